// The read path under injected I/O faults (FileSource reading through the fault engine of
// core/io/io_engine.h): short reads and EINTR are retried and give the right bytes; EIO at a
// random offset fails the whole read with the file, the offset and the errno, and a view (an
// atomic file gathered from two shard files) never returns partial data as success; threads
// sharing one FileSource all read right. Seeded: UCPFS_TEST_SEED replays a run.
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <unistd.h>

#include "core/io/file_source.h"
#include "core/io/io_engine.h"
#include "views/atomic.h"
#include "test_seed.h"

namespace ucpfs {
namespace {

namespace fs = std::filesystem;
using io::Fault;

// FileSource makes one engine per read; they all draw on (and count in) one plan.
io::IoEngineFactory FaultyReads(std::shared_ptr<io::FaultPlan> plan) {
  return [plan] { return io::MakeFaultEngine(io::MakePreadEngine(), plan); };
}

// `n` short-read or EINTR faults (short with probability p_short) at random offsets below
// `n_bytes`, each firing on every read that reaches it.
std::vector<Fault> RandomRetryableFaults(std::mt19937_64& rng, size_t n, uint64_t n_bytes, double p_short) {
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<Fault> faults;
  for (size_t i = 0; i < n; ++i) {
    faults.push_back(Fault{.kind = io::OpKind::kRead, .byte_offset = rng() % n_bytes,
                           .effect = u(rng) < p_short ? Fault::Effect::kShort : Fault::Effect::kEintr,
                           .times = -1});
  }
  return faults;
}

class FaultIo : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = ucpfs::testing::TestSeed();
    dir_ = fs::temp_directory_path() / ("ucpfs_fault_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string WriteRandom(const std::string& name, size_t n, std::vector<std::byte>* bytes) {
    std::mt19937_64 rng(seed_ ^ n);
    bytes->resize(n);
    for (auto& b : *bytes) b = static_cast<std::byte>(rng());
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes->data()),
                                                static_cast<std::streamsize>(n));
    return path;
  }

  // A random file of n_bytes, opened to read through a fault engine with `n_faults` random
  // short-read and EINTR faults (in `plan_`).
  std::shared_ptr<FileSource> OpenFlaky(const std::string& name, size_t n_bytes, size_t n_faults,
                                        std::vector<std::byte>* bytes) {
    const std::string path = WriteRandom(name, n_bytes, bytes);
    std::mt19937_64 rng(seed_ + n_faults);
    plan_ = std::make_shared<io::FaultPlan>(RandomRetryableFaults(rng, n_faults, n_bytes, 0.6));
    auto src = FileSource::Open(path, FaultyReads(plan_));
    EXPECT_TRUE(src.ok()) << src.error().ToString();
    return src.ok() ? *src : nullptr;
  }

  uint64_t seed_ = 0;
  fs::path dir_;
  std::shared_ptr<io::FaultPlan> plan_;
};

TEST_F(FaultIo, ShortReadsAndEintrAreRetried) {
  std::vector<std::byte> want;
  auto src = OpenFlaky("a.bin", 1 << 20, 400, &want);
  ASSERT_NE(src, nullptr);
  std::mt19937_64 rng(seed_);
  for (int i = 0; i < 300; ++i) {
    const uint64_t off = rng() % want.size();
    const uint64_t n = rng() % (want.size() - off + 1);
    std::vector<std::byte> got(n);
    Status s = src->ReadAt(off, got);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(std::equal(got.begin(), got.end(), want.begin() + static_cast<long>(off))) << off << "+" << n;
  }
  EXPECT_GT(plan_->InjectedCount(), 100u);
}

// FUSE threads share one FileSource: each read makes its own engine, all drawing on one plan.
TEST_F(FaultIo, ConcurrentReadersOfOneFileShareOnePlan) {
  std::vector<std::byte> want;
  auto src = OpenFlaky("c.bin", 1 << 18, 200, &want);
  ASSERT_NE(src, nullptr);
  std::atomic<int> bad{0};
  std::vector<std::thread> readers;
  for (uint64_t t = 0; t < 4; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937_64 thread_rng(seed_ + t);
      for (int i = 0; i < 100; ++i) {
        const uint64_t off = thread_rng() % want.size();
        std::vector<std::byte> got(thread_rng() % (want.size() - off + 1));
        if (!src->ReadAt(off, got).ok() ||
            !std::equal(got.begin(), got.end(), want.begin() + static_cast<long>(off))) {
          ++bad;
        }
      }
    });
  }
  for (auto& r : readers) r.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(plan_->InjectedCount(), 100u);
}

