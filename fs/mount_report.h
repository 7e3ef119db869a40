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

  // Adds "views": {"reads", "bytes_read"} and "errors": {"count", "last": [messages, oldest
  // first]} to `out`.
  void AddTo(nlohmann::ordered_json& out) const;

  uint64_t n_errors() const { return n_errors_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> n_view_reads_{0};
  std::atomic<uint64_t> n_view_bytes_{0};
  std::atomic<uint64_t> n_errors_{0};
  mutable std::mutex mu_;
  std::deque<std::string> last_;  // guarded by mu_; at most kMaxMessages
};

}  // namespace ucpfs::fs
