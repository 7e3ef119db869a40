"""End-to-end: saving into a real FUSE mount (issue 10, write capture), under the running torch.

A DCP checkpoint (gen_dcp2x.py) is mounted; then, through the mount:
 1. torch.save of a state dict (several MiB, random tensors) into a new subdirectory: reading it
    back through the mount at once gives the same tensors; once the mount is unmounted and the
    daemon has drained, SRC holds exactly the bytes torch.save writes to a plain directory;
 2. a pointer file rewritten with open(..., 'w') (DeepSpeed's `latest`) replaces the old one;
 3. rename of a file being saved, unlink of one, mkdir/rmdir, truncate, append to an existing
    file: SRC shows the same result as the same operations on a plain directory;
 4. the views stay read-only (EROFS) and their names cannot be taken;
 5. kill -9 of the daemon after a save: the next mount recovers; every file is either absent or
    byte-exact (never torn), and nothing is left in .ucpfs/capture;
 6. a run directory (step-1/, step-2/, each a DCP checkpoint): atomic/ serves the newest,
    checkpoints/<name>/atomic/ each by name; a third checkpoint copied in becomes atomic/ within
    seconds without a remount, while a reader that opened the old atomic file keeps its bytes;
    it is copied marker first (as `cp -r` may: the views are rebuilt while it cannot open yet,
    status.json lists it with its error), then its shards, which alone make it the newest.

Run by hand: UCPFS_BIN=build/cli/ucpfs /usr/bin/python3 tests/e2e/write_capture_test.py
"""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import capture_parts, expected_atomic, gen_fixture, is_mounted, mounted


def state(seed, n_tensors=6, rows=512):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(rows, 256, generator=g) for i in range(n_tensors)}


def saved_bytes(obj, name):
    """What torch.save writes for `obj` into a plain directory under the file name `name` (the
    zip records are named after the file)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, os.path.basename(name))
        torch.save(obj, path)
        return open(path, "rb").read()


def wait_unmounted_and_drained(mnt, src, names, timeout_s=60):
    """After umount the daemon drains in the background: wait until every name is in SRC."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_mounted(mnt) and all(os.path.exists(os.path.join(src, n)) for n in names):
            parts = capture_parts(src)
            if not parts:
                return
        time.sleep(0.05)
    raise AssertionError(f"not drained after {timeout_s} s: {names}")


