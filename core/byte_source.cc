#include "core/byte_source.h"

#include <cstring>

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
