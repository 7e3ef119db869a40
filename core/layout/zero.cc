// See zero.h.
#include "core/layout/zero.h"

#include <algorithm>
#include <optional>
#include <string>

#include "core/checked.h"

namespace ucpfs::layout {

uint64_t ZeroFlatGroup::PaddingOf(int dp_rank) const {
  const uint64_t lo = WindowStart(dp_rank);
  const uint64_t hi = lo + partition_elems;
  if (total_elems <= lo) return partition_elems;
  if (total_elems < hi) return hi - total_elems;
  return 0;
}

Result<ZeroFlatGroup> MakeZeroFlatGroup(std::span<const uint64_t> param_numels, int dp,
                                        uint64_t alignment_factor) {
  if (dp < 1 || alignment_factor < 1) {
    return InvalidArgumentError("ZeRO partition: dp " + std::to_string(dp) + " and alignment factor " +
                                std::to_string(alignment_factor) + " must be >= 1");
  }
  ZeroFlatGroup g;
  g.dp = dp;
  g.param_starts.reserve(param_numels.size());
  g.param_numels.assign(param_numels.begin(), param_numels.end());
  for (uint64_t n : param_numels) {
    g.param_starts.push_back(g.total_elems);
    std::optional<uint64_t> sum = CheckedAdd(g.total_elems, n);
    if (!sum) return InvalidArgumentError("ZeRO partition: the flat size overflows");
    g.total_elems = *sum;
  }
  const std::optional<uint64_t> align = CheckedMul(alignment_factor, static_cast<uint64_t>(dp));
  const std::optional<uint64_t> up = align ? CheckedAdd(g.total_elems, *align - 1) : std::nullopt;
  if (!up) return InvalidArgumentError("ZeRO partition: the padded size overflows");
  g.padded_elems = *up / *align * *align;
  g.partition_elems = g.padded_elems / static_cast<uint64_t>(dp);
  return g;
}

std::vector<ZeroFragment> FragmentsOfParam(const ZeroFlatGroup& group, size_t index) {
  std::vector<ZeroFragment> out;
  const uint64_t start = group.param_starts.at(index);
  const uint64_t end = start + group.param_numels.at(index);
  if (start == end || group.partition_elems == 0) return out;
  for (auto d = static_cast<int>(start / group.partition_elems); d < group.dp; ++d) {
    const uint64_t lo = group.WindowStart(d), hi = lo + group.partition_elems;
    if (lo >= end) break;
    const uint64_t a = std::max(start, lo), b = std::min(end, hi);
    out.push_back({d, a - start, a - lo, b - a});
  }
  return out;
}

std::vector<IndexedFragment> FragmentsInWindow(const ZeroFlatGroup& group, int dp_rank) {
  std::vector<IndexedFragment> out;
  const uint64_t lo = group.WindowStart(dp_rank), hi = lo + group.partition_elems;
  // The first parameter ending past lo: param_starts ascend.
  auto it = std::upper_bound(group.param_starts.begin(), group.param_starts.end(), lo);
  size_t i = it == group.param_starts.begin() ? 0 : static_cast<size_t>(it - group.param_starts.begin()) - 1;
  for (; i < group.param_starts.size() && group.param_starts[i] < hi; ++i) {
    const uint64_t start = group.param_starts[i], end = start + group.param_numels[i];
    const uint64_t a = std::max(start, lo), b = std::min(end, hi);
    if (a < b) out.push_back({i, {dp_rank, a - start, a - lo, b - a}});
  }
  return out;
}

uint64_t Zero3PartitionElems(uint64_t numel, int dp) {
  const auto n = static_cast<uint64_t>(std::max(dp, 1));
  return numel / n + (numel % n != 0 ? 1 : 0);
}

ZeroFragment Zero3FragmentOf(uint64_t numel, int dp, int dp_rank) {
  const uint64_t pn = Zero3PartitionElems(numel, dp);
  const uint64_t lo = pn * static_cast<uint64_t>(dp_rank);
  const uint64_t n = lo >= numel ? 0 : std::min(pn, numel - lo);
  return {dp_rank, n == 0 ? 0 : lo, 0, n};
}

std::vector<std::pair<size_t, size_t>> Zero3SubGroups(std::span<const uint64_t> partition_elems,
                                                      uint64_t sub_group_size) {
  std::vector<std::pair<size_t, size_t>> out;
  size_t first = 0;
  uint64_t running = 0;
  for (size_t i = 0; i < partition_elems.size(); ++i) {
    running = CheckedAdd(running, partition_elems[i]).value_or(UINT64_MAX);
    if (running >= sub_group_size || i + 1 == partition_elems.size()) {
      out.emplace_back(first, i + 1);
      first = i + 1;
      running = 0;
    }
  }
  return out;
}

}  // namespace ucpfs::layout
