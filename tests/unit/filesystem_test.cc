// Filesystem without a kernel: lookups, errno mapping, reads, listings, the lifetime of
// subtrees built on lookup (kernel references counted, evicted when all are forgotten), new
// generations of the views (Swap: old inodes readable until forgotten), and the source served
// read-write beside the views, saves captured (create, write, read back, fsync, rename,
// unlink, views EROFS), and an s3:// mount's bucket objects beside the staged files.
#include "fs/filesystem.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string_view>

#include "core/io/pinned_cache.h"
#include "core/io/write_capture.h"
#include "core/io/source_tree.h"
#include "fs/bucket_files.h"
#include "fs/errno_map.h"

namespace ucpfs::fs {
namespace {

constexpr struct timespec kMtime = {1700000000, 5};

Opener TextOpener(std::string text) {
  return [text]() -> Result<std::shared_ptr<const ByteSource>> {
    std::vector<std::byte> bytes(text.size());
    for (size_t i = 0; i < text.size(); ++i) bytes[i] = static_cast<std::byte>(text[i]);
    return std::shared_ptr<const ByteSource>(std::make_shared<MemorySource>("t", std::move(bytes)));
  };
}

// A tree whose life is observable: `alive` counts the trees the resolver made and that still
// exist.
struct CountedTree {
  explicit CountedTree(std::shared_ptr<std::atomic<int>> alive_in) : alive(std::move(alive_in)) { ++*alive; }
  ~CountedTree() { --*alive; }
  CountedTree(const CountedTree&) = delete;
  CountedTree& operator=(const CountedTree&) = delete;
  Tree tree{kMtime};
  std::shared_ptr<std::atomic<int>> alive;
};

struct Fixture {
  std::shared_ptr<std::atomic<int>> alive = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::atomic<int>> n_resolved = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<MountReport> report = std::make_shared<MountReport>();
  std::unique_ptr<Filesystem> fs;
  Ino dynamic = 0;
  Ino file = 0;

  Fixture() {
    auto tree = std::make_shared<Tree>(kMtime);
    dynamic = *tree->AddDir(kRootIno, "target", kMtime);
    const Ino docs = *tree->AddDir(kRootIno, "docs", kMtime);
    file = *tree->AddFile(docs, "a.txt", 11, kMtime, TextOpener("hello world"));
    FilesystemOptions options;
    options.uid = 1234;
    options.gid = 5678;
    options.dynamic_dir = dynamic;
    options.report = report;
    options.resolve = [alive = alive, n_resolved = n_resolved](const std::string& name)
        -> Result<std::shared_ptr<const Tree>> {
      if (name.rfind("ok", 0) != 0) return InvalidArgumentError("not a layout: " + name);
      ++*n_resolved;
      auto made = std::make_shared<CountedTree>(alive);
      const Ino rank = *made->tree.AddDir(kRootIno, "rank_0", kMtime);
      (void)*made->tree.AddFile(rank, "model.pt", name.size(), kMtime, TextOpener(name));
      return std::shared_ptr<const Tree>(made, &made->tree);
    };
    fs = std::move(Filesystem::Make(tree, std::move(options))).value();
  }
};

TEST(FilesystemTest, LooksUpTheMainTreeWithoutCountingIt) {
  Fixture f;
  Result<Entry> docs = f.fs->Lookup(kRootIno, "docs");
  ASSERT_TRUE(docs.ok());
  EXPECT_TRUE(S_ISDIR(docs->attr.st_mode));
  EXPECT_EQ(docs->attr.st_uid, 1234u);
  Result<Entry> a = f.fs->Lookup(docs->ino, "a.txt");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->ino, f.file);
  EXPECT_EQ(a->attr.st_size, 11);
  EXPECT_EQ(a->attr.st_blocks, 1);
  // A disk file's block size: Python's buffered files (torch.load's) size their buffer by it.
  EXPECT_EQ(a->attr.st_blksize, 4096);
  Result<Entry> missing = f.fs->Lookup(kRootIno, "nope");
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(missing->ino, 0u);  // a negative entry
  EXPECT_EQ(f.fs->Lookup(docs->ino, "..")->ino, kRootIno);
  EXPECT_EQ(f.fs->Lookup(docs->ino, ".")->ino, docs->ino);
  Result<Entry> not_dir = f.fs->Lookup(f.file, "x");
  ASSERT_FALSE(not_dir.ok());
  EXPECT_EQ(ErrnoFromStatus(not_dir.error()), ENOTDIR);
  EXPECT_EQ(ErrnoFromStatus(f.fs->Lookup(999, "x").error()), ENOENT);
  f.fs->Forget(f.file, 100);  // the main tree is pinned
  EXPECT_TRUE(f.fs->GetAttr(f.file).ok());
}

TEST(FilesystemTest, OpensReadOnlyAndReadsClipped) {
  Fixture f;
  EXPECT_EQ(ErrnoFromStatus(f.fs->Open(f.file, O_WRONLY).error()), EROFS);
  EXPECT_EQ(ErrnoFromStatus(f.fs->Open(f.file, O_RDONLY | O_TRUNC).error()), EROFS);
  EXPECT_EQ(ErrnoFromStatus(f.fs->Open(kRootIno, O_RDONLY).error()), EISDIR);
  Result<OpenFile> open = f.fs->Open(f.file, O_RDONLY);
  ASSERT_TRUE(open.ok());
  std::vector<std::byte> buf(64);
  Result<size_t> n = f.fs->Read(*open, 6, buf);
  ASSERT_TRUE(n.ok());
  ASSERT_EQ(*n, 5u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(buf.data()), *n), "world");
  EXPECT_EQ(*f.fs->Read(*open, 11, buf), 0u);
  EXPECT_EQ(ErrnoFromStatus(f.fs->Access(f.file, W_OK)), EROFS);
  EXPECT_TRUE(f.fs->Access(f.file, R_OK).ok());
}

