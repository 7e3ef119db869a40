// libFuzzer target: a non-tensor item of a checkpoint (a torch.save blob: LR scheduler,
// dataloader, train state) decoded into a servable value must decode or give a clean error,
// never crash, hang or allocate without bound; what decodes must also be writable again.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/format/plain_value.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data),
                               reinterpret_cast<const std::byte*>(data) + size);
  auto src = std::make_shared<ucpfs::MemorySource>("fuzz.pt", std::move(bytes));
  auto v = ucpfs::format::DecodePlainValue(src);
  if (v.ok()) {
    auto again = ucpfs::format::LazyTorchFile::Build(*v, "again.pt");
    (void)again;
  }
  return 0;
}
