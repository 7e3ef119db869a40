// ByteSource: random-access read of an immutable byte sequence (a file, a slice of a file,
// a buffer). All format readers in core/ read through this, so they know no system I/O and
// tests can hand them in-memory or fault-injecting sources.
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

  // What ReadAt of [byte_offset, byte_offset + n_bytes) would read, without reading: the runs
  // of the sources at the bottom (core/source_run.h), in the order the read would fill them.
  // A source that is not built over others (a file, a buffer) reports itself: the default.
  // Sources built over others (slices, lazy views) report the runs of theirs. Errors:
  // kOutOfRange when the range is not inside [0, Size()); kUnsupported when a part cannot tell.
  virtual Status DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const;
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
  uint64_t base_offset() const { return byte_offset_; }

 private:
  SliceSource(std::shared_ptr<const ByteSource> base, uint64_t byte_offset, uint64_t n_bytes);
  std::shared_ptr<const ByteSource> base_;
  uint64_t byte_offset_;
  uint64_t n_bytes_;
  std::string name_;
};

// Reads a whole range into a new vector. Errors as ReadAt; kResourceExhausted above max_bytes.
Result<std::vector<std::byte>> ReadRange(const ByteSource& src, uint64_t byte_offset,
                                         uint64_t n_bytes, uint64_t max_bytes = 1ull << 30);

}  // namespace ucpfs
