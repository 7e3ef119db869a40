#!/usr/bin/python3
"""Writes the torch fixtures that tests/unit/pickle_test.cc checks.

Usage: /usr/bin/python3 make_torch_pickles.py [OUTDIR]   (Debian's torch 1.13; default OUTDIR is
the folder this script lives in)

Outputs:
  torch_state_dict.pkl    data.pkl extracted from torch.save() of a small state dict: float32,
                          bfloat16, int64 and bool tensors, a view and a transpose sharing the
                          float32 storage (offset/stride), a 0-d float64 tensor, a Parameter,
                          inside an OrderedDict carrying _metadata (BUILD state).
  torch_state_dict.json   the expected tensor attributes, per state-dict key: storage key,
                          dtype, storage offset, shape, stride (elements), storage numel and
                          class, requires_grad, is_parameter.
  torch_state_dict.pt     that state dict as torch.save writes it (a zip), and
  torch_legacy.pt         as torch's legacy format writes it (_use_new_zipfile_serialization=False:
                          no zip, five pickles, then each storage's element count and bytes):
                          tests/unit/torch_file_test.cc reads both and compares every tensor.
  dcp113.metadata         the .metadata pickle of a real 2-rank gloo DCP save
                          (torch.distributed._shard.checkpoint, protocol 4) of build_dcp_state:
                          two ShardedTensors split by rows, plain tensors and
                          plain values (smaller than e2e/fixtures/gen_dcp113_llama.py).
Everything is deterministic except dcp113.metadata's memo numbering, which is stable for a given
torch/Python pair.
"""
import collections
import dataclasses as _dc
import io
import json
import os
import pickle
import sys
import tempfile
import zipfile

# --- Python 3.11 + torch 1.13 workaround -------------------------------------------------
# torch 1.13's ShardedTensorMetadata uses `field(default=TensorProperties())`; Python >= 3.11
# rejects unhashable dataclass defaults. Make TensorProperties hashable (unsafe_hash) before
# torch.distributed._shard is imported. Pickled module/class names and state do not change.
_orig_dataclass = _dc.dataclass


def _patched_dataclass(cls=None, /, **kw):
    def wrap(c):
        if c.__name__ == "TensorProperties":
            kw.setdefault("unsafe_hash", True)
        return _orig_dataclass(c, **kw)
    return wrap if cls is None else wrap(cls)


_dc.dataclass = _patched_dataclass
# ------------------------------------------------------------------------------------------
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int64: "int64",
               torch.bool: "bool", torch.float64: "float64"}


