"""End-to-end: no accepted byte is lost without a loud error (write capture, issue 22 item 3).

Plain bytes through a real FUSE mount (torch only to make a source for 4):
 1. a file pending in MNT/step1 while SRC/step1 is removed from outside, then another save:
    both close with 0 but `ucpfs sync`, `ucpfs status` and `ucpfs umount` name both, and the
    umount exits non-zero; once the directory is made again, the next mount places both, whole
    and in order;
 2. a source on a small tmpfs (8 MiB): a save that does not fit fails with ENOSPC, a small file
    closed after it is held back (not dropped); `rm MNT/big` gives the space back at once, and
    once room is made outside, the held-back saves place by themselves (no sync);
 3. a pwrite at 16 TiB (past ext4's file size limit) fails with EFBIG at write(), and later saves
    are not held back by it;
 4. a --read-only-index mount is read-only and creates nothing in SRC (no .ucpfs/capture);
 5. a full cache over a full disk (a 16M cache, a source on an 8 MiB tmpfs, --write-stall-timeout 2):
    a writer of a file larger than both gets ENOSPC from write() within seconds instead of
    hanging, and an unlink through the mount frees everything (umount exits 0).
 6. a file a crash recovery set aside in SRC/.ucpfs/capture/recovered/ (whole, but closed after a
    torn one: tests/unit/write_capture_test.cc makes such recoveries) is named by `ucpfs status`,
    `ucpfs sync` and `ucpfs umount` (both exit non-zero) at every mount, never placed, until it
    is moved or deleted.

Run by hand: UCPFS_BIN=build/cli/ucpfs python3 tests/e2e/capture_loss_test.py
"""
import errno
import os
import shutil
import subprocess
import threading
import time

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import capture_parts, is_mounted

CACHE = ("--cache-size", "64M")


def mount(src, mnt, options=CACHE):
    os.makedirs(mnt, exist_ok=True)
    run([ucpfs_bin(), "mount", src, mnt, "--log", mnt + ".log", *options], timeout=120)
    assert is_mounted(mnt)


def umount(mnt, expect_rc=0):
    """`ucpfs umount`; waits until the daemon is gone; returns its stderr."""
    pids = run(["pgrep", "-f", f"ucpfs mount .* {mnt} "], check=False).stdout.split()
    r = run([ucpfs_bin(), "umount", mnt], check=False)
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.returncode == expect_rc, (r.returncode, r.stderr)
    return r.stderr


def force_umount(mnt):
    if is_mounted(mnt):
        subprocess.run(["umount", "-l", mnt])


def wait_until(fn, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.05)
    return False


def directory_removed(work):
    src, mnt = os.path.join(work, "src1"), os.path.join(work, "mnt1")
    os.makedirs(src)
    a, b = os.urandom(3 << 20), os.urandom(100000)
    mount(src, mnt)
    try:
        os.mkdir(os.path.join(mnt, "step1"))
        f = open(os.path.join(mnt, "step1", "a.dat"), "wb")
        f.write(a)
        os.rmdir(os.path.join(src, "step1"))  # from outside, while a.dat is pending
        f.close()  # accepted
        with open(os.path.join(mnt, "b.dat"), "wb") as g:
            g.write(b)
        r = run([ucpfs_bin(), "sync", mnt, "--quiet"], check=False)
        assert r.returncode != 0 and "step1/a.dat" in r.stderr and "b.dat" in r.stderr, r.stderr
        out = run([ucpfs_bin(), "status", mnt]).stdout
        assert "not placed:  step1/a.dat" in out and "not placed:  b.dat" in out, out
        err = umount(mnt, expect_rc=1)
        assert "step1/a.dat" in err and "b.dat" in err and "next mount" in err, err
    finally:
        force_umount(mnt)
    assert not os.path.exists(os.path.join(src, "b.dat")), "b.dat placed ahead of a.dat"
    os.mkdir(os.path.join(src, "step1"))
    mount(src, mnt)
    try:
        assert open(os.path.join(src, "step1", "a.dat"), "rb").read() == a
        assert open(os.path.join(src, "b.dat"), "rb").read() == b
        umount(mnt)
    finally:
        force_umount(mnt)
    assert not capture_parts(src), capture_parts(src)
    return "both named by sync, status and umount (exit 1), placed by the next mount"


