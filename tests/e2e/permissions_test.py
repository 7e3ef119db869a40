"""End-to-end: files saved through an `allow_other` mount belong to whoever made them (issue 22).

Run as root. One tree is built twice: in a plain directory (the oracle: what the kernel does)
and in SRC, mounted with `-o allow_other`. Child processes drop to `nobody` and to a test user
with a supplementary group (os.setgroups / setresgid / setresuid, each with its umask) and run
every write operation on both: create with modes 0644/04755/02755/0777 under umask 022 and 077,
create in a setgid directory (group inherited, S_ISGID dropped for a non-member), mkdir, chmod
(set-id bits, another's file), chown/chgrp (self, other, own group), truncate, utime, rename and
unlink in a sticky directory (another's file: EPERM), rmdir, mknod, O_TRUNC of another's file,
xattrs. The result codes must be equal; so must owner, group and mode of every entry, through
the mount while files are still being saved (a pending file's stat) and in SRC once `ucpfs sync`
made them durable. Only one difference is intended: mknod of a FIFO/socket/device is EPERM in
the mount (the source holds regular files, directories and symlinks only).

The exploit probe: `nobody` copies /usr/bin/id with mode 04755: it must not be root-owned.

Then ordinary tools (as root): `cp -a`, `tar x` and `rsync -a` of a small tree (modes, owners,
mtimes, a symlink, a subdirectory) into the mount give the same tree as into a plain directory;
`cp -a` exits 0 and its `user.*` xattr lands on the file; others are ENOTSUP; a
writable shared mmap of a file opened for writing fails with ENODEV (documented in
docs/reference.md "Saving into the mount"). Last, a second mount with `--materialize`, where such
a map works: nobody and the test user map new files, root's 0666 file and (refused) root's 0644
one writable MAP_SHARED, also writing after the descriptor's close; result codes, bytes, owner,
group and mode in SRC equal the plain directory's.

Run by hand: UCPFS_BIN=build/cli/ucpfs /usr/bin/python3 tests/e2e/permissions_test.py
"""
import errno
import hashlib
import json
import mmap
import os
import shutil
import stat
import subprocess
import sys
import time

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import mounted

NOBODY = (65534, 65534, [65534])
TESTU = (4242, 4242, [4242, 4343])   # a user with the supplementary group 4343
OTHER = 4343                          # a group TESTU is in, nobody is not
ROOT_ONLY = ("root", 0, 0)


def build_tree(base):
    """The initial tree, as root: directories of different owners, a setgid one, a sticky one."""
    def d(rel, mode, uid=0, gid=0):
        p = os.path.join(base, rel)
        os.makedirs(p, exist_ok=True)
        os.chown(p, uid, gid)
        os.chmod(p, mode)

    def f(rel, mode, uid=0, gid=0, data=b"x" * 10):
        p = os.path.join(base, rel)
        with open(p, "wb") as fh:
            fh.write(data)
        os.chown(p, uid, gid)
        os.chmod(p, mode)

    os.chmod(base, 0o755)
    d("pub", 0o777)
    d("priv", 0o755)
    d("sgid", 0o2775, 0, OTHER)        # setgid, writable by group 4343
    d("sgid_open", 0o2777, 0, OTHER)   # setgid, writable by anyone
    d("sticky", 0o1777)
    d("sticky/rootdir", 0o755)
    d("home", 0o755, TESTU[0], TESTU[1])
    f("pub/rootfile", 0o644)
    f("pub/rootfile666", 0o666)
    f("pub/nobodyfile", 0o644, NOBODY[0], NOBODY[1])
    f("sticky/rootfile", 0o644)
    f("sticky/rootfile666", 0o666)
    f("sticky/userfile", 0o644, TESTU[0], TESTU[1])
    f("sticky/nobodyfile", 0o644, NOBODY[0], NOBODY[1])
    f("home/mine", 0o644, TESTU[0], TESTU[1])


