// PinnedCache: sizes and their refusals; chunks aligned, distinct, non-overlapping and equal to
// Regions(); back-pressure and Shutdown with real blocked threads; double and foreign releases
// refused without corrupting the pool; a seeded multi-thread stress test in which no chunk is
// ever held twice; the memory is locked (VmLck grows) when it can be, and the unlocked fallback,
// forced in a child without CAP_IPC_LOCK under a small RLIMIT_MEMLOCK, warns and still works;
// an O_DIRECT write and read of chunks; ParseByteSize.
#include "core/io/pinned_cache.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/io/cuda_host.h"
#include "tests/unit/test_seed.h"

namespace ucpfs::io {
namespace {

constexpr size_t kChunk = size_t{64} << 10;

PinnedCacheOptions SmallOptions(size_t n_chunks) {
  PinnedCacheOptions o;
  o.capacity_bytes = n_chunks * kChunk;
  o.chunk_bytes = kChunk;
  return o;
}

std::unique_ptr<PinnedCache> MakeOrDie(const PinnedCacheOptions& options) {
  auto cache = PinnedCache::Make(options);
  if (!cache.ok()) {
    ADD_FAILURE() << cache.error().ToString();
    return nullptr;
  }
  return std::move(cache).value();
}

// Fills a chunk with 64-bit words derived from `tag`, and checks it back.
void FillPattern(const Chunk& c, size_t n_bytes, uint64_t tag) {
  for (size_t i = 0; i < n_bytes / 8; ++i) {
    const uint64_t word = tag * 0x9e3779b97f4a7c15ULL + i;
    std::memcpy(c.data + i * 8, &word, 8);
  }
}
bool HasPattern(const Chunk& c, size_t n_bytes, uint64_t tag) {
  for (size_t i = 0; i < n_bytes / 8; ++i) {
    uint64_t word;
    std::memcpy(&word, c.data + i * 8, 8);
    if (word != tag * 0x9e3779b97f4a7c15ULL + i) return false;
  }
  return true;
}

// Waits (bounded) until `n` Acquires are blocked in the cache.
bool WaitForWaiters(const PinnedCache& cache, uint64_t n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (cache.stats().n_waiting != n) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// A field of /proc/self/status in kB ("VmLck"), or -1.
int64_t ProcStatusKb(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::strtoll(line.c_str() + field.size() + 1, nullptr, 10);
  }
  return -1;
}

// Capability sets through the raw syscalls (no libcap in the build).
bool ReadCaps(__user_cap_header_struct* header, __user_cap_data_struct (&data)[2]) {
  *header = {_LINUX_CAPABILITY_VERSION_3, 0};
  return ::syscall(SYS_capget, header, data) == 0;
}
bool HasIpcLock() {
  __user_cap_header_struct header;
  __user_cap_data_struct data[2] = {};
  return ReadCaps(&header, data) && (data[CAP_IPC_LOCK / 32].effective & (1u << (CAP_IPC_LOCK % 32))) != 0;
}
bool DropIpcLock() {
  __user_cap_header_struct header;
  __user_cap_data_struct data[2] = {};
  if (!ReadCaps(&header, data)) return false;
  const uint32_t bit = 1u << (CAP_IPC_LOCK % 32);
  data[CAP_IPC_LOCK / 32].effective &= ~bit;
  data[CAP_IPC_LOCK / 32].permitted &= ~bit;
  data[CAP_IPC_LOCK / 32].inheritable &= ~bit;
  return ::syscall(SYS_capset, &header, data) == 0 && !HasIpcLock();
}

TEST(PinnedCacheTest, CapacityRoundsDownToWholeChunks) {
  PinnedCacheOptions o = SmallOptions(0);
  o.capacity_bytes = 16 * kChunk + kChunk - 1;
  auto cache = MakeOrDie(o);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->n_chunks(), 16u);
  EXPECT_EQ(cache->chunk_bytes(), kChunk);
  EXPECT_EQ(cache->stats().capacity_bytes, 16 * kChunk);
  EXPECT_EQ(cache->stats().used_bytes, 0u);
  EXPECT_EQ(cache->Regions().size(), 16u);
}

TEST(PinnedCacheTest, RefusesBadSizes) {
  struct Case {
    uint64_t capacity_bytes;
    size_t chunk_bytes;
    StatusCode code;
    const char* says;
  };
  const uint64_t huge_chunks = (uint64_t{1} << 32) * kChunk;  // 2^32 chunks: one too many
  const Case cases[] = {
      {1 << 20, 0, StatusCode::kInvalidArgument, "multiple of 4096"},
      {1 << 20, 4095, StatusCode::kInvalidArgument, "multiple of 4096"},
      {1 << 20, kChunk + 1, StatusCode::kInvalidArgument, "multiple of 4096"},
      {1 << 20, 32 << 10, StatusCode::kInvalidArgument, "65536"},        // under 64 KiB
      {uint64_t{4} << 30, (size_t{1} << 30) + 4096, StatusCode::kInvalidArgument, "1 GiB"},
      {0, kChunk, StatusCode::kInvalidArgument, "at least two chunks"},
      {2 * kChunk - 1, kChunk, StatusCode::kInvalidArgument, "at least two chunks"},
      {huge_chunks, kChunk, StatusCode::kInvalidArgument, "over the limit"},
      {uint64_t{1} << 50, size_t{1} << 30, StatusCode::kResourceExhausted, "physical memory"},  // 1 PiB
  };
  for (const Case& c : cases) {
    PinnedCacheOptions o;
    o.capacity_bytes = c.capacity_bytes;
    o.chunk_bytes = c.chunk_bytes;
    auto cache = PinnedCache::Make(o);
    ASSERT_FALSE(cache.ok()) << c.capacity_bytes << " / " << c.chunk_bytes;
    EXPECT_EQ(cache.error().code(), c.code) << cache.error().ToString();
    EXPECT_NE(cache.error().message().find(c.says), std::string::npos) << cache.error().ToString();
  }
  // The smallest valid cache: two chunks of 64 KiB.
  EXPECT_TRUE(PinnedCache::Make(SmallOptions(2)).ok());
}

TEST(PinnedCacheTest, ChunksAlignedDistinctDisjointAndMatchRegions) {
  auto cache = MakeOrDie(SmallOptions(12));
  ASSERT_NE(cache, nullptr);
  const std::vector<iovec> regions = cache->Regions();
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < cache->n_chunks(); ++i) {
    std::optional<Chunk> c = cache->Acquire();  // never waits: chunks are free
    ASSERT_TRUE(c.has_value());
    chunks.push_back(*c);
  }
  EXPECT_EQ(cache->stats().n_blocked, 0u);
  EXPECT_EQ(cache->stats().used_bytes, 12 * kChunk);
  EXPECT_FALSE(cache->TryAcquire().has_value());

