// ByteSource: random-access read of an immutable byte sequence (a file, a slice of a file,
// a buffer). All format readers in core/ read through this, so they know no system I/O and
// tests can hand them in-memory or fault-injecting sources.
//
// Batched reads: ReadPieces reads several ranges of one source at once (files submit them as
// one batch of I/O ops: core/io/file_source.h), and a ReadBatch open on the calling thread
// collects the plain reads of a whole view read (ReadOrDefer) so that they go out together when
// it ends: a read of a view is one batch of source reads per source file.
//
// Located reads: inside a LocateScope, the view read's batch does not read the plain pieces
// whose source lies in an open file (ByteSource::LocatePieces): it hands back where they lie,
// and the caller moves those file pages itself (the mount splices them into its reply).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/source_run.h"
#include "core/status.h"

namespace ucpfs {

// One range of a batched read (ByteSource::ReadPieces).
struct ReadPiece {
  uint64_t byte_offset = 0;
  std::span<std::byte> out;
};

// Where a source's bytes lie in an open file (ByteSource::LocatePieces): `fd` stays open while
// `holder` is held.
struct FileExtent {
  std::shared_ptr<const void> holder;
  int fd = -1;
  uint64_t byte_offset = 0;  // in the file
};

class ByteSource {
 public:
  virtual ~ByteSource() = default;

  // Total size in bytes.
  virtual uint64_t Size() const = 0;

  // Name used in error messages (usually the path).
  virtual const std::string& Name() const = 0;

  // Reads exactly out.size() bytes at byte_offset. Errors: kOutOfRange when the range is not
  // inside [0, Size()), kIo when the underlying read fails (sys_errno set).
  virtual Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const = 0;

  // A hint: [byte_offset, byte_offset + n_bytes) will be read soon. Sources backed by files
  // start reading the bytes they will need into the page cache, without waiting and without
  // holding them in this process; others ignore it (the default). Never fails; a range past the
  // end is clipped.
  virtual void Prefetch(uint64_t byte_offset, uint64_t n_bytes) const {
    (void)byte_offset;
    (void)n_bytes;
  }

  // Reads every piece (exactly out.size() bytes at byte_offset each), as one batch where the
  // source can (files: submitted together). The default reads them one by one with ReadAt.
  // Errors: ReadAt's, of the first failing piece in the order given; its index goes to
  // *failed_index (when not null). On error the other pieces' bytes are unspecified.
  virtual Status ReadPieces(std::span<const struct ReadPiece> pieces, size_t* failed_index = nullptr) const;

  // What ReadAt of [byte_offset, byte_offset + n_bytes) would read, without reading: the runs
  // of the sources at the bottom (core/source_run.h), in the order the read would fill them.
  // A source that is not built over others (a file, a buffer) reports itself: the default.
  // Sources built over others (slices, lazy views) report the runs of theirs. Errors:
  // kOutOfRange when the range is not inside [0, Size()); kUnsupported when a part cannot tell.
  virtual Status DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const;

  // Where each piece's bytes lie, unchanged, in an open file (extents[i] for pieces[i];
  // extents.size() == pieces.size()), without reading them: for readers that move file pages
  // instead of copying them (LocateScope). A file is checked now to be the version indexed, as
  // a read's would be. false: this source cannot say (bytes in memory or object storage; the
  // default): read the pieces instead. Errors: what ReadPieces would return for the same pieces
  // besides the read itself (kOutOfRange, the open's, kDataLoss for a changed file).
  virtual Result<bool> LocatePieces(std::span<const ReadPiece> pieces, std::span<FileExtent> extents) const;
};

// A ByteSource over bytes held in memory.
class MemorySource final : public ByteSource {
 public:
  MemorySource(std::string name, std::vector<std::byte> bytes)
      : name_(std::move(name)), bytes_(std::move(bytes)) {}
  MemorySource(std::string name, std::span<const uint8_t> bytes);

  uint64_t Size() const override { return bytes_.size(); }
  const std::string& Name() const override { return name_; }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;

