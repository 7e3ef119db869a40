"""Benchmark (issue 12 item 4, "Scale"): the index, first reads and the daemon's memory on
checkpoints far larger than the others here, all synthetic (gen_scale_dcp.py, torch-free).

Parts (--parts, comma-separated; all by default):
  index    `ucpfs index SRC` of a DCP checkpoint with 1,000 .distcp files (1,000 ranks x 1 file)
           and 20,028 tensors (5,007 parameters with exp_avg, exp_avg_sq and step; every tensor
           but the steps split over 2 ranks: 35,049 chunks; small tensors), SRC/.ucpfs deleted
           before each run: wall time and peak RSS (ru_maxrss of the child, from wait4), median
           of --repeat; then the same with the index already built (reuse), and a mount of it:
           mount time and the daemon's peak RSS after stat'ing every atomic/ file.
           Goal: < 10 s and < 256 MiB.
  read     a 107 GB checkpoint (llama-70B widths, 8 layers, fp32 weights + 2 Adam moments, 8
           ranks x 2 files, FSDP row chunks) whose tensor data are holes (sparse files: a few MB
           on disk) and, for comparison, the same model with 2 layers (46 GB). Each is indexed
           (timed), then mounted fresh with --layout tp2_pp2_dp2 --layout tp8_pp1_dp1 and, with
           the page cache dropped: the first read of target rank files, of atomic files and of a
           rank file of a layout built on lookup (open + first 1 MiB + last 1 MiB; the lookup
           one includes building the layout). Goal: < 1 s each. Then --read-gib GiB are read
           through the mount with 1 MiB reads (half from a target model.pt, half from an atomic
           file) while the daemon's VmRSS is sampled every 50 ms; its VmHWM after. Goal: < 256
           MiB, and the same on both sizes (not growing with the checkpoint).
  layouts  64 layouts of 512 ranks (tp x pp x dp = 512 with pp <= 8, with and without _zero1)
           on one fresh mount of the 107 GB checkpoint, each built on its first lookup under
           target/ (the --lookup-memory-mib budget applies: --lookup-mib, default the mount's
           256), or with --layouts-flag all given with --layout at mount time: every rank
           directory listed and every file stat'ed (no data read). Time, layouts served
           (a refused one is ENOENT and named in the daemon's log), files stat'ed, and the
           daemon's VmHWM after. Goal: all 64 within < 256 MiB.

The checkpoints are generated on the first run into --workdir (default /tmp/ucpfs-scale-bench;
about 4 MB of disk in all for the sparse ones, 80 MB for the 1,000-file one) and reused. Run as
root so the page cache can be dropped; not part of the test run. Prints what it measures, the
goals, and one JSON line.

Usage: /usr/bin/python3 tests/bench/scale_bench.py [--ucpfs build/cli/ucpfs]
       [--workdir /tmp/ucpfs-scale-bench] [--parts index,read,layouts] [--repeat 3]
       [--read-gib 4] [--lookup-mib N] [--layouts-flag]
"""
import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import Mount, daemon_figures  # noqa: E402

ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
GEN = os.path.join(HERE, "gen_scale_dcp.py")
MIB = 1 << 20
GOAL_MIB = 256

MANY = ["--layers", "556", "--dim", "16", "--kv-dim", "8", "--ffn", "32", "--vocab", "64",
        "--ranks", "1000", "--files-per-rank", "1", "--shards", "2"]
BIG = ["--dim", "8192", "--kv-dim", "1024", "--ffn", "28672", "--vocab", "128256",
       "--ranks", "8", "--files-per-rank", "2", "--shards", "8", "--sparse"]
CHECKPOINTS = {"many": MANY, "big": ["--layers", "8"] + BIG, "half": ["--layers", "2"] + BIG}
READ_LAYOUTS = ["tp2_pp2_dp2", "tp8_pp1_dp1"]
LOOKUP_LAYOUT = "tp4_pp2_dp1"


def log(*a):
    print(*a, flush=True)


