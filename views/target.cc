#include "views/target.h"
#include "core/json_text.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/format/safetensors.h"
#include "core/format/torch_file.h"
#include "core/format/torch_writer.h"
#include "core/layout/zero.h"
#include "core/slice/local_view.h"
#include "views/atomic.h"
#include "views/mcore_from_hf.h"

namespace ucpfs::views {

const char* TargetStateName(TargetState s) {
  switch (s) {
    case TargetState::kWeight: return "weight";
    case TargetState::kFp32: return "fp32";
    case TargetState::kExpAvg: return "exp_avg";
    case TargetState::kExpAvgSq: return "exp_avg_sq";
    case TargetState::kStep: return "step";
  }
  return "weight";
}

namespace {

using Files = std::shared_ptr<const std::vector<std::shared_ptr<const ByteSource>>>;
using format::SaveValue;

// A window of a 1-D virtual tensor: the concatenation of `parts` in float32, zero padded to
// padded_n_elems (ReadConcatBytes), seen from window_byte_offset on.
class ConcatProvider final : public format::TensorBytesProvider {
 public:
  ConcatProvider(std::vector<std::shared_ptr<const slice::TensorLayout>> parts, uint64_t padded_n_elems,
                 uint64_t window_byte_offset, Files files)
      : parts_(std::move(parts)), padded_n_elems_(padded_n_elems),
        window_byte_offset_(window_byte_offset), files_(std::move(files)) {
    for (const auto& p : parts_) raw_.push_back(p.get());
  }
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    return slice::ReadConcatBytes(raw_, DType::kFloat32, padded_n_elems_, *files_,
                                  window_byte_offset_ + byte_offset, out);
  }
  void Prefetch(uint64_t byte_offset, uint64_t n_bytes) const override {
    slice::PrefetchConcatBytes(raw_, DType::kFloat32, padded_n_elems_, *files_, window_byte_offset_ + byte_offset,
                               n_bytes);
  }
  Status DescribeReads(uint64_t byte_offset, uint64_t n_bytes, const SourceRunSink& sink) const override {
    return slice::DescribeConcatReads(raw_, DType::kFloat32, padded_n_elems_, *files_,
                                      window_byte_offset_ + byte_offset, n_bytes, sink);
  }

 private:
  std::vector<std::shared_ptr<const slice::TensorLayout>> parts_;
  std::vector<const slice::TensorLayout*> raw_;
  uint64_t padded_n_elems_;
  uint64_t window_byte_offset_;
  Files files_;
};

Status CheckConvertible(const slice::TensorLayout& layout, DType dst, const std::string& what) {
  for (const auto& f : layout.fragments) {
    if (f.file_id == slice::kZeroFileId) continue;
    if (!slice::CanConvert(f.dtype, dst)) {
      return UnsupportedError(what + ": cannot convert stored " + std::string(TorchName(f.dtype)) +
                              " to " + std::string(TorchName(dst)));
    }
  }
  return Status::Ok();
}

// A tensor of `shape` that reads as zeros.
std::shared_ptr<const slice::TensorLayout> ZeroLayout(const std::vector<int64_t>& shape) {
  auto z = std::make_shared<slice::TensorLayout>();
  z->shape = shape;
  slice::Fragment f;
  f.box.offsets.assign(shape.size(), 0);
  f.box.sizes = shape;
  f.flat_hi = f.box.Volume();
  f.file_id = slice::kZeroFileId;
  if (f.flat_hi > 0) z->fragments.push_back(std::move(f));
  return z;
}

std::string DescribeTargetPattern(const layout::ParamPattern& p) {
  std::string s = layout::TpKindName(p.tp);
  if (p.tp_dim >= 0) s += "(dim=" + std::to_string(p.tp_dim) + ")";
  if (!p.sub_sizes.empty()) {
    s += "[sub=";
    for (size_t i = 0; i < p.sub_sizes.size(); ++i) s += (i ? "," : "") + std::to_string(p.sub_sizes[i]);
    s += "]";
  }
  return s;
}

// A float32 scalar known when the file is planned (a step the source stored as a number).
class ScalarF32Provider final : public format::TensorBytesProvider {
 public:
  explicit ScalarF32Provider(float value) : value_(value) {}
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    std::byte bytes[sizeof(float)];
    std::memcpy(bytes, &value_, sizeof(float));
    if (byte_offset > sizeof(float) || out.size() > sizeof(float) - byte_offset) {
      return OutOfRangeError("scalar step: read past its 4 bytes");
    }
    std::memcpy(out.data(), bytes + byte_offset, out.size());
    return Status::Ok();
  }
  Status DescribeReads(uint64_t, uint64_t, const SourceRunSink&) const override {
    return Status::Ok();  // known when planned: reads nothing
  }

