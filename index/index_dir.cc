// See index_dir.h.
#include "index/index_dir.h"

#include <fcntl.h>
#include <sys/file.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <system_error>
#include <cstdio>
#include <cstring>

namespace ucpfs::index {

std::string Hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string NotFollowed(const std::string& what, const std::string& path, const struct stat& st) {
  return what + " " + path + " is " + (S_ISLNK(st.st_mode) ? "a symbolic link" : "not a regular file") +
         ": not followed (remove it, or give --index-dir)";
}

Result<IndexDir> IndexDir::Open(const std::string& path) {
  IndexDir dir;
  dir.path_ = path;
  dir.fd_ = Fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (dir.fd_.get() >= 0) return dir;
  const int e = errno;
  struct stat st;
  if (e == ENOENT) return Status(StatusCode::kNotFound, "no index at " + path, e);
  if ((e == ELOOP || e == ENOTDIR) && ::lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode)) {
      return InvalidArgumentError("index directory " + path +
                                  " is a symbolic link: not followed (remove it, or give --index-dir)");
    }
    return InvalidArgumentError("index directory " + path + " is not a directory");
  }
  return IoError("opening index directory " + path + ": " + std::strerror(e), e);
}

Result<IndexDir> IndexDir::OpenOrCreate(const std::string& path) {
  Result<IndexDir> dir = Open(path);
  if (dir.ok() || dir.error().code() != StatusCode::kNotFound) return dir;
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return IoError("creating index directory " + path + ": " + ec.message(), ec.value());
  return Open(path);
}

Result<Fd> IndexDir::OpenFile(const char* name, int flags, struct stat* st) const {
  if ((flags & O_CREAT) != 0) {
    Fd created(::openat(fd_.get(), name, flags | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (created.get() >= 0) return StatRegular(std::move(created), name, st);
    if (errno != EEXIST) return IoError("creating " + PathOf(name) + ": " + std::strerror(errno), errno);
    flags &= ~O_CREAT;
  }
  Fd pinned(::openat(fd_.get(), name, O_PATH | O_NOFOLLOW | O_CLOEXEC));
  if (pinned.get() < 0) {
    const int e = errno;
    if (e == ENOENT) return Status(StatusCode::kNotFound, "no " + PathOf(name), e);
    return IoError("opening " + PathOf(name) + ": " + std::strerror(e), e);
  }
  UCPFS_ASSIGN_OR_RETURN(pinned, StatRegular(std::move(pinned), name, st));
  Fd fd(::open(pinned.ProcPath().c_str(), flags | O_CLOEXEC));
  if (fd.get() < 0) return IoError("opening " + PathOf(name) + ": " + std::strerror(errno), errno);
  return StatRegular(std::move(fd), name, st);
}

Status IndexDir::CheckReplaceable(const char* name) const {
  struct stat st;
  if (::fstatat(fd_.get(), name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return IoError("stat " + PathOf(name) + ": " + std::strerror(errno), errno);
  }
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(NotFollowed("index file", PathOf(name), st));
  return Status::Ok();
}

Result<Fd> IndexDir::CreateTemp(std::string* tmp_name) const {
  tmp_name->clear();
  Fd fd(::openat(fd_.get(), ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0644));
  if (fd.get() >= 0) return fd;
  if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL && errno != ENOENT) {
    return IoError("creating a file in " + path_ + ": " + std::strerror(errno), errno);
  }
  *tmp_name = TempName();
  fd = Fd(::openat(fd_.get(), tmp_name->c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    const int e = errno;
    tmp_name->clear();
    return IoError("creating a file in " + path_ + ": " + std::strerror(e), e);
  }
  return fd;
}

Status IndexDir::Publish(const Fd& fd, std::string* tmp_name, const char* name) const {
  UCPFS_RETURN_IF_ERROR(CheckReplaceable(name));
  if (tmp_name->empty()) {
    *tmp_name = TempName();
    if (::linkat(AT_FDCWD, fd.ProcPath().c_str(), fd_.get(), tmp_name->c_str(), AT_SYMLINK_FOLLOW) != 0) {
      const int e = errno;
      tmp_name->clear();
      return IoError("linking the new index into " + path_ + ": " + std::strerror(e), e);
    }
  }
  if (::renameat(fd_.get(), tmp_name->c_str(), fd_.get(), name) != 0) {
    return IoError("renaming the new index to " + PathOf(name) + ": " + std::strerror(errno), errno);
  }
  tmp_name->clear();
  if (::fsync(fd_.get()) != 0 && errno != EINVAL) {
    return IoError("syncing " + path_ + ": " + std::strerror(errno), errno);
  }
  return Status::Ok();
}

void IndexDir::RemoveTemp(std::string* tmp_name) const {
  if (!tmp_name->empty()) ::unlinkat(fd_.get(), tmp_name->c_str(), 0);
  tmp_name->clear();
}

Result<Fd> IndexDir::StatRegular(Fd fd, const char* name, struct stat* st) const {
  if (::fstat(fd.get(), st) != 0) return IoError("stat " + PathOf(name) + ": " + std::strerror(errno), errno);
  if (!S_ISREG(st->st_mode)) return InvalidArgumentError(NotFollowed("index file", PathOf(name), *st));
  return fd;
}

std::string IndexDir::TempName() const {
  static std::atomic<uint64_t> counter{0};
  return "data.mdb.tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1)) + "-" +
         Hex16(static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
}

Status BuildLock::Acquire(const IndexDir& dir) {
  struct stat st;
  UCPFS_ASSIGN_OR_RETURN(fd_, dir.OpenFile("lock", O_RDWR | O_CREAT, &st));
  while (::flock(fd_.get(), LOCK_EX) != 0) {
    if (errno == EINTR) continue;
    return IoError("locking " + dir.PathOf("lock") + ": " + std::strerror(errno), errno);
  }
  return Status::Ok();
}

}  // namespace ucpfs::index
