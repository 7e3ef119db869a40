// The stored form of the scanners' typed facts (source_facts.h).
#include "index/source_facts.h"

#include <type_traits>

namespace ucpfs::index {
namespace {

using nlohmann::json;

inline constexpr int64_t kMaxCount = int64_t{1} << 40;

json OptionalJson(const std::optional<int64_t>& v) { return v ? json(*v) : json(nullptr); }
json OptionalJson(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }
json OptionalJson(const std::optional<std::string>& v) { return v ? json(*v) : json(nullptr); }

// The fields of one stored object, each checked; the first failure is kept and named.
class Fields {
 public:
  Fields(const json& j, std::string what) : j_(j), what_(std::move(what)) {
    if (!j_.is_object()) Fail("", "is not an object");
  }
  const Status& status() const { return status_; }

  std::string Text(const char* key, bool required = true) {
    const json* v = Find(key, required);
    if (v == nullptr) return {};
    if (!v->is_string()) return Fail(key, "is not a string"), std::string();
    return v->get<std::string>();
  }
  std::optional<std::string> OptionalText(const char* key) {
    const json* v = Find(key, false);
    if (v == nullptr || v->is_null()) return std::nullopt;
    if (!v->is_string()) return Fail(key, "is not a string"), std::nullopt;
    return v->get<std::string>();
  }
  bool Flag(const char* key, bool absent) {
    const json* v = Find(key, false);
    if (v == nullptr) return absent;
    if (!v->is_boolean()) return Fail(key, "is not a boolean"), absent;
    return v->get<bool>();
  }
  // An integer in [lo, hi]; `absent` when the key is missing and not required.
  int64_t Int(const char* key, int64_t lo, int64_t hi, bool required = true, int64_t absent = 0) {
    const json* v = Find(key, required);
    if (v == nullptr) return absent;
    if (!v->is_number_integer() || v->get<int64_t>() < lo || v->get<int64_t>() > hi) {
      return Fail(key, "is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]"), absent;
    }
    return v->get<int64_t>();
  }
  std::optional<int64_t> OptionalInt(const char* key, int64_t lo, int64_t hi) {
    const json* v = Find(key, false);
    if (v == nullptr || v->is_null()) return std::nullopt;
    return Int(key, lo, hi);
  }
  std::optional<double> OptionalNumber(const json& v, const std::string& key) {
    if (v.is_null()) return std::nullopt;
    if (!v.is_number()) return Fail(key, "is not a number"), std::nullopt;
    return v.get<double>();
  }
  std::optional<double> OptionalNumber(const char* key) {
    const json* v = Find(key, false);
    return v == nullptr ? std::nullopt : OptionalNumber(*v, key);
  }
  double Number(const char* key) {
    const json* v = Find(key, true);
    if (v == nullptr) return 0;
    if (!v->is_number()) return Fail(key, "is not a number"), 0.0;
    return v->get<double>();
  }
  std::vector<std::string> Texts(const char* key) {
    std::vector<std::string> out;
    const json* v = Find(key, true);
    if (v == nullptr) return out;
    if (!v->is_array()) return Fail(key, "is not a list"), out;
    for (const json& e : *v) {
      if (!e.is_string()) return Fail(key, "holds a value that is not a string"), out;
      out.push_back(e.get<std::string>());
    }
    return out;
  }
  const json* Find(const char* key, bool required) {
    if (!status_.ok() || !j_.is_object()) return nullptr;
    auto it = j_.find(key);
    if (it == j_.end()) {
      if (required) Fail(key, "is missing");
      return nullptr;
    }
    return &*it;
  }
  void Fail(const std::string& key, const std::string& why) {
    if (status_.ok()) {
      status_ = CorruptError("index: the " + what_ + " facts' " + (key.empty() ? "record" : "'" + key + "'") + " " + why);
    }
  }

