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
struct ThreadBatches {
  std::vector<std::vector<Deferred>> frames;  // frames[0, depth) are open, innermost last
  size_t depth = 0;
};
thread_local ThreadBatches t_batches;

Status WithName(Status s, const ByteSource& src) {
  if (!s.ok() && s.message().find(src.Name()) == std::string::npos) return s.WithContext(src.Name());
  return s;
}

// Reads everything `frame` holds, each source's pieces as one batch, and clears it. The first
// error in deferral order wins: every source is read (their pieces are independent), then the
// failure with the smallest index is returned. A source may be a view whose read opens a batch
// of its own: nothing here refers into the thread's frames while a source reads.
Status ReadPending(std::vector<Deferred>& frame) {
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
  return ReadPending(t_batches.frames[t_batches.depth - 1]);  // this batch is the innermost
}

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