  std::vector<bool> seen(cache->n_chunks(), false);
  for (const Chunk& c : chunks) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(c.data) % 4096, 0u) << c.index;
    ASSERT_LT(c.index, cache->n_chunks());
    EXPECT_FALSE(seen[c.index]) << "index handed out twice: " << c.index;
    seen[c.index] = true;
    EXPECT_EQ(regions[c.index].iov_base, c.data);
    EXPECT_EQ(regions[c.index].iov_len, kChunk);
  }
  std::vector<Chunk> by_address = chunks;
  std::sort(by_address.begin(), by_address.end(), [](const Chunk& a, const Chunk& b) { return a.data < b.data; });
  for (size_t i = 1; i < by_address.size(); ++i) {
    EXPECT_LE(by_address[i - 1].data + kChunk, by_address[i].data) << "chunks overlap";
  }
  // Every byte is writable and no chunk's bytes land in another's.
  for (const Chunk& c : chunks) FillPattern(c, kChunk, c.index);
  for (const Chunk& c : chunks) EXPECT_TRUE(HasPattern(c, kChunk, c.index)) << c.index;
  for (const Chunk& c : chunks) ASSERT_TRUE(cache->Release(c).ok());
  EXPECT_EQ(cache->stats().used_bytes, 0u);
}

