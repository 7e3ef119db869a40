// See snapshot.h.
#include "index/snapshot.h"

namespace ucpfs::index {

Result<std::shared_ptr<const Snapshot>> OpenSnapshot(const SnapshotOptions& options, uint64_t generation) {
  IndexOptions io;
  io.index_dir = options.index_dir;
  io.read_only = options.read_only_index;
  io.progress = options.progress;
  io.tree = options.tree;
  UCPFS_ASSIGN_OR_RETURN(OpenedIndex opened, OpenOrBuildIndex(options.source_dir, io));
  return SnapshotOf(std::move(opened), options, generation);
}

Result<std::shared_ptr<const Snapshot>> SnapshotOf(OpenedIndex opened, const SnapshotOptions& options,
                                                   uint64_t generation) {
  auto s = std::make_shared<Snapshot>();
  s->generation = generation;
  s->options = options;
  if (!s->options.tree) s->options.tree = LocalTree::Make(options.source_dir);
  s->opened = std::move(opened);
  UCPFS_ASSIGN_OR_RETURN(s->mapping, MapKeys(s->opened.checkpoint, options.key_rules));
  s->counters = std::make_shared<IoCounters>();
  UCPFS_ASSIGN_OR_RETURN(s->files, OpenFileTable(*s->options.tree, s->opened.checkpoint, s->counters));
  return std::shared_ptr<const Snapshot>(std::move(s));
}

void OpenSourceFile(const Snapshot& snapshot, const std::string& rel_path) {
  const auto& files = snapshot.checkpoint().files;
  for (size_t i = 0; i < files.size() && i < snapshot.files->size(); ++i) {
    if (files[i].rel_path != rel_path) continue;
    if (const auto* lazy = dynamic_cast<const LazySource*>((*snapshot.files)[i].get())) (void)lazy->Open();
  }
}

}  // namespace ucpfs::index
