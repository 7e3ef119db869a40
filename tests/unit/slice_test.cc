// Slice algebra: boxes, coverage validation, read plans, dtype conversion and plan execution.
// Hand cases for each sharding pattern, a corrupt-layout catalogue, conversion edge cases
// (exhaustive where the domain is 16 bits), and seeded property tests against a naive
// element-by-element gather. Seed: UCPFS_TEST_SEED, else random; printed either way.
#include <gtest/gtest.h>

#include "tests/unit/counting_source.h"
#include "tests/unit/test_seed.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <set>

#include "core/byte_source.h"
#include "core/slice/local_view.h"
#include "core/slice/slice.h"

namespace ucpfs::slice {
namespace {

using Files = std::vector<std::shared_ptr<const ByteSource>>;

using ::ucpfs::testing::TestSeed;

using ::ucpfs::testing::CountingSource;

std::vector<std::byte> F32Bytes(const std::vector<float>& v) {
  std::vector<std::byte> b(v.size() * 4);
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<float> AsF32(const std::vector<std::byte>& b) {
  std::vector<float> v(b.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

Fragment Frag(std::vector<int64_t> offsets, std::vector<int64_t> sizes, uint32_t file_id,
              uint64_t byte_offset = 0, DType dtype = DType::kFloat32) {
  Fragment f;
  f.box = {std::move(offsets), std::move(sizes)};
  f.flat_lo = 0;
  f.flat_hi = f.box.Volume();
  f.file_id = file_id;
  f.byte_offset = byte_offset;
  f.dtype = dtype;
  return f;
}

// Global row-major values 0, 1, 2, ... of a float32 tensor, stored per fragment as described
// by the layout (row-major, strided or flat range), one file per fragment unless shared.
struct Built {
  TensorLayout layout;
  Files files;
  std::vector<float> expect;
};

uint64_t GlobalIndex(const std::vector<int64_t>& shape, const std::vector<int64_t>& idx) {
  uint64_t g = 0;
  for (size_t d = 0; d < shape.size(); ++d) g = g * static_cast<uint64_t>(shape[d]) + static_cast<uint64_t>(idx[d]);
  return g;
}

// Stored element offset (from byte_offset) of box position p of fragment f.
uint64_t StoredElem(const Fragment& f, uint64_t p) {
  if (f.strides.empty()) return p - f.flat_lo;
  uint64_t off = 0;
  for (size_t d = f.box.sizes.size(); d-- > 0;) {
    const uint64_t n = static_cast<uint64_t>(f.box.sizes[d]);
    off += (p % n) * static_cast<uint64_t>(f.strides[d]);
    p /= n;
  }
  return off;
}

std::vector<int64_t> BoxIndex(const Fragment& f, uint64_t p) {
  std::vector<int64_t> idx(f.box.sizes.size());
  for (size_t d = f.box.sizes.size(); d-- > 0;) {
    const uint64_t n = static_cast<uint64_t>(f.box.sizes[d]);
    idx[d] = f.box.offsets[d] + static_cast<int64_t>(p % n);
    p /= n;
  }
  return idx;
}

// Writes the float32 values expect[global] for every fragment into per-fragment files.
Built Store(std::vector<int64_t> shape, std::vector<Fragment> frags) {
  Built b;
  b.layout.shape = std::move(shape);
  b.expect.resize(b.layout.NumElems());
  std::iota(b.expect.begin(), b.expect.end(), 0.0f);
  for (size_t i = 0; i < frags.size(); ++i) {
    Fragment& f = frags[i];
    f.file_id = static_cast<uint32_t>(i);
    uint64_t extent = 0;
    for (uint64_t p = f.flat_lo; p < f.flat_hi; ++p) extent = std::max(extent, StoredElem(f, p) + 1);
    std::vector<float> data(extent + f.byte_offset / 4, -1.0f);
    for (uint64_t p = f.flat_lo; p < f.flat_hi; ++p) {
      data[f.byte_offset / 4 + StoredElem(f, p)] = b.expect[GlobalIndex(b.layout.shape, BoxIndex(f, p))];
    }
    b.files.push_back(std::make_shared<MemorySource>("rank" + std::to_string(i) + ".bin", F32Bytes(data)));
  }
  b.layout.fragments = std::move(frags);
  return b;
}

std::vector<float> ReadAll(const Built& b, std::vector<CopyOp>* ops_out = nullptr) {
  const uint64_t n = b.layout.NumElems();
  auto ops = PlanRead(b.layout, DType::kFloat32, 0, n);
  EXPECT_TRUE(ops.ok()) << ops.status().ToString();
  if (!ops.ok()) return {};
  std::vector<std::byte> out(n * 4);
  Status s = ExecutePlan(*ops, b.files, out);
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (ops_out) *ops_out = *ops;
  return AsF32(out);
}

// ---- Box laws and basics ----

TEST(Box, VolumeAndNumElems) {
  EXPECT_EQ((Box{{}, {}}).Volume(), 1u);
  EXPECT_EQ((Box{{0, 0}, {3, 4}}).Volume(), 12u);
  EXPECT_EQ((Box{{0, 0}, {3, 0}}).Volume(), 0u);
  EXPECT_EQ((Box{{0, 0}, {-1, 5}}).Volume(), 0u);
  EXPECT_EQ((Box{{0, 0, 0}, {1 << 30, 1 << 30, 1 << 30}}).Volume(),
            std::numeric_limits<uint64_t>::max());  // saturates
  TensorLayout l;
  EXPECT_EQ(l.NumElems(), 1u);  // 0-d
  l.shape = {2, 0, 5};
  EXPECT_EQ(l.NumElems(), 0u);
  l.shape = {7, 3};
  EXPECT_EQ(l.NumElems(), 21u);
}

TEST(Box, IntersectHandCases) {
  Box out;
  ASSERT_TRUE(Intersect({{0, 0}, {4, 4}}, {{2, 1}, {4, 2}}, &out));
  EXPECT_EQ(out, (Box{{2, 1}, {2, 2}}));
  EXPECT_FALSE(Intersect({{0, 0}, {4, 4}}, {{4, 0}, {1, 4}}, &out));  // touching
  EXPECT_FALSE(Intersect({{0}, {4}}, {{0, 0}, {4, 4}}, &out));        // rank mismatch
  EXPECT_FALSE(Intersect({{0}, {0}}, {{0}, {4}}, &out));              // empty
  ASSERT_TRUE(Intersect({{}, {}}, {{}, {}}, &out));                   // 0-d: one element
  EXPECT_EQ(out, (Box{{}, {}}));
  const int64_t big = std::numeric_limits<int64_t>::max();
  ASSERT_TRUE(Intersect({{big - 2}, {big}}, {{big - 5}, {4}}, &out));  // end overflows
  EXPECT_EQ(out, (Box{{big - 2}, {1}}));
}

Box RandomBox(std::mt19937_64& rng, size_t rank) {
  Box b;
  for (size_t d = 0; d < rank; ++d) {
    b.offsets.push_back(static_cast<int64_t>(rng() % 8));
    b.sizes.push_back(static_cast<int64_t>(rng() % 6));
  }
  return b;
}

TEST(BoxProperty, IntersectCommutativeIdempotentAndExact) {
  std::mt19937_64 rng(TestSeed());
  for (int trial = 0; trial < 3000; ++trial) {
    const size_t rank = rng() % 4;
    Box a = RandomBox(rng, rank), b = RandomBox(rng, rank);
    Box ab, ba, aa;
    const bool x = Intersect(a, b, &ab);
    const bool y = Intersect(b, a, &ba);
    ASSERT_EQ(x, y);
    if (x) {
      EXPECT_EQ(ab, ba);
      Box again;
      ASSERT_TRUE(Intersect(ab, ab, &again));
      EXPECT_EQ(again, ab);
      ASSERT_TRUE(Intersect(ab, a, &again));  // the intersection lies inside both
      EXPECT_EQ(again, ab);
    }
    if (a.Volume() > 0) {
      ASSERT_TRUE(Intersect(a, a, &aa));
      EXPECT_EQ(aa, a);
    } else {
      EXPECT_FALSE(Intersect(a, a, &aa));
    }
    // Exact: the intersection volume equals a point count.
    uint64_t count = 0;
    if (rank > 0) {
      std::vector<int64_t> p(rank, 0);
      for (;;) {
        bool in_a = true, in_b = true;
        for (size_t d = 0; d < rank; ++d) {
          in_a = in_a && p[d] >= a.offsets[d] && p[d] < a.offsets[d] + a.sizes[d];
          in_b = in_b && p[d] >= b.offsets[d] && p[d] < b.offsets[d] + b.sizes[d];
        }
        count += (in_a && in_b) ? 1 : 0;
        size_t d = rank;
        while (d-- > 0 && ++p[d] == 14) p[d] = 0;
        if (d == static_cast<size_t>(-1)) break;
      }
    } else {
      count = 1;
    }
    EXPECT_EQ(x ? ab.Volume() : 0, count);
  }
}

// ---- Hand cases: sharding patterns ----

TEST(Plan, RowShardOneOpPerFragment) {
  Built b = Store({8, 3}, {Frag({0, 0}, {2, 3}, 0), Frag({2, 0}, {3, 3}, 0, 8),
                           Frag({5, 0}, {3, 3}, 0, 4)});
  ASSERT_TRUE(ValidateCoverage(b.layout, "w").ok());
  std::vector<CopyOp> ops;
  EXPECT_EQ(ReadAll(b, &ops), b.expect);
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[0].n_elems, 6u);
  EXPECT_EQ(ops[1].n_elems, 9u);
  EXPECT_EQ(ops[1].src_byte_offset, 8u);
  EXPECT_EQ(ops[1].dst_byte_offset, 24u);
  EXPECT_EQ(ops[2].src_elem_stride, 1);
}

TEST(Plan, AdjacentFragmentsInOneFileCoalesce) {
  // Two row shards stored back to back in one file: one op.
  std::vector<float> data(12);
  std::iota(data.begin(), data.end(), 0.0f);
  TensorLayout l{{4, 3}, {Frag({0, 0}, {2, 3}, 0, 0), Frag({2, 0}, {2, 3}, 0, 24)}};
  Files files{std::make_shared<MemorySource>("one.bin", F32Bytes(data))};
  auto ops = PlanRead(l, DType::kFloat32, 1, 11);
  ASSERT_TRUE(ops.ok());
  ASSERT_EQ(ops->size(), 1u);
  EXPECT_EQ((*ops)[0].src_byte_offset, 4u);
  EXPECT_EQ((*ops)[0].n_elems, 10u);
}

TEST(Plan, ColumnShard) {
  Built b = Store({3, 5}, {Frag({0, 0}, {3, 2}, 0), Frag({0, 2}, {3, 3}, 0)});
  ASSERT_TRUE(ValidateCoverage(b.layout, "w").ok());
  std::vector<CopyOp> ops;
  EXPECT_EQ(ReadAll(b, &ops), b.expect);
  EXPECT_EQ(ops.size(), 6u);  // one run per row per shard
  // A range inside one row of one shard touches one fragment.
  auto part = PlanRead(b.layout, DType::kFloat32, 5, 7);
  ASSERT_TRUE(part.ok());
  ASSERT_EQ(part->size(), 1u);
  EXPECT_EQ((*part)[0].file_id, 0u);
  EXPECT_EQ((*part)[0].src_byte_offset, 8u);  // row 1, col 0 of the 3x2 shard
}

TEST(Plan, UnevenShards) {
  Built one_d = Store({7}, {Frag({0}, {3}, 0), Frag({3}, {3}, 0), Frag({6}, {1}, 0)});
  ASSERT_TRUE(ValidateCoverage(one_d.layout, "b").ok());
  EXPECT_EQ(ReadAll(one_d), one_d.expect);
  Built rows = Store({5, 2}, {Frag({0, 0}, {3, 2}, 0), Frag({3, 0}, {2, 2}, 0)});
  ASSERT_TRUE(ValidateCoverage(rows.layout, "w").ok());
  EXPECT_EQ(ReadAll(rows), rows.expect);
}

TEST(Plan, ShardHyGrid) {
  std::vector<Fragment> frags;
  for (int64_t r = 0; r < 2; ++r) {
    for (int64_t c = 0; c < 3; ++c) frags.push_back(Frag({r * 2, c * 2}, {2, 2}, 0));
  }
  Built b = Store({4, 6}, frags);
  ASSERT_TRUE(ValidateCoverage(b.layout, "w").ok());
  std::vector<CopyOp> ops;
  EXPECT_EQ(ReadAll(b, &ops), b.expect);
  EXPECT_EQ(ops.size(), 12u);
  // 3-D: box spanning trailing dims fully merges them into one run per outer index.
  Built c = Store({2, 3, 4}, {Frag({0, 0, 0}, {1, 3, 4}, 0), Frag({1, 0, 0}, {1, 3, 4}, 0)});
  ASSERT_TRUE(ValidateCoverage(c.layout, "w").ok());
  EXPECT_EQ(ReadAll(c, &ops), c.expect);
  EXPECT_EQ(ops.size(), 2u);
}

TEST(Plan, ZeroDimTensor) {
  Built b = Store({}, {Frag({}, {}, 0)});
  EXPECT_EQ(b.layout.NumElems(), 1u);
  ASSERT_TRUE(ValidateCoverage(b.layout, "scalar").ok());
  std::vector<CopyOp> ops;
  EXPECT_EQ(ReadAll(b, &ops), std::vector<float>{0.0f});
  EXPECT_EQ(ops.size(), 1u);
  TensorLayout none{{}, {}};
  Status s = ValidateCoverage(none, "scalar");
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("covered by no fragment"), std::string::npos) << s.message();
}

TEST(Plan, EmptyTensor) {
  TensorLayout l{{0, 3}, {}};
  EXPECT_TRUE(ValidateCoverage(l, "e").ok());
  l.fragments.push_back(Frag({0, 0}, {0, 3}, 0));  // an empty chunk is harmless
  EXPECT_TRUE(ValidateCoverage(l, "e").ok());
  auto ops = PlanRead(l, DType::kFloat32, 0, 0);
  ASSERT_TRUE(ops.ok());
  EXPECT_TRUE(ops->empty());
  EXPECT_EQ(PlanRead(l, DType::kFloat32, 0, 1).status().code(), StatusCode::kOutOfRange);
  Files files;
  EXPECT_TRUE(ReadTensorBytes(l, DType::kFloat32, files, 0, {}).ok());
  std::byte one[1];
  EXPECT_EQ(ReadTensorBytes(l, DType::kFloat32, files, 0, one).code(), StatusCode::kOutOfRange);
}

TEST(Plan, MegatronFlatRangesOverLocalChunks) {
  // Param [4, 6]; TP grid 2x2 gives local chunks [2, 3]; each chunk's 6 elements are split
  // across 2 DP ranks as flat ranges [0, 4) and [4, 6).
  std::vector<Fragment> frags;
  for (int64_t r = 0; r < 2; ++r) {
    for (int64_t c = 0; c < 2; ++c) {
      Fragment lo = Frag({r * 2, c * 3}, {2, 3}, 0);
      Fragment hi = lo;
      lo.flat_hi = 4;
      hi.flat_lo = 4;
      hi.byte_offset = 12;  // some padding before
      frags.push_back(lo);
      frags.push_back(hi);
    }
  }
  Built b = Store({4, 6}, frags);
  ASSERT_TRUE(ValidateCoverage(b.layout, "decoder.w").ok());
  EXPECT_EQ(ReadAll(b), b.expect);
  // Element 7 is chunk (0,0) row 1 col 1: flat position 4 -> the second rank's first element.
  auto ops = PlanRead(b.layout, DType::kFloat32, 7, 8);
  ASSERT_TRUE(ops.ok());
  ASSERT_EQ(ops->size(), 1u);
  EXPECT_EQ((*ops)[0].file_id, 1u);
  EXPECT_EQ((*ops)[0].src_byte_offset, 12u);
  // Missing one rank's piece is a gap, named by its first element.
  TensorLayout missing = b.layout;
  missing.fragments.erase(missing.fragments.begin() + 3);  // chunk (0,1), flat [4, 6)
  Status s = ValidateCoverage(missing, "decoder.w");
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("decoder.w: elements [10, 12)"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("index [1, 4]"), std::string::npos) << s.message();
  auto gap = PlanRead(missing, DType::kFloat32, 0, 24);
  EXPECT_EQ(gap.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(gap.status().message().find("element 10 "), std::string::npos) << gap.status().message();
}

TEST(Plan, TransposedChunkReadsOnce) {
  // Shape [4, 6]: rows [0, 2) row-major; rows [2, 4) stored transposed (column-major).
  Fragment t = Frag({2, 0}, {2, 6}, 1);
  t.strides = {1, 2};
  Built b = Store({4, 6}, {Frag({0, 0}, {2, 6}, 0), t});
  ASSERT_TRUE(ValidateCoverage(b.layout, "w").ok());
  std::vector<CopyOp> ops;
  EXPECT_EQ(ReadAll(b, &ops), b.expect);
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[1].src_elem_stride, 2);
  EXPECT_EQ(ops[1].n_elems, 6u);
  // The strided ops share their bytes: the chunk is read once, in one request.
  std::vector<std::byte> raw(48);
  ASSERT_TRUE(b.files[1]->ReadAt(0, raw).ok());
  auto counting = std::make_shared<CountingSource>("t.bin", raw);
  Files files{b.files[0], counting};
  std::vector<std::byte> out(24 * 4);
  ASSERT_TRUE(ExecutePlan(ops, files, out).ok());
  EXPECT_EQ(AsF32(out), b.expect);
  EXPECT_EQ(counting->reads(), 1u);
  EXPECT_EQ(counting->bytes_read(), 48u);
  // A 3-D chunk with permuted storage order and padded strides.
  Fragment p = Frag({0, 0, 0}, {2, 3, 4}, 0);
  p.strides = {1, 10, 2};
  Built c = Store({2, 3, 4}, {p});
  ASSERT_TRUE(ValidateCoverage(c.layout, "w").ok());
  EXPECT_EQ(ReadAll(c), c.expect);
}

TEST(Plan, ConversionOnRead) {
  // bf16 shard + fp32 shard read as fp32 and as bf16.
  std::vector<uint16_t> bf = {0x3F80, 0x4000, 0xC040};  // 1, 2, -3
  std::vector<std::byte> bf_bytes(6);
  std::memcpy(bf_bytes.data(), bf.data(), 6);
  TensorLayout l{{2, 3}, {Frag({0, 0}, {1, 3}, 0, 0, DType::kBFloat16), Frag({1, 0}, {1, 3}, 1)}};
  Files files{std::make_shared<MemorySource>("a", bf_bytes),
              std::make_shared<MemorySource>("b", F32Bytes({4.0f, 5.0f, 6.5f}))};
  std::vector<std::byte> out(24);
  ASSERT_TRUE(ReadTensorBytes(l, DType::kFloat32, files, 0, out).ok());
  EXPECT_EQ(AsF32(out), (std::vector<float>{1, 2, -3, 4, 5, 6.5f}));
  std::vector<std::byte> out16(12);
  ASSERT_TRUE(ReadTensorBytes(l, DType::kBFloat16, files, 0, out16).ok());
  std::vector<uint16_t> got(6);
  std::memcpy(got.data(), out16.data(), 12);
  EXPECT_EQ(got, (std::vector<uint16_t>{0x3F80, 0x4000, 0xC040, 0x4080, 0x40A0, 0x40D0}));
  auto bad = PlanRead(l, DType::kInt32, 0, 6);
  EXPECT_EQ(bad.status().code(), StatusCode::kUnsupported);
}

TEST(Plan, UnalignedByteRanges) {
  Built b = Store({3, 4}, {Frag({0, 0}, {3, 2}, 0), Frag({0, 2}, {3, 2}, 0)});
  std::vector<std::byte> all(48);
  std::memcpy(all.data(), b.expect.data(), 48);
  for (uint64_t lo = 0; lo <= 48; ++lo) {
    for (uint64_t hi = lo; hi <= 48; ++hi) {
      std::vector<std::byte> out(hi - lo);
      Status s = ReadTensorBytes(b.layout, DType::kFloat32, b.files, lo, out);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_TRUE(std::equal(out.begin(), out.end(), all.begin() + static_cast<ptrdiff_t>(lo)))
          << lo << ".." << hi;
    }
  }
  std::vector<std::byte> out(2);
  EXPECT_EQ(ReadTensorBytes(b.layout, DType::kFloat32, b.files, 47, out).code(),
            StatusCode::kOutOfRange);
}

TEST(Plan, RangeErrors) {
  Built b = Store({4}, {Frag({0}, {4}, 0)});
  EXPECT_EQ(PlanRead(b.layout, DType::kFloat32, 0, 5).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(PlanRead(b.layout, DType::kFloat32, 3, 2).status().code(), StatusCode::kInvalidArgument);
  auto empty = PlanRead(b.layout, DType::kFloat32, 2, 2);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  // Unremoved replicas are a double cover for the planner.
  TensorLayout twice = b.layout;
  twice.fragments.push_back(twice.fragments[0]);
  auto r = PlanRead(twice, DType::kFloat32, 0, 4);
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.status().message().find("covered twice"), std::string::npos);
}

TEST(Plan, TransposedColumnShardReadsOnce) {
  // Column shards of [64, 8]; the second is stored transposed, so its row ops interleave with
  // the first shard's in destination order, yet its bytes are read once.
  Fragment t = Frag({0, 4}, {64, 4}, 1);
  t.strides = {1, 64};
  Built b = Store({64, 8}, {Frag({0, 0}, {64, 4}, 0), t});
  ASSERT_TRUE(ValidateCoverage(b.layout, "w").ok());
  std::vector<CopyOp> ops;
  EXPECT_EQ(ReadAll(b, &ops), b.expect);
  EXPECT_EQ(ops.size(), 128u);
  std::vector<std::byte> raw(b.files[1]->Size());
  ASSERT_TRUE(b.files[1]->ReadAt(0, raw).ok());
  auto counting = std::make_shared<CountingSource>("t.bin", raw);
  Files files{b.files[0], counting};
  std::vector<std::byte> out(64 * 8 * 4);
  ASSERT_TRUE(ExecutePlan(ops, files, out).ok());
  EXPECT_EQ(AsF32(out), b.expect);
  EXPECT_EQ(counting->reads(), 1u);
  EXPECT_EQ(counting->bytes_read(), 64u * 4 * 4);
}

TEST(Plan, LargeTransposedChunkInBoundedWindows) {
  // Rows [0, 1024) of [2048, 2200] stored transposed in float32 (9 MB spanned by every row's
  // op: more than one 8 MiB window); rows [1024, 2048) row-major bfloat16.
  const int64_t rows = 2048, cols = 2200, half = 1024;
  std::vector<float> top(static_cast<size_t>(half * cols));
  std::vector<uint16_t> bottom(static_cast<size_t>(half * cols));
  std::vector<float> expect(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const float v = static_cast<float>((i * 7 + j * 13) % 251);  // exact in bf16
      expect[static_cast<size_t>(i * cols + j)] = v;
      if (i < half) {
        top[static_cast<size_t>(i + j * half)] = v;
      } else {
        bottom[static_cast<size_t>((i - half) * cols + j)] = static_cast<uint16_t>(std::bit_cast<uint32_t>(v) >> 16);
      }
    }
  }
  std::vector<std::byte> bottom_bytes(bottom.size() * 2);
  std::memcpy(bottom_bytes.data(), bottom.data(), bottom_bytes.size());
  auto t = std::make_shared<CountingSource>("top.bin", F32Bytes(top));
  Files files{t, std::make_shared<MemorySource>("bottom.bin", bottom_bytes)};
  Fragment tf = Frag({0, 0}, {half, cols}, 0);
  tf.strides = {1, half};
  TensorLayout l{{rows, cols}, {tf, Frag({half, 0}, {half, cols}, 1, 0, DType::kBFloat16)}};
  ASSERT_TRUE(ValidateCoverage(l, "big").ok());
  std::vector<std::byte> out(expect.size() * 4);
  Status s = ReadTensorBytes(l, DType::kFloat32, files, 0, out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(AsF32(out) == expect);
  EXPECT_EQ(t->reads(), 2u);
  EXPECT_LT(t->bytes_read(), top.size() * 4 + 64);
}

// ---- Coverage validation: replicas and the corrupt-layout catalogue ----

TEST(Coverage, Replicas) {
  TensorLayout l{{4, 2}, {Frag({0, 0}, {2, 2}, 0), Frag({2, 0}, {2, 2}, 1), Frag({0, 0}, {2, 2}, 2),
                          Frag({0, 0}, {2, 2}, 3)}};
  std::vector<std::pair<size_t, size_t>> replicas;
  ASSERT_TRUE(ValidateCoverage(l, "w", &replicas).ok());
  EXPECT_EQ(replicas, (std::vector<std::pair<size_t, size_t>>{{0, 2}, {0, 3}}));
  Status s = ValidateCoverage(l, "w");
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("covered twice"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offsets [0, 0] sizes [2, 2]"), std::string::npos) << s.message();
  // Replicated flat ranges too.
  Fragment a = Frag({0}, {6}, 0), b2 = a;
  a.flat_hi = 3;
  b2.flat_lo = 3;
  TensorLayout flat{{6}, {a, b2, b2, a}};
  ASSERT_TRUE(ValidateCoverage(flat, "x", &replicas).ok());
  EXPECT_EQ(replicas, (std::vector<std::pair<size_t, size_t>>{{1, 2}, {0, 3}}));
}

struct CorruptCase {
  std::string name;
  TensorLayout layout;
  std::vector<std::string> needles;  // substrings of the message
};

TEST(Coverage, CorruptCatalogue) {
  auto flat = [](Fragment f, uint64_t lo, uint64_t hi) {
    f.flat_lo = lo;
    f.flat_hi = hi;
    return f;
  };
  auto strided = [](Fragment f, std::vector<int64_t> s) {
    f.strides = std::move(s);
    return f;
  };
  std::vector<CorruptCase> cases = {
      {"gap", {{4, 4}, {Frag({0, 0}, {4, 2}, 0), Frag({0, 2}, {3, 2}, 0)}},
       {"t: elements [14, 16)", "index [3, 2]", "covered by no fragment", "14 of 16"}},
      {"overlap", {{4, 4}, {Frag({0, 0}, {3, 4}, 0), Frag({2, 0}, {2, 4}, 0)}},
       {"t: fragments 0 (box offsets [0, 0] sizes [3, 4]) and 1", "overlap in offsets [2, 0] sizes [1, 4]"}},
      {"overlap among many", {{8, 8}, {Frag({0, 0}, {4, 4}, 0), Frag({0, 4}, {4, 4}, 0),
                                       Frag({4, 0}, {4, 4}, 0), Frag({4, 4}, {4, 4}, 0),
                                       Frag({3, 3}, {2, 2}, 0)}},
       {"overlap in offsets [3, 3] sizes [1, 1]"}},
      {"flat overlap", {{6}, {flat(Frag({0}, {6}, 0), 0, 4), flat(Frag({0}, {6}, 0), 3, 6)}},
       {"fragments 0 and 1 overlap in box offsets [0] sizes [6]", "[0, 4) and [3, 6)"}},
      {"whole box and flat part", {{6}, {Frag({0}, {6}, 0), flat(Frag({0}, {6}, 0), 2, 3)}},
       {"overlap"}},
      {"rank", {{4, 4}, {Frag({0}, {4}, 0)}}, {"fragment 0", "rank 1 does not match shape [4, 4]"}},
      {"outside", {{4, 4}, {Frag({0, 2}, {4, 3}, 0)}}, {"box outside shape [4, 4]"}},
      {"negative offset", {{4}, {Frag({-1}, {4}, 0)}}, {"box outside shape"}},
      {"flat past box", {{4}, {flat(Frag({0}, {4}, 0), 2, 5)}}, {"flat range outside the box's 4 elements"}},
      {"flat reversed", {{4}, {flat(Frag({0}, {4}, 0), 3, 2)}}, {"flat range outside"}},
      {"stride rank", {{2, 2}, {strided(Frag({0, 0}, {2, 2}, 0), {1})}}, {"strides [1] of wrong rank"}},
      {"negative stride", {{2, 2}, {strided(Frag({0, 0}, {2, 2}, 0), {2, -1})}}, {"negative stride"}},
      {"flat over transposed", {{2, 2}, {strided(flat(Frag({0, 0}, {2, 2}, 0), 0, 2), {1, 2})}},
       {"non-row-major strides"}},
      {"stride overflow", {{2, 2}, {strided(Frag({0, 0}, {2, 2}, 0), {int64_t{1} << 62, 1 << 20})}},
       {"stored extent overflows"}},
      {"shape", {{-1, 2}, {}}, {"bad shape [-1, 2]"}},
      {"shape overflow", {{1 << 30, 1 << 30, 1 << 30}, {}}, {"bad shape"}},
  };
  for (const auto& c : cases) {
    Status s = ValidateCoverage(c.layout, "t");
    EXPECT_EQ(s.code(), StatusCode::kCorrupt) << c.name;
    for (const auto& n : c.needles) {
      EXPECT_NE(s.message().find(n), std::string::npos) << c.name << ": " << s.message();
    }
  }
}

TEST(Coverage, ManyFragmentsQuickly) {
  // 64 x 64 grid of 4 x 4 boxes plus each split into two flat ranges: 8192 fragments.
  TensorLayout l;
  l.shape = {256, 256};
  for (int64_t r = 0; r < 64; ++r) {
    for (int64_t c = 0; c < 64; ++c) {
      Fragment f = Frag({r * 4, c * 4}, {4, 4}, 0);
      Fragment g = f;
      f.flat_hi = 7;
      g.flat_lo = 7;
      l.fragments.push_back(f);
      l.fragments.push_back(g);
    }
  }
  EXPECT_TRUE(ValidateCoverage(l, "big").ok());
  l.fragments.pop_back();
  Status s = ValidateCoverage(l, "big");
  EXPECT_NE(s.message().find("index [253, 255]"), std::string::npos) << s.message();
  auto ops = PlanRead(l, DType::kFloat32, 1000, 1010);
  ASSERT_TRUE(ops.ok());
  EXPECT_EQ(ops->size(), 3u);  // row 3, columns 232..241: three 4-wide boxes
}

// ---- Execution errors ----

TEST(Execute, FirstFailingReadInDestinationOrder) {
  Built b = Store({4, 2}, {Frag({0, 0}, {2, 2}, 0), Frag({2, 0}, {2, 2}, 0)});
  auto bytes = [&](size_t i) {
    std::vector<std::byte> raw(b.files[i]->Size());
    EXPECT_TRUE(b.files[i]->ReadAt(0, raw).ok());
    return raw;
  };
  auto f0 = std::make_shared<CountingSource>("rank0.distcp", bytes(0));
  auto f1 = std::make_shared<CountingSource>("rank1.distcp", bytes(1));
  Files files{f0, f1};
  std::vector<std::byte> out(32);
  f1->fail_hi = 1;
  Status s = ReadTensorBytes(b.layout, DType::kFloat32, files, 0, out);
  EXPECT_EQ(s.code(), StatusCode::kIo);
  EXPECT_NE(s.message().find("rank1.distcp"), std::string::npos) << s.message();
  f0->fail_hi = 1;
  s = ReadTensorBytes(b.layout, DType::kFloat32, files, 0, out);
  EXPECT_NE(s.message().find("rank0.distcp"), std::string::npos) << s.message();
  // A short file: the read past its end fails and names it.
  Files short_files{std::make_shared<MemorySource>("short.bin", std::vector<std::byte>(8)), b.files[1]};
  s = ReadTensorBytes(b.layout, DType::kFloat32, short_files, 0, out);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("short.bin"), std::string::npos) << s.message();
  // Bad op: unknown file.
  CopyOp op;
  op.file_id = 7;
  op.n_elems = 1;
  EXPECT_EQ(ExecutePlan(std::span<const CopyOp>(&op, 1), files, out).code(), StatusCode::kInvalidArgument);
  op.file_id = 0;
  op.dst_byte_offset = 30;  // past the output
  EXPECT_EQ(ExecutePlan(std::span<const CopyOp>(&op, 1), files, out).code(), StatusCode::kInvalidArgument);
}

TEST(Execute, StridedGroupErrorNamesFirstOpInDestinationOrder) {
  // Transposed chunk [3, 4] (strides [1, 3]): row i's op spans bytes [4i, 4i + 40). Reads
  // touching byte 40 fail: rows 1 and 2 would fail, and row 1 comes first.
  Fragment t = Frag({0, 0}, {3, 4}, 0);
  t.strides = {1, 3};
  Built b = Store({3, 4}, {t});
  std::vector<std::byte> raw(48);
  ASSERT_TRUE(b.files[0]->ReadAt(0, raw).ok());
  auto src = std::make_shared<CountingSource>("tp.bin", raw);
  src->fail_lo = 40;
  src->fail_hi = 41;
  Files files{src};
  std::vector<std::byte> out(48);
  Status s = ReadTensorBytes(b.layout, DType::kFloat32, files, 0, out);
  EXPECT_EQ(s.code(), StatusCode::kIo);
  EXPECT_NE(s.message().find("tp.bin: pread at offset 4:"), std::string::npos) << s.message();
}

// ---- Conversions ----

uint16_t ToF16(float f) {
  uint16_t h;
  EXPECT_TRUE(ConvertElements(DType::kFloat32, DType::kFloat16, reinterpret_cast<const std::byte*>(&f),
                              reinterpret_cast<std::byte*>(&h), 1).ok());
  return h;
}
uint16_t ToBf16(float f) {
  uint16_t h;
  EXPECT_TRUE(ConvertElements(DType::kFloat32, DType::kBFloat16, reinterpret_cast<const std::byte*>(&f),
                              reinterpret_cast<std::byte*>(&h), 1).ok());
  return h;
}
uint16_t F64To(DType dst, double d) {
  uint16_t h;
  EXPECT_TRUE(ConvertElements(DType::kFloat64, dst, reinterpret_cast<const std::byte*>(&d),
                              reinterpret_cast<std::byte*>(&h), 1).ok());
  return h;
}
float FromHalf(DType src, uint16_t h) {
  float f;
  EXPECT_TRUE(ConvertElements(src, DType::kFloat32, reinterpret_cast<const std::byte*>(&h),
                              reinterpret_cast<std::byte*>(&f), 1).ok());
  return f;
}
float Bits(uint32_t u) { return std::bit_cast<float>(u); }

TEST(Convert, Float16RoundTripAllPatterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = FromHalf(DType::kFloat16, h);
    ASSERT_EQ(ToF16(f), h) << std::hex << i;
    double d;
    ASSERT_TRUE(ConvertElements(DType::kFloat16, DType::kFloat64, reinterpret_cast<const std::byte*>(&h),
                                reinterpret_cast<std::byte*>(&d), 1).ok());
    ASSERT_EQ(F64To(DType::kFloat16, d), h) << std::hex << i;
    const bool nan = (h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0;
    if (nan) {
      ASSERT_TRUE(std::isnan(f));
      continue;
    }
#ifdef __FLT16_MAX__
    ASSERT_EQ(f, static_cast<float>(std::bit_cast<_Float16>(h))) << std::hex << i;
#endif
    ASSERT_EQ(d, static_cast<double>(f));
  }
}

TEST(Convert, BFloat16RoundTripAllPatterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float f = FromHalf(DType::kBFloat16, h);
    ASSERT_EQ(std::bit_cast<uint32_t>(f), i << 16);
    ASSERT_EQ(ToBf16(f), h);
    // f16 <-> bf16 through the generic path agrees with going through f32.
    uint16_t via;
    ASSERT_TRUE(ConvertElements(DType::kBFloat16, DType::kFloat16, reinterpret_cast<const std::byte*>(&h),
                                reinterpret_cast<std::byte*>(&via), 1).ok());
    ASSERT_EQ(via, ToF16(f)) << std::hex << i;
  }
}

TEST(Convert, BFloat16Rounding) {
  EXPECT_EQ(ToBf16(Bits(0x3F808000)), 0x3F80);  // tie, even stays
  EXPECT_EQ(ToBf16(Bits(0x3F818000)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(ToBf16(Bits(0x3F808001)), 0x3F81);  // just above the tie
  EXPECT_EQ(ToBf16(Bits(0x3F807FFF)), 0x3F80);
  EXPECT_EQ(ToBf16(Bits(0xBF818000)), 0xBF82);  // sign symmetric
  EXPECT_EQ(ToBf16(Bits(0x7F7FFFFF)), 0x7F80);  // max float rounds to inf
  EXPECT_EQ(ToBf16(Bits(0x7F800000)), 0x7F80);
  EXPECT_EQ(ToBf16(Bits(0xFF800000)), 0xFF80);
  EXPECT_EQ(ToBf16(Bits(0x80000000)), 0x8000);  // -0
  EXPECT_EQ(ToBf16(Bits(0x00008000)), 0x0000);  // subnormal tie to even (0)
  EXPECT_EQ(ToBf16(Bits(0x00018000)), 0x0002);  // subnormal tie to even (2)
  EXPECT_EQ(ToBf16(Bits(0x007FFFFF)), 0x0080);  // largest subnormal rounds to min normal
  EXPECT_EQ(ToBf16(Bits(0x7FC00000)), 0x7FC0);
  EXPECT_EQ(ToBf16(Bits(0xFFC12345)), 0xFFC1);  // payload top bits kept
  const uint16_t snan = ToBf16(Bits(0x7F800001));  // payload only in dropped bits: still NaN
  EXPECT_TRUE(std::isnan(FromHalf(DType::kBFloat16, snan)));
  // Narrowing from float64 rounds once (through float32 would round twice).
  EXPECT_EQ(F64To(DType::kBFloat16, 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)), 0x3F81);
  EXPECT_EQ(F64To(DType::kBFloat16, 1.0 + std::ldexp(1.0, -8)), 0x3F80);
  EXPECT_EQ(F64To(DType::kBFloat16, 1e300), 0x7F80);
  EXPECT_EQ(F64To(DType::kBFloat16, -1e-300), 0x8000);
  EXPECT_TRUE(std::isnan(FromHalf(DType::kBFloat16, F64To(DType::kBFloat16, std::nan("")))));
}

TEST(Convert, Float16Rounding) {
  EXPECT_EQ(ToF16(65504.0f), 0x7BFF);
  EXPECT_EQ(ToF16(65519.0f), 0x7BFF);
  EXPECT_EQ(ToF16(65520.0f), 0x7C00);  // tie above max goes to even: inf
  EXPECT_EQ(ToF16(-1e10f), 0xFC00);
  EXPECT_EQ(ToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(ToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even
  EXPECT_EQ(ToF16(std::ldexp(1.0f, -25) * 1.0001f), 0x0001);
  EXPECT_EQ(ToF16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: tie to even (2)
  EXPECT_EQ(ToF16(std::ldexp(1023.5f, -24)), 0x0400);  // largest subnormal + half: min normal
  EXPECT_EQ(ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie, even
  EXPECT_EQ(ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  EXPECT_EQ(ToF16(-0.0f), 0x8000);
  EXPECT_EQ(ToF16(Bits(0x7FC00000)), 0x7E00);
  EXPECT_TRUE(std::isnan(FromHalf(DType::kFloat16, ToF16(Bits(0x7F800001)))));
  EXPECT_EQ(F64To(DType::kFloat16, 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40)), 0x3C01);
  EXPECT_EQ(F64To(DType::kFloat16, std::ldexp(1.0, -30)), 0x0000);
}

TEST(ConvertProperty, AgreesWithHardwareCasts) {
  std::mt19937_64 rng(TestSeed() ^ 0x5eed);
  for (int i = 0; i < 200000; ++i) {
    const uint64_t bits = rng();
    const double d = std::bit_cast<double>(bits);
    const float f = std::bit_cast<float>(static_cast<uint32_t>(bits));
    if (!std::isnan(d)) {
      float got;
      ASSERT_TRUE(ConvertElements(DType::kFloat64, DType::kFloat32, reinterpret_cast<const std::byte*>(&d),
                                  reinterpret_cast<std::byte*>(&got), 1).ok());
      ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(static_cast<float>(d))) << d;
    }
    if (!std::isnan(f)) {
      double got;
      ASSERT_TRUE(ConvertElements(DType::kFloat32, DType::kFloat64, reinterpret_cast<const std::byte*>(&f),
                                  reinterpret_cast<std::byte*>(&got), 1).ok());
      ASSERT_EQ(got, static_cast<double>(f));
#ifdef __FLT16_MAX__
      ASSERT_EQ(ToF16(f), std::bit_cast<uint16_t>(static_cast<_Float16>(f))) << f;
      // Values near f16's range exercise subnormals and rounding more often.
      if (std::isfinite(f)) {
        const float g = std::ldexp(f - std::trunc(f), static_cast<int>(rng() % 44) - 28);
        ASSERT_EQ(ToF16(g), std::bit_cast<uint16_t>(static_cast<_Float16>(g))) << g;
      }
#endif
      // bf16 is f32 rounded at bit 16: the value is the nearest (ties even) of the two.
      const uint16_t b = ToBf16(f);
      const float back = FromHalf(DType::kBFloat16, b);
      if (std::isfinite(back)) {
        const float down = Bits(static_cast<uint32_t>(bits) & 0xFFFF0000u);
        const float up = Bits((static_cast<uint32_t>(bits) & 0xFFFF0000u) + 0x10000u);
        ASSERT_TRUE(back == down || back == up);
        ASSERT_LE(std::fabs(static_cast<double>(back) - f), std::fabs(static_cast<double>(down == back ? up : down) - f));
      }
    }
  }
}

TEST(Convert, IntegersAndUnalignedBuffers) {
  alignas(8) std::byte buf[64] = {};
  std::byte* in = buf + 1;  // unaligned
  const int64_t vals64[] = {-3, (int64_t{1} << 53) | 1, 0};
  std::memcpy(in, vals64, sizeof vals64);
  alignas(8) std::byte outb[64] = {};
  std::byte* out = outb + 3;
  ASSERT_TRUE(ConvertElements(DType::kInt64, DType::kFloat64, in, out, 3).ok());
  double d[3];
  std::memcpy(d, out, sizeof d);
  EXPECT_EQ(d[0], -3.0);
  EXPECT_EQ(d[1], 9007199254740992.0);  // 2^53 + 1 rounds to even
  const int8_t i8[] = {-128, 127, 0};
  std::memcpy(in, i8, 3);
  ASSERT_TRUE(ConvertElements(DType::kInt8, DType::kFloat32, in, out, 3).ok());
  float f[3];
  std::memcpy(f, out, sizeof f);
  EXPECT_EQ(f[0], -128.0f);
  EXPECT_EQ(f[1], 127.0f);
  const uint8_t u8[] = {255, 0, 2};
  std::memcpy(in, u8, 3);
  ASSERT_TRUE(ConvertElements(DType::kUInt8, DType::kFloat32, in, out, 3).ok());
  std::memcpy(f, out, sizeof f);
  EXPECT_EQ(f[0], 255.0f);
  ASSERT_TRUE(ConvertElements(DType::kBool, DType::kFloat32, in, out, 3).ok());
  std::memcpy(f, out, sizeof f);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], 0.0f);
  EXPECT_EQ(f[2], 1.0f);
  const int16_t i16[] = {-32768, 5};
  std::memcpy(in, i16, 4);
  ASSERT_TRUE(ConvertElements(DType::kInt16, DType::kFloat64, in, out, 2).ok());
  std::memcpy(d, out, 16);
  EXPECT_EQ(d[0], -32768.0);
  const int32_t i32[] = {16777217, -1};
  std::memcpy(in, i32, 8);
  ASSERT_TRUE(ConvertElements(DType::kInt32, DType::kFloat32, in, out, 2).ok());
  std::memcpy(f, out, 8);
  EXPECT_EQ(f[0], 16777216.0f);
  EXPECT_EQ(f[1], -1.0f);
  // Identity for any dtype, including ones with no arithmetic support.
  std::memcpy(in, "abcdefghijklmnop", 16);
  ASSERT_TRUE(ConvertElements(DType::kComplex128, DType::kComplex128, in, out, 1).ok());
  EXPECT_EQ(std::memcmp(in, out, 16), 0);
}

TEST(Convert, Support) {
  const DType floats[] = {DType::kFloat64, DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  const DType ints[] = {DType::kInt64, DType::kInt32, DType::kInt16, DType::kInt8, DType::kUInt8, DType::kBool};
  for (DType a : floats) {
    for (DType b : floats) EXPECT_TRUE(CanConvert(a, b));
    for (DType b : ints) EXPECT_FALSE(CanConvert(a, b)) << TorchName(a) << "->" << TorchName(b);
  }
  for (DType a : ints) {
    EXPECT_TRUE(CanConvert(a, DType::kFloat32));
    EXPECT_TRUE(CanConvert(a, DType::kFloat64));
    EXPECT_FALSE(CanConvert(a, DType::kFloat16));
    EXPECT_FALSE(CanConvert(a, DType::kBFloat16));
  }
  for (int i = 0; i < kNumDTypes; ++i) EXPECT_TRUE(CanConvert(static_cast<DType>(i), static_cast<DType>(i)));
  EXPECT_FALSE(CanConvert(DType::kInt32, DType::kInt64));
  EXPECT_FALSE(CanConvert(DType::kFloat8E4M3FN, DType::kFloat32));
  std::byte x[8] = {}, y[8];
  EXPECT_EQ(ConvertElements(DType::kFloat32, DType::kInt32, x, y, 1).code(), StatusCode::kUnsupported);
}

// ---- Property: random layouts against a naive gather ----

struct RandomCase {
  TensorLayout layout;  // replicas removed
  Files files;
  std::vector<std::vector<std::byte>> file_bytes;
  DType dst;
  std::vector<std::byte> expect;  // whole tensor in dst, gathered element by element
  size_t replica_count = 0;
};

std::vector<int64_t> RandomCuts(std::mt19937_64& rng, int64_t n) {
  if (n == 0) return {0, 0};  // one empty cell
  std::vector<int64_t> cuts{0, n};
  const int extra = static_cast<int>(rng() % 4);
  for (int i = 0; i < extra && n > 0; ++i) cuts.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(n + 1)));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

RandomCase MakeRandomCase(std::mt19937_64& rng) {
  static const DType kSrc[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64,
                               DType::kInt32, DType::kInt8, DType::kUInt8, DType::kBool,
                               DType::kInt64, DType::kInt16};
  RandomCase rc;
  const size_t rank = rng() % 5;
  for (size_t d = 0; d < rank; ++d) rc.layout.shape.push_back(static_cast<int64_t>(rng() % 12 == 0 ? 0 : 1 + rng() % 6));
  const DType tensor_dtype = kSrc[rng() % std::size(kSrc)];
  rc.dst = rng() % 2 ? tensor_dtype : DType::kFloat32;
  // Grid of uneven splits along random dims.
  std::vector<std::vector<int64_t>> cuts;
  for (size_t d = 0; d < rank; ++d) {
    cuts.push_back(rng() % 2 ? RandomCuts(rng, rc.layout.shape[d])
                             : std::vector<int64_t>{0, rc.layout.shape[d]});
  }
  std::vector<Box> boxes;
  std::vector<size_t> cell(rank, 0);
  for (bool done = false; !done;) {
    Box b;
    for (size_t d = 0; d < rank; ++d) {
      b.offsets.push_back(cuts[d][cell[d]]);
      b.sizes.push_back(cuts[d][cell[d] + 1] - cuts[d][cell[d]]);
    }
    boxes.push_back(b);
    size_t d = rank;
    while (d-- > 0 && ++cell[d] + 1 == cuts[d].size()) cell[d] = 0;
    done = d == static_cast<size_t>(-1);
  }
  std::vector<Fragment> frags;
  for (const Box& b : boxes) {
    Fragment f;
    f.box = b;
    const uint64_t v = b.Volume();
    f.flat_hi = v;
    if (v > 1 && rng() % 3 == 0) {
      // Flat ranges: split the box's row-major order at random points.
      std::vector<uint64_t> pts{0, v};
      for (int i = 0; i < 3; ++i) pts.push_back(rng() % (v + 1));
      std::sort(pts.begin(), pts.end());
      pts.erase(std::unique(pts.begin(), pts.end()), pts.end());
      for (size_t i = 0; i + 1 < pts.size(); ++i) {
        Fragment g = f;
        g.flat_lo = pts[i];
        g.flat_hi = pts[i + 1];
        frags.push_back(g);
      }
      continue;
    }
    if (rank > 0 && v > 0 && rng() % 3 == 0) {
      // Stored in a permuted dim order, sometimes padded.
      std::vector<size_t> perm(rank);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      f.strides.assign(rank, 0);
      int64_t stride = static_cast<int64_t>(1 + (rng() % 4 == 0 ? rng() % 3 : 0));
      for (size_t k = rank; k-- > 0;) {
        f.strides[perm[k]] = stride;
        stride *= b.sizes[perm[k]] + (rng() % 4 == 0 ? 1 : 0);
      }
    }
    frags.push_back(f);
  }
  std::shuffle(frags.begin(), frags.end(), rng);
  // Place fragments in up to 3 files at random gaps, with random source dtypes.
  const size_t n_files = 1 + rng() % 3;
  std::vector<uint64_t> file_len(n_files, 0);
  for (Fragment& f : frags) {
    f.dtype = rng() % 3 ? tensor_dtype : kSrc[rng() % std::size(kSrc)];
    if (!CanConvert(f.dtype, rc.dst)) f.dtype = tensor_dtype;
    f.file_id = static_cast<uint32_t>(rng() % n_files);
    uint64_t extent = 0;
    for (uint64_t p = f.flat_lo; p < f.flat_hi; ++p) extent = std::max(extent, StoredElem(f, p) + 1);
    f.byte_offset = file_len[f.file_id] + rng() % 7;
    file_len[f.file_id] = f.byte_offset + extent * ItemSize(f.dtype);
  }
  rc.file_bytes.resize(n_files);
  for (size_t i = 0; i < n_files; ++i) {
    rc.file_bytes[i].resize(file_len[i] + rng() % 5);
    for (auto& byte : rc.file_bytes[i]) byte = static_cast<std::byte>(rng());
    rc.files.push_back(std::make_shared<MemorySource>("f" + std::to_string(i), rc.file_bytes[i]));
  }
  // Replicas: copies of some fragments (same box and range, maybe another file), appended.
  std::vector<Fragment> all = frags;
  std::set<std::pair<size_t, size_t>> expect_pairs;
  for (size_t i = 0; i < frags.size(); ++i) {
    if (frags[i].flat_lo != frags[i].flat_hi && rng() % 8 == 0) {
      expect_pairs.insert({i, all.size()});
      all.push_back(frags[i]);
    }
  }
  TensorLayout with_replicas{rc.layout.shape, all};
  std::vector<std::pair<size_t, size_t>> replicas;
  Status s = ValidateCoverage(with_replicas, "prop", &replicas);
  EXPECT_TRUE(s.ok()) << s.ToString();
  const std::set<std::pair<size_t, size_t>> got_pairs(replicas.begin(), replicas.end());
  EXPECT_EQ(got_pairs, expect_pairs);
  rc.replica_count = replicas.size();
  rc.layout.fragments = frags;
  // Naive gather, counting covers.
  const uint64_t numel = rc.layout.NumElems();
  const uint64_t dsz = ItemSize(rc.dst);
  rc.expect.assign(numel * dsz, std::byte{0});
  std::vector<int> covers(numel, 0);
  for (const Fragment& f : frags) {
    const uint64_t isz = ItemSize(f.dtype);
    for (uint64_t p = f.flat_lo; p < f.flat_hi; ++p) {
      const uint64_t g = GlobalIndex(rc.layout.shape, BoxIndex(f, p));
      ++covers[g];
      const std::byte* src = rc.file_bytes[f.file_id].data() + f.byte_offset + StoredElem(f, p) * isz;
      EXPECT_TRUE(ConvertElements(f.dtype, rc.dst, src, rc.expect.data() + g * dsz, 1).ok());
    }
  }
  for (uint64_t g = 0; g < numel; ++g) EXPECT_EQ(covers[g], 1) << g;
  return rc;
}

TEST(SliceProperty, RandomLayoutsMatchNaiveGather) {
  std::mt19937_64 rng(TestSeed() ^ 0xabcdef);
  int trials_with_replicas = 0, nonempty = 0;
  uint64_t total_ops = 0, total_elems = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    RandomCase rc = MakeRandomCase(rng);
    if (::testing::Test::HasFailure()) return;
    trials_with_replicas += rc.replica_count > 0 ? 1 : 0;
    ASSERT_TRUE(ValidateCoverage(rc.layout, "prop").ok());
    const uint64_t numel = rc.layout.NumElems();
    const uint64_t dsz = ItemSize(rc.dst);
    if (numel == 0) continue;
    ++nonempty;
    for (int q = 0; q < 12; ++q) {
      uint64_t lo = rng() % (numel + 1), hi = rng() % (numel + 1);
      if (q == 0) {
        lo = 0;
        hi = numel;
      }
      if (lo > hi) std::swap(lo, hi);
      auto ops = PlanRead(rc.layout, rc.dst, lo, hi);
      ASSERT_TRUE(ops.ok()) << ops.status().ToString();
      // Each target element exactly once, in destination order.
      uint64_t next_dst = 0;
      for (const CopyOp& op : *ops) {
        ASSERT_EQ(op.dst_byte_offset, next_dst);
        ASSERT_GT(op.n_elems, 0u);
        ASSERT_EQ(op.dst_dtype, rc.dst);
        next_dst += op.n_elems * dsz;
      }
      ASSERT_EQ(next_dst, (hi - lo) * dsz);
      total_ops += ops->size();
      total_elems += hi - lo;
      std::vector<std::byte> out((hi - lo) * dsz);
      ASSERT_TRUE(ExecutePlan(*ops, rc.files, out).ok());
      ASSERT_TRUE(std::equal(out.begin(), out.end(), rc.expect.begin() + static_cast<ptrdiff_t>(lo * dsz)))
          << "elements [" << lo << ", " << hi << ")";
      // Unaligned byte ranges.
      uint64_t blo = rng() % (numel * dsz + 1), bhi = rng() % (numel * dsz + 1);
      if (blo > bhi) std::swap(blo, bhi);
      std::vector<std::byte> bytes(bhi - blo);
      Status s = ReadTensorBytes(rc.layout, rc.dst, rc.files, blo, bytes);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_TRUE(std::equal(bytes.begin(), bytes.end(), rc.expect.begin() + static_cast<ptrdiff_t>(blo)))
          << "bytes [" << blo << ", " << bhi << ")";
    }
    // Dropping a fragment leaves a gap that both validation and planning name.
    if (!rc.layout.fragments.empty()) {
      TensorLayout missing = rc.layout;
      const size_t drop = rng() % missing.fragments.size();
      const Fragment gone = missing.fragments[drop];
      missing.fragments.erase(missing.fragments.begin() + static_cast<ptrdiff_t>(drop));
      if (gone.flat_lo != gone.flat_hi) {
        Status v = ValidateCoverage(missing, "prop");
        EXPECT_EQ(v.code(), StatusCode::kCorrupt);
        EXPECT_NE(v.message().find("covered by no fragment"), std::string::npos) << v.message();
        auto p = PlanRead(missing, rc.dst, 0, numel);
        EXPECT_EQ(p.status().code(), StatusCode::kCorrupt);
      }
    }
  }
  std::cout << "[ stats ] " << nonempty << " non-empty layouts, " << trials_with_replicas
            << " with replicas, " << total_ops << " ops, " << total_elems << " elements\n";
  EXPECT_GT(trials_with_replicas, 0);
  EXPECT_GT(nonempty, 500);
}

TEST(SliceProperty, RowShardedWholeReadIsOneOpPerFragment) {
  std::mt19937_64 rng(TestSeed() ^ 0x7777);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t rows = static_cast<int64_t>(1 + rng() % 40);
    std::vector<int64_t> shape{rows};
    for (size_t d = rng() % 3; d > 0; --d) shape.push_back(static_cast<int64_t>(1 + rng() % 5));
    std::vector<int64_t> cuts = RandomCuts(rng, rows);
    std::vector<Fragment> frags;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      std::vector<int64_t> off(shape.size(), 0), size = shape;
      off[0] = cuts[i];
      size[0] = cuts[i + 1] - cuts[i];
      frags.push_back(Frag(off, size, 0, 4 * (rng() % 3)));
    }
    Built b = Store(shape, frags);
    ASSERT_TRUE(ValidateCoverage(b.layout, "rows").ok());
    std::vector<CopyOp> ops;
    EXPECT_EQ(ReadAll(b, &ops), b.expect);
    EXPECT_EQ(ops.size(), frags.size());
  }
}

// A tensor whose value is the mean of N stored copies (Fragment::mean_with): torch's
// sum(slices) / len(slices) over float32, i.e. ((0 + s0) + s1 + ...) / N, each step rounded.
std::vector<float> TorchMean(const std::vector<std::vector<float>>& copies) {
  std::vector<float> m(copies[0].size());
  for (size_t e = 0; e < m.size(); ++e) {
    float acc = 0.0f + copies[0][e];
    for (size_t c = 1; c < copies.size(); ++c) acc = acc + copies[c][e];
    m[e] = acc / static_cast<float>(copies.size());
  }
  return m;
}

std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<uint32_t>(v[i]);
  return b;
}

