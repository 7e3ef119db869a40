"""``ucpfs.torch.StorageReader``: ``torch.distributed.checkpoint.load`` from any source ucpfs reads.

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import ucpfs.torch

    model_sd, optim_sd = get_state_dict(model, optimizer)     # an FSDP2 or DTensor TP model
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=ucpfs.torch.StorageReader("/ckpt/global_step100"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

The checkpoint (DeepSpeed, Megatron, Hugging Face, DCP: whatever ``ucpfs mount`` reads) is
described to DCP as if it had been saved from ``get_state_dict`` of the unsharded model:

- ``model.<fqn>``: each parameter as one tensor of its global shape (the fp32 master where the
  source has one, as ``atomic/<fqn>/fp32.pt``, else the weight in its stored dtype);
- ``optim.state.<fqn>.exp_avg``, ``.exp_avg_sq`` (Adam's moments, as stored) and ``.step`` (a
  0-d float32 tensor, as torch's Adam keeps it);
- ``optim.param_groups.<g>.<field>`` (the source's hyper-parameters, each group's ``params`` and
  ``param_names`` the fqns of its parameters) and a model's non-tensor values (Megatron-Core's
  ``_extra_state``) as bytes items.

``<fqn>`` is the source's parameter name as ``atomic/`` lists it (after ``rules``), passed
through ``rename`` when given. Each tensor is one chunk of its whole shape; a rank's ReadItems
are boxes of it, and each box is read from the source alone (``_core.Tensors.read_box``: the
slice machinery of the views), so a rank reads about its share of the checkpoint, never whole
tensors. ``bytes_read`` counts what this reader read from the source files.

Not for: writing; a key the state has and the source lacks (a group field the source's optimizer
did not have; Megatron-Core GPTModel's ``_extra_state``): DCP then reports ``Missing key``; drop
it from the state, or load with ``DefaultLoadPlanner(allow_partial_load=True)``.
Needs torch >= 2.4 (tested with 2.13); the rest of ucpfs does not need torch.
"""

import io
import json
import os
import uuid
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import StorageReader as _StorageReader
from torch.futures import Future

from . import _core
from . import views as _views

# Group fields that name the parameters: the reader writes its own (fqns).
_PARAM_FIELDS = ("params", "param_names")


class StorageReader(_StorageReader):
    """A ``torch.distributed.checkpoint`` StorageReader over the checkpoint ``src`` (a directory).

    ``model_key``, ``optim_key``: the top-level keys of the state passed to ``dcp.load`` (its
    model and optimizer state dicts, as ``get_state_dict`` makes them). ``rename``: a dict or a
    callable from the source's parameter names to the model's fqns (e.g. dropping a prefix).
    ``rules``: a key-rules file (``ucpfs mount --rules``). ``index_dir``, ``read_only_index``: as
    ``ucpfs.open``."""

    def __init__(self, src, *, model_key="model", optim_key="optim", rename=None, rules=None,
                 index_dir=None, read_only_index=False):
        super().__init__()
        self.src = os.fspath(src)
        self.model_key = model_key
        self.optim_key = optim_key
        self._rename = rename
        self._open_args = dict(index_dir=index_dir, read_only_index=read_only_index, rules=rules)
        self._tensors = None
        self._session = None
        self._items = None
        self.bytes_read = 0      # bytes this reader read from the source files (read_data)
        self.payload_bytes = 0   # bytes of tensor data it returned
        self.warnings = []

    # -- the checkpoint, described --
    def _name(self, name):
        if self._rename is None:
            return name
        if callable(self._rename):
            return self._rename(name)
        return self._rename.get(name, name)

    def _open(self):
        if self._tensors is None:
            views = _views.open(self.src, **self._open_args)
            self._session = views._session
            self._tensors = _core.Tensors(self._session)
        return self._tensors

    def _describe(self):
        """{DCP key: ("tensor", param index, state, dtype, shape) | ("step", index, step shape or
        None, value) | ("bytes", value)}, in the source's parameter order."""
        tensors = self._open()
        params = tensors.params()
        items = {}
        model, optim = self.model_key, self.optim_key
        groups = {}  # source group -> [hyper, [fqn]], in order of their first parameter
        for i, p in enumerate(params):
            fqn = self._name(p["name"])
            states = p["states"]
            if p["in_model"]:
                state = "fp32" if "fp32" in states else "weight" if "weight" in states else None
                if state is not None:
                    items[f"{model}.{fqn}"] = ("tensor", i, state, states[state], tuple(p["shape"]))
                parent = fqn.rsplit(".", 1)[0] + "." if "." in fqn else ""
                for name, value in p["model_siblings"]:
                    items[f"{model}.{parent}{name}"] = ("bytes", value)
            if not p["in_optimizer"]:
                continue
            for state in ("exp_avg", "exp_avg_sq"):
                if state in states:
                    items[f"{optim}.state.{fqn}.{state}"] = ("tensor", i, state, states[state], tuple(p["shape"]))
            if "step" in states or p["step_value"] is not None:
                items[f"{optim}.state.{fqn}.step"] = ("step", i, p["step_value"])
            if p["hyper"] or p["group"] >= 0:
                group = groups.setdefault(p["group"], [p["hyper"], []])
                group[1].append(fqn)
        for g, (hyper, fqns) in enumerate(groups.values()):
            for field, value in hyper:
                if field not in _PARAM_FIELDS:
                    items[f"{optim}.param_groups.{g}.{field}"] = ("bytes", value)
            items[f"{optim}.param_groups.{g}.params"] = ("bytes", list(fqns))
            # An optimizer built from named parameters (torch >= 2.6; torchtitan's) keeps their
            # names in each group too, and its state_dict asks for them.
            items[f"{optim}.param_groups.{g}.param_names"] = ("bytes", list(fqns))
        self.warnings = list(tensors.warnings)
        return items

    # -- StorageReader --
    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.src = os.fspath(checkpoint_id)
            self._tensors = self._session = None
        self._items = None

    def read_metadata(self, *args, **kwargs):
        self._items = self._describe()
        md = {}
        for key, item in self._items.items():
            if item[0] == "tensor":
                shape = torch.Size(item[4])
                md[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=getattr(torch, item[3])), size=shape,
                    chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)])
            elif item[0] == "step":
                md[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([]),
                                                chunks=[ChunkStorageMetadata(offsets=torch.Size([]),
                                                                             sizes=torch.Size([]))])
            else:
                md[key] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md,
                        storage_meta=StorageMeta(checkpoint_id=self.src, load_id=uuid.uuid4().hex))

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        if self._items is None:
            self._items = self._describe()

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def _read(self, index, state, offsets, sizes, dtype):
        """The box (offsets, sizes) of a parameter's state, read from the source, as a tensor."""
        torch_dtype = getattr(torch, dtype)
        n = 1
        for s in sizes:
            n *= s
        if n == 0:
            return torch.empty(sizes, dtype=torch_dtype)
        raw = bytearray(n * torch_dtype.itemsize)
        self._tensors.read_box(index, state, list(offsets), list(sizes), dtype, raw)
        self.payload_bytes += len(raw)
        return torch.frombuffer(raw, dtype=torch_dtype).reshape(sizes)

    def read_data(self, plan, planner):
        tensors = self._open()
        before = self._session.source_bytes_read
        for req in plan.items:
            key = req.storage_index.fqn
            item = self._items.get(key)
            if item is None:
                raise KeyError(f"{self.src}: {key}: not in the checkpoint as ucpfs describes it")
            if req.type == LoadItemType.BYTE_IO:
                if item[0] != "bytes":
                    raise TypeError(f"{self.src}: {key} is a tensor, asked for as bytes")
                buf = io.BytesIO()
                torch.save(item[1], buf)
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            if item[0] == "tensor":
                chunk = req.storage_index.offset or torch.Size([0] * len(req.lengths))
                offsets = [int(c) + int(o) for c, o in zip(chunk, req.storage_offsets)]
                value = self._read(item[1], item[2], offsets, [int(s) for s in req.lengths], item[3])
            elif item[0] == "step":
                if item[2] is not None:
                    value = torch.tensor(item[2], dtype=torch.float32)
                else:
                    shape = tensors.step_shape(item[1])
                    value = self._read(item[1], "step", [0] * len(shape), shape, "float32").reshape(())
            else:
                raise TypeError(f"{self.src}: {key} is bytes, asked for as a tensor")
            target = planner.resolve_tensor(req).detach()
            if target.size() != value.size():
                raise ValueError(f"{self.src}: {key}: read {tuple(value.size())}, the state holds "
                                 f"{tuple(target.size())}")
            target.copy_(value)
            planner.commit_tensor(req, target)
        self.bytes_read += self._session.source_bytes_read - before
        fut = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return os.path.isdir(os.fspath(checkpoint_id))

    @property
    def checkpoint_id(self):
        return self.src


