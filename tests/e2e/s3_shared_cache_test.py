"""End-to-end: two mounts of one s3:// prefix, separate processes started at the same moment,
sharing one local index directory (issue 27), against a real Ceph RGW (tests/s3/rgw.sh; run
under `rgw.sh exec DIR`).

A DCP checkpoint (a tiny MLP after one AdamW step) is saved into the bucket by torch's own S3 path
(FsspecWriter over s3fs) and downloaded once with s3fs into a local copy, which a third mount
serves as the reference. Two ways of sharing, each with a fresh directory:
 A. `--index-dir D`, D empty: both mounts find no index and build one in D at once (builders
    serialize on D's lock; the second reuses or rebuilds, never reads a half-written catalog);
 B. the bucket's index (`ucpfs index s3://...` once, kept under PREFIX/.ucpfs/), both mounts
    `--read-only-index` with one XDG_CACHE_HOME: both download the bucket's catalog into the same
    from-bucket/ copy at once.
In each, both mounts read every view file at the same time (a thread per mount, files in
opposite orders), and each file equals, byte for byte, the local copy's mount; each target rank's
model.pt and optim.pt torch.load to the live job's tensors. Afterwards the shared directory holds
catalogs whose bytes a fresh `ucpfs verify` finds current, no temporary file is left in it, and a
third mount from it reuses the index (builds nothing) and serves the same bytes.
 C. Two writable mounts (saves staged in the cache directory's .stage/) with one XDG_CACHE_HOME,
    started at once: one mounts and serves the same views; the other is refused, naming the
    staging directory another live mount uses (two uploaders of one journal would corrupt it).

Run by hand: tests/s3/rgw.sh exec DIR env UCPFS_BIN=build/cli/ucpfs \
    .venv/bin/python tests/e2e/s3_shared_cache_test.py
"""
import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import time

import torch

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import is_mounted, mounted
import s3_common
from s3_mount_test import view_files
from s3_nodes_test import check_values

LAYOUT = "tp1_pp1_dp2_zero1"


@contextlib.contextmanager
def mounted_together(stack, url, mnts, *extra):
    """Both `ucpfs mount` commands started at once, each in a thread of its own; yields the
    mount points and status.json of each. Whatever mounted is unmounted on the way out."""
    cms = [mounted(url, m, *extra) for m in mnts]
    with concurrent.futures.ThreadPoolExecutor(len(cms)) as pool:
        futures = [pool.submit(cm.__enter__) for cm in cms]
        concurrent.futures.wait(futures)
    for cm, f in zip(cms, futures):
        if f.exception() is None:
            stack.push(cm.__exit__)
    for f in futures:
        f.result()  # the first failure, now that the others will be unmounted
    yield [(m, json.load(open(os.path.join(m, ".ucpfs", "status.json")))) for m in mnts]


def read_all(m, files):
    out = {}
    for f in files:
        with open(os.path.join(m, f), "rb") as fh:
            out[f] = fh.read()
    return out


def check_pair(url, work, tag, reference, model, opt, extra, verify_extra, shared_dir):
    """Two mounts of `url` started and read at once, sharing `shared_dir`; every view file equals
    `reference` (relative path -> bytes); then the directory is checked."""
    files = sorted(reference)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        pair = stack.enter_context(mounted_together(stack, url, [os.path.join(work, f"{tag}-{i}") for i in (0, 1)],
                                                    f"--layout={LAYOUT}", *extra))
        for m, st in pair:
            assert view_files(m) == files, f"{m}: view files differ from the local copy's mount"
            assert os.path.realpath(st["index"]["dir"]).startswith(os.path.realpath(shared_dir)), \
                f"{m}: index in {st['index']['dir']}, not in the shared {shared_dir}"
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(read_all, [m for m, _ in pair], [files, files[::-1]]))
        states = [st["index"]["state"] for _, st in pair]
        for (m, _), g in zip(pair, got):
            for f in files:
                assert g[f] == reference[f], f"{m}/{f}: {len(g[f])} bytes, not the local copy's {len(reference[f])}"
        results = [(None, None, {f: torch.load(os.path.join(pair[0][0], "target", LAYOUT, f"rank_{r}", f))
                                 for f in ("model.pt", "optim.pt")}) for r in (0, 1)]
        check_values(results, model, opt)
    left = [os.path.join(r, f) for r, _, fs in os.walk(shared_dir) for f in fs if ".tmp" in f]
    assert not left, f"temporary files left in the shared directory: {left}"
    catalogs = [r for r, _, fs in os.walk(shared_dir) if "data.mdb" in fs]
    assert catalogs, f"no catalog in {shared_dir}"
    # A third process, started afterwards from the same directory: the index is there, current.
    with mounted(url, os.path.join(work, f"{tag}-after"), f"--layout={LAYOUT}", *extra) as (m, _):
        st = json.load(open(os.path.join(m, ".ucpfs", "status.json")))
        assert st["index"]["state"] == "reused", f"a third mount found no usable index: {st['index']}"
        assert read_all(m, files) == reference, "the third mount's views differ"
    v = run([ucpfs_bin(), "verify", url, "--json", "-q", "--no-atomic", *verify_extra], check=False)
    assert v.returncode == 0 and json.loads(v.stdout)["index"] == "current", v.stdout + v.stderr
    print(f"{tag}: 2 mounts at once (index {', '.join(states)}), {len(files)} view files each equal the local "
          f"copy's, {len(catalogs)} catalog(s) in the shared directory, verify current: "
          f"{time.monotonic() - t0:.1f} s", flush=True)