 private:
  float value_;
};

// One held parameter of a rank.
struct Held {
  size_t param = 0;  // index into TargetInput::params
  layout::LocalView view;
  // Local layouts per state (null when absent); step is the global (one-element) layout.
  std::array<std::shared_ptr<const slice::TensorLayout>, kNumTargetStates> local;
  // The step as a 0-d float32 tensor, from the step layout or the source's number; or null.
  std::shared_ptr<const format::TensorBytesProvider> step;
};

constexpr int S(TargetState s) { return static_cast<int>(s); }

// The layout that decides a parameter's shape and split: its weight, else its fp32 master, else
// (a fused parameter served in optim.pt only) its first moment; null when it has none of them.
const std::shared_ptr<const slice::TensorLayout>& PrimaryOf(const TargetParam& p) {
  for (TargetState s : {TargetState::kWeight, TargetState::kFp32}) {
    if (p.states[S(s)]) return p.states[S(s)];
  }
  return p.in_model ? p.states[S(TargetState::kWeight)]
                    : p.states[S(p.states[S(TargetState::kExpAvg)] ? TargetState::kExpAvg : TargetState::kExpAvgSq)];
}

bool SameHyper(const std::vector<HyperParam>& a, const std::vector<HyperParam>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !a[i].second.SameAs(b[i].second)) return false;
  }
  return true;
}

// param_groups: parameters of one source group (TargetParam::group) with identical
// hyper-parameters share a group, groups in order of their first parameter (model.pt order).
// `optimizer`: the held entries in optim.pt, in its position order.
SaveValue ParamGroups(const TargetInput& in, const std::vector<const Held*>& optimizer) {
  std::vector<const std::vector<HyperParam>*> keys;
  std::vector<int> source_group;
  std::vector<std::vector<size_t>> members;
  for (size_t i = 0; i < optimizer.size(); ++i) {
    const auto& p = in.params[optimizer[i]->param];
    size_t g = 0;
    while (g < keys.size() && !(source_group[g] == p.group && SameHyper(*keys[g], p.hyper))) ++g;
    if (g == keys.size()) {
      keys.push_back(&p.hyper);
      source_group.push_back(p.group);
      members.emplace_back();
    }
    members[g].push_back(i);
  }
  SaveValue groups = SaveValue::List();
  for (size_t g = 0; g < keys.size(); ++g) {
    SaveValue group = SaveValue::Dict();
    SaveValue params = SaveValue::List();
    SaveValue names = SaveValue::List();
    for (size_t i : members[g]) {
      params.Append(SaveValue::Int(static_cast<int64_t>(i)));
      names.Append(SaveValue::Str(optimizer[i]->view.local_name));
    }
    group.Set("params", std::move(params));
    group.Set("param_names", std::move(names));
    for (const auto& [field, value] : *keys[g]) {
      if (field == "params" || field == "param_names") continue;
      group.Set(field, value);
    }
    groups.Append(std::move(group));
  }
  return groups;
}

// What optim.pt lacks that a torch Adam/AdamW needs to step, because the source does not have
// it: "step" when a parameter with moments has no step, and each of Adam's hyper-parameters
// without a default (lr, betas, eps, weight_decay) some group lacks. Written as optim.pt's
// top-level "ucpfs_missing" (torch's Optimizer.load_state_dict reads only 'state' and
// 'param_groups'); docs/reference.md "Target views: layouts, presets, rank files" says what
// the user passes.
std::vector<std::string> MissingForAdam(const TargetInput& in, const std::vector<const Held*>& optimizer) {
  std::vector<std::string> out;
  bool moments = false;
  bool no_step = false;
  for (const Held* h : optimizer) {
    if (!h->local[S(TargetState::kExpAvg)]) continue;
    moments = true;
    no_step = no_step || !h->step;
  }
  if (!moments) return out;
  if (no_step) out.emplace_back("step");
  for (const char* field : {"lr", "betas", "eps", "weight_decay"}) {
    for (const Held* h : optimizer) {
      const auto& hyper = in.params[h->param].hyper;
      if (std::none_of(hyper.begin(), hyper.end(), [&](const HyperParam& f) { return f.first == field; })) {
        out.emplace_back(field);
        break;
      }
    }
  }
  return out;
}

