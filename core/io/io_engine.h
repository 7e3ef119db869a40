// IoEngine: the one interface through which ucpfs reads and writes file bytes (RocksDB's
// FileSystem shape): batches of positional reads, writes and fdatasyncs, run by
//   - the pread/pwrite engine (MakePreadEngine): one system call per op, always available;
//   - the io_uring engine (MakeUringEngine): several ops in flight, completions out of order,
//     buffers optionally registered with the ring (fixed buffers, for O_DIRECT from pinned
//     memory); its availability is probed once per process and cached;
//   - the fault-injecting engine (MakeFaultEngine): wraps another and injects short transfers,
//     EINTR, EIO or ENOSPC at chosen file offsets, for tests.
// Not for: opening, naming or closing files (callers own descriptors), or buffering.
//
// Semantics every engine shares (one conformance suite, tests/unit/io_engine_test.cc, runs on
// all three):
//   - An op completes when all of its n_bytes moved, or with an error: a short transfer is
//     resumed where it stopped, EINTR/EAGAIN retried; a read that meets end of file completes
//     with the bytes it got (IoCompletion::n_bytes < n_bytes), never an error.
//   - Errors are kIo (or kNoSpace for ENOSPC/EDQUOT) with the exact sys_errno, naming the op, the
//     fd, the op's range, the offset where it failed and the engine, e.g.
//       "write of 65536 bytes at offset 0 on fd 7 failed at offset 8192 (pread engine): No space
//        left on device".
//     ("fdatasync on fd 7 failed (io_uring engine): ..."). A write that moves nothing without
//     an error is kIo with sys_errno 0 ("...: wrote nothing"). The fault engine passes its inner
//     engine's errors on as worded there (naming the piece of the op that failed). A failed
//     op's IoCompletion::n_bytes is what moved before the error, so it failed at
//     byte_offset + n_bytes (bytes before that point may have been written).
//   - Ops of one batch may run in any order and complete in any order; a caller that needs an
//     order (data before its fdatasync) waits for the first batch before submitting the next.
//     Completions are matched to ops by user_data only.
//   - O_DIRECT: the engines add no alignment of their own; the caller's buffers, offsets and
//     lengths must meet the file's (4096 is safe). Resumed short transfers keep whatever
//     alignment the kernel's short count had.
//
// Lifetimes: an op's buffer must stay valid until its completion has been reaped, or the engine
// destroyed: destroying an engine waits for the ops it has in the kernel and drops their
// completions (file ops always end; a read of a pipe that nobody writes would hold it up).
//
// Thread-safety: an engine object is used by one thread at a time (one per flusher, or one per
// reader thread); make one per thread. Make* functions are thread-safe, and so is a FaultPlan
// (engines of many threads may share one).
//
// Changes from the first draft of this header:
//   - The fault engine's faults and its injection count live in a FaultPlan that the caller
//     holds by shared_ptr (MakeFaultEngine takes one): the count outlives the engine, and the
//     engines that FileSource makes per read (IoEngineFactory) share one plan and one count.
//   - IoEngineFactory: how a shared reader (FileSource) makes single-thread engines.
//   - A failed op's IoCompletion::n_bytes is what moved before the error (was unspecified).
//   - RunAll returns the completions only; FirstError gives the first error (the draft spoke of
//     a RunAll(...).status that does not exist). RunAll with ops already in flight fails every
//     op with kInvalidArgument rather than mixing their completions in.
//   - RegisterBuffers with ops in flight is kInvalidArgument in every engine (was a caveat).
//   - ReadExact: an early end of file is kDataLoss ("file shrank"), not kIo, and the messages
//     are the read path's ("<what>: pread at offset N: <strerror>"), so FileSource reads through
//     it unchanged.
//   - QueueDepth of the pread engine is 1: it runs each op inside Submit, to completion.
//   - Fault: when each effect fires (a fault at most once per op; shorts and errors where the
//     transfer reaches the offset, EINTR on the attempt that covers it), what kShort does when
//     the op starts at its offset, which fires first at one offset, and that fdatasync faults
//     ignore byte_offset.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/byte_source.h"
#include "core/status.h"

