// ScanDeepSpeed: DeepSpeed tag directory -> Checkpoint. See deepspeed_scan.h.
//
// Error rule: the first problem wins, in this order: the tag, the file names, the model states,
// then the optimizer files by dp rank; every message names the file and the key.
#include "index/deepspeed_scan.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/format/torch_file.h"
#include "core/layout/zero.h"
#include "core/layout/layout.h"
#include "core/layout/patterns.h"
#include "index/checkpoint_builder.h"
#include "index/pickle_walk.h"
#include "index/deepspeed_patterns.h"
#include "index/megatron_scan.h"

namespace ucpfs::index {
namespace {

constexpr uint64_t kMaxLatestBytes = 4096;

// The files of one tag directory, by role.
struct TagFiles {
  std::map<int, std::string> model;                       // mp rank -> mp_rank_XX_model_states.pt
  std::map<std::pair<int, int>, std::string> zero3_model;  // (dp, mp) -> zero_pp_rank_..._model_states.pt
  std::map<std::pair<int, int>, std::string> optim;        // (dp, mp) -> [bf16_]zero_pp_rank_..._optim_states.pt
  std::map<std::pair<int, int>, std::string> layers;       // (layer, tp) -> layer_LL-model_TT-model_states.pt
  std::vector<std::string> unsupported;                    // MoE expert files
};

// The tag directory `rel` of the tree ("": its root).
Result<TagFiles> ListTag(const SourceTree& tree, const std::string& rel) {
  const std::string dir = tree.PathOf(rel);  // for messages
  Result<std::vector<TreeEntry>> entries = tree.List(rel);
  if (!entries.ok()) return NotFoundError("DeepSpeed tag directory " + dir + " cannot be listed");
  static const std::regex kModel(R"(mp_rank_(\d+)_model_states\.pt)");
  static const std::regex kZero3Model(R"(zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  static const std::regex kOptim(R"((?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  static const std::regex kLayer(R"(layer_(\d+)-model_(\d+)-model_states\.pt)");
  static const std::regex kExpert(R"((layer_\d+_expert_\d+_mp_rank_\d+_model|expp_rank_\d+_mp_rank_\d+_optim)_states\.pt)");
  TagFiles out;
  auto num = [](const std::ssub_match& m) -> int {
    const std::string s = m.str();
    return s.size() > 6 ? -1 : std::stoi(s);
  };
  for (const TreeEntry& e : *entries) {  // by name
    const std::string& name = e.name;
    if (name.size() > 255 || e.kind != EntryKind::kFile) continue;
    std::smatch m;
    if (std::regex_match(name, m, kZero3Model)) {
      if (num(m[1]) < 0 || num(m[2]) < 0) return CorruptError(dir + "/" + name + ": rank number too large");
      out.zero3_model[{num(m[1]), num(m[2])}] = name;
    } else if (std::regex_match(name, m, kOptim)) {
      if (num(m[1]) < 0 || num(m[2]) < 0) return CorruptError(dir + "/" + name + ": rank number too large");
      if (!out.optim.emplace(std::make_pair(num(m[1]), num(m[2])), name).second) {
        return CorruptError(dir + "/" + name + ": a second optimizer file for dp rank " + m[1].str() +
                            " (with and without the bf16_ prefix?)");
      }
    } else if (std::regex_match(name, m, kModel)) {
      if (num(m[1]) < 0) return CorruptError(dir + "/" + name + ": rank number too large");
      out.model[num(m[1])] = name;
    } else if (std::regex_match(name, m, kLayer)) {
      if (num(m[1]) < 0 || num(m[2]) < 0) return CorruptError(dir + "/" + name + ": layer or rank number too large");
      out.layers[{num(m[1]), num(m[2])}] = name;
    } else if (std::regex_match(name, m, kExpert)) {
      out.unsupported.push_back(name);
    }
  }
  return out;
}

// ---- pickle helpers ----

std::optional<int64_t> IntOf(const pickle::PickleGraph& g, pickle::NodeId n) {
  if (g.kind(n) == pickle::Kind::kInt) return g.int_value(n);
  if (g.kind(n) == pickle::Kind::kBool) return g.bool_value(n) ? 1 : 0;
  return std::nullopt;
}

}  // namespace

std::optional<int64_t> DeepSpeedZeroStage(const pickle::PickleGraph& g, pickle::NodeId n) {
  // max_stage is an alias of weights (Python pickles the canonical name, but an alias resolves too).
  static constexpr pickle::IntEnumMember kMembers[] = {
      {"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2}, {"weights", 3}, {"max_stage", 3}};
  static constexpr pickle::IntEnumType kZeroStageEnum = {kZeroStageEnumModule, kZeroStageEnumClass, kMembers};
  if (g.kind(n) == pickle::Kind::kInt) return g.int_value(n);
  return pickle::IntEnumValue(g, n, kZeroStageEnum);
}

namespace {

// torch.Size((a, b)) (REDUCE of torch.Size with a tuple), or a plain tuple/list of ints.
std::optional<std::vector<int64_t>> ShapeOf(const pickle::PickleGraph& g, pickle::NodeId n) {
  pickle::NodeId seq = n;
  if (g.kind(n) == pickle::Kind::kObject) {
    const auto args = Items(g, g.object(n).args);
    if (args.size() != 1) return std::nullopt;
    seq = args[0];
  }
  if (g.kind(seq) != pickle::Kind::kTuple && g.kind(seq) != pickle::Kind::kList) return std::nullopt;
  std::vector<int64_t> shape;
  for (pickle::NodeId d : g.items(seq)) {
    if (g.kind(d) != pickle::Kind::kInt || g.int_value(d) < 0) return std::nullopt;
    shape.push_back(g.int_value(d));
  }
  return shape;
}

std::optional<uint64_t> NumelOf(const std::vector<int64_t>& shape) {
  std::optional<uint64_t> n = 1;
  for (int64_t d : shape) n = n ? CheckedMul(*n, static_cast<uint64_t>(d)) : std::nullopt;
  return n;
}

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
};

// param_shapes: a list (one per param group; ZeRO-3: per sub-group) of name -> torch.Size.
Result<std::vector<std::vector<Param>>> ParamShapes(const format::TorchFile& tf, const std::string& where) {
  const pickle::PickleGraph& g = tf.graph();
  const pickle::NodeId shapes = Get(g, g.root(), "param_shapes");
  if (g.kind(shapes) == pickle::Kind::kNone) {
    return UnsupportedError(where + ": param_shapes is None (a checkpoint without ZeRO partitions)");
  }
  if (g.kind(shapes) != pickle::Kind::kList) return CorruptError(where + ": param_shapes is not a list");
  std::vector<std::vector<Param>> out;
  std::set<std::string> seen;
  for (pickle::NodeId group : g.items(shapes)) {
    std::vector<Param> params;
    for (const auto& [k, v] : Pairs(g, group)) {
      if (g.kind(k) != pickle::Kind::kString) return CorruptError(where + ": param_shapes has a non-string key");
      Param p;
      p.name = std::string(g.text(k));
      std::optional<std::vector<int64_t>> shape = ShapeOf(g, v);
      std::optional<uint64_t> numel = shape ? NumelOf(*shape) : std::nullopt;
      if (!numel) return CorruptError(where + ": param_shapes['" + p.name + "'] is not a shape");
      if (!seen.insert(p.name).second) {
        return CorruptError(where + ": param_shapes lists '" + p.name + "' twice");
      }
      p.shape = std::move(*shape);
      p.numel = *numel;
      params.push_back(std::move(p));
    }
    out.push_back(std::move(params));
  }
  return out;
}

// A plain pickled value (None, bool, int, float, str, list, tuple, dict with str keys) as JSON;
// anything else, or past the bounds, becomes null. For universal_checkpoint_info.
nlohmann::json PlainJson(const pickle::PickleGraph& g, pickle::NodeId n, int depth, uint64_t* budget) {
  if (depth > 16 || *budget == 0) return nullptr;
  --*budget;
  switch (g.kind(n)) {
    case pickle::Kind::kBool: return g.bool_value(n);
    case pickle::Kind::kInt: return g.int_value(n);
    case pickle::Kind::kFloat: return g.float_value(n);
    case pickle::Kind::kString: {
      // JSON text must be UTF-8: keep only strings that are.
      std::string s(g.text(n));
      try {
        (void)nlohmann::json(s).dump();
      } catch (const nlohmann::json::exception&) {
        return nullptr;
      }
      return s;
    }
    case pickle::Kind::kList:
    case pickle::Kind::kTuple: {
      nlohmann::json a = nlohmann::json::array();
      for (pickle::NodeId item : g.items(n)) a.push_back(PlainJson(g, item, depth + 1, budget));
      return a;
    }
    case pickle::Kind::kDict: {
      nlohmann::json o = nlohmann::json::object();
      for (const auto& [k, v] : g.dict_items(n)) {
        if (g.kind(k) != pickle::Kind::kString) continue;
        nlohmann::json key = PlainJson(g, k, depth + 1, budget);
        if (key.is_string()) o[key.get<std::string>()] = PlainJson(g, v, depth + 1, budget);
      }
      return o;
    }
    default: return nullptr;
  }
}

class DeepSpeedScanner {
 public:
  explicit DeepSpeedScanner(const SourceTree& tree) : builder_(tree) {}

  Result<Checkpoint> Run(const ScanProgress& progress) {
    UCPFS_RETURN_IF_ERROR(FindTag());
    UCPFS_ASSIGN_OR_RETURN(files_, ListTag(builder_.tree(), tag_dir_));
    UCPFS_RETURN_IF_ERROR(CheckNames());
    zero3_ = !files_.zero3_model.empty();
    Checkpoint& cp = builder_.checkpoint();
    cp.format = "deepspeed";

    // Model states of mp rank 0: degrees and universal_checkpoint_info.
    const std::string model0_name = zero3_ ? files_.zero3_model.begin()->second : files_.model.begin()->second;
    UCPFS_ASSIGN_OR_RETURN(const uint32_t model0_id, builder_.AddFile(Rel(model0_name)));
    UCPFS_ASSIGN_OR_RETURN(format::TorchFile model0, builder_.OpenTorchFile(model0_id));
    const std::string model0_where = builder_.source(model0_id)->Name();
    UCPFS_RETURN_IF_ERROR(Degrees(model0, model0_where));
    {
      const pickle::PickleGraph& g = model0.graph();
      uint64_t budget = 100000;
      const pickle::NodeId uc = Get(g, g.root(), "universal_checkpoint_info");
      uc_json_ = g.kind(uc) == pickle::Kind::kDict ? PlainJson(g, uc, 0, &budget) : nlohmann::json(nullptr);
      UCPFS_ASSIGN_OR_RETURN(patterns_, ParseDeepSpeedPatterns(uc_json_, model0_where));
      // Megatron-DeepSpeed's client state keeps its args, as ds_to_universal reads them: the
      // heads and query groups a tp split of the fused query_key_value needs, the vocabulary's
      // pad multiple.
      megatron_args_ = DecodeMegatronArgs(g, Get(g, g.root(), "args"));
      if (tp_ > 1 && !patterns_.present) {
        return UnsupportedError(model0_where + ": a tensor-parallel (tp " + std::to_string(tp_) +
                                ") checkpoint without universal_checkpoint_info: how each parameter is split "
                                "is not recorded");
      }
    }

    const int n_mp = tp_ * pp_;
    optim_.resize(static_cast<size_t>(n_mp));
    optim_ids_.resize(optim_.size());
    for (const auto& [key, name] : files_.optim) {
      UCPFS_ASSIGN_OR_RETURN(uint32_t id, builder_.AddFile(Rel(name)));
      UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, builder_.OpenTorchFile(id));
      optim_ids_[static_cast<size_t>(key.second)].push_back(id);
      optim_[static_cast<size_t>(key.second)].push_back(std::move(tf));
    }
    dp_ = static_cast<int>(optim_[0].size());
    UCPFS_ASSIGN_OR_RETURN(stage_, ZeroStage());
    cp.flavor = (stage_ == 0 ? std::string("bf16_optimizer") : "zero" + std::to_string(stage_)) +
                (tp_ > 1 ? " tp" + std::to_string(tp_) : "") + (pp_ > 1 ? " pp" + std::to_string(pp_) : "") +
                " dp" + std::to_string(dp_) + (tag_.empty() ? "" : " tag " + tag_);

    // param_shapes of every mp rank, and the names any of them knows (for layer files).
    groups_.resize(static_cast<size_t>(n_mp));
    uint64_t total = 0, done = 0;
    for (int m = 0; m < n_mp; ++m) {
      if (m == 0 || zero3_) {
        UCPFS_ASSIGN_OR_RETURN(groups_[0], ParamShapes(model0, model0_where));
      } else {
        UCPFS_ASSIGN_OR_RETURN(const uint32_t id, builder_.AddFile(Rel(files_.model.at(m))));
        UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, builder_.OpenTorchFile(id));
        UCPFS_ASSIGN_OR_RETURN(groups_[static_cast<size_t>(m)], ParamShapes(tf, builder_.source(id)->Name()));
      }
      for (const auto& g : groups_[static_cast<size_t>(m)]) {
        total += g.size();
        for (const Param& p : g) known_names_.insert(p.name);
      }
    }
    UCPFS_RETURN_IF_ERROR(LayerWeights());

    for (int m = 0; m < n_mp; ++m) {
      const int t = m % tp_;
      // Module tensors of this rank: its mp_rank file's `module` (ZeRO-1/2, BF16_Optimizer), or
      // the layer files of its tp rank (pipeline; those of other stages are not in its groups).
      std::map<std::string, Item> weight_of;
      std::vector<std::string> module_order;
      if (!zero3_ && files_.layers.empty()) {
        UCPFS_ASSIGN_OR_RETURN(const uint32_t id, builder_.AddFile(Rel(files_.model.at(m))));
        UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, builder_.OpenTorchFile(id));
        UCPFS_ASSIGN_OR_RETURN(std::vector<Item> weights, ModuleItems(tf, id, t));
        for (Item& w : weights) {
          module_order.push_back(w.key);
          weight_of.emplace(module_order.back(), std::move(w));
        }
      }
      const auto& groups = groups_[static_cast<size_t>(m)];
      for (size_t gi = 0; gi < groups.size(); ++gi) {
        std::vector<std::vector<Item>> items;
        if (zero3_) {
          UCPFS_ASSIGN_OR_RETURN(items, Zero3Group(gi));
        } else {
          UCPFS_ASSIGN_OR_RETURN(items, FlatGroup(m, gi));
        }
        for (size_t pi = 0; pi < items.size(); ++pi) {
          const std::string& name = groups[gi][pi].name;
          if (auto w = weight_of.find(name); w != weight_of.end()) {
            UCPFS_RETURN_IF_ERROR(Merge(std::move(w->second), t));
            weight_of.erase(w);
          } else if (auto lw = layer_weights_[static_cast<size_t>(t)].find(name);
                     lw != layer_weights_[static_cast<size_t>(t)].end()) {
            UCPFS_RETURN_IF_ERROR(Merge(std::move(lw->second), t));
            layer_weights_[static_cast<size_t>(t)].erase(lw);
          }
          for (Item& item : items[pi]) UCPFS_RETURN_IF_ERROR(Merge(std::move(item), t));
          if (progress) progress(++done, total);
        }
      }
      // Module tensors without optimizer state (buffers, frozen parameters), in module order.
      for (const std::string& name : module_order) {
        if (auto it = weight_of.find(name); it != weight_of.end()) UCPFS_RETURN_IF_ERROR(Merge(std::move(it->second), t));
      }
    }
    if (zero3_) {
      UCPFS_ASSIGN_OR_RETURN(std::vector<Item> module_only, Zero3ModuleOnly(model0, model0_id));
      for (Item& item : module_only) UCPFS_RETURN_IF_ERROR(Merge(std::move(item), 0));
    }
    for (int t = 0; t < tp_; ++t) {
      for (const std::string& name : layer_order_) {
        auto& left = layer_weights_[static_cast<size_t>(t)];
        if (auto it = left.find(name); it != left.end()) UCPFS_RETURN_IF_ERROR(Merge(std::move(it->second), t));
      }
    }
    const std::string where = builder_.dir() + (tag_dir_.empty() ? "" : "/" + tag_dir_);
    std::map<std::string, const Item*> averaged;
    for (Item& item : merged_.items()) {
      if (item.layout.shape.empty() || !Averaged(item.key)) continue;
      UCPFS_RETURN_IF_ERROR(FoldTpMean(item, tp_, where));
      averaged[item.key] = &item;
    }
    // An averaged parameter's module weight held in a narrower dtype than its fp32 master (bf16,
    // fp16) is what DeepSpeed's universal loader gives the module: the masters' mean rounded to
    // the module's dtype (its lp_param.copy_(hp_param)), not the mean of the tp ranks' rounded
    // copies, which can differ in the last bit. So it reads the masters' mean, converted.
    for (Item& item : merged_.items()) {
      if (!item.model_tensor || item.dtype == DType::kFloat32 || averaged.count(item.key) == 0) continue;
      const auto master = averaged.find("optimizer.state." + item.key + ".fp32_param");
      if (master == averaged.end() || master->second->layout.shape != item.layout.shape) continue;
      item.layout = master->second->layout;
    }
    for (Item& item : merged_.items()) {
      if (!item.layout.shape.empty()) UCPFS_RETURN_IF_ERROR(builder_.FinishTensor(item, where));
      builder_.AddItem(std::move(item));
    }
    UCPFS_ASSIGN_OR_RETURN(cp.facts, Facts());
    return builder_.Take();
  }

 private:
  // Adds tp rank t's part of an item: a new key, or more fragments of one seen before (another
  // tp rank's pieces). A key another rank already gave fully (tied weights on a later pipeline
  // stage, a step) is skipped, as ds_to_universal skips pipeline-replicated parameters there.
  Status Merge(Item item, int t) { return merged_.Add(std::move(item), t, builder_.dir()); }

  // Tensor- and pipeline-parallel degrees: checkpoint_parallel_dimensions when the engine wrote
  // it, else (as ds_to_universal) the tp ranks of the layer files, else one stage.
  Status Degrees(const format::TorchFile& model0, const std::string& where) {
    const int n_mp = zero3_ ? 1 : static_cast<int>(files_.model.size());
    const pickle::PickleGraph& g = model0.graph();
    const pickle::NodeId dims = Get(g, g.root(), "checkpoint_parallel_dimensions");
    if (g.kind(dims) == pickle::Kind::kDict) {
      const std::optional<int64_t> pp = IntOf(g, Get(g, dims, "pp_degree")), tp = IntOf(g, Get(g, dims, "tp_degree"));
      if (!pp || !tp || *pp < 1 || *tp < 1 || *pp > kMaxRank || *tp > kMaxRank) {
        return CorruptError(where + ": checkpoint_parallel_dimensions holds no positive pp_degree and tp_degree");
      }
      pp_ = static_cast<int>(*pp);
      tp_ = static_cast<int>(*tp);
    } else if (!files_.layers.empty()) {
      std::set<int> tps;
      for (const auto& [key, name] : files_.layers) tps.insert(key.second);
      tp_ = static_cast<int>(tps.size());
      pp_ = n_mp / tp_;
    } else {
      tp_ = n_mp;
      pp_ = 1;
    }
    if (tp_ * pp_ != n_mp) {
      return CorruptError(where + ": " + std::to_string(n_mp) + " model-states files, but tp " + std::to_string(tp_) +
                          " x pp " + std::to_string(pp_) + " ranks");
    }
    for (const auto& [key, name] : files_.layers) {
      if (key.second >= tp_) {
        return CorruptError(where + ": layer file " + name + " names tp rank " + std::to_string(key.second) +
                            " of " + std::to_string(tp_));
      }
    }
    if (zero3_ && (tp_ > 1 || pp_ > 1)) {
      return UnsupportedError(where + ": tensor- or pipeline-parallel ZeRO-3 checkpoints are not supported yet");
    }
    return Status::Ok();
  }

  // Whether item `key` (a parameter, or its optimizer.state.<name>.fp32_param / exp_avg /
  // exp_avg_sq) is a parameter_to_average_patterns one at tp > 1: served as the tp ranks' mean,
  // as ds_to_universal's merge_tp_slices serves it.
  bool Averaged(const std::string& key) const {
    if (tp_ == 1) return false;
    std::string name = key;
    constexpr std::string_view kState = "optimizer.state.";
    if (name.rfind(kState, 0) == 0) {
      for (std::string_view suffix : {".fp32_param", ".exp_avg_sq", ".exp_avg"}) {
        if (name.size() > kState.size() + suffix.size() && name.ends_with(suffix)) {
          name = name.substr(kState.size(), name.size() - kState.size() - suffix.size());
          break;
        }
      }
    }
    const Result<DeepSpeedParamRule> rule = ClassifyDeepSpeedParam(patterns_, name);
    return rule.ok() && rule->merge == DeepSpeedMerge::kAverage;
  }

  // Where tp rank t's slice of `name` (of local shape `local`) lies, by universal_checkpoint_info
  // as ds_to_universal merges it (deepspeed_patterns.h), through layout::TargetSlice.
  Result<Placement> Place(const std::string& name, const std::vector<int64_t>& local, int t) const {
    Placement pl;
    pl.global_shape = local;
    if (tp_ == 1) return pl;
    UCPFS_ASSIGN_OR_RETURN(const DeepSpeedParamRule rule, ClassifyDeepSpeedParam(patterns_, name));
    layout::ParamPattern pattern;
    pattern.tp = layout::TpKind::kColumn;
    pattern.tp_dim = 0;
    auto refuse = [&](const std::string& why) {
      return UnsupportedError("parameter '" + name + "' of shape " + JoinInts(local) + " at tp " + std::to_string(tp_) +
                              ": " + why);
    };
    switch (rule.merge) {
      case DeepSpeedMerge::kReplicated:
        pl.skip = t != 0;
        return pl;
      case DeepSpeedMerge::kAverage:
        // Every tp rank holds a whole copy; the value is their mean (FoldTpMean, once all are in).
        return pl;
      case DeepSpeedMerge::kTwoSub:
        if (local.empty() || local[0] % 2 != 0) return refuse("two sub-parameters need an even first dim");
        pattern.sub_sizes = {local[0] * tp_ / 2, local[0] * tp_ / 2};
        break;
      case DeepSpeedMerge::kSubParams: {
        // Rank t holds [sub_0 width t; sub_1 width t; ...] along dim 0, widths possibly uneven
        // (version 0.4), so the pieces come from the split itself.
        if (local.empty()) return refuse("a 0-d tensor has no sub-parameters");
        UCPFS_ASSIGN_OR_RETURN(const DeepSpeedSubSplit split,
                               DeepSpeedSubParamSplit(patterns_, rule, name, tp_,
                                                      patterns_.version >= 0.4 ? -1 : local[0] * tp_));
        int64_t offset = 0, local_rows = 0;
        for (size_t j = 0; j < split.sizes.size(); ++j) {
          int64_t before = 0;
          for (int r = 0; r < t; ++r) before += split.widths[j][static_cast<size_t>(r)];
          const int64_t width = split.widths[j][static_cast<size_t>(t)];
          if (width > 0) {
            slice::Box box;
            box.offsets.assign(local.size(), 0);
            box.offsets[0] = offset + before;
            box.sizes = local;
            box.sizes[0] = width;
            pl.pieces.push_back(std::move(box));
          }
          offset += split.sizes[j];
          local_rows += width;
        }
        if (local_rows != local[0]) {
          return refuse("tp rank " + std::to_string(t) + "'s sub-parameter widths add up to " +
                        std::to_string(local_rows) + " rows");
        }
        pl.global_shape[0] = offset;
        return pl;
      }
      case DeepSpeedMerge::kCat:
        if (static_cast<size_t>(rule.cat_dim) >= local.size()) return refuse("no dim " + std::to_string(rule.cat_dim) + " to split");
        if (rule.cat_dim == 1) pattern.tp = layout::TpKind::kRow;
        pattern.tp_dim = rule.cat_dim;
        break;
    }
    const size_t d = static_cast<size_t>(pattern.tp_dim);
    if (local.size() <= d) return refuse("no dim to split");
    const std::optional<uint64_t> global = CheckedMul(static_cast<uint64_t>(local[d]), static_cast<uint64_t>(tp_));
    if (!global || *global > (uint64_t{1} << 48)) return refuse("the global size overflows");
    pl.global_shape[d] = static_cast<int64_t>(*global);
    layout::Layout lay;
    lay.tp = tp_;
    layout::RankCoords coords;
    coords.tp = t;
    UCPFS_ASSIGN_OR_RETURN(const layout::LocalView view,
                           layout::TargetSlice(layout::Preset::kAuto, name, pattern, pl.global_shape, lay, {}, coords));
    if (view.local_shape != local || (view.pieces.size() > 1 && view.cat_dim != 0)) {
      return refuse("its slice does not follow the pattern (local shape " + JoinInts(view.local_shape) + ")");
    }
    pl.pieces = view.pieces;
    return pl;
  }

  // Pipeline layer files (layer_LL-model_TT-model_states.pt, a layer's bare state_dict): their
  // tensors by global name, placed for tp rank TT. A layer's key K is the parameter "LL.K", or
  // the tied module's "tied_modules.<key>.K" when that is the one parameter with that suffix.
  Status LayerWeights() {
    layer_weights_.resize(static_cast<size_t>(tp_));
    std::set<std::string> ordered;
    // Every suffix K of a known "tied_modules.<k>.K" name -> those names (one pass over the names,
    // so a hostile file with many tensors costs a lookup each).
    std::map<std::string, std::set<std::string>> tied;
    if (!files_.layers.empty()) {
      constexpr std::string_view kTied = "tied_modules.";
      for (const std::string& name : known_names_) {
        if (name.rfind(kTied, 0) != 0) continue;
        const size_t dot = name.find('.', kTied.size());
        if (dot != std::string::npos) tied[name.substr(dot + 1)].insert(name);
      }
    }
    for (const auto& [key, name] : files_.layers) {
      UCPFS_ASSIGN_OR_RETURN(const uint32_t id, builder_.AddFile(Rel(name)));
      UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, builder_.OpenTorchFile(id));
      for (const format::TensorRecord& rec : tf.tensors()) {
        std::string global = std::to_string(key.first) + "." + rec.key;
        if (known_names_.count(global) == 0) {
          if (auto t = tied.find(rec.key); t != tied.end() && t->second.size() == 1) global = *t->second.begin();
        }
        UCPFS_ASSIGN_OR_RETURN(std::optional<Item> item, PlacedTensor(global, rec, id, key.second));
        if (!item) continue;
        item->model_tensor = true;  // a layer's state_dict
        if (ordered.insert(global).second) layer_order_.push_back(global);
        layer_weights_[static_cast<size_t>(key.second)].try_emplace(global, std::move(*item));
      }
    }
    return Status::Ok();
  }

  // A stored module tensor of tp rank t as (part of) the global tensor `name`; nullopt when it
  // is a replica the merge does not read (kept in Checkpoint::replicas for `ucpfs verify`).
  Result<std::optional<Item>> PlacedTensor(const std::string& name, const format::TensorRecord& t, uint32_t file_id,
                                           int tp_rank) {
    UCPFS_ASSIGN_OR_RETURN(Placement pl, Place(name, t.shape, tp_rank));
    const bool replica = pl.skip;
    if (replica && !pl.skip_holds_copy) return std::optional<Item>();  // partial values: nothing to compare
    pl.skip = false;
    UCPFS_ASSIGN_OR_RETURN(Item item, PlacedItem(pl, name, t, file_id, builder_.source(file_id)->Name()));
    if (replica) {
      builder_.AddReplica(std::move(item));
      return std::optional<Item>();
    }
    return std::optional<Item>(std::move(item));
  }

  // What the universal view needs beyond items (DeepSpeedSourceFacts).
  Result<DeepSpeedSourceFacts> Facts() const {
    DeepSpeedSourceFacts info;
    info.tag = tag_;
    info.zero_stage = stage_;
    info.dp = dp_;
    info.tp = tp_;
    info.pp = pp_;
    info.universal_checkpoint_info = uc_json_;
    info.megatron_args = megatron_args_;
    // The files ds_to_universal copies next to zero/: mp_rank_* (ZeRO-1/2, BF16_Optimizer) or
    // every *model_states.pt (ZeRO-3).
    if (zero3_) {
      for (const auto& [key, name] : files_.zero3_model) info.model_files.push_back(Rel(name));
    } else {
      for (const auto& [mp, name] : files_.model) info.model_files.push_back(Rel(name));
    }
    info.optimizer_file = Rel(files_.optim.begin()->second);
    // A param group's step when the optimizer keeps it as a Python number (a tensor step is
    // the item optimizer.state.<name>.step): per group, the number or nullopt.
    const pickle::PickleGraph& og = optim_[0][0].graph();
    const pickle::NodeId osd = Get(og, og.root(), "optimizer_state_dict");
    const pickle::NodeId state = Get(og, Get(og, osd, zero3_ ? "optimizer_state_dict" : "base_optimizer_state"), "state");
    for (size_t gi = 0; gi < groups_[0].size(); ++gi) {
      pickle::NodeId group = pickle::kNoNode;
      for (const auto& [k, v] : Pairs(og, state)) {
        if (IntOf(og, k) == static_cast<int64_t>(gi)) group = v;
      }
      const pickle::NodeId step = Get(og, group, "step");
      const pickle::Kind kind = og.kind(step);
      info.number_steps.push_back(kind == pickle::Kind::kInt     ? std::optional<double>(og.int_value(step))
                                  : kind == pickle::Kind::kFloat ? std::optional<double>(og.float_value(step))
                                                                 : std::nullopt);
    }
    if (EncodeSourceFacts(info).size() > kMaxSourceFactsBytes) {
      return CorruptError(Where(0, 0) + ": universal_checkpoint_info is too large");
    }
    return info;
  }

  std::string Rel(const std::string& name) const { return tag_dir_.empty() ? name : tag_dir_ + "/" + name; }

  Status FindTag() {
    if (!builder_.tree().IsFile("latest")) return Status::Ok();  // the directory is the tag
    UCPFS_ASSIGN_OR_RETURN(uint32_t id, builder_.AddFile("latest"));
    const ByteSource& src = *builder_.source(id);
    if (src.Size() > kMaxLatestBytes) return CorruptError(src.Name() + ": " + std::to_string(src.Size()) + " bytes, not a tag name");
    std::string text(src.Size(), '\0');
    UCPFS_RETURN_IF_ERROR(src.ReadAt(0, std::as_writable_bytes(std::span(text.data(), text.size()))));
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.erase(0, 1);
    if (text.empty() || text == "." || text == ".." || text.find('/') != std::string::npos ||
        text.find('\0') != std::string::npos) {
      return CorruptError(src.Name() + ": '" + text + "' is not a tag directory name");
    }
    if (!builder_.tree().IsDirectory(text)) {
      return CorruptError(src.Name() + ": names tag '" + text + "', which is not a directory of " + builder_.dir());
    }
    tag_ = text;
    tag_dir_ = text;
    return Status::Ok();
  }

  Status CheckNames() const {
    const std::string where = builder_.dir() + (tag_dir_.empty() ? "" : "/" + tag_dir_);
    if (!files_.unsupported.empty()) {
      return UnsupportedError(where + "/" + files_.unsupported.front() + ": MoE expert files are not supported yet");
    }
    if ((files_.model.empty() && files_.zero3_model.empty()) || files_.optim.empty()) {
      return NotFoundError(where + " holds no DeepSpeed model and optimizer states "
                           "(mp_rank_XX_model_states.pt, zero_pp_rank_D_mp_rank_XX_optim_states.pt)");
    }
    if (!files_.model.empty() && !files_.zero3_model.empty()) {
      return CorruptError(where + ": both mp_rank_00_model_states.pt and ZeRO-3 zero_pp_rank_*_model_states.pt");
    }
    // mp ranks 0..M-1, each with dp ranks 0..D-1 (the same D).
    std::set<int> mps;
    for (const auto& [mp, name] : files_.model) mps.insert(mp);
    for (const auto& [key, name] : files_.zero3_model) mps.insert(key.second);
    int expect_mp = 0;
    for (int mp : mps) {
      if (mp != expect_mp) {
        return CorruptError(where + ": the model states of mp rank " + std::to_string(expect_mp) +
                            " are missing (mp_rank_" + (expect_mp < 10 ? "0" : "") + std::to_string(expect_mp) + ")");
      }
      ++expect_mp;
    }
    if (!files_.zero3_model.empty() && mps.size() > 1) {
      return UnsupportedError(where + ": tensor-parallel ZeRO-3 checkpoints (mp ranks " + std::to_string(mps.size()) +
                              ") are not supported yet");
    }
    std::map<int, int> dp_of_mp;
    for (const auto& [key, name] : files_.optim) {
      if (mps.count(key.second) == 0) {
        return CorruptError(where + "/" + name + ": an optimizer partition of mp rank " + std::to_string(key.second) +
                            ", which has no model states");
      }
    }
    for (int mp : mps) {
      int expect = 0;
      for (auto it = files_.optim.begin(); it != files_.optim.end(); ++it) {
        if (it->first.second != mp) continue;
        if (it->first.first != expect) {
          return CorruptError(where + ": optimizer partition of dp rank " + std::to_string(expect) + " of mp rank " +
                              std::to_string(mp) + " is missing (found " + it->second + ")");
        }
        ++expect;
      }
      dp_of_mp[mp] = expect;
    }
    for (const auto& [mp, n] : dp_of_mp) {
      if (n != dp_of_mp.begin()->second) {
        return CorruptError(where + ": mp rank " + std::to_string(mp) + " has " + std::to_string(n) +
                            " optimizer partitions, mp rank 0 " + std::to_string(dp_of_mp.begin()->second));
      }
    }
    if (!files_.zero3_model.empty() && files_.zero3_model.size() != files_.optim.size()) {
      return CorruptError(where + ": " + std::to_string(files_.zero3_model.size()) + " ZeRO-3 model files but " +
                          std::to_string(files_.optim.size()) + " optimizer files");
    }
    if (!files_.layers.empty() && !files_.zero3_model.empty()) {
      return UnsupportedError(where + ": pipeline layer files with ZeRO-3 are not supported");
    }
    return Status::Ok();
  }

  // 1 or 2 (zero_stage), 3 (ZeRO-3), or 0 for BF16_Optimizer (no zero_stage key).
  Result<int> ZeroStage() const {
    std::optional<int> stage;
    for (size_t m = 0; m < optim_.size(); ++m) {
      for (size_t d = 0; d < optim_[m].size(); ++d) {
        const pickle::PickleGraph& g = optim_[m][d].graph();
        const pickle::NodeId osd = Get(g, g.root(), "optimizer_state_dict");
        if (Pairs(g, osd).empty()) return CorruptError(Where(m, d) + ": no optimizer_state_dict");
        const pickle::NodeId z = Get(g, osd, "zero_stage");
        int s = 0;
        if (z != pickle::kNoNode) {
          std::optional<int64_t> v = DeepSpeedZeroStage(g, z);
          if (!v || *v < 1 || *v > 3) return CorruptError(Where(m, d) + ": optimizer_state_dict.zero_stage is not 1, 2 or 3");
          s = static_cast<int>(*v);
        }
        if (stage && *stage != s) return CorruptError(Where(m, d) + ": zero_stage differs from dp rank 0's");
        stage = s;
      }
    }
    if ((*stage == 3) != zero3_) {
      return CorruptError(Where(0, 0) + ": zero_stage " + std::to_string(*stage) + " does not match the model files");
    }
    return *stage;
  }

  std::string Where(size_t mp_rank, size_t dp_rank) const {
    return builder_.source(optim_ids_[mp_rank][dp_rank])->Name();
  }

  Result<std::vector<Item>> ModuleItems(const format::TorchFile& model, uint32_t model_id, int tp_rank) {
    std::vector<Item> out;
    constexpr std::string_view kPrefix = "module.";
    for (const format::TensorRecord& t : model.tensors()) {
      if (t.key.rfind(kPrefix, 0) != 0) continue;
      UCPFS_ASSIGN_OR_RETURN(std::optional<Item> item, PlacedTensor(t.key.substr(kPrefix.size()), t, model_id, tp_rank));
      if (!item) continue;
      item->model_tensor = true;  // module.state_dict(): parameters and persistent buffers by name
      out.push_back(std::move(*item));
    }
    return out;
  }

  // A 1-D contiguous fp32 tensor at `key` of (mp, dp) rank with min..max elements.
  Result<const format::TensorRecord*> FlatTensor(size_t m, size_t d, const std::string& key, uint64_t min_elems,
                                                 uint64_t max_elems) const {
    for (const format::TensorRecord& t : optim_[m][d].tensors()) {
      if (t.key != key) continue;
      if (t.shape.size() != 1 || !t.contiguous) {
        return CorruptError(Where(m, d) + ": " + key + " is not a 1-D contiguous tensor (shape " + JoinInts(t.shape) + ")");
      }
      if (t.n_elems < min_elems || t.n_elems > max_elems) {
        return CorruptError(Where(m, d) + ": " + key + " has " + std::to_string(t.n_elems) +
                            " elements; the partition needs " +
                            (min_elems == max_elems ? std::to_string(min_elems)
                                                    : std::to_string(min_elems) + " to " + std::to_string(max_elems)));
      }
      return &t;
    }
    return CorruptError(Where(m, d) + ": no tensor " + key);
  }

  // The group's step on dp rank 0 of mp rank m, if the optimizer keeps one as a tensor.
  const format::TensorRecord* StepOf(size_t m, const std::string& state_key) const {
    for (const format::TensorRecord& t : optim_[m][0].tensors()) {
      if (t.key == state_key + ".step" && t.n_elems == 1) return &t;
    }
    return nullptr;
  }

  Item StepItem(const Param& p, size_t m, const format::TensorRecord& step) const {
    Item item;
    item.key = "optimizer.state." + p.name + ".step";
    item.kind = ItemKind::kTensor;
    item.dtype = step.dtype;
    slice::Fragment f;
    f.flat_lo = 0;
    f.flat_hi = 1;
    f.file_id = optim_ids_[m][0];
    f.byte_offset = step.data_offset;
    f.dtype = step.dtype;
    item.layout.fragments.push_back(std::move(f));
    return item;
  }

  // Where one param group's (ZeRO-3: sub-group's) states lie, per dp rank.
  struct Partitions {
    std::vector<const format::TensorRecord*> fp32, exp_avg, exp_avg_sq;
    const format::TensorRecord* step = nullptr;  // on dp rank 0, when kept as a tensor
  };

  // A parameter's fp32 master, Adam moments and step on mp rank m, from its fragments
  // (partition_elem_offset: the element inside rank dp_rank's tensor), placed in the global
  // tensor.
  Result<std::vector<Item>> ItemsOfParam(const Param& p, size_t m, const std::vector<layout::ZeroFragment>& frags,
                                         const Partitions& parts) const {
    std::vector<Item> items;
    UCPFS_ASSIGN_OR_RETURN(const Placement pl, Place(p.name, p.shape, static_cast<int>(m) % tp_));
    if (pl.skip) return items;
    if (p.numel > 0) {
      const std::pair<const char*, const std::vector<const format::TensorRecord*>*> states[] = {
          {".fp32_param", &parts.fp32}, {".exp_avg", &parts.exp_avg}, {".exp_avg_sq", &parts.exp_avg_sq}};
      for (const auto& [suffix, recs] : states) {
        Item item;
        item.key = "optimizer.state." + p.name + suffix;
        item.kind = ItemKind::kTensor;
        item.dtype = (*recs)[0]->dtype;
        item.layout.shape = pl.global_shape;
        for (const layout::ZeroFragment& z : frags) {
          const auto d = static_cast<size_t>(z.dp_rank);
          const format::TensorRecord& rec = *(*recs)[d];
          PlaceRange(pl, z.param_elem_offset, z.param_elem_offset + z.n_elems, optim_ids_[m][d],
                     rec.data_offset + z.partition_elem_offset * ItemSize(rec.dtype), rec.dtype,
                     &item.layout.fragments);
        }
        items.push_back(std::move(item));
      }
    }
    if (parts.step != nullptr) items.push_back(StepItem(p, m, *parts.step));
    return items;
  }

  // ZeRO-1/2 and BF16_Optimizer: group gi's flat partitions on mp rank m.
  Result<std::vector<std::vector<Item>>> FlatGroup(int mp, size_t gi) const {
    const auto m = static_cast<size_t>(mp);
    const std::vector<Param>& params = groups_[m][gi];
    std::vector<uint64_t> numels;
    for (const Param& p : params) numels.push_back(p.numel);
    UCPFS_ASSIGN_OR_RETURN(const layout::ZeroFlatGroup group, layout::MakeZeroFlatGroup(numels, dp_));
    const std::string g = std::to_string(gi);
    const std::string fp32_key = "optimizer_state_dict.single_partition_of_fp32_groups." + g;
    const std::string state_key = "optimizer_state_dict.base_optimizer_state.state." + g;
    std::vector<const format::TensorRecord*> fp32(static_cast<size_t>(dp_)), avg(fp32.size()), avg_sq(fp32.size());
    for (size_t d = 0; d < fp32.size(); ++d) {
      UCPFS_RETURN_IF_ERROR(CheckMappings(m, d, gi, group));
      const uint64_t real = group.partition_elems - group.PaddingOf(static_cast<int>(d));
      // ZeRO-1/2 store the fp32 partition without its padding, BF16_Optimizer with it.
      UCPFS_ASSIGN_OR_RETURN(fp32[d], FlatTensor(m, d, fp32_key, real, group.partition_elems));
      UCPFS_ASSIGN_OR_RETURN(avg[d], FlatTensor(m, d, state_key + ".exp_avg", group.partition_elems, group.partition_elems));
      UCPFS_ASSIGN_OR_RETURN(avg_sq[d],
                             FlatTensor(m, d, state_key + ".exp_avg_sq", group.partition_elems, group.partition_elems));
    }
    const Partitions parts{fp32, avg, avg_sq, StepOf(m, state_key)};
    std::vector<std::vector<Item>> out;
    for (size_t pi = 0; pi < params.size(); ++pi) {
      UCPFS_ASSIGN_OR_RETURN(std::vector<Item> items,
                             ItemsOfParam(params[pi], m, layout::FragmentsOfParam(group, pi), parts));
      out.push_back(std::move(items));
    }
    return out;
  }

  // Rank (m, d)'s param_slice_mappings[gi] must be what the partition math says, name by name.
  Status CheckMappings(size_t m, size_t d, size_t gi, const layout::ZeroFlatGroup& group) const {
    const pickle::PickleGraph& g = optim_[m][d].graph();
    const pickle::NodeId osd = Get(g, g.root(), "optimizer_state_dict");
    const auto counts = Items(g, Get(g, osd, "partition_count"));
    if (gi < counts.size()) {
      std::optional<int64_t> c = IntOf(g, counts[gi]);
      if (!c || *c != dp_) {
        return CorruptError(Where(m, d) + ": optimizer_state_dict.partition_count[" + std::to_string(gi) + "] is " +
                            (c ? std::to_string(*c) : std::string("not an int")) + " but there are " +
                            std::to_string(dp_) + " dp ranks");
      }
    }
    const auto mappings = Items(g, Get(g, osd, "param_slice_mappings"));
    if (mappings.empty()) return Status::Ok();  // older files: the math alone
    if (gi >= mappings.size()) {
      return CorruptError(Where(m, d) + ": param_slice_mappings has no group " + std::to_string(gi));
    }
    const auto expected = layout::FragmentsInWindow(group, static_cast<int>(d));
    const auto pairs = Pairs(g, mappings[gi]);
    const std::string key = "optimizer_state_dict.param_slice_mappings." + std::to_string(gi);
    if (pairs.size() != expected.size()) {
      return CorruptError(Where(m, d) + ": " + key + " lists " + std::to_string(pairs.size()) +
                          " fragments; param_shapes and the partition size give " + std::to_string(expected.size()));
    }
    for (size_t i = 0; i < pairs.size(); ++i) {
      const Param& p = groups_[m][gi][expected[i].param];
      const pickle::NodeId addr = g.object(pairs[i].second).state;
      std::optional<int64_t> numel = IntOf(g, Get(g, addr, "numel")), start = IntOf(g, Get(g, addr, "start"));
      if (g.kind(pairs[i].first) != pickle::Kind::kString || g.text(pairs[i].first) != p.name || !numel || !start ||
          static_cast<uint64_t>(*numel) != expected[i].fragment.n_elems ||
          static_cast<uint64_t>(*start) != expected[i].fragment.partition_elem_offset) {
        return CorruptError(Where(m, d) + ": " + key + " entry " + std::to_string(i) + " does not match '" + p.name +
                            "' at " + std::to_string(expected[i].fragment.partition_elem_offset) + " (+" +
                            std::to_string(expected[i].fragment.n_elems) + ")");
      }
    }
    return Status::Ok();
  }

  // ZeRO-3 (one mp rank): sub-group gi, each parameter padded to pn * dp, rank d holding
  // [d * pn, +pn).
  Result<std::vector<std::vector<Item>>> Zero3Group(size_t gi) const {
    const std::vector<Param>& params = groups_[0][gi];
    uint64_t flat = 0;
    std::vector<uint64_t> starts;
    for (const Param& p : params) {
      starts.push_back(flat);
      std::optional<uint64_t> sum = CheckedAdd(flat, layout::Zero3PartitionElems(p.numel, dp_));
      if (!sum) return CorruptError(Where(0, 0) + ": sub-group " + std::to_string(gi) + " size overflows");
      flat = *sum;
    }
    const std::string g = std::to_string(gi);
    const std::string fp32_key = "optimizer_state_dict.fp32_flat_groups." + g;
    const std::string state_key = "optimizer_state_dict.optimizer_state_dict.state." + g;
    std::vector<const format::TensorRecord*> fp32(static_cast<size_t>(dp_)), avg(fp32.size()), avg_sq(fp32.size());
    for (size_t d = 0; d < fp32.size(); ++d) {
      UCPFS_ASSIGN_OR_RETURN(fp32[d], FlatTensor(0, d, fp32_key, flat, flat));
      UCPFS_ASSIGN_OR_RETURN(avg[d], FlatTensor(0, d, state_key + ".exp_avg", flat, flat));
      UCPFS_ASSIGN_OR_RETURN(avg_sq[d], FlatTensor(0, d, state_key + ".exp_avg_sq", flat, flat));
    }
    const Partitions parts{fp32, avg, avg_sq, StepOf(0, state_key)};
    std::vector<std::vector<Item>> out;
    for (size_t pi = 0; pi < params.size(); ++pi) {
      std::vector<layout::ZeroFragment> frags;
      for (int d = 0; d < dp_; ++d) {
        layout::ZeroFragment z = layout::Zero3FragmentOf(params[pi].numel, dp_, d);
        if (z.n_elems == 0) continue;  // this rank holds only padding of it
        z.partition_elem_offset = starts[pi];
        frags.push_back(z);
      }
      UCPFS_ASSIGN_OR_RETURN(std::vector<Item> items, ItemsOfParam(params[pi], 0, frags, parts));
      out.push_back(std::move(items));
    }
    return out;
  }

  // ZeRO-3's module tensors without optimizer state, in module order: buffers (whole in every dp
  // rank's `module`; dp rank 0's are read) and frozen parameters (`frozen_param_shapes`, each dp
  // rank holding its ceil(numel/dp) partition in `frozen_param_fragments`, as ZeRO-3 partitions
  // any parameter). Trained parameters are placeholders there (their state is in the optimizer).
  Result<std::vector<Item>> Zero3ModuleOnly(const format::TorchFile& model0, uint32_t model0_id) {
    const std::string where0 = builder_.source(model0_id)->Name();
    const pickle::PickleGraph& g = model0.graph();
    std::map<std::string, std::vector<int64_t>> frozen;
    for (const auto& [k, v] : Pairs(g, Get(g, g.root(), "frozen_param_shapes"))) {
      const std::optional<std::vector<int64_t>> shape = ShapeOf(g, v);
      if (g.kind(k) != pickle::Kind::kString || !shape) {
        return CorruptError(where0 + ": frozen_param_shapes holds an entry that is not name -> shape");
      }
      frozen.emplace(std::string(g.text(k)), *shape);
    }
    // Each dp rank's model file: its frozen partitions by name.
    std::vector<std::map<std::string, const format::TensorRecord*>> parts(static_cast<size_t>(dp_));
    std::vector<uint32_t> ids(parts.size());
    std::vector<format::TorchFile> files;
    files.reserve(parts.size());
    if (!frozen.empty()) {
      for (int d = 0; d < dp_; ++d) {
        const auto it = files_.zero3_model.find({d, 0});
        if (it == files_.zero3_model.end()) return CorruptError(where0 + ": no ZeRO-3 model file of dp rank " + std::to_string(d));
        UCPFS_ASSIGN_OR_RETURN(ids[static_cast<size_t>(d)], builder_.AddFile(Rel(it->second)));
        UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, builder_.OpenTorchFile(ids[static_cast<size_t>(d)]));
        files.push_back(std::move(tf));
        constexpr std::string_view kPrefix = "frozen_param_fragments.";
        for (const format::TensorRecord& t : files.back().tensors()) {
          if (t.key.rfind(kPrefix, 0) == 0) parts[static_cast<size_t>(d)][t.key.substr(kPrefix.size())] = &t;
        }
      }
    }
    std::vector<Item> out;
    constexpr std::string_view kModule = "module.";
    for (const format::TensorRecord& t : model0.tensors()) {
      if (t.key.rfind(kModule, 0) != 0) continue;
      const std::string name = t.key.substr(kModule.size());
      if (known_names_.count(name) != 0) continue;  // a trained parameter's placeholder
      const auto f = frozen.find(name);
      if (f == frozen.end()) {
        if (t.n_elems == 0) continue;  // a placeholder of a parameter no list names
        UCPFS_ASSIGN_OR_RETURN(std::optional<Item> item, PlacedTensor(name, t, model0_id, 0));
        if (!item) continue;
        item->model_tensor = true;
        out.push_back(std::move(*item));
        continue;
      }
      const std::optional<uint64_t> numel = NumelOf(f->second);
      if (!numel) return CorruptError(where0 + ": frozen parameter '" + name + "' has too many elements");
      Placement pl;
      pl.global_shape = f->second;
      Item item;
      item.key = name;
      item.kind = ItemKind::kTensor;
      item.model_tensor = true;
      item.layout.shape = f->second;
      for (int d = 0; d < dp_; ++d) {
        const layout::ZeroFragment z = layout::Zero3FragmentOf(*numel, dp_, d);
        const auto p = parts[static_cast<size_t>(d)].find(name);
        if (p == parts[static_cast<size_t>(d)].end()) {
          return CorruptError(builder_.source(ids[static_cast<size_t>(d)])->Name() + ": no frozen_param_fragments entry for '" +
                              name + "'");
        }
        const format::TensorRecord& rec = *p->second;
        if (!rec.contiguous || rec.n_elems != layout::Zero3PartitionElems(*numel, dp_)) {
          return CorruptError(builder_.source(ids[static_cast<size_t>(d)])->Name() + ": frozen_param_fragments." + name +
                              " has " + std::to_string(rec.n_elems) + " elements; the partition needs " +
                              std::to_string(layout::Zero3PartitionElems(*numel, dp_)));
        }
        item.dtype = rec.dtype;
        if (z.n_elems == 0) continue;  // this rank holds only padding of it
        PlaceRange(pl, z.param_elem_offset, z.param_elem_offset + z.n_elems, ids[static_cast<size_t>(d)],
                   rec.data_offset + z.partition_elem_offset * ItemSize(rec.dtype), rec.dtype, &item.layout.fragments);
      }
      out.push_back(std::move(item));
    }
    return out;
  }

