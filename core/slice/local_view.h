// Local views: the groundwork for target views (each rank of a new parallel layout gets its
// local tensor, computed lazily from the source fragments; docs/design.md "Data model").
//
// A local tensor is the concatenation, along one dim, of boxes of the global tensor (one box
// for a plain shard, several for Shard-NC such as [Q_r; K_r; V_r] out of a fused [Q; K; V]),
// plus optional zero padding at the end of that dim (vocabulary rows padded to a multiple).
// LocalLayout turns a global TensorLayout into a TensorLayout in the local tensor's own
// coordinates, so the existing PlanRead / ExecutePlan / ReadTensorBytes serve it unchanged.
//
// Not for: deciding which boxes a rank gets (the pattern rules do that), I/O, replica choice
// (remove replicas from the global layout first, as for PlanRead).
// Invariants: pure and deterministic; all offsets and byte offsets overflow-checked; a
// normalized layout reads identically to its input; a local layout built from a global one
// that passes ValidateCoverage passes ValidateCoverage too.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/byte_source.h"
#include "core/dtype.h"
#include "core/slice/slice.h"
#include "core/status.h"

namespace ucpfs::slice {

// The row-major positions [lo, hi) of a box of `box_sizes` as boxes in box-local coordinates
// (offsets from the box's first element), in row-major order: a ragged head, full slabs, a
// ragged tail. At most 2·rank−1 boxes (1 for rank 0), none empty; their volumes sum to hi - lo
// and their union is exactly the range. Requires lo <= hi <= volume of box_sizes and no
// negative size; otherwise (and for an empty range) returns no boxes.
std::vector<Box> FlatRangeToBoxes(const std::vector<int64_t>& box_sizes, uint64_t lo, uint64_t hi);

// Rewrites every fragment as a plain box fragment with explicit stored strides, reading
// identically:
// - a flat-range fragment becomes the boxes of FlatRangeToBoxes, each with the parent box's
//   row-major strides (flat ranges are stored 1-D contiguous) and the byte offset of its own
//   first element;
// - a whole-box fragment keeps its strides; empty strides become explicit row-major ones;
// - fragments holding no element are dropped. Fragment order otherwise follows the input.
// After this, every fragment has flat_lo == 0, flat_hi == box volume and strides.size() ==
// rank, so the stored element at box-local index i lies at byte_offset + Σ i[d]·strides[d]·
// ItemSize(dtype). Coverage is not checked (replicas stay replicas).
// Errors: kCorrupt naming the fragment: wrong rank, box outside the shape, flat range outside
// the box, invalid dtype, strides of wrong rank or negative, byte offsets that overflow.
Result<TensorLayout> NormalizeFragments(const TensorLayout& layout);

// The layout, in local coordinates, of the tensor of `local_shape` that concatenates the global
// boxes `pieces` along `cat_dim` (in order), followed by zero padding to local_shape[cat_dim].
// Each piece must have the global rank, lie inside the global shape, and match local_shape in
// every dim but cat_dim; the pieces' extents along cat_dim may sum to less than
// local_shape[cat_dim]: the remainder at the end is covered by one kZeroFileId fragment.
// Fragments are the intersections of the normalized global fragments with each piece,
// translated (relative to the piece, plus the piece's position along cat_dim), with the global
// fragment's file, dtype and strides and the byte offset of the intersection's first element.
// A 0-d tensor takes exactly one piece with no dims (cat_dim is ignored).
// If `global` passes ValidateCoverage without replicas, the result does too.
// Errors: kInvalidArgument naming the problem (rank mismatch, cat_dim out of range, piece
// outside the global shape, piece not matching local_shape, pieces exceeding local_shape,
// negative sizes); NormalizeFragments's kCorrupt.
Result<TensorLayout> LocalLayout(const TensorLayout& global, const std::vector<int64_t>& local_shape,
                                 int cat_dim, const std::vector<Box>& pieces);

// Reads bytes [byte_offset, byte_offset + out.size()) of a 1-D virtual tensor: the row-major
// contents of each layout in `parts`, converted to `dst`, concatenated, then zeros up to
// padded_n_elems elements (ZeRO-1 flat partitions: each DP rank's partition is a byte window of
// this). All parts read from the one file table. Never partial success.
// Errors: kInvalidArgument (a null part, invalid dst, padded_n_elems smaller than the parts'
// elements), kOutOfRange (window past padded_n_elems · ItemSize(dst) bytes), and whatever
// ReadTensorBytes returns for a part (the first in byte order).
Status ReadConcatBytes(const std::vector<const TensorLayout*>& parts, DType dst,
                       uint64_t padded_n_elems,
                       std::span<const std::shared_ptr<const ByteSource>> files,
                       uint64_t byte_offset, std::span<std::byte> out);

// A hint that ReadConcatBytes of [byte_offset, byte_offset + n_bytes) comes soon: each part's
// range announced (PrefetchTensorBytes). Never fails; a bad window is ignored.
void PrefetchConcatBytes(const std::vector<const TensorLayout*>& parts, DType dst, uint64_t padded_n_elems,
                         std::span<const std::shared_ptr<const ByteSource>> files, uint64_t byte_offset,
                         uint64_t n_bytes);

// What ReadConcatBytes of the same window reads, without reading (DescribeTensorReads per part;
// the trailing padding as zero fill). Errors as ReadConcatBytes's.
Status DescribeConcatReads(const std::vector<const TensorLayout*>& parts, DType dst, uint64_t padded_n_elems,
                           std::span<const std::shared_ptr<const ByteSource>> files, uint64_t byte_offset,
                           uint64_t n_bytes, const SourceRunSink& sink);

// Reads the sub-box `box` (offsets and sizes in the global shape) of the tensor `global`,
// row-major in `dst`, into `out` (exactly the box's elements · ItemSize(dst) bytes): the box as
// a one-piece LocalLayout, then ReadTensorBytes, so only the source bytes inside the box are
// read (of a flat-range fragment, only its elements in the box). What a reader of chunks of a
// consolidated tensor (torch.distributed.checkpoint's ReadItems: python/) calls.
// Errors: kInvalidArgument (rank mismatch, a negative size, `out` of another size, a box outside
// the shape: LocalLayout's), ReadTensorBytes's (the first failing read, naming the file).
Status ReadBoxBytes(const TensorLayout& global, const Box& box, DType dst,
                    std::span<const std::shared_ptr<const ByteSource>> files, std::span<std::byte> out);

}  // namespace ucpfs::slice
