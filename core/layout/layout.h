// Parallel layouts of a target view (docs/design.md "Mount layout"): the name grammar
// `tp<T>_pp<P>_dp<D>[_ep<E>][_zero<Z>]`, the rank order, and the pipeline split.
//
// Not for: which parameter a rank holds or which slice of it (patterns.h does that), I/O.
// Invariants: a Layout returned by ParseLayout has every degree >= 1, ep divides dp, zero in
// {0, 1}, World() <= kMaxWorld, and `name` is the canonical spelling (degrees without leading
// zeros; `_ep<E>` only when E > 1; `_zero<Z>` only when Z > 0). Rank order is Megatron's and
// DeepSpeed's: rank = tp + T*(dp + D*pp); expert parallelism is folded into data parallelism
// (ep_rank = dp_rank % E), so CoordsOf and RankOf are inverse bijections on [0, World()).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ucpfs::layout {

// Upper bound on the number of ranks of a layout (and on each degree): keeps every product
// in int range and refuses typos such as tp80000.
inline constexpr int kMaxWorld = 1 << 20;

struct Layout {
  int tp = 1;
  int pp = 1;
  int dp = 1;
  int ep = 1;    // divides dp
  int zero = 0;  // 0: optimizer state per parameter; 1: ZeRO-1 flat partitions over dp
  std::string name;  // canonical

  int World() const { return tp * pp * dp; }
};

// Parses a layout name. Grammar (strict, parts in this order, lower case):
//   tp<T>_pp<P>_dp<D>[_ep<E>][_zero<Z>]   with T, P, D, E >= 1 decimal without leading zeros
// Errors (kInvalidArgument, the message names the layout and what is wrong): an unknown or
// misplaced part, a missing part, a missing/zero/non-numeric degree, a degree with leading
// zeros, a world over kMaxWorld, ep not dividing dp, zero not in {0, 1}.
Result<Layout> ParseLayout(std::string_view name);

// The coordinates of one rank. ep = dp % layout.ep (derived; RankOf ignores it).
struct RankCoords {
  int tp = 0;
  int pp = 0;
  int dp = 0;
  int ep = 0;
  bool operator==(const RankCoords&) const = default;
};

// Coordinates of `rank`; requires 0 <= rank < layout.World() (asserted).
RankCoords CoordsOf(const Layout& layout, int rank);

// The rank at `coords`, or -1 when a coordinate is out of range.
int RankOf(const Layout& layout, const RankCoords& coords);

// Pipeline stage boundaries: P+1 ascending layer indices b, stage s holding layers
// [b[s], b[s+1]), b[0] = 0, b[P] = n_layers.
// - Without `layers_per_stage`: b[s] = floor(s * L / P). Refused when P > L (some stage would
//   hold no layer), which usually means a wrong layout.
// - With `layers_per_stage` (the --pp-split a,b,... option: the NUMBER of layers of each stage,
//   not boundaries): P non-negative counts summing to L. Zero counts are allowed here (e.g. a
//   last stage holding only the final norm and output head) because the user asked for them.
// Errors: kInvalidArgument naming the problem (n_layers < 0, pp < 1, P > L, wrong count of
// entries, a negative entry, a sum different from L).
Result<std::vector<int>> PipelineSplit(int n_layers, int pp,
                                       const std::optional<std::vector<int>>& layers_per_stage);

// Parses the --pp-split value "a,b,c" into counts. Errors: kInvalidArgument (empty entry,
// non-digit, value over kMaxWorld).
Result<std::vector<int>> ParsePpSplit(std::string_view text);

// The stage holding global layer `layer` given boundaries from PipelineSplit, or -1.
int StageOfLayer(const std::vector<int>& bounds, int layer);

}  // namespace ucpfs::layout
