// Status/Result, checked arithmetic, dtype tables and byte sources.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <limits>

#include "core/byte_source.h"
#include "core/checked.h"
#include "core/dtype.h"
#include "core/io/file_source.h"
#include "core/status.h"

namespace ucpfs {
namespace {

Result<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> Quarter(int x) {
  UCPFS_ASSIGN_OR_RETURN(int h, Half(x));
  UCPFS_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(Status, CodesMessagesAndContext) {
  EXPECT_TRUE(Status::Ok().ok());
  Status s = CorruptError("offset 12: bad signature").WithContext("model.pt");
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_EQ(s.ToString(), "corrupt: model.pt: offset 12: bad signature");
  Status io = IoError("pread", 5);
  EXPECT_EQ(io.sys_errno(), 5);
  EXPECT_EQ(io.WithContext("x").sys_errno(), 5);
}

TEST(Result, PropagatesFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  auto r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().message(), "odd: 3");
}

TEST(Checked, Overflow) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  EXPECT_EQ(CheckedAdd(1, 2), 3u);
  EXPECT_FALSE(CheckedAdd(max, 1).has_value());
  EXPECT_FALSE(CheckedMul(1ull << 32, 1ull << 32).has_value());
  EXPECT_EQ(CheckedMul(1ull << 31, 1ull << 32), 1ull << 63);
  EXPECT_TRUE(RangeInside(0, 10, 10));
  EXPECT_TRUE(RangeInside(10, 0, 10));
  EXPECT_FALSE(RangeInside(11, 0, 10));
  EXPECT_FALSE(RangeInside(5, max, 10));  // offset + length would wrap
}

TEST(DType, TablesRoundTrip) {
  for (int i = 0; i < kNumDTypes; ++i) {
    DType d = static_cast<DType>(i);
    EXPECT_EQ(DTypeFromTorchName(TorchName(d)), d) << TorchName(d);
    if (!StorageClassName(d).empty()) {
      EXPECT_EQ(DTypeFromStorageClassName(StorageClassName(d)), d);
    }
  }
  EXPECT_EQ(ItemSize(DType::kBFloat16), 2u);
  EXPECT_EQ(ItemSize(DType::kComplex128), 16u);
  EXPECT_EQ(DTypeFromStorageClassName("BFloat16Storage"), DType::kBFloat16);
  EXPECT_EQ(DTypeFromTorchName("float8_e4m3fn"), DType::kFloat8E4M3FN);
  EXPECT_FALSE(DTypeFromTorchName("float13").has_value());
  EXPECT_FALSE(DTypeFromStorageClassName("UntypedStorage").has_value());
}

TEST(ByteSource, MemoryAndSlice) {
  std::vector<uint8_t> bytes(100);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i);
  auto mem = std::make_shared<MemorySource>("mem", bytes);
  std::byte out[4];
  ASSERT_TRUE(mem->ReadAt(96, out).ok());
  EXPECT_EQ(out[3], std::byte{99});
  EXPECT_EQ(mem->ReadAt(97, out).code(), StatusCode::kOutOfRange);

  auto slice = SliceSource::Make(mem, 10, 20);
  ASSERT_TRUE(slice.ok());
  ASSERT_TRUE((*slice)->ReadAt(0, out).ok());
  EXPECT_EQ(out[0], std::byte{10});
  EXPECT_EQ((*slice)->ReadAt(17, out).code(), StatusCode::kOutOfRange);
  EXPECT_FALSE(SliceSource::Make(mem, 90, 11).ok());

  EXPECT_EQ(ReadRange(*mem, 0, 50, 10).status().code(), StatusCode::kResourceExhausted);
  auto all = ReadRange(*mem, 0, 100);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 100u);
}

TEST(FileSource, ReadsAndReportsErrors) {
  std::string path = ::testing::TempDir() + "/ucpfs_file_source_test.bin";
  {
    std::ofstream f(path, std::ios::binary);
    f << "hello world";
  }
  auto src = FileSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.error().ToString();
  EXPECT_EQ((*src)->Size(), 11u);
  std::byte out[5];
  ASSERT_TRUE((*src)->ReadAt(6, out).ok());
  EXPECT_EQ(std::string(reinterpret_cast<char*>(out), 5), "world");
  EXPECT_EQ((*src)->ReadAt(7, out).code(), StatusCode::kOutOfRange);
  std::remove(path.c_str());

  auto missing = FileSource::Open(path);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.error().message().find(path), std::string::npos);
  EXPECT_EQ(FileSource::Open(::testing::TempDir()).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ucpfs
