// See write_capture.h. Not for: FUSE, names in the mount's namespace (fs/), or choosing what
// to capture (the Filesystem decides).
#include "core/io/write_capture.h"

#include "core/io/write_capture_internal.h"

namespace ucpfs::io {

void WriteCapture::Impl::Journal(const JournalRecord& r) {
  const std::vector<std::byte> bytes = EncodeJournalRecord(r);
  std::lock_guard lock(journal_mu);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(journal_fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // The journal only speeds recovery up; without the record the file is discarded after a
      // crash instead of finished, never placed wrong.
      Log("ucpfs: capture journal write failed: " + std::string(std::strerror(errno)));
      return;
    }
    done += static_cast<size_t>(n);
  }
}

// The cache (made now from options.cache_options unless given) and the threads, on the first
// file captured: a mount that is only read holds no pinned memory.
Status WriteCapture::Impl::EnsureStarted() {
  std::lock_guard lock(start_mu);
  if (started) return Status::Ok();
  if (cache == nullptr) {
    UCPFS_ASSIGN_OR_RETURN(auto made, PinnedCache::Make(options.cache_options));
    cache = std::shared_ptr<PinnedCache>(std::move(made));
  }
  chunk_bytes = cache->chunk_bytes();
  for (unsigned i = 0; i < std::max(1u, options.n_flushers); ++i) threads.emplace_back([this] { FlusherLoop(); });
  threads.emplace_back([this] { CommitterLoop(); });
  started = true;
  return Status::Ok();
}

void WriteCapture::Impl::Stop() {
  {
    std::lock_guard lock(mu);
    stopping = true;
  }
  work_cv.notify_all();
  lease_cv.notify_all();
  for (auto& t : threads) t.join();
  threads.clear();
  if (lease_thread.joinable()) lease_thread.join();
}

void WriteCapture::Impl::LeaseLoop() {
  std::unique_lock lock(mu);
  while (!lease_cv.wait_for(lock, std::chrono::seconds(kLeaseRenewSeconds), [&] { return stopping; })) {
    lock.unlock();
    if (Status s = mount->RenewLease(); !s.ok()) Log("ucpfs: capture: " + s.ToString());
    lock.lock();
  }
}

void WriteCapture::Impl::NoteKept(const std::vector<RecoveryStep>& kept, const std::string& where) {
  std::lock_guard lock(mu);
  for (const RecoveryStep& step : kept) {
    kept_unplaced.push_back({step.path, "could not be placed by the recovery at this mount's start", where});
  }
}

namespace {

// The largest file SRC's filesystem takes (ext4: 16 TiB less a block), found by truncating a
// sparse probe file: a write past it gets EFBIG at once rather than failing at flush.
uint64_t ProbeMaxFileBytes(int dir_fd) {
  uint64_t lo = 0, hi = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  const int fd = openat(dir_fd, "size-probe", O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return hi;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo + 1) / 2;
    if (ftruncate(fd, static_cast<off_t>(mid)) == 0) {
      lo = mid;
    } else if (errno == EFBIG || errno == EINVAL) {
      hi = mid - 1;
    } else {
      lo = hi;  // another error: no limit known, none enforced
    }
  }
  close(fd);
  unlinkat(dir_fd, "size-probe", 0);
  return lo;
}

}  // namespace

