"""The kernel's fast paths (libfuse >= 3.17 built by tests/build-libfuse.sh): FUSE passthrough of
source files and of views materialised on demand (--materialize), and FUSE over io_uring.

One small DCP checkpoint (gen_dcp2x.py), its view files read first through a mount with every
fast path off (--no-passthrough: the daemon serves every byte, as with libfuse 3.14) as the
reference. Then, with passthrough: each view file read twice equals the reference; the first
open of each is served by the daemon while its copy is built behind it, and once built, later
opens pass through and the daemon never sees their reads (stats.json's view read count does not
move: the kernel read the materialised copy), the cache holds at most --materialize-size (least recently used out, an
evicted file is computed again), torch.load(mmap=True) of a rank file works on the backing file,
a new checkpoint saved into the mount (a new generation) is never served from an old copy while
a reader of the old view keeps its bytes; while a copy is built, the first open of a view of at
least 32 MiB reads it direct_io (a second read of it comes to the daemon again), maps
MAP_SHARED, and a second open at once is cached, while a small view's first open keeps the page
cache, and a reload keeps the pages a MAP_SHARED map of the first open read; a writable MAP_SHARED mapping of a new file (also written after its descriptor's close)
is saved through the capture (ENODEV without FUSE_CAP_DIRECT_IO_ALLOW_MMAP);
source files are read and written in place through the kernel (counted opens, bytes equal on
disk), an O_TRUNC rewrite of a file another process reads is refused with ETXTBSY (the kernel
cannot mix a passed-through inode with the daemon's capture) and works once it is closed; a
symlink as the cache directory is refused. FUSE over io_uring: with the fuse module's
enable_uring switched on for one mount (restored after), requests arrive through the rings
(stats.json counts them) and bytes are equal; switched off, status says why.

View replies splice the source's plain bytes by default (stats.json counts them): on a checkpoint
of larger tensors (tests/bench/gen_bench_dcp.py), every view file equals the one copied through
the daemon (UCPFS_READ_PATH=copy) and the rank files `ucpfs convert`'s.

Without --readahead, the mount's kernel readahead window is the source disk's (at least 1 MiB,
at most 64 MiB); --readahead 2M sets 2 MiB. The kernel keeps four windows of requests in flight
(max_background, at least 64; read from fusectl, mounted for the check when it is not), with
the default window, 2 MiB and 64 MiB.

Built against libfuse 3.14 (no source package could be had), the same views and files must be
equal and status must say the fast paths are off and why.
"""
import errno
import io
import json
import mmap
import os
import shutil
import stat
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from e2e_common import Results, run, tmpdir, ucpfs_bin  # noqa: E402
from mount_common import FIXTURES, mounted, stats, status  # noqa: E402
from write_capture_test import wait_until  # noqa: E402

LAYOUT = "tp2_pp1_dp1"
HERE = os.path.dirname(os.path.abspath(__file__))
URING_PARAM = "/sys/module/fuse/parameters/enable_uring"


def view_files(mnt):
    """Relative paths of every view file (atomic/, target/<LAYOUT>/, safetensors/)."""
    out = []
    for top in ("atomic", os.path.join("target", LAYOUT), "safetensors"):
        for d, _, files in os.walk(os.path.join(mnt, top)):
            out += [os.path.relpath(os.path.join(d, f), mnt) for f in files]
    return sorted(out)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def read_ahead_kb(path, bdi_only=False):
    """The readahead window (KiB) of the device holding `path`: its block queue's (a partition's
    disk's) or its bdi's (a FUSE mount); None when the kernel shows neither."""
    dev = os.stat(path).st_dev
    mm = f"{os.major(dev)}:{os.minor(dev)}"
    tries = [f"/sys/class/bdi/{mm}/read_ahead_kb"]
    if not bdi_only:
        tries = [f"/sys/dev/block/{mm}/queue/read_ahead_kb", f"/sys/dev/block/{mm}/../queue/read_ahead_kb"] + tries
    for t in tries:
        if os.path.exists(t):
            return int(open(t).read())
    return None


