// Pattern rules (docs/design.md "Pattern rules"): how each parameter of a model is split for a
// target layout. A parameter's ParamPattern says its tensor-parallel kind and dimension,
// Shard-NC sub-parameters of fused tensors, vocabulary padding, pipeline placement and expert
// ownership; TargetSlice turns a pattern into the rank's LocalView, the boxes of the global
// tensor whose concatenation along one dim (plus zero padding) is the rank's local tensor —
// exactly what slice::LocalLayout takes.
//
// Presets follow the naming and tensor-parallel conventions of
// - torchtitan (Llama/MoE): its TP plan, DTensor chunk semantics for uneven splits (chunk =
//   ceil(n/T), the last ranks smaller or empty), global layer names on every stage, stacked
//   experts [n_experts, ...] split along dim 0 by EP;
// - Megatron-Core (GPT/Llama/Mixtral): divisibility required, SwiGLU linear_fc1 = [gate; up]
//   as two sub-parameters, group-interleaved linear_qkv (a plain dim-0 split, legal only when
//   the query groups divide by T), vocabulary padded to a multiple of 128*T, per-stage local
//   layer numbering, local_experts.<j> renumbered per EP rank; also Megatron-LM legacy and
//   Megatron-DeepSpeed names (encoder.layers.N.self_attention.query_key_value / dense,
//   mlp.dense_h_to_4h / dense_4h_to_h, encoder.final_layernorm) with the same semantics;
// - Hugging Face (Llama/Mistral/Mixtral): divisibility required, fused qkv_proj [Q; K; V]
//   with GQA sizes and gate_up_proj [gate; up] as Shard-NC.
// User rules (ParseRules, the --pattern-rules FILE) are tried before the preset; the first match wins.
// What the source geometry proves wins over any rule: CheckGeometry reports a conflict as an
// error naming the parameter.
//
// Not for: I/O, optimizer-state key naming (callers strip `optimizer.state.` etc. and pass the
// model fqn), layer-stacked names without a layer index (Megatron torch_dist
// `decoder.layers.self_attention...` with a prepended layer axis: index/mcore_unstack.h splits
// them per layer before they get here).
// Invariants: pure and deterministic; for every T and every non-replicated pattern, the pieces
// of the T tensor-parallel ranks cover every global element exactly once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/layout/layout.h"
#include "core/slice/slice.h"
#include "core/status.h"

namespace re2 {
class RE2;
}  // namespace re2

namespace ucpfs::layout {

enum class TpKind {
  kReplicate,  // every TP rank holds the whole tensor
  kColumn,     // split along tp_dim (0 for a plain weight: output features)
  kRow,        // split along tp_dim (1 for a plain weight: input features)
  kVocab,      // split along tp_dim 0 with rows padded to a multiple (Megatron) or not
  kPartial,    // source TP slices are partial values, averaged; every target rank holds all
};
const char* TpKindName(TpKind kind);

enum class PpPlacement {
  kLayer,           // on the stage holding `layer`
  kFirst,           // embeddings
  kLast,            // final norm, output head
  kTiedFirstLast,   // tied embeddings: on the first and the last stage
  kAll,             // every stage (e.g. rotary buffers)
};
const char* PpPlacementName(PpPlacement p);

// How a split that does not divide evenly is handled.
enum class UnevenSplit {
  kRequireDivisible,  // Megatron, Hugging Face: an error naming the parameter
  kChunk,             // torchtitan / DTensor: chunk = ceil(n/T), last ranks smaller or empty
};

struct ParamPattern {
  TpKind tp = TpKind::kReplicate;
  int tp_dim = -1;  // the split dimension; -1 for replicate/partial
  // Shard-NC: global sizes along tp_dim of each sub-parameter (sum = global size); each rank
  // holds [sub_0 chunk r; sub_1 chunk r; ...]. Empty = a plain shard.
  std::vector<int64_t> sub_sizes;
  // Megatron linear_qkv: [q heads; k; v] per query group, groups contiguous. A plain split
  // along dim 0 is right only when qkv_groups % T == 0 (checked by TargetSlice when known).
  bool qkv_group_interleaved = false;
  int64_t qkv_groups = 0;  // 0 = unknown
  // kVocab: the padded vocabulary is a multiple of vocab_pad_multiple * T (Megatron's
  // make_vocab_size_divisible_by = 128), computed from vocab_size = real rows (0 = the global
  // rows); 0 = no padding, except for stored rows T does not divide (then 128, as Megatron).
  // Every stored row up to the padded size is served as stored, source padding included.
  int64_t vocab_pad_multiple = 0;
  int64_t vocab_size = 0;
  // Rows padded past the stored ones repeat the last stored row instead of reading as zeros: what
  // Megatron-LM's checkpoint converters (tools/checkpoint, pad_weight) write when they pad a
  // Hugging Face vocabulary (ModelInfo::vocab_pad_repeat_last).
  bool vocab_pad_repeat_last = false;
  UnevenSplit uneven = UnevenSplit::kRequireDivisible;
  PpPlacement pp = PpPlacement::kAll;
  int layer = -1;         // global layer index for kLayer
  int expert = -1;        // global expert index of a per-expert parameter, else -1
  int64_t n_experts = 0;  // total experts (per-expert params and stacked experts)
  int expert_dim = -1;    // dim indexing experts in a stacked expert tensor, else -1
  std::string rule;       // which rule matched (for messages)
};

// kMegatronCore: the source's weights renamed and fused as Megatron-Core's GPTModel names them
// (views/mcore_from_hf.h: a Hugging Face Llama-family source), then split by the Megatron
// preset; its rules are the Megatron preset's.
enum class Preset { kAuto, kTorchtitan, kMegatron, kHuggingFace, kMegatronCore };
const char* PresetName(Preset p);
// "auto", "torchtitan", "megatron", "hf" (also "huggingface"), "megatron-core" (also "mcore").
// Errors: kInvalidArgument.
Result<Preset> ParsePreset(std::string_view name);

// The naming family of a model from its parameter names: the preset with most
// characteristic names; kAuto when none is recognised.
Preset DetectPreset(const std::vector<std::string>& names);

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
};

