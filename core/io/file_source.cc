#include "core/io/file_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/checked.h"

namespace ucpfs {

Result<std::shared_ptr<FileSource>> FileSource::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT) return Status(StatusCode::kNotFound, path + ": no such file", e);
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
    return InvalidArgumentError(path + ": not a regular file");
  }
  return std::shared_ptr<FileSource>(new FileSource(path, fd, static_cast<uint64_t>(st.st_size)));
}

FileSource::~FileSource() { ::close(fd_); }

Status FileSource::ReadAt(uint64_t byte_offset, std::span<std::byte> out) const {
  if (!RangeInside(byte_offset, out.size(), n_bytes_)) {
    return OutOfRangeError(path_ + ": read of " + std::to_string(out.size()) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end (" +
                           std::to_string(n_bytes_) + " bytes)");
  }
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::pread(fd_, out.data() + done, out.size() - done,
                        static_cast<off_t>(byte_offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      return IoError(path_ + ": pread at offset " + std::to_string(byte_offset + done) + ": " +
                         std::strerror(e), e);
    }
    if (n == 0) {
      return Status(StatusCode::kDataLoss, path_ + ": file shrank: short read at offset " +
                                               std::to_string(byte_offset + done));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace ucpfs
