"""Benchmark (issue 10's speed goals for write capture): torch.save of a large state dict into a
ucpfs mount vs the same torch.save into tmpfs, onto the disk with fsync, and `fio` on the same
disk, in one run so the ratios are comparable.

One state dict is made once in memory (--tensors fp32 tensors of --numel random values each,
default 384 x 1 Mi = 1.5 GiB; the file torch.save writes is 1.5 GiB + a few KiB). Every file is
named model.pt, because torch.save names its zip records after the file. Before every
measurement the page cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`), and the
previous repetition's file is deleted (not timed). Each repetition measures:
  tmpfs         torch.save into --tmpfs (default /dev/shm): T_tmpfs, the wall time of the call;
  mount <size>  a fresh `ucpfs mount SRC MNT --cache-size <size>` of an empty SRC (one mount with
                a cache that holds the file, --cache-size, default 2G; one with a smaller cache,
                --small-cache, default 512M, to show back-pressure): T_save, the wall time of
                torch.save into MNT/model.pt (how long the trainer is blocked), then T_sync, the
                wall time of `ucpfs sync MNT` run right after (the command returns once the file
                is durable in SRC). stats.json is read when torch.save returns and after the sync;
                the daemon's peak RSS (VmHWM) and CPU time are read before unmounting;
  disk          torch.save into a folder of --workdir (the filesystem SRC lives on), then fsync of
                the file and of its folder: T_disk (save and fsyncs), T_disk_save (save alone);
  replay <size> the same two mounts, but the file's bytes (what torch.save wrote, held in memory)
                written into MNT/model.pt with 8 MiB os.write calls, then `ucpfs sync MNT`: the FUSE
                path takes these faster than the disk, so the flushers have a backlog and their own
                throughput shows (torch.save produces its bytes more slowly than the disk takes them);
  fio           `fio --rw=write --ioengine=io_uring --direct=1 --bs=8M --iodepth=8 --end_fsync=1
                --fallocate=none` of the file's size (rounded up to 8 MiB, the capture's chunk) into a
                fresh file in --workdir: its own bandwidth figure (bw_bytes), B_fio.
Goals (issue 10), each a ratio of medians from the same run:
  1. T_save(mount, big cache) / T_tmpfs <= 1.2 (the small cache's ratio is shown too);
  2. (T_save + T_sync)(mount, big cache) / T_disk <= 1.0;
  3. flush throughput / B_fio >= 0.9, on the replay with the big cache (the torch.save rows are
     shown too), the flush throughput taken three ways:
       stats     bytes_flushed / flush_busy_seconds of stats.json (time with a flush in flight);
       end       file bytes / (T_write + T_sync): from the first write until the file is durable;
       drain     bytes still to flush when the writer returned / T_sync: the flushers alone
                 (taken only from repetitions where that backlog is at least a tenth of the
                 file; "(k of N)" says how many).
The load average is printed at the start and the end: on a shared machine the figures move with it.
Before timing, the bytes a mount leaves in SRC (torch.save with both cache sizes, and the replay,
each after `ucpfs sync`) are checked to equal what torch.save writes into a plain file of the same
name, so nothing wrong is timed.

--small-ops runs only two small-operation figures instead (no torch.save, no fio):
  random writes  a fresh mount with --random-cache (default 16M); MNT/random.bin written whole
                (--random-file-mib, default 64) and fsync'd, then --random-writes (default 3000)
                4 KiB os.pwrite calls at random page-aligned offsets (seeded), closed, `ucpfs sync`:
                writes/s of the pwrite calls alone, and bytes flushed (stats.json's bytes_flushed
                from the fsync to after the sync) / bytes written at random;
  creates        --creates (default 1000) files of 4 KiB made in one folder (open O_CREAT|O_EXCL,
                one write, close) through a fresh mount, and the same into a plain folder of
                SRC's filesystem, alternately, --repeat times: files/s of each and their ratio
                (the mount's `ucpfs sync` afterwards is timed apart).

Run as root (drop_caches, mlock of the cache) after `cmake --build build --target ucpfs`; needs
fio (`apt-get install -y fio`). Not part of the test run. Prints a table and a one-line JSON
summary.

Usage: .venv/bin/python tests/bench/write_capture_bench.py [--ucpfs build/cli/ucpfs]
       [--workdir /tmp/ucpfs-wc-bench] [--tmpfs /dev/shm] [--repeat 3]
       [--tensors 384 --numel 1048576] [--cache-size 2G] [--small-cache 512M]
       .venv/bin/python tests/bench/write_capture_bench.py --small-ops [--random-cache 16M]
       [--random-file-mib 64] [--random-writes 3000] [--creates 1000] [--repeat 3]
"""
import argparse
import random
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