TEST(Mean, HandValuesInTorchOrderAndNegativeZero) {
  // 3 copies of 5 elements: -0.0 everywhere averages to +0.0 (0 + -0.0); 1e8, -1e8, 1 gives
  // ((1e8 - 1e8) + 1) / 3 = 1/3 in left-to-right order (1e8 + (-1e8 + 1) would give 0).
  const std::vector<std::vector<float>> copies = {{-0.0f, 1e8f, 1.0f, 3.0f, -0.0f},
                                                  {-0.0f, -1e8f, 2.0f, 3.0f, 0.0f},
                                                  {-0.0f, 1.0f, 4.0f, 3.0f, -0.0f}};
  Files files;
  for (size_t c = 0; c < copies.size(); ++c) {
    files.push_back(std::make_shared<MemorySource>("tp" + std::to_string(c), F32Bytes(copies[c])));
  }
  Fragment f = Frag({0}, {5}, 0);
  f.mean_with = {{1, 0, DType::kFloat32}, {2, 0, DType::kFloat32}};
  TensorLayout l{{5}, {f}};
  std::vector<std::byte> out(20);
  ASSERT_TRUE(ReadTensorBytes(l, DType::kFloat32, files, 0, out).ok());
  const std::vector<float> got = AsF32(out);
  EXPECT_EQ(std::bit_cast<uint32_t>(got[0]), 0u);  // +0.0
  EXPECT_EQ(got[1], 1.0f / 3.0f);
  EXPECT_EQ(got[2], 7.0f / 3.0f);
  EXPECT_EQ(got[3], 3.0f);
  EXPECT_EQ(std::bit_cast<uint32_t>(got[4]), 0u);
  EXPECT_EQ(Bits(got), Bits(TorchMean(copies)));
  // N = 2 of a single copy pair.
  Fragment two = Frag({0}, {5}, 0);
  two.mean_with = {{1, 0, DType::kFloat32}};
  ASSERT_TRUE(ReadTensorBytes(TensorLayout{{5}, {two}}, DType::kFloat32, files, 0, out).ok());
  EXPECT_EQ(Bits(AsF32(out)), Bits(TorchMean({copies[0], copies[1]})));
  // What a read of it touches: every copy.
  std::vector<const ByteSource*> touched;
  uint64_t read_n_bytes = 0, view_n_bytes = 0;
  ASSERT_TRUE(DescribeTensorReads(l, DType::kFloat32, files, 0, 20, [&](const SourceRun& r) {
                touched.push_back(r.file);
                read_n_bytes += r.ReadBytes();
                view_n_bytes += r.ViewBytes();
              }).ok());
  EXPECT_EQ(touched, (std::vector<const ByteSource*>{files[0].get(), files[1].get(), files[2].get()}));
  EXPECT_EQ(read_n_bytes, 60u);  // every copy is read
  EXPECT_EQ(view_n_bytes, 20u);  // the view's bytes are filled once
}

