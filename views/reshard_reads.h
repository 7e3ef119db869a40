// Reshard reads: which source files feed which ranks of a target layout, and how many bytes,
// without reading any (`ucpfs plan`). Each rank file of the layout (model.pt, optim.pt,
// extra_state.pt) describes the runs its lazy tensors would read (ByteSource::DescribeReads ->
// LazyTorchFile -> LayoutProvider / ConcatProvider -> slice::DescribeTensorReads over the same
// PlanRead the reads execute), and they are added up per source file.
//
// Not for: I/O, naming source files (the caller holds the names of its file table), drawing.
// Counts are exact element bytes: a view that reads a quarter of a shard counts a quarter of
// it; a strided run (a source chunk stored transposed) counts its elements, although the read
// fetches the span they lie in.
// Invariants: for each rank file, the bytes its runs fill (read or zero) equal its tensor
// payload (checked: kInternal otherwise); per source file, read_n_bytes is the sum over ranks,
// distinct_n_bytes <= the source's size.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/status.h"
#include "views/target.h"

namespace ucpfs::views {

struct RankFileReads {
  std::string name;               // "model.pt", "optim.pt", "extra_state.pt"
  uint64_t file_n_bytes = 0;      // the whole file (pickle, zip headers and tensor data)
  uint64_t payload_n_bytes = 0;   // its tensor data
  uint64_t zero_n_bytes = 0;      // tensor data filled with zeros (padding; a state the source lacks)
  uint64_t converted_n_bytes = 0; // tensor data read in another dtype (its bytes read differ)
  std::vector<uint64_t> read_n_bytes;  // per source file id: bytes read from it
};

struct RankReads {
  int rank = 0;
  std::vector<RankFileReads> files;  // the rank's files that exist, in the order above
  std::vector<uint64_t> read_n_bytes;  // per source file id, summed over the files
  uint64_t ReadTotal() const;
  uint64_t FileTotal() const;     // sum of file_n_bytes
  uint64_t PayloadTotal() const;  // sum of payload_n_bytes
};

struct SourceReads {
  uint64_t read_n_bytes = 0;      // summed over ranks (a byte read by k ranks counts k times)
  uint64_t distinct_n_bytes = 0;  // bytes of the file read by at least one rank
  bool distinct_exact = true;     // false: a long strided run counted its whole span (an upper bound)
  int fan_out = 0;                // ranks that read from it
};

struct ReshardReads {
  std::string layout;
  std::vector<RankReads> ranks;      // 0 .. World()-1
  std::vector<SourceReads> sources;  // per source file id
  uint64_t ReadTotal() const;
  uint64_t FileTotal() const;
  uint64_t PayloadTotal() const;
};

// Builds every rank's files of `plan` (TargetPlan::Build: sizes and headers only) and adds up
// what they read from `files` (the file table the plan's input was made with: its entries must
// be the sources at the bottom, as index::OpenFileTable's are). Errors: TargetPlan::Build's
// (with the rank); kUnsupported from a tensor that cannot describe its reads; kInternal when a
// run names a source outside `files` or a rank file's runs do not fill its payload exactly.
Result<ReshardReads> ComputeReshardReads(const TargetPlan& plan,
                                         std::span<const std::shared_ptr<const ByteSource>> files);

}  // namespace ucpfs::views
