"""The `ucpfs` command of the Python package: runs the C++ binary the wheel carries
(ucpfs/bin/ucpfs) with the same arguments, so `ucpfs mount ...` is the very daemon a source
build installs."""

import os
import sys

from .mount import binary


def main():
    path = binary()
    os.execv(path, [path] + sys.argv[1:])


if __name__ == "__main__":
    main()
