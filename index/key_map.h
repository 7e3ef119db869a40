// Key mapping: which checkpoint keys are model weights, fp32 masters, Adam moments or steps of
// which parameter. Built-in rules cover torchtitan (`<fqn>`, `model.<fqn>`,
// `optimizer.state.<fqn>.exp_avg|exp_avg_sq|step`), torch.distributed.checkpoint.state_dict
// helpers (`state.<fqn>.<k>`, `param_groups.<fqn>.<field>`) and Megatron (`<key>`,
// `optimizer.state.{param,fp32_param,exp_avg,exp_avg_sq}.<key>`). A rules file (--rules, JSON
// or TOML) adds rules that are tried before the built-ins. Keys that match nothing are
// reported, never silently dropped.
#pragma once

#include <array>
#include <cstdint>
#include <regex>
#include <string>
#include <vector>

#include "core/status.h"
#include "index/checkpoint.h"

namespace ucpfs::index {

enum class StateKind : uint8_t { kWeight = 0, kFp32 = 1, kExpAvg = 2, kExpAvgSq = 3, kStep = 4 };
inline constexpr int kNumStateKinds = 5;
const char* StateKindName(StateKind kind);  // "weight", "fp32", "exp_avg", "exp_avg_sq", "step"

struct KeyRule {
  std::string pattern;      // ECMAScript regex, must match the whole key
  std::string param;        // replacement giving the parameter name, e.g. "$1"
  StateKind state = StateKind::kWeight;
  bool ignore = false;      // matched keys are known non-parameter state (not "unmapped")
  std::regex compiled;
};

struct ParamEntry {
  std::string name;                          // parameter fqn
  std::array<int32_t, kNumStateKinds> item;  // index into Checkpoint::items, or -1
};

struct KeyMapping {
  std::vector<ParamEntry> params;          // in the order of their first key in the source
  std::vector<std::string> unmapped_keys;  // tensor keys no rule matched
  std::vector<std::string> ignored_keys;   // keys matched by an `ignore` rule or non-tensor items
};

// Parses a rules file. JSON: {"rules": [{"pattern": "...", "param": "$1", "state": "exp_avg"},
// {"pattern": "...", "ignore": true}, ...]}; TOML: [[rules]] tables with the same fields.
// The format is chosen by extension (.json / .toml). Errors: kNotFound, kInvalidArgument
// (naming the file, the rule index and what is wrong, e.g. a bad regex or unknown state).
Result<std::vector<KeyRule>> LoadRules(const std::string& path);

// The built-in rules, in the order they are tried.
std::vector<KeyRule> BuiltinRules();

// Maps every item of `checkpoint`: user rules first, then built-ins; the first matching rule
// wins. A tensor key matching a rule whose state is already taken for that parameter is an
// error naming both keys (kInvalidArgument).
Result<KeyMapping> MapKeys(const Checkpoint& checkpoint, const std::vector<KeyRule>& user_rules);

}  // namespace ucpfs::index
