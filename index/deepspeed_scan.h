// DeepSpeed scanner: a DeepSpeed save directory (`latest` naming a tag directory such as
// `global_step3/`) or one tag directory, as the engine writes it (research/deepspeed.md §1, §2):
// `mp_rank_XX_model_states.pt` (ZeRO-3: `zero_pp_rank_D_mp_rank_XX_model_states.pt`) and the
// optimizer partitions `[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt` of ZeRO-1/2,
// BF16_Optimizer and ZeRO-3 (with sub-groups), fp32, fp16 and bf16.
//
// Items (keys the built-in key rules map): every module tensor `<name>` (ZeRO-1/2 and
// BF16_Optimizer; ZeRO-3 stores only placeholders), `optimizer.state.<name>.fp32_param`,
// `.exp_avg`, `.exp_avg_sq` as flat-range fragments of the data-parallel partitions (the ZeRO
// arithmetic of core/layout/zero.h, cross-checked with the files' own param_slice_mappings,
// partition sizes and paddings: padding never reaches a tensor), and `.step` per parameter
// (its param group's step).
//
// Checkpoint::format_info (JSON), what the universal view (universal_view.h) needs beyond the
// items: {"tag": the tag directory ("" when the directory is the tag), "zero_stage": 1, 2, 3 or
// 0 (BF16_Optimizer), "dp": ranks, "universal_checkpoint_info": the model states' dict as plain
// JSON (non-plain values null) or null, "model_files": the model-states files ds_to_universal
// copies (relative paths), "optimizer_file": dp rank 0's optimizer file, "number_steps": per
// param group, its step when kept as a Python number, else null}.
//
// Not yet: tensor- or pipeline-parallel saves (several mp ranks, layer files) and MoE expert
// files are refused with kUnsupported naming the file. Every other inconsistency (a missing dp
// rank, a partition of the wrong size, shapes or mappings that disagree) is kCorrupt naming the
// file and the key.
#pragma once

#include <string>

#include "core/status.h"
#include "index/checkpoint.h"
#include "index/scanner.h"

namespace ucpfs::index {

// True when `dir` holds a regular file `latest`, or `*model_states.pt` files.
bool IsDeepSpeedDirectory(const std::string& dir);

// Errors: kNotFound (no tag, no model states), kCorrupt, kUnsupported (see above).
Result<Checkpoint> ScanDeepSpeed(const std::string& dir, const ScanProgress& progress = nullptr);

}  // namespace ucpfs::index
