// StreamedUploads: the full parts of files still being saved into an s3:// mount, sent to the
// bucket while they are written, so that at close only what is left goes out (the bucket
// uploader, bucket_uploader.h, owns one and takes each file's upload over when the file's turn
// comes, in close order).
//
// It follows each captured file's part through write capture's PartChange events
// (write_capture.h): a part of part_bytes bytes, [k * part_bytes, (k + 1) * part_bytes), is
// ready once every chunk overlapping it was flushed whole and the file was flushed past its end
// (so it is never the file's last part). Ready parts are read back from the part file (a
// descriptor dup'ed at the file's first event: the same inode the file has under its final
// name) and sent as UploadPart of one multipart upload per file, created at the first ready part
// at PREFIX/<the file's path then> and journaled (kStreaming) before any part is sent, by
// `threads` threads. Nothing is visible in the bucket until the uploader completes the upload.
//
// A part sent stays good while no event touched a chunk overlapping it since it was read: each
// event stamps the chunks it covers with a new number, and a part remembers the largest stamp
// of its chunks when its read began. Take() hands over the upload with the parts still good;
// the uploader sends the others (a part rewritten after it was sent goes again, as does one
// sent while a flush of it was in flight).
//
// Bounds: at most kMaxStreamedFiles files followed at once (later ones upload at close, as
// before), parts 1..10000 only, one part_bytes buffer per thread while it sends.
// An upload never taken over is aborted (and journaled done) when its file is discarded, when
// the file goes up in one PUT (Abandon), when Take finds it begun at another path or for other
// part sizes, and at Stop; after a crash the next mount aborts what the journal lists open
// (upload_journal.h). A cut only makes the parts past it not whole (sent again if need be).
//
// Thread-safety: every method may be called from any thread at once. Lock order: the owner's
// journal lock (inside `append`) before this class's mutex, never after.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/io/s3_client.h"
#include "core/io/upload_journal.h"
#include "core/io/write_capture.h"
#include "core/status.h"

namespace ucpfs::io {

inline constexpr size_t kMaxStreamedFiles = 64;

struct StreamedUploadsOptions {
  std::shared_ptr<s3::Client> client;
  std::string bucket;
  std::function<std::string(const std::string& rel_path)> key;  // the object key of a staged path
  uint64_t part_bytes = 8ull << 20;
  unsigned threads = 4;
  // A fresh record id (never an item's) and the journal append (durable when it returns OK).
  std::function<uint64_t()> new_id;
  std::function<Status(const UploadRecord&)> append;
  std::function<void(const std::string&)> log;
};

struct StreamedStats {
  uint64_t files = 0;           // followed now
  uint64_t uploads_open = 0;    // multipart uploads created and not yet taken over or aborted
  uint64_t parts_sent = 0;      // this mount's life
  uint64_t bytes_sent = 0;
  uint64_t parts_taken = 0;     // handed over still good
  uint64_t parts_stale = 0;     // sent, then changed before the file's turn: sent again at close
  uint64_t uploads_aborted = 0;
};

class StreamedUploads {
 public:
  explicit StreamedUploads(StreamedUploadsOptions options);
  // Stop(), if not called.
  ~StreamedUploads();
  StreamedUploads(const StreamedUploads&) = delete;
  StreamedUploads& operator=(const StreamedUploads&) = delete;

  // A captured file's part changed (WriteCaptureOptions::on_part_change).
  void Changed(const PartChange& change);

  // What Take hands over: the multipart upload of the file and its parts still good (part
  // number 1.. -> ETag), each exactly part_bytes long.
  struct Taken {
    uint64_t stream_id = 0;
    std::string upload_id;
    std::map<int, std::string> parts;
  };
  // The file with inode `ino` is to be uploaded at `rel_path` with `n_bytes` in parts of
  // `part_bytes`: waits for its parts in flight and hands its upload over (nullopt when there is
  // none, or none usable: begun at another path or for other part sizes, then aborted). The
  // caller journals its own kBegun of upload_id, then Done(stream_id).
  std::optional<Taken> Take(uint64_t ino, const std::string& rel_path, uint64_t n_bytes, uint64_t part_bytes);
  // The file with inode `ino` is uploaded without its stream (in one PUT): its upload, if any,
  // is aborted and journaled done (`why` goes into the log line should the abort fail).
  void Abandon(uint64_t ino, const std::string& why);
  // Journals the end (kDone) of a stream handed over.
  void Done(uint64_t stream_id);
  // The kStreaming records of the uploads open now (to write again into a journal started afresh).
  std::vector<UploadRecord> Open() const;
  // Stops the threads and aborts every upload not handed over.
  void Stop();

  StreamedStats Stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucpfs::io
