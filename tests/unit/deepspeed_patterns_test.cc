// DeepSpeed universal_checkpoint_info patterns: the merge ds_to_universal applies to each name
// (its precedence and its refusals), and sub-parameter splits (even before 0.4, recorded widths
// at 0.4).
#include "index/deepspeed_patterns.h"

#include <gtest/gtest.h>

namespace ucpfs::index {
namespace {

DeepSpeedPatterns Parse(const nlohmann::json& uc) {
  auto p = ParseDeepSpeedPatterns(uc, "mp_rank_00_model_states.pt");
  EXPECT_TRUE(p.ok()) << p.error().message();
  return p.ok() ? std::move(*p) : DeepSpeedPatterns{};
}

// Megatron-DeepSpeed's lists (docs/formats.md "Megatron-DeepSpeed's pattern lists"), with a
// GQA entry as AutoTP writes it.
nlohmann::json Megatron() {
  return {
      {"universal_checkpoint_version", 0.2},
      {"original_vocab_size", 37},
      {"vocabulary_parameter_patterns", {"tied_modules.embed.word_embeddings.weight"}},
      {"pipeline_replicated_parameter_patterns", {"tied_modules.embed.word_embeddings.weight"}},
      {"tp_replicated_parameter_patterns", {R"(\d+.input_layernorm.weight)", R"(\d+.self_attention.dense.bias)"}},
      {"parameter_with_row_parallelism_patterns", {R"(\d+.self_attention.dense.weight)"}},
      {"parameter_with_2_sub_params_cat_dim_0", {R"(\d+.mlp.dense_h_to_4h.weight)"}},
      {"parameter_with_sub_params",
       {{{"patterns", {R"(\d+.self_attention.query_key_value.weight)"}}, {"shape", {3, 16}}, {"partition_dim", 0}}}},
  };
}

TEST(DeepSpeedPatterns, PrecedenceAsDsToUniversal) {
  const DeepSpeedPatterns p = Parse(Megatron());
  auto merge = [&](const std::string& name) {
    auto r = ClassifyDeepSpeedParam(p, name);
    EXPECT_TRUE(r.ok()) << name;
    return *r;
  };
  EXPECT_EQ(merge("3.input_layernorm.weight").merge, DeepSpeedMerge::kReplicated);
  EXPECT_EQ(merge("3.self_attention.dense.bias").merge, DeepSpeedMerge::kReplicated);
  const DeepSpeedParamRule row = merge("3.self_attention.dense.weight");
  EXPECT_EQ(row.merge, DeepSpeedMerge::kCat);
  EXPECT_EQ(row.cat_dim, 1);
  EXPECT_EQ(merge("4.mlp.dense_h_to_4h.weight").merge, DeepSpeedMerge::kTwoSub);
  const DeepSpeedParamRule qkv = merge("3.self_attention.query_key_value.weight");
  EXPECT_EQ(qkv.merge, DeepSpeedMerge::kSubParams);
  EXPECT_EQ(qkv.sub_pattern, R"(\d+.self_attention.query_key_value.weight)");
  const DeepSpeedParamRule vocab = merge("tied_modules.embed.word_embeddings.weight");
  EXPECT_EQ(vocab.merge, DeepSpeedMerge::kCat);
  EXPECT_EQ(vocab.cat_dim, 0);
  EXPECT_TRUE(vocab.vocab);
  EXPECT_TRUE(IsPipelineReplicated(p, "tied_modules.embed.word_embeddings.weight"));
  EXPECT_FALSE(IsPipelineReplicated(p, "3.input_layernorm.weight"));
  // re.match: anchored at the start only.
  EXPECT_EQ(merge("x3.input_layernorm.weight").merge, DeepSpeedMerge::kCat);
  EXPECT_EQ(merge("3.input_layernorm.weight_extra").merge, DeepSpeedMerge::kReplicated);
  // No universal_checkpoint_info: the converter's default, cat along dim 0.
  const DeepSpeedPatterns none = Parse(nullptr);
  EXPECT_FALSE(none.present);
  EXPECT_EQ(ClassifyDeepSpeedParam(none, "anything")->merge, DeepSpeedMerge::kCat);
}

TEST(DeepSpeedPatterns, Refusals) {
  nlohmann::json uc = Megatron();
  uc["tp_replicated_parameter_patterns"].push_back(R"(\d+.input_layernorm)");
  auto two = ClassifyDeepSpeedParam(Parse(uc), "3.input_layernorm.weight");
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.error().message().find("matches 2 patterns"), std::string::npos) << two.error().message();

  uc = Megatron();
  uc["affine_map"] = {{"params", {{"x", 1}}}};
  EXPECT_FALSE(ClassifyDeepSpeedParam(Parse(uc), "3.input_layernorm.weight").ok());

