// See streamed_uploads.h.
#include "core/io/streamed_uploads.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <set>
#include <tuple>
#include <thread>

namespace ucpfs::io {
namespace {

constexpr uint64_t kMaxParts = 10000;

struct ChunkState {
  uint64_t n_bytes = 0;
  uint64_t stamp = 0;  // the event that last touched it
  bool whole = false;  // the part holds all of it
};

struct PartSent {
  uint64_t stamp = 0;  // the largest stamp of its chunks when its read began
  std::string etag;
};

struct Stream {
  uint64_t seq = 0;
  uint64_t ino = 0;
  int fd = -1;              // the part, dup'ed
  std::string rel_path;     // where it went when its upload was created (or would be)
  uint64_t flushed_end = 0; // the end of the furthest chunk flushed
  std::map<uint64_t, ChunkState> chunks;  // by byte offset
  std::map<uint64_t, PartSent> sent;      // by part index
  std::map<uint64_t, bool> in_flight;     // part index -> being sent
  // Parts an event may have made ready to send (NextPart looks at these only, and drops each
  // it finds not ready or sent already: a later event that concerns it puts it back).
  std::set<uint64_t> candidates;
  uint64_t stream_id = 0;
  std::string upload_id;
  bool creating = false;    // a thread is creating its upload
  bool recorded = false;    // its kStreaming record is (being) journaled
  bool closing = false;     // Take or an abort waits for it: no new part is started
  bool failed = false;      // creating the upload failed: left to the close
};

}  // namespace

struct StreamedUploads::Impl {
  StreamedUploadsOptions options;
  mutable std::mutex mu;
  std::condition_variable cv;       // work may be ready, or stopping
  std::condition_variable idle_cv;  // a part finished
  std::map<uint64_t, Stream> streams;  // by seq
  uint64_t next_stamp = 1;
  bool stopping = false;
  bool full_logged = false;
  StreamedStats stats;
  std::vector<std::thread> threads;

  void Log(const std::string& line) const {
    if (options.log) options.log(line);
  }
  std::string Url(const std::string& rel) const { return "s3://" + options.bucket + "/" + options.key(rel); }

  // The largest stamp of the chunks overlapping part k, and whether they are all whole.
  std::pair<uint64_t, bool> PartState(const Stream& s, uint64_t k) const {
    const uint64_t lo = k * options.part_bytes, hi = lo + options.part_bytes;
    uint64_t stamp = 0, covered = lo;
    auto it = s.chunks.upper_bound(lo);
    if (it != s.chunks.begin()) --it;
    for (; it != s.chunks.end() && it->first < hi; ++it) {
      if (it->first + it->second.n_bytes <= lo) continue;
      stamp = std::max(stamp, it->second.stamp);
      if (!it->second.whole || it->first > covered) return {stamp, false};
      covered = std::max(covered, it->first + it->second.n_bytes);
    }
    return {stamp, covered >= hi};
  }

  // A part of some stream to send now (mu held): (seq, part index).
  std::optional<std::pair<uint64_t, uint64_t>> NextPart() {
    for (auto& [seq, s] : streams) {
      if (s.closing || s.failed || s.creating) continue;
      for (auto it = s.candidates.begin(); it != s.candidates.end();) {
        const uint64_t k = *it;
        if (s.in_flight.contains(k)) {  // looked at again once sent (Worker puts it back)
          it = s.candidates.erase(it);
          continue;
        }
        // Never the last part, never past S3's 10,000.
        bool ready = k < kMaxParts && (k + 1) * options.part_bytes < s.flushed_end;
        uint64_t stamp = 0;
        if (ready) {
          bool whole = false;
          std::tie(stamp, whole) = PartState(s, k);
          const auto sent = s.sent.find(k);
          ready = whole && (sent == s.sent.end() || sent->second.stamp != stamp);
        }
        if (!ready) {
          it = s.candidates.erase(it);
          continue;
        }
        return std::pair{seq, k};
      }
    }
    return std::nullopt;
  }

  // Aborts the stream's upload, if any, and journals its end. The stream is out of `streams`.
  void AbortStream(Stream s, const std::string& why) {
    if (!s.upload_id.empty()) {
      const Status a = options.client->AbortMultipartUpload(options.bucket, options.key(s.rel_path), s.upload_id);
      if (!a.ok() && a.code() != StatusCode::kNotFound) {
        Log("ucpfs: upload: cannot abort the streamed upload of " + Url(s.rel_path) + " (" + why +
            "): " + a.ToString() + " (the next mount aborts it)");
      } else {
        UploadRecord r;
        r.type = UploadRecordType::kDone;
        r.id = s.stream_id;
        if (Status d = options.append(r); !d.ok()) Log("ucpfs: upload journal: " + d.ToString());
      }
      std::lock_guard lock(mu);
      ++stats.uploads_aborted;
    }
    if (s.fd >= 0) close(s.fd);
  }