TEST(PinnedCacheTest, BlockedAcquireIsReleasedByAnotherThreadsRelease) {
  auto cache = MakeOrDie(SmallOptions(2));
  ASSERT_NE(cache, nullptr);
  const Chunk a = *cache->TryAcquire();
  const Chunk b = *cache->TryAcquire();
  ASSERT_FALSE(cache->TryAcquire().has_value());

  std::atomic<bool> returned{false};
  std::optional<Chunk> got;
  std::thread waiter([&] {
    got = cache->Acquire();
    returned = true;
  });
  ASSERT_TRUE(WaitForWaiters(*cache, 1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(returned.load()) << "Acquire returned while every chunk was in use";
  EXPECT_EQ(cache->stats().n_blocked, 1u);

  ASSERT_TRUE(cache->Release(b).ok());
  waiter.join();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->index, b.index);
  EXPECT_EQ(got->data, b.data);
  const PinnedCache::Stats s = cache->stats();
  EXPECT_EQ(s.n_blocked, 1u);
  EXPECT_EQ(s.n_waiting, 0u);
  EXPECT_GE(s.blocked_ns, 20'000'000u);  // it waited through the 20 ms sleep at least
  EXPECT_EQ(s.used_bytes, 2 * kChunk);
  EXPECT_TRUE(cache->Release(a).ok());
  EXPECT_TRUE(cache->Release(*got).ok());
}

TEST(PinnedCacheTest, AcquireForGivesUpAfterItsWaitAndTakesAChunkFreedMeanwhile) {
  auto cache = MakeOrDie(SmallOptions(2));
  ASSERT_NE(cache, nullptr);
  const Chunk a = *cache->TryAcquire();
  const Chunk b = *cache->TryAcquire();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(cache->AcquireFor(std::chrono::milliseconds(30)).has_value());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(30));
  EXPECT_FALSE(cache->shut_down());
  EXPECT_EQ(cache->stats().n_waiting, 0u);
  std::optional<Chunk> got;
  std::thread waiter([&] { got = cache->AcquireFor(std::chrono::seconds(30)); });
  ASSERT_TRUE(WaitForWaiters(*cache, 1));
  ASSERT_TRUE(cache->Release(b).ok());
  waiter.join();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->index, b.index);
  cache->Shutdown();
  EXPECT_TRUE(cache->shut_down());
  EXPECT_FALSE(cache->AcquireFor(std::chrono::seconds(30)).has_value());  // at once
  EXPECT_TRUE(cache->Release(a).ok());
  EXPECT_TRUE(cache->Release(*got).ok());
}

TEST(PinnedCacheTest, ShutdownWakesBlockedAcquires) {
  auto cache = MakeOrDie(SmallOptions(2));
  ASSERT_NE(cache, nullptr);
  const Chunk a = *cache->Acquire();
  const Chunk b = *cache->Acquire();
  std::vector<std::optional<Chunk>> got(3, Chunk{});
  std::vector<std::thread> waiters;
  for (size_t i = 0; i < got.size(); ++i) waiters.emplace_back([&, i] { got[i] = cache->Acquire(); });
  ASSERT_TRUE(WaitForWaiters(*cache, 3));
  cache->Shutdown();
  for (std::thread& t : waiters) t.join();
  for (const auto& g : got) EXPECT_FALSE(g.has_value());
  EXPECT_EQ(cache->stats().n_blocked, 3u);
  EXPECT_EQ(cache->stats().n_waiting, 0u);
  // Release still works; nothing is handed out any more, free chunks or not.
  EXPECT_TRUE(cache->Release(a).ok());
  EXPECT_TRUE(cache->Release(b).ok());
  EXPECT_FALSE(cache->Acquire().has_value());
  EXPECT_FALSE(cache->TryAcquire().has_value());
  EXPECT_EQ(cache->stats().used_bytes, 0u);
}

