// See passthrough.h. Not for: FUSE types (fuse_mount.cc), the views (tree.cc), or how captured
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

namespace ucpfs::fs {
namespace {

bool Shown(mode_t mode) { return S_ISREG(mode) || S_ISDIR(mode) || S_ISLNK(mode); }

// What an unprivileged write, truncation or chown leaves of a mode: S_ISUID goes, and S_ISGID
// when group-executable (the kernel's should_remove_suid).
mode_t KillPrivs(mode_t mode) {
  mode &= ~static_cast<mode_t>(S_ISUID);
  if ((mode & (S_ISGID | S_IXGRP)) == (S_ISGID | S_IXGRP)) mode &= ~static_cast<mode_t>(S_ISGID);
  return mode;
}

bool HasPrivs(mode_t mode) { return KillPrivs(mode) != mode; }

// Only the user namespace is passed through: the daemon keeps capabilities (CAP_SETFCAP for
// security.capability, CAP_SYS_ADMIN for trusted.*) that a switched fsuid does not drop.
bool UserXattr(const std::string& name) { return name.starts_with("user.") && name.size() > 5; }

Status Sys(int err, const std::string& what) { return PosixError(err, what + ": " + std::strerror(err)); }

std::string ProcPath(int fd) { return "/proc/self/fd/" + std::to_string(fd); }

// A name the kernel hands us is one component; refuse anything else outright.
Status CheckName(std::string_view name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos ||
      name.find('\0') != std::string_view::npos || name.size() > 255) {
    return PosixError(EINVAL, "invalid name");
  }
  return Status::Ok();
}

}  // namespace

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
  const std::string proc = ProcPath(node->fd);
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

Result<struct stat> Passthrough::ProbeCreate(const Caller& caller, const Node& dir, mode_t mode) {
  static std::atomic<uint64_t> next_probe{0};
  static const std::string prefix = ".ucpfs-create." + std::to_string(getpid()) + ".";
  AsCaller as(caller);
  UCPFS_RETURN_IF_ERROR(as.status());
  for (int attempt = 0; attempt < 16; ++attempt) {
    const std::string probe = prefix + std::to_string(next_probe.fetch_add(1));
    const int fd = openat(dir.fd, probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode & 07777);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) return Sys(errno, "create in " + (dir.name.empty() ? std::string("/") : dir.name));
    struct stat st = {};
    const int rc = fstat(fd, &st);
    const int err = errno;
    close(fd);
    unlinkat(dir.fd, probe.c_str(), 0);
    if (rc != 0) return Sys(err, "stat a new file");
    return st;
  }
  return PosixError(EEXIST, "no free placeholder name");
}

Status Passthrough::MayDelete(const Caller& caller, const Node& dir, uid_t owner) {
  struct stat dst = {};
  if (fstatat(dir.fd, "", &dst, AT_EMPTY_PATH) != 0) return Sys(errno, "stat " + dir.name);
  {
    AsCaller as(caller);
    UCPFS_RETURN_IF_ERROR(as.status());
    if (faccessat(dir.fd, "", W_OK | X_OK, AT_EACCESS | AT_EMPTY_PATH) != 0) return Sys(errno, "remove in " + dir.name);
  }
  if ((dst.st_mode & S_ISVTX) != 0 && !caller.Privileged() && caller.uid != owner && caller.uid != dst.st_uid) {
    return PosixError(EPERM, "a sticky directory: not the owner");
  }
  return Status::Ok();
}

