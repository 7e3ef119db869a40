"""End-to-end: ucpfs through mount(8), as sshfs users mount: `mount -t fuse.ucpfs SRC MNT -o ...`,
an fstab line (`mount -T FILE MNT`), plain `umount`, and `ucpfs status` of such mounts.

Real util-linux mount(8), real FUSE, a real torch DCP save (fixtures/gen_dcp113_llama.py). mount(8)
finds its helper only in /sbin: the test points /sbin/mount.fuse.ucpfs at UCPFS_BIN for its
duration (needs root) and puts back what was there (nothing, or an installed link) afterwards.

- `-o layout=tp2_pp1_dp1,cache_size=64M,ro`: mountinfo says fuse.ucpfs, source SRC, ro; an atomic
  view's tensor equals what torch saved; creating a file is EROFS; status: no write cache, the
  given layout, index built (schema), a layout built on lookup (`ls target/tp4_pp1_dp1`) listed by
  name, view reads and bytes counted, a bad layout looked up counted as an error naming it.
- fstab line (rw, cache_size=3G, nofail) with `mount -T`: status shows the 3 GiB cache and the
  index reused; a file written through the mount is, after a plain `umount` and the daemon's exit
  (it drains its cache, then exits), byte for byte in SRC.
- a misspelt option is refused by the helper with a message naming it; nothing is mounted.
"""
import contextlib
import json
import os
import subprocess
import time

import torch

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import expected_atomic, gen_fixture, is_mounted

HELPER = "/sbin/mount.fuse.ucpfs"


@contextlib.contextmanager
def helper_installed(exe):
    """/sbin/mount.fuse.ucpfs -> exe for the duration; what was there before is put back."""
    if os.geteuid() != 0:
        raise SystemExit("mount_helper_test needs root (mount(8) of a FUSE filesystem, /sbin)")
    saved = HELPER + ".saved-by-test"
    had = os.path.lexists(HELPER)
    if had:
        os.rename(HELPER, saved)
    os.symlink(os.path.abspath(exe), HELPER)
    try:
        yield
    finally:
        os.unlink(HELPER)
        if had:
            os.rename(saved, HELPER)


def mountinfo(mnt):
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if fields[4] == mnt:
                sep = fields.index("-")
                return {"options": fields[5].split(","), "type": fields[sep + 1], "source": fields[sep + 2]}
    return None


def status_json(mnt):
    return json.loads(run([ucpfs_bin(), "status", mnt, "--json"]).stdout)


def umount_and_wait(mnt, pid):
    """Plain umount(8); then the daemon drains its write cache and exits: wait for that."""
    run(["umount", mnt])
    assert not is_mounted(mnt), "still mounted after umount"
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                break
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", \
        f"daemon {pid} still running 20 s after umount"