 private:
  const json& j_;
  std::string what_;
  Status status_ = Status::Ok();
};

// Megatron's args (DCP's common.pt, DeepSpeed's client state): one form for both.
json EncodeArgs(const MegatronCoreArgs& a) {
  json args = json::object();
  auto put = [&](const char* name, const std::optional<int64_t>& v) {
    if (v) args[name] = *v;
  };
  put("vocab_size", a.vocab_size);
  put("make_vocab_size_divisible_by", a.make_vocab_size_divisible_by);
  put("padded_vocab_size", a.padded_vocab_size);
  put("num_attention_heads", a.num_attention_heads);
  put("num_query_groups", a.num_query_groups);
  put("kv_channels", a.kv_channels);
  args["apply_wd_to_qk_layernorm"] = a.apply_wd_to_qk_layernorm;
  if (!a.architecture.empty()) args["architecture"] = a.architecture;
  return args;
}

Result<MegatronCoreArgs> DecodeArgs(const json& args) {
  Fields a(args, "Megatron args");
  MegatronCoreArgs m;
  m.vocab_size = a.OptionalInt("vocab_size", 1, kMaxCount);
  m.make_vocab_size_divisible_by = a.OptionalInt("make_vocab_size_divisible_by", 1, kMaxCount);
  m.padded_vocab_size = a.OptionalInt("padded_vocab_size", 1, kMaxCount);
  m.num_attention_heads = a.OptionalInt("num_attention_heads", 1, kMaxCount);
  m.num_query_groups = a.OptionalInt("num_query_groups", 1, kMaxCount);
  m.kv_channels = a.OptionalInt("kv_channels", 1, kMaxCount);
  m.apply_wd_to_qk_layernorm = a.Flag("apply_wd_to_qk_layernorm", false);
  if (const json* arch = a.Find("architecture", false)) {
    // Only what the scanner records: an object of scalars, each string short.
    if (!arch->is_object()) return CorruptError("index: the Megatron args' 'architecture' is not an object");
    for (const auto& [k, v] : arch->items()) {
      if (!(v.is_boolean() || v.is_number() || (v.is_string() && v.get_ref<const std::string&>().size() <= 256))) {
        return CorruptError("index: the Megatron args' architecture field '" + k + "' is not a bool, number or short string");
      }
    }
    m.architecture = *arch;
  }
  UCPFS_RETURN_IF_ERROR(a.status());
  return m;
}

// ---- dcp ----------------------------------------------------------------------------------

json Encode(const DcpSourceFacts& f) {
  json j = {{"megatron_core", f.megatron_core}};
  if (f.args) j["megatron_args"] = EncodeArgs(*f.args);
  return j;
}

Result<DcpSourceFacts> DecodeDcp(const json& j) {
  Fields f(j, "DCP");
  DcpSourceFacts out;
  out.megatron_core = f.Flag("megatron_core", false);
  if (const json* args = f.Find("megatron_args", false)) {
    UCPFS_ASSIGN_OR_RETURN(out.args, DecodeArgs(*args));
  }
  UCPFS_RETURN_IF_ERROR(f.status());
  return out;
}

// ---- deepspeed ----------------------------------------------------------------------------

json Encode(const DeepSpeedSourceFacts& f) {
  json steps = json::array();
  for (const auto& s : f.number_steps) steps.push_back(OptionalJson(s));
  json j = {{"tag", f.tag},
            {"zero_stage", f.zero_stage},
            {"dp", f.dp},
            {"tp", f.tp},
            {"pp", f.pp},
            {"universal_checkpoint_info", f.universal_checkpoint_info},
            {"model_files", f.model_files},
            {"optimizer_file", f.optimizer_file},
            {"number_steps", std::move(steps)}};
  if (f.megatron_args) j["megatron_args"] = EncodeArgs(*f.megatron_args);
  return j;
}

Result<DeepSpeedSourceFacts> DecodeDeepSpeed(const json& j) {
  Fields f(j, "DeepSpeed");
  DeepSpeedSourceFacts out;
  out.tag = f.Text("tag");
  out.zero_stage = static_cast<int>(f.Int("zero_stage", 0, 3));
  out.dp = static_cast<int>(f.Int("dp", 1, kMaxCount));
  out.tp = static_cast<int>(f.Int("tp", 1, kMaxCount));
  out.pp = static_cast<int>(f.Int("pp", 1, kMaxCount));
  if (const json* uc = f.Find("universal_checkpoint_info", false)) out.universal_checkpoint_info = *uc;
  out.model_files = f.Texts("model_files");
  out.optimizer_file = f.Text("optimizer_file");
  if (const json* steps = f.Find("number_steps", false)) {
    if (!steps->is_array()) {
      f.Fail("number_steps", "is not a list");
    } else {
      for (const json& s : *steps) out.number_steps.push_back(f.OptionalNumber(s, "number_steps"));
    }
  }
  if (const json* args = f.Find("megatron_args", false)) {
    UCPFS_ASSIGN_OR_RETURN(out.megatron_args, DecodeArgs(*args));
  }
  UCPFS_RETURN_IF_ERROR(f.status());
  return out;
}

// ---- megatron -----------------------------------------------------------------------------

json Encode(const MegatronSourceFacts& f) {
  json j = {{"iteration", OptionalJson(f.iteration)},
          {"dir", f.dir},
          {"tp", f.tp},
          {"pp", f.pp},
          {"num_layers", f.num_layers},
          {"hidden_size", f.hidden_size},
          {"num_attention_heads", f.num_attention_heads},
          {"num_query_groups", f.num_query_groups},
          {"kv_channels", f.kv_channels},
          {"swiglu", f.swiglu},
          {"tied_embeddings", f.tied_embeddings},
          {"padded_vocab_size", f.padded_vocab_size},
          {"vocab_size", OptionalJson(f.vocab_size)},
          {"make_vocab_size_divisible_by", f.make_vocab_size_divisible_by},
          {"distributed_optimizer", f.distributed_optimizer},
          {"checkpoint_version", f.checkpoint_version},
          {"optimizer_step", OptionalJson(f.optimizer_step)}};
  if (f.args) j["megatron_args"] = EncodeArgs(*f.args);
  return j;
}

Result<MegatronSourceFacts> DecodeMegatron(const json& j) {
  Fields f(j, "Megatron");
  MegatronSourceFacts out;
  out.iteration = f.OptionalText("iteration");
  out.dir = f.Text("dir");
  out.tp = static_cast<int>(f.Int("tp", 1, kMaxCount));
  out.pp = static_cast<int>(f.Int("pp", 1, kMaxCount));
  out.num_layers = f.Int("num_layers", 1, kMaxCount);
  out.hidden_size = f.Int("hidden_size", 1, kMaxCount);
  out.num_attention_heads = f.Int("num_attention_heads", 1, kMaxCount);
  out.num_query_groups = f.Int("num_query_groups", 1, kMaxCount);
  out.kv_channels = f.Int("kv_channels", 1, kMaxCount);
  if (f.Find("swiglu", true) != nullptr) out.swiglu = f.Flag("swiglu", false);
  out.tied_embeddings = f.Flag("tied_embeddings", true);
  out.padded_vocab_size = f.Int("padded_vocab_size", 1, kMaxCount);
  out.vocab_size = f.OptionalInt("vocab_size", 1, kMaxCount);
  out.make_vocab_size_divisible_by = f.Int("make_vocab_size_divisible_by", 0, kMaxCount, false);
  out.distributed_optimizer = f.Flag("distributed_optimizer", false);
  out.checkpoint_version = f.Number("checkpoint_version");
  out.optimizer_step = f.OptionalNumber("optimizer_step");
  if (const json* args = f.Find("megatron_args", false)) {
    UCPFS_ASSIGN_OR_RETURN(out.args, DecodeArgs(*args));
  }
  UCPFS_RETURN_IF_ERROR(f.status());
  return out;
}

// ---- torch_state --------------------------------------------------------------------------

json Encode(const TorchStateSourceFacts& f) {
  json j = {{"has_optimizer", f.has_optimizer},
            {"optimizer_file", f.optimizer_file},
            {"optimizer_prefix", f.optimizer_prefix},
            {"optimizer_top_key", f.optimizer_top_key},
            {"framework", f.framework},
            {"weights_wrapper", f.weights_wrapper},
            {"param_order", f.param_order},
            {"grouping", f.grouping},
            {"ambiguous", f.ambiguous},
            {"other_optimizers", f.other_optimizers}};
  if (f.module_prefix) j["module_prefix"] = *f.module_prefix;
  if (f.weights_container) j["weights_container"] = *f.weights_container;
  return j;
}

Result<TorchStateSourceFacts> DecodeTorchState(const json& j) {
  Fields f(j, "torch.save training state");
  TorchStateSourceFacts out;
  out.has_optimizer = f.Flag("has_optimizer", true);
  out.optimizer_file = f.Text("optimizer_file");
  out.optimizer_prefix = f.Text("optimizer_prefix");
  out.optimizer_top_key = f.Text("optimizer_top_key");
  out.framework = f.Text("framework", false);
  out.module_prefix = f.OptionalText("module_prefix");
  out.weights_container = f.OptionalText("weights_container");
  out.weights_wrapper = f.Text("weights_wrapper", false);
  out.param_order = f.Text("param_order", false);
  out.grouping = f.Text("grouping", false);
  out.ambiguous = f.Text("ambiguous", false);
  out.other_optimizers = f.Int("other_optimizers", 0, kMaxCount, false);
  UCPFS_RETURN_IF_ERROR(f.status());
  return out;
}

// ---- weights ------------------------------------------------------------------------------

json Encode(const WeightsSourceFacts& f) {
  json j = {{"container", f.container}, {"files", f.files}, {"skipped_values", f.skipped_values}};
  if (!f.state_dict_key.empty()) j["state_dict_key"] = f.state_dict_key;
  if (f.hf_config) {
    const HfModelConfig& c = *f.hf_config;
    json hf = {{"model_type", c.model_type}, {"architecture", c.architecture}, {"hidden_size", c.hidden_size},
               {"num_attention_heads", c.num_attention_heads}, {"num_key_value_heads", c.num_key_value_heads},
               {"head_dim", c.head_dim}, {"intermediate_size", c.intermediate_size},
               {"num_hidden_layers", c.num_hidden_layers}, {"vocab_size", c.vocab_size}, {"hidden_act", c.hidden_act}};
    if (c.tie_word_embeddings) hf["tie_word_embeddings"] = *c.tie_word_embeddings;
    j["hf_config"] = std::move(hf);
  }
  if (!f.hf_config_error.empty()) j["hf_config_error"] = f.hf_config_error;
  return j;
}

Result<WeightsSourceFacts> DecodeWeights(const json& j) {
  Fields f(j, "weights");
  WeightsSourceFacts out;
  out.container = f.Text("container");
  out.files = f.Texts("files");
  out.skipped_values = f.Int("skipped_values", 0, INT64_MAX);
  out.state_dict_key = f.Text("state_dict_key", false);
  out.hf_config_error = f.Text("hf_config_error", false);
  if (const json* hf = f.Find("hf_config", false)) {
    Fields h(*hf, "weights hf_config");
    HfModelConfig c;
    c.model_type = h.Text("model_type");
    c.architecture = h.Text("architecture");
    c.hidden_size = h.Int("hidden_size", 0, kMaxCount);
    c.num_attention_heads = h.Int("num_attention_heads", 0, kMaxCount);
    c.num_key_value_heads = h.Int("num_key_value_heads", 0, kMaxCount);
    c.head_dim = h.Int("head_dim", 0, kMaxCount);
    c.intermediate_size = h.Int("intermediate_size", 0, kMaxCount);
    c.num_hidden_layers = h.Int("num_hidden_layers", 0, kMaxCount);
    c.vocab_size = h.Int("vocab_size", 0, kMaxCount);
    c.hidden_act = h.Text("hidden_act");
    if (h.Find("tie_word_embeddings", false) != nullptr) c.tie_word_embeddings = h.Flag("tie_word_embeddings", false);
    UCPFS_RETURN_IF_ERROR(h.status());
    out.hf_config = std::move(c);
  }
  UCPFS_RETURN_IF_ERROR(f.status());
  return out;
}

template <typename T>
Result<SourceFacts> Wrap(Result<T> r) {
  if (!r.ok()) return r.error();
  return SourceFacts(std::move(*r));
}

}  // namespace

std::string EncodeSourceFacts(const SourceFacts& facts) {
  return std::visit(
      [](const auto& f) -> std::string {
        using T = std::decay_t<decltype(f)>;
        if constexpr (std::is_same_v<T, std::monostate>) {
          return std::string();
        } else {
          const char* name = std::is_same_v<T, DcpSourceFacts>         ? "dcp"
                             : std::is_same_v<T, DeepSpeedSourceFacts> ? "deepspeed"
                             : std::is_same_v<T, MegatronSourceFacts>  ? "megatron"
                             : std::is_same_v<T, TorchStateSourceFacts> ? "torch_state"
                                                                        : "weights";
          return json{{name, Encode(f)}}.dump();
        }
      },
      facts);
}

Result<SourceFacts> DecodeSourceFacts(std::string_view stored) {
  if (stored.empty()) return SourceFacts();
  if (stored.size() > kMaxSourceFactsBytes) return CorruptError("index: the scanner's facts are too large");
  const json j = json::parse(stored.begin(), stored.end(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.size() != 1) return CorruptError("index: the scanner's facts are not one named JSON object");
  const std::string name = j.begin().key();
  const json& body = j.begin().value();
  if (name == "dcp") return Wrap(DecodeDcp(body));
  if (name == "deepspeed") return Wrap(DecodeDeepSpeed(body));
  if (name == "megatron") return Wrap(DecodeMegatron(body));
  if (name == "torch_state") return Wrap(DecodeTorchState(body));
  if (name == "weights") return Wrap(DecodeWeights(body));
  return CorruptError("index: the scanner's facts name no known scanner ('" + name + "')");
}

}  // namespace ucpfs::index