Result<std::unique_ptr<PassthroughHandle>> Passthrough::StartCapture(const std::shared_ptr<Node>& dir,
                                                                     const std::string& name, const struct stat& attr,
                                                                     std::shared_ptr<Node>* made, bool exclusive) {
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<io::CapturedFile> file,
                         capture_->Create(dir->fd, name, attr.st_mode & 07777, exclusive));
  if (Status owned = capture_->SetOwner(*file, attr.st_uid, attr.st_gid); !owned.ok()) {
    capture_->Discard(*file);
    return owned;
  }
  const struct stat st = capture_->Stat(*file);
  Result<int> path_fd = capture_->OpenPath(*file);
  if (!path_fd.ok()) {
    capture_->Discard(*file);
    return path_fd.error();
  }
  auto node = std::make_shared<Node>();
  node->dev = st.st_dev;
  node->ino = st.st_ino;
  node->parent_id = dir->id;
  node->name = name;
  node->captured.store(file);
  node->open_writers = 1;
  {
    std::lock_guard lock(mu_);
    node->id = next_id_++;
    // The part's inode: its O_PATH descriptor follows it through the rename into place.
    node->fd = *path_fd;
    nodes_.emplace(node->id, node);
    by_file_[{node->dev, node->ino}] = node->id;
    overlay_[{dir->id, name}] = node->id;
  }
  *made = node;
  auto h = std::make_unique<PassthroughHandle>();
  h->ino = InoOf(*node);
  h->captured = std::move(file);
  h->writable = true;
  return h;
}

Result<std::unique_ptr<PassthroughHandle>> Passthrough::OpenUncounted(const Caller& caller, Ino ino, int flags) {
  const std::shared_ptr<Node> node = Find(ino);
  if (node == nullptr) return PosixError(ENOENT, "no inode " + std::to_string(ino));
  if (node->is_dir) return PosixError(EISDIR, node->name + " is a directory");
  if (node->is_symlink) return PosixError(ELOOP, node->name + " is a symlink");
  if (node->gone) return Gone(*node);
  const std::shared_ptr<io::CapturedFile> captured = node->captured.load();
  const bool write = (flags & O_ACCMODE) != O_RDONLY;
  bool open_writers = false;
  {
    std::lock_guard lock(mu_);
    open_writers = node->open_writers > 0;
  }
  if (write && !open_writers && CapturedNow(captured) && (flags & O_TRUNC) == 0) {
    // Reopened for writing after its last close, before it is durable: make it durable, then
    // write to it in place like any source file.
    UCPFS_RETURN_IF_ERROR(capture_->Fsync(*captured));
  }
  if (CapturedNow(captured) && (!write || open_writers)) {
    // Another open of a file being captured: reads see what was written; writes join it.
    // (Permission: the kernel checked it against the attributes served, default_permissions.)
    auto h = std::make_unique<PassthroughHandle>();
    h->ino = ino;
    h->captured = captured;
    h->writable = write;
    h->caller = caller;
    h->kill_privs = write && !caller.Privileged();
    if (write) {
      std::lock_guard lock(mu_);
      ++node->open_writers;
    }
    if (write && (flags & O_TRUNC) != 0) UCPFS_RETURN_IF_ERROR(capture_->Truncate(*captured, 0));
    return h;
  }
  if (write && (flags & O_TRUNC) != 0 && capture_ != nullptr) {
    // Rewriting a file: captured like a new one, which replaces it atomically when durable. The
    // caller must be able to open it for writing: asked of the kernel (without truncating it).
    struct stat attr = {};
    {
      AsCaller as(caller);
      UCPFS_RETURN_IF_ERROR(as.status());
      std::shared_lock use(node->fd_mu);
      if (node->gone) return Gone(*node);
      const int probe = open(ProcPath(node->fd).c_str(), (flags & ~(O_CREAT | O_EXCL | O_NOCTTY | O_NOFOLLOW | O_TRUNC)) | O_CLOEXEC);
      if (probe < 0) return Sys(errno, "open " + node->name);
      close(probe);
      if (fstatat(node->fd, "", &attr, AT_EMPTY_PATH) != 0) return Sys(errno, "stat " + node->name);
    }
    std::shared_ptr<Node> dir;
    std::string name;
    {
      std::lock_guard lock(mu_);
      const auto it = nodes_.find(node->parent_id);
      if (it != nodes_.end()) dir = it->second;
      name = node->name;
    }
    // It keeps its owner, group and mode; truncation by an unprivileged writer drops S_ISUID/S_ISGID.
    if (!caller.Privileged()) attr.st_mode = KillPrivs(attr.st_mode);
    if (dir != nullptr && !name.empty()) {
      std::shared_ptr<Node> made;
      UCPFS_ASSIGN_OR_RETURN(auto h, StartCapture(dir, name, attr, &made));
      // The kernel knows this inode number: it now stands for the captured file (the old file
      // is replaced when the new one is placed).
      std::lock_guard lock(mu_);
      nodes_.erase(made->id);
      by_file_.erase({made->dev, made->ino});
      if (const auto f = by_file_.find({node->dev, node->ino}); f != by_file_.end() && f->second == node->id) {
        by_file_.erase(f);
      }
      {
        std::unique_lock use(node->fd_mu);
        close(node->fd);
        node->fd = made->fd;
        made->fd = -1;
      }
      node->dev = made->dev;
      node->ino = made->ino;
      by_file_[{node->dev, node->ino}] = node->id;
      node->captured.store(made->captured.load());
      node->open_writers = 1;
      overlay_[{dir->id, name}] = node->id;
      h->ino = ino;
      h->caller = caller;
      h->kill_privs = !caller.Privileged();
      return h;
    }
  }
  // Reopened through /proc: the O_PATH descriptor names the inode itself (no path is resolved).
  // As the caller, so the kernel checks its access (and truncation drops its bits).
  int fd = -1;
  struct stat st = {};
  {
    AsCaller as(caller);
    UCPFS_RETURN_IF_ERROR(as.status());
    std::shared_lock use(node->fd_mu);
    if (node->gone) return Gone(*node);
    fd = open(ProcPath(node->fd).c_str(), (flags & ~(O_CREAT | O_EXCL | O_NOCTTY | O_NOFOLLOW)) | O_CLOEXEC);
    if (fd < 0) return Sys(errno, "open " + node->name);
  }
  auto h = std::make_unique<PassthroughHandle>();
  h->ino = ino;
  h->fd = fd;
  h->writable = write;
  h->caller = caller;
  h->kill_privs = write && !caller.Privileged() && fstat(fd, &st) == 0 && HasPrivs(st.st_mode);
  return h;
}