namespace ucpfs::io {

enum class OpKind { kRead, kWrite, kFdatasync };

struct IoOp {
  OpKind kind = OpKind::kRead;
  int fd = -1;
  uint64_t byte_offset = 0;
  std::byte* buffer = nullptr;  // kRead: filled; kWrite: read (const in spirit); kFdatasync: unused
  size_t n_bytes = 0;
  // Index of a buffer registered with RegisterBuffers that holds [buffer, buffer + n_bytes),
  // or -1. Only a hint: engines without fixed buffers ignore it, and the io_uring engine runs
  // an op whose range is not inside that registered buffer as an ordinary read or write.
  int registered_buffer = -1;
  uint64_t user_data = 0;  // returned in the completion
};

struct IoCompletion {
  uint64_t user_data = 0;
  size_t n_bytes = 0;  // moved (reads: fewer at end of file; failed ops: before the error)
  Status status;
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;

  // "pread", "io_uring", "fault(<inner>)".
  virtual std::string Name() const = 0;

  // Queues ops; at most QueueDepth() may be in flight, and Submit blocks (reaping into an
  // internal list that Reap returns first) when the ring is full. The pread engine runs each op
  // to completion inside Submit. The buffers must stay valid until the op's completion has been
  // reaped. Errors: kIo when the engine itself fails (io_uring_submit or io_uring_wait_cqe:
  // sys_errno set), not an op: ops fail through their completions. After such an error some of
  // this call's ops may have been queued and the rest not (InFlight() tells how many are
  // pending); keep reaping while InFlight() > 0 before freeing buffers, and expect the engine
  // to fail again (RunAll does this and fails the ops left without a completion).
  virtual Status Submit(std::span<const IoOp> ops) = 0;
  // Completions of submitted ops, at most out.size(); waits for at least one when `wait` and
  // any are in flight. Returns how many were written to `out`. Errors: kIo when the engine
  // itself fails (io_uring_wait_cqe, or an inner engine's Reap or Submit).
  virtual Result<size_t> Reap(std::span<IoCompletion> out, bool wait) = 0;
  // Ops submitted and not yet reaped.
  virtual size_t InFlight() const = 0;
  virtual unsigned QueueDepth() const = 0;

  // Registers memory regions as fixed buffers (io_uring_register_buffers); index i of `regions`
  // is IoOp::registered_buffer i. Replaces earlier registrations (an empty span removes them).
  // Engines without fixed buffers accept and ignore it. Errors: kInvalidArgument when ops are
  // in flight; kIo with sys_errno (ENOMEM past RLIMIT_MEMLOCK, EFAULT, EINVAL).
  virtual Status RegisterBuffers(std::span<const iovec> regions) = 0;
  // Sparse registration: `n` fixed-buffer slots, all empty (ops naming an empty slot run as
  // ordinary reads and writes), filled one at a time by UpdateBuffer, e.g. as the pinned cache
  // locks each chunk on first use (registering pins the pages: at once, it would fault in all
  // of them). Replaces earlier registrations. Engines without fixed buffers accept and ignore
  // both. Errors: as RegisterBuffers.
  virtual Status RegisterBufferSlots(unsigned n) = 0;
  // Fills slot `index` (of RegisterBufferSlots) with `region`. Errors: kInvalidArgument for an
  // index out of range or ops in flight; kIo with sys_errno.
  virtual Status UpdateBuffer(unsigned index, const iovec& region) = 0;

