// See hf_view.h.
#include "views/hf_view.h"

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/format/safetensors.h"
#include "core/io/source_tree.h"
#include "core/slice/local_view.h"
#include "views/atomic.h"
#include "index/hf_config.h"
#include "index/source_facts.h"

namespace ucpfs::index {
namespace {

using json = nlohmann::ordered_json;

// What a Llama config.json says, gathered from the source.
struct LlamaFacts {
  int64_t layers = 0, hidden = 0, ffn = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, max_positions = 0;
  double norm_eps = 0, rope_theta = 0;
  bool tied = false;
  std::optional<int64_t> bos, eos;  // unknown: null in config.json
};

// One tensor of the view: rows of a source item (row ranges, concatenated), under its HF name.
struct Planned {
  std::string name;
  const Item* item = nullptr;
  std::vector<std::pair<int64_t, int64_t>> rows;  // [lo, hi) of dim 0; empty: the whole tensor
};

std::shared_ptr<const ByteSource> TextFile(const std::string& name, const std::string& text) {
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  return std::make_shared<MemorySource>(name, std::move(bytes));
}

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
  std::optional<std::string> Text(const char* name) const {
    auto it = j_.find(name);
    if (it == j_.end() || !it->is_string()) return std::nullopt;
    return it->get<std::string>();
  }

