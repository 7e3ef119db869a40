// The view options of the command line, shared by mount, convert, verify and plan: what decides
// how target views split parameters (--preset, --pattern-rules, --pp-split,
// --make-vocab-size-divisible-by), the other views' options (--safetensors-shard-size,
// --hf-dtype, --hf-config) and, for convert and verify, which views (registry names,
// views/view_kind.h) to write or read. Parsed into views::ViewOptions, the options a mount's
// view kinds are built with, before the index is opened so a typo fails at once.
//
// Not for: listing, writing or reading the view files (views/view_files.h, the commands).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "views/view_kind.h"

namespace ucpfs::cli {

// The view options as given on the command line.
struct ViewArgs {
  std::vector<std::string> layouts;      // --layout (repeatable): the target view
  bool atomic = false;                   // atomic/
  bool safetensors = false;              // safetensors/
  std::vector<std::string> views;        // --view NAME (repeatable): any registered kind
  std::string safetensors_shard_size;    // empty: 5 GB (safetensors/ and hf/)
  std::string preset = "auto";           // --preset
  std::string pattern_rules;             // --pattern-rules FILE
  std::string pp_split;                  // --pp-split a,b,...
  int64_t vocab_pad_multiple = 0;        // --make-vocab-size-divisible-by (0: not given)
  std::string hf_dtype;                  // --hf-dtype: hf/'s weights (empty: as trained)
  std::string hf_config;                 // --hf-config FILE: the base model's config.json
};

// Registers --preset, --pattern-rules, --pp-split and --make-vocab-size-divisible-by (what
// decides how target views split parameters) on `cmd`: mount, convert, verify and plan take them
// alike.
void AddPatternOptions(CLI::App* cmd, std::string& preset, std::string& pattern_rules, std::string& pp_split,
                       int64_t& vocab_pad_multiple);

// Registers --hf-dtype and --hf-config (hf/'s options) on `cmd`: mount, convert and verify.
void AddHfOptions(CLI::App* cmd, std::string& hf_dtype, std::string& hf_config);

// ViewArgs parsed.
struct ViewSelection {
  views::ViewOptions options;  // lookup_budget_bytes left at its default (mount sets it)
  // The kinds asked for, by registry name, each once, in registry order: "target" with
  // --layout, "atomic", "safetensors", and each --view.
  std::vector<std::string> kinds;
};

// Errors: kInvalidArgument for a bad layout, preset, split, shard size, dtype, view name or an
// unreadable --hf-config (read now: a daemon may not see the same relative path); kNotFound when
// the pattern rules file cannot be read; ParseRules' errors.
Result<ViewSelection> ParseViewArgs(const ViewArgs& args);

}  // namespace ucpfs::cli
