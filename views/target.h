// Target views: the files of one rank of a new parallel layout (docs/design.md "Mount layout",
// `target/<layout>/rank_<N>/`):
//   model.pt      OrderedDict fqn -> this rank's local tensor, in the source's model dtype (the
//                 weight item's dtype), in the source's parameter order (model.load_state_dict);
//   model.safetensors  the same tensors as a safetensors file (format/safetensors.h);
//   optim.pt      only when the source has optimizer state (fp32 masters or Adam moments):
//                 zero 0: a torch.optim state dict {'state': {i: {'step', 'exp_avg',
//                 'exp_avg_sq'}}, 'param_groups': [...], ['fp32': OrderedDict fqn -> master]}
//                 with i the parameter's position in model.pt;
//                 zero 1: {'fp32', 'exp_avg', 'exp_avg_sq', 'step', 'param_groups'}, each of the
//                 three a 1-D float32 tensor: this DP rank's ZeRO-1 partition of the rank's local
//                 tensors flattened and concatenated in model.pt order (docs/formats.md
//                 "ZeRO partitions": padded with zeros at the end to a multiple of 2·dp,
//                 equal partitions);
//   extra_state.pt only when the source has non-parameter state for this rank: a dict
//                 {source key: value} of the source's other items (LR scheduler, dataloader,
//                 RNG, train state, user extras) in source order; replicated items on every
//                 rank, rank-local items (a `dp_rank_<d>` key component) on the ranks whose DP
//                 coordinate is d when the source has one such item per DP rank of the layout;
//   ucp_info.json where every tensor of the files comes from (UcpInfo), which items
//                 extra_state.pt holds, and which source items this rank does not get, and why.
// Sizes and every non-tensor byte are known when Build returns; tensor bytes are gathered
// from the source fragments on read (LazyTorchFile + slice::LocalLayout / ReadConcatBytes).
//
// Not for: I/O, key naming of the source (the caller maps keys to states: index/key_map.h),
// deciding which slice a rank holds (layout/patterns.h does that).
// Caveats:
//  - param_groups carry the source's hyper-parameters only where the caller found them
//    (TargetParam::hyper); with none, a group holds only 'params' and 'param_names' (torch's
//    Optimizer.load_state_dict takes the saved group whole, so the optimizer then lacks them).
//    Groups follow the source's (TargetParam::group), never merged across source groups.
//  - 'step' is always a 0-d float32 tensor (what torch.optim's Adam keeps, on torch 1.13 and
//    2.x), whether the source stored a tensor or a Python number (TargetParam::step_value).
//    A parameter with an Adam moment but no step gets no 'step' (torch's Adam then refuses to
//    load it: the source does not say what the step was).
//  - What the source lacks of those ('step', and Adam's lr, betas, eps, weight_decay) is listed
//    in optim.pt's top-level "ucpfs_missing", for the user to add before load_state_dict.
//  - zero 1: a held parameter missing one of the states reads as zeros in that state's flat
//    tensor, so partitions stay aligned; a state no held parameter has is omitted.
//  - Floats in param_groups are pickled as BINFLOAT: torch 1.13's weights_only=True refuses
//    them (torch_writer.h); plain torch.load accepts them.
// Invariants: pure and deterministic; the files of a rank depend only on the input, the layout
// and the rank (identical DP replicas give identical bytes).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "core/byte_source.h"
#include "core/dtype.h"
#include "core/format/torch_writer.h"
#include "core/layout/layout.h"
#include "core/layout/patterns.h"
#include "core/slice/slice.h"
#include "core/status.h"
#include "index/decoded_items.h"

