// safetensors: `safetensors/`, the weights consolidated as Hugging Face's sharded safetensors
// and index, lazily (views/safetensors_view.h), for the checkpoint and for every checkpoint of
// a run. A source safetensors cannot hold is mounted without it: status.json "safetensors".
#include <cstdio>
#include <string>

#include "fs/namespace.h"
#include "views/safetensors_view.h"
#include "views/view_kind.h"

namespace ucpfs::views {
namespace {

using fs::FixedSource;
using fs::Ino;
using fs::Tree;

// `safetensors/` under `parent` (views/safetensors_view.h), when the source has weights
// safetensors can hold; otherwise *error says why there is none (the mount goes on without it).
Status AddSafetensorsView(Tree& tree, Ino parent, const std::shared_ptr<const index::Snapshot>& snap,
                          const index::PatternOptions& patterns, uint64_t shard_n_bytes, struct timespec mtime,
                          const ViewAccess& access, size_t* n_files, std::string* error) {
  auto built =
      index::BuildSafetensorsView(snap->checkpoint(), snap, snap->mapping, snap->files, patterns, shard_n_bytes);
  if (!built.ok()) {
    *error = built.error().ToString();
    std::fprintf(stderr, "ucpfs: warning: no safetensors/ view: %s\n", error->c_str());
    return Status::Ok();
  }
  auto& files = *built;
  if (files.empty()) return Status::Ok();
  UCPFS_ASSIGN_OR_RETURN(Ino dir, tree.AddDir(parent, "safetensors", mtime));
  for (auto& f : files) {
    const uint64_t n_bytes = f.source->Size();
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(dir, f.name, n_bytes, mtime, FixedSource(std::move(f.source))));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
    ++*n_files;
  }
  return Status::Ok();
}

class Safetensors final : public ViewKind {
 public:
  const char* Name() const override { return "safetensors"; }
  Status Add(const ViewContext& ctx, ViewOutput* out) const override {
    size_t n_safetensors = 0;
    std::string safetensors_error;
    UCPFS_RETURN_IF_ERROR(AddSafetensorsView(ctx.tree, ctx.parent, ctx.snapshot, ctx.patterns,
                                             ctx.options.safetensors_shard_n_bytes, ctx.mtime, ctx.access,
                                             &n_safetensors, &safetensors_error));
    out->counts["safetensors_files"] = n_safetensors;
    if (!safetensors_error.empty()) out->status["safetensors"] = {{"error", safetensors_error}};
    return Status::Ok();
  }
};

}  // namespace

const ViewKind* SafetensorsKind() {
  static const Safetensors kind;
  return &kind;
}

}  // namespace ucpfs::views
