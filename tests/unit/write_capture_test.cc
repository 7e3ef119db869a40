// Write capture without a kernel: files written into a WriteCapture over a real directory land
// byte-exact under their final names, in close order, only when complete; a cache smaller than
// the files streams them (back-pressure, never an error); a flush error is reported by Fsync and
// keeps the data until Sync retries; recovery after a crash finishes complete files in commit
// order and discards incomplete ones and everything committed after them. Also the journal
// parser on damaged input. Seeded: UCPFS_TEST_SEED replays a run.
#include "core/io/write_capture.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/io/capture_journal.h"
#include "core/io/capture_mount.h"
#include "test_seed.h"

namespace ucpfs::io {
namespace {

namespace stdfs = std::filesystem;

std::vector<std::byte> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

std::vector<std::byte> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(raw.size());
  if (!raw.empty()) std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

class WriteCaptureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = stdfs::temp_directory_path() / ("ucpfs-capture-" + std::to_string(getpid()) + "-" +
                                           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    stdfs::remove_all(dir_);
    stdfs::create_directories(dir_ / "sub");
    src_fd_ = open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ASSERT_GE(src_fd_, 0);
    sub_fd_ = open((dir_ / "sub").c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    ASSERT_GE(sub_fd_, 0);
  }
  void TearDown() override {
    capture_.reset();
    close(sub_fd_);
    close(src_fd_);
    stdfs::remove_all(dir_);
  }
  void Start(size_t n_chunks, size_t chunk_bytes = 64 << 10, std::function<std::unique_ptr<IoEngine>()> engine = {}) {
    capture_ = StartAnother(n_chunks, chunk_bytes, std::move(engine));
  }
  // One more WriteCapture of the same SRC: another mount of it.
  std::unique_ptr<WriteCapture> StartAnother(size_t n_chunks, size_t chunk_bytes = 64 << 10,
                                             std::function<std::unique_ptr<IoEngine>()> engine = {}) {
    PinnedCacheOptions co;
    co.capacity_bytes = n_chunks * chunk_bytes;
    co.chunk_bytes = chunk_bytes;
    co.allow_cuda = false;
    co.lock_on_first_use = true;  // as the mount makes it
    auto cache = PinnedCache::Make(co);
    EXPECT_TRUE(cache.ok()) << cache.error().ToString();
    if (!cache.ok()) return nullptr;
    WriteCaptureOptions o;
    o.source_dirfd = src_fd_;
    o.source_dir = dir_.string();
    o.cache = std::shared_ptr<PinnedCache>(std::move(*cache));
    o.make_engine = std::move(engine);
    o.log = [this](const std::string& line) {
      std::lock_guard lock(durable_mu_);
      log_.push_back(line);
    };
    o.on_durable = [this](const std::string& rel) {
      std::lock_guard lock(durable_mu_);
      durable_.push_back(rel);
    };
    o.before_replace = before_replace_;
    o.before_settled = before_settled_;
    o.on_part_change = on_part_change_;
    o.write_stall_timeout_ms = write_stall_timeout_ms_;
    o.names = names_;
    auto wc = WriteCapture::Start(std::move(o));
    EXPECT_TRUE(wc.ok()) << wc.error().ToString();
    return wc.ok() ? std::move(*wc) : nullptr;
  }
  std::shared_ptr<CapturedFile> Create(const std::string& name, int dirfd = -1) {
    auto f = capture_->Create(dirfd < 0 ? src_fd_ : dirfd, name, 0640);
    EXPECT_TRUE(f.ok()) << f.error().ToString();
    return f.ok() ? *f : nullptr;
  }
  void WriteAll(CapturedFile& f, const std::vector<std::byte>& data, size_t piece) {
    for (size_t at = 0; at < data.size(); at += piece) {
      const size_t n = std::min(piece, data.size() - at);
      ASSERT_TRUE(capture_->Write(f, at, std::span(data.data() + at, n)).ok());
    }
  }

  stdfs::path dir_;
  int src_fd_ = -1;
  int sub_fd_ = -1;
  std::unique_ptr<WriteCapture> capture_;
  std::vector<std::string> log_;
  std::mutex durable_mu_;
  std::vector<std::string> durable_;
  std::function<void(const std::string&)> before_replace_;  // set before Start
  std::function<Status(const std::string&, const struct stat&)> before_settled_;  // set before Start
  std::function<void(const PartChange&)> on_part_change_;                         // set before Start
  uint64_t write_stall_timeout_ms_ = 30000;                 // set before Start
  std::shared_ptr<NameOps> names_;                          // set before Start (null: the real ones)
};

TEST_F(WriteCaptureTest, FilesLandByteExactInCloseOrderOnlyWhenComplete) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed());
  Start(/*n_chunks=*/16);
  // Uneven sizes: empty, smaller than a chunk, unaligned tails, several chunks.
  const std::vector<size_t> sizes = {0, 1, 4095, 4097, 65536, 65536 * 3 + 17, 300000};
  std::vector<std::vector<std::byte>> data;
  std::vector<std::shared_ptr<CapturedFile>> files;
  for (size_t i = 0; i < sizes.size(); ++i) {
    data.push_back(RandomBytes(rng, sizes[i]));
    files.push_back(Create("shard_" + std::to_string(i) + ".bin", i % 2 == 0 ? src_fd_ : sub_fd_));
    WriteAll(*files.back(), data.back(), 1 + rng() % 70000);
    // Not visible under its final name while being written.
    const stdfs::path final_path = (i % 2 == 0 ? dir_ : dir_ / "sub") / ("shard_" + std::to_string(i) + ".bin");
    EXPECT_FALSE(stdfs::exists(final_path));
    // Readers of the file being written see the bytes written.
    std::vector<std::byte> back(sizes[i]);
    auto n = capture_->Read(*files.back(), 0, back);
    ASSERT_TRUE(n.ok());
    EXPECT_EQ(*n, sizes[i]);
    EXPECT_EQ(back, data.back());
    EXPECT_EQ(static_cast<size_t>(capture_->Stat(*files.back()).st_size), sizes[i]);
  }
  for (auto& f : files) ASSERT_TRUE(capture_->Close(*f).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  for (size_t i = 0; i < sizes.size(); ++i) {
    const stdfs::path p = (i % 2 == 0 ? dir_ : dir_ / "sub") / ("shard_" + std::to_string(i) + ".bin");
    EXPECT_EQ(ReadFile(p), data[i]) << p;
    EXPECT_EQ(stdfs::status(p).permissions() & stdfs::perms::all, static_cast<stdfs::perms>(0640));
  }
  std::lock_guard lock(durable_mu_);
  ASSERT_EQ(durable_.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(durable_[i], (i % 2 == 0 ? "" : "sub/") + ("shard_" + std::to_string(i) + ".bin"));
  }
  // Nothing captured is alive: the journal is back to its magic alone.
  const stdfs::path state = capture_->Stats().state_dir;
  EXPECT_EQ(state.parent_path(), dir_ / ".ucpfs" / "capture");
  EXPECT_EQ(stdfs::file_size(state / "journal"), sizeof(kJournalMagic));
  for (const auto& e : stdfs::recursive_directory_iterator(dir_ / ".ucpfs" / "capture")) {
    EXPECT_NE(e.path().extension(), ".part") << e.path();
  }
}

TEST_F(WriteCaptureTest, BeforeReplaceIsCalledWhileTheOldFileIsStillInPlace) {
  // A served view's source file: whoever still reads it opens it before the new one lands.
  { std::ofstream(dir_ / "sub" / "shard.bin", std::ios::binary) << "old bytes"; }
  std::vector<std::string> called;
  int old_fd = -1;
  before_replace_ = [&](const std::string& rel) {
    called.push_back(rel);
    old_fd = open((dir_ / rel).c_str(), O_RDONLY | O_CLOEXEC);
  };
  Start(/*n_chunks=*/4);
  auto f = Create("shard.bin", sub_fd_);
  const std::string text = "new bytes, longer";
  ASSERT_TRUE(capture_->Write(*f, 0, std::as_bytes(std::span(text.data(), text.size()))).ok());
  ASSERT_TRUE(capture_->Close(*f).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  ASSERT_EQ(called, std::vector<std::string>{"sub/shard.bin"});
  ASSERT_GE(old_fd, 0);
  char old[32] = {};
  EXPECT_EQ(pread(old_fd, old, sizeof old, 0), 9);
  EXPECT_STREQ(old, "old bytes");
  close(old_fd);
  const std::vector<std::byte> placed = ReadFile(dir_ / "sub" / "shard.bin");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(placed.data()), placed.size()), text);
}

