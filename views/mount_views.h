// The views of a mount as one Tree (fs/tree.h): every registered view kind (views/view_kind.h)
// built from a Snapshot, in registry order, then `.ucpfs/` (fs/namespace.h) with status.json
// assembled from what each kind reported; for a run directory also `checkpoints/<name>/`.
// Knows no FUSE types and no particular view. Everything is sized here, before the views go
// live; no tensor byte is read until a file is read.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "fs/namespace.h"
#include "fs/tree.h"
#include "index/snapshot.h"
#include "views/view_kind.h"

namespace ucpfs::views {

// The views of `snapshot` (kept alive by the tree's openers and the target resolver).
// With target layouts: `target/<layout>/rank_<N>/{model.pt,optim.pt,ucp_info.json}` (other
// layouts on first lookup through info->resolve_target). Ranks that differ only in their
// data-parallel coordinate get the very same model.pt (and, without ZeRO partitioning,
// optim.pt): those share one inode, so the page cache holds them once.
// Errors: kIo when the source directory cannot be listed; kUnsupported when a state's stored
// dtype cannot be converted (names the parameter); kInvalidArgument when a layout does not fit
// the model (names the layout and why).
Result<std::shared_ptr<fs::Tree>> BuildNamespace(std::shared_ptr<const index::Snapshot> snapshot,
                                                 const ViewOptions& options, const fs::MountHooks& hooks,
                                                 fs::NamespaceInfo* info);

// One checkpoint of a run directory.
struct NamedSnapshot {
  std::string name;  // its subdirectory
  std::shared_ptr<const index::Snapshot> snapshot;
};

// A run directory (index/run_dir.h): the newest checkpoint (`run.back()`) served as by
// BuildNamespace at the root (atomic/, target/ with layouts built on lookup, .ucpfs/), and every
// checkpoint of the run by name: what each kind serves for a run's checkpoint
// (ViewContext::run_member: `checkpoints/<name>/atomic/`, `safetensors/` and, for the layouts
// given with --layout, `target/<layout>/`). Errors: BuildNamespace's, for any of them.
Result<std::shared_ptr<fs::Tree>> BuildRunNamespace(const std::vector<NamedSnapshot>& run, const ViewOptions& options,
                                                    const fs::MountHooks& hooks, fs::NamespaceInfo* info);

}  // namespace ucpfs::views
