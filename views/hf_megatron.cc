// Megatron-family sources for hf/ (hf_plans.h): Megatron-LM's saved args as a Llama-family
// config.json, and the Megatron-Core and Megatron-DeepSpeed names mapped to Hugging Face's.
#include "views/hf_plans.h"

#include <cctype>
#include <string_view>

namespace ucpfs::index::hf {
namespace {

// The Megatron-LM args' architecture fields (MegatronArchitectureArgs).
class Args {
 public:
  explicit Args(const nlohmann::json& j) : j_(j) {}
  std::optional<double> Number(const char* name) const {
    auto it = j_.find(name);
    if (it == j_.end() || !it->is_number()) return std::nullopt;
    return it->get<double>();
  }
  std::optional<int64_t> Int(const char* name) const {
    auto it = j_.find(name);
    if (it == j_.end() || !it->is_number_integer()) return std::nullopt;
    return it->get<int64_t>();
  }
  std::optional<bool> Flag(const char* name) const {
    auto it = j_.find(name);
    if (it == j_.end() || !it->is_boolean()) return std::nullopt;
    return it->get<bool>();
  }
  bool TextIs(const char* name, std::string_view want) const {  // ASCII case-insensitive
    auto t = Text(name);
    if (!t || t->size() != want.size()) return false;
    for (size_t i = 0; i < want.size(); ++i) {
      if (std::tolower(static_cast<unsigned char>((*t)[i])) != std::tolower(static_cast<unsigned char>(want[i]))) {
        return false;
      }
    }
    return true;
  }
  std::optional<std::string> Text(const char* name) const {
    auto it = j_.find(name);
    if (it == j_.end() || !it->is_string()) return std::nullopt;
    return it->get<std::string>();
  }

