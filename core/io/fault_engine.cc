// The fault-injecting IoEngine: runs each op through the inner engine in pieces, cut where the
// FaultPlan says a fault fires. A short transfer is a piece that ends early, EINTR and errors are
// fed to the op's OpProgress as a system call's -errno would be, so what the read path and the
// flusher see under faults is what the real engines' shared retry logic makes of them.
// Not for: production; faults at the system-call level inside the inner engine (the inner
// engine's own short transfers are real ones).
// Invariants: every op in pending_ has exactly one piece queued for or in the inner engine,
// except between Advance's decisions; the inner engine's user_data is the op's id here.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <unordered_map>

#include "core/io/io_engine.h"
#include "core/io/op_progress.h"

namespace ucpfs::io {

using internal::OpProgress;
using internal::Step;

namespace {

// Where several faults meet an op at one offset, an error fires before an EINTR and an EINTR
// before a short transfer, which would move the op past the others; then the first listed.
int Rank(Fault::Effect effect) {
  switch (effect) {
    case Fault::Effect::kError: return 0;
    case Fault::Effect::kEintr: return 1;
    case Fault::Effect::kShort: return 2;
  }
  return 3;
}

bool Before(const Fault& a, const Fault& b) {
  if (a.kind != OpKind::kFdatasync && a.byte_offset != b.byte_offset) return a.byte_offset < b.byte_offset;
  return Rank(a.effect) < Rank(b.effect);
}

}  // namespace

std::optional<FaultPlan::Hit> FaultPlan::Nearest(OpKind kind, uint64_t from_offset, uint64_t to_offset,
                                                 std::span<const size_t> fired) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<Hit> best;
  for (size_t i = 0; i < faults_.size(); ++i) {
    const Fault& f = faults_[i];
    if (f.kind != kind || f.times == 0) continue;
    const bool covered = kind == OpKind::kFdatasync || (f.byte_offset >= from_offset && f.byte_offset < to_offset);
    if (!covered || std::find(fired.begin(), fired.end(), i) != fired.end()) continue;
    if (!best || Before(f, best->fault)) best = Hit{i, f};
  }
  return best;
}

bool FaultPlan::Claim(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  int& times = faults_[index].times;
  if (times == 0) return false;  // another engine took the last one since Nearest
  if (times > 0) --times;
  injected_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void FaultPlan::TrackUnsynced() {
  std::lock_guard<std::mutex> lock(mu_);
  track_unsynced_ = true;
}

void FaultPlan::CutPowerAfterOps(uint64_t n_ops) {
  std::lock_guard<std::mutex> lock(mu_);
  cut_at_op_ = ops_submitted_.load() + n_ops;
}

bool FaultPlan::PowerIsOff() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_submitted_.load() >= cut_at_op_;
}

bool FaultPlan::TakeOp() {
  std::lock_guard<std::mutex> lock(mu_);
  if (ops_submitted_.load() >= cut_at_op_) return false;
  ops_submitted_.fetch_add(1);
  return true;
}

void FaultPlan::Completed(const IoOp& op, size_t n_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!track_unsynced_) return;
  struct stat st = {};
  if (fstat(op.fd, &st) != 0) return;
  const std::pair<uint64_t, uint64_t> key{st.st_dev, st.st_ino};
  if (op.kind == OpKind::kFdatasync) {
    const auto it = unsynced_.find(key);
    if (it != unsynced_.end()) it->second.ranges.clear();
    return;
  }
  if (op.kind != OpKind::kWrite || n_bytes == 0) return;
  Unsynced& u = unsynced_[key];
  if (u.fd < 0) {
    // A descriptor of our own (not O_DIRECT, unlike a dup), that holds the inode through
    // renames and unlinks.
    const std::string proc = "/proc/self/fd/" + std::to_string(op.fd);
    u.fd = open(proc.c_str(), O_WRONLY | O_CLOEXEC);
  }
  u.ranges.emplace_back(op.byte_offset, n_bytes);
}

uint64_t FaultPlan::DropUnsynced() {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t dropped = 0;
  for (auto& [key, u] : unsynced_) {
    for (const auto& [at, n] : u.ranges) {
      const std::vector<unsigned char> garbage(n, 0xA5);
      if (u.fd >= 0 && pwrite(u.fd, garbage.data(), n, static_cast<off_t>(at)) == static_cast<ssize_t>(n)) dropped += n;
    }
    u.ranges.clear();
    if (u.fd >= 0) fsync(u.fd);
  }
  return dropped;
}

FaultPlan::~FaultPlan() {
  for (auto& [key, u] : unsynced_) {
    if (u.fd >= 0) close(u.fd);
  }
}

