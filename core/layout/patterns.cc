// Pattern rules, presets and target slicing (see patterns.h).
#include "core/layout/patterns.h"

#include <re2/re2.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <memory>

namespace ucpfs::layout {
namespace {

// Every regex here (built-in, user and checkpoint rules alike) is compiled with these: Latin-1,
// so any byte string is a name and `.` is one byte; no logging (errors come back as Status);
// bounded memory (RE2 falls back from its DFA to the NFA, still linear, when the cache fills).
constexpr int64_t kMaxRegexMemBytes = int64_t{8} << 20;

RE2::Options RegexOptions() {
  RE2::Options o;
  o.set_encoding(RE2::Options::EncodingLatin1);
  o.set_log_errors(false);
  o.set_max_mem(kMaxRegexMemBytes);
  return o;
}

std::unique_ptr<const RE2> CompileRegex(std::string_view pattern) {
  return std::make_unique<const RE2>(re2::StringPiece(pattern.data(), pattern.size()),
                                     RegexOptions());
}

// The first match of `re` in `text`: groups[0] the whole match, groups[i] capture group i for
// i < n_groups (an unmatched group is empty with a null data()). False when nothing matches.
bool Search(const RE2& re, std::string_view text, re2::StringPiece* groups, int n_groups) {
  return re.Match(re2::StringPiece(text.data(), text.size()), 0, text.size(), RE2::UNANCHORED,
                  groups, n_groups);
}

std::string_view View(const re2::StringPiece& s) { return {s.data(), s.size()}; }

// What precedes and what follows match groups[0] in `text` (groups from Search on `text`).
std::string Prefix(std::string_view text, const re2::StringPiece& whole) {
  return std::string(text.substr(0, static_cast<size_t>(whole.data() - text.data())));
}
std::string Suffix(std::string_view text, const re2::StringPiece& whole) {
  return std::string(text.substr(static_cast<size_t>(whole.data() - text.data()) + whole.size()));
}

// How a built-in rule derives Shard-NC sizes or other shape-dependent facts.
enum class Special {
  kNone,
  kHfQkv,        // [Q; K; V], Q = heads*head_dim (or the hidden size), K = V = the rest / 2
  kHalves,       // [gate; up], two equal halves
  kMegatronQkv,  // group-interleaved: plain dim-0 split, groups must divide by T
  kMegatronFc1,  // [gate; up] when the model uses a gated linear unit, else plain column
};

struct BuiltIn {
  const char* regex;
  TpKind tp;
  std::optional<PpPlacement> pp;  // nullopt: kLayer when a layer index is found, else kAll
  Special special = Special::kNone;
  bool embedding = false;  // input embedding: tied → first and last stage
  int expert_dim = -1;     // stacked experts
};

constexpr int64_t kMegatronVocabMultiple = 128;
// Repeated last rows (ParamPattern::vocab_pad_repeat_last) are one piece each; a pad multiple far
// past any real vocabulary would make millions of them.
constexpr int64_t kMaxRepeatedPadRows = 1 << 16;
constexpr int64_t kMaxDimSize = int64_t{1} << 48;  // make_vocab_size_divisible_by default

// Dims of a plain weight are [out, in]; stacked expert weights add leading dims, so column
// splits the second-to-last dim and row the last (1-D tensors: dim 0).
int DefaultTpDim(TpKind kind, size_t n_dims) {
  if (kind == TpKind::kReplicate || kind == TpKind::kPartial) return -1;
  if (n_dims <= 1) return 0;
  if (kind == TpKind::kRow) return static_cast<int>(n_dims) - 1;
  return static_cast<int>(n_dims) - 2;
}

const std::vector<BuiltIn>& TorchtitanRules() {
  static const std::vector<BuiltIn> rules = {
      {R"(^tok_embeddings\.weight$)", TpKind::kVocab, PpPlacement::kFirst, Special::kNone, true},
      {R"(^(output|lm_head)\.weight$)", TpKind::kVocab, PpPlacement::kLast},
      {R"(^norm\.weight$)", TpKind::kReplicate, PpPlacement::kLast},
      {R"(^freqs_cis$)", TpKind::kReplicate, PpPlacement::kAll},
      // 0.3 names them qkv_linear.w[qkv] (stored split) and qkv_linear.wqkv (the fused
      // parameter, ColwiseParallel: a chunk of whole kv head groups when tp divides them).
      {R"(\.attention\.(qkv_linear\.)?(w[qkv]|wqkv)\.(weight|bias)$)", TpKind::kColumn, std::nullopt},
      {R"(\.attention\.wo\.weight$)", TpKind::kRow, std::nullopt},
      {R"(\.attention\.wo\.bias$)", TpKind::kReplicate, std::nullopt},
      {R"(\.attention\.[qk]_norm\.weight$)", TpKind::kReplicate, std::nullopt},
      {R"(\.feed_forward\.w[13]\.weight$)", TpKind::kColumn, std::nullopt},
      {R"(\.feed_forward\.w2\.weight$)", TpKind::kRow, std::nullopt},
      {R"(\.(attention_norm|ffn_norm)\.weight$)", TpKind::kReplicate, std::nullopt},
      {R"(\.moe\.experts\.w[13]$)", TpKind::kColumn, std::nullopt, Special::kNone, false, 0},
      {R"(\.moe\.experts\.w2$)", TpKind::kRow, std::nullopt, Special::kNone, false, 0},
      {R"(\.moe\.shared_experts\.w[13](\.weight)?$)", TpKind::kColumn, std::nullopt},
      {R"(\.moe\.shared_experts\.w2(\.weight)?$)", TpKind::kRow, std::nullopt},
      {R"(\.moe\.router\.gate\.weight$)", TpKind::kReplicate, std::nullopt},
      {R"(\.moe\.(expert_bias|tokens_per_expert)$)", TpKind::kReplicate, std::nullopt},
  };
  return rules;
}

const std::vector<BuiltIn>& MegatronRules() {
  static const std::vector<BuiltIn> rules = {
      {R"((^|\.)embedding\.word_embeddings\.weight$)", TpKind::kVocab, PpPlacement::kFirst,
       Special::kNone, true},
      {R"((^|\.)embedding\.position_embeddings\.weight$)", TpKind::kReplicate,
       PpPlacement::kFirst},
      {R"((^|\.)output_layer\.weight$)", TpKind::kVocab, PpPlacement::kLast},
      {R"((^|\.)decoder\.final_layernorm\.(weight|bias)$)", TpKind::kReplicate,
       PpPlacement::kLast},
      {R"(\.layer_norm_(weight|bias)$)", TpKind::kReplicate, std::nullopt},
      {R"(\.(input_layernorm|pre_mlp_layernorm|post_attention_layernorm|q_layernorm|k_layernorm)\.(weight|bias)$)",
       TpKind::kReplicate, std::nullopt},
      {R"(\.self_attention\.linear_qkv\.(weight|bias)$)", TpKind::kColumn, std::nullopt,
       Special::kMegatronQkv},
      {R"(\.self_attention\.linear_proj\.weight$)", TpKind::kRow, std::nullopt},
      {R"(\.self_attention\.linear_proj\.bias$)", TpKind::kReplicate, std::nullopt},
      {R"(\.linear_fc1\.(weight|bias)$)", TpKind::kColumn, std::nullopt, Special::kMegatronFc1},
      {R"(\.linear_fc2\.weight$)", TpKind::kRow, std::nullopt},
      {R"(\.linear_fc2\.bias$)", TpKind::kReplicate, std::nullopt},
      {R"(\.mlp\.router\.(weight|bias|expert_bias)$)", TpKind::kReplicate, std::nullopt},
      {R"(\._extra_state$)", TpKind::kReplicate, std::nullopt},
      // Megatron-LM legacy and Megatron-DeepSpeed names (language_model.encoder.layers.N...).
      {R"((^|\.)encoder\.final_layernorm\.(weight|bias)$)", TpKind::kReplicate, PpPlacement::kLast},
      {R"(\.self_attention\.query_key_value\.(weight|bias)$)", TpKind::kColumn, std::nullopt,
       Special::kMegatronQkv},
      {R"(\.self_attention\.dense\.weight$)", TpKind::kRow, std::nullopt},
      {R"(\.self_attention\.dense\.bias$)", TpKind::kReplicate, std::nullopt},
      {R"(\.mlp\.dense_h_to_4h\.(weight|bias)$)", TpKind::kColumn, std::nullopt, Special::kMegatronFc1},
      {R"(\.mlp\.dense_4h_to_h\.weight$)", TpKind::kRow, std::nullopt},
      {R"(\.mlp\.dense_4h_to_h\.bias$)", TpKind::kReplicate, std::nullopt},
  };
  return rules;
}

const std::vector<BuiltIn>& HuggingFaceRules() {
  static const std::vector<BuiltIn> rules = {
      {R"(^model\.embed_tokens\.weight$)", TpKind::kVocab, PpPlacement::kFirst, Special::kNone,
       true},
      {R"(^lm_head\.weight$)", TpKind::kVocab, PpPlacement::kLast},
      {R"(^model\.norm\.weight$)", TpKind::kReplicate, PpPlacement::kLast},
      {R"(rotary_emb\.inv_freq$)", TpKind::kReplicate, PpPlacement::kAll},
      {R"(\.self_attn\.[qkv]_proj\.(weight|bias)$)", TpKind::kColumn, std::nullopt},
      {R"(\.self_attn\.qkv_proj\.(weight|bias)$)", TpKind::kColumn, std::nullopt, Special::kHfQkv},
      {R"(\.self_attn\.o_proj\.weight$)", TpKind::kRow, std::nullopt},
      {R"(\.self_attn\.o_proj\.bias$)", TpKind::kReplicate, std::nullopt},
      {R"(\.self_attn\.[qk]_norm\.weight$)", TpKind::kReplicate, std::nullopt},
      {R"(\.mlp\.(gate_proj|up_proj)\.weight$)", TpKind::kColumn, std::nullopt},
      {R"(\.mlp\.gate_up_proj\.weight$)", TpKind::kColumn, std::nullopt, Special::kHalves},
      {R"(\.mlp\.down_proj\.weight$)", TpKind::kRow, std::nullopt},
      {R"(\.(input_layernorm|post_attention_layernorm)\.weight$)", TpKind::kReplicate,
       std::nullopt},
      {R"(\.block_sparse_moe\.gate\.weight$)", TpKind::kReplicate, std::nullopt},
      {R"(\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$)", TpKind::kColumn, std::nullopt},
      {R"(\.block_sparse_moe\.experts\.\d+\.w2\.weight$)", TpKind::kRow, std::nullopt},
  };
  return rules;
}

const std::vector<BuiltIn>& RulesOf(Preset preset) {
  static const std::vector<BuiltIn> none;
  switch (preset) {
    case Preset::kTorchtitan: return TorchtitanRules();
    case Preset::kMegatron:
    case Preset::kMegatronCore: return MegatronRules();
    case Preset::kHuggingFace: return HuggingFaceRules();
    case Preset::kAuto: break;
  }
  return none;
}

// A built-in that failed to compile would match nothing; PresetPatterns' unit test keeps
// every one compiling.
struct CompiledBuiltIns {
  const std::vector<BuiltIn>* rules;
  std::vector<std::unique_ptr<const RE2>> regexes;
};

const CompiledBuiltIns& Compiled(Preset preset) {
  auto compile = [](const std::vector<BuiltIn>& rules) {
    CompiledBuiltIns c{&rules, {}};
    for (const BuiltIn& r : rules) c.regexes.push_back(CompileRegex(r.regex));
    return c;
  };
  static const CompiledBuiltIns torchtitan = compile(TorchtitanRules());
  static const CompiledBuiltIns megatron = compile(MegatronRules());
  static const CompiledBuiltIns hf = compile(HuggingFaceRules());
  switch (preset) {
    case Preset::kTorchtitan: return torchtitan;
    case Preset::kMegatron:
    case Preset::kMegatronCore: return megatron;
    default: return hf;
  }
}

const RE2& LayerRegex() {
  static const std::unique_ptr<const RE2> re = CompileRegex(R"((^|\.)layers\.(\d+)\.)");
  return *re;
}
const RE2& ExpertRegex() {
  static const std::unique_ptr<const RE2> re =
      CompileRegex(R"(\.(local_experts|experts)\.(\d+)\.)");
  return *re;
}

// A decimal that fits in int, else -1.
int ToIndex(std::string_view digits) {
  if (digits.empty()) return -1;
  int v = -1;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || ptr != digits.data() + digits.size()) return -1;
  return v;
}

int LayerOf(const std::string& name) {
  re2::StringPiece m[3];
  if (!Search(LayerRegex(), name, m, 3)) return -1;
  return ToIndex(View(m[2]));
}

int ExpertOf(const std::string& name) {
  re2::StringPiece m[3];
  if (!Search(ExpertRegex(), name, m, 3)) return -1;
  return ToIndex(View(m[2]));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status ParamError(const std::string& name, const std::string& why) {
  return InvalidArgumentError("parameter '" + name + "': " + why);
}

// Shared checks and fill-ins after a rule matched.
Result<ParamPattern> Finish(ParamPattern p, const std::string& name,
                            const std::vector<int64_t>& shape, std::optional<int> tp_dim) {
  if (p.tp == TpKind::kReplicate || p.tp == TpKind::kPartial) {
    p.tp_dim = -1;
    p.sub_sizes.clear();
  } else {
    int d = tp_dim.value_or(DefaultTpDim(p.tp, shape.size()));
    if (p.tp == TpKind::kVocab && !tp_dim) d = p.expert_dim >= 0 ? p.expert_dim + 1 : 0;
    if (shape.empty() || d < 0 || d >= static_cast<int>(shape.size())) {
      return ParamError(name, std::string(TpKindName(p.tp)) + " split along dim " +
                                  std::to_string(d) + " does not fit shape " + ShapeString(shape) +
                                  " (rule " + p.rule + ")");
    }
    if (d == p.expert_dim) {
      return ParamError(name, "tensor-parallel dim " + std::to_string(d) +
                                  " is the expert dim (rule " + p.rule + ")");
    }
    p.tp_dim = d;
    if (!p.sub_sizes.empty()) {
      int64_t sum = 0;
      for (int64_t s : p.sub_sizes) {
        if (s <= 0) return ParamError(name, "sub-parameter size " + std::to_string(s) + " <= 0");
        sum += s;
      }
      if (sum != shape[static_cast<size_t>(d)]) {
        return ParamError(name, "sub-parameter sizes sum to " + std::to_string(sum) +
                                    ", dim " + std::to_string(d) + " of shape " +
                                    ShapeString(shape) + " has " +
                                    std::to_string(shape[static_cast<size_t>(d)]) + " (rule " +
                                    p.rule + ")");
      }
    }
  }
  if (p.expert_dim >= static_cast<int>(shape.size())) {
    return ParamError(name, "expert dim " + std::to_string(p.expert_dim) + " does not fit shape " +
                                ShapeString(shape));
  }
  if (p.expert_dim >= 0 && p.n_experts == 0) p.n_experts = shape[static_cast<size_t>(p.expert_dim)];
  return p;
}

Result<ParamPattern> FromBuiltIn(Preset preset, const BuiltIn& rule, const std::string& name,
                                 const std::vector<int64_t>& shape, const ModelInfo& info) {
  ParamPattern p;
  p.rule = std::string(PresetName(preset)) + ":" + rule.regex;
  p.tp = rule.tp;
  p.uneven = preset == Preset::kTorchtitan ? UnevenSplit::kChunk : UnevenSplit::kRequireDivisible;
  p.layer = LayerOf(name);
  p.pp = rule.pp.value_or(p.layer >= 0 ? PpPlacement::kLayer : PpPlacement::kAll);
  if (rule.embedding && info.tied_embeddings) p.pp = PpPlacement::kTiedFirstLast;
  if (p.pp != PpPlacement::kLayer) p.layer = -1;
  p.expert_dim = rule.expert_dim;
  p.expert = ExpertOf(name);
  if (p.expert >= 0) p.n_experts = info.n_experts;
  if (p.tp == TpKind::kVocab) {
    p.vocab_size = info.vocab_size;
    p.vocab_pad_repeat_last = info.vocab_pad_repeat_last;
    if (preset == Preset::kMegatron || preset == Preset::kMegatronCore) {
      p.vocab_pad_multiple = info.vocab_pad_multiple > 0 ? info.vocab_pad_multiple : kMegatronVocabMultiple;
    } else {
      p.vocab_pad_multiple = info.vocab_pad_multiple;  // given: --make-vocab-size-divisible-by
    }
  }
  const bool is_weight = shape.size() == 2;
  const int64_t rows = shape.empty() ? 0 : shape[0];
  switch (rule.special) {
    case Special::kNone: break;
    case Special::kHalves:
      if (rows % 2 != 0) return ParamError(name, "fused [gate; up] has odd rows " + std::to_string(rows));
      p.sub_sizes = {rows / 2, rows / 2};
      break;
    case Special::kMegatronFc1:
      if (!info.gated_linear_unit.has_value()) {
        return ParamError(name, "cannot tell whether linear_fc1 is a fused [gate; up] (SwiGLU); "
                                "set gated_linear_unit in the model config or give a rule");
      }
      if (*info.gated_linear_unit) {
        if (rows % 2 != 0) return ParamError(name, "SwiGLU linear_fc1 has odd rows " + std::to_string(rows));
        p.sub_sizes = {rows / 2, rows / 2};
      }
      break;
    case Special::kMegatronQkv: {
      p.qkv_group_interleaved = true;
      p.qkv_groups = info.num_query_groups;
      int64_t hidden = is_weight ? shape[1] : info.hidden_size;
      int64_t head_dim = info.head_dim;
      if (head_dim == 0 && info.num_attention_heads > 0 && hidden > 0 &&
          hidden % info.num_attention_heads == 0) {
        head_dim = hidden / info.num_attention_heads;
      }
      int64_t q_size = info.num_attention_heads > 0 && head_dim > 0
                           ? info.num_attention_heads * head_dim
                           : hidden;
      if (p.qkv_groups == 0 && head_dim > 0 && q_size > 0 && rows > q_size &&
          (rows - q_size) % (2 * head_dim) == 0) {
        p.qkv_groups = (rows - q_size) / (2 * head_dim);
      }
      break;
    }
    case Special::kHfQkv: {
      int64_t hidden = is_weight ? shape[1] : info.hidden_size;
      int64_t q_size = info.num_attention_heads > 0 && info.head_dim > 0
                           ? info.num_attention_heads * info.head_dim
                           : hidden;
      if (q_size <= 0 || rows <= q_size || (rows - q_size) % 2 != 0) {
        return ParamError(name, "fused qkv_proj of shape " + ShapeString(shape) +
                                    ": cannot derive [Q; K; V] sizes (q size " +
                                    std::to_string(q_size) +
                                    "); give num_attention_heads and head_dim or a rule with "
                                    "sub_sizes");
      }
      p.sub_sizes = {q_size, (rows - q_size) / 2, (rows - q_size) / 2};
      break;
    }
  }
  return Finish(std::move(p), name, shape, std::nullopt);
}

Result<ParamPattern> FromUserRule(const Rule& rule, const std::string& name,
                                  const std::vector<int64_t>& shape, const ModelInfo& info,
                                  std::string_view first_group) {
  ParamPattern p;
  p.rule = "rules:" + rule.regex;
  p.tp = rule.tp;
  p.uneven = UnevenSplit::kRequireDivisible;
  p.sub_sizes = rule.sub_sizes;
  p.vocab_pad_multiple = rule.vocab_pad_multiple;
  if (p.tp == TpKind::kVocab) {
    p.vocab_size = info.vocab_size;
    // The rule's own multiple, else the model's (Megatron args, --make-vocab-size-divisible-by).
    if (p.vocab_pad_multiple == 0) p.vocab_pad_multiple = info.vocab_pad_multiple;
  }
  p.expert_dim = rule.expert_dim.value_or(-1);
  p.expert = ExpertOf(name);
  if (p.expert >= 0) p.n_experts = info.n_experts;
  p.layer = ToIndex(first_group);
  if (p.layer < 0) p.layer = LayerOf(name);
  p.pp = rule.pp.value_or(p.layer >= 0 ? PpPlacement::kLayer : PpPlacement::kAll);
  if (p.pp == PpPlacement::kLayer && p.layer < 0) {
    return ParamError(name, "rule '" + rule.regex + "' places it by layer, but the name has no "
                                                    "layer index");
  }
  if (p.pp != PpPlacement::kLayer) p.layer = -1;
  std::optional<int> tp_dim = rule.tp_dim;
  if (!tp_dim && p.expert_dim >= 0 && p.tp != TpKind::kReplicate && p.tp != TpKind::kPartial) {
    // Default dims count past a leading expert dim.
    tp_dim = p.tp == TpKind::kRow ? p.expert_dim + 2 : p.expert_dim + 1;
    if (shape.size() == 2) tp_dim = p.expert_dim == 0 ? 1 : 0;
  }
  return Finish(std::move(p), name, shape, tp_dim);
}

// Splits [0, n) into T parts; part r is [lo, hi). Errors (kRequireDivisible) when T does not
// divide n, or the part is not a multiple of granule.
Status SplitRange(int64_t n, int t, int r, UnevenSplit uneven, const std::string& name,
                  const std::string& what, int64_t* lo, int64_t* hi) {
  if (uneven == UnevenSplit::kRequireDivisible) {
    if (n % t != 0) {
      return ParamError(name, what + " " + std::to_string(n) + " not divisible by tp " +
                                  std::to_string(t));
    }
    *lo = n / t * r;
    *hi = *lo + n / t;
    return Status::Ok();
  }
  // DTensor Shard: chunk = ceil(n/T); the last ranks get less or nothing.
  int64_t chunk = (n + t - 1) / t;
  *lo = std::min(n, chunk * r);
  *hi = std::min(n, chunk * (r + 1));
  return Status::Ok();
}

}  // namespace

const char* TpKindName(TpKind kind) {
  switch (kind) {
    case TpKind::kReplicate: return "replicate";
    case TpKind::kColumn: return "column";
    case TpKind::kRow: return "row";
    case TpKind::kVocab: return "vocab";
    case TpKind::kPartial: return "partial";
  }
  return "?";
}

const char* PpPlacementName(PpPlacement p) {
  switch (p) {
    case PpPlacement::kLayer: return "layer";
    case PpPlacement::kFirst: return "first";
    case PpPlacement::kLast: return "last";
    case PpPlacement::kTiedFirstLast: return "tied";
    case PpPlacement::kAll: return "all";
  }
  return "?";
}

const char* PresetName(Preset p) {
  switch (p) {
    case Preset::kAuto: return "auto";
    case Preset::kTorchtitan: return "torchtitan";
    case Preset::kMegatron: return "megatron";
    case Preset::kHuggingFace: return "hf";
    case Preset::kMegatronCore: return "megatron-core";
  }
  return "?";
}

Result<Preset> ParsePreset(std::string_view name) {
  if (name == "auto") return Preset::kAuto;
  if (name == "torchtitan") return Preset::kTorchtitan;
  if (name == "megatron") return Preset::kMegatron;
  if (name == "hf" || name == "huggingface") return Preset::kHuggingFace;
  if (name == "megatron-core" || name == "mcore") return Preset::kMegatronCore;
  return InvalidArgumentError("unknown preset '" + std::string(name) +
                              "' (expected auto, torchtitan, megatron, hf or megatron-core)");
}

Preset DetectPreset(const std::vector<std::string>& names) {
  static const std::unique_ptr<const RE2> torchtitan = CompileRegex(
      R"(^(tok_embeddings\.weight|layers\.\d+\.(attention\.w[qkvo]|attention\.qkv_linear\.|feed_forward\.w[123]|moe\.|attention_norm|ffn_norm)))");
  static const std::unique_ptr<const RE2> megatron = CompileRegex(
      R"((^|\.)(embedding\.word_embeddings\.|(decoder|encoder)\.layers\.\d+\.(self_attention|mlp)\.|output_layer\.weight))");
  static const std::unique_ptr<const RE2> hf = CompileRegex(
      R"(^(model\.embed_tokens\.|model\.layers\.\d+\.(self_attn|mlp|block_sparse_moe)\.|lm_head\.weight))");
  int64_t votes[3] = {0, 0, 0};
  for (const std::string& n : names) {
    if (RE2::PartialMatch(n, *torchtitan)) ++votes[0];
    if (RE2::PartialMatch(n, *megatron)) ++votes[1];
    if (RE2::PartialMatch(n, *hf)) ++votes[2];
  }
  int64_t best = std::max({votes[0], votes[1], votes[2]});
  if (best == 0) return Preset::kAuto;
  if (votes[0] == best) return Preset::kTorchtitan;
  if (votes[1] == best) return Preset::kMegatron;
  return Preset::kHuggingFace;
}

ModelInfo DetectModelInfo(Preset preset, const std::vector<ParamInfo>& params) {
  ModelInfo info;
  std::map<std::string, const ParamInfo*> by_name;
  for (const ParamInfo& p : params) by_name[p.name] = &p;
  bool has_embedding = false;
  bool has_head = false;
  for (const ParamInfo& p : params) {
    int layer = LayerOf(p.name);
    if (layer >= 0) info.n_layers = std::max(info.n_layers, layer + 1);
    int expert = ExpertOf(p.name);
    if (expert >= 0) info.n_experts = std::max<int64_t>(info.n_experts, int64_t{expert} + 1);
    const std::string& n = p.name;
    auto ends_with = [&n](std::string_view s) {
      return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0;
    };
    if (ends_with("tok_embeddings.weight") || ends_with("embedding.word_embeddings.weight") ||
        ends_with("embed_tokens.weight")) {
      has_embedding = true;
      if (p.shape.size() == 2) info.hidden_size = p.shape[1];
    }
    if (n == "output.weight" || ends_with("output_layer.weight") || n == "lm_head.weight") {
      has_head = true;
    }
    if (preset == Preset::kTorchtitan && ends_with(".moe.experts.w1") && !p.shape.empty()) {
      info.n_experts = std::max(info.n_experts, p.shape[0]);
    }
    // SwiGLU: fc1 rows are twice fc2's columns (Megatron-Core linear_fc1/linear_fc2, legacy
    // dense_h_to_4h/dense_4h_to_h).
    const bool core_fc1 = ends_with(".linear_fc1.weight"), legacy_fc1 = ends_with(".mlp.dense_h_to_4h.weight");
    if ((preset == Preset::kMegatron || preset == Preset::kMegatronCore) && !info.gated_linear_unit.has_value() && (core_fc1 || legacy_fc1) &&
        p.shape.size() == 2) {
      const std::string_view fc1_name = core_fc1 ? "linear_fc1.weight" : "dense_h_to_4h.weight";
      std::string fc2 = n.substr(0, n.size() - fc1_name.size()) +
                        (core_fc1 ? "linear_fc2.weight" : "dense_4h_to_h.weight");
      auto it = by_name.find(fc2);
      if (it != by_name.end() && it->second->shape.size() == 2) {
        info.gated_linear_unit = p.shape[0] == 2 * it->second->shape[1];
      }
    }
  }
  info.tied_embeddings = has_embedding && !has_head;
  return info;
}

void ApplyModelFacts(const ModelInfo& facts, ModelInfo* info) {
  auto take = [](int64_t fact, int64_t* into) {
    if (fact > 0) *into = fact;
  };
  if (facts.n_layers > 0) info->n_layers = facts.n_layers;
  take(facts.n_experts, &info->n_experts);
  if (facts.gated_linear_unit.has_value()) info->gated_linear_unit = facts.gated_linear_unit;
  take(facts.hidden_size, &info->hidden_size);
  take(facts.num_attention_heads, &info->num_attention_heads);
  take(facts.num_query_groups, &info->num_query_groups);
  take(facts.head_dim, &info->head_dim);
  take(facts.vocab_size, &info->vocab_size);
  take(facts.vocab_pad_multiple, &info->vocab_pad_multiple);
  if (facts.vocab_pad_repeat_last) info->vocab_pad_repeat_last = true;
}

Result<ModelInfo> MergeAttentionFacts(const ModelInfo& a, const std::string& a_source, const ModelInfo& b,
                                      const std::string& b_source) {
  ModelInfo out = a;
  const std::pair<const char*, int64_t ModelInfo::*> kFacts[] = {
      {"num_attention_heads", &ModelInfo::num_attention_heads},
      {"num_key_value_heads", &ModelInfo::num_query_groups},
      {"head_dim", &ModelInfo::head_dim}};
  for (const auto& [name, field] : kFacts) {
    if (b.*field <= 0) continue;
    if (a.*field > 0 && a.*field != b.*field) {
      return InvalidArgumentError(std::string(name) + ": " + a_source + " gives " + std::to_string(a.*field) + ", " +
                                  b_source + " gives " + std::to_string(b.*field));
    }
    out.*field = b.*field;
  }
  return out;
}

Status CheckLayoutForModel(const Layout& layout, const ModelInfo& info,
                           const std::optional<std::vector<int>>& layers_per_stage) {
  auto fail = [&layout](const std::string& why) {
    return InvalidArgumentError("layout " + layout.name + ": " + why);
  };
  Result<std::vector<int>> split = PipelineSplit(info.n_layers, layout.pp, layers_per_stage);
  if (!split.ok()) return fail(split.error().message());
  if (layout.ep > 1 && (info.n_experts == 0 || info.n_experts % layout.ep != 0)) {
    return fail(std::to_string(info.n_experts) + " experts not divisible by ep" +
                std::to_string(layout.ep));
  }
  if (info.num_attention_heads > 0 && info.num_attention_heads % layout.tp != 0) {
    return fail(std::to_string(info.num_attention_heads) + " attention heads not divisible by tp" +
                std::to_string(layout.tp));
  }
  if (info.num_query_groups > 0 && info.num_query_groups % layout.tp != 0) {
    return fail(std::to_string(info.num_query_groups) + " query groups not divisible by tp" +
                std::to_string(layout.tp));
  }
  return Status::Ok();
}

Result<Rule> MakeRule(Rule rule) {
  rule.compiled.reset();
  if (rule.regex.size() > kMaxRulePatternBytes) {
    return InvalidArgumentError("rule pattern '" + rule.regex.substr(0, 64) + "...': " +
                                std::to_string(rule.regex.size()) + " bytes, over the limit of " +
                                std::to_string(kMaxRulePatternBytes));
  }
  std::shared_ptr<const RE2> re = CompileRegex(rule.regex);
  if (!re->ok()) {
    return InvalidArgumentError("rule pattern '" + rule.regex + "': " + re->error());
  }
  rule.compiled = std::move(re);
  return rule;
}

bool RuleMatches(const Rule& rule, std::string_view name) {
  return rule.compiled != nullptr &&
         RE2::PartialMatch(re2::StringPiece(name.data(), name.size()), *rule.compiled);
}

std::vector<std::string> PresetPatterns(Preset preset) {
  std::vector<std::string> out;
  for (const BuiltIn& r : RulesOf(preset)) out.emplace_back(r.regex);
  return out;
}

Result<ParamPattern> PatternFor(Preset preset, const std::string& name,
                                const std::vector<int64_t>& global_shape, const ModelInfo& info,
                                const std::vector<Rule>& user_rules) {
  for (const Rule& rule : user_rules) {
    if (rule.compiled == nullptr) continue;
    // The whole match and the first capture group (the layer index), when the rule has one.
    re2::StringPiece m[2];
    const int n_groups = std::min(rule.compiled->NumberOfCapturingGroups(), 1) + 1;
    if (Search(*rule.compiled, name, m, n_groups)) {
      return FromUserRule(rule, name, global_shape, info, View(m[1]));
    }
  }
  if (preset == Preset::kAuto) preset = DetectPreset({name});
  if (preset == Preset::kAuto) {
    return NotFoundError("parameter '" + name + "': no rule matches and no preset recognises "
                                                "the name");
  }
  const CompiledBuiltIns& c = Compiled(preset);
  for (size_t i = 0; i < c.regexes.size(); ++i) {
    if (RE2::PartialMatch(name, *c.regexes[i])) {
      return FromBuiltIn(preset, (*c.rules)[i], name, global_shape, info);
    }
  }
  return NotFoundError("parameter '" + name + "': no rule of preset " + PresetName(preset) +
                       " matches (add one with --rules)");
}

Status CheckGeometry(const ParamPattern& pattern, const std::string& name,
                     std::optional<int> source_shard_dim) {
  if (!source_shard_dim.has_value()) return Status::Ok();
  int d = *source_shard_dim;
  if (d == pattern.expert_dim || d == pattern.tp_dim) return Status::Ok();
  std::string said = pattern.tp == TpKind::kReplicate || pattern.tp == TpKind::kPartial
                         ? std::string(TpKindName(pattern.tp))
                         : std::string(TpKindName(pattern.tp)) + " along dim " +
                               std::to_string(pattern.tp_dim);
  return InvalidArgumentError("parameter '" + name + "': the source splits it along dim " +
                              std::to_string(d) + " but rule " + pattern.rule + " says " + said +
                              " (fix the rule; the source geometry wins)");
}

ParamPattern PatternFromGeometry(const std::vector<int64_t>& global_shape,
                                 std::optional<int> source_shard_dim) {
  ParamPattern p;
  p.rule = "source geometry";
  if (!source_shard_dim.has_value() || *source_shard_dim < 0 ||
      *source_shard_dim >= static_cast<int>(global_shape.size())) {
    p.tp = TpKind::kReplicate;
    return p;
  }
  p.tp = *source_shard_dim == 0 ? TpKind::kColumn : TpKind::kRow;
  p.tp_dim = *source_shard_dim;
  p.uneven = UnevenSplit::kChunk;
  return p;
}

Result<LocalView> TargetSlice(Preset preset, const std::string& name, const ParamPattern& pattern,
                              const std::vector<int64_t>& shape, const Layout& layout,
                              const std::vector<int>& stage_bounds, const RankCoords& coords) {
  LocalView view;
  // Pipeline placement.
  const int last_stage = layout.pp - 1;
  int stage_first_layer = 0;
  switch (pattern.pp) {
    case PpPlacement::kLayer: {
      int stage = StageOfLayer(stage_bounds, pattern.layer);
      if (stage < 0) {
        return ParamError(name, "layer " + std::to_string(pattern.layer) +
                                    " is outside the pipeline split");
      }
      if (stage != coords.pp) return view;
      stage_first_layer = stage_bounds[static_cast<size_t>(stage)];
      break;
    }
    case PpPlacement::kFirst:
      if (coords.pp != 0) return view;
      break;
    case PpPlacement::kLast:
      if (coords.pp != last_stage) return view;
      break;
    case PpPlacement::kTiedFirstLast:
      if (coords.pp != 0 && coords.pp != last_stage) return view;
      break;
    case PpPlacement::kAll: break;
  }
  // Expert ownership (per-expert parameters).
  int local_expert = pattern.expert;
  if (pattern.expert >= 0 && layout.ep > 1) {
    if (pattern.n_experts <= 0 || pattern.n_experts % layout.ep != 0) {
      return ParamError(name, "experts " + std::to_string(pattern.n_experts) +
                                  " not divisible by ep " + std::to_string(layout.ep));
    }
    int64_t per_rank = pattern.n_experts / layout.ep;
    if (pattern.expert / per_rank != coords.ep) return view;
    local_expert = static_cast<int>(pattern.expert - per_rank * coords.ep);
  }
  view.held = true;
  view.local_name = name;
  if (preset == Preset::kMegatron || preset == Preset::kMegatronCore) {
    // Megatron numbers layers per stage and experts per EP rank.
    if (pattern.pp == PpPlacement::kLayer) {
      re2::StringPiece m[3];
      if (Search(LayerRegex(), name, m, 3)) {
        view.local_name = Prefix(name, m[0]) + std::string(View(m[1])) + "layers." +
                          std::to_string(pattern.layer - stage_first_layer) + "." +
                          Suffix(name, m[0]);
      }
    }
    // Tied embeddings: a last stage that is not the first holds the word embeddings as its
    // output layer (GPTModel's output_layer.weight, loaded from the embedding's key).
    constexpr std::string_view kWordEmbeddings = "embedding.word_embeddings.weight";
    if (pattern.pp == PpPlacement::kTiedFirstLast && coords.pp == last_stage && coords.pp != 0 &&
        name.ends_with(kWordEmbeddings) &&
        (name.size() == kWordEmbeddings.size() || name[name.size() - kWordEmbeddings.size() - 1] == '.')) {
      view.local_name = name.substr(0, name.size() - kWordEmbeddings.size()) + "output_layer.weight";
    }
    if (pattern.expert >= 0) {
      re2::StringPiece m[3];
      const std::string current = view.local_name;
      if (Search(ExpertRegex(), current, m, 3)) {
        view.local_name = Prefix(current, m[0]) + "." + std::string(View(m[1])) + "." +
                          std::to_string(local_expert) + "." + Suffix(current, m[0]);
      }
    }
  }

  // The box of the whole tensor, then narrowed by EP (stacked experts) and TP.
  slice::Box whole;
  whole.offsets.assign(shape.size(), 0);
  whole.sizes = shape;
  for (int64_t s : shape) {
    // The cap keeps every offset product below int64 overflow (padding math included).
    if (s < 0 || s > kMaxDimSize) {
      return ParamError(name, "size out of range in shape " + ShapeString(shape));
    }
  }
  if (pattern.expert_dim >= 0) {
    if (pattern.expert_dim >= static_cast<int>(shape.size())) {
      return ParamError(name, "expert dim does not fit shape " + ShapeString(shape));
    }
    const size_t ed = static_cast<size_t>(pattern.expert_dim);
    int64_t n = shape[ed];
    if (n % layout.ep != 0) {
      return ParamError(name, "experts " + std::to_string(n) + " not divisible by ep " +
                                  std::to_string(layout.ep));
    }
    whole.offsets[ed] = n / layout.ep * coords.ep;
    whole.sizes[ed] = n / layout.ep;
  }
  const int t = layout.tp;
  const int r = coords.tp;
  // Vocabulary rows are cut to the real vocabulary and padded even at tp1 (Megatron pads to a
  // multiple of 128), so they never take this shortcut.
  if (pattern.tp == TpKind::kReplicate || pattern.tp == TpKind::kPartial ||
      (t == 1 && pattern.tp != TpKind::kVocab)) {
    view.cat_dim = 0;
    view.local_shape = whole.sizes;
    if (whole.Volume() > 0 || shape.empty()) view.pieces.push_back(whole);
    return view;
  }
  if (pattern.tp_dim < 0 || pattern.tp_dim >= static_cast<int>(shape.size())) {
    return ParamError(name, "tensor-parallel dim " + std::to_string(pattern.tp_dim) +
                                " does not fit shape " + ShapeString(shape));
  }
  const size_t d = static_cast<size_t>(pattern.tp_dim);
  view.cat_dim = pattern.tp_dim;
  view.pieces.clear();
  view.local_shape = whole.sizes;
  const int64_t n = whole.sizes[d];
  const int64_t base = whole.offsets[d];

  if (pattern.tp == TpKind::kVocab) {
    // Every stored row is served as stored, source padding included: a stored row past the real
    // vocabulary may still be a live one (Megatron's NullTokenizer adds an EOD row past
    // args.vocab_size), and Megatron's own loader copies the stored rows too. With a pad
    // multiple, the target is padded from the real vocabulary the way Megatron pads it; every
    // rank holds padded/T rows, the stored ones first, zeros after (only the last ranks have
    // zeros), and stored rows past the target's padded size do not fit it. Without, the stored
    // rows are split like any other dim.
    int64_t real = pattern.vocab_size > 0 ? std::min(pattern.vocab_size, n) : n;
    int64_t lo = 0;
    int64_t hi = 0;
    // Stored rows T does not divide (a weights-only model's 97, GPT-2's 50257) are padded the
    // way Megatron pads, to a multiple of 128 * T, instead of refused.
    const bool odd = pattern.vocab_pad_multiple == 0 &&
                     pattern.uneven == UnevenSplit::kRequireDivisible && n % t != 0;
    const int64_t pad_multiple = odd ? kMegatronVocabMultiple : pattern.vocab_pad_multiple;
    if (pad_multiple > 0) {
      int64_t multiple = pad_multiple * t;
      int64_t padded = (real + multiple - 1) / multiple * multiple;
      int64_t per_rank = padded / t;
      int64_t served = std::min(n, padded);
      lo = std::min(served, per_rank * r);
      hi = std::min(served, per_rank * (r + 1));
      view.local_shape[d] = per_rank;
    } else {
      UCPFS_RETURN_IF_ERROR(SplitRange(n, t, r, pattern.uneven, name, "vocabulary rows", &lo, &hi));
      view.local_shape[d] = hi - lo;
    }
    if (hi > lo) {
      slice::Box b = whole;
      b.offsets[d] = base + lo;
      b.sizes[d] = hi - lo;
      view.pieces.push_back(std::move(b));
    }
    // Megatron-LM's converters pad a vocabulary by repeating its last row
    // (`torch.cat((w, w[-1].unsqueeze(0).expand(padding_size, -1)))`): one piece per padded row,
    // each the last stored row, in place of the zeros.
    const int64_t n_pad_rows = view.local_shape[d] - (hi - lo);
    if (pattern.vocab_pad_repeat_last && n_pad_rows > 0 && n > 0) {
      if (n_pad_rows > kMaxRepeatedPadRows) {
        return ParamError(name, std::to_string(n_pad_rows) + " padded vocabulary rows on one rank: more than " +
                                    std::to_string(kMaxRepeatedPadRows) + " repeated last rows");
      }
      slice::Box last = whole;
      last.offsets[d] = base + n - 1;
      last.sizes[d] = 1;
      view.pieces.insert(view.pieces.end(), static_cast<size_t>(n_pad_rows), last);
    }
    return view;
  }
  if (pattern.qkv_group_interleaved && t > 1) {
    if (pattern.qkv_groups == 0) {
      return ParamError(name, "group-interleaved linear_qkv needs the number of query groups "
                              "(num_query_groups, or num_attention_heads / head_dim) to split "
                              "by tp " + std::to_string(t));
    }
    if (pattern.qkv_groups % t != 0) {
      return ParamError(name, "query groups " + std::to_string(pattern.qkv_groups) +
                                  " not divisible by tp " + std::to_string(t));
    }
  }
  std::vector<int64_t> subs = pattern.sub_sizes;
  if (subs.empty()) subs.push_back(n);
  int64_t sub_start = 0;
  int64_t local_size = 0;
  for (size_t i = 0; i < subs.size(); ++i) {
    const std::string what = subs.size() == 1
                                 ? "dim " + std::to_string(d) + " size"
                                 : "sub-parameter " + std::to_string(i) + " size";
    int64_t lo = 0;
    int64_t hi = 0;
    UCPFS_RETURN_IF_ERROR(SplitRange(subs[i], t, r, pattern.uneven, name, what, &lo, &hi));
    if (hi > lo) {
      slice::Box b = whole;
      b.offsets[d] = base + sub_start + lo;
      b.sizes[d] = hi - lo;
      view.pieces.push_back(std::move(b));
    }
    local_size += hi - lo;
    sub_start += subs[i];
  }
  if (sub_start != n) {
    return ParamError(name, "sub-parameter sizes sum to " + std::to_string(sub_start) +
                                ", dim " + std::to_string(d) + " has " + std::to_string(n));
  }
  view.local_shape[d] = local_size;
  return view;
}

}  // namespace ucpfs::layout
