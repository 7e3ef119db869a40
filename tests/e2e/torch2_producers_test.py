"""End-to-end: checkpoints written by real torch 2.13 producers, mounted on a new layout.

Fixtures (fixtures/gen_torch2.py, the tiny Llama of gen_llama_train.py trained with Adam and a
LambdaLR, saved the torchtitan way: get_model_state_dict, get_optimizer_state_dict, train_state,
lr_scheduler, per-DP-rank dataloader bytes, python and numpy RNG states):
  fsdp2 (2 ranks: step tensor, int; 3 ranks, uneven shards: step float), tp (2-D dp2 x tp2 mesh
  with FSDP2: step tensor; 1-D tp2: step int), async_save (tensor, int), rank-local metadata
  from use_collectives=False (tensor, int).
Each is mounted once with three layouts different from the one it was saved with, and:
 1. every atomic/*/*.pt and every target rank file (model.pt, optim.pt, extra_state.pt) loads with
    torch.load's defaults (weights_only=True), with mmap=True (same content), and
    get_unsafe_globals_in_checkpoint is []; atomic files equal the full saved tensors, model.pt and
    optim.pt moments equal reference slices of them (torchtitan TP plan, pipeline split; the
    slicer of target_views_test.py), bit for bit; model.pt is in the model's parameter order;
    optim.pt is {'state': {i: {step, exp_avg, exp_avg_sq}}, 'param_groups': [...]} with 'step' a
    0-d float32 tensor holding the saved value whatever type was saved, and every saved
    param_groups field (lr, betas, ..., decoupled_weight_decay, initial_lr) carried;
 2. resume: target/tp1_pp1_dp1/rank_0 model.pt and optim.pt loaded into a fresh Llama and a fresh
    torch.optim.Adam (default hyper-parameters, parameters in model.pt order) train 3 more steps
    with losses equal bit for bit (float.hex) to the generator's continuation; for 2-rank
    data-parallel fixtures that continuation is also the uninterrupted distributed run's. Not
    vacuous: no optimizer state, step + 1, or a fresh Adam's hyper-parameters give other losses;
 3. oracle: torch's own DCP resharding (dcp.load of the source into get_model_state_dict /
    get_optimizer_state_dict templates of a plain model for TP 1, of a TP-2 parallelized model in
    2 gloo processes for TP 2; rank-local sources through a reader that unions the __<r>.metadata
    files) gives exactly the tensors, steps and param groups of every rank's model.pt and optim.pt;
 4. non-tensor items (the contract): extra_state.pt is the dict {key: saved value} of every
    non-tensor item that is not an optimizer step or param_groups field, in checkpoint order,
    values equal and of the same types; dp_rank_<d> items only on ranks with dp coordinate d,
    and only when the source has exactly D of them; items weights_only cannot load (the numpy RNG
    state) never. ucp_info.json's "extra_state" lists the served keys and "not_served" exactly the
    others, with reasons; .ucpfs/status.json and `ucpfs inspect --json` list the unloadable ones.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/torch2_producers_test.py
`--self-check` validates this test without ucpfs: it writes the views the contract describes,
computed here from the truth, checks that everything passes on them, and that deliberately wrong
views (model.pt out of order, an int step, a moment 1 ulp off, a doubled lr, a list for a
tuple) fail.
"""
import collections
import io
import json
import os
import re
import sys
import time

import torch

from e2e_common import Results, run, seeded_rng, tmpdir, ucpfs_bin
from mount_common import FIXTURES, PY, expected_atomic, gen_fixture, mounted, status, step_equal

sys.path.insert(0, FIXTURES)
import gen_llama_train as gen  # noqa: E402  (Llama, batch, train_step)
import gen_torch2 as g2  # noqa: E402  (tp_plan, make_optimizer)
from rendezvous import TcpRendezvous, rank_env  # noqa: E402
from target_views_test import coords, expect_failure, n_ranks, parse_layout, stage_of, tp_slice  # noqa: E402