def fuse_connection(path, *names):
    """A FUSE mount's connection settings as the kernel holds them (fusectl: mounted here when it
    is not, and unmounted again), one per name; None where the kernel has no fusectl."""
    conns = "/sys/fs/fuse/connections"
    mounted_here = False
    if os.path.isdir(conns) and not os.listdir(conns):
        mounted_here = subprocess.run(["mount", "-t", "fusectl", "none", conns], capture_output=True).returncode == 0
    try:
        d = f"{conns}/{os.minor(os.stat(path).st_dev)}"
        return [int(open(f"{d}/{n}").read()) for n in names] if os.path.isdir(d) else None
    finally:
        if mounted_here:
            subprocess.run(["umount", conns], check=True)


def main():
    res = Results("kernel_fast_paths_test")
    version = run([ucpfs_bin(), "--version"]).stdout
    fast = "fast paths: " in version and "passthrough" in version.split("fast paths: ")[1]
    uring_built = fast and "io_uring" in version.split("fast paths: ")[1]

    def version_line():
        assert "libfuse 3." in version, version
        if not fast:
            assert "fast paths off" in version, version
    res.check("ucpfs --version names the libfuse and its fast paths", version_line)

    with tmpdir("ucpfs-fastpaths-") as tmp:
        src = os.path.join(tmp, "src")
        run([sys.executable, os.path.join(FIXTURES, "gen_dcp2x.py"), src, "--expected", os.path.join(tmp, "exp")])
        with open(os.path.join(src, "notes.txt"), "wb") as f:
            f.write(b"0123456789" * 1000)
        src2 = os.path.join(tmp, "src2")  # the next save: same names, other values
        run([sys.executable, os.path.join(FIXTURES, "gen_dcp2x.py"), src2, "--seed", "2",
             "--expected", os.path.join(tmp, "exp2")])
        mnt = os.path.join(tmp, "mnt")
        cache = os.path.join(tmp, "cache")

        # The reference: every byte served by the daemon, copied through its buffer (no splice).
        os.environ["UCPFS_READ_PATH"] = "copy"
        try:
            with mounted(src, mnt, "--layout", LAYOUT, "--no-passthrough", "--read-only") as (m, _):
                names = view_files(m)
                want = {n: read(os.path.join(m, n)) for n in names}
                k = stats(m)["kernel"]
                assert k["passthrough"].startswith("off"), k
                assert k["passthrough_opens"] == {"source": 0, "views": 0}, k
                assert k["splice"].startswith("off: turned off") and k["spliced"]["bytes"] == 0, k
        finally:
            del os.environ["UCPFS_READ_PATH"]
        assert len(names) > 20 and all(want.values()), names

        def spliced_replies_equal_the_oracle():
            # By default a view reply splices the source's plain bytes (stats.json counts them),
            # pieces of 16 KiB and more: a checkpoint of 768 KiB tensors (torch's dcp.save, 2
            # ranks). Every view file equals the one copied through the daemon, and the rank
            # files equal `ucpfs convert`'s, computed without FUSE; read whole, then in odd pieces
            # after the kernel dropped the file's pages (requests at other offsets and sizes).
            big = os.path.join(tmp, "big")
            run([sys.executable, os.path.join(HERE, "..", "bench", "gen_bench_dcp.py"), big, "--tensors", "4",
                 "--rows", "384", "--cols", "512"])
            out = os.path.join(tmp, "converted")
            run([ucpfs_bin(), "convert", big, out, "--layout", LAYOUT])
            os.environ["UCPFS_READ_PATH"] = "copy"
            try:
                with mounted(big, mnt, "--layout", LAYOUT, "--read-only") as (m, _):
                    big_names = view_files(m)
                    copied = {n: read(os.path.join(m, n)) for n in big_names}
                    assert stats(m)["kernel"]["spliced"]["bytes"] == 0
            finally:
                del os.environ["UCPFS_READ_PATH"]
            ranks = [n for n in big_names if n.startswith("target/")]
            assert ranks and all(read(os.path.join(out, n)) == copied[n] for n in ranks), ranks
            with mounted(big, mnt, "--layout", LAYOUT, "--no-passthrough", "--read-only") as (m, _):
                for n in big_names:
                    assert read(os.path.join(m, n)) == copied[n], n
                k = stats(m)["kernel"]
                assert k["splice"] == "on", k
                big_total = sum(len(b) for b in copied.values())
                assert k["spliced"]["replies"] > 0 and k["spliced"]["bytes"] > big_total // 2, (k, big_total)
                for n in ranks:
                    fd = os.open(os.path.join(m, n), os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        size = len(copied[n])
                        for off in range(size - 1, -1, -(size // 7 + 4093)):
                            assert os.pread(fd, 300000, off) == copied[n][off:off + 300000], (n, off)
                    finally:
                        os.close(fd)
        res.check("spliced view replies equal the copied ones and ucpfs convert's", spliced_replies_equal_the_oracle)

        def readahead_follows_the_source():
            # Without --readahead the mount reads ahead as far as the source's disk (at least the
            # 1 MiB request size, at most 64 MiB): mmap readers such as from_pretrained fault page
            # by page and get only this window in flight. --readahead overrides it.
            disk = read_ahead_kb(src)
            want_kb = 1024 if disk is None else max(1024, min(disk, 64 * 1024))
            with mounted(src, mnt, "--read-only") as (m, _):
                got = read_ahead_kb(m, bdi_only=True)
                assert got == want_kb, f"mount's window {got} KiB, wanted {want_kb} (source disk: {disk})"
                # libcurl (and its ~30 dependencies) is loaded only by s3:// sources: not part of
                # a local mount's cold start.
                with open(f"/proc/{status(m)['daemon_pid']}/maps") as f:
                    assert "libcurl" not in f.read(), "a local mount's daemon loaded libcurl"
                in_flight_fits(m, want_kb)
            with mounted(src, mnt, "--read-only", "--readahead", "2M") as (m, _):
                assert read_ahead_kb(m, bdi_only=True) == 2048
                in_flight_fits(m, 2048)
            with mounted(src, mnt, "--read-only", "--readahead", "64M") as (m, _):
                assert read_ahead_kb(m, bdi_only=True) == 64 * 1024
                in_flight_fits(m, 64 * 1024)

        def in_flight_fits(m, window_kib):
            # Room for four windows of read-ahead requests in flight (at least 64, at most 1024),
            # not the kernel's 12 (congested at 9, where a page fault's next window was skipped).
            opts = next(line.split()[-1] for line in open("/proc/self/mountinfo") if line.split()[4] == m)
            max_read = int(next(o for o in opts.split(",") if o.startswith("max_read=")).split("=")[1])
            want = max(64, min(1024, 4 * -(-window_kib * 1024 // max_read)))
            assert stats(m)["kernel"]["max_background"] == want, (stats(m)["kernel"], max_read)
            kernel = fuse_connection(m, "max_background", "congestion_threshold")
            if kernel is not None:
                assert kernel == [want, want * 3 // 4], f"the kernel keeps {kernel} (in flight, congested), wanted {want}"
        res.check("the default kernel readahead follows the source disk's; --readahead sets it; no libcurl loaded; "
                  "read-ahead windows fit the kernel's requests in flight", readahead_follows_the_source)
        atomic = [n for n in names if n.startswith("atomic/")]
        with mounted(src2, mnt, "--no-passthrough", "--read-only") as (m, _):
            want2 = {n: read(os.path.join(m, n)) for n in atomic}
        assert any(want2[n] != want[n] for n in atomic)
        total = sum(len(b) for b in want.values())
        limit = total * 6 // 10  # not all fit: the least recently used go

        with mounted(src, mnt, "--layout", LAYOUT, "--materialize", cache, "--materialize-size", str(limit)) as (m, _):
            before = stats(m)

            def builds_done():
                assert wait_until(lambda: stats(m)["kernel"]["materialize"]["queued"] == 0, timeout_s=60), \
                    stats(m)["kernel"]["materialize"]

            first_round = {}

            def views_equal():
                for rnd in range(2):
                    for n in names:
                        got = read(os.path.join(m, n))
                        assert got == want[n], (rnd, n, len(got), len(want[n]))
                    if fast and rnd == 0:
                        first_round.update(stats(m))
                        builds_done()
            res.check("every view file read twice through --materialize equals the daemon's bytes", views_equal)
            after = stats(m)
            k = after["kernel"]

            def first_open_served_then_passed_through():
                if not fast:
                    assert k["passthrough"].startswith("off: libfuse"), k
                    assert after["views"]["reads"] - before["views"]["reads"] >= len(names), (before, after)
                    return
                assert k["passthrough"] == "on", k
                mat = k["materialize"]
                # Round 1: every first open was served by the daemon (no copy yet) and queued a build
                # where the cache had room; round 2: the copies still in the cache (60% of the bytes
                # fit) passed through, the others were served by the daemon and queued again (least
                # recently used out: the cache cannot hold them all, so some copy was evicted).
                first = first_round["kernel"]["materialize"]
                assert first_round["kernel"]["passthrough_opens"]["views"] == 0 and first["hits"] == 0, first_round
                assert first["misses"] == len(names) and first["queued"] + first["builds"] > 0, first
                assert mat["evictions"] > 0 and mat["failures"] == 0, mat
                assert mat["misses"] + mat["hits"] == 2 * len(names), mat
                assert k["passthrough_opens"]["views"] == mat["hits"], (k, mat)
                # Round 1's reads came to the daemon (round 2's misses may be served from the pages the
                # kernel kept of round 1).
                assert first_round["views"]["reads"] - before["views"]["reads"] >= len(names), (before, first_round)
                assert mat["bytes"] <= limit and mat["max_bytes"] == limit, mat
                # A set that fits: read once (the daemon serves it and builds the copies behind), then
                # again once built: every open passes through and the daemon answers no read of them
                # (only the read of stats.json itself counts).
                rank = [n for n in names if n.startswith(os.path.join("target", LAYOUT, "rank_0") + "/")]
                assert rank and sum(len(want[n]) for n in rank) < limit // 2, rank
                builds_done()  # round 2's: queued builds hold their room until done
                for n in rank:
                    assert read(os.path.join(m, n)) == want[n], n
                builds_done()
                s0 = stats(m)
                missed = []
                for n in rank:
                    h0 = stats(m)["kernel"]["passthrough_opens"]["views"]
                    assert read(os.path.join(m, n)) == want[n], n
                    if stats(m)["kernel"]["passthrough_opens"]["views"] == h0:
                        missed.append(n)
                assert not missed, (missed, s0["kernel"]["materialize"])
                s1 = stats(m)
                opens = s1["kernel"]["passthrough_opens"]["views"] - s0["kernel"]["passthrough_opens"]["views"]
                assert opens == len(rank), (opens, rank, s1["kernel"]["materialize"])
                # Only the reads of stats.json itself count (two per file above, and s1's).
                assert s1["views"]["reads"] - s0["views"]["reads"] == 1 + 2 * len(rank), (s0["views"], s1["views"])
            res.check("a view's first open is served by the daemon while its copy is built; later opens pass "
                      "through to the copy, the daemon reading none of it", first_open_served_then_passed_through)

            def cache_dir():
                if not fast:
                    return
                st = os.lstat(cache)
                assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), st
                files = os.listdir(cache)
                assert files and sum(os.lstat(os.path.join(cache, f)).st_size for f in files) <= limit, files
                for f in files:
                    fst = os.lstat(os.path.join(cache, f))
                    assert stat.S_ISREG(fst.st_mode) and stat.S_IMODE(fst.st_mode) == 0o600, (f, fst)
            res.check("the cache directory is 0700, its files 0600 and at most --materialize-size", cache_dir)

            def mmap_load():
                rank0 = os.path.join(m, "target", LAYOUT, "rank_0", "model.pt")
                got = torch.load(rank0, mmap=True, weights_only=True)
                ref = torch.load(io.BytesIO(want[os.path.relpath(rank0, m)]), weights_only=True)
                assert got.keys() == ref.keys() and got, (list(got), list(ref))
                for key in ref:
                    assert torch.equal(got[key], ref[key]), key
            res.check("torch.load(mmap=True) of a rank file equals its bytes loaded from memory", mmap_load)

            def source_files():
                n0 = stats(m)["kernel"]["passthrough_opens"]["source"]
                for f in sorted(os.listdir(src)):
                    if f.endswith(".distcp"):
                        assert read(os.path.join(m, f)) == read(os.path.join(src, f)), f
                with open(os.path.join(m, "notes.txt"), "r+b") as f:  # written in place: no capture
                    f.seek(5000)
                    f.write(b"ABCDEFGHIJ")
                want_notes = b"0123456789" * 500 + b"ABCDEFGHIJ" + b"0123456789" * 499
                assert read(os.path.join(src, "notes.txt")) == want_notes
                assert read(os.path.join(m, "notes.txt")) == want_notes
                n1 = stats(m)["kernel"]["passthrough_opens"]["source"]
                if fast:
                    n_distcp = sum(f.endswith(".distcp") for f in os.listdir(src))
                    assert n1 - n0 == n_distcp + 2, (n0, n1)
                else:
                    assert n1 == n0 == 0, (n0, n1)
            res.check("source files are read and written in place, through the kernel", source_files)

            def rewrite_while_read():
                path = os.path.join(m, "notes.txt")
                with open(path, "rb") as reader:
                    try:
                        with open(path, "wb") as w:
                            w.write(b"new")
                        assert not fast, "an O_TRUNC rewrite of a passed-through file was let through"
                    except OSError as e:
                        assert fast and e.errno == errno.ETXTBSY, e
                    got = reader.read(10)
                    if fast:  # the reader keeps reading the file it opened
                        assert got == b"0123456789", got
                # Closed now: captured as before. The kernel sends RELEASE after close(2) returns and
                # another daemon thread may take the rewrite's open first: the open waits for that
                # RELEASE (up to 200 ms) rather than refuse, so a rewrite right after the reader's
                # close goes through at the first try.
                with open(path, "wb") as w:
                    w.write(b"rewritten")
                # The writer's RELEASE, which commits the capture, is asynchronous too; its close
                # reached the daemon (FLUSH) before close(2) returned, and a sync waits for that
                # close's RELEASE: one sync is enough.
                open(os.path.join(m, ".ucpfs", "sync")).close()
                assert read(os.path.join(src, "notes.txt")) == b"rewritten", read(os.path.join(src, "notes.txt"))[:40]
                through = read(path)
                assert through == b"rewritten", through[:40]
            res.check("O_TRUNC of a file being read through the kernel: ETXTBSY, then, right after its close, captured",
                      rewrite_while_read)

            def new_generation():
                old = open(os.path.join(m, atomic[0]), "rb")  # an open of the current generation
                old_bytes = old.read()
                old.seek(0)
                generation = status(m)["generation"]
                # As DCP saves: the data files, then .metadata.
                for f in sorted(f for f in os.listdir(src2) if f.endswith(".distcp")) + [".metadata"]:
                    shutil.copyfile(os.path.join(src2, f), os.path.join(m, f))
                try:
                    wait_until(lambda: status(m)["generation"] > generation, timeout_s=30)
                except AssertionError:
                    raise AssertionError(f"no new generation: {status(m)}") from None
                # The mount's root names are cached for 1 s: atomic/ may name the old generation that long.
                assert wait_until(lambda: all(read(os.path.join(m, n)) == want2[n] for n in atomic), timeout_s=30)
                assert old.read() == old_bytes, "a reader of the old view saw new bytes"
                old.close()
            res.check("a new generation is never served from an old copy; an old reader keeps its bytes",
                      new_generation)

        # A view of at least 32 MiB (kDirectFirstOpenMinBytes): two 38 MB tensors.
        bigger = os.path.join(tmp, "bigger")
        run([sys.executable, os.path.join(HERE, "..", "bench", "gen_bench_dcp.py"), bigger, "--tensors", "2",
             "--rows", "4096", "--cols", "2304"])
        rank0 = os.path.join("target", LAYOUT, "rank_0", "model.pt")
        rank1 = os.path.join("target", LAYOUT, "rank_1", "model.pt")
        with mounted(bigger, mnt, "--layout", LAYOUT, "--no-passthrough", "--read-only") as (m, _):
            want_rank0 = read(os.path.join(m, rank0))
            want_rank1 = read(os.path.join(m, rank1))
        assert min(len(want_rank0), len(want_rank1)) >= 32 << 20, (len(want_rank0), len(want_rank1))
        with mounted(bigger, mnt, "--layout", LAYOUT, "--materialize", os.path.join(tmp, "cache2")) as (m, _):
            def direct_first_open():
                path = os.path.join(m, rank0)
                with open(path, "rb", buffering=0) as f:
                    assert f.read() == want_rank0
                    f.seek(0)
                    r0 = stats(m)["views"]["reads"]
                    assert f.read() == want_rank0
                    again = stats(m)["views"]["reads"] - r0  # 1: this stats.json read
                    with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED) as mm:
                        assert mm[:] == want_rank0
                    # A second open meanwhile is cached: readers of one file at once share its pages.
                    with open(path, "rb", buffering=0) as g:
                        assert g.read() == want_rank0
                        g.seek(0)
                        r1 = stats(m)["views"]["reads"]
                        assert g.read() == want_rank0
                        assert stats(m)["views"]["reads"] - r1 == 1, "the second open's pages were not kept"
                if fast:  # the first open read direct_io: its second read came to the daemon again
                    assert again > 1, again
            res.check("while a view's copy is built, its first open reads direct_io, maps MAP_SHARED, and a "
                      "second open at once is cached", direct_first_open)

            def reload_keeps_the_mapped_pages():
                # As safetensors loads: the first open maps the file MAP_SHARED and reads it through
                # the map (the kernel drops a direct_io file's pages when it is mapped, then the map's
                # faults bring them in). A reload right after, before the copy is built, keeps them:
                # its open is cached, not direct_io, and its reads never reach the daemon.
                path = os.path.join(m, rank1)
                with open(path, "rb", buffering=0) as f:
                    with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED) as mm:
                        assert mm[:] == want_rank1
                with open(path, "rb", buffering=0) as f:
                    r0 = stats(m)["views"]["reads"]
                    assert f.read() == want_rank1
                    assert stats(m)["views"]["reads"] - r0 == 1, "a reload read the view again"
            res.check("a reload while the copy is built keeps the pages a MAP_SHARED map of the first open read",
                      reload_keeps_the_mapped_pages)

            def small_views_cached():
                name = next(n for n in view_files(m) if n.endswith("step.pt") or n.endswith(".json"))
                with open(os.path.join(m, name), "rb", buffering=0) as f:
                    first = f.read()
                    f.seek(0)
                    r0 = stats(m)["views"]["reads"]
                    assert f.read() == first and first
                    assert stats(m)["views"]["reads"] - r0 == 1, name  # kept: only the stats read
            res.check("a small view's first open keeps the page cache", small_views_cached)

            def shared_writable_mapping():
                path = os.path.join(m, "mapped.bin")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                os.ftruncate(fd, 3 * 4096)
                try:
                    mm = mmap.mmap(fd, 3 * 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                except OSError as e:  # libfuse without FUSE_CAP_DIRECT_IO_ALLOW_MMAP
                    os.close(fd)
                    assert not fast and e.errno == errno.ENODEV, e
                    return
                mm[0:5] = b"first"
                os.close(fd)  # written through the mapping after the descriptor's close too
                mm[8192:8197] = b"after"
                mm.close()
                open(os.path.join(m, ".ucpfs", "sync")).close()
                want_bytes = b"first" + b"\0" * 8187 + b"after" + b"\0" * 4091
                assert read(os.path.join(bigger, "mapped.bin")) == want_bytes
                assert read(path) == want_bytes
            res.check("with --materialize a writable MAP_SHARED mapping of a new file is saved through the "
                      "capture, also what is written after its descriptor's close", shared_writable_mapping)

        def symlink_cache_refused():
            real = os.path.join(tmp, "real-cache")
            os.makedirs(real)
            link = os.path.join(tmp, "link-cache")
            os.symlink(real, link)
            p = run([ucpfs_bin(), "mount", src, mnt, "--materialize", link, "--log", os.path.join(tmp, "bad.log")],
                    check=False)
            if p.returncode == 0:
                run([ucpfs_bin(), "umount", mnt])
            assert p.returncode != 0 and "link-cache" in p.stderr + read(os.path.join(tmp, "bad.log")).decode(), \
                p.stderr
        res.check("a symlink as --materialize is refused, naming it", symlink_cache_refused)

        def io_uring():
            if not uring_built or not os.access(URING_PARAM, os.W_OK):
                with mounted(src, mnt, "--read-only") as (m, _):
                    k = stats(m)["kernel"]
                    assert k["io_uring"].startswith("off: ") and k["io_uring_requests"] == 0, k
                return
            was = open(URING_PARAM).read().strip()
            try:
                for enable in ("N", "Y"):
                    with open(URING_PARAM, "w") as f:
                        f.write(enable)
                    with mounted(src, mnt, "--layout", LAYOUT, "--read-only", "--no-passthrough") as (m, _):
                        for n in atomic[:8]:  # src holds the second save now
                            assert read(os.path.join(m, n)) == want2[n], n
                        k = stats(m)["kernel"]
                    if enable == "Y":
                        assert k["io_uring"] == "on" and k["io_uring_requests"] > 0, k
                    else:
                        assert "enable_uring" in k["io_uring"] and k["io_uring_requests"] == 0, k
            finally:
                with open(URING_PARAM, "w") as f:
                    f.write(was)
        res.check("FUSE over io_uring where the kernel offers it, /dev/fuse otherwise (said in stats.json)", io_uring)
    res.finish()


if __name__ == "__main__":
    main()
