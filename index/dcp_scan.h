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

#include <string>
#include <vector>

#include "core/status.h"
#include "index/checkpoint.h"
#include "index/scanner.h"

namespace ucpfs::index {

// True when `dir` holds `.metadata` or any `__<r>.metadata` (DCP), possibly with
// metadata.json (Megatron torch_dist).
bool IsDcpDirectory(const std::string& dir);

// The parts, by name, when `dir` is not a DCP directory itself but one checkpoint saved as
// several (2 to 16; else empty):
// its real subdirectories that are DCP directories have pairwise disjoint keys (Accelerate's
// save_state folder: `pytorch_model_fsdp_0/` for the model, `optimizer_0/` for the optimizer).
// Reads their metadata (each file at most 64 MiB). Subdirectories repeating keys are a run of
// checkpoints (run_dir.h), not one. ScanDcp scans such a directory as one checkpoint whose file
// paths name the part (`optimizer_0/__0_0.distcp`).
std::vector<std::string> DcpCompositeParts(const std::string& dir);

// Scans `dir`. Errors: kNotFound (no metadata), kCorrupt (metadata or blob malformed, a chunk
// whose stored shape disagrees with the metadata, coverage gaps/overlaps), kUnsupported.
Result<Checkpoint> ScanDcp(const std::string& dir, const ScanProgress& progress = nullptr);

}  // namespace ucpfs::index
