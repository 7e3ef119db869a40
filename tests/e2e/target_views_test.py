"""End-to-end: `ucpfs convert SRC DST --layout=L ...` writes target views that torch loads and resumes.

Runs under torch 1.13 and torch 2.x (CTest registers both); the fixtures are written by the
running torch. Fixtures: one tiny Llama (torchtitan names, 4 layers, GQA, vocab 37) trained K
steps with Adam, saved by real gloo DCP (1.13 save_state_dict, 2.x torch.distributed.checkpoint.save)
with several shardings of the SAME state (2 ranks rows, 2 ranks cols, 3 ranks mixed, 4 ranks 2x2
grid) by fixtures/gen_llama_train.py. Under 2.x, torch's planner spreads the replicated steps and
the BYTE_IO param-group items over the ranks' files, in an order that depends on the sharding.
For every source and every layout (tp2_pp2_dp2, tp1_pp4_dp1, tp2_pp1_dp2_zero1, tp3_pp3_dp1,
tp1_pp1_dp1):
- DST/target/<L>/ holds exactly rank_0..rank_{T*P*D-1}, each exactly model.pt, optim.pt,
  ucp_info.json;
- model.pt loads with torch.load(weights_only=False) and the ways the running torch offers
  (e2e_common.served_loads: 1.13 weights_only=True; torch >= 2.6 the default weights_only=True,
  mmap=True, mmap=True with weights_only=True, and no unsafe globals), is an OrderedDict
  fqn -> fp32 tensor in parameter order, with only this pipeline stage's parameters, each equal
  bit for bit to a reference slice computed here from the expected full tensors (pipeline split
  floor(s*L/P); torchtitan TP plan with torch.chunk/DTensor semantics; rank = tp + T*(dp + D*pp));
- optim.pt loads the same ways, except that on torch 1.13 it needs weights_only=False: its
  param_groups hold Python floats (lr, betas, eps), which 1.13's weights_only unpickler refuses;
- optim.pt (zero0) is a torch.optim state_dict: state[i] = {step, exp_avg, exp_avg_sq} for the
  i-th model.pt tensor, one param group with params 0..n-1, param_names and the Adam fields; no
  'fp32' (the source has no separate masters); (zero1) fp32/exp_avg/exp_avg_sq are this DP rank's
  equal, zero-padded partition of the TP/PP-local tensors flattened in model.pt order;
- ucp_info.json names layout, rank, coords, and for every model.pt tensor the global shape and
  pieces covering exactly the reference TP box.
Across sources: every layout's model.pt/optim.pt (and ucp_info.json) are byte-identical.
Resume: tp1_pp1_dp1 rank_0 model.pt/optim.pt loaded (torch.load's default on torch >= 2.6) into a
fresh model and a fresh Adam continue training with losses equal bit for bit (float.hex) to the
generator's uninterrupted run (and differ when the optimizer state is not loaded: the check is not
vacuous).
The mount serves convert's bytes, and every rank's model.pt/optim.pt read through the mount
(mmap=True included) passes the same checks as convert's files.
Also: --atomic gives the same target files; a malformed layout is refused.

Run by hand: UCPFS_BIN=build/cli/ucpfs /usr/bin/python3 tests/e2e/target_views_test.py
`--self-check` validates this test without ucpfs: it writes the target views itself from the
reference slicer, checks that everything passes on them, and that deliberately wrong files fail.
"""
import collections
import contextlib
import filecmp
import io
import json
import os
import shutil
import sys
import time

import torch

from e2e_common import TORCH_2_6, Results, run, seeded_rng, served_loads, tmpdir, ucpfs_bin
from mount_common import FIXTURES, PY

sys.path.insert(0, FIXTURES)
import gen_llama_train as gen  # noqa: E402  (model, batches, train_step)

NAME = "e2e_target_views"
LAYOUTS = ["tp2_pp2_dp2", "tp1_pp4_dp1", "tp2_pp1_dp2_zero1", "tp3_pp3_dp1", "tp1_pp1_dp1"]
SOURCES = [("r2_rows", 2, "rows"), ("r2_cols", 2, "cols"), ("r3_mixed", 3, "mixed"),
           ("r4_grid", 4, "grid")]
FILES = ["model.pt", "model.safetensors", "optim.pt", "ucp_info.json"]


# ---------------------------------------------------------------- reference slicer (independent)

def parse_layout(name):
    parts = name.split("_")
    vals = {}
    for p in parts:
        key = p.rstrip("0123456789")
        assert key in ("tp", "pp", "dp", "ep", "zero") and key not in vals and p[len(key):], name
        vals[key] = int(p[len(key):])
    assert all(k in vals for k in ("tp", "pp", "dp")), name
    return {"T": vals["tp"], "P": vals["pp"], "D": vals["dp"], "E": vals.get("ep", 1),
            "Z": vals.get("zero", 0)}


