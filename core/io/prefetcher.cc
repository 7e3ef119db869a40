// The read-ahead readers (see prefetcher.h).
#include "core/io/prefetcher.h"

#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include "core/io/file_source.h"

namespace ucpfs::io {
namespace {

// What a reader asks for at a time: through the read-ahead descriptor, a chunk read into the
// page cache by the kernel's own read-ahead; the scratch buffer's reads are of kScratchBytes.
constexpr uint64_t kChunkBytes = uint64_t{8} << 20;
constexpr uint64_t kScratchBytes = uint64_t{1} << 20;

#ifndef __NR_cachestat
#define __NR_cachestat 451  // the same number on every architecture (Linux 6.5)
#endif

struct CachestatRange {
  uint64_t off;
  uint64_t len;
};
struct Cachestat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

std::atomic<bool> g_no_cachestat{false};

// Whether every page of [byte_offset, +n_bytes) of `fd` is in the page cache; false when the
// kernel cannot tell (then the range is read).
bool AllCached(int fd, uint64_t byte_offset, uint64_t n_bytes) {
  if (g_no_cachestat.load(std::memory_order_relaxed)) return false;
  CachestatRange range{byte_offset, n_bytes};
  Cachestat cs{};
  if (::syscall(__NR_cachestat, fd, &range, &cs, 0) != 0) {
    if (errno == ENOSYS || errno == EPERM) g_no_cachestat.store(true, std::memory_order_relaxed);
    return false;
  }
  const long page = ::sysconf(_SC_PAGESIZE);
  const uint64_t page_bytes = page > 0 ? static_cast<uint64_t>(page) : 4096;
  const uint64_t first = byte_offset / page_bytes, last = (byte_offset + n_bytes - 1) / page_bytes;
  return cs.nr_cache >= last - first + 1;
}

// /dev/null for writing, opened once (-1 when it cannot be: then no reader sends to it).
int NullFd() {
  static const int fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  return fd;
}

}  // namespace

Prefetcher::Prefetcher(unsigned n_threads, size_t max_queued)
    : n_threads_(std::max(1u, n_threads)), max_queued_(std::max<size_t>(1, max_queued)) {}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    queue_.clear();
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

Prefetcher& Prefetcher::Global() {
  static Prefetcher global(2, 64);
  return global;
}

bool Prefetcher::Enqueue(std::shared_ptr<const FileSource> file, uint64_t byte_offset, uint64_t n_bytes) {
  if (!file || byte_offset >= file->Size() || n_bytes == 0) return false;
  n_bytes = std::min(n_bytes, file->Size() - byte_offset);
  {
    std::lock_guard lock(mu_);
    if (stopping_) return false;
    if (queue_.size() >= max_queued_) {
      ++counters_.ranges_dropped;
      return false;
    }
    if (threads_.empty()) {
      for (unsigned i = 0; i < n_threads_; ++i) threads_.emplace_back([this] { Run(); });
    }
    queue_.push_back(Job{std::move(file), byte_offset, n_bytes});
    ++counters_.ranges_queued;
  }
  wake_.notify_one();
  return true;
}

void Prefetcher::Drain() {
  std::unique_lock lock(mu_);
  idle_.wait(lock, [this] { return queue_.empty() && busy_ == 0; });
}

Prefetcher::Counters Prefetcher::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

void Prefetcher::Run() {
  std::vector<std::byte> scratch;  // allocated on the first range read
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    Job job = std::move(queue_.front());
    queue_.pop_front();
    ++busy_;
    lock.unlock();
    Read(job, scratch);
    job.file.reset();  // closes the file here, not under the lock, when it was the last holder
    lock.lock();
    --busy_;
    idle_.notify_all();
  }
}

void Prefetcher::Read(const Job& job, std::vector<std::byte>& scratch) {
  uint64_t read = 0, cached = 0;
  const int fd = job.file->fd();
  // sendfile to /dev/null: the file's pages pass through the kernel's splice read, which brings
  // them into the page cache by the descriptor's ordinary read-ahead (large folios, requests as
  // large as the device takes), and nothing is copied. Where the file system cannot splice,
  // the next ways for the rest of the range.
  bool send = NullFd() >= 0;
  for (uint64_t at = job.byte_offset, end = job.byte_offset + job.n_bytes; at < end;) {
    const uint64_t n = std::min(kChunkBytes, end - at);
    uint64_t done = n;  // of [at, at + n): brought in or found cached
    if (AllCached(fd, at, n)) {
      cached += n;
    } else if (send) {
      off_t offset = static_cast<off_t>(at);
      const ssize_t got = ::sendfile(NullFd(), job.file->read_ahead_fd(), &offset, n);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP)) {
        send = false;
        continue;
      }
      if (got <= 0) break;  // an error or end of file: the read that needs the bytes reports it
      read += done = static_cast<uint64_t>(got);
    } else if (::posix_fadvise(fd, static_cast<off_t>(at), static_cast<off_t>(n), POSIX_FADV_WILLNEED) == 0 &&
               AllCached(fd, at, n)) {
      // The file system started reading the chunk into the page cache (the pages are there,
      // being filled): no copy through the scratch buffer. That copy is as much CPU as the read
      // it serves, and on a machine of few cores it made cold reads through the mount slower
      // than no read-ahead at all (a 940 MB rank file: 0.77-0.99 s against 0.54-0.70 s).
      read += n;
    } else {  // WILLNEED ignored (network and FUSE file systems), or the kernel cannot tell
      if (scratch.size() < kScratchBytes) scratch.resize(kScratchBytes);
      const ssize_t got = ::pread(fd, scratch.data(), std::min(n, kScratchBytes), static_cast<off_t>(at));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;
      read += done = static_cast<uint64_t>(got);
    }
    at += done;
    {
      std::lock_guard lock(mu_);
      if (stopping_) break;
    }
  }
  std::lock_guard lock(mu_);
  counters_.bytes_read += read;
  counters_.bytes_cached += cached;
}

}  // namespace ucpfs::io
