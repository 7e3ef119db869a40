// The batched read path: the cached copy plan (slice::PlanCache) selects exactly the bytes a
// fresh plan reads, on random layouts and ranges; a ReadBatch defers plain reads and reads each
// source's as one batch, returning the first error in byte order; FileSource::ReadPieces through
// the fault engine retries shorts and names the failing piece; LazyFileSource::ReadPieces still
// catches an edit in place; a LocateScope leaves a view read's plain pieces in their files
// (where they lie, exactly) and still catches an edit in place; the read-ahead readers read ranges into the page cache, bounded.
// Seeded: UCPFS_TEST_SEED replays a run.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "core/io/file_source.h"
#include "core/io/io_engine.h"
#include "core/io/lazy_file_source.h"
#include "core/io/prefetcher.h"
#include "core/slice/plan_cache.h"
#include "views/atomic.h"
#include "test_seed.h"

namespace ucpfs {
namespace {

namespace fs = std::filesystem;
using slice::CopyOp;
using slice::Fragment;
using slice::PlanCache;
using slice::TensorLayout;
using Files = std::vector<std::shared_ptr<const ByteSource>>;

// A source that counts its ReadAt and ReadPieces calls and can fail at one offset.
class CountingSource final : public ByteSource {
 public:
  CountingSource(std::string name, std::vector<std::byte> bytes) : name_(std::move(name)), bytes_(std::move(bytes)) {}
  uint64_t Size() const override { return bytes_.size(); }
  const std::string& Name() const override { return name_; }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override {
    ++reads;
    if (fail_at != UINT64_MAX && fail_at >= byte_offset && fail_at < byte_offset + out.size()) {
      return IoError(name_ + ": injected at " + std::to_string(fail_at), 5);
    }
    std::memcpy(out.data(), bytes_.data() + byte_offset, out.size());
    return Status::Ok();
  }
  Status ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index) const override {
    ++batches;
    return ByteSource::ReadPieces(pieces, failed_index);
  }
  mutable int reads = 0, batches = 0;
  uint64_t fail_at = UINT64_MAX;

