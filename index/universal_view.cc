// BuildUniversalView: see universal_view.h. The per-parameter logic follows ds_to_universal's
// merge_tp_slices at one tensor-parallel rank (research/deepspeed.md §3).
#include "index/universal_view.h"

#include <nlohmann/json.hpp>

#include <map>
#include <regex>
#include <set>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "core/format/plain_value.h"
#include "core/format/torch_file.h"
#include "core/format/torch_writer.h"
#include "core/layout/patterns.h"
#include "core/views/atomic.h"

namespace ucpfs::index {
namespace {

using format::SaveValue;

// layout::RuleMatches (RE2, linear time) where the layout library has it; the std::regex
// `compiled` of older builds otherwise. TODO: call layout::RuleMatches directly once the RE2
// switch of core/layout has landed.
template <typename R>
bool MatchesRule(const R& r, const std::string& name) {
  if constexpr (requires { RuleMatches(r, std::string_view(name)); }) {
    return RuleMatches(r, std::string_view(name));
  } else {
    return std::regex_search(name, r.compiled);
  }
}
bool Matches(const layout::Rule& r, const std::string& name) { return MatchesRule(r, name); }

// The pattern lists of universal_checkpoint_info, as layout rules (Python's re.match: anchored
// at the start of the name only). layout::RuleMatches runs them in linear time, so a
// checkpoint's hostile pattern cannot hang the daemon.
struct UcPatterns {
  std::vector<layout::Rule> replicated, average, row, vocab, two_sub, sub_params;
  std::optional<int64_t> original_vocab_size;
  bool affine_map = false;
};

Result<std::vector<layout::Rule>> RulesOf(const nlohmann::json& uc, const char* key, layout::TpKind tp,
                                          const std::string& where) {
  std::vector<layout::Rule> out;
  if (!uc.contains(key) || uc[key].is_null()) return out;
  if (!uc[key].is_array()) return CorruptError(where + ": universal_checkpoint_info['" + key + "'] is not a list");
  for (const auto& p : uc[key]) {
    if (!p.is_string()) return CorruptError(where + ": universal_checkpoint_info['" + key + "'] holds a non-string");
    layout::Rule r;
    r.regex = "^(?:" + p.get<std::string>() + ")";
    r.tp = tp;
    auto made = layout::MakeRule(std::move(r));
    if (!made.ok()) {
      return CorruptError(where + ": universal_checkpoint_info['" + key + "']: " + made.error().message());
    }
    out.push_back(std::move(*made));
  }
  return out;
}

Result<UcPatterns> ParseUc(const nlohmann::json& uc, const std::string& where) {
  UcPatterns p;
  if (!uc.is_object()) return p;  // no universal_checkpoint_info: ds_to_universal's defaults
  UCPFS_ASSIGN_OR_RETURN(p.replicated, RulesOf(uc, "tp_replicated_parameter_patterns", layout::TpKind::kReplicate, where));
  UCPFS_ASSIGN_OR_RETURN(p.average, RulesOf(uc, "parameter_to_average_patterns", layout::TpKind::kPartial, where));
  UCPFS_ASSIGN_OR_RETURN(p.row, RulesOf(uc, "parameter_with_row_parallelism_patterns", layout::TpKind::kRow, where));
  UCPFS_ASSIGN_OR_RETURN(p.vocab, RulesOf(uc, "vocabulary_parameter_patterns", layout::TpKind::kVocab, where));
  UCPFS_ASSIGN_OR_RETURN(p.two_sub, RulesOf(uc, "parameter_with_2_sub_params_cat_dim_0", layout::TpKind::kColumn, where));
  if (uc.contains("parameter_with_sub_params") && uc["parameter_with_sub_params"].is_array()) {
    for (const auto& s : uc["parameter_with_sub_params"]) {
      if (!s.is_object() || !s.contains("patterns")) continue;
      nlohmann::json wrapped = {{"patterns", s["patterns"]}};
      UCPFS_ASSIGN_OR_RETURN(auto rules, RulesOf(wrapped, "patterns", layout::TpKind::kColumn, where));
      for (auto& r : rules) p.sub_params.push_back(std::move(r));
    }
  }
  if (uc.contains("original_vocab_size") && uc["original_vocab_size"].is_number_integer()) {
    p.original_vocab_size = uc["original_vocab_size"].get<int64_t>();
  }
  p.affine_map = uc.contains("affine_map") && !uc["affine_map"].is_null() && !uc["affine_map"].empty();
  return p;
}

// The one matching pattern of a list, as ds_to_universal's get_matched_pattern (which asserts
// that at most one matches).
Result<bool> MatchOne(const std::vector<layout::Rule>& rules, const std::string& name, const char* list) {
  int n = 0;
  for (const auto& r : rules) n += Matches(r, name) ? 1 : 0;
  if (n > 1) {
    return UnsupportedError("parameter '" + name + "' matches " + std::to_string(n) + " patterns of " + list +
                            " (ds_to_universal refuses that too)");
  }
  return n == 1;
}

// The dict keys before 'param' and the rows kept, for a ZeRO-1/2 parameter.
struct UniversalKeys {
  SaveValue::DictItems keys;
  std::optional<int64_t> keep_rows;  // vocabulary: original_vocab_size
};

Result<UniversalKeys> KeysFor(const UcPatterns& uc, const std::string& name, const std::vector<int64_t>& shape) {
  UniversalKeys k;
  if (uc.affine_map) return UnsupportedError("parameter '" + name + "': universal_checkpoint_info has an affine_map");
  UCPFS_ASSIGN_OR_RETURN(bool replicated, MatchOne(uc.replicated, name, "tp_replicated_parameter_patterns"));
  bool average = false, two_sub = false;
  if (!replicated) {
    UCPFS_ASSIGN_OR_RETURN(average, MatchOne(uc.average, name, "parameter_to_average_patterns"));
  }
  if (!replicated && !average) {
    UCPFS_ASSIGN_OR_RETURN(two_sub, MatchOne(uc.two_sub, name, "parameter_with_2_sub_params_cat_dim_0"));
  }
  if (!replicated && !average && !two_sub) {
    for (const auto& r : uc.sub_params) {
      if (Matches(r, name)) {
        return UnsupportedError("parameter '" + name + "' is declared in parameter_with_sub_params (not served yet)");
      }
    }
    UCPFS_ASSIGN_OR_RETURN(bool row, MatchOne(uc.row, name, "parameter_with_row_parallelism_patterns"));
    k.keys.emplace_back(SaveValue::Str("cat_dim"), SaveValue::Int(row ? 1 : 0));
  } else if (two_sub) {
    k.keys.emplace_back(SaveValue::Str("cat_dim"), SaveValue::Int(0));
    k.keys.emplace_back(SaveValue::Str("param_n_sub_params"), SaveValue::Int(2));
  }
  UCPFS_ASSIGN_OR_RETURN(bool vocab, MatchOne(uc.vocab, name, "vocabulary_parameter_patterns"));
  if (vocab) {
    if (!uc.original_vocab_size) {
      return UnsupportedError("parameter '" + name +
                              "' is a vocabulary parameter but universal_checkpoint_info has no original_vocab_size");
    }
    if (shape.size() != 2 || *uc.original_vocab_size < 0) {
      return UnsupportedError("vocabulary parameter '" + name + "' is not 2-D");
    }
    k.keep_rows = std::min(*uc.original_vocab_size, shape[0]);
    k.keys.emplace_back(SaveValue::Str("vocab_tensor"), SaveValue::Bool(true));
  }
  return k;
}

format::SaveOptions OptionsFor(const std::string& file) {
  format::SaveOptions o;
  o.prefix = file.substr(0, file.find('.'));  // torch.save names the archive after the file
  return o;
}

// A tensor of `item` in its stored dtype (the first fragment's), optionally only its first rows.
SaveValue TensorOf(const Item& item, const FileTable& files, bool requires_grad, std::optional<int64_t> rows,
                   bool flat) {
  auto layout = std::make_shared<const slice::TensorLayout>(item.layout);
  const DType dtype = item.layout.fragments.empty() ? item.dtype : item.layout.fragments.front().dtype;
  format::SaveTensor t;
  t.dtype = dtype;
  t.shape = item.layout.shape;
  if (rows) t.shape[0] = *rows;  // a row prefix is a prefix of the row-major bytes
  if (flat) {
    uint64_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
    t.shape = {static_cast<int64_t>(n)};
  }
  t.provider = std::make_shared<views::LayoutProvider>(std::move(layout), dtype, files);
  t.requires_grad = requires_grad;
  return SaveValue::Tensor(std::move(t));
}

Result<std::shared_ptr<const ByteSource>> Build(const SaveValue& root, const std::string& dir, const std::string& rel,
                                                const std::string& file) {
  UCPFS_ASSIGN_OR_RETURN(auto f, format::LazyTorchFile::Build(root, dir + "/" + rel, OptionsFor(file)));
  return std::shared_ptr<const ByteSource>(std::move(f));
}

// zero/optimizer_state.pt: what ds_to_universal's _save_optimizer_state(_stage3) saves.
Result<SaveValue> OptimizerState(const Checkpoint& c, const FileTable& files, const std::string& optim_rel,
                                 bool zero3) {
  int64_t id = -1;
  for (size_t i = 0; i < c.files.size(); ++i) {
    if (c.files[i].rel_path == optim_rel) id = static_cast<int64_t>(i);
  }
  if (id < 0) return CorruptError("index: format_info names optimizer file '" + optim_rel + "', not in the file table");
  const std::shared_ptr<const ByteSource>& src = (*files)[static_cast<size_t>(id)];
  UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, format::TorchFile::Open(src));
  const pickle::PickleGraph& g = tf.graph();
  const pickle::NodeId osd = g.DictGet(g.root(), "optimizer_state_dict");
  if (g.kind(osd) != pickle::Kind::kDict) return CorruptError(src->Name() + ": optimizer_state_dict is not a dict");
  format::PlainValueLimits limits;
  limits.keep_objects = true;
  limits.max_depth = 32;
  const std::set<std::string_view> sharded = {"base_optimizer_state", "param_slice_mappings",
                                              "single_partition_of_fp32_groups"};
  // Python dict semantics: a repeated key keeps its first position and its last value.
  SaveValue::DictItems out;
  std::unordered_map<std::string, size_t> position;
  auto put = [&](SaveValue key, SaveValue value, const std::string& slot) {
    auto [it, fresh] = position.try_emplace(slot, out.size());
    if (fresh) {
      out.emplace_back(std::move(key), std::move(value));
    } else {
      out[it->second].second = std::move(value);
    }
  };
  for (const auto& [k, v] : g.dict_items(osd)) {
    if (g.kind(k) != pickle::Kind::kString && g.kind(k) != pickle::Kind::kInt) {
      return UnsupportedError(src->Name() + ": optimizer_state_dict has a key that is neither str nor int");
    }
    const bool str = g.kind(k) == pickle::Kind::kString;
    const std::string text = str ? std::string(g.text(k)) : std::to_string(g.int_value(k));
    if (!zero3 && str && sharded.count(text) > 0) continue;
    UCPFS_ASSIGN_OR_RETURN(SaveValue value, format::DecodeValueAt(tf, src, v, limits));
    put(str ? SaveValue::Str(text) : SaveValue::Int(g.int_value(k)), std::move(value), (str ? "s:" : "i:") + text);
  }
  const pickle::NodeId inner = g.DictGet(osd, zero3 ? "optimizer_state_dict" : "base_optimizer_state");
  const pickle::NodeId groups = g.DictGet(inner, "param_groups");
  if (groups == pickle::kNoNode) return CorruptError(src->Name() + ": no param_groups in the optimizer state");
  UCPFS_ASSIGN_OR_RETURN(SaveValue pg, format::DecodeValueAt(tf, src, groups, limits));
  put(SaveValue::Str("param_groups"), std::move(pg), "s:param_groups");
  return SaveValue::Dict(std::move(out));
}

Result<nlohmann::json> DeepSpeedInfo(const Checkpoint& c) {
  const nlohmann::json info = nlohmann::json::parse(c.format_info, nullptr, /*allow_exceptions=*/false);
  if (!info.is_object() || !info.contains("zero_stage") || !info["zero_stage"].is_number_integer() ||
      !info.contains("optimizer_file") || !info["optimizer_file"].is_string() || !info.contains("model_files") ||
      !info["model_files"].is_array() || !info.contains("tag") || !info["tag"].is_string()) {
    return CorruptError("index: the DeepSpeed format_info is incomplete");
  }
  return info;
}

}  // namespace

