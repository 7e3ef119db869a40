// See errno_map.h for the rule.
#include "fs/errno_map.h"

#include <cerrno>
#include <utility>

namespace ucpfs::fs {

int ErrnoFromStatus(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk: return 0;
    case StatusCode::kNotFound: return ENOENT;
    case StatusCode::kNoSpace: return ENOSPC;
    default: return status.sys_errno() != 0 ? status.sys_errno() : EIO;
  }
}

Status PosixError(int sys_errno, std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message), sys_errno);
}

}  // namespace ucpfs::fs
