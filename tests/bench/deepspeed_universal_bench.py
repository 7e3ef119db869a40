"""Benchmark (issue 9's speed goals): DeepSpeed's offline converter vs the mount's
`<tag>_universal/`, on genuine DeepSpeed checkpoints of 0.6 and 1.5 GB, in one run so the ratios
are comparable.

The checkpoints are saved by the real engine (tests/e2e/fixtures/gen_deepspeed.py: ZeRO-2, 2 gloo
ranks on CPU, fp32, 1 step; Megatron-DeepSpeed names) and cached under --workdir. For each model,
the page cache is dropped (`echo 3 > /proc/sys/vm/drop_caches`, or the source files evicted with
POSIX_FADV_DONTNEED where that is not allowed) before every measurement, on both sides:
  conv          `python -m deepspeed.checkpoint.ds_to_universal` on the tag with --num_extract_workers
                and --num_merge_workers = nproc, into a fresh folder: T_conv;
  first         `ucpfs mount` (index built: SRC/.ucpfs deleted first) + torch.load of
                atomic/<first param>/fp32.pt: T_first; `first (index)`: the index already built;
  read cat      `ucpfs mount` (index built) + 1 MiB reads of every file of <tag>_universal/: T_read;
  read load     the same with torch.load(weights_only=False) of every file;
  ds-out cat / ds-out load   the same two reads of the converter's output folder (no mount),
                for scale: what reading the converted files costs once they exist.
Each mount is fresh; its time (mount) and the daemon's peak RSS (VmHWM) and CPU time are taken
from /proc/<daemon>/ before unmounting. Before timing, the mount's universal files are checked
against the converter's (same file list; a few files loaded and compared with torch.equal), so
the benchmark never times a wrong answer. Goals: T_conv / T_first >= 100, T_conv / T_read >= 2,
daemon peak RSS not growing with the model. Prints a table and a one-line JSON summary.

T_conv is the converter's wall time, its Python start and imports included (it is a program of
its own), its output left in the page cache (no sync). The mount's side runs in this process,
torch already imported. Run as root so the page cache can be dropped. Not part of the test run.

Usage: .venv/bin/python tests/bench/deepspeed_universal_bench.py [--ucpfs build/cli/ucpfs]
       [--workdir /tmp/ucpfs-ds-bench] [--repeat 3] [--models small,large]
"""
import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import torch

from bench_common import Mount

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
GEN = os.path.join(ROOT, "tests", "e2e", "fixtures", "gen_deepspeed.py")

# Model sizes for gen_deepspeed.py; bytes of the tag directory (ZeRO-2 fp32, 16 bytes a parameter).
MODELS = {
    "small": {"hidden": 512, "layers": 4, "ffn": 1408, "vocab": 24001},  # 37.5 M parameters, 0.60 GB
    "large": {"hidden": 768, "layers": 8, "ffn": 2048, "vocab": 24001},  # 93.6 M parameters, 1.50 GB
}
STATES = ("fp32", "exp_avg", "exp_avg_sq")
BUF = 1 << 20


def log(*a):
    print(*a, flush=True)


# --- page cache -------------------------------------------------------------------------------

def files_under(d, skip=(".ucpfs",)):
    out = []
    for root, dirs, files in os.walk(d):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        out += [os.path.join(root, f) for f in sorted(files)]
    return out


class Cache:
    """Drops the whole page cache (both sides alike) where allowed, or else evicts the files of
    the given trees (fsync + POSIX_FADV_DONTNEED)."""

    def __init__(self, trees, how=None):
        self.trees = trees
        self.how = how or ("drop_caches" if os.access("/proc/sys/vm/drop_caches", os.W_OK) else "fadvise")

    def drop(self):
        os.sync()
        if self.how == "drop_caches":
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return
        for t in self.trees:
            for p in files_under(t) if os.path.isdir(t) else []:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


# --- reading ----------------------------------------------------------------------------------