from bench_common import Mount

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
NAME = "model.pt"  # torch.save names the zip records after the file: the same name everywhere
CHUNK = 8 << 20    # the capture's chunk (PinnedCacheOptions::chunk_bytes)


def log(*a):
    print(*a, flush=True)


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def same_bytes(a, b, block=16 << 20):
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


# --- the mount ------------------------------------------------------------------------------

class CaptureMount(Mount):
    """A fresh mount of an emptied SRC with --cache-size; `seconds` includes mapping, populating
    and locking the cache. Unmounted with `ucpfs umount` (which syncs first)."""

    def __init__(self, ucpfs, src, mnt, cache_size, log_file):
        super().__init__([ucpfs, "mount", src, mnt, "--cache-size", cache_size, "--log", log_file], mnt,
                         umount=[ucpfs, "umount", mnt])
        self.ucpfs, self.src = ucpfs, src

    def __enter__(self):
        shutil.rmtree(self.src, ignore_errors=True)
        os.makedirs(self.src)
        return super().__enter__()

    def capture(self):
        with open(os.path.join(self.mnt, ".ucpfs", "stats.json")) as f:
            return json.load(f)["capture"]

    def sync(self):
        subprocess.run([self.ucpfs, "sync", self.mnt], check=True)


# --- the measurements -------------------------------------------------------------------------

def make_state(n_tensors, numel):
    g = torch.Generator().manual_seed(10)
    return {f"layers.{i}.weight": torch.randn(numel, generator=g).reshape(-1, 1024) if numel % 1024 == 0
            else torch.randn(numel, generator=g) for i in range(n_tensors)}


def fsync_path(path, flags=os.O_RDONLY):
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_plain(sd, d, durable):
    """torch.save into d/model.pt: T_tmpfs (durable=False), or T_disk with the fsyncs of the
    file and of d (durable=True; `save` is the torch.save alone). The file is deleted after."""
    path = os.path.join(d, NAME)
    unlink(path)
    drop_caches()
    t0 = time.perf_counter()
    torch.save(sd, path)
    t_save = time.perf_counter() - t0
    if durable:
        fsync_path(path)
        fsync_path(d, os.O_RDONLY | os.O_DIRECTORY)
    t = time.perf_counter() - t0
    n = os.path.getsize(path)
    unlink(path)  # not timed; frees the memory
    return dict(seconds=t, save=t_save, bytes=n)


