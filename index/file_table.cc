// See file_table.h.
#include "index/file_table.h"

namespace ucpfs::index {

Result<FileTable> OpenFileTable(const SourceTree& tree, const Checkpoint& checkpoint,
                                std::shared_ptr<IoCounters> counters) {
  auto fd_cache = std::make_shared<FdCache>(FdCache::DefaultCapacity());
  auto table = std::make_shared<std::vector<std::shared_ptr<const ByteSource>>>();
  table->reserve(checkpoint.files.size());
  for (const auto& f : checkpoint.files) {
    UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<const LazySource> file,
                           tree.OpenLazy(f.rel_path, f.Identity(), counters, fd_cache));
    table->push_back(std::move(file));
  }
  return FileTable(std::move(table));
}

}  // namespace ucpfs::index
