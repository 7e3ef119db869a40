// See capture_mount.h. Not for: what a state holds (journal, parts: write_capture*, capture_*).
#include "core/io/capture_mount.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

namespace ucpfs::io {
namespace {

// The running kernel's boot id: equal for every process of this kernel, new after a reboot.
std::string BootId() {
  char buf[64] = {};
  const int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "unknown";
  const ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  std::string s(buf, n > 0 ? static_cast<size_t>(n) : 0);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "unknown" : s;
}

// The host name with only [A-Za-z0-9._-] kept, so it can be part of a file name.
std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "host";
  std::string out;
  for (const char* p = buf; *p != '\0' && out.size() < 64; ++p) {
    const char c = *p;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' || c == '_') {
      out.push_back(c);
    }
  }
  return out.empty() ? "host" : out;
}

// This process's pid namespace ("pid:[4026531836]"): a pid in a lease means this process's
// pid of that number only where the namespaces are equal.
std::string PidNamespace() {
  char buf[64] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "unknown";
}

bool TakeLock(int fd) {
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}

// A small file of the state, read whole (at most 4096 bytes).
std::string ReadSmall(int fd) {
  char buf[4096];
  size_t got = 0;
  while (got < sizeof(buf)) {
    const ssize_t n = pread(fd, buf + got, sizeof(buf) - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  return std::string(buf, got);
}

std::string Field(const std::string& text, const std::string& key) {
  const std::string want = key + " ";
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = text.find('\n', at);
    const std::string line = text.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (line.compare(0, want.size(), want) == 0) return line.substr(want.size());
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return "";
}

double AgeSeconds(const struct timespec& t) {
  struct timespec now = {};
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec - t.tv_sec) + static_cast<double>(now.tv_nsec - t.tv_nsec) / 1e9;
}

}  // namespace

Status CheckOwnedFile(int fd, const std::string& shown) {
  struct stat st = {};
  if (fstat(fd, &st) != 0) return IoError("stat " + shown, errno);
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(shown + " is not a regular file: not used");
  if (st.st_uid != geteuid()) {
    return InvalidArgumentError(shown + " belongs to uid " + std::to_string(st.st_uid) + ", not to the daemon's: not used");
  }
  if (st.st_nlink != 1) return InvalidArgumentError(shown + " has " + std::to_string(st.st_nlink) + " hard links: not used");
  return Status::Ok();
}

Status CheckOwnedDir(int fd, const std::string& shown) {
  struct stat st = {};
  if (fstat(fd, &st) != 0) return IoError("stat " + shown, errno);
  if (!S_ISDIR(st.st_mode)) return InvalidArgumentError(shown + " is not a directory: not used");
  if (st.st_uid != geteuid()) {
    return InvalidArgumentError(shown + " belongs to uid " + std::to_string(st.st_uid) + ", not to the daemon's: not used");
  }
  if ((st.st_mode & 022) != 0) return InvalidArgumentError(shown + " is writable by group or others: not used");
  return Status::Ok();
}

Result<int> OpenOrMakeDir(int dirfd, const char* name, const std::string& shown, bool owned) {
  int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) {
    if (mkdirat(dirfd, name, 0700) != 0 && errno != EEXIST) return IoError("mkdir " + shown, errno);
    fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  }
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      return InvalidArgumentError(shown + " is a symbolic link or not a directory: not followed");
    }
    return IoError("open " + shown, errno);
  }
  if (Status s = owned ? CheckOwnedDir(fd, shown) : Status::Ok(); !s.ok()) {
    close(fd);
    return s;
  }
  return fd;
}

