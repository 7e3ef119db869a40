"""End-to-end test of the FUSE front end (fs/fuse_mount.cc) on a real mount.

Mounts the demo tree of tests/tools/serve_tree.cc (its header comment is the layout this test
expects) and checks it with ordinary tools and syscalls: listings, stat, du, find, full and
random reads, mmap, read-only errors, open and read failures, concurrent readers, statfs and
shutdown on SIGTERM. Readiness comes through a pipe on the daemon's fd 3 (no sleeping); the
mount is always removed in a finally block, and a watchdog kills everything after 120 s.

Needs root or a user allowed to mount FUSE (fusermount3), and UCPFS_TOOLS_DIR (set by CTest).
Prints "e2e_fuse_tree: N passed, M failed" and exits non-zero on any failure.
"""
import errno
import mmap
import os
import random
import select
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

NAME = "e2e_fuse_tree"
MiB = 1 << 20
GOLDEN = 0x9E3779B97F4A7C15
WATCHDOG_S = 120
READY_TIMEOUT_S = 30
FAIL_READ_PATH = "bad/fail_read.bin"

# path -> (size, seed); the layout of serve_tree.cc.
FILES = {
    "empty.bin": (0, 1),
    "one.bin": (1, 2),
    "a/f4095.bin": (4095, 3),
    "a/f4096.bin": (4096, 4),
    "a/b/c/f1m3.bin": (MiB + 3, 5),
    "big/gen64m.bin": (64 * MiB, 6),
    "big/link4096.bin": (4096, 4),
    FAIL_READ_PATH: (2 * MiB, 7),
}
FILES.update({f"many/f{i:03d}.bin": (i, 1000 + i) for i in range(300)})
BROKEN = {"broken/open_fails.bin": 1000, "broken/size_mismatch.bin": 100}
DIRS = {"", "a", "a/b", "a/b/c", "big", "broken", "many", "emptydir", "bad"}
READABLE = [p for p in FILES if p != FAIL_READ_PATH]


def expected_bytes(seed, size):
    """Byte o is byte o % 8 (little-endian) of the word (o // 8 + 1) * GOLDEN + seed mod 2**64."""
    n_words = (size + 7) // 8
    with np.errstate(over="ignore"):
        words = np.arange(1, n_words + 1, dtype=np.uint64) * np.uint64(GOLDEN) + np.uint64(seed)
    return words.astype("<u8").tobytes()[:size]


_EXPECTED = {}


def expected_of(path):
    if path not in _EXPECTED:
        _EXPECTED[path] = expected_bytes(FILES[path][1], FILES[path][0])
    return _EXPECTED[path]


class Results:
    def __init__(self):
        self.passed, self.failed = 0, 0

    def check(self, label, fn):
        t0 = time.monotonic()
        try:
            fn()
            self.passed += 1
            print(f"ok   {label} ({time.monotonic() - t0:.2f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            self.failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def expect_errno(fn, codes, what):
    codes = codes if isinstance(codes, (set, tuple, list)) else {codes}
    try:
        fn()
    except OSError as e:
        expect(e.errno in codes, f"{what}: errno {errno.errorcode.get(e.errno, e.errno)}, "
                                 f"wanted {[errno.errorcode[c] for c in codes]}")
        return
    raise AssertionError(f"{what}: succeeded, wanted {[errno.errorcode[c] for c in codes]}")


def run(cmd, check=True):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}: {p.stderr.strip()}")
    return p


def read_file(path, chunk=MiB):
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(chunk)
            if not b:
                return bytes(out)
            out += b


def unmount(mnt):
    for cmd in (["fusermount3", "-u", "-q", mnt], ["umount", mnt], ["umount", "-l", mnt]):
        if not os.path.ismount(mnt):
            return
        subprocess.run(cmd, capture_output=True, timeout=30)


def serve_tree_exe():
    tools = os.environ.get("UCPFS_TOOLS_DIR")
    if not tools:
        sys.exit("UCPFS_TOOLS_DIR is not set (run through ctest, or export it)")
    return os.path.join(tools, "serve_tree")


