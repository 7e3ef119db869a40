// The view files of a checkpoint as `ucpfs convert` writes them and `ucpfs verify` reads them:
// target/<layout>/rank_<N>/{model.pt, model.safetensors, optim.pt, extra_state.pt,
// ucp_info.json}, safetensors/ and atomic/<param>/<state>.pt, each a lazy ByteSource built by
// the same views/ code the mount serves.
//
// Not for: writing or reading them (the commands do), or the mount's tree (views/mount_views).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/byte_source.h"
#include "core/layout/layout.h"
#include "core/layout/patterns.h"
#include "core/status.h"
#include "views/target.h"
#include "index/snapshot.h"

namespace ucpfs::cli {

// The view options as given on the command line.
struct ViewArgs {
  std::vector<std::string> layouts;      // --layout (repeatable)
  bool atomic = false;                   // atomic/
  bool safetensors = false;              // safetensors/
  std::string safetensors_shard_size;    // empty: 5 GB
  std::string preset = "auto";           // --preset
  std::string pattern_rules;             // --pattern-rules FILE
  std::string pp_split;                  // --pp-split a,b,...
  int64_t vocab_pad_multiple = 0;        // --make-vocab-size-divisible-by (0: not given)
};

// Registers --preset, --pattern-rules, --pp-split and --make-vocab-size-divisible-by (what
// decides how target views split parameters) on `cmd`: mount, convert, verify and plan take them
// alike.
void AddPatternOptions(CLI::App* cmd, std::string& preset, std::string& pattern_rules, std::string& pp_split,
                       int64_t& vocab_pad_multiple);

// ViewArgs parsed (before the index is opened, so a typo fails at once).
struct ViewSelection {
  std::vector<layout::Layout> layouts;  // repeated names once
  bool atomic = false;
  bool safetensors = false;
  uint64_t safetensors_shard_n_bytes = 0;
  layout::Preset preset = layout::Preset::kAuto;
  std::vector<layout::Rule> rules;
  layout::ModelInfo model_facts;  // the rules file's "model" (layout::RulesFile)
  std::optional<std::vector<int>> pp_split;
  int64_t vocab_pad_multiple = 0;  // 0: the source's make_vocab_size_divisible_by, else 128
};

// Errors: kInvalidArgument for a bad layout, preset, split or shard size; kNotFound when the
// pattern rules file cannot be read; ParseRules' errors.
Result<ViewSelection> ParseViewArgs(const ViewArgs& args);

// The target-view input of the snapshot with the selection's patterns (preset, rules, pp split)
// applied; `warn` gets one line per source item no view serves. Errors: PatternOptionsFor's,
// MakeTargetInput's.
Result<std::shared_ptr<const views::TargetInput>> MakeViewInput(const index::Snapshot& snapshot,
                                                                 const ViewSelection& selection,
                                                                 const std::function<void(const std::string&)>& warn);

struct ViewFile {
  std::string path;  // relative to the views' root, e.g. "target/tp2_pp1_dp1/rank_0/model.pt"
  std::shared_ptr<const ByteSource> source;
};

// Every view file `selection` asks for, target views first, then safetensors/, then atomic/.
// `warn` gets the target input's warnings. Errors: those of the view builders, with the layout
// and rank; kNotFound when safetensors/ is asked for and there are no weights.
Result<std::vector<ViewFile>> ListViewFiles(const index::Snapshot& snapshot, const ViewSelection& selection,
                                            const std::function<void(const std::string&)>& warn);

}  // namespace ucpfs::cli
