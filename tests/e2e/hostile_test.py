"""End-to-end: hostile checkpoints and hostile situations (issue 8), with real mounts.

- The index location is untrusted: `.ucpfs` itself, or data.mdb / lock as symlinks to places
  outside the checkpoint (dangling too): `ucpfs index` and `ucpfs mount` refuse, naming the file
  and saying it is not followed; a symlinked lock.mdb is never opened; nothing outside changes.
- A prebuilt index with a record pointing outside the checkpoint, a wrong file size, or a
  fragment past a file's end (fingerprint kept, as an attacker could): `--read-only-index`
  refuses it with the reason, a writable mount rebuilds it and serves the true bytes; a corrupt
  data.mdb hard-linked to an outside file is replaced, and that file is not written.

- A FIFO, a socket or a symlink in place of a data file: `ucpfs index` and `ucpfs mount` end at
  once with an error naming the file; nothing blocks.
- A source file edited in place after mounting (same size, mtime put back, even the same
  bytes): reads that need it give EIO and the daemon logs the file once; a remount re-indexes
  and serves again.
- Mount safety: MNT equal to or inside SRC, or SRC inside MNT, is refused; a dead ucpfs mount
  (daemon killed) is cleared by the next mount; a second mount over a live one is refused;
  `ucpfs umount` refuses a filesystem that is not ucpfs.
- Permissions with `-o allow_other`: passthrough files keep the source's mode and owner, views
  are never more readable than the source files (user `nobody` is refused where a source is
  private to root).
- Names: parameter keys that cannot be file names (".", "..", NUL, over 255 bytes, not UTF-8),
  a source directory and a file whose names are not UTF-8: served under escaped names listed in
  status.json; every JSON output stays valid.
- Memory: a lookup of a 65536-rank layout is refused (over the 4096-rank cap of lookups), and one
  of 4096 ranks over --lookup-memory-mib 1, each within 20 s,
  and the daemon does not grow; a layout that fits is still built on lookup; once the kernel
  forgets a layout's inodes (dentries dropped), it is evicted and its budget serves another.
- A checkpoint with more data files than the open-file limit (hard limit 64, 128 files) indexes,
  mounts and serves every atomic file bit for bit.
Every probe has a hard timeout: a hang is a failure, never a stuck CI.
"""
import errno
import os
import shutil
import socket
import subprocess
import time

import torch

from e2e_common import Results, as_nobody, run, tmpdir, ucpfs_bin
from mount_common import expected_atomic, gen_fixture, mounted, step_equal


def clean_error(cmd, must, timeout_s=20):
    """Runs cmd; it must fail within timeout_s with an error that contains every string of must."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{cmd} hung for {timeout_s} s") from e
    assert p.returncode != 0, f"{cmd} succeeded: {p.stdout}"
    for m in must:
        assert m in p.stderr, f"{cmd}: error lacks {m!r}: {p.stderr}"
    return time.monotonic() - t0


def copy_of(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".ucpfs"))
    return dst


def biggest_shard(d):
    return max((f for f in os.listdir(d) if f.endswith(".distcp")), key=lambda f: os.path.getsize(os.path.join(d, f)))


def special_files_refused(work, src):
    for kind in ("fifo", "socket", "symlink"):
        d = copy_of(src, os.path.join(work, f"special-{kind}"))
        shard = biggest_shard(d)
        path = os.path.join(d, shard)
        os.remove(path)
        keep = None
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "socket":
            keep = socket.socket(socket.AF_UNIX)
            keep.bind(path)
        else:
            outside = os.path.join(work, f"outside-{kind}")
            shutil.copy(os.path.join(src, shard), outside)
            os.symlink(outside, path)
        try:
            clean_error([ucpfs_bin(), "index", d], [shard])
            mnt = os.path.join(work, f"mnt-special-{kind}")
            os.makedirs(mnt, exist_ok=True)
            clean_error([ucpfs_bin(), "mount", d, mnt], [shard])
            with open("/proc/self/mounts", errors="surrogateescape") as f:
                assert not any(line.split()[1] == mnt for line in f), "a refused mount is mounted"
        finally:
            if keep:
                keep.close()


def snapshot(d):
    """Every entry under d: (kind, bytes, mtime_ns) by relative path, symlinks not followed."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            data = open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else None
            out[os.path.relpath(p, d)] = (st.st_mode, data, st.st_mtime_ns)
    return out