def save_and_read_back(work, src):
    mnt = os.path.join(work, "mnt")
    sd = state(1)
    want = saved_bytes(sd, "model.pt")
    with mounted(src, mnt) as (m, _):
        os.makedirs(os.path.join(m, "step2"))
        torch.save(sd, os.path.join(m, "step2", "model.pt"))
        got = torch.load(os.path.join(m, "step2", "model.pt"))
        assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
        assert os.path.getsize(os.path.join(m, "step2", "model.pt")) == len(want)
        # `ucpfs sync --json` returns once the save is durable: SRC holds it before the unmount.
        synced = json.loads(run([ucpfs_bin(), "sync", m, "--json", "--quiet"]).stdout)
        assert synced["mount"] == os.path.realpath(m) and synced["dirty_bytes"] == 0, synced
        # bytes_flushed counts what the flushers wrote to parts since the sync began: whole
        # 4096-byte pages (O_DIRECT), the file's last one with its padding (the commit's
        # ftruncate cuts it off). Usually 0 (the close's commit flushed it all before the sync
        # began); under load the whole save, rounded up to a page. More would be a page written
        # twice, which a save written once in order never needs.
        padded = -(-len(want) // 4096) * 4096
        assert synced["bytes_flushed"] <= padded and synced["seconds"] >= 0, (synced, padded)
        assert open(os.path.join(src, "step2", "model.pt"), "rb").read() == want
        with open(os.path.join(m, "latest"), "w") as f:
            f.write("step1")
        with open(os.path.join(m, "latest"), "w") as f:  # rewritten: O_TRUNC
            f.write("step2")
        assert open(os.path.join(m, "latest")).read() == "step2"
    wait_unmounted_and_drained(mnt, src, ["step2/model.pt", "latest"])
    assert open(os.path.join(src, "step2", "model.pt"), "rb").read() == want
    assert open(os.path.join(src, "latest")).read() == "step2"
    return len(want)


def namespace_operations(work, src):
    mnt = os.path.join(work, "mnt")
    with mounted(src, mnt) as (m, _):
        torch.save(state(2, 2), os.path.join(m, "a.tmp"))
        os.rename(os.path.join(m, "a.tmp"), os.path.join(m, "a.pt"))  # DCP's .metadata.tmp -> .metadata
        assert os.path.exists(os.path.join(src, "a.pt"))  # rename made it durable first
        torch.save(state(3, 2), os.path.join(m, "gone.pt"))
        os.unlink(os.path.join(m, "gone.pt"))
        os.mkdir(os.path.join(m, "d"))
        os.rmdir(os.path.join(m, "d"))
        with open(os.path.join(m, "t.bin"), "wb") as f:
            f.write(b"x" * 100000)
            f.truncate(1234)
        with open(os.path.join(m, "a.pt"), "ab") as f:
            f.write(b"tail")
        names = sorted(os.listdir(m))
        for view in ("atomic", "target", ".ucpfs"):
            assert view in names, names
        for bad in (lambda: open(os.path.join(m, "atomic", "x"), "w"),
                    lambda: os.mkdir(os.path.join(m, "target")),
                    lambda: os.rename(os.path.join(m, "a.pt"), os.path.join(m, "atomic"))):
            try:
                bad()
                raise AssertionError("a view was changed")
            except OSError as e:
                assert e.errno in (errno.EROFS, errno.EEXIST, errno.EPERM, errno.ENOENT, errno.EISDIR), e
    wait_unmounted_and_drained(mnt, src, ["a.pt", "t.bin"])
    assert open(os.path.join(src, "a.pt"), "rb").read() == saved_bytes(state(2, 2), "a.tmp") + b"tail"
    assert not os.path.exists(os.path.join(src, "gone.pt"))
    assert not os.path.exists(os.path.join(src, "d"))
    assert open(os.path.join(src, "t.bin"), "rb").read() == b"x" * 1234


# Takes the OFD write lock of argv[1] as soon as it is free, says "held", keeps it argv[2] s.
LOCK_HOLDER = """
import fcntl, os, struct, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
while True:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
        break
    except OSError:
        time.sleep(0.001)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def kill_during_saves(work, src):
    """kill -9 right after a burst of closes: each file is whole or absent, never torn."""
    mnt = os.path.join(work, "mnt-kill")
    os.makedirs(mnt, exist_ok=True)
    wants = {f"k/shard_{i}.pt": saved_bytes(state(10 + i, 3), f"shard_{i}.pt") for i in range(8)}
    run([ucpfs_bin(), "mount", src, mnt, "--log", mnt + ".log"], timeout=120)
    pid = None
    with open("/proc/self/mounts", errors="surrogateescape") as f:
        assert any(line.split()[1] == mnt for line in f)
    out = subprocess.run(["pgrep", "-f", f"ucpfs mount {src} {mnt}"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert pids, "daemon not found"
    pid = pids[0]
    os.makedirs(os.path.join(mnt, "k"), exist_ok=True)
    for name, data in wants.items():
        with open(os.path.join(mnt, name), "wb") as f:
            f.write(data)
    with open(os.path.join(mnt, "k", "latest"), "w") as f:
        f.write("k")
    # A killed daemon's lock is released only once its last thread has exited, which under load
    # can be after the next mount has started (then it used to leave the state, parts and all, to
    # the mount after it). A helper takes the lock the moment it is free and holds it a while:
    # the next mount must wait for it, since the lease names a daemon that is exiting.
    cap = os.path.join(src, ".ucpfs", "capture")
    def lease(d):
        try:
            return open(os.path.join(cap, d, "lease")).read()
        except OSError:  # recovered/, or the state of an earlier mount going away
            return ""
    mine = [d for d in os.listdir(cap) if f"\npid {pid}\n" in lease(d)]
    assert len(mine) == 1, os.listdir(cap)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, os.path.join(cap, mine[0], "lock"), "0.5"],
                              stdout=subprocess.PIPE, text=True)
    os.kill(pid, signal.SIGKILL)
    assert holder.stdout.readline().strip() == "held"
    subprocess.run(["umount", "-l", mnt])
    # The next mount recovers what the killed daemon left.
    with mounted(src, mnt) as (m, _):
        pass
    holder.wait()
    log = open(mnt + ".log").read()
    assert "its daemon is exiting; waiting for its lock" in log, log
    placed = [n for n in wants if os.path.exists(os.path.join(src, n))]
    for name in placed:
        assert open(os.path.join(src, name), "rb").read() == wants[name], f"{name} is torn"
    if os.path.exists(os.path.join(src, "k", "latest")):
        assert len(placed) == len(wants), "latest is durable before its shards"
    leftover = capture_parts(src)
    assert not leftover, leftover
    return f"{len(placed)} of {len(wants)} shards placed; log: {log.count('capture recovery')} recovery lines"


def atomic_equal(root, expected):
    """Every atomic fp32 under `root` equals the expected tensors."""
    want = expected_atomic(expected)
    assert sorted(os.listdir(root)) == sorted(p.replace("/", "%2F") for p in want), os.listdir(root)
    for param, files in want.items():
        got = torch.load(os.path.join(root, param.replace("/", "%2F"), "fp32.pt"))["param"]
        assert torch.equal(got, files["fp32.pt"]), param
    return len(want)


def wait_until(fn, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if fn():
                return time.monotonic()
        except (OSError, AssertionError, RuntimeError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError("not within the time limit")


def run_directory(work):
    run_dir = os.path.join(work, "run")
    expected = {}
    for i in (1, 2):
        out = os.path.join(work, f"gen-step-{i}")
        expected[i] = torch.load(gen_fixture("gen_dcp2x.py", out, "--variant", "2x", "--seed", str(i)))
        shutil.copytree(out, os.path.join(run_dir, f"step-{i}"))
        time.sleep(0.05)  # step-2's .metadata is the newer
    out3 = os.path.join(work, "gen-step-3")
    expected[3] = torch.load(gen_fixture("gen_dcp2x.py", out3, "--variant", "2x", "--seed", "3"))
    with mounted(run_dir, os.path.join(work, "mnt-run")) as (m, _):
        n = atomic_equal(os.path.join(m, "atomic"), expected[2])
        for i in (1, 2):
            atomic_equal(os.path.join(m, "checkpoints", f"step-{i}", "atomic"), expected[i])
        st = json.load(open(os.path.join(m, ".ucpfs", "status.json")))
        assert st["run"]["newest"] == "step-2", st["run"]
        # A reader of the old view keeps its snapshot across the swap.
        some = sorted(os.listdir(os.path.join(m, "atomic")))[0]
        old = open(os.path.join(m, "atomic", some, "fp32.pt"), "rb")
        old_bytes = old.read()
        old.seek(0)
        t0 = time.monotonic()
        # The marker first, as `cp -r` copies it when the source lists it first: the views are
        # rebuilt with step-3 listed but not opened (its shards are missing), and step-3 must still
        # become the newest once its shards land, though no marker changes then.
        step3 = os.path.join(m, "step-3")
        os.mkdir(step3)
        shutil.copyfile(os.path.join(out3, ".metadata"), os.path.join(step3, ".metadata"))

        def run_entry():
            run_status = json.load(open(os.path.join(m, ".ucpfs", "status.json")))["run"]
            return next((c for c in run_status["checkpoints"] if c["name"] == "step-3"), None)
        wait_until(lambda: (run_entry() or {}).get("error"), timeout_s=60)
        unopened = run_entry()["error"]
        for name in sorted(os.listdir(out3)):
            if name != ".metadata":
                subprocess.run(["cp", "-r", os.path.join(out3, name), step3], check=True)
        t1 = wait_until(lambda: json.load(open(os.path.join(m, ".ucpfs", "status.json")))["run"]["newest"] == "step-3",
                        timeout_s=60)
        assert "error" not in run_entry(), run_entry()
        # The mount's root names are cached for 1 s: atomic/ may name the previous generation
        # that long after status.json names the new one.
        wait_until(lambda: atomic_equal(os.path.join(m, "atomic"), expected[3]) > 0, timeout_s=10)
        atomic_equal(os.path.join(m, "checkpoints", "step-3", "atomic"), expected[3])
        assert old.read() == old_bytes, "a reader of the old view saw new bytes"
        old.close()
    return f"{n} parameters; step-3's views {t1 - t0:.2f} s after cp started (listed first as: {unopened[:80]})"


def main():
    res = Results("write_capture")
    with tmpdir("ucpfs-write-capture-") as work:
        src = os.path.join(work, "ckpt")
        gen_fixture("gen_dcp2x.py", src, "--variant", "2x")
        res.check("torch.save into the mount: read back at once; SRC holds torch.save's exact bytes",
                  lambda: save_and_read_back(work, src))
        res.check("rename, unlink, mkdir/rmdir, truncate, append act on SRC; views stay read-only",
                  lambda: namespace_operations(work, src))
        res.check("kill -9 of the daemon: files whole or absent, latest never ahead, nothing left over",
                  lambda: kill_during_saves(work, src))
        res.check("run directory: newest at atomic/, each by name, a new checkpoint swapped in without a remount",
                  lambda: run_directory(work))
    res.finish()


if __name__ == "__main__":
    main()
