// Tests for core/format/safetensors.h: files written by the real safetensors 0.8.0 library
// (tests/data/safetensors/make_safetensors.py) reproduced byte for byte by the lazy writer and
// parsed by the reader; seeded writer -> reader round trips with lazy reads at random offsets
// (the seed is logged; UCPFS_TEST_SEED replays one); the catalogue of handcrafted corrupt files,
// each refused with its code and a message naming the file and the problem; the index JSON both
// ways; and the writer's refusals.
#include "core/format/safetensors.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/checked.h"

namespace ucpfs::format {
namespace {

// The fixture generator's byte pattern (make_safetensors.py: pattern_byte); bools keep bit 0.
uint8_t PatternByte(DType dtype, uint8_t seed, uint64_t k) {
  const auto b = static_cast<uint8_t>((k * 31 + seed * 7u + (k >> 8)) % 251);
  return dtype == DType::kBool ? static_cast<uint8_t>(b & 1) : b;
}

uint64_t NBytes(DType dtype, const std::vector<int64_t>& shape) {
  uint64_t n = ItemSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Serves the pattern; every request must lie inside the tensor.
class PatternProvider final : public TensorBytesProvider {
 public:
  PatternProvider(DType dtype, uint64_t n_bytes, uint8_t seed) : dtype_(dtype), n_bytes_(n_bytes), seed_(seed) {}
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    if (out.empty() || !RangeInside(byte_offset, out.size(), n_bytes_)) {
      ADD_FAILURE() << "provider asked for " << out.size() << " bytes at " << byte_offset << " of " << n_bytes_;
      return OutOfRangeError("bad provider range");
    }
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>(PatternByte(dtype_, seed_, byte_offset + i));
    return Status::Ok();
  }

 private:
  DType dtype_;
  uint64_t n_bytes_;
  uint8_t seed_;
};

class FailingProvider final : public TensorBytesProvider {
 public:
  Status Read(uint64_t, std::span<std::byte>) const override { return IoError("disk.bin: pread: Input/output error", EIO); }
};

class FailingSource final : public ByteSource {
 public:
  uint64_t Size() const override { return 64; }
  const std::string& Name() const override { return name_; }
  Status ReadAt(uint64_t, std::span<std::byte>) const override { return IoError("bad.safetensors: pread", EIO); }

