#include "index/target_input.h"

#include <map>

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


}  // namespace ucpfs::index
