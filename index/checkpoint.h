// The scanned model of a checkpoint: its files and its items (tensors with their fragments,
// and opaque byte items), as scanners produce it and the LMDB catalog stores it.
//
// Not for: deciding what a key means (key_map.h) or serving reads (core/slice, fs/).
// Invariants: every Fragment::file_id and Item::file_id indexes `files`; items keep the
// source's order (DCP: the order of state_dict_metadata, i.e. the saved state dict's order);
// tensor layouts passed ValidateCoverage (replicas already removed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/io/file_source.h"
#include "core/slice/slice.h"
#include "index/source_facts.h"

namespace ucpfs::index {

struct SourceFile {
  std::string rel_path;  // relative to the checkpoint directory
  uint64_t n_bytes = 0;
  int64_t mtime_ns = 0;
  // Identity at index time beyond size and mtime (checked before any byte is served).
  uint64_t dev = 0;
  uint64_t ino = 0;
  int64_t ctime_ns = 0;

  FileIdentity Identity() const { return {dev, ino, n_bytes, mtime_ns, ctime_ns}; }
};

enum class ItemKind : uint8_t { kTensor = 0, kBytes = 1 };

struct Item {
  std::string key;  // the source's key, e.g. DCP fqn "layers.0.attention.wq.weight"
  ItemKind kind = ItemKind::kTensor;
  // kTensor: the tensor's dtype (from the metadata) and layout (global shape + fragments).
  DType dtype = DType::kFloat32;
  slice::TensorLayout layout;
  // kBytes: the serialized object (for DCP a torch.save blob) lies here.
  uint32_t file_id = 0;
  uint64_t byte_offset = 0;
  uint64_t n_bytes = 0;
  // kTensor: the scanner read it from the model's own state dict (a parameter or buffer, e.g.
  // DeepSpeed's `module`), so its key is the model's name for it whatever that name looks like;
  // the key mapper takes such a tensor that no rule maps as that name's weight.
  bool model_tensor = false;
};

// A relative path that stays inside the checkpoint directory: not empty, not absolute, no NUL
// and no ".." component.
bool SafeRelativePath(const std::string& p);

struct Checkpoint {
  // Display text only (status, inspect): the scanner's name, e.g. "dcp", and its variant, e.g.
  // "torch-2.x". What the views need to know is in `facts`.
  std::string format;
  std::string flavor;
  // What the scanner knows beyond files and items, typed (source_facts.h).
  SourceFacts facts;
  std::vector<SourceFile> files;
  std::vector<Item> items;
  // Copies the scanner did not read because another tp rank's copy of the same tensor is used
  // (DeepSpeed and Megatron-LM tp-replicated module tensors, e.g. layer norms of tp ranks > 0):
  // each an item with the key of the item it repeats, as stored. `ucpfs verify` compares them
  // (CheckTpReplicas); not stored in the index (empty in a checkpoint loaded from one).
  std::vector<Item> replicas;
};

}  // namespace ucpfs::index
