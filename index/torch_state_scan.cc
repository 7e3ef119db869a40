// See torch_state_scan.h.
#include "index/torch_state_scan.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "core/format/plain_value.h"
#include "core/format/torch_file.h"
#include "index/checkpoint_builder.h"
#include "index/pickle_walk.h"
#include "index/positional_optim.h"
#include "index/weights_scan.h"

namespace ucpfs::index {
namespace {

using pickle::Kind;
using pickle::NodeId;
using pickle::PickleGraph;

constexpr std::string_view kFormat = "torch_state";
constexpr std::string_view kAmbiguous = "ambiguous.";

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool IsTorchName(std::string_view name) {
  return EndsWith(name, ".pt") || EndsWith(name, ".pth") || EndsWith(name, ".bin");
}

bool IsListLike(const PickleGraph& g, NodeId n) { return g.kind(n) == Kind::kList || g.kind(n) == Kind::kTuple; }

// torch.optim's state_dict(): {"state": {int: {...}}, "param_groups": [{"params": [int, ...], ...}]}.
bool IsOptimizerStateDict(const PickleGraph& g, NodeId n) {
  const NodeId state = Get(g, n, "state"), groups = Get(g, n, "param_groups");
  if (g.kind(state) != Kind::kDict || !IsListLike(g, groups) || Items(g, groups).empty()) return false;
  for (const auto& [k, v] : g.dict_items(state)) {
    if (g.kind(k) != Kind::kInt) return false;
  }
  for (NodeId group : Items(g, groups)) {
    const NodeId params = Get(g, group, "params");
    if (!IsListLike(g, params)) return false;
    for (NodeId p : Items(g, params)) {
      if (g.kind(p) != Kind::kInt) return false;
    }
  }
  return true;
}

struct FoundOptimizer {
  NodeId node = pickle::kNoNode;
  std::string prefix;   // its key path in TorchFile::tensors() keys, with a trailing '.', or ""
  std::string top_key;  // the root key it lies under, or "" for the root itself
};

// The optimizer state dicts of a file, by structure: the root, a value of the root dict
// (torchtune's recipe_state["optimizer"]), or an item of a list there (Lightning's
// optimizer_states[i]).
std::vector<FoundOptimizer> FindOptimizers(const PickleGraph& g) {
  std::vector<FoundOptimizer> out;
  const NodeId root = g.root();
  if (IsOptimizerStateDict(g, root)) return {{root, "", ""}};
  for (const auto& [k, v] : Pairs(g, root)) {
    if (g.kind(k) != Kind::kString) continue;
    const std::string key(g.text(k));
    if (IsOptimizerStateDict(g, v)) {
      out.push_back({v, key + ".", key});
      continue;
    }
    const auto items = Items(g, v);
    for (size_t i = 0; i < items.size() && IsListLike(g, v); ++i) {
      if (IsOptimizerStateDict(g, items[i])) out.push_back({items[i], key + "." + std::to_string(i) + ".", key});
    }
  }
  return out;
}

// Lightning's checkpoint dict: `state_dict` (the LightningModule's) and `optimizer_states`, or,
// saved with save_weights_only, the `pytorch-lightning_version` Lightning always writes.
bool IsLightning(const PickleGraph& g) {
  return g.kind(Get(g, g.root(), "state_dict")) == Kind::kDict &&
         (IsListLike(g, Get(g, g.root(), "optimizer_states")) ||
          g.kind(Get(g, g.root(), "pytorch-lightning_version")) == Kind::kString);
}

// A torch file that can be the weights: a dict of tensors, or one wrapping it (weights_scan.h).
bool IsStateDictFile(const PickleGraph& g) {
  const NodeId root = g.root();
  if (g.kind(root) != Kind::kDict) return false;
  bool all_tensors = true;
  for (const auto& [k, v] : g.dict_items(root)) {
    if (g.kind(k) != Kind::kString) return false;
    all_tensors = all_tensors && g.kind(v) == Kind::kTensor;
    for (const char* wrapper : {"state_dict", "model_state_dict", "model", "module"}) {
      if (g.text(k) == wrapper && g.kind(v) == Kind::kDict) return true;
    }
  }
  return all_tensors;
}

// An LR scheduler's state_dict() saved alone (the Trainer's scheduler.pt).
bool IsSchedulerFile(const PickleGraph& g) {
  return Get(g, g.root(), "last_epoch") != pickle::kNoNode && Get(g, g.root(), "base_lrs") != pickle::kNoNode;
}

// The optimizer's groups (positions) as saved.
std::vector<std::vector<int64_t>> GroupPositions(const PickleGraph& g, NodeId optimizer) {
  std::vector<std::vector<int64_t>> out;
  for (NodeId group : Items(g, Get(g, optimizer, "param_groups"))) {
    std::vector<int64_t> positions;
    for (NodeId p : Items(g, Get(g, group, "params"))) positions.push_back(g.int_value(p));
    out.push_back(std::move(positions));
  }
  return out;
}

// "<position>.<field>" -> (position, field).
std::optional<std::pair<int64_t, std::string>> SplitState(const std::string& rest) {
  const size_t dot = rest.find('.');
  if (dot == 0 || dot == std::string::npos || dot > 9) return std::nullopt;
  for (size_t i = 0; i < dot; ++i) {
    if (rest[i] < '0' || rest[i] > '9') return std::nullopt;
  }
  return std::make_pair(std::stoll(rest.substr(0, dot)), rest.substr(dot + 1));
}

constexpr std::string_view kRecipeState = "recipe_state/recipe_state.pt";

// torchtune's output_dir: `recipe_state/recipe_state.pt` and the checkpointer's `epoch_<N>/`
// folders (real directories); the newest epoch's name, or "" when it is not one.
std::string TorchtuneEpochDir(const SourceTree& tree) {
  if (!tree.IsDirectory("recipe_state") || !tree.IsFile(kRecipeState)) return "";
  std::string best;
  int64_t best_n = -1;
  Result<std::vector<TreeEntry>> entries = tree.List("");
  if (!entries.ok()) return "";
  size_t seen = 0;
  for (const TreeEntry& e : *entries) {
    if (++seen > 100000) break;
    const std::string& name = e.name;
    if (!name.starts_with("epoch_") || name.size() > 6 + 9 || name.size() == 6) continue;
    const std::string digits = name.substr(6);
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (e.kind != EntryKind::kDirectory) continue;
    const int64_t n = std::stoll(digits);
    if (n > best_n) best_n = n, best = name;
  }
  return best;
}

// torchtune's checkpointer saves q_proj / k_proj in Hugging Face's rotary layout (tune_to_hf's
// _permute: Hugging Face row (h, a, i) is torchtune row (h, i, a) of head h, a in {0, 1}, i <
// head_dim / 2) while the optimizer's moments keep torchtune's: this places a moment tensor so
// its rows are read in the weights' layout (2 strided fragments per head). False when the shape
// does not split into `heads` heads of even size.
bool PlaceRotaryRows(Item* item, const format::TensorRecord& rec, int64_t heads) {
  if (rec.shape.size() != 2 || heads <= 0 || rec.shape[0] % heads != 0 || (rec.shape[0] / heads) % 2 != 0) {
    return false;
  }
  const int64_t hd = rec.shape[0] / heads, dim = rec.shape[1];
  const int64_t s0 = rec.contiguous ? dim : rec.stride[0], s1 = rec.contiguous ? 1 : rec.stride[1];
  const uint64_t elem = ItemSize(rec.dtype);
  if (item->layout.fragments.size() != 1) return false;
  const uint32_t file_id = item->layout.fragments[0].file_id;
  item->layout.fragments.clear();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t a = 0; a < 2; ++a) {
      slice::Fragment f;
      f.box.offsets = {h * hd + a * hd / 2, 0};
      f.box.sizes = {hd / 2, dim};
      f.flat_lo = 0;
      f.flat_hi = static_cast<uint64_t>(hd / 2 * dim);
      f.file_id = file_id;
      f.byte_offset = rec.data_offset + static_cast<uint64_t>((h * hd + a) * s0) * elem;
      f.dtype = rec.dtype;
      f.strides = {2 * s0, s1};
      item->layout.fragments.push_back(std::move(f));
    }
  }
  return true;
}

