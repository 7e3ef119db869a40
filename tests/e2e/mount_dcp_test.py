"""End-to-end: mount real DCP checkpoints and read consolidated atomic files with torch.load.

Runs under torch 1.13 and torch 2.x (CTest registers both). Fixtures: real multi-process gloo
saves of a small Llama-like model by the running torch (2 and 4 ranks, row/column/uneven/grid
shardings, replicated tensors, 0-d and BYTE_IO items, Adam moments; torch 2.x's planner spreads
replicated tensors and BYTE_IO items over the ranks' files and flattens the nested `train_state`),
a synthetic torch 2.x-style DCP directory (uneven FSDP2 shards with an empty chunk, a transposed
chunk, rank-local metadata variant) and a Megatron torch_dist directory (flattened-range
optimizer chunks). For each: every MNT/atomic/<param>/*.pt loads and equals the original full
tensor bit for bit, loaded the ways the running torch offers (e2e_common.served_loads: 1.13
weights_only=True; torch >= 2.6 the default weights_only=True, mmap=True, mmap=True with
weights_only=True, and no unsafe globals); ls -R / du / find / stat read no tensor data;
8 concurrent readers read everything twice; writes to views fail with EROFS; mmap works; a remount
reuses the index.
"""
import concurrent.futures
import errno
import hashlib
import json
import mmap
import os
import shutil
import subprocess

import torch

from e2e_common import TORCH_VERSION, Results, bits_equal, run, served_loads, tmpdir, ucpfs_bin
from mount_common import (expected_atomic, gen_fixture, is_mounted, mounted, param_state, step_equal, stats,
                          status)
from shared_fixtures import fixture


def check_atomic_files(mnt, expected):
    want = expected_atomic(expected)
    assert want, "fixture has no parameters"
    got_params = sorted(os.listdir(os.path.join(mnt, "atomic")))
    assert got_params == sorted(p.replace("/", "%2F") for p in want), (got_params, sorted(want))
    for param, files in want.items():
        d = os.path.join(mnt, "atomic", param.replace("/", "%2F"))
        assert sorted(os.listdir(d)) == sorted(files), (param, os.listdir(d), sorted(files))
        for name, t in files.items():
            for how, obj in served_loads(os.path.join(d, name)):
                what = f"{param}/{name} ({how})"
                if name == "step.pt":
                    step_equal(obj, t, what)
                    continue
                assert isinstance(obj, dict) and list(obj)[-1] == "param", (what, list(obj))
                p = obj["param"]
                assert p.dtype == torch.float32, (what, p.dtype)
                assert p.shape == t.shape, (what, p.shape, t.shape)
                assert bits_equal(p, t), f"{what}: values differ"
                for k in obj:
                    assert k in ("cat_dim", "vocab_tensor", "param"), (what, k)


def metadata_ops_read_no_data(mnt):
    before = stats(mnt)["source_bytes_read"]
    run(["ls", "-lR", mnt])
    run(["du", "-sh", os.path.join(mnt, "atomic")])
    du_b = run(["du", "-sb", os.path.join(mnt, "atomic")]).stdout.split()[0]
    total = 0
    for root, dirs, files in os.walk(os.path.join(mnt, "atomic")):
        for f in files:
            total += os.stat(os.path.join(root, f)).st_size
        total += sum(os.stat(os.path.join(root, d)).st_size for d in dirs)
    total += os.stat(os.path.join(mnt, "atomic")).st_size
    assert int(du_b) == total, (du_b, total)
    run(["find", mnt, "-name", "*.pt"])
    run(["stat", os.path.join(mnt, "atomic")])
    after = stats(mnt)["source_bytes_read"]
    assert after == before, f"metadata operations read {after - before} source bytes"


def read_all(mnt):
    digests = {}
    for root, _, files in os.walk(os.path.join(mnt, "atomic")):
        for f in files:
            p = os.path.join(root, f)
            digests[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return digests


def concurrent_readers(mnt):
    reference = read_all(mnt)
    def reader(_):
        return [read_all(mnt) for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        for results in ex.map(reader, range(8)):
            for r in results:
                assert r == reference, "a concurrent reader saw different bytes"


def writes_fail(mnt):
    """Views are read-only (the source's own files are read-write: write_capture_test.py)."""
    some = next(os.path.join(r, f) for r, _, fs in os.walk(os.path.join(mnt, "atomic")) for f in fs)
    for attempt in (lambda: open(some, "r+b"), lambda: open(os.path.join(mnt, "atomic", "new.pt"), "wb"),
                    lambda: os.mkdir(os.path.join(mnt, "atomic", "x")), lambda: os.unlink(some)):
        try:
            attempt()
        except OSError as e:
            assert e.errno == errno.EROFS, (e.errno, e)
        else:
            raise AssertionError("a write on the mount succeeded")


def mmap_works(mnt):
    some = max((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(mnt, "atomic")) for f in fs),
               key=os.path.getsize)
    with open(some, "rb") as f:
        data = f.read()
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        assert m[:] == data
        m.close()


def passthrough(mnt, src):
    for root, _, files in os.walk(src):
        if "/.ucpfs" in root + "/":
            continue
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), src)
            assert open(os.path.join(mnt, rel), "rb").read() == open(os.path.join(src, rel), "rb").read(), rel


