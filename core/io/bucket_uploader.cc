// See bucket_uploader.h.
#include "core/io/bucket_uploader.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "core/io/beneath.h"
#include "core/io/capture_journal.h"
#include "core/io/staged_copies.h"
#include "core/io/streamed_uploads.h"
#include "core/io/upload_journal.h"

namespace ucpfs::io {
namespace {

using Clock = std::chrono::steady_clock;

// "/a/b", "./a/b" -> "a/b" (the passthrough's paths of top-level names start with '/').
std::string Clean(std::string rel) {
  while (rel.starts_with("/") || rel.starts_with("./")) rel.erase(0, rel[0] == '/' ? 1 : 2);
  return rel;
}

Status ReadFully(int fd, uint64_t byte_offset, std::span<std::byte> out, const std::string& shown) {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(byte_offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("read " + shown, errno);
    if (n == 0) return Status(StatusCode::kDataLoss, shown + ": shorter than when it was queued", EIO);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

struct BucketUploader::Impl {
  BucketUploaderOptions options;
  int stage_fd = -1;
  int state_fd = -1;
  int journal_fd = -1;
  std::string journal_path;

  struct Item {
    PendingUpload what;
    uint64_t n_bytes = 0;
    // Queued by write capture's commit before the file shows under its name: taken up only once
    // it does (`visible`), or skipped once a later commit's file shows (the committer is serial:
    // this commit ended without placing it, e.g. the file was unlinked while pending).
    bool from_capture = false;
    bool visible = true;
  };
  std::mutex journal_mu;  // taken before mu, never after
  mutable std::mutex mu;
  std::condition_variable cv;       // queue changed, stopping
  std::condition_variable done_cv;  // an item finished, or the head failed
  std::deque<Item> queue;
  uint64_t next_id = 1;
  uint64_t n_enqueued = 0;  // items ever queued (this life)
  uint64_t n_finished = 0;  // items ever finished; items finish in queue order
  bool stopping = false;
  Status head_error;
  Clock::time_point last_progress = Clock::now();
  uint64_t uploaded_files = 0, uploaded_bytes = 0, deleted_objects = 0, skipped = 0, removed_files = 0;
  // Uploaded staged files, kept until removed (Collect) when still the same.
  struct Kept {
    StagedCopyRemover::Version version;  // the version uploaded
    Clock::time_point uploaded_at;
  };
  std::map<std::string, Kept> uploaded;
  std::mutex in_use_mu;  // held while in_use or removed is called
  std::function<std::vector<std::string>(uint64_t)> in_use;
  std::function<void()> on_removed;
  std::unique_ptr<StagedCopyRemover> copies;  // made by Start, before the thread
  Clock::time_point last_collect = Clock::now();
  // The version last queued at each path (this mount's life).
  std::map<std::string, StagedCopyRemover::Version> last_queued;
  std::unique_ptr<StreamedUploads> streams;  // null without stream_parts
  // Streamed uploads of an earlier mount that could not be aborted at Start: kept in the journal
  // (written again whenever it is started afresh) for the next mount to try again.
  std::vector<UploadRecord> unaborted;
  std::thread thread;

  void Log(const std::string& line) const {
    if (options.log) options.log(line);
  }
  std::string Key(const std::string& rel) const { return options.prefix.empty() ? rel : options.prefix + "/" + rel; }
  std::string Url(const std::string& rel) const { return "s3://" + options.bucket + "/" + Key(rel); }

  // Appends a record and makes it durable. Caller holds journal_mu.
  Status Append(const UploadRecord& r) {
    const std::vector<std::byte> bytes = EncodeUploadRecord(r);
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = write(journal_fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Status(StatusCode::kIo, "write " + journal_path + ": " + std::strerror(errno), errno);
      done += static_cast<size_t>(n);
    }
    if (fdatasync(journal_fd) != 0) return IoError("fdatasync " + journal_path, errno);
    return Status::Ok();
  }

  Status Enqueue(PendingUpload p, bool from_capture = false) {
    UCPFS_RETURN_IF_ERROR(CheckPlacePath(p.path));
    std::lock_guard journal_lock(journal_mu);
    {
      std::lock_guard lock(mu);
      // The same version queued again (an fsync, then the close of an unchanged file): once.
      const auto last = last_queued.find(p.path);
      const StagedCopyRemover::Version version{p.ino, p.size, p.mtime_ns};
      if (!p.is_delete && last != last_queued.end() && last->second == version) return Status::Ok();
      if (p.is_delete) {
        last_queued.erase(p.path);
      } else {
        last_queued[p.path] = version;
      }
      p.id = next_id++;
    }
    UploadRecord r;
    r.type = p.is_delete ? UploadRecordType::kDelete : UploadRecordType::kQueued;
    r.id = p.id;
    r.size = p.size;
    r.ino = p.ino;
    r.mtime_ns = p.mtime_ns;
    r.path = p.path;
    if (Status s = Append(r); !s.ok()) {
      std::lock_guard lock(mu);
      last_queued.erase(p.path);  // not queued: a later call must not be taken for a repeat
      return s;
    }
    {
      std::lock_guard lock(mu);
      const uint64_t n = p.size;
      queue.push_back({std::move(p), n, from_capture, !from_capture});
      ++n_enqueued;
    }
    cv.notify_all();
    return Status::Ok();
  }

  Status Abort(const PendingUpload& p) {
    for (const std::string& id : p.begun_upload_ids) {
      const Status s = options.client->AbortMultipartUpload(options.bucket, Key(p.path), id);
      if (!s.ok() && s.code() != StatusCode::kNotFound) return s;
    }
    return Status::Ok();
  }

  // Uploads (or deletes) one item. *skip: the staged file is gone or changed (nothing sent).
  Status Do(Item& item, bool* skip) {
    PendingUpload& p = item.what;
    UCPFS_RETURN_IF_ERROR(Abort(p));
    p.begun_upload_ids.clear();
    const std::string key = Key(p.path);
    if (p.is_delete) {
      const Status s = options.client->DeleteObject(options.bucket, key);
      return s.code() == StatusCode::kNotFound ? Status::Ok() : s;
    }
    const std::string shown = options.stage_dir + "/" + p.path;
    const int fd = OpenBeneath(stage_fd, p.path, O_RDONLY | O_NOFOLLOW);
    if (fd < 0) {
      if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP || errno == EXDEV) {
        Log("ucpfs: upload: " + shown + " is gone since it was queued: not uploaded to " + Url(p.path));
        *skip = true;
        return Status::Ok();
      }
      return IoError("open " + shown, errno);
    }
    struct stat st = {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_ino != p.ino ||
        static_cast<uint64_t>(st.st_size) != p.size || MtimeNs(st) != p.mtime_ns) {
      close(fd);
      Log("ucpfs: upload: " + shown + " changed since it was queued: skipped (a later item uploads its new version)");
      *skip = true;
      return Status::Ok();
    }
    Status s = p.size <= options.part_bytes ? PutWhole(fd, p, shown) : PutMultipart(fd, p, shown);
    close(fd);
    return s;
  }

  // The part size of a multipart upload of n_bytes: part_bytes, or larger (whole MiBs) past
  // 10,000 parts.
  uint64_t PartSize(uint64_t n_bytes) const {
    uint64_t part = options.part_bytes;
    if ((n_bytes + part - 1) / part > 10000) part = ((n_bytes / 10000) | ((1u << 20) - 1)) + 1;
    return part;
  }

  // The file's streamed upload (streamed_uploads.h), taken over by the item and journaled as its
  // own (kBegun) before the stream's end: nullopt when there is none.
  Result<std::optional<StreamedUploads::Taken>> TakeStream(const PendingUpload& p, uint64_t part) {
    if (!streams) return std::optional<StreamedUploads::Taken>();
    std::optional<StreamedUploads::Taken> taken = streams->Take(p.ino, p.path, p.size, part);
    if (!taken) return taken;
    {
      std::lock_guard journal_lock(journal_mu);
      UploadRecord r;
      r.type = UploadRecordType::kBegun;
      r.id = p.id;
      r.upload_id = taken->upload_id;
      UCPFS_RETURN_IF_ERROR(Append(r));  // the stream's record stays open: the next mount aborts it
    }
    streams->Done(taken->stream_id);
    return taken;
  }

  Status PutWhole(int fd, const PendingUpload& p, const std::string& shown) {
    // A stream of a file cut to one part since: not needed.
    if (streams) streams->Abandon(p.ino, "it is uploaded whole, in one PUT");
    std::vector<std::byte> body(p.size);
    UCPFS_RETURN_IF_ERROR(ReadFully(fd, 0, body, shown));
    return options.client->PutObject(options.bucket, Key(p.path), body).status();
  }

  Status PutMultipart(int fd, PendingUpload& p, const std::string& shown) {
    const std::string key = Key(p.path);
    const uint64_t part = PartSize(p.size);  // at most 10,000 parts
    const uint64_t n_parts = (p.size + part - 1) / part;
    std::vector<s3::CompletedPart> parts(n_parts);
    UCPFS_ASSIGN_OR_RETURN(std::optional<StreamedUploads::Taken> taken, TakeStream(p, part));
    std::string upload_id;
    if (taken) {
      // Sent while the file was written and unchanged since: not sent again.
      upload_id = taken->upload_id;
      for (const auto& [number, etag] : taken->parts) parts[static_cast<size_t>(number - 1)] = {number, etag};
    } else {
      UCPFS_ASSIGN_OR_RETURN(upload_id, options.client->CreateMultipartUpload(options.bucket, key));
      std::lock_guard journal_lock(journal_mu);
      UploadRecord r;
      r.type = UploadRecordType::kBegun;
      r.id = p.id;
      r.upload_id = upload_id;
      if (Status s = Append(r); !s.ok()) {
        (void)options.client->AbortMultipartUpload(options.bucket, key, upload_id);
        return s;
      }
    }
    std::atomic<uint64_t> next{0};
    std::mutex err_mu;
    Status first_error;
    uint64_t first_error_part = n_parts;
    auto worker = [&] {
      std::vector<std::byte> buf(part);
      for (;;) {
        const uint64_t i = next.fetch_add(1);
        if (i >= n_parts) return;
        if (parts[i].part_number != 0) continue;  // streamed
        {
          std::lock_guard lock(err_mu);
          if (!first_error.ok()) return;
        }
        const uint64_t offset = i * part;
        const std::span<std::byte> body(buf.data(), static_cast<size_t>(std::min(part, p.size - offset)));
        Status s = ReadFully(fd, offset, body, shown);
        Result<std::string> etag = s.ok() ? options.client->UploadPart(options.bucket, key, upload_id,
                                                                       static_cast<int>(i + 1), body)
                                          : Result<std::string>(s);
        if (!etag.ok()) {
          std::lock_guard lock(err_mu);
          if (i < first_error_part) {
            first_error = etag.error();
            first_error_part = i;
          }
          return;
        }
        parts[i] = {static_cast<int>(i + 1), *etag};
      }
    };
    const unsigned n_threads = static_cast<unsigned>(std::min<uint64_t>(std::max(1u, options.parts_in_flight), n_parts));
    std::vector<std::thread> threads;
    for (unsigned t = 1; t < n_threads; ++t) threads.emplace_back(worker);
    worker();
    for (auto& t : threads) t.join();
    Status s = first_error;
    if (s.ok()) s = options.client->CompleteMultipartUpload(options.bucket, key, upload_id, parts).status();
    if (!s.ok()) (void)options.client->AbortMultipartUpload(options.bucket, key, upload_id);
    return s;
  }

  // Whether the staging path names the item's inode now.
  bool Visible(const PendingUpload& p) const {
    const int fd = OpenBeneath(stage_fd, p.path, O_PATH | O_NOFOLLOW);
    if (fd < 0) return false;
    struct stat st = {};
    const bool same = fstat(fd, &st) == 0 && st.st_ino == p.ino;
    close(fd);
    return same;
  }

  // Waits until the head may be taken up (see Item::visible). *gone: skip it. False: stopping.
  // A head that shows neither itself nor a sign that its commit ended is skipped after 60 s (a
  // commit whose rename keeps failing: when it places the file later, its commit queues it again).
  bool WaitVisible(bool* gone) {
    const auto since = Clock::now();
    for (;;) {
      if (Clock::now() - since > std::chrono::seconds(60)) {
        std::lock_guard lock(mu);
        last_queued.erase(queue.front().what.path);
        *gone = true;
        return true;
      }
      std::vector<Item> snapshot;
      {
        std::unique_lock lock(mu);
        if (stopping) return false;
        if (queue.front().visible) return true;
        snapshot.assign(queue.begin(), queue.end());
      }
      if (Visible(snapshot[0].what)) {
        std::lock_guard lock(mu);
        queue.front().visible = true;
        return true;
      }
      for (size_t i = 1; i < snapshot.size(); ++i) {
        // A later commit's file shows, or the name was renamed away or unlinked since (the
        // passthrough renames and unlinks only files that show).
        const bool renamed_away = snapshot[i].what.is_delete && snapshot[i].what.path == snapshot[0].what.path;
        if (renamed_away || (snapshot[i].from_capture && (snapshot[i].visible || Visible(snapshot[i].what)))) {
          *gone = true;
          return true;
        }
      }
      std::unique_lock lock(mu);
      cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return stopping; });
    }
  }

