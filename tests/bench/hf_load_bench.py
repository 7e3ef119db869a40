"""Benchmark: transformers' from_pretrained of the mount's hf/ folder against the same folder on
disk, cold and warm, in one run (issue 24, item 4); and the mount's time with and without hf/
read (hf/ costs nothing until read).

The source is a Megatron-Core torch_dist checkpoint of a Llama-style GPTModel (tp 1, one gloo
process; --hidden, --layers, --ffn; fp32, not trained: its bytes are what matters), saved by
megatron-core's dist_checkpointing with Megatron-LM's args (tests/e2e/fixtures/gen_megatron_llama.py's
model and args). MNT/hf/ is copied to DISK/hf/ (cp -r), so both sides load byte-identical files.
For each figure the median of --repeat runs, in this one python (transformers imported once):
  cold  the source, the disk copy and (by a fresh mount) the mount's page cache evicted first
        (posix_fadvise DONTNEED), then from_pretrained(dir, dtype=float32) and one read of every
        weight (transformers may keep them on the safetensors mmap until first used)
  warm  from_pretrained again at once (same mount, same page cache)
  mount `ucpfs mount` until it returns (ready), on a fresh mount with a cold source (and its
        index reused), against --base-ucpfs (a build without hf/, e.g. the main branch's) when
        given, each with its own index directory
Ratios: mount time / disk time (1.0 = parity; the goal is <= 1.2).

Printed: each median with its range (min-max) and the load average at the end.

Usage: .venv/bin/python tests/bench/hf_load_bench.py [--ucpfs build/cli/ucpfs] [--workdir DIR]
       [--repeat 3] [--hidden 1024 --layers 8 --ffn 2816] [--base-ucpfs OTHER_BUILD/cli/ucpfs]
       [--mount-arg=--readahead=1M ...]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e", "fixtures"))
from atomic_read_bench import evict, files_under  # noqa: E402
from bench_common import Mount  # noqa: E402


def save(rank, world, port, a):
    """One gloo process: gen_megatron_llama's model at tp 1 with the bench's sizes, saved."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    import gen_megatron_core as gmc  # noqa: PLC0415
    import gen_megatron_llama as gml  # noqa: PLC0415
    from rendezvous import rank_env  # noqa: PLC0415
    rank_env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gmc.install_cpu_shims()
    from megatron.core import dist_checkpointing  # noqa: PLC0415
    gml.TP, gml.HIDDEN, gml.LAYERS, gml.FFN, gml.HEADS, gml.GROUPS = 1, a.hidden, a.layers, a.ffn, a.hidden // 64, 4
    gmc.set_layout(1, 1, 0)
    ddp = gml.build(tied=False, qkv_bias=False, experts=0)
    dist_checkpointing.save({"model": ddp.sharded_state_dict(), "args": gml.megatron_args(False, False, 0),
                             "iteration": 0}, a.src)
    gmc.leave_world()


def load_s(path):
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # transformers may leave weights on the safetensors mmap until used: touch every one, as the
    # first forward does, so both sides read every byte.
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    s = time.perf_counter() - t0
    del model
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ucpfs", default=os.path.join(ROOT, "build", "cli", "ucpfs"))
    ap.add_argument("--workdir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--base-ucpfs")
    ap.add_argument("--mount-arg", action="append", default=[],
                    help="an extra option for the measured mounts, e.g. --mount-arg=--readahead=1M (repeatable)")
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="hf-load-bench-")
    a.src = os.path.join(work, "src")
    mnt, disk = os.path.join(work, "mnt"), os.path.join(work, "disk", "hf")
    if not os.path.exists(os.path.join(a.src, "metadata.json")):
        import torch.multiprocessing as mp  # noqa: PLC0415
        from rendezvous import TcpRendezvous  # noqa: PLC0415
        t0 = time.perf_counter()
        os.makedirs(a.src, exist_ok=True)
        with TcpRendezvous() as rdzv:
            mp.spawn(save, args=(1, rdzv.port, a), nprocs=1, join=True)
        print(f"saved the Megatron-Core checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
    src_files = files_under(a.src)
    mount_argv = [a.ucpfs, "mount", a.src, mnt, "--read-only", "--index-dir", os.path.join(work, "index")] + a.mount_arg
    with Mount(mount_argv, mnt):  # the index, built once; the on-disk copy
        shutil.rmtree(disk, ignore_errors=True)
        os.makedirs(os.path.dirname(disk), exist_ok=True)
        subprocess.run(["cp", "-r", os.path.join(mnt, "hf"), disk], check=True)
    n_bytes = sum(os.path.getsize(p) for p in files_under(disk))
    disk_files = files_under(disk)
    base_argv = None
    if a.base_ucpfs:
        base_argv = [a.base_ucpfs, "mount", a.src, mnt, "--read-only", "--index-dir", os.path.join(work, "index-base")]
        with Mount(base_argv, mnt):  # its index, built once
            pass
    fig = {k: [] for k in ("disk_cold", "mnt_cold", "disk_warm", "mnt_warm", "mount_s", "mount_plain_s")}
    for _ in range(a.repeat):
        if base_argv:
            evict(src_files)
            with Mount(base_argv, mnt) as m:
                fig["mount_plain_s"].append(m.seconds)
        # Both sides' files before each side's cold load: left cached, the other side's files made
        # the next load take older free memory, which this VM's host had taken back (a fault per
        # first touch; docs/benchmarks.md, "2026-11-28, late: the kernel keeps more read-ahead
        # requests in flight").
        evict(disk_files + src_files)
        fig["disk_cold"].append(load_s(disk))
        fig["disk_warm"].append(load_s(disk))
        evict(disk_files + src_files)
        with Mount(mount_argv, mnt) as m:
            fig["mount_s"].append(m.seconds)
            fig["mnt_cold"].append(load_s(os.path.join(mnt, "hf")))
            fig["mnt_warm"].append(load_s(os.path.join(mnt, "hf")))
    med = {k: statistics.median(v) for k, v in fig.items() if v}
    print(f"hf/: {n_bytes / 1e6:.0f} MB in {len(disk_files)} files; median of {a.repeat}")
    for kind in ("cold", "warm"):
        d, m = med[f"disk_{kind}"], med[f"mnt_{kind}"]
        rng = {k: f"{min(fig[k]):.3f}-{max(fig[k]):.3f}" for k in (f"disk_{kind}", f"mnt_{kind}")}
        print(f"  from_pretrained {kind}: disk {d:.3f} s ({rng[f'disk_{kind}']}), MNT/hf {m:.3f} s "
              f"({rng[f'mnt_{kind}']}), ratio of medians {m / d:.2f}")
    base = f" ({a.base_ucpfs}: {med['mount_plain_s']:.2f} s)" if base_argv else ""
    print(f"  ucpfs mount (ready, index reused): {med['mount_s']:.2f} s{base}")
    print(f"  load average {os.getloadavg()[0]:.1f} (1 min) at the end")
    if not a.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
