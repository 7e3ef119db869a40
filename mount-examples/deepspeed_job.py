"""The DeepSpeed training job of resume-deepspeed-universal.sh: save on one DP size, resume on another.

Usage (the python of .venv/: torch 2.13, DeepSpeed 0.19.8 on CPU):
  deepspeed_job.py save CKPT OUT --ranks N    train 3 steps (ZeRO-2, bf16 with fp32 masters) on N
                                              processes, engine.save_checkpoint(CKPT); write
                                              OUT/saved.pt: every parameter's fp32 master and Adam
                                              moments as the live engine held them
  deepspeed_job.py resume CKPT OUT --ranks M  a new engine on M processes with
                                              checkpoint.load_universal loads CKPT (the mount: its
                                              latest_universal names the universal folder), checks
                                              every master and moment equals OUT/saved.pt bit for
                                              bit, then trains 3 more steps

The model is the tiny GPT with Megatron-DeepSpeed parameter names of
tests/e2e/fixtures/gen_deepspeed.py (make_engine, train_step; its client state carries the
`universal_checkpoint_info` Megatron-DeepSpeed saves). gloo over a file:// rendezvous.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e", "fixtures"))
import gen_deepspeed as gen  # noqa: E402  (sets DS_ACCELERATOR=cpu before DeepSpeed is imported)
import deepspeed  # noqa: E402,F401  (imported once here; the forked ranks inherit it)
import ranks  # noqa: E402  (launch: the job's forked processes)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

CASE, SEED, STEPS = "zero2_bf16", 0, 3
STATES = ("fp32", "exp_avg", "exp_avg_sq")
VOCABULARY = ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight")


def start(rank, world, rendezvous, load_universal=False):
    """One rank: gloo over a file:// rendezvous (DeepSpeed uses the process group it finds), then
    the engine: the model, AdamW in two param groups, the ZeRO-2 bf16 config of CASE."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    return gen.make_engine(CASE, SEED, load_universal=load_universal)


def full_states(engine):
    """Every parameter's fp32 master and Adam moments, gathered whole from the ZeRO partitions."""
    gen.relink_optimizer_state(engine)
    return {name: {"fp32": safe_get_full_fp32_param(p).clone(),
                   "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                   "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
            for name, p in engine.module.named_parameters()}


def save(rank, a, rendezvous):
    engine = start(rank, a.ranks, rendezvous)
    for step in range(STEPS):
        gen.train_step(engine, SEED, step)
    engine.save_checkpoint(a.path, client_state={"iteration": STEPS,
                                                 "universal_checkpoint_info": gen.universal_checkpoint_info()})
    saved = full_states(engine)
    if rank == 0:
        torch.save(saved, os.path.join(a.out, "saved.pt"))
    gen.leave_rank()


def resume(rank, a, rendezvous):
    engine = start(rank, a.ranks, rendezvous, load_universal=True)
    # With checkpoint.load_universal, load_checkpoint reads `latest_universal` and, from the
    # folder it names, each parameter's zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt, cutting this
    # rank's partition for the new DP size.
    engine.load_checkpoint(a.path, load_optimizer_states=True, load_lr_scheduler_states=True)
    got, want = full_states(engine), torch.load(os.path.join(a.out, "saved.pt"))
    assert sorted(got) == sorted(want), f"parameters {sorted(got)} != saved {sorted(want)}"
    for name in want:
        for s in STATES:
            g, w = got[name][s], want[name][s]
            if name in VOCABULARY:
                # The universal format keeps the 37 real rows of the vocabulary (padded to 40 in
                # the model); load_universal pads them again with zeros, as from ds_to_universal.
                assert not g[gen.VOCAB:].any(), f"{name} {s}: padding rows are not zeros"
                g, w = g[:gen.VOCAB], w[:gen.VOCAB]
            assert g.dtype == w.dtype == torch.float32 and g.shape == w.shape, (name, s, g.shape, w.shape)
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)), f"rank {rank}: {name} {s} differs"
    if rank == 0:
        print(f"  {a.ranks} ranks: the fp32 masters and Adam moments of {len(want)} parameters equal the "
              "saved ones, bit for bit")
    # Train on: the batches are drawn per DP rank, so the losses are this new job's own.
    losses = [float.fromhex(gen.train_step(engine, SEED, STEPS + j)) for j in range(3)]
    if rank == 0:
        print("  trained on:", " ".join(f"{x:.6f}" for x in losses))
    gen.leave_rank()


def main():
    ranks.save_or_resume(__doc__, save, resume, path_help="the checkpoint directory (resume: the mount)",
                         out_help="where save writes saved.pt")


if __name__ == "__main__":
    main()
