// Reading a safe-pickle graph (core/format/pickle.h) as plain data: the few walks every scanner
// of torch.save files needs. Nothing here runs or imports anything; a node of the wrong kind
// reads as empty (callers say what they expected, naming the file).
#pragma once

#include <span>
#include <string_view>
#include <utility>

#include "core/format/pickle.h"

namespace ucpfs::index {

// The key/value pairs of a dict, an OrderedDict (REDUCE + SETITEMS), or an object's BUILD state
// dict (argparse.Namespace pickles as NEWOBJ + BUILD of its __dict__); else none.
inline std::span<const std::pair<pickle::NodeId, pickle::NodeId>> Pairs(const pickle::PickleGraph& g,
                                                                       pickle::NodeId n) {
  if (g.kind(n) == pickle::Kind::kDict) return g.dict_items(n);
  if (g.kind(n) == pickle::Kind::kObject) {
    const pickle::ObjectInfo o = g.object(n);
    if (g.kind(o.state) == pickle::Kind::kDict) return g.dict_items(o.state);
    return o.dict_items;
  }
  return {};
}

// The value of string key `key` in Pairs(dict) (the last one, as Python keeps), or kNoNode.
inline pickle::NodeId Get(const pickle::PickleGraph& g, pickle::NodeId dict, std::string_view key) {
  pickle::NodeId found = pickle::kNoNode;
  for (const auto& [k, v] : Pairs(g, dict)) {
    if (g.kind(k) == pickle::Kind::kString && g.text(k) == key) found = v;
  }
  return found;
}

// The items of a list or tuple, or an object's APPENDS; else none.
inline std::span<const pickle::NodeId> Items(const pickle::PickleGraph& g, pickle::NodeId n) {
  const pickle::Kind k = g.kind(n);
  if (k == pickle::Kind::kList || k == pickle::Kind::kTuple) return g.items(n);
  if (k == pickle::Kind::kObject) return g.object(n).list_items;
  return {};
}

}  // namespace ucpfs::index
