// libFuzzer target: a DCP `.metadata` pickle from arbitrary bytes must parse into DcpMetadata or
// give a clean error, never crash, hang or allocate without bound.
#include <cstddef>
#include <cstdint>
#include <span>

#include "index/dcp_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto bytes = std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size);
  auto md = ucpfs::index::ParseDcpMetadata(bytes, "fuzz.metadata");
  (void)md;
  return 0;
}