TEST(PinnedCacheTest, DoubleAndForeignReleasesAreRefusedAndThePoolStaysIntact) {
  auto cache = MakeOrDie(SmallOptions(4));
  auto other = MakeOrDie(SmallOptions(4));
  ASSERT_NE(cache, nullptr);
  ASSERT_NE(other, nullptr);
  const Chunk a = *cache->Acquire();
  const Chunk b = *cache->Acquire();
  ASSERT_EQ(a.index, 0u);  // chunks are handed out from index 0 up while none was released
  ASSERT_EQ(b.index, 1u);
  ASSERT_TRUE(cache->Release(a).ok());

  std::byte outside[16];
  const Chunk refused[] = {
      a,                                        // released twice
      Chunk{a.data + 2 * kChunk, 2},            // a free chunk that was never acquired
      Chunk{b.data, a.index},                   // b's address with a's index
      Chunk{b.data + 1, b.index},               // inside b, not its start
      Chunk{outside, 0},                        // not this cache's memory
      Chunk{nullptr, 0},
      Chunk{a.data, static_cast<uint32_t>(cache->n_chunks())},  // index out of range
      *other->Acquire(),                        // another cache's chunk (index in range)
  };
  for (const Chunk& c : refused) {
    Status s = cache->Release(c);
    EXPECT_EQ(s.code(), StatusCode::kInternal) << c.index << ": " << s.ToString();
  }
  const PinnedCache::Stats s = cache->stats();
  EXPECT_EQ(s.n_bad_releases, std::size(refused));
  EXPECT_EQ(s.used_bytes, kChunk);  // b only

  // Three chunks are free, each handed out once, then none: the refused releases added nothing.
  std::vector<uint32_t> indices = {b.index};
  while (std::optional<Chunk> c = cache->TryAcquire()) indices.push_back(c->index);
  std::sort(indices.begin(), indices.end());
  EXPECT_EQ(indices, (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(cache->stats().used_bytes, 4 * kChunk);
}

TEST(PinnedCacheTest, SeededStressNoChunkHeldTwice) {
  const uint64_t seed = ucpfs::testing::TestSeed();
  constexpr size_t kChunks = 4;
  constexpr int kThreads = 8;
  constexpr int kRounds = 200;
  auto cache = MakeOrDie(SmallOptions(kChunks));
  ASSERT_NE(cache, nullptr);
  std::vector<std::atomic<int>> holder(kChunks);
  for (auto& h : holder) h = -1;
  std::atomic<int> n_double_holds{0}, n_corrupted{0}, n_bad_status{0}, n_acquired{0};

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + static_cast<uint64_t>(t));
      for (int round = 0; round < kRounds; ++round) {
        const bool try_only = rng() % 4 == 0;
        std::optional<Chunk> c = try_only ? cache->TryAcquire() : cache->Acquire();
        if (!c) continue;  // TryAcquire found none
        ++n_acquired;
        int expected = -1;
        if (!holder[c->index].compare_exchange_strong(expected, t)) ++n_double_holds;
        const uint64_t tag = (static_cast<uint64_t>(t) << 32) | static_cast<uint64_t>(round);
        FillPattern(*c, kChunk, tag);
        for (uint64_t i = rng() % 4; i > 0; --i) std::this_thread::yield();
        if (!HasPattern(*c, kChunk, tag)) ++n_corrupted;
        expected = t;
        if (!holder[c->index].compare_exchange_strong(expected, -1)) ++n_double_holds;
        if (!cache->Release(*c).ok()) ++n_bad_status;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(n_double_holds.load(), 0);
  EXPECT_EQ(n_corrupted.load(), 0);
  EXPECT_EQ(n_bad_status.load(), 0);
  EXPECT_GT(n_acquired.load(), kThreads * kRounds / 2);  // at least every Acquire (3/4 of rounds)
  const PinnedCache::Stats s = cache->stats();
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.n_waiting, 0u);
  EXPECT_EQ(s.n_bad_releases, 0u);
  // The free list came through intact: every chunk exactly once.
  std::vector<uint32_t> indices;
  while (std::optional<Chunk> c = cache->TryAcquire()) indices.push_back(c->index);
  std::sort(indices.begin(), indices.end());
  EXPECT_EQ(indices, (std::vector<uint32_t>{0, 1, 2, 3}));
}

TEST(PinnedCacheTest, LockOnFirstUseLocksEachChunkWhenFirstHandedOut) {
  if (!HasIpcLock()) GTEST_SKIP() << "needs CAP_IPC_LOCK to see chunks locked";
  PinnedCacheOptions o = SmallOptions(16);
  o.allow_cuda = false;
  o.lock_on_first_use = true;
  const int64_t before_kb = ProcStatusKb("VmLck");
  auto cache = MakeOrDie(o);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->kind(), PinnedMemoryKind::kLocked);
  EXPECT_EQ(ProcStatusKb("VmLck"), before_kb);  // nothing locked (nor faulted in) yet
  const int64_t chunk_kb = static_cast<int64_t>(cache->chunk_bytes() / 1024);
  std::optional<Chunk> a = cache->Acquire();
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(ProcStatusKb("VmLck") - before_kb, chunk_kb);
  std::memset(a->data, 0x5a, cache->chunk_bytes());  // writable, locked memory
  ASSERT_TRUE(cache->Release(*a).ok());
  std::optional<Chunk> again = cache->Acquire();  // LIFO: the same chunk, locked already
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->index, a->index);
  EXPECT_EQ(ProcStatusKb("VmLck") - before_kb, chunk_kb);
  std::optional<Chunk> b = cache->TryAcquire();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(ProcStatusKb("VmLck") - before_kb, 2 * chunk_kb);
  ASSERT_TRUE(cache->Release(*again).ok());
  ASSERT_TRUE(cache->Release(*b).ok());
  cache.reset();
  EXPECT_EQ(ProcStatusKb("VmLck"), before_kb);
}

