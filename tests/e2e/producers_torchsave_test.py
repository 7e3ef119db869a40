"""End-to-end: training state that frameworks save with torch.save / safetensors (issue 23).

Each checkpoint is saved by the framework's own recipe (tests/e2e/fixtures/gen_hf_trainer.py,
gen_lightning.py, gen_torchtune.py; shared fixtures, generated once per CTest run by
shared_fixtures.py, or here when run alone) and mounted at the folder a user would pick:
  - hf_trainer: the Trainer's `checkpoint-K/` (model.safetensors, optimizer.pt with positions in
    the Trainer's decay / no-decay groups, scheduler.pt, trainer_state.json); hf_trainer_gpt2 the
    same for a GPT-2 (its nn.LayerNorm weights are kept out of decay by type; no tp2 check);
  - lightning: the folder of ModelCheckpoint's `.ckpt`;
  - torchtune: the checkpointer's output_dir (`epoch_0/` with Hugging Face safetensors,
    `recipe_state/recipe_state.pt` with the optimizer): torchtune trains its own llama3 module,
    whose MLP order (w1, w2, w3) and rotary q/k row layout differ from LlamaForCausalLM's; the
    served moments follow the saved weights' layout, and the resumed LlamaForCausalLM (another
    implementation of the same model) repeats the live losses to 1e-5;
  - hf_trainer_zero2 / hf_trainer_zero3: the Trainer with DeepSpeed ZeRO-2 / ZeRO-3
    (gen_hf_trainer.py --deepspeed): `checkpoint-K/` with `latest` and `global_stepK/`, served by
    the DeepSpeed scanner under the Hugging Face model's names; one param group (the Trainer hands
    DeepSpeed's optimizer all parameters), format deepspeed, nothing of the param groups unserved;
    DeepSpeed's engine clips the gradients, so the resume clips alike and repeats the losses to 1e-5.
Checks per case, against the truth the live job gave:
 1. status.json: format torch_state (deepspeed), no unmapped key, nothing ambiguous, the
    optimizer's param groups served;
 2. atomic/<name>/{fp32,exp_avg,exp_avg_sq}.pt equal the live weights and moments bit for bit,
    step.pt the live step;
 3. target/tp1_pp1_dp1/rank_0/model.pt loads with load_state_dict(strict=True) into a fresh
    LlamaForCausalLM; optim.pt loads into a fresh AdamW of that model grouped as the framework
    groups it (the Trainer: its get_decay_parameter_names; Lightning, torchtune: one group), its param groups carry the live hyper-parameters, and 3 more steps give the live job's
    losses exactly;
 4. target/tp2_pp1_dp1: each rank's model.pt and optim.pt moments are the truth's slices.
And: the Trainer's checkpoint with config.json naming a model family whose module order is not
known is named ambiguous in status.json (nothing guessed), and --rules mapping the
`optimizer.state.ambiguous.<i>.*` keys settles it (atomic moments = truth).
Several .ckpt files without last.ckpt, or two optimizer files, are refused naming them; a truncated
optim.pt, optimizer.pt or .ckpt is named with the zip reader's reason (inspect, mount, and a run
folder's status.json).
A Lightning .ckpt renamed to model.pt is still recognised by structure.
torch's legacy format (a script's model.pt + optim.pt saved with
_use_new_zipfile_serialization=False, under torch 2.13 and 1.13) is served alike; a directory
whose only .bin is no torch.save file mounts with no views, the reason in status.json.
Pickled under both interpreters we ship: the Trainer, Lightning and torchtune cases also run under
Debian 12's Python 3.11.2 (tests/install-python-debian.sh, the venv's torch 2.13), checked the
same way (debian_*); a script's model.pt + optim.pt saved under the venv's torch 2.13 and under
Debian's Python with its torch 1.13 (when /usr/bin/python3 has torch): atomic = live job, strict
load, optim load. pickletools shows where Debian's pickles differ: the Trainer's
training_args.bin (its enums by name, getattr(IntervalStrategy, 'NO'), not by value) and torch
1.13's optim.pt (its Adam groups lack decoupled_weight_decay). Lightning's .ckpt, torchtune's
recipe_state.pt and the Trainer's optimizer.pt, scheduler.pt and rng_state.pth hold no enum or
class pickled by value or name that differs: the same opcodes under both Pythons (both torches
pickle with protocol 2), which the test prints rather than asserts.
And the empty-directory probe: a mount of an empty directory receives model.pt (a state dict) and
optim.pt (an optimizer state dict) by torch.save; its remount serves them as weights + positional
optimizer (atomic moments equal what was saved).

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/producers_torchsave_test.py
"""
import json
import os
import pickletools
import shutil
import sys
import zipfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
sys.path.insert(0, HERE)
from e2e_common import Results, bits_equal, run, tmpdir, ucpfs_bin  # noqa: E402
from mount_common import PY, mounted, status  # noqa: E402
from shared_fixtures import fixtures  # noqa: E402
from weights_only_test import mount_fails, tp_piece  # noqa: E402

