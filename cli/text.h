// Small text helpers shared by the CLI's human-readable outputs.
#pragma once

#include <cstdint>
#include <iomanip>
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

// "512 B", "1.5 KiB", "3.0 GiB".
inline std::string HumanBytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  std::ostringstream s;
  if (u == 0) s << n << " B";
  else s << std::fixed << std::setprecision(1) << v << ' ' << units[u];
  return s.str();
}

}  // namespace ucpfs::cli
