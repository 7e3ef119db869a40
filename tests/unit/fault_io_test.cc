// The read path under injected I/O faults (FileSource's PreadFn): short reads and EINTR are
// retried and give the right bytes; EIO at a random offset fails the whole read with the file,
// the offset and the errno, and a view (an atomic file gathered from two shard files) never
// returns partial data as success. Seeded: UCPFS_TEST_SEED replays a run.
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include <gtest/gtest.h>
#include <unistd.h>

#include "core/io/file_source.h"
#include "core/views/atomic.h"
#include "test_seed.h"

namespace ucpfs {
namespace {

namespace fs = std::filesystem;

// Fault plan shared with the injected pread (a plain function pointer cannot capture).
struct Faults {
  std::mt19937_64 rng{1};
  double p_eintr = 0;
  double p_short = 0;
  off_t eio_from = -1;  // >= 0: any read that reaches this offset fails with EIO
  uint64_t injected = 0;
};
Faults g_faults;

ssize_t FaultyPread(int fd, void* buf, size_t n, off_t off) {
  std::uniform_real_distribution<double> u(0, 1);
  if (g_faults.eio_from >= 0 && off + static_cast<off_t>(n) > g_faults.eio_from) {
    ++g_faults.injected;
    errno = EIO;
    return -1;
  }
  if (u(g_faults.rng) < g_faults.p_eintr) {
    ++g_faults.injected;
    errno = EINTR;
    return -1;
  }
  if (n > 1 && u(g_faults.rng) < g_faults.p_short) {
    ++g_faults.injected;
    n = 1 + g_faults.rng() % (n - 1);
  }
  return ::pread(fd, buf, n, off);
}

class FaultIo : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = ucpfs::testing::TestSeed();
    g_faults = Faults{};
    g_faults.rng.seed(seed_);
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

  uint64_t seed_ = 0;
  fs::path dir_;
};

TEST_F(FaultIo, ShortReadsAndEintrAreRetried) {
  std::vector<std::byte> want;
  const std::string path = WriteRandom("a.bin", 1 << 20, &want);
  g_faults.p_eintr = 0.3;
  g_faults.p_short = 0.5;
  auto src = FileSource::Open(path, &FaultyPread);
  ASSERT_TRUE(src.ok()) << src.error().ToString();
  std::mt19937_64 rng(seed_);
  for (int i = 0; i < 300; ++i) {
    const uint64_t off = rng() % want.size();
    const uint64_t n = rng() % (want.size() - off + 1);
    std::vector<std::byte> got(n);
    Status s = (*src)->ReadAt(off, got);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(std::equal(got.begin(), got.end(), want.begin() + static_cast<long>(off))) << off << "+" << n;
  }
  EXPECT_GT(g_faults.injected, 100u);
}

TEST_F(FaultIo, EioFailsTheWholeReadWithTheFileAndOffset) {
  std::vector<std::byte> want;
  const std::string path = WriteRandom("b.bin", 1 << 16, &want);
  std::mt19937_64 rng(seed_);
  for (int i = 0; i < 50; ++i) {
    g_faults.eio_from = static_cast<off_t>(rng() % want.size());
    g_faults.p_short = 0.3;
    auto src = FileSource::Open(path, &FaultyPread);
    ASSERT_TRUE(src.ok());
    std::vector<std::byte> all(want.size());
    Status s = (*src)->ReadAt(0, all);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kIo);
    EXPECT_EQ(s.sys_errno(), EIO);
    EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("offset"), std::string::npos) << s.message();
    // A range before the fault still reads.
    std::vector<std::byte> head(static_cast<size_t>(g_faults.eio_from));
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
  auto build = [&](PreadFn fn) {
    auto files = std::make_shared<std::vector<std::shared_ptr<const ByteSource>>>();
    files->push_back(*FileSource::Open(pa, fn));
    files->push_back(*FileSource::Open(pb, fn));
    return *views::BuildAtomicFile(layout, {}, files, "atomic/w/fp32.pt");
  };
  auto clean = build(nullptr);
  std::vector<std::byte> want(clean->Size());
  ASSERT_TRUE(clean->ReadAt(0, want).ok());

  g_faults.p_eintr = 0.2;
  g_faults.p_short = 0.4;
  auto flaky = build(&FaultyPread);
  std::vector<std::byte> got(flaky->Size());
  ASSERT_TRUE(flaky->ReadAt(0, got).ok());
  EXPECT_EQ(got, want);

  g_faults.eio_from = 1000;  // inside both shards' data
  auto broken = build(&FaultyPread);
  std::vector<std::byte> out(broken->Size(), std::byte{0x5A});
  Status s = broken->ReadAt(0, out);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIo) << s.ToString();
  EXPECT_NE(s.message().find("s0.bin"), std::string::npos) << s.message();  // the first error in byte order
}

}  // namespace
}  // namespace ucpfs
