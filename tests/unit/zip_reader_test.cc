// ZipArchive tests: hermetic archives from an in-test builder (torch-style FB padding, data
// descriptors, ZIP64 extras and end records), a real Python zipfile archive, and a catalogue of
// handcrafted corrupt files that must each fail cleanly (kCorrupt / kResourceExhausted), plus
// truncation-at-every-length and every-byte-flip sweeps that must never crash.
#include "core/format/zip_reader.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/checked.h"
#include "tests/unit/counting_source.h"

namespace ucpfs::format {
namespace {

constexpr uint32_t kSat32 = 0xFFFFFFFF;

// ---- builder -------------------------------------------------------------------------------

void PutLe(std::vector<uint8_t>& out, uint64_t value, int n_bytes) {
  for (int i = 0; i < n_bytes; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}
void Put16(std::vector<uint8_t>& out, uint64_t value) { PutLe(out, value, 2); }
void Put32(std::vector<uint8_t>& out, uint64_t value) { PutLe(out, value, 4); }
void Put64(std::vector<uint8_t>& out, uint64_t value) { PutLe(out, value, 8); }
void PutStr(std::vector<uint8_t>& out, const std::string& s) { out.insert(out.end(), s.begin(), s.end()); }

void PatchLe(std::vector<uint8_t>& bytes, uint64_t byte_offset, uint64_t value, int n_bytes) {
  for (int i = 0; i < n_bytes; ++i) {
    bytes.at(byte_offset + i) = static_cast<uint8_t>(value >> (8 * i));
  }
}

struct BuildEntry {
  std::string name{};
  std::string data{};  // bytes as stored (compressed when method != 0)
  uint16_t method = 0;
  uint32_t crc = 0;
  std::optional<uint64_t> n_bytes{};  // uncompressed size when it differs from data.size()
  // Saturate these central-directory fields and carry the real values in a ZIP64 extra (also
  // written to the local header, as torch does).
  bool zip64_sizes = false;
  bool zip64_offset = false;
};

struct BuildOptions {
  uint64_t alignment = 0;       // 0: no FB padding field; else data aligned like torch
  bool descriptors = false;     // data descriptors after non-empty records (torch: flags 0x0808)
  bool zip64_end = false;       // ZIP64 EOCD + locator before the EOCD (torch always)
  bool saturate_eocd = false;   // EOCD count/size/offset fields 0xFFFF / 0xFFFFFFFF
  std::string comment{};
};

struct BuiltZip {
  std::vector<uint8_t> bytes;
  std::vector<uint64_t> local_header_offsets;
  std::vector<uint64_t> data_offsets;
  std::vector<uint64_t> cd_entry_offsets;
  uint64_t cd_offset = 0;
  uint64_t cd_n_bytes = 0;
  uint64_t zip64_eocd_offset = 0;
  uint64_t locator_offset = 0;
  uint64_t eocd_offset = 0;
};

uint64_t DeclaredSize(const BuildEntry& e) { return e.n_bytes.value_or(e.data.size()); }

BuiltZip BuildZip(const std::vector<BuildEntry>& entries, const BuildOptions& opt = {}) {
  BuiltZip z;
  std::vector<uint8_t>& out = z.bytes;
  std::vector<uint16_t> flags;
  for (const BuildEntry& e : entries) {
    const uint64_t lho = out.size();
    const bool zip64 = e.zip64_sizes || e.zip64_offset;
    std::vector<uint8_t> extra;
    if (zip64) {
      Put16(extra, 0x0001);
      Put16(extra, (e.zip64_sizes ? 16 : 0) + (e.zip64_offset ? 8 : 0));
      if (e.zip64_sizes) {
        Put64(extra, DeclaredSize(e));
        Put64(extra, e.data.size());
      }
      if (e.zip64_offset) Put64(extra, lho);
    }
    if (opt.alignment != 0) {
      // torch's getPadding: the FB header (4 bytes) counts, the ZIP64 field before it too.
      const uint64_t start = lho + 30 + e.name.size() + extra.size() + 4;
      const uint64_t pad = (opt.alignment - start % opt.alignment) % opt.alignment;
      PutStr(extra, "FB");
      Put16(extra, pad);
      PutStr(extra, std::string(pad, 'Z'));
    }
    const bool descriptor = opt.descriptors && !e.data.empty();
    const uint16_t f = static_cast<uint16_t>((opt.descriptors ? 0x0800 : 0) | (descriptor ? 0x0008 : 0));
    flags.push_back(f);
    z.local_header_offsets.push_back(lho);
    Put32(out, 0x04034b50);
    Put16(out, 0);
    Put16(out, f);
    Put16(out, e.method);
    Put16(out, 0);
    Put16(out, 0);
    Put32(out, descriptor ? 0 : e.crc);
    Put32(out, descriptor ? 0 : (e.zip64_sizes ? kSat32 : e.data.size()));
    Put32(out, descriptor ? 0 : (e.zip64_sizes ? kSat32 : DeclaredSize(e)));
    Put16(out, e.name.size());
    Put16(out, extra.size());
    PutStr(out, e.name);
    out.insert(out.end(), extra.begin(), extra.end());
    z.data_offsets.push_back(out.size());
    PutStr(out, e.data);
    if (descriptor) {
      Put32(out, 0x08074b50);
      Put32(out, e.crc);
      PutLe(out, e.data.size(), zip64 ? 8 : 4);
      PutLe(out, DeclaredSize(e), zip64 ? 8 : 4);
    }
  }

  z.cd_offset = out.size();
  for (size_t i = 0; i < entries.size(); ++i) {
    const BuildEntry& e = entries[i];
    std::vector<uint8_t> extra;
    if (e.zip64_sizes || e.zip64_offset) {
      Put16(extra, 0x0001);
      Put16(extra, (e.zip64_sizes ? 16 : 0) + (e.zip64_offset ? 8 : 0));
      if (e.zip64_sizes) {
        Put64(extra, DeclaredSize(e));
        Put64(extra, e.data.size());
      }
      if (e.zip64_offset) Put64(extra, z.local_header_offsets[i]);
    }
    z.cd_entry_offsets.push_back(out.size());
    Put32(out, 0x02014b50);
    Put16(out, 0);
    Put16(out, 0);
    Put16(out, flags[i]);
    Put16(out, e.method);
    Put16(out, 0);
    Put16(out, 0);
    Put32(out, e.crc);
    Put32(out, e.zip64_sizes ? kSat32 : e.data.size());
    Put32(out, e.zip64_sizes ? kSat32 : DeclaredSize(e));
    Put16(out, e.name.size());
    Put16(out, extra.size());
    Put16(out, 0);
    Put16(out, 0);
    Put16(out, 0);
    Put32(out, 0);
    Put32(out, e.zip64_offset ? kSat32 : z.local_header_offsets[i]);
    PutStr(out, e.name);
    out.insert(out.end(), extra.begin(), extra.end());
  }
  z.cd_n_bytes = out.size() - z.cd_offset;

  const uint64_t n = entries.size();
  if (opt.zip64_end) {
    z.zip64_eocd_offset = out.size();
    Put32(out, 0x06064b50);
    Put64(out, 44);
    Put16(out, 0x031e);
    Put16(out, 45);
    Put32(out, 0);
    Put32(out, 0);
    Put64(out, n);
    Put64(out, n);
    Put64(out, z.cd_n_bytes);
    Put64(out, z.cd_offset);
    z.locator_offset = out.size();
    Put32(out, 0x07064b50);
    Put32(out, 0);
    Put64(out, z.zip64_eocd_offset);
    Put32(out, 1);
  }
  z.eocd_offset = out.size();
  Put32(out, 0x06054b50);
  Put16(out, 0);
  Put16(out, 0);
  Put16(out, opt.saturate_eocd ? 0xFFFF : n);
  Put16(out, opt.saturate_eocd ? 0xFFFF : n);
  Put32(out, opt.saturate_eocd ? kSat32 : z.cd_n_bytes);
  Put32(out, opt.saturate_eocd ? kSat32 : z.cd_offset);
  Put16(out, opt.comment.size());
  PutStr(out, opt.comment);
  return z;
}

// Byte offsets inside records, for patching.
constexpr uint64_t kCdCsize = 20, kCdUsize = 24, kCdNameLen = 28, kCdLho = 42;
constexpr uint64_t kLocalNameLen = 26, kLocalExtraLen = 28;
constexpr uint64_t kEocdCount = 10, kEocdCdSize = 12, kEocdCdOffset = 16;
constexpr uint64_t kZ64RecordSize = 4, kZ64Count = 32, kZ64CdSize = 40, kZ64CdOffset = 48;
constexpr uint64_t kLocatorOffset = 8;

// A string literal with embedded NULs, all of it but the terminator.
template <size_t N>
std::string Lit(const char (&s)[N]) {
  return std::string(s, N - 1);
}

std::vector<BuildEntry> TorchLikeEntries() {
  return {
      {.name = "archive/data.pkl", .data = Lit("\x80\x02}q\x00(X\x01\x00\x00\x00" "aq\x01."), .crc = 0x12345678},
      {.name = "archive/data/0", .data = Lit("\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b"), .crc = 0xdeadbeef},
      {.name = "archive/data/1", .data = ""},
      {.name = "archive/version", .data = "3\n", .crc = 0x2d2f6e4b},
  };
}

BuildOptions TorchLikeOptions() {
  return {.alignment = 64, .descriptors = true, .zip64_end = true};
}

MemorySource Source(const std::vector<uint8_t>& bytes, std::string name = "t.zip") {
  return MemorySource(std::move(name), std::span<const uint8_t>(bytes));
}

// The same bytes, counting the reads made of them (and failing those touching [fail_lo, fail_hi)).
::ucpfs::testing::CountingSource Counted(const std::vector<uint8_t>& bytes) {
  const auto* p = reinterpret_cast<const std::byte*>(bytes.data());
  return ::ucpfs::testing::CountingSource("t.zip", std::vector<std::byte>(p, p + bytes.size()));
}

std::string ReadString(const ByteSource& src, uint64_t byte_offset, uint64_t n_bytes) {
  std::string out(n_bytes, '\0');
  Status st = src.ReadAt(byte_offset, std::as_writable_bytes(std::span<char>(out)));
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

// Checks every entry against what the builder wrote, including the bytes at data_offset.
void ExpectMatchesBuild(const ZipArchive& a, const BuiltZip& z,
                        const std::vector<BuildEntry>& entries, const ByteSource& src) {
  ASSERT_EQ(a.entries().size(), entries.size());
  EXPECT_EQ(a.cd_offset(), z.cd_offset);
  for (size_t i = 0; i < entries.size(); ++i) {
    SCOPED_TRACE(entries[i].name);
    const ZipEntry& got = a.entries()[i];
    EXPECT_EQ(got.name, entries[i].name);
    EXPECT_EQ(got.local_header_offset, z.local_header_offsets[i]);
    EXPECT_EQ(got.data_offset, z.data_offsets[i]);
    EXPECT_EQ(got.compressed_n_bytes, entries[i].data.size());
    EXPECT_EQ(got.n_bytes, DeclaredSize(entries[i]));
    EXPECT_EQ(got.method, entries[i].method);
    EXPECT_EQ(got.crc32, entries[i].crc);
    EXPECT_EQ(ReadString(src, got.data_offset, got.compressed_n_bytes), entries[i].data);
    EXPECT_EQ(a.Find(entries[i].name), &got);
  }
}

void ExpectError(const Result<ZipArchive>& r, StatusCode code, const std::string& what = "") {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), code) << r.error().ToString();
  EXPECT_EQ(r.error().message().rfind("t.zip: offset ", 0), 0u) << r.error().message();
  if (!what.empty()) {
    EXPECT_NE(r.error().message().find(what), std::string::npos) << r.error().message();
  }
}

void ExpectCorrupt(const std::vector<uint8_t>& bytes, const std::string& what = "",
                   const ZipLimits& limits = {}) {
  MemorySource src = Source(bytes);
  ExpectError(ZipArchive::Open(src, limits), StatusCode::kCorrupt, what);
}

// What any successfully opened archive must guarantee, whatever the input.
void ExpectInvariants(const ZipArchive& a, const ByteSource& src) {
  ASSERT_LE(a.cd_offset(), src.Size());
  for (const ZipEntry& e : a.entries()) {
    ASSERT_TRUE(RangeInside(e.data_offset, e.compressed_n_bytes, a.cd_offset())) << e.name;
    ASSERT_LT(e.local_header_offset, e.data_offset);
    std::vector<std::byte> head(std::min<uint64_t>(64, e.compressed_n_bytes));
    ASSERT_TRUE(src.ReadAt(e.data_offset, head).ok());
    ASSERT_NE(a.Find(e.name), nullptr);
  }
}

// ---- valid archives ------------------------------------------------------------------------

TEST(ZipReader, TorchLikeArchive) {
  const auto entries = TorchLikeEntries();
  const BuiltZip z = BuildZip(entries, TorchLikeOptions());
  MemorySource src = Source(z.bytes);
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ExpectMatchesBuild(*r, z, entries, src);
  EXPECT_EQ(r->prefix(), "archive");
  for (const ZipEntry& e : r->entries()) EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
  EXPECT_EQ(r->entries()[0].data_offset, 64u);  // as in torch's own sd113.pt
  EXPECT_EQ(r->entries()[0].flags, 0x0808);
  EXPECT_EQ(r->entries()[1].flags, 0x0808);
}

TEST(ZipReader, ZeroByteRecord) {
  const auto entries = TorchLikeEntries();
  MemorySource src = Source(BuildZip(entries, TorchLikeOptions()).bytes);
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  const ZipEntry* e = r->FindRecord("data/1");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->n_bytes, 0u);
  EXPECT_EQ(e->compressed_n_bytes, 0u);
  EXPECT_EQ(e->flags, 0x0800);  // no data descriptor for 0-byte records
  EXPECT_EQ(e->data_offset % 64, 0u);
}

TEST(ZipReader, ZeroByteRecordRightBeforeCentralDirectory) {
  const std::vector<BuildEntry> entries = {{.name = "a/x", .data = "abc"}, {.name = "a/empty"}};
  const BuiltZip z = BuildZip(entries);
  MemorySource src = Source(z.bytes);
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ExpectMatchesBuild(*r, z, entries, src);
  EXPECT_EQ(r->entries()[1].data_offset, r->cd_offset());
}

TEST(ZipReader, PrefixAndFindRecord) {
  const auto entries = TorchLikeEntries();
  MemorySource src = Source(BuildZip(entries, TorchLikeOptions()).bytes);
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->prefix(), "archive");
  ASSERT_NE(r->FindRecord("data.pkl"), nullptr);
  EXPECT_EQ(r->FindRecord("data.pkl")->name, "archive/data.pkl");
  EXPECT_EQ(r->FindRecord("data/0"), &r->entries()[1]);
  EXPECT_EQ(r->FindRecord("version"), &r->entries()[3]);
  EXPECT_EQ(r->FindRecord("data/2"), nullptr);
  EXPECT_EQ(r->FindRecord(""), nullptr);
  EXPECT_EQ(r->Find("data.pkl"), nullptr);
  EXPECT_EQ(r->Find("archive/data.pk"), nullptr);
}