  void Loop() {
    auto backoff = std::chrono::milliseconds(1000);
    std::string last_logged;
    for (;;) {
      Item item;
      {
        std::unique_lock lock(mu);
        const auto ready = [&] { return stopping || !queue.empty(); };
        if (uploaded.empty() && !copies->HasKeptDirs()) {
          cv.wait(lock, ready);
        } else {
          cv.wait_for(lock, std::chrono::seconds(1), ready);  // copies to remove when due
        }
        if (stopping) return;
      }
      if (Clock::now() - last_collect >= std::chrono::seconds(1)) {
        Collect(/*at_stop=*/false);
        last_collect = Clock::now();
      }
      {
        std::lock_guard lock(mu);
        if (queue.empty()) continue;
      }
      bool skip = false;
      if (!WaitVisible(&skip)) return;
      {
        std::lock_guard lock(mu);
        item = queue.front();
      }
      Status s;
      if (skip) {
        Log("ucpfs: upload: " + options.stage_dir + "/" + item.what.path +
            " does not show under its name (renamed or unlinked since, or never placed): skipped");
      } else {
        s = Do(item, &skip);
      }
      if (!s.ok()) {
        // Once per item and error (a request id differs on every try).
        std::string error = s.ToString();
        if (const size_t at = error.find(" (request "); at != std::string::npos) error.resize(at);
        const std::string line = "ucpfs: upload of " + Url(item.what.path) + " failed: " + error +
                                 " (kept staged; tried again, every later file waits behind it)";
        if (line != last_logged) Log(line);
        last_logged = line;
        {
          std::unique_lock lock(mu);
          head_error = s;
          done_cv.notify_all();
          cv.wait_for(lock, backoff, [&] { return stopping; });
          if (stopping) return;
        }
        backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::milliseconds(30000));
        continue;
      }
      backoff = std::chrono::milliseconds(1000);
      last_logged.clear();
      // Before it counts as finished: whoever waits for it (WaitUploaded) finds it reported.
      if (!skip && options.on_uploaded) options.on_uploaded(item.what.path);
      {
        std::lock_guard journal_lock(journal_mu);
        UploadRecord r;
        r.type = UploadRecordType::kDone;
        r.id = item.what.id;
        if (Status d = Append(r); !d.ok()) Log("ucpfs: upload journal: " + d.ToString());
        std::lock_guard lock(mu);
        queue.pop_front();
        ++n_finished;
        head_error = Status::Ok();
        last_progress = Clock::now();
        if (skip) {
          ++skipped;
        } else if (item.what.is_delete) {
          ++deleted_objects;
          uploaded.erase(item.what.path);
        } else {
          ++uploaded_files;
          uploaded_bytes += item.n_bytes;
          uploaded[item.what.path] = {{item.what.ino, item.what.size, item.what.mtime_ns}, Clock::now()};
        }
        if (queue.empty()) {
          // Every item's record is spent: start the journal afresh so it stays small over a long
          // mount, with the streamed uploads open now written again.
          if (ftruncate(journal_fd, sizeof(kUploadJournalMagic)) != 0 || fdatasync(journal_fd) != 0) {
            Log("ucpfs: upload journal cannot be truncated: " + std::string(std::strerror(errno)));
          }
          std::vector<UploadRecord> keep = unaborted;
          if (streams) {
            for (UploadRecord& open : streams->Open()) keep.push_back(std::move(open));
          }
          for (const UploadRecord& rec : keep) {
            if (Status a = Append(rec); !a.ok()) Log("ucpfs: upload journal: " + a.ToString());
          }
        }
      }
      done_cv.notify_all();
    }
  }

