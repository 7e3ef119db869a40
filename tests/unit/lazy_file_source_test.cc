// Source files: FIFOs, sockets and symlinks are refused by name without blocking; a file
// replaced or edited in place after indexing is never served (kDataLoss naming it), while an
// open one replaced by a rename keeps serving what it opened; any number of files is served
// through a small descriptor cache.
#include "core/io/lazy_file_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace ucpfs {
namespace {

namespace fs = std::filesystem;

class SourceFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ucpfs_lfs_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    return path;
  }
  static FileIdentity Indexed(const std::string& path) {
    auto f = FileSource::Open(path);
    EXPECT_TRUE(f.ok()) << f.error().ToString();
    return (*f)->identity();
  }
  static Result<std::string> Read(const ByteSource& src) {
    std::string out(src.Size(), '\0');
    UCPFS_RETURN_IF_ERROR(src.ReadAt(0, std::as_writable_bytes(std::span(out.data(), out.size()))));
    return out;
  }

  fs::path dir_;
};

TEST_F(SourceFiles, SpecialFilesAreRefusedByNameWithoutBlocking) {
  const std::string fifo = (dir_ / "__0_0.distcp").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  auto start = std::chrono::steady_clock::now();
  auto f = FileSource::Open(fifo);  // O_RDONLY without O_NONBLOCK would wait for a writer
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.error().message().find(fifo), std::string::npos);
  EXPECT_NE(f.error().message().find("FIFO"), std::string::npos) << f.error().message();

  const std::string target = Write("secret", "outside");
  const std::string link = (dir_ / "__1_0.distcp").string();
  fs::create_symlink(target, link);
  auto l = FileSource::Open(link);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.error().message().find("symbolic link"), std::string::npos) << l.error().message();

  auto d = FileSource::Open(dir_.string());
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.error().message().find("directory"), std::string::npos) << d.error().message();
}

TEST_F(SourceFiles, AFileEditedInPlaceIsNeverServed) {
  const std::string path = Write("__0_0.distcp", "0123456789");
  const FileIdentity indexed = Indexed(path);
  LazyFileSource src(path, indexed);
  ASSERT_EQ(*Read(src), "0123456789");

  // Same size, mtime put back: only ctime tells. The open descriptor sees the edit.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  Write("__0_0.distcp", "ABCDEFGHIJ");
  struct timespec times[2] = {{0, UTIME_OMIT},
                              {indexed.mtime_ns / 1000000000, indexed.mtime_ns % 1000000000}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  auto edited = Read(src);
  ASSERT_FALSE(edited.ok());
  EXPECT_EQ(edited.error().code(), StatusCode::kDataLoss);
  EXPECT_NE(edited.error().message().find(path), std::string::npos);
  EXPECT_NE(edited.error().message().find("ctime"), std::string::npos) << edited.error().message();

  // A fresh source (a later open) is refused before any byte is read.
  LazyFileSource later(path, indexed);
  auto refused = Read(later);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("not the file that was indexed"), std::string::npos)
      << refused.error().message();
}

TEST_F(SourceFiles, AReplacedFileIsNeverServed) {
  const std::string path = Write("__0_0.distcp", "0123456789");
  const FileIdentity indexed = Indexed(path);
  const std::string other = Write("new", "ABCDEFGHIJ");
  fs::rename(other, path);  // another inode under the same name
  struct timespec times[2] = {{0, UTIME_OMIT},
                              {indexed.mtime_ns / 1000000000, indexed.mtime_ns % 1000000000}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  LazyFileSource src(path, indexed);
  auto r = Read(src);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.error().message().find("inode"), std::string::npos) << r.error().message();
}

TEST_F(SourceFiles, AnOpenFileReplacedByRenameKeepsServingTheBytesItOpened) {
  // A save into the mount renames new files over the old names; readers of the views of the
  // old files keep reading them (unlinking an inode changes its ctime and nothing else).
  const std::string path = Write("__0_0.distcp", "0123456789");
  LazyFileSource src(path, Indexed(path));
  ASSERT_EQ(*Read(src), "0123456789");
  const int writer = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(writer, 0);
  fs::rename(Write("new", "ABCDEFGHIJ"), path);
  auto kept = Read(src);
  ASSERT_TRUE(kept.ok()) << kept.error().ToString();
  EXPECT_EQ(*kept, "0123456789");

  // An edit of the unlinked file is still refused.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_EQ(::pwrite(writer, "xy", 2, 0), 2);
  ::close(writer);
  auto edited = Read(src);
  ASSERT_FALSE(edited.ok());
  EXPECT_EQ(edited.error().code(), StatusCode::kDataLoss);
  EXPECT_NE(edited.error().message().find("mtime"), std::string::npos) << edited.error().message();
}

TEST_F(SourceFiles, ManyFilesThroughASmallDescriptorCache) {
  constexpr int kFiles = 40;
  auto cache = std::make_shared<FdCache>(3);
  auto counters = std::make_shared<IoCounters>();
  std::vector<std::unique_ptr<LazyFileSource>> files;
  for (int i = 0; i < kFiles; ++i) {
    const std::string path = Write("__" + std::to_string(i) + "_0.distcp", "file " + std::to_string(i));
    files.push_back(std::make_unique<LazyFileSource>(path, Indexed(path), counters, cache));
  }
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < kFiles; ++i) {
      auto r = Read(*files[static_cast<size_t>(i)]);
      ASSERT_TRUE(r.ok()) << r.error().ToString();
      EXPECT_EQ(*r, "file " + std::to_string(i));
      EXPECT_LE(cache->size(), 3u);
    }
  }
  EXPECT_EQ(counters->files_opened.load(), 3u * kFiles);  // round-robin over 40 evicts every time
  EXPECT_EQ(counters->source_read_errors.load(), 0u);
  EXPECT_GE(FdCache::DefaultCapacity(), 16u);
}

}  // namespace
}  // namespace ucpfs
