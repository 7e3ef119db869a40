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
// map of strings or null), each dtype (known), each shape (non-negative dims, product bounded),
// each data_offsets pair (b <= e, e - b == numel * item size), and that the tensors' ranges tile
// the data buffer exactly: no overlap, no hole, and the buffer ends where the file ends (what the
// safetensors library itself enforces). Stricter than the library, which keeps the last of
// duplicate keys and ignores unknown fields: both are refused here. The JSON is parsed as a
// stream against the schema (no document tree), so memory is O(tensors) beyond the header's
// own bytes and nesting can never go deeper than the schema's three levels. A dtype safetensors
// knows but ucpfs has no DType for (F4, F6_E2M3, F6_E3M2) is kUnsupported naming the tensor.
// Limits exceeded (header bytes, tensors, rank): kResourceExhausted.
//
// Writer (LazySafetensorsFile): the exact bytes `safetensors.torch.save_file(tensors, path,
// metadata)` writes for the same tensors, computed without reading tensor data: tensors ordered
// by the library's dtype order, descending (U64 I64 F64 C64 F32 U32 I32 BF16 F16 U16 I16
// F8_E5M2FNUZ F8_E4M3FNUZ F8_E8M0 F8_E4M3 F8_E5M2 I8 U8 BOOL), then by name (bytewise); compact
// JSON as serde_json writes it (__metadata__ first, then the tensors in data order, each
// {"dtype","shape","data_offsets"}; non-ASCII raw, control characters escaped); header padded
// with spaces to a multiple of 8; data back to back, no alignment. ReadAt fills tensor bytes
// from the providers. Memory: the header only.
//
// Not for: deciding what a tensor means (index/), I/O (callers hand a ByteSource).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/byte_source.h"
#include "core/dtype.h"
#include "core/format/torch_writer.h"
#include "core/status.h"

namespace ucpfs::format {

struct SafetensorsLimits {
  // The library's own bound; also bounds ParseSafetensorsIndex's text.
  uint64_t max_header_bytes = 100'000'000;
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
  // In data-offset order; empty tensors at one offset first, then by name.
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;   // __metadata__, in file order
};

// The safetensors dtype string ("F32", "BF16", "I64", "BOOL", "F8_E4M3", ...) of `dtype`, or
// empty when safetensors has none (complex32, complex128, quantized).
std::string_view SafetensorsDTypeName(DType dtype);

// Errors: see the file comment; kIo from the source.
Result<SafetensorsHeader> ReadSafetensors(const ByteSource& src, const SafetensorsLimits& limits = {});

// model.safetensors.index.json (Hugging Face): {"metadata": {...}, "weight_map": {name: file}}.
// Returns weight_map in file order. Other top-level keys and whatever "metadata" holds are
// skipped (nesting at most kMaxIndexJsonDepth deep). Errors: kCorrupt naming `source_name` when
// it is not valid JSON of that shape (weight_map present, an object of strings; no duplicate key
// in any object); kResourceExhausted past max_tensors entries, past max_header_bytes of text or
// nested deeper than kMaxIndexJsonDepth.
inline constexpr int kMaxIndexJsonDepth = 64;
Result<std::vector<std::pair<std::string, std::string>>> ParseSafetensorsIndex(
    std::string_view json_text, const std::string& source_name, const SafetensorsLimits& limits = {});

class LazySafetensorsFile final : public ByteSource {
 public:
  // `tensors` in any order (the file orders them as the library does); names must be distinct,
  // non-empty, valid UTF-8 and not "__metadata__"; dtypes must have a SafetensorsDTypeName;
  // shapes non-negative; a provider is needed when the tensor has bytes. `metadata` is written
  // in the order given, keys distinct, all valid UTF-8; empty means metadata=None (no
  // "__metadata__" at all). The library writes metadata from a Rust HashMap, in an order that
  // changes from run to run: byte identity holds for at most one metadata entry.
  // Errors: kInvalidArgument naming the tensor or key (also when the size overflows 64 bits).
  static Result<std::shared_ptr<const LazySafetensorsFile>> Build(
      std::vector<std::pair<std::string, SaveTensor>> tensors,
      std::vector<std::pair<std::string, std::string>> metadata, std::string name);

  uint64_t Size() const override;
  const std::string& Name() const override;
  // Errors: kOutOfRange when the range is not inside [0, Size()); otherwise the first provider
  // error (in byte order), with the tensor's name. Never calls a provider outside its tensor.
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override;
  // The runs of the tensors' providers in the range (the header reads nothing). Errors as
  // ReadAt's, from the providers' DescribeReads.
  Status DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const override;

  // The header bytes (8-byte length + JSON + padding); the data starts right after.
  const std::string& header() const { return header_; }

 private:
  struct Entry {
    std::string name;
    uint64_t byte_offset = 0;  // in the file
    uint64_t n_bytes = 0;      // > 0: tensors without bytes are not entries
    std::shared_ptr<const TensorBytesProvider> provider;
  };
  LazySafetensorsFile() = default;
  std::string name_;
  std::string header_;          // 8-byte length + JSON + padding
  std::vector<Entry> entries_;  // ascending byte_offset, back to back after header_
  uint64_t size_ = 0;
};

// model.safetensors.index.json as Hugging Face writes it (json.dumps(indent=2, sort_keys=True)
// + "\n"): {"metadata": {"total_size": total_n_bytes}, "weight_map": {name: file}}, names
// sorted by code point, everything outside printable ASCII escaped as \uXXXX (ensure_ascii).
// Names should be distinct (a Python dict cannot hold duplicates); bytes that are not UTF-8
// are written as U+FFFD, as core/json_text.h does.
std::string SafetensorsIndexJson(uint64_t total_n_bytes,
                                 const std::vector<std::pair<std::string, std::string>>& weight_map);

}  // namespace ucpfs::format
