// Slice algebra and copy planning (see slice.h).
//
// Geometry of one fragment, used by both coverage validation and read planning: the box's
// elements fall into "rows" of run_len elements that are contiguous in the global row-major
// order (the box's last dim, extended over trailing dims the box spans fully) and evenly
// strided in the source (src_stride elements apart: 1 when stored row-major). Rows come in
// increasing global order, so a fragment is a sorted stream of runs; merging the streams of all
// fragments with a heap yields the copy plan in destination order, and the first gap or
// double cover falls out of the same walk.
//
// Not for: I/O policy (ExecutePlan just calls ByteSource::ReadAt), caching, or deciding which
// replica to read (the caller removes replicas before planning).
#include "core/slice/slice.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <queue>
#include <utility>

#include "core/checked.h"
#include "core/slice/plan_cache.h"

namespace ucpfs::slice {
namespace {

constexpr uint64_t kSat = std::numeric_limits<uint64_t>::max();
constexpr int64_t kMaxI64 = std::numeric_limits<int64_t>::max();
// Bound on one source read (and on the bounce buffers) in ExecutePlan.
constexpr uint64_t kPieceBytes = uint64_t{8} << 20;
// Largest item size of any dtype (complex128): the overlap between gather windows.
constexpr uint64_t kMaxItemSize = 16;

bool ValidDType(DType d) { return static_cast<int>(d) < kNumDTypes; }

std::string DTypeName(DType d) {
  return ValidDType(d) ? std::string(TorchName(d)) : "dtype#" + std::to_string(static_cast<int>(d));
}

std::string DimsString(std::span<const int64_t> v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

std::string BoxString(const Box& b) {
  return "offsets " + DimsString(b.offsets) + " sizes " + DimsString(b.sizes);
}

std::string FragString(const Fragment& f, size_t index) {
  std::string s = "fragment " + std::to_string(index) + " (box " + BoxString(f.box);
  uint64_t v = f.box.Volume();
  if (f.flat_lo != 0 || f.flat_hi != v) {
    s += " flat range [" + std::to_string(f.flat_lo) + ", " + std::to_string(f.flat_hi) + ")";
  }
  return s + ")";
}

// Coordinates of global element e of a tensor of `shape` (row-major), e.g. "[1, 0, 3]".
std::string IndexString(uint64_t e, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    uint64_t n = static_cast<uint64_t>(shape[d]);
    if (n == 0) break;
    idx[d] = static_cast<int64_t>(e % n);
    e /= n;
  }
  return DimsString(idx);
}

// Product of sizes; nullopt when a size is negative or the product overflows.
std::optional<uint64_t> CheckedVolume(std::span<const int64_t> sizes) {
  uint64_t v = 1;
  bool zero = false;
  for (int64_t s : sizes) {
    if (s < 0) return std::nullopt;
    if (s == 0) zero = true;
  }
  if (zero) return 0;
  for (int64_t s : sizes) {
    auto m = CheckedMul(v, static_cast<uint64_t>(s));
    if (!m) return std::nullopt;
    v = *m;
  }
  return v;
}

uint64_t SatMul(uint64_t a, uint64_t b) {
  auto m = CheckedMul(a, b);
  return m ? *m : kSat;
}

// Row-major element strides of `shape`; requires that its volume fits in uint64.
std::vector<uint64_t> GlobalStrides(const std::vector<int64_t>& shape) {
  std::vector<uint64_t> g(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) g[d - 1] = SatMul(g[d], static_cast<uint64_t>(shape[d]));
  return g;
}

// Global element index of the element at flat position p of a (non-empty) box.
uint64_t GlobalOfPosition(const Box& b, const std::vector<uint64_t>& gstrides, uint64_t p) {
  uint64_t g = 0;
  for (size_t d = b.sizes.size(); d-- > 0;) {
    uint64_t n = static_cast<uint64_t>(b.sizes[d]);
    g += (static_cast<uint64_t>(b.offsets[d]) + p % n) * gstrides[d];
    p /= n;
  }
  return g;
}

// Checks one fragment against the shape (no allocation: PlanRead calls this for every
// fragment on every read). On success *first/*end receive the global span of its elements
// ([0, 0) when empty). Messages name the fragment; the caller adds the tensor.
Status CheckFragment(const std::vector<int64_t>& shape, const std::vector<uint64_t>& gstrides,
                     const Fragment& f, size_t index, uint64_t* first, uint64_t* end) {
  const size_t r = shape.size();
  auto fail = [&](const std::string& why) {
    return CorruptError(FragString(f, index) + ": " + why);
  };
  if (f.box.offsets.size() != r || f.box.sizes.size() != r) {
    return fail("rank " + std::to_string(f.box.sizes.size()) + " does not match shape " +
                DimsString(shape));
  }
  if (!ValidDType(f.dtype)) return fail("invalid dtype");
  for (size_t d = 0; d < r; ++d) {
    if (f.box.offsets[d] < 0 || f.box.sizes[d] < 0 ||
        f.box.offsets[d] > shape[d] - f.box.sizes[d]) {
      return fail("box outside shape " + DimsString(shape));
    }
  }
  const uint64_t v = *CheckedVolume(f.box.sizes);  // inside the shape, so no overflow
  if (f.flat_lo > f.flat_hi || f.flat_hi > v) {
    return fail("flat range outside the box's " + std::to_string(v) + " elements");
  }
  if (!f.strides.empty()) {
    if (f.strides.size() != r) return fail("strides " + DimsString(f.strides) + " of wrong rank");
    for (int64_t s : f.strides) {
      if (s < 0) return fail("negative stride in " + DimsString(f.strides));
    }
  }
  *first = *end = 0;
  if (f.flat_lo == f.flat_hi) return Status::Ok();
  const bool restricted = f.flat_lo != 0 || f.flat_hi != v;
  // Highest stored element offset, to prove every source byte offset fits in uint64.
  uint64_t max_elem = 0;
  if (f.strides.empty() || restricted) {
    max_elem = f.flat_hi - f.flat_lo - 1;
  } else {
    for (size_t d = 0; d < r; ++d) {
      auto t = CheckedMul(static_cast<uint64_t>(f.box.sizes[d] - 1),
                          static_cast<uint64_t>(f.strides[d]));
      auto sum = t ? CheckedAdd(max_elem, *t) : std::nullopt;
      if (!sum) return fail("stored extent overflows");
      max_elem = *sum;
    }
  }
  if (restricted && !f.strides.empty()) {
    // Flat ranges are stored 1-D contiguous: only row-major strides make sense.
    uint64_t expect = 1;
    for (size_t d = r; d-- > 0;) {
      const uint64_t s = static_cast<uint64_t>(f.box.sizes[d]);
      if (s != 1 && static_cast<uint64_t>(f.strides[d]) != expect) {
        return fail("flat range over non-row-major strides " + DimsString(f.strides));
      }
      expect *= s;
    }
  }
  const uint64_t isz = ItemSize(f.dtype);
  auto n_bytes = CheckedMul(max_elem + 1, isz);
  if (!n_bytes || !CheckedAdd(f.byte_offset, *n_bytes)) return fail("stored extent overflows");
  *first = GlobalOfPosition(f.box, gstrides, f.flat_lo);
  *end = GlobalOfPosition(f.box, gstrides, f.flat_hi - 1) + 1;
  return Status::Ok();
}

// Run structure of a checked, non-empty fragment (see the file comment).
struct FragGeom {
  const Fragment* frag = nullptr;
  size_t index = 0;
  uint64_t run_len = 1;      // elements per row
  uint64_t src_stride = 1;   // source element step inside a row
  uint64_t g_base = 0;       // global index of the box's first element
  uint64_t row_first = 0;    // rows touched by the flat range: [row_first, row_end)
  uint64_t row_end = 0;
  // Outer dims (those not merged into the run, size-1 dims dropped), outermost first.
  std::vector<uint64_t> outer_size, outer_gstride, outer_sstride;
};

FragGeom BuildGeom(const std::vector<int64_t>& shape, const std::vector<uint64_t>& gstrides,
                   const Fragment& f, size_t index) {
  FragGeom g;
  g.frag = &f;
  g.index = index;
  const size_t r = shape.size();
  const auto& s = f.box.sizes;
  for (size_t d = 0; d < r; ++d) g.g_base += static_cast<uint64_t>(f.box.offsets[d]) * gstrides[d];
  size_t j = 0;
  if (r > 0) {
    // Global contiguity: dims after k are spanned fully.
    size_t k = r - 1;
    while (k > 0 && s[k] == shape[k]) --k;
    // Effective stored strides (a size-1 dim's stride is irrelevant: make it chain).
    std::vector<uint64_t> te(r);
    for (size_t d = r; d-- > 0;) {
      const uint64_t next = d + 1 < r ? SatMul(te[d + 1], static_cast<uint64_t>(s[d + 1])) : 1;
      te[d] = (f.strides.empty() || s[d] == 1) ? next : static_cast<uint64_t>(f.strides[d]);
    }
    // Source contiguity: dims from chain to r-1 step evenly by te[r-1].
    size_t chain = r - 1;
    while (chain > 0 && te[chain - 1] != kSat &&
           CheckedMul(te[chain], static_cast<uint64_t>(s[chain])) == te[chain - 1]) {
      --chain;
    }
    j = std::max(k, chain);
    g.src_stride = te[r - 1];
    g.run_len = 1;
    for (size_t d = j; d < r; ++d) g.run_len *= static_cast<uint64_t>(s[d]);
    for (size_t d = 0; d < j; ++d) {
      if (s[d] == 1) continue;
      g.outer_size.push_back(static_cast<uint64_t>(s[d]));
      g.outer_gstride.push_back(gstrides[d]);
      g.outer_sstride.push_back(te[d]);
    }
  }
  g.row_first = f.flat_lo / g.run_len;
  g.row_end = f.flat_hi / g.run_len + (f.flat_hi % g.run_len != 0 ? 1 : 0);
  return g;
}

// A position in one fragment's stream of runs.
struct Cursor {
  const FragGeom* g = nullptr;
  uint64_t row = 0;
  std::vector<uint64_t> idx;  // outer multi-index of `row`
  uint64_t row_global = 0;    // global index of the row's first element
  uint64_t row_src = 0;       // source element offset (from the box's element 0) of it
  // The current run, clipped to the flat range: global [lo, hi), source element of lo
  // relative to the fragment's byte_offset.
  uint64_t lo = 0, hi = 0, src = 0;

