"""End-to-end: saves into an s3://BUCKET/PREFIX mount land in the bucket, in close order, and
survive kill -9 (issue 27 item 4), against a real Ceph RGW (tests/s3/rgw.sh; run under
`rgw.sh exec DIR`, which sets the AWS variables).

A DCP checkpoint saved by torch's own dcp.save (FileSystemWriter with two writer threads, so two
shards of about 12 MiB each: multipart uploads) and a torch.save file are saved into the mount of
an empty prefix, and the same into a local directory. The bucket is read back with botocore (the
AWS SDK's core, from the venv) and a bucket policy (RGW enforces it, the owner included) makes
chosen uploads fail.

 A. Plain save: after `ucpfs sync`, the objects are exactly the saved files (no `.metadata.tmp`
    left), the shards and the torch.save file byte-equal the local save's, `.metadata` byte-equals
    what the mount holds and describes the same tensors as the local one; the objects downloaded
    load with dcp.load (strict) and torch.load into the saved values; the large shards went up
    as multipart uploads; a poller listing the bucket all along never saw `.metadata` without
    every shard; the views appear from the bucket (atomic/<param>/fp32.pt equals the parameter);
    umount exits 0 and leaves no staged file.
 B. Order under failure: PUTs of one shard are denied. `.metadata`, closed after it, never
    reaches the bucket while it fails; stats.json names the failing object; once the policy is
    lifted everything lands and `ucpfs sync` returns.
 D. Staged copies leave (--stage-keep 1): after `ucpfs sync` of a save, its staged copies leave
    the staging directory within seconds (their emptied directories at the unmount: the kernel
    holds them) (stats.json counts them, no
    bytes staged, none held by the daemon's descriptors of the removed files) while the objects stay byte-equal; a file saved, then held open for reading
    while it is uploaded, closed and renamed 0.8 s later keeps its staged copy until the rename
    (kept 1 s after its last close); a removed name reads the object from the bucket and its rename
    fails with EXDEV; a second save into the same
    prefix lands whole (DCP's `.metadata.tmp` renamed right after its close).
 F. An emptied directory stays while held: step/a.bin saved and uploaded, its copy removed
    (--stage-keep 1); step/ stays in the staging directory while the kernel holds it, and a file
    created in it through a descriptor taken before lands in the bucket; the unmount removes it.
 E. Streaming: a 45 MiB file written through the mount and held open has its full parts but the
    last in the bucket's multipart upload (listed, each part's ETag the MD5 of the written bytes)
    and no object yet; a rewrite of its first bytes sends that part again at close; after sync the
    object byte-equals the final bytes and no upload is open. A daemon killed while streaming
    leaves its upload open; the next mount aborts it, and the file never closed never shows.
 C. kill -9: every PUT under the prefix is denied, the save returns, the daemon is killed at once
    (uploads not done, commits perhaps in flight); nothing is in the bucket. The policy is lifted
    and the prefix mounted again with the same --stage-dir: every object lands byte-equal, and no
    multipart upload is left open under the prefix.

Run by hand: tests/s3/rgw.sh exec DIR env UCPFS_BIN=build/cli/ucpfs UCPFS_TOOLS_DIR=build/tests \
    .venv/bin/python tests/e2e/s3_save_test.py
"""
import errno
import hashlib
import json
import os
import stat
import signal
import subprocess
import sys
import threading
import time

import botocore.session
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import daemon_alive, is_mounted, mounted, stats, status

SHARDS = ["__0_0.distcp", "__0_1.distcp"]


def s3():
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name=os.environ.get("AWS_REGION", "us-east-1"))


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(1024, 3072), torch.nn.ReLU(), torch.nn.Linear(3072, 1024))


def save(dst, seed=0):
    """A torch.save file under extra/, then a DCP save (two writer threads: two shards)."""
    model = make_model(seed)
    os.makedirs(os.path.join(dst, "extra"), exist_ok=True)
    torch.manual_seed(seed + 1)
    torch.save({"w": torch.randn(300, 200), "step": 7}, os.path.join(dst, "extra", "model.pt"))
    dcp.save({"model": model.state_dict()}, storage_writer=FileSystemWriter(dst, thread_count=2))
    return model


