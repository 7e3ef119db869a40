// The picture `ucpfs plan --svg` writes: source files as boxes on the left, target ranks on the
// right, bands between them as wide as the bytes that flow, each labelled (a <title> on every
// band, a text where the band is wide enough). Plain SVG 1.1 text, names XML-escaped; pure (no
// I/O). The caller aggregates: this draws every node and flow it is given.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ucpfs::cli {

struct FlowPicture {
  std::string title;     // e.g. "ucpfs plan: tp2_pp1_dp1 of /ckpt"
  std::string subtitle;  // totals
  struct Node {
    std::string label;
    uint64_t n_bytes = 0;
    bool muted = false;  // drawn grey (zero fill, "other")
  };
  std::vector<Node> sources;
  std::vector<Node> ranks;
  struct Flow {
    size_t source = 0;
    size_t rank = 0;
    uint64_t n_bytes = 0;
  };
  std::vector<Flow> flows;  // n_bytes > 0
};

// The SVG document.
std::string RenderFlowSvg(const FlowPicture& picture);

}  // namespace ucpfs::cli