TEST_F(WriteCaptureTest, PartChangesTellWhenEachChunkIsWholeInThePartAndWhenThePartIsCutOrDropped) {
  // What streamed uploads follow: each full chunk, once flushed, is reported whole with the part's
  // descriptor holding exactly its bytes; a chunk rewritten is reported again; a truncate is a
  // cut; an unlinked pending file is discarded. Events come with the file's path and inode.
  constexpr size_t kChunk = 64 << 10;
  struct Seen {
    PartChange change;
    std::vector<std::byte> bytes;  // kFlushed and whole: what the part held then
  };
  std::mutex mu;
  std::vector<Seen> seen;
  on_part_change_ = [&](const PartChange& c) {
    Seen s{c, {}};
    if (c.kind == PartChange::Kind::kFlushed && c.whole && c.rel_path == "sub/big") {  // "gone" is cut at once
      s.bytes.resize(c.n_bytes);
      EXPECT_EQ(pread(c.part_fd, s.bytes.data(), s.bytes.size(), static_cast<off_t>(c.byte_offset)),
                static_cast<ssize_t>(c.n_bytes));
    }
    std::lock_guard lock(mu);
    seen.push_back(std::move(s));
  };
  Start(/*n_chunks=*/8, kChunk);
  std::vector<std::byte> data(3 * kChunk + 100);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>((i * 131) >> 3);
  auto f = Create("big", sub_fd_);
  WriteAll(*f, data, 4096);
  // The first three chunks are full: each is flushed (and reported whole) without a close.
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard lock(mu);
      if (std::count_if(seen.begin(), seen.end(), [](const Seen& s) { return s.change.whole; }) >= 3) break;
    }
    usleep(10000);
  }
  {
    // Not under `mu`: the reports take it under the file's lock, which Stat takes.
    const ino_t ino = capture_->Stat(*f).st_ino;
    std::lock_guard lock(mu);
    std::vector<uint64_t> whole_at;
    for (const Seen& s : seen) {
      EXPECT_EQ(s.change.rel_path, "sub/big");
      EXPECT_EQ(s.change.ino, ino);
      if (!s.change.whole) continue;
      whole_at.push_back(s.change.byte_offset);
      EXPECT_EQ(s.change.n_bytes, kChunk);
      EXPECT_TRUE(std::equal(s.bytes.begin(), s.bytes.end(), data.begin() + static_cast<ptrdiff_t>(s.change.byte_offset)))
          << "the part did not hold the chunk's bytes when it was reported whole";
    }
    std::sort(whole_at.begin(), whole_at.end());
    EXPECT_EQ(whole_at, (std::vector<uint64_t>{0, kChunk, 2 * kChunk}));
    seen.clear();
  }
  // A rewrite of chunk 1: reported again (at the latest when it is flushed for the commit).
  ASSERT_TRUE(capture_->Write(*f, kChunk + 10, std::span(data.data(), 5)).ok());
  ASSERT_TRUE(capture_->Truncate(*f, 2 * kChunk + 7).ok());
  ASSERT_TRUE(capture_->Fsync(*f).ok());
  {
    std::lock_guard lock(mu);
    EXPECT_TRUE(std::any_of(seen.begin(), seen.end(), [&](const Seen& s) {
      return s.change.kind == PartChange::Kind::kFlushed && s.change.byte_offset == kChunk;
    })) << "the rewritten chunk was not reported";
    EXPECT_TRUE(std::any_of(seen.begin(), seen.end(), [&](const Seen& s) {
      return s.change.kind == PartChange::Kind::kCut && s.change.byte_offset == 2 * kChunk + 7;
    })) << "the truncate was not reported";
    seen.clear();
  }
  ASSERT_TRUE(capture_->Close(*f).ok());
  auto g = Create("gone");
  WriteAll(*g, data, 4096);
  ASSERT_TRUE(capture_->Discard(*g));
  ASSERT_TRUE(capture_->Close(*g).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  // Stopped before `seen` goes: a flush of "gone" still in flight reports when it completes.
  f.reset();
  g.reset();
  capture_.reset();
  std::lock_guard lock(mu);
  EXPECT_TRUE(std::any_of(seen.begin(), seen.end(), [](const Seen& s) {
    return s.change.kind == PartChange::Kind::kDiscarded && s.change.rel_path == "gone";
  })) << "the discard was not reported";
}

TEST_F(WriteCaptureTest, BeforeSettledRecordsEveryCommitBeforeItsBytesShowAndItsErrorHoldsTheFileBack) {
  // The bucket uploader's hook: called for each commit (an fsync of an open file too), in commit
  // order, before the file shows under its name, with the inode and size it is placed with; an
  // error keeps the file (and every later one) unplaced until the hook takes it.
  struct Call {
    std::string rel;
    bool visible;
    ino_t ino;
    off_t size;
  };
  std::mutex mu;
  std::vector<Call> calls;
  std::atomic<bool> refuse{false};
  before_settled_ = [&](const std::string& rel, const struct stat& st) {
    struct stat now = {};
    const bool visible = ::stat((dir_ / rel).c_str(), &now) == 0 && now.st_ino == st.st_ino;
    std::lock_guard lock(mu);
    calls.push_back({rel, visible, st.st_ino, st.st_size});
    return refuse.load() ? Status(StatusCode::kIo, "refused", EIO) : Status::Ok();
  };
  Start(/*n_chunks=*/4);
  const std::string a = "shard bytes", b = "pointer";
  auto shard = Create("shard.bin", sub_fd_);
  ASSERT_TRUE(capture_->Write(*shard, 0, std::as_bytes(std::span(a.data(), a.size()))).ok());
  ASSERT_TRUE(capture_->Fsync(*shard).ok());  // placed while open: recorded first
  ASSERT_TRUE(capture_->Close(*shard).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  refuse = true;
  auto latest = Create("latest");
  ASSERT_TRUE(capture_->Write(*latest, 0, std::as_bytes(std::span(b.data(), b.size()))).ok());
  ASSERT_TRUE(capture_->Close(*latest).ok());
  EXPECT_FALSE(capture_->Sync().ok());
  EXPECT_FALSE(stdfs::exists(dir_ / "latest")) << "placed although its record failed";
  refuse = false;
  ASSERT_TRUE(capture_->Sync().ok());
  EXPECT_EQ(ReadFile((dir_ / "latest").string()).size(), b.size());
  std::lock_guard lock(mu);
  ASSERT_GE(calls.size(), 4u);  // shard at fsync, shard at close, latest refused (1+), latest
  EXPECT_EQ(calls[0].rel, "sub/shard.bin");
  EXPECT_FALSE(calls[0].visible) << "the hook ran after the file showed under its name";
  EXPECT_EQ(calls[0].size, static_cast<off_t>(a.size()));
  EXPECT_EQ(calls[1].rel, "sub/shard.bin");  // the close of a placed file: before its last fdatasync
  EXPECT_EQ(calls[1].ino, calls[0].ino);
  for (size_t i = 2; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].rel, "latest");
    EXPECT_FALSE(calls[i].visible);
    EXPECT_EQ(calls[i].size, static_cast<off_t>(b.size()));
  }
}

TEST_F(WriteCaptureTest, CacheSmallerThanTheFilesStreamsThemWithBackPressure) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 1);
  Start(/*n_chunks=*/3);
  // Two writers at once, 20 chunks each, through a 3-chunk cache.
  std::vector<std::byte> a = RandomBytes(rng, 20 * 65536 + 100);
  std::vector<std::byte> b = RandomBytes(rng, 20 * 65536 - 100);
  auto fa = Create("a.bin");
  auto fb = Create("b.bin");
  std::thread ta([&] { WriteAll(*fa, a, 10000); });
  std::thread tb([&] { WriteAll(*fb, b, 30000); });
  ta.join();
  tb.join();
  ASSERT_TRUE(capture_->Close(*fa).ok());
  ASSERT_TRUE(capture_->Close(*fb).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  EXPECT_EQ(ReadFile((dir_ / "a.bin").string()), a);
  EXPECT_EQ(ReadFile((dir_ / "b.bin").string()), b);
  const CaptureStats s = capture_->Stats();
  EXPECT_EQ(s.bytes_captured, a.size() + b.size());
  EXPECT_GE(s.bytes_flushed, a.size() + b.size());
  EXPECT_EQ(s.cache_used_bytes, 0u);
  EXPECT_EQ(s.files_pending, 0u);
}