WriteCapture::WriteCapture(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

WriteCapture::~WriteCapture() {
  if (!impl_) return;
  Impl& m = *impl_;
  const Status s = m.SyncQueued();  // what recovery set aside stays where it is, listed there
  if (!s.ok()) {
    m.Log("ucpfs: unmount: not everything captured could be placed: " + s.ToString());
    m.KeepQueued();  // while the flushers run
    for (const UnplacedFile& u : Stats().unplaced) {
      m.Log("ucpfs: unmount: '" + u.path + "' not placed (" + u.reason + "): " +
            (u.kept_in.empty() ? "LOST: its bytes were only in memory" : "kept in " + u.kept_in + " for the next mount"));
    }
  }
  m.Stop();
  if (m.journal_fd >= 0) close(m.journal_fd);
  if (m.mount.has_value()) {
    bool left = false;
    {
      std::lock_guard lock(m.mu);
      left = !m.commit_queue.empty() || !m.pending.empty();
    }
    if (left) {
      m.Log("ucpfs: unmount: what could not be placed stays in " + m.capture_dir + " for the next mount");
    } else if (m.names->Fsync(m.capture_fd) != 0) {
      // The state directory no longer takes a sync (the disk failed, or a test cut the power):
      // nothing more is changed there; the next mount reads what is left.
      m.Log("ucpfs: unmount: " + m.capture_dir + " cannot be synced (" + std::strerror(errno) + "): left as it is");
    } else {
      m.mount->Remove();  // nothing left: the state goes, and with it the lock
    }
    m.mount.reset();
  }
  if (m.capture_root_fd >= 0) close(m.capture_root_fd);
}

Result<std::unique_ptr<WriteCapture>> WriteCapture::Start(WriteCaptureOptions options) {
  if (options.source_dirfd < 0) return InvalidArgumentError("write capture needs the source directory");
  auto impl = std::make_unique<Impl>();
  impl->cache = options.cache;
  if (impl->cache != nullptr) impl->chunk_bytes = impl->cache->chunk_bytes();
  impl->options = std::move(options);
  impl->names = impl->options.names ? impl->options.names : RealNameOps();
  const std::string src = impl->options.source_dir;
  char real[PATH_MAX];
  const ssize_t n = readlink(ProcFdPath(impl->options.source_dirfd).c_str(), real, sizeof(real) - 1);
  if (n <= 0) return IoError("resolve " + src, errno);
  impl->source_real.assign(real, static_cast<size_t>(n));
  UCPFS_ASSIGN_OR_RETURN(const int ucpfs_fd,
                         OpenOrMakeDir(impl->options.source_dirfd, ".ucpfs", src + "/.ucpfs", /*owned=*/false));
  Result<int> capture = OpenOrMakeDir(ucpfs_fd, "capture", src + "/.ucpfs/capture", /*owned=*/true);
  close(ucpfs_fd);
  if (!capture.ok()) return capture.error();
  impl->capture_root_fd = *capture;
  impl->capture_root_dir = src + "/.ucpfs/capture";
  std::unique_ptr<WriteCapture> wc(new WriteCapture(std::move(impl)));
  Impl& m = *wc->impl_;
  // This mount's own state first (its lock held from now on), so a mount starting meanwhile
  // sees it alive; then what dead mounts left.
  UCPFS_ASSIGN_OR_RETURN(MountState state, MountState::Create(m.capture_root_fd, m.capture_root_dir));
  m.mount.emplace(std::move(state));
  m.capture_fd = m.mount->dir_fd();
  m.capture_dir = m.mount->dir_shown();
  m.journal_fd = openat(m.capture_fd, "journal", O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (m.journal_fd < 0) return IoError("create " + m.capture_dir + "/journal", errno);
  if (write(m.journal_fd, kJournalMagic, sizeof(kJournalMagic)) != static_cast<ssize_t>(sizeof(kJournalMagic)) ||
      fsync(m.journal_fd) != 0) {
    return IoError("write " + m.capture_dir + "/journal", errno);
  }
  fsync(m.capture_fd);
  m.max_file_bytes = ProbeMaxFileBytes(m.capture_fd);
  m.lease_thread = std::thread([&m] { m.LeaseLoop(); });
  UCPFS_RETURN_IF_ERROR(m.Recover());
  if (m.cache != nullptr) UCPFS_RETURN_IF_ERROR(m.EnsureStarted());
  return wc;
}

Result<std::shared_ptr<CapturedFile>> WriteCapture::Create(int parent_dirfd, const std::string& name, mode_t mode,
                                                           bool exclusive) {
  Impl& m = *impl_;
  UCPFS_RETURN_IF_ERROR(m.EnsureStarted());
  auto f = std::make_shared<CapturedFile>();
  f->cache = m.cache.get();
  {
    std::lock_guard lock(m.mu);
    f->seq = m.next_seq++;
  }
  f->part_name = PartName(f->seq);
  f->name = name;
  f->mode = mode & 07777;
  f->fd = m.names->CreateAt(m.capture_fd, f->part_name.c_str(), O_RDWR | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (f->fd < 0) return Errno("create " + m.PartPath(*f), errno);
  if (fstat(f->fd, &f->part_stat) != 0) {
    const int err = errno;
    m.names->UnlinkAt(m.capture_fd, f->part_name.c_str(), 0);
    return Errno("set up " + m.PartPath(*f), err);
  }
  f->inode_uid = f->part_stat.st_uid;
  f->inode_gid = f->part_stat.st_gid;
  f->direct_fd = openat(m.capture_fd, f->part_name.c_str(), O_WRONLY | O_DIRECT | O_NOFOLLOW | O_CLOEXEC);
  if (f->direct_fd < 0) f->direct_fd = f->fd;  // a filesystem without O_DIRECT: buffered writes
  f->parent_fd = fcntl(parent_dirfd, F_DUPFD_CLOEXEC, 0);
  if (f->parent_fd < 0) {
    const int err = errno;
    m.names->UnlinkAt(m.capture_fd, f->part_name.c_str(), 0);
    return Errno("dup the directory of " + name, err);
  }
  clock_gettime(CLOCK_REALTIME, &f->mtime);
  f->atime = f->mtime;
  f->exclusive = exclusive;
  f->last_rel = m.RelPath(*f);
  std::lock_guard lock(m.mu);
  m.pending.emplace(f->seq, f);
  return f;
}

struct stat WriteCapture::Stat(const CapturedFile& file) const {
  const CapturedFile& f = file;
  std::lock_guard lock(f.mu);
  struct stat st = f.part_stat;
  st.st_mode = static_cast<mode_t>(S_IFREG | f.mode);
  st.st_size = static_cast<off_t>(f.size);
  st.st_blocks = static_cast<blkcnt_t>((f.size + 511) / 512);
  if (f.uid != static_cast<uid_t>(-1)) st.st_uid = f.uid;
  if (f.gid != static_cast<gid_t>(-1)) st.st_gid = f.gid;
  st.st_atim = f.atime;
  st.st_mtim = f.mtime;
  st.st_ctim = f.mtime;
  st.st_nlink = f.discarded ? 0 : 1;
  return st;
}

Status WriteCapture::Write(CapturedFile& file, uint64_t byte_offset, std::span<const std::byte> data) {
  Impl& m = *impl_;
  const std::shared_ptr<CapturedFile> f = file.shared_from_this();
  const size_t c = m.chunk_bytes;
  size_t done = 0;
  if (byte_offset > m.max_file_bytes || data.size() > m.max_file_bytes - byte_offset) {
    return Status(StatusCode::kInvalidArgument,
                  "a write at byte " + std::to_string(byte_offset) + " passes the source filesystem's file size limit of " +
                      std::to_string(m.max_file_bytes) + " bytes",
                  EFBIG);
  }
  std::unique_lock lock(file.mu);
  if (file.closed) return InvalidArgumentError("write after close");
  file.kept = false;
  while (done < data.size()) {
    const uint64_t at = byte_offset + done;
    const uint64_t index = at / c;
    const auto within = static_cast<size_t>(at % c);
    const size_t n = std::min(c - within, data.size() - done);
    UCPFS_RETURN_IF_ERROR(m.MakeResident(f, lock, index));
    ChunkSlot& slot = file.chunks[index];
    if (within > slot.valid_bytes) std::memset(slot.mem->data + slot.valid_bytes, 0, within - slot.valid_bytes);
    std::memcpy(slot.mem->data + within, data.data() + done, n);
    slot.valid_bytes = std::max<uint64_t>(slot.valid_bytes, within + n);
    slot.filled.Add(within, within + n);
    slot.MarkDirty(within, within + n);
    ++slot.generation;
    if (!slot.dirty) {
      slot.dirty = true;
      m.dirty_chunks.fetch_add(1);
    }
    file.size = std::max<uint64_t>(file.size, at + n);
    if (slot.filled.Covers(c)) m.QueueChunk(f, index, slot);
    done += n;
  }
  clock_gettime(CLOCK_REALTIME, &file.mtime);
  m.bytes_captured.fetch_add(data.size());
  return Status::Ok();
}

Result<size_t> WriteCapture::Read(CapturedFile& f, uint64_t byte_offset, std::span<std::byte> out) {
  Impl& m = *impl_;
  std::lock_guard lock(f.mu);
  if (byte_offset >= f.size) return size_t{0};
  const auto n_total = static_cast<size_t>(std::min<uint64_t>(out.size(), f.size - byte_offset));
  size_t done = 0;
  while (done < n_total) {
    const uint64_t at = byte_offset + done;
    const uint64_t index = at / m.chunk_bytes;
    const auto within = static_cast<size_t>(at % m.chunk_bytes);
    const size_t n = std::min(m.chunk_bytes - within, n_total - done);
    const auto it = f.chunks.find(index);
    if (it != f.chunks.end() && it->second.mem) {
      const ChunkSlot& slot = it->second;
      const size_t valid = within < slot.valid_bytes ? std::min<size_t>(n, static_cast<size_t>(slot.valid_bytes) - within) : 0;
      std::memcpy(out.data() + done, slot.mem->data + within, valid);
      std::memset(out.data() + done + valid, 0, n - valid);
    } else {
      size_t got = 0;
      while (got < n) {
        const ssize_t r = pread(f.fd, out.data() + done + got, n - got, static_cast<off_t>(at + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return Errno("read " + m.PartPath(f), errno);
        if (r == 0) break;
        got += static_cast<size_t>(r);
      }
      std::memset(out.data() + done + got, 0, n - got);  // a hole never written
    }
    done += n;
  }
  return n_total;
}

Status WriteCapture::Truncate(CapturedFile& f, uint64_t n_bytes) {
  Impl& m = *impl_;
  if (n_bytes > m.max_file_bytes) {
    return Status(StatusCode::kInvalidArgument,
                  "a size of " + std::to_string(n_bytes) + " bytes passes the source filesystem's file size limit", EFBIG);
  }
  std::unique_lock lock(f.mu);
  bool cut = false;
  if (n_bytes < f.size) {
    // No write of this file may land after the part is cut: it would bring bytes past the new
    // size back, which a later extension must read as zeros.
    f.cv.wait(lock, [&] {
      return std::none_of(f.chunks.begin(), f.chunks.end(), [](const auto& c) { return c.second.in_flight; });
    });
    for (auto it = f.chunks.begin(); it != f.chunks.end();) {
      const uint64_t start = it->first * m.chunk_bytes;
      ChunkSlot& slot = it->second;
      if (start >= n_bytes) {  // a queued one is skipped by its flusher (no slot any more)
        if (slot.mem) ReleaseChunk(*m.cache, *slot.mem);
        if (slot.dirty) m.dirty_chunks.fetch_sub(1);
        it = f.chunks.erase(it);
        continue;
      }
      if (start < n_bytes && n_bytes < start + m.chunk_bytes && slot.mem) {
        const uint64_t keep = n_bytes - start;
        if (slot.valid_bytes > keep) slot.valid_bytes = keep;
        slot.filled.Clip(keep);
        // Its last page is written again (the part's was cut by the ftruncate below, which
        // zeroes past the end), and with it the chunk's new hash goes into the journal.
        slot.MarkDirty(keep - 1, keep);
        ++slot.generation;
        if (!slot.dirty) {
          slot.dirty = true;
          m.dirty_chunks.fetch_add(1);
        }
      }
      // Not resident: the part's bytes past n_bytes are cut below, and a later write reads back
      // only up to the size.
      ++it;
    }
    if (ftruncate(f.fd, static_cast<off_t>(n_bytes)) != 0) return Errno("truncate " + m.PartPath(f), errno);
    cut = true;
  }
  f.size = n_bytes;
  clock_gettime(CLOCK_REALTIME, &f.mtime);
  if (cut && m.options.on_part_change) {  // under the lock, as a flush's report (Complete)
    PartChange change;
    change.kind = PartChange::Kind::kCut;
    change.byte_offset = n_bytes;
    m.NotifyPartChange(f, change);
  }
  return Status::Ok();
}

Status WriteCapture::Close(CapturedFile& file) {
  Status error;
  {
    std::lock_guard lock(file.mu);
    file.closed = true;
    error = file.error;
    if (file.discarded) return Status::Ok();
  }
  impl_->Enqueue(file.shared_from_this());
  return error;
}

Status WriteCapture::Fsync(CapturedFile& file) {
  {
    std::lock_guard lock(file.mu);
    if (file.discarded) return Status::Ok();
  }
  return impl_->WaitFor(impl_->Enqueue(file.shared_from_this()));
}

Status WriteCapture::Sync() {
  UCPFS_RETURN_IF_ERROR(impl_->SyncQueued());
  return impl_->CheckNothingAside();
}

Status WriteCapture::Impl::SyncQueued() {
  Impl& m = *this;
  uint64_t ticket = 0;
  {
    std::lock_guard lock(m.mu);
    ticket = m.next_ticket - 1;
    if (!m.head_error.ok()) {
      // Tried again by the committer; until it fails again, waiters wait for it.
      m.retry = true;
      m.head_error = Status::Ok();
    }
  }
  m.work_cv.notify_all();
  return m.WaitFor(ticket);
}

bool WriteCapture::Discard(CapturedFile& f) {
  Impl& m = *impl_;
  {
    std::lock_guard lock(f.mu);
    if (f.placed) return false;
    if (f.discarded) return true;
    f.discarded = true;
    for (auto& [index, slot] : f.chunks) {
      if (slot.mem && !slot.in_flight) {
        ReleaseChunk(*m.cache, *slot.mem);
        slot.mem.reset();
      }
      if (slot.dirty) m.dirty_chunks.fetch_sub(1);
      slot.dirty = false;
    }
  }
  // Its space is given back now (a writer may still hold the file open), which may be what a
  // failed commit waits for.
  if (ftruncate(f.fd, 0) != 0) m.Log("ucpfs: capture: cannot free " + m.PartPath(f) + ": " + std::strerror(errno));
  m.names->UnlinkAt(m.capture_fd, f.part_name.c_str(), 0);
  m.Journal({JournalType::kDiscard, f.seq, 0, 0, 0, 0, 0, {}});
  if (m.options.on_part_change) {
    PartChange change;
    change.kind = PartChange::Kind::kDiscarded;
    m.NotifyPartChange(f, change);
  }
  {
    std::lock_guard lock(m.mu);
    m.pending.erase(f.seq);
    if (!m.head_error.ok()) m.retry = true;
  }
  m.work_cv.notify_all();
  return true;
}

Status WriteCapture::Error(const CapturedFile& file) const {
  const CapturedFile& f = file;
  std::lock_guard lock(f.mu);
  return f.error;
}

Status WriteCapture::Moved(CapturedFile& file, int new_parent_dirfd, const std::string& new_name) {
  const int dup_fd = fcntl(new_parent_dirfd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return IoError("dup the directory of " + new_name, errno);
  std::lock_guard lock(file.mu);
  if (!file.placed) {
    close(dup_fd);
    return Status(StatusCode::kInvalidArgument, "'" + file.name + "' is not placed yet");
  }
  if (file.parent_fd >= 0) close(file.parent_fd);
  file.parent_fd = dup_fd;
  file.name = new_name;
  return Status::Ok();
}

bool WriteCapture::Placed(const CapturedFile& file) const {
  const CapturedFile& f = file;
  std::lock_guard lock(f.mu);
  return f.placed;
}

Result<int> WriteCapture::OpenPath(const CapturedFile& file) const {
  const int fd = open(ProcFdPath(file.fd).c_str(), O_PATH | O_CLOEXEC);
  if (fd < 0) return IoError("open " + impl_->PartPath(file), errno);
  return fd;
}

bool WriteCapture::Settled(const CapturedFile& file) const {
  const CapturedFile& f = file;
  std::lock_guard lock(f.mu);
  return f.settled;
}

Status WriteCapture::SetMode(CapturedFile& f, mode_t mode) {
  std::lock_guard lock(f.mu);
  f.mode = mode & 07777;
  if (f.placed && fchmod(f.fd, f.mode) != 0) return Errno("chmod " + f.last_rel, errno);
  return Status::Ok();
}

Status WriteCapture::SetOwner(CapturedFile& f, uid_t uid, gid_t gid) {
  std::lock_guard lock(f.mu);
  if (uid != static_cast<uid_t>(-1)) f.uid = uid;
  if (gid != static_cast<gid_t>(-1)) f.gid = gid;
  if (f.placed) {
    if (fchown(f.fd, f.uid, f.gid) != 0 || fchmod(f.fd, f.mode) != 0) return Errno("chown " + f.last_rel, errno);
    if (f.uid != static_cast<uid_t>(-1)) f.inode_uid = f.uid;
    if (f.gid != static_cast<gid_t>(-1)) f.inode_gid = f.gid;
  }
  return Status::Ok();
}

Status WriteCapture::SetTimes(CapturedFile& f, const struct timespec times[2]) {
  struct timespec now = {};
  clock_gettime(CLOCK_REALTIME, &now);
  std::lock_guard lock(f.mu);
  for (int i = 0; i < 2; ++i) {
    if (times[i].tv_nsec == UTIME_OMIT) continue;
    (i == 0 ? f.atime : f.mtime) = times[i].tv_nsec == UTIME_NOW ? now : times[i];
  }
  const struct timespec set[2] = {f.atime, f.mtime};
  if (f.placed && futimens(f.fd, set) != 0) return Errno("set the times of " + f.last_rel, errno);
  return Status::Ok();
}

CaptureStats WriteCapture::Stats() const {
  const Impl& m = *impl_;
  CaptureStats s;
  s.state_dir = m.capture_dir;
  std::vector<std::shared_ptr<CapturedFile>> held;
  Status head;
  {
    std::lock_guard lock(m.mu);
    s.unplaced = m.kept_unplaced;
    head = m.head_error;
    if (!head.ok()) {
      for (const auto& item : m.commit_queue) held.push_back(item.file);
    }
  }
  for (UnplacedFile& u : m.ListRecovered()) s.unplaced.push_back(std::move(u));
  std::string first;
  for (const auto& f : held) {
    std::lock_guard lock(f->mu);
    if (f->discarded || f->placed) continue;
    UnplacedFile u;
    u.path = f->last_rel;
    u.reason = first.empty() ? head.message() : "waits behind '" + first + "', which could not be placed";
    u.kept_in = f->kept ? m.capture_dir : "";
    if (first.empty()) first = u.path;
    if (s.unplaced.empty() || s.unplaced.back().path != u.path) s.unplaced.push_back(std::move(u));
  }
  std::shared_ptr<PinnedCache> cache;
  {
    std::lock_guard lock(m.start_mu);
    cache = m.cache;
    s.engine = m.engine_name.empty() ? "not started yet" : m.engine_name;
  }
  if (cache == nullptr) {
    s.cache_capacity_bytes = m.options.cache_options.capacity_bytes;
    s.memory_kind = "not allocated yet";
    return s;
  }
  const PinnedCache::Stats cs = cache->stats();
  s.cache_capacity_bytes = cs.capacity_bytes;
  s.cache_used_bytes = cs.used_bytes;
  s.writers_blocked_ns = cs.blocked_ns;
  s.dirty_bytes = m.dirty_chunks.load() * m.chunk_bytes;
  s.bytes_captured = m.bytes_captured.load();
  s.bytes_flushed = m.bytes_flushed.load();
  s.flush_busy_ns = m.flush_busy_ns.load();
  s.files_committed = m.files_committed.load();
  s.flush_errors = m.flush_errors.load();
  s.chunks_coalesced = m.ops_coalesced.load();
  s.memory_kind = PinnedMemoryKindName(cache->kind());
  std::lock_guard lock(m.mu);
  s.files_pending = m.pending.size();
  return s;
}

}  // namespace ucpfs::io