  static constexpr int64_t kMaxRank = 1 << 20;

  CheckpointBuilder builder_;
  std::string tag_;      // from `latest`, or "" when the directory is the tag
  std::string tag_dir_;  // relative to the directory
  TagFiles files_;
  bool zero3_ = false;
  int tp_ = 1, pp_ = 1, dp_ = 0;
  int stage_ = 0;
  nlohmann::json uc_json_;
  std::optional<MegatronCoreArgs> megatron_args_;
  DeepSpeedPatterns patterns_;
  std::vector<std::vector<std::vector<Param>>> groups_;   // by mp rank, param group
  std::set<std::string> known_names_;                     // every param_shapes name
  std::vector<std::vector<format::TorchFile>> optim_;     // by mp rank, dp rank
  std::vector<std::vector<uint32_t>> optim_ids_;
  std::vector<std::map<std::string, Item>> layer_weights_;  // by tp rank: layer-file tensors not yet added
  std::vector<std::string> layer_order_;
  TpSliceMerger merged_{/*repeat_is_error=*/false};
};

}  // namespace

bool IsDeepSpeedDirectory(const SourceTree& tree) {
  if (tree.IsFile("latest")) return true;
  Result<TagFiles> files = ListTag(tree, "");
  return files.ok() && (!files->model.empty() || !files->zero3_model.empty());
}

Result<Checkpoint> ScanDeepSpeed(const SourceTree& tree, const ScanProgress& progress) {
  return DeepSpeedScanner(tree).Run(progress);
}

}  // namespace ucpfs::index
