// See weights_scan.h.
#include "index/weights_scan.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "core/format/safetensors.h"
#include "core/format/torch_file.h"
#include "index/checkpoint_builder.h"

namespace ucpfs::index {
namespace {

constexpr std::string_view kSafetensorsIndex = "model.safetensors.index.json";
constexpr std::string_view kTorchIndex = "pytorch_model.bin.index.json";
constexpr std::string_view kPytorchModel = "pytorch_model.bin";
constexpr uint64_t kMaxIndexBytes = 256ull << 20;
constexpr size_t kMaxListedNames = 100000;

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool IsTorchName(std::string_view name) {
  return EndsWith(name, ".pt") || EndsWith(name, ".pth") || EndsWith(name, ".bin");
}

}  // namespace

std::vector<std::string> RegularFileNames(const SourceTree& tree, const std::string& rel_dir) {
  std::vector<std::string> names;  // sorted, as List gives them
  Result<std::vector<TreeEntry>> entries = tree.List(rel_dir);
  if (!entries.ok()) return names;
  for (const TreeEntry& e : *entries) {
    const std::string& name = e.name;
    if (name.empty() || name[0] == '.' || name.size() > 255) continue;
    if (e.kind != EntryKind::kFile) continue;
    names.push_back(name);
    if (names.size() >= kMaxListedNames) break;
  }
  return names;
}

namespace {

struct Listing {
  bool safetensors_index = false;
  bool torch_index = false;
  bool pytorch_model = false;  // pytorch_model.bin
  std::vector<std::string> safetensors;  // *.safetensors
  std::vector<std::string> torch;        // *.pt, *.pth, *.bin
};

Listing ListWeights(const SourceTree& tree, const std::string& rel_dir) {
  Listing l;
  for (const std::string& name : RegularFileNames(tree, rel_dir)) {
    if (name == kSafetensorsIndex) l.safetensors_index = true;
    else if (name == kTorchIndex) l.torch_index = true;
    else if (EndsWith(name, ".safetensors")) l.safetensors.push_back(name);
    else if (IsTorchName(name)) {
      l.torch.push_back(name);
      l.pytorch_model = l.pytorch_model || name == kPytorchModel;
    }
  }
  return l;
}

class WeightsScan {
 public:
  WeightsScan(CheckpointBuilder& builder, const WeightsOptions& options) : builder_(builder), options_(options) {}

  Result<WeightsFound> Run(const ScanProgress& progress) {
    progress_ = progress;
    const std::string dir = options_.sub_dir.empty() ? builder_.dir() : builder_.dir() + "/" + options_.sub_dir;
    Listing l = ListWeights(builder_.tree(), options_.sub_dir);
    std::erase_if(l.torch, [&](const std::string& n) { return options_.exclude.count(n) != 0; });
    l.pytorch_model = std::find(l.torch.begin(), l.torch.end(), std::string(kPytorchModel)) != l.torch.end();
    // A .bin/.pt/.pth file that does not begin as a torch.save file (a zip or the legacy format)
    // is some other program's data, not weights: left out, and named when nothing else is found.
    // Looked at only where it matters: several candidates (which count), or the one that fails.
    std::vector<std::string> not_torch;
    if (!l.safetensors_index && l.safetensors.empty() && !l.torch_index && !l.pytorch_model && l.torch.size() > 1) {
      std::erase_if(l.torch, [&](const std::string& n) {
        if (!NotTorch(n)) return false;
        not_torch.push_back(n);
        return true;
      });
    }
    WeightsFound found;
    if (l.safetensors_index) {
      found.container = "safetensors";
      UCPFS_RETURN_IF_ERROR(FromIndex(std::string(kSafetensorsIndex), /*safetensors=*/true));
    } else if (!l.safetensors.empty()) {
      found.container = "safetensors";
      total_ = l.safetensors.size();
      for (const std::string& name : l.safetensors) UCPFS_RETURN_IF_ERROR(AddSafetensorsFile(name, nullptr));
    } else if (l.torch_index) {
      found.container = "torch";
      UCPFS_RETURN_IF_ERROR(FromIndex(std::string(kTorchIndex), /*safetensors=*/false));
    } else if (l.torch.size() == 1 || l.pytorch_model) {
      // Hugging Face's own name wins over the files a Trainer saves beside it (optimizer.pt,
      // training_args.bin, rng_state.pth).
      found.container = "torch";
      total_ = 1;
      const std::string name = l.pytorch_model ? std::string(kPytorchModel) : l.torch.front();
      const Status added = AddTorchFile(name, nullptr);
      if (!added.ok() && !l.pytorch_model && NotTorch(name)) return NoWeights(dir, {name});
      UCPFS_RETURN_IF_ERROR(added);
    } else if (l.torch.size() > 1) {
      return UnsupportedError(dir + ": " + std::to_string(l.torch.size()) + " torch.save files (" + l.torch[0] +
                              ", " + l.torch[1] + ", ...) and no " + std::string(kTorchIndex) +
                              " saying which tensors each holds; ucpfs serves one state dict per directory");
    } else {
      return NoWeights(dir, not_torch);
    }
    found.skipped_values = skipped_values_;
    found.state_dict_key = state_dict_key_;
    return found;
  }