  std::vector<std::string> Waiting(size_t max) const {
    std::vector<std::string> out;
    for (const Item& i : queue) {
      if (out.size() >= max) break;
      out.push_back(Url(i.what.path) + (i.what.is_delete ? " (delete)" : ""));
    }
    return out;
  }

  // Removes the uploaded copies that are due (all of them at Stop): see the file comment.
  void Collect(bool at_stop) {
    std::vector<std::string> busy;
    if (!at_stop) {
      std::lock_guard lock(in_use_mu);
      if (!in_use) return;
      busy = in_use(options.keep_ms);
    }
    std::sort(busy.begin(), busy.end());
    const auto now = Clock::now();
    std::vector<std::pair<std::string, Kept>> due;
    {
      std::lock_guard lock(mu);
      std::vector<std::string> queued;
      for (const Item& i : queue) queued.push_back(i.what.path);
      std::sort(queued.begin(), queued.end());
      for (const auto& [path, kept] : uploaded) {
        if (std::binary_search(queued.begin(), queued.end(), path)) continue;  // a newer version or a delete
        if (!at_stop && (std::binary_search(busy.begin(), busy.end(), path) ||
                         now - kept.uploaded_at < std::chrono::milliseconds(options.keep_ms))) {
          continue;
        }
        due.emplace_back(path, kept);
      }
    }
    size_t n_removed = 0;
    for (const auto& [path, kept] : due) {
      const bool removed = copies->Remove(path, kept.version, at_stop);
      n_removed += removed ? 1 : 0;
      std::lock_guard lock(mu);
      const auto it = uploaded.find(path);
      if (it == uploaded.end() || it->second.uploaded_at != kept.uploaded_at) continue;  // uploaded again meanwhile
      uploaded.erase(it);  // removed, or gone or changed (not ours to remove: a later item's)
      if (removed) {
        ++removed_files;
        // A file at this path later is a new one (and the map stays small over a long mount).
        const auto last = last_queued.find(path);
        if (last != last_queued.end() && last->second == kept.version) {
          last_queued.erase(last);
        }
      }
    }
    copies->RetryKeptDirs(at_stop);  // emptied directories the mount knew, once it no longer does
    if (n_removed > 0 && !at_stop) {
      std::lock_guard lock(in_use_mu);
      if (on_removed) on_removed();
    }
  }
};

