#include "views/mcore_from_hf.h"

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/layout/patterns.h"
#include "core/slice/local_view.h"

namespace ucpfs::views {
namespace {

constexpr int S(TargetState s) { return static_cast<int>(s); }

// The Hugging Face parameters of one decoder layer, by their name after `model.layers.<i>.`.
using LayerParts = std::map<std::string, const TargetParam*>;

Status Bad(const std::string& what) { return InvalidArgumentError("--preset megatron-core: " + what); }

// Rows [row_lo, row_lo + n_rows) of `src`, placed at row `dst_row` of a tensor whose other dims are
// src's: the source fragments restricted to those rows, in the new tensor's coordinates.
struct RowBlock {
  const slice::TensorLayout* src = nullptr;
  int64_t row_lo = 0;
  int64_t n_rows = 0;
};

Result<slice::TensorLayout> StackRows(const std::vector<RowBlock>& blocks, const std::string& what) {
  slice::TensorLayout out;
  int64_t dst_row = 0;
  for (const RowBlock& b : blocks) {
    const auto& shape = b.src->shape;
    if (shape.empty()) return Bad(what + ": a part is 0-d");
    if (out.shape.empty()) {
      out.shape = shape;
    } else if (!std::equal(shape.begin() + 1, shape.end(), out.shape.begin() + 1, out.shape.end())) {
      return Bad(what + ": parts of different widths");
    }
    if (b.row_lo < 0 || b.n_rows < 0 || b.row_lo > shape[0] - b.n_rows) {
      return Bad(what + ": rows [" + std::to_string(b.row_lo) + ", " + std::to_string(b.row_lo + b.n_rows) +
                 ") outside a part of " + std::to_string(shape[0]) + " rows");
    }
    slice::Box piece;
    piece.offsets.assign(shape.size(), 0);
    piece.offsets[0] = b.row_lo;
    piece.sizes = shape;
    piece.sizes[0] = b.n_rows;
    UCPFS_ASSIGN_OR_RETURN(slice::TensorLayout local, slice::LocalLayout(*b.src, piece.sizes, 0, {piece}));
    for (slice::Fragment& f : local.fragments) {  // normalized: whole boxes, so a row shift is enough
      f.box.offsets[0] += dst_row;
      out.fragments.push_back(std::move(f));
    }
    dst_row += b.n_rows;
  }
  out.shape[0] = dst_row;
  return out;
}

// One Megatron-Core parameter made of row blocks of Hugging Face parameters (one block of a
// whole parameter when it is only renamed). Every state present in all parts is fused alike; the
// step, hyper-parameters and group are the first part's.
struct Part {
  const TargetParam* param;
  int64_t row_lo;
  int64_t n_rows;
};

Result<TargetParam> Fuse(const std::string& name, const std::vector<Part>& parts) {
  TargetParam out;
  out.name = name;
  const TargetParam& first = *parts.front().param;
  out.hyper = first.hyper;
  out.group = first.group;
  out.step_value = first.step_value;
  out.states[S(TargetState::kStep)] = first.states[S(TargetState::kStep)];
  out.dtypes[S(TargetState::kStep)] = first.dtypes[S(TargetState::kStep)];
  out.keys[S(TargetState::kStep)] = first.keys[S(TargetState::kStep)];
  for (const Part& p : parts) {
    if (!p.param->in_model || !p.param->in_optimizer) {
      return Bad("parameter '" + p.param->name + "' is held fused by the optimizer; not renamed");
    }
  }
  for (int s = 0; s < kNumTargetStates; ++s) {
    if (s == S(TargetState::kStep)) continue;
    size_t n_have = 0;
    for (const Part& p : parts) n_have += p.param->states[s] != nullptr;
    if (n_have == 0) continue;
    if (n_have != parts.size()) {
      return Bad("'" + name + "': some of its parts have state " + TargetStateName(static_cast<TargetState>(s)) +
                 " and some do not");
    }
    std::vector<RowBlock> blocks;
    std::string keys;
    for (const Part& p : parts) {
      if (p.param->dtypes[s] != first.dtypes[s]) {
        return Bad("'" + name + "': its parts '" + first.name + "' and '" + p.param->name + "' have different dtypes");
      }
      blocks.push_back({p.param->states[s].get(), p.row_lo, p.n_rows});
      const std::string& k = p.param->keys[s];
      if (keys.find(k) == std::string::npos) keys += (keys.empty() ? "" : " + ") + k;
    }
    if (parts.size() == 1 && parts[0].row_lo == 0 && parts[0].n_rows == first.states[s]->shape.at(0)) {
      out.states[s] = first.states[s];  // renamed only: the same layout
    } else {
      UCPFS_ASSIGN_OR_RETURN(slice::TensorLayout fused, StackRows(blocks, "'" + name + "'"));
      out.states[s] = std::make_shared<const slice::TensorLayout>(std::move(fused));
    }
    out.dtypes[s] = first.dtypes[s];
    out.keys[s] = std::move(keys);
  }
  return out;
}

int64_t Rows(const TargetParam& p) {
  for (const auto& l : p.states) {
    if (l && !l->shape.empty()) return l->shape[0];
  }
  return -1;
}

Part Whole(const TargetParam* p) { return {p, 0, Rows(*p)}; }

// "model.layers.<i>.<rest>" -> (i, rest).
std::optional<std::pair<int64_t, std::string>> LayerOf(std::string_view name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  const size_t dot = name.find('.');
  if (dot == 0 || dot == std::string_view::npos || dot > 9) return std::nullopt;
  int64_t layer = 0;
  for (char c : name.substr(0, dot)) {
    if (c < '0' || c > '9') return std::nullopt;
    layer = layer * 10 + (c - '0');
  }
  return std::make_pair(layer, std::string(name.substr(dot + 1)));
}

class Converter {
 public:
  Converter(const TargetInput& in, int64_t heads, int64_t groups, int64_t head_dim)
      : in_(in), heads_(heads), groups_(groups), head_dim_(head_dim) {}

