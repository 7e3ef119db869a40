// Megatron-LM legacy scanner: a save directory of Megatron-LM's `--ckpt-format torch`
// (docs/formats.md "Megatron-LM legacy saves"): `latest_checkpointed_iteration.txt` (an iteration
// or `release`) naming `iter_<7 digits>/` (or `release/`), or one such directory itself, holding
// `mp_rank_<TT>[_<PPP>]/model_optim_rng.pt` per tensor-parallel rank TT and pipeline stage PPP
// (`_PPP` only when pp > 1), written by dp rank 0 of each.
//
// Everything about the model comes from the saved `args` (an argparse.Namespace, read as data):
// tensor_model_parallel_size, pipeline_model_parallel_size, num_layers (stages split evenly, or
// decoder_first/last_pipeline_num_layers), num_attention_heads, num_query_groups
// (group_query_attention), kv_channels, hidden_size, swiglu, padded_vocab_size,
// make_vocab_size_divisible_by, vocab_size (when the run gave one; plus one with
// tokenizer_type NullTokenizer: MegatronTokenizerVocab), untie_embeddings_and_output_weights.
// Every rank's file must agree with rank 0's args; checkpoint_version must be >= 3.0.
//
// Items (keys the built-in key rules map), each a GLOBAL tensor: every model tensor `<fqn>` of
// `model` with the stage's layer numbers made global (`decoder.layers.<n>`, legacy
// `encoder.layers.<n>`), each tp rank's slice placed through layout::TargetSlice with the
// Megatron preset and the args' facts (column, row, vocabulary with its padded rows, SwiGLU
// linear_fc1 [gate; up], group-interleaved linear_qkv; tp-replicated tensors read from tp rank 0);
// with tied embeddings, the last stage's copy (`output_layer.weight` and its optimizer state) is
// not read (Megatron keeps it equal to the first stage's embedding). Optimizer state of the
// non-distributed optimizer (`optimizer`: Float16OptimizerWithFloat16Params' {optimizer,
// fp32_from_fp16_params} or FP32Optimizer's torch.optim state dict): `optimizer.state.<fqn>.
// fp32_param` (bf16/fp16 parameters' fp32 masters; fp32 parameters are their own master),
// `.exp_avg`, `.exp_avg_sq`, `.step`. Megatron's param groups keep only positions: a position is
// matched to its parameter as Megatron built the groups (model order, weight decay off for
// biases and 1-D tensors: wd_mult 0), each shape checked.
// The distributed optimizer's state (args.use_distributed_optimizer): `distrib_optim.pt` beside
// each rank's model_optim_rng.pt (DistributedOptimizer.save_parameter_state, dp rank 0), whose
// grad buffer 0 holds fp32 "world" vectors `param`, `exp_avg`, `exp_avg_sq` and `numel_unpadded`:
// the same item keys, each parameter's range found by Megatron-Core's grad-buffer layout
// (BufferOffsets in the .cc: reverse model order, 64-element starts, buckets from
// overlap_grad_reduce / ddp_bucket_size / the 40M default, none past the first stage, a tied
// embedding's copy in its own bucket; bucket-end padding stripped), the total checked against
// numel_unpadded and every vector's length. The step is the param groups' (a number in
// model_optim_rng.pt): MegatronSourceFacts::optimizer_step, served by MegatronOptimizerStep.
//
// Checkpoint::facts: MegatronSourceFacts (source_facts.h), the iteration and the model facts of
// the saved `args`, and rank 0's args decoded as DecodeMegatronArgs reads them (the hf/ view's).
//
// Supported: Megatron-LM checkpoint_version 3.0 files as Megatron-LM with Megatron-Core
// >= 0.5 writes them (param groups with wd_mult). Refused with kUnsupported naming the file:
// virtual pipelines (`model0`, ...), expert parallelism and MoE (num_experts), pipeline splits
// that account for embedding or loss, checkpoint versions < 3.0, a ChainedOptimizer of several
// optimizers, param groups that differ by more than weight decay (lr_mult / decoupled_lr
// overrides) for the non-distributed optimizer. distrib_optim.pt: the coalesced format
// (`buckets_coalesced`, Megatron-Core >= 0.7) laid out as Megatron-Core 0.13 to 0.19 lay out their
// grad buffers (read from their param_and_grad_buffer.py; tested with 0.16.1). Refused with
// kUnsupported: per-bucket lists (no buckets_coalesced), a list of states (a ChainedOptimizer),
// several grad buffers (parameters of several dtypes, whose states megatron-core 0.16.1 itself
// saves mismatched), context parallelism, several optimizer instances, multi-token prediction,
// FSDP, args.ddp_num_buckets. Every inconsistency (a missing rank directory or file, a tracker
// naming no directory, args that disagree, shapes that do not make one tensor, a truncated file,
// a distrib_optim.pt missing or whose sizes or dtypes are not the model's layout: Megatron-Core
// 0.7-0.12 files differ around padding and the tied embedding's bucket, and the size check is
// what refuses them) is kCorrupt naming the file.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/format/pickle.h"
#include "core/layout/patterns.h"
#include "core/status.h"
#include "index/checkpoint.h"
#include "index/scanner.h"

