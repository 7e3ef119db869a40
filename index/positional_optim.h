// Positional optimizer state: `optimizer.state_dict()` as torch.optim saves it keys each
// parameter's state by its position (param_groups[g]["params"] lists the positions of group g,
// numbered across the groups in order), with no parameter names. This matches positions to the
// model's parameter names by the grouping rule of the framework that built the param groups, and
// checks every state tensor's shape against its parameter's.
//
// Rules (each gives, per group, the parameter names in named_parameters() order; the model's
// parameters are taken as the weights in state-dict order, every one trainable):
//   - kInOrder: the groups take the parameters contiguously, in order (torch's default
//     `Optimizer(model.parameters())`: one group; torchtune's recipes; a LightningModule's
//     configure_optimizers over self.parameters()).
//   - kTrainerDecay: the Hugging Face Trainer's create_optimizer: group 0 the parameters
//     get_decay_parameter_names keeps (no "bias", "layernorm", "rmsnorm", "norm" component or
//     "_norm" suffix in the lower-cased name), group 1 the others.
//   - kTrainerDecayLayerNorm: as kTrainerDecay, and a 1-D `<m>.weight` beside a `<m>.bias` of the
//     same shape is taken for an nn.LayerNorm's (whose parameters the Trainer excludes by type,
//     which names alone do not show).
// A rule fits when it gives as many groups of the same sizes as the saved param groups and every
// state tensor (but `step`) has its parameter's shape. MatchPositions never guesses: when no rule
// fits, or rules that fit disagree, the result says why and names no parameter.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ucpfs::index {

enum class GroupingRule : uint8_t { kInOrder = 0, kTrainerDecay = 1, kTrainerDecayLayerNorm = 2 };
const char* GroupingRuleName(GroupingRule rule);  // "in_order", "trainer_decay", "trainer_decay_layernorm"
std::optional<GroupingRule> ParseGroupingRule(const std::string& name);

struct NamedShape {
  std::string name;
  std::vector<int64_t> shape;
};

struct PositionalOptimizer {
  std::vector<std::vector<int64_t>> group_positions;  // param_groups[g]["params"]
  // Per position with state: the shapes of its tensor states other than `step`.
  std::vector<std::pair<int64_t, std::vector<int64_t>>> state_shapes;
};

// Module orders for weights whose file keeps none (safetensors sorts tensors by name), in Hugging
// Face names: kHfLlama, transformers' Llama family (LlamaForCausalLM, Mistral, Qwen2, Qwen3:
// model{embed_tokens, layers.<i>{self_attn{q,k,v,o_proj, q_norm, k_norm}, mlp{gate,up,down_proj},
// input_layernorm, post_attention_layernorm}, norm}, lm_head; weight before bias); kTorchtuneLlama,
// torchtune's llama builders as its checkpointer names them in Hugging Face terms (the same, but
// its FeedForward registers w1, w2, w3: gate, down, up); kHfGpt2, transformers' GPT-2
// (transformer{wte, wpe, h.<i>{ln_1, attn{c_attn, q_attn, c_proj}, ln_2, crossattention,
// ln_cross_attn, mlp{c_fc, c_proj}}, ln_f}, lm_head).
enum class ModuleOrder : uint8_t { kHfLlama, kTorchtuneLlama, kHfGpt2 };
const char* ModuleOrderName(ModuleOrder order);  // "hf_llama", "torchtune_llama", "hf_gpt2"
// The order of a Hugging Face model_type (config.json), if known.
std::optional<ModuleOrder> HfModuleOrder(const std::string& model_type);
std::optional<ModuleOrder> ParseModuleOrder(const std::string& name);
// Whether config.json's `model_type` is of the Llama family.
bool IsHfLlamaFamily(const std::string& model_type);
// `params` sorted in `order`, or false (unchanged) when a name has a component it does not know.
bool SortModuleOrder(std::vector<NamedShape>* params, ModuleOrder order);

// Per group, the parameter names `rule` gives; nothing when the rule makes a different number
// of groups or sizes than `groups`.
std::optional<std::vector<std::vector<std::string>>> RuleGroups(const std::vector<NamedShape>& params,
                                                               const std::vector<std::vector<int64_t>>& groups,
                                                               GroupingRule rule);

// Position -> name under `rule` (positions as listed in the groups); nothing when it does not fit
// the group sizes.
std::optional<std::vector<std::pair<int64_t, std::string>>> AssignPositions(
    const std::vector<NamedShape>& params, const std::vector<std::vector<int64_t>>& groups, GroupingRule rule);

struct PositionalMatch {
  std::optional<GroupingRule> rule;                      // the one rule that fits, else none
  std::vector<std::pair<int64_t, std::string>> names;    // position -> name under `rule`
  std::string why_not;                                   // with no rule: what was tried, and why not
};

// Tries `rules` in order; distinct rules giving the same assignment count as one.
PositionalMatch MatchPositions(const std::vector<NamedShape>& params, const PositionalOptimizer& optimizer,
                               const std::vector<GroupingRule>& rules);

}  // namespace ucpfs::index
