// FileSource: a ByteSource over a file on disk, read with pread(2). The only place in core/
// that touches file descriptors for reading (besides the io_uring executor, later).
#pragma once

#include <memory>
#include <string>

#include "core/byte_source.h"

namespace ucpfs {

class FileSource final : public ByteSource {
 public:
  // Opens `path` read-only without blocking and without following a final symlink, and checks
  // it is a regular file before anything reads it. Errors: kNotFound (ENOENT), kIo (other
  // errno, sys_errno set), kInvalidArgument naming the file when it is a symlink, a FIFO, a
  // socket, a device or a directory.
  static Result<std::shared_ptr<FileSource>> Open(const std::string& path);
  ~FileSource() override;
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

  uint64_t Size() const override { return n_bytes_; }
  const std::string& Name() const override { return path_; }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;

 private:
  FileSource(std::string path, int fd, uint64_t n_bytes)
      : path_(std::move(path)), fd_(fd), n_bytes_(n_bytes) {}
  std::string path_;
  int fd_;
  uint64_t n_bytes_;
};

}  // namespace ucpfs