def tamper_index_exe():
    tools = os.environ.get("UCPFS_TOOLS_DIR")
    if not tools:
        raise AssertionError("UCPFS_TOOLS_DIR is not set (run through ctest, or export it)")
    return os.path.join(tools, "tamper_index")


def index_state(m):
    import json  # noqa: PLC0415
    return json.load(open(os.path.join(m, ".ucpfs", "status.json")))["index"]["state"]


def serves_truth(m, expected):
    """Every atomic file under mount m holds the tensors the producer wrote, bit for bit."""
    want = expected_atomic(torch.load(expected))
    for param, fs in want.items():
        for name, t in fs.items():
            obj = torch.load(os.path.join(m, "atomic", param.replace("/", "%2F"), name))
            if name == "step.pt":
                step_equal(obj, t, (param, name))
                continue
            assert torch.equal(obj["param"].reshape(-1).view(torch.int32), t.reshape(-1).view(torch.int32)), \
                (param, name)


def symlinked_index(work, src, expected):
    """A checkpoint shipping `.ucpfs` (or a file in it) as a symlink to a place outside: index
    and mount refuse and say why, and nothing outside changes."""
    outside = os.path.join(work, "outside-index")
    os.makedirs(outside)
    for name in ("data.mdb", "lock.mdb", "lock", "victim"):
        with open(os.path.join(outside, name), "wb") as f:
            f.write(b"not yours " + name.encode())
    before = snapshot(outside)
    cases = [("dir", ".ucpfs", outside, ["symbolic link", "not followed"]),
             ("data", ".ucpfs/data.mdb", os.path.join(outside, "data.mdb"), ["data.mdb", "not followed"]),
             ("data-dangling", ".ucpfs/data.mdb", os.path.join(outside, "created-by-ucpfs"),
              ["data.mdb", "not followed"]),
             ("lock", ".ucpfs/lock", os.path.join(outside, "lock"), ["lock", "not followed"]),
             ("lock.mdb", ".ucpfs/lock.mdb", os.path.join(outside, "lock.mdb"), None)]
    for kind, link, target, must in cases:
        d = copy_of(src, os.path.join(work, f"symidx-{kind}"))
        os.makedirs(os.path.join(d, ".ucpfs"), exist_ok=True)
        if link == ".ucpfs":
            os.rmdir(os.path.join(d, ".ucpfs"))
        os.symlink(target, os.path.join(d, link))
        mnt = os.path.join(work, f"mnt-symidx-{kind}")
        os.makedirs(mnt)
        if must is None:  # a file ucpfs never opens: indexes and serves, the link untouched
            run([ucpfs_bin(), "index", d], timeout=120)
            with mounted(d, mnt) as (m, _):
                serves_truth(m, expected)
            assert os.path.islink(os.path.join(d, link))
        else:
            clean_error([ucpfs_bin(), "index", d], must)
            clean_error([ucpfs_bin(), "mount", d, mnt], must)
            assert os.path.islink(os.path.join(d, link)), "ucpfs removed a link it did not create"
        assert snapshot(outside) == before, f"{kind}: a file outside the checkpoint changed"
        assert not os.path.exists(os.path.join(outside, "created-by-ucpfs"))


def crafted_index(work, src, expected):
    """A prebuilt index whose records point outside the checkpoint or past a file's end (with
    the right fingerprint, as an attacker can compute it): refused in read-only mode, rebuilt
    when writable, never served; a corrupt data.mdb hard-linked to a file outside is replaced,
    not written."""
    for change, args, must in [("path", ["0", "../outside.distcp"], "leaves the checkpoint"),
                               ("grow", ["0"], "bytes, the index says"),
                               ("offset", [".weight"], "lies outside its file")]:
        d = copy_of(src, os.path.join(work, f"crafted-{change}"))
        shutil.copy(os.path.join(d, sorted(f for f in os.listdir(d) if f.endswith(".distcp"))[0]),
                    os.path.join(work, "outside.distcp"))
        run([ucpfs_bin(), "index", d], timeout=120)
        run([tamper_index_exe(), os.path.join(d, ".ucpfs"), change, *args])
        mnt = os.path.join(work, f"mnt-crafted-{change}")
        os.makedirs(mnt)
        clean_error([ucpfs_bin(), "mount", d, mnt, "--read-only-index"], [must, "index"])
        with mounted(d, mnt) as (m, _):
            assert index_state(m) == "rebuilt (index was corrupt)", index_state(m)
            serves_truth(m, expected)
    d = copy_of(src, os.path.join(work, "crafted-hardlink"))
    victim = os.path.join(work, "victim.bin")
    with open(victim, "wb") as f:
        f.write(b"\x17" * 8192)
    os.makedirs(os.path.join(d, ".ucpfs"))
    os.link(victim, os.path.join(d, ".ucpfs", "data.mdb"))
    run([ucpfs_bin(), "index", d], timeout=120)
    assert open(victim, "rb").read() == b"\x17" * 8192, "the index was written through a hard link"
    assert os.stat(os.path.join(d, ".ucpfs", "data.mdb")).st_ino != os.stat(victim).st_ino


