// PinnedCache: one reservation made by Make, cut into chunks, handed out from a free list under
// one mutex; see pinned_cache.h. Not for: growing, shrinking or per-chunk allocation.
#include "core/io/pinned_cache.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string_view>

#include "core/checked.h"
#include "core/io/cuda_host.h"

namespace ucpfs::io {
namespace {

constexpr size_t kDirectIoAlign = 4096;
constexpr size_t kMinChunkBytes = size_t{64} << 10;
constexpr size_t kMaxChunkBytes = size_t{1} << 30;  // io_uring's limit for one fixed buffer
constexpr uint64_t kMaxChunks = UINT32_MAX;          // Chunk::index is 32 bits

std::string RlimitMemlockText() {
  struct rlimit lim;
  if (::getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return "unknown";
  if (lim.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(static_cast<uint64_t>(lim.rlim_cur)) + " bytes";
}

// The machine's physical memory in bytes, 0 when unknown.
uint64_t PhysicalMemoryBytes() {
  const long n_pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_bytes = ::sysconf(_SC_PAGESIZE);
  if (n_pages <= 0 || page_bytes <= 0) return 0;
  return CheckedMul(static_cast<uint64_t>(n_pages), static_cast<uint64_t>(page_bytes)).value_or(0);
}

}  // namespace

const char* PinnedMemoryKindName(PinnedMemoryKind kind) {
  switch (kind) {
    case PinnedMemoryKind::kCudaHost: return "cuda_host";
    case PinnedMemoryKind::kLocked: return "mlock";
    case PinnedMemoryKind::kUnlocked: return "unlocked";
  }
  return "unknown";
}

struct PinnedCache::Impl {
  ~Impl() {
    if (kind == PinnedMemoryKind::kCudaHost) {
      CudaFreeHost(allocation);
    } else if (allocation != nullptr) {
      ::munmap(allocation, allocation_bytes);  // also unlocks
    }
  }

  // What was allocated (freed by ~Impl) and the 4096-aligned start of chunk 0 inside it.
  std::byte* allocation = nullptr;
  size_t allocation_bytes = 0;
  std::byte* base = nullptr;
  PinnedMemoryKind kind = PinnedMemoryKind::kUnlocked;
  size_t chunk_bytes = 0;
  size_t n_chunks = 0;

  mutable std::mutex mu;
  std::condition_variable chunk_freed;  // signalled once per Release, and on Shutdown
  // Guarded by mu. free_list holds each free chunk's index exactly once; in_use[i] is true
  // exactly when i is not in free_list. Release checks in_use before pushing, which is what
  // keeps a double release out of the list.
  std::vector<uint32_t> free_list;
  std::vector<bool> in_use;
  bool shut_down = false;
  Stats stats;
  // lock_on_first_use: touched[i] once chunk i has been locked (or tried); guarded by mu.
  bool lock_on_first_use = false;
  std::vector<bool> touched;
  bool lock_refused = false;  // guarded by mu
  std::function<void(const std::string&)> warn;

  Chunk TakeLocked() {
    const uint32_t index = free_list.back();  // LIFO: the chunk released last is warm in cache
    free_list.pop_back();
    in_use[index] = true;
    stats.used_bytes += chunk_bytes;
    return Chunk{base + size_t{index} * chunk_bytes, index};
  }

  // First use of a chunk under lock_on_first_use: fault and lock its pages (outside mu: the
  // chunk is the caller's alone now).
  Chunk FirstUse(const Chunk& chunk, bool first) {
    if (!first) return chunk;
    if (::syscall(SYS_mlock, chunk.data, chunk_bytes) != 0) {
      const int e = errno;
      bool tell = false;
      {
        std::lock_guard lock(mu);
        tell = !lock_refused;
        lock_refused = true;
        kind = PinnedMemoryKind::kUnlocked;
      }
      if (tell && warn) {
        warn("pinned cache: mlock refused (" + std::string(std::strerror(e)) + "; RLIMIT_MEMLOCK " +
             RlimitMemlockText() + "): using unlocked memory, which the kernel may page out");
      }
    }
    // mlock of a writable private mapping faults its pages in for writing: nothing else to do.
    return chunk;
  }

  // Marks `index` used; true when this is its first use.
  bool MarkTouched(uint32_t index) {
    if (!lock_on_first_use || touched[index]) return false;
    touched[index] = true;
    return true;
  }
};

Result<std::unique_ptr<PinnedCache>> PinnedCache::Make(const PinnedCacheOptions& options) {
  const size_t chunk_bytes = options.chunk_bytes;
  if (chunk_bytes % kDirectIoAlign != 0 || chunk_bytes < kMinChunkBytes || chunk_bytes > kMaxChunkBytes) {
    return InvalidArgumentError("pinned cache: chunk_bytes " + std::to_string(chunk_bytes) +
                                " must be a multiple of 4096 from 65536 (64 KiB) to 1073741824 (1 GiB)");
  }
  const uint64_t n_chunks = options.capacity_bytes / chunk_bytes;
  if (n_chunks < 2) {
    return InvalidArgumentError("pinned cache: capacity_bytes " + std::to_string(options.capacity_bytes) +
                                " must hold at least two chunks of " + std::to_string(chunk_bytes) + " bytes");
  }
  if (n_chunks > kMaxChunks) {
    return InvalidArgumentError("pinned cache: capacity_bytes " + std::to_string(options.capacity_bytes) +
                                " makes " + std::to_string(n_chunks) + " chunks, over the limit of " +
                                std::to_string(kMaxChunks) + " (use larger chunks)");
  }
  const uint64_t n_bytes = n_chunks * chunk_bytes;  // <= capacity_bytes: no overflow
  const uint64_t physical_bytes = PhysicalMemoryBytes();
  if (physical_bytes != 0 && n_bytes > physical_bytes) {
    return ResourceExhaustedError("pinned cache: " + std::to_string(n_bytes) + " bytes requested, more than the " +
                                  std::to_string(physical_bytes) + " bytes of physical memory");
  }

  auto impl = std::make_unique<Impl>();
  impl->chunk_bytes = chunk_bytes;
  impl->n_chunks = static_cast<size_t>(n_chunks);
  auto warn = [&options](const std::string& line) {
    if (options.warn) options.warn(line);
  };

  if (options.allow_cuda && CudaDeviceCount() > 0) {
    // cudaHostAlloc promises less alignment than O_DIRECT needs: one extra 4096 bytes lets the
    // first chunk start on a 4096 boundary whatever the runtime returns.
    const size_t allocation_bytes = static_cast<size_t>(n_bytes) + kDirectIoAlign;
    Result<std::byte*> cuda = CudaHostAlloc(allocation_bytes);
    if (cuda.ok()) {
      impl->allocation = *cuda;
      impl->allocation_bytes = allocation_bytes;
      impl->kind = PinnedMemoryKind::kCudaHost;
      const uintptr_t address = reinterpret_cast<uintptr_t>(*cuda);
      impl->base = *cuda + ((kDirectIoAlign - address % kDirectIoAlign) % kDirectIoAlign);
    } else {
      warn("pinned cache: " + cuda.error().message() + "; using mlock'd host memory instead");
    }
  }

  if (impl->allocation == nullptr) {
    // MAP_POPULATE faults every page in now (writes on a private mapping), so even when mlock
    // is refused below the write path takes no page faults while memory is plentiful. With
    // lock_on_first_use the range is only reserved: Acquire faults and locks chunk by chunk.
    const int populate = options.lock_on_first_use ? MAP_NORESERVE : MAP_POPULATE;
    void* mapping = ::mmap(nullptr, static_cast<size_t>(n_bytes), PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | populate, -1, 0);
    if (mapping == MAP_FAILED) {
      const int e = errno;
      return Status(StatusCode::kResourceExhausted,
                    "pinned cache: mmap of " + std::to_string(n_bytes) + " bytes failed: " + std::strerror(e), e);
    }
    impl->allocation = static_cast<std::byte*>(mapping);  // page-aligned, so 4096-aligned
    impl->allocation_bytes = static_cast<size_t>(n_bytes);
    impl->base = impl->allocation;
    if (options.lock_on_first_use) {
      impl->kind = PinnedMemoryKind::kLocked;  // until a chunk's mlock is refused
      impl->lock_on_first_use = true;
      impl->touched.assign(static_cast<size_t>(n_chunks), false);
      impl->warn = options.warn;
    } else if (::syscall(SYS_mlock, mapping, impl->allocation_bytes) == 0) {
      // mlock through syscall(2): the sanitizers' runtimes replace mlock() and munlock() with
      // no-ops that report success, so a sanitizer build would call unlocked memory locked.
      impl->kind = PinnedMemoryKind::kLocked;
    } else {
      const int e = errno;
      // A refused mlock may have locked a prefix before it failed; unlock it, so the memory is
      // uniformly what kind() says.
      ::syscall(SYS_munlock, mapping, impl->allocation_bytes);
      impl->kind = PinnedMemoryKind::kUnlocked;
      warn("pinned cache: mlock of " + std::to_string(n_bytes) + " bytes refused (" + std::strerror(e) +
           "; RLIMIT_MEMLOCK " + RlimitMemlockText() +
           " and no CAP_IPC_LOCK): using unlocked memory, which the kernel may page out; raise the limit "
           "(ulimit -l, systemd LimitMEMLOCK=) to lock it");
    }
  }

  impl->free_list.reserve(impl->n_chunks);
  // Pushed in reverse so that TakeLocked (from the back) hands out chunk 0 first.
  for (size_t i = impl->n_chunks; i-- > 0;) impl->free_list.push_back(static_cast<uint32_t>(i));
  impl->in_use.assign(impl->n_chunks, false);
  impl->stats.capacity_bytes = n_bytes;

  std::unique_ptr<PinnedCache> cache(new PinnedCache());
  cache->impl_ = std::move(impl);
  return cache;
}

PinnedCache::~PinnedCache() = default;

std::optional<Chunk> PinnedCache::Acquire() { return AcquireFor(std::chrono::nanoseconds::max()); }

std::optional<Chunk> PinnedCache::AcquireFor(std::chrono::nanoseconds wait) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  if (m.free_list.empty() && !m.shut_down) {
    const auto start = std::chrono::steady_clock::now();
    ++m.stats.n_blocked;
    ++m.stats.n_waiting;
    const auto ready = [&m] { return m.shut_down || !m.free_list.empty(); };
    if (wait == std::chrono::nanoseconds::max()) {
      m.chunk_freed.wait(lock, ready);
    } else {
      m.chunk_freed.wait_for(lock, wait, ready);
    }
    --m.stats.n_waiting;
    m.stats.blocked_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
  }
  if (m.shut_down || m.free_list.empty()) return std::nullopt;
  const Chunk chunk = m.TakeLocked();
  const bool first = m.MarkTouched(chunk.index);
  lock.unlock();
  return m.FirstUse(chunk, first);
}

bool PinnedCache::shut_down() const {
  std::lock_guard lock(impl_->mu);
  return impl_->shut_down;
}

std::optional<Chunk> PinnedCache::TryAcquire() {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  if (m.shut_down || m.free_list.empty()) return std::nullopt;
  const Chunk chunk = m.TakeLocked();
  const bool first = m.MarkTouched(chunk.index);
  lock.unlock();
  return m.FirstUse(chunk, first);
}

Status PinnedCache::Release(const Chunk& chunk) {
  Impl& m = *impl_;
  {
    std::lock_guard lock(m.mu);
    // The address is compared, not only the index: a Chunk from another cache, or a forged
    // one, carries an index that may well be in range.
    if (chunk.index >= m.n_chunks || chunk.data != m.base + size_t{chunk.index} * m.chunk_bytes) {
      ++m.stats.n_bad_releases;
      return InternalError("pinned cache: Release of a chunk that is not this cache's (index " +
                           std::to_string(chunk.index) + " of " + std::to_string(m.n_chunks) +
                           ", address does not match); ignored");
    }
    if (!m.in_use[chunk.index]) {
      ++m.stats.n_bad_releases;
      return InternalError("pinned cache: chunk " + std::to_string(chunk.index) +
                           " released while free (a double release, or never acquired); ignored");
    }
    m.in_use[chunk.index] = false;
    m.free_list.push_back(chunk.index);
    m.stats.used_bytes -= m.chunk_bytes;
  }
  m.chunk_freed.notify_one();
  return Status::Ok();
}

void PinnedCache::Shutdown() {
  Impl& m = *impl_;
  {
    std::lock_guard lock(m.mu);
    m.shut_down = true;
  }
  m.chunk_freed.notify_all();
}

size_t PinnedCache::chunk_bytes() const { return impl_->chunk_bytes; }
size_t PinnedCache::n_chunks() const { return impl_->n_chunks; }
PinnedMemoryKind PinnedCache::kind() const {
  std::lock_guard lock(impl_->mu);  // lock_on_first_use may turn it to kUnlocked
  return impl_->kind;
}

std::vector<iovec> PinnedCache::Regions() const {
  std::vector<iovec> regions(impl_->n_chunks);
  for (size_t i = 0; i < regions.size(); ++i) {
    regions[i].iov_base = impl_->base + i * impl_->chunk_bytes;
    regions[i].iov_len = impl_->chunk_bytes;
  }
  return regions;
}

PinnedCache::Stats PinnedCache::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

Result<uint64_t> ParseByteSize(const std::string& text) {
  auto invalid = [&text](const std::string& why) {
    return InvalidArgumentError("byte size '" + text + "': " + why);
  };
  size_t n_digits = 0;
  while (n_digits < text.size() && std::isdigit(static_cast<unsigned char>(text[n_digits]))) ++n_digits;
  if (n_digits == 0) {
    return invalid("expected a whole number of bytes, optionally followed by a unit (K, M, G, T, P, E, or KiB ... EiB)");
  }
  uint64_t number = 0;
  if (std::from_chars(text.data(), text.data() + n_digits, number).ec != std::errc()) {
    return invalid("more than 2^64 - 1 bytes");
  }
  std::string unit = text.substr(n_digits);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (unit.empty() || unit == "b") return number;
  if (unit[0] == '.') return invalid("whole numbers only (write 1536M, not 1.5G)");
  const std::string written_unit = text.substr(n_digits);
  const size_t prefix = std::string_view("kmgtpe").find(unit[0]);  // 2^10, 2^20, ..., 2^60
  const std::string rest = unit.substr(1);
  const std::string letter(1, static_cast<char>(std::toupper(static_cast<unsigned char>(unit[0]))));
  if (prefix == std::string_view::npos || !(rest.empty() || rest == "b" || rest == "i" || rest == "ib")) {
    return invalid("unknown unit '" + written_unit + "' (K, M, G, T, P, E, or KiB ... EiB)");
  }
  if (rest == "b") {
    return invalid("ambiguous unit '" + written_unit + "' (a power of 1000 or of 1024?): write " +
                   letter + " or " + letter + "iB for a power of 1024");
  }
  const int shift = 10 * static_cast<int>(prefix + 1);
  const std::optional<uint64_t> n_bytes = CheckedMul(number, uint64_t{1} << shift);
  if (!n_bytes) return invalid("more than 2^64 - 1 bytes");
  return *n_bytes;
}

}  // namespace ucpfs::io
