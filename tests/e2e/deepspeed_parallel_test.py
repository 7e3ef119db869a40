"""End-to-end: tensor- and pipeline-parallel Megatron-DeepSpeed checkpoints (issue 9), real FUSE.

The real DeepSpeed 0.19.8 engine (fixtures/gen_megatron_deepspeed.py, CPU, gloo: our own
Megatron-style tensor-parallel layers behind an mpu, and DeepSpeed's PipelineModule /
PipelineEngine with a tied embedding) trains a tiny GPT with Megatron-DeepSpeed names and
universal_checkpoint_info, and saves, for each case:
  tp2 (dp2, ZeRO-1), tp2_zero2_bf16 (dp2, ZeRO-2 bf16), pp2 (dp2, layer files, mp rank =
  stage), pp2_tp2 (dp1, mp rank = stage * 2 + tp), and with grouped-query attention (4 query /
  2 key-value heads, a fused QKV declared by parameter_with_sub_params and version-0.4
  sub_param_shard_widths as AutoTP writes it): tp2_gqa and pp2_tp2_gqa_bf16; and tp2_average
  (the layer norms in parameter_to_average_patterns, each tp rank's copy different: served as
  ds_to_universal's sum(slices) / len(slices)), also in bf16 (tp2_average_bf16: the module
  weight is that fp32 mean rounded to bf16, as DeepSpeed's universal loader makes it).
For each, mounted at the save directory (`latest` -> global_step3/):
 1. `ucpfs index` names the degrees in the flavor (tp2, pp2, dp);
 2. every atomic/<param>/{fp32,exp_avg,exp_avg_sq}.pt equals the live engine's full tensor
    (each tp rank's safe_get_full_fp32_param / safe_get_full_optimizer_state merged by the
    Megatron split: column and vocabulary along dim 0, row-parallel along dim 1, SwiGLU
    [gates; ups], replicated from rank 0, averaged as ds_to_universal averages) bit for bit;
 3. global_step3_universal/ equals, file by file, what the installed ds_to_universal writes for
    the same tag (which the generator checked against the same truth), and latest_universal
    names it;
 4. target/tp1_pp1_dp1/rank_0/model.pt holds every parameter, equal to the engine's fp32 master
    (bf16 cases: rounded to bf16, the module the engine keeps; the module / layer-file weights
    placed from every tp rank and stage; the
    vocabulary padded as Megatron pads it for tp 1 by the saved args' make_vocab_size_divisible_by,
    its stored rows as stored up to there), and
    optim.pt carries DeepSpeed's two param groups with their hyper-parameters (weight decay 0.1
    for the weights, 0.0 for biases and norms);
 5. tp 2 saves (tp2, tp2_zero2_bf16, tp2_gqa, tp2_average): target/tp2_pp1_dp1/rank_r is tp rank
    r of the job: model.pt = the module tp rank r saved, fp32 master and moments = DeepSpeed's own
    universal loader's slice for tp rank r (the vocabulary padded by make_vocab_size_divisible_by
    of Megatron-DeepSpeed's saved args, the fused QKV split by its query groups, num_key_value_heads,
    or, with GQA declared as AutoTP declares it, per sub-parameter).
Inconsistent parallel saves give a clear error naming the file: a missing tp rank's optimizer
partition, tp slices of disagreeing shapes.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/deepspeed_parallel_test.py
"""
import os
import shutil
import sys

import torch

from deepspeed_sources_test import atomic_equals_truth, clean_error, ds_to_universal, universal_equals
from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import mounted

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "fixtures", "gen_megatron_deepspeed.py")
# name -> (generator arguments, flavor the index reports)
CASES = {
    "tp2": (["--case", "tp2"], "zero1 tp2 dp2"),
    "tp2_zero2_bf16": (["--case", "tp2", "--zero", "2", "--bf16"], "zero2 tp2 dp2"),
    "pp2": (["--case", "pp2"], "zero1 pp2 dp2"),
    "pp2_tp2": (["--case", "pp2_tp2"], "zero1 tp2 pp2 dp1"),
    "tp2_gqa": (["--case", "tp2", "--gqa"], "zero1 tp2 dp2"),
    # Layer norms in parameter_to_average_patterns, each tp rank's copy different: served as
    # ds_to_universal's sum(slices) / len(slices), bit for bit.
    "tp2_average": (["--case", "tp2", "--average"], "zero1 tp2 dp2"),
    # The same in bf16: the averaged module weight is the fp32 masters' mean rounded to bf16, as
    # DeepSpeed's universal loader makes it (lp_param.copy_(hp_param)), to the last bit.
    "tp2_average_bf16": (["--case", "tp2", "--average", "--bf16"], "zero1 tp2 dp2"),
    # DeepSpeed's PipelineEngine runs ZeRO-1 only.
    "pp2_tp2_gqa_bf16": (["--case", "pp2_tp2", "--gqa", "--bf16"], "zero1 tp2 pp2 dp1"),
}


