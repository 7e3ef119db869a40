// libFuzzer target: the write-capture journal (SRC/.ucpfs/capture/journal, untrusted: it lives
// in the checkpoint directory) must parse or give a clean error, never crash, hang or allocate
// without bound; the recovery plan made from whatever parses must only ever finish files whose
// recorded chunks tile their size, with paths that pass CheckPlacePath, and never finish a file
// committed after one it discards.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "core/io/capture_journal.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ucpfs::io;
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(kJournalMagic),
                               reinterpret_cast<const std::byte*>(kJournalMagic) + sizeof(kJournalMagic));
  bytes.insert(bytes.end(), reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
  auto parsed = ParseJournal(bytes);
  if (!parsed.ok()) return 0;
  std::vector<uint64_t> parts;
  for (const auto& r : parsed->records) {
    if (parts.size() < 64) parts.push_back(r.seq);
  }
  const std::vector<RecoveryStep> plan = PlanRecovery(*parsed, parts);
  bool discarded = false;
  for (const RecoveryStep& step : plan) {
    if (!step.finish) {
      if (!step.path.empty()) discarded = true;
      continue;
    }
    if (discarded || !CheckPlacePath(step.path).ok()) std::abort();
    uint64_t covered = 0;
    for (const auto& c : step.chunks) {
      if (c.byte_offset != covered) std::abort();
      covered = c.byte_offset + c.n_bytes;
    }
    if (covered < step.size) std::abort();
  }
  return 0;
}