// An engine that hands every op to a pread engine; the ones below look at the writes first.
class ForwardingEngine : public IoEngine {
 public:
  ForwardingEngine() : inner_(MakePreadEngine()) {}
  Status Submit(std::span<const IoOp> ops) override { return inner_->Submit(ops); }
  Result<size_t> Reap(std::span<IoCompletion> out, bool wait) override { return inner_->Reap(out, wait); }
  size_t InFlight() const override { return inner_->InFlight(); }
  unsigned QueueDepth() const override { return inner_->QueueDepth(); }
  Status RegisterBuffers(std::span<const iovec> regions) override { return inner_->RegisterBuffers(regions); }
  Status RegisterBufferSlots(unsigned n) override { return inner_->RegisterBufferSlots(n); }
  Status UpdateBuffer(unsigned index, const iovec& region) override { return inner_->UpdateBuffer(index, region); }

 protected:
  std::unique_ptr<IoEngine> inner_;
};

// An engine whose writes each take `delay`: slow enough that both flushers have batches in
// flight at once.
class SlowWriteEngine final : public ForwardingEngine {
 public:
  explicit SlowWriteEngine(std::chrono::milliseconds delay) : delay_(delay) {}
  std::string Name() const override { return "slow(" + inner_->Name() + ")"; }
  Status Submit(std::span<const IoOp> ops) override {
    for (const IoOp& op : ops) {
      if (op.kind == OpKind::kWrite) std::this_thread::sleep_for(delay_);
    }
    return inner_->Submit(ops);
  }

 private:
  std::chrono::milliseconds delay_;
};

TEST_F(WriteCaptureTest, FlushBusyTimeIsTheUnionOfTheFlushersNotTheirSum) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 7);
  const auto delay = std::chrono::milliseconds(20);
  Start(/*n_chunks=*/32, 64 << 10, [delay] { return std::make_unique<SlowWriteEngine>(delay); });
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::byte> a = RandomBytes(rng, 24 * 65536);
  auto f = Create("a.bin");
  WriteAll(*f, a, 65536);
  ASSERT_TRUE(capture_->Close(*f).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  const auto wall = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
  const CaptureStats s = capture_->Stats();
  EXPECT_EQ(ReadFile((dir_ / "a.bin").string()), a);
  // Time with a flush in flight: at least one write's delay, and never more than the time
  // that passed (two flushers busy at once count once).
  EXPECT_GE(s.flush_busy_ns, static_cast<uint64_t>(std::chrono::nanoseconds(delay).count()));
  EXPECT_LE(s.flush_busy_ns, static_cast<uint64_t>(wall.count()));
}

TEST_F(WriteCaptureTest, RandomWritesHolesTruncateAndRewrites) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 2);
  Start(/*n_chunks=*/2);
  auto f = Create("random.bin");
  std::vector<std::byte> model;
  for (int step = 0; step < 200; ++step) {
    const uint64_t at = rng() % 400000;
    if (rng() % 10 == 0) {
      const uint64_t n = rng() % 400000;
      ASSERT_TRUE(capture_->Truncate(*f, n).ok());
      model.resize(n);
      continue;
    }
    const std::vector<std::byte> piece = RandomBytes(rng, 1 + rng() % 20000);
    ASSERT_TRUE(capture_->Write(*f, at, piece).ok());
    if (model.size() < at + piece.size()) model.resize(at + piece.size());
    std::memcpy(model.data() + at, piece.data(), piece.size());
  }
  std::vector<std::byte> back(model.size());
  auto n = capture_->Read(*f, 0, back);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(back, model);
  ASSERT_TRUE(capture_->Close(*f).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  EXPECT_EQ(ReadFile((dir_ / "random.bin").string()), model);
}

TEST_F(WriteCaptureTest, SmallRandomWritesFlushTheirPagesNotWholeChunks) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 12);
  Start(/*n_chunks=*/4);  // 64 KiB chunks: a file of 32 chunks does not fit
  std::vector<std::byte> model = RandomBytes(rng, 32 * 65536);
  auto f = Create("random.bin");
  WriteAll(*f, model, 65536);
  ASSERT_TRUE(capture_->Fsync(*f).ok());
  const uint64_t flushed0 = capture_->Stats().bytes_flushed;
  const int n_writes = 300;
  for (int i = 0; i < n_writes; ++i) {
    const uint64_t at = (rng() % (model.size() / 4096)) * 4096 + rng() % 100;
    const std::vector<std::byte> d = RandomBytes(rng, 1000);
    ASSERT_TRUE(capture_->Write(*f, at, d).ok());
    std::memcpy(model.data() + at, d.data(), d.size());
  }
  ASSERT_TRUE(capture_->Close(*f).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  EXPECT_EQ(ReadFile((dir_ / "random.bin").string()), model);
  // At most two pages per write (one may straddle a page boundary), never a whole chunk each.
  const uint64_t flushed = capture_->Stats().bytes_flushed - flushed0;
  EXPECT_LE(flushed, uint64_t{n_writes} * 2 * 4096) << flushed;
}

// Counts the bytes of every write submitted to it: what the disk is asked to write, whatever
// the capture's own counters say.
class CountingEngine final : public ForwardingEngine {
 public:
  explicit CountingEngine(std::shared_ptr<std::atomic<uint64_t>> written) : written_(std::move(written)) {}
  std::string Name() const override { return "counting(" + inner_->Name() + ")"; }
  Status Submit(std::span<const IoOp> ops) override {
    for (const IoOp& op : ops) {
      if (op.kind == OpKind::kWrite) written_->fetch_add(op.n_bytes);
    }
    return inner_->Submit(ops);
  }

 private:
  std::shared_ptr<std::atomic<uint64_t>> written_;
};

// The mount's case (a cache of 2 chunks, a file 8 times larger, 4 KiB writes at random), with
// two writes far apart in one chunk before the writer moves on: the disk is asked to write
// their two pages, not the stretch between them (a dirty [lowest, highest) range flushed most
// of each chunk: 1543 MiB flushed for 13.7 MiB written through a 16M-cache mount).
TEST_F(WriteCaptureTest, RandomPageWritesThroughASmallCacheFlushOnlyTheirPages) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 13);
  constexpr size_t kChunk = 1 << 20, kPage = 4096, kPagesPerChunk = kChunk / kPage;
  auto written = std::make_shared<std::atomic<uint64_t>>(0);
  Start(/*n_chunks=*/2, kChunk, [written] { return std::make_unique<CountingEngine>(written); });
  std::vector<std::byte> model = RandomBytes(rng, 16 * kChunk);
  auto f = Create("random.bin");
  WriteAll(*f, model, kChunk);
  ASSERT_TRUE(capture_->Fsync(*f).ok());
  const uint64_t engine0 = written->load();
  const uint64_t flushed0 = capture_->Stats().bytes_flushed;
  EXPECT_EQ(engine0, model.size());
  const int n_steps = 150;
  uint64_t n_writes = 0;
  for (int i = 0; i < n_steps; ++i) {
    const uint64_t chunk = rng() % (model.size() / kChunk);
    const uint64_t p1 = rng() % (kPagesPerChunk / 2), p2 = kPagesPerChunk / 2 + rng() % (kPagesPerChunk / 2);
    for (const uint64_t page : {p1, p2}) {
      const uint64_t at = chunk * kChunk + page * kPage;
      const std::vector<std::byte> d = RandomBytes(rng, kPage);
      ASSERT_TRUE(capture_->Write(*f, at, d).ok());
      std::memcpy(model.data() + at, d.data(), d.size());
      ++n_writes;
    }
  }
  ASSERT_TRUE(capture_->Close(*f).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  EXPECT_EQ(ReadFile((dir_ / "random.bin").string()), model);
  const uint64_t engine = written->load() - engine0;
  EXPECT_LE(engine, n_writes * kPage) << engine << " bytes written to the disk for " << n_writes << " pages";
  EXPECT_EQ(capture_->Stats().bytes_flushed - flushed0, engine);
}

