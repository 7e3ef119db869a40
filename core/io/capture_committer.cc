// The committer of WriteCapture (see write_capture.h, write_capture_internal.h): files placed
// under their final names strictly in close order, each once flushed, truncated, fdatasync'd and
// renamed, with its directory fsync'd.
#include "core/io/write_capture_internal.h"

namespace ucpfs::io {

// Destination of `f` relative to SRC, "" when it is not beneath SRC any more.
std::string WriteCapture::Impl::RelPath(const CapturedFile& f) const {
  char buf[PATH_MAX];
  const ssize_t n = readlink(ProcFdPath(f.parent_fd).c_str(), buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string dir(buf, static_cast<size_t>(n));
  if (dir == source_real) return f.name;
  if (dir.size() > source_real.size() && dir.compare(0, source_real.size(), source_real) == 0 &&
      dir[source_real.size()] == '/') {
    return dir.substr(source_real.size() + 1) + "/" + f.name;
  }
  return "";
}

Result<int> WriteCapture::Impl::OpenPlace(CapturedFile& f, std::string* rel) {
  std::string last;
  {
    std::lock_guard lock(f.mu);
    last = f.last_rel;
  }
  const std::string now = RelPath(f);
  auto gone = [&](const std::string& why) {
    return Status(StatusCode::kIo, "'" + last + "' cannot be placed: its directory " + why, EIO);
  };
  if (now.empty()) return gone("was moved out of the source from outside");
  const size_t slash = now.rfind('/');
  const std::string parent = slash == std::string::npos ? "" : now.substr(0, slash);
  const int dir = parent.empty() ? fcntl(options.source_dirfd, F_DUPFD_CLOEXEC, 0)
                                 : OpenBeneath(options.source_dirfd, parent, O_RDONLY | O_DIRECTORY);
  if (dir < 0) return gone("was removed");
  struct stat want = {}, got = {};
  if (fstat(f.parent_fd, &want) != 0 || fstat(dir, &got) != 0 || want.st_dev != got.st_dev || want.st_ino != got.st_ino) {
    close(dir);
    return gone("was removed or replaced");
  }
  {
    std::lock_guard lock(f.mu);
    f.last_rel = now;
  }
  *rel = now;
  return dir;
}

void WriteCapture::Impl::KeepQueued() {
  std::vector<std::shared_ptr<CapturedFile>> files;
  {
    std::lock_guard lock(mu);
    for (const CommitItem& item : commit_queue) files.push_back(item.file);
  }
  std::vector<std::shared_ptr<CapturedFile>> synced;
  for (const auto& f : files) {
    {
      std::lock_guard lock(f->mu);
      if (f->discarded || f->placed || f->kept) continue;
    }
    if (!FlushAll(f).ok()) continue;  // still in memory only: listed so
    uint64_t size = 0;
    {
      std::lock_guard lock(f->mu);
      size = f->size;
    }
    if (ftruncate(f->fd, static_cast<off_t>(size)) != 0 || names->Fsync(f->fd) != 0) continue;
    synced.push_back(f);
  }
  // The parts' names are durable only once their directory is: until then a power cut may take
  // a part, bytes and all.
  if (synced.empty() || names->Fsync(capture_fd) != 0) return;
  for (const auto& f : synced) {
    std::lock_guard lock(f->mu);
    f->kept = f->closed;  // a file still open may grow: kept only once closed
  }
}

// Waits until `f` has no dirty chunk (queueing them all), or a flush failed.
Status WriteCapture::Impl::FlushAll(const std::shared_ptr<CapturedFile>& f) {
  std::unique_lock lock(f->mu);
  f->flush_ready = false;
  for (;;) {
    if (!f->error.ok()) return f->error;
    bool busy = false;
    for (auto& [index, slot] : f->chunks) {
      if (slot.dirty || slot.in_flight) {
        busy = true;
        if (slot.dirty && !slot.in_flight) QueueChunk(f, index, slot);
      }
    }
    if (!busy) {
      f->flush_ready = true;
      return Status::Ok();
    }
    f->cv.wait_for(lock, std::chrono::milliseconds(100));
  }
}

// A placed and closed file needs no memory relief and is no longer pending.
void WriteCapture::Impl::ForgetIfDone(const std::shared_ptr<CapturedFile>& f) {
  bool done = false;
  {
    std::lock_guard lock(f->mu);
    done = f->placed && f->closed;
  }
  if (!done) return;
  std::lock_guard lock(mu);
  pending.erase(f->seq);
}

Status WriteCapture::Impl::CommitFile(const std::shared_ptr<CapturedFile>& f, IoEngine& engine) {
  bool closed_before = false;
  {
    std::lock_guard lock(f->mu);
    if (f->discarded) return Status::Ok();
    closed_before = f->closed;
  }
  UCPFS_RETURN_IF_ERROR(FlushAll(f));
  uint64_t size = 0;
  bool placed = false;
  {
    std::lock_guard lock(f->mu);
    size = f->size;
    placed = f->placed;
  }
  if (ftruncate(f->fd, static_cast<off_t>(size)) != 0) return Errno("truncate " + PartPath(*f), errno);
  UCPFS_RETURN_IF_ERROR(ApplyAttributes(*f));
  if (placed && options.before_settled) {
    // Visible under its name already (an earlier fsync): recorded before its new bytes are
    // durable, so no crash leaves them durable and unrecorded.
    struct stat st = {};
    if (fstat(f->fd, &st) != 0) return Errno("stat " + PartPath(*f), errno);
    const std::string rel = RelPath(*f);  // where it is now (WriteCapture::Moved follows renames)
    if (rel.empty()) return Status(StatusCode::kIo, "'" + f->name + "' was moved out of the source", EIO);
    UCPFS_RETURN_IF_ERROR(options.before_settled(rel, st));
  }
  IoOp sync;
  sync.kind = OpKind::kFdatasync;
  sync.fd = f->fd;
  std::vector<IoCompletion> synced = engine.RunAll(std::span<const IoOp>(&sync, 1));
  UCPFS_RETURN_IF_ERROR(FirstError(synced));
  if (placed) {
    {
      std::lock_guard lock(f->mu);
      f->settled = closed_before;
    }
    ForgetIfDone(f);
    return Status::Ok();
  }
  std::string rel;
  Result<int> place = OpenPlace(*f, &rel);
  if (!place.ok()) {
    std::lock_guard lock(f->mu);
    if (f->discarded) return Status::Ok();
    return place.error();
  }
  const int dir = *place;
  Status late_attrs;
  if (options.before_replace) options.before_replace(rel);
  if (options.before_settled) {
    struct stat st = {};
    Status queued = fstat(f->fd, &st) == 0 ? options.before_settled(rel, st) : Errno("stat " + PartPath(*f), errno);
    if (!queued.ok()) {
      close(dir);
      return queued;
    }
  }
  {
    // Under the file's lock: an unlink (Discard) either comes first, and the file is never
    // placed, or after, and finds it placed.
    std::lock_guard lock(f->mu);
    if (f->discarded) {
      close(dir);
      return Status::Ok();
    }
    const unsigned flags = f->exclusive ? RENAME_NOREPLACE : 0;
    if (names->RenameAt(capture_fd, f->part_name.c_str(), dir, f->name.c_str(), flags) != 0) {
      const int err = errno;
      close(dir);
      return Errno("rename " + PartPath(*f) + " to " + options.source_dir + "/" + rel +
                       (err == EEXIST ? " (created O_EXCL, and the name was taken from outside meanwhile)" : ""),
                   err);
    }
    f->placed = true;
    // Again: a chmod/chown/utimens may have come since ApplyAttributes (from now on they go to
    // the placed file directly).
    late_attrs = ApplyAttributesLocked(*f, /*only_changed=*/true);
  }
  {
    // Before the file counts as durable (Fsync returns, the journal says done, a later file is
    // placed): a rename is durable only once its directory is.
    const int rc = names->Fsync(dir);
    const int err = errno;
    close(dir);
    if (rc != 0) return Errno("fsync the directory of " + rel, err);
  }
  UCPFS_RETURN_IF_ERROR(late_attrs);
  {
    std::lock_guard lock(f->mu);
    f->settled = closed_before;
  }
  Journal({JournalType::kDone, f->seq, 0, 0, 0, 0, 0, {}});
  files_committed.fetch_add(1);
  ForgetIfDone(f);
  if (options.on_durable) options.on_durable(rel);
  return Status::Ok();
}

void WriteCapture::Impl::CommitterLoop() {
  std::unique_ptr<IoEngine> engine = options.make_engine ? options.make_engine() : MakeDefaultEngine(4);
  // A failed head is tried again by itself, after 1 s, then twice as long each time up to 8 s
  // (space freed, a directory made again): files behind it place without anyone calling sync.
  auto backoff = std::chrono::seconds(1);
  for (;;) {
    CommitItem item;
    bool is_retry = false;
    bool keep = false;
    {
      std::unique_lock lock(mu);
      auto ready = [&] { return stopping || retry || (!commit_queue.empty() && head_error.ok()); };
      if (!head_error.ok() && !commit_queue.empty()) {
        if (!work_cv.wait_for(lock, backoff, ready)) retry = true;
      } else {
        work_cv.wait(lock, ready);
      }
      if (commit_queue.empty()) {
        retry = false;
        if (stopping) return;
        continue;
      }
      if (!head_error.ok() && !retry) {
        if (!stopping) continue;
        // Unmounting with a file that cannot be placed: what is written of it and of every
        // file behind it is durable in its part (KeepQueued; the next mount places them, in
        // order), and the caller of Sync reports them.
        keep = true;
      } else {
        is_retry = retry;
        retry = false;
        head_error = Status::Ok();
        item = commit_queue.front();
      }
    }
    if (keep) {  // the destructor kept what it could (KeepQueued) before stopping the threads
      {
        std::lock_guard lock(mu);
        commit_queue.clear();
      }
      done_cv.notify_all();
      return;
    }
    if (is_retry) {  // tried anew: the file's earlier flush errors too
      std::lock_guard lock(item.file->mu);
      item.file->error = Status::Ok();
    }
    const Status s = CommitFile(item.file, *engine);
    bool failed = false;
    {
      std::lock_guard lock(mu);
      if (s.ok()) {
        commit_queue.pop_front();
        committed_ticket = item.ticket;
        backoff = std::chrono::seconds(1);
        if (commit_queue.empty() && pending.empty()) {
          // Nothing captured is alive: the journal's records are all spent. Start it afresh,
          // so it stays small over a long mount (a crash now has nothing to recover).
          std::lock_guard journal_lock(journal_mu);
          if (ftruncate(journal_fd, sizeof(kJournalMagic)) != 0) {
            Log("ucpfs: capture journal cannot be truncated: " + std::string(std::strerror(errno)));
          }
        }
      } else {
        if (head_error_ticket != item.ticket || !is_retry) Log("ucpfs: capture: " + s.ToString() + " (tried again until it can be placed)");
        head_error = s;
        head_error_ticket = item.ticket;
        backoff = std::min<std::chrono::seconds>(backoff * 2, std::chrono::seconds(8));
        failed = true;
      }
    }
    done_cv.notify_all();
    if (failed) KeepQueued();
  }
}

// What the caller's own create (and its chown, chmod, utimens since) gave the file: decided in
// fs/passthrough.cc as the caller, applied by the daemon here, after the last byte and before the
// rename, so the name never shows the part's 0600 and root. chown first: it clears S_ISUID and
// S_ISGID, which the mode then sets again where the caller's own file would have them.
Status WriteCapture::Impl::ApplyAttributes(CapturedFile& f) {
  std::lock_guard lock(f.mu);
  return ApplyAttributesLocked(f, /*only_changed=*/false);
}

namespace {
bool SameTime(const struct timespec& a, const struct timespec& b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; }
}  // namespace

// The owner only when the inode has another (a root caller's file is the daemon's already).
// Mode and times always, unless `only_changed` (the re-apply right after the rename, when
// nothing but a chmod, chown or utimens since the first apply can have changed them): a
// truncate or a write of the part since an earlier commit moved its mtime, and may have
// cleared S_ISUID/S_ISGID.
Status WriteCapture::Impl::ApplyAttributesLocked(CapturedFile& f, bool only_changed) {
  const uid_t uid = f.uid != static_cast<uid_t>(-1) ? f.uid : f.inode_uid;
  const gid_t gid = f.gid != static_cast<gid_t>(-1) ? f.gid : f.inode_gid;
  const bool chown_it = uid != f.inode_uid || gid != f.inode_gid;
  if (chown_it) {
    if (fchown(f.fd, f.uid, f.gid) != 0) return Errno("chown " + PartPath(f), errno);
    f.inode_uid = uid;
    f.inode_gid = gid;
  }
  // A chown clears S_ISUID/S_ISGID: the mode goes again after one.
  if (chown_it || !only_changed || f.applied_mode != f.mode) {
    if (fchmod(f.fd, f.mode) != 0) return Errno("set the mode of " + PartPath(f), errno);
  }
  if (!only_changed || !SameTime(f.applied_atime, f.atime) || !SameTime(f.applied_mtime, f.mtime)) {
    const struct timespec times[2] = {f.atime, f.mtime};
    if (futimens(f.fd, times) != 0) return Errno("set the times of " + PartPath(f), errno);
  }
  f.applied_mode = f.mode;
  f.applied_atime = f.atime;
  f.applied_mtime = f.mtime;
  return Status::Ok();
}

// Queues `f` for commit, with its commit record; returns the ticket.
uint64_t WriteCapture::Impl::Enqueue(const std::shared_ptr<CapturedFile>& f) {
  JournalRecord r;
  r.type = JournalType::kCommit;
  {
    std::lock_guard lock(f->mu);
    r.seq = f->seq;
    r.size = f->size;
    r.mode = f->mode;
    r.attrs.known = f->uid != static_cast<uid_t>(-1) || f->gid != static_cast<gid_t>(-1);
    r.attrs.uid = static_cast<uint32_t>(f->uid);
    r.attrs.gid = static_cast<uint32_t>(f->gid);
    r.attrs.atime_ns = static_cast<int64_t>(f->atime.tv_sec) * 1000000000 + f->atime.tv_nsec;
    r.attrs.mtime_ns = static_cast<int64_t>(f->mtime.tv_sec) * 1000000000 + f->mtime.tv_nsec;
  }
  // Where its directory is now (on close(2)'s path: a readlink and an fstat, not OpenPlace's
  // full check, which the commit does before it places the file, as recovery checks every
  // journal path again before use).
  std::string now = RelPath(*f);
  struct stat dir_st = {};
  if (!now.empty() && (fstat(f->parent_fd, &dir_st) != 0 || dir_st.st_nlink == 0)) now.clear();  // removed
  {
    std::lock_guard lock(f->mu);
    if (!now.empty()) f->last_rel = now;
    r.path = f->last_rel;  // where it was last seen beneath SRC, if its directory is gone now
    f->kept = false;
  }
  Journal(r);
  uint64_t ticket = 0;
  {
    std::lock_guard lock(mu);
    ticket = next_ticket++;
    commit_queue.push_back({f, ticket});
  }
  work_cv.notify_all();
  return ticket;
}

Status WriteCapture::Impl::WaitFor(uint64_t ticket) {
  std::unique_lock lock(mu);
  for (;;) {
    if (committed_ticket >= ticket) return Status::Ok();
    if (!head_error.ok() && head_error_ticket <= ticket) return head_error;
    if (commit_queue.empty()) return committed_ticket >= ticket ? Status::Ok() : head_error;
    done_cv.wait(lock);
  }
}

}  // namespace ucpfs::io
