// FileSource: a ByteSource over a file on disk, read with pread(2). The only place in core/
// that touches file descriptors for reading (besides the io_uring executor, later).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "core/byte_source.h"

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

  // "" when `now` is the same version as *this, else what differs, e.g. "size 10 -> 12".
  std::string Differences(const FileIdentity& now) const;
};

// The pread(2) a FileSource calls: the system's, or a test's that injects faults (short reads,
// EINTR, EIO at chosen offsets) to exercise the read path.
using PreadFn = ssize_t (*)(int fd, void* buf, size_t n_bytes, off_t byte_offset);

class FileSource final : public ByteSource {
 public:
  // Opens `path` read-only without blocking and without following a final symlink, and checks
  // it is a regular file before anything reads it. Errors: kNotFound (ENOENT), kIo (other
  // errno, sys_errno set), kInvalidArgument naming the file when it is a symlink, a FIFO, a
  // socket, a device or a directory.
  static Result<std::shared_ptr<FileSource>> Open(const std::string& path, PreadFn pread_fn = nullptr);
  ~FileSource() override;
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

  uint64_t Size() const override { return n_bytes_; }
  const std::string& Name() const override { return path_; }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;

  // The file's identity when it was opened.
  const FileIdentity& identity() const { return identity_; }
  // fstat again: kDataLoss naming the file and what changed since it was opened (an edit in
  // place changes mtime and ctime), kIo when fstat fails.
  Status CheckUnchanged() const;

 private:
  FileSource(std::string path, int fd, FileIdentity identity, PreadFn pread_fn)
      : path_(std::move(path)), fd_(fd), n_bytes_(identity.n_bytes), identity_(identity), pread_(pread_fn) {}
  std::string path_;
  int fd_;
  uint64_t n_bytes_;
  FileIdentity identity_;
  PreadFn pread_;
};

}  // namespace ucpfs
