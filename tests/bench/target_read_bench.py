"""Benchmark: reading every rank file of target layouts through the mount, against `cat` of
the source and against `ucpfs convert` of the same layout, in one run (ratios are comparable;
absolute numbers on shared machines are not).

For each layout, median of --repeat runs, source evicted from the page cache before each
(fsync + POSIX_FADV_DONTNEED):
  cat      cat of all source files
  mount    read all MNT/target/<layout>/rank_*/* on a fresh mount (each inode once: DP
           replicas of a file share an inode, and reading a shared inode twice is a cache hit)
  convert  ucpfs convert SRC DST --layout=<layout> (same planner, no FUSE, writes to disk)

Usage: /usr/bin/python3 tests/bench/target_read_bench.py [--ucpfs build/cli/ucpfs]
       [--workdir DIR] [--repeat 3] [--layout tp2_pp2_dp2 --layout tp2_pp1_dp2_zero1]
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
sys.path.insert(0, HERE)
from atomic_read_bench import Mount, evict, files_under, read_files, timed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ucpfs", default=os.path.join(HERE, "..", "..", "build", "cli", "ucpfs"))
    ap.add_argument("--workdir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layout", action="append")
    a = ap.parse_args()
    layouts = a.layout or ["tp2_pp2_dp2", "tp2_pp1_dp2_zero1"]
    ucpfs = os.path.abspath(a.ucpfs)
    work = a.workdir or tempfile.mkdtemp(prefix="ucpfs-tbench-")
    src, mnt = os.path.join(work, "ckpt"), os.path.join(work, "mnt")
    if not os.path.exists(os.path.join(src, ".metadata")):
        print(f"generating the benchmark checkpoint in {src} ...", flush=True)
        subprocess.run(["/usr/bin/python3", os.path.join(HERE, "gen_bench_dcp.py"), src], check=True)
    subprocess.run([ucpfs, "index", src], check=True, stdout=subprocess.DEVNULL)
    sources = files_under(src)
    src_bytes = sum(os.path.getsize(p) for p in sources)
    print(f"source: {len(sources)} files, {src_bytes / 2**20:.0f} MiB; median of {a.repeat}")
    for lay in layouts:
        res = {"cat": [], "mount": [], "convert": []}
        n_view = 0
        for _ in range(a.repeat):
            evict(sources)
            res["cat"].append(timed(lambda: read_files(sources)))
            evict(sources)
            with Mount(ucpfs, src, mnt, f"--layout={lay}") as m:
                seen, files = set(), []
                for p in files_under(os.path.join(m, "target", lay)):
                    ino = os.stat(p).st_ino
                    if ino not in seen:
                        seen.add(ino)
                        files.append(p)
                n_view, t = timed(lambda: read_files(files))
                res["mount"].append((n_view, t))
            evict(sources)
            dst = os.path.join(work, "convert-out")
            shutil.rmtree(dst, ignore_errors=True)
            t0 = time.perf_counter()
            subprocess.run([ucpfs, "convert", src, dst, f"--layout={lay}"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            t = time.perf_counter() - t0
            n = sum(os.path.getsize(p) for p in files_under(dst))
            res["convert"].append((n, t))
            shutil.rmtree(dst)

        def mbps(k):
            return statistics.median(n / t / 1e6 for n, t in res[k])
        print(f"{lay}: {n_view / 2**20:.0f} MiB of distinct rank files")
        for k in res:
            print(f"  {k:8s} {mbps(k):8.0f} MB/s")
        print(f"  mount / cat     = {mbps('mount') / mbps('cat'):.2f}x")
        print(f"  mount / convert = {mbps('mount') / mbps('convert'):.2f}x")
    if not a.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
