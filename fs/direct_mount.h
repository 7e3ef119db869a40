// Root's FUSE mount without mount(8): the daemon calls mount(2) itself on a /dev/fuse it opened
// and hands libfuse the descriptor ("/dev/fd/N", libfuse's documented way for a mount made by
// its caller). libfuse's own mount, run as root, ends by fork+exec'ing `mount -i -f` only to
// record the mount in /etc/mtab; where /etc/mtab is the kernel's list (a symlink to
// /proc/self/mounts, every current distribution) that records nothing for a fuse mount with no
// userspace options, yet it cost a cold start ~5 ms quiet and ~30 ms with the page cache dropped
// (mount(8) and its four libraries loaded from disk).
//
// Used only where the result is exactly libfuse's: effective uid 0, no user -o options but `ro` (their
// split into kernel and session options is libfuse's), /etc/mtab a symlink; anything else, or a
// mount(2) that fails, leaves the mount to libfuse (fusermount3 for other users).
//
// Not for: serving the session (fuse_mount.cc), unmounting by path (fuse_mount.h: Unmount).
#pragma once

#include <cstdint>
#include <string>

namespace ucpfs::fs {

struct DirectMountRequest {
  std::string mountpoint;
  std::string fsname;   // the mount's source, as findmnt shows it
  std::string subtype;  // the type is "fuse.<subtype>"
  bool read_only = false;
  uint32_t max_read_bytes = 0;
  bool user_options = false;  // -o options given by the user: libfuse mounts
};

// The /dev/fuse descriptor of a live mount made with mount(2), or -1 when libfuse must mount
// (not root, user options, mtab a real file, or mount(2) failed: then nothing is left behind).
int DirectMount(const DirectMountRequest& request);

// After the session ended, on a mount made by DirectMount (its descriptor, still open): unmounts
// it (lazily, as libfuse does) unless the kernel says it is gone already (POLLERR on the
// descriptor: unmounted, or the connection aborted), so a mount made at the same path since is
// never touched.
void DirectUnmount(int fuse_fd, const std::string& mountpoint);

}  // namespace ucpfs::fs
