// IoEngine conformance (core/io/io_engine.h): one suite that every engine runs (pread, io_uring,
// and the fault engine with no faults over each), then what only io_uring shows (completions
// really out of order, the cached probe), then the fault engine's own tests: short transfers
// and EINTR still move the exact bytes, EIO/ENOSPC/EDQUOT surface with their codes and errnos,
// `times` and the injection count, and a seeded random run against a naive oracle
// (UCPFS_TEST_SEED replays it).
#include "core/io/io_engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "test_seed.h"

namespace ucpfs::io {
namespace {

namespace fs = std::filesystem;

using Bytes = std::vector<std::byte>;

Bytes RandomBytes(std::mt19937_64& rng, size_t n_bytes) {
  Bytes out(n_bytes);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

// A directory of its own under the temp directory, removed with everything in it.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    std::replace(name.begin(), name.end(), '/', '_');
    path_ = fs::temp_directory_path() / ("ucpfs_io_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() { fs::remove_all(path_); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// An open descriptor, closed when it goes.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const std::string& path, int flags) : fd_(::open(path.c_str(), flags | O_CLOEXEC, 0644)) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

void WriteFile(const std::string& path, const Bytes& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// The whole file, read with plain pread (an oracle independent of the engines).
Bytes ReadWholeFile(int fd) {
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  Bytes out(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(done));
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  EXPECT_EQ(done, out.size());
  return out;
}

IoOp Read(int fd, uint64_t byte_offset, std::byte* buffer, size_t n_bytes, uint64_t user_data = 0) {
  return IoOp{.kind = OpKind::kRead, .fd = fd, .byte_offset = byte_offset, .buffer = buffer,
              .n_bytes = n_bytes, .user_data = user_data};
}
IoOp Write(int fd, uint64_t byte_offset, const std::byte* buffer, size_t n_bytes, uint64_t user_data = 0) {
  return IoOp{.kind = OpKind::kWrite, .fd = fd, .byte_offset = byte_offset,
              .buffer = const_cast<std::byte*>(buffer), .n_bytes = n_bytes, .user_data = user_data};
}
IoOp Fdatasync(int fd, uint64_t user_data = 0) {
  return IoOp{.kind = OpKind::kFdatasync, .fd = fd, .user_data = user_data};
}

// Reaps until nothing is in flight, at most `span_size` at a time, waiting when `wait_every`
// says so (else polling). Each user_data must come back once.
std::map<uint64_t, IoCompletion> ReapAll(IoEngine& engine, size_t span_size,
                                         const std::function<bool()>& wait_every = [] { return true; }) {
  std::map<uint64_t, IoCompletion> got;
  std::vector<IoCompletion> out(span_size);
  while (engine.InFlight() > 0) {
    const size_t before = engine.InFlight();
    const bool wait = wait_every();
    Result<size_t> n = engine.Reap(out, wait);
    if (!n.ok()) {
      ADD_FAILURE() << n.error().ToString();
      break;
    }
    if (wait && *n == 0) {
      ADD_FAILURE() << "Reap(wait) returned nothing with " << before << " in flight";
      break;
    }
    EXPECT_LE(*n, span_size);
    EXPECT_EQ(engine.InFlight(), before - *n);
    for (size_t k = 0; k < *n; ++k) {
      EXPECT_TRUE(got.emplace(out[k].user_data, out[k]).second) << "user_data " << out[k].user_data << " twice";
    }
  }
  return got;
}

// ---- one conformance suite, every engine ----

using MakeEngine = std::function<Result<std::unique_ptr<IoEngine>>(unsigned queue_depth)>;

Result<std::unique_ptr<IoEngine>> WithoutFaults(Result<std::unique_ptr<IoEngine>> inner) {
  if (!inner.ok()) return inner;
  return MakeFaultEngine(std::move(inner).value(), std::make_shared<FaultPlan>(std::vector<Fault>{}));
}

struct EngineKind {
  std::string test_name;
  std::string engine_name;  // Name()
  MakeEngine make;
};

const EngineKind kPread{"pread", "pread", [](unsigned) -> Result<std::unique_ptr<IoEngine>> { return MakePreadEngine(); }};
const EngineKind kUring{"io_uring", "io_uring", [](unsigned d) { return MakeUringEngine(d); }};
const EngineKind kFaultPread{"fault_pread", "fault(pread)", [](unsigned d) { return WithoutFaults(kPread.make(d)); }};
const EngineKind kFaultUring{"fault_io_uring", "fault(io_uring)", [](unsigned d) { return WithoutFaults(kUring.make(d)); }};

std::string TestName(const ::testing::TestParamInfo<EngineKind>& param_info) { return param_info.param.test_name; }

// Makes the parameter's engine, or skips the test where io_uring cannot run.
#define UCPFS_MAKE_ENGINE_OR_SKIP(var, kind, depth)                                   \
  auto var##_made = (kind).make(depth);                                               \
  if (!var##_made.ok() && var##_made.error().code() == StatusCode::kUnsupported) {    \
    GTEST_SKIP() << var##_made.error().ToString();                                    \
  }                                                                                   \
  ASSERT_TRUE(var##_made.ok()) << var##_made.error().ToString();                      \
  std::unique_ptr<IoEngine> var = std::move(var##_made).value()

class Conformance : public ::testing::TestWithParam<EngineKind> {
 protected:
  static constexpr unsigned kDepth = 4;  // small, so batches are larger than the queue

  void SetUp() override {
    rng_.seed(ucpfs::testing::TestSeed());
    UCPFS_MAKE_ENGINE_OR_SKIP(engine, GetParam(), kDepth);
    engine_ = std::move(engine);
  }

  std::mt19937_64 rng_;
  ScratchDir dir_;
  std::unique_ptr<IoEngine> engine_;
};

TEST_P(Conformance, NameAndQueueDepth) {
  EXPECT_EQ(engine_->Name(), GetParam().engine_name);
  EXPECT_GE(engine_->QueueDepth(), 1u);
  EXPECT_LE(engine_->QueueDepth(), kDepth);
  EXPECT_EQ(engine_->InFlight(), 0u);
  std::vector<IoCompletion> out(4);
  auto none = engine_->Reap(out, /*wait=*/true);  // nothing in flight: returns at once
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, 0u);
}

TEST_P(Conformance, ManyReadsInOneBatchComeBackByUserData) {
  const Bytes want = RandomBytes(rng_, 256 << 10);
  WriteFile(dir_.File("r.bin"), want);
  Fd fd(dir_.File("r.bin"), O_RDONLY);
  ASSERT_GE(fd.get(), 0);

  constexpr size_t kOps = 100;  // > kDepth
  std::vector<Bytes> buffers(kOps);
  std::vector<IoOp> ops;
  for (size_t i = 0; i < kOps; ++i) {
    const uint64_t off = rng_() % want.size();
    const size_t n = std::min<size_t>(rng_() % 8192 + 1, want.size() - off);
    buffers[i].assign(n, std::byte{0});
    ops.push_back(Read(fd.get(), off, buffers[i].data(), n, /*user_data=*/1000 + 7 * i));
  }
  ASSERT_TRUE(engine_->Submit(ops).ok());
  EXPECT_EQ(engine_->InFlight(), kOps);
  const auto got = ReapAll(*engine_, 3);
  ASSERT_EQ(got.size(), kOps);
  for (size_t i = 0; i < kOps; ++i) {
    auto it = got.find(ops[i].user_data);
    ASSERT_NE(it, got.end()) << "op " << i;
    ASSERT_TRUE(it->second.status.ok()) << it->second.status.ToString();
    EXPECT_EQ(it->second.n_bytes, ops[i].n_bytes);
    EXPECT_TRUE(std::equal(buffers[i].begin(), buffers[i].end(), want.begin() + static_cast<long>(ops[i].byte_offset)))
        << "op " << i;
  }
}

TEST_P(Conformance, ManyWritesInOneBatch) {
  constexpr size_t kChunk = 4096, kOps = 64;
  const Bytes data = RandomBytes(rng_, kChunk * kOps);
  Fd fd(dir_.File("w.bin"), O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_GE(fd.get(), 0);
  std::vector<size_t> order(kOps);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng_);
  std::vector<IoOp> ops;
  for (size_t i : order) ops.push_back(Write(fd.get(), i * kChunk, data.data() + i * kChunk, kChunk, ~uint64_t{i}));
  ASSERT_TRUE(engine_->Submit(ops).ok());
  const auto got = ReapAll(*engine_, 5);
  ASSERT_EQ(got.size(), kOps);
  for (const auto& [user_data, c] : got) {
    EXPECT_TRUE(c.status.ok()) << c.status.ToString();
    EXPECT_EQ(c.n_bytes, kChunk);
  }
  EXPECT_EQ(ReadWholeFile(fd.get()), data);
}

TEST_P(Conformance, ReadsAtAndPastEndOfFileCompleteShort) {
  const Bytes want = RandomBytes(rng_, 1000);
  WriteFile(dir_.File("eof.bin"), want);
  Fd fd(dir_.File("eof.bin"), O_RDONLY);
  ASSERT_GE(fd.get(), 0);
  Bytes a(200), b(50), c(10), d(1000);
  const std::vector<IoOp> ops = {Read(fd.get(), 900, a.data(), a.size(), 1), Read(fd.get(), 1000, b.data(), b.size(), 2),
                                 Read(fd.get(), 5000, c.data(), c.size(), 3), Read(fd.get(), 0, d.data(), d.size(), 4),
                                 Read(fd.get(), 10, a.data(), 0, 5)};
  const std::vector<IoCompletion> done = engine_->RunAll(ops);
  ASSERT_EQ(done.size(), ops.size());
  ASSERT_TRUE(FirstError(done).ok()) << FirstError(done).ToString();
  const size_t want_n[] = {100, 0, 0, 1000, 0};
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(done[i].user_data, ops[i].user_data);
    EXPECT_EQ(done[i].n_bytes, want_n[i]) << "op " << i;
  }
  EXPECT_TRUE(std::equal(a.begin(), a.begin() + 100, want.begin() + 900));
  EXPECT_EQ(d, want);
}

TEST_P(Conformance, RunAllKeepsOpOrderAndReadExactChecksTheEnd) {
  const Bytes want = RandomBytes(rng_, 1000);
  WriteFile(dir_.File("ra.bin"), want);
  Fd fd(dir_.File("ra.bin"), O_RDONLY);
  ASSERT_GE(fd.get(), 0);
  std::vector<Bytes> buffers(20, Bytes(50));
  std::vector<IoOp> ops;
  for (size_t i = 0; i < buffers.size(); ++i) ops.push_back(Read(fd.get(), 50 * i, buffers[i].data(), 50, 77));
  const std::vector<IoCompletion> done = engine_->RunAll(ops);
  ASSERT_EQ(done.size(), ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    ASSERT_TRUE(done[i].status.ok()) << done[i].status.ToString();
    EXPECT_EQ(done[i].user_data, 77u);  // the ops' own user_data, even when not unique
    EXPECT_EQ(done[i].n_bytes, 50u);
    EXPECT_TRUE(std::equal(buffers[i].begin(), buffers[i].end(), want.begin() + static_cast<long>(50 * i)));
  }

  Bytes exact(100);
  ASSERT_TRUE(ReadExact(*engine_, fd.get(), 900, exact, "ra.bin").ok());
  EXPECT_TRUE(std::equal(exact.begin(), exact.end(), want.begin() + 900));
  Status past = ReadExact(*engine_, fd.get(), 950, exact, "ra.bin");
  EXPECT_EQ(past.code(), StatusCode::kDataLoss) << past.ToString();
  EXPECT_EQ(past.message(), "ra.bin: file shrank: short read at offset 1000");

  // RunAll needs nothing else in flight: it refuses rather than mixing completions up.
  ASSERT_TRUE(engine_->Submit(std::span(ops).first(1)).ok());
  const std::vector<IoCompletion> refused = engine_->RunAll(std::span(ops).subspan(1, 2));
  ASSERT_EQ(refused.size(), 2u);
  EXPECT_EQ(refused[0].status.code(), StatusCode::kInvalidArgument) << refused[0].status.ToString();
  EXPECT_EQ(ReapAll(*engine_, 1).size(), 1u);
}

TEST_P(Conformance, FdatasyncOp) {
  const Bytes data = RandomBytes(rng_, 10);
  Fd fd(dir_.File("sync.bin"), O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_GE(fd.get(), 0);
  const IoOp write = Write(fd.get(), 0, data.data(), data.size(), 1);
  ASSERT_TRUE(FirstError(engine_->RunAll(std::span(&write, 1))).ok());
  const IoOp sync = Fdatasync(fd.get(), 42);
  const std::vector<IoCompletion> done = engine_->RunAll(std::span(&sync, 1));
  ASSERT_TRUE(done[0].status.ok()) << done[0].status.ToString();
  EXPECT_EQ(done[0].user_data, 42u);
  EXPECT_EQ(done[0].n_bytes, 0u);
  EXPECT_EQ(ReadWholeFile(fd.get()), data);
}

TEST_P(Conformance, BadDescriptorsGiveIoErrorWithEbadf) {
  Bytes buffer(16);
  Fd read_only(dir_.File("ro.bin"), O_RDONLY | O_CREAT);
  ASSERT_GE(read_only.get(), 0);
  const std::vector<IoOp> ops = {Read(-1, 123, buffer.data(), buffer.size()), Write(-1, 123, buffer.data(), buffer.size()),
                                 Fdatasync(-1), Write(read_only.get(), 123, buffer.data(), buffer.size())};
  const std::vector<IoCompletion> done = engine_->RunAll(ops);
  for (size_t i = 0; i < ops.size(); ++i) {
    const Status& s = done[i].status;
    EXPECT_EQ(s.code(), StatusCode::kIo) << s.ToString();
    EXPECT_EQ(s.sys_errno(), EBADF) << s.ToString();
    EXPECT_EQ(done[i].n_bytes, 0u);
    EXPECT_NE(s.message().find("on fd " + std::to_string(ops[i].fd)), std::string::npos) << s.message();
    if (ops[i].kind != OpKind::kFdatasync) {
      EXPECT_NE(s.message().find("at offset 123"), std::string::npos) << s.message();
    }
    EXPECT_NE(s.message().find(ops[i].kind == OpKind::kRead    ? "read of 16 bytes"
                               : ops[i].kind == OpKind::kWrite ? "write of 16 bytes"
                                                               : "fdatasync"),
              std::string::npos)
        << s.message();
  }
  EXPECT_EQ(FirstError(done).message(), done[0].status.message());
}

TEST_P(Conformance, RegisterBuffersNeedsNothingInFlight) {
  Bytes buffer(4096);
  const iovec region{buffer.data(), buffer.size()};
  Fd fd(dir_.File("reg.bin"), O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_GE(fd.get(), 0);
  const IoOp op = Write(fd.get(), 0, buffer.data(), buffer.size());
  ASSERT_TRUE(engine_->Submit(std::span(&op, 1)).ok());
  EXPECT_EQ(engine_->RegisterBuffers(std::span(&region, 1)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ReapAll(*engine_, 1).size(), 1u);
  EXPECT_TRUE(engine_->RegisterBuffers(std::span(&region, 1)).ok());
  EXPECT_TRUE(engine_->RegisterBuffers({}).ok());
}

// O_DIRECT from 4096-aligned buffers registered as fixed buffers: what the flusher does.
TEST_P(Conformance, SparseSlotsFilledOneAtATime) {
  constexpr size_t kBlock = 4096;
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> a(static_cast<std::byte*>(std::aligned_alloc(kBlock, kBlock)));
  std::unique_ptr<std::byte, Free> b(static_cast<std::byte*>(std::aligned_alloc(kBlock, kBlock)));
  ASSERT_TRUE(a && b);
  const Bytes da = RandomBytes(rng_, kBlock), db = RandomBytes(rng_, kBlock);
  std::copy(da.begin(), da.end(), a.get());
  std::copy(db.begin(), db.end(), b.get());
  ASSERT_TRUE(engine_->RegisterBufferSlots(4).ok());
  ASSERT_TRUE(engine_->UpdateBuffer(1, iovec{a.get(), kBlock}).ok());
  Fd fd(::open(dir_.File("sparse.bin").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  ASSERT_GE(fd.get(), 0);
  // From a filled slot, and from an empty one (an ordinary write).
  IoOp wa = Write(fd.get(), 0, a.get(), kBlock, 0);
  wa.registered_buffer = 1;
  IoOp wb = Write(fd.get(), kBlock, b.get(), kBlock, 1);
  wb.registered_buffer = 2;
  const IoOp writes[] = {wa, wb};
  std::vector<IoCompletion> done = engine_->RunAll(writes);
  ASSERT_TRUE(FirstError(done).ok()) << FirstError(done).ToString();
  Bytes back(2 * kBlock);
  ASSERT_TRUE(ReadExact(*engine_, fd.get(), 0, back, "sparse.bin").ok());
  EXPECT_TRUE(std::equal(da.begin(), da.end(), back.begin()));
  EXPECT_TRUE(std::equal(db.begin(), db.end(), back.begin() + kBlock));
  if (engine_->Name().find("io_uring") != std::string::npos) {
    EXPECT_EQ(engine_->UpdateBuffer(9, iovec{a.get(), kBlock}).code(), StatusCode::kInvalidArgument);
  }
  ASSERT_TRUE(engine_->RegisterBuffers({}).ok());
}

TEST_P(Conformance, DirectIoFromRegisteredBuffers) {
  constexpr size_t kBlock = 4096, kBlocks = 16, kRegion = kBlock * kBlocks;
  const int raw_fd = ::open(dir_.File("direct.bin").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
  if (raw_fd < 0 && errno == EINVAL) GTEST_SKIP() << "O_DIRECT is not supported under " << fs::temp_directory_path();
  ASSERT_GE(raw_fd, 0) << std::strerror(errno);
  Fd fd(raw_fd);
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> out(static_cast<std::byte*>(std::aligned_alloc(kBlock, kRegion)));
  std::unique_ptr<std::byte, Free> in(static_cast<std::byte*>(std::aligned_alloc(kBlock, kRegion)));
  ASSERT_TRUE(out && in);
  const Bytes data = RandomBytes(rng_, kRegion);
  std::copy(data.begin(), data.end(), out.get());
  std::fill_n(in.get(), kRegion, std::byte{0});
  const iovec regions[] = {{out.get(), kRegion}, {in.get(), kRegion}};
  Status registered = engine_->RegisterBuffers(regions);
  ASSERT_TRUE(registered.ok()) << registered.ToString();

  std::vector<IoOp> writes;
  for (size_t i = 0; i < kBlocks; ++i) {
    IoOp w = Write(fd.get(), i * kBlock, out.get() + i * kBlock, kBlock, i);
    w.registered_buffer = 0;
    writes.push_back(w);
  }
  std::vector<IoCompletion> done = engine_->RunAll(writes);
  ASSERT_TRUE(FirstError(done).ok()) << FirstError(done).ToString();
  const IoOp sync = Fdatasync(fd.get());
  ASSERT_TRUE(FirstError(engine_->RunAll(std::span(&sync, 1))).ok());

  std::vector<IoOp> reads;
  for (size_t i = 0; i < kBlocks; ++i) {
    IoOp r = Read(fd.get(), i * kBlock, in.get() + i * kBlock, kBlock, i);
    // The last read's hint names the wrong region: it must still read, as an ordinary read.
    r.registered_buffer = i + 1 < kBlocks ? 1 : 0;
    reads.push_back(r);
  }
  std::shuffle(reads.begin(), reads.end(), rng_);
  done = engine_->RunAll(reads);
  ASSERT_TRUE(FirstError(done).ok()) << FirstError(done).ToString();
  for (const IoCompletion& c : done) EXPECT_EQ(c.n_bytes, kBlock);
  EXPECT_TRUE(std::equal(data.begin(), data.end(), in.get()));
  EXPECT_TRUE(engine_->RegisterBuffers({}).ok());
}

INSTANTIATE_TEST_SUITE_P(Engines, Conformance, ::testing::Values(kPread, kUring, kFaultPread, kFaultUring),
                         TestName);

// ---- io_uring only ----

TEST(UringEngine, CompletesOutOfOrderAndResumesShortReads) {
  UCPFS_MAKE_ENGINE_OR_SKIP(engine, kUring, 4);
  ScratchDir dir;
  const std::string path = dir.File("f.bin");
  WriteFile(path, Bytes(64, std::byte{7}));
  Fd file(path, O_RDONLY);
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  Fd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  Bytes from_pipe(8), from_file(64);
  // The pipe read cannot end before something is written: the file read, submitted after it,
  // completes first.
  const std::vector<IoOp> ops = {Read(pipe_read.get(), 0, from_pipe.data(), from_pipe.size(), 1),
                                 Read(file.get(), 0, from_file.data(), from_file.size(), 2)};
  ASSERT_TRUE(engine->Submit(ops).ok());
  struct FeedThePipe {  // ends the pipe read whatever happens, so the engine can be destroyed
    int fd;
    size_t n_fed = 0;
    bool Feed(size_t n_bytes) {
      const ssize_t n = ::write(fd, "abcdefgh" + n_fed, n_bytes);
      n_fed += n > 0 ? static_cast<size_t>(n) : 0;
      return n == static_cast<ssize_t>(n_bytes);
    }
    ~FeedThePipe() { (void)Feed(8 - n_fed); }
  } feeder{pipe_write.get()};
  std::vector<IoCompletion> out(2);
  auto n = engine->Reap(out, /*wait=*/true);
  ASSERT_TRUE(n.ok());
  ASSERT_EQ(*n, 1u);
  EXPECT_EQ(out[0].user_data, 2u);
  EXPECT_EQ(out[0].n_bytes, 64u);
  // Half of what the pipe read asks for: a short read, resubmitted for the rest, still pending.
  ASSERT_TRUE(feeder.Feed(4));
  for (int i = 0; i < 20; ++i) {
    n = engine->Reap(out, /*wait=*/false);
    ASSERT_TRUE(n.ok());
    ASSERT_EQ(*n, 0u);
    ::usleep(1000);
  }
  EXPECT_EQ(engine->InFlight(), 1u);
  ASSERT_TRUE(feeder.Feed(4));
  n = engine->Reap(out, /*wait=*/true);
  ASSERT_TRUE(n.ok());
  ASSERT_EQ(*n, 1u);
  EXPECT_EQ(out[0].user_data, 1u);
  EXPECT_EQ(out[0].n_bytes, 8u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(from_pipe.data()), 8), "abcdefgh");
}

TEST(UringEngine, ProbeDecidesTheDefaultEngine) {
  EXPECT_EQ(MakeUringEngine(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeUringEngine(4097).status().code(), StatusCode::kInvalidArgument);
  auto first = MakeUringEngine(8);
  auto second = MakeUringEngine(8);
  EXPECT_EQ(first.ok(), second.ok());
  if (!first.ok()) {
    EXPECT_EQ(first.error().code(), StatusCode::kUnsupported);
    EXPECT_EQ(first.error().message(), second.error().message());  // the cached reason
  }
  EXPECT_EQ(MakeDefaultEngine(8)->Name(), first.ok() ? "io_uring" : "pread");
}

// ---- the fault engine ----

// The fault engine over each inner engine.
class FaultEngineTest : public ::testing::TestWithParam<EngineKind> {
 protected:
  void SetUp() override { rng_.seed(ucpfs::testing::TestSeed()); }

  // A fault engine over the parameter's engine with `faults` (skips where io_uring cannot run).
  std::unique_ptr<IoEngine> Make(std::vector<Fault> faults, unsigned queue_depth = 4) {
    plan_ = std::make_shared<FaultPlan>(std::move(faults));
    auto inner = GetParam().make(queue_depth);
    if (!inner.ok()) {
      skip_ = inner.error().code() == StatusCode::kUnsupported;
      EXPECT_TRUE(skip_) << inner.error().ToString();
      return nullptr;
    }
    return MakeFaultEngine(std::move(inner).value(), plan_);
  }

  std::mt19937_64 rng_;
  ScratchDir dir_;
  std::shared_ptr<FaultPlan> plan_;
  bool skip_ = false;
};

#define UCPFS_FAULT_ENGINE_OR_SKIP(var, ...) \
  auto var = Make(__VA_ARGS__);              \
  if (skip_) GTEST_SKIP() << "io_uring unavailable"; \
  ASSERT_NE(var, nullptr)

Fault At(OpKind kind, uint64_t byte_offset, Fault::Effect effect, int sys_errno = EIO, int times = -1) {
  return Fault{.kind = kind, .byte_offset = byte_offset, .effect = effect, .sys_errno = sys_errno, .times = times};
}

TEST_P(FaultEngineTest, ShortTransfersAndEintrMoveTheExactBytes) {
  using E = Fault::Effect;
  const Bytes want = RandomBytes(rng_, 64 << 10);
  WriteFile(dir_.File("f.bin"), want);
  UCPFS_FAULT_ENGINE_OR_SKIP(engine, {At(OpKind::kRead, 0, E::kEintr), At(OpKind::kRead, 100, E::kShort),
                                      At(OpKind::kRead, 5000, E::kShort), At(OpKind::kRead, 5001, E::kShort),
                                      At(OpKind::kRead, 20000, E::kEintr), At(OpKind::kRead, 30000, E::kShort),
                                      At(OpKind::kRead, 40000, E::kShort), At(OpKind::kRead, 60000, E::kError, EAGAIN),
                                      At(OpKind::kWrite, 7, E::kEintr),
                                      At(OpKind::kWrite, 100, E::kShort), At(OpKind::kWrite, 65535, E::kShort)});
  Fd fd(dir_.File("f.bin"), O_RDWR);
  ASSERT_GE(fd.get(), 0);
  Bytes all(want.size()), part(1000), one(1);
  const std::vector<IoOp> reads = {Read(fd.get(), 0, all.data(), all.size()),
                                   Read(fd.get(), 40000, part.data(), part.size()),
                                   Read(fd.get(), 5000, one.data(), one.size())};
  const std::vector<IoCompletion> done = engine->RunAll(reads);
  ASSERT_TRUE(FirstError(done).ok()) << FirstError(done).ToString();
  EXPECT_EQ(all, want);
  EXPECT_TRUE(std::equal(part.begin(), part.end(), want.begin() + 40000));
  EXPECT_EQ(one[0], want[5000]);
  // The whole-file read meets all 8 read faults (EAGAIN is retried like EINTR); the read at
  // 40000 is halved where it starts; the 1-byte read at 5000 cannot be shortened.
  EXPECT_EQ(plan_->InjectedCount(), 9u);

  const Bytes rewrite = RandomBytes(rng_, want.size());
  const IoOp write = Write(fd.get(), 0, rewrite.data(), rewrite.size());
  ASSERT_TRUE(FirstError(engine->RunAll(std::span(&write, 1))).ok());
  EXPECT_EQ(ReadWholeFile(fd.get()), rewrite);
  EXPECT_EQ(plan_->InjectedCount(), 12u);
}

TEST_P(FaultEngineTest, ErrorsSurfaceWithTheirCodeAndErrno) {
  using E = Fault::Effect;
  const Bytes want = RandomBytes(rng_, 64 << 10);
  WriteFile(dir_.File("e.bin"), want);
  UCPFS_FAULT_ENGINE_OR_SKIP(engine, {At(OpKind::kRead, 10000, E::kError, EIO),
                                      At(OpKind::kWrite, 20000, E::kError, ENOSPC, 1),
                                      At(OpKind::kWrite, 30000, E::kError, EDQUOT, 1),
                                      At(OpKind::kFdatasync, 0, E::kError, EIO, 1)});
  Fd fd(dir_.File("e.bin"), O_RDWR);
  ASSERT_GE(fd.get(), 0);

  Bytes all(want.size());
  const IoOp read = Read(fd.get(), 0, all.data(), all.size());
  IoCompletion c = engine->RunAll(std::span(&read, 1))[0];
  EXPECT_EQ(c.status.code(), StatusCode::kIo) << c.status.ToString();
  EXPECT_EQ(c.status.sys_errno(), EIO);
  EXPECT_EQ(c.n_bytes, 10000u);  // moved before the error
  EXPECT_TRUE(std::equal(all.begin(), all.begin() + 10000, want.begin()));
  EXPECT_EQ(c.status.message(), "read of 65536 bytes at offset 0 on fd " + std::to_string(fd.get()) +
                                    " failed at offset 10000 (" + engine->Name() + " engine): " + std::strerror(EIO));
  // ReadExact words it as the read path does.
  Status exact = ReadExact(*engine, fd.get(), 9000, std::span(all).first(2000), "e.bin");
  EXPECT_EQ(exact.message(), std::string("e.bin: pread at offset 10000: ") + std::strerror(EIO));
  EXPECT_EQ(exact.sys_errno(), EIO);

  const Bytes patch = RandomBytes(rng_, 8192);
  const IoOp write = Write(fd.get(), 16384, patch.data(), patch.size());
  c = engine->RunAll(std::span(&write, 1))[0];
  EXPECT_EQ(c.status.code(), StatusCode::kNoSpace) << c.status.ToString();
  EXPECT_EQ(c.status.sys_errno(), ENOSPC);
  EXPECT_EQ(c.n_bytes, 20000u - 16384u);
  Bytes now = ReadWholeFile(fd.get());
  EXPECT_TRUE(std::equal(patch.begin(), patch.begin() + (20000 - 16384), now.begin() + 16384));  // written before
  EXPECT_TRUE(std::equal(now.begin() + 20000, now.begin() + 16384 + 8192, want.begin() + 20000));  // not after
  // times = 1: the same write now succeeds.
  c = engine->RunAll(std::span(&write, 1))[0];
  EXPECT_TRUE(c.status.ok()) << c.status.ToString();

  const IoOp quota = Write(fd.get(), 29000, patch.data(), 4000);
  c = engine->RunAll(std::span(&quota, 1))[0];
  EXPECT_EQ(c.status.code(), StatusCode::kNoSpace) << c.status.ToString();
  EXPECT_EQ(c.status.sys_errno(), EDQUOT);

  const IoOp sync = Fdatasync(fd.get());
  c = engine->RunAll(std::span(&sync, 1))[0];
  EXPECT_EQ(c.status.code(), StatusCode::kIo);
  EXPECT_EQ(c.status.sys_errno(), EIO);
  EXPECT_NE(c.status.message().find("fdatasync on fd " + std::to_string(fd.get())), std::string::npos)
      << c.status.message();
  EXPECT_TRUE(engine->RunAll(std::span(&sync, 1))[0].status.ok());
  EXPECT_EQ(plan_->InjectedCount(), 5u);  // EIO read twice (times -1), ENOSPC, EDQUOT, fdatasync
}

TEST_P(FaultEngineTest, TimesLimitsHowManyOpsAFaultHits) {
  using E = Fault::Effect;
  WriteFile(dir_.File("t.bin"), Bytes(100, std::byte{1}));
  UCPFS_FAULT_ENGINE_OR_SKIP(engine, {At(OpKind::kRead, 50, E::kError, EIO, 2)});
  Fd fd(dir_.File("t.bin"), O_RDONLY);
  Bytes buffer(100);
  const IoOp read = Read(fd.get(), 0, buffer.data(), buffer.size());
  const std::vector<IoOp> three(3, read);
  const std::vector<IoCompletion> done = engine->RunAll(three);
  // Which two of the three fail is the engine's order; that exactly two do is not.
  EXPECT_EQ(std::count_if(done.begin(), done.end(), [](const IoCompletion& c) { return !c.status.ok(); }), 2);
  EXPECT_EQ(plan_->InjectedCount(), 2u);
  EXPECT_TRUE(engine->RunAll(std::span(&read, 1))[0].status.ok());
}

// Seeded: random batches of reads (across end of file) and disjoint writes, with fdatasyncs,
// under random faults, against a model of the file. Errors fire every time (their order across
// ops is then irrelevant); shorts and EINTRs fire a random number of times.
TEST_P(FaultEngineTest, RandomFaultsAgainstANaiveOracle) {
  using E = Fault::Effect;
  constexpr uint64_t kSpan = 128 << 10;
  std::vector<Fault> faults;
  std::vector<uint64_t> hot;  // fault offsets: faults share them, and ops start and end there, a third of the time
  auto offset = [&] {
    if (!hot.empty() && rng_() % 3 == 0) return hot[rng_() % hot.size()];
    hot.push_back(rng_() % kSpan);
    return hot.back();
  };
  for (int i = 0; i < 40; ++i) {
    const OpKind kind = rng_() % 2 ? OpKind::kRead : OpKind::kWrite;
    const int pick = static_cast<int>(rng_() % 10);
    const int error_errnos[] = {EIO, ENOSPC, EDQUOT};
    const int times_choices[] = {-1, 1, 3};
    if (pick < 2) {
      faults.push_back(At(kind, offset(), E::kError, error_errnos[rng_() % 3], -1));
    } else {
      faults.push_back(At(kind, offset(), pick < 6 ? E::kShort : E::kEintr, EIO, times_choices[rng_() % 3]));
    }
  }
  const bool sync_fails = rng_() % 2 == 0;
  if (sync_fails) faults.push_back(At(OpKind::kFdatasync, 0, E::kError, EIO, -1));
  faults.push_back(At(OpKind::kFdatasync, 0, E::kEintr, EIO, 2));
  const std::vector<Fault> plan = faults;
  UCPFS_FAULT_ENGINE_OR_SKIP(engine, faults, static_cast<unsigned>(1 + rng_() % 8));

  Fd fd(dir_.File("rand.bin"), O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_GE(fd.get(), 0);
  Bytes model;
  // The first error an op meets in [from, to), for `kind`.
  auto first_error = [&plan](OpKind kind, uint64_t from, uint64_t to) -> const Fault* {
    const Fault* first = nullptr;
    for (const Fault& f : plan) {
      if (f.kind != kind || f.effect != E::kError) continue;
      if (kind != OpKind::kFdatasync && (f.byte_offset < from || f.byte_offset >= to)) continue;
      if (first == nullptr || f.byte_offset < first->byte_offset) first = &f;
    }
    return first;
  };
  auto expect_error = [](const IoCompletion& c, const Fault& f) {
    EXPECT_EQ(c.status.code(), f.sys_errno == EIO ? StatusCode::kIo : StatusCode::kNoSpace) << c.status.ToString();
    EXPECT_EQ(c.status.sys_errno(), f.sys_errno) << c.status.ToString();
  };
  uint64_t n_errors = 0;
  for (int round = 0; round < 60; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const size_t n_ops = 1 + rng_() % 20;
    std::vector<IoOp> ops;
    std::vector<Bytes> buffers(n_ops);
    const bool writing = round < 5 || rng_() % 2 == 0;
    if (writing) {  // disjoint: sorted cut points, every other gap written
      std::vector<uint64_t> cuts(2 * n_ops);
      for (auto& cut : cuts) cut = rng_() % 3 == 0 ? hot[rng_() % hot.size()] : rng_() % kSpan;
      std::sort(cuts.begin(), cuts.end());
      for (size_t i = 0; i < n_ops; ++i) {
        buffers[i] = RandomBytes(rng_, cuts[2 * i + 1] - cuts[2 * i]);
        ops.push_back(Write(fd.get(), cuts[2 * i], buffers[i].data(), buffers[i].size(), rng_()));
      }
      ops.push_back(Fdatasync(fd.get(), rng_()));
    } else {
      for (size_t i = 0; i < n_ops; ++i) {
        const uint64_t off = rng_() % 3 == 0 ? hot[rng_() % hot.size()] : rng_() % (model.size() + 4096);
        buffers[i].assign(rng_() % 20000, std::byte{0xEE});
        ops.push_back(Read(fd.get(), off, buffers[i].data(), buffers[i].size(), rng_()));
      }
    }
    std::map<uint64_t, IoCompletion> got;
    if (rng_() % 2) {
      const std::vector<IoCompletion> done = engine->RunAll(ops);
      for (size_t i = 0; i < ops.size(); ++i) got[ops[i].user_data] = done[i];
    } else {
      ASSERT_TRUE(engine->Submit(ops).ok());
      std::mt19937_64 wait_rng(rng_());
      got = ReapAll(*engine, 1 + rng_() % 5, [&wait_rng] { return wait_rng() % 2 == 0; });
    }
    ASSERT_EQ(got.size(), ops.size()) << "user_data collided or ops were lost";

    const size_t size_before = model.size();
    for (size_t i = 0; i < ops.size(); ++i) {
      const IoOp& op = ops[i];
      const IoCompletion& c = got[op.user_data];
      if (op.kind == OpKind::kFdatasync) {
        if (const Fault* f = first_error(op.kind, 0, 0)) {
          expect_error(c, *f);
          ++n_errors;
        } else {
          EXPECT_TRUE(c.status.ok()) << c.status.ToString();
        }
        continue;
      }
      // A read moves up to end of file; it reaches an error where it starts or once every byte
      // before the error has moved (so one just at end of file, too).
      uint64_t end = op.byte_offset + op.n_bytes, error_end = end;
      if (op.kind == OpKind::kRead) {
        const uint64_t eof = std::max<uint64_t>(size_before, op.byte_offset);
        end = std::min(end, eof);
        error_end = std::min(error_end, eof + 1);
      }
      const Fault* f = first_error(op.kind, op.byte_offset, error_end);
      const uint64_t stop = f ? f->byte_offset : end;
      if (f) {
        expect_error(c, *f);
        ++n_errors;
      } else {
        EXPECT_TRUE(c.status.ok()) << c.status.ToString();
      }
      EXPECT_EQ(c.n_bytes, stop - op.byte_offset) << "op " << i;
      const auto n_moved = static_cast<long>(stop - op.byte_offset);
      if (op.kind == OpKind::kRead) {
        EXPECT_TRUE(std::equal(buffers[i].begin(), buffers[i].begin() + n_moved,
                               model.begin() + static_cast<long>(op.byte_offset)))
            << "op " << i;
      } else if (n_moved > 0) {
        if (model.size() < stop) model.resize(stop, std::byte{0});
        std::copy_n(buffers[i].begin(), n_moved, model.begin() + static_cast<long>(op.byte_offset));
      }
    }
    ASSERT_EQ(ReadWholeFile(fd.get()), model);
  }
  EXPECT_GE(plan_->InjectedCount(), n_errors);
}

// A short transfer takes its op two trips through the inner engine while its batch mate
// takes one: the completions come back out of submission order, matched by user_data.
TEST(FaultEngine, AShortTransferCompletesAfterItsBatchMate) {
  ScratchDir dir;
  WriteFile(dir.File("o.bin"), Bytes(16384, std::byte{3}));
  Fd fd(dir.File("o.bin"), O_RDONLY);
  auto plan = std::make_shared<FaultPlan>(std::vector<Fault>{At(OpKind::kRead, 1000, Fault::Effect::kShort)});
  auto engine = MakeFaultEngine(MakePreadEngine(), plan);
  Bytes a(4096), b(4096);
  const std::vector<IoOp> ops = {Read(fd.get(), 0, a.data(), a.size(), 10), Read(fd.get(), 8192, b.data(), b.size(), 11)};
  ASSERT_TRUE(engine->Submit(ops).ok());
  std::vector<uint64_t> order;
  std::vector<IoCompletion> out(1);
  while (engine->InFlight() > 0) {
    auto n = engine->Reap(out, /*wait=*/true);
    ASSERT_TRUE(n.ok() && *n == 1);
    EXPECT_TRUE(out[0].status.ok());
    EXPECT_EQ(out[0].n_bytes, 4096u);
    order.push_back(out[0].user_data);
  }
  EXPECT_EQ(order, (std::vector<uint64_t>{11, 10}));
  EXPECT_EQ(a, Bytes(4096, std::byte{3}));
  EXPECT_EQ(plan->InjectedCount(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Inner, FaultEngineTest, ::testing::Values(kPread, kUring),
                         TestName);

}  // namespace
}  // namespace ucpfs::io