Result<std::pair<struct stat, std::unique_ptr<PassthroughHandle>>> Passthrough::CreateUncounted(
    const Caller& caller, Ino parent, std::string_view name_view, mode_t mode, int flags) {
  const std::shared_ptr<Node> dir = DirNode(parent);
  if (dir == nullptr) return PosixError(ENOTDIR, "not a directory");
  UCPFS_RETURN_IF_ERROR(CheckName(name_view));
  const std::string name(name_view);
  if (std::shared_ptr<Node> pending = Pending(dir->id, name)) {
    if ((flags & O_EXCL) != 0) return PosixError(EEXIST, name + " exists");
    UCPFS_ASSIGN_OR_RETURN(auto h, OpenUncounted(caller, InoOf(*pending), flags | O_TRUNC));
    pending->n_lookups.fetch_add(1);
    UCPFS_ASSIGN_OR_RETURN(struct stat st, StatNode(*pending));
    return std::make_pair(st, std::move(h));
  }
  struct stat existing = {};
  if (fstatat(dir->fd, name.c_str(), &existing, AT_SYMLINK_NOFOLLOW) == 0) {
    if ((flags & O_EXCL) != 0) return PosixError(EEXIST, name + " exists");
    if (S_ISLNK(existing.st_mode)) return PosixError(ELOOP, name + " is a symlink");
    if (!Shown(existing.st_mode)) return PosixError(EEXIST, name + " exists and is not a regular file");
    UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<Node> node, NodeFor(dir, name, true, &existing));
    Result<std::unique_ptr<PassthroughHandle>> h = OpenUncounted(caller, InoOf(*node), flags);
    if (!h.ok()) {
      Forget(InoOf(*node), 1);
      return h.error();
    }
    UCPFS_ASSIGN_OR_RETURN(struct stat st, StatNode(*node));
    return std::make_pair(st, std::move(*h));
  }
  if (capture_ != nullptr) {
    UCPFS_ASSIGN_OR_RETURN(const struct stat attr, ProbeCreate(caller, *dir, mode));
    // The name was free. An O_EXCL create keeps it so; so does one in a sticky directory, where
    // a name another user makes meanwhile is one this caller could not replace (the directory
    // is looked at only when that decides it).
    bool exclusive = (flags & O_EXCL) != 0;
    if (!exclusive && !caller.Privileged()) {
      struct stat dst = {};
      exclusive = fstatat(dir->fd, "", &dst, AT_EMPTY_PATH) == 0 && (dst.st_mode & S_ISVTX) != 0;
    }
    std::shared_ptr<Node> made;
    UCPFS_ASSIGN_OR_RETURN(auto h, StartCapture(dir, name, attr, &made, exclusive));
    h->caller = caller;
    h->kill_privs = !caller.Privileged();
    made->n_lookups.fetch_add(1);
    UCPFS_ASSIGN_OR_RETURN(struct stat st, StatNode(*made));
    return std::make_pair(st, std::move(h));
  }
  int fd = -1;
  {
    AsCaller as(caller);
    UCPFS_RETURN_IF_ERROR(as.status());
    fd = openat(dir->fd, name.c_str(), (flags | O_CREAT | O_NOFOLLOW | O_CLOEXEC) & ~O_NOCTTY, mode & 07777);
    if (fd < 0) return Sys(errno, "create " + name);
  }
  auto h = std::make_unique<PassthroughHandle>();
  h->fd = fd;
  h->writable = true;
  h->caller = caller;
  struct stat st = {};
  Result<std::shared_ptr<Node>> node = NodeFor(dir, name, true, &st);
  if (!node.ok()) return node.error();
  h->ino = InoOf(**node);
  h->kill_privs = !caller.Privileged() && HasPrivs(st.st_mode);
  UCPFS_ASSIGN_OR_RETURN(st, StatNode(**node));
  return std::make_pair(st, std::move(h));
}