def edited_in_place(work, src, expected):
    d = copy_of(src, os.path.join(work, "edited"))
    mnt = os.path.join(work, "mnt-edited")
    want = expected_atomic(torch.load(expected))
    files = [os.path.join(p.replace("/", "%2F"), n) for p, fs in want.items() for n in fs]
    with mounted(d, mnt) as (m, _):
        first = open(os.path.join(m, "atomic", files[0]), "rb").read()
        assert first
        # Rewrite every shard with its own bytes, mtime put back: only ctime moves.
        for f in os.listdir(d):
            if f.endswith(".distcp"):
                p = os.path.join(d, f)
                st = os.stat(p)
                data = open(p, "rb").read()
                with open(p, "r+b") as h:
                    h.write(data)
                os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        failed = 0
        for name in files[1:]:
            try:
                open(os.path.join(m, "atomic", name), "rb").read()
            except OSError as e:
                assert e.errno == errno.EIO, e
                failed += 1
        assert failed == len(files) - 1, f"{failed} of {len(files) - 1} reads failed after the edit"
        log = open(mnt + ".log").read()
        lines = [x for x in log.splitlines() if "remount to re-index" in x]
        shards = {x.split(": read ")[1].split(" offset")[0] for x in lines} if lines else set()
        assert lines, log
        distinct = {x.split(" offset ")[1].split(": ", 1)[1] for x in lines}
        assert len(lines) == len(distinct), f"the same change was logged more than once:\n{log}"
        del shards
    # A remount re-indexes the changed source and serves it.
    with mounted(d, mnt) as (m, _):
        for name in files:
            open(os.path.join(m, "atomic", name), "rb").read()


def many_files_small_limit(work, src, expected):
    d = copy_of(src, os.path.join(work, "many"))
    n_files = len(os.listdir(d))
    assert n_files > 64, n_files
    limit = ["prlimit", "--nofile=64:64", "--"]
    r = run(limit + [ucpfs_bin(), "index", d], timeout=120)
    assert "items" in r.stdout, r.stdout
    mnt = os.path.join(work, "mnt-many")
    os.makedirs(mnt, exist_ok=True)
    r = run(limit + [ucpfs_bin(), "mount", d, mnt, "--log", mnt + ".log"], timeout=120)
    try:
        want = expected_atomic(torch.load(expected))
        for param, fs in want.items():
            for name, t in fs.items():
                obj = torch.load(os.path.join(mnt, "atomic", param.replace("/", "%2F"), name), weights_only=True)
                if name == "step.pt":
                    step_equal(obj, t, (param, name))
                    continue
                assert torch.equal(obj["param"].reshape(-1).view(torch.int32), t.reshape(-1).view(torch.int32)), \
                    (param, name)
    finally:
        subprocess.run([ucpfs_bin(), "umount", mnt])