def generate(work, name):
    """The checkpoint `name` under work/, generated once (its generator's JSON line is kept)."""
    src = os.path.join(work, name)
    stamp = os.path.join(work, name + ".json")
    args = CHECKPOINTS[name]
    if os.path.exists(stamp):
        with open(stamp) as f:
            info = json.load(f)
        if info.get("args") == args:
            return src, info
    log(f"generating {name} in {src} ...")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, GEN, src, *args], check=True, capture_output=True, text=True).stdout
    info = json.loads(out.splitlines()[-1])
    info["args"] = args
    info["generate_seconds"] = round(time.perf_counter() - t0, 1)
    with open(stamp, "w") as f:
        json.dump(info, f)
    return src, info


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass  # not root: the sparse sources have no data blocks to evict anyway


def run_rusage(argv):
    """(wall seconds, peak RSS MiB) of a child process, from wait4."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    t = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    if p.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({p.returncode}): {err}")
    return t, ru.ru_maxrss / 1024


def index_runs(ucpfs, src, repeat):
    """Builds the index `repeat` times from scratch, then reuses it: figures in seconds / MiB."""
    import shutil
    build = []
    for _ in range(repeat):
        shutil.rmtree(os.path.join(src, ".ucpfs"), ignore_errors=True)
        drop_caches()
        build.append(run_rusage([ucpfs, "index", src]))
    drop_caches()
    reuse = run_rusage([ucpfs, "index", src])
    return {"build_s": statistics.median(t for t, _ in build), "build_s_all": [round(t, 3) for t, _ in build],
            "build_rss_mib": max(r for _, r in build), "reuse_s": reuse[0], "reuse_rss_mib": reuse[1]}


def mount_argv(ucpfs, src, mnt, work, extra=()):
    """A `ucpfs mount` command line logging to a fresh work/mount.log."""
    log_file = os.path.join(work, "mount.log")
    if os.path.exists(log_file):
        os.remove(log_file)
    return [ucpfs, "mount", src, mnt, "--log", log_file, *extra]


def walk_stat(top):
    """Lists every directory under `top` and stats every entry: number of files."""
    n = 0
    stack = [top]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    n += 1 if st.st_size >= 0 else 0
    return n


# --- part a: the index of 1,000 files ---------------------------------------------------------

def part_index(a, work, ucpfs):
    src, info = generate(work, "many")
    log(f"index: {info['files']} files, {info['tensors']} tensors, {info['chunks']} chunks, "
        f"{info['params']} params, {info['n_bytes'] / MIB:.0f} MiB of tensor data")
    r = index_runs(ucpfs, src, a.repeat)
    r.update({k: info[k] for k in ("files", "tensors", "chunks", "params")})
    mnt = os.path.join(work, "mnt")
    argv = mount_argv(ucpfs, src, mnt, work)
    drop_caches()
    with Mount(argv, mnt) as m:
        t0 = time.perf_counter()
        n = walk_stat(os.path.join(mnt, "atomic"))
        r["mount_s"] = m.seconds
        r["stat_atomic_s"] = time.perf_counter() - t0
        r["atomic_files"] = n
        r["mount_rss_mib"], _ = m.figures()
    log(f"  ucpfs index (built):  {r['build_s']:.2f} s (runs {r['build_s_all']}), peak RSS {r['build_rss_mib']:.1f} MiB"
        f"   goal < 10 s, < {GOAL_MIB} MiB")
    log(f"  ucpfs index (reused): {r['reuse_s']:.2f} s, peak RSS {r['reuse_rss_mib']:.1f} MiB")
    log(f"  mount: {r['mount_s']:.2f} s; stat of {n} atomic files {r['stat_atomic_s']:.2f} s; "
        f"daemon peak RSS {r['mount_rss_mib']:.1f} MiB")
    r["ok"] = r["build_s"] < 10 and r["build_rss_mib"] < GOAL_MIB
    return r


# --- part b: first reads and memory on 100 GB ---------------------------------------------------

def first_read(path):
    """open + the first MiB + the last MiB: (seconds to the first MiB, seconds in all, size)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, MIB, 0)
        t1 = time.perf_counter()
        size = os.fstat(fd).st_size
        tail = os.pread(fd, MIB, max(0, size - MIB))
        t2 = time.perf_counter()
    finally:
        os.close(fd)
    assert head[:2] == b"PK" and len(tail) == min(MIB, size), path
    return t1 - t0, t2 - t0, size