class Daemon:
    """serve_tree as a child process whose fd 3 is the write end of the readiness pipe."""

    def __init__(self, mnt):
        self.mnt = mnt
        self.pid = None
        self.returncode = None

    def start(self, expect_ready=True):
        exe = serve_tree_exe()
        r, w = os.pipe()  # both close-on-exec: only the dup2'd fd 3 reaches the child
        actions = [(os.POSIX_SPAWN_DUP2, w, 3)]
        if w != 3:
            actions.append((os.POSIX_SPAWN_CLOSE, w))
        self.pid = os.posix_spawn(exe, [exe, self.mnt, "--fail-read", FAIL_READ_PATH],
                                  os.environ, file_actions=actions)
        os.close(w)
        try:
            ready, _, _ = select.select([r], [], [], READY_TIMEOUT_S)
            expect(ready, f"no readiness byte within {READY_TIMEOUT_S} s")
            byte = os.read(r, 1)
        finally:
            os.close(r)
        if not expect_ready:
            expect(not byte, "a byte on the readiness pipe of a mount that must fail")
            return
        expect(byte, f"readiness pipe closed without a byte (daemon alive: {self.alive()})")
        expect(os.path.ismount(self.mnt), "ready, but the mountpoint is not a mount")

    def poll(self):
        if self.pid is not None and self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def alive(self):
        return self.pid is not None and self.poll() is None

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon still running after {timeout} s")
            time.sleep(0.02)
        return self.returncode

    def signal(self, sig):
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self):
        unmount(self.mnt)
        if self.pid is None:
            return
        try:
            self.wait(10)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            self.wait(10)


def start_watchdog(daemon):
    def fire():
        print(f"{NAME}: watchdog: still running after {WATCHDOG_S} s; killing the daemon",
              flush=True)
        daemon.signal(signal.SIGKILL)  # aborts the connection: blocked syscalls get ENOTCONN
        unmount(daemon.mnt)
        print(f"{NAME}: 0 passed, 1 failed (watchdog)", flush=True)
        os._exit(1)

    t = threading.Timer(WATCHDOG_S, fire)
    t.daemon = True
    t.start()
    return t


# ---- checks ----

def check_walk(mnt):
    files, dirs = set(), set()
    for root, dnames, fnames in os.walk(mnt):
        rel = os.path.relpath(root, mnt)
        rel = "" if rel == "." else rel
        dirs.add(rel)
        for n in fnames:
            files.add(os.path.join(rel, n) if rel else n)
    want_files = set(FILES) | set(BROKEN)
    expect(files == want_files, f"files differ: missing {sorted(want_files - files)[:5]}, "
                                f"extra {sorted(files - want_files)[:5]}")
    expect(dirs == DIRS, f"dirs differ: {sorted(dirs ^ DIRS)}")
    expect(sorted(os.listdir(os.path.join(mnt, "many"))) ==
           [f"f{i:03d}.bin" for i in range(300)], "listdir(many) not the 300 names in order")
    expect(os.listdir(os.path.join(mnt, "emptydir")) == [], "emptydir not empty")


def check_ls(mnt):
    out = run(["ls", "-laR", mnt]).stdout
    for p in list(FILES) + list(BROKEN):
        expect(os.path.basename(p) in out, f"ls -laR misses {p}")
    expect("-r--r--r--" in out and "dr-xr-xr-x" in out, "ls -l modes")


def check_find(mnt):
    out = run(["find", mnt, "-type", "f"]).stdout.split("\n")
    got = {os.path.relpath(p, mnt) for p in out if p}
    expect(got == set(FILES) | set(BROKEN), "find -type f differs")
    out = run(["find", mnt, "-mindepth", "1", "-type", "d"]).stdout.split("\n")
    got = {os.path.relpath(p, mnt) for p in out if p}
    expect(got == DIRS - {""}, f"find -type d differs: {sorted(got ^ (DIRS - {''}))}")
    out = run(["find", mnt, "-name", "f1m3.bin", "-size", "+1024k"]).stdout.strip()
    expect(out == os.path.join(mnt, "a/b/c/f1m3.bin"), f"find -size: {out!r}")