class TorchStateScan {
 public:
  explicit TorchStateScan(const SourceTree& tree) : builder_(tree) {}

  Result<Checkpoint> Run(const ScanProgress& progress) {
    const std::string& dir = builder_.dir();
    const std::vector<std::string> names = RegularFileNames(builder_.tree(), "");
    std::vector<std::string> ckpts, torch;
    for (const auto& n : names) {
      if (EndsWith(n, ".ckpt")) ckpts.push_back(n);
      else if (IsTorchName(n)) torch.push_back(n);
    }
    std::string holder;
    std::set<std::string> not_weights;  // torch files that are not the weights
    std::vector<std::string> schedulers;
    const std::string epoch_dir = TorchtuneEpochDir(builder_.tree());
    if (!epoch_dir.empty()) {
      holder = std::string(kRecipeState);
    } else if (!ckpts.empty()) {
      if (ckpts.size() == 1) {
        holder = ckpts[0];
      } else if (std::find(ckpts.begin(), ckpts.end(), "last.ckpt") != ckpts.end()) {
        holder = "last.ckpt";
      } else {
        return UnsupportedError(dir + ": " + std::to_string(ckpts.size()) + " .ckpt files (" + ckpts[0] + ", " +
                                ckpts[1] + ", ...) and no last.ckpt; mount a folder holding the one to serve");
      }
    } else {
      std::vector<std::string> holders;
      CheckpointBuilder probe(builder_.tree());
      for (size_t i = 0; i < torch.size() && i < kMaxProbedFiles; ++i) {
        auto id = probe.AddFile(torch[i]);
        if (!id.ok()) continue;
        auto tf = probe.OpenTorchFile(*id);
        // Some other program's data (not even the start of a torch.save file): not a candidate.
        if (!tf.ok() && !format::LooksLikeTorchFile(*probe.source(*id))) continue;
        // A torch.save file that does not read may be the optimizer's (IsTorchStateDirectory):
        // named, with the reader's reason, rather than served without it.
        if (!tf.ok()) return tf.error();
        const PickleGraph& g = tf->graph();
        if (!FindOptimizers(g).empty()) {
          holders.push_back(torch[i]);
          not_weights.insert(torch[i]);
        } else if (IsSchedulerFile(g)) {
          schedulers.push_back(torch[i]);
          not_weights.insert(torch[i]);
        } else if (!IsStateDictFile(g)) {
          not_weights.insert(torch[i]);
        }
      }
      if (holders.empty()) return NotFoundError(dir + ": no torch.save file holds an optimizer state dict");
      if (holders.size() > 1) {
        return UnsupportedError(dir + ": " + std::to_string(holders.size()) + " torch.save files hold an optimizer "
                                "state dict (" + holders[0] + ", " + holders[1] + "); ucpfs serves one");
      }
      holder = holders[0];
    }
    UCPFS_ASSIGN_OR_RETURN(const uint32_t hid, builder_.AddFile(holder));
    UCPFS_ASSIGN_OR_RETURN(format::TorchFile tf, builder_.OpenTorchFile(hid));
    const std::string where = builder_.source(hid)->Name();
    const PickleGraph& g = tf.graph();
    const bool lightning = IsLightning(g);
    std::vector<FoundOptimizer> found = FindOptimizers(g);
    // A Lightning checkpoint saved with save_weights_only has no optimizer: its weights and
    // non-parameter state are served alone.
    const bool has_optimizer = !found.empty();
    if (!has_optimizer && !lightning) {
      return NotFoundError(where + ": holds no optimizer state dict (state, param_groups)");
    }
    const FoundOptimizer opt = has_optimizer ? found[0] : FoundOptimizer{pickle::kNoNode, "", "optimizer_states"};

    TorchStateSourceFacts info;
    info.has_optimizer = has_optimizer;
    info.optimizer_file = holder;
    info.optimizer_prefix = opt.prefix;
    info.optimizer_top_key = opt.top_key;
    if (lightning) {
      info.framework = "lightning";
      UCPFS_RETURN_IF_ERROR(AddLightningWeights(tf, hid, where, &info));
    } else {
      WeightsOptions wo;
      wo.sub_dir = epoch_dir;
      wo.key_prefix = "model.";
      wo.exclude = not_weights;
      UCPFS_ASSIGN_OR_RETURN(WeightsFound w, AddWeights(builder_, wo, nullptr));
      info.weights_container = w.container;
      info.weights_wrapper = w.state_dict_key;
    }
    std::vector<NamedShape> params;
    for (const Item& it : builder_.checkpoint().items) params.push_back({it.key.substr(6), it.layout.shape});
    // The parameters' named_parameters() order: a torch.save state dict keeps it; safetensors
    // sorts tensors by name, so it comes from the model family config.json names, if known.
    std::string order_unknown;
    std::vector<NamedShape> served_order;  // the items' order when it is not `params`'
    nlohmann::json config;
    std::vector<GroupingRule> rules = {GroupingRule::kInOrder, GroupingRule::kTrainerDecay,
                                       GroupingRule::kTrainerDecayLayerNorm};
    if (!epoch_dir.empty()) {
      // torchtune's recipes: one group over model.parameters() (torchtune's own module order).
      info.framework = "torchtune";
      rules = {GroupingRule::kInOrder};
      config = Config(epoch_dir + "/config.json");
    } else if (!lightning && builder_.tree().IsFile("trainer_state.json")) {
      // The Trainer's decay / no-decay groups.
      info.framework = "hf_trainer";
      rules = {GroupingRule::kTrainerDecay, GroupingRule::kTrainerDecayLayerNorm};
    }
    if (info.weights_container == "safetensors") {
      if (epoch_dir.empty()) config = Config("config.json");
      const std::string model_type = config.value("model_type", std::string());
      const std::optional<ModuleOrder> known = HfModuleOrder(model_type);
      const ModuleOrder hf = known.value_or(ModuleOrder::kHfLlama);
      // torchtune: its llama module (its checkpointer converts Llama-family weights only so).
      const bool has_order = epoch_dir.empty() ? known.has_value() : model_type == "llama";
      const ModuleOrder order = epoch_dir.empty() ? hf : ModuleOrder::kTorchtuneLlama;
      served_order = params;
      if (has_order && SortModuleOrder(&params, order) && SortModuleOrder(&served_order, hf)) {
        info.param_order = ModuleOrderName(order);
        std::map<std::string, size_t> at;
        for (size_t i = 0; i < served_order.size(); ++i) at["model." + served_order[i].name] = i;
        std::vector<Item>& items = builder_.checkpoint().items;
        std::stable_sort(items.begin(), items.end(),
                         [&](const Item& a, const Item& b) { return at[a.key] < at[b.key]; });
      } else {
        order_unknown = "the weights are safetensors, which keep no parameter order (tensors sorted by name), and "
                        "config.json's model_type '" + model_type + "' is not one whose module order ucpfs knows "
                        "(llama, mistral, qwen2, qwen3, gpt2 with their own module names; torchtune: llama)";
      }
    } else {
      info.param_order = "state_dict";
    }
    if (!has_optimizer) return Finish(info, lightning, where, {}, progress);
    PositionalOptimizer po;
    po.group_positions = GroupPositions(g, opt.node);
    const std::string state_prefix = opt.prefix + "state.";
    std::map<int64_t, std::vector<int64_t>> shapes;
    for (const format::TensorRecord& rec : tf.tensors()) {
      if (!rec.key.starts_with(state_prefix)) continue;
      auto ps = SplitState(rec.key.substr(state_prefix.size()));
      if (!ps || ps->second == "step") continue;
      auto [it, inserted] = shapes.try_emplace(ps->first, rec.shape);
      if (!inserted && it->second != rec.shape) {
        return CorruptError(where + ": the state of parameter position " + std::to_string(ps->first) +
                            " has tensors of shapes " + JoinInts(it->second) + " and " + JoinInts(rec.shape));
      }
    }
    po.state_shapes.assign(shapes.begin(), shapes.end());
    PositionalMatch match;
    if (order_unknown.empty()) {
      match = MatchPositions(params, po, rules);
    } else {
      match.why_not = order_unknown;
    }
    std::map<int64_t, std::string> name_of(match.names.begin(), match.names.end());
    if (match.rule) {
      info.grouping = GroupingRuleName(*match.rule);
    } else {
      info.ambiguous = match.why_not;
    }
    std::set<std::string> seen;
    for (const format::TensorRecord& rec : tf.tensors()) {
      if (!rec.key.starts_with(state_prefix)) continue;
      auto ps = SplitState(rec.key.substr(state_prefix.size()));
      if (!ps) continue;
      auto named = name_of.find(ps->first);
      const std::string key = "optimizer.state." +
                              (named != name_of.end() ? named->second
                                                      : std::string(kAmbiguous) + std::to_string(ps->first)) +
                              "." + ps->second;
      if (!seen.insert(key).second) continue;
      std::vector<int64_t> strides;
      if (!rec.contiguous) strides = rec.stride;
      Item item = CheckpointBuilder::WholeTensor(key, rec.dtype, rec.shape, hid, rec.data_offset, std::move(strides));
      if (!epoch_dir.empty() && named != name_of.end() && ps->second != "step") {
        const int64_t heads = RotaryHeads(named->second, config);
        if (heads != 0 && !PlaceRotaryRows(&item, rec, heads)) {
          return UnsupportedError(where + ": '" + rec.key + "' of shape " + JoinInts(rec.shape) +
                                  " does not split into " + std::to_string(heads) + " heads of even size, as " +
                                  "torchtune's q/k layout needs (heads from " + epoch_dir + "/config.json)");
        }
      }
      UCPFS_RETURN_IF_ERROR(builder_.FinishTensor(item, where));
      builder_.AddItem(std::move(item));
    }
    if (found.size() > 1) info.other_optimizers = static_cast<int64_t>(found.size() - 1);
    return Finish(info, lightning, where, schedulers, progress);
  }

