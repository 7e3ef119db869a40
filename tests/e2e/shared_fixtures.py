"""Framework fixtures generated once per CTest run and shared by the tests that read them.

A shared fixture is one generator invocation (a tests/e2e/fixtures/gen_*.py script, its arguments
and the interpreter it runs under), named in FIXTURES below. tests/CMakeLists.txt registers a
setup test `fixture_<name>` (FIXTURES_SETUP) that runs

    python3 tests/e2e/shared_fixtures.py make NAME DIR

which removes DIR (a fixture from an older run or build is never reused), generates into DIR/out
(generators write beside their output too: out_truth.pt, out_expected.pt) and writes
DIR/complete.json last. The tests that read it (FIXTURES_REQUIRED) get UCPFS_FIXTURES_DIR from
CTest and call `fixture(NAME, work)`, which copies DIR into their own work directory (they mount,
index and alter sources, and tests run side by side) and returns the copy's `out`. Run alone,
without UCPFS_FIXTURES_DIR (`python3 tests/e2e/x_test.py`), or when the setup did not complete,
the test generates the fixture itself, the same way. Scripts run after the tests (the
documented examples in mount-examples/) call `shared_fixtures.py ensure NAME DIR`, which reuses a
complete DIR of the same definition (the CTest run's) and generates it only when there is none.
"""
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GENERATORS = os.path.join(HERE, "fixtures")

# name -> (interpreter, generator, arguments); "{out}" is the output directory. Interpreters:
# torch213 the shared venv (tests/install-python.sh), torch113 Debian's /usr/bin/python3 with its
# torch 1.13, debian Debian's Python 3.11.2 running the shared venv's packages
# (tests/install-python-debian.sh: its pickler writes enums by name).
FIXTURES = {
    # DeepSpeed ZeRO-2, 2 ranks (deepspeed_save_into_mount: the plain save to copy in and the
    # plain save a save into the mount must equal byte for byte).
    "ds_zero2": ("torch213", "gen_deepspeed.py", ["save", "{out}", "--case", "zero2", "--ranks", "2"]),
    # Megatron-Core tp 2 dp 2 (DistributedOptimizer, fully_reshardable) after one step
    # (python_package: ucpfs.open's views against the mount's).
    "mcore_tp2_dp2": ("torch213", "gen_megatron_core.py", ["{out}", "--cases", "tp2_dp2", "--steps", "1"]),
    # A Llama-style Megatron-Core job at tp 2, untied and tied, with its live logits (hf_view).
    "megatron_llama": ("torch213", "gen_megatron_llama.py", ["{out}"]),
    # Megatron-LM legacy tp 2 x pp 2 and Megatron-DeepSpeed's Llama recipe at pp 2 x tp 2 (hf_megatron).
    "megatron_legacy_tp2_pp2": ("torch213", "gen_megatron_legacy.py", ["save", "{out}", "--tp", "2", "--pp", "2"]),
    "mds_llama_pp2_tp2": ("torch213", "gen_megatron_deepspeed.py", ["save", "{out}", "--case", "pp2_tp2", "--llama"]),
    # torchtitan 0.3.0's CheckpointManager save of its llama3 debug model (hf_view).
    "torchtitan": ("torch213", "gen_torchtitan.py", ["{out}"]),
    # The corrupt DCP variants (mount_dcp under each torch; verify under torch 1.13).
    "dcp2x_corrupt_torch113": ("torch113", "gen_dcp2x.py", ["{out}", "--variant", "corrupt"]),
    "dcp2x_corrupt_torch213": ("torch213", "gen_dcp2x.py", ["{out}", "--variant", "corrupt"]),
    # The documented examples' sample (mount-examples/mount-sample.sh, export-safetensors.sh,
    # shared-index.sh): a torch 1.13 DCP save of 2 ranks, and its expected tensors.
    "dcp113_llama": ("torch113", "gen_dcp113_llama.py",
                     ["{out}", "--ranks", "2", "--seed", "0", "--expected", "{out}_expected.pt"]),
    # torch.save producers (producers_torchsave), under the venv's Python and Debian's.
    "hf_trainer": ("torch213", "gen_hf_trainer.py", ["{out}"]),
    "hf_trainer_gpt2": ("torch213", "gen_hf_trainer.py", ["{out}", "--model", "gpt2"]),
    "hf_trainer_zero2": ("torch213", "gen_hf_trainer.py", ["{out}", "--deepspeed", "zero2"]),
    "hf_trainer_zero3": ("torch213", "gen_hf_trainer.py", ["{out}", "--deepspeed", "zero3"]),
    "lightning": ("torch213", "gen_lightning.py", ["{out}"]),
    "torchtune": ("torch213", "gen_torchtune.py", ["{out}"]),
    "debian_hf_trainer": ("debian", "gen_hf_trainer.py", ["{out}"]),
    "debian_lightning": ("debian", "gen_lightning.py", ["{out}"]),
    "debian_torchtune": ("debian", "gen_torchtune.py", ["{out}"]),
}
STAMP = "complete.json"