 private:
  std::string name_;
  std::vector<std::byte> bytes_;
};

std::vector<std::byte> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

Fragment Frag(std::vector<int64_t> off, std::vector<int64_t> size, uint32_t file, uint64_t byte_offset = 0) {
  Fragment f;
  f.box.offsets = std::move(off);
  f.box.sizes = std::move(size);
  f.flat_hi = f.box.Volume();
  f.file_id = file;
  f.byte_offset = byte_offset;
  return f;
}

// A [rows, cols] float32 tensor in four kinds of pieces: row shards (file 0), a transposed
// column block (file 1, strided), flat ranges of the last row block (file 2), zero padding.
struct Mixed {
  TensorLayout layout;
  Files files;
};
Mixed MakeMixed(std::mt19937_64& rng) {
  const int64_t rows = 8 + static_cast<int64_t>(rng() % 8), cols = 6 + static_cast<int64_t>(rng() % 6);
  Mixed m;
  m.layout.shape = {rows, cols};
  const int64_t r1 = rows / 2, c1 = cols / 2, r2 = rows - 2;
  // Rows [0, r1): row-major shard in file 0.
  m.layout.fragments.push_back(Frag({0, 0}, {r1, cols}, 0));
  // Rows [r1, r2), cols [0, c1): stored transposed in file 1.
  Fragment t = Frag({r1, 0}, {r2 - r1, c1}, 1, 8);
  t.strides = {1, r2 - r1};
  m.layout.fragments.push_back(t);
  // Rows [r1, r2), cols [c1, cols): zero padding.
  m.layout.fragments.push_back(Frag({r1, c1}, {r2 - r1, cols - c1}, slice::kZeroFileId));
  // Rows [r2, rows): two flat ranges in file 2.
  const uint64_t n_last = static_cast<uint64_t>(2 * cols), cut = 1 + rng() % (n_last - 1);
  Fragment lo = Frag({r2, 0}, {2, cols}, 2, 0);
  lo.flat_hi = cut;
  Fragment hi = Frag({r2, 0}, {2, cols}, 2, 4096);
  hi.flat_lo = cut;
  m.layout.fragments.push_back(lo);
  m.layout.fragments.push_back(hi);
  for (int i = 0; i < 3; ++i) m.files.push_back(std::make_shared<MemorySource>("f" + std::to_string(i), RandomBytes(rng, 8192)));
  return m;
}

TEST(PlanCache, SelectReadsWhatAFreshPlanReads) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed());
  for (int round = 0; round < 40; ++round) {
    Mixed m = MakeMixed(rng);
    ASSERT_TRUE(slice::ValidateCoverage(m.layout, "mixed").ok());
    const DType dst = round % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
    PlanCache cache(m.layout, dst);
    ASSERT_TRUE(cache.Cached());
    auto whole = slice::PlanRead(m.layout, dst, 0, m.layout.NumElems());
    ASSERT_TRUE(whole.ok());
    EXPECT_GE(slice::PlanOpsBound(m.layout), whole->size());
    const uint64_t isz = ItemSize(dst), n_bytes = m.layout.NumElems() * isz;
    for (int k = 0; k < 30; ++k) {
      // Byte ranges, unaligned ones included (partial first and last elements).
      const uint64_t a = rng() % n_bytes, b = a + 1 + rng() % (n_bytes - a);
      std::vector<std::byte> fresh(b - a), cached(b - a);
      ASSERT_TRUE(slice::ReadTensorBytes(m.layout, dst, m.files, a, fresh).ok());
      ASSERT_TRUE(slice::ReadTensorBytes(m.layout, dst, m.files, a, cached, &cache).ok());
      ASSERT_EQ(fresh, cached) << "round " << round << " bytes [" << a << ", " << b << ")";
      // The selected ops of an element range are the fresh plan's bytes too.
      const uint64_t e0 = a / isz, e1 = std::max(e0 + 1, b / isz);
      std::vector<CopyOp> ops;
      ASSERT_TRUE(cache.Select(e0, e1, ops));
      std::vector<std::byte> by_select((e1 - e0) * isz), by_plan((e1 - e0) * isz);
      ASSERT_TRUE(slice::ExecutePlan(ops, m.files, by_select).ok());
      auto planned = slice::PlanRead(m.layout, dst, e0, e1);
      ASSERT_TRUE(planned.ok());
      ASSERT_TRUE(slice::ExecutePlan(*planned, m.files, by_plan).ok());
      ASSERT_EQ(by_select, by_plan);
    }
  }
}

TEST(PlanCache, BudgetIsCountedAndGivenBack) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 1);
  Mixed m = MakeMixed(rng);
  const uint64_t before = PlanCache::BytesInUse();
  {
    PlanCache cache(m.layout, DType::kFloat32);
    EXPECT_EQ(PlanCache::BytesInUse(), before);  // nothing planned before the first read
    ASSERT_TRUE(cache.Cached());
    EXPECT_GT(PlanCache::BytesInUse(), before);
  }
  EXPECT_EQ(PlanCache::BytesInUse(), before);
  // A tensor whose plan could pass the op bound is not cached; its reads plan as before.
  TensorLayout wide;
  const int64_t rows = static_cast<int64_t>(PlanCache::kMaxCachedOps) + 10;
  wide.shape = {rows, 2};
  Fragment t = Frag({0, 0}, {rows, 1}, 0);
  t.strides = {1, rows};  // a column stored alone: one op per row
  wide.fragments.push_back(t);
  wide.fragments.push_back(Frag({0, 1}, {rows, 1}, 0, static_cast<uint64_t>(rows) * 4));
  EXPECT_GT(slice::PlanOpsBound(wide), PlanCache::kMaxCachedOps);
  PlanCache big(wide, DType::kFloat32);
  std::vector<CopyOp> ops;
  EXPECT_FALSE(big.Select(0, 4, ops));
  EXPECT_EQ(PlanCache::BytesInUse(), before);
  // A layout with a gap is not cached either; the range's own plan reports the gap.
  TensorLayout gap;
  gap.shape = {4};
  gap.fragments.push_back(Frag({0}, {2}, 0));
  PlanCache broken(gap, DType::kFloat32);
  EXPECT_FALSE(broken.Select(0, 4, ops));
  Files one{std::make_shared<MemorySource>("g", std::vector<std::byte>(64))};
  std::vector<std::byte> out(16);
  EXPECT_EQ(slice::ReadTensorBytes(gap, DType::kFloat32, one, 0, out, &broken).code(), StatusCode::kCorrupt);
}