TEST(PinnedCacheTest, MemoryIsLockedWhenItCanBe) {
  // The kind this process must get: CUDA host memory with a GPU, else locked memory when the
  // process may lock it (CAP_IPC_LOCK, or a large enough RLIMIT_MEMLOCK), else unlocked.
  PinnedCacheOptions o = SmallOptions(16);
  std::vector<std::string> warnings;
  o.warn = [&warnings](const std::string& line) { warnings.push_back(line); };
  struct rlimit lim;
  ASSERT_EQ(::getrlimit(RLIMIT_MEMLOCK, &lim), 0);
  const int64_t locked_before_kb = ProcStatusKb("VmLck");
  const bool may_lock = HasIpcLock() || lim.rlim_cur == RLIM_INFINITY ||
                        lim.rlim_cur >= o.capacity_bytes + static_cast<uint64_t>(locked_before_kb) * 1024;
  const PinnedMemoryKind expected = CudaDeviceCount() > 0 ? PinnedMemoryKind::kCudaHost
                                    : may_lock            ? PinnedMemoryKind::kLocked
                                                          : PinnedMemoryKind::kUnlocked;
  auto cache = MakeOrDie(o);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->kind(), expected) << PinnedMemoryKindName(cache->kind()) << " (cuda built: " << CudaBuilt()
                                     << ", devices: " << CudaDeviceCount() << ")";
  EXPECT_EQ(warnings.size(), expected == PinnedMemoryKind::kUnlocked ? 1u : 0u);
  if (cache->kind() == PinnedMemoryKind::kLocked) {
    // The kernel agrees: the whole capacity is locked while the cache lives, and no more after.
    EXPECT_GE(ProcStatusKb("VmLck") - locked_before_kb, static_cast<int64_t>(o.capacity_bytes / 1024));
    cache.reset();
    EXPECT_EQ(ProcStatusKb("VmLck"), locked_before_kb);
  }

  // allow_cuda=false never gives CUDA host memory.
  o.allow_cuda = false;
  auto host = MakeOrDie(o);
  ASSERT_NE(host, nullptr);
  EXPECT_NE(host->kind(), PinnedMemoryKind::kCudaHost);
}

