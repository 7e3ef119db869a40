// See fused_qkv.h.
#include "core/layout/fused_qkv.h"

#include <optional>
#include <string_view>

namespace ucpfs::layout {
namespace {

// 0, 1, 2 for a module component naming the query, key or value part (`wq`, `k_proj`, ...).
std::optional<int> RoleOf(std::string_view name) {
  const size_t last = name.rfind('.');
  if (last == std::string_view::npos) return std::nullopt;
  std::string_view module = name.substr(0, last);
  module = module.substr(module.rfind('.') == std::string_view::npos ? 0 : module.rfind('.') + 1);
  if (module.ends_with("_proj")) module.remove_suffix(5);
  if (module.empty()) return std::nullopt;
  switch (module.back()) {
    case 'q': return 0;
    case 'k': return 1;
    case 'v': return 2;
    default: return std::nullopt;
  }
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> FusedQkv::FusedRowsOf(size_t part) const {
  int role = 0;
  while (role < 3 && part_of[static_cast<size_t>(role)] != part) ++role;
  std::vector<std::pair<int64_t, int64_t>> rows;
  if (role == 3) return rows;
  const int64_t group_rows = (heads_per_kv + 2) * head_dim;
  const int64_t lo = role == 0 ? 0 : (heads_per_kv + role - 1) * head_dim;
  const int64_t n = role == 0 ? heads_per_kv * head_dim : head_dim;
  rows.reserve(static_cast<size_t>(n_kv_heads));
  for (int64_t g = 0; g < n_kv_heads; ++g) rows.emplace_back(g * group_rows + lo, n);
  return rows;
}

Result<FusedQkv> FusedQkvOf(const std::string& fused_name, int64_t fused_rows,
                            const std::vector<std::string>& part_names, const std::vector<int64_t>& part_rows,
                            const ModelInfo& facts) {
  auto bad = [&](const std::string& why) {
    return InvalidArgumentError("fused parameter '" + fused_name + "': " + why);
  };
  if (part_names.size() != 3 || part_rows.size() != 3) {
    return bad("stored as " + std::to_string(part_names.size()) + " parts, not a query, key and value");
  }
  FusedQkv out;
  std::array<bool, 3> seen = {false, false, false};
  for (size_t i = 0; i < 3; ++i) {
    const std::optional<int> role = RoleOf(part_names[i]);
    if (!role || seen[static_cast<size_t>(*role)]) {
      return bad("its parts '" + part_names[0] + "', '" + part_names[1] + "', '" + part_names[2] +
                 "' are not named as a query, a key and a value (wq, wk, wv)");
    }
    seen[static_cast<size_t>(*role)] = true;
    out.part_of[static_cast<size_t>(*role)] = i;
  }
  const int64_t q = part_rows[out.part_of[0]], k = part_rows[out.part_of[1]], v = part_rows[out.part_of[2]];
  if (k <= 0 || k != v || q <= 0 || q % k != 0 || q + k + v != fused_rows) {
    return bad("query, key and value rows " + std::to_string(q) + ", " + std::to_string(k) + ", " +
               std::to_string(v) + " do not make grouped-query attention of " + std::to_string(fused_rows) + " rows");
  }
  out.heads_per_kv = q / k;
  // The head dimension from each fact given; all must agree.
  int64_t head_dim = 0;
  std::string from;
  auto offer = [&](int64_t hd, bool fits, const std::string& fact) -> Status {
    if (!fits || hd <= 0) {
      return bad(fact + " does not divide its query and key rows (" + std::to_string(q) + ", " + std::to_string(k) + ")");
    }
    if (head_dim != 0 && hd != head_dim) {
      return bad(fact + " gives head dimension " + std::to_string(hd) + ", " + from + " gives " + std::to_string(head_dim));
    }
    head_dim = hd;
    from = fact;
    return Status::Ok();
  };
  if (facts.head_dim > 0) {
    UCPFS_RETURN_IF_ERROR(offer(facts.head_dim, k % facts.head_dim == 0, "head_dim " + std::to_string(facts.head_dim)));
  }
  if (facts.num_query_groups > 0) {
    UCPFS_RETURN_IF_ERROR(offer(k / facts.num_query_groups, k % facts.num_query_groups == 0,
                                "num_key_value_heads " + std::to_string(facts.num_query_groups)));
  }
  if (facts.num_attention_heads > 0) {
    UCPFS_RETURN_IF_ERROR(offer(q / facts.num_attention_heads, q % facts.num_attention_heads == 0,
                                "num_attention_heads " + std::to_string(facts.num_attention_heads)));
  }
  if (head_dim == 0) {
    return bad("how its rows interleave the query, key and value heads needs the head dimension, which the "
               "checkpoint does not store: " + std::string(kFusedQkvFactsHint));
  }
  if (k % head_dim != 0) {
    return bad(from + " gives head dimension " + std::to_string(head_dim) + ", which does not divide its key rows (" +
               std::to_string(k) + ")");
  }
  out.head_dim = head_dim;
  out.n_kv_heads = k / head_dim;
  return out;
}

}  // namespace ucpfs::layout