 private:
  std::string name_ = "bad.safetensors";
};

struct Spec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint8_t seed;
};

std::pair<std::string, SaveTensor> Tensor(const Spec& s) {
  const uint64_t n = NBytes(s.dtype, s.shape);
  return {s.name, SaveTensor{.dtype = s.dtype, .shape = s.shape,
                             .provider = std::make_shared<PatternProvider>(s.dtype, n, s.seed)}};
}

// The tables of make_safetensors.py.
const std::vector<Spec> kMixed = {
    {"layers.1.w", DType::kFloat32, {3, 2}, 1}, {"layers.0.w", DType::kBFloat16, {2, 3}, 2},
    {"step", DType::kInt64, {}, 3},             {"mask", DType::kBool, {5}, 4},
    {"tokens", DType::kUInt8, {7}, 5},          {"scale_fp8", DType::kFloat8E4M3FN, {3}, 6},
    {"a_half", DType::kFloat16, {1, 1, 3}, 7},  {"ids", DType::kInt32, {4}, 8},
    {"bias", DType::kFloat32, {3}, 9},          {"Z_upper", DType::kBFloat16, {1}, 10},
};
const std::vector<Spec> kZeroEmpty = {
    {"scalar", DType::kFloat32, {}, 1},       {"empty", DType::kFloat32, {0}, 2},
    {"empty_2x0", DType::kInt64, {2, 0}, 3},  {"empty_0x3", DType::kFloat32, {0, 3}, 4},
    {"after", DType::kFloat16, {2}, 5},
};
const std::vector<Spec> kAllDTypes = {
    {"f64", DType::kFloat64, {2}, 1},          {"f32", DType::kFloat32, {2}, 2},
    {"f16", DType::kFloat16, {2}, 3},          {"bf16", DType::kBFloat16, {2}, 4},
    {"i64", DType::kInt64, {2}, 5},            {"i32", DType::kInt32, {2}, 6},
    {"i16", DType::kInt16, {2}, 7},            {"i8", DType::kInt8, {2}, 8},
    {"u8", DType::kUInt8, {2}, 9},             {"bool", DType::kBool, {2}, 10},
    {"u16", DType::kUInt16, {2}, 11},          {"u32", DType::kUInt32, {2}, 12},
    {"u64", DType::kUInt64, {2}, 13},          {"c64", DType::kComplex64, {2}, 14},
    {"f8_e4m3", DType::kFloat8E4M3FN, {3}, 15}, {"f8_e5m2", DType::kFloat8E5M2, {3}, 16},
    {"f8_e4m3fnuz", DType::kFloat8E4M3Fnuz, {3}, 17}, {"f8_e5m2fnuz", DType::kFloat8E5M2Fnuz, {3}, 18},
    {"f8_e8m0", DType::kFloat8E8M0Fnu, {3}, 19},
};
const std::vector<Spec> kNames = {
    {"caf\xc3\xa9", DType::kFloat32, {1}, 1},
    {"quote\"back\\slash/", DType::kFloat32, {1}, 2},
    {std::string("ctl\x01\x1f\x7f\t\n\r\b\f"), DType::kFloat32, {1}, 3},
    {"\xe4\xb8\xad\xe6\x96\x87.\xf0\x9f\x98\x80", DType::kFloat32, {1}, 4},
    {"z", DType::kFloat32, {1}, 5},
    {"Z", DType::kFloat32, {1}, 6},
};
using Pairs = std::vector<std::pair<std::string, std::string>>;
const Pairs kFormatPt = {{"format", "pt"}};
const Pairs kNamesMetadata = {{"note", std::string("\xc3\xa9\"\\\n\0", 6)}};

std::filesystem::path DataDir() {
  if (const char* env = std::getenv("UCPFS_TEST_DATA"); env != nullptr && *env != '\0') return env;
  return std::filesystem::path(__FILE__).parent_path().parent_path() / "data";
}

std::vector<uint8_t> ReadFixture(const std::string& name) {
  std::ifstream f(DataDir() / "safetensors" / name, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot open " << name;
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::vector<uint8_t> Render(const ByteSource& f) {
  std::vector<uint8_t> out(f.Size());
  const Status st = f.ReadAt(0, std::as_writable_bytes(std::span<uint8_t>(out)));
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

std::shared_ptr<const LazySafetensorsFile> Build(std::vector<Spec> specs, const Pairs& metadata) {
  std::vector<std::pair<std::string, SaveTensor>> tensors;
  // Reverse the given order: the writer must not depend on it.
  for (auto it = specs.rbegin(); it != specs.rend(); ++it) tensors.push_back(Tensor(*it));
  auto f = LazySafetensorsFile::Build(std::move(tensors), metadata, "out.safetensors");
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  return f.ok() ? *f : nullptr;
}

// The reader's view of `bytes` agrees with `specs` and `metadata`, and each tensor's bytes are
// its pattern.
void ExpectReads(const std::vector<uint8_t>& bytes, const std::vector<Spec>& specs, const Pairs& metadata) {
  MemorySource src("golden.safetensors", bytes);
  auto h = ReadSafetensors(src);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->metadata, metadata);
  EXPECT_EQ(h->data_byte_offset, 8 + h->header_n_bytes);
  EXPECT_EQ(h->header_n_bytes % 8, 0u);
  ASSERT_EQ(h->tensors.size(), specs.size());
  uint64_t previous_end = h->data_byte_offset;
  for (const SafetensorsTensor& t : h->tensors) {
    EXPECT_EQ(t.byte_offset, previous_end) << t.name;
    previous_end = t.byte_offset + t.n_bytes;
    const Spec* spec = nullptr;
    for (const Spec& s : specs) {
      if (s.name == t.name) spec = &s;
    }
    ASSERT_NE(spec, nullptr) << t.name;
    EXPECT_EQ(t.dtype, spec->dtype) << t.name;
    EXPECT_EQ(t.shape, spec->shape) << t.name;
    ASSERT_EQ(t.n_bytes, NBytes(spec->dtype, spec->shape)) << t.name;
    for (uint64_t k = 0; k < t.n_bytes; ++k) {
      ASSERT_EQ(bytes[t.byte_offset + k], PatternByte(spec->dtype, spec->seed, k)) << t.name << " byte " << k;
    }
  }
  EXPECT_EQ(previous_end, bytes.size());
}

void ExpectGolden(const std::string& fixture, const std::vector<Spec>& specs, const Pairs& metadata) {
  SCOPED_TRACE(fixture);
  const std::vector<uint8_t> golden = ReadFixture(fixture);
  ASSERT_FALSE(golden.empty());
  auto f = Build(specs, metadata);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->Size(), golden.size());
  const std::vector<uint8_t> ours = Render(*f);
  EXPECT_EQ(std::string(ours.begin(), ours.end()), std::string(golden.begin(), golden.end()));
  ExpectReads(golden, specs, metadata);
}

TEST(SafetensorsGolden, Mixed) { ExpectGolden("mixed.safetensors", kMixed, kFormatPt); }
TEST(SafetensorsGolden, ZeroDimAndEmpty) { ExpectGolden("zero_empty.safetensors", kZeroEmpty, {}); }
TEST(SafetensorsGolden, EveryDType) { ExpectGolden("all_dtypes.safetensors", kAllDTypes, {}); }
TEST(SafetensorsGolden, EscapedAndNonAsciiNames) { ExpectGolden("names.safetensors", kNames, kNamesMetadata); }
TEST(SafetensorsGolden, NoTensors) {
  ExpectGolden("no_tensors.safetensors", {}, kFormatPt);
  ExpectGolden("empty.safetensors", {}, {});
}

TEST(SafetensorsGolden, HeaderText) {
  // The library's order and spelling, spelled out once so a change is easy to read.
  auto f = Build({{"b", DType::kFloat32, {2}, 1}, {"a", DType::kBool, {}, 2}, {"c", DType::kInt64, {0}, 3}},
                 kFormatPt);
  ASSERT_NE(f, nullptr);
  const std::string json = f->header().substr(8);
  EXPECT_EQ(json,
            "{\"__metadata__\":{\"format\":\"pt\"},"
            "\"c\":{\"dtype\":\"I64\",\"shape\":[0],\"data_offsets\":[0,0]},"
            "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
            "\"a\":{\"dtype\":\"BOOL\",\"shape\":[],\"data_offsets\":[8,9]}} ");
  EXPECT_EQ(f->Size(), f->header().size() + 9);
}

TEST(SafetensorsGolden, IndexJson) {
  const std::vector<uint8_t> golden = ReadFixture("index.json");
  const std::string text(golden.begin(), golden.end());
  const Pairs weight_map = {
      {"model.layers.10.w", "model-00002-of-00002.safetensors"},
      {"model.layers.9.w", "model-00001-of-00002.safetensors"},
      {"lm_head.weight", "model-00002-of-00002.safetensors"},
      {"caf\xc3\xa9\x7f\x01\"\\/", "model-00001-of-00002.safetensors"},
      {"\xf0\x9f\x98\x80", "model-00001-of-00002.safetensors"},
      {"\xef\xbf\xbf", "model-00001-of-00002.safetensors"},
      {"Z", "model-00001-of-00002.safetensors"},
  };
  EXPECT_EQ(SafetensorsIndexJson(123456789, weight_map), text);
  auto parsed = ParseSafetensorsIndex(text, "model.safetensors.index.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_EQ(parsed->size(), weight_map.size());
  Pairs sorted = weight_map;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(*parsed, sorted);  // the file holds them sorted
}

TEST(SafetensorsIndex, EmptyAndNotUtf8) {
  EXPECT_EQ(SafetensorsIndexJson(0, {}), "{\n  \"metadata\": {\n    \"total_size\": 0\n  },\n  \"weight_map\": {}\n}\n");
  EXPECT_EQ(SafetensorsIndexJson(5, {{"b\xff", "f"}, {"a", "f"}}),
            "{\n  \"metadata\": {\n    \"total_size\": 5\n  },\n  \"weight_map\": {\n    \"a\": \"f\",\n"
            "    \"b\\ufffd\": \"f\"\n  }\n}\n");
}

TEST(SafetensorsIndex, ParsesAndSkipsWhatItDoesNotRead) {
  auto parsed = ParseSafetensorsIndex(
      R"({"metadata": {"total_size": 10, "x": [1, {"y": null}]}, "extra": [[true]],
          "weight_map": {"b": "f2", "a": "f1"}})", "i.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(*parsed, (Pairs{{"b", "f2"}, {"a", "f1"}}));
  auto empty = ParseSafetensorsIndex(R"({"weight_map": {}})", "i.json");
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE(empty->empty());
}

void ExpectIndexRefused(std::string_view text, StatusCode code, const std::string& what,
                        const SafetensorsLimits& limits = {}) {
  auto r = ParseSafetensorsIndex(text, "idx.json", limits);
  ASSERT_FALSE(r.ok()) << "accepted: " << text.substr(0, 80);
  EXPECT_EQ(r.error().code(), code) << r.error().ToString();
  EXPECT_NE(r.error().message().find("idx.json"), std::string::npos) << r.error().ToString();
  EXPECT_NE(r.error().message().find(what), std::string::npos) << r.error().ToString();
}

TEST(SafetensorsIndex, Refusals) {
  ExpectIndexRefused("", StatusCode::kCorrupt, "invalid JSON");
  ExpectIndexRefused("{\"weight_map\": {}", StatusCode::kCorrupt, "invalid JSON");
  ExpectIndexRefused("[]", StatusCode::kCorrupt, "not a JSON object");
  ExpectIndexRefused(std::string_view("{\"weight_map\": {}}\0junk", 23), StatusCode::kCorrupt, "NUL byte");
  ExpectIndexRefused(R"({"metadata": {}})", StatusCode::kCorrupt, "no weight_map");
  ExpectIndexRefused(R"({"weight_map": []})", StatusCode::kCorrupt, "weight_map is an array");
  ExpectIndexRefused(R"({"weight_map": {"a": 1}})", StatusCode::kCorrupt, "not a string");
  ExpectIndexRefused(R"({"weight_map": {"a": {}}})", StatusCode::kCorrupt, "not a string");
  ExpectIndexRefused(R"({"weight_map": {"a": "f", "a": "g"}})", StatusCode::kCorrupt, "weight_map: duplicate key");
  ExpectIndexRefused(R"({"weight_map": {}, "weight_map": {}})", StatusCode::kCorrupt, "duplicate key");
  ExpectIndexRefused(R"({"metadata": {"k": 1, "k": 2}, "weight_map": {}})", StatusCode::kCorrupt, "duplicate key");
  ExpectIndexRefused("{\"weight_map\": {\"a\xff\": \"f\"}}", StatusCode::kCorrupt, "invalid JSON");
  ExpectIndexRefused(R"({"weight_map": {"\ud800": "f"}})", StatusCode::kCorrupt, "invalid JSON");
  SafetensorsLimits two;
  two.max_tensors = 2;
  ExpectIndexRefused(R"({"weight_map": {"a": "f", "b": "f", "c": "f"}})", StatusCode::kResourceExhausted,
                     "more than 2", two);
  SafetensorsLimits small;
  small.max_header_bytes = 10;
  ExpectIndexRefused(R"({"weight_map": {}})", StatusCode::kResourceExhausted, "limit", small);
  // Nesting: 65 levels are refused, a million too (no recursion to overflow).
  for (int depth : {kMaxIndexJsonDepth + 1, 1'000'000}) {
    std::string deep = "{\"metadata\": " + std::string(static_cast<size_t>(depth - 1), '[') +
                       std::string(static_cast<size_t>(depth - 1), ']') + ", \"weight_map\": {}}";
    ExpectIndexRefused(deep, StatusCode::kResourceExhausted, "nested deeper");
  }
  std::string ok_deep = "{\"metadata\": " + std::string(kMaxIndexJsonDepth - 1, '[') +
                        std::string(kMaxIndexJsonDepth - 1, ']') + ", \"weight_map\": {}}";
  EXPECT_TRUE(ParseSafetensorsIndex(ok_deep, "idx.json").ok());
}

TEST(SafetensorsDType, Names) {
  EXPECT_EQ(SafetensorsDTypeName(DType::kFloat32), "F32");
  EXPECT_EQ(SafetensorsDTypeName(DType::kBFloat16), "BF16");
  EXPECT_EQ(SafetensorsDTypeName(DType::kBool), "BOOL");
  EXPECT_EQ(SafetensorsDTypeName(DType::kFloat8E4M3FN), "F8_E4M3");
  EXPECT_EQ(SafetensorsDTypeName(DType::kFloat8E8M0Fnu), "F8_E8M0");
  EXPECT_EQ(SafetensorsDTypeName(DType::kComplex64), "C64");
  EXPECT_EQ(SafetensorsDTypeName(DType::kComplex32), "");
  EXPECT_EQ(SafetensorsDTypeName(DType::kComplex128), "");
  EXPECT_EQ(SafetensorsDTypeName(DType::kQInt8), "");
  int named = 0;
  for (int i = 0; i < kNumDTypes; ++i) named += SafetensorsDTypeName(static_cast<DType>(i)).empty() ? 0 : 1;
  EXPECT_EQ(named, 19);
}

// Writer -> bytes -> reader, random tensors; then random lazy reads against the whole render.
TEST(SafetensorsRoundTrip, RandomFilesAndLazyReads) {
  uint64_t seed = std::random_device{}();
  if (const char* env = std::getenv("UCPFS_TEST_SEED")) seed = std::strtoull(env, nullptr, 10);
  std::cout << "UCPFS_TEST_SEED=" << seed << "\n";
  std::mt19937_64 rng(seed);
  std::vector<DType> dtypes;
  for (int i = 0; i < kNumDTypes; ++i) {
    if (!SafetensorsDTypeName(static_cast<DType>(i)).empty()) dtypes.push_back(static_cast<DType>(i));
  }
  for (int round = 0; round < 40; ++round) {
    std::vector<Spec> specs;
    const int n = static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      Spec s;
      s.name = "t" + std::to_string(rng() % 1000) + "_" + std::to_string(i);
      s.dtype = dtypes[rng() % dtypes.size()];
      const int rank = static_cast<int>(rng() % 4);
      for (int d = 0; d < rank; ++d) s.shape.push_back(static_cast<int64_t>(rng() % 6));
      s.seed = static_cast<uint8_t>(rng());
      specs.push_back(s);
    }
    Pairs metadata;
    if (rng() % 2 == 0) metadata.emplace_back("format", "pt");
    auto f = Build(specs, metadata);
    ASSERT_NE(f, nullptr);
    const std::vector<uint8_t> whole = Render(*f);
    ExpectReads(whole, specs, metadata);
    for (int r = 0; r < 50; ++r) {
      const uint64_t off = rng() % (whole.size() + 1);
      const uint64_t len = rng() % (whole.size() - off + 1);
      std::vector<uint8_t> part(len);
      ASSERT_TRUE(f->ReadAt(off, std::as_writable_bytes(std::span<uint8_t>(part))).ok());
      ASSERT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + static_cast<ptrdiff_t>(off)))
          << "round " << round << " offset " << off << " length " << len;
    }
  }
}