TEST(ZipReader, PrefixIsFirstEntryUpToFirstSlash) {
  {
    MemorySource src = Source(BuildZip({{.name = "a/b/c", .data = "1"}, {.name = "x/y"}}).bytes);
    auto r = ZipArchive::Open(src);
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    EXPECT_EQ(r->prefix(), "a");
    EXPECT_EQ(r->FindRecord("b/c"), &r->entries()[0]);
  }
  {
    MemorySource src = Source(BuildZip({{.name = "noslash", .data = "1"}, {.name = "q/r"}}).bytes);
    auto r = ZipArchive::Open(src);
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    EXPECT_EQ(r->prefix(), "");
    EXPECT_EQ(r->FindRecord("noslash"), &r->entries()[0]);  // empty prefix: the record as is
  }
  {
    MemorySource src = Source(BuildZip({{.name = "/lead", .data = "1"}}).bytes);
    auto r = ZipArchive::Open(src);
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    EXPECT_EQ(r->prefix(), "");
  }
}

TEST(ZipReader, EmptyArchive) {
  for (bool zip64 : {false, true}) {
    MemorySource src = Source(BuildZip({}, {.zip64_end = zip64}).bytes);
    auto r = ZipArchive::Open(src);
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    EXPECT_TRUE(r->entries().empty());
    EXPECT_EQ(r->prefix(), "");
    EXPECT_EQ(r->FindRecord("data.pkl"), nullptr);
  }
}