  void Seek(uint64_t row_index) {
    row = row_index;
    idx.assign(g->outer_size.size(), 0);
    row_global = g->g_base;
    row_src = 0;
    for (size_t d = idx.size(); d-- > 0;) {
      idx[d] = row_index % g->outer_size[d];
      row_index /= g->outer_size[d];
      row_global += idx[d] * g->outer_gstride[d];
      row_src += idx[d] * g->outer_sstride[d];
    }
    Load();
  }
  // Moves to the next row; false at the end of the fragment.
  bool Next() {
    if (++row >= g->row_end) return false;
    for (size_t d = idx.size(); d-- > 0;) {
      row_global += g->outer_gstride[d];
      row_src += g->outer_sstride[d];
      if (++idx[d] < g->outer_size[d]) break;
      // Wraps: exact in modular arithmetic, and the sum is in range again after the carry.
      row_global -= g->outer_size[d] * g->outer_gstride[d];
      row_src -= g->outer_size[d] * g->outer_sstride[d];
      idx[d] = 0;
    }
    Load();
    return true;
  }
  void Load() {
    const Fragment& f = *g->frag;
    const uint64_t pos = row * g->run_len;  // box position of the row's first element
    const uint64_t t_lo = f.flat_lo > pos ? f.flat_lo - pos : 0;
    const uint64_t t_hi = std::min(g->run_len, f.flat_hi - pos);
    lo = row_global + t_lo;
    hi = row_global + t_hi;
    // Flat-range fragments are row-major (row_src == pos, stride 1): position p is stored at
    // p - flat_lo. Whole boxes have flat_lo == 0.
    src = row_src + t_lo * g->src_stride - f.flat_lo;
  }
};

struct WalkIssue {
  bool gap = true;       // else: an element covered twice
  uint64_t elem = 0;     // first uncovered / doubly covered global element
  uint64_t end = 0;      // gap: where coverage resumes
  size_t frag_a = 0, frag_b = 0;  // overlap: the two fragments
};

// Visits, in global order, the runs of `geoms` clipped to [lo, hi): visit(geom, global_lo,
// n_elems, src_elem). Stops at the first gap or double cover and returns it.
std::optional<WalkIssue> WalkRuns(
    const std::vector<FragGeom>& geoms, uint64_t lo, uint64_t hi,
    const std::function<void(const FragGeom&, uint64_t, uint64_t, uint64_t)>& visit) {
  std::vector<Cursor> cursors;
  cursors.reserve(geoms.size());
  using Entry = std::pair<uint64_t, size_t>;  // (clipped run start, cursor), min first
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (const FragGeom& g : geoms) {
    // First row whose end passes lo: row starts increase with the row index.
    uint64_t a = g.row_first, b = g.row_end;
    Cursor probe;
    probe.g = &g;
    while (a < b) {
      const uint64_t mid = a + (b - a) / 2;
      probe.Seek(mid);
      if (probe.row_global + g.run_len > lo) {
        b = mid;
      } else {
        a = mid + 1;
      }
    }
    if (a == g.row_end) continue;
    probe.Seek(a);
    bool live = true;
    while (live && probe.hi <= lo) live = probe.Next();
    if (!live || probe.lo >= hi) continue;
    cursors.push_back(std::move(probe));
    heap.push({std::max(cursors.back().lo, lo), cursors.size() - 1});
  }
  uint64_t expected = lo;
  size_t last_frag = 0;
  while (!heap.empty()) {
    auto [start, ci] = heap.top();
    heap.pop();
    Cursor& c = cursors[ci];
    if (start > expected) return WalkIssue{true, expected, start, 0, 0};
    if (start < expected) return WalkIssue{false, start, 0, last_frag, c.g->index};
    const uint64_t stop = std::min(c.hi, hi);
    visit(*c.g, start, stop - start, c.src + (start - c.lo) * c.g->src_stride);
    expected = stop;
    last_frag = c.g->index;
    if (c.Next() && c.lo < hi) heap.push({c.lo, ci});
  }
  if (expected < hi) return WalkIssue{true, expected, hi, 0, 0};
  return std::nullopt;
}

// ---- dtype conversion ----

struct FloatFmt {
  int ebits;
  int mbits;
};

std::optional<FloatFmt> FloatFormat(DType d) {
  switch (d) {
    case DType::kFloat64: return FloatFmt{11, 52};
    case DType::kFloat32: return FloatFmt{8, 23};
    case DType::kFloat16: return FloatFmt{5, 10};
    case DType::kBFloat16: return FloatFmt{8, 7};
    default: return std::nullopt;
  }
}

bool IsIntLike(DType d) {
  switch (d) {
    case DType::kInt64: case DType::kInt32: case DType::kInt16: case DType::kInt8:
    case DType::kUInt8: case DType::kBool:
      return true;
    default:
      return false;
  }
}

// x >> s rounded to nearest, ties to even; s in [0, 63].
uint64_t ShiftRne(uint64_t x, int s) {
  if (s == 0) return x;
  const uint64_t q = x >> s;
  const uint64_t rem = x & ((uint64_t{1} << s) - 1);
  const uint64_t half = uint64_t{1} << (s - 1);
  return (rem > half || (rem == half && (q & 1))) ? q + 1 : q;
}

// Converts the bit pattern of a binary floating-point number between IEEE-style formats:
// exact when widening, round-to-nearest-even when narrowing (overflow to inf, gradual
// underflow through subnormals). NaN payloads keep their top bits; a NaN whose kept payload
// would be zero becomes a quiet NaN, so NaN stays NaN.
uint64_t ConvertFloatBits(uint64_t x, FloatFmt in, FloatFmt out) {
  const int in_bias = (1 << (in.ebits - 1)) - 1;
  const int out_bias = (1 << (out.ebits - 1)) - 1;
  const uint64_t in_emax = (uint64_t{1} << in.ebits) - 1;
  const uint64_t out_emax = (uint64_t{1} << out.ebits) - 1;
  const uint64_t in_mmask = (uint64_t{1} << in.mbits) - 1;
  const uint64_t e = (x >> in.mbits) & in_emax;
  const uint64_t m = x & in_mmask;
  const uint64_t sign = ((x >> (in.ebits + in.mbits)) & 1) << (out.ebits + out.mbits);
  const uint64_t inf = sign | (out_emax << out.mbits);
  if (e == in_emax) {
    if (m == 0) return inf;
    uint64_t pm = in.mbits >= out.mbits ? m >> (in.mbits - out.mbits) : m << (out.mbits - in.mbits);
    if (pm == 0) pm = uint64_t{1} << (out.mbits - 1);
    return inf | pm;
  }
  if (e == 0 && m == 0) return sign;
  // Normalize to sig (leading 1 at bit in.mbits) * 2^(exp2 - in.mbits).
  int64_t exp2;
  uint64_t sig;
  if (e == 0) {
    const int lead = 63 - __builtin_clzll(m);
    exp2 = int64_t{1} - in_bias - in.mbits + lead;
    sig = m << (in.mbits - lead);
  } else {
    exp2 = static_cast<int64_t>(e) - in_bias;
    sig = m | (uint64_t{1} << in.mbits);
  }
  const int64_t te = exp2 + out_bias;
  if (te >= static_cast<int64_t>(out_emax)) return inf;
  if (te >= 1) {
    if (out.mbits >= in.mbits) {
      return sign | (static_cast<uint64_t>(te) << out.mbits) |
             ((sig & in_mmask) << (out.mbits - in.mbits));
    }
    const uint64_t rounded = ShiftRne(sig, in.mbits - out.mbits);
    // rounded is in [2^mbits, 2^(mbits+1)]; adding it carries into the exponent (up to inf).
    return sign + ((static_cast<uint64_t>(te) << out.mbits) + rounded - (uint64_t{1} << out.mbits));
  }
  // Subnormal result: units of 2^(1 - out_bias - out.mbits).
  const int64_t shift = in.mbits - out.mbits + (1 - te);
  if (shift >= 64) return sign;  // below half the smallest subnormal
  if (shift <= 0) return sign | (sig << -shift);
  return sign | ShiftRne(sig, static_cast<int>(shift));  // may round up to the smallest normal
}

template <typename T>
T Load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void Store(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

template <typename In, typename Out, typename F>
void Map(const std::byte* in, std::byte* out, uint64_t n, F f) {
  for (uint64_t i = 0; i < n; ++i) Store<Out>(out + i * sizeof(Out), f(Load<In>(in + i * sizeof(In))));
}

uint16_t F32ToBf16(uint32_t x) {
  if ((x & 0x7F800000u) == 0x7F800000u && (x & 0x007FFFFFu) != 0) {
    uint16_t h = static_cast<uint16_t>(x >> 16);
    return (h & 0x7F) ? h : static_cast<uint16_t>(h | 0x40);
  }
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

template <typename Out>
void IntToFloat(DType src, const std::byte* in, std::byte* out, uint64_t n) {
  switch (src) {
    case DType::kInt64: Map<int64_t, Out>(in, out, n, [](int64_t v) { return static_cast<Out>(v); }); break;
    case DType::kInt32: Map<int32_t, Out>(in, out, n, [](int32_t v) { return static_cast<Out>(v); }); break;
    case DType::kInt16: Map<int16_t, Out>(in, out, n, [](int16_t v) { return static_cast<Out>(v); }); break;
    case DType::kInt8: Map<int8_t, Out>(in, out, n, [](int8_t v) { return static_cast<Out>(v); }); break;
    case DType::kUInt8: Map<uint8_t, Out>(in, out, n, [](uint8_t v) { return static_cast<Out>(v); }); break;
    case DType::kBool: Map<uint8_t, Out>(in, out, n, [](uint8_t v) { return v ? Out{1} : Out{0}; }); break;
    default: break;
  }
}

template <typename In>
void FloatToFloatFrom(FloatFmt fi, DType dst, FloatFmt fo, const std::byte* in, std::byte* out,
                      uint64_t n) {
  auto conv = [fi, fo](In v) { return ConvertFloatBits(v, fi, fo); };
  switch (ItemSize(dst)) {
    case 2: Map<In, uint16_t>(in, out, n, [&](In v) { return static_cast<uint16_t>(conv(v)); }); break;
    case 4: Map<In, uint32_t>(in, out, n, [&](In v) { return static_cast<uint32_t>(conv(v)); }); break;
    default: Map<In, uint64_t>(in, out, n, conv); break;
  }
}

// ---- plan execution ----

// Zero-fill ops count as contiguous: ReadContiguous fills them without reading.
bool Contiguous(const CopyOp& op) {
  return op.src_elem_stride == 1 || op.n_elems <= 1 || op.file_id == kZeroFileId;
}

// A read whose bytes are used at once (converted, gathered). When it fails, the reads deferred
// before it (ReadOrDefer) come first in byte order: their error, if any, is the one returned.
Status ReadFrom(const ByteSource& src, uint64_t byte_offset, std::span<std::byte> out) {
  Status s = src.ReadAt(byte_offset, out);
  if (s.ok()) return s;
  if (Status earlier = FlushReadBatch(); !earlier.ok()) return earlier;
  if (s.message().find(src.Name()) == std::string::npos) return s.WithContext(src.Name());
  return s;
}

Status CheckOp(const CopyOp& op, size_t i, std::span<const std::shared_ptr<const ByteSource>> files,
               uint64_t out_bytes) {
  const std::string where = "copy op " + std::to_string(i) + ": ";
  if (op.file_id == kZeroFileId) {
    // Zero fill: only the destination matters (zero bytes are zero in every dtype).
    if (!ValidDType(op.dst_dtype)) return InvalidArgumentError(where + "invalid destination dtype");
    auto dst_bytes = CheckedMul(op.n_elems, ItemSize(op.dst_dtype));
    if (!dst_bytes || !RangeInside(op.dst_byte_offset, *dst_bytes, out_bytes)) {
      return InvalidArgumentError(where + "destination outside the output buffer");
    }
    return Status::Ok();
  }
  if (op.file_id >= files.size() || files[op.file_id] == nullptr) {
    return InvalidArgumentError(where + "no file " + std::to_string(op.file_id));
  }
  if (!CanConvert(op.src_dtype, op.dst_dtype)) {
    return UnsupportedError(where + "cannot convert " + DTypeName(op.src_dtype) + " to " +
                            DTypeName(op.dst_dtype));
  }
  if (op.src_elem_stride < 0) return InvalidArgumentError(where + "negative stride");
  auto dst_bytes = CheckedMul(op.n_elems, ItemSize(op.dst_dtype));
  if (!dst_bytes || !RangeInside(op.dst_byte_offset, *dst_bytes, out_bytes)) {
    return InvalidArgumentError(where + "destination outside the output buffer");
  }
  if (op.n_elems > 0) {
    const uint64_t step = Contiguous(op) ? 1 : static_cast<uint64_t>(op.src_elem_stride);
    auto last = CheckedMul(op.n_elems - 1, step);
    auto span = last ? CheckedMul(*last + 1, ItemSize(op.src_dtype)) : std::nullopt;
    if (!span || !CheckedAdd(op.src_byte_offset, *span)) {
      return InvalidArgumentError(where + "source range overflows");
    }
  }
  return Status::Ok();
}

class Executor {
 public:
  // `defer`: plain reads may go into the thread's open ReadBatch (`out` outlives it).
  Executor(std::span<const std::shared_ptr<const ByteSource>> files, std::span<std::byte> out, bool defer)
      : files_(files), out_(out), defer_(defer) {}

  Status ReadContiguous(const CopyOp& op) {
    if (op.file_id == kZeroFileId) {
      std::memset(out_.data() + op.dst_byte_offset, 0, op.n_elems * ItemSize(op.dst_dtype));
      return Status::Ok();
    }
    const ByteSource& src = *files_[op.file_id];
    const uint64_t in_isz = ItemSize(op.src_dtype), out_isz = ItemSize(op.dst_dtype);
    std::byte* dst = out_.data() + op.dst_byte_offset;
    if (op.src_dtype == op.dst_dtype) {
      // No bounce copy: straight into the caller's buffer, in the view read's batch if one is open.
      const std::span<std::byte> whole(dst, op.n_elems * in_isz);
      return defer_ ? ReadOrDefer(src, op.src_byte_offset, whole) : ReadFrom(src, op.src_byte_offset, whole);
    }
    const uint64_t per_piece = std::max<uint64_t>(1, kPieceBytes / in_isz);
    for (uint64_t done = 0; done < op.n_elems;) {
      const uint64_t n = std::min(per_piece, op.n_elems - done);
      Bounce(n * in_isz);
      UCPFS_RETURN_IF_ERROR(ReadFrom(src, op.src_byte_offset + done * in_isz,
                                     std::span<std::byte>(bounce_.data(), n * in_isz)));
      UCPFS_RETURN_IF_ERROR(ConvertElements(op.src_dtype, op.dst_dtype, bounce_.data(),
                                            dst + done * out_isz, n));
      done += n;
    }
    return Status::Ok();
  }

  // Strided ops reading one file: the bytes their elements span are read once, in windows of
  // at most kPieceBytes (+ one element), and each window's elements are gathered into place.
  // A transposed chunk yields one strided op per row, all spanning the same bytes: this reads
  // the chunk once instead of once per row.
  Status Gather(std::span<const CopyOp* const> ops) {
    const ByteSource& src = *files_[ops.front()->file_id];
    struct Pending {
      const CopyOp* op;
      uint64_t step;     // source bytes between elements
      uint64_t t = 0;    // next element to copy
      uint64_t t_end = 0;  // end of the elements starting in the current window
      uint64_t next_byte;  // source byte offset of element t
    };
    std::vector<Pending> pend;
    pend.reserve(ops.size());
    for (const CopyOp* op : ops) {
      if (op->n_elems == 0) continue;
      pend.push_back({op, static_cast<uint64_t>(op->src_elem_stride) * ItemSize(op->src_dtype), 0, 0,
                      op->src_byte_offset});
    }
    std::stable_sort(pend.begin(), pend.end(), [](const Pending& a, const Pending& b) {
      return a.next_byte < b.next_byte;
    });
    std::vector<size_t> active;
    size_t next = 0;
    while (next < pend.size() || !active.empty()) {
      // The window starts at the first byte a pending element needs; it owns the elements
      // starting in [w, w_end) and extends to the end of the last of them.
      uint64_t w = kSat;
      for (size_t a : active) w = std::min(w, pend[a].next_byte);
      if (next < pend.size()) w = std::min(w, pend[next].next_byte);
      const uint64_t w_end = CheckedAdd(w, kPieceBytes).value_or(kSat);
      while (next < pend.size() && pend[next].next_byte < w_end) active.push_back(next++);
      uint64_t read_end = w;
      for (size_t a : active) {
        Pending& p = pend[a];
        p.t_end = ElemsStartingBefore(*p.op, p.step, w_end);
        if (p.t_end > p.t) {
          read_end = std::max(read_end, p.op->src_byte_offset + (p.t_end - 1) * p.step +
                                            ItemSize(p.op->src_dtype));
        }
      }
      Bounce(read_end - w);
      UCPFS_RETURN_IF_ERROR(ReadFrom(src, w, std::span<std::byte>(bounce_.data(), read_end - w)));
      for (size_t k = 0; k < active.size();) {
        Pending& p = pend[active[k]];
        if (p.t_end > p.t) UCPFS_RETURN_IF_ERROR(Copy(p, w));
        if (p.t >= p.op->n_elems) {
          active[k] = active.back();
          active.pop_back();
        } else {
          p.next_byte = p.op->src_byte_offset + p.t * p.step;
          ++k;
        }
      }
    }
    return Status::Ok();
  }

 private:
  static uint64_t ElemsStartingBefore(const CopyOp& op, uint64_t step, uint64_t w_end) {
    if (op.src_byte_offset >= w_end) return 0;
    if (step == 0) return op.n_elems;
    const uint64_t x = w_end - op.src_byte_offset;
    return std::min(op.n_elems, x / step + (x % step != 0 ? 1 : 0));
  }

  // Copies elements [p.t, p.t_end) of p's op out of the window buffer (which holds source
  // bytes from w on) into place, converting as needed.
  template <typename PendingT>
  Status Copy(PendingT& p, uint64_t w) {
    const CopyOp& op = *p.op;
    const uint64_t in_isz = ItemSize(op.src_dtype), out_isz = ItemSize(op.dst_dtype);
    std::byte* dst = out_.data() + op.dst_byte_offset;
    // Element i lies at window byte op.src_byte_offset + i * step - w.
    const std::byte* win = bounce_.data();
    const uint64_t first = op.src_byte_offset - w;
    if (op.src_dtype == op.dst_dtype) {
      for (uint64_t i = p.t; i < p.t_end; ++i) {
        std::memcpy(dst + i * out_isz, win + (first + i * p.step), in_isz);
      }
    } else {
      constexpr uint64_t kChunk = 4096;
      std::byte tmp[kChunk * kMaxItemSize];
      for (uint64_t i = p.t; i < p.t_end;) {
        const uint64_t n = std::min(kChunk, p.t_end - i);
        for (uint64_t q = 0; q < n; ++q) {
          std::memcpy(tmp + q * in_isz, win + (first + (i + q) * p.step), in_isz);
        }
        UCPFS_RETURN_IF_ERROR(ConvertElements(op.src_dtype, op.dst_dtype, tmp, dst + i * out_isz, n));
        i += n;
      }
    }
    p.t = p.t_end;
    return Status::Ok();
  }

  void Bounce(uint64_t n_bytes) {
    if (bounce_.size() < n_bytes) bounce_.resize(n_bytes);
  }

  std::span<const std::shared_ptr<const ByteSource>> files_;
  std::span<std::byte> out_;
  const bool defer_;
  std::vector<std::byte> bounce_;
};

}  // namespace

uint64_t Box::Volume() const {
  auto v = CheckedVolume(sizes);
  if (!v) {
    for (int64_t s : sizes) {
      if (s <= 0) return 0;  // a negative size holds nothing
    }
    return kSat;  // saturates; ValidateCoverage reports the overflow
  }
  return *v;
}

bool Intersect(const Box& a, const Box& b, Box* out) {
  const size_t r = a.sizes.size();
  if (a.offsets.size() != r || b.offsets.size() != r || b.sizes.size() != r) return false;
  Box res;
  res.offsets.resize(r);
  res.sizes.resize(r);
  for (size_t d = 0; d < r; ++d) {
    if (a.sizes[d] <= 0 || b.sizes[d] <= 0) return false;
    // End = offset + size may overflow for garbage boxes: saturate (the true end is larger).
    int64_t a_end, b_end;
    if (__builtin_add_overflow(a.offsets[d], a.sizes[d], &a_end)) a_end = kMaxI64;
    if (__builtin_add_overflow(b.offsets[d], b.sizes[d], &b_end)) b_end = kMaxI64;
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a_end, b_end);
    if (hi <= lo) return false;
    res.offsets[d] = lo;
    res.sizes[d] = hi - lo;  // lo >= the offset whose size was positive: no overflow
  }
  if (out != nullptr) *out = std::move(res);
  return true;
}

uint64_t TensorLayout::NumElems() const {
  auto v = CheckedVolume(shape);
  return v ? *v : kSat;
}

Status ValidateCoverage(const TensorLayout& layout, const std::string& what,
                        std::vector<std::pair<size_t, size_t>>* replicas) {
  if (replicas != nullptr) replicas->clear();
  const auto& shape = layout.shape;
  const auto& frags = layout.fragments;
  auto fail = [&](const std::string& why) { return CorruptError(what + ": " + why); };
  auto numel_opt = CheckedVolume(shape);
  if (!numel_opt) return fail("bad shape " + DimsString(shape));
  const uint64_t numel = *numel_opt;
  const auto gstrides = GlobalStrides(shape);

  std::vector<size_t> order;  // non-empty fragments
  for (size_t i = 0; i < frags.size(); ++i) {
    uint64_t first, end;
    Status s = CheckFragment(shape, gstrides, frags[i], i, &first, &end);
    if (!s.ok()) return s.WithContext(what);
    if (frags[i].flat_lo != frags[i].flat_hi) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Fragment& x = frags[a];
    const Fragment& y = frags[b];
    if (x.box.offsets != y.box.offsets) return x.box.offsets < y.box.offsets;
    if (x.box.sizes != y.box.sizes) return x.box.sizes < y.box.sizes;
    if (x.flat_lo != y.flat_lo) return x.flat_lo < y.flat_lo;
    if (x.flat_hi != y.flat_hi) return x.flat_hi < y.flat_hi;
    return a < b;
  });

