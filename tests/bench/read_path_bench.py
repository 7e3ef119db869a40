"""Benchmark: the daemon's read path (issue 26, item 4), old and new in one run.

The daemon reads views through the batched read path and splices the source's plain bytes into
its replies by default ("splice"); UCPFS_READ_PATH=copy in its environment copies every reply
through its buffer ("copy": the batched path before splicing), and UCPFS_READ_PATH=legacy brings
back the path before batching (an engine made per source read, the copy plan of a tensor made
again per request, one descriptor-cache lookup and one fstat per source read, read-ahead as
WILLNEED hints only). Every figure is measured for each of --paths (default all three), in this
one run.

  ceiling     `cat` of every rank file of --layout (model.pt, optim.pt) through a fresh mount of
              a tmpfs-resident copy of the checkpoint, against `cat` of one file of the same
              byte count served by null_fuse_server (a libfuse server answering reads with
              zeros, configured as the daemon is): the FUSE ceiling of this machine. Also the
              daemon's CPU time per byte (user + system, from /proc/<pid>/stat), both servers.
  concurrent  --concurrent loader processes at once, each torch.load-ing its own rank's files
              of tp<N>_pp1_dp1 through a fresh mount of the on-disk checkpoint, cold (page cache
              of the source evicted), against the same files written to disk by `ucpfs convert`,
              cold too.

Ratios are speed ratios (above 1: faster than the baseline). Median of --repeat.

Usage (root, after `cmake --build build --target ucpfs`):
  .venv/bin/python tests/bench/read_path_bench.py [--workdir DIR] [--tmpfs /dev/shm] [--repeat 5]
      [--tensors 12] [--layout tp2_pp1_dp1] [--concurrent 8] [--only ceiling|concurrent]
      [--paths legacy,copy,splice]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from atomic_read_bench import evict, files_under, read_files  # noqa: E402
from bench_common import Mount, daemon_figures  # noqa: E402
from torch_load_bench import concurrent_seconds, rank_files  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
ALL_PATHS = ("legacy", "copy", "splice")


def env_for(path):
    env = dict(os.environ)
    env.pop("UCPFS_READ_PATH", None)
    if path != "splice":
        env["UCPFS_READ_PATH"] = path
    return env


class EnvMount(Mount):
    """bench_common.Mount with the daemon's environment set (it is forked by `ucpfs mount`)."""

    def __init__(self, argv, mnt, env):
        super().__init__(argv, mnt)
        self.env = env

    def __enter__(self):
        old = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)
        try:
            return super().__enter__()
        finally:
            os.environ.clear()
            os.environ.update(old)


def set_read_ahead(mnt, kib=1024):
    """The mount's bdi read_ahead_kb (ucpfs raises its own to max_read; do the same for the null
    server, so both read ahead alike)."""
    dev = os.stat(mnt).st_dev
    p = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(p, "w") as f:
            f.write(str(kib))
    except OSError:
        pass