def check_case(work, case):
    args, flavor = CASES[case]
    src = os.path.join(work, case)
    run([sys.executable, GEN, "save", src] + args, timeout=600)
    truth = torch.load(src + "_truth.pt")
    r = run([ucpfs_bin(), "index", src], timeout=120)
    assert f"deepspeed ({flavor} tag global_step3)" in r.stderr + r.stdout, r.stderr + r.stdout
    tp2 = "--case" in args and args[args.index("--case") + 1] == "tp2"
    layouts = ["--layout", "tp1_pp1_dp1"] + (["--layout", "tp2_pp1_dp1"] if tp2 else [])
    with mounted(src, os.path.join(work, "mnt-" + case), *layouts) as (m, _):
        n = atomic_equals_truth(m, truth)
        assert n == 3 * (len(truth) - 1), n
        ds = ds_to_universal(work, case, src)
        assert open(os.path.join(m, "latest_universal")).read() == "global_step3_universal"
        n_universal = universal_equals(os.path.join(m, "global_step3_universal"),
                                       os.path.join(ds, "global_step3_universal"))
        assert n_universal > 3 * (len(truth) - 1), n_universal
        target_equals_truth(m, truth, src, fp32="--bf16" not in args)
        if tp2:
            target_tp2_equals_job(m, src)
    if "--average" in args:  # plan counts every averaged copy read, and the view's bytes once
        r = run([ucpfs_bin(), "plan", src, "--layout", "tp1_pp1_dp1"], timeout=120)
        assert "read amplification" in r.stdout + r.stderr, r.stdout + r.stderr
    return n


