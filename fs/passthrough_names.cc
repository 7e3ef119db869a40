// See passthrough.h: namespace changes (mkdir, mknod, symlink, unlink, rmdir, rename) and
// user.* xattrs of source files, each made as the caller.
#include "fs/passthrough.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/statvfs.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "fs/errno_map.h"
#include "fs/passthrough_util.h"

namespace ucpfs::fs {

using namespace passthrough_detail;  // NOLINT: this class's own helpers


Result<struct stat> Passthrough::MakeEntry(const Caller& caller, Ino parent, std::string_view name_view,
                                           const char* what, const std::function<int(int, const char*)>& make) {
  const std::shared_ptr<Node> dir = DirNode(parent);
  if (dir == nullptr) return PosixError(ENOTDIR, "not a directory");
  UCPFS_RETURN_IF_ERROR(CheckName(name_view));
  const std::string name(name_view);
  if (Pending(dir->id, name) != nullptr) return PosixError(EEXIST, name + " exists");
  {
    AsCaller as(caller);
    UCPFS_RETURN_IF_ERROR(as.status());
    if (make(dir->fd, name.c_str()) != 0) return Sys(errno, std::string(what) + " " + name);
  }
  struct stat st = {};
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<Node> node, NodeFor(dir, name, true, &st));
  return StatNode(*node);
}

Result<struct stat> Passthrough::Mkdir(const Caller& caller, Ino parent, std::string_view name, mode_t mode) {
  return MakeEntry(caller, parent, name, "mkdir",
                   [mode](int dirfd, const char* n) { return mkdirat(dirfd, n, mode & 07777); });
}

Result<struct stat> Passthrough::Mknod(const Caller& caller, Ino parent, std::string_view name, mode_t mode) {
  if (!S_ISREG(mode)) {
    return PosixError(EPERM, std::string(name) + ": only regular files, directories and symlinks are made in the source");
  }
  return MakeEntry(caller, parent, name, "mknod", [mode](int dirfd, const char* n) {
    const int fd = openat(dirfd, n, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode & 07777);
    return fd < 0 ? -1 : close(fd);
  });
}

Result<struct stat> Passthrough::Symlink(const Caller& caller, Ino parent, std::string_view name,
                                         const std::string& target) {
  return MakeEntry(caller, parent, name, "symlink",
                   [&target](int dirfd, const char* n) { return symlinkat(target.c_str(), dirfd, n); });
}

Result<std::string> Passthrough::Readlink(Ino ino) {
  const std::shared_ptr<Node> node = Find(ino);
  if (node == nullptr) return PosixError(ENOENT, "no inode " + std::to_string(ino));
  if (!node->is_symlink) return PosixError(EINVAL, node->name + " is not a symlink");
  std::string target(4096, '\0');
  std::shared_lock use(node->fd_mu);
  if (node->gone) return Gone(*node);
  const ssize_t n = readlinkat(node->fd, "", target.data(), target.size());
  if (n < 0) return Sys(errno, "readlink " + node->name);
  target.resize(static_cast<size_t>(n));
  return target;
}

