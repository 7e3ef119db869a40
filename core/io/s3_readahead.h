// S3ReadAhead: the bytes of one object that a view announced it will read soon
// (ByteSource::Prefetch from the mount's --prefetch window), fetched ahead in blocks by a small
// pool of threads, several GETs in flight, and handed to the reads that then ask for them. A
// file's page cache plays this part for a local source; an object has none.
//
// Exactly the announced bytes are fetched (never a neighbour's), once: a block is dropped when
// its bytes have all been read, and a hint leaves out what was read already (the ranges read
// are remembered), so a rank GETs what its views need, no more. A read that a
// block does not hold wholly (not announced, or announced but dropped) is the caller's to make.
//
// Bounded: at most kMaxHeldBytes of one object held or in flight, and kMaxHeldBytesTotal of all
// objects together; the part of a hint past either is dropped (read-ahead is a hint; those bytes
// are then read when asked for), never a block not read yet. A block never read (a reader that
// stopped early) is held until its object's reader goes (the snapshot's file table). A block
// whose GET failed is dropped; the read then makes its own GET and reports its own error.
//
// Block buffers are reused: a dropped block's buffer goes back to a free list of the process
// (at most kMaxPooledBlocks, freed once no fetch has taken one for kPoolIdleMs), so a stream of
// blocks does not allocate, zero and page-fault 4 MiB for each (that was a third of the daemon's
// CPU time in a whole-shard torch.load). Stats() reports both bounds' use.
// Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>

#include "core/io/s3_client.h"
#include "core/status.h"

namespace ucpfs::s3 {

inline constexpr uint64_t kReadAheadBlockBytes = uint64_t{4} << 20;
inline constexpr uint64_t kMaxHeldBytes = uint64_t{64} << 20;
inline constexpr uint64_t kMaxHeldBytesTotal = uint64_t{256} << 20;
inline constexpr size_t kMaxReadRanges = 1024;
inline constexpr size_t kMaxPooledBlocks = 16;      // idle block buffers kept (64 MiB)

// A block's buffer: kReadAheadBlockBytes aligned to 2 MiB and advised for transparent huge
// pages, so a fresh one (each mount's first blocks) faults in 2 pages, not 1024.
struct BlockFree {
  void operator()(std::byte* p) const;
};
using BlockBuffer = std::unique_ptr<std::byte[], BlockFree>;
inline constexpr uint64_t kPoolIdleMs = 2000;       // ... and freed after this long unused

// The read-ahead of the whole process (stats.json's s3.read_ahead).
struct ReadAheadStats {
  uint64_t held_bytes = 0;       // held or in flight now, every object
  uint64_t peak_held_bytes = 0;  // the most ever held at once (bound: kMaxHeldBytesTotal)
  uint64_t pooled_bytes = 0;     // idle block buffers kept for reuse (bound: kMaxPooledBlocks)
  uint64_t blocks_fetched = 0;   // blocks whose GET succeeded
  uint64_t bytes_served = 0;     // bytes handed to reads from blocks
  uint64_t hint_bytes_dropped = 0;  // hinted bytes left out at a bound (read when asked for)
};

class S3ReadAhead : public std::enable_shared_from_this<S3ReadAhead> {
 public:
  explicit S3ReadAhead(std::shared_ptr<S3ObjectSource> object) : object_(std::move(object)) {}
  ~S3ReadAhead();

  // Starts fetching [byte_offset, byte_offset + n_bytes) (clipped to the object), less what is
  // held or in flight already, in blocks of at most kReadAheadBlockBytes. Never waits for a GET.
  void Hint(uint64_t byte_offset, uint64_t n_bytes);

  // When held blocks cover [byte_offset, byte_offset + out.size()) without a gap: waits for them,
  // copies the bytes into `out` and returns true (blocks read to their end are dropped).
  // Otherwise false, and `out` is untouched.
  bool TryRead(uint64_t byte_offset, std::span<std::byte> out);

  // A read of [byte_offset, byte_offset + n_bytes) that the caller makes itself (TryRead said
  // no): a later Hint leaves those bytes out, so they are not fetched twice.
  void NoteRead(uint64_t byte_offset, uint64_t n_bytes);

  // Bytes held or in flight, of every object (for tests).
  static uint64_t HeldBytesTotal();
  static ReadAheadStats Stats();

 private:
  struct Block {
    ~Block();
    uint64_t byte_offset = 0;
    uint64_t n_bytes = 0;
    BlockBuffer data;  // kReadAheadBlockBytes, from the pool; n_bytes used
    uint64_t n_read = 0;   // bytes handed to readers (a block is dropped at n_bytes)
    bool done = false;
    bool failed = false;
  };
  void Fetch(Block& block);
  void DropLocked(std::map<uint64_t, std::shared_ptr<Block>>::iterator it);
  void NoteReadLocked(uint64_t byte_offset, uint64_t end);

  std::shared_ptr<S3ObjectSource> object_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  std::map<uint64_t, std::shared_ptr<Block>> blocks_;  // by offset, disjoint; guarded by mu_
  uint64_t held_bytes_ = 0;                            // guarded by mu_
  // Ranges read already (start -> end, merged; at most kMaxReadRanges, the lowest forgotten
  // first): a hint skips them. Guarded by mu_.
  std::map<uint64_t, uint64_t> read_;
};

}  // namespace ucpfs::s3
