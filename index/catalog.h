// The LMDB catalog: stores an index::Checkpoint with a schema version and a fingerprint of the
// source, so an unchanged source reuses its index in milliseconds, a changed one is
// re-indexed, and a corrupt index is rebuilt.
//
// Location: SRC/.ucpfs/ when writable, else $XDG_CACHE_HOME/ucpfs/<hash of SRC path>/ (or
// ~/.cache/...); IndexOptions::index_dir overrides. The index is the single file data.mdb (LMDB,
// MDB_NOSUBDIR | MDB_NOLOCK | MDB_NOTLS), replaced whole by rename when rebuilt, so readers
// (many machines sharing a read-only index too) never write or lock anything; builders
// serialize on a flock of index_dir/lock.
//
// The location is untrusted (a checkpoint may ship its own `.ucpfs/`): the directory and the
// files in it are never reached through a symlink (refused, "not followed"), FIFOs, devices and
// other special files are refused without being opened, a corrupt or crafted data.mdb is
// replaced by a new file (never written in place, so a hard link to a file elsewhere is never
// changed), and nothing there is deleted. A loaded index is checked record by record against
// the real files (ValidateIndexRecords) before it is used.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/status.h"
#include "index/checkpoint.h"
#include "index/dcp_scan.h"

namespace ucpfs::index {

// 2: items of torch 2.x checkpoints in the saved state dict's order (planner_data), not the
// metadata's. 3: source files record device, inode and ctime (checked before serving).
// 4: meta format_info (Checkpoint::format_info). 5: Megatron-Core torch_dist layer-stacked
// tensors indexed as one item per layer (and expert), and its args in format_info. 6: tensor
// items record Item::model_tensor. 7: meta facts (Checkpoint::facts, typed per scanner) in place
// of format_info.
// 8: Megatron args' vocab_size in the facts counts NullTokenizer's EOD row
// (MegatronTokenizerVocab).
// 9: fragments record their averaged copies (Fragment::mean_with: DeepSpeed's
// parameter_to_average_patterns).
// 10: weights facts record the directory's config.json (WeightsSourceFacts::hf_config).
// 11: Megatron-Core args' architecture fields in the facts (the hf/ view's config.json).
// 12: DeepSpeed facts record Megatron-DeepSpeed's args (heads, query groups, vocabulary).
inline constexpr uint32_t kCatalogSchemaVersion = 12;

// xxHash3-64 over the sorted (relative path, size, mtime, ctime, inode) of every regular file
// under `dir` (the index directory `.ucpfs/` excluded; symlinks and special files are not
// followed or opened) and the bytes of its metadata files (`.metadata`, `__*.metadata`,
// `metadata.json`). A file replaced or edited in place changes it, so the index is rebuilt.
// Errors: kNotFound, kIo.
Result<uint64_t> FingerprintSource(const SourceTree& tree);

// Produces the Checkpoint of a source directory given by its path (tests inject their own).
using CheckpointScanner = std::function<Result<Checkpoint>(const std::string& dir,
                                                           const ScanProgress& progress)>;

struct IndexOptions {
  std::string index_dir;      // empty: default location (see above)
  bool read_only = false;     // never write; fail if the index is missing or stale
  ScanProgress progress;      // forwarded to the scanner
  CheckpointScanner scanner;  // empty: ScanCheckpoint (the format registry); tests inject their own
  // What the source is read through (fingerprint, record checks, scan); empty: a LocalTree over
  // the source directory. The index directory is local either way.
  std::shared_ptr<const SourceTree> tree;
};

enum class IndexState { kReused, kBuilt, kRebuiltChanged, kRebuiltCorrupt };
const char* IndexStateName(IndexState state);  // "reused", "built", "rebuilt (source changed)", ...

struct OpenedIndex {
  Checkpoint checkpoint;
  std::string index_dir;   // where the LMDB environment lives
  IndexState state = IndexState::kBuilt;
  uint64_t fingerprint = 0;
  double elapsed_s = 0;    // time spent opening (and building, if it did)
};

// Default index directory for `src_dir` (SRC/.ucpfs when writable, else the cache path).
// May create SRC/.ucpfs (that is how writability is probed: access(2) alone says yes to root
// on a directory it cannot write, e.g. a read-only mount).
std::string DefaultIndexDir(const std::string& src_dir);

// The decision behind DefaultIndexDir with the probe injected: SRC/.ucpfs when
// `can_create_index_dir_in(src_dir)`, else CacheIndexDir(src_dir).
std::string DefaultIndexDirFor(const std::string& src_dir,
                               const std::function<bool(const std::string&)>& can_create_index_dir_in);

// ${XDG_CACHE_HOME:-$HOME/.cache}/ucpfs/<16 hex digits of XXH3-64 of SRC's absolute path>.
std::string CacheIndexDir(const std::string& src_dir);

// Opens the index of `src_dir`, building it (scanning with ScanCheckpoint) when missing, stale or
// corrupt. Errors: those of the scanner; kIo/kNoSpace when the index cannot be written;
// kNotFound / kDataLoss in read_only mode when there is no valid index.
Result<OpenedIndex> OpenOrBuildIndex(const std::string& src_dir, const IndexOptions& options);

// Checks checkpoint records against the real files of `src_dir` (a loaded index before use; the
// DeepSpeed fuzz target checks a fresh scan with it): every path stays inside `src_dir` and names
// a regular file of the recorded size, every byte item and every fragment (strides included)
// lies inside its file, and every tensor's fragments cover it exactly once. `index_dir` only
// names the index in messages. Errors: kDataLoss naming the first record that does not match.
Status ValidateIndexRecords(const SourceTree& tree, const std::string& index_dir, const Checkpoint& c);

// Lower-level: write / read a checkpoint to / from an LMDB environment at `index_dir`.
// Load errors: kNotFound (no index), kDataLoss (schema mismatch or undecodable records:
// the caller rebuilds), kIo.
Status StoreCheckpoint(const std::string& index_dir, const Checkpoint& checkpoint,
                       uint64_t fingerprint);
Result<Checkpoint> LoadCheckpoint(const std::string& index_dir, bool read_only,
                                  uint64_t* fingerprint);

}  // namespace ucpfs::index
