// Layout names, rank order and pipeline split (see layout.h).
#include "core/layout/layout.h"

#include <cassert>
#include <charconv>
#include <cstdint>

namespace ucpfs::layout {
namespace {

Status LayoutError(std::string_view name, const std::string& why) {
  return InvalidArgumentError("layout '" + std::string(name) + "': " + why +
                              " (expected tp<T>_pp<P>_dp<D>[_ep<E>][_zero<Z>])");
}

// Parses a decimal without sign or leading zeros, at most kMaxWorld. Returns -1 when the text
// is not a number, -2 for leading zeros, -3 when too large.
int ParseDegree(std::string_view digits) {
  if (digits.empty()) return -1;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
  }
  if (digits.size() > 1 && digits[0] == '0') return -2;
  if (digits.size() > 8) return -3;
  int v = 0;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || ptr != digits.data() + digits.size()) return -1;
  if (v > kMaxWorld) return -3;
  return v;
}

}  // namespace

Result<Layout> ParseLayout(std::string_view name) {
  static constexpr std::string_view kKeys[] = {"tp", "pp", "dp", "ep", "zero"};
  // Values by key index; -1 = absent.
  int values[5] = {-1, -1, -1, -1, -1};
  if (name.empty()) return LayoutError(name, "empty name");
  size_t next_key = 0;  // parts must appear in kKeys order
  size_t pos = 0;
  while (pos <= name.size()) {
    size_t end = name.find('_', pos);
    if (end == std::string_view::npos) end = name.size();
    std::string_view part = name.substr(pos, end - pos);
    if (part.empty()) return LayoutError(name, "empty part");
    size_t key_len = 0;
    while (key_len < part.size() && part[key_len] >= 'a' && part[key_len] <= 'z') ++key_len;
    std::string_view key = part.substr(0, key_len);
    std::string_view digits = part.substr(key_len);
    size_t k = 0;
    while (k < 5 && kKeys[k] != key) ++k;
    if (k == 5) return LayoutError(name, "unknown part '" + std::string(part) + "'");
    if (values[k] != -1) return LayoutError(name, "'" + std::string(key) + "' given twice");
    if (k < next_key) {
      return LayoutError(name, "part '" + std::string(part) + "' out of order");
    }
    int v = ParseDegree(digits);
    if (v == -1) {
      return LayoutError(name, "'" + std::string(key) + "' needs a decimal degree, got '" +
                                   std::string(digits) + "'");
    }
    if (v == -2) {
      return LayoutError(name, "'" + std::string(part) + "' has leading zeros");
    }
    if (v == -3) {
      return LayoutError(name, "'" + std::string(part) + "' exceeds " + std::to_string(kMaxWorld));
    }
    if (v == 0 && k != 4) {
      return LayoutError(name, "'" + std::string(key) + "' degree must be >= 1");
    }
    values[k] = v;
    next_key = k + 1;
    pos = end + 1;
  }
  for (size_t k = 0; k < 3; ++k) {
    if (values[k] == -1) {
      return LayoutError(name, "missing part '" + std::string(kKeys[k]) + "<N>'");
    }
  }
  Layout out;
  out.tp = values[0];
  out.pp = values[1];
  out.dp = values[2];
  out.ep = values[3] == -1 ? 1 : values[3];
  out.zero = values[4] == -1 ? 0 : values[4];
  if (out.zero > 1) {
    return LayoutError(name, "zero" + std::to_string(out.zero) +
                                 " not supported: zero must be 0 (per-parameter optimizer state) "
                                 "or 1 (flat partitions over dp)");
  }
  if (out.dp % out.ep != 0) {
    return LayoutError(name, "ep" + std::to_string(out.ep) + " must divide dp" +
                                 std::to_string(out.dp) + " (experts are parallel within dp)");
  }
  int64_t world = int64_t{out.tp} * out.pp * out.dp;
  if (world > kMaxWorld) {
    return LayoutError(name, "world size " + std::to_string(world) + " exceeds " +
                                 std::to_string(kMaxWorld));
  }
  out.name = "tp" + std::to_string(out.tp) + "_pp" + std::to_string(out.pp) + "_dp" +
             std::to_string(out.dp);
  if (out.ep > 1) out.name += "_ep" + std::to_string(out.ep);
  if (out.zero > 0) out.name += "_zero" + std::to_string(out.zero);
  return out;
}

