"""The views of a checkpoint without FUSE: ``ucpfs.open(SRC)``.

The namespace is the very one a mount of SRC shows: the extension serves it through the mount's
own FUSE-free ``Filesystem`` (fs/filesystem.h), so names, sizes and bytes are the mount's, and a
file is read lazily, with the mount's memory bound (a target rank file is built when opened and
holds no tensor bytes; its bytes are read from the source as they are asked for).

    v = ucpfs.open("/ckpt/global_step100")
    v.listdir()                                   # what `ls MNT` shows
    v.target("tp2_pp1_dp4").rank(3).listdir()     # model.pt, optim.pt, ucp_info.json
    with v.target("tp2_pp1_dp4").rank(3).open("model.pt") as f:
        state = torch.load(f, weights_only=True)
    v.open("atomic/decoder.weight/fp32.pt")       # any path of the mount
    v.hf.materialize("/scratch/hf")               # real files: from_pretrained, torch.load(mmap=True)

Not for: writing (views are read-only, and so are the source's files here); a run directory of
several checkpoints (open one of its checkpoints).
"""

import builtins
import errno
import fcntl
import hashlib
import io
import json
import os
import stat as _stat
import tempfile

from . import _core

# A file object reads the source in requests of this size at least (BufferedReader's buffer):
# torch.load asks for small records and tensors; one request per record would be slow.
_BUFFER_N_BYTES = 1 << 20
# A file is materialised in pieces of this size (the mount's --materialize reads the same): the
# memory it takes is bounded whatever the file's size.
_MATERIALIZE_CHUNK_N_BYTES = 8 << 20
# In each directory materialised into: what each file there was made from (its generation key
# and the file's own stat when written), so an unchanged source is not computed again; and the
# lock that makes two processes (two ranks) materialising there take turns.
_STAMP_NAME = ".ucpfs-materialized.json"
_LOCK_NAME = ".ucpfs-materialized.lock"


class ViewFile(io.RawIOBase):
    """One open read-only file of the views: seekable, ``readinto`` at any offset. ``Dir.open``
    wraps it in an ``io.BufferedReader``; torch.load, safetensors.torch.load(f.read()) and
    anything that takes a binary file object read it."""

    def __init__(self, node, name):
        super().__init__()
        self._handle = node.open()
        self._pos = 0
        self.name = name

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, buffer):
        self._checkClosed()
        n = self._handle.readinto(self._pos, buffer)
        self._pos += n
        return n

    def seek(self, offset, whence=io.SEEK_SET):
        self._checkClosed()
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._handle.size + offset
        else:
            raise ValueError(f"invalid whence ({whence})")
        if pos < 0:
            raise OSError(22, f"{self.name}: negative seek position {pos}")
        self._pos = pos
        return pos

    def tell(self):
        self._checkClosed()
        return self._pos

    def readall(self):
        self._checkClosed()
        buf = bytearray(max(self._handle.size - self._pos, 0))
        n = self._handle.readinto(self._pos, buf) if buf else 0
        self._pos += n
        return bytes(buf[:n])

    def close(self):
        self._handle = _Closed(self._handle.size) if hasattr(self, "_handle") else None
        super().close()

    @property
    def size(self):
        return self._handle.size


class _Closed:
    def __init__(self, size):
        self.size = size


