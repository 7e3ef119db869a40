// ViewKind: the one interface every view of a mount implements (atomic/, target/,
// <tag>_universal/, safetensors/, ...), and the registry that lists them. A kind is given a
// Snapshot (index/snapshot.h) and the view options, and adds its directories and lazily built
// files to the mount's Tree (fs/tree.h) under one parent: the root, or `checkpoints/<name>/` of
// a run directory. It also says what status.json and stats.json report about it.
//
// Not for: the `.ucpfs/` directory, the source's own files (the Passthrough) or the FUSE
// session (fs/), nor the daemon that rebuilds generations (mount/). A kind asks the snapshot's
// typed facts (index/source_facts.h), never compares format names.
//
// Adding a view kind: one file `views/<name>_kind.cc` with a ViewKind subclass and its factory,
// declared below, and one line in the registry (view_registry.cc), in build order (inode
// numbers follow build order, so a new kind goes last).
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/layout/layout.h"
#include "core/layout/patterns.h"
#include "core/status.h"
#include "fs/tree.h"
#include "index/checkpoint.h"
#include "index/snapshot.h"
#include "views/hf_view.h"
#include "views/view_inputs.h"

namespace ucpfs::views {

// Which target views to build, how to slice parameters for them, and the other views' options.
struct ViewOptions {
  std::vector<layout::Layout> layouts;   // --layout (may repeat)
  layout::Preset preset = layout::Preset::kAuto;
  std::vector<layout::Rule> rules;       // --pattern-rules
  // The attention facts the user gave: --pattern-rules' "model", with --hf-config's heads
  // (layout::MergeAttentionFacts); over the checkpoint's own (index::PatternOptionsFor).
  layout::ModelInfo model_facts;
  std::optional<std::vector<int>> pp_split;
  int64_t vocab_pad_multiple = 0;        // --make-vocab-size-divisible-by (0: the source's, else 128)
  // Memory that layouts built on lookup may take together (--lookup-memory-mib). A layout keeps
  // only its tree (rank files are sized when it is built and built again when opened); one
  // whose estimate (rank 0's tree bytes × ranks) would pass the budget is refused, not built.
  uint64_t lookup_budget_bytes = uint64_t{256} << 20;
  // safetensors/: the largest shard (--safetensors-shard-size; views/safetensors_view.h).
  uint64_t safetensors_shard_n_bytes = 5'000'000'000;
  index::HfViewOptions hf;  // hf/: --hf-dtype, --hf-config, the shard size (views/hf_view.h)
};

// Who may read view files: never more than every source file allows. All sources readable by
// others: 0444 for the mounting user (the default). Otherwise the bits every source grants to
// a common owner and a common group, with that owner and group (root where they differ).
struct ViewAccess {
  uint32_t mode = 0444;
  int64_t uid = -1;
  int64_t gid = -1;
};
ViewAccess AccessOfSources(const SourceTree& source, const std::vector<index::SourceFile>& sources);

// What every kind of one snapshot is built with, besides the tree and parent: the source
// directory's mtime, the pattern options (index::PatternOptionsFor over `options`) and the
// sources' access. Errors: the source's Stat's, PatternOptionsFor's.
struct ViewBase {
  struct timespec mtime = {};
  index::PatternOptions patterns;
  ViewAccess access;
};
Result<ViewBase> ViewBaseOf(const index::Snapshot& snapshot, const ViewOptions& options);

// What a kind is given. Valid for the call to ViewKind::Add only; what a kind's files need later
// (the snapshot) it keeps by shared_ptr in their openers.
struct ViewContext {
  std::shared_ptr<const index::Snapshot> snapshot;
  const ViewOptions& options;
  const index::PatternOptions& patterns;  // PatternOptionsFor(snapshot, options), made once
  fs::Tree& tree;
  fs::Ino parent = fs::kRootIno;  // where the kind adds its names
  struct timespec mtime = {};     // the source directory's
  ViewAccess access;              // of the snapshot's source files
  // A checkpoint of a run directory under `checkpoints/<name>/`: only what a kind serves for
  // every checkpoint of a run (no views built on lookup, nothing reported).
  bool run_member = false;
};

// What a kind reports. Each field is optional; kinds add to them, the namespace assembles them.
struct ViewOutput {
  // Top-level keys of status.json that the kind owns, in the kind's order.
  nlohmann::ordered_json status = nlohmann::ordered_json::object();
  // status.json's "counts" (files and bytes the kind serves, e.g. "atomic_files").
  nlohmann::ordered_json counts = nlohmann::ordered_json::object();
  // A directory whose names are built on first lookup (fs::Filesystem's dynamic directory; at
  // most one per mount: target/), its resolver and lister.
  fs::Ino dynamic_dir = 0;
  fs::SubtreeResolver resolve;
  fs::SubtreeLister list;
  // Called at each open of stats.json, to add what changed since the mount.
  std::function<void(nlohmann::ordered_json& stats)> stats;
  // Called at each open of status.json with the status as built and the room it has (its text
  // must stay under `n_bytes`); `live_room_bytes` is the room the kind needs beyond the text
  // built at mount time. At most one kind per mount (target/: refused layouts).
  std::function<std::string(const nlohmann::ordered_json& status, uint64_t n_bytes)> status_live;
  uint64_t live_room_bytes = 0;
};

class ViewKind {
 public:
  virtual ~ViewKind() = default;
  // The view's name as the documentation and log lines say it ("atomic", "target", ...).
  virtual const char* Name() const = 0;
  // Adds the view under ctx.parent. A view this source cannot have is left out, the reason in
  // `out->status` and the log; an error returned fails the whole namespace (a name taken, a
  // stored dtype that cannot be converted, a layout given with --layout that does not fit).
  virtual Status Add(const ViewContext& ctx, ViewOutput* out) const = 0;
};

// The registry: every view kind, in build order. View kinds are stateless; one instance each.
const std::vector<const ViewKind*>& ViewKinds();

// The factories the registry calls (one per *_kind.cc).
const ViewKind* UniversalKind();
const ViewKind* AtomicKind();
const ViewKind* SafetensorsKind();
const ViewKind* HfKind();
const ViewKind* TargetKind();

// The target views' input as target/ makes it (MakeTargetInput with the patterns applied and
// the --pp-split): `ucpfs plan` plans a layout from the same. It keeps `snapshot` alive (its
// tensor layouts are the snapshot's). `warn` gets one line per source item no view serves.
// Errors: MakeTargetInput's.
Result<std::shared_ptr<const TargetInput>> TargetInputOf(const std::shared_ptr<const index::Snapshot>& snapshot,
                                                         const ViewOptions& options,
                                                         const index::PatternOptions& patterns,
                                                         const std::function<void(const std::string&)>& warn);

}  // namespace ucpfs::views