namespace ucpfs::views {

// The scanners decode these (index/decoded_items.h); the target views serve them.
using index::ExtraItem;
using index::HyperParam;
using index::NotServed;

// The states of a parameter, in the order of index::StateKind.
enum class TargetState : uint8_t { kWeight = 0, kFp32 = 1, kExpAvg = 2, kExpAvgSq = 3, kStep = 4 };
inline constexpr int kNumTargetStates = 5;
const char* TargetStateName(TargetState s);  // "weight", "fp32", "exp_avg", "exp_avg_sq", "step"

struct TargetParam {
  std::string name;  // model fqn (global)
  // Global layouts per TargetState (null: the source has no such state). Every present layout
  // must have the same global shape, except step (one element).
  std::array<std::shared_ptr<const slice::TensorLayout>, kNumTargetStates> states;
  std::array<DType, kNumTargetStates> dtypes{};        // each state's dtype in the source
  std::array<std::string, kNumTargetStates> keys;      // each state's source key (ucp_info.json)
  std::vector<HyperParam> hyper;  // the param group's hyper-parameters, in source field order
  // The source's param group (numbered in the order the source lists them), or -1 when unknown.
  // Parameters of different source groups stay in different optim.pt groups even when their
  // hyper-parameters are identical (the Hugging Face Trainer's decay / no-decay groups with
  // weight_decay 0: its optimizer has two groups, and load_state_dict needs two).
  int group = -1;
  // The step when the source stored it as a Python int or float (states[kStep] is then null).
  std::optional<double> step_value;
  // A fused parameter whose weight the source stores split under other names (FusedParam):
  // the fused one (moments and step, no weight) is in optim.pt only, each split weight in
  // model.pt only. Everything else is in both.
  bool in_model = true;
  bool in_optimizer = true;
  // Values model.pt holds right after this parameter, each named as the parameter's local name
  // with its last component replaced by `first` (Megatron-Core's `_extra_state` of a linear
  // layer, None for its local modules, which load_state_dict(strict=True) expects). Not in
  // model.safetensors (no tensors) nor optim.pt. A tied parameter's (PpPlacement::kTiedFirstLast:
  // Megatron's word embeddings) are its output layer's: on the last stage only, under
  // `output_layer.`, as GPTModel with shared embeddings holds them.
  std::vector<std::pair<std::string, format::SaveValue>> model_siblings;
};

// A parameter the optimizer holds fused while the model's state_dict saves its weight split
// (torchtitan's FusedQKVLinear: optimizer state under `qkv_linear.wqkv.weight`, weights as
// `qkv_linear.wq|wk|wv.weight`). Listed in status.json and inspect as `fused_params`. model.pt
// holds the split weights, optim.pt the fused state (what the model and its optimizer load);
// atomic/ serves the moments split under the model's names when the interleave is known
// (layout::FusedQkvOf: the head dimension, from the user), else each side under its own names.
struct FusedParam {
  std::string param;                   // the optimizer's name (moments and step)
  std::vector<std::string> stored_as;  // the model's names (weights), in source order
  int64_t rows = 0;                    // the fused state's dim-0 size
  std::vector<int64_t> stored_rows;    // each stored_as weight's dim-0 size
  // What status.json and inspect say about it (index::FusedNote): how it is served, or which
  // fact is missing for atomic/ to serve it under one name.
  std::string note;
};

// How each parameter is split, from the one pattern source: layout::PatternFor (the rules,
// then the preset), and the source geometry (PatternFromGeometry) where nothing matches. Target
// views and atomic files' cat_dim both come from here.
struct PatternParam {
  std::string name;
  std::vector<int64_t> shape;
  std::optional<int> shard_dim;  // ShardDim of the source layout
};
struct ModelPatterns {
  layout::Preset preset = layout::Preset::kAuto;  // the one used (kAuto resolved)
  layout::ModelInfo info;
  std::vector<layout::ParamPattern> patterns;  // per param
};
// `vocab_size` overrides ModelInfo::vocab_size (a source that records its unpadded vocabulary);
// then `facts` (what the source records about its model: layout::ApplyModelFacts).
// Errors: PatternFor's (a rule that does not fit a parameter's shape), naming the parameter.
Result<ModelPatterns> PatternsOf(const std::vector<PatternParam>& params, layout::Preset preset,
                                 const std::vector<layout::Rule>& rules, std::optional<int64_t> vocab_size,
                                 const layout::ModelInfo& facts = {});

struct TargetInput {
  std::vector<TargetParam> params;  // in the source's parameter order
  std::shared_ptr<const std::vector<std::shared_ptr<const ByteSource>>> files;  // fragment file ids
  layout::Preset preset = layout::Preset::kAuto;  // kAuto: DetectPreset over the names
  std::vector<layout::Rule> rules;                // user pattern rules, then the source's own
  std::optional<int64_t> vocab_size;              // the source's unpadded vocabulary, if recorded
  layout::ModelInfo model_facts;                  // what the source records about its model
  std::optional<std::vector<int>> pp_split;       // --pp-split: layers per stage
  std::vector<ExtraItem> extras;       // served in extra_state.pt, in source order
  std::vector<NotServed> not_served;   // items no layout serves
  std::vector<FusedParam> fused;       // see FusedParam
};

struct RankFiles {
  std::shared_ptr<const ByteSource> model;  // model.pt
  // model.safetensors: model.pt's tensors as safetensors.torch.save_file writes them
  // (metadata {"format": "pt"}); null when safetensors cannot hold one of them (a dtype with no
  // safetensors name, e.g. complex32; a name that is not UTF-8 or is "__metadata__").
  std::shared_ptr<const ByteSource> model_safetensors;
  // Why model_safetensors is null when it was wanted and the rank has weights (served as
  // rank_N/model.safetensors.error by a mount); empty otherwise.
  std::string model_safetensors_refused;
  std::shared_ptr<const ByteSource> optim;  // optim.pt; null when the source has no optimizer state
  std::shared_ptr<const ByteSource> info;   // ucp_info.json
  std::shared_ptr<const ByteSource> extra;  // extra_state.pt; null when the rank gets no extra item
};

// Which of a rank's files TargetPlan::Build makes; the others are left null. A file's bytes do
// not depend on which others are made with it. Errors of the input (slices, dtypes) are
// returned whatever is chosen; a file's own (LazyTorchFile::Build's) only when it is made.
struct RankFileSet {
  bool model = true;
  bool model_safetensors = true;
  bool optim = true;
  bool extra = true;
  bool info = true;
};

struct RankParts;  // target.cc: what the ranks of one (tp, pp, ep) coordinate are made from

// The per-layout work done once (preset, model info, patterns, stage bounds), so that the
// files of many ranks are built without repeating it. Keeps `input` alive.
class TargetPlan {
 public:
  // Errors (kInvalidArgument naming the layout or the parameter): no parameter; a layout the
  // model refuses (CheckLayoutForModel, PipelineSplit); a rule that does not fit a parameter's
  // shape; a pattern that conflicts with the source geometry (CheckGeometry); states of one
  // parameter with different shapes.
  static Result<TargetPlan> Make(std::shared_ptr<const TargetInput> input, layout::Layout layout);