 private:
  const nlohmann::json& j_;
};

Status Missing(const std::string& fact, const std::string& why) {
  return InvalidArgumentError("hf/: the source does not record " + fact + " (" + why + ")");
}

Result<LlamaFacts> MegatronCoreFacts(const DcpSourceFacts& dcp, const PatternOptions& patterns, bool has_output_layer) {
  if (!dcp.args) return Missing("Megatron-LM's args", "common.pt holds no readable `args`: config.json is made from them");
  const MegatronCoreArgs& margs = *dcp.args;
  const Args a(margs.architecture);
  // Features the Llama names cannot express: refused by name, never dropped.
  if (auto n = a.Text("normalization"); n && *n != "RMSNorm") {
    return UnsupportedError("hf/: args.normalization is " + *n + "; Hugging Face Llama uses RMSNorm");
  }
  if (!a.Text("normalization")) return Missing("args.normalization", "Llama needs RMSNorm");
  if (a.Flag("apply_layernorm_1p").value_or(false)) {
    return UnsupportedError("hf/: args.apply_layernorm_1p (zero-centred norm weights) has no Llama counterpart");
  }
  if (auto p = a.Text("position_embedding_type"); p && *p != "rope") {
    return UnsupportedError("hf/: args.position_embedding_type is " + *p + "; Hugging Face Llama uses rotary embeddings");
  }
  if (!a.Text("position_embedding_type") && !a.Flag("use_rotary_position_embeddings").value_or(false)) {
    return Missing("args.position_embedding_type", "Llama needs rotary embeddings");
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
  if (a.Flag("add_bias_linear").value_or(true) || a.Flag("add_qkv_bias").value_or(false)) {
    if (!a.Flag("add_bias_linear")) return Missing("args.add_bias_linear", "Llama has no linear biases");
    return UnsupportedError("hf/: the model has linear biases (args.add_bias_linear / add_qkv_bias); Llama has none");
  }
  if (a.Flag("qk_layernorm").value_or(false)) {
    return UnsupportedError("hf/: args.qk_layernorm (query/key norms) has no Llama counterpart");
  }
  if (a.Int("num_experts").value_or(0) > 0) return UnsupportedError("hf/: a mixture of experts (args.num_experts) is not mapped yet");
  if (a.Flag("multi_latent_attention").value_or(false)) return UnsupportedError("hf/: multi-latent attention is not Llama");

  LlamaFacts f;
  auto need_int = [&](const char* name, int64_t* into) -> Status {
    auto v = a.Int(name);
    if (!v || *v <= 0) return Missing(std::string("args.") + name, "a config.json field");
    *into = *v;
    return Status::Ok();
  };
  UCPFS_RETURN_IF_ERROR(need_int("num_layers", &f.layers));
  UCPFS_RETURN_IF_ERROR(need_int("hidden_size", &f.hidden));
  UCPFS_RETURN_IF_ERROR(need_int("num_attention_heads", &f.heads));
  if (auto v = a.Int("ffn_hidden_size"); v && *v > 0) f.ffn = *v;
  else return Missing("args.ffn_hidden_size", "intermediate_size");
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
  if (!theta || !(*theta > 0)) return Missing("args.rotary_base", "rope_theta");
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
    return CorruptError("hf/: args.untie_embeddings_and_output_weights is set but the checkpoint has no output_layer.weight");
  }
  // Megatron-LM's NullTokenizer: its one special token, EOD, is the last id.
  if (a.Text("tokenizer_type").value_or("") == "NullTokenizer") f.eos = f.vocab - 1;
  return f;
}

std::string LlamaConfigJson(const LlamaFacts& f, DType dtype) {
  json c;
  c["architectures"] = {"LlamaForCausalLM"};
  c["model_type"] = "llama";
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
  c["attention_bias"] = false;
  c["mlp_bias"] = false;
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

// The Megatron-Core names of a Llama block → the HF tensors, in HF's state_dict order.
Result<std::vector<Planned>> MegatronCorePlan(const std::map<std::string, const Item*>& weights, const LlamaFacts& f) {
  std::vector<Planned> out;
  std::map<std::string, bool> used;
  auto find = [&](std::initializer_list<std::string> names, const std::string& role) -> Result<const Item*> {
    for (const auto& n : names) {
      auto it = weights.find(n);
      if (it != weights.end()) {
        used[n] = true;
        return it->second;
      }
    }
    return CorruptError("hf/: the checkpoint has no " + role + " (" + *names.begin() + ")");
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
  UCPFS_ASSIGN_OR_RETURN(const Item* emb, find({"embedding.word_embeddings.weight"}, "word embedding"));
  if (emb->layout.shape.size() != 2 || emb->layout.shape[1] != f.hidden || emb->layout.shape[0] < f.vocab) {
    return InvalidArgumentError("hf/: embedding.word_embeddings.weight does not hold " + std::to_string(f.vocab) + " rows of " +
                                std::to_string(f.hidden));
  }
  out.push_back({"model.embed_tokens.weight", emb, {{0, f.vocab}}});
  const int64_t qpg = f.heads / f.kv_heads, hd = f.head_dim;
  for (int64_t l = 0; l < f.layers; ++l) {
    const std::string m = "decoder.layers." + std::to_string(l) + ".";
    const std::string h = "model.layers." + std::to_string(l) + ".";
    UCPFS_ASSIGN_OR_RETURN(const Item* qkv, find({m + "self_attention.linear_qkv.weight"}, "fused QKV of layer " + std::to_string(l)));
    UCPFS_RETURN_IF_ERROR(check_shape(qkv, m + "self_attention.linear_qkv.weight", {f.kv_heads * (qpg + 2) * hd, f.hidden}));
    Planned q{h + "self_attn.q_proj.weight", qkv, {}}, k{h + "self_attn.k_proj.weight", qkv, {}},
        v{h + "self_attn.v_proj.weight", qkv, {}};
    for (int64_t g = 0; g < f.kv_heads; ++g) {  // each query group: [its q heads; k; v]
      const int64_t base = g * (qpg + 2) * hd;
      q.rows.push_back({base, base + qpg * hd});
      k.rows.push_back({base + qpg * hd, base + (qpg + 1) * hd});
      v.rows.push_back({base + (qpg + 1) * hd, base + (qpg + 2) * hd});
    }
    out.push_back(std::move(q));
    out.push_back(std::move(k));
    out.push_back(std::move(v));
    UCPFS_ASSIGN_OR_RETURN(const Item* proj, find({m + "self_attention.linear_proj.weight"}, "attention output of layer " + std::to_string(l)));
    UCPFS_RETURN_IF_ERROR(check_shape(proj, m + "self_attention.linear_proj.weight", {f.hidden, f.heads * hd}));
    out.push_back({h + "self_attn.o_proj.weight", proj, {}});
    UCPFS_ASSIGN_OR_RETURN(const Item* fc1, find({m + "mlp.linear_fc1.weight"}, "MLP input of layer " + std::to_string(l)));
    UCPFS_RETURN_IF_ERROR(check_shape(fc1, m + "mlp.linear_fc1.weight", {2 * f.ffn, f.hidden}));
    out.push_back({h + "mlp.gate_proj.weight", fc1, {{0, f.ffn}}});  // SwiGLU: [gate; up]
    out.push_back({h + "mlp.up_proj.weight", fc1, {{f.ffn, 2 * f.ffn}}});
    UCPFS_ASSIGN_OR_RETURN(const Item* fc2, find({m + "mlp.linear_fc2.weight"}, "MLP output of layer " + std::to_string(l)));
    UCPFS_RETURN_IF_ERROR(check_shape(fc2, m + "mlp.linear_fc2.weight", {f.hidden, f.ffn}));
    out.push_back({h + "mlp.down_proj.weight", fc2, {}});
    UCPFS_ASSIGN_OR_RETURN(const Item* n1, find({m + "self_attention.linear_qkv.layer_norm_weight", m + "input_layernorm.weight"},
                                                "attention norm of layer " + std::to_string(l)));
    UCPFS_RETURN_IF_ERROR(check_shape(n1, m + "input_layernorm.weight", {f.hidden}));
    out.push_back({h + "input_layernorm.weight", n1, {}});
    UCPFS_ASSIGN_OR_RETURN(const Item* n2, find({m + "mlp.linear_fc1.layer_norm_weight", m + "pre_mlp_layernorm.weight"},
                                                "MLP norm of layer " + std::to_string(l)));
    UCPFS_RETURN_IF_ERROR(check_shape(n2, m + "pre_mlp_layernorm.weight", {f.hidden}));
    out.push_back({h + "post_attention_layernorm.weight", n2, {}});
  }
  UCPFS_ASSIGN_OR_RETURN(const Item* norm, find({"decoder.final_layernorm.weight"}, "final norm"));
  UCPFS_RETURN_IF_ERROR(check_shape(norm, "decoder.final_layernorm.weight", {f.hidden}));
  out.push_back({"model.norm.weight", norm, {}});
  if (!f.tied) {
    UCPFS_ASSIGN_OR_RETURN(const Item* head, find({"output_layer.weight"}, "output layer"));
    UCPFS_RETURN_IF_ERROR(check_shape(head, "output_layer.weight", emb->layout.shape));
    out.push_back({"lm_head.weight", head, {{0, f.vocab}}});
  } else if (auto it = weights.find("output_layer.weight"); it != weights.end()) {
    used[it->first] = true;  // a pipeline's last-stage copy of the tied embedding
  }
  for (const auto& [name, item] : weights) {
    if (!used.count(name)) {
      return UnsupportedError("hf/: parameter '" + name + "' has no Hugging Face Llama counterpart (e.g. more layers "
                              "than args.num_layers, or a module Llama lacks)");
    }
  }
  return out;
}

// A Hugging Face source: weights saved by save_pretrained (or the Trainer), whose names are
// already the architecture's; also the Trainer's DeepSpeed checkpoint-N/ (its config.json beside
// the DeepSpeed tag: the engine's module is the Hugging Face model, under its own names).
bool IsHuggingFaceSource(const Checkpoint& c, const SourceTree& source) {
  if (std::holds_alternative<WeightsSourceFacts>(c.facts)) return true;
  if (std::holds_alternative<DeepSpeedSourceFacts>(c.facts)) return source.Open("config.json").ok();
  const auto* ts = std::get_if<TorchStateSourceFacts>(&c.facts);
  return ts != nullptr && ts->framework == "hf_trainer";
}

// The source's config.json with its dtype fields set to `dtype` (--hf-dtype). Errors: kCorrupt
// when it is not a JSON object (or larger than 1 MiB), naming it.
Result<std::string> RetypedConfig(const ByteSource& config, DType dtype) {
  constexpr uint64_t kMaxConfigBytes = 1u << 20;
  if (config.Size() > kMaxConfigBytes) return CorruptError(config.Name() + ": larger than 1 MiB");
  UCPFS_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, ReadRange(config, 0, config.Size(), kMaxConfigBytes));
  json j = json::parse(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), nullptr, false);
  if (!j.is_object()) return CorruptError(config.Name() + ": not a JSON object");
  j["dtype"] = std::string(TorchName(dtype));
  if (j.contains("torch_dtype")) j["torch_dtype"] = std::string(TorchName(dtype));
  return j.dump(2) + "\n";
}

// ---- torchtitan-style DCP ------------------------------------------------------------------

bool IsTitanSource(const std::map<std::string, const Item*>& weights) {
  return weights.count("tok_embeddings.weight") > 0 && weights.count("norm.weight") > 0;
}

// The rows of a Meta-layout q or k weight in Hugging Face's order: within each head, the
// interleaved pairs (2j, 2j+1) become halves (j | hd/2 + j): permute() of
// convert_llama_weights_to_hf, w.view(n, hd/2, 2, d).transpose(1, 2).
std::vector<std::pair<int64_t, int64_t>> RotaryRows(int64_t n_heads, int64_t head_dim) {
  std::vector<std::pair<int64_t, int64_t>> rows;
  rows.reserve(static_cast<size_t>(n_heads * head_dim));
  for (int64_t h = 0; h < n_heads; ++h) {
    for (int64_t a = 0; a < 2; ++a) {
      for (int64_t j = 0; j < head_dim / 2; ++j) {
        const int64_t r = h * head_dim + 2 * j + a;
        rows.push_back({r, r + 1});
      }
    }
  }
  return rows;
}

// config.json of a torchtitan source: --hf-config's object, checked against the tensors, with
// what the tensors prove written in; *facts gets heads and widths for the plan.
Result<json> TitanConfig(const std::map<std::string, const Item*>& weights, const HfViewOptions& options,
                         LlamaFacts* facts) {
  if (options.config_text.empty()) {
    return Missing("the attention heads, rope theta and norm eps",
                   "a torchtitan-style DCP checkpoint keeps only tensors: give the base model's config.json with "
                   "--hf-config FILE");
  }
  const std::string where = "--hf-config " + options.config_path;
  // The typed facts through the one config.json reader (index/hf_config.h: every field checked);
  // the object itself is kept to be written out with what the tensors prove.
  UCPFS_ASSIGN_OR_RETURN(const HfModelConfig typed, ParseHfConfig(options.config_text, where));
  json c = json::parse(options.config_text, nullptr, false);
  if (!typed.model_type.empty() && typed.model_type != "llama" && typed.model_type != "mistral") {
    return UnsupportedError(where + ": model_type \"" + typed.model_type + "\" is not a Llama-family model ucpfs maps");
  }
  if (typed.num_attention_heads <= 0) {
    return InvalidArgumentError(where + " does not give num_attention_heads (a positive integer)");
  }
  facts->heads = typed.num_attention_heads;
  facts->kv_heads = typed.KvHeads();
  if (!c.contains("rms_norm_eps") || !c["rms_norm_eps"].is_number()) {
    return InvalidArgumentError(where + " does not give rms_norm_eps");
  }
  if (!c.contains("rope_theta") && !(c.contains("rope_parameters") && c["rope_parameters"].contains("rope_theta"))) {
    return InvalidArgumentError(where + " does not give rope_theta (or rope_parameters.rope_theta)");
  }
  const Item* emb = weights.at("tok_embeddings.weight");
  if (emb->layout.shape.size() != 2) return CorruptError("hf/: tok_embeddings.weight is not 2-d");
  facts->vocab = emb->layout.shape[0];
  facts->hidden = emb->layout.shape[1];
  int64_t layers = 0;
  while (weights.count("layers." + std::to_string(layers) + ".attention_norm.weight")) ++layers;
  facts->layers = layers;
  auto w1 = weights.find("layers.0.feed_forward.w1.weight");
  if (w1 == weights.end() || w1->second->layout.shape.size() != 2) return CorruptError("hf/: no layers.0.feed_forward.w1.weight");
  facts->ffn = w1->second->layout.shape[0];
  facts->head_dim = typed.head_dim > 0 ? typed.head_dim : facts->hidden / facts->heads;
  if (facts->kv_heads <= 0 || facts->heads % facts->kv_heads != 0 || facts->head_dim % 2 != 0) {
    return InvalidArgumentError(where + ": num_key_value_heads / head_dim do not fit num_attention_heads");
  }
  facts->tied = weights.count("output.weight") == 0 && weights.count("lm_head.weight") == 0;
  // What the tensors say wins over the file, which must agree where it speaks.
  auto agree = [&](const char* name, int64_t value) -> Status {
    if (c.contains(name) && c[name] != value) {
      return InvalidArgumentError(where + ": " + name + " is " + c[name].dump() + ", the checkpoint's tensors make it " +
                                  std::to_string(value));
    }
    c[name] = value;
    return Status::Ok();
  };
  UCPFS_RETURN_IF_ERROR(agree("vocab_size", facts->vocab));
  UCPFS_RETURN_IF_ERROR(agree("hidden_size", facts->hidden));
  UCPFS_RETURN_IF_ERROR(agree("intermediate_size", facts->ffn));
  UCPFS_RETURN_IF_ERROR(agree("num_hidden_layers", facts->layers));
  if (c.contains("tie_word_embeddings") && c["tie_word_embeddings"] != facts->tied) {
    return InvalidArgumentError(where + ": tie_word_embeddings is " + c["tie_word_embeddings"].dump() +
                                (facts->tied ? ", but the checkpoint has no output weight"
                                             : ", but the checkpoint has its own output weight"));
  }
  c["tie_word_embeddings"] = facts->tied;
  if (!c.contains("architectures")) c["architectures"] = {"LlamaForCausalLM"};
  if (!c.contains("model_type")) c["model_type"] = "llama";
  return c;
}

Result<std::vector<Planned>> TitanPlan(const std::map<std::string, const Item*>& weights, const LlamaFacts& f) {
  std::vector<Planned> out;
  std::map<std::string, bool> used;
  auto find = [&](std::initializer_list<std::string> names) -> Result<const Item*> {
    for (const auto& n : names) {
      if (auto it = weights.find(n); it != weights.end()) {
        used[n] = true;
        return it->second;
      }
    }
    return CorruptError("hf/: the checkpoint has no " + *names.begin());
  };
  UCPFS_ASSIGN_OR_RETURN(const Item* emb, find({"tok_embeddings.weight"}));
  out.push_back({"model.embed_tokens.weight", emb, {}});
  for (int64_t l = 0; l < f.layers; ++l) {
    const std::string t = "layers." + std::to_string(l) + ".";
    const std::string h = "model.layers." + std::to_string(l) + ".";
    UCPFS_ASSIGN_OR_RETURN(const Item* wq, find({t + "attention.wq.weight", t + "attention.qkv_linear.wq.weight"}));
    UCPFS_ASSIGN_OR_RETURN(const Item* wk, find({t + "attention.wk.weight", t + "attention.qkv_linear.wk.weight"}));
    UCPFS_ASSIGN_OR_RETURN(const Item* wv, find({t + "attention.wv.weight", t + "attention.qkv_linear.wv.weight"}));
    if (wq->layout.shape != std::vector<int64_t>{f.heads * f.head_dim, f.hidden} ||
        wk->layout.shape != std::vector<int64_t>{f.kv_heads * f.head_dim, f.hidden}) {
      return InvalidArgumentError("hf/: layer " + std::to_string(l) +
                                  "'s wq / wk do not have the heads --hf-config gives (num_attention_heads " +
                                  std::to_string(f.heads) + ", num_key_value_heads " + std::to_string(f.kv_heads) + ")");
    }
    out.push_back({h + "self_attn.q_proj.weight", wq, RotaryRows(f.heads, f.head_dim)});
    out.push_back({h + "self_attn.k_proj.weight", wk, RotaryRows(f.kv_heads, f.head_dim)});
    out.push_back({h + "self_attn.v_proj.weight", wv, {}});
    UCPFS_ASSIGN_OR_RETURN(const Item* wo, find({t + "attention.wo.weight"}));
    out.push_back({h + "self_attn.o_proj.weight", wo, {}});
    UCPFS_ASSIGN_OR_RETURN(const Item* w1, find({t + "feed_forward.w1.weight"}));
    UCPFS_ASSIGN_OR_RETURN(const Item* w3, find({t + "feed_forward.w3.weight"}));
    UCPFS_ASSIGN_OR_RETURN(const Item* w2, find({t + "feed_forward.w2.weight"}));
    out.push_back({h + "mlp.gate_proj.weight", w1, {}});
    out.push_back({h + "mlp.up_proj.weight", w3, {}});
    out.push_back({h + "mlp.down_proj.weight", w2, {}});
    UCPFS_ASSIGN_OR_RETURN(const Item* n1, find({t + "attention_norm.weight"}));
    UCPFS_ASSIGN_OR_RETURN(const Item* n2, find({t + "ffn_norm.weight"}));
    out.push_back({h + "input_layernorm.weight", n1, {}});
    out.push_back({h + "post_attention_layernorm.weight", n2, {}});
  }
  UCPFS_ASSIGN_OR_RETURN(const Item* norm, find({"norm.weight"}));
  out.push_back({"model.norm.weight", norm, {}});
  if (!f.tied) {
    UCPFS_ASSIGN_OR_RETURN(const Item* head, find({"output.weight", "lm_head.weight"}));
    out.push_back({"lm_head.weight", head, {}});
  }
  for (const auto& [name, item] : weights) {
    if (!used.count(name)) return UnsupportedError("hf/: parameter '" + name + "' has no Hugging Face Llama counterpart");
  }
  return out;
}

}  // namespace

