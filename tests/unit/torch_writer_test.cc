// Tests for LazyTorchFile (core/format/torch_writer.h): exact zip bytes (FB padding, 64-byte
// alignment, descriptors, central directory, ZIP64 records), pickle bytes against hand-written
// opcode sequences, chunked reads against whole reads (seeded; the seed is logged and can be
// set with UCPFS_TEST_SEED), providers touched only for tensor bytes, ZIP64 thresholds on
// files of several GiB whose tensor bytes are fabricated from the offset (nothing big is
// allocated), error propagation and input validation.
#include "core/format/torch_writer.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/checked.h"

namespace ucpfs::format {
namespace {

constexpr uint64_t kU32Max = 0xFFFFFFFFu;

// Tensor bytes fabricated from the offset; counts calls and checks every range.
class PatternProvider final : public TensorBytesProvider {
 public:
  PatternProvider(uint64_t n_bytes, uint8_t seed) : n_bytes_(n_bytes), seed_(seed) {}

  static std::byte ByteAt(uint8_t seed, uint64_t o) {
    const uint64_t x = o ^ (o >> 8) ^ (o >> 16) ^ (o >> 24) ^ (o >> 32);
    return static_cast<std::byte>(static_cast<uint8_t>(x * 31u + seed));
  }

  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    ++calls_;
    ranges_.emplace_back(byte_offset, out.size());
    if (out.empty() || !RangeInside(byte_offset, out.size(), n_bytes_)) {
      ADD_FAILURE() << "provider asked for " << out.size() << " bytes at " << byte_offset
                    << " of a " << n_bytes_ << "-byte tensor";
      return OutOfRangeError("bad provider range");
    }
    for (size_t i = 0; i < out.size(); ++i) out[i] = ByteAt(seed_, byte_offset + i);
    return Status::Ok();
  }

  int calls() const { return calls_; }
  const std::vector<std::pair<uint64_t, uint64_t>>& ranges() const { return ranges_; }
  void Reset() const {
    calls_ = 0;
    ranges_.clear();
  }