Result<MountState> MountState::Create(int capture_fd, const std::string& capture_dir) {
  MountState m;
  m.capture_fd_ = capture_fd;
  std::random_device rd;
  const std::string host = HostName();
  for (int attempt = 0;; ++attempt) {
    char tail[32];
    std::snprintf(tail, sizeof(tail), "-%d-%08x", static_cast<int>(getpid()), static_cast<unsigned>(rd()));
    m.id_ = host + tail;
    if (mkdirat(capture_fd, m.id_.c_str(), 0700) == 0) break;
    if (errno != EEXIST || attempt >= 8) return IoError("mkdir " + capture_dir + "/" + m.id_, errno);
  }
  m.shown_ = capture_dir + "/" + m.id_;
  m.dir_fd_ = openat(capture_fd, m.id_.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (m.dir_fd_ < 0) return IoError("open " + m.shown_, errno);
  UCPFS_RETURN_IF_ERROR(CheckOwnedDir(m.dir_fd_, m.shown_));
  m.lock_fd_ = openat(m.dir_fd_, "lock", O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (m.lock_fd_ < 0) return IoError("create " + m.shown_ + "/lock", errno);
  if (!TakeLock(m.lock_fd_)) return IoError("lock " + m.shown_ + "/lock", errno);
  m.lease_fd_ = openat(m.dir_fd_, "lease", O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (m.lease_fd_ < 0) return IoError("create " + m.shown_ + "/lease", errno);
  const std::string lease = "host " + host + "\nboot " + BootId() + "\npid " + std::to_string(getpid()) + "\npidns " +
                            PidNamespace() + "\n";
  if (write(m.lease_fd_, lease.data(), lease.size()) != static_cast<ssize_t>(lease.size()) || fsync(m.lease_fd_) != 0) {
    return IoError("write " + m.shown_ + "/lease", errno);
  }
  fsync(capture_fd);
  return m;
}

MountState::MountState(MountState&& o) noexcept
    : id_(std::move(o.id_)), shown_(std::move(o.shown_)), capture_fd_(o.capture_fd_), dir_fd_(o.dir_fd_),
      lock_fd_(o.lock_fd_), lease_fd_(o.lease_fd_) {
  o.dir_fd_ = o.lock_fd_ = o.lease_fd_ = -1;
}

MountState::~MountState() {
  if (lease_fd_ >= 0) close(lease_fd_);
  if (lock_fd_ >= 0) close(lock_fd_);
  if (dir_fd_ >= 0) close(dir_fd_);
}

Status MountState::RenewLease() const {
  if (futimens(lease_fd_, nullptr) != 0) return IoError("renew " + shown_ + "/lease", errno);
  return Status::Ok();
}

void MountState::Remove() {
  if (dir_fd_ < 0) return;
  RemoveFilesIn(dir_fd_);
  unlinkat(capture_fd_, id_.c_str(), AT_REMOVEDIR);
}

ClaimedMount::ClaimedMount(ClaimedMount&& o) noexcept : dir_fd(o.dir_fd), lock_fd(o.lock_fd), shown(std::move(o.shown)) {
  o.dir_fd = o.lock_fd = -1;
}

ClaimedMount::~ClaimedMount() {
  if (lock_fd >= 0) close(lock_fd);
  if (dir_fd >= 0) close(dir_fd);
}

void ClaimedMount::Remove(int capture_fd, const std::string& name) {
  RemoveFilesIn(dir_fd);
  unlinkat(capture_fd, name.c_str(), AT_REMOVEDIR);
}

Result<std::vector<std::pair<std::string, unsigned char>>> ListDir(int dir_fd, const std::string& shown) {
  const int dup_fd = fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return IoError("dup " + shown, errno);
  DIR* d = fdopendir(dup_fd);
  if (d == nullptr) {
    const int err = errno;
    close(dup_fd);
    return IoError("list " + shown, err);
  }
  rewinddir(d);  // the descriptor's offset is shared with every dup of it
  std::vector<std::pair<std::string, unsigned char>> out;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.emplace_back(n, e->d_type);
  }
  closedir(d);
  return out;
}

void RemoveFilesIn(int dir_fd) {
  Result<std::vector<std::pair<std::string, unsigned char>>> names = ListDir(dir_fd, "a capture state");
  if (!names.ok()) return;
  for (const auto& [n, type] : *names) unlinkat(dir_fd, n.c_str(), 0);  // a directory stays (EISDIR)
}

Result<std::optional<ClaimedMount>> ClaimIfDead(int capture_fd, const std::string& name, const std::string& shown,
                                                uint64_t lease_timeout_s, std::string* why) {
  ClaimedMount c;
  c.shown = shown;
  c.dir_fd = openat(capture_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (c.dir_fd < 0) {
    if (errno == ENOENT) {  // removed meanwhile by its own clean unmount
      *why = "gone";
      return std::optional<ClaimedMount>();
    }
    if (errno == ELOOP || errno == ENOTDIR) return InvalidArgumentError(shown + " is a symbolic link or not a directory: not used");
    return IoError("open " + shown, errno);
  }
  UCPFS_RETURN_IF_ERROR(CheckOwnedDir(c.dir_fd, shown));
  c.lock_fd = openat(c.dir_fd, "lock", O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (c.lock_fd < 0) {
    // A state being made right now has no lock yet; one whose lock is gone is told dead by age.
    struct stat st = {};
    if (fstat(c.dir_fd, &st) != 0 || AgeSeconds(st.st_mtim) < static_cast<double>(lease_timeout_s)) {
      *why = "no lock file yet";
      return std::optional<ClaimedMount>();
    }
  } else {
    UCPFS_RETURN_IF_ERROR(CheckOwnedFile(c.lock_fd, shown + "/lock"));
    if (!TakeLock(c.lock_fd)) {
      *why = "its mount is alive (its lock is held)";
      return std::optional<ClaimedMount>();
    }
  }
  // The lock is ours now. Proof enough on this kernel; a mount of another host (or of a boot
  // before this one) must also have let its lease expire.
  const int lease_fd = openat(c.dir_fd, "lease", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  std::string boot;
  struct timespec renewed = {};
  if (lease_fd >= 0) {
    struct stat st = {};
    if (CheckOwnedFile(lease_fd, shown + "/lease").ok() && fstat(lease_fd, &st) == 0) {
      boot = Field(ReadSmall(lease_fd), "boot");
      renewed = st.st_mtim;
    }
    close(lease_fd);
  } else {
    struct stat st = {};
    if (fstat(c.dir_fd, &st) == 0) renewed = st.st_mtim;
  }
  if (boot != BootId() || c.lock_fd < 0) {
    const double age = AgeSeconds(renewed);
    if (age < static_cast<double>(lease_timeout_s)) {
      *why = "its lease (another host or boot) was renewed " + std::to_string(static_cast<int64_t>(age)) +
             " s ago, less than the lease timeout of " + std::to_string(lease_timeout_s) + " s";
      return std::optional<ClaimedMount>();
    }
  }
  return std::optional<ClaimedMount>(std::move(c));
}

bool DaemonExitingHere(int capture_fd, const std::string& name) {
  const int dir_fd = openat(capture_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dir_fd < 0) return false;
  const int lease_fd = openat(dir_fd, "lease", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  close(dir_fd);
  if (lease_fd < 0) return false;
  const std::string lease = CheckOwnedFile(lease_fd, "lease").ok() ? ReadSmall(lease_fd) : "";
  close(lease_fd);
  const std::string pid_text = Field(lease, "pid");
  if (Field(lease, "boot") != BootId() || Field(lease, "pidns") != PidNamespace() || pid_text.empty() ||
      pid_text.size() > 9 || pid_text.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  // /proc/<pid>/status of the thread group leader: "State:\tZ (zombie)", and the pending
  // signals of the thread and of the group, in hex, SIGKILL being bit 8. /proc/<pid>/stat's
  // flags (its 9th field) hold PF_EXITING (0x4) once the leader has begun to exit.
  const std::string proc = "/proc/" + pid_text;
  const int status_fd = open((proc + "/status").c_str(), O_RDONLY | O_CLOEXEC);
  if (status_fd < 0) return errno == ENOENT;  // reaped: whoever still holds the lock is on its way out too
  const std::string status = ReadSmall(status_fd);
  close(status_fd);
  const auto field = [&status](const char* key) {
    const size_t at = status.find(std::string("\n") + key + ":");
    if (at == std::string::npos) return std::string();
    const size_t from = status.find_first_not_of(" \t", at + std::strlen(key) + 2);
    const size_t end = status.find('\n', from);
    return from == std::string::npos ? std::string() : status.substr(from, end == std::string::npos ? end : end - from);
  };
  const std::string state = field("State");
  if (!state.empty() && (state[0] == 'Z' || state[0] == 'X')) return true;
  for (const char* key : {"SigPnd", "ShdPnd"}) {
    const std::string hex = field(key);
    if (!hex.empty() && hex.size() <= 16 && hex.find_first_not_of("0123456789abcdef") == std::string::npos &&
        ((std::stoull(hex, nullptr, 16) >> (SIGKILL - 1)) & 1) != 0) {
      return true;
    }
  }
  const int stat_fd = open((proc + "/stat").c_str(), O_RDONLY | O_CLOEXEC);
  if (stat_fd < 0) return errno == ENOENT;
  const std::string stat = ReadSmall(stat_fd);
  close(stat_fd);
  // After the command's closing parenthesis: state ppid pgrp session tty_nr tpgid flags.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return false;
  unsigned long long flags = 0;
  char st = 0;
  long long skip = 0;
  if (std::sscanf(stat.c_str() + paren + 1, " %c %lld %lld %lld %lld %lld %llu", &st, &skip, &skip, &skip, &skip, &skip,
                  &flags) != 7) {
    return false;
  }
  constexpr unsigned long long kPfExiting = 0x4;
  return (flags & kPfExiting) != 0;
}

}  // namespace ucpfs::io