TEST(ZipReader, DuplicateNamesKeepFirst) {
  const std::vector<BuildEntry> entries = {
      {.name = "p/a", .data = "first"}, {.name = "p/b", .data = "b"}, {.name = "p/a", .data = "second"}};
  MemorySource src = Source(BuildZip(entries).bytes);
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ASSERT_EQ(r->entries().size(), 3u);
  EXPECT_EQ(r->Find("p/a"), &r->entries()[0]);
}

TEST(ZipReader, Zip64ExtrasAndEndRecords) {
  // Every combination of saturated CD fields, each with a ZIP64 extra holding the real (small)
  // values, with the EOCD fields saturated so only the ZIP64 EOCD has the truth.
  std::vector<BuildEntry> entries = {
      {.name = "z/sizes", .data = "0123456789", .crc = 1, .zip64_sizes = true},
      {.name = "z/offset", .data = "abc", .crc = 2, .zip64_offset = true},
      {.name = "z/both", .data = "hello world", .crc = 3, .zip64_sizes = true, .zip64_offset = true},
      {.name = "z/empty", .zip64_sizes = true},
      {.name = "z/plain", .data = "xy", .crc = 5},
  };
  for (bool descriptors : {false, true}) {
    for (uint64_t alignment : {uint64_t{0}, uint64_t{64}}) {
      SCOPED_TRACE(std::to_string(descriptors) + "/" + std::to_string(alignment));
      const BuiltZip z = BuildZip(entries, {.alignment = alignment,
                                            .descriptors = descriptors,
                                            .zip64_end = true,
                                            .saturate_eocd = true});
      MemorySource src = Source(z.bytes);
      auto r = ZipArchive::Open(src);
      ASSERT_TRUE(r.ok()) << r.error().ToString();
      ExpectMatchesBuild(*r, z, entries, src);
      EXPECT_EQ(r->prefix(), "z");
    }
  }
}

