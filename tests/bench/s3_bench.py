"""Issue 27's speed goal: cold torch.load of a target rank's files through an `s3://` mount
against what a job does without ucpfs: download the checkpoint's objects from the bucket to
local disk (s3fs `get`) and load them there (dcp.load), in one run.

Run under a store's variables, as root (page cache dropped between cold rounds; `--link-mbit N`
limits the store's answers to N Mbit/s with tc on lo, as a store across a link of that speed):
    tests/s3/rgw.sh start /tmp/ucpfs-rgw
    tests/s3/rgw.sh exec /tmp/ucpfs-rgw .venv/bin/python tests/bench/s3_bench.py [--rounds 3]

The checkpoint: a mixed-precision training state saved by one process with torch's own S3 path
(dcp.save through FsspecWriter, s3fs): the model's weights in bf16 (--layers square Linear layers
of --width) and AdamW's fp32 moments keyed by parameter name (get_state_dict), one shard object.
`ucpfs index` builds its index once into the bucket (not timed). Two cases:
  whole   target/tp1_pp1_dp1/rank_0 (model.pt, optim.pt): the rank needs every byte of the shard;
          goal: the mount at least as fast as the download (>= 1.0x)
  part    target/tp1_pp1_dp8_zero1/rank_3: the weights and 1/8 of the optimizer state, a part
          of the shard; goal >= 2x
Each cold round, for each case: drop the page cache, then (a) a fresh `ucpfs mount` (its time
included) and torch.load of the rank's files, then unmount; (b) drop the page cache, s3fs `get`
of every object of the checkpoint to local disk and dcp.load of the whole state from there
(the rank's part is then a slice, not timed); the same for (c) dcp.load straight from the
bucket through FsspecReader (s3fs), torch's own S3 read path (no goal: for reference). Medians
of --rounds; the mount's GET bytes (stats.json s3.bytes_get) beside the download's, and the most
bytes its read-ahead held at once (s3.read_ahead.peak_held_bytes).
"""
import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
sys.path.insert(0, HERE)
import s3_common  # noqa: E402
from bench_common import Mount  # noqa: E402

CASES = (("whole", "tp1_pp1_dp1", 0, 1.0), ("part", "tp1_pp1_dp8_zero1", 3, 2.0))


def log(*a):
    print(*a, flush=True)


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def make_state(layers, width):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    state = s3_common.training_state(model, opt)
    state["model"] = {k: v.to(torch.bfloat16) for k, v in state["model"].items()}  # bf16 weights, fp32 moments
    return state


def template(state):
    """Empty tensors of the saved shapes: what a loader passes to dcp.load."""
    return {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else template(v) if isinstance(v, dict) else
                copy.deepcopy(v)) for k, v in state.items()}


def load_files(files):
    for f in files:
        torch.load(f)


