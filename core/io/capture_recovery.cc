// The recovery of WriteCapture (see write_capture.h, write_capture_internal.h): at start, what
// dead mounts left in the capture directory (capture_mount.h says which are dead) is finished in
// close order or discarded; what is whole but cannot be placed yet is kept for the next mount.
#include <dirent.h>

#include "core/io/write_capture_internal.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ucpfs::io {

Result<std::vector<RecoveryStep>> WriteCapture::Impl::RecoverState(int dir_fd, const std::string& shown) {
  std::vector<uint64_t> parts;
  UCPFS_ASSIGN_OR_RETURN(const auto entries, ListDir(dir_fd, shown));
  for (const auto& [n, type] : entries) {
    if (n.size() < 6 || n.compare(n.size() - 5, 5, ".part") != 0) continue;
    const std::string digits = n.substr(0, n.size() - 5);
    if (digits.empty() || digits.size() > 19 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    parts.push_back(std::stoull(digits));
  }
  std::sort(parts.begin(), parts.end());
  ParsedJournal journal;
  const int jfd = openat(dir_fd, "journal", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (jfd >= 0) {
    struct stat st = {};
    std::vector<std::byte> bytes;
    std::string why;
    if (Status owned = CheckOwnedFile(jfd, shown + "/journal"); !owned.ok()) {
      why = owned.message();
    } else if (fstat(jfd, &st) != 0) {
      why = std::strerror(errno);
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
    if (!why.empty()) Log("ucpfs: capture journal " + shown + "/journal " + why + ": not used");
  } else if (errno != ENOENT) {
    Log("ucpfs: capture journal " + shown + "/journal cannot be opened (" + std::strerror(errno) +
        "): not used");
  }
  std::vector<RecoveryStep> plan = PlanRecovery(journal, parts);
  std::vector<RecoveryStep> kept;
  for (size_t i = 0; i < plan.size(); ++i) {
    RecoveryStep& step = plan[i];
    if (!kept.empty() && step.finish) {  // behind a file that could not be placed: kept, in order
      kept.push_back(step);
      continue;
    }
    if (step.finish) {
      bool placing_failed = false;
      const Status s = FinishRecovered(step, dir_fd, shown, &placing_failed);
      if (!s.ok() && placing_failed) {
        // Whole and verified, but its place is not there (directory gone, disk full): kept for
        // the next mount, with every file committed after it.
        Log("ucpfs: capture recovery: cannot place '" + step.path + "' yet (" + s.message() + "): kept in " + shown +
            " for the next mount");
        kept.push_back(step);
        continue;
      }
      if (!s.ok()) MarkIncomplete(plan, i, s.message());
    }
    if (!step.finish) {
      unlinkat(dir_fd, PartName(step.seq).c_str(), 0);
      Log("ucpfs: capture recovery: discarded " + (step.path.empty() ? PartName(step.seq) : "'" + step.path + "'") +
          ": " + step.reason);
    }
  }
  if (kept.empty()) {
    unlinkat(dir_fd, "journal", 0);
    return kept;
  }
  // A journal of what is kept only, published by rename so a crash leaves the old or the new one
  // whole. journal.new is made afresh (a name there may be a hard link to anything).
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(kJournalMagic),
                               reinterpret_cast<const std::byte*>(kJournalMagic) + sizeof(kJournalMagic));
  for (const RecoveryStep& step : kept) {
    std::vector<JournalRecord> records = step.chunks;
    records.push_back({JournalType::kCommit, step.seq, 0, 0, 0, step.size, step.mode, step.path, step.attrs});
    for (const JournalRecord& r : records) {
      const std::vector<std::byte> e = EncodeJournalRecord(r);
      bytes.insert(bytes.end(), e.begin(), e.end());
    }
  }
  unlinkat(dir_fd, "journal.new", 0);
  const int tmp = openat(dir_fd, "journal.new", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (tmp < 0) return IoError("create " + shown + "/journal.new", errno);
  const bool ok = write(tmp, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()) && fsync(tmp) == 0;
  const int err = errno;
  close(tmp);
  if (!ok) return IoError("write " + shown + "/journal.new", err);
  if (renameat(dir_fd, "journal.new", dir_fd, "journal") != 0) return IoError("rename " + shown + "/journal.new", errno);
  fsync(dir_fd);
  return kept;
}

Status WriteCapture::Impl::Recover() {
  // State left directly in the capture directory by a daemon from before per-mount states.
  UCPFS_ASSIGN_OR_RETURN(std::vector<RecoveryStep> legacy, RecoverState(capture_root_fd, capture_root_dir));
  NoteKept(legacy, capture_root_dir);
  // Every other mount's state, when that mount is provably dead.
  std::vector<std::string> names;
  UCPFS_ASSIGN_OR_RETURN(const auto entries, ListDir(capture_root_fd, capture_root_dir));
  for (const auto& [n, type] : entries) {
    if (n != mount->id() && (type == DT_DIR || type == DT_UNKNOWN)) names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string shown = capture_root_dir + "/" + name;
    std::string why;
    Result<std::optional<ClaimedMount>> claimed = ClaimIfDead(capture_root_fd, name, shown, options.lease_timeout_s, &why);
    if (!claimed.ok()) {
      Log("ucpfs: capture recovery: " + claimed.error().message());
      continue;
    }
    if (!claimed->has_value()) continue;  // alive, or not provably dead yet: not ours to touch
    ClaimedMount& c = **claimed;
    Result<std::vector<RecoveryStep>> kept = RecoverState(c.dir_fd, shown);
    if (!kept.ok()) {
      Log("ucpfs: capture recovery of " + shown + ": " + kept.error().ToString());
      continue;
    }
    if (kept->empty()) {
      c.Remove(capture_root_fd, name);
    } else {
      NoteKept(*kept, shown);
    }
  }
  return Status::Ok();
}

// Verifies a committed file's part against its chunk records and places it.
Status WriteCapture::Impl::FinishRecovered(const RecoveryStep& step, int dir_fd, const std::string& shown,
                                            bool* placing_failed) {
  const std::string part = PartName(step.seq);
  const int fd = openat(dir_fd, part.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return IoError("open " + shown + "/" + part, errno);
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  // The part may be a hard link to a file outside SRC, planted with a crafted journal: only a
  // regular file of the daemon's own, with one link, is ever truncated, chmod'ed or placed.
  UCPFS_RETURN_IF_ERROR(CheckOwnedFile(fd, shown + "/" + part));
  struct stat st = {};
  if (fstat(fd, &st) != 0) return IoError("stat " + shown + "/" + part, errno);
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
  // The owner and times the journal records (the journal is untrusted: never S_ISUID/S_ISGID).
  if (step.attrs.known && fchown(fd, step.attrs.uid, step.attrs.gid) != 0) {
    return IoError("chown " + shown + "/" + part, errno);
  }
  const auto ts = [](int64_t ns) { return timespec{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)}; };
  const struct timespec times[2] = {ts(step.attrs.atime_ns), ts(step.attrs.mtime_ns)};
  if (ftruncate(fd, static_cast<off_t>(step.size)) != 0 || fchmod(fd, step.mode & 01777) != 0 ||
      (step.attrs.known && futimens(fd, times) != 0) || fdatasync(fd) != 0) {
    return IoError("finish " + shown + "/" + part, errno);
  }
  const size_t slash = step.path.rfind('/');
  const std::string parent = slash == std::string::npos ? "." : step.path.substr(0, slash);
  const std::string name = slash == std::string::npos ? step.path : step.path.substr(slash + 1);
  const int dir = parent == "." ? dup(options.source_dirfd) : OpenBeneath(options.source_dirfd, parent, O_RDONLY | O_DIRECTORY);
  if (dir < 0) {
    *placing_failed = errno == ENOENT || errno == ENOTDIR || errno == ENOSPC || errno == EDQUOT || errno == EIO;
    return Errno("open directory '" + parent + "' beneath the source", errno);
  }
  const int rc = renameat(dir_fd, part.c_str(), dir, name.c_str());
  const int err = errno;
  if (rc == 0) fsync(dir);
  close(dir);
  if (rc != 0) {
    *placing_failed = true;
    return Errno("rename to '" + step.path + "'", err);
  }
  Log("ucpfs: capture recovery: finished '" + step.path + "' (" + std::to_string(step.size) + " bytes)");
  return Status::Ok();
}

}  // namespace ucpfs::io
