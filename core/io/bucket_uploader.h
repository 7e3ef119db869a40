// BucketUploader: the files saved into an s3:// mount, uploaded from their local staging
// directory to s3://BUCKET/PREFIX/<path> strictly in the order they were queued: the order in
// which write capture made them durable (close order, WriteCaptureOptions::before_settled), so a
// pointer file closed last (`latest`, DCP's `.metadata`) is never visible in the bucket before
// the shards closed before it. Each item's upload completes before the next one's starts: a PUT
// for a file up to part_bytes, else CreateMultipartUpload, UploadPart of part_bytes parts
// (parts_in_flight at once, read from the staged file) and CompleteMultipartUpload. A rename or
// unlink in the staging directory (Changed) queues the new name's upload and a DELETE of what is
// gone, in the same order.
//
// Streaming (stream_parts): a file still being written sends its full parts as they are flushed
// (streamed_uploads.h, fed by PartChanged); its item then takes that upload over and sends only
// the parts not sent or changed since, then completes it in its turn. Bytes go cache -> the
// file's part on the staging disk (WriteCapture) -> bucket, read back from the part. A staged copy uploaded and unchanged since queued (same inode, size and
// mtime), with no item queued at its path, is removed (by the uploader's thread, checked about
// once a second) once it was uploaded keep_ms ago and is not in use (in_use: open through the
// mount, or closed less than keep_ms ago: DCP renames `.metadata.tmp` right after closing it and
// the rename needs the staged bytes); then its directories, when empty and not known to the mount
// (dir_in_use: the kernel may still create in one through a name or descriptor it holds; never the
// staging root).
// The removal (staged_copies.h) moves the name into STATE first and checks the inode there, so a
// file renamed onto the name meanwhile is put back, never lost; then `removed` is called, so the mount lets
// go of what it still holds of the copies (fs/passthrough.h: their blocks are freed then, or at
// the last close of one that came into use meanwhile). Removing a copy needs no journal record: its
// item is done (kDone) already. At Stop every such copy is removed, in use or not.
//
// Crash safety: each item is recorded in a journal (STATE/journal, upload_journal.h) and the
// record fsync'd before Queue returns, so (with before_settled) no file is visible under its
// final name in the staging directory unrecorded; a multipart upload's id is recorded when it
// is created and its end (kDone) after it completed. Start() reads the journal back (untrusted:
// bounded, checksummed, every path checked beneath the staging root, never through a symlink),
// aborts the multipart uploads recorded as begun, and queues again, in the journal's order,
// every item not done. The journal is started afresh whenever the queue is empty.
//
// Failures: the client retries 5xx, throttling and transport errors itself; an item that still
// fails (a 403, the store down for longer) stays at the head of the queue, blocking every item
// behind it (order), is logged once per error naming s3://BUCKET/KEY, listed in Stats().failing,
// and tried again after 1 s, backing off to 30 s. A staged file that is gone or changed since it
// was queued is skipped (a later item holds its newer version, or it was removed: logged).
//
// Thread-safety: every method may be called from any thread at once.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/io/s3_client.h"
#include "core/io/streamed_uploads.h"
#include "core/io/write_capture.h"
#include "core/status.h"

