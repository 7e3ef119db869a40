// DCP scanner: reads a PyTorch Distributed Checkpoint directory (torch 1.13
// `_shard.checkpoint`, torch 2.x `distributed.checkpoint` incl. rank-local `__<r>.metadata`,
// Megatron-Core `torch_dist` with metadata.json/common.pt and flattened-range optimizer chunks)
// into an index::Checkpoint, locating every chunk's raw tensor bytes inside its torch.save
// blob. Megatron-Core's layer-stacked tensors are split into one item per layer (and expert),
// named as Megatron's state_dict names them (mcore_unstack.h). Metadata classes are matched by class name, never by module path.
//
// Untrusted input: metadata and blobs go through the safe pickle/zip readers; compressed or
// transformed items (transform_descriptors, safetensors-format DCP) are refused with
// kUnsupported naming the item rather than producing wrong data. Errors name the file.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "index/decoded_items.h"
#include "index/checkpoint.h"
#include "index/key_map.h"
#include "index/scanner.h"
#include "index/file_table.h"

namespace ucpfs::index {

// True when `dir` holds `.metadata` or any `__<r>.metadata` (DCP), possibly with
// metadata.json (Megatron torch_dist).
bool IsDcpDirectory(const SourceTree& tree);

// The parts, by name, when `dir` is not a DCP directory itself but one checkpoint saved as
// several (2 to 16; else empty):
// its real subdirectories that are DCP directories have pairwise disjoint keys (Accelerate's
// save_state folder: `pytorch_model_fsdp_0/` for the model, `optimizer_0/` for the optimizer).
// Reads their metadata (each file at most 64 MiB). Subdirectories repeating keys are a run of
// checkpoints (run_dir.h), not one. ScanDcp scans such a directory as one checkpoint whose file
// paths name the part (`optimizer_0/__0_0.distcp`).
std::vector<std::string> DcpCompositeParts(const SourceTree& tree);

// Scans `dir`. Errors: kNotFound (no metadata), kCorrupt (metadata or blob malformed, a chunk
// whose stored shape disagrees with the metadata, coverage gaps/overlaps), kUnsupported.
Result<Checkpoint> ScanDcp(const SourceTree& tree, const ScanProgress& progress = nullptr);

// What the target views need from a Megatron-Core torch_dist checkpoint beyond its items: the
// optimizer's param groups and step, which Megatron-LM's save keeps in common.pt
// (`optimizer.optimizer.param_groups`: DistributedOptimizer.state_dict() and Float16Optimizer;
// `optimizer.param_groups`: FP32Optimizer; a ChainedOptimizer's under `optimizer.<i>`, MoE's
// expert-parallel groups among them), every field as saved (torch's own: lr, betas, eps,
// weight_decay, amsgrad, ...; Megatron's: wd_mult, lr_mult, max_lr, ...; the distributed
// optimizer's step) but without their parameters (`params` is not persisted). Each mapped
// parameter is put in its group by Megatron's grouping rule (MegatronNoWeightDecay over its name
// and dimensions: the group with wd_mult 0, else the one with another wd_mult; among the
// expert-parallel groups when there are such and its name has an `.experts.` part); a group that
// still lists `params` must list as many as the rule gives it. `step` is the groups' step (one
// for all; the distributed optimizer keeps no per-parameter step). Never guessed: groups that
// differ by more than weight decay and expert parallelism (lr_mult, decoupled lr), two groups of
// one class, a parameter whose class has no group, a count that
// does not fit: their hyper-parameters are left out and the reason is in not_served (the step is
// kept). Empty for other checkpoints and when common.pt holds no param groups (dp_reshardable).
struct MegatronCoreParamGroup {
  std::vector<std::string> params;  // parameter names, in mapping order
  std::vector<HyperParam> fields;
};
struct MegatronCoreOptimizerFacts {
  std::optional<double> step;
  std::vector<MegatronCoreParamGroup> groups;
  std::vector<NotServed> not_served;
};
MegatronCoreOptimizerFacts MegatronCoreOptimizerFactsOf(const Checkpoint& checkpoint, const KeyMapping& mapping,
                                                        const FileTable& files);

}  // namespace ucpfs::index