  // Whether `name` is some other program's data: it does not begin as a torch.save file does.
  bool NotTorch(const std::string& name) const {
    Result<OpenedFile> f = builder_.tree().Open(RelPath(name));
    return f.ok() && !format::LooksLikeTorchFile(*f->bytes);  // an open's error comes when it is read
  }

  static Status NoWeights(const std::string& dir, const std::vector<std::string>& not_torch) {
    std::string skipped;
    for (const std::string& n : not_torch) skipped += (skipped.empty() ? "; " : ", ") + n;
    if (!skipped.empty()) {
      skipped += not_torch.size() == 1 ? ": not a torch.save file" : ": not torch.save files";
      skipped += " (neither a zip nor torch's legacy format)";
    }
    return NotFoundError(dir + ": no weights (" + std::string(kSafetensorsIndex) + ", *.safetensors, " +
                         std::string(kTorchIndex) + " or a .pt/.pth/.bin file)" + skipped);
  }

 private:
  // The tensors a shard must hold: name -> still expected. Null: take every tensor.
  using Expected = std::map<std::string, bool>;

  std::string RelPath(const std::string& name) const {
    return options_.sub_dir.empty() ? name : options_.sub_dir + "/" + name;
  }

  Status Add(Item item, const std::string& where) {
    if (!names_.insert(item.key).second) {
      return CorruptError(where + ": tensor '" + item.key + "' is stored twice (also in an earlier file)");
    }
    item.key = options_.key_prefix + item.key;
    UCPFS_RETURN_IF_ERROR(builder_.FinishTensor(item, where));
    builder_.AddItem(std::move(item));
    return Status::Ok();
  }

  Status AddSafetensorsFile(const std::string& name, Expected* expected) {
    UCPFS_ASSIGN_OR_RETURN(uint32_t id, builder_.AddFile(RelPath(name)));
    const ByteSource& src = *builder_.source(id);
    UCPFS_ASSIGN_OR_RETURN(format::SafetensorsHeader h, format::ReadSafetensors(src));
    for (format::SafetensorsTensor& t : h.tensors) {
      UCPFS_RETURN_IF_ERROR(Expect(expected, t.name, src.Name()));
      UCPFS_RETURN_IF_ERROR(Add(CheckpointBuilder::WholeTensor(std::move(t.name), t.dtype, std::move(t.shape), id,
                                                               t.byte_offset),
                                src.Name()));
    }
    Done();
    return Status::Ok();
  }