NAME = "e2e_torch2_producers"
# (label, mode, ranks, step type)
SPECS = [("fsdp2_tensor", "fsdp2", 2, "tensor"), ("fsdp2_int", "fsdp2", 2, "int"),
         ("fsdp2_r3_float", "fsdp2", 3, "float"), ("tp2d_tensor", "tp", 4, "tensor"),
         ("tp1d_int", "tp", 2, "int"), ("async_tensor", "async", 2, "tensor"),
         ("async_int", "async", 2, "int"), ("ranklocal_tensor", "ranklocal", 2, "tensor"),
         ("ranklocal_int", "ranklocal", 2, "int")]
CANDIDATE_LAYOUTS = ["tp1_pp1_dp1", "tp2_pp1_dp2", "tp2_pp2_dp1", "tp1_pp2_dp2"]
RANK_FILES = ["extra_state.pt", "model.pt", "model.safetensors", "optim.pt", "ucp_info.json"]
STEP_RE = re.compile(r"optimizer\.state\..+\.step")
GROUP_RE = re.compile(r"optim(izer)?\.param_groups\..+")
DP_RANK_RE = re.compile(r"dp_rank_(\d+)")


class Fixture:
    def __init__(self, label, mode, ranks, step_type, src, stem):
        self.label, self.mode, self.ranks, self.step_type, self.src = label, mode, ranks, step_type, src
        self.truth = torch.load(stem + ".pt")
        self.objects = torch.load(stem + "_objects.pt", weights_only=False)  # holds a numpy array
        self.info = json.load(open(stem + "_resume.json"))
        mesh = self.info["mesh"]
        saved = f"tp{mesh['tp']}_pp1_dp{mesh['dp']}"
        self.layouts = [x for x in CANDIDATE_LAYOUTS if x != saved][:3]
        self.names = self.info["param_order"]
        self.group = {k.rsplit(".", 1)[1]: v for k, v in self.objects.items()
                      if k.startswith("optimizer.param_groups.0.") and not k.endswith(".params")}
        self.loadable = {k: weights_only_loadable(v) for k, v in self.objects.items()}
        self.saved_order = saved_order(src)


# ---------------------------------------------------------------- comparing loaded objects

def same_value(a, b, what):
    """Equal content and types: tensors bit for bit, containers element by element."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), f"{what}: {type(a).__name__}, want a tensor"
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), \
            f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        x, y = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
        if x.dtype.is_floating_point and x.element_size() == 4:
            x, y = x.view(torch.int32), y.view(torch.int32)
        assert torch.equal(x, y), f"{what}: values differ"
        return
    assert type(a) is type(b), f"{what}: {type(a).__name__} {a!r:.80}, want {type(b).__name__} {b!r:.80}"
    if isinstance(b, dict):
        assert list(a) == list(b), f"{what}: keys {list(a)} != {list(b)}"
        for k in b:
            same_value(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{what}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same_value(x, y, f"{what}[{i}]")
    elif isinstance(b, float):
        assert a.hex() == b.hex(), f"{what}: {a!r} != {b!r}"
    else:
        assert a == b, f"{what}: {a!r:.80} != {b!r:.80}"


def load_checked(path):
    """torch.load with torch 2.13's defaults (weights_only=True); the same with mmap=True; and no
    global outside the weights_only allow-list."""
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    assert unsafe == [], f"{path}: unsafe globals {unsafe}"
    obj = torch.load(path)
    mm = torch.load(path, mmap=True)
    same_value(mm, obj, f"{path} (mmap=True)")
    del mm  # unmaps: nothing may keep the mount busy at unmount
    return obj


def weights_only_loadable(value):
    """Whether torch.load(weights_only=True) can load a torch.save of value."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
        return True
    except Exception:  # noqa: BLE001 - any refusal means "cannot be represented"
        return False


# ---------------------------------------------------------------- the contract for non-tensor items

def extra_candidates(fx):
    """Non-tensor items that are neither an optimizer step nor a param_groups field, in order."""
    return [k for k in fx.objects if not STEP_RE.fullmatch(k) and not GROUP_RE.fullmatch(k)]


def rank_local(key):
    """(prefix, d) for a key with a dp_rank_<d> component, else None."""
    parts = key.split(".")
    for i, p in enumerate(parts):
        m = DP_RANK_RE.fullmatch(p)
        if m:
            return ".".join(parts[:i]), int(m[1])
    return None