TEST(ReadBatch, DefersPlainReadsAndReadsEachSourceOnce) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 2);
  auto a = std::make_shared<CountingSource>("a", RandomBytes(rng, 4096));
  auto b = std::make_shared<CountingSource>("b", RandomBytes(rng, 4096));
  std::vector<std::byte> out(6 * 100), want(6 * 100);
  {
    ReadBatch batch;
    for (int i = 0; i < 6; ++i) {
      const auto& src = i % 2 == 0 ? a : b;
      const uint64_t at = static_cast<uint64_t>(i) * 300;
      ASSERT_TRUE(src->ReadAt(at, std::span(want).subspan(i * 100, 100)).ok());
      ASSERT_TRUE(ReadOrDefer(*src, at, std::span(out).subspan(i * 100, 100)).ok());
    }
    {
      ReadBatch inner;  // nests: it reads only what is deferred while it is the innermost
      EXPECT_TRUE(inner.Finish().ok());
    }
    EXPECT_EQ(ReadBatch::PendingPieces(), 6u);
    a->reads = b->reads = 0;
    ASSERT_TRUE(batch.Finish().ok());
    EXPECT_EQ(ReadBatch::PendingPieces(), 0u);
  }
  EXPECT_EQ(out, want);
  EXPECT_EQ(a->batches, 1);
  EXPECT_EQ(b->batches, 1);
  EXPECT_EQ(a->reads + b->reads, 6);
  // Without a batch open, a read is a read.
  std::vector<std::byte> one(10);
  ASSERT_TRUE(ReadOrDefer(*a, 0, one).ok());
  EXPECT_EQ(a->batches, 1);
}

TEST(ReadBatch, FirstErrorInByteOrderAcrossSources) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 3);
  auto a = std::make_shared<CountingSource>("a", RandomBytes(rng, 4096));
  auto b = std::make_shared<CountingSource>("b", RandomBytes(rng, 4096));
  a->fail_at = 2000;  // a's third piece fails
  b->fail_at = 100;   // b's first piece fails: it comes earlier in byte order
  std::vector<std::byte> out(400);
  ReadBatch batch;
  ASSERT_TRUE(ReadOrDefer(*a, 0, std::span(out).subspan(0, 100)).ok());
  ASSERT_TRUE(ReadOrDefer(*a, 1000, std::span(out).subspan(100, 100)).ok());
  ASSERT_TRUE(ReadOrDefer(*b, 50, std::span(out).subspan(200, 100)).ok());
  ASSERT_TRUE(ReadOrDefer(*a, 1950, std::span(out).subspan(300, 100)).ok());
  Status s = batch.Finish();
  EXPECT_EQ(s.code(), StatusCode::kIo);
  EXPECT_NE(s.message().find("b: injected at 100"), std::string::npos) << s.message();
}

TEST(ReadBatch, ViewReadFailsAsAWholeAndReadsOncePerSource) {
  // An atomic file over two shard files: one ReadAt of the whole file reads each shard in one
  // batch; a failing shard fails the whole read, naming it.
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 4);
  auto s0 = std::make_shared<CountingSource>("shard0", RandomBytes(rng, 4 * 64));
  auto s1 = std::make_shared<CountingSource>("shard1", RandomBytes(rng, 4 * 64));
  auto layout = std::make_shared<TensorLayout>();
  layout->shape = {16, 8};
  layout->fragments = {Frag({0, 0}, {8, 8}, 0), Frag({8, 0}, {8, 8}, 1)};
  auto files = std::make_shared<Files>(Files{s0, s1});
  auto file = views::BuildAtomicFile(layout, {}, files, "atomic/w/fp32.pt");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  std::vector<std::byte> all((*file)->Size());
  ASSERT_TRUE((*file)->ReadAt(0, all).ok());
  EXPECT_EQ(s0->batches, 1);
  EXPECT_EQ(s1->batches, 1);
  // The tensor's bytes are the shards' back to back.
  std::vector<std::byte> shards(512);
  ASSERT_TRUE(s0->ReadAt(0, std::span(shards).first(256)).ok());
  ASSERT_TRUE(s1->ReadAt(0, std::span(shards).last(256)).ok());
  EXPECT_NE(std::search(all.begin(), all.end(), shards.begin(), shards.end()), all.end());
  s1->fail_at = 8;
  Status st = (*file)->ReadAt(0, all);
  EXPECT_EQ(st.code(), StatusCode::kIo);
  EXPECT_NE(st.message().find("shard1"), std::string::npos) << st.message();
  EXPECT_EQ(ReadBatch::PendingPieces(), 0u);
}

