"""ucpfs: a training checkpoint (PyTorch DCP, DeepSpeed, Megatron, Hugging Face) served as
resharded views, from Python.

- ``ucpfs.open(SRC)``: the namespace a mount of SRC shows (``atomic/``, ``target/<layout>/``,
  ``<tag>_universal/``, ``safetensors/`` and the source's own files), without FUSE, root or
  ``/dev/fuse``: every file opens as a seekable read-only binary file object, and
  ``.materialize(DIR)`` writes a folder's files as real ones (``from_pretrained(DIR)``,
  ``torch.load(path, mmap=True)``).
- ``ucpfs.mount(SRC, MNT, ...)``: a real mount for those who may mount, as a context manager.
- ``ucpfs.torch.StorageReader(SRC)`` (``import ucpfs.torch``, needs torch): the checkpoint for
  ``torch.distributed.checkpoint.load``, into FSDP2 or tensor-parallel models; and
  ``ucpfs.torch.LazyStateDict(views.hf)`` for ``from_pretrained(None, state_dict=...)``.

Nothing but ``ucpfs.torch`` needs torch.
"""

__version__ = "0.1.0"


# The shared libraries the extension links (ldd), with their Debian 12 packages; the `ucpfs`
# binary also needs libfuse3-3 (and fuse3's fusermount3 to mount as a user).
_SYSTEM_LIBRARIES = (("liblmdb", "liblmdb0"), ("liburing", "liburing2"), ("libre2", "libre2-9"),
                     ("libtomlplusplus", "libtomlplusplus3"), ("libz.so", "zlib1g"))


def _load_core():
    # The extension links the system libraries a Debian 12 base image may lack; say which and how
    # to get them rather than a bare "cannot open shared object file".
    try:
        from . import _core
    except ImportError as e:
        text = str(e)
        for lib, pkg in _SYSTEM_LIBRARIES:
            if lib in text:
                raise ImportError(
                    f"ucpfs needs the system library {lib} ({text}); on Debian 12: apt-get install {pkg} "
                    f"(all that ucpfs needs: apt-get install {' '.join(p for _, p in _SYSTEM_LIBRARIES)} "
                    f"libfuse3-3 fuse3, the last two to mount)") from e
        raise
    return _core


_core = _load_core()

from .views import Views, Dir, ViewFile, open  # noqa: E402  (after the library check)
from .mount import Mount, MountError, mount, binary  # noqa: E402

__all__ = ["open", "Views", "Dir", "ViewFile", "mount", "Mount", "MountError", "binary"]