def disk_full(work):
    src, mnt = os.path.join(work, "small"), os.path.join(work, "mnt2")
    os.makedirs(src)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", src], check=True)
    try:
        filler = os.path.join(src, "filler")
        with open(filler, "wb") as f:
            f.write(b"\0" * (3 << 20))
        mount(src, mnt)
        try:
            big, small = os.urandom(6 << 20), os.urandom(4096)
            try:
                with open(os.path.join(mnt, "big.dat"), "wb") as f:
                    f.write(big)
                    os.fsync(f.fileno())
                raise AssertionError("a save larger than the free space was made durable")
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
            with open(os.path.join(mnt, "small.dat"), "wb") as f:
                f.write(small)  # closes with 0: accepted, held back behind big.dat
            r = run([ucpfs_bin(), "sync", mnt, "--quiet"], check=False)
            assert r.returncode != 0 and "big.dat" in r.stderr and "small.dat" in r.stderr, r.stderr
            # While bytes are only in memory, ucpfs umount refuses and keeps the mount.
            r = run([ucpfs_bin(), "umount", mnt], check=False)
            assert r.returncode != 0 and is_mounted(mnt) and "small.dat" in r.stderr, r.stderr
            # Room made outside: the held-back saves place by themselves, in order.
            os.unlink(filler)
            assert wait_until(lambda: os.path.exists(os.path.join(src, "small.dat"))), "held-back saves not placed"
            assert open(os.path.join(src, "big.dat"), "rb").read() == big
            assert open(os.path.join(src, "small.dat"), "rb").read() == small
            # `rm MNT/x` of a pending file gives its space back at once.
            free0 = shutil.disk_usage(src).free
            f = open(os.path.join(mnt, "x.dat"), "wb")
            f.write(os.urandom(16 << 20))  # does not fit: its flushed chunks hold the disk
            f.flush()
            wait_until(lambda: shutil.disk_usage(src).free < free0 - (1 << 20), 10)
            os.unlink(os.path.join(mnt, "x.dat"))
            assert wait_until(lambda: shutil.disk_usage(src).free >= free0 - (64 << 10), 5), "space not given back"
            try:
                f.close()
            except OSError:
                pass
            umount(mnt)
        finally:
            force_umount(mnt)
    finally:
        subprocess.run(["umount", "-l", src])
    return "ENOSPC named, small file held back then placed after room was made; rm gave space back"


