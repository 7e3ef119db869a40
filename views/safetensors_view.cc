// See safetensors_view.h.
#include "views/safetensors_view.h"

#include <cstdio>
#include <cstring>
#include <utility>

#include "core/checked.h"
#include "core/format/safetensors.h"
#include "views/atomic.h"
#include "views/target.h"

namespace ucpfs::index {

Result<std::vector<SafetensorsViewFile>> BuildSafetensorsView(const Checkpoint& c,
                                                              const std::shared_ptr<const void>& owner,
                                                              const KeyMapping& mapping, const FileTable& files,
                                                              const PatternOptions& patterns,
                                                              uint64_t max_shard_n_bytes) {
  if (max_shard_n_bytes == 0) return InvalidArgumentError("the safetensors shard size must be at least 1 byte");
  // Each parameter's weight, else its fp32 master.
  struct Weight {
    std::string name;
    const Item* item;
  };
  std::vector<Weight> weights;
  std::vector<views::PatternParam> pattern_params;
  for (const ParamEntry& p : mapping.params) {
    int32_t idx = p.item[static_cast<int>(StateKind::kWeight)];
    if (idx < 0) idx = p.item[static_cast<int>(StateKind::kFp32)];
    if (idx < 0 || c.items[static_cast<size_t>(idx)].kind != ItemKind::kTensor) continue;
    const Item& it = c.items[static_cast<size_t>(idx)];
    weights.push_back({p.name, &it});
    pattern_params.push_back({p.name, it.layout.shape, views::ShardDim(it.layout)});
  }
  if (weights.empty()) return std::vector<SafetensorsViewFile>{};
  UCPFS_ASSIGN_OR_RETURN(views::ModelPatterns mp,
                         views::PatternsOf(pattern_params, patterns.preset, patterns.rules, patterns.vocab_size));

  std::vector<NamedSaveTensor> tensors;
  for (size_t i = 0; i < weights.size(); ++i) {
    const Item& it = *weights[i].item;
    if (format::SafetensorsDTypeName(it.dtype).empty()) {
      return UnsupportedError("safetensors view: parameter '" + weights[i].name + "' is " +
                              std::string(TorchName(it.dtype)) + ", which safetensors cannot hold");
    }
    std::vector<int64_t> shape = it.layout.shape;
    const layout::ParamPattern& pattern = mp.patterns[i];
    if (pattern.tp == layout::TpKind::kVocab && pattern.tp_dim == 0 && !shape.empty() && pattern.vocab_size > 0 &&
        pattern.vocab_size < shape[0]) {
      shape[0] = pattern.vocab_size;  // the padding rows are the last ones: a prefix stays
    }
    uint64_t n = ItemSize(it.dtype);
    for (int64_t d : shape) {
      auto m = CheckedMul(n, static_cast<uint64_t>(d));
      if (!m) return CorruptError("safetensors view: parameter '" + weights[i].name + "': size overflows");
      n = *m;
    }
    tensors.push_back({weights[i].name,
                       format::SaveTensor{it.dtype, std::move(shape),
                                          std::make_shared<views::LayoutProvider>(KeptLayout(it, owner), it.dtype,
                                                                                  files)},
                       n});
  }

  return ShardSafetensors(std::move(tensors), max_shard_n_bytes, "safetensors/");
}

Result<std::vector<SafetensorsViewFile>> ShardSafetensors(std::vector<NamedSaveTensor> tensors,
                                                          uint64_t max_shard_n_bytes, const std::string& dir) {
  // huggingface_hub's split: fill shards in order; an oversized tensor alone, before the shard
  // being filled.
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_n_bytes = 0, total_n_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n = tensors[i].n_bytes;
    total_n_bytes += n;
    if (n > max_shard_n_bytes) {
      shards.push_back({i});
      continue;
    }
    if (current_n_bytes + n > max_shard_n_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_n_bytes = 0;
    }
    current.push_back(i);
    current_n_bytes += n;
  }
  if (!current.empty()) shards.push_back(std::move(current));

  std::vector<SafetensorsViewFile> out;
  std::vector<std::pair<std::string, std::string>> weight_map;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    std::vector<std::pair<std::string, format::SaveTensor>> shard;
    for (size_t i : shards[s]) {
      weight_map.emplace_back(tensors[i].name, name);
      shard.emplace_back(tensors[i].name, tensors[i].tensor);
    }
    UCPFS_ASSIGN_OR_RETURN(auto file, format::LazySafetensorsFile::Build(std::move(shard), {{"format", "pt"}},
                                                                         dir + name));
    out.push_back({name, std::move(file)});
  }
  std::string index = format::SafetensorsIndexJson(total_n_bytes, weight_map);
  std::vector<std::byte> bytes(index.size());
  std::memcpy(bytes.data(), index.data(), index.size());
  out.push_back({"model.safetensors.index.json",
                 std::make_shared<MemorySource>(dir + "model.safetensors.index.json", std::move(bytes))});
  return out;
}

}  // namespace ucpfs::index
