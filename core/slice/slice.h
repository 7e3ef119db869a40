// Slice algebra and copy planning: which bytes of which source file hold global elements
// [a, b) of a tensor (docs/design.md "Data model").
//
// A tensor has a global shape (row-major). Its stored pieces are Fragments: a Box in the
// global shape, optionally restricted to a flat range [flat_lo, flat_hi) of the box's own
// row-major order (ZeRO / Megatron flattened_range shards), plus where the box's elements are
// stored: a file id, the byte offset of the fragment's first element, the stored dtype and the
// stored element strides (a DCP chunk may be stored non-row-major, e.g. transposed).
//
// Pure logic: no I/O here. Reading goes through PlanRead (element runs -> CopyOps) and
// ExecutePlan (CopyOps + a file table -> bytes, with dtype conversion).
// Invariants: all element counts and byte offsets are overflow-checked; a plan covers each
// requested target element exactly once; plans are deterministic.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/dtype.h"
#include "core/status.h"

namespace ucpfs::slice {

// A Fragment or CopyOp with this file_id stores nothing: its elements read as zeros in any
// destination dtype (all-zero bytes; no conversion check, no file table entry). Target views
// use it for padding that is part of the tensor (e.g. vocabulary rows padded to a multiple).
// ValidateCoverage counts it like any fragment.
inline constexpr uint32_t kZeroFileId = 0xFFFFFFFFu;

// An axis-aligned box in a row-major view: offsets[i] + [0, sizes[i]) along dim i.
// A 0-d box (no dims) holds one element.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;

  uint64_t Volume() const;  // product of sizes (1 for 0-d)
  bool operator==(const Box&) const = default;
};

// Intersection of two boxes of the same rank; empty optional-like result via `ok` flag.
// Returns false when they do not intersect (or a size is 0).
bool Intersect(const Box& a, const Box& b, Box* out);

// Another stored copy of a fragment's (or copy op's) elements, for a value that is the
// elementwise mean of N stored copies (DeepSpeed's parameter_to_average_patterns, which
// ds_to_universal merges as sum(slices) / len(slices)). The copy has the same element layout
// as its fragment (box, flat range, strides) and lies at its own byte offset in its own file
// and dtype.
struct MeanPart {
  uint32_t file_id = 0;
  uint64_t byte_offset = 0;  // where this copy's element at the fragment's first position lies
  DType dtype = DType::kFloat32;
  bool operator==(const MeanPart&) const = default;
};

// Moves each copy's byte offset forward by n_elems of its own dtype (a sub-range of the fragment).
void ShiftMeanParts(std::vector<MeanPart>& parts, uint64_t n_elems);

struct Fragment {
  Box box;                    // in the tensor's global shape
  uint64_t flat_lo = 0;       // restriction to [flat_lo, flat_hi) of the box's row-major order
  uint64_t flat_hi = 0;       // == box.Volume() for a whole box
  uint32_t file_id = 0;       // index into the caller's file table, or kZeroFileId
  uint64_t byte_offset = 0;   // where the stored element at flat position flat_lo lies
  DType dtype = DType::kFloat32;  // stored dtype (may differ from the tensor's, e.g. bf16 vs fp32 target)
  // Stored element strides per box dim; empty = row-major contiguous. Must be empty when
  // the fragment is a flat-range restriction (flat ranges are stored as 1-D contiguous).
  std::vector<int64_t> strides;
  // Empty: the stored elements are the value. Else the value is their elementwise mean with
  // these N-1 other copies, computed in float32 as torch computes sum(slices) / len(slices):
  // ((0 + own) + mean_with[0] + ...) / N, then converted to the destination dtype.
  std::vector<MeanPart> mean_with;

  uint64_t NumElems() const { return flat_hi - flat_lo; }
};

struct TensorLayout {
  std::vector<int64_t> shape;   // global shape
  std::vector<Fragment> fragments;
  uint64_t NumElems() const;    // product of shape
};

// Checks that the fragments cover every element of `shape` exactly once: right rank, boxes
// inside the shape, flat ranges inside their box, no element covered twice, none uncovered.
// Identical duplicates (same box and flat range: replicas) are reported through `replicas`
// (pairs of fragment indices) instead of failing, so the caller can verify their bytes and
// drop one. Errors: kCorrupt with `what` (e.g. the tensor name) and the offending region.
Status ValidateCoverage(const TensorLayout& layout, const std::string& what,
                        std::vector<std::pair<size_t, size_t>>* replicas = nullptr);

