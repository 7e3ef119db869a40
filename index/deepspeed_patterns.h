// DeepSpeed's universal_checkpoint_info pattern lists (research/deepspeed.md §3.1, §3.5) and
// how ds_to_universal merges one parameter's tensor-parallel slices by them. The one place that
// reads these lists: the DeepSpeed scanner places each tp rank's slice in the global tensor by
// it, and the universal view writes the same merge keys ds_to_universal writes.
//
// Matching is Python's re.match (anchored at the start of the name only), on RE2 through
// layout::RuleMatches: linear time, so patterns from an untrusted checkpoint cannot hang us.
//
// Not for: layouts of other formats (layout::PatternFor and the presets), reading pickles.
// Invariants: ClassifyDeepSpeedParam follows ds_to_universal's precedence (affine map,
// tp-replicated, averaged, two sub-parameters, sub-parameter shapes, row / default cat; the
// vocabulary strip applies on top of any of them) and refuses what ds_to_universal asserts on
// (a name matching two patterns of one list).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/layout/patterns.h"
#include "core/status.h"

namespace ucpfs::index {

// One parameter_with_sub_params entry (DeepSpeed's SubparamShape).
struct DeepSpeedSubParams {
  std::vector<layout::Rule> rules;  // its patterns
  nlohmann::json shape;             // as recorded (a list; the partition dim's entry a list of sizes or a count)
  int partition_dim = 0;
};

struct DeepSpeedPatterns {
  bool present = false;  // the checkpoint has a universal_checkpoint_info dict
  std::vector<layout::Rule> replicated, average, row, vocab, two_sub, pipeline_replicated;
  std::vector<DeepSpeedSubParams> sub_params;
  std::optional<int64_t> original_vocab_size;
  double version = 0;
  bool affine_map = false;
};

// Parses universal_checkpoint_info (as plain JSON; null or a non-object: no patterns, the
// converter's defaults). Errors: kCorrupt naming `where` and the key (a list that is not a list
// of strings, a pattern RE2 cannot compile).
Result<DeepSpeedPatterns> ParseDeepSpeedPatterns(const nlohmann::json& uc, const std::string& where);

enum class DeepSpeedMerge {
  kReplicated,  // tp slices equal: slice 0
  kAverage,     // the mean of the slices
  kTwoSub,      // each slice [a_r; b_r] along dim 0: [a_0..a_T; b_0..b_T]
  kSubParams,   // sub-parameter shapes along partition_dim (fused QKV with GQA)
  kCat,         // torch.cat along cat_dim (1 for row-parallel, else 0)
};

struct DeepSpeedParamRule {
  DeepSpeedMerge merge = DeepSpeedMerge::kCat;
  int cat_dim = 0;                               // kCat, kTwoSub
  bool vocab = false;                            // rows stripped to original_vocab_size
  const DeepSpeedSubParams* sub_params = nullptr;  // kSubParams; points into the patterns
};

// How ds_to_universal merges parameter `name`. Errors: kUnsupported naming the parameter (an
// affine map; a name matching two patterns of one list, which ds_to_universal asserts on).
Result<DeepSpeedParamRule> ClassifyDeepSpeedParam(const DeepSpeedPatterns& patterns, const std::string& name);

// Whether `name` matches pipeline_replicated_parameter_patterns (tied weights whose later
// pipeline stages ds_to_universal skips).
bool IsPipelineReplicated(const DeepSpeedPatterns& patterns, const std::string& name);

// The sizes along partition_dim of each sub-parameter of `rule` (kSubParams) for a parameter
// whose global size along that dim is `global_size`: the recorded list, or a count of equal
// sub-parameters (universal_checkpoint_info before version 0.4). Errors: kUnsupported naming
// `name` (sizes that do not sum to the dim, a count that does not divide it, a partition dim other
// than 0, per-rank shard widths of version 0.4).
Result<std::vector<int64_t>> DeepSpeedSubSizes(const DeepSpeedPatterns& patterns, const DeepSpeedParamRule& rule,
                                               const std::string& name, int64_t global_size);

}  // namespace ucpfs::index