  Status Run(std::vector<TargetParam>* out, std::vector<NotServed>* not_served) {
    const TargetParam* embed = nullptr;
    const TargetParam* norm = nullptr;
    const TargetParam* head = nullptr;
    std::map<int64_t, LayerParts> layers;
    for (const TargetParam& p : in_.params) {
      if (p.name == "model.embed_tokens.weight") {
        embed = &p;
      } else if (p.name == "model.norm.weight") {
        norm = &p;
      } else if (p.name == "lm_head.weight") {
        head = &p;
      } else if (p.name.ends_with("rotary_emb.inv_freq")) {
        not_served->push_back({p.name, "rotary frequencies: Megatron-Core computes them (set rotary_base)"});
      } else if (auto l = LayerOf(p.name); l && kKnown(l->second)) {
        layers[l->first][l->second] = &p;
      } else {
        return Bad("no Megatron-Core name for '" + p.name + "' (a Llama-family model's names are expected)");
      }
    }
    if (embed == nullptr) return Bad("no model.embed_tokens.weight");
    // Tied embeddings (no lm_head): the Megatron preset puts the embedding on the last stage too,
    // as output_layer.weight where that stage is not the first; the output layer's _extra_state
    // goes with it (TargetParam::model_siblings of a tied parameter).
    UCPFS_RETURN_IF_ERROR(Add(out, "embedding.word_embeddings.weight", {Whole(embed)}, head == nullptr));
    int64_t expected = 0;
    for (const auto& [index, parts] : layers) {
      if (index != expected) return Bad("layer " + std::to_string(expected) + " is missing");
      ++expected;
      UCPFS_RETURN_IF_ERROR(AddLayer(index, parts, out));
    }
    if (norm == nullptr) return Bad("no model.norm.weight");
    UCPFS_RETURN_IF_ERROR(Add(out, "decoder.final_layernorm.weight", {Whole(norm)}, false));
    return head == nullptr ? Status::Ok() : Add(out, "output_layer.weight", {Whole(head)}, true);
  }