def state_dict():
    torch.manual_seed(0)
    sd = collections.OrderedDict()
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sd["f32"] = base
    sd["bf16"] = (torch.arange(6, dtype=torch.float32) / 3).to(torch.bfloat16)
    sd["i64"] = torch.arange(5, dtype=torch.int64) - 2
    sd["bool"] = torch.tensor([True, False, True])
    sd["view"] = base[1:, 1:3]          # offset 5, shape (2, 2), stride (4, 1)
    sd["transposed"] = base.t()         # shape (4, 3), stride (1, 4)
    sd["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    sd["param"] = torch.nn.Parameter(torch.ones(2, 2))
    sd._metadata = collections.OrderedDict([("", {"version": 1}), ("sub", {"version": 2})])
    return sd


def write_state_dict(outdir):
    sd = state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        names = z.namelist()
        prefix = names[0].split("/", 1)[0]
        data_pkl = z.read(f"{prefix}/data.pkl")
        records = {n[len(prefix) + 1:]: len(z.read(n)) for n in names}
    with open(os.path.join(outdir, "torch_state_dict.pkl"), "wb") as f:
        f.write(data_pkl)

    # torch 1.13 numbers storages "0", "1", ... in first-use order, i.e. state-dict order.
    keys = {}
    expected = collections.OrderedDict()
    for name, t in sd.items():
        storage = t.storage()
        key = keys.setdefault(storage.data_ptr(), str(len(keys)))
        expected[name] = {
            "storage_key": key,
            "storage_numel": storage.size(),
            "dtype": DTYPE_NAMES[t.dtype],
            "storage_offset": t.storage_offset(),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "requires_grad": bool(t.requires_grad),
            "is_parameter": isinstance(t, torch.nn.Parameter),
        }
        # The record for the key holds exactly numel elements.
        assert records[f"data/{key}"] == storage.size() * t.element_size(), name

    # Take the storage class from the pickle itself (a non-executing unpickler) and
    # cross-check the keys and numels against it.
    seen = []

    class Ref:
        def __init__(self, module, name):
            self.qualname = f"{module}.{name}"

        def __call__(self, *args, **kwargs):
            return None

    class Probe(pickle.Unpickler):
        def persistent_load(self, pid):
            seen.append((pid[1].qualname, pid[2], pid[4]))
            return None

        def find_class(self, module, name):
            if module == "collections":
                return getattr(collections, name)
            return Ref(module, name)

    Probe(io.BytesIO(data_pkl)).load()
    assert [s[1] for s in seen] == [e["storage_key"] for e in expected.values()], seen
    for (cls, _, numel), e in zip(seen, expected.values()):
        assert numel == e["storage_numel"], (numel, e)
        e["storage_class"] = cls

    with open(os.path.join(outdir, "torch_state_dict.json"), "w") as f:
        json.dump({"tensors": expected}, f, indent=1)
        f.write("\n")


# ---- DCP (two gloo ranks on CPU) ----

def build_dcp_state(rank):
    from torch.distributed._shard.sharded_tensor import init_from_local_shards, Shard, ShardMetadata
    full_w = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)       # rows 2 + 2
    full_e = (torch.arange(5 * 2, dtype=torch.float32).reshape(5, 2) / 7).to(torch.bfloat16)

    def st(full, offs_sizes, dim):
        o, s = offs_sizes[rank]
        local = full.narrow(dim, o, s).contiguous()
        offsets = [0] * full.dim()
        offsets[dim] = o
        sizes = list(full.shape)
        sizes[dim] = s
        md = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{rank}/cpu")
        return init_from_local_shards([Shard(local, md)], list(full.shape))

    return {
        "model.w": st(full_w, [(0, 2), (2, 2)], 0),
        "model.emb": st(full_e, [(0, 3), (3, 2)], 0),
        "model.bias": torch.linspace(-1, 1, 3),
        "model.scalar": torch.tensor(2.5, dtype=torch.float64),
        "step": 42,
        "meta": {"epoch": 3, "names": ["a", "b"]},
    }


def dcp_worker(rank, world, ckpt, initfile):
    dist.init_process_group("gloo", init_method=f"file://{initfile}", rank=rank, world_size=world)
    from torch.distributed._shard.checkpoint import save_state_dict, FileSystemWriter
    save_state_dict(build_dcp_state(rank),
                    storage_writer=FileSystemWriter(ckpt, single_file_per_rank=True))
    dist.barrier()
    dist.destroy_process_group()


def write_dcp(outdir):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        initfile = os.path.join(tmp, "gloo_init")
        mp.spawn(dcp_worker, args=(2, ckpt, initfile), nprocs=2, join=True)
        with open(os.path.join(ckpt, ".metadata"), "rb") as f:
            data = f.read()
    with open(os.path.join(outdir, "dcp113.metadata"), "wb") as f:
        f.write(data)


def write_legacy(outdir):
    sd = state_dict()
    torch.save(sd, os.path.join(outdir, "torch_state_dict.pt"))
    torch.save(sd, os.path.join(outdir, "torch_legacy.pt"), _use_new_zipfile_serialization=False)


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    os.makedirs(outdir, exist_ok=True)
    write_state_dict(outdir)
    write_legacy(outdir)
    write_dcp(outdir)
    print("wrote", outdir, sorted(os.listdir(outdir)))


if __name__ == "__main__":
    main()