class RssSampler:
    """Samples a process's VmRSS every `period_s` in a thread: the largest seen, in MiB."""

    def __init__(self, pid, period_s=0.05):
        self.pid, self.period_s, self.max_mib, self.samples = pid, period_s, 0.0, 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        self.max_mib = max(self.max_mib, int(line.split()[1]) / 1024)
                        self.samples += 1
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def read_through(path, n_bytes):
    """Reads n_bytes from the start of `path` with 1 MiB reads: bytes read."""
    buf = bytearray(MIB)
    done = 0
    with open(path, "rb", buffering=0) as f:
        while done < n_bytes:
            k = f.readinto(buf)
            if not k:
                break
            done += k
    return done


def part_read_one(a, work, ucpfs, name):
    src, info = generate(work, name)
    log(f"read [{name}]: {info['n_bytes'] / 1e9:.1f} GB of tensor data in {info['files']} files "
        f"({info['disk_bytes'] / MIB:.1f} MiB on disk), {info['tensors']} tensors, {info['chunks']} chunks")
    r = {"n_bytes": info["n_bytes"], "disk_bytes": info["disk_bytes"]}
    idx = index_runs(ucpfs, src, 1)
    r["index_s"], r["index_rss_mib"] = idx["build_s"], idx["build_rss_mib"]
    mnt = os.path.join(work, "mnt")
    argv = mount_argv(ucpfs, src, mnt, work, [f"--layout={x}" for x in READ_LAYOUTS])
    drop_caches()
    with Mount(argv, mnt) as m:
        r["mount_s"] = m.seconds
        r["mount_rss_mib"], _ = m.figures()
        firsts = {}
        picks = [f"target/{READ_LAYOUTS[0]}/rank_0/model.pt", f"target/{READ_LAYOUTS[0]}/rank_3/optim.pt",
                 f"target/{READ_LAYOUTS[1]}/rank_5/model.pt",
                 "atomic/tok_embeddings.weight/fp32.pt", "atomic/layers.1.feed_forward.w2.weight/exp_avg_sq.pt",
                 f"target/{LOOKUP_LAYOUT}/rank_5/optim.pt"]
        for rel in picks:
            t_head, t_all, size = first_read(os.path.join(mnt, rel))
            firsts[rel] = {"head_s": t_head, "all_s": t_all, "size": size}
            log(f"  first read {rel} ({size / 1e9:.2f} GB): first MiB {t_head * 1e3:.0f} ms, "
                f"+ last MiB {t_all * 1e3:.0f} ms")
        r["first_reads"] = firsts
        r["first_read_max_s"] = max(v["all_s"] for v in firsts.values())
        r["rss_after_first_mib"], _ = m.figures()
        half = int(a.read_gib * (1 << 30)) // 2
        reads = [os.path.join(mnt, f"target/{READ_LAYOUTS[0]}/rank_0/model.pt"),
                 os.path.join(mnt, "atomic/tok_embeddings.weight/exp_avg.pt")]
        with RssSampler(m.pid) as s:
            t0 = time.perf_counter()
            n = sum(read_through(p, half) for p in reads)
            t = time.perf_counter() - t0
        r["read_bytes"], r["read_s"] = n, t
        r["read_rss_max_mib"], r["rss_samples"] = s.max_mib, s.samples
        r["daemon_hwm_mib"], r["daemon_cpu_s"] = m.figures()
    log(f"  index {r['index_s']:.2f} s ({r['index_rss_mib']:.1f} MiB), mount {r['mount_s']:.2f} s; "
        f"slowest first read {r['first_read_max_s'] * 1e3:.0f} ms (goal < 1000 ms)")
    log(f"  read {n / 2**30:.2f} GiB in {t:.2f} s ({n / t / 1e6:.0f} MB/s); daemon VmRSS max "
        f"{s.max_mib:.1f} MiB over {s.samples} samples, VmHWM {r['daemon_hwm_mib']:.1f} MiB (goal < {GOAL_MIB} MiB)")
    return r


def part_read(a, work, ucpfs):
    out = {name: part_read_one(a, work, ucpfs, name) for name in ("half", "big")}
    out["ok"] = all(v["first_read_max_s"] < 1 and v["daemon_hwm_mib"] < GOAL_MIB for v in out.values())
    return out


# --- part c: 64 layouts of 512 ranks -------------------------------------------------------------

