// The cached whole-tensor copy plan (see plan_cache.h).
#include "core/slice/plan_cache.h"

#include <algorithm>
#include <atomic>

#include "core/checked.h"

namespace ucpfs::slice {
namespace {

std::atomic<uint64_t> g_bytes_in_use{0};

uint64_t OpBytes(const CopyOp& op) { return sizeof(CopyOp) + op.mean_with.capacity() * sizeof(MeanPart); }

// Takes n_bytes of the budget; false when it would pass the budget.
bool Charge(uint64_t n_bytes) {
  uint64_t now = g_bytes_in_use.load(std::memory_order_relaxed);
  do {
    if (now + n_bytes > PlanCache::kPlanCacheBudgetBytes) return false;
  } while (!g_bytes_in_use.compare_exchange_weak(now, now + n_bytes, std::memory_order_relaxed));
  return true;
}

}  // namespace

uint64_t PlanOpsBound(const TensorLayout& layout) {
  uint64_t total = 0;
  for (const Fragment& f : layout.fragments) {
    const size_t rank = f.box.sizes.size();
    // A run is the box's last dim, extended over the dims before it while the box spans the
    // dims after them fully (row-major storage only; stored strides: the last dim alone).
    uint64_t run = 1;
    if (rank > 0) {
      run = static_cast<uint64_t>(std::max<int64_t>(1, f.box.sizes[rank - 1]));
      if (f.strides.empty()) {
        for (size_t d = rank - 1; d > 0; --d) {
          if (d >= layout.shape.size() || f.box.sizes[d] != layout.shape[d] || f.box.offsets[d] != 0) break;
          run = CheckedMul(run, static_cast<uint64_t>(std::max<int64_t>(1, f.box.sizes[d - 1]))).value_or(UINT64_MAX);
        }
      }
    }
    const uint64_t n = f.flat_hi > f.flat_lo ? f.flat_hi - f.flat_lo : 0;
    total = CheckedAdd(total, n / run + 2).value_or(UINT64_MAX);
  }
  return total;
}

PlanCache::~PlanCache() {
  if (charged_bytes_ > 0) g_bytes_in_use.fetch_sub(charged_bytes_, std::memory_order_relaxed);
}

uint64_t PlanCache::BytesInUse() { return g_bytes_in_use.load(std::memory_order_relaxed); }

void PlanCache::Make() const {
  if (PlanOpsBound(layout_) > kMaxCachedOps) return;
  uint64_t numel = 1;
  for (int64_t d : layout_.shape) {
    auto m = d < 0 ? std::nullopt : CheckedMul(numel, static_cast<uint64_t>(d));
    if (!m) return;
    numel = *m;
  }
  auto ops = PlanRead(layout_, dst_dtype_, 0, numel);
  if (!ops.ok()) return;  // the range's own PlanRead reports it
  uint64_t n_bytes = 0;
  for (const CopyOp& op : *ops) n_bytes += OpBytes(op);
  if (!Charge(n_bytes)) return;
  charged_bytes_ = n_bytes;
  ops_ = std::move(ops).value();
  usable_ = true;
}

bool PlanCache::Cached() const {
  std::call_once(once_, [this] { Make(); });
  return usable_;
}

bool PlanCache::Select(uint64_t elem_lo, uint64_t elem_hi, std::vector<CopyOp>& out) const {
  if (!Cached()) return false;
  out.clear();
  if (elem_lo >= elem_hi) return true;
  const uint64_t isz = ItemSize(dst_dtype_);
  const uint64_t lo_byte = elem_lo * isz, hi_byte = elem_hi * isz;
  // The ops tile [0, numel * isz) in destination order: start at the last one at or before lo.
  auto it = std::upper_bound(ops_.begin(), ops_.end(), lo_byte,
                             [](uint64_t b, const CopyOp& op) { return b < op.dst_byte_offset; });
  if (it == ops_.begin()) return false;  // cannot happen for a whole plan; plan the range instead
  --it;
  for (; it != ops_.end() && it->dst_byte_offset < hi_byte; ++it) {
    CopyOp op = *it;
    const uint64_t op_end = op.dst_byte_offset + op.n_elems * isz;
    if (op_end <= lo_byte) continue;
    if (op.dst_byte_offset < lo_byte) {
      const uint64_t skip = (lo_byte - op.dst_byte_offset) / isz;
      const uint64_t stride = static_cast<uint64_t>(std::max<int64_t>(1, op.src_elem_stride));
      if (op.file_id != kZeroFileId) op.src_byte_offset += skip * stride * ItemSize(op.src_dtype);
      ShiftMeanParts(op.mean_with, skip * stride);
      op.n_elems -= skip;
      op.dst_byte_offset = lo_byte;
    }
    if (op_end > hi_byte) op.n_elems -= (op_end - hi_byte) / isz;
    op.dst_byte_offset -= lo_byte;
    if (op.n_elems == 1) op.src_elem_stride = 1;
    out.push_back(std::move(op));
  }
  return true;
}

}  // namespace ucpfs::slice
