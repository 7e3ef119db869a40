// Hugging Face weights as Megatron-Core ranks (`--preset megatron-core`): the target views' input
// of a Hugging Face Llama-family model (Llama, Mistral, Qwen2, Qwen3: `model.layers.<i>.self_attn.
// q_proj`...) rewritten as Megatron-Core's GPTModel (local layer spec) names and holds it, so the
// Megatron preset then splits it per rank:
//   model.embed_tokens.weight                    -> embedding.word_embeddings.weight
//   model.layers.<i>.input_layernorm.weight      -> decoder.layers.<i>.input_layernorm.weight
//   self_attn.q_proj / k_proj / v_proj (+ bias)  -> self_attention.linear_qkv.{weight,bias}, fused per
//                                                   query group: [q heads of group g; k_g; v_g] for g
//                                                   in 0..G-1 (megatron/core/transformer/attention.py
//                                                   SelfAttention.get_query_key_value_tensors)
//   self_attn.o_proj                             -> self_attention.linear_proj
//   self_attn.q_norm / k_norm (Qwen3)            -> self_attention.q_layernorm / k_layernorm
//   post_attention_layernorm                     -> pre_mlp_layernorm
//   mlp.gate_proj, mlp.up_proj                   -> mlp.linear_fc1, [gate; up] (the preset splits each
//                                                   half per tp rank: rank r holds [gate_r; up_r])
//   mlp.down_proj                                -> mlp.linear_fc2
//   model.norm.weight                            -> decoder.final_layernorm.weight
//   lm_head.weight                               -> output_layer.weight
// in GPTModel's state_dict order, each linear layer followed by its `_extra_state` (None: what the
// local spec's layers hold, so load_state_dict(strict=True) finds every key). The vocabulary is
// padded by the preset as Megatron-LM's checkpoint converters pad it: to a multiple of
// make_vocab_size_divisible_by (128) times tp, repeating the last row. Fused tensors are new
// layouts over the same source bytes (no copy): each part's fragments, restricted to its rows and
// moved to its place in the fused tensor. Every state is fused alike (optimizer moments too).
//
// Tied embeddings (no lm_head.weight): the embedding alone, which the Megatron preset also places
// on the last stage (output_layer.weight there when it is not the first), with the output layer's
// `_extra_state` on the last stage (GPTModel with share_embeddings_and_output_weights).
//
// Not for: Transformer Engine's names (`linear_qkv.layer_norm_weight`), MoE families, reading the
// config (index/hf_config.h gives heads and query groups through TargetInput::model_facts).
// Invariants: pure; a fused layout covers every element exactly once when its parts do.
#pragma once

#include <memory>

#include "core/status.h"
#include "views/target.h"

namespace ucpfs::views {

// `in` (preset kMegatronCore) as Megatron-Core's GPTModel names it, with preset kMegatron. Names
// that are already Megatron's (DetectPreset) are kept. Needs model_facts.num_attention_heads and
// num_query_groups (head_dim defaults to hidden / heads).
// Errors: kInvalidArgument naming the parameter or the missing fact: a name with no Megatron-Core
// counterpart, a layer missing one of q/k/v or gate/up, shapes that disagree with the heads, parts
// of one fused tensor with different dtypes or states.
Result<std::shared_ptr<const TargetInput>> MegatronCoreFromHf(const TargetInput& in);

}  // namespace ucpfs::views