def as_user(user, umask, fn):
    """Runs fn() in a child with `user`'s credentials and `umask`: ("ok", value) or ("err", errno)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = ("exc", "?")
        try:
            os.close(r)
            uid, gid, groups = user
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.umask(umask)
            out = ("ok", fn())
        except OSError as e:
            out = ("err", errno.errorcode.get(e.errno, e.errno))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = ("exc", repr(e))
        finally:
            os.write(w, json.dumps(out).encode())
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return tuple(json.loads(data))


def attrs(path):
    st = os.lstat(path)
    return [st.st_uid, st.st_gid, oct(stat.S_IMODE(st.st_mode))]


def write_file(path, mode, data=b"saved through the mount\n", flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
    fd = os.open(path, flags, mode)
    try:
        os.write(fd, data)
        return attrs(path)  # while still open: a pending file's stat through the mount
    finally:
        os.close(fd)


def copy_id(path):
    shutil.copyfile("/usr/bin/id", path)
    os.chmod(path, 0o4755)
    return attrs(path)


def operations():
    """(label, user, umask, fn(base) -> value); run in this order on both trees."""
    ops = []
    for uname, user in (("nobody", NOBODY), ("testu", TESTU)):
        for um in (0o022, 0o077):
            for mode in (0o644, 0o4755, 0o2755, 0o777):
                name = f"pub/f_{uname}_{um:o}_{mode:o}"
                ops.append((f"{uname} umask {um:o} create {name}", user, um,
                            lambda b, n=name, m=mode: write_file(os.path.join(b, n), m)))
            ops.append((f"{uname} umask {um:o} mkdir", user, um,
                        lambda b, n=f"pub/d_{uname}_{um:o}": (os.mkdir(os.path.join(b, n), 0o777), attrs(os.path.join(b, n)))[1]))
        p = lambda b, n: os.path.join(b, n)  # noqa: E731
        ops += [
            (f"{uname} create existing O_EXCL", user, 0o022,
             lambda b: write_file(p(b, "pub/rootfile"), 0o644, flags=os.O_WRONLY | os.O_CREAT | os.O_EXCL)),
            (f"{uname} create in priv", user, 0o022, lambda b, u=uname: write_file(p(b, f"priv/{u}"), 0o644)),
            (f"{uname} create 02755 in sgid", user, 0o022, lambda b, u=uname: write_file(p(b, f"sgid/{u}"), 0o2755)),
            (f"{uname} create 02755 in sgid_open", user, 0o022,
             lambda b, u=uname: write_file(p(b, f"sgid_open/{u}"), 0o2755)),
            (f"{uname} mkdir in sgid_open", user, 0o022,
             lambda b, u=uname: (os.mkdir(p(b, f"sgid_open/d_{u}"), 0o755), attrs(p(b, f"sgid_open/d_{u}")))[1]),
            (f"{uname} chmod own 04755", user, 0o022,
             lambda b, u=uname: (os.chmod(p(b, f"pub/f_{u}_22_644"), 0o4755), attrs(p(b, f"pub/f_{u}_22_644")))[1]),
            (f"{uname} chmod own 02755 (own group)", user, 0o022,
             lambda b, u=uname: (os.chmod(p(b, f"pub/f_{u}_22_777"), 0o2755), attrs(p(b, f"pub/f_{u}_22_777")))[1]),
            (f"{uname} chmod 02755 in sgid_open (group 4343)", user, 0o022,
             lambda b, u=uname: (os.chmod(p(b, f"sgid_open/{u}"), 0o2755), attrs(p(b, f"sgid_open/{u}")))[1]),
            (f"{uname} chmod root's file", user, 0o022, lambda b: os.chmod(p(b, "pub/rootfile"), 0o777)),
            (f"{uname} chown own to self", user, 0o022,
             lambda b, u=uname, i=user: (os.chown(p(b, f"pub/f_{u}_77_644"), i[0], -1), attrs(p(b, f"pub/f_{u}_77_644")))[1]),
            (f"{uname} chown own to root", user, 0o022, lambda b, u=uname: os.chown(p(b, f"pub/f_{u}_77_644"), 0, -1)),
            (f"{uname} chgrp own to 4343", user, 0o022,
             lambda b, u=uname: (os.chown(p(b, f"pub/f_{u}_77_4755"), -1, OTHER), attrs(p(b, f"pub/f_{u}_77_4755")))[1]),
            (f"{uname} truncate own set-id file", user, 0o022,
             lambda b, u=uname: (os.truncate(p(b, f"pub/f_{u}_22_4755"), 3), attrs(p(b, f"pub/f_{u}_22_4755")))[1]),
            (f"{uname} truncate root's file", user, 0o022, lambda b: os.truncate(p(b, "pub/rootfile"), 0)),
            (f"{uname} utime own", user, 0o022,
             lambda b, u=uname: (os.utime(p(b, f"pub/f_{u}_77_777"), ns=(10**18, 2 * 10**18)),
                                 os.lstat(p(b, f"pub/f_{u}_77_777")).st_mtime_ns)[1]),
            (f"{uname} utime root's file", user, 0o022, lambda b: os.utime(p(b, "pub/rootfile"), ns=(10**18, 10**18))),
            (f"{uname} utime now, writable root's file", user, 0o022, lambda b: os.utime(p(b, "pub/rootfile666"))),
            (f"{uname} O_TRUNC root's file in sticky", user, 0o022,
             lambda b: write_file(p(b, "sticky/rootfile"), 0o644, flags=os.O_WRONLY | os.O_TRUNC)),
            (f"{uname} O_TRUNC root's 0666 file in sticky", user, 0o022,
             lambda b: write_file(p(b, "sticky/rootfile666"), 0o644, flags=os.O_WRONLY | os.O_TRUNC)),
            (f"{uname} create own in sticky", user, 0o022, lambda b, u=uname: write_file(p(b, f"sticky/{u}_new"), 0o644)),
            (f"{uname} rename own over root's in sticky", user, 0o022,
             lambda b, u=uname: os.rename(p(b, f"sticky/{u}_new"), p(b, "sticky/rootfile"))),
            (f"{uname} rename own in sticky", user, 0o022,
             lambda b, u=uname: os.rename(p(b, f"sticky/{u}_new"), p(b, f"sticky/{u}_moved"))),
            (f"{uname} unlink root's in sticky", user, 0o022, lambda b: os.unlink(p(b, "sticky/rootfile666"))),
            (f"{uname} rmdir root's in sticky", user, 0o022, lambda b: os.rmdir(p(b, "sticky/rootdir"))),
            (f"{uname} unlink root's in pub (not sticky)", user, 0o022, lambda b: os.unlink(p(b, "pub/rootfile"))),
            (f"{uname} rename own in pub", user, 0o022,
             lambda b, u=uname: os.rename(p(b, f"pub/f_{u}_77_644"), p(b, f"pub/r_{u}"))),
            (f"{uname} unlink own", user, 0o022, lambda b, u=uname: os.unlink(p(b, f"pub/r_{u}"))),
            (f"{uname} rmdir own", user, 0o022, lambda b, u=uname: os.rmdir(p(b, f"pub/d_{u}_77"))),
            (f"{uname} mknod regular", user, 0o022,
             lambda b, u=uname: (os.mknod(p(b, f"pub/n_{u}"), 0o640 | stat.S_IFREG), attrs(p(b, f"pub/n_{u}")))[1]),
            (f"{uname} mknod device", user, 0o022,
             lambda b, u=uname: os.mknod(p(b, f"pub/c_{u}"), 0o644 | stat.S_IFCHR, os.makedev(1, 3))),
            (f"{uname} symlink", user, 0o022,
             lambda b, u=uname: (os.symlink("target", p(b, f"pub/l_{u}")), attrs(p(b, f"pub/l_{u}")))[1]),
            (f"{uname} copy of id with 04755", user, 0o022, lambda b, u=uname: copy_id(p(b, f"pub/id_{u}"))),
        ]
    ops.append(("testu chown own to nobody", TESTU, 0o022, lambda b: os.chown(os.path.join(b, "home/mine"), NOBODY[0], -1)))
    ops.append(("testu user xattr", TESTU, 0o022,
                lambda b: (os.setxattr(os.path.join(b, "home/mine"), "user.k", b"v"),
                           os.getxattr(os.path.join(b, "home/mine"), "user.k").decode())[1]))
    return ops


def tree_attrs(base):
    out = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if not (dirpath == base and d == ".ucpfs")]
        for n in dirnames + filenames:
            path = os.path.join(dirpath, n)
            out[os.path.relpath(path, base)] = attrs(path)
    return out


def compare_ops(plain, src, mnt):
    mismatches = []
    for label, user, um, fn in operations():
        a = as_user(user, um, lambda: fn(plain))
        b = as_user(user, um, lambda: fn(mnt))
        if a[0] == "exc" or b[0] == "exc":
            mismatches.append(f"{label}: exception plain={a} mount={b}")
        elif a != b:
            mismatches.append(f"{label}: plain={a} mount={b}")
    # mkfifo: allowed in the plain directory, refused (EPERM) in the mount.
    fifo = [as_user(NOBODY, 0o022, lambda b=b: os.mkfifo(os.path.join(b, "pub/fifo"))) for b in (plain, mnt)]
    if fifo != [("ok", None), ("err", "EPERM")]:
        mismatches.append(f"mkfifo: {fifo}")
    else:
        os.unlink(os.path.join(plain, "pub/fifo"))
    assert not mismatches, "\n  " + "\n  ".join(mismatches)


def compare_trees(plain, other, what):
    a, b = tree_attrs(plain), tree_attrs(other)
    diff = [f"{k}: plain={a.get(k)} {what}={b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    assert not diff, f"{len(diff)} differ:\n  " + "\n  ".join(diff[:40])


def exploit_probe(src):
    st = os.lstat(os.path.join(src, "pub/id_nobody"))
    assert st.st_uid == NOBODY[0], f"nobody's copy of id is owned by uid {st.st_uid}"
    assert not (st.st_uid == 0 and st.st_mode & stat.S_ISUID), "a root-owned setuid file"
    leftovers = [n for n in os.listdir(os.path.join(src, "pub")) if n.startswith(".ucpfs-create.")]
    assert not leftovers, f"placeholders left: {leftovers}"


def sticky_race(src, mnt):
    """nobody saves a new name in the sticky directory; root makes that name from outside before
    the save is closed: nobody could not have replaced root's file, so it is not replaced (the
    save stays pending, `ucpfs sync` fails naming it) until nobody unlinks its own."""
    go, ready = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([NOBODY[2][0]])
            os.setresgid(NOBODY[1], NOBODY[1], NOBODY[1])
            os.setresuid(NOBODY[0], NOBODY[0], NOBODY[0])
            fd = os.open(os.path.join(mnt, "sticky/race"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"nobody's")
            os.write(ready[1], b"1")
            os.read(go[0], 1)
            os.close(fd)
            code = 0
        finally:
            os._exit(code)
    os.read(ready[0], 1)
    with open(os.path.join(src, "sticky/race"), "wb") as f:
        f.write(b"root's")
    os.write(go[1], b"1")
    _, status = os.waitpid(pid, 0)
    assert status == 0, f"nobody's save failed: {status}"
    for _ in range(100):  # the kernel sends the release after close(2) returns
        r = run([ucpfs_bin(), "sync", mnt], check=False)
        if r.returncode != 0:
            break
        time.sleep(0.05)
    assert r.returncode != 0 and "race" in r.stderr + r.stdout, f"sync: {r.returncode} {r.stderr}"
    assert open(os.path.join(src, "sticky/race"), "rb").read() == b"root's", "root's file was replaced"
    assert as_user(NOBODY, 0o022, lambda: os.unlink(os.path.join(mnt, "sticky/race"))) == ("ok", None)
    run([ucpfs_bin(), "sync", mnt])
    assert open(os.path.join(src, "sticky/race"), "rb").read() == b"root's"


# ---- ordinary tools ----

def tool_tree(base):
    """A small tree owned by TESTU: modes, old mtimes, a symlink, a subdirectory."""
    os.makedirs(os.path.join(base, "sub"))
    files = {"a.bin": (0o640, b"a" * 5000), "run.sh": (0o755, b"#!/bin/sh\necho hi\n"),
             "sub/secret": (0o600, b"s" * 70000), "sub/empty": (0o644, b"")}
    for rel, (mode, data) in files.items():
        p = os.path.join(base, rel)
        with open(p, "wb") as f:
            f.write(data)
        os.chmod(p, mode)
    # cp -a copies it (onto a file still being saved: the mount places it first).
    os.setxattr(os.path.join(base, "a.bin"), "user.origin", b"tool tree")
    os.symlink("a.bin", os.path.join(base, "link"))
    os.chmod(os.path.join(base, "sub"), 0o750)
    for i, rel in enumerate(["a.bin", "run.sh", "sub/secret", "sub/empty", "link", "sub", "."]):
        p = os.path.join(base, rel)
        os.lchown(p, TESTU[0], OTHER)
        os.utime(p, ns=(1_500_000_000_000_000_000 + i * 10**9, 1_600_000_000_123_456_789 + i * 10**9),
                 follow_symlinks=False)


def full_tree(base):
    out = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if not (dirpath == base and d == ".ucpfs")]
        for n in dirnames + filenames + ["."] * (dirpath == base):
            path = os.path.normpath(os.path.join(dirpath, n))
            st = os.lstat(path)
            entry = [stat.filemode(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns]
            if stat.S_ISREG(st.st_mode):
                entry += [st.st_size, hashlib.sha256(open(path, "rb").read()).hexdigest()[:16],
                          sorted((n, os.getxattr(path, n).decode()) for n in os.listxattr(path))]
            if stat.S_ISLNK(st.st_mode):
                entry.append(os.readlink(path))
            out[os.path.relpath(path, base)] = entry
    return out


def tools(work, plain, src, mnt):
    tree = os.path.join(work, "tree")
    tool_tree(tree)
    tarball = os.path.join(work, "tree.tar")
    run(["tar", "-C", tree, "-cf", tarball, "."])
    for base in (plain, mnt):
        run(["cp", "-a", tree, os.path.join(base, "cpa")])  # exits 0 (no EROFS from setxattr)
        os.mkdir(os.path.join(base, "tarx"))
        run(["tar", "-C", os.path.join(base, "tarx"), "-xf", tarball])
        run(["rsync", "-a", tree + "/", os.path.join(base, "rs") + "/"])
    run([ucpfs_bin(), "sync", mnt])
    diffs = []
    for sub in ("cpa", "tarx", "rs"):
        want = full_tree(os.path.join(plain, sub))
        for what, got in (("src", full_tree(os.path.join(src, sub))), ("mount", full_tree(os.path.join(mnt, sub)))):
            diffs += [f"{sub}/{k} ({what}): plain={want.get(k)} {what}={got.get(k)}"
                      for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    assert not diffs, f"{len(diffs)} differ:\n  " + "\n  ".join(diffs[:40])


def xattrs_and_mmap(src, mnt):
    f = os.path.join(mnt, "pub/rootfile666")
    os.setxattr(f, "user.tool", b"kept")
    assert os.getxattr(os.path.join(src, "pub/rootfile666"), "user.tool") == b"kept"
    assert "user.tool" in os.listxattr(f)
    os.removexattr(f, "user.tool")
    for name in ("trusted.x", "security.capability"):
        try:
            os.setxattr(f, name, b"\x01\x00\x00\x02" + b"\0" * 16)
            raise AssertionError(f"setxattr {name} through the mount succeeded")
        except OSError as e:
            assert e.errno in (errno.ENOTSUP, errno.EPERM), f"setxattr {name}: {e}"
    assert os.listxattr(os.path.join(src, "pub/rootfile666")) == []
    # A file opened for writing bypasses the page cache: MAP_SHARED is ENODEV without --materialize
    # (docs/reference.md; kernel_fast_paths_test.py maps one with it).
    path = os.path.join(mnt, "pub/mapped")
    with open(path, "w+b") as fh:
        fh.write(b"\0" * 4096)
        fh.flush()
        try:
            mmap.mmap(fh.fileno(), 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            raise AssertionError("writable MAP_SHARED of a file opened for writing worked: update docs/reference.md")
        except OSError as e:
            assert e.errno == errno.ENODEV, e
        with mmap.mmap(fh.fileno(), 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            m[:2] = b"ok"  # a private copy: works
    with open(path, "rb") as fh:  # read-only: maps
        with mmap.mmap(fh.fileno(), 4096, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            assert m[:4] == b"\0" * 4


def map_write(path, flags, size=3 * 4096):
    """Opens `path` with `flags`, maps it writable MAP_SHARED, writes through the map before and
    after the descriptor's close: (owner, group, mode) then, or the errno of the open or mmap."""
    fd = os.open(path, flags, 0o644)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    mm[0:5] = b"first"
    mm[8192:8197] = b"after"  # the descriptor is closed: the mapping still writes back
    mm.close()
    return attrs(path)


