// See view_files.h.
#include "cli/view_files.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "cli/checkpoint_cmds.h"
#include "views/target.h"
#include "views/safetensors_view.h"
#include "views/view_inputs.h"

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

Result<ViewSelection> ParseViewArgs(const ViewArgs& args) {
  ViewSelection out;
  out.atomic = args.atomic;
  out.safetensors = args.safetensors;
  UCPFS_ASSIGN_OR_RETURN(out.safetensors_shard_n_bytes, ParseShardSize(args.safetensors_shard_size));
  for (const auto& name : args.layouts) {
    UCPFS_ASSIGN_OR_RETURN(auto l, layout::ParseLayout(name));
    const bool repeated = std::any_of(out.layouts.begin(), out.layouts.end(),
                                      [&](const layout::Layout& seen) { return seen.name == l.name; });
    if (!repeated) out.layouts.push_back(std::move(l));  // --layout given twice: one view
  }
  UCPFS_ASSIGN_OR_RETURN(out.preset, layout::ParsePreset(args.preset));
  if (!args.pattern_rules.empty()) {
    std::ifstream f(args.pattern_rules, std::ios::binary);
    if (!f) return NotFoundError(args.pattern_rules + ": cannot open");
    std::stringstream text;
    text << f.rdbuf();
    UCPFS_ASSIGN_OR_RETURN(layout::RulesFile file, layout::ParseRulesFile(text.str(), args.pattern_rules));
    out.rules = std::move(file.rules);
    out.model_facts = file.model;
  }
  if (!args.pp_split.empty()) {
    UCPFS_ASSIGN_OR_RETURN(auto split, layout::ParsePpSplit(args.pp_split));
    out.pp_split = std::move(split);
  }
  if (args.vocab_pad_multiple < 0 || args.vocab_pad_multiple > layout::kMaxVocabPadMultiple) {
    return InvalidArgumentError("make_vocab_size_divisible_by " + std::to_string(args.vocab_pad_multiple) +
                                ": not in [1, " + std::to_string(layout::kMaxVocabPadMultiple) + "]");
  }
  out.vocab_pad_multiple = args.vocab_pad_multiple;
  return out;
}

Result<std::shared_ptr<const views::TargetInput>> MakeViewInput(const index::Snapshot& snapshot,
                                                                 const ViewSelection& selection,
                                                                 const std::function<void(const std::string&)>& warn) {
  const auto& ckpt = snapshot.checkpoint();
  UCPFS_ASSIGN_OR_RETURN(auto patterns, index::PatternOptionsFor(ckpt, selection.preset, selection.rules,
                                                                     selection.vocab_pad_multiple, selection.model_facts));
  UCPFS_ASSIGN_OR_RETURN(auto input, index::MakeTargetInput(ckpt, snapshot.mapping, snapshot.files, warn));
  index::ApplyPatterns(*input, patterns, selection.pp_split);
  return std::shared_ptr<const views::TargetInput>(std::move(input));
}

Result<std::vector<ViewFile>> ListViewFiles(const index::Snapshot& snapshot, const ViewSelection& selection,
                                            const std::function<void(const std::string&)>& warn) {
  const auto& ckpt = snapshot.checkpoint();
  UCPFS_ASSIGN_OR_RETURN(auto patterns, index::PatternOptionsFor(ckpt, selection.preset, selection.rules,
                                                                     selection.vocab_pad_multiple, selection.model_facts));
  std::vector<ViewFile> out;
  if (!selection.layouts.empty()) {
    UCPFS_ASSIGN_OR_RETURN(std::shared_ptr<const views::TargetInput> shared, MakeViewInput(snapshot, selection, warn));
    for (const auto& l : selection.layouts) {
      auto plan = views::TargetPlan::Make(shared, l);
      if (!plan.ok()) return plan.error().WithContext("layout " + l.name);
      for (int r = 0; r < l.World(); ++r) {
        auto rf = plan->Build(r);
        if (!rf.ok()) return rf.error().WithContext("layout " + l.name + " rank " + std::to_string(r));
        const std::string dir = "target/" + l.name + "/rank_" + std::to_string(r) + "/";
        out.push_back({dir + "model.pt", rf->model});
        if (rf->model_safetensors) out.push_back({dir + "model.safetensors", rf->model_safetensors});
        if (rf->optim) out.push_back({dir + "optim.pt", rf->optim});
        if (rf->extra) out.push_back({dir + "extra_state.pt", rf->extra});
        out.push_back({dir + "ucp_info.json", rf->info});
      }
    }
  }
  if (selection.safetensors) {
    UCPFS_ASSIGN_OR_RETURN(auto views, index::BuildSafetensorsView(ckpt, snapshot.mapping, snapshot.files, patterns,
                                                                   selection.safetensors_shard_n_bytes));
    if (views.empty()) return NotFoundError(snapshot.source_dir() + ": no model weights to write as safetensors");
    for (auto& v : views) out.push_back({"safetensors/" + v.name, std::move(v.source)});
  }
  if (selection.atomic) {
    UCPFS_ASSIGN_OR_RETURN(auto views, index::BuildAtomicViews(ckpt, snapshot.mapping, snapshot.files, patterns));
    for (auto& v : views) out.push_back({"atomic/" + v.dir + "/" + v.file, std::move(v.source)});
  }
  return out;
}

}  // namespace ucpfs::cli