def interpreter(kind):
    if kind == "torch113":
        return "/usr/bin/python3"
    venv = os.environ.get("UCPFS_TORCH2_PYTHON") or os.path.join(ROOT, ".venv", "bin", "python")
    if kind == "torch213":
        return venv
    assert kind == "debian", kind
    r = subprocess.run(["bash", os.path.join(ROOT, "tests", "install-python-debian.sh")], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, UCPFS_TORCH2_PYTHON=venv))
    assert r.returncode == 0, f"tests/install-python-debian.sh failed: {r.stderr}"
    return r.stdout.strip().splitlines()[-1]


def _command(name, out):
    kind, script, args = FIXTURES[name]
    return [interpreter(kind), os.path.join(GENERATORS, script)] + [a.replace("{out}", out) for a in args]


def _start(name, d):
    """Starts generating fixture `name` into d/out (d emptied first); returns the process."""
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return subprocess.Popen(_command(name, os.path.join(d, "out")), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(name, d, p, t0, timeout_s):
    try:
        log, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        log, _ = p.communicate()
        raise AssertionError(f"fixture {name}: {p.args} ran past {timeout_s} s:\n{log[-4000:]}") from None
    assert p.returncode == 0, f"fixture {name}: {p.args} exited {p.returncode}:\n{log[-4000:]}"
    kind, script, args = FIXTURES[name]
    with open(os.path.join(d, STAMP), "w") as f:
        json.dump({"name": name, "interpreter": kind, "generator": script, "args": args,
                   "seconds": round(time.monotonic() - t0, 1)}, f)
    return os.path.join(d, "out")


def _shared(name):
    """The directory CTest's setup test filled for this run, or None (run alone, or no setup)."""
    root = os.environ.get("UCPFS_FIXTURES_DIR")
    if not root:
        return None
    d = os.path.join(root, name)
    try:
        stamp = json.load(open(os.path.join(d, STAMP)))
    except (OSError, ValueError):
        print(f"shared_fixtures: {d} is not complete (its setup test did not run); generating {name} here",
              flush=True)
        return None
    kind, script, args = FIXTURES[name]
    assert (stamp["interpreter"], stamp["generator"], stamp["args"]) == (kind, script, args), \
        f"{d} was generated by another definition of {name}: {stamp}"
    return d


def fixtures(names, work, timeout_s=900):
    """{name: path of the fixture's `out` in a private copy under work/<name>/}: copied from the
    run's shared fixtures where CTest set them up, else generated here (side by side)."""
    started, paths = {}, {}
    for name in names:
        d = os.path.join(work, name)
        shared = _shared(name)
        if shared:
            shutil.copytree(shared, d, symlinks=True)
            paths[name] = os.path.join(d, "out")
        else:
            started[name] = (d, _start(name, d), time.monotonic())
    for name, (d, p, t0) in started.items():
        paths[name] = _finish(name, d, p, t0, timeout_s)
    return paths


def fixture(name, work, timeout_s=900):
    return fixtures([name], work, timeout_s)[name]


def make(name, d, timeout_s=900):
    """The setup test: d emptied, the fixture generated into d/out, then the stamp."""
    t0 = time.monotonic()
    _finish(name, d, _start(name, d), t0, timeout_s)
    print(f"fixture {name}: generated in {time.monotonic() - t0:.1f} s into {d}", flush=True)


def ensure(name, d, timeout_s=900):
    """For scripts run after the tests (mount-examples/, in CI after the CTest run that set up
    build/fixtures/NAME): d/out when d holds a complete fixture of this definition, else d/out
    generated first. Not for tests, which copy (fixtures()): callers only read it."""
    try:
        stamp = json.load(open(os.path.join(d, STAMP)))
        if (stamp["interpreter"], stamp["generator"], stamp["args"]) == tuple(FIXTURES[name]):
            return os.path.join(d, "out")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    make(name, d, timeout_s)
    return os.path.join(d, "out")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("make", "ensure") or sys.argv[2] not in FIXTURES:
        sys.exit(f"usage: shared_fixtures.py make|ensure NAME DIR (NAME one of {', '.join(FIXTURES)}); "
                 "ensure prints the fixture's out directory, generating it unless DIR holds it complete")
    if sys.argv[1] == "make":
        make(sys.argv[2], os.path.abspath(sys.argv[3]))
    else:
        sys.stdout = sys.stderr  # make's progress line; the path alone goes to stdout
        out = ensure(sys.argv[2], os.path.abspath(sys.argv[3]))
        print(out, file=sys.__stdout__)