namespace ucpfs::index {

// True when `dir` holds a regular `latest_checkpointed_iteration.txt`, or is itself an
// iteration directory (a directory `mp_rank_00` or `mp_rank_00_000` with `model_optim_rng.pt`).
bool IsMegatronLegacyDirectory(const SourceTree& tree);

// Errors: kNotFound, kCorrupt, kUnsupported (see above), naming the file.
Result<Checkpoint> ScanMegatronLegacy(const SourceTree& tree, const ScanProgress& progress = nullptr);

// The model facts a Megatron-LM legacy checkpoint's MegatronSourceFacts record (heads, query
// groups, head dim, hidden size, SwiGLU, layers, unpadded vocabulary, vocabulary pad multiple);
// all zero for other checkpoints. Errors: none today (the facts were checked when decoded).
Result<layout::ModelInfo> MegatronModelFacts(const Checkpoint& checkpoint);

// The vocabulary of a Megatron-LM run's tokenizer from its args: `vocab_size`, plus the EOD row
// Megatron-LM's NullTokenizer appends (its eod id is vocab_size; its vocab_size property is
// vocab_size + 1, which _vocab_size_with_padding pads). 0 stays 0 (unknown). Shared by this
// scanner and the torch_dist one (dcp_scan.cc), so the target views pad from, and the
// safetensors view strips to, the rows the tokenizer really has.
int64_t MegatronTokenizerVocab(int64_t args_vocab_size, std::string_view tokenizer_type);

// The fields of Megatron-LM's saved `args` (an argparse.Namespace or a dict) that
// describe the model's architecture (kMegatronArchitectureArgNames: layers, widths, heads, norm,
// rotary, biases, tied embeddings, dtype flags), as a JSON object of what each holds when it is a
// bool, number or string (at most 256 bytes); a torch dtype (params_dtype) as "torch.<name>".
// Others, and fields holding anything else, are left out: the reader names what is missing.
nlohmann::json MegatronArchitectureArgs(const pickle::PickleGraph& g, pickle::NodeId args);

// The model facts of a Megatron `args` (an argparse.Namespace, read as data) that the views need
// to split for another layout: vocabulary (MegatronTokenizerVocab), its pad multiple, padded
// vocabulary, heads, query groups, kv_channels, apply_wd_to_qk_layernorm. Query groups are
// Megatron-LM's num_query_groups when group_query_attention is set (it keeps the command line's
// value even without GQA), else Megatron-DeepSpeed's num_key_value_heads (which it always sets:
// the heads without GQA; its fused query_key_value is group-interleaved as Megatron-Core's).
// Each number only when saved as a positive int; nullopt when `args` records none. Shared by the
// torch_dist scanner (common.pt, dcp_scan.cc) and the DeepSpeed one (Megatron-DeepSpeed's
// client state, deepspeed_scan.cc), so the args are decoded in one place.
std::optional<MegatronCoreArgs> DecodeMegatronArgs(const pickle::PickleGraph& g, pickle::NodeId args);

// Megatron-Core's weight-decay rule (optimizer/__init__.py get_standard_config_overrides, as
// _get_param_groups applies it to model_chunk.named_parameters()): no weight decay (wd_mult 0)
// for biases (`*.bias`) and 1-D parameters (norms), except q/k layernorms when
// apply_wd_to_qk_layernorm is set. Shared by this scanner and the torch_dist one (dcp_scan.h).
bool MegatronNoWeightDecay(const std::string& name, size_t n_dims, bool wd_on_qk_layernorm);

// The step of a Megatron-LM legacy checkpoint saved with the distributed optimizer (its param groups'
// step, which model_optim_rng.pt holds as a number and distrib_optim.pt does not hold);
// nullopt for other checkpoints or when the groups record none.
std::optional<double> MegatronOptimizerStep(const Checkpoint& checkpoint);

}  // namespace ucpfs::index
