// What is mounted where, from /proc/self/mountinfo: used to refuse unsafe mounts (a mount
// point inside its own source, a second mount over a live one), to clear a dead ucpfs mount
// (its daemon gone: "Transport endpoint is not connected") and to make `ucpfs umount` act only
// on ucpfs mounts.
//
// Not for: mounting (fuse_mount.h). Paths are compared as the kernel lists them (absolute,
// symlinks resolved by the caller).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace ucpfs::fs {

struct MountEntry {
  std::string mount_point;  // unescaped (mountinfo writes space, tab, newline, '\' as octal)
  std::string fs_type;      // e.g. "fuse.ucpfs", "tmpfs"
  std::string source;
};

// Every entry of /proc/self/mountinfo, in its order (later entries are mounted on top).
// Errors: kIo when the file cannot be read.
Result<std::vector<MountEntry>> ReadMounts(const std::string& mountinfo = "/proc/self/mountinfo");

// The topmost mount at exactly `path`, if any.
Result<std::optional<MountEntry>> TopMountAt(const std::string& path);

// True for a ucpfs mount ("fuse.ucpfs").
bool IsUcpfs(const MountEntry& m);

// Refuses a mount point equal to SRC, inside it, or containing it (a checkpoint mounted onto
// itself deadlocks the kernel connection). Both paths absolute and resolved.
// Errors: kInvalidArgument saying which.
Status CheckMountPointAgainstSource(const std::string& src, const std::string& mnt);

// Prepares `mnt` for a new mount: nothing mounted there -> ok; a dead ucpfs mount (statvfs fails
// with ENOTCONN) -> detached (lazy unmount), ok; a live mount of any kind, or a dead mount that
// is not ucpfs -> kInvalidArgument saying what is there and how to clear it.
Status PrepareMountPoint(const std::string& mnt);

// `ucpfs umount`: unmounts `mnt` only when its topmost mount is ucpfs. Errors: kInvalidArgument
// when nothing or something else is mounted there (naming its type); Unmount's errors.
Status UnmountUcpfs(const std::string& mnt);

}  // namespace ucpfs::fs
