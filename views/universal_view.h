// The universal view of a DeepSpeed checkpoint: `<tag>_universal/`, holding what DeepSpeed's
// `ds_to_universal` writes for the same tag (docs/formats.md "The universal checkpoint"), so that
// an engine with `checkpoint.load_universal` resumes from the mount on any data-parallel size:
//   zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt  the consolidated states, as ds_to_universal
//       pickles them. ZeRO-1/2 and BF16_Optimizer: a dict {[cat_dim], [param_n_sub_params],
//       [sub_param_shape], [vocab_tensor], 'param'} by the checkpoint's universal_checkpoint_info
//       (deepspeed_patterns.h; tp-replicated or averaged: no keys; two sub-parameters: cat_dim 0
//       and param_n_sub_params 2; sub-parameter shapes: DeepSpeed's SubparamShape object;
//       row-parallel: cat_dim 1; otherwise cat_dim 0; vocabulary parameters stripped to
//       original_vocab_size rows and marked vocab_tensor), the whole tensor-parallel tensor the
//       scanner assembled from every tp rank and pipeline stage, in its stored dtype, fp32 with
//       requires_grad=True. ZeRO-3: the bare flat tensor (ds_to_universal's stage-3 output).
//   zero/<param>/step.pt   the param group's step (ZeRO-1/2, BF16_Optimizer; a tensor step)
//   zero/<param>/fp32.pt   also for module tensors without optimizer state: {'param': fp32}
//   zero/optimizer_state.pt  dp rank 0's optimizer_state_dict without its partitions, plus
//       'param_groups' (ZeRO-3: the whole dict, partitions included), re-emitted as pickled
//       (DeepSpeed's LossScaler and ZeroStageEnum objects stay objects)
//   <model states files>   the tag's mp_rank_* files of every tp rank and pipeline stage (ZeRO-3:
//       every *model_states.pt), as is; pipeline layer files are not copied (nor by ds_to_universal).
// Every file is lazy: sizes and headers from the index and rank 0's optimizer pickle; tensor
// bytes gathered from the partitions when read.
//
// Not for: MoE/AutoEP experts, an `affine_map` (kUnsupported naming the parameter), Python-number
// steps (step.pt is served only for a tensor step). Module tensors without optimizer state at
// tp > 1 are served whole, where ds_to_universal writes tp rank 0's slice (equal for replicated
// buffers).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/format/torch_writer.h"
#include "core/layout/patterns.h"
#include "core/status.h"
#include "fs/namespace.h"
#include "index/checkpoint.h"
#include "index/key_map.h"
#include "views/view_inputs.h"

namespace ucpfs::index {

struct UniversalFile {
  std::string rel_path;  // under the universal directory, e.g. "zero/<param>/fp32.pt"
  // A virtual file: its exact size, and its builder (deterministic; the mount builds it again
  // when it is opened, so the tree keeps the file's object, not its zip headers and pickle).
  uint64_t n_bytes = 0;
  fs::Builder build;       // for fs::BuiltOnOpen; null for a checkpoint file:
  std::string source_rel;  // that file, relative to the checkpoint, served as is
};

struct UniversalView {
  std::string dir;               // "<tag>_universal"
  std::string latest_universal;  // the content of `latest_universal` ("" when no `latest`)
  std::vector<UniversalFile> files;
};

// The split patterns a checkpoint records itself, as layout rules for views::PatternsOf (after
// the user's): DeepSpeed's universal_checkpoint_info tp-replicated (replicate), averaged
// (partial), vocabulary (vocab, with original_vocab_size) and row-parallel (row) patterns, in
// that order, matched as Python's re.match does (deepspeed_patterns.h), after its
// parameter_with_sub_params parameters (column, split per sub-parameter); two-sub-parameter
// patterns are left to the presets (their sizes depend on each shape); Megatron-DeepSpeed's args
// (client state), as below. Megatron-Core torch_dist: no rules; the vocabulary size,
// make_vocab_size_divisible_by, attention heads, query groups and head size of its args
// (common.pt), where recorded. Empty for other formats.
struct SourcePatterns {
  std::vector<layout::Rule> rules;
  std::optional<int64_t> vocab_size;
  layout::ModelInfo model_facts;  // Megatron's args (layout::ApplyModelFacts)
};
Result<SourcePatterns> SourcePatternsOf(const Checkpoint& checkpoint);

// The optimizer param groups of a "deepspeed" checkpoint, for target views' optim.pt: each
// group's hyper-parameters (base_optimizer_state.param_groups of the (mp 0, dp 0) optimizer file,
// ZeRO-3: its optimizer_state_dict.param_groups; 'params' left out, decoded as plain values) and
// the names of its parameters (the union, in order, of group i of every model-states file's
// param_shapes; ZeRO-3: of the sub-groups the group's 'params' number, as DeepSpeed's stage 3
// saves each group's flat sub-group partitions). Empty for other formats.
// Errors: kCorrupt naming the file (no param_groups, param_shapes of another group count, a
// ZeRO-3 sub-group in no group, in two, or missing).
struct DeepSpeedParamGroup {
  std::vector<std::string> params;
  std::vector<std::pair<std::string, format::SaveValue>> fields;
};
Result<std::vector<DeepSpeedParamGroup>> DeepSpeedParamGroups(const Checkpoint& checkpoint, const FileTable& files);

// The key of the param groups DeepSpeedParamGroups reads, for the not-served entry naming them:
// "optimizer_state_dict.base_optimizer_state.param_groups", or ZeRO-3's
// "optimizer_state_dict.optimizer_state_dict.param_groups" (the former when the facts are
// not DeepSpeed's).
std::string DeepSpeedParamGroupsKey(const Checkpoint& checkpoint);

// The universal view of a "deepspeed" checkpoint; nullopt for other formats. `source_name` is
// the mounted directory's name, used as the tag when the directory is itself the tag. The
// files' builders keep `checkpoint`'s tensor layouts (KeptLayout, `owner`).
// Errors: kUnsupported (see above), kCorrupt (the facts or rank 0's optimizer file are not what
// the scanner saw), each naming the file or parameter.
Result<std::optional<UniversalView>> BuildUniversalView(const Checkpoint& checkpoint,
                                                        const std::shared_ptr<const void>& owner,
                                                        const KeyMapping& mapping, const FileTable& files,
                                                        const std::string& source_name);

}  // namespace ucpfs::index