 private:
  // The scheduler files as whole-file items, and the checkpoint's format facts.
  Result<Checkpoint> Finish(const TorchStateSourceFacts& info, bool lightning, const std::string& where,
                            const std::vector<std::string>& schedulers, const ScanProgress& progress) {
    for (const std::string& s : schedulers) {
      UCPFS_ASSIGN_OR_RETURN(const uint32_t sid, builder_.AddFile(s));
      Item item;
      item.key = schedulers.size() == 1 ? "lr_scheduler" : "lr_scheduler." + s;
      item.kind = ItemKind::kBytes;
      item.file_id = sid;
      item.n_bytes = builder_.source(sid)->Size();
      builder_.AddItem(std::move(item));
    }
    if (progress) progress(1, 1);
    Checkpoint& c = builder_.checkpoint();
    c.format = std::string(kFormat);
    c.flavor = lightning ? "lightning" : info.framework.empty() ? "torch" : info.framework;
    c.facts = info;
    if (EncodeSourceFacts(c.facts).size() > kMaxSourceFactsBytes) return ResourceExhaustedError(where + ": too much to record");
    return builder_.Take();
  }

  // Lightning's `state_dict.<name>` tensors as `model.<name>`, less the one attribute every name
  // starts with (the LightningModule's wrapped model), if any.
  Status AddLightningWeights(const format::TorchFile& tf, uint32_t id, const std::string& where, TorchStateSourceFacts* info) {
    const std::string prefix = "state_dict.";
    std::vector<const format::TensorRecord*> recs;
    std::set<std::string> firsts;
    bool nested = true;
    for (const format::TensorRecord& rec : tf.tensors()) {
      if (!rec.key.starts_with(prefix) || rec.key.size() == prefix.size()) continue;
      const std::string name = rec.key.substr(prefix.size());
      const size_t dot = name.find('.');
      nested = nested && dot != std::string::npos;
      firsts.insert(name.substr(0, dot));
      recs.push_back(&rec);
    }
    std::string strip;
    if (nested && firsts.size() == 1) strip = *firsts.begin() + ".";
    info->module_prefix = strip;
    std::set<std::string> seen;
    for (const format::TensorRecord* rec : recs) {
      const std::string name = rec->key.substr(prefix.size() + strip.size());
      if (!seen.insert(name).second) continue;
      std::vector<int64_t> strides;
      if (!rec->contiguous) strides = rec->stride;
      Item item = CheckpointBuilder::WholeTensor("model." + name, rec->dtype, rec->shape, id, rec->data_offset,
                                                 std::move(strides));
      UCPFS_RETURN_IF_ERROR(builder_.FinishTensor(item, where));
      builder_.AddItem(std::move(item));
    }
    if (recs.empty()) return NotFoundError(where + ": Lightning checkpoint with no tensor in 'state_dict'");
    return Status::Ok();
  }

