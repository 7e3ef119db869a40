// libFuzzer target: safetensors files and model.safetensors.index.json (untrusted: they come
// with the checkpoint) must parse or give a clean error, never crash, hang or allocate without
// bound. Each input is tried three ways: as a whole file; framed (byte 0 ignored, bytes 1-2 a
// little-endian data size, the rest the header JSON, given its true length, so the fuzzer works
// on the JSON instead of the 8-byte length); and as index text. What parses must hold the
// reader's promises (tensors tile the data buffer exactly, sizes match shapes), and the lazy
// writer fed the parsed tensors must write a file the reader parses back to the same tensors.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/checked.h"
#include "core/format/safetensors.h"

namespace {

using namespace ucpfs;
using namespace ucpfs::format;

// A tensor's bytes, served from the parsed source.
class SourceProvider final : public TensorBytesProvider {
 public:
  SourceProvider(const ByteSource& src, uint64_t byte_offset) : src_(src), byte_offset_(byte_offset) {}
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    return src_.ReadAt(byte_offset_ + byte_offset, out);
  }

 private:
  const ByteSource& src_;
  uint64_t byte_offset_;
};

void Check(bool ok) {
  if (!ok) std::abort();
}

void CheckParsed(const ByteSource& src, const SafetensorsHeader& h) {
  Check(h.data_byte_offset == 8 + h.header_n_bytes);
  uint64_t covered = h.data_byte_offset;
  for (const SafetensorsTensor& t : h.tensors) {
    Check(t.byte_offset == covered);
    uint64_t n = ItemSize(t.dtype);
    for (int64_t d : t.shape) {
      Check(d >= 0);
      const auto next = CheckedMul(n, static_cast<uint64_t>(d));
      Check(next.has_value());
      n = *next;
    }
    Check(n == t.n_bytes);
    covered += t.n_bytes;
  }
  Check(covered == src.Size());
}

// Writes the parsed tensors again and reads the result back.
void RoundTrip(const ByteSource& src, const SafetensorsHeader& h) {
  std::vector<std::pair<std::string, SaveTensor>> tensors;
  for (const SafetensorsTensor& t : h.tensors) {
    // The writer refuses what save_file cannot write: an empty name, "__metadata__" is
    // impossible here (the reader takes it for metadata).
    if (t.name.empty()) return;
    tensors.push_back({t.name, SaveTensor{.dtype = t.dtype, .shape = t.shape,
                                          .provider = std::make_shared<SourceProvider>(src, t.byte_offset)}});
  }
  auto file = LazySafetensorsFile::Build(std::move(tensors), h.metadata, "rewritten");
  Check(file.ok());
  std::vector<std::byte> bytes((*file)->Size());
  Check((*file)->ReadAt(0, bytes).ok());
  MemorySource again("rewritten", std::move(bytes));
  auto h2 = ReadSafetensors(again);
  Check(h2.ok());
  Check(h2->metadata == h.metadata && h2->tensors.size() == h.tensors.size());
  uint64_t n_bytes = 0;
  for (const SafetensorsTensor& t : h2->tensors) n_bytes += t.n_bytes;
  Check(again.Size() == h2->data_byte_offset + n_bytes);
}

void TryFile(const ByteSource& src) {
  SafetensorsLimits limits;
  limits.max_tensors = 4096;
  auto h = ReadSafetensors(src, limits);
  if (!h.ok()) {
    Check(!h.error().message().empty());
    return;
  }
  CheckParsed(src, *h);
  RoundTrip(src, *h);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  TryFile(MemorySource("fuzz.safetensors", std::span<const uint8_t>(data, size)));

  if (size >= 3) {
    const size_t json_n_bytes = size - 3;
    const size_t data_n_bytes = static_cast<size_t>(data[1]) | static_cast<size_t>(data[2]) << 8;
    std::vector<std::byte> framed;
    framed.reserve(8 + json_n_bytes + data_n_bytes);
    for (int i = 0; i < 8; ++i) framed.push_back(static_cast<std::byte>((json_n_bytes >> (8 * i)) & 0xFF));
    const auto* json = reinterpret_cast<const std::byte*>(data + 3);
    framed.insert(framed.end(), json, json + json_n_bytes);
    for (size_t i = 0; i < data_n_bytes; ++i) framed.push_back(static_cast<std::byte>(i & 0xFF));
    TryFile(MemorySource("framed.safetensors", std::move(framed)));
  }

  SafetensorsLimits limits;
  limits.max_tensors = 4096;
  auto index = ParseSafetensorsIndex(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.json", limits);
  if (index.ok()) {
    // What parses must come back from the writer's text (names are valid UTF-8 by then).
    const std::string text = SafetensorsIndexJson(size, *index);
    auto again = ParseSafetensorsIndex(text, "rewritten.json");
    Check(again.ok() && again->size() == index->size());
  }
  return 0;
}
