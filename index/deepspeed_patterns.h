// DeepSpeed's universal_checkpoint_info pattern lists (docs/formats.md "The universal checkpoint",
// "Megatron-DeepSpeed's pattern lists") and
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
  size_t index = 0;                   // in parameter_with_sub_params
  std::vector<std::string> patterns;  // as recorded
  std::vector<layout::Rule> rules;    // the patterns compiled
  nlohmann::json shape;               // as recorded (the partition dim's entry: sizes, or a count before 0.4)
  int partition_dim = 0;
};

struct DeepSpeedPatterns {
  bool present = false;  // the checkpoint has a universal_checkpoint_info dict
  std::vector<layout::Rule> replicated, average, row, vocab, two_sub, pipeline_replicated;
  std::vector<DeepSpeedSubParams> sub_params;
  nlohmann::json shard_widths;  // sub_param_shard_widths (version 0.4): pattern -> per sub-parameter, per tp rank
  std::optional<int64_t> original_vocab_size;
  double version = 0;
  bool affine_map = false;
};

// The most patterns (all lists together) a checkpoint may record: each is compiled (RE2) and
// tried on every parameter name.
inline constexpr size_t kMaxDeepSpeedPatterns = 512;

// Parses universal_checkpoint_info (as plain JSON; null or a non-object: no patterns, the
// converter's defaults). Errors: kCorrupt naming `where` and the key (a list that is not a list
// of strings, a pattern RE2 cannot compile, more than kMaxDeepSpeedPatterns patterns).
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
  std::string sub_pattern;                         // kSubParams: the pattern that matched, as recorded
};

// How ds_to_universal merges parameter `name`. Errors: kUnsupported naming the parameter (an
// affine map; a name matching two patterns of one list, which ds_to_universal asserts on).
Result<DeepSpeedParamRule> ClassifyDeepSpeedParam(const DeepSpeedPatterns& patterns, const std::string& name);

// Whether `name` matches pipeline_replicated_parameter_patterns (tied weights whose later
// pipeline stages ds_to_universal skips).
bool IsPipelineReplicated(const DeepSpeedPatterns& patterns, const std::string& name);

// How a kSubParams parameter is split: the global size of each sub-parameter along
// partition_dim, and each tp rank's width of it (tp rank r holds [sub_0 width r; sub_1 width r;
// ...], its pieces in sub-parameter order). Version 0.4 records sizes and widths
// (sub_param_shard_widths, possibly uneven); before it the sizes (or a count of equal
// sub-parameters of `global_size` together) split evenly over `tp`.
struct DeepSpeedSubSplit {
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> widths;  // [sub-parameter][tp rank]
};
// Errors: kUnsupported naming `name` (sizes or widths that do not add up, a count that does not
// divide, an uneven split before 0.4, a partition dim other than 0, missing widths at 0.4).
// With tp == 0 only the sizes are computed and checked (`widths` stays empty): what the
// universal view needs, which merges every tp rank.
Result<DeepSpeedSubSplit> DeepSpeedSubParamSplit(const DeepSpeedPatterns& patterns, const DeepSpeedParamRule& rule,
                                                 const std::string& name, int tp, int64_t global_size);

}  // namespace ucpfs::index
