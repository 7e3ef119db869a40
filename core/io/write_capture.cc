// See write_capture.h. Not for: FUSE, names in the mount's namespace (fs/), or choosing what
// to capture (the Filesystem decides).
#include "core/io/write_capture.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
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
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/io/capture_journal.h"

namespace ucpfs::io {
namespace {

constexpr size_t kDirectAlign = 4096;

uint64_t NowNs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

Status Errno(const std::string& what, int err) {
  if (err == ENOSPC || err == EDQUOT) return Status(StatusCode::kNoSpace, what + ": " + std::strerror(err), err);
  return IoError(what, err);
}

// A directory beneath `root` by a relative path, never through a symlink or out of `root`.
int OpenBeneath(int root, const std::string& rel, uint64_t flags) {
  struct open_how how = {};
  how.flags = flags | O_CLOEXEC;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  return static_cast<int>(syscall(SYS_openat2, root, rel.c_str(), &how, sizeof(how)));
}

// Opens (creating it) directory `name` in `dirfd`, never following a symlink.
Result<int> OpenOrMakeDir(int dirfd, const char* name, const std::string& shown) {
  int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) {
    if (mkdirat(dirfd, name, 0700) != 0 && errno != EEXIST) return IoError("mkdir " + shown, errno);
    fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  }
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      return InvalidArgumentError(shown + " is a symbolic link or not a directory: not followed");
    }
    return IoError("open " + shown, errno);
  }
  return fd;
}

std::string PartName(uint64_t seq) { return std::to_string(seq) + ".part"; }

// Gives a chunk back; the cache refuses only a chunk it does not know or one given back twice,
// which is a bug here: say so, loudly, rather than lose track of memory silently.
void ReleaseChunk(PinnedCache& cache, const Chunk& chunk) {
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
};

}  // namespace

