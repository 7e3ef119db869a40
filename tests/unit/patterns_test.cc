// Pattern rules and target slicing: preset detection per naming family, PatternFor on the
// representative names of each preset, local names (Megatron per-stage layers and EP-local
// experts), rules files, the RE2 regex engine (every built-in pattern compiles; pathological
// patterns and megabyte names run in linear time without recursion; invalid or over-long
// patterns refused naming them; Python named groups; byte names), geometry conflicts, and a
// seeded property test: for random shapes, T and each TP kind (Shard-NC and vocab padding
// included), the rank pieces cover each global element exactly once and the local tensors,
// concatenated in rank order (per sub-parameter), rebuild the global tensor (element index
// arrays as the oracle).
// Seed: UCPFS_TEST_SEED, else random; printed either way.
#include <gtest/gtest.h>

#include "tests/unit/test_seed.h"

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <random>

#include "core/layout/fused_qkv.h"
#include "core/layout/patterns.h"

namespace ucpfs::slice {
void PrintTo(const Box& b, std::ostream* os) {
  *os << "Box(offsets=[";
  for (size_t i = 0; i < b.offsets.size(); ++i) *os << (i ? "," : "") << b.offsets[i];
  *os << "], sizes=[";
  for (size_t i = 0; i < b.sizes.size(); ++i) *os << (i ? "," : "") << b.sizes[i];
  *os << "])";
}
}  // namespace ucpfs::slice