// A source that records the prefetch hints it gets.
class HintedSource final : public ByteSource {
 public:
  explicit HintedSource(uint64_t n_bytes) : n_bytes_(n_bytes) {}
  uint64_t Size() const override { return n_bytes_; }
  const std::string& Name() const override { return name_; }
  Status ReadAt(uint64_t, std::span<std::byte> out) const override {
    std::fill(out.begin(), out.end(), std::byte{7});
    return Status::Ok();
  }
  void Prefetch(uint64_t byte_offset, uint64_t n_bytes) const override {
    std::lock_guard lock(mu_);
    hints_.emplace_back(byte_offset, byte_offset + n_bytes);
  }
  std::vector<std::pair<uint64_t, uint64_t>> Hints() const {
    std::lock_guard lock(mu_);
    return hints_;
  }

 private:
  uint64_t n_bytes_;
  std::string name_ = "hinted";
  mutable std::mutex mu_;
  mutable std::vector<std::pair<uint64_t, uint64_t>> hints_;
};

// A tree of one view file of `n_bytes` over a HintedSource.
struct HintedFile {
  explicit HintedFile(uint64_t n_bytes) : source(std::make_shared<HintedSource>(n_bytes)) {
    tree = std::make_shared<Tree>(kMtime);
    auto s = source;
    ino = *tree->AddFile(kRootIno, "model.pt", n_bytes, kMtime, [s]() -> Result<std::shared_ptr<const ByteSource>> {
      return std::shared_ptr<const ByteSource>(s);
    });
  }
  // A Filesystem with this read-ahead window, and the file opened in it.
  std::pair<std::unique_ptr<Filesystem>, OpenFile> Open(uint64_t read_ahead_bytes) const {
    FilesystemOptions options;
    options.read_ahead_bytes = read_ahead_bytes;
    auto fs = std::move(Filesystem::Make(tree, std::move(options))).value();
    OpenFile open = *fs->Open(ino, O_RDONLY);
    return {std::move(fs), std::move(open)};
  }
  std::shared_ptr<HintedSource> source;
  std::shared_ptr<Tree> tree;
  Ino ino = 0;
};

TEST(FilesystemTest, SequentialViewReadsPrefetchTheirSourceAhead) {
  constexpr uint64_t kMiB = 1 << 20;
  HintedFile f(100 * kMiB);
  auto& source = f.source;
  auto& tree = f.tree;
  const Ino file = f.ino;
  auto [fs, open] = f.Open(8 * kMiB);
  // torch.load's order: the zip directory at the end first, then front to back.
  fs->ReadAhead(open, 100 * kMiB - 4096, 4096);  // the last bytes: nothing lies ahead
  fs->ReadAhead(open, 99 * kMiB, kMiB);          // idem
  EXPECT_TRUE(source->Hints().empty());
  fs->ReadAhead(open, 90 * kMiB, kMiB);  // near the end: clipped to the file
  for (uint64_t off = 0; off < 12 * kMiB; off += kMiB) fs->ReadAhead(open, off, kMiB);
  const auto hints = source->Hints();
  ASSERT_EQ(hints.size(), 4u);
  EXPECT_EQ(hints[0], std::make_pair(91 * kMiB, 99 * kMiB));
  EXPECT_EQ(hints[1], std::make_pair(1 * kMiB, 9 * kMiB));    // a new stream from the front
  EXPECT_EQ(hints[2], std::make_pair(9 * kMiB, 13 * kMiB));   // topped up at half (the step: at least 4 MiB)
  EXPECT_EQ(hints[3], std::make_pair(13 * kMiB, 17 * kMiB));
  // Off: no hints at all.
  auto quiet = std::move(Filesystem::Make(tree, {})).value();
  OpenFile q = *quiet->Open(file, O_RDONLY);
  EXPECT_EQ(q.prefetched_until, nullptr);
  quiet->ReadAhead(q, 0, kMiB);
  EXPECT_EQ(source->Hints().size(), 4u);
}

// A larger window is topped up in eighths (4 MiB of 32M), not halves: an s3:// source then keeps
// GETs going as the reader advances, instead of waves that leave the link idle between them.
TEST(FilesystemTest, ALargeReadAheadWindowIsToppedUpInEighths) {
  constexpr uint64_t kMiB = 1 << 20;
  HintedFile f(200 * kMiB);
  auto [fs, open] = f.Open(32 * kMiB);
  for (uint64_t off = 0; off < 16 * kMiB; off += kMiB) fs->ReadAhead(open, off, kMiB);
  const auto hints = f.source->Hints();
  ASSERT_EQ(hints.size(), 5u);
  EXPECT_EQ(hints[0], std::make_pair(200 * kMiB - kReadAheadTailBytes, 200 * kMiB));  // the tail
  EXPECT_EQ(hints[1], std::make_pair(1 * kMiB, 33 * kMiB));  // the window
  EXPECT_EQ(hints[2], std::make_pair(33 * kMiB, 37 * kMiB)); // then 4 MiB each 4 MiB read
  EXPECT_EQ(hints[3], std::make_pair(37 * kMiB, 41 * kMiB));
  EXPECT_EQ(hints[4], std::make_pair(41 * kMiB, 45 * kMiB));
  // A 128M window: steps of 16 MiB.
  auto [fs2, open2] = f.Open(128 * kMiB);
  for (uint64_t off = 0; off < 20 * kMiB; off += kMiB) fs2->ReadAhead(open2, off, kMiB);
  const auto wide_hints = f.source->Hints();
  ASSERT_EQ(wide_hints.size(), 8u);
  EXPECT_EQ(wide_hints[6], std::make_pair(1 * kMiB, 129 * kMiB));
  EXPECT_EQ(wide_hints[7], std::make_pair(129 * kMiB, 145 * kMiB));
}