  // Fragments of one box: flat ranges disjoint, identical ones are replicas.
  std::vector<size_t> kept;         // fragments that count (one per replica set)
  std::vector<size_t> unique_box;   // one fragment per distinct box
  uint64_t total = 0;
  for (size_t g = 0; g < order.size();) {
    size_t h = g;
    while (h < order.size() && frags[order[h]].box == frags[order[g]].box) ++h;
    unique_box.push_back(order[g]);
    size_t prev = order[g];     // last distinct flat range
    size_t reach = order[g];    // fragment with the highest flat_hi so far
    kept.push_back(order[g]);
    total += frags[order[g]].NumElems();
    for (size_t q = g + 1; q < h; ++q) {
      const size_t i = order[q];
      const Fragment& f = frags[i];
      if (f.flat_lo == frags[prev].flat_lo && f.flat_hi == frags[prev].flat_hi) {
        if (replicas == nullptr) {
          return fail("fragments " + std::to_string(prev) + " and " + std::to_string(i) +
                      " both cover box " + BoxString(f.box) + " flat range [" +
                      std::to_string(f.flat_lo) + ", " + std::to_string(f.flat_hi) +
                      "): elements covered twice");
        }
        replicas->push_back({prev, i});
        continue;
      }
      if (f.flat_lo < frags[reach].flat_hi) {
        return fail("fragments " + std::to_string(reach) + " and " + std::to_string(i) +
                    " overlap in box " + BoxString(f.box) + ": flat ranges [" +
                    std::to_string(frags[reach].flat_lo) + ", " + std::to_string(frags[reach].flat_hi) +
                    ") and [" + std::to_string(f.flat_lo) + ", " + std::to_string(f.flat_hi) + ")");
      }
      prev = i;
      if (f.flat_hi > frags[reach].flat_hi) reach = i;
      kept.push_back(i);
      total += f.NumElems();  // disjoint subsets of the shape: no overflow
    }
    g = h;
  }