namespace ucpfs::layout {
namespace {

using ::ucpfs::testing::TestSeed;

using Shape = std::vector<int64_t>;

// ---------------------------------------------------------------- preset detection

TEST(DetectPreset, EachFamily) {
  EXPECT_EQ(DetectPreset({"tok_embeddings.weight", "layers.0.attention.wq.weight", "norm.weight",
                          "output.weight"}),
            Preset::kTorchtitan);
  EXPECT_EQ(DetectPreset({"embedding.word_embeddings.weight",
                          "decoder.layers.0.self_attention.linear_qkv.weight",
                          "decoder.final_layernorm.weight", "output_layer.weight"}),
            Preset::kMegatron);
  EXPECT_EQ(DetectPreset({"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                          "model.norm.weight", "lm_head.weight"}),
            Preset::kHuggingFace);
  EXPECT_EQ(DetectPreset({"model.layers.3.block_sparse_moe.experts.0.w1.weight"}),
            Preset::kHuggingFace);
  EXPECT_EQ(DetectPreset({"layers.1.moe.experts.w1"}), Preset::kTorchtitan);
  EXPECT_EQ(DetectPreset({"foo.bar", "baz"}), Preset::kAuto);
  EXPECT_EQ(DetectPreset({}), Preset::kAuto);
  EXPECT_EQ(ParsePreset("hf").value(), Preset::kHuggingFace);
  EXPECT_EQ(ParsePreset("megatron").value(), Preset::kMegatron);
  EXPECT_FALSE(ParsePreset("deepspeed").ok());
}

TEST(DetectModelInfo, LayersExpertsTiedGated) {
  ModelInfo m = DetectModelInfo(
      Preset::kMegatron,
      {{"embedding.word_embeddings.weight", {1000, 64}},
       {"decoder.layers.0.mlp.linear_fc1.weight", {512, 64}},
       {"decoder.layers.0.mlp.linear_fc2.weight", {64, 256}},
       {"decoder.layers.11.mlp.experts.local_experts.7.linear_fc1.weight", {512, 64}}});
  EXPECT_EQ(m.n_layers, 12);
  EXPECT_EQ(m.n_experts, 8);
  EXPECT_TRUE(m.tied_embeddings);
  ASSERT_TRUE(m.gated_linear_unit.has_value());
  EXPECT_TRUE(*m.gated_linear_unit);
  EXPECT_EQ(m.hidden_size, 64);
  ModelInfo t = DetectModelInfo(Preset::kTorchtitan, {{"tok_embeddings.weight", {100, 16}},
                                                      {"layers.3.moe.experts.w1", {8, 32, 16}},
                                                      {"output.weight", {100, 16}}});
  EXPECT_EQ(t.n_layers, 4);
  EXPECT_EQ(t.n_experts, 8);
  EXPECT_FALSE(t.tied_embeddings);
}

// ---------------------------------------------------------------- PatternFor per preset

struct Expect {
  std::string name;
  Shape shape;
  TpKind tp;
  int tp_dim;
  PpPlacement pp;
  int layer = -1;
  std::vector<int64_t> sub_sizes = {};
  int expert_dim = -1;
  int expert = -1;
};

void CheckAll(Preset preset, const ModelInfo& info, const std::vector<Expect>& cases) {
  for (const Expect& e : cases) {
    Result<ParamPattern> p = PatternFor(preset, e.name, e.shape, info);
    ASSERT_TRUE(p.ok()) << e.name << ": " << p.status().ToString();
    EXPECT_EQ(p->tp, e.tp) << e.name << " got " << TpKindName(p->tp);
    EXPECT_EQ(p->tp_dim, e.tp_dim) << e.name;
    EXPECT_EQ(p->pp, e.pp) << e.name << " got " << PpPlacementName(p->pp);
    EXPECT_EQ(p->layer, e.layer) << e.name;
    EXPECT_EQ(p->sub_sizes, e.sub_sizes) << e.name;
    EXPECT_EQ(p->expert_dim, e.expert_dim) << e.name;
    EXPECT_EQ(p->expert, e.expert) << e.name;
  }
}

TEST(PatternFor, Torchtitan) {
  ModelInfo info;
  info.n_layers = 4;
  using K = TpKind;
  using P = PpPlacement;
  CheckAll(Preset::kTorchtitan, info,
           {
               {"tok_embeddings.weight", {1000, 64}, K::kVocab, 0, P::kFirst},
               {"layers.2.attention.wq.weight", {64, 64}, K::kColumn, 0, P::kLayer, 2},
               {"layers.2.attention.wk.weight", {16, 64}, K::kColumn, 0, P::kLayer, 2},
               {"layers.2.attention.wv.weight", {16, 64}, K::kColumn, 0, P::kLayer, 2},
               {"layers.2.attention.wo.weight", {64, 64}, K::kRow, 1, P::kLayer, 2},
               {"layers.0.feed_forward.w1.weight", {256, 64}, K::kColumn, 0, P::kLayer, 0},
               {"layers.0.feed_forward.w3.weight", {256, 64}, K::kColumn, 0, P::kLayer, 0},
               {"layers.0.feed_forward.w2.weight", {64, 256}, K::kRow, 1, P::kLayer, 0},
               {"layers.1.attention_norm.weight", {64}, K::kReplicate, -1, P::kLayer, 1},
               {"layers.1.ffn_norm.weight", {64}, K::kReplicate, -1, P::kLayer, 1},
               {"norm.weight", {64}, K::kReplicate, -1, P::kLast},
               {"output.weight", {1000, 64}, K::kVocab, 0, P::kLast},
               {"layers.3.moe.experts.w1", {8, 128, 64}, K::kColumn, 1, P::kLayer, 3, {}, 0},
               {"layers.3.moe.experts.w3", {8, 128, 64}, K::kColumn, 1, P::kLayer, 3, {}, 0},
               {"layers.3.moe.experts.w2", {8, 64, 128}, K::kRow, 2, P::kLayer, 3, {}, 0},
               {"layers.3.moe.router.gate.weight", {8, 64}, K::kReplicate, -1, P::kLayer, 3},
               {"layers.3.moe.shared_experts.w1.weight", {128, 64}, K::kColumn, 0, P::kLayer, 3},
               {"layers.3.moe.shared_experts.w2.weight", {64, 128}, K::kRow, 1, P::kLayer, 3},
           });
  ParamPattern p = PatternFor(Preset::kTorchtitan, "layers.0.attention.wq.weight", {64, 64}, info)
                       .value();
  EXPECT_EQ(p.uneven, UnevenSplit::kChunk);
  EXPECT_EQ(p.vocab_pad_multiple, 0);
  Result<ParamPattern> unknown = PatternFor(Preset::kTorchtitan, "layers.0.foo.weight", {4}, info);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("layers.0.foo.weight"), std::string::npos);
}

TEST(PatternFor, Megatron) {
  ModelInfo info;
  info.n_layers = 4;
  info.n_experts = 8;
  info.gated_linear_unit = true;
  using K = TpKind;
  using P = PpPlacement;
  // hidden 64, 8 heads of 8, 2 query groups: qkv rows = 64 + 2*2*8 = 96.
  CheckAll(
      Preset::kMegatron, info,
      {
          {"embedding.word_embeddings.weight", {1024, 64}, K::kVocab, 0, P::kFirst},
          {"decoder.layers.1.self_attention.linear_qkv.weight", {96, 64}, K::kColumn, 0,
           P::kLayer, 1},
          {"decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", {64}, K::kReplicate,
           -1, P::kLayer, 1},
          {"decoder.layers.1.self_attention.linear_proj.weight", {64, 64}, K::kRow, 1, P::kLayer,
           1},
          {"decoder.layers.1.mlp.linear_fc1.weight", {512, 64}, K::kColumn, 0, P::kLayer, 1,
           {256, 256}},
          {"decoder.layers.1.mlp.linear_fc2.weight", {64, 256}, K::kRow, 1, P::kLayer, 1},
          {"decoder.layers.1.input_layernorm.weight", {64}, K::kReplicate, -1, P::kLayer, 1},
          {"decoder.final_layernorm.weight", {64}, K::kReplicate, -1, P::kLast},
          {"output_layer.weight", {1024, 64}, K::kVocab, 0, P::kLast},
          {"decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight", {512, 64},
           K::kColumn, 0, P::kLayer, 2, {256, 256}, -1, 5},
          {"decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight", {64, 256}, K::kRow,
           1, P::kLayer, 2, {}, -1, 5},
          {"decoder.layers.2.mlp.router.weight", {8, 64}, K::kReplicate, -1, P::kLayer, 2},
      });
  ParamPattern emb =
      PatternFor(Preset::kMegatron, "embedding.word_embeddings.weight", {1000, 64}, info).value();
  EXPECT_EQ(emb.vocab_pad_multiple, 128);
  info.tied_embeddings = true;
  EXPECT_EQ(
      PatternFor(Preset::kMegatron, "embedding.word_embeddings.weight", {1000, 64}, info)->pp,
      PpPlacement::kTiedFirstLast);
  // Query groups derived from num_attention_heads: (96 - 64) / (2 * 8) = 2.
  info.num_attention_heads = 8;
  ParamPattern qkv = PatternFor(Preset::kMegatron,
                                "decoder.layers.0.self_attention.linear_qkv.weight", {96, 64}, info)
                         .value();
  EXPECT_TRUE(qkv.qkv_group_interleaved);
  EXPECT_EQ(qkv.qkv_groups, 2);
  // Not gated: plain column fc1. Unknown: an error naming the parameter.
  info.gated_linear_unit = false;
  EXPECT_TRUE(PatternFor(Preset::kMegatron, "decoder.layers.0.mlp.linear_fc1.weight", {256, 64},
                         info)
                  ->sub_sizes.empty());
  info.gated_linear_unit.reset();
  Result<ParamPattern> unknown =
      PatternFor(Preset::kMegatron, "decoder.layers.0.mlp.linear_fc1.weight", {256, 64}, info);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("decoder.layers.0.mlp.linear_fc1.weight"),
            std::string::npos);
}

TEST(PatternFor, HuggingFace) {
  ModelInfo info;
  info.n_layers = 2;
  info.hidden_size = 64;
  using K = TpKind;
  using P = PpPlacement;
  // GQA: q 64, k = v = 16 → fused rows 96.
  CheckAll(Preset::kHuggingFace, info,
           {
               {"model.embed_tokens.weight", {1000, 64}, K::kVocab, 0, P::kFirst},
               {"model.layers.0.self_attn.q_proj.weight", {64, 64}, K::kColumn, 0, P::kLayer, 0},
               {"model.layers.0.self_attn.k_proj.weight", {16, 64}, K::kColumn, 0, P::kLayer, 0},
               {"model.layers.0.self_attn.v_proj.weight", {16, 64}, K::kColumn, 0, P::kLayer, 0},
               {"model.layers.0.self_attn.o_proj.weight", {64, 64}, K::kRow, 1, P::kLayer, 0},
               {"model.layers.1.self_attn.qkv_proj.weight", {96, 64}, K::kColumn, 0, P::kLayer, 1,
                {64, 16, 16}},
               {"model.layers.1.self_attn.qkv_proj.bias", {96}, K::kColumn, 0, P::kLayer, 1,
                {64, 16, 16}},
               {"model.layers.1.mlp.gate_proj.weight", {256, 64}, K::kColumn, 0, P::kLayer, 1},
               {"model.layers.1.mlp.up_proj.weight", {256, 64}, K::kColumn, 0, P::kLayer, 1},
               {"model.layers.1.mlp.down_proj.weight", {64, 256}, K::kRow, 1, P::kLayer, 1},
               {"model.layers.1.mlp.gate_up_proj.weight", {512, 64}, K::kColumn, 0, P::kLayer, 1,
                {256, 256}},
               {"model.layers.1.input_layernorm.weight", {64}, K::kReplicate, -1, P::kLayer, 1},
               {"model.layers.1.post_attention_layernorm.weight", {64}, K::kReplicate, -1,
                P::kLayer, 1},
               {"model.norm.weight", {64}, K::kReplicate, -1, P::kLast},
               {"lm_head.weight", {1000, 64}, K::kVocab, 0, P::kLast},
               {"model.layers.1.block_sparse_moe.gate.weight", {8, 64}, K::kReplicate, -1,
                P::kLayer, 1},
               {"model.layers.1.block_sparse_moe.experts.3.w1.weight", {256, 64}, K::kColumn, 0,
                P::kLayer, 1, {}, -1, 3},
               {"model.layers.1.block_sparse_moe.experts.3.w2.weight", {64, 256}, K::kRow, 1,
                P::kLayer, 1, {}, -1, 3},
           });
  // Explicit heads override the hidden-size guess (q 8*16 = 128 ≠ hidden 64).
  info.num_attention_heads = 8;
  info.head_dim = 16;
  EXPECT_EQ(PatternFor(Preset::kHuggingFace, "model.layers.1.self_attn.qkv_proj.weight",
                       {192, 64}, info)
                ->sub_sizes,
            (std::vector<int64_t>{128, 32, 32}));
  Result<ParamPattern> bad = PatternFor(
      Preset::kHuggingFace, "model.layers.1.self_attn.qkv_proj.weight", {100, 64}, info);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("qkv_proj"), std::string::npos);
  // kAuto picks the family from the name.
  EXPECT_EQ(PatternFor(Preset::kAuto, "model.layers.0.self_attn.o_proj.weight", {64, 64}, info)
                ->tp,
            TpKind::kRow);
}

// ---------------------------------------------------------------- rules files

TEST(Rules, ParseAndOverride) {
  Result<std::vector<Rule>> rules = ParseRules(R"({"patterns": [
      {"pattern": "attention\\.wq\\.weight$", "tp": "row"},
      {"pattern": "fused_qkv\\.weight$", "tp": "column", "sub_sizes": [8, 4, 4]},
      {"pattern": "^embed$", "tp": "vocab", "pp": "tied", "vocab_pad_multiple": 64},
      {"pattern": "^blocks\\.(\\d+)\\.experts$", "tp": "column", "expert_dim": 0},
      {"pattern": "scale$", "tp": "partial", "pp": "all"}
  ]})",
                                               "my_rules.json");
  ASSERT_TRUE(rules.ok()) << rules.status().ToString();
  ASSERT_EQ(rules->size(), 5u);
  ModelInfo info;
  ParamPattern wq =
      PatternFor(Preset::kTorchtitan, "layers.0.attention.wq.weight", {64, 64}, info, *rules)
          .value();
  EXPECT_EQ(wq.tp, TpKind::kRow);
  EXPECT_EQ(wq.tp_dim, 1);
  EXPECT_EQ(wq.pp, PpPlacement::kLayer);
  EXPECT_EQ(wq.layer, 0);
  ParamPattern fused =
      PatternFor(Preset::kAuto, "x.fused_qkv.weight", {16, 32}, info, *rules).value();
  EXPECT_EQ(fused.sub_sizes, (std::vector<int64_t>{8, 4, 4}));
  ParamPattern embed = PatternFor(Preset::kAuto, "embed", {100, 8}, info, *rules).value();
  EXPECT_EQ(embed.pp, PpPlacement::kTiedFirstLast);
  EXPECT_EQ(embed.vocab_pad_multiple, 64);
  ParamPattern experts =
      PatternFor(Preset::kAuto, "blocks.5.experts", {4, 16, 8}, info, *rules).value();
  EXPECT_EQ(experts.layer, 5);
  EXPECT_EQ(experts.expert_dim, 0);
  EXPECT_EQ(experts.tp_dim, 1);
  EXPECT_EQ(experts.n_experts, 4);
  EXPECT_EQ(PatternFor(Preset::kAuto, "a.scale", {3}, info, *rules)->tp, TpKind::kPartial);
  // Sub sizes that do not fit the shape name the parameter.
  Result<ParamPattern> misfit = PatternFor(Preset::kAuto, "y.fused_qkv.weight", {17, 32}, info,
                                           *rules);
  ASSERT_FALSE(misfit.ok());
  EXPECT_NE(misfit.status().message().find("y.fused_qkv.weight"), std::string::npos);
}

