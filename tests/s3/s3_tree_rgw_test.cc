// S3Tree (core/io/s3_tree.h) against a real Ceph RGW (tests/s3/rgw.sh exec), the SourceTree
// contract of tests/unit/source_tree_test.cc as far as a store has it (no symlinks or FIFOs
// there): sorted listings of objects and common prefixes, Stat of an object and of a prefix,
// Open of objects only, lazy files checked against the ETag (a replaced or deleted object is
// kDataLoss naming s3://BUCKET/KEY, never other bytes), subtrees, unclean paths refused, and
// S3's date forms. Without AWS_ENDPOINT_URL it fails: the store must be there.
#include "core/io/s3_tree.h"
#include "core/io/s3_readahead.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace ucpfs {
namespace {

std::span<const std::byte> Bytes(const std::string& s) { return std::as_bytes(std::span<const char>(s.data(), s.size())); }

template <typename T>
StatusCode CodeOf(const Result<T>& r) {
  return r.ok() ? StatusCode::kOk : r.error().code();
}

std::string Read(const ByteSource& src) {
  std::string out(src.Size(), '\0');
  const Status s = src.ReadAt(0, std::as_writable_bytes(std::span(out.data(), out.size())));
  return s.ok() ? out : "error: " + s.message();
}

std::vector<std::string> Names(const std::vector<TreeEntry>& entries) {
  std::vector<std::string> out;
  for (const TreeEntry& e : entries) out.push_back(e.name);
  return out;
}

class S3TreeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_NE(std::getenv("AWS_ENDPOINT_URL"), nullptr) << "run under tests/s3/rgw.sh exec DIR";
    bucket_ = new std::string("ucpfs-tree-" + std::to_string(getpid()) + "-" +
                              std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000));
    auto tree = S3Tree::FromEnvironment("s3://" + *bucket_ + "/ckpt/");
    ASSERT_TRUE(tree.ok()) << tree.error().ToString();
    tree_ = new std::shared_ptr<const S3Tree>(*tree);
    s3::Client& c = *(*tree_)->client();
    ASSERT_TRUE(c.CreateBucket(*bucket_).ok());
    for (const auto& [key, body] : std::vector<std::pair<std::string, std::string>>{
             {"ckpt/a.bin", "abc"}, {"ckpt/b/c.txt", "hello"}, {"ckpt/b/d/", ""}, {"ckpt/e/f/g.bin", "xyz"},
             {"ckptx/other.bin", "no"}, {"ckpt/b/..", "unreachable"}}) {
      auto etag = c.PutObject(*bucket_, key, Bytes(body));
      ASSERT_TRUE(etag.ok()) << etag.error().ToString();
    }
  }
  static void TearDownTestSuite() {
    if (tree_ != nullptr) {
      s3::Client& c = *(*tree_)->client();
      auto all = c.ListObjects(*bucket_, "", "");
      if (all.ok()) {
        for (const auto& o : all->objects) (void)c.DeleteObject(*bucket_, o.key);
      }
      EXPECT_TRUE(c.DeleteBucket(*bucket_).ok());
    }
    delete tree_;
    delete bucket_;
  }
  const S3Tree& tree() { return **tree_; }
  s3::Client& client() { return *tree().client(); }
  const std::string& bucket() { return *bucket_; }

  static inline std::shared_ptr<const S3Tree>* tree_ = nullptr;
  static inline std::string* bucket_ = nullptr;
};

TEST(S3Time, BothDateFormsAgree) {
  auto iso = ParseS3TimeNs("2026-11-27T12:00:05.123Z");
  auto http = ParseS3TimeNs("Fri, 27 Nov 2026 12:00:05 GMT");
  ASSERT_TRUE(iso.ok());
  ASSERT_TRUE(http.ok());
  EXPECT_EQ(*iso, *http);
  EXPECT_EQ(*iso, int64_t{1795780805} * 1000000000);
  EXPECT_EQ(CodeOf(ParseS3TimeNs("yesterday")), StatusCode::kCorrupt);
  EXPECT_NE(ETagInode("\"a\""), ETagInode("\"b\""));
}