class FilePieces : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ucpfs_read_path_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& name, const std::vector<std::byte>& bytes) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                                static_cast<std::streamsize>(bytes.size()));
    return path;
  }
  fs::path dir_;
};

TEST_F(FilePieces, BatchThroughFaultEngine) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 5);
  const auto bytes = RandomBytes(rng, 1 << 20);
  const std::string path = Write("a.bin", bytes);
  // Shorts and EINTR everywhere: retried, the bytes are right.
  std::vector<io::Fault> faults;
  for (int i = 0; i < 16; ++i) {
    faults.push_back({.kind = io::OpKind::kRead, .byte_offset = rng() % bytes.size(),
                      .effect = i % 2 ? io::Fault::Effect::kShort : io::Fault::Effect::kEintr, .times = -1});
  }
  auto plan = std::make_shared<io::FaultPlan>(faults);
  auto file = FileSource::Open(path, [plan] { return io::MakeFaultEngine(io::MakePreadEngine(), plan); });
  ASSERT_TRUE(file.ok());
  std::vector<std::byte> out(8 * 4096);
  std::vector<ReadPiece> pieces;
  for (int i = 0; i < 8; ++i) {
    pieces.push_back({static_cast<uint64_t>(rng() % (bytes.size() - 4096)), std::span(out).subspan(i * 4096, 4096)});
  }
  ASSERT_TRUE((*file)->ReadPieces(pieces).ok());
  for (const auto& p : pieces) {
    ASSERT_EQ(0, std::memcmp(p.out.data(), bytes.data() + p.byte_offset, p.out.size()));
  }
  // EIO inside the third piece: that piece is named, with the offset and the errno.
  pieces.clear();
  for (int i = 0; i < 4; ++i) pieces.push_back({static_cast<uint64_t>(i) * 100000, std::span(out).subspan(i * 4096, 4096)});
  auto eio = std::make_shared<io::FaultPlan>(std::vector<io::Fault>{
      {.kind = io::OpKind::kRead, .byte_offset = 200000 + 17, .effect = io::Fault::Effect::kError, .sys_errno = EIO, .times = -1}});
  auto failing = FileSource::Open(path, [eio] { return io::MakeFaultEngine(io::MakePreadEngine(), eio); });
  ASSERT_TRUE(failing.ok());
  size_t failed = 99;
  Status s = (*failing)->ReadPieces(pieces, &failed);
  EXPECT_EQ(s.code(), StatusCode::kIo);
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_EQ(failed, 2u);
  EXPECT_NE(s.message().find(path + ": pread at offset 200017"), std::string::npos) << s.message();
  // The thread's own engine (io_uring where it can be used) reads the same bytes, from pages
  // the page cache does not hold too (the descriptor is blocking: no nowait EAGAIN loop).
  auto plain = FileSource::Open(path);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(::fcntl((*plain)->fd(), F_GETFL) & O_NONBLOCK, 0);
  (void)::posix_fadvise((*plain)->fd(), 0, 0, POSIX_FADV_DONTNEED);
  std::vector<std::byte> again(out.size());
  for (auto& p : pieces) p.out = std::span(again).subspan(static_cast<size_t>(p.out.data() - out.data()), p.out.size());
  ASSERT_TRUE((*plain)->ReadPieces(pieces).ok());
  for (const auto& p : pieces) ASSERT_EQ(0, std::memcmp(p.out.data(), bytes.data() + p.byte_offset, p.out.size()));
  // Past the end: kOutOfRange, nothing read.
  std::vector<ReadPiece> past{{bytes.size() - 10, std::span(out).first(20)}};
  EXPECT_EQ((*plain)->ReadPieces(past).code(), StatusCode::kOutOfRange);
}