  // A Hugging Face config.json of the checkpoint (`rel`), or an empty object.
  nlohmann::json Config(const std::string& rel) {
    auto id = builder_.AddFile(rel);
    if (!id.ok()) return nlohmann::json::object();
    const ByteSource& src = *builder_.source(*id);
    if (src.Size() > (1u << 20)) return nlohmann::json::object();
    auto bytes = ReadRange(src, 0, src.Size(), 1u << 20);
    if (!bytes.ok()) return nlohmann::json::object();
    auto j = nlohmann::json::parse(std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size()),
                                   nullptr, /*allow_exceptions=*/false);
    return j.is_object() ? j : nlohmann::json::object();
  }

  // The heads of a torchtune q_proj / k_proj weight (tune_to_hf permutes those two), else 0.
  static int64_t RotaryHeads(const std::string& name, const nlohmann::json& config) {
    const char* field = name.ends_with(".self_attn.q_proj.weight")   ? "num_attention_heads"
                        : name.ends_with(".self_attn.k_proj.weight") ? "num_key_value_heads"
                                                                     : nullptr;
    if (field == nullptr || !config.contains(field) || !config[field].is_number_integer()) return field ? -1 : 0;
    return config[field].get<int64_t>();
  }

  CheckpointBuilder builder_;
};

