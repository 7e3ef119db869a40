// GCC 12 with -fsanitize=address,undefined -O2 reports a false -Wmaybe-uninitialized inside
// libstdc++'s <regex> (GCC PR 105562; see key_map.cc): off before <regex> is first included.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "views/view_inputs.h"

#include <algorithm>
#include <map>
#include <optional>
#include <regex>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "core/format/plain_value.h"
#include "core/layout/fused_qkv.h"
#include "core/slice/local_view.h"
#include "views/atomic.h"
#include "index/dcp_scan.h"
#include "index/megatron_scan.h"
#include "index/torch_state_scan.h"
#include "views/universal_view.h"

namespace ucpfs::index {

namespace {

using format::SaveValue;

// Non-tensor items larger than this are not decoded (they are reported instead).
constexpr uint64_t kMaxOtherItemBytes = 64ull << 20;

// `<prefix>param_groups[.<rest>]` with prefix "", "optimizer.", "optim." or one of the optimizer
// prefixes the key mapping found (KeyMapping::optimizer_prefixes, e.g. the DCP tutorial's
// `app.optim.`): returns the prefix (with its dot) and rest, or nothing for any other key.
std::optional<std::pair<std::string, std::string>> SplitParamGroups(const std::string& key,
                                                                    const std::vector<std::string>& found) {
  constexpr std::string_view kGroups = "param_groups";
  auto split = [&](const std::string& prefix) -> std::optional<std::pair<std::string, std::string>> {
    if (key.size() < prefix.size() + kGroups.size() || key.compare(0, prefix.size(), prefix) != 0 ||
        key.compare(prefix.size(), kGroups.size(), kGroups) != 0) {
      return std::nullopt;
    }
    const size_t end = prefix.size() + kGroups.size();
    if (end == key.size()) return std::make_pair(prefix, std::string());
    if (key[end] != '.' || end + 1 == key.size()) return std::nullopt;
    return std::make_pair(prefix, key.substr(end + 1));
  };
  for (const char* prefix : {"", "optimizer.", "optim."}) {
    if (auto s = split(prefix)) return s;
  }
  for (const std::string& prefix : found) {
    if (auto s = split(prefix)) return s;
  }
  return std::nullopt;
}

bool AllDigits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A `dp_rank_<d>` component of a key (torchtitan keeps each DP rank's dataloader state under
// `dataloader.dp_rank_<d>`): d, and the key with that component written `dp_rank_*`.
std::optional<std::pair<int, std::string>> RankLocal(const std::string& key) {
  static const std::regex kRe(R"((^|\.)dp_rank_([0-9]{1,9})(\.|$))");
  std::smatch m;
  if (!std::regex_search(key, m, kRe)) return std::nullopt;
  const int d = std::stoi(m[2].str());
  const std::string group = m.prefix().str() + m[1].str() + "dp_rank_*" + m[3].str() + m.suffix().str();
  return std::make_pair(d, group);
}

constexpr uint64_t kWholeItemReadBytes = 1 << 20;

// Small non-tensor items' bytes read ahead, by item index (PreReadSmallItems).
using PreRead = std::unordered_map<int32_t, std::vector<std::byte>>;

// Reads the small non-tensor items among `indices` (each at most kWholeItemReadBytes), each
// file's as one batch (ByteSource::ReadPieces: on an object store, ranged GETs in flight at once
// instead of one round trip per item). A file whose batch fails is left out: ItemValue reads
// its items alone and reports its own error.
PreRead PreReadSmallItems(const Checkpoint& c, const std::vector<int32_t>& indices, const FileTable& files) {
  std::map<uint32_t, std::vector<int32_t>> by_file;
  uint64_t total = 0;
  for (int32_t idx : indices) {
    if (idx < 0 || static_cast<size_t>(idx) >= c.items.size()) continue;
    const Item& it = c.items[static_cast<size_t>(idx)];
    if (it.kind == ItemKind::kTensor || it.n_bytes > kWholeItemReadBytes || it.file_id >= files->size()) continue;
    if (total + it.n_bytes > kMaxOtherItemBytes) break;  // bounded: the rest are read one by one
    total += it.n_bytes;
    by_file[it.file_id].push_back(idx);
  }
  PreRead out;
  for (const auto& [file_id, idxs] : by_file) {
    const ByteSource& file = *(*files)[file_id];
    std::vector<std::vector<std::byte>> bytes(idxs.size());
    std::vector<ReadPiece> pieces;
    bool in_range = true;
    for (size_t i = 0; i < idxs.size(); ++i) {
      const Item& it = c.items[static_cast<size_t>(idxs[i])];
      if (it.byte_offset > file.Size() || it.n_bytes > file.Size() - it.byte_offset) in_range = false;
      bytes[i].resize(it.n_bytes);
      pieces.push_back({it.byte_offset, bytes[i]});
    }
    if (!in_range || !file.ReadPieces(pieces).ok()) continue;
    for (size_t i = 0; i < idxs.size(); ++i) out[idxs[i]] = std::move(bytes[i]);
  }
  return out;
}

// The value of an item: a decoded blob, or a tensor read lazily from its fragments. `pre`
// (may be null): bytes of small items read ahead (an item's are moved out when used).
Result<SaveValue> ItemValue(const Item& it, const FileTable& files, PreRead* pre = nullptr, int32_t index = -1) {
  if (it.kind == ItemKind::kTensor) {
    return SaveValue::Tensor(it.dtype, it.layout.shape,
                             std::make_shared<views::LayoutProvider>(
                                 std::make_shared<const slice::TensorLayout>(it.layout), it.dtype, files));
  }
  if (it.n_bytes > kMaxOtherItemBytes) {
    return ResourceExhaustedError("a non-tensor item of " + std::to_string(it.n_bytes) +
                                  " bytes, over the " + std::to_string(kMaxOtherItemBytes >> 20) +
                                  " MiB that are decoded");
  }
  if (it.file_id >= files->size()) return CorruptError("item file id out of range");
  UCPFS_ASSIGN_OR_RETURN(auto blob, SliceSource::Make((*files)[it.file_id], it.byte_offset, it.n_bytes));
  if (it.n_bytes <= kWholeItemReadBytes) {
    // A small blob is read whole, once (or was, with its file's other small items: `pre`): its
    // decoder's several small reads (zip records, the pickle) would each be a request to an
    // object store. Named as the slice it is, read ahead or not.
    std::vector<std::byte> bytes;
    if (auto found = pre != nullptr ? pre->extract(index) : PreRead::node_type(); !found.empty()) {
      bytes = std::move(found.mapped());
    } else {
      bytes.resize(it.n_bytes);
      UCPFS_RETURN_IF_ERROR(blob->ReadAt(0, bytes));
    }
    return format::DecodePlainValue(std::make_shared<MemorySource>(blob->Name(), std::move(bytes)));
  }
  return format::DecodePlainValue(std::move(blob));
}

// The fields of one param group dict (everything but params / param_names), in order.
std::vector<views::HyperParam> GroupFields(const SaveValue& group) {
  std::vector<views::HyperParam> out;
  for (const auto& [k, v] : group.dict_items()) {
    if (k.kind() != SaveValue::Kind::kString || k.string_value() == "params" ||
        k.string_value() == "param_names") {
      continue;
    }
    out.emplace_back(k.string_value(), v);
  }
  return out;
}

// The parameter names of a param group's `params` value, or an error saying why not. Positions
// (torch.optim's own state_dict) are names through `positional` (KeyMapping::positional_names).
Result<std::vector<std::string>> GroupParams(const SaveValue& params,
                                             const std::vector<std::string>& positional) {
  if (params.kind() != SaveValue::Kind::kList && params.kind() != SaveValue::Kind::kTuple) {
    return InvalidArgumentError("'params' is not a list");
  }
  std::vector<std::string> names;
  for (const auto& p : params.items()) {
    if (p.kind() == SaveValue::Kind::kString) {
      names.push_back(p.string_value());
    } else if (p.kind() == SaveValue::Kind::kInt && p.int_value() >= 0 &&
               static_cast<uint64_t>(p.int_value()) < positional.size()) {
      names.push_back(positional[static_cast<size_t>(p.int_value())]);
    } else {
      return InvalidArgumentError("'params' holds parameter positions (torch.optim's own state_dict) "
                                  "that cannot be matched to the checkpoint's " +
                                  std::to_string(positional.size()) + " matched parameters");
    }
  }
  return names;
}

// The tensor layout of state `k` of `p`, or null.
const slice::TensorLayout* TensorState(const Checkpoint& c, const ParamEntry& p, StateKind k) {
  const int32_t i = p.item[static_cast<int>(k)];
  if (i < 0 || c.items[static_cast<size_t>(i)].kind != ItemKind::kTensor) return nullptr;
  return &c.items[static_cast<size_t>(i)].layout;
}

// A fused parameter's optimizer state (FusedParams): its first moment, else its second.
const slice::TensorLayout* FusedMoment(const Checkpoint& c, const ParamEntry& p) {
  const slice::TensorLayout* moment = TensorState(c, p, StateKind::kExpAvg);
  return moment ? moment : TensorState(c, p, StateKind::kExpAvgSq);
}
int64_t FusedStateRows(const Checkpoint& c, const ParamEntry& p) { return FusedMoment(c, p)->shape.at(0); }

// How a fused parameter is served, for status.json and inspect (views::FusedParam::note).
std::string FusedNote(const std::string& param, int64_t rows, const std::vector<std::string>& parts,
                      const std::vector<int64_t>& part_rows, const layout::ModelInfo& facts) {
  auto qkv = layout::FusedQkvOf(param, rows, parts, part_rows, facts);
  if (!qkv.ok()) {
    return "model.pt holds the split weights and optim.pt the fused state; atomic/ serves the weights under the "
           "split names and the moments and step under the fused name only: " + qkv.error().message();
  }
  return "model.pt holds the split weights and optim.pt the fused state; atomic/ serves the moments and step "
         "under the split names too, rows grouped per key-value head (" + std::to_string(qkv->n_kv_heads) +
         " key-value heads of " + std::to_string(qkv->heads_per_kv) + " query heads, head_dim " +
         std::to_string(qkv->head_dim) + ")";
}

// Parameters the optimizer holds fused while the model saves the weight split, found by
// structure: optimizer state `<m>.<a>.<s>` with no weight, and weights with no optimizer state
// `<m>.<b>.<s>`, `<m>.<c>.<s>`, ... (the same module `<m>`, the same last component `<s>`: at
// least two, all of them) whose dim-0 sizes add up to the state's, other dims equal. torchtitan's
// FusedQKVLinear: `qkv_linear.wqkv.weight` state [768, 256], `qkv_linear.wq|wk|wv.weight`
// weights [256, 256] each. Per fused parameter: the indices (into mapping.params) of its split
// weights, in source order. How the fused rows interleave the split ones (per kv head group:
// [q heads; k; v]) needs the head dimension, which the checkpoint does not store
// (layout::FusedQkvOf takes it from the user's facts).
std::map<size_t, std::vector<size_t>> FusedParams(const Checkpoint& c, const KeyMapping& mapping) {
  auto module_and_last = [](const std::string& name) -> std::optional<std::pair<std::string, std::string>> {
    const size_t last = name.rfind('.');
    if (last == std::string::npos || last == 0) return std::nullopt;
    const size_t leaf = name.rfind('.', last - 1);
    if (leaf == std::string::npos) return std::nullopt;
    return std::make_pair(name.substr(0, leaf), name.substr(last + 1));
  };
  std::map<std::pair<std::string, std::string>, std::vector<size_t>> weight_only;  // (m, s) -> params
  for (size_t i = 0; i < mapping.params.size(); ++i) {
    const auto& p = mapping.params[i];
    const bool weight = TensorState(c, p, StateKind::kWeight) != nullptr;
    const bool optimizer = p.item[static_cast<int>(StateKind::kFp32)] >= 0 ||
                           p.item[static_cast<int>(StateKind::kExpAvg)] >= 0 ||
                           p.item[static_cast<int>(StateKind::kExpAvgSq)] >= 0 ||
                           p.item[static_cast<int>(StateKind::kStep)] >= 0;
    if (!weight || optimizer) continue;
    if (auto ms = module_and_last(p.name)) weight_only[*ms].push_back(i);
  }
  std::map<size_t, std::vector<size_t>> out;
  for (size_t i = 0; i < mapping.params.size(); ++i) {
    const auto& p = mapping.params[i];
    if (TensorState(c, p, StateKind::kWeight) || TensorState(c, p, StateKind::kFp32)) continue;
    const slice::TensorLayout* moment = FusedMoment(c, p);
    if (!moment || moment->shape.empty()) continue;
    auto ms = module_and_last(p.name);
    if (!ms) continue;
    auto it = weight_only.find(*ms);
    if (it == weight_only.end() || it->second.size() < 2) continue;
    int64_t rows = 0;
    bool fits = true;
    for (size_t w : it->second) {
      const auto& shape = TensorState(c, mapping.params[w], StateKind::kWeight)->shape;
      fits = fits && shape.size() == moment->shape.size() &&
             std::equal(shape.begin() + 1, shape.end(), moment->shape.begin() + 1);
      if (fits) rows += shape[0];
    }
    if (!fits || rows != moment->shape[0]) continue;
    out[i] = it->second;
    weight_only.erase(it);  // a split weight belongs to one fused parameter
  }
  return out;
}

}  // namespace

// Builds the target input from the index: every mapped parameter's tensor states and step, the
// optimizer hyper-parameters, and every other item as extra state or as a reported item.
void ApplyPatterns(views::TargetInput& input, const PatternOptions& patterns, std::optional<std::vector<int>> pp_split) {
  input.preset = patterns.preset;
  input.rules = patterns.rules;
  input.vocab_size = patterns.vocab_size;
  input.model_facts = patterns.model_facts;
  input.pp_split = std::move(pp_split);
  for (views::FusedParam& f : input.fused) {
    f.note = FusedNote(f.param, f.rows, f.stored_as, f.stored_rows, patterns.model_facts);
  }
}

std::shared_ptr<const slice::TensorLayout> KeptLayout(const Item& item, const std::shared_ptr<const void>& owner) {
  if (owner) return std::shared_ptr<const slice::TensorLayout>(owner, &item.layout);
  return std::make_shared<const slice::TensorLayout>(item.layout);
}

Result<std::shared_ptr<views::TargetInput>> MakeTargetInput(
    const Checkpoint& c, const std::shared_ptr<const void>& owner, const KeyMapping& mapping, const FileTable& files,
    const std::function<void(const std::string&)>& warn) {
  auto in = std::make_shared<views::TargetInput>();
  in->files = files;
  std::unordered_set<std::string> param_names;
  for (const auto& p : mapping.params) param_names.insert(p.name);

  // Hyper-parameters per parameter fqn. Two spellings: torchtitan's flattened
  // `<prefix>param_groups.<fqn>.<field>`, and torch.distributed.checkpoint's flattening of
  // get_optimizer_state_dict, `<prefix>param_groups.<i>.<field>` next to
  // `<prefix>param_groups.<i>.params` (the group's fqns); also a whole group or the whole list
  // in one item.
  std::map<std::string, std::vector<views::HyperParam>> hyper;
  // Each parameter's source group (views::TargetParam::group): the one its hyper-parameters come from.
  std::map<std::string, int> group_of_param;
  int n_groups = 0;
  auto take_group = [&](const std::string& name, const std::vector<views::HyperParam>& fields, int group_number) {
    auto& h = hyper[name];
    if (!h.empty()) return;
    h = fields;
    group_of_param[name] = group_number;
  };
  struct Group {
    std::vector<std::string> item_keys;
    std::optional<std::vector<std::string>> params;
    std::string params_error;
    std::vector<views::HyperParam> fields;
  };
  std::map<std::string, Group> groups;  // "<prefix>param_groups.<i>" -> group, in key order
  std::vector<std::string> group_order;
  auto group_of = [&](const std::string& id) -> Group& {
    auto [it, inserted] = groups.try_emplace(id);
    if (inserted) group_order.push_back(id);
    return it->second;
  };
  auto add_group_dict = [&](const std::string& id, const std::string& key, const SaveValue& dict) {
    Group& g = group_of(id);
    g.item_keys.push_back(key);
    for (auto& f : GroupFields(dict)) g.fields.push_back(std::move(f));
    for (const auto& [k, v] : dict.dict_items()) {
      if (k.kind() == SaveValue::Kind::kString && k.string_value() == "params") {
        auto names = GroupParams(v, mapping.positional_names);
        if (names.ok()) {
          g.params = std::move(*names);
        } else {
          g.params_error = names.error().message();
        }
      }
    }
  };
  auto report = [&](const std::string& key, const std::string& reason) {
    in->not_served.push_back({key, reason});
    if (warn) warn(key + ": not served: " + reason);
  };

  const auto* dcp = std::get_if<DcpSourceFacts>(&c.facts);
  const bool megatron_core = dcp != nullptr && dcp->megatron_core;
  PreRead pre = PreReadSmallItems(c, mapping.other_items, files);
  for (int32_t idx : mapping.other_items) {
    const Item& it = c.items[static_cast<size_t>(idx)];
    if (megatron_core && it.kind == ItemKind::kTensor &&
        it.key.find("optimizer.distributed.") != std::string::npos && it.key.find(".gbuf_idx_") != std::string::npos) {
      // Copied whole into every rank's extra_state.pt it would be the whole optimizer state, of
      // the source's layout, on each rank.
      report(it.key, "Megatron DistributedOptimizer 'dp_reshardable' bucket: a flat buffer of many parameters "
                     "whose parameter ranges the checkpoint does not store; not split into parameters "
                     "(save with 'fully_reshardable' for atomic and target optimizer state)");
      continue;
    }
    auto value = ItemValue(it, files, &pre, idx);
    if (!value.ok()) {
      report(it.key, value.error().message());
      continue;
    }
    if (auto pg = SplitParamGroups(it.key, mapping.optimizer_prefixes)) {
      const auto& [prefix, rest] = *pg;
      const std::string base = prefix + "param_groups";
      if (rest.empty()) {  // the whole list of groups
        if (value->kind() != SaveValue::Kind::kList) {
          report(it.key, "param_groups is not a list of dicts");
          continue;
        }
        for (size_t g = 0; g < value->items().size(); ++g) {
          if (value->items()[g].kind() == SaveValue::Kind::kDict) {
            add_group_dict(base + "." + std::to_string(g), it.key, value->items()[g]);
          }
        }
        continue;
      }
      if (AllDigits(rest) && value->kind() == SaveValue::Kind::kDict) {  // one group
        add_group_dict(base + "." + rest, it.key, *value);
        continue;
      }
      const size_t dot = rest.rfind('.');
      if (dot != std::string::npos) {
        const std::string head = rest.substr(0, dot), field = rest.substr(dot + 1);
        if (param_names.count(head) != 0) {  // torchtitan: param_groups.<fqn>.<field>
          if (field != "params" && field != "param_names") hyper[head].emplace_back(field, std::move(*value));
          continue;
        }
        if (AllDigits(head)) {  // param_groups.<i>.<field>
          Group& g = group_of(base + "." + head);
          g.item_keys.push_back(it.key);
          if (field == "params") {
            auto names = GroupParams(*value, mapping.positional_names);
            if (names.ok()) {
              g.params = std::move(*names);
            } else {
              g.params_error = names.error().message();
            }
          } else if (field != "param_names") {
            g.fields.emplace_back(field, std::move(*value));
          }
          continue;
        }
      }
      report(it.key, "an optimizer param_groups entry of no known parameter or group");
      continue;
    }
    views::ExtraItem e;
    e.key = it.key;
    e.value = std::move(*value);
    if (auto rl = RankLocal(it.key)) {
      e.dp_rank = rl->first;
      e.group = rl->second;
    }
    in->extras.push_back(std::move(e));
  }
  // DeepSpeed keeps its param groups inside the optimizer files, not as items.
  if (std::holds_alternative<DeepSpeedSourceFacts>(c.facts)) {
    auto ds_groups = DeepSpeedParamGroups(c, files);
    if (!ds_groups.ok()) {
      in->not_served.push_back({DeepSpeedParamGroupsKey(c), ds_groups.error().message()});
      if (warn) warn("DeepSpeed param groups: not served: " + ds_groups.error().message());
    } else {
      for (const DeepSpeedParamGroup& g : *ds_groups) {
        const int group_number = n_groups++;
        for (const std::string& name : g.params) take_group(name, g.fields, group_number);
      }
    }
  }
  // A positional optimizer in torch.save files keeps its groups, and its file the trainer's other
  // state, inside pickles (torch_state_scan.h).
  {
    TorchStateFacts ts = TorchStateFactsOf(c, mapping, files);
    for (const TorchStateGroup& g : ts.groups) {
      const int group_number = n_groups++;
      for (const std::string& name : g.params) take_group(name, g.fields, group_number);
    }
    for (auto& e : ts.extras) in->extras.push_back(std::move(e));
    for (const auto& n : ts.not_served) report(n.key, n.reason);
  }
  for (const std::string& id : group_order) {
    Group& g = groups[id];
    if (!g.params) {
      const std::string why = g.params_error.empty() ? "the group has no 'params' list naming its parameters"
                                                     : g.params_error;
      for (const auto& k : g.item_keys) report(k, "hyper-parameters of " + id + " left out of optim.pt: " + why);
      continue;
    }
    const int group_number = n_groups++;
    for (const auto& name : *g.params) take_group(name, g.fields, group_number);
  }

  // Megatron-Core torch_dist keeps its param groups, without their parameters, and its step in
  // common.pt (dcp_scan.h).
  MegatronCoreOptimizerFacts mcore = MegatronCoreOptimizerFactsOf(c, mapping, files);
  for (const MegatronCoreParamGroup& g : mcore.groups) {
    const int group_number = n_groups++;
    for (const std::string& name : g.params) take_group(name, g.fields, group_number);
  }
  for (const auto& n : mcore.not_served) report(n.key, n.reason);
  // Megatron's distributed optimizer keeps its step in the param groups only (megatron_scan.h,
  // dcp_scan.h).
  std::optional<double> group_step = MegatronOptimizerStep(c);
  if (!group_step) group_step = mcore.step;
  // A fused parameter's split weights are listed right after it (as the model's state_dict
  // lists them where the fused one would be).
  const std::map<size_t, std::vector<size_t>> fused = FusedParams(c, mapping);
  std::vector<size_t> order;
  std::vector<char> split_weight(mapping.params.size(), 0);
  for (const auto& [f, parts] : fused) {
    views::FusedParam fp;
    fp.param = mapping.params[f].name;
    fp.rows = FusedStateRows(c, mapping.params[f]);
    for (size_t w : parts) {
      split_weight[w] = 1;
      fp.stored_as.push_back(mapping.params[w].name);
      fp.stored_rows.push_back(TensorState(c, mapping.params[w], StateKind::kWeight)->shape[0]);
    }
    fp.note = FusedNote(fp.param, fp.rows, fp.stored_as, fp.stored_rows, {});
    in->fused.push_back(std::move(fp));
  }
  for (size_t i = 0; i < mapping.params.size(); ++i) {
    if (split_weight[i]) continue;
    order.push_back(i);
    if (auto f = fused.find(i); f != fused.end()) order.insert(order.end(), f->second.begin(), f->second.end());
  }
  for (size_t pi : order) {
    const auto& p = mapping.params[pi];
    views::TargetParam tp;
    tp.name = p.name;
    tp.in_model = fused.count(pi) == 0;
    tp.in_optimizer = split_weight[pi] == 0;
    if (group_step && p.item[static_cast<int>(StateKind::kStep)] < 0 &&
        p.item[static_cast<int>(StateKind::kExpAvg)] >= 0) {
      tp.step_value = group_step;
    }
    for (int k = 0; k < kNumStateKinds; ++k) {
      if (p.item[k] < 0) continue;
      const auto& it = c.items[static_cast<size_t>(p.item[k])];
      tp.keys[k] = it.key;
      if (it.kind == ItemKind::kTensor) {
        tp.states[k] = KeptLayout(it, owner);
        tp.dtypes[k] = it.dtype;
        continue;
      }
      // A step stored as a Python number (MapKeys lets no other state be a non-tensor item).
      auto value = ItemValue(it, files);
      if (value.ok() && value->kind() == SaveValue::Kind::kInt) {
        tp.step_value = static_cast<double>(value->int_value());
      } else if (value.ok() && value->kind() == SaveValue::Kind::kFloat) {
        tp.step_value = value->float_value();
      } else {
        tp.keys[k].clear();
        report(it.key, value.ok() ? "an optimizer step that is not a number or a tensor"
                                  : value.error().message());
      }
    }
    if (!tp.states[0] && !tp.states[1] && tp.in_model) {
      // Optimizer-only leftovers: state for a parameter with no model tensor.
      for (int k = 0; k < kNumStateKinds; ++k) {
        if (p.item[k] >= 0) {
          report(c.items[static_cast<size_t>(p.item[k])].key,
                 "optimizer state of parameter '" + p.name + "', which has no weight in the checkpoint");
        }
      }
      continue;
    }
    if (auto h = hyper.find(p.name); h != hyper.end()) tp.hyper = h->second;
    if (auto g = group_of_param.find(p.name); g != group_of_param.end()) tp.group = g->second;
    in->params.push_back(std::move(tp));
  }
  return in;
}

Result<PatternOptions> PatternOptionsFor(const Checkpoint& checkpoint, layout::Preset preset,
                                         std::vector<layout::Rule> user_rules, int64_t vocab_pad_multiple,
                                         const layout::ModelInfo& user_facts) {
  PatternOptions o;
  o.preset = preset;
  o.rules = std::move(user_rules);
  UCPFS_ASSIGN_OR_RETURN(SourcePatterns own, SourcePatternsOf(checkpoint));
  for (auto& r : own.rules) o.rules.push_back(std::move(r));
  o.vocab_size = own.vocab_size;
  o.model_facts = own.model_facts;
  if (std::holds_alternative<MegatronSourceFacts>(checkpoint.facts)) {
    UCPFS_ASSIGN_OR_RETURN(o.model_facts, MegatronModelFacts(checkpoint));
    if (o.model_facts.vocab_size > 0) o.vocab_size = o.model_facts.vocab_size;
  }
  if (const auto* w = std::get_if<WeightsSourceFacts>(&checkpoint.facts); w && preset == layout::Preset::kMegatronCore) {
    // A Hugging Face model folder served as Megatron-Core ranks: its config.json says what the
    // names and shapes cannot (heads, key-value heads).
    if (!w->hf_config_error.empty()) return InvalidArgumentError("--preset megatron-core: " + w->hf_config_error);
    if (w->hf_config) {
      UCPFS_ASSIGN_OR_RETURN(o.model_facts, MegatronCoreFactsOf(*w->hf_config));
      if (o.model_facts.vocab_size > 0) o.vocab_size = o.model_facts.vocab_size;
    }
  }
  if (vocab_pad_multiple > 0) o.model_facts.vocab_pad_multiple = vocab_pad_multiple;  // the user's wins
  layout::ApplyModelFacts(user_facts, &o.model_facts);
  return o;
}

Result<std::vector<AtomicView>> BuildAtomicViews(const Checkpoint& c, const std::shared_ptr<const void>& owner,
                                                 const KeyMapping& mapping, const FileTable& files,
                                                 const PatternOptions& patterns) {
  // Every parameter with a tensor weight or master, and its pattern.
  std::vector<views::PatternParam> pattern_params;
  std::vector<size_t> pattern_of(mapping.params.size(), SIZE_MAX);
  for (size_t i = 0; i < mapping.params.size(); ++i) {
    const auto& p = mapping.params[i];
    int32_t primary = p.item[static_cast<int>(StateKind::kWeight)];
    if (primary < 0) primary = p.item[static_cast<int>(StateKind::kFp32)];
    if (primary < 0) primary = p.item[static_cast<int>(StateKind::kExpAvg)];  // a fused parameter's moments (FusedParams)
    if (primary < 0 || c.items[static_cast<size_t>(primary)].kind != ItemKind::kTensor) continue;
    const auto& layout = c.items[static_cast<size_t>(primary)].layout;
    pattern_of[i] = pattern_params.size();
    pattern_params.push_back({p.name, layout.shape, views::ShardDim(layout)});
  }
  UCPFS_ASSIGN_OR_RETURN(views::ModelPatterns mp,
                         views::PatternsOf(pattern_params, patterns.preset, patterns.rules, patterns.vocab_size,
                                           patterns.model_facts));
  struct AtomicState {
    const char* file;
    StateKind primary;
    int fallback;  // the state used when `primary` is absent, or -1
  };
  const AtomicState kStates[] = {{"fp32.pt", StateKind::kFp32, static_cast<int>(StateKind::kWeight)},
                                 {"exp_avg.pt", StateKind::kExpAvg, -1},
                                 {"exp_avg_sq.pt", StateKind::kExpAvgSq, -1}};
  // A fused parameter whose interleave is known (layout::FusedQkvOf, from the user's facts) is
  // served under its split weights' names only: each takes its rows of the fused optimizer
  // state, and the fused step. Otherwise each side keeps its own names (FusedNote says why).
  struct SplitState {
    size_t fused;                                      // index into mapping.params
    std::vector<std::pair<int64_t, int64_t>> rows;     // of the fused state, per key-value head
  };
  std::map<size_t, SplitState> split_of;               // a split weight's index -> its state
  std::unordered_set<size_t> served_split;             // fused parameters served that way
  for (const auto& [f, parts] : FusedParams(c, mapping)) {
    std::vector<std::string> names;
    std::vector<int64_t> rows;
    for (size_t w : parts) {
      names.push_back(mapping.params[w].name);
      rows.push_back(TensorState(c, mapping.params[w], StateKind::kWeight)->shape[0]);
    }
    auto qkv = layout::FusedQkvOf(mapping.params[f].name, FusedStateRows(c, mapping.params[f]), names, rows,
                                  patterns.model_facts);
    if (!qkv.ok()) continue;
    served_split.insert(f);
    for (size_t i = 0; i < parts.size(); ++i) split_of[parts[i]] = {f, qkv->FusedRowsOf(i)};
  }
  // An atomic file's size follows from its shape and pattern alone (views::BuildAtomicFile): one
  // file of each is built to size all of that kind, then dropped; each is built again on open.
  std::map<std::tuple<std::vector<int64_t>, std::optional<int64_t>, bool>, uint64_t> size_of_kind;
  std::vector<AtomicView> out;
  for (size_t pi = 0; pi < mapping.params.size(); ++pi) {
    if (served_split.count(pi) != 0) continue;
    const auto& p = mapping.params[pi];
    const auto split = split_of.find(pi);
    const views::AtomicPattern pattern =
        pattern_of[pi] == SIZE_MAX ? views::AtomicPattern{} : views::AtomicPatternOf(mp.patterns[pattern_of[pi]]);
    for (const auto& s : kStates) {
      const ParamEntry& holder = split != split_of.end() && s.primary != StateKind::kFp32 ? mapping.params[split->second.fused] : p;
      int32_t item = holder.item[static_cast<int>(s.primary)];
      if (item < 0 && s.fallback >= 0) item = p.item[s.fallback];
      if (item < 0) continue;
      const auto& it = c.items[static_cast<size_t>(item)];
      if (it.kind != ItemKind::kTensor) continue;
      AtomicView v{.dir = views::AtomicDirName(p.name), .file = s.file, .n_bytes = 0, .build = nullptr};
      std::shared_ptr<const slice::TensorLayout> layout;
      if (&holder != &p) {  // this weight's rows of the fused state
        std::vector<slice::Box> pieces;
        std::vector<int64_t> shape = it.layout.shape;
        shape[0] = 0;
        for (const auto& [row_lo, n_rows] : split->second.rows) {
          slice::Box b{std::vector<int64_t>(shape.size(), 0), it.layout.shape};
          b.offsets[0] = row_lo;
          b.sizes[0] = n_rows;
          shape[0] += n_rows;
          pieces.push_back(std::move(b));
        }
        UCPFS_ASSIGN_OR_RETURN(slice::TensorLayout local, slice::LocalLayout(it.layout, shape, 0, pieces));
        layout = std::make_shared<const slice::TensorLayout>(std::move(local));
      } else {
        layout = KeptLayout(it, owner);
      }
      std::string name = "atomic/" + v.dir + "/" + v.file;
      UCPFS_RETURN_IF_ERROR(views::CheckAtomicDtypes(*layout, name));
      auto [size, fresh] = size_of_kind.try_emplace({layout->shape, pattern.cat_dim, pattern.vocab_tensor}, 0);
      if (fresh) {
        UCPFS_ASSIGN_OR_RETURN(auto built, views::BuildAtomicFile(layout, pattern, files, name));
        size->second = built->Size();
      }
      v.n_bytes = size->second;
      v.build = [layout = std::move(layout), pattern, files, name = std::move(name)]()
          -> Result<std::shared_ptr<const ByteSource>> {
        UCPFS_ASSIGN_OR_RETURN(auto built, views::BuildAtomicFile(layout, pattern, files, name));
        return std::shared_ptr<const ByteSource>(std::move(built));
      };
      out.push_back(std::move(v));
    }
    // step.pt: the optimizer step as saved (a tensor, or a Python number), as DeepSpeed's
    // universal checkpoint keeps it.
    const ParamEntry& step_holder = split != split_of.end() ? mapping.params[split->second.fused] : p;
    const int32_t step = step_holder.item[static_cast<int>(StateKind::kStep)];
    if (step < 0) continue;
    auto value = ItemValue(c.items[static_cast<size_t>(step)], files);
    if (!value.ok()) continue;  // target views report it (MakeTargetInput)
    const auto kind = value->kind();
    if (kind != SaveValue::Kind::kTensor && kind != SaveValue::Kind::kInt) continue;  // no floats: torch 1.13 weights_only
    AtomicView v{.dir = views::AtomicDirName(p.name), .file = "step.pt", .n_bytes = 0, .build = nullptr};
    std::string name = "atomic/" + v.dir + "/step.pt";
    UCPFS_ASSIGN_OR_RETURN(auto lazy, format::LazyTorchFile::Build(*value, name));
    v.n_bytes = lazy->Size();
    v.build = [value = std::move(*value), name = std::move(name)]() -> Result<std::shared_ptr<const ByteSource>> {
      UCPFS_ASSIGN_OR_RETURN(auto built, format::LazyTorchFile::Build(value, name));
      return std::shared_ptr<const ByteSource>(std::move(built));
    };
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace ucpfs::index