TEST(Rules, Errors) {
  struct Case {
    const char* json;
    const char* message_part;
  };
  const Case cases[] = {
      {"not json", "not valid JSON"},
      {"[]", "expected {\"patterns\""},
      {R"({"patterns": [], "extra": 1})", "unknown top-level key 'extra'"},
      {R"({"patterns": [{"tp": "row"}]})", "patterns[0]: missing 'pattern'"},
      {R"({"patterns": [{"pattern": "x"}]})", "missing 'tp'"},
      {R"({"patterns": [{"pattern": "x", "tp": "diagonal"}]})", "'tp' must be"},
      {R"({"patterns": [{"pattern": "x", "tp": "row", "pp": "middle"}]})", "'pp' must be"},
      {R"({"patterns": [{"pattern": "x", "tp": "row", "tp_dmi": 1}]})", "unknown key 'tp_dmi'"},
      {R"({"patterns": [{"pattern": "x", "tp": "row", "sub_sizes": [1, -2]}]})", "sub_sizes"},
      {R"({"patterns": [{"pattern": "x", "tp": "row", "tp_dim": -1}]})", "'tp_dim' must be"},
      {R"({"patterns": [{"pattern": "(", "tp": "row"}]})", "patterns[0]"},
  };
  for (const Case& c : cases) {
    Result<std::vector<Rule>> r = ParseRules(c.json, "r.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_NE(r.status().message().find(c.message_part), std::string::npos)
        << c.json << " -> " << r.status().message();
    EXPECT_NE(r.status().message().find("r.json"), std::string::npos) << r.status().message();
  }
}

// A rules file's "model": the attention facts a checkpoint does not store; alone or with patterns.
TEST(Rules, ModelFacts) {
  Result<RulesFile> f = ParseRulesFile(R"({"model": {"head_dim": 16, "num_key_value_heads": 4}})", "m.json");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_TRUE(f->rules.empty());
  EXPECT_EQ(f->model.head_dim, 16);
  EXPECT_EQ(f->model.num_query_groups, 4);
  EXPECT_EQ(f->model.num_attention_heads, 0);
  for (const char* bad : {R"({"model": {"heads": 4}})", R"({"model": {"head_dim": 0}})", R"({"model": [1]})",
                          R"({"model": {"head_dim": "16"}})"}) {
    Result<RulesFile> r = ParseRulesFile(bad, "m.json");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("m.json: model"), std::string::npos) << r.status().message();
  }
  // Two places the user gave them: equal or one-sided facts merge, differing ones are named.
  ModelInfo rules, config;
  rules.head_dim = 16;
  config.num_attention_heads = 8;
  config.head_dim = 16;
  Result<ModelInfo> both = MergeAttentionFacts(rules, "--pattern-rules r.json", config, "--hf-config c.json");
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(both->num_attention_heads, 8);
  config.head_dim = 32;
  Result<ModelInfo> clash = MergeAttentionFacts(rules, "--pattern-rules r.json", config, "--hf-config c.json");
  ASSERT_FALSE(clash.ok());
  EXPECT_NE(clash.status().message().find("head_dim: --pattern-rules r.json gives 16, --hf-config c.json gives 32"),
            std::string::npos)
      << clash.status().message();
}

// torchtitan's FusedQKVLinear rows, [n_kv, heads_per_kv + 2, head_dim]: group g is its query
// heads, its key head, its value head (its _split_qkv_on_save). The parts are found by name in
// any order; the head dimension comes from any one fact, and a missing or misfitting one is named.
TEST(FusedQkv, RowsPerKeyValueHead) {
  ModelInfo facts;
  facts.head_dim = 2;
  const std::vector<std::string> names = {"l.wk.weight", "l.wq.weight", "l.wv.weight"};
  // 3 kv heads of 2 query heads, head_dim 2: q 12 rows, k = v = 6 rows, fused 24.
  Result<FusedQkv> q = FusedQkvOf("l.wqkv.weight", 24, names, {6, 12, 6}, facts);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->n_kv_heads, 3);
  EXPECT_EQ(q->heads_per_kv, 2);
  using Rows = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(q->FusedRowsOf(1), (Rows{{0, 4}, {8, 4}, {16, 4}}));  // wq
  EXPECT_EQ(q->FusedRowsOf(0), (Rows{{4, 2}, {12, 2}, {20, 2}}));  // wk
  EXPECT_EQ(q->FusedRowsOf(2), (Rows{{6, 2}, {14, 2}, {22, 2}}));  // wv
  ModelInfo groups;
  groups.num_query_groups = 3;
  EXPECT_EQ(FusedQkvOf("l.wqkv.weight", 24, names, {6, 12, 6}, groups)->head_dim, 2);
  ModelInfo heads;
  heads.num_attention_heads = 6;
  EXPECT_EQ(FusedQkvOf("l.wqkv.weight", 24, names, {6, 12, 6}, heads)->head_dim, 2);

  Result<FusedQkv> none = FusedQkvOf("l.wqkv.weight", 24, names, {6, 12, 6}, {});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("'l.wqkv.weight'"), std::string::npos);
  EXPECT_NE(none.status().message().find("head_dim"), std::string::npos);
  heads.head_dim = 3;
  EXPECT_FALSE(FusedQkvOf("l.wqkv.weight", 24, names, {6, 12, 6}, heads).ok());  // 3 vs 6 heads' 2
  EXPECT_FALSE(FusedQkvOf("l.wqkv.weight", 24, {"l.wa.weight", "l.wq.weight", "l.wv.weight"}, {6, 12, 6}, facts).ok());
  EXPECT_FALSE(FusedQkvOf("l.wqkv.weight", 22, names, {6, 12, 6}, facts).ok());
  EXPECT_FALSE(FusedQkvOf("l.wqkv.weight", 12, {"l.wq.weight", "l.wk.weight"}, {6, 6}, facts).ok());
}

// ---------------------------------------------------------------- the regex engine (RE2)

// Patterns and names may come from untrusted checkpoints: RE2 must refuse what it cannot run
// and run the rest in time linear in the name, with no recursion per byte (std::regex, the
// previous engine, hangs on the first case and overflows the stack on the second).

Rule Make(const std::string& regex, TpKind tp = TpKind::kColumn) {
  Rule r;
  r.regex = regex;
  r.tp = tp;
  Result<Rule> made = MakeRule(std::move(r));
  EXPECT_TRUE(made.ok()) << regex << " -> " << made.status().message();
  return made.ok() ? std::move(made).value() : Rule{};
}

int64_t MillisSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start)
      .count();
}

TEST(RuleRegex, EveryPresetPatternCompiles) {
  for (Preset p : {Preset::kTorchtitan, Preset::kMegatron, Preset::kHuggingFace}) {
    const std::vector<std::string> patterns = PresetPatterns(p);
    EXPECT_FALSE(patterns.empty()) << PresetName(p);
    for (const std::string& regex : patterns) {
      Rule r;
      r.regex = regex;
      Result<Rule> made = MakeRule(std::move(r));
      EXPECT_TRUE(made.ok()) << PresetName(p) << ": " << made.status().message();
    }
  }
  EXPECT_TRUE(PresetPatterns(Preset::kAuto).empty());
}

