// libFuzzer target for the safe pickle reader: ParsePickle on arbitrary bytes with modest
// limits; on success, an iterative walk (cycle-guarded) touches every reachable node and checks
// that every id it finds is in range. Seeds: tests/fuzz/seeds/pickle_*.bin.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "core/format/pickle.h"

namespace {

using ucpfs::pickle::Kind;
using ucpfs::pickle::kNoNode;
using ucpfs::pickle::Node;
using ucpfs::pickle::NodeId;
using ucpfs::pickle::PickleGraph;

void Check(bool ok) {
  if (!ok) std::abort();
}

void Walk(const PickleGraph& g) {
  if (g.root() == kNoNode) return;
  Check(g.root() < g.size());
  std::vector<bool> seen(g.size());
  std::vector<NodeId> todo{g.root()};
  uint64_t sink = 0;
  auto visit = [&](NodeId id) {
    if (id == kNoNode) return;
    Check(id < g.size());
    if (!seen[id]) todo.push_back(id);
  };
  while (!todo.empty()) {
    const NodeId id = todo.back();
    todo.pop_back();
    if (seen[id]) continue;
    seen[id] = true;
    const Node& n = g.at(id);
    sink += n.text.size() + n.module.size() + n.name.size() + n.storage_key.size() +
            n.tensor_shape.size() + n.tensor_stride.size();
    for (NodeId c : n.items) visit(c);
    for (const auto& [k, v] : n.dict_items) {
      visit(k);
      visit(v);
    }
    for (NodeId c : n.list_items) visit(c);
    visit(n.callable);
    visit(n.args);
    visit(n.kwargs);
    visit(n.state);
    visit(n.tensor_storage);
    if (n.kind == Kind::kTensor) {
      Check(n.tensor_storage != kNoNode && g.at(n.tensor_storage).kind == Kind::kStorage);
      Check(n.tensor_shape.size() == n.tensor_stride.size());
    }
    // Exercise the helpers walkers use.
    (void)g.ClassName(id);
    (void)g.DictGet(id, "state_dict_metadata");
    (void)g.IsGlobal(id, "torch", "Size");
  }
  Check(sink != UINT64_MAX);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ucpfs::pickle::PickleLimits limits;
  limits.max_nodes = 1u << 16;
  limits.max_memo = 1u << 16;
  limits.max_stack = 1u << 16;
  limits.max_mark_depth = 64;
  limits.max_string_bytes = 1u << 20;
  auto result = ucpfs::pickle::ParsePickle(
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size), "fuzz.pkl",
      limits);
  if (result.ok()) {
    Walk(*result);
  } else {
    Check(!result.status().message().empty());
  }
  return 0;
}
