"""Benchmark: what users do with a mount, against the same files on disk, in one run (issue 12).

The source is a real DCP checkpoint (gen_bench_dcp.py: torch 1.13, 2 gloo ranks; --tensors 28
gives 1.8 GB). `ucpfs convert` writes the same views to disk first (DISK/target/<layout>/...,
DISK/atomic/...), so both sides read byte-identical files; only the path differs. For each
figure: median of --repeat runs; "cold" evicts the source, the on-disk copies and (by a fresh
mount) the mount's page cache before each run; "warm" repeats at once on the same mount.

  load_target   torch.load of every rank file of --layout (model.pt, optim.pt), one process,
                for each python of --python (torch 1.13 and 2.13), and with mmap=True where
                torch has it (>= 2.1)
  load_atomic   torch.load of every atomic/<param>/*.pt
  cat           cat of the view files (target + atomic) vs cat of the source files (per byte:
                the views hold twice the source's bytes) and vs cat of the same views on disk
  concurrent    --concurrent processes at once, each torch.load-ing its own rank's files of a
                layout with that many ranks (tp<N>_pp1_dp1)
  first_tensor  `ucpfs mount` (until it returns, ready) + torch.load of one atomic file in a
                python that has already imported torch, on a cold cache
  daemon        peak RSS of the daemon over the whole run

Ratios are speed ratios: disk time / mount time (1.0 = parity; above 1 the mount is faster).

Usage: /usr/bin/python3 tests/bench/torch_load_bench.py [--ucpfs build/cli/ucpfs]
       [--workdir DIR] [--repeat 3] [--layout tp2_pp1_dp1] [--tensors 28]
       [--python /usr/bin/python3 --python .venv/bin/python] [--concurrent 8]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from atomic_read_bench import evict, files_under, read_files  # noqa: E402
from bench_common import Mount  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))

# Runs in a child python: loads the files given in argv[2:] with torch.load (argv[1]: "mmap"
# or "plain"), touching every tensor, and prints the seconds the loads took (interpreter start
# and `import torch` excluded).
LOADER = r"""
import sys, time, torch
mode, paths = sys.argv[1], sys.argv[2:]
kw = {"mmap": True} if mode == "mmap" else {}
if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6):
    kw["weights_only"] = True
t0 = time.perf_counter()
n = 0
def touch(o):
    global n
    if isinstance(o, torch.Tensor):
        n += int(o.reshape(-1)[-1:].numel())  # mmap: fault in the last page at least
        if mode == "mmap":
            o.sum()
    elif isinstance(o, dict):
        for v in o.values(): touch(v)
    elif isinstance(o, (list, tuple)):
        for v in o: touch(v)
for p in paths:
    touch(torch.load(p, **kw))
print(time.perf_counter() - t0)
"""


def torch_version(python):
    out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                         text=True, check=True).stdout.strip()
    return out, tuple(int(x) for x in out.split("+")[0].split(".")[:2])


def load_seconds(python, mode, paths):
    p = subprocess.run([python, "-c", LOADER, mode, *paths], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{python} torch.load failed: {p.stderr[-2000:]}")
    return float(p.stdout.strip().splitlines()[-1])


def concurrent_seconds(python, groups):
    """Wall time of len(groups) loader processes started together (each timing its own loads)."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([python, "-c", LOADER, "plain", *g], stdout=subprocess.PIPE, text=True)
             for g in groups]
    for p in procs:
        p.wait()
        if p.returncode != 0:
            raise RuntimeError("a concurrent loader failed")
    return time.perf_counter() - t0


