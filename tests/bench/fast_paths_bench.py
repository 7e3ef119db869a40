"""Benchmark: warm torch.load and torch.load(mmap=True) of target rank files through a mount, with
the kernel's fast paths (--materialize: the kernel serves the views from the cached copies by
FUSE passthrough) and without (--no-passthrough: every byte through the daemon, as with libfuse
3.14), against the same files on disk written by `ucpfs convert`; all in one run (issue 26).

The checkpoint and its on-disk views are torch_load_bench.py's (gen_bench_dcp.py, 1.8 GB with
--tensors 28; `ucpfs convert --layout`), made under --workdir when missing. For each mount
variant: a fresh mount, every rank file loaded once (the warm-up: for --materialize this is the
first opens, served by the daemon, queue the copies' builds, and the rounds start once they are
built: stats.json's kernel.materialize), then --rounds rounds, each loading every rank file from
disk and then through the mount, plain and mmap=True, in this python (touching every tensor: a sum);
figures are medians, ratios disk time / mount time (1.0 = parity). Before that, --cold-rounds rounds
of a cold load (the source and the on-disk files evicted before each side's load and, with
--materialize, the cache emptied; a fresh mount each time, so its first opens are served by the
daemon while the copies are built behind them) on both sides. The daemon's peak RSS (VmHWM) is read
before each unmount. --baseline-ucpfs adds the same rows for another build (e.g. one linked against
Debian's libfuse 3.14: `tests/build.sh build314 -DUCPFS_LIBFUSE=SYSTEM`); --copy-replies adds both
variants again with the daemon's replies copied through its buffer (UCPFS_READ_PATH=copy: no
splice), measured in the same run. --drop-caches makes each cold round drop the whole page cache
(sync; drop_caches=3) instead of evicting only the source and the on-disk files
(POSIX_FADV_DONTNEED): on a VM whose disk is cached by its host the two give different cold ratios,
and this one also drops what both sides read besides the checkpoint (torch's own files, dentries).

Usage: .venv/bin/python tests/bench/fast_paths_bench.py [--ucpfs build/cli/ucpfs]
       [--baseline-ucpfs build314/cli/ucpfs [--baseline-materialize]] [--workdir DIR] [--rounds 7] [--cold-rounds 3]
       [--layout tp2_pp1_dp1] [--tensors 28] [--gen-python .venv/bin/python] [--copy-replies] [--drop-caches]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
from atomic_read_bench import evict, files_under  # noqa: E402
from bench_common import daemon_figures, daemon_pid  # noqa: E402


def load_seconds(paths, mmap):
    t0 = time.perf_counter()
    total = 0.0
    for p in paths:
        sd = torch.load(p, mmap=mmap, weights_only=True)
        for v in sd.values():
            if isinstance(v, torch.Tensor) and v.numel():
                total += float(v.float().sum())
        del sd
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ucpfs", default=os.path.join(ROOT, "build", "cli", "ucpfs"))
    ap.add_argument("--baseline-ucpfs")
    ap.add_argument("--baseline-materialize", action="store_true",
                    help="mount the baseline build with --materialize too (e.g. an older build's copies)")
    ap.add_argument("--workdir", default="/tmp/ucpfs-fastpaths-bench")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cold-rounds", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true",
                    help="cold rounds drop the whole page cache (root), not only the checkpoint's files")
    ap.add_argument("--copy-replies", action="store_true",
                    help="also measure each variant with UCPFS_READ_PATH=copy (replies copied, not spliced)")
    ap.add_argument("--layout", default="tp2_pp1_dp1")
    ap.add_argument("--tensors", type=int, default=28)
    ap.add_argument("--gen-python", default="/usr/bin/python3",
                    help="the python that saves the checkpoint: torch 1.13's save_state_dict, or torch >= 2.2's "
                         "dcp.save (e.g. .venv/bin/python)")
    a = ap.parse_args()
    src, disk, mnt, cache = (os.path.join(a.workdir, x) for x in ("ckpt", "disk", "mnt", "cache"))
    ucpfs = os.path.abspath(a.ucpfs)
    if not os.path.exists(os.path.join(src, ".metadata")):
        subprocess.run([a.gen_python, os.path.join(HERE, "gen_bench_dcp.py"), src, "--tensors", str(a.tensors)],
                       check=True)
    if not os.path.exists(os.path.join(disk, "target", a.layout)):
        shutil.rmtree(disk, ignore_errors=True)
        subprocess.run([ucpfs, "convert", src, disk, f"--layout={a.layout}"], check=True, stdout=subprocess.DEVNULL)
    rel = sorted(os.path.relpath(os.path.join(d, f), disk)
                 for d, _, fs in os.walk(os.path.join(disk, "target", a.layout)) for f in fs if f.endswith(".pt"))
    n_bytes = sum(os.path.getsize(os.path.join(disk, r)) for r in rel)
    print(f"{len(rel)} rank files of {a.layout}, {n_bytes / 1e9:.2f} GB; median of {a.rounds} rounds", flush=True)
    print(subprocess.run([ucpfs, "--version"], capture_output=True, text=True).stdout.strip(), flush=True)

    variants = [("fast paths (--materialize)", ucpfs, ["--materialize", cache], None),
                ("fast paths off (--no-passthrough)", ucpfs, ["--no-passthrough"], None)]
    if a.copy_replies:
        variants += [(name + ", copied replies", binary, extra, "copy") for name, binary, extra, _ in variants]
    if a.baseline_ucpfs:
        variants.append(("baseline build" + (" (--materialize)" if a.baseline_materialize else ""),
                         os.path.abspath(a.baseline_ucpfs), ["--materialize", cache] if a.baseline_materialize else [],
                         None))
    rows = []
    os.makedirs(mnt, exist_ok=True)
    on_disk = [os.path.join(disk, r) for r in rel]
    on_mnt = [os.path.join(mnt, r) for r in rel]
    sources = files_under(src)

    def mount(binary, extra, read_path):
        argv = [binary, "mount", src, mnt, "--read-only", f"--layout={a.layout}", *extra]
        env = dict(os.environ)
        env.pop("UCPFS_READ_PATH", None)
        if read_path:
            env["UCPFS_READ_PATH"] = read_path  # the daemon is forked by `ucpfs mount`: it inherits it
        subprocess.run(argv, check=True, env=env)
        return daemon_pid(argv)

    def wait_for_copies(n_files):
        """With --materialize: until the copies built behind the first opens are done (stats.json)."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with open(os.path.join(mnt, ".ucpfs", "stats.json")) as f:
                mat = json.load(f).get("kernel", {}).get("materialize")
            if not mat or (mat.get("queued", 0) == 0 and mat["files"] >= n_files):
                return
            if mat.get("queued", 0) == 0:  # not all were queued (a full cache): open them again
                load_seconds(on_mnt, False)
            time.sleep(0.2)
        raise SystemExit(f"the copies were not built in 600 s: {mat}")

    def report(row, d, m):
        """Medians, and the range of the per-round ratios (disk / mount of the same round)."""
        rows.append(row)
        ratios = [x / y for x, y in zip(d, m)]
        print(f"  {row[0]:58s} disk {row[1]:6.3f} s  mount {row[2]:6.3f} s  ratio {row[1] / row[2]:5.3f}x"
              f"  (rounds {min(ratios):.2f}-{max(ratios):.2f}x)", flush=True)

    def cold(paths):
        """Evicts `paths` (or, with --drop-caches, the whole page cache) before a cold round."""
        if a.drop_caches:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        else:
            evict(paths)

    for name, binary, extra, read_path in variants:
        peak_mib = 0.0
        for mmap in (False, True):
            d, m = [], []
            for _ in range(a.cold_rounds):
                cold(sources + on_disk)
                d.append(load_seconds(on_disk, mmap))
                # The disk side's files too: each side starts without the other's 1.88 GB cached.
                # Left cached, they made the mount's cold load 2.02 s against 1.24 s on this VM: its
                # load had to take older free memory, which the host had taken back (a fault per
                # first touch; docs/benchmarks.md, "2026-11-28, late: the kernel keeps more
                # read-ahead requests in flight"), a state the disk side never had.
                cold(sources + on_disk)
                pid = mount(binary, extra, read_path)  # a fresh daemon empties the --materialize cache
                try:
                    m.append(load_seconds(on_mnt, mmap))
                    peak_mib = max(peak_mib, daemon_figures(pid)[0])
                finally:
                    subprocess.run([binary, "umount", mnt], check=False)
            if d:
                report((f"{name}: cold torch.load" + (" mmap=True" if mmap else ""), statistics.median(d),
                        statistics.median(m)), d, m)
        pid = mount(binary, extra, read_path)
        try:
            for mmap in (False, True):
                load_seconds(on_disk, mmap)
                load_seconds(on_mnt, mmap)  # warm-up (queues the copies' builds with --materialize)
                wait_for_copies(len(rel))
                d, m = [], []
                for _ in range(a.rounds):
                    d.append(load_seconds(on_disk, mmap))
                    m.append(load_seconds(on_mnt, mmap))
                report((f"{name}: warm torch.load" + (" mmap=True" if mmap else ""), statistics.median(d),
                        statistics.median(m)), d, m)
            with open(os.path.join(mnt, ".ucpfs", "stats.json")) as f:
                kernel = json.load(f).get("kernel", {})
            print(f"  {name}: kernel {json.dumps(kernel)}", flush=True)
            peak_mib = max(peak_mib, daemon_figures(pid)[0])
        finally:
            subprocess.run([binary, "umount", mnt], check=False)
        print(f"  {name}: daemon peak RSS {peak_mib:.1f} MiB", flush=True)
        rows.append((f"{name}: daemon peak RSS MiB", peak_mib, peak_mib))
    print(f"load average {os.getloadavg()}", flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
