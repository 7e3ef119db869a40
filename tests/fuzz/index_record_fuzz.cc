// libFuzzer target: an index record read back from LMDB is untrusted (a checkpoint may ship its
// own .ucpfs/). Any bytes must decode into a SourceFile or an Item, or give a clean kDataLoss-
// style error: never crash, hang or allocate without bound. The first byte picks the table.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "index/catalog_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view record(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] & 1) {
    auto f = ucpfs::index::codec::DecodeSourceFile(record);
    (void)f;
  } else {
    auto it = ucpfs::index::codec::DecodeItem(record);
    (void)it;
  }
  return 0;
}
