// Key mapping (see key_map.h): rules, rules files, the checkpoint's structure (optimizer and
// model prefixes), and the mapping of a checkpoint's keys.
//
// Not for: anything about bytes; a rule names a parameter and a state, nothing else (the
// structure reads global shapes only to tell which prefix holds the optimizer's parameters).
// Invariants: every item ends up in exactly one of params / unmapped_keys / other_items (a
// kBytes item is a parameter's state only as its step); the result depends only on the keys,
// their order, kinds and global shapes.
// GCC 12 with -fsanitize=address,undefined -O2 reports a false -Wmaybe-uninitialized inside
// libstdc++'s <regex> compiler (std::function in _State, GCC PR 105562); it must be off
// before <regex> is first included (by key_map.h) to cover the header's locations.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "index/key_map.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

namespace ucpfs::index {
namespace {

constexpr size_t kMaxMatchedKeyBytes = 1024;

constexpr const char* kStateNamesHelp = "weight, fp32 (or fp32_param, param), exp_avg, exp_avg_sq, step";

// The literal text every match of `pattern` must start with (from a leading "^abc\.def"), used
// to skip most rules without running the regex. Conservative: any doubt ends the prefix.
std::string LiteralPrefix(const std::string& pattern) {
  // A top-level alternation ("^a|b") makes any prefix wrong.
  int depth = 0;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\') {
      ++i;
      continue;
    }
    if (in_class) {
      if (c == ']') in_class = false;
      continue;
    }
    if (c == '[') in_class = true;
    else if (c == '(') ++depth;
    else if (c == ')') --depth;
    else if (c == '|' && depth == 0) return "";
  }
  std::string prefix;
  size_t i = 0;
  if (!pattern.empty() && pattern[0] == '^') i = 1;
  for (; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\') {
      if (i + 1 >= pattern.size()) break;
      char n = pattern[i + 1];
      if (std::isalnum(static_cast<unsigned char>(n)) || n == '_') break;  // \d, \w, \1, \x..
      prefix.push_back(n);
      ++i;
      continue;
    }
    if (std::strchr("*+?{", c) != nullptr) {
      if (!prefix.empty()) prefix.pop_back();  // the quantifier applies to the last literal
      break;
    }
    if (std::strchr(".^$()[]|}", c) != nullptr) break;
    prefix.push_back(c);
  }
  return prefix;
}

// Checks every $n of an ECMAScript replacement against the pattern's group count.
Status CheckGroupRefs(const std::string& replacement, unsigned n_groups, const char* field) {
  for (size_t i = 0; i < replacement.size(); ++i) {
    if (replacement[i] != '$' || i + 1 >= replacement.size()) continue;
    char n = replacement[i + 1];
    if (n == '$') {
      ++i;
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(n))) continue;
    unsigned group = static_cast<unsigned>(n - '0');
    // libstdc++ reads two digits when two follow ("$12").
    if (i + 2 < replacement.size() && std::isdigit(static_cast<unsigned char>(replacement[i + 2]))) {
      group = group * 10 + static_cast<unsigned>(replacement[i + 2] - '0');
    }
    if (group > n_groups) {
      return InvalidArgumentError(std::string(field) + " '" + replacement + "' refers to group $" +
                                  std::to_string(group) + " but the pattern has " +
                                  std::to_string(n_groups) + " group(s)");
    }
  }
  return Status::Ok();
}

KeyRule Rule(std::string pattern, std::string param, StateKind state, std::string state_ref = "") {
  KeyRule r;
  r.pattern = std::move(pattern);
  r.param = std::move(param);
  r.state = state;
  r.state_ref = std::move(state_ref);
  return r;
}

KeyRule IgnoreRule(std::string pattern) {
  KeyRule r;
  r.pattern = std::move(pattern);
  r.ignore = true;
  return r;
}

struct MatcherRule {
  const KeyRule* rule;
  std::string prefix;
  std::string label;  // "user rule 2 (pattern ...)" / "built-in rule 5 (...)"
};