def layouts_512(n=64, max_pp=8):
    """n layout names of 512 ranks: tp, pp, dp powers of two, pp <= max_pp; without ZeRO
    first, then with _zero1, each by (tp, pp)."""
    out = []
    for zero in ("", "_zero1"):
        for tp_log in range(10):
            for pp_log in range(10 - tp_log):
                tp, pp = 1 << tp_log, 1 << pp_log
                if pp > max_pp:
                    continue
                out.append(f"tp{tp}_pp{pp}_dp{512 // (tp * pp)}{zero}")
    return out[:n]


def part_layouts(a, work, ucpfs):
    src, info = generate(work, "big")
    names = layouts_512()
    assert len(set(names)) == 64, names
    mnt = os.path.join(work, "mnt")
    extra = [f"--lookup-memory-mib={a.lookup_mib}"] if a.lookup_mib else []
    if a.layouts_flag:
        extra += [f"--layout={x}" for x in names]
    argv = mount_argv(ucpfs, src, mnt, work, extra)
    subprocess.run([ucpfs, "index", src], check=True, stdout=subprocess.DEVNULL)
    drop_caches()
    r = {"how": "--layout" if a.layouts_flag else "lookup", "layouts": len(names), "refused": []}
    with Mount(argv, mnt) as m:
        r["mount_s"] = m.seconds
        r["mount_rss_mib"], _ = m.figures()
        n_files = n_ranks = 0
        per_layout = []
        t0 = time.perf_counter()
        for name in names:
            t1 = time.perf_counter()
            d = os.path.join(mnt, "target", name)
            try:
                ranks = os.listdir(d)
            except OSError as e:
                r["refused"].append(f"{name}: {e.strerror}")
                continue
            n_ranks += len(ranks)
            n_files += walk_stat(d)
            per_layout.append(time.perf_counter() - t1)
        r["seconds"] = time.perf_counter() - t0
        r["ranks"], r["files"] = n_ranks, n_files
        r["layout_s_median"] = statistics.median(per_layout) if per_layout else None
        r["layout_s_max"] = max(per_layout) if per_layout else None
        r["daemon_hwm_mib"], r["daemon_cpu_s"] = m.figures()
        with open(os.path.join(mnt, ".ucpfs", "stats.json")) as f:
            r["lookup_layouts"] = json.load(f).get("lookup_layouts")
    served = len(names) - len(r["refused"])
    log(f"layouts ({r['how']}): {served}/{len(names)} layouts of 512 ranks served, {n_ranks} rank dirs, "
        f"{n_files} files stat'ed in {r['seconds']:.1f} s (per layout median {r['layout_s_median'] or 0:.2f} s, "
        f"max {r['layout_s_max'] or 0:.2f} s); mount {r['mount_s']:.2f} s; daemon VmHWM "
        f"{r['daemon_hwm_mib']:.1f} MiB (goal all 64 within < {GOAL_MIB} MiB)")
    log(f"  lookup budget: {r['lookup_layouts']}")
    for x in r["refused"][:5]:
        log(f"  refused {x}")
    r["ok"] = served == len(names) and r["daemon_hwm_mib"] < GOAL_MIB
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ucpfs", default=os.path.join(ROOT, "build", "cli", "ucpfs"))
    ap.add_argument("--workdir", default="/tmp/ucpfs-scale-bench")
    ap.add_argument("--parts", default="index,read,layouts")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--read-gib", type=float, default=4.0)
    ap.add_argument("--lookup-mib", type=int, help="--lookup-memory-mib for the layouts part")
    ap.add_argument("--layouts-flag", action="store_true", help="give the 64 layouts with --layout")
    a = ap.parse_args()
    ucpfs = os.path.abspath(a.ucpfs)
    work = os.path.abspath(a.workdir)
    os.makedirs(work, exist_ok=True)
    log(f"{datetime.date.today()} {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    parts = {"index": part_index, "read": part_read, "layouts": part_layouts}
    out = {}
    for p in a.parts.split(","):
        out[p] = parts[p](a, work, ucpfs)
    out["load_average"] = os.getloadavg()[0]
    print(json.dumps(out, default=lambda x: round(x, 4) if isinstance(x, float) else str(x)))


if __name__ == "__main__":
    sys.exit(main())
