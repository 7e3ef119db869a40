// The recovery of WriteCapture (see write_capture.h, write_capture_internal.h): at start, what
// dead mounts left in the capture directory (capture_mount.h says which are dead) is finished in
// close order or discarded; what is whole but cannot be placed yet is kept for the next mount;
// what is whole but was committed after a file that cannot be finished is set aside in
// SRC/.ucpfs/capture/recovered/<state>/<path> (never placed: it would be ahead of that file),
// and listed as unplaced by every mount until someone moves or deletes it.
#include <dirent.h>

#include "core/io/write_capture_internal.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ucpfs::io {

Result<std::vector<RecoveryStep>> WriteCapture::Impl::RecoverState(int dir_fd, const std::string& shown,
                                                                   const std::string& state_name) {
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
  if (jfd < 0 && errno == ENOENT && parts.empty()) return std::vector<RecoveryStep>{};  // nothing left here
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
  std::vector<uint64_t> discard;  // parts unlinked once the journal no longer names them
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
    if (step.recover) {
      bool verified = true;
      const Status s = KeepRecovered(step, dir_fd, shown, state_name, &verified);
      if (s.ok()) continue;
      if (!verified) {
        step.reason = s.message();
      } else {
        // Whole, but it cannot be set aside now: the state stays as it is (nothing of it is
        // discarded), and the next mount tries again.
        std::lock_guard lock(mu);
        kept_unplaced.push_back({step.path, step.reason + "; cannot be kept in " + capture_root_dir + "/recovered (" +
                                                s.message() + ")", shown});
        return IoError("keep '" + step.path + "' aside: " + s.message() + " (left as it is for the next mount)", EIO);
      }
    }
    if (!step.finish) {
      discard.push_back(step.seq);
      Log("ucpfs: capture recovery: discarded " + (step.path.empty() ? PartName(step.seq) : "'" + step.path + "'") +
          ": " + step.reason);
    }
  }
  // What was finished or set aside is durable now (each move was synced): only then does the
  // journal go (or shrink to what is kept), and only then the parts it named, so a crash in
  // between leaves a state the next recovery reads the same way (never a later file placed
  // because an earlier one's part is gone).
  if (kept.empty()) {
    names->UnlinkAt(dir_fd, "journal", 0);
    if (names->Fsync(dir_fd) != 0) return IoError("fsync " + shown, errno);
  } else {
    UCPFS_RETURN_IF_ERROR(WriteKeptJournal(kept, dir_fd, shown));
  }
  for (uint64_t seq : discard) names->UnlinkAt(dir_fd, PartName(seq).c_str(), 0);
  return kept;
}