  // The stream of the file with inode `ino` not being taken out already; 0 when none (mu held).
  uint64_t SeqOf(uint64_t ino) const {
    for (const auto& [seq, s] : streams) {
      if (s.ino == ino && !s.closing) return seq;
    }
    return 0;
  }

  // Marks the stream closing, waits for its parts in flight and takes it out (mu held by lock).
  Stream Detach(std::unique_lock<std::mutex>& lock, uint64_t seq) {
    streams.at(seq).closing = true;
    idle_cv.wait(lock, [&] {
      const auto it = streams.find(seq);
      return it == streams.end() || (it->second.in_flight.empty() && !it->second.creating);
    });
    Stream s = std::move(streams.at(seq));
    streams.erase(seq);
    return s;
  }

  void Worker() {
    std::vector<std::byte> buf;
    std::unique_lock lock(mu);
    for (;;) {
      std::optional<std::pair<uint64_t, uint64_t>> next;
      cv.wait(lock, [&] { return stopping || (next = NextPart()).has_value(); });
      if (stopping) return;
      const auto [seq, k] = *next;
      Stream& s = streams.at(seq);
      if (s.upload_id.empty()) {
        s.creating = true;
        const std::string rel = s.rel_path;
        lock.unlock();
        Result<std::string> id = options.client->CreateMultipartUpload(options.bucket, options.key(rel));
        UploadRecord r;
        r.type = UploadRecordType::kStreaming;
        r.path = rel;
        r.id = options.new_id();
        Status recorded = id.ok() ? Status::Ok() : id.error();
        if (id.ok()) {
          r.upload_id = *id;
          {
            std::lock_guard relock(mu);
            Stream& t = streams.at(seq);
            t.upload_id = *id;
            t.stream_id = r.id;
            t.recorded = true;  // from now on Open() lists it
          }
          recorded = options.append(r);
          if (!recorded.ok()) (void)options.client->AbortMultipartUpload(options.bucket, options.key(rel), *id);
        }
        lock.lock();
        Stream& t = streams.at(seq);
        t.creating = false;
        if (!recorded.ok()) {
          t.upload_id.clear();
          t.recorded = false;
          t.failed = true;
          Log("ucpfs: upload: the parts of " + Url(rel) + " go at its close, not while it is written: " +
              recorded.ToString());
        }
        idle_cv.notify_all();
        cv.notify_all();
        continue;
      }
      const auto [stamp, whole] = PartState(s, k);
      s.in_flight[k] = true;
      const int fd = s.fd;
      const std::string key = options.key(s.rel_path), upload_id = s.upload_id;
      lock.unlock();
      buf.resize(options.part_bytes);
      Result<std::string> etag = std::string();
      bool short_read = false;  // cut meanwhile, or a read error
      size_t done = 0;
      while (done < buf.size()) {
        const ssize_t n = pread(fd, buf.data() + done, buf.size() - done,
                                static_cast<off_t>(k * options.part_bytes + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      if (done == buf.size()) {
        etag = options.client->UploadPart(options.bucket, key, upload_id, static_cast<int>(k + 1), buf);
      } else {
        short_read = true;
      }
      std::vector<std::byte>().swap(buf);  // held only while sending
      lock.lock();
      Stream& t = streams.at(seq);
      t.in_flight.erase(k);
      t.candidates.insert(k);  // changed while it was sent: it goes again
      if (short_read) {
        t.failed = true;  // a file cut while written (rare): its parts go at its close
      } else if (etag.ok()) {
        t.sent[k] = {stamp, *etag};
        ++stats.parts_sent;
        stats.bytes_sent += options.part_bytes;
      } else {
        // Left to the close (which sends every part not good): no retry loop here.
        t.failed = true;
        Log("ucpfs: upload: part " + std::to_string(k + 1) + " of " + Url(t.rel_path) +
            " goes at its close: " + etag.error().ToString());
      }
      idle_cv.notify_all();
      cv.notify_all();
    }
  }
};

StreamedUploads::StreamedUploads(StreamedUploadsOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  const unsigned n = std::max(1u, impl_->options.threads);
  for (unsigned i = 0; i < n; ++i) impl_->threads.emplace_back([this] { impl_->Worker(); });
}

StreamedUploads::~StreamedUploads() { Stop(); }

void StreamedUploads::Changed(const PartChange& change) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  if (m.stopping) return;
  auto it = m.streams.find(change.seq);
  if (change.kind == PartChange::Kind::kDiscarded) {
    if (it == m.streams.end()) return;
    Stream s = m.Detach(lock, change.seq);
    lock.unlock();
    m.AbortStream(std::move(s), "its file was removed before it was saved");
    return;
  }
  if (it == m.streams.end()) {
    if (change.kind != PartChange::Kind::kFlushed || !change.whole || change.rel_path.empty()) return;
    if (m.streams.size() >= kMaxStreamedFiles) {
      if (!m.full_logged) {
        m.Log("ucpfs: upload: " + std::to_string(kMaxStreamedFiles) +
              " files are being streamed already: later ones upload when closed");
      }
      m.full_logged = true;
      return;
    }
    Stream s;
    s.seq = change.seq;
    s.ino = change.ino;
    s.rel_path = change.rel_path;
    s.fd = fcntl(change.part_fd, F_DUPFD_CLOEXEC, 0);
    if (s.fd < 0) return;
    it = m.streams.emplace(change.seq, std::move(s)).first;
  }
  Stream& s = it->second;
  if (s.closing) return;  // being taken over: it is closed, no event can change it now
  const uint64_t stamp = m.next_stamp++;
  if (change.kind == PartChange::Kind::kFlushed) {
    ChunkState& c = s.chunks[change.byte_offset];
    c.n_bytes = std::max(c.n_bytes, change.n_bytes);
    c.stamp = stamp;
    c.whole = change.whole;
    const uint64_t p = m.options.part_bytes, end = change.byte_offset + change.n_bytes;
    // The parts this chunk overlaps, and those it makes not the last (the file's end passed them).
    for (uint64_t k = change.byte_offset / p; k * p < end && k < kMaxParts; ++k) s.candidates.insert(k);
    for (uint64_t k = s.flushed_end / p; k * p < end && k < kMaxParts; ++k) {
      if (k > 0) s.candidates.insert(k - 1);
      s.candidates.insert(k);
    }
    s.flushed_end = std::max(s.flushed_end, end);
  } else {  // kCut: nothing at or past the new end is whole any more
    for (auto& [offset, c] : s.chunks) {
      if (offset + c.n_bytes > change.byte_offset) {
        c.whole = false;
        c.stamp = stamp;
      }
    }
    s.flushed_end = std::min(s.flushed_end, change.byte_offset);
  }
  m.cv.notify_all();
}

void StreamedUploads::Abandon(uint64_t ino, const std::string& why) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  const uint64_t seq = m.SeqOf(ino);
  if (seq == 0) return;
  Stream s = m.Detach(lock, seq);
  lock.unlock();
  m.AbortStream(std::move(s), why);
}

std::optional<StreamedUploads::Taken> StreamedUploads::Take(uint64_t ino, const std::string& rel_path,
                                                            uint64_t n_bytes, uint64_t part_bytes) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  const uint64_t seq = m.SeqOf(ino);
  if (seq == 0) return std::nullopt;
  Stream s = m.Detach(lock, seq);
  if (s.upload_id.empty()) {
    lock.unlock();
    if (s.fd >= 0) close(s.fd);
    return std::nullopt;
  }
  if (s.rel_path != rel_path || part_bytes != m.options.part_bytes) {
    lock.unlock();
    m.AbortStream(std::move(s), "it is saved at " + rel_path + " in parts of " + std::to_string(part_bytes) + " bytes");
    return std::nullopt;
  }
  Taken t;
  t.stream_id = s.stream_id;
  t.upload_id = s.upload_id;
  for (const auto& [k, sent] : s.sent) {
    if ((k + 1) * part_bytes > n_bytes) continue;
    const auto [stamp, whole] = m.PartState(s, k);
    if (whole && stamp == sent.stamp) {
      t.parts[static_cast<int>(k + 1)] = sent.etag;
      ++m.stats.parts_taken;
    } else {
      ++m.stats.parts_stale;
    }
  }
  lock.unlock();
  if (s.fd >= 0) close(s.fd);
  return t;
}

void StreamedUploads::Done(uint64_t stream_id) {
  UploadRecord r;
  r.type = UploadRecordType::kDone;
  r.id = stream_id;
  if (Status d = impl_->options.append(r); !d.ok()) impl_->Log("ucpfs: upload journal: " + d.ToString());
}

std::vector<UploadRecord> StreamedUploads::Open() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  std::vector<UploadRecord> out;
  for (const auto& [seq, s] : m.streams) {
    if (!s.recorded || s.upload_id.empty()) continue;
    UploadRecord r;
    r.type = UploadRecordType::kStreaming;
    r.id = s.stream_id;
    r.path = s.rel_path;
    r.upload_id = s.upload_id;
    out.push_back(std::move(r));
  }
  return out;
}

void StreamedUploads::Stop() {
  Impl& m = *impl_;
  {
    std::lock_guard lock(m.mu);
    if (m.stopping) return;
    m.stopping = true;
  }
  m.cv.notify_all();
  for (auto& t : m.threads) t.join();
  std::map<uint64_t, Stream> left;
  {
    std::lock_guard lock(m.mu);
    left.swap(m.streams);
  }
  for (auto& [seq, s] : left) m.AbortStream(std::move(s), "the mount stops");
}

StreamedStats StreamedUploads::Stats() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  StreamedStats s = m.stats;
  s.files = m.streams.size();
  for (const auto& [seq, st] : m.streams) s.uploads_open += st.upload_id.empty() ? 0 : 1;
  return s;
}

}  // namespace ucpfs::io
