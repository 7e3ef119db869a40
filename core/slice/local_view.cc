// Local views (see local_view.h).
//
// Everything here is a rewrite of fragment lists: no element is touched. The one piece of
// arithmetic that matters is the byte offset of a sub-box's first element: once a fragment is
// normalized (plain box, explicit strides), the element at box-local index i is stored at
// byte_offset + Σ i[d]·strides[d]·itemsize, so any sub-box inherits the strides and only moves
// its byte_offset. Flat ranges are stored 1-D contiguous, which is exactly row-major strides of
// their parent box offset by -flat_lo elements.
#include "core/slice/local_view.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "core/checked.h"

namespace ucpfs::slice {
namespace {

constexpr uint64_t kMaxI64 = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

std::string Dims(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

std::string BoxStr(const Box& b) { return "offsets " + Dims(b.offsets) + " sizes " + Dims(b.sizes); }

// Product of sizes; nullopt when a size is negative or the product overflows.
std::optional<uint64_t> Volume(const std::vector<int64_t>& sizes) {
  uint64_t v = 1;
  for (int64_t s : sizes) {
    if (s < 0) return std::nullopt;
  }
  for (int64_t s : sizes) {
    if (s == 0) return 0;
  }
  for (int64_t s : sizes) {
    auto m = CheckedMul(v, static_cast<uint64_t>(s));
    if (!m) return std::nullopt;
    v = *m;
  }
  return v;
}

// Row-major strides of sizes whose volume is at most kMaxI64 (so every stride fits int64).
std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> st(sizes.size(), 1);
  for (size_t d = sizes.size(); d-- > 1;) st[d - 1] = st[d] * std::max<int64_t>(sizes[d], 1);
  return st;
}

// Appends the boxes of positions [lo, hi) (lo < hi) of the sub-box of dims [d, r), whose
// volume per index of dim d is inner[d]; `prefix` holds the fixed indices of dims [0, d).
// A range aligned to whole slabs of dim d is one box; otherwise a ragged head (ending on a
// slab boundary) and a ragged tail (starting on one) recurse one dim deeper around at most one
// box of full slabs. A head's or tail's recursion again has one aligned end, so it adds at most
// one box per dim: 1 + 2·(r−1−d) boxes in all.
void Decompose(const std::vector<int64_t>& sizes, const std::vector<uint64_t>& inner, size_t d,
               std::vector<int64_t>& prefix, uint64_t lo, uint64_t hi, std::vector<Box>* out) {
  const size_t r = sizes.size();
  const uint64_t w = inner[d];
  auto slab = [&](uint64_t a, uint64_t b) {  // full slabs [a, b) of dim d
    Box box;
    box.offsets = prefix;
    box.sizes.assign(prefix.size(), 1);
    box.offsets.push_back(static_cast<int64_t>(a));
    box.sizes.push_back(static_cast<int64_t>(b - a));
    for (size_t e = d + 1; e < r; ++e) {
      box.offsets.push_back(0);
      box.sizes.push_back(sizes[e]);
    }
    out->push_back(std::move(box));
  };
  auto deeper = [&](uint64_t index, uint64_t sub_lo, uint64_t sub_hi) {
    prefix.push_back(static_cast<int64_t>(index));
    Decompose(sizes, inner, d + 1, prefix, sub_lo, sub_hi, out);
    prefix.pop_back();
  };
  uint64_t a = lo / w;
  const uint64_t b = hi / w;
  if (lo % w == 0 && hi % w == 0) {
    slab(a, b);
    return;
  }
  if (a == b) {  // inside one slab (and not aligned, so d + 1 < r)
    deeper(a, lo - a * w, hi - a * w);
    return;
  }
  if (lo % w != 0) {
    deeper(a, lo - a * w, w);
    ++a;
  }
  if (b > a) slab(a, b);
  if (hi % w != 0) deeper(b, 0, hi - b * w);
}

}  // namespace

std::vector<Box> FlatRangeToBoxes(const std::vector<int64_t>& box_sizes, uint64_t lo, uint64_t hi) {
  std::vector<Box> out;
  auto vol = Volume(box_sizes);
  if (!vol || lo >= hi || hi > *vol) return out;
  if (box_sizes.empty()) {  // 0-d: one element, [0, 1)
    out.push_back(Box{});
    return out;
  }
  // inner[d] = volume of dims (d, r): no overflow, it divides the checked volume.
  std::vector<uint64_t> inner(box_sizes.size(), 1);
  for (size_t d = box_sizes.size(); d-- > 1;) {
    inner[d - 1] = inner[d] * static_cast<uint64_t>(box_sizes[d]);
  }
  std::vector<int64_t> prefix;
  Decompose(box_sizes, inner, 0, prefix, lo, hi, &out);
  return out;
}

Result<TensorLayout> NormalizeFragments(const TensorLayout& layout) {
  const auto& shape = layout.shape;
  const size_t r = shape.size();
  if (!Volume(shape)) return CorruptError("bad shape " + Dims(shape));
  TensorLayout res;
  res.shape = shape;
  res.fragments.reserve(layout.fragments.size());
  for (size_t i = 0; i < layout.fragments.size(); ++i) {
    const Fragment& f = layout.fragments[i];
    auto fail = [&](const std::string& why) {
      return CorruptError("fragment " + std::to_string(i) + " (box " + BoxStr(f.box) + "): " + why);
    };
    if (f.box.offsets.size() != r || f.box.sizes.size() != r) {
      return fail("rank does not match shape " + Dims(shape));
    }
    if (static_cast<int>(f.dtype) >= kNumDTypes) return fail("invalid dtype");
    for (size_t d = 0; d < r; ++d) {
      if (f.box.offsets[d] < 0 || f.box.sizes[d] < 0 || f.box.offsets[d] > shape[d] - f.box.sizes[d]) {
        return fail("box outside shape " + Dims(shape));
      }
    }
    const uint64_t v = *Volume(f.box.sizes);  // inside a shape whose volume fits
    if (v > kMaxI64) return fail("box too large");
    if (f.flat_lo > f.flat_hi || f.flat_hi > v) {
      return fail("flat range [" + std::to_string(f.flat_lo) + ", " + std::to_string(f.flat_hi) +
                  ") outside the box's " + std::to_string(v) + " elements");
    }
    if (!f.strides.empty()) {
      if (f.strides.size() != r) return fail("strides " + Dims(f.strides) + " of wrong rank");
      for (int64_t s : f.strides) {
        if (s < 0) return fail("negative stride in " + Dims(f.strides));
      }
    }
    if (f.flat_lo == f.flat_hi) continue;  // holds nothing
    const uint64_t isz = ItemSize(f.dtype);
    const std::vector<int64_t> rm = RowMajorStrides(f.box.sizes);
    const bool restricted = f.flat_lo != 0 || f.flat_hi != v;
    if (!restricted) {
      Fragment g = f;
      if (g.strides.empty()) g.strides = rm;
      // The stored extent must fit: byte_offset + (max element + 1) · itemsize.
      uint64_t max_elem = 0;
      for (size_t d = 0; d < r; ++d) {
        auto t = CheckedMul(static_cast<uint64_t>(f.box.sizes[d] - 1), static_cast<uint64_t>(g.strides[d]));
        auto sum = t ? CheckedAdd(max_elem, *t) : std::nullopt;
        if (!sum) return fail("stored extent overflows");
        max_elem = *sum;
      }
      auto n_bytes = CheckedMul(max_elem + 1, isz);
      if (!n_bytes || !CheckedAdd(f.byte_offset, *n_bytes)) return fail("stored extent overflows");
      res.fragments.push_back(std::move(g));
      continue;
    }
    if (!f.strides.empty()) {
      for (size_t d = 0; d < r; ++d) {
        if (f.box.sizes[d] != 1 && f.strides[d] != rm[d]) {
          return fail("flat range over non-row-major strides " + Dims(f.strides));
        }
      }
    }
    auto n_bytes = CheckedMul(f.flat_hi - f.flat_lo, isz);
    if (!n_bytes || !CheckedAdd(f.byte_offset, *n_bytes)) return fail("stored extent overflows");
    for (Box& b : FlatRangeToBoxes(f.box.sizes, f.flat_lo, f.flat_hi)) {
      // Position of the sub-box's first element in the parent box; stored at pos - flat_lo.
      uint64_t pos = 0;
      for (size_t d = 0; d < r; ++d) pos += static_cast<uint64_t>(b.offsets[d]) * static_cast<uint64_t>(rm[d]);
      Fragment g;
      g.box.offsets.resize(r);
      for (size_t d = 0; d < r; ++d) g.box.offsets[d] = f.box.offsets[d] + b.offsets[d];
      g.box.sizes = std::move(b.sizes);
      g.flat_lo = 0;
      g.flat_hi = g.box.Volume();
      g.file_id = f.file_id;
      g.byte_offset = f.byte_offset + (pos - f.flat_lo) * isz;  // inside the checked extent
      g.dtype = f.dtype;
      g.strides = rm;
      g.mean_with = f.mean_with;
      ShiftMeanParts(g.mean_with, pos - f.flat_lo);
      res.fragments.push_back(std::move(g));
    }
  }
  return res;
}

Result<TensorLayout> LocalLayout(const TensorLayout& global, const std::vector<int64_t>& local_shape,
                                 int cat_dim, const std::vector<Box>& pieces) {
  const size_t r = global.shape.size();
  if (local_shape.size() != r) {
    return InvalidArgumentError("local shape " + Dims(local_shape) + " has rank " +
                                std::to_string(local_shape.size()) + ", global shape " +
                                Dims(global.shape) + " has rank " + std::to_string(r));
  }
  if (!Volume(local_shape)) return InvalidArgumentError("bad local shape " + Dims(local_shape));
  UCPFS_ASSIGN_OR_RETURN(TensorLayout norm, NormalizeFragments(global));
  if (r == 0) {
    if (pieces.size() != 1 || !pieces[0].offsets.empty() || !pieces[0].sizes.empty()) {
      return InvalidArgumentError("a 0-d tensor takes exactly one piece with no dims, got " +
                                  std::to_string(pieces.size()) + " pieces");
    }
    return norm;
  }
  if (cat_dim < 0 || static_cast<size_t>(cat_dim) >= r) {
    return InvalidArgumentError("cat_dim " + std::to_string(cat_dim) + " out of range for rank " +
                                std::to_string(r));
  }
  const size_t cd = static_cast<size_t>(cat_dim);
  // Checks the pieces and places them along cat_dim.
  std::vector<int64_t> position(pieces.size());
  uint64_t filled = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const Box& p = pieces[k];
    const std::string which = "piece " + std::to_string(k) + " (" + BoxStr(p) + ")";
    if (p.offsets.size() != r || p.sizes.size() != r) {
      return InvalidArgumentError(which + ": rank does not match global shape " + Dims(global.shape));
    }
    for (size_t d = 0; d < r; ++d) {
      if (p.offsets[d] < 0 || p.sizes[d] < 0 || p.offsets[d] > global.shape[d] - p.sizes[d]) {
        return InvalidArgumentError(which + ": outside global shape " + Dims(global.shape));
      }
      if (d != cd && p.sizes[d] != local_shape[d]) {
        return InvalidArgumentError(which + ": extent " + std::to_string(p.sizes[d]) + " in dim " +
                                    std::to_string(d) + " does not match local shape " +
                                    Dims(local_shape));
      }
    }
    position[k] = static_cast<int64_t>(filled);
    filled += static_cast<uint64_t>(p.sizes[cd]);  // each at most a global dim: no overflow
    if (filled > static_cast<uint64_t>(local_shape[cd])) {
      return InvalidArgumentError("pieces 0.." + std::to_string(k) + " span " + std::to_string(filled) +
                                  " along dim " + std::to_string(cd) + ", more than local shape " +
                                  Dims(local_shape));
    }
  }
  TensorLayout res;
  res.shape = local_shape;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const Box& p = pieces[k];
    for (const Fragment& f : norm.fragments) {
      Box in;
      if (!Intersect(f.box, p, &in)) continue;
      Fragment g;
      g.box.sizes = in.sizes;
      g.box.offsets.resize(r);
      uint64_t skip_elems = 0;  // stored elements between f's first element and in's
      for (size_t d = 0; d < r; ++d) {
        g.box.offsets[d] = in.offsets[d] - p.offsets[d] + (d == cd ? position[k] : 0);
        skip_elems += static_cast<uint64_t>(in.offsets[d] - f.box.offsets[d]) *
                      static_cast<uint64_t>(f.strides[d]);  // inside f's checked extent
      }
      g.flat_lo = 0;
      g.flat_hi = g.box.Volume();
      g.file_id = f.file_id;
      g.byte_offset = f.byte_offset + skip_elems * ItemSize(f.dtype);
      g.dtype = f.dtype;
      g.strides = f.strides;
      g.mean_with = f.mean_with;
      ShiftMeanParts(g.mean_with, skip_elems);
      res.fragments.push_back(std::move(g));
    }
  }
  if (filled < static_cast<uint64_t>(local_shape[cd])) {
    // Zero padding at the end of cat_dim; its dtype is irrelevant (zeros convert to anything).
    Fragment pad;
    pad.box.offsets.assign(r, 0);
    pad.box.offsets[cd] = static_cast<int64_t>(filled);
    pad.box.sizes = local_shape;
    pad.box.sizes[cd] = local_shape[cd] - static_cast<int64_t>(filled);
    pad.flat_lo = 0;
    pad.flat_hi = pad.box.Volume();
    pad.file_id = kZeroFileId;
    pad.dtype = norm.fragments.empty() ? DType::kFloat32 : norm.fragments.front().dtype;
    res.fragments.push_back(std::move(pad));
  }
  return res;
}

