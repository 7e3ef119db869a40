"""End-to-end: checkpoints in object storage mounted from s3://BUCKET/PREFIX (issue 27), against a
real Ceph RGW (tests/s3/rgw.sh; run under `rgw.sh exec DIR`, which sets the AWS variables).

 1. A DCP checkpoint saved here by torch's own dcp.save (a tiny model, one process) and the
    DeepSpeed ZeRO-2 shared fixture (ds_zero2, 2 gloo ranks) are PUT into a bucket (the tests'
    uploader, tests/s3/s3_put_tree.cc, through the project's client). Each is mounted from
    s3://bucket/prefix and from the local copy with the same --layout: every view file
    (atomic/, target/<layout>/rank_N/, safetensors/, the DeepSpeed universal folder) is equal
    byte for byte, and status.json says the mount is read-only with the object-store features
    off (--read-only: saves into a bucket mount are e2e_s3_save's).
 2. A target rank reads only about its share: the mount's source byte counter (stats.json)
    after reading rank_0 of a dp2 layout is within 10 % of what `ucpfs plan` says rank 0 reads.
 3. An object replaced under a live mount: reading a view that needs it fails with EIO (never
    other bytes), and the mount's errors name s3://bucket/key.

Run by hand: tests/s3/rgw.sh exec DIR env UCPFS_BIN=build/cli/ucpfs UCPFS_TOOLS_DIR=build/tests \
    .venv/bin/python tests/e2e/s3_mount_test.py
"""
import errno
import filecmp
import json
import os
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from e2e_common import Results, run, tmpdir, tool, ucpfs_bin
from mount_common import mounted
from shared_fixtures import fixture

LAYOUT = "tp1_pp1_dp2_zero1"  # ZeRO-1 over 2 ranks: each target rank holds half the optimizer state


def save_dcp(out):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=out)


def view_files(m):
    """Every view file under the mount (not .ucpfs/), relative paths."""
    out = []
    for top in sorted(os.listdir(m)):
        if top == ".ucpfs":
            continue
        p = os.path.join(m, top)
        if os.path.isfile(p):
            out.append(top)
            continue
        for r, _, fs in os.walk(p):
            out.extend(os.path.relpath(os.path.join(r, f), m) for f in fs)
    return sorted(out)


def views_equal(s3_mnt, local_mnt, local_src):
    # The local mount also serves the source's own files (passthrough), which an s3 mount does not.
    a = view_files(s3_mnt)
    b = [f for f in view_files(local_mnt) if not os.path.lexists(os.path.join(local_src, f))]
    assert a == b, f"view files differ: only s3 {sorted(set(a) - set(b))[:5]}, only local {sorted(set(b) - set(a))[:5]}"
    assert any(f.startswith("atomic/") for f in a) and any(f.startswith(f"target/{LAYOUT}/rank_1/") for f in a), a[:10]
    for f in a:
        assert filecmp.cmp(os.path.join(s3_mnt, f), os.path.join(local_mnt, f), shallow=False), f"{f} differs"
    return len(a)


def stats(m):
    return json.load(open(os.path.join(m, ".ucpfs", "stats.json")))


def status(m):
    return json.load(open(os.path.join(m, ".ucpfs", "status.json")))


