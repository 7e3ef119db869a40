"""End-to-end: DCP checkpoints saved by the frameworks' own recipes, mounted at the folder a user
would pick, served whole.

Cases (each generated once by its fixture generator, 2 gloo ranks on CPU, a few AdamW steps;
truth from the live job: producers_common.py):
  tutorial        PyTorch's DCP tutorial, FSDP2, dcp.save({"app": AppState(model, optimizer)})
                  (keys app.model.*, app.optim.*), mounted at its CHECKPOINT_DIR;
  tutorial_async  the same state saved with dcp.async_save (same generator run);
  accelerate_fsdp Accelerate's FSDP save_state folder (pytorch_model_fsdp_0/ + optimizer_0/);
  lightning_fsdp, lightning_model_parallel  Lightning's sharded checkpoint directory (FSDPStrategy
                  with state_dict_type="sharded"; ModelParallelStrategy with FSDP2);
  torchtitan      torchtitan 0.3.0's CheckpointManager, llama3 debug model under FSDP2 (the shared
                  fixture "torchtitan"), mounted at its checkpoint/step-K/ with the head dimension
                  given in a --pattern-rules file's "model": weights saved split
                  (qkv_linear.wq|wk|wv), optimizer state fused (qkv_linear.wqkv); model.pt split,
                  optim.pt fused (what its model and optimizer load), atomic/ all under the split
                  names, the moments split per key-value head as torchtitan's own
                  _split_qkv_on_save splits the weight; resumed with its LR scheduler's last_epoch
                  from extra_state.pt; second layout tp2 (its TP plan: colwise chunks of wqkv and
                  wq/wk/wv, rowwise wo/w2);
  torchtitan_run  the same save mounted at its run folder checkpoint/ (the newest step-K served),
                  the heads given by --hf-config (a config.json of the model's heads);
  torchtitan_bare the same with no head facts: atomic/ keeps each side under its own names and
                  status.json's fused_params note names the missing fact.
Per case:
 1. .ucpfs/status.json: no unmapped keys, no ambiguity; the model prefix it names is stripped;
 2. atomic/<fqn>/{fp32,exp_avg,exp_avg_sq}.pt equal the live job's full weights and moments;
 3. target/tp1_pp1_dp1/rank_0/model.pt loads with load_state_dict(strict=True) into a fresh
    instance of the framework's model class, and equals the truth;
 4. optim.pt loads into a fresh optimizer of that model (optimizer.load_state_dict): exactly the
    optimizer's param groups with every hyper-parameter, the step and moments of the truth; and
    training on gives the losses of the uninterrupted job (float.hex);
 5. a second layout (each case names it) equals the truth's slices on every rank.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/producers_dcp_test.py [CASE...]
"""
import importlib
import json
import os
import sys

import torch

from e2e_common import Results, run, tmpdir
from mount_common import FIXTURES, PY, mounted, status
from shared_fixtures import fixture

sys.path.insert(0, FIXTURES)

NAME = "e2e_producers_dcp"


class Case:
    """label; generator script and its arguments (each script + arguments runs once); the
    generator module (model class, optimizer, data and step); the second layout and how a rank's
    slice of the truth is cut; the folder mounted (default: the truth's "checkpoint")."""

    def __init__(self, label, script, args, second_layout, slicer=None, mount=None, facts=None, shared=None,
                 views_only=False):
        self.label, self.script, self.args, self.mount = label, script, args, mount
        self.views_only = views_only  # status and atomic/ only (the rank files are checked by another case)
        # facts: how the head facts reach the mount ("rules", "hf-config", or None: not given);
        # shared: the shared fixture (e2e/shared_fixtures.py) that is this generator run.
        self.facts, self.shared = facts, shared
        self.second_layout, self.slicer = second_layout, slicer or (lambda t, fqn, rank: t)
        self.module = importlib.import_module(script[:-3])


def dp_replica(t, fqn, rank):
    return t


def titan_tp2(t, fqn, rank):
    """torchtitan's llama3 TP plan at tp 2: norms replicated, wo/w2 rowwise (dim 1), the rest
    (embeddings, lm_head, wqkv and its split wq/wk/wv, w1/w3) colwise (dim 0), torch.chunk."""
    if t.dim() < 2:
        return t
    dim = 1 if fqn.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else 0
    return t.chunk(2, dim=dim)[rank]


