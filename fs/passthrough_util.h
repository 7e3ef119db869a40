// Helpers the Passthrough's files share (passthrough.cc, passthrough_files.cc,
// passthrough_names.cc). Internal to fs/.
#pragma once

#include <sys/stat.h>

#include <cstring>
#include <string>
#include <string_view>

#include "core/io/beneath.h"
#include "core/status.h"
#include "fs/errno_map.h"

namespace ucpfs::fs::passthrough_detail {

inline bool Shown(mode_t mode) { return S_ISREG(mode) || S_ISDIR(mode) || S_ISLNK(mode); }

// What an unprivileged write, truncation or chown leaves of a mode: S_ISUID goes, and S_ISGID
// when group-executable (the kernel's should_remove_suid).
inline mode_t KillPrivs(mode_t mode) {
  mode &= ~static_cast<mode_t>(S_ISUID);
  if ((mode & (S_ISGID | S_IXGRP)) == (S_ISGID | S_IXGRP)) mode &= ~static_cast<mode_t>(S_ISGID);
  return mode;
}

inline bool HasPrivs(mode_t mode) { return KillPrivs(mode) != mode; }

// Only the user namespace is passed through: the daemon keeps capabilities (CAP_SETFCAP for
// security.capability, CAP_SYS_ADMIN for trusted.*) that a switched fsuid does not drop.
inline bool UserXattr(const std::string& name) { return name.starts_with("user.") && name.size() > 5; }

inline Status Sys(int err, const std::string& what) { return PosixError(err, what + ": " + std::strerror(err)); }

using io::ProcFdPath;

// A name the kernel hands us is one component; refuse anything else outright.
inline Status CheckName(std::string_view name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos ||
      name.find('\0') != std::string_view::npos || name.size() > 255) {
    return PosixError(EINVAL, "invalid name");
  }
  return Status::Ok();
}

}  // namespace ucpfs::fs::passthrough_detail