TEST(SafetensorsWriter, ReadErrors) {
  std::vector<std::pair<std::string, SaveTensor>> tensors;
  tensors.push_back({"bad", SaveTensor{.dtype = DType::kFloat32, .shape = {4},
                                       .provider = std::make_shared<FailingProvider>()}});
  auto f = LazySafetensorsFile::Build(std::move(tensors), {}, "v.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  std::vector<std::byte> buf(4);
  EXPECT_TRUE((*f)->ReadAt(0, buf).ok());  // header bytes only: no provider call
  std::vector<std::byte> all((*f)->Size());
  const Status st = (*f)->ReadAt(0, all);
  EXPECT_EQ(st.code(), StatusCode::kIo);
  EXPECT_EQ(st.sys_errno(), EIO);
  EXPECT_NE(st.message().find("\"bad\""), std::string::npos) << st.ToString();
  EXPECT_EQ((*f)->ReadAt((*f)->Size(), std::span<std::byte>(buf.data(), 1)).code(), StatusCode::kOutOfRange);
  EXPECT_TRUE((*f)->ReadAt((*f)->Size(), std::span<std::byte>()).ok());
}

void ExpectBuildRefused(std::vector<std::pair<std::string, SaveTensor>> tensors, const Pairs& metadata,
                        const std::string& what) {
  auto f = LazySafetensorsFile::Build(std::move(tensors), metadata, "v.safetensors");
  ASSERT_FALSE(f.ok()) << "accepted; wanted: " << what;
  EXPECT_EQ(f.error().code(), StatusCode::kInvalidArgument) << f.error().ToString();
  EXPECT_NE(f.error().message().find("v.safetensors"), std::string::npos) << f.error().ToString();
  EXPECT_NE(f.error().message().find(what), std::string::npos) << f.error().ToString();
}

TEST(SafetensorsWriter, Refusals) {
  const auto t = [](std::string name, DType dtype, std::vector<int64_t> shape) { return Tensor({std::move(name), dtype, std::move(shape), 1}); };
  ExpectBuildRefused({t("a", DType::kFloat32, {1}), t("a", DType::kInt8, {2})}, {}, "duplicate tensor name \"a\"");
  ExpectBuildRefused({t("c", DType::kComplex128, {1})}, {}, "no dtype for complex128");
  ExpectBuildRefused({t("c", DType::kComplex32, {1})}, {}, "no dtype for complex32");
  ExpectBuildRefused({t("q", DType::kQInt8, {1})}, {}, "no dtype for qint8");
  ExpectBuildRefused({t("", DType::kFloat32, {1})}, {}, "non-empty");
  ExpectBuildRefused({t("__metadata__", DType::kFloat32, {1})}, {}, "other than __metadata__");
  ExpectBuildRefused({t("bad\xff", DType::kFloat32, {1})}, {}, "UTF-8");
  ExpectBuildRefused({{"neg", SaveTensor{.dtype = DType::kFloat32, .shape = {2, -1}, .provider = nullptr}}}, {},
                     "negative dimension");
  ExpectBuildRefused({{"huge", SaveTensor{.dtype = DType::kFloat32, .shape = {1LL << 40, 1LL << 40}, .provider = nullptr}}},
                     {}, "more than 2^64");
  ExpectBuildRefused({{"np", SaveTensor{.dtype = DType::kFloat32, .shape = {2}, .provider = nullptr}}}, {},
                     "no provider");
  ExpectBuildRefused({}, {{"k", "1"}, {"k", "2"}}, "duplicate metadata key \"k\"");
  ExpectBuildRefused({}, {{"k", "\xc0\xaf"}}, "UTF-8");
  // Empty tensors need no provider.
  EXPECT_TRUE(LazySafetensorsFile::Build(
                  {{"e", SaveTensor{.dtype = DType::kFloat32, .shape = {0, 5}, .provider = nullptr}}}, {}, "v")
                  .ok());
}

// ---- The corrupt-file catalogue ----

std::string Le64(uint64_t v) {
  std::string out;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
  return out;
}

// A file: length, `json` padded with spaces to a multiple of 8, `data_n_bytes` zero bytes.
std::string File(const std::string& json, size_t data_n_bytes) {
  std::string padded = json;
  padded.append((8 - padded.size() % 8) % 8, ' ');
  return Le64(padded.size()) + padded + std::string(data_n_bytes, '\0');
}

std::string Entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
}

