"""End-to-end: Megatron-LM legacy (`--ckpt-format torch`) checkpoints (issue 11), real FUSE.

fixtures/gen_megatron_legacy.py runs a real Megatron-Core 0.16.1 GPTModel (GQA 4/2 heads, SwiGLU,
RMSNorm, biases, tied embeddings, vocabulary 37 padded to a multiple of 8 * tp, bf16 with fp32
masters) and a real Megatron-Core optimizer step on CPU over gloo, and writes what Megatron-LM's
save_checkpoint writes: latest_checkpointed_iteration.txt, iter_0000002/mp_rank_TT_PPP/
model_optim_rng.pt. Saved at tp2 pp2 (4 processes) and mounted:
 1. `ucpfs index` reports the format and degrees;
 2. every atomic/<param>/{fp32,exp_avg,exp_avg_sq}.pt equals the live optimizer's fp32 master and
    Adam moments merged the Megatron way (tp slices, global layer numbers; the vocabulary with
    the padding rows it was stored with, as for DeepSpeed sources) bit for bit, under torch 2.13 (default, mmap) and Debian's torch 1.13;
 3. target/tp1_pp1_dp1 and target/tp2_pp1_dp1: each rank's model.pt loads into a Megatron-Core
    GPTModel of that layout (built by megatron-core itself at tp 1 / tp 2, vocabulary re-padded for
    the new tp), every tensor equal to the truth sliced for the rank (the vocabulary: the stored
    rows, padding included, up to the new padded size, zeros past them); optim.pt's fp32 masters
    and moments likewise.

Then a save with megatron-core's DistributedOptimizer (tp2 pp2 dp2, 8 processes, overlap_grad_reduce
with DDP buckets of 1000 elements, so the first stage has several buckets and both stages a
separate bucket for the tied embedding's copy): DistributedOptimizer.save_parameter_state writes
distrib_optim.pt; the atomic files equal the live optimizer's shards gathered over dp, and
target/tp1_pp1_dp1's optim.pt holds the same masters and moments and the param groups' step.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/megatron_legacy_test.py
"""
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from e2e_common import Results, run, served_loads, tmpdir, ucpfs_bin
from mount_common import mounted

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import gen_megatron_legacy as gen  # noqa: E402

TORCH113 = "/usr/bin/python3"


def escaped(name):
    return name.replace("/", "%2F")


def check_atomic(m, truth):
    n = 0
    for name, states in truth["params"].items():
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            path = os.path.join(m, "atomic", escaped(name), kind + ".pt")
            for how, got in served_loads(path):
                t = got["param"]
                if "word_embeddings" in name:  # stored rows, padding included (as for DeepSpeed sources)
                    assert t.shape[0] == gen.padded_vocab(2) and got["vocab_tensor"], (name, t.shape)
                assert torch.equal(t, states[kind]), (name, kind, how)
            n += 1
    assert n == 3 * len(truth["params"]), n
    # Debian's torch 1.13 loads the same files (weights_only=True) with the same values.
    names = list(truth["params"])[:3] + ["embedding.word_embeddings.weight"]
    script = ("import sys, torch\n"
              "for p in sys.argv[1:]:\n"
              "    t = torch.load(p, weights_only=True)['param']\n"
              "    print(p, list(t.shape), float(t.double().sum()))\n")
    paths = [os.path.join(m, "atomic", escaped(n), "fp32.pt") for n in names]
    if os.path.exists(TORCH113):
        out = run([TORCH113, "-c", script] + paths, timeout=120).stdout.split("\n")
        for line, name in zip(out, names):
            want = truth["params"][name]["fp32"]
            assert line.split(" ", 1)[1] == f"{list(want.shape)} {float(want.double().sum())}", (line, name)


