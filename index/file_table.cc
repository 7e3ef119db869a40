#include "index/file_table.h"

namespace ucpfs::index {

FileTable OpenFileTable(const std::string& source_dir, const Checkpoint& checkpoint,
                        std::shared_ptr<IoCounters> counters) {
  auto fd_cache = std::make_shared<FdCache>(FdCache::DefaultCapacity());
  auto table = std::make_shared<std::vector<std::shared_ptr<const ByteSource>>>();
  table->reserve(checkpoint.files.size());
  for (const auto& f : checkpoint.files) {
    table->push_back(std::make_shared<LazyFileSource>(source_dir + "/" + f.rel_path, f.Identity(), counters, fd_cache));
  }
  return table;
}

}  // namespace ucpfs::index