  Status AddTorchFile(const std::string& name, Expected* expected) {
    UCPFS_ASSIGN_OR_RETURN(uint32_t id, builder_.AddFile(RelPath(name)));
    UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, builder_.OpenTorchFile(id));
    const std::string& where = builder_.source(id)->Name();
    const std::string prefix = WrapperPrefix(tf);
    if (!prefix.empty()) state_dict_key_ = prefix.substr(0, prefix.size() - 1);
    std::set<std::string> seen_here;
    for (const format::TensorRecord& rec : tf.tensors()) {
      if (rec.key.empty()) {
        return UnsupportedError(where + ": the file holds a single tensor, not a state dict of named tensors");
      }
      if (!rec.key.starts_with(prefix)) {
        ++skipped_values_;  // beside the wrapped state dict (e.g. an optimizer's tensors)
        continue;
      }
      format::TensorRecord t = rec;
      t.key = rec.key.substr(prefix.size());
      if (t.key.empty()) continue;
      // A tensor reachable by two paths (tied weights) is listed under each; the same path
      // twice (a dict saved with a repeated key) is one.
      if (!seen_here.insert(t.key).second) continue;
      UCPFS_RETURN_IF_ERROR(Expect(expected, t.key, where));
      std::vector<int64_t> strides;
      if (!t.contiguous) strides = t.stride;
      UCPFS_RETURN_IF_ERROR(
          Add(CheckpointBuilder::WholeTensor(t.key, t.dtype, t.shape, id, t.data_offset, std::move(strides)), where));
    }
    skipped_values_ += CountPlainLeaves(tf);
    Done();
    return Status::Ok();
  }

  // "<key>." when the file wraps its state dict in a top-level dict under a usual key
  // ({"state_dict": sd, "epoch": 3}, {"model": sd}, {"module": sd}) and holds no tensor at the
  // top level itself; else "". The first of those keys present (in that order) wins.
  static std::string WrapperPrefix(const format::TorchFile& tf) {
    const pickle::PickleGraph& g = tf.graph();
    const pickle::NodeId root = g.root();
    if (root == pickle::kNoNode || g.kind(root) != pickle::Kind::kDict) return "";
    std::map<std::string, pickle::NodeId> dicts;
    for (const auto& [k, v] : g.dict_items(root)) {
      if (g.kind(v) == pickle::Kind::kTensor) return "";
      if (g.kind(k) == pickle::Kind::kString && g.kind(v) == pickle::Kind::kDict) dicts[std::string(g.text(k))] = v;
    }
    for (const char* key : {"state_dict", "model_state_dict", "model", "module"}) {
      if (dicts.count(key)) return std::string(key) + ".";
    }
    return "";
  }

  // Non-tensor leaves of a torch file's top-level dict (e.g. an "epoch" saved beside the
  // weights): counted, not served.
  static uint64_t CountPlainLeaves(const format::TorchFile& tf) {
    const pickle::PickleGraph& g = tf.graph();
    const pickle::NodeId root = g.root();
    if (root == pickle::kNoNode || g.kind(root) != pickle::Kind::kDict) return 0;
    uint64_t n = 0;
    for (const auto& [k, v] : g.dict_items(root)) {
      const pickle::Kind kind = g.kind(v);
      if (kind != pickle::Kind::kTensor && kind != pickle::Kind::kDict && kind != pickle::Kind::kList &&
          kind != pickle::Kind::kTuple) {
        ++n;
      }
    }
    return n;
  }

  Status Expect(Expected* expected, const std::string& name, const std::string& where) {
    if (expected == nullptr) return Status::Ok();
    auto it = expected->find(name);
    if (it == expected->end()) {
      return CorruptError(where + ": holds tensor '" + name + "', which the index's weight_map does not assign to it");
    }
    it->second = false;
    return Status::Ok();
  }