namespace {

// The walk ReadConcatBytes and DescribeConcatBytes share: checks the arguments, then calls
// part(k, byte offset in part k, n_bytes, byte offset in the window) for each part the window
// [byte_offset, byte_offset + n_bytes) overlaps, in order, and pad(byte offset in the window,
// n_bytes) for the trailing zeros it overlaps. Stops at the first error of `part`.
template <typename PartFn, typename PadFn>
Status WalkConcat(const std::vector<const TensorLayout*>& parts, DType dst, uint64_t padded_n_elems,
                  uint64_t byte_offset, uint64_t n_bytes, PartFn part, PadFn pad) {
  if (static_cast<int>(dst) >= kNumDTypes) return InvalidArgumentError("invalid destination dtype");
  const uint64_t isz = ItemSize(dst);
  uint64_t n_elems = 0;
  std::vector<uint64_t> part_n(parts.size());
  for (size_t k = 0; k < parts.size(); ++k) {
    if (parts[k] == nullptr) return InvalidArgumentError("part " + std::to_string(k) + " is null");
    auto v = Volume(parts[k]->shape);
    auto sum = v ? CheckedAdd(n_elems, *v) : std::nullopt;
    if (!sum) return InvalidArgumentError("part " + std::to_string(k) + ": bad shape " + Dims(parts[k]->shape));
    part_n[k] = *v;
    n_elems = *sum;
  }
  if (padded_n_elems < n_elems) {
    return InvalidArgumentError("padded size " + std::to_string(padded_n_elems) +
                                " elements is smaller than the parts' " + std::to_string(n_elems));
  }
  auto total = CheckedMul(padded_n_elems, isz);
  if (!total || !RangeInside(byte_offset, n_bytes, *total)) {
    return OutOfRangeError("read of " + std::to_string(n_bytes) + " bytes at offset " +
                           std::to_string(byte_offset) + " past the concatenation's " +
                           (total ? std::to_string(*total) : std::string("too many")) + " bytes");
  }
  const uint64_t end = byte_offset + n_bytes;
  uint64_t part_lo = 0;  // byte offset of part k in the concatenation
  for (size_t k = 0; k < parts.size() && part_lo < end; ++k) {
    const uint64_t part_hi = part_lo + part_n[k] * isz;  // <= total: no overflow
    const uint64_t lo = std::max(part_lo, byte_offset), hi = std::min(part_hi, end);
    if (lo < hi) {
      Status s = part(k, lo - part_lo, hi - lo, lo - byte_offset);
      if (!s.ok()) return s.WithContext("part " + std::to_string(k));
    }
    part_lo = part_hi;
  }
  // Trailing padding.
  const uint64_t pad_lo = std::max(n_elems * isz, byte_offset);
  if (pad_lo < end) pad(pad_lo - byte_offset, end - pad_lo);
  return Status::Ok();
}

}  // namespace