def map_read_only_for_write(path):
    """A read-only descriptor of another's file mapped writable MAP_SHARED: the kernel refuses."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()
    finally:
        os.close(fd)


def shared_maps(work, plain, src):
    """With --materialize (FUSE_DIRECT_IO_ALLOW_MMAP), a file opened for writing maps writable
    MAP_SHARED: the kernel's writeback of such a map is not made by the writer (a kernel thread
    may send it), so what it writes must be taken as the opener's. As nobody and as the test user,
    in a fresh allow_other mount: the same result codes as the plain directory, and once synced
    the same bytes, owner, group and mode."""
    mnt, cache = os.path.join(work, "mnt-mat"), os.path.join(work, "mat-cache")
    new = os.O_RDWR | os.O_CREAT | os.O_EXCL
    ops = [("nobody new file", NOBODY, lambda b: map_write(os.path.join(b, "pub/map_nobody"), new)),
           ("testu new file in home", TESTU, lambda b: map_write(os.path.join(b, "home/map_testu"), new)),
           ("nobody root's 0666 file", NOBODY, lambda b: map_write(os.path.join(b, "pub/rootfile666"), os.O_RDWR)),
           ("nobody root's 0644 file for writing", NOBODY,
            lambda b: map_write(os.path.join(b, "pub/map_root"), os.O_RDWR)),
           ("nobody root's 0644 file read-only, mapped writable", NOBODY,
            lambda b: map_read_only_for_write(os.path.join(b, "pub/map_root")))]
    for base in (plain, src):
        with open(os.path.join(base, "pub/map_root"), "wb") as f:
            f.write(b"root's" + b"\0" * (3 * 4096 - 6))
        os.chmod(os.path.join(base, "pub/map_root"), 0o644)
    mismatches = []
    with mounted(src, mnt, "-o", "allow_other", "-q", "--materialize", cache, timeout_s=120) as (m, _):
        for label, user, fn in ops:
            a, b = as_user(user, 0o022, lambda: fn(plain)), as_user(user, 0o022, lambda: fn(m))
            if a[0] == "exc" or b[0] == "exc" or a != b:
                mismatches.append(f"{label}: plain={a} mount={b}")
        run([ucpfs_bin(), "sync", m])
    assert not mismatches, "\n  " + "\n  ".join(mismatches)
    for rel in ("pub/map_nobody", "home/map_testu", "pub/rootfile666", "pub/map_root"):
        want, got = (open(os.path.join(b, rel), "rb").read() for b in (plain, src))
        assert got == want, f"{rel}: {got[:16]!r}... in SRC, {want[:16]!r}... in the plain directory"
        assert attrs(os.path.join(src, rel)) == attrs(os.path.join(plain, rel)), rel
    assert open(os.path.join(src, "pub/map_nobody"), "rb").read(5) == b"first"


def main():
    if os.geteuid() != 0:
        print("permissions_test: needs root (it drops privileges in child processes); skipped")
        sys.exit(0)
    res = Results("permissions")
    with tmpdir("/tmp/capture-creds-perm-") as work:
        os.chmod(work, 0o755)
        plain, src, mnt = (os.path.join(work, n) for n in ("plain", "src", "mnt"))
        for d in (plain, src):
            os.mkdir(d)
            build_tree(d)
        with mounted(src, mnt, "-o", "allow_other", "-q", timeout_s=240) as (m, _):
            res.check("every write operation as nobody and as a user with a group: same result codes",
                      lambda: compare_ops(plain, src, m))
            res.check("owner, group, mode through the mount equal the plain directory's",
                      lambda: compare_trees(plain, m, "mount"))
            run([ucpfs_bin(), "sync", m])
            res.check("owner, group, mode in SRC after sync equal the plain directory's",
                      lambda: compare_trees(plain, src, "src"))
            res.check("nobody's setuid copy of id is not root's; no placeholder left", lambda: exploit_probe(src))
            res.check("a name root makes in the sticky directory while nobody's save is pending is kept",
                      lambda: sticky_race(src, m))
            res.check("user.* xattrs pass through, others refused; writable MAP_SHARED is ENODEV",
                      lambda: xattrs_and_mmap(src, m))
            res.check("cp -a, tar x, rsync -a into the mount give the plain directory's tree",
                      lambda: tools(work, plain, src, m))
        res.check("with --materialize, writable MAP_SHARED maps by nobody and a user land as theirs, "
                  "byte-exact; a read-only descriptor cannot map writable", lambda: shared_maps(work, plain, src))
    res.finish()


if __name__ == "__main__":
    main()
