// The write-capture journal: an append-only record of what was flushed and committed, read back
// after a crash to decide which captured files to finish and which to discard. Pure bytes ->
// records here (no I/O), so the parser of this untrusted file is unit-tested and fuzzed alone.
//
// File: the 8-byte magic "UCPFSJ01", then records, each
//   u32 payload length (little endian) | u64 XXH64(payload, seed 0) | payload
// and a payload is a u8 type then its fields (all little endian):
//   kChunk   seq u64, byte_offset u64, n_bytes u64, hash u64  (XXH64 of those bytes of the part)
//   kCommit  seq u64, size u64, mode u32, path length u32, path (relative to SRC), then
//            (optional, absent in older journals) known u8, uid u32, gid u32, atime ns i64,
//            mtime ns i64: the owner and times the file is placed with
//   kDone    seq u64   (placed under its final name; the part no longer exists)
//   kDiscard seq u64   (unlinked before it was placed)
// A torn or damaged record ends the journal there (everything after it is ignored).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace ucpfs::io {

inline constexpr char kJournalMagic[8] = {'U', 'C', 'P', 'F', 'S', 'J', '0', '1'};
// Bounds on what a journal may hold (it is untrusted input).
inline constexpr size_t kMaxJournalBytes = size_t{256} << 20;
inline constexpr size_t kMaxJournalPathBytes = 4096;

enum class JournalType : uint8_t { kChunk = 1, kCommit = 2, kDone = 3, kDiscard = 4 };

// The owner, group and times of a committed file (kCommit); `known` false in older journals.
struct CapturedAttrs {
  bool known = false;
  uint32_t uid = 0;
  uint32_t gid = 0;
  int64_t atime_ns = 0;
  int64_t mtime_ns = 0;
};

struct JournalRecord {
  JournalType type = JournalType::kChunk;
  uint64_t seq = 0;
  uint64_t byte_offset = 0;  // kChunk
  uint64_t n_bytes = 0;      // kChunk
  uint64_t hash = 0;         // kChunk
  uint64_t size = 0;         // kCommit
  uint32_t mode = 0;         // kCommit
  std::string path;          // kCommit
  CapturedAttrs attrs = {};  // kCommit
};

// The framing every append-only journal of ucpfs shares (this one, the bucket uploader's:
// upload_journal.h): a magic, then records of u32 payload length | u64 XXH64(payload) | payload.
// Little-endian integers of n_bytes (1..8) appended to / read from a payload (GetLittleEndian:
// the caller checked that [at, at + n_bytes) lies inside `in`).
void PutLittleEndian(std::vector<std::byte>& out, uint64_t v, int n_bytes);
uint64_t GetLittleEndian(std::span<const std::byte> in, size_t at, int n_bytes);
// One framed record of `payload`, ready to append.
std::vector<std::byte> FrameJournalPayload(std::span<const std::byte> payload);
// Calls `decode` on each whole record's payload whose checksum holds, in order, and stops at the
// first torn or damaged one (or one `decode` refuses: returns false), saying why in *stopped
// (left alone when every byte was a whole record). Returns the bytes used (magic included).
// Errors: kCorrupt when `bytes` is larger than max_bytes or does not start with `magic`.
Result<size_t> SplitJournal(std::span<const std::byte> bytes, const char (&magic)[8], size_t max_bytes,
                            std::string* stopped, const std::function<bool(std::span<const std::byte>)>& decode);

// One encoded record, ready to append.
std::vector<std::byte> EncodeJournalRecord(const JournalRecord& record);

struct ParsedJournal {
  std::vector<JournalRecord> records;
  // Why parsing stopped before the end ("" when every byte was a whole record): a torn tail
  // after a crash is expected, a damaged record is worth a log line.
  std::string stopped;
  size_t n_bytes_used = 0;
};

// Errors: kCorrupt when the magic is wrong or the journal is larger than kMaxJournalBytes.
Result<ParsedJournal> ParseJournal(std::span<const std::byte> bytes);

// What recovery does with one captured file.
struct RecoveryStep {
  uint64_t seq = 0;
  bool finish = false;    // true: place it (complete); false: discard it (unless `recover`)
  // Complete, but committed after a file that cannot be finished: never placed (it would be
  // ahead of that file), kept aside whole (capture_recovery.cc: .ucpfs/capture/recovered/).
  bool recover = false;
  std::string path;       // its final path (relative), "" when never committed
  uint64_t size = 0;
  uint32_t mode = 0;
  CapturedAttrs attrs = {};  // owner and times to place it with (when known)
  std::string reason;     // for the log line when discarded
  // kChunk records to verify against the part before finishing: the latest per offset, sorted,
  // covering [0, size) without a gap.
  std::vector<JournalRecord> chunks;
};

// The recovery plan for the parts present (`part_seqs`), from the journal: in commit order
// (the position of each file's last kCommit), files whose recorded chunks cover their size are
// finished until the first that is not; it is discarded, and every later one is recovered (kept
// aside, never placed) when its chunks cover its size, else discarded; parts never committed,
// and parts of files already done or discarded, are discarded. The verification of each chunk's
// hash against the part's bytes is the caller's (a mismatch discards that file and turns every
// later finish into a recover: call MarkIncomplete).
std::vector<RecoveryStep> PlanRecovery(const ParsedJournal& journal, const std::vector<uint64_t>& part_seqs);
// After a finish step at `index` fails verification: it becomes a discard with `reason`, and
// every later finish step a recover (its chunks still to be verified).
void MarkIncomplete(std::vector<RecoveryStep>& plan, size_t index, const std::string& reason);

// A relative path that may be placed beneath SRC: not empty, not absolute, no "", "." or ".."
// component, no NUL, components of at most 255 bytes, at most kMaxJournalPathBytes, and not
// inside ".ucpfs". Errors: kInvalidArgument saying which rule.
Status CheckPlacePath(const std::string& rel_path);

}  // namespace ucpfs::io