// In a child process (a death test's fork): drops CAP_IPC_LOCK, lowers RLIMIT_MEMLOCK to
// `limit_bytes`, and checks Make falls back to unlocked memory with one warning naming the
// errno text and the limit, and that the cache works. Returns "" or what went wrong.
std::string UnlockedFallbackInChild(rlim_t limit_bytes, int expected_errno) {
  if (!DropIpcLock()) return std::string("could not drop CAP_IPC_LOCK: ") + std::strerror(errno);
  const struct rlimit lim = {limit_bytes, limit_bytes};
  if (::setrlimit(RLIMIT_MEMLOCK, &lim) != 0) return std::string("setrlimit: ") + std::strerror(errno);
  PinnedCacheOptions o = SmallOptions(16);
  o.allow_cuda = false;
  std::vector<std::string> warnings;
  o.warn = [&warnings](const std::string& line) { warnings.push_back(line); };
  auto made = PinnedCache::Make(o);
  if (!made.ok()) return "Make failed: " + made.error().ToString();
  PinnedCache& cache = **made;
  if (cache.kind() != PinnedMemoryKind::kUnlocked) return std::string("kind ") + PinnedMemoryKindName(cache.kind());
  if (warnings.size() != 1) return "expected one warning, got " + std::to_string(warnings.size());
  const std::string& w = warnings[0];
  for (const std::string& needle : {std::string("mlock"), std::string(std::strerror(expected_errno)),
                                    "RLIMIT_MEMLOCK " + std::to_string(limit_bytes) + " bytes", std::string("unlocked")}) {
    if (w.find(needle) == std::string::npos) return "warning '" + w + "' lacks '" + needle + "'";
  }
  if (ProcStatusKb("VmLck") != 0) return "VmLck is " + std::to_string(ProcStatusKb("VmLck")) + " kB, expected 0";
  std::vector<Chunk> chunks;
  while (std::optional<Chunk> c = cache.TryAcquire()) chunks.push_back(*c);
  if (chunks.size() != 16) return "acquired " + std::to_string(chunks.size()) + " chunks, expected 16";
  for (const Chunk& c : chunks) FillPattern(c, kChunk, c.index + 7);
  for (const Chunk& c : chunks) {
    if (!HasPattern(c, kChunk, c.index + 7)) return "chunk " + std::to_string(c.index) + " lost its bytes";
    if (!cache.Release(c).ok()) return "release failed";
  }
  std::fprintf(stderr, "fallback warning: %s\n", w.c_str());
  return "";
}

TEST(PinnedCacheDeathTest, UnlockedFallbackWhenMlockIsRefused) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // RLIMIT_MEMLOCK 0 -> EPERM; a nonzero limit under the capacity -> ENOMEM.
  const std::pair<rlim_t, int> cases[] = {{0, EPERM}, {64 << 10, ENOMEM}};
  for (const auto& [limit_bytes, expected_errno] : cases) {
    EXPECT_EXIT(
        {
          const std::string problem = UnlockedFallbackInChild(limit_bytes, expected_errno);
          if (!problem.empty()) std::fprintf(stderr, "child: %s\n", problem.c_str());
          std::exit(problem.empty() ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "fallback warning: pinned cache: mlock of 1048576 bytes refused")
        << "RLIMIT_MEMLOCK " << limit_bytes;
  }
}

TEST(PinnedCacheTest, ODirectWriteAndReadOfChunks) {
  auto cache = MakeOrDie(SmallOptions(4));
  ASSERT_NE(cache, nullptr);
  const char* tmp = std::getenv("TMPDIR");
  std::string dir_template = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/ucpfs_pinned_XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template.data()), nullptr) << std::strerror(errno);
  const std::string path = dir_template + "/chunks.bin";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EINVAL) {
    ::rmdir(dir_template.c_str());
    GTEST_SKIP() << "the filesystem of " << dir_template << " does not support O_DIRECT";
  }
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);

  const Chunk a = *cache->Acquire();
  const Chunk b = *cache->Acquire();
  FillPattern(a, kChunk, 11);
  FillPattern(b, kChunk, 22);
  EXPECT_EQ(::pwrite(fd, a.data, kChunk, 0), static_cast<ssize_t>(kChunk)) << std::strerror(errno);
  EXPECT_EQ(::pwrite(fd, b.data, kChunk, static_cast<off_t>(kChunk)), static_cast<ssize_t>(kChunk))
      << std::strerror(errno);
  // Read back, also with O_DIRECT, into the other chunks.
  const Chunk c = *cache->Acquire();
  const Chunk d = *cache->Acquire();
  EXPECT_EQ(::pread(fd, c.data, kChunk, 0), static_cast<ssize_t>(kChunk)) << std::strerror(errno);
  EXPECT_EQ(::pread(fd, d.data, kChunk, static_cast<off_t>(kChunk)), static_cast<ssize_t>(kChunk))
      << std::strerror(errno);
  EXPECT_TRUE(HasPattern(c, kChunk, 11));
  EXPECT_TRUE(HasPattern(d, kChunk, 22));
  ::close(fd);
  ::unlink(path.c_str());
  ::rmdir(dir_template.c_str());
}