TEST(RuleRegex, PathologicalPatternsRunInLinearTime) {
  const std::string name(100000, 'a');
  ModelInfo info;
  for (const char* regex : {"(a*)*b", "(a|aa)*c", "^(a+)+$x", "(a*)*(a*)*(a*)*(a*)*b",
                            "(?:(?:a|a?)+){20}b"}) {
    const Rule rule = Make(regex);
    const auto start = std::chrono::steady_clock::now();
    EXPECT_FALSE(RuleMatches(rule, name)) << regex;
    // PatternFor also extracts the first capture group.
    Result<ParamPattern> p = PatternFor(Preset::kAuto, name, {4}, info, {rule});
    ASSERT_FALSE(p.ok()) << regex;
    EXPECT_EQ(p.status().code(), StatusCode::kNotFound) << regex;
    EXPECT_LT(MillisSince(start), 5000) << regex;
  }
  // A pathological pattern that does match: the capture group (not a number) gives no layer.
  const Rule rule = Make("(a*)*b");
  const std::string matching = name + "b";
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(RuleMatches(rule, matching));
  ParamPattern p = PatternFor(Preset::kAuto, matching, {4}, info, {rule}).value();
  EXPECT_EQ(p.tp, TpKind::kColumn);
  EXPECT_EQ(p.layer, -1);
  EXPECT_EQ(p.pp, PpPlacement::kAll);
  EXPECT_LT(MillisSince(start), 5000);
}

TEST(RuleRegex, MegabyteNameNeedsNoStack) {
  const std::string middle(size_t{1} << 20, 'x');
  const std::string name = "layers.7." + middle + ".w.weight";
  ModelInfo info;
  for (const char* regex : {R"(^layers\.(\d+)\..*\.weight$)",
                            R"(^layers\.(\d+)\.(?:x|y)+\.w\.weight$)", R"((\d+)\.(x*)*\.w)"}) {
    const Rule rule = Make(regex);
    EXPECT_TRUE(RuleMatches(rule, name)) << regex;
    ParamPattern p = PatternFor(Preset::kAuto, name, {8, 8}, info, {rule}).value();
    EXPECT_EQ(p.layer, 7) << regex;
    EXPECT_EQ(p.pp, PpPlacement::kLayer) << regex;
  }
  EXPECT_FALSE(RuleMatches(Make(R"(^layers\.\d+\.x+y)"), name));
  // The built-in presets run on RE2 too: a megabyte name under a Megatron layer.
  const std::string megatron = "decoder.layers.3." + middle + ".self_attention.linear_proj.weight";
  ParamPattern m = PatternFor(Preset::kMegatron, megatron, {8, 8}, info).value();
  EXPECT_EQ(m.tp, TpKind::kRow);
  EXPECT_EQ(m.layer, 3);
}

TEST(RuleRegex, InvalidPatternsAreRefusedNamingThem) {
  struct Case {
    std::string regex;
    const char* message_part;  // from RE2's error text, or the length check
  };
  const Case cases[] = {
      {"(", "missing )"},
      {"a)(", "unexpected )"},
      {R"((a)\1)", "invalid escape"},               // backreference: RE2 has none
      {"(?P<a>x)(?P=a)", "invalid perl operator"},  // Python's named backreference
      {"a(?=b)", "invalid perl operator"},          // lookahead
      {"(?<!a)b", "invalid perl operator"},         // lookbehind
      {"a{1001}", "invalid repetition size"},       // over RE2's repeat limit
      {std::string(kMaxRulePatternBytes + 1, 'a'), "4097 bytes"},
  };
  for (const Case& c : cases) {
    Rule r;
    r.regex = c.regex;
    Result<Rule> made = MakeRule(std::move(r));
    ASSERT_FALSE(made.ok()) << c.regex;
    EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument) << c.regex;
    EXPECT_NE(made.status().message().find(c.message_part), std::string::npos)
        << c.regex << " -> " << made.status().message();
    EXPECT_NE(made.status().message().find("rule pattern '" + c.regex.substr(0, 64)),
              std::string::npos)
        << made.status().message();
  }
  // A program too large for the memory bound is refused, not truncated.
  Rule huge;
  // 2100 bytes, ~1.3 million instructions: over the 8 MiB bound.
  for (int i = 0; i < 100; ++i) huge.regex += "[acegikmoqsuwy]{1000}";
  ASSERT_LE(huge.regex.size(), kMaxRulePatternBytes);
  Result<Rule> too_large = MakeRule(std::move(huge));
  ASSERT_FALSE(too_large.ok());
  EXPECT_NE(too_large.status().message().find("too large"), std::string::npos)
      << too_large.status().message();
  // Exactly at the length limit is accepted; a Rule never made matches nothing.
  EXPECT_TRUE(RuleMatches(Make(std::string(kMaxRulePatternBytes, 'a')),
                          std::string(kMaxRulePatternBytes, 'a')));
  Rule unmade;
  unmade.regex = "x";
  EXPECT_FALSE(RuleMatches(unmade, "x"));
}

TEST(RuleRegex, PythonNamedGroupsAndBytes) {
  // DeepSpeed's universal_checkpoint_info patterns are Python `re` syntax.
  const Rule named = Make(R"(^layers\.(?P<layer>\d+)\.attention\.wq\.weight$)", TpKind::kRow);
  ModelInfo info;
  ParamPattern p =
      PatternFor(Preset::kAuto, "layers.12.attention.wq.weight", {8, 8}, info, {named}).value();
  EXPECT_EQ(p.tp, TpKind::kRow);
  EXPECT_EQ(p.layer, 12);
  EXPECT_EQ(p.pp, PpPlacement::kLayer);
  // A capture group that matched nothing (alternation) falls back to `layers.<N>.`.
  const Rule optional = Make(R"((?:block\.(\d+)|mlp)\.w$)");
  EXPECT_EQ(PatternFor(Preset::kAuto, "layers.4.mlp.w", {8}, info, {optional})->layer, 4);
  EXPECT_EQ(PatternFor(Preset::kAuto, "x.block.9.w", {8}, info, {optional})->layer, 9);
  // Names are bytes (Latin-1): `.` is one byte, NUL and 0xff included; not valid UTF-8 is fine.
  const std::string bytes("w.\xff\x00z", 5);
  EXPECT_TRUE(RuleMatches(Make(R"(^w\.\xff.z$)"), bytes));
  EXPECT_TRUE(RuleMatches(Make(R"(^w\...z$)"), bytes));
  EXPECT_TRUE(RuleMatches(Make("z$"), bytes));
  // Copies share the compiled program.
  const Rule copy = named;
  EXPECT_EQ(copy.compiled, named.compiled);
  EXPECT_TRUE(RuleMatches(copy, "layers.1.attention.wq.weight"));
}

// ---------------------------------------------------------------- geometry

TEST(Geometry, SourceWinsConflictIsAnError) {
  ModelInfo info;
  ParamPattern wo =
      PatternFor(Preset::kTorchtitan, "layers.0.attention.wo.weight", {64, 64}, info).value();
  EXPECT_TRUE(CheckGeometry(wo, "layers.0.attention.wo.weight", std::nullopt).ok());
  EXPECT_TRUE(CheckGeometry(wo, "layers.0.attention.wo.weight", 1).ok());
  Status conflict = CheckGeometry(wo, "layers.0.attention.wo.weight", 0);
  ASSERT_FALSE(conflict.ok());
  EXPECT_NE(conflict.message().find("layers.0.attention.wo.weight"), std::string::npos);
  EXPECT_NE(conflict.message().find("splits it along dim 0"), std::string::npos);
  ParamPattern norm = PatternFor(Preset::kTorchtitan, "norm.weight", {64}, info).value();
  EXPECT_FALSE(CheckGeometry(norm, "norm.weight", 0).ok());
  ParamPattern experts =
      PatternFor(Preset::kTorchtitan, "layers.0.moe.experts.w1", {8, 32, 16}, info).value();
  EXPECT_TRUE(CheckGeometry(experts, "e", 0).ok());  // EP split of the source
  EXPECT_TRUE(CheckGeometry(experts, "e", 1).ok());
  EXPECT_FALSE(CheckGeometry(experts, "e", 2).ok());
  ParamPattern g = PatternFromGeometry({8, 4}, 1);
  EXPECT_EQ(g.tp, TpKind::kRow);
  EXPECT_EQ(g.tp_dim, 1);
  EXPECT_EQ(PatternFromGeometry({8, 4}, std::nullopt).tp, TpKind::kReplicate);
}

// ---------------------------------------------------------------- target slices

slice::Box B(Shape offsets, Shape sizes) { return slice::Box{std::move(offsets), std::move(sizes)}; }