TEST_F(WriteCaptureTest, FsyncOfAnOpenFilePlacesItAndLaterWritesFollow) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 3);
  Start(/*n_chunks=*/4);
  auto first = Create("first.bin");
  const std::vector<std::byte> d1 = RandomBytes(rng, 5000);
  WriteAll(*first, d1, 5000);
  ASSERT_TRUE(capture_->Close(*first).ok());
  auto f = Create("grow.bin");
  const std::vector<std::byte> d2 = RandomBytes(rng, 70000);
  WriteAll(*f, d2, 7000);
  ASSERT_TRUE(capture_->Fsync(*f).ok());
  // Fsync made it durable, with everything closed before it.
  EXPECT_EQ(ReadFile((dir_ / "first.bin").string()), d1);
  EXPECT_EQ(ReadFile((dir_ / "grow.bin").string()), d2);
  const std::vector<std::byte> d3 = RandomBytes(rng, 1000);
  ASSERT_TRUE(capture_->Write(*f, d2.size(), d3).ok());
  ASSERT_TRUE(capture_->Close(*f).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  std::vector<std::byte> want = d2;
  want.insert(want.end(), d3.begin(), d3.end());
  EXPECT_EQ(ReadFile((dir_ / "grow.bin").string()), want);
  EXPECT_TRUE(capture_->Settled(*f));
}

TEST_F(WriteCaptureTest, DiscardedFileIsNeverPlaced) {
  Start(/*n_chunks=*/4);
  auto f = Create("gone.bin");
  std::vector<std::byte> d(100000, std::byte{7});
  WriteAll(*f, d, 100000);
  EXPECT_TRUE(capture_->Discard(*f));
  ASSERT_TRUE(capture_->Sync().ok());
  EXPECT_FALSE(stdfs::exists(dir_ / "gone.bin"));
}

TEST_F(WriteCaptureTest, UnlinkWhileQueuedForCommitNeverPlacesItNorFailsSync) {
  Start(/*n_chunks=*/4);
  for (int i = 0; i < 50; ++i) {
    auto f = Create("racy.bin");
    std::vector<std::byte> d(70000, std::byte{static_cast<unsigned char>(i)});
    WriteAll(*f, d, 70000);
    ASSERT_TRUE(capture_->Close(*f).ok());
    if (!capture_->Discard(*f)) {  // placed first: the caller removes it
      ASSERT_EQ(unlink((dir_ / "racy.bin").c_str()), 0);
    }
    const Status s = capture_->Sync();
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_FALSE(stdfs::exists(dir_ / "racy.bin")) << i;
  }
}

TEST_F(WriteCaptureTest, FlushErrorIsReportedAndTheDataKeptUntilSyncRetries) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 4);
  // The first write at byte 65536 of any file fails with ENOSPC, once.
  auto plan = std::make_shared<FaultPlan>(std::vector<Fault>{Fault{OpKind::kWrite, 65536, Fault::Effect::kError, ENOSPC, 1}});
  Start(/*n_chunks=*/8, 64 << 10, [plan] { return MakeFaultEngine(MakePreadEngine(), plan); });
  auto a = Create("a.bin");
  const std::vector<std::byte> da = RandomBytes(rng, 200000);
  WriteAll(*a, da, 50000);
  const Status s = capture_->Fsync(*a);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(plan->InjectedCount(), 1u);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.ToString();
  EXPECT_FALSE(stdfs::exists(dir_ / "a.bin"));
  // A file closed after it waits behind it: never placed ahead of it.
  auto b = Create("b.bin");
  WriteAll(*b, RandomBytes(rng, 10), 10);
  (void)capture_->Close(*b);
  EXPECT_FALSE(stdfs::exists(dir_ / "b.bin"));
  ASSERT_TRUE(capture_->Close(*a).ok() || true);
  // The fault happened once: a retry succeeds with the data kept in the cache.
  const Status retried = capture_->Sync();
  ASSERT_TRUE(retried.ok()) << retried.ToString();
  EXPECT_EQ(ReadFile((dir_ / "a.bin").string()), da);
  EXPECT_TRUE(stdfs::exists(dir_ / "b.bin"));
  EXPECT_GE(capture_->Stats().flush_errors, 1u);
}

// A disk that fails every write with ENOSPC while `dead` is set, and works again once it is
// cleared (the switch happens between batches, never under ops in flight).
class DeadDiskEngine final : public ForwardingEngine {
 public:
  explicit DeadDiskEngine(std::shared_ptr<std::atomic<bool>> dead) : dead_(std::move(dead)) {
    std::vector<Fault> faults;  // every page of the first MiB of any file
    for (uint64_t at = 0; at < (1u << 20); at += 4096) faults.push_back(Fault{OpKind::kWrite, at, Fault::Effect::kError, ENOSPC, -1});
    failing_ = MakeFaultEngine(MakePreadEngine(), std::make_shared<FaultPlan>(std::move(faults)));
  }
  std::string Name() const override { return "dead-disk"; }
  Status Submit(std::span<const IoOp> ops) override {
    if (active_->InFlight() == 0) active_ = dead_->load() ? failing_.get() : inner_.get();
    return active_->Submit(ops);
  }
  Result<size_t> Reap(std::span<IoCompletion> out, bool wait) override { return active_->Reap(out, wait); }
  size_t InFlight() const override { return active_->InFlight(); }
  Status RegisterBufferSlots(unsigned n) override {
    UCPFS_RETURN_IF_ERROR(failing_->RegisterBufferSlots(n));
    return inner_->RegisterBufferSlots(n);
  }
  Status UpdateBuffer(unsigned index, const iovec& region) override {
    UCPFS_RETURN_IF_ERROR(failing_->UpdateBuffer(index, region));
    return inner_->UpdateBuffer(index, region);
  }

 private:
  std::shared_ptr<std::atomic<bool>> dead_;
  std::unique_ptr<IoEngine> failing_;
  IoEngine* active_ = inner_.get();
};

// A writer that needs cache space while the disk refuses every write is failed with the disk's
// error after the stall timeout, never left waiting; what was accepted stays readable and is
// listed as unplaced once closed; when the disk takes writes again, the next write goes on
// and the file lands whole.
TEST_F(WriteCaptureTest, AFullCacheOverADeadDiskFailsTheWriterAfterTheStallTimeout) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 14);
  auto dead = std::make_shared<std::atomic<bool>>(true);
  write_stall_timeout_ms_ = 300;
  Start(/*n_chunks=*/2, 64 << 10, [dead] { return std::make_unique<DeadDiskEngine>(dead); });
  auto f = Create("stalled.bin");
  const std::vector<std::byte> data = RandomBytes(rng, 3 * 65536);
  WriteAll(*f, std::vector<std::byte>(data.begin(), data.begin() + 2 * 65536), 65536);  // fills the cache
  const auto t0 = std::chrono::steady_clock::now();
  auto third = std::async(std::launch::async, [&] {
    return capture_->Write(*f, 2 * 65536, std::span(data.data() + 2 * 65536, 65536));
  });
  if (third.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    ADD_FAILURE() << "a writer waited 30 s on a full cache over a dead disk";
    std::_Exit(1);  // the waiting thread cannot be joined
  }
  const Status s = third.get();
  const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.ToString();
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  EXPECT_NE(s.message().find("stalled.bin"), std::string::npos) << s.ToString();
  EXPECT_GE(waited_s, 0.3);
  // What was accepted is still there for readers.
  std::vector<std::byte> back(2 * 65536);
  ASSERT_TRUE(capture_->Read(*f, 0, back).ok());
  EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin()));
  // Closed, it is listed as not placed, with the disk's error.
  EXPECT_FALSE(capture_->Close(*f).ok());
  bool listed = false;
  for (int i = 0; i < 100 && !listed; ++i) {
    for (const UnplacedFile& u : capture_->Stats().unplaced) listed = listed || u.path == "stalled.bin";
    if (!listed) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(listed);
  EXPECT_FALSE(stdfs::exists(dir_ / "stalled.bin"));
  // The disk is back: the file lands as accepted (its third chunk was refused, so a hole).
  dead->store(false);
  const Status synced = capture_->Sync();
  ASSERT_TRUE(synced.ok()) << synced.ToString();
  EXPECT_EQ(ReadFile((dir_ / "stalled.bin").string()), std::vector<std::byte>(data.begin(), data.begin() + 2 * 65536));
  EXPECT_TRUE(capture_->Stats().unplaced.empty());
}

// A slow disk is not a dead one: writers wait on a full cache as long as it takes, past the
// stall timeout, while the flushers' writes succeed.
TEST_F(WriteCaptureTest, AFullCacheOverASlowDiskOnlyMakesWritersWait) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 15);
  write_stall_timeout_ms_ = 50;
  Start(/*n_chunks=*/2, 64 << 10, [] { return std::make_unique<SlowWriteEngine>(std::chrono::milliseconds(150)); });
  auto f = Create("slow.bin");
  const std::vector<std::byte> data = RandomBytes(rng, 8 * 65536);
  WriteAll(*f, data, 65536);
  ASSERT_TRUE(capture_->Close(*f).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  EXPECT_EQ(ReadFile((dir_ / "slow.bin").string()), data);
}