  // Distinct boxes must not intersect. Sweep along the dim with the most distinct offsets,
  // testing each box against those still open there.
  if (!shape.empty() && unique_box.size() > 1) {
    size_t sweep = 0, best = 0;
    std::vector<int64_t> offs;
    for (size_t d = 0; d < shape.size(); ++d) {
      offs.clear();
      for (size_t i : unique_box) offs.push_back(frags[i].box.offsets[d]);
      std::sort(offs.begin(), offs.end());
      const size_t distinct = static_cast<size_t>(std::unique(offs.begin(), offs.end()) - offs.begin());
      if (distinct > best) {
        best = distinct;
        sweep = d;
      }
    }
    std::vector<size_t> by_start = unique_box;
    std::stable_sort(by_start.begin(), by_start.end(), [&](size_t a, size_t b) {
      return frags[a].box.offsets[sweep] < frags[b].box.offsets[sweep];
    });
    std::vector<size_t> open;
    for (size_t i : by_start) {
      const Box& bi = frags[i].box;
      std::erase_if(open, [&](size_t o) {
        return frags[o].box.offsets[sweep] + frags[o].box.sizes[sweep] <= bi.offsets[sweep];
      });
      for (size_t o : open) {
        Box both;
        if (Intersect(frags[o].box, bi, &both)) {
          return fail("fragments " + std::to_string(std::min(o, i)) + " (box " +
                      BoxString(frags[std::min(o, i)].box) + ") and " + std::to_string(std::max(o, i)) +
                      " (box " + BoxString(frags[std::max(o, i)].box) + ") overlap in " +
                      BoxString(both));
        }
      }
      open.push_back(i);
    }
  }
  if (replicas != nullptr) {
    std::sort(replicas->begin(), replicas->end(),
              [](const auto& a, const auto& b) { return a.second < b.second; });
  }
  if (total == numel) return Status::Ok();
  if (total > numel) {
    return fail("fragments cover " + std::to_string(total) + " elements, shape " +
                DimsString(shape) + " has " + std::to_string(numel));
  }
  // Some element is uncovered: find the first gap.
  std::sort(kept.begin(), kept.end());
  std::vector<FragGeom> geoms;
  geoms.reserve(kept.size());
  for (size_t i : kept) geoms.push_back(BuildGeom(shape, gstrides, frags[i], i));
  auto issue = WalkRuns(geoms, 0, numel, [](const FragGeom&, uint64_t, uint64_t, uint64_t) {});
  std::string where;
  if (issue && issue->gap) {
    where = "elements [" + std::to_string(issue->elem) + ", " + std::to_string(issue->end) +
            ") (first at index " + IndexString(issue->elem, shape) + ") are covered by no fragment; ";
  }
  return fail(where + "fragments cover " + std::to_string(total) + " of " + std::to_string(numel) +
              " elements of shape " + DimsString(shape));
}

Result<std::vector<CopyOp>> PlanRead(const TensorLayout& layout, DType dst_dtype, uint64_t elem_lo,
                                     uint64_t elem_hi) {
  if (!ValidDType(dst_dtype)) return InvalidArgumentError("invalid destination dtype");
  auto numel = CheckedVolume(layout.shape);
  if (!numel) return CorruptError("bad shape " + DimsString(layout.shape));
  if (elem_lo > elem_hi) {
    return InvalidArgumentError("element range [" + std::to_string(elem_lo) + ", " +
                                std::to_string(elem_hi) + ") is reversed");
  }
  if (elem_hi > *numel) {
    return OutOfRangeError("element range [" + std::to_string(elem_lo) + ", " +
                           std::to_string(elem_hi) + ") past the tensor's " +
                           std::to_string(*numel) + " elements");
  }
  const uint64_t dst_isz = ItemSize(dst_dtype);
  if (!CheckedMul(elem_hi - elem_lo, dst_isz)) return OutOfRangeError("range too large");
  std::vector<CopyOp> ops;
  if (elem_lo == elem_hi) return ops;

  const auto gstrides = GlobalStrides(layout.shape);
  std::vector<FragGeom> geoms;
  for (size_t i = 0; i < layout.fragments.size(); ++i) {
    const Fragment& f = layout.fragments[i];
    uint64_t first, end;
    UCPFS_RETURN_IF_ERROR(CheckFragment(layout.shape, gstrides, f, i, &first, &end));
    if (first == end || end <= elem_lo || first >= elem_hi) continue;
    if (f.file_id != kZeroFileId && !CanConvert(f.dtype, dst_dtype)) {
      return UnsupportedError(FragString(f, i) + ": cannot convert " + std::string(TorchName(f.dtype)) +
                              " to " + std::string(TorchName(dst_dtype)));
    }
    if (!f.mean_with.empty()) {
      // A mean is computed in float32 (AverageRun): every copy must convert to it.
      if (f.file_id == kZeroFileId || !CanConvert(DType::kFloat32, dst_dtype)) {
        return UnsupportedError(FragString(f, i) + ": a mean of copies cannot be read as " +
                                std::string(TorchName(dst_dtype)));
      }
      for (const MeanPart& part : f.mean_with) {
        if (!CanConvert(part.dtype, DType::kFloat32) || !CanConvert(f.dtype, DType::kFloat32)) {
          return UnsupportedError(FragString(f, i) + ": cannot average stored " + std::string(TorchName(part.dtype)));
        }
      }
    }
    geoms.push_back(BuildGeom(layout.shape, gstrides, f, i));
  }
  auto issue = WalkRuns(geoms, elem_lo, elem_hi,
                        [&](const FragGeom& g, uint64_t global, uint64_t n, uint64_t src_elem) {
    const Fragment& f = *g.frag;
    const uint64_t src_isz = ItemSize(f.dtype);
    CopyOp op;
    op.file_id = f.file_id;
    op.src_byte_offset = f.byte_offset + src_elem * src_isz;  // inside the checked extent
    op.src_elem_stride = n == 1 ? 1 : static_cast<int64_t>(g.src_stride);
    op.src_dtype = f.dtype;
    op.dst_dtype = dst_dtype;
    op.dst_byte_offset = (global - elem_lo) * dst_isz;
    op.n_elems = n;
    if (!f.mean_with.empty()) {
      op.mean_with = f.mean_with;
      ShiftMeanParts(op.mean_with, src_elem);
      ops.push_back(std::move(op));
      return;
    }
    if (!ops.empty() && ops.back().mean_with.empty()) {
      CopyOp& p = ops.back();
      const auto elems = CheckedMul(p.n_elems, static_cast<uint64_t>(p.src_elem_stride));
      const auto advance = elems ? CheckedMul(*elems, src_isz) : std::nullopt;
      if (p.file_id == op.file_id && p.src_dtype == op.src_dtype &&
          p.src_elem_stride == op.src_elem_stride &&
          p.dst_byte_offset + p.n_elems * dst_isz == op.dst_byte_offset && advance &&
          CheckedAdd(p.src_byte_offset, *advance) == op.src_byte_offset) {
        p.n_elems += n;
        return;
      }
    }
    ops.push_back(std::move(op));
  });
  if (issue) {
    if (issue->gap) {
      return CorruptError("no fragment covers element " + std::to_string(issue->elem) +
                          " (index " + IndexString(issue->elem, layout.shape) + ") of shape " +
                          DimsString(layout.shape));
    }
    return CorruptError("element " + std::to_string(issue->elem) + " (index " +
                        IndexString(issue->elem, layout.shape) + ") is covered twice, by " +
                        FragString(layout.fragments[issue->frag_a], issue->frag_a) + " and " +
                        FragString(layout.fragments[issue->frag_b], issue->frag_b));
  }
  return ops;
}

bool CanConvert(DType src, DType dst) {
  if (!ValidDType(src) || !ValidDType(dst)) return false;
  if (src == dst) return true;
  if (FloatFormat(src) && FloatFormat(dst)) return true;
  return IsIntLike(src) && (dst == DType::kFloat32 || dst == DType::kFloat64);
}

Status ConvertElements(DType src, DType dst, const std::byte* in, std::byte* out, uint64_t n) {
  if (!CanConvert(src, dst)) {
    return UnsupportedError("cannot convert " + DTypeName(src) + " to " + DTypeName(dst));
  }
  if (n == 0) return Status::Ok();
  if (src == dst) {
    std::memcpy(out, in, n * ItemSize(src));
    return Status::Ok();
  }
  if (IsIntLike(src)) {
    if (dst == DType::kFloat32) {
      IntToFloat<float>(src, in, out, n);
    } else {
      IntToFloat<double>(src, in, out, n);
    }
    return Status::Ok();
  }
  if (src == DType::kBFloat16 && dst == DType::kFloat32) {
    Map<uint16_t, uint32_t>(in, out, n, [](uint16_t v) { return static_cast<uint32_t>(v) << 16; });
    return Status::Ok();
  }
  if (src == DType::kFloat32 && dst == DType::kBFloat16) {
    Map<uint32_t, uint16_t>(in, out, n, F32ToBf16);
    return Status::Ok();
  }
  const FloatFmt fi = *FloatFormat(src), fo = *FloatFormat(dst);
  switch (ItemSize(src)) {
    case 2: FloatToFloatFrom<uint16_t>(fi, dst, fo, in, out, n); break;
    case 4: FloatToFloatFrom<uint32_t>(fi, dst, fo, in, out, n); break;
    default: FloatToFloatFrom<uint64_t>(fi, dst, fo, in, out, n); break;
  }
  return Status::Ok();
}

void ShiftMeanParts(std::vector<MeanPart>& parts, uint64_t n_elems) {
  for (MeanPart& p : parts) p.byte_offset += n_elems * ItemSize(p.dtype);
}

namespace {

// One averaged run (CopyOp::mean_with): its copies read as float32 in bounded chunks, summed in
// torch's order for sum(slices) / len(slices) over float32 tensors (Python's sum starts at 0,
// so 0 + s0 turns -0.0 into +0.0), divided by N, then converted to the destination dtype.
// Each IEEE operation is a separate statement: no fused multiply-add, no reciprocal.
Status AverageRun(const CopyOp& op, std::span<const std::shared_ptr<const ByteSource>> files,
                  std::span<std::byte> out) {
  constexpr uint64_t kChunkElems = uint64_t{1} << 14;  // 64 KiB of float32 per copy
  const uint64_t n_copies = 1 + op.mean_with.size();
  const float divisor = static_cast<float>(n_copies);
  const uint64_t stride = Contiguous(op) ? 1 : static_cast<uint64_t>(op.src_elem_stride);
  const uint64_t dst_isz = ItemSize(op.dst_dtype);
  std::vector<float> sum(std::min(op.n_elems, kChunkElems)), copy(sum.size());
  for (uint64_t done = 0; done < op.n_elems;) {
    const uint64_t n = std::min(kChunkElems, op.n_elems - done);
    for (uint64_t c = 0; c < n_copies; ++c) {
      CopyOp one;
      one.file_id = c == 0 ? op.file_id : op.mean_with[c - 1].file_id;
      one.src_dtype = c == 0 ? op.src_dtype : op.mean_with[c - 1].dtype;
      const uint64_t base = c == 0 ? op.src_byte_offset : op.mean_with[c - 1].byte_offset;
      auto skip = CheckedMul(done * stride, ItemSize(one.src_dtype));
      auto at = skip ? CheckedAdd(base, *skip) : std::nullopt;
      if (!at) return InvalidArgumentError("averaged copy: source range overflows");
      one.src_byte_offset = *at;
      one.src_elem_stride = op.src_elem_stride;
      one.dst_dtype = DType::kFloat32;
      one.n_elems = n;
      UCPFS_RETURN_IF_ERROR(ExecutePlan(std::span<const CopyOp>(&one, 1), files,
                                        std::as_writable_bytes(std::span<float>(copy.data(), n))));
      if (c == 0) {
        for (uint64_t e = 0; e < n; ++e) sum[e] = 0.0f + copy[e];
      } else {
        for (uint64_t e = 0; e < n; ++e) sum[e] = sum[e] + copy[e];
      }
    }
    for (uint64_t e = 0; e < n; ++e) sum[e] = sum[e] / divisor;
    UCPFS_RETURN_IF_ERROR(ConvertElements(DType::kFloat32, op.dst_dtype,
                                          reinterpret_cast<const std::byte*>(sum.data()),
                                          out.data() + op.dst_byte_offset + done * dst_isz, n));
    done += n;
  }
  return Status::Ok();
}

}  // namespace

namespace {

// ExecutePlan; `defer`: plain reads may wait in the thread's open ReadBatch (only when `out` is
// the view read's own buffer, never a local one that is looked at on return).
Status ExecutePlanImpl(std::span<const CopyOp> ops, std::span<const std::shared_ptr<const ByteSource>> files,
                       std::span<std::byte> out, bool defer) {
  for (size_t i = 0; i < ops.size(); ++i) UCPFS_RETURN_IF_ERROR(CheckOp(ops[i], i, files, out.size()));
  if (std::any_of(ops.begin(), ops.end(), [](const CopyOp& op) { return !op.mean_with.empty(); })) {
    // Averaged runs are computed one by one; the others read as usual, op by op in order.
    for (const CopyOp& op : ops) {
      if (op.mean_with.empty()) {
        UCPFS_RETURN_IF_ERROR(ExecutePlanImpl(std::span<const CopyOp>(&op, 1), files, out, defer));
      } else {
        UCPFS_RETURN_IF_ERROR(AverageRun(op, files, out));
      }
    }
    return Status::Ok();
  }
  Executor ex(files, out, defer);
  // Strided ops are gathered per file, all of a file's at once (its first strided op in
  // destination order triggers the group): a transposed column shard interleaves with other
  // shards in destination order, yet its rows all span the same bytes.
  std::vector<std::pair<uint32_t, size_t>> strided;  // (file, op), sorted
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!Contiguous(ops[i])) strided.push_back({ops[i].file_id, i});
  }
  std::sort(strided.begin(), strided.end());
  std::vector<bool> done(ops.size(), false);
  std::vector<const CopyOp*> group;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (done[i]) continue;
    if (Contiguous(ops[i])) {
      UCPFS_RETURN_IF_ERROR(ex.ReadContiguous(ops[i]));
      continue;
    }
    auto it = std::lower_bound(strided.begin(), strided.end(), std::make_pair(ops[i].file_id, i));
    group.clear();
    for (auto g = it; g != strided.end() && g->first == ops[i].file_id; ++g) {
      group.push_back(&ops[g->second]);
      done[g->second] = true;
    }
    Status s = ex.Gather(group);
    if (!s.ok()) {
      // Find the first failure in destination order, reading the rest op by op (everything
      // before op i succeeded already).
      for (size_t k = i; k < ops.size(); ++k) {
        const CopyOp* one = &ops[k];
        UCPFS_RETURN_IF_ERROR(Contiguous(ops[k]) ? ex.ReadContiguous(ops[k])
                                                 : ex.Gather(std::span<const CopyOp* const>(&one, 1)));
      }
      return s;
    }
  }
  return Status::Ok();
}

}  // namespace

