// Scanner: one per source format, behind one interface, each turning a checkpoint directory into
// an index::Checkpoint with the shared CheckpointBuilder (checkpoint_builder.h). The directory is
// a SourceTree (core/io/source_tree.h): scanners list, stat and open the source only through it,
// so a local directory and an object store scan alike. Each format's functions (ScanDcp, ...)
// also take a path: a LocalTree over it, for tests and tools. The registry
// (Scanners) lists them in the order they are tried; ScannerFor picks the first that recognises
// a directory.
//
// Formats: "dcp" (PyTorch DCP, torch 1.13 and 2.x, Megatron-Core torch_dist; dcp_scan.h),
// "deepspeed" (a DeepSpeed save directory or one tag of it; deepspeed_scan.h), "megatron"
// (a Megatron-LM legacy `--ckpt-format torch` save directory or one iteration of it;
// megatron_scan.h), "torch_state" (torch.save training state with a positional optimizer: a
// Hugging Face Trainer checkpoint-N/, a Lightning .ckpt, a script's model.pt + optim.pt;
// torch_state_scan.h) and "weights" (Hugging Face safetensors or a torch.save state dict, no
// optimizer state; weights_scan.h), tried in that order.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "core/io/source_tree.h"
#include "core/status.h"
#include "index/checkpoint.h"

namespace ucpfs::index {

// Progress callback: (items done, items total). Called from the scanning thread.
using ScanProgress = std::function<void(uint64_t done, uint64_t total)>;

class Scanner {
 public:
  virtual ~Scanner() = default;
  // The format's name, as in Checkpoint::format.
  virtual std::string_view Name() const = 0;
  // Whether the tree's root looks like this format. Cheap: it looks at names and small marker
  // files only.
  virtual bool Recognizes(const SourceTree& tree) const = 0;
  // Errors: the format's own (kNotFound, kCorrupt, kUnsupported, ...), naming the file.
  virtual Result<Checkpoint> Scan(const SourceTree& tree, const ScanProgress& progress) const = 0;
};

// Every format, in the order they are tried.
std::span<const Scanner* const> Scanners();

// The scanner of the tree. Errors: kNotFound naming the directory and what was looked for.
Result<const Scanner*> ScannerFor(const SourceTree& tree);

// ScannerFor(tree)->Scan(tree, progress).
Result<Checkpoint> ScanCheckpoint(const SourceTree& tree, const ScanProgress& progress = nullptr);

}  // namespace ucpfs::index