def saved_order(src):
    """Keys in the order of the state dict that was saved: DCP's planner_data (the saving
    state dict's flattened keys, in order), the first metadata file's first for rank-local
    checkpoints. state_dict_metadata's own order follows the deduplicated save plans instead."""
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
    reader = FileSystemReader(src)
    if os.path.exists(os.path.join(src, ".metadata")):
        mds = [reader.read_metadata()]
    else:
        ranks = sorted(int(m[1]) for m in (re.fullmatch(r"__(\d+)\.metadata", n) for n in os.listdir(src)) if m)
        mds = [reader.read_metadata(rank=r) for r in ranks]
    order = {}
    for md in mds:
        order.update(dict.fromkeys(k for k in (md.planner_data or {}) if k not in order))
    return list(order)


def expected_extra(fx, lay, rank):
    """(OrderedDict served to this rank, set of keys not served on this layout). Keys come in the
    saved state dict's order; a rank's own dp_rank_<d> item takes the place of its group's
    first item (the place it had in that rank's state dict)."""
    pos = {k: i for i, k in enumerate(fx.saved_order)}
    cands = sorted(extra_candidates(fx), key=lambda k: pos.get(k, len(pos)))
    groups = collections.Counter(rank_local(k)[0] for k in cands if rank_local(k))
    served, not_served, placed = collections.OrderedDict(), set(), set()
    dp = coords(lay, rank)["dp"]
    for k in cands:
        rl = rank_local(k)
        if rl and groups[rl[0]] == lay["D"]:
            if rl[0] in placed:
                continue
            placed.add(rl[0])
            k = next(c for c in cands if rank_local(c) == (rl[0], dp))
        if not fx.loadable[k]:
            not_served.add(k)
            continue
        rl = rank_local(k)
        if rl and groups[rl[0]] != lay["D"]:
            not_served.add(k)
        elif not rl or rl[1] == dp:
            served[k] = fx.objects[k]
    return served, not_served


def unloadable(fx):
    return {k for k in extra_candidates(fx) if not fx.loadable[k]}


def check_not_served_list(entries, must, fx, what):
    assert isinstance(entries, list), f"{what}: not_served is {type(entries).__name__}"
    keys = []
    for e in entries:
        assert isinstance(e, dict) and isinstance(e.get("reason"), str) and e["reason"].strip(), \
            f"{what}: entry without a reason: {e}"
        keys.append(e.get("key"))
    assert not set(must) - set(keys), f"{what}: not_served lacks {sorted(set(must) - set(keys))}"
    bogus = set(keys) - set(extra_candidates(fx))
    assert not bogus, f"{what}: not_served lists items that are not non-tensor extras: {sorted(bogus)}"
    return set(keys)


# ---------------------------------------------------------------- the rank files against the truth

def check_listing(mnt, fx, lay_name):
    lay = parse_layout(lay_name)
    root = os.path.join(mnt, "target", lay_name)
    ranks = sorted(os.listdir(root))
    assert ranks == sorted(f"rank_{r}" for r in range(n_ranks(lay))), f"{lay_name}: {ranks}"
    for r in ranks:
        got = sorted(os.listdir(os.path.join(root, r)))
        assert got == RANK_FILES, f"{lay_name}/{r}: {got} != {RANK_FILES}"


def check_atomic(mnt, fx):
    want = expected_atomic(fx.truth)
    got = sorted(os.listdir(os.path.join(mnt, "atomic")))
    assert got == sorted(want), f"atomic/: {got} != {sorted(want)}"
    for param, files in want.items():
        d = os.path.join(mnt, "atomic", param)
        if "step.pt" not in files and fx.step_type == "int":
            files = dict(files, **{"step.pt": fx.info["steps"]})  # the Python int step, as saved
        assert sorted(os.listdir(d)) == sorted(files), f"{param}: {os.listdir(d)}"
        for name, t in files.items():
            obj = load_checked(os.path.join(d, name))
            if name == "step.pt":
                step_equal(obj, t, f"atomic/{param}/{name}")
                continue
            assert isinstance(obj, dict) and list(obj)[-1] == "param", f"{param}/{name}: {list(obj)}"
            same_value(obj["param"], t, f"atomic/{param}/{name}")


