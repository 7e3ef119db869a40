"""Helpers for tests that mount checkpoints with `ucpfs mount` (real FUSE)."""
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time

from e2e_common import run, ucpfs_bin

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
# Fixture generators run under the interpreter (and so the torch) of the test itself.
PY = sys.executable


def gen_fixture(script, outdir, *args):
    """Runs a fixture generator; returns the path of its expected-tensors file."""
    expected = outdir.rstrip("/") + "_expected.pt"
    run([PY, os.path.join(FIXTURES, script), outdir, "--expected", expected, *args], timeout=300)
    return expected


def daemon_alive(pid):
    """Whether process `pid` runs (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def is_mounted(mnt):
    with open("/proc/self/mounts", errors="surrogateescape") as f:
        return any(line.split()[1] == mnt for line in f)


@contextlib.contextmanager
def mounted(src, mnt, *extra, timeout_s=600):
    """`ucpfs mount` (returns when ready), yields the mount point, always unmounts.
    A watchdog unmounts after `timeout_s` so a hung test cannot hang CI; when it fired, the
    check fails saying so (what the body saw after it is an empty directory, not the mount).
    The default is long: on a loaded 2-core machine a body running several multi-process jobs
    against one mount (deepspeed_sources: 4 resumes) took over 120 s."""
    os.makedirs(mnt, exist_ok=True)
    log = mnt.rstrip("/") + ".log"
    t0 = time.monotonic()
    p = run([ucpfs_bin(), "mount", src, mnt, "--log", log, *extra], check=False, timeout=300)
    ready_s = time.monotonic() - t0
    if p.returncode != 0:
        raise AssertionError(f"ucpfs mount failed ({p.returncode}): {p.stderr}")
    assert is_mounted(mnt), "mount returned but nothing is mounted"
    fired = []

    def unmount_hung():
        fired.append(time.monotonic() - t0)
        subprocess.run(["umount", "-l", mnt])

    watchdog = threading.Timer(timeout_s, unmount_hung)
    watchdog.daemon = True
    watchdog.start()
    try:
        daemon_pid = json.load(open(os.path.join(mnt, ".ucpfs", "status.json")))["daemon_pid"]
    except (OSError, ValueError, KeyError):
        daemon_pid = None
    def fired_message():
        return f"the test's watchdog unmounted {mnt} {fired[0]:.0f} s after mounting (timeout_s={timeout_s})"

    try:
        yield mnt, ready_s
        if fired:
            raise AssertionError(fired_message())
    except BaseException as e:
        if fired and not str(e).startswith("the test's watchdog"):
            raise AssertionError(f"{fired_message()}; then: {type(e).__name__}: {e}") from e
        raise
    finally:
        watchdog.cancel()
        r = run([ucpfs_bin(), "umount", mnt], check=False)
        if r.returncode != 0 and is_mounted(mnt):
            subprocess.run(["umount", "-l", mnt])
        elif r.returncode == 0 and daemon_pid is not None and daemon_alive(daemon_pid):
            # `ucpfs umount` returns once the daemon has exited (nothing of it touches SRC after).
            raise AssertionError(f"ucpfs umount returned while its daemon (pid {daemon_pid}) still runs")
        deadline = time.monotonic() + 10
        while is_mounted(mnt) and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.path.exists(log):
            text = open(log, errors="replace").read()
            if "ERROR" in text or "error" in text.lower():
                print(f"--- daemon log {log}:\n{text}", file=sys.stderr)


def capture_parts(src):
    """The parts (files being captured) left in SRC's capture state: every mount keeps its own
    state directory under .ucpfs/capture/."""
    out = []
    for d, _, files in os.walk(os.path.join(src, ".ucpfs", "capture")):
        out += [os.path.join(d, f) for f in files if f.endswith(".part")]
    return out


def status(mnt):
    return json.load(open(os.path.join(mnt, ".ucpfs", "status.json")))


def stats(mnt):
    return json.load(open(os.path.join(mnt, ".ucpfs", "stats.json")))


# Key -> (param, state), mirroring the built-in rules for the fixtures' naming.
_RULES = [
    (r"optimizer\.state\.(.+)\.(exp_avg|exp_avg_sq|step)", lambda m: (m[1], m[2])),
    (r"optimizer\.state\.(.+)\.(fp32_param|master_param)", lambda m: (m[1], "fp32")),
    (r"optimizer\.state\.(param|fp32_param)\.(.+)", lambda m: (m[2], "fp32")),
    (r"optimizer\.state\.(exp_avg|exp_avg_sq)\.(.+)", lambda m: (m[2], m[1])),
    (r"optimizer\.state\.fp32\.(.+)", None),
    (r"model\.(.+)", lambda m: (m[1], "weight")),
    (r"(.+\.(weight|bias))", lambda m: (m[1], "weight")),
]


def param_state(key):
    for pat, fn in _RULES:
        m = re.fullmatch(pat, key)
        if m:
            return fn(m) if fn else None
    return None


def step_equal(got, want, what):
    """An atomic step.pt's value against the saved step."""
    import torch  # noqa: PLC0415  (the mount helpers run without torch too)
    if hasattr(want, "dtype"):
        assert hasattr(got, "dtype") and got.dtype == want.dtype and got.shape == want.shape, (what, got, want)
        assert torch.equal(got, want), (what, got, want)
    else:
        assert type(got) is int and got == want, (what, got, want)


def expected_atomic(expected):
    """param -> {atomic file name -> expected fp32 tensor} from an expected-tensors dict, plus
    "step.pt" -> the step as saved (a tensor in its dtype, or an int; float steps are not served)."""
    per = {}
    for key, t in expected.items():
        ps = param_state(key)
        step_number = ps is not None and ps[1] == "step" and type(t) is int
        if ps is None or not (hasattr(t, "dtype") or step_number):
            continue
        per.setdefault(ps[0], {})[ps[1]] = t
    out = {}
    for param, states in per.items():
        files = {}
        master = states.get("fp32", states.get("weight"))
        if master is not None:
            files["fp32.pt"] = master.float()
        for s in ("exp_avg", "exp_avg_sq"):
            if s in states:
                files[s + ".pt"] = states[s].float()
        if "step" in states and files:
            files["step.pt"] = states["step"]
        if files:
            out[param] = files
    return out
