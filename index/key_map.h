// Key mapping: which checkpoint keys are model weights, fp32 masters, Adam moments or steps of
// which parameter. Before any built-in rule, the checkpoint's structure decides where a framework
// nested its state (see MapKeys): optimizer state `<P>state.<fqn>.<field>` under any prefix P
// (`app.optim.`, `optimizer_0.`, `optimizer.`...), and the model's weights under whichever wrapper
// prefix W (`app.model.`, `model.`, `state_dict.`...) makes their names the optimizer's fqns with
// equal shapes; W is stripped, as are torch's own wrapper components (`_orig_mod.`,
// `_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`). Built-in rules cover torchtitan (`<fqn>`, `model.<fqn>`,
// `optimizer.state.<fqn>.exp_avg|exp_avg_sq|step`), torch.distributed.checkpoint.state_dict
// helpers (`state.<fqn>.<k>`, `param_groups.<fqn>.<field>`) and Megatron (`<key>`,
// `optimizer.state.{param,fp32_param,exp_avg,exp_avg_sq}.<key>`; a leading `module.` of <key>,
// from Megatron's DDP wrapper, is dropped so that names are the model's state_dict names). A rules file (--rules, JSON
// or TOML) adds rules that are tried before the built-ins. Keys that match nothing are
// reported, never silently dropped; non-parameter items (optimizer param_groups, LR scheduler,
// dataloader, RNG, train state, user extras) are kept as other_items for the views to serve.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "index/checkpoint.h"