// The built-in rules of `checkpoint`: a weights-only source's (its scanner's facts say so), else
// the training checkpoints'.
const std::vector<KeyRule>& CompiledBuiltins(const Checkpoint& checkpoint) {
  static const std::vector<KeyRule> rules = BuiltinRules();
  static const std::vector<KeyRule> weights = BuiltinRules("weights");
  return std::holds_alternative<WeightsSourceFacts>(checkpoint.facts) ? weights : rules;
}

Result<std::string> ReadWholeFile(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return NotFoundError(path + ": no such rules file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError(path + ": cannot open rules file: " + std::strerror(errno), errno);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return IoError(path + ": error reading rules file", EIO);
  return ss.str();
}

// One rule's fields as read from JSON or TOML, before validation.
struct RawRule {
  std::optional<std::string> pattern, param, state;
  bool ignore = false;
};

Result<KeyRule> RuleFromRaw(const RawRule& raw) {
  if (!raw.pattern) return InvalidArgumentError("missing \"pattern\"");
  KeyRule rule;
  rule.pattern = *raw.pattern;
  rule.ignore = raw.ignore;
  if (raw.param) rule.param = *raw.param;
  if (raw.state) {
    if (raw.state->find('$') != std::string::npos) {
      rule.state_ref = *raw.state;
    } else if (std::optional<StateKind> kind = ParseStateKind(*raw.state)) {
      rule.state = *kind;
    } else {
      return InvalidArgumentError("unknown state \"" + *raw.state + "\" (expected " +
                                  kStateNamesHelp + ", or a group reference like \"$2\")");
    }
  }
  UCPFS_RETURN_IF_ERROR(CompileRule(&rule));
  return rule;
}

// Rules from a parsed document {"rules": [{pattern, param, state, ignore}, ...]}: a JSON file,
// or a TOML file converted to JSON, so both formats share one validation.
Result<std::vector<KeyRule>> RulesFromDoc(const std::string& path, const nlohmann::json& doc,
                                          const std::string& expected) {
  using nlohmann::json;
  if (!doc.is_object() || !doc.contains("rules") || !doc["rules"].is_array()) {
    return InvalidArgumentError(path + ": " + expected);
  }
  std::vector<KeyRule> rules;
  const json& list = doc["rules"];
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = path + ": rules[" + std::to_string(i) + "]";
    const json& r = list[i];
    if (!r.is_object()) return InvalidArgumentError(where + ": expected an object (a table in TOML)");
    RawRule raw;
    for (const auto& [name, value] : r.items()) {
      if (name == "pattern" || name == "param" || name == "state") {
        if (!value.is_string()) return InvalidArgumentError(where + ": \"" + name + "\" must be a string");
        std::string text = value.get<std::string>();
        (name == "pattern" ? raw.pattern : name == "param" ? raw.param : raw.state) = std::move(text);
      } else if (name == "ignore") {
        if (!value.is_boolean()) return InvalidArgumentError(where + ": \"ignore\" must be true or false");
        raw.ignore = value.get<bool>();
      } else {
        return InvalidArgumentError(where + ": unknown field \"" + name +
                                    "\" (expected pattern, param, state, ignore)");
      }
    }
    Result<KeyRule> rule = RuleFromRaw(raw);
    if (!rule.ok()) return rule.error().WithContext(where);
    rules.push_back(std::move(rule).value());
  }
  return rules;
}

Result<std::vector<KeyRule>> ParseJsonRules(const std::string& path, const std::string& text) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(path + ": invalid JSON: " + e.what());
  }
  return RulesFromDoc(path, doc, "expected an object with a \"rules\" array");
}

Result<std::vector<KeyRule>> ParseTomlRules(const std::string& path, const std::string& text) {
  toml::table doc;
  try {
    doc = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    const auto& where = e.source().begin;
    return InvalidArgumentError(path + ": invalid TOML at line " + std::to_string(where.line) +
                                ", column " + std::to_string(where.column) + ": " +
                                std::string(e.description()));
  }
  const toml::node* list = doc.get("rules");
  if (list == nullptr || !list->is_array()) return InvalidArgumentError(path + ": expected [[rules]] tables");
  for (const auto& [name, value] : doc) {
    (void)value;
    if (name.str() != "rules") {
      return InvalidArgumentError(path + ": unknown top-level key \"" + std::string(name.str()) + "\"");
    }
  }
  std::ostringstream as_json;
  as_json << toml::json_formatter{doc};
  return RulesFromDoc(path, nlohmann::json::parse(as_json.str()), "expected [[rules]] tables");
}

}  // namespace