import gen_hf_trainer  # noqa: E402

LAYOUTS = ("--layout", "tp1_pp1_dp1", "--layout", "tp2_pp1_dp1")


def check_status(m, fmt):
    s = status(m)
    assert s["format"] == fmt, f"format: {s['format']}"
    groups = [n for n in s.get("not_served", []) if "param_groups" in n.get("key", "")]
    assert not groups, f"param groups not served: {groups}"
    assert not s.get("unmapped_keys"), f"unmapped: {s.get('unmapped_keys')}"
    amb = [n for n in s.get("not_served", []) if "ambiguous" in n["reason"] or "not matched" in n["reason"]]
    assert not amb, f"ambiguous: {amb}"


def check_atomic(m, truth):
    names = sorted(truth["weights"])
    assert sorted(os.listdir(os.path.join(m, "atomic"))) == names, "atomic/ lists exactly the parameters"
    for n in names:
        got = torch.load(os.path.join(m, "atomic", n, "fp32.pt"))["param"]
        assert bits_equal(got, truth["weights"][n].float()), f"atomic {n} fp32"
        for k in ("exp_avg", "exp_avg_sq"):
            got = torch.load(os.path.join(m, "atomic", n, k + ".pt"))["param"]
            assert bits_equal(got, truth[k][n]), f"atomic {n} {k}"
        step = torch.load(os.path.join(m, "atomic", n, "step.pt"))
        step = step["param"] if isinstance(step, dict) else step
        assert torch.equal(torch.as_tensor(step), truth["step"][n]), f"atomic {n} step {step}"


def check_resume(m, truth, groups_of, exact=True):
    d = os.path.join(m, "target", "tp1_pp1_dp1", "rank_0")
    model = gen_hf_trainer.make_model(1234, truth.get("model", "llama"))
    model.load_state_dict(torch.load(os.path.join(d, "model.pt")), strict=True)
    opt = torch.optim.AdamW(groups_of(model))
    o = torch.load(os.path.join(d, "optim.pt"), weights_only=False)
    opt.load_state_dict(o)
    names = {p: n for n, p in model.named_parameters()}
    for g, want in zip(opt.param_groups, truth["groups"]):
        members = [names[p] for p in g["params"]]
        # torchtune's module registers its MLP as w1, w2, w3 (gate, down, up): another order.
        assert (members if exact else sorted(members)) == (want["names"] if exact else sorted(want["names"])), \
            "group members"
        for k, v in want.items():
            if k != "names":
                assert g.get(k) == v, f"group {k}: {g.get(k)} != {v}"
    for p, n in names.items():
        assert torch.equal(opt.state[p]["step"], truth["step"][n]), f"step {n}"
    losses = []
    model.train()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for b in truth["batches"]:
        loss = model(**b).loss
        loss.backward()
        if truth.get("clip"):  # DeepSpeed's engine.step() clips the gradients' global norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), truth["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if exact and not truth.get("clip"):
        assert losses == truth["losses"], f"resumed losses {losses} != {truth['losses']}"
    else:  # another implementation of the same model or of clipping: equal to float rounding
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, truth["losses"])), \
            f"resumed losses {losses} !~ {truth['losses']}"