namespace ucpfs::io {

struct BucketUploaderOptions {
  std::shared_ptr<s3::Client> client;
  std::string bucket;
  std::string prefix;      // no trailing '/'; "" for the bucket's root
  std::string stage_dir;   // the staging root (absolute), what relative paths are beneath
  std::string state_dir;   // holds the journal (made 0700 when missing; not a symlink)
  uint64_t part_bytes = 8ull << 20;  // at least 5 MiB (S3's smallest part but the last)
  unsigned parts_in_flight = 4;
  std::function<void(const std::string&)> log;
  // Called on the uploader's thread after an item's object is in the bucket (or deleted).
  std::function<void(const std::string& rel_path)> on_uploaded;
  // How long an uploaded staged copy stays (after its upload and its last close), at least 1 s.
  uint64_t keep_ms = 60000;
  // Send a file's full parts while it is written (see above), parts_in_flight at once.
  bool stream_parts = true;
};

struct UploaderStats {
  uint64_t queued_files = 0;      // items waiting, the one in progress included
  uint64_t queued_bytes = 0;      // their bytes (at queue time)
  uint64_t uploaded_files = 0;    // this mount's life
  uint64_t uploaded_bytes = 0;
  uint64_t deleted_objects = 0;
  uint64_t skipped = 0;           // staged file gone or changed since queued
  std::string failing;            // the head's last error ("" when it is not failing)
  std::vector<std::string> waiting;  // s3://BUCKET/KEY of each item not done, in order (at most 1000)
  uint64_t staged_bytes = 0;      // queued_bytes plus the uploaded copies still kept
  uint64_t removed_files = 0;     // uploaded copies removed from the staging directory (this life)
  StreamedStats streamed;         // parts sent while their files were written
};

class BucketUploader {
 public:
  // Opens (making it) state_dir, locks its journal (another live mount on the same staging
  // directory: kIo with EBUSY), reads it back, aborts recorded multipart uploads, queues what was
  // not done and starts the uploader thread. Errors: kIo naming the path; kInvalidArgument for
  // missing options.
  static Result<std::unique_ptr<BucketUploader>> Start(BucketUploaderOptions options);
  // Stops the thread (what is queued stays in the journal for the next mount).
  ~BucketUploader();
  BucketUploader(const BucketUploader&) = delete;
  BucketUploader& operator=(const BucketUploader&) = delete;

  // Queues the staged file `rel_path` (its stat: inode, size, mtime) for upload; returns once the
  // record is durable. Called by write capture's commit (before_settled) before the file shows
  // under that name: it is taken up once the name shows that inode (or skipped once a file
  // queued after it shows: its commit ended without placing it). The version queued last at that path (same inode, size and mtime) is
  // not queued again (an fsync, then the close of the unchanged file). Errors: kIo (the journal cannot be written), kInvalidArgument (a path
  // that is not clean).
  Status Queue(const std::string& rel_path, const struct stat& st);
  // Something changed at `rel_path` in the staging directory outside write capture (a rename's
  // two ends, an unlink, an rmdir): a regular file there now is queued, a directory's regular
  // files beneath it are queued (at most 100,000), nothing there queues a DELETE of the object.
  Status Changed(const std::string& rel_path);
  // A captured file's part changed (WriteCaptureOptions::on_part_change): followed for streaming.
  void PartChanged(const PartChange& change);
  // Returns once every item queued before the call is done. Gives up, with kIo naming every
  // s3://BUCKET/KEY not uploaded, when the head has failed for stuck_ms with no progress;
  // `progress` (may be null) gets a line every 2 s while it waits.
  Status WaitUploaded(uint64_t stuck_ms, const std::function<void(const std::string&)>& progress);
  // WaitUploaded(stuck_ms), then stops the thread, removes the staged copies uploaded and
  // unchanged since, and returns WaitUploaded's status.
  Status Stop(uint64_t stuck_ms, const std::function<void(const std::string&)>& progress);

  // Who tells which staged paths are in use (open through the mount, or closed less than
  // recent_ms ago); until it is set, and once it is set to null, no copy is removed before Stop.
  // Returns once no earlier function is being called.
  void SetInUse(std::function<std::vector<std::string>(uint64_t recent_ms)> in_use);
  // Called on the uploader's thread after it removed staged copies (not at Stop). Returns once
  // no earlier function is being called.
  void SetRemoved(std::function<void()> removed);
  // Who tells whether an empty staging directory (its st_dev, st_ino) is still known to the mount
  // (fs::Passthrough::KnowsDirectory); such a one, and its parents, are not removed (a create in
  // it would fail). Unset: directories are removed when empty. Not asked at Stop.
  void SetDirInUse(std::function<bool(dev_t, ino_t)> dir_in_use);

  UploaderStats Stats() const;
  std::string Url(const std::string& rel_path) const;  // s3://BUCKET/PREFIX/rel_path

  struct Impl;

 private:
  explicit BucketUploader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucpfs::io