Status ExecutePlan(std::span<const CopyOp> ops, std::span<const std::shared_ptr<const ByteSource>> files,
                   std::span<std::byte> out) {
  return ExecutePlanImpl(ops, files, out, /*defer=*/false);
}

void PrefetchTensorBytes(const TensorLayout& layout, DType dst_dtype,
                         std::span<const std::shared_ptr<const ByteSource>> files, uint64_t byte_offset,
                         uint64_t n_bytes) {
  if (!ValidDType(dst_dtype) || n_bytes == 0) return;
  const uint64_t isz = ItemSize(dst_dtype);
  auto numel = CheckedVolume(layout.shape);
  if (!numel || *numel == 0) return;
  const uint64_t elem_lo = std::min(byte_offset / isz, *numel);
  const uint64_t elem_hi = std::min(*numel, elem_lo + (n_bytes + isz - 1) / isz);
  if (elem_lo >= elem_hi) return;
  auto ops = PlanRead(layout, dst_dtype, elem_lo, elem_hi);
  if (!ops.ok()) return;
  // Coalesce runs of one file that lie close together (strided or gathered rows) into one hint,
  // one pending run per file: a tensor split by columns alternates files every row (a run of
  // file 0, then of file 1, ...), and a run broken at each change of file gave one hint per row
  // (thousands of fadvise calls and prefetch ranges per window, most dropped).
  constexpr uint64_t kGapBytes = 1u << 20;
  struct Pending {
    uint64_t lo = 0, hi = 0;  // hi == 0: none
  };
  std::vector<Pending> pending(files.size());
  auto add = [&](uint32_t file, uint64_t a, uint64_t b) {
    if (file >= files.size() || b <= a) return;
    Pending& run = pending[file];
    if (run.hi != 0 && a >= run.lo && a <= run.hi + kGapBytes) {
      run.hi = std::max(run.hi, b);
      return;
    }
    if (run.hi != 0) files[file]->Prefetch(run.lo, run.hi - run.lo);
    run = Pending{a, b};
  };
  for (const CopyOp& op : *ops) {
    if (op.file_id == kZeroFileId || op.n_elems == 0) continue;
    const uint64_t src_isz = ItemSize(op.src_dtype);
    const uint64_t stride = static_cast<uint64_t>(std::max<int64_t>(1, op.src_elem_stride));
    for (const MeanPart& part : op.mean_with) {  // the other copies of an averaged run
      add(part.file_id, part.byte_offset, part.byte_offset + ((op.n_elems - 1) * stride + 1) * ItemSize(part.dtype));
    }
    add(op.file_id, op.src_byte_offset, op.src_byte_offset + ((op.n_elems - 1) * stride + 1) * src_isz);
  }
  for (size_t f = 0; f < pending.size(); ++f) {
    if (pending[f].hi != 0) files[f]->Prefetch(pending[f].lo, pending[f].hi - pending[f].lo);
  }
}

