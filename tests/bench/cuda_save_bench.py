"""Benchmark: the CUDA write path. torch.save of a state dict of CUDA tensors into a ucpfs mount
(the daemon's pinned cache allocated with cudaHostAlloc when it sees a GPU), against the same
torch.save into tmpfs and against torch.distributed.checkpoint's async_save, in one run.

Needs a machine with a CUDA GPU and a ucpfs built with the CUDA toolkit (the default build
finds it; `ucpfs --version` and stats.json's `cache.memory` say `cuda_host`). CI has no GPU: this
is run by hand (docs/benchmarks.md "Saving CUDA tensors (a GPU machine)"). With `--device cpu`
it runs the same steps on CPU tensors, to check the script itself on a machine without a GPU.

One state dict is made once on the device (--tensors tensors of --numel random values each, in
--dtype; default 64 x 16 Mi bf16 = 2 GiB). Each repetition measures, with the page cache dropped
before each (as root):
  tmpfs        torch.save(sd, TMPFS/model.pt): the wall time of the call (torch copies each
               tensor to pageable host memory, then writes);
  mount        torch.save(sd, MNT/model.pt) on a fresh `ucpfs mount SRC MNT --cache-size C` of an
               empty SRC on --workdir's disk: T_save (how long the trainer is blocked), then
               `ucpfs sync MNT`: T_sync (until the file is durable in SRC);
  disk         torch.save into --workdir plus fsync of the file: T_disk;
  async_save   torch.distributed.checkpoint.async_save(sd, checkpoint_id=WORKDIR/dcp_N) in a
               one-process gloo group: T_async (until the call returns: the state staged in
               host memory), T_async_done (until its future completes: written to disk);
  async_mount  the same async_save into the mount (checkpoint_id=MNT/dcp_N), then `ucpfs sync`.
The bytes the mount leaves in SRC are compared with the tmpfs file first, so nothing wrong is
timed. Prints a table and a one-line JSON summary (also written to --json if given).

Usage: python3 tests/bench/cuda_save_bench.py --ucpfs build/cli/ucpfs [--workdir /tmp/ucpfs-cuda]
       [--tmpfs /dev/shm] [--repeat 3] [--tensors 64 --numel 16777216 --dtype bf16]
       [--cache-size 4G] [--device cuda|cpu] [--json OUT]
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import Mount  # noqa: E402

NAME = "model.pt"  # torch.save names its zip records after the file: the same name everywhere


def log(*a):
    print(*a, flush=True)


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:  # not root, or a sandbox that refuses: say so, keep going
        log(f"note: drop_caches refused ({e})")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 24)
            if not b:
                return h.hexdigest()
            h.update(b)


def sync_device(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync_device(device)
    t0 = time.perf_counter()
    out = fn()
    sync_device(device)
    return time.perf_counter() - t0, out


def daemon_cache_kind(mnt):
    try:
        with open(os.path.join(mnt, ".ucpfs", "stats.json")) as f:
            stats = json.load(f)
    except OSError:
        return "?"
    cache = stats.get("capture", stats.get("cache", {}))
    for k in ("memory", "memory_kind", "pinned"):
        if isinstance(cache, dict) and k in cache:
            return str(cache[k])
    return json.dumps(cache)[:120]


def init_group():
    import torch.distributed as dist
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ucpfs", default=os.path.join(HERE, "..", "..", "build", "cli", "ucpfs"))
    ap.add_argument("--workdir", default="/tmp/ucpfs-cuda-bench")
    ap.add_argument("--tmpfs", default="/dev/shm")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--numel", type=int, default=16 << 20)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--cache-size", default="4G")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("cuda_save_bench: no CUDA device (use --device cpu to check the script)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    ucpfs = os.path.abspath(a.ucpfs)
    version = subprocess.run([ucpfs, "--version"], capture_output=True, text=True).stdout.strip()
    log(f"ucpfs: {version}")
    log(f"torch {torch.__version__}, device {a.device}"
        + (f" ({torch.cuda.get_device_name(0)})" if a.device == "cuda" else ""))
    gen = torch.Generator(device=a.device).manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(a.numel, generator=gen, device=a.device).to(dtype)
          for i in range(a.tensors)}
    n_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    log(f"state dict: {a.tensors} x {a.numel} {a.dtype} = {n_bytes / 2**30:.2f} GiB on {a.device}")

    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    tmp_dir = os.path.join(a.tmpfs, "ucpfs-cuda-bench")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    src = os.path.join(a.workdir, "src")
    mnt = os.path.join(a.workdir, "mnt")
    disk = os.path.join(a.workdir, "disk")
    os.makedirs(src)
    os.makedirs(disk)
    init_group()
    import torch.distributed.checkpoint as dcp

    rows = {k: [] for k in ("tmpfs", "mount_save", "mount_sync", "disk", "async", "async_done",
                            "async_mount", "async_mount_done", "async_mount_sync")}
    cache_kind = None
    for rep in range(a.repeat):
        drop_caches()
        tmp_file = os.path.join(tmp_dir, NAME)
        t, _ = timed(lambda: torch.save(sd, tmp_file), a.device)
        rows["tmpfs"].append(t)

        drop_caches()
        argv = [ucpfs, "mount", src, mnt, f"--cache-size={a.cache_size}"]
        with Mount(argv, mnt, umount=[ucpfs, "umount", mnt]):
            target = os.path.join(mnt, f"r{rep}", NAME)
            os.makedirs(os.path.dirname(target))
            t_save, _ = timed(lambda: torch.save(sd, target), a.device)
            t0 = time.perf_counter()
            subprocess.run([ucpfs, "sync", mnt], check=True)
            t_sync = time.perf_counter() - t0
            cache_kind = daemon_cache_kind(mnt)
            # async_save through the mount: staged by DCP, then written into the capture.
            drop_caches()
            t_a, fut = timed(lambda: dcp.async_save(sd, checkpoint_id=os.path.join(mnt, f"dcp{rep}")),
                             a.device)
            t0 = time.perf_counter()
            fut.result()
            t_a_done = time.perf_counter() - t0 + t_a
            t0 = time.perf_counter()
            subprocess.run([ucpfs, "sync", mnt], check=True)
            rows["async_mount"].append(t_a)
            rows["async_mount_done"].append(t_a_done)
            rows["async_mount_sync"].append(time.perf_counter() - t0)
        rows["mount_save"].append(t_save)
        rows["mount_sync"].append(t_sync)
        if rep == 0:
            same = sha256(os.path.join(src, f"r{rep}", NAME)) == sha256(tmp_file)
            log(f"bytes in SRC equal the tmpfs file: {same}")
            if not same:
                sys.exit("cuda_save_bench: the mount's file differs from torch.save's: not timing it")

        drop_caches()
        disk_file = os.path.join(disk, f"r{rep}", NAME)
        os.makedirs(os.path.dirname(disk_file))

        def save_fsync():
            torch.save(sd, disk_file)
            fd = os.open(disk_file, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        t, _ = timed(save_fsync, a.device)
        rows["disk"].append(t)

        drop_caches()
        t_a, fut = timed(lambda: dcp.async_save(sd, checkpoint_id=os.path.join(disk, f"dcp{rep}")),
                         a.device)
        t0 = time.perf_counter()
        fut.result()
        os.sync()
        rows["async"].append(t_a)
        rows["async_done"].append(time.perf_counter() - t0 + t_a)
        os.remove(tmp_file)

    med = {k: statistics.median(v) for k, v in rows.items() if v}
    gib = n_bytes / 2**30
    log(f"\npinned cache memory (stats.json): {cache_kind}")
    log(f"{'measurement':<34}{'median s':>10}{'GiB/s':>9}")
    names = [("tmpfs", "torch.save -> tmpfs"), ("mount_save", "torch.save -> mount (returns)"),
             ("mount_sync", "  then ucpfs sync (durable)"), ("disk", "torch.save -> disk + fsync"),
             ("async", "dcp.async_save -> disk (returns)"), ("async_done", "  until written"),
             ("async_mount", "dcp.async_save -> mount (returns)"),
             ("async_mount_done", "  until written"), ("async_mount_sync", "  then ucpfs sync")]
    for k, label in names:
        log(f"{label:<34}{med[k]:>10.3f}{gib / med[k]:>9.2f}")
    summary = {
        "torch": torch.__version__, "device": a.device,
        "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
        "ucpfs": version, "cache_memory": cache_kind, "bytes": n_bytes, "repeat": a.repeat,
        "median_s": med,
        "ratios": {
            "mount_save_vs_tmpfs": med["mount_save"] / med["tmpfs"],
            "mount_durable_vs_disk": (med["mount_save"] + med["mount_sync"]) / med["disk"],
            "mount_save_vs_async_save_return": med["mount_save"] / med["async"],
            "mount_durable_vs_async_save_done": (med["mount_save"] + med["mount_sync"]) / med["async_done"],
        },
    }
    log(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    shutil.rmtree(tmp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