LocalView Slice(Preset preset, const std::string& name, const Shape& shape, const ModelInfo& info,
                const char* layout_name, int rank, std::optional<std::vector<int>> split = {}) {
  Layout l = ParseLayout(layout_name).value();
  ParamPattern p = PatternFor(preset, name, shape, info).value();
  std::vector<int> bounds = PipelineSplit(info.n_layers, l.pp, split).value();
  Result<LocalView> v = TargetSlice(preset, name, p, shape, l, bounds, CoordsOf(l, rank));
  EXPECT_TRUE(v.ok()) << name << ": " << v.status().ToString();
  return v.ok() ? v.value() : LocalView{};
}

TEST(TargetSlice, HfFusedQkvGqaIsShardNC) {
  ModelInfo info;
  info.n_layers = 2;
  // [Q 64; K 16; V 16] x 32 at tp2 → rank 1 holds [Q 32..64; K 8..16; V 8..16].
  LocalView v = Slice(Preset::kHuggingFace, "model.layers.1.self_attn.qkv_proj.weight", {96, 64},
                      info, "tp2_pp1_dp1", 1);
  ASSERT_TRUE(v.held);
  EXPECT_EQ(v.local_shape, (Shape{48, 64}));
  EXPECT_EQ(v.cat_dim, 0);
  EXPECT_EQ(v.pieces, (std::vector<slice::Box>{B({32, 0}, {32, 64}), B({72, 0}, {8, 64}),
                                               B({88, 0}, {8, 64})}));
  EXPECT_EQ(v.local_name, "model.layers.1.self_attn.qkv_proj.weight");
}

TEST(TargetSlice, MegatronSwigluAndLocalNames) {
  ModelInfo info;
  info.n_layers = 4;
  info.n_experts = 8;
  info.gated_linear_unit = true;
  // tp2_pp2_dp2_ep2: rank 7 = tp1, dp1, pp1 → ep1; layers 2,3 on stage 1.
  LocalView fc1 = Slice(Preset::kMegatron, "decoder.layers.3.mlp.linear_fc1.weight", {512, 64},
                        info, "tp2_pp2_dp2_ep2", 7);
  ASSERT_TRUE(fc1.held);
  EXPECT_EQ(fc1.local_name, "decoder.layers.1.mlp.linear_fc1.weight");
  EXPECT_EQ(fc1.pieces,
            (std::vector<slice::Box>{B({128, 0}, {128, 64}), B({384, 0}, {128, 64})}));
  EXPECT_EQ(fc1.local_shape, (Shape{256, 64}));
  EXPECT_FALSE(Slice(Preset::kMegatron, "decoder.layers.1.mlp.linear_fc1.weight", {512, 64}, info,
                     "tp2_pp2_dp2_ep2", 7)
                   .held);
  // Expert 5 lives on ep rank 1 (experts 4..7) as local expert 1.
  LocalView e5 = Slice(Preset::kMegatron,
                       "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight",
                       {64, 256}, info, "tp2_pp2_dp2_ep2", 7);
  ASSERT_TRUE(e5.held);
  EXPECT_EQ(e5.local_name, "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight");
  EXPECT_EQ(e5.pieces, (std::vector<slice::Box>{B({0, 128}, {64, 128})}));
  EXPECT_EQ(e5.cat_dim, 1);
  EXPECT_FALSE(Slice(Preset::kMegatron,
                     "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight", {64, 256},
                     info, "tp2_pp2_dp2_ep2", 7)
                   .held);
  // Vocabulary: 1000 rows, tp2 → padded to 1024 (multiple of 256): rank 1 has rows 512..999
  // then 24 zero rows.
  LocalView emb = Slice(Preset::kMegatron, "embedding.word_embeddings.weight", {1000, 64}, info,
                        "tp2_pp2_dp2_ep2", 1);
  ASSERT_TRUE(emb.held);
  EXPECT_EQ(emb.local_shape, (Shape{512, 64}));
  EXPECT_EQ(emb.pieces, (std::vector<slice::Box>{B({512, 0}, {488, 64})}));
  EXPECT_FALSE(Slice(Preset::kMegatron, "embedding.word_embeddings.weight", {1000, 64}, info,
                     "tp2_pp2_dp2_ep2", 7)
                   .held);  // untied: first stage only
  EXPECT_TRUE(Slice(Preset::kMegatron, "output_layer.weight", {1000, 64}, info,
                    "tp2_pp2_dp2_ep2", 7)
                  .held);
  info.tied_embeddings = true;
  // Tied: the last stage holds the word embeddings as its output layer (GPTModel's name there);
  // the first stage, and a single stage, keep the embedding's name.
  LocalView tied_last = Slice(Preset::kMegatron, "embedding.word_embeddings.weight", {1000, 64}, info,
                              "tp2_pp2_dp2_ep2", 7);
  EXPECT_TRUE(tied_last.held);
  EXPECT_EQ(tied_last.local_name, "output_layer.weight");
  EXPECT_EQ(Slice(Preset::kMegatron, "embedding.word_embeddings.weight", {1000, 64}, info, "tp2_pp2_dp2_ep2", 1)
                .local_name,
            "embedding.word_embeddings.weight");
  EXPECT_EQ(Slice(Preset::kMegatron, "embedding.word_embeddings.weight", {1000, 64}, info, "tp2_pp1_dp1", 1)
                .local_name,
            "embedding.word_embeddings.weight");
  // Vocab padding applies at tp1 too (multiple of 128), and the stored rows past the real
  // vocabulary are served as stored (NullTokenizer's EOD row lies there).
  info.vocab_size = 1000;
  LocalView tp1 = Slice(Preset::kMegatron, "output_layer.weight", {1024, 64}, info,
                        "tp1_pp1_dp1", 0);
  EXPECT_EQ(tp1.local_shape, (Shape{1024, 64}));
  EXPECT_EQ(tp1.pieces, (std::vector<slice::Box>{B({0, 0}, {1024, 64})}));
  // A source stored with fewer rows than the target's padded size: the rest are zeros.
  LocalView fewer = Slice(Preset::kMegatron, "output_layer.weight", {1001, 64}, info, "tp2_pp1_dp1", 1);
  EXPECT_EQ(fewer.local_shape, (Shape{512, 64}));
  EXPECT_EQ(fewer.pieces, (std::vector<slice::Box>{B({512, 0}, {489, 64})}));
  // The checkpoint's make_vocab_size_divisible_by (Megatron's args) replaces the default 128:
  // 37 real rows of a tp2 source padded to 256 give 40 rows at tp1 with a multiple of 8; the
  // stored rows 37..39 are served, those past 40 do not fit.
  info.vocab_size = 37;
  ModelInfo facts;
  facts.vocab_pad_multiple = 8;
  ApplyModelFacts(facts, &info);
  LocalView small = Slice(Preset::kMegatron, "output_layer.weight", {256, 16}, info, "tp1_pp1_dp1", 0);
  EXPECT_EQ(small.local_shape, (Shape{40, 16}));
  EXPECT_EQ(small.pieces, (std::vector<slice::Box>{B({0, 0}, {40, 16})}));
}

TEST(TargetSlice, OddVocabularyIsPaddedTheMegatronWay) {
  // 97 rows at tp2 (a weights-only model; GPT-2's 50257 alike): padded to a multiple of
  // 128 * 2 = 256, 128 rows per rank, the stored rows first, zeros after; at tp1 unpadded.
  ModelInfo info;
  LocalView r0 = Slice(Preset::kHuggingFace, "model.embed_tokens.weight", {97, 8}, info, "tp2_pp1_dp1", 0);
  EXPECT_EQ(r0.local_shape, (Shape{128, 8}));
  EXPECT_EQ(r0.pieces, (std::vector<slice::Box>{B({0, 0}, {97, 8})}));
  LocalView r1 = Slice(Preset::kHuggingFace, "lm_head.weight", {97, 8}, info, "tp2_pp1_dp1", 1);
  EXPECT_EQ(r1.local_shape, (Shape{128, 8}));
  EXPECT_TRUE(r1.pieces.empty());
  LocalView tp1 = Slice(Preset::kHuggingFace, "lm_head.weight", {97, 8}, info, "tp1_pp1_dp1", 0);
  EXPECT_EQ(tp1.local_shape, (Shape{97, 8}));
  EXPECT_EQ(tp1.pieces, (std::vector<slice::Box>{B({0, 0}, {97, 8})}));
  // An even count splits as it is.
  LocalView even = Slice(Preset::kHuggingFace, "lm_head.weight", {96, 8}, info, "tp2_pp1_dp1", 1);
  EXPECT_EQ(even.local_shape, (Shape{48, 8}));
  EXPECT_EQ(even.pieces, (std::vector<slice::Box>{B({48, 0}, {48, 8})}));
}