 private:
  const nlohmann::json& j_;
};

// A Megatron-Core mixture of experts as Mixtral computes one: every layer's MLP routed
// (moe_layer_freq 1), softmax over the top-k logits (moe_router_pre_softmax off, score function
// softmax, no scaling, no groups, no expert bias), no shared experts, no capacity limit (no token
// dropped), no biases, SequentialMLP experts (local_experts.<e>). Anything else is refused by
// name. Sets f->experts, f->topk; nothing without experts.
Status MixtureFacts(const Args& a, LlamaFacts* f) {
  const int64_t experts = a.Int("num_experts").value_or(0);
  if (experts <= 0) return Status::Ok();
  auto refuse = [](const std::string& what) {
    return UnsupportedError("hf/: a mixture of experts with " + what + " is not Mixtral's (not mapped)");
  };
  if (a.Text("moe_layer_freq") || a.Int("moe_layer_freq").value_or(1) != 1) {
    return refuse("args.moe_layer_freq (dense layers)");
  }
  if (a.Int("moe_shared_expert_intermediate_size").value_or(0) > 0) return refuse("shared experts");
  if (a.Flag("moe_router_pre_softmax").value_or(false)) return refuse("args.moe_router_pre_softmax");
  if (auto sf = a.Text("moe_router_score_function"); sf && *sf != "softmax") {
    return refuse("args.moe_router_score_function " + *sf);
  }
  if (a.Number("moe_router_topk_scaling_factor")) return refuse("args.moe_router_topk_scaling_factor");
  if (a.Number("moe_expert_capacity_factor")) return refuse("args.moe_expert_capacity_factor (dropped tokens)");
  if (a.Int("moe_router_num_groups").value_or(0) > 0) return refuse("grouped routing (args.moe_router_num_groups)");
  if (a.Flag("moe_router_enable_expert_bias").value_or(false)) return refuse("args.moe_router_enable_expert_bias");
  if (f->attention_bias || f->qkv_bias) return refuse("linear biases");
  // TEGroupedMLP's weight<N> tensors: the same numbers, but Transformer Engine cannot run where
  // this mapping was checked, so it is refused rather than served unchecked.
  if (a.Flag("moe_grouped_gemm").value_or(false)) return refuse("grouped-GEMM experts (args.moe_grouped_gemm)");
  const auto topk = a.Int("moe_router_topk");
  if (!topk || *topk <= 0 || *topk > experts) return Missing("args.moe_router_topk", "num_experts_per_tok");
  f->experts = experts;
  f->topk = *topk;
  return Status::Ok();
}

}  // namespace

Result<LlamaFacts> MegatronFacts(const std::optional<MegatronCoreArgs>& args, const std::string& where,
                                 const PatternOptions& patterns, bool has_output_layer) {
  if (!args) return Missing("Megatron-LM's args", where + " holds no readable `args`: config.json is made from them");
  const MegatronCoreArgs& margs = *args;
  const Args a(margs.architecture);
  // Features the Llama names cannot express: refused by name, never dropped.
  if (auto n = a.Text("normalization"); n && !a.TextIs("normalization", "RMSNorm")) {
    return UnsupportedError("hf/: args.normalization is " + *n + "; Hugging Face Llama uses RMSNorm");
  }
  if (!a.Text("normalization")) return Missing("args.normalization", "Llama needs RMSNorm");
  if (a.Flag("apply_layernorm_1p").value_or(false)) {
    return UnsupportedError("hf/: args.apply_layernorm_1p (zero-centred norm weights) has no Llama counterpart");
  }
  if (auto p = a.Text("position_embedding_type"); p && *p != "rope") {
    return UnsupportedError("hf/: args.position_embedding_type is " + *p +
                            "; Hugging Face Llama uses rotary embeddings");
  }
  if (!a.Text("position_embedding_type") && !a.Flag("use_rotary_position_embeddings").value_or(false)) {
    return Missing("args.position_embedding_type", "Llama needs rotary embeddings");
  }
  if (a.Flag("add_position_embedding").value_or(false)) {  // Megatron-DeepSpeed's learned positions
    return UnsupportedError("hf/: args.add_position_embedding (learned absolute positions) has no Llama counterpart");
  }
  if (auto r = a.Number("rotary_percent"); r && *r != 1.0) {
    return UnsupportedError("hf/: args.rotary_percent is " + std::to_string(*r) + "; Llama rotates every channel");
  }
  if (a.Flag("rotary_interleaved").value_or(false)) {
    return UnsupportedError("hf/: args.rotary_interleaved: Hugging Face Llama rotates halves, not interleaved pairs");
  }
  if (a.Flag("use_rope_scaling").value_or(false)) {
    return UnsupportedError("hf/: args.use_rope_scaling (Llama 3.1 rope scaling) is not mapped yet");
  }
  if (!a.Flag("swiglu").value_or(false)) {
    return UnsupportedError("hf/: args.swiglu is not set; the Llama MLP is gated SiLU (SwiGLU)");
  }
  LlamaFacts f;
  const auto bias_linear = a.Flag("add_bias_linear");
  if (!bias_linear) return Missing("args.add_bias_linear", "whether the linear layers have biases");
  f.attention_bias = f.mlp_bias = *bias_linear;
  f.qkv_bias = *bias_linear || a.Flag("add_qkv_bias").value_or(false);
  if (a.Flag("qk_layernorm").value_or(false)) {
    return UnsupportedError("hf/: args.qk_layernorm (query/key norms) has no Llama counterpart");
  }
  UCPFS_RETURN_IF_ERROR(MixtureFacts(a, &f));
  if (a.Flag("multi_latent_attention").value_or(false)) {
    return UnsupportedError("hf/: multi-latent attention is not Llama");
  }

  auto need_int = [&](const char* name, int64_t* into) -> Status {
    auto v = a.Int(name);
    if (!v || *v <= 0) return Missing(std::string("args.") + name, "a config.json field");
    *into = *v;
    return Status::Ok();
  };
  UCPFS_RETURN_IF_ERROR(need_int("num_layers", &f.layers));
  UCPFS_RETURN_IF_ERROR(need_int("hidden_size", &f.hidden));
  UCPFS_RETURN_IF_ERROR(need_int("num_attention_heads", &f.heads));
  const char* ffn_name = f.experts > 0 && a.Int("moe_ffn_hidden_size") ? "moe_ffn_hidden_size" : "ffn_hidden_size";
  if (auto v = a.Int(ffn_name); v && *v > 0) {
    f.ffn = *v;
  } else {
    return Missing("args.ffn_hidden_size", "intermediate_size");
  }
  f.kv_heads = margs.num_query_groups.value_or(f.heads);  // set only with group_query_attention
  f.head_dim = margs.kv_channels.value_or(0);
  if (f.head_dim == 0) {
    if (f.hidden % f.heads != 0) return Missing("args.kv_channels", "hidden_size is not a multiple of the heads");
    f.head_dim = f.hidden / f.heads;
  }
  if (f.kv_heads <= 0 || f.heads % f.kv_heads != 0) {
    return InvalidArgumentError("hf/: args.num_query_groups " + std::to_string(f.kv_heads) +
                                " does not divide num_attention_heads " + std::to_string(f.heads));
  }
  auto eps = a.Number("norm_epsilon");
  if (!eps) eps = a.Number("layernorm_epsilon");
  if (!eps || !(*eps > 0)) return Missing("args.norm_epsilon", "rms_norm_eps");
  f.norm_eps = *eps;
  auto theta = a.Number("rotary_base");
  if (!theta) theta = a.Number("rope_theta");
  if (!theta || !(*theta > 0)) return Missing("args.rotary_base", "rope_theta (Megatron-DeepSpeed: args.rope_theta)");
  f.rope_theta = *theta;
  f.max_positions = a.Int("max_position_embeddings").value_or(a.Int("seq_length").value_or(0));
  if (f.max_positions <= 0) return Missing("args.max_position_embeddings", "max_position_embeddings");
  if (!patterns.vocab_size || *patterns.vocab_size <= 0) {
    return Missing("args.vocab_size", "the real vocabulary, without Megatron's padding rows");
  }
  f.vocab = *patterns.vocab_size;
  const auto untie = a.Flag("untie_embeddings_and_output_weights");
  f.tied = untie ? !*untie : !has_output_layer;
  if (!f.tied && !has_output_layer) {
    return CorruptError("hf/: args.untie_embeddings_and_output_weights is set but the checkpoint has no output layer");
  }
  // Megatron-LM's NullTokenizer: its one special token, EOD, is the last id.
  if (a.Text("tokenizer_type").value_or("") == "NullTokenizer") f.eos = f.vocab - 1;
  return f;
}

std::string LlamaConfigJson(const LlamaFacts& f, DType dtype) {
  using json = nlohmann::ordered_json;
  const bool qwen2 = f.qkv_bias && !f.attention_bias, mixtral = f.experts > 0;
  json c;
  c["architectures"] = {mixtral ? "MixtralForCausalLM" : qwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM"};
  c["model_type"] = mixtral ? "mixtral" : qwen2 ? "qwen2" : "llama";
  c["vocab_size"] = f.vocab;
  c["hidden_size"] = f.hidden;
  c["intermediate_size"] = f.ffn;
  c["num_hidden_layers"] = f.layers;
  c["num_attention_heads"] = f.heads;
  c["num_key_value_heads"] = f.kv_heads;
  c["head_dim"] = f.head_dim;
  c["hidden_act"] = "silu";
  c["max_position_embeddings"] = f.max_positions;
  c["rms_norm_eps"] = f.norm_eps;
  // transformers 5 reads rope_parameters; 4.x reads rope_theta.
  c["rope_theta"] = f.rope_theta;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", f.rope_theta}};
  if (mixtral) {
    c["num_local_experts"] = f.experts;
    c["num_experts_per_tok"] = f.topk;
    c["sliding_window"] = nullptr;
    c["output_router_logits"] = false;
    c["router_jitter_noise"] = 0.0;
  } else if (qwen2) {
    c["use_sliding_window"] = false;
  } else {
    c["attention_bias"] = f.attention_bias;
    c["mlp_bias"] = f.mlp_bias;
  }
  c["attention_dropout"] = 0.0;
  c["tie_word_embeddings"] = f.tied;
  c["bos_token_id"] = f.bos ? json(*f.bos) : json(nullptr);
  c["eos_token_id"] = f.eos ? json(*f.eos) : json(nullptr);
  c["pad_token_id"] = nullptr;
  c["use_cache"] = true;
  c["dtype"] = std::string(TorchName(dtype));
  c["torch_dtype"] = std::string(TorchName(dtype));
  return c.dump(2) + "\n";
}

MegatronNames MegatronCoreNames(int64_t n_layers) {
  MegatronNames n;
  n.embedding = {"embedding.word_embeddings.weight"};
  n.final_norm = {"decoder.final_layernorm.weight"};
  n.output = {"output_layer.weight"};
  for (int64_t l = 0; l < n_layers; ++l) n.layers.push_back("decoder.layers." + std::to_string(l) + ".");
  n.qkv = "self_attention.linear_qkv";
  n.proj = "self_attention.linear_proj";
  n.fc1 = "mlp.linear_fc1";
  n.fc2 = "mlp.linear_fc2";
  // The local spec's norms, or Transformer Engine's fused into the next linear.
  n.norm1 = {"self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"};
  n.norm2 = {"mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"};
  return n;
}

MegatronNames MegatronDeepSpeedNames(const std::map<std::string, const Item*>& weights) {
  MegatronNames n;
  n.qkv = "self_attention.query_key_value";
  n.proj = "self_attention.dense";
  n.fc1 = "mlp.dense_h_to_4h";
  n.fc2 = "mlp.dense_4h_to_h";
  n.norm1 = {"input_layernorm.weight"};
  n.norm2 = {"post_attention_layernorm.weight"};
  if (weights.count("language_model.embedding.word_embeddings.weight")) {
    n.embedding = {"language_model.embedding.word_embeddings.weight"};
    n.final_norm = {"language_model.encoder.final_layernorm.weight"};
    n.output = {"language_model.output_layer.weight"};
    for (int64_t l = 0;; ++l) {
      const std::string prefix = "language_model.encoder.layers." + std::to_string(l) + ".";
      if (weights.count(prefix + "input_layernorm.weight") == 0) break;
      n.layers.push_back(prefix);
    }
    return n;
  }
  // The pipeline's numbered entries: "<i>.<rest>".
  std::map<int64_t, std::vector<std::string>> entries;
  for (const auto& [name, item] : weights) {
    const size_t dot = name.find('.');
    if (dot == 0 || dot == std::string::npos || dot > 6) continue;
    if (name.find_first_not_of("0123456789") != dot) continue;
    entries[std::stoll(name.substr(0, dot))].push_back(name.substr(dot + 1));
  }
  int64_t last_layer = -1;
  for (const auto& [i, rest] : entries) {
    for (const auto& r : rest) {
      if (r == n.qkv + ".weight") {
        n.layers.push_back(std::to_string(i) + ".");
        last_layer = i;
      } else if (r == "word_embeddings.weight" && n.layers.empty()) {
        n.embedding.push_back(std::to_string(i) + "." + r);
      }
    }
  }
  n.embedding.push_back("tied_modules.embed.word_embeddings.weight");
  for (const auto& [i, rest] : entries) {
    if (i <= last_layer) continue;
    for (const auto& r : rest) {
      if (r == "weight" && n.final_norm.empty()) n.final_norm.push_back(std::to_string(i) + ".weight");
      if (r == "lm_head.weight") n.output.push_back(std::to_string(i) + "." + r);
    }
  }
  if (n.final_norm.empty()) n.final_norm.push_back("<the final norm's weight after the last layer>");
  if (n.output.empty()) n.output.push_back("<an lm_head.weight after the last layer>");
  return n;
}

Result<std::vector<Planned>> MegatronPlan(const std::map<std::string, const Item*>& weights, const LlamaFacts& f,
                                          const MegatronNames& names) {
  std::vector<Planned> out;
  std::map<std::string, bool> used;
  auto find = [&](const std::vector<std::string>& candidates, const std::string& role) -> Result<const Item*> {
    for (const auto& n : candidates) {
      auto it = weights.find(n);
      if (it != weights.end()) {
        used[n] = true;
        return it->second;
      }
    }
    return CorruptError("hf/: the checkpoint has no " + role + " (" + candidates.front() + ")");
  };
  auto check_shape = [](const Item* it, const std::string& name, std::vector<int64_t> want) -> Status {
    if (it->layout.shape != want) {
      std::string w, h;
      for (auto d : want) w += (w.empty() ? "" : ",") + std::to_string(d);
      for (auto d : it->layout.shape) h += (h.empty() ? "" : ",") + std::to_string(d);
      return InvalidArgumentError("hf/: " + name + " is [" + h + "], the args make it [" + w + "]");
    }
    return Status::Ok();
  };
  if (static_cast<int64_t>(names.layers.size()) != f.layers) {
    return InvalidArgumentError("hf/: the checkpoint holds " + std::to_string(names.layers.size()) +
                                " transformer layers, args.num_layers says " + std::to_string(f.layers));
  }
  UCPFS_ASSIGN_OR_RETURN(const Item* emb, find(names.embedding, "word embedding"));
  if (emb->layout.shape.size() != 2 || emb->layout.shape[1] != f.hidden || emb->layout.shape[0] < f.vocab) {
    return InvalidArgumentError("hf/: " + names.embedding.front() + " does not hold " + std::to_string(f.vocab) +
                                " rows of " + std::to_string(f.hidden));
  }
  out.push_back({"model.embed_tokens.weight", emb, {{0, f.vocab}}});
  const int64_t qpg = f.heads / f.kv_heads, hd = f.head_dim;
  for (int64_t l = 0; l < f.layers; ++l) {
    const std::string& m = names.layers[static_cast<size_t>(l)];
    const std::string h = "model.layers." + std::to_string(l) + ".";
    const std::string layer = " of layer " + std::to_string(l);
    // q, k and v of the fused QKV (weight rows, or bias elements): each query group's rows.
    auto split_qkv = [&](const Item* fused, const std::string& suffix) {
      Planned q{h + "self_attn.q_proj." + suffix, fused, {}}, k{h + "self_attn.k_proj." + suffix, fused, {}},
          v{h + "self_attn.v_proj." + suffix, fused, {}};
      for (int64_t g = 0; g < f.kv_heads; ++g) {  // each query group: [its q heads; k; v]
        const int64_t base = g * (qpg + 2) * hd;
        q.rows.push_back({base, base + qpg * hd});
        k.rows.push_back({base + qpg * hd, base + (qpg + 1) * hd});
        v.rows.push_back({base + (qpg + 1) * hd, base + (qpg + 2) * hd});
      }
      out.push_back(std::move(q));
      out.push_back(std::move(k));
      out.push_back(std::move(v));
    };
    const int64_t qkv_rows = f.kv_heads * (qpg + 2) * hd;
    UCPFS_ASSIGN_OR_RETURN(const Item* qkv, find({m + names.qkv + ".weight"}, "fused QKV" + layer));
    UCPFS_RETURN_IF_ERROR(check_shape(qkv, m + names.qkv + ".weight", {qkv_rows, f.hidden}));
    split_qkv(qkv, "weight");
    if (f.qkv_bias) {
      UCPFS_ASSIGN_OR_RETURN(const Item* b, find({m + names.qkv + ".bias"}, "fused QKV bias" + layer));
      UCPFS_RETURN_IF_ERROR(check_shape(b, m + names.qkv + ".bias", {qkv_rows}));
      split_qkv(b, "bias");
    }
    UCPFS_ASSIGN_OR_RETURN(const Item* proj, find({m + names.proj + ".weight"}, "attention output" + layer));
    UCPFS_RETURN_IF_ERROR(check_shape(proj, m + names.proj + ".weight", {f.hidden, f.heads * hd}));
    out.push_back({h + "self_attn.o_proj.weight", proj, {}});
    if (f.attention_bias) {
      UCPFS_ASSIGN_OR_RETURN(const Item* b, find({m + names.proj + ".bias"}, "attention output bias" + layer));
      UCPFS_RETURN_IF_ERROR(check_shape(b, m + names.proj + ".bias", {f.hidden}));
      out.push_back({h + "self_attn.o_proj.bias", b, {}});
    }
    if (f.experts > 0) {  // Mixtral: the router, then each expert's w1 (gate), w2 (down), w3 (up)
      const std::string moe = h + "block_sparse_moe.";
      UCPFS_ASSIGN_OR_RETURN(const Item* router, find({m + "mlp.router.weight"}, "MoE router" + layer));
      UCPFS_RETURN_IF_ERROR(check_shape(router, m + "mlp.router.weight", {f.experts, f.hidden}));
      out.push_back({moe + "gate.weight", router, {}});
      for (int64_t e = 0; e < f.experts; ++e) {
        const std::string x = m + "mlp.experts.local_experts." + std::to_string(e) + ".";
        const std::string y = moe + "experts." + std::to_string(e) + ".";
        UCPFS_ASSIGN_OR_RETURN(const Item* fc1, find({x + "linear_fc1.weight"}, "expert " + std::to_string(e) + layer));
        UCPFS_RETURN_IF_ERROR(check_shape(fc1, x + "linear_fc1.weight", {2 * f.ffn, f.hidden}));
        UCPFS_ASSIGN_OR_RETURN(const Item* fc2, find({x + "linear_fc2.weight"}, "expert " + std::to_string(e) + layer));
        UCPFS_RETURN_IF_ERROR(check_shape(fc2, x + "linear_fc2.weight", {f.hidden, f.ffn}));
        out.push_back({y + "w1.weight", fc1, {{0, f.ffn}}});
        out.push_back({y + "w2.weight", fc2, {}});
        out.push_back({y + "w3.weight", fc1, {{f.ffn, 2 * f.ffn}}});
      }
    } else {
      UCPFS_ASSIGN_OR_RETURN(const Item* fc1, find({m + names.fc1 + ".weight"}, "MLP input" + layer));
      UCPFS_RETURN_IF_ERROR(check_shape(fc1, m + names.fc1 + ".weight", {2 * f.ffn, f.hidden}));
      out.push_back({h + "mlp.gate_proj.weight", fc1, {{0, f.ffn}}});  // SwiGLU: [gate; up]
      out.push_back({h + "mlp.up_proj.weight", fc1, {{f.ffn, 2 * f.ffn}}});
      if (f.mlp_bias) {
        UCPFS_ASSIGN_OR_RETURN(const Item* b, find({m + names.fc1 + ".bias"}, "MLP input bias" + layer));
        UCPFS_RETURN_IF_ERROR(check_shape(b, m + names.fc1 + ".bias", {2 * f.ffn}));
        out.push_back({h + "mlp.gate_proj.bias", b, {{0, f.ffn}}});
        out.push_back({h + "mlp.up_proj.bias", b, {{f.ffn, 2 * f.ffn}}});
      }
      UCPFS_ASSIGN_OR_RETURN(const Item* fc2, find({m + names.fc2 + ".weight"}, "MLP output" + layer));
      UCPFS_RETURN_IF_ERROR(check_shape(fc2, m + names.fc2 + ".weight", {f.hidden, f.ffn}));
      out.push_back({h + "mlp.down_proj.weight", fc2, {}});
      if (f.mlp_bias) {
        UCPFS_ASSIGN_OR_RETURN(const Item* b, find({m + names.fc2 + ".bias"}, "MLP output bias" + layer));
        UCPFS_RETURN_IF_ERROR(check_shape(b, m + names.fc2 + ".bias", {f.hidden}));
        out.push_back({h + "mlp.down_proj.bias", b, {}});
      }
    }
    std::vector<std::string> n1, n2;
    for (const auto& n : names.norm1) n1.push_back(m + n);
    for (const auto& n : names.norm2) n2.push_back(m + n);
    UCPFS_ASSIGN_OR_RETURN(const Item* norm1, find(n1, "attention norm" + layer));
    UCPFS_RETURN_IF_ERROR(check_shape(norm1, n1.back(), {f.hidden}));
    out.push_back({h + "input_layernorm.weight", norm1, {}});
    UCPFS_ASSIGN_OR_RETURN(const Item* norm2, find(n2, "MLP norm" + layer));
    UCPFS_RETURN_IF_ERROR(check_shape(norm2, n2.back(), {f.hidden}));
    out.push_back({h + "post_attention_layernorm.weight", norm2, {}});
  }
  UCPFS_ASSIGN_OR_RETURN(const Item* norm, find(names.final_norm, "final norm"));
  UCPFS_RETURN_IF_ERROR(check_shape(norm, names.final_norm.front(), {f.hidden}));
  out.push_back({"model.norm.weight", norm, {}});
  if (!f.tied) {
    UCPFS_ASSIGN_OR_RETURN(const Item* head, find(names.output, "output layer"));
    UCPFS_RETURN_IF_ERROR(check_shape(head, names.output.front(), emb->layout.shape));
    out.push_back({"lm_head.weight", head, {{0, f.vocab}}});
  } else {
    for (const auto& n : names.output) {
      if (weights.count(n)) used[n] = true;  // a pipeline's last-stage copy of the tied embedding
    }
  }
  for (const auto& [name, item] : weights) {
    if (!used.count(name)) {
      return UnsupportedError("hf/: parameter '" + name + "' has no Hugging Face " +
                              (f.qkv_bias && !f.attention_bias ? "Qwen2" : "Llama") +
                              " counterpart (e.g. more layers than args.num_layers, a bias the args do not declare, "
                              "or a module Llama lacks)");
    }
  }
  return out;
}

Status RefuseAutoTpQkv(const DeepSpeedSourceFacts& ds) {
  const auto& uc = ds.universal_checkpoint_info;
  if (uc.is_object() && uc.contains("parameter_with_sub_params") && !uc["parameter_with_sub_params"].empty()) {
    return UnsupportedError("hf/: universal_checkpoint_info declares parameter_with_sub_params (a fused QKV laid "
                            "out [q; k; v] as DeepSpeed AutoTP cuts it): not mapped to Hugging Face names yet");
  }
  return Status::Ok();
}

}  // namespace ucpfs::index::hf
