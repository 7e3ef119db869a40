// Small text helpers shared by the CLI's human-readable outputs.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace ucpfs::cli {

// "[4,8]" for a shape or stride.
inline std::string Dims(const std::vector<int64_t>& dims) {
  std::ostringstream s;
  s << '[';
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? "," : "") << dims[i];
  s << ']';
  return s.str();
}

}  // namespace ucpfs::cli
