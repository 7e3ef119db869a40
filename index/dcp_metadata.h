// DCP metadata records: one `.metadata` / `__<r>.metadata` pickle read into plain structs.
// The pickled `Metadata` object is walked by class NAME (module paths moved between torch
// versions): state_dict_metadata {fqn: TensorStorageMetadata | BytesStorageMetadata},
// storage_data {MetadataIndex: _StorageInfo}, and Megatron-Core's optional mcore_data.
//
// Not for: opening blobs, checking coverage or building the Checkpoint (dcp_scan.cc does that).
// Untrusted input: the pickle goes through the bounded safe reader; every field's kind is
// checked; negative sizes and offsets are kCorrupt. The torch 1.12 prototype schema
// (ShardedTensorStorageMetadata, storage_key fields, no storage_data) is kUnsupported.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/format/pickle.h"
#include "core/status.h"

namespace ucpfs::index {

struct DcpChunk {
  std::vector<int64_t> offsets;  // in the DCP tensor's global shape
  std::vector<int64_t> sizes;
};

struct DcpEntry {
  std::string fqn;
  bool is_bytes = false;          // BytesStorageMetadata (BYTE_IO)
  DType dtype = DType::kFloat32;  // tensors: TensorProperties.dtype
  std::vector<int64_t> size;      // tensors: global shape (torch.Size)
  std::vector<DcpChunk> chunks;   // tensors: ChunkStorageMetadata in pickle order
};

// storage_data key: MetadataIndex(fqn, offset). has_offsets is false when offset is None or
// absent (BYTE_IO items); a 0-d tensor has offsets == {} with has_offsets true.
struct DcpStorageKey {
  std::string fqn;
  bool has_offsets = false;
  std::vector<int64_t> offsets;
  auto operator<=>(const DcpStorageKey&) const = default;
};

struct DcpStorage {
  std::string relative_path;
  uint64_t byte_offset = 0;
  uint64_t n_bytes = 0;
  // _StorageInfo.transform_descriptors (e.g. "stream.zstd/1"); non-empty means the slice is not
  // a plain torch.save zip.
  std::vector<std::string> transform_descriptors;
};

struct DcpMetadata {
  std::string flavor;                           // "torch-1.13" (_shard.checkpoint) or "torch-2.x"
  std::vector<DcpEntry> entries;                // state_dict_metadata order
  // The keys of planner_data (torch 2.x: flattened key -> path of the saved state dict), in
  // its order, which is the saving state dict's order; state_dict_metadata's order is not
  // (it follows the deduplicated per-rank save plans). Empty when absent.
  std::vector<std::string> saved_order;
  std::map<DcpStorageKey, DcpStorage> storage;  // a repeated key: the last one wins (as in Python)
  // Megatron-Core mcore_data[key]['nd_reformulated_orig_global_shape'].
  std::map<std::string, std::vector<int64_t>> nd_orig_shape;
};

// Parses one metadata pickle. `name` (the file's path) starts every error message.
// Errors: kCorrupt (malformed pickle, root not a Metadata object, a field of the wrong kind, a
// negative size/offset, an unknown dtype), kUnsupported (torch 1.12 prototype schema, unknown
// storage-metadata class), kResourceExhausted (pickle limits).
Result<DcpMetadata> ParseDcpMetadata(std::span<const std::byte> bytes, const std::string& name,
                                     const pickle::PickleLimits& limits = {});

}  // namespace ucpfs::index