def too_large(work):
    src, mnt = os.path.join(work, "src3"), os.path.join(work, "mnt3")
    os.makedirs(src)
    mount(src, mnt)
    try:
        fd = os.open(os.path.join(mnt, "huge.dat"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, b"x", 16 << 40)
            raise AssertionError("a pwrite at 16 TiB was accepted")
        except OSError as e:
            assert e.errno == errno.EFBIG, e
        os.close(fd)
        with open(os.path.join(mnt, "after.dat"), "wb") as f:
            f.write(b"after")
        run([ucpfs_bin(), "sync", mnt, "--quiet"])
        assert open(os.path.join(src, "after.dat"), "rb").read() == b"after"
        umount(mnt)
    finally:
        force_umount(mnt)
    return "EFBIG at write(); later saves placed"


def read_only_index(work):
    import torch
    src, mnt, shared = os.path.join(work, "src4"), os.path.join(work, "mnt4"), os.path.join(work, "index4")
    os.makedirs(src)
    torch.save({"w": torch.arange(8.0)}, os.path.join(src, "model.pt"))
    run([ucpfs_bin(), "index", src, "--index-dir", shared])
    os.makedirs(mnt)
    run([ucpfs_bin(), "mount", src, mnt, "--index-dir", shared, "--read-only-index", "--log", mnt + ".log"], timeout=120)
    try:
        try:
            open(os.path.join(mnt, "new.dat"), "wb").close()
            raise AssertionError("a --read-only-index mount took a save")
        except OSError as e:
            assert e.errno == errno.EROFS, e
        assert not os.path.exists(os.path.join(src, ".ucpfs")), os.listdir(src)
        umount(mnt)
    finally:
        force_umount(mnt)
    return "read-only, nothing made in SRC"


def stalled_writer(work):
    src, mnt = os.path.join(work, "small5"), os.path.join(work, "mnt5")
    os.makedirs(src)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", src], check=True)
    try:
        mount(src, mnt, ("--cache-size", "16M", "--write-stall-timeout", "2"))
        try:
            outcome = {}
            block = os.urandom(1 << 20)

            def writer():
                fd = os.open(os.path.join(mnt, "huge.dat"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                t0 = time.monotonic()
                try:
                    for i in range(64):
                        os.pwrite(fd, block, i << 20)
                    outcome["error"] = None
                except OSError as e:
                    outcome["error"] = e.errno
                outcome["seconds"] = time.monotonic() - t0
                try:
                    os.close(fd)
                except OSError:
                    pass

            t = threading.Thread(target=writer, daemon=True)
            t.start()
            t.join(60)
            assert not t.is_alive(), "a writer hung on a full cache over a full disk"
            assert outcome["error"] == errno.ENOSPC, outcome
            assert outcome["seconds"] < 30, outcome
            os.unlink(os.path.join(mnt, "huge.dat"))  # discarded: its chunks and its part go
            umount(mnt)
        finally:
            force_umount(mnt)
    finally:
        subprocess.run(["umount", "-l", src])
    return f"ENOSPC at write() after {outcome['seconds']:.1f} s (stall timeout 2 s); umount 0 after the unlink"
def set_aside(work):
    src, mnt = os.path.join(work, "src6"), os.path.join(work, "mnt6")
    aside = os.path.join(src, ".ucpfs", "capture", "recovered", "node-1-0000abcd")
    os.makedirs(os.path.join(aside, "step9"), mode=0o700)
    data = os.urandom(5000)
    with open(os.path.join(aside, "step9", "latest"), "wb") as f:
        f.write(data)
    with open(aside + ".why", "w") as f:
        f.write("committed after 'step9/shard.pt', which could not be finished\n")
    for _ in range(2):  # listed again by the next mount
        mount(src, mnt)
        try:
            out = run([ucpfs_bin(), "status", mnt]).stdout
            assert "not placed:  step9/latest" in out and "step9/shard.pt" in out and "recovered" in out, out
            r = run([ucpfs_bin(), "sync", mnt, "--quiet"], check=False)
            assert r.returncode != 0 and "step9/latest" in r.stderr, (r.returncode, r.stderr)
            err = umount(mnt, expect_rc=1)
            assert "step9/latest" in err, err
        finally:
            force_umount(mnt)
        assert not os.path.exists(os.path.join(src, "step9", "latest")), "a file set aside was placed"
    os.remove(os.path.join(aside, "step9", "latest"))  # someone decided
    mount(src, mnt)
    try:
        run([ucpfs_bin(), "sync", mnt, "--quiet"])
        umount(mnt)
    finally:
        force_umount(mnt)
    return "named by status, sync and umount (exit 1) at every mount, never placed, until deleted"


def main():
    res = Results("capture_loss")
    with tmpdir("ucpfs-capture-loss-") as work:
        res.check("directory removed from outside: named by sync/status/umount, placed by the next mount",
                  lambda: directory_removed(work))
        res.check("disk full: ENOSPC named, nothing dropped, held-back saves place once room is made",
                  lambda: disk_full(work))
        res.check("pwrite past the file size limit: EFBIG at write()", lambda: too_large(work))
        res.check("--read-only-index: no write capture, nothing created in SRC", lambda: read_only_index(work))
        res.check("full cache over a full disk: the writer gets ENOSPC after the stall timeout, never hangs",
                  lambda: stalled_writer(work))
        res.check("a file set aside by a crash recovery: named until moved or deleted, never placed",
                  lambda: set_aside(work))
    res.finish()


if __name__ == "__main__":
    main()