Result<DType> ParseHfDType(const std::string& text) {
  if (text == "bf16" || text == "bfloat16") return DType::kBFloat16;
  if (text == "fp16" || text == "float16" || text == "half") return DType::kFloat16;
  if (text == "fp32" || text == "float32" || text == "float") return DType::kFloat32;
  return InvalidArgumentError("--hf-dtype '" + text + "': expected bf16, fp16 or fp32");
}

Result<std::vector<SafetensorsViewFile>> BuildHfView(const Checkpoint& c, const KeyMapping& mapping,
                                                     const FileTable& files, const PatternOptions& patterns,
                                                     const SourceTree& source, const HfViewOptions& options) {
  // Each parameter's weight, else its fp32 master (as safetensors/ takes them), in source order.
  std::map<std::string, const Item*> weights;
  std::vector<Planned> in_order;
  for (const ParamEntry& p : mapping.params) {
    int32_t idx = p.item[static_cast<int>(StateKind::kWeight)];
    if (idx < 0) idx = p.item[static_cast<int>(StateKind::kFp32)];
    if (idx < 0 || c.items[static_cast<size_t>(idx)].kind != ItemKind::kTensor) continue;
    weights.emplace(p.name, &c.items[static_cast<size_t>(idx)]);
    in_order.push_back({p.name, &c.items[static_cast<size_t>(idx)], {}});
  }
  if (weights.empty()) return UnsupportedError("hf/: the source holds no model weights");

  LlamaFacts facts;
  std::vector<Planned> plan;
  std::optional<json> given_config;  // torchtitan: --hf-config's, checked
  std::vector<SafetensorsViewFile> passed;  // the identity's config and tokenizer files
  const auto* dcp = std::get_if<DcpSourceFacts>(&c.facts);
  if (dcp != nullptr && dcp->megatron_core) {
    UCPFS_ASSIGN_OR_RETURN(facts, MegatronCoreFacts(*dcp, patterns, weights.count("output_layer.weight") > 0));
    UCPFS_ASSIGN_OR_RETURN(plan, MegatronCorePlan(weights, facts));
  } else if (dcp != nullptr && IsTitanSource(weights)) {
    UCPFS_ASSIGN_OR_RETURN(given_config, TitanConfig(weights, options, &facts));
    UCPFS_ASSIGN_OR_RETURN(plan, TitanPlan(weights, facts));
  } else if (IsHuggingFaceSource(c, source)) {
    for (const char* name : kHfPassThroughFiles) {
      auto opened = source.Open(name);
      if (!opened.ok() && opened.error().code() == StatusCode::kNotFound) continue;
      if (!opened.ok()) return opened.error();
      std::shared_ptr<const ByteSource> file = opened->bytes;
      if (options.dtype && std::string_view(name) == "config.json") {
        UCPFS_ASSIGN_OR_RETURN(std::string text, RetypedConfig(*file, *options.dtype));
        file = TextFile("hf/config.json", text);
      }
      passed.push_back({name, std::move(file)});
    }
    if (passed.empty() || passed.front().name != "config.json") {
      return Missing("config.json", "a Hugging Face source's hf/ is the source itself, config.json included");
    }
    plan = std::move(in_order);
  } else {
    return UnsupportedError("hf/: a " + c.format + (c.flavor.empty() ? "" : " (" + c.flavor + ")") +
                            " source is not mapped to Hugging Face names yet");
  }

  // The dtype: the one asked for, else the weights' own (one for all where config.json is
  // written here: it names one; the identity keeps each tensor's).
  const bool identity = !passed.empty();
  const DType model_dtype = options.dtype.value_or(plan.front().item->dtype);
  std::vector<NamedSaveTensor> tensors;
  for (const Planned& p : plan) {
    const Item& it = *p.item;
    const DType dtype = options.dtype.value_or(identity ? it.dtype : model_dtype);
    if (format::SafetensorsDTypeName(dtype).empty()) {
      return UnsupportedError("hf/: " + p.name + " is " + std::string(TorchName(dtype)) + ", which safetensors cannot hold");
    }
    if (!options.dtype && it.dtype != dtype) {
      return UnsupportedError("hf/: the weights are stored in more than one dtype (" + std::string(TorchName(dtype)) +
                              ", " + std::string(TorchName(it.dtype)) + "); choose one with --hf-dtype");
    }
    if (!slice::CanConvert(it.dtype, dtype)) {
      return UnsupportedError("hf/: " + p.name + " is " + std::string(TorchName(it.dtype)) + ", which cannot be converted to " +
                              std::string(TorchName(dtype)));
    }
    std::vector<int64_t> shape = it.layout.shape;
    std::shared_ptr<const slice::TensorLayout> layout;
    if (p.rows.empty()) {
      layout = std::make_shared<const slice::TensorLayout>(it.layout);
    } else {
      std::vector<slice::Box> pieces;
      int64_t n_rows = 0;
      for (auto [lo, hi] : p.rows) {
        slice::Box b{std::vector<int64_t>(shape.size(), 0), shape};
        b.offsets[0] = lo;
        b.sizes[0] = hi - lo;
        pieces.push_back(std::move(b));
        n_rows += hi - lo;
      }
      shape[0] = n_rows;
      UCPFS_ASSIGN_OR_RETURN(slice::TensorLayout local, slice::LocalLayout(it.layout, shape, 0, pieces));
      layout = std::make_shared<const slice::TensorLayout>(std::move(local));
    }
    uint64_t n = ItemSize(dtype);
    for (int64_t d : shape) {
      auto m = CheckedMul(n, static_cast<uint64_t>(d));
      if (!m) return CorruptError("hf/: " + p.name + ": size overflows");
      n = *m;
    }
    tensors.push_back({p.name, format::SaveTensor{dtype, std::move(shape),
                                                  std::make_shared<views::LayoutProvider>(layout, dtype, files)},
                       n});
  }
  UCPFS_ASSIGN_OR_RETURN(std::vector<SafetensorsViewFile> shards,
                         ShardSafetensors(std::move(tensors), options.max_shard_n_bytes, "hf/"));
  std::vector<SafetensorsViewFile> out;
  if (identity) {
    for (auto& f : passed) out.push_back(std::move(f));
    for (auto& s : shards) out.push_back(std::move(s));
    return out;
  }
  if (given_config) {
    (*given_config)["dtype"] = std::string(TorchName(model_dtype));
    if (given_config->contains("torch_dtype")) (*given_config)["torch_dtype"] = std::string(TorchName(model_dtype));
    out.push_back({"config.json", TextFile("hf/config.json", given_config->dump(2) + "\n")});
    for (auto& s : shards) out.push_back(std::move(s));
    return out;
  }
  out.push_back({"config.json", TextFile("hf/config.json", LlamaConfigJson(facts, model_dtype))});
  if (facts.bos || facts.eos) {
    json g;
    if (facts.bos) g["bos_token_id"] = *facts.bos;
    if (facts.eos) g["eos_token_id"] = *facts.eos;
    out.push_back({"generation_config.json", TextFile("hf/generation_config.json", g.dump(2) + "\n")});
  }
  for (auto& s : shards) out.push_back(std::move(s));
  return out;
}

}  // namespace ucpfs::index
