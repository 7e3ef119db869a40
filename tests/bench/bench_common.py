"""Helpers shared by the benchmarks in this folder (not a benchmark itself)."""
import os
import re
import subprocess
import time


def daemon_pid(argv):
    """The daemon `ucpfs mount` forked: the one process left with exactly this command line."""
    want = "\0".join(argv) + "\0"
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline") as f:
                    if f.read() == want:
                        found.append(int(d))
            except OSError:
                pass
    assert len(found) == 1, (argv, found)
    return found[0]


def daemon_figures(pid):
    """(peak RSS in MiB, user + system CPU seconds) of a live process."""
    with open(f"/proc/{pid}/status") as f:
        hwm_kib = int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return hwm_kib / 1024, cpu_s


class Mount:
    """A fresh mount made by `argv` (a `ucpfs mount SRC MNT ...` command line); `seconds` is how
    long the command took, `pid` the daemon's (see daemon_pid). On exit, `umount` (default
    fusermount3 -u MNT) is run and the daemon waited for (it exits once unmounted and drained)."""

    def __init__(self, argv, mnt, umount=None):
        self.argv, self.mnt = list(argv), mnt
        self.umount = umount or ["fusermount3", "-u", mnt]

    def __enter__(self):
        os.makedirs(self.mnt, exist_ok=True)
        t0 = time.perf_counter()
        subprocess.run(self.argv, check=True)
        self.seconds = time.perf_counter() - t0
        self.pid = daemon_pid(self.argv)
        return self

    def figures(self):
        return daemon_figures(self.pid)

    def __exit__(self, *exc):
        subprocess.run(self.umount, check=True)
        for _ in range(1000):
            if not os.path.exists(f"/proc/{self.pid}"):
                break
            time.sleep(0.01)
