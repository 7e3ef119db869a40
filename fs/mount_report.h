// MountReport: what a mount has done so far, for `.ucpfs/stats.json` and `ucpfs status`: reads
// of the views (count, bytes) and the errors the daemon met (how many, and the last few
// messages, each naming the file). Knows no FUSE types; shared by the Filesystem (which counts
// and records) and the namespace's stats.json opener (which reports).
//
// Not a log: the daemon's log keeps every line; this keeps kMaxMessages (the newest), so its
// memory is bounded whatever the mount meets. Thread-safe: any FUSE worker may count or record
// while stats.json is read.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

namespace ucpfs::fs {

class MountReport {
 public:
  static constexpr size_t kMaxMessages = 8;
  static constexpr size_t kMaxMessageBytes = 512;  // longer messages are cut (stats.json has a fixed size)

  // A read of a view file answered with `n_bytes` bytes.
  void CountViewRead(uint64_t n_bytes);
  // An error the daemon met and logged; `message` names the file ("read atomic/w/fp32.pt offset
  // 0: ..."). `keep_message` false counts it without keeping its text (a repeat the log skips).
  void RecordError(const std::string& message, bool keep_message = true);

  // The kernel's fast paths (fuse_mount.cc): what libfuse and the kernel agreed at INIT.
  struct Kernel {
    std::string libfuse;              // the libfuse linked, e.g. "3.18.3"
    bool passthrough = false;         // FUSE passthrough negotiated
    std::string passthrough_why;      // when off: why
    bool io_uring = false;            // FUSE over io_uring negotiated
    std::string io_uring_why;         // when off: why
    bool splice = false;              // view replies splice the source's pages (FUSE_CAP_SPLICE_WRITE)
    std::string splice_why;           // when off: why
    uint32_t max_background = 0;      // async requests (read-ahead, async direct I/O) in flight at most
  };
  void SetKernel(Kernel kernel);
  // An open(2) served by the kernel from a backing file (FUSE passthrough): its reads and writes
  // never reach the daemon. `view`: a materialised view file, else a source file.
  void CountPassthroughOpen(bool view);
  // A request that reached the daemon through FUSE over io_uring.
  void CountUringRequest() { n_uring_requests_.fetch_add(1, std::memory_order_relaxed); }
  // A view read answered with `n_bytes` of its bytes spliced from the source files' pages.
  void CountSplicedReply(uint64_t n_bytes) {
    n_spliced_replies_.fetch_add(1, std::memory_order_relaxed);
    n_spliced_bytes_.fetch_add(n_bytes, std::memory_order_relaxed);
  }
  // The materialised views' counters (fs/materialize.h), when --materialize is on.
  void SetMaterializeStats(std::function<nlohmann::ordered_json()> stats);

  // Adds "views": {"reads", "bytes_read"}, "errors": {"count", "last": [messages, oldest
  // first]} and "kernel": {"libfuse", "passthrough", "io_uring", "splice", "max_background", counters ("spliced":
  // {"replies", "bytes"} among them), "materialize"} to `out`.
  void AddTo(nlohmann::ordered_json& out) const;

  uint64_t n_errors() const { return n_errors_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> n_view_reads_{0};
  std::atomic<uint64_t> n_view_bytes_{0};
  std::atomic<uint64_t> n_errors_{0};
  std::atomic<uint64_t> n_passthrough_source_opens_{0};
  std::atomic<uint64_t> n_passthrough_view_opens_{0};
  std::atomic<uint64_t> n_uring_requests_{0};
  std::atomic<uint64_t> n_spliced_replies_{0};
  std::atomic<uint64_t> n_spliced_bytes_{0};
  mutable std::mutex mu_;
  std::deque<std::string> last_;  // guarded by mu_; at most kMaxMessages
  Kernel kernel_;                 // guarded by mu_
  std::function<nlohmann::ordered_json()> materialize_stats_;  // guarded by mu_
};

}  // namespace ucpfs::fs