  // Runs `ops` to completion (Submit, then Reap until all are back) and returns one completion
  // per op, in the order of `ops`, with the ops' own user_data. FirstError(RunAll(ops)) is the
  // first error in op order. Needs nothing else in flight: otherwise every op fails with
  // kInvalidArgument and nothing is submitted. An engine failure (Submit's or Reap's error)
  // becomes the status of every op it left without a completion.
  std::vector<IoCompletion> RunAll(std::span<const IoOp> ops);
};

// Makes an engine for the calling thread. Called from many threads at once, so it must be
// thread-safe; it never returns null.
using IoEngineFactory = std::function<std::unique_ptr<IoEngine>()>;

// The first failed completion's status in `done`'s order, or OK.
Status FirstError(std::span<const IoCompletion> done);

// Reads exactly out.size() bytes at byte_offset from fd through `engine`, for a range the
// caller knows the file holds (it checked the size), so an early end of file means the file
// shrank. Needs nothing else in flight on `engine` (see RunAll). Errors, worded as the read
// path has always worded them, whatever the engine:
//   - the op's code (kIo) and sys_errno: "<what>: pread at offset <failed at>: <strerror>";
//   - kDataLoss: "<what>: file shrank: short read at offset <end of file>";
//   - an error without an errno (engine failure, RunAll misuse): its status with `what` first.
Status ReadExact(IoEngine& engine, int fd, uint64_t byte_offset, std::span<std::byte> out,
                 const std::string& what);

// ReadExact of several ranges of one file, submitted to `engine` as one batch (io_uring runs
// them together). Needs nothing else in flight. Errors: ReadExact's, of the first failing piece
// in the order given; its index goes to *failed_index (when not null).
Status ReadExactPieces(IoEngine& engine, int fd, std::span<const ReadPiece> pieces, const std::string& what,
                       size_t* failed_index = nullptr);

// The calling thread's engine for reads of source files, made on its first use and kept for the
// thread's life (read path: no engine is made per read): io_uring when it can be used here
// (one ring per reader thread) else pread. `n_ops` is the batch about to be read: a batch of
// one op goes through pread whatever the thread has, since a ring gains nothing on one op and
// costs a hand-off to a kernel worker on a cold file.
IoEngine& ThreadReadEngine(size_t n_ops);

std::unique_ptr<IoEngine> MakePreadEngine();

// Errors: kInvalidArgument when queue_depth is 0 or above 4096; kUnsupported when io_uring
// cannot be used here (kernel, seccomp, RLIMIT_MEMLOCK, missing opcodes): the probe runs once
// per process, its result is cached, and every kUnsupported carries its reason; kIo with
// sys_errno when the probe passed but this ring could not be set up (io_uring_queue_init).
Result<std::unique_ptr<IoEngine>> MakeUringEngine(unsigned queue_depth = 32);
// io_uring when MakeUringEngine succeeds, else pread.
std::unique_ptr<IoEngine> MakeDefaultEngine(unsigned queue_depth = 32);

// A fault to inject: the first op of `kind` on any fd whose range covers `byte_offset` (and each
// later one, up to `times`) gets `effect`. A fault fires at most once per op (its resumed rest
// included). A short transfer or an error fires when the op's transfer reaches `byte_offset`:
// the op starts there, or every byte before it has moved (a read that meets end of file before
// it never reaches it; one that ends just at it does). Where several meet an op at one offset,
// errors fire first, then EINTRs, then shorts. Ops of one batch reach faults in the engine's
// order, so with `times` limited, which of them gets a fault is not fixed. fdatasync faults
// ignore byte_offset (every fdatasync op matches).
struct Fault {
  enum class Effect {
    // Moves only the bytes before byte_offset, then resumes; when byte_offset is where the op
    // (or its rest) starts, moves half of it (never past another fault it has not met). An op
    // of 1 byte is never shortened. Reads and writes only.
    kShort,
    kEintr,   // the first attempt whose range covers byte_offset fails with EINTR (then retried)
    kError,   // completes with errno `sys_errno` (EIO, ENOSPC, ...) after moving the bytes before
              // byte_offset; a sys_errno <= 0 counts as EIO, and EINTR/EAGAIN are retried as a
              // system call's would be
  };
  OpKind kind = OpKind::kRead;
  uint64_t byte_offset = 0;
  Effect effect = Effect::kError;
  int sys_errno = 5;  // EIO
  int times = 1;      // -1: every time
};

class FaultEngine;

// The faults of one test and how many were injected: shared (shared_ptr) by every fault engine
// made with it, thread-safe. `times` counts down across all of them.
class FaultPlan {
 public:
  explicit FaultPlan(std::vector<Fault> faults) : faults_(std::move(faults)) {}
  FaultPlan(const FaultPlan&) = delete;
  FaultPlan& operator=(const FaultPlan&) = delete;

  // Faults injected so far (an EINTR, a shortened transfer, an error each count 1).
  uint64_t InjectedCount() const { return injected_.load(std::memory_order_relaxed); }

