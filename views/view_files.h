// The files of the views a mount serves, as a list: what `ucpfs convert` writes and `ucpfs verify`
// reads. The kinds asked for (by their registry names, view_kind.h) add their names to a Tree
// exactly as in a mount (same ViewKind code, same options), and the tree is walked: so every
// registered kind (hf/, <tag>_universal/, ...) is available to convert and verify, with the
// mount's bytes.
//
// Order: the kinds in registry order (universal, atomic, safetensors, hf, target); within a
// kind, the order the mounted tree lists its directories (depth first, names in byte order, as
// readdir gives them: rank_0, rank_1, rank_10, rank_2; extra_state.pt before model.pt).
//
// Not for: the mount's tree itself (mount_views.h), reading or writing the files (the commands).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "fs/tree.h"
#include "index/snapshot.h"
#include "views/view_kind.h"

namespace ucpfs::views {

struct ViewFile {
  std::string path;  // relative to the views' root, e.g. "target/tp2_pp1_dp1/rank_0/model.pt"
  uint64_t n_bytes = 0;  // exactly what open() yields
  fs::Opener open;       // builds the file's bytes (lazily; called once per use)
};

// The names of the registered kinds, "atomic, safetensors, ..." in registry order (for messages
// and help texts).
std::string ViewKindNames();

// Every file of the kinds named in `kinds` (registry names; each at most once), built from
// `snapshot` with `options` as a mount would build them. Errors: kInvalidArgument for a name no
// kind has; a kind's Add error; kUnsupported naming the view when the kind reports that this
// source cannot have it (status.json's "<kind>": {"error": ...}); kNotFound when it adds no name
// at all (safetensors/ of a source with no weights). An empty directory (atomic/ of a model with
// no parameters) is no error: it lists no file.
Result<std::vector<ViewFile>> ListViewFiles(std::shared_ptr<const index::Snapshot> snapshot,
                                            const ViewOptions& options, const std::vector<std::string>& kinds);

}  // namespace ucpfs::views