Result<SourcePatterns> SourcePatternsOf(const Checkpoint& c) {
  SourcePatterns out;
  if (c.format != "deepspeed") return out;
  UCPFS_ASSIGN_OR_RETURN(nlohmann::json info, DeepSpeedInfo(c));
  UCPFS_ASSIGN_OR_RETURN(UcPatterns uc, ParseUc(info.value("universal_checkpoint_info", nlohmann::json()),
                                                info["optimizer_file"].get<std::string>()));
  for (auto* list : {&uc.replicated, &uc.average, &uc.vocab, &uc.row}) {
    for (auto& r : *list) out.rules.push_back(std::move(r));
  }
  out.vocab_size = uc.original_vocab_size;
  return out;
}

Result<std::optional<UniversalView>> BuildUniversalView(const Checkpoint& c, const KeyMapping& mapping,
                                                        const FileTable& files, const std::string& source_name) {
  if (c.format != "deepspeed") return std::optional<UniversalView>();
  UCPFS_ASSIGN_OR_RETURN(const nlohmann::json info, DeepSpeedInfo(c));
  const bool zero3 = info["zero_stage"].get<int>() == 3;
  const std::string tag = info["tag"].get<std::string>();
  UniversalView view;
  view.dir = (tag.empty() ? source_name : tag) + "_universal";
  if (!tag.empty()) view.latest_universal = view.dir;
  const std::string optim_rel = info["optimizer_file"].get<std::string>();
  UCPFS_ASSIGN_OR_RETURN(UcPatterns uc, ParseUc(info.value("universal_checkpoint_info", nlohmann::json()), optim_rel));

  const char* kFiles[] = {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"};
  const StateKind kKinds[] = {StateKind::kFp32, StateKind::kExpAvg, StateKind::kExpAvgSq};
  for (const ParamEntry& p : mapping.params) {
    const std::string dir = "zero/" + views::AtomicDirName(p.name);
    const int32_t fp32 = p.item[static_cast<int>(StateKind::kFp32)];
    if (fp32 < 0) {
      // A module tensor without optimizer state: {'param': tensor.float()}.
      const int32_t w = p.item[static_cast<int>(StateKind::kWeight)];
      if (zero3 || w < 0 || c.items[static_cast<size_t>(w)].kind != ItemKind::kTensor) continue;
      const Item& item = c.items[static_cast<size_t>(w)];
      SaveValue root = SaveValue::Dict();
      auto layout = std::make_shared<const slice::TensorLayout>(item.layout);
      root.Set("param", SaveValue::Tensor(DType::kFloat32, item.layout.shape,
                                          std::make_shared<views::LayoutProvider>(layout, DType::kFloat32, files)));
      UCPFS_ASSIGN_OR_RETURN(auto src, Build(root, view.dir, dir + "/fp32.pt", "fp32.pt"));
      view.files.push_back({dir + "/fp32.pt", std::move(src), {}});
      continue;
    }
    UniversalKeys keys;
    if (!zero3) {
      UCPFS_ASSIGN_OR_RETURN(keys, KeysFor(uc, p.name, c.items[static_cast<size_t>(fp32)].layout.shape));
    }
    for (int s = 0; s < 3; ++s) {
      const int32_t i = p.item[static_cast<int>(kKinds[s])];
      if (i < 0 || c.items[static_cast<size_t>(i)].kind != ItemKind::kTensor) continue;
      SaveValue tensor = TensorOf(c.items[static_cast<size_t>(i)], files, kKinds[s] == StateKind::kFp32,
                                  keys.keep_rows, zero3);
      SaveValue root;
      if (zero3) {
        root = std::move(tensor);
      } else {
        root = SaveValue::Dict(keys.keys);
        root.Set("param", std::move(tensor));
      }
      const std::string rel = dir + "/" + kFiles[s];
      UCPFS_ASSIGN_OR_RETURN(auto src, Build(root, view.dir, rel, kFiles[s]));
      view.files.push_back({rel, std::move(src), {}});
    }
    const int32_t step = p.item[static_cast<int>(StateKind::kStep)];
    if (!zero3 && step >= 0 && c.items[static_cast<size_t>(step)].kind == ItemKind::kTensor) {
      SaveValue root = TensorOf(c.items[static_cast<size_t>(step)], files, false, std::nullopt, false);
      UCPFS_ASSIGN_OR_RETURN(auto src, Build(root, view.dir, dir + "/step.pt", "step.pt"));
      view.files.push_back({dir + "/step.pt", std::move(src), {}});
    }
  }

  UCPFS_ASSIGN_OR_RETURN(SaveValue optim, OptimizerState(c, files, optim_rel, zero3));
  UCPFS_ASSIGN_OR_RETURN(auto optim_src, Build(optim, view.dir, "zero/optimizer_state.pt", "optimizer_state.pt"));
  view.files.push_back({"zero/optimizer_state.pt", std::move(optim_src), {}});

  for (const auto& m : info["model_files"]) {
    if (!m.is_string()) return CorruptError("index: the DeepSpeed format_info lists a model file that is not a path");
    const std::string rel = m.get<std::string>();
    if (!SafeRelativePath(rel)) return CorruptError("index: the DeepSpeed format_info names model file '" + rel + "'");
    view.files.push_back({rel.substr(rel.rfind('/') + 1), nullptr, rel});
  }
  return std::optional<UniversalView>(std::move(view));
}

}  // namespace ucpfs::index