class Dir:
    """A directory of the views. ``d / "name"`` or ``d["name"]`` is a child (a Dir, or for a file
    its ``Entry``), ``d.listdir()`` lists it as ``os.listdir`` of the mount would, ``d.open(name)``
    opens a file in it (a path with ``/`` goes down several levels)."""

    def __init__(self, views, node, path):
        self._views = views
        self._node = node
        self.path = path  # relative to the root of the views ("" for the root)

    def __repr__(self):
        return f"<ucpfs.Dir {self.path or '/'} of {self._views.source_dir}>"

    def listdir(self, path=""):
        return self._walk(path)._node.list() if path else self._node.list()

    def __iter__(self):
        return iter(self.listdir())

    def __contains__(self, name):
        try:
            self._node.child(name)
            return True
        except FileNotFoundError:
            return False

    def _walk(self, path):
        node, at = self._node, self.path
        for part in [p for p in path.split("/") if p and p != "."]:
            node = node.child(part)
            at = f"{at}/{part}" if at else part
        mode = node.stat()[0]
        return Dir(self._views, node, at) if _stat.S_ISDIR(mode) else Entry(self._views, node, at)

    def __truediv__(self, path):
        return self._walk(path)

    __getitem__ = __truediv__

    def dir(self, path):
        """The subdirectory ``path``. Errors: FileNotFoundError, NotADirectoryError."""
        found = self._walk(path)
        if not isinstance(found, Dir):
            raise NotADirectoryError(20, f"{found.path}: not a directory")
        return found

    def open(self, path, mode="rb", buffering=-1):
        """``path`` (below this directory) as a read-only binary file object: an
        ``io.BufferedReader`` over a ``ViewFile`` (``buffering=0``: the ViewFile itself)."""
        return self._walk(path).open(mode, buffering)

    def stat(self, path=""):
        return (self._walk(path) if path else self).stat_result()

    def stat_result(self):
        mode, size, mtime = self._node.stat()
        return os.stat_result((mode, 0, 0, 1, 0, 0, size, mtime, mtime, mtime))

    def materialize(self, dst_dir):
        """Writes every file below this directory as a real file under ``dst_dir`` (made when
        missing; subdirectories alike) and returns ``dst_dir``: what needs a path rather than a
        file object (``AutoModelForCausalLM.from_pretrained(dst_dir)`` of ``.hf``,
        ``torch.load(path, mmap=True)``) takes it. See ``Entry.materialize``."""
        dst_dir = os.fspath(dst_dir)
        os.makedirs(dst_dir, exist_ok=True)
        with _Stamps(dst_dir) as stamps:
            for name in self.listdir():
                child = self / name
                if isinstance(child, Dir):
                    child.materialize(os.path.join(dst_dir, name))
                else:
                    child._materialize_into(stamps, name)
        return dst_dir

    # -- the mount's views (the names a mount shows at its root) --
    def target(self, layout):
        """``target/<layout>/`` (e.g. "tp2_pp1_dp4"), built when first asked, as a mount's lookup
        builds it. Errors: FileNotFoundError naming why a layout does not fit the model."""
        d = self.dir("target/" + layout)
        return TargetDir(d._views, d._node, d.path)


class TargetDir(Dir):
    """``target/<layout>/``: ``rank(n)`` is ``rank_<n>/``."""

    def rank(self, n):
        return self.dir(f"rank_{int(n)}")