def stage_names(fx, lay, rank):
    return [n for n in fx.names if stage_of(n, lay["P"]) == coords(lay, rank)["pp"]]


def check_model(path, fx, lay, rank):
    m = load_checked(path)
    assert type(m) is collections.OrderedDict, f"model.pt is {type(m).__name__}"
    want = stage_names(fx, lay, rank)
    assert sorted(m) == sorted(want), f"model.pt keys {list(m)} != {want}"
    tp = coords(lay, rank)["tp"]
    for n in want:
        same_value(m[n], tp_slice(fx.truth[f"model.{n}"], n, lay["T"], tp), f"model.pt[{n}]")
    return list(m)


def check_model_order(path, fx, lay, rank):
    keys = list(torch.load(path))
    want = stage_names(fx, lay, rank)
    assert keys == want, f"model.pt order {keys} != the model's parameter order {want}"


def check_group(g, fx, keys, what):
    assert isinstance(g, dict), f"{what}: param group is {type(g).__name__}"
    for f, want in fx.group.items():
        assert f in g, f"{what}: param group lacks {f!r} (has {sorted(g)})"
        got = tuple(g[f]) if f == "betas" and isinstance(g[f], list) else g[f]
        same_value(got, want, f"{what}: {f}")
    assert g.get("params") == list(range(len(keys))), f"{what}: params {g.get('params')}"
    if "param_names" in g:
        assert list(g["param_names"]) == keys, f"{what}: param_names {g['param_names']} != {keys}"


def check_step(v, k, what):
    assert isinstance(v, torch.Tensor), f"{what}: step is {type(v).__name__} {v!r}, want a tensor"
    assert v.dtype == torch.float32 and v.dim() == 0, f"{what}: step {v.dtype} {tuple(v.shape)}"
    assert v.item() == float(k), f"{what}: step {v.item()} != {k}"


def check_optim(path, fx, lay, rank, keys):
    """Structure and moments; the step and the param group are checked on their own."""
    o = load_checked(path)
    assert isinstance(o, dict) and sorted(o) == ["param_groups", "state"], f"optim.pt keys {sorted(o)}"
    st = o["state"]
    assert sorted(st) == list(range(len(keys))) and all(type(i) is int for i in st), \
        f"state indices {sorted(st)}"
    tp = coords(lay, rank)["tp"]
    for i, n in enumerate(keys):
        assert {"exp_avg", "exp_avg_sq"} <= set(st[i]) <= {"exp_avg", "exp_avg_sq", "step"}, \
            f"state[{i}] ({n}): {sorted(st[i])}"  # 'step' has a check of its own
        for s in ("exp_avg", "exp_avg_sq"):
            same_value(st[i][s], tp_slice(fx.truth[f"optimizer.state.{n}.{s}"], n, lay["T"], tp),
                       f"state[{i}].{s} ({n})")
    assert isinstance(o["param_groups"], list) and len(o["param_groups"]) == 1, \
        f"param_groups {o['param_groups']!r:.200}"


def check_optim_step(path, fx):
    st = torch.load(path)["state"]
    for i in sorted(st):
        check_step(st[i].get("step"), fx.info["steps"], f"state[{i}]")


def check_optim_group(path, fx, keys):
    check_group(torch.load(path)["param_groups"][0], fx, keys, "optim.pt")


def check_extra(d, fx, lay, rank):
    served, not_served = expected_extra(fx, lay, rank)
    got = load_checked(os.path.join(d, "extra_state.pt"))
    assert isinstance(got, dict), f"extra_state.pt is {type(got).__name__}"
    assert list(got) == list(served), f"extra_state.pt keys {list(got)} != {list(served)}"
    for k, v in served.items():
        same_value(got[k], v, f"extra_state.pt[{k}]")
    info = json.load(open(os.path.join(d, "ucp_info.json")))
    assert info.get("extra_state") == list(served), \
        f"ucp_info.json extra_state {info.get('extra_state')} != {list(served)}"
    keys = check_not_served_list(info.get("not_served"), not_served, fx, "ucp_info.json")
    assert keys == not_served, f"ucp_info.json not_served {sorted(keys)} != {sorted(not_served)}"


