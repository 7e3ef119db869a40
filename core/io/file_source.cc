#include "core/io/file_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/checked.h"
#include "core/io/beneath.h"
#include "core/io/prefetcher.h"

namespace ucpfs {

FileIdentity FileIdentity::Of(const struct stat& st) {
  FileIdentity id;
  id.dev = static_cast<uint64_t>(st.st_dev);
  id.ino = static_cast<uint64_t>(st.st_ino);
  id.n_bytes = static_cast<uint64_t>(st.st_size);
  id.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  id.ctime_ns = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  return id;
}

std::string FileIdentity::Differences(const FileIdentity& now) const {
  std::string out;
  auto add = [&out](const char* what, auto a, auto b) {
    if (a == b) return;
    out += (out.empty() ? "" : ", ") + std::string(what) + " " + std::to_string(a) + " -> " + std::to_string(b);
  };
  add("size", n_bytes, now.n_bytes);
  add("mtime_ns", mtime_ns, now.mtime_ns);
  // The device number is not compared: it differs between machines that mount one shared
  // filesystem and share its index (--read-only-index); inode numbers and ctime do not.
  if (ino != 0) add("inode", ino, now.ino);
  if (ctime_ns != 0) add("ctime_ns", ctime_ns, now.ctime_ns);
  return out;
}

Result<std::shared_ptr<FileSource>> FileSource::Open(const std::string& path, io::IoEngineFactory make_engine) {
  // O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; O_NOFOLLOW: a
  // checkpoint's file that is a symlink is refused, never followed out of the checkpoint.
  // Nothing is read before fstat shows a regular file.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT) return Status(StatusCode::kNotFound, path + ": no such file", e);
    if (e == ELOOP) return InvalidArgumentError(path + ": is a symbolic link (not followed)");
    return IoError(path + ": open: " + std::strerror(e), e);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return IoError(path + ": fstat: " + std::strerror(e), e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* what = S_ISFIFO(st.st_mode)  ? "a FIFO"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISDIR(st.st_mode)  ? "a directory"
                                              : "not a regular file";
    return InvalidArgumentError(path + ": is " + std::string(what) + ", not a regular file (never read)");
  }
  // O_NONBLOCK was for the open alone: left on, io_uring may answer a read of pages not yet
  // cached with EAGAIN (a nowait read), which the engine would retry in a busy loop.
  if (const int fl = ::fcntl(fd, F_GETFL); fl >= 0 && (fl & O_NONBLOCK) != 0) (void)::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return std::shared_ptr<FileSource>(new FileSource(path, fd, FileIdentity::Of(st), std::move(make_engine)));
}

Status FileSource::CheckUnchanged() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    int e = errno;
    return IoError(path_ + ": fstat: " + std::strerror(e), e);
  }
  FileIdentity now = FileIdentity::Of(st);
  // Unlinking an inode (a save renaming a new file over its name) changes its ctime and nothing
  // else: the bytes this descriptor reads are still the ones opened. Size and mtime still tell
  // an edit made before or after the unlink.
  if (st.st_nlink == 0) now.ctime_ns = identity_.ctime_ns;
  const std::string diff = identity_.Differences(now);
  if (!diff.empty()) {
    return Status(StatusCode::kDataLoss, path_ + ": changed while open (" + diff + "); remount to re-index it");
  }
  return Status::Ok();
}

FileSource::~FileSource() {
  if (read_ahead_fd_ >= 0 && read_ahead_fd_ != fd_) ::close(read_ahead_fd_);
  ::close(fd_);
}

int FileSource::read_ahead_fd() const {
  std::call_once(read_ahead_once_, [this] {
    // The same open file, so a regular file (Open checked): no O_NONBLOCK needed here.
    const int fd = ::open(io::ProcFdPath(fd_).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      read_ahead_fd_ = fd_;
      return;
    }
    // Twice the device's read-ahead window for this descriptor's sequential reads.
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    read_ahead_fd_ = fd;
  });
  return read_ahead_fd_;
}

