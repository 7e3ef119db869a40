// TorchFile: a torch.save file opened for inspection. Reads the zip directory, parses
// data.pkl with the safe pickle reader, and resolves every tensor in the object graph to the
// exact bytes it occupies in the file: (storage record, absolute byte offset of the first
// element, dtype, shape, strides, storage offset).
//
// torch's legacy format (no zip: torch.save(..., _use_new_zipfile_serialization=False), torch
// before 1.6) is read too: its storages become stored records "data/<key>" at their exact
// offsets (archive(), no prefix), each one's element count, written before its bytes, checked
// against the pickle. A storage that is a view of another (legacy persistent ids with view
// metadata) is kUnsupported.
//
// Not for: loading tensor data (callers read the bytes they need through the ByteSource).
// Invariants: every reported tensor's strided extent lies inside its storage record, and every
// storage record lies inside the file; storage records must be STORED (uncompressed), else
// resolution fails with kUnsupported naming the record. Walks are iterative-safe: depth is
// bounded and cycles are cut.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/dtype.h"
#include "core/format/pickle.h"
#include "core/format/zip_reader.h"
#include "core/status.h"

namespace ucpfs::format {

struct TensorRecord {
  std::string key;            // dot-joined path into the object graph: dict keys, list/tuple indices
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;      // in elements
  int64_t storage_offset = 0;       // in elements
  std::string storage_key;          // "0" -> record "<prefix>/data/0"
  std::string record_name;          // full zip entry name of the storage
  uint64_t record_offset = 0;       // absolute byte offset of the storage's first byte
  uint64_t record_n_bytes = 0;      // size of the storage record
  uint64_t data_offset = 0;         // absolute byte offset of the tensor's first element
  uint64_t n_elems = 0;             // product of shape
  uint64_t n_bytes = 0;             // n_elems * ItemSize(dtype)
  bool contiguous = true;           // row-major contiguous (bytes are [data_offset, +n_bytes))
  bool is_parameter = false;
};

struct TorchFileLimits {
  pickle::PickleLimits pickle;
  uint64_t max_pickle_bytes = 1ull << 30;
  uint32_t max_walk_depth = 256;
  ZipLimits zip;
};

class TorchFile {
 public:
  // Errors: those of ZipArchive::Open and ParsePickle; kCorrupt when data.pkl is missing or a
  // tensor's storage record is missing, has the wrong size for its numel, or a tensor's
  // extent leaves its storage; kUnsupported for compressed storage records, non-'storage'
  // persistent ids or negative strides. Messages start with the file name.
  static Result<TorchFile> Open(std::shared_ptr<const ByteSource> src,
                                const TorchFileLimits& limits = {});

  const ByteSource& source() const { return *src_; }
  bool legacy() const { return legacy_; }  // torch's legacy format (no zip, no checksums)
  const ZipArchive& archive() const { return archive_; }
  const pickle::PickleGraph& graph() const { return graph_; }
  // Tensors in object-graph order (pickle order); a tensor reachable by two paths is listed
  // under each path.
  const std::vector<TensorRecord>& tensors() const { return tensors_; }

 private:
  std::shared_ptr<const ByteSource> src_;
  ZipArchive archive_;
  pickle::PickleGraph graph_;
  std::vector<TensorRecord> tensors_;
  bool legacy_ = false;
};

// Whether `src` begins as torch's legacy format does (the magic number's pickle).
bool IsLegacyTorchFile(const ByteSource& src);
// Whether `src` begins as a torch.save file does: a zip's first local header, or the legacy
// format's magic number. False for a file too short or unreadable there.
bool LooksLikeTorchFile(const ByteSource& src);

// Resolves one tensor node (kind kTensor) against the archive. `key` is copied into the
// result. Exposed for DCP scanning, which resolves tensors inside slices of .distcp files.
Result<TensorRecord> ResolveTensor(const ByteSource& src, const ZipArchive& archive,
                                   const pickle::PickleGraph& graph, pickle::NodeId tensor,
                                   std::string key);

}  // namespace ucpfs::format
