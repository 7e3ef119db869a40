#include "core/io/s3_readahead.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>

namespace ucpfs::s3 {

void BlockFree::operator()(std::byte* p) const { std::free(p); }

namespace {

std::atomic<uint64_t> g_held_total{0};
std::atomic<uint64_t> g_peak_held{0};
std::atomic<uint64_t> g_blocks_fetched{0};
std::atomic<uint64_t> g_bytes_served{0};
std::atomic<uint64_t> g_hint_bytes_dropped{0};

void AddHeld(uint64_t n) {
  const uint64_t now = g_held_total += n;
  uint64_t peak = g_peak_held.load(std::memory_order_relaxed);
  while (now > peak && !g_peak_held.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// Idle block buffers (each kReadAheadBlockBytes), kept for the next block: at most
// kMaxPooledBlocks, all freed by Trim once none was taken or given back for kPoolIdleMs.
// Never destroyed.
class BufferPool {
 public:
  using Clock = std::chrono::steady_clock;
  static BufferPool& Get() {
    static BufferPool* pool = new BufferPool;
    return *pool;
  }
  BlockBuffer Take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_use_ = Clock::now();
      if (!free_.empty()) {
        BlockBuffer buffer = std::move(free_.back());
        free_.pop_back();
        return buffer;
      }
    }
    // Not value-initialised: the GET writes every byte the block uses before any is read.
    constexpr size_t kHugePage = size_t{2} << 20;
    static_assert(kReadAheadBlockBytes % kHugePage == 0);
    void* p = std::aligned_alloc(kHugePage, kReadAheadBlockBytes);
    if (p == nullptr) throw std::bad_alloc();
    (void)madvise(p, kReadAheadBlockBytes, MADV_HUGEPAGE);  // a hint: without THP, small pages
    return BlockBuffer(static_cast<std::byte*>(p));
  }
  void Give(BlockBuffer buffer) {
    std::lock_guard<std::mutex> lock(mu_);
    last_use_ = Clock::now();
    if (free_.size() < kMaxPooledBlocks) free_.push_back(std::move(buffer));
  }
  void Trim() {
    std::vector<BlockBuffer> freed;  // freed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    if (Clock::now() - last_use_ >= std::chrono::milliseconds(kPoolIdleMs)) freed.swap(free_);
  }
  uint64_t PooledBytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return free_.size() * kReadAheadBlockBytes;
  }

 private:
  std::mutex mu_;
  std::vector<BlockBuffer> free_;
  Clock::time_point last_use_;
};

// The fetching threads of the process: a fixed few, a bounded queue (a job that finds it full
// is not queued: the caller drops its block). Never destroyed (threads may be mid-GET at exit).
// An idle thread trims the buffer pool.
class Pool {
 public:
  static Pool& Get() {
    static Pool* pool = new Pool(8, 1024);
    return *pool;
  }
  bool Submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (jobs_.size() >= max_queued_) return false;
      jobs_.push_back(std::move(job));
      if (threads_.empty()) {
        for (unsigned i = 0; i < n_threads_; ++i) threads_.emplace_back([this] { Run(); });
        for (std::thread& t : threads_) t.detach();
      }
    }
    cv_.notify_one();
    return true;
  }

 private:
  Pool(unsigned n_threads, size_t max_queued) : n_threads_(n_threads), max_queued_(max_queued) {}
  void Run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (!cv_.wait_for(lock, std::chrono::milliseconds(kPoolIdleMs), [this] { return !jobs_.empty(); })) {
          lock.unlock();
          BufferPool::Get().Trim();
          continue;
        }
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  const unsigned n_threads_;
  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
};

}  // namespace

S3ReadAhead::~S3ReadAhead() { g_held_total -= held_bytes_; }

S3ReadAhead::Block::~Block() {
  if (data) BufferPool::Get().Give(std::move(data));
}

uint64_t S3ReadAhead::HeldBytesTotal() { return g_held_total.load(); }

ReadAheadStats S3ReadAhead::Stats() {
  ReadAheadStats s;
  s.held_bytes = g_held_total.load();
  s.peak_held_bytes = g_peak_held.load();
  s.pooled_bytes = BufferPool::Get().PooledBytes();
  s.blocks_fetched = g_blocks_fetched.load();
  s.bytes_served = g_bytes_served.load();
  s.hint_bytes_dropped = g_hint_bytes_dropped.load();
  return s;
}

void S3ReadAhead::DropLocked(std::map<uint64_t, std::shared_ptr<Block>>::iterator it) {
  held_bytes_ -= it->second->n_bytes;
  g_held_total -= it->second->n_bytes;
  blocks_.erase(it);
}

void S3ReadAhead::NoteReadLocked(uint64_t byte_offset, uint64_t end) {
  if (end <= byte_offset) return;
  // Merge with every range it touches.
  auto it = read_.upper_bound(byte_offset);
  if (it != read_.begin() && std::prev(it)->second >= byte_offset) --it;
  while (it != read_.end() && it->first <= end) {
    byte_offset = std::min(byte_offset, it->first);
    end = std::max(end, it->second);
    it = read_.erase(it);
  }
  read_.emplace(byte_offset, end);
  while (read_.size() > kMaxReadRanges) read_.erase(read_.begin());
}

