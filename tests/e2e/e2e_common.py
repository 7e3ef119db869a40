"""Shared helpers for ucpfs end-to-end tests.

CTest runs each script that writes checkpoints twice: with Debian's /usr/bin/python3 (torch 1.13)
and with the virtual environment's python (torch 2.13). Binaries come from the environment CTest
sets: UCPFS_BIN (the ucpfs executable) and UCPFS_TOOLS_DIR (build/tests, holding test tools).
Each script prints one closing line "<name>: N passed, M failed" and exits non-zero on any
failure.
"""
import os
import random
import subprocess
import sys
import tempfile
import warnings

import torch

# torch 2.x warns once per process when a complex32 tensor is made (random_tensor does).
warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")

# (major, minor) of the torch running the test.
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# torch >= 2.6: torch.load defaults to weights_only=True, has mmap=True, and
# torch.serialization.get_unsafe_globals_in_checkpoint.
TORCH_2_6 = TORCH_VERSION >= (2, 6)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
# dtypes torch 2.x saves through _rebuild_tensor_v3 (no legacy storage class); 1.13 has none.
DTYPES_V3 = [getattr(torch, n) for n in (
    "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu",
    "uint16", "uint32", "uint64", "complex32") if TORCH_VERSION >= (2, 3) and hasattr(torch, n)]
# Every dtype the running torch can save.
ALL_DTYPES = DTYPES + DTYPES_V3
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ucpfs_bin():
    path = os.environ.get("UCPFS_BIN")
    if not path:
        sys.exit("UCPFS_BIN is not set (run through ctest, or export it)")
    return path


def tool(name):
    d = os.environ.get("UCPFS_TOOLS_DIR")
    if not d:
        sys.exit("UCPFS_TOOLS_DIR is not set (run through ctest, or export it)")
    return os.path.join(d, name)


def seeded_rng(test_name):
    seed = int(os.environ.get("UCPFS_TEST_SEED", random.SystemRandom().randrange(1 << 31)))
    print(f"{test_name}: seed {seed} (set UCPFS_TEST_SEED={seed} to reproduce)", flush=True)
    torch.manual_seed(seed)
    return random.Random(seed)


def random_tensor(rng, dtype, shape):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype in DTYPES_V3:  # random bit patterns (NaNs included): compare with bits_equal
        n = _SAME_SIZE_INT[dtype.itemsize]
        bits = torch.randint(-2 ** 63, 2 ** 63 - 1, shape, dtype=torch.int64).to(n)
        return bits.view(dtype)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype) if dtype != torch.uint8 else \
        torch.randint(0, 256, shape, dtype=dtype)


def bits_equal(a, b):
    """torch.equal on the raw bits: same dtype, shape and bytes (NaN payloads and -0.0 included;
    also for dtypes without torch.equal, e.g. complex32)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 16:  # complex128: compare its float64 halves
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    n = _SAME_SIZE_INT.get(a.element_size())
    if n is None or a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.view(n), b.view(n))


def served_loads(path, has_floats=False):
    """Loads `path` (a .pt file ucpfs wrote or serves) as users of the running torch do; returns
    [(how, object)], the objects to compare with the truth.
    - torch >= 2.6: torch.load(path) (default weights_only=True), torch.load(path, mmap=True) and
      torch.load(path, mmap=True, weights_only=True); and
      torch.serialization.get_unsafe_globals_in_checkpoint(path) must be [].
    - torch 1.13: weights_only=True when the file holds no Python floats (atomic files, model.pt).
      A file with floats (optim.pt: lr, betas, eps in param_groups) needs weights_only=False,
      because 1.13's weights_only unpickler refuses BINFLOAT (docs/reference.md
      "Writer compatibility")."""
    if not TORCH_2_6:
        return [(f"weights_only={not has_floats}", torch.load(path, weights_only=not has_floats))]
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    assert unsafe == [], f"{path}: get_unsafe_globals_in_checkpoint = {unsafe}"
    return [("default", torch.load(path)), ("mmap=True", torch.load(path, mmap=True)),
            ("mmap=True, weights_only=True", torch.load(path, mmap=True, weights_only=True))]


def run(cmd, check=True, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


class Results:
    """Counts named checks; prints failures as they happen and a closing line."""

    def __init__(self, name):
        self.name, self.passed, self.failed = name, 0, 0

    def check(self, label, fn):
        try:
            fn()
            self.passed += 1
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            self.failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)

    def finish(self):
        print(f"{self.name}: {self.passed} passed, {self.failed} failed", flush=True)
        sys.exit(1 if self.failed or not self.passed else 0)


def as_nobody(*cmd, stdin=None, timeout=60):
    """Runs cmd as user nobody (uid and gid 65534, no groups): the CompletedProcess, stdout as
    bytes, stderr as text."""
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd],
                       input=stdin, capture_output=True, timeout=timeout)
    p.stderr = p.stderr.decode(errors="replace")
    return p


class _WorkDir(tempfile.TemporaryDirectory):
    """A temporary directory whose cleanup first detaches whatever a failed check left mounted
    inside it, so one failure is reported as itself and not as the cleanup's ENOTCONN."""

    def cleanup(self):
        try:
            with open("/proc/self/mountinfo", errors="surrogateescape") as f:
                points = [line.split()[4] for line in f]
        except OSError:
            points = []
        inside = [p for p in points if p.startswith(self.name + os.sep)]
        for p in sorted(set(inside), key=len, reverse=True):
            print(f"cleanup: detaching {p}, left mounted", flush=True)
            subprocess.run(["umount", "-l", p], check=False)
        super().cleanup()


def tmpdir(prefix):
    return _WorkDir(prefix=prefix)
