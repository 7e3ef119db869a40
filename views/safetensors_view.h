// The consolidated safetensors view: the source's model weights as Hugging Face's
// save_pretrained lays them out, `model-0000K-of-0000N.safetensors` shards plus
// `model.safetensors.index.json`, computed lazily like every other view (headers now, tensor
// bytes gathered from the source fragments on read; memory: the headers).
//
// - Tensors: every mapped parameter's weight (its fp32 master when the source has no weight),
//   global, in the source dtype, named by the parameter's fqn, in parameter order. A vocabulary
//   parameter whose source records its unpadded vocabulary (views::PatternsOf) loses its padding
//   rows.
// - Shards: huggingface_hub's split_torch_state_dict_into_shards rule: tensors in order fill a
//   shard until the next one would pass `max_shard_n_bytes`; a tensor larger than that gets a
//   shard of its own (placed before the shard being filled). Each shard is exactly what
//   `safetensors.torch.save_file(shard, path, metadata={"format": "pt"})` writes.
//
// Not for: renaming to another framework's names (the names are the source's).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/status.h"
#include "index/checkpoint.h"
#include "index/key_map.h"
#include "views/view_inputs.h"

namespace ucpfs::index {

// Hugging Face's default max_shard_size ("5GB", decimal).
inline constexpr uint64_t kDefaultSafetensorsShardBytes = 5'000'000'000;

struct SafetensorsViewFile {
  std::string name;  // "model-00001-of-00002.safetensors", "model.safetensors.index.json"
  std::shared_ptr<const ByteSource> source;
};

// One tensor of a sharded safetensors folder, with its size in bytes.
struct NamedSaveTensor {
  std::string name;
  format::SaveTensor tensor;
  uint64_t n_bytes = 0;
};

// `tensors`, in order, as huggingface_hub's split lays them into shards (see above):
// `model-0000K-of-0000N.safetensors` then `model.safetensors.index.json`; `dir` prefixes the
// files' names in errors ("safetensors/", "hf/"). Shared by safetensors/ and hf/ (hf_view.h).
// Errors: LazySafetensorsFile::Build's.
Result<std::vector<SafetensorsViewFile>> ShardSafetensors(std::vector<NamedSaveTensor> tensors,
                                                          uint64_t max_shard_n_bytes, const std::string& dir);

// The view's files, shards first, the index last; empty when the source has no weight. The
// shards keep `checkpoint`'s tensor layouts (KeptLayout, `owner`).
// Errors: kInvalidArgument when max_shard_n_bytes is 0 or a name safetensors cannot hold (not
// UTF-8, "__metadata__"); a dtype safetensors cannot hold (kUnsupported naming the parameter);
// views::PatternsOf's. The mount serves no safetensors/ then, and says why in status.json.
Result<std::vector<SafetensorsViewFile>> BuildSafetensorsView(const Checkpoint& checkpoint,
                                                              const std::shared_ptr<const void>& owner,
                                                              const KeyMapping& mapping, const FileTable& files,
                                                              const PatternOptions& patterns,
                                                              uint64_t max_shard_n_bytes);

}  // namespace ucpfs::index