def check_stat(mnt):
    uid, gid = os.getuid(), os.getgid()
    sizes = dict((p, s) for p, (s, _) in FILES.items()) | BROKEN
    for p, size in sizes.items():
        st = os.stat(os.path.join(mnt, p))
        expect(st.st_size == size, f"{p}: size {st.st_size} != {size}")
        expect(st.st_mode == stat.S_IFREG | 0o444, f"{p}: mode {oct(st.st_mode)}")
        expect(st.st_blocks == (size + 511) // 512, f"{p}: st_blocks {st.st_blocks}")
        expect((st.st_uid, st.st_gid) == (uid, gid), f"{p}: owner {st.st_uid}:{st.st_gid}")
        expect(st.st_mtime_ns == 1700000000_123456789, f"{p}: mtime {st.st_mtime_ns}")
        linked = p in ("a/f4096.bin", "big/link4096.bin")
        expect(st.st_nlink == (2 if linked else 1), f"{p}: nlink {st.st_nlink}")
    a = os.stat(os.path.join(mnt, "a/f4096.bin"))
    b = os.stat(os.path.join(mnt, "big/link4096.bin"))
    expect(a.st_ino == b.st_ino and a.st_dev == b.st_dev, "hard link: different inodes")
    expect(os.path.samefile(os.path.join(mnt, "a/f4096.bin"),
                            os.path.join(mnt, "big/link4096.bin")), "samefile")
    expect(os.stat(mnt).st_ino == 1, f"root inode {os.stat(mnt).st_ino}")
    inos = {os.stat(os.path.join(mnt, p)).st_ino for p in sizes}
    expect(len(inos) == len(sizes) - 1, "inode numbers not unique (but for the link)")
    for d in DIRS:
        path = os.path.join(mnt, d)
        st = os.stat(path)
        n_sub = sum(1 for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
        expect(st.st_mode == stat.S_IFDIR | 0o555, f"{d}/: mode {oct(st.st_mode)}")
        expect(st.st_nlink == 2 + n_sub, f"{d}/: nlink {st.st_nlink}, {n_sub} subdirs")
    expect_errno(lambda: os.stat(os.path.join(mnt, "nope")), errno.ENOENT, "stat missing")
    expect_errno(lambda: os.stat(os.path.join(mnt, "nope")), errno.ENOENT, "stat missing (cached)")
    expect_errno(lambda: os.stat(os.path.join(mnt, "one.bin/x")), errno.ENOTDIR, "stat through file")


def total_bytes():
    # Hard links count once, as in du.
    seen = {}
    for p, (size, seed) in FILES.items():
        seen[(size, seed)] = size
    return sum(seen.values()) + sum(BROKEN.values())


def check_du(mnt):
    total = total_bytes()
    got = int(run(["du", "-sb", mnt]).stdout.split()[0])
    expect(got == total, f"du -sb {got} != {total}")
    apparent_k = int(run(["du", "-s", "--apparent-size", "--block-size=1K", mnt]).stdout.split()[0])
    expect(apparent_k == (total + 1023) // 1024, f"du --apparent-size {apparent_k} KiB vs {total} B")
    blocks_k = int(run(["du", "-s", "--block-size=1K", mnt]).stdout.split()[0])
    expect(blocks_k * 1024 >= total, f"du -s {blocks_k} KiB < {total} B")
    got = int(run(["du", "-sb", os.path.join(mnt, "big/gen64m.bin")]).stdout.split()[0])
    expect(got == 64 * MiB, f"du -sb gen64m.bin {got}")


def check_full_reads(mnt):
    for p in READABLE:
        data = read_file(os.path.join(mnt, p))
        want = expected_of(p)
        expect(len(data) == len(want), f"{p}: read {len(data)} bytes, want {len(want)}")
        expect(data == want, f"{p}: content differs")


def check_odd_chunk_reads(mnt):
    # Reads in chunks that straddle page and request boundaries.
    for p in ("a/f4095.bin", "a/b/c/f1m3.bin"):
        data = read_file(os.path.join(mnt, p), chunk=4093)
        expect(data == expected_of(p), f"{p}: chunked read differs")


def check_random_preads(mnt, rng):
    fds = {p: os.open(os.path.join(mnt, p), os.O_RDONLY) for p in READABLE}
    try:
        for _ in range(3000):
            p = rng.choice(READABLE)
            size = FILES[p][0]
            off = rng.randrange(0, size + 2) if rng.random() < 0.8 else \
                rng.choice([0, max(size - 1, 0), size, size + 10, MiB - 1, MiB, 4096])
            n = rng.choice([1, 7, 4096, 4097, 65536, MiB, MiB + 5, rng.randrange(1, 300000)])
            data = os.pread(fds[p], n, off)
            want = expected_of(p)[off:off + n]
            expect(data == want, f"{p}: pread({n}, {off}) gave {len(data)} bytes, "
                                 f"want {len(want)}; equal={data == want}")
    finally:
        for fd in fds.values():
            os.close(fd)


def check_mmap(mnt):
    for p in ("a/f4095.bin", "a/b/c/f1m3.bin", "big/gen64m.bin", "big/link4096.bin"):
        with open(os.path.join(mnt, p), "rb") as f:
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED) as m:
                expect(len(m) == FILES[p][0], f"{p}: mmap length {len(m)}")
                expect(m[:] == expected_of(p), f"{p}: mmap content differs")
                expect(m[len(m) - 3:] == expected_of(p)[-3:], f"{p}: mmap tail")
    with open(os.path.join(mnt, "big/gen64m.bin"), "rb") as f:
        with mmap.mmap(f.fileno(), 8 * MiB, prot=mmap.PROT_READ, offset=32 * MiB) as m:
            expect(m[:] == expected_of("big/gen64m.bin")[32 * MiB:40 * MiB], "mmap at offset")


def check_read_only(mnt):
    f = os.path.join(mnt, "one.bin")
    new = os.path.join(mnt, "new.bin")
    ro = errno.EROFS
    expect_errno(lambda: os.open(f, os.O_WRONLY), ro, "open O_WRONLY")
    expect_errno(lambda: os.open(f, os.O_RDWR), ro, "open O_RDWR")
    expect_errno(lambda: os.open(f, os.O_RDONLY | os.O_TRUNC), ro, "open O_TRUNC")
    expect_errno(lambda: os.open(f, os.O_WRONLY | os.O_APPEND), ro, "open O_APPEND")
    expect_errno(lambda: os.open(new, os.O_WRONLY | os.O_CREAT, 0o644), ro, "create")
    expect_errno(lambda: os.mknod(new, 0o644 | stat.S_IFREG), ro, "mknod")
    expect_errno(lambda: os.unlink(f), ro, "unlink")
    expect_errno(lambda: os.mkdir(os.path.join(mnt, "newdir")), ro, "mkdir")
    expect_errno(lambda: os.rmdir(os.path.join(mnt, "emptydir")), ro, "rmdir")
    expect_errno(lambda: os.rename(f, new), ro, "rename")
    expect_errno(lambda: os.link(f, new), ro, "link")
    expect_errno(lambda: os.symlink("one.bin", new), ro, "symlink")
    expect_errno(lambda: os.truncate(f, 0), ro, "truncate")
    expect_errno(lambda: os.chmod(f, 0o666), ro, "chmod")
    expect_errno(lambda: os.utime(f, (0, 0)), ro, "utime")
    expect_errno(lambda: os.setxattr(f, "user.x", b"1"), (ro, errno.ENOTSUP), "setxattr")
    expect(not os.access(f, os.W_OK), "access(W_OK) succeeded")
    expect(os.access(f, os.R_OK), "access(R_OK) failed")
    expect(os.access(os.path.join(mnt, "a"), os.R_OK | os.X_OK), "access(dir, R_OK|X_OK) failed")
    expect(not os.path.exists(new), "new.bin appeared")
    expect(read_file(f) == expected_of("one.bin"), "one.bin changed")


def check_xattrs(mnt):
    f = os.path.join(mnt, "one.bin")
    expect_errno(lambda: os.getxattr(f, "user.x"), (errno.ENOTSUP, errno.ENODATA), "getxattr")
    try:
        names = os.listxattr(f)
        expect(names == [], f"listxattr gave {names}")
    except OSError as e:
        expect(e.errno == errno.ENOTSUP, f"listxattr errno {e.errno}")


def check_statfs(mnt):
    sv = os.statvfs(mnt)
    expect(sv.f_flag & os.ST_RDONLY, f"statvfs flags {sv.f_flag:#x} lack ST_RDONLY")
    expect(sv.f_blocks * sv.f_frsize >= total_bytes(), "statvfs size below the files' total")
    expect(sv.f_bavail == 0 and sv.f_bfree == 0, "statvfs reports free space")
    out = run(["df", "-h", mnt]).stdout
    expect("serve_tree" in out, f"df does not show the fsname: {out!r}")


def check_open_failures(mnt, daemon):
    for p in BROKEN:
        expect_errno(lambda: open(os.path.join(mnt, p), "rb"), errno.EIO, f"open {p}")
    expect(daemon.alive(), "daemon died after failing opens")


def check_fail_read(mnt, daemon):
    path = os.path.join(mnt, FAIL_READ_PATH)
    want = expected_of(FAIL_READ_PATH)
    fd = os.open(path, os.O_RDONLY)
    try:
        expect(os.pread(fd, 4096, 0) == want[:4096], "first page")
        expect(os.pread(fd, MiB, 0) == want[:MiB], "first MiB")
        expect_errno(lambda: os.pread(fd, 4096, MiB), errno.EIO, "pread at 1 MiB")
        expect_errno(lambda: os.pread(fd, 100, 2 * MiB - 100), errno.EIO, "pread near the end")
        expect_errno(lambda: read_file(path), errno.EIO, "whole-file read")
    finally:
        os.close(fd)
    expect(daemon.alive(), "daemon died after a failing read")
    expect(read_file(os.path.join(mnt, "a/b/c/f1m3.bin")) == expected_of("a/b/c/f1m3.bin"),
           "read after a failing read")


def drop_cached_pages(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_concurrent(mnt, n_threads=8, rounds=2):
    errors = []
    barrier = threading.Barrier(n_threads)

    def reader(k):
        try:
            rng = random.Random(k)
            order = list(READABLE)
            barrier.wait()
            for _ in range(rounds):
                rng.shuffle(order)
                for p in order:
                    full = os.path.join(mnt, p)
                    # Evict cached pages so the reads reach the daemon concurrently.
                    drop_cached_pages(full)
                    data = read_file(full, chunk=rng.choice([4096, 65536, MiB]))
                    if data != expected_of(p):
                        errors.append(f"thread {k}: {p} differs")
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    expect(not any(t.is_alive() for t in threads), "reader threads hung")
    expect(not errors, "; ".join(errors[:5]))


def check_concurrent_processes(mnt, n_procs=8):
    # Separate processes, each reading every file twice, checked with sha256 against ours.
    import hashlib
    script = (
        "import hashlib, os, sys\n"
        "mnt = sys.argv[1]\n"
        "for _ in range(2):\n"
        "    for p in sys.argv[2:]:\n"
        "        h = hashlib.sha256()\n"
        "        with open(os.path.join(mnt, p), 'rb', buffering=0) as f:\n"
        "            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)\n"
        "            while b := f.read(1 << 20):\n"
        "                h.update(b)\n"
        "        print(p, h.hexdigest())\n")
    paths = ["a/b/c/f1m3.bin", "big/gen64m.bin", "a/f4095.bin", "many/f299.bin"]
    want = {p: hashlib.sha256(expected_of(p)).hexdigest() for p in paths}
    procs = [subprocess.Popen([sys.executable, "-c", script, mnt] + paths[k % 2:] + paths[:k % 2],
                              stdout=subprocess.PIPE, text=True) for k in range(n_procs)]
    for k, pr in enumerate(procs):
        out, _ = pr.communicate(timeout=90)
        expect(pr.returncode == 0, f"process {k} exited {pr.returncode}")
        lines = [ln.split() for ln in out.strip().split("\n")]
        expect(len(lines) == 2 * len(paths), f"process {k}: {len(lines)} lines")
        for p, digest in lines:
            expect(digest == want[p], f"process {k}: {p} digest differs")


def check_sigterm_unmounts(mnt, daemon):
    daemon.signal(signal.SIGTERM)
    rc = daemon.wait(30)
    expect(rc == 0, f"daemon exited {rc} on SIGTERM")
    expect(not os.path.ismount(mnt), "still mounted after SIGTERM")


def check_unmount_api(tmp):
    # A second mount, removed with fs::Unmount (serve_tree --unmount): the daemon exits 0.
    mnt2 = os.path.join(tmp, "mnt2")
    os.mkdir(mnt2)
    d = Daemon(mnt2)
    try:
        d.start()
        expect(read_file(os.path.join(mnt2, "a/f4095.bin")) == expected_of("a/f4095.bin"),
               "second mount content")
        run([serve_tree_exe(), "--unmount", mnt2])
        expect(d.wait(30) == 0, f"daemon exited {d.returncode} after Unmount")
        expect(not os.path.ismount(mnt2), "still mounted after Unmount")
        p = run([serve_tree_exe(), "--unmount", mnt2], check=False)
        expect(p.returncode != 0 and "serve_tree:" in p.stderr,
               f"Unmount of a non-mount: exit {p.returncode}, {p.stderr.strip()!r}")
    finally:
        d.stop()


def check_bad_mountpoint(tmp):
    d = Daemon(os.path.join(tmp, "does-not-exist"))
    d.start(expect_ready=False)
    expect(d.wait(30) == 1, f"serve_tree on a missing mountpoint exited {d.returncode}")


def main():
    seed = int(os.environ.get("UCPFS_TEST_SEED", random.SystemRandom().randrange(1 << 31)))
    print(f"{NAME}: seed {seed} (set UCPFS_TEST_SEED={seed} to reproduce)", flush=True)
    rng = random.Random(seed)
    res = Results()
    with tempfile.TemporaryDirectory(prefix="ucpfs-fuse-tree-") as tmp:
        mnt = os.path.join(tmp, "mnt")
        os.mkdir(mnt)
        daemon = Daemon(mnt)
        watchdog = start_watchdog(daemon)
        try:
            res.check("mount and readiness", daemon.start)
            if daemon.alive() and os.path.ismount(mnt):
                res.check("os.walk listing", lambda: check_walk(mnt))
                res.check("ls -laR", lambda: check_ls(mnt))
                res.check("find", lambda: check_find(mnt))
                res.check("stat sizes/modes/nlink/inodes", lambda: check_stat(mnt))
                res.check("du", lambda: check_du(mnt))
                res.check("full reads", lambda: check_full_reads(mnt))
                res.check("odd-chunk reads", lambda: check_odd_chunk_reads(mnt))
                res.check("random preads", lambda: check_random_preads(mnt, rng))
                res.check("mmap", lambda: check_mmap(mnt))
                res.check("read-only errors", lambda: check_read_only(mnt))
                res.check("xattrs", lambda: check_xattrs(mnt))
                res.check("statfs/df", lambda: check_statfs(mnt))
                res.check("failing opens", lambda: check_open_failures(mnt, daemon))
                res.check("failing reads", lambda: check_fail_read(mnt, daemon))
                res.check("8 concurrent reader threads", lambda: check_concurrent(mnt))
                res.check("8 concurrent reader processes",
                          lambda: check_concurrent_processes(mnt))
                res.check("daemon alive", lambda: expect(daemon.alive(), "daemon exited"))
                res.check("SIGTERM unmounts", lambda: check_sigterm_unmounts(mnt, daemon))
            res.check("Unmount API", lambda: check_unmount_api(tmp))
            res.check("bad mountpoint fails cleanly", lambda: check_bad_mountpoint(tmp))
        finally:
            daemon.stop()
            watchdog.cancel()
    print(f"{NAME}: {res.passed} passed, {res.failed} failed", flush=True)
    sys.exit(1 if res.failed or not res.passed else 0)


if __name__ == "__main__":
    main()
