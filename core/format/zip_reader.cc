// ZipArchive::Open: EOCD -> (ZIP64 locator -> ZIP64 EOCD) -> central directory -> local headers.
//
// Every number read from the file is untrusted. Reads are bounded before they are issued: the
// EOCD search window is at most 65,557 bytes, the central directory is read once (bounded by
// ZipLimits::max_cd_bytes and checked against the end records), and each local header costs one
// read of 30 + name bytes. Nothing is reserved before the entry count has been checked against
// both the limit and the central directory size (46 bytes per entry at least).
#include "core/format/zip_reader.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>

#include <zlib.h>

#include "core/checked.h"

namespace ucpfs::format {
namespace {

constexpr uint32_t kLocalHeaderSig = 0x04034b50;
constexpr uint32_t kCentralHeaderSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr uint16_t kZip64ExtraId = 0x0001;

constexpr uint64_t kLocalHeaderBytes = 30;
constexpr uint64_t kCentralHeaderBytes = 46;
constexpr uint64_t kEocdBytes = 22;
constexpr uint64_t kZip64LocatorBytes = 20;
constexpr uint64_t kZip64EocdBytes = 56;
// The ZIP64 EOCD's "size of record" counts the bytes after its first 12.
constexpr uint64_t kZip64EocdMinRecordBytes = kZip64EocdBytes - 12;
// EOCD plus the longest possible comment.
constexpr uint64_t kMaxEocdSearchBytes = kEocdBytes + 0xFFFF;  // 65,557
// torch and Python write no archive comment, so the EOCD and the ZIP64 locator before it sit in
// the last 42 bytes; a small first read avoids a 64 KiB read on every open.
constexpr uint64_t kFastEocdSearchBytes = 256;

constexpr uint32_t kSaturated32 = 0xFFFFFFFF;

uint16_t LoadU16(const std::byte* p) {
  return static_cast<uint16_t>(std::to_integer<uint16_t>(p[0]) |
                               std::to_integer<uint16_t>(p[1]) << 8);
}

uint32_t LoadU32(const std::byte* p) {
  return static_cast<uint32_t>(LoadU16(p)) | static_cast<uint32_t>(LoadU16(p + 2)) << 16;
}

uint64_t LoadU64(const std::byte* p) {
  return static_cast<uint64_t>(LoadU32(p)) | static_cast<uint64_t>(LoadU32(p + 4)) << 32;
}

std::string Hex(uint64_t value, int n_digits) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%0*llx", n_digits, static_cast<unsigned long long>(value));
  return buf;
}

// Names come from the file: quote them, escape control bytes and cut long ones, so an error
// message stays one readable line.
std::string QuoteName(std::string_view name) {
  constexpr size_t kMaxShown = 80;
  std::string out = "'";
  for (size_t i = 0; i < name.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7f || c == '\'' || c == '\\') {
      out += "\\x" + Hex(c, 2).substr(2);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (name.size() > kMaxShown) out += "...";
  out += "'";
  return out;
}

Status Corrupt(const ByteSource& src, uint64_t byte_offset, const std::string& what) {
  return CorruptError(src.Name() + ": offset " + std::to_string(byte_offset) + ": " + what);
}

Status Exhausted(const ByteSource& src, uint64_t byte_offset, const std::string& what) {
  return ResourceExhaustedError(src.Name() + ": offset " + std::to_string(byte_offset) + ": " +
                                what);
}

// What the end records say about the central directory.
struct EndRecords {
  uint64_t n_entries = 0;
  uint64_t cd_offset = 0;
  uint64_t cd_n_bytes = 0;
  // Offset of the record that gave these values (ZIP64 EOCD or EOCD), for error messages. The
  // central directory must end at or before it.
  uint64_t record_offset = 0;
};

// Position of the EOCD inside `tail` (the last tail.size() bytes of the file), or nullopt.
// Scans backward: the last signature whose comment fits before the end of the file wins, so a
// signature inside a comment is skipped when its own comment length does not fit.
std::optional<size_t> ScanForEocd(std::span<const std::byte> tail) {
  if (tail.size() < kEocdBytes) return std::nullopt;
  for (size_t pos = tail.size() - kEocdBytes + 1; pos-- > 0;) {
    const std::byte* p = tail.data() + pos;
    if (LoadU32(p) != kEocdSig) continue;
    const uint64_t comment_n_bytes = LoadU16(p + 20);
    if (comment_n_bytes <= tail.size() - pos - kEocdBytes) return pos;
  }
  return std::nullopt;
}

Result<EndRecords> ReadEndRecords(const ByteSource& src) {
  const uint64_t file_n_bytes = src.Size();
  if (file_n_bytes < kEocdBytes) {
    return Corrupt(src, 0, "file of " + std::to_string(file_n_bytes) +
                               " bytes is too small for an end-of-central-directory record");
  }

  // Both windows are suffixes of the file and are scanned from the end, so the small one finds
  // exactly the EOCD the large one would, when it finds one at all.
  std::vector<std::byte> tail;
  uint64_t tail_offset = 0;
  std::optional<size_t> eocd_in_tail;
  for (uint64_t window_n_bytes : {std::min(file_n_bytes, kFastEocdSearchBytes),
                                  std::min(file_n_bytes, kMaxEocdSearchBytes)}) {
    if (window_n_bytes <= tail.size()) break;  // the small window was already the whole file
    tail_offset = file_n_bytes - window_n_bytes;
    UCPFS_ASSIGN_OR_RETURN(tail, ReadRange(src, tail_offset, window_n_bytes));
    eocd_in_tail = ScanForEocd(tail);
    if (eocd_in_tail) break;
  }
  if (!eocd_in_tail) {
    return Corrupt(src, tail_offset,
                   "no end-of-central-directory record in the last " +
                       std::to_string(tail.size()) + " bytes (not a zip file?)");
  }
  const std::byte* eocd = tail.data() + *eocd_in_tail;
  const uint64_t eocd_offset = tail_offset + *eocd_in_tail;

  EndRecords end;
  end.n_entries = LoadU16(eocd + 10);
  end.cd_n_bytes = LoadU32(eocd + 12);
  end.cd_offset = LoadU32(eocd + 16);
  end.record_offset = eocd_offset;

  if (eocd_offset < kZip64LocatorBytes) return end;
  const uint64_t locator_offset = eocd_offset - kZip64LocatorBytes;
  std::array<std::byte, kZip64LocatorBytes> locator_buf;
  const std::byte* locator;
  if (*eocd_in_tail >= kZip64LocatorBytes) {
    locator = eocd - kZip64LocatorBytes;
  } else {
    UCPFS_RETURN_IF_ERROR(src.ReadAt(locator_offset, locator_buf));
    locator = locator_buf.data();
  }
  // Without a locator, a saturated EOCD field may still be a real value (Python writes exactly
  // 65,535 entries without ZIP64); the central-directory checks catch it when it is not.
  if (LoadU32(locator) != kZip64LocatorSig) return end;

  const uint64_t zip64_eocd_offset = LoadU64(locator + 8);
  if (!RangeInside(zip64_eocd_offset, kZip64EocdBytes, locator_offset)) {
    return Corrupt(src, locator_offset,
                   "ZIP64 locator points to a ZIP64 end record at offset " +
                       std::to_string(zip64_eocd_offset) + " that does not end before the locator");
  }
  std::array<std::byte, kZip64EocdBytes> z64;
  UCPFS_RETURN_IF_ERROR(src.ReadAt(zip64_eocd_offset, z64));
  if (LoadU32(z64.data()) != kZip64EocdSig) {
    return Corrupt(src, zip64_eocd_offset,
                   "bad ZIP64 end-of-central-directory signature " + Hex(LoadU32(z64.data()), 8));
  }
  // The record may carry an extensible data sector, but it must still end at the locator.
  const uint64_t record_n_bytes = LoadU64(z64.data() + 4);
  const auto record_end = CheckedAdd(zip64_eocd_offset + 12, record_n_bytes);
  if (record_n_bytes < kZip64EocdMinRecordBytes || !record_end || *record_end > locator_offset) {
    return Corrupt(src, zip64_eocd_offset,
                   "ZIP64 end record declares a size of " + std::to_string(record_n_bytes) +
                       " bytes, which does not fit between its header and the locator at " +
                       std::to_string(locator_offset));
  }
  end.n_entries = LoadU64(z64.data() + 32);
  end.cd_n_bytes = LoadU64(z64.data() + 40);
  end.cd_offset = LoadU64(z64.data() + 48);
  end.record_offset = zip64_eocd_offset;
  return end;
}

// Fills the entry's saturated fields from its ZIP64 extra (header id 0x0001). Per the spec the
// extra holds only the fields whose 32-bit value is saturated, in the order usize, csize, lho.
// A saturated field with no ZIP64 extra keeps its literal value: the range checks later decide.
Status ParseCentralExtra(const ByteSource& src, uint64_t extra_offset,
                         std::span<const std::byte> extra, ZipEntry& entry) {
  const bool usize_saturated = entry.n_bytes == kSaturated32;
  const bool csize_saturated = entry.compressed_n_bytes == kSaturated32;
  const bool lho_saturated = entry.local_header_offset == kSaturated32;
  bool seen_zip64 = false;
  size_t pos = 0;
  // Fewer than 4 trailing bytes cannot hold a field header; like Python's zipfile, ignore them.
  while (extra.size() - pos >= 4) {
    const uint16_t id = LoadU16(extra.data() + pos);
    const size_t field_n_bytes = LoadU16(extra.data() + pos + 2);
    const size_t body = pos + 4;
    if (field_n_bytes > extra.size() - body) {
      return Corrupt(src, extra_offset + pos,
                     "extra field " + Hex(id, 4) + " of " + std::to_string(field_n_bytes) +
                         " bytes runs past the end of its entry's extra area (" +
                         std::to_string(extra.size()) + " bytes)");
    }
    if (id == kZip64ExtraId && !seen_zip64) {
      seen_zip64 = true;
      const size_t needed_n_bytes =
          8 * (size_t{usize_saturated} + size_t{csize_saturated} + size_t{lho_saturated});
      if (field_n_bytes < needed_n_bytes) {
        return Corrupt(src, extra_offset + pos,
                       "ZIP64 extra field of " + std::to_string(field_n_bytes) +
                           " bytes is too short for the saturated fields (needs " +
                           std::to_string(needed_n_bytes) + ")");
      }
      const std::byte* p = extra.data() + body;
      if (usize_saturated) {
        entry.n_bytes = LoadU64(p);
        p += 8;
      }
      if (csize_saturated) {
        entry.compressed_n_bytes = LoadU64(p);
        p += 8;
      }
      if (lho_saturated) entry.local_header_offset = LoadU64(p);
    }
    pos = body + field_n_bytes;
  }
  return Status::Ok();
}

// Reads the entry's local header (one read: fixed part + name), checks it against the central
// directory and sets data_offset. `cd_entry_offset` names the central-directory entry in errors
// about values it holds.
Status ResolveLocalHeader(const ByteSource& src, uint64_t cd_offset, uint64_t cd_entry_offset,
                          std::vector<std::byte>& buf, ZipEntry& entry) {
  const uint64_t header_n_bytes = kLocalHeaderBytes + entry.name.size();
  if (!RangeInside(entry.local_header_offset, header_n_bytes, cd_offset)) {
    return Corrupt(src, cd_entry_offset,
                   "entry " + QuoteName(entry.name) + ": local header offset " +
                       std::to_string(entry.local_header_offset) + " (" +
                       std::to_string(header_n_bytes) +
                       " bytes) does not end before the central directory at " +
                       std::to_string(cd_offset));
  }
  buf.resize(header_n_bytes);  // at most 30 + 65,535 bytes
  UCPFS_RETURN_IF_ERROR(src.ReadAt(entry.local_header_offset, buf));
  const std::byte* h = buf.data();
  if (LoadU32(h) != kLocalHeaderSig) {
    return Corrupt(src, entry.local_header_offset,
                   "entry " + QuoteName(entry.name) + ": bad local header signature " +
                       Hex(LoadU32(h), 8));
  }
  const uint16_t local_name_n_bytes = LoadU16(h + 26);
  const uint16_t local_extra_n_bytes = LoadU16(h + 28);
  if (local_name_n_bytes != entry.name.size()) {
    return Corrupt(src, entry.local_header_offset,
                   "entry " + QuoteName(entry.name) + ": local header name length " +
                       std::to_string(local_name_n_bytes) +
                       " differs from the central directory's " +
                       std::to_string(entry.name.size()));
  }
  if (!entry.name.empty() &&
      std::memcmp(h + kLocalHeaderBytes, entry.name.data(), entry.name.size()) != 0) {
    return Corrupt(src, entry.local_header_offset,
                   "entry " + QuoteName(entry.name) +
                       ": local header name differs from the central directory's");
  }
  // The local extra (FB padding, a ZIP64 field with other values) is usually longer than the
  // central one, so the data offset can only come from the local header.
  const auto data_offset = CheckedAdd(entry.local_header_offset + header_n_bytes,
                                      local_extra_n_bytes);
  if (!data_offset || !RangeInside(*data_offset, entry.compressed_n_bytes, cd_offset)) {
    return Corrupt(src, cd_entry_offset,
                   "entry " + QuoteName(entry.name) + ": data of " +
                       std::to_string(entry.compressed_n_bytes) + " bytes at offset " +
                       (data_offset ? std::to_string(*data_offset) : std::string("(overflow)")) +
                       " does not end before the central directory at " +
                       std::to_string(cd_offset));
  }
  entry.data_offset = *data_offset;
  return Status::Ok();
}

}  // namespace

Result<ZipArchive> ZipArchive::Open(const ByteSource& src, const ZipLimits& limits) {
  UCPFS_ASSIGN_OR_RETURN(const EndRecords end, ReadEndRecords(src));

  // A range outside the file is corruption whatever the limits; check it first so a garbage
  // size is reported as such rather than as a limit.
  if (!RangeInside(end.cd_offset, end.cd_n_bytes, end.record_offset)) {
    return Corrupt(src, end.record_offset,
                   "central directory at offset " + std::to_string(end.cd_offset) + " of " +
                       std::to_string(end.cd_n_bytes) +
                       " bytes does not end before the end record");
  }
  if (end.cd_n_bytes > limits.max_cd_bytes) {
    return Exhausted(src, end.record_offset,
                     "central directory of " + std::to_string(end.cd_n_bytes) +
                         " bytes is above the limit of " + std::to_string(limits.max_cd_bytes));
  }
  if (end.n_entries > limits.max_entries) {
    return Exhausted(src, end.record_offset,
                     "central directory declares " + std::to_string(end.n_entries) +
                         " entries, above the limit of " + std::to_string(limits.max_entries));
  }
  // Overflows only with a huge max_entries; checked all the same.
  const auto min_cd_n_bytes = CheckedMul(end.n_entries, kCentralHeaderBytes);
  if (!min_cd_n_bytes || *min_cd_n_bytes > end.cd_n_bytes) {
    return Corrupt(src, end.record_offset,
                   std::to_string(end.n_entries) + " entries cannot fit in a central directory of " +
                       std::to_string(end.cd_n_bytes) + " bytes");
  }
  UCPFS_ASSIGN_OR_RETURN(const std::vector<std::byte> cd,
                         ReadRange(src, end.cd_offset, end.cd_n_bytes, limits.max_cd_bytes));

  ZipArchive archive;
  archive.cd_offset_ = end.cd_offset;
  // Bounded above: n_entries <= max_entries and n_entries * 46 <= bytes already read.
  archive.entries_.reserve(end.n_entries);
  archive.index_.reserve(end.n_entries);
  std::vector<std::byte> local_buf;

  size_t pos = 0;
  for (uint64_t i = 0; i < end.n_entries; ++i) {
    const uint64_t entry_offset = end.cd_offset + pos;
    if (cd.size() - pos < kCentralHeaderBytes) {
      return Corrupt(src, entry_offset,
                     "central directory entry " + std::to_string(i) + " of " +
                         std::to_string(end.n_entries) +
                         " runs past the end of the central directory");
    }
    const std::byte* h = cd.data() + pos;
    if (LoadU32(h) != kCentralHeaderSig) {
      return Corrupt(src, entry_offset,
                     "bad central directory signature " + Hex(LoadU32(h), 8) + " for entry " +
                         std::to_string(i));
    }
    const size_t name_n_bytes = LoadU16(h + 28);
    const size_t extra_n_bytes = LoadU16(h + 30);
    const size_t comment_n_bytes = LoadU16(h + 32);
    const size_t entry_n_bytes = kCentralHeaderBytes + name_n_bytes + extra_n_bytes +
                                 comment_n_bytes;
    if (cd.size() - pos < entry_n_bytes) {
      return Corrupt(src, entry_offset,
                     "central directory entry " + std::to_string(i) + " of " +
                         std::to_string(entry_n_bytes) +
                         " bytes (with name, extra and comment) runs past the end of the "
                         "central directory");
    }

    ZipEntry entry;
    entry.flags = LoadU16(h + 8);
    entry.method = LoadU16(h + 10);
    entry.crc32 = LoadU32(h + 16);
    entry.compressed_n_bytes = LoadU32(h + 20);
    entry.n_bytes = LoadU32(h + 24);
    entry.local_header_offset = LoadU32(h + 42);
    entry.name.assign(reinterpret_cast<const char*>(h + kCentralHeaderBytes), name_n_bytes);
    const uint64_t extra_offset = entry_offset + kCentralHeaderBytes + name_n_bytes;
    UCPFS_RETURN_IF_ERROR(ParseCentralExtra(
        src, extra_offset,
        std::span<const std::byte>(h + kCentralHeaderBytes + name_n_bytes, extra_n_bytes), entry));
    // Callers read stored entries as raw bytes of n_bytes; the two sizes must agree.
    if (entry.method == 0 && entry.compressed_n_bytes != entry.n_bytes) {
      return Corrupt(src, entry_offset,
                     "stored entry " + QuoteName(entry.name) + " has compressed size " +
                         std::to_string(entry.compressed_n_bytes) + " but size " +
                         std::to_string(entry.n_bytes));
    }
    UCPFS_RETURN_IF_ERROR(
        ResolveLocalHeader(src, end.cd_offset, entry_offset, local_buf, entry));

    archive.index_.emplace(entry.name, archive.entries_.size());  // keeps the first duplicate
    archive.entries_.push_back(std::move(entry));
    pos += entry_n_bytes;
  }

  if (!archive.entries_.empty()) {
    const std::string& first = archive.entries_.front().name;
    const size_t slash = first.find('/');
    if (slash != std::string::npos) archive.prefix_ = first.substr(0, slash);
  }
  return archive;
}

ZipArchive ZipArchive::FromRecords(std::vector<ZipEntry> entries) {
  ZipArchive archive;
  archive.entries_ = std::move(entries);
  for (size_t i = 0; i < archive.entries_.size(); ++i) archive.index_.emplace(archive.entries_[i].name, i);
  return archive;
}

const ZipEntry* ZipArchive::Find(std::string_view full_name) const {
  const auto it = index_.find(full_name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const ZipEntry* ZipArchive::FindRecord(std::string_view record) const {
  if (prefix_.empty()) return Find(record);
  std::string full_name;
  full_name.reserve(prefix_.size() + 1 + record.size());
  full_name.append(prefix_).append(1, '/').append(record);
  return Find(full_name);
}

Result<bool> CheckEntryCrc32(const ByteSource& src, const ZipEntry& entry,
                             const std::function<void(uint64_t)>& on_bytes) {
  if (entry.method != 0) {
    return UnsupportedError(src.Name() + ": zip entry '" + entry.name + "' is compressed (method " +
                            std::to_string(entry.method) + ")");
  }
  if (entry.crc32 == 0 && entry.n_bytes != 0) return false;
  std::vector<std::byte> buf(static_cast<size_t>(std::min<uint64_t>(entry.n_bytes, 1u << 20)));
  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (uint64_t done = 0; done < entry.n_bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), entry.n_bytes - done));
    UCPFS_RETURN_IF_ERROR(src.ReadAt(entry.data_offset + done, std::span(buf.data(), n)));
    crc = ::crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), static_cast<uInt>(n));
    done += n;
    if (on_bytes) on_bytes(n);
  }
  if (static_cast<uint32_t>(crc) != entry.crc32) {
    char text[96];
    std::snprintf(text, sizeof(text), "CRC-32 %08x of its %llu bytes, the zip header says %08x",
                  static_cast<unsigned>(crc), static_cast<unsigned long long>(entry.n_bytes), entry.crc32);
    return Status(StatusCode::kDataLoss, src.Name() + ": zip entry '" + entry.name + "' (at byte " +
                                             std::to_string(entry.data_offset) + "): " + text);
  }
  return true;
}

}  // namespace ucpfs::format
