// DeepSpeed scanner: a DeepSpeed save directory (`latest` naming a tag directory such as
// `global_step3/`) or one tag directory, as the engine writes it (docs/formats.md "DeepSpeed
// save directories"):
// `mp_rank_XX_model_states.pt` per model-parallel rank XX = pp_stage * tp + tp_rank (ZeRO-3:
// `zero_pp_rank_D_mp_rank_00_model_states.pt`), the optimizer partitions
// `[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt` of ZeRO-1/2, BF16_Optimizer and ZeRO-3
// (with sub-groups), fp32, fp16 and bf16, and the pipeline layer files
// `layer_LL-model_TT-model_states.pt` (Megatron-DeepSpeed's PipelineModule).
//
// Degrees: tp and pp from the model states' `checkpoint_parallel_dimensions` when present,
// else (as ds_to_universal) tp = the tp ranks of the layer files and pp = mp ranks / tp, else
// tp = mp ranks and pp = 1; dp = optimizer files per mp rank.
//
// Items (keys the built-in key rules map), each a GLOBAL tensor: every module tensor `<name>`,
// marked Item::model_tensor so buffers and frozen parameters map by name too (ZeRO-1/2 and
// BF16_Optimizer `module`; ZeRO-3: buffers from dp rank 0's `module`, frozen parameters from
// every dp rank's `frozen_param_fragments` partition, as flat ranges; with pipelines the layer files' tensors, named
// "LL.<key>" or "tied_modules.<k>.<key>" as in param_shapes; ZeRO-3 stores only placeholders),
// `optimizer.state.<name>.fp32_param`, `.exp_avg`, `.exp_avg_sq` as flat-range fragments of the
// data-parallel partitions (the ZeRO arithmetic of core/layout/zero.h, cross-checked with the
// files' own param_slice_mappings, partition sizes and paddings: padding never reaches a tensor),
// and `.step` per parameter (its param group's step). With tp > 1 each tp rank's slice is placed
// where ds_to_universal's merge puts it (deepspeed_patterns.h: tp-replicated: rank 0's; row-
// parallel: along dim 1; two sub-parameters and sub-parameter shapes: Shard-NC pieces; otherwise
// along dim 0, vocabulary rows with their padding), through layout::TargetSlice. A parameter on
// several pipeline stages (tied embeddings) is read from the first.
//
// Checkpoint::facts: DeepSpeedSourceFacts (source_facts.h), what the universal view
// (universal_view.h) needs beyond the items: the tag, the ZeRO stage, the degrees, the
// universal_checkpoint_info dict as plain JSON, the model-states files ds_to_universal copies,
// (mp 0, dp 0)'s optimizer file and each param group's step kept as a Python number.
//
// `zero_stage` is read in both pickled forms of ZeroStageEnum (DeepSpeedZeroStage).
//
// Not yet (kUnsupported naming the file or parameter): MoE expert files, tensor- or
// pipeline-parallel ZeRO-3, averaged tensor-parallel slices (parameter_to_average_patterns),
// sub-parameter shapes along a dim other than 0 or with version-0.4 shard widths, a tp > 1
// checkpoint without universal_checkpoint_info. Every other inconsistency (a missing dp or mp
// rank, a partition of the wrong size, shapes or mappings that disagree, tp slices that do not
// make one tensor) is kCorrupt naming the file and the key.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/format/pickle.h"
#include "core/status.h"
#include "index/checkpoint.h"
#include "index/scanner.h"

namespace ucpfs::index {

// True when `dir` holds a regular file `latest`, or `*model_states.pt` files.
bool IsDeepSpeedDirectory(const SourceTree& tree);

// Errors: kNotFound (no tag, no model states), kCorrupt, kUnsupported (see above).
Result<Checkpoint> ScanDeepSpeed(const SourceTree& tree, const ScanProgress& progress = nullptr);

// DeepSpeed's deepspeed.runtime.zero.config.ZeroStageEnum, an (int, Enum) the optimizer files
// pickle as `zero_stage`.
inline constexpr std::string_view kZeroStageEnumModule = "deepspeed.runtime.zero.config";
inline constexpr std::string_view kZeroStageEnumClass = "ZeroStageEnum";

// A pickled zero_stage: a ZeroStageEnum by value (`ZeroStageEnum(1)`) or by name
// (`getattr(ZeroStageEnum, 'optimizer_states')`, as Debian 12's Python 3.11.2 pickles it), or a
// plain int. nullopt for anything else (nothing is resolved or called).
std::optional<int64_t> DeepSpeedZeroStage(const pickle::PickleGraph& g, pickle::NodeId n);

}  // namespace ucpfs::index