void FileSource::Prefetch(uint64_t byte_offset, uint64_t n_bytes) const {
  if (byte_offset >= n_bytes_ || n_bytes == 0) return;
  const uint64_t n = std::min(n_bytes, n_bytes_ - byte_offset);
  // The readers read the range through the kernel's ordinary read-ahead (large requests). A
  // WILLNEED as well, made first, had the kernel read the same pages in 1 MiB requests (its
  // reads fill single pages, not the large folios of the ordinary read-ahead): with both, a
  // cold 1.88 GB load through the mount sent ~1,800 requests of 1 MiB queued ~15 deep, not
  // ~950 of 2 MiB, and took 6-8 % longer. WILLNEED alone is bounded by the device's read-ahead
  // and ignored by some file systems (network and FUSE ones), so it is what is left when the
  // readers are busy.
  if (LegacyReadPath() || !io::Prefetcher::Global().Enqueue(shared_from_this(), byte_offset, n)) {
    (void)::posix_fadvise(fd_, static_cast<off_t>(byte_offset), static_cast<off_t>(n), POSIX_FADV_WILLNEED);
  }
}

Status FileSource::ReadAt(uint64_t byte_offset, std::span<std::byte> out) const {
  if (!RangeInside(byte_offset, out.size(), n_bytes_)) {
    return OutOfRangeError(path_ + ": read of " + std::to_string(out.size()) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end (" +
                           std::to_string(n_bytes_) + " bytes)");
  }
  // Engines are single-thread objects and many FUSE threads read one FileSource at once: each
  // thread reads through its own (it holds no descriptor, so it may outlive this file). A
  // factory (tests) makes one per call.
  if (!make_engine_ && !LegacyReadPath()) return io::ReadExact(io::ThreadReadEngine(1), fd_, byte_offset, out, path_);
  const std::unique_ptr<io::IoEngine> engine = make_engine_ ? make_engine_() : io::MakePreadEngine();
  if (!engine) return InternalError(path_ + ": the I/O engine factory made no engine");
  return io::ReadExact(*engine, fd_, byte_offset, out, path_);
}

Result<bool> FileSource::LocatePieces(std::span<const ReadPiece> pieces, std::span<FileExtent> extents) const {
  if (extents.size() != pieces.size()) return InvalidArgumentError(path_ + ": LocatePieces: one extent per piece");
  std::shared_ptr<const FileSource> self = shared_from_this();
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!RangeInside(pieces[i].byte_offset, pieces[i].out.size(), n_bytes_)) {
      return OutOfRangeError(path_ + ": read of " + std::to_string(pieces[i].out.size()) + " bytes at offset " +
                             std::to_string(pieces[i].byte_offset) + " past end (" + std::to_string(n_bytes_) +
                             " bytes)");
    }
    extents[i] = FileExtent{self, fd_, pieces[i].byte_offset};
  }
  return true;
}

Status FileSource::ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index) const {
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!RangeInside(pieces[i].byte_offset, pieces[i].out.size(), n_bytes_)) {
      if (failed_index != nullptr) *failed_index = i;
      return OutOfRangeError(path_ + ": read of " + std::to_string(pieces[i].out.size()) + " bytes at offset " +
                             std::to_string(pieces[i].byte_offset) + " past end (" + std::to_string(n_bytes_) +
                             " bytes)");
    }
  }
  if (LegacyReadPath()) return ByteSource::ReadPieces(pieces, failed_index);
  if (make_engine_) {
    const std::unique_ptr<io::IoEngine> engine = make_engine_();
    if (!engine) return InternalError(path_ + ": the I/O engine factory made no engine");
    return io::ReadExactPieces(*engine, fd_, pieces, path_, failed_index);
  }
  return io::ReadExactPieces(io::ThreadReadEngine(pieces.size()), fd_, pieces, path_, failed_index);
}

}  // namespace ucpfs