void S3ReadAhead::NoteRead(uint64_t byte_offset, uint64_t n_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  NoteReadLocked(byte_offset, byte_offset + n_bytes);
}

void S3ReadAhead::Hint(uint64_t byte_offset, uint64_t n_bytes) {
  const uint64_t size = object_->Size();
  if (byte_offset >= size || n_bytes == 0) return;
  const uint64_t end = std::min(size, byte_offset + std::min(n_bytes, size - byte_offset));
  std::vector<std::shared_ptr<Block>> started;
  {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t pos = byte_offset;
    while (pos < end) {
      // Skip what was read already.
      auto next_read = read_.upper_bound(pos);
      if (next_read != read_.begin() && std::prev(next_read)->second > pos) {
        pos = std::prev(next_read)->second;
        continue;
      }
      // Skip what a block already holds; stop the new block where the next one (or a range
      // read) begins.
      auto next = blocks_.upper_bound(pos);
      if (next != blocks_.begin()) {
        auto prev = std::prev(next);
        const uint64_t prev_end = prev->first + prev->second->n_bytes;
        if (prev_end > pos) {
          pos = prev_end;
          continue;
        }
      }
      uint64_t stop = std::min(end, pos + kReadAheadBlockBytes);
      if (next != blocks_.end()) stop = std::min(stop, next->first);
      if (next_read != read_.end()) stop = std::min(stop, next_read->first);
      const uint64_t n = stop - pos;
      // Past the bounds the rest of the hint is dropped: a block not read yet is never dropped
      // for one further ahead (its bytes would be fetched twice).
      if (held_bytes_ + n > kMaxHeldBytes || g_held_total.load() + n > kMaxHeldBytesTotal) {
        g_hint_bytes_dropped += end - pos;
        break;
      }
      auto block = std::make_shared<Block>();
      block->byte_offset = pos;
      block->n_bytes = n;
      block->data = BufferPool::Get().Take();
      held_bytes_ += n;
      AddHeld(n);
      blocks_.emplace(pos, block);
      started.push_back(std::move(block));
      pos = stop;
    }
  }
  std::shared_ptr<S3ReadAhead> self = shared_from_this();
  for (const std::shared_ptr<Block>& block : started) {
    // The job holds the block by address: the map keeps it until it is done (only a done block
    // is dropped), so the last reader's drop gives its buffer back at once.
    if (!Pool::Get().Submit([self, raw = block.get()] { self->Fetch(*raw); })) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = blocks_.find(block->byte_offset);
      if (it != blocks_.end() && it->second == block) DropLocked(it);
    }
  }
}

void S3ReadAhead::Fetch(Block& block) {
  const Status st = object_->ReadAt(block.byte_offset, std::span(block.data.get(), block.n_bytes));
  if (st.ok()) g_blocks_fetched += 1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    block.done = true;
    block.failed = !st.ok();
    if (block.failed) {
      auto it = blocks_.find(block.byte_offset);
      if (it != blocks_.end() && it->second.get() == &block) DropLocked(it);  // `block` may go here
    }
  }
  done_cv_.notify_all();
}

bool S3ReadAhead::TryRead(uint64_t byte_offset, std::span<std::byte> out) {
  if (out.empty()) return false;
  const uint64_t end = byte_offset + out.size();
  std::unique_lock<std::mutex> lock(mu_);
  // The blocks covering [byte_offset, end) without a gap.
  std::vector<std::shared_ptr<Block>> cover;
  auto it = blocks_.upper_bound(byte_offset);
  if (it == blocks_.begin()) return false;
  --it;
  uint64_t pos = byte_offset;
  for (; it != blocks_.end() && pos < end; ++it) {
    const Block& b = *it->second;
    if (b.byte_offset > pos || b.byte_offset + b.n_bytes <= pos) return false;
    cover.push_back(it->second);
    pos = b.byte_offset + b.n_bytes;
  }
  if (pos < end) return false;
  done_cv_.wait(lock, [&] { return std::all_of(cover.begin(), cover.end(), [](const auto& b) { return b->done; }); });
  if (std::any_of(cover.begin(), cover.end(), [](const auto& b) { return b->failed; })) return false;
  // Counted (and dropped when read to their end) under the lock, copied after it: a done block's
  // bytes no longer change, and `cover` keeps each alive, so readers of one object copy at once.
  for (const std::shared_ptr<Block>& b : cover) {
    const uint64_t from = std::max(byte_offset, b->byte_offset);
    const uint64_t to = std::min(end, b->byte_offset + b->n_bytes);
    b->n_read += to - from;
    NoteReadLocked(from, to);
    if (b->n_read >= b->n_bytes) {  // every byte handed out: the block has done its work
      auto found = blocks_.find(b->byte_offset);
      if (found != blocks_.end() && found->second == b) DropLocked(found);
    }
  }
  lock.unlock();
  for (const std::shared_ptr<Block>& b : cover) {
    const uint64_t from = std::max(byte_offset, b->byte_offset);
    const uint64_t to = std::min(end, b->byte_offset + b->n_bytes);
    std::memcpy(out.data() + (from - byte_offset), b->data.get() + (from - b->byte_offset), to - from);
  }
  g_bytes_served += out.size();
  return true;
}

}  // namespace ucpfs::s3