Result<std::unique_ptr<BucketUploader>> BucketUploader::Start(BucketUploaderOptions options) {
  if (!options.client || options.bucket.empty() || options.stage_dir.empty() || options.state_dir.empty()) {
    return InvalidArgumentError("BucketUploader: client, bucket, stage_dir and state_dir are needed");
  }
  if (options.part_bytes < (5ull << 20)) return InvalidArgumentError("BucketUploader: parts of at least 5 MiB");
  if (options.keep_ms < 1000) return InvalidArgumentError("BucketUploader: keep staged copies at least 1 s");
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  Impl& m = *impl;
  auto fail = [&](const std::string& what, int err) {
    if (m.journal_fd >= 0) close(m.journal_fd);
    if (m.state_fd >= 0) close(m.state_fd);
    if (m.stage_fd >= 0) close(m.stage_fd);
    return Status(StatusCode::kIo, what + ": " + std::strerror(err), err);
  };
  m.stage_fd = open(m.options.stage_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (m.stage_fd < 0) return fail("open the staging directory " + m.options.stage_dir, errno);
  if (mkdir(m.options.state_dir.c_str(), 0700) != 0 && errno != EEXIST) return fail("mkdir " + m.options.state_dir, errno);
  m.state_fd = open(m.options.state_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (m.state_fd < 0) return fail("open " + m.options.state_dir + " (a directory, not a symbolic link)", errno);
  struct stat dst = {};
  if (fstat(m.state_fd, &dst) != 0 || dst.st_uid != geteuid()) {
    return fail(m.options.state_dir + " is not owned by this user", EPERM);
  }
  m.copies = std::make_unique<StagedCopyRemover>(m.stage_fd, m.state_fd, m.options.stage_dir, m.options.state_dir,
                                                 m.options.log);
  m.journal_path = m.options.state_dir + "/journal";
  // O_APPEND: every record lands at the end, also after the journal is truncated.
  m.journal_fd = openat(m.state_fd, "journal", O_RDWR | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (m.journal_fd < 0) return fail("open " + m.journal_path, errno);
  if (flock(m.journal_fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      (void)fail("", err);  // closes what is open
      return Status(StatusCode::kIo,
                    m.journal_path + " is locked: another live mount uses the staging directory " + m.options.stage_dir,
                    EBUSY);
    }
    return fail("lock " + m.journal_path, err);
  }
  struct stat jst = {};
  if (fstat(m.journal_fd, &jst) != 0 || !S_ISREG(jst.st_mode)) return fail("stat " + m.journal_path, errno);
  // Read it back (bounded: a larger one is damaged, and refused as such).
  std::vector<std::byte> bytes(static_cast<size_t>(std::min<uint64_t>(jst.st_size, kMaxUploadJournalBytes + 1)));
  if (!bytes.empty()) {
    if (Status r = ReadFully(m.journal_fd, 0, bytes, m.journal_path); !r.ok()) return fail("read " + m.journal_path, EIO);
  }
  std::vector<PendingUpload> pending;
  std::vector<UploadPlan::Streaming> streaming;
  if (!bytes.empty()) {
    Result<ParsedUploadJournal> parsed = ParseUploadJournal(bytes);
    if (!parsed.ok()) {
      m.Log("ucpfs: upload journal " + m.journal_path + ": " + parsed.error().message() + ": ignored");
    } else {
      if (!parsed->stopped.empty()) m.Log("ucpfs: upload journal " + m.journal_path + ": " + parsed->stopped);
      UploadPlan plan = PlanUploads(*parsed);
      for (const std::string& d : plan.dropped) m.Log("ucpfs: upload journal " + m.journal_path + ": " + d);
      pending = std::move(plan.pending);
      streaming = std::move(plan.streaming);
      m.next_id = plan.max_id + 1;
    }
  }
  // Afresh: the items not done are written again (same order, new ids) after the magic.
  if (ftruncate(m.journal_fd, 0) != 0) return fail("truncate " + m.journal_path, errno);
  if (write(m.journal_fd, kUploadJournalMagic, sizeof(kUploadJournalMagic)) != sizeof(kUploadJournalMagic)) {
    return fail("write " + m.journal_path, errno);
  }
  if (fdatasync(m.journal_fd) != 0 || fsync(m.state_fd) != 0) return fail("fsync " + m.journal_path, errno);
  for (const UploadPlan::Streaming& open : streaming) {
    // A file a killed daemon was streaming: its upload is aborted (its item, if it was queued,
    // uploads it again whole), or kept in the journal for the next mount when that fails.
    const Status a = m.options.client->AbortMultipartUpload(m.options.bucket, m.Key(open.path), open.upload_id);
    if (a.ok() || a.code() == StatusCode::kNotFound) continue;
    m.Log("ucpfs: upload: cannot abort " + m.Url(open.path) + "'s streamed upload begun by an earlier mount: " +
          a.ToString() + " (tried again at the next mount)");
    UploadRecord r;
    r.type = UploadRecordType::kStreaming;
    r.id = open.id;
    r.path = open.path;
    r.upload_id = open.upload_id;
    if (Status s = m.Append(r); !s.ok()) return fail(s.message(), s.sys_errno() != 0 ? s.sys_errno() : EIO);
    m.unaborted.push_back(std::move(r));
  }
  for (PendingUpload& p : pending) {
    // A multipart upload a killed daemon began: aborted before the item is done again (kept in
    // the item, so a failed abort is retried with it).
    if (!p.begun_upload_ids.empty()) {
      if (Status s = m.Abort(p); s.ok()) p.begun_upload_ids.clear();
    }
    const std::vector<std::string> begun = p.begun_upload_ids;
    m.Log("ucpfs: upload: " + std::string(p.is_delete ? "delete of " : "") + m.Url(p.path) +
          " was queued by an earlier mount and not done: queued again");
    if (Status s = m.Enqueue(p); !s.ok()) return fail(s.message(), s.sys_errno() != 0 ? s.sys_errno() : EIO);
    std::lock_guard lock(m.mu);
    m.queue.back().what.begun_upload_ids = begun;
  }
  if (m.options.stream_parts) {
    StreamedUploadsOptions so;
    so.client = m.options.client;
    so.bucket = m.options.bucket;
    so.key = [&m](const std::string& rel) { return m.Key(rel); };
    so.part_bytes = m.options.part_bytes;
    so.threads = m.options.parts_in_flight;
    so.new_id = [&m] {
      std::lock_guard lock(m.mu);
      return m.next_id++;
    };
    so.append = [&m](const UploadRecord& r) {
      std::lock_guard journal_lock(m.journal_mu);
      return m.Append(r);
    };
    so.log = m.options.log;
    m.streams = std::make_unique<StreamedUploads>(std::move(so));
  }
  m.thread = std::thread([&m] { m.Loop(); });
  return std::unique_ptr<BucketUploader>(new BucketUploader(std::move(impl)));
}

BucketUploader::BucketUploader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

BucketUploader::~BucketUploader() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->done_cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
  if (impl_->streams) impl_->streams->Stop();
  close(impl_->journal_fd);
  close(impl_->state_fd);
  close(impl_->stage_fd);
}

namespace {
PendingUpload UploadOf(const std::string& rel_path, const struct stat& st) {
  PendingUpload p;
  p.path = Clean(rel_path);
  p.size = static_cast<uint64_t>(st.st_size);
  p.ino = st.st_ino;
  p.mtime_ns = MtimeNs(st);
  return p;
}
}  // namespace

Status BucketUploader::Queue(const std::string& rel_path, const struct stat& st) {
  return impl_->Enqueue(UploadOf(rel_path, st), /*from_capture=*/true);
}

void BucketUploader::PartChanged(const PartChange& change) {
  if (impl_->streams) impl_->streams->Changed(change);
}

Status BucketUploader::Changed(const std::string& rel_path) {
  Impl& m = *impl_;
  const std::string rel = Clean(rel_path);
  const size_t slash = rel.rfind('/');
  const std::string name = slash == std::string::npos ? rel : rel.substr(slash + 1);
  if (rel.empty() || name.starts_with(".ucpfs-create.") || rel == ".ucpfs" || rel.starts_with(".ucpfs/")) {
    return Status::Ok();
  }
  const int fd = OpenBeneath(m.stage_fd, rel, O_PATH | O_NOFOLLOW);
  if (fd < 0) {
    if (errno != ENOENT) return Status::Ok();  // a symlink (ELOOP) or not beneath: not mirrored
    PendingUpload p;
    p.is_delete = true;
    p.path = rel;
    return m.Enqueue(std::move(p));
  }
  struct stat st = {};
  const int rc = fstat(fd, &st);
  close(fd);
  if (rc != 0) return IoError("stat " + m.options.stage_dir + "/" + rel, errno);
  if (S_ISREG(st.st_mode)) return m.Enqueue(UploadOf(rel, st));
  if (!S_ISDIR(st.st_mode)) return Status::Ok();
  // A directory renamed into place: its files, in name order, depth first (bounded).
  size_t budget = 100000;
  std::function<Status(const std::string&)> walk = [&](const std::string& dir) -> Status {
    const int dfd = OpenBeneath(m.stage_fd, dir, O_RDONLY | O_DIRECTORY);
    if (dfd < 0) return Status::Ok();
    DIR* d = fdopendir(dfd);
    if (d == nullptr) {
      close(dfd);
      return Status::Ok();
    }
    std::vector<std::string> names;
    while (const dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != ".." && !n.starts_with(".ucpfs-create.")) names.push_back(n);
    }
    closedir(d);
    std::sort(names.begin(), names.end());
    for (const std::string& n : names) {
      if (budget == 0) return Status::Ok();
      --budget;
      const std::string child = dir + "/" + n;
      const int cfd = OpenBeneath(m.stage_fd, child, O_PATH | O_NOFOLLOW);
      if (cfd < 0) continue;
      struct stat cst = {};
      const int crc = fstat(cfd, &cst);
      close(cfd);
      if (crc != 0) continue;
      if (S_ISREG(cst.st_mode)) {
        UCPFS_RETURN_IF_ERROR(m.Enqueue(UploadOf(child, cst)));
      } else if (S_ISDIR(cst.st_mode)) {
        UCPFS_RETURN_IF_ERROR(walk(child));
      }
    }
    return Status::Ok();
  };
  return walk(rel);
}

Status BucketUploader::WaitUploaded(uint64_t stuck_ms, const std::function<void(const std::string&)>& progress) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  const uint64_t target = m.n_enqueued;
  auto last_line = Clock::now();
  while (m.n_finished < target && !m.stopping) {
    m.done_cv.wait_for(lock, std::chrono::milliseconds(200));
    const auto now = Clock::now();
    if (progress && now - last_line >= std::chrono::seconds(2)) {
      uint64_t bytes = 0;
      for (const auto& i : m.queue) bytes += i.n_bytes;
      progress("uploading to s3://" + m.options.bucket + "/" + m.options.prefix + ": " + std::to_string(m.queue.size()) +
               " file(s), " + std::to_string(bytes >> 20) + " MiB to go" +
               (m.head_error.ok() ? "" : " (failing: " + m.head_error.ToString() + ")"));
      last_line = now;
    }
    if (!m.head_error.ok() && now - m.last_progress >= std::chrono::milliseconds(stuck_ms)) {
      std::string msg = std::to_string(m.queue.size()) + " file(s) not uploaded (kept staged in " +
                        m.options.stage_dir + " for the next mount): ";
      const std::vector<std::string> waiting = m.Waiting(1000);
      for (size_t i = 0; i < waiting.size(); ++i) msg += (i ? ", " : "") + waiting[i];
      msg += "; the first failed with: " + m.head_error.ToString();
      return Status(StatusCode::kIo, msg, EIO);
    }
  }
  if (m.n_finished < target) {
    return Status(StatusCode::kIo, std::to_string(m.queue.size()) + " file(s) not uploaded: stopping", EIO);
  }
  return Status::Ok();
}

