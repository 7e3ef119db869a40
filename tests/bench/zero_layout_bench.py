"""How long a ZeRO-1 layout of 4096 data-parallel ranks takes to build on lookup.

Usage (as root, FUSE): .venv/bin/python tests/bench/zero_layout_bench.py [--ucpfs BIN]... [--repeat 3]
       [--layout tp1_pp1_dp4096_zero1] [--workdir DIR]

The source is the target-view tests' checkpoint (tests/e2e/fixtures/gen_llama_train.py: 2 ranks,
row-sharded, 2 steps), written once into the work directory. For each binary given (several:
before and after a change, measured in turns in one run, so they share the machine's load) and
each repetition: a fresh mount, then `ls MNT/target/<layout>` (every rank directory built on that
lookup, each ZeRO rank's optim.pt and ucp_info.json sized), timed; then `ls -lR` of the layout's
tree hashed, so the binaries are seen to serve the same names and sizes. Prints the median per
binary.
"""
import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ucpfs", action="append", help="binary to measure (repeat for several)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layout", default="tp1_pp1_dp4096_zero1")
    ap.add_argument("--workdir", default="/tmp/ucpfs-zero-layout-bench")
    a = ap.parse_args()
    bins = a.ucpfs or [os.path.join(ROOT, "build", "cli", "ucpfs")]
    src = os.path.join(a.workdir, "src")
    if not os.path.isdir(src):
        os.makedirs(a.workdir, exist_ok=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "e2e", "fixtures", "gen_llama_train.py"), src,
                        "--ranks", "2", "--sharding", "rows", "--steps", "2", "--seed", "0"], check=True)
    times = {b: [] for b in bins}
    trees = {b: set() for b in bins}
    mnt = os.path.join(a.workdir, "mnt")
    os.makedirs(mnt, exist_ok=True)
    for _ in range(a.repeat):
        for b in bins:
            subprocess.run([b, "mount", src, mnt, "--log", os.path.join(a.workdir, "log")], check=True)
            try:
                t0 = time.monotonic()
                n = len(os.listdir(os.path.join(mnt, "target", a.layout)))
                times[b].append(time.monotonic() - t0)
                listing = subprocess.run(["ls", "-lR", "--time-style=+", "."], cwd=os.path.join(mnt, "target", a.layout),
                                         check=True, capture_output=True).stdout
                trees[b].add(hashlib.sha256(listing).hexdigest()[:16])
            finally:
                subprocess.run([b, "umount", mnt], check=True)
            assert n > 0, n
    for b in bins:
        print(f"{b}: {a.layout} ({n} ranks) built in {statistics.median(times[b]):.2f} s median "
              f"({', '.join(f'{t:.2f}' for t in times[b])}); tree {', '.join(sorted(trees[b]))}", flush=True)
    if len({t for b in bins for t in trees[b]}) != 1:
        sys.exit("the binaries serve different trees")


if __name__ == "__main__":
    main()
