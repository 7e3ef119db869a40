// See view_files.h.
#include "views/view_files.h"

#include <algorithm>
#include <map>

namespace ucpfs::views {
namespace {

// Appends the files under `ino` (a directory or a file named `path`) in the tree's listing order.
void Walk(const fs::Tree& tree, fs::Ino ino, const std::string& path, std::vector<ViewFile>* out) {
  const fs::TreeNode* node = tree.Get(ino);
  if (node == nullptr) return;
  if (!node->is_dir) {
    out->push_back({path, node->size, node->open});
    return;
  }
  for (const auto& [name, child] : node->children) Walk(tree, child, path + "/" + name, out);
}

}  // namespace

std::string ViewKindNames() {
  std::string names;
  for (const ViewKind* kind : ViewKinds()) names += (names.empty() ? "" : ", ") + std::string(kind->Name());
  return names;
}

Result<std::vector<ViewFile>> ListViewFiles(std::shared_ptr<const index::Snapshot> snapshot,
                                            const ViewOptions& options, const std::vector<std::string>& kinds) {
  for (const std::string& name : kinds) {
    const auto& all = ViewKinds();
    if (std::none_of(all.begin(), all.end(), [&](const ViewKind* k) { return name == k->Name(); })) {
      return InvalidArgumentError("no view '" + name + "' (views: " + ViewKindNames() + ")");
    }
  }
  UCPFS_ASSIGN_OR_RETURN(const ViewBase base, ViewBaseOf(*snapshot, options));
  fs::Tree tree(base.mtime);
  const ViewContext ctx{.snapshot = snapshot,
                        .options = options,
                        .patterns = base.patterns,
                        .tree = tree,
                        .parent = fs::kRootIno,
                        .mtime = base.mtime,
                        .access = base.access};
  std::vector<ViewFile> out;
  for (const ViewKind* kind : ViewKinds()) {
    const std::string name = kind->Name();
    if (std::find(kinds.begin(), kinds.end(), name) == kinds.end()) continue;
    const std::map<std::string, fs::Ino> before = tree.Get(fs::kRootIno)->children;
    ViewOutput report;
    UCPFS_RETURN_IF_ERROR(kind->Add(ctx, &report));
    // A view this source cannot have: the kind mounts without it and says why.
    if (auto it = report.status.find(name); it != report.status.end() && it->is_object() && it->contains("error")) {
      return UnsupportedError(snapshot->source_dir() + ": no " + name + " view: " + (*it)["error"].get<std::string>());
    }
    bool added = false;
    for (const auto& [child, ino] : tree.Get(fs::kRootIno)->children) {
      if (before.contains(child)) continue;
      Walk(tree, ino, child, &out);
      added = true;
    }
    if (!added) return NotFoundError(snapshot->source_dir() + ": this source has no " + name + " view");
  }
  return out;
}

}  // namespace ucpfs::views