void ExpectRefused(const std::string& bytes, StatusCode code, const std::string& what,
                   const SafetensorsLimits& limits = {}) {
  MemorySource src("bad.safetensors", std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  auto h = ReadSafetensors(src, limits);
  ASSERT_FALSE(h.ok()) << "accepted; wanted: " << what;
  EXPECT_EQ(h.error().code(), code) << h.error().ToString();
  EXPECT_NE(h.error().message().find("bad.safetensors"), std::string::npos) << h.error().ToString();
  EXPECT_NE(h.error().message().find(what), std::string::npos) << "wanted: " << what << "\n got: " << h.error().ToString();
}

TEST(SafetensorsCorrupt, Catalogue) {
  const std::string a = Entry("a", "F32", "[2]", "[0,8]");
  const StatusCode kC = StatusCode::kCorrupt;
  // Sanity: the base file is fine.
  {
    const std::string good = File("{" + a + "}", 8);
    MemorySource src("good", std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(good.data()), good.size()));
    ASSERT_TRUE(ReadSafetensors(src).ok());
  }
  // The 8-byte length.
  ExpectRefused(std::string(5, '\0'), kC, "shorter than the 8-byte header length");
  ExpectRefused(Le64(0) + "{}", kC, "header length 0 is below 2");
  ExpectRefused(Le64(1) + "{", kC, "header length 1 is below 2");
  ExpectRefused(Le64(100) + "{}", kC, "header length 100 runs past the end of the file (10 bytes)");
  ExpectRefused(Le64(UINT64_MAX) + "{}", kC, "runs past the end of the file");
  SafetensorsLimits small;
  small.max_header_bytes = 16;
  ExpectRefused(File("{" + a + "}", 8), StatusCode::kResourceExhausted, "above the limit of 16 bytes", small);
  // The JSON text.
  ExpectRefused(File("{x}", 0), kC, "invalid JSON");
  ExpectRefused(File("[]", 0), kC, "is an array, not a JSON object");
  ExpectRefused(File("\"s\"", 0), kC, "is a string, not a JSON object");
  ExpectRefused(File("{" + a + "} x", 8), kC, "invalid JSON");
  ExpectRefused(Le64(8) + "{}" + std::string(6, '\0'), kC, "byte 2: invalid JSON: a NUL byte");  // NUL padding
  ExpectRefused(Le64(16) + "{}" + std::string(1, '\0') + "{\"x\":[}}}}}}}}}}", kC, "NUL byte");
  ExpectRefused(File("{" + a + ",}", 8), kC, "invalid JSON");
  ExpectRefused(File("{\"a\xff\":{}}", 0), kC, "invalid JSON");                 // not UTF-8
  ExpectRefused(File("{\"\xc0\xaf\":{}}", 0), kC, "invalid JSON");             // overlong
  ExpectRefused(File("{\"\\udc00\":{}}", 0), kC, "invalid JSON");              // lone surrogate
  ExpectRefused(File("{\"a\":{\"dtype\":\"F32\xed\xa0\x80\"}}", 0), kC, "invalid JSON");  // encoded surrogate
  // Tensor entries.
  ExpectRefused(File("{\"a\":1}", 0), kC, "tensor \"a\": entry is an integer, not an object");
  ExpectRefused(File("{\"a\":[]}", 0), kC, "tensor \"a\": entry is an array, not an object");
  ExpectRefused(File(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), kC, "tensor \"a\": no dtype");
  ExpectRefused(File(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8), kC, "tensor \"a\": no shape");
  ExpectRefused(File(R"({"a":{"dtype":"F32","shape":[2]}})", 8), kC, "tensor \"a\": no data_offsets");
  ExpectRefused(File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8), kC,
                "unexpected field \"x\"");
  ExpectRefused(File(R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8), kC,
                "duplicate field \"dtype\"");
  ExpectRefused(File(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8), kC, "dtype is an integer, not a string");
  ExpectRefused(File(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8), kC, "shape is an integer, not an array");
  ExpectRefused(File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":{}}})", 8), kC, "data_offsets is an object");
  ExpectRefused(File(R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8), kC, "shape holds a string");
  ExpectRefused(File(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8), kC,
                "shape holds a number that is not an integer");
  ExpectRefused(File(R"({"a":{"dtype":"F32","shape":[null],"data_offsets":[0,8]}})", 8), kC, "shape holds null");
  ExpectRefused(File(Entry("a", "f32", "[2]", "[0,8]").insert(0, "{") + "}", 8), kC, "unknown dtype \"f32\"");
  ExpectRefused(File(Entry("a", "", "[2]", "[0,8]").insert(0, "{") + "}", 8), kC, "unknown dtype \"\"");
  ExpectRefused(File("{" + Entry("a", "F4", "[2]", "[0,1]") + "}", 1), StatusCode::kUnsupported,
                "tensor \"a\": dtype F4 has no ucpfs dtype");
  ExpectRefused(File("{" + Entry("a", "F6_E2M3", "[4]", "[0,3]") + "}", 3), StatusCode::kUnsupported, "F6_E2M3");
  // Shapes.
  ExpectRefused(File("{" + Entry("a", "F32", "[-2]", "[0,8]") + "}", 8), kC, "negative dimension");
  ExpectRefused(File("{" + Entry("a", "F32", "[9223372036854775808]", "[0,8]") + "}", 8), kC, "above 2^63 - 1");
  ExpectRefused(File("{" + Entry("a", "F32", "[4294967296,4294967296,2]", "[0,8]") + "}", 8), kC,
                "has more than 2^64 bytes");
  ExpectRefused(File("{" + Entry("a", "F32", "[4611686018427387904]", "[0,8]") + "}", 8), kC,
                "has more than 2^64 bytes");  // numel fits, numel * 4 does not
  ExpectRefused(File("{" + Entry("a", "F32", "[99999999999999999999]", "[0,8]") + "}", 8), kC,
                "shape holds a number that is not an integer");  // beyond u64: parsed as a double
  ExpectRefused(File("{" + Entry("a", "F32", "[1e400]", "[0,8]") + "}", 8), kC, "invalid JSON");
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[0,8]") + "}", 8), StatusCode::kResourceExhausted, "rank above 0",
                SafetensorsLimits{.max_rank = 0});
  // data_offsets.
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[8,0]") + "}", 8), kC, "data_offsets [8, 0] are reversed");
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[0]") + "}", 8), kC, "data_offsets has 1 entries, not 2");
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[]") + "}", 8), kC, "data_offsets has 0 entries, not 2");
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[0,8,8]") + "}", 8), kC, "more than 2 entries");
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[-1,8]") + "}", 8), kC, "data_offsets holds a negative integer");
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[0,8.5]") + "}", 8), kC, "data_offsets holds a number");
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[0,18446744073709551615]") + "}", 8), kC, "hold 18446744073709551615 bytes");
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[0,4]") + "}", 4), kC,
                "data_offsets [0, 4] hold 4 bytes, but shape [2] of F32 needs 8");
  // Tiling of the data buffer.
  ExpectRefused(File("{" + a + "," + Entry("b", "F32", "[1]", "[4,8]") + "}", 8), kC,
                "tensor \"b\": data [4, 8) overlaps tensor \"a\"");
  ExpectRefused(File("{" + a + "," + Entry("b", "F32", "[0]", "[4,4]") + "}", 8), kC, "overlaps tensor \"a\"");
  ExpectRefused(File("{" + a + "," + Entry("b", "F32", "[1]", "[12,16]") + "}", 16), kC,
                "tensor \"b\": data [12, 16) leaves a hole of 4 bytes");
  ExpectRefused(File("{" + Entry("a", "F32", "[2]", "[4,12]") + "}", 12), kC, "leaves a hole of 4 bytes");
  ExpectRefused(File("{" + a + "}", 4), kC, "run past the end of the data buffer (4 bytes");
  ExpectRefused(File("{" + a + "}", 9), kC, "the tensors cover 8 bytes of the 9-byte data buffer");
  ExpectRefused(File("{}", 1), kC, "cover 0 bytes of the 1-byte data buffer");
  // Names and metadata.
  ExpectRefused(File("{" + a + "," + a + "}", 8), kC, "duplicate name \"a\"");
  ExpectRefused(File(R"({"__metadata__":{"k":1}})", 0), kC, "__metadata__ value of key \"k\" is an integer, not a string");
  ExpectRefused(File(R"({"__metadata__":{"k":{}}})", 0), kC, "is an object, not a string");
  ExpectRefused(File(R"({"__metadata__":["k"]})", 0), kC, "__metadata__ is an array, not an object");
  ExpectRefused(File(R"({"__metadata__":"pt"})", 0), kC, "__metadata__ is a string, not an object");
  ExpectRefused(File(R"({"__metadata__":{"k":"1","k":"2"}})", 0), kC, "__metadata__: duplicate key \"k\"");
  ExpectRefused(File(R"({"__metadata__":{},"__metadata__":{}})", 0), kC, "duplicate name \"__metadata__\"");
  ExpectRefused(File("{" + a + "," + Entry("b", "F32", "[2]", "[8,16]") + "}", 16), StatusCode::kResourceExhausted,
                "more than 1 tensors", SafetensorsLimits{.max_tensors = 1});
  // Deep nesting is refused at the first level the schema does not allow: no recursion, no tree.
  const size_t deep = 1'000'000;
  ExpectRefused(File(std::string(deep, '[') + std::string(deep, ']'), 0), kC, "not a JSON object");
  ExpectRefused(File("{\"a\":{\"shape\":" + std::string(deep, '[') + std::string(deep, ']') + "}}", 0), kC,
                "shape holds an array");
  ExpectRefused(File("{\"__metadata__\":{\"k\":" + std::string(deep, '[') + std::string(deep, ']') + "}}", 0), kC,
                "is an array, not a string");
  // I/O errors come through as they are.
  FailingSource failing;
  auto h = ReadSafetensors(failing);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.error().code(), StatusCode::kIo);
}

TEST(SafetensorsReader, WhatTheLibraryAlsoAccepts) {
  // Whitespace around the JSON, __metadata__ null, an empty name, an empty tensor anywhere on a
  // boundary, fields in any order, a header not padded to 8.
  const std::string json = " {\"__metadata__\":null,\"b\":{\"shape\":[0],\"data_offsets\":[8,8],\"dtype\":\"F32\"}," +
                           Entry("", "F32", "[2]", "[0,8]") + "}\n\t";
  const std::string bytes = Le64(json.size()) + json + std::string(8, '\0');
  MemorySource src("ok.safetensors", std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  auto h = ReadSafetensors(src);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "");
  EXPECT_EQ(h->tensors[1].name, "b");
  EXPECT_EQ(h->tensors[1].byte_offset, 8 + json.size() + 8);
  EXPECT_TRUE(h->metadata.empty());
}

}  // namespace
}  // namespace ucpfs::format
