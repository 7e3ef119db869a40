"""The resuming job of resume-megatron.sh: Megatron-Core models of a new TP/PP layout load their
rank files from the mount.

Usage (the python of .venv/: torch 2.13, megatron-core 0.16.1 on CPU):
  megatron_job.py LAYOUT_DIR TRUTH --tp T --pp P
LAYOUT_DIR is the mount's target/tp<T>_pp<P>_dp1/; TRUTH the saving job's consolidated truth
(tests/e2e/fixtures/gen_megatron_legacy.py writes it: every parameter's global weight and fp32
master). T * P processes each build the GPTModel of their (tp, pp) rank with megatron-core itself
(gen_megatron_legacy.build_model: 4 layers, GQA, SwiGLU, RMSNorm, tied embeddings, bf16), load
rank_<r>/model.pt into it with load_state_dict, and check every weight, and every fp32 master of
rank_<r>/optim.pt, equals the truth cut for that rank (global layer numbers made local to the
stage, vocabulary padded for the new T), bit for bit. gloo over a file:// rendezvous.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e", "fixtures"))
import gen_megatron_legacy as gen  # noqa: E402  (build_model, local_slice, global_name, CPU shims)
import ranks  # noqa: E402  (launch: the job's forked processes)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402


def resume(rank, a, rendezvous):
    gen.install_cpu_shims()   # megatron-core's CUDA-only calls, on the CPU
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=a.tp * a.pp)
    ps.initialize_model_parallel(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    model, _ = gen.build_model(a.tp, a.pp)   # this rank's stage, freshly initialized

    # Load this rank's files from the mount (rank = tp + T * pp: Megatron's order).
    d = os.path.join(a.layout_dir, f"rank_{rank}")
    sd = torch.load(os.path.join(d, "model.pt"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, f"rank {rank}: unexpected keys {unexpected}"
    assert all(k.endswith("_extra_state") for k in missing), f"rank {rank}: missing {missing}"

    # Check: every tensor the model now holds is the saved one, cut for this rank.
    truth = torch.load(a.truth)["params"]
    held = model.state_dict()

    def want(name, kind):
        g = gen.global_name(name, pp_rank, a.pp)
        if g == "output_layer.weight":   # tied: the last stage holds a copy of the embedding
            g = "embedding.word_embeddings.weight"
        return gen.local_slice(g, truth[g][kind], a.tp, tp_rank)

    for name in sd:
        w = want(name, "weight").to(held[name].dtype)
        assert torch.equal(held[name], w), f"rank {rank}: {name} differs from the saved weight"
    masters = torch.load(os.path.join(d, "optim.pt")).get("fp32", {})
    for name, master in masters.items():
        assert torch.equal(master, want(name, "fp32")), f"rank {rank}: fp32 master of {name} differs"
    print(f"  rank {rank} (tp {tp_rank}, pp {pp_rank}): {len(sd)} weights and {len(masters)} fp32 masters "
          "equal the saved ones", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layout_dir")
    ap.add_argument("truth")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    a = ap.parse_args()
    rendezvous = os.path.join(os.path.dirname(os.path.abspath(a.truth)), "rendezvous-megatron")
    ranks.launch(resume, a.tp * a.pp, rendezvous, a)


if __name__ == "__main__":
    main()