def inspect_and_index(src, expected):
    """`ucpfs index` (summary, then reuse) and `ucpfs inspect --json` agree with what torch wrote."""
    first = run([ucpfs_bin(), "index", src]).stdout
    assert "ucpfs index: " in first and " parameters" in first, first
    again = run([ucpfs_bin(), "index", src]).stdout
    assert "reused" in again, again
    report = json.loads(run([ucpfs_bin(), "inspect", "--json", src]).stdout)
    assert report["format"] == "dcp", report["format"]
    assert report["unmapped_keys"] == [], report["unmapped_keys"]
    want = expected_atomic(expected)
    by_name = {p["name"]: p["states"] for p in report["params"]}
    assert sorted(by_name) == sorted(want), (sorted(by_name), sorted(want))
    for key, t in expected.items():
        ps = param_state(key)
        if ps is None or not hasattr(t, "dtype") or ps[1] not in by_name.get(ps[0], {}):
            continue
        st = by_name[ps[0]][ps[1]]
        assert st["key"] == key, (st["key"], key)
        assert st["shape"] == list(t.shape), (key, st["shape"], list(t.shape))
        assert st["dtype"] == str(t.dtype).split(".")[1], (key, st["dtype"], t.dtype)
        assert st["nbytes"] == t.numel() * t.element_size(), (key, st["nbytes"])
        assert st["fragments"] >= (1 if t.numel() else 0) and st["files"], (key, st)


def failing_source_gives_eio(workdir, src):
    """A source shard that changes under a mount: reads needing it fail with EIO, the daemon logs
    the file and keeps serving."""
    copy = os.path.join(workdir, "eio-src")
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns(".ucpfs"))
    mnt = os.path.join(workdir, "mnt-eio")
    with mounted(copy, mnt) as (m, _):
        shard = max((f for f in os.listdir(copy) if f.endswith(".distcp")),
                    key=lambda f: os.path.getsize(os.path.join(copy, f)))
        os.truncate(os.path.join(copy, shard), 10)
        failed = 0
        for root, _, files in os.walk(os.path.join(m, "atomic")):
            for f in files:
                try:
                    open(os.path.join(root, f), "rb").read()
                except OSError as e:
                    assert e.errno == errno.EIO, e
                    failed += 1
        assert failed > 0, "no read failed although a shard was truncated"
        assert status(m)["format"] == "dcp"  # still serving
        assert stats(m)["source_read_errors"] > 0
        log = open(mnt + ".log").read()
        assert shard in log and "read" in log, log
    shutil.rmtree(copy)


def check_checkpoint(res, label, src, expected_path, workdir):
    expected = torch.load(expected_path)
    mnt = os.path.join(workdir, "mnt-" + label)
    res.check(f"{label}: ucpfs index and inspect --json", lambda: inspect_and_index(src, expected))
    try:
        with mounted(src, mnt) as (m, ready_s):
            st = status(m)
            print(f"{label}: first mount ready in {ready_s:.2f} s (index {st['index']['state']})", flush=True)
            def status_ok():
                assert st["format"] == "dcp" and st["counts"]["atomic_files"] > 0, st
                assert st["counts"]["unmapped_keys"] == 0, st["unmapped_keys"]
            res.check(f"{label}: status.json", status_ok)
            res.check(f"{label}: ls/du/find/stat read no tensor data", lambda: metadata_ops_read_no_data(m))
            res.check(f"{label}: atomic files equal the full tensors", lambda: check_atomic_files(m, expected))
            res.check(f"{label}: 8 concurrent readers, twice", lambda: concurrent_readers(m))
            res.check(f"{label}: writes to views fail with EROFS", lambda: writes_fail(m))
            res.check(f"{label}: mmap", lambda: mmap_works(m))
            res.check(f"{label}: passthrough files", lambda: passthrough(m, src))
        with mounted(src, mnt) as (m, ready_s):
            st = status(m)
            print(f"{label}: remount ready in {ready_s:.3f} s, index open {st['index']['open_seconds']:.4f} s",
                  flush=True)
            def reused():
                assert st["index"]["state"] == "reused", st["index"]
            res.check(f"{label}: remount reuses the index", reused)
            res.check(f"{label}: atomic files after remount", lambda: check_atomic_files(m, expected))
    except Exception as e:  # noqa: BLE001 - a failed mount fails this checkpoint, not the run
        res.failed += 1
        print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)