// torch.load reads a zip's head, then its directory at the end, then the data: a reader that
// starts at the front gets the file's tail announced before the window, so its second read does
// not wait behind the window's source reads. Only the first read of an open file does it, and
// only at offset 0; a tail already covered by the read is not announced again.
TEST(FilesystemTest, AReaderStartingAtTheFrontGetsTheTailAnnouncedFirst) {
  constexpr uint64_t kMiB = 1 << 20;
  HintedFile f(100 * kMiB);
  {
    auto [fs, open] = f.Open(8 * kMiB);
    fs->ReadAhead(open, 0, kMiB);
    fs->ReadAhead(open, 100 * kMiB - 4096, 4096);  // the directory: nothing more
    fs->ReadAhead(open, 0, kMiB);                   // the front again: within the window
    const auto hints = f.source->Hints();
    ASSERT_EQ(hints.size(), 2u);
    EXPECT_EQ(hints[0], std::make_pair(100 * kMiB - kReadAheadTailBytes, 100 * kMiB));
    EXPECT_EQ(hints[1], std::make_pair(1 * kMiB, 9 * kMiB));
  }
  {  // A first read elsewhere (mmap faults, a seek): the window alone.
    auto [fs, open] = f.Open(8 * kMiB);
    fs->ReadAhead(open, 40 * kMiB, kMiB);
    fs->ReadAhead(open, 0, kMiB);
    const auto hints = f.source->Hints();
    ASSERT_EQ(hints.size(), 4u);
    EXPECT_EQ(hints[2], std::make_pair(41 * kMiB, 49 * kMiB));
    EXPECT_EQ(hints[3], std::make_pair(1 * kMiB, 9 * kMiB));
  }
  {  // A file no larger than the first read plus the tail: nothing to announce apart.
    HintedFile small(kMiB + kReadAheadTailBytes);
    auto [fs, open] = small.Open(8 * kMiB);
    fs->ReadAhead(open, 0, kMiB);
    const auto hints = small.source->Hints();
    ASSERT_EQ(hints.size(), 1u);
    EXPECT_EQ(hints[0], std::make_pair(1 * kMiB, kMiB + kReadAheadTailBytes));
  }
}

TEST(FilesystemTest, ASubtreeIsBuiltOnceAndEvictedWhenEveryReferenceIsForgotten) {
  Fixture f;
  Result<Entry> first = f.fs->Lookup(f.dynamic, "ok_a");
  ASSERT_TRUE(first.ok());
  ASSERT_NE(first->ino, 0u);
  Result<Entry> again = f.fs->Lookup(f.dynamic, "ok_a");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->ino, first->ino);
  EXPECT_EQ(*f.n_resolved, 1);
  EXPECT_EQ(f.fs->NumSubtrees(), 1u);
  EXPECT_EQ(f.fs->PathOf(first->ino), "/target/ok_a");

  // Two references to the root, one to rank_0, one to model.pt.
  Result<Entry> rank = f.fs->Lookup(first->ino, "rank_0");
  ASSERT_TRUE(rank.ok());
  Result<Entry> model = f.fs->Lookup(rank->ino, "model.pt");
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(f.fs->PathOf(model->ino), "/target/ok_a/rank_0/model.pt");
  EXPECT_EQ(f.fs->Lookup(rank->ino, "..")->ino, first->ino);  // a fifth reference
  EXPECT_EQ(f.fs->Lookup(first->ino, "..")->ino, f.dynamic);    // the main tree: not counted

  // An open file keeps its bytes even after its subtree goes.
  Result<OpenFile> open = f.fs->Open(model->ino, O_RDONLY);
  ASSERT_TRUE(open.ok());

  f.fs->Forget(first->ino, 3);
  f.fs->Forget(rank->ino, 1);
  EXPECT_EQ(f.fs->NumSubtrees(), 1u);  // model.pt is still known
  EXPECT_EQ(*f.alive, 1);
  f.fs->Forget(model->ino, 1);
  EXPECT_EQ(f.fs->NumSubtrees(), 0u);
  EXPECT_EQ(*f.alive, 0);  // the resolver's tree (and what it holds) is released
  EXPECT_EQ(ErrnoFromStatus(f.fs->GetAttr(model->ino).error()), ENOENT);
  EXPECT_FALSE(f.fs->Reference(first->ino).has_value());
  std::vector<std::byte> buf(16);
  ASSERT_EQ(*f.fs->Read(*open, 0, buf), 4u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(buf.data()), 4), "ok_a");

  // Looked up again: built afresh under new inode numbers, so stale ones never alias.
  Result<Entry> rebuilt = f.fs->Lookup(f.dynamic, "ok_a");
  ASSERT_TRUE(rebuilt.ok());
  EXPECT_NE(rebuilt->ino, first->ino);
  EXPECT_EQ(*f.n_resolved, 2);
  f.fs->Forget(rebuilt->ino, 1000);  // more than it had: clamped, evicted
  EXPECT_EQ(f.fs->NumSubtrees(), 0u);
}