# ---------------------------------------------------------------- resume

def resume(d, fx, tamper=None):
    """Losses of 3 steps after loading d/model.pt and d/optim.pt into a fresh Llama and a fresh
    Adam (torch defaults; load_state_dict brings the hyper-parameters)."""
    torch.set_num_threads(1)
    sd = torch.load(os.path.join(d, "model.pt"))
    model = gen.Llama()
    model.load_state_dict(sd)
    params = dict(model.named_parameters())
    opt = torch.optim.Adam([params[n] for n in sd])
    o = torch.load(os.path.join(d, "optim.pt"))
    if tamper == "step":
        for s in o["state"].values():
            s["step"] = s["step"] + 1
    if tamper == "defaults":  # keep the moments, drop the saved hyper-parameters
        o["param_groups"] = [dict(opt.state_dict()["param_groups"][0])]
    if tamper != "no_optim":
        opt.load_state_dict(o)
    k = fx.info["steps"]
    return [float(gen.train_step(model, opt, gen.batch(fx.info["seed"], k + j))).hex()
            for j in range(fx.info["continue_steps"])]


def check_resume(mnt, fx):
    got = resume(os.path.join(mnt, "target", "tp1_pp1_dp1", "rank_0"), fx)
    assert got == fx.info["continue_losses"], f"losses {got} != {fx.info['continue_losses']}"


def check_resume_sensitive(mnt, fx):
    d = os.path.join(mnt, "target", "tp1_pp1_dp1", "rank_0")
    for tamper in ("no_optim", "step", "defaults"):
        assert resume(d, fx, tamper) != fx.info["continue_losses"], f"'{tamper}' still resumes bit for bit"


# ---------------------------------------------------------------- oracle: torch's own resharding

def merged_reader(src):
    """A FileSystemReader of src; for rank-local metadata (__<r>.metadata, no .metadata), it
    returns the union of the ranks' metadata, which torch's loader would otherwise only use to
    resume on the very same ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None or os.path.exists(os.path.join(src, ".metadata")):
                return super().read_metadata(*args, **kwargs)
            merged, r = None, 0
            while os.path.exists(os.path.join(src, f"__{r}.metadata")):
                md = super().read_metadata(rank=r)
                if merged is None:
                    merged = md
                else:
                    for k, v in md.state_dict_metadata.items():
                        have = merged.state_dict_metadata.setdefault(k, v)
                        if have is not v and isinstance(v, TensorStorageMetadata):
                            offs = {tuple(c.offsets) for c in have.chunks}
                            have.chunks.extend(c for c in v.chunks if tuple(c.offsets) not in offs)
                    for k, v in md.storage_data.items():
                        merged.storage_data.setdefault(k, v)
                r += 1
            return merged
    return Reader(src)


def oracle_state(model, opt, reader):
    """dcp.load of the source into the torchtitan-style templates of `model`; returns
    {"model": {fqn: local tensor}, "state": {fqn: {...}}, "param_groups": [...]}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    md = reader.read_metadata()
    osd = get_optimizer_state_dict(model, opt)
    for fqn, st in osd["state"].items():  # a step saved as int/float is a BYTE_IO item
        if isinstance(md.state_dict_metadata.get(f"optimizer.state.{fqn}.step"), BytesStorageMetadata):
            st["step"] = 0
    sd = {"model": get_model_state_dict(model), "optimizer": osd}
    dcp.load(sd, storage_reader=reader)

    def local(t):
        return t.to_local().clone() if hasattr(t, "to_local") else (t.clone() if isinstance(t, torch.Tensor) else t)
    return {"model": {k: local(v) for k, v in sd["model"].items()},
            "state": {f: {k: local(v) for k, v in st.items()} for f, st in osd["state"].items()},
            "param_groups": osd["param_groups"]}


def oracle_tp1(src, steps):
    model = gen.Llama()
    opt, _ = g2.make_optimizer(model, steps)
    return oracle_state(model, opt, merged_reader(src))


