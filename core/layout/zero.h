// ZeRO partition arithmetic (docs/formats.md "ZeRO partitions"), usable in both directions:
// from a parameter to the pieces each data-parallel rank stores (reading a DeepSpeed source,
// writing a target ZeRO view), and from a rank's stored window back to the parameters in it.
// Pure integer math, overflow-checked; no I/O.
//
// ZeRO-1/2 and BF16_Optimizer, per optimizer param group: the group's parameters are flattened
// and concatenated in order (no per-parameter alignment), zeros are appended to a multiple of
// alignment_factor * dp (DeepSpeed's nccl_start_alignment_factor is 2), and rank d holds the
// window [d * ps, (d + 1) * ps) of ps = padded / dp elements. A parameter overlapping that
// window is one fragment there: DeepSpeed's fragment_address(start = offset inside the window,
// numel). The padding (group_paddings) lies in the last window(s) only.
//
// ZeRO-3, per parameter: pn = ceil(numel / dp); the parameter is padded with zeros to pn * dp and
// rank d holds elements [d * pn, (d + 1) * pn), of which max(0, min(pn, numel - d * pn)) are real
// (a small parameter leaves the last ranks nothing real). A rank's flat buffer of one sub-group
// is the concatenation of those pn-element slices in parameter order; sub-groups close when the
// running sum of pn reaches sub_group_size, or at the last parameter.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"

namespace ucpfs::layout {

inline constexpr uint64_t kZeroAlignmentFactor = 2;  // DeepSpeed's nccl_start_alignment_factor

// One optimizer param group's flat buffer under ZeRO-1/2.
struct ZeroFlatGroup {
  int dp = 1;
  std::vector<uint64_t> param_starts;  // element offset of each parameter in the flat buffer
  std::vector<uint64_t> param_numels;
  uint64_t total_elems = 0;      // sum of param_numels
  uint64_t padded_elems = 0;     // total rounded up to a multiple of alignment_factor * dp
  uint64_t partition_elems = 0;  // ps = padded / dp: what every rank stores

  // The window of rank d: [d * ps, (d + 1) * ps).
  uint64_t WindowStart(int dp_rank) const { return partition_elems * static_cast<uint64_t>(dp_rank); }
  // Padding elements inside rank d's window (DeepSpeed's group_paddings[d]): ps when the window
  // lies wholly past the parameters, the tail past them in the window holding their end, else 0.
  uint64_t PaddingOf(int dp_rank) const;
};

// Errors: kInvalidArgument when dp < 1, alignment_factor < 1, or a size overflows.
Result<ZeroFlatGroup> MakeZeroFlatGroup(std::span<const uint64_t> param_numels, int dp,
                                        uint64_t alignment_factor = kZeroAlignmentFactor);

// One stored piece: elements [param_elem_offset, +n_elems) of a parameter sit at
// partition_elem_offset in rank dp_rank's stored window (for ZeRO-3: in its slice of that
// parameter).
struct ZeroFragment {
  int dp_rank = 0;
  uint64_t param_elem_offset = 0;
  uint64_t partition_elem_offset = 0;
  uint64_t n_elems = 0;
  bool operator==(const ZeroFragment&) const = default;
};

// Parameter -> pieces: the fragments of parameter `index` of `group`, in rank order (their
// param_elem_offset ranges tile [0, numel)); an empty parameter has none.
std::vector<ZeroFragment> FragmentsOfParam(const ZeroFlatGroup& group, size_t index);

// Window -> parameters: the fragments stored in rank d's window, in flat order, with the
// parameter index of each (DeepSpeed's param_slice_mappings of that rank).
struct IndexedFragment {
  size_t param = 0;
  ZeroFragment fragment;
};
std::vector<IndexedFragment> FragmentsInWindow(const ZeroFlatGroup& group, int dp_rank);

// ZeRO-3: the elements of a parameter each rank stores (pn, padded with zeros past numel).
uint64_t Zero3PartitionElems(uint64_t numel, int dp);
// The real (unpadded) part of rank d's slice; n_elems 0 when it holds only padding.
ZeroFragment Zero3FragmentOf(uint64_t numel, int dp, int dp_rank);

// ZeRO-3 sub-groups: half-open ranges [first, last) of parameter indices, given each
// parameter's partition size pn (Zero3PartitionElems) in order. A sub-group closes once its
// running sum reaches sub_group_size, or at the last parameter.
std::vector<std::pair<size_t, size_t>> Zero3SubGroups(std::span<const uint64_t> partition_elems,
                                                      uint64_t sub_group_size);

}  // namespace ucpfs::layout
