"""Benchmark: reading every atomic file through the mount vs `cat` of the source files, cold
and warm (page cache of the source), in one run so the ratios are comparable.

  cold:  source evicted from the page cache (posix_fadvise DONTNEED) before each measurement;
         ucpfs = read all MNT/atomic/*/*.pt on a fresh mount, baseline = cat of all source files.
  warm:  source in the page cache; ucpfs = the same read on a fresh mount (nothing in the
         mount's own cache), baseline = reading the source's own files through the same kind of
         fresh mount (passthrough: a plain FUSE read of in-memory data).

Usage: /usr/bin/python3 tests/bench/atomic_read_bench.py [--ucpfs build/cli/ucpfs]
       [--workdir DIR] [--repeat 3] [--tensors 12 --rows 4096 --cols 4096]
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


def evict(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped: write them back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(paths, bufsize=1 << 20):
    n = 0
    buf = bytearray(bufsize)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    break
                n += k
    return n


def timed(fn):
    t0 = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - t0


def files_under(d, skip=(".ucpfs",)):
    out = []
    for root, dirs, files in os.walk(d):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        out += [os.path.join(root, f) for f in sorted(files)]
    return out


class Mount:
    def __init__(self, ucpfs, src, mnt, *extra):
        self.ucpfs, self.src, self.mnt, self.extra = ucpfs, src, mnt, list(extra)

    def __enter__(self):
        os.makedirs(self.mnt, exist_ok=True)
        subprocess.run([self.ucpfs, "mount", self.src, self.mnt, *self.extra], check=True)
        return self.mnt

    def __exit__(self, *exc):
        subprocess.run([self.ucpfs, "umount", self.mnt], check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ucpfs", default=os.path.join(HERE, "..", "..", "build", "cli", "ucpfs"))
    ap.add_argument("--workdir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=12)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    a = ap.parse_args()
    ucpfs = os.path.abspath(a.ucpfs)
    work = a.workdir or tempfile.mkdtemp(prefix="ucpfs-bench-")
    src, mnt = os.path.join(work, "ckpt"), os.path.join(work, "mnt")
    if not os.path.exists(os.path.join(src, ".metadata")):
        print(f"generating {a.tensors} x {a.rows} x {a.cols} fp32 checkpoint in {src} ...", flush=True)
        subprocess.run(["/usr/bin/python3", os.path.join(HERE, "gen_bench_dcp.py"), src,
                        "--tensors", str(a.tensors), "--rows", str(a.rows), "--cols", str(a.cols)], check=True)
    subprocess.run([ucpfs, "index", src], check=True, stdout=subprocess.DEVNULL)
    sources = files_under(src)

    results = {k: [] for k in ("cat_cold", "ucpfs_cold", "fuse_warm", "ucpfs_warm")}
    n_atomic = 0
    for _ in range(a.repeat):
        evict(sources)
        n, t = timed(lambda: int(subprocess.run(["sh", "-c", 'cat "$@" | wc -c', "sh", *sources],
                                                capture_output=True, text=True, check=True).stdout))
        results["cat_cold"].append((n, t))
        evict(sources)
        with Mount(ucpfs, src, mnt) as m:
            atomic = files_under(os.path.join(m, "atomic"))
            n_atomic, t = timed(lambda: read_files(atomic))
            results["ucpfs_cold"].append((n_atomic, t))
        read_files(sources)  # warm the source
        with Mount(ucpfs, src, mnt) as m:
            passthrough = [os.path.join(m, os.path.relpath(p, src)) for p in sources]
            n, t = timed(lambda: read_files(passthrough))
            results["fuse_warm"].append((n, t))
        with Mount(ucpfs, src, mnt) as m:
            atomic = files_under(os.path.join(m, "atomic"))
            n, t = timed(lambda: read_files(atomic))
            results["ucpfs_warm"].append((n, t))

    def mbps(k):
        return statistics.median(n / t / 1e6 for n, t in results[k])

    src_bytes = sum(os.path.getsize(p) for p in sources)
    print(f"source: {len(sources)} files, {src_bytes / 2**20:.0f} MiB; atomic files: {n_atomic / 2**20:.0f} MiB; "
          f"median of {a.repeat}")
    for k in results:
        print(f"  {k:12s} {mbps(k):8.0f} MB/s")
    print(f"cold: ucpfs / cat          = {mbps('ucpfs_cold') / mbps('cat_cold'):.2f}x")
    print(f"warm: ucpfs / FUSE ceiling = {mbps('ucpfs_warm') / mbps('fuse_warm'):.2f}x")
    if not a.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
