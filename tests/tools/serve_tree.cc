// serve_tree: mounts a fixed demo Tree with ServeTree, in the foreground, for the FUSE e2e
// test (tests/e2e/fuse_tree_test.py, which holds the same layout as its expectations).
//
//   serve_tree MOUNTPOINT [--fail-read PATH] [--threads N]
//   serve_tree --unmount MOUNTPOINT      (calls fs::Unmount; exit status 0 on success)
//
// When fd 3 is an open pipe, it is the readiness pipe: one byte once the mount answers, then closed.
// Ends when unmounted (fusermount3 -u / umount) or on SIGINT/SIGTERM (unmounting itself).
//
// Content: byte o of a file with seed s is byte (o % 8) (little-endian) of the 64-bit word
// (o / 8 + 1) * 0x9E3779B97F4A7C15 + s (mod 2^64). Layout (sizes in bytes):
//   empty.bin 0 (seed 1)           one.bin 1 (2)
//   a/f4095.bin 4095 (3)           a/f4096.bin 4096 (4)
//   a/b/c/f1m3.bin 1 MiB + 3 (5)   big/gen64m.bin 64 MiB (6, computed on the fly, no buffer)
//   big/link4096.bin: a hard link to a/f4096.bin
//   broken/open_fails.bin 1000: its opener fails (EIO)
//   broken/size_mismatch.bin 100: its opener yields 99 bytes (EIO at open)
//   many/fNNN.bin for NNN in 000..299: NNN bytes (seed 1000 + NNN)
//   emptydir/
//   PATH from --fail-read: 2 MiB (seed 7); reads touching bytes >= 1 MiB fail (EIO)
// Not for: anything but tests.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/checked.h"
#include "fs/fuse_mount.h"
#include "fs/tree.h"

namespace {

using ucpfs::ByteSource;
using ucpfs::Result;
using ucpfs::Status;
using ucpfs::fs::Ino;
using ucpfs::fs::Tree;

static_assert(std::endian::native == std::endian::little, "content words are little-endian");

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

void FillContent(uint64_t seed, uint64_t byte_offset, std::span<std::byte> out) {
  size_t i = 0;
  uint64_t pos = byte_offset;
  // Head up to a word boundary, whole words, then the tail.
  while (i < out.size() && pos % 8 != 0) {
    const uint64_t word = (pos / 8 + 1) * kGolden + seed;
    out[i++] = static_cast<std::byte>(word >> (8 * (pos % 8)));
    ++pos;
  }
  for (uint64_t w = pos / 8 + 1; out.size() - i >= 8; ++w, i += 8, pos += 8) {
    const uint64_t word = w * kGolden + seed;
    std::memcpy(out.data() + i, &word, 8);
  }
  while (i < out.size()) {
    const uint64_t word = (pos / 8 + 1) * kGolden + seed;
    out[i++] = static_cast<std::byte>(word >> (8 * (pos % 8)));
    ++pos;
  }
}

// Bytes computed from offsets: any size without holding it in memory.
class GeneratedSource : public ByteSource {
 public:
  GeneratedSource(std::string name, uint64_t n_bytes, uint64_t seed)
      : name_(std::move(name)), n_bytes_(n_bytes), seed_(seed) {}
  uint64_t Size() const override { return n_bytes_; }
  const std::string& Name() const override { return name_; }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override {
    if (!ucpfs::RangeInside(byte_offset, out.size(), n_bytes_)) {
      return ucpfs::OutOfRangeError(name_ + ": read past end at offset " +
                                    std::to_string(byte_offset));
    }
    FillContent(seed_, byte_offset, out);
    return Status::Ok();
  }

 private:
  std::string name_;
  uint64_t n_bytes_;
  uint64_t seed_;
};

// Generated content whose reads fail once they touch bytes at or past `fail_from`.
class FailingSource final : public GeneratedSource {
 public:
  FailingSource(std::string name, uint64_t n_bytes, uint64_t seed, uint64_t fail_from)
      : GeneratedSource(std::move(name), n_bytes, seed), fail_from_(fail_from) {}
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override {
    if (byte_offset + out.size() > fail_from_) {
      return ucpfs::IoError(Name() + ": simulated media error at offset " +
                                std::to_string(byte_offset),
                            EIO);
    }
    return GeneratedSource::ReadAt(byte_offset, out);
  }

