// The one place a Status becomes the errno a FUSE request is answered with.
//
// Rule: kNotFound is ENOENT; a Status that carries the errno of the failed system call (or the
// POSIX answer the Filesystem chose, e.g. ENOTDIR, EROFS) answers with it; kNoSpace is ENOSPC;
// everything else is EIO (kOutOfRange from a source means the tree and the source disagree,
// since reads are clipped to the node size first: a data error, not the caller's mistake).
#pragma once

#include <string>

#include "core/status.h"

namespace ucpfs::fs {

int ErrnoFromStatus(const Status& status);

// A Status answering with `sys_errno` (ENOTDIR, EISDIR, EROFS, ...), message for the log.
Status PosixError(int sys_errno, std::string message);

}  // namespace ucpfs::fs
