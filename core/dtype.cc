#include "core/dtype.h"

namespace ucpfs {
namespace {

struct DTypeInfo {
  DType dtype;
  uint32_t item_size;
  std::string_view torch_name;
  std::string_view storage_class;  // empty: no legacy typed storage
};

constexpr DTypeInfo kTable[] = {
    {DType::kFloat64, 8, "float64", "DoubleStorage"},
    {DType::kFloat32, 4, "float32", "FloatStorage"},
    {DType::kFloat16, 2, "float16", "HalfStorage"},
    {DType::kBFloat16, 2, "bfloat16", "BFloat16Storage"},
    {DType::kInt64, 8, "int64", "LongStorage"},
    {DType::kInt32, 4, "int32", "IntStorage"},
    {DType::kInt16, 2, "int16", "ShortStorage"},
    {DType::kInt8, 1, "int8", "CharStorage"},
    {DType::kUInt8, 1, "uint8", "ByteStorage"},
    {DType::kBool, 1, "bool", "BoolStorage"},
    {DType::kComplex32, 4, "complex32", ""},
    {DType::kComplex64, 8, "complex64", "ComplexFloatStorage"},
    {DType::kComplex128, 16, "complex128", "ComplexDoubleStorage"},
    {DType::kUInt16, 2, "uint16", ""},
    {DType::kUInt32, 4, "uint32", ""},
    {DType::kUInt64, 8, "uint64", ""},
    {DType::kFloat8E5M2, 1, "float8_e5m2", ""},
    {DType::kFloat8E4M3FN, 1, "float8_e4m3fn", ""},
    {DType::kFloat8E5M2Fnuz, 1, "float8_e5m2fnuz", ""},
    {DType::kFloat8E4M3Fnuz, 1, "float8_e4m3fnuz", ""},
    {DType::kFloat8E8M0Fnu, 1, "float8_e8m0fnu", ""},
    {DType::kQInt8, 1, "qint8", "QInt8Storage"},
    {DType::kQUInt8, 1, "quint8", "QUInt8Storage"},
    {DType::kQInt32, 4, "qint32", "QInt32Storage"},
};
static_assert(sizeof(kTable) / sizeof(kTable[0]) == kNumDTypes);

const DTypeInfo& Info(DType dtype) { return kTable[static_cast<int>(dtype)]; }

}  // namespace

uint32_t ItemSize(DType dtype) { return Info(dtype).item_size; }
std::string_view TorchName(DType dtype) { return Info(dtype).torch_name; }
std::string_view StorageClassName(DType dtype) { return Info(dtype).storage_class; }

std::optional<DType> DTypeFromTorchName(std::string_view name) {
  for (const auto& info : kTable) {
    if (info.torch_name == name) return info.dtype;
  }
  // Aliases torch also pickles under.
  if (name == "float" ) return DType::kFloat32;
  if (name == "double") return DType::kFloat64;
  if (name == "half") return DType::kFloat16;
  if (name == "long") return DType::kInt64;
  if (name == "int") return DType::kInt32;
  if (name == "short") return DType::kInt16;
  if (name == "cfloat") return DType::kComplex64;
  if (name == "cdouble") return DType::kComplex128;
  return std::nullopt;
}

std::optional<DType> DTypeFromStorageClassName(std::string_view name) {
  if (name.empty()) return std::nullopt;
  for (const auto& info : kTable) {
    if (info.storage_class == name) return info.dtype;
  }
  return std::nullopt;
}

}  // namespace ucpfs
