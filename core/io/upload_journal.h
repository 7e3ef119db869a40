// The bucket uploader's queue journal (bucket_uploader.h): an append-only record of the files
// queued for upload to s3://BUCKET/PREFIX, in queue order, and of how far each got, read back
// after a crash to upload again what was queued and not done. Pure bytes -> records here (no
// I/O), so the parser of this untrusted file is unit-tested alone.
//
// File: the 8-byte magic "UCPFSU01", then records framed as the capture journal's
// (capture_journal.h: u32 payload length | u64 XXH64(payload) | payload); a payload is a u8 type,
// the item's id u64, then (all little endian):
//   kQueued  size u64, ino u64, mtime ns i64, path length u32, path: upload the staged file at
//            path (relative to the staging root) to PREFIX/path, if it is still that inode, size
//            and mtime
//   kDelete  path length u32, path: delete PREFIX/path (the staged file was unlinked or renamed)
//   kBegun   upload-id length u32, upload id: a multipart upload of the item was created (abort
//            it when the item is done again after a crash)
//   kStreaming  path length u32, path, upload-id length u32, upload id: a multipart upload of the
//            file being written at path was created before the file was queued, to send its full
//            parts as they are written (its id is one of its own, never an item's; abort it after
//            a crash unless a kDone of that id follows)
//   kDone    the item's upload or delete completed (or it was given up, as its log line says), or
//            the streamed upload of that id was taken over by an item (its kBegun names it) or aborted
// A torn or damaged record ends the journal there (everything after it is ignored).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace ucpfs::io {

inline constexpr char kUploadJournalMagic[8] = {'U', 'C', 'P', 'F', 'S', 'U', '0', '1'};
// Bounds on what the journal may hold (it is untrusted input).
inline constexpr size_t kMaxUploadJournalBytes = size_t{64} << 20;
inline constexpr size_t kMaxUploadIdBytes = 1024;

enum class UploadRecordType : uint8_t { kQueued = 1, kDelete = 2, kBegun = 3, kDone = 4, kStreaming = 5 };

struct UploadRecord {
  UploadRecordType type = UploadRecordType::kQueued;
  uint64_t id = 0;
  uint64_t size = 0;       // kQueued
  uint64_t ino = 0;        // kQueued
  int64_t mtime_ns = 0;    // kQueued
  std::string path;        // kQueued, kDelete, kStreaming
  std::string upload_id;   // kBegun, kStreaming
};

// One encoded record, ready to append.
std::vector<std::byte> EncodeUploadRecord(const UploadRecord& record);

struct ParsedUploadJournal {
  std::vector<UploadRecord> records;
  std::string stopped;  // why parsing stopped early ("" when every byte was a whole record)
  size_t n_bytes_used = 0;
};

// Errors: kCorrupt when the magic is wrong or the journal is larger than kMaxUploadJournalBytes.
// A record that does not decode (unknown type, bad length, an upload id past kMaxUploadIdBytes or
// not printable ASCII, a path past kMaxJournalPathBytes) ends it as a damaged one does.
Result<ParsedUploadJournal> ParseUploadJournal(std::span<const std::byte> bytes);

// An item queued and not done, to be done again after a crash.
struct PendingUpload {
  uint64_t id = 0;
  bool is_delete = false;
  std::string path;
  uint64_t size = 0;
  uint64_t ino = 0;
  int64_t mtime_ns = 0;
  std::vector<std::string> begun_upload_ids;  // multipart uploads to abort first
};

struct UploadPlan {
  std::vector<PendingUpload> pending;  // in queue order (the order of their kQueued/kDelete)
  // Items dropped, one line each: a path that is not a clean relative path outside .ucpfs
  // (CheckPlacePath), an id queued twice, a kBegun/kDone of an id never queued.
  std::vector<std::string> dropped;
  uint64_t max_id = 0;  // the largest id seen (new items take larger ones)
  // Streamed multipart uploads (kStreaming) never taken over or aborted: abort them.
  struct Streaming {
    uint64_t id = 0;
    std::string path;
    std::string upload_id;
  };
  std::vector<Streaming> streaming;
};

UploadPlan PlanUploads(const ParsedUploadJournal& journal);

}  // namespace ucpfs::io