Status ReadConcatBytes(const std::vector<const TensorLayout*>& parts, DType dst,
                       uint64_t padded_n_elems,
                       std::span<const std::shared_ptr<const ByteSource>> files,
                       uint64_t byte_offset, std::span<std::byte> out) {
  return WalkConcat(
      parts, dst, padded_n_elems, byte_offset, out.size(),
      [&](size_t k, uint64_t part_offset, uint64_t n, uint64_t out_offset) {
        return ReadTensorBytes(*parts[k], dst, files, part_offset, out.subspan(out_offset, n));
      },
      [&](uint64_t out_offset, uint64_t n) { std::memset(out.data() + out_offset, 0, n); });
}

Status DescribeConcatReads(const std::vector<const TensorLayout*>& parts, DType dst, uint64_t padded_n_elems,
                           std::span<const std::shared_ptr<const ByteSource>> files, uint64_t byte_offset,
                           uint64_t n_bytes, const SourceRunSink& sink) {
  return WalkConcat(
      parts, dst, padded_n_elems, byte_offset, n_bytes,
      [&](size_t k, uint64_t part_offset, uint64_t n, uint64_t) {
        return DescribeTensorReads(*parts[k], dst, files, part_offset, n, sink);
      },
      [&](uint64_t, uint64_t n) { sink(SourceRun{nullptr, 0, n, 1, 1, 1}); });  // in bytes: exact
}