Status DescribeTensorReads(const TensorLayout& layout, DType dst_dtype,
                           std::span<const std::shared_ptr<const ByteSource>> files, uint64_t byte_offset,
                           uint64_t n_bytes, const SourceRunSink& sink) {
  if (!ValidDType(dst_dtype)) return InvalidArgumentError("invalid destination dtype");
  auto numel = CheckedVolume(layout.shape);
  if (!numel) return CorruptError("bad shape " + DimsString(layout.shape));
  const uint64_t isz = ItemSize(dst_dtype);
  auto total = CheckedMul(*numel, isz);
  if (!total || !RangeInside(byte_offset, n_bytes, *total)) {
    return OutOfRangeError("range of " + std::to_string(n_bytes) + " bytes at offset " +
                           std::to_string(byte_offset) + " past the tensor's " +
                           (total ? std::to_string(*total) : std::string("too many")) + " bytes");
  }
  if (n_bytes == 0) return Status::Ok();
  const uint64_t elem_lo = byte_offset / isz;
  const uint64_t elem_hi = (byte_offset + n_bytes + isz - 1) / isz;
  constexpr uint64_t kPieceElems = uint64_t{1} << 24;  // bounds the plan held at once
  for (uint64_t lo = elem_lo; lo < elem_hi;) {
    const uint64_t hi = std::min(elem_hi, lo + kPieceElems);
    UCPFS_ASSIGN_OR_RETURN(auto ops, PlanRead(layout, dst_dtype, lo, hi));
    for (const CopyOp& op : ops) {
      SourceRun run;
      if (op.file_id != kZeroFileId) {
        if (op.file_id >= files.size()) {
          return InvalidArgumentError("file id " + std::to_string(op.file_id) + " outside the file table of " +
                                      std::to_string(files.size()));
        }
        run.file = files[op.file_id].get();
      }
      run.byte_offset = op.src_byte_offset;
      run.n_elems = op.n_elems;
      run.elem_stride = op.src_elem_stride;
      run.src_item_n_bytes = static_cast<uint32_t>(op.file_id == kZeroFileId ? isz : ItemSize(op.src_dtype));
      run.dst_item_n_bytes = static_cast<uint32_t>(isz);
      sink(run);
      for (const MeanPart& part : op.mean_with) {  // an averaged run reads every copy
        if (part.file_id >= files.size()) {
          return InvalidArgumentError("file id " + std::to_string(part.file_id) + " outside the file table of " +
                                      std::to_string(files.size()));
        }
        run.file = files[part.file_id].get();
        run.byte_offset = part.byte_offset;
        run.src_item_n_bytes = static_cast<uint32_t>(ItemSize(part.dtype));
        run.dst_item_n_bytes = 0;  // averaged into the run above, which fills the view
        sink(run);
      }
    }
    lo = hi;
  }
  return Status::Ok();
}

