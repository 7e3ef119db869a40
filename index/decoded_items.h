// What the scanners decode from a source beyond tensors, in the form the views serve it: an
// optimizer param group's hyper-parameters, a non-parameter item as plain data, and an item no
// view serves with the reason. Value types only (views/target.h uses them as views::HyperParam,
// views::ExtraItem, views::NotServed).
#pragma once

#include <string>
#include <utility>

#include "core/format/torch_writer.h"

namespace ucpfs::index {

// A hyper-parameter of an optimizer param group: (field, value), e.g. ("lr", 3e-4),
// ("betas", (0.9, 0.95)), ("foreach", None); any plain value (format/plain_value.h).
using HyperParam = std::pair<std::string, format::SaveValue>;

// A non-parameter item of the source, decoded (format::DecodePlainValue or a tensor layout).
struct ExtraItem {
  std::string key;          // the source's key
  format::SaveValue value;  // tensors in it read lazily from the source
  // Rank-local items: the source DP rank of a `dp_rank_<d>` key component, and the key with
  // that component written `dp_rank_*` (items of one group are spread over the DP ranks).
  int dp_rank = -1;         // -1: replicated, served on every rank
  std::string group;
};

// A source item no view serves, and why (listed in status.json, inspect and ucp_info.json).
struct NotServed {
  std::string key;
  std::string reason;
};

}  // namespace ucpfs::index
