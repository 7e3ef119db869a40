// TorchFile: tensor resolution on files from the lazy writer (round trip, seeded property
// test over random descriptions) and a catalogue of files whose pickle lies about its storages.
#include "core/format/torch_file.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "core/format/torch_writer.h"
#include "core/io/file_source.h"
#include "tests/unit/counting_source.h"

namespace ucpfs::format {
namespace {

// Tensor bytes held in memory.
class VectorProvider final : public TensorBytesProvider {
 public:
  explicit VectorProvider(std::vector<std::byte> bytes) : bytes_(std::move(bytes)) {}
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    if (!out.empty()) std::memcpy(out.data(), bytes_.data() + byte_offset, out.size());
    return Status::Ok();
  }
  const std::vector<std::byte>& bytes() const { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

struct Made {
  SaveValue value;
  std::shared_ptr<const VectorProvider> provider;
};

Made MakeTensor(std::mt19937_64& rng, DType dtype, std::vector<int64_t> shape) {
  uint64_t n = ItemSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  std::vector<std::byte> bytes(n);
  for (auto& b : bytes) b = static_cast<std::byte>(rng() & 0xFF);
  if (dtype == DType::kBool) {
    for (auto& b : bytes) b = static_cast<std::byte>(static_cast<uint8_t>(b) & 1);
  }
  auto p = std::make_shared<VectorProvider>(std::move(bytes));
  return {SaveValue::Tensor(dtype, std::move(shape), p), p};
}

std::vector<std::byte> ReadAll(const ByteSource& src) {
  std::vector<std::byte> out(src.Size());
  EXPECT_TRUE(src.ReadAt(0, out).ok());
  return out;
}

TEST(TorchFile, RoundTripsWriterOutput) {
  std::mt19937_64 rng(1);
  auto a = MakeTensor(rng, DType::kBFloat16, {3, 5});
  auto b = MakeTensor(rng, DType::kInt64, {});
  auto c = MakeTensor(rng, DType::kFloat32, {0, 4});
  SaveValue inner = SaveValue::List();
  inner.Append(b.value).Append(SaveValue::Str("x")).Append(c.value);
  SaveValue root = SaveValue::OrderedDict();
  root.Set("layers.0.weight", a.value).Set("extra", inner).Set(SaveValue::Int(7), SaveValue::Int(1));
  auto written = LazyTorchFile::Build(root, "rt.pt");
  ASSERT_TRUE(written.ok()) << written.error().ToString();
  auto file = TorchFile::Open(*written);
  ASSERT_TRUE(file.ok()) << file.error().ToString();
  const auto& ts = file->tensors();
  ASSERT_EQ(ts.size(), 3u);
  EXPECT_EQ(ts[0].key, "layers.0.weight");
  EXPECT_EQ(ts[1].key, "extra.0");
  EXPECT_EQ(ts[2].key, "extra.2");
  EXPECT_EQ(ts[0].dtype, DType::kBFloat16);
  EXPECT_EQ(ts[0].shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(ts[0].stride, (std::vector<int64_t>{5, 1}));
  EXPECT_TRUE(ts[1].shape.empty());
  EXPECT_EQ(ts[1].n_bytes, 8u);
  EXPECT_EQ(ts[2].n_bytes, 0u);
  EXPECT_EQ(ts[0].storage_key, "0");
  EXPECT_EQ(ts[2].storage_key, "2");
  auto all = ReadAll(**written);
  EXPECT_EQ(0, std::memcmp(all.data() + ts[0].data_offset, a.provider->bytes().data(), ts[0].n_bytes));
  EXPECT_EQ(0, std::memcmp(all.data() + ts[1].data_offset, b.provider->bytes().data(), 8));
  for (const auto& t : ts) EXPECT_EQ(t.data_offset % 64, 0u) << t.key;
}

// Property: for random descriptions, the reader finds exactly the records and bytes the writer
// laid out. Seed from UCPFS_TEST_SEED or random, and logged.
TEST(TorchFileProperty, ReaderFindsWriterBytes) {
  uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("UCPFS_TEST_SEED")) seed = std::strtoull(s, nullptr, 10);
  std::cout << "seed " << seed << " (UCPFS_TEST_SEED to reproduce)\n";
  std::mt19937_64 rng(seed);
  const DType dtypes[] = {DType::kFloat64, DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                          DType::kInt64,   DType::kInt32,   DType::kInt16,   DType::kInt8,
                          DType::kUInt8,   DType::kBool,    DType::kComplex64,
                          DType::kComplex128, DType::kFloat8E4M3FN, DType::kUInt16};
  for (int round = 0; round < 50; ++round) {
    SaveValue root = SaveValue::Dict();
    std::vector<Made> made;
    const int n = static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      std::vector<int64_t> shape(rng() % 4);
      for (auto& d : shape) d = static_cast<int64_t>(rng() % 6);
      made.push_back(MakeTensor(rng, dtypes[rng() % std::size(dtypes)], shape));
      root.Set("t" + std::to_string(i), made.back().value);
    }
    auto written = LazyTorchFile::Build(root, "prop.pt");
    ASSERT_TRUE(written.ok()) << written.error().ToString();
    auto file = TorchFile::Open(*written);
    ASSERT_TRUE(file.ok()) << file.error().ToString();
    ASSERT_EQ(file->tensors().size(), made.size());
    auto all = ReadAll(**written);
    for (size_t i = 0; i < made.size(); ++i) {
      const auto& t = file->tensors()[i];
      const auto& want = made[i].value.tensor();
      EXPECT_EQ(t.key, "t" + std::to_string(i));
      EXPECT_EQ(t.dtype, want.dtype);
      EXPECT_EQ(t.shape, want.shape);
      EXPECT_TRUE(t.contiguous);
      ASSERT_EQ(t.n_bytes, made[i].provider->bytes().size());
      const auto& rec = (*written)->records();
      auto it = std::find_if(rec.begin(), rec.end(), [&](const RecordLayout& r) {
        return r.name == "data/" + t.storage_key;
      });
      ASSERT_NE(it, rec.end());
      EXPECT_EQ(t.data_offset, it->data_offset);
      const auto& want_bytes = made[i].provider->bytes();
      EXPECT_TRUE(std::equal(want_bytes.begin(), want_bytes.end(), all.begin() + static_cast<long>(t.data_offset)));
    }
  }
}

// Writes a one-tensor file, then patches its pickle (same length) so it lies.
class CorruptTorchFile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(7);
    auto t = MakeTensor(rng, DType::kFloat32, {4, 6});  // 24 elements, 96 bytes
    SaveValue root = SaveValue::Dict();
    root.Set("w", t.value);
    auto written = LazyTorchFile::Build(root, "c.pt");
    ASSERT_TRUE(written.ok());
    bytes_ = ReadAll(**written);
  }