Status BucketUploader::Stop(uint64_t stuck_ms, const std::function<void(const std::string&)>& progress) {
  Status s = WaitUploaded(stuck_ms, progress);
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->done_cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
  if (impl_->streams) impl_->streams->Stop();  // what no item took over is aborted
  impl_->Collect(/*at_stop=*/true);
  return s;
}

UploaderStats BucketUploader::Stats() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  UploaderStats s;
  s.queued_files = m.queue.size();
  for (const auto& i : m.queue) s.queued_bytes += i.n_bytes;
  s.uploaded_files = m.uploaded_files;
  s.uploaded_bytes = m.uploaded_bytes;
  s.deleted_objects = m.deleted_objects;
  s.skipped = m.skipped;
  s.failing = m.head_error.ok() ? "" : m.head_error.ToString();
  s.waiting = m.Waiting(1000);
  s.staged_bytes = s.queued_bytes;
  for (const auto& [path, kept] : m.uploaded) s.staged_bytes += kept.version.size;
  s.removed_files = m.removed_files;
  if (m.streams) s.streamed = m.streams->Stats();
  return s;
}

void BucketUploader::SetInUse(std::function<std::vector<std::string>(uint64_t recent_ms)> in_use) {
  std::lock_guard lock(impl_->in_use_mu);
  impl_->in_use = std::move(in_use);
}

void BucketUploader::SetRemoved(std::function<void()> removed) {
  std::lock_guard lock(impl_->in_use_mu);
  impl_->on_removed = std::move(removed);
}

void BucketUploader::SetDirInUse(std::function<bool(dev_t, ino_t)> dir_in_use) {
  impl_->copies->SetDirInUse(std::move(dir_in_use));
}

std::string BucketUploader::Url(const std::string& rel_path) const { return impl_->Url(Clean(rel_path)); }

}  // namespace ucpfs::io
