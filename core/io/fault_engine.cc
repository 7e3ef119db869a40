// The fault-injecting IoEngine: runs each op through the inner engine in pieces, cut where the
// FaultPlan says a fault fires. A short transfer is a piece that ends early, EINTR and errors are
// fed to the op's OpProgress as a system call's -errno would be, so what the read path and the
// flusher see under faults is what the real engines' shared retry logic makes of them.
// Not for: production; faults at the system-call level inside the inner engine (the inner
// engine's own short transfers are real ones).
// Invariants: every op in pending_ has exactly one piece queued for or in the inner engine,
// except between Advance's decisions; the inner engine's user_data is the op's id here.
// Also the fault NameOps (name_ops.h): namespace changes counted as ops of the plan and, while it
// tracks unsynced state, remembered until a directory they changed is fsync'd (the model:
// io_engine.h, FaultPlan).
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <unordered_map>

#include "core/io/beneath.h"
#include "core/io/io_engine.h"
#include "core/io/name_ops.h"
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
    u.fd = open(ProcFdPath(op.fd).c_str(), O_WRONLY | O_CLOEXEC);
  }
  u.ranges.emplace_back(op.byte_offset, n_bytes);
}

namespace {

using NodeKey = std::pair<uint64_t, uint64_t>;

NodeKey KeyOf(const struct stat& st) { return {st.st_dev, st.st_ino}; }

// The inode `name` in `dir_fd` names now (not following a symlink), if any.
std::optional<NodeKey> NodeAt(int dir_fd, const std::string& name) {
  struct stat st = {};
  if (fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return std::nullopt;
  return KeyOf(st);
}

}  // namespace

// Undoes one namespace change that a power cut loses, where the names still say it happened
// (a later change kept may have moved things on: then it is left as it is).
void FaultPlan::UndoNameChange(const NameChange& c) {
  using Kind = NameChange::Kind;
  switch (c.kind) {
    case Kind::kCreate:
      if (NodeAt(c.dir_fd, c.name) == c.node) unlinkat(c.dir_fd, c.name.c_str(), 0);
      break;
    case Kind::kMkdir:
      if (NodeAt(c.dir_fd, c.name) == c.node && unlinkat(c.dir_fd, c.name.c_str(), AT_REMOVEDIR) != 0) {
        // Not empty: what was made inside goes with it.
        std::error_code ec;
        std::filesystem::remove_all(ProcFdPath(c.dir_fd) + "/" + c.name, ec);
      }
      break;
    case Kind::kRename:
      if (NodeAt(c.new_dir_fd, c.new_name) == c.node &&
          renameat2(c.new_dir_fd, c.new_name.c_str(), c.dir_fd, c.name.c_str(), RENAME_NOREPLACE) == 0 &&
          !c.stash.empty()) {
        renameat2(c.new_dir_fd, c.stash.c_str(), c.new_dir_fd, c.new_name.c_str(), RENAME_NOREPLACE);
      }
      break;
    case Kind::kUnlink:
      if (!NodeAt(c.dir_fd, c.name) && !c.stash.empty()) {
        renameat2(c.dir_fd, c.stash.c_str(), c.dir_fd, c.name.c_str(), RENAME_NOREPLACE);
      }
      break;
    case Kind::kRmdir:
      if (!NodeAt(c.dir_fd, c.name)) mkdirat(c.dir_fd, c.name.c_str(), c.mode);
      break;
  }
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
  for (auto it = names_.rbegin(); it != names_.rend(); ++it) {
    if (it->durable) continue;
    UndoNameChange(*it);
    ++names_undone_;
  }
  for (NameChange& c : names_) {
    // What a kept unlink or rename removed is gone for good (an undone one's stash is back in
    // place, and this finds nothing).
    if (!c.stash.empty()) unlinkat(c.kind == NameChange::Kind::kRename ? c.new_dir_fd : c.dir_fd, c.stash.c_str(), 0);
    if (c.dir_fd >= 0) close(c.dir_fd);
    if (c.new_dir_fd >= 0) close(c.new_dir_fd);
  }
  names_.clear();
  return dropped;
}

uint64_t FaultPlan::NamesUndone() const {
  std::lock_guard<std::mutex> lock(mu_);
  return names_undone_;
}

FaultPlan::~FaultPlan() {
  for (auto& [key, u] : unsynced_) {
    if (u.fd >= 0) close(u.fd);
  }
  for (NameChange& c : names_) {
    if (c.dir_fd >= 0) close(c.dir_fd);
    if (c.new_dir_fd >= 0) close(c.new_dir_fd);
  }
}

// The system calls of NameOps under a FaultPlan: each takes an op (none while the power is off:
// EIO), and while the plan tracks unsynced state, each change is remembered with what undoing it
// needs (a hard link, in the same directory, to an inode the change takes a name from).
class FaultNames final : public NameOps {
 public:
  explicit FaultNames(std::shared_ptr<FaultPlan> plan) : plan_(std::move(plan)) {}

  int CreateAt(int dirfd, const char* name, int flags, mode_t mode) override {
    if (!plan_->TakeOp()) return Off();
    const bool existed = NodeAt(dirfd, name).has_value();
    const int fd = openat(dirfd, name, flags | O_CREAT, mode);
    struct stat st = {};
    if (fd >= 0 && !existed && Tracking() && fstat(fd, &st) == 0) {
      FaultPlan::NameChange c;
      c.kind = FaultPlan::NameChange::Kind::kCreate;
      c.name = name;
      c.node = KeyOf(st);
      Remember(std::move(c), dirfd, -1);
    }
    return fd;
  }