TEST_F(FaultIo, EioFailsTheWholeReadWithTheFileAndOffset) {
  std::vector<std::byte> want;
  const std::string path = WriteRandom("b.bin", 1 << 16, &want);
  std::mt19937_64 rng(seed_);
  for (int i = 0; i < 50; ++i) {
    const uint64_t eio_at = rng() % want.size();
    std::vector<Fault> faults = RandomRetryableFaults(rng, 20, want.size(), 1.0);
    faults.push_back(Fault{.kind = io::OpKind::kRead, .byte_offset = eio_at, .effect = Fault::Effect::kError,
                           .sys_errno = EIO, .times = -1});
    auto plan = std::make_shared<io::FaultPlan>(std::move(faults));
    auto src = FileSource::Open(path, FaultyReads(plan));
    ASSERT_TRUE(src.ok());
    std::vector<std::byte> all(want.size());
    Status s = (*src)->ReadAt(0, all);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kIo);
    EXPECT_EQ(s.sys_errno(), EIO);
    EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("offset"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(": pread at offset " + std::to_string(eio_at) + ": "), std::string::npos)
        << s.message();
    // A range before the fault still reads.
    std::vector<std::byte> head(static_cast<size_t>(eio_at));
    ASSERT_TRUE((*src)->ReadAt(0, head).ok());
    EXPECT_TRUE(std::equal(head.begin(), head.end(), want.begin()));
  }
}

TEST_F(FaultIo, AViewNeverServesPartialData) {
  // A [64, 32] float32 tensor stored as two row shards in two files.
  std::vector<std::byte> a, b;
  const std::string pa = WriteRandom("s0.bin", 32 * 32 * 4, &a);
  const std::string pb = WriteRandom("s1.bin", 32 * 32 * 4, &b);
  auto layout = std::make_shared<slice::TensorLayout>();
  layout->shape = {64, 32};
  for (int s = 0; s < 2; ++s) {
    slice::Fragment f;
    f.box.offsets = {32 * s, 0};
    f.box.sizes = {32, 32};
    f.flat_hi = 32 * 32;
    f.file_id = static_cast<uint32_t>(s);
    layout->fragments.push_back(f);
  }
  auto build = [&](io::IoEngineFactory make_engine) {
    auto files = std::make_shared<std::vector<std::shared_ptr<const ByteSource>>>();
    files->push_back(*FileSource::Open(pa, make_engine));
    files->push_back(*FileSource::Open(pb, make_engine));
    return *views::BuildAtomicFile(layout, {}, files, "atomic/w/fp32.pt");
  };
  auto clean = build({});
  std::vector<std::byte> want(clean->Size());
  ASSERT_TRUE(clean->ReadAt(0, want).ok());

  std::mt19937_64 rng(seed_);
  std::vector<Fault> faults = RandomRetryableFaults(rng, 40, a.size(), 0.67);
  auto flaky_plan = std::make_shared<io::FaultPlan>(faults);
  auto flaky = build(FaultyReads(flaky_plan));
  std::vector<std::byte> got(flaky->Size());
  ASSERT_TRUE(flaky->ReadAt(0, got).ok());
  EXPECT_EQ(got, want);
  EXPECT_GT(flaky_plan->InjectedCount(), 0u);

  faults.push_back(Fault{.kind = io::OpKind::kRead, .byte_offset = 1000,  // inside both shards' data
                         .effect = Fault::Effect::kError, .sys_errno = EIO, .times = -1});
  auto broken = build(FaultyReads(std::make_shared<io::FaultPlan>(faults)));
  std::vector<std::byte> out(broken->Size(), std::byte{0x5A});
  Status s = broken->ReadAt(0, out);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIo) << s.ToString();
  EXPECT_NE(s.message().find("s0.bin"), std::string::npos) << s.message();  // the first error in byte order
}

}  // namespace
}  // namespace ucpfs