Result<size_t> Passthrough::Read(PassthroughHandle& h, uint64_t byte_offset, std::span<std::byte> out) {
  if (h.captured != nullptr) return capture_->Read(*h.captured, byte_offset, out);
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = pread(h.fd, out.data() + done, out.size() - done, static_cast<off_t>(byte_offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Sys(errno, "read");
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

Result<size_t> Passthrough::Write(PassthroughHandle& h, uint64_t byte_offset, std::span<const std::byte> data) {
  if (!h.writable) return PosixError(EBADF, "not open for writing");
  if (h.closing.exchange(false)) {  // written after a close(2): open through another descriptor
    std::lock_guard lock(mu_);
    closing_.erase(&h);
  }
  if (h.captured != nullptr) {
    if (h.kill_privs.exchange(false)) {  // an unprivileged write drops S_ISUID/S_ISGID
      const mode_t mode = capture_->Stat(*h.captured).st_mode & 07777;
      if (HasPrivs(mode)) UCPFS_RETURN_IF_ERROR(capture_->SetMode(*h.captured, KillPrivs(mode)));
    }
    UCPFS_RETURN_IF_ERROR(capture_->Write(*h.captured, byte_offset, data));
    return data.size();
  }
  size_t done = 0;
  if (h.kill_privs.exchange(false)) {
    // The first write as the writer: the kernel drops the bits itself.
    AsCaller as(h.caller);
    UCPFS_RETURN_IF_ERROR(as.status());
    const ssize_t n = pwrite(h.fd, data.data(), data.size(), static_cast<off_t>(byte_offset));
    if (n < 0) return Sys(errno, "write");
    done = static_cast<size_t>(n);
  }
  while (done < data.size()) {
    const ssize_t n = pwrite(h.fd, data.data() + done, data.size() - done, static_cast<off_t>(byte_offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Sys(errno, "write");
    done += static_cast<size_t>(n);
  }
  return done;
}

Status Passthrough::Fsync(PassthroughHandle& h, bool datasync) {
  if (h.captured != nullptr) return capture_->Fsync(*h.captured);
  if ((datasync ? fdatasync(h.fd) : fsync(h.fd)) != 0) return Sys(errno, "fsync");
  return Status::Ok();
}

Status Passthrough::Flush(PassthroughHandle& h) {
  if (h.captured == nullptr) return Status::Ok();
  if (h.writable) {
    std::lock_guard lock(mu_);
    closing_[&h] = {++n_closes_, h.ino};
    h.closing = true;
  }
  return capture_->Error(*h.captured);
}

std::vector<std::string> Passthrough::WaitClosesReleased(std::chrono::milliseconds max) {
  std::vector<Ino> not_released;
  {
    std::unique_lock lock(mu_);
    const uint64_t before = n_closes_;
    const auto waited_for = [&] {
      return std::none_of(closing_.begin(), closing_.end(), [&](const auto& e) { return e.second.first <= before; });
    };
    if (closing_cv_.wait_for(lock, max, waited_for)) return {};
    for (auto it = closing_.begin(); it != closing_.end();) {
      if (it->second.first <= before) {
        not_released.push_back(it->second.second);
        it = closing_.erase(it);  // not waited for again until closed again
      } else {
        ++it;
      }
    }
  }
  std::vector<std::string> paths;
  for (const Ino ino : not_released) paths.push_back(PathOf(ino));
  return paths;
}

Result<std::unique_ptr<PassthroughHandle>> Passthrough::Open(const Caller& caller, Ino ino, int flags) {
  // Counted before the file is looked at: a node is released (ReleaseIfRemoved) only while
  // nothing has it open, so an open counted first finds it either kept or gone.
  CountOpen(ino, 1);
  if (const std::shared_ptr<Node> node = Find(ino); node != nullptr && !node->is_dir) {
    // Removed, and open nowhere else: a stale name (the kernel's, for up to a second), which a
    // plain disk would not open either. An open file's /proc/PID/fd/N opens it still.
    if (ReleaseIfRemoved(node, /*own_opens=*/1)) {
      CountOpen(ino, -1);
      return Gone(*node);
    }
  }
  Result<std::unique_ptr<PassthroughHandle>> h = OpenUncounted(caller, ino, flags);
  if (!h.ok()) CountOpen(ino, -1);
  return h;
}

Result<std::pair<struct stat, std::unique_ptr<PassthroughHandle>>> Passthrough::Create(const Caller& caller,
                                                                                       Ino parent,
                                                                                       std::string_view name,
                                                                                       mode_t mode, int flags) {
  UCPFS_ASSIGN_OR_RETURN(auto made, CreateUncounted(caller, parent, name, mode, flags));
  CountOpen(made.second->ino, 1);
  return made;
}

void Passthrough::CountOpen(Ino ino, int delta) {
  std::lock_guard lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  OpenCount& c = opens_[ino];
  c.n += delta;
  if (delta >= 0) return;
  c.released = now;
  // Bounded without an uploader asking (InUsePaths): closes older than an hour are forgotten.
  if (opens_.size() > 4096) {
    std::erase_if(opens_, [&](const auto& e) { return e.second.n <= 0 && now - e.second.released > std::chrono::hours(1); });
  }
}

std::vector<std::string> Passthrough::InUsePaths(uint64_t recent_ms) {
  const auto now = std::chrono::steady_clock::now();
  std::vector<Ino> open;
  {
    std::lock_guard lock(mu_);
    for (auto it = opens_.begin(); it != opens_.end();) {
      if (it->second.n <= 0 && now - it->second.released >= std::chrono::milliseconds(recent_ms)) {
        it = opens_.erase(it);  // closed long enough: forgotten (the map stays small)
      } else {
        open.push_back(it->first);
        ++it;
      }
    }
  }
  std::vector<std::string> paths;
  for (const Ino ino : open) {
    std::string path = PathOf(ino);
    if (path.starts_with("/")) paths.push_back(path.substr(1));
  }
  return paths;
}

Status Passthrough::Release(PassthroughHandle& h) {
  CountOpen(h.ino, -1);
  const std::shared_ptr<Node> node = Find(h.ino);
  Status closed;
  if (h.captured != nullptr && h.writable) {
    bool last = false;
    if (node != nullptr) {
      std::lock_guard lock(mu_);
      last = --node->open_writers <= 0;
    }
    if (last) closed = capture_->Close(*h.captured);  // queued for commit before a waiting sync goes on
    std::lock_guard lock(mu_);
    if (closing_.erase(&h) > 0) closing_cv_.notify_all();
  }
  // A file removed while open: at its last close the node lets its blocks go.
  if (node != nullptr && !node->is_dir) ReleaseIfRemoved(node);
  return closed;
}

bool Passthrough::PendingLocked(const Node& node) {
  for (auto it = overlay_.begin(); it != overlay_.end();) {
    if (it->second != node.id) {
      ++it;
      continue;
    }
    // Placed since (a real entry now; dropped here as Pending drops it when the name is next
    // looked up), or still pending.
    if (const std::shared_ptr<io::CapturedFile> captured = node.captured.load();
        captured != nullptr && capture_ != nullptr && !capture_->Placed(*captured)) {
      return true;
    }
    it = overlay_.erase(it);
  }
  return false;
}

std::shared_ptr<Passthrough::Node> Passthrough::NodeOfFile(dev_t dev, ino_t ino) const {
  std::lock_guard lock(mu_);
  const auto it = by_file_.find({dev, ino});
  if (it == by_file_.end()) return nullptr;
  const auto n = nodes_.find(it->second);
  return n == nodes_.end() ? nullptr : n->second;
}

bool Passthrough::ReleaseIfRemoved(const std::shared_ptr<Node>& node, int own_opens) {
  if (node->gone) return true;
  if (node->is_dir || node->id == 1) return false;
  // Removed: a capture not settled tells (an unlinked pending file is discarded); else the inode.
  if (const std::shared_ptr<io::CapturedFile> captured = node->captured.load();
      captured != nullptr && capture_ != nullptr && !capture_->Settled(*captured)) {
    if (capture_->Stat(*captured).st_nlink != 0) return false;
  } else {
    std::shared_lock use(node->fd_mu);
    struct stat st = {};
    if (node->gone || fstatat(node->fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0 || st.st_nlink != 0) {
      return node->gone;
    }
  }
  // No name has it now (a link count never comes back from zero): released unless in use.
  {
    std::lock_guard lock(mu_);
    if (node->gone) return true;
    const Ino ino = InoOf(*node);
    if (const auto it = opens_.find(ino); it != opens_.end() && it->second.n > own_opens) return false;
    if (node->open_writers > 0 || PendingLocked(*node)) return false;
    node->gone = true;  // opens counted from now on find it gone (Open counts before it looks)
    if (const auto f = by_file_.find({node->dev, node->ino}); f != by_file_.end() && f->second == node->id) {
      by_file_.erase(f);  // the inode number may be given to a new file
    }
  }
  std::shared_ptr<io::CapturedFile> captured = node->captured.exchange(nullptr);  // its descriptors close with it
  std::unique_lock use(node->fd_mu);
  if (node->fd >= 0) close(node->fd);
  node->fd = -1;
  return true;
}

size_t Passthrough::ReleaseRemoved() {
  last_sweep_ns_.store(std::chrono::steady_clock::now().time_since_epoch().count());
  std::vector<std::shared_ptr<Node>> files;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, node] : nodes_) {
      if (!node->is_dir && id != 1 && !node->gone) files.push_back(node);
    }
  }
  size_t n = 0;
  for (const auto& node : files) n += ReleaseIfRemoved(node) ? 1 : 0;
  return n;
}

void Passthrough::SweepSoon() {
  const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
  int64_t last = last_sweep_ns_.load();
  if (now - last < 1'000'000'000 || !last_sweep_ns_.compare_exchange_strong(last, now)) return;
  ReleaseRemoved();
}

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
  if (setxattr(ProcPath(node->fd).c_str(), name.c_str(), value.data(), value.size(), flags) != 0) {
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
  const ssize_t n = getxattr(ProcPath(node->fd).c_str(), name.c_str(), size == 0 ? nullptr : value.data(), size);
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
    const std::string proc = ProcPath(node->fd);
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
  if (removexattr(ProcPath(node->fd).c_str(), name.c_str()) != 0) return Sys(errno, "removexattr " + node->name);
  return Status::Ok();
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
