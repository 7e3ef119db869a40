// Materializer (the --materialize cache): a copy holds the view's bytes and is reused; another
// tree (generation) never meets an old copy; least recently opened out within the size; a view
// larger than the cache is refused; a symlink or another user's directory is refused; the
// directory is made 0700 and an earlier daemon's copies are removed.
#include "fs/materialize.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace ucpfs::fs {
namespace {

std::string TempDir() {
  char tmpl[] = "/tmp/ucpfs-materialize-test-XXXXXX";
  return mkdtemp(tmpl);
}

// A temporary directory removed at the end of the test.
struct Scratch {
  std::string path = TempDir();
  ~Scratch() { std::filesystem::remove_all(path); }
};

MemorySource Bytes(const std::string& name, size_t n, unsigned char seed) {
  std::vector<std::byte> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = std::byte(static_cast<unsigned char>(seed + i * 7));
  return MemorySource(name, std::move(b));
}

std::vector<std::byte> ReadAll(int fd) {
  std::vector<std::byte> out;
  std::byte buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  close(fd);
  return out;
}

std::vector<std::byte> Want(const ByteSource& s) {
  std::vector<std::byte> b(s.Size());
  EXPECT_TRUE(s.ReadAt(0, b).ok());
  return b;
}

// A node owned by a "tree": the aliasing pointer a Filesystem hands out.
std::shared_ptr<const void> NodeOf(const std::shared_ptr<std::vector<int>>& tree, size_t i) {
  return std::shared_ptr<const void>(tree, &(*tree)[i]);
}

TEST(Materializer, CopiesOnceAndReusesWithinATree) {
  Scratch scratch;
  const std::string dir = scratch.path + "/cache";
  auto m = Materializer::Make(dir, 1 << 20);
  ASSERT_TRUE(m.ok()) << m.error().ToString();
  struct stat st = {};
  ASSERT_EQ(stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  auto tree = std::make_shared<std::vector<int>>(4);
  const MemorySource a = Bytes("a", 100000, 1);
  for (int i = 0; i < 3; ++i) {
    Result<int> fd = (*m)->Open(NodeOf(tree, 0), a);
    ASSERT_TRUE(fd.ok()) << fd.error().ToString();
    EXPECT_EQ(ReadAll(*fd), Want(a));
  }
  const auto s = (*m)->Stats();
  EXPECT_EQ(s["builds"], 1u);
  EXPECT_EQ(s["hits"], 2u);
  EXPECT_EQ(s["bytes"], 100000u);
}

TEST(Materializer, AnotherTreeNeverMeetsAnOldCopy) {
  Scratch scratch;
  auto m = Materializer::Make(scratch.path + "/c", 1 << 20);
  ASSERT_TRUE(m.ok());
  const MemorySource old_bytes = Bytes("v", 5000, 1), new_bytes = Bytes("v", 5000, 2);
  auto gen1 = std::make_shared<std::vector<int>>(1);
  ASSERT_EQ(ReadAll(*(*m)->Open(NodeOf(gen1, 0), old_bytes)), Want(old_bytes));
  // A new generation (another tree), even at the same address once the old one is gone.
  gen1.reset();
  auto gen2 = std::make_shared<std::vector<int>>(1);
  EXPECT_EQ(ReadAll(*(*m)->Open(NodeOf(gen2, 0), new_bytes)), Want(new_bytes));
  EXPECT_EQ((*m)->Stats()["builds"], 2u);
  EXPECT_EQ((*m)->Stats()["hits"], 0u);
}

TEST(Materializer, LeastRecentlyOpenedGoFirstWithinTheSize) {
  Scratch scratch;
  auto m = Materializer::Make(scratch.path + "/c", 25000);
  ASSERT_TRUE(m.ok());
  auto tree = std::make_shared<std::vector<int>>(4);
  const MemorySource a = Bytes("a", 10000, 1), b = Bytes("b", 10000, 2), c = Bytes("c", 10000, 3);
  ASSERT_TRUE((*m)->Open(NodeOf(tree, 0), a).ok());
  ASSERT_TRUE((*m)->Open(NodeOf(tree, 1), b).ok());
  ASSERT_TRUE((*m)->Open(NodeOf(tree, 0), a).ok());  // a is now the most recent
  ASSERT_TRUE((*m)->Open(NodeOf(tree, 2), c).ok());  // b goes
  auto s = (*m)->Stats();
  EXPECT_EQ(s["evictions"], 1u);
  EXPECT_EQ(s["files"], 2u);
  EXPECT_LE(s["bytes"].get<uint64_t>(), 25000u);
  EXPECT_EQ(ReadAll(*(*m)->Open(NodeOf(tree, 0), a)), Want(a));  // still there
  EXPECT_EQ((*m)->Stats()["builds"], 3u);
  EXPECT_EQ(ReadAll(*(*m)->Open(NodeOf(tree, 1), b)), Want(b));  // computed again
  EXPECT_EQ((*m)->Stats()["builds"], 4u);
  const MemorySource big = Bytes("big", 30000, 4);
  Result<int> too_big = (*m)->Open(NodeOf(tree, 3), big);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.error().code(), StatusCode::kUnsupported);
}

TEST(Materializer, RefusesASymlinkAndRemovesAnEarlierDaemonsCopies) {
  Scratch scratch;
  const std::string base = scratch.path;
  ASSERT_EQ(mkdir((base + "/real").c_str(), 0755), 0);
  ASSERT_EQ(symlink("real", (base + "/link").c_str()), 0);
  auto refused = Materializer::Make(base + "/link", 1 << 20);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("/link"), std::string::npos) << refused.error().ToString();
  EXPECT_FALSE(Materializer::Make(base + "/real", 0).ok());
  // Leftovers of an earlier daemon go; other files stay.
  for (const char* name : {"/real/ucpfs-view-1-0", "/real/other"}) {
    const int fd = open((base + name).c_str(), O_CREAT | O_WRONLY, 0600);
    ASSERT_GE(fd, 0);
    close(fd);
  }
  auto m = Materializer::Make(base + "/real", 1 << 20);
  ASSERT_TRUE(m.ok());
  EXPECT_FALSE(std::filesystem::exists(base + "/real/ucpfs-view-1-0"));
  EXPECT_TRUE(std::filesystem::exists(base + "/real/other"));
  if (geteuid() == 0) {
    ASSERT_EQ(mkdir((base + "/theirs").c_str(), 0700), 0);
    ASSERT_EQ(chown((base + "/theirs").c_str(), 65534, 65534), 0);
    EXPECT_FALSE(Materializer::Make(base + "/theirs", 1 << 20).ok());
  }
}

}  // namespace
}  // namespace ucpfs::fs