def rank_files(root, layout):
    """[[files of rank r]] under root/target/<layout>/rank_r, model.pt and optim.pt only."""
    d = os.path.join(root, "target", layout)
    ranks = sorted(os.listdir(d), key=lambda r: int(r.split("_")[1]))
    return [[os.path.join(d, r, f) for f in ("model.pt", "optim.pt") if os.path.exists(os.path.join(d, r, f))]
            for r in ranks]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ucpfs", default=os.path.join(ROOT, "build", "cli", "ucpfs"))
    ap.add_argument("--workdir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layout", default="tp2_pp1_dp1")
    ap.add_argument("--tensors", type=int, default=28)
    ap.add_argument("--gen-python", default="/usr/bin/python3",
                    help="the python that saves the checkpoint: torch 1.13's save_state_dict, or torch >= 2.2's "
                         "dcp.save (e.g. .venv/bin/python)")
    ap.add_argument("--python", action="append")
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--only", action="append", choices=["target", "mmap", "atomic", "cat", "concurrent", "first"],
                    help="measure only these figures (repeatable; default: all)")
    ap.add_argument("--mount-arg", action="append", default=[], help="extra `ucpfs mount` argument (repeatable)")
    a = ap.parse_args()
    pythons = a.python or [p for p in ("/usr/bin/python3", os.path.join(ROOT, ".venv", "bin", "python"))
                           if os.path.exists(p)]
    ucpfs = os.path.abspath(a.ucpfs)
    work = a.workdir or tempfile.mkdtemp(prefix="ucpfs-loadbench-")
    src, disk, mnt = (os.path.join(work, x) for x in ("ckpt", "disk", "mnt"))
    if not os.path.exists(os.path.join(src, ".metadata")):
        print(f"generating the benchmark checkpoint in {src} ...", flush=True)
        subprocess.run([a.gen_python, os.path.join(HERE, "gen_bench_dcp.py"), src, "--tensors",
                        str(a.tensors)], check=True)
    subprocess.run([ucpfs, "index", src], check=True, stdout=subprocess.DEVNULL)
    wide = f"tp{a.concurrent}_pp1_dp1"
    if not os.path.exists(os.path.join(disk, "target", wide)):
        shutil.rmtree(disk, ignore_errors=True)
        subprocess.run([ucpfs, "convert", src, disk, f"--layout={a.layout}", f"--layout={wide}", "--atomic"],
                       check=True, stdout=subprocess.DEVNULL)
    sources = files_under(src)
    src_bytes = sum(os.path.getsize(p) for p in sources)
    disk_target = [f for g in rank_files(disk, a.layout) for f in g]
    disk_atomic = files_under(os.path.join(disk, "atomic"))
    disk_all = files_under(disk)
    target_bytes = sum(os.path.getsize(p) for p in disk_target)
    print(f"source: {len(sources)} files, {src_bytes / 1e9:.2f} GB; {a.layout}: {len(disk_target)} rank files, "
          f"{target_bytes / 1e9:.2f} GB; atomic: {len(disk_atomic)} files; median of {a.repeat}", flush=True)

    def on(root, files):
        return [os.path.join(root, os.path.relpath(f, disk)) for f in files]

    argv = [ucpfs, "mount", src, mnt, "--read-only", f"--layout={a.layout}"] + \
        ([f"--layout={wide}"] if wide != a.layout else []) + a.mount_arg
    only = set(a.only or ["target", "mmap", "atomic", "cat", "concurrent", "first"])
    rows = []  # (figure, disk seconds, mount seconds)
    peak_rss = 0.0

    def figure(name, disk_fn, mount_fn, warm_fn=None):
        nonlocal peak_rss
        d, m, w_d, w_m = [], [], [], []
        for _ in range(a.repeat):
            evict(sources + disk_all)
            d.append(disk_fn(disk))
            if warm_fn:
                w_d.append(disk_fn(disk))
            evict(sources + disk_all)
            with Mount(argv, mnt) as mo:
                m.append(mount_fn(mnt))
                if warm_fn:
                    w_m.append(mount_fn(mnt))
                peak_rss = max(peak_rss, mo.figures()[0])
        rows.append((name + (" cold" if warm_fn else ""), statistics.median(d), statistics.median(m)))
        if warm_fn:
            rows.append((name + " warm", statistics.median(w_d), statistics.median(w_m)))
        r = rows[-2:] if warm_fn else rows[-1:]
        for row in r:
            print(f"  {row[0]:44s} disk {row[1]:7.2f} s  mount {row[2]:7.2f} s  ratio {row[1] / row[2]:5.2f}x",
                  flush=True)

    for py in pythons:
        ver, vt = torch_version(py)
        modes = (["plain"] if "target" in only else []) + (["mmap"] if vt >= (2, 1) and "mmap" in only else [])
        for mode in modes:
            figure(f"torch {ver} load {a.layout}" + (" mmap" if mode == "mmap" else ""),
                   lambda root, mode=mode, py=py: load_seconds(py, mode, on(root, disk_target)),
                   lambda root, mode=mode, py=py: load_seconds(py, mode, on(root, disk_target)), warm_fn=True)
        if "atomic" not in only:
            continue
        figure(f"torch {ver} load atomic",
               lambda root, py=py: load_seconds(py, "plain", on(root, disk_atomic)),
               lambda root, py=py: load_seconds(py, "plain", on(root, disk_atomic)), warm_fn=True)
    view_files = disk_target + disk_atomic

    def cat_seconds(paths):
        t0 = time.perf_counter()
        read_files(paths)
        return time.perf_counter() - t0
    if "cat" in only:
        # Per byte: the views hold more bytes than the source (target + atomic), so the source's
        # time is scaled to the views' byte count.
        view_bytes = sum(os.path.getsize(p) for p in view_files)
        figure("cat views (mount) vs cat source (disk), per byte",
               lambda root: cat_seconds(sources) * view_bytes / src_bytes,
               lambda root: cat_seconds(on(root, view_files)))
        figure("cat views (mount) vs cat the same views (disk)", lambda root: cat_seconds(on(root, view_files)),
               lambda root: cat_seconds(on(root, view_files)))
    groups = rank_files(disk, wide)
    if "concurrent" in only:
        figure(f"{len(groups)} concurrent loaders, {wide} (torch {torch_version(pythons[-1])[0]})",
               lambda root: concurrent_seconds(pythons[-1], [on(root, g) for g in groups]),
               lambda root: concurrent_seconds(pythons[-1], [on(root, g) for g in groups]))

    # Mount + first atomic tensor, cold.
    first = []
    one = on(mnt, disk_atomic[:1])
    for _ in range(a.repeat if "first" in only else 0):
        evict(sources)
        with Mount(argv, mnt) as mo:
            first.append(mo.seconds + load_seconds(pythons[-1], "plain", one))
            peak_rss = max(peak_rss, mo.figures()[0])
    if first:
        print(f"  mount + first atomic torch.load (the load in a running python): {statistics.median(first):.3f} s")
    first = first or [0.0]
    print(f"  daemon peak RSS: {peak_rss:.0f} MiB")
    print(json.dumps({"rows": rows, "first_tensor_s": statistics.median(first), "peak_rss_mib": peak_rss}))
    if not a.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
