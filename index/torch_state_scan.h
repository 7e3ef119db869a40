// torch.save training state with a positional optimizer (format "torch_state"): a directory whose
// torch.save files hold an optimizer's own `optimizer.state_dict()` (a dict of `state` keyed by
// parameter position and `param_groups` listing the positions), found by structure wherever the
// framework nests it, beside the model's weights:
//   - Hugging Face Trainer `checkpoint-N/`: model.safetensors (or pytorch_model.bin, or shards
//     with an index) + optimizer.pt + scheduler.pt (+ trainer_state.json, which names the
//     framework: its decay / no-decay grouping);
//   - PyTorch Lightning: a `.ckpt` (the folder's one, else `last.ckpt`; or any torch file whose
//     top level holds `state_dict` and `optimizer_states`): weights `state_dict.<fqn>`,
//     `optimizer_states[0]`, the rest (`epoch`, `global_step`, `lr_schedulers`, `loops`, ...) as
//     non-parameter state (a `.ckpt` saved with save_weights_only: its weights and that state). The
//     LightningModule's names lose one leading attribute when every
//     weight has the same one (`self.model = ...`: `model.`), so names are those of the wrapped
//     model, whose class the user instantiates; otherwise they are the LightningModule's;
//   - torchtune's checkpointer output_dir: `recipe_state/recipe_state.pt` ({optimizer, seed,
//     epochs_run, ...}) and `epoch_<N>/` (the newest is served: Hugging Face safetensors in
//     torchtune's conversion, whose q_proj / k_proj rows are permuted to Hugging Face's rotary
//     layout; the optimizer's moments of those are placed in the same layout);
//   - a plain training script's files: a state dict (`model.pt`) and `optim.pt` (or any name).
// The positions are matched to the weights' names by the framework's grouping rule and checked
// against every state shape (positional_optim.h). Items are named canonically for key mapping:
// weights `model.<fqn>`, optimizer state `optimizer.state.<fqn>.<field>` (matched) or
// `optimizer.state.ambiguous.<position>.<field>` (not matched: the reason is reported in
// status.json and `ucpfs inspect`, and `--rules` mapping those keys to names settles it), the
// scheduler file `lr_scheduler` (a whole-file blob).
// Directories with no optimizer state dict are left to the weights scanner.
//
// Untrusted input: every file is opened without following a symlink and parsed by the safe
// pickle reader; at most kMaxProbedFiles torch files are probed. Errors name the file.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "index/decoded_items.h"
#include "index/checkpoint.h"
#include "index/key_map.h"
#include "index/scanner.h"
#include "index/file_table.h"

namespace ucpfs::index {

inline constexpr size_t kMaxProbedFiles = 16;

// True when `dir` is torchtune's output_dir, holds a Lightning `.ckpt`, or a torch.save file (`*.pt`, `*.pth`, `*.bin`) whose
// pickle holds an optimizer state dict (probing at most kMaxProbedFiles files).
bool IsTorchStateDirectory(const SourceTree& tree);

// Errors: kNotFound (no optimizer state), kUnsupported (several optimizer files or .ckpt files),
// kCorrupt naming the file; the weights scanner's errors for the weights beside it.
Result<Checkpoint> ScanTorchState(const SourceTree& tree, const ScanProgress& progress = nullptr);

// What the target views need from a "torch_state" checkpoint beyond its items, read again from
// its pickles: each param group's hyper-parameters and parameter names (positions named by the
// scanner's grouping rule, or, where it was ambiguous, by the user's rules for the
// `optimizer.state.ambiguous.<i>.*` keys), the non-parameter state kept inside the optimizer's
// file (Lightning's epoch, global_step, lr_schedulers...), and what is not served, with why.
// Empty for other formats.
struct TorchStateGroup {
  std::vector<std::string> params;
  std::vector<HyperParam> fields;
};
struct TorchStateFacts {
  std::vector<TorchStateGroup> groups;
  std::vector<ExtraItem> extras;
  std::vector<NotServed> not_served;
};
TorchStateFacts TorchStateFactsOf(const Checkpoint& checkpoint, const KeyMapping& mapping, const FileTable& files);

}  // namespace ucpfs::index