TEST(FilesystemTest, ReadDirPlusReferencesCountAndListingsShowLiveSubtrees) {
  Fixture f;
  const Ino a = f.fs->Lookup(f.dynamic, "ok_a")->ino;
  const Ino b = f.fs->Lookup(f.dynamic, "ok_b")->ino;
  Result<DirListing> listing = f.fs->OpenDir(f.dynamic);
  ASSERT_TRUE(listing.ok());
  EXPECT_FALSE(listing->cacheable);
  ASSERT_EQ(listing->items.size(), 4u);
  EXPECT_EQ(listing->items[2].name, "ok_a");
  EXPECT_EQ(listing->items[3].name, "ok_b");
  std::optional<Entry> ref = f.fs->Reference(a);  // as readdirplus would
  ASSERT_TRUE(ref.has_value());
  f.fs->Forget(a, 1);
  EXPECT_EQ(f.fs->NumSubtrees(), 2u);  // one reference left
  f.fs->Forget(a, 1);
  f.fs->Forget(b, 1);
  EXPECT_EQ(f.fs->NumSubtrees(), 0u);
  EXPECT_FALSE(f.fs->StatOf(listing->items[2].ino).has_value());  // gone since the snapshot
  EXPECT_EQ(f.fs->OpenDir(f.dynamic)->items.size(), 2u);
  EXPECT_TRUE(f.fs->OpenDir(kRootIno)->cacheable);
}

TEST(FilesystemTest, AResolveErrorIsEnoentAndNotRemembered) {
  Fixture f;
  Result<Entry> bad = f.fs->Lookup(f.dynamic, "bad");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(ErrnoFromStatus(bad.error()), ENOENT);
  EXPECT_NE(bad.error().message().find("not a layout: bad"), std::string::npos);
  EXPECT_EQ(f.fs->NumSubtrees(), 0u);
}

// The mount's report (stats.json "views" and "errors"): view reads counted with their bytes,
// every error recorded with the file it concerns.
TEST(FilesystemTest, ViewReadsAndErrorsGoToTheReport) {
  Fixture f;
  Result<OpenFile> open = f.fs->Open(f.file, O_RDONLY);
  ASSERT_TRUE(open.ok());
  std::vector<std::byte> buf(4);
  ASSERT_EQ(*f.fs->Read(*open, 0, buf), 4u);
  ASSERT_EQ(*f.fs->Read(*open, 8, buf), 3u);
  ASSERT_FALSE(f.fs->Lookup(f.dynamic, "bad").ok());
  nlohmann::ordered_json j;
  f.report->AddTo(j);
  EXPECT_EQ(j["views"]["reads"], 2u);
  EXPECT_EQ(j["views"]["bytes_read"], 7u);
  EXPECT_EQ(j["errors"]["count"], 1u);
  ASSERT_EQ(j["errors"]["last"].size(), 1u);
  EXPECT_EQ(j["errors"]["last"][0].get<std::string>(), "target/bad: invalid argument: not a layout: bad");

  // A source that fails: the open error names the file.
  auto tree = std::make_shared<Tree>(kMtime);
  const Ino broken = *tree->AddFile(kRootIno, "broken.pt", 3, kMtime, []() -> Result<std::shared_ptr<const ByteSource>> {
    return IoError("shard_0.distcp: pread", EIO);
  });
  FilesystemOptions options;
  options.report = f.report;
  auto fs = std::move(Filesystem::Make(tree, std::move(options))).value();
  ASSERT_FALSE(fs->Open(broken, O_RDONLY).ok());
  nlohmann::ordered_json k;
  f.report->AddTo(k);
  EXPECT_EQ(k["errors"]["count"], 2u);
  const std::string last = k["errors"]["last"][1].get<std::string>();
  EXPECT_NE(last.find("open /broken.pt: "), std::string::npos) << last;
  EXPECT_NE(last.find("shard_0.distcp"), std::string::npos) << last;
}

