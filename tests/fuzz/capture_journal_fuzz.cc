// libFuzzer target: the write-capture journal (SRC/.ucpfs/capture/journal, untrusted: it lives
// in the checkpoint directory) must parse or give a clean error, never crash, hang or allocate
// without bound; the recovery plan made from whatever parses must only ever finish files whose
// recorded chunks tile their size, with paths that pass CheckPlacePath, and never finish a file
// committed after one it discards (those whole are set aside, `recover`, never finished).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <algorithm>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/io/capture_journal.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ucpfs::io;
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(kJournalMagic),
                               reinterpret_cast<const std::byte*>(kJournalMagic) + sizeof(kJournalMagic));
  if (size > 0 && (data[0] & 1) != 0) {
    // Framed: the input is payloads (a length byte, then that many bytes), each wrapped in a
    // record header with its true checksum, so the fuzzer reaches the decoder and the planner
    // instead of stopping at the checksum.
    size_t at = 1;
    while (at < size) {
      const size_t n = std::min<size_t>(data[at], size - at - 1);
      const uint8_t* payload = data + at + 1;
      const uint64_t hash = XXH64(payload, n, 0);
      for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<std::byte>((n >> (8 * i)) & 0xff));
      for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<std::byte>((hash >> (8 * i)) & 0xff));
      bytes.insert(bytes.end(), reinterpret_cast<const std::byte*>(payload), reinterpret_cast<const std::byte*>(payload) + n);
      at += 1 + n;
    }
  } else {
    bytes.insert(bytes.end(), reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
  }
  auto parsed = ParseJournal(bytes);
  if (!parsed.ok()) return 0;
  std::vector<uint64_t> parts;
  for (const auto& r : parsed->records) {
    if (parts.size() < 64) parts.push_back(r.seq);
  }
  const std::vector<RecoveryStep> plan = PlanRecovery(*parsed, parts);
  bool discarded = false;
  for (const RecoveryStep& step : plan) {
    if (step.finish && step.recover) std::abort();
    if (!step.finish && !step.recover) {
      // Any file not finished stops the ones committed after it, a commit whose path is empty or
      // unplaceable included (the steps for parts never committed come last, after all of those).
      discarded = true;
      continue;
    }
    // A file set aside (recover) only ever follows one that is not finished; a finished one never.
    if (discarded != step.recover || !CheckPlacePath(step.path).ok()) std::abort();
    uint64_t covered = 0;
    for (const auto& c : step.chunks) {
      if (c.byte_offset != covered) std::abort();
      covered = c.byte_offset + c.n_bytes;
    }
    if (covered < step.size) std::abort();
  }
  return 0;
}