// A journal of what is kept only, published by rename so a crash leaves the old or the new one
// whole. journal.new is made afresh (a name there may be a hard link to anything).
Status WriteCapture::Impl::WriteKeptJournal(const std::vector<RecoveryStep>& kept, int dir_fd, const std::string& shown) {
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
  names->UnlinkAt(dir_fd, "journal.new", 0);
  const int tmp = names->CreateAt(dir_fd, "journal.new", O_WRONLY | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (tmp < 0) return IoError("create " + shown + "/journal.new", errno);
  const bool ok = write(tmp, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()) && names->Fsync(tmp) == 0;
  const int err = errno;
  close(tmp);
  if (!ok) return IoError("write " + shown + "/journal.new", err);
  if (names->RenameAt(dir_fd, "journal.new", dir_fd, "journal", 0) != 0) return IoError("rename " + shown + "/journal.new", errno);
  if (names->Fsync(dir_fd) != 0) return IoError("fsync " + shown, errno);
  return Status::Ok();
}

Status WriteCapture::Impl::Recover() {
  // State left directly in the capture directory by a daemon from before per-mount states.
  Result<std::vector<RecoveryStep>> legacy = RecoverState(capture_root_fd, capture_root_dir, "earlier");
  if (legacy.ok()) {
    NoteKept(*legacy, capture_root_dir);
  } else {
    Log("ucpfs: capture recovery of " + capture_root_dir + ": " + legacy.error().ToString());
  }
  // Every other mount's state, when that mount is provably dead.
  std::vector<std::string> states;
  UCPFS_ASSIGN_OR_RETURN(const auto entries, ListDir(capture_root_fd, capture_root_dir));
  for (const auto& [n, type] : entries) {
    if (n != mount->id() && n != kRecoveredDir && (type == DT_DIR || type == DT_UNKNOWN)) states.push_back(n);
  }
  std::sort(states.begin(), states.end());
  for (const std::string& name : states) {
    const std::string shown = capture_root_dir + "/" + name;
    std::string why;
    // (Result holds a ClaimedMount, which cannot be assigned: emplaced afresh for each try.)
    std::optional<Result<std::optional<ClaimedMount>>> tried;
    tried.emplace(ClaimIfDead(capture_root_fd, name, shown, options.lease_timeout_s, &why));
    // A daemon killed just before this mount started holds its lock until its last thread has
    // exited: left alone now, its state would wait for the mount after this one (its parts and
    // all). Waited for, bounded, and only when its lease shows it exiting on this kernel.
    if (tried->ok() && !(*tried)->has_value() && DaemonExitingHere(capture_root_fd, name)) {
      Log("ucpfs: capture recovery: " + shown + ": its daemon is exiting; waiting for its lock");
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kDyingLockWaitSeconds);
      while (tried->ok() && !(*tried)->has_value() && why != "gone" && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        tried.emplace(ClaimIfDead(capture_root_fd, name, shown, options.lease_timeout_s, &why));
      }
    }
    Result<std::optional<ClaimedMount>>& claimed = *tried;
    if (!claimed.ok()) {
      Log("ucpfs: capture recovery: " + claimed.error().message());
      continue;
    }
    if (!claimed->has_value()) {  // alive, or not provably dead yet: not ours to touch
      if (why != "gone") Log("ucpfs: capture recovery: " + shown + " left alone: " + why);
      continue;
    }
    ClaimedMount& c = **claimed;
    Result<std::vector<RecoveryStep>> kept = RecoverState(c.dir_fd, shown, name);
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
  PruneRecovered();
  return Status::Ok();
}

// Opens a committed file's part, verifies it against its chunk records, and gives it its size,
// mode, owner and times, durably. Returns the part's descriptor (the caller closes it).
Result<int> WriteCapture::Impl::OpenVerified(const RecoveryStep& step, int dir_fd, const std::string& shown) {
  const std::string part = PartName(step.seq);
  const int fd = openat(dir_fd, part.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return IoError("open " + shown + "/" + part, errno);
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) close(fd);
    }
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
      (step.attrs.known && futimens(fd, times) != 0) || names->Fsync(fd) != 0) {
    return IoError("finish " + shown + "/" + part, errno);
  }
  closer.fd = -1;
  return fd;
}

// Verifies a committed file's part against its chunk records and places it.
Status WriteCapture::Impl::FinishRecovered(const RecoveryStep& step, int dir_fd, const std::string& shown,
                                            bool* placing_failed) {
  const std::string part = PartName(step.seq);
  UCPFS_ASSIGN_OR_RETURN(const int fd, OpenVerified(step, dir_fd, shown));
  struct stat st = {};
  const int stat_rc = fstat(fd, &st);
  const int stat_err = errno;
  close(fd);
  if (options.before_settled) {
    // Recorded first (the bucket uploader's queue), as a commit does: never visible unrecorded.
    Status queued = stat_rc == 0 ? options.before_settled(step.path, st) : Errno("stat " + shown + "/" + part, stat_err);
    if (!queued.ok()) {
      *placing_failed = true;
      return queued;
    }
  }
  const size_t slash = step.path.rfind('/');
  const std::string parent = slash == std::string::npos ? "." : step.path.substr(0, slash);
  const std::string name = slash == std::string::npos ? step.path : step.path.substr(slash + 1);
  const int dir = parent == "." ? dup(options.source_dirfd) : OpenBeneath(options.source_dirfd, parent, O_RDONLY | O_DIRECTORY);
  if (dir < 0) {
    *placing_failed = errno == ENOENT || errno == ENOTDIR || errno == ENOSPC || errno == EDQUOT || errno == EIO;
    return Errno("open directory '" + parent + "' beneath the source", errno);
  }
  const int rc = names->RenameAt(dir_fd, part.c_str(), dir, name.c_str(), 0);
  const int err = errno;
  if (rc == 0 && names->Fsync(dir) != 0) {
    Log("ucpfs: capture recovery: placed '" + step.path + "' but cannot sync its directory: " + std::strerror(errno));
  }
  close(dir);
  if (rc != 0) {
    *placing_failed = true;
    return Errno("rename to '" + step.path + "'", err);
  }
  Log("ucpfs: capture recovery: finished '" + step.path + "' (" + std::to_string(step.size) + " bytes)");
  return Status::Ok();
}