def main():
    res = Results("e2e_mount_helper")
    exe = ucpfs_bin()
    with tmpdir("ucpfs-mount-helper-") as d, helper_installed(exe):
        src, mnt = os.path.join(d, "src"), os.path.join(d, "mnt")
        os.makedirs(mnt)
        expected = torch.load(gen_fixture("gen_dcp113_llama.py", src, "--ranks", "2"))
        atomic = expected_atomic(expected)
        param = sorted(p for p in atomic if "fp32.pt" in atomic[p])[0]

        # mount -t fuse.ucpfs SRC MNT -o ..., read-only.
        r = run(["mount", "-t", "fuse.ucpfs", src, mnt, "-o", "layout=tp2_pp1_dp1,cache_size=64M,ro"], check=False)
        try:
            def mounted_ro():
                assert r.returncode == 0, r.stderr
                info = mountinfo(mnt)
                assert info is not None, "nothing mounted"
                assert info["type"] == "fuse.ucpfs" and info["source"] == src, info
                assert "ro" in info["options"], info
            res.check("mount -t fuse.ucpfs -o layout=...,cache_size=...,ro", mounted_ro)

            def view_equals_saved():
                got = torch.load(os.path.join(mnt, "atomic", param, "fp32.pt"))["param"]
                want = atomic[param]["fp32.pt"]
                assert got.dtype == want.dtype and torch.equal(got, want), param
            res.check("atomic view equals what torch saved", view_equals_saved)

            def writes_refused():
                try:
                    open(os.path.join(mnt, "new.pt"), "wb").close()
                except OSError as e:
                    assert e.errno == 30, e  # EROFS
                else:
                    raise AssertionError("a file was created in a read-only mount")
            res.check("writes are EROFS", writes_refused)

            def status_read_only():
                s = status_json(mnt)
                st, stats = s["status"], s["stats"]
                assert st["source"] == src and st["format"] == "dcp", st
                assert st["target_layouts"] == ["tp2_pp1_dp1"], st["target_layouts"]
                assert st["index"]["state"] == "built" and st["index"]["schema"] >= 1, st["index"]
                assert st["index"]["dir"] == os.path.join(src, ".ucpfs"), st["index"]
                assert "capture" not in stats, stats  # read-only: no write cache
                assert stats["lookup_layouts"]["names"] == [], stats["lookup_layouts"]
                os.listdir(os.path.join(mnt, "target", "tp4_pp1_dp1"))
                assert not os.path.exists(os.path.join(mnt, "target", "tp3_bad"))
                stats = status_json(mnt)["stats"]
                assert stats["lookup_layouts"]["names"] == ["tp4_pp1_dp1"], stats["lookup_layouts"]
                assert stats["lookup_layouts"]["memory_bytes"] > 0, stats["lookup_layouts"]
                n_bytes = os.path.getsize(os.path.join(mnt, "atomic", param, "fp32.pt"))
                assert stats["views"]["bytes_read"] >= n_bytes and stats["views"]["reads"] >= 1, stats["views"]
                assert stats["source_reads"] >= 1, stats
                errors = stats["errors"]
                assert errors["count"] >= 1 and any("target/tp3_bad" in m for m in errors["last"]), errors
                text = run([exe, "status", mnt]).stdout
                assert "tp2_pp1_dp1 (given), tp4_pp1_dp1 (built on lookup)" in text, text
                assert "write cache: none (read-only mount)" in text and "target/tp3_bad" in text, text
            res.check("ucpfs status of the read-only mount", status_read_only)
        finally:
            if is_mounted(mnt):
                subprocess.run(["umount", mnt])

        def unmounted():
            assert not is_mounted(mnt), "still mounted after plain umount"
        res.check("plain umount", unmounted)

        # An fstab line, mounted with mount -T FILE MNT; read-write.
        fstab = os.path.join(d, "fstab")
        with open(fstab, "w") as f:
            f.write(f"{src} {mnt} fuse.ucpfs layout=tp2_pp1_dp1,cache_size=3G,nofail,x-systemd.automount 0 0\n")
        r = run(["mount", "-T", fstab, mnt], check=False)
        payload = os.urandom(3 << 20)
        try:
            def fstab_mounted():
                assert r.returncode == 0, r.stderr
                info = mountinfo(mnt)
                assert info is not None and info["type"] == "fuse.ucpfs" and "rw" in info["options"], info
                st = status_json(mnt)
                assert st["stats"]["capture"]["cache_bytes"] == 3 << 30, st["stats"]["capture"]
                assert st["status"]["index"]["state"] == "reused", st["status"]["index"]
                text = run([exe, "status", mnt]).stdout
                assert "3072.0 MiB free of 3072.0 MiB" in text, text  # more than 2^31 bytes
            res.check("fstab line with mount -T: cache size, index reused", fstab_mounted)

            def durable_after_plain_umount():
                pid = status_json(mnt)["status"]["daemon_pid"]
                with open(os.path.join(mnt, "saved.bin"), "wb") as f:
                    f.write(payload)
                umount_and_wait(mnt, pid)
                with open(os.path.join(src, "saved.bin"), "rb") as f:
                    assert f.read() == payload, "saved.bin differs in SRC"
            res.check("a file saved into the mount is in SRC after plain umount", durable_after_plain_umount)
        finally:
            if is_mounted(mnt):
                subprocess.run(["umount", mnt])

        def bad_option():
            p = run(["mount", "-t", "fuse.ucpfs", src, mnt, "-o", "ro,cachesize=8G"], check=False)
            assert p.returncode != 0, "a misspelt option was accepted"
            assert "'cachesize=8G'" in p.stderr and "unknown option" in p.stderr, p.stderr
            assert not is_mounted(mnt)
        res.check("a bad option is refused, naming it", bad_option)

        def s3_only_options():
            for opt in ("stage_keep=5", "stage_dir=/tmp"):  # an s3:// mount's staging options
                p = run(["mount", "-t", "fuse.ucpfs", src, mnt, "-o", opt], check=False)
                assert p.returncode != 0 and "is for a writable s3:// source" in p.stderr, (opt, p.stderr)
                assert not is_mounted(mnt)
        res.check("an s3:// mount's staging options are refused for a local source", s3_only_options)
    res.finish()


if __name__ == "__main__":
    main()