def check_tp2(m, truth):
    for r in range(2):
        d = os.path.join(m, "target", "tp2_pp1_dp1", f"rank_{r}")
        sd = torch.load(os.path.join(d, "model.pt"))
        assert set(sd) == set(truth["weights"]), "tp2 names"
        o = torch.load(os.path.join(d, "optim.pt"), weights_only=False)
        order = list(sd)
        for i, n in enumerate(order):
            assert bits_equal(sd[n], tp_piece(n, truth["weights"][n], 2, r).contiguous()), f"tp2 rank {r} {n}"
            for k in ("exp_avg", "exp_avg_sq"):
                want = tp_piece(n, truth[k][n], 2, r).contiguous()
                assert bits_equal(o["state"][i][k], want), f"tp2 rank {r} {n} {k}"


def trainer_groups(model):
    return gen_hf_trainer.trainer_param_groups(model, 0.01, 1e-2)


def deepspeed_groups(model):
    # The Trainer hands DeepSpeed's optimizer every trainable parameter as one group.
    return [{"params": [p for p in model.parameters() if p.requires_grad]}]


def one_group(model):
    return [{"params": list(model.parameters())}]


def check_case(res, name, src, mnt, truth, groups_of, exact=True, fmt="torch_state"):
    with mounted(src, mnt, "--read-only", *LAYOUTS, "--index-dir", mnt + ".idx") as (m, _):
        res.check(f"{name}: recognised, mapped, not ambiguous", lambda: check_status(m, fmt))
        res.check(f"{name}: atomic weights, moments, step = live job", lambda: check_atomic(m, truth))
        res.check(f"{name}: model.pt strict, optim.pt loads, resume = live losses",
                  lambda: check_resume(m, truth, groups_of, exact))
        if truth.get("model", "llama") == "llama":  # tp_piece knows the Hugging Face Llama preset
            res.check(f"{name}: tp2_pp1_dp1 = truth slices", lambda: check_tp2(m, truth))


