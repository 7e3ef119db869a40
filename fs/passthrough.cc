// See passthrough.h: nodes, lookup, attributes, listing (opens and I/O: passthrough_files.cc;
// namespace changes and xattrs: passthrough_names.cc). Not for: FUSE types (fuse_mount.cc), the views (tree.cc), or how captured
// bytes become durable (core/io/write_capture.cc).
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


bool Passthrough::CapturedNow(const Node& node) const { return CapturedNow(node.captured.load()); }

bool Passthrough::CapturedNow(const std::shared_ptr<io::CapturedFile>& captured) const {
  return captured != nullptr && capture_ != nullptr && !capture_->Settled(*captured);
}

bool Passthrough::Unplaced(const Node& node) const {
  const std::shared_ptr<io::CapturedFile> captured = node.captured.load();
  return captured != nullptr && capture_ != nullptr && !capture_->Settled(*captured) && !capture_->Placed(*captured);
}

Status Passthrough::Gone(const Node& node) { return PosixError(ENOENT, node.name + " was removed"); }

PassthroughHandle::~PassthroughHandle() {
  if (fd >= 0) close(fd);
}

Passthrough::Passthrough(int root_fd, std::string source_dir, std::shared_ptr<io::WriteCapture> capture)
    : root_fd_(root_fd), source_dir_(std::move(source_dir)), capture_(std::move(capture)) {}

Passthrough::~Passthrough() {
  std::lock_guard lock(mu_);
  for (auto& [id, node] : nodes_) {
    if (node->fd >= 0 && node->fd != root_fd_) close(node->fd);
  }
  close(root_fd_);
}

