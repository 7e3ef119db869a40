"""Benchmark checkpoint: a real DCP save by 2 gloo processes of large fp32 tensors, half sharded by
rows and half by columns (so atomic reads gather whole ranges and row pieces). Under torch 1.13
(/usr/bin/python3) it is saved with `save_state_dict` of ShardedTensors; under torch >= 2.2 (the
venv) with `torch.distributed.checkpoint.save` of DTensors on a CPU device mesh.

Usage: PYTHON gen_bench_dcp.py OUTDIR [--tensors N] [--rows R] [--cols C]
Total size: N * R * C * 4 bytes (default 12 x 4096 x 4096 x 4 = 768 MiB; --tensors 28 gives 1.88 GB).
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e", "fixtures"))
import torch  # noqa: E402
TORCH2 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 2)
if not TORCH2:
    import torch113_compat  # noqa: F401,E402  (must precede torch.distributed)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def worker(rank, world, init, outdir, n, rows, cols):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if TORCH2:
        save_torch2(rank, world, outdir, n, rows, cols)
    else:
        save_torch113(rank, world, outdir, n, rows, cols)
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads now and then abort the interpreter's teardown ("terminate called without an
    # active exception"): leave without it, as the fixtures' ranks do (gen_llama_train.leave_rank).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tensor_name(i):
    # torchtitan names, so the target-view presets apply: even tensors are column-parallel
    # (wq, split along dim 0 in the source), odd ones row-parallel (wo, split along dim 1).
    return f"layers.{i // 2}.attention.{'wq' if i % 2 == 0 else 'wo'}.weight"


def shards(rank, world, n, rows, cols):
    """(name, split dim, offset of this rank's shard along it, the shard) of every tensor."""
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        full = torch.randn(rows, cols, generator=g)
        dim = 0 if i % 2 == 0 else 1
        size = (rows if dim == 0 else cols) // world
        yield tensor_name(i), dim, rank * size, full.narrow(dim, rank * size, size).contiguous()


def save_torch2(rank, world, outdir, n, rows, cols):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (world,))
    sd = {name: DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
          for name, dim, _, local in shards(rank, world, n, rows, cols)}
    dcp.save(sd, checkpoint_id=outdir)


def save_torch113(rank, world, outdir, n, rows, cols):
    from torch.distributed._shard.checkpoint import FileSystemWriter, save_state_dict
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
    sd = {}
    for name, dim, at, local in shards(rank, world, n, rows, cols):
        off = [0, 0]
        off[dim] = at
        shard = Shard(local, ShardMetadata(off, list(local.shape), f"rank:{rank}/cpu"))
        sd[name] = init_from_local_shards([shard], rows, cols)
    save_state_dict(sd, FileSystemWriter(outdir, single_file_per_rank=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--tensors", type=int, default=12)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        init = "file://" + os.path.join(td, "rdzv")
        mp.spawn(worker, args=(2, init, a.outdir, a.tensors, a.rows, a.cols), nprocs=2, join=True)


if __name__ == "__main__":
    main()