def cat_files(paths):
    n = 0
    buf = bytearray(BUF)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n


def load_files(paths):
    n = 0
    for p in paths:
        obj = torch.load(p, map_location="cpu", weights_only=False)
        n += 1 if obj is not None else 0
    return n


# --- the sanity check -------------------------------------------------------------------------

def same_object(a, b, path):
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), path
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
        return
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            same_object(a[k], b[k], path + [k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same_object(x, y, path + [i])
    elif hasattr(a, "__dict__"):
        same_object(vars(a), vars(b), path + ["__dict__"])
    else:
        assert a == b, (path, a, b)


def check_universal(got, want):
    """The mount's universal folder has the converter's files; a few of them load equal."""
    rel = lambda d: sorted(os.path.relpath(p, d) for p in files_under(d))  # noqa: E731
    assert rel(got) == rel(want), set(rel(got)) ^ set(rel(want))
    params = sorted(x for x in os.listdir(os.path.join(want, "zero")) if os.path.isdir(os.path.join(want, "zero", x)))
    picks = [f"zero/{params[0]}/{s}.pt" for s in STATES + ("step",)]
    picks += [f"zero/{params[len(params) // 2]}/{s}.pt" for s in STATES]
    picks += [f"zero/{params[-1]}/fp32.pt", "zero/optimizer_state.pt"]
    picks += [r for r in rel(want) if not r.startswith("zero/")]  # the model-states files
    for r in picks:
        same_object(torch.load(os.path.join(got, r), weights_only=False),
                    torch.load(os.path.join(want, r), weights_only=False), [r])
    return len(rel(want)), len(picks)


# --- one model --------------------------------------------------------------------------------

def generate(work, name, size):
    src = os.path.join(work, name)
    if os.path.exists(os.path.join(src, "latest")):
        return src
    partial = src + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    log(f"generating {name} {size} in {src} ...")
    args = [f"--{k}={v}" for k, v in size.items()]
    subprocess.run([sys.executable, GEN, "save", partial, "--case", "zero2", "--ranks", "2", "--steps", "1",
                    "--no-truth", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.rename(partial, src)
    return src


def convert(tag_dir, out_dir, workers, log_file):
    """ds_to_universal into a fresh folder: (seconds, {phase: seconds}) from its '***' lines."""
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
           "--output_folder", out_dir, "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]
    marks = [("start", 0.0)]
    t0 = time.perf_counter()
    with open(log_file, "a") as lf, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True, bufsize=1) as p:
        for line in p.stdout:
            lf.write(line)
            m = re.match(r"\*\*\* (\d)\.", line)
            if m:
                marks.append(("step" + m.group(1), time.perf_counter() - t0))
    t = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"ds_to_universal failed ({p.returncode}); see {log_file}")
    marks.append(("end", t))
    names = {"start": "import+load", "step1": "extract", "step2": "merge", "step3": "save+copy"}
    phases = {names[a]: b_t - a_t for (a, a_t), (_, b_t) in zip(marks, marks[1:])}
    return t, phases


def bench_model(a, name, cache_how):
    work = os.path.abspath(a.workdir)
    src = generate(work, name, MODELS[name])
    tag = open(os.path.join(src, "latest")).read().strip()
    tag_dir = os.path.join(src, tag)
    src_bytes = sum(os.path.getsize(p) for p in files_under(tag_dir))
    ds_out = os.path.join(work, name + "-ds", tag + "_universal")
    mnt = os.path.join(work, "mnt")
    mlog = os.path.join(work, "mount.log")
    clog = os.path.join(work, "ds_to_universal.log")
    cache = Cache([src, os.path.dirname(ds_out)], cache_how)
    workers = os.cpu_count()
    log(f"[{name}] {tag_dir}: {src_bytes / 1e9:.2f} GB")

    rows = {k: [] for k in ("conv", "first", "first (index)", "read cat", "read load", "ds-out cat", "ds-out load")}
    phases = []

    def measure(key, fn):
        """fn() -> dict with "seconds" (what it timed) and more figures."""
        cache.drop()
        rows[key].append(fn())

    def timed(fn):
        def run():
            t0 = time.perf_counter()
            n = fn()
            return dict(seconds=time.perf_counter() - t0, n=n)
        return run

    def mounted(build_index, body):
        """Timed: `ucpfs mount` + body; not timed: deleting the index, unmounting."""
        def run():
            if build_index:
                shutil.rmtree(os.path.join(src, ".ucpfs"), ignore_errors=True)
            cache.drop()
            t0 = time.perf_counter()
            with Mount([a.ucpfs, "mount", src, mnt, "--log", mlog], mnt) as m:
                n = body(m.mnt)
                seconds = time.perf_counter() - t0
                rss_mib, cpu_s = m.figures()
            return dict(seconds=seconds, mount=m.seconds, rss_mib=rss_mib, cpu_s=cpu_s, n=n)
        return run

    first_name = None
    for r in range(a.repeat):
        def conv():
            shutil.rmtree(os.path.dirname(ds_out), ignore_errors=True)  # not timed
            cache.drop()
            t, ph = convert(tag_dir, ds_out, workers, clog)
            phases.append(ph)
            return dict(seconds=t)
        measure("conv", conv)
        if r == 0:  # the mount must give the converter's answer before it is timed
            with Mount([a.ucpfs, "mount", src, mnt, "--log", mlog], mnt) as m:
                n_files, n_checked = check_universal(os.path.join(m.mnt, tag + "_universal"), ds_out)
                first_name = sorted(os.listdir(os.path.join(m.mnt, "atomic")))[0]
            log(f"[{name}] sanity: {n_files} universal files, as the converter's; {n_checked} compared "
                f"with torch.equal; first atomic tensor {first_name}")
        first_file = lambda m: torch.load(os.path.join(m, "atomic", first_name, "fp32.pt"))["param"].numel()  # noqa: E731,B023
        universal = lambda m: files_under(os.path.join(m, tag + "_universal"))  # noqa: E731
        measure("first", mounted(True, first_file))
        measure("first (index)", mounted(False, first_file))
        measure("read cat", mounted(True, lambda m: cat_files(universal(m))))
        measure("read load", mounted(True, lambda m: load_files(universal(m))))
        measure("ds-out cat", timed(lambda: cat_files(files_under(ds_out))))
        measure("ds-out load", timed(lambda: load_files(files_under(ds_out))))
        log(f"[{name}] repeat {r + 1}/{a.repeat}: " + ", ".join(f"{k} {v[-1]['seconds']:.3f} s" for k, v in rows.items()))

    med = lambda key, field="seconds": statistics.median(x[field] for x in rows[key])  # noqa: E731
    return {
        "model": name, "size": MODELS[name], "tag_bytes": src_bytes,
        "universal_bytes": rows["read cat"][0]["n"], "ds_out_bytes": rows["ds-out cat"][0]["n"],
        "universal_files": len(files_under(ds_out)), "first_param": first_name,
        "t": {k: med(k) for k in rows},
        "mount_s": {k: med(k, "mount") for k in rows if "mount" in rows[k][0]},
        "daemon_rss_mib": {k: max(x["rss_mib"] for x in rows[k]) for k in rows if "rss_mib" in rows[k][0]},
        "daemon_cpu_s": {k: med(k, "cpu_s") for k in rows if "cpu_s" in rows[k][0]},
        "conv_phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
    }


def report(results, a, cache_how):
    log("")
    log(f"{os.cpu_count()} cores, {datetime.date.today()}, median of {a.repeat}; page cache dropped "
        f"({cache_how}) before each measurement; ds_to_universal with {os.cpu_count()} extract/merge workers")
    head = f"{'':16s}" + "".join(f"{r['model'] + ' (' + format(r['tag_bytes'] / 1e9, '.2f') + ' GB)':>34s}" for r in results)
    log(head)
    log(f"{'':16s}" + "".join(f"{'wall s':>10s}{'mount s':>8s}{'RSS MiB':>8s}{'CPU s':>8s}" for _ in results))
    for key in results[0]["t"]:
        line = f"{key:16s}"
        for r in results:
            line += f"{r['t'][key]:10.3f}"
            if key in r["mount_s"]:
                line += f"{r['mount_s'][key]:8.3f}{r['daemon_rss_mib'][key]:8.1f}{r['daemon_cpu_s'][key]:8.2f}"
            else:
                line += f"{'':24s}"
        log(line)
    for r in results:
        t = r["t"]
        log(f"{r['model']}: ds_to_universal phases " +
            ", ".join(f"{k} {v:.2f} s" for k, v in r["conv_phases_s"].items()))
        first, read = t["conv"] / t["first"], t["conv"] / max(t["read cat"], t["read load"])
        log(f"{r['model']}: T_conv / T_first = {first:.1f}x (index built), "
            f"{t['conv'] / t['first (index)']:.1f}x (index present)   "
            f"[goal >= 100: {'met' if first >= 100 else 'missed'}]")
        log(f"{r['model']}: T_conv / T_read  = {t['conv'] / t['read cat']:.1f}x (cat), "
            f"{t['conv'] / t['read load']:.1f}x (torch.load)   [goal >= 2: {'met' if read >= 2 else 'missed'}]")
    rss = [max(r["daemon_rss_mib"].values()) for r in results]
    log("daemon peak RSS: " + ", ".join(f"{r['model']} {x:.1f} MiB" for r, x in zip(results, rss)))
    summary = {"bench": "deepspeed_universal", "date": str(datetime.date.today()), "cores": os.cpu_count(),
               "repeat": a.repeat, "cache": cache_how, "models": {}}
    for r in results:
        t = r["t"]
        summary["models"][r["model"]] = {
            "tag_bytes": r["tag_bytes"], "universal_bytes": r["universal_bytes"], "ds_out_bytes": r["ds_out_bytes"],
            "universal_files": r["universal_files"],
            "t_conv": round(t["conv"], 3), "t_first": round(t["first"], 4),
            "t_first_index_present": round(t["first (index)"], 4),
            "t_read_cat": round(t["read cat"], 3), "t_read_load": round(t["read load"], 3),
            "t_ds_out_cat": round(t["ds-out cat"], 3), "t_ds_out_load": round(t["ds-out load"], 3),
            "conv_over_first": round(t["conv"] / t["first"], 1),
            "conv_over_read_cat": round(t["conv"] / t["read cat"], 2),
            "conv_over_read_load": round(t["conv"] / t["read load"], 2),
            "daemon_peak_rss_mib": round(max(r["daemon_rss_mib"].values()), 1),
            "conv_phases_s": {k: round(v, 2) for k, v in r["conv_phases_s"].items()},
        }
    print(json.dumps(summary, separators=(",", ":")), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ucpfs", default=os.path.join(ROOT, "build", "cli", "ucpfs"))
    ap.add_argument("--workdir", default="/tmp/ucpfs-ds-bench",
                    help="generated checkpoints are kept here and reused")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models", default="small,large", help=f"comma-separated, of {sorted(MODELS)}")
    a = ap.parse_args()
    a.ucpfs = os.path.abspath(a.ucpfs)
    names = a.models.split(",")
    if not names or any(n not in MODELS for n in names) or a.repeat < 1:
        ap.error("bad --models or --repeat")
    os.makedirs(a.workdir, exist_ok=True)
    cache_how = Cache([]).how
    results = [bench_model(a, n, cache_how) for n in names]
    report(results, a, cache_how)


if __name__ == "__main__":
    sys.exit(main())
