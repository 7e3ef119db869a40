// See direct_mount.h. The options and flags are libfuse 3's for the options ServeTree passes
// (lib/mount.c: fd, rootmode, user_id, group_id after the kernel options; MS_NOSUID|MS_NODEV).
#include "fs/direct_mount.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

namespace ucpfs::fs {

int DirectMount(const DirectMountRequest& r) {
  if (::geteuid() != 0 || r.user_options || r.max_read_bytes == 0 || r.subtype.empty()) return -1;
  struct stat mtab = {};
  if (::lstat("/etc/mtab", &mtab) != 0 || !S_ISLNK(mtab.st_mode)) return -1;
  struct stat root = {};
  if (::stat(r.mountpoint.c_str(), &root) != 0) return -1;
  const int fd = ::open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (fd < 0) return -1;
  char rootmode[16];
  std::snprintf(rootmode, sizeof(rootmode), "%o", root.st_mode & S_IFMT);
  const std::string data = "default_permissions,max_read=" + std::to_string(r.max_read_bytes) +
                           ",fd=" + std::to_string(fd) + ",rootmode=" + rootmode +
                           ",user_id=" + std::to_string(::getuid()) + ",group_id=" + std::to_string(::getgid());
  const unsigned long flags = MS_NOSUID | MS_NODEV | (r.read_only ? MS_RDONLY : 0);
  const std::string type = "fuse." + r.subtype;
  if (::mount(r.fsname.c_str(), r.mountpoint.c_str(), type.c_str(), flags, data.c_str()) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void DirectUnmount(int fuse_fd, const std::string& mountpoint) {
  struct pollfd p = {.fd = fuse_fd, .events = 0, .revents = 0};
  if (::poll(&p, 1, 0) == 1 && (p.revents & POLLERR)) return;
  ::umount2(mountpoint.c_str(), MNT_DETACH);
}

}  // namespace ucpfs::fs