TEST(TargetSlice, MakeVocabSizeDivisibleByPadsEveryVocabulary) {
  // --make-vocab-size-divisible-by 8 (ModelInfo::vocab_pad_multiple): 97 rows at tp2 pad to a
  // multiple of 16 (112: 56 per rank), under the Hugging Face preset and a vocab rule without a
  // multiple of its own; a rule's own multiple wins; 96 rows at tp1 stay 96 (a multiple of 8).
  ModelInfo info;
  info.vocab_pad_multiple = 8;
  LocalView r1 = Slice(Preset::kHuggingFace, "lm_head.weight", {97, 8}, info, "tp2_pp1_dp1", 1);
  EXPECT_EQ(r1.local_shape, (Shape{56, 8}));
  EXPECT_EQ(r1.pieces, (std::vector<slice::Box>{B({56, 0}, {41, 8})}));
  LocalView tp1 = Slice(Preset::kHuggingFace, "lm_head.weight", {96, 8}, info, "tp1_pp1_dp1", 0);
  EXPECT_EQ(tp1.local_shape, (Shape{96, 8}));
  const std::vector<Rule> own = ParseRules(R"({"patterns": [{"pattern": "^embed$", "tp": "vocab"}]})", "r").value();
  EXPECT_EQ(PatternFor(Preset::kAuto, "embed", {97, 8}, info, own).value().vocab_pad_multiple, 8);
  const std::vector<Rule> rule64 =
      ParseRules(R"({"patterns": [{"pattern": "^embed$", "tp": "vocab", "vocab_pad_multiple": 64}]})", "r").value();
  EXPECT_EQ(PatternFor(Preset::kAuto, "embed", {97, 8}, info, rule64).value().vocab_pad_multiple, 64);
  // Over the Megatron preset's (and a checkpoint's make_vocab_size_divisible_by, ApplyModelFacts).
  EXPECT_EQ(PatternFor(Preset::kMegatron, "embedding.word_embeddings.weight", {97, 8}, info).value().vocab_pad_multiple,
            8);
}

TEST(TargetSlice, PaddedVocabularyRowsRepeatTheLastRow) {
  // ModelInfo::vocab_pad_repeat_last (--preset megatron-core): Megatron-LM's converters pad with
  // the last row. 97 rows at tp2 pad to 256: rank 0 holds rows 0..96 then 31 copies of row 96,
  // rank 1 only copies of it; a vocabulary that needs no padding gets none.
  ModelInfo info;
  info.vocab_pad_repeat_last = true;
  info.vocab_size = 97;
  const slice::Box last = B({96, 0}, {1, 8});
  LocalView r0 = Slice(Preset::kMegatron, "embedding.word_embeddings.weight", {97, 8}, info, "tp2_pp1_dp1", 0);
  EXPECT_EQ(r0.local_shape, (Shape{128, 8}));
  std::vector<slice::Box> want = {B({0, 0}, {97, 8})};
  want.insert(want.end(), 31, last);
  EXPECT_EQ(r0.pieces, want);
  LocalView r1 = Slice(Preset::kMegatron, "output_layer.weight", {97, 8}, info, "tp2_pp1_dp1", 1);
  EXPECT_EQ(r1.pieces, std::vector<slice::Box>(128, last));
  info.vocab_size = 256;
  LocalView full = Slice(Preset::kMegatron, "output_layer.weight", {256, 8}, info, "tp2_pp1_dp1", 1);
  EXPECT_EQ(full.pieces, (std::vector<slice::Box>{B({128, 0}, {128, 8})}));
  EXPECT_EQ(ParsePreset("megatron-core").value(), Preset::kMegatronCore);
  EXPECT_STREQ(PresetName(Preset::kMegatronCore), "megatron-core");
  EXPECT_EQ(PresetPatterns(Preset::kMegatronCore), PresetPatterns(Preset::kMegatron));
}

TEST(ApplyModelFacts, RecordedValuesOverrideDetectedOnes) {
  ModelInfo info;
  info.num_attention_heads = 2;
  ModelInfo facts;
  facts.num_attention_heads = 4;
  facts.num_query_groups = 2;
  facts.head_dim = 4;
  ApplyModelFacts(facts, &info);
  EXPECT_EQ(info.num_attention_heads, 4);
  EXPECT_EQ(info.num_query_groups, 2);
  EXPECT_EQ(info.head_dim, 4);
  EXPECT_EQ(info.vocab_pad_multiple, 0);  // not recorded: the preset's default stays
  // With the query groups known, a GQA linear_qkv [q q k v per group] splits by group.
  ParamPattern qkv =
      PatternFor(Preset::kMegatron, "decoder.layers.0.self_attention.linear_qkv.weight", {32, 16}, info).value();
  EXPECT_EQ(qkv.qkv_groups, 2);
}

TEST(TargetSlice, TorchtitanUnevenAndExperts) {
  ModelInfo info;
  info.n_layers = 2;
  // 10 rows at tp4: DTensor chunks of 3 → 3, 3, 3, 1.
  std::vector<int64_t> rows;
  for (int r = 0; r < 4; ++r) {
    LocalView v = Slice(Preset::kTorchtitan, "layers.0.attention.wq.weight", {10, 8}, info,
                        "tp4_pp1_dp1", r);
    rows.push_back(v.local_shape[0]);
  }
  EXPECT_EQ(rows, (std::vector<int64_t>{3, 3, 3, 1}));
  // 2 rows at tp4: 1, 1, 0, 0 (empty ranks hold an empty tensor, no piece).
  LocalView empty = Slice(Preset::kTorchtitan, "layers.0.attention.wk.weight", {2, 8}, info,
                          "tp4_pp1_dp1", 3);
  EXPECT_TRUE(empty.held);
  EXPECT_EQ(empty.local_shape, (Shape{0, 8}));
  EXPECT_TRUE(empty.pieces.empty());
  // Global layer names kept on every stage.
  LocalView l1 = Slice(Preset::kTorchtitan, "layers.1.feed_forward.w2.weight", {8, 12}, info,
                       "tp1_pp2_dp1", 1);
  EXPECT_TRUE(l1.held);
  EXPECT_EQ(l1.local_name, "layers.1.feed_forward.w2.weight");
  // Stacked experts [8, 32, 16] at tp2_pp1_dp4_ep2, rank 3 = tp1, dp1 → ep1: experts 4..7,
  // hidden rows 16..31.
  LocalView e = Slice(Preset::kTorchtitan, "layers.1.moe.experts.w1", {8, 32, 16}, info,
                      "tp2_pp1_dp4_ep2", 3);
  EXPECT_EQ(e.local_shape, (Shape{4, 16, 16}));
  EXPECT_EQ(e.cat_dim, 1);
  EXPECT_EQ(e.pieces, (std::vector<slice::Box>{B({4, 16, 0}, {4, 16, 16})}));
}

TEST(TargetSlice, ErrorsNameTheParameter) {
  ModelInfo info;
  info.n_layers = 2;
  info.gated_linear_unit = false;
  Layout l = ParseLayout("tp3_pp1_dp1").value();
  std::vector<int> bounds = PipelineSplit(2, 1, std::nullopt).value();
  const std::string name = "decoder.layers.0.mlp.linear_fc1.weight";
  ParamPattern p = PatternFor(Preset::kMegatron, name, {256, 64}, info).value();
  Result<LocalView> v = TargetSlice(Preset::kMegatron, name, p, {256, 64}, l, bounds, CoordsOf(l, 0));
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find(name), std::string::npos);
  EXPECT_NE(v.status().message().find("256 not divisible by tp 3"), std::string::npos)
      << v.status().message();
  // Megatron QKV without known groups at tp > 1; groups not divisible.
  const std::string qkv = "decoder.layers.0.self_attention.linear_qkv.weight";
  ParamPattern q = PatternFor(Preset::kMegatron, qkv, {96, 64}, info).value();
  Layout t2 = ParseLayout("tp2_pp1_dp1").value();
  Result<LocalView> unknown = TargetSlice(Preset::kMegatron, qkv, q, {96, 64}, t2, bounds,
                                          CoordsOf(t2, 0));
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("num_query_groups"), std::string::npos);
  q.qkv_groups = 3;
  Layout t3 = ParseLayout("tp2_pp1_dp1").value();
  Result<LocalView> odd = TargetSlice(Preset::kMegatron, qkv, q, {96, 64}, t3, bounds, CoordsOf(t3, 1));
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("query groups 3 not divisible by tp 2"), std::string::npos);
  q.qkv_groups = 2;
  EXPECT_TRUE(TargetSlice(Preset::kMegatron, qkv, q, {96, 64}, t3, bounds, CoordsOf(t3, 1)).ok());
  // A layer outside the split.
  ParamPattern far = PatternFor(Preset::kMegatron, "decoder.layers.9.input_layernorm.weight", {64}, info).value();
  EXPECT_FALSE(TargetSlice(Preset::kMegatron, "decoder.layers.9.input_layernorm.weight", far, {64}, l, bounds, CoordsOf(l, 0)).ok());
}

