// See positional_optim.h.
#include "index/positional_optim.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "index/checkpoint_builder.h"

namespace ucpfs::index {
namespace {

// transformers' Trainer.get_decay_parameter_names: forbidden_name_patterns searched in the
// lower-cased parameter name (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
// r"_norm(?:$|\.)").
bool TrainerNoDecayName(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (n.find("bias") != std::string::npos || n.find("layernorm") != std::string::npos ||
      n.find("rmsnorm") != std::string::npos) {
    return true;
  }
  for (size_t at = n.find("norm"); at != std::string::npos; at = n.find("norm", at + 1)) {
    const size_t end = at + 4;
    const bool ends = end == n.size() || n[end] == '.';
    if (!ends) continue;
    if (at == 0 || n[at - 1] == '.') return true;  // (?:^|\.)norm(?:$|\.)
    if (n[at - 1] == '_') return true;              // _norm(?:$|\.)
  }
  return false;
}

}  // namespace

const char* GroupingRuleName(GroupingRule rule) {
  switch (rule) {
    case GroupingRule::kInOrder: return "in_order";
    case GroupingRule::kTrainerDecay: return "trainer_decay";
    case GroupingRule::kTrainerDecayLayerNorm: return "trainer_decay_layernorm";
  }
  return "unknown";
}

std::optional<GroupingRule> ParseGroupingRule(const std::string& name) {
  for (GroupingRule r : {GroupingRule::kInOrder, GroupingRule::kTrainerDecay, GroupingRule::kTrainerDecayLayerNorm}) {
    if (name == GroupingRuleName(r)) return r;
  }
  return std::nullopt;
}

bool IsHfLlamaFamily(const std::string& model_type) {
  return model_type == "llama" || model_type == "mistral" || model_type == "qwen2" || model_type == "qwen3";
}

const char* ModuleOrderName(ModuleOrder order) {
  switch (order) {
    case ModuleOrder::kHfLlama: return "hf_llama";
    case ModuleOrder::kTorchtuneLlama: return "torchtune_llama";
    case ModuleOrder::kHfGpt2: return "hf_gpt2";
  }
  return "unknown";
}

std::optional<ModuleOrder> HfModuleOrder(const std::string& model_type) {
  if (IsHfLlamaFamily(model_type)) return ModuleOrder::kHfLlama;
  if (model_type == "gpt2") return ModuleOrder::kHfGpt2;
  return std::nullopt;
}

std::optional<ModuleOrder> ParseModuleOrder(const std::string& name) {
  for (ModuleOrder o : {ModuleOrder::kHfLlama, ModuleOrder::kTorchtuneLlama, ModuleOrder::kHfGpt2}) {
    if (name == ModuleOrderName(o)) return o;
  }
  return std::nullopt;
}

bool SortModuleOrder(std::vector<NamedShape>* params, ModuleOrder order) {
  // Rank among siblings, as the modeling code registers them.
  static const std::map<std::string, int> kTorchtuneMlp = {{"gate_proj", 0}, {"down_proj", 1}, {"up_proj", 2}};
  static const std::map<std::string, int> kGpt2 = {
      {"transformer", 0}, {"lm_head", 1}, {"wte", 0},           {"wpe", 1},           {"h", 2},
      {"ln_f", 3},        {"ln_1", 0},    {"attn", 1},          {"ln_2", 2},          {"crossattention", 3},
      {"ln_cross_attn", 4}, {"mlp", 5},   {"c_attn", 0},        {"q_attn", 1},        {"c_fc", 0},
      {"c_proj", 2},      {"weight", 0},  {"bias", 1}};
  static const std::map<std::string, int> kRank = {
      {"model", 0},          {"lm_head", 1},      {"embed_tokens", 0}, {"layers", 1},
      {"norm", 2},           {"self_attn", 0},    {"mlp", 1},          {"input_layernorm", 2},
      {"post_attention_layernorm", 3}, {"q_proj", 0}, {"k_proj", 1},   {"v_proj", 2},
      {"o_proj", 3},         {"q_norm", 4},       {"k_norm", 5},       {"gate_proj", 0},
      {"up_proj", 1},        {"down_proj", 2},    {"weight", 0},       {"bias", 1}};
  std::vector<std::pair<std::vector<int64_t>, size_t>> keys;
  for (size_t i = 0; i < params->size(); ++i) {
    std::vector<int64_t> key;
    const std::string& name = (*params)[i].name;
    size_t start = 0;
    while (start <= name.size()) {
      const size_t dot = std::min(name.find('.', start), name.size());
      const std::string part = name.substr(start, dot - start);
      start = dot + 1;
      if (!part.empty() && part.size() <= 9 && std::all_of(part.begin(), part.end(), ::isdigit)) {
        key.push_back(std::stoll(part));
        continue;
      }
      if (order == ModuleOrder::kTorchtuneLlama && kTorchtuneMlp.count(part)) {
        key.push_back(kTorchtuneMlp.at(part));
        continue;
      }
      const std::map<std::string, int>& ranks = order == ModuleOrder::kHfGpt2 ? kGpt2 : kRank;
      auto it = ranks.find(part);
      if (it == ranks.end()) return false;
      key.push_back(it->second);
    }
    keys.emplace_back(std::move(key), i);
  }
  std::sort(keys.begin(), keys.end());
  std::vector<NamedShape> sorted;
  for (const auto& k : keys) sorted.push_back(std::move((*params)[k.second]));
  *params = std::move(sorted);
  return true;
}

std::optional<std::vector<std::vector<std::string>>> RuleGroups(const std::vector<NamedShape>& params,
                                                               const std::vector<std::vector<int64_t>>& groups,
                                                               GroupingRule rule) {
  std::vector<std::vector<std::string>> out;
  if (rule == GroupingRule::kInOrder) {
    size_t next = 0;
    for (const auto& g : groups) {
      if (params.size() - next < g.size()) return std::nullopt;
      std::vector<std::string> names;
      for (size_t i = 0; i < g.size(); ++i) names.push_back(params[next + i].name);
      next += g.size();
      out.push_back(std::move(names));
    }
    if (next != params.size()) return std::nullopt;
    return out;
  }
  // The Trainer: [decay, no decay], each in named_parameters() order.
  std::set<std::string> layer_norm;
  if (rule == GroupingRule::kTrainerDecayLayerNorm) {
    std::map<std::string, const NamedShape*> by_name;
    for (const auto& p : params) by_name[p.name] = &p;
    for (const auto& p : params) {
      const std::string suffix = ".weight";
      if (p.shape.size() != 1 || p.name.size() <= suffix.size() ||
          p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) != 0) {
        continue;
      }
      auto bias = by_name.find(p.name.substr(0, p.name.size() - suffix.size()) + ".bias");
      if (bias != by_name.end() && bias->second->shape == p.shape) layer_norm.insert(p.name);
    }
  }
  std::vector<std::string> decay, no_decay;
  for (const auto& p : params) {
    (TrainerNoDecayName(p.name) || layer_norm.count(p.name) ? no_decay : decay).push_back(p.name);
  }
  if (groups.size() != 2 || groups[0].size() != decay.size() || groups[1].size() != no_decay.size()) {
    return std::nullopt;
  }
  out.push_back(std::move(decay));
  out.push_back(std::move(no_decay));
  return out;
}