TEST(FilesystemTest, ConcurrentLookupsAndForgetsLeaveNothingBehind) {
  Fixture f;
  constexpr int kThreads = 8;
  constexpr int kRounds = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&f, t] {
      for (int i = 0; i < kRounds; ++i) {
        const std::string name = "ok_" + std::to_string((i + t) % 3);
        Result<Entry> root = f.fs->Lookup(f.dynamic, name);
        ASSERT_TRUE(root.ok());
        Result<Entry> rank = f.fs->Lookup(root->ino, "rank_0");
        ASSERT_TRUE(rank.ok());
        ASSERT_NE(rank->ino, 0u);
        EXPECT_EQ(f.fs->GetAttr(rank->ino)->st_ino, rank->ino);
        f.fs->Forget(rank->ino, 1);
        f.fs->Forget(root->ino, 1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(f.fs->NumSubtrees(), 0u);
  EXPECT_EQ(*f.alive, 0);
}

TEST(FilesystemTest, MakeRefusesABadDynamicDirectory) {
  auto tree = std::make_shared<Tree>(kMtime);
  const Ino file = *tree->AddFile(kRootIno, "f", 0, kMtime, TextOpener(""));
  FilesystemOptions options;
  options.dynamic_dir = file;
  options.resolve = [](const std::string&) -> Result<std::shared_ptr<const Tree>> {
    return std::shared_ptr<const Tree>();
  };
  EXPECT_EQ(Filesystem::Make(tree, options).error().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Filesystem::Make(nullptr, {}).error().code(), StatusCode::kInvalidArgument);
}

std::shared_ptr<Tree> ViewTree(const std::string& text) {
  auto tree = std::make_shared<Tree>(kMtime);
  const Ino atomic = *tree->AddDir(kRootIno, "atomic", kMtime);
  (void)*tree->AddFile(atomic, "w.pt", text.size(), kMtime, TextOpener(text));
  return tree;
}

std::string ReadAll(Filesystem& fs, Ino ino) {
  Result<OpenFile> file = fs.Open(ino, O_RDONLY);
  EXPECT_TRUE(file.ok());
  if (!file.ok()) return "";
  std::vector<std::byte> buf(4096);
  Result<size_t> n = fs.Read(*file, 0, buf);
  EXPECT_TRUE(n.ok());
  (void)fs.Release(*file);
  return std::string(reinterpret_cast<const char*>(buf.data()), n.ok() ? *n : 0);
}

// A lister's names show in the dynamic directory before they are looked up; a resolver may
// answer one with a tree whose root is a file (target/<layout>.error).
TEST(FilesystemTest, ListedNamesAndFileChildrenOfTheDynamicDirectory) {
  auto tree = std::make_shared<Tree>(kMtime);
  const Ino dynamic = *tree->AddDir(kRootIno, "target", kMtime);
  FilesystemOptions options;
  options.dynamic_dir = dynamic;
  options.resolve = [](const std::string& name) -> Result<std::shared_ptr<const Tree>> {
    if (name != "x.error") return NotFoundError("no " + name);
    return std::make_shared<const Tree>(Tree::OneFile(4, kMtime, TextOpener("why\n")));
  };
  options.list = [] { return std::vector<std::string>{"x.error"}; };
  auto fs = Filesystem::Make(tree, options);
  ASSERT_TRUE(fs.ok()) << fs.error().ToString();
  Result<DirListing> listing = (*fs)->OpenDir(dynamic);
  ASSERT_TRUE(listing.ok());
  ASSERT_EQ(listing->items.size(), 3u);  // ".", "..", x.error
  EXPECT_EQ(listing->items[2].name, "x.error");
  EXPECT_TRUE(listing->items[2].by_name);
  EXPECT_EQ(listing->items[2].type, static_cast<mode_t>(S_IFREG));
  Result<Entry> file = (*fs)->Lookup(dynamic, "x.error");
  ASSERT_TRUE(file.ok());
  EXPECT_TRUE(S_ISREG(file->attr.st_mode));
  EXPECT_EQ(file->attr.st_size, 4);
  EXPECT_EQ(ReadAll(**fs, file->ino), "why\n");
  EXPECT_EQ((*fs)->Lookup(file->ino, "a").error().sys_errno(), ENOTDIR);
  listing = (*fs)->OpenDir(dynamic);  // resolved now: listed once, by inode
  ASSERT_TRUE(listing.ok());
  ASSERT_EQ(listing->items.size(), 3u);
  EXPECT_EQ(listing->items[2].ino, file->ino);
  (*fs)->Forget(file->ino, 1);
  EXPECT_EQ((*fs)->NumSubtrees(), 0u);
}

TEST(FilesystemTest, SwapServesTheNewGenerationAndKeepsTheOldUntilForgotten) {
  auto fs = std::move(Filesystem::Make(ViewTree("first"), {})).value();
  // The first generation is pinned: its inodes are served as they are.
  const Ino old_dir = fs->Lookup(kRootIno, "atomic")->ino;
  const Ino old_file = fs->Lookup(old_dir, "w.pt")->ino;
  ASSERT_TRUE(fs->Swap(ViewTree("second!"), 0, nullptr).ok());
  EXPECT_EQ(fs->Generation(), 2u);
  const Entry new_dir = *fs->Lookup(kRootIno, "atomic");
  EXPECT_NE(new_dir.ino, old_dir);
  const Entry new_file = *fs->Lookup(new_dir.ino, "w.pt");
  EXPECT_EQ(ReadAll(*fs, new_file.ino), "second!");
  EXPECT_EQ(ReadAll(*fs, old_file), "first");  // a reader of the old snapshot
  EXPECT_EQ(fs->Lookup(new_dir.ino, "..")->ino, kRootIno);
  EXPECT_EQ(fs->PathOf(new_file.ino), "/atomic/w.pt");
  // A third generation: the second (not current, still referenced) stays until forgotten.
  ASSERT_TRUE(fs->Swap(ViewTree("third"), 0, nullptr).ok());
  EXPECT_EQ(ReadAll(*fs, new_file.ino), "second!");
  // Two kernel references to it (the ".." lookup's answer, the root, is not counted).
  fs->Forget(new_file.ino, 1);
  EXPECT_TRUE(fs->GetAttr(new_file.ino).ok());
  fs->Forget(new_dir.ino, 1);
  EXPECT_EQ(ErrnoFromStatus(fs->GetAttr(new_file.ino).error()), ENOENT);  // released
  EXPECT_EQ(ReadAll(*fs, fs->Lookup(fs->Lookup(kRootIno, "atomic")->ino, "w.pt")->ino), "third");
}

class PassthroughFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("ucpfs-fs-pt-" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "old");
    std::ofstream(dir_ / "old" / "a.txt") << "source";
    src_fd_ = open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    io::PinnedCacheOptions co;
    co.capacity_bytes = 4 << 20;
    co.chunk_bytes = 1 << 20;
    co.allow_cuda = false;
    io::WriteCaptureOptions wo;
    wo.source_dirfd = src_fd_;
    wo.source_dir = dir_.string();
    wo.cache = std::shared_ptr<io::PinnedCache>(std::move(io::PinnedCache::Make(co)).value());
    capture_ = std::shared_ptr<io::WriteCapture>(std::move(io::WriteCapture::Start(std::move(wo))).value());
    FilesystemOptions options;
    options.passthrough = std::shared_ptr<Passthrough>(std::move(Passthrough::Make(dir_.string(), capture_)).value());
    fs_ = std::move(Filesystem::Make(ViewTree("view"), std::move(options))).value();
  }
  void TearDown() override {
    fs_.reset();
    capture_.reset();
    close(src_fd_);
    std::filesystem::remove_all(dir_);
  }
  std::filesystem::path dir_;
  int src_fd_ = -1;
  std::shared_ptr<io::WriteCapture> capture_;
  std::unique_ptr<Filesystem> fs_;
};