CASES = [
    Case("tutorial", "gen_dcp_tutorial.py", [], "tp1_pp1_dp2", dp_replica),
    Case("tutorial_async", "gen_dcp_tutorial.py", [], "tp1_pp1_dp2", dp_replica, mount="checkpoint_async"),
    Case("accelerate_fsdp", "gen_accelerate_fsdp.py", [], "tp1_pp1_dp2", dp_replica),
    Case("lightning_fsdp", "gen_lightning_fsdp.py", ["--strategy", "fsdp"], "tp1_pp1_dp2", dp_replica),
    Case("lightning_model_parallel", "gen_lightning_fsdp.py", ["--strategy", "model_parallel"], "tp1_pp1_dp2",
         dp_replica),
    Case("torchtitan", "gen_torchtitan.py", [], "tp2_pp1_dp1", titan_tp2, facts="rules", shared="torchtitan"),
    Case("torchtitan_run", "gen_torchtitan.py", [], "tp1_pp1_dp2", dp_replica, mount="checkpoint",
         facts="hf-config", shared="torchtitan"),
    Case("torchtitan_bare", "gen_torchtitan.py", [], "tp1_pp1_dp2", dp_replica, shared="torchtitan", views_only=True),
]


def same(a, b, what):
    assert isinstance(a, torch.Tensor), f"{what}: {type(a).__name__}, want a tensor"
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: values differ (max |d| {(a.double() - b.double()).abs().max().item()})"


def split_truth(truth, case):
    """{split fqn: state} of the fused parameters, split by the framework's own rule, when the
    mount was given the facts to split them; else {}."""
    if not case.facts:
        return {}
    return case.module.split_fused_state(case.module.build_model(), truth["optim"]["state"])


def mount_facts(case, work):
    """The mount options that give the head facts as the case says (written into work)."""
    if not case.facts:
        return []
    facts = case.module.attention_facts()
    if case.facts == "rules":
        path = os.path.join(work, case.label + "-rules.json")
        with open(path, "w") as f:
            json.dump({"model": {"head_dim": facts["head_dim"]}}, f)
        return ["--pattern-rules", path]
    path = os.path.join(work, case.label + "-config.json")
    with open(path, "w") as f:  # a config.json of the model's heads (hidden_size / heads = head_dim)
        json.dump({"model_type": "llama", "num_attention_heads": facts["num_attention_heads"],
                   "num_key_value_heads": facts["num_key_value_heads"],
                   "hidden_size": facts["num_attention_heads"] * facts["head_dim"]}, f)
    return ["--hf-config", path]


def check_status(mnt, truth, case):
    st = status(mnt)
    assert st["unmapped_keys"] == [], f"unmapped keys: {st['unmapped_keys']}"
    ks = st["key_structure"]
    assert ks["ambiguities"] == [], f"ambiguities: {ks['ambiguities']}"
    names = set(truth["model"]) | set(truth["optim"]["state"])
    assert st["counts"]["params"] == len(names), (st["counts"], sorted(names))
    # Optimizer state of no weight name: a parameter the model saves split (torchtitan's wqkv).
    fused = sorted(set(truth["optim"]["state"]) - set(truth["model"]))
    assert sorted(f["param"] for f in st["fused_params"]) == fused, st["fused_params"]
    for f in st["fused_params"]:
        want = "key-value heads" if case.facts else "head_dim"
        assert want in f["note"], f["note"]


def check_atomic(mnt, truth, case):
    split = split_truth(truth, case)
    state = {**truth["optim"]["state"], **split}
    for fqn in dict.fromkeys([*truth["model"], *truth["optim"]["state"]]):
        d = os.path.join(mnt, "atomic", fqn.replace("/", "%2F"))
        w = truth["model"].get(fqn)
        if w is None:  # held fused by the optimizer, stored split: no weight under this name
            assert not os.path.exists(os.path.join(d, "fp32.pt")), f"atomic/{fqn}/fp32.pt exists"
            if split:  # served under the split names only
                assert not os.path.exists(d), f"atomic/{fqn} exists beside its split parts"
                continue
        else:
            same(torch.load(os.path.join(d, "fp32.pt"))["param"], w.float(), f"atomic/{fqn}/fp32.pt")
        st = state.get(fqn)
        if st is None:
            assert not os.path.exists(os.path.join(d, "exp_avg.pt")), f"atomic/{fqn}/exp_avg.pt exists"
            continue
        for k in ("exp_avg", "exp_avg_sq"):
            same(torch.load(os.path.join(d, k + ".pt"))["param"], st[k].float(), f"atomic/{fqn}/{k}.pt")
        if fqn in split:
            same(torch.load(os.path.join(d, "step.pt")), st["step"], f"atomic/{fqn}/step.pt")


def group_fields(g):
    return {k: v for k, v in g.items() if k not in ("params", "param_names")}


