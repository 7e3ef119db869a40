// See view_args.h.
#include "cli/view_args.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "cli/checkpoint_cmds.h"
#include "index/hf_config.h"
#include "views/view_files.h"

namespace ucpfs::cli {

void AddPatternOptions(CLI::App* cmd, std::string& preset, std::string& pattern_rules, std::string& pp_split,
                       int64_t& vocab_pad_multiple) {
  cmd->add_option("--preset", preset,
                  "pattern preset: auto, torchtitan, megatron, hf, or megatron-core (a Hugging Face Llama-family "
                  "model served in target/ under Megatron-Core GPTModel names, QKV and gate/up fused)");
  cmd->add_option("--pattern-rules", pattern_rules, "pattern rules file (JSON {\"patterns\": [...]})");
  cmd->add_option("--pp-split", pp_split, "layers per pipeline stage, e.g. 5,6,6,5");
  cmd->add_option("--make-vocab-size-divisible-by", vocab_pad_multiple,
                  "pad vocabularies in target views to a multiple of N*tp, as Megatron-LM's option does "
                  "(default: the source's args, else 128)")
      ->check(CLI::Range(int64_t{1}, layout::kMaxVocabPadMultiple));
}

void AddHfOptions(CLI::App* cmd, std::string& hf_dtype, std::string& hf_config) {
  cmd->add_option("--hf-dtype", hf_dtype, "dtype of hf/'s weights: bf16, fp16 or fp32 (default: as trained)");
  cmd->add_option("--hf-config", hf_config,
                  "the base model's config.json, for hf/ of sources that do not record their architecture "
                  "(torchtitan-style DCP)");
}

Result<ViewSelection> ParseViewArgs(const ViewArgs& args) {
  ViewSelection out;
  views::ViewOptions& t = out.options;
  UCPFS_ASSIGN_OR_RETURN(t.safetensors_shard_n_bytes, ParseShardSize(args.safetensors_shard_size));
  t.hf.max_shard_n_bytes = t.safetensors_shard_n_bytes;
  for (const auto& name : args.layouts) {
    UCPFS_ASSIGN_OR_RETURN(auto l, layout::ParseLayout(name));
    const bool repeated = std::any_of(t.layouts.begin(), t.layouts.end(),
                                      [&](const layout::Layout& seen) { return seen.name == l.name; });
    if (!repeated) t.layouts.push_back(std::move(l));  // --layout given twice: one view
  }
  UCPFS_ASSIGN_OR_RETURN(t.preset, layout::ParsePreset(args.preset));
  if (!args.pattern_rules.empty()) {
    std::ifstream f(args.pattern_rules, std::ios::binary);
    if (!f) return NotFoundError(args.pattern_rules + ": cannot open");
    std::stringstream text;
    text << f.rdbuf();
    UCPFS_ASSIGN_OR_RETURN(layout::RulesFile file, layout::ParseRulesFile(text.str(), args.pattern_rules));
    t.rules = std::move(file.rules);
    t.model_facts = file.model;
  }
  if (!args.pp_split.empty()) {
    UCPFS_ASSIGN_OR_RETURN(auto split, layout::ParsePpSplit(args.pp_split));
    t.pp_split = std::move(split);
  }
  if (args.vocab_pad_multiple < 0 || args.vocab_pad_multiple > layout::kMaxVocabPadMultiple) {
    return InvalidArgumentError("make_vocab_size_divisible_by " + std::to_string(args.vocab_pad_multiple) +
                                ": not in [1, " + std::to_string(layout::kMaxVocabPadMultiple) + "]");
  }
  t.vocab_pad_multiple = args.vocab_pad_multiple;
  if (!args.hf_dtype.empty()) {
    UCPFS_ASSIGN_OR_RETURN(t.hf.dtype, index::ParseHfDType(args.hf_dtype));
  }
  if (!args.hf_config.empty()) {
    std::ifstream in(args.hf_config, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in || text.str().size() > (1u << 20)) {
      return InvalidArgumentError("--hf-config " + args.hf_config + ": cannot be read, or larger than 1 MiB");
    }
    t.hf.config_text = text.str();
    t.hf.config_path = args.hf_config;
    // Its heads are facts of the model for every view (a fused QKV's interleave), as a rules
    // file's "model" gives them; an unreadable config is hf/'s to report (hf.error).
    const std::string where = "--hf-config " + args.hf_config;
    if (auto config = index::ParseHfConfig(t.hf.config_text, where); config.ok()) {
      UCPFS_ASSIGN_OR_RETURN(t.model_facts, layout::MergeAttentionFacts(t.model_facts, "--pattern-rules " + args.pattern_rules,
                                                                       index::AttentionFactsOf(*config), where));
    }
  }
  // The kinds asked for, each once, checked against the registry now.
  auto want = [&](const std::string& name) -> Status {
    const auto& all = views::ViewKinds();
    if (std::none_of(all.begin(), all.end(), [&](const views::ViewKind* k) { return name == k->Name(); })) {
      return InvalidArgumentError("--view " + name + ": no such view (views: " + views::ViewKindNames() + ")");
    }
    if (std::find(out.kinds.begin(), out.kinds.end(), name) == out.kinds.end()) out.kinds.push_back(name);
    return Status::Ok();
  };
  if (!t.layouts.empty()) UCPFS_RETURN_IF_ERROR(want("target"));
  if (args.atomic) UCPFS_RETURN_IF_ERROR(want("atomic"));
  if (args.safetensors) UCPFS_RETURN_IF_ERROR(want("safetensors"));
  for (const std::string& name : args.views) UCPFS_RETURN_IF_ERROR(want(name));
  if (t.layouts.empty() && std::find(out.kinds.begin(), out.kinds.end(), "target") != out.kinds.end()) {
    return InvalidArgumentError("--view target: give the layouts with --layout");
  }
  // In registry order, the order their files are listed in (views/view_files.h).
  std::vector<std::string> ordered;
  for (const views::ViewKind* k : views::ViewKinds()) {
    if (std::find(out.kinds.begin(), out.kinds.end(), k->Name()) != out.kinds.end()) ordered.push_back(k->Name());
  }
  out.kinds = std::move(ordered);
  return out;
}

}  // namespace ucpfs::cli