 private:
  static bool kKnown(const std::string& rest) {
    static const char* const kNames[] = {
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_proj.bias",
        "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"};
    for (const char* n : kNames) {
      if (rest == n) return true;
    }
    return false;
  }

  // `extra_state`: the module's last parameter, which Megatron-Core's linear layers follow with
  // `_extra_state` (None) in their state_dict.
  Status Add(std::vector<TargetParam>* out, const std::string& name, const std::vector<Part>& parts,
             bool extra_state) {
    UCPFS_ASSIGN_OR_RETURN(TargetParam p, Fuse(name, parts));
    if (extra_state) p.model_siblings.emplace_back("_extra_state", format::SaveValue::None());
    out->push_back(std::move(p));
    return Status::Ok();
  }

  Status AddLayer(int64_t index, const LayerParts& parts, std::vector<TargetParam>* out) {
    const std::string hf = "model.layers." + std::to_string(index) + ".";
    const std::string mc = "decoder.layers." + std::to_string(index) + ".";
    auto get = [&](const std::string& rest) -> const TargetParam* {
      auto it = parts.find(rest);
      return it == parts.end() ? nullptr : it->second;
    };
    auto need = [&](const std::string& rest) -> Result<const TargetParam*> {
      const TargetParam* p = get(rest);
      if (p == nullptr) return Bad("no " + hf + rest);
      return p;
    };
    UCPFS_ASSIGN_OR_RETURN(const TargetParam* in_norm, need("input_layernorm.weight"));
    UCPFS_RETURN_IF_ERROR(Add(out, mc + "input_layernorm.weight", {Whole(in_norm)}, false));
    UCPFS_ASSIGN_OR_RETURN(const TargetParam* o, need("self_attn.o_proj.weight"));
    const TargetParam* o_bias = get("self_attn.o_proj.bias");
    UCPFS_RETURN_IF_ERROR(Add(out, mc + "self_attention.linear_proj.weight", {Whole(o)}, o_bias == nullptr));
    if (o_bias) UCPFS_RETURN_IF_ERROR(Add(out, mc + "self_attention.linear_proj.bias", {Whole(o_bias)}, true));
    UCPFS_RETURN_IF_ERROR(AddQkv(hf, mc, "weight", get, true, out));
    UCPFS_RETURN_IF_ERROR(AddQkv(hf, mc, "bias", get, false, out));
    if (const TargetParam* q = get("self_attn.q_norm.weight")) {
      UCPFS_RETURN_IF_ERROR(Add(out, mc + "self_attention.q_layernorm.weight", {Whole(q)}, false));
    }
    if (const TargetParam* k = get("self_attn.k_norm.weight")) {
      UCPFS_RETURN_IF_ERROR(Add(out, mc + "self_attention.k_layernorm.weight", {Whole(k)}, false));
    }
    UCPFS_ASSIGN_OR_RETURN(const TargetParam* post, need("post_attention_layernorm.weight"));
    UCPFS_RETURN_IF_ERROR(Add(out, mc + "pre_mlp_layernorm.weight", {Whole(post)}, false));
    UCPFS_ASSIGN_OR_RETURN(const TargetParam* gate, need("mlp.gate_proj.weight"));
    UCPFS_ASSIGN_OR_RETURN(const TargetParam* up, need("mlp.up_proj.weight"));
    if (Rows(*gate) != Rows(*up)) {
      return Bad(hf + "mlp.gate_proj.weight and up_proj.weight have different rows");
    }
    UCPFS_RETURN_IF_ERROR(Add(out, mc + "mlp.linear_fc1.weight", {Whole(gate), Whole(up)}, true));
    UCPFS_ASSIGN_OR_RETURN(const TargetParam* down, need("mlp.down_proj.weight"));
    return Add(out, mc + "mlp.linear_fc2.weight", {Whole(down)}, true);
  }

