#include "views/mount_views.h"

#include <nlohmann/json.hpp>

#include "core/json_text.h"
#include "views/view_inputs.h"

namespace ucpfs::views {

using fs::Ino;
using fs::kRootIno;
using fs::Tree;

Result<std::shared_ptr<Tree>> BuildNamespace(std::shared_ptr<const index::Snapshot> snapshot,
                                             const ViewOptions& options, const fs::MountHooks& hooks,
                                             fs::NamespaceInfo* info) {
  auto tree = std::make_shared<Tree>();
  const std::string& source_dir = snapshot->source_dir();
  const index::OpenedIndex& opened = snapshot->opened;
  const index::KeyMapping& mapping = snapshot->mapping;
  const auto& ckpt = opened.checkpoint;
  UCPFS_ASSIGN_OR_RETURN(const ViewBase base, ViewBaseOf(*snapshot, options));
  const struct timespec mtime = base.mtime;

  // Source files by id, opened on first read.
  const std::shared_ptr<IoCounters> counters = snapshot->counters;
  const ViewContext ctx{.snapshot = snapshot,
                        .options = options,
                        .patterns = base.patterns,
                        .tree = *tree,
                        .parent = kRootIno,
                        .mtime = mtime,
                        .access = base.access};
  // Every view kind, in registry order (inode numbers follow it).
  const std::vector<const ViewKind*>& kinds = ViewKinds();
  std::vector<ViewOutput> outs(kinds.size());
  for (size_t i = 0; i < kinds.size(); ++i) UCPFS_RETURN_IF_ERROR(kinds[i]->Add(ctx, &outs[i]));
  const ViewOutput* dynamic = nullptr;  // the one kind with a directory built on lookup
  const ViewOutput* live = nullptr;     // the one kind whose status.json part changes after the mount
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (outs[i].dynamic_dir != 0) {
      if (dynamic != nullptr) return InternalError(std::string("two views have a directory built on lookup: ") + kinds[i]->Name());
      dynamic = &outs[i];
    }
    if (outs[i].status_live) {
      if (live != nullptr) return InternalError(std::string("two views change status.json after the mount: ") + kinds[i]->Name());
      live = &outs[i];
    }
  }

  // The source's own files are served beside the tree by the mount's Passthrough.
  const size_t n_passthrough = ckpt.files.size();
  nlohmann::ordered_json status;
  status["source"] = source_dir;
  status["format"] = ckpt.format;
  status["flavor"] = ckpt.flavor;
  status["index"] = {{"dir", opened.index_dir},
                     {"state", index::IndexStateName(opened.state)},
                     {"reused", opened.state == index::IndexState::kReused},
                     {"schema", index::kCatalogSchemaVersion},
                     {"fingerprint", opened.fingerprint},
                     {"open_seconds", opened.elapsed_s}};
  nlohmann::ordered_json counts = {{"params", mapping.params.size()}};
  for (const ViewOutput& out : outs) {
    for (const auto& [key, value] : out.counts.items()) counts[key] = value;
  }
  counts["source_files"] = n_passthrough;
  counts["items"] = ckpt.items.size();
  counts["unmapped_keys"] = mapping.unmapped_keys.size();
  status["counts"] = std::move(counts);
  // Each view's own keys (views/*_kind.cc), in registry order.
  for (const ViewOutput& out : outs) {
    for (const auto& [key, value] : out.status.items()) status[key] = value;
  }
  status["unmapped_keys"] = mapping.unmapped_keys;
  // What the key mapping read from the checkpoint's structure, and what it would not guess.
  status["key_structure"] = {{"model_prefix", mapping.model_prefix},
                             {"optimizer_prefixes", mapping.optimizer_prefixes},
                             {"ambiguities", mapping.ambiguities}};
  status["generation"] = snapshot->generation;
  for (const auto& [key, value] : hooks.status_extra.items()) status[key] = value;
  const std::string status_text = JsonText(status) + "\n";
  std::function<std::string(uint64_t)> status_live;
  if (live != nullptr) {
    status_live = [status, f = live->status_live](uint64_t n_bytes) { return f(status, n_bytes); };
  }
  std::vector<std::function<void(nlohmann::ordered_json&)>> view_stats;
  for (const ViewOutput& out : outs) {
    if (out.stats) view_stats.push_back(out.stats);
  }
  auto source_counters = [counters, view_stats](nlohmann::ordered_json& j) {
    j["source_bytes_read"] = counters->source_bytes_read.load();
    j["source_reads"] = counters->source_reads.load();
    j["source_read_errors"] = counters->source_read_errors.load();
    j["source_files_opened"] = counters->files_opened.load();
    for (const auto& add : view_stats) add(j);
  };
  UCPFS_RETURN_IF_ERROR(fs::AddMetaDir(*tree, mtime, status_text, source_counters, hooks, status_live,
                                       live != nullptr ? live->live_room_bytes : 0));
  if (info != nullptr) {
    const nlohmann::ordered_json& served = status["counts"];
    info->source_dir = source_dir;
    info->n_atomic_files = served.value("atomic_files", size_t{0});
    info->n_passthrough_files = n_passthrough;
    info->n_target_files = served.value("target_files", size_t{0});
    info->status_json = std::move(status_text);
    if (dynamic != nullptr) {
      info->target_dir = dynamic->dynamic_dir;
      info->resolve_target = dynamic->resolve;
      info->list_target = dynamic->list;
    }
  }
  return tree;
}

Result<std::shared_ptr<Tree>> BuildRunNamespace(const std::vector<NamedSnapshot>& run, const ViewOptions& options,
                                                const fs::MountHooks& hooks, fs::NamespaceInfo* info) {
  if (run.empty()) return InvalidArgumentError("a run with no checkpoint");
  UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<Tree> tree, BuildNamespace(run.back().snapshot, options, hooks, info));
  if (tree->Lookup(kRootIno, "checkpoints") != nullptr) {
    return InvalidArgumentError("the views of the newest checkpoint already use the name 'checkpoints'");
  }
  const struct timespec mtime = fs::Now();
  UCPFS_ASSIGN_OR_RETURN(Ino all, tree->AddDir(kRootIno, "checkpoints", mtime));
  for (const NamedSnapshot& named : run) {
    UCPFS_ASSIGN_OR_RETURN(Ino dir, tree->AddDir(all, named.name, mtime));
    UCPFS_ASSIGN_OR_RETURN(const ViewBase base, ViewBaseOf(*named.snapshot, options));
    const ViewContext ctx{.snapshot = named.snapshot,
                          .options = options,
                          .patterns = base.patterns,
                          .tree = *tree,
                          .parent = dir,
                          .mtime = mtime,  // a run's checkpoints: the time of the mount
                          .access = base.access,
                          .run_member = true};
    for (const ViewKind* kind : ViewKinds()) {
      ViewOutput unreported;  // a run's checkpoints are not reported on
      UCPFS_RETURN_IF_ERROR(kind->Add(ctx, &unreported));
    }
  }
  return tree;
}

}  // namespace ucpfs::views
