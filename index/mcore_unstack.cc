// Splitting Megatron-Core's layer-stacked tensors (see mcore_unstack.h).
#include "index/mcore_unstack.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "core/checked.h"
#include "core/dtype.h"
#include "index/checkpoint_builder.h"

namespace ucpfs::index {
namespace {

// Cap on the indices one stacked tensor expands to (layers x experts).
constexpr uint64_t kMaxSplitItems = uint64_t{1} << 20;

std::vector<std::string> Components(const std::string& key) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t dot = key.find('.', start);
    out.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) return out;
    start = dot + 1;
  }
}

bool IsNumber(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// SequentialMLP (0.16) saves its local_experts.<j> as `experts.experts.` with an expert axis.
bool IsExpertsOfExperts(const std::vector<std::string>& parts, size_t i) {
  return parts[i] == "experts" && i > 0 && parts[i - 1] == "experts";
}

bool IsStackedAt(const std::vector<std::string>& parts, size_t i) {
  return (parts[i] == "layers" || parts[i] == "local_experts" || IsExpertsOfExperts(parts, i)) &&
         i + 1 < parts.size() && !IsNumber(parts[i + 1]);
}

// Row-major element strides of `sizes`.
std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> s(sizes.size(), 1);
  for (size_t i = sizes.size(); i-- > 1;) s[i - 1] = s[i] * sizes[i];
  return s;
}

// Each index tuple of the `k` leading dims of `sizes`, in row-major order.
std::vector<std::vector<int64_t>> Tuples(const std::vector<int64_t>& sizes, size_t k) {
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> t(k, 0);
  for (size_t i = 0; i < k; ++i) {
    if (sizes[i] == 0) return out;
  }
  while (true) {
    out.push_back(t);
    size_t d = k;
    while (d > 0) {
      if (++t[d - 1] < sizes[d - 1]) break;
      t[d - 1] = 0;
      --d;
    }
    if (d == 0) return out;
  }
}

// The fragments of `item` per index of its `k` stacked axes, each without those axes.
Result<std::map<std::vector<int64_t>, std::vector<slice::Fragment>>> SplitFragments(const Item& item, size_t k) {
  std::map<std::vector<int64_t>, std::vector<slice::Fragment>> out;
  for (const slice::Fragment& f : item.layout.fragments) {
    const std::vector<int64_t>& sizes = f.box.sizes;
    const bool single = std::all_of(sizes.begin(), sizes.begin() + static_cast<std::ptrdiff_t>(k),
                                    [](int64_t s) { return s == 1; });
    const uint64_t volume = f.box.Volume();
    if (!single && (f.flat_lo != 0 || f.flat_hi != volume)) {
      return UnsupportedError("tensor '" + item.key + "': a flattened-range chunk at offsets " +
                              JoinInts(f.box.offsets) + " spans several stacked layers/experts (sizes " +
                              JoinInts(sizes) + ")");
    }
    const std::vector<int64_t> strides = f.strides.empty() ? RowMajorStrides(sizes) : f.strides;
    for (const std::vector<int64_t>& t : Tuples(sizes, k)) {
      slice::Fragment sub = f;
      int64_t elem_offset = 0;
      std::vector<int64_t> index(k);
      for (size_t i = 0; i < k; ++i) {
        elem_offset += t[i] * strides[i];
        index[i] = f.box.offsets[i] + t[i];
      }
      sub.box.offsets.erase(sub.box.offsets.begin(), sub.box.offsets.begin() + static_cast<std::ptrdiff_t>(k));
      sub.box.sizes.erase(sub.box.sizes.begin(), sub.box.sizes.begin() + static_cast<std::ptrdiff_t>(k));
      if (!f.strides.empty()) {
        sub.strides.erase(sub.strides.begin(), sub.strides.begin() + static_cast<std::ptrdiff_t>(k));
      }
      if (!single) {
        // A whole box: each index is a whole sub-box, elem_offset elements further on.
        auto bytes = CheckedMul(static_cast<uint64_t>(elem_offset), ItemSize(f.dtype));
        auto at = bytes ? CheckedAdd(f.byte_offset, *bytes) : std::nullopt;
        if (!at) return CorruptError("tensor '" + item.key + "': fragment offset overflows");
        sub.byte_offset = *at;
        sub.flat_lo = 0;
        sub.flat_hi = sub.box.Volume();
      }
      out[index].push_back(std::move(sub));
    }
  }
  return out;
}

}  // namespace

int StackedAxes(const std::string& key) {
  const std::vector<std::string> parts = Components(key);
  int n = 0;
  for (size_t i = 0; i < parts.size(); ++i) n += IsStackedAt(parts, i) ? 1 : 0;
  return n;
}

std::string UnstackedKey(const std::string& key, const std::vector<int64_t>& index) {
  const std::vector<std::string> parts = Components(key);
  std::string out;
  size_t next = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool stacked = IsStackedAt(parts, i) && next < index.size();
    out += (i ? "." : "") + (stacked && IsExpertsOfExperts(parts, i) ? std::string("local_experts") : parts[i]);
    if (stacked) out += "." + std::to_string(index[next++]);
  }
  return out;
}

Result<std::vector<Item>> UnstackMegatronItems(std::vector<Item> items) {
  std::vector<Item> out;
  out.reserve(items.size());
  // A run of consecutive stacked items, split, before it is ordered index by index.
  std::vector<std::pair<std::vector<int64_t>, Item>> run;
  std::vector<Item> deferred;
  auto flush = [&]() {
    std::stable_sort(run.begin(), run.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& r : run) out.push_back(std::move(r.second));
    for (Item& d : deferred) out.push_back(std::move(d));
    run.clear();
    deferred.clear();
  };
  for (Item& item : items) {
    const size_t k = item.kind == ItemKind::kTensor ? static_cast<size_t>(StackedAxes(item.key)) : 0;
    if (item.kind == ItemKind::kBytes && !run.empty()) {
      // Byte items (e.g. each layer's _extra_state) follow the run instead of cutting it.
      deferred.push_back(std::move(item));
      continue;
    }
    if (k == 0 || item.layout.shape.size() <= k) {
      flush();
      out.push_back(std::move(item));
      continue;
    }
    uint64_t n_split = 1;
    for (size_t i = 0; i < k; ++i) {
      auto n = CheckedMul(n_split, static_cast<uint64_t>(item.layout.shape[i]));
      if (!n || *n > kMaxSplitItems) {
        return UnsupportedError("tensor '" + item.key + "': stacked axes " + JoinInts(item.layout.shape) +
                                " expand to too many tensors");
      }
      n_split = *n;
    }
    UCPFS_ASSIGN_OR_RETURN(auto parts, SplitFragments(item, k));
    const std::vector<int64_t> rest(item.layout.shape.begin() + static_cast<std::ptrdiff_t>(k), item.layout.shape.end());
    for (const std::vector<int64_t>& index : Tuples(item.layout.shape, k)) {
      Item one;
      one.key = UnstackedKey(item.key, index);
      one.kind = ItemKind::kTensor;
      one.dtype = item.dtype;
      one.layout.shape = rest;
      if (auto it = parts.find(index); it != parts.end()) one.layout.fragments = std::move(it->second);
      run.emplace_back(index, std::move(one));
    }
  }
  flush();
  std::set<std::string> keys;
  for (const Item& item : out) {
    if (!keys.insert(item.key).second) {
      return CorruptError("key '" + item.key + "' is both saved and the split of a layer-stacked tensor");
    }
  }
  return out;
}

}  // namespace ucpfs::index
