// What a scanner knows of a checkpoint beyond its files and items, as typed facts: one struct per
// scanner, held in Checkpoint::facts. The views ask these (std::get_if on the variant) instead of
// comparing format or flavor strings, which are display text only. The catalog stores the facts
// as one JSON blob; this file is its only encoder and decoder (one function pair per scanner), so
// no consumer parses it.
//
// Not for: what the views make of the facts (universal_view.h, view_inputs.h), reading the
// source's files (the scanners).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "index/hf_config.h"

namespace ucpfs::index {

// The largest stored form of the facts (EncodeSourceFacts), checked by the scanners that list
// files and by the catalog when it reads an index.
inline constexpr size_t kMaxSourceFactsBytes = 1 << 20;

// Megatron's `args` as Megatron-Core torch_dist keeps them in common.pt and Megatron-DeepSpeed in
// its DeepSpeed client state, decoded once (megatron_scan.h DecodeMegatronArgs): each number when
// saved as a positive int (num_query_groups only with group_query_attention set, as Megatron-LM
// keeps it from the command line even without GQA; else Megatron-DeepSpeed's num_key_value_heads).
struct MegatronCoreArgs {
  std::optional<int64_t> vocab_size, make_vocab_size_divisible_by, padded_vocab_size, num_attention_heads,
      num_query_groups, kv_channels;
  bool apply_wd_to_qk_layernorm = false;  // Megatron's weight-decay rule (MegatronNoWeightDecay)
  // The architecture fields of the args as saved (MegatronArchitectureArgs, megatron_scan.h): an
  // object of bools, numbers and strings, what the hf/ view's config.json is made of.
  nlohmann::json architecture = nlohmann::json::object();
};

// "dcp" (dcp_scan.h).
struct DcpSourceFacts {
  bool megatron_core = false;            // saved by Megatron-Core (metadata.json sharded_backend torch_dist)
  std::optional<MegatronCoreArgs> args;  // common.pt's args, when it parses and records any
};

// "deepspeed" (deepspeed_scan.h): what the universal view needs beyond the items.
struct DeepSpeedSourceFacts {
  std::string tag;     // the tag directory, "" when the directory is the tag
  int zero_stage = 0;  // 1, 2, 3, or 0 (BF16_Optimizer)
  int dp = 1, tp = 1, pp = 1;
  nlohmann::json universal_checkpoint_info;  // the model states' dict as plain JSON, or null
  std::vector<std::string> model_files;      // the model-states files ds_to_universal copies
  std::string optimizer_file;                // (mp 0, dp 0)'s optimizer file
  // Per param group, its step when the optimizer keeps it as a Python number, else nullopt.
  std::vector<std::optional<double>> number_steps;
  std::optional<MegatronCoreArgs> megatron_args;  // Megatron-DeepSpeed's client-state args, when any
};

// "megatron" (megatron_scan.h): the iteration and the model facts of the saved `args`.
struct MegatronSourceFacts {
  std::optional<std::string> iteration;  // the tracker's text; nullopt without a tracker
  std::string dir;                       // the iteration directory, "" when the directory is it
  int tp = 1, pp = 1;
  int64_t num_layers = 0, hidden_size = 0, num_attention_heads = 0, num_query_groups = 0, kv_channels = 0;
  bool swiglu = false, tied_embeddings = true;
  int64_t padded_vocab_size = 0;
  std::optional<int64_t> vocab_size;
  int64_t make_vocab_size_divisible_by = 0;  // 0: not saved
  bool distributed_optimizer = false;
  double checkpoint_version = 0;
  // The distributed optimizer's step (its param groups'), which distrib_optim.pt does not hold.
  std::optional<double> optimizer_step;
  std::optional<MegatronCoreArgs> args;  // rank 0's args decoded as the other Megatron sources' (hf/'s config.json)
};

// "torch_state" (torch_state_scan.h): where the positional optimizer lies and how its positions
// were named.
struct TorchStateSourceFacts {
  bool has_optimizer = true;      // false: a Lightning save_weights_only checkpoint
  std::string optimizer_file;     // the torch.save file holding the optimizer state dict
  std::string optimizer_prefix;   // its path inside the pickle, as item keys spell it ("" at the root)
  std::string optimizer_top_key;  // the top-level key that holds it (Lightning's optimizer_states), or ""
  std::string framework;          // "lightning", "torchtune", "hf_trainer", or "" (a script)
  std::optional<std::string> module_prefix;    // Lightning: the wrapped model's attribute stripped
  std::optional<std::string> weights_container;  // "safetensors" | "torch" (not Lightning)
  std::string weights_wrapper;    // the weights file's state-dict key, or ""
  std::string param_order;        // positional_optim.h ModuleOrderName, "state_dict", or "" (unknown)
  std::string grouping;           // positional_optim.h GroupingRuleName when positions were matched
  std::string ambiguous;          // else why not
  int64_t other_optimizers = 0;   // further optimizers in the file, not matched
};

// "weights" (weights_scan.h).
struct WeightsSourceFacts {
  std::string container;           // "safetensors" | "torch"
  std::vector<std::string> files;  // the weight files, relative
  int64_t skipped_values = 0;      // torch: values not served
  std::string state_dict_key;      // the wrapper key, or ""
  // The directory's config.json (a Hugging Face model folder), when it has one that parses;
  // else why not ("" when there is none).
  std::optional<HfModelConfig> hf_config;
  std::string hf_config_error;
};

using SourceFacts = std::variant<std::monostate, DcpSourceFacts, DeepSpeedSourceFacts, MegatronSourceFacts,
                                 TorchStateSourceFacts, WeightsSourceFacts>;

// The stored form: "" for none, else a JSON object with one key naming the alternative
// ("dcp", "deepspeed", "megatron", "torch_state", "weights").
std::string EncodeSourceFacts(const SourceFacts& facts);

// The inverse of EncodeSourceFacts; every field checked, since an index is untrusted.
// Errors: kCorrupt naming the field.
Result<SourceFacts> DecodeSourceFacts(std::string_view stored);

}  // namespace ucpfs::index