# safetensors' dtype names.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}
# A safetensors header larger than this is refused (the views' are a few KiB per shard; safetensors
# itself refuses more than 100 MB).
_MAX_SAFETENSORS_HEADER_N_BYTES = 100_000_000


class LazyStateDict(Mapping):
    """The tensors of a folder of safetensors files of the views (``ucpfs.open(SRC).hf``,
    ``.safetensors``), as a read-only mapping from name to tensor that reads a tensor's bytes
    only when it is asked for (the shards' headers are read at once):

        sd = ucpfs.torch.LazyStateDict(ucpfs.open(SRC).hf)
        model = AutoModelForCausalLM.from_pretrained(None, config=config, state_dict=sd)

    Each value is a new CPU tensor (its own memory); nothing is written to disk.
    Errors: OSError naming the file (a header that is not safetensors' is EINVAL)."""

    def __init__(self, folder):
        self._dir = folder
        self._where = {}  # name -> (shard, dtype, shape, begin byte, end byte)
        self._files = {}  # shard -> its open ViewFile
        for shard in sorted(n for n in folder.listdir() if n.endswith(".safetensors")):
            with folder.open(shard) as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 0 <= n <= _MAX_SAFETENSORS_HEADER_N_BYTES:
                    raise OSError(22, f"{folder.path}/{shard}: not a safetensors file (header size {n})")
                try:
                    header = json.loads(f.read(n))
                    for name, meta in header.items():
                        if name == "__metadata__":
                            continue
                        begin, end = meta["data_offsets"]
                        self._where[name] = (shard, _SAFETENSORS_DTYPES[meta["dtype"]], tuple(meta["shape"]),
                                             8 + n + begin, 8 + n + end)
                except (ValueError, KeyError, TypeError) as e:
                    raise OSError(22, f"{folder.path}/{shard}: a bad safetensors header ({e!r})") from None

    def __getitem__(self, name):
        shard, dtype, shape, begin, end = self._where[name]
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = self._dir.open(shard, buffering=0)
        buf = bytearray(end - begin)
        done = 0
        f.seek(begin)
        while done < len(buf):
            n = f.readinto(memoryview(buf)[done:])
            if not n:
                raise OSError(5, f"{self._dir.path}/{shard}: {name} ends past the end of the file")
            done += n
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()