class Entry:
    """A file of the views: ``open()`` it; ``real_path`` is the real file when it is one of the
    source's own (so ``torch.load(e.real_path, mmap=True)`` works), else None."""

    def __init__(self, views, node, path):
        self._views = views
        self._node = node
        self.path = path

    def __repr__(self):
        return f"<ucpfs.Entry {self.path} of {self._views.source_dir}>"

    @property
    def size(self):
        return self._node.stat()[1]

    @property
    def real_path(self):
        if not self._node.is_source:
            return None
        return os.path.join(self._views.source_dir, self.path)

    def open(self, mode="rb", buffering=-1):
        if mode not in ("r", "rb"):
            raise OSError(30, f"{self.path}: the views are read-only (mode {mode!r})")
        raw = ViewFile(self._node, self.path)
        if buffering == 0:
            return raw
        return io.BufferedReader(raw, _BUFFER_N_BYTES if buffering in (-1, 1) else buffering)

    def stat_result(self):
        mode, size, mtime = self._node.stat()
        return os.stat_result((mode, 0, 0, 1, 0, 0, size, mtime, mtime, mtime))

    def materialize(self, path):
        """This file's bytes as the real file ``path`` (its directory must exist); returns
        ``path``. Computed through the core as a read of the mount's would be, streamed in 8 MiB
        pieces, written to a temporary file beside ``path`` and renamed over it (a reader never
        sees a partial file). Reused, not computed again, while the source is unchanged (the
        source's fingerprint, this view's path, size and options are what ``path`` was made
        from, and ``path`` itself was not modified since). Errors: OSError naming the file."""
        path = os.fspath(path)
        parent, name = os.path.split(os.path.abspath(path))
        with _Stamps(parent) as stamps:
            self._materialize_into(stamps, name)
        return path

    def _generation_key(self):
        mode, size, mtime = self._node.stat()
        what = [self._views.source_dir, self._views.fingerprint, self._views.options_key, self.path, size, mtime]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest(), size

    def _materialize_into(self, stamps, name):
        if name.startswith(".ucpfs-materialized"):  # a source file named like our own records
            raise OSError(errno.EINVAL, f"{self.path}: cannot be materialised: its name is ucpfs's ({name})")
        key, size = self._generation_key()
        if stamps.fresh(name, key):
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".ucpfs-tmp", dir=stamps.dir)
        try:
            with os.fdopen(fd, "wb") as out, self.open(buffering=0) as raw:
                buf = memoryview(bytearray(max(1, min(size, _MATERIALIZE_CHUNK_N_BYTES))))
                n_bytes = 0
                while True:
                    n = raw.readinto(buf)
                    if not n:
                        break
                    out.write(buf[:n])
                    n_bytes += n
            if n_bytes != size:
                raise OSError(errno.EIO, f"{self.path}: {n_bytes} bytes read of {size}")
            os.chmod(tmp, 0o644 & ~_UMASK)
            os.replace(tmp, os.path.join(stamps.dir, name))
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        stamps.record(name, key)


def _read_umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once, at import: os.umask can only be read by setting it