def local_files(root):
    out = []
    for r, _, fs in os.walk(root):
        out.extend(os.path.relpath(os.path.join(r, f), root) for f in fs)
    return sorted(out)


def objects(c, bucket, prefix):
    keys = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys.extend(o["Key"][len(prefix) + 1:] for o in page.get("Contents", []))
    return sorted(keys)


def body(c, bucket, key):
    return c.get_object(Bucket=bucket, Key=key)["Body"].read()


def deny_puts(c, bucket, resource):
    c.put_bucket_policy(Bucket=bucket, Policy=json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Deny", "Principal": "*", "Action": "s3:PutObject",
                       "Resource": f"arn:aws:s3:::{bucket}/{resource}"}]}))


def wait_for(what, fn, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def check_same_as_local(c, bucket, prefix, local, mnt=None):
    """Every saved file is an object, nothing else; shards and torch.save file byte-equal the local
    save; .metadata byte-equals the mount's (its save id differs from the local save's) and
    describes the same tensors."""
    want = local_files(local)
    got = objects(c, bucket, prefix)
    assert got == want, f"objects {got} != saved files {want}"
    for rel in want:
        if rel == ".metadata":
            continue
        with open(os.path.join(local, rel), "rb") as f:
            assert body(c, bucket, f"{prefix}/{rel}") == f.read(), f"s3://{bucket}/{prefix}/{rel} differs from the local save"
    meta = body(c, bucket, f"{prefix}/.metadata")
    if mnt is not None:
        with open(os.path.join(mnt, ".metadata"), "rb") as f:
            assert meta == f.read(), ".metadata in the bucket differs from the file saved into the mount"
    return meta


def load_from_bucket(c, bucket, prefix, work, model):
    """Downloads the objects and loads them with dcp.load (strict) and torch.load."""
    d = os.path.join(work, "download-" + prefix)
    for rel in objects(c, bucket, prefix):
        p = os.path.join(d, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(body(c, bucket, f"{prefix}/{rel}"))
    fresh = make_model(99)
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, storage_reader=FileSystemReader(d))
    fresh.load_state_dict(sd["model"], strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), f"{k} loaded from the bucket differs"
    extra = torch.load(os.path.join(d, "extra", "model.pt"), weights_only=True)
    torch.manual_seed(1)
    assert torch.equal(extra["w"], torch.randn(300, 200)) and extra["step"] == 7
    return d


def main():
    res = Results("s3_save")
    bucket = f"ucpfs-save-{os.getpid()}-{int(time.time()) % 100000}"
    c = s3()
    c.create_bucket(Bucket=bucket)
    with tmpdir("ucpfs-s3-save-") as work:
        local = os.path.join(work, "local")
        model = save(local)
        local_meta = FileSystemReader(local).read_metadata().state_dict_metadata

        def plain_save():
            prefix, mnt, stage = "a", os.path.join(work, "mnt-a"), os.path.join(work, "stage-a")
            seen, stop = [], threading.Event()

            def poll():  # every listing: .metadata only with every shard
                pc = s3()
                while not stop.is_set():
                    keys = set(objects(pc, bucket, prefix))
                    seen.append(keys)
                    assert ".metadata" not in keys or set(SHARDS) <= keys, f".metadata listed before the shards: {keys}"
            poller_error = []

            def poll_safe():
                try:
                    poll()
                except Exception as e:  # noqa: BLE001 - reported below
                    poller_error.append(e)
            poller = threading.Thread(target=poll_safe)
            poller.start()
            try:
                with mounted(f"s3://{bucket}/{prefix}", mnt, "--stage-dir", stage,
                             "--index-dir", os.path.join(work, "index-a"), "--cache-size", "64M") as (m, _):
                    st = status(m)["object_store"]
                    assert st["stage_dir"] == stage and not st["off"], st
                    save(m)
                    run([ucpfs_bin(), "sync", m, "-q"])
                    stop.set()
                    poller.join()
                    assert not poller_error, poller_error[0]
                    meta = check_same_as_local(c, bucket, prefix, local, m)
                    import pickle
                    got_meta = pickle.loads(meta).state_dict_metadata  # noqa: S301 - our own test's save
                    assert got_meta.keys() == local_meta.keys(), "the .metadata uploaded describes other tensors"
                    for s in SHARDS:  # > 8 MiB: multipart (the ETag of a multipart object ends in -<parts>)
                        etag = c.head_object(Bucket=bucket, Key=f"{prefix}/{s}")["ETag"]
                        assert etag.strip('"').endswith("-2"), f"{s}: ETag {etag}: not a 2-part multipart upload"
                    up = stats(m)["s3"]["upload"]
                    assert up["queued_files"] == 0 and up["uploaded_files"] >= len(local_files(local)), up
                    load_from_bucket(c, bucket, prefix, work, model)
                    # The views, indexed again from the bucket.
                    atomic = os.path.join(m, "atomic")
                    wait_for("atomic/ from the bucket", lambda: os.path.isdir(atomic) and os.listdir(atomic))
                    for k, v in model.state_dict().items():
                        got = torch.load(os.path.join(atomic, k, "fp32.pt"), weights_only=True)["param"]
                        assert torch.equal(got, v.float()), f"atomic/{k} differs"
                    print(f"A: {len(seen)} listings during the save; {len(objects(c, bucket, prefix))} objects "
                          f"byte-equal; views of {len(os.listdir(atomic))} parameters", flush=True)
                    r = run([ucpfs_bin(), "umount", m], check=False)
                    assert r.returncode == 0, f"umount exited {r.returncode}: {r.stderr}"
                left = [f for f in local_files(stage) if not f.startswith(".ucpfs/")]
                assert left == [], f"staged copies left after unmount: {left}"
            finally:
                stop.set()
                poller.join()
        res.check("A: a save lands whole, byte-equal, loadable, viewable", plain_save)

        def order_under_failure():
            prefix, mnt, stage = "b", os.path.join(work, "mnt-b"), os.path.join(work, "stage-b")
            blocked = SHARDS[1]
            deny_puts(c, bucket, f"{prefix}/{blocked}")
            try:
                with mounted(f"s3://{bucket}/{prefix}", mnt, "--stage-dir", stage,
                             "--index-dir", os.path.join(work, "index-b"), "--cache-size", "64M") as (m, _):
                    save(m)
                    failing = wait_for("the upload to fail", lambda: stats(m)["s3"]["upload"]["failing"])
                    assert f"s3://{bucket}/{prefix}/{blocked}" in json.dumps(stats(m)["s3"]["upload"]), failing
                    for _ in range(20):  # 2 s of retries: never .metadata, never the blocked shard
                        keys = objects(c, bucket, prefix)
                        assert ".metadata" not in keys and blocked not in keys, f"uploaded past a failing shard: {keys}"
                        time.sleep(0.1)
                    print(f"B: while {blocked} fails the bucket holds {keys}", flush=True)
                    c.delete_bucket_policy(Bucket=bucket)
                    run([ucpfs_bin(), "sync", m, "-q"], timeout=120)
                    check_same_as_local(c, bucket, prefix, local, m)
            finally:
                c.delete_bucket_policy(Bucket=bucket)
        res.check("B: nothing after a failing shard is uploaded before it", order_under_failure)

        def staged_copies_leave():
            prefix, mnt, stage = "d", os.path.join(work, "mnt-d"), os.path.join(work, "stage-d")
            t_start = time.monotonic()

            def staged(dirs=False):  # files (and directories) in the staging directory but its state
                return sorted(os.path.relpath(os.path.join(r, n), stage) for r, ds, fs in os.walk(stage)
                              for n in (ds + fs if dirs else fs)
                              if not os.path.relpath(os.path.join(r, n), stage).startswith(".ucpfs"))
            with mounted(f"s3://{bucket}/{prefix}", mnt, "--stage-dir", stage, "--stage-keep", "1",
                         "--index-dir", os.path.join(work, "index-d"), "--cache-size", "64M") as (m, _):
                save(m)
                run([ucpfs_bin(), "sync", m, "-q"])
                t0 = time.monotonic()
                wait_for("the staged copies to leave", lambda: staged() == [], 10)
                gone_s = time.monotonic() - t0
                # The mount lets go of the removed copies (their nodes' descriptors and the
                # capture's) right after the uploader removed them: no deleted file stays held
                # (a removed directory's node keeps its O_PATH until the kernel forgets it: no bytes).
                pid = status(m)["daemon_pid"]

                def held():
                    out = []
                    for fd in os.listdir(f"/proc/{pid}/fd"):
                        try:
                            target = os.readlink(f"/proc/{pid}/fd/{fd}")
                            st = os.stat(f"/proc/{pid}/fd/{fd}")
                            if target.endswith(" (deleted)") and stat.S_ISREG(st.st_mode):
                                out.append((target, st.st_size))
                        except OSError:
                            continue
                    return out
                try:
                    wait_for("the removed copies to be let go", lambda: not held(), 5)
                except AssertionError:
                    raise AssertionError(f"removed staged copies still held: {held()}") from None
                check_same_as_local(c, bucket, prefix, local)
                up = stats(m)["s3"]["upload"]
                assert up["staged_bytes"] == 0 and up["removed_files"] >= len(local_files(local)), up
                line = [ln for ln in run([ucpfs_bin(), "status", m]).stdout.splitlines() if ln.startswith("uploads:")]
                assert line and " staged in " in line[0] and "copies removed" in line[0], line
                for i in range(2):  # saved, read for 1.5 s (uploaded meanwhile), renamed 0.8 s after that close
                    tmp, final = os.path.join(m, f"probe{i}.tmp"), os.path.join(m, f"probe{i}")
                    with open(tmp, "wb") as f:
                        f.write(b"x" * 1000)
                    with open(tmp, "rb") as f:
                        time.sleep(1.5)
                        assert f.read() == b"x" * 1000
                    time.sleep(0.8)
                    os.rename(tmp, final)  # FileNotFoundError if the copy was removed too early
                    os.unlink(final)
                # The staged copy is gone: the name is the bucket's object now, which is not
                # renamed in place (EXDEV: mv copies, then unlinks).
                with open(os.path.join(m, SHARDS[0]), "rb") as f, open(os.path.join(local, SHARDS[0]), "rb") as g:
                    assert f.read() == g.read(), f"{SHARDS[0]} read from the bucket through the mount differs"
                try:
                    os.rename(os.path.join(m, SHARDS[0]), os.path.join(m, "moved"))
                    raise AssertionError("a rename of an object in the bucket succeeded")
                except OSError as e:
                    assert e.errno == errno.EXDEV, e
                save(m)  # again, into the same prefix: DCP renames .metadata.tmp right after its close
                run([ucpfs_bin(), "sync", m, "-q"])
                check_same_as_local(c, bucket, prefix, local, m)
                wait_for("the second save's staged copies to leave", lambda: staged() == [], 10)
                print(f"D: staged copies gone {gone_s:.1f} s after sync; "
                      f"{stats(m)['s3']['upload']['removed_files']} removed in all; D took "
                      f"{time.monotonic() - t_start:.1f} s", flush=True)
            # Emptied directories the kernel held (extra/) stayed while mounted; the unmount removes them.
            assert staged(dirs=True) == [], staged(dirs=True)
        res.check("D: uploaded staged copies leave after --stage-keep, saves still land", staged_copies_leave)

        def emptied_dir_stays():
            """F: a step directory whose staged copies left stays while the kernel holds it: a file
            created in it through a descriptor of it taken before (no lookup, so no chance to make
            it again) lands; the unmount removes the emptied directory."""
            prefix, mnt, stage = "f", os.path.join(work, "mnt-f"), os.path.join(work, "stage-f")
            with mounted(f"s3://{bucket}/{prefix}", mnt, "--stage-dir", stage, "--stage-keep", "1",
                         "--index-dir", os.path.join(work, "index-f")) as (m, _):
                os.mkdir(os.path.join(m, "step"))
                first, second = os.urandom(3000), os.urandom(5000)
                with open(os.path.join(m, "step", "a.bin"), "wb") as f:
                    f.write(first)
                dir_fd = os.open(os.path.join(m, "step"), os.O_RDONLY | os.O_DIRECTORY)
                try:
                    run([ucpfs_bin(), "sync", m, "-q"])
                    wait_for("step/a.bin's staged copy to leave",
                             lambda: not os.path.exists(os.path.join(stage, "step", "a.bin")), 10)
                    time.sleep(1.5)  # another pass of the uploader's removals
                    assert os.path.isdir(os.path.join(stage, "step")), "the emptied step/ was removed while held"
                    fd = os.open("b.bin", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644, dir_fd=dir_fd)
                    with os.fdopen(fd, "wb") as f:
                        f.write(second)
                finally:
                    os.close(dir_fd)
                run([ucpfs_bin(), "sync", m, "-q"])
                assert objects(c, bucket, prefix) == ["step/a.bin", "step/b.bin"], objects(c, bucket, prefix)
                assert body(c, bucket, f"{prefix}/step/a.bin") == first
                assert body(c, bucket, f"{prefix}/step/b.bin") == second
            left = [os.path.join(r, n) for r, ds, fs in os.walk(stage) for n in ds + fs
                    if not os.path.relpath(os.path.join(r, n), stage).startswith(".ucpfs")]
            assert left == [], left
        res.check("F: an emptied step directory the kernel holds stays; a create in it lands", emptied_dir_stays)

        def kill9():
            prefix, mnt, stage = "c", os.path.join(work, "mnt-c"), os.path.join(work, "stage-c")
            index = os.path.join(work, "index-c")
            url = f"s3://{bucket}/{prefix}"
            deny_puts(c, bucket, f"{prefix}/*")
            os.makedirs(mnt, exist_ok=True)
            log = mnt + ".log"
            try:
                run([ucpfs_bin(), "mount", url, mnt, "--stage-dir", stage, "--index-dir", index, "--log", log,
                     "--cache-size", "64M"], timeout=120)
                pid = status(mnt)["daemon_pid"]
                save(mnt)
                os.kill(pid, signal.SIGKILL)
                wait_for("the daemon to die", lambda: not daemon_alive(pid), 10)
                subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
                assert objects(c, bucket, prefix) == [], "objects landed while every PUT was denied"
                c.delete_bucket_policy(Bucket=bucket)
                with mounted(url, mnt, "--stage-dir", stage, "--index-dir", index, "--cache-size", "64M") as (m, _):
                    run([ucpfs_bin(), "sync", m, "-q"], timeout=120)
                    check_same_as_local(c, bucket, prefix, local)
                    load_from_bucket(c, bucket, prefix, work, model)
                    open_uploads = c.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
                    assert open_uploads == [], f"multipart uploads left open: {open_uploads}"
                    requeued = open(m + ".log").read().count("queued by an earlier mount")
                    print(f"C: after kill -9, {requeued} item(s) queued again; every object landed", flush=True)
            finally:
                try:
                    c.delete_bucket_policy(Bucket=bucket)
                except Exception:  # noqa: BLE001 - already lifted
                    pass
                if is_mounted(mnt):
                    subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
        res.check("C: kill -9 right after the save, remount: every object lands", kill9)

        def streamed():
            prefix, mnt, stage = "e", os.path.join(work, "mnt-e"), os.path.join(work, "stage-e")
            index = os.path.join(work, "index-e")
            url, part = f"s3://{bucket}/{prefix}", 8 << 20
            data = bytearray(os.urandom(45 << 20))

            def open_upload(name):
                ups = [u for u in c.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads", [])
                       if u["Key"] == f"{prefix}/{name}"]
                return ups[0]["UploadId"] if ups else None

            def listed_parts(name):
                upload_id = open_upload(name)
                if upload_id is None:
                    return []
                return c.list_parts(Bucket=bucket, Key=f"{prefix}/{name}", UploadId=upload_id).get("Parts", [])
            with mounted(url, mnt, "--stage-dir", stage, "--index-dir", index, "--cache-size", "64M") as (m, _):
                with open(os.path.join(m, "big.dat"), "wb") as f:
                    for i in range(0, len(data), 1 << 20):
                        f.write(data[i:i + (1 << 20)])
                    f.flush()
                    # Still open: the full parts but the last are in the bucket's multipart upload,
                    # each byte-equal (RGW's part ETag is the part's MD5); no object shows yet.
                    parts = wait_for("4 parts sent while the file is open", lambda: (
                        p if len(p := listed_parts("big.dat")) >= 4 else None))
                    for p in parts:
                        n = p["PartNumber"]
                        want = hashlib.md5(bytes(data[(n - 1) * part:n * part])).hexdigest()  # noqa: S324 - S3's part ETag
                        assert p["ETag"].strip('"') == want and p["Size"] == part, (p, want)
                    assert "big.dat" not in objects(c, bucket, prefix), "the object showed before its close"
                    # Rewritten after its part was sent: that part goes again at close.
                    data[100:200] = os.urandom(100)
                    f.seek(100)
                    f.write(data[100:200])
                t0 = time.monotonic()
                run([ucpfs_bin(), "sync", m, "-q"])
                sync_s = time.monotonic() - t0
                assert body(c, bucket, f"{prefix}/big.dat") == bytes(data), "the streamed object differs"
                assert open_upload("big.dat") is None, "its multipart upload is still open"
                first_pid = status(m)["daemon_pid"]
                got = stats(m)["s3"]["upload"]["streamed"]
                # The rewritten part went twice: streamed again, or stale at close and sent then.
                assert got["parts_taken"] >= 3 and got["parts_sent"] + got["parts_stale"] >= 5, got
                assert got["uploads_open"] == 0 and got["files"] == 0, got
                out = run([ucpfs_bin(), "status", m]).stdout
                assert f"  streamed:  {got['parts_sent']} parts" in out and "  read-ahead: " in out, out
            # kill -9 while a file is streamed: its upload is aborted by the next mount, and the
            # file, never closed, never shows in the bucket.
            wait_for("the first daemon to exit (it holds the stage's journal)", lambda: not daemon_alive(first_pid), 30)
            os.makedirs(mnt, exist_ok=True)
            log = mnt + ".log"
            run([ucpfs_bin(), "mount", url, mnt, "--stage-dir", stage, "--index-dir", index, "--log", log,
                 "--cache-size", "64M"], timeout=120)
            try:
                pid = status(mnt)["daemon_pid"]
                f = open(os.path.join(mnt, "torn.dat"), "wb")
                f.write(bytes(data[:30 << 20]))
                f.flush()
                wait_for("a part of torn.dat sent", lambda: listed_parts("torn.dat"))
                os.kill(pid, signal.SIGKILL)
                wait_for("the daemon to die", lambda: not daemon_alive(pid), 10)
                try:
                    f.close()
                except OSError:
                    pass
                subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
                assert open_upload("torn.dat") is not None, "nothing left to abort: the check proves nothing"
                with mounted(url, mnt, "--stage-dir", stage, "--index-dir", index, "--cache-size", "64M") as (m, _):
                    run([ucpfs_bin(), "sync", m, "-q"], timeout=120)
                    assert open_upload("torn.dat") is None, "the killed daemon's streamed upload is still open"
                    assert "torn.dat" not in objects(c, bucket, prefix), "a file never closed reached the bucket"
                    assert body(c, bucket, f"{prefix}/big.dat")[:100] == bytes(data[:100])
            finally:
                if is_mounted(mnt):
                    subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
            print(f"E: {len(parts)} parts in the bucket before close, byte-equal; sync after close "
                  f"{sync_s:.2f} s; a killed daemon's streamed upload aborted at the next mount", flush=True)
        res.check("E: full parts stream to the bucket while the file is written", streamed)
    # The store keeps objects in memory (memstore): leave it as found for the tests after this one.
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            c.delete_object(Bucket=bucket, Key=o["Key"])
    for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        c.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    c.delete_bucket(Bucket=bucket)
    res.finish()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
