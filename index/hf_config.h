// A Hugging Face model folder's `config.json`, as the architecture facts the views need (heads, key-value
// heads, sizes, vocabulary, tied embeddings). The weights scanner reads it beside the weights
// (weights_scan.h) and records it in WeightsSourceFacts; `--preset megatron-core` takes the model
// facts from it (view_inputs.h, views/mcore_from_hf.h).
//
// Not for: reading files (the caller reads the text, bounded), tokenizer or generation settings.
// Untrusted input: every number is checked (a positive integer below 2^40 or absent); a field of
// the wrong type is an error naming the file and the field, never a guess.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/layout/patterns.h"
#include "core/status.h"

namespace ucpfs::index {

// The largest config.json read, in bytes.
inline constexpr uint64_t kMaxHfConfigBytes = 1 << 20;

struct HfModelConfig {
  std::string model_type;    // "llama", "mistral", "qwen2", "qwen3", ...; "" when absent
  std::string architecture;  // architectures[0] ("LlamaForCausalLM"), or ""
  // 0: not given. num_key_value_heads defaults to num_attention_heads and head_dim to
  // hidden_size / num_attention_heads, as transformers does (KvHeads, HeadDim).
  int64_t hidden_size = 0, num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0,
          intermediate_size = 0, num_hidden_layers = 0, vocab_size = 0;
  std::optional<bool> tie_word_embeddings;
  std::string hidden_act;  // "silu", ...; "" when absent

  int64_t KvHeads() const { return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads; }
  int64_t HeadDim() const;  // 0 when neither head_dim nor hidden_size / heads is known
  bool operator==(const HfModelConfig&) const = default;
};

// Parses config.json's text; `where` names the file in errors.
// Errors: kCorrupt (not a JSON object, a field of the wrong type or out of range).
Result<HfModelConfig> ParseHfConfig(std::string_view text, const std::string& where);

// The model facts `--preset megatron-core` takes from a config (layout::ModelInfo: layers, hidden
// size, heads, key-value heads as query groups, head dim, vocabulary, SwiGLU), for the families
// whose weights Megatron-Core's GPTModel computes alike (model_type llama, mistral, qwen2, qwen3,
// hidden_act silu). Errors: kInvalidArgument naming the model type or activation otherwise (Gemma's
// norms add one to their weights, for one, which GPTModel's do not).
Result<layout::ModelInfo> MegatronCoreFactsOf(const HfModelConfig& config);

// The attention facts a config gives (heads, key-value heads as query groups, head dim; 0 where
// it gives none), what --hf-config adds to the pattern rules file's "model" (layout::RulesFile):
// a torchtitan fused QKV's interleave (core/layout/fused_qkv.h) needs them.
layout::ModelInfo AttentionFactsOf(const HfModelConfig& config);

}  // namespace ucpfs::index