def empty_dir_probe(work):
    src, mnt = os.path.join(work, "probe_src"), os.path.join(work, "probe_mnt")
    os.makedirs(src)
    model = gen_hf_trainer.make_model(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = gen_hf_trainer.batches(3, 1)[0]
    model(**b).loss.backward()
    opt.step()
    with mounted(src, mnt, "--index-dir", mnt + ".idx") as (m, _):
        torch.save(model.state_dict(), os.path.join(m, "model.pt"))
        torch.save(opt.state_dict(), os.path.join(m, "optim.pt"))
    with mounted(src, mnt, "--read-only", "--index-dir", mnt + ".idx2") as (m, _):
        s = status(m)
        assert s["format"] == "torch_state", f"not recognised: {s['format']} {s.get('not_served')}"
        names = {p: n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            got = torch.load(os.path.join(m, "atomic", names[p], "exp_avg.pt"))["param"]
            assert bits_equal(got, st["exp_avg"]), names[p]
        o = torch.load(os.path.join(m, "target", "tp1_pp1_dp1", "rank_0", "optim.pt"), weights_only=False)
        fresh = gen_hf_trainer.make_model(9)
        fresh.load_state_dict(torch.load(os.path.join(m, "target", "tp1_pp1_dp1", "rank_0", "model.pt")))
        torch.optim.AdamW(fresh.parameters()).load_state_dict(o)
        assert o["param_groups"][0]["lr"] == 1e-3


def ambiguous_then_rules(work, ckpt, truth):
    """The Trainer's checkpoint with config.json naming a model family whose module order ucpfs
    does not know: model.safetensors keeps no parameter order, so the positions are named
    ambiguous in status.json (never guessed); --rules mapping each position settles it."""
    src = os.path.join(work, "amb")
    shutil.copytree(ckpt, src)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["model_type"] = "some_new_model"
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    mnt = os.path.join(work, "mnt-amb")
    with mounted(src, mnt, "--read-only", "--index-dir", mnt + ".idx") as (m, _):
        amb = [n for n in status(m)["not_served"] if "not matched to parameter names" in n["reason"]]
        assert amb and "keep no parameter order" in amb[0]["reason"], status(m)["not_served"]
        assert not os.path.exists(os.path.join(m, "atomic", "lm_head.weight", "exp_avg.pt"))
    order = [n for g in truth["groups"] for n in g["names"]]  # positions: the groups' params in order
    rules = {"rules": [{"pattern": rf"^optimizer\.state\.ambiguous\.{i}\.(exp_avg|exp_avg_sq|step)$",
                        "param": name, "state": "$1"} for i, name in enumerate(order)]}
    path = os.path.join(work, "rules.json")
    json.dump(rules, open(path, "w"))
    with mounted(src, mnt, "--read-only", "--rules", path, "--index-dir", mnt + ".idx2") as (m, _):
        s = status(m)
        assert not [n for n in s["not_served"] if "not matched" in n["reason"]], s["not_served"]
        for n in order:
            for k in ("exp_avg", "exp_avg_sq"):
                got = torch.load(os.path.join(m, "atomic", n, k + ".pt"))["param"]
                assert bits_equal(got, truth[k][n]), f"{n} {k}"


def renamed_ckpt(work, ckpt_dir, truth):
    """Lightning's .ckpt renamed to model.pt (the only file of its folder): recognised by its
    structure (state_dict + optimizer_states), its optimizer state served, not dropped."""
    src = os.path.join(work, "renamed")
    os.makedirs(src)
    shutil.copy(os.path.join(ckpt_dir, os.listdir(ckpt_dir)[0]), os.path.join(src, "model.pt"))
    mnt = os.path.join(work, "mnt-renamed")
    with mounted(src, mnt, "--read-only", "--index-dir", mnt + ".idx") as (m, _):
        assert status(m)["flavor"] == "lightning", status(m)["flavor"]
        check_atomic(m, truth)


# A script's own torch.save of its model and optimizer (no framework), with the truth of the live job.
SCRIPT_PRODUCER = r"""
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(2):
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
# "legacy": torch's format before 1.6, still one argument away (no zip; tensors after 5 pickles)
kw = {"_use_new_zipfile_serialization": False} if sys.argv[2:] == ["legacy"] else {}
torch.save(model.state_dict(), sys.argv[1] + "/model.pt", **kw)
torch.save(opt.state_dict(), sys.argv[1] + "/optim.pt", **kw)
names = {p: n for n, p in model.named_parameters()}
truth = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "lr": 1e-3}
for k in ("exp_avg", "exp_avg_sq", "step"):
    truth[k] = {names[p]: s[k].clone() for p, s in opt.state.items()}
torch.save(truth, sys.argv[1] + "_truth.pt")
"""


def script_files(work, python, name, legacy=False):
    """model.pt + optim.pt saved by a plain script under `python` (in torch's legacy format with
    `legacy`): atomic = the live job, model.pt loads strictly into the script's model, optim.pt
    into its optimizer."""
    src = os.path.join(work, name)
    os.makedirs(src)
    run([python, "-c", SCRIPT_PRODUCER, src] + (["legacy"] if legacy else []), timeout=120)
    for f in ("model.pt", "optim.pt"):
        assert zipfile.is_zipfile(os.path.join(src, f)) != legacy, f"{f}: legacy {legacy}"
    truth = torch.load(src + "_truth.pt")
    mnt = os.path.join(work, "mnt-" + name)
    with mounted(src, mnt, "--read-only", "--index-dir", mnt + ".idx") as (m, _):
        assert status(m)["format"] == "torch_state", status(m)["format"]
        check_atomic(m, truth)
        d = os.path.join(m, "target", "tp1_pp1_dp1", "rank_0")
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
        model.load_state_dict(torch.load(os.path.join(d, "model.pt")), strict=True)
        opt = torch.optim.Adam(model.parameters())
        opt.load_state_dict(torch.load(os.path.join(d, "optim.pt"), weights_only=False))
        assert opt.param_groups[0]["lr"] == truth["lr"], opt.param_groups[0]
        names = {p: n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert bits_equal(st[k], truth[k][names[p]]), f"optim.pt {names[p]} {k}"
    return src


def pickle_ops(path):
    """The opcodes (name, argument) of the pickle in a torch.save file (data.pkl) or a plain pickle."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    else:
        data = open(path, "rb").read()
    return [(op.name, arg) for op, arg, _ in pickletools.genops(data)]


def by_name(ops):
    """Enum members pickled by name (`getattr(Enum, 'NAME')`, CPython 3.11.2's Enum.__reduce_ex__)
    rather than by value (`Enum(value)`, later CPython 3.11 releases)."""
    return sum(1 for op, arg in ops if op == "GLOBAL" and arg in ("__builtin__ getattr", "builtins getattr"))


def pickles_compared(pairs, differ):
    """Each (label, Debian's file, the venv's file) compared by pickletools: where `differ` names
    the label, the two pickles must differ, and Debian's must hold what makes it differ."""
    lines = []
    for label, debian, venv in pairs:
        # Pickled paths (the Trainer's output_dir, ModelCheckpoint's) name the fixture's folder,
        # debian_<producer>/ beside <producer>/: compared without that prefix.
        ops_d = [(op, arg.replace("/debian_", "/") if isinstance(arg, str) else arg) for op, arg in pickle_ops(debian)]
        ops_v = pickle_ops(venv)
        lines.append(f"{label}: {'differs' if ops_d != ops_v else 'same opcodes'} "
                     f"({len(ops_d)} / {len(ops_v)} ops, enums by name {by_name(ops_d)} / {by_name(ops_v)})")
        if label in differ:
            assert ops_d != ops_v, f"{label}: Debian's pickle is the venv's, op for op"
            assert differ[label](ops_d, ops_v), f"{label}: {lines[-1]}"
    print("producers_torchsave: pickles, Debian's Python / the venv's:\n  " + "\n  ".join(lines), flush=True)


def refusals(work, ckpt_dir):
    """Choices ucpfs does not make: several .ckpt files without last.ckpt, two optimizer files."""
    two = os.path.join(work, "two_ckpt")
    os.makedirs(two)
    ckpt = os.path.join(ckpt_dir, os.listdir(ckpt_dir)[0])
    for name in ("epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"):
        shutil.copy(ckpt, os.path.join(two, name))
    mount_fails(two, os.path.join(work, "mnt-two_ckpt"), "no last.ckpt")
    optims = os.path.join(work, "two_optim")
    os.makedirs(optims)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    torch.save(model.state_dict(), os.path.join(optims, "model.pt"))
    for name in ("optim_a.pt", "optim_b.pt"):
        torch.save(opt.state_dict(), os.path.join(optims, name))
    mount_fails(optims, os.path.join(work, "mnt-two_optim"), "optim_a.pt, optim_b.pt")


def corrupt_optimizer(work, script_src, trainer_ckpt, ckpt_dir):
    """A truncated optimizer file is named, with the zip reader's reason, where the user looks:
    a script's optim.pt beside model.pt (`ucpfs inspect`, `ucpfs mount`), the Trainer's
    optimizer.pt (`ucpfs mount`; and, mounting the Trainer's output_dir, status.json lists the
    newest checkpoint-N/ with that reason while the one before is served), a Lightning .ckpt."""
    def truncated(src, name, dst):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".ucpfs"))
        path = os.path.join(dst, name)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        return dst
    reason = "offset 0: no end-of-central-directory record"
    bad = truncated(script_src, "optim.pt", os.path.join(work, "bad_script"))
    r = run([ucpfs_bin(), "inspect", bad], check=False, timeout=60)
    assert r.returncode != 0 and "bad_script/optim.pt: " + reason in r.stderr, r.stderr
    mount_fails(bad, os.path.join(work, "mnt-bad_script"), "bad_script/optim.pt: " + reason)
    ckpt = os.listdir(ckpt_dir)[0]
    lightning = truncated(ckpt_dir, ckpt, os.path.join(work, "bad_lightning"))
    mount_fails(lightning, os.path.join(work, "mnt-bad_lightning"), ckpt + ": " + reason)
    out = os.path.join(work, "bad_trainer")
    shutil.copytree(trainer_ckpt, os.path.join(out, "checkpoint-3"), ignore=shutil.ignore_patterns(".ucpfs"))
    trainer = truncated(trainer_ckpt, "optimizer.pt", os.path.join(out, "checkpoint-6"))
    mount_fails(trainer, os.path.join(work, "mnt-bad_trainer"), "checkpoint-6/optimizer.pt: " + reason)
    mnt = os.path.join(work, "mnt-bad_trainer_run")
    with mounted(out, mnt, "--read-only", "--index-dir", mnt + ".idx") as (m, _):
        run_status = status(m)["run"]
        assert run_status["newest"] == "checkpoint-3", run_status
        listed = {c["name"]: c.get("error", "") for c in run_status["checkpoints"]}
        assert "checkpoint-6/optimizer.pt: " + reason in listed["checkpoint-6"], listed


def not_torch_bin(work):
    """A directory whose only candidate is some other program's data.bin: `ucpfs index` says so,
    and a mount serves the directory (its files, a save target) with no views, the reason in
    status.json; a save into it then becomes the checkpoint."""
    src, mnt = os.path.join(work, "not_torch"), os.path.join(work, "mnt-not_torch")
    os.makedirs(src)
    data = os.urandom(4096)
    with open(os.path.join(src, "data.bin"), "wb") as f:
        f.write(data)
    r = run([ucpfs_bin(), "index", src, "--index-dir", mnt + ".idx0"], check=False, timeout=60)
    assert r.returncode != 0 and "data.bin: not a torch.save file" in r.stderr, r.stderr
    with mounted(src, mnt, "--index-dir", mnt + ".idx") as (m, _):
        s = status(m)
        assert s["format"] == "none" and "data.bin: not a torch.save file" in s["no_checkpoint"], s
        assert open(os.path.join(m, "data.bin"), "rb").read() == data
        model = torch.nn.Linear(3, 2)
        torch.save(model.state_dict(), os.path.join(m, "model.pt"))
    with mounted(src, mnt, "--read-only", "--index-dir", mnt + ".idx2") as (m, _):
        got = torch.load(os.path.join(m, "atomic", "weight", "fp32.pt"))["param"]
        assert bits_equal(got, model.weight.detach()), "atomic weight"


def has_torch113():
    return run(["/usr/bin/python3", "-c", "import torch"], check=False).returncode == 0


def torch_param_group_keys(ops):
    """The keys a pickled optimizer state dict's param groups carry (the short strings pickled)."""
    return {arg for op, arg in ops if op in ("BINUNICODE", "SHORT_BINUNICODE") and isinstance(arg, str)}


# The torch.save producers' fixtures (shared_fixtures.py: generated once per CTest run, else here).
VENV = ("hf_trainer", "lightning", "torchtune", "hf_trainer_gpt2", "hf_trainer_zero2", "hf_trainer_zero3")
DEBIAN = ("debian_hf_trainer", "debian_lightning", "debian_torchtune")


def main():
    res = Results("producers_torchsave")
    with tmpdir("ucpfs-torchsave-") as work:
        fx = fixtures(VENV + DEBIAN, work)
        hf, lt, tt, gpt2, z2, z3 = (fx[n] for n in VENV)
        cases = [("hf_trainer", os.path.join(hf, "checkpoint-3"), torch.load(os.path.join(hf, "truth.pt")),
                  trainer_groups),
                 ("lightning", os.path.join(lt, "ckpt"), torch.load(os.path.join(lt, "truth.pt")), one_group),
                 ("torchtune", os.path.join(tt, "out"), torch.load(os.path.join(tt, "truth.pt")), one_group),
                 ("hf_trainer_gpt2", os.path.join(gpt2, "checkpoint-3"), torch.load(os.path.join(gpt2, "truth.pt")),
                  trainer_groups)]
        # The same producers under Debian 12's Python 3.11.2 (tests/install-python-debian.sh), whose
        # pickler writes enums by name: served alike.
        d_hf, d_lt, d_tt = (fx[n] for n in DEBIAN)
        cases += [("debian_hf_trainer", os.path.join(d_hf, "checkpoint-3"),
                   torch.load(os.path.join(d_hf, "truth.pt")), trainer_groups),
                  ("debian_lightning", os.path.join(d_lt, "ckpt"), torch.load(os.path.join(d_lt, "truth.pt")),
                   one_group),
                  ("debian_torchtune", os.path.join(d_tt, "out"), torch.load(os.path.join(d_tt, "truth.pt")),
                   one_group)]
        for name, src, truth, groups_of in cases:
            # torchtune trained its own llama3 module; the served files load into LlamaForCausalLM.
            check_case(res, name, src, os.path.join(work, "mnt-" + name), truth, groups_of, "torchtune" not in name)
        # The Trainer with DeepSpeed: checkpoint-K/ holds `latest` and global_stepK/ (the DeepSpeed scanner).
        for name, out in (("hf_trainer_zero2", z2), ("hf_trainer_zero3", z3)):
            check_case(res, name, os.path.join(out, "checkpoint-3"), os.path.join(work, "mnt-" + name),
                       torch.load(os.path.join(out, "truth.pt")), deepspeed_groups, fmt="deepspeed")
        res.check("hf_trainer, unknown module order: ambiguous in status.json, --rules settles it",
                  lambda: ambiguous_then_rules(work, cases[0][1], cases[0][2]))
        res.check("empty dir + torch.save model.pt, optim.pt: remount serves them", lambda: empty_dir_probe(work))
        res.check("lightning .ckpt renamed to model.pt: optimizer served", lambda: renamed_ckpt(work, lt + "/ckpt",
                                                                                              cases[1][2]))
        res.check("several .ckpt or optimizer files: refused, naming them", lambda: refusals(work, lt + "/ckpt"))
        scripts = {}

        def script(python, name):
            scripts[name] = script_files(work, python, name)
        res.check("a script's model.pt + optim.pt (torch 2.13): atomic = live job, strict load, optim load",
                  lambda: script(PY, "script"))
        if has_torch113():
            res.check("the same script under Debian's Python 3.11.2 and torch 1.13: served alike",
                      lambda: script("/usr/bin/python3", "script_torch113"))
        # torch's legacy format (_use_new_zipfile_serialization=False), under both torches.
        res.check("the script saving torch's legacy format (torch 2.13): served alike",
                  lambda: script_files(work, PY, "script_legacy", legacy=True))
        if has_torch113():
            res.check("the script saving torch's legacy format (torch 1.13): served alike",
                      lambda: script_files(work, "/usr/bin/python3", "script_torch113_legacy", legacy=True))
        res.check("a .bin that is no torch.save file: mounted with no views, named in status.json",
                  lambda: not_torch_bin(work))
        res.check("a truncated optim.pt / optimizer.pt / .ckpt: named with the zip reader's reason "
                  "(inspect, mount, a run folder's status.json)",
                  lambda: corrupt_optimizer(work, scripts["script"], cases[0][1], lt + "/ckpt"))

        def compared():
            ckpt = {d: os.path.join(d, "ckpt", os.listdir(os.path.join(d, "ckpt"))[0]) for d in (lt, d_lt)}
            pairs = [(f"hf_trainer {f}", os.path.join(d_hf, "checkpoint-3", f), os.path.join(hf, "checkpoint-3", f))
                     for f in ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth")]
            pairs += [("lightning .ckpt", ckpt[d_lt], ckpt[lt]),
                      ("torchtune recipe_state.pt", os.path.join(d_tt, "out", "recipe_state", "recipe_state.pt"),
                       os.path.join(tt, "out", "recipe_state", "recipe_state.pt"))]
            differ = {"hf_trainer training_args.bin": lambda d, v: by_name(d) > 0 and by_name(v) == 0}
            if "script_torch113" in scripts:
                pairs.append(("script optim.pt (torch 1.13 / 2.13)", os.path.join(scripts["script_torch113"], "optim.pt"),
                              os.path.join(scripts["script"], "optim.pt")))
                # torch 2.13's Adam param groups carry one key torch 1.13's do not.
                differ["script optim.pt (torch 1.13 / 2.13)"] = \
                    lambda d, v: torch_param_group_keys(v) - torch_param_group_keys(d) == {"decoupled_weight_decay"}
            pickles_compared(pairs, differ)
        res.check("pickletools: Debian's pickles differ where they should (enums by name)", compared)
    res.finish()


if __name__ == "__main__":
    main()
