"""ucpfs: a training checkpoint (PyTorch DCP, DeepSpeed, Megatron, Hugging Face) served as
resharded views, from Python.

- ``ucpfs.open(SRC)``: the namespace a mount of SRC shows (``atomic/``, ``target/<layout>/``,
  ``<tag>_universal/``, ``safetensors/`` and the source's own files), without FUSE, root or
  ``/dev/fuse``: every file opens as a seekable read-only binary file object.
- ``ucpfs.mount(SRC, MNT, ...)``: a real mount for those who may mount, as a context manager.

Nothing here needs torch.
"""

__version__ = "0.1.0"


def _load_core():
    # The extension links the system libraries a Debian 12 base image may lack; say which and how
    # to get them rather than a bare "cannot open shared object file".
    try:
        from . import _core
    except ImportError as e:
        text = str(e)
        for lib, pkg in (("liblmdb", "liblmdb0"), ("liburing", "liburing2"), ("libxxhash", "libxxhash0"),
                         ("libre2", "libre2-9"), ("libz.so", "zlib1g")):
            if lib in text:
                raise ImportError(
                    f"ucpfs needs the system library {lib} ({text}); on Debian 12: "
                    f"apt-get install {pkg} (all of ucpfs's: apt-get install liblmdb0 liburing2 "
                    f"libxxhash0 libre2-9 zlib1g, and fuse3 to mount)") from e
        raise
    return _core


_core = _load_core()

from .views import Views, Dir, ViewFile, open  # noqa: E402  (after the library check)
from .mount import Mount, MountError, mount, binary  # noqa: E402

__all__ = ["open", "Views", "Dir", "ViewFile", "mount", "Mount", "MountError", "binary"]