// Pieces that follow each other in the file are read as one op (a column-split tensor's rows),
// scattered into their places, or straight into memory they tile; an error inside such a run
// still names the piece and offset, and a file that shrank is still kDataLoss.
TEST_F(FilePieces, AdjacentPiecesReadAsOne) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 8);
  const auto bytes = RandomBytes(rng, 1 << 20);
  const std::string path = Write("cols.bin", bytes);
  // Counts the read ops that reach the engine.
  class Counting final : public io::IoEngine {
   public:
    Counting(std::unique_ptr<io::IoEngine> inner, std::shared_ptr<std::atomic<int>> n) : inner_(std::move(inner)), n_(std::move(n)) {}
    std::string Name() const override { return "counting(" + inner_->Name() + ")"; }
    Status Submit(std::span<const io::IoOp> ops) override {
      *n_ += static_cast<int>(ops.size());
      return inner_->Submit(ops);
    }
    Result<size_t> Reap(std::span<io::IoCompletion> out, bool wait) override { return inner_->Reap(out, wait); }
    size_t InFlight() const override { return inner_->InFlight(); }
    unsigned QueueDepth() const override { return inner_->QueueDepth(); }
    Status RegisterBuffers(std::span<const iovec> r) override { return inner_->RegisterBuffers(r); }
    Status RegisterBufferSlots(unsigned n) override { return inner_->RegisterBufferSlots(n); }
    Status UpdateBuffer(unsigned i, const iovec& r) override { return inner_->UpdateBuffer(i, r); }

   private:
    std::unique_ptr<io::IoEngine> inner_;
    std::shared_ptr<std::atomic<int>> n_;
  };
  auto n_ops = std::make_shared<std::atomic<int>>(0);
  for (const bool faulty : {false, true}) {
    std::vector<io::Fault> faults;
    if (faulty) {  // shorts and EINTR inside the merged runs: resumed, the bytes are right
      for (int i = 0; i < 8; ++i) {
        faults.push_back({.kind = io::OpKind::kRead, .byte_offset = rng() % 200000,
                          .effect = i % 2 ? io::Fault::Effect::kShort : io::Fault::Effect::kEintr, .times = -1});
      }
    }
    auto plan = std::make_shared<io::FaultPlan>(faults);
    auto file = FileSource::Open(path, [plan, n_ops] {
      return std::make_unique<Counting>(io::MakeFaultEngine(io::MakePreadEngine(), plan), n_ops);
    });
    ASSERT_TRUE(file.ok());
    // 24 rows of 8000 bytes adjacent in the file, every other slot of `out` (two files' columns
    // interleave in a view row); then 5 pieces adjacent in the file and in memory; then a lone one.
    std::vector<std::byte> out(64 * 8000, std::byte{0x55});
    std::vector<ReadPiece> pieces;
    for (int r = 0; r < 24; ++r) pieces.push_back({static_cast<uint64_t>(r) * 8000, std::span(out).subspan(2 * r * 8000, 8000)});
    for (int r = 0; r < 5; ++r) {
      pieces.push_back({500000 + static_cast<uint64_t>(r) * 3000, std::span(out).subspan(48 * 8000 + r * 3000, 3000)});
    }
    pieces.push_back({900000, std::span(out).subspan(60 * 8000, 100)});
    n_ops->store(0);
    ASSERT_TRUE((*file)->ReadPieces(pieces).ok());
    EXPECT_EQ(n_ops->load(), 3) << "30 pieces in 3 runs of the file";
    for (const auto& p : pieces) ASSERT_EQ(0, std::memcmp(p.out.data(), bytes.data() + p.byte_offset, p.out.size()));
    for (int r = 0; r < 24; ++r) ASSERT_EQ(out[(2 * r + 1) * 8000], std::byte{0x55}) << "wrote outside a piece";
  }
  // EIO inside the 7th row of a merged run: the 7th piece is named, at the failing offset.
  auto eio = std::make_shared<io::FaultPlan>(std::vector<io::Fault>{
      {.kind = io::OpKind::kRead, .byte_offset = 6 * 8000 + 123, .effect = io::Fault::Effect::kError, .sys_errno = EIO, .times = -1}});
  auto failing = FileSource::Open(path, [eio] { return io::MakeFaultEngine(io::MakePreadEngine(), eio); });
  ASSERT_TRUE(failing.ok());
  std::vector<std::byte> out(24 * 16000);
  std::vector<ReadPiece> rows;
  for (int r = 0; r < 24; ++r) rows.push_back({static_cast<uint64_t>(r) * 8000, std::span(out).subspan(2 * r * 8000, 8000)});
  size_t failed = 99;
  Status s = (*failing)->ReadPieces(rows, &failed);
  EXPECT_EQ(s.code(), StatusCode::kIo);
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_EQ(failed, 6u);
  EXPECT_NE(s.message().find(path + ": pread at offset 48123"), std::string::npos) << s.message();
  // The file shrinks under an open source: the merged read is short, the last piece past the new
  // end is the one reported, as kDataLoss.
  auto plain = FileSource::Open(path);
  ASSERT_TRUE(plain.ok());
  ASSERT_EQ(::truncate(path.c_str(), 20 * 8000 + 10), 0);
  failed = 99;
  s = (*plain)->ReadPieces(rows, &failed);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_EQ(failed, 20u);
  EXPECT_NE(s.message().find("file shrank: short read at offset 160010"), std::string::npos) << s.message();
}

