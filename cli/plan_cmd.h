// `ucpfs plan SRC --layout L [--json] [--svg FILE]`: which source files feed which ranks of
// layout L, and how many bytes, from the index alone (no tensor data is read): a table (ranks x
// source files, with totals) and a summary line, the exact matrix as JSON, or a diagram (SVG).
// The counting is views/reshard_reads.h; this formats it.
#pragma once

#include <memory>
#include <string>

#include "cli/checkpoint_cmds.h"

namespace CLI {
class App;
}

namespace ucpfs::cli {

struct PlanArgs {
  SourceArgs source;             // SRC, --index-dir, --rules, --read-only-index
  std::string layout;            // --layout (required)
  bool json = false;             // --json
  std::string svg;               // --svg FILE
  std::string preset = "auto";   // --preset
  std::string pattern_rules;     // --pattern-rules FILE
  std::string pp_split;          // --pp-split a,b,...
  int64_t vocab_pad_multiple = 0;  // --make-vocab-size-divisible-by (0: not given)
};

// Registers `plan` on `app` with its own options (not the source options: the caller adds
// them to returned->source). `args` must outlive parsing.
CLI::App* AddPlanCommand(CLI::App& app, PlanArgs& args);

// Returns the exit status (0 ok, 1 error); the report on stdout, errors on stderr.
int RunPlan(const PlanArgs& args);

}  // namespace ucpfs::cli
