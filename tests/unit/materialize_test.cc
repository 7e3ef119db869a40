// Materializer (the --materialize cache): the first open answers "not yet" and queues one build
// (behind the caller); the copy then holds the view's bytes and is reused; another tree
// (generation) never meets an old copy, and a build whose tree went is dropped; least recently
// opened out within the size; builds wait for a gap in the daemon's reads; a view larger than the cache is refused; a symlink or another
// user's directory is refused; the directory is made 0700 and an earlier daemon's copies are
// removed.
#include "fs/materialize.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <thread>
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

std::shared_ptr<const ByteSource> Bytes(const std::string& name, size_t n, unsigned char seed) {
  std::vector<std::byte> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = std::byte(static_cast<unsigned char>(seed + i * 7));
  return std::make_shared<MemorySource>(name, std::move(b));
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

std::vector<std::byte> Want(const std::shared_ptr<const ByteSource>& s) {
  std::vector<std::byte> b(s->Size());
  EXPECT_TRUE(s->ReadAt(0, b).ok());
  return b;
}

// A node owned by a "tree": the aliasing pointer a Filesystem hands out.
std::shared_ptr<const void> NodeOf(const std::shared_ptr<std::vector<int>>& tree, size_t i) {
  return std::shared_ptr<const void>(tree, &(*tree)[i]);
}

// An open once the copy is built: the first open answers -1 (the caller serves it) and queues
// the build; the next one, after the builds, gets the copy.
Result<int> OpenBuilt(Materializer& m, const std::shared_ptr<const void>& node,
                      const std::shared_ptr<const ByteSource>& source) {
  Result<int> fd = m.Open(node, source);
  if (!fd.ok() || *fd >= 0) return fd;
  m.WaitIdle();
  return m.Open(node, source);
}

TEST(Materializer, CopiesOnceAndReusesWithinATree) {
  Scratch scratch;
  const std::string dir = scratch.path + "/cache";
  auto m = Materializer::Make(dir, 64 << 20);
  ASSERT_TRUE(m.ok()) << m.error().ToString();
  struct stat st = {};
  ASSERT_EQ(stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  auto tree = std::make_shared<std::vector<int>>(4);
  const auto a = Bytes("a", 20u << 20, 1);  // more than one chunk
  // Opens before the copy is built are the caller's, and queue one build, not one each: only
  // the first says it queued it.
  for (int i = 0; i < 2; ++i) {
    bool queued = i != 0;  // the opposite of what Open must say: it sets it either way
    Result<int> fd = (*m)->Open(NodeOf(tree, 0), a, &queued);
    ASSERT_TRUE(fd.ok()) << fd.error().ToString();
    EXPECT_EQ(*fd, -1);
    EXPECT_EQ(queued, i == 0) << i;
  }
  (*m)->WaitIdle();
  EXPECT_EQ((*m)->Stats()["queued"], 0u);
  for (int i = 0; i < 3; ++i) {
    bool queued = true;
    Result<int> fd = (*m)->Open(NodeOf(tree, 0), a, &queued);
    ASSERT_TRUE(fd.ok()) << fd.error().ToString();
    ASSERT_GE(*fd, 0);
    EXPECT_FALSE(queued);
    EXPECT_EQ(ReadAll(*fd), Want(a));
  }
  const auto s = (*m)->Stats();
  EXPECT_EQ(s["builds"], 1u);
  EXPECT_EQ(s["misses"], 2u);
  EXPECT_EQ(s["hits"], 3u);
  EXPECT_EQ(s["bytes"], 20u << 20);
  EXPECT_EQ(s["failures"], 0u);
}

// A source whose reads wait until the test opens the gate: holds the builder inside a build.
class GatedSource final : public ByteSource {
 public:
  GatedSource(std::shared_ptr<const ByteSource> base, std::shared_future<void> gate)
      : base_(std::move(base)), gate_(std::move(gate)) {}
  uint64_t Size() const override { return base_->Size(); }
  const std::string& Name() const override { return base_->Name(); }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override {
    gate_.wait();
    return base_->ReadAt(byte_offset, out);
  }

 private:
  std::shared_ptr<const ByteSource> base_;
  std::shared_future<void> gate_;
};

// A cache in a scratch directory with `n` views of `tree` queued, each 1 MiB, whose reads wait
// at one gate: the first is held inside its build, the rest wait behind it.
struct GatedQueue {
  explicit GatedQueue(const std::shared_ptr<std::vector<int>>& tree, size_t n) {
    auto made = Materializer::Make(dir, 1 << 30);
    EXPECT_TRUE(made.ok());
    m = std::move(*made);
    for (size_t i = 0; i < n; ++i) {
      sources.push_back(std::make_shared<GatedSource>(Bytes("v" + std::to_string(i), 1u << 20,
                                                            static_cast<unsigned char>(i)), gate));
      EXPECT_EQ(*m->Open(NodeOf(tree, i), sources.back()), -1);
    }
  }
  Scratch scratch;
  const std::string dir = scratch.path + "/c";
  std::unique_ptr<Materializer> m;  // before the gate: a gate never opened breaks at its end
  std::promise<void> open_gate;     // first, and the builder held there can be joined
  const std::shared_future<void> gate = open_gate.get_future().share();
  std::vector<std::shared_ptr<const ByteSource>> sources;
};

TEST(Materializer, ABuildWhoseTreeWentIsDropped) {
  // Views queued behind one being built (held at its read); then their tree goes.
  auto tree = std::make_shared<std::vector<int>>(8);
  GatedQueue q(tree, 8);
  auto& m = q.m;
  const std::string& dir = q.dir;
  auto& open_gate = q.open_gate;
  auto& sources = q.sources;
  EXPECT_EQ(m->Stats()["queued"], 8u);
  tree.reset();
  open_gate.set_value();
  m->WaitIdle();
  const auto s = m->Stats();
  EXPECT_EQ(s["builds"], 0u);  // the one running finished, but its tree was gone: not offered
  EXPECT_EQ(s["files"], 0u);
  EXPECT_EQ(s["bytes"], 0u);
  EXPECT_EQ(s["failures"], 0u);
  EXPECT_TRUE(std::filesystem::is_empty(dir));  // nothing half built or unreachable is left
  auto tree2 = std::make_shared<std::vector<int>>(1);
  EXPECT_EQ(ReadAll(*OpenBuilt(*m, NodeOf(tree2, 0), sources[0])), Want(sources[0]));
}

TEST(Materializer, StopDropsTheQueueAndQueuesNothingMore) {
  auto tree = std::make_shared<std::vector<int>>(4);
  GatedQueue q(tree, 3);
  auto& m = q.m;
  std::thread stopper([&] { m->Stop(); });  // waits for the build held at the gate
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  q.open_gate.set_value();
  stopper.join();
  const auto s = m->Stats();
  EXPECT_EQ(s["queued"], 0u);
  EXPECT_LE(s["builds"].get<uint64_t>(), 1u);  // at most the one running, finished whole
  EXPECT_EQ(*m->Open(NodeOf(tree, 3), Bytes("w", 100, 2)), -1);
  EXPECT_EQ(m->Stats()["queued"], 0u);
  for (const auto& e : std::filesystem::directory_iterator(q.dir)) EXPECT_EQ(e.file_size(), 1u << 20) << e.path();
}

TEST(Materializer, BuildsWaitForAGapInTheDaemonsReads) {
  Scratch scratch;
  auto m = Materializer::Make(scratch.path + "/c", 1 << 20);
  ASSERT_TRUE(m.ok());
  auto tree = std::make_shared<std::vector<int>>(1);
  const auto a = Bytes("a", 1000, 1);
  (*m)->NoteForegroundRead();
  ASSERT_EQ(*(*m)->Open(NodeOf(tree, 0), a), -1);
  // While reads keep coming (every 2 ms, well inside the quiet time), nothing is built.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  while (std::chrono::steady_clock::now() < until) {
    (*m)->NoteForegroundRead();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ((*m)->Stats()["builds"], 0u);
  EXPECT_EQ((*m)->Stats()["queued"], 1u);
  (*m)->WaitIdle();  // the reads stopped: built
  EXPECT_EQ(ReadAll(*(*m)->Open(NodeOf(tree, 0), a)), Want(a));
}

TEST(Materializer, AnotherTreeNeverMeetsAnOldCopy) {
  Scratch scratch;
  auto m = Materializer::Make(scratch.path + "/c", 1 << 20);
  ASSERT_TRUE(m.ok());
  const auto old_bytes = Bytes("v", 5000, 1), new_bytes = Bytes("v", 5000, 2);
  auto gen1 = std::make_shared<std::vector<int>>(1);
  ASSERT_EQ(ReadAll(*OpenBuilt(**m, NodeOf(gen1, 0), old_bytes)), Want(old_bytes));
  // A new generation (another tree), even at the same address once the old one is gone.
  gen1.reset();
  auto gen2 = std::make_shared<std::vector<int>>(1);
  EXPECT_EQ(*(*m)->Open(NodeOf(gen2, 0), new_bytes), -1);  // a miss: built anew
  (*m)->WaitIdle();
  EXPECT_EQ(ReadAll(*(*m)->Open(NodeOf(gen2, 0), new_bytes)), Want(new_bytes));
  EXPECT_EQ((*m)->Stats()["builds"], 2u);
  EXPECT_EQ((*m)->Stats()["misses"], 2u);
  EXPECT_EQ((*m)->Stats()["hits"], 2u);  // each generation's own copy, once built
}

TEST(Materializer, LeastRecentlyOpenedGoFirstWithinTheSize) {
  Scratch scratch;
  auto m = Materializer::Make(scratch.path + "/c", 25000);
  ASSERT_TRUE(m.ok());
  auto tree = std::make_shared<std::vector<int>>(4);
  const auto a = Bytes("a", 10000, 1), b = Bytes("b", 10000, 2), c = Bytes("c", 10000, 3);
  ASSERT_GE(*OpenBuilt(**m, NodeOf(tree, 0), a), 0);
  ASSERT_GE(*OpenBuilt(**m, NodeOf(tree, 1), b), 0);
  ASSERT_GE(*(*m)->Open(NodeOf(tree, 0), a), 0);  // a is now the most recent
  ASSERT_GE(*OpenBuilt(**m, NodeOf(tree, 2), c), 0);  // b goes
  auto s = (*m)->Stats();
  EXPECT_EQ(s["evictions"], 1u);
  EXPECT_EQ(s["files"], 2u);
  EXPECT_LE(s["bytes"].get<uint64_t>(), 25000u);
  EXPECT_EQ(ReadAll(*(*m)->Open(NodeOf(tree, 0), a)), Want(a));  // still there
  EXPECT_EQ((*m)->Stats()["builds"], 3u);
  EXPECT_EQ(ReadAll(*OpenBuilt(**m, NodeOf(tree, 1), b)), Want(b));  // computed again
  EXPECT_EQ((*m)->Stats()["builds"], 4u);
  const auto big = Bytes("big", 30000, 4);
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