def read_only_index(d, src):
    """--read-only-index (the shared, prebuilt index of many mounts): a current index is served;
    a missing or stale one fails the mount with the reason and is never built or written."""
    shared, empty = os.path.join(d, "ro-index"), os.path.join(d, "ro-index-empty")
    os.makedirs(empty)
    run([ucpfs_bin(), "index", src, "--index-dir", shared])
    digest = lambda: hashlib.sha256(open(os.path.join(shared, "data.mdb"), "rb").read()).hexdigest()  # noqa: E731
    built = digest()
    with mounted(src, os.path.join(d, "mnt-ro-index"), "--index-dir", shared, "--read-only-index") as (m, _):
        assert status(m)["index"]["state"] == "reused", status(m)["index"]
        assert os.listdir(os.path.join(m, "atomic")), "no atomic views"
    mnt = os.path.join(d, "mnt-ro-refused")
    os.makedirs(mnt)

    def refused(*args):
        r = run([ucpfs_bin(), "mount", *args, mnt, "--read-only-index"], check=False, timeout=120)
        if is_mounted(mnt):
            run([ucpfs_bin(), "umount", mnt])
            raise AssertionError(f"mounted with --read-only-index {args}: {r.stderr}")
        assert r.returncode == 1, (r.returncode, r.stderr)
        return r.stderr

    err = refused(src, "--index-dir", empty)
    assert "no index for " + src in err, err
    assert os.listdir(empty) == [], f"an index was written in {empty}: {os.listdir(empty)}"
    stale = os.path.join(d, "ro-index-stale-src")
    shutil.copytree(src, stale, ignore=shutil.ignore_patterns(".ucpfs"))
    run([ucpfs_bin(), "index", stale, "--index-dir", shared])
    built = digest()
    shard = os.path.join(stale, sorted(f for f in os.listdir(stale) if f.endswith(".distcp"))[0])
    with open(shard, "r+b") as f:  # the same bytes written again: a new mtime
        f.write(f.read(1))
    err = refused(stale, "--index-dir", shared)
    assert "is stale" in err, err
    assert digest() == built, "a stale read-only index was written"


def main():
    res = Results("e2e_mount_dcp")
    with tmpdir("ucpfs-mount-") as d:
        cases = []
        for ranks in (2, 4):
            src = os.path.join(d, f"dcp_torch_r{ranks}")
            cases.append((f"torch{TORCH_VERSION[0]}.{TORCH_VERSION[1]}-{ranks}ranks", src,
                          gen_fixture("gen_dcp113_llama.py", src, "--ranks", str(ranks), "--seed", str(ranks))))
        for variant in ("2x", "ranklocal", "megatron"):
            src = os.path.join(d, f"dcp{variant}")
            cases.append((f"synthetic-{variant}", src, gen_fixture("gen_dcp2x.py", src, "--variant", variant)))
        for label, src, expected in cases:
            check_checkpoint(res, label, src, expected, d)
        res.check("--read-only-index: a current index is served, a missing or stale one refused, never written",
                  lambda: read_only_index(d, cases[0][1]))
        res.check("a truncated source shard gives EIO, the daemon keeps serving",
                  lambda: failing_source_gives_eio(d, cases[0][1]))

        # Corrupt or unsupported checkpoints: the mount fails with a clear error naming the
        # problem, and nothing is left mounted.
        bad = fixture(f"dcp2x_corrupt_torch{TORCH_VERSION[0]}{TORCH_VERSION[1]}", d)
        mnt = os.path.join(d, "mnt-bad")
        os.makedirs(mnt, exist_ok=True)
        for kind in sorted(os.listdir(bad)):
            def refused(src=os.path.join(bad, kind)):
                r = run([ucpfs_bin(), "mount", src, mnt], check=False, timeout=120)
                assert r.returncode == 1, (r.returncode, r.stderr)
                assert r.stderr.startswith("ucpfs mount: ") and src in r.stderr, r.stderr
                assert ("corrupt" in r.stderr or "unsupported" in r.stderr), r.stderr
                assert not is_mounted(mnt), "a failed mount left something mounted"
            res.check(f"corrupt checkpoint '{kind}' is refused", refused)
    res.finish()


if __name__ == "__main__":
    main()