TEST_F(PassthroughFixture, SavesAreCapturedAndLandWhenDurable) {
  // The source's files beside the views.
  Result<DirListing> root = fs_->OpenDir(kRootIno);
  ASSERT_TRUE(root.ok());
  std::vector<std::string> names;
  for (const auto& item : root->items) names.push_back(item.name);
  EXPECT_EQ(names, (std::vector<std::string>{".", "..", "atomic", "old"}));
  const Entry old = *fs_->Lookup(kRootIno, "old");
  EXPECT_TRUE(Passthrough::Owns(old.ino));
  EXPECT_EQ(ReadAll(*fs_, fs_->Lookup(old.ino, "a.txt")->ino), "source");
  // Create, write, read back before it is durable; not in SRC until then.
  auto made = fs_->Create(kRootIno, "saved.pt", 0644, O_WRONLY | O_CREAT | O_TRUNC);
  ASSERT_TRUE(made.ok()) << made.error().ToString();
  const std::string text(3 << 20, 'x');
  ASSERT_TRUE(fs_->Write(made->second, 0, std::span(reinterpret_cast<const std::byte*>(text.data()), text.size())).ok());
  EXPECT_EQ(fs_->GetAttr(made->first.ino)->st_size, static_cast<off_t>(text.size()));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "saved.pt"));
  ASSERT_TRUE(fs_->Fsync(made->second, false).ok());
  EXPECT_EQ(std::filesystem::file_size(dir_ / "saved.pt"), text.size());
  ASSERT_TRUE(fs_->Release(made->second).ok());
  // Rename and unlink act on the source; views refuse both.
  ASSERT_TRUE(fs_->Rename(kRootIno, "saved.pt", old.ino, "moved.pt", 0).ok());
  EXPECT_TRUE(std::filesystem::exists(dir_ / "old" / "moved.pt"));
  EXPECT_EQ(ErrnoFromStatus(fs_->Rename(old.ino, "moved.pt", kRootIno, "atomic", 0)), EROFS);
  EXPECT_EQ(ErrnoFromStatus(fs_->Unlink(kRootIno, "atomic")), EROFS);
  EXPECT_EQ(ErrnoFromStatus(fs_->Create(kRootIno, "atomic", 0644, O_WRONLY | O_CREAT).error()), EEXIST);
  const Entry view_dir = *fs_->Lookup(kRootIno, "atomic");
  EXPECT_EQ(ErrnoFromStatus(fs_->Create(view_dir.ino, "x", 0644, O_WRONLY | O_CREAT).error()), EROFS);
  // A pending file unlinked before it is durable never lands.
  auto gone = fs_->Create(old.ino, "gone.pt", 0644, O_WRONLY | O_CREAT);
  ASSERT_TRUE(gone.ok());
  ASSERT_TRUE(fs_->Write(gone->second, 0, std::span(reinterpret_cast<const std::byte*>(text.data()), 10)).ok());
  ASSERT_TRUE(fs_->Unlink(old.ino, "gone.pt").ok());
  ASSERT_TRUE(fs_->Release(gone->second).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  EXPECT_FALSE(std::filesystem::exists(dir_ / "old" / "gone.pt"));
  Result<Entry> none = fs_->Lookup(old.ino, "gone.pt");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->ino, 0u);
}

// An s3:// mount's read-write area: the bucket's objects (here a LocalTree standing for the
// bucket: BucketFiles asks only the SourceTree calls) beside the staged files, staged winning.
class BucketFixture : public PassthroughFixture {
 protected:
  void SetUp() override {
    PassthroughFixture::SetUp();
    bucket_dir_ = dir_.string() + "-bucket";
    std::filesystem::remove_all(bucket_dir_);
    std::filesystem::create_directories(bucket_dir_ / "step" / "deep");
    std::ofstream(bucket_dir_ / "latest") << "step";
    std::ofstream(bucket_dir_ / "old") << "shadowed by the staged directory";
    std::ofstream(bucket_dir_ / "step" / "shard") << "0123456789";
    std::ofstream(bucket_dir_ / "step" / "deep" / "x") << "x";
    bucket_ = std::make_shared<BucketFiles>(LocalTree::Make(bucket_dir_.string()));
    bucket_->SetRemove([this](const std::string& rel) { return RemoveObject(rel); });
    FilesystemOptions options;
    options.passthrough = std::shared_ptr<Passthrough>(std::move(Passthrough::Make(dir_.string(), capture_)).value());
    options.bucket = bucket_;
    fs_ = std::move(Filesystem::Make(ViewTree("view"), std::move(options))).value();
  }
  void TearDown() override {
    PassthroughFixture::TearDown();
    std::filesystem::remove_all(bucket_dir_);
  }
  // What the uploader's DELETE does, recorded.
  Status RemoveObject(const std::string& rel) {
    removed_.push_back(rel);
    std::filesystem::remove(bucket_dir_ / rel);
    return Status::Ok();
  }
  std::vector<std::string> Names(Ino dir) {
    Result<DirListing> listing = fs_->OpenDir(dir);
    EXPECT_TRUE(listing.ok());
    std::vector<std::string> names;
    if (!listing.ok()) return names;
    const DirListing listed = *std::move(listing);
    for (const auto& item : listed.items) names.push_back(item.name);
    return names;
  }
  std::filesystem::path bucket_dir_;
  std::shared_ptr<BucketFiles> bucket_;
  std::vector<std::string> removed_;
};

