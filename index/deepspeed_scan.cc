// ScanDeepSpeed: DeepSpeed tag directory -> Checkpoint. See deepspeed_scan.h.
//
// Error rule: the first problem wins, in this order: the tag, the file names, the model states,
// then the optimizer files by dp rank; every message names the file and the key.
#include "index/deepspeed_scan.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/format/torch_file.h"
#include "core/layout/zero.h"
#include "index/checkpoint_builder.h"

namespace ucpfs::index {
namespace {

constexpr uint64_t kMaxLatestBytes = 4096;

bool IsRegular(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The files of one tag directory, by role.
struct TagFiles {
  std::map<int, std::string> model;                       // mp rank -> mp_rank_XX_model_states.pt
  std::map<std::pair<int, int>, std::string> zero3_model;  // (dp, mp) -> zero_pp_rank_..._model_states.pt
  std::map<std::pair<int, int>, std::string> optim;        // (dp, mp) -> [bf16_]zero_pp_rank_..._optim_states.pt
  std::vector<std::string> unsupported;                    // layer_*, expert, expp_rank_* files
};

Result<TagFiles> ListTag(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return NotFoundError("DeepSpeed tag directory " + dir + " cannot be listed");
  static const std::regex kModel(R"(mp_rank_(\d+)_model_states\.pt)");
  static const std::regex kZero3Model(R"(zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  static const std::regex kOptim(R"((?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  static const std::regex kOther(R"((layer_.*|expp_rank_.*)_(model|optim)_states\.pt)");
  TagFiles out;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  std::sort(names.begin(), names.end());
  auto num = [](const std::ssub_match& m) -> int {
    const std::string s = m.str();
    return s.size() > 6 ? -1 : std::stoi(s);
  };
  for (const std::string& name : names) {
    if (name.size() > 255 || !IsRegular(dir + "/" + name)) continue;
    std::smatch m;
    if (std::regex_match(name, m, kZero3Model)) {
      if (num(m[1]) < 0 || num(m[2]) < 0) return CorruptError(dir + "/" + name + ": rank number too large");
      out.zero3_model[{num(m[1]), num(m[2])}] = name;
    } else if (std::regex_match(name, m, kOptim)) {
      if (num(m[1]) < 0 || num(m[2]) < 0) return CorruptError(dir + "/" + name + ": rank number too large");
      if (!out.optim.emplace(std::make_pair(num(m[1]), num(m[2])), name).second) {
        return CorruptError(dir + "/" + name + ": a second optimizer file for dp rank " + m[1].str() +
                            " (with and without the bf16_ prefix?)");
      }
    } else if (std::regex_match(name, m, kModel)) {
      if (num(m[1]) < 0) return CorruptError(dir + "/" + name + ": rank number too large");
      out.model[num(m[1])] = name;
    } else if (std::regex_match(name, m, kOther)) {
      out.unsupported.push_back(name);
    }
  }
  return out;
}

// ---- pickle helpers ----

// The key/value pairs of a dict or an OrderedDict built by REDUCE + SETITEMS.
std::span<const std::pair<pickle::NodeId, pickle::NodeId>> Pairs(const pickle::PickleGraph& g, pickle::NodeId n) {
  if (g.kind(n) == pickle::Kind::kDict) return g.dict_items(n);
  if (g.kind(n) == pickle::Kind::kObject) return g.object(n).dict_items;
  return {};
}

pickle::NodeId Get(const pickle::PickleGraph& g, pickle::NodeId dict, std::string_view key) {
  pickle::NodeId found = pickle::kNoNode;
  for (const auto& [k, v] : Pairs(g, dict)) {
    if (g.kind(k) == pickle::Kind::kString && g.text(k) == key) found = v;
  }
  return found;
}

std::span<const pickle::NodeId> Items(const pickle::PickleGraph& g, pickle::NodeId n) {
  const pickle::Kind k = g.kind(n);
  if (k == pickle::Kind::kList || k == pickle::Kind::kTuple) return g.items(n);
  if (k == pickle::Kind::kObject) return g.object(n).list_items;
  return {};
}

std::optional<int64_t> IntOf(const pickle::PickleGraph& g, pickle::NodeId n) {
  if (g.kind(n) == pickle::Kind::kInt) return g.int_value(n);
  if (g.kind(n) == pickle::Kind::kBool) return g.bool_value(n) ? 1 : 0;
  // An int Enum (ZeroStageEnum) pickles as REDUCE(cls, (value,)).
  if (g.kind(n) == pickle::Kind::kObject) {
    const auto args = Items(g, g.object(n).args);
    if (args.size() == 1 && g.kind(args[0]) == pickle::Kind::kInt) return g.int_value(args[0]);
  }
  return std::nullopt;
}

// torch.Size((a, b)) (REDUCE of torch.Size with a tuple), or a plain tuple/list of ints.
std::optional<std::vector<int64_t>> ShapeOf(const pickle::PickleGraph& g, pickle::NodeId n) {
  pickle::NodeId seq = n;
  if (g.kind(n) == pickle::Kind::kObject) {
    const auto args = Items(g, g.object(n).args);
    if (args.size() != 1) return std::nullopt;
    seq = args[0];
  }
  if (g.kind(seq) != pickle::Kind::kTuple && g.kind(seq) != pickle::Kind::kList) return std::nullopt;
  std::vector<int64_t> shape;
  for (pickle::NodeId d : g.items(seq)) {
    if (g.kind(d) != pickle::Kind::kInt || g.int_value(d) < 0) return std::nullopt;
    shape.push_back(g.int_value(d));
  }
  return shape;
}

std::optional<uint64_t> NumelOf(const std::vector<int64_t>& shape) {
  std::optional<uint64_t> n = 1;
  for (int64_t d : shape) n = n ? CheckedMul(*n, static_cast<uint64_t>(d)) : std::nullopt;
  return n;
}

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
};

// param_shapes: a list (one per param group; ZeRO-3: per sub-group) of name -> torch.Size.
Result<std::vector<std::vector<Param>>> ParamShapes(const format::TorchFile& tf, const std::string& where) {
  const pickle::PickleGraph& g = tf.graph();
  const pickle::NodeId shapes = Get(g, g.root(), "param_shapes");
  if (g.kind(shapes) == pickle::Kind::kNone) {
    return UnsupportedError(where + ": param_shapes is None (a checkpoint without ZeRO partitions)");
  }
  if (g.kind(shapes) != pickle::Kind::kList) return CorruptError(where + ": param_shapes is not a list");
  std::vector<std::vector<Param>> out;
  std::set<std::string> seen;
  for (pickle::NodeId group : g.items(shapes)) {
    std::vector<Param> params;
    for (const auto& [k, v] : Pairs(g, group)) {
      if (g.kind(k) != pickle::Kind::kString) return CorruptError(where + ": param_shapes has a non-string key");
      Param p;
      p.name = std::string(g.text(k));
      std::optional<std::vector<int64_t>> shape = ShapeOf(g, v);
      std::optional<uint64_t> numel = shape ? NumelOf(*shape) : std::nullopt;
      if (!numel) return CorruptError(where + ": param_shapes['" + p.name + "'] is not a shape");
      if (!seen.insert(p.name).second) {
        return CorruptError(where + ": param_shapes lists '" + p.name + "' twice");
      }
      p.shape = std::move(*shape);
      p.numel = *numel;
      params.push_back(std::move(p));
    }
    out.push_back(std::move(params));
  }
  return out;
}

// A plain pickled value (None, bool, int, float, str, list, tuple, dict with str keys) as JSON;
// anything else, or past the bounds, becomes null. For universal_checkpoint_info.
nlohmann::json PlainJson(const pickle::PickleGraph& g, pickle::NodeId n, int depth, uint64_t* budget) {
  if (depth > 16 || *budget == 0) return nullptr;
  --*budget;
  switch (g.kind(n)) {
    case pickle::Kind::kBool: return g.bool_value(n);
    case pickle::Kind::kInt: return g.int_value(n);
    case pickle::Kind::kFloat: return g.float_value(n);
    case pickle::Kind::kString: {
      // JSON text must be UTF-8: keep only strings that are.
      std::string s(g.text(n));
      try {
        (void)nlohmann::json(s).dump();
      } catch (const nlohmann::json::exception&) {
        return nullptr;
      }
      return s;
    }
    case pickle::Kind::kList:
    case pickle::Kind::kTuple: {
      nlohmann::json a = nlohmann::json::array();
      for (pickle::NodeId item : g.items(n)) a.push_back(PlainJson(g, item, depth + 1, budget));
      return a;
    }
    case pickle::Kind::kDict: {
      nlohmann::json o = nlohmann::json::object();
      for (const auto& [k, v] : g.dict_items(n)) {
        if (g.kind(k) != pickle::Kind::kString) continue;
        nlohmann::json key = PlainJson(g, k, depth + 1, budget);
        if (key.is_string()) o[key.get<std::string>()] = PlainJson(g, v, depth + 1, budget);
      }
      return o;
    }
    default: return nullptr;
  }
}

class DeepSpeedScanner {
 public:
  explicit DeepSpeedScanner(const std::string& dir) : builder_(dir) {}

  Result<Checkpoint> Run(const ScanProgress& progress) {
    UCPFS_RETURN_IF_ERROR(FindTag());
    UCPFS_ASSIGN_OR_RETURN(files_, ListTag(builder_.dir() + "/" + tag_dir_));
    UCPFS_RETURN_IF_ERROR(CheckNames());
    const bool zero3 = !files_.zero3_model.empty();
    Checkpoint& cp = builder_.checkpoint();
    cp.format = "deepspeed";
    const std::string model_name = zero3 ? files_.zero3_model.begin()->second : files_.model.begin()->second;
    UCPFS_ASSIGN_OR_RETURN(uint32_t model_id, builder_.AddFile(Rel(model_name)));
    UCPFS_ASSIGN_OR_RETURN(format::TorchFile model, builder_.OpenTorchFile(model_id));
    const std::string model_where = builder_.source(model_id)->Name();
    UCPFS_ASSIGN_OR_RETURN(groups_, ParamShapes(model, model_where));

    // The optimizer partitions, by dp rank.
    for (const auto& [rank, name] : files_.optim) {
      UCPFS_ASSIGN_OR_RETURN(uint32_t id, builder_.AddFile(Rel(name)));
      UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, builder_.OpenTorchFile(id));
      optim_ids_.push_back(id);
      optim_.push_back(std::move(tf));
    }
    dp_ = static_cast<int>(optim_.size());
    UCPFS_ASSIGN_OR_RETURN(stage_, ZeroStage());
    cp.flavor = (stage_ == 0 ? std::string("bf16_optimizer") : "zero" + std::to_string(stage_)) + " dp" +
                std::to_string(dp_) + (tag_.empty() ? "" : " tag " + tag_);

    std::vector<Item> weights;
    if (!zero3) weights = ModuleItems(model, model_id);
    std::vector<std::string> module_order;
    std::map<std::string, Item> weight_of;
    for (Item& w : weights) {
      module_order.push_back(w.key);
      weight_of.emplace(module_order.back(), std::move(w));
    }

    uint64_t total = 0, done = 0;
    for (const auto& g : groups_) total += g.size();
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      std::vector<std::vector<Item>> items;
      if (zero3) {
        UCPFS_ASSIGN_OR_RETURN(items, Zero3Group(gi));
      } else {
        UCPFS_ASSIGN_OR_RETURN(items, FlatGroup(gi));
      }
      for (size_t pi = 0; pi < items.size(); ++pi) {
        const std::string& name = groups_[gi][pi].name;
        if (auto w = weight_of.find(name); w != weight_of.end()) {
          builder_.AddItem(std::move(w->second));
          weight_of.erase(w);
        }
        for (Item& item : items[pi]) builder_.AddItem(std::move(item));
        if (progress) progress(++done, total);
      }
    }
    // Module tensors without optimizer state (buffers, frozen parameters), in module order.
    for (const std::string& name : module_order) {
      if (auto it = weight_of.find(name); it != weight_of.end()) builder_.AddItem(std::move(it->second));
    }
    UCPFS_ASSIGN_OR_RETURN(cp.format_info, FormatInfo(model, zero3));
    return builder_.Take();
  }

 private:
  // What the universal view needs beyond items (deepspeed_scan.h, "format_info").
  Result<std::string> FormatInfo(const format::TorchFile& model, bool zero3) const {
    nlohmann::json info;
    info["tag"] = tag_.empty() ? std::string() : tag_;
    info["zero_stage"] = stage_;
    info["dp"] = dp_;
    const pickle::PickleGraph& g = model.graph();
    uint64_t budget = 100000;
    const pickle::NodeId uc = Get(g, g.root(), "universal_checkpoint_info");
    info["universal_checkpoint_info"] =
        g.kind(uc) == pickle::Kind::kDict ? PlainJson(g, uc, 0, &budget) : nlohmann::json(nullptr);
    // The files ds_to_universal copies next to zero/: mp_rank_* (ZeRO-1/2, BF16_Optimizer) or
    // every *model_states.pt (ZeRO-3).
    nlohmann::json model_files = nlohmann::json::array();
    if (zero3) {
      for (const auto& [key, name] : files_.zero3_model) model_files.push_back(Rel(name));
    } else {
      for (const auto& [mp, name] : files_.model) model_files.push_back(Rel(name));
    }
    info["model_files"] = model_files;
    info["optimizer_file"] = Rel(files_.optim.begin()->second);
    // A param group's step when the optimizer keeps it as a Python number (a tensor step is
    // the item optimizer.state.<name>.step): per group, the number or null.
    nlohmann::json steps = nlohmann::json::array();
    const pickle::PickleGraph& og = optim_[0].graph();
    const pickle::NodeId osd = Get(og, og.root(), "optimizer_state_dict");
    const pickle::NodeId state = Get(og, Get(og, osd, zero3 ? "optimizer_state_dict" : "base_optimizer_state"), "state");
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      pickle::NodeId group = pickle::kNoNode;
      for (const auto& [k, v] : Pairs(og, state)) {
        if (IntOf(og, k) == static_cast<int64_t>(gi)) group = v;
      }
      const pickle::NodeId step = Get(og, group, "step");
      const pickle::Kind kind = og.kind(step);
      steps.push_back(kind == pickle::Kind::kInt || kind == pickle::Kind::kFloat ? PlainJson(og, step, 0, &budget)
                                                                                  : nlohmann::json(nullptr));
    }
    info["number_steps"] = steps;
    std::string text = info.dump();
    if (text.size() > kMaxFormatInfoBytes) {
      return CorruptError(builder_.source(optim_ids_[0])->Name() + ": universal_checkpoint_info is too large");
    }
    return text;
  }

  std::string Rel(const std::string& name) const { return tag_dir_.empty() ? name : tag_dir_ + "/" + name; }

  Status FindTag() {
    const std::string latest = builder_.dir() + "/latest";
    if (!IsRegular(latest)) return Status::Ok();  // the directory is the tag
    UCPFS_ASSIGN_OR_RETURN(uint32_t id, builder_.AddFile("latest"));
    const ByteSource& src = *builder_.source(id);
    if (src.Size() > kMaxLatestBytes) return CorruptError(src.Name() + ": " + std::to_string(src.Size()) + " bytes, not a tag name");
    std::string text(src.Size(), '\0');
    UCPFS_RETURN_IF_ERROR(src.ReadAt(0, std::as_writable_bytes(std::span(text.data(), text.size()))));
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.erase(0, 1);
    if (text.empty() || text == "." || text == ".." || text.find('/') != std::string::npos ||
        text.find('\0') != std::string::npos) {
      return CorruptError(src.Name() + ": '" + text + "' is not a tag directory name");
    }
    struct stat st;
    const std::string tag_path = builder_.dir() + "/" + text;
    if (::lstat(tag_path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return CorruptError(src.Name() + ": names tag '" + text + "', which is not a directory of " + builder_.dir());
    }
    tag_ = text;
    tag_dir_ = text;
    return Status::Ok();
  }

  Status CheckNames() const {
    const std::string where = builder_.dir() + (tag_dir_.empty() ? "" : "/" + tag_dir_);
    if (!files_.unsupported.empty()) {
      return UnsupportedError(where + "/" + files_.unsupported.front() +
                              ": pipeline-parallel layer files and MoE expert files are not supported yet");
    }
    std::set<int> mps;
    for (const auto& [mp, name] : files_.model) mps.insert(mp);
    for (const auto& [key, name] : files_.zero3_model) mps.insert(key.second);
    for (const auto& [key, name] : files_.optim) mps.insert(key.second);
    if ((files_.model.empty() && files_.zero3_model.empty()) || files_.optim.empty()) {
      return NotFoundError(where + " holds no DeepSpeed model and optimizer states "
                           "(mp_rank_XX_model_states.pt, zero_pp_rank_D_mp_rank_XX_optim_states.pt)");
    }
    if (mps.size() > 1 || *mps.begin() != 0) {
      return UnsupportedError(where + ": model-parallel ranks " + std::to_string(*mps.rbegin()) +
                              " found: tensor- or pipeline-parallel DeepSpeed checkpoints are not supported yet");
    }
    if (!files_.model.empty() && !files_.zero3_model.empty()) {
      return CorruptError(where + ": both mp_rank_00_model_states.pt and ZeRO-3 zero_pp_rank_*_model_states.pt");
    }
    // dp ranks 0..D-1, each once.
    int expect = 0;
    for (const auto& [key, name] : files_.optim) {
      if (key.first != expect) {
        return CorruptError(where + ": optimizer partition of dp rank " + std::to_string(expect) +
                            " is missing (found " + name + ")");
      }
      ++expect;
    }
    if (!files_.zero3_model.empty() && files_.zero3_model.size() != files_.optim.size()) {
      return CorruptError(where + ": " + std::to_string(files_.zero3_model.size()) + " ZeRO-3 model files but " +
                          std::to_string(files_.optim.size()) + " optimizer files");
    }
    return Status::Ok();
  }

  // 1 or 2 (zero_stage), 3 (ZeRO-3), or 0 for BF16_Optimizer (no zero_stage key).
  Result<int> ZeroStage() const {
    std::optional<int> stage;
    for (size_t d = 0; d < optim_.size(); ++d) {
      const pickle::PickleGraph& g = optim_[d].graph();
      const pickle::NodeId osd = Get(g, g.root(), "optimizer_state_dict");
      if (Pairs(g, osd).empty()) return CorruptError(Where(d) + ": no optimizer_state_dict");
      const pickle::NodeId z = Get(g, osd, "zero_stage");
      int s = 0;
      if (z != pickle::kNoNode) {
        std::optional<int64_t> v = IntOf(g, z);
        if (!v || *v < 1 || *v > 3) return CorruptError(Where(d) + ": optimizer_state_dict.zero_stage is not 1, 2 or 3");
        s = static_cast<int>(*v);
      }
      if (stage && *stage != s) return CorruptError(Where(d) + ": zero_stage differs from dp rank 0's");
      stage = s;
    }
    const bool zero3_files = !files_.zero3_model.empty();
    if ((*stage == 3) != zero3_files) {
      return CorruptError(Where(0) + ": zero_stage " + std::to_string(*stage) + " does not match the model files");
    }
    return *stage;
  }

  std::string Where(size_t dp_rank) const { return builder_.source(optim_ids_[dp_rank])->Name(); }

  std::vector<Item> ModuleItems(const format::TorchFile& model, uint32_t model_id) const {
    std::vector<Item> out;
    constexpr std::string_view kPrefix = "module.";
    for (const format::TensorRecord& t : model.tensors()) {
      if (t.key.rfind(kPrefix, 0) != 0) continue;
      Item item;
      item.key = t.key.substr(kPrefix.size());
      item.kind = ItemKind::kTensor;
      item.dtype = t.dtype;
      item.layout.shape = t.shape;
      slice::Fragment f;
      f.box.offsets.assign(t.shape.size(), 0);
      f.box.sizes = t.shape;
      f.flat_lo = 0;
      f.flat_hi = t.n_elems;
      f.file_id = model_id;
      f.byte_offset = t.data_offset;
      f.dtype = t.dtype;
      if (!t.contiguous) f.strides = t.stride;
      item.layout.fragments.push_back(std::move(f));
      out.push_back(std::move(item));
    }
    return out;
  }

  // A flat-range fragment of `p`: its elements [param_elem_offset, +n) stored contiguously at
  // element `elem` of tensor `rec` in file `file_id`.
  static slice::Fragment FlatFragment(const Param& p, uint64_t param_elem_offset, uint64_t n, uint32_t file_id,
                                      const format::TensorRecord& rec, uint64_t elem) {
    slice::Fragment f;
    f.box.offsets.assign(p.shape.size(), 0);
    f.box.sizes = p.shape;
    f.flat_lo = param_elem_offset;
    f.flat_hi = param_elem_offset + n;
    f.file_id = file_id;
    f.byte_offset = rec.data_offset + elem * ItemSize(rec.dtype);
    f.dtype = rec.dtype;
    return f;
  }

  // A 1-D contiguous fp32 tensor at `key` of dp rank d with at least `min_elems` elements.
  Result<const format::TensorRecord*> FlatTensor(size_t d, const std::string& key, uint64_t min_elems,
                                                 uint64_t max_elems) const {
    for (const format::TensorRecord& t : optim_[d].tensors()) {
      if (t.key != key) continue;
      if (t.shape.size() != 1 || !t.contiguous) {
        return CorruptError(Where(d) + ": " + key + " is not a 1-D contiguous tensor (shape " + JoinInts(t.shape) + ")");
      }
      if (t.n_elems < min_elems || t.n_elems > max_elems) {
        return CorruptError(Where(d) + ": " + key + " has " + std::to_string(t.n_elems) +
                            " elements; the partition needs " +
                            (min_elems == max_elems ? std::to_string(min_elems)
                                                    : std::to_string(min_elems) + " to " + std::to_string(max_elems)));
      }
      return &t;
    }
    return CorruptError(Where(d) + ": no tensor " + key);
  }

  // The group's step on dp rank 0, if the optimizer keeps one as a tensor.
  const format::TensorRecord* StepOf(const std::string& state_key) const {
    for (const format::TensorRecord& t : optim_[0].tensors()) {
      if (t.key == state_key + ".step" && t.n_elems == 1) return &t;
    }
    return nullptr;
  }

  static Item NewTensorItem(const std::string& key, const Param& p, DType dtype) {
    Item item;
    item.key = key;
    item.kind = ItemKind::kTensor;
    item.dtype = dtype;
    item.layout.shape = p.shape;
    return item;
  }

  Item StepItem(const Param& p, const format::TensorRecord& step) const {
    Item item;
    item.key = "optimizer.state." + p.name + ".step";
    item.kind = ItemKind::kTensor;
    item.dtype = step.dtype;
    slice::Fragment f;
    f.flat_lo = 0;
    f.flat_hi = 1;
    f.file_id = optim_ids_[0];
    f.byte_offset = step.data_offset;
    f.dtype = step.dtype;
    item.layout.fragments.push_back(std::move(f));
    return item;
  }

  // Where one param group's (ZeRO-3: sub-group's) states lie, per dp rank.
  struct Partitions {
    std::vector<const format::TensorRecord*> fp32, exp_avg, exp_avg_sq;
    const format::TensorRecord* step = nullptr;  // on dp rank 0, when kept as a tensor
  };

  // A parameter's fp32 master, Adam moments and step, from its fragments (partition_elem_offset:
  // the element inside rank dp_rank's tensor).
  Result<std::vector<Item>> ItemsOfParam(const Param& p, const std::vector<layout::ZeroFragment>& frags,
                                         const Partitions& parts) {
    std::vector<Item> items;
    if (p.numel > 0) {
      const std::pair<const char*, const std::vector<const format::TensorRecord*>*> states[] = {
          {".fp32_param", &parts.fp32}, {".exp_avg", &parts.exp_avg}, {".exp_avg_sq", &parts.exp_avg_sq}};
      for (const auto& [suffix, recs] : states) {
        Item item = NewTensorItem("optimizer.state." + p.name + suffix, p, (*recs)[0]->dtype);
        for (const layout::ZeroFragment& z : frags) {
          const auto d = static_cast<size_t>(z.dp_rank);
          item.layout.fragments.push_back(
              FlatFragment(p, z.param_elem_offset, z.n_elems, optim_ids_[d], *(*recs)[d], z.partition_elem_offset));
        }
        UCPFS_RETURN_IF_ERROR(builder_.FinishTensor(item, Where(0)));
        items.push_back(std::move(item));
      }
    }
    if (parts.step != nullptr) items.push_back(StepItem(p, *parts.step));
    return items;
  }

  // ZeRO-1/2 and BF16_Optimizer: group gi's flat partitions.
  Result<std::vector<std::vector<Item>>> FlatGroup(size_t gi) {
    const std::vector<Param>& params = groups_[gi];
    std::vector<uint64_t> numels;
    for (const Param& p : params) numels.push_back(p.numel);
    UCPFS_ASSIGN_OR_RETURN(const layout::ZeroFlatGroup group, layout::MakeZeroFlatGroup(numels, dp_));
    const std::string g = std::to_string(gi);
    const std::string fp32_key = "optimizer_state_dict.single_partition_of_fp32_groups." + g;
    const std::string state_key = "optimizer_state_dict.base_optimizer_state.state." + g;
    std::vector<const format::TensorRecord*> fp32(static_cast<size_t>(dp_)), avg(fp32.size()), avg_sq(fp32.size());
    for (size_t d = 0; d < fp32.size(); ++d) {
      UCPFS_RETURN_IF_ERROR(CheckMappings(d, gi, group));
      const uint64_t real = group.partition_elems - group.PaddingOf(static_cast<int>(d));
      // ZeRO-1/2 store the fp32 partition without its padding, BF16_Optimizer with it.
      UCPFS_ASSIGN_OR_RETURN(fp32[d], FlatTensor(d, fp32_key, real, group.partition_elems));
      UCPFS_ASSIGN_OR_RETURN(avg[d], FlatTensor(d, state_key + ".exp_avg", group.partition_elems, group.partition_elems));
      UCPFS_ASSIGN_OR_RETURN(avg_sq[d], FlatTensor(d, state_key + ".exp_avg_sq", group.partition_elems, group.partition_elems));
    }
    const Partitions parts{fp32, avg, avg_sq, StepOf(state_key)};
    std::vector<std::vector<Item>> out;
    for (size_t pi = 0; pi < params.size(); ++pi) {
      UCPFS_ASSIGN_OR_RETURN(std::vector<Item> items,
                             ItemsOfParam(params[pi], layout::FragmentsOfParam(group, pi), parts));
      out.push_back(std::move(items));
    }
    return out;
  }

  // The rank's param_slice_mappings[gi] must be what the partition math says, name by name.
  Status CheckMappings(size_t d, size_t gi, const layout::ZeroFlatGroup& group) const {
    const pickle::PickleGraph& g = optim_[d].graph();
    const pickle::NodeId osd = Get(g, g.root(), "optimizer_state_dict");
    const auto counts = Items(g, Get(g, osd, "partition_count"));
    if (gi < counts.size()) {
      std::optional<int64_t> c = IntOf(g, counts[gi]);
      if (!c || *c != dp_) {
        return CorruptError(Where(d) + ": optimizer_state_dict.partition_count[" + std::to_string(gi) + "] is " +
                            (c ? std::to_string(*c) : std::string("not an int")) + " but there are " +
                            std::to_string(dp_) + " dp ranks");
      }
    }
    const auto mappings = Items(g, Get(g, osd, "param_slice_mappings"));
    if (mappings.empty()) return Status::Ok();  // older files: the math alone
    if (gi >= mappings.size()) {
      return CorruptError(Where(d) + ": param_slice_mappings has no group " + std::to_string(gi));
    }
    const auto expected = layout::FragmentsInWindow(group, static_cast<int>(d));
    const auto pairs = Pairs(g, mappings[gi]);
    const std::string key = "optimizer_state_dict.param_slice_mappings." + std::to_string(gi);
    if (pairs.size() != expected.size()) {
      return CorruptError(Where(d) + ": " + key + " lists " + std::to_string(pairs.size()) +
                          " fragments; param_shapes and the partition size give " + std::to_string(expected.size()));
    }
    for (size_t i = 0; i < pairs.size(); ++i) {
      const Param& p = groups_[gi][expected[i].param];
      const pickle::NodeId addr = g.object(pairs[i].second).state;
      std::optional<int64_t> numel = IntOf(g, Get(g, addr, "numel")), start = IntOf(g, Get(g, addr, "start"));
      if (g.kind(pairs[i].first) != pickle::Kind::kString || g.text(pairs[i].first) != p.name || !numel || !start ||
          static_cast<uint64_t>(*numel) != expected[i].fragment.n_elems ||
          static_cast<uint64_t>(*start) != expected[i].fragment.partition_elem_offset) {
        return CorruptError(Where(d) + ": " + key + " entry " + std::to_string(i) + " does not match '" + p.name +
                            "' at " + std::to_string(expected[i].fragment.partition_elem_offset) + " (+" +
                            std::to_string(expected[i].fragment.n_elems) + ")");
      }
    }
    return Status::Ok();
  }

  // ZeRO-3: sub-group gi, each parameter padded to pn * dp, rank d holding [d * pn, +pn).
  Result<std::vector<std::vector<Item>>> Zero3Group(size_t gi) {
    const std::vector<Param>& params = groups_[gi];
    uint64_t flat = 0;
    std::vector<uint64_t> starts;
    for (const Param& p : params) {
      starts.push_back(flat);
      std::optional<uint64_t> sum = CheckedAdd(flat, layout::Zero3PartitionElems(p.numel, dp_));
      if (!sum) return CorruptError(Where(0) + ": sub-group " + std::to_string(gi) + " size overflows");
      flat = *sum;
    }
    const std::string g = std::to_string(gi);
    const std::string fp32_key = "optimizer_state_dict.fp32_flat_groups." + g;
    const std::string state_key = "optimizer_state_dict.optimizer_state_dict.state." + g;
    std::vector<const format::TensorRecord*> fp32(static_cast<size_t>(dp_)), avg(fp32.size()), avg_sq(fp32.size());
    for (size_t d = 0; d < fp32.size(); ++d) {
      UCPFS_ASSIGN_OR_RETURN(fp32[d], FlatTensor(d, fp32_key, flat, flat));
      UCPFS_ASSIGN_OR_RETURN(avg[d], FlatTensor(d, state_key + ".exp_avg", flat, flat));
      UCPFS_ASSIGN_OR_RETURN(avg_sq[d], FlatTensor(d, state_key + ".exp_avg_sq", flat, flat));
    }
    const Partitions parts{fp32, avg, avg_sq, StepOf(state_key)};
    std::vector<std::vector<Item>> out;
    for (size_t pi = 0; pi < params.size(); ++pi) {
      std::vector<layout::ZeroFragment> frags;
      for (int d = 0; d < dp_; ++d) {
        layout::ZeroFragment z = layout::Zero3FragmentOf(params[pi].numel, dp_, d);
        if (z.n_elems == 0) continue;  // this rank holds only padding of it
        z.partition_elem_offset = starts[pi];
        frags.push_back(z);
      }
      UCPFS_ASSIGN_OR_RETURN(std::vector<Item> items, ItemsOfParam(params[pi], frags, parts));
      out.push_back(std::move(items));
    }
    return out;
  }

  CheckpointBuilder builder_;
  std::string tag_;      // from `latest`, or "" when the directory is the tag
  std::string tag_dir_;  // relative to the directory
  TagFiles files_;
  std::vector<std::vector<Param>> groups_;
  std::vector<format::TorchFile> optim_;  // by dp rank
  std::vector<uint32_t> optim_ids_;
  int dp_ = 0;
  int stage_ = 0;
};

}  // namespace

bool IsDeepSpeedDirectory(const std::string& dir) {
  if (IsRegular(dir + "/latest")) return true;
  Result<TagFiles> files = ListTag(dir);
  return files.ok() && (!files->model.empty() || !files->zero3_model.empty());
}

Result<Checkpoint> ScanDeepSpeed(const std::string& dir, const ScanProgress& progress) {
  return DeepSpeedScanner(dir).Run(progress);
}

}  // namespace ucpfs::index