def target_equals_truth(m, truth, src, fp32):
    d = os.path.join(m, "target", "tp1_pp1_dp1", "rank_0")
    model = torch.load(os.path.join(d, "model.pt"))
    names = [k for k in truth if k != "__step__"]
    assert sorted(model) == sorted(names), sorted(set(model) ^ set(names))
    # Megatron-DeepSpeed's saved args pad the vocabulary to a multiple of
    # make_vocab_size_divisible_by * tp: 40 rows at tp 1, the stored rows as stored up to there
    # (a tp 2 save stores 48; the rows past 40 do not fit a tp 1 model).
    state = torch.load(os.path.join(src, "global_step3", "mp_rank_00_model_states.pt"), weights_only=False)
    multiple = state["args"].make_vocab_size_divisible_by
    rows = -(-state["universal_checkpoint_info"]["original_vocab_size"] // multiple) * multiple
    for name in names:
        want = truth[name]["fp32"]
        if "word_embeddings" in name or "output_layer" in name:
            want = want[:rows]
        if not fp32:  # the bf16 module the engine keeps (and its universal loader makes): lp.copy_(hp)
            want = want.to(model[name].dtype)
        assert torch.equal(model[name], want), (name, model[name].dtype, model[name].shape, want.shape)
    groups = torch.load(os.path.join(d, "optim.pt"))["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0], groups
    assert all(g["lr"] == 0.01 and tuple(g["betas"]) == (0.9, 0.95) for g in groups), groups
    in_groups = [n for g in groups for n in g["param_names"]]
    assert sorted(in_groups) == sorted(names), sorted(set(in_groups) ^ set(names))


def universal_slice(folder, shape, tp_rank):
    """DeepSpeed's own split of a universal checkpoint parameter for tp rank `tp_rank` of 2
    (universal_checkpoint.load_hp_checkpoint_state, as engine.load_universal_checkpoint calls it
    for each parameter of a tp 2 model whose slice has `shape`): {state: tensor of `shape`}."""
    from types import SimpleNamespace
    from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state
    n = 1
    for d in shape:
        n *= d
    fp32 = torch.empty(n)
    mapping = SimpleNamespace(lp_fragment_address=SimpleNamespace(start=0, numel=n), optim_fragment={},
                              get_hp_fragment=lambda: fp32)
    param = SimpleNamespace(shape=torch.Size(shape), numel=lambda: n, _hp_mapping=mapping)
    load_hp_checkpoint_state(param, folder, tp_rank, 2)
    out = {k: v.view(shape) for k, v in mapping.optim_fragment.items()}
    out["fp32"] = fp32.view(shape)
    return out


def target_tp2_equals_job(m, src):
    """target/tp2_pp1_dp1 of a tp 2 save is the tp 2 job's own state: each rank's model.pt is what
    tp rank r's engine saved as its module (mp_rank_0r_model_states.pt; averaged parameters, whose
    tp copies differ, are served on every rank as the module DeepSpeed's universal loader makes:
    the fp32 masters' mean in the module's dtype), and its fp32 master and Adam moments
    are what DeepSpeed's universal loader cuts for tp rank r from global_step3_universal/ (the
    vocabulary's rows past original_vocab_size, which it zero-pads, are served as stored)."""
    import re
    states = os.path.join(src, "global_step3")
    info = torch.load(os.path.join(states, "mp_rank_00_model_states.pt"), weights_only=False)["universal_checkpoint_info"]
    averaged = info.get("parameter_to_average_patterns", [])
    vocab_rows = info["original_vocab_size"]
    uni = os.path.join(m, "global_step3_universal", "zero")
    for r in range(2):
        d = os.path.join(m, "target", "tp2_pp1_dp1", f"rank_{r}")
        model = torch.load(os.path.join(d, "model.pt"))
        job = torch.load(os.path.join(states, f"mp_rank_{r:02d}_model_states.pt"), weights_only=False)["module"]
        assert sorted(model) == sorted(job), sorted(set(model) ^ set(job))
        optim = torch.load(os.path.join(d, "optim.pt"), weights_only=False)
        index = {n: i for g in optim["param_groups"] for i, n in zip(g["params"], g["param_names"])}
        for name, t in job.items():
            assert model[name].shape == t.shape, (r, name, model[name].shape, t.shape)
            want = universal_slice(os.path.join(uni, name), tuple(t.shape), r)
            if any(re.match(p, name) for p in averaged):  # the module the universal loader makes
                assert torch.equal(model[name], want["fp32"].to(t.dtype)), (r, name)
            else:
                assert torch.equal(model[name], t), (r, name)
            rows = slice(None)
            if "word_embeddings" in name or "output_layer" in name:  # vocabulary: rows past the real ones
                rows = slice(0, max(0, min(t.shape[0], vocab_rows - r * t.shape[0])))
            got = dict(optim["state"][index[name]], fp32=optim["fp32"][name])
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got[k][rows], want[k][rows]), (r, name, k)


def inconsistent_saves(work):
    base = os.path.join(work, "pp2_tp2")
    # tp rank 1 of stage 0 without its optimizer partition.
    d = os.path.join(work, "bad-missing-tp")
    shutil.copytree(base, d, ignore=shutil.ignore_patterns(".ucpfs"))
    os.remove(os.path.join(d, "global_step3", "zero_pp_rank_0_mp_rank_01_optim_states.pt"))
    clean_error([ucpfs_bin(), "index", d], ["mp rank 1 has 0 optimizer partitions"])
    # tp rank 1's model states and partitions swapped for another stage's: its slices no longer
    # make one tensor with rank 0's.
    d = os.path.join(work, "bad-swapped")
    shutil.copytree(base, d, ignore=shutil.ignore_patterns(".ucpfs"))
    tag = os.path.join(d, "global_step3")
    for kind in ("mp_rank_{:02d}_model_states.pt", "zero_pp_rank_0_mp_rank_{:02d}_optim_states.pt"):
        shutil.copy(os.path.join(tag, kind.format(3)), os.path.join(tag, kind.format(1)))
    clean_error([ucpfs_bin(), "index", d], ["bad-swapped", "covered by no fragment"])


def main():
    res = Results("deepspeed_parallel")
    with tmpdir("ucpfs-deepspeed-parallel-") as work:
        for case in [c for c in CASES if len(sys.argv) < 2 or c in sys.argv[1:]]:
            res.check(f"{case}: atomic states equal the engine's merged tensors bit for bit; "
                      "global_step3_universal equals ds_to_universal's output",
                      lambda case=case: check_case(work, case))
        if len(sys.argv) < 2 or "pp2_tp2" in sys.argv[1:]:  # made from that case's save
            res.check("inconsistent parallel saves: clear errors naming the file", lambda: inconsistent_saves(work))
    res.finish()


if __name__ == "__main__":
    main()