std::vector<IoOp> CoalesceWrites(std::vector<IoOp> ops, std::vector<std::vector<uint64_t>>* members) {
  std::sort(ops.begin(), ops.end(), [](const IoOp& a, const IoOp& b) {
    return a.fd != b.fd ? a.fd < b.fd : a.byte_offset < b.byte_offset;
  });
  std::vector<IoOp> out;
  for (const IoOp& op : ops) {
    if (!out.empty()) {
      IoOp& last = out.back();
      if (last.fd == op.fd && last.byte_offset + last.n_bytes == op.byte_offset &&
          last.buffer + last.n_bytes == op.buffer && last.n_bytes % kDirectAlign == 0) {
        last.n_bytes += op.n_bytes;
        last.registered_buffer = -1;  // spans two fixed buffers
        (*members)[last.user_data].push_back(op.user_data);
        continue;
      }
    }
    members->push_back({op.user_data});
    out.push_back(op);
    out.back().user_data = members->size() - 1;
  }
  return out;
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
  mode_t mode = 0644;
  uint64_t size = 0;   // logical
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
  size_t chunk_bytes = 0;
  int capture_fd = -1;
  int journal_fd = -1;
  std::string capture_dir;  // for messages
  std::string source_real;  // realpath of SRC, to express destinations relative to it
  std::string engine_name;  // the flushers' engine, once they run; guarded by start_mu

  mutable std::mutex mu;  // everything below; taken after a file's mutex, never before
  std::condition_variable work_cv;    // flush queue or commit queue changed
  std::condition_variable done_cv;    // a commit finished or failed
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
  bool stopping = false;
  uint64_t next_seq = 1;
  std::map<uint64_t, std::weak_ptr<CapturedFile>> pending;  // created and not yet placed or discarded
  std::mutex journal_mu;

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

  void Journal(const JournalRecord& r) {
    const std::vector<std::byte> bytes = EncodeJournalRecord(r);
    std::lock_guard lock(journal_mu);
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = write(journal_fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        // The journal only speeds recovery up; without the record the file is discarded after a
        // crash instead of finished, never placed wrong.
        Log("ucpfs: capture journal write failed: " + std::string(std::strerror(errno)));
        return;
      }
      done += static_cast<size_t>(n);
    }
  }

  // Destination of `f` relative to SRC, "" when it is not beneath SRC any more.
  std::string RelPath(const CapturedFile& f) const {
    char link[64];
    std::snprintf(link, sizeof(link), "/proc/self/fd/%d", f.parent_fd);
    char buf[PATH_MAX];
    const ssize_t n = readlink(link, buf, sizeof(buf) - 1);
    if (n <= 0) return "";
    std::string dir(buf, static_cast<size_t>(n));
    if (dir == source_real) return f.name;
    if (dir.size() > source_real.size() && dir.compare(0, source_real.size(), source_real) == 0 &&
        dir[source_real.size()] == '/') {
      return dir.substr(source_real.size() + 1) + "/" + f.name;
    }
    return "";
  }

  // Queues a chunk of `f` (f.mu held) for flushing.
  void QueueChunk(const std::shared_ptr<CapturedFile>& f, uint64_t index, ChunkSlot& slot) {
    if (slot.queued || slot.in_flight) return;
    slot.queued = true;
    {
      std::lock_guard lock(mu);
      flush_queue.emplace_back(f, index);
    }
    work_cv.notify_all();
  }

  // Frees memory for a blocked writer: resident chunks not being written are released when clean
  // and queued for an evicting flush when dirty.
  void RelieveMemory() {
    std::vector<std::shared_ptr<CapturedFile>> files;
    {
      std::lock_guard lock(mu);
      for (auto& [seq, weak] : pending) {
        if (auto f = weak.lock()) files.push_back(std::move(f));
      }
    }
    for (auto& f : files) {
      std::unique_lock lock(f->mu, std::try_to_lock);
      if (!lock.owns_lock()) continue;
      for (auto& [index, slot] : f->chunks) {
        if (!slot.mem || slot.in_flight || slot.queued) continue;
        if (!slot.dirty) {
          ReleaseChunk(*cache, *slot.mem);
          slot.mem.reset();
          ++slot.generation;
        } else {
          slot.evict = true;
          QueueChunk(f, index, slot);
        }
      }
    }
  }

  // Makes `slot` (chunk `index` of f, f.mu held via `lock`) resident, reading back what the part
  // holds. May unlock while waiting for the cache.
  Status MakeResident(const std::shared_ptr<CapturedFile>& f, std::unique_lock<std::mutex>& lock, uint64_t index) {
    while (!f->chunks[index].mem) {
      lock.unlock();
      std::optional<Chunk> chunk = cache->TryAcquire();
      if (!chunk) {
        RelieveMemory();
        chunk = cache->Acquire();
      }
      lock.lock();
      if (!chunk) return InternalError("write capture is shutting down");
      ChunkSlot& slot = f->chunks[index];
      if (slot.mem) {  // another writer won
        ReleaseChunk(*cache, *chunk);
        break;
      }
      slot.mem = chunk;
      slot.valid_bytes = 0;
      slot.filled = {};
      ++slot.generation;
      const uint64_t start = index * chunk_bytes;
      if (slot.on_disk && f->size > start) {
        const auto n = static_cast<size_t>(std::min<uint64_t>(chunk_bytes, f->size - start));
        size_t got = 0;
        while (got < n) {
          const ssize_t r = pread(f->fd, chunk->data + got, n - got, static_cast<off_t>(start + got));
          if (r < 0 && errno == EINTR) continue;
          if (r < 0) {
            const int err = errno;
            ReleaseChunk(*cache, *chunk);
            slot.mem.reset();
            return Errno("read back " + PartPath(*f), err);
          }
          if (r == 0) break;
          got += static_cast<size_t>(r);
        }
        std::memset(chunk->data + got, 0, n - got);
        slot.valid_bytes = n;
        slot.filled.Add(0, n);
      }
    }
    return Status::Ok();
  }

  // ---- flushers ----

  struct Flight {
    std::shared_ptr<CapturedFile> file;
    uint64_t index = 0;
    uint64_t generation = 0;
    uint64_t n_data = 0;  // file bytes in this chunk
    uint64_t hash = 0;
  };

  void FlusherLoop() {
    std::unique_ptr<IoEngine> engine = options.make_engine ? options.make_engine() : MakeDefaultEngine(options.queue_depth);
    {
      std::lock_guard lock(start_mu);
      engine_name = engine->Name();
    }
    // Fixed buffers, registered chunk by chunk when this flusher first writes from one (the
    // cache locks a chunk on its first use; registering all of them now would fault in and pin
    // the whole capacity).
    const std::vector<iovec> regions = cache->Regions();
    const bool fixed = engine->RegisterBufferSlots(static_cast<unsigned>(regions.size())).ok();
    std::vector<bool> registered(regions.size(), false);
    const size_t depth = std::max<size_t>(1, std::min<size_t>(options.queue_depth, engine->QueueDepth()));
    std::vector<Flight> flights;
    std::vector<IoOp> ops;
    std::vector<IoCompletion> done(depth);
    for (;;) {
      std::vector<std::pair<std::shared_ptr<CapturedFile>, uint64_t>> batch;
      {
        std::unique_lock lock(mu);
        work_cv.wait(lock, [&] { return stopping || !flush_queue.empty(); });
        if (flush_queue.empty() && stopping) return;
        while (!flush_queue.empty() && batch.size() < depth) {
          batch.push_back(std::move(flush_queue.front()));
          flush_queue.pop_front();
        }
      }
      flights.clear();
      ops.clear();
      for (auto& [f, index] : batch) {
        std::lock_guard lock(f->mu);
        const auto found = f->chunks.find(index);
        if (found == f->chunks.end()) continue;  // truncated away
        ChunkSlot& slot = found->second;
        slot.queued = false;
        if (f->discarded || !slot.mem || !slot.dirty) {
          if (f->discarded && slot.mem) {
            ReleaseChunk(*cache, *slot.mem);
            slot.mem.reset();
          }
          continue;
        }
        const uint64_t start = index * chunk_bytes;
        const uint64_t n_data = f->size > start ? std::min<uint64_t>(chunk_bytes, f->size - start) : 0;
        if (n_data == 0) {  // truncated away
          slot.dirty = false;
          dirty_chunks.fetch_sub(1);
          ReleaseChunk(*cache, *slot.mem);
          slot.mem.reset();
          ++slot.generation;
          continue;
        }
        const uint64_t n_write = (n_data + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
        if (slot.valid_bytes < n_write) {  // holes and the padding of the tail read as zeros
          std::memset(slot.mem->data + slot.valid_bytes, 0, n_write - slot.valid_bytes);
          slot.valid_bytes = n_write;
        }
        slot.in_flight = true;
        // Hashed under the file's lock: a writer changing the chunk afterwards (while the kernel
        // reads it) bumps its generation, and then neither the record nor the release happens.
        Flight fl{f, index, slot.generation, n_data, XXH64(slot.mem->data, static_cast<size_t>(n_data), 0)};
        flights.push_back(fl);
        IoOp op;
        op.kind = OpKind::kWrite;
        op.fd = f->direct_fd;
        op.byte_offset = start;
        op.buffer = slot.mem->data;
        op.n_bytes = static_cast<size_t>(n_write);
        op.registered_buffer = -1;
        if (fixed && (registered[slot.mem->index] ||
                      engine->UpdateBuffer(slot.mem->index, regions[slot.mem->index]).ok())) {
          registered[slot.mem->index] = true;
          op.registered_buffer = static_cast<int>(slot.mem->index);
        }
        op.user_data = flights.size() - 1;
        ops.push_back(op);
      }
      if (ops.empty()) continue;
      // Adjacent chunks of one file that are adjacent in memory too go out as one write (not
      // from a fixed buffer then: it spans two).
      std::vector<std::vector<uint64_t>> members;  // per op sent: the flights it carries
      std::vector<IoOp> sent = CoalesceWrites(ops, &members);
      {
        std::lock_guard busy(busy_mu);
        if (batches_in_flight++ == 0) busy_since_ns = NowNs();
      }
      std::vector<IoCompletion> results = engine->RunAll(sent);
      {
        std::lock_guard busy(busy_mu);
        if (--batches_in_flight == 0) flush_busy_ns.fetch_add(NowNs() - busy_since_ns);
      }
      ops_coalesced.fetch_add(ops.size() - sent.size());
      // Completed last chunk first: the cache hands chunks out LIFO, so the next file's chunks
      // come out ascending in memory, and coalesce again.
      for (size_t i = results.size(); i-- > 0;) {
        const std::vector<uint64_t>& carried = members[results[i].user_data];
        for (size_t k = carried.size(); k-- > 0;) Complete(flights[carried[k]], results[i]);
      }
    }
  }

  void Complete(const Flight& fl, const IoCompletion& c) {
    CapturedFile& f = *fl.file;
    {
      std::lock_guard lock(f.mu);
      ChunkSlot& slot = f.chunks[fl.index];
      slot.in_flight = false;
      if (!c.status.ok()) {
        if (f.error.ok()) f.error = c.status;
        flush_errors.fetch_add(1);
        Log("ucpfs: flushing " + PartPath(f) + " at byte " + std::to_string(fl.index * chunk_bytes) + ": " +
            c.status.ToString() + " (the data stays in the cache)");
      } else {
        bytes_flushed.fetch_add(fl.n_data);
        slot.on_disk = true;
        if (slot.generation == fl.generation) {
          slot.dirty = false;
          dirty_chunks.fetch_sub(1);
          Journal({JournalType::kChunk, f.seq, fl.index * chunk_bytes, fl.n_data, fl.hash, 0, 0, {}});
          if (slot.evict || f.closed || slot.filled.Covers(chunk_bytes)) {
            ReleaseChunk(*cache, *slot.mem);
            slot.mem.reset();
            slot.evict = false;
            ++slot.generation;
          }
        } else if (slot.filled.Covers(chunk_bytes) || !f.flush_ready) {
          QueueChunk(fl.file, fl.index, slot);  // changed while in flight: write it again
        }
      }
    }
    f.cv.notify_all();
  }

  // ---- committer ----

  // Waits until `f` has no dirty chunk (queueing them all), or a flush failed.
  Status FlushAll(const std::shared_ptr<CapturedFile>& f) {
    std::unique_lock lock(f->mu);
    f->flush_ready = false;
    for (;;) {
      if (!f->error.ok()) return f->error;
      bool busy = false;
      for (auto& [index, slot] : f->chunks) {
        if (slot.dirty || slot.in_flight) {
          busy = true;
          if (slot.dirty && !slot.in_flight) QueueChunk(f, index, slot);
        }
      }
      if (!busy) {
        f->flush_ready = true;
        return Status::Ok();
      }
      f->cv.wait_for(lock, std::chrono::milliseconds(100));
    }
  }

  // A placed and closed file needs no memory relief and is no longer pending.
  void ForgetIfDone(const std::shared_ptr<CapturedFile>& f) {
    bool done = false;
    {
      std::lock_guard lock(f->mu);
      done = f->placed && f->closed;
    }
    if (!done) return;
    std::lock_guard lock(mu);
    pending.erase(f->seq);
  }

  Status CommitFile(const std::shared_ptr<CapturedFile>& f, IoEngine& engine) {
    bool closed_before = false;
    {
      std::lock_guard lock(f->mu);
      if (f->discarded) return Status::Ok();
      closed_before = f->closed;
    }
    UCPFS_RETURN_IF_ERROR(FlushAll(f));
    uint64_t size = 0;
    bool placed = false;
    {
      std::lock_guard lock(f->mu);
      size = f->size;
      placed = f->placed;
    }
    if (ftruncate(f->fd, static_cast<off_t>(size)) != 0) return Errno("truncate " + PartPath(*f), errno);
    IoOp sync;
    sync.kind = OpKind::kFdatasync;
    sync.fd = f->fd;
    std::vector<IoCompletion> synced = engine.RunAll(std::span<const IoOp>(&sync, 1));
    UCPFS_RETURN_IF_ERROR(FirstError(synced));
    if (placed) {
      {
        std::lock_guard lock(f->mu);
        f->settled = closed_before;
      }
      ForgetIfDone(f);
      return Status::Ok();
    }
    const std::string rel = RelPath(*f);
    if (options.before_replace) options.before_replace(rel);
    if (renameat(capture_fd, f->part_name.c_str(), f->parent_fd, f->name.c_str()) != 0) {
      const int err = errno;
      std::lock_guard lock(f->mu);
      if (f->discarded) return Status::Ok();  // unlinked while being committed: its part is gone
      return Errno("rename " + PartPath(*f) + " to " + options.source_dir + "/" + rel, err);
    }
    const int dir = openat(f->parent_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) {
      const int rc = fsync(dir);
      const int err = errno;
      close(dir);
      if (rc != 0) return Errno("fsync the directory of " + rel, err);
    }
    {
      std::lock_guard lock(f->mu);
      f->placed = true;
      f->settled = closed_before;
    }
    Journal({JournalType::kDone, f->seq, 0, 0, 0, 0, 0, {}});
    files_committed.fetch_add(1);
    ForgetIfDone(f);
    if (options.on_durable) options.on_durable(rel);
    return Status::Ok();
  }

  void CommitterLoop() {
    std::unique_ptr<IoEngine> engine = options.make_engine ? options.make_engine() : MakeDefaultEngine(4);
    for (;;) {
      CommitItem item;
      bool is_retry = false;
      {
        std::unique_lock lock(mu);
        work_cv.wait(lock, [&] { return stopping || retry || (!commit_queue.empty() && head_error.ok()); });
        if (commit_queue.empty()) {
          retry = false;
          if (stopping) return;
          continue;
        }
        if (!head_error.ok() && !retry) {  // stuck on a failed file until Sync retries
          if (!stopping) continue;
          // Unmounting with a file that cannot be made durable: give up, loudly (the caller of
          // Sync logs it); its later files are not placed either, so the order holds.
          commit_queue.clear();
          lock.unlock();
          done_cv.notify_all();
          return;
        }
        is_retry = retry;
        retry = false;
        head_error = Status::Ok();
        item = commit_queue.front();
      }
      if (is_retry) {  // Sync asked again: the file's earlier flush errors are tried anew
        std::lock_guard lock(item.file->mu);
        item.file->error = Status::Ok();
      }
      const Status s = CommitFile(item.file, *engine);
      {
        std::lock_guard lock(mu);
        if (s.ok()) {
          commit_queue.pop_front();
          committed_ticket = item.ticket;
          if (commit_queue.empty() && pending.empty()) {
            // Nothing captured is alive: the journal's records are all spent. Start it afresh,
            // so it stays small over a long mount (a crash now has nothing to recover).
            std::lock_guard journal_lock(journal_mu);
            if (ftruncate(journal_fd, sizeof(kJournalMagic)) != 0) {
              Log("ucpfs: capture journal cannot be truncated: " + std::string(std::strerror(errno)));
            }
          }
        } else {
          head_error = s;
          head_error_ticket = item.ticket;
          if (stopping) {  // give up: unmount reports it; the data stays for the next mount
            commit_queue.clear();
          }
        }
      }
      done_cv.notify_all();
    }
  }

  // Queues `f` for commit, with its commit record; returns the ticket.
  uint64_t Enqueue(const std::shared_ptr<CapturedFile>& f) {
    JournalRecord r;
    r.type = JournalType::kCommit;
    {
      std::lock_guard lock(f->mu);
      r.seq = f->seq;
      r.size = f->size;
      r.mode = f->mode;
    }
    r.path = RelPath(*f);
    Journal(r);
    uint64_t ticket = 0;
    {
      std::lock_guard lock(mu);
      ticket = next_ticket++;
      commit_queue.push_back({f, ticket});
    }
    work_cv.notify_all();
    return ticket;
  }

  Status WaitFor(uint64_t ticket) {
    std::unique_lock lock(mu);
    for (;;) {
      if (committed_ticket >= ticket) return Status::Ok();
      if (!head_error.ok() && head_error_ticket <= ticket) return head_error;
      if (commit_queue.empty()) return committed_ticket >= ticket ? Status::Ok() : head_error;
      done_cv.wait(lock);
    }
  }

  // ---- recovery ----

  Status Recover() {
    std::vector<uint64_t> parts;
    {
      const int dup_fd = dup(capture_fd);
      if (dup_fd < 0) return IoError("dup " + capture_dir, errno);
      DIR* d = fdopendir(dup_fd);
      if (d == nullptr) {
        close(dup_fd);
        return IoError("list " + capture_dir, errno);
      }
      while (dirent* e = readdir(d)) {
        const std::string n = e->d_name;
        if (n.size() < 6 || n.compare(n.size() - 5, 5, ".part") != 0) continue;
        const std::string digits = n.substr(0, n.size() - 5);
        if (digits.empty() || digits.size() > 19 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
        parts.push_back(std::stoull(digits));
      }
      closedir(d);
    }
    std::sort(parts.begin(), parts.end());
    ParsedJournal journal;
    const int jfd = openat(capture_fd, "journal", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (jfd >= 0) {
      struct stat st = {};
      std::vector<std::byte> bytes;
      std::string why;
      if (fstat(jfd, &st) != 0 || !S_ISREG(st.st_mode)) {
        why = "not a regular file";
      } else if (static_cast<uint64_t>(st.st_size) > kMaxJournalBytes) {
        why = "larger than " + std::to_string(kMaxJournalBytes) + " bytes";
      } else {
        bytes.resize(static_cast<size_t>(st.st_size));
        size_t got = 0;
        while (got < bytes.size()) {
          const ssize_t n = read(jfd, bytes.data() + got, bytes.size() - got);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) break;
          got += static_cast<size_t>(n);
        }
        bytes.resize(got);
      }
      close(jfd);
      if (why.empty() && !bytes.empty()) {
        Result<ParsedJournal> parsed = ParseJournal(bytes);
        if (parsed.ok()) {
          journal = std::move(*parsed);
          if (!journal.stopped.empty()) Log("ucpfs: capture journal: " + journal.stopped + "; the rest is ignored");
        } else {
          why = parsed.error().message();
        }
      }
      if (!why.empty()) Log("ucpfs: capture journal " + capture_dir + "/journal " + why + ": not used");
    } else if (errno != ENOENT) {
      Log("ucpfs: capture journal " + capture_dir + "/journal cannot be opened (" + std::strerror(errno) +
          "): not used");
    }
    std::vector<RecoveryStep> plan = PlanRecovery(journal, parts);
    for (size_t i = 0; i < plan.size(); ++i) {
      RecoveryStep& step = plan[i];
      if (step.finish) {
        const Status s = FinishRecovered(step);
        if (!s.ok()) MarkIncomplete(plan, i, s.message());
      }
      if (!step.finish) {
        unlinkat(capture_fd, PartName(step.seq).c_str(), 0);
        Log("ucpfs: capture recovery: discarded " + (step.path.empty() ? PartName(step.seq) : "'" + step.path + "'") +
            ": " + step.reason);
      }
    }
    // A fresh journal, published by rename so a crash leaves the old or the new one whole.
    const int tmp = openat(capture_fd, "journal.new", O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (tmp < 0) return IoError("create " + capture_dir + "/journal.new", errno);
    const bool ok = write(tmp, kJournalMagic, sizeof(kJournalMagic)) == static_cast<ssize_t>(sizeof(kJournalMagic)) &&
                    fsync(tmp) == 0;
    const int err = errno;
    close(tmp);
    if (!ok) return IoError("write " + capture_dir + "/journal.new", err);
    if (renameat(capture_fd, "journal.new", capture_fd, "journal") != 0) {
      return IoError("rename " + capture_dir + "/journal.new", errno);
    }
    fsync(capture_fd);
    journal_fd = openat(capture_fd, "journal", O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);
    if (journal_fd < 0) return IoError("open " + capture_dir + "/journal", errno);
    return Status::Ok();
  }

  // Verifies a committed file's part against its chunk records and places it.
  Status FinishRecovered(const RecoveryStep& step) {
    const std::string part = PartName(step.seq);
    const int fd = openat(capture_fd, part.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return IoError("open " + capture_dir + "/" + part, errno);
    struct Closer {
      int fd;
      ~Closer() { close(fd); }
    } closer{fd};
    struct stat st = {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return InvalidArgumentError("the part is not a regular file");
    if (static_cast<uint64_t>(st.st_size) < step.size) {
      return Status(StatusCode::kDataLoss, "the part holds " + std::to_string(st.st_size) + " of " + std::to_string(step.size) + " bytes");
    }
    std::vector<std::byte> buf;
    for (const JournalRecord& c : step.chunks) {
      if (c.n_bytes > (uint64_t{1} << 30)) return CorruptError("a chunk record of " + std::to_string(c.n_bytes) + " bytes");
      buf.resize(static_cast<size_t>(c.n_bytes));
      size_t got = 0;
      while (got < buf.size()) {
        const ssize_t n = pread(fd, buf.data() + got, buf.size() - got, static_cast<off_t>(c.byte_offset + got));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += static_cast<size_t>(n);
      }
      if (got != buf.size() || XXH64(buf.data(), buf.size(), 0) != c.hash) {
        return Status(StatusCode::kDataLoss, "the bytes at " + std::to_string(c.byte_offset) + " are not what was flushed");
      }
    }
    if (ftruncate(fd, static_cast<off_t>(step.size)) != 0 || fchmod(fd, step.mode & 07777) != 0 || fdatasync(fd) != 0) {
      return IoError("finish " + capture_dir + "/" + part, errno);
    }
    const size_t slash = step.path.rfind('/');
    const std::string parent = slash == std::string::npos ? "." : step.path.substr(0, slash);
    const std::string name = slash == std::string::npos ? step.path : step.path.substr(slash + 1);
    const int dir = parent == "." ? dup(options.source_dirfd) : OpenBeneath(options.source_dirfd, parent, O_RDONLY | O_DIRECTORY);
    if (dir < 0) return IoError("open directory '" + parent + "' beneath the source", errno);
    const int rc = renameat(capture_fd, part.c_str(), dir, name.c_str());
    const int err = errno;
    if (rc == 0) fsync(dir);
    close(dir);
    if (rc != 0) return IoError("rename to '" + step.path + "'", err);
    Log("ucpfs: capture recovery: finished '" + step.path + "' (" + std::to_string(step.size) + " bytes)");
    return Status::Ok();
  }

  // The cache (made now from options.cache_options unless given) and the threads, on the first
  // file captured: a mount that is only read holds no pinned memory.
  Status EnsureStarted() {
    std::lock_guard lock(start_mu);
    if (started) return Status::Ok();
    if (cache == nullptr) {
      UCPFS_ASSIGN_OR_RETURN(auto made, PinnedCache::Make(options.cache_options));
      cache = std::shared_ptr<PinnedCache>(std::move(made));
    }
    chunk_bytes = cache->chunk_bytes();
    for (unsigned i = 0; i < std::max(1u, options.n_flushers); ++i) threads.emplace_back([this] { FlusherLoop(); });
    threads.emplace_back([this] { CommitterLoop(); });
    started = true;
    return Status::Ok();
  }

  void Stop() {
    {
      std::lock_guard lock(mu);
      stopping = true;
    }
    work_cv.notify_all();
    for (auto& t : threads) t.join();
    threads.clear();
  }
};

WriteCapture::WriteCapture(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

WriteCapture::~WriteCapture() {
  if (!impl_) return;
  const Status s = Sync();
  if (!s.ok()) impl_->Log("ucpfs: unmount: not everything captured is durable: " + s.ToString());
  impl_->Stop();
  if (impl_->journal_fd >= 0) close(impl_->journal_fd);
  if (impl_->capture_fd >= 0) close(impl_->capture_fd);
}

Result<std::unique_ptr<WriteCapture>> WriteCapture::Start(WriteCaptureOptions options) {
  if (options.source_dirfd < 0) return InvalidArgumentError("write capture needs the source directory");
  auto impl = std::make_unique<Impl>();
  impl->cache = options.cache;
  if (impl->cache != nullptr) impl->chunk_bytes = impl->cache->chunk_bytes();
  impl->options = std::move(options);
  const std::string src = impl->options.source_dir;
  char real[PATH_MAX];
  char link[64];
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", impl->options.source_dirfd);
  const ssize_t n = readlink(link, real, sizeof(real) - 1);
  if (n <= 0) return IoError("resolve " + src, errno);
  impl->source_real.assign(real, static_cast<size_t>(n));
  UCPFS_ASSIGN_OR_RETURN(const int ucpfs_fd, OpenOrMakeDir(impl->options.source_dirfd, ".ucpfs", src + "/.ucpfs"));
  Result<int> capture = OpenOrMakeDir(ucpfs_fd, "capture", src + "/.ucpfs/capture");
  close(ucpfs_fd);
  if (!capture.ok()) return capture.error();
  impl->capture_fd = *capture;
  impl->capture_dir = src + "/.ucpfs/capture";
  std::unique_ptr<WriteCapture> wc(new WriteCapture(std::move(impl)));
  Impl& m = *wc->impl_;
  UCPFS_RETURN_IF_ERROR(m.Recover());
  if (m.cache != nullptr) UCPFS_RETURN_IF_ERROR(m.EnsureStarted());
  return wc;
}

Result<std::shared_ptr<CapturedFile>> WriteCapture::Create(int parent_dirfd, const std::string& name, mode_t mode) {
  Impl& m = *impl_;
  UCPFS_RETURN_IF_ERROR(m.EnsureStarted());
  auto f = std::make_shared<CapturedFile>();
  f->cache = m.cache.get();
  {
    std::lock_guard lock(m.mu);
    f->seq = m.next_seq++;
  }
  f->part_name = PartName(f->seq);
  f->name = name;
  f->mode = mode & 07777;
  f->fd = openat(m.capture_fd, f->part_name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (f->fd < 0) return Errno("create " + m.PartPath(*f), errno);
  if (fchmod(f->fd, f->mode) != 0 || fstat(f->fd, &f->part_stat) != 0) {
    const int err = errno;
    unlinkat(m.capture_fd, f->part_name.c_str(), 0);
    return Errno("set up " + m.PartPath(*f), err);
  }
  f->direct_fd = openat(m.capture_fd, f->part_name.c_str(), O_WRONLY | O_DIRECT | O_NOFOLLOW | O_CLOEXEC);
  if (f->direct_fd < 0) f->direct_fd = f->fd;  // a filesystem without O_DIRECT: buffered writes
  f->parent_fd = fcntl(parent_dirfd, F_DUPFD_CLOEXEC, 0);
  if (f->parent_fd < 0) {
    const int err = errno;
    unlinkat(m.capture_fd, f->part_name.c_str(), 0);
    return Errno("dup the directory of " + name, err);
  }
  clock_gettime(CLOCK_REALTIME, &f->mtime);
  std::lock_guard lock(m.mu);
  m.pending.emplace(f->seq, f);
  return f;
}

struct stat WriteCapture::Stat(const CapturedFile& file) const {
  const CapturedFile& f = file;
  std::lock_guard lock(f.mu);
  struct stat st = f.part_stat;
  st.st_mode = static_cast<mode_t>(S_IFREG | f.mode);
  st.st_size = static_cast<off_t>(f.size);
  st.st_blocks = static_cast<blkcnt_t>((f.size + 511) / 512);
  st.st_mtim = f.mtime;
  st.st_ctim = f.mtime;
  st.st_nlink = f.discarded ? 0 : 1;
  return st;
}

Status WriteCapture::Write(CapturedFile& file, uint64_t byte_offset, std::span<const std::byte> data) {
  Impl& m = *impl_;
  const std::shared_ptr<CapturedFile> f = file.shared_from_this();
  const size_t c = m.chunk_bytes;
  size_t done = 0;
  std::unique_lock lock(file.mu);
  if (file.closed) return InvalidArgumentError("write after close");
  while (done < data.size()) {
    const uint64_t at = byte_offset + done;
    const uint64_t index = at / c;
    const auto within = static_cast<size_t>(at % c);
    const size_t n = std::min(c - within, data.size() - done);
    UCPFS_RETURN_IF_ERROR(m.MakeResident(f, lock, index));
    ChunkSlot& slot = file.chunks[index];
    if (within > slot.valid_bytes) std::memset(slot.mem->data + slot.valid_bytes, 0, within - slot.valid_bytes);
    std::memcpy(slot.mem->data + within, data.data() + done, n);
    slot.valid_bytes = std::max<uint64_t>(slot.valid_bytes, within + n);
    slot.filled.Add(within, within + n);
    ++slot.generation;
    if (!slot.dirty) {
      slot.dirty = true;
      m.dirty_chunks.fetch_add(1);
    }
    file.size = std::max<uint64_t>(file.size, at + n);
    if (slot.filled.Covers(c)) m.QueueChunk(f, index, slot);
    done += n;
  }
  clock_gettime(CLOCK_REALTIME, &file.mtime);
  m.bytes_captured.fetch_add(data.size());
  return Status::Ok();
}

Result<size_t> WriteCapture::Read(CapturedFile& f, uint64_t byte_offset, std::span<std::byte> out) {
  Impl& m = *impl_;
  std::lock_guard lock(f.mu);
  if (byte_offset >= f.size) return size_t{0};
  const auto n_total = static_cast<size_t>(std::min<uint64_t>(out.size(), f.size - byte_offset));
  size_t done = 0;
  while (done < n_total) {
    const uint64_t at = byte_offset + done;
    const uint64_t index = at / m.chunk_bytes;
    const auto within = static_cast<size_t>(at % m.chunk_bytes);
    const size_t n = std::min(m.chunk_bytes - within, n_total - done);
    const auto it = f.chunks.find(index);
    if (it != f.chunks.end() && it->second.mem) {
      const ChunkSlot& slot = it->second;
      const size_t valid = within < slot.valid_bytes ? std::min<size_t>(n, static_cast<size_t>(slot.valid_bytes) - within) : 0;
      std::memcpy(out.data() + done, slot.mem->data + within, valid);
      std::memset(out.data() + done + valid, 0, n - valid);
    } else {
      size_t got = 0;
      while (got < n) {
        const ssize_t r = pread(f.fd, out.data() + done + got, n - got, static_cast<off_t>(at + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return Errno("read " + m.PartPath(f), errno);
        if (r == 0) break;
        got += static_cast<size_t>(r);
      }
      std::memset(out.data() + done + got, 0, n - got);  // a hole never written
    }
    done += n;
  }
  return n_total;
}

Status WriteCapture::Truncate(CapturedFile& f, uint64_t n_bytes) {
  Impl& m = *impl_;
  std::unique_lock lock(f.mu);
  if (n_bytes < f.size) {
    // No write of this file may land after the part is cut: it would bring bytes past the new
    // size back, which a later extension must read as zeros.
    f.cv.wait(lock, [&] {
      return std::none_of(f.chunks.begin(), f.chunks.end(), [](const auto& c) { return c.second.in_flight; });
    });
    for (auto it = f.chunks.begin(); it != f.chunks.end();) {
      const uint64_t start = it->first * m.chunk_bytes;
      ChunkSlot& slot = it->second;
      if (start >= n_bytes) {  // a queued one is skipped by its flusher (no slot any more)
        if (slot.mem) ReleaseChunk(*m.cache, *slot.mem);
        if (slot.dirty) m.dirty_chunks.fetch_sub(1);
        it = f.chunks.erase(it);
        continue;
      }
      if (start < n_bytes && n_bytes < start + m.chunk_bytes && slot.mem) {
        const uint64_t keep = n_bytes - start;
        if (slot.valid_bytes > keep) slot.valid_bytes = keep;
        slot.filled.Clip(keep);
        ++slot.generation;
        if (!slot.dirty) {
          slot.dirty = true;
          m.dirty_chunks.fetch_add(1);
        }
      }
      // Not resident: the part's bytes past n_bytes are cut below, and a later write reads back
      // only up to the size.
      ++it;
    }
    if (ftruncate(f.fd, static_cast<off_t>(n_bytes)) != 0) return Errno("truncate " + m.PartPath(f), errno);
  }
  f.size = n_bytes;
  clock_gettime(CLOCK_REALTIME, &f.mtime);
  return Status::Ok();
}

Status WriteCapture::Close(CapturedFile& file) {
  Status error;
  {
    std::lock_guard lock(file.mu);
    file.closed = true;
    error = file.error;
    if (file.discarded) return Status::Ok();
  }
  impl_->Enqueue(file.shared_from_this());
  return error;
}

Status WriteCapture::Fsync(CapturedFile& file) {
  {
    std::lock_guard lock(file.mu);
    if (file.discarded) return Status::Ok();
  }
  return impl_->WaitFor(impl_->Enqueue(file.shared_from_this()));
}

Status WriteCapture::Sync() {
  Impl& m = *impl_;
  uint64_t ticket = 0;
  {
    std::lock_guard lock(m.mu);
    ticket = m.next_ticket - 1;
    if (!m.head_error.ok()) {
      // Tried again by the committer; until it fails again, waiters wait for it.
      m.retry = true;
      m.head_error = Status::Ok();
    }
  }
  m.work_cv.notify_all();
  return m.WaitFor(ticket);
}

bool WriteCapture::Discard(CapturedFile& f) {
  Impl& m = *impl_;
  {
    std::lock_guard lock(f.mu);
    if (f.placed) return false;
    if (f.discarded) return true;
    f.discarded = true;
    for (auto& [index, slot] : f.chunks) {
      if (slot.mem && !slot.in_flight) {
        ReleaseChunk(*m.cache, *slot.mem);
        slot.mem.reset();
      }
      if (slot.dirty) m.dirty_chunks.fetch_sub(1);
      slot.dirty = false;
    }
  }
  unlinkat(m.capture_fd, f.part_name.c_str(), 0);
  m.Journal({JournalType::kDiscard, f.seq, 0, 0, 0, 0, 0, {}});
  std::lock_guard lock(m.mu);
  m.pending.erase(f.seq);
  return true;
}

Status WriteCapture::Error(const CapturedFile& file) const {
  const CapturedFile& f = file;
  std::lock_guard lock(f.mu);
  return f.error;
}

bool WriteCapture::Placed(const CapturedFile& file) const {
  const CapturedFile& f = file;
  std::lock_guard lock(f.mu);
  return f.placed;
}

Result<int> WriteCapture::OpenPath(const CapturedFile& file) const {
  const std::string proc = "/proc/self/fd/" + std::to_string(file.fd);
  const int fd = open(proc.c_str(), O_PATH | O_CLOEXEC);
  if (fd < 0) return IoError("open " + impl_->PartPath(file), errno);
  return fd;
}

bool WriteCapture::Settled(const CapturedFile& file) const {
  const CapturedFile& f = file;
  std::lock_guard lock(f.mu);
  return f.settled;
}

Status WriteCapture::SetMode(CapturedFile& f, mode_t mode) {
  std::lock_guard lock(f.mu);
  f.mode = mode & 07777;
  if (fchmod(f.fd, f.mode) != 0) return Errno("chmod " + impl_->PartPath(f), errno);
  return Status::Ok();
}

CaptureStats WriteCapture::Stats() const {
  const Impl& m = *impl_;
  CaptureStats s;
  std::shared_ptr<PinnedCache> cache;
  {
    std::lock_guard lock(m.start_mu);
    cache = m.cache;
    s.engine = m.engine_name.empty() ? "not started yet" : m.engine_name;
  }
  if (cache == nullptr) {
    s.cache_capacity_bytes = m.options.cache_options.capacity_bytes;
    s.memory_kind = "not allocated yet";
    return s;
  }
  const PinnedCache::Stats cs = cache->stats();
  s.cache_capacity_bytes = cs.capacity_bytes;
  s.cache_used_bytes = cs.used_bytes;
  s.writers_blocked_ns = cs.blocked_ns;
  s.dirty_bytes = m.dirty_chunks.load() * m.chunk_bytes;
  s.bytes_captured = m.bytes_captured.load();
  s.bytes_flushed = m.bytes_flushed.load();
  s.flush_busy_ns = m.flush_busy_ns.load();
  s.files_committed = m.files_committed.load();
  s.flush_errors = m.flush_errors.load();
  s.chunks_coalesced = m.ops_coalesced.load();
  s.memory_kind = PinnedMemoryKindName(cache->kind());
  std::lock_guard lock(m.mu);
  s.files_pending = m.pending.size();
  return s;
}

}  // namespace ucpfs::io
