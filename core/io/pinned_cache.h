// PinnedCache: a bounded pool of fixed-size chunks of page-locked host memory, aligned for
// O_DIRECT, into which write capture copies what a trainer saves, and out of which the flusher
// writes (io_uring fixed buffers: Regions() registers them).
// Not for: device memory, variable-sized allocations, anything that must survive the cache.
//
// Memory, in order of preference:
//   - cudaHostAlloc (portable, pinned for DMA) when built with UCPFS_CUDA, allow_cuda is set and
//     a CUDA device is present at run time (the runtime is asked once per process; no device
//     means no CUDA calls after). If cudaHostAlloc itself fails, Make warns through
//     Options::warn and takes the next way;
//   - an anonymous mapping, populated (MAP_POPULATE) and locked with mlock, so the kernel never
//     pages it out;
//   - the same mapping unlocked, when mlock is refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK): it
//     works, slower under memory pressure, and Make reports one warning line through
//     Options::warn (the errno text and the RLIMIT_MEMLOCK soft limit).
// The whole capacity is reserved by Make (no allocation on the write path) and freed by the
// destructor (munmap / cudaFreeHost).
//
// Invariants: every chunk starts on a 4096-byte boundary and is chunk_bytes() long (a multiple
// of 4096); chunks never overlap; a chunk is held by at most one caller between the Acquire or
// TryAcquire that returned it and its Release.
//
// Back-pressure: Acquire blocks while every chunk is in use, until Release gives one back (the
// flusher, once a chunk is durable in its file); it never fails for lack of space and never
// drops data. Time spent blocked is counted (Stats::blocked_ns, Stats::n_blocked). Waiters are
// not served in arrival order: a Release wakes one, and a newcomer may take the chunk first.
//
// Thread-safety: every method may be called from any thread at once, except the destructor,
// which must run only once no thread is inside a method (no Acquire waiting: call Shutdown and
// join the waiters first); chunks still held then point at freed memory.
//
// Refinements of the first draft (same shape):
//   - Release returns Status: a double release or a chunk not from this cache is detected, left
//     out of the free list (the pool stays intact) and reported as kInternal.
//   - TryAcquire returns nullopt after Shutdown, like Acquire; Release still works after it.
//   - Stats gained n_waiting (Acquires waiting now) and n_bad_releases (Releases refused).
//   - chunk_bytes is at most 1 GiB (the most one io_uring fixed buffer may be); the capacity,
//     in whole chunks, is at most the machine's physical memory (kResourceExhausted, checked
//     before anything is mapped) and at most 2^32 - 1 chunks (Chunk::index is 32 bits).
//   - ParseByteSize's accepted forms, and refusals, are listed at the function.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace ucpfs::io {

enum class PinnedMemoryKind { kCudaHost, kLocked, kUnlocked };
const char* PinnedMemoryKindName(PinnedMemoryKind kind);  // "cuda_host", "mlock", "unlocked"

struct PinnedCacheOptions {
  uint64_t capacity_bytes = uint64_t{2} << 30;  // rounded down to whole chunks; at least 2
  size_t chunk_bytes = size_t{8} << 20;         // a multiple of 4096 (O_DIRECT), 64 KiB .. 1 GiB
  bool allow_cuda = true;                       // use cudaHostAlloc when built with CUDA and a GPU is present
  // Called (from Make only) with one line when the memory is not what was preferred, e.g.
  // "mlock of ... refused (...): unlocked". May be empty: the line is then dropped, and kind()
  // still tells.
  std::function<void(const std::string&)> warn;
  // Lock each chunk when it is first handed out, instead of populating and locking the whole
  // capacity in Make (which costs about 1 s per 2 GiB here, and the memory from the start): the
  // first use of a chunk then faults and locks its pages (as a tmpfs write faults its pages). A
  // refused mlock is warned about once (through `warn`, then from Acquire) and the cache goes
  // on unlocked. Host memory only (cudaHostAlloc pins everything at once).
  bool lock_on_first_use = false;
};

// One chunk: chunk_bytes of memory, its index in Regions() (the fixed-buffer index).
struct Chunk {
  std::byte* data = nullptr;
  uint32_t index = 0;
};

class PinnedCache {
 public:
  // Errors: kInvalidArgument (bad sizes, with the rule), kResourceExhausted when the capacity
  // exceeds physical memory or the memory cannot be had at all (mmap failed; names the size
  // and the errno text).
  static Result<std::unique_ptr<PinnedCache>> Make(const PinnedCacheOptions& options);
  ~PinnedCache();
  PinnedCache(const PinnedCache&) = delete;
  PinnedCache& operator=(const PinnedCache&) = delete;

  // A free chunk, waiting as long as every chunk is in use. nullopt only after Shutdown.
  std::optional<Chunk> Acquire();
  // A free chunk, waiting at most `wait` while every chunk is in use; nullopt after that or
  // after Shutdown (shut_down() tells which). Counted in Stats as Acquire is.
  std::optional<Chunk> AcquireFor(std::chrono::nanoseconds wait);
  bool shut_down() const;
  // A free chunk now, or nullopt (every chunk in use, or after Shutdown). Never waits.
  std::optional<Chunk> TryAcquire();
  // Gives a chunk back (its bytes are not cleared) and wakes one waiting Acquire. Errors:
  // kInternal, and nothing changes, when the chunk is already free (released twice, or never
  // acquired) or is not one of this cache's (index out of range, or data not that index's
  // address). Both are the caller's bugs; they are counted in Stats::n_bad_releases.
  Status Release(const Chunk& chunk);
  // Wakes every waiting Acquire (they return nullopt); later Acquires and TryAcquires return
  // nullopt too. Release keeps working, so holders can still give their chunks back.
  void Shutdown();

  size_t chunk_bytes() const;
  size_t n_chunks() const;
  PinnedMemoryKind kind() const;
  // One iovec per chunk, index = Chunk::index, for IoEngine::RegisterBuffers.
  std::vector<iovec> Regions() const;

  struct Stats {
    uint64_t capacity_bytes = 0;    // n_chunks() * chunk_bytes()
    uint64_t used_bytes = 0;        // chunks acquired and not released
    uint64_t blocked_ns = 0;        // total time Acquire waited (added when each wait ends)
    uint64_t n_blocked = 0;         // Acquires that had to wait (counted when the wait begins)
    uint64_t n_waiting = 0;         // Acquires waiting now
    uint64_t n_bad_releases = 0;    // Releases refused with kInternal
  };
  Stats stats() const;

 private:
  PinnedCache() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Parses a size into bytes: a whole decimal number, optionally followed by a unit, case
// insensitive: none or "B" (bytes), "K"/"Ki"/"KiB" (2^10), "M"/"Mi"/"MiB" (2^20), "G", "T", "P",
// "E" likewise. So "4G", "512M", "1536MiB", "2GiB", "1048576". Errors: kInvalidArgument naming
// the text and the reason for anything else: an empty text, signs, spaces, fractions ("1.5G"),
// unknown units, the ambiguous "KB"/"MB"/"GB"/... (10^3 or 2^10? write "K" or "KiB"), and
// values over 2^64 - 1 bytes. Zero is a size and is accepted; callers for which zero makes no
// sense refuse it (PinnedCache::Make refuses any capacity under two chunks).
Result<uint64_t> ParseByteSize(const std::string& text);

}  // namespace ucpfs::io