// An empty ordered_json object with room for n_fields. nlohmann's ordered_map is a vector of
// pair<const string, json>, whose move may throw (the const key is copied), so the vector grows
// by copying every value, nested ones included; ucp_info.json is made for every rank of every
// layout (its size is needed to list the file), so its objects are filled in place instead.
nlohmann::ordered_json ObjectWithRoom(size_t n_fields) {
  auto out = nlohmann::ordered_json::object();
  out.get_ref<nlohmann::ordered_json::object_t&>().reserve(n_fields);
  return out;
}

nlohmann::ordered_json PiecesJson(const std::vector<int64_t>& global_shape,
                                  const std::vector<slice::Box>& pieces) {
  auto out = nlohmann::ordered_json::array();
  out.get_ref<nlohmann::ordered_json::array_t&>().reserve(pieces.size());
  for (const auto& b : pieces) {
    auto piece = ObjectWithRoom(3);
    piece["view_shape"] = global_shape;
    piece["offsets"] = b.offsets;
    piece["sizes"] = b.sizes;
    out.push_back(std::move(piece));
  }
  return out;
}

}  // namespace

Result<TargetPlan> TargetPlan::Make(std::shared_ptr<const TargetInput> input, layout::Layout layout) {
  if (!input || input->params.empty()) {
    return InvalidArgumentError("layout " + layout.name + ": the source has no parameters");
  }
  if (!input->files) return InvalidArgumentError("target view: no file table");
  if (input->preset == layout::Preset::kMegatronCore) {  // the source renamed and fused as GPTModel holds it
    UCPFS_ASSIGN_OR_RETURN(input, MegatronCoreFromHf(*input));
  }
  TargetPlan plan;
  plan.layout_ = std::move(layout);
  if (plan.layout_.zero != 0 && plan.layout_.dp > 1) plan.shared_parts_ = std::make_shared<SharedRankParts>();
  for (const auto& p : input->params) {
    const auto& primary = PrimaryOf(p);
    if (!primary) {
      return InvalidArgumentError("parameter '" + p.name + "': no weight and no fp32 master");
    }
    for (int s = 0; s < kNumTargetStates; ++s) {
      if (s == S(TargetState::kStep) || !p.states[s]) continue;
      if (p.states[s]->shape != primary->shape) {
        return InvalidArgumentError("parameter '" + p.name + "': state " +
                                    TargetStateName(static_cast<TargetState>(s)) +
                                    " has a shape different from the weight's");
      }
      if (s != S(TargetState::kWeight)) plan.has_optim_ = true;
    }
    if ((!p.in_model || !p.in_optimizer) && plan.layout_.zero != 0) {
      return InvalidArgumentError("parameter '" + p.name + "' is held fused by the optimizer and stored split by the model; a ZeRO "
                                  "flat buffer of it is not built (serve it without zero)");
    }
  }
  std::vector<PatternParam> pattern_params;
  for (const auto& p : input->params) {
    const auto& primary = *PrimaryOf(p);
    pattern_params.push_back({p.name, primary.shape, ShardDim(primary)});
  }
  UCPFS_ASSIGN_OR_RETURN(ModelPatterns mp, PatternsOf(pattern_params, input->preset, input->rules, input->vocab_size,
                                                           input->model_facts));
  plan.preset_ = mp.preset;
  const layout::ModelInfo& info = mp.info;
  UCPFS_RETURN_IF_ERROR(layout::CheckLayoutForModel(plan.layout_, info, input->pp_split));
  if (plan.layout_.pp > 1 || input->pp_split) {
    UCPFS_ASSIGN_OR_RETURN(plan.stage_bounds_,
                           layout::PipelineSplit(info.n_layers, plan.layout_.pp, input->pp_split));
  } else {
    plan.stage_bounds_ = {0, info.n_layers};
  }
  plan.patterns_ = std::move(mp.patterns);
  plan.input_ = std::move(input);
  return plan;
}