  // Simulated power loss, as RocksDB's FaultInjectionTestFS does it. Once TrackUnsynced() is
  // called, every write that completes is remembered per file (by inode) until an fdatasync of
  // that file completes (through an engine, or a NameOps::Fsync of the file), and every namespace
  // change made through MakeFaultNameOps (create, rename, unlink, mkdir) until a directory it
  // changed is fsync'd through it. CutPowerAfterOps(n): after n more ops (engine ops and NameOps
  // calls) have been submitted, the power is off: every later op fails with EIO and changes
  // nothing (ops already issued complete). Then DropUnsynced() overwrites every remembered range
  // with garbage, as a cut may leave it, undoes every remembered namespace change, latest first,
  // and returns how many bytes it dropped (NamesUndone() tells how many changes it undid).
  // OpsSubmitted() counts every op submitted so far.
  //
  // The namespace model: a change is atomic (a rename is never half done: ext4, XFS and btrfs
  // journal it as one transaction) and durable only once a directory it changed was fsync'd after
  // it (POSIX's rule, what FaultInjectionTestFS and ALICE assume). It is weaker than ext4's
  // default, where an fsync of any file or directory commits every change before it: neither an
  // fsync of the file itself nor a later durable change makes an earlier change durable here. So
  // what keeps its invariants under this model keeps them on those filesystems.
  void TrackUnsynced();
  void CutPowerAfterOps(uint64_t n_ops);
  bool PowerIsOff() const;
  uint64_t OpsSubmitted() const { return ops_submitted_.load(std::memory_order_relaxed); }
  uint64_t DropUnsynced();
  uint64_t NamesUndone() const;
  ~FaultPlan();

 private:
  friend class FaultEngine;
  friend class FaultNames;
  // The op may go out (false: the power is off).
  bool TakeOp();
  void Completed(const IoOp& op, size_t n_bytes);
  struct Hit {
    size_t index = 0;
    Fault fault;
  };
  // The fault with times left that an op of `kind` meets first in [from_offset, to_offset), not
  // one of `fired` (indices that already fired for this op).
  std::optional<Hit> Nearest(OpKind kind, uint64_t from_offset, uint64_t to_offset,
                             std::span<const size_t> fired) const;
  // Takes one of the fault's `times` and counts an injection; false when none is left.
  bool Claim(size_t index);

  mutable std::mutex mu_;
  std::vector<Fault> faults_;  // times: what is left (guarded by mu_)
  std::atomic<uint64_t> injected_{0};
  std::atomic<uint64_t> ops_submitted_{0};
  // Power-cut state, guarded by mu_.
  bool track_unsynced_ = false;
  uint64_t cut_at_op_ = UINT64_MAX;  // ops_submitted_ value from which the power is off
  struct Unsynced {
    int fd = -1;  // our own descriptor of the inode (buffered), to drop through
    std::vector<std::pair<uint64_t, uint64_t>> ranges;  // (byte_offset, n_bytes) written since its last fdatasync
  };
  std::map<std::pair<uint64_t, uint64_t>, Unsynced> unsynced_;  // by (st_dev, st_ino)
  // A namespace change not yet known durable, with what undoing it needs.
  struct NameChange {
    enum class Kind { kCreate, kMkdir, kRename, kUnlink, kRmdir } kind = Kind::kCreate;
    int dir_fd = -1;      // our own O_PATH descriptors of the directories (closed by DropUnsynced)
    int new_dir_fd = -1;  // kRename: the destination
    std::pair<uint64_t, uint64_t> dir{}, new_dir{};  // their (st_dev, st_ino)
    std::string name, new_name;
    std::pair<uint64_t, uint64_t> node{};  // the inode created, renamed or unlinked
    std::string stash;    // a hard link, in the directory of the name, to the inode an unlink or a
                          // rename removed from that name ("" when none)
    mode_t mode = 0;      // kRmdir
    bool durable = false;
  };
  static void UndoNameChange(const NameChange& c);
  std::vector<NameChange> names_;  // in the order they were made
  uint64_t names_undone_ = 0;
  uint64_t next_stash_ = 0;
};

// Wraps `inner`; the plan's InjectedCount() says what it injected. Name() "fault(<inner>)",
// QueueDepth() the inner's; fixed buffers are registered with the inner engine.
std::unique_ptr<IoEngine> MakeFaultEngine(std::unique_ptr<IoEngine> inner, std::shared_ptr<FaultPlan> plan);

}  // namespace ucpfs::io
