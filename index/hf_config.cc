#include "index/hf_config.h"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace ucpfs::index {
namespace {

constexpr int64_t kMaxSize = int64_t{1} << 40;

}  // namespace

int64_t HfModelConfig::HeadDim() const {
  if (head_dim > 0) return head_dim;
  if (num_attention_heads > 0 && hidden_size > 0 && hidden_size % num_attention_heads == 0) {
    return hidden_size / num_attention_heads;
  }
  return 0;
}

Result<HfModelConfig> ParseHfConfig(std::string_view text, const std::string& where) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return CorruptError(where + ": not a JSON object");
  HfModelConfig c;
  Status bad = Status::Ok();
  auto fail = [&](const char* key, const std::string& why) {
    if (bad.ok()) bad = CorruptError(where + ": '" + key + "' " + why);
  };
  auto text_of = [&](const char* key, std::string* out) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return;
    if (!it->is_string()) return fail(key, "is not a string");
    *out = it->get<std::string>();
  };
  // A positive integer; null or absent leaves 0 (head_dim is null in some configs).
  auto size_of = [&](const char* key, int64_t* out) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return;
    if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > kMaxSize) {
      return fail(key, "is not a positive integer below 2^40");
    }
    *out = it->get<int64_t>();
  };
  text_of("model_type", &c.model_type);
  text_of("hidden_act", &c.hidden_act);
  if (auto it = j.find("architectures"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) {
      fail("architectures", "is not a list");
    } else if (!it->empty()) {
      if (!(*it)[0].is_string()) {
        fail("architectures", "holds a value that is not a string");
      } else {
        c.architecture = (*it)[0].get<std::string>();
      }
    }
  }
  size_of("hidden_size", &c.hidden_size);
  size_of("num_attention_heads", &c.num_attention_heads);
  size_of("num_key_value_heads", &c.num_key_value_heads);
  size_of("head_dim", &c.head_dim);
  size_of("intermediate_size", &c.intermediate_size);
  size_of("num_hidden_layers", &c.num_hidden_layers);
  size_of("vocab_size", &c.vocab_size);
  if (auto it = j.find("tie_word_embeddings"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) {
      fail("tie_word_embeddings", "is not a boolean");
    } else {
      c.tie_word_embeddings = it->get<bool>();
    }
  }
  UCPFS_RETURN_IF_ERROR(bad);
  return c;
}

Result<layout::ModelInfo> MegatronCoreFactsOf(const HfModelConfig& c) {
  static const char* const kFamilies[] = {"llama", "mistral", "qwen2", "qwen3"};
  bool known = false;
  for (const char* f : kFamilies) known = known || c.model_type == f;
  if (!known) {
    return InvalidArgumentError("--preset megatron-core: config.json's model_type '" + c.model_type +
                                "' is not one served as Megatron-Core ranks (llama, mistral, qwen2, qwen3)");
  }
  if (!c.hidden_act.empty() && c.hidden_act != "silu") {
    return InvalidArgumentError("--preset megatron-core: config.json's hidden_act '" + c.hidden_act +
                                "' is not SwiGLU's silu");
  }
  layout::ModelInfo info;
  info.n_layers = static_cast<int>(std::min<int64_t>(c.num_hidden_layers, 1 << 30));
  info.hidden_size = c.hidden_size;
  info.num_attention_heads = c.num_attention_heads;
  info.num_query_groups = c.KvHeads();
  info.head_dim = c.HeadDim();
  info.vocab_size = c.vocab_size;
  info.gated_linear_unit = true;
  return info;
}

layout::ModelInfo AttentionFactsOf(const HfModelConfig& c) {
  layout::ModelInfo info;
  info.num_attention_heads = c.num_attention_heads;
  info.num_query_groups = c.KvHeads();
  info.head_dim = c.HeadDim();
  return info;
}

}  // namespace ucpfs::index