std::optional<std::vector<std::pair<int64_t, std::string>>> AssignPositions(
    const std::vector<NamedShape>& params, const std::vector<std::vector<int64_t>>& groups, GroupingRule rule) {
  auto names = RuleGroups(params, groups, rule);
  if (!names) return std::nullopt;
  std::vector<std::pair<int64_t, std::string>> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].size(); ++i) out.emplace_back(groups[g][i], (*names)[g][i]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

PositionalMatch MatchPositions(const std::vector<NamedShape>& params, const PositionalOptimizer& optimizer,
                               const std::vector<GroupingRule>& rules) {
  PositionalMatch result;
  std::map<std::string, const std::vector<int64_t>*> shape_of;
  for (const auto& p : params) shape_of[p.name] = &p.shape;
  // Every position appears once.
  std::set<int64_t> seen;
  size_t n_positions = 0;
  for (const auto& g : optimizer.group_positions) {
    for (int64_t p : g) {
      ++n_positions;
      if (!seen.insert(p).second) {
        result.why_not = "position " + std::to_string(p) + " is listed in two param groups";
        return result;
      }
    }
  }
  std::vector<std::string> tried;
  std::vector<std::pair<GroupingRule, std::vector<std::pair<int64_t, std::string>>>> fits;
  for (GroupingRule rule : rules) {
    auto assigned = AssignPositions(params, optimizer.group_positions, rule);
    if (!assigned) {
      tried.push_back(std::string(GroupingRuleName(rule)) + ": its groups are not the saved groups' sizes");
      continue;
    }
    std::map<int64_t, std::string> by_position(assigned->begin(), assigned->end());
    std::string bad;
    for (const auto& [position, shape] : optimizer.state_shapes) {
      auto it = by_position.find(position);
      if (it == by_position.end()) {
        bad = "state of position " + std::to_string(position) + ", which no param group lists";
        break;
      }
      if (*shape_of[it->second] != shape) {
        bad = "position " + std::to_string(position) + " would be '" + it->second + "' of shape " +
              JoinInts(*shape_of[it->second]) + " but its state has shape " + JoinInts(shape);
        break;
      }
    }
    if (!bad.empty()) {
      tried.push_back(std::string(GroupingRuleName(rule)) + ": " + bad);
      continue;
    }
    bool same = false;
    for (const auto& f : fits) same = same || f.second == *assigned;
    if (!same) fits.emplace_back(rule, std::move(*assigned));
  }
  if (fits.size() == 1) {
    result.rule = fits[0].first;
    result.names = std::move(fits[0].second);
    return result;
  }
  const std::string counts = std::to_string(n_positions) + " positions in " +
                             std::to_string(optimizer.group_positions.size()) + " param group(s), " +
                             std::to_string(params.size()) + " parameters";
  if (fits.empty()) {
    result.why_not = "no grouping rule fits (" + counts + ")";
    for (const auto& t : tried) result.why_not += "; " + t;
    return result;
  }
  result.why_not = "ambiguous: " + std::to_string(fits.size()) + " grouping rules fit with different parameters (" +
                   counts + "):";
  for (const auto& [rule, names] : fits) {
    result.why_not += std::string(" ") + GroupingRuleName(rule) + " [";
    for (size_t i = 0; i < names.size() && i < 4; ++i) {
      result.why_not += (i ? ", " : "") + std::to_string(names[i].first) + "=" + names[i].second;
    }
    result.why_not += names.size() > 4 ? ", ...]" : "]";
  }
  return result;
}

}  // namespace ucpfs::index
