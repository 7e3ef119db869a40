// libFuzzer target: S3's XML answers (core/io/s3_xml.h; untrusted: whatever the endpoint sends)
// must parse or give a clean error, never crash, hang or allocate without bound. Each input is
// given to every parser; what parses must keep the parsers' promises (a truncated page names how
// to continue, an upload has a key and an id).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "core/io/s3_xml.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ucpfs::s3;
  std::string_view xml(reinterpret_cast<const char*>(data), size);
  (void)ParseErrorBody(xml, "fuzz");
  (void)ParseInitiateMultipartUpload(xml, "fuzz");
  ErrorBody eb;
  (void)ParseCompleteMultipartUpload(xml, "fuzz", &eb);
  if (auto page = ParseListObjectsV2(xml, "fuzz"); page.ok()) {
    if (page->is_truncated && page->next_continuation_token.empty()) std::abort();
  }
  if (auto ups = ParseListMultipartUploads(xml, "fuzz"); ups.ok()) {
    for (const UploadEntry& u : ups->uploads) {
      if (u.key.empty() || u.upload_id.empty()) std::abort();
    }
    if (ups->is_truncated && ups->next_key_marker.empty()) std::abort();
  }
  return 0;
}