TEST(ZipReader, Zip64EndRecordsWinOverUnsaturatedEocd) {
  // torch writes the ZIP64 EOCD even for tiny files; its values are the ones used.
  const auto entries = TorchLikeEntries();
  BuiltZip z = BuildZip(entries, TorchLikeOptions());
  PatchLe(z.bytes, z.eocd_offset + kEocdCdOffset, 0, 4);  // would fail if it were used
  MemorySource src = Source(z.bytes);
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ExpectMatchesBuild(*r, z, entries, src);
}

// Written once by Python's zipfile (no padding, no descriptors; "p/b" with force_zip64, so its
// local header has a ZIP64 extra and saturated sizes; "p/c" deflated; archive comment "hello"):
//   zf.writestr(ZipInfo("p/a", (2024,1,1,0,0,0)), b"hi")
//   with zf.open(ZipInfo("p/b", ...), "w", force_zip64=True) as f: f.write(b"xyz")
//   zi = ZipInfo("p/c", ...); zi.compress_type = ZIP_DEFLATED; zf.writestr(zi, b"a" * 40)
//   zf.comment = b"hello"
constexpr uint8_t kPythonZip[] = {
    0x50, 0x4b, 0x03, 0x04, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x21, 0x58, 0xac, 0x2a,
    0x93, 0xd8, 0x02, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x70, 0x2f,
    0x61, 0x68, 0x69, 0x50, 0x4b, 0x03, 0x04, 0x2d, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x21,
    0x58, 0x67, 0xba, 0x8e, 0xeb, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x03, 0x00, 0x14,
    0x00, 0x70, 0x2f, 0x62, 0x01, 0x00, 0x10, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x78, 0x79, 0x7a, 0x50, 0x4b, 0x03, 0x04, 0x14,
    0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x21, 0x58, 0x25, 0x8a, 0x5b, 0xc9, 0x06, 0x00, 0x00,
    0x00, 0x28, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x70, 0x2f, 0x63, 0x4b, 0x4c, 0x24, 0x0e,
    0x00, 0x00, 0x50, 0x4b, 0x01, 0x02, 0x14, 0x03, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x21, 0x58, 0xac, 0x2a, 0x93, 0xd8, 0x02, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x03, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x01, 0x00, 0x00, 0x00, 0x00,
    0x70, 0x2f, 0x61, 0x50, 0x4b, 0x01, 0x02, 0x2d, 0x03, 0x2d, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x21, 0x58, 0x67, 0xba, 0x8e, 0xeb, 0x03, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x03,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x01, 0x23, 0x00, 0x00,
    0x00, 0x70, 0x2f, 0x62, 0x50, 0x4b, 0x01, 0x02, 0x14, 0x03, 0x14, 0x00, 0x00, 0x00, 0x08, 0x00,
    0x00, 0x00, 0x21, 0x58, 0x25, 0x8a, 0x5b, 0xc9, 0x06, 0x00, 0x00, 0x00, 0x28, 0x00, 0x00, 0x00,
    0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x01, 0x5b, 0x00,
    0x00, 0x00, 0x70, 0x2f, 0x63, 0x50, 0x4b, 0x05, 0x06, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0x03,
    0x00, 0x93, 0x00, 0x00, 0x00, 0x82, 0x00, 0x00, 0x00, 0x05, 0x00, 0x68, 0x65, 0x6c, 0x6c, 0x6f,
};