Result<ModelPatterns> PatternsOf(const std::vector<PatternParam>& params, layout::Preset preset,
                                 const std::vector<layout::Rule>& rules, std::optional<int64_t> vocab_size,
                                 const layout::ModelInfo& facts) {
  ModelPatterns out;
  std::vector<std::string> names;
  std::vector<layout::ParamInfo> infos;
  for (const auto& p : params) {
    names.push_back(p.name);
    infos.push_back({p.name, p.shape});
  }
  // megatron-core: the target views rename the source first (MegatronCoreFromHf); other views keep
  // the source's names and their own preset.
  const bool detect = preset == layout::Preset::kAuto || preset == layout::Preset::kMegatronCore;
  out.preset = detect ? layout::DetectPreset(names) : preset;
  out.info = layout::DetectModelInfo(out.preset, infos);
  if (vocab_size) out.info.vocab_size = *vocab_size;
  layout::ApplyModelFacts(facts, &out.info);
  for (const auto& p : params) {
    auto pattern = layout::PatternFor(out.preset, p.name, p.shape, out.info, rules);
    if (!pattern.ok()) {
      if (pattern.error().code() != StatusCode::kNotFound) return pattern.error();
      pattern = layout::PatternFromGeometry(p.shape, p.shard_dim);
    }
    // A DCP chunk grid records how the checkpoint was *stored* (FSDP/HSDP shard every tensor
    // along dim 0 whatever its tensor-parallel role), so it does not prove a TP kind: a rule
    // that matched wins, and the geometry only decides when no rule matches (above).
    out.patterns.push_back(std::move(*pattern));
  }
  return out;
}

// What a rank's files are made from that depends only on its (tp, pp, ep) coordinate: the
// parameters it holds with their local layouts per state and, for a ZeRO layout, the flat group
// of their local sizes.
struct RankParts {
  std::vector<Held> held;
  std::optional<layout::ZeroFlatGroup> zero;
};

struct TargetPlan::SharedRankParts {
  std::mutex mu;
  std::map<std::tuple<int, int, int>, std::shared_ptr<const RankParts>> by_coords;  // guarded by mu
};

Result<std::shared_ptr<const RankParts>> TargetPlan::PartsOf(const layout::RankCoords& coords) const {
  const std::tuple<int, int, int> key{coords.tp, coords.pp, coords.ep};
  if (shared_parts_) {
    std::lock_guard lock(shared_parts_->mu);
    if (auto it = shared_parts_->by_coords.find(key); it != shared_parts_->by_coords.end()) return it->second;
  }
  const TargetInput& in = *input_;
  const std::string dir = "target/" + layout_.name + "/rank_" + std::to_string(layout::RankOf(layout_, coords)) + "/";
  auto parts = std::make_shared<RankParts>();
  std::vector<Held>& held = parts->held;
  // Which parameters the rank holds, and their local layouts per state.
  for (size_t i = 0; i < in.params.size(); ++i) {
    const auto& p = in.params[i];
    const auto& primary = PrimaryOf(p);
    UCPFS_ASSIGN_OR_RETURN(auto view, layout::TargetSlice(preset_, p.name, patterns_[i], primary->shape,
                                                          layout_, stage_bounds_, coords));
    if (!view.held) continue;
    Held h;
    h.param = i;
    for (int s = 0; s < kNumTargetStates; ++s) {
      if (!p.states[s]) continue;
      if (s == S(TargetState::kStep)) {
        if (p.states[s]->NumElems() != 1) {
          return InvalidArgumentError("parameter '" + p.name + "': step has " +
                                      std::to_string(p.states[s]->NumElems()) + " elements, not 1");
        }
        UCPFS_RETURN_IF_ERROR(CheckConvertible(*p.states[s], DType::kFloat32, p.keys[s]));
        h.local[s] = p.states[s];
        h.step = std::make_shared<LayoutProvider>(p.states[s], DType::kFloat32, in.files);
        continue;
      }
      auto local = slice::LocalLayout(*p.states[s], view.local_shape, view.cat_dim, view.pieces);
      if (!local.ok()) return local.error().WithContext("parameter '" + p.name + "'");
      h.local[s] = std::make_shared<const slice::TensorLayout>(std::move(*local));
    }
    if (!h.step && p.step_value) {
      h.step = std::make_shared<ScalarF32Provider>(static_cast<float>(*p.step_value));
    }
    h.view = std::move(view);
    held.push_back(std::move(h));
  }
  // Megatron's last stage holds tied word embeddings as its output layer, the last parameter of
  // its model (layout::TargetSlice names it output_layer.weight): list it last, as parameters()
  // does, so optim.pt's positions match an optimizer built from that model.
  std::stable_partition(held.begin(), held.end(), [&](const Held& h) {
    return !(patterns_[h.param].pp == layout::PpPlacement::kTiedFirstLast && h.view.local_name != in.params[h.param].name);
  });
  if (layout_.zero != 0) {
    // ZeRO-1 (layout/zero.h): flat = concat of the local tensors in model.pt order, padded to
    // a multiple of 2·dp, DP rank d holding its window of ps = padded / dp elements.
    std::vector<uint64_t> numels;
    for (const auto& h : held) {
      std::optional<uint64_t> n = 1;
      for (int64_t d : h.view.local_shape) {
        if (n) n = CheckedMul(*n, static_cast<uint64_t>(d));
      }
      if (!n) return InvalidArgumentError(dir + ": flat size overflows");
      numels.push_back(*n);
    }
    UCPFS_ASSIGN_OR_RETURN(parts->zero, layout::MakeZeroFlatGroup(numels, layout_.dp));
  }
  if (!shared_parts_) return std::shared_ptr<const RankParts>(std::move(parts));
  std::lock_guard lock(shared_parts_->mu);
  return shared_parts_->by_coords.try_emplace(key, std::move(parts)).first->second;  // a racing build's, if first
}

