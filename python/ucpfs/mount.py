"""A real mount from Python, for those who may mount (root, or a user with /dev/fuse and
fusermount3):

    with ucpfs.mount(SRC, MNT, layout="tp2_pp1_dp4") as m:
        torch.load(m.path / "target/tp2_pp1_dp4/rank_0/model.pt")

It runs the `ucpfs mount` binary (which returns once the mount is ready), and on exit
`ucpfs umount` (which returns once the daemon has exited, its saves made durable). A mount that
fails raises MountError with the daemon's own error text.
"""

import os
import pathlib
import shutil
import subprocess


class MountError(RuntimeError):
    """`ucpfs mount` or `ucpfs umount` failed; the message is its error text."""


def binary():
    """The `ucpfs` binary: the one in this package (a wheel), else $UCPFS_BIN, else on PATH."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "ucpfs")
    for path in (here, os.environ.get("UCPFS_BIN")):
        if path and os.access(path, os.X_OK):
            return path
    found = shutil.which("ucpfs")
    # The `ucpfs` entry point of this package execs the binary; do not take it for the binary.
    if found and not _is_entry_point(found):
        return found
    raise FileNotFoundError(2, "the ucpfs binary: not in this package, $UCPFS_BIN or PATH")


def _is_entry_point(path):
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


class Mount:
    """A live mount: ``path`` (the mount point, a pathlib.Path), ``source``, ``umount()``."""

    def __init__(self, source, mountpoint, args, timeout_s):
        self.source = os.path.abspath(os.fspath(source))
        self.path = pathlib.Path(os.path.abspath(os.fspath(mountpoint)))
        self._args = args
        self._timeout_s = timeout_s
        self._mounted = False

    def __repr__(self):
        return f"<ucpfs.Mount {self.source} at {self.path}{'' if self._mounted else ' (not mounted)'}>"

    def _run(self, args, what):
        try:
            done = subprocess.run([binary()] + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, timeout=self._timeout_s)
        except subprocess.TimeoutExpired as e:
            raise MountError(f"ucpfs {what} {self.path}: no answer in {self._timeout_s} s") from e
        if done.returncode != 0:
            text = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            raise MountError(text)
        return done

    def start(self):
        self._run(["mount", self.source, str(self.path)] + self._args, "mount")
        self._mounted = True
        return self

    def umount(self):
        if self._mounted:
            self._run(["umount", str(self.path)], "umount")
            self._mounted = False

    def __enter__(self):
        return self if self._mounted else self.start()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.umount()
            return False
        # The block failed: its exception is the one to see. An unmount that fails now (busy:
        # the traceback may still hold a file or mmap of the mount) is a warning, not a new error.
        try:
            self.umount()
        except MountError as e:
            import warnings  # noqa: PLC0415
            warnings.warn(f"ucpfs: {self.path} stays mounted: {e}", RuntimeWarning, stacklevel=2)
        return False


def mount(source, mountpoint, layout=None, read_only=False, index_dir=None, options=(), timeout_s=600):
    """Mounts checkpoint ``source`` at ``mountpoint`` (an existing directory) and returns the
    Mount, ready; use it as a context manager to unmount on exit. ``layout``: a layout name or a
    list of them (``--layout``); ``read_only``: ``--read-only``; ``index_dir``: ``--index-dir``;
    ``options``: more arguments of ``ucpfs mount`` (e.g. ["--cache-size", "2G"]). Errors:
    MountError with the daemon's error text."""
    args = []
    layouts = [layout] if isinstance(layout, str) else list(layout or [])
    for name in layouts:
        args += ["--layout", name]
    if read_only:
        args.append("--read-only")
    if index_dir is not None:
        args += ["--index-dir", os.path.abspath(os.fspath(index_dir))]
    args += list(options)
    return Mount(source, mountpoint, args, timeout_s).start()