// One copy: n_elems elements from file `file_id`, starting at src_byte_offset and stepping
// src_elem_stride elements (1 = contiguous), converted from src_dtype to dst_dtype, written
// contiguously at dst_byte_offset (relative to the start of the planned range).
struct CopyOp {
  uint32_t file_id = 0;  // kZeroFileId: the destination range is zero-filled, nothing is read
  uint64_t src_byte_offset = 0;
  int64_t src_elem_stride = 1;
  DType src_dtype = DType::kFloat32;
  DType dst_dtype = DType::kFloat32;
  uint64_t dst_byte_offset = 0;
  uint64_t n_elems = 0;
  // The other copies this run is averaged with (Fragment::mean_with), each at this run's first
  // element and stepping src_elem_stride; never coalesced with a neighbouring run.
  std::vector<MeanPart> mean_with;
};

// Plans elements [elem_lo, elem_hi) of the tensor's row-major data, written in dst_dtype:
// the op for global element e writes at (e - elem_lo) * ItemSize(dst_dtype). Adjacent runs
// contiguous in both source and destination (same file, same dtypes) are coalesced. Touches
// only fragments that intersect the range. Fragments listed as replicas of an earlier one must
// have been removed by the caller. Errors: kOutOfRange (range past the tensor), kCorrupt (an
// element no fragment covers), kUnsupported (a dtype conversion CanConvert refuses).
Result<std::vector<CopyOp>> PlanRead(const TensorLayout& layout, DType dst_dtype, uint64_t elem_lo,
                                     uint64_t elem_hi);

// Converts n elements from src to dst dtype. Supported: identity for every dtype; among
// float64/float32/float16/bfloat16 in any direction (round-to-nearest-even when narrowing);
// integer and bool dtypes to float32/float64. Errors: kUnsupported.
Status ConvertElements(DType src, DType dst, const std::byte* in, std::byte* out, uint64_t n);
bool CanConvert(DType src, DType dst);

// Runs a plan against a table of source files; `out` receives the planned elements
// (n_elems of the range * ItemSize(dst)). Source reads are issued as large contiguous requests
// (a strided op reads its spanned range once, in bounded pieces). Errors: the first failing
// read in destination byte order (with the file's name), or a conversion error; never partial
// success.
Status ExecutePlan(std::span<const CopyOp> ops,
                   std::span<const std::shared_ptr<const ByteSource>> files,
                   std::span<std::byte> out);

// Reads bytes [byte_offset, byte_offset + out.size()) of the tensor's row-major data in
// dst_dtype: plans the enclosing elements and executes the plan (through a small bounce buffer
// for a partial first or last element). This is what a TensorBytesProvider calls.
// A hint for ReadTensorBytes of the same range (ByteSource::Prefetch): tells each source file
// which byte ranges that read will touch, one hint per run of nearby bytes (strided runs: their
// whole extent). Errors are ignored: the read reports them.
void PrefetchTensorBytes(const TensorLayout& layout, DType dst_dtype,
                         std::span<const std::shared_ptr<const ByteSource>> files, uint64_t byte_offset,
                         uint64_t n_bytes);

// What ReadTensorBytes of the same range reads, without reading (ByteSource::DescribeReads):
// one SourceRun per planned copy, in destination order, naming the file table's entry
// (files[file_id], not what it is built over) or no file for zero fill; an averaged copy op adds
// one run per other copy (Fragment::mean_with), right after it, filling nothing. A partial first or last
// element counts whole, as the read plans it. Planned in bounded pieces, so memory stays small
// for any tensor. Errors: kInvalidArgument (invalid dst dtype, a file id outside `files`),
// kOutOfRange (range past the tensor), PlanRead's.
Status DescribeTensorReads(const TensorLayout& layout, DType dst_dtype,
                           std::span<const std::shared_ptr<const ByteSource>> files, uint64_t byte_offset,
                           uint64_t n_bytes, const SourceRunSink& sink);

// `plans` (may be null): the tensor's cached plan (plan_cache.h), used instead of planning when
// it has one. Plain reads (no conversion, no gather) go out through ReadOrDefer: inside a
// ReadBatch they are read when it finishes, together with the rest of the view read.
Status ReadTensorBytes(const TensorLayout& layout, DType dst_dtype,
                       std::span<const std::shared_ptr<const ByteSource>> files,
                       uint64_t byte_offset, std::span<std::byte> out, const class PlanCache* plans = nullptr);

}  // namespace ucpfs::slice