  // The files of `rank` (0 <= rank < World(), else kInvalidArgument), those in `want` (a file
  // the rank does not have stays null either way). Errors: those of TargetSlice and LocalLayout
  // naming the parameter; kUnsupported when a stored dtype cannot be converted to the file's
  // dtype; LazyTorchFile::Build's.
  Result<RankFiles> Build(int rank, const RankFileSet& want = {}) const;

  // Whether the data-parallel replicas of one (tp, pp, ep) coordinate have the same files (the
  // same bytes in model.pt, model.safetensors, optim.pt and extra_state.pt) and ucp_info.json
  // files that differ only in "rank" and the "dp" coordinate: no ZeRO partitioning and no
  // rank-local extra state. A mount then sizes a replica's files without building them.
  bool ReplicasAlike() const;
  // The size of replica (rank, dp)'s ucp_info.json, from that of replica (first_rank, first_dp)
  // of the same (tp, pp, ep), when ReplicasAlike(): the two differ only in those numbers.
  static uint64_t ReplicaInfoBytes(uint64_t first_info_bytes, int first_rank, int first_dp, int rank, int dp);

  const layout::Layout& layout() const { return layout_; }
  layout::Preset preset() const { return preset_; }
  const std::vector<layout::ParamPattern>& patterns() const { return patterns_; }

 private:
  std::shared_ptr<const TargetInput> input_;
  layout::Layout layout_;
  layout::Preset preset_ = layout::Preset::kAuto;
  std::vector<int> stage_bounds_;
  std::vector<layout::ParamPattern> patterns_;  // per input param
  bool has_optim_ = false;
  // ZeRO layouts: what every data-parallel rank of one (tp, pp, ep) shares (the held parameters'
  // local layouts, the flat group), made by the first Build of that coordinate and kept for the
  // plan's life, so a layout of thousands of ZeRO ranks slices each parameter once (target.cc).
  struct SharedRankParts;
  std::shared_ptr<SharedRankParts> shared_parts_;
  // The parts of the ranks at `coords`: shared_parts_'s when kept, else made for this call.
  Result<std::shared_ptr<const RankParts>> PartsOf(const layout::RankCoords& coords) const;
};

// One-shot convenience: TargetPlan::Make(input, layout) then Build(rank).
Result<RankFiles> BuildRankFiles(std::shared_ptr<const TargetInput> input,
                                 const layout::Layout& layout, int rank);

}  // namespace ucpfs::views