TEST_F(FilePieces, LazyBatchCatchesAnEditInPlace) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 6);
  const auto bytes = RandomBytes(rng, 65536);
  const std::string path = Write("shard.bin", bytes);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  auto counters = std::make_shared<IoCounters>();
  LazyFileSource lazy(path, FileIdentity::Of(st), counters, std::make_shared<FdCache>(4));
  std::vector<std::byte> out(3 * 1000);
  std::vector<ReadPiece> pieces{{0, std::span(out).subspan(0, 1000)},
                                {30000, std::span(out).subspan(1000, 1000)},
                                {64000, std::span(out).subspan(2000, 1000)}};
  ASSERT_TRUE(lazy.ReadPieces(pieces).ok());
  EXPECT_EQ(0, std::memcmp(out.data() + 1000, bytes.data() + 30000, 1000));
  EXPECT_EQ(counters->source_reads.load(), 3u);
  EXPECT_EQ(counters->source_bytes_read.load(), 3000u);
  EXPECT_EQ(counters->files_opened.load(), 1u);
  // An edit in place (same size, new mtime) fails the next batch with kDataLoss.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('x');
  }
  Status s = lazy.ReadPieces(pieces);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find("changed while open"), std::string::npos) << s.message();
  EXPECT_EQ(counters->source_read_errors.load(), 1u);
}

// Fills each located piece from its file, as the mount's spliced reply does.
void FillLocated(const std::vector<LocatedPiece>& located) {
  for (const LocatedPiece& p : located) {
    ASSERT_EQ(::pread(p.where.fd, p.out, p.n_bytes, static_cast<off_t>(p.where.byte_offset)),
              static_cast<ssize_t>(p.n_bytes));
  }
}