// The node at a key path ("optimizer_states.0.") from the root.
NodeId NodeAt(const PickleGraph& g, const std::string& prefix) {
  NodeId n = g.root();
  size_t start = 0;
  while (start < prefix.size() && n != pickle::kNoNode) {
    const size_t dot = prefix.find('.', start);
    const std::string part = prefix.substr(start, dot - start);
    start = dot + 1;
    if (IsListLike(g, n)) {
      const auto items = Items(g, n);
      const bool digits = !part.empty() && part.size() <= 9 &&
                          std::all_of(part.begin(), part.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      const size_t i = digits ? std::stoul(part) : SIZE_MAX;
      n = i < items.size() ? items[i] : pickle::kNoNode;
    } else {
      n = Get(g, n, part);
    }
  }
  return n;
}

// The optimizer's param groups: hyper-parameters as saved, positions named (TorchStateFactsOf).
void AddGroups(const Checkpoint& c, const KeyMapping& mapping, const TorchStateSourceFacts& info, const format::TorchFile& tf,
               const std::shared_ptr<const ByteSource>& src, const format::PlainValueLimits& limits,
               TorchStateFacts* out) {
  const PickleGraph& g = tf.graph();
  const std::string& file = info.optimizer_file;
  const std::string& prefix = info.optimizer_prefix;
  const NodeId opt = NodeAt(g, prefix);
  if (!IsOptimizerStateDict(g, opt)) {
    out->not_served.push_back({file + ": param_groups", src->Name() + ": no optimizer state dict at '" + prefix +
                                                            "' any more"});
    return;
  }
  const std::vector<std::vector<int64_t>> groups = GroupPositions(g, opt);

  // Position -> name: the scanner's rule over the weights, or the user's rules for the
  // ambiguous positions' keys.
  std::map<int64_t, std::string> name_of;
  if (auto rule = ParseGroupingRule(info.grouping)) {
    std::vector<NamedShape> params;
    for (const Item& it : c.items) {
      if (it.kind == ItemKind::kTensor && it.key.starts_with("model.")) params.push_back({it.key.substr(6), it.layout.shape});
    }
    // The items are in the served model's order; the optimizer's may differ (torchtune's).
    if (auto order = ParseModuleOrder(info.param_order)) SortModuleOrder(&params, *order);
    if (auto assigned = AssignPositions(params, groups, *rule)) {
      name_of.insert(assigned->begin(), assigned->end());
    } else {
      out->not_served.push_back({file + ": " + prefix + "param_groups",
                                 std::string("the grouping rule ") + GroupingRuleName(*rule) +
                                     " the index recorded no longer fits the weights; hyper-parameters left out"});
    }
  } else {
    const std::string ambiguous = "optimizer.state." + std::string(kAmbiguous);
    for (const ParamEntry& p : mapping.params) {
      for (int32_t idx : p.item) {
        if (idx < 0) continue;
        const std::string& key = c.items[static_cast<size_t>(idx)].key;
        if (!key.starts_with(ambiguous)) continue;
        auto ps = SplitState(key.substr(ambiguous.size()));
        if (ps && !p.name.starts_with(kAmbiguous)) name_of[ps->first] = p.name;
      }
    }
    size_t n_positions = 0;
    for (const auto& grp : groups) n_positions += grp.size();
    if (name_of.size() != n_positions) {  // not settled by the user's rules
      out->not_served.push_back({file + ": " + prefix + "state",
                                "positional optimizer state not matched to parameter names: " +
                                    info.ambiguous +
                                    "; its keys are optimizer.state.ambiguous.<position>.<field>: pass --rules "
                                    "mapping them to parameter names (state \"$1\")"});
    }
  }
  const auto group_nodes = Items(g, Get(g, opt, "param_groups"));
  for (size_t gi = 0; gi < group_nodes.size() && gi < groups.size(); ++gi) {
    TorchStateGroup group;
    for (const auto& [k, v] : Pairs(g, group_nodes[gi])) {
      if (g.kind(k) != Kind::kString || g.text(k) == "params" || g.text(k) == "param_names") continue;
      auto value = format::DecodeValueAt(tf, src, v, limits);
      if (!value.ok()) {
        out->not_served.push_back({file + ": " + prefix + "param_groups." + std::to_string(gi) + "." +
                                      std::string(g.text(k)),
                                  value.error().message()});
        continue;
      }
      group.fields.emplace_back(std::string(g.text(k)), std::move(*value));
    }
    size_t unnamed = 0;
    for (int64_t p : groups[gi]) {
      auto it = name_of.find(p);
      if (it == name_of.end()) ++unnamed;
      else group.params.push_back(it->second);
    }
    if (unnamed != 0 && name_of.size() != 0) {
      out->not_served.push_back({file + ": " + prefix + "param_groups." + std::to_string(gi),
                                std::to_string(unnamed) + " of its parameter positions are not matched to names"});
    }
    out->groups.push_back(std::move(group));
  }

}

// What a nesting file keeps beside the optimizer and the weights: non-parameter state.
void AddExtras(const TorchStateSourceFacts& info, const format::TorchFile& tf, const std::shared_ptr<const ByteSource>& src,
               const format::PlainValueLimits& limits, TorchStateFacts* out) {
  const PickleGraph& g = tf.graph();
  const std::string& prefix = info.optimizer_prefix;
  // Lightning's epoch, global_step, lr_schedulers, loops; torchtune's seed, epochs_run.
  const std::string& top = info.optimizer_top_key;
  if (!top.empty()) {
    for (const auto& [k, v] : Pairs(g, g.root())) {
      if (g.kind(k) != Kind::kString) continue;
      const std::string key(g.text(k));
      if (key == "state_dict") continue;
      if (key == top) {
        const auto items = Items(g, v);
        for (size_t i = 1; i < items.size(); ++i) {
          out->not_served.push_back({key + "." + std::to_string(i), "a second optimizer: only " + prefix +
                                                                      " is matched to parameters"});
        }
        continue;
      }
      auto value = format::DecodeValueAt(tf, src, v, limits);
      if (!value.ok()) {
        out->not_served.push_back({key, value.error().message()});
        continue;
      }
      ExtraItem e;
      e.key = key;
      e.value = std::move(*value);
      out->extras.push_back(std::move(e));
    }
  }
}

}  // namespace