// ---- recovery ----

void WriteJournal(const stdfs::path& path, const std::vector<JournalRecord>& records, size_t truncate_tail = 0) {
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(kJournalMagic),
                               reinterpret_cast<const std::byte*>(kJournalMagic) + sizeof(kJournalMagic));
  for (const auto& r : records) {
    const auto e = EncodeJournalRecord(r);
    bytes.insert(bytes.end(), e.begin(), e.end());
  }
  bytes.resize(bytes.size() - truncate_tail);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
}

JournalRecord ChunkRecord(uint64_t seq, uint64_t offset, const std::vector<std::byte>& data) {
  return {JournalType::kChunk, seq, offset, data.size(), XXH64(data.data(), data.size(), 0), 0, 0, {}};
}

JournalRecord CommitRecord(uint64_t seq, uint64_t size, const std::string& path) {
  return {JournalType::kCommit, seq, 0, 0, 0, size, 0644, path};
}

TEST_F(WriteCaptureTest, RecoveryFinishesCompleteFilesInOrderAndSetsAsideWholeOnesBehindATornOne) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 5);
  const stdfs::path cap = dir_ / ".ucpfs" / "capture";
  stdfs::create_directories(cap);
  auto part = [&](uint64_t seq, const std::vector<std::byte>& d) {
    std::ofstream(cap / (std::to_string(seq) + ".part"), std::ios::binary)
        .write(reinterpret_cast<const char*>(d.data()), static_cast<std::streamsize>(d.size()));
  };
  const auto s1 = RandomBytes(rng, 100000), s2 = RandomBytes(rng, 3000), s3 = RandomBytes(rng, 5000);
  const auto latest = RandomBytes(rng, 12), after = RandomBytes(rng, 7000), half = RandomBytes(rng, 9000);
  part(1, s1);
  part(2, s2);
  std::vector<std::byte> torn = s3;
  torn[100] ^= std::byte{1};  // flushed bytes that are not what the record says
  part(3, torn);
  part(4, latest);
  part(5, RandomBytes(rng, 10));  // never closed
  part(6, after);
  part(7, std::vector<std::byte>(half.begin(), half.begin() + 4096));  // its end was never flushed
  std::vector<std::byte> s1a(s1.begin(), s1.begin() + 65536), s1b(s1.begin() + 65536, s1.end());
  const std::vector<std::byte> half_a(half.begin(), half.begin() + 4096);
  WriteJournal(cap / "journal",
               {ChunkRecord(1, 0, s1a), ChunkRecord(1, 65536, s1b), CommitRecord(1, s1.size(), "sub/shard_1"),
                ChunkRecord(2, 0, s2), CommitRecord(2, s2.size(), "shard_2"), ChunkRecord(3, 0, s3),
                CommitRecord(3, s3.size(), "shard_3"), ChunkRecord(4, 0, latest), CommitRecord(4, latest.size(), "latest"),
                ChunkRecord(6, 0, after), CommitRecord(6, after.size(), "sub/after"), ChunkRecord(7, 0, half_a),
                CommitRecord(7, half.size(), "half")});
  // The bucket uploader's hook sees exactly the files recovery places, in order, each before it
  // shows under its name.
  std::vector<std::pair<std::string, bool>> settled;
  before_settled_ = [&](const std::string& rel, const struct stat& st) {
    struct stat now = {};
    settled.emplace_back(rel, ::stat((dir_ / rel).c_str(), &now) == 0 && now.st_ino == st.st_ino);
    return Status::Ok();
  };
  Start(4);
  EXPECT_EQ(settled, (std::vector<std::pair<std::string, bool>>{{"sub/shard_1", false}, {"shard_2", false}}));
  EXPECT_EQ(ReadFile((dir_ / "sub" / "shard_1").string()), s1);
  EXPECT_EQ(ReadFile((dir_ / "shard_2").string()), s2);
  EXPECT_FALSE(stdfs::exists(dir_ / "shard_3"));  // torn: discarded
  // Whole, but committed after a torn file: never placed ahead of it, never destroyed either.
  EXPECT_FALSE(stdfs::exists(dir_ / "latest"));
  EXPECT_FALSE(stdfs::exists(dir_ / "sub" / "after"));
  EXPECT_FALSE(stdfs::exists(dir_ / "half"));
  const stdfs::path aside = cap / "recovered" / "earlier";
  EXPECT_EQ(ReadFile((aside / "latest").string()), latest);
  EXPECT_EQ(ReadFile((aside / "sub" / "after").string()), after);
  EXPECT_FALSE(stdfs::exists(aside / "half"));  // not whole itself: discarded
  for (const auto& e : stdfs::recursive_directory_iterator(cap)) EXPECT_NE(e.path().extension(), ".part") << e.path();
  std::string all;
  for (const auto& l : log_) all += l + "\n";
  EXPECT_NE(all.find("finished 'sub/shard_1'"), std::string::npos) << all;
  EXPECT_NE(all.find("discarded 'shard_3'"), std::string::npos) << all;
  EXPECT_NE(all.find("kept 'latest'"), std::string::npos) << all;
  EXPECT_NE(all.find("discarded 'half'"), std::string::npos) << all;
  EXPECT_NE(all.find("never closed"), std::string::npos) << all;
  // Listed, and a sync fails naming them, at this mount and at every later one until they go.
  auto listed = [](const CaptureStats& st) {
    std::set<std::string> out;
    for (const UnplacedFile& u : st.unplaced) {
      out.insert(u.path);
      EXPECT_NE(u.kept_in.find("recovered"), std::string::npos) << u.kept_in;
      EXPECT_NE(u.reason.find("shard_3"), std::string::npos) << u.reason;
    }
    return out;
  };
  EXPECT_EQ(listed(capture_->Stats()), (std::set<std::string>{"latest", "sub/after"}));
  Status synced = capture_->Sync();
  EXPECT_EQ(synced.sys_errno(), EIO);
  EXPECT_NE(synced.message().find("'latest'"), std::string::npos) << synced.ToString();
  EXPECT_NE(synced.message().find("'sub/after'"), std::string::npos) << synced.ToString();
  capture_.reset();
  Start(4);
  EXPECT_EQ(listed(capture_->Stats()), (std::set<std::string>{"latest", "sub/after"}));
  EXPECT_FALSE(capture_->Sync().ok());
  EXPECT_FALSE(stdfs::exists(dir_ / "latest"));
  stdfs::remove(aside / "latest");
  stdfs::rename(aside / "sub" / "after", dir_ / "sub" / "after");  // someone decided
  EXPECT_TRUE(capture_->Stats().unplaced.empty());
  EXPECT_TRUE(capture_->Sync().ok());
  capture_.reset();
  Start(4);  // what is left of it goes
  EXPECT_FALSE(stdfs::exists(cap / "recovered")) << "empty directories and .why left";
}