TEST(CheckLayoutForModel, RefusesWithAReason) {
  ModelInfo info;
  info.n_layers = 4;
  info.n_experts = 8;
  info.num_attention_heads = 12;
  info.num_query_groups = 4;
  EXPECT_TRUE(CheckLayoutForModel(ParseLayout("tp4_pp4_dp4_ep4").value(), info, std::nullopt).ok());
  Status pp = CheckLayoutForModel(ParseLayout("tp1_pp8_dp1").value(), info, std::nullopt);
  ASSERT_FALSE(pp.ok());
  EXPECT_NE(pp.message().find("layout tp1_pp8_dp1: pipeline split: pp8 exceeds the 4 layers"),
            std::string::npos) << pp.message();
  EXPECT_TRUE(CheckLayoutForModel(ParseLayout("tp1_pp8_dp1").value(), info,
                                  std::vector<int>{1, 1, 1, 1, 0, 0, 0, 0}).ok());
  Status ep = CheckLayoutForModel(ParseLayout("tp1_pp1_dp3_ep3").value(), info, std::nullopt);
  ASSERT_FALSE(ep.ok());
  EXPECT_NE(ep.message().find("8 experts not divisible by ep3"), std::string::npos);
  Status heads = CheckLayoutForModel(ParseLayout("tp8_pp1_dp1").value(), info, std::nullopt);
  ASSERT_FALSE(heads.ok());
  EXPECT_NE(heads.message().find("12 attention heads not divisible by tp8"), std::string::npos);
  Status groups = CheckLayoutForModel(ParseLayout("tp3_pp1_dp1").value(), info, std::nullopt);
  ASSERT_FALSE(groups.ok());
  EXPECT_NE(groups.message().find("4 query groups not divisible by tp3"), std::string::npos);
}

TEST(TargetSlice, RefusesHugeOrNegativeShapes) {
  ModelInfo info;
  info.n_layers = 1;
  Layout l = ParseLayout("tp2_pp1_dp1").value();
  ParamPattern p = PatternFor(Preset::kTorchtitan, "layers.0.attention.wq.weight", {4, 4}, info).value();
  for (const Shape& bad : {Shape{-1, 4}, Shape{int64_t{1} << 62, 4}}) {
    Result<LocalView> v = TargetSlice(Preset::kTorchtitan, "layers.0.attention.wq.weight", p, bad,
                                      l, {0, 1}, CoordsOf(l, 0));
    EXPECT_FALSE(v.ok());
  }
}

// ---------------------------------------------------------------- property test

// A dense N-d array of global element indices (-1 = zero padding), row-major.
struct Arr {
  Shape shape;
  std::vector<int64_t> data;
};

int64_t Volume(const Shape& s) {
  int64_t v = 1;
  for (int64_t x : s) v *= x;
  return v;
}

// Row-major index of `idx` in `shape`.
int64_t Flat(const Shape& shape, const Shape& idx) {
  int64_t f = 0;
  for (size_t i = 0; i < shape.size(); ++i) f = f * shape[i] + idx[i];
  return f;
}

// Calls fn(idx) for every index of `shape`.
template <typename Fn>
void ForEach(const Shape& shape, Fn fn) {
  if (Volume(shape) == 0) return;
  Shape idx(shape.size(), 0);
  while (true) {
    fn(idx);
    int d = static_cast<int>(shape.size()) - 1;
    while (d >= 0 && ++idx[static_cast<size_t>(d)] == shape[static_cast<size_t>(d)]) {
      idx[static_cast<size_t>(d)] = 0;
      --d;
    }
    if (d < 0) return;
  }
}

// Slab [lo, hi) of `a` along dim d.
Arr SlabOf(const Arr& a, size_t d, int64_t lo, int64_t hi) {
  Arr out;
  out.shape = a.shape;
  out.shape[d] = hi - lo;
  out.data.resize(static_cast<size_t>(Volume(out.shape)));
  ForEach(out.shape, [&](const Shape& idx) {
    Shape src = idx;
    src[d] += lo;
    out.data[static_cast<size_t>(Flat(out.shape, idx))] = a.data[static_cast<size_t>(Flat(a.shape, src))];
  });
  return out;
}

Arr Concat(const std::vector<Arr>& parts, size_t d, Shape like) {
  Arr out;
  out.shape = std::move(like);
  out.shape[d] = 0;
  for (const Arr& p : parts) out.shape[d] += p.shape[d];
  out.data.resize(static_cast<size_t>(Volume(out.shape)));
  int64_t at = 0;
  for (const Arr& p : parts) {
    ForEach(p.shape, [&](const Shape& idx) {
      Shape dst = idx;
      dst[d] += at;
      out.data[static_cast<size_t>(Flat(out.shape, dst))] = p.data[static_cast<size_t>(Flat(p.shape, idx))];
    });
    at += p.shape[d];
  }
  return out;
}

// The local tensor of a view, built from its pieces (the oracle for what a reader would copy).
Arr Materialize(const LocalView& v, const Shape& global_shape) {
  Arr out;
  out.shape = v.local_shape;
  out.data.assign(static_cast<size_t>(Volume(v.local_shape)), -1);
  const size_t d = static_cast<size_t>(v.cat_dim);
  int64_t at = 0;
  for (const slice::Box& b : v.pieces) {
    EXPECT_EQ(b.offsets.size(), global_shape.size());
    for (size_t i = 0; i < global_shape.size(); ++i) {
      EXPECT_GE(b.offsets[i], 0);
      EXPECT_LE(b.offsets[i] + b.sizes[i], global_shape[i]);
      if (i != d) {
        EXPECT_EQ(b.sizes[i], v.local_shape[i]);
      }
    }
    ForEach(b.sizes, [&](const Shape& idx) {
      Shape g = idx;
      Shape l = idx;
      for (size_t i = 0; i < g.size(); ++i) g[i] += b.offsets[i];
      l[d] += at;
      out.data[static_cast<size_t>(Flat(out.shape, l))] = Flat(global_shape, g);
    });
    at += b.sizes[d];
  }
  EXPECT_LE(at, v.local_shape.empty() ? 1 : v.local_shape[d]);
  return out;
}