class _Stamps:
    """The stamp file of one directory materialised into, held under its lock (flock) from
    ``with`` to its end, and written back (temporary file, rename) if it changed."""

    def __init__(self, dst_dir):
        self.dir = dst_dir

    def __enter__(self):
        self._lock = os.open(os.path.join(self.dir, _LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o644)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            with builtins.open(os.path.join(self.dir, _STAMP_NAME)) as f:
                self._stamps = json.load(f)
            if not isinstance(self._stamps, dict):
                self._stamps = {}
        except (OSError, ValueError):
            self._stamps = {}
        self._changed = False
        return self

    def fresh(self, name, key):
        """``name`` here was made from ``key`` and has not been modified or replaced since."""
        want = self._stamps.get(name)
        try:
            st = os.stat(os.path.join(self.dir, name), follow_symlinks=False)
        except OSError:
            return False
        return isinstance(want, dict) and want == _stamp_of(key, st)

    def record(self, name, key):
        self._stamps[name] = _stamp_of(key, os.stat(os.path.join(self.dir, name), follow_symlinks=False))
        self._changed = True

    def __exit__(self, *exc):
        try:
            if self._changed:
                fd, tmp = tempfile.mkstemp(prefix=_STAMP_NAME + ".", dir=self.dir)
                with os.fdopen(fd, "w") as f:
                    json.dump(self._stamps, f)
                os.replace(tmp, os.path.join(self.dir, _STAMP_NAME))
        finally:
            os.close(self._lock)


def _stamp_of(key, st):
    if not _stat.S_ISREG(st.st_mode):
        return None
    return {"key": key, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}



class Views(Dir):
    """The root of the views of one checkpoint (``ucpfs.open``)."""

    # The views a mount shows at its root, by attribute. A view added to the mount (e.g. hf/) is
    # one line here.
    _VIEW_DIRS = {
        "atomic": "atomic",
        "safetensors": "safetensors",
        "hf": "hf",
    }

    def __init__(self, session, options_key=""):
        self._session = session
        super().__init__(self, session.root(), "")
        self.source_dir = session.source_dir
        # What a materialised file is made from besides the source: the options that shape views.
        self.fingerprint = session.fingerprint
        self.options_key = options_key
        self.index_dir = session.index_dir
        self.index_state = session.index_state  # "reused", "built", ...

    def __repr__(self):
        return f"<ucpfs.Views of {self.source_dir} (index {self.index_dir})>"

    def __getattr__(self, name):
        view = Views._VIEW_DIRS.get(name)
        if view is None:
            raise AttributeError(name)
        return self.dir(view)

    @property
    def universal(self):
        """DeepSpeed's ``<tag>_universal/``: the one ``latest_universal`` names, else the only one.
        Errors: FileNotFoundError when the checkpoint has none (not DeepSpeed, or the view could
        not be built: see ``status``)."""
        if "latest_universal" in self.listdir():
            with self.open("latest_universal") as f:
                return self.dir(f.read().decode().strip())
        found = [n for n in self.listdir() if n.endswith("_universal") and isinstance(self / n, Dir)]
        if len(found) != 1:
            raise FileNotFoundError(2, f"{self.source_dir}: {len(found)} *_universal views: "
                                       f"{', '.join(found) or 'none'}")
        return self.dir(found[0])

    @property
    def status(self):
        """What a mount's ``.ucpfs/status.json`` says (the views, the index, what was refused)."""
        import json
        return json.loads(self._session.status_json)


def _user_index_dir(src):
    # Where an index of an unwritable SRC goes when the user's cache (what the C++ side picks:
    # $XDG_CACHE_HOME or ~/.cache) cannot be written either (a service user whose home is
    # /nonexistent): a directory of this user's in the temporary directory.
    key = hashlib.sha256(os.path.realpath(src).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"ucpfs-{os.getuid()}", key)


def open(src, index_dir=None, read_only_index=False, lookup_memory_mib=256,
         safetensors_shard_size=5_000_000_000, rules=None):
    """The views of checkpoint ``src`` (a directory), as ``ucpfs mount SRC MNT`` would show them.

    ``index_dir``: where the index is kept (``ucpfs mount --index-dir``); by default SRC/.ucpfs,
    or when SRC is not writable the user's cache directory (``~/.cache/ucpfs/<hash>``), or when
    that cannot be written either ``$TMPDIR/ucpfs-<uid>/<hash>``. ``read_only_index``: use a
    prebuilt index and write nothing (``--read-only-index``). ``rules``: a key-rules file
    (``--rules``). Errors: OSError subclasses naming
    the file (FileNotFoundError when SRC holds no checkpoint)."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        raise NotADirectoryError(20, f"{src}: not a directory")
    args = dict(read_only_index=read_only_index, lookup_memory_mib=lookup_memory_mib,
                safetensors_shard_n_bytes=safetensors_shard_size,
                rules=os.fspath(rules) if rules is not None else "")
    rules_sha = ""
    if rules is not None:
        with builtins.open(rules, "rb") as f:
            rules_sha = hashlib.sha256(f.read()).hexdigest()
    options_key = json.dumps([safetensors_shard_size, rules_sha, _core_version()])
    if index_dir is not None:
        return Views(_core.open_session(src, os.fspath(index_dir), **args), options_key)
    try:
        return Views(_core.open_session(src, "", **args), options_key)
    except PermissionError:
        if read_only_index:
            raise
    # SRC/.ucpfs exists but is not ours to write (e.g. made by a root mount, and stale), or the
    # user's cache is not writable: the user's cache, then a directory of ours in $TMPDIR.
    try:
        return Views(_core.open_session(src, _core.cache_index_dir(src), **args), options_key)
    except PermissionError:
        pass
    fallback = _user_index_dir(src)
    os.makedirs(fallback, mode=0o700, exist_ok=True)
    return Views(_core.open_session(src, fallback, **args), options_key)


def _core_version():
    # A new ucpfs may compute a view's bytes differently: its files are not reused.
    from . import __version__  # noqa: PLC0415
    return __version__