// Recovery's own steps are ordered for a crash: a power cut after any of its namespace changes
// (fault NameOps: what no directory fsync made durable is undone) and a recovery after it never
// place a file ahead of a torn one, never lose one that was set aside, and leave no part.
TEST_F(WriteCaptureTest, APowerCutDuringRecoveryNeverPlacesAheadNorLosesAFileSetAside) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 6);
  const stdfs::path cap = dir_ / ".ucpfs" / "capture";
  const auto s1 = RandomBytes(rng, 70000), s2 = RandomBytes(rng, 5000), latest = RandomBytes(rng, 12);
  const auto after = RandomBytes(rng, 3000);
  uint64_t cut_at = 0;
  for (;; ++cut_at) {
    ASSERT_LT(cut_at, 200u);
    stdfs::remove_all(dir_ / ".ucpfs");
    stdfs::remove_all(dir_ / "sub");
    stdfs::remove(dir_ / "shard_2");
    stdfs::remove(dir_ / "latest");
    stdfs::create_directories(cap);
    stdfs::create_directories(dir_ / "sub");
    auto part = [&](uint64_t seq, const std::vector<std::byte>& d) {
      std::ofstream(cap / (std::to_string(seq) + ".part"), std::ios::binary)
          .write(reinterpret_cast<const char*>(d.data()), static_cast<std::streamsize>(d.size()));
    };
    part(1, s1);
    std::vector<std::byte> torn = s2;
    torn[7] ^= std::byte{1};
    part(2, torn);
    part(3, latest);
    part(4, after);
    WriteJournal(cap / "journal", {ChunkRecord(1, 0, s1), CommitRecord(1, s1.size(), "sub/shard_1"), ChunkRecord(2, 0, s2),
                                   CommitRecord(2, s2.size(), "shard_2"), ChunkRecord(3, 0, latest),
                                   CommitRecord(3, latest.size(), "latest"), ChunkRecord(4, 0, after),
                                   CommitRecord(4, after.size(), "sub/after")});
    auto plan = std::make_shared<FaultPlan>(std::vector<Fault>{});
    plan->TrackUnsynced();
    plan->CutPowerAfterOps(cut_at);
    names_ = MakeFaultNameOps(plan);
    Start(4);
    plan->CutPowerAfterOps(0);
    capture_.reset();
    const bool whole_run = plan->OpsSubmitted() < cut_at;  // the cut came after everything
    plan->DropUnsynced();
    names_ = nullptr;
    Start(4);  // the power is back
    const std::string where = "cut after " + std::to_string(cut_at) + " ops";
    EXPECT_EQ(ReadFile((dir_ / "sub" / "shard_1").string()), s1) << where;
    EXPECT_FALSE(stdfs::exists(dir_ / "shard_2")) << where;
    EXPECT_FALSE(stdfs::exists(dir_ / "latest")) << where;
    EXPECT_FALSE(stdfs::exists(dir_ / "sub" / "after")) << where;
    std::set<std::string> aside;
    for (const auto& e : stdfs::recursive_directory_iterator(cap)) {
      if (!e.is_regular_file()) continue;
      EXPECT_NE(e.path().extension(), ".part") << where << ": " << e.path();
      const std::string rel = e.path().lexically_relative(cap / "recovered").string();
      if (rel.starts_with("..") || e.path().extension() == ".why") continue;
      aside.insert(rel.substr(rel.find('/') + 1));
      EXPECT_EQ(ReadFile(e.path().string()), rel.ends_with("latest") ? latest : after) << where << ": " << rel;
    }
    EXPECT_EQ(aside, (std::set<std::string>{"latest", "sub/after"})) << where;
    capture_.reset();
    if (::testing::Test::HasFailure() || whole_run) break;
  }
  std::cout << "[ recovery cuts ] cut after each of " << cut_at << " ops\n";
  EXPECT_GT(cut_at, 5u);  // recovery's steps were cut at many points
}

TEST_F(WriteCaptureTest, RecoveryNeverPlacesOutsideTheSourceOrThroughASymlink) {
  const stdfs::path cap = dir_ / ".ucpfs" / "capture";
  stdfs::create_directories(cap);
  const stdfs::path outside = dir_.string() + "-outside";
  stdfs::create_directories(outside);
  stdfs::create_symlink(outside, dir_ / "link");
  const std::vector<std::byte> d(10, std::byte{1});
  for (uint64_t seq : {1, 2, 3}) {
    std::ofstream(cap / (std::to_string(seq) + ".part"), std::ios::binary).write(reinterpret_cast<const char*>(d.data()), 10);
  }
  WriteJournal(cap / "journal", {ChunkRecord(1, 0, d), CommitRecord(1, 10, "../escape"), ChunkRecord(2, 0, d),
                                 CommitRecord(2, 10, "link/x"), ChunkRecord(3, 0, d), CommitRecord(3, 10, ".ucpfs/x")});
  Start(4);
  EXPECT_FALSE(stdfs::exists(outside / "x"));
  EXPECT_FALSE(stdfs::exists(dir_.parent_path() / "escape"));
  EXPECT_FALSE(stdfs::exists(dir_ / ".ucpfs" / "x"));
  stdfs::remove_all(outside);
}

// ---- several mounts of one SRC ----

std::string BootId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string s;
  std::getline(f, s);
  return s;
}

TEST_F(WriteCaptureTest, MountsOfOneSourceSaveAtOnceAndANewOneLeavesTheLiveOnesAlone) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 11);
  std::vector<std::unique_ptr<WriteCapture>> mounts;
  for (int i = 0; i < 4; ++i) mounts.push_back(StartAnother(8));
  // Each mount has its own state directory.
  std::set<std::string> states;
  for (auto& m : mounts) states.insert(m->Stats().state_dir);
  ASSERT_EQ(states.size(), mounts.size());
  // Every mount saves its rank's files at once; a file of each stays open (written, fsync'd
  // halfway) while a fifth mount starts: its recovery must leave the live mounts' parts alone.
  std::vector<std::vector<std::byte>> data(mounts.size()), open_data(mounts.size());
  std::vector<std::shared_ptr<CapturedFile>> open_files(mounts.size());
  for (size_t r = 0; r < mounts.size(); ++r) {
    data[r] = RandomBytes(rng, 100000 + 9000 * r);
    open_data[r] = RandomBytes(rng, 150000);
  }
  std::vector<std::thread> savers;
  for (size_t r = 0; r < mounts.size(); ++r) {
    savers.emplace_back([&, r] {
      WriteCapture& wc = *mounts[r];
      for (int k = 0; k < 3; ++k) {
        auto f = wc.Create(src_fd_, "__" + std::to_string(r) + "_" + std::to_string(k) + ".distcp", 0644);
        ASSERT_TRUE(f.ok()) << f.error().ToString();
        ASSERT_TRUE(wc.Write(**f, 0, data[r]).ok());
        ASSERT_TRUE(wc.Fsync(**f).ok());
        ASSERT_TRUE(wc.Close(**f).ok());
      }
      auto f = wc.Create(sub_fd_, "open_" + std::to_string(r), 0644);
      ASSERT_TRUE(f.ok());
      ASSERT_TRUE(wc.Write(**f, 0, std::span(open_data[r].data(), 70000)).ok());
      ASSERT_TRUE(wc.Fsync(**f).ok());
      open_files[r] = *f;
    });
  }
  for (auto& t : savers) t.join();
  auto late = StartAnother(8);
  ASSERT_NE(late, nullptr);
  for (size_t r = 0; r < mounts.size(); ++r) {
    ASSERT_TRUE(mounts[r]->Write(*open_files[r], 70000, std::span(open_data[r].data() + 70000, 80000)).ok());
    ASSERT_TRUE(mounts[r]->Close(*open_files[r]).ok());
    const Status s = mounts[r]->Sync();
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(ReadFile((dir_ / "sub" / ("open_" + std::to_string(r))).string()), open_data[r]);
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(ReadFile((dir_ / ("__" + std::to_string(r) + "_" + std::to_string(k) + ".distcp")).string()), data[r]);
    }
  }
  for (const auto& l : log_) EXPECT_EQ(l.find("discarded"), std::string::npos) << l;
  // A clean end removes the state directory.
  const std::string state = mounts[0]->Stats().state_dir;
  mounts[0].reset();
  EXPECT_FALSE(stdfs::exists(state));
}

