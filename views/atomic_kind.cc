// atomic: `atomic/<param>/<state>.pt`, one lazy torch.save file per parameter and state
// (views/atomic.h, made by views/view_inputs.h's BuildAtomicViews; sized at mount, built on
// open: fs::BuiltOnOpen), for the checkpoint and for every checkpoint of a run. status.json:
// "escaped_names" (parameters whose directory name is not their fqn).
#include <map>
#include <string>
#include <vector>

#include "fs/namespace.h"
#include "views/atomic.h"
#include "views/view_inputs.h"
#include "views/view_kind.h"

namespace ucpfs::views {
namespace {

using fs::Ino;
using fs::Tree;

// `atomic/<param>/<state>.pt` files under `atomic`.
Status AddAtomicFiles(Tree& tree, Ino atomic, std::vector<index::AtomicView> atomic_views, struct timespec mtime,
                      const ViewAccess& access, size_t* n_atomic, uint64_t* atomic_bytes) {
  std::map<std::string, Ino> param_dirs;
  for (auto& v : atomic_views) {
    auto [dir, fresh] = param_dirs.try_emplace(v.dir, 0);
    if (fresh) {
      UCPFS_ASSIGN_OR_RETURN(dir->second, tree.AddDir(atomic, v.dir, mtime));
    }
    *atomic_bytes += v.n_bytes;
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(dir->second, v.file, v.n_bytes, mtime,
                                                 fs::BuiltOnOpen(std::move(v.build), v.n_bytes)));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
    ++*n_atomic;
  }
  return Status::Ok();
}

class Atomic final : public ViewKind {
 public:
  const char* Name() const override { return "atomic"; }
  Status Add(const ViewContext& ctx, ViewOutput* out) const override {
    const index::Snapshot& snap = *ctx.snapshot;
    UCPFS_ASSIGN_OR_RETURN(Ino atomic, ctx.tree.AddDir(ctx.parent, "atomic", ctx.mtime));
    size_t n_atomic = 0;
    uint64_t atomic_bytes = 0;
    UCPFS_ASSIGN_OR_RETURN(auto atomic_views, index::BuildAtomicViews(snap.checkpoint(), ctx.snapshot, snap.mapping,
                                                                       snap.files, ctx.patterns));
    UCPFS_RETURN_IF_ERROR(AddAtomicFiles(ctx.tree, atomic, std::move(atomic_views), ctx.mtime, ctx.access, &n_atomic,
                                         &atomic_bytes));
    out->counts["atomic_files"] = n_atomic;
    out->counts["atomic_bytes"] = atomic_bytes;
    // Parameters whose atomic/ directory name is not their fqn (views::AtomicDirName).
    out->status["escaped_names"] = nlohmann::ordered_json::array();
    for (const auto& p : snap.mapping.params) {
      const std::string dir = views::AtomicDirName(p.name);
      if (dir != p.name) out->status["escaped_names"].push_back({{"param", p.name}, {"dir", "atomic/" + dir}});
    }
    return Status::Ok();
  }
};

}  // namespace

const ViewKind* AtomicKind() {
  static const Atomic kind;
  return &kind;
}

}  // namespace ucpfs::views