def mount_safety(work, src):
    d = copy_of(src, os.path.join(work, "self"))
    os.makedirs(os.path.join(d, "inner"))
    outer = os.path.join(work, "outer")
    os.makedirs(os.path.join(outer, "ckpt"))
    nested = copy_of(src, os.path.join(outer, "ckpt", "src"))
    clean_error([ucpfs_bin(), "mount", d, d], ["is the checkpoint itself"])
    clean_error([ucpfs_bin(), "mount", d, os.path.join(d, "inner")], ["inside the checkpoint"])
    clean_error([ucpfs_bin(), "mount", nested, outer], ["inside the mount point"])

    # A dead ucpfs mount (daemon killed) is cleared by the next mount, which serves.
    mnt = os.path.join(work, "mnt-dead")
    os.makedirs(mnt)
    run([ucpfs_bin(), "mount", d, mnt], timeout=120)
    daemons = run(["pgrep", "-f", f"ucpfs mount {d} {mnt}"], check=False).stdout.split()
    assert daemons, "no daemon found"
    for pid in daemons:
        os.kill(int(pid), 9)
    # While the daemon is still dying, a request it had taken may end in EIO (the kernel's, now and
    # then); once it is gone the mount reads as not connected.
    deadline = time.monotonic() + 10
    seen = []
    while time.monotonic() < deadline:
        try:
            os.listdir(mnt)
            seen.append("served")
        except OSError as e:
            seen.append(errno.errorcode.get(e.errno, str(e.errno)))
            assert e.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO), e
            if e.errno != errno.EIO:
                break
        time.sleep(0.05)
    assert seen and seen[-1] in ("ENOTCONN", "ECONNABORTED"), f"the killed daemon's mount read as {seen[-5:]}"
    with mounted(d, mnt) as (m, _):
        assert "atomic" in os.listdir(m)
        # A second mount over a live one is refused, saying how to clear it.
        clean_error([ucpfs_bin(), "mount", d, m], ["already mounted", "ucpfs umount"])
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        assert sum(line.split()[4] == mnt for line in f) == 0, "mounts stacked at the mount point"

    # `ucpfs umount` of something that is not ucpfs is refused, and it stays mounted.
    foreign = os.path.join(work, "foreign")
    os.makedirs(foreign)
    run(["mount", "-t", "tmpfs", "ucpfs-test-tmpfs", foreign])
    try:
        clean_error([ucpfs_bin(), "umount", foreign], ["not a ucpfs mount", "tmpfs"])
        assert run(["mountpoint", "-q", foreign], check=False).returncode == 0, "the tmpfs was unmounted"
    finally:
        subprocess.run(["umount", foreign])
    clean_error([ucpfs_bin(), "umount", foreign], ["nothing is mounted there"])


def permissions_allow_other(work, src):
    os.chmod(work, 0o755)  # let `nobody` reach the mount point
    d = copy_of(src, os.path.join(work, "perm"))
    for root, dirs, files in os.walk(d):
        for x in dirs:
            os.chmod(os.path.join(root, x), 0o755)
        for x in files:
            os.chmod(os.path.join(root, x), 0o644)
    os.chmod(d, 0o755)
    mnt = os.path.join(work, "mnt-perm")
    # All sources world-readable: nobody reads views and passthrough files.
    with mounted(d, mnt, "-o", "allow_other") as (m, _):
        atomic = os.path.join(m, "atomic", sorted(os.listdir(os.path.join(m, "atomic")))[0])
        view = os.path.join(atomic, sorted(os.listdir(atomic))[0])
        assert as_nobody("cat", view).returncode == 0, as_nobody("cat", view).stderr
        shard = biggest_shard(d)
        assert as_nobody("cat", os.path.join(m, shard)).returncode == 0
    # One private shard (root, 0600): its passthrough keeps mode and owner, and no view is more
    # readable than it; root still reads everything.
    shard = biggest_shard(d)
    os.chmod(os.path.join(d, shard), 0o600)
    with mounted(d, mnt, "-o", "allow_other") as (m, _):
        st = os.stat(os.path.join(m, shard))
        # The source is read-write through the mount: its mode as it is.
        assert (st.st_mode & 0o777, st.st_uid) == (0o600, 0), (oct(st.st_mode), st.st_uid)
        r = as_nobody("cat", os.path.join(m, shard))
        assert r.returncode != 0 and "Permission denied" in r.stderr, r
        for root, _, files in os.walk(os.path.join(m, "atomic")):
            for f in files:
                p = os.path.join(root, f)
                assert os.stat(p).st_mode & 0o077 == 0, (p, oct(os.stat(p).st_mode))
                r = as_nobody("cat", p)
                assert r.returncode != 0 and "Permission denied" in r.stderr, (p, r)
                open(p, "rb").read()  # root may
        lay = os.path.join(m, "target", "tp1_pp1_dp1", "rank_0", "model.pt")
        r = as_nobody("cat", lay)
        assert r.returncode != 0 and "Permission denied" in r.stderr, r


ODD_NAMES = {  # key -> the atomic/ directory name ucpfs must give it (views::AtomicDirName)
    "model..": b"%2E",
    "model...": b"%2E%2E",
    "model.a\x00b": b"a%00b",
    # Not UTF-8: pickled with surrogatepass, kept as the key's bytes.
    "model.\udcff\udcfe.weight": "\udcff\udcfe.weight".encode("utf-8", "surrogatepass"),
    "model." + "w" * 300: None,  # over NAME_MAX: a prefix, '~' and a hash
}


