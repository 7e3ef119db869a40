// The Hugging Face tensors of a training checkpoint's weights, per source family, for hf/
// (hf_view.h says what each family's mapping does): a plan lists each tensor of the Hugging Face
// model as rows of one source item, and the facts its config.json is written from. Megatron-LM's
// args and the Megatron-Core and Megatron-DeepSpeed names in hf_megatron.cc; torchtitan's names,
// with --hf-config, in hf_titan.cc; BuildHfView (hf_view.cc) chooses the family and turns the
// plan into safetensors shards. Used by hf_view.cc alone.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/status.h"
#include "index/checkpoint.h"
#include "index/source_facts.h"
#include "views/hf_view.h"

namespace ucpfs::index::hf {

// What a Llama-family config.json says, gathered from the source.
struct LlamaFacts {
  int64_t layers = 0, hidden = 0, ffn = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, max_positions = 0;
  double norm_eps = 0, rope_theta = 0;
  bool tied = false;
  // Megatron's biases: add_bias_linear (every linear: Llama's attention_bias and mlp_bias) or
  // add_qkv_bias alone (q, k and v only: Qwen2, model_type "qwen2").
  bool attention_bias = false, mlp_bias = false, qkv_bias = false;
  // A mixture of experts (Megatron's num_experts): every MLP is `experts` experts of width ffn,
  // the top `topk` chosen per token by softmax over their logits (Mixtral, model_type "mixtral").
  int64_t experts = 0, topk = 0;
  std::optional<int64_t> bos, eos;  // unknown: null in config.json
};

// One tensor of the view: rows of a source item (row ranges, concatenated), under its HF name.
struct Planned {
  std::string name;
  const Item* item = nullptr;
  std::vector<std::pair<int64_t, int64_t>> rows;  // [lo, hi) of dim 0; empty: the whole tensor
};

// kInvalidArgument: "hf/: the source does not record `fact` (`why`)".
Status Missing(const std::string& fact, const std::string& why);

// ---- Megatron-LM, Megatron-Core, Megatron-DeepSpeed (hf_megatron.cc) -------------------------

// The Llama-family facts of Megatron's saved args: Megatron-LM's names (Megatron-Core torch_dist's
// common.pt, a legacy save's model_optim_rng.pt) and Megatron-DeepSpeed's (its client state:
// normalization "rmsnorm", use_rotary_position_embeddings with add_position_embedding false,
// rope_theta, layernorm_epsilon). `where` names the file the args come from.
Result<LlamaFacts> MegatronFacts(const std::optional<MegatronCoreArgs>& args, const std::string& where,
                                 const PatternOptions& patterns, bool has_output_layer);

// config.json: Llama's (LlamaForCausalLM), or Qwen2's where only q, k and v have biases.
std::string LlamaConfigJson(const LlamaFacts& f, DType dtype);

// Where a Megatron-family checkpoint keeps each tensor of a Llama block: Megatron-Core's names
// (torch_dist and legacy saves of a Megatron-Core GPTModel) or Megatron-DeepSpeed's (its
// non-pipeline GPTModel, or a PipelineModule's numbered layers). Each field lists the names
// looked for, first found wins; a layer's are suffixes of its prefix.
struct MegatronNames {
  std::vector<std::string> embedding, final_norm, output;
  std::vector<std::string> layers;  // each layer's prefix, in order
  std::string qkv, proj, fc1, fc2;  // modules of a layer (".weight" / ".bias" appended)
  std::vector<std::string> norm1, norm2;
};

// Megatron-Core's names for `n_layers` layers (torch_dist and legacy saves alike); each layer's
// norms as the local spec names them or as Transformer Engine fuses them into the next linear.
MegatronNames MegatronCoreNames(int64_t n_layers);

// Megatron-DeepSpeed: GPTModel's `language_model.` names, or GPTModelPipe's layer list, whose
// numbered entries are the embedding (`tied_modules.embed.` when tied), the transformer layers
// (those with a fused query_key_value), the final norm (the first numbered `<i>.weight` after
// them) and an untied head (`<i>.lm_head.weight`).
MegatronNames MegatronDeepSpeedNames(const std::map<std::string, const Item*>& weights);

// A Megatron model's names → the Hugging Face tensors, in Hugging Face's state_dict order: the
// fused QKV split per query group (each group's [q heads; k; v] rows), linear_fc1 into gate and
// up ([gate; up]), biases split alike, the vocabulary stripped of its padding rows.
Result<std::vector<Planned>> MegatronPlan(const std::map<std::string, const Item*>& weights, const LlamaFacts& f,
                                          const MegatronNames& names);

// A fused QKV declared as DeepSpeed AutoTP's sub-parameters ([q; k; v], universal_checkpoint_info's
// parameter_with_sub_params) is not Megatron's per-group layout: refused by name, not guessed.
Status RefuseAutoTpQkv(const DeepSpeedSourceFacts& ds);

// ---- torchtitan-style DCP (hf_titan.cc) ------------------------------------------------------

// A torchtitan-style source: tok_embeddings.weight and norm.weight among the weights.
bool IsTitanSource(const std::map<std::string, const Item*>& weights);

// config.json of a torchtitan source: --hf-config's object, checked against the tensors, with
// what the tensors prove written in; *facts gets heads and widths for the plan.
Result<nlohmann::ordered_json> TitanConfig(const std::map<std::string, const Item*>& weights,
                                          const HfViewOptions& options, LlamaFacts* facts);

// The Hugging Face tensors of torchtitan's names: q and k rows permuted from Meta's rotary
// layout to Hugging Face's, every weight used once.
Result<std::vector<Planned>> TitanPlan(const std::map<std::string, const Item*>& weights, const LlamaFacts& f);

}  // namespace ucpfs::index::hf