  // Bounded: every pattern is compiled and tried on every name.
  nlohmann::json many = nlohmann::json::array();
  for (size_t i = 0; i <= kMaxDeepSpeedPatterns; ++i) many.push_back("p" + std::to_string(i));
  auto too_many = ParseDeepSpeedPatterns({{"tp_replicated_parameter_patterns", many}}, "mp_rank_00_model_states.pt");
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.error().message().find("more than 512 patterns"), std::string::npos);

  for (const nlohmann::json& bad : {nlohmann::json{{"tp_replicated_parameter_patterns", "a"}},
                                    nlohmann::json{{"tp_replicated_parameter_patterns", {1}}},
                                    nlohmann::json{{"tp_replicated_parameter_patterns", {"(unclosed"}}},
                                    nlohmann::json{{"parameter_with_sub_params", {{{"patterns", {"q"}}}}}},
                                    nlohmann::json{{"parameter_with_sub_params",
                                                    {{{"patterns", {"q"}}, {"shape", {3}}, {"partition_dim", 1}}}}}}) {
    auto p = ParseDeepSpeedPatterns(bad, "mp_rank_00_model_states.pt");
    ASSERT_FALSE(p.ok()) << bad.dump();
    EXPECT_NE(p.error().message().find("mp_rank_00_model_states.pt"), std::string::npos);
  }
}

TEST(DeepSpeedPatterns, SubParamSplits) {
  // Before 0.4: a count of equal sub-parameters, split evenly.
  DeepSpeedPatterns p = Parse(Megatron());
  const DeepSpeedParamRule qkv = *ClassifyDeepSpeedParam(p, "3.self_attention.query_key_value.weight");
  auto even = DeepSpeedSubParamSplit(p, qkv, "qkv", 2, 48);
  ASSERT_TRUE(even.ok()) << even.error().message();
  EXPECT_EQ(even->sizes, (std::vector<int64_t>{16, 16, 16}));
  EXPECT_EQ(even->widths, (std::vector<std::vector<int64_t>>{{8, 8}, {8, 8}, {8, 8}}));
  EXPECT_FALSE(DeepSpeedSubParamSplit(p, qkv, "qkv", 2, 47).ok());  // 3 does not divide 47
  EXPECT_FALSE(DeepSpeedSubParamSplit(p, qkv, "qkv", 4, 30).ok());  // 10 per sub-parameter: not by tp 4
  // 0.4: GQA sizes with recorded (uneven) widths.
  nlohmann::json uc = Megatron();
  uc["universal_checkpoint_version"] = 0.4;
  uc["parameter_with_sub_params"][0]["shape"] = {{16, 8, 8}, 16};
  uc["sub_param_shard_widths"] = {{R"(\d+.self_attention.query_key_value.weight)", {{8, 8}, {6, 2}, {4, 4}}}};
  p = Parse(uc);
  const DeepSpeedParamRule gqa = *ClassifyDeepSpeedParam(p, "3.self_attention.query_key_value.weight");
  auto uneven = DeepSpeedSubParamSplit(p, gqa, "qkv", 2, -1);
  ASSERT_TRUE(uneven.ok()) << uneven.error().message();
  EXPECT_EQ(uneven->sizes, (std::vector<int64_t>{16, 8, 8}));
  EXPECT_EQ(uneven->widths, (std::vector<std::vector<int64_t>>{{8, 8}, {6, 2}, {4, 4}}));
  EXPECT_FALSE(DeepSpeedSubParamSplit(p, gqa, "qkv", 3, -1).ok());  // no width per rank
  // tp 0 (the universal view, which merges every rank): the sizes alone, whatever the widths.
  auto sizes_only = DeepSpeedSubParamSplit(p, gqa, "qkv", 0, 32);
  ASSERT_TRUE(sizes_only.ok()) << sizes_only.error().message();
  EXPECT_EQ(sizes_only->sizes, (std::vector<int64_t>{16, 8, 8}));
  EXPECT_TRUE(sizes_only->widths.empty());
  EXPECT_FALSE(DeepSpeedSubParamSplit(p, gqa, "qkv", 0, 33).ok());  // the sizes sum to 32
  uc["sub_param_shard_widths"] = {{R"(\d+.self_attention.query_key_value.weight)", {{8, 8}, {6, 3}, {4, 4}}}};
  p = Parse(uc);
  auto bad_sum = DeepSpeedSubParamSplit(p, *ClassifyDeepSpeedParam(p, "3.self_attention.query_key_value.weight"),
                                        "qkv", 2, -1);
  ASSERT_FALSE(bad_sum.ok());
  EXPECT_NE(bad_sum.error().message().find("sum to 9, not 8"), std::string::npos) << bad_sum.error().message();
  uc.erase("sub_param_shard_widths");
  p = Parse(uc);
  EXPECT_FALSE(
      DeepSpeedSubParamSplit(p, *ClassifyDeepSpeedParam(p, "3.self_attention.query_key_value.weight"), "qkv", 2, -1).ok());
}

}  // namespace
}  // namespace ucpfs::index
