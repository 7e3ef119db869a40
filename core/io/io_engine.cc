// What every IoEngine shares (OpProgress, RunAll, ReadExact) and the pread/pwrite engine.
// The io_uring engine is in uring_engine.cc, the fault engine in fault_engine.cc.
#include "core/io/io_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "core/io/op_progress.h"

namespace ucpfs::io {
namespace internal {
namespace {

const char* KindName(OpKind kind) {
  switch (kind) {
    case OpKind::kRead: return "read";
    case OpKind::kWrite: return "write";
    case OpKind::kFdatasync: return "fdatasync";
  }
  return "op";
}

// "write of 65536 bytes at offset 0 on fd 7 failed at offset 8192 (pread engine)"
std::string Describe(const IoOp& op, uint64_t failed_at, const std::string& engine) {
  if (op.kind == OpKind::kFdatasync) {
    return "fdatasync on fd " + std::to_string(op.fd) + " failed (" + engine + " engine)";
  }
  return std::string(KindName(op.kind)) + " of " + std::to_string(op.n_bytes) + " bytes at offset " +
         std::to_string(op.byte_offset) + " on fd " + std::to_string(op.fd) + " failed at offset " +
         std::to_string(failed_at) + " (" + engine + " engine)";
}

}  // namespace

Step OpProgress::Feed(int64_t result, const std::string& engine) {
  if (result < 0) {
    const int e = static_cast<int>(-result);
    if (e == EINTR || e == EAGAIN) return Step::kAgain;
    const StatusCode code = (e == ENOSPC || e == EDQUOT) ? StatusCode::kNoSpace : StatusCode::kIo;
    status_ = Status(code, Describe(op_, next_offset(), engine) + ": " + std::strerror(e), e);
    return Step::kFailed;
  }
  if (op_.kind == OpKind::kFdatasync) return Step::kDone;
  if (static_cast<uint64_t>(result) > rest_bytes()) {
    status_ = InternalError(Describe(op_, next_offset(), engine) + ": moved " + std::to_string(result) +
                            " bytes, more than the " + std::to_string(rest_bytes()) + " asked for");
    return Step::kFailed;
  }
  done_bytes_ += static_cast<size_t>(result);
  if (rest_bytes() == 0) return Step::kDone;
  if (result > 0) return Step::kAgain;  // short transfer: resume where it stopped
  if (op_.kind == OpKind::kRead) return Step::kDone;  // end of file
  // A write that moves nothing without an error would be retried forever.
  status_ = Status(StatusCode::kIo, Describe(op_, next_offset(), engine) + ": wrote nothing", 0);
  return Step::kFailed;
}

size_t TakeReady(std::deque<IoCompletion>& ready, std::span<IoCompletion> out) {
  size_t n = 0;
  for (; n < out.size() && !ready.empty(); ++n) {
    out[n] = std::move(ready.front());
    ready.pop_front();
  }
  return n;
}

Status CheckNothingInFlight(const IoEngine& engine_obj, const char* what) {
  if (engine_obj.InFlight() == 0) return Status::Ok();
  return InvalidArgumentError(engine_obj.Name() + " engine: " + what + " with " +
                              std::to_string(engine_obj.InFlight()) + " ops in flight");
}

}  // namespace internal

namespace {

using internal::OpProgress;
using internal::Step;

class PreadEngine final : public IoEngine {
 public:
  std::string Name() const override { return "pread"; }

  Status Submit(std::span<const IoOp> ops) override {
    for (const IoOp& op : ops) done_.push_back(Run(op));
    return Status::Ok();
  }

  Result<size_t> Reap(std::span<IoCompletion> out, bool /*wait: nothing is ever pending*/) override {
    return internal::TakeReady(done_, out);
  }

  size_t InFlight() const override { return done_.size(); }
  unsigned QueueDepth() const override { return 1; }

  Status RegisterBuffers(std::span<const iovec> /*regions: no fixed buffers*/) override {
    return internal::CheckNothingInFlight(*this, "RegisterBuffers");
  }
  Status RegisterBufferSlots(unsigned /*n: no fixed buffers*/) override {
    return internal::CheckNothingInFlight(*this, "RegisterBufferSlots");
  }
  Status UpdateBuffer(unsigned /*index*/, const iovec& /*region*/) override {
    return internal::CheckNothingInFlight(*this, "UpdateBuffer");
  }

