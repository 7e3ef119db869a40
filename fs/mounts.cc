#include "fs/mounts.h"

#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "fs/fuse_mount.h"

namespace ucpfs::fs {
namespace {

// mountinfo escapes ' ', '\t', '\n' and '\\' as \ooo.
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '7' && s[i + 2] >= '0' && s[i + 2] <= '7' && s[i + 3] >= '0' &&
        s[i + 3] <= '7') {
      out.push_back(static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

bool Inside(const std::string& path, const std::string& dir) {
  if (dir == "/") return true;
  return path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 && path[dir.size()] == '/';
}

}  // namespace

Result<std::vector<MountEntry>> ReadMounts(const std::string& mountinfo) {
  std::ifstream in(mountinfo);
  if (!in) return IoError(mountinfo + ": cannot read", errno);
  std::vector<MountEntry> out;
  std::string line;
  while (std::getline(in, line)) {
    // id parent major:minor root mount_point options [optional fields...] - fs_type source super
    std::istringstream fields(line);
    std::string id, parent, dev, root, mount_point, options, word;
    if (!(fields >> id >> parent >> dev >> root >> mount_point >> options)) continue;
    while (fields >> word && word != "-") {
    }
    MountEntry m;
    m.mount_point = Unescape(mount_point);
    fields >> m.fs_type >> m.source;
    m.source = Unescape(m.source);
    out.push_back(std::move(m));
  }
  return out;
}

Result<std::optional<MountEntry>> TopMountAt(const std::string& path) {
  UCPFS_ASSIGN_OR_RETURN(auto mounts, ReadMounts());
  std::optional<MountEntry> top;
  for (auto& m : mounts) {
    if (m.mount_point == path) top = std::move(m);
  }
  return top;
}

bool IsUcpfs(const MountEntry& m) { return m.fs_type == "fuse.ucpfs"; }

Status CheckMountPointAgainstSource(const std::string& src, const std::string& mnt) {
  if (mnt == src) {
    return InvalidArgumentError("mount point " + mnt + " is the checkpoint itself (choose an empty directory outside it)");
  }
  if (Inside(mnt, src)) {
    return InvalidArgumentError("mount point " + mnt + " is inside the checkpoint " + src +
                                " (choose a directory outside it)");
  }
  if (Inside(src, mnt)) {
    return InvalidArgumentError("the checkpoint " + src + " is inside the mount point " + mnt +
                                " (choose a directory outside it)");
  }
  return Status::Ok();
}

Status PrepareMountPoint(const std::string& mnt) {
  UCPFS_ASSIGN_OR_RETURN(auto top, TopMountAt(mnt));
  // statvfs goes to the filesystem (stat may be answered from the kernel's attribute cache).
  struct statvfs sv;
  // A killed daemon reads as ENOTCONN, or ECONNABORTED while requests were in flight. While it is still
  // dying, a request it had taken may end in EIO (seen 3 times in 40 kills): ask again for up to 1 s.
  int rc = ::statvfs(mnt.c_str(), &sv);
  for (int i = 0; rc != 0 && errno == EIO && i < 20; ++i) {
    ::usleep(50 * 1000);
    rc = ::statvfs(mnt.c_str(), &sv);
  }
  const bool dead = rc != 0 && (errno == ENOTCONN || errno == ECONNABORTED);
  if (!top) {
    if (dead) return InvalidArgumentError(mnt + ": transport endpoint is not connected, but no mount is listed there");
    return Status::Ok();
  }
  if (!dead) {
    return InvalidArgumentError(mnt + ": already mounted (" + top->fs_type + " " + top->source + "); " +
                                (IsUcpfs(*top) ? "`ucpfs umount " + mnt + "` first" : "unmount it first"));
  }
  if (!IsUcpfs(*top)) {
    return InvalidArgumentError(mnt + ": a dead " + top->fs_type + " mount is there (not ucpfs); clear it with `umount -l " +
                                mnt + "`");
  }
  // A dead ucpfs mount: its daemon is gone, nothing can be served from it. Detach it.
  if (::umount2(mnt.c_str(), MNT_DETACH) != 0) {
    const int e = errno;
    return IoError(mnt + ": a dead ucpfs mount is there and detaching it failed: " + std::strerror(e), e);
  }
  return Status::Ok();
}

Status UnmountUcpfs(const std::string& mnt) {
  UCPFS_ASSIGN_OR_RETURN(auto top, TopMountAt(mnt));
  if (!top) return InvalidArgumentError(mnt + ": nothing is mounted there");
  if (!IsUcpfs(*top)) {
    return InvalidArgumentError(mnt + ": not a ucpfs mount (" + top->fs_type + " " + top->source +
                                "); ucpfs umount only unmounts ucpfs");
  }
  return Unmount(mnt);
}

}  // namespace ucpfs::fs