  // An index (HF `*.index.json`): its weight_map names each tensor's file. The files are read
  // in the order of their first mention; items follow each file's own order.
  Status FromIndex(const std::string& index_name, bool safetensors) {
    UCPFS_ASSIGN_OR_RETURN(uint32_t id, builder_.AddFile(RelPath(index_name)));
    const ByteSource& src = *builder_.source(id);
    if (src.Size() > kMaxIndexBytes) {
      return ResourceExhaustedError(src.Name() + ": " + std::to_string(src.Size()) + " bytes, over the " +
                                    std::to_string(kMaxIndexBytes >> 20) + " MiB an index may have");
    }
    UCPFS_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, ReadRange(src, 0, src.Size(), kMaxIndexBytes));
    const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    UCPFS_ASSIGN_OR_RETURN(auto weight_map, format::ParseSafetensorsIndex(text, src.Name()));
    std::vector<std::string> order;
    std::map<std::string, Expected> by_file;
    for (auto& [name, file] : weight_map) {
      if (!SafeRelativePath(file) || file == index_name) {
        return CorruptError(src.Name() + ": weight_map assigns '" + name + "' to '" + file +
                            "', which is not a data file inside the checkpoint directory");
      }
      auto [it, inserted] = by_file.try_emplace(file);
      if (inserted) order.push_back(file);
      if (!it->second.emplace(name, true).second) {
        return CorruptError(src.Name() + ": weight_map lists '" + name + "' twice");
      }
    }
    total_ = order.size();
    for (const std::string& file : order) {
      // A shard the index names but the directory lacks is a broken checkpoint, not "no
      // checkpoint here" (kNotFound would let a mount fall back to an empty namespace).
      if (Result<uint32_t> added = builder_.AddFile(RelPath(file)); !added.ok()) {
        if (added.error().code() != StatusCode::kNotFound) return added.status();
        return CorruptError(src.Name() + ": weight_map names " + file + ", which is missing");
      }
      Expected& expected = by_file[file];
      UCPFS_RETURN_IF_ERROR(safetensors ? AddSafetensorsFile(file, &expected) : AddTorchFile(file, &expected));
      for (const auto& [name, missing] : expected) {
        if (missing) {
          return CorruptError(src.Name() + ": weight_map puts tensor '" + name + "' in " + file +
                              ", which does not hold it");
        }
      }
    }
    return Status::Ok();
  }

  void Done() {
    if (progress_) progress_(++done_, total_);
  }

  CheckpointBuilder& builder_;
  const WeightsOptions& options_;
  ScanProgress progress_;
  uint64_t done_ = 0, total_ = 0;
  uint64_t skipped_values_ = 0;
  std::string state_dict_key_;  // the top-level key a torch file wraps its state dict in, if any
  std::set<std::string> names_;
};

}  // namespace

bool IsWeightsDirectory(const SourceTree& tree) {
  const Listing l = ListWeights(tree, "");
  return l.safetensors_index || l.torch_index || !l.safetensors.empty() || !l.torch.empty();
}

Result<WeightsFound> AddWeights(CheckpointBuilder& builder, const WeightsOptions& options,
                                const ScanProgress& progress) {
  return WeightsScan(builder, options).Run(progress);
}

Result<Checkpoint> ScanWeights(const SourceTree& tree, const ScanProgress& progress) {
  CheckpointBuilder builder(tree);
  UCPFS_ASSIGN_OR_RETURN(WeightsFound found, AddWeights(builder, WeightsOptions{}, progress));
  Checkpoint& c = builder.checkpoint();
  c.format = "weights";
  c.flavor = found.container;
  WeightsSourceFacts info;
  info.container = found.container;
  for (const SourceFile& f : c.files) info.files.push_back(f.rel_path);
  info.skipped_values = static_cast<int64_t>(found.skipped_values);
  info.state_dict_key = found.state_dict_key;
  // A Hugging Face model folder's config.json: the architecture facts (hf_config.h). Read after
  // the weight files are listed (it is in the file table, so its identity is checked, but it is
  // not a weight file). A bad one is recorded, not fatal: only views that need it fail, saying why.
  if (Result<uint32_t> id = builder.AddFile("config.json"); id.ok()) {
    const ByteSource& src = *builder.source(*id);
    Result<std::vector<std::byte>> bytes =
        src.Size() > kMaxHfConfigBytes
            ? Result<std::vector<std::byte>>(ResourceExhaustedError(src.Name() + ": over the 1 MiB a config.json may have"))
            : ReadRange(src, 0, src.Size(), kMaxHfConfigBytes);
    Result<HfModelConfig> config =
        bytes.ok() ? ParseHfConfig(std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size()), src.Name())
                   : Result<HfModelConfig>(bytes.error());
    if (config.ok()) {
      info.hf_config = std::move(*config);
    } else {
      info.hf_config_error = config.error().message();
    }
  } else if (id.error().code() != StatusCode::kNotFound) {
    info.hf_config_error = id.error().message();
  }
  c.facts = std::move(info);
  if (EncodeSourceFacts(c.facts).size() > kMaxSourceFactsBytes) {
    return ResourceExhaustedError(tree.Root() + ": too many weight files to record");
  }
  return builder.Take();
}

}  // namespace ucpfs::index