def oracle_tp2_worker(rank, port, jobs, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    rank_env(rank, 2, port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    got = {}
    for label, src, steps in jobs:
        model = gen.Llama()
        g2.apply_tp(model, mesh)
        opt, _ = g2.make_optimizer(model, steps)
        got[label] = oracle_state(model, opt, merged_reader(src))
    torch.save(got, os.path.join(out, f"oracle_tp2_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def oracle_tp2_main(jobs_json, out):
    import torch.multiprocessing as mp
    with TcpRendezvous() as rdzv:
        mp.spawn(oracle_tp2_worker, args=(rdzv.port, json.load(open(jobs_json)), out), nprocs=2, join=True)


def oracle_rank(oracles, lay, r):
    c = coords(lay, r)
    return oracles[c["tp"]] if lay["T"] == 2 else oracles[0]


def check_oracle_tensors(mnt, lay_name, oracles):
    lay = parse_layout(lay_name)
    for r in range(n_ranks(lay)):
        ora, pp = oracle_rank(oracles, lay, r), coords(lay, r)["pp"]
        d = os.path.join(mnt, "target", lay_name, f"rank_{r}")
        m = torch.load(os.path.join(d, "model.pt"))
        want = [n for n in ora["model"] if stage_of(n, lay["P"]) == pp]
        assert sorted(m) == sorted(want), f"rank_{r}: model.pt keys {list(m)} != dcp.load's {want}"
        for n in want:
            same_value(m[n], ora["model"][n], f"rank_{r} model.pt[{n}] vs dcp.load")
        o = torch.load(os.path.join(d, "optim.pt"))
        for i, n in enumerate(m):
            for s in ("exp_avg", "exp_avg_sq"):
                same_value(o["state"][i][s], ora["state"][n][s],
                           f"rank_{r} optim.pt state[{i}].{s} ({n}) vs dcp.load")


def check_oracle_scalars(mnt, lay_name, oracles):
    lay = parse_layout(lay_name)
    for r in range(n_ranks(lay)):
        ora = oracle_rank(oracles, lay, r)
        d = os.path.join(mnt, "target", lay_name, f"rank_{r}")
        names = list(torch.load(os.path.join(d, "model.pt")))
        o = torch.load(os.path.join(d, "optim.pt"))
        for i, n in enumerate(names):
            got, want = o["state"][i].get("step"), ora["state"][n]["step"]
            assert got is not None and float(got) == float(want), f"rank_{r} state[{i}].step {got} != {want}"
        g = o["param_groups"][0]
        for f, v in ora["param_groups"][0].items():
            if f != "params":
                got = tuple(g[f]) if f == "betas" and isinstance(g.get(f), list) else g.get(f, "<missing>")
                same_value(got, v, f"rank_{r} param_groups.{f} vs dcp.load")


# ---------------------------------------------------------------- main

def check_views(res, fx, root, oracles):
    """Every check of the served views under root (a mount point, or --self-check's directory)."""
    label = fx.label
    res.check(f"{label}: atomic files load (defaults, mmap, no unsafe globals) and equal the truth",
              lambda: check_atomic(root, fx))
    for lay_name in fx.layouts:
        lay = parse_layout(lay_name)
        what = f"{label} {lay_name}"
        res.check(f"{what}: ranks and files", lambda: check_listing(root, fx, lay_name))
        for r in range(n_ranks(lay)):
            d = os.path.join(root, "target", lay_name, f"rank_{r}")
            keys = []
            res.check(f"{what} rank_{r}: model.pt", lambda: keys.extend(
                check_model(os.path.join(d, "model.pt"), fx, lay, r)))
            res.check(f"{what} rank_{r}: model.pt in the model's parameter order",
                      lambda: check_model_order(os.path.join(d, "model.pt"), fx, lay, r))
            if keys:
                optim = os.path.join(d, "optim.pt")
                res.check(f"{what} rank_{r}: optim.pt state and moments",
                          lambda: check_optim(optim, fx, lay, r, keys))
                res.check(f"{what} rank_{r}: optim.pt step is a 0-d float32 tensor = {fx.info['steps']}",
                          lambda: check_optim_step(optim, fx))
                res.check(f"{what} rank_{r}: optim.pt param_groups carry every saved field",
                          lambda: check_optim_group(optim, fx, keys))
            res.check(f"{what} rank_{r}: extra_state.pt and ucp_info.json extra_state/not_served",
                      lambda: check_extra(d, fx, lay, r))
        if oracles.get(lay["T"]) is not None:
            res.check(f"{what}: model.pt and moments equal torch's dcp.load resharding",
                      lambda: check_oracle_tensors(root, lay_name, oracles[lay["T"]]))
            res.check(f"{what}: steps and param_groups equal torch's dcp.load",
                      lambda: check_oracle_scalars(root, lay_name, oracles[lay["T"]]))
    res.check(f"{label}: resume from tp1_pp1_dp1 is bit for bit", lambda: check_resume(root, fx))
    res.check(f"{label}: resume check is not vacuous", lambda: check_resume_sensitive(root, fx))
    res.check(f"{label}: status.json not_served lists the unloadable items with reasons",
              lambda: check_not_served_list(status(root).get("not_served"), unloadable(fx), fx, "status.json"))


def check_fixture(res, fx, workdir, oracles):
    label = fx.label
    t0 = time.monotonic()
    if fx.mode != "tp" and fx.ranks == 2:
        res.check(f"{label}: the reference continuation is the uninterrupted distributed run's", lambda: (
            _eq(fx.info["continue_losses"], fx.info["dist_continue_losses"], "losses")))

    def mounted_checks():
        mnt = os.path.join(workdir, f"mnt-{label}")
        with mounted(fx.src, mnt, *[f"--layout={x}" for x in fx.layouts], timeout_s=300) as (m, _):
            check_views(res, fx, m, oracles)
    res.check(f"{label}: mount {' '.join(fx.layouts)}, check, unmount", mounted_checks)
    res.check(f"{label}: ucpfs inspect --json not_served", lambda: check_not_served_list(
        json.loads(run([ucpfs_bin(), "inspect", fx.src, "--json"], timeout=120).stdout).get("not_served"),
        unloadable(fx), fx, "inspect --json"))
    print(f"{NAME}: {label} checked in {time.monotonic() - t0:.1f} s", flush=True)


# ---------------------------------------------------------------- self-check (no ucpfs needed)

def write_contract_views(fx, dst, wrong=None):
    """Writes what the contract says a mount of fx serves (atomic/, .ucpfs/status.json,
    target/<L>/rank_<N>/), computed here from the truth. wrong: a deliberate bug."""
    for param, files in expected_atomic(fx.truth).items():
        os.makedirs(os.path.join(dst, "atomic", param))
        for name, t in files.items():
            torch.save({"param": t.clone()}, os.path.join(dst, "atomic", param, name))
    os.makedirs(os.path.join(dst, ".ucpfs"))
    with open(os.path.join(dst, ".ucpfs", "status.json"), "w") as f:
        json.dump({"not_served": [{"key": k, "reason": "weights_only cannot load it"}
                                  for k in sorted(unloadable(fx))]}, f)
    for lay_name in fx.layouts:
        lay = parse_layout(lay_name)
        for r in range(n_ranks(lay)):
            names, tp = stage_names(fx, lay, r), coords(lay, r)["tp"]
            if wrong == "order":
                names = names[::-1]
            model = collections.OrderedDict((n, tp_slice(fx.truth[f"model.{n}"], n, lay["T"], tp)) for n in names)
            step = fx.info["steps"] if wrong == "int_step" else torch.tensor(float(fx.info["steps"]))
            state = {i: {"step": step.clone() if isinstance(step, torch.Tensor) else step,
                         "exp_avg": tp_slice(fx.truth[f"optimizer.state.{n}.exp_avg"], n, lay["T"], tp),
                         "exp_avg_sq": tp_slice(fx.truth[f"optimizer.state.{n}.exp_avg_sq"], n, lay["T"], tp)}
                     for i, n in enumerate(names)}
            if wrong == "ulp":  # one element of one moment off by one unit in the last place
                t = state[0]["exp_avg_sq"].reshape(-1)
                t[0] = torch.nextafter(t[0], torch.tensor(float("inf")))
            group = dict(fx.group, params=list(range(len(names))), param_names=names)
            if wrong == "lr":
                group["lr"] = group["lr"] * 2
            served, not_served = expected_extra(fx, lay, r)
            if wrong == "list_for_tuple":
                served = collections.OrderedDict((k, list(v) if isinstance(v, tuple) else v)
                                                 for k, v in served.items())
            d = os.path.join(dst, "target", lay_name, f"rank_{r}")
            os.makedirs(d)
            torch.save(model, os.path.join(d, "model.pt"))
            torch.save({"state": state, "param_groups": [group]}, os.path.join(d, "optim.pt"))
            torch.save(dict(served), os.path.join(d, "extra_state.pt"))
            with open(os.path.join(d, "ucp_info.json"), "w") as f:
                json.dump({"layout": lay_name, "rank": r, "extra_state": list(served),
                           "not_served": [{"key": k, "reason": "see the contract"} for k in sorted(not_served)]}, f)


def self_check(res, fixtures, workdir, oracles):
    for fx in fixtures:
        dst = os.path.join(workdir, f"contract-{fx.label}")
        write_contract_views(fx, dst)
        check_views(res, fx, dst, oracles[fx.label])
    fx = next(x for x in fixtures if x.step_type == "int")
    for wrong in ("order", "int_step", "ulp", "lr", "list_for_tuple"):
        def caught(wrong=wrong):
            bad = os.path.join(workdir, f"bad-{wrong}")
            write_contract_views(fx, bad, wrong)
            expect_failure(lambda sub: check_views(sub, fx, bad, oracles[fx.label]))
        res.check(f"self-check: deliberately wrong '{wrong}' views fail", caught)


def _eq(a, b, what):
    assert a == b, f"{what}: {a} != {b}"


def main():
    if sys.argv[1:2] == ["--oracle-tp2"]:  # internal: the 2-process oracle, under run()'s timeout
        return oracle_tp2_main(sys.argv[2], sys.argv[3])
    self_checking = "--self-check" in sys.argv[1:]
    res = Results(NAME)
    rng = seeded_rng(NAME)
    seed, steps = rng.randrange(1000), rng.randrange(2, 5)
    print(f"{NAME}: model seed {seed}, {steps} training steps", flush=True)
    t0 = time.monotonic()
    with tmpdir("ucpfs-torch2-") as d:
        fixtures = []
        for label, mode, ranks, step_type in SPECS:
            src = os.path.join(d, label)

            def make(label=label, mode=mode, ranks=ranks, step_type=step_type, src=src):
                expected = gen_fixture("gen_torch2.py", src, "--mode", mode, "--ranks", str(ranks),
                                       "--step-type", step_type, "--steps", str(steps), "--seed", str(seed))
                fixtures.append(Fixture(label, mode, ranks, step_type, src, expected[:-3]))
            res.check(f"{label}: generator ({mode}, {ranks} ranks, step {step_type})", make)
        print(f"{NAME}: {len(fixtures)} fixtures in {time.monotonic() - t0:.1f} s", flush=True)

        t1 = time.monotonic()
        oracles = {fx.label: {} for fx in fixtures}
        for fx in fixtures:
            res.check(f"{fx.label}: dcp.load into a plain model (oracle for TP 1)",
                      lambda: oracles[fx.label].__setitem__(1, [oracle_tp1(fx.src, steps)]))
        jobs = os.path.join(d, "oracle_jobs.json")
        with open(jobs, "w") as f:
            json.dump([(fx.label, fx.src, steps) for fx in fixtures], f)

        def tp2():
            run([PY, os.path.abspath(__file__), "--oracle-tp2", jobs, d], timeout=300)
            per_rank = [torch.load(os.path.join(d, f"oracle_tp2_rank{r}.pt")) for r in range(2)]
            for fx in fixtures:
                oracles[fx.label][2] = [per_rank[r][fx.label] for r in range(2)]
        res.check("dcp.load into a TP-2 parallelized model in 2 gloo processes (oracle for TP 2)", tp2)
        print(f"{NAME}: oracles in {time.monotonic() - t1:.1f} s", flush=True)

        if self_checking:
            self_check(res, fixtures, d, oracles)
        else:
            for fx in fixtures:
                check_fixture(res, fx, d, oracles[fx.label])
    print(f"{NAME}: {time.monotonic() - t0:.1f} s", flush=True)
    res.finish()


if __name__ == "__main__":
    main()