std::vector<uint8_t> PythonZip() { return {std::begin(kPythonZip), std::end(kPythonZip)}; }

TEST(ZipReader, PythonZipfileArchive) {
  MemorySource src = Source(PythonZip());
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ASSERT_EQ(r->entries().size(), 3u);
  EXPECT_EQ(r->prefix(), "p");
  EXPECT_EQ(r->cd_offset(), 130u);

  const ZipEntry* a = r->FindRecord("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->local_header_offset, 0u);
  EXPECT_EQ(a->data_offset, 33u);
  EXPECT_EQ(a->n_bytes, 2u);
  EXPECT_EQ(a->crc32, 0xd8932aacu);
  EXPECT_EQ(ReadString(src, a->data_offset, a->n_bytes), "hi");

  // force_zip64: local extra of 20 bytes, central directory without one.
  const ZipEntry* b = r->FindRecord("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->local_header_offset, 35u);
  EXPECT_EQ(b->data_offset, 35u + 30 + 3 + 20);
  EXPECT_EQ(b->n_bytes, 3u);
  EXPECT_EQ(ReadString(src, b->data_offset, b->n_bytes), "xyz");

  const ZipEntry* c = r->FindRecord("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->method, 8);
  EXPECT_EQ(c->n_bytes, 40u);
  EXPECT_EQ(c->compressed_n_bytes, 6u);
  EXPECT_EQ(c->data_offset, 91u + 30 + 3);
}

TEST(ZipReader, CommentWithFakeEocdInside) {
  // A comment containing a whole EOCD-looking record whose own comment length cannot fit: the
  // backward scan must skip it and find the real one.
  std::vector<uint8_t> fake;
  Put32(fake, 0x06054b50);
  PutStr(fake, std::string(16, '\0'));
  Put16(fake, 500);  // comment longer than what follows
  std::string comment(fake.begin(), fake.end());
  comment += "tail";
  const std::vector<BuildEntry> entries = {{.name = "c/x", .data = "data"}};
  const BuiltZip z = BuildZip(entries, {.comment = comment});
  MemorySource src = Source(z.bytes);
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ExpectMatchesBuild(*r, z, entries, src);
}

TEST(ZipReader, LongCommentsNeedTheFullScan) {
  // The first look covers only the last few hundred bytes; longer comments, up to the maximum
  // of 65,535 bytes, must still be found.
  const auto entries = TorchLikeEntries();
  for (size_t comment_n_bytes : {size_t{200}, size_t{1000}, size_t{65535}}) {
    BuildOptions opt = TorchLikeOptions();
    opt.comment = std::string(comment_n_bytes, 'c');
    const BuiltZip z = BuildZip(entries, opt);
    MemorySource src = Source(z.bytes);
    auto r = ZipArchive::Open(src);
    ASSERT_TRUE(r.ok()) << comment_n_bytes << ": " << r.error().ToString();
    ExpectMatchesBuild(*r, z, entries, src);
  }
}

TEST(ZipReader, TrailingBytesAfterEocdAreTolerated) {
  const auto entries = TorchLikeEntries();
  BuiltZip z = BuildZip(entries, TorchLikeOptions());
  z.bytes.insert(z.bytes.end(), 10, 0);
  MemorySource src = Source(z.bytes);
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ExpectMatchesBuild(*r, z, entries, src);
}

TEST(ZipReader, ReadsOncePerLocalHeader) {
  // Tail (EOCD + locator), ZIP64 EOCD, central directory, then one read per entry.
  const auto entries = TorchLikeEntries();
  auto src = Counted(BuildZip(entries, TorchLikeOptions()).bytes);
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(src.reads(), 3 + entries.size());
}

TEST(ZipReader, SourceErrorsPropagate) {
  const BuiltZip z = BuildZip(TorchLikeEntries(), TorchLikeOptions());
  for (uint64_t fail_from : {uint64_t{0}, z.cd_offset, z.local_header_offsets[2] + 1}) {
    auto src = Counted(z.bytes);  // every read touching [fail_from, end) fails
    src.fail_lo = fail_from;
    src.fail_hi = UINT64_MAX;
    auto r = ZipArchive::Open(src);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code(), StatusCode::kIo) << r.error().ToString();
    EXPECT_EQ(r.error().sys_errno(), EIO);
  }
}

// ---- limits --------------------------------------------------------------------------------

TEST(ZipReader, LimitsGiveResourceExhausted) {
  const BuiltZip z = BuildZip(TorchLikeEntries(), TorchLikeOptions());
  MemorySource src = Source(z.bytes);
  ExpectError(ZipArchive::Open(src, {.max_entries = 3}), StatusCode::kResourceExhausted, "entries");
  ExpectError(ZipArchive::Open(src, {.max_cd_bytes = z.cd_n_bytes - 1}),
              StatusCode::kResourceExhausted, "central directory of");
  EXPECT_TRUE(ZipArchive::Open(src, {.max_entries = 4, .max_cd_bytes = z.cd_n_bytes}).ok());
}

TEST(ZipReader, BigDeclaredEntryCountHitsLimit) {
  BuiltZip z = BuildZip(TorchLikeEntries(), TorchLikeOptions());
  PatchLe(z.bytes, z.zip64_eocd_offset + kZ64Count, 1'000'000'000, 8);
  MemorySource src = Source(z.bytes);
  ExpectError(ZipArchive::Open(src, {.max_entries = 1000}), StatusCode::kResourceExhausted);
  // Within a generous limit the count is still checked against the directory's size.
  ExpectError(ZipArchive::Open(src, {.max_entries = 2'000'000'000}), StatusCode::kCorrupt,
              "cannot fit");
}

// ---- corrupt-file catalogue ----------------------------------------------------------------

class ZipCorrupt : public ::testing::Test {
 protected:
  void SetUp() override { z_ = BuildZip(TorchLikeEntries(), TorchLikeOptions()); }
  BuiltZip z_;
};

TEST_F(ZipCorrupt, EmptyAndTinyFiles) {
  ExpectCorrupt({}, "too small");
  ExpectCorrupt(std::vector<uint8_t>(21, 0), "too small");
  ExpectCorrupt(std::vector<uint8_t>(22, 0), "no end-of-central-directory");
  ExpectCorrupt(std::vector<uint8_t>(100000, 0), "no end-of-central-directory");
}

TEST_F(ZipCorrupt, TruncatedAtEveryLength) {
  for (const std::vector<uint8_t>& full : {z_.bytes, PythonZip(), BuildZip(TorchLikeEntries()).bytes}) {
    for (size_t n = 0; n < full.size(); ++n) {
      std::vector<uint8_t> cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
      MemorySource src = Source(cut);
      auto r = ZipArchive::Open(src);
      ASSERT_FALSE(r.ok()) << "prefix of " << n << " bytes opened";
      ASSERT_EQ(r.error().code(), StatusCode::kCorrupt) << r.error().ToString();
    }
  }
}

TEST_F(ZipCorrupt, EocdCdOffsetPastEof) {
  BuiltZip z = BuildZip(TorchLikeEntries());  // no ZIP64 records: the EOCD values are used
  PatchLe(z.bytes, z.eocd_offset + kEocdCdOffset, z.bytes.size() + 100, 4);
  ExpectCorrupt(z.bytes, "central directory at offset");
}

TEST_F(ZipCorrupt, EocdCdSizePastEocd) {
  BuiltZip z = BuildZip(TorchLikeEntries());
  PatchLe(z.bytes, z.eocd_offset + kEocdCdSize, z.cd_n_bytes + 1, 4);
  ExpectCorrupt(z.bytes, "does not end before the end record");
}

TEST_F(ZipCorrupt, SaturatedEocdWithoutLocator) {
  BuiltZip z = BuildZip(TorchLikeEntries(), {.saturate_eocd = true});
  ExpectCorrupt(z.bytes);
}

TEST_F(ZipCorrupt, CdOffsetPlusSizeWraps) {
  PatchLe(z_.bytes, z_.zip64_eocd_offset + kZ64CdOffset, ~uint64_t{0} - 7, 8);
  PatchLe(z_.bytes, z_.zip64_eocd_offset + kZ64CdSize, 64, 8);
  ExpectCorrupt(z_.bytes, "central directory at offset");
  // A size past the end of the file is corruption, not a limit, whatever the limits.
  PatchLe(z_.bytes, z_.zip64_eocd_offset + kZ64CdOffset, z_.cd_offset, 8);
  PatchLe(z_.bytes, z_.zip64_eocd_offset + kZ64CdSize, ~uint64_t{0} - 7, 8);
  ExpectCorrupt(z_.bytes, "central directory at offset");
  ExpectCorrupt(z_.bytes, "central directory at offset",
                {.max_entries = ~uint64_t{0}, .max_cd_bytes = ~uint64_t{0}});
}

TEST_F(ZipCorrupt, EntryCountLargerThanCentralDirectory) {
  PatchLe(z_.bytes, z_.zip64_eocd_offset + kZ64Count, 5, 8);  // 5 * 46 still fits: walk runs out
  ExpectCorrupt(z_.bytes, "runs past the end of the central directory");
  PatchLe(z_.bytes, z_.zip64_eocd_offset + kZ64Count, 1000, 8);
  ExpectCorrupt(z_.bytes, "cannot fit");
  BuiltZip plain = BuildZip(TorchLikeEntries());  // the EOCD's own 16-bit count
  PatchLe(plain.bytes, plain.eocd_offset + kEocdCount, 5, 2);
  ExpectCorrupt(plain.bytes, "runs past the end of the central directory");
  PatchLe(plain.bytes, plain.eocd_offset + kEocdCount, 0xFFFF, 2);
  ExpectCorrupt(plain.bytes, "cannot fit");
}

TEST_F(ZipCorrupt, Zip64EocdWith2To63Entries) {
  PatchLe(z_.bytes, z_.zip64_eocd_offset + kZ64Count, uint64_t{1} << 63, 8);
  MemorySource src = Source(z_.bytes);
  ExpectError(ZipArchive::Open(src), StatusCode::kResourceExhausted);
  // No limit: the count * 46 overflow must be caught, not wrapped.
  ExpectCorrupt(z_.bytes, "cannot fit", {.max_entries = ~uint64_t{0}, .max_cd_bytes = ~uint64_t{0}});
}

TEST_F(ZipCorrupt, BadCentralDirectorySignature) {
  z_.bytes[z_.cd_entry_offsets[1]] ^= 0xFF;
  ExpectCorrupt(z_.bytes, "bad central directory signature");
}

TEST_F(ZipCorrupt, CdNameLengthPastCdEnd) {
  PatchLe(z_.bytes, z_.cd_entry_offsets.back() + kCdNameLen, 0xFFFF, 2);
  ExpectCorrupt(z_.bytes, "runs past the end of the central directory");
}

TEST_F(ZipCorrupt, LocalHeaderOffsetPastEof) {
  PatchLe(z_.bytes, z_.cd_entry_offsets[1] + kCdLho, 0x7FFFFFFF, 4);
  ExpectCorrupt(z_.bytes, "local header offset");
}

TEST_F(ZipCorrupt, LocalHeaderInsideCentralDirectory) {
  PatchLe(z_.bytes, z_.cd_entry_offsets[1] + kCdLho, z_.cd_offset - 10, 4);
  ExpectCorrupt(z_.bytes, "local header offset");
}

TEST_F(ZipCorrupt, SaturatedLocalHeaderOffsetWithoutZip64Extra) {
  PatchLe(z_.bytes, z_.cd_entry_offsets[0] + kCdLho, kSat32, 4);
  ExpectCorrupt(z_.bytes, "local header offset");
}

TEST_F(ZipCorrupt, BadLocalSignature) {
  z_.bytes[z_.local_header_offsets[1] + 2] ^= 0x01;
  ExpectCorrupt(z_.bytes, "bad local header signature");
}

TEST_F(ZipCorrupt, LocalNameLengthMismatch) {
  PatchLe(z_.bytes, z_.local_header_offsets[1] + kLocalNameLen, 13, 2);
  ExpectCorrupt(z_.bytes, "name length");
}

TEST_F(ZipCorrupt, LocalNameMismatch) {
  z_.bytes[z_.local_header_offsets[1] + 30 + 3] ^= 0x20;
  ExpectCorrupt(z_.bytes, "name differs");
}

TEST_F(ZipCorrupt, DataPastCentralDirectory) {
  // Sizes that reach into the central directory.
  const uint64_t too_big = z_.cd_offset - z_.data_offsets[3] + 1;
  PatchLe(z_.bytes, z_.cd_entry_offsets[3] + kCdCsize, too_big, 4);
  PatchLe(z_.bytes, z_.cd_entry_offsets[3] + kCdUsize, too_big, 4);
  ExpectCorrupt(z_.bytes, "does not end before the central directory");
}

TEST_F(ZipCorrupt, DataPastEof) {
  PatchLe(z_.bytes, z_.cd_entry_offsets[0] + kCdCsize, 0xFFFFFFF0, 4);
  PatchLe(z_.bytes, z_.cd_entry_offsets[0] + kCdUsize, 0xFFFFFFF0, 4);
  ExpectCorrupt(z_.bytes, "does not end before the central directory");
}

TEST_F(ZipCorrupt, LocalExtraPushesDataPastCentralDirectory) {
  PatchLe(z_.bytes, z_.local_header_offsets[3] + kLocalExtraLen, 0xFFFF, 2);
  ExpectCorrupt(z_.bytes, "does not end before the central directory");
}

TEST_F(ZipCorrupt, StoredSizesDisagree) {
  PatchLe(z_.bytes, z_.cd_entry_offsets[0] + kCdUsize, 17, 4);
  ExpectCorrupt(z_.bytes, "compressed size");
}

BuiltZip Zip64Sample() {
  return BuildZip({{.name = "z/a", .data = "0123456789", .zip64_sizes = true, .zip64_offset = true}},
                  {.zip64_end = true, .saturate_eocd = true});
}

TEST_F(ZipCorrupt, Zip64ExtraTooShort) {
  BuiltZip z = Zip64Sample();
  const uint64_t extra = z.cd_entry_offsets[0] + 46 + 3;
  PatchLe(z.bytes, extra + 2, 16, 2);  // needs 24: usize, csize, lho
  ExpectCorrupt(z.bytes, "too short");
  PatchLe(z.bytes, extra + 2, 0, 2);
  ExpectCorrupt(z.bytes, "too short");
}

TEST_F(ZipCorrupt, ExtraFieldOverrunsExtraArea) {
  BuiltZip z = Zip64Sample();
  PatchLe(z.bytes, z.cd_entry_offsets[0] + 46 + 3 + 2, 25, 2);
  ExpectCorrupt(z.bytes, "runs past the end of its entry's extra area");
}

TEST_F(ZipCorrupt, Zip64ExtraWithHugeValues) {
  BuiltZip z = Zip64Sample();
  const uint64_t extra_body = z.cd_entry_offsets[0] + 46 + 3 + 4;
  PatchLe(z.bytes, extra_body + 0, ~uint64_t{0}, 8);   // usize
  PatchLe(z.bytes, extra_body + 8, ~uint64_t{0}, 8);   // csize
  ExpectCorrupt(z.bytes, "does not end before the central directory");
  z = Zip64Sample();
  PatchLe(z.bytes, extra_body + 16, ~uint64_t{0} - 2, 8);  // lho
  ExpectCorrupt(z.bytes, "local header offset");
}

TEST_F(ZipCorrupt, Zip64LocatorPointsOutsideFile) {
  for (uint64_t bad : {uint64_t{z_.bytes.size()} + 100, ~uint64_t{0}, ~uint64_t{0} - 30,
                       uint64_t{z_.locator_offset - 55}}) {
    std::vector<uint8_t> bytes = z_.bytes;
    PatchLe(bytes, z_.locator_offset + kLocatorOffset, bad, 8);
    ExpectCorrupt(bytes, "ZIP64 locator");
  }
}

TEST_F(ZipCorrupt, Zip64EocdBadSignature) {
  z_.bytes[z_.zip64_eocd_offset] ^= 0xFF;
  ExpectCorrupt(z_.bytes, "bad ZIP64 end-of-central-directory signature");
}

TEST_F(ZipCorrupt, Zip64EocdBadRecordSize) {
  for (uint64_t bad : {uint64_t{0}, uint64_t{43}, uint64_t{45}, ~uint64_t{0}}) {
    std::vector<uint8_t> bytes = z_.bytes;
    PatchLe(bytes, z_.zip64_eocd_offset + kZ64RecordSize, bad, 8);
    ExpectCorrupt(bytes, "ZIP64 end record declares");
  }
}

TEST_F(ZipCorrupt, Zip64CdOffsetPastEof) {
  PatchLe(z_.bytes, z_.zip64_eocd_offset + kZ64CdOffset, uint64_t{1} << 40, 8);
  ExpectCorrupt(z_.bytes, "central directory at offset");
}

TEST_F(ZipCorrupt, EverySingleByteFlipIsHandled) {
  // Must never crash; an archive that still opens must keep every invariant.
  for (const std::vector<uint8_t>& base : {z_.bytes, PythonZip(), Zip64Sample().bytes}) {
    int n_ok = 0;
    for (size_t i = 0; i < base.size(); ++i) {
      for (uint8_t mask : {uint8_t{0x01}, uint8_t{0x80}, uint8_t{0xFF}}) {
        std::vector<uint8_t> bytes = base;
        bytes[i] ^= mask;
        MemorySource src = Source(bytes);
        auto r = ZipArchive::Open(src);
        if (r.ok()) {
          ++n_ok;
          ExpectInvariants(*r, src);
        } else {
          const StatusCode code = r.error().code();
          ASSERT_TRUE(code == StatusCode::kCorrupt || code == StatusCode::kResourceExhausted)
              << "flip " << int{mask} << " at " << i << ": " << r.error().ToString();
        }
      }
    }
    EXPECT_GT(n_ok, 0);  // flips in data bytes, CRCs and times are harmless
  }
}

TEST(ZipReader, ErrorMessagesNameSourceAndOffset) {
  BuiltZip z = BuildZip(TorchLikeEntries(), TorchLikeOptions());
  z.bytes[z.local_header_offsets[2]] = 'X';
  MemorySource src = Source(z.bytes, "model.pt");
  auto r = ZipArchive::Open(src);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().message(),
            "model.pt: offset " + std::to_string(z.local_header_offsets[2]) +
                ": entry 'archive/data/1': bad local header signature 0x04034b58");
}

// CheckEntryCrc32: a real CRC-32 passes, a wrong one is kDataLoss naming the entry, CRC 0 on
// data is "no checksum" (false), and every byte read is reported.
TEST(ZipReader, CheckEntryCrc32) {
  const std::vector<BuildEntry> entries = {
      {.name = "archive/data/0", .data = "hello", .crc = 0x3610a686},  // zlib.crc32(b"hello")
      {.name = "archive/data/1", .data = "hellp", .crc = 0x3610a686},  // one bit flipped
      {.name = "archive/data/2", .data = "abc", .crc = 0},             // no checksum stored
  };
  const BuiltZip z = BuildZip(entries, TorchLikeOptions());
  MemorySource src = Source(z.bytes, "w.pt");
  auto r = ZipArchive::Open(src);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  uint64_t n_read = 0;
  auto count = [&](uint64_t n) { n_read += n; };
  auto good = CheckEntryCrc32(src, *r->FindRecord("data/0"), count);
  ASSERT_TRUE(good.ok()) << good.error().ToString();
  EXPECT_TRUE(*good);
  EXPECT_EQ(n_read, 5u);
  auto bad = CheckEntryCrc32(src, *r->FindRecord("data/1"), count);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.error().message().find("w.pt: zip entry 'archive/data/1'"), std::string::npos) << bad.error().message();
  EXPECT_NE(bad.error().message().find("the zip header says 3610a686"), std::string::npos) << bad.error().message();
  auto none = CheckEntryCrc32(src, *r->FindRecord("data/2"), count);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(*none);
  EXPECT_EQ(n_read, 10u);  // nothing read for the entry without a checksum
}

}  // namespace
}  // namespace ucpfs::format
