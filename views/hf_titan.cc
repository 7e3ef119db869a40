// torchtitan-style DCP sources for hf/ (hf_plans.h): the config from --hf-config checked against
// the tensors, and torchtitan's names mapped to Hugging Face Llama's.
#include "views/hf_plans.h"
#include "index/hf_config.h"

namespace ucpfs::index::hf {
namespace {

using json = nlohmann::ordered_json;

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

}  // namespace

bool IsTitanSource(const std::map<std::string, const Item*>& weights) {
  return weights.count("tok_embeddings.weight") > 0 && weights.count("norm.weight") > 0;
}

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
  if (w1 == weights.end() || w1->second->layout.shape.size() != 2) {
    return CorruptError("hf/: no layers.0.feed_forward.w1.weight");
  }
  facts->ffn = w1->second->layout.shape[0];
  facts->head_dim = typed.head_dim > 0 ? typed.head_dim : facts->hidden / facts->heads;
  if (facts->kv_heads <= 0 || facts->heads % facts->kv_heads != 0 || facts->head_dim % 2 != 0) {
    return InvalidArgumentError(where + ": num_key_value_heads / head_dim do not fit num_attention_heads");
  }
  facts->tied = weights.count("output.weight") == 0 && weights.count("lm_head.weight") == 0;
  // What the tensors say wins over the file, which must agree where it speaks.
  auto agree = [&](const char* name, int64_t value) -> Status {
    if (c.contains(name) && c[name] != value) {
      return InvalidArgumentError(where + ": " + name + " is " + c[name].dump() +
                                  ", the checkpoint's tensors make it " + std::to_string(value));
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
                                  std::to_string(f.heads) + ", num_key_value_heads " + std::to_string(f.kv_heads) +
                                  ")");
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
    if (!used.count(name)) {
      return UnsupportedError("hf/: parameter '" + name + "' has no Hugging Face Llama counterpart");
    }
  }
  return out;
}

}  // namespace ucpfs::index::hf
