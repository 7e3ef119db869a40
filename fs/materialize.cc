#include "fs/materialize.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
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

// The calling thread at the lowest priority: nice 19, and the idle I/O class (linux/ioprio.h:
// IOPRIO_WHO_PROCESS 1 names a thread by its id; class IDLE 3 in the top 3 of 16 bits), so the
// builds use what foreground reads leave of the CPUs and the disk. Best effort: a kernel or
// scheduler without I/O classes builds at normal I/O priority.
void LowestPriority() {
  const auto tid = static_cast<id_t>(syscall(SYS_gettid));
  (void)setpriority(PRIO_PROCESS, tid, 19);
  (void)syscall(SYS_ioprio_set, 1, static_cast<int>(tid), 3 << 13);
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

void Materializer::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    queue_.clear();
  }
  work_.notify_all();
  if (builder_.joinable()) builder_.join();
}

Materializer::~Materializer() {
  Stop();
  for (const auto& [key, entry] : entries_) {
    if (!entry.name.empty()) unlinkat(dir_fd_, entry.name.c_str(), 0);
  }
  close(dir_fd_);
}

void Materializer::Drop(std::map<const void*, Entry>::iterator it) {
  // A queued or running build of a dropped entry finds another id (or none) when it finishes,
  // and unlinks its own file.
  if (it->second.ready) lru_.erase(it->second.lru);
  n_bytes_ -= it->second.n_bytes;
  if (!it->second.name.empty()) unlinkat(dir_fd_, it->second.name.c_str(), 0);
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

Result<std::string> Materializer::Build(const Job& job) {
  const ByteSource& source = *job.source;
  const std::string name = kPrefix + std::to_string(getpid()) + "-" + std::to_string(job.id);
  const int fd = openat(dir_fd_, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return SysError(errno, "materialize " + source.Name() + " into " + dir_ + "/" + name);
  const uint64_t size = source.Size();
  std::vector<std::byte> buffer(static_cast<size_t>(std::min(size, kChunkBytes)));
  Status status = Status::Ok();
  uint64_t announced_until = 0;
  for (uint64_t at = 0; at < size && status.ok();) {
    // Given up between chunks when the view's generation is gone or the daemon stops.
    if (stop_.load(std::memory_order_relaxed) || job.node.expired()) {
      status = Status(StatusCode::kNotFound, source.Name() + ": its generation is gone");
      break;
    }
    // Waits for a gap in the reads the daemon serves (a cold load through the mount comes first).
    if (SteadyNowNs() - last_foreground_read_ns_.load(std::memory_order_relaxed) < kQuietNs) {
      std::unique_lock lock(mu_);  // woken at once by Stop
      work_.wait_for(lock, std::chrono::nanoseconds(kQuietNs / 4), [&] { return stop_.load(); });
      continue;
    }
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
  // Offered only once on the disk: a copy is never half there, whatever happens to the daemon.
  if (status.ok() && fdatasync(fd) != 0) status = SysError(errno, "fdatasync " + dir_ + "/" + name);
  close(fd);
  if (!status.ok()) {
    unlinkat(dir_fd_, name.c_str(), 0);
    return status;
  }
  return name;
}

void Materializer::BuilderLoop() {
  LowestPriority();
  std::unique_lock lock(mu_);
  for (;;) {
    work_.wait(lock, [&] { return stop_.load() || !queue_.empty(); });
    if (stop_.load()) break;
    const Job job = std::move(queue_.front());
    queue_.pop_front();
    ++n_running_;
    lock.unlock();
    Result<std::string> name = Build(job);
    lock.lock();
    --n_running_;
    auto it = entries_.find(job.key);
    const bool ours = it != entries_.end() && it->second.id == job.id;
    if (name.ok() && ours && !it->second.node.expired()) {
      it->second.name = *name;
      it->second.ready = true;
      lru_.push_front(job.key);
      it->second.lru = lru_.begin();
      ++n_builds_;
    } else {
      if (name.ok()) unlinkat(dir_fd_, name->c_str(), 0);
      if (ours) Drop(it);
      if (!name.ok() && name.error().code() != StatusCode::kNotFound) {
        ++n_failures_;
        last_error_ = name.error().ToString();
        std::fprintf(stderr, "ucpfs: materialize: %s\n", last_error_.c_str());
      }
    }
    if (queue_.empty() && n_running_ == 0) idle_.notify_all();
  }
  n_running_ = 0;
  idle_.notify_all();
}

Result<int> Materializer::Open(const std::shared_ptr<const void>& node, std::shared_ptr<const ByteSource> source,
                               bool* queued) {
  if (queued != nullptr) *queued = false;
  const uint64_t size = source->Size();
  if (size > max_bytes_) {
    return Status(StatusCode::kUnsupported, source->Name() + " is larger than the materialize cache");
  }
  std::lock_guard lock(mu_);
  if (auto it = entries_.find(node.get()); it != entries_.end()) {
    if (!SameNode(it->second.node, node)) {  // an earlier generation's node at this address
      Drop(it);
    } else if (!it->second.ready) {  // queued or being built: served by the caller meanwhile
      ++n_misses_;
      return -1;
    } else {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      const int fd = openat(dir_fd_, it->second.name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      if (fd >= 0) {
        ++n_hits_;
        return fd;
      }
      if (errno != ENOENT) return SysError(errno, "open " + dir_ + "/" + it->second.name);
      Drop(it);  // removed beneath us: build again
    }
  }
  ++n_misses_;
  if (stop_.load()) return -1;
  MakeRoom(size);
  // Builds queued and running hold the rest: this view is not copied this time (served by the
  // caller; queued again at a later open), so the cache never holds more than max_bytes.
  if (n_bytes_ + size > max_bytes_) return -1;
  Entry& entry = entries_[node.get()];
  entry.node = node;
  entry.n_bytes = size;
  entry.id = next_id_++;
  n_bytes_ += size;  // reserved while queued and building
  queue_.push_back(Job{node.get(), entry.id, node, std::move(source)});
  if (!builder_.joinable()) builder_ = std::thread([this] { BuilderLoop(); });
  work_.notify_one();
  if (queued != nullptr) *queued = true;
  return -1;
}

void Materializer::WaitIdle() {
  std::unique_lock lock(mu_);
  idle_.wait(lock, [&] { return queue_.empty() && n_running_ == 0; });
}

nlohmann::ordered_json Materializer::Stats() const {
  std::lock_guard lock(mu_);
  return {{"dir", dir_},
          {"max_bytes", max_bytes_},
          {"bytes", n_bytes_},
          {"files", lru_.size()},
          {"builds", n_builds_},
          {"hits", n_hits_},
          {"misses", n_misses_},
          {"queued", queue_.size() + n_running_},
          {"failures", n_failures_},
          {"evictions", n_evictions_},
          {"last_error", last_error_}};
}

}  // namespace ucpfs::fs
