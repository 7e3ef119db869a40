// Prefetcher: the read-ahead readers of a process. FileSource::Prefetch hands them ranges of
// source files that a view read will need soon; they bring what the page cache lacks into it,
// a chunk at a time: sendfile to /dev/null from the file's read-ahead descriptor
// (FileSource::read_ahead_fd), so the kernel's own read-ahead reads the pages in large requests
// and nothing is copied; where the file system cannot splice, a WILLNEED hint where the kernel
// then shows the pages present (cachestat: being read, no copy), else a pread into a small
// scratch buffer that is thrown away, so the later reads find the pages there, whatever the
// file system does with the hint.
//
// Not for: holding data for readers (the page cache does), or ordering reads.
// Invariants: memory is bounded (a fixed queue of ranges, one 1 MiB scratch buffer per reader
// thread); a range that finds the queue full is dropped (read-ahead is a hint); a queued range
// keeps its file open (shared ownership) until it has been read; ranges already in the page cache
// are not read again where the kernel tells (cachestat(2), Linux 6.5+). Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ucpfs {
class FileSource;
}

namespace ucpfs::io {

class Prefetcher {
 public:
  // `n_threads` reader threads (started on the first Enqueue), at most `max_queued` ranges waiting.
  Prefetcher(unsigned n_threads, size_t max_queued);
  ~Prefetcher();  // drops what waits, waits for the ranges being read
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The process's readers: 2 threads, 64 ranges.
  static Prefetcher& Global();

  // Queues [byte_offset, byte_offset + n_bytes) of `file` (clipped to its size); false when the
  // queue was full and the range dropped.
  bool Enqueue(std::shared_ptr<const FileSource> file, uint64_t byte_offset, uint64_t n_bytes);

  // Waits until nothing is queued or being read (for tests and benchmarks).
  void Drain();

  struct Counters {
    uint64_t ranges_queued = 0;
    uint64_t ranges_dropped = 0;
    uint64_t bytes_read = 0;     // read into the page cache by the readers
    uint64_t bytes_cached = 0;   // found in the page cache already, not read
  };
  Counters counters() const;

 private:
  struct Job {
    std::shared_ptr<const FileSource> file;
    uint64_t byte_offset = 0;
    uint64_t n_bytes = 0;
  };
  void Run();
  void Read(const Job& job, std::vector<std::byte>& scratch);

  const unsigned n_threads_;
  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable wake_;   // a job was queued, or stopping
  std::condition_variable idle_;   // a job finished
  std::deque<Job> queue_;          // guarded by mu_
  unsigned busy_ = 0;              // readers reading a job; guarded by mu_
  bool stopping_ = false;          // guarded by mu_
  Counters counters_;              // guarded by mu_
  std::vector<std::thread> threads_;  // started under mu_ on the first Enqueue
};

}  // namespace ucpfs::io
