// Internals of WriteCapture shared by its files: the captured file, its chunks and the engine's
// state (WriteCapture::Impl). Included only by write_capture*.cc and capture_*.cc of this folder;
// the public interface is write_capture.h.
//
// Where each part lives:
//   write_capture.cc      the public class, start/stop, the journal appender
//   capture_flusher.cc    cache -> parts: chunks made resident, queued and written through an IoEngine
//   capture_committer.cc  close-order placement: flush, truncate, fdatasync, rename, fsync the directory
//   capture_recovery.cc   the next mount's replay of what a crashed daemon left in the capture directory,
//                         and what it set aside in recovered/
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/io/beneath.h"
#include "core/io/capture_journal.h"
#include "core/io/capture_mount.h"
#include "core/io/write_capture.h"

namespace ucpfs::io {

inline constexpr size_t kDirectAlign = 4096;

inline uint64_t NowNs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

inline Status Errno(const std::string& what, int err) {
  if (err == ENOSPC || err == EDQUOT) return Status(StatusCode::kNoSpace, what + ": " + std::strerror(err), err);
  return IoError(what, err);
}

inline std::string PartName(uint64_t seq) { return std::to_string(seq) + ".part"; }

// In SRC/.ucpfs/capture: where recovery sets aside whole files it must not place (never a mount
// id, which always holds a '-').
inline constexpr char kRecoveredDir[] = "recovered";

// Gives a chunk back; the cache refuses only a chunk it does not know or one given back twice,
// which is a bug here: say so, loudly, rather than lose track of memory silently.
inline void ReleaseChunk(PinnedCache& cache, const Chunk& chunk) {
  const Status s = cache.Release(chunk);
  if (!s.ok()) std::fprintf(stderr, "ucpfs: internal: %s\n", s.ToString().c_str());
}

// Merged byte intervals of a chunk written since it was filled from scratch.
struct Intervals {
  std::vector<std::pair<uint64_t, uint64_t>> runs;  // sorted, disjoint, non-adjacent
  void Add(uint64_t lo, uint64_t hi) {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (const auto& r : runs) {
      if (r.second < lo || r.first > hi) {
        out.push_back(r);
      } else {
        lo = std::min(lo, r.first);
        hi = std::max(hi, r.second);
      }
    }
    out.emplace_back(lo, hi);
    std::sort(out.begin(), out.end());
    runs = std::move(out);
  }
  bool Covers(uint64_t n) const { return runs.size() == 1 && runs[0].first == 0 && runs[0].second >= n; }
  void Clip(uint64_t n) {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (const auto& r : runs) {
      if (r.first < n) out.emplace_back(r.first, std::min(r.second, n));
    }
    runs = std::move(out);
  }
};

struct ChunkSlot {
  std::optional<Chunk> mem;  // resident in the cache
  uint64_t valid_bytes = 0;  // [0, valid_bytes) of mem holds data or zeros; the rest is stale
  Intervals filled;
  bool dirty = false;
  bool queued = false;      // in the flush queue
  bool in_flight = false;
  bool evict = false;       // release after the flush even if not full
  bool on_disk = false;     // the part holds bytes of this chunk
  uint64_t generation = 0;  // bumped by every change of mem
  // The 4096-byte pages of mem written since their last flush, one bit each. Only they are
  // written to the part, one write per run of them: outside them mem holds what the part holds
  // (read back, or zeros where the part has a hole), so a small write to a resident chunk flushes
  // its page, and two writes far apart in one chunk flush two pages, not what lies between
  // (a [lowest, highest) range did, and random writes flushed most of each 8 MiB chunk).
  // A flush takes the bits it writes (TakeDirtyPages); a failed one gives them back.
  std::vector<uint64_t> dirty_pages;
  void MarkDirty(uint64_t lo, uint64_t hi) {
    if (hi <= lo) return;
    const uint64_t first = lo / kDirectAlign, last = (hi - 1) / kDirectAlign;
    if (dirty_pages.size() <= last / 64) dirty_pages.resize(last / 64 + 1, 0);
    for (uint64_t p = first; p <= last; ++p) dirty_pages[p / 64] |= uint64_t{1} << (p % 64);
  }
  std::vector<uint64_t> TakeDirtyPages() { return std::exchange(dirty_pages, {}); }
  void GiveBackDirtyPages(const std::vector<uint64_t>& pages) {
    if (dirty_pages.size() < pages.size()) dirty_pages.resize(pages.size(), 0);
    for (size_t i = 0; i < pages.size(); ++i) dirty_pages[i] |= pages[i];
  }
};

// The runs of set bits of a page bitmap below page n_pages, as byte ranges [first, second).
inline std::vector<std::pair<uint64_t, uint64_t>> DirtyRuns(const std::vector<uint64_t>& pages, uint64_t n_pages) {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  const uint64_t end = std::min<uint64_t>(n_pages, pages.size() * 64);
  for (uint64_t p = 0; p < end;) {
    if ((pages[p / 64] >> (p % 64) & 1) == 0) {
      ++p;
      continue;
    }
    uint64_t q = p + 1;
    while (q < end && (pages[q / 64] >> (q % 64) & 1) != 0) ++q;
    runs.emplace_back(p * kDirectAlign, q * kDirectAlign);
    p = q;
  }
  return runs;
}

class CapturedFile : public std::enable_shared_from_this<CapturedFile> {
 public:
  mutable std::mutex mu;
  std::condition_variable cv;  // a chunk write completed, or the file changed state
  uint64_t seq = 0;
  std::string part_name;
  int direct_fd = -1;  // O_DIRECT when the filesystem takes it, else == fd
  int fd = -1;         // buffered: reads back, truncate, fdatasync
  int parent_fd = -1;  // O_PATH destination directory (dup'ed)
  std::string name;
  mode_t mode = 0644;  // applied to the part only when it is placed (it stays 0600 until then)
  uid_t uid = static_cast<uid_t>(-1);  // owner to place it with (-1: the daemon's, as created)
  gid_t gid = static_cast<gid_t>(-1);
  uint64_t size = 0;   // logical
  struct timespec atime = {};
  struct timespec mtime = {};
  struct stat part_stat = {};
  std::map<uint64_t, ChunkSlot> chunks;
  bool closed = false;
  bool discarded = false;
  bool placed = false;
  bool settled = false;     // closed, and its last commit started after the close
  bool flush_ready = true;  // false while a commit of it has not been started
  Status error;             // the first flush error not yet retried
  PinnedCache* cache = nullptr;
  bool exclusive = false;   // created O_EXCL: placed only where no name is (RENAME_NOREPLACE)
  std::string last_rel;     // where it goes, relative to SRC, as last resolved (for messages, the journal)
  // The owner the part's inode has (the daemon's when made; what the last fchown gave it), and
  // the mode and times ApplyAttributes last applied (ApplyAttributesLocked says when they count).
  uid_t inode_uid = static_cast<uid_t>(-1);
  gid_t inode_gid = static_cast<gid_t>(-1);
  mode_t applied_mode = 0;
  struct timespec applied_atime = {}, applied_mtime = {};
  bool kept = false;        // everything written is durable in its part (a commit failed after)

