// See hf_view.h. The families' plans are in hf_plans.h (hf_megatron.cc, hf_titan.cc); here the
// family is chosen and the plan becomes config.json and safetensors shards.
#include "views/hf_view.h"

#include <cstring>
#include <map>
#include <memory>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/format/safetensors.h"
#include "core/io/source_tree.h"
#include "core/slice/local_view.h"
#include "views/atomic.h"
#include "views/hf_plans.h"
#include "index/source_facts.h"

namespace ucpfs::index {
namespace {

using json = nlohmann::ordered_json;
using hf::LlamaFacts;
using hf::Missing;
using hf::Planned;

std::shared_ptr<const ByteSource> TextFile(const std::string& name, const std::string& text) {
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  return std::make_shared<MemorySource>(name, std::move(bytes));
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

}  // namespace

Status hf::Missing(const std::string& fact, const std::string& why) {
  return InvalidArgumentError("hf/: the source does not record " + fact + " (" + why + ")");
}

Result<DType> ParseHfDType(const std::string& text) {
  if (text == "bf16" || text == "bfloat16") return DType::kBFloat16;
  if (text == "fp16" || text == "float16" || text == "half") return DType::kFloat16;
  if (text == "fp32" || text == "float32" || text == "float") return DType::kFloat32;
  return InvalidArgumentError("--hf-dtype '" + text + "': expected bf16, fp16 or fp32");
}

Result<std::vector<SafetensorsViewFile>> BuildHfView(const Checkpoint& c, const std::shared_ptr<const void>& owner,
                                                     const KeyMapping& mapping, const FileTable& files,
                                                     const PatternOptions& patterns, const SourceTree& source,
                                                     const HfViewOptions& options) {
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
  const auto* legacy = std::get_if<MegatronSourceFacts>(&c.facts);
  const auto* ds = std::get_if<DeepSpeedSourceFacts>(&c.facts);
  if ((dcp != nullptr && dcp->megatron_core) || legacy != nullptr) {
    const bool has_output = weights.count("output_layer.weight") > 0;
    UCPFS_ASSIGN_OR_RETURN(facts, dcp != nullptr
                                      ? hf::MegatronFacts(dcp->args, "common.pt", patterns, has_output)
                                      : hf::MegatronFacts(legacy->args, "model_optim_rng.pt", patterns, has_output));
    UCPFS_ASSIGN_OR_RETURN(plan, hf::MegatronPlan(weights, facts, hf::MegatronCoreNames(facts.layers)));
  } else if (ds != nullptr && ds->megatron_args) {
    // Megatron-DeepSpeed: its args in the client state, its own names.
    const hf::MegatronNames names = hf::MegatronDeepSpeedNames(weights);
    bool has_output = false;
    for (const auto& n : names.output) has_output |= weights.count(n) > 0;
    UCPFS_RETURN_IF_ERROR(hf::RefuseAutoTpQkv(*ds));
    UCPFS_ASSIGN_OR_RETURN(facts,
                           hf::MegatronFacts(ds->megatron_args, "the DeepSpeed client state", patterns, has_output));
    UCPFS_ASSIGN_OR_RETURN(plan, hf::MegatronPlan(weights, facts, names));
  } else if (dcp != nullptr && hf::IsTitanSource(weights)) {
    UCPFS_ASSIGN_OR_RETURN(given_config, hf::TitanConfig(weights, options, &facts));
    UCPFS_ASSIGN_OR_RETURN(plan, hf::TitanPlan(weights, facts));
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
      layout = KeptLayout(it, owner);
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
  out.push_back({"config.json", TextFile("hf/config.json", hf::LlamaConfigJson(facts, model_dtype))});
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
