// PlanCache: a tensor's whole copy plan (slice::PlanRead over all its elements), made on the
// first read and kept, so each later read of a range only selects and clips the ops it needs
// instead of planning again. A view file holds one per tensor (views::LayoutProvider), so plans
// are cached per view inode and generation: a new generation builds new view files.
//
// Not for: plans too large to keep: a tensor whose plan could exceed kMaxCachedOps ops, or
// that would take the process past kPlanCacheBudgetBytes, is not cached and its reads plan as
// before (Select returns false). Memory is bounded by that budget, counted across the process.
// Thread-safe: the plan is made once (the first reader makes it; others wait), then only read.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "core/slice/slice.h"

namespace ucpfs::slice {

class PlanCache {
 public:
  static constexpr uint64_t kMaxCachedOps = uint64_t{1} << 16;
  static constexpr uint64_t kPlanCacheBudgetBytes = uint64_t{64} << 20;

  // `layout` must outlive the cache (its owner holds both).
  PlanCache(const TensorLayout& layout, DType dst_dtype) : layout_(layout), dst_dtype_(dst_dtype) {}
  ~PlanCache();
  PlanCache(const PlanCache&) = delete;
  PlanCache& operator=(const PlanCache&) = delete;

  // The ops of PlanRead(layout, dst_dtype, elem_lo, elem_hi) (the same bytes when executed:
  // destination offsets relative to elem_lo, the first and last op clipped), into `out`.
  // false when the tensor has no cached plan (too large, over the budget, or the whole plan
  // failed: PlanRead of the range then tells why); `out` is then unspecified.
  bool Select(uint64_t elem_lo, uint64_t elem_hi, std::vector<CopyOp>& out) const;

  // Bytes held by cached plans in this process (for tests and stats).
  static uint64_t BytesInUse();
  // Whether Select has a plan (makes it if not tried yet).
  bool Cached() const;

 private:
  void Make() const;

  const TensorLayout& layout_;
  const DType dst_dtype_;
  mutable std::once_flag once_;
  mutable std::vector<CopyOp> ops_;  // set once under once_, read-only afterwards
  mutable bool usable_ = false;
  mutable uint64_t charged_bytes_ = 0;
};

// An upper bound on the ops PlanRead makes for the whole tensor (each fragment's rows: runs
// contiguous in the global order), without planning; saturates.
uint64_t PlanOpsBound(const TensorLayout& layout);

}  // namespace ucpfs::slice
