// The Hugging Face model view, `hf/`: a folder that `transformers`' from_pretrained (and vLLM,
// SGLang) loads as it is, computed lazily from a training checkpoint: `config.json`,
// `generation_config.json` where the source says its tokens, and the weights under the Hugging Face
// architecture's names as `model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`
// (sharded as safetensors/ is: ShardSafetensors). Headers and config now; tensor bytes gathered
// from the source fragments on read, converted to the chosen dtype.
//
// Sources and what is done to their weights (Hugging Face Llama names, LlamaForCausalLM; Qwen2's
// where Megatron's args give q/k/v biases alone, add_qkv_bias; Llama's attention_bias and mlp_bias
// where every linear has one, add_bias_linear; Mixtral's, MixtralForCausalLM, for a Megatron-Core
// mixture of experts as Mixtral computes it: router → block_sparse_moe.gate, each SequentialMLP
// expert's linear_fc1 → w1 (gate) and w3 (up), linear_fc2 → w2):
// - Megatron-Core torch_dist (DcpSourceFacts::megatron_core with the saved args), and the same
//   model saved by Megatron-LM's legacy format (MegatronSourceFacts::args): the fused
//   `linear_qkv` split per query group into q/k/v (Megatron keeps each group's [q heads; k; v]
//   rows together), `linear_fc1` into gate and up (its global form is [gate; up]), the norms
//   mapped (the local spec's `input_layernorm` / `pre_mlp_layernorm` and the fused
//   `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`; `final_layernorm`), the
//   vocabulary's padding rows stripped to the real vocabulary (MegatronTokenizerVocab), tied
//   embeddings left to Hugging Face (no lm_head.weight, tie_word_embeddings true). config.json
//   from the args (MegatronArchitectureArgs).
// - Megatron-DeepSpeed (DeepSpeedSourceFacts::megatron_args, its client state): the same with its
//   names (`query_key_value`, `dense`, `dense_h_to_4h` [gate; up], `dense_4h_to_h`,
//   `input_layernorm`, `post_attention_layernorm`), from GPTModel's `language_model.` or a
//   PipelineModule's numbered layers (embedding, the layers with a fused QKV, then the final norm's
//   `<i>.weight` and an untied `<i>.lm_head.weight`); its args' names (normalization "rmsnorm",
//   use_rotary_position_embeddings, rope_theta, layernorm_epsilon). A QKV declared as AutoTP's
//   [q; k; v] sub-parameters is refused.
// - Hugging Face itself (weights-only safetensors or torch folders, the Trainer's checkpoint-N/,
//   with DeepSpeed too: its engine's module states) with its config.json: the identity. The weights under their own names and dtype, resharded;
//   config.json, generation_config.json and the tokenizer files (kHfPassThroughFiles) passed
//   through as the source's files (opened now, never through a symlink, read on read).
//
// - torchtitan-style DCP (`tok_embeddings`, `layers.<i>.attention.wq|wk|wv` or
//   `qkv_linear.wq|wk|wv`, `feed_forward.w1|w2|w3`, `attention_norm`, `ffn_norm`, `norm`,
//   `output` or `lm_head`): Meta's rotary layout of wq / wk permuted to Hugging Face's (each
//   head's interleaved pairs to halves, as convert_llama_weights_to_hf and torchtitan's own
//   state_dict_adapter do). The heads, norm eps and rope come from --hf-config (the base model's
//   config.json), whose other fields pass through; the widths, layers, vocabulary and tying are
//   checked against the tensors.
//
// Never guessed: a fact config.json needs that the source does not record, or an architecture
// the Llama names cannot express (LayerNorm, learned positions, qk norms, interleaved or
// partial rotary, experts Mixtral does not compute: MixtureFacts), is an error naming it; the mount then serves `hf.error` holding it and
// says it in status.json. Not for: Hugging Face → training names (the reverse).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/io/source_tree.h"
#include "core/status.h"
#include "index/checkpoint.h"
#include "index/key_map.h"
#include "views/safetensors_view.h"
#include "views/view_inputs.h"

namespace ucpfs::index {

struct HfViewOptions {
  std::optional<DType> dtype;  // --hf-dtype (bf16, fp16, fp32); nullopt: as trained (the stored dtype)
  // --hf-config FILE: the base model's config.json (its text, and the path for messages), for
  // sources that do not record their architecture (torchtitan-style DCP). Empty: none given.
  std::string config_text, config_path;
  uint64_t max_shard_n_bytes = kDefaultSafetensorsShardBytes;
};

// --hf-dtype's value: bf16|bfloat16, fp16|float16|half, fp32|float32|float.
// Errors: kInvalidArgument naming the value.
Result<DType> ParseHfDType(const std::string& text);

// The model folder's files a Hugging Face source's hf/ serves as they are, when present.
inline constexpr const char* kHfPassThroughFiles[] = {
    "config.json",       "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
    "chat_template.jinja",     "chat_template.json"};

// The view's files: config.json, generation_config.json (when known), the shards, the index.
// Errors: kUnsupported naming the source kind, the architecture feature or the parameter the
// Llama names cannot hold; kInvalidArgument naming the missing fact (e.g. "args.norm_epsilon")
// or a shape that disagrees with the facts; CanConvert's refusals as kUnsupported naming the
// parameter; ShardSafetensors's. Weights read whole keep `checkpoint`'s tensor layouts
// (KeptLayout, `owner`).
Result<std::vector<SafetensorsViewFile>> BuildHfView(const Checkpoint& checkpoint,
                                                     const std::shared_ptr<const void>& owner,
                                                     const KeyMapping& mapping, const FileTable& files,
                                                     const PatternOptions& patterns, const SourceTree& source,
                                                     const HfViewOptions& options);

}  // namespace ucpfs::index