TEST(ParseByteSizeTest, AcceptsNumbersAndBinaryUnits) {
  const std::pair<const char*, uint64_t> cases[] = {
      {"0", 0},
      {"1048576", 1048576},
      {"4096B", 4096},
      {"4G", uint64_t{4} << 30},
      {"4g", uint64_t{4} << 30},
      {"512M", uint64_t{512} << 20},
      {"1536MiB", uint64_t{1536} << 20},
      {"2GiB", uint64_t{2} << 30},
      {"2gib", uint64_t{2} << 30},
      {"8Ki", 8192},
      {"3T", uint64_t{3} << 40},
      {"1P", uint64_t{1} << 50},
      {"15E", uint64_t{15} << 60},
      {"18446744073709551615", UINT64_MAX},
  };
  for (const auto& [text, n_bytes] : cases) {
    auto r = ParseByteSize(text);
    ASSERT_TRUE(r.ok()) << text << ": " << r.error().ToString();
    EXPECT_EQ(*r, n_bytes) << text;
  }
}

TEST(ParseByteSizeTest, RefusesGarbageAmbiguityAndOverflow) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "whole number"},
      {"G", "whole number"},
      {"-1", "whole number"},
      {"+1", "whole number"},
      {" 1", "whole number"},
      {"1 ", "unknown unit"},
      {"1.5G", "whole numbers only"},
      {"4X", "unknown unit"},
      {"4Gi B", "unknown unit"},
      {"4GiBs", "unknown unit"},
      {"4GB", "ambiguous"},
      {"4kb", "ambiguous"},
      {"0x10", "unknown unit"},
      {"1e9", "unknown unit"},
      {"16E", "more than 2^64"},
      {"18446744073709551616", "more than 2^64"},
      {"99999999999999999999999G", "more than 2^64"},
  };
  for (const auto& [text, says] : cases) {
    auto r = ParseByteSize(text);
    ASSERT_FALSE(r.ok()) << "'" << text << "' parsed as " << *r;
    EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.error().message().find(says), std::string::npos) << r.error().ToString();
    EXPECT_NE(r.error().message().find("'" + std::string(text) + "'"), std::string::npos) << r.error().ToString();
  }
  // An embedded NUL is not a unit.
  EXPECT_FALSE(ParseByteSize(std::string("4\0G", 3)).ok());
}

TEST(PinnedCacheTest, KindNames) {
  EXPECT_STREQ(PinnedMemoryKindName(PinnedMemoryKind::kCudaHost), "cuda_host");
  EXPECT_STREQ(PinnedMemoryKindName(PinnedMemoryKind::kLocked), "mlock");
  EXPECT_STREQ(PinnedMemoryKindName(PinnedMemoryKind::kUnlocked), "unlocked");
}

}  // namespace
}  // namespace ucpfs::io
