#include "mount/reindexer.h"

namespace ucpfs::mount {

bool IsCompletionMarker(const std::string& rel) {
  const std::string name = rel.substr(rel.find_last_of('/') + 1);
  return name == "latest" || name == "latest_checkpointed_iteration.txt" || name == ".metadata" || name == "trainer_state.json" ||
         name == "model.safetensors.index.json" || name == "pytorch_model.bin.index.json" ||
         (name.size() > 9 && name.compare(name.size() - 9, 9, ".metadata") == 0);
}

}  // namespace ucpfs::mount
