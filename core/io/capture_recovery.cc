// The recovery of WriteCapture (see write_capture.h, write_capture_internal.h): at start, what an
// earlier daemon left in the capture directory is finished in close order or discarded, and the
// journal is started afresh.
#include <dirent.h>

#include "core/io/write_capture_internal.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ucpfs::io {

Status WriteCapture::Impl::Recover() {
  std::vector<uint64_t> parts;
  {
    const int dup_fd = dup(capture_fd);
    if (dup_fd < 0) return IoError("dup " + capture_dir, errno);
    DIR* d = fdopendir(dup_fd);
    if (d == nullptr) {
      close(dup_fd);
      return IoError("list " + capture_dir, errno);
    }
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n.size() < 6 || n.compare(n.size() - 5, 5, ".part") != 0) continue;
      const std::string digits = n.substr(0, n.size() - 5);
      if (digits.empty() || digits.size() > 19 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
      parts.push_back(std::stoull(digits));
    }
    closedir(d);
  }
  std::sort(parts.begin(), parts.end());
  ParsedJournal journal;
  const int jfd = openat(capture_fd, "journal", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (jfd >= 0) {
    struct stat st = {};
    std::vector<std::byte> bytes;
    std::string why;
    if (fstat(jfd, &st) != 0 || !S_ISREG(st.st_mode)) {
      why = "not a regular file";
    } else if (static_cast<uint64_t>(st.st_size) > kMaxJournalBytes) {
      why = "larger than " + std::to_string(kMaxJournalBytes) + " bytes";
    } else {
      bytes.resize(static_cast<size_t>(st.st_size));
      size_t got = 0;
      while (got < bytes.size()) {
        const ssize_t n = read(jfd, bytes.data() + got, bytes.size() - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += static_cast<size_t>(n);
      }
      bytes.resize(got);
    }
    close(jfd);
    if (why.empty() && !bytes.empty()) {
      Result<ParsedJournal> parsed = ParseJournal(bytes);
      if (parsed.ok()) {
        journal = std::move(*parsed);
        if (!journal.stopped.empty()) Log("ucpfs: capture journal: " + journal.stopped + "; the rest is ignored");
      } else {
        why = parsed.error().message();
      }
    }
    if (!why.empty()) Log("ucpfs: capture journal " + capture_dir + "/journal " + why + ": not used");
  } else if (errno != ENOENT) {
    Log("ucpfs: capture journal " + capture_dir + "/journal cannot be opened (" + std::strerror(errno) +
        "): not used");
  }
  std::vector<RecoveryStep> plan = PlanRecovery(journal, parts);
  for (size_t i = 0; i < plan.size(); ++i) {
    RecoveryStep& step = plan[i];
    if (step.finish) {
      const Status s = FinishRecovered(step);
      if (!s.ok()) MarkIncomplete(plan, i, s.message());
    }
    if (!step.finish) {
      unlinkat(capture_fd, PartName(step.seq).c_str(), 0);
      Log("ucpfs: capture recovery: discarded " + (step.path.empty() ? PartName(step.seq) : "'" + step.path + "'") +
          ": " + step.reason);
    }
  }
  // A fresh journal, published by rename so a crash leaves the old or the new one whole.
  const int tmp = openat(capture_fd, "journal.new", O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (tmp < 0) return IoError("create " + capture_dir + "/journal.new", errno);
  const bool ok = write(tmp, kJournalMagic, sizeof(kJournalMagic)) == static_cast<ssize_t>(sizeof(kJournalMagic)) &&
                  fsync(tmp) == 0;
  const int err = errno;
  close(tmp);
  if (!ok) return IoError("write " + capture_dir + "/journal.new", err);
  if (renameat(capture_fd, "journal.new", capture_fd, "journal") != 0) {
    return IoError("rename " + capture_dir + "/journal.new", errno);
  }
  fsync(capture_fd);
  journal_fd = openat(capture_fd, "journal", O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);
  if (journal_fd < 0) return IoError("open " + capture_dir + "/journal", errno);
  return Status::Ok();
}

// Verifies a committed file's part against its chunk records and places it.
Status WriteCapture::Impl::FinishRecovered(const RecoveryStep& step) {
  const std::string part = PartName(step.seq);
  const int fd = openat(capture_fd, part.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return IoError("open " + capture_dir + "/" + part, errno);
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st = {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return InvalidArgumentError("the part is not a regular file");
  if (static_cast<uint64_t>(st.st_size) < step.size) {
    return Status(StatusCode::kDataLoss, "the part holds " + std::to_string(st.st_size) + " of " + std::to_string(step.size) + " bytes");
  }
  std::vector<std::byte> buf;
  for (const JournalRecord& c : step.chunks) {
    if (c.n_bytes > (uint64_t{1} << 30)) return CorruptError("a chunk record of " + std::to_string(c.n_bytes) + " bytes");
    buf.resize(static_cast<size_t>(c.n_bytes));
    size_t got = 0;
    while (got < buf.size()) {
      const ssize_t n = pread(fd, buf.data() + got, buf.size() - got, static_cast<off_t>(c.byte_offset + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    if (got != buf.size() || XXH64(buf.data(), buf.size(), 0) != c.hash) {
      return Status(StatusCode::kDataLoss, "the bytes at " + std::to_string(c.byte_offset) + " are not what was flushed");
    }
  }
  if (ftruncate(fd, static_cast<off_t>(step.size)) != 0 || fchmod(fd, step.mode & 07777) != 0 || fdatasync(fd) != 0) {
    return IoError("finish " + capture_dir + "/" + part, errno);
  }
  const size_t slash = step.path.rfind('/');
  const std::string parent = slash == std::string::npos ? "." : step.path.substr(0, slash);
  const std::string name = slash == std::string::npos ? step.path : step.path.substr(slash + 1);
  const int dir = parent == "." ? dup(options.source_dirfd) : OpenBeneath(options.source_dirfd, parent, O_RDONLY | O_DIRECTORY);
  if (dir < 0) return IoError("open directory '" + parent + "' beneath the source", errno);
  const int rc = renameat(capture_fd, part.c_str(), dir, name.c_str());
  const int err = errno;
  if (rc == 0) fsync(dir);
  close(dir);
  if (rc != 0) return IoError("rename to '" + step.path + "'", err);
  Log("ucpfs: capture recovery: finished '" + step.path + "' (" + std::to_string(step.size) + " bytes)");
  return Status::Ok();
}

}  // namespace ucpfs::io
