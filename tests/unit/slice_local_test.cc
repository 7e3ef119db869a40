// Local views: FlatRangeToBoxes, NormalizeFragments, zero-fill fragments, LocalLayout and
// ReadConcatBytes. Hand cases for each target pattern (row/column shards across source
// shardings, grid to 1-D, Shard-NC fused QKV, vocabulary padding) and seeded property tests
// against a naive element-by-element oracle: the flat-range law, normalization reads
// identically, source layout -> target layout -> back is the identity, and the flat
// concatenation equals a naive one. Seed: UCPFS_TEST_SEED, else random; printed either way.
#include <gtest/gtest.h>

#include "tests/unit/test_seed.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>

#include "core/byte_source.h"
#include "core/slice/local_view.h"
#include "core/slice/slice.h"

namespace ucpfs::slice {
namespace {

using Files = std::vector<std::shared_ptr<const ByteSource>>;

using ::ucpfs::testing::TestSeed;

// Per-test RNG: the printed seed reproduces every test, whichever subset runs.
std::mt19937_64 Rng(uint64_t salt) { return std::mt19937_64(TestSeed() ^ (salt * 0x9E3779B97F4A7C15ull)); }

int64_t Uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // [lo, hi]
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

uint64_t Volume(const std::vector<int64_t>& s) {
  uint64_t v = 1;
  for (int64_t x : s) v *= static_cast<uint64_t>(x);
  return v;
}

std::vector<int64_t> Unravel(uint64_t e, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = static_cast<int64_t>(e % static_cast<uint64_t>(shape[d]));
    e /= static_cast<uint64_t>(shape[d]);
  }
  return idx;
}

uint64_t Ravel(const std::vector<int64_t>& idx, const std::vector<int64_t>& shape) {
  uint64_t g = 0;
  for (size_t d = 0; d < shape.size(); ++d) g = g * static_cast<uint64_t>(shape[d]) + static_cast<uint64_t>(idx[d]);
  return g;
}

std::vector<float> AsF32(const std::vector<std::byte>& b) {
  std::vector<float> v(b.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

// Encodes one small integer value (exact in every dtype used here) as `dt`.
void Encode(DType dt, float v, std::byte* out) {
  switch (dt) {
    case DType::kInt32: {
      const int32_t x = static_cast<int32_t>(v);
      std::memcpy(out, &x, 4);
      return;
    }
    case DType::kInt16: {
      const int16_t x = static_cast<int16_t>(v);
      std::memcpy(out, &x, 2);
      return;
    }
    default: {
      std::byte f[4];
      std::memcpy(f, &v, 4);
      ASSERT_TRUE(ConvertElements(DType::kFloat32, dt, f, out, 1).ok());
    }
  }
}

// Builds source layouts into a shared set of in-memory files: each stored piece is appended to
// a random file after a random gap of garbage bytes.
struct Store {
  std::vector<std::vector<std::byte>> bufs;
  std::mt19937_64* rng = nullptr;

  explicit Store(std::mt19937_64& r, size_t n_files) : bufs(n_files), rng(&r) {
    for (auto& b : bufs) Garbage(b, static_cast<size_t>(Uniform(r, 0, 9)));
  }
  void Garbage(std::vector<std::byte>& b, size_t n) {
    for (size_t i = 0; i < n; ++i) b.push_back(static_cast<std::byte>(Uniform(*rng, 0, 255)));
  }
  // Reserves n_bytes (garbage-filled) in a random file; returns (file, byte offset).
  std::pair<uint32_t, uint64_t> Place(uint64_t n_bytes) {
    const uint32_t f = static_cast<uint32_t>(Uniform(*rng, 0, static_cast<int64_t>(bufs.size()) - 1));
    Garbage(bufs[f], static_cast<size_t>(Uniform(*rng, 0, 7)));
    const uint64_t off = bufs[f].size();
    Garbage(bufs[f], static_cast<size_t>(n_bytes));
    return {f, off};
  }
  Files Sources() const {
    Files files;
    for (size_t i = 0; i < bufs.size(); ++i) {
      files.push_back(std::make_shared<MemorySource>("file" + std::to_string(i), bufs[i]));
    }
    return files;
  }
};

// Writes fragment f (box / flat range / strides as given; file_id and byte_offset chosen here)
// holding values[global index] and appends it to the layout.
void Put(Store& st, TensorLayout& layout, const std::vector<float>& values, Fragment f) {
  const uint64_t v = f.box.Volume();
  const uint64_t isz = ItemSize(f.dtype);
  std::vector<int64_t> st_strides = f.strides;
  if (st_strides.empty()) {
    st_strides.assign(f.box.sizes.size(), 1);
    for (size_t d = f.box.sizes.size(); d-- > 1;) st_strides[d - 1] = st_strides[d] * f.box.sizes[d];
  }
  const bool restricted = f.flat_lo != 0 || f.flat_hi != v;
  uint64_t extent = 0;  // stored elements
  if (restricted) {
    extent = f.flat_hi - f.flat_lo;
  } else if (v > 0) {
    for (size_t d = 0; d < f.box.sizes.size(); ++d) {
      extent += static_cast<uint64_t>(f.box.sizes[d] - 1) * static_cast<uint64_t>(st_strides[d]);
    }
    extent += 1;
  }
  auto [file, off] = st.Place(extent * isz);
  f.file_id = file;
  f.byte_offset = off;
  for (uint64_t p = f.flat_lo; p < f.flat_hi; ++p) {
    const std::vector<int64_t> local = Unravel(p, f.box.sizes);
    std::vector<int64_t> global = local;
    uint64_t stored = 0;
    for (size_t d = 0; d < local.size(); ++d) {
      global[d] += f.box.offsets[d];
      stored += static_cast<uint64_t>(local[d]) * static_cast<uint64_t>(st_strides[d]);
    }
    if (restricted) stored = p - f.flat_lo;
    Encode(f.dtype, values[Ravel(global, layout.shape)], st.bufs[file].data() + off + stored * isz);
  }
  layout.fragments.push_back(std::move(f));
}

Fragment BoxFrag(std::vector<int64_t> offsets, std::vector<int64_t> sizes, DType dt = DType::kFloat32) {
  Fragment f;
  f.box = {std::move(offsets), std::move(sizes)};
  f.flat_hi = f.box.Volume();
  f.dtype = dt;
  return f;
}

// A random source: uneven grid (possibly empty cells), some cells split into flat ranges, some
// stored transposed / with gaps, random dtypes (integer ones only if allow_ints: they convert
// to float32/float64 only), a few zero-fill cells. `values` receives the naive global tensor
// (zero where a zero-fill cell lies).
TensorLayout RandomSource(std::mt19937_64& rng, Store& st, const std::vector<int64_t>& shape,
                          std::vector<float>* values, bool allow_zero_cells, bool allow_ints = true) {
  TensorLayout layout;
  layout.shape = shape;
  const uint64_t n = Volume(shape);
  values->resize(n);
  const int64_t salt = Uniform(rng, 0, 1000);
  for (uint64_t e = 0; e < n; ++e) (*values)[e] = static_cast<float>((static_cast<int64_t>(e) * 37 + salt) % 200 + 1);
  const size_t r = shape.size();
  std::vector<std::vector<int64_t>> cuts(r);
  for (size_t d = 0; d < r; ++d) {
    const int64_t parts = Uniform(rng, 1, 3);
    cuts[d] = {0, shape[d]};
    for (int64_t k = 1; k < parts; ++k) cuts[d].push_back(Uniform(rng, 0, shape[d]));
    std::sort(cuts[d].begin(), cuts[d].end());
  }
  const DType dtypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                          DType::kInt32, DType::kInt16};
  const int64_t n_dtypes = allow_ints ? 6 : 4;
  std::vector<size_t> cell(r, 0);
  while (true) {
    Box box;
    for (size_t d = 0; d < r; ++d) {
      box.offsets.push_back(cuts[d][cell[d]]);
      box.sizes.push_back(cuts[d][cell[d] + 1] - cuts[d][cell[d]]);
    }
    const uint64_t v = box.Volume();
    const DType dt = dtypes[Uniform(rng, 0, n_dtypes - 1)];
    const int64_t kind = Uniform(rng, 0, 9);
    if (allow_zero_cells && kind == 0 && v > 0) {
      Fragment f = BoxFrag(box.offsets, box.sizes, dt);
      f.file_id = kZeroFileId;
      f.byte_offset = static_cast<uint64_t>(Uniform(rng, 0, 100));
      for (uint64_t p = 0; p < v; ++p) {
        std::vector<int64_t> g = Unravel(p, box.sizes);
        for (size_t d = 0; d < r; ++d) g[d] += box.offsets[d];
        (*values)[Ravel(g, shape)] = 0.0f;
      }
      layout.fragments.push_back(std::move(f));
    } else if (kind <= 3 && v > 0) {
      // Flat ranges over the box (ZeRO-style), row-major, strides empty or explicit.
      std::vector<uint64_t> fc = {0, v};
      const int64_t k = Uniform(rng, 0, 3);
      for (int64_t i = 0; i < k; ++i) fc.push_back(static_cast<uint64_t>(Uniform(rng, 0, static_cast<int64_t>(v))));
      std::sort(fc.begin(), fc.end());
      for (size_t i = 0; i + 1 < fc.size(); ++i) {
        Fragment f = BoxFrag(box.offsets, box.sizes, dtypes[Uniform(rng, 0, n_dtypes - 1)]);
        f.flat_lo = fc[i];
        f.flat_hi = fc[i + 1];
        if (Uniform(rng, 0, 1) == 1) {
          f.strides.assign(r, 1);
          for (size_t d = r; d-- > 1;) f.strides[d - 1] = f.strides[d] * box.sizes[d];
        }
        Put(st, layout, *values, std::move(f));
      }
    } else {
      // Whole box; stored in a random dim order with random gaps, or row-major (empty strides).
      Fragment f = BoxFrag(box.offsets, box.sizes, dt);
      if (Uniform(rng, 0, 2) != 0) {
        std::vector<size_t> perm(r);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        f.strides.assign(r, 0);
        int64_t acc = 1;
        for (size_t i = r; i-- > 0;) {
          f.strides[perm[i]] = acc;
          acc *= std::max<int64_t>(box.sizes[perm[i]], 1) + Uniform(rng, 0, 1);
        }
      }
      Put(st, layout, *values, std::move(f));
    }
    size_t d = r;
    while (d-- > 0) {
      if (++cell[d] + 1 < cuts[d].size()) break;
      cell[d] = 0;
    }
    if (d == static_cast<size_t>(-1)) break;  // every cell done (and the 0-d case)
  }
  std::shuffle(layout.fragments.begin(), layout.fragments.end(), rng);
  return layout;
}

std::vector<int64_t> RandomShape(std::mt19937_64& rng, size_t min_rank) {
  std::vector<int64_t> shape(static_cast<size_t>(Uniform(rng, static_cast<int64_t>(min_rank), 3)));
  for (auto& s : shape) s = Uniform(rng, 0, 7);
  if (Uniform(rng, 0, 4) != 0) {
    for (auto& s : shape) s = std::max<int64_t>(s, 1);
  }
  return shape;
}

std::vector<float> ReadAllF32(const TensorLayout& l, const Files& files) {
  std::vector<std::byte> b(l.NumElems() * 4, std::byte{0xAB});
  Status s = ReadTensorBytes(l, DType::kFloat32, files, 0, b);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return AsF32(b);
}

// Naive local tensor: pieces concatenated along cat_dim, zeros after.
std::vector<float> NaiveLocal(const std::vector<float>& global, const std::vector<int64_t>& shape,
                              const std::vector<int64_t>& local_shape, size_t cat_dim,
                              const std::vector<Box>& pieces) {
  std::vector<float> out(Volume(local_shape), 0.0f);
  for (uint64_t e = 0; e < out.size(); ++e) {
    std::vector<int64_t> idx = Unravel(e, local_shape);
    int64_t pos = 0;
    for (const Box& p : pieces) {
      if (idx[cat_dim] < pos + p.sizes[cat_dim]) {
        std::vector<int64_t> g = idx;
        for (size_t d = 0; d < g.size(); ++d) g[d] = (d == cat_dim ? idx[d] - pos : idx[d]) + p.offsets[d];
        out[e] = global[Ravel(g, shape)];
        break;
      }
      pos += p.sizes[cat_dim];
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// FlatRangeToBoxes

// Checks the law for one range: count bound, non-empty boxes in row-major order whose union is
// exactly [lo, hi) (each position once).
void CheckFlatLaw(const std::vector<int64_t>& sizes, uint64_t lo, uint64_t hi) {
  SCOPED_TRACE("sizes rank " + std::to_string(sizes.size()) + " range [" + std::to_string(lo) + ", " +
               std::to_string(hi) + ")");
  const std::vector<Box> boxes = FlatRangeToBoxes(sizes, lo, hi);
  const size_t r = sizes.size();
  EXPECT_LE(boxes.size(), r == 0 ? size_t{1} : 2 * r - 1);
  const uint64_t v = Volume(sizes);
  std::vector<int> count(v, 0);
  uint64_t total = 0, next = lo;
  for (const Box& b : boxes) {
    ASSERT_EQ(b.offsets.size(), r);
    ASSERT_EQ(b.sizes.size(), r);
    ASSERT_GT(b.Volume(), 0u);
    total += b.Volume();
    // Row-major order and contiguity: each box starts where the previous ended.
    uint64_t first = Ravel(b.offsets, sizes);
    EXPECT_EQ(first, next);
    for (uint64_t q = 0; q < b.Volume(); ++q) {
      std::vector<int64_t> idx = Unravel(q, b.sizes);
      for (size_t d = 0; d < r; ++d) {
        idx[d] += b.offsets[d];
        ASSERT_LT(idx[d], sizes[d]);
      }
      ++count[Ravel(idx, sizes)];
    }
    std::vector<int64_t> last(r);
    for (size_t d = 0; d < r; ++d) last[d] = b.offsets[d] + b.sizes[d] - 1;
    next = Ravel(last, sizes) + 1;
  }
  EXPECT_EQ(total, hi - lo);
  for (uint64_t p = 0; p < v; ++p) EXPECT_EQ(count[p], (p >= lo && p < hi) ? 1 : 0) << "position " << p;
}

TEST(FlatRangeToBoxes, HandCases) {
  // [3, 4]: positions 2..9 = row 0 cols 2-3, row 1, row 2 cols 0-1.
  auto b = FlatRangeToBoxes({3, 4}, 2, 10);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (Box{{0, 2}, {1, 2}}));
  EXPECT_EQ(b[1], (Box{{1, 0}, {1, 4}}));
  EXPECT_EQ(b[2], (Box{{2, 0}, {1, 2}}));
  EXPECT_EQ(FlatRangeToBoxes({3, 4}, 0, 12), (std::vector<Box>{Box{{0, 0}, {3, 4}}}));
  EXPECT_EQ(FlatRangeToBoxes({3, 4}, 5, 7), (std::vector<Box>{Box{{1, 1}, {1, 2}}}));
  EXPECT_EQ(FlatRangeToBoxes({}, 0, 1), (std::vector<Box>{Box{}}));
  EXPECT_TRUE(FlatRangeToBoxes({3, 4}, 5, 5).empty());
  EXPECT_TRUE(FlatRangeToBoxes({3, 4}, 5, 13).empty());  // past the box
  EXPECT_TRUE(FlatRangeToBoxes({3, 4}, 6, 5).empty());   // reversed
  EXPECT_TRUE(FlatRangeToBoxes({3, 0}, 0, 0).empty());
  // Worst case for rank 3: 2·3−1 = 5 boxes.
  EXPECT_EQ(FlatRangeToBoxes({3, 3, 3}, 1, 26).size(), 5u);
}

TEST(FlatRangeToBoxes, ExhaustiveSmall) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {2, 3}, {3, 1, 4}, {2, 2, 2, 2}, {1, 5, 1}};
  for (const auto& s : shapes) {
    const uint64_t v = Volume(s);
    for (uint64_t lo = 0; lo <= v; ++lo) {
      for (uint64_t hi = lo; hi <= v; ++hi) CheckFlatLaw(s, lo, hi);
    }
  }
}

TEST(FlatRangeToBoxes, PropertyLaw) {
  auto rng = Rng(1);
  for (int iter = 0; iter < 500; ++iter) {
    std::vector<int64_t> sizes(static_cast<size_t>(Uniform(rng, 0, 5)));
    for (auto& s : sizes) s = Uniform(rng, 1, 5);
    const uint64_t v = Volume(sizes);
    uint64_t lo = static_cast<uint64_t>(Uniform(rng, 0, static_cast<int64_t>(v)));
    uint64_t hi = static_cast<uint64_t>(Uniform(rng, 0, static_cast<int64_t>(v)));
    if (lo > hi) std::swap(lo, hi);
    CheckFlatLaw(sizes, lo, hi);
    if (HasFatalFailure()) return;
  }
}

// ---------------------------------------------------------------------------------------------
// NormalizeFragments

TEST(NormalizeFragments, FlatRangeBecomesBoxesWithByteOffsets) {
  TensorLayout l;
  l.shape = {4, 4};
  Fragment f = BoxFrag({1, 0}, {3, 4}, DType::kBFloat16);
  f.flat_lo = 2;
  f.flat_hi = 11;
  f.byte_offset = 100;
  f.file_id = 3;
  l.fragments.push_back(f);
  auto n = NormalizeFragments(l);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  ASSERT_EQ(n->fragments.size(), 3u);
  const Fragment& a = n->fragments[0];
  EXPECT_EQ(a.box, (Box{{1, 2}, {1, 2}}));
  EXPECT_EQ(a.byte_offset, 100u);
  EXPECT_EQ(a.strides, (std::vector<int64_t>{4, 1}));
  EXPECT_EQ(a.file_id, 3u);
  EXPECT_EQ(a.dtype, DType::kBFloat16);
  EXPECT_EQ(n->fragments[1].box, (Box{{2, 0}, {1, 4}}));
  EXPECT_EQ(n->fragments[1].byte_offset, 100u + 2 * 2);  // position 4 stored at 4 - 2
  EXPECT_EQ(n->fragments[2].box, (Box{{3, 0}, {1, 3}}));
  EXPECT_EQ(n->fragments[2].byte_offset, 100u + 6 * 2);
  for (const Fragment& g : n->fragments) {
    EXPECT_EQ(g.flat_lo, 0u);
    EXPECT_EQ(g.flat_hi, g.box.Volume());
  }
}

TEST(NormalizeFragments, PlainKeepsStridesAndFillsRowMajor) {
  TensorLayout l;
  l.shape = {2, 3};
  Fragment a = BoxFrag({0, 0}, {2, 2});
  a.strides = {1, 2};  // transposed
  Fragment b = BoxFrag({0, 2}, {2, 1});
  Fragment empty = BoxFrag({0, 0}, {0, 3});
  l.fragments = {a, b, empty};
  auto n = NormalizeFragments(l);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  ASSERT_EQ(n->fragments.size(), 2u);  // the empty one is dropped
  EXPECT_EQ(n->fragments[0].strides, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(n->fragments[1].strides, (std::vector<int64_t>{1, 1}));
}

TEST(NormalizeFragments, Errors) {
  TensorLayout l;
  l.shape = {2, 3};
  l.fragments = {BoxFrag({0, 0}, {2})};
  EXPECT_EQ(NormalizeFragments(l).status().code(), StatusCode::kCorrupt);
  l.fragments = {BoxFrag({1, 0}, {2, 3})};
  auto s = NormalizeFragments(l).status();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("outside shape"), std::string::npos) << s.message();
  Fragment f = BoxFrag({0, 0}, {2, 3});
  f.flat_hi = 7;
  l.fragments = {f};
  EXPECT_EQ(NormalizeFragments(l).status().code(), StatusCode::kCorrupt);
  f = BoxFrag({0, 0}, {2, 3});
  f.flat_lo = 1;
  f.strides = {1, 2};
  l.fragments = {f};
  s = NormalizeFragments(l).status();
  EXPECT_NE(s.message().find("non-row-major"), std::string::npos) << s.message();
  f = BoxFrag({0, 0}, {2, 3});
  f.byte_offset = ~uint64_t{0} - 4;
  l.fragments = {f};
  s = NormalizeFragments(l).status();
  EXPECT_NE(s.message().find("overflows"), std::string::npos) << s.message();
}

TEST(NormalizeFragments, PropertyReadsIdentically) {
  auto rng = Rng(2);
  for (int iter = 0; iter < 300; ++iter) {
    Store st(rng, 3);
    std::vector<float> values;
    const std::vector<int64_t> shape = RandomShape(rng, 0);
    TensorLayout src = RandomSource(rng, st, shape, &values, true);
    const Files files = st.Sources();
    ASSERT_TRUE(ValidateCoverage(src, "src").ok());
    auto norm = NormalizeFragments(src);
    ASSERT_TRUE(norm.ok()) << norm.status().ToString();
    Status v = ValidateCoverage(*norm, "norm");
    ASSERT_TRUE(v.ok()) << v.ToString();
    for (const Fragment& g : norm->fragments) {
      EXPECT_EQ(g.flat_lo, 0u);
      EXPECT_EQ(g.flat_hi, g.box.Volume());
      EXPECT_GT(g.flat_hi, 0u);
      EXPECT_EQ(g.strides.size(), shape.size());
    }
    EXPECT_EQ(ReadAllF32(*norm, files), values);
    EXPECT_EQ(ReadAllF32(src, files), values);
    // A random byte window in a random dtype reads the same through both.
    const DType dst = Uniform(rng, 0, 1) ? DType::kFloat64 : DType::kFloat32;
    const uint64_t n_bytes = values.size() * ItemSize(dst);
    uint64_t a = static_cast<uint64_t>(Uniform(rng, 0, static_cast<int64_t>(n_bytes)));
    uint64_t b = static_cast<uint64_t>(Uniform(rng, 0, static_cast<int64_t>(n_bytes)));
    if (a > b) std::swap(a, b);
    std::vector<std::byte> x(b - a), y(b - a, std::byte{1});
    ASSERT_TRUE(ReadTensorBytes(src, dst, files, a, x).ok());
    ASSERT_TRUE(ReadTensorBytes(*norm, dst, files, a, y).ok());
    EXPECT_EQ(x, y);
    if (HasFailure()) return;
  }
}

// ---------------------------------------------------------------------------------------------
// Zero fill

TEST(ZeroFill, ReadsAsZerosInAnyDtype) {
  TensorLayout l;
  l.shape = {2, 3};
  Fragment z = BoxFrag({0, 0}, {2, 3});
  z.file_id = kZeroFileId;
  l.fragments = {z};
  ASSERT_TRUE(ValidateCoverage(l, "z").ok());
  const Files none;  // no file table entry needed
  for (DType dst : {DType::kFloat32, DType::kBFloat16, DType::kInt64, DType::kFloat64, DType::kBool}) {
    std::vector<std::byte> out(6 * ItemSize(dst), std::byte{0xAB});
    Status s = ReadTensorBytes(l, dst, none, 0, out);
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (std::byte c : out) EXPECT_EQ(c, std::byte{0});
  }
}

TEST(ZeroFill, MixedWithDataAndPartialWindows) {
  // [4, 3]: rows 0-1 from a transposed float16 file, rows 2-3 zeros; float32 values 1..6.
  auto rng = Rng(3);
  Store st(rng, 1);
  TensorLayout l;
  l.shape = {4, 3};
  std::vector<float> values(12, 0.0f);
  for (int i = 0; i < 6; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i + 1);
  Fragment data = BoxFrag({0, 0}, {2, 3}, DType::kFloat16);
  data.strides = {1, 2};
  Put(st, l, values, data);
  Fragment z = BoxFrag({2, 0}, {2, 3}, DType::kInt8);
  z.file_id = kZeroFileId;
  l.fragments.push_back(z);
  ASSERT_TRUE(ValidateCoverage(l, "mixed").ok());
  const Files files = st.Sources();
  EXPECT_EQ(ReadAllF32(l, files), values);
  for (uint64_t a = 0; a <= 48; ++a) {
    for (uint64_t b = a; b <= 48; b += 5) {
      std::vector<std::byte> out(b - a, std::byte{0xCD});
      ASSERT_TRUE(ReadTensorBytes(l, DType::kFloat32, files, a, out).ok());
      EXPECT_TRUE(std::equal(out.begin(), out.end(), reinterpret_cast<const std::byte*>(values.data()) + a))
          << "[" << a << ", " << b << ")";
    }
  }
  // A zero fragment overlapping data is a double cover like any other.
  Fragment over = BoxFrag({1, 0}, {1, 3});
  over.file_id = kZeroFileId;
  l.fragments.back() = over;
  EXPECT_EQ(ValidateCoverage(l, "mixed").code(), StatusCode::kCorrupt);
}

TEST(ZeroFill, ExecutePlanZeroOps) {
  CopyOp z;
  z.file_id = kZeroFileId;
  z.src_byte_offset = ~uint64_t{0};  // ignored
  z.src_elem_stride = 7;             // ignored: nothing is read
  z.src_dtype = DType::kComplex64;   // no conversion check
  z.dst_dtype = DType::kFloat32;
  z.dst_byte_offset = 4;
  z.n_elems = 3;
  std::vector<std::byte> out(20, std::byte{0xEE});
  const Files none;
  ASSERT_TRUE(ExecutePlan(std::span<const CopyOp>(&z, 1), none, out).ok());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], (i >= 4 && i < 16) ? std::byte{0} : std::byte{0xEE});
  z.n_elems = 5;  // past the buffer
  EXPECT_EQ(ExecutePlan(std::span<const CopyOp>(&z, 1), none, out).code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// LocalLayout hand cases. Global values are 1, 2, 3, ... row-major.

struct Source {
  TensorLayout layout;
  Files files;
  std::vector<float> values;
};

Source RowMajorSource(std::vector<int64_t> shape, const std::vector<Box>& boxes, DType dt = DType::kFloat32) {
  auto rng = Rng(4);
  Store st(rng, 2);
  Source s;
  s.layout.shape = std::move(shape);
  s.values.resize(Volume(s.layout.shape));
  std::iota(s.values.begin(), s.values.end(), 1.0f);
  for (const Box& b : boxes) Put(st, s.layout, s.values, BoxFrag(b.offsets, b.sizes, dt));
  s.files = st.Sources();
  EXPECT_TRUE(ValidateCoverage(s.layout, "source").ok());
  return s;
}

std::vector<float> ReadLocal(const Source& s, const std::vector<int64_t>& local_shape, int cat_dim,
                             const std::vector<Box>& pieces, TensorLayout* out_layout = nullptr) {
  auto l = LocalLayout(s.layout, local_shape, cat_dim, pieces);
  EXPECT_TRUE(l.ok()) << l.status().ToString();
  if (!l.ok()) return {};
  Status v = ValidateCoverage(*l, "local");
  EXPECT_TRUE(v.ok()) << v.ToString();
  if (out_layout != nullptr) *out_layout = *l;
  return ReadAllF32(*l, s.files);
}

TEST(LocalLayout, RowShardOfColumnShardedSource) {
  Source s = RowMajorSource({4, 6}, {Box{{0, 0}, {4, 3}}, Box{{0, 3}, {4, 3}}});
  TensorLayout l;
  auto got = ReadLocal(s, {2, 6}, 0, {Box{{2, 0}, {2, 6}}}, &l);
  EXPECT_EQ(got, (std::vector<float>{13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24}));
  ASSERT_EQ(l.fragments.size(), 2u);
  EXPECT_EQ(l.fragments[0].box, (Box{{0, 0}, {2, 3}}));
  EXPECT_EQ(l.fragments[1].box, (Box{{0, 3}, {2, 3}}));
  // byte_offset moved to global row 2 of the column shard: 2 rows · 3 elements · 4 bytes.
  EXPECT_EQ(l.fragments[0].byte_offset, s.layout.fragments[0].byte_offset + 24);
}

TEST(LocalLayout, ColumnShardOfRowShardedSource) {
  Source s = RowMajorSource({4, 6}, {Box{{0, 0}, {1, 6}}, Box{{1, 0}, {3, 6}}}, DType::kBFloat16);
  auto got = ReadLocal(s, {4, 3}, 1, {Box{{0, 3}, {4, 3}}});
  EXPECT_EQ(got, (std::vector<float>{4, 5, 6, 10, 11, 12, 16, 17, 18, 22, 23, 24}));
}

TEST(LocalLayout, GridTo1DSplit) {
  // 2x2 grid over [4, 4] to four column ranks [4, 1].
  Source s = RowMajorSource({4, 4}, {Box{{0, 0}, {2, 2}}, Box{{0, 2}, {2, 2}}, Box{{2, 0}, {2, 2}},
                                     Box{{2, 2}, {2, 2}}});
  for (int64_t t = 0; t < 4; ++t) {
    auto got = ReadLocal(s, {4, 1}, 1, {Box{{0, t}, {4, 1}}});
    EXPECT_EQ(got, (std::vector<float>{static_cast<float>(1 + t), static_cast<float>(5 + t),
                                       static_cast<float>(9 + t), static_cast<float>(13 + t)}));
  }
}

TEST(LocalLayout, ShardNCFusedQkv) {
  // Fused [Q; K; V] with q = 4, k = v = 2 rows of width 3, source TP = 2 split at row 5 (not a
  // segment boundary). Target TP = 2: rank r holds [Q_r; K_r; V_r].
  Source s = RowMajorSource({8, 3}, {Box{{0, 0}, {5, 3}}, Box{{5, 0}, {3, 3}}});
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<Box> pieces = {Box{{2 * r, 0}, {2, 3}}, Box{{4 + r, 0}, {1, 3}}, Box{{6 + r, 0}, {1, 3}}};
    auto got = ReadLocal(s, {4, 3}, 0, pieces);
    std::vector<float> want;
    for (int64_t row : {2 * r, 2 * r + 1, 4 + r, 6 + r}) {
      for (int64_t c = 0; c < 3; ++c) want.push_back(static_cast<float>(row * 3 + c + 1));
    }
    EXPECT_EQ(got, want) << "rank " << r;
  }
}

TEST(LocalLayout, VocabPaddingRows) {
  // Vocabulary 5 padded to 6 over 2 ranks: rank 0 rows 0-2, rank 1 rows 3-4 plus a zero row.
  Source s = RowMajorSource({5, 2}, {Box{{0, 0}, {5, 2}}});
  EXPECT_EQ(ReadLocal(s, {3, 2}, 0, {Box{{0, 0}, {3, 2}}}), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  TensorLayout l;
  EXPECT_EQ(ReadLocal(s, {3, 2}, 0, {Box{{3, 0}, {2, 2}}}, &l), (std::vector<float>{7, 8, 9, 10, 0, 0}));
  ASSERT_EQ(l.fragments.size(), 2u);
  EXPECT_EQ(l.fragments[1].file_id, kZeroFileId);
  EXPECT_EQ(l.fragments[1].box, (Box{{2, 0}, {1, 2}}));
  // A rank with no data at all (torch.chunk's empty tail) is all padding.
  EXPECT_EQ(ReadLocal(s, {2, 2}, 0, {}), (std::vector<float>{0, 0, 0, 0}));
}

TEST(LocalLayout, ZeroDim) {
  Source s = RowMajorSource({}, {Box{}}, DType::kFloat64);
  EXPECT_EQ(ReadLocal(s, {}, 0, {Box{}}), (std::vector<float>{1}));
  EXPECT_EQ(LocalLayout(s.layout, {}, 0, {}).status().code(), StatusCode::kInvalidArgument);
}

TEST(LocalLayout, Errors) {
  Source s = RowMajorSource({4, 6}, {Box{{0, 0}, {4, 6}}});
  auto expect_err = [&](const std::vector<int64_t>& shape, int cat, const std::vector<Box>& pieces,
                        const std::string& needle) {
    auto r = LocalLayout(s.layout, shape, cat, pieces);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  expect_err({4}, 0, {Box{{0}, {4}}}, "rank");
  expect_err({4, 6}, 2, {Box{{0, 0}, {4, 6}}}, "cat_dim");
  expect_err({4, 6}, 0, {Box{{0}, {4}}}, "rank does not match");
  expect_err({4, 6}, 0, {Box{{2, 0}, {4, 6}}}, "outside global shape");
  expect_err({4, 6}, 0, {Box{{0, -1}, {4, 6}}}, "outside global shape");
  expect_err({4, 5}, 0, {Box{{0, 0}, {4, 6}}}, "does not match local shape");
  expect_err({3, 6}, 0, {Box{{0, 0}, {2, 6}}, Box{{2, 0}, {2, 6}}}, "more than local shape");
  expect_err({-1, 6}, 0, {}, "bad local shape");
  TensorLayout bad = s.layout;
  bad.fragments[0].box.sizes = {5, 6};
  EXPECT_EQ(LocalLayout(bad, {4, 6}, 0, {Box{{0, 0}, {4, 6}}}).status().code(), StatusCode::kCorrupt);
}

// ---------------------------------------------------------------------------------------------
// The key property: source layout -> target layout -> back is the identity.

TEST(LocalLayout, PropertySourceTargetBackIsIdentity) {
  auto rng = Rng(5);
  for (int iter = 0; iter < 300; ++iter) {
    Store st(rng, static_cast<size_t>(Uniform(rng, 1, 3)));
    std::vector<float> values;
    const std::vector<int64_t> shape = RandomShape(rng, 1);
    const size_t r = shape.size();
    TensorLayout src = RandomSource(rng, st, shape, &values, true);
    const Files files = st.Sources();
    ASSERT_TRUE(ValidateCoverage(src, "src").ok());
    // Target: split dim sd into K segments (fused tensors; K = 1 is a plain shard), each
    // chunked over T ranks with torch.chunk semantics (ceil; last ranks smaller or empty); rank
    // t concatenates its chunk of every segment, then 0-2 padding rows.
    const size_t sd = static_cast<size_t>(Uniform(rng, 0, static_cast<int64_t>(r) - 1));
    const int64_t T = Uniform(rng, 1, 4);
    std::vector<int64_t> seg = {0, shape[sd]};
    for (int64_t k = Uniform(rng, 0, 2); k > 0; --k) seg.push_back(Uniform(rng, 0, shape[sd]));
    std::sort(seg.begin(), seg.end());
    std::vector<float> back(values.size(), -1.0f);
    std::vector<int> hits(values.size(), 0);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<Box> pieces;
      int64_t extent = 0;
      for (size_t k = 0; k + 1 < seg.size(); ++k) {
        const int64_t len = seg[k + 1] - seg[k];
        const int64_t chunk = (len + T - 1) / T;
        const int64_t lo = std::min(t * chunk, len), hi = std::min((t + 1) * chunk, len);
        Box p{std::vector<int64_t>(r, 0), shape};
        p.offsets[sd] = seg[k] + lo;
        p.sizes[sd] = hi - lo;
        extent += hi - lo;
        pieces.push_back(std::move(p));
      }
      std::vector<int64_t> local_shape = shape;
      local_shape[sd] = extent + Uniform(rng, 0, 2);
      SCOPED_TRACE("iter " + std::to_string(iter) + " rank " + std::to_string(t) + " of " +
                   std::to_string(T) + " split dim " + std::to_string(sd));
      auto local = LocalLayout(src, local_shape, static_cast<int>(sd), pieces);
      ASSERT_TRUE(local.ok()) << local.status().ToString();
      Status v = ValidateCoverage(*local, "local");  // every target element exactly once
      ASSERT_TRUE(v.ok()) << v.ToString();
      const std::vector<float> got = ReadAllF32(*local, files);
      ASSERT_EQ(got, NaiveLocal(values, shape, local_shape, sd, pieces));
      // A random byte window of the local tensor in float64 matches too.
      const uint64_t n_bytes = got.size() * 8;
      uint64_t a = static_cast<uint64_t>(Uniform(rng, 0, static_cast<int64_t>(n_bytes)));
      uint64_t b = static_cast<uint64_t>(Uniform(rng, 0, static_cast<int64_t>(n_bytes)));
      if (a > b) std::swap(a, b);
      std::vector<double> as_f64(got.begin(), got.end());
      std::vector<std::byte> win(b - a);
      ASSERT_TRUE(ReadTensorBytes(*local, DType::kFloat64, files, a, win).ok());
      EXPECT_TRUE(std::equal(win.begin(), win.end(), reinterpret_cast<const std::byte*>(as_f64.data()) + a));
      // Back: scatter the local tensor's pieces into the global one.
      for (uint64_t e = 0; e < got.size(); ++e) {
        std::vector<int64_t> idx = Unravel(e, local_shape);
        int64_t pos = 0;
        bool in_piece = false;
        for (const Box& p : pieces) {
          if (idx[sd] < pos + p.sizes[sd]) {
            std::vector<int64_t> g = idx;
            for (size_t d = 0; d < r; ++d) g[d] = (d == sd ? idx[d] - pos : idx[d]) + p.offsets[d];
            const uint64_t ge = Ravel(g, shape);
            back[ge] = got[e];
            ++hits[ge];
            in_piece = true;
            break;
          }
          pos += p.sizes[sd];
        }
        if (!in_piece) {
          EXPECT_EQ(got[e], 0.0f) << "padding element " << e;
        }
      }
    }
    EXPECT_EQ(back, values) << "iter " << iter;
    for (int h : hits) ASSERT_EQ(h, 1) << "iter " << iter;
    if (HasFailure()) return;
  }
}

// ---------------------------------------------------------------------------------------------
// ReadConcatBytes

TEST(ReadConcatBytes, PropertyMatchesNaiveConcatenation) {
  auto rng = Rng(6);
  for (int iter = 0; iter < 200; ++iter) {
    Store st(rng, 2);
    const size_t n_parts = static_cast<size_t>(Uniform(rng, 0, 3));
    const DType dtypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16};
    const DType dst = dtypes[Uniform(rng, 0, 3)];
    const bool ints = dst == DType::kFloat32 || dst == DType::kFloat64;
    std::vector<TensorLayout> layouts(n_parts);
    std::vector<float> naive;
    for (auto& l : layouts) {
      std::vector<float> values;
      l = RandomSource(rng, st, RandomShape(rng, 0), &values, true, ints);
      naive.insert(naive.end(), values.begin(), values.end());
    }
    const Files files = st.Sources();
    std::vector<const TensorLayout*> parts;
    for (const auto& l : layouts) parts.push_back(&l);
    const uint64_t isz = ItemSize(dst);
    const uint64_t padded = naive.size() + static_cast<uint64_t>(Uniform(rng, 0, 5));
    std::vector<std::byte> want(padded * isz, std::byte{0});
    ASSERT_TRUE(ConvertElements(DType::kFloat32, dst, reinterpret_cast<const std::byte*>(naive.data()),
                                want.data(), naive.size())
                    .ok());
    for (int w = 0; w < 10; ++w) {
      uint64_t a = static_cast<uint64_t>(Uniform(rng, 0, static_cast<int64_t>(want.size())));
      uint64_t b = static_cast<uint64_t>(Uniform(rng, 0, static_cast<int64_t>(want.size())));
      if (a > b) std::swap(a, b);
      if (w == 0) a = 0, b = want.size();
      std::vector<std::byte> out(b - a, std::byte{0x5A});
      Status s = ReadConcatBytes(parts, dst, padded, files, a, out);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_TRUE(std::equal(out.begin(), out.end(), want.begin() + static_cast<ptrdiff_t>(a)))
          << "iter " << iter << " window [" << a << ", " << b << ")";
    }
    std::vector<std::byte> one(1);
    EXPECT_EQ(ReadConcatBytes(parts, dst, padded, files, want.size(), one).code(), StatusCode::kOutOfRange);
    if (!naive.empty()) {
      EXPECT_EQ(ReadConcatBytes(parts, dst, naive.size() - 1, files, 0, {}).code(),
                StatusCode::kInvalidArgument);
    }
  }
}

TEST(ReadConcatBytes, ZeroOnePartitions) {
  // Two parameters [2, 2] and [3] flattened into 8 elements (1 padding), split over DP = 2:
  // each rank's partition is a 4-element window.
  Source a = RowMajorSource({2, 2}, {Box{{0, 0}, {1, 2}}, Box{{1, 0}, {1, 2}}});
  Source b = RowMajorSource({3}, {Box{{0}, {3}}});
  // Different file tables in the two sources: give b's fragments file ids after a's.
  Files files = a.files;
  for (auto& f : b.layout.fragments) f.file_id += static_cast<uint32_t>(a.files.size());
  files.insert(files.end(), b.files.begin(), b.files.end());
  std::vector<float> out(4);
  auto span = std::as_writable_bytes(std::span<float>(out));
  ASSERT_TRUE(ReadConcatBytes({&a.layout, &b.layout}, DType::kFloat32, 8, files, 0, span).ok());
  EXPECT_EQ(out, (std::vector<float>{1, 2, 3, 4}));
  ASSERT_TRUE(ReadConcatBytes({&a.layout, &b.layout}, DType::kFloat32, 8, files, 16, span).ok());
  EXPECT_EQ(out, (std::vector<float>{1, 2, 3, 0}));
  EXPECT_EQ(ReadConcatBytes({&a.layout, nullptr}, DType::kFloat32, 8, files, 0, span).code(),
            StatusCode::kInvalidArgument);
}


TEST(ReadBoxBytes, BoxOfFlatRangeSource) {
  // ZeRO-style: [4, 6] stored as two flat ranges that split row 1 (elements [0, 10) in bf16,
  // [10, 24) in float32); any box reads its elements, row-major, in float32.
  auto rng = Rng(11);
  Store st(rng, 2);
  Source s;
  s.layout.shape = {4, 6};
  s.values.resize(24);
  std::iota(s.values.begin(), s.values.end(), 1.0f);
  Fragment lo = BoxFrag({0, 0}, {4, 6}, DType::kBFloat16);
  lo.flat_hi = 10;
  Fragment hi = BoxFrag({0, 0}, {4, 6});
  hi.flat_lo = 10;
  Put(st, s.layout, s.values, lo);
  Put(st, s.layout, s.values, hi);
  s.files = st.Sources();
  for (const Box& box : {Box{{1, 2}, {2, 3}}, Box{{0, 0}, {4, 6}}, Box{{3, 5}, {1, 1}}, Box{{0, 3}, {4, 1}}}) {
    std::vector<float> got(box.Volume());
    ASSERT_TRUE(ReadBoxBytes(s.layout, box, DType::kFloat32, s.files, std::as_writable_bytes(std::span<float>(got))).ok());
    std::vector<float> want;
    for (int64_t r = 0; r < box.sizes[0]; ++r) {
      for (int64_t c = 0; c < box.sizes[1]; ++c) want.push_back(s.values[(box.offsets[0] + r) * 6 + box.offsets[1] + c]);
    }
    EXPECT_EQ(got, want) << "box at " << box.offsets[0] << "," << box.offsets[1];
  }
  std::vector<float> out(6);
  auto span = std::as_writable_bytes(std::span<float>(out));
  EXPECT_EQ(ReadBoxBytes(s.layout, Box{{0, 0}, {2, 2}}, DType::kFloat32, s.files, span).code(),
            StatusCode::kInvalidArgument);  // 4 elements, 6 in the buffer
  EXPECT_EQ(ReadBoxBytes(s.layout, Box{{3, 0}, {2, 3}}, DType::kFloat32, s.files, span).code(),
            StatusCode::kInvalidArgument);  // outside the shape
  EXPECT_EQ(ReadBoxBytes(s.layout, Box{{0}, {6}}, DType::kFloat32, s.files, span).code(),
            StatusCode::kInvalidArgument);  // rank
  EXPECT_TRUE(ReadBoxBytes(s.layout, Box{{1, 1}, {0, 3}}, DType::kFloat32, s.files, {}).ok());  // empty
}

}  // namespace
}  // namespace ucpfs::slice