TEST_F(S3TreeTest, ListsObjectsAndPrefixesSorted) {
  EXPECT_EQ(tree().Root(), "s3://" + bucket() + "/ckpt");
  auto root = tree().List("");
  ASSERT_TRUE(root.ok()) << root.error().ToString();
  ASSERT_EQ(Names(*root), (std::vector<std::string>{"a.bin", "b", "e"}));  // not ckptx/
  EXPECT_EQ((*root)[0].kind, EntryKind::kFile);
  EXPECT_EQ((*root)[0].identity.n_bytes, 3u);
  EXPECT_NE((*root)[0].identity.mtime_ns, 0);
  EXPECT_NE((*root)[0].identity.ino, 0u);
  EXPECT_EQ((*root)[0].mode, 0444u);
  EXPECT_EQ((*root)[1].kind, EntryKind::kDirectory);

  auto b = tree().List("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(Names(*b), (std::vector<std::string>{"c.txt", "d"}));  // "b/.." left out
  auto d = tree().List("b/d");  // only its marker object: exists, empty
  ASSERT_TRUE(d.ok()) << d.error().ToString();
  EXPECT_TRUE(d->empty());
  EXPECT_EQ(CodeOf(tree().List("missing")), StatusCode::kNotFound);
  EXPECT_EQ(CodeOf(tree().List("a.bin")), StatusCode::kNotFound);
}

TEST_F(S3TreeTest, StatTellsObjectsFromPrefixes) {
  auto a = tree().Stat("a.bin");
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  EXPECT_EQ(a->kind, EntryKind::kFile);
  EXPECT_EQ(a->name, "a.bin");
  // HEAD and the listing give the same identity: an index built from one checks with the other.
  auto root = tree().List("");
  ASSERT_TRUE(root.ok());
  EXPECT_EQ((*root)[0].identity.Differences(a->identity), "");
  auto e = tree().Stat("e/f");
  ASSERT_TRUE(e.ok()) << e.error().ToString();
  EXPECT_EQ(e->kind, EntryKind::kDirectory);
  EXPECT_EQ(e->name, "f");
  EXPECT_TRUE(tree().IsDirectory(""));
  EXPECT_TRUE(tree().IsFile("b/c.txt"));
  EXPECT_EQ(CodeOf(tree().Stat("nope")), StatusCode::kNotFound);
}

TEST_F(S3TreeTest, OpensObjectsOnly) {
  auto f = tree().Open("b/c.txt");
  ASSERT_TRUE(f.ok()) << f.error().ToString();
  EXPECT_EQ(Read(*f->bytes), "hello");
  EXPECT_EQ(f->bytes->Name(), "s3://" + bucket() + "/ckpt/b/c.txt");
  EXPECT_EQ(f->identity.n_bytes, 5u);
  auto dir = tree().Open("b");
  ASSERT_EQ(CodeOf(dir), StatusCode::kInvalidArgument);
  EXPECT_NE(dir.error().message().find("/ckpt/b"), std::string::npos) << dir.error().message();
  EXPECT_EQ(CodeOf(tree().Open("nope")), StatusCode::kNotFound);
}

// A listing answers Stat, Open, directory checks and List of its names for a second, unless the
// client writes; a tree over another client (the forked daemon's) takes the listing with it.
TEST_F(S3TreeTest, AnswersFromAFreshListing) {
  auto made = S3Tree::Make(tree().client(), "s3://" + bucket() + "/ckpt");  // nothing remembered yet
  ASSERT_TRUE(made.ok());
  const S3Tree& t = **made;
  auto requests = [&] { return client().counters().requests; };
  auto root = t.List("");
  ASSERT_TRUE(root.ok()) << root.error().ToString();
  uint64_t before = requests();
  auto a = t.Stat("a.bin");
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  EXPECT_EQ(a->kind, EntryKind::kFile);
  EXPECT_EQ(a->name, "a.bin");
  EXPECT_EQ((*root)[0].identity.Differences(a->identity), "");
  EXPECT_EQ(t.Stat("b")->kind, EntryKind::kDirectory);
  EXPECT_EQ(CodeOf(t.Stat("nope")), StatusCode::kNotFound);
  EXPECT_TRUE(t.IsDirectory(""));
  auto opened = t.Open("a.bin");
  ASSERT_TRUE(opened.ok()) << opened.error().ToString();
  EXPECT_EQ(opened->identity.Differences(a->identity), "");
  auto again = t.List("");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(Names(*again), Names(*root));
  EXPECT_EQ(requests(), before) << "answered from the listing";
  EXPECT_EQ(Read(*opened->bytes), "abc");  // the bytes are the object's (one GET)

  // Handed to another client: it asks nothing for what was listed.
  auto other = s3::Client::Make(client().options());
  ASSERT_TRUE(other.ok());
  auto moved = t.WithClient(*other);
  auto moved_a = moved->Stat("a.bin");
  ASSERT_TRUE(moved_a.ok());
  EXPECT_EQ(moved_a->identity.Differences(a->identity), "");
  EXPECT_EQ((*other)->counters().requests, 0u);

  // A write through the tree's client: asked again, so what it wrote is seen at once.
  ASSERT_TRUE(client().PutObject(bucket(), "ckpt/new.bin", Bytes("n")).ok());
  before = requests();
  EXPECT_TRUE(t.Stat("new.bin").ok());
  EXPECT_GT(requests(), before);
  auto listed = t.List("");
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(Names(*listed), (std::vector<std::string>{"a.bin", "b", "e", "new.bin"}));

  // Another client's write is seen once the listing is a second old.
  const auto listed_at = std::chrono::steady_clock::now();
  ASSERT_TRUE((*other)->PutObject(bucket(), "ckpt/late.bin", Bytes("l")).ok());
  const bool still_fresh = std::chrono::steady_clock::now() - listed_at < std::chrono::milliseconds(kListingFreshMs / 2);
  if (still_fresh) {
    EXPECT_EQ(CodeOf(t.Stat("late.bin")), StatusCode::kNotFound) << "answered from the listing";
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(kListingFreshMs + 50));
  EXPECT_TRUE(t.Stat("late.bin").ok());
  ASSERT_TRUE(client().DeleteObject(bucket(), "ckpt/new.bin").ok());
  ASSERT_TRUE(client().DeleteObject(bucket(), "ckpt/late.bin").ok());
}

TEST_F(S3TreeTest, LazyFilesFailOnAReplacedObject) {
  ASSERT_TRUE(client().PutObject(bucket(), "ckpt/lazy.bin", Bytes("version-1")).ok());
  auto st = tree().Stat("lazy.bin");
  ASSERT_TRUE(st.ok());
  auto counters = std::make_shared<IoCounters>();
  auto lazy = tree().OpenLazy("lazy.bin", st->identity, counters, nullptr);
  ASSERT_TRUE(lazy.ok());
  EXPECT_EQ(Read(**lazy), "version-1");
  EXPECT_EQ(counters->source_bytes_read.load(), 9u);

  // Replaced under an open reader: If-Match fails, no other bytes served.
  ASSERT_TRUE(client().PutObject(bucket(), "ckpt/lazy.bin", Bytes("version-2")).ok());
  std::string out(9, '\0');
  Status s = (*lazy)->ReadAt(0, std::as_writable_bytes(std::span(out.data(), out.size())));
  ASSERT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find("s3://" + bucket() + "/ckpt/lazy.bin"), std::string::npos) << s.message();

  // A fresh tree (nothing remembered): HEAD on first open, the ETag's hash compared.
  auto fresh = S3Tree::Make(tree().client(), "s3://" + bucket() + "/ckpt");
  ASSERT_TRUE(fresh.ok());
  auto lazy2 = (*fresh)->OpenLazy("lazy.bin", st->identity, nullptr, nullptr);
  ASSERT_TRUE(lazy2.ok());
  Status open = (*lazy2)->Open();
  ASSERT_EQ(open.code(), StatusCode::kDataLoss) << open.ToString();
  EXPECT_NE(open.message().find("s3://" + bucket() + "/ckpt/lazy.bin"), std::string::npos) << open.message();
  // The current version opens and reads.
  auto now = (*fresh)->Stat("lazy.bin");
  ASSERT_TRUE(now.ok());
  auto lazy3 = (*fresh)->OpenLazy("lazy.bin", now->identity, nullptr, nullptr);
  ASSERT_TRUE(lazy3.ok());
  EXPECT_EQ(Read(**lazy3), "version-2");
  // Deleted: kDataLoss too.
  ASSERT_TRUE(client().DeleteObject(bucket(), "ckpt/lazy.bin").ok());
  auto fresh2 = S3Tree::Make(tree().client(), "s3://" + bucket() + "/ckpt");
  auto lazy4 = (*fresh2)->OpenLazy("lazy.bin", now->identity, nullptr, nullptr);
  EXPECT_EQ((*lazy4)->Open().code(), StatusCode::kDataLoss);
}

