"""End-to-end: DeepSpeed checkpoints saved into, and copied into, a mount (issue 10), real FUSE.

 1. A genuine DeepSpeed 0.19.8 ZeRO-2 save (2 gloo ranks, CPU) made in a plain directory is
    copied with `cp -r` into a mount of an empty directory: within seconds, without a remount,
    `latest_universal` names `global_step3_universal`, which equals the installed
    ds_to_universal's output file by file, and every atomic state equals the engine's truth.
 2. The DeepSpeed engine's own `save_checkpoint` writes into the mount (the generator's save
    directory is the mount): the files in SRC are byte-identical to the same save into a plain
    directory, and the views appear without a remount and equal the truth.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/deepspeed_save_into_mount_test.py
"""
import filecmp
import os
import subprocess
import sys
import time

import torch

from deepspeed_sources_test import GEN, atomic_equals_truth, ds_to_universal, universal_equals
from e2e_common import Results, run, tmpdir
from mount_common import mounted
from shared_fixtures import fixture


def wait_for(path, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout_s} s")


def files_under(d):
    return sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs
                  if "/.ucpfs" not in "/" + os.path.relpath(r, d) + "/")


def copied_in(work, plain):
    truth = torch.load(plain + "_truth.pt")
    want = ds_to_universal(work, "zero2", plain)
    src = os.path.join(work, "empty")
    os.makedirs(src)
    with mounted(src, os.path.join(work, "mnt-copy")) as (m, _):
        assert sorted(os.listdir(m)) == [".ucpfs"], os.listdir(m)
        t0 = time.monotonic()
        subprocess.run(["cp", "-r"] + [os.path.join(plain, e) for e in sorted(os.listdir(plain))] + [m], check=True)
        t1 = wait_for(os.path.join(m, "latest_universal"))
        assert open(os.path.join(m, "latest_universal")).read() == "global_step3_universal"
        n = universal_equals(os.path.join(m, "global_step3_universal"), os.path.join(want, "global_step3_universal"))
        assert atomic_equals_truth(m, truth) == 3 * (len(truth) - 1)
    return f"{n} universal files equal ds_to_universal's; views {t1 - t0:.2f} s after cp started"


def saved_into(work, plain):
    src = os.path.join(work, "mounted-save")
    os.makedirs(src)
    mnt = os.path.join(work, "mnt-save")
    with mounted(src, mnt) as (m, _):
        # The engine saves straight into the mount (its truth file lands beside the mount point).
        run([sys.executable, GEN, "save", m, "--case", "zero2", "--ranks", "2"], timeout=600)
        truth = torch.load(m + "_truth.pt")
        wait_for(os.path.join(m, "latest_universal"))
        assert atomic_equals_truth(m, truth) == 3 * (len(truth) - 1)
        # Everything is durable once sync returns.
        run(["cat", os.path.join(m, ".ucpfs", "sync")])
        got, want = files_under(src), files_under(plain)
        assert got == want, set(got) ^ set(want)
        differ = [f for f in want if not filecmp.cmp(os.path.join(src, f), os.path.join(plain, f), shallow=False)]
        # torch.save output is deterministic for the same tensors; the engine's save is too.
        assert not differ, differ
    return f"{len(want)} files byte-identical to the same save into a plain directory"


def main():
    res = Results("deepspeed_save_into_mount")
    with tmpdir("ucpfs-ds-into-mount-") as work:
        # One plain save (shared_fixtures.py: once per CTest run): copied in, and what a save into
        # the mount must equal byte for byte (the same generator and arguments as the save below).
        plain = fixture("ds_zero2", work)
        res.check("cp -r of a DeepSpeed save into an empty mount: <tag>_universal appears, equal to ds_to_universal",
                  lambda: copied_in(work, plain))
        res.check("DeepSpeed save_checkpoint into the mount: SRC byte-identical, views without a remount",
                  lambda: saved_into(work, plain))
    res.finish()


if __name__ == "__main__":
    main()
