#include "index/view_inputs.h"

#include <map>

#include "core/views/atomic.h"

namespace ucpfs::index {

// Builds the target input from the index: every mapped parameter's tensor states, and the
// hyper-parameters torchtitan flattens into BYTE_IO items `optimizer.param_groups.<fqn>.<field>`.
Result<std::shared_ptr<views::TargetInput>> MakeTargetInput(
    const Checkpoint& c, const KeyMapping& mapping, const FileTable& files,
    const std::function<void(const std::string&)>& warn) {
  auto in = std::make_shared<views::TargetInput>();
  in->files = files;
  std::map<std::string, std::vector<views::HyperParam>> hyper;
  const std::string kPrefix = "optimizer.param_groups.";
  for (const auto& it : c.items) {
    if (it.kind != ItemKind::kBytes || it.key.rfind(kPrefix, 0) != 0) continue;
    const size_t dot = it.key.rfind('.');
    if (dot == std::string::npos || dot <= kPrefix.size()) continue;
    const std::string fqn = it.key.substr(kPrefix.size(), dot - kPrefix.size());
    const std::string field = it.key.substr(dot + 1);
    if (field == "params" || field == "param_names") continue;
    UCPFS_ASSIGN_OR_RETURN(auto blob, SliceSource::Make((*files)[it.file_id], it.byte_offset, it.n_bytes));
    auto value = views::ParseHyperValue(blob);
    if (!value.ok()) {
      if (warn) warn(it.key + ": " + value.error().ToString() + " (left out of param_groups)");
      continue;
    }
    hyper[fqn].emplace_back(field, std::move(*value));
  }
  for (const auto& p : mapping.params) {
    views::TargetParam tp;
    tp.name = p.name;
    for (int k = 0; k < kNumStateKinds; ++k) {
      if (p.item[k] < 0) continue;
      const auto& it = c.items[static_cast<size_t>(p.item[k])];
      if (it.kind != ItemKind::kTensor) continue;
      tp.states[k] = std::make_shared<const slice::TensorLayout>(it.layout);
      tp.dtypes[k] = it.dtype;
      tp.keys[k] = it.key;
    }
    if (!tp.states[0] && !tp.states[1]) continue;  // optimizer-only leftovers: no model tensor
    if (auto h = hyper.find(p.name); h != hyper.end()) tp.hyper = h->second;
    in->params.push_back(std::move(tp));
  }
  return in;
}


Result<std::vector<AtomicView>> BuildAtomicViews(const Checkpoint& c, const KeyMapping& mapping,
                                                 const FileTable& files) {
  struct AtomicState {
    const char* file;
    StateKind primary;
    int fallback;  // the state used when `primary` is absent, or -1
  };
  const AtomicState kStates[] = {{"fp32.pt", StateKind::kFp32, static_cast<int>(StateKind::kWeight)},
                                 {"exp_avg.pt", StateKind::kExpAvg, -1},
                                 {"exp_avg_sq.pt", StateKind::kExpAvgSq, -1}};
  std::vector<AtomicView> out;
  for (const auto& p : mapping.params) {
    for (const auto& s : kStates) {
      int32_t item = p.item[static_cast<int>(s.primary)];
      if (item < 0 && s.fallback >= 0) item = p.item[s.fallback];
      if (item < 0) continue;
      const auto& it = c.items[static_cast<size_t>(item)];
      if (it.kind != ItemKind::kTensor) continue;
      AtomicView v{views::AtomicDirName(p.name), s.file, nullptr};
      auto layout = std::make_shared<const slice::TensorLayout>(it.layout);
      UCPFS_ASSIGN_OR_RETURN(v.source, views::BuildAtomicFile(layout, views::AtomicPatternFor(p.name, it.layout),
                                                              files, "atomic/" + v.dir + "/" + v.file));
      out.push_back(std::move(v));
    }
  }
  return out;
}

}  // namespace ucpfs::index
