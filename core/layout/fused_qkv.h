// A fused query/key/value projection held by the optimizer as one parameter while the model's
// state_dict saves it as three (torchtitan 0.3.0's FusedQKVLinear: parameter `wqkv`, saved as
// `wq`/`wk`/`wv` by its state_dict post-hook, _split_qkv_on_save). The fused rows are grouped per
// key-value head: viewed as [n_kv_heads, heads_per_kv + 2, head_dim, ...], group g holds its
// heads_per_kv query heads, then its key head, then its value head. FusedQkvOf says which fused
// rows each stored part is, so that the optimizer's fused moments can be served under the split
// names (and the split weights under the fused one).
//
// The checkpoint does not store how many heads there are: with n_heads == n_kv_heads the shapes
// of wq, wk and wv are equal whatever the head dimension, and the interleave differs for every
// head dimension. One fact settles it, given in ModelInfo (a pattern rules file's "model" object,
// or --hf-config): head_dim, num_query_groups (key-value heads) or num_attention_heads. Without
// any, FusedQkvOf fails naming what is missing; facts that disagree with the shapes fail naming
// the parameter. Nothing is guessed.
//
// Pure logic: no I/O.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/layout/patterns.h"
#include "core/status.h"

namespace ucpfs::layout {

struct FusedQkv {
  int64_t n_kv_heads = 0;
  int64_t heads_per_kv = 0;  // query heads per key-value head
  int64_t head_dim = 0;
  // Index into the parts given to FusedQkvOf of the query, key and value parts.
  std::array<size_t, 3> part_of = {0, 1, 2};

  // The fused rows of part `part` (an index into the parts given to FusedQkvOf), in the part's own
  // row order: one [row_lo, row_lo + n_rows) per key-value head, n_rows = heads_per_kv*head_dim
  // for the query part, head_dim for the key and value parts.
  std::vector<std::pair<int64_t, int64_t>> FusedRowsOf(size_t part) const;
};

// What a fused parameter and its stored parts need to be a FusedQkvLinear: three parts whose
// names' module component ends in q, k and v (`wq`, `wk`, `wv`; `q_proj`...), the key and value
// parts of equal rows, the query's a multiple of them, the three adding up to the fused rows,
// and one of head_dim, num_query_groups or num_attention_heads in `facts` (the others, when also
// given, agreeing). `fused_name` is used in messages.
// Errors: kInvalidArgument naming the parameter: not three parts of q, k, v names or sizes; no
// fact given (the message says which facts and where to give them); facts that do not fit.
Result<FusedQkv> FusedQkvOf(const std::string& fused_name, int64_t fused_rows,
                            const std::vector<std::string>& part_names, const std::vector<int64_t>& part_rows,
                            const ModelInfo& facts);

// Where FusedQkvOf's facts come from, for messages.
inline constexpr const char* kFusedQkvFactsHint =
    "give \"model\": {\"head_dim\": N} (or \"num_attention_heads\" / \"num_key_value_heads\") in a "
    "--pattern-rules file, or the model's config.json with --hf-config";

}  // namespace ucpfs::layout