def write_all(path, data, block=CHUNK):
    """The replay: `data` written into a new file with `block`-sized os.write calls."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        at = 0
        while at < len(view):
            at += os.write(fd, view[at:at + block])
    finally:
        os.close(fd)


def save_mount(writer, a, cache_size, work):
    """writer(path) saves the file; timed: it, then `ucpfs sync`."""
    src, mnt = os.path.join(work, "src"), os.path.join(work, "mnt")
    with CaptureMount(a.ucpfs, src, mnt, cache_size, os.path.join(work, "mount.log")) as m:
        drop_caches()
        t0 = time.perf_counter()
        writer(os.path.join(mnt, NAME))
        t_save = time.perf_counter() - t0
        at_save = m.capture()  # a few ms; before the sync's clock starts
        t1 = time.perf_counter()
        m.sync()
        t_sync = time.perf_counter() - t1
        after = m.capture()
        rss_mib, cpu_s = m.figures()
        mount_s = m.seconds
    n = os.path.getsize(os.path.join(src, NAME))
    assert after["bytes_captured"] == n and after["bytes_flushed"] == n, (n, after)
    assert after["files_committed"] == 1 and after["flush_errors"] == 0, after
    backlog = after["bytes_flushed"] - at_save["bytes_flushed"]
    return dict(save=t_save, sync=t_sync, seconds=t_save + t_sync, bytes=n, mount=mount_s,
                rss_mib=rss_mib, cpu_s=cpu_s, backlog=backlog,
                stats_rate=after["flush_bytes_per_second"],
                busy=after["flush_busy_seconds"], blocked=after["writers_blocked_seconds"],
                cache_mib=after["cache_bytes"] / 2**20, memory=after["memory"], engine=after["engine"],
                end_rate=n / (t_save + t_sync),
                drain_rate=backlog / t_sync if t_sync > 0 and backlog * 10 >= n else float("nan"))


def run_fio(d, n_bytes):
    path = os.path.join(d, "fio.dat")
    unlink(path)
    size = (n_bytes + CHUNK - 1) // CHUNK * CHUNK
    drop_caches()
    cmd = ["fio", "--name=wcb", f"--filename={path}", f"--size={size}", "--rw=write", "--bs=8M",
           "--ioengine=io_uring", "--direct=1", "--iodepth=8", "--end_fsync=1", "--fallocate=none",
           "--output-format=json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t0
    unlink(path)
    w = json.loads(out[out.index("{"):])["jobs"][0]["write"]
    return dict(seconds=wall, bytes=size, rate=float(w["bw_bytes"]), wall_rate=size / wall)


# --- the check --------------------------------------------------------------------------------

def check(sd, a, work, tmpfs_dir):
    """SRC's bytes after a save through the mount (each cache size; the replay) and `ucpfs sync`
    equal torch.save's output into a plain file of the same name; so do the disk baseline's.
    Returns that output, for the replay."""
    want = os.path.join(tmpfs_dir, NAME)
    torch.save(sd, want)
    with open(want, "rb") as f:
        data = f.read()
    plain = os.path.join(work, "disk", NAME)
    torch.save(sd, plain)
    assert same_bytes(plain, want), "torch.save is not deterministic here"
    unlink(plain)
    src, mnt = os.path.join(work, "src"), os.path.join(work, "mnt")
    writers = {"torch.save": lambda p: torch.save(sd, p), "replay": lambda p: write_all(p, data)}
    for how, cache in (("torch.save", a.cache_size), ("torch.save", a.small_cache), ("replay", a.cache_size)):
        with CaptureMount(a.ucpfs, src, mnt, cache, os.path.join(work, "mount.log")) as m:
            writers[how](os.path.join(mnt, NAME))
            m.sync()
            assert same_bytes(os.path.join(src, NAME), want), f"SRC/{NAME} differs ({how}, cache {cache})"
            got = m.capture()
            assert got["bytes_flushed"] == len(data) and got["files_committed"] == 1, got
    unlink(want)
    return data


# --- report -----------------------------------------------------------------------------------

# --- small operations (--small-ops) -----------------------------------------------------------

def random_writes(a, work):
    """Random 4 KiB writes into a file larger than the cache (see the docstring)."""
    src, mnt = os.path.join(work, "src"), os.path.join(work, "mnt")
    rng = random.Random(1)
    page = 4096
    n_pages = (a.random_file_mib << 20) // page
    with CaptureMount(a.ucpfs, src, mnt, a.random_cache, os.path.join(work, "mount.log")) as m:
        path = os.path.join(mnt, "random.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            block = os.urandom(CHUNK)
            for at in range(0, n_pages * page, CHUNK):
                os.pwrite(fd, block[:min(CHUNK, n_pages * page - at)], at)
            os.fsync(fd)
            flushed0 = m.capture()["bytes_flushed"]
            data = os.urandom(page)
            offsets = [rng.randrange(n_pages) * page for _ in range(a.random_writes)]
            t0 = time.perf_counter()
            for off in offsets:
                os.pwrite(fd, data, off)
            t_write = time.perf_counter() - t0
        finally:
            os.close(fd)
        t0 = time.perf_counter()
        m.sync()
        t_sync = time.perf_counter() - t0
        flushed = m.capture()["bytes_flushed"] - flushed0
    written = a.random_writes * page
    return {"cache": a.random_cache, "file_mib": a.random_file_mib, "writes": a.random_writes,
            "writes_per_s": round(a.random_writes / t_write, 1), "t_sync": round(t_sync, 3),
            "bytes_written": written, "bytes_flushed": flushed, "flushed_over_written": round(flushed / written, 3)}


def make_files(d, n, data):
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(n):
        fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.close(fd)
    return time.perf_counter() - t0


def creates(a, work):
    """Files made through a mount vs into a plain folder of SRC's filesystem (see the docstring)."""
    src, mnt, plain = os.path.join(work, "src"), os.path.join(work, "mnt"), os.path.join(work, "plain")
    data = os.urandom(4096)
    rows = {"mount": [], "plain": [], "sync": []}
    for _ in range(a.repeat):
        shutil.rmtree(plain, ignore_errors=True)
        os.sync()
        rows["plain"].append(make_files(os.path.join(plain, "d"), a.creates, data))
        with CaptureMount(a.ucpfs, src, mnt, a.random_cache, os.path.join(work, "mount.log")) as m:
            os.sync()
            rows["mount"].append(make_files(os.path.join(mnt, "d"), a.creates, data))
            t0 = time.perf_counter()
            m.sync()
            rows["sync"].append(time.perf_counter() - t0)
        assert len(os.listdir(os.path.join(src, "d"))) == a.creates
    shutil.rmtree(plain, ignore_errors=True)
    mount_s, plain_s = statistics.median(rows["mount"]), statistics.median(rows["plain"])
    return {"files": a.creates, "repeat": a.repeat, "mount_files_per_s": round(a.creates / mount_s, 1),
            "plain_files_per_s": round(a.creates / plain_s, 1), "mount_over_plain": round(plain_s / mount_s, 3),
            "t_sync_after": round(statistics.median(rows["sync"]), 3)}


