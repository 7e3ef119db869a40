"""End-to-end: genuine DeepSpeed checkpoints (issue 9, sources), mounted with real FUSE.

The real DeepSpeed 0.19.8 engine (fixtures/gen_deepspeed.py, CPU, gloo) trains a tiny GPT with
Megatron-DeepSpeed names in two AdamW param groups and saves, for each case:
  zero1 (3 ranks), zero2_bf16 (2), zero1_fp16 (2), bf16_optimizer (BF16_Optimizer, 3),
  zero3 (2), zero3_subgroups (3 ranks, sub_group_size 300: several sub-groups, and a
  1-element parameter that two ranks hold none of).
For each, mounted at the save directory (`latest` -> global_step3/):
 1. `ucpfs index` recognises the format ("deepspeed", the stage and dp size in the flavor);
 2. every atomic/<param>/{fp32,exp_avg,exp_avg_sq}.pt equals the live engine's
    safe_get_full_fp32_param / safe_get_full_optimizer_state bit for bit (padding never leaks:
    shapes are the parameters' own);
 3. the source files are passed through, and target/tp1_pp1_dp2/rank_*/model.pt and optim.pt
    load with torch.load's defaults;
 4. global_step3_universal/ equals, file by file, what the installed ds_to_universal writes for
    the same tag (same files; same pickled objects: dict keys in order, tensors bit for bit with
    their dtype, shape and requires_grad, DeepSpeed's LossScaler and ZeroStageEnum objects), and
    latest_universal names it;
 5. a DeepSpeed engine with checkpoint.load_universal resumes from the mount at dp=1 and dp=3
    (zero2_bf16, zero3, bf16_optimizer) with losses equal, bit for bit, to the same resume from
    ds_to_universal's output.
The tag directory itself mounts the same atomic bytes, and its universal view. Inconsistent saves give a clear error
naming the file: a missing dp rank, a truncated optimizer file, model states of a second
model-parallel rank without its optimizer partitions.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/deepspeed_sources_test.py
"""
import json
import os
import shutil
import subprocess
import sys

import torch

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import mounted

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "fixtures", "gen_deepspeed.py")
CASES = [("zero1", 3), ("zero2_bf16", 2), ("zero1_fp16", 2), ("bf16_optimizer", 3), ("zero3", 2),
         ("zero3_subgroups", 3)]
STATES = ("fp32", "exp_avg", "exp_avg_sq")


RESUME_CASES = ("zero2_bf16", "zero3", "bf16_optimizer")


def generate(work, case, ranks):
    out = os.path.join(work, case)
    run([sys.executable, GEN, "save", out, "--case", case, "--ranks", str(ranks)], timeout=600)
    return out


def ds_to_universal(work, case, src):
    """The installed converter's output for src's tag, in a directory of its own."""
    out = os.path.join(work, case + "-ds")
    os.makedirs(out)
    run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         os.path.join(src, "global_step3"), "--output_folder", os.path.join(out, "global_step3_universal"),
         "--num_extract_workers", "1", "--num_merge_workers", "1"], timeout=600)
    return out