Status ReadTensorBytes(const TensorLayout& layout, DType dst_dtype,
                       std::span<const std::shared_ptr<const ByteSource>> files,
                       uint64_t byte_offset, std::span<std::byte> out, const PlanCache* plans) {
  if (!ValidDType(dst_dtype)) return InvalidArgumentError("invalid destination dtype");
  auto numel = CheckedVolume(layout.shape);
  if (!numel) return CorruptError("bad shape " + DimsString(layout.shape));
  const uint64_t isz = ItemSize(dst_dtype);
  auto total = CheckedMul(*numel, isz);
  if (!total || !RangeInside(byte_offset, out.size(), *total)) {
    return OutOfRangeError("read of " + std::to_string(out.size()) + " bytes at offset " +
                           std::to_string(byte_offset) + " past the tensor's " +
                           (total ? std::to_string(*total) : std::string("too many")) + " bytes");
  }
  if (out.empty()) return Status::Ok();
  const uint64_t end = byte_offset + out.size();
  const uint64_t elem_lo = byte_offset / isz;
  const uint64_t elem_hi = end / isz + (end % isz != 0 ? 1 : 0);
  // Whole elements [full_lo, full_hi) land straight in `out`; a partial first or last element
  // goes through a one-element bounce buffer.
  const uint64_t full_lo = elem_lo + (byte_offset % isz != 0 ? 1 : 0);
  const uint64_t full_hi = std::max(full_lo, end / isz);
  // The cached plan's ops for [lo, hi), or PlanRead's.
  auto plan = [&](uint64_t lo, uint64_t hi) -> Result<std::vector<CopyOp>> {
    std::vector<CopyOp> ops;
    if (plans != nullptr && plans->Select(lo, hi, ops)) return ops;
    return PlanRead(layout, dst_dtype, lo, hi);
  };
  auto partial = [&](uint64_t e) -> Status {
    UCPFS_ASSIGN_OR_RETURN(auto ops, plan(e, e + 1));
    std::byte elem[kMaxItemSize];
    UCPFS_RETURN_IF_ERROR(ExecutePlan(ops, files, std::span<std::byte>(elem, isz)));
    const uint64_t lo = std::max(byte_offset, e * isz);
    const uint64_t hi = std::min(end, (e + 1) * isz);
    std::memcpy(out.data() + (lo - byte_offset), elem + (lo - e * isz), hi - lo);
    return Status::Ok();
  };
  if (full_lo > elem_lo) UCPFS_RETURN_IF_ERROR(partial(elem_lo));
  if (full_hi > full_lo) {
    UCPFS_ASSIGN_OR_RETURN(auto ops, plan(full_lo, full_hi));
    const uint64_t skip = full_lo * isz - byte_offset;
    UCPFS_RETURN_IF_ERROR(
        ExecutePlanImpl(ops, files, out.subspan(skip, (full_hi - full_lo) * isz), /*defer=*/true));
  }
  if (elem_hi > full_hi && elem_hi - 1 >= full_lo) UCPFS_RETURN_IF_ERROR(partial(elem_hi - 1));
  return Status::Ok();
}

}  // namespace ucpfs::slice
