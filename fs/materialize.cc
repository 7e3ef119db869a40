#include "fs/materialize.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <span>
#include <vector>

namespace ucpfs::fs {
namespace {

constexpr char kPrefix[] = "ucpfs-view-";
// The source is read in pieces of this size: bounded memory whatever the view's size.
constexpr uint64_t kChunkBytes = 8ull << 20;

// Same node: the weak reference still names the live tree the node was found in.
bool SameNode(const std::weak_ptr<const void>& cached, const std::shared_ptr<const void>& node) {
  return !cached.expired() && !cached.owner_before(node) && !node.owner_before(cached);
}

Status SysError(int err, const std::string& what) {
  return Status(StatusCode::kIo, what + ": " + std::strerror(err), err);
}

// Removes the files an earlier daemon left (only names this class makes, only regular files).
void RemoveLeftovers(int dir_fd) {
  const int fd = openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  DIR* d = fdopendir(fd);
  if (d == nullptr) {
    close(fd);
    return;
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    if (std::strncmp(e->d_name, kPrefix, sizeof(kPrefix) - 1) == 0) names.emplace_back(e->d_name);
  }
  closedir(d);
  for (const std::string& name : names) {
    struct stat st = {};
    if (fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
      unlinkat(dir_fd, name.c_str(), 0);
    }
  }
}

}  // namespace

Result<std::unique_ptr<Materializer>> Materializer::Make(const std::string& dir, uint64_t max_bytes,
                                                         uint64_t read_ahead_bytes) {
  if (max_bytes == 0) return InvalidArgumentError("--materialize-size must be more than 0");
  if (dir.empty()) return InvalidArgumentError("--materialize needs a directory");
  // Made when missing (its parent must exist); never through a symlink.
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return SysError(errno, "materialize directory " + dir);
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP || err == ENOTDIR) {
      return Status(StatusCode::kInvalidArgument, "materialize directory " + dir + " is not a directory (a symlink?)",
                    err);
    }
    return SysError(err, "materialize directory " + dir);
  }
  struct stat st = {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return SysError(err, "materialize directory " + dir);
  }
  if (st.st_uid != geteuid()) {
    close(fd);
    return InvalidArgumentError("materialize directory " + dir + " is owned by uid " + std::to_string(st.st_uid) +
                                ", not by the daemon's (" + std::to_string(geteuid()) + ")");
  }
  if ((st.st_mode & 07777) != 0700 && fchmod(fd, 0700) != 0) {
    const int err = errno;
    close(fd);
    return SysError(err, "chmod 0700 " + dir);
  }
  RemoveLeftovers(fd);
  return std::unique_ptr<Materializer>(new Materializer(fd, dir, max_bytes, read_ahead_bytes));
}

Materializer::Materializer(int dir_fd, std::string dir, uint64_t max_bytes, uint64_t read_ahead_bytes)
    : dir_fd_(dir_fd), dir_(std::move(dir)), max_bytes_(max_bytes), read_ahead_bytes_(read_ahead_bytes) {}

Materializer::~Materializer() {
  for (const auto& [key, entry] : entries_) unlinkat(dir_fd_, entry.name.c_str(), 0);
  close(dir_fd_);
}

void Materializer::Drop(std::map<const void*, Entry>::iterator it) {
  if (it->second.ready) lru_.erase(it->second.lru);
  n_bytes_ -= it->second.n_bytes;
  unlinkat(dir_fd_, it->second.name.c_str(), 0);
  entries_.erase(it);
}

void Materializer::MakeRoom(uint64_t n_bytes) {
  // Copies of views whose tree is gone (a replaced generation, an evicted subtree) go first.
  if (n_bytes_ + n_bytes > max_bytes_) {
    for (auto it = entries_.begin(); it != entries_.end();) {
      auto next = std::next(it);
      if (it->second.ready && it->second.node.expired()) {
        Drop(it);
        ++n_evictions_;
      }
      it = next;
    }
  }
  while (n_bytes_ + n_bytes > max_bytes_ && !lru_.empty()) {
    const void* oldest = lru_.back();
    Drop(entries_.find(oldest));
    ++n_evictions_;
  }
}