TEST_F(FilePieces, LocateScopeLeavesPlainPiecesInTheirFiles) {
  // The MakeMixed layout over two file shards (row shards: plain pieces; a transposed block:
  // gathered) and a memory one (flat ranges: plain, but not in a file), at a file offset inside
  // a slice: with the located pieces filled from their files, a read under a LocateScope equals
  // a plain read, at every offset and size tried.
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 8);
  Mixed m = MakeMixed(rng);
  auto counters = std::make_shared<IoCounters>();
  auto cache = std::make_shared<FdCache>(4);
  for (int i = 0; i < 2; ++i) {
    std::vector<std::byte> bytes(8192 + 100);
    std::vector<std::byte> mine(8192);
    ASSERT_TRUE(m.files[i]->ReadAt(0, mine).ok());
    std::copy(mine.begin(), mine.end(), bytes.begin() + 100);
    const std::string path = Write("shard" + std::to_string(i), bytes);
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    auto lazy = std::make_shared<LazyFileSource>(path, FileIdentity::Of(st), counters, cache);
    auto slice = SliceSource::Make(lazy, 100, 8192);
    ASSERT_TRUE(slice.ok());
    m.files[i] = *slice;
  }
  auto layout = std::make_shared<TensorLayout>(m.layout);
  auto file = views::BuildAtomicFile(layout, {}, std::make_shared<Files>(m.files), "atomic/w/fp32.pt");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  std::vector<std::byte> want((*file)->Size());
  ASSERT_TRUE((*file)->ReadAt(0, want).ok());
  size_t n_located = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const uint64_t off = rng() % want.size();
    const size_t n = 1 + rng() % (want.size() - off);
    std::vector<std::byte> got(n, std::byte{0xee});
    {
      LocateScope scope(1 + rng() % 64, 1 + rng() % 4);
      ASSERT_TRUE((*file)->ReadAt(off, got).ok());
      n_located += scope.pieces().size();
      for (const LocatedPiece& p : scope.pieces()) {
        ASSERT_GE(p.out, got.data());
        ASSERT_LE(p.out + p.n_bytes, got.data() + got.size());
      }
      FillLocated(scope.pieces());
    }
    ASSERT_EQ(0, std::memcmp(got.data(), want.data() + off, n)) << "offset " << off << " size " << n;
  }
  EXPECT_GT(n_located, 0u);
  // Only pieces of at least min_piece_bytes, at most max_pieces of them.
  {
    std::vector<std::byte> got(want.size());
    LocateScope scope(UINT64_MAX, 64);
    ASSERT_TRUE((*file)->ReadAt(0, got).ok());
    EXPECT_TRUE(scope.pieces().empty());
    EXPECT_EQ(got, want);
  }
  {
    std::vector<std::byte> got(want.size());
    LocateScope scope(1, 1);
    ASSERT_TRUE((*file)->ReadAt(0, got).ok());
    EXPECT_EQ(scope.pieces().size(), 1u);
  }
  // An edit in place of a shard fails the located read (kDataLoss), as a read would.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  {
    std::fstream f((dir_ / "shard0").string(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('x');
  }
  std::vector<std::byte> got(want.size());
  LocateScope scope(1, 64);
  Status s = (*file)->ReadAt(0, got);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find("shard0"), std::string::npos) << s.message();
}

TEST_F(FilePieces, PrefetcherReadsRangesIntoThePageCache) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 7);
  const auto bytes = RandomBytes(rng, 3 << 20);
  const std::string path = Write("p.bin", bytes);
  auto file = FileSource::Open(path);
  ASSERT_TRUE(file.ok());
  io::Prefetcher prefetcher(2, 2);
  ASSERT_TRUE(prefetcher.Enqueue(*file, 1000, 2 << 20));
  ASSERT_TRUE(prefetcher.Enqueue(*file, (3 << 20) - 10, 1 << 20));  // clipped to the file
  prefetcher.Drain();
  auto c = prefetcher.counters();
  EXPECT_EQ(c.ranges_queued, 2u);
  // Every byte was either read or found cached (the file was just written: cached, where the
  // kernel can tell).
  EXPECT_EQ(c.bytes_read + c.bytes_cached, (2u << 20) + 10u);
  // A queue of 2 ranges: enqueued faster than they are read, the rest are dropped (counted), the
  // queue does not grow.
  uint64_t dropped = 0;
  for (int i = 0; i < 1000; ++i) dropped += prefetcher.Enqueue(*file, 0, 3 << 20) ? 0 : 1;
  prefetcher.Drain();
  EXPECT_EQ(prefetcher.counters().ranges_dropped, dropped);
  EXPECT_EQ(prefetcher.counters().ranges_queued + dropped, 1002u);
}

// How many pages of [byte_offset, +n_bytes) of `path` (page-aligned) are in the page cache
// with their reads complete (mincore over a mapping).
size_t PagesCached(const std::string& path, size_t byte_offset, size_t n_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  void* map = ::mmap(nullptr, n_bytes, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(byte_offset));
  ::close(fd);
  if (map == MAP_FAILED) return 0;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> present((n_bytes + page - 1) / page);
  size_t n = 0;
  if (::mincore(map, n_bytes, present.data()) == 0) {
    for (unsigned char p : present) n += p & 1;
  }
  ::munmap(map, n_bytes);
  return n;
}

