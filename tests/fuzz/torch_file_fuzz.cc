// libFuzzer target: a whole torch.save file (zip + pickle + tensor resolution) from arbitrary
// bytes must give a TorchFile or a clean error, never a crash, hang or unbounded allocation.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "core/byte_source.h"
#include "core/format/torch_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto src = std::make_shared<ucpfs::MemorySource>("fuzz.pt", std::span<const uint8_t>(data, size));
  ucpfs::format::TorchFileLimits limits;
  limits.pickle.max_nodes = 1u << 16;
  limits.pickle.max_memo = 1u << 16;
  limits.pickle.max_stack = 1u << 16;
  limits.max_walk_depth = 64;
  auto file = ucpfs::format::TorchFile::Open(src, limits);
  if (file.ok()) {
    uint64_t sum = 0;
    for (const auto& t : file->tensors()) sum += t.data_offset + t.n_bytes;
    (void)sum;
  }
  return 0;
}