Result<std::unique_ptr<Passthrough>> Passthrough::Make(const std::string& source_dir,
                                                       std::shared_ptr<io::WriteCapture> capture) {
  const int fd = open(source_dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError("open " + source_dir, errno);
  struct stat st = {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return IoError("stat " + source_dir, err);
  }
  std::unique_ptr<Passthrough> p(new Passthrough(fd, source_dir, std::move(capture)));
  auto root = std::make_shared<Node>();
  root->id = 1;
  root->dev = st.st_dev;
  root->ino = st.st_ino;
  root->fd = fd;
  root->is_dir = true;
  root->parent_id = 1;
  p->nodes_.emplace(1, root);
  p->by_file_.emplace(std::make_pair(st.st_dev, st.st_ino), 1);
  return p;
}

std::shared_ptr<Passthrough::Node> Passthrough::Find(Ino ino) const {
  const uint64_t id = ino == kRootIno ? 1 : (ino & ~kPassthroughBit);
  std::lock_guard lock(mu_);
  const auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : it->second;
}

std::shared_ptr<Passthrough::Node> Passthrough::DirNode(Ino ino) const {
  std::shared_ptr<Node> n = Find(ino);
  return n != nullptr && n->is_dir ? n : nullptr;
}

std::string Passthrough::PathOf(Ino ino) const {
  std::string path;
  std::lock_guard lock(mu_);
  uint64_t id = ino == kRootIno ? 1 : (ino & ~kPassthroughBit);
  for (int depth = 0; id != 1 && depth < 4096; ++depth) {
    const auto it = nodes_.find(id);
    if (it == nodes_.end()) return "<ino " + std::to_string(ino) + ">" + path;
    path = "/" + it->second->name + path;
    id = it->second->parent_id;
  }
  return path.empty() ? "/" : path;
}

std::optional<std::pair<Ino, std::string>> Passthrough::ParentOf(Ino ino) const {
  std::lock_guard lock(mu_);
  const auto it = nodes_.find(ino == kRootIno ? 1 : (ino & ~kPassthroughBit));
  if (it == nodes_.end() || it->second->id == 1) return std::nullopt;
  const uint64_t parent = it->second->parent_id;
  return std::make_pair(parent == 1 ? kRootIno : (kPassthroughBit | parent), it->second->name);
}

Result<struct stat> Passthrough::StatNode(const Node& node) const {
  if (const std::shared_ptr<io::CapturedFile> captured = node.captured.load(); CapturedNow(captured)) {
    struct stat st = capture_->Stat(*captured);
    st.st_ino = InoOf(node);
    return st;
  }
  struct stat st = {};
  {
    std::shared_lock use(node.fd_mu);
    if (node.gone) return Gone(node);
    if (fstatat(node.fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
      return Sys(errno, "stat " + node.name);
    }
  }
  st.st_ino = InoOf(node);
  return st;
}

Result<std::shared_ptr<Passthrough::Node>> Passthrough::NodeFor(const std::shared_ptr<Node>& dir,
                                                                const std::string& name, bool take_ref,
                                                                struct stat* st) {
  const int fd = openat(dir->fd, name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Sys(errno, "open " + name);
  if (fstatat(fd, "", st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
    const int err = errno;
    close(fd);
    return Sys(err, "stat " + name);
  }
  if (!Shown(st->st_mode)) {
    close(fd);
    return PosixError(ENOENT, name + " is not a regular file or directory: not shown");
  }
  std::lock_guard lock(mu_);
  const auto key = std::make_pair(st->st_dev, st->st_ino);
  std::shared_ptr<Node> node;
  if (const auto it = by_file_.find(key); it != by_file_.end()) {
    node = nodes_.at(it->second);
    close(fd);
  } else {
    node = std::make_shared<Node>();
    node->id = next_id_++;
    node->dev = st->st_dev;
    node->ino = st->st_ino;
    node->fd = fd;
    node->is_dir = S_ISDIR(st->st_mode);
    node->is_symlink = S_ISLNK(st->st_mode);
    nodes_.emplace(node->id, node);
    by_file_.emplace(key, node->id);
  }
  if (node->id != 1) {
    node->parent_id = dir->id;
    node->name = name;
  }
  if (take_ref) node->n_lookups.fetch_add(1);
  return node;
}

std::shared_ptr<Passthrough::Node> Passthrough::Pending(uint64_t dir_id, const std::string& name) {
  std::shared_ptr<Node> node;
  {
    std::lock_guard lock(mu_);
    const auto it = overlay_.find({dir_id, name});
    if (it == overlay_.end()) return nullptr;
    const auto n = nodes_.find(it->second);
    if (n == nodes_.end()) {
      overlay_.erase(it);
      return nullptr;
    }
    node = n->second;
  }
  if (const std::shared_ptr<io::CapturedFile> captured = node->captured.load();
      capture_ != nullptr && captured != nullptr && capture_->Placed(*captured)) {
    std::lock_guard lock(mu_);
    overlay_.erase({dir_id, name});
    return nullptr;  // now a real entry
  }
  return node;
}

Result<struct stat> Passthrough::Lookup(Ino parent, std::string_view name_view) {
  const std::shared_ptr<Node> dir = DirNode(parent);
  if (dir == nullptr) return PosixError(ENOTDIR, "not a directory");
  UCPFS_RETURN_IF_ERROR(CheckName(name_view));
  const std::string name(name_view);
  if (std::shared_ptr<Node> pending = Pending(dir->id, name)) {
    pending->n_lookups.fetch_add(1);
    return StatNode(*pending);
  }
  struct stat st = {};
  Result<std::shared_ptr<Node>> node = NodeFor(dir, name, true, &st);
  if (!node.ok()) {
    if (node.error().sys_errno() == ENOENT) {
      SweepSoon();  // a name the kernel may still know went: its file may be held here
      struct stat none = {};
      return none;  // st_ino 0: no such name
    }
    return node.error();
  }
  return StatNode(**node);
}

void Passthrough::Forget(Ino ino, uint64_t n_lookups) {
  if (ino == kRootIno) return;
  std::shared_ptr<Node> released;
  std::lock_guard lock(mu_);
  const auto it = nodes_.find(ino & ~kPassthroughBit);
  if (it == nodes_.end() || it->second->id == 1) return;
  Node& node = *it->second;
  uint64_t now = node.n_lookups.load();
  while (!node.n_lookups.compare_exchange_weak(now, now - std::min(now, n_lookups))) {
  }
  if (now > n_lookups || node.open_writers > 0) return;
  // A pending captured file stays while its overlay entry names it.
  if (PendingLocked(node)) return;
  released = it->second;
  if (const auto f = by_file_.find({node.dev, node.ino}); f != by_file_.end() && f->second == node.id) by_file_.erase(f);
  nodes_.erase(it);
  std::unique_lock use(released->fd_mu);
  if (released->fd >= 0) close(released->fd);
  released->fd = -1;
}

Result<struct stat> Passthrough::GetAttr(Ino ino) {
  const std::shared_ptr<Node> node = Find(ino);
  if (node == nullptr) return PosixError(ENOENT, "no inode " + std::to_string(ino));
  Result<struct stat> st = StatNode(*node);
  // Removed and not open: the kernel's inode outlived the name (nothing can open it again).
  if (st.ok() && st->st_nlink == 0 && !node->is_dir && ReleaseIfRemoved(node)) return Gone(*node);
  return st;
}

Result<struct stat> Passthrough::SetAttr(const Caller& caller, Ino ino, const struct stat& attr, int to_set,
                                         PassthroughHandle* handle) {
  const std::shared_ptr<Node> node = Find(ino);
  if (node == nullptr) return PosixError(ENOENT, "no inode " + std::to_string(ino));
  if (const std::shared_ptr<io::CapturedFile> captured = node->captured.load();
      captured != nullptr && capture_ != nullptr && !capture_->Settled(*captured)) {
    // No inode of the caller's exists yet: the kernel's rules for chown/chmod/utimens, applied
    // here to what the capture keeps (and applies when it places the file).
    const struct stat now = capture_->Stat(*captured);
    const bool owner = caller.Privileged() || caller.uid == now.st_uid;
    if ((to_set & (kSetUid | kSetGid)) != 0) {
      const uid_t uid = (to_set & kSetUid) != 0 ? attr.st_uid : now.st_uid;
      const gid_t gid = (to_set & kSetGid) != 0 ? attr.st_gid : now.st_gid;
      if (!caller.Privileged() && (!owner || uid != now.st_uid || (gid != now.st_gid && !caller.InGroup(gid)))) {
        return PosixError(EPERM, "chown " + node->name + ": not permitted");
      }
      UCPFS_RETURN_IF_ERROR(capture_->SetOwner(*captured, uid, gid));
      UCPFS_RETURN_IF_ERROR(capture_->SetMode(*captured, KillPrivs(now.st_mode & 07777)));
    }
    if ((to_set & kSetMode) != 0) {
      if (!owner) return PosixError(EPERM, "chmod " + node->name + ": not the owner");
      mode_t mode = attr.st_mode & 07777;
      const gid_t gid = capture_->Stat(*captured).st_gid;
      if (!caller.Privileged() && !caller.InGroup(gid)) mode &= ~static_cast<mode_t>(S_ISGID);
      UCPFS_RETURN_IF_ERROR(capture_->SetMode(*captured, mode));
    }
    if ((to_set & kSetSize) != 0) {
      UCPFS_RETURN_IF_ERROR(capture_->Truncate(*captured, static_cast<uint64_t>(attr.st_size)));
    }
    if ((to_set & (kSetAtime | kSetMtime)) != 0) {
      // Times of one's choosing: the owner's only (to now: anyone who may write, checked by the
      // kernel against the attributes served).
      const bool explicit_times = ((to_set & kSetAtime) != 0 && (to_set & kSetAtimeNow) == 0) ||
                                  ((to_set & kSetMtime) != 0 && (to_set & kSetMtimeNow) == 0);
      if (explicit_times && !owner) return PosixError(EPERM, "set the times of " + node->name + ": not the owner");
      struct timespec times[2];
      times[0].tv_nsec = UTIME_OMIT;
      times[1].tv_nsec = UTIME_OMIT;
      if ((to_set & kSetAtime) != 0) times[0] = (to_set & kSetAtimeNow) != 0 ? timespec{0, UTIME_NOW} : attr.st_atim;
      if ((to_set & kSetMtime) != 0) times[1] = (to_set & kSetMtimeNow) != 0 ? timespec{0, UTIME_NOW} : attr.st_mtim;
      UCPFS_RETURN_IF_ERROR(capture_->SetTimes(*captured, times));
    }
    return StatNode(*node);
  }
  if (node->is_dir && (to_set & (kSetAtime | kSetMtime)) != 0 && capture_ != nullptr) {
    // Placing a pending file changes its directory's mtime: place them first, so the times
    // set now (cp -a, tar x and rsync set a directory's after its contents) are the last word.
    std::vector<std::shared_ptr<io::CapturedFile>> pending;
    {
      std::lock_guard lock(mu_);
      for (const auto& [key, id] : overlay_) {
        const auto it = nodes_.find(id);
        if (key.first == node->id && it != nodes_.end() && it->second->captured.load()) pending.push_back(it->second->captured.load());
      }
    }
    for (const auto& file : pending) UCPFS_RETURN_IF_ERROR(capture_->Fsync(*file));
  }
  AsCaller as(caller);
  UCPFS_RETURN_IF_ERROR(as.status());
  std::shared_lock use(node->fd_mu);
  if (node->gone) return Gone(*node);
  const std::string proc = ProcFdPath(node->fd);
  if ((to_set & (kSetUid | kSetGid)) != 0) {
    const uid_t uid = (to_set & kSetUid) != 0 ? attr.st_uid : static_cast<uid_t>(-1);
    const gid_t gid = (to_set & kSetGid) != 0 ? attr.st_gid : static_cast<gid_t>(-1);
    if (fchownat(node->fd, "", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0) {
      return Sys(errno, "chown " + node->name);
    }
  }
  if ((to_set & kSetMode) != 0) {
    if (node->is_symlink) return PosixError(EOPNOTSUPP, "chmod " + node->name + ": a symlink");
    if (chmod(proc.c_str(), attr.st_mode & 07777) != 0) return Sys(errno, "chmod " + node->name);
  }
  if ((to_set & kSetSize) != 0) {
    if (node->is_dir) return PosixError(EISDIR, node->name + " is a directory");
    if (node->is_symlink) return PosixError(EINVAL, node->name + " is a symlink");
    if (handle != nullptr && handle->fd >= 0) {
      if (ftruncate(handle->fd, attr.st_size) != 0) return Sys(errno, "truncate " + node->name);
    } else if (truncate(proc.c_str(), attr.st_size) != 0) {
      return Sys(errno, "truncate " + node->name);
    }
  }
  if ((to_set & (kSetAtime | kSetMtime)) != 0) {
    struct timespec times[2];
    times[0].tv_nsec = UTIME_OMIT;
    times[1].tv_nsec = UTIME_OMIT;
    if ((to_set & kSetAtime) != 0) times[0] = (to_set & kSetAtimeNow) != 0 ? timespec{0, UTIME_NOW} : attr.st_atim;
    if ((to_set & kSetMtime) != 0) times[1] = (to_set & kSetMtimeNow) != 0 ? timespec{0, UTIME_NOW} : attr.st_mtim;
    // A symlink's own times: through the /proc link they would be its target's.
    const int rc = node->is_symlink ? utimensat(node->fd, "", times, AT_EMPTY_PATH)
                                    : utimensat(AT_FDCWD, proc.c_str(), times, 0);
    if (rc != 0) return Sys(errno, "set the times of " + node->name);
  }
  use.unlock();
  return StatNode(*node);
}

Result<std::vector<Passthrough::DirItem>> Passthrough::List(Ino ino) {
  const std::shared_ptr<Node> dir = DirNode(ino);
  if (dir == nullptr) return PosixError(ENOTDIR, "not a directory");
  SweepSoon();  // files removed from outside, whose names the kernel may still hold
  const int fd = openat(dir->fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Sys(errno, "opendir " + dir->name);
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    const int err = errno;
    close(fd);
    return Sys(err, "opendir " + dir->name);
  }
  std::vector<DirItem> items;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    if (dir->id == 1 && name == ".ucpfs") continue;
    struct stat st = {};
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !Shown(st.st_mode)) continue;
    items.push_back({name, 0, st.st_mode & S_IFMT});
  }
  closedir(d);
  std::vector<std::pair<std::string, uint64_t>> pending;
  {
    std::lock_guard lock(mu_);
    for (const auto& [key, id] : overlay_) {
      if (key.first == dir->id) pending.emplace_back(key.second, id);
    }
  }
  for (const auto& [name, id] : pending) {
    if (Pending(dir->id, name) == nullptr) continue;
    items.erase(std::remove_if(items.begin(), items.end(), [&](const DirItem& i) { return i.name == name; }),
                items.end());
    items.push_back({name, kPassthroughBit | id, S_IFREG});
  }
  std::sort(items.begin(), items.end(), [](const DirItem& a, const DirItem& b) { return a.name < b.name; });
  return items;
}

struct statvfs Passthrough::StatFs() {
  SweepSoon();  // so the free space shown counts what files removed from outside held
  struct statvfs sv = {};
  fstatvfs(root_fd_, &sv);
  return sv;
}

}  // namespace ucpfs::fs