// What presets need beyond one parameter's name and shape. DetectModelInfo fills what the
// names and shapes prove; the caller may override from config (e.g. Megatron args).
struct ModelInfo {
  int n_layers = 0;              // max layer index + 1
  int64_t n_experts = 0;         // max expert index + 1 (per-expert names) or stacked dim 0
  bool tied_embeddings = false;  // no output head parameter
  // Megatron linear_fc1 is [gate; up] (SwiGLU): from fc1 rows == 2 * fc2 cols.
  std::optional<bool> gated_linear_unit;
  int64_t hidden_size = 0;          // embedding width
  int64_t num_attention_heads = 0;  // 0 = unknown (from config only)
  int64_t num_query_groups = 0;     // 0 = unknown (from config only)
  int64_t head_dim = 0;             // 0 = unknown (from config only)
  int64_t vocab_size = 0;           // original (unpadded) vocabulary; 0 = the global rows
  // Megatron's make_vocab_size_divisible_by (the padded vocabulary is a multiple of it times
  // T); 0 = the preset's default, 128.
  // Also set by --make-vocab-size-divisible-by, which then pads every vocabulary (any preset, and
  // a rule with no vocab_pad_multiple of its own) the Megatron way.
  int64_t vocab_pad_multiple = 0;
  // Vocabulary rows padded past the stored ones repeat the last stored row (ParamPattern's).
  bool vocab_pad_repeat_last = false;
};
// The largest vocabulary pad multiple a rule or --make-vocab-size-divisible-by may give.
inline constexpr int64_t kMaxVocabPadMultiple = int64_t{1} << 30;
ModelInfo DetectModelInfo(Preset preset, const std::vector<ParamInfo>& params);

// Facts a checkpoint records about its model (Megatron-LM's args) over what the names and
// shapes proved: every non-zero number and every set optional of `facts` replaces info's.
void ApplyModelFacts(const ModelInfo& facts, ModelInfo* info);

// The attention facts (num_attention_heads, num_query_groups, head_dim) of `a` and `b` together,
// from two places the user gave them (a rules file's "model", --hf-config): each given by one or
// by both alike. Errors: kInvalidArgument naming the fact and both sources when they differ.
Result<ModelInfo> MergeAttentionFacts(const ModelInfo& a, const std::string& a_source, const ModelInfo& b,
                                      const std::string& b_source);

// Whole-model checks of a layout, so that an invalid layout is refused with one reason before
// any parameter is sliced: pp vs the layer count (PipelineSplit, with `layers_per_stage` from
// --pp-split), experts divisible by ep, and, where the config gave them, attention heads and
// query groups divisible by tp. Per-parameter divisibility is TargetSlice's.
// Errors: kInvalidArgument naming the layout and the reason.
Status CheckLayoutForModel(const Layout& layout, const ModelInfo& info,
                           const std::optional<std::vector<int>>& layers_per_stage);

// One declarative rule (built-in, from --rules, or from a checkpoint's own pattern lists).
// `regex` is RE2 syntax (Perl-like: `\d`, `(?:...)`, Python's `(?P<name>...)`; no
// backreferences or lookaround), compiled with Latin-1 encoding so that any byte string is a
// name, and searched in the parameter name (RE2::PartialMatch; anchor with ^ and $). Matching
// is linear in the name's length with bounded memory, so rules and names may come from
// untrusted checkpoints. A first capture group, when present and numeric, is the layer index
// for kLayer (otherwise `(^|.)layers.<N>.` is used).
struct Rule {
  std::string regex;
  TpKind tp = TpKind::kReplicate;
  std::optional<int> tp_dim;            // default: 0 column/vocab, 1 row (shifted past expert_dim)
  std::vector<int64_t> sub_sizes;       // explicit Shard-NC sizes
  std::optional<PpPlacement> pp;        // default: kLayer when a layer index is found, else kAll
  int64_t vocab_pad_multiple = 0;
  std::optional<int> expert_dim;
  // Filled by MakeRule / ParseRules; shared, so a Rule stays cheap to copy. Null (a Rule that
  // never went through MakeRule) matches nothing.
  std::shared_ptr<const re2::RE2> compiled;
};