bool IsTorchStateDirectory(const SourceTree& tree) {
  if (!TorchtuneEpochDir(tree).empty()) return true;
  size_t probed = 0;
  CheckpointBuilder probe(tree);
  const std::vector<std::string> names = RegularFileNames(tree, "");
  const size_t torch_files = static_cast<size_t>(
      std::count_if(names.begin(), names.end(), [](const std::string& n) { return IsTorchName(n); }));
  for (const std::string& name : names) {
    const bool ckpt = EndsWith(name, ".ckpt");
    if ((!ckpt && !IsTorchName(name)) || probed >= kMaxProbedFiles) continue;
    ++probed;
    auto id = probe.AddFile(name);
    if (!id.ok()) continue;
    auto tf = probe.OpenTorchFile(*id);
    // A .ckpt, or a torch.save file beside others, that does not read is claimed, so the scan
    // names it and the reader's reason (a truncated optim.pt, optimizer.pt or .ckpt), rather than
    // the weights scanner serving the rest without a word about it, or failing on how many
    // files there are. A file that does not even begin as a torch.save file does is some other
    // program's data (format::LooksLikeTorchFile), not a broken optimizer.
    if (!tf.ok() && !ckpt && !format::LooksLikeTorchFile(*probe.source(*id))) continue;
    if (!tf.ok()) return ckpt || torch_files > 1;
    if (!FindOptimizers(tf->graph()).empty() || (ckpt && IsLightning(tf->graph()))) return true;
  }
  return false;
}