Result<RankFiles> TargetPlan::Build(int rank, const RankFileSet& want) const {
  if (rank < 0 || rank >= layout_.World()) {
    return InvalidArgumentError("layout " + layout_.name + ": rank " + std::to_string(rank) +
                                " out of range [0, " + std::to_string(layout_.World()) + ")");
  }
  const TargetInput& in = *input_;
  const layout::RankCoords coords = layout::CoordsOf(layout_, rank);
  const std::string dir = "target/" + layout_.name + "/rank_" + std::to_string(rank) + "/";
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<const RankParts> parts_of_rank, PartsOf(coords));
  const std::vector<Held>& held = parts_of_rank->held;

  nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
  auto add_info = [&](const Held& h, TargetState s, const std::string& file, const std::string& key,
                      DType dtype, const nlohmann::ordered_json& flat_range) {
    if (!want.info) return;
    const auto& p = in.params[h.param];
    const bool step = s == TargetState::kStep;
    const std::vector<int64_t> global_shape =
        p.states[S(s)] ? p.states[S(s)]->shape : std::vector<int64_t>{};  // a stored number: 0-d
    auto t = ObjectWithRoom(10);
    t["param"] = p.name;
    t["state"] = TargetStateName(s);
    t["file"] = file;
    t["key"] = key;
    t["source_key"] = p.keys[S(s)];
    t["dtype"] = std::string(TorchName(dtype));
    t["global_shape"] = global_shape;
    t["pattern"] = step ? std::string("replicate") : DescribeTargetPattern(patterns_[h.param]);
    t["pieces"] = step ? nlohmann::ordered_json::array() : PiecesJson(p.states[S(s)]->shape, h.view.pieces);
    t["flat_range"] = flat_range;
    tensors.push_back(std::move(t));
  };

  // model.pt
  SaveValue model = SaveValue::OrderedDict();
  std::vector<std::pair<std::string, format::SaveTensor>> model_tensors;
  std::string safetensors_refused;  // the first tensor safetensors cannot hold, and why
  for (const auto& h : held) {
    const auto& p = in.params[h.param];
    if (!p.in_model) continue;
    const int s = p.states[S(TargetState::kWeight)] ? S(TargetState::kWeight) : S(TargetState::kFp32);
    const DType dtype = p.dtypes[s];
    UCPFS_RETURN_IF_ERROR(CheckConvertible(*h.local[s], dtype, p.keys[s]));
    add_info(h, static_cast<TargetState>(s), "model.pt", h.view.local_name, dtype, nullptr);
    if (!want.model && !want.model_safetensors) continue;  // sizing another file (a ZeRO rank's)
    format::SaveTensor t{dtype, h.view.local_shape, std::make_shared<LayoutProvider>(h.local[s], dtype, in.files)};
    if (safetensors_refused.empty() && format::SafetensorsDTypeName(dtype).empty()) {
      safetensors_refused = "tensor '" + h.view.local_name + "' has dtype " + std::string(TorchName(dtype)) +
                            ", which safetensors has no name for (model.pt has it)";
    }
    model_tensors.emplace_back(h.view.local_name, t);
    model.Set(h.view.local_name, SaveValue::Tensor(std::move(t)));
    std::string module = h.view.local_name.substr(0, h.view.local_name.rfind('.') + 1);  // "" without a dot
    bool siblings = true;
    if (patterns_[h.param].pp == layout::PpPlacement::kTiedFirstLast) {  // the output layer's (TargetParam)
      siblings = coords.pp == layout_.pp - 1;
      module = "output_layer.";
    }
    for (const auto& [last, value] : p.model_siblings) {
      if (siblings) model.Set(module + last, value);
    }
  }
  RankFiles out;
  if (want.model) {
    UCPFS_ASSIGN_OR_RETURN(auto model_file, format::LazyTorchFile::Build(model, dir + "model.pt"));
    out.model = std::move(model_file);
  }
  if (want.model_safetensors && safetensors_refused.empty()) {
    // Names safetensors cannot hold (not UTF-8, "__metadata__") leave the rank without it.
    auto st = format::LazySafetensorsFile::Build(std::move(model_tensors), {{"format", "pt"}}, dir + "model.safetensors");
    if (st.ok()) {
      out.model_safetensors = std::move(*st);
    } else {
      safetensors_refused = st.error().message() + " (model.pt has the same tensors)";
    }
  }
  if (want.model_safetensors && !out.model_safetensors) out.model_safetensors_refused = safetensors_refused;

  // optim.pt
  if (has_optim_) {
    // optim.pt's positions: the held parameters the optimizer holds, in order.
    std::vector<const Held*> optimizer;
    for (const auto& h : held) {
      if (in.params[h.param].in_optimizer) optimizer.push_back(&h);
    }
    SaveValue optim = SaveValue::Dict();
    const TargetState kMoments[] = {TargetState::kExpAvg, TargetState::kExpAvgSq};
    if (layout_.zero == 0) {
      SaveValue state = SaveValue::Dict();
      SaveValue fp32 = SaveValue::OrderedDict();
      bool any_fp32 = false;
      for (size_t i = 0; i < optimizer.size(); ++i) {
        const Held& h = *optimizer[i];
        const auto& p = in.params[h.param];
        SaveValue entry = SaveValue::Dict();
        bool any = false;
        if (h.step) {
          entry.Set("step", SaveValue::Tensor(DType::kFloat32, {}, h.step));
          add_info(h, TargetState::kStep, "optim.pt", "state." + std::to_string(i) + ".step",
                   DType::kFloat32, nullptr);
          any = true;
        }
        for (TargetState s : kMoments) {
          const auto& l = h.local[S(s)];
          if (!l) continue;
          UCPFS_RETURN_IF_ERROR(CheckConvertible(*l, DType::kFloat32, p.keys[S(s)]));
          entry.Set(TargetStateName(s),
                    SaveValue::Tensor(DType::kFloat32, h.view.local_shape,
                                      std::make_shared<LayoutProvider>(l, DType::kFloat32, in.files)));
          add_info(h, s, "optim.pt", "state." + std::to_string(i) + "." + TargetStateName(s),
                   DType::kFloat32, nullptr);
          any = true;
        }
        if (any) state.Set(SaveValue::Int(static_cast<int64_t>(i)), std::move(entry));
        const auto& master = h.local[S(TargetState::kFp32)];
        if (master && p.states[S(TargetState::kFp32)] != p.states[S(TargetState::kWeight)] &&
            p.states[S(TargetState::kWeight)]) {
          UCPFS_RETURN_IF_ERROR(CheckConvertible(*master, DType::kFloat32, p.keys[S(TargetState::kFp32)]));
          fp32.Set(h.view.local_name,
                   SaveValue::Tensor(DType::kFloat32, h.view.local_shape,
                                     std::make_shared<LayoutProvider>(master, DType::kFloat32, in.files)));
          add_info(h, TargetState::kFp32, "optim.pt", "fp32." + h.view.local_name, DType::kFloat32, nullptr);
          any_fp32 = true;
        }
      }
      optim.Set("state", std::move(state));
      if (want.optim) optim.Set("param_groups", ParamGroups(in, optimizer));  // else sizing another file
      if (any_fp32) optim.Set("fp32", std::move(fp32));
    } else {
      // ZeRO-1: the flat group of the held parameters (PartsOf); this rank's window of it.
      const layout::ZeroFlatGroup& group = *parts_of_rank->zero;
      // The held parameters' pieces in this rank's window (at most one each), in flat order.
      std::map<size_t, layout::ZeroFragment> in_window;
      if (want.info) {
        for (const layout::IndexedFragment& f : layout::FragmentsInWindow(group, coords.dp)) {
          in_window.emplace(f.param, f.fragment);
        }
      }
      const uint64_t padded = group.padded_elems;
      const uint64_t ps = group.partition_elems;
      const uint64_t lo = group.WindowStart(coords.dp);
      const TargetState kFlat[] = {TargetState::kFp32, TargetState::kExpAvg, TargetState::kExpAvgSq};
      for (TargetState s : kFlat) {
        bool any = false;
        for (const auto& h : held) any = any || h.local[S(s)] || (s == TargetState::kFp32 && h.local[0]);
        if (!any) continue;
        std::vector<std::shared_ptr<const slice::TensorLayout>> parts;
        for (size_t i = 0; i < held.size(); ++i) {
          const Held& h = held[i];
          const auto& p = in.params[h.param];
          // The fp32 master falls back to the weight (converted), as DeepSpeed's master is.
          int src = S(s);
          if (!h.local[src] && s == TargetState::kFp32) src = S(TargetState::kWeight);
          std::shared_ptr<const slice::TensorLayout> part =
              h.local[src] ? h.local[src] : ZeroLayout(h.view.local_shape);
          UCPFS_RETURN_IF_ERROR(CheckConvertible(*part, DType::kFloat32, p.keys[src]));
          parts.push_back(part);
          if (auto f = in_window.find(i); f != in_window.end() && h.local[src]) {
            add_info(h, static_cast<TargetState>(src), "optim.pt", TargetStateName(s), DType::kFloat32,
                     nlohmann::ordered_json::array({f->second.partition_elem_offset,
                                                    f->second.partition_elem_offset + f->second.n_elems}));
          }
        }
        optim.Set(TargetStateName(s),
                  SaveValue::Tensor(DType::kFloat32, {static_cast<int64_t>(ps)},
                                    std::make_shared<ConcatProvider>(std::move(parts), padded,
                                                                     lo * ItemSize(DType::kFloat32), in.files)));
      }
      for (const auto& h : held) {
        if (!h.step) continue;
        optim.Set("step", SaveValue::Tensor(DType::kFloat32, {}, h.step));
        add_info(h, TargetState::kStep, "optim.pt", "step", DType::kFloat32, nullptr);
        break;
      }
      if (want.optim) optim.Set("param_groups", ParamGroups(in, optimizer));  // else sizing another file
    }
    if (const std::vector<std::string> missing = MissingForAdam(in, optimizer); !missing.empty()) {
      SaveValue names = SaveValue::List();
      for (const std::string& m : missing) names.Append(SaveValue::Str(m));
      optim.Set("ucpfs_missing", std::move(names));
    }
    if (want.optim) {
      UCPFS_ASSIGN_OR_RETURN(auto optim_file, format::LazyTorchFile::Build(optim, dir + "optim.pt"));
      out.optim = std::move(optim_file);
    }
  }

  // extra_state.pt: replicated items everywhere; a rank-local group only when it has exactly one
  // item per DP rank of this layout (source DP ranks 0..dp-1), else it is ambiguous and reported.
  std::map<std::string, std::vector<int>> group_ranks;
  for (const auto& e : in.extras) {
    if (e.dp_rank >= 0) group_ranks[e.group].push_back(e.dp_rank);
  }
  std::map<std::string, bool> fits;
  for (auto& [group, r] : group_ranks) {
    std::sort(r.begin(), r.end());
    bool ok = static_cast<int>(r.size()) == layout_.dp;
    for (size_t i = 0; ok && i < r.size(); ++i) ok = r[i] == static_cast<int>(i);
    fits[group] = ok;
  }
  auto group_fits = [&](const std::string& group) { return fits[group]; };
  SaveValue extra = SaveValue::Dict();
  auto extra_keys = nlohmann::ordered_json::array();
  auto not_served = nlohmann::ordered_json::array();
  for (const auto& n : in.not_served) not_served.push_back({{"key", n.key}, {"reason", n.reason}});
  // A rank-local item takes the place of its group's first item, so a rank's extra_state.pt
  // lists its keys in the order that rank's state dict had.
  std::map<std::string, const ExtraItem*> mine;  // group -> the item of this rank's DP coordinate
  for (const auto& e : in.extras) {
    if (e.dp_rank >= 0 && e.dp_rank == coords.dp) mine.emplace(e.group, &e);
  }
  std::set<std::string> placed;
  for (const auto& item : in.extras) {
    const ExtraItem* ep = &item;
    if (item.dp_rank >= 0 && group_fits(item.group)) {
      if (!placed.insert(item.group).second) continue;
      auto it = mine.find(item.group);
      if (it == mine.end()) continue;
      ep = it->second;
    }
    const ExtraItem& e = *ep;
    if (e.dp_rank >= 0) {
      if (!group_fits(e.group)) {
        not_served.push_back(
            {{"key", e.key},
             {"reason", "rank-local state of source data-parallel rank " + std::to_string(e.dp_rank) + " of " +
                            std::to_string(group_ranks[e.group].size()) + " ('" + e.group + "'); layout " +
                            layout_.name + " has " + std::to_string(layout_.dp) +
                            " data-parallel ranks, so which rank gets it is ambiguous"}});
        continue;
      }
      if (e.dp_rank != coords.dp) continue;
    }
    extra.Set(e.key, e.value);
    extra_keys.push_back(e.key);
  }
  if (want.extra && !extra_keys.empty()) {
    UCPFS_ASSIGN_OR_RETURN(auto extra_file, format::LazyTorchFile::Build(extra, dir + "extra_state.pt"));
    out.extra = std::move(extra_file);
  }

  if (!want.info) return out;
  auto info = ObjectWithRoom(7);
  info["layout"] = layout_.name;
  info["rank"] = rank;
  info["coords"] = {{"tp", coords.tp}, {"pp", coords.pp}, {"dp", coords.dp}, {"ep", coords.ep}};
  info["tensors"] = std::move(tensors);
  info["extra_state"] = std::move(extra_keys);
  info["not_served"] = std::move(not_served);
  const std::string text = JsonText(info) + "\n";
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  out.info = std::make_shared<MemorySource>(dir + "ucp_info.json", std::move(bytes));
  return out;
}

bool TargetPlan::ReplicasAlike() const {
  return layout_.zero == 0 &&
         std::none_of(input_->extras.begin(), input_->extras.end(), [](const ExtraItem& e) { return e.dp_rank >= 0; });
}

// Build writes "rank" and "dp" as plain decimal integers, and nothing else in ucp_info.json
// depends on the DP coordinate when ReplicasAlike() (tensors' pieces come from (tp, pp, ep);
// extra state and not_served are the same on every rank). target_test checks this against Build.
uint64_t TargetPlan::ReplicaInfoBytes(uint64_t first_info_bytes, int first_rank, int first_dp, int rank, int dp) {
  auto digits = [](int v) { return static_cast<uint64_t>(std::to_string(v).size()); };
  return first_info_bytes - digits(first_rank) - digits(first_dp) + digits(rank) + digits(dp);
}

Result<RankFiles> BuildRankFiles(std::shared_ptr<const TargetInput> input, const layout::Layout& layout,
                                 int rank) {
  UCPFS_ASSIGN_OR_RETURN(auto plan, TargetPlan::Make(std::move(input), layout));
  return plan.Build(rank);
}

}  // namespace ucpfs::views
