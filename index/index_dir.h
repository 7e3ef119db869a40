// The index directory, reached safely (see IndexDir), and the build lock in it. Internal to
// index/: the catalog (catalog.cc) and its file (catalog_file.cc) use it; nothing outside does.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <utility>

#include "core/io/beneath.h"
#include "core/status.h"

namespace ucpfs::index {

// 16 lowercase hex digits.
std::string Hex16(uint64_t v);

// "index file PATH is a symbolic link / not a regular file: not followed (...)".
std::string NotFollowed(const std::string& what, const std::string& path, const struct stat& st);

// A file descriptor, closed when it goes.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // The magic link that reopens this very inode, whatever its names now are.
  std::string ProcPath() const { return io::ProcFdPath(fd_); }

 private:
  int fd_ = -1;
};

// The index directory, opened once with O_DIRECTORY|O_NOFOLLOW: a checkpoint may ship its own
// `.ucpfs/` (data.mdb -> /etc/passwd, or `.ucpfs` -> /etc), so neither the directory nor any
// file in it is ever reached through a symlink, and everything in it is reached relative to
// this descriptor, never by path again (nothing can be swapped between a check and a use); a
// file there is opened for I/O only once its pinned inode is known to be a regular file.
// What ucpfs writes there: `data.mdb`, only ever replaced whole by renaming a file ucpfs created
// itself over it, and `lock` (the builders' flock). Nothing there is deleted or written in place.
class IndexDir {
 public:
  // Errors: kNotFound when absent; kInvalidArgument when a symlink or not a directory; kIo.
  static Result<IndexDir> Open(const std::string& path);

  // Open, creating the directory (and its parents) first when it is absent. A symlink in its
  // place, dangling or not, is refused by Open, never created through.
  static Result<IndexDir> OpenOrCreate(const std::string& path);

  const std::string& path() const { return path_; }
  std::string PathOf(const char* name) const { return path_ + "/" + name; }

  // Opens regular file `name` for I/O without following a symlink and without opening anything
  // else: the entry is first pinned with O_PATH|O_NOFOLLOW (which opens no FIFO or device: a
  // device's open can have effects of its own) and checked with fstat, and only then is that very
  // inode opened, through its /proc/self/fd link. With O_CREAT a missing file is created O_EXCL
  // (which also fails on a symlink, dangling or not). Errors: kNotFound; kInvalidArgument (a
  // symlink, or not a regular file); kIo.
  Result<Fd> OpenFile(const char* name, int flags, struct stat* st) const;

  // Absent, or a regular file (checked before `name` is replaced).
  Status CheckReplaceable(const char* name) const;

  // A new, empty file only ucpfs knows: an unnamed O_TMPFILE inode where the filesystem has
  // them, else a fresh name created with O_EXCL (*tmp_name set; the caller removes it on failure).
  Result<Fd> CreateTemp(std::string* tmp_name) const;

  // Makes the file of CreateTemp `name` (replacing it atomically), then syncs the directory.
  Status Publish(const Fd& fd, std::string* tmp_name, const char* name) const;

  // Removes a temporary name ucpfs created (never anything else).
  void RemoveTemp(std::string* tmp_name) const;

 private:
  Result<Fd> StatRegular(Fd fd, const char* name, struct stat* st) const;

  std::string TempName() const;

  std::string path_;
  Fd fd_;
};

// An exclusive flock on index_dir/lock, held while an index is (re)built.
class BuildLock {
 public:
  Status Acquire(const IndexDir& dir);

 private:
  Fd fd_;  // closing the descriptor drops the flock
};

}  // namespace ucpfs::index