  ~CapturedFile() {
    for (auto& [index, slot] : chunks) {
      if (slot.mem) ReleaseChunk(*cache, *slot.mem);
    }
    if (direct_fd >= 0 && direct_fd != fd) close(direct_fd);
    if (fd >= 0) close(fd);
    if (parent_fd >= 0) close(parent_fd);
  }
};

struct WriteCapture::Impl {
  WriteCaptureOptions options;
  std::shared_ptr<PinnedCache> cache;
  std::shared_ptr<NameOps> names;  // options.names, or the real system calls
  size_t chunk_bytes = 0;
  int capture_root_fd = -1;      // SRC/.ucpfs/capture
  std::string capture_root_dir;  // for messages
  std::optional<MountState> mount;  // this mount's state directory in it, its lock held
  int capture_fd = -1;              // == mount->dir_fd(): the parts and the journal
  int journal_fd = -1;
  std::string capture_dir;  // == mount->dir_shown(), for messages
  // Files recovery found whole but could not place (kept for a later mount), as (path, where, why).
  std::vector<UnplacedFile> kept_unplaced;  // guarded by mu
  std::thread lease_thread;  // renews mount's lease every kLeaseRenewSeconds until stopping
  std::string source_real;  // realpath of SRC, to express destinations relative to it
  std::string engine_name;  // the flushers' engine, once they run; guarded by start_mu

  mutable std::mutex mu;  // everything below; taken after a file's mutex, never before
  std::condition_variable work_cv;    // flush queue or commit queue changed
  std::condition_variable done_cv;    // a commit finished or failed
  std::condition_variable lease_cv;   // stopping
  std::deque<std::pair<std::shared_ptr<CapturedFile>, uint64_t>> flush_queue;  // (file, chunk index)
  struct CommitItem {
    std::shared_ptr<CapturedFile> file;
    uint64_t ticket = 0;
  };
  std::deque<CommitItem> commit_queue;
  uint64_t next_ticket = 1;
  uint64_t committed_ticket = 0;  // every ticket <= this is durable
  Status head_error;              // the head of the commit queue failed with this
  uint64_t head_error_ticket = 0;
  bool retry = false;
  uint64_t max_file_bytes = std::numeric_limits<int64_t>::max();  // SRC's filesystem's, probed at start
  bool stopping = false;
  uint64_t next_seq = 1;
  std::map<uint64_t, std::weak_ptr<CapturedFile>> pending;  // created and not yet placed or discarded
  std::mutex journal_mu;

