// libFuzzer target for ZipArchive::Open: any byte string must give a Status, never a crash,
// and an archive that opens must keep its promises: every entry's data range lies before the
// central directory inside the file (so reading it succeeds) and Find/FindRecord find it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "core/byte_source.h"
#include "core/format/zip_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ucpfs::MemorySource src("fuzz.zip", std::span<const uint8_t>(data, size));
  // Small limits keep the fuzzer's memory use bounded; the logic they guard is the same.
  auto archive = ucpfs::format::ZipArchive::Open(src, {.max_entries = 1u << 16,
                                                       .max_cd_bytes = 16u << 20});
  if (!archive.ok()) return 0;
  if (archive->cd_offset() > src.Size()) __builtin_trap();
  const std::string& prefix = archive->prefix();
  std::vector<std::byte> head;
  for (const ucpfs::format::ZipEntry& entry : archive->entries()) {
    if (entry.data_offset > archive->cd_offset() ||
        entry.compressed_n_bytes > archive->cd_offset() - entry.data_offset) {
      __builtin_trap();
    }
    if (archive->Find(entry.name) == nullptr) __builtin_trap();
    const std::string_view name = entry.name;
    if (prefix.empty()) {
      if (archive->FindRecord(name) == nullptr) __builtin_trap();
    } else if (name.size() > prefix.size() && name.starts_with(prefix) &&
               name[prefix.size()] == '/') {
      if (archive->FindRecord(name.substr(prefix.size() + 1)) == nullptr) __builtin_trap();
    }
    head.resize(std::min<uint64_t>(64, entry.compressed_n_bytes));
    if (!src.ReadAt(entry.data_offset, head).ok()) __builtin_trap();
  }
  return 0;
}
