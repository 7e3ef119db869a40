// What the views are built from, derived from an indexed checkpoint; shared by the mount
// (views/mount_views) and `ucpfs convert`, so both serve exactly the same files:
//  - the atomic files (views/atomic.h) of every mapped parameter;
//  - the input of target views (views/target.h): each mapped parameter's tensor states and
//    step (a tensor, or a Python int/float), the optimizer hyper-parameters (torchtitan's
//    `optimizer.param_groups.<fqn>.<field>`, or DCP's flattening of get_optimizer_state_dict,
//    `optimizer.param_groups.<i>.<field>` with `.params` naming the group's parameters), and
//    every other non-parameter item: decoded as extra state (extra_state.pt), or reported in
//    TargetInput::not_served with the reason (not plain data, too large, optimizer state of no
//    weight, hyper-parameters of a group whose parameters cannot be named).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/io/lazy_file_source.h"
#include "core/layout/patterns.h"
#include "core/status.h"
#include "fs/namespace.h"
#include "views/target.h"
#include "index/checkpoint.h"
#include "index/file_table.h"
#include "index/key_map.h"

namespace ucpfs::index {

// `item`'s tensor layout for a view to keep: the checkpoint's own, kept alive by `owner` (the
// snapshot holding the checkpoint), so a mount holds one copy of each layout; a copy when there
// is no owner (a checkpoint that outlives the view, as in the unit tests).
std::shared_ptr<const slice::TensorLayout> KeptLayout(const Item& item, const std::shared_ptr<const void>& owner);

// Reads and decodes the non-tensor items (small blobs; tensor bytes stay lazy). The tensor
// states are `checkpoint`'s layouts, kept alive by `owner` (KeptLayout). `warn` receives one
// line per item that is not served, with the reason (also in TargetInput::not_served).
// Errors: none today beyond allocation; bad items are reported, not fatal.
Result<std::shared_ptr<views::TargetInput>> MakeTargetInput(
    const Checkpoint& checkpoint, const std::shared_ptr<const void>& owner, const KeyMapping& mapping,
    const FileTable& files, const std::function<void(const std::string&)>& warn);

// One atomic file: `atomic/<dir>/<file>`, sized and checked at once, built when it is read.
struct AtomicView {
  std::string dir;   // views::AtomicDirName(param)
  std::string file;  // "fp32.pt" (the fp32 master, else the weight), "exp_avg.pt", "exp_avg_sq.pt",
                     // "step.pt" (the optimizer step as saved: a tensor or a number)
  uint64_t n_bytes = 0;  // the file's exact size
  // Builds the file (a lazy torch.save file of n_bytes; deterministic), for fs::BuiltOnOpen.
  // Holding only this between opens, a mount keeps a few hundred bytes an atomic file rather
  // than its zip headers, pickle and copy plans (about 5 KB).
  fs::Builder build;
};

// What decides how parameters are split (views::PatternsOf), for the atomic files' cat_dim and
// the target views alike.
struct PatternOptions {
  layout::Preset preset = layout::Preset::kAuto;
  std::vector<layout::Rule> rules;  // the user's rules, then the checkpoint's own
  std::optional<int64_t> vocab_size;  // the checkpoint's unpadded vocabulary, when recorded
  // What the checkpoint records about its model (Megatron-LM args), then what the user gave.
  layout::ModelInfo model_facts;
};

// The user's preset and rules, then the patterns the checkpoint records itself (DeepSpeed's
// universal_checkpoint_info: universal_view.h, SourceRules) and its unpadded vocabulary;
// `vocab_pad_multiple` (--make-vocab-size-divisible-by; 0: not given) replaces the checkpoint's
// make_vocab_size_divisible_by.
// Errors: kCorrupt when the checkpoint's own patterns do not compile (names the file).
// `user_facts` (the rules file's "model" and --hf-config's heads: ViewOptions::model_facts) replace
// the checkpoint's own where given (layout::ApplyModelFacts).
Result<PatternOptions> PatternOptionsFor(const Checkpoint& checkpoint, layout::Preset preset,
                                         std::vector<layout::Rule> user_rules, int64_t vocab_pad_multiple = 0,
                                         const layout::ModelInfo& user_facts = {});

// Sets what decides the target views' splits on `input`: the preset, rules, unpadded vocabulary
// and model facts of `patterns`, and the pipeline split (--pp-split; none: even).
void ApplyPatterns(views::TargetInput& input, const PatternOptions& patterns, std::optional<std::vector<int>> pp_split);

// The atomic files of every mapped parameter, in parameter order; cat_dim and vocab_tensor from
// the parameter's pattern. The files' builders keep `checkpoint`'s tensor layouts (KeptLayout,
// `owner`). Errors: kUnsupported when a stored dtype cannot be converted to fp32 (names the
// file); a rule that does not fit a parameter (views::PatternsOf).
Result<std::vector<AtomicView>> BuildAtomicViews(const Checkpoint& checkpoint, const std::shared_ptr<const void>& owner,
                                                 const KeyMapping& mapping, const FileTable& files,
                                                 const PatternOptions& patterns);

}  // namespace ucpfs::index
