// CountingSource: bytes in memory that count the reads made of them (calls and bytes,
// thread-safe) and can fail those touching [fail_lo, fail_hi) with EIO, so a unit test pins
// down a reader's I/O pattern: how many reads, how many bytes, what a failure does.
// Header-only, for tests.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/byte_source.h"

namespace ucpfs::testing {

class CountingSource final : public ByteSource {
 public:
  CountingSource(std::string name, std::vector<std::byte> bytes) : inner_(std::move(name), std::move(bytes)) {}
  uint64_t Size() const override { return inner_.Size(); }
  const std::string& Name() const override { return inner_.Name(); }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override {
    reads_.fetch_add(1, std::memory_order_relaxed);
    bytes_read_.fetch_add(out.size(), std::memory_order_relaxed);
    if (byte_offset < fail_hi && byte_offset + out.size() > fail_lo) {
      return IoError(Name() + ": pread at offset " + std::to_string(byte_offset) + ": EIO", EIO);
    }
    return inner_.ReadAt(byte_offset, out);
  }
  uint64_t reads() const { return reads_.load(std::memory_order_relaxed); }
  uint64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }

  uint64_t fail_lo = 0, fail_hi = 0;  // set before reads begin

 private:
  MemorySource inner_;
  mutable std::atomic<uint64_t> reads_{0};
  mutable std::atomic<uint64_t> bytes_read_{0};
};

}  // namespace ucpfs::testing
