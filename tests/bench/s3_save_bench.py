"""Saves into an s3:// mount: how long from the start of a save until it is in the bucket, with
a file's full parts streamed while it is written (the default) and without (every part at the
file's turn, UCPFS_UPLOAD_STREAM=off), against saving to local disk and uploading the file with
s3fs `put` (what a job does without ucpfs), in one run.

Run under a store's variables, as root:
    tests/s3/rgw.sh start /tmp/ucpfs-rgw
    tests/s3/rgw.sh exec /tmp/ucpfs-rgw .venv/bin/python tests/bench/s3_save_bench.py [--rounds 3]

The save: one torch.save of a state dict of --tensors fp32 tensors of --mib MiB in all, written
by --writers threads at once into one file each (a writer per rank's shard); with --work-ms the
writers are paced (that long before each 8 MiB they write: a rank copying its state off the GPU
or serializing it as it writes), so the network is faster than the save. Each round, for each case, into a fresh prefix: (a) `ucpfs mount` of the
prefix (not timed), the save into the mount, `ucpfs sync` (returns once every file is in the
bucket): seconds from the save's start to sync's return, and the save alone; (b) the same with
UCPFS_UPLOAD_STREAM=off; (c) the save to local disk, then s3fs `put` of the files. Medians of
--rounds; ratio = (c) / (a), and (b) / (a) for what streaming saves.
"""
import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import s3_common  # noqa: E402


def log(*a):
    print(*a, flush=True)


def save(dst, writers, tensors, mib, work_s):
    """Each writer saves its own file with torch.save. With work_s > 0 the writer is paced: the
    file's bytes (the same torch.save bytes) are written in 8 MiB pieces with work_s between them,
    as a rank that copies its state off the GPU or serializes it while it writes."""
    per = (mib << 20) // (writers * tensors) // 4

    def one(w):
        torch.manual_seed(w)
        sd = {f"t{t}": torch.randn(per) for t in range(tensors)}
        path = os.path.join(dst, f"rank_{w}.pt")
        if work_s <= 0:
            torch.save(sd, path)
            return
        buf = io.BytesIO()
        torch.save(sd, buf)
        view = buf.getbuffer()
        with open(path, "wb") as f:
            for at in range(0, len(view), 8 << 20):
                time.sleep(work_s)
                f.write(view[at:at + (8 << 20)])
    threads = [threading.Thread(target=one, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ucpfs", default=os.path.join(ROOT, "build", "cli", "ucpfs"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--work-ms", type=float, default=0.0, help="pace: this long before each 8 MiB written")
    ap.add_argument("--cache-size", default="1G")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="ucpfs-s3-save-bench.")
    os.makedirs(work, exist_ok=True)
    os.environ["XDG_CACHE_HOME"] = os.path.join(work, "cache")
    fs = s3_common.filesystem()
    rows = {"stream": [], "no_stream": [], "disk_then_put": []}
    save_only = {"stream": [], "no_stream": []}
    streamed_parts = []
    with s3_common.temporary_bucket(fs, "ucpfs-save-bench") as bucket:
        for r in range(a.rounds):
            for case in ("stream", "no_stream"):
                prefix = f"{case}-{r}"
                mnt, stage = os.path.join(work, "mnt"), os.path.join(work, f"stage-{case}-{r}")
                env = dict(os.environ)
                if case == "no_stream":
                    env["UCPFS_UPLOAD_STREAM"] = "off"
                argv = [a.ucpfs, "mount", f"s3://{bucket}/{prefix}", mnt, "--stage-dir", stage,
                        "--index-dir", os.path.join(work, f"index-{case}-{r}"), "--cache-size", a.cache_size]
                os.makedirs(mnt, exist_ok=True)
                subprocess.run(argv, check=True, env=env)
                try:
                    t0 = time.perf_counter()
                    save(mnt, a.writers, a.tensors, a.mib, a.work_ms / 1000)
                    t_save = time.perf_counter() - t0
                    subprocess.run([a.ucpfs, "sync", mnt, "-q"], check=True)
                    rows[case].append(time.perf_counter() - t0)
                    save_only[case].append(t_save)
                    if case == "stream":
                        import json
                        st = json.load(open(os.path.join(mnt, ".ucpfs", "stats.json")))["s3"]["upload"]["streamed"]
                        streamed_parts.append(st["parts_sent"])
                finally:
                    subprocess.run([a.ucpfs, "umount", mnt], check=True, stdout=subprocess.DEVNULL)
                shutil.rmtree(stage, ignore_errors=True)
                fs.rm(f"{bucket}/{prefix}", recursive=True)  # the store keeps objects in memory
            local = os.path.join(work, "local")
            shutil.rmtree(local, ignore_errors=True)
            os.makedirs(local)
            t0 = time.perf_counter()
            save(local, a.writers, a.tensors, a.mib, a.work_ms / 1000)
            for w in range(a.writers):
                fs.put(os.path.join(local, f"rank_{w}.pt"), f"{bucket}/disk-{r}/rank_{w}.pt")
            rows["disk_then_put"].append(time.perf_counter() - t0)
            shutil.rmtree(local)
            fs.rm(f"{bucket}/disk-{r}", recursive=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        log(f"{a.writers} writers, {a.mib} MiB in all, {a.work_ms} ms before each 8 MiB written, medians of {a.rounds}:")
        log(f"  mount, streamed:     {med['stream']:.2f} s to the bucket (save alone {statistics.median(save_only['stream']):.2f} s; "
            f"{statistics.median(streamed_parts)} parts sent while written)")
        log(f"  mount, not streamed: {med['no_stream']:.2f} s (save alone {statistics.median(save_only['no_stream']):.2f} s)")
        log(f"  disk, then s3fs put: {med['disk_then_put']:.2f} s")
        log(f"  ratio disk+put / streamed mount: {med['disk_then_put'] / med['stream']:.2f}x; "
            f"not streamed / streamed: {med['no_stream'] / med['stream']:.2f}x")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