# Writes the odd-names checkpoint with gen_dcp2x (which must run without torch imported): argv
# fixtures_dir, out (bytes via surrogateescape), keys as JSON; prints the tensors' bytes in hex.
_ODD_WRITER = """
import json, os, random, sys
sys.path.insert(0, sys.argv[1])
import gen_dcp2x as g
rng = random.Random(7)
save = g.Save(1)
out = {}
for key in json.loads(sys.argv[3]):
    t = g.random_tensor(rng, "float32", (3, 4))
    out[key] = t.data.hex()
    save.tensor(key, t.dtype, t.shape, g.whole_chunk(t, 0))
save.write(sys.argv[2])
print(json.dumps(out))
"""


def odd_names(work):
    """Keys that cannot be file names as they are, a source directory and a file whose names are
    not UTF-8: the mount serves them under escaped names listed in status.json, and every JSON
    output stays valid."""
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from mount_common import FIXTURES  # noqa: PLC0415
    src = os.fsencode(os.path.join(work, "odd")) + b"-\xff\xfe"
    r = subprocess.run([sys.executable, "-c", _ODD_WRITER, FIXTURES, src, json.dumps(list(ODD_NAMES))],
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    truth = {k: bytes.fromhex(v) for k, v in json.loads(r.stdout).items()}
    with open(src + b"/notes-\xc3\x28.txt", "wb") as f:
        f.write(b"passthrough")
    mnt = os.path.join(work, "mnt-odd")
    p = subprocess.run([ucpfs_bin(), "inspect", src, "--json"], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    json.loads(p.stdout)
    with mounted(os.fsdecode(src), mnt) as (m, _):
        st = json.load(open(os.path.join(m, ".ucpfs", "status.json"), "rb"))
        escaped = [e["dir"] for e in st["escaped_names"]]
        names = set(os.listdir(os.path.join(os.fsencode(m), b"atomic")))
        assert len(names) == len(ODD_NAMES), names
        assert len(escaped) == len(ODD_NAMES) - 1, escaped  # all but the non-UTF-8 one (kept as bytes)
        for key, want in ODD_NAMES.items():
            if want is None:
                long = [n for n in names if len(n) > 200]
                assert len(long) == 1 and len(long[0]) <= 255 and b"~" in long[0], long
                want = long[0]
            assert want in names, (key, want, names)
            obj = torch.load(os.fsdecode(os.path.join(os.fsencode(m), b"atomic", want, b"fp32.pt")), weights_only=True)
            assert obj["param"].numpy().tobytes() == truth[key], key
        assert open(os.path.join(os.fsencode(m), b"notes-\xc3\x28.txt"), "rb").read() == b"passthrough"
        json.loads(open(os.path.join(m, ".ucpfs", "stats.json")).read())
        run(["ls", "-lR", m])


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))


def huge_layout_lookup(work, src):
    mnt = os.path.join(work, "mnt-huge")
    with mounted(src, mnt, "--lookup-memory-mib", "1") as (m, _):
        pid = int(run(["pgrep", "-f", f"ucpfs mount {src} {mnt}"]).stdout.split()[0])
        before = rss_kib(pid)
        # Over the rank cap of lookups (4096): refused before anything is planned; within the cap
        # but over --lookup-memory-mib: refused from rank 0's estimate.
        for layout, why in (("tp1_pp1_dp65536", "limited to 4096"), ("tp1_pp1_dp4096", "lookup-memory-mib")):
            t0 = time.monotonic()
            p = subprocess.run(["ls", os.path.join(m, "target", layout)], capture_output=True, text=True, timeout=60)
            took = time.monotonic() - t0
            assert p.returncode != 0 and "No such file" in p.stderr, p
            assert took < 20, f"the refusal of {layout} took {took:.1f} s"
            log = open(mnt + ".log").read()
            assert layout in log and why in log, log
        grown = rss_kib(pid) - before
        assert grown < 64 * 1024, f"the daemon grew by {grown} KiB"
        # A layout that fits is still built on lookup and served.
        assert sorted(os.listdir(os.path.join(m, "target", "tp2_pp1_dp2"))) == ["rank_0", "rank_1", "rank_2", "rank_3"]
        assert status_ok(m)


def lookup_layouts(m):
    import json  # noqa: PLC0415
    return json.load(open(os.path.join(m, ".ucpfs", "stats.json")))["lookup_layouts"]


