// JSON text for everything ucpfs prints or serves (status.json, ucp_info.json, inspect --json).
// Names come from untrusted checkpoints and may hold bytes that are not UTF-8; JSON cannot, and
// nlohmann's default dump throws on them. The one rule: each invalid byte is written as U+FFFD
// (the replacement character). Valid UTF-8 is written as is.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace ucpfs {

template <typename Json>
std::string JsonText(const Json& j, int indent = 2) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace ucpfs
