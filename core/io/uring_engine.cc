// The io_uring IoEngine (liburing): up to QueueDepth() ops in the kernel at once, each in a slot
// whose index is the SQE's user_data; completions come back in whatever order the kernel ends
// them, and an op whose CQE shows a short transfer, -EINTR or -EAGAIN is prepared again in the
// same slot for the rest. Fixed buffers (read_fixed/write_fixed) are used for ops that name a
// registered region holding their bytes.
// Not for: SQPOLL or linked SQEs (ordering is the caller's, by batches).
// Invariants: in-kernel SQEs <= slots in use <= QueueDepth() <= SQ entries, and the CQ has twice
// the SQ's entries, so neither get_sqe nor the CQ can run out.
#include <liburing.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <utility>

#include "core/io/io_engine.h"
#include "core/io/op_progress.h"

namespace ucpfs::io {
namespace {

using internal::OpProgress;
using internal::Step;

constexpr unsigned kMaxQueueDepth = 4096;

struct UringProbe {
  bool ok = false;
  std::string why;  // when not ok
};

// Runs once per process (a function-local static is initialized once, thread-safely): a tiny
// ring, and the opcodes the engine prepares.
const UringProbe& Probe() {
  static const UringProbe probe = [] {
    UringProbe p;
    struct io_uring ring {};
    if (int r = io_uring_queue_init(4, &ring, 0); r < 0) {
      p.why = std::string("io_uring_queue_init: ") + std::strerror(-r);
      return p;
    }
    struct io_uring_probe* ops = io_uring_get_probe_ring(&ring);
    if (ops == nullptr) {
      p.why = "the kernel cannot list its io_uring opcodes (before Linux 5.6)";
    } else {
      static constexpr std::pair<int, const char*> kNeeded[] = {
          {IORING_OP_READ, "IORING_OP_READ"},           {IORING_OP_WRITE, "IORING_OP_WRITE"},
          {IORING_OP_READ_FIXED, "IORING_OP_READ_FIXED"}, {IORING_OP_WRITE_FIXED, "IORING_OP_WRITE_FIXED"},
          {IORING_OP_FSYNC, "IORING_OP_FSYNC"}};
      for (const auto& [op, name] : kNeeded) {
        if (!io_uring_opcode_supported(ops, op)) {
          p.why = std::string("the kernel lacks ") + name;
          break;
        }
      }
      io_uring_free_probe(ops);
      p.ok = p.why.empty();
    }
    io_uring_queue_exit(&ring);
    return p;
  }();
  return probe;
}

class UringEngine final : public IoEngine {
 public:
  // Errors: kIo with sys_errno when io_uring_queue_init fails.
  static Result<std::unique_ptr<IoEngine>> Make(unsigned queue_depth) {
    std::unique_ptr<UringEngine> engine(new UringEngine(queue_depth));
    if (int r = io_uring_queue_init(queue_depth, &engine->ring_, 0); r < 0) {
      return IoError("io_uring_queue_init(" + std::to_string(queue_depth) + "): " + std::strerror(-r), -r);
    }
    engine->ring_ready_ = true;
    return std::unique_ptr<IoEngine>(std::move(engine));
  }

  ~UringEngine() override {
    if (!ring_ready_) return;
    // The kernel may still write into the buffers of in-kernel ops: wait for them before the
    // ring (and the caller's buffers) go away.
    while (in_kernel_ > 0) {
      struct io_uring_cqe* cqe = nullptr;
      const int r = io_uring_wait_cqe(&ring_, &cqe);
      if (r == -EINTR) continue;
      if (r < 0) break;  // cannot wait: nothing better to do than tear the ring down
      io_uring_cqe_seen(&ring_, cqe);
      --in_kernel_;
    }
    io_uring_queue_exit(&ring_);
  }

  UringEngine(const UringEngine&) = delete;
  UringEngine& operator=(const UringEngine&) = delete;

  std::string Name() const override { return "io_uring"; }

  Status Submit(std::span<const IoOp> ops) override {
    for (const IoOp& op : ops) {
      // Ring full: reap into ready_ (Reap hands those out first) until a slot is free.
      while (free_slots_.empty()) {
        UCPFS_ASSIGN_OR_RETURN(size_t got, Collect(/*wait=*/true));
        (void)got;
      }
      const uint32_t slot = free_slots_.back();
      free_slots_.pop_back();
      slots_[slot] = OpProgress(op);
      if (Status s = Prepare(slot); !s.ok()) {
        Finish(slot, s);
        return s;
      }
    }
    return Flush();
  }