Result<Checkpoint> ScanTorchState(const SourceTree& tree, const ScanProgress& progress) {
  return TorchStateScan(tree).Run(progress);
}

TorchStateFacts TorchStateFactsOf(const Checkpoint& c, const KeyMapping& mapping, const FileTable& files) {
  TorchStateFacts out;
  const TorchStateSourceFacts* facts = std::get_if<TorchStateSourceFacts>(&c.facts);
  if (facts == nullptr) return out;
  const TorchStateSourceFacts& info = *facts;
  const std::string& file = info.optimizer_file;
  auto fail = [&](const std::string& why) {
    out.not_served.push_back({file + ": param_groups", why});
    return out;
  };
  uint32_t id = UINT32_MAX;
  for (size_t i = 0; i < c.files.size(); ++i) {
    if (c.files[i].rel_path == file) id = static_cast<uint32_t>(i);
  }
  if (id == UINT32_MAX || id >= files->size()) return fail("index: the optimizer file is not in the file table");
  const std::shared_ptr<const ByteSource>& src = (*files)[id];
  auto tf = format::TorchFile::Open(src);
  if (!tf.ok()) return fail(tf.error().message());
  format::PlainValueLimits limits;
  limits.max_depth = 16;
  limits.max_nodes = 1 << 20;
  if (info.has_optimizer) AddGroups(c, mapping, info, *tf, src, limits, &out);
  AddExtras(info, *tf, src, limits, &out);
  return out;
}

}  // namespace ucpfs::index
