// Progress of a long CLI operation (index, convert, sync, verify) on stderr: the one reporter
// every command uses.
//
// On a terminal: a single line redrawn in place at most every 100 ms (none in the first 500 ms,
// so quick operations stay silent) with done/total, a bar, the rate and an ETA. Not a terminal
// (a log, a pipe): a plain line at most every 2 s. Either way a final line when the operation
// finishes (Finish), and nothing at all when quiet. Thread-safe: workers may call Update.
//
// Not for: results (those go to stdout, as text or --json) or errors.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "index/scanner.h"

namespace ucpfs::cli {

enum class ProgressUnit { kItems, kBytes };

struct ProgressOptions {
  std::string label;  // "ucpfs index: indexing"
  ProgressUnit unit = ProgressUnit::kItems;
  bool quiet = false;
  bool tty = false;
  // Injected for tests; defaults: std::chrono::steady_clock::now, and fputs to stderr + fflush.
  std::function<std::chrono::steady_clock::time_point()> now;
  std::function<void(std::string_view)> write;
};

// Options for stderr: tty = isatty(2).
ProgressOptions StderrProgressOptions(std::string label, ProgressUnit unit, bool quiet);

class Progress {
 public:
  static constexpr std::chrono::milliseconds kTtyInterval{100};
  static constexpr std::chrono::milliseconds kTtyDelay{500};
  static constexpr std::chrono::milliseconds kLineInterval{2000};

  explicit Progress(ProgressOptions options);

  // `done` of `total` so far; `note` is appended (e.g. "3 dirty"). Drawn when the throttle allows.
  void Update(uint64_t done, uint64_t total, std::string_view note = {});
  // The final line (once; later calls and Updates draw nothing).
  void Finish(uint64_t done, uint64_t total, std::string_view note = {});

  // One line of text, without "\r" or "\n":
  //   "<label> [########------------]  40% 4.0/10.0 MiB 2.0 MiB/s ETA 3s <note>"
  // The rate is done/elapsed_s; no rate or ETA before any time has passed or anything is done;
  // no bar or percentage when total is 0.
  static std::string Render(std::string_view label, ProgressUnit unit, uint64_t done, uint64_t total,
                            double elapsed_s, std::string_view note = {});

 private:
  void Draw(uint64_t done, uint64_t total, std::string_view note, bool final);

  ProgressOptions options_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  bool drawn_ = false;    // a line was drawn
  bool finished_ = false;
};

// "1.5 MiB", "37 B", "12.0 GiB".
std::string HumanBytes(double n_bytes);

// A ScanProgress (the index builders' (done, total) callback) drawing on `progress`, finishing
// it when done == total; nullptr when `progress` is.
index::ScanProgress ScanProgressOf(std::shared_ptr<Progress> progress);

// The progress of building an index ("ucpfs: indexing", items) on stderr, as a ScanProgress.
index::ScanProgress IndexingProgress(bool quiet);

}  // namespace ucpfs::cli
