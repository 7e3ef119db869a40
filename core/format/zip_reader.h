// ZipArchive: reads the central directory of a zip file (torch.save's container) and resolves
// every entry to an exact byte range, ZIP64 included. It never decompresses: it reports the
// method so callers can refuse compressed records.
//
// Untrusted input: every count, size and offset is checked against the file size with
// overflow-checked arithmetic; the central directory size and entry count are bounded.
// Errors name the source, the byte offset and what is wrong (kCorrupt), or kResourceExhausted
// for limits. Not for: writing zips (see torch_writer.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/byte_source.h"
#include "core/status.h"

namespace ucpfs::format {

struct ZipEntry {
  std::string name;                // full name as stored, e.g. "archive/data/0"
  uint64_t local_header_offset = 0;
  uint64_t data_offset = 0;        // absolute: local header + 30 + local name len + local extra len
  uint64_t n_bytes = 0;            // uncompressed size
  uint64_t compressed_n_bytes = 0; // == n_bytes when method == 0
  uint16_t method = 0;             // 0 = stored, 8 = deflate, others as stored in the file
  uint16_t flags = 0;
  uint32_t crc32 = 0;              // as stored (torch writes 0 or real values; never checked here)
};

struct ZipLimits {
  uint64_t max_entries = 1u << 20;
  uint64_t max_cd_bytes = 256ull << 20;
};

class ZipArchive {
 public:
  // Reads the EOCD (scanning back at most 65,557 bytes), the ZIP64 locator/EOCD when fields
  // are saturated, every central-directory entry with its ZIP64 extra, and every local header.
  // Errors: kCorrupt (no EOCD, bad signature, an offset/size outside the file, overflow,
  // local name length mismatch, ...), kResourceExhausted (limits), kIo from the source.
  static Result<ZipArchive> Open(const ByteSource& src, const ZipLimits& limits = {});
  // The records of a torch file that is no zip (the legacy format, torch_file.h), stored, with
  // no prefix, so they are found as an archive's are. Names must be distinct.
  static ZipArchive FromRecords(std::vector<ZipEntry> entries);

  const std::vector<ZipEntry>& entries() const { return entries_; }

  // The entry with exactly this full name, or nullptr.
  const ZipEntry* Find(std::string_view full_name) const;

  // torch's archive prefix: the first central-directory entry's name up to its first '/'
  // (PyTorchStreamReader does the same); empty when that name has no '/'.
  const std::string& prefix() const { return prefix_; }

  // Find(prefix() + "/" + record), e.g. FindRecord("data.pkl"), FindRecord("data/3");
  // Find(record) when prefix() is empty.
  const ZipEntry* FindRecord(std::string_view record) const;

  // Offset of the central directory (all entry data lies before it).
  uint64_t cd_offset() const { return cd_offset_; }

 private:
  // Hashes std::string and std::string_view alike, so Find needs no temporary string.
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view name) const noexcept {
      return std::hash<std::string_view>{}(name);
    }
  };

  std::vector<ZipEntry> entries_;
  // name -> index into entries_; the first of duplicate names wins.
  std::unordered_map<std::string, size_t, NameHash, std::equal_to<>> index_;
  std::string prefix_;
  uint64_t cd_offset_ = 0;
};

// Checks the CRC-32 stored for `entry` (method 0) against its bytes in `src`, read in 1 MiB
// blocks; `on_bytes` (may be empty) is told each block's length. Returns false, reading nothing,
// when the entry stores CRC 0 for data (no checksum: torch_writer's tensor records), true when
// checked. Errors: kDataLoss naming the source, the entry and both CRCs on a mismatch;
// kUnsupported for a compressed entry; kIo from the source.
Result<bool> CheckEntryCrc32(const ByteSource& src, const ZipEntry& entry,
                             const std::function<void(uint64_t)>& on_bytes = nullptr);

}  // namespace ucpfs::format
