// The flushers of WriteCapture (see write_capture.h, write_capture_internal.h): chunks of the
// pinned cache made resident for writers, queued when full (or for eviction), and written into
// the parts through an IoEngine, several in flight, adjacent ones coalesced.
#include "core/io/write_capture_internal.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#if defined(__SANITIZE_THREAD__)
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#endif

namespace ucpfs::io {

namespace {

// A chunk goes to the disk while a writer may be changing it: the writer bumps the chunk's
// generation and Complete writes it again (see FlusherLoop). The kernel reads the chunk, not the
// program: io_uring's reads are never seen by ThreadSanitizer, but the pwrite engine's
// interceptor reports them as a race with the writer's memcpy. So under ThreadSanitizer the
// flusher thread's memory accesses are not tracked while its batch runs (the annotation ignores
// writes too; the thread touches only its own engine's state there); its locks, the writers'
// side and everything else stay checked.
class KernelReadsTheBatch {
 public:
#if defined(__SANITIZE_THREAD__)
  KernelReadsTheBatch() { AnnotateIgnoreReadsBegin(__FILE__, __LINE__); }
  ~KernelReadsTheBatch() { AnnotateIgnoreReadsEnd(__FILE__, __LINE__); }
#else
  KernelReadsTheBatch() = default;
#endif
  KernelReadsTheBatch(const KernelReadsTheBatch&) = delete;
  KernelReadsTheBatch& operator=(const KernelReadsTheBatch&) = delete;
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

// Queues a chunk of `f` (f.mu held) for flushing.
void WriteCapture::Impl::QueueChunk(const std::shared_ptr<CapturedFile>& f, uint64_t index, ChunkSlot& slot) {
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
void WriteCapture::Impl::RelieveMemory() {
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
Status WriteCapture::Impl::MakeResident(const std::shared_ptr<CapturedFile>& f, std::unique_lock<std::mutex>& lock, uint64_t index) {
  while (!f->chunks[index].mem) {
    lock.unlock();
    std::optional<Chunk> chunk = cache->TryAcquire();
    // A full cache: evict, and wait. Every second the evicting flushes are asked for again
    // (a failed one left its chunk dirty and resident); once the wait has lasted
    // write_stall_timeout_ms with the flushers' writes failing, the writer gets their error
    // rather than waiting for ever on a disk that is gone or full.
    const auto since = std::chrono::steady_clock::now();
    const auto stall = std::chrono::milliseconds(options.write_stall_timeout_ms);
    while (!chunk && !cache->shut_down()) {
      RelieveMemory();
      const auto waited = std::chrono::steady_clock::now() - since;
      if (waited >= stall && flush_failing.load()) {
        Status last;
        {
          std::lock_guard guard(mu);
          last = last_flush_error;
        }
        const int err = last.sys_errno() != 0 ? last.sys_errno() : EIO;
        lock.lock();
        char waited_s[32];
        std::snprintf(waited_s, sizeof(waited_s), "%.1f", static_cast<double>(options.write_stall_timeout_ms) / 1000);
        return Errno("write to " + f->last_rel + ": the cache is full and the flushers cannot write (" +
                         last.message() + ") for " + waited_s + " s; what was written before stays in the cache",
                     err);
      }
      std::chrono::nanoseconds next = std::chrono::seconds(1);
      if (waited < stall) next = std::min<std::chrono::nanoseconds>(next, stall - waited);
      chunk = cache->AcquireFor(next);
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

void WriteCapture::Impl::FlusherLoop() {
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
        slot.dirty_pages.clear();
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
      // Only the pages written since the last flush go out, one write per run of them; the
      // rest of the part already holds what mem holds. No dirty page below the end (a truncate
      // cut them off): the whole chunk, to be safe.
      std::vector<uint64_t> pages = slot.TakeDirtyPages();
      std::vector<std::pair<uint64_t, uint64_t>> runs = DirtyRuns(pages, n_write / kDirectAlign);
      if (runs.empty()) runs.emplace_back(0, n_write);
      uint64_t n_written = 0;
      for (const auto& [from, to] : runs) n_written += to - from;
      slot.in_flight = true;
      // Hashed under the file's lock: a writer changing the chunk afterwards (while the kernel
      // reads it) bumps its generation, and then neither the record nor the release happens.
      Flight fl{f, index, slot.generation, n_data, XXH64(slot.mem->data, static_cast<size_t>(n_data), 0),
                std::move(pages), n_written};
      flights.push_back(std::move(fl));
      int registered_buffer = -1;
      if (fixed && (registered[slot.mem->index] ||
                    engine->UpdateBuffer(slot.mem->index, regions[slot.mem->index]).ok())) {
        registered[slot.mem->index] = true;
        registered_buffer = static_cast<int>(slot.mem->index);
      }
      for (const auto& [from, to] : runs) {
        IoOp op;
        op.kind = OpKind::kWrite;
        op.fd = f->direct_fd;
        op.byte_offset = start + from;
        op.buffer = slot.mem->data + from;
        op.n_bytes = static_cast<size_t>(to - from);
        op.registered_buffer = registered_buffer;
        op.user_data = flights.size() - 1;
        ops.push_back(op);
      }
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
    std::vector<IoCompletion> results;
    {
      [[maybe_unused]] const KernelReadsTheBatch kernel_reads;
      results = engine->RunAll(sent);
    }
    {
      std::lock_guard busy(busy_mu);
      if (--batches_in_flight == 0) flush_busy_ns.fetch_add(NowNs() - busy_since_ns);
    }
    ops_coalesced.fetch_add(ops.size() - sent.size());
    // A flight (a chunk) may be several writes: it fails with the first of their errors.
    std::vector<IoCompletion> outcome(flights.size());
    for (const IoCompletion& r : results) {
      for (const uint64_t k : members[r.user_data]) {
        if (outcome[k].status.ok() && !r.status.ok()) outcome[k].status = r.status;
      }
    }
    // Completed last chunk first: the cache hands chunks out LIFO, so the next file's chunks
    // come out ascending in memory, and coalesce again.
    for (size_t k = flights.size(); k-- > 0;) Complete(flights[k], outcome[k]);
    // Holds no file past its flush: a file removed since keeps its blocks while referenced.
    flights.clear();
  }
}

void WriteCapture::Impl::Complete(const Flight& fl, const IoCompletion& c) {
  CapturedFile& f = *fl.file;
  {
    bool whole = false;  // the part holds all of the chunk, as it is now
    std::lock_guard lock(f.mu);
    ChunkSlot& slot = f.chunks[fl.index];
    slot.in_flight = false;
    if (!c.status.ok()) {
      {
        std::lock_guard guard(mu);
        last_flush_error = c.status;
      }
      flush_failing.store(true);
      slot.GiveBackDirtyPages(fl.pages);
      if (f.error.ok()) f.error = c.status;
      flush_errors.fetch_add(1);
      Log("ucpfs: flushing " + PartPath(f) + " at byte " + std::to_string(fl.index * chunk_bytes) + ": " +
          c.status.ToString() + " (the data stays in the cache)");
    } else {
      flush_failing.store(false);
      bytes_flushed.fetch_add(fl.n_written);
      slot.on_disk = true;
      if (slot.generation == fl.generation) {
        whole = slot.filled.Covers(chunk_bytes);
        slot.dirty = false;
        slot.dirty_pages.clear();
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
    // Reported before the lock is let go: a commit waiting for this write (the committer sees
    // in_flight under this lock) must not be queued for upload before the report is in. Even
    // a failed write may have changed some of the chunk's bytes in the part.
    if (options.on_part_change) {
      PartChange change;
      change.kind = PartChange::Kind::kFlushed;
      change.byte_offset = fl.index * chunk_bytes;
      change.n_bytes = chunk_bytes;
      change.whole = whole;
      NotifyPartChange(f, change);
    }
  }
  f.cv.notify_all();
}

void WriteCapture::Impl::NotifyPartChange(const CapturedFile& f, PartChange change) const {
  change.seq = f.seq;
  change.ino = f.part_stat.st_ino;
  change.part_fd = f.fd;
  change.rel_path = RelPath(f);
  options.on_part_change(change);
}

}  // namespace ucpfs::io