def n_ranks(lay):
    return lay["T"] * lay["P"] * lay["D"]


def coords(lay, rank):
    T, D = lay["T"], lay["D"]
    return {"tp": rank % T, "dp": (rank // T) % D, "pp": rank // (T * D), "ep": 0}


def stage_of(fqn, P):
    if fqn.startswith("tok_embeddings."):
        return 0
    if fqn.startswith("layers."):
        layer = int(fqn.split(".")[1])
        L = gen.LAYERS
        return next(s for s in range(P) if s * L // P <= layer < (s + 1) * L // P)
    assert fqn in ("norm.weight", "output.weight"), fqn
    return P - 1


def tp_dim(fqn):
    """torchtitan's TP plan: None = replicated."""
    if fqn == "tok_embeddings.weight" or fqn == "output.weight":
        return 0
    leaf = fqn.split(".")[-2]
    if leaf in ("wq", "wk", "wv", "w1", "w3"):
        return 0
    if leaf in ("wo", "w2"):
        return 1
    assert fqn.endswith("norm.weight"), fqn
    return None


def tp_box(shape, fqn, T, tp):
    """(offsets, sizes) of TP rank tp's piece: DTensor Shard(dim) = tensor.chunk(T, dim)[tp],
    empty when torch.chunk returns fewer than T chunks."""
    offs, sizes = [0] * len(shape), list(shape)
    d = tp_dim(fqn)
    if d is not None:
        n = shape[d]
        c = -(-n // T)
        offs[d] = min(tp * c, n)
        sizes[d] = max(0, min(c, n - tp * c))
    return offs, sizes


def tp_slice(t, fqn, T, tp):
    offs, sizes = tp_box(list(t.shape), fqn, T, tp)
    d = tp_dim(fqn)
    if d is not None and T > 0 and tp < len(t.chunk(T, d)):  # cross-check against torch.chunk
        assert torch.equal(t.chunk(T, d)[tp], t.narrow(d, offs[d], sizes[d]))
    return t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].clone()


def reference_rank(full, info, lay, rank):
    """The expected model.pt / optim.pt objects of one rank."""
    c = coords(lay, rank)
    names = [n for n in info["param_order"] if stage_of(n, lay["P"]) == c["pp"]]
    model = collections.OrderedDict((n, tp_slice(full[n], n, lay["T"], c["tp"])) for n in names)
    moments = {s: [tp_slice(full[f"optimizer.state.{n}.{s}"], n, lay["T"], c["tp"]) for n in names]
               for s in ("exp_avg", "exp_avg_sq")}
    group = dict(info["param_group"])
    group["betas"] = tuple(group["betas"])
    step = full[f"optimizer.state.{info['param_order'][0]}.step"]
    if lay["Z"] == 0:
        optim = {"state": {i: {"step": step.clone(), "exp_avg": moments["exp_avg"][i],
                               "exp_avg_sq": moments["exp_avg_sq"][i]} for i in range(len(names))},
                 "param_groups": [dict(group, params=list(range(len(names))), param_names=names)]}
    else:
        D, dp = lay["D"], c["dp"]

        def part(ts):
            flat = torch.cat([t.reshape(-1) for t in ts]) if ts else torch.zeros(0)
            p = -(-flat.numel() // D)
            flat = torch.cat([flat, torch.zeros(p * D - flat.numel())])
            return flat[dp * p:(dp + 1) * p].clone()
        optim = {"fp32": part(list(model.values())), "exp_avg": part(moments["exp_avg"]),
                 "exp_avg_sq": part(moments["exp_avg_sq"]), "step": step.clone(),
                 "param_groups": [dict(group, params=list(range(len(names))), param_names=names)]}
    return model, optim, names


def same_bits(a, b, what):
    assert isinstance(a, torch.Tensor), f"{what}: not a tensor ({type(a).__name__})"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)), \
        f"{what}: values differ"


def check_step(v, k, what):
    if isinstance(v, torch.Tensor):
        assert v.dim() == 0 and v.is_floating_point(), f"{what}: step {v.dtype} {tuple(v.shape)}"
        v = v.item()
    assert float(v) == float(k), f"{what}: step {v} != {k}"


def check_group(g, want, what, zero):
    assert isinstance(g, dict), f"{what}: param group is {type(g).__name__}"
    for f in gen.GROUP_FIELDS:
        assert f in g, f"{what}: param group lacks {f}"
        got, exp = g[f], want[f]
        if f == "betas":
            got, exp = tuple(got), tuple(exp)
        ok = (got is exp) if (exp is None or isinstance(exp, bool)) else \
            (got == exp and not isinstance(got, bool))
        assert ok, f"{what}: {f} = {got!r}, want {exp!r}"
    if zero == 0:
        assert g["params"] == want["params"], f"{what}: params {g['params']} != {want['params']}"
        assert list(g.get("param_names", [])) == want["param_names"], \
            f"{what}: param_names {g.get('param_names')} != {want['param_names']}"
    elif "param_names" in g:
        assert list(g["param_names"]) == want["param_names"], f"{what}: param_names"


def check_model(path, want, what):
    loads = served_loads(path) + [("weights_only=False", torch.load(path, weights_only=False))]
    for how, m in loads:
        w = f"{what} ({how})"
        assert type(m) is collections.OrderedDict, f"{w}: model.pt is {type(m).__name__}"
        assert list(m) == list(want), f"{w}: keys {list(m)} != {list(want)}"
        for k, t in want.items():
            same_bits(m[k], t, f"{w}: {k}")


def describe_groups(groups):
    """Why there are several param groups: which fields differ, or only their order."""
    plain = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in groups]
    if all(p == plain[0] for p in plain):
        return ("the groups' hyper-parameters are equal; only their field order differs: " +
                "; ".join(",".join(p) for p in plain))
    return "hyper-parameters differ: " + "; ".join(repr(p) for p in plain)


def check_optim(path, want, lay, steps, what):
    for how, o in served_loads(path, has_floats=True):
        check_optim_obj(o, want, lay, steps, f"{what} ({how})")


def check_optim_obj(o, want, lay, steps, what):
    assert isinstance(o, dict), f"{what}: optim.pt is {type(o).__name__}"
    if lay["Z"] == 0:
        assert sorted(o) == ["param_groups", "state"], f"{what}: optim.pt keys {sorted(o)}"
        st = o["state"]
        assert sorted(st) == sorted(want["state"]) and all(type(i) is int for i in st), \
            f"{what}: state indices {sorted(st)} != {sorted(want['state'])}"
        for i, ws in want["state"].items():
            assert sorted(st[i]) == ["exp_avg", "exp_avg_sq", "step"], f"{what}: state[{i}] {sorted(st[i])}"
            check_step(st[i]["step"], steps, f"{what}: state[{i}]")
            for s in ("exp_avg", "exp_avg_sq"):
                same_bits(st[i][s], ws[s], f"{what}: state[{i}].{s}")
    else:
        need = ["exp_avg", "exp_avg_sq", "fp32", "param_groups", "step"]
        assert all(k in o for k in need), f"{what}: optim.pt keys {sorted(o)}, need {need}"
        for s in ("fp32", "exp_avg", "exp_avg_sq"):
            assert o[s].dim() == 1, f"{what}: {s} is {o[s].dim()}-D"
            same_bits(o[s], want[s], f"{what}: {s}")
        check_step(o["step"], steps, what)
    assert isinstance(o["param_groups"], list) and len(o["param_groups"]) == 1, \
        f"{what}: {len(o['param_groups'])} param groups ({describe_groups(o['param_groups'])})"
    check_group(o["param_groups"][0], want["param_groups"][0], what, lay["Z"])


def check_info(path, lay_name, lay, rank, full, names, what):
    info = json.load(open(path))
    assert info.get("layout") == lay_name and info.get("rank") == rank, \
        f"{what}: layout/rank {info.get('layout')}/{info.get('rank')}"
    c = coords(lay, rank)
    assert {k: info["coords"].get(k) for k in ("tp", "pp", "dp", "ep")} == c, \
        f"{what}: coords {info['coords']} != {c}"
    keys = ("param", "state", "file", "key", "dtype", "global_shape", "pattern", "pieces", "flat_range")
    in_model = {}
    for e in info["tensors"]:
        miss = [k for k in keys if k not in e]
        assert not miss, f"{what}: tensor entry {e.get('param')} lacks {miss}"
        assert e["file"] in ("model.pt", "optim.pt"), f"{what}: file {e['file']}"
        if e["file"] == "model.pt":
            assert e["key"] not in in_model, f"{what}: model.pt key {e['key']} listed twice"
            in_model[e["key"]] = e
    assert sorted(in_model) == sorted(names), f"{what}: model.pt entries {sorted(in_model)}"
    for n in names:
        e = in_model[n]
        shape = list(full[n].shape)
        assert e["param"] == n and list(e["global_shape"]) == shape, \
            f"{what}: {n}: param {e['param']} global_shape {e['global_shape']}"
        offs, sizes = tp_box(shape, n, lay["T"], c["tp"])
        want = torch.zeros(shape, dtype=torch.int32)
        want[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] = 1
        got = torch.zeros(shape, dtype=torch.int32)
        numel = 0
        for p in e["pieces"]:
            numel += int(torch.tensor(p["sizes"]).prod().item()) if p["sizes"] else 1
            if list(p["view_shape"]) == shape:
                got[tuple(slice(o, o + s) for o, s in zip(p["offsets"], p["sizes"]))] += 1
        assert numel == int(want.sum()), f"{what}: {n}: pieces hold {numel} elements, want {int(want.sum())}"
        if all(list(p["view_shape"]) == shape for p in e["pieces"]):
            assert torch.equal(got, want), f"{what}: {n}: pieces {e['pieces']} != box {offs}+{sizes}"


def check_layout(res, label, dst, lay_name, full, info):
    lay = parse_layout(lay_name)
    root = os.path.join(dst, "target", lay_name)
    res.check(f"{label} {lay_name}: exactly ranks 0..{n_ranks(lay) - 1}, each {FILES}", lambda: (
        _eq(sorted(os.listdir(root)), sorted(f"rank_{r}" for r in range(n_ranks(lay))), root),
        [_eq(sorted(os.listdir(os.path.join(root, f"rank_{r}"))), FILES, f"rank_{r}")
         for r in range(n_ranks(lay))]))
    for r in range(n_ranks(lay)):
        d = os.path.join(root, f"rank_{r}")
        model, optim, names = reference_rank(full, info, lay, r)
        what = f"{label} {lay_name} rank_{r}"
        res.check(f"{what}: model.pt", lambda: check_model(os.path.join(d, "model.pt"), model, what))
        res.check(f"{what}: model.safetensors holds model.pt's tensors",
                  lambda: check_model_safetensors(d, what))
        res.check(f"{what}: optim.pt", lambda: check_optim(os.path.join(d, "optim.pt"), optim, lay,
                                                            info["steps"], what))
        res.check(f"{what}: ucp_info.json", lambda: check_info(os.path.join(d, "ucp_info.json"), lay_name,
                                                                lay, r, full, names, what))


def check_model_safetensors(d, what):
    """model.safetensors: save_file's bytes for model.pt's tensors (where the safetensors
    library is installed: torch 2.13's environment), else at least the header's names."""
    model = torch.load(os.path.join(d, "model.pt"))
    data = open(os.path.join(d, "model.safetensors"), "rb").read()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert sorted(k for k in header if k != "__metadata__") == sorted(model), f"{what}: model.safetensors names"
    try:
        import safetensors.torch as st
    except ImportError:
        return
    assert st.save({k: v.contiguous() for k, v in model.items()}, metadata={"format": "pt"}) == data, \
        f"{what}: model.safetensors differs from safetensors.torch.save of model.pt"


def _eq(a, b, what):
    assert a == b, f"{what}: {a} != {b}"


def same_files(a, b, lay_name, names):
    root_a, root_b = (os.path.join(x, "target", lay_name) for x in (a, b))
    diff = []
    for r in sorted(os.listdir(root_a)):
        for f in names:
            pa, pb = os.path.join(root_a, r, f), os.path.join(root_b, r, f)
            if not os.path.exists(pb) or not filecmp.cmp(pa, pb, shallow=False):
                diff.append(f"{r}/{f}")
    assert not diff, f"differ: {diff}"


def resume(dst, info, load_optim=True):
    torch.set_num_threads(1)
    d = os.path.join(dst, "target", "tp1_pp1_dp1", "rank_0")
    model = gen.Llama()
    # torch >= 2.6: torch.load's default (weights_only=True); 1.13: optim.pt holds floats.
    load = (lambda p, floats: torch.load(p)) if TORCH_2_6 else \
        (lambda p, floats: torch.load(p, weights_only=not floats))
    model.load_state_dict(load(os.path.join(d, "model.pt"), False))
    opt = gen.make_optimizer(model)
    if load_optim:
        opt.load_state_dict(load(os.path.join(d, "optim.pt"), True))
    k = info["steps"]
    return [float(gen.train_step(model, opt, gen.batch(info["seed"], k + j))).hex()
            for j in range(info["continue_steps"])]


def check_resume(dst, info):
    got = resume(dst, info)
    assert got == info["continue_losses"], f"losses {got} != uninterrupted {info['continue_losses']}"


def check_resume_sensitive(dst, info):
    got = resume(dst, info, load_optim=False)
    assert got != info["continue_losses"], "losses match even without the optimizer state"


# ---------------------------------------------------------------- self-check (no ucpfs needed)

def write_reference(full, info, dst, wrong=None):
    """Writes DST/target/<L>/rank_<N>/ from the reference slicer. wrong: a deliberate bug."""
    for lay_name in LAYOUTS:
        lay = parse_layout(lay_name)
        for r in range(n_ranks(lay)):
            model, optim, names = reference_rank(full, info, lay, r)
            c = coords(lay, r)
            if wrong == "wo_dim0" and lay["T"] > 1:
                for n in names:
                    if n.endswith("attention.wo.weight"):
                        model[n] = full[n].chunk(lay["T"], 0)[c["tp"]].clone()
            if wrong == "zero1_per_tensor" and lay["Z"] == 1:  # each tensor split over DP instead
                optim["fp32"] = torch.cat([t.reshape(-1).tensor_split(lay["D"])[c["dp"]]
                                           for t in model.values()])
            if wrong == "step" and lay["Z"] == 0:
                for s in optim["state"].values():
                    s["step"] = s["step"] + 1
            d = os.path.join(dst, "target", lay_name, f"rank_{r}")
            os.makedirs(d, exist_ok=True)
            torch.save(model, os.path.join(d, "model.pt"))
            torch.save(optim, os.path.join(d, "optim.pt"))
            tensors = []
            for n in names:
                offs, sizes = tp_box(list(full[n].shape), n, lay["T"], c["tp"])
                tensors.append({"param": n, "state": "weight", "file": "model.pt", "key": n,
                                "dtype": "float32", "global_shape": list(full[n].shape),
                                "pattern": "shard" if tp_dim(n) is not None else "replicate",
                                "pieces": [{"view_shape": list(full[n].shape), "offsets": offs,
                                            "sizes": sizes}], "flat_range": None})
            with open(os.path.join(d, "ucp_info.json"), "w") as f:
                json.dump({"layout": lay_name, "rank": r, "coords": c, "tensors": tensors}, f)


def expect_failure(fn):
    sub = Results("sub")
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        fn(sub)
    assert sub.failed > 0, "the deliberately wrong files passed every check"
    first = log.getvalue().splitlines()[0]
    print(f"  self-check caught {sub.failed} failing checks, e.g. {first}", flush=True)


# ---------------------------------------------------------------- main

def check_mount(src, out, workdir):
    """The mount serves the same bytes as `ucpfs convert` (the oracle), sizes come before data,
    and data-parallel replicas of a rank file share one inode."""
    from mount_common import mounted, stats  # noqa: PLC0415 - only the mount check needs it
    mnt = os.path.join(workdir, "mnt-target")
    with mounted(src, mnt, *[f"--layout={x}" for x in LAYOUTS]) as (m, _):
        before = stats(m)["source_bytes_read"]
        run(["ls", "-lR", os.path.join(m, "target")])
        run(["du", "-sh", os.path.join(m, "target")])
        assert stats(m)["source_bytes_read"] == before, "ls/du of target/ read tensor data"
        for lay_name in LAYOUTS:
            lay = parse_layout(lay_name)
            ranks = sorted(os.listdir(os.path.join(m, "target", lay_name)))
            assert ranks == sorted(f"rank_{r}" for r in range(n_ranks(lay))), (lay_name, ranks)
            for r in ranks:
                for f in sorted(os.listdir(os.path.join(out, "target", lay_name, r))):
                    a = os.path.join(m, "target", lay_name, r, f)
                    b = os.path.join(out, "target", lay_name, r, f)
                    assert os.path.getsize(a) == os.path.getsize(b), (a, os.path.getsize(a), os.path.getsize(b))
                    assert open(a, "rb").read() == open(b, "rb").read(), f"{a} differs from convert's {b}"
        # tp2_pp2_dp2: rank = tp + 2*(dp + 2*pp); ranks 0 and 2 differ only in dp.
        d = os.path.join(m, "target", "tp2_pp2_dp2")
        for f in ("model.pt", "model.safetensors", "optim.pt"):
            assert os.stat(os.path.join(d, "rank_0", f)).st_ino == os.stat(os.path.join(d, "rank_2", f)).st_ino, f
        assert os.stat(os.path.join(d, "rank_0", "model.pt")).st_ino != os.stat(os.path.join(d, "rank_1", "model.pt")).st_ino
        z = os.path.join(m, "target", "tp2_pp1_dp2_zero1")
        assert os.stat(os.path.join(z, "rank_0", "optim.pt")).st_ino != os.stat(os.path.join(z, "rank_2", "optim.pt")).st_ino
        # An invalid layout is refused at mount time with the reason.
        os.makedirs(mnt + "-bad", exist_ok=True)
        r = run([ucpfs_bin(), "mount", src, mnt + "-bad", "--layout=tp2_pp9_dp1"], check=False, timeout=120)
        assert r.returncode != 0 and "tp2_pp9_dp1" in r.stderr, r.stderr
    try:
        check_mount_dynamic(src, out, workdir)
    except Exception:
        log = os.path.join(workdir, "mnt-target-dyn.log")
        if os.path.exists(log):
            print(f"--- daemon log {log}:\n{open(log).read()}", file=sys.stderr)
        raise


def check_mount_loads(res, src, full, info, workdir):
    """Every rank's model.pt/optim.pt read through the mount (torch.load with mmap=True on the
    FUSE file included, under torch >= 2.6) equals the reference like convert's files do."""
    from mount_common import mounted  # noqa: PLC0415
    mnt = os.path.join(workdir, "mnt-target-loads")
    try:
        with mounted(src, mnt, *[f"--layout={x}" for x in LAYOUTS]) as (m, _):
            for lay_name in LAYOUTS:
                lay = parse_layout(lay_name)
                for r in range(n_ranks(lay)):
                    d = os.path.join(m, "target", lay_name, f"rank_{r}")
                    model, optim, _ = reference_rank(full, info, lay, r)
                    what = f"mount {lay_name} rank_{r}"
                    res.check(f"{what}: model.pt", lambda: check_model(os.path.join(d, "model.pt"), model, what))
                    res.check(f"{what}: optim.pt", lambda: check_optim(os.path.join(d, "optim.pt"), optim, lay,
                                                                        info["steps"], what))
    except Exception as e:  # noqa: BLE001 - a failed mount is one failure, not a crash
        res.failed += 1
        print(f"FAIL mount for the rank-file loads: {type(e).__name__}: {e}", flush=True)


def check_lookup_concurrency(m):
    """A large layout built on lookup does not hold up other lookups, in target/ or elsewhere;
    DP replicas of a layout without ZeRO are sized without being built (fast)."""
    import threading  # noqa: PLC0415
    target = os.path.join(m, "target")
    t0 = time.monotonic()
    ranks = os.listdir(os.path.join(target, "tp1_pp1_dp4096"))
    plain_s = time.monotonic() - t0
    assert len(ranks) == 4096, len(ranks)
    info = json.load(open(os.path.join(target, "tp1_pp1_dp4096", "rank_4095", "ucp_info.json")))
    assert info["rank"] == 4095 and info["coords"]["dp"] == 4095, info
    # Each ZeRO-1 rank has its own optim.pt, so this one is built rank by rank (seconds).
    big = {}

    def build_big():
        t = time.monotonic()
        big["n"] = len(os.listdir(os.path.join(target, "tp1_pp1_dp4096_zero1")))
        big["end"], big["s"] = time.monotonic(), time.monotonic() - t
    thread = threading.Thread(target=build_big)
    thread.start()
    time.sleep(0.02)  # the build takes about 0.4 s on the 2-core test machine
    source_file = sorted(x for x in os.listdir(m) if x.endswith(".distcp"))[0]
    small = {}
    for name in ("target/tp1_pp2_dp1", "atomic", source_file):
        t = time.monotonic()
        os.stat(os.path.join(m, name))
        small[name] = time.monotonic() - t
    small_end = time.monotonic()
    thread.join()
    figures = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in small.items())
    print(f"  lookups: tp1_pp1_dp4096 listed in {plain_s:.2f} s; during the {big['s']:.2f} s build of "
          f"tp1_pp1_dp4096_zero1: {figures}", flush=True)
    assert big["n"] == 4096, big
    assert small_end < big["end"], f"the other lookups waited for the big build ({figures}; build {big['s']:.2f} s)"
    assert max(small.values()) < 0.5, figures


