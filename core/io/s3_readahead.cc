#include "core/io/s3_readahead.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>

namespace ucpfs::s3 {
namespace {

std::atomic<uint64_t> g_held_total{0};

// The fetching threads of the process: a fixed few, a bounded queue (a job that finds it full
// is not queued: the caller drops its block). Never destroyed (threads may be mid-GET at exit).
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
        cv_.wait(lock, [this] { return !jobs_.empty(); });
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

uint64_t S3ReadAhead::HeldBytesTotal() { return g_held_total.load(); }

void S3ReadAhead::DropLocked(std::map<uint64_t, std::shared_ptr<Block>>::iterator it) {
  held_bytes_ -= it->second->data.size();
  g_held_total -= it->second->data.size();
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
        const uint64_t prev_end = prev->first + prev->second->data.size();
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
      if (held_bytes_ + n > kMaxHeldBytes || g_held_total.load() + n > kMaxHeldBytesTotal) break;
      auto block = std::make_shared<Block>();
      block->byte_offset = pos;
      block->data.resize(n);
      held_bytes_ += n;
      g_held_total += n;
      blocks_.emplace(pos, block);
      started.push_back(std::move(block));
      pos = stop;
    }
  }
  std::shared_ptr<S3ReadAhead> self = shared_from_this();
  for (const std::shared_ptr<Block>& block : started) {
    if (!Pool::Get().Submit([self, block] { self->Fetch(block); })) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = blocks_.find(block->byte_offset);
      if (it != blocks_.end() && it->second == block) DropLocked(it);
    }
  }
}

void S3ReadAhead::Fetch(const std::shared_ptr<Block>& block) {
  const Status st = object_->ReadAt(block->byte_offset, block->data);
  {
    std::lock_guard<std::mutex> lock(mu_);
    block->done = true;
    block->failed = !st.ok();
    if (block->failed) {
      auto it = blocks_.find(block->byte_offset);
      if (it != blocks_.end() && it->second == block) DropLocked(it);
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
    if (b.byte_offset > pos || b.byte_offset + b.data.size() <= pos) return false;
    cover.push_back(it->second);
    pos = b.byte_offset + b.data.size();
  }
  if (pos < end) return false;
  done_cv_.wait(lock, [&] { return std::all_of(cover.begin(), cover.end(), [](const auto& b) { return b->done; }); });
  if (std::any_of(cover.begin(), cover.end(), [](const auto& b) { return b->failed; })) return false;
  for (const std::shared_ptr<Block>& b : cover) {
    const uint64_t from = std::max(byte_offset, b->byte_offset);
    const uint64_t to = std::min(end, b->byte_offset + b->data.size());
    std::memcpy(out.data() + (from - byte_offset), b->data.data() + (from - b->byte_offset), to - from);
    b->n_read += to - from;
    NoteReadLocked(from, to);
    if (b->n_read >= b->data.size()) {  // every byte handed out: the block has done its work
      auto found = blocks_.find(b->byte_offset);
      if (found != blocks_.end() && found->second == b) DropLocked(found);
    }
  }
  return true;
}

}  // namespace ucpfs::s3
