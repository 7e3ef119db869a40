// universal: DeepSpeed's `<tag>_universal/` (what ds_to_universal writes, as lazy files:
// views/universal_view.h) and `latest_universal`, for the tag the checkpoint is, and in a save
// directory for every other tag (views/deepspeed_tags.h). A checkpoint the view cannot serve is
// still mounted, without it: the reason goes to the log and status.json ("universal").
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "core/io/source_tree.h"
#include "fs/namespace.h"
#include "views/deepspeed_tags.h"
#include "views/universal_view.h"
#include "views/view_kind.h"

namespace ucpfs::views {
namespace {

using fs::FixedSource;
using fs::Ino;
using fs::kRootIno;
using fs::Opener;
using fs::Tree;

// <dir>/ with the universal view's files, and `latest_universal` naming it. Checkpoint files
// (the model states ds_to_universal copies) are served from `source_prefix` + source_rel of
// `source`, opened at open(2) (SourceTree::Open). Every one is resolved before the first node is
// added, so a missing source file or a taken name fails with the tree unchanged.
Status AddUniversal(Tree& tree, index::UniversalView& u, const std::shared_ptr<const SourceTree>& source,
                    const std::string& source_prefix, struct timespec mtime, const ViewAccess& access,
                    size_t* n_files) {
  struct Copied {
    std::string rel;
    TreeEntry st;
  };
  std::vector<Copied> copies;  // each checkpoint file, in order
  for (const auto& f : u.files) {
    if (f.build) continue;
    const std::string rel = source_prefix + f.source_rel;
    Result<TreeEntry> st = source->Stat(rel);
    if (!st.ok() || st->kind != EntryKind::kFile) {
      return NotFoundError(u.dir + "/" + f.rel_path + ": source file " + source_prefix + f.source_rel +
                           " is not a regular file in the source");
    }
    copies.push_back({rel, std::move(*st)});
  }
  if (tree.Lookup(kRootIno, u.dir) != nullptr) return InternalError(u.dir + ": the name is taken in the mount");
  UCPFS_ASSIGN_OR_RETURN(Ino udir, tree.AddDir(kRootIno, u.dir, mtime));
  size_t next_link = 0;
  for (auto& f : u.files) {
    const size_t slash = f.rel_path.rfind('/');
    Ino parent = udir;
    if (slash != std::string::npos) {
      UCPFS_ASSIGN_OR_RETURN(parent, tree.MakeDirs(udir, f.rel_path.substr(0, slash), mtime));
    }
    const std::string name = f.rel_path.substr(slash == std::string::npos ? 0 : slash + 1);
    if (!f.build) {
      const Copied& c = copies[next_link++];
      Opener open = [source, rel = c.rel]() -> Result<std::shared_ptr<const ByteSource>> {
        UCPFS_ASSIGN_OR_RETURN(OpenedFile file, source->Open(rel));
        return std::move(file.bytes);
      };
      const int64_t mtime_ns = c.st.identity.mtime_ns;
      const struct timespec file_mtime = {static_cast<time_t>(mtime_ns / 1000000000), static_cast<long>(mtime_ns % 1000000000)};
      UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(parent, name, c.st.identity.n_bytes, file_mtime, std::move(open)));
      UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, c.st.mode, c.st.uid, c.st.gid));
      continue;
    }
    UCPFS_ASSIGN_OR_RETURN(Ino ino,
                           tree.AddFile(parent, name, f.n_bytes, mtime, fs::BuiltOnOpen(std::move(f.build), f.n_bytes)));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
    ++*n_files;
  }
  if (!u.latest_universal.empty()) {
    auto text = std::make_shared<MemorySource>(
        "latest_universal", std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(u.latest_universal.data()),
                                                     u.latest_universal.size()));
    const uint64_t n_bytes = text->Size();
    UCPFS_ASSIGN_OR_RETURN(Ino ino, tree.AddFile(kRootIno, "latest_universal", n_bytes, mtime, FixedSource(text)));
    UCPFS_RETURN_IF_ERROR(tree.SetAccess(ino, access.mode, access.uid, access.gid));
  }
  return Status::Ok();
}

