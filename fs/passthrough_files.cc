// See passthrough.h: opens, creates, reads, writes, flush and release of source files, their
// write capture, and letting go of removed files' descriptors.
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
      const int probe = open(ProcFdPath(node->fd).c_str(), (flags & ~(O_CREAT | O_EXCL | O_NOCTTY | O_NOFOLLOW | O_TRUNC)) | O_CLOEXEC);
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
    fd = open(ProcFdPath(node->fd).c_str(), (flags & ~(O_CREAT | O_EXCL | O_NOCTTY | O_NOFOLLOW)) | O_CLOEXEC);
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

bool Passthrough::KnowsDirectory(dev_t dev, ino_t ino) {
  std::lock_guard lock(mu_);
  const auto f = by_file_.find({dev, ino});
  if (f == by_file_.end()) return false;
  const auto n = nodes_.find(f->second);
  if (n == nodes_.end() || !n->second->is_dir) return false;
  if (n->second->n_lookups.load() > 0) return true;
  const auto pending = overlay_.lower_bound({f->second, std::string()});
  return pending != overlay_.end() && pending->first.first == f->second;
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
}  // namespace ucpfs::fs
