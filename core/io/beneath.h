// Paths beneath a directory descriptor, never through a symlink or out of it (openat2
// RESOLVE_BENEATH), and a file's mtime in nanoseconds: what the write capture and the bucket
// uploader both use on the staging and source directories. Also the path of an open
// descriptor (/proc/self/fd/N), which reopens the very inode it holds, whatever its names.
#pragma once

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace ucpfs::io {

// `rel` beneath `root` (a descriptor from openat2, or -1 with errno).
inline int OpenBeneath(int root, const std::string& rel, uint64_t flags) {
  struct open_how how = {};
  how.flags = flags | O_CLOEXEC;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  return static_cast<int>(syscall(SYS_openat2, root, rel.c_str(), &how, sizeof(how)));
}

// "/proc/self/fd/<fd>": opening it opens the inode `fd` holds (no path lookup of its names).
inline std::string ProcFdPath(int fd) { return "/proc/self/fd/" + std::to_string(fd); }

inline int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace ucpfs::io
