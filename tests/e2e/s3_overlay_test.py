"""End-to-end: the read-write area of an s3://BUCKET/PREFIX mount shows the bucket's objects
beside the staged files (issue 27; fs/bucket_files.h), against a real Ceph RGW (tests/s3/rgw.sh;
run under `rgw.sh exec DIR`).

A DCP checkpoint (a small MLP after one AdamW step) is saved into the bucket by torch's own S3
path (dcp.save through FsspecWriter over s3fs), plus a `latest` object and `extra/notes.txt`
(s3fs), and the prefix is mounted writable (--stage-dir):
 - the read-write names at MNT (inodes of the source, not the views') are the bucket's listing
   under the prefix (its `.ucpfs/` aside), and so is `extra/`;
 - a 64 KiB read in the middle of the shard (readahead off: POSIX_FADV_RANDOM) GETs only that
   range (stats.json s3.object_bytes_get);
 - every object read through MNT equals its GET bytes, with its size and Last-Modified (pages
   read once stay cached for the inode, as a view's do);
 - an object replaced in the bucket behind an open file reads as EIO, named in stats.json errors;
 - rename of an object: EXDEV; an in-place write (no O_TRUNC): EPERM; rmdir of a directory
   holding objects: ENOTEMPTY; each refusal names the file in stats.json;
 - an O_TRUNC rewrite of an object lands in the bucket; unlink removes the object (gone from MNT
   at once, from the bucket after `ucpfs sync`), and not before a file closed just before it
   (a poller never lists the bucket without both);
 - a new dcp.save into MNT lands with `.metadata` never listed before its shards, and loads.

Run by hand: tests/s3/rgw.sh exec DIR env UCPFS_BIN=build/cli/ucpfs \
    .venv/bin/python tests/e2e/s3_overlay_test.py
"""
import contextlib
import errno
import os
import threading
import time

import botocore.session
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import mounted, stats
import s3_common

SOURCE_INO_BIT = 1 << 62  # fs/passthrough.h kPassthroughBit: the read-write area's inodes


def client():
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name=os.environ.get("AWS_REGION", "us-east-1"))


def listing(c, bucket, prefix):
    """{name: "file"|"dir"} directly under prefix/ (ListObjectsV2, delimiter '/')."""
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/", Delimiter="/"):
        out.update({o["Key"][len(prefix) + 1:]: "file" for o in page.get("Contents", [])})
        out.update({p["Prefix"][len(prefix) + 1:-1]: "dir" for p in page.get("CommonPrefixes", [])})
    out.pop(".ucpfs", None)  # the index kept in the bucket: shadowed by the mount's own .ucpfs/
    return out


def keys(c, bucket, prefix):
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        out.update({o["Key"][len(prefix) + 1:]: o for o in page.get("Contents", [])})
    return {k: o for k, o in out.items() if not k.startswith(".ucpfs/")}


def source_names(d):
    return {n for n in os.listdir(d) if os.lstat(os.path.join(d, n)).st_ino & SOURCE_INO_BIT}


def object_get_bytes(m, key):
    return sum(n for name, n in stats(m)["s3"]["object_bytes_get"].items() if name.endswith("/" + key))


def expect_errno(want, fn, what):
    try:
        fn()
    except OSError as e:
        assert e.errno == want, f"{what}: {e} (want {errno.errorcode[want]})"
        return
    raise AssertionError(f"{what} succeeded (want {errno.errorcode[want]})")


def logged(m, name):
    return any(name in line for line in stats(m)["errors"]["last"])