class Link:
    """--link-mbit: the store's answers to this machine limited to N Mbit/s (tc HTB on lo, matching
    the RGW port as source port), as a store reached over a link of that speed rather than from
    memory over loopback; both sides of the comparison go through it. Removed on exit."""

    def __init__(self, mbit):
        from urllib.parse import urlparse
        self.mbit = mbit
        self.port = urlparse(os.environ["AWS_ENDPOINT_URL"]).port

    def __enter__(self):
        if not self.mbit:
            return self
        tc = lambda *a: subprocess.run(["tc", *a], check=True)  # noqa: E731
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10")
        tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit", "burst", "16mb")
        tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate", f"{self.mbit}mbit",
           "ceil", f"{self.mbit}mbit", "burst", "1mb")
        tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", "sport", str(self.port), "0xffff", "flowid", "1:20")
        return self

    def __exit__(self, *exc):
        if self.mbit:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ucpfs", default=os.path.join(ROOT, "build", "cli", "ucpfs"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--mount-option", action="append", default=[], help="more `ucpfs mount` options (repeat)")
    ap.add_argument("--link-mbit", type=int, default=0,
                    help="limit the store's answers to this many Mbit/s (tc on lo; 0: no limit)")
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="ucpfs-s3-bench.")
    os.makedirs(work, exist_ok=True)
    os.environ["XDG_CACHE_HOME"] = os.path.join(work, "cache")  # ucpfs's copy of the bucket's index
    fs = s3_common.filesystem()
    bucket = f"ucpfs-bench-{os.getpid()}"
    url = f"s3://{bucket}/run/step-1"
    s3_common.make_bucket(fs, bucket)
    try:
        state = make_state(a.layers, a.width)
        t0 = time.perf_counter()
        s3_common.dcp_save_s3(state, url)
        objects = {o["name"]: o["size"] for o in fs.ls(url.removeprefix("s3://"), detail=True) if o["type"] == "file"}
        ckpt_bytes = sum(objects.values())
        log(f"saved {ckpt_bytes / 1e6:.1f} MB with FsspecWriter in {time.perf_counter() - t0:.1f} s: "
            f"{ {k.rsplit('/', 1)[1]: v for k, v in objects.items()} }")
        subprocess.run([a.ucpfs, "index", url, "-q"], check=True, stdout=subprocess.DEVNULL)
        plans = {layout: json.loads(subprocess.run([a.ucpfs, "plan", url, f"--layout={layout}", "--json"], check=True,
                                                   capture_output=True, text=True).stdout)
                 for _, layout, _, _ in CASES}
        empty = template(state)
        del state

        def through_mount(layout, rank):
            drop_caches()
            mnt = os.path.join(work, "mnt")
            t = time.perf_counter()
            with Mount([a.ucpfs, "mount", url, mnt, f"--layout={layout}", "--read-only-index", *a.mount_option],
                       mnt) as m:
                d = os.path.join(mnt, "target", layout, f"rank_{rank}")
                load_files([os.path.join(d, f["name"]) for f in plans[layout]["ranks"][rank]["files"]])
                seconds = time.perf_counter() - t
                s3 = json.load(open(os.path.join(mnt, ".ucpfs", "stats.json")))["s3"]
                got = s3["bytes_get"]
                peak_held.append(s3.get("read_ahead", {}).get("peak_held_bytes", 0))  # 0: a build without it
                mount_s.append(m.seconds)
            return seconds, got

        def download_then_load():
            import torch.distributed.checkpoint as dcp
            drop_caches()
            local = os.path.join(work, "download")
            shutil.rmtree(local, ignore_errors=True)
            t = time.perf_counter()
            fs.get(url.removeprefix("s3://") + "/", local, recursive=True)
            dcp.load(template(empty), checkpoint_id=local)
            seconds = time.perf_counter() - t
            shutil.rmtree(local)
            return seconds

        def fsspec_reader():
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
            drop_caches()
            t = time.perf_counter()
            dcp.load(template(empty), storage_reader=FsspecReader(url, **s3_common.s3fs_options()))
            return time.perf_counter() - t

        results = {}
        link = Link(a.link_mbit).__enter__()  # left in the finally below
        if a.link_mbit:
            log(f"the store's answers limited to {a.link_mbit} Mbit/s (tc on lo, port {link.port})")
        mount_s = []  # of `ucpfs mount` alone
        peak_held = []  # the mount's read-ahead: the most bytes held at once (stats.json)
        for name, layout, rank, goal in CASES:
            del mount_s[:]
            del peak_held[:]
            rows = {"mount": [], "download": [], "fsspec": []}
            got = 0
            for _ in range(a.rounds):
                s, got = through_mount(layout, rank)
                rows["mount"].append(s)
                rows["download"].append(download_then_load())
                rows["fsspec"].append(fsspec_reader())
            med = {k: statistics.median(v) for k, v in rows.items()}
            need = plans[layout]["ranks"][rank]["read_bytes"]
            ratio = med["download"] / med["mount"]
            results[name] = {"layout": layout, "rank": rank, "mount_s": list(mount_s), "rank_read_bytes": need, "mount_get_bytes": got,
                             "read_ahead_peak_held_bytes": max(peak_held),
                             "checkpoint_bytes": ckpt_bytes, "seconds": rows, "median_s": med,
                             "ratio_download_over_mount": ratio, "ratio_fsspec_over_mount": med["fsspec"] / med["mount"],
                             "goal": goal, "met": ratio >= goal}
            log(f"{name:5s} {layout}/rank_{rank}: needs {need / 1e6:.1f} of {ckpt_bytes / 1e6:.1f} MB "
                f"(mount GET {got / 1e6:.1f} MB, read-ahead held at most {max(peak_held) / 1e6:.1f} MB); mount + torch.load {med['mount']:.2f} s "
                f"(mount {statistics.median(mount_s):.2f} s) "
                f"({', '.join(f'{x:.2f}' for x in rows['mount'])}), s3fs get + dcp.load {med['download']:.2f} s "
                f"({', '.join(f'{x:.2f}' for x in rows['download'])}), FsspecReader dcp.load {med['fsspec']:.2f} s: "
                f"{ratio:.2f}x (goal >= {goal}x: {'met' if ratio >= goal else 'missed'}), "
                f"{med['fsspec'] / med['mount']:.2f}x over FsspecReader")
        print(json.dumps({"bench": "s3_bench", "date": time.strftime("%Y-%m-%d"), "rounds": a.rounds,
                          "link_mbit": a.link_mbit, "results": results}))
    finally:
        Link(a.link_mbit).__exit__()
        s3_common.remove_bucket(fs, bucket)
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
