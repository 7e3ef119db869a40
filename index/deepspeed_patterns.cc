// DeepSpeed universal_checkpoint_info patterns: see deepspeed_patterns.h.
#include "index/deepspeed_patterns.h"

#include <utility>

namespace ucpfs::index {
namespace {

Result<std::vector<layout::Rule>> RulesOf(const nlohmann::json& uc, const char* key, layout::TpKind tp,
                                          const std::string& where, size_t* budget) {
  std::vector<layout::Rule> out;
  if (!uc.contains(key) || uc[key].is_null()) return out;
  if (!uc[key].is_array()) return CorruptError(where + ": universal_checkpoint_info['" + key + "'] is not a list");
  if (uc[key].size() > *budget) {
    return CorruptError(where + ": universal_checkpoint_info holds more than " + std::to_string(kMaxDeepSpeedPatterns) +
                        " patterns");
  }
  *budget -= uc[key].size();
  for (const auto& p : uc[key]) {
    if (!p.is_string()) return CorruptError(where + ": universal_checkpoint_info['" + key + "'] holds a non-string");
    layout::Rule r;
    r.regex = "^(?:" + p.get<std::string>() + ")";  // re.match: anchored at the start only
    r.tp = tp;
    auto made = layout::MakeRule(std::move(r));
    if (!made.ok()) {
      return CorruptError(where + ": universal_checkpoint_info['" + key + "']: " + made.error().message());
    }
    out.push_back(std::move(*made));
  }
  return out;
}

bool AnyMatches(const std::vector<layout::Rule>& rules, const std::string& name) {
  for (const auto& r : rules) {
    if (layout::RuleMatches(r, name)) return true;
  }
  return false;
}

// The one matching pattern of a list, as ds_to_universal's get_matched_pattern (which asserts
// that at most one matches).
Result<bool> MatchOne(const std::vector<layout::Rule>& rules, const std::string& name, const char* list) {
  int n = 0;
  for (const auto& r : rules) n += layout::RuleMatches(r, name) ? 1 : 0;
  if (n > 1) {
    return UnsupportedError("parameter '" + name + "' matches " + std::to_string(n) + " patterns of " + list +
                            " (ds_to_universal refuses that too)");
  }
  return n == 1;
}

}  // namespace

Result<DeepSpeedPatterns> ParseDeepSpeedPatterns(const nlohmann::json& uc, const std::string& where) {
  DeepSpeedPatterns p;
  if (!uc.is_object()) return p;
  p.present = true;
  size_t budget = kMaxDeepSpeedPatterns;
  UCPFS_ASSIGN_OR_RETURN(p.replicated, RulesOf(uc, "tp_replicated_parameter_patterns", layout::TpKind::kReplicate, where, &budget));
  UCPFS_ASSIGN_OR_RETURN(p.average, RulesOf(uc, "parameter_to_average_patterns", layout::TpKind::kPartial, where, &budget));
  UCPFS_ASSIGN_OR_RETURN(p.row, RulesOf(uc, "parameter_with_row_parallelism_patterns", layout::TpKind::kRow, where, &budget));
  UCPFS_ASSIGN_OR_RETURN(p.vocab, RulesOf(uc, "vocabulary_parameter_patterns", layout::TpKind::kVocab, where, &budget));
  UCPFS_ASSIGN_OR_RETURN(p.two_sub, RulesOf(uc, "parameter_with_2_sub_params_cat_dim_0", layout::TpKind::kColumn, where, &budget));
  UCPFS_ASSIGN_OR_RETURN(p.pipeline_replicated,
                         RulesOf(uc, "pipeline_replicated_parameter_patterns", layout::TpKind::kReplicate, where, &budget));
  if (uc.contains("parameter_with_sub_params") && !uc["parameter_with_sub_params"].is_null()) {
    const nlohmann::json& list = uc["parameter_with_sub_params"];
    if (!list.is_array()) {
      return CorruptError(where + ": universal_checkpoint_info['parameter_with_sub_params'] is not a list");
    }
    for (const auto& s : list) {
      // A SubparamShape dataclass pickles as an object, which the plain-JSON form keeps as null;
      // Megatron-DeepSpeed and AutoTP write dicts.
      if (!s.is_object() || !s.contains("patterns")) {
        return CorruptError(where + ": universal_checkpoint_info['parameter_with_sub_params'] holds an entry "
                                    "that is not a {'patterns', 'shape', 'partition_dim'} dict");
      }
      DeepSpeedSubParams sp;
      sp.index = p.sub_params.size();
      const nlohmann::json wrapped = {{"patterns", s["patterns"]}};
      UCPFS_ASSIGN_OR_RETURN(sp.rules, RulesOf(wrapped, "patterns", layout::TpKind::kColumn, where, &budget));
      for (const auto& pattern : s["patterns"]) sp.patterns.push_back(pattern.get<std::string>());
      sp.shape = s.value("shape", nlohmann::json());
      const nlohmann::json dim = s.value("partition_dim", nlohmann::json());
      if (!dim.is_number_integer() || !sp.shape.is_array() || dim.get<int64_t>() < 0 ||
          dim.get<int64_t>() >= static_cast<int64_t>(sp.shape.size())) {
        return CorruptError(where + ": universal_checkpoint_info['parameter_with_sub_params']: partition_dim "
                                    "does not index its shape");
      }
      sp.partition_dim = dim.get<int>();
      p.sub_params.push_back(std::move(sp));
    }
  }
  if (uc.contains("sub_param_shard_widths") && uc["sub_param_shard_widths"].is_object()) {
    p.shard_widths = uc["sub_param_shard_widths"];
  }
  if (uc.contains("original_vocab_size") && uc["original_vocab_size"].is_number_integer()) {
    p.original_vocab_size = uc["original_vocab_size"].get<int64_t>();
  }
  if (uc.contains("universal_checkpoint_version") && uc["universal_checkpoint_version"].is_number()) {
    p.version = uc["universal_checkpoint_version"].get<double>();
  }
  p.affine_map = uc.contains("affine_map") && !uc["affine_map"].is_null() && !uc["affine_map"].empty();
  return p;
}

Result<DeepSpeedParamRule> ClassifyDeepSpeedParam(const DeepSpeedPatterns& p, const std::string& name) {
  DeepSpeedParamRule rule;
  if (p.affine_map) return UnsupportedError("parameter '" + name + "': universal_checkpoint_info has an affine_map");
  // ds_to_universal's get_matched_sub_params_pattern: the first entry, first pattern, matching.
  const DeepSpeedSubParams* sub = nullptr;
  std::string sub_pattern;
  for (const auto& s : p.sub_params) {
    for (size_t i = 0; sub == nullptr && i < s.rules.size(); ++i) {
      if (layout::RuleMatches(s.rules[i], name)) {
        sub = &s;
        sub_pattern = s.patterns[i];
      }
    }
  }
  UCPFS_ASSIGN_OR_RETURN(bool replicated, MatchOne(p.replicated, name, "tp_replicated_parameter_patterns"));
  if (replicated) {
    rule.merge = DeepSpeedMerge::kReplicated;
  } else {
    UCPFS_ASSIGN_OR_RETURN(bool average, MatchOne(p.average, name, "parameter_to_average_patterns"));
    if (average) {
      rule.merge = DeepSpeedMerge::kAverage;
    } else {
      UCPFS_ASSIGN_OR_RETURN(bool two_sub, MatchOne(p.two_sub, name, "parameter_with_2_sub_params_cat_dim_0"));
      if (two_sub) {
        rule.merge = DeepSpeedMerge::kTwoSub;
      } else if (sub != nullptr) {
        rule.merge = DeepSpeedMerge::kSubParams;
        rule.sub_params = sub;
        rule.sub_pattern = sub_pattern;
      } else {
        UCPFS_ASSIGN_OR_RETURN(bool row, MatchOne(p.row, name, "parameter_with_row_parallelism_patterns"));
        rule.cat_dim = row ? 1 : 0;
      }
    }
  }
  UCPFS_ASSIGN_OR_RETURN(rule.vocab, MatchOne(p.vocab, name, "vocabulary_parameter_patterns"));
  return rule;
}

bool IsPipelineReplicated(const DeepSpeedPatterns& p, const std::string& name) {
  return AnyMatches(p.pipeline_replicated, name);
}

Result<DeepSpeedSubSplit> DeepSpeedSubParamSplit(const DeepSpeedPatterns& p, const DeepSpeedParamRule& rule,
                                                 const std::string& name, int tp, int64_t global_size) {
  const DeepSpeedSubParams& sp = *rule.sub_params;
  auto refuse = [&](const std::string& why) {
    return UnsupportedError("parameter '" + name + "' (parameter_with_sub_params): " + why);
  };
  if (sp.partition_dim != 0) return refuse("a partition dim other than 0 is not served yet");
  const nlohmann::json& spec = sp.shape[static_cast<size_t>(sp.partition_dim)];
  DeepSpeedSubSplit split;
  auto as_size = [](const nlohmann::json& v) -> std::optional<int64_t> {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (int64_t{1} << 48)) return std::nullopt;
    return v.get<int64_t>();
  };
  if (spec.is_array()) {
    for (const auto& s : spec) {
      const std::optional<int64_t> size = as_size(s);
      if (!size) return refuse("a sub-parameter size is not a size");
      split.sizes.push_back(*size);
    }
  } else if (p.version < 0.4 && spec.is_number_integer()) {
    const int64_t n = spec.get<int64_t>();
    if (n <= 0 || n > global_size || global_size % n != 0) {
      return refuse(std::to_string(n) + " sub-parameters do not divide " + std::to_string(global_size));
    }
    split.sizes.assign(static_cast<size_t>(n), global_size / n);
  } else {
    return refuse("its shape at partition_dim is neither sizes nor a count");
  }
  if (tp == 0) {
    // Sizes only.
  } else if (p.version >= 0.4) {
    const nlohmann::json w = p.shard_widths.is_object() ? p.shard_widths.value(rule.sub_pattern, nlohmann::json())
                                                        : nlohmann::json();
    if (!w.is_array() || w.size() != split.sizes.size()) {
      return refuse("universal checkpoint version 0.4 records no sub_param_shard_widths for its pattern, one list per "
                    "sub-parameter");
    }
    for (size_t j = 0; j < w.size(); ++j) {
      if (!w[j].is_array() || w[j].size() != static_cast<size_t>(tp)) {
        return refuse("sub_param_shard_widths has no width per tp rank for sub-parameter " + std::to_string(j));
      }
      std::vector<int64_t> widths;
      int64_t sum = 0;
      for (const auto& v : w[j]) {
        const std::optional<int64_t> width = as_size(v);
        if (!width) return refuse("a shard width is not a size");
        widths.push_back(*width);
        sum += *width;
      }
      if (sum != split.sizes[j]) {
        return refuse("the shard widths of sub-parameter " + std::to_string(j) + " sum to " + std::to_string(sum) +
                      ", not " + std::to_string(split.sizes[j]));
      }
      split.widths.push_back(std::move(widths));
    }
  } else {
    for (int64_t size : split.sizes) {
      if (size % tp != 0) return refuse("sub-parameter size " + std::to_string(size) + " does not divide by tp");
      split.widths.emplace_back(static_cast<size_t>(tp), size / tp);
    }
  }
  int64_t sum = 0;
  for (int64_t size : split.sizes) sum += size;
  if (global_size >= 0 && sum != global_size) {
    return refuse("sub-parameter sizes sum to " + std::to_string(sum) + ", not " + std::to_string(global_size));
  }
  return split;
}

}  // namespace ucpfs::index
