// One conformance suite for every SourceTree (core/io/source_tree.h), run over LocalTree and the
// tests' in-memory tree (memory_tree.h, what an object store looks like): listings sorted and
// never following a symlink, lstat semantics, only regular files opened (a symlink, FIFO or
// directory refused by name, without blocking), lazy files checked against their identity,
// subtrees, and every path that is not a clean relative path refused before anything is looked
// up. An S3 tree joins by adding a row to kTrees.
#include "core/io/source_tree.h"

#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "tests/unit/memory_tree.h"

namespace ucpfs {
namespace {

namespace fs = std::filesystem;

struct TreeRow {
  const char* name;
  std::function<std::shared_ptr<const SourceTree>(const fs::path& dir)> make;
};

const TreeRow kTrees[] = {
    {"local", [](const fs::path& dir) -> std::shared_ptr<const SourceTree> { return LocalTree::Make(dir.string() + "/"); }},
    {"memory", [](const fs::path& dir) -> std::shared_ptr<const SourceTree> {
       return testing::MemoryTree::CopyOf(dir, dir.string());
     }},
};

template <typename T>
StatusCode CodeOf(const Result<T>& r) {
  return r.ok() ? StatusCode::kOk : r.error().code();
}

class SourceTreeConformance : public ::testing::TestWithParam<TreeRow> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ucpfs_tree_" + std::to_string(::getpid()) + "_" + GetParam().name);
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "b" / "d");
    std::ofstream(dir_ / "a.bin", std::ios::binary) << "abc";
    std::ofstream(dir_ / "b" / "c.txt", std::ios::binary) << "hello";
    fs::create_symlink("a.bin", dir_ / "link");
    fs::create_directory_symlink("b", dir_ / "linkdir");
    ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0644), 0);
    tree_ = GetParam().make(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string Read(const ByteSource& src) {
    std::string out(src.Size(), '\0');
    const Status s = src.ReadAt(0, std::as_writable_bytes(std::span(out.data(), out.size())));
    return s.ok() ? out : "error: " + s.message();
  }
  static std::vector<std::string> Names(const std::vector<TreeEntry>& entries) {
    std::vector<std::string> out;
    for (const TreeEntry& e : entries) out.push_back(e.name);
    return out;
  }

  fs::path dir_;
  std::shared_ptr<const SourceTree> tree_;
};

TEST_P(SourceTreeConformance, ListsSortedWithoutFollowingSymlinks) {
  EXPECT_EQ(tree_->Root(), dir_.string());  // no trailing '/'
  Result<std::vector<TreeEntry>> root = tree_->List("");
  ASSERT_TRUE(root.ok()) << root.error().message();
  ASSERT_EQ(Names(*root), (std::vector<std::string>{"a.bin", "b", "fifo", "link", "linkdir"}));
  EXPECT_EQ((*root)[0].kind, EntryKind::kFile);
  EXPECT_EQ((*root)[0].identity.n_bytes, 3u);
  EXPECT_NE((*root)[0].identity.mtime_ns, 0);
  EXPECT_EQ((*root)[1].kind, EntryKind::kDirectory);
  EXPECT_EQ((*root)[2].kind, EntryKind::kOther);
  EXPECT_EQ((*root)[3].kind, EntryKind::kSymlink);
  EXPECT_EQ((*root)[4].kind, EntryKind::kSymlink);

  Result<std::vector<TreeEntry>> b = tree_->List("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(Names(*b), (std::vector<std::string>{"c.txt", "d"}));
  Result<std::vector<TreeEntry>> d = tree_->List("b/d");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->empty());
  for (const char* not_a_dir : {"linkdir", "a.bin", "nope", "link"}) {
    Result<std::vector<TreeEntry>> l = tree_->List(not_a_dir);
    ASSERT_FALSE(l.ok()) << not_a_dir;
    EXPECT_EQ(l.error().code(), StatusCode::kNotFound) << not_a_dir;
    EXPECT_NE(l.error().message().find(tree_->PathOf(not_a_dir)), std::string::npos) << l.error().message();
  }
}