def load_into_megatron(rank, tp, target_dir, truth_path, out_dir, step, init):
    """Builds a tp-way Megatron-Core GPTModel, loads rank's model.pt into it, compares."""
    gen.install_cpu_shims()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model, _ = gen.build_model(tp, 1)
    truth = torch.load(truth_path)["params"]
    d = os.path.join(target_dir, f"rank_{rank}")
    sd = torch.load(os.path.join(d, "model.pt"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("_extra_state") for k in missing), missing
    held = dict(model.state_dict())
    for name, t in sd.items():
        want = gen.local_slice(name, truth[name]["weight"], tp, rank).to(held[name].dtype)
        assert torch.equal(held[name], want), (rank, name)
    optim = torch.load(os.path.join(d, "optim.pt"))
    names = list(sd)
    for i, name in enumerate(names):
        for kind in ("exp_avg", "exp_avg_sq"):
            want = gen.local_slice(name, truth[name][kind], tp, rank)
            assert torch.equal(optim["state"][i][kind], want), (rank, name, kind)
    for name, master in optim.get("fp32", {}).items():
        assert torch.equal(master, gen.local_slice(name, truth[name]["fp32"], tp, rank)), (rank, name)
    if step is not None:  # the distributed optimizer's step, from its param groups
        for i in range(len(names)):
            assert float(optim["state"][i]["step"]) == step, (rank, i, optim["state"][i].get("step"))
    with open(os.path.join(out_dir, f"ok_{rank}"), "w") as f:
        f.write(str(len(sd)))
    dist.destroy_process_group()


def check_target(m, work, truth_path, tp, step=None):
    target_dir = os.path.join(m, "target", f"tp{tp}_pp1_dp1")
    out = os.path.join(work, f"target-tp{tp}")
    os.makedirs(out, exist_ok=True)
    gen.spawn(load_into_megatron, (tp, target_dir, truth_path, out, step), tp)
    for r in range(tp):
        assert int(open(os.path.join(out, f"ok_{r}")).read()) > 0


def check_save(work, res):
    src = os.path.join(work, "tp2_pp2")
    run([sys.executable, gen.__file__, "save", src, "--tp", "2", "--pp", "2"], timeout=600)
    truth_path = src + "_truth.pt"
    truth = torch.load(truth_path)
    r = run([ucpfs_bin(), "index", src], timeout=120)
    assert "megatron (megatron-lm-legacy tp2 pp2 iter_0000002)" in r.stdout + r.stderr, r.stdout + r.stderr
    with mounted(src, os.path.join(work, "mnt"), "--layout", "tp1_pp1_dp1", "--layout", "tp2_pp1_dp1") as (m, _):
        status = json.load(open(os.path.join(m, ".ucpfs", "status.json")))
        assert "megatron" in json.dumps(status), status
        res.check("atomic fp32 / exp_avg / exp_avg_sq equal the live optimizer's merged tensors",
                  lambda: check_atomic(m, truth))
        for tp in (1, 2):
            res.check(f"target tp{tp}_pp1_dp1 loads into a Megatron-Core model of that layout, equal to the truth",
                      lambda tp=tp: check_target(m, work, truth_path, tp))


def check_distopt_save(work, res):
    src = os.path.join(work, "distopt")
    run([sys.executable, gen.__file__, "save", src, "--tp", "2", "--pp", "2", "--dp", "2", "--distopt",
         "--bucket-size", "1000"], timeout=600)
    truth_path = src + "_truth.pt"
    truth = torch.load(truth_path)
    r = run([ucpfs_bin(), "index", src], timeout=120)
    assert "megatron-lm-legacy tp2 pp2 distributed-optimizer iter_0000002" in r.stdout + r.stderr, r.stdout + r.stderr
    with mounted(src, os.path.join(work, "mnt-distopt"), "--layout", "tp1_pp1_dp1") as (m, _):
        res.check("distributed optimizer: atomic fp32 / exp_avg / exp_avg_sq equal the live optimizer's",
                  lambda: check_atomic(m, truth))
        res.check("distributed optimizer: target tp1_pp1_dp1 weights, masters, moments and step",
                  lambda: check_target(m, os.path.join(work, "distopt-target"), truth_path, 1, float(truth["step"])))


def main():
    res = Results("megatron_legacy")
    with tmpdir("ucpfs-megatron-legacy-") as work:
        res.check("tp2 pp2 save mounted", lambda: check_save(work, res))
        res.check("tp2 pp2 dp2 save with the distributed optimizer (buckets of 1000) mounted",
                  lambda: check_distopt_save(work, res))
    res.finish()


if __name__ == "__main__":
    main()
