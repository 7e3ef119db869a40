// `ucpfs convert SRC DST --layout=L [...]`: materialises views to disk without FUSE, the oracle
// the mount is tested against. Writes DST/target/<layout>/rank_<N>/ for every --layout and, with
// --atomic, --safetensors or --view NAME, that view's directory (atomic/, safetensors/, hf/,
// <tag>_universal/), listed by views/view_files.h from the same view kinds the mount serves.
// Each file is streamed in 8 MiB reads to
// "<file>.tmp" and renamed into place; files are spread over --threads workers balanced by size
// (largest first onto the least loaded worker).
#pragma once

#include <string>
#include <vector>

#include "cli/checkpoint_cmds.h"
#include "cli/view_args.h"

namespace ucpfs::cli {

struct ConvertArgs {
  SourceArgs source;  // SRC, --index-dir, --rules (key mapping), --read-only-index
  std::string dst;
  ViewArgs views;     // --layout..., --atomic, --safetensors, --view, and the views' options
  int threads = 0;    // 0: hardware_concurrency
  bool json = false;  // --json: the summary as one JSON object
};

// Returns the process exit status (0 ok, 1 error); progress and errors on stderr, a summary on
// stdout.
int RunConvert(const ConvertArgs& args);

}  // namespace ucpfs::cli