TEST_P(SourceTreeConformance, StatIsLstat) {
  Result<TreeEntry> root = tree_->Stat("");
  ASSERT_TRUE(root.ok());
  EXPECT_EQ(root->kind, EntryKind::kDirectory);
  Result<TreeEntry> c = tree_->Stat("b/c.txt");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->name, "c.txt");
  EXPECT_EQ(c->kind, EntryKind::kFile);
  EXPECT_EQ(c->identity.n_bytes, 5u);
  EXPECT_EQ(tree_->Stat("link")->kind, EntryKind::kSymlink);
  EXPECT_EQ(tree_->Stat("linkdir")->kind, EntryKind::kSymlink);
  EXPECT_TRUE(tree_->IsFile("a.bin"));
  EXPECT_FALSE(tree_->IsFile("link"));
  EXPECT_TRUE(tree_->IsDirectory("b/d"));
  EXPECT_FALSE(tree_->IsDirectory("linkdir"));
  Result<TreeEntry> missing = tree_->Stat("b/nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code(), StatusCode::kNotFound);
}

TEST_P(SourceTreeConformance, OpensRegularFilesOnly) {
  Result<OpenedFile> c = tree_->Open("b/c.txt");
  ASSERT_TRUE(c.ok()) << c.error().message();
  EXPECT_EQ(Read(*c->bytes), "hello");
  EXPECT_EQ(c->bytes->Name(), tree_->PathOf("b/c.txt"));
  EXPECT_EQ(c->identity.n_bytes, 5u);
  const auto start = std::chrono::steady_clock::now();
  for (const char* refused : {"link", "fifo", "b", "linkdir"}) {
    Result<OpenedFile> f = tree_->Open(refused);
    ASSERT_FALSE(f.ok()) << refused;
    EXPECT_EQ(f.error().code(), StatusCode::kInvalidArgument) << refused << ": " << f.error().message();
    EXPECT_NE(f.error().message().find(tree_->PathOf(refused)), std::string::npos) << f.error().message();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));  // the FIFO did not block
  Result<OpenedFile> missing = tree_->Open("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code(), StatusCode::kNotFound);
}

TEST_P(SourceTreeConformance, LazyFilesAreCheckedAgainstTheirIdentity) {
  Result<OpenedFile> c = tree_->Open("b/c.txt");
  ASSERT_TRUE(c.ok());
  auto cache = std::make_shared<FdCache>(4);
  auto counters = std::make_shared<IoCounters>();
  Result<std::shared_ptr<const LazySource>> lazy = tree_->OpenLazy("b/c.txt", c->identity, counters, cache);
  ASSERT_TRUE(lazy.ok());
  EXPECT_TRUE((*lazy)->Open().ok());
  EXPECT_EQ(Read(**lazy), "hello");
  EXPECT_GT(counters->source_bytes_read.load(), 0u);

  FileIdentity other = c->identity;
  other.mtime_ns += 1;  // another version of the file
  Result<std::shared_ptr<const LazySource>> stale = tree_->OpenLazy("b/c.txt", other, nullptr, nullptr);
  ASSERT_TRUE(stale.ok());  // nothing is opened yet
  const Status opened = (*stale)->Open();
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.code(), StatusCode::kDataLoss);
  EXPECT_NE(opened.message().find("c.txt"), std::string::npos) << opened.message();
}

TEST_P(SourceTreeConformance, SubtreesAreRootedBelow) {
  Result<std::shared_ptr<const SourceTree>> b = tree_->Subtree("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->Root(), tree_->PathOf("b"));
  Result<std::vector<TreeEntry>> listed = (*b)->List("");
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(Names(*listed), (std::vector<std::string>{"c.txt", "d"}));
  Result<OpenedFile> c = (*b)->Open("c.txt");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(Read(*c->bytes), "hello");
}

TEST_P(SourceTreeConformance, PathsThatAreNotCleanAreRefused) {
  for (const char* bad : {"../a.bin", "/etc/passwd", "b//c.txt", "./a.bin", "b/./c.txt", "b/", "b/..", ".."}) {
    EXPECT_FALSE(SafeTreePath(bad)) << bad;
    EXPECT_EQ(CodeOf(tree_->List(bad)), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(CodeOf(tree_->Stat(bad)), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(CodeOf(tree_->Open(bad)), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(CodeOf(tree_->OpenLazy(bad, {}, nullptr, nullptr)), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(CodeOf(tree_->Subtree(bad)), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(CodeOf(tree_->Open("")), StatusCode::kInvalidArgument);  // the root is no file
  EXPECT_TRUE(SafeTreePath(""));
  EXPECT_TRUE(SafeTreePath("b/c.txt"));
  EXPECT_TRUE(SafeTreePath("..x/.y"));
}

INSTANTIATE_TEST_SUITE_P(Trees, SourceTreeConformance, ::testing::ValuesIn(kTrees),
                         [](const ::testing::TestParamInfo<TreeRow>& row) { return std::string(row.param.name); });

}  // namespace
}  // namespace ucpfs
