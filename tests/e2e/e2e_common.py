"""Shared helpers for ucpfs end-to-end tests (run with Debian's /usr/bin/python3 + torch 1.13).

Binaries come from the environment CTest sets: UCPFS_BIN (the ucpfs executable) and
UCPFS_TOOLS_DIR (build/tests, holding test tools). Each script prints one closing line
"<name>: N passed, M failed" and exits non-zero on any failure.
"""
import os
import random
import subprocess
import sys
import tempfile

import torch

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


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
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype) if dtype != torch.uint8 else \
        torch.randint(0, 256, shape, dtype=dtype)


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


def tmpdir(prefix):
    return tempfile.TemporaryDirectory(prefix=prefix)