// The longest `regex` MakeRule accepts, in bytes.
inline constexpr size_t kMaxRulePatternBytes = 4096;

// Builds a rule, compiling its regex (RE2, about 8 MiB at most for its program and DFA caches).
// Errors: kInvalidArgument naming the pattern, with RE2's error text (bad syntax, a construct
// RE2 lacks, a program over the memory bound) or the length when over kMaxRulePatternBytes.
Result<Rule> MakeRule(Rule rule);

// Whether `rule` (from MakeRule) is found anywhere in `name`: RE2::PartialMatch, linear time.
bool RuleMatches(const Rule& rule, std::string_view name);

// The regexes of a preset's built-in rules, in the order PatternFor tries them (kAuto: none).
// They compile under MakeRule (a unit test checks every one).
std::vector<std::string> PresetPatterns(Preset preset);

// A pattern rules file (--pattern-rules): its rules, and the model facts it gives.
struct RulesFile {
  std::vector<Rule> rules;
  // "model": {"head_dim": N, "num_attention_heads": N, "num_key_value_heads": N} (any of them):
  // the attention facts a checkpoint does not store (fused_qkv.h; the Hugging Face fused
  // qkv_proj and Megatron's linear_qkv splits). num_key_value_heads is num_query_groups here.
  ModelInfo model;
};

// Parses a rules file's text: {"patterns": [{"pattern": "<RE2 regex>", "tp":
// "column|row|vocab|replicate|partial", "tp_dim": d, "sub_sizes": [..], "pp":
// "layer|first|last|tied|all", "vocab_pad_multiple": N, "expert_dim": d}, ...], "model": {...}}.
// Only "pattern" and "tp" are required; unknown keys are errors (a typo must not be ignored);
// "patterns" may be empty when "model" is given.
// Errors: kInvalidArgument naming `source` (the file name), the entry index or model field and
// the problem.
Result<RulesFile> ParseRulesFile(std::string_view json_text, const std::string& source);
// ParseRulesFile's rules alone.
Result<std::vector<Rule>> ParseRules(std::string_view json_text, const std::string& source);

// The pattern of parameter `name` (a model fqn) of `global_shape`: the first matching user rule,
// else the preset's rules (kAuto: the preset DetectPreset would give for this one name).
// Errors: kNotFound when nothing matches (the caller may then fall back to the source
// geometry, PatternFromGeometry); kInvalidArgument naming the parameter when a rule does not fit
// the shape (tp_dim out of range, sub_sizes not summing to the dim, a fused QKV whose sizes
// cannot be derived).
Result<ParamPattern> PatternFor(Preset preset, const std::string& name,
                                const std::vector<int64_t>& global_shape, const ModelInfo& info,
                                const std::vector<Rule>& user_rules = {});

// What the source's chunk geometry proves about a parameter: it is split along
// `source_shard_dim` (nullopt: one chunk, or replicated copies; nothing is proven).
// A pattern that splits along another dim, or replicates a tensor the source splits, is a
// conflict: kInvalidArgument naming the parameter, the rule and the source's dim. The expert
// dim and a dim the pattern splits are both accepted.
Status CheckGeometry(const ParamPattern& pattern, const std::string& name,
                     std::optional<int> source_shard_dim);

// The pattern the source geometry alone gives when no rule matched: a plain split along the
// source's dim (column for dim 0, row otherwise), or replicate when the source is one chunk.
ParamPattern PatternFromGeometry(const std::vector<int64_t>& global_shape,
                                 std::optional<int> source_shard_dim);

// A rank's view of one parameter.
struct LocalView {
  bool held = false;          // false: the rank does not hold this parameter (other stage/EP)
  std::string local_name;     // the fqn in the rank's files
  std::vector<int64_t> local_shape;
  int cat_dim = 0;            // the pieces are concatenated along this dim
  // Global boxes, in local order along cat_dim; every other dim matches local_shape. Their
  // extents along cat_dim may sum to less than local_shape[cat_dim]: the rest is zero padding
  // (vocabulary rows), at the end. Empty pieces are omitted.
  std::vector<slice::Box> pieces;
};

// The local view of parameter `name` on the rank at `coords` of `layout`, with pipeline stage
// boundaries `stage_bounds` (PipelineSplit). Local names: Megatron renumbers
// `decoder.layers.<global>` to the stage-local index and `local_experts.<j>` to the EP-local
// index, and names tied word embeddings `output_layer.weight` on a last stage that is not the
// first; torchtitan and Hugging Face keep global names.
// Errors: kInvalidArgument naming the parameter: a split that does not divide under
// kRequireDivisible (e.g. "rows 1000 not divisible by tp 3"), qkv groups not divisible by T,
// experts not divisible by EP, a layer outside the split, a pattern that does not fit the shape.
Result<LocalView> TargetSlice(Preset preset, const std::string& name, const ParamPattern& pattern,
                              const std::vector<int64_t>& global_shape, const Layout& layout,
                              const std::vector<int>& stage_bounds, const RankCoords& coords);

}  // namespace ucpfs::layout
