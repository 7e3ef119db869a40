// Materializer: view files computed once into a bounded cache directory (`ucpfs mount
// --materialize DIR --materialize-size N`), so later opens are served by the kernel straight
// from the cached file (FUSE passthrough, fuse_mount.cc): warm reads and mmap then run on the
// backing file system's page cache, never through the daemon. Knows no FUSE types.
//
// The first open of a view never waits for its copy: Open answers "not yet" (-1) and queues the
// build, and the caller serves that open itself (computed reads, as without --materialize), so a
// cold read is as fast as without the cache. The copies are built behind it by one builder
// thread at the lowest CPU and I/O priority (nice 19, the idle I/O class), one view at a time,
// pausing while the daemon serves reads (NoteForegroundRead), so they take what the foreground
// reads leave; a copy is offered only once complete and fdatasync'd.
//
// Not for: deciding whether an open may pass through (fuse_mount.cc does: the kernel's rules on
// mixing modes), views' bytes (their ByteSource computes them).
//
// Invariants:
// - A cached file belongs to one view file of one generation: the entry is keyed by the view's
//   node and holds a weak reference to the tree that node is part of, so a new generation (a
//   new tree), or a dynamic subtree built again, misses and computes afresh; nothing of a
//   replaced generation is ever served. A queued or running build whose tree goes is dropped
//   (its partial file unlinked) at its next chunk.
// - The directory is untrusted like everything on disk: it must be a real directory (no
//   symlink followed) owned by the daemon's user, and is made mode 0700; every file is made
//   with O_CREAT|O_EXCL|O_NOFOLLOW beneath it (openat on its descriptor). Files this process
//   did not make there are not read: names of an earlier daemon (`ucpfs-view-*`) are removed at
//   start, others left alone.
// - The cache holds at most max_bytes of finished and queued files (a build reserves its size
//   when queued): least recently opened out (unlinked; a file still passed through stays
//   readable through its open descriptors); copies whose tree is gone go before any other. A
//   view larger than max_bytes is not materialised (kUnsupported).
//
// Thread-safety: every method may be called from any thread. One build per view at a time: an
// open of a view already queued or being built answers -1 without queueing it again.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/byte_source.h"
#include "core/status.h"

namespace ucpfs::fs {

class Materializer {
 public:
  // Errors: kInvalidArgument (max_bytes 0; DIR a symlink, not a directory, or owned by another
  // user), kIo naming DIR. `read_ahead_bytes`: how far ahead of a build's reads the source is
  // announced (ByteSource::Prefetch, as --prefetch does for reads through the mount; 0: not).
  static Result<std::unique_ptr<Materializer>> Make(const std::string& dir, uint64_t max_bytes,
                                                    uint64_t read_ahead_bytes = 0);
  ~Materializer();

  // A read-only descriptor (the caller closes it) of the finished copy of the view file `node`
  // (its identity: an aliasing pointer owned by the tree it belongs to) holding `source`'s bytes;
  // or -1 when there is none yet: its build is then queued (once), and the caller serves this
  // open from `source` itself. Errors: kUnsupported (larger than the cache), kIo (opening a
  // finished copy, naming it). A build's own errors are counted in Stats ("failures",
  // "last_error") and written to stderr (the daemon's log); the view is queued again at a later
  // open. `queued` (optional) is set when this call queued the build: the first open since the
  // view had no copy (opens while it is queued or built, or when the cache is full of queued
  // builds, answer -1 with it false).
  Result<int> Open(const std::shared_ptr<const void>& node, std::shared_ptr<const ByteSource> source,
                   bool* queued = nullptr);

  // A read of a view file the daemon serves (fuse_mount.cc, per read request: one clock read
  // and a relaxed store, no lock; not the control files, which a status poll reads). Builds
  // pause between chunks until the daemon has served none for kQuietNs, so a copy is made
  // between the foreground's loads, not against them.
  void NoteForegroundRead() {
    last_foreground_read_ns_.store(SteadyNowNs(), std::memory_order_relaxed);
  }

  // Drops the queued builds, stops the one running (at its next chunk) and waits for the
  // builder: called when the session ends, before the views' sources go (the destructor calls
  // it too). Later opens answer -1 and queue nothing. Not to be called from two threads at once.
  void Stop();

  // Blocks until no build is queued or running (tests; the bench's warm rounds use Stats).
  void WaitIdle();

  // {"dir", "max_bytes", "bytes", "files", "builds", "hits", "misses", "queued", "failures",
  //  "evictions", "last_error"}: misses are opens answered -1 (served by the daemon), queued the
  //  builds not finished yet (running included).
  nlohmann::ordered_json Stats() const;

 private:
  struct Entry {
    std::weak_ptr<const void> node;
    std::string name;  // in dir_; set when ready
    uint64_t n_bytes = 0;
    uint64_t id = 0;    // the build's; a finished build whose entry has another id was dropped
    bool ready = false;  // built; false while queued or being built
    std::list<const void*>::iterator lru;
  };
  struct Job {
    const void* key;
    uint64_t id;
    std::weak_ptr<const void> node;
    std::shared_ptr<const ByteSource> source;
  };
  static constexpr int64_t kQuietNs = 1'000'000'000;  // 1 s
  static int64_t SteadyNowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  Materializer(int dir_fd, std::string dir, uint64_t max_bytes, uint64_t read_ahead_bytes);
  void BuilderLoop();
  // Computes `job`'s source into a new file, fdatasync'd; returns its name. Gives up (kNotFound)
  // when the job's tree goes or the Materializer stops. No lock held.
  Result<std::string> Build(const Job& job);
  // Unlinks least recently used ready entries until `n_bytes` more fit. mu_ held.
  void MakeRoom(uint64_t n_bytes);
  void Drop(std::map<const void*, Entry>::iterator it);  // mu_ held

  const int dir_fd_;
  const std::string dir_;
  const uint64_t max_bytes_;
  const uint64_t read_ahead_bytes_;
  mutable std::mutex mu_;
  std::condition_variable work_;  // a job queued, or stopping
  std::condition_variable idle_;  // the queue emptied and no build runs
  std::map<const void*, Entry> entries_;  // guarded by mu_
  std::list<const void*> lru_;            // most recent at the front; ready entries; mu_
  std::deque<Job> queue_;                 // mu_
  uint64_t n_running_ = 0;                // builds in progress; mu_
  std::atomic<int64_t> last_foreground_read_ns_{0};
  std::atomic<bool> stop_{false};         // set under mu_; read by builds between chunks
  uint64_t n_bytes_ = 0;                  // of ready and reserved entries; mu_
  uint64_t next_id_ = 1;                  // mu_
  uint64_t n_builds_ = 0, n_hits_ = 0, n_misses_ = 0, n_failures_ = 0, n_evictions_ = 0;  // mu_
  std::string last_error_;                // mu_
  std::thread builder_;                   // started at the first queued build
};

}  // namespace ucpfs::fs
