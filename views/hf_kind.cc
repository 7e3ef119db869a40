// hf: `hf/`, a Hugging Face model folder `from_pretrained` loads as it is (views/hf_view.h).
// When the source cannot give one (a fact missing, a model Llama's names cannot express),
// `hf.error` at the same place says why, as does status.json "hf"; the mount goes on.
#include <memory>
#include <string>
#include <vector>

#include "fs/namespace.h"
#include "views/hf_view.h"
#include "views/view_kind.h"

namespace ucpfs::views {
namespace {

using fs::FixedSource;
using fs::Ino;
using fs::Tree;

Status AddHfView(Tree& tree, Ino parent, const std::shared_ptr<const index::Snapshot>& snap,
                 const index::PatternOptions& patterns, const index::HfViewOptions& options, struct timespec mtime,
                 const ViewAccess& access, size_t* n_files, std::string* error) {
  auto built =
      index::BuildHfView(snap->checkpoint(), snap, snap->mapping, snap->files, patterns, snap->tree(), options);
  if (!built.ok()) {
    *error = built.error().message();
    auto src = std::make_shared<MemorySource>(
        "hf.error", std::vector<std::byte>(reinterpret_cast<const std::byte*>(error->data()),
                                           reinterpret_cast<const std::byte*>(error->data()) + error->size()));
    const uint64_t n = src->Size();
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(parent, "hf.error", n, mtime, FixedSource(std::move(src))));
    return tree.SetAccess(ino, access.mode, access.uid, access.gid);
  }
  UCPFS_ASSIGN_OR_RETURN(Ino dir, tree.AddDir(parent, "hf", mtime));
  for (auto& f : *built) {
    const uint64_t n_bytes = f.source->Size();
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(dir, f.name, n_bytes, mtime, FixedSource(std::move(f.source))));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
    ++*n_files;
  }
  return Status::Ok();
}

class Hf final : public ViewKind {
 public:
  const char* Name() const override { return "hf"; }
  Status Add(const ViewContext& ctx, ViewOutput* out) const override {
    if (ctx.run_member) return Status::Ok();  // the newest checkpoint of a run only, at the root
    size_t n_hf = 0;
    std::string hf_error;
    UCPFS_RETURN_IF_ERROR(AddHfView(ctx.tree, ctx.parent, ctx.snapshot, ctx.patterns, ctx.options.hf, ctx.mtime,
                                    ctx.access, &n_hf, &hf_error));
    out->counts["hf_files"] = n_hf;
    if (!hf_error.empty()) out->status["hf"] = {{"error", hf_error}};
    return Status::Ok();
  }
};

}  // namespace

const ViewKind* HfKind() {
  static const Hf kind;
  return &kind;
}

}  // namespace ucpfs::views
