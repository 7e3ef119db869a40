// Torch dtypes: element sizes, torch names ("bfloat16") and legacy storage class names
// ("BFloat16Storage"). Pure table lookups; no torch needed.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace ucpfs {

enum class DType : uint8_t {
  kFloat64, kFloat32, kFloat16, kBFloat16,
  kInt64, kInt32, kInt16, kInt8, kUInt8, kBool,
  kComplex32, kComplex64, kComplex128,
  kUInt16, kUInt32, kUInt64,
  kFloat8E5M2, kFloat8E4M3FN, kFloat8E5M2Fnuz, kFloat8E4M3Fnuz, kFloat8E8M0Fnu,
  kQInt8, kQUInt8, kQInt32,
};

inline constexpr int kNumDTypes = static_cast<int>(DType::kQInt32) + 1;

// Size in bytes of one element.
uint32_t ItemSize(DType dtype);

// torch's name without "torch.", e.g. "float32", "bfloat16", "float8_e4m3fn".
std::string_view TorchName(DType dtype);
std::optional<DType> DTypeFromTorchName(std::string_view name);

// Legacy typed-storage class name ("FloatStorage"), or empty for dtypes that only have the
// untyped-storage + _rebuild_tensor_v3 encoding (float8, uint16/32/64, complex32).
std::string_view StorageClassName(DType dtype);
std::optional<DType> DTypeFromStorageClassName(std::string_view name);

}  // namespace ucpfs