def small_ops(a):
    work = os.path.abspath(a.workdir)
    os.makedirs(work, exist_ok=True)
    fs_type = subprocess.run(["stat", "-f", "-c", "%T", work], capture_output=True, text=True).stdout.strip()
    load_start = os.getloadavg()
    rw = random_writes(a, work)
    log(f"random 4 KiB writes: {rw['writes_per_s']}/s through a {rw['cache']} cache into a {rw['file_mib']} MiB file; "
        f"{rw['bytes_flushed']} bytes flushed for {rw['bytes_written']} written ({rw['flushed_over_written']}x); "
        f"sync {rw['t_sync']} s")
    cr = creates(a, work)
    log(f"creates: {cr['mount_files_per_s']} files/s through the mount, {cr['plain_files_per_s']} files/s into a plain "
        f"folder ({cr['mount_over_plain']}x); sync afterwards {cr['t_sync_after']} s")
    summary = {"bench": "write_capture_small_ops", "date": str(datetime.date.today()), "cores": os.cpu_count(),
               "fs": fs_type, "load_avg_1min": [round(load_start[0], 1), round(os.getloadavg()[0], 1)],
               "random_writes": rw, "creates": cr}
    print(json.dumps(summary, separators=(",", ":")), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ucpfs", default=os.path.join(ROOT, "build", "cli", "ucpfs"))
    ap.add_argument("--workdir", default="/tmp/ucpfs-wc-bench", help="SRC, MNT and the disk baseline live here")
    ap.add_argument("--tmpfs", default="/dev/shm", help="a tmpfs folder for the baseline")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=384)
    ap.add_argument("--numel", type=int, default=1 << 20, help="fp32 values per tensor")
    ap.add_argument("--cache-size", default="2G", help="a cache that holds the file")
    ap.add_argument("--small-cache", default="512M", help="a cache smaller than the file")
    ap.add_argument("--small-ops", action="store_true", help="only random 4 KiB writes and file creation")
    ap.add_argument("--random-cache", default="16M")
    ap.add_argument("--random-file-mib", type=int, default=64)
    ap.add_argument("--random-writes", type=int, default=3000)
    ap.add_argument("--creates", type=int, default=1000)
    a = ap.parse_args()
    a.ucpfs = os.path.abspath(a.ucpfs)
    if a.repeat < 1:
        ap.error("bad --repeat")
    if a.small_ops:
        if os.geteuid() != 0:
            sys.exit("run as root: the cache is locked in memory")
        return small_ops(a)
    if os.geteuid() != 0:
        sys.exit("run as root: the page cache is dropped before every measurement")
    if shutil.which("fio") is None:
        sys.exit("fio not found: apt-get install -y fio")
    work = os.path.abspath(a.workdir)
    disk_dir = os.path.join(work, "disk")
    tmpfs_dir = os.path.join(a.tmpfs, "ucpfs-wc-bench")
    for d in (work, disk_dir, tmpfs_dir):
        os.makedirs(d, exist_ok=True)
    fs_type = subprocess.run(["stat", "-f", "-c", "%T", work], capture_output=True, text=True).stdout.strip()
    tmpfs_type = subprocess.run(["stat", "-f", "-c", "%T", tmpfs_dir], capture_output=True, text=True).stdout.strip()

    load_start = os.getloadavg()
    t0 = time.perf_counter()
    sd = make_state(a.tensors, a.numel)
    data_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    log(f"state dict: {a.tensors} fp32 tensors, {data_bytes / 2**30:.2f} GiB, made in {time.perf_counter() - t0:.1f} s; "
        f"torch {torch.__version__}; workdir {work} ({fs_type}), tmpfs {tmpfs_dir} ({tmpfs_type})")
    data = check(sd, a, work, tmpfs_dir)
    n_file = len(data)
    log(f"sanity: SRC/{NAME} after torch.save through the mount + `ucpfs sync` ({a.cache_size} and {a.small_cache} "
        f"caches) and after the replay equals torch.save's output into a plain file ({n_file} bytes)")

    big, small = f"mount {a.cache_size}", f"mount {a.small_cache}"
    rbig, rsmall = f"replay {a.cache_size}", f"replay {a.small_cache}"
    mounts = (big, small, rbig, rsmall)
    rows = {k: [] for k in ("tmpfs", *mounts, "disk", "fio")}
    torch_save = lambda p: torch.save(sd, p)  # noqa: E731
    replay = lambda p: write_all(p, data)  # noqa: E731
    for r in range(a.repeat):
        rows["tmpfs"].append(save_plain(sd, tmpfs_dir, durable=False))
        rows[big].append(save_mount(torch_save, a, a.cache_size, work))
        rows[small].append(save_mount(torch_save, a, a.small_cache, work))
        rows[rbig].append(save_mount(replay, a, a.cache_size, work))
        rows[rsmall].append(save_mount(replay, a, a.small_cache, work))
        rows["disk"].append(save_plain(sd, disk_dir, durable=True))
        rows["fio"].append(run_fio(disk_dir, n_file))
        log(f"repeat {r + 1}/{a.repeat}: tmpfs {rows['tmpfs'][-1]['seconds']:.3f} s, "
            + ", ".join(f"{k} {rows[k][-1]['save']:.3f} s + sync {rows[k][-1]['sync']:.3f} s" for k in mounts)
            + f", disk {rows['disk'][-1]['save']:.3f} s + fsync {rows['disk'][-1]['seconds'] - rows['disk'][-1]['save']:.3f} s"
            + f", fio {rows['fio'][-1]['rate'] / 1e6:.0f} MB/s")

    def med(key, field="seconds"):
        """Median over the repetitions; NaN (a drain rate not shown) left out, None if all are."""
        xs = [x[field] for x in rows[key] if not (isinstance(x[field], float) and math.isnan(x[field]))]
        return statistics.median(xs) if xs else None

    def mb(x):
        return f"{x / 1e6:5.0f}" if x is not None else "  n/a"

    def drained(k):
        n = sum(1 for x in rows[k] if not math.isnan(x["drain_rate"]))
        return "" if n == len(rows[k]) else f" ({n} of {len(rows[k])})"

    load_end = os.getloadavg()
    log("")
    log(f"load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end (1 min)")
    log(f"{os.cpu_count()} cores, {datetime.date.today()}, median of {a.repeat}; file {n_file / 2**30:.2f} GiB "
        f"({n_file} bytes); torch {torch.__version__}; page cache dropped before each measurement")
    log(f"  {'tmpfs':12s} torch.save {med('tmpfs'):7.3f} s  {mb(n_file / med('tmpfs'))} MB/s")
    for k in mounts:
        what = "torch.save" if k in (big, small) else "os.write  "
        log(f"  {k:12s} {what} {med(k, 'save'):7.3f} s  {mb(n_file / med(k, 'save'))} MB/s"
            f"   + ucpfs sync {med(k, 'sync'):6.3f} s = {med(k):6.3f} s"
            f"   (left to flush when the writer returned {mb(med(k, 'backlog'))} MB, writers blocked {med(k, 'blocked'):5.3f} s)")
        log(f"  {'':12s} flush: stats {mb(med(k, 'stats_rate'))} MB/s (busy {med(k, 'busy'):.3f} s), "
            f"end {mb(med(k, 'end_rate'))} MB/s, drain {mb(med(k, 'drain_rate'))} MB/s{drained(k)}; "
            f"mount {med(k, 'mount'):.2f} s, daemon peak RSS {max(x['rss_mib'] for x in rows[k]):.0f} MiB "
            f"(cache {rows[k][0]['cache_mib']:.0f} MiB {rows[k][0]['memory']} + "
            f"{max(x['rss_mib'] - x['cache_mib'] for x in rows[k]):.1f} MiB), CPU {med(k, 'cpu_s'):.2f} s "
            f"(the cache's populating included)")
    log(f"  {'disk':12s} torch.save {med('disk', 'save'):7.3f} s   + fsync = {med('disk'):6.3f} s")
    log(f"  {'fio':12s} {mb(med('fio', 'rate'))} MB/s (fio's figure; {mb(med('fio', 'wall_rate'))} MB/s "
        f"over its wall time, start and fsync included)")

    def verdict(ok):
        return "met" if ok else "missed"

    def ratio(x, y):
        return None if x is None or y is None else x / y

    def fmt(x):
        return "n/a" if x is None else f"{x:.2f}x"

    g1 = ratio(med(big, "save"), med("tmpfs"))
    g1s = ratio(med(small, "save"), med("tmpfs"))
    g2 = ratio(med(big), med("disk"))
    g2s = ratio(med(small), med("disk"))
    fio_rate = med("fio", "rate")
    g3 = {k: {w: ratio(med(k, w + "_rate"), fio_rate) for w in ("stats", "end", "drain")} for k in mounts}
    log(f"1. torch.save: mount / tmpfs = {fmt(g1)} ({a.cache_size} cache), {fmt(g1s)} ({a.small_cache} cache)"
        f"   [goal <= 1.2 with a cache that holds the file: {verdict(g1 <= 1.2)}]")
    log(f"2. durable: (torch.save + ucpfs sync) / (torch.save + fsync on disk) = {fmt(g2)} ({a.cache_size} cache), "
        f"{fmt(g2s)} ({a.small_cache} cache)   [goal <= 1.0: {verdict(g2 <= 1.0)}]")
    for k in mounts:
        line = ", ".join(f"{w} {fmt(v)}" for w, v in g3[k].items())
        goal = ""
        if k == rbig:
            goal = "   [goal >= 0.9: " + ", ".join(f"{w} {verdict(v >= 0.9)}" for w, v in g3[k].items()
                                                  if v is not None) + "]"
        log(f"3. flush / fio, {k:12s}: {line}{goal}")
    ceiling = ratio(n_file / med("tmpfs"), fio_rate)
    log(f"   (torch.save's own rate into tmpfs / fio = {fmt(ceiling)}: torch.save alone makes its bytes more slowly "
        f"than fio writes them, so the flushers wait for it in the torch.save rows)")

    def r3(x, nd=3):
        return None if x is None else round(x, nd)

    def mount_json(k):
        return {"t_write": r3(med(k, "save")), "t_sync": r3(med(k, "sync")), "t_durable": r3(med(k)),
                "backlog_bytes": int(med(k, "backlog")), "writers_blocked_s": r3(med(k, "blocked")),
                "flush_busy_s": r3(med(k, "busy")), "flush_stats_bps": r3(med(k, "stats_rate"), None),
                "flush_end_bps": r3(med(k, "end_rate"), None), "flush_drain_bps": r3(med(k, "drain_rate"), None),
                "mount_s": r3(med(k, "mount")), "daemon_peak_rss_mib": round(max(x["rss_mib"] for x in rows[k]), 1),
                "daemon_rss_beyond_cache_mib": round(max(x["rss_mib"] - x["cache_mib"] for x in rows[k]), 1),
                "daemon_cpu_s": r3(med(k, "cpu_s"), 2), "memory": rows[k][0]["memory"], "engine": rows[k][0]["engine"],
                "flush_over_fio": {w: r3(v) for w, v in g3[k].items()}}

    summary = {
        "bench": "write_capture", "date": str(datetime.date.today()), "cores": os.cpu_count(), "repeat": a.repeat,
        "torch": torch.__version__, "file_bytes": n_file, "fs": fs_type,
        "load_avg_1min": [round(load_start[0], 1), round(load_end[0], 1)],
        "t_tmpfs": r3(med("tmpfs")), "t_disk_save": r3(med("disk", "save")), "t_disk": r3(med("disk")),
        "fio_bps": round(fio_rate), "fio_wall_bps": round(med("fio", "wall_rate")),
        "tmpfs_save_over_fio": r3(ceiling),
        "mounts": {k: mount_json(k) for k in mounts},
        "ratios": {"save_over_tmpfs": r3(g1), "save_over_tmpfs_small": r3(g1s),
                   "durable_over_disk": r3(g2), "durable_over_disk_small": r3(g2s)},
    }
    print(json.dumps(summary, separators=(",", ":")), flush=True)
    shutil.rmtree(tmpfs_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