  // The last flush write failed (cleared by one that succeeds), with this error (guarded by mu):
  // what a writer stalled on a full cache gets after write_stall_timeout_ms.
  std::atomic<bool> flush_failing{false};
  Status last_flush_error;
  std::atomic<uint64_t> bytes_captured{0}, bytes_flushed{0}, files_committed{0}, flush_errors{0};
  std::atomic<uint64_t> dirty_chunks{0}, flush_busy_ns{0}, ops_coalesced{0};
  // flush_busy_ns counts the time with at least one flusher's batch in flight: the union of the
  // flushers' busy intervals, not their sum (which overlapping flushers would count twice).
  // busy_mu is a leaf lock, never held with another.
  std::mutex busy_mu;
  unsigned batches_in_flight = 0;
  uint64_t busy_since_ns = 0;
  std::vector<std::thread> threads;
  mutable std::mutex start_mu;
  bool started = false;  // guarded by start_mu; cache, chunk_bytes and threads are set once

  void Log(const std::string& line) const {
    if (options.log) options.log(line);
  }
  std::string PartPath(const CapturedFile& f) const { return capture_dir + "/" + f.part_name; }

  // write_capture.cc
  void Journal(const JournalRecord& r);
  // Returns once every file closed before the call is durable (WriteCapture::Sync without the
  // check of what recovery left unplaced).
  Status SyncQueued();
  Status EnsureStarted();
  void Stop();
  void LeaseLoop();

  // capture_flusher.cc
  struct Flight {
    std::shared_ptr<CapturedFile> file;
    uint64_t index = 0;
    uint64_t generation = 0;
    uint64_t n_data = 0;  // file bytes in this chunk
    uint64_t hash = 0;    // of those n_data bytes (all of them, whichever part of them is written)
    std::vector<uint64_t> pages;  // the dirty pages it writes, given back if it fails
    uint64_t n_written = 0;
  };
  void QueueChunk(const std::shared_ptr<CapturedFile>& f, uint64_t index, ChunkSlot& slot);
  void RelieveMemory();
  Status MakeResident(const std::shared_ptr<CapturedFile>& f, std::unique_lock<std::mutex>& lock, uint64_t index);
  void FlusherLoop();
  void Complete(const Flight& fl, const IoCompletion& c);
  // options.on_part_change(change), filled in with f's identity. A flush's and a cut's report
  // are made with f.mu held (see Complete); a discard's with no lock.
  void NotifyPartChange(const CapturedFile& f, PartChange change) const;

  // capture_committer.cc
  std::string RelPath(const CapturedFile& f) const;
  // The directory `f` is to be placed in, re-resolved beneath SRC's root (never through a
  // symlink or out of SRC) and checked to be the one it was created in; sets f.last_rel.
  // Errors: kIo (EIO) naming the file when that directory was removed or left SRC.
  Result<int> OpenPlace(CapturedFile& f, std::string* rel);
  // Makes what is written of every file queued behind a failed one durable in its part, so an
  // unmount keeps it for the next mount.
  void KeepQueued();
  Status FlushAll(const std::shared_ptr<CapturedFile>& f);
  void ForgetIfDone(const std::shared_ptr<CapturedFile>& f);
  Status CommitFile(const std::shared_ptr<CapturedFile>& f, IoEngine& engine);
  // The owner, group, mode and times `f` must have, applied to its part before it is placed
  // (Locked: f.mu held).
  Status ApplyAttributes(CapturedFile& f);
  Status ApplyAttributesLocked(CapturedFile& f, bool only_changed);
  void CommitterLoop();
  uint64_t Enqueue(const std::shared_ptr<CapturedFile>& f);
  Status WaitFor(uint64_t ticket);

  // capture_recovery.cc
  Status Recover();
  // Recovers the state in `dir_fd` (shown as `shown`, named `state_name` in the capture
  // directory); returns the steps kept, unplaced.
  Result<std::vector<RecoveryStep>> RecoverState(int dir_fd, const std::string& shown, const std::string& state_name);
  Status WriteKeptJournal(const std::vector<RecoveryStep>& kept, int dir_fd, const std::string& shown);
  // The step's part, verified against its chunk records, with its size, mode, owner and times,
  // fdatasync'd. Errors: kDataLoss when its bytes are not what was flushed; kIo.
  Result<int> OpenVerified(const RecoveryStep& step, int dir_fd, const std::string& shown);
  // *placing_failed: the file is whole but its place cannot take it now (kept, not discarded).
  Status FinishRecovered(const RecoveryStep& step, int dir_fd, const std::string& shown, bool* placing_failed);
  // Moves a whole file that must not be placed (RecoveryStep::recover) to
  // recovered/<state_name>/<path>, durably. *verified false: its part is not whole (discard it).
  Status KeepRecovered(const RecoveryStep& step, int dir_fd, const std::string& shown, const std::string& state_name,
                       bool* verified);
  // What recovered/ holds now (listed as unplaced; bounded: the directory is untrusted).
  std::vector<UnplacedFile> ListRecovered() const;
  // Removes what recovered/ holds of states whose files were all moved or deleted (their empty
  // directories and their .why), and recovered/ itself when empty.
  void PruneRecovered();
  // kIo (EIO) naming every file recovery kept unplaced or set aside, which a sync must not call
  // durable; OK when there is none.
  Status CheckNothingAside() const;
  void NoteKept(const std::vector<RecoveryStep>& kept, const std::string& where);
};

}  // namespace ucpfs::io