Result<std::string> Materializer::Build(const ByteSource& source, uint64_t id) {
  const std::string name = kPrefix + std::to_string(getpid()) + "-" + std::to_string(id);
  const int fd = openat(dir_fd_, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return SysError(errno, "materialize " + source.Name() + " into " + dir_ + "/" + name);
  const uint64_t size = source.Size();
  std::vector<std::byte> buffer(static_cast<size_t>(std::min(size, kChunkBytes)));
  Status status = Status::Ok();
  uint64_t announced_until = 0;
  for (uint64_t at = 0; at < size && status.ok();) {
    const auto n = static_cast<size_t>(std::min<uint64_t>(kChunkBytes, size - at));
    // The source's next bytes are read ahead (the process's prefetch readers) while this chunk
    // is computed and written, as reads through the mount are: a cold build otherwise waits on
    // the disk for every chunk in turn. Announced a window at a time, half a window early.
    if (read_ahead_bytes_ != 0 && at + n < size && announced_until < at + n + read_ahead_bytes_ / 2) {
      const uint64_t from = std::max(announced_until, at + n);
      announced_until = std::min(size, at + n + std::max<uint64_t>(read_ahead_bytes_, kChunkBytes));
      if (announced_until > from) source.Prefetch(from, announced_until - from);
    }
    status = source.ReadAt(at, std::span(buffer.data(), n));
    for (size_t done = 0; status.ok() && done < n;) {
      const ssize_t w = pwrite(fd, buffer.data() + done, n - done, static_cast<off_t>(at + done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) status = SysError(w < 0 ? errno : ENOSPC, "writing " + dir_ + "/" + name);
      else done += static_cast<size_t>(w);
    }
    at += n;
  }
  close(fd);
  if (!status.ok()) {
    unlinkat(dir_fd_, name.c_str(), 0);
    return status;
  }
  return name;
}

Result<int> Materializer::Open(const std::shared_ptr<const void>& node, const ByteSource& source) {
  const uint64_t size = source.Size();
  if (size > max_bytes_) {
    return Status(StatusCode::kUnsupported, source.Name() + " is larger than the materialize cache");
  }
  std::unique_lock lock(mu_);
  for (;;) {
    auto it = entries_.find(node.get());
    if (it == entries_.end()) break;
    if (!SameNode(it->second.node, node)) {  // an earlier generation's node at this address
      if (!it->second.ready) {               // still being built: let that build finish
        built_.wait(lock);
        continue;
      }
      Drop(it);
      break;
    }
    if (!it->second.ready) {
      built_.wait(lock);
      continue;
    }
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    const int fd = openat(dir_fd_, it->second.name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
      ++n_hits_;
      return fd;
    }
    Drop(it);  // removed beneath us: build again
    break;
  }
  MakeRoom(size);
  const uint64_t id = next_id_++;
  Entry& entry = entries_[node.get()];
  entry.node = node;
  entry.n_bytes = size;
  n_bytes_ += size;  // reserved while building
  lock.unlock();
  Result<std::string> name = Build(source, id);
  lock.lock();
  auto it = entries_.find(node.get());
  if (!name.ok()) {
    n_bytes_ -= size;
    entries_.erase(it);
    built_.notify_all();
    return name.error();
  }
  it->second.name = *name;
  it->second.ready = true;
  lru_.push_front(node.get());
  it->second.lru = lru_.begin();
  ++n_builds_;
  built_.notify_all();
  const int fd = openat(dir_fd_, name->c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return SysError(errno, "open " + dir_ + "/" + *name);
  return fd;
}

nlohmann::ordered_json Materializer::Stats() const {
  std::lock_guard lock(mu_);
  return {{"dir", dir_},       {"max_bytes", max_bytes_}, {"bytes", n_bytes_},          {"files", lru_.size()},
          {"builds", n_builds_}, {"hits", n_hits_},         {"evictions", n_evictions_}};
}

}  // namespace ucpfs::fs