namespace ucpfs::index {

enum class StateKind : uint8_t { kWeight = 0, kFp32 = 1, kExpAvg = 2, kExpAvgSq = 3, kStep = 4 };
inline constexpr int kNumStateKinds = 5;
const char* StateKindName(StateKind kind);  // "weight", "fp32", "exp_avg", "exp_avg_sq", "step"

// Accepts the StateKindName names plus the source spellings "fp32_param" and "param"
// (Megatron's optimizer.state.{fp32_param,param}.<key>: the fp32 master copy).
std::optional<StateKind> ParseStateKind(std::string_view name);

struct KeyRule {
  std::string pattern;      // ECMAScript regex, must match the whole key
  std::string param;        // replacement giving the parameter name, e.g. "$1"
  StateKind state = StateKind::kWeight;
  // When non-empty, the state comes from the match instead of `state`: a replacement such as
  // "$2" whose result must be a ParseStateKind name (e.g. from "(exp_avg|exp_avg_sq)").
  std::string state_ref;
  // Matched keys are known non-parameter state (not "unmapped"): they go to other_items, from
  // which the target views serve param_groups and extra_state.pt. Spelt "ignore" in rules files.
  bool ignore = false;
  std::regex compiled;
};

// Checks a rule and fills `compiled`: the pattern must compile, and every $n in `param` and
// `state_ref` must name a group of the pattern. An empty `param` of a non-ignore rule becomes
// "$1". Errors: kInvalidArgument saying what is wrong.
Status CompileRule(KeyRule* rule);

struct ParamEntry {
  std::string name;                          // parameter fqn
  std::array<int32_t, kNumStateKinds> item;  // index into Checkpoint::items, or -1
};

struct KeyMapping {
  std::vector<ParamEntry> params;          // in the order of their first key in the source
  std::vector<std::string> unmapped_keys;  // tensor keys no rule matched
  // Items that are not parameter states, in source order (indices into Checkpoint::items):
  // every non-tensor item except a parameter's step, and tensors matched by an `ignore` rule.
  std::vector<int32_t> other_items;
  // When the optimizer state was keyed by parameter position (torch.optim's own state_dict,
  // `optim.state.<i>.<k>`) and matched to the model tensors: position i -> name. Else empty.
  std::vector<std::string> positional_names;
  // What the structure decided (empty when it decided nothing): the wrapper prefix stripped from
  // the model's weights, and the prefixes (each ending in '.', or "") under which optimizer state
  // `<P>state.…` and its `<P>param_groups` were found.
  std::string model_prefix;
  std::vector<std::string> optimizer_prefixes;
  // Where the structure has two answers (two prefixes holding the optimizer's parameters, two
  // optimizers over the same parameters): one sentence each, naming the keys' prefixes and what
  // --rules settles. Nothing ambiguous is mapped by structure: it is left to the rules.
  std::vector<std::string> ambiguities;
};

// Removes torch's own wrapper module components from a parameter name, anywhere in it, as
// torch.distributed.checkpoint.state_dict's _get_fqns does: `_orig_mod.` (torch.compile),
// `_fsdp_wrapped_module.` (FSDP1), `_checkpoint_wrapped_module.` (activation checkpointing).
std::string StripWrapperComponents(std::string_view name);

// Parses a rules file. JSON: {"rules": [{"pattern": "...", "param": "$1", "state": "exp_avg"},
// {"pattern": "...", "ignore": true}, ...]}; TOML: [[rules]] tables with the same fields.
// "state" is a state name or a replacement like "$2" (KeyRule::state_ref); "param" defaults to
// "$1"; unknown fields are errors (a misspelt field would otherwise be silently dropped).
// The format is chosen by extension (.json / .toml). Errors: kNotFound, kInvalidArgument
// (naming the file, the rule index and what is wrong, e.g. a bad regex or unknown state).
Result<std::vector<KeyRule>> LoadRules(const std::string& path);

// The built-in rules of a source format (Checkpoint::format), in the order they are tried:
// "weights" (weights_scan.h) has one, every tensor being the weight its name says; every other
// format shares the rules above.
std::vector<KeyRule> BuiltinRules(std::string_view format = "");

// Maps every item of `checkpoint`: user rules first, then the structure (below), then the
// built-ins of its format; the first matching rule wins.
// The structure, over the keys no user rule matched: a prefix P is an optimizer's when a tensor
// key `<P>state.<fqn>.<field>` exists (field exp_avg, exp_avg_sq, fp32_param or master_param;
// P ends in '.' or is empty; the leftmost `state` component; positions (digits) are left to the
// rules). Its keys `<P>state.<fqn>.{exp_avg,exp_avg_sq,step,fp32_param,master_param}` are that
// parameter's states and `<P>param_groups[.…]` non-parameter state. The model prefix W is the
// prefix of the other tensor keys that, stripped (and StripWrapperComponents), names the most of
// the optimizers' fqns with the exp_avg's shape; every tensor key under a non-empty W is a weight
// of its stripped name (buffers and frozen parameters included), under W = "" only those named
// like an optimizer fqn. Two optimizer prefixes over overlapping fqns, or two W naming equally
// many, are ambiguities (KeyMapping::ambiguities): that part is then not mapped by structure
// (ambiguous optimizer keys are unmapped; weights go to the rules). A tensor key matching a rule whose state is already taken for that parameter is an
// error naming both keys (kInvalidArgument). A non-tensor (kBytes) item is a parameter's state
// only when a rule makes it that parameter's step (e.g. `optimizer.state.<fqn>.step` saved as a
// Python int); every other non-tensor item goes to other_items whatever the rules say. A tensor key no rule matches that
// is exactly the name of a parameter found through other keys (e.g. torchtitan's MoE
// `layers.0.moe.experts.w1` next to `optimizer.state.layers.0.moe.experts.w1.exp_avg`) is
// that parameter's weight; one the scanner marked Item::model_tensor (read from the model's
// own state dict: a buffer or frozen parameter such as DeepSpeed's `module.position_gain`) is
// the weight of the parameter its key names. Optimizer state keyed by parameter position (torch.optim's own
// state_dict) is matched to the i-th parameter when the model tensors are exactly as many as the
// positions (KeyMapping::positional_names); otherwise it stays under the position's name and the
// views report it. User rules are compiled here from their `pattern` (CompileRule),
// so a hand-built rule need not fill `compiled`. Keys longer than 1024 bytes are reported
// unmapped without being matched (std::regex recursion grows with the key's length).
Result<KeyMapping> MapKeys(const Checkpoint& checkpoint, const std::vector<KeyRule>& user_rules);

}  // namespace ucpfs::index