  // linear_qkv.<kind> from q/k/v_proj.<kind>, interleaved per query group: for each group g, the
  // rows of its heads/groups query heads, then its key head, then its value head.
  template <typename Get>
  Status AddQkv(const std::string& hf, const std::string& mc, const std::string& kind, const Get& get,
                bool required, std::vector<TargetParam>* out) {
    const TargetParam* q = get("self_attn.q_proj." + kind);
    const TargetParam* k = get("self_attn.k_proj." + kind);
    const TargetParam* v = get("self_attn.v_proj." + kind);
    if (!q && !k && !v && !required) return Status::Ok();
    if (!q || !k || !v) return Bad(hf + "self_attn: q_proj, k_proj and v_proj." + kind + " are not all there");
    const int64_t q_per_group = heads_ / groups_;
    if (Rows(*q) != heads_ * head_dim_ || Rows(*k) != groups_ * head_dim_ || Rows(*v) != groups_ * head_dim_) {
      return Bad(hf + "self_attn: q/k/v_proj." + kind + " rows " + std::to_string(Rows(*q)) + "/" +
                 std::to_string(Rows(*k)) + "/" + std::to_string(Rows(*v)) + " do not fit " + std::to_string(heads_) +
                 " heads, " + std::to_string(groups_) + " key-value heads of " + std::to_string(head_dim_));
    }
    std::vector<Part> parts;
    for (int64_t g = 0; g < groups_; ++g) {
      parts.push_back({q, g * q_per_group * head_dim_, q_per_group * head_dim_});
      parts.push_back({k, g * head_dim_, head_dim_});
      parts.push_back({v, g * head_dim_, head_dim_});
    }
    const bool has_bias = get("self_attn.q_proj.bias") != nullptr;
    return Add(out, mc + "self_attention.linear_qkv." + kind, parts, kind == "bias" || !has_bias);
  }

  const TargetInput& in_;
  int64_t heads_, groups_, head_dim_;
};

}  // namespace

Result<std::shared_ptr<const TargetInput>> MegatronCoreFromHf(const TargetInput& in) {
  auto out = std::make_shared<TargetInput>(in);
  out->preset = layout::Preset::kMegatron;
  std::vector<std::string> names;
  for (const auto& p : in.params) names.push_back(p.name);
  if (layout::DetectPreset(names) == layout::Preset::kMegatron) {  // already Megatron's names
    return std::shared_ptr<const TargetInput>(std::move(out));
  }

  const layout::ModelInfo& facts = in.model_facts;
  const int64_t heads = facts.num_attention_heads;
  const int64_t groups = facts.num_query_groups > 0 ? facts.num_query_groups : heads;
  if (heads <= 0) {
    return Bad("the number of attention heads is unknown (the source has no config.json with num_attention_heads)");
  }
  if (heads % groups != 0) {
    return Bad(std::to_string(heads) + " attention heads do not divide into " + std::to_string(groups) +
               " key-value heads");
  }
  int64_t head_dim = facts.head_dim;
  if (head_dim <= 0 && facts.hidden_size > 0 && facts.hidden_size % heads == 0) head_dim = facts.hidden_size / heads;
  if (head_dim <= 0) return Bad("the head dimension is unknown (config.json has neither head_dim nor hidden_size)");

  out->params.clear();
  out->fused.clear();
  UCPFS_RETURN_IF_ERROR(Converter(in, heads, groups, head_dim).Run(&out->params, &out->not_served));
  // What Megatron-Core's model is, for the Megatron preset: SwiGLU (linear_fc1 = [gate; up]),
  // heads and groups as the config says, the vocabulary padded as Megatron-LM's converters pad it.
  out->model_facts.gated_linear_unit = true;
  out->model_facts.num_query_groups = groups;
  out->model_facts.head_dim = head_dim;
  out->model_facts.vocab_pad_repeat_last = true;
  return std::shared_ptr<const TargetInput>(std::move(out));
}

}  // namespace ucpfs::views