Status Passthrough::Unlink(const Caller& caller, Ino parent, std::string_view name_view) {
  const std::shared_ptr<Node> dir = DirNode(parent);
  if (dir == nullptr) return PosixError(ENOTDIR, "not a directory");
  UCPFS_RETURN_IF_ERROR(CheckName(name_view));
  const std::string name(name_view);
  if (std::shared_ptr<Node> pending = Pending(dir->id, name)) {
    const std::shared_ptr<io::CapturedFile> captured = pending->captured.load();
    UCPFS_RETURN_IF_ERROR(MayDelete(caller, *dir, capture_->Stat(*captured).st_uid));
    const bool discarded = capture_->Discard(*captured);
    {
      std::lock_guard lock(mu_);
      overlay_.erase({dir->id, name});
    }
    if (discarded) {
      ReleaseIfRemoved(pending);  // its part's descriptors, unless a writer still has it open
      return Status::Ok();
    }
    // Placed meanwhile: it is a real entry now, removed below.
  }
  struct stat st = {};
  if (fstatat(dir->fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return Sys(errno, "unlink " + name);
  if (!Shown(st.st_mode)) return PosixError(ENOENT, name + " is not shown");
  {
    AsCaller as(caller);
    UCPFS_RETURN_IF_ERROR(as.status());
    if (unlinkat(dir->fd, name.c_str(), 0) != 0) return Sys(errno, "unlink " + name);
  }
  if (const std::shared_ptr<Node> node = NodeOfFile(st.st_dev, st.st_ino)) ReleaseIfRemoved(node);
  if (changed_) changed_(PathOf(InoOf(*dir)) + "/" + name);
  return Status::Ok();
}

Status Passthrough::Rmdir(const Caller& caller, Ino parent, std::string_view name_view) {
  const std::shared_ptr<Node> dir = DirNode(parent);
  if (dir == nullptr) return PosixError(ENOTDIR, "not a directory");
  UCPFS_RETURN_IF_ERROR(CheckName(name_view));
  const std::string name(name_view);
  struct stat st = {};
  if (fstatat(dir->fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    std::lock_guard lock(mu_);
    const auto it = by_file_.find({st.st_dev, st.st_ino});
    if (it != by_file_.end()) {
      for (const auto& [key, id] : overlay_) {
        // Its parts live in .ucpfs/capture, so the real directory looks empty; placing them
        // later needs it.
        if (key.first == it->second) return PosixError(ENOTEMPTY, name + " holds files being saved");
      }
    }
  }
  {
    AsCaller as(caller);
    UCPFS_RETURN_IF_ERROR(as.status());
    if (unlinkat(dir->fd, name.c_str(), AT_REMOVEDIR) != 0) return Sys(errno, "rmdir " + name);
  }
  if (changed_) changed_(PathOf(InoOf(*dir)) + "/" + name);
  return Status::Ok();
}

Status Passthrough::Rename(const Caller& caller, Ino parent, std::string_view name_view, Ino new_parent,
                           std::string_view new_name_view, unsigned flags) {
  const std::shared_ptr<Node> dir = DirNode(parent);
  const std::shared_ptr<Node> new_dir = DirNode(new_parent);
  if (dir == nullptr || new_dir == nullptr) return PosixError(ENOTDIR, "not a directory");
  UCPFS_RETURN_IF_ERROR(CheckName(name_view));
  UCPFS_RETURN_IF_ERROR(CheckName(new_name_view));
  const std::string name(name_view);
  const std::string new_name(new_name_view);
  // A pending source is made durable under its name first (rename is a sync point: DCP writes
  // `.metadata.tmp`, fsyncs it and renames it to `.metadata`).
  if (std::shared_ptr<Node> pending = Pending(dir->id, name)) {
    const std::shared_ptr<io::CapturedFile> captured = pending->captured.load();
    UCPFS_RETURN_IF_ERROR(MayDelete(caller, *dir, capture_->Stat(*captured).st_uid));
    UCPFS_RETURN_IF_ERROR(capture_->Fsync(*captured));
    Pending(dir->id, name);  // drops the overlay entry of the placed file
  }
  // A pending target would be placed later over what the rename put there: discard it.
  std::shared_ptr<Node> discarded_target;
  if (std::shared_ptr<Node> target = Pending(new_dir->id, new_name)) {
    if ((flags & RENAME_NOREPLACE) != 0) return PosixError(EEXIST, new_name + " exists");
    const std::shared_ptr<io::CapturedFile> captured = target->captured.load();
    UCPFS_RETURN_IF_ERROR(MayDelete(caller, *new_dir, capture_->Stat(*captured).st_uid));
    (void)capture_->Discard(*captured);  // placed already: the rename replaces it
    std::lock_guard lock(mu_);
    overlay_.erase({new_dir->id, new_name});
    discarded_target = target;
  }
  // What the rename replaces, if anything: its node lets the file go once it has no name.
  struct stat replaced = {};
  const bool replacing = (flags & RENAME_EXCHANGE) == 0 &&
                         fstatat(new_dir->fd, new_name.c_str(), &replaced, AT_SYMLINK_NOFOLLOW) == 0;
  struct stat st = {};
  if (fstatat(dir->fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return Sys(errno, "rename " + name);
  if (!Shown(st.st_mode)) return PosixError(ENOENT, name + " is not shown");
  // A placed file still being captured (written since, or closed with its last commit pending).
  std::shared_ptr<io::CapturedFile> captured;
  bool closed = false;
  {
    std::lock_guard lock(mu_);
    if (const auto it = by_file_.find({st.st_dev, st.st_ino}); it != by_file_.end()) {
      const Node& node = *nodes_.at(it->second);
      if (std::shared_ptr<io::CapturedFile> now = node.captured.load(); CapturedNow(now)) {
        captured = std::move(now);
        closed = node.open_writers == 0;
      }
    }
  }
  // Closed: its last commit lands under the name it was closed with, before the rename.
  if (captured && closed) UCPFS_RETURN_IF_ERROR(capture_->Fsync(*captured));
  {
    AsCaller as(caller);
    UCPFS_RETURN_IF_ERROR(as.status());
    if (renameat2(dir->fd, name.c_str(), new_dir->fd, new_name.c_str(), flags) != 0) {
      return Sys(errno, "rename " + name + " to " + new_name);
    }
  }
  // Still written: its later commits go by the new name.
  if (captured && !closed) (void)capture_->Moved(*captured, new_dir->fd, new_name);
  {
    std::lock_guard lock(mu_);
    if (const auto it = by_file_.find({st.st_dev, st.st_ino}); it != by_file_.end()) {
      Node& node = *nodes_.at(it->second);
      node.parent_id = new_dir->id;
      node.name = new_name;
    }
  }
  if (discarded_target != nullptr) ReleaseIfRemoved(discarded_target);
  if (replacing && (replaced.st_dev != st.st_dev || replaced.st_ino != st.st_ino)) {
    if (const std::shared_ptr<Node> node = NodeOfFile(replaced.st_dev, replaced.st_ino)) ReleaseIfRemoved(node);
  }
  if (changed_) {
    // Both ends, the new name first (an s3:// mount uploads it, then deletes the old object).
    changed_(PathOf(InoOf(*new_dir)) + "/" + new_name);
    changed_(PathOf(InoOf(*dir)) + "/" + name);
  }
  return Status::Ok();
}

Status Passthrough::SetXattr(const Caller& caller, Ino ino, const std::string& name, std::span<const std::byte> value,
                             int flags) {
  const std::shared_ptr<Node> node = Find(ino);
  if (node == nullptr) return PosixError(ENOENT, "no inode " + std::to_string(ino));
  if (!UserXattr(name)) return PosixError(ENOTSUP, "only user.* xattrs are kept");
  // A file being saved gets its inode under its name first (placed now, with its owner and
  // mode): the xattr then lives on the real file (cp -a sets them right after the data).
  if (const std::shared_ptr<io::CapturedFile> captured = node->captured.load();
      CapturedNow(captured) && !capture_->Placed(*captured)) {
    UCPFS_RETURN_IF_ERROR(capture_->Fsync(*captured));
  }
  // Through the /proc link only a file's own xattrs are safe to touch; a symlink has no user.* ones.
  if (node->is_symlink) return PosixError(EPERM, node->name + " is a symlink");
  AsCaller as(caller);
  UCPFS_RETURN_IF_ERROR(as.status());
  std::shared_lock use(node->fd_mu);
  if (node->gone) return Gone(*node);
  if (setxattr(ProcFdPath(node->fd).c_str(), name.c_str(), value.data(), value.size(), flags) != 0) {
    return Sys(errno, "setxattr " + node->name);
  }
  return Status::Ok();
}

Result<std::vector<std::byte>> Passthrough::GetXattr(const Caller& caller, Ino ino, const std::string& name,
                                                      size_t size) {
  const std::shared_ptr<Node> node = Find(ino);
  if (node == nullptr) return PosixError(ENOENT, "no inode " + std::to_string(ino));
  if (!UserXattr(name) || Unplaced(*node) || node->is_symlink) return PosixError(ENODATA, "no such xattr");
  AsCaller as(caller);
  UCPFS_RETURN_IF_ERROR(as.status());
  std::shared_lock use(node->fd_mu);
  if (node->gone) return Gone(*node);
  std::vector<std::byte> value(size);
  const ssize_t n = getxattr(ProcFdPath(node->fd).c_str(), name.c_str(), size == 0 ? nullptr : value.data(), size);
  if (n < 0) return Sys(errno, "getxattr " + node->name);
  // size 0 asks only the size: a vector of that many (unused) bytes tells it.
  value.resize(static_cast<size_t>(n));
  return value;
}

Result<std::vector<std::byte>> Passthrough::ListXattr(const Caller& caller, Ino ino, size_t size) {
  const std::shared_ptr<Node> node = Find(ino);
  if (node == nullptr) return PosixError(ENOENT, "no inode " + std::to_string(ino));
  std::vector<std::byte> out;
  if (Unplaced(*node) || node->is_symlink) return out;
  std::vector<char> names;
  {
    AsCaller as(caller);
    UCPFS_RETURN_IF_ERROR(as.status());
    std::shared_lock use(node->fd_mu);
    if (node->gone) return Gone(*node);
    const std::string proc = ProcFdPath(node->fd);
    for (int attempt = 0; attempt < 4; ++attempt) {
      const ssize_t need = listxattr(proc.c_str(), nullptr, 0);
      if (need < 0) return Sys(errno, "listxattr " + node->name);
      names.resize(static_cast<size_t>(need));
      const ssize_t n = listxattr(proc.c_str(), names.data(), names.size());
      if (n >= 0) {
        names.resize(static_cast<size_t>(n));
        break;
      }
      if (errno != ERANGE) return Sys(errno, "listxattr " + node->name);
    }
  }
  for (size_t i = 0; i < names.size();) {
    const std::string one(names.data() + i);
    i += one.size() + 1;
    if (!UserXattr(one)) continue;
    for (char c : one) out.push_back(static_cast<std::byte>(c));
    out.push_back(std::byte{0});
  }
  if (size != 0 && out.size() > size) return PosixError(ERANGE, "listxattr: buffer too small");
  return out;
}

Status Passthrough::RemoveXattr(const Caller& caller, Ino ino, const std::string& name) {
  const std::shared_ptr<Node> node = Find(ino);
  if (node == nullptr) return PosixError(ENOENT, "no inode " + std::to_string(ino));
  if (!UserXattr(name) || Unplaced(*node) || node->is_symlink) return PosixError(ENODATA, "no such xattr");
  AsCaller as(caller);
  UCPFS_RETURN_IF_ERROR(as.status());
  std::shared_lock use(node->fd_mu);
  if (node->gone) return Gone(*node);
  if (removexattr(ProcFdPath(node->fd).c_str(), name.c_str()) != 0) return Sys(errno, "removexattr " + node->name);
  return Status::Ok();
}
}  // namespace ucpfs::fs