TEST_F(BucketFixture, ObjectsShowBesideStagedFilesAndChangesAreRefusedOrStaged) {
  // Listed with the views and the staged names; `old` is the staged directory's.
  EXPECT_EQ(Names(kRootIno), (std::vector<std::string>{".", "..", "atomic", "latest", "old", "step"}));
  EXPECT_FALSE(BucketFiles::Owns(fs_->Lookup(kRootIno, "old")->ino));
  const Entry latest = *fs_->Lookup(kRootIno, "latest");
  ASSERT_TRUE(BucketFiles::Owns(latest.ino));
  EXPECT_TRUE(Passthrough::Owns(latest.ino));
  EXPECT_EQ(latest.attr.st_size, 4);
  EXPECT_EQ(ReadAll(*fs_, latest.ino), "step");
  // A bucket directory is made in the staging directory on lookup (never uploaded).
  const Entry step = *fs_->Lookup(kRootIno, "step");
  EXPECT_TRUE(std::filesystem::is_directory(dir_ / "step"));
  EXPECT_EQ(Names(step.ino), (std::vector<std::string>{".", "..", "deep", "shard"}));
  const Entry shard = *fs_->Lookup(step.ino, "shard");
  Result<OpenFile> part = fs_->Open(shard.ino, O_RDONLY);
  ASSERT_TRUE(part.ok());
  std::vector<std::byte> buf(3);
  ASSERT_EQ(*fs_->Read(*part, 4, buf), 3u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(buf.data()), 3), "456");
  (void)fs_->Release(*part);
  // Refused: in-place writes (EPERM), renames (EXDEV, also of a directory holding objects), rmdir
  // of a directory holding objects (ENOTEMPTY), setattr (EPERM).
  EXPECT_EQ(ErrnoFromStatus(fs_->Open(shard.ino, O_RDWR).error()), EPERM);
  EXPECT_EQ(ErrnoFromStatus(fs_->Open(shard.ino, O_WRONLY | O_APPEND).error()), EPERM);
  EXPECT_EQ(ErrnoFromStatus(fs_->Rename(step.ino, "shard", kRootIno, "moved", 0)), EXDEV);
  EXPECT_EQ(ErrnoFromStatus(fs_->Rename(kRootIno, "step", kRootIno, "moved", 0)), EXDEV);
  EXPECT_EQ(ErrnoFromStatus(fs_->Rmdir(kRootIno, "step")), ENOTEMPTY);
  ASSERT_TRUE(fs_->Mknod(kRootIno, "new", S_IFREG | 0644).ok());
  EXPECT_EQ(ErrnoFromStatus(fs_->Rename(kRootIno, "new", kRootIno, "latest", RENAME_NOREPLACE)), EEXIST);
  struct stat attr = {};
  EXPECT_EQ(ErrnoFromStatus(fs_->SetAttr(shard.ino, attr, Passthrough::kSetSize, nullptr).error()), EPERM);
  EXPECT_TRUE(removed_.empty());
  // An O_TRUNC rewrite is staged and answers for the object's inode from then on.
  Result<OpenFile> rewrite = fs_->Open(latest.ino, O_WRONLY | O_TRUNC);
  ASSERT_TRUE(rewrite.ok()) << rewrite.error().ToString();
  ASSERT_TRUE(fs_->Write(*rewrite, 0, std::as_bytes(std::span(std::string_view("step-22")))).ok());
  ASSERT_TRUE(fs_->Release(*rewrite).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  EXPECT_EQ(fs_->GetAttr(latest.ino)->st_size, 7);
  EXPECT_EQ(ReadAll(*fs_, latest.ino), "step-22");
  std::ifstream staged(dir_ / "latest");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(staged), {}), "step-22");
  // Unlink of an object hands its DELETE over and hides the name until it lands; one whose
  // DELETE could not be queued stays.
  bucket_->SetRemove([](const std::string& rel) { return IoError("journal full: " + rel, ENOSPC); });
  EXPECT_EQ(ErrnoFromStatus(fs_->Unlink(step.ino, "shard")), ENOSPC);
  EXPECT_EQ(Names(step.ino), (std::vector<std::string>{".", "..", "deep", "shard"}));
  bucket_->SetRemove([this](const std::string& rel) { return RemoveObject(rel); });
  ASSERT_TRUE(fs_->Unlink(step.ino, "shard").ok());
  EXPECT_EQ(removed_, (std::vector<std::string>{"step/shard"}));
  EXPECT_EQ(Names(step.ino), (std::vector<std::string>{".", "..", "deep"}));
  EXPECT_EQ(fs_->Lookup(step.ino, "shard")->ino, 0u);
  bucket_->Landed("step/shard");
  EXPECT_EQ(Names(step.ino), (std::vector<std::string>{".", "..", "deep"}));
  // An object replaced behind the mount reads as EIO, never as other bytes.
  const Entry x = *fs_->Lookup(fs_->Lookup(step.ino, "deep")->ino, "x");
  std::ofstream(bucket_dir_ / "step" / "deep" / "x") << "another version";
  Result<OpenFile> stale = fs_->Open(x.ino, O_RDONLY);
  ASSERT_TRUE(stale.ok());
  EXPECT_EQ(ErrnoFromStatus(fs_->Read(*stale, 0, buf).error()), EIO);
  (void)fs_->Release(*stale);
  // The kernel forgets an object's inode: it is gone.
  fs_->Forget(x.ino, 1);
  EXPECT_EQ(ErrnoFromStatus(fs_->GetAttr(x.ino).error()), ENOENT);
}