def null_server_cat(binary, mnt, n_bytes):
    """(seconds, server CPU seconds) of `cat` of n_bytes from a fresh null server."""
    os.makedirs(mnt, exist_ok=True)
    proc = subprocess.Popen([binary, mnt, str(n_bytes)])
    try:
        for _ in range(500):
            if os.path.exists(os.path.join(mnt, "zeros")):
                break
            time.sleep(0.01)
        set_read_ahead(mnt)
        cpu0 = daemon_figures(proc.pid)[1]
        t0 = time.perf_counter()
        got = read_files([os.path.join(mnt, "zeros")])
        seconds = time.perf_counter() - t0
        cpu = daemon_figures(proc.pid)[1] - cpu0
        assert got == n_bytes, (got, n_bytes)
    finally:
        subprocess.run(["fusermount3", "-u", mnt], check=False)
        proc.wait(timeout=30)
    return seconds, cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ucpfs", default=os.path.join(ROOT, "build", "cli", "ucpfs"))
    ap.add_argument("--workdir", default="/tmp/ucpfs-readpath-bench")
    ap.add_argument("--tmpfs", default="/dev/shm")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tensors", type=int, default=12)
    ap.add_argument("--layout", default="tp2_pp1_dp1")
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--only", action="append", choices=["ceiling", "concurrent"])
    ap.add_argument("--paths", default=",".join(ALL_PATHS), help="read paths to measure, comma-separated")
    a = ap.parse_args()
    PATHS = tuple(p for p in a.paths.split(",") if p)
    assert PATHS and all(p in ALL_PATHS for p in PATHS), a.paths
    only = set(a.only or ["ceiling", "concurrent"])
    ucpfs = os.path.abspath(a.ucpfs)
    work = a.workdir
    src, disk = os.path.join(work, "ckpt"), os.path.join(work, "disk")
    mnt, null_mnt = os.path.join(work, "mnt"), os.path.join(work, "null")
    wide = f"tp{a.concurrent}_pp1_dp1"
    if not os.path.exists(os.path.join(src, ".metadata")):
        print(f"generating the benchmark checkpoint in {src} ...", flush=True)
        subprocess.run(["/usr/bin/python3", os.path.join(HERE, "gen_bench_dcp.py"), src, "--tensors",
                        str(a.tensors)], check=True)
    subprocess.run([ucpfs, "index", src], check=True, stdout=subprocess.DEVNULL)
    null_bin = os.path.join(work, "null_fuse_server")
    subprocess.run(f"cc -O2 -o {null_bin} {HERE}/null_fuse_server.c $(pkg-config --cflags --libs fuse3)",
                   shell=True, check=True)
    result = {"load_avg": os.getloadavg()[0]}
    sources = files_under(src)
    print(f"source: {len(sources)} files, {sum(os.path.getsize(p) for p in sources) / 1e9:.2f} GB; "
          f"median of {a.repeat}; load average {os.getloadavg()[0]:.1f}", flush=True)

    if "ceiling" in only:
        shm = os.path.join(a.tmpfs, "ucpfs-readpath-bench")
        shutil.rmtree(shm, ignore_errors=True)
        shutil.copytree(src, shm)  # the index too: it names the files by path under SRC
        subprocess.run([ucpfs, "index", shm], check=True, stdout=subprocess.DEVNULL)
        try:
            argv = [ucpfs, "mount", shm, mnt, "--read-only", f"--layout={a.layout}"]
            with Mount(argv, mnt):
                files = [f for g in rank_files(mnt, a.layout) for f in g]
                rel = [os.path.relpath(f, mnt) for f in files]
                n_bytes = sum(os.path.getsize(f) for f in files)
            print(f"ceiling: cat of {len(files)} rank files of {a.layout}, {n_bytes / 1e9:.2f} GB, tmpfs source",
                  flush=True)
            runs = {p: [] for p in PATHS + ("null",)}
            for _ in range(a.repeat):
                runs["null"].append(null_server_cat(null_bin, null_mnt, n_bytes))
                for path in PATHS:
                    with EnvMount(argv, mnt, env_for(path)) as m:
                        cpu0 = m.figures()[1]
                        t0 = time.perf_counter()
                        got = read_files([os.path.join(mnt, r) for r in rel])
                        seconds = time.perf_counter() - t0
                        runs[path].append((seconds, m.figures()[1] - cpu0))
                        assert got == n_bytes
            med = {p: (statistics.median(s for s, _ in r), statistics.median(c for _, c in r))
                   for p, r in runs.items()}
            for p in ("null",) + PATHS:
                s, c = med[p]
                print(f"  {p:8s} {n_bytes / s / 1e9:6.2f} GB/s  server CPU {c * 1e9 / n_bytes:6.3f} ns/byte"
                      + ("" if p == "null" else f"  {med['null'][0] / s:5.2f}x of the ceiling"), flush=True)
            result["ceiling"] = {p: {"seconds": s, "cpu_s": c, "gbps": n_bytes / s / 1e9,
                                     "cpu_ns_per_byte": c * 1e9 / n_bytes} for p, (s, c) in med.items()}
            result["ceiling"]["bytes"] = n_bytes
            for p in PATHS:
                result["ceiling"][p]["of_ceiling"] = med["null"][0] / med[p][0]
        finally:
            shutil.rmtree(shm, ignore_errors=True)

    if "concurrent" in only:
        if not os.path.exists(os.path.join(disk, "target", wide)):
            shutil.rmtree(disk, ignore_errors=True)
            subprocess.run([ucpfs, "convert", src, disk, f"--layout={wide}"], check=True, stdout=subprocess.DEVNULL)
        groups = rank_files(disk, wide)
        disk_all = files_under(disk)
        argv = [ucpfs, "mount", src, mnt, "--read-only", f"--layout={wide}"]
        runs = {p: [] for p in ("disk",) + PATHS}
        for _ in range(a.repeat):
            evict(sources + disk_all)
            runs["disk"].append(concurrent_seconds(a.python, groups))
            for path in PATHS:
                evict(sources + disk_all)
                with EnvMount(argv, mnt, env_for(path)):
                    on = [[os.path.join(mnt, os.path.relpath(f, disk)) for f in g] for g in groups]
                    runs[path].append(concurrent_seconds(a.python, on))
        med = {p: statistics.median(r) for p, r in runs.items()}
        print(f"concurrent: {len(groups)} loaders of {wide}, cold", flush=True)
        for p in ("disk",) + PATHS:
            print(f"  {p:8s} {med[p]:6.2f} s" + ("" if p == "disk" else f"  {med['disk'] / med[p]:5.2f}x of disk"),
                  flush=True)
        result["concurrent"] = {p: {"seconds": s} for p, s in med.items()}
        for p in PATHS:
            result["concurrent"][p]["of_disk"] = med["disk"] / med[p]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