const char* StateKindName(StateKind kind) {
  switch (kind) {
    case StateKind::kWeight: return "weight";
    case StateKind::kFp32: return "fp32";
    case StateKind::kExpAvg: return "exp_avg";
    case StateKind::kExpAvgSq: return "exp_avg_sq";
    case StateKind::kStep: return "step";
  }
  return "unknown";
}

std::optional<StateKind> ParseStateKind(std::string_view name) {
  if (name == "weight") return StateKind::kWeight;
  if (name == "fp32" || name == "fp32_param" || name == "param") return StateKind::kFp32;
  if (name == "exp_avg") return StateKind::kExpAvg;
  if (name == "exp_avg_sq") return StateKind::kExpAvgSq;
  if (name == "step") return StateKind::kStep;
  return std::nullopt;
}

Status CompileRule(KeyRule* rule) {
  if (rule->pattern.empty()) return InvalidArgumentError("empty pattern");
  try {
    rule->compiled = std::regex(rule->pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return InvalidArgumentError("invalid regex \"" + rule->pattern + "\": " + e.what());
  }
  if (rule->ignore) return Status::Ok();
  const unsigned n_groups = static_cast<unsigned>(rule->compiled.mark_count());
  if (rule->param.empty()) {
    if (n_groups == 0) {
      return InvalidArgumentError("no \"param\" given and pattern \"" + rule->pattern +
                                  "\" has no group to default to ($1)");
    }
    rule->param = "$1";
  }
  UCPFS_RETURN_IF_ERROR(CheckGroupRefs(rule->param, n_groups, "param"));
  UCPFS_RETURN_IF_ERROR(CheckGroupRefs(rule->state_ref, n_groups, "state"));
  return Status::Ok();
}

namespace {

bool IsPosition(const std::string& name) {
  return !name.empty() && name.size() <= 9 &&
         std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// torch.optim's own state_dict (saved as is, e.g. `{"optim": optimizer.state_dict()}`) keys
// each parameter's state by its position in model.parameters(): `optim.state.<i>.exp_avg`.
// When the checkpoint's model tensors are exactly those positions (as many, in the saved
// order: every tensor a parameter, no buffers), position i is the i-th of them; otherwise the
// positions stay unmatched and the views report them.
void MatchPositionalOptimizerState(KeyMapping* m) {
  auto has_model_tensor = [](const ParamEntry& p) {
    return p.item[static_cast<size_t>(StateKind::kWeight)] >= 0 ||
           p.item[static_cast<size_t>(StateKind::kFp32)] >= 0;
  };
  std::vector<size_t> weights, positions;
  int64_t max_position = -1;
  for (size_t i = 0; i < m->params.size(); ++i) {
    const ParamEntry& p = m->params[i];
    if (has_model_tensor(p)) {
      weights.push_back(i);
    } else if (IsPosition(p.name)) {
      positions.push_back(i);
      max_position = std::max<int64_t>(max_position, std::stoll(p.name));
    }
  }
  if (positions.empty() || max_position + 1 != static_cast<int64_t>(weights.size())) return;
  for (size_t i : positions) {
    ParamEntry& target = m->params[weights[static_cast<size_t>(std::stoll(m->params[i].name))]];
    for (int k = 0; k < kNumStateKinds; ++k) {
      if (target.item[static_cast<size_t>(k)] >= 0 && m->params[i].item[static_cast<size_t>(k)] >= 0) return;
    }
  }
  for (size_t i : positions) {
    ParamEntry& target = m->params[weights[static_cast<size_t>(std::stoll(m->params[i].name))]];
    for (int k = 0; k < kNumStateKinds; ++k) {
      if (m->params[i].item[static_cast<size_t>(k)] >= 0) target.item[static_cast<size_t>(k)] = m->params[i].item[static_cast<size_t>(k)];
    }
  }
  m->positional_names.clear();
  for (size_t i : weights) m->positional_names.push_back(m->params[i].name);
  std::vector<ParamEntry> kept;
  for (size_t i = 0; i < m->params.size(); ++i) {
    if (has_model_tensor(m->params[i])) kept.push_back(std::move(m->params[i]));
  }
  m->params = std::move(kept);
}

// ---- the checkpoint's structure (see MapKeys in key_map.h) ------------------------------------

constexpr std::string_view kWrapperComponents[] = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"};

bool IsWrapperComponent(std::string_view part) {
  return std::find(std::begin(kWrapperComponents), std::end(kWrapperComponents), part) != std::end(kWrapperComponents);
}

// Whether `prefix` ("" or ending in '.') ends in a wrapper component.
bool EndsInWrapperComponent(std::string_view prefix) {
  if (prefix.size() < 2) return false;
  prefix.remove_suffix(1);
  const size_t dot = prefix.rfind('.');
  return IsWrapperComponent(dot == std::string_view::npos ? prefix : prefix.substr(dot + 1));
}

// A key of the form `<prefix>state.<fqn>.<field>`, split at its leftmost `state` component.
struct OptimizerKey {
  std::string prefix;  // "" or ending in '.'
  std::string fqn;
  StateKind kind = StateKind::kWeight;
  bool moment_or_master = false;  // exp_avg, exp_avg_sq, fp32_param or master_param (not step)
};

std::optional<OptimizerKey> SplitOptimizerKey(const std::string& key) {
  constexpr std::string_view kState = "state.";
  size_t p = 0;
  for (;; ++p) {
    p = key.find(kState, p);
    if (p == std::string::npos) return std::nullopt;
    if (p == 0 || key[p - 1] == '.') break;
  }
  const size_t begin = p + kState.size();
  const size_t dot = key.rfind('.');
  if (dot == std::string::npos || dot <= begin) return std::nullopt;
  const std::string_view field = std::string_view(key).substr(dot + 1);
  OptimizerKey out;
  if (field == "exp_avg") {
    out.kind = StateKind::kExpAvg;
  } else if (field == "exp_avg_sq") {
    out.kind = StateKind::kExpAvgSq;
  } else if (field == "step") {
    out.kind = StateKind::kStep;
  } else if (field == "fp32_param" || field == "master_param") {
    out.kind = StateKind::kFp32;
  } else {
    return std::nullopt;
  }
  out.moment_or_master = out.kind != StateKind::kStep;
  out.prefix = key.substr(0, p);
  out.fqn = key.substr(begin, dot - begin);
  return out;
}

// Whether `key` is `<prefix>param_groups` or lies under it.
bool IsParamGroupsKey(const std::string& key, const std::string& prefix) {
  constexpr std::string_view kGroups = "param_groups";
  if (key.compare(0, prefix.size(), prefix) != 0) return false;
  const std::string_view rest = std::string_view(key).substr(prefix.size());
  return rest == kGroups || (rest.starts_with(kGroups) && rest.size() > kGroups.size() && rest[kGroups.size()] == '.');
}

std::string Quoted(const std::string& prefix) { return "'" + prefix + "'"; }

// What MapKeys decides from the structure of the keys no user rule matched.
struct Structure {
  std::vector<std::string> optimizers;  // prefixes, in order of first key
  std::unordered_set<std::string> ambiguous_optimizers;
  std::unordered_set<std::string> fqns;  // the unambiguous optimizers' parameters, stripped
  std::optional<std::string> model_prefix;
  std::vector<std::string> ambiguities;

  bool IsOptimizer(const std::string& prefix) const {
    return std::find(optimizers.begin(), optimizers.end(), prefix) != optimizers.end();
  }
};

// `considered[i]`: item i is not matched by a user rule (and not over-long).
Structure FindStructure(const Checkpoint& c, const std::vector<bool>& considered) {
  Structure s;
  std::unordered_map<std::string, std::unordered_set<std::string>> fqns_of;  // prefix -> fqns
  std::unordered_map<std::string, const std::vector<int64_t>*> shape_of;      // fqn -> exp_avg's shape
  for (size_t i = 0; i < c.items.size(); ++i) {
    const Item& it = c.items[i];
    if (!considered[i] || it.kind != ItemKind::kTensor) continue;
    std::optional<OptimizerKey> k = SplitOptimizerKey(it.key);
    if (!k || !k->moment_or_master || IsPosition(k->fqn)) continue;
    auto [entry, fresh] = fqns_of.try_emplace(k->prefix);
    if (fresh) s.optimizers.push_back(k->prefix);
    std::string fqn = StripWrapperComponents(k->fqn);
    if (k->kind == StateKind::kExpAvg) shape_of.try_emplace(fqn, &it.layout.shape);
    entry->second.insert(std::move(fqn));
  }
  // Two optimizers over the same parameters: which one a resume wants is not in the keys.
  for (size_t a = 0; a < s.optimizers.size(); ++a) {
    for (size_t b = a + 1; b < s.optimizers.size(); ++b) {
      const auto& fa = fqns_of[s.optimizers[a]];
      const auto& fb = fqns_of[s.optimizers[b]];
      const auto shared = std::find_if(fa.begin(), fa.end(), [&](const std::string& f) { return fb.count(f) != 0; });
      if (shared == fa.end()) continue;
      s.ambiguous_optimizers.insert(s.optimizers[a]);
      s.ambiguous_optimizers.insert(s.optimizers[b]);
      s.ambiguities.push_back("optimizer state of the same parameters (e.g. '" + *shared + "') under both " +
                              Quoted(s.optimizers[a] + "state.") + " and " + Quoted(s.optimizers[b] + "state.") +
                              ": neither is served; a --rules file mapping one of them (and ignoring the other) "
                              "settles it");
    }
  }
  for (const std::string& p : s.optimizers) {
    if (s.ambiguous_optimizers.count(p) == 0) s.fqns.insert(fqns_of[p].begin(), fqns_of[p].end());
  }
  if (s.fqns.empty()) return s;

  // Candidate model prefixes: every component boundary of every other tensor key whose rest
  // names an optimizer fqn of the same shape.
  std::map<std::string, std::unordered_set<std::string>> named;  // prefix -> fqns it names
  for (size_t i = 0; i < c.items.size(); ++i) {
    const Item& it = c.items[i];
    if (!considered[i] || it.kind != ItemKind::kTensor) continue;
    if (std::optional<OptimizerKey> k = SplitOptimizerKey(it.key); k && fqns_of.count(k->prefix) != 0) continue;
    for (size_t b = 0; b < it.key.size(); b = it.key.find('.', b) + 1) {
      std::string rest = StripWrapperComponents(std::string_view(it.key).substr(b));
      // A prefix ending in a wrapper component is the prefix before it (stripped alike).
      if (s.fqns.count(rest) != 0 && !EndsInWrapperComponent(std::string_view(it.key).substr(0, b))) {
        auto shape = shape_of.find(rest);
        if (shape == shape_of.end() || *shape->second == it.layout.shape) named[it.key.substr(0, b)].insert(rest);
      }
      if (it.key.find('.', b) == std::string::npos) break;
    }
  }
  size_t best = 0;
  std::vector<std::string> best_prefixes;
  for (const auto& [prefix, f] : named) {
    if (f.size() > best) {
      best = f.size();
      best_prefixes = {prefix};
    } else if (f.size() == best) {
      best_prefixes.push_back(prefix);
    }
  }
  if (best_prefixes.size() == 1) {
    s.model_prefix = best_prefixes.front();
  } else if (best_prefixes.size() > 1) {
    std::string list;
    for (const auto& p : best_prefixes) list += (list.empty() ? "" : ", ") + Quoted(p);
    s.ambiguities.push_back("the optimizer's " + std::to_string(best) + " parameters appear as weights under " +
                            std::to_string(best_prefixes.size()) + " prefixes (" + list +
                            "): none is taken as the model; a --rules file naming the model's keys settles it");
  }
  return s;
}

}  // namespace

std::string StripWrapperComponents(std::string_view name) {
  std::string out;
  out.reserve(name.size());
  size_t begin = 0;
  while (begin <= name.size()) {
    size_t end = name.find('.', begin);
    if (end == std::string_view::npos) end = name.size();
    const std::string_view part = name.substr(begin, end - begin);
    if (!IsWrapperComponent(part)) {
      if (!out.empty()) out.push_back('.');
      out.append(part);
    }
    begin = end + 1;
  }
  return out.empty() ? std::string(name) : out;
}

std::vector<KeyRule> BuiltinRules(std::string_view format) {
  std::vector<KeyRule> rules;
  if (format == "weights") {
    // A weights-only source holds nothing but the model's state dict: every tensor is the
    // weight its name says, "model." prefix and all (Hugging Face names keep it).
    rules.push_back(Rule(R"(^(.+)$)", "$1", StateKind::kWeight));
    Status s = CompileRule(&rules.back());
    (void)s;
    return rules;
  }
  rules = {
      // Optimizer state, most specific first.
      // torchtitan: optimizer.state.<fqn>.<k>
      Rule(R"(^optim(?:izer)?\.state\.(.+)\.(exp_avg|exp_avg_sq|step)$)", "$1", StateKind::kWeight, "$2"),
      // torch.distributed.checkpoint.state_dict flattening: state.<fqn>.<k>
      Rule(R"(^state\.(.+)\.(exp_avg|exp_avg_sq|step)$)", "$1", StateKind::kWeight, "$2"),
      // fp32 masters kept beside the moments (mixed-precision trainers on top of torchtitan).
      Rule(R"(^(?:optimizer\.)?state\.(.+)\.(?:fp32_param|master_param)$)", "$1", StateKind::kFp32),
      // Megatron distributed optimizer: optimizer.state.{param,fp32_param}.<key> (fp32 master);
      // the key of a model wrapped in Megatron's DDP starts with `module.` (dropped, as below);
      // a ChainedOptimizer (MoE: dense and expert parameters) prefixes `chained_<i>.`.
      Rule(R"(^(?:chained_\d+\.)?optimizer\.state\.(param|fp32_param)\.(?:module\.)?(.+)$)", "$2", StateKind::kFp32),
      // Megatron: optimizer.state.{exp_avg,exp_avg_sq}.<key>
      Rule(R"(^(?:chained_\d+\.)?optimizer\.state\.(exp_avg|exp_avg_sq)\.(?:module\.)?(.+)$)", "$2",
           StateKind::kWeight, "$1"),
      // Known non-parameter state (served in extra_state.pt, or as optim.pt's param_groups).
      IgnoreRule(R"(^optim(?:izer)?\.param_groups(\..*)?$)"),
      IgnoreRule(R"(^param_groups(\..*)?$)"),
      IgnoreRule(R"(^lr_scheduler(\..*)?$)"),
      IgnoreRule(R"(^dataloader(\..*)?$)"),
      IgnoreRule(R"(^train_state(\..*)?$)"),
      IgnoreRule(R"(^(?:chained_\d+\.)?optimizer\.distributed\..*$)"),
      IgnoreRule(R"(^common_state.*$)"),
      IgnoreRule(R"(^rng_state.*$)"),
      IgnoreRule(R"(^(.*\.)?_extra_state.*$)"),  // Transformer Engine's FP8 metadata
      // Model weights.
      Rule(R"(^model\.(.+)$)", "$1", StateKind::kWeight),
      // Any other weight/bias: torchtitan fqns, Megatron keys (incl. Transformer Engine's fused
      // linear_qkv.layer_norm_weight / layer_norm_bias).
      // A leading `module.` is what a DDP wrapper (Megatron's) adds to the model's own names.
      Rule(R"(^(?:module\.)?(.+\.(weight|bias|layer_norm_weight|layer_norm_bias))$)", "$1", StateKind::kWeight),
      Rule(R"(^(?:module\.)?(.+embeddings)$)", "$1", StateKind::kWeight),
  };
  for (KeyRule& r : rules) {
    Status s = CompileRule(&r);
    (void)s;  // the built-ins are tested to compile (key_map_test)
  }
  return rules;
}

Result<std::vector<KeyRule>> LoadRules(const std::string& path) {
  std::string ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (ext != ".json" && ext != ".toml") {
    return InvalidArgumentError(path + ": unknown rules file type \"" + ext +
                                "\" (expected .json or .toml)");
  }
  UCPFS_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  return ext == ".json" ? ParseJsonRules(path, text) : ParseTomlRules(path, text);
}

Result<KeyMapping> MapKeys(const Checkpoint& checkpoint, const std::vector<KeyRule>& user_rules) {
  std::vector<KeyRule> user;
  user.reserve(user_rules.size());
  for (size_t i = 0; i < user_rules.size(); ++i) {
    KeyRule r = user_rules[i];
    Status s = CompileRule(&r);
    if (!s.ok()) return s.WithContext("user rule " + std::to_string(i));
    user.push_back(std::move(r));
  }
  const std::vector<KeyRule>& builtins = CompiledBuiltins(checkpoint);
  std::vector<MatcherRule> rules;
  rules.reserve(user.size() + builtins.size());
  for (size_t i = 0; i < user.size(); ++i) {
    rules.push_back({&user[i], LiteralPrefix(user[i].pattern),
                     "user rule " + std::to_string(i) + " (\"" + user[i].pattern + "\")"});
  }
  for (size_t i = 0; i < builtins.size(); ++i) {
    rules.push_back({&builtins[i], LiteralPrefix(builtins[i].pattern),
                     "built-in rule " + std::to_string(i) + " (\"" + builtins[i].pattern + "\")"});
  }

  KeyMapping out;
  std::unordered_map<std::string, size_t> param_index;
  auto assign = [&](const std::string& name, StateKind state, size_t item) -> Status {
    auto [it, inserted] = param_index.try_emplace(name, out.params.size());
    if (inserted) {
      ParamEntry entry;
      entry.name = name;
      entry.item.fill(-1);
      out.params.push_back(std::move(entry));
    }
    int32_t& slot = out.params[it->second].item[static_cast<size_t>(state)];
    if (slot >= 0) {
      return InvalidArgumentError("keys \"" + checkpoint.items[static_cast<size_t>(slot)].key +
                                  "\" and \"" + checkpoint.items[item].key + "\" both map to " +
                                  StateKindName(state) + " of parameter \"" + name + "\"");
    }
    slot = static_cast<int32_t>(item);
    return Status::Ok();
  };

  if (checkpoint.items.size() > static_cast<size_t>(INT32_MAX)) {
    return ResourceExhaustedError("too many items to map (" + std::to_string(checkpoint.items.size()) + ")");
  }
  std::vector<size_t> unmatched;
  std::smatch m;
  // The first user rule matching each item (the structure is read from the other items).
  auto first_hit = [&](const std::string& key, size_t begin, size_t end) -> const MatcherRule* {
    for (size_t r = begin; r < end; ++r) {
      if (key.compare(0, rules[r].prefix.size(), rules[r].prefix) != 0) continue;
      if (std::regex_match(key, m, rules[r].rule->compiled)) return &rules[r];
    }
    return nullptr;
  };
  std::vector<bool> considered(checkpoint.items.size());
  for (size_t i = 0; i < checkpoint.items.size(); ++i) {
    const std::string& key = checkpoint.items[i].key;
    considered[i] = key.size() <= kMaxMatchedKeyBytes && first_hit(key, 0, user.size()) == nullptr;
  }
  Structure structure = FindStructure(checkpoint, considered);
  for (const std::string& p : structure.optimizers) {
    if (structure.ambiguous_optimizers.count(p) == 0) out.optimizer_prefixes.push_back(p);
  }
  if (structure.model_prefix) out.model_prefix = *structure.model_prefix;
  out.ambiguities = structure.ambiguities;

  for (size_t i = 0; i < checkpoint.items.size(); ++i) {
    const Item& item = checkpoint.items[i];
    const bool tensor = item.kind == ItemKind::kTensor;
    if (item.key.size() > kMaxMatchedKeyBytes) {
      if (tensor) {
        unmatched.push_back(i);
      } else {
        out.other_items.push_back(static_cast<int32_t>(i));
      }
      continue;
    }
    const MatcherRule* hit = considered[i] ? nullptr : first_hit(item.key, 0, user.size());
    if (hit == nullptr) {
      // The structure: an optimizer's state and param groups, then (after the built-in ignore
      // rules) the model's weights under its prefix.
      std::optional<OptimizerKey> ok = SplitOptimizerKey(item.key);
      if (ok && structure.IsOptimizer(ok->prefix) && !IsPosition(ok->fqn)) {
        if (structure.ambiguous_optimizers.count(ok->prefix) != 0 || (!tensor && ok->kind != StateKind::kStep)) {
          if (tensor) {
            out.unmapped_keys.push_back(item.key);
          } else {
            out.other_items.push_back(static_cast<int32_t>(i));
          }
          continue;
        }
        UCPFS_RETURN_IF_ERROR(assign(StripWrapperComponents(ok->fqn), ok->kind, i));
        continue;
      }
      if (std::any_of(structure.optimizers.begin(), structure.optimizers.end(),
                      [&](const std::string& p) { return IsParamGroupsKey(item.key, p); })) {
        out.other_items.push_back(static_cast<int32_t>(i));
        continue;
      }
      hit = first_hit(item.key, user.size(), rules.size());
      if (tensor && structure.model_prefix && (hit == nullptr || !hit->rule->ignore)) {
        const std::string& w = *structure.model_prefix;
        std::string name;
        if (!w.empty() && item.key.size() > w.size() && item.key.compare(0, w.size(), w) == 0) {
          name = StripWrapperComponents(std::string_view(item.key).substr(w.size()));
        } else if (w.empty() && structure.fqns.count(StripWrapperComponents(item.key)) != 0) {
          name = StripWrapperComponents(item.key);
        }
        if (!name.empty()) {
          UCPFS_RETURN_IF_ERROR(assign(name, StateKind::kWeight, i));
          continue;
        }
      }
    }
    if (hit == nullptr) {
      if (tensor) {
        unmatched.push_back(i);
      } else {
        out.other_items.push_back(static_cast<int32_t>(i));
      }
      continue;
    }
    const KeyRule& rule = *hit->rule;
    if (rule.ignore) {
      out.other_items.push_back(static_cast<int32_t>(i));
      continue;
    }
    std::string name = m.format(rule.param);
    if (name.empty()) {
      return InvalidArgumentError("key \"" + item.key + "\": " + hit->label +
                                  " gives an empty parameter name");
    }
    StateKind state = rule.state;
    if (!rule.state_ref.empty()) {
      std::string state_name = m.format(rule.state_ref);
      std::optional<StateKind> kind = ParseStateKind(state_name);
      if (!kind) {
        return InvalidArgumentError("key \"" + item.key + "\": " + hit->label + " gives state \"" +
                                    state_name + "\" (expected " + kStateNamesHelp + ")");
      }
      state = *kind;
    }
    // A non-tensor value is a parameter's state only as its step (an int or float some
    // optimizers keep); any other non-tensor item is non-parameter state.
    if (!tensor && state != StateKind::kStep) {
      out.other_items.push_back(static_cast<int32_t>(i));
      continue;
    }
    UCPFS_RETURN_IF_ERROR(assign(name, state, i));
  }

  // A bare key equal to a known parameter's name is its weight (see key_map.h).
  for (size_t i : unmatched) {
    const std::string& key = checkpoint.items[i].key;
    auto it = param_index.find(key);
    if (it != param_index.end() &&
        out.params[it->second].item[static_cast<size_t>(StateKind::kWeight)] < 0) {
      out.params[it->second].item[static_cast<size_t>(StateKind::kWeight)] = static_cast<int32_t>(i);
    } else if (checkpoint.items[i].model_tensor && it == param_index.end()) {
      // The scanner read it from the model's state dict: a buffer or frozen parameter by its own name.
      UCPFS_RETURN_IF_ERROR(assign(key, StateKind::kWeight, i));
    } else {
      out.unmapped_keys.push_back(key);
    }
  }

  // Order of first appearance of any of a parameter's keys.
  auto first_item = [](const ParamEntry& p) {
    int32_t first = INT32_MAX;
    for (int32_t idx : p.item) {
      if (idx >= 0) first = std::min(first, idx);
    }
    return first;
  };
  std::stable_sort(out.params.begin(), out.params.end(),
                   [&](const ParamEntry& a, const ParamEntry& b) { return first_item(a) < first_item(b); });
  MatchPositionalOptimizerState(&out);
  return out;
}

}  // namespace ucpfs::index
