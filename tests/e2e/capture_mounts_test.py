"""End-to-end: several mounts of one SRC saving at once (write capture shared by mounts), torch >= 2.4.

What nodes sharing a checkpoint directory do: every rank saves through its own mount of the same
SRC. Gloo ranks on CPU hold a state dict of DTensors sharded over all ranks and save it with
torch.distributed.checkpoint, rank r through mount r, and the same state into a plain directory:
 1. 2 ranks through 2 mounts, then 4 ranks through 4 mounts: SRC holds every .distcp file of the
    plain save byte for byte, .metadata loads (dcp_to_torch_save) to the full tensors; while the
    4 ranks save, every mount also holds a file open half-written, and one more mount
    is started meanwhile: its recovery leaves the live mounts' state alone (the half-written files
    are finished afterwards and land whole); no mount log says a file was discarded.
 2. kill -9 of one mount's daemon with a file closed (not yet synced) and one open half-written:
    a later mount recovers the dead mount's state only (its closed file is placed whole, its
    state directory goes), while another live mount's open file is untouched and lands whole.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/capture_mounts_test.py
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import capture_parts, is_mounted, stats, status

ROWS, COLS, N_TENSORS = 1024, 512, 3  # 2 MiB per tensor: every rank file spans chunks
CACHE = ("--cache-size", "64M")


def full_state():
    g = torch.Generator().manual_seed(7)
    return {f"layer{i}.weight": torch.randn(ROWS, COLS, generator=g) for i in range(N_TENSORS)}


def rank_main(rank, world, init_file, mounts, plain, sub):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()}
    dcp.save(sd, checkpoint_id=plain)
    dist.barrier()
    dcp.save(sd, checkpoint_id=os.path.join(mounts[rank], sub))
    dist.barrier()
    dist.destroy_process_group()


def mount(src, mnt):
    os.makedirs(mnt, exist_ok=True)
    run([ucpfs_bin(), "mount", src, mnt, "--log", mnt + ".log", *CACHE], timeout=120)
    assert is_mounted(mnt)
    return mnt


def umount(mnt):
    """`ucpfs umount`; returns its exit status once the daemon has drained and exited."""
    try:
        pid = status(mnt)["daemon_pid"]
    except (OSError, ValueError, KeyError):
        pid = None
    r = run([ucpfs_bin(), "umount", mnt], check=False)
    if is_mounted(mnt):
        subprocess.run(["umount", "-l", mnt])
    deadline = time.monotonic() + 60
    while pid and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    return r.returncode


def open_half(path, data):
    """A file written halfway and left open: its part is live in its mount's state."""
    f = open(path, "wb")
    f.write(data[: len(data) // 2])
    f.flush()
    return f


def finish(f, data):
    f.write(data[len(data) // 2:])
    f.close()


def check_save(src, plain, sub):
    names = sorted(n for n in os.listdir(plain))
    got = sorted(n for n in os.listdir(os.path.join(src, sub)) if not n.startswith(("straggler", ".ucpfs")))
    assert got == names, (got, names)
    for n in names:
        if n.endswith(".distcp"):
            assert open(os.path.join(src, sub, n), "rb").read() == open(os.path.join(plain, n), "rb").read(), n
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(os.path.join(src, sub), os.path.join(d, "all.pt"))
        loaded = torch.load(os.path.join(d, "all.pt"))
    want = full_state()
    assert sorted(loaded) == sorted(want) and all(torch.equal(loaded[k], want[k]) for k in want)
    return len(names)


def save_through_mounts(work, src, world, late_mount=None):
    mnts = [mount(src, os.path.join(work, f"mnt{world}-{r}")) for r in range(world)]
    sub = f"ckpt{world}"
    plain = os.path.join(work, f"plain{world}")
    os.makedirs(os.path.join(mnts[0], sub))
    stragglers = {}
    try:
        for r, m in enumerate(mnts):
            data = os.urandom(3 << 20)
            stragglers[r] = (open_half(os.path.join(m, sub, f"straggler_{r}"), data), data)
        init_file = os.path.join(work, f"init{world}")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, world, init_file, mnts, plain, sub)) for r in range(world)]
        for p in procs:
            p.start()
        late = None
        if late_mount:
            # One more mount of SRC while the ranks save: once some rank file is being captured.
            deadline = time.monotonic() + 60
            while len(capture_parts(src)) <= world and time.monotonic() < deadline and any(p.is_alive() for p in procs):
                time.sleep(0.005)
            late = mount(src, late_mount)
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0, f"rank exited with {p.exitcode}"
        for r, (f, data) in stragglers.items():
            finish(f, data)
        stragglers.clear()
        run([ucpfs_bin(), "sync", mnts[0], "--quiet"])
        for r in range(world):
            run([ucpfs_bin(), "sync", mnts[r], "--quiet"])
            got = open(os.path.join(src, sub, f"straggler_{r}"), "rb").read()
            assert got == open(os.path.join(mnts[r], sub, f"straggler_{r}"), "rb").read() and len(got) == 3 << 20
        n = check_save(src, plain, sub)
        if late:
            assert umount(late) == 0
    finally:
        for f, _ in stragglers.values():
            f.close()
        codes = [umount(m) for m in mnts]
    assert codes == [0] * world, codes
    for m in mnts + ([late_mount] if late_mount else []):
        log = open(m + ".log").read()
        assert "discarded" not in log and "ERROR" not in log, log
    assert not capture_parts(src), capture_parts(src)
    return f"{world} mounts: {n} files whole" + (", one more mount started meanwhile" if late_mount else "")


def kill_one(work, src):
    mnts = [mount(src, os.path.join(work, f"mntk-{r}")) for r in range(3)]
    later = os.path.join(work, "mntk-later")
    os.makedirs(os.path.join(mnts[0], "k"), exist_ok=True)
    closed = os.urandom(5 << 20)
    open_data = os.urandom(3 << 20)
    live = None
    try:
        with open(os.path.join(mnts[1], "k", "closed"), "wb") as f:
            f.write(closed)
        dead_open = open_half(os.path.join(mnts[1], "k", "dead_open"), open_data)
        live = open_half(os.path.join(mnts[2], "k", "live_open"), open_data)
        dirs = [stats(m)["capture"]["state_dir"] for m in mnts]
        assert all(os.path.isdir(d) for d in dirs), dirs
        pid = status(mnts[1])["daemon_pid"]
        os.kill(pid, signal.SIGKILL)
        subprocess.run(["umount", "-l", mnts[1]])
        try:
            dead_open.close()
        except OSError:
            pass
        mount(src, later)
        # The dead mount's state is gone; the live ones are there.
        assert not os.path.exists(dirs[1]) and os.path.isdir(dirs[0]) and os.path.isdir(dirs[2]), dirs
        got = open(os.path.join(src, "k", "closed"), "rb").read() if os.path.exists(os.path.join(src, "k", "closed")) else None
        assert got is None or got == closed, "the dead mount's closed file is torn"
        finish(live, open_data)
        live = None
        run([ucpfs_bin(), "sync", mnts[2], "--quiet"])
        assert open(os.path.join(src, "k", "live_open"), "rb").read() == open_data
        log = open(later + ".log").read()
        assert "discarded" not in log or "dead_open" in log or "never closed" in log, log
    finally:
        if live:
            live.close()
        for m in mnts + [later]:
            umount(m)
    return f"dead mount's closed file {'placed whole' if got is not None else 'absent'}; the live mount's open file landed"


def main():
    res = Results("capture_mounts")
    with tmpdir("ucpfs-capture-mounts-") as work:
        src = os.path.join(work, "src")
        os.makedirs(src)
        res.check("2 mounts of one SRC, one DCP rank each: every file lands whole",
                  lambda: save_through_mounts(work, src, 2))
        res.check("4 mounts, one more started mid-save: every file lands whole, nothing discarded",
                  lambda: save_through_mounts(work, src, 4, late_mount=os.path.join(work, "mnt-late")))
        res.check("kill -9 of one mount: a later mount recovers only the dead one's state",
                  lambda: kill_one(work, src))
    res.finish()


if __name__ == "__main__":
    main()
