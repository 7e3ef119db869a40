"""End-to-end: an s3:// mount with `-o allow_other` serves another user, user `nobody` (setpriv
--reuid=65534, as e2e_hostile does for local mounts), the views, and refuses what the permissions
refuse (issue 27), against a real Ceph RGW (tests/s3/rgw.sh; run under `rgw.sh exec DIR`).

A DCP checkpoint (a tiny MLP after one AdamW step) is saved into the bucket by torch's own S3 path
(FsspecWriter over s3fs). Then:
 1. A read-only mount (`--read-only`): nobody lists it and reads every view file, byte-equal to
    what root reads through it, and .ucpfs/status.json; nobody's create in it fails (EROFS).
 2. A writable mount (saves staged locally, uploaded to the bucket): its root (the staging
    directory) is root's and 0755, as a local SRC's usually is, so nobody reads the views (every
    target rank file, byte-equal to root's); a file root saves 0600 is refused to nobody
    (EACCES), one saved 0644 is served; nobody cannot create in the root or in a directory
    root made 0755; in one root made 0777 nobody's file is nobody's (owner 65534) and, after
    `ucpfs sync`, is in the bucket with its bytes.

Run by hand: tests/s3/rgw.sh exec DIR env UCPFS_BIN=build/cli/ucpfs \
    .venv/bin/python tests/e2e/s3_allow_other_test.py
"""
import os
import sys

import torch

from e2e_common import Results, as_nobody, run, tmpdir, ucpfs_bin
from mount_common import mounted
import s3_common
from s3_mount_test import view_files

LAYOUT = "tp1_pp1_dp2_zero1"

def refused(what, cmd, reason):
    p = as_nobody(*cmd)
    rc, _, err = p.returncode, p.stdout, p.stderr
    assert rc != 0 and reason in err, f"{what}: nobody was not refused ({reason}): rc {rc}, {err!r}"


def nobody_reads_equal(m, files):
    for f in files:
        p = as_nobody("cat", os.path.join(m, f))
        rc, out, err = p.returncode, p.stdout, p.stderr
        assert rc == 0, f"nobody cannot read {f}: {err}"
        with open(os.path.join(m, f), "rb") as fh:
            assert out == fh.read(), f"{f}: nobody read {len(out)} bytes, not root's"


def check_read_only(url, work):
    with mounted(url, os.path.join(work, "mnt-ro"), f"--layout={LAYOUT}", "-o", "allow_other", "--read-only",
                 "--index-dir", os.path.join(work, "index-ro")) as (m, _):
        files = view_files(m)
        assert any(f.startswith(f"target/{LAYOUT}/rank_1/") for f in files) and any(
            f.startswith("atomic/") for f in files), files[:10]
        p = as_nobody("ls", "-A", m)
        rc, out, err = p.returncode, p.stdout, p.stderr
        assert rc == 0 and b"target" in out.split(), (rc, out, err)
        nobody_reads_equal(m, files + [".ucpfs/status.json"])
        refused("create in a read-only mount", ["touch", os.path.join(m, "new")], "Read-only file system")
    print(f"read-only: nobody reads all {len(files)} view files, byte-equal to root's; its create is refused",
          flush=True)


def check_writable(url, work, fs):
    with s3_common.cache_home(os.path.join(work, "cache")), \
            mounted(url, os.path.join(work, "mnt-rw"), f"--layout={LAYOUT}", "-o", "allow_other") as (m, _):
        st = os.stat(m)
        assert (st.st_mode & 0o777, st.st_uid) == (0o755, 0), f"MNT's root: {oct(st.st_mode)} uid {st.st_uid}"
        ranks = [os.path.join("target", LAYOUT, f"rank_{r}", f) for r in (0, 1) for f in ("model.pt", "optim.pt")]
        nobody_reads_equal(m, ranks)
        torch.save({"w": torch.arange(8)}, os.path.join(m, "private.pt"))
        os.chmod(os.path.join(m, "private.pt"), 0o600)
        torch.save({"w": torch.arange(4)}, os.path.join(m, "public.pt"))
        os.chmod(os.path.join(m, "public.pt"), 0o644)
        refused("a 0600 file of root's", ["cat", os.path.join(m, "private.pt")], "Permission denied")
        nobody_reads_equal(m, ["public.pt"])
        refused("create in MNT's root (root's, 0755)", ["touch", os.path.join(m, "new")], "Permission denied")
        os.mkdir(os.path.join(m, "closed"), 0o755)
        refused("create in a directory of root's, 0755", ["touch", os.path.join(m, "closed", "new")],
                "Permission denied")
        os.mkdir(os.path.join(m, "shared"))
        os.chmod(os.path.join(m, "shared"), 0o777)
        data = os.urandom(100000)
        mine = os.path.join(m, "shared", "mine.bin")
        p = as_nobody("dd", f"of={mine}", "status=none", stdin=data)
        rc, _, err = p.returncode, p.stdout, p.stderr
        assert rc == 0, f"nobody cannot save into a 0777 directory: {err}"
        st = os.stat(mine)
        assert (st.st_uid, st.st_gid) == (65534, 65534), f"nobody's file is {st.st_uid}:{st.st_gid}"
        run([ucpfs_bin(), "sync", m])
        key = url.removeprefix("s3://") + "/shared/mine.bin"
        fs.invalidate_cache()
        assert fs.cat(key) == data, "nobody's file is not in the bucket with its bytes"
    print("writable: MNT's root 0755; nobody reads the rank files and a 0644 save, is refused a 0600 one and "
          "creates only in a 0777 directory, as its own file, uploaded", flush=True)


def main():
    assert os.environ.get("AWS_ENDPOINT_URL"), "run under tests/s3/rgw.sh exec DIR"
    res = Results("s3_allow_other")
    fs = s3_common.filesystem()
    with s3_common.temporary_bucket(fs, "ucpfs-other") as bucket, tmpdir("ucpfs_s3_other_") as work:
        url = f"s3://{bucket}/runs/step1"
        os.chmod(work, 0o755)  # let nobody reach the mount points
        model, opt = s3_common.train_tiny()
        s3_common.dcp_save_s3(s3_common.training_state(model, opt), url)
        res.check("allow_other, read-only: nobody reads every view; its writes are refused",
                  lambda: check_read_only(url, work))
        res.check("allow_other, writable: nobody reads views and public saves, is refused private ones",
                  lambda: check_writable(url, work, fs))
    res.finish()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
