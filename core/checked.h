// Overflow-checked integer arithmetic for sizes and offsets read from untrusted files.
// Every size, count and offset that comes from a file goes through these before use.
#pragma once

#include <cstdint>
#include <optional>

namespace ucpfs {

// a + b, or nullopt on unsigned 64-bit overflow.
inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// a * b, or nullopt on unsigned 64-bit overflow.
inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// True when [offset, offset + length) lies inside [0, size).
inline bool RangeInside(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

}  // namespace ucpfs
