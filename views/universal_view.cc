// BuildUniversalView: see universal_view.h. The per-parameter logic follows ds_to_universal's
// merge_tp_slices at one tensor-parallel rank (docs/formats.md "The universal checkpoint").
#include "views/universal_view.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "core/format/plain_value.h"
#include "core/format/torch_file.h"
#include "core/format/torch_writer.h"
#include "core/layout/patterns.h"
#include "views/atomic.h"
#include "index/deepspeed_patterns.h"
#include "index/deepspeed_scan.h"

namespace ucpfs::index {
namespace {

using format::SaveValue;

// A file of the checkpoint by its relative path, opened as a torch.save archive.
Result<std::pair<format::TorchFile, std::shared_ptr<const ByteSource>>> OpenCheckpointFile(const Checkpoint& c,
                                                                                          const FileTable& files,
                                                                                          const std::string& rel) {
  for (size_t i = 0; i < c.files.size(); ++i) {
    if (c.files[i].rel_path != rel) continue;
    const std::shared_ptr<const ByteSource>& src = (*files)[i];
    UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, format::TorchFile::Open(src));
    return std::make_pair(std::move(tf), src);
  }
  return CorruptError("index: the DeepSpeed facts name file '" + rel + "', not in the file table");
}

// DeepSpeed's SubparamShape objects, as ds_to_universal saves them under 'sub_param_shape':
// SubparamShape(**entry) of the matched parameter_with_sub_params entry, its fields decoded
// from the model states' pickle (so lists stay lists and tuples tuples), in the dataclass's
// field order; before version 0.4 a count at partition_dim becomes the tuple of sizes.
class SubParamShapes {
 public:
  SubParamShapes(const Checkpoint& c, const FileTable& files, std::string model_rel)
      : c_(c), files_(files), model_rel_(std::move(model_rel)) {}

