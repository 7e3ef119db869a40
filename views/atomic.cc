#include "views/atomic.h"

#include <set>

namespace ucpfs::views {

std::string AtomicDirName(const std::string& fqn) {
  std::string out;
  for (char c : fqn) {
    if (c == '/') out += "%2F";
    else if (c == '%') out += "%25";
    else if (c == '\0') out += "%00";
    else out += c;
  }
  if (out.empty()) return "%00empty";
  if (out == ".") return "%2E";
  if (out == "..") return "%2E%2E";
  constexpr size_t kNameMax = 255;
  if (out.size() > kNameMax) {
    // Deterministic: a prefix, then '~' and the FNV-1a 64 hash of the whole name in hex.
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : fqn) {
      h ^= c;
      h *= 1099511628211ull;
    }
    static const char kHex[] = "0123456789abcdef";
    std::string tail = "~";
    for (int i = 60; i >= 0; i -= 4) tail += kHex[(h >> i) & 0xF];
    out = out.substr(0, kNameMax - tail.size()) + tail;
  }
  return out;
}


namespace {

// Dims along which the fragments' boxes do not span the whole shape.
std::set<int> SplitDims(const slice::TensorLayout& layout) {
  std::set<int> dims;
  for (const auto& f : layout.fragments) {
    for (size_t d = 0; d < f.box.sizes.size() && d < layout.shape.size(); ++d) {
      if (f.box.offsets[d] != 0 || f.box.sizes[d] != layout.shape[d]) dims.insert(static_cast<int>(d));
    }
  }
  return dims;
}

bool HasFlatRanges(const slice::TensorLayout& layout) {
  for (const auto& f : layout.fragments) {
    if (f.flat_lo != 0 || f.flat_hi != f.box.Volume()) return true;
  }
  return false;
}

}  // namespace

std::optional<int> ShardDim(const slice::TensorLayout& layout) {
  auto dims = SplitDims(layout);
  if (dims.size() == 1) return *dims.begin();
  return std::nullopt;
}

std::string DescribePattern(const slice::TensorLayout& layout) {
  if (layout.NumElems() == 0) return "empty";
  std::string flat = HasFlatRanges(layout) ? "+flat" : "";
  auto dims = SplitDims(layout);
  if (dims.empty()) return layout.fragments.size() <= 1 ? "unique" + flat : "flat";
  std::string s = dims.size() == 1 ? "shard(dim=" : "shard(dims=";
  bool first = true;
  for (int d : dims) {
    s += (first ? "" : ",") + std::to_string(d);
    first = false;
  }
  return s + ")" + flat;
}

AtomicPattern AtomicPatternOf(const layout::ParamPattern& pattern) {
  AtomicPattern p;
  switch (pattern.tp) {
    case layout::TpKind::kVocab:
      p.vocab_tensor = true;
      [[fallthrough]];
    case layout::TpKind::kColumn:
    case layout::TpKind::kRow:
      if (pattern.tp_dim >= 0) p.cat_dim = pattern.tp_dim;
      break;
    case layout::TpKind::kReplicate:
    case layout::TpKind::kPartial:
      break;
  }
  return p;
}

Status LayoutProvider::Read(uint64_t byte_offset, std::span<std::byte> out) const {
  return slice::ReadTensorBytes(*layout_, dst_dtype_, *files_, byte_offset, out,
                                LegacyReadPath() ? nullptr : &plans_);
}

Status CheckAtomicDtypes(const slice::TensorLayout& layout, const std::string& name) {
  for (const auto& f : layout.fragments) {
    if (!slice::CanConvert(f.dtype, DType::kFloat32)) {
      return UnsupportedError(name + ": cannot convert stored " + std::string(TorchName(f.dtype)) +
                              " to float32");
    }
  }
  return Status::Ok();
}

Result<std::shared_ptr<format::LazyTorchFile>> BuildAtomicFile(
    std::shared_ptr<const slice::TensorLayout> layout, const AtomicPattern& pattern,
    std::shared_ptr<const std::vector<std::shared_ptr<const ByteSource>>> files, std::string name) {
  UCPFS_RETURN_IF_ERROR(CheckAtomicDtypes(*layout, name));
  format::SaveValue root = format::SaveValue::Dict();
  if (pattern.cat_dim) root.Set("cat_dim", format::SaveValue::Int(*pattern.cat_dim));
  if (pattern.vocab_tensor) root.Set("vocab_tensor", format::SaveValue::Bool(true));
  std::vector<int64_t> shape = layout->shape;
  auto provider = std::make_shared<LayoutProvider>(std::move(layout), DType::kFloat32, std::move(files));
  root.Set("param", format::SaveValue::Tensor(DType::kFloat32, std::move(shape), std::move(provider)));
  // No floats in the object: loads with weights_only=True on torch 1.13 and >= 2.6.
  format::SaveOptions options;
  options.allow_floats = false;
  return format::LazyTorchFile::Build(root, std::move(name), options);
}

}  // namespace ucpfs::views
