// The --pattern-rules FILE parser (see patterns.h ParseRulesFile). Kept apart from patterns.cc so that only
// this file depends on nlohmann_json.
#include <nlohmann/json.hpp>

#include "core/layout/patterns.h"

namespace ucpfs::layout {
namespace {

Status EntryError(const std::string& source, size_t index, const std::string& why) {
  return InvalidArgumentError(source + ": patterns[" + std::to_string(index) + "]: " + why);
}

}  // namespace

Result<std::vector<Rule>> ParseRules(std::string_view json_text, const std::string& source) {
  UCPFS_ASSIGN_OR_RETURN(RulesFile file, ParseRulesFile(json_text, source));
  return std::move(file.rules);
}

Result<RulesFile> ParseRulesFile(std::string_view json_text, const std::string& source) {
  nlohmann::json doc = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return InvalidArgumentError(source + ": not valid JSON");
  const bool has_model = doc.is_object() && doc.contains("model");
  if (!doc.is_object() || (!doc.contains("patterns") && !has_model) ||
      (doc.contains("patterns") && !doc["patterns"].is_array())) {
    return InvalidArgumentError(source + ": expected {\"patterns\": [...]} (and/or \"model\": {...})");
  }
  RulesFile file;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    if (it.key() != "patterns" && it.key() != "model") {
      return InvalidArgumentError(source + ": unknown top-level key '" + it.key() + "'");
    }
  }
  if (has_model) {
    const nlohmann::json& m = doc["model"];
    if (!m.is_object()) return InvalidArgumentError(source + ": model: must be an object");
    for (auto it = m.begin(); it != m.end(); ++it) {
      int64_t* into = it.key() == "head_dim"              ? &file.model.head_dim
                      : it.key() == "num_attention_heads" ? &file.model.num_attention_heads
                      : it.key() == "num_key_value_heads" ? &file.model.num_query_groups
                                                          : nullptr;
      if (into == nullptr) {
        return InvalidArgumentError(source + ": model: unknown key '" + it.key() +
                                    "' (head_dim, num_attention_heads, num_key_value_heads)");
      }
      const nlohmann::json& v = it.value();
      if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > (int64_t{1} << 40)) {
        return InvalidArgumentError(source + ": model: '" + it.key() + "' must be a positive integer");
      }
      *into = v.get<int64_t>();
    }
  }
  std::vector<Rule>& rules = file.rules;
  static const nlohmann::json kNoPatterns = nlohmann::json::array();
  const nlohmann::json& list = doc.contains("patterns") ? doc["patterns"] : kNoPatterns;
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& e = list[i];
    if (!e.is_object()) return EntryError(source, i, "not an object");
    Rule rule;
    bool has_pattern = false;
    bool has_tp = false;
    for (auto it = e.begin(); it != e.end(); ++it) {
      const std::string& key = it.key();
      const nlohmann::json& v = it.value();
      auto small_int = [&](int64_t lo, int64_t hi, int64_t* out) -> Status {
        if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
          return EntryError(source, i, "'" + key + "' must be an integer in [" +
                                           std::to_string(lo) + ", " + std::to_string(hi) + "]");
        }
        *out = v.get<int64_t>();
        return Status::Ok();
      };
      if (key == "pattern") {
        if (!v.is_string()) return EntryError(source, i, "'pattern' must be a string");
        rule.regex = v.get<std::string>();
        has_pattern = true;
      } else if (key == "tp") {
        const std::string s = v.is_string() ? v.get<std::string>() : "";
        if (s == "column") rule.tp = TpKind::kColumn;
        else if (s == "row") rule.tp = TpKind::kRow;
        else if (s == "vocab") rule.tp = TpKind::kVocab;
        else if (s == "replicate") rule.tp = TpKind::kReplicate;
        else if (s == "partial") rule.tp = TpKind::kPartial;
        else return EntryError(source, i, "'tp' must be column, row, vocab, replicate or partial");
        has_tp = true;
      } else if (key == "pp") {
        const std::string s = v.is_string() ? v.get<std::string>() : "";
        if (s == "layer") rule.pp = PpPlacement::kLayer;
        else if (s == "first") rule.pp = PpPlacement::kFirst;
        else if (s == "last") rule.pp = PpPlacement::kLast;
        else if (s == "tied") rule.pp = PpPlacement::kTiedFirstLast;
        else if (s == "all") rule.pp = PpPlacement::kAll;
        else return EntryError(source, i, "'pp' must be layer, first, last, tied or all");
      } else if (key == "tp_dim" || key == "expert_dim") {
        int64_t d = 0;
        UCPFS_RETURN_IF_ERROR(small_int(0, 31, &d));
        (key == "tp_dim" ? rule.tp_dim : rule.expert_dim) = static_cast<int>(d);
      } else if (key == "vocab_pad_multiple") {
        UCPFS_RETURN_IF_ERROR(small_int(0, kMaxVocabPadMultiple, &rule.vocab_pad_multiple));
      } else if (key == "sub_sizes") {
        if (!v.is_array() || v.empty()) {
          return EntryError(source, i, "'sub_sizes' must be a non-empty array of sizes");
        }
        for (const nlohmann::json& s : v) {
          if (!s.is_number_integer() || s.get<int64_t>() <= 0 ||
              s.get<int64_t>() > (int64_t{1} << 48)) {
            return EntryError(source, i, "'sub_sizes' entries must be positive integers");
          }
          rule.sub_sizes.push_back(s.get<int64_t>());
        }
      } else {
        return EntryError(source, i, "unknown key '" + key + "'");
      }
    }
    if (!has_pattern) return EntryError(source, i, "missing 'pattern'");
    if (!has_tp) return EntryError(source, i, "missing 'tp'");
    Result<Rule> made = MakeRule(std::move(rule));
    if (!made.ok()) return made.error().WithContext(source + ": patterns[" + std::to_string(i) + "]");
    rules.push_back(std::move(made).value());
  }
  return file;
}

}  // namespace ucpfs::layout