 private:
  std::string name_;
  std::vector<std::byte> bytes_;
};

// A window [byte_offset, byte_offset + n_bytes) of another source, seen as a whole source
// (a DCP .distcp slice is a complete torch.save zip).
class SliceSource final : public ByteSource {
 public:
  // Errors: kOutOfRange when the window is not inside `base`.
  static Result<std::shared_ptr<SliceSource>> Make(std::shared_ptr<const ByteSource> base,
                                                   uint64_t byte_offset, uint64_t n_bytes);
  uint64_t Size() const override { return n_bytes_; }
  const std::string& Name() const override { return name_; }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;
  // The runs of `base` under the window.
  Status DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const override;
  // The pieces moved into `base`, read there as one batch.
  Status ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index = nullptr) const override;
  // The pieces moved into `base`, located there.
  Result<bool> LocatePieces(std::span<const ReadPiece> pieces, std::span<FileExtent> extents) const override;
  uint64_t base_offset() const { return byte_offset_; }

 private:
  SliceSource(std::shared_ptr<const ByteSource> base, uint64_t byte_offset, uint64_t n_bytes);
  std::shared_ptr<const ByteSource> base_;
  uint64_t byte_offset_;
  uint64_t n_bytes_;
  std::string name_;
};

// The reads of one view read, collected while it is open on the calling thread and read when it
// ends (Finish), each source's pieces as one batch (ByteSource::ReadPieces). Scopes nest: reads
// go to the innermost, and each Finish reads its own (a view read inside another returns its
// bytes complete). A deferred piece's buffer must stay valid until Finish (they are the view
// read's own output buffer). Not for reads whose bytes the caller looks at before the scope
// ends (conversions, gathers): those read at once through ReadAt.
class ReadBatch {
 public:
  ReadBatch();
  ~ReadBatch();  // without Finish (a failing read): what was deferred is dropped unread
  ReadBatch(const ReadBatch&) = delete;
  ReadBatch& operator=(const ReadBatch&) = delete;

  // Reads what was deferred. Errors: the first failing piece's in the order deferred (a view
  // reads in byte order, so that is the first in byte order), with the source's name as
  // context when its message lacks it.
  Status Finish();

  // Pieces deferred to this thread's innermost open batch and not read yet (for tests).
  static size_t PendingPieces();

 private:
  bool finished_ = false;
};

// `src.ReadAt(byte_offset, out)`, deferred into the calling thread's innermost ReadBatch when there
// is one (Ok is returned then; the read's error comes from Finish), else read now.
Status ReadOrDefer(const ByteSource& src, uint64_t byte_offset, std::span<std::byte> out);

// Flushes the calling thread's innermost open ReadBatch now (reads what it deferred so far). Callers whose
// own reads must not pass deferred ones (to keep the first error in byte order) call it first.
// Errors: as ReadBatch::Finish. Ok when no batch is open.
Status FlushReadBatch();

// A plain piece of a view read left unread (LocateScope): its `n_bytes` at `out` are the bytes
// at `where` in an open file.
struct LocatedPiece {
  std::byte* out = nullptr;
  size_t n_bytes = 0;
  FileExtent where;
};

// While open on the calling thread, the first ReadBatch opened after it (a view file's read:
// LazyTorchFile, LazySafetensorsFile) leaves unread the deferred pieces of at least
// `min_piece_bytes` whose source can locate them (ByteSource::LocatePieces), up to `max_pieces`
// of them (more are read), and records them in pieces(), in the order deferred: the caller must
// get those bytes from the files itself, after the read returns Ok. Every other byte of the read
// is in its buffer as usual. Batches opened inside that one (a view read by another) read
// everything. Scopes do not nest. Not with LegacyReadPath (no batches: nothing is located).
class LocateScope {
 public:
  LocateScope(uint64_t min_piece_bytes, size_t max_pieces);
  ~LocateScope();
  LocateScope(const LocateScope&) = delete;
  LocateScope& operator=(const LocateScope&) = delete;

  const std::vector<LocatedPiece>& pieces() const;

 private:
  size_t depth_;
};

// The read path as it was before batching (UCPFS_READ_PATH=legacy in the environment, read once
// per process): an I/O engine made per source read, no plan cache, no ReadBatch, read-ahead as
// WILLNEED hints only. For measuring the new path against the old in one run, and a way back.
bool LegacyReadPath();

// Reads a whole range into a new vector. Errors as ReadAt; kResourceExhausted above max_bytes.
Result<std::vector<std::byte>> ReadRange(const ByteSource& src, uint64_t byte_offset,
                                         uint64_t n_bytes, uint64_t max_bytes = 1ull << 30);

}  // namespace ucpfs
