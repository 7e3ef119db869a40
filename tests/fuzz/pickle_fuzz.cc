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
    for (NodeId c : g.items(id)) visit(c);
    for (const auto& [k, v] : g.dict_items(id)) {
      visit(k);
      visit(v);
    }
    visit(g.state(id));
    visit(g.persistent_id(id));
    sink += g.text(id).size() + g.module(id).size() + g.name(id).size();
    switch (g.kind(id)) {
      case Kind::kObject: {
        const auto o = g.object(id);
        Check(o.args != kNoNode && g.kind(o.args) == Kind::kTuple);
        visit(o.callable);
        visit(o.args);
        visit(o.kwargs);
        for (NodeId c : o.list_items) visit(c);
        for (const auto& [k, v] : o.dict_items) {
          visit(k);
          visit(v);
        }
        break;
      }
      case Kind::kStorage: sink += g.storage(id).key.size() + g.storage(id).location.size(); break;
      case Kind::kTensor: {
        const auto t = g.tensor(id);
        Check(t.storage != kNoNode && g.kind(t.storage) == Kind::kStorage);
        Check(t.shape.size() == t.stride.size());
        sink += t.shape.size();
        visit(t.storage);
        break;
      }
      default: break;
    }
    // Exercise the helpers walkers use.
    (void)g.ClassName(id);
    const NodeId got = g.DictGet(id, "state_dict_metadata");
    Check(got == kNoNode || got < g.size());
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
    Check(result->MemoryBytes() >= result->size() * 16);
  } else {
    Check(!result.status().message().empty());
  }
  return 0;
}