def check_mount_dynamic(src, out, workdir):
    """Layouts not given with --layout appear under target/ on first lookup, with convert's
    bytes; invalid names are ENOENT plus a log line with the reason; a layout over the lookup cap
    (4096 ranks) is refused at once; refused well-formed layouts are listed with their reason in
    stats.json and `ucpfs status`; concurrent first lookups agree on the inodes."""
    import threading  # noqa: PLC0415
    from mount_common import mounted  # noqa: PLC0415
    mnt = os.path.join(workdir, "mnt-target-dyn")
    log = mnt + ".log"
    with mounted(src, mnt, "--layout=tp2_pp2_dp2") as (m, _):
        target = os.path.join(m, "target")
        assert sorted(os.listdir(target)) == ["tp2_pp2_dp2"], os.listdir(target)
        for lay_name in ("tp1_pp4_dp1", "tp2_pp1_dp2_zero1"):
            lay = parse_layout(lay_name)
            ranks = sorted(os.listdir(os.path.join(target, lay_name)))
            assert ranks == sorted(f"rank_{r}" for r in range(n_ranks(lay))), (lay_name, ranks)
            for r in ranks:
                names = sorted(os.listdir(os.path.join(target, lay_name, r)))
                assert names == sorted(os.listdir(os.path.join(out, "target", lay_name, r))), names
                for f in names:
                    a = os.path.join(target, lay_name, r, f)
                    b = os.path.join(out, "target", lay_name, r, f)
                    assert open(a, "rb").read() == open(b, "rb").read(), f"{a} differs from convert's {b}"
        assert sorted(os.listdir(target)) == ["tp1_pp4_dp1", "tp2_pp1_dp2_zero1", "tp2_pp2_dp2"], \
            os.listdir(target)
        z = os.path.join(target, "tp2_pp1_dp2_zero1")
        assert os.stat(os.path.join(z, "rank_0", "model.pt")).st_ino == os.stat(os.path.join(z, "rank_2", "model.pt")).st_ino
        assert os.stat(os.path.join(z, "rank_0", "optim.pt")).st_ino != os.stat(os.path.join(z, "rank_2", "optim.pt")).st_ino
        assert os.path.realpath(os.path.join(z, "..")) == os.path.realpath(target)
        assert os.stat(os.path.join(z, "..")).st_ino == os.stat(target).st_ino
        for bad in ("tp2_pp9_dp1", "bogus", "tp02_pp2_dp2"):
            try:
                os.stat(os.path.join(target, bad))
                raise AssertionError(f"target/{bad} exists")
            except FileNotFoundError:
                pass
            lines = [x for x in open(log).read().splitlines() if f"target/{bad}: " in x]
            assert lines and lines[-1].split(f"target/{bad}: ", 1)[1].strip(), f"no reason logged for {bad}"
            print(f"  target/{bad}: {lines[-1]}", flush=True)
        assert "bogus" not in os.listdir(target)
        # An absurd layout is refused at once; refusals of well-formed layouts show with their
        # reason in stats.json and `ucpfs status` (names that are no layout do not).
        t0 = time.monotonic()
        assert not os.path.exists(os.path.join(target, "tp1_pp1_dp65536"))
        assert time.monotonic() - t0 < 5, time.monotonic() - t0
        stats = json.load(open(os.path.join(m, ".ucpfs", "stats.json")))
        refused = {r["layout"]: r["reason"] for r in stats["lookup_layouts"]["refused"]}
        assert sorted(refused) == ["tp1_pp1_dp65536", "tp2_pp9_dp1"], refused
        assert "4096" in refused["tp1_pp1_dp65536"] and "pp9" in refused["tp2_pp9_dp1"], refused
        out_status = run([ucpfs_bin(), "status", m], timeout=60).stdout
        assert "refused:   tp2_pp9_dp1: " in out_status and "refused:   tp1_pp1_dp65536: " in out_status, out_status
        # ... and in status.json, and as target/<layout>.error beside the missing directory.
        status = json.load(open(os.path.join(m, ".ucpfs", "status.json")))
        assert {r["layout"]: r["reason"] for r in status["target_refused"]} == refused, status["target_refused"]
        listing = os.listdir(target)
        assert "tp2_pp9_dp1.error" in listing and "tp1_pp1_dp65536.error" in listing, listing
        for name, why in refused.items():
            assert open(os.path.join(target, name + ".error")).read() == why + "\n", name
            assert not os.path.exists(os.path.join(target, name)), name
        assert not os.path.exists(os.path.join(target, "tp1_pp1_dp2.error")), "a layout never refused has no .error"
        check_lookup_concurrency(m)
        # 8 threads looking up one new layout at once see the same inodes.
        new = "tp1_pp1_dp1"
        seen, errors = [], []
        barrier = threading.Barrier(8)

        def look():
            try:
                barrier.wait()
                d = os.path.join(target, new)
                seen.append((os.stat(d).st_ino, os.stat(os.path.join(d, "rank_0", "model.pt")).st_ino,
                             os.stat(os.path.join(d, "rank_0", "optim.pt")).st_ino))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
        threads = [threading.Thread(target=look) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(seen) == 8 and len(set(seen)) == 1, (errors, seen)
        assert new in os.listdir(target)
        a = os.path.join(target, new, "rank_0", "model.pt")
        assert open(a, "rb").read() == open(os.path.join(out, "target", new, "rank_0", "model.pt"), "rb").read()


def main():
    self_check = "--self-check" in sys.argv[1:]
    res = Results(NAME)
    rng = seeded_rng(NAME)
    seed, steps = rng.randrange(1000), rng.randrange(2, 5)
    print(f"{NAME}: model seed {seed}, {steps} training steps", flush=True)
    t0 = time.monotonic()
    with tmpdir("ucpfs-target-") as d:
        srcs = []
        for name, ranks, sharding in SOURCES:
            src = os.path.join(d, name)
            expected = src + "_expected.pt"
            run([PY, os.path.join(FIXTURES, "gen_llama_train.py"), src, "--ranks", str(ranks),
                 "--sharding", sharding, "--steps", str(steps), "--seed", str(seed),
                 "--expected", expected], timeout=300)
            srcs.append((name, src, expected))
        full = torch.load(srcs[0][2])
        info = json.load(open(os.path.splitext(srcs[0][2])[0] + "_resume.json"))
        print(f"{NAME}: fixtures in {time.monotonic() - t0:.1f} s", flush=True)
        for _, _, expected in srcs[1:]:
            other = torch.load(expected)
            assert list(other) == list(full) and all(torch.equal(other[k], full[k]) for k in full), \
                "generator: shardings of the same model differ"

        outs = []
        for name, src, _ in srcs:
            out = os.path.join(d, f"out_{name}")
            if self_check:
                write_reference(full, info, out)
            else:
                t1, failed = time.monotonic(), res.failed
                res.check(f"{name}: ucpfs convert exits 0",
                          lambda: run([ucpfs_bin(), "convert", src, out] +
                                      [f"--layout={x}" for x in LAYOUTS], timeout=600))
                print(f"{NAME}: convert {name} in {time.monotonic() - t1:.1f} s", flush=True)
                if res.failed > failed:
                    continue  # one failure per source, not one per rank file
            outs.append((name, out))
            for lay_name in LAYOUTS:
                check_layout(res, name, out, lay_name, full, info)
            res.check(f"{name}: resume from tp1_pp1_dp1 continues bit for bit",
                      lambda: check_resume(out, info))
        res.check("every source converted", lambda: _eq(len(outs), len(srcs), "converted sources"))
        if outs:
            res.check("resume check is not vacuous (no optimizer state -> other losses)",
                      lambda: check_resume_sensitive(outs[0][1], info))
        for lay_name in LAYOUTS if outs else []:
            for name, out in outs[1:]:
                res.check(f"{lay_name}: model.pt/optim.pt byte-identical {outs[0][0]} vs {name}",
                          lambda: same_files(outs[0][1], out, lay_name, ["model.pt", "optim.pt"]))
                res.check(f"{lay_name}: ucp_info.json identical {outs[0][0]} vs {name}",
                          lambda: same_files(outs[0][1], out, lay_name, ["ucp_info.json"]))

        if self_check:
            for wrong in ("wo_dim0", "zero1_per_tensor", "step"):
                def caught(wrong=wrong):
                    bad = os.path.join(d, f"bad_{wrong}")
                    write_reference(full, info, bad, wrong=wrong)
                    expect_failure(lambda sub: [check_layout(sub, wrong, bad, x, full, info)
                                                for x in LAYOUTS])
                res.check(f"self-check: deliberately wrong '{wrong}' files fail", caught)

            def resume_caught():
                bad = os.path.join(d, "bad_resume")
                shutil.copytree(outs[0][1], bad)
                p = os.path.join(bad, "target", "tp1_pp1_dp1", "rank_0", "optim.pt")
                o = torch.load(p, weights_only=False)
                # Every moment, relative 2^-10: the loss is fp32 and the first resumed loss
                # precedes any update, so an 8-ulp change of one moment can round away
                # (it did for some seeds, on both torches).
                for st in o["state"].values():
                    st["exp_avg_sq"] = st["exp_avg_sq"] * (1 + 2 ** -10)
                torch.save(o, p)
                got = resume(bad, info)
                assert got != info["continue_losses"], "a perturbed exp_avg_sq resumed bit for bit"
            res.check("self-check: slightly perturbed moments (x(1+2^-10)) break resume equality", resume_caught)
        else:
            name, src, _ = srcs[-1]
            out_a = os.path.join(d, "out_atomic")

            def atomic():
                run([ucpfs_bin(), "convert", src, out_a, "--layout=tp2_pp2_dp2", "--atomic"], timeout=600)
                assert name in dict(outs), f"convert of {name} failed above"
                same_files(dict(outs)[name], out_a, "tp2_pp2_dp2", ["model.pt", "optim.pt"])
            res.check("--atomic: same target files", atomic)
            if outs:
                res.check("mount serves convert's bytes; DP replicas share inodes; no data read by ls/du",
                          lambda: check_mount(srcs[0][1], outs[0][1], d))
            check_mount_loads(res, srcs[0][1], full, info, d)
            for bad in ("tp0_pp1_dp1", "tp2_dp2", "bogus"):
                def refused(bad=bad):
                    out_b = os.path.join(d, f"out_bad_{bad}")
                    r = run([ucpfs_bin(), "convert", src, out_b, f"--layout={bad}"], check=False, timeout=120)
                    assert r.returncode != 0, f"exit 0 for --layout={bad}"
                    assert r.stderr.strip(), "no error message"
                    assert not os.path.exists(os.path.join(out_b, "target", bad)), "wrote a target dir"
                res.check(f"malformed layout '{bad}' is refused", refused)
    print(f"{NAME}: {time.monotonic() - t0:.1f} s", flush=True)
    res.finish()


if __name__ == "__main__":
    main()
