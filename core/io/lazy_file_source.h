// LazyFileSource: a ByteSource over a source file whose identity (size, mtime, device, inode,
// ctime) was recorded when the checkpoint was indexed, opened on first read. A mount may
// reference any number of shard files: their descriptors live in a bounded FdCache shared by
// the mount, so a checkpoint with more files than the descriptor limit still serves.
//
// Reads fail with kDataLoss naming the file when it is not the indexed version (replaced,
// resized, edited in place: checked when opened and after every read), so changed bytes are
// never served as valid; the source must be re-indexed (a remount does it).
// Thread-safe.
#pragma once

#include <atomic>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/byte_source.h"
#include "core/io/file_source.h"

namespace ucpfs {

// Counters shared by the source files of one mount (reported in .ucpfs/stats.json).
struct IoCounters {
  std::atomic<uint64_t> source_bytes_read{0};
  std::atomic<uint64_t> source_reads{0};
  std::atomic<uint64_t> source_read_errors{0};
  std::atomic<uint64_t> files_opened{0};
};

// At most `capacity` open source files, least recently used closed first. A file in use by a
// read stays open until that read ends (shared ownership), so the bound can be exceeded by the
// number of concurrent reads, never more.
class FdCache {
 public:
  explicit FdCache(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  // The open file at `path`, opened (FileSource::Open) when not cached and checked against
  // `expected`. Errors: FileSource::Open's; kDataLoss naming the file and what differs.
  // `*opened` (when given) tells whether this call opened the file.
  Result<std::shared_ptr<FileSource>> Get(const std::string& path, const FileIdentity& expected,
                                          bool* opened = nullptr);

  size_t capacity() const { return capacity_; }
  size_t size() const;

  // A capacity that fits the process's open-file limit: a quarter of the soft RLIMIT_NOFILE
  // (a cached file may hold two descriptors, its own and FileSource::read_ahead_fd; the other
  // half for FUSE, LMDB and the daemon), at least 16, at most 65536.
  static size_t DefaultCapacity();

 private:
  const size_t capacity_;
  mutable std::mutex mu_;
  std::list<std::string> lru_;  // front: most recent
  struct Entry {
    std::shared_ptr<FileSource> file;
    std::list<std::string>::iterator pos;
  };
  std::unordered_map<std::string, Entry> open_;
};

// Raises the soft RLIMIT_NOFILE to the hard limit (what a daemon that opens many files should
// do at start); returns the soft limit in force afterwards.
uint64_t RaiseOpenFileLimit();

// A source file opened on first read and checked against the identity it was indexed with
// (SourceTree::OpenLazy makes them: LazyFileSource for a local directory).
class LazySource : public ByteSource {
 public:
  // Opens the file now, as a first read would (checked against the indexed identity), so that
  // reads keep reaching it once another file is renamed over its name. Errors: as a read's open.
  virtual Status Open() const = 0;
};

class LazyFileSource final : public LazySource {
 public:
  // `cache` null: the file keeps its own descriptor once opened.
  LazyFileSource(std::string path, FileIdentity expected, std::shared_ptr<IoCounters> counters = nullptr,
                 std::shared_ptr<FdCache> cache = nullptr)
      : path_(std::move(path)), expected_(expected), counters_(std::move(counters)), cache_(std::move(cache)) {}

  uint64_t Size() const override { return expected_.n_bytes; }
  const std::string& Name() const override { return path_; }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;
  // The pieces as one batch (FileSource::ReadPieces): one look-up of the open file and one
  // identity check (fstat) after the whole batch, where ReadAt does both per read. A view read
  // is one batch per source file (ReadBatch), so an edit in place is still caught by the first
  // view read after it, as with ReadAt. Errors: ReadAt's.
  Status ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index = nullptr) const override;
  // The pieces in the open file, which is checked first (fstat) as a batch's read is after it:
  // a file edited in place before the call fails it (kDataLoss), so an edit is caught by the
  // first view read after it. The pieces are counted as read. Errors: ReadPieces' but the read's.
  Result<bool> LocatePieces(std::span<const ReadPiece> pieces, std::span<FileExtent> extents) const override;
  // FileSource::Prefetch on the file (opened first if need be; an open that fails is ignored).
  void Prefetch(uint64_t byte_offset, uint64_t n_bytes) const override;
  // LazySource::Open (through the cache when there is one).
  Status Open() const override { return Get().status(); }

 private:
  Result<std::shared_ptr<FileSource>> Get() const;
  void Count(uint64_t n_reads, uint64_t n_bytes, bool ok) const;

  std::string path_;
  FileIdentity expected_;
  std::shared_ptr<IoCounters> counters_;
  std::shared_ptr<FdCache> cache_;
  mutable std::mutex mu_;
  mutable std::shared_ptr<FileSource> file_;  // without a cache: guarded by mu_ until set
};

}  // namespace ucpfs