TEST_F(WriteCaptureTest, RecoveryTakesOnlyTheStateOfMountsProvablyDead) {
  const stdfs::path cap = dir_ / ".ucpfs" / "capture";
  stdfs::create_directories(cap);
  const std::vector<std::byte> d(1000, std::byte{7});
  // A mount's state: lock, lease (boot id, and how long ago it was renewed), journal, one part
  // committed as `path`.
  auto state = [&](const std::string& id, const std::string& boot, int lease_age_s, const std::string& path) {
    const stdfs::path s = cap / id;
    stdfs::create_directories(s);
    stdfs::permissions(s, stdfs::perms::owner_all);
    std::ofstream(s / "lock").put('\0');
    std::ofstream(s / "lease") << "host h\nboot " << boot << "\npid 1\n";
    const auto t = stdfs::file_time_type::clock::now() - std::chrono::seconds(lease_age_s);
    stdfs::last_write_time(s / "lease", t);
    std::ofstream(s / "1.part", std::ios::binary).write(reinterpret_cast<const char*>(d.data()), 1000);
    WriteJournal(s / "journal", {ChunkRecord(1, 0, d), CommitRecord(1, 1000, path)});
  };
  state("dead-here", BootId(), 0, "dead_here");             // lock free on this kernel: dead
  state("alive-here", BootId(), 0, "alive_here");           // lock held below: alive
  state("other-host-fresh", "another-boot", 5, "fresh");    // another kernel, lease fresh: alive
  state("other-host-stale", "another-boot", 600, "stale");  // another kernel, lease expired: dead
  const int held = open((cap / "alive-here" / "lock").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(held, 0);
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  ASSERT_EQ(fcntl(held, F_OFD_SETLK, &fl), 0);
  Start(4);
  std::string all;
  for (const auto& l : log_) all += l + "\n";
  EXPECT_EQ(ReadFile((dir_ / "dead_here").string()), d) << all;
  EXPECT_EQ(ReadFile((dir_ / "stale").string()), d);
  EXPECT_FALSE(stdfs::exists(cap / "dead-here"));
  EXPECT_FALSE(stdfs::exists(cap / "other-host-stale"));
  EXPECT_FALSE(stdfs::exists(dir_ / "alive_here"));
  EXPECT_FALSE(stdfs::exists(dir_ / "fresh"));
  EXPECT_TRUE(stdfs::exists(cap / "alive-here" / "1.part"));
  EXPECT_TRUE(stdfs::exists(cap / "other-host-fresh" / "1.part"));
  close(held);
}

// A daemon killed just before a mount starts keeps its lock until its last thread has exited:
// when its lease shows it exiting on this kernel (here: a zombie child's pid, this boot and pid
// namespace), the starting mount waits for the lock and recovers the state; a live daemon's pid,
// or a lease of another pid namespace, is not waited for.
TEST_F(WriteCaptureTest, RecoveryWaitsForTheLockOfADaemonThatIsExiting) {
  const stdfs::path cap = dir_ / ".ucpfs" / "capture";
  stdfs::create_directories(cap);
  char ns[64] = {};
  ASSERT_GT(readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1), 0);
  const pid_t zombie = fork();
  ASSERT_GE(zombie, 0);
  if (zombie == 0) _exit(0);
  for (;;) {  // until the child is a zombie (not reaped: its pid stays)
    std::ifstream st("/proc/" + std::to_string(zombie) + "/stat");
    const std::string text((std::istreambuf_iterator<char>(st)), std::istreambuf_iterator<char>());
    if (text.find(") Z") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const std::vector<std::byte> d(1000, std::byte{9});
  auto state = [&](const std::string& id, pid_t pid, const std::string& pidns, const std::string& path) {
    const stdfs::path s = cap / id;
    stdfs::create_directories(s);
    stdfs::permissions(s, stdfs::perms::owner_all);
    std::ofstream(s / "lock").put('\0');
    std::ofstream(s / "lease") << "host h\nboot " << BootId() << "\npid " << pid << "\npidns " << pidns << "\n";
    std::ofstream(s / "1.part", std::ios::binary).write(reinterpret_cast<const char*>(d.data()), 1000);
    WriteJournal(s / "journal", {ChunkRecord(1, 0, d), CommitRecord(1, 1000, path)});
  };
  state("exiting", zombie, ns, "exiting_here");
  state("alive", getpid(), ns, "alive_here");
  state("other-ns", zombie, "pid:[1]", "other_ns");
  const int cap_fd = open(cap.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(cap_fd, 0);
  EXPECT_TRUE(DaemonExitingHere(cap_fd, "exiting"));
  EXPECT_FALSE(DaemonExitingHere(cap_fd, "alive"));
  EXPECT_FALSE(DaemonExitingHere(cap_fd, "other-ns"));
  close(cap_fd);
  std::vector<int> held;
  for (const char* id : {"exiting", "alive", "other-ns"}) {
    held.push_back(open((cap / id / "lock").c_str(), O_RDWR | O_CLOEXEC));
    ASSERT_GE(held.back(), 0);
    struct flock fl = {};
    fl.l_type = F_WRLCK;
    ASSERT_EQ(fcntl(held.back(), F_OFD_SETLK, &fl), 0);
  }
  // The exiting daemon's lock goes 300 ms into the start.
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    close(held[0]);
  });
  const auto t0 = std::chrono::steady_clock::now();
  Start(4);
  const double start_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  release.join();
  std::string all;
  for (const auto& l : log_) all += l + "\n";
  EXPECT_EQ(ReadFile((dir_ / "exiting_here").string()), d) << all;
  EXPECT_FALSE(stdfs::exists(cap / "exiting"));
  EXPECT_GE(start_s, 0.25);
  EXPECT_LT(start_s, 5.0);  // the live ones are not waited for
  EXPECT_FALSE(stdfs::exists(dir_ / "alive_here"));
  EXPECT_FALSE(stdfs::exists(dir_ / "other_ns"));
  EXPECT_TRUE(stdfs::exists(cap / "alive" / "1.part"));
  EXPECT_TRUE(stdfs::exists(cap / "other-ns" / "1.part"));
  close(held[1]);
  close(held[2]);
  waitpid(zombie, nullptr, 0);
}

// The owner, mode and times given while a file is pending are what it is placed with; the part
// stays 0600 and the daemon's until then. Recovery applies the journal's owner and times, never
// S_ISUID/S_ISGID (the journal is untrusted).
TEST_F(WriteCaptureTest, PlacedWithItsOwnerModeAndTimesAlsoAfterACrash) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give files away";
  Start(4);
  auto f = Create("owned.bin");
  ASSERT_NE(f, nullptr);
  ASSERT_TRUE(capture_->SetOwner(*f, 4242, 4343).ok());
  ASSERT_TRUE(capture_->SetMode(*f, 02750).ok());
  WriteAll(*f, std::vector<std::byte>(1000, std::byte{7}), 300);
  const struct timespec times[2] = {{1000000000, 5}, {1500000000, 7}};
  ASSERT_TRUE(capture_->SetTimes(*f, times).ok());
  EXPECT_EQ(capture_->Stat(*f).st_uid, 4242u);
  EXPECT_EQ(capture_->Stat(*f).st_mtim.tv_sec, 1500000000);
  ASSERT_TRUE(capture_->Close(*f).ok());
  ASSERT_TRUE(capture_->Sync().ok());
  struct stat st = {};
  ASSERT_EQ(lstat((dir_ / "owned.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 4242u);
  EXPECT_EQ(st.st_gid, 4343u);
  EXPECT_EQ(st.st_mode & 07777, 02750u);
  EXPECT_EQ(st.st_mtim.tv_sec, 1500000000);
  EXPECT_EQ(st.st_mtim.tv_nsec, 7);
  EXPECT_EQ(st.st_atim.tv_sec, 1000000000);
  capture_.reset();

  // A crash after the commit record: the next mount places it with the journal's owner and times.
  const stdfs::path cap = dir_ / ".ucpfs" / "capture";
  for (const auto& e : stdfs::directory_iterator(cap)) stdfs::remove_all(e.path());
  const std::vector<std::byte> data(3000, std::byte{9});
  std::ofstream(cap / "1.part", std::ios::binary).write(reinterpret_cast<const char*>(data.data()), 3000);
  JournalRecord commit = CommitRecord(1, data.size(), "recovered.bin");
  commit.mode = 04755;
  commit.attrs = {true, 4242, 4343, 1000000000000000000, 1600000000000000123};
  WriteJournal(cap / "journal", {ChunkRecord(1, 0, data), commit});
  auto parsed = ParseJournal(ReadFile((cap / "journal").string()));
  ASSERT_TRUE(parsed.ok());
  ASSERT_EQ(parsed->records.size(), 2u);
  EXPECT_EQ(parsed->records[1].attrs.uid, 4242u);
  EXPECT_EQ(parsed->records[1].attrs.mtime_ns, 1600000000000000123);
  Start(4);
  ASSERT_EQ(lstat((dir_ / "recovered.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 4242u);
  EXPECT_EQ(st.st_gid, 4343u);
  EXPECT_EQ(st.st_mode & 07777, 0755u);  // no set-id bit from a journal
  EXPECT_EQ(st.st_mtim.tv_sec, 1600000000);
  EXPECT_EQ(st.st_mtim.tv_nsec, 123);
}

// ---- the capture directory is untrusted ----

TEST_F(WriteCaptureTest, HardLinksPlantedInADeadStateNeverTouchAnOutsideFile) {
  const stdfs::path cap = dir_ / ".ucpfs" / "capture";
  const stdfs::path dead = cap / "planted";
  stdfs::create_directories(dead);
  stdfs::permissions(dead, stdfs::perms::owner_all);
  std::ofstream(dead / "lock").put('\0');  // free: the mount that made it is dead
  std::ofstream(dead / "lease") << "host h\nboot " << BootId() << "\npid 1\n";
  const stdfs::path outside = dir_.string() + "-outside";
  stdfs::create_directories(outside);
  const std::vector<std::byte> victim_bytes(8192, std::byte{'v'});
  std::ofstream(outside / "victim", std::ios::binary).write(reinterpret_cast<const char*>(victim_bytes.data()), 8192);
  std::ofstream(outside / "victim2", std::ios::binary).write("keep", 4);
  stdfs::permissions(outside / "victim", static_cast<stdfs::perms>(0644));
  // The part is a hard link to the victim, and the journal says it is a whole file of 100 bytes
  // to be made 06777: recovery would truncate and chmod the victim through it.
  stdfs::create_hard_link(outside / "victim", dead / "1.part");
  // journal.new is a hard link to another outside file; a valid file whose directory is gone is
  // kept, which rewrites the journal through journal.new.
  stdfs::create_hard_link(outside / "victim2", dead / "journal.new");
  const std::vector<std::byte> d(100, std::byte{3});
  std::ofstream(dead / "2.part", std::ios::binary).write(reinterpret_cast<const char*>(d.data()), 100);
  JournalRecord commit = CommitRecord(1, 100, "x");
  commit.mode = 06777;
  const std::vector<std::byte> first(victim_bytes.begin(), victim_bytes.begin() + 100);
  WriteJournal(dead / "journal", {ChunkRecord(1, 0, first), commit, ChunkRecord(2, 0, d), CommitRecord(2, 100, "gone/y")});
  Start(4);
  EXPECT_EQ(ReadFile((outside / "victim").string()), victim_bytes);
  EXPECT_EQ(stdfs::status(outside / "victim").permissions(), static_cast<stdfs::perms>(0644));
  EXPECT_EQ(stdfs::hard_link_count(outside / "victim"), 1u);  // the planted link is dropped, not placed
  EXPECT_FALSE(stdfs::exists(dir_ / "x"));
  EXPECT_EQ(ReadFile((outside / "victim2").string()).size(), 4u);
  std::string all;
  for (const auto& l : log_) all += l + "\n";
  EXPECT_NE(all.find("hard links"), std::string::npos) << all;
  stdfs::remove_all(outside);
}

TEST_F(WriteCaptureTest, ADirectoryMovedOutOfTheSourceIsNeverWrittenInto) {
  Start(4);
  auto f = Create("shard.bin", sub_fd_);
  WriteAll(*f, std::vector<std::byte>(5000, std::byte{1}), 5000);
  const stdfs::path outside = dir_.string() + "-moved";
  stdfs::rename(dir_ / "sub", outside);  // from outside, while shard.bin is pending
  EXPECT_TRUE(capture_->Close(*f).ok());
  const Status s = capture_->Sync();
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(stdfs::exists(outside / "shard.bin"));
  CaptureStats st = capture_->Stats();
  for (int i = 0; i < 200 && (st.unplaced.empty() || st.unplaced[0].kept_in.empty()); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // made durable in its part meanwhile
    st = capture_->Stats();
  }
  ASSERT_EQ(st.unplaced.size(), 1u);
  EXPECT_EQ(st.unplaced[0].path, "sub/shard.bin");
  EXPECT_FALSE(st.unplaced[0].kept_in.empty());
  capture_.reset();  // unmount: kept for the next mount
  EXPECT_FALSE(stdfs::exists(outside / "shard.bin"));
  stdfs::rename(outside, dir_ / "sub");
  Start(4);  // the next mount places it where it belongs
  EXPECT_EQ(ReadFile((dir_ / "sub" / "shard.bin").string()), std::vector<std::byte>(5000, std::byte{1}));
}

TEST_F(WriteCaptureTest, AnExclusiveCreateNeverReplacesANameTakenMeanwhile) {
  Start(4);
  auto f = capture_->Create(src_fd_, "e.bin", 0644, /*exclusive=*/true);
  ASSERT_TRUE(f.ok());
  WriteAll(**f, std::vector<std::byte>(100, std::byte{1}), 100);
  std::ofstream(dir_ / "e.bin") << "theirs";
  EXPECT_TRUE(capture_->Close(**f).ok());
  const Status s = capture_->Sync();
  EXPECT_EQ(s.sys_errno(), EEXIST) << s.ToString();
  EXPECT_EQ(ReadFile((dir_ / "e.bin").string()).size(), 6u);
  // Unlinking it through the mount lets the queue go on.
  EXPECT_TRUE(capture_->Discard(**f));
  auto g = Create("after.bin");
  WriteAll(*g, std::vector<std::byte>(10, std::byte{2}), 10);
  EXPECT_TRUE(capture_->Close(*g).ok());
  EXPECT_TRUE(capture_->Sync().ok());
  EXPECT_TRUE(stdfs::exists(dir_ / "after.bin"));
}

TEST(CaptureJournal, DamagedAndTornRecordsEndTheJournal) {
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(kJournalMagic),
                               reinterpret_cast<const std::byte*>(kJournalMagic) + sizeof(kJournalMagic));
  const std::vector<std::byte> d(5, std::byte{9});
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    const auto e = EncodeJournalRecord(ChunkRecord(seq, 0, d));
    bytes.insert(bytes.end(), e.begin(), e.end());
  }
  auto whole = ParseJournal(bytes);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->records.size(), 3u);
  EXPECT_TRUE(whole->stopped.empty());
  auto torn = ParseJournal(std::span(bytes).first(bytes.size() - 3));
  ASSERT_TRUE(torn.ok());
  EXPECT_EQ(torn->records.size(), 2u);
  EXPECT_FALSE(torn->stopped.empty());
  bytes[sizeof(kJournalMagic) + 20] ^= std::byte{0x40};  // inside the first record
  auto damaged = ParseJournal(bytes);
  ASSERT_TRUE(damaged.ok());
  EXPECT_EQ(damaged->records.size(), 0u);
  EXPECT_NE(damaged->stopped.find("damaged"), std::string::npos);
  EXPECT_FALSE(ParseJournal(std::span(bytes).first(4)).ok());  // no magic
  // A commit whose path is too long for its payload, or absurd lengths, never over-reads.
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 6);
  for (int i = 0; i < 2000; ++i) {
    std::vector<std::byte> junk = bytes;
    for (int k = 0; k < 4; ++k) junk[rng() % junk.size()] = static_cast<std::byte>(rng() & 0xff);
    junk.resize(rng() % (junk.size() + 1));
    (void)ParseJournal(junk);
  }
}

TEST(CoalesceWrites, MergesWhatContinuesInTheFileAndInMemory) {
  alignas(4096) static std::byte arena[6 * 4096];
  auto op = [&](int fd, uint64_t offset, int chunk, uint64_t id) {
    IoOp o;
    o.kind = OpKind::kWrite;
    o.fd = fd;
    o.byte_offset = offset;
    o.buffer = arena + chunk * 4096;
    o.n_bytes = 4096;
    o.registered_buffer = chunk;
    o.user_data = id;
    return o;
  };
  // fd 3: offsets 0,4096,8192 from chunks 0,1,2 (one write); fd 3 offset 12288 from chunk 4
  // (memory not adjacent); fd 4 offset 4096 from chunk 3 (another file). Given out of order.
  std::vector<std::vector<uint64_t>> members;
  const std::vector<IoOp> out = CoalesceWrites(
      {op(3, 8192, 2, 10), op(4, 4096, 3, 11), op(3, 0, 0, 12), op(3, 12288, 4, 13), op(3, 4096, 1, 14)}, &members);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].fd, 3);
  EXPECT_EQ(out[0].byte_offset, 0u);
  EXPECT_EQ(out[0].n_bytes, 3u * 4096);
  EXPECT_EQ(out[0].registered_buffer, -1);
  EXPECT_EQ(members[out[0].user_data], (std::vector<uint64_t>{12, 14, 10}));
  EXPECT_EQ(out[1].byte_offset, 12288u);
  EXPECT_EQ(out[1].registered_buffer, 4);
  EXPECT_EQ(members[out[1].user_data], (std::vector<uint64_t>{13}));
  EXPECT_EQ(out[2].fd, 4);
  EXPECT_EQ(members[out[2].user_data], (std::vector<uint64_t>{11}));
}

TEST(CaptureJournal, PlacePathRules) {
  EXPECT_TRUE(CheckPlacePath("global_step3/mp_rank_00_model_states.pt").ok());
  EXPECT_TRUE(CheckPlacePath("latest").ok());
  for (const char* bad : {"", "/etc/passwd", "../x", "a/../b", "a//b", "./a", ".ucpfs/capture/1.part", "a/"}) {
    EXPECT_FALSE(CheckPlacePath(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace ucpfs::io