void PrefetchConcatBytes(const std::vector<const TensorLayout*>& parts, DType dst, uint64_t padded_n_elems,
                         std::span<const std::shared_ptr<const ByteSource>> files, uint64_t byte_offset,
                         uint64_t n_bytes) {
  (void)WalkConcat(
      parts, dst, padded_n_elems, byte_offset, n_bytes,
      [&](size_t k, uint64_t part_offset, uint64_t n, uint64_t) {
        PrefetchTensorBytes(*parts[k], dst, files, part_offset, n);
        return Status::Ok();
      },
      [](uint64_t, uint64_t) {});
}

Status ReadBoxBytes(const TensorLayout& global, const Box& box, DType dst,
                    std::span<const std::shared_ptr<const ByteSource>> files, std::span<std::byte> out) {
  if (box.offsets.size() != global.shape.size() || box.sizes.size() != global.shape.size()) {
    return InvalidArgumentError("box " + BoxStr(box) + " does not have the rank of shape " + Dims(global.shape));
  }
  std::optional<uint64_t> n_bytes = ItemSize(dst);
  for (int64_t s : box.sizes) {
    if (s < 0) return InvalidArgumentError("box " + BoxStr(box) + " has a negative size");
    if (n_bytes) n_bytes = CheckedMul(*n_bytes, static_cast<uint64_t>(s));
  }
  if (!n_bytes || *n_bytes != out.size()) {
    return InvalidArgumentError("box " + BoxStr(box) + " of " + std::string(TorchName(dst)) + " does not fill " +
                                std::to_string(out.size()) + " bytes");
  }
  if (out.empty()) return Status::Ok();
  // One piece spanning the whole local shape: the box in its own coordinates, holding only the
  // parts of the source fragments inside it (LocalLayout checks it lies inside the shape).
  UCPFS_ASSIGN_OR_RETURN(TensorLayout local, LocalLayout(global, box.sizes, 0, {box}));
  return ReadTensorBytes(local, dst, files, 0, out);
}

}  // namespace ucpfs::slice
