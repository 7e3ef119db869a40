"""End-to-end: DeepSpeed checkpoints saved under Debian 12's own Python (3.11.2), frozen
parameters and buffers included, mounted with real FUSE.

Debian's /usr/bin/python3 pickles an int Enum by name: DeepSpeed's `zero_stage` is written as
`getattr(ZeroStageEnum, 'optimizer_states')` (GLOBAL builtins.getattr + REDUCE), where newer
Pythons write `ZeroStageEnum(1)`. tests/install-python-debian.sh gives that interpreter the
pinned torch 2.13 and DeepSpeed 0.19.8; fixtures/gen_deepspeed.py runs under it (2 gloo ranks,
--frozen: a frozen parameter in no param group and a persistent buffer) for zero2_bf16 and
zero3. For each:
 1. the optimizer files pickle zero_stage by name (pickletools), and `ucpfs index` reads the stage;
 2. atomic/<param>/{fp32,exp_avg,exp_avg_sq}.pt equal the live engine's, bit for bit, and
    atomic/<frozen or buffer>/fp32.pt the module's tensor as fp32 (ZeRO-3: the frozen parameter
    gathered from every dp rank's partition);
 3. global_step3_universal/ equals, file by file, what ds_to_universal (run under the same
    interpreter) writes: `zero/<frozen or buffer>/fp32.pt` included (ZeRO-1/2; the converter's
    ZeRO-3 path writes none), and zero/optimizer_state.pt's
    ZeroStageEnum loads as the same member.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/deepspeed_debian_python_test.py
"""
import io
import os
import pickletools
import subprocess
import sys
import zipfile

import torch

from deepspeed_sources_test import atomic_equals_truth, universal_equals
from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import mounted

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEN = os.path.join(HERE, "fixtures", "gen_deepspeed.py")
# ZeRO-1 decodes its stage through the same code as ZeRO-2 (CI time: two saves, not three).
CASES = ("zero2_bf16", "zero3")
MODULE_ONLY = ("language_model.embedding.frozen_shift", "language_model.encoder.position_gain")


def debian_python():
    r = subprocess.run(["bash", os.path.join(ROOT, "tests", "install-python-debian.sh")], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, UCPFS_TORCH2_PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr
    py = r.stdout.strip().splitlines()[-1]
    version = subprocess.run([py, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    assert version == "3.11.2", version
    return py


def zero_stage_opcodes(path):
    """The pickle ops that write optimizer_state_dict.zero_stage in an optimizer file."""
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    out = io.StringIO()
    pickletools.dis(data, out=out)
    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if "ZeroStageEnum" in line)
    return "\n".join(lines[at - 2:at + 10])


def check_case(work, py, case):
    src = os.path.join(work, case)
    run([py, GEN, "save", src, "--case", case, "--ranks", "2", "--frozen"], timeout=600)
    optim = [f for f in os.listdir(os.path.join(src, "global_step3")) if f.endswith("optim_states.pt")][0]
    ops = zero_stage_opcodes(os.path.join(src, "global_step3", optim))
    assert "GLOBAL     '__builtin__ getattr'" in ops and "REDUCE" in ops, ops
    truth = torch.load(src + "_truth.pt")
    module_only = truth.pop("__module_only__")
    assert sorted(module_only) == sorted(MODULE_ONLY), sorted(module_only)
    r = run([ucpfs_bin(), "index", src], timeout=120)
    stage = "zero" + case[4]
    assert f"deepspeed ({stage} dp2 tag global_step3)" in r.stderr + r.stdout, r.stderr + r.stdout
    ds = os.path.join(work, case + "-ds")
    run([py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(src, "global_step3"),
         "--output_folder", os.path.join(ds, "global_step3_universal"), "--num_extract_workers", "1",
         "--num_merge_workers", "1"], timeout=600)
    with mounted(src, os.path.join(work, "mnt-" + case)) as (m, _):
        n = atomic_equals_truth(m, truth)
        for name, want in module_only.items():
            got = torch.load(os.path.join(m, "atomic", name, "fp32.pt"))["param"]
            assert got.dtype == torch.float32 and torch.equal(got, want), (name, got, want)
            n += 1
        n_universal = universal_equals(os.path.join(m, "global_step3_universal"),
                                       os.path.join(ds, "global_step3_universal"))
        stage_enum = torch.load(os.path.join(m, "global_step3_universal", "zero", "optimizer_state.pt"),
                                weights_only=False)["zero_stage"]
        assert type(stage_enum).__name__ == "ZeroStageEnum" and int(stage_enum) == int(case[4]), stage_enum
    return n, n_universal


def main():
    res = Results("deepspeed_debian_python")
    with tmpdir("ucpfs-ds-debian-") as work:
        py = debian_python()
        for case in CASES:
            res.check(f"{case} saved under Python 3.11.2 (ZeroStageEnum pickled by name, a frozen parameter, a "
                      "buffer): atomic equals the engine's; the universal view equals ds_to_universal's output",
                      lambda case=case: check_case(work, py, case))
    res.finish()


if __name__ == "__main__":
    main()