  Result<size_t> Reap(std::span<IoCompletion> out, bool wait) override {
    size_t n = internal::TakeReady(ready_, out);
    while (n < out.size() && SlotsInUse() > 0) {
      UCPFS_ASSIGN_OR_RETURN(size_t got, Collect(/*wait=*/wait && n == 0));
      n += internal::TakeReady(ready_, out.subspan(n));
      if (got == 0) break;  // nothing more without waiting
    }
    return n;
  }

  size_t InFlight() const override { return SlotsInUse() + ready_.size(); }
  unsigned QueueDepth() const override { return static_cast<unsigned>(slots_.size()); }

  Status RegisterBuffers(std::span<const iovec> regions) override {
    UCPFS_RETURN_IF_ERROR(internal::CheckNothingInFlight(*this, "RegisterBuffers"));
    if (!registered_.empty()) {
      if (int r = io_uring_unregister_buffers(&ring_); r < 0) {
        return IoError(std::string("io_uring_unregister_buffers: ") + std::strerror(-r), -r);
      }
      registered_.clear();
    }
    if (regions.empty()) return Status::Ok();
    if (int r = io_uring_register_buffers(&ring_, regions.data(), static_cast<unsigned>(regions.size())); r < 0) {
      size_t n_bytes = 0;
      for (const iovec& v : regions) n_bytes += v.iov_len;
      return IoError("io_uring_register_buffers of " + std::to_string(regions.size()) + " regions (" +
                         std::to_string(n_bytes) + " bytes): " + std::strerror(-r),
                     -r);
    }
    registered_.assign(regions.begin(), regions.end());
    return Status::Ok();
  }

  Status RegisterBufferSlots(unsigned n) override {
    UCPFS_RETURN_IF_ERROR(RegisterBuffers({}));  // drops what was registered
    if (n == 0) return Status::Ok();
    if (int r = io_uring_register_buffers_sparse(&ring_, n); r < 0) {
      return IoError("io_uring_register_buffers_sparse of " + std::to_string(n) + " slots: " + std::strerror(-r), -r);
    }
    registered_.assign(n, iovec{nullptr, 0});  // empty slots: FixedIndex never picks them
    return Status::Ok();
  }

  Status UpdateBuffer(unsigned index, const iovec& region) override {
    UCPFS_RETURN_IF_ERROR(internal::CheckNothingInFlight(*this, "UpdateBuffer"));
    if (index >= registered_.size()) {
      return InvalidArgumentError("UpdateBuffer: slot " + std::to_string(index) + " of " +
                                  std::to_string(registered_.size()));
    }
    __u64 tag = 0;
    if (int r = io_uring_register_buffers_update_tag(&ring_, index, &region, &tag, 1); r < 0) {
      return IoError("io_uring_register_buffers_update_tag of slot " + std::to_string(index) + ": " +
                         std::strerror(-r),
                     -r);
    }
    registered_[index] = region;
    return Status::Ok();
  }

 private:
  explicit UringEngine(unsigned queue_depth) : slots_(queue_depth) {
    free_slots_.reserve(queue_depth);
    for (uint32_t i = queue_depth; i > 0; --i) free_slots_.push_back(i - 1);
  }

  size_t SlotsInUse() const { return slots_.size() - free_slots_.size(); }

  // The registered region the slot's next attempt lies in, or -1 (then an ordinary read/write).
  int FixedIndex(const OpProgress& p) const {
    const int i = p.op().registered_buffer;
    if (i < 0 || static_cast<size_t>(i) >= registered_.size()) return -1;
    const auto begin = reinterpret_cast<uintptr_t>(registered_[static_cast<size_t>(i)].iov_base);
    const uintptr_t end = begin + registered_[static_cast<size_t>(i)].iov_len;
    const auto lo = reinterpret_cast<uintptr_t>(p.next_buffer());
    return lo >= begin && lo <= end && p.NextAttemptBytes() <= end - lo ? i : -1;
  }

