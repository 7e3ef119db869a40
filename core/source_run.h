// SourceRun: one run of stored elements that reading a lazy view would read, described without
// reading it (ByteSource::DescribeReads). `ucpfs plan` adds them up per source file to show what
// a target layout reads.
//
// Not for: I/O or scheduling (ByteSource::Prefetch is the hint for that; it merges nearby runs,
// this never does).
// Invariants: a run is exact: n_elems elements of src_item_n_bytes, the first at byte_offset of
// `file`, each elem_stride elements after the one before (1: contiguous); they become n_elems
// elements of dst_item_n_bytes in the view. A run with no file is zero fill (nothing read). A run
// with dst_item_n_bytes 0 is read to be combined into another run's elements (the other copies of
// an averaged fragment, slice::Fragment::mean_with): it fills nothing itself.
#pragma once

#include <cstdint>
#include <functional>

namespace ucpfs {

class ByteSource;

struct SourceRun {
  const ByteSource* file = nullptr;  // the source read (a leaf: no ByteSource below it); null: zeros
  uint64_t byte_offset = 0;          // of the first element in `file`
  uint64_t n_elems = 0;
  int64_t elem_stride = 1;           // in elements; 1: contiguous
  uint32_t src_item_n_bytes = 1;     // stored element size
  uint32_t dst_item_n_bytes = 1;     // element size in the view (differs when converted; 0: see above)

  // Bytes the run reads from `file` (n_elems · src_item_n_bytes; 0 for zeros).
  uint64_t ReadBytes() const { return file == nullptr ? 0 : n_elems * src_item_n_bytes; }
  // Bytes the run fills in the view.
  uint64_t ViewBytes() const { return n_elems * dst_item_n_bytes; }
};

using SourceRunSink = std::function<void(const SourceRun&)>;

}  // namespace ucpfs