namespace {

// A directory `name` in `dirfd`, made (0700) when missing, never through a symlink; a new one's
// entry is made durable (its parent fsync'd). Errors: kIo naming `shown`.
Result<int> MakeDurableDir(NameOps& names, int dirfd, const std::string& name, const std::string& shown) {
  bool made = false;
  if (names.MkdirAt(dirfd, name.c_str(), 0700) == 0) {
    made = true;
  } else if (errno != EEXIST) {
    return IoError("mkdir " + shown, errno);
  }
  const int fd = openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return IoError("open " + shown + " (a directory, not a symbolic link)", errno);
  if (made && names.Fsync(dirfd) != 0) {
    const int err = errno;
    close(fd);
    return IoError("fsync the directory of " + shown, err);
  }
  return fd;
}

}  // namespace

Status WriteCapture::Impl::KeepRecovered(const RecoveryStep& step, int dir_fd, const std::string& shown,
                                         const std::string& state_name, bool* verified) {
  Result<int> part = OpenVerified(step, dir_fd, shown);
  if (!part.ok()) {
    *verified = false;
    return part.error();
  }
  close(*part);
  // SRC/.ucpfs/capture/recovered/<state>/<path>, every directory made durable as it is made.
  const std::string top = capture_root_dir + "/" + kRecoveredDir;
  UCPFS_ASSIGN_OR_RETURN(int dir, MakeDurableDir(*names, capture_root_fd, kRecoveredDir, top));
  if (Status owned = CheckOwnedDir(dir, top); !owned.ok()) {
    close(dir);
    return owned;
  }
  // Why, once per state: beside its directory, so it never takes a saved file's name.
  // Made afresh: a name there may be a hard link to anything.
  const std::string why_name = state_name + ".why";
  names->UnlinkAt(dir, why_name.c_str(), 0);
  const int why = names->CreateAt(dir, why_name.c_str(), O_WRONLY | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (why >= 0) {
    const std::string text = step.reason + "\n";
    const bool ok = write(why, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && names->Fsync(why) == 0;
    close(why);
    if (!ok || names->Fsync(dir) != 0) Log("ucpfs: capture recovery: cannot write " + top + "/" + why_name);
  }
  std::string where = top;
  std::string rest = state_name + "/" + step.path;  // CheckPlacePath held: no "", "." or ".."
  for (size_t slash = rest.find('/'); slash != std::string::npos; slash = rest.find('/')) {
    const std::string component = rest.substr(0, slash);
    rest = rest.substr(slash + 1);
    where += "/" + component;
    Result<int> next = MakeDurableDir(*names, dir, component, where);
    close(dir);
    if (!next.ok()) return next.error();
    dir = *next;
  }
  const std::string name = PartName(step.seq);
  const int rc = names->RenameAt(dir_fd, name.c_str(), dir, rest.c_str(), 0);
  const int err = errno;
  const int synced = rc == 0 ? names->Fsync(dir) : 0;
  const int sync_err = errno;
  close(dir);
  if (rc != 0) return Errno("move " + shown + "/" + name + " to " + where + "/" + rest, err);
  if (synced != 0) return Errno("fsync " + where, sync_err);
  Log("ucpfs: capture recovery: kept '" + step.path + "' (" + std::to_string(step.size) + " bytes) in " + where +
      ", not placed: " + step.reason);
  return Status::Ok();
}

namespace {

// Regular files beneath directory `fd` (never through a symlink), as paths relative to it, at
// most `budget` more entries looked at, 64 directories deep.
void ListFilesBeneath(int fd, const std::string& prefix, int depth, size_t* budget, std::vector<std::string>* out) {
  Result<std::vector<std::pair<std::string, unsigned char>>> entries = ListDir(fd, prefix);
  if (!entries.ok()) return;
  std::sort(entries->begin(), entries->end());
  for (const auto& [name, type] : *entries) {
    if (*budget == 0) return;
    --*budget;
    struct stat st = {};
    if (fstatat(fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    const std::string rel = prefix.empty() ? name : prefix + "/" + name;
    if (S_ISREG(st.st_mode)) {
      out->push_back(rel);
    } else if (S_ISDIR(st.st_mode) && depth < 64) {
      const int sub = openat(fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub < 0) continue;
      ListFilesBeneath(sub, rel, depth + 1, budget, out);
      close(sub);
    }
  }
}

// Removes the empty directories beneath `fd` (never through a symlink); true when none other is left.
bool RemoveEmptyDirsIn(int fd, int depth) {
  Result<std::vector<std::pair<std::string, unsigned char>>> entries = ListDir(fd, "recovered");
  if (!entries.ok() || depth >= 64) return false;
  bool empty = true;
  for (const auto& [name, type] : *entries) {
    const int sub = openat(fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (sub < 0) {
      empty = false;
      continue;
    }
    const bool gone = RemoveEmptyDirsIn(sub, depth + 1) && unlinkat(fd, name.c_str(), AT_REMOVEDIR) == 0;
    close(sub);
    empty = empty && gone;
  }
  return empty;
}

}  // namespace

void WriteCapture::Impl::PruneRecovered() {
  const int top = openat(capture_root_fd, kRecoveredDir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (top < 0) return;
  Result<std::vector<std::pair<std::string, unsigned char>>> entries = ListDir(top, kRecoveredDir);
  if (entries.ok()) {
    for (const auto& [state, type] : *entries) {
      const int dir = openat(top, state.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (dir < 0) continue;
      // Everything set aside there was moved or deleted: its directories and its .why go.
      const bool empty = RemoveEmptyDirsIn(dir, 0);
      close(dir);
      if (empty && unlinkat(top, state.c_str(), AT_REMOVEDIR) == 0) unlinkat(top, (state + ".why").c_str(), 0);
    }
  }
  close(top);
  unlinkat(capture_root_fd, kRecoveredDir, AT_REMOVEDIR);  // when empty
}

std::vector<UnplacedFile> WriteCapture::Impl::ListRecovered() const {
  std::vector<UnplacedFile> out;
  const int top = openat(capture_root_fd, kRecoveredDir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (top < 0) return out;
  const std::string shown = capture_root_dir + "/" + kRecoveredDir;
  Result<std::vector<std::pair<std::string, unsigned char>>> entries = ListDir(top, shown);
  size_t budget = 10000;  // the directory is untrusted: bounded
  if (entries.ok()) {
    std::sort(entries->begin(), entries->end());
    for (const auto& [state, type] : *entries) {
      const int dir = openat(top, state.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (dir < 0) continue;
      std::vector<std::string> files;
      ListFilesBeneath(dir, "", 0, &budget, &files);
      close(dir);
      std::string why = "committed after a file that a crash left incomplete";
      const int why_fd = openat(top, (state + ".why").c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
      if (why_fd >= 0) {
        char buf[1024];
        const ssize_t n = read(why_fd, buf, sizeof(buf));
        close(why_fd);
        if (n > 0) why.assign(buf, static_cast<size_t>(n));
        if (const size_t nl = why.find('\n'); nl != std::string::npos) why.resize(nl);
      }
      for (const std::string& f : files) {
        out.push_back({f, "recovered after a crash, not placed (" + why + "): move it into place or delete it",
                       shown + "/" + state});
      }
    }
  }
  close(top);
  return out;
}

Status WriteCapture::Impl::CheckNothingAside() const {
  std::vector<UnplacedFile> aside;
  {
    std::lock_guard lock(mu);
    aside = kept_unplaced;
  }
  for (UnplacedFile& u : ListRecovered()) aside.push_back(std::move(u));
  if (aside.empty()) return Status::Ok();
  std::string list;
  for (size_t i = 0; i < aside.size() && i < 8; ++i) list += (i == 0 ? "'" : ", '") + aside[i].path + "' (in " + aside[i].kept_in + ")";
  if (aside.size() > 8) list += " and " + std::to_string(aside.size() - 8) + " more";
  return Status(StatusCode::kIo, std::to_string(aside.size()) + " file(s) saved before a crash are not placed: " + list,
                EIO);
}

}  // namespace ucpfs::io
