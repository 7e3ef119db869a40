// `ucpfs convert SRC DST --layout=L [...]`: materialises views to disk without FUSE, the oracle
// the mount is tested against. Writes DST/target/<layout>/rank_<N>/{model.pt,optim.pt,
// ucp_info.json} for every --layout and, with --atomic, DST/atomic/<param>/<state>.pt, built by
// the same views/ code the mount serves. Each file is streamed in 8 MiB reads to
// "<file>.tmp" and renamed into place; files are spread over --threads workers balanced by size
// (largest first onto the least loaded worker).
#pragma once

#include <string>
#include <vector>

#include "cli/checkpoint_cmds.h"

namespace ucpfs::cli {

struct ConvertArgs {
  SourceArgs source;                 // SRC, --index-dir, --rules (key mapping), --read-only-index
  std::string dst;
  std::vector<std::string> layouts;  // --layout (repeatable)
  bool atomic = false;
  bool safetensors = false;          // --safetensors: DST/safetensors/ (views/safetensors_view.h)
  std::string safetensors_shard_size;  // --safetensors-shard-size (empty: 5 GB)
  std::string preset = "auto";       // --preset
  std::string pattern_rules;         // --pattern-rules FILE (layout/patterns.h ParseRules format)
  std::string pp_split;              // --pp-split a,b,...
  int64_t vocab_pad_multiple = 0;    // --make-vocab-size-divisible-by (0: not given)
  int threads = 0;                   // 0: hardware_concurrency
  bool json = false;                 // --json: the summary as one JSON object
};

// Returns the process exit status (0 ok, 1 error); progress and errors on stderr, a summary on
// stdout.
int RunConvert(const ConvertArgs& args);

}  // namespace ucpfs::cli
