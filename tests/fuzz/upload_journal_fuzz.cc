// libFuzzer target: the bucket uploader's queue journal (STAGE/.ucpfs/upload/journal, read back
// after a crash: untrusted) must parse or give a clean error, never crash, hang or allocate
// without bound; the plan made from whatever parses only ever holds paths that pass
// CheckPlacePath, upload ids of printable ASCII within kMaxUploadIdBytes, and each id once.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <span>
#include <vector>

#include <algorithm>

#include "core/io/capture_journal.h"
#include "core/io/upload_journal.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ucpfs::io;
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(kUploadJournalMagic),
                               reinterpret_cast<const std::byte*>(kUploadJournalMagic) + sizeof(kUploadJournalMagic));
  const auto* in = reinterpret_cast<const std::byte*>(data);
  if (size > 0 && (data[0] & 1) != 0) {
    // Framed: payloads (a length byte, then that many bytes), each with its true checksum, so the
    // fuzzer reaches the decoder and the planner instead of stopping at the checksum.
    size_t at = 1;
    while (at < size) {
      const size_t n = std::min<size_t>(data[at], size - at - 1);
      const std::vector<std::byte> framed = FrameJournalPayload(std::span(in + at + 1, n));
      bytes.insert(bytes.end(), framed.begin(), framed.end());
      at += 1 + n;
    }
  } else {
    bytes.insert(bytes.end(), in, in + size);
  }
  auto parsed = ParseUploadJournal(bytes);
  if (!parsed.ok()) return 0;
  const UploadPlan plan = PlanUploads(*parsed);
  std::set<uint64_t> ids;
  for (const PendingUpload& p : plan.pending) {
    if (!CheckPlacePath(p.path).ok() || !ids.insert(p.id).second || p.id > plan.max_id) std::abort();
    for (const std::string& u : p.begun_upload_ids) {
      if (u.empty() || u.size() > kMaxUploadIdBytes) std::abort();
      for (char c : u) {
        if (c < 0x21 || c > 0x7e) std::abort();
      }
    }
  }
  return 0;
}