// The uploader removed a staged copy (uploaded) while the kernel still holds its inode: the
// bucket's object answers its getattr and reads, and an O_TRUNC rewrite is staged anew.
TEST_F(BucketFixture, ARemovedStagedCopyIsAnsweredByItsObject) {
  auto made = fs_->Create(kRootIno, "saved", 0644, O_WRONLY | O_CREAT | O_TRUNC);
  ASSERT_TRUE(made.ok());
  ASSERT_TRUE(fs_->Write(made->second, 0, std::as_bytes(std::span(std::string_view("abc")))).ok());
  ASSERT_TRUE(fs_->Release(made->second).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  const Ino staged = fs_->Lookup(kRootIno, "saved")->ino;
  EXPECT_FALSE(BucketFiles::Owns(staged));
  std::ofstream(bucket_dir_ / "saved") << "abc";  // uploaded
  bucket_->Landed("saved");
  std::filesystem::remove(dir_ / "saved");  // and the staged copy removed
  EXPECT_EQ(fs_->GetAttr(staged)->st_size, 3);
  EXPECT_EQ(ReadAll(*fs_, staged), "abc");
  Result<OpenFile> rewrite = fs_->Open(staged, O_WRONLY | O_TRUNC);
  ASSERT_TRUE(rewrite.ok()) << rewrite.error().ToString();
  ASSERT_TRUE(fs_->Write(*rewrite, 0, std::as_bytes(std::span(std::string_view("zz")))).ok());
  ASSERT_TRUE(fs_->Release(*rewrite).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  std::ifstream again(dir_ / "saved");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(again), {}), "zz");
  // Without an object of that name, a removed copy is ENOENT as before.
  std::filesystem::remove(bucket_dir_ / "saved");
  bucket_->Landed("saved");
  const Ino restaged = fs_->Lookup(kRootIno, "saved")->ino;
  std::filesystem::remove(dir_ / "saved");
  EXPECT_EQ(ErrnoFromStatus(fs_->Open(restaged, O_RDONLY).error()), ENOENT);
}

// As root: what `nobody` saves is nobody's, with the kernel's bits (setgid directory, umask,
// S_ISUID dropped by its write), pending and once durable; the daemon's thread is root again after.
TEST_F(PassthroughFixture, SavedAsTheCaller) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  constexpr gid_t kGroup = 4343;
  std::filesystem::create_directories(dir_ / "pub");
  std::filesystem::create_directories(dir_ / "sgid");
  ASSERT_EQ(chmod(dir_.c_str(), 0755), 0);
  ASSERT_EQ(chmod((dir_ / "pub").c_str(), 0777), 0);
  ASSERT_EQ(chown((dir_ / "sgid").c_str(), 0, kGroup), 0);
  ASSERT_EQ(chmod((dir_ / "sgid").c_str(), 02777), 0);
  Caller nobody;
  nobody.switch_creds = true;
  nobody.uid = 65534;
  nobody.gid = 65534;
  nobody.groups = {65534};
  nobody.umask = 022;
  nobody.has_umask = true;
  const Entry pub = *fs_->Lookup(kRootIno, "pub");
  const Entry sgid = *fs_->Lookup(kRootIno, "sgid");

  auto made = fs_->Create(pub.ino, "id", 04755, O_WRONLY | O_CREAT, nobody);
  ASSERT_TRUE(made.ok()) << made.error().ToString();
  EXPECT_EQ(made->first.attr.st_uid, 65534u);
  EXPECT_EQ(made->first.attr.st_gid, 65534u);
  EXPECT_EQ(made->first.attr.st_mode & 07777, 04755u);
  ASSERT_TRUE(fs_->Write(made->second, 0, std::span(reinterpret_cast<const std::byte*>("abc"), 3)).ok());
  EXPECT_EQ(fs_->GetAttr(made->first.ino)->st_mode & 07777, 0755u);  // an unprivileged write drops S_ISUID
  ASSERT_TRUE(fs_->Release(made->second).ok());

  auto in_sgid = fs_->Create(sgid.ino, "f", 02755, O_WRONLY | O_CREAT, nobody);
  ASSERT_TRUE(in_sgid.ok()) << in_sgid.error().ToString();
  EXPECT_EQ(in_sgid->first.attr.st_gid, kGroup);              // inherited
  EXPECT_EQ(in_sgid->first.attr.st_mode & 07777, 0755u);      // S_ISGID: not a member
  ASSERT_TRUE(fs_->Release(in_sgid->second).ok());
  Result<Entry> dir = fs_->Mkdir(sgid.ino, "d", 0777, nobody);
  ASSERT_TRUE(dir.ok());
  EXPECT_EQ(dir->attr.st_uid, 65534u);
  EXPECT_EQ(dir->attr.st_mode & 07777, 02755u);
  // Not nobody's: refused by the kernel.
  struct stat chmod_to = {};
  chmod_to.st_mode = 0777;
  EXPECT_EQ(ErrnoFromStatus(fs_->SetAttr(sgid.ino, chmod_to, Passthrough::kSetMode, nullptr, nobody).error()), EPERM);
  EXPECT_EQ(ErrnoFromStatus(fs_->Create(kRootIno, "no", 0644, O_WRONLY | O_CREAT, nobody).error()), EACCES);

  ASSERT_TRUE(capture_->Sync().ok());
  struct stat st = {};
  ASSERT_EQ(lstat((dir_ / "pub" / "id").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 65534u);
  EXPECT_EQ(st.st_mode & 07777, 0755u);
  ASSERT_EQ(lstat((dir_ / "sgid" / "f").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 65534u);
  EXPECT_EQ(st.st_gid, kGroup);
  // The serving thread is the daemon again.
  EXPECT_EQ(setfsuid(static_cast<uid_t>(-1)), 0);
  EXPECT_EQ(setfsgid(static_cast<gid_t>(-1)), 0);
}

}  // namespace
}  // namespace ucpfs::fs
