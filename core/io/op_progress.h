// OpProgress: how far one IoOp has got. Internal to core/io: every engine feeds the result of
// each attempt (a system call, a CQE, an inner engine's completion) through Feed, so all of them
// resume short transfers, retry EINTR/EAGAIN, treat end of file and word errors the same way
// (the rules in io_engine.h).
// Not for: callers of IoEngine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>

#include "core/io/io_engine.h"

namespace ucpfs::io::internal {

// The most one attempt asks for (Linux moves at most 0x7ffff000 bytes per call anyway; io_uring
// lengths are 32-bit): a larger op takes several attempts.
inline constexpr size_t kMaxAttemptBytes = size_t{1} << 30;

enum class Step { kDone, kAgain, kFailed };

class OpProgress {
 public:
  OpProgress() = default;
  explicit OpProgress(const IoOp& op) : op_(op) {}

  const IoOp& op() const { return op_; }
  size_t done_bytes() const { return done_bytes_; }
  size_t rest_bytes() const { return op_.n_bytes - done_bytes_; }
  // Where the next attempt starts and how much it asks for (0 for fdatasync).
  uint64_t next_offset() const { return op_.byte_offset + done_bytes_; }
  std::byte* next_buffer() const { return op_.buffer + done_bytes_; }
  size_t NextAttemptBytes() const { return rest_bytes() < kMaxAttemptBytes ? rest_bytes() : kMaxAttemptBytes; }

  // One attempt's result: bytes moved (>= 0) or -errno. kAgain: issue the next attempt;
  // kDone/kFailed: Completion() is final. `engine` names the engine in error messages.
  Step Feed(int64_t result, const std::string& engine);

  IoCompletion Completion() const { return IoCompletion{op_.user_data, done_bytes_, status_}; }

 private:
  IoOp op_;
  size_t done_bytes_ = 0;
  Status status_;
};

// Moves completions from the front of `ready` into `out`; returns how many.
size_t TakeReady(std::deque<IoCompletion>& ready, std::span<IoCompletion> out);

// kInvalidArgument naming `engine` and `what` when `engine_obj` has ops in flight.
Status CheckNothingInFlight(const IoEngine& engine_obj, const char* what);

}  // namespace ucpfs::io::internal