 private:
  uint64_t n_bytes_;
  uint8_t seed_;
  mutable int calls_ = 0;
  mutable std::vector<std::pair<uint64_t, uint64_t>> ranges_;
};

class FailingProvider final : public TensorBytesProvider {
 public:
  Status Read(uint64_t, std::span<std::byte>) const override {
    return IoError("disk.bin: pread: Input/output error", EIO);
  }
};

uint64_t NBytes(DType dtype, const std::vector<int64_t>& shape) {
  uint64_t n = ItemSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// A tensor with a PatternProvider; the provider is returned through `out` when wanted.
SaveValue PT(DType dtype, std::vector<int64_t> shape, uint8_t seed,
             std::shared_ptr<PatternProvider>* out = nullptr) {
  auto p = std::make_shared<PatternProvider>(NBytes(dtype, shape), seed);
  if (out != nullptr) *out = p;
  return SaveValue::Tensor(dtype, std::move(shape), p);
}

std::vector<uint8_t> ReadAll(const LazyTorchFile& f) {
  std::vector<uint8_t> out(f.Size());
  Status st = f.ReadAt(0, std::as_writable_bytes(std::span<uint8_t>(out)));
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

std::vector<uint8_t> ReadRange(const LazyTorchFile& f, uint64_t off, size_t n) {
  std::vector<uint8_t> out(n);
  Status st = f.ReadAt(off, std::as_writable_bytes(std::span<uint8_t>(out)));
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

uint64_t Le(const std::vector<uint8_t>& b, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | b.at(at + static_cast<size_t>(i));
  return v;
}

std::string Str(const std::vector<uint8_t>& b, size_t at, size_t n) {
  return std::string(reinterpret_cast<const char*>(b.data() + at), n);
}

std::vector<uint8_t> Bytes(std::string_view s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::shared_ptr<LazyTorchFile> MustBuild(const SaveValue& v, const SaveOptions& o = {}) {
  auto r = LazyTorchFile::Build(v, "test.pt", o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : nullptr;
}

// The size formula of docs/formats.md "torch.save files", from the layout alone.
uint64_t SizeFormula(const LazyTorchFile& f, const std::string& prefix) {
  uint64_t total = 0;
  for (const auto& r : f.records()) {
    const uint64_t name = prefix.size() + 1 + r.name.size();
    total += 30 + name + r.local_extra_n_bytes + r.n_bytes + r.descriptor_n_bytes;
    total += 46 + name + r.central_extra_n_bytes;
  }
  return total + 56 + 20 + 22;
}

// torch 2.x `_get_offset` (calculate_storage_offsets): every storage after data/0 is assumed
// to start right after the previous one; its data offset follows the getPadding formula.
void ExpectComputedOffsetsMatch(const LazyTorchFile& f, const std::string& prefix,
                                uint64_t alignment) {
  const RecordLayout* prev = nullptr;
  for (const auto& r : f.records()) {
    if (r.tensor_index < 0) continue;
    EXPECT_EQ(r.name, "data/" + std::to_string(r.tensor_index));
    if (prev != nullptr) {
      EXPECT_EQ(r.tensor_index, prev->tensor_index + 1);
      uint64_t cursor = prev->data_offset + prev->n_bytes;
      if (prev->n_bytes > 0) {
        cursor += (prev->local_header_offset >= kU32Max || prev->n_bytes >= kU32Max) ? 24 : 16;
      }
      uint64_t start = cursor + 30 + prefix.size() + 1 + r.name.size() + 4;
      if (r.n_bytes >= kU32Max || cursor >= kU32Max) {
        start += 4;
        if (r.n_bytes >= kU32Max) start += 16;
        if (cursor >= kU32Max) start += 8;
      }
      start += (alignment - start % alignment) % alignment;
      EXPECT_EQ(cursor, r.local_header_offset) << r.name;
      EXPECT_EQ(start, r.data_offset) << r.name;
    }
    prev = &r;
  }
}

// Checks one local header, its FB padding and its ZIP64 extra against the layout; returns
// the header's bytes (read through ReadAt).
void CheckLocalHeader(const LazyTorchFile& f, const RecordLayout& r, const std::string& prefix) {
  const std::string full = prefix + "/" + r.name;
  const size_t header_n = 30 + full.size() + r.local_extra_n_bytes;
  ASSERT_EQ(r.local_header_offset + header_n, r.data_offset) << r.name;
  const auto h = ReadRange(f, r.local_header_offset, header_n);
  EXPECT_EQ(Le(h, 0, 4), 0x04034b50u);
  EXPECT_EQ(Le(h, 4, 2), 0u);  // version needed
  EXPECT_EQ(Le(h, 6, 2), r.n_bytes == 0 ? 0x0800u : 0x0808u) << r.name;
  EXPECT_EQ(Le(h, 8, 2), 0u);  // stored
  EXPECT_EQ(Le(h, 10, 4), 0u);
  EXPECT_EQ(Le(h, 14, 4), 0u);  // crc, sizes: in the descriptor
  EXPECT_EQ(Le(h, 18, 4), 0u);
  EXPECT_EQ(Le(h, 22, 4), 0u);
  EXPECT_EQ(Le(h, 26, 2), full.size());
  EXPECT_EQ(Le(h, 28, 2), r.local_extra_n_bytes);
  EXPECT_EQ(Str(h, 30, full.size()), full);
  size_t at = 30 + full.size();
  const bool big = r.n_bytes >= kU32Max;
  const bool far = r.local_header_offset >= kU32Max;
  EXPECT_EQ(r.zip64, big || far) << r.name;
  if (r.zip64) {
    EXPECT_EQ(Le(h, at, 2), 1u) << r.name;
    EXPECT_EQ(Le(h, at + 2, 2), (big ? 16u : 0u) + (far ? 8u : 0u)) << r.name;
    at += 4;
    if (big) {
      EXPECT_EQ(Le(h, at, 8), r.n_bytes) << r.name;
      EXPECT_EQ(Le(h, at + 8, 8), 0u) << r.name;
      at += 16;
    }
    if (far) {
      EXPECT_EQ(Le(h, at, 8), r.local_header_offset) << r.name;
      at += 8;
    }
  }
  EXPECT_EQ(Str(h, at, 2), "FB") << r.name;
  const uint64_t pad = Le(h, at + 2, 2);
  EXPECT_EQ(at + 4 + pad, header_n) << r.name;
  EXPECT_EQ(Str(h, at + 4, pad), std::string(pad, 'Z')) << r.name;
}

void CheckDescriptor(const LazyTorchFile& f, const RecordLayout& r) {
  const bool z64 = r.n_bytes >= kU32Max || r.local_header_offset >= kU32Max;
  if (r.n_bytes == 0) {
    EXPECT_EQ(r.descriptor_n_bytes, 0) << r.name;
    return;
  }
  ASSERT_EQ(r.descriptor_n_bytes, z64 ? 24 : 16) << r.name;
  const auto d = ReadRange(f, r.data_offset + r.n_bytes, r.descriptor_n_bytes);
  EXPECT_EQ(Le(d, 0, 4), 0x08074b50u);
  EXPECT_EQ(Le(d, 4, 4), r.crc32);
  const int w = z64 ? 8 : 4;
  EXPECT_EQ(Le(d, 8, w), r.n_bytes) << r.name;
  EXPECT_EQ(Le(d, 8 + static_cast<size_t>(w), w), r.n_bytes) << r.name;
}

// Walks the central directory and the end records and checks them against the layout.
void CheckCentralDirectoryAndEnd(const LazyTorchFile& f, const std::string& prefix) {
  const auto& recs = f.records();
  const uint64_t tail_n = f.Size() - f.cd_offset();
  const auto cd = ReadRange(f, f.cd_offset(), static_cast<size_t>(tail_n));
  size_t at = 0;
  for (const auto& r : recs) {
    const std::string full = prefix + "/" + r.name;
    const bool big = r.n_bytes >= kU32Max;
    const bool far = r.local_header_offset >= kU32Max;
    EXPECT_EQ(Le(cd, at, 4), 0x02014b50u) << r.name;
    EXPECT_EQ(Le(cd, at + 4, 2), 0u);
    EXPECT_EQ(Le(cd, at + 6, 2), 0u);
    EXPECT_EQ(Le(cd, at + 8, 2), r.n_bytes == 0 ? 0x0800u : 0x0808u);
    EXPECT_EQ(Le(cd, at + 10, 2), 0u);
    EXPECT_EQ(Le(cd, at + 12, 4), 0u);
    EXPECT_EQ(Le(cd, at + 16, 4), r.crc32);
    EXPECT_EQ(Le(cd, at + 20, 4), big ? kU32Max : r.n_bytes) << r.name;
    EXPECT_EQ(Le(cd, at + 24, 4), big ? kU32Max : r.n_bytes) << r.name;
    EXPECT_EQ(Le(cd, at + 28, 2), full.size());
    const uint64_t extra_n = Le(cd, at + 30, 2);
    EXPECT_EQ(extra_n, r.central_extra_n_bytes);
    EXPECT_EQ(Le(cd, at + 32, 2), 0u);
    EXPECT_EQ(Le(cd, at + 34, 2), 0u);
    EXPECT_EQ(Le(cd, at + 36, 2), 0u);
    EXPECT_EQ(Le(cd, at + 38, 4), 0u);
    EXPECT_EQ(Le(cd, at + 42, 4), far ? kU32Max : r.local_header_offset) << r.name;
    EXPECT_EQ(Str(cd, at + 46, full.size()), full);
    size_t x = at + 46 + full.size();
    if (big || far) {
      EXPECT_EQ(extra_n, 4u + (big ? 16u : 0u) + (far ? 8u : 0u)) << r.name;
      EXPECT_EQ(Le(cd, x, 2), 1u);
      EXPECT_EQ(Le(cd, x + 2, 2), extra_n - 4);
      x += 4;
      if (big) {
        EXPECT_EQ(Le(cd, x, 8), r.n_bytes);
        EXPECT_EQ(Le(cd, x + 8, 8), r.n_bytes);
        x += 16;
      }
      if (far) {
        EXPECT_EQ(Le(cd, x, 8), r.local_header_offset);
      }
    } else {
      EXPECT_EQ(extra_n, 0u) << r.name;
    }
    at += 46 + full.size() + extra_n;
  }
  EXPECT_EQ(at, f.cd_n_bytes());
  EXPECT_EQ(f.cd_offset() + at, f.zip64_eocd_offset());
  const uint64_t n = recs.size();
  // ZIP64 EOCD (56 bytes)
  EXPECT_EQ(Le(cd, at, 4), 0x06064b50u);
  EXPECT_EQ(Le(cd, at + 4, 8), 44u);
  EXPECT_EQ(Le(cd, at + 12, 2), 0x031eu);
  EXPECT_EQ(Le(cd, at + 14, 2), 45u);
  EXPECT_EQ(Le(cd, at + 16, 4), 0u);
  EXPECT_EQ(Le(cd, at + 20, 4), 0u);
  EXPECT_EQ(Le(cd, at + 24, 8), n);
  EXPECT_EQ(Le(cd, at + 32, 8), n);
  EXPECT_EQ(Le(cd, at + 40, 8), f.cd_n_bytes());
  EXPECT_EQ(Le(cd, at + 48, 8), f.cd_offset());
  at += 56;
  // ZIP64 locator (20 bytes)
  EXPECT_EQ(Le(cd, at, 4), 0x07064b50u);
  EXPECT_EQ(Le(cd, at + 4, 4), 0u);
  EXPECT_EQ(Le(cd, at + 8, 8), f.zip64_eocd_offset());
  EXPECT_EQ(Le(cd, at + 16, 4), 1u);
  at += 20;
  // EOCD (22 bytes)
  EXPECT_EQ(Le(cd, at, 4), 0x06054b50u);
  EXPECT_EQ(Le(cd, at + 4, 2), 0u);
  EXPECT_EQ(Le(cd, at + 6, 2), 0u);
  EXPECT_EQ(Le(cd, at + 8, 2), std::min<uint64_t>(n, 0xFFFF));
  EXPECT_EQ(Le(cd, at + 10, 2), std::min<uint64_t>(n, 0xFFFF));
  EXPECT_EQ(Le(cd, at + 12, 4), std::min(f.cd_n_bytes(), kU32Max));
  EXPECT_EQ(Le(cd, at + 16, 4), std::min(f.cd_offset(), kU32Max));
  EXPECT_EQ(Le(cd, at + 20, 2), 0u);
  EXPECT_EQ(at + 22, cd.size());
}

void CheckWholeLayout(const LazyTorchFile& f, const std::string& prefix, uint64_t alignment) {
  uint64_t cursor = 0;
  for (const auto& r : f.records()) {
    EXPECT_EQ(r.local_header_offset, cursor) << r.name;
    EXPECT_EQ(r.data_offset % alignment, 0u) << r.name;
    CheckLocalHeader(f, r, prefix);
    CheckDescriptor(f, r);
    cursor = r.data_offset + r.n_bytes + r.descriptor_n_bytes;
  }
  EXPECT_EQ(cursor, f.cd_offset());
  CheckCentralDirectoryAndEnd(f, prefix);
  EXPECT_EQ(f.Size(), SizeFormula(f, prefix));
  ExpectComputedOffsetsMatch(f, prefix, alignment);
}

uint64_t TestSeed() {
  if (const char* s = std::getenv("UCPFS_TEST_SEED"); s != nullptr && *s != '\0') {
    return std::strtoull(s, nullptr, 10);
  }
  return std::random_device{}();
}

// ------------------------------------------------------------------------------ the tests

TEST(TorchWriter, SmallFileExactHeaders) {
  std::shared_ptr<PatternProvider> w, e;
  SaveValue root = SaveValue::OrderedDict();
  root.Set("w", PT(DType::kFloat32, {2, 3}, 1, &w));
  root.Set("empty", PT(DType::kFloat32, {0}, 2, &e));
  root.Set("step", SaveValue::Int(7));
  auto f = MustBuild(root);
  ASSERT_NE(f, nullptr);

  const auto& recs = f->records();
  std::vector<std::string> names;
  for (const auto& r : recs) names.push_back(r.name);
  EXPECT_EQ(names, (std::vector<std::string>{"data.pkl", ".format_version", ".storage_alignment",
                                             "byteorder", "data/0", "data/1", "version",
                                             ".data/serialization_id"}));
  EXPECT_EQ(f->n_tensors(), 2u);

  const auto all = ReadAll(*f);
  ASSERT_EQ(all.size(), f->Size());

  // The first local header, byte for byte: "archive/data.pkl" is 16 bytes, so the data would
  // start at 30 + 16 + 4 = 50 and the FB field pads 14 'Z's to reach 64.
  std::vector<uint8_t> expect_head = {0x50, 0x4b, 0x03, 0x04,  // signature
                                      0x00, 0x00,              // version needed
                                      0x08, 0x08,              // flags
                                      0x00, 0x00,              // stored
                                      0x00, 0x00, 0x00, 0x00,  // time, date
                                      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  // crc, sizes
                                      0x10, 0x00,              // name length 16
                                      0x12, 0x00};             // extra length 18
  for (char c : std::string("archive/data.pkl")) expect_head.push_back(static_cast<uint8_t>(c));
  expect_head.insert(expect_head.end(), {'F', 'B', 0x0e, 0x00});
  expect_head.insert(expect_head.end(), 14, 'Z');
  ASSERT_EQ(expect_head.size(), 64u);
  EXPECT_EQ(std::vector<uint8_t>(all.begin(), all.begin() + 64), expect_head);
  EXPECT_EQ(recs[0].data_offset, 64u);

  // In-memory record contents and their real CRCs; tensor records have CRC 0.
  auto content = [&](const RecordLayout& r) {
    return std::vector<uint8_t>(all.begin() + static_cast<ptrdiff_t>(r.data_offset),
                                all.begin() + static_cast<ptrdiff_t>(r.data_offset + r.n_bytes));
  };
  EXPECT_EQ(content(recs[1]), Bytes("1"));
  EXPECT_EQ(content(recs[2]), Bytes("64"));
  EXPECT_EQ(content(recs[3]), Bytes("little"));
  EXPECT_EQ(content(recs[6]), Bytes("3\n"));
  const auto sid = content(recs[7]);
  ASSERT_EQ(sid.size(), 40u);
  for (uint8_t c : sid) EXPECT_TRUE(c >= '0' && c <= '9');
  const auto pk = f->pickle();
  EXPECT_EQ(content(recs[0]),
            std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(pk.data()),
                                 reinterpret_cast<const uint8_t*>(pk.data()) + pk.size()));
  for (size_t i : {0, 1, 2, 3, 6, 7}) {
    const auto c = content(recs[i]);
    EXPECT_EQ(recs[i].crc32, static_cast<uint32_t>(crc32(0, c.data(), static_cast<uInt>(c.size()))))
        << recs[i].name;
    EXPECT_EQ(recs[i].tensor_index, -1);
  }
  EXPECT_EQ(recs[4].crc32, 0u);
  EXPECT_EQ(recs[4].tensor_index, 0);
  EXPECT_EQ(recs[4].n_bytes, 24u);
  for (size_t i = 0; i < 24; ++i) {
    EXPECT_EQ(all[recs[4].data_offset + i], static_cast<uint8_t>(PatternProvider::ByteAt(1, i)));
  }
  // The empty tensor: a 0-byte record, flags 0x0800, no descriptor; version starts right at
  // its data offset.
  EXPECT_EQ(recs[5].n_bytes, 0u);
  EXPECT_EQ(recs[5].descriptor_n_bytes, 0);
  EXPECT_EQ(recs[6].local_header_offset, recs[5].data_offset);
  EXPECT_EQ(e->calls(), 0);

  CheckWholeLayout(*f, "archive", 64);

  // Deterministic: the same description gives the same bytes.
  auto f2 = MustBuild(root);
  EXPECT_EQ(ReadAll(*f2), all);
}

TEST(TorchWriter, AlignmentAndPrefixOptions) {
  SaveOptions o;
  o.prefix = "model";
  o.alignment = 4096;
  SaveValue root = SaveValue::Dict();
  root.Set("a", PT(DType::kBFloat16, {3, 5}, 3));
  root.Set("b", PT(DType::kInt8, {7}, 4));
  auto f = MustBuild(root, o);
  ASSERT_NE(f, nullptr);
  CheckWholeLayout(*f, "model", 4096);
  const auto& r = f->records()[2];
  ASSERT_EQ(r.name, ".storage_alignment");
  EXPECT_EQ(ReadRange(*f, r.data_offset, r.n_bytes), Bytes("4096"));
}

TEST(TorchWriter, ChunkedReadsEqualWholeRead) {
  const uint64_t seed = TestSeed();
  std::cout << "[ seed ] UCPFS_TEST_SEED=" << seed << "\n";
  SCOPED_TRACE("UCPFS_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);

  SaveValue root = SaveValue::OrderedDict();
  root.Set("big", PT(DType::kFloat32, {300, 7}, 5));
  root.Set("scalar", PT(DType::kFloat64, {}, 6));
  root.Set("empty", PT(DType::kInt16, {3, 0}, 7));
  SaveValue list = SaveValue::List();
  for (int i = 0; i < 5; ++i) {
    list.Append(PT(DType::kUInt8, {i * 13 + 1}, static_cast<uint8_t>(10 + i)));
  }
  root.Set("list", std::move(list));
  root.Set("name", SaveValue::Str("chunks"));
  auto f = MustBuild(root);
  ASSERT_NE(f, nullptr);
  const auto all = ReadAll(*f);

  for (int round = 0; round < 200; ++round) {
    const uint64_t off = rng() % (f->Size() + 1);
    const uint64_t max_n = f->Size() - off;
    uint64_t n = 0;
    switch (rng() % 4) {
      case 0: n = max_n == 0 ? 0 : rng() % std::min<uint64_t>(max_n, 16) + 1; break;
      case 1: n = max_n == 0 ? 0 : rng() % std::min<uint64_t>(max_n, 300) + 1; break;
      case 2: n = max_n == 0 ? 0 : rng() % max_n + 1; break;
      default: n = max_n; break;
    }
    EXPECT_EQ(ReadRange(*f, off, static_cast<size_t>(n)),
              std::vector<uint8_t>(all.begin() + static_cast<ptrdiff_t>(off),
                                   all.begin() + static_cast<ptrdiff_t>(off + n)))
        << "offset " << off << " length " << n;
  }
  // Sequential reads in random chunk sizes reassemble the file.
  std::vector<uint8_t> re;
  for (uint64_t off = 0; off < f->Size();) {
    const uint64_t n = std::min<uint64_t>(rng() % 97 + 1, f->Size() - off);
    const auto part = ReadRange(*f, off, static_cast<size_t>(n));
    re.insert(re.end(), part.begin(), part.end());
    off += n;
  }
  EXPECT_EQ(re, all);

  // Out of range.
  std::vector<std::byte> buf(2);
  EXPECT_EQ(f->ReadAt(f->Size() - 1, buf).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(f->ReadAt(~0ull, buf).code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(f->ReadAt(f->Size(), std::span<std::byte>()).ok());
}

TEST(TorchWriter, ProvidersCalledOnlyForTensorBytes) {
  std::shared_ptr<PatternProvider> a, b;
  SaveValue root = SaveValue::OrderedDict();
  root.Set("a", PT(DType::kInt64, {100}, 20, &a));
  root.Set("b", PT(DType::kFloat16, {50}, 21, &b));
  auto f = MustBuild(root);
  ASSERT_NE(f, nullptr);
  const auto& ra = f->records()[4];
  const auto& rb = f->records()[5];
  ASSERT_EQ(ra.name, "data/0");
  ASSERT_EQ(rb.name, "data/1");

  // Header-only reads: everything before data/0, the gap between tensors, and the tail.
  ReadRange(*f, 0, static_cast<size_t>(ra.data_offset));
  ReadRange(*f, ra.data_offset + ra.n_bytes,
            static_cast<size_t>(rb.data_offset - (ra.data_offset + ra.n_bytes)));
  ReadRange(*f, rb.data_offset + rb.n_bytes,
            static_cast<size_t>(f->Size() - (rb.data_offset + rb.n_bytes)));
  EXPECT_EQ(a->calls(), 0);
  EXPECT_EQ(b->calls(), 0);

  // A read spanning the end of a, the headers in between and the start of b.
  const uint64_t off = ra.data_offset + ra.n_bytes - 10;
  const uint64_t n = rb.data_offset + 6 - off;
  const auto got = ReadRange(*f, off, static_cast<size_t>(n));
  ASSERT_EQ(a->ranges().size(), 1u);
  EXPECT_EQ(a->ranges()[0], std::make_pair(uint64_t{790}, uint64_t{10}));
  ASSERT_EQ(b->ranges().size(), 1u);
  EXPECT_EQ(b->ranges()[0], std::make_pair(uint64_t{0}, uint64_t{6}));
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(got[i], static_cast<uint8_t>(PatternProvider::ByteAt(20, 790 + i)));
  }
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(got[n - 6 + i], static_cast<uint8_t>(PatternProvider::ByteAt(21, i)));
  }
}

TEST(TorchWriter, ProviderErrorPropagates) {
  SaveValue root = SaveValue::OrderedDict();
  root.Set("ok", PT(DType::kFloat32, {4}, 1));
  root.Set("bad", SaveValue::Tensor(DType::kFloat32, {4}, std::make_shared<FailingProvider>()));
  auto f = MustBuild(root);
  ASSERT_NE(f, nullptr);
  const auto& bad = f->records()[5];
  ASSERT_EQ(bad.name, "data/1");
  std::vector<std::byte> buf(f->Size());
  Status st = f->ReadAt(0, buf);
  EXPECT_EQ(st.code(), StatusCode::kIo);
  EXPECT_EQ(st.sys_errno(), EIO);
  EXPECT_NE(st.message().find("data/1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("pread"), std::string::npos) << st.message();
  // Reads that do not touch the failing tensor still work.
  EXPECT_TRUE(f->ReadAt(0, std::span<std::byte>(buf).first(bad.data_offset)).ok());
  EXPECT_TRUE(f->ReadAt(bad.data_offset + bad.n_bytes,
                        std::span<std::byte>(buf).first(f->Size() - bad.data_offset - bad.n_bytes))
                  .ok());
  EXPECT_EQ(f->ReadAt(bad.data_offset + 3, std::span<std::byte>(buf).first(1)).code(),
            StatusCode::kIo);
}

// Records of exactly 0xFFFFFFFF bytes (ZIP64), 0xFFFFFFFE bytes (not ZIP64 by size), and
// records whose local header lands past 4 GiB (ZIP64 by offset).
TEST(TorchWriter, Zip64Thresholds) {
  std::shared_ptr<PatternProvider> p0, p1, p2, p3;
  SaveValue root = SaveValue::OrderedDict();
  root.Set("small_first", PT(DType::kUInt8, {0xFFFFFFFE}, 30, &p0));  // data/0: no ZIP64
  root.Set("exact", PT(DType::kUInt8, {0xFFFFFFFF}, 31, &p1));        // data/1: big + far
  root.Set("after", PT(DType::kFloat32, {4}, 32, &p2));               // data/2: far only
  root.Set("empty_far", PT(DType::kFloat32, {0}, 33, &p3));           // data/3: far, 0 bytes
  auto f = MustBuild(root);
  ASSERT_NE(f, nullptr);
  const auto& recs = f->records();
  ASSERT_EQ(recs.size(), 10u);
  const RecordLayout& r0 = recs[4];
  const RecordLayout& r1 = recs[5];
  const RecordLayout& r2 = recs[6];
  const RecordLayout& r3 = recs[7];

  EXPECT_FALSE(r0.zip64);
  EXPECT_EQ(r0.n_bytes, 0xFFFFFFFEu);
  EXPECT_EQ(r0.descriptor_n_bytes, 16);
  EXPECT_EQ(r0.central_extra_n_bytes, 0);

  EXPECT_TRUE(r1.zip64);
  EXPECT_GE(r1.local_header_offset, kU32Max);
  EXPECT_EQ(r1.n_bytes, kU32Max);
  EXPECT_EQ(r1.descriptor_n_bytes, 24);
  EXPECT_EQ(r1.central_extra_n_bytes, 4 + 24);
  EXPECT_GE(r1.local_extra_n_bytes, 4 + 24 + 4);

  EXPECT_TRUE(r2.zip64);
  EXPECT_EQ(r2.descriptor_n_bytes, 24);
  EXPECT_EQ(r2.central_extra_n_bytes, 4 + 8);

  EXPECT_TRUE(r3.zip64);  // ZIP64 extra by offset, but an empty record has no descriptor
  EXPECT_EQ(r3.descriptor_n_bytes, 0);
  EXPECT_EQ(r3.central_extra_n_bytes, 4 + 8);

  // In-memory records past 4 GiB get ZIP64 too.
  EXPECT_TRUE(recs[8].zip64);
  EXPECT_EQ(recs[8].name, "version");
  EXPECT_EQ(recs[8].descriptor_n_bytes, 24);
  EXPECT_GT(f->cd_offset(), kU32Max);

  // Every header, descriptor, CD entry and end record, read without touching tensor data.
  CheckWholeLayout(*f, "archive", 64);
  EXPECT_EQ(p0->calls() + p1->calls() + p2->calls() + p3->calls(), 0);

  // The in-memory records past 4 GiB have the right contents and CRCs.
  EXPECT_EQ(ReadRange(*f, recs[8].data_offset, 2), Bytes("3\n"));
  EXPECT_EQ(recs[8].crc32,
            static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>("3\n"), 2)));

  // A read across the end of the 4 GiB tensor, its ZIP64 descriptor, the next local header
  // and into data/2.
  const uint64_t off = r1.data_offset + r1.n_bytes - 5;
  const uint64_t n = r2.data_offset + 3 - off;
  const auto got = ReadRange(*f, off, static_cast<size_t>(n));
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(got[i], static_cast<uint8_t>(PatternProvider::ByteAt(31, r1.n_bytes - 5 + i)));
  }
  EXPECT_EQ(Le(got, 5, 4), 0x08074b50u);
  EXPECT_EQ(Le(got, 9, 4), 0u);
  EXPECT_EQ(Le(got, 13, 8), kU32Max);
  EXPECT_EQ(Le(got, 21, 8), kU32Max);
  EXPECT_EQ(Le(got, 29, 4), 0x04034b50u);
  ASSERT_EQ(p1->ranges().size(), 1u);
  EXPECT_EQ(p1->ranges()[0], std::make_pair(r1.n_bytes - 5, uint64_t{5}));
  ASSERT_EQ(p2->ranges().size(), 1u);
  EXPECT_EQ(p2->ranges()[0], std::make_pair(uint64_t{0}, uint64_t{3}));
  EXPECT_EQ(p0->calls(), 0);
}

// A record of 0xFFFFFFFF bytes whose header is below 4 GiB: ZIP64 by size only.
TEST(TorchWriter, Zip64BySizeOnly) {
  SaveValue root = SaveValue::OrderedDict();
  root.Set("exact", PT(DType::kUInt8, {0xFFFFFFFF}, 40));
  root.Set("next", PT(DType::kUInt8, {0xFFFFFFFE}, 41));
  auto f = MustBuild(root);
  ASSERT_NE(f, nullptr);
  const RecordLayout& r0 = f->records()[4];
  const RecordLayout& r1 = f->records()[5];
  EXPECT_LT(r0.local_header_offset, kU32Max);
  EXPECT_TRUE(r0.zip64);
  EXPECT_EQ(r0.central_extra_n_bytes, 4 + 16);
  EXPECT_EQ(r0.descriptor_n_bytes, 24);
  EXPECT_GE(r1.local_header_offset, kU32Max);
  EXPECT_TRUE(r1.zip64);
  EXPECT_EQ(r1.central_extra_n_bytes, 4 + 8);
  CheckWholeLayout(*f, "archive", 64);
}

TEST(TorchWriter, MultiTebibyteLayoutWithoutData) {
  SaveValue root = SaveValue::OrderedDict();
  root.Set("huge", PT(DType::kFloat32, {1ll << 40}, 50));  // 4 TiB
  root.Set("huge2", PT(DType::kBFloat16, {1ll << 20, 1ll << 20}, 51));  // 2 TiB
  auto f = MustBuild(root);
  ASSERT_NE(f, nullptr);
  EXPECT_GT(f->Size(), 6ull << 40);
  CheckWholeLayout(*f, "archive", 64);
}

std::vector<uint8_t> PickleOf(const SaveValue& v, SaveOptions o = {}) {
  auto f = MustBuild(v, o);
  if (f == nullptr) return {};
  const auto pk = f->pickle();
  return std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(pk.data()),
                              reinterpret_cast<const uint8_t*>(pk.data()) + pk.size());
}

// Appends literal bytes written as a string (may contain NULs via the size argument).
void Add(std::vector<uint8_t>& out, const char* s, size_t n) {
  for (size_t i = 0; i < n; ++i) out.push_back(static_cast<uint8_t>(s[i]));
}
#define ADD(out, lit) Add(out, lit, sizeof(lit) - 1)

TEST(TorchWriter, PickleBytesMatchHandWrittenOpcodes) {
  SaveValue root = SaveValue::OrderedDict();
  root.Set("a", SaveValue::Int(1));
  root.Set("b",
           SaveValue::List({SaveValue::None(), SaveValue::Bool(true), SaveValue::Bool(false)}));
  root.Set("c", SaveValue::Tuple({SaveValue::Int(300), SaveValue::Int(-5), SaveValue::Int(70000)}));
  root.Set("d", SaveValue::Tuple({SaveValue::Int(1), SaveValue::Int(2), SaveValue::Int(3),
                                  SaveValue::Int(1ll << 40)}));
  root.Set("e", SaveValue::Str("\xc3\xa9"));
  root.Set("f", SaveValue::Float(1.5));
  root.Set("g", SaveValue::Dict({{SaveValue::Int(7), SaveValue::Tuple()},
                                 {SaveValue::Str("x"), SaveValue::List()}}));
  root.Set("t", PT(DType::kFloat16, {}, 1));       // 0-d, legacy storage
  root.Set("u", PT(DType::kFloat8E4M3FN, {2}, 2));  // v3 / UntypedStorage
  root.Set("v", PT(DType::kFloat32, {2, 0}, 3));    // empty

  std::vector<uint8_t> e;
  ADD(e, "\x80\x02");                                    // PROTO 2
  ADD(e, "ccollections\nOrderedDict\n)R");               // OrderedDict()
  ADD(e, "(");                                           // MARK
  ADD(e, "X\x01\x00\x00\x00" "a" "K\x01");
  ADD(e, "X\x01\x00\x00\x00" "b" "](N\x88\x89" "e");     // [None, True, False]
  ADD(e, "X\x01\x00\x00\x00" "c" "M\x2c\x01" "J\xfb\xff\xff\xff" "J\x70\x11\x01\x00" "\x87");
  ADD(e, "X\x01\x00\x00\x00" "d" "(K\x01K\x02K\x03\x8a\x06\x00\x00\x00\x00\x00\x01t");
  ADD(e, "X\x01\x00\x00\x00" "e" "X\x02\x00\x00\x00\xc3\xa9");
  ADD(e, "X\x01\x00\x00\x00" "f" "G\x3f\xf8\x00\x00\x00\x00\x00\x00");  // BINFLOAT big-endian
  ADD(e, "X\x01\x00\x00\x00" "g" "}(K\x07)X\x01\x00\x00\x00" "x]u");     // {7: (), 'x': []}
  // t: _rebuild_tensor_v2((storage, HalfStorage, '0', 'cpu', 1), 0, (), (), False, OD())
  ADD(e, "X\x01\x00\x00\x00" "t" "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
         "ctorch\nHalfStorage\nX\x01\x00\x00\x00" "0X\x03\x00\x00\x00" "cpuK\x01tQK\x00))\x89"
         "ccollections\nOrderedDict\n)RtR");
  // u: _rebuild_tensor_v3((storage, UntypedStorage, '1', 'cpu', 2 bytes), 0, (2,), (1,),
  //    False, OD(), torch.float8_e4m3fn)
  ADD(e, "X\x01\x00\x00\x00" "u" "ctorch._utils\n_rebuild_tensor_v3\n((X\x07\x00\x00\x00storage"
         "ctorch.storage\nUntypedStorage\nX\x01\x00\x00\x00" "1X\x03\x00\x00\x00" "cpuK\x02tQ"
         "K\x00K\x02\x85K\x01\x85\x89" "ccollections\nOrderedDict\n)Rctorch\nfloat8_e4m3fn\ntR");
  // v: shape (2, 0), contiguous strides (1, 1) as torch computes them, numel 0
  ADD(e, "X\x01\x00\x00\x00" "v" "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
         "ctorch\nFloatStorage\nX\x01\x00\x00\x00" "2X\x03\x00\x00\x00" "cpuK\x00tQ"
         "K\x00K\x02K\x00\x86K\x01K\x01\x86\x89" "ccollections\nOrderedDict\n)RtR");
  ADD(e, "u.");  // SETITEMS, STOP
  EXPECT_EQ(PickleOf(root), e);
}

TEST(TorchWriter, PickleIntEncodings) {
  struct Case {
    int64_t v;
    std::vector<uint8_t> bytes;
  };
  const std::vector<Case> cases = {
      {0, {'K', 0}},
      {255, {'K', 0xff}},
      {256, {'M', 0x00, 0x01}},
      {65535, {'M', 0xff, 0xff}},
      {65536, {'J', 0x00, 0x00, 0x01, 0x00}},
      {-1, {'J', 0xff, 0xff, 0xff, 0xff}},
      {INT32_MIN, {'J', 0x00, 0x00, 0x00, 0x80}},
      {INT32_MAX, {'J', 0xff, 0xff, 0xff, 0x7f}},
      {int64_t{INT32_MAX} + 1, {0x8a, 5, 0x00, 0x00, 0x00, 0x80, 0x00}},
      {int64_t{INT32_MIN} - 1, {0x8a, 5, 0xff, 0xff, 0xff, 0x7f, 0xff}},
      {-(1ll << 39), {0x8a, 5, 0x00, 0x00, 0x00, 0x00, 0x80}},
      {1ll << 40, {0x8a, 6, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01}},
      {INT64_MAX, {0x8a, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}},
      {INT64_MIN, {0x8a, 8, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80}},
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> e = {0x80, 0x02};
    e.insert(e.end(), c.bytes.begin(), c.bytes.end());
    e.push_back('.');
    EXPECT_EQ(PickleOf(SaveValue::Int(c.v)), e) << c.v;
  }
}

TEST(TorchWriter, PickleBatchesOfAtMost1000) {
  SaveValue list = SaveValue::List();
  for (int i = 0; i < 2500; ++i) list.Append(SaveValue::None());
  std::vector<uint8_t> e = {0x80, 0x02, ']'};
  for (int batch : {1000, 1000, 500}) {
    e.push_back('(');
    e.insert(e.end(), static_cast<size_t>(batch), 'N');
    e.push_back('e');
  }
  e.push_back('.');
  EXPECT_EQ(PickleOf(list), e);

  SaveValue dict = SaveValue::Dict();
  for (int i = 0; i < 1001; ++i) dict.Set("k" + std::to_string(i), SaveValue::None());
  const auto pk = PickleOf(dict);
  // '}' '(' 1000 x (key, N) 'u' '(' 1 x (key, N) 'u' '.'  (no key byte is '(' or 'u')
  ASSERT_GE(pk.size(), 6u);
  EXPECT_EQ(pk[2], '}');
  EXPECT_EQ(pk[3], '(');
  EXPECT_EQ(pk[pk.size() - 2], 'u');
  size_t marks = 0, setitems = 0;
  for (size_t i = 3; i < pk.size(); ++i) {
    if (pk[i] == '(') ++marks;
    if (pk[i] == 'u') ++setitems;
  }
  EXPECT_EQ(marks, 2u);
  EXPECT_EQ(setitems, 2u);
}

TEST(TorchWriter, StorageKeysInFirstUseOrder) {
  std::shared_ptr<PatternProvider> pa, pb, pc;
  SaveValue root = SaveValue::Dict();
  SaveValue inner = SaveValue::Dict();
  inner.Set("q", PT(DType::kInt16, {5}, 2, &pb));
  root.Set("z", SaveValue::List({PT(DType::kInt32, {3}, 1, &pa), std::move(inner)}));
  root.Set("a", PT(DType::kInt64, {2}, 3, &pc));
  auto f = MustBuild(root);
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(f->n_tensors(), 3u);
  EXPECT_EQ(f->tensor(0).provider, pa);
  EXPECT_EQ(f->tensor(1).provider, pb);
  EXPECT_EQ(f->tensor(2).provider, pc);
  EXPECT_EQ(f->records()[4].n_bytes, 12u);
  EXPECT_EQ(f->records()[5].n_bytes, 10u);
  EXPECT_EQ(f->records()[6].n_bytes, 16u);
  CheckWholeLayout(*f, "archive", 64);
  const auto all = ReadAll(*f);
  const auto& r = f->records()[5];
  for (size_t i = 0; i < r.n_bytes; ++i) {
    EXPECT_EQ(all[r.data_offset + i], static_cast<uint8_t>(PatternProvider::ByteAt(2, i)));
  }
}

TEST(TorchWriter, FloatsRejectedWhenNotAllowed) {
  SaveOptions o;
  o.allow_floats = false;
  SaveValue root = SaveValue::Dict();
  root.Set("opt", SaveValue::List({SaveValue::Int(1), SaveValue::Tuple({SaveValue::Float(0.1)})}));
  auto r = LazyTorchFile::Build(root, "f.pt", o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.error().message().find("['opt'][1][0]"), std::string::npos) << r.error().message();
  EXPECT_TRUE(LazyTorchFile::Build(root, "f.pt").ok());  // allowed by default
  root = SaveValue::Dict();
  root.Set("n", SaveValue::Int(1));
  EXPECT_TRUE(LazyTorchFile::Build(root, "f.pt", o).ok());
}

TEST(TorchWriter, InvalidInputs) {
  auto code = [](const SaveValue& v, SaveOptions o = {}) {
    auto r = LazyTorchFile::Build(v, "bad.pt", o);
    return r.ok() ? StatusCode::kOk : r.error().code();
  };
  const SaveValue none;
  SaveOptions o;
  o.prefix = "";
  EXPECT_EQ(code(none, o), StatusCode::kInvalidArgument);
  o.prefix = "a/b";
  EXPECT_EQ(code(none, o), StatusCode::kInvalidArgument);
  o.prefix = std::string(2000, 'p');
  EXPECT_EQ(code(none, o), StatusCode::kInvalidArgument);
  o = {};
  o.alignment = 0;
  EXPECT_EQ(code(none, o), StatusCode::kInvalidArgument);
  o.alignment = 48;
  EXPECT_EQ(code(none, o), StatusCode::kInvalidArgument);
  o.alignment = 65536;
  EXPECT_EQ(code(none, o), StatusCode::kInvalidArgument);
  o.alignment = 1;
  EXPECT_EQ(code(none, o), StatusCode::kOk);

  EXPECT_EQ(code(SaveValue::Dict({{SaveValue::Str("k"), none}, {SaveValue::Str("k"), none}})),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SaveValue::Dict({{SaveValue::Int(1), none}, {SaveValue::Int(1), none}})),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SaveValue::Dict({{SaveValue::Int(1), none}, {SaveValue::Str("1"), none}})),
            StatusCode::kOk);
  EXPECT_EQ(code(SaveValue::Dict({{SaveValue::Float(1), none}})), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SaveValue::Dict({{SaveValue::Tuple(), none}})), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SaveValue::Str("\xff")), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SaveValue::Str("\xc0\x80")), StatusCode::kInvalidArgument);       // overlong
  EXPECT_EQ(code(SaveValue::Str("\xed\xa0\x80")), StatusCode::kInvalidArgument);   // surrogate
  EXPECT_EQ(code(SaveValue::Str("\xf0\x9f\x98\x80")), StatusCode::kOk);            // emoji

  EXPECT_EQ(code(SaveValue::Tensor(DType::kFloat32, {-1}, nullptr)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SaveValue::Tensor(DType::kFloat32, {4}, nullptr)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SaveValue::Tensor(DType::kFloat32, {0, 4}, nullptr)), StatusCode::kOk);
  EXPECT_EQ(code(PT(DType::kQInt8, {4}, 1)), StatusCode::kUnsupported);
  EXPECT_EQ(code(SaveValue::Tensor(DType::kFloat64, {1ll << 62, 8}, nullptr)),
            StatusCode::kInvalidArgument);  // numel overflows int64
  EXPECT_EQ(code(SaveValue::Tensor(DType::kFloat64, {1ll << 61}, nullptr)),
            StatusCode::kInvalidArgument);  // bytes overflow int64
  EXPECT_EQ(code(SaveValue::Tensor(DType::kFloat32, {0, 1ll << 40, 1ll << 40}, nullptr)),
            StatusCode::kInvalidArgument);  // strides overflow although numel is 0

  SaveValue deep;
  for (int i = 0; i < 1100; ++i) deep = SaveValue::List({std::move(deep)});
  EXPECT_EQ(code(deep), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace ucpfs::format