class FaultEngine final : public IoEngine {
 public:
  FaultEngine(std::unique_ptr<IoEngine> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)), name_("fault(" + inner_->Name() + ")"), batch_(64) {}

  std::string Name() const override { return name_; }

  Status Submit(std::span<const IoOp> ops) override {
    for (const IoOp& op : ops) {
      if (!plan_->TakeOp()) {  // the power is off: nothing moves
        ready_.push_back(IoCompletion{op.user_data, 0, IoError(name_ + ": the power is off (simulated)", EIO)});
        continue;
      }
      const uint64_t id = next_id_++;
      Pending& p = pending_[id];
      p.progress = OpProgress(op);
      Advance(id, p);
    }
    return FlushToInner();
  }

  Result<size_t> Reap(std::span<IoCompletion> out, bool wait) override {
    size_t n = internal::TakeReady(ready_, out);
    while (n < out.size() && inner_->InFlight() > 0) {
      UCPFS_ASSIGN_OR_RETURN(size_t got, inner_->Reap(batch_, /*wait=*/wait && n == 0));
      for (size_t k = 0; k < got; ++k) OnInner(batch_[k]);
      UCPFS_RETURN_IF_ERROR(FlushToInner());
      n += internal::TakeReady(ready_, out.subspan(n));
      if (got == 0) break;  // nothing more without waiting
    }
    return n;
  }

  size_t InFlight() const override { return pending_.size() + ready_.size(); }
  unsigned QueueDepth() const override { return inner_->QueueDepth(); }

  Status RegisterBufferSlots(unsigned n) override {
    UCPFS_RETURN_IF_ERROR(internal::CheckNothingInFlight(*this, "RegisterBufferSlots"));
    return inner_->RegisterBufferSlots(n);
  }
  Status UpdateBuffer(unsigned index, const iovec& region) override {
    UCPFS_RETURN_IF_ERROR(internal::CheckNothingInFlight(*this, "UpdateBuffer"));
    return inner_->UpdateBuffer(index, region);
  }
  Status RegisterBuffers(std::span<const iovec> regions) override {
    UCPFS_RETURN_IF_ERROR(internal::CheckNothingInFlight(*this, "RegisterBuffers"));
    return inner_->RegisterBuffers(regions);
  }

 private:
  struct Pending {
    OpProgress progress;
    std::vector<size_t> fired;  // plan indices that already fired for this op
  };

  // Decides the op's next piece from where it stands: the faults it reaches first fire (EINTR and
  // errors right here, through OpProgress), then one piece goes to the inner engine, or the op is
  // over.
  void Advance(uint64_t id, Pending& p) {
    const OpKind kind = p.progress.op().kind;
    for (;;) {
      const uint64_t from_offset = p.progress.next_offset();
      const size_t rest_bytes = p.progress.rest_bytes();
      const auto hit = plan_->Nearest(kind, from_offset, from_offset + rest_bytes, p.fired);
      if (!hit) return Issue(id, p, rest_bytes);
      const Fault& f = hit->fault;
      const bool at_start = kind == OpKind::kFdatasync || f.byte_offset == from_offset;
      // An error fires where the transfer reaches it: the bytes before it move first.
      if (f.effect == Fault::Effect::kError && !at_start) return Issue(id, p, f.byte_offset - from_offset);
      p.fired.push_back(hit->index);
      switch (f.effect) {
        case Fault::Effect::kEintr:
          if (plan_->Claim(hit->index)) (void)p.progress.Feed(-EINTR, name_);  // kAgain: retried here
          break;
        case Fault::Effect::kShort: {
          if (kind == OpKind::kFdatasync) break;
          size_t n_bytes = f.byte_offset - from_offset;
          if (at_start) {
            n_bytes = rest_bytes / 2;
            // Halving must not carry the op past a fault it has not met yet.
            if (const auto next = plan_->Nearest(kind, from_offset + 1, from_offset + n_bytes, p.fired)) {
              n_bytes = next->fault.byte_offset - from_offset;
            }
          }
          if (n_bytes > 0 && plan_->Claim(hit->index)) return Issue(id, p, n_bytes);
          break;
        }
        case Fault::Effect::kError:
          if (plan_->Claim(hit->index) &&
              p.progress.Feed(-int64_t{f.sys_errno > 0 ? f.sys_errno : EIO}, name_) != Step::kAgain) {
            return Finish(id);
          }
          break;
      }
    }
  }

  // Queues the op's next n_bytes for the inner engine (sent by FlushToInner).
  void Issue(uint64_t id, const Pending& p, size_t n_bytes) {
    IoOp piece = p.progress.op();
    piece.byte_offset = p.progress.next_offset();
    piece.buffer = p.progress.next_buffer();
    piece.n_bytes = n_bytes;
    piece.user_data = id;
    to_inner_.push_back(piece);
  }

  Status FlushToInner() {
    if (to_inner_.empty()) return Status::Ok();
    Status s = inner_->Submit(to_inner_);
    to_inner_.clear();
    return s;
  }

  void OnInner(IoCompletion& piece) {
    auto it = pending_.find(piece.user_data);
    if (it == pending_.end()) return;
    Pending& p = it->second;
    if (!piece.status.ok()) {  // the inner engine's error, as it worded it (naming the piece)
      ready_.push_back(IoCompletion{p.progress.op().user_data, p.progress.done_bytes() + piece.n_bytes,
                                    std::move(piece.status)});
      pending_.erase(it);
      return;
    }
    if (p.progress.Feed(static_cast<int64_t>(piece.n_bytes), name_) == Step::kAgain) return Advance(it->first, p);
    Finish(it->first);
  }

  void Finish(uint64_t id) {
    auto it = pending_.find(id);
    IoCompletion c = it->second.progress.Completion();
    if (c.status.ok()) plan_->Completed(it->second.progress.op(), c.n_bytes);
    ready_.push_back(std::move(c));
    pending_.erase(it);
  }

  std::unique_ptr<IoEngine> inner_;
  std::shared_ptr<FaultPlan> plan_;
  const std::string name_;
  uint64_t next_id_ = 0;
  std::unordered_map<uint64_t, Pending> pending_;  // submitted, not finished
  std::vector<IoOp> to_inner_;                     // pieces decided, not yet submitted
  std::deque<IoCompletion> ready_;                 // finished, not yet reaped
  std::vector<IoCompletion> batch_;                // the inner engine's completions
};

std::unique_ptr<IoEngine> MakeFaultEngine(std::unique_ptr<IoEngine> inner, std::shared_ptr<FaultPlan> plan) {
  if (!plan) plan = std::make_shared<FaultPlan>(std::vector<Fault>{});
  return std::make_unique<FaultEngine>(std::move(inner), std::move(plan));
}

}  // namespace ucpfs::io