def check_writable_pair(url, work, reference):
    mnts = [os.path.join(work, f"rw-{i}") for i in (0, 1)]
    with s3_common.cache_home(os.path.join(work, "cache-rw")):
        for m in mnts:
            os.makedirs(m)
        procs = [subprocess.Popen([ucpfs_bin(), "mount", url, m, f"--layout={LAYOUT}", "--log", m + ".log"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for m in mnts]
        outs = [p.communicate(timeout=120) for p in procs]
    live = [m for m in mnts if is_mounted(m)]
    try:
        codes = [p.returncode for p in procs]
        assert sorted(codes) == [0, 1] and len(live) == 1, f"exit codes {codes}, mounted {live}: {outs}"
        refused = outs[codes.index(1)][1]
        assert "another live mount uses the staging directory" in refused and ".stage" in refused, refused
        files = sorted(reference)
        assert read_all(live[0], files) == reference, "the writable mount's views differ"
    finally:
        for m in live:
            run([ucpfs_bin(), "umount", m], check=False)
    print(f"writable: one mounted, the other refused: {refused.strip().splitlines()[-1][:200]}", flush=True)


def main():
    assert os.environ.get("AWS_ENDPOINT_URL"), "run under tests/s3/rgw.sh exec DIR"
    res = Results("s3_shared_cache")
    fs = s3_common.filesystem()
    with s3_common.temporary_bucket(fs, "ucpfs-shared") as bucket, tmpdir("ucpfs_s3_shared_") as work:
        url = f"s3://{bucket}/runs/step1"
        model, opt = s3_common.train_tiny()
        s3_common.dcp_save_s3(s3_common.training_state(model, opt), url)
        local = os.path.join(work, "local")
        fs.get(url.removeprefix("s3://") + "/", local, recursive=True)
        with mounted(local, os.path.join(work, "mnt-local"), f"--layout={LAYOUT}", "--read-only",
                     "--index-dir", os.path.join(work, "index-local")) as (lm, _):
            reference = read_all(lm, [f for f in view_files(lm) if not os.path.lexists(os.path.join(local, f))])
        assert any(f.startswith(f"target/{LAYOUT}/rank_1/") for f in reference), sorted(reference)[:10]

        shared_index = os.path.join(work, "shared-index")
        res.check("two mounts building one --index-dir at once serve the checkpoint's views",
                  lambda: check_pair(url, work, "index-dir", reference, model, opt,
                                     ["--read-only", "--index-dir", shared_index], ["--index-dir", shared_index],
                                     shared_index))

        def bucket_index():
            with s3_common.cache_home(os.path.join(work, "cache-builder")):
                run([ucpfs_bin(), "index", url, "-q"])
            with s3_common.cache_home(os.path.join(work, "shared-cache")) as cache:
                check_pair(url, work, "bucket-index", reference, model, opt, ["--read-only-index"], [], cache)
        res.check("two mounts fetching the bucket's index into one cache at once serve the checkpoint's views",
                  bucket_index)
        res.check("a second writable mount sharing the staging directory is refused",
                  lambda: check_writable_pair(url, work, reference))
    res.finish()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
