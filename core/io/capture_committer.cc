// The committer of WriteCapture (see write_capture.h, write_capture_internal.h): files placed
// under their final names strictly in close order, each once flushed, truncated, fdatasync'd and
// renamed, with its directory fsync'd.
#include "core/io/write_capture_internal.h"

namespace ucpfs::io {

// Destination of `f` relative to SRC, "" when it is not beneath SRC any more.
std::string WriteCapture::Impl::RelPath(const CapturedFile& f) const {
  char link[64];
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", f.parent_fd);
  char buf[PATH_MAX];
  const ssize_t n = readlink(link, buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string dir(buf, static_cast<size_t>(n));
  if (dir == source_real) return f.name;
  if (dir.size() > source_real.size() && dir.compare(0, source_real.size(), source_real) == 0 &&
      dir[source_real.size()] == '/') {
    return dir.substr(source_real.size() + 1) + "/" + f.name;
  }
  return "";
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
  const std::string rel = RelPath(*f);
  if (options.before_replace) options.before_replace(rel);
  if (renameat(capture_fd, f->part_name.c_str(), f->parent_fd, f->name.c_str()) != 0) {
    const int err = errno;
    std::lock_guard lock(f->mu);
    if (f->discarded) return Status::Ok();  // unlinked while being committed: its part is gone
    return Errno("rename " + PartPath(*f) + " to " + options.source_dir + "/" + rel, err);
  }
  const int dir = openat(f->parent_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    const int rc = fsync(dir);
    const int err = errno;
    close(dir);
    if (rc != 0) return Errno("fsync the directory of " + rel, err);
  }
  {
    std::lock_guard lock(f->mu);
    f->placed = true;
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
  for (;;) {
    CommitItem item;
    bool is_retry = false;
    {
      std::unique_lock lock(mu);
      work_cv.wait(lock, [&] { return stopping || retry || (!commit_queue.empty() && head_error.ok()); });
      if (commit_queue.empty()) {
        retry = false;
        if (stopping) return;
        continue;
      }
      if (!head_error.ok() && !retry) {  // stuck on a failed file until Sync retries
        if (!stopping) continue;
        // Unmounting with a file that cannot be made durable: give up, loudly (the caller of
        // Sync logs it); its later files are not placed either, so the order holds.
        commit_queue.clear();
        lock.unlock();
        done_cv.notify_all();
        return;
      }
      is_retry = retry;
      retry = false;
      head_error = Status::Ok();
      item = commit_queue.front();
    }
    if (is_retry) {  // Sync asked again: the file's earlier flush errors are tried anew
      std::lock_guard lock(item.file->mu);
      item.file->error = Status::Ok();
    }
    const Status s = CommitFile(item.file, *engine);
    {
      std::lock_guard lock(mu);
      if (s.ok()) {
        commit_queue.pop_front();
        committed_ticket = item.ticket;
        if (commit_queue.empty() && pending.empty()) {
          // Nothing captured is alive: the journal's records are all spent. Start it afresh,
          // so it stays small over a long mount (a crash now has nothing to recover).
          std::lock_guard journal_lock(journal_mu);
          if (ftruncate(journal_fd, sizeof(kJournalMagic)) != 0) {
            Log("ucpfs: capture journal cannot be truncated: " + std::string(std::strerror(errno)));
          }
        }
      } else {
        head_error = s;
        head_error_ticket = item.ticket;
        if (stopping) {  // give up: unmount reports it; the data stays for the next mount
          commit_queue.clear();
        }
      }
    }
    done_cv.notify_all();
  }
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
  }
  r.path = RelPath(*f);
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
