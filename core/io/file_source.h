// FileSource: a ByteSource over a file on disk. It owns the descriptor and reads through an
// IoEngine (core/io/io_engine.h): the calling thread's read engine (io::ThreadReadEngine: pread
// for one read, io_uring for a batch of ReadPieces) unless Open is given a factory, e.g. a fault
// engine's in tests. Thread-safe: FUSE threads share one FileSource.
#pragma once

#include <sys/stat.h>

#include <memory>
#include <mutex>
#include <string>

#include "core/byte_source.h"
#include "core/io/io_engine.h"

namespace ucpfs {

// What identifies one version of a file: recorded when a checkpoint is indexed, compared when
// the file is opened to serve it and after every read, so bytes of a file that was replaced or
// edited in place are never served as the indexed ones. dev is recorded but not compared (it
// differs between machines sharing one index on a parallel filesystem); zero ino/ctime mean
// "not recorded", and are not compared.
struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t n_bytes = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;

  // The identity fstat/lstat reports.
  static FileIdentity Of(const struct stat& st);

  // "" when `now` is the same version as *this, else what differs, e.g. "size 10 -> 12".
  std::string Differences(const FileIdentity& now) const;
};

class FileSource final : public ByteSource, public std::enable_shared_from_this<FileSource> {
 public:
  // Opens `path` read-only without blocking and without following a final symlink, and checks
  // it is a regular file before anything reads it. Errors: kNotFound (ENOENT), kIo (other
  // errno, sys_errno set), kInvalidArgument naming the file when it is a symlink, a FIFO, a
  // socket, a device or a directory.
  // `make_engine` makes the engine each ReadAt and ReadPieces reads through (empty: the
  // thread's read engine, io::ThreadReadEngine); it is called once per call, from any thread, so
  // it should make cheap engines (pread, a fault engine over pread), not a ring per read.
  static Result<std::shared_ptr<FileSource>> Open(const std::string& path, io::IoEngineFactory make_engine = {});
  ~FileSource() override;
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

  uint64_t Size() const override { return n_bytes_; }
  const std::string& Name() const override { return path_; }
  // Errors: kOutOfRange past Size(); io::ReadExact's (kIo "<path>: pread at offset N: <strerror>"
  // with sys_errno, kDataLoss "<path>: file shrank: short read at offset N").
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;
  // The pieces as one batch of read ops (io_uring runs them together). Errors: ReadAt's.
  Status ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index = nullptr) const override;
  // Each piece is at its own offset of this file's descriptor (held by the extents). Errors:
  // kOutOfRange past Size().
  Result<bool> LocatePieces(std::span<const ReadPiece> pieces, std::span<FileExtent> extents) const override;
  // The range handed to the process's read-ahead readers (core/io/prefetcher.h), which read
  // what is not in the page cache yet into it; a hint only. Where they cannot take it (their
  // queue is full) or with io::LegacyReadPath, posix_fadvise(POSIX_FADV_WILLNEED) instead.
  void Prefetch(uint64_t byte_offset, uint64_t n_bytes) const override;
  // The descriptor (valid while this object lives).
  int fd() const { return fd_; }
  // A second open of the same file (the open descriptor reopened through /proc/self/fd, so the
  // same inode whatever became of the path since), marked POSIX_FADV_SEQUENTIAL, for the
  // read-ahead readers: it has read-ahead state of its own, which the readers' sequential
  // reads grow to the device's full window, where the readers' reads interleaved with the
  // serving threads' on fd() looked random to the kernel. Opened on first use; fd() when it
  // cannot be (no /proc). Valid while this object lives.
  int read_ahead_fd() const;

  // The file's identity when it was opened.
  const FileIdentity& identity() const { return identity_; }
  // fstat again: kDataLoss naming the file and what changed since it was opened (an edit in
  // place changes mtime and ctime; ctime alone is not compared once the file is unlinked, which
  // changes it), kIo when fstat fails.
  Status CheckUnchanged() const;

 private:
  FileSource(std::string path, int fd, FileIdentity identity, io::IoEngineFactory make_engine)
      : path_(std::move(path)), fd_(fd), n_bytes_(identity.n_bytes), identity_(identity),
        make_engine_(std::move(make_engine)) {}
  std::string path_;
  int fd_;
  mutable std::once_flag read_ahead_once_;
  mutable int read_ahead_fd_ = -1;  // set once under read_ahead_once_; fd_ when not reopened
  uint64_t n_bytes_;
  FileIdentity identity_;
  io::IoEngineFactory make_engine_;  // empty: pread
};

}  // namespace ucpfs