TEST_F(FilePieces, ReadAheadDescriptorIsASecondOpenOfTheSameFile) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 9);
  const std::string path = Write("ra.bin", RandomBytes(rng, 1 << 16));
  const auto open_fds = [] {
    return std::distance(fs::directory_iterator("/proc/self/fd"), fs::directory_iterator{});
  };
  const auto before = open_fds();
  std::shared_ptr<FileSource> file, other;
  {
    auto opened = FileSource::Open(path);
    ASSERT_TRUE(opened.ok());
    file = *opened;
  }
  const int fd = file->read_ahead_fd();
  EXPECT_EQ(fd, file->read_ahead_fd());  // opened once
  const bool reopened = fd != file->fd();
  struct stat a {}, b {};
  ASSERT_EQ(::fstat(file->fd(), &a), 0);
  ASSERT_EQ(::fstat(fd, &b), 0);
  EXPECT_EQ(a.st_dev, b.st_dev);
  EXPECT_EQ(a.st_ino, b.st_ino);
  // Its own descriptor where /proc is there, read-only and closed on exec.
  if (reopened) {
    EXPECT_EQ(::fcntl(fd, F_GETFL) & O_ACCMODE, O_RDONLY);
    EXPECT_NE(::fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
  } else {
    EXPECT_FALSE(fs::exists("/proc/self/fd")) << "read_ahead_fd() fell back to fd() with /proc there";
  }
  // The same inode even when the path names another file by then (reopened through
  // /proc/self/fd, never by the path).
  {
    auto opened = FileSource::Open(path);
    ASSERT_TRUE(opened.ok());
    other = *opened;
  }
  fs::rename(path, (dir_ / "moved.bin").string());
  Write("ra.bin", RandomBytes(rng, 100));
  struct stat c {};
  ASSERT_EQ(::fstat(other->read_ahead_fd(), &c), 0);
  EXPECT_EQ(c.st_ino, a.st_ino);
  EXPECT_EQ(c.st_size, 1 << 16);
  // Both descriptors close with the file.
  EXPECT_EQ(open_fds(), before + (reopened ? 4 : 2));
  file.reset();
  other.reset();
  EXPECT_EQ(open_fds(), before);
}

TEST_F(FilePieces, PrefetcherBringsAColdRangeIntoThePageCache) {
  // A file written and synced, its pages dropped (POSIX_FADV_DONTNEED; where the file system
  // keeps them, e.g. tmpfs, only the byte count is checked): the readers' pass brings every page
  // of the range into the page cache (the kernel's read-ahead may go on past its end: those
  // later chunks count as found cached), and nothing before its start.
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 10);
  const size_t n_bytes = size_t{24} << 20;
  const std::string path = Write("cold.bin", RandomBytes(rng, n_bytes));
  {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fdatasync(fd), 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    ::close(fd);
  }
  const bool evicted = PagesCached(path, 0, n_bytes) == 0;
  auto file = FileSource::Open(path);
  ASSERT_TRUE(file.ok());
  io::Prefetcher prefetcher(1, 4);
  const uint64_t from = 3 << 20, n = 17 << 20;  // two 8 MiB chunks and a part
  ASSERT_TRUE(prefetcher.Enqueue(*file, from, n));
  prefetcher.Drain();
  const auto c = prefetcher.counters();
  EXPECT_EQ(c.bytes_read + c.bytes_cached, n);
  if (!evicted) GTEST_SKIP() << "the file system kept the pages: only the byte count was checked";
  EXPECT_GE(c.bytes_read, uint64_t{8} << 20);  // at least the first chunk was read, not found
  // mincore counts a page once its read has completed: wait for the reads the pass started.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  size_t in_range = 0;
  for (int i = 0; i < 500 && in_range < n / page; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    in_range = PagesCached(path, from, n);
  }
  EXPECT_EQ(in_range, n / page);
  EXPECT_EQ(PagesCached(path, 0, from), 0u);
}

}  // namespace
}  // namespace ucpfs