class Universal final : public ViewKind {
 public:
  const char* Name() const override { return "universal"; }
  Status Add(const ViewContext& ctx, ViewOutput* out) const override {
    if (ctx.run_member) return Status::Ok();  // served for the run's newest checkpoint only, at the root
    const std::string& source_dir = ctx.snapshot->source_dir();
    const std::shared_ptr<const SourceTree>& source = ctx.snapshot->options.tree;
    const index::KeyMapping& mapping = ctx.snapshot->mapping;
    const auto& ckpt = ctx.snapshot->checkpoint();
    const index::FileTable& files = ctx.snapshot->files;
    const std::shared_ptr<IoCounters> counters = ctx.snapshot->counters;
    Tree* tree = &ctx.tree;
    const struct timespec mtime = ctx.mtime;
    const ViewAccess& access = ctx.access;
    // DeepSpeed: <tag>_universal/ and latest_universal. A checkpoint the view cannot serve is
    // still mounted, without it; the reason goes to the log and status.json.
    std::optional<index::UniversalView> universal;
    std::string universal_error;
    {
      const std::string base = source_dir.substr(source_dir.find_last_of('/') + 1);
      auto built = index::BuildUniversalView(ckpt, ctx.snapshot, mapping, files, base.empty() ? "checkpoint" : base);
      if (built.ok()) {
        universal = std::move(*built);
      } else {
        universal_error = built.error().message();
        std::fprintf(stderr, "ucpfs: warning: no universal view: %s\n", universal_error.c_str());
      }
    }
    // A save directory (`latest` names its tag): <tag>_universal/ for every other tag as well,
    // each built from its tag directory alone (views/deepspeed_tags.h). A tag that cannot be
    // served is left out with its error; the mount goes on.
    index::DeepSpeedTags other_tags;
    std::string other_tags_error;
    {
      auto built = index::BuildDeepSpeedTagViews(*source, ckpt, counters);
      if (built.ok()) {
        other_tags = std::move(*built);
      } else {
        other_tags_error = built.error().message();
        std::fprintf(stderr, "ucpfs: warning: no universal views of the other tags: %s\n", other_tags_error.c_str());
      }
      for (const auto& t : other_tags.tags) {
        if (!t.view) std::fprintf(stderr, "ucpfs: warning: no %s_universal: %s\n", t.name.c_str(), t.error.c_str());
      }
      if (other_tags.n_left_out > 0) {
        std::fprintf(stderr, "ucpfs: warning: %zu more subdirectories not examined for tags (at most %zu tags)\n",
                     other_tags.n_left_out, index::kMaxDeepSpeedTags);
      }
    }

    size_t n_universal = 0;
    if (universal) {
      UCPFS_RETURN_IF_ERROR(AddUniversal(*tree, *universal, source, "", mtime, access, &n_universal));
    }
    for (auto& t : other_tags.tags) {
      if (!t.view) continue;
      Result<std::shared_ptr<const SourceTree>> tag_tree = source->Subtree(t.name);
      const Status added =
          tag_tree.ok() ? AddUniversal(*tree, *t.view, source, t.name + "/", mtime, AccessOfSources(**tag_tree, t.files),
                                       &n_universal)
                        : tag_tree.error();
      if (!added.ok()) {
        t.error = added.message();
        std::fprintf(stderr, "ucpfs: warning: no %s: %s\n", t.view->dir.c_str(), t.error.c_str());
        t.view.reset();
      }
    }
    out->counts["universal_files"] = n_universal;
    if (universal) {
      out->status["universal"] = {{"dir", universal->dir}, {"latest_universal", universal->latest_universal}};
    } else if (!universal_error.empty()) {
      out->status["universal"] = {{"error", universal_error}};
    }
    if (!other_tags_error.empty()) {
      out->status["universal_tags_error"] = other_tags_error;
    }
    if (!other_tags.tags.empty()) {
      out->status["universal_tags"] = nlohmann::ordered_json::array();
      for (const auto& t : other_tags.tags) {
        nlohmann::ordered_json j = {{"tag", t.name}, {"dir", t.name + "_universal"}};
        if (!t.view) j["error"] = t.error;
        out->status["universal_tags"].push_back(std::move(j));
      }
    }
    if (other_tags.n_left_out > 0) {
      out->status["universal_tags_left_out"] = {
          {"subdirectories", other_tags.n_left_out},
          {"reason", "at most " + std::to_string(index::kMaxDeepSpeedTags) +
                         " tags get a universal view; the subdirectories after them (in name order) were not examined"}};
    }
    return Status::Ok();
  }
};

}  // namespace

const ViewKind* UniversalKind() {
  static const Universal kind;
  return &kind;
}

}  // namespace ucpfs::views