  int RenameAt(int old_dirfd, const char* old_name, int new_dirfd, const char* new_name, unsigned flags) override {
    if (!plan_->TakeOp()) return Off();
    const auto node = NodeAt(old_dirfd, old_name);
    if (!Tracking() || !node) return renameat2(old_dirfd, old_name, new_dirfd, new_name, flags);
    FaultPlan::NameChange c;
    c.kind = FaultPlan::NameChange::Kind::kRename;
    c.name = old_name;
    c.new_name = new_name;
    c.node = *node;
    struct stat replaced = {};
    if ((flags & RENAME_NOREPLACE) == 0 && fstatat(new_dirfd, new_name, &replaced, AT_SYMLINK_NOFOLLOW) == 0 &&
        !S_ISDIR(replaced.st_mode) && KeyOf(replaced) != *node) {
      c.stash = Stash(new_dirfd, new_name);
    }
    const int rc = renameat2(old_dirfd, old_name, new_dirfd, new_name, flags);
    const int err = errno;
    if (rc != 0) {
      if (!c.stash.empty()) unlinkat(new_dirfd, c.stash.c_str(), 0);
      errno = err;
      return rc;
    }
    Remember(std::move(c), old_dirfd, new_dirfd);
    return 0;
  }

  int UnlinkAt(int dirfd, const char* name, int flags) override {
    if (!plan_->TakeOp()) return Off();
    struct stat st = {};
    if (!Tracking() || fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return unlinkat(dirfd, name, flags);
    FaultPlan::NameChange c;
    c.name = name;
    c.node = KeyOf(st);
    if ((flags & AT_REMOVEDIR) != 0) {
      c.kind = FaultPlan::NameChange::Kind::kRmdir;
      c.mode = st.st_mode & 07777;
    } else {
      c.kind = FaultPlan::NameChange::Kind::kUnlink;
      c.stash = Stash(dirfd, name);
    }
    const int rc = unlinkat(dirfd, name, flags);
    const int err = errno;
    if (rc != 0) {
      if (!c.stash.empty()) unlinkat(dirfd, c.stash.c_str(), 0);
      errno = err;
      return rc;
    }
    Remember(std::move(c), dirfd, -1);
    return 0;
  }

  int MkdirAt(int dirfd, const char* name, mode_t mode) override {
    if (!plan_->TakeOp()) return Off();
    const int rc = mkdirat(dirfd, name, mode);
    if (rc != 0 || !Tracking()) return rc;
    if (const auto node = NodeAt(dirfd, name)) {
      FaultPlan::NameChange c;
      c.kind = FaultPlan::NameChange::Kind::kMkdir;
      c.name = name;
      c.node = *node;
      Remember(std::move(c), dirfd, -1);
    }
    return 0;
  }

  int Fsync(int fd) override {
    if (!plan_->TakeOp()) return Off();
    struct stat st = {};
    if (fstat(fd, &st) != 0) return -1;
    if (fsync(fd) != 0) return -1;
    if (S_ISDIR(st.st_mode)) {
      std::lock_guard<std::mutex> lock(plan_->mu_);
      for (FaultPlan::NameChange& c : plan_->names_) {
        if (c.dir == KeyOf(st) || (c.kind == FaultPlan::NameChange::Kind::kRename && c.new_dir == KeyOf(st))) {
          c.durable = true;
        }
      }
    } else {
      IoOp sync;
      sync.kind = OpKind::kFdatasync;
      sync.fd = fd;
      plan_->Completed(sync, 0);
    }
    return 0;
  }

 private:
  static int Off() {
    errno = EIO;  // the power is off (simulated)
    return -1;
  }

  bool Tracking() const {
    std::lock_guard<std::mutex> lock(plan_->mu_);
    return plan_->track_unsynced_;
  }

  // A new hard link to what `name` in `dirfd` names, beside it; its name ("" if none was made).
  std::string Stash(int dirfd, const char* name) {
    uint64_t n = 0;
    {
      std::lock_guard<std::mutex> lock(plan_->mu_);
      n = plan_->next_stash_++;
    }
    const std::string stash = ".fault-stash-" + std::to_string(getpid()) + "-" + std::to_string(n);
    return linkat(dirfd, name, dirfd, stash.c_str(), 0) == 0 ? stash : std::string();
  }

  void Remember(FaultPlan::NameChange c, int dirfd, int new_dirfd) {
    struct stat st = {};
    c.dir_fd = fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
    if (fstat(dirfd, &st) == 0) c.dir = KeyOf(st);
    if (new_dirfd >= 0) {
      c.new_dir_fd = fcntl(new_dirfd, F_DUPFD_CLOEXEC, 0);
      if (fstat(new_dirfd, &st) == 0) c.new_dir = KeyOf(st);
    }
    std::lock_guard<std::mutex> lock(plan_->mu_);
    plan_->names_.push_back(std::move(c));
  }

  std::shared_ptr<FaultPlan> plan_;
};

std::shared_ptr<NameOps> MakeFaultNameOps(std::shared_ptr<FaultPlan> plan) {
  if (!plan) plan = std::make_shared<FaultPlan>(std::vector<Fault>{});
  return std::make_shared<FaultNames>(std::move(plan));
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
