// Weights-only sources: a directory holding plain model weights, as Hugging Face, Meta and
// users save them, with no sharding metadata (every tensor is whole):
//   - safetensors: `model.safetensors.index.json` naming the shard of every tensor
//     (`model-0000K-of-0000N.safetensors`), else every `*.safetensors` file of the directory
//     (a single `model.safetensors`, or several with distinct tensor names);
//   - torch.save: `pytorch_model.bin.index.json` with `pytorch_model-0000K-of-0000N.bin` shards,
//     else `pytorch_model.bin` (beside what a Hugging Face Trainer saves: optimizer.pt,
//     training_args.bin...), else the directory's one torch.save file (`*.pt`, `*.pth`, `*.bin`:
//     `consolidated.00.pth`, a `.pt` state dict).
// Every tensor becomes a weight item keyed by its state-dict name (a torch file's nested dicts
// are joined with '.'); key mapping takes the names as they are (Checkpoint::format "weights",
// key_map.h). A torch file whose top level holds no tensor but a dict under "state_dict",
// "model_state_dict", "model" or "module" (the first present) is that dict's state dict
// (Lightning, training scripts); tensors elsewhere in it (an optimizer's) and non-tensor values
// are not served (counted in WeightsSourceFacts::skipped_values).
//
// Checkpoint::facts: WeightsSourceFacts (source_facts.h): the container, the files, the values
// not served and the wrapper key.
//
// Untrusted input: the safetensors reader distrusts every header (core/format/safetensors.h),
// an index must name files inside the directory (never through a symlink) and agree with them
// exactly (every tensor of a listed file in the weight map, every weight-map entry in its file),
// and a tensor name appears once. Errors: kNotFound (no weights), kCorrupt naming the file and
// the tensor, kUnsupported (several torch files without an index, compressed records...).
#pragma once

#include <set>
#include <string>
#include <vector>

#include "core/status.h"
#include "index/checkpoint.h"
#include "index/checkpoint_builder.h"
#include "index/scanner.h"

namespace ucpfs::index {

// True when `dir` holds (regular files, not symlinks) a weights index, a `*.safetensors` file,
// or a torch.save candidate (`*.pt`, `*.pth`, `*.bin`; ScanWeights refuses several without an
// index). Tried after every other format, whose directories may hold such files too.
bool IsWeightsDirectory(const SourceTree& tree);

// The regular files of `rel_dir` of the tree (no symlinks, no hidden names), sorted; at most
// 100000.
std::vector<std::string> RegularFileNames(const SourceTree& tree, const std::string& rel_dir);

Result<Checkpoint> ScanWeights(const SourceTree& tree, const ScanProgress& progress = nullptr);

// The weights of one directory, read as ScanWeights reads them, into another scanner's builder
// (torch_state_scan.h: the weights beside an optimizer's state).
struct WeightsOptions {
  std::string sub_dir;            // relative to the builder's directory; "" for itself
  std::string key_prefix;         // put before every tensor's state-dict name in its item key
  std::set<std::string> exclude;  // torch files of sub_dir that are not weights (an optimizer's)
};
struct WeightsFound {
  std::string container;        // "safetensors" or "torch"
  uint64_t skipped_values = 0;  // torch: values not served
  std::string state_dict_key;   // torch: the wrapper key, if any
};
// Errors: those of ScanWeights.
Result<WeightsFound> AddWeights(CheckpointBuilder& builder, const WeightsOptions& options,
                                const ScanProgress& progress = nullptr);

}  // namespace ucpfs::index
