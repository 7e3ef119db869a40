"""The torch 2.x FSDP2 training job of resume-new-layout.sh: save on one world size, resume on another.

Usage (the python of .venv/, torch 2.13):
  fsdp2_job.py save CKPT OUT --ranks N    train 3 steps on N processes, dcp.save to CKPT; write
                                          OUT/saved.pt (the full state as saved) and
                                          OUT/uninterrupted.json (losses of 3 more steps of the
                                          same job, never stopped)
  fsdp2_job.py resume RANK_DIR OUT --ranks M
                                          a new job of M processes loads RANK_DIR/model.pt and
                                          optim.pt (full state dicts: the mount's
                                          target/tp1_pp1_dp1/rank_0/), checks the state equals
                                          OUT/saved.pt exactly, trains 3 steps and checks the
                                          losses equal OUT/uninterrupted.json, bit for bit

The model is the tiny Llama of tests/e2e/fixtures/gen_llama_train.py (4 layers, torchtitan names)
with torch.optim.Adam; every block and then the root are wrapped with FSDP2's fully_shard, as
torchtitan does. Every rank trains on the same batch, so the data-parallel average of the
gradients is the gradient itself, exactly, on 1, 2 or 4 ranks (a sum of 2 or 4 equal floats
divided by 2 or 4 is exact; with 3 it is not), and a job resumed on another of these world sizes
must reproduce the uninterrupted job bit for bit. CPU only, gloo over a file:// rendezvous.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e", "fixtures"))
import gen_llama_train as gen  # noqa: E402  (Llama, batch, train_step)
import ranks  # noqa: E402  (launch: the job's forked processes)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # noqa: E402

SEED, STEPS, MORE_STEPS = 7, 3, 3
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def start(rank, world, rendezvous):
    """One process of the job: gloo over a file:// rendezvous, the model sharded with FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    model = gen.Llama(SEED)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=gen.LR)


def save(rank, a, rendezvous):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    model, opt = start(rank, a.ranks, rendezvous)
    for step in range(STEPS):
        gen.train_step(model, opt, gen.batch(SEED, step))
    # The checkpoint: each rank writes its own shards (torchtitan's layout of the state dict).
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=a.path)
    # What was saved, gathered whole, to check the resumed job against (written before training
    # on: the optimizer's 0-d step tensors in it are the live ones).
    saved_model, saved_optim = get_state_dict(model, opt, options=FULL)
    if rank == 0:
        torch.save({"model": saved_model, "optim": saved_optim}, os.path.join(a.out, "saved.pt"))
    # The same job, never stopped: the losses a resume must reproduce.
    losses = [gen.train_step(model, opt, gen.batch(SEED, STEPS + j)) for j in range(MORE_STEPS)]
    if rank == 0:
        with open(os.path.join(a.out, "uninterrupted.json"), "w") as f:
            json.dump([x.hex() for x in losses], f)
    gen.leave_rank()


def as_fqn_keyed(optim):
    """The mount's optim.pt is a plain torch.optim state dict: parameters are numbered, and each
    param group lists their names in `param_names`. The torch.distributed.checkpoint.state_dict
    API names them by their FQN instead."""
    fqn, groups = {}, []
    for g in optim["param_groups"]:
        g = dict(g)
        names = g.pop("param_names")
        fqn.update(zip(g["params"], names))
        groups.append(dict(g, params=names))
    return {"state": {fqn[i]: s for i, s in optim["state"].items()}, "param_groups": groups}


def resume(rank, a, rendezvous):
    model, opt = start(rank, a.ranks, rendezvous)   # a fresh job on the new world size
    # Every rank reads the whole state from the mount (model.pt, optim.pt: one rank of layout
    # tp1_pp1_dp1, i.e. the consolidated state); set_state_dict keeps this rank's FSDP2 shard.
    model_sd = torch.load(os.path.join(a.path, "model.pt"))
    optim_sd = as_fqn_keyed(torch.load(os.path.join(a.path, "optim.pt")))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True))
    # Check 1: the new job holds exactly the state the old one saved (gathered whole on rank 0).
    got_model, got_optim = get_state_dict(model, opt, options=FULL)
    if rank == 0:
        saved = torch.load(os.path.join(a.out, "saved.pt"))
        exact = dict(rtol=0, atol=0)   # every tensor: same dtype, shape and values
        torch.testing.assert_close(got_model, saved["model"], **exact)
        torch.testing.assert_close(got_optim["state"], saved["optim"]["state"], **exact)
        # (torch's set_state_dict gives the tuple `betas` back as a list: compared as lists)
        groups = [[{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in o["param_groups"]]
                  for o in (got_optim, saved["optim"])]
        assert groups[0] == groups[1], f"param groups differ: {groups[0]} != {groups[1]}"
    # Check 2: training on gives the uninterrupted job's losses, bit for bit.
    losses = [gen.train_step(model, opt, gen.batch(SEED, STEPS + j)) for j in range(MORE_STEPS)]
    want = [float.fromhex(h) for h in json.load(open(os.path.join(a.out, "uninterrupted.json")))]
    if rank == 0:
        for got, ref in zip(losses, want):
            print(f"  loss {got:.10f}   uninterrupted {ref:.10f}")
    assert losses == want, f"rank {rank}: resumed losses {losses} != uninterrupted {want}"
    if rank == 0:
        print(f"  {a.ranks} ranks hold the saved state exactly and train on bit for bit")
    gen.leave_rank()


def main():
    ranks.save_or_resume(__doc__, save, resume,
                         path_help="save: the checkpoint directory; resume: the rank directory to load",
                         out_help="where save writes saved.pt and uninterrupted.json")


if __name__ == "__main__":
    main()