def main():
    assert os.environ.get("AWS_ENDPOINT_URL"), "run under tests/s3/rgw.sh exec DIR"
    res = Results("s3_mount")
    bucket = f"ucpfs-mount-{os.getpid()}-{int(time.time()) % 100000}"
    with tmpdir("ucpfs_s3_mount_") as work:
        dcp_dir = os.path.join(work, "dcp")
        save_dcp(dcp_dir)
        ds_dir = fixture("ds_zero2", work)
        run([tool("s3_put_tree"), dcp_dir, f"s3://{bucket}/runs/dcp"])
        run([tool("s3_put_tree"), ds_dir, f"s3://{bucket}/runs/ds"])
        index_dir = os.path.join(work, "index")  # a private index per test run

        for name, local in (("dcp", dcp_dir), ("ds", ds_dir)):
            url = f"s3://{bucket}/runs/{name}"

            def same_views(url=url, local=local, name=name):
                with mounted(url, os.path.join(work, f"mnt-s3-{name}"), f"--layout={LAYOUT}",
                             "--index-dir", os.path.join(index_dir, name), "--read-only") as (sm, _), \
                        mounted(local, os.path.join(work, f"mnt-local-{name}"), f"--layout={LAYOUT}",
                                "--read-only") as (lm, _):
                    n = views_equal(sm, lm, local)
                    st = status(sm)
                    assert st["source"] == url, st["source"]
                    assert st["object_store"]["url"] == url and st["object_store"]["off"], st.get("object_store")
                    assert not os.access(sm, os.W_OK) or open_for_write_fails(sm), "an s3 --read-only mount must be read-only"
                    print(f"{name}: {n} view files equal the local mount's", flush=True)
            res.check(f"{name}: every view equals the local copy's", same_views)

        def rank_share():
            url = f"s3://{bucket}/runs/ds"
            plan = json.loads(run([ucpfs_bin(), "plan", url, f"--layout={LAYOUT}", "--json",
                                   "--index-dir", os.path.join(index_dir, "ds")]).stdout)
            with mounted(url, os.path.join(work, "mnt-share"), f"--layout={LAYOUT}",
                         "--index-dir", os.path.join(index_dir, "ds")) as (m, _):
                before, before_get = stats(m)["source_bytes_read"], stats(m)["s3"]["bytes_get"]
                rank = os.path.join(m, "target", LAYOUT, "rank_0")
                for f in rank0_files(plan):  # model.pt, optim.pt (model.safetensors repeats model.pt's bytes)
                    with open(os.path.join(rank, f), "rb") as fh:
                        while fh.read(1 << 20):
                            pass
                got = stats(m)["source_bytes_read"] - before
                got_get = stats(m)["s3"]["bytes_get"] - before_get  # the client's own count of GET bodies
            want = rank0_bytes(plan)
            distinct = plan["totals"]["distinct_bytes"]  # the tensor bytes of every rank together
            assert want > 0 and abs(got - want) <= 0.10 * want, f"rank 0 read {got} bytes from S3, its plan {want}"
            assert got < 0.75 * distinct, f"rank 0 read {got} bytes of the checkpoint's {distinct}"
            assert abs(got_get - want) <= 0.10 * want, f"rank 0: the client GET {got_get} bytes, its plan {want}"
            print(f"rank_0 of {LAYOUT}: {got} bytes read from S3 ({got_get} GET by the client), plan {want}, "
                  f"all ranks' {distinct}", flush=True)
        res.check("a target rank reads about its share", rank_share)

        def replaced_object():
            url = f"s3://{bucket}/runs/dcp"
            with mounted(url, os.path.join(work, "mnt-replace"), f"--layout={LAYOUT}",
                         "--index-dir", os.path.join(index_dir, "dcp")) as (m, _):
                shard = sorted(f for f in os.listdir(dcp_dir) if f.endswith(".distcp"))[0]
                other = os.path.join(work, "other.distcp")
                with open(os.path.join(dcp_dir, shard), "rb") as fh:
                    data = bytearray(fh.read())
                data[-1] ^= 0xFF  # same size, other bytes: only the ETag tells
                open(other, "wb").write(data)
                run([tool("s3_put_tree"), other, f"{url}/{shard}"])
                views = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(m, "atomic")) for f in fs]
                failed = 0
                for v in views:
                    try:
                        with open(v, "rb") as fh:
                            fh.read()
                    except OSError as e:
                        assert e.errno == errno.EIO, f"{v}: {e}"
                        failed += 1
                assert failed > 0, "no view failed after its source object was replaced"
                errors = json.dumps(stats(m).get("errors", {})) + json.dumps(status(m))
                assert f"s3://{bucket}/runs/dcp/{shard}" in errors, errors[:2000]
                print(f"replaced {shard}: {failed} of {len(views)} atomic views fail with EIO", flush=True)
        res.check("a replaced object gives EIO naming it", replaced_object)
    res.finish()


def open_for_write_fails(m):
    try:
        open(os.path.join(m, "new-file"), "wb").close()
    except OSError as e:
        return e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    return False


def rank0_bytes(plan):
    """What `ucpfs plan --json` says rank 0 reads from the source (its per-rank total)."""
    return next(r["read_bytes"] for r in plan["ranks"] if r["rank"] == 0)


def rank0_files(plan):
    return [f["name"] for r in plan["ranks"] if r["rank"] == 0 for f in r["files"]]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