def same_object(a, b, path):
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), path
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), \
            (path, a.dtype, b.dtype, a.shape, b.shape, a.requires_grad, b.requires_grad)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
        return
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            same_object(a[k], b[k], path + [k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same_object(x, y, path + [i])
    elif hasattr(a, "__dict__"):
        same_object(vars(a), vars(b), path + ["__dict__"])
    else:
        assert a == b, (path, a, b)


def files_under(d):
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)


def universal_equals(got, want):
    """Every file of `want` (ds_to_universal's folder) is in `got` and loads to the same object."""
    assert files_under(got) == files_under(want), set(files_under(got)) ^ set(files_under(want))
    for f in files_under(want):
        same_object(torch.load(os.path.join(got, f), weights_only=False),
                    torch.load(os.path.join(want, f), weights_only=False), [f])
    return len(files_under(want))


def atomic_equals_truth(m, truth):
    n = 0
    for name, states in truth.items():
        if name == "__step__":
            continue
        for s in STATES:
            got = torch.load(os.path.join(m, "atomic", name, s + ".pt"))["param"]
            want = states[s]
            assert got.dtype == torch.float32 and got.shape == want.shape, (name, s, got.shape, want.shape)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (name, s)
            n += 1
    return n


def atomic_patterns(m):
    """atomic cat_dim/vocab_tensor come from the one pattern source: the checkpoint's own
    universal_checkpoint_info first (row, vocabulary, replicated), then the Megatron preset."""
    def keys(name):
        obj = torch.load(os.path.join(m, "atomic", name, "fp32.pt"))
        return {k: v for k, v in obj.items() if k != "param"}
    layer = "language_model.encoder.layers.0."
    assert keys(layer + "mlp.dense_4h_to_h.weight") == {"cat_dim": 1}
    assert keys("language_model.embedding.word_embeddings.weight") == {"cat_dim": 0, "vocab_tensor": True}
    assert keys("language_model.scale") == {}
    assert keys(layer + "self_attention.query_key_value.weight") == {"cat_dim": 0}
    assert keys(layer + "input_layernorm.bias") == {}
    step = torch.load(os.path.join(m, "atomic", layer + "mlp.dense_4h_to_h.weight", "step.pt"))
    assert step.dim() == 0 and step.item() == 3, step


def check_case(work, case, ranks):
    src = generate(work, case, ranks)
    truth = torch.load(src + "_truth.pt")
    r = run([ucpfs_bin(), "index", src], timeout=120)
    stage = "bf16_optimizer" if case == "bf16_optimizer" else "zero" + case[4]
    assert f"deepspeed ({stage} dp{ranks} tag global_step3)" in r.stderr + r.stdout, r.stderr + r.stdout
    mnt = os.path.join(work, "mnt-" + case)
    with mounted(src, mnt) as (m, _):
        n = atomic_equals_truth(m, truth)
        assert n == 3 * (len(truth) - 1), n
        atomic_patterns(m)
        status = json.load(open(os.path.join(m, ".ucpfs", "status.json")))
        assert status["format"] == "deepspeed", status["format"]
        tag_files = sorted(os.listdir(os.path.join(m, "global_step3")))
        assert tag_files == sorted(os.listdir(os.path.join(src, "global_step3"))), tag_files
        for rank in (0, 1):
            d = os.path.join(m, "target", "tp1_pp1_dp2", f"rank_{rank}")
            model = torch.load(os.path.join(d, "model.pt"))
            optim = torch.load(os.path.join(d, "optim.pt"))
            assert set(model) == {k for k in truth if k != "__step__"}, sorted(model)
            assert "param_groups" in optim
        ds = ds_to_universal(work, case, src)
        assert open(os.path.join(m, "latest_universal")).read() == "global_step3_universal"
        n_universal = universal_equals(os.path.join(m, "global_step3_universal"),
                                       os.path.join(ds, "global_step3_universal"))
        assert n_universal > 3 * (len(truth) - 1), n_universal
        if case in RESUME_CASES:
            for dp in (1, 3):
                losses = [resume(case, d, dp) for d in (m, ds)]
                assert losses[0] == losses[1], (dp, losses)
    return n


def resume(case, ckpt_dir, ranks):
    """The 3 losses after load_checkpoint(ckpt_dir) with checkpoint.load_universal (latest_universal)."""
    r = run([sys.executable, GEN, "resume", ckpt_dir, "--case", case, "--ranks", str(ranks), "--universal"],
            timeout=600)
    return json.loads(r.stdout.strip().splitlines()[-1])["losses"]


def tag_directory_mounts(work):
    src = os.path.join(work, "zero1")
    tag = os.path.join(src, "global_step3")
    truth = torch.load(src + "_truth.pt")
    with mounted(tag, os.path.join(work, "mnt-tag")) as (m, _):
        atomic_equals_truth(m, truth)
        # Named after the directory; no `latest`, so no latest_universal.
        universal_equals(os.path.join(m, "global_step3_universal"),
                         os.path.join(work, "zero1-ds", "global_step3_universal"))
        assert not os.path.exists(os.path.join(m, "latest_universal"))


def clean_error(cmd, must):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, f"{cmd} succeeded"
    for s in must:
        assert s in p.stderr, f"error lacks {s!r}: {p.stderr}"


def inconsistent_saves(work):
    base = os.path.join(work, "zero1")
    # A missing dp rank.
    d = os.path.join(work, "bad-missing")
    shutil.copytree(base, d, ignore=shutil.ignore_patterns(".ucpfs"))
    os.remove(os.path.join(d, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    clean_error([ucpfs_bin(), "index", d], ["dp rank 1 of mp rank 0 is missing"])
    # A truncated optimizer file.
    d = os.path.join(work, "bad-truncated")
    shutil.copytree(base, d, ignore=shutil.ignore_patterns(".ucpfs"))
    victim = os.path.join(d, "global_step3", "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    clean_error([ucpfs_bin(), "index", d], ["zero_pp_rank_2_mp_rank_00_optim_states.pt"])
    # Model states of a second model-parallel rank without its optimizer partitions.
    d = os.path.join(work, "bad-tp")
    shutil.copytree(base, d, ignore=shutil.ignore_patterns(".ucpfs"))
    shutil.copy(os.path.join(d, "global_step3", "mp_rank_00_model_states.pt"),
                os.path.join(d, "global_step3", "mp_rank_01_model_states.pt"))
    clean_error([ucpfs_bin(), "index", d], ["mp rank 1 has 0 optimizer partitions, mp rank 0 3"])
    # `latest` naming something that is not a tag directory.
    d = os.path.join(work, "bad-latest")
    shutil.copytree(base, d, ignore=shutil.ignore_patterns(".ucpfs"))
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("../../etc")
    clean_error([ucpfs_bin(), "index", d], ["latest", "not a tag directory name"])


def main():
    res = Results("deepspeed_sources")
    with tmpdir("ucpfs-deepspeed-") as work:
        for case, ranks in CASES:
            res.check(f"{case} ({ranks} ranks): atomic fp32/exp_avg/exp_avg_sq equal the engine's, bit for bit; "
                      "global_step3_universal equals ds_to_universal's output"
                      + ("; load_universal from the mount at dp=1 and dp=3 trains bit for bit as from it"
                         if case in RESUME_CASES else ""),
                      lambda case=case, ranks=ranks: check_case(work, case, ranks))
        res.check("a tag directory mounts by itself", lambda: tag_directory_mounts(work))
        res.check("inconsistent saves: clear errors naming the file", lambda: inconsistent_saves(work))
    res.finish()


if __name__ == "__main__":
    main()