  Result<SaveValue> For(const DeepSpeedPatterns& uc, const DeepSpeedParamRule& rule, const std::string& name,
                        const std::vector<int64_t>& shape) {
    const DeepSpeedSubParams& sp = *rule.sub_params;
    if (shape.empty()) return UnsupportedError("parameter '" + name + "' is 0-d but has sub-parameters");
    UCPFS_ASSIGN_OR_RETURN(const DeepSpeedSubSplit split, DeepSpeedSubParamSplit(uc, rule, name, /*tp=*/0, shape[0]));
    if (!model_) {
      UCPFS_ASSIGN_OR_RETURN(auto opened, OpenCheckpointFile(c_, files_, model_rel_));
      model_.emplace(std::move(opened.first));
      model_src_ = std::move(opened.second);
    }
    const pickle::PickleGraph& g = model_->graph();
    const pickle::NodeId list = g.DictGet(g.DictGet(g.root(), "universal_checkpoint_info"), "parameter_with_sub_params");
    const pickle::Kind kind = g.kind(list);
    if ((kind != pickle::Kind::kList && kind != pickle::Kind::kTuple) || sp.index >= g.items(list).size()) {
      return CorruptError(model_src_->Name() + ": universal_checkpoint_info['parameter_with_sub_params'] changed");
    }
    const pickle::NodeId entry = g.items(list)[sp.index];
    format::PlainValueLimits limits;
    limits.max_depth = 8;
    limits.max_nodes = 1 << 16;
    SaveValue fields = SaveValue::Dict();
    for (const char* field : {"patterns", "shape", "partition_dim"}) {
      const pickle::NodeId v = g.DictGet(entry, field);
      if (v == pickle::kNoNode) return CorruptError(model_src_->Name() + ": a SubparamShape without '" + field + "'");
      UCPFS_ASSIGN_OR_RETURN(SaveValue value, format::DecodeValueAt(*model_, model_src_, v, limits));
      if (std::string_view(field) == "shape" && uc.version < 0.4 && sp.shape[static_cast<size_t>(sp.partition_dim)].is_number_integer()) {
        // ds_to_universal normalises a count: tuple(shape) with the sizes at partition_dim.
        SaveValue dims = SaveValue::Tuple();
        for (size_t d = 0; d < sp.shape.size(); ++d) {
          if (d == static_cast<size_t>(sp.partition_dim)) {
            SaveValue sizes = SaveValue::Tuple();
            for (int64_t n : split.sizes) sizes.Append(SaveValue::Int(n));
            dims.Append(std::move(sizes));
          } else if (sp.shape[d].is_number_integer()) {
            dims.Append(SaveValue::Int(sp.shape[d].get<int64_t>()));
          } else {
            return UnsupportedError("parameter '" + name + "': its sub-parameter shape has a non-integer dim");
          }
        }
        value = std::move(dims);
      }
      fields.Set(field, std::move(value));
    }
    return SaveValue::Object(SaveValue::Global("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
                             SaveValue::Tuple(), /*newobj=*/true, std::move(fields));
  }

 private:
  const Checkpoint& c_;
  const FileTable& files_;
  std::string model_rel_;
  std::optional<format::TorchFile> model_;
  std::shared_ptr<const ByteSource> model_src_;
};

// The dict keys before 'param' and the rows kept, for a ZeRO-1/2 parameter.
struct UniversalKeys {
  SaveValue::DictItems keys;
  std::optional<int64_t> keep_rows;  // vocabulary: original_vocab_size
};

Result<UniversalKeys> KeysFor(const DeepSpeedPatterns& uc, const std::string& name, const std::vector<int64_t>& shape,
                              SubParamShapes& sub_shapes) {
  UniversalKeys k;
  UCPFS_ASSIGN_OR_RETURN(const DeepSpeedParamRule rule, ClassifyDeepSpeedParam(uc, name));
  switch (rule.merge) {
    case DeepSpeedMerge::kReplicated:
    case DeepSpeedMerge::kAverage: break;
    case DeepSpeedMerge::kTwoSub:
      k.keys.emplace_back(SaveValue::Str("cat_dim"), SaveValue::Int(0));
      k.keys.emplace_back(SaveValue::Str("param_n_sub_params"), SaveValue::Int(2));
      break;
    case DeepSpeedMerge::kSubParams: {
      UCPFS_ASSIGN_OR_RETURN(SaveValue shape_object, sub_shapes.For(uc, rule, name, shape));
      k.keys.emplace_back(SaveValue::Str("sub_param_shape"), std::move(shape_object));
      break;
    }
    case DeepSpeedMerge::kCat: k.keys.emplace_back(SaveValue::Str("cat_dim"), SaveValue::Int(rule.cat_dim)); break;
  }
  if (rule.vocab) {
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

// A tensor of `item` in its stored dtype (the first fragment's), optionally only its first rows;
// its layout kept as KeptLayout keeps it (`owner`).
SaveValue TensorOf(const Item& item, const std::shared_ptr<const void>& owner, const FileTable& files,
                   bool requires_grad, std::optional<int64_t> rows, bool flat) {
  std::shared_ptr<const slice::TensorLayout> layout = KeptLayout(item, owner);
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

// The virtual file `rel` (named `file`) holding `root`: built once here to size it, and kept
// as its builder.
Result<UniversalFile> Virtual(SaveValue root, const std::string& dir, const std::string& rel, const std::string& file) {
  std::string name = dir + "/" + rel;
  format::SaveOptions options = OptionsFor(file);
  UCPFS_ASSIGN_OR_RETURN(auto sized, format::LazyTorchFile::Build(root, name, options));
  UniversalFile out{.rel_path = rel, .n_bytes = sized->Size(), .build = nullptr, .source_rel = {}};
  out.build = [root = std::move(root), name = std::move(name),
               options = std::move(options)]() -> Result<std::shared_ptr<const ByteSource>> {
    UCPFS_ASSIGN_OR_RETURN(auto f, format::LazyTorchFile::Build(root, name, options));
    return std::shared_ptr<const ByteSource>(std::move(f));
  };
  return out;
}

// zero/optimizer_state.pt: what ds_to_universal's _save_optimizer_state(_stage3) saves.
Result<SaveValue> OptimizerState(const Checkpoint& c, const FileTable& files, const std::string& optim_rel,
                                 bool zero3) {
  UCPFS_ASSIGN_OR_RETURN(auto opened, OpenCheckpointFile(c, files, optim_rel));
  const format::TorchFile& tf = opened.first;
  const std::shared_ptr<const ByteSource>& src = opened.second;
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
    if (str && text == "zero_stage" && g.kind(v) == pickle::Kind::kObject) {
      // ZeroStageEnum as DeepSpeed loads it, re-emitted by value (ZeroStageEnum(n)): the same member
      // whichever form the source's Python pickled (by name under Debian 12's 3.11.2).
      const std::optional<int64_t> stage = DeepSpeedZeroStage(g, v);
      if (!stage) return CorruptError(src->Name() + ": optimizer_state_dict.zero_stage is not a ZeroStageEnum");
      put(SaveValue::Str(text),
          SaveValue::Object(SaveValue::Global(std::string(kZeroStageEnumModule), std::string(kZeroStageEnumClass)),
                            SaveValue::Tuple({SaveValue::Int(*stage)}), /*newobj=*/false),
          "s:" + text);
      continue;
    }
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

// Megatron-Core torch_dist: the vocabulary facts the scanner read from common.pt's args
// (dcp_scan.cc ReadMegatronArgs).
SourcePatterns MegatronSourcePatterns(const MegatronCoreArgs& args) {
  SourcePatterns out;
  if (args.vocab_size) out.vocab_size = *args.vocab_size;
  out.model_facts.vocab_pad_multiple = args.make_vocab_size_divisible_by.value_or(0);
  out.model_facts.num_attention_heads = args.num_attention_heads.value_or(0);
  out.model_facts.num_query_groups = args.num_query_groups.value_or(0);
  out.model_facts.head_dim = args.kv_channels.value_or(0);
  return out;
}

// A regex matching exactly `name` (RE2, Latin-1): punctuation escaped, other bytes as \x{HH}.
std::string ExactNameRegex(const std::string& name) {
  std::string out = "^";
  for (unsigned char ch : name) {
    if (std::isalnum(ch) || ch == '_') {
      out += static_cast<char>(ch);
    } else if (ch < 0x80 && std::ispunct(ch)) {
      out += '\\';
      out += static_cast<char>(ch);
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x{";
      out += kHex[ch >> 4];
      out += kHex[ch & 15];
      out += '}';
    }
  }
  return out + "$";
}

// The parameters parameter_with_sub_params declares (AutoTP's fused QKV with GQA, [q; k; v]) as
// column rules with their sub-parameter sizes, so a target layout splits each sub-parameter by
// tp as DeepSpeed's universal loader does (never as a preset's fused QKV). Sizes recorded as a
// list (AutoTP, every version) hold for every name the entry's patterns match; a count (before
// 0.4) gives sizes by each tensor's rows, so those parameters get one exact-name rule each.
Result<std::vector<layout::Rule>> SubParamRules(const DeepSpeedPatterns& uc, const Checkpoint& c) {
  std::vector<layout::Rule> out;
  for (const DeepSpeedSubParams& sp : uc.sub_params) {
    const nlohmann::json& spec = sp.shape.is_array() && sp.shape.size() > static_cast<size_t>(sp.partition_dim)
                                     ? sp.shape[static_cast<size_t>(sp.partition_dim)]
                                     : nlohmann::json();
    if (sp.partition_dim != 0 || !spec.is_array()) continue;
    DeepSpeedParamRule as_rule;
    as_rule.merge = DeepSpeedMerge::kSubParams;
    as_rule.sub_params = &sp;
    const std::string what = "pattern '" + (sp.patterns.empty() ? std::string() : sp.patterns[0]) + "'";
    UCPFS_ASSIGN_OR_RETURN(DeepSpeedSubSplit split, DeepSpeedSubParamSplit(uc, as_rule, what, 0, -1));
    for (layout::Rule r : sp.rules) {
      r.tp = layout::TpKind::kColumn;
      r.tp_dim = 0;
      r.sub_sizes = split.sizes;
      out.push_back(std::move(r));
    }
  }
  for (const Item& item : c.items) {
    if (!item.model_tensor || item.kind != ItemKind::kTensor || item.layout.shape.empty()) continue;
    Result<DeepSpeedParamRule> rule = ClassifyDeepSpeedParam(uc, item.key);
    if (!rule.ok() || rule->merge != DeepSpeedMerge::kSubParams) continue;
    const DeepSpeedSubParams& sp = *rule->sub_params;
    if (sp.partition_dim != 0 || !sp.shape.is_array() || sp.shape.empty() || sp.shape[0].is_array()) continue;
    UCPFS_ASSIGN_OR_RETURN(DeepSpeedSubSplit split,
                           DeepSpeedSubParamSplit(uc, *rule, item.key, 0, item.layout.shape[0]));
    layout::Rule r;
    r.regex = ExactNameRegex(item.key);
    r.tp = layout::TpKind::kColumn;
    r.tp_dim = 0;
    r.sub_sizes = split.sizes;
    UCPFS_ASSIGN_OR_RETURN(r, layout::MakeRule(std::move(r)));
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

Result<SourcePatterns> SourcePatternsOf(const Checkpoint& c) {
  SourcePatterns out;
  if (const auto* dcp = std::get_if<DcpSourceFacts>(&c.facts); dcp != nullptr && dcp->megatron_core) {
    return dcp->args ? MegatronSourcePatterns(*dcp->args) : out;
  }
  const auto* info = std::get_if<DeepSpeedSourceFacts>(&c.facts);
  if (info == nullptr) return out;
  UCPFS_ASSIGN_OR_RETURN(DeepSpeedPatterns uc,
                         ParseDeepSpeedPatterns(info->universal_checkpoint_info, info->optimizer_file));
  // Megatron-DeepSpeed's args: the heads and query groups its group-interleaved query_key_value
  // is split by, the vocabulary's pad multiple.
  if (info->megatron_args) out = MegatronSourcePatterns(*info->megatron_args);
  UCPFS_ASSIGN_OR_RETURN(out.rules, SubParamRules(uc, c));
  for (auto* list : {&uc.replicated, &uc.average, &uc.vocab, &uc.row}) {
    for (auto& r : *list) out.rules.push_back(std::move(r));
  }
  if (uc.original_vocab_size) out.vocab_size = uc.original_vocab_size;
  return out;
}

// ZeRO-1/2 and BF16_Optimizer keep the torch optimizer's state as base_optimizer_state; ZeRO-3
// as optimizer_state_dict, whose groups' `params` number the group's flat sub-groups.
namespace {
const char* DeepSpeedBaseOptimizerKey(bool zero3) { return zero3 ? "optimizer_state_dict" : "base_optimizer_state"; }
}  // namespace

std::string DeepSpeedParamGroupsKey(const Checkpoint& c) {
  const auto* info = std::get_if<DeepSpeedSourceFacts>(&c.facts);
  const bool zero3 = info != nullptr && info->zero_stage == 3;
  return std::string("optimizer_state_dict.") + DeepSpeedBaseOptimizerKey(zero3) + ".param_groups";
}

Result<std::vector<DeepSpeedParamGroup>> DeepSpeedParamGroups(const Checkpoint& c, const FileTable& files) {
  std::vector<DeepSpeedParamGroup> out;
  const auto* info = std::get_if<DeepSpeedSourceFacts>(&c.facts);
  if (info == nullptr) return out;
  const bool zero3 = info->zero_stage == 3;
  UCPFS_ASSIGN_OR_RETURN(auto optim, OpenCheckpointFile(c, files, info->optimizer_file));
  const pickle::PickleGraph& g = optim.first.graph();
  const char* const base_key = DeepSpeedBaseOptimizerKey(zero3);
  const pickle::NodeId groups =
      g.DictGet(g.DictGet(g.DictGet(g.root(), "optimizer_state_dict"), base_key), "param_groups");
  if (g.kind(groups) != pickle::Kind::kList) {
    return CorruptError(optim.second->Name() + ": optimizer_state_dict." + base_key + ".param_groups is not a list");
  }
  format::PlainValueLimits limits;
  limits.max_depth = 8;
  limits.max_nodes = 1 << 16;
  // ZeRO-3: group i's sub-groups (indices into param_shapes), in order.
  std::vector<std::vector<size_t>> sub_groups;
  for (pickle::NodeId group : g.items(groups)) {
    if (g.kind(group) != pickle::Kind::kDict) {
      return CorruptError(optim.second->Name() + ": a param group is not a dict");
    }
    DeepSpeedParamGroup pg;
    for (const auto& [k, v] : g.dict_items(group)) {
      if (g.kind(k) != pickle::Kind::kString || g.text(k) == "params" || g.text(k) == "param_names") continue;
      auto value = format::DecodeValueAt(optim.first, optim.second, v, limits);
      if (value.ok()) pg.fields.emplace_back(std::string(g.text(k)), std::move(*value));  // plain values only
    }
    if (zero3) {
      const pickle::NodeId params = g.DictGet(group, "params");
      if (g.kind(params) != pickle::Kind::kList) {
        return CorruptError(optim.second->Name() + ": a ZeRO-3 param group's params is not a list");
      }
      std::vector<size_t>& subs = sub_groups.emplace_back();
      for (pickle::NodeId id : g.items(params)) {
        if (g.kind(id) != pickle::Kind::kInt || g.int_value(id) < 0 || g.int_value(id) > (int64_t{1} << 20)) {
          return CorruptError(optim.second->Name() + ": a ZeRO-3 param group's params holds a value that is not a "
                              "sub-group number");
        }
        subs.push_back(static_cast<size_t>(g.int_value(id)));
      }
    }
    out.push_back(std::move(pg));
  }
  for (const std::string& m : info->model_files) {
    UCPFS_ASSIGN_OR_RETURN(auto model, OpenCheckpointFile(c, files, m));
    const pickle::PickleGraph& mg = model.first.graph();
    const pickle::NodeId shapes = mg.DictGet(mg.root(), "param_shapes");
    if (mg.kind(shapes) != pickle::Kind::kList) return CorruptError(model.second->Name() + ": param_shapes is not a list");
    const auto shape_groups = mg.items(shapes);
    // Each group's param_shapes entries: ZeRO-1/2 one per param group; ZeRO-3 one per sub-group,
    // each sub-group in exactly one param group.
    std::vector<std::vector<size_t>> entries_of(out.size());
    if (zero3) {
      std::vector<bool> seen(shape_groups.size());
      for (size_t gi = 0; gi < out.size(); ++gi) {
        for (size_t s : sub_groups[gi]) {
          if (s >= shape_groups.size() || seen[s]) {
            return CorruptError(optim.second->Name() + ": param group " + std::to_string(gi) + " names sub-group " +
                                std::to_string(s) + ", which " + model.second->Name() + "'s param_shapes (" +
                                std::to_string(shape_groups.size()) + " sub-groups) " +
                                (s >= shape_groups.size() ? "lacks" : "gives another group too"));
          }
          seen[s] = true;
          entries_of[gi].push_back(s);
        }
      }
      if (std::find(seen.begin(), seen.end(), false) != seen.end()) {
        return CorruptError(model.second->Name() + ": a param_shapes sub-group is in none of " + optim.second->Name() +
                            "'s param groups");
      }
    } else {
      if (shape_groups.size() != out.size()) {
        return CorruptError(model.second->Name() + ": param_shapes does not list the optimizer's " +
                            std::to_string(out.size()) + " param groups");
      }
      for (size_t gi = 0; gi < out.size(); ++gi) entries_of[gi].push_back(gi);
    }
    for (size_t gi = 0; gi < out.size(); ++gi) {
      std::vector<std::string>& names = out[gi].params;
      for (size_t e : entries_of[gi]) {
        for (const auto& [k, v] : mg.dict_items(shape_groups[e])) {
          if (mg.kind(k) != pickle::Kind::kString) continue;
          std::string name(mg.text(k));
          if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(std::move(name));
        }
      }
    }
  }
  return out;
}

Result<std::optional<UniversalView>> BuildUniversalView(const Checkpoint& c, const std::shared_ptr<const void>& owner,
                                                        const KeyMapping& mapping, const FileTable& files,
                                                        const std::string& source_name) {
  const auto* info = std::get_if<DeepSpeedSourceFacts>(&c.facts);
  if (info == nullptr) return std::optional<UniversalView>();
  const bool zero3 = info->zero_stage == 3;
  const std::string& tag = info->tag;
  UniversalView view;
  view.dir = (tag.empty() ? source_name : tag) + "_universal";
  if (!tag.empty()) view.latest_universal = view.dir;
  const std::string& optim_rel = info->optimizer_file;
  UCPFS_ASSIGN_OR_RETURN(DeepSpeedPatterns uc, ParseDeepSpeedPatterns(info->universal_checkpoint_info, optim_rel));

  // universal_checkpoint_info was read from the first model-states file (mp rank 0).
  const std::vector<std::string>& model_files = info->model_files;
  SubParamShapes sub_shapes(c, files, model_files.empty() ? std::string() : model_files[0]);
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
      root.Set("param", SaveValue::Tensor(DType::kFloat32, item.layout.shape,
                                          std::make_shared<views::LayoutProvider>(KeptLayout(item, owner),
                                                                                  DType::kFloat32, files)));
      UCPFS_ASSIGN_OR_RETURN(UniversalFile f, Virtual(std::move(root), view.dir, dir + "/fp32.pt", "fp32.pt"));
      view.files.push_back(std::move(f));
      continue;
    }
    UniversalKeys keys;
    if (!zero3) {
      UCPFS_ASSIGN_OR_RETURN(keys, KeysFor(uc, p.name, c.items[static_cast<size_t>(fp32)].layout.shape, sub_shapes));
    }
    for (int s = 0; s < 3; ++s) {
      const int32_t i = p.item[static_cast<int>(kKinds[s])];
      if (i < 0 || c.items[static_cast<size_t>(i)].kind != ItemKind::kTensor) continue;
      SaveValue tensor = TensorOf(c.items[static_cast<size_t>(i)], owner, files, kKinds[s] == StateKind::kFp32,
                                  keys.keep_rows, zero3);
      SaveValue root;
      if (zero3) {
        root = std::move(tensor);
      } else {
        root = SaveValue::Dict(keys.keys);
        root.Set("param", std::move(tensor));
      }
      const std::string rel = dir + "/" + kFiles[s];
      UCPFS_ASSIGN_OR_RETURN(UniversalFile f, Virtual(std::move(root), view.dir, rel, kFiles[s]));
      view.files.push_back(std::move(f));
    }
    const int32_t step = p.item[static_cast<int>(StateKind::kStep)];
    if (!zero3 && step >= 0 && c.items[static_cast<size_t>(step)].kind == ItemKind::kTensor) {
      SaveValue root = TensorOf(c.items[static_cast<size_t>(step)], owner, files, false, std::nullopt, false);
      UCPFS_ASSIGN_OR_RETURN(UniversalFile f, Virtual(std::move(root), view.dir, dir + "/step.pt", "step.pt"));
      view.files.push_back(std::move(f));
    }
  }

  UCPFS_ASSIGN_OR_RETURN(SaveValue optim, OptimizerState(c, files, optim_rel, zero3));
  UCPFS_ASSIGN_OR_RETURN(UniversalFile optim_file,
                         Virtual(std::move(optim), view.dir, "zero/optimizer_state.pt", "optimizer_state.pt"));
  view.files.push_back(std::move(optim_file));

  for (const std::string& rel : model_files) {
    if (!SafeRelativePath(rel)) return CorruptError("index: the DeepSpeed facts name model file '" + rel + "'");
    view.files.push_back(
        {.rel_path = rel.substr(rel.rfind('/') + 1), .n_bytes = 0, .build = nullptr, .source_rel = rel});
  }
  return std::optional<UniversalView>(std::move(view));
}

}  // namespace ucpfs::index
