// CheckpointBuilder: what every Scanner shares while it turns a source directory (a SourceTree)
// into a Checkpoint: the file table (each file opened once through the tree, without following a
// symlink, its identity recorded, then read through a bounded descriptor cache), torch.save files opened for their
// tensors, and the finishing of each tensor item (coverage exactly once; replicas, i.e. the same
// box stored twice, must hold equal bytes and only the first is kept).
//
// Not for: any one format's naming or metadata (the scanners).
// Errors name the file (and the item, where there is one).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/format/torch_file.h"
#include "core/io/lazy_file_source.h"
#include "core/io/source_tree.h"
#include "core/status.h"
#include "index/checkpoint.h"

namespace ucpfs::index {

class CheckpointBuilder {
 public:
  // `tree` must outlive the builder.
  explicit CheckpointBuilder(const SourceTree& tree) : tree_(tree) {}

  // The tree's root, for messages.
  const std::string& dir() const { return tree_.Root(); }
  const SourceTree& tree() const { return tree_; }
  Checkpoint& checkpoint() { return ckpt_; }

  // Registers (once) and opens `rel_path` (relative to the tree, checked by SafeRelativePath and
  // SafeTreePath) and returns its file id. Errors: kCorrupt when the path leaves the directory;
  // kNotFound when missing; kInvalidArgument for a symlink or a special file (SourceTree::Open);
  // kIo.
  Result<uint32_t> AddFile(const std::string& rel_path);
  const std::shared_ptr<const ByteSource>& source(uint32_t file_id) const { return sources_.at(file_id); }
  const std::vector<std::shared_ptr<const ByteSource>>& sources() const { return sources_; }

  // The whole file `file_id` as a torch.save archive. Errors: those of TorchFile::Open.
  Result<format::TorchFile> OpenTorchFile(uint32_t file_id) const;

  // Checks that the item's fragments cover its shape exactly once, comparing and dropping
  // replicas. Errors: kCorrupt naming `where` and the item.
  Status FinishTensor(Item& item, const std::string& where);

  // A tensor item `key` stored whole in file `file_id` at [byte_offset, ...) as `dtype` with
  // `shape`, row-major unless `strides` (in elements) are given: one fragment covering it (none
  // when it has no elements).
  static Item WholeTensor(std::string key, DType dtype, std::vector<int64_t> shape, uint32_t file_id,
                          uint64_t byte_offset, std::vector<int64_t> strides = {});

  // Appends an item (in source order) and returns the checkpoint when done.
  void AddItem(Item item) { ckpt_.items.push_back(std::move(item)); }
  // Records a tp-replicated copy that is not read (Checkpoint::replicas).
  void AddReplica(Item item) { ckpt_.replicas.push_back(std::move(item)); }
  Checkpoint Take() { return std::move(ckpt_); }

 private:
  Status DropReplicas(Item& item, const std::vector<std::pair<size_t, size_t>>& replicas);

  const SourceTree& tree_;
  Checkpoint ckpt_;
  std::vector<std::shared_ptr<const ByteSource>> sources_;  // by file id
  std::shared_ptr<FdCache> fd_cache_ = std::make_shared<FdCache>(FdCache::DefaultCapacity());
  std::map<std::string, uint32_t> file_ids_;  // rel_path -> file id
};

// Checks that fragments `a` and `b` of `item`, which cover the same box, hold equal data (read
// through `sources`, by file id). Errors: kCorrupt naming both files, the item and the box;
// the sources' read errors.
Status CompareReplicaFragments(const Item& item, const slice::Fragment& a, const slice::Fragment& b,
                               const std::vector<std::shared_ptr<const ByteSource>>& sources);

// Compares every copy in `checkpoint.replicas` with the item of the same key: each fragment of
// the copy with the item's fragment of the same box. Returns one kCorrupt per copy that
// differs (naming its file), or the read error; `compared` (when given) counts the fragments
// compared. A copy whose item is missing or split otherwise is reported as kCorrupt too.
std::vector<Status> CheckTpReplicas(const Checkpoint& checkpoint,
                                    const std::vector<std::shared_ptr<const ByteSource>>& sources,
                                    uint64_t* compared = nullptr);

// Where one tensor-parallel rank's slice of a parameter lies in the global tensor (the DeepSpeed
// and Megatron-LM scanners place each rank's stored tensor with it).
struct Placement {
  std::vector<int64_t> global_shape;
  // Global boxes, in local order; their concatenation along dim 0 (or, for a single box, the
  // box itself) is the local tensor. Empty: the local tensor is the whole global tensor.
  std::vector<slice::Box> pieces;
  bool skip = false;  // a replica of tp rank 0's (tp-replicated): not read
  bool skip_holds_copy = true;  // with skip: the same values as tp rank 0's (false: partial values)
};

// Appends the global fragments of local elements [lo, hi), stored contiguously at byte_offset
// of file_id, to `out`.
void PlaceRange(const Placement& pl, uint64_t lo, uint64_t hi, uint32_t file_id, uint64_t byte_offset, DType dtype,
                std::vector<slice::Fragment>* out);

// The item `key` (dtype and global shape of `pl`) holding stored tensor `rec` of file_id where
// `pl` places it. A non-contiguous tensor is kept with its strides when it is the whole tensor.
// Errors: kUnsupported, naming `where` and the record, for a non-contiguous slice.
Result<Item> PlacedItem(const Placement& pl, const std::string& key, const format::TensorRecord& rec,
                        uint32_t file_id, const std::string& where);

// Merges the tensor-parallel slices of each item, as the scanners of per-rank files read them:
// an item's first slice starts it, a later tp rank's slice adds its fragments (the shapes must
// agree), a 0-d item (a step) is kept once. A slice from a tp rank that already gave one (a
// later pipeline stage's copy of tied weights) is skipped, or, with `repeat_is_error`, kCorrupt.
class TpSliceMerger {
 public:
  explicit TpSliceMerger(bool repeat_is_error) : repeat_is_error_(repeat_is_error) {}
  // Errors: kCorrupt naming `where` and the item.
  Status Add(Item item, int tp_rank, const std::string& where);
  std::vector<Item>& items() { return merged_; }  // in first-seen order

 private:
  bool repeat_is_error_;
  std::vector<Item> merged_;
  std::map<std::string, size_t> index_;
  std::set<std::pair<std::string, int>> contributed_;  // (item key, tp rank) added
};

// Folds the tp ranks' whole copies of an averaged tensor (DeepSpeed's
// parameter_to_average_patterns) into fragments whose value is their mean (Fragment::mean_with):
// `item` holds n_copies copies, each flat ranges of the whole tensor covering it once, added in
// tp order (TpSliceMerger); the result cuts them at every copy's range boundary, keeps tp rank
// 0's bytes and lists the others' in tp order. Errors: kUnsupported naming `where` and the item
// (a copy not made of flat ranges of the whole tensor, or not n_copies of them).
Status FoldTpMean(Item& item, int n_copies, const std::string& where);

// "[1, 2, 3]" for messages.
std::string JoinInts(const std::vector<int64_t>& v);

}  // namespace ucpfs::index