TEST(TargetSliceProperty, CoverExactlyOnceAndRebuild) {
  std::mt19937_64 rng(TestSeed());
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 400; ++iter) {
    const int t = static_cast<int>(uni(1, 6));
    const int kind = static_cast<int>(uni(0, 5));  // column, row, vocab, shard-nc, replicate, partial
    const bool chunk = uni(0, 1) == 1;
    const size_t rank = static_cast<size_t>(uni(1, 3));
    Shape shape(rank);
    for (auto& s : shape) s = uni(1, 7);
    ParamPattern p;
    p.rule = "property";
    p.uneven = chunk ? UnevenSplit::kChunk : UnevenSplit::kRequireDivisible;
    size_t d = 0;
    switch (kind) {
      case 0: p.tp = TpKind::kColumn; d = 0; break;
      case 1: p.tp = TpKind::kRow; d = rank - 1; break;
      case 2:
        p.tp = TpKind::kVocab;
        d = 0;
        p.vocab_pad_multiple = uni(0, 4);
        shape[0] = uni(1, 40);
        if (uni(0, 1) == 1) p.vocab_size = uni(1, shape[0]);
        break;
      case 3: {
        p.tp = TpKind::kColumn;
        d = static_cast<size_t>(uni(0, static_cast<int64_t>(rank) - 1));
        const int64_t n_subs = uni(1, 3);
        shape[d] = 0;
        for (int64_t i = 0; i < n_subs; ++i) {
          int64_t s = chunk ? uni(1, 13) : t * uni(1, 3);
          p.sub_sizes.push_back(s);
          shape[d] += s;
        }
        break;
      }
      case 4: p.tp = TpKind::kReplicate; break;
      default: p.tp = TpKind::kPartial; break;
    }
    if (kind <= 2 && !chunk && p.vocab_pad_multiple == 0) {
      shape[d] = t * uni(1, 4);  // divisible, so the even split applies
      if (p.vocab_size > 0) p.vocab_size = t * uni(1, shape[d] / t);
    }
    p.tp_dim = (kind == 4 || kind == 5) ? -1 : static_cast<int>(d);
    SCOPED_TRACE("iter " + std::to_string(iter) + " kind " + std::to_string(kind) + " t " +
                 std::to_string(t) + " chunk " + std::to_string(chunk));
    Layout layout = ParseLayout("tp" + std::to_string(t) + "_pp1_dp1").value();
    std::vector<Arr> locals;
    std::vector<LocalView> views;
    std::vector<int> coverage(static_cast<size_t>(Volume(shape)), 0);
    for (int r = 0; r < t; ++r) {
      Result<LocalView> v = TargetSlice(Preset::kTorchtitan, "p", p, shape, layout, {0, 1},
                                        CoordsOf(layout, r));
      ASSERT_TRUE(v.ok()) << v.status().ToString();
      ASSERT_TRUE(v->held);
      locals.push_back(Materialize(*v, shape));
      for (int64_t e : locals.back().data) {
        if (e >= 0) ++coverage[static_cast<size_t>(e)];
      }
      views.push_back(std::move(v).value());
    }
    Arr global;
    global.shape = shape;
    for (int64_t i = 0; i < Volume(shape); ++i) global.data.push_back(i);
    if (kind == 4 || kind == 5) {
      for (const Arr& l : locals) EXPECT_EQ(l.data, global.data);
      continue;
    }
    // Rows served: every stored row up to the padded size (a pad multiple), else all of them.
    int64_t real = shape[d];
    if (kind == 2 && p.vocab_pad_multiple > 0) {
      const int64_t vocab = p.vocab_size > 0 ? p.vocab_size : shape[d];
      const int64_t multiple = p.vocab_pad_multiple * t;
      real = std::min(shape[d], (vocab + multiple - 1) / multiple * multiple);
    }
    for (size_t e = 0; e < coverage.size(); ++e) {
      Shape idx(rank);
      int64_t rest = static_cast<int64_t>(e);
      for (size_t i = rank; i-- > 0;) {
        idx[i] = rest % shape[i];
        rest /= shape[i];
      }
      EXPECT_EQ(coverage[e], idx[d] < real ? 1 : 0) << "element " << e;
    }
    if (kind == 2) {
      // Equal padded local sizes; padding rows only at the end; concat of the real rows = the
      // real part of the global tensor.
      std::vector<Arr> reals;
      for (const Arr& l : locals) {
        if (p.vocab_pad_multiple > 0 || !chunk) {
          EXPECT_EQ(l.shape, locals[0].shape);
        }
        int64_t rows = 0;
        for (const slice::Box& b : views[reals.size()].pieces) rows += b.sizes[d];
        reals.push_back(SlabOf(l, d, 0, rows));
        for (int64_t e : SlabOf(l, d, rows, l.shape[d]).data) EXPECT_EQ(e, -1);
      }
      if (p.vocab_pad_multiple > 0) {
        EXPECT_EQ(locals[0].shape[d] * t % (p.vocab_pad_multiple * t), 0);
      }
      EXPECT_EQ(Concat(reals, d, shape).data, SlabOf(global, d, 0, real).data);
      continue;
    }
    std::vector<int64_t> subs = p.sub_sizes.empty() ? std::vector<int64_t>{shape[d]} : p.sub_sizes;
    // Per sub-parameter: the s-th segment of each local, concatenated in rank order, is the
    // s-th sub-parameter of the global tensor.
    std::vector<int64_t> at(static_cast<size_t>(t), 0);
    int64_t sub_start = 0;
    for (int64_t s : subs) {
      std::vector<Arr> parts;
      for (int r = 0; r < t; ++r) {
        int64_t c = chunk ? (s + t - 1) / t : s / t;
        int64_t n = std::max<int64_t>(0, std::min(s, c * (r + 1)) - std::min(s, c * r));
        const Arr& l = locals[static_cast<size_t>(r)];
        parts.push_back(SlabOf(l, d, at[static_cast<size_t>(r)], at[static_cast<size_t>(r)] + n));
        at[static_cast<size_t>(r)] += n;
      }
      EXPECT_EQ(Concat(parts, d, shape).data, SlabOf(global, d, sub_start, sub_start + s).data);
      sub_start += s;
    }
    for (int r = 0; r < t; ++r) {
      EXPECT_EQ(at[static_cast<size_t>(r)], locals[static_cast<size_t>(r)].shape[d]);
    }
  }
}

// Every rank of a layout with PP and EP: within one data-parallel replica (the E dp ranks
// dp in [k*E, (k+1)*E)), every element of every parameter is held by exactly
// (replicated over tp ? T : 1) * (split by experts ? 1 : E) * (tied and P > 1 ? 2 : 1) ranks.
TEST(TargetSliceProperty, AllRanksWithPipelineAndExperts) {
  struct Param {
    Preset preset;
    std::string name;
    Shape shape;
  };
  const std::vector<Param> params = {
      {Preset::kTorchtitan, "tok_embeddings.weight", {10, 4}},
      {Preset::kTorchtitan, "layers.0.attention.wq.weight", {8, 4}},
      {Preset::kTorchtitan, "layers.3.moe.experts.w1", {4, 6, 4}},
      {Preset::kTorchtitan, "layers.2.moe.experts.w2", {4, 4, 6}},
      {Preset::kTorchtitan, "layers.1.ffn_norm.weight", {4}},
      {Preset::kTorchtitan, "output.weight", {10, 4}},
      {Preset::kMegatron, "embedding.word_embeddings.weight", {300, 4}},
      {Preset::kMegatron, "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight",
       {8, 4}},
      {Preset::kMegatron, "decoder.layers.1.mlp.linear_fc2.weight", {4, 4}},
      {Preset::kMegatron, "decoder.final_layernorm.weight", {4}},
  };
  for (const char* layout_name : {"tp1_pp1_dp1", "tp2_pp2_dp4_ep2", "tp2_pp4_dp4_ep4",
                                  "tp1_pp3_dp2_ep2", "tp2_pp1_dp2"}) {
    const Layout l = ParseLayout(layout_name).value();
    for (bool tied : {false, true}) {
      ModelInfo info;
      info.n_layers = 4;
      info.n_experts = 4;
      info.gated_linear_unit = true;
      info.tied_embeddings = tied;
      const std::vector<int> bounds = PipelineSplit(4, l.pp, std::nullopt).value();
      for (const Param& prm : params) {
        SCOPED_TRACE(std::string(layout_name) + " " + prm.name + (tied ? " tied" : ""));
        const ParamPattern p = PatternFor(prm.preset, prm.name, prm.shape, info).value();
        const bool split_by_experts = p.expert >= 0 || p.expert_dim >= 0;
        const bool tp_replicated = p.tp == TpKind::kReplicate || p.tp == TpKind::kPartial;
        const int64_t want = (tp_replicated ? l.tp : 1) * (split_by_experts ? 1 : l.ep) *
                             (p.pp == PpPlacement::kTiedFirstLast && l.pp > 1 ? 2 : 1);
        for (int replica = 0; replica < l.dp / l.ep; ++replica) {
          std::vector<int64_t> count(static_cast<size_t>(Volume(prm.shape)), 0);
          for (int rank = 0; rank < l.World(); ++rank) {
            const RankCoords c = CoordsOf(l, rank);
            if (c.dp / l.ep != replica) continue;
            Result<LocalView> v = TargetSlice(prm.preset, prm.name, p, prm.shape, l, bounds, c);
            ASSERT_TRUE(v.ok()) << v.status().ToString();
            if (!v->held) continue;
            for (int64_t e : Materialize(*v, prm.shape).data) {
              if (e >= 0) ++count[static_cast<size_t>(e)];
            }
          }
          for (size_t e = 0; e < count.size(); ++e) {
            // Megatron vocab padding never covers a real row twice; all real rows are covered.
            ASSERT_EQ(count[e], want) << "element " << e;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace ucpfs::layout