  // Replaces the first occurrence of `from` with `to` (same length) in the file bytes.
  void Patch(std::vector<uint8_t> from, std::vector<uint8_t> to) {
    ASSERT_EQ(from.size(), to.size());
    auto* p = reinterpret_cast<uint8_t*>(bytes_.data());
    auto it = std::search(p, p + bytes_.size(), from.begin(), from.end());
    ASSERT_NE(it, p + bytes_.size()) << "pattern not found";
    std::copy(to.begin(), to.end(), it);
  }

  Status Open() {
    auto src = std::make_shared<MemorySource>("c.pt", bytes_);
    return TorchFile::Open(src).status();
  }

  std::vector<std::byte> bytes_;
};

// In the pickle: numel is BININT1 24 ('K' 0x18); shape (4, 6) is 'K' 4 'K' 6 TUPLE2.
TEST_F(CorruptTorchFile, StorageNumelDisagreesWithRecord) {
  Patch({'K', 24, 't'}, {'K', 23, 't'});  // the persistent id's numel, right before TUPLE
  Status s = Open();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.ToString();
  EXPECT_NE(s.message().find("declares 23 elements"), std::string::npos) << s.ToString();
}

TEST_F(CorruptTorchFile, ExtentPastStorage) {
  Patch({'K', 4, 'K', 6, 0x86}, {'K', 5, 'K', 6, 0x86});  // shape (5, 6) needs 30 elements
  Status s = Open();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.ToString();
  EXPECT_NE(s.message().find("past the end"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("tensor 'w'"), std::string::npos) << s.ToString();
}

TEST_F(CorruptTorchFile, MissingStorageRecord) {
  Patch({'X', 1, 0, 0, 0, '0'}, {'X', 1, 0, 0, 0, '9'});  // storage key "0" -> "9"
  Status s = Open();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.ToString();
  EXPECT_NE(s.message().find("'data/9' is missing"), std::string::npos) << s.ToString();
}

TEST_F(CorruptTorchFile, NoDataPkl) {
  Patch({'d', 'a', 't', 'a', '.', 'p', 'k', 'l'}, {'d', 'a', 't', 'a', '.', 'p', 'k', 'x'});
  Patch({'d', 'a', 't', 'a', '.', 'p', 'k', 'l'}, {'d', 'a', 't', 'a', '.', 'p', 'k', 'x'});
  Status s = Open();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.ToString();
  EXPECT_NE(s.message().find("data.pkl"), std::string::npos) << s.ToString();
}

TEST_F(CorruptTorchFile, TruncatedEverywhereGivesCleanErrors) {
  for (size_t cut = 0; cut < bytes_.size(); ++cut) {
    std::vector<std::byte> part(bytes_.begin(), bytes_.begin() + static_cast<long>(cut));
    auto src = std::make_shared<MemorySource>("t.pt", std::move(part));
    auto r = TorchFile::Open(src);
    EXPECT_FALSE(r.ok()) << "cut " << cut;
  }
}

// torch's legacy format, read from a real save (tests/data/pickles/make_torch_pickles.py, Debian's
// torch 1.13): the same state dict saved as a zip and as the legacy format gives the same tensors,
// with the same bytes.
class LegacyTorchFile : public ::testing::Test {
 protected:
  static std::shared_ptr<const ByteSource> Fixture(const std::string& name) {
    const char* env = std::getenv("UCPFS_TEST_DATA");
    const std::string dir = env != nullptr && *env != '\0'
                                ? std::string(env)
                                : (std::filesystem::path(__FILE__).parent_path().parent_path() / "data").string();
    auto src = FileSource::Open(dir + "/pickles/" + name);
    EXPECT_TRUE(src.ok()) << src.error().ToString();
    return src.ok() ? *src : nullptr;
  }
  void SetUp() override {
    legacy_ = Fixture("torch_legacy.pt");
    zip_ = Fixture("torch_state_dict.pt");
    ASSERT_TRUE(legacy_ && zip_);
    bytes_ = ReadAll(*legacy_);
  }
  Status OpenBytes(std::vector<std::byte> bytes) {
    return TorchFile::Open(std::make_shared<MemorySource>("l.pt", std::move(bytes))).status();
  }
  std::shared_ptr<const ByteSource> legacy_, zip_;
  std::vector<std::byte> bytes_;
};

TEST_F(LegacyTorchFile, SameTensorsAndBytesAsTheZip) {
  EXPECT_TRUE(IsLegacyTorchFile(*legacy_));
  EXPECT_FALSE(IsLegacyTorchFile(*zip_));
  EXPECT_TRUE(LooksLikeTorchFile(*legacy_));
  EXPECT_TRUE(LooksLikeTorchFile(*zip_));
  auto legacy = TorchFile::Open(legacy_);
  ASSERT_TRUE(legacy.ok()) << legacy.error().ToString();
  auto zip = TorchFile::Open(zip_);
  ASSERT_TRUE(zip.ok()) << zip.error().ToString();
  EXPECT_TRUE(legacy->legacy());
  EXPECT_FALSE(zip->legacy());
  ASSERT_EQ(legacy->tensors().size(), zip->tensors().size());
  ASSERT_GE(legacy->tensors().size(), 5u);
  for (size_t i = 0; i < zip->tensors().size(); ++i) {
    const TensorRecord& l = legacy->tensors()[i];
    const TensorRecord& z = zip->tensors()[i];
    SCOPED_TRACE(z.key);
    EXPECT_EQ(l.key, z.key);
    EXPECT_EQ(l.dtype, z.dtype);
    EXPECT_EQ(l.shape, z.shape);
    EXPECT_EQ(l.stride, z.stride);
    EXPECT_EQ(l.storage_offset, z.storage_offset);
    EXPECT_EQ(l.record_n_bytes, z.record_n_bytes);
    EXPECT_EQ(l.n_bytes, z.n_bytes);
    EXPECT_EQ(l.is_parameter, z.is_parameter);
    // The whole storage's bytes: a strided tensor's elements lie anywhere in it.
    auto lb = ReadRange(*legacy_, l.record_offset, l.record_n_bytes);
    auto zb = ReadRange(*zip_, z.record_offset, z.record_n_bytes);
    ASSERT_TRUE(lb.ok() && zb.ok());
    EXPECT_EQ(*lb, *zb);
  }
  MemorySource random("r.bin", std::vector<std::byte>(64, std::byte{0x5a}));
  EXPECT_FALSE(LooksLikeTorchFile(random));
}

TEST_F(LegacyTorchFile, AStorageCountThatDisagreesIsCorrupt) {
  auto legacy = TorchFile::Open(legacy_);
  ASSERT_TRUE(legacy.ok());
  const uint64_t count_at = legacy->tensors()[0].record_offset - 8;
  bytes_[count_at] = static_cast<std::byte>(static_cast<uint8_t>(bytes_[count_at]) + 1);
  Status s = OpenBytes(bytes_);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.ToString();
  EXPECT_NE(s.message().find("but the pickle declares"), std::string::npos) << s.ToString();
}

TEST_F(LegacyTorchFile, ABigEndianSaveIsUnsupported) {
  const std::string key = "little_endian";
  auto* p = reinterpret_cast<const char*>(bytes_.data());
  const char* at = std::search(p, p + bytes_.size(), key.begin(), key.end());
  ASSERT_NE(at, p + bytes_.size());
  const char* truth = std::find(at, p + bytes_.size(), static_cast<char>(0x88));  // NEWTRUE
  ASSERT_NE(truth, p + bytes_.size());
  bytes_[static_cast<size_t>(truth - p)] = std::byte{0x89};  // NEWFALSE
  Status s = OpenBytes(bytes_);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.ToString();
  EXPECT_NE(s.message().find("big-endian"), std::string::npos) << s.ToString();
}

// A pickle wrong in the bytes read is refused at once: only a pickle that runs past them is read
// again larger (the reader would otherwise read a corrupt multi-GB file up to its 1 GiB bound).
TEST_F(LegacyTorchFile, ACorruptPickleIsRefusedWithoutReadingFurther) {
  // A parameter's name in the object pickle: BINUNICODE ('X', 4-byte length) before its text.
  auto legacy = TorchFile::Open(legacy_);
  ASSERT_TRUE(legacy.ok());
  const std::string key = legacy->tensors()[0].key;
  auto* p = reinterpret_cast<const char*>(bytes_.data());
  const char* at = std::search(p, p + bytes_.size(), key.begin(), key.end());
  ASSERT_NE(at, p + bytes_.size());
  ASSERT_EQ(at[-5], 'X') << key;
  std::vector<std::byte> big = bytes_;
  big.resize(64 << 20);  // 64 MiB: the storages' bytes follow the pickles in a real file
  big[static_cast<size_t>(at - p) - 5] = std::byte{0xff};  // no such opcode
  auto src = std::make_shared<::ucpfs::testing::CountingSource>("big.pt", big);
  Status s = TorchFile::Open(src).status();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.ToString();
  EXPECT_NE(s.message().find("unknown opcode"), std::string::npos) << s.ToString();
  EXPECT_LE(src->bytes_read(), uint64_t{2} << 20);  // the zip check and the first 1 MiB read
  // The same file intact opens (its pickles end inside the first read).
  big[static_cast<size_t>(at - p) - 5] = std::byte{'X'};
  auto intact = std::make_shared<::ucpfs::testing::CountingSource>("big.pt", big);
  EXPECT_TRUE(TorchFile::Open(intact).ok());
}

TEST_F(LegacyTorchFile, TruncatedEverywhereGivesCleanErrors) {
  for (size_t cut = 0; cut < bytes_.size(); ++cut) {
    Status s = OpenBytes(std::vector<std::byte>(bytes_.begin(), bytes_.begin() + static_cast<long>(cut)));
    EXPECT_FALSE(s.ok()) << "cut " << cut;
  }
}

}  // namespace
}  // namespace ucpfs::format