TEST(Mean, ZeroFlatShardsChunksPartialReadsBf16AndLocalViews) {
  // A (40000, 3) tensor stored by 3 tp ranks, each split into two ZeRO flat ranges at the same
  // boundary, at different byte offsets per rank, one rank in bf16: the mean must be exact over
  // runs longer than one chunk, for any byte window, in bf16, and through a local view.
  std::mt19937_64 rng(TestSeed());
  const uint64_t n = 120000, cut = 70001;
  std::vector<std::vector<float>> copies(3, std::vector<float>(n));
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-40, 40);
  for (auto& c : copies) {
    for (float& x : c) x = std::ldexp(mant(rng), expo(rng));
  }
  copies[0][5] = copies[1][5] = copies[2][5] = -0.0f;
  // Rank 2 is stored in bf16: its float32 view is the bf16 value.
  std::vector<uint16_t> bf(n);
  for (uint64_t e = 0; e < n; ++e) {
    bf[e] = static_cast<uint16_t>(std::bit_cast<uint32_t>(copies[2][e]) >> 16);
    copies[2][e] = std::bit_cast<float>(static_cast<uint32_t>(bf[e]) << 16);
  }
  const uint64_t pad0 = 12, pad1 = 100;  // bytes before each rank's data
  std::vector<std::byte> r0(pad0 + n * 4), r1(pad1 + n * 4), r2(n * 2);
  std::memcpy(r0.data() + pad0, copies[0].data(), n * 4);
  std::memcpy(r1.data() + pad1, copies[1].data(), n * 4);
  std::memcpy(r2.data(), bf.data(), n * 2);
  Files files{std::make_shared<MemorySource>("tp0", r0), std::make_shared<MemorySource>("tp1", r1),
              std::make_shared<MemorySource>("tp2", r2)};
  TensorLayout l;
  l.shape = {40000, 3};
  for (auto [lo, hi] : {std::pair<uint64_t, uint64_t>{0, cut}, {cut, n}}) {
    Fragment f = Frag({0, 0}, {40000, 3}, 0, pad0 + lo * 4);
    f.flat_lo = lo;
    f.flat_hi = hi;
    f.mean_with = {{1, pad1 + lo * 4, DType::kFloat32}, {2, lo * 2, DType::kBFloat16}};
    l.fragments.push_back(f);
  }
  ASSERT_TRUE(ValidateCoverage(l, "mean").ok());
  const std::vector<float> want = TorchMean(copies);
  std::vector<std::byte> out(n * 4);
  ASSERT_TRUE(ReadTensorBytes(l, DType::kFloat32, files, 0, out).ok());
  ASSERT_EQ(Bits(AsF32(out)), Bits(want));
  EXPECT_EQ(std::bit_cast<uint32_t>(AsF32(out)[5]), 0u);
  // Byte windows, unaligned, across the ZeRO cut and chunk boundaries.
  for (int i = 0; i < 20; ++i) {
    const uint64_t a = rng() % (n * 4), len = 1 + rng() % std::min<uint64_t>(n * 4 - a, 200000);
    std::vector<std::byte> part(len);
    ASSERT_TRUE(ReadTensorBytes(l, DType::kFloat32, files, a, part).ok());
    ASSERT_EQ(std::memcmp(part.data(), out.data() + a, len), 0) << a << " " << len;
  }
  // bf16: the float32 mean, rounded.
  std::vector<std::byte> out16(n * 2), want16(n * 2);
  ASSERT_TRUE(ReadTensorBytes(l, DType::kBFloat16, files, 0, out16).ok());
  ASSERT_TRUE(ConvertElements(DType::kFloat32, DType::kBFloat16, out.data(), want16.data(), n).ok());
  EXPECT_EQ(out16, want16);
  // A local view of rows [10000, 30000), column 1 keeps the mean.
  auto local = LocalLayout(l, {20000, 1}, 0, {Box{{10000, 1}, {20000, 1}}});
  ASSERT_TRUE(local.ok()) << local.status().message();
  std::vector<std::byte> lo(20000 * 4);
  ASSERT_TRUE(ReadTensorBytes(*local, DType::kFloat32, files, 0, lo).ok());
  const std::vector<float> got = AsF32(lo);
  for (uint64_t r = 0; r < 20000; ++r) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got[r]), std::bit_cast<uint32_t>(want[(10000 + r) * 3 + 1])) << r;
  }
  // A failing copy fails the read, naming its file.
  Files broken = files;
  broken[1] = std::make_shared<MemorySource>("tp1", std::vector<std::byte>(pad1 + 8));
  Status s = ReadTensorBytes(l, DType::kFloat32, broken, 0, out);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("tp1"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace ucpfs::slice