  // Prepares an SQE for the slot's next attempt (submitted by the next Flush).
  Status Prepare(uint32_t slot) {
    struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      UCPFS_RETURN_IF_ERROR(Flush());
      sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) return InternalError("io_uring: no free submission queue entry");
    }
    const OpProgress& p = slots_[slot];
    const IoOp& op = p.op();
    const auto n_bytes = static_cast<unsigned>(p.NextAttemptBytes());  // <= kMaxAttemptBytes
    const int fixed = FixedIndex(p);
    switch (op.kind) {
      case OpKind::kRead:
        if (fixed >= 0) {
          io_uring_prep_read_fixed(sqe, op.fd, p.next_buffer(), n_bytes, p.next_offset(), fixed);
        } else {
          io_uring_prep_read(sqe, op.fd, p.next_buffer(), n_bytes, p.next_offset());
        }
        break;
      case OpKind::kWrite:
        if (fixed >= 0) {
          io_uring_prep_write_fixed(sqe, op.fd, p.next_buffer(), n_bytes, p.next_offset(), fixed);
        } else {
          io_uring_prep_write(sqe, op.fd, p.next_buffer(), n_bytes, p.next_offset());
        }
        break;
      case OpKind::kFdatasync: io_uring_prep_fsync(sqe, op.fd, IORING_FSYNC_DATASYNC); break;
    }
    io_uring_sqe_set_data64(sqe, slot);
    return Status::Ok();
  }

  // Submits every prepared SQE. Errors: kIo with sys_errno from io_uring_submit.
  Status Flush() {
    while (io_uring_sq_ready(&ring_) > 0) {
      const int r = io_uring_submit(&ring_);
      if (r == -EINTR) continue;
      if (r < 0) return IoError(std::string("io_uring_submit: ") + std::strerror(-r), -r);
      if (r == 0) return InternalError("io_uring_submit took none of the prepared entries");
      in_kernel_ += static_cast<size_t>(r);
    }
    return Status::Ok();
  }

  // Handles every CQE there is (waiting for one first when `wait` and any are in the kernel):
  // finished ops go to ready_, the others are prepared again and submitted. Returns how many
  // CQEs it handled. Errors: Flush's; kIo with sys_errno from io_uring_wait_cqe.
  Result<size_t> Collect(bool wait) {
    UCPFS_RETURN_IF_ERROR(Flush());
    if (in_kernel_ == 0) return size_t{0};
    if (wait) {
      struct io_uring_cqe* cqe = nullptr;
      int r = 0;
      do {
        r = io_uring_wait_cqe(&ring_, &cqe);
      } while (r == -EINTR);
      if (r < 0) return IoError(std::string("io_uring_wait_cqe: ") + std::strerror(-r), -r);
    }
    size_t handled = 0;
    struct io_uring_cqe* cqes[64];
    while (unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, 64)) {
      for (unsigned k = 0; k < n; ++k) {
        OnCqe(static_cast<uint32_t>(io_uring_cqe_get_data64(cqes[k])), cqes[k]->res);
      }
      io_uring_cq_advance(&ring_, n);
      handled += n;
    }
    UCPFS_RETURN_IF_ERROR(Flush());
    return handled;
  }

  void OnCqe(uint32_t slot, int32_t res) {
    --in_kernel_;
    OpProgress& p = slots_[slot];
    const Step step = p.Feed(res, Name());
    if (step != Step::kAgain) {
      Finish(slot, Status::Ok());
      return;
    }
    // Not Prepare's error to the caller: CQEs are being handled. It ends this op instead.
    if (Status s = Prepare(slot); !s.ok()) Finish(slot, s);
  }

  // The slot's op is over: its completion (with `failure` when given) goes to ready_.
  void Finish(uint32_t slot, const Status& failure) {
    IoCompletion c = slots_[slot].Completion();
    if (!failure.ok()) c.status = failure;
    ready_.push_back(std::move(c));
    free_slots_.push_back(slot);
  }

  struct io_uring ring_ {};
  bool ring_ready_ = false;
  std::vector<OpProgress> slots_;
  std::vector<uint32_t> free_slots_;
  size_t in_kernel_ = 0;              // submitted SQEs whose CQE has not been handled
  std::deque<IoCompletion> ready_;    // finished, not yet reaped
  std::vector<iovec> registered_;     // the fixed buffers, by index
};

}  // namespace

Result<std::unique_ptr<IoEngine>> MakeUringEngine(unsigned queue_depth) {
  if (queue_depth == 0 || queue_depth > kMaxQueueDepth) {
    return InvalidArgumentError("io_uring queue depth " + std::to_string(queue_depth) + " not in [1, " +
                                std::to_string(kMaxQueueDepth) + "]");
  }
  const UringProbe& probe = Probe();
  if (!probe.ok) return UnsupportedError("io_uring unavailable: " + probe.why);
  return UringEngine::Make(queue_depth);
}

}  // namespace ucpfs::io