def layouts_evicted_when_forgotten(work, src):
    """A layout built on lookup holds its share of --lookup-memory-mib only while the kernel
    knows its inodes: once they are forgotten (here: dentries dropped), its memory is given
    back, and a layout that did not fit beside it is built."""
    mnt = os.path.join(work, "mnt-evict")
    # A layout holds its tree only (rank files are built again on open): about 3 KB a rank.
    with mounted(src, mnt, "--lookup-memory-mib", "1") as (m, _):
        first, second = "tp1_pp1_dp256", "tp1_pp1_dp255"  # each about 2/3 of the budget
        # An open directory keeps its inode known to the kernel, so memory pressure elsewhere (a
        # loaded CI machine reclaims dentries on its own) cannot evict a layout while it is checked.
        pin = os.open(os.path.join(m, "target", first), os.O_RDONLY | os.O_DIRECTORY)
        assert len(os.listdir(os.path.join(m, "target", first))) == 256
        held = lookup_layouts(m)
        assert held["live"] == 1 and 0 < held["memory_bytes"] <= 1 << 20, held
        assert 2 * held["memory_bytes"] > 1 << 20, f"the fixture no longer fills the budget: {held}"
        p = subprocess.run(["ls", os.path.join(m, "target", second)], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0, "a second layout passed the budget"
        assert second in open(mnt + ".log").read()
        os.close(pin)
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")  # dentries and inodes: the kernel forgets the unused ones
        deadline = time.monotonic() + 10
        while lookup_layouts(m)["live"] != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        after = lookup_layouts(m)
        assert {k: after[k] for k in ("live", "memory_bytes", "memory_limit_bytes", "names")} == \
            {"live": 0, "memory_bytes": 0, "memory_limit_bytes": 1 << 20, "names": []}, after
        # The refusal stays listed with its reason (stats.json; `ucpfs status`).
        assert after["max_ranks"] == 4096 and [r["layout"] for r in after["refused"]] == [second], after
        assert "lookup-memory-mib" in after["refused"][0]["reason"], after
        listed = os.listdir(os.path.join(m, "target"))
        assert first not in listed, listed
        pin = os.open(os.path.join(m, "target", second), os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert len(os.listdir(os.path.join(m, "target", second))) == 255
            held = lookup_layouts(m)
            assert held["live"] == 1 and held["names"] == [second], held
            # The first one comes back on demand, built afresh (and now it is the one refused).
            p = subprocess.run(["ls", os.path.join(m, "target", first)], capture_output=True, text=True, timeout=60)
            assert p.returncode != 0, (p.stdout[:200], lookup_layouts(m))
        finally:
            os.close(pin)


def status_ok(m):
    import json  # noqa: PLC0415
    return json.load(open(os.path.join(m, ".ucpfs", "status.json")))["format"] == "dcp"


def main():
    res = Results("hostile")
    with tmpdir("ucpfs-hostile-") as work:
        src = os.path.join(work, "src")
        expected = gen_fixture("gen_dcp113_llama.py", src, "--ranks", "2", "--single-file-per-rank", "0")
        res.check("symlinked index directory or index files: refused, nothing outside changes",
                  lambda: symlinked_index(work, src, expected))
        res.check("a crafted prebuilt index is refused read-only, rebuilt when writable, never served",
                  lambda: crafted_index(work, src, expected))
        res.check("FIFO, socket and symlink data files: index and mount fail at once naming the file",
                  lambda: special_files_refused(work, src))
        res.check("a source edited in place gives EIO, is logged once per change, and a remount serves it",
                  lambda: edited_in_place(work, src, expected))
        res.check("self-mounts refused; a dead mount is cleared; no stacking; umount only unmounts ucpfs",
                  lambda: mount_safety(work, src))
        res.check("allow_other: passthrough keeps mode and owner; views never more readable than sources",
                  lambda: permissions_allow_other(work, src))
        res.check("odd names (., .., NUL, > 255 bytes, not UTF-8) are served under escaped names",
                  lambda: odd_names(work))
        res.check("a 65536-rank layout lookup is refused within 20 s without growing the daemon",
                  lambda: huge_layout_lookup(work, src))
        res.check("layouts built on lookup are evicted once the kernel forgets them, releasing their budget",
                  lambda: layouts_evicted_when_forgotten(work, src))
        res.check("more data files than the descriptor limit: index, mount and serve every atomic file",
                  lambda: many_files_small_limit(work, src, expected))
    res.finish()


if __name__ == "__main__":
    main()
