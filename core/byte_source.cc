#include "core/byte_source.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/checked.h"

namespace ucpfs {

MemorySource::MemorySource(std::string name, std::span<const uint8_t> bytes)
    : name_(std::move(name)), bytes_(bytes.size()) {
  if (!bytes.empty()) std::memcpy(bytes_.data(), bytes.data(), bytes.size());
}

Status MemorySource::ReadAt(uint64_t byte_offset, std::span<std::byte> out) const {
  if (!RangeInside(byte_offset, out.size(), bytes_.size())) {
    return OutOfRangeError(name_ + ": read of " + std::to_string(out.size()) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end (" +
                           std::to_string(bytes_.size()) + " bytes)");
  }
  if (!out.empty()) std::memcpy(out.data(), bytes_.data() + byte_offset, out.size());
  return Status::Ok();
}

Status ByteSource::DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const {
  if (!RangeInside(byte_offset, n_bytes, Size())) {
    return OutOfRangeError(Name() + ": range of " + std::to_string(n_bytes) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end (" + std::to_string(Size()) + " bytes)");
  }
  if (n_bytes > 0) sink(SourceRun{this, byte_offset, n_bytes, 1, 1, 1});
  return Status::Ok();
}

SliceSource::SliceSource(std::shared_ptr<const ByteSource> base, uint64_t byte_offset,
                         uint64_t n_bytes)
    : base_(std::move(base)), byte_offset_(byte_offset), n_bytes_(n_bytes) {
  name_ = base_->Name() + "@" + std::to_string(byte_offset_) + "+" + std::to_string(n_bytes_);
}

Result<std::shared_ptr<SliceSource>> SliceSource::Make(std::shared_ptr<const ByteSource> base,
                                                       uint64_t byte_offset, uint64_t n_bytes) {
  if (!RangeInside(byte_offset, n_bytes, base->Size())) {
    return OutOfRangeError(base->Name() + ": slice at offset " + std::to_string(byte_offset) +
                           " of " + std::to_string(n_bytes) + " bytes past end (" +
                           std::to_string(base->Size()) + " bytes)");
  }
  return std::shared_ptr<SliceSource>(new SliceSource(std::move(base), byte_offset, n_bytes));
}

Status SliceSource::ReadAt(uint64_t byte_offset, std::span<std::byte> out) const {
  if (!RangeInside(byte_offset, out.size(), n_bytes_)) {
    return OutOfRangeError(name_ + ": read of " + std::to_string(out.size()) +
                           " bytes at offset " + std::to_string(byte_offset) + " past end");
  }
  return base_->ReadAt(byte_offset_ + byte_offset, out);
}

Status SliceSource::DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const {
  if (!RangeInside(byte_offset, n_bytes, n_bytes_)) {
    return OutOfRangeError(name_ + ": range of " + std::to_string(n_bytes) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end");
  }
  return base_->DescribeReads(byte_offset_ + byte_offset, n_bytes, sink);
}

Result<bool> ByteSource::LocatePieces(std::span<const ReadPiece>, std::span<FileExtent>) const { return false; }

Result<bool> SliceSource::LocatePieces(std::span<const ReadPiece> pieces, std::span<FileExtent> extents) const {
  std::vector<ReadPiece> moved(pieces.begin(), pieces.end());
  for (ReadPiece& p : moved) {
    if (!RangeInside(p.byte_offset, p.out.size(), n_bytes_)) {
      return OutOfRangeError(name_ + ": read of " + std::to_string(p.out.size()) + " bytes at offset " +
                             std::to_string(p.byte_offset) + " past end");
    }
    p.byte_offset += byte_offset_;
  }
  return base_->LocatePieces(moved, extents);
}

Status ByteSource::ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index) const {
  for (size_t i = 0; i < pieces.size(); ++i) {
    Status s = ReadAt(pieces[i].byte_offset, pieces[i].out);
    if (!s.ok()) {
      if (failed_index != nullptr) *failed_index = i;
      return s;
    }
  }
  return Status::Ok();
}

Status SliceSource::ReadPieces(std::span<const ReadPiece> pieces, size_t* failed_index) const {
  std::vector<ReadPiece> moved(pieces.begin(), pieces.end());
  for (size_t i = 0; i < moved.size(); ++i) {
    if (!RangeInside(moved[i].byte_offset, moved[i].out.size(), n_bytes_)) {
      if (failed_index != nullptr) *failed_index = i;
      return OutOfRangeError(name_ + ": read of " + std::to_string(moved[i].out.size()) + " bytes at offset " +
                             std::to_string(moved[i].byte_offset) + " past end");
    }
    moved[i].byte_offset += byte_offset_;
  }
  return base_->ReadPieces(moved, failed_index);
}

namespace {

// The calling thread's open ReadBatches, innermost last: what each deferred, in order.
struct Deferred {
  const ByteSource* src;
  ReadPiece piece;
};
// An open LocateScope's request and what it located so far.
struct Locating {
  bool open = false;
  size_t frame = 0;  // the batch frame it applies to: the first opened after it
  uint64_t min_piece_bytes = 0;
  size_t max_pieces = 0;
  std::vector<LocatedPiece> pieces;  // kept across scopes (its capacity), cleared at each
};
struct ThreadBatches {
  std::vector<std::vector<Deferred>> frames;  // frames[0, depth) are open, innermost last
  size_t depth = 0;
  Locating locating;
};
thread_local ThreadBatches t_batches;

Status WithName(Status s, const ByteSource& src) {
  if (!s.ok() && s.message().find(src.Name()) == std::string::npos) return s.WithContext(src.Name());
  return s;
}

// Moves the pieces of `group` (all of `src`) that `locating` takes and `src` can locate into
// locating.pieces; what stays in `group` (with its indices) is to be read.
Status Locate(const ByteSource& src, std::vector<ReadPiece>& group, std::vector<size_t>& group_index,
              Locating& locating) {
  std::vector<size_t> take;  // positions in group
  for (size_t i = 0; i < group.size() && locating.pieces.size() + take.size() < locating.max_pieces; ++i) {
    if (group[i].out.size() >= locating.min_piece_bytes) take.push_back(i);
  }
  if (take.empty()) return Status::Ok();
  std::vector<ReadPiece> pieces;
  pieces.reserve(take.size());
  for (size_t i : take) pieces.push_back(group[i]);
  std::vector<FileExtent> extents(take.size());
  UCPFS_ASSIGN_OR_RETURN(const bool located, src.LocatePieces(pieces, extents));
  if (!located) return Status::Ok();
  for (size_t k = 0; k < take.size(); ++k) {
    locating.pieces.push_back({pieces[k].out.data(), pieces[k].out.size(), std::move(extents[k])});
  }
  // Keep the rest, in order.
  size_t kept = 0, next_taken = 0;
  for (size_t i = 0; i < group.size(); ++i) {
    if (next_taken < take.size() && take[next_taken] == i) {
      ++next_taken;
      continue;
    }
    group[kept] = group[i];
    group_index[kept] = group_index[i];
    ++kept;
  }
  group.resize(kept);
  group_index.resize(kept);
  return Status::Ok();
}

// Reads everything `frame` holds, each source's pieces as one batch, and clears it. The first
// error in deferral order wins: every source is read (their pieces are independent), then the
// failure with the smallest index is returned. A source may be a view whose read opens a batch
// of its own: nothing here refers into the thread's frames while a source reads.
// `locating` (the frame is a LocateScope's): pieces its sources can locate are recorded there
// instead of read.
Status ReadPending(std::vector<Deferred>& frame, Locating* locating = nullptr) {
  if (frame.empty()) return Status::Ok();
  const std::vector<Deferred> pending = std::move(frame);
  frame.clear();
  const size_t n = pending.size();
  std::vector<bool> taken(n, false);
  std::vector<ReadPiece> group;
  std::vector<size_t> group_index;
  size_t first_failed = n;
  Status first;
  for (size_t i = 0; i < n; ++i) {
    if (taken[i]) continue;
    const ByteSource* src = pending[i].src;
    group.clear();
    group_index.clear();
    for (size_t k = i; k < n; ++k) {
      if (taken[k] || pending[k].src != src) continue;
      taken[k] = true;
      group.push_back(pending[k].piece);
      group_index.push_back(k);
    }
    if (locating != nullptr) {
      Status s = Locate(*src, group, group_index, *locating);
      if (!s.ok()) {
        if (group_index[0] < first_failed) {
          first_failed = group_index[0];
          first = WithName(std::move(s), *src);
        }
        continue;
      }
      if (group.empty()) continue;
    }
    size_t failed = 0;
    Status s = src->ReadPieces(group, &failed);
    if (s.ok()) continue;
    const size_t at = group_index[std::min(failed, group_index.size() - 1)];
    if (at < first_failed) {
      first_failed = at;
      first = WithName(std::move(s), *src);
    }
  }
  return first_failed == n ? Status::Ok() : first;
}

}  // namespace

ReadBatch::ReadBatch() {
  ThreadBatches& b = t_batches;
  if (b.frames.size() <= b.depth) b.frames.emplace_back();
  b.frames[b.depth++].clear();
}

ReadBatch::~ReadBatch() {
  // Not finished (a failing read): what was deferred is dropped unread.
  ThreadBatches& b = t_batches;
  b.frames[--b.depth].clear();
}

Status ReadBatch::Finish() {
  if (finished_) return Status::Ok();
  finished_ = true;
  ThreadBatches& b = t_batches;
  const size_t frame = b.depth - 1;  // this batch is the innermost
  Locating* locating = b.locating.open && b.locating.frame == frame ? &b.locating : nullptr;
  return ReadPending(b.frames[frame], locating);
}

LocateScope::LocateScope(uint64_t min_piece_bytes, size_t max_pieces) : depth_(t_batches.depth) {
  Locating& l = t_batches.locating;
  l.open = true;
  l.frame = depth_;
  l.min_piece_bytes = std::max<uint64_t>(min_piece_bytes, 1);
  l.max_pieces = max_pieces;
  l.pieces.clear();
}

LocateScope::~LocateScope() {
  Locating& l = t_batches.locating;
  l.open = false;
  l.pieces.clear();  // lets go of the files
}

const std::vector<LocatedPiece>& LocateScope::pieces() const { return t_batches.locating.pieces; }

size_t ReadBatch::PendingPieces() {
  return t_batches.depth == 0 ? 0 : t_batches.frames[t_batches.depth - 1].size();
}

Status ReadOrDefer(const ByteSource& src, uint64_t byte_offset, std::span<std::byte> out) {
  ThreadBatches& b = t_batches;
  if (b.depth == 0 || out.empty()) return WithName(src.ReadAt(byte_offset, out), src);
  if (!RangeInside(byte_offset, out.size(), src.Size())) {
    return OutOfRangeError(src.Name() + ": read of " + std::to_string(out.size()) + " bytes at offset " +
                           std::to_string(byte_offset) + " past end (" + std::to_string(src.Size()) + " bytes)");
  }
  b.frames[b.depth - 1].push_back({&src, ReadPiece{byte_offset, out}});
  return Status::Ok();
}

bool LegacyReadPath() {
  static const bool legacy = [] {
    const char* v = std::getenv("UCPFS_READ_PATH");
    return v != nullptr && std::string(v) == "legacy";
  }();
  return legacy;
}

Status FlushReadBatch() {
  return t_batches.depth == 0 ? Status::Ok() : ReadPending(t_batches.frames[t_batches.depth - 1]);
}

Result<std::vector<std::byte>> ReadRange(const ByteSource& src, uint64_t byte_offset,
                                         uint64_t n_bytes, uint64_t max_bytes) {
  if (n_bytes > max_bytes) {
    return ResourceExhaustedError(src.Name() + ": refusing to read " + std::to_string(n_bytes) +
                                  " bytes at offset " + std::to_string(byte_offset) +
                                  " into memory (limit " + std::to_string(max_bytes) + ")");
  }
  if (!RangeInside(byte_offset, n_bytes, src.Size())) {
    return OutOfRangeError(src.Name() + ": range at offset " + std::to_string(byte_offset) +
                           " of " + std::to_string(n_bytes) + " bytes past end of file (" +
                           std::to_string(src.Size()) + " bytes)");
  }
  std::vector<std::byte> out(n_bytes);
  UCPFS_RETURN_IF_ERROR(src.ReadAt(byte_offset, out));
  return out;
}

}  // namespace ucpfs