RankCoords CoordsOf(const Layout& layout, int rank) {
  assert(rank >= 0 && rank < layout.World());
  RankCoords c;
  c.tp = rank % layout.tp;
  c.dp = (rank / layout.tp) % layout.dp;
  c.pp = rank / (layout.tp * layout.dp);
  c.ep = c.dp % layout.ep;
  return c;
}

int RankOf(const Layout& layout, const RankCoords& c) {
  if (c.tp < 0 || c.tp >= layout.tp || c.dp < 0 || c.dp >= layout.dp || c.pp < 0 ||
      c.pp >= layout.pp) {
    return -1;
  }
  return c.tp + layout.tp * (c.dp + layout.dp * c.pp);
}

Result<std::vector<int>> PipelineSplit(int n_layers, int pp,
                                       const std::optional<std::vector<int>>& layers_per_stage) {
  if (n_layers < 0) return InvalidArgumentError("pipeline split: negative layer count");
  if (pp < 1) return InvalidArgumentError("pipeline split: pp must be >= 1");
  std::vector<int> bounds(static_cast<size_t>(pp) + 1, 0);
  if (!layers_per_stage.has_value()) {
    // One stage holds everything, layers or not (a model with no numbered layers, e.g. an MLP).
    if (pp > n_layers && pp > 1) {
      return InvalidArgumentError("pipeline split: pp" + std::to_string(pp) + " exceeds the " +
                                  std::to_string(n_layers) +
                                  " layers (a stage would hold no layer; give --pp-split to "
                                  "allow empty stages)");
    }
    for (int s = 0; s <= pp; ++s) {
      bounds[static_cast<size_t>(s)] =
          static_cast<int>(int64_t{s} * n_layers / pp);  // floor(s*L/P), no overflow in int64
    }
    return bounds;
  }
  const std::vector<int>& counts = *layers_per_stage;
  if (counts.size() != static_cast<size_t>(pp)) {
    return InvalidArgumentError("--pp-split: " + std::to_string(counts.size()) +
                                " entries for pp" + std::to_string(pp) +
                                " (give one layer count per stage)");
  }
  int64_t sum = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    if (counts[s] < 0) {
      return InvalidArgumentError("--pp-split: stage " + std::to_string(s) +
                                  " has a negative layer count");
    }
    sum += counts[s];
    if (sum > n_layers) break;
    bounds[s + 1] = static_cast<int>(sum);
  }
  if (sum != n_layers) {
    return InvalidArgumentError("--pp-split: layer counts sum to " + std::to_string(sum) +
                                (sum > n_layers ? " or more" : "") + ", the model has " +
                                std::to_string(n_layers) + " layers");
  }
  return bounds;
}

Result<std::vector<int>> ParsePpSplit(std::string_view text) {
  std::vector<int> out;
  size_t pos = 0;
  while (true) {
    size_t end = text.find(',', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view item = text.substr(pos, end - pos);
    int v = -1;
    if (!item.empty() && item.size() <= 8 &&
        item.find_first_not_of("0123456789") == std::string_view::npos) {
      std::from_chars(item.data(), item.data() + item.size(), v);
    }
    if (v < 0 || v > kMaxWorld) {
      return InvalidArgumentError("--pp-split '" + std::string(text) + "': entry '" +
                                  std::string(item) + "' is not a layer count");
    }
    out.push_back(v);
    if (end == text.size()) break;
    pos = end + 1;
  }
  return out;
}

int StageOfLayer(const std::vector<int>& bounds, int layer) {
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    if (layer >= bounds[s] && layer < bounds[s + 1]) return static_cast<int>(s);
  }
  return -1;
}

}  // namespace ucpfs::layout
