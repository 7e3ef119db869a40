// Positional optimizer state: the grouping rules (in order, the Trainer's decay split with and
// without LayerNorm pairs), the shape check, disagreeing rules named ambiguous, and the Hugging
// Face Llama-family, torchtune and GPT-2 module orders.
#include "index/positional_optim.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ucpfs::index {
namespace {

std::vector<NamedShape> Llama() {
  return {{"model.embed_tokens.weight", {8, 4}},
          {"model.layers.0.self_attn.q_proj.weight", {4, 4}},
          {"model.layers.0.self_attn.o_proj.weight", {4, 4}},
          {"model.layers.0.input_layernorm.weight", {4}},
          {"model.norm.weight", {4}},
          {"lm_head.weight", {8, 4}}};
}

PositionalOptimizer Optim(std::vector<std::vector<int64_t>> groups, const std::vector<NamedShape>& shapes_in_order) {
  PositionalOptimizer o;
  o.group_positions = std::move(groups);
  int64_t pos = 0;
  for (const auto& g : o.group_positions) {
    for (size_t i = 0; i < g.size(); ++i) o.state_shapes.emplace_back(g[i], shapes_in_order[pos++].shape);
  }
  return o;
}

TEST(PositionalOptim, OneGroupInOrder) {
  const auto params = Llama();
  const auto m = MatchPositions(params, Optim({{0, 1, 2, 3, 4, 5}}, params),
                                {GroupingRule::kInOrder, GroupingRule::kTrainerDecay});
  ASSERT_TRUE(m.rule) << m.why_not;
  EXPECT_EQ(*m.rule, GroupingRule::kInOrder);
  EXPECT_EQ(m.names[5].second, "lm_head.weight");
}

TEST(PositionalOptim, TrainerDecaySplit) {
  const auto params = Llama();
  // decay: embed, q, o, lm_head; no decay: input_layernorm, norm.
  const std::vector<NamedShape> saved = {params[0], params[1], params[2], params[5], params[3], params[4]};
  const auto m = MatchPositions(params, Optim({{0, 1, 2, 3}, {4, 5}}, saved),
                                {GroupingRule::kTrainerDecay, GroupingRule::kTrainerDecayLayerNorm});
  ASSERT_TRUE(m.rule) << m.why_not;
  EXPECT_EQ(m.names[3].second, "lm_head.weight");
  EXPECT_EQ(m.names[4].second, "model.layers.0.input_layernorm.weight");
}

TEST(PositionalOptim, ShapeMismatchIsNotGuessed) {
  const auto params = Llama();
  auto o = Optim({{0, 1, 2, 3, 4, 5}}, params);
  o.state_shapes[1].second = {3, 4};
  const auto m = MatchPositions(params, o, {GroupingRule::kInOrder});
  EXPECT_FALSE(m.rule);
  EXPECT_NE(m.why_not.find("no grouping rule fits"), std::string::npos) << m.why_not;
  EXPECT_NE(m.why_not.find("model.layers.0.self_attn.q_proj.weight"), std::string::npos) << m.why_not;
  EXPECT_TRUE(m.names.empty());
}

TEST(PositionalOptim, DisagreeingRulesAreAmbiguous) {
  // Two groups of 1-D parameters: contiguous in order, or decay / no-decay; both fit the shapes.
  const std::vector<NamedShape> params = {{"a.bias", {4}}, {"b.weight", {4}}};
  const auto m = MatchPositions(params, Optim({{0}, {1}}, params),
                                {GroupingRule::kInOrder, GroupingRule::kTrainerDecay});
  EXPECT_FALSE(m.rule);
  EXPECT_NE(m.why_not.find("ambiguous"), std::string::npos) << m.why_not;
}

TEST(PositionalOptim, LayerNormPairsNeedTheirOwnRule) {
  // GPT-2's ln_1 is an nn.LayerNorm: the Trainer excludes it by type, not by name.
  const std::vector<NamedShape> params = {{"h.0.ln_1.weight", {4}}, {"h.0.ln_1.bias", {4}}, {"h.0.attn.w", {4, 4}}};
  const std::vector<NamedShape> saved = {params[2], params[0], params[1]};
  const auto m = MatchPositions(params, Optim({{0}, {1, 2}}, saved),
                                {GroupingRule::kTrainerDecay, GroupingRule::kTrainerDecayLayerNorm});
  ASSERT_TRUE(m.rule) << m.why_not;
  EXPECT_EQ(*m.rule, GroupingRule::kTrainerDecayLayerNorm);
}

TEST(PositionalOptim, HfLlamaOrder) {
  std::vector<NamedShape> p = {{"lm_head.weight", {}},
                               {"model.layers.10.mlp.down_proj.weight", {}},
                               {"model.layers.2.self_attn.q_proj.bias", {}},
                               {"model.layers.2.self_attn.q_proj.weight", {}},
                               {"model.embed_tokens.weight", {}},
                               {"model.layers.2.post_attention_layernorm.weight", {}},
                               {"model.norm.weight", {}}};
  ASSERT_TRUE(SortModuleOrder(&p, ModuleOrder::kHfLlama));
  std::vector<std::string> names;
  for (const auto& x : p) names.push_back(x.name);
  EXPECT_EQ(names, (std::vector<std::string>{"model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight",
                                             "model.layers.2.self_attn.q_proj.bias",
                                             "model.layers.2.post_attention_layernorm.weight",
                                             "model.layers.10.mlp.down_proj.weight", "model.norm.weight",
                                             "lm_head.weight"}));
  std::vector<NamedShape> unknown = {{"transformer.h.0.attn.c_attn.weight", {}}};
  EXPECT_FALSE(SortModuleOrder(&unknown, ModuleOrder::kHfLlama));
  std::vector<NamedShape> mlp = {{"model.layers.0.mlp.up_proj.weight", {}},
                                 {"model.layers.0.mlp.down_proj.weight", {}},
                                 {"model.layers.0.mlp.gate_proj.weight", {}}};
  ASSERT_TRUE(SortModuleOrder(&mlp, ModuleOrder::kTorchtuneLlama));  // w1, w2, w3
  EXPECT_EQ(mlp[1].name, "model.layers.0.mlp.down_proj.weight");
  std::vector<NamedShape> gpt2 = {{"transformer.h.0.mlp.c_proj.weight", {}}, {"transformer.h.0.ln_1.weight", {}},
                                  {"lm_head.weight", {}},                    {"transformer.h.0.attn.c_proj.weight", {}},
                                  {"transformer.wte.weight", {}},            {"transformer.h.0.mlp.c_fc.weight", {}}};
  ASSERT_TRUE(SortModuleOrder(&gpt2, *HfModuleOrder("gpt2")));
  names.clear();
  for (const auto& x : gpt2) names.push_back(x.name);
  EXPECT_EQ(names, (std::vector<std::string>{"transformer.wte.weight", "transformer.h.0.ln_1.weight",
                                             "transformer.h.0.attn.c_proj.weight", "transformer.h.0.mlp.c_fc.weight",
                                             "transformer.h.0.mlp.c_proj.weight", "lm_head.weight"}));
  EXPECT_TRUE(IsHfLlamaFamily("qwen2"));
  EXPECT_FALSE(IsHfLlamaFamily("gpt2"));
}

}  // namespace
}  // namespace ucpfs::index