 private:
  uint64_t fail_from_;
};

std::shared_ptr<const ByteSource> MemoryFile(const std::string& name, uint64_t n_bytes,
                                             uint64_t seed) {
  std::vector<std::byte> bytes(n_bytes);
  FillContent(seed, 0, bytes);
  return std::make_shared<ucpfs::MemorySource>(name, std::move(bytes));
}

ucpfs::fs::Opener Shared(std::shared_ptr<const ByteSource> source) {
  return [source]() -> Result<std::shared_ptr<const ByteSource>> { return source; };
}

Status Check(const Status& s) {
  if (!s.ok()) std::fprintf(stderr, "serve_tree: %s\n", s.ToString().c_str());
  return s;
}

#define TRY(expr)                                   \
  do {                                              \
    if (!Check(expr).ok()) return nullptr;          \
  } while (0)
#define TRY_ASSIGN(lhs, expr)                       \
  do {                                              \
    auto r_ = (expr);                               \
    if (!Check(r_.status()).ok()) return nullptr;   \
    lhs = *r_;                                      \
  } while (0)

std::shared_ptr<Tree> BuildDemoTree(const std::string& fail_read_path) {
  auto tree = std::make_shared<Tree>();
  const struct timespec mtime = {1700000000, 123456789};
  const Ino root = ucpfs::fs::kRootIno;
  auto add_mem = [&](Ino dir, const std::string& name, uint64_t n_bytes, uint64_t seed) {
    return tree->AddFile(dir, name, n_bytes, mtime, Shared(MemoryFile(name, n_bytes, seed)));
  };
  Ino a = 0, c = 0, big = 0, broken = 0, many = 0, f4096 = 0, ignored = 0;
  TRY_ASSIGN(ignored, add_mem(root, "empty.bin", 0, 1));
  TRY_ASSIGN(ignored, add_mem(root, "one.bin", 1, 2));
  TRY_ASSIGN(a, tree->AddDir(root, "a", mtime));
  TRY_ASSIGN(ignored, add_mem(a, "f4095.bin", 4095, 3));
  TRY_ASSIGN(f4096, add_mem(a, "f4096.bin", 4096, 4));
  TRY_ASSIGN(c, tree->MakeDirs(a, "b/c", mtime));
  TRY_ASSIGN(ignored, add_mem(c, "f1m3.bin", kMiB + 3, 5));
  TRY_ASSIGN(big, tree->AddDir(root, "big", mtime));
  TRY_ASSIGN(ignored, tree->AddFile(big, "gen64m.bin", 64 * kMiB, mtime,
                                    Shared(std::make_shared<GeneratedSource>(
                                        "gen64m.bin", 64 * kMiB, 6))));
  TRY(tree->AddLink(big, "link4096.bin", f4096));
  TRY_ASSIGN(broken, tree->AddDir(root, "broken", mtime));
  TRY_ASSIGN(ignored, tree->AddFile(broken, "open_fails.bin", 1000, mtime,
                                    []() -> Result<std::shared_ptr<const ByteSource>> {
                                      return ucpfs::IoError("open_fails.bin: simulated open failure", EIO);
                                    }));
  TRY_ASSIGN(ignored, tree->AddFile(broken, "size_mismatch.bin", 100, mtime,
                                    Shared(MemoryFile("size_mismatch.bin", 99, 8))));
  TRY_ASSIGN(many, tree->AddDir(root, "many", mtime));
  for (uint64_t i = 0; i < 300; ++i) {
    char name[32];
    std::snprintf(name, sizeof(name), "f%03llu.bin", static_cast<unsigned long long>(i));
    // Opened lazily: the bytes are made at open time, as real views do.
    TRY_ASSIGN(ignored, tree->AddFile(many, name, i, mtime,
                                      [i, n = std::string(name)]()
                                          -> Result<std::shared_ptr<const ByteSource>> {
                                        return MemoryFile(n, i, 1000 + i);
                                      }));
  }
  TRY_ASSIGN(ignored, tree->AddDir(root, "emptydir", mtime));
  if (!fail_read_path.empty()) {
    const size_t slash = fail_read_path.rfind('/');
    Ino dir = root;
    if (slash != std::string::npos) {
      TRY_ASSIGN(dir, tree->MakeDirs(root, fail_read_path.substr(0, slash), mtime));
    }
    const std::string name = fail_read_path.substr(slash == std::string::npos ? 0 : slash + 1);
    TRY_ASSIGN(ignored, tree->AddFile(dir, name, 2 * kMiB, mtime,
                                      Shared(std::make_shared<FailingSource>(name, 2 * kMiB, 7,
                                                                             kMiB))));
  }
  (void)ignored;
  return tree;
}

int Usage() {
  std::fprintf(stderr,
               "usage: serve_tree MOUNTPOINT [--fail-read PATH] [--threads N]\n"
               "       serve_tree --unmount MOUNTPOINT\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--unmount") {
    const Status status = ucpfs::fs::Unmount(argv[2]);
    if (!status.ok()) {
      std::fprintf(stderr, "serve_tree: %s\n", status.ToString().c_str());
      return 1;
    }
    return 0;
  }
  std::string mountpoint, fail_read_path;
  int threads = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--fail-read" && i + 1 < argc) {
      fail_read_path = argv[++i];
    } else if (arg == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (!arg.empty() && arg[0] != '-' && mountpoint.empty()) {
      mountpoint = arg;
    } else {
      return Usage();
    }
  }
  if (mountpoint.empty()) return Usage();
  std::shared_ptr<Tree> tree = BuildDemoTree(fail_read_path);
  if (tree == nullptr) return 1;

  ucpfs::fs::MountOptions options;
  options.mountpoint = mountpoint;
  options.fsname = "serve_tree";
  options.max_threads = threads;
  // fd 3 counts as the readiness pipe only when it is one (not some other inherited fd).
  struct stat st = {};
  if (fcntl(3, F_GETFD) != -1 && fstat(3, &st) == 0 && S_ISFIFO(st.st_mode)) {
    fcntl(3, F_SETFD, FD_CLOEXEC);  // not for helpers such as fusermount3
    options.ready_fd = 3;
  }
  const Status status = ucpfs::fs::ServeTree(std::move(tree), options);
  if (!status.ok()) {
    std::fprintf(stderr, "serve_tree: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
