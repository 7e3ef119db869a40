// safetensors: the reader that distrusts the file, and the lazy writer of byte-identical files.
//
// The format (https://github.com/huggingface/safetensors, version 0.8 as installed by
// tests/requirements.txt): 8 bytes little-endian u64 N, then N bytes of UTF-8 JSON
// {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]},
// ...} (padded with spaces to a multiple of 8 by the writer), then the data buffer; offsets are
// relative to the buffer's start. Tensors are row-major, little-endian.
//
// Reader (ReadSafetensors): checks, each with overflow-checked arithmetic, and refuses with
// kCorrupt naming the file, the tensor and the reason: the header length (>= 2, at most
// SafetensorsLimits::max_header_bytes and inside the file), the JSON (valid UTF-8 text, an object
// of objects, no duplicate names, exactly the fields dtype/shape/data_offsets, __metadata__ a
// map of strings), each dtype (known), each shape (non-negative dims, product bounded), each
// data_offsets pair (b <= e, e - b == numel * item size), and that the tensors' ranges tile the
// data buffer exactly: no overlap, no hole, and the buffer ends where the file ends (what the
// safetensors library itself enforces). A dtype safetensors knows but torch files cannot carry
// here (F4, F6_*, C64...) is kUnsupported naming the tensor. Limits exceeded: kResourceExhausted.
//
// Writer (LazySafetensorsFile): the exact bytes `safetensors.torch.save_file(tensors, path,
// metadata)` writes for the same tensors (the library's tensor order: by dtype alignment, then
// by name; compact JSON; header padded with spaces to a multiple of 8), computed without reading
// tensor data; ReadAt fills tensor bytes from the providers. Memory: the header only.
//
// Not for: deciding what a tensor means (index/), I/O (callers hand a ByteSource).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/byte_source.h"
#include "core/dtype.h"
#include "core/format/torch_writer.h"
#include "core/status.h"

namespace ucpfs::format {

struct SafetensorsLimits {
  uint64_t max_header_bytes = 100'000'000;  // the safetensors library's own bound
  uint64_t max_tensors = 1u << 20;
  uint32_t max_rank = 64;
};

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;   // empty: 0-d
  uint64_t byte_offset = 0;     // absolute, in the file
  uint64_t n_bytes = 0;
};

struct SafetensorsHeader {
  uint64_t header_n_bytes = 0;        // N (the JSON's length, padding included)
  uint64_t data_byte_offset = 0;      // 8 + N
  std::vector<SafetensorsTensor> tensors;                      // in data-offset order
  std::vector<std::pair<std::string, std::string>> metadata;   // __metadata__, in file order
};

// The safetensors dtype string ("F32", "BF16", "I64", "BOOL", "F8_E4M3", ...) of `dtype`, or
// empty when safetensors has none (complex32, quantized).
std::string_view SafetensorsDTypeName(DType dtype);

// Errors: see the file comment; kIo from the source.
Result<SafetensorsHeader> ReadSafetensors(const ByteSource& src, const SafetensorsLimits& limits = {});

// model.safetensors.index.json (Hugging Face): {"metadata": {...}, "weight_map": {name: file}}.
// Returns weight_map in file order. Errors: kCorrupt naming `source_name` when it is not that
// shape (weight_map values must be strings; names unique); kResourceExhausted past max_tensors.
Result<std::vector<std::pair<std::string, std::string>>> ParseSafetensorsIndex(
    std::string_view json_text, const std::string& source_name, const SafetensorsLimits& limits = {});

class LazySafetensorsFile final : public ByteSource {
 public:
  // `tensors` in any order (the file orders them as the library does); names must be distinct
  // and non-empty, dtypes must have a SafetensorsDTypeName, `metadata` in the order given (the
  // library writes a map: pass at most one entry, or sorted entries, for byte identity).
  // Errors: kInvalidArgument naming the tensor.
  static Result<std::shared_ptr<const LazySafetensorsFile>> Build(
      std::vector<std::pair<std::string, SaveTensor>> tensors,
      std::vector<std::pair<std::string, std::string>> metadata, std::string name);

  uint64_t Size() const override;
  const std::string& Name() const override;
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;

 private:
  struct Entry;
  LazySafetensorsFile() = default;
  std::string name_;
  std::string header_;  // 8-byte length + JSON + padding
  std::vector<std::pair<uint64_t, SaveTensor>> data_;  // (byte offset in the file, tensor), ascending
  uint64_t size_ = 0;
};

// model.safetensors.index.json as Hugging Face writes it (json.dumps(indent=2, sort_keys=True)
// + "\n"): {"metadata": {"total_size": total_n_bytes}, "weight_map": {name: file}}.
std::string SafetensorsIndexJson(uint64_t total_n_bytes,
                                 const std::vector<std::pair<std::string, std::string>>& weight_map);

}  // namespace ucpfs::format
