// Builds the views of a mount (a Tree) from a Snapshot: `atomic/<param>/<state>.pt`, `target/`,
// DeepSpeed's `<tag>_universal/`, `.ucpfs/` (status.json, stats.json, sync); for a run
// directory also `checkpoints/<name>/`. The source's own files are not in the tree: the mount's
// Passthrough serves them beside it. Knows no FUSE types. Everything is sized here, before the
// views go live; no tensor byte is read until a file is read.
#pragma once

#include <memory>
#include <optional>
#include <vector>
#include <string>

#include "core/status.h"
#include "core/layout/layout.h"
#include "core/layout/patterns.h"
#include "fs/mount_report.h"
#include "fs/tree.h"
#include <functional>

#include <nlohmann/json.hpp>

#include "index/catalog.h"
#include "index/hf_view.h"
#include "index/key_map.h"
#include "index/snapshot.h"

namespace ucpfs::fs {

struct NamespaceInfo {
  std::string source_dir;  // absolute
  size_t n_atomic_files = 0;
  size_t n_passthrough_files = 0;
  size_t n_target_files = 0;      // distinct inodes under target/
  std::string status_json;  // the content of .ucpfs/status.json
  // target/ and the builder of its layouts not given with --layout, for ServeTree's
  // MountOptions::dynamic_dir / resolve. The resolver builds `target/<name>/` as a Tree of its
  // own (rank_<N>/ under its root); errors (kInvalidArgument) name the layout and why: not a
  // layout name, not its canonical spelling, or one the model refuses. It refers to the
  // `opened` index and `mapping` given to BuildNamespace, which must outlive it; thread-safe.
  Ino target_dir = 0;
  SubtreeResolver resolve_target;
  // The names target/ lists before they are looked up: `<layout>.error` of each remembered
  // refusal (the resolver serves them as files holding the reason). For MountOptions::list.
  SubtreeLister list_target;
  std::string index_state;   // set by the caller, for its messages
  double index_seconds = 0;
};

// Which target views to build, and how to slice parameters for them.
struct TargetOptions {
  std::vector<layout::Layout> layouts;   // --layout (may repeat)
  layout::Preset preset = layout::Preset::kAuto;
  std::vector<layout::Rule> rules;       // --pattern-rules
  std::optional<std::vector<int>> pp_split;
  int64_t vocab_pad_multiple = 0;        // --make-vocab-size-divisible-by (0: the source's, else 128)
  // Memory that layouts built on lookup may take together (--lookup-memory-mib). A layout keeps
  // only its tree (rank files are sized when it is built and built again when opened); one
  // whose estimate (rank 0's tree bytes × ranks) would pass the budget is refused, not built.
  uint64_t lookup_budget_bytes = uint64_t{256} << 20;
  // safetensors/: the largest shard (--safetensors-shard-size; index/safetensors_view.h).
  uint64_t safetensors_shard_n_bytes = 5'000'000'000;
  index::HfViewOptions hf;  // hf/: --hf-dtype, the shard size (index/hf_view.h)
};


// Errors: kIo when the source directory cannot be listed; kUnsupported when a state's stored
// dtype cannot be converted to fp32 (names the parameter).
// With target layouts: `target/<layout>/rank_<N>/{model.pt,optim.pt,ucp_info.json}` (other
// layouts on first lookup through info->resolve_target). Ranks
// that differ only in their data-parallel coordinate get the very same model.pt (and, without
// ZeRO partitioning, optim.pt): those share one inode, so the page cache holds them once.
// Errors: kIo when the source directory cannot be listed; kUnsupported when a state's stored
// dtype cannot be converted (names the parameter); kInvalidArgument when a layout does not fit
// the model (names the layout and why).
// What the mount adds to `.ucpfs/` beside the views (each optional).
struct MountHooks {
  // `.ucpfs/sync`: its open(2) returns once everything saved into the mount before it is
  // durable (`ucpfs sync MNT`), and fails with the flush error otherwise.
  std::function<Status()> sync;
  // The write capture's counters, as stats.json's "capture".
  std::function<nlohmann::ordered_json()> capture_stats;
  // View reads and errors so far, as stats.json's "views" and "errors" (MountReport::AddTo).
  std::shared_ptr<MountReport> report;
  // More top-level keys of status.json (e.g. "run": the checkpoints of a run directory).
  nlohmann::ordered_json status_extra = nlohmann::ordered_json::object();
};

// The views of `snapshot` (kept alive by the tree's openers and the target resolver).
Result<std::shared_ptr<Tree>> BuildNamespace(std::shared_ptr<const index::Snapshot> snapshot,
                                             const TargetOptions& targets, const MountHooks& hooks,
                                             NamespaceInfo* info);

// One checkpoint of a run directory.
struct NamedSnapshot {
  std::string name;  // its subdirectory
  std::shared_ptr<const index::Snapshot> snapshot;
};

// A run directory (index/run_dir.h): the newest checkpoint (`run.back()`) served as by
// BuildNamespace at the root (atomic/, target/ with layouts built on lookup, .ucpfs/), and every
// checkpoint of the run by name: `checkpoints/<name>/atomic/` and, for the layouts given with
// --layout, `checkpoints/<name>/target/<layout>/`. Errors: BuildNamespace's, for any of them.
Result<std::shared_ptr<Tree>> BuildRunNamespace(const std::vector<NamedSnapshot>& run, const TargetOptions& targets,
                                                const MountHooks& hooks, NamespaceInfo* info);

// The namespace of a source that holds no checkpoint (yet): `.ucpfs/` only, status.json saying
// `why` under "no_checkpoint".
Result<std::shared_ptr<Tree>> BuildEmptyNamespace(const std::string& source_dir, const std::string& why,
                                                  uint64_t generation, const MountHooks& hooks, NamespaceInfo* info);

}  // namespace ucpfs::fs