def check_resume(mnt, truth, mod):
    rank = os.path.join(mnt, "target", "tp1_pp1_dp1", "rank_0")
    sd = torch.load(os.path.join(rank, "model.pt"))
    model = mod.build_model()
    model.load_state_dict(sd, strict=True)
    for fqn, w in truth["model"].items():
        same(sd[fqn], w, f"model.pt[{fqn}]")
    opt = mod.make_optimizer(model)
    names = [n for n, _ in model.named_parameters()]
    optim_sd = torch.load(os.path.join(rank, "optim.pt"))
    if hasattr(mod, "load_optimizer"):  # the optimizer and what else the framework resumes
        mod.load_optimizer(opt, optim_sd, torch.load(os.path.join(rank, "extra_state.pt"), weights_only=False))
    else:
        opt.load_state_dict(optim_sd)
    torch_opt = getattr(mod, "torch_optimizer", lambda o: o)(opt)
    # The optimizer now holds exactly the live job's groups and state.
    want_groups = truth["optim"]["param_groups"]
    got_groups = torch_opt.state_dict()["param_groups"]
    assert len(got_groups) == len(want_groups), f"{len(got_groups)} param groups, want {len(want_groups)}"
    for i, (g, w) in enumerate(zip(got_groups, want_groups)):
        assert group_fields(g) == group_fields(w), f"param_groups[{i}]: {group_fields(g)} != {group_fields(w)}"
        assert [names[p] for p in g["params"]] == list(w["params"]), f"param_groups[{i}] params"
    params = dict(model.named_parameters())
    for fqn, st in truth["optim"]["state"].items():
        got = torch_opt.state[params[fqn]]
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                same(got[k], v, f"optim state {fqn}.{k}")
            else:
                assert got[k] == v, f"optim state {fqn}.{k}: {got[k]!r} != {v!r}"
    losses = [mod.train_step(model, opt, mod.data(truth["seed"], truth["steps"] + j))
              for j in range(len(truth["continue_losses"]))]
    want = [float(x).hex() for x in truth["continue_losses"]]
    assert [x.hex() for x in losses] == want, f"resumed losses {losses} != uninterrupted {truth['continue_losses']}"


def check_second_layout(mnt, truth, case):
    layout = case.second_layout
    base = os.path.join(mnt, "target", layout)
    ranks = sorted(os.listdir(base))
    assert ranks, f"target/{layout} is empty"
    for r in ranks:
        rank = int(r.split("_")[1])
        sd = torch.load(os.path.join(base, r, "model.pt"))
        assert set(sd) == set(truth["model"]), f"{layout}/{r}: {sorted(sd)}"
        for fqn, w in truth["model"].items():
            same(sd[fqn], case.slicer(w, fqn, rank), f"{layout}/{r}/model.pt[{fqn}]")
        optim = torch.load(os.path.join(base, r, "optim.pt"))
        # Positions are the optimizer's parameters (named in each group), not model.pt's keys.
        order = {i: n for g in optim["param_groups"] for i, n in zip(g["params"], g["param_names"])}
        assert sorted(order.values()) == sorted(truth["optim"]["state"]), f"{layout}/{r}/optim.pt param_names"
        for i, st in optim["state"].items():
            want = truth["optim"]["state"][order[i]]
            for k in ("exp_avg", "exp_avg_sq"):
                same(st[k], case.slicer(want[k], order[i], rank), f"{layout}/{r}/optim.pt {order[i]}.{k}")


def main():
    res = Results(NAME)
    chosen = [c for c in CASES if len(sys.argv) < 2 or c.label in sys.argv[1:]]
    with tmpdir("ucpfs-producers-dcp-") as tmp:
        generated = {}  # (script, args) -> its OUTDIR, or None when it failed
        for case in chosen:
            key = (case.script, tuple(case.args))
            if key not in generated:
                out = os.path.join(tmp, f"gen{len(generated)}")
                try:
                    if case.shared:
                        out = fixture(case.shared, os.path.join(tmp, f"gen{len(generated)}"))
                    else:
                        run([PY, os.path.join(FIXTURES, case.script), out, *case.args], timeout=300)
                    generated[key] = out
                except AssertionError as e:
                    generated[key] = None
                    res.check(f"{case.label}: generate", lambda e=e: (_ for _ in ()).throw(e))
            out = generated[key]
            if out is None:
                continue
            truth = torch.load(os.path.join(out, "truth.pt"), weights_only=False)
            src = os.path.join(out, case.mount or truth["checkpoint"])
            mnt = os.path.join(tmp, case.label + "-mnt")
            with mounted(src, mnt, "--layout", "tp1_pp1_dp1", "--layout", case.second_layout,
                         *mount_facts(case, tmp)) as (m, _):
                res.check(f"{case.label}: status names no unmapped key and no ambiguity",
                          lambda: check_status(m, truth, case))
                res.check(f"{case.label}: atomic weights and moments equal the live job's",
                          lambda: check_atomic(m, truth, case))
                if case.views_only:
                    continue
                res.check(f"{case.label}: tp1 model.pt loads strictly, optim.pt loads and resumes the same losses",
                          lambda: check_resume(m, truth, case.module))
                res.check(f"{case.label}: {case.second_layout} equals the truth's slices",
                          lambda: check_second_layout(m, truth, case))
    res.finish()


if __name__ == "__main__":
    main()