 private:
  // One system call per attempt.
  static int64_t Attempt(const OpProgress& p) {
    const IoOp& op = p.op();
    const auto byte_offset = static_cast<off_t>(p.next_offset());
    ssize_t n = 0;
    switch (op.kind) {
      case OpKind::kRead: n = ::pread(op.fd, p.next_buffer(), p.NextAttemptBytes(), byte_offset); break;
      case OpKind::kWrite: n = ::pwrite(op.fd, p.next_buffer(), p.NextAttemptBytes(), byte_offset); break;
      case OpKind::kFdatasync: n = ::fdatasync(op.fd); break;
    }
    return n < 0 ? -int64_t{errno} : int64_t{n};
  }

  IoCompletion Run(const IoOp& op) const {
    OpProgress p(op);
    while (p.Feed(Attempt(p), Name()) == Step::kAgain) {
    }
    return p.Completion();
  }

  std::deque<IoCompletion> done_;  // completed inside Submit, not yet reaped
};

}  // namespace

std::vector<IoCompletion> IoEngine::RunAll(std::span<const IoOp> ops) {
  std::vector<IoCompletion> done(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) done[i].user_data = ops[i].user_data;
  if (Status busy = internal::CheckNothingInFlight(*this, "RunAll"); !busy.ok()) {
    for (auto& c : done) c.status = busy;
    return done;
  }
  // Completions come back in any order: tag each op with its index, then restore user_data.
  std::vector<IoOp> tagged(ops.begin(), ops.end());
  for (size_t i = 0; i < tagged.size(); ++i) tagged[i].user_data = i;
  std::vector<bool> back(ops.size(), false);
  Status failure = Submit(tagged);
  std::vector<IoCompletion> batch(std::min<size_t>(ops.size(), 64));
  // Even after a Submit failure, what was queued is reaped: its buffers are in use until then.
  while (InFlight() > 0) {
    Result<size_t> n = Reap(batch, /*wait=*/true);
    if (!n.ok() || *n == 0) {
      failure = n.ok() ? InternalError(Name() + " engine: Reap returned nothing with ops in flight") : n.status();
      break;
    }
    for (size_t k = 0; k < *n; ++k) {
      const uint64_t i = batch[k].user_data;
      if (i >= done.size()) continue;
      done[i].n_bytes = batch[k].n_bytes;
      done[i].status = std::move(batch[k].status);
      back[i] = true;
    }
  }
  for (size_t i = 0; i < done.size(); ++i) {
    if (back[i]) continue;
    done[i].status = failure.ok() ? InternalError(Name() + " engine: op " + std::to_string(i) + " never completed")
                                  : failure;
  }
  return done;
}

Status FirstError(std::span<const IoCompletion> done) {
  for (const IoCompletion& c : done) {
    if (!c.status.ok()) return c.status;
  }
  return Status::Ok();
}

namespace {

// ReadExact's verdict on one completed read of `n_bytes` at byte_offset.
Status ExactReadStatus(const IoCompletion& done, uint64_t byte_offset, size_t n_bytes, const std::string& what) {
  if (done.status.ok() && done.n_bytes >= n_bytes) return Status::Ok();
  const std::string stopped_at = std::to_string(byte_offset + done.n_bytes);
  if (!done.status.ok()) {
    const int e = done.status.sys_errno();
    if (e == 0) return done.status.WithContext(what);
    return Status(done.status.code(), what + ": pread at offset " + stopped_at + ": " + std::strerror(e), e);
  }
  return Status(StatusCode::kDataLoss, what + ": file shrank: short read at offset " + stopped_at);
}

}  // namespace

Status ReadExact(IoEngine& engine, int fd, uint64_t byte_offset, std::span<std::byte> out,
                 const std::string& what) {
  const IoOp op{.kind = OpKind::kRead, .fd = fd, .byte_offset = byte_offset, .buffer = out.data(),
                .n_bytes = out.size()};
  const IoCompletion done = std::move(engine.RunAll(std::span(&op, 1)).front());
  return ExactReadStatus(done, byte_offset, out.size(), what);
}

namespace {

// ReadExactPieces with one op per piece (also the fallback that words a merged read's error).
Status ReadEachPiece(IoEngine& engine, int fd, std::span<const ReadPiece> pieces, const std::string& what,
                     size_t* failed_index) {
  std::vector<IoOp> ops(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    ops[i] = IoOp{.kind = OpKind::kRead, .fd = fd, .byte_offset = pieces[i].byte_offset,
                  .buffer = pieces[i].out.data(), .n_bytes = pieces[i].out.size(), .user_data = i};
  }
  const std::vector<IoCompletion> done = engine.RunAll(ops);
  for (size_t i = 0; i < done.size(); ++i) {
    Status s = ExactReadStatus(done[i], pieces[i].byte_offset, pieces[i].out.size(), what);
    if (!s.ok()) {
      if (failed_index != nullptr) *failed_index = i;
      return s;
    }
  }
  return Status::Ok();
}

// A merged read may span at most this many bytes, and the scattered ones of one batch at most
// kMaxScratchBytes in all (the thread's scratch buffer).
constexpr size_t kMaxMergedBytes = size_t{1} << 20;
constexpr size_t kMaxScratchBytes = size_t{1} << 20;

}  // namespace

Status ReadExactPieces(IoEngine& engine, int fd, std::span<const ReadPiece> pieces, const std::string& what,
                       size_t* failed_index) {
  // Pieces that follow each other in the file become one read: a tensor split by columns is
  // read as one short run per row from each file, adjacent in the file but not in the view, so
  // a request of 1 MiB would be a hundred reads of 8 KiB (each a cold disk read of its own, or
  // an op of the ring). Adjacent in memory too, the read goes straight into the pieces; else
  // into the thread's scratch buffer, then copied out.
  struct Group {
    size_t first = 0, count = 0;
    uint64_t byte_offset = 0;
    size_t n_bytes = 0;
    bool direct = true;  // into pieces[first].out's memory, which the group's pieces tile
    size_t scratch_at = 0;
  };
  std::vector<Group> groups;
  groups.reserve(pieces.size());
  size_t scratch_bytes = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ReadPiece& p = pieces[i];
    if (!groups.empty()) {
      Group& g = groups.back();
      const ReadPiece& last = pieces[i - 1];
      const bool adjacent = g.byte_offset + g.n_bytes == p.byte_offset && !p.out.empty() && !last.out.empty();
      const bool in_memory = g.direct && last.out.data() + last.out.size() == p.out.data();
      const size_t extra = in_memory ? 0 : (g.direct ? g.n_bytes : 0) + p.out.size();
      if (adjacent && g.n_bytes + p.out.size() <= kMaxMergedBytes && scratch_bytes + extra <= kMaxScratchBytes) {
        if (!in_memory && g.direct) {
          g.direct = false;
          g.scratch_at = scratch_bytes;
        }
        scratch_bytes += extra;
        g.n_bytes += p.out.size();
        ++g.count;
        continue;
      }
    }
    groups.push_back(Group{.first = i, .count = 1, .byte_offset = p.byte_offset, .n_bytes = p.out.size()});
  }
  if (groups.size() == pieces.size()) return ReadEachPiece(engine, fd, pieces, what, failed_index);
  thread_local std::vector<std::byte> scratch;
  if (scratch.size() < scratch_bytes) scratch.resize(scratch_bytes);
  std::vector<IoOp> ops(groups.size());
  for (size_t k = 0; k < groups.size(); ++k) {
    const Group& g = groups[k];
    std::byte* into = g.direct ? pieces[g.first].out.data() : scratch.data() + g.scratch_at;
    ops[k] = IoOp{.kind = OpKind::kRead, .fd = fd, .byte_offset = g.byte_offset, .buffer = into,
                  .n_bytes = g.n_bytes, .user_data = k};
  }
  const std::vector<IoCompletion> done = engine.RunAll(ops);
  for (size_t k = 0; k < groups.size(); ++k) {
    if (!ExactReadStatus(done[k], groups[k].byte_offset, groups[k].n_bytes, what).ok()) {
      // Rare: read again piece by piece, so the error names the piece and offset it always did.
      return ReadEachPiece(engine, fd, pieces, what, failed_index);
    }
  }
  for (const Group& g : groups) {
    if (g.direct) continue;
    size_t at = g.scratch_at;
    for (size_t i = g.first; i < g.first + g.count; ++i) {
      std::memcpy(pieces[i].out.data(), scratch.data() + at, pieces[i].out.size());
      at += pieces[i].out.size();
    }
  }
  return Status::Ok();
}

IoEngine& ThreadReadEngine(size_t n_ops) {
  // Made on first use and destroyed at thread exit (FUSE worker threads come and go): each
  // thread's own, so no lock. The ring's depth bounds the ops in flight, not the batch.
  thread_local std::unique_ptr<IoEngine> pread_engine = MakePreadEngine();
  thread_local std::unique_ptr<IoEngine> batch_engine;
  if (n_ops <= 1) return *pread_engine;
  if (!batch_engine) batch_engine = MakeDefaultEngine(32);
  return *batch_engine;
}

std::unique_ptr<IoEngine> MakePreadEngine() { return std::make_unique<PreadEngine>(); }

std::unique_ptr<IoEngine> MakeDefaultEngine(unsigned queue_depth) {
  auto uring = MakeUringEngine(queue_depth);
  if (uring.ok()) return std::move(uring).value();
  return MakePreadEngine();
}

}  // namespace ucpfs::io