// What a view announces (Prefetch) is fetched ahead and handed to the reads that follow: the
// bytes are the object's, and every byte is GET once, whether a read found it fetched ahead, read
// it itself first (a later hint leaves it out), or straddles two blocks.
TEST_F(S3TreeTest, ReadAheadServesAnnouncedBytesOnce) {
  std::string body(10 * 1024 * 1024 + 17, '\0');
  for (size_t i = 0; i < body.size(); ++i) body[i] = static_cast<char>((i * 2654435761u) >> 13);
  ASSERT_TRUE(client().PutObject(bucket(), "ckpt/big.bin", Bytes(body)).ok());
  auto st = tree().Stat("big.bin");
  ASSERT_TRUE(st.ok()) << st.error().ToString();
  auto lazy = tree().OpenLazy("big.bin", st->identity, nullptr, nullptr);
  ASSERT_TRUE(lazy.ok()) << lazy.error().ToString();
  const ByteSource& src = **lazy;
  const uint64_t before = client().counters().bytes_get;
  auto read = [&](uint64_t off, size_t n) {
    std::string out(n, '\0');
    const Status r = src.ReadAt(off, std::as_writable_bytes(std::span(out.data(), out.size())));
    EXPECT_TRUE(r.ok()) << r.ToString();
    EXPECT_EQ(out, body.substr(off, n)) << "at " << off;
  };
  read(0, 1000);                       // read first, then announced with what follows
  const uint64_t requests_before = client().counters().requests;
  const s3::ReadAheadStats stats_before = s3::S3ReadAhead::Stats();
  src.Prefetch(0, 9 * 1024 * 1024);    // [1000, 9 MiB) fetched ahead, in 4 MiB blocks
  EXPECT_EQ(s3::S3ReadAhead::HeldBytesTotal(), 9 * 1024 * 1024 - 1000u);
  read(1000, 4 * 1024 * 1024);         // straddles the first two blocks
  read(1000 + 4 * 1024 * 1024, 3 * 1024 * 1024);
  std::vector<std::string> outs(2, std::string(512 * 1024, '\0'));
  std::vector<ReadPiece> pieces = {
      {1000 + 7 * 1024 * 1024, std::as_writable_bytes(std::span(outs[0].data(), outs[0].size()))},
      {9 * 1024 * 1024, std::as_writable_bytes(std::span(outs[1].data(), outs[1].size()))}};  // not announced
  ASSERT_TRUE(src.ReadPieces(pieces).ok());
  EXPECT_EQ(outs[0], body.substr(1000 + 7 * 1024 * 1024, outs[0].size()));
  EXPECT_EQ(outs[1], body.substr(9 * 1024 * 1024, outs[1].size()));
  read(1000 + 7 * 1024 * 1024 + 512 * 1024, 9 * 1024 * 1024 - (1000 + 7 * 1024 * 1024 + 512 * 1024));
  EXPECT_EQ(client().counters().bytes_get - before, 9 * 1024 * 1024 + 512 * 1024u);  // each byte once
  EXPECT_EQ(client().counters().requests - requests_before, 4u);  // 3 blocks and the piece not announced
  EXPECT_EQ(s3::S3ReadAhead::HeldBytesTotal(), 0u);  // every block read to its end, dropped
  const s3::ReadAheadStats stats = s3::S3ReadAhead::Stats();
  EXPECT_EQ(stats.blocks_fetched - stats_before.blocks_fetched, 3u);
  EXPECT_EQ(stats.bytes_served - stats_before.bytes_served, 9 * 1024 * 1024 - 1000u);  // all but the piece not announced
  EXPECT_GE(stats.peak_held_bytes, 9 * 1024 * 1024 - 1000u);
  // The dropped blocks' buffers are kept for the next blocks, within the pool's bound.
  EXPECT_GE(stats.pooled_bytes, 3 * s3::kReadAheadBlockBytes);
  EXPECT_LE(stats.pooled_bytes, s3::kMaxPooledBlocks * s3::kReadAheadBlockBytes);
  // ... and freed once idle for kPoolIdleMs.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(3 * s3::kPoolIdleMs);
  while (s3::S3ReadAhead::Stats().pooled_bytes != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(s3::S3ReadAhead::Stats().pooled_bytes, 0u);
  (void)client().DeleteObject(bucket(), "ckpt/big.bin");
}

TEST_F(S3TreeTest, SubtreesAreRootedBelow) {
  auto sub = tree().Subtree("e");
  ASSERT_TRUE(sub.ok());
  EXPECT_EQ((*sub)->Root(), "s3://" + bucket() + "/ckpt/e");
  auto l = (*sub)->List("f");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(Names(*l), (std::vector<std::string>{"g.bin"}));
  auto f = (*sub)->Open("f/g.bin");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(Read(*f->bytes), "xyz");
  // A whole bucket is a tree too.
  auto whole = S3Tree::Make(tree().client(), "s3://" + bucket());
  ASSERT_TRUE(whole.ok());
  auto top = (*whole)->List("");
  ASSERT_TRUE(top.ok());
  EXPECT_EQ(Names(*top), (std::vector<std::string>{"ckpt", "ckptx"}));
}

TEST_F(S3TreeTest, PathsThatAreNotCleanAreRefused) {
  for (const char* bad : {"/a.bin", "../x", "b/../a.bin", "b//c.txt", "./a.bin", "b/"}) {
    EXPECT_EQ(CodeOf(tree().List(bad)), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(CodeOf(tree().Stat(bad)), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(CodeOf(tree().Open(bad)), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(CodeOf(tree().OpenLazy(bad, FileIdentity{}, nullptr, nullptr)), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(CodeOf(tree().Subtree(bad)), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(CodeOf(S3Tree::Make(tree().client(), "http://x/y")), StatusCode::kInvalidArgument);
  EXPECT_EQ(CodeOf(S3Tree::Make(tree().client(), "s3://b/../x")), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ucpfs