@contextlib.contextmanager
def polling(bucket, prefix):
    """Lists the objects under prefix/ all along (another client); yields the listings seen."""
    seen, stop, errors = [], threading.Event(), []

    def poll():
        pc = client()
        try:
            while not stop.is_set():
                seen.append(set(keys(pc, bucket, prefix)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        yield seen
    finally:
        stop.set()
        poller.join()
    assert not errors, errors[0]
    seen.append(set(keys(client(), bucket, prefix)))


def main():
    res = Results("s3_overlay")
    c = client()
    bucket, prefix = f"ucpfs-overlay-{os.getpid()}-{int(time.time()) % 100000}", "run/step-1"
    c.create_bucket(Bucket=bucket)
    fs = s3_common.filesystem()
    model, opt = s3_common.train_tiny(sizes=(512, 1024, 256))
    s3_common.dcp_save_s3(s3_common.training_state(model, opt), f"s3://{bucket}/{prefix}")
    fs.pipe(f"{bucket}/{prefix}/latest", b"step-1\n")
    fs.pipe(f"{bucket}/{prefix}/extra/notes.txt", b"notes " * 1000)
    fs.pipe(f"{bucket}/{prefix}/replaced.bin", b"v1" * 1000)  # replaced behind the mount, never read before
    objs = keys(c, bucket, prefix)
    shard = max((k for k in objs if k.endswith(".distcp")), key=lambda k: objs[k]["Size"])
    assert objs[shard]["Size"] > 4 << 20, f"{shard}: {objs[shard]['Size']} bytes: too small to read part of"

    with tmpdir("ucpfs-s3-overlay-") as work, \
            mounted(f"s3://{bucket}/{prefix}", os.path.join(work, "mnt"), "--stage-dir", os.path.join(work, "stage"),
                    "--index-dir", os.path.join(work, "index"), "--cache-size", "64M") as (m, _):

        def names():
            want = listing(c, bucket, prefix)
            got = source_names(m)
            assert got == set(want), f"MNT's read-write names {sorted(got)} != the bucket's {sorted(want)}"
            for n, kind in want.items():
                assert os.path.isdir(os.path.join(m, n)) == (kind == "dir"), f"{n}: not a {kind}"
            assert sorted(os.listdir(os.path.join(m, "extra"))) == sorted(listing(c, bucket, prefix + "/extra"))
        res.check("MNT lists the bucket's objects under the prefix", names)

        def partial_read():
            size = objs[shard]["Size"]
            offset, n = (size // 2) & ~4095, 64 << 10
            before = object_get_bytes(m, shard)
            fd = os.open(os.path.join(m, shard), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                got = os.pread(fd, n, offset)
            finally:
                os.close(fd)
            want = c.get_object(Bucket=bucket, Key=f"{prefix}/{shard}", Range=f"bytes={offset}-{offset + n - 1}")
            assert got == want["Body"].read(), f"{shard}: bytes at {offset} differ from a ranged GET"
            fetched = object_get_bytes(m, shard) - before
            assert n <= fetched <= n + 8192, f"{shard}: a {n}-byte read GET {fetched} of its {size} bytes"
            print(f"partial read: {n} bytes of {shard} ({size} bytes) GET {fetched}", flush=True)
        res.check("a partial read GETs only its range", partial_read)

        def every_object():
            for rel, o in objs.items():
                if rel == "replaced.bin":
                    continue
                path = os.path.join(m, rel)
                st = os.stat(path)
                assert st.st_size == o["Size"], f"{rel}: size {st.st_size} != {o['Size']}"
                assert int(st.st_mtime) == int(o["LastModified"].timestamp()), f"{rel}: mtime differs"
                with open(path, "rb") as f:
                    assert f.read() == c.get_object(Bucket=bucket, Key=f"{prefix}/{rel}")["Body"].read(), rel
        res.check("every object reads through MNT as its GET bytes", every_object)

        def refusals():
            expect_errno(errno.EXDEV, lambda: os.rename(os.path.join(m, shard), os.path.join(m, "moved")),
                         "rename of an object")
            assert logged(m, shard), "the refused rename is not named in stats.json errors"
            expect_errno(errno.EPERM, lambda: open(os.path.join(m, "latest"), "r+b"), "an in-place write")
            expect_errno(errno.ENOTEMPTY, lambda: os.rmdir(os.path.join(m, "extra")), "rmdir of extra/")
            assert "moved" not in os.listdir(m) and shard in os.listdir(m)
        res.check("rename EXDEV, in-place write EPERM, rmdir ENOTEMPTY", refusals)

        def replaced():
            fd = os.open(os.path.join(m, "replaced.bin"), os.O_RDONLY)
            try:
                c.put_object(Bucket=bucket, Key=f"{prefix}/replaced.bin", Body=b"v2" * 1000)
                expect_errno(errno.EIO, lambda: os.pread(fd, 100, 0), "a read of a replaced object")
            finally:
                os.close(fd)
            assert logged(m, "replaced.bin"), "the replaced object is not named in stats.json errors"
        res.check("an object replaced in the bucket reads as EIO", replaced)

        def changes():
            data = os.urandom(12 << 20)  # a multipart upload
            with polling(bucket, prefix) as seen:
                with open(os.path.join(m, "extra", "notes.txt"), "wb") as f:  # O_TRUNC: staged, uploaded over it
                    f.write(b"rewritten")
                with open(os.path.join(m, "new.bin"), "wb") as f:
                    f.write(data)
                os.unlink(os.path.join(m, "latest"))  # right after the close: deleted after new.bin lands
                assert "latest" not in os.listdir(m), "an unlinked object is still listed"
                run([ucpfs_bin(), "sync", m, "-q"])
            now = keys(c, bucket, prefix)
            assert "latest" not in now, "unlink did not delete the object"
            assert all("latest" in s or "new.bin" in s for s in seen), "latest was deleted before new.bin landed"
            assert c.get_object(Bucket=bucket, Key=f"{prefix}/new.bin")["Body"].read() == data
            assert c.get_object(Bucket=bucket, Key=f"{prefix}/extra/notes.txt")["Body"].read() == b"rewritten"
            with open(os.path.join(m, "extra", "notes.txt"), "rb") as f:
                assert f.read() == b"rewritten"
            assert "latest" not in os.listdir(m)
            print(f"changes: {len(seen)} listings polled", flush=True)
        res.check("an O_TRUNC rewrite lands, unlink deletes the object after the save before it", changes)

        def new_save():
            state = s3_common.training_state(model, opt)
            with polling(bucket, prefix + "/step-2") as seen:
                dcp.save(state, storage_writer=FileSystemWriter(os.path.join(m, "step-2"), thread_count=2))
                run([ucpfs_bin(), "sync", m, "-q"])
            got = set(keys(c, bucket, prefix + "/step-2"))
            shards = {k for k in got if k.endswith(".distcp")}
            assert ".metadata" in got and len(shards) == 2, got
            assert all(".metadata" not in s or shards <= s for s in seen), ".metadata listed before its shards"
            fresh, fresh_opt = s3_common.train_tiny(seed=5, sizes=(512, 1024, 256))
            loaded = s3_common.training_state(fresh, fresh_opt)
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(os.path.join(m, "step-2")))
            for k, v in state["model"].items():
                assert torch.equal(loaded["model"][k], v), k
        res.check("a new dcp.save into MNT lands in order and loads", new_save)

    s3_common.remove_bucket(fs, bucket)
    res.finish()


if __name__ == "__main__":
    main()
