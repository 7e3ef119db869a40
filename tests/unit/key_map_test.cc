// Key mapping: the built-in rules on torchtitan, Megatron and state_dict-helper key sets,
// unmapped and ignored keys, user rules (override, ignore, $n states), duplicate states,
// parameter order, and JSON / TOML rules files with precise errors.
#include "index/key_map.h"

#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace ucpfs::index {
namespace {

namespace fs = std::filesystem;

// "#name" is a kBytes item, anything else a tensor.
Checkpoint Keys(const std::vector<std::string>& keys) {
  Checkpoint cp;
  cp.format = "dcp";
  cp.files = {{"__0_0.distcp", 1, 0}};
  for (const std::string& k : keys) {
    Item item;
    if (!k.empty() && k[0] == '#') {
      item.key = k.substr(1);
      item.kind = ItemKind::kBytes;
    } else {
      item.key = k;
      item.kind = ItemKind::kTensor;
    }
    cp.items.push_back(std::move(item));
  }
  return cp;
}

// A readable view of a mapping: "param: state=key state=key" per parameter, in order.
std::vector<std::string> Describe(const Checkpoint& cp, const KeyMapping& m) {
  std::vector<std::string> out;
  for (const ParamEntry& p : m.params) {
    std::string line = p.name + ":";
    for (int s = 0; s < kNumStateKinds; ++s) {
      if (p.item[static_cast<size_t>(s)] < 0) continue;
      line += std::string(" ") + StateKindName(static_cast<StateKind>(s)) + "=" +
              cp.items[static_cast<size_t>(p.item[static_cast<size_t>(s)])].key;
    }
    out.push_back(line);
  }
  return out;
}

// The keys of other_items (non-parameter state), in order.
std::vector<std::string> Others(const Checkpoint& cp, const KeyMapping& m) {
  std::vector<std::string> out;
  for (int32_t i : m.other_items) out.push_back(cp.items[static_cast<size_t>(i)].key);
  return out;
}

KeyRule UserRule(std::string pattern, std::string param, StateKind state = StateKind::kWeight,
                 std::string state_ref = "", bool ignore = false) {
  KeyRule r;
  r.pattern = std::move(pattern);
  r.param = std::move(param);
  r.state = state;
  r.state_ref = std::move(state_ref);
  r.ignore = ignore;
  return r;
}

using Strings = std::vector<std::string>;

TEST(KeyMap, BuiltinRulesCompile) {
  std::vector<KeyRule> rules = BuiltinRules();
  ASSERT_GE(rules.size(), 10u);
  for (KeyRule r : rules) {
    Status s = CompileRule(&r);
    EXPECT_TRUE(s.ok()) << r.pattern << ": " << s.ToString();
  }
}

TEST(KeyMap, StateNames) {
  for (int s = 0; s < kNumStateKinds; ++s) {
    auto kind = static_cast<StateKind>(s);
    EXPECT_EQ(ParseStateKind(StateKindName(kind)), kind);
  }
  EXPECT_EQ(ParseStateKind("fp32_param"), StateKind::kFp32);
  EXPECT_EQ(ParseStateKind("param"), StateKind::kFp32);
  EXPECT_FALSE(ParseStateKind("momentum_buffer").has_value());
  EXPECT_FALSE(ParseStateKind("").has_value());
}

TEST(KeyMap, Torchtitan) {
  // Model fqns at the top level, optimizer.state.<fqn>.<k>, BYTE_IO bookkeeping.
  Checkpoint cp = Keys({
      "tok_embeddings.weight",
      "layers.0.attention.wq.weight",
      "layers.0.attention_norm.weight",
      "layers.0.moe.experts.w1",          // MoE expert weights have no ".weight"
      "layers.0.moe.expert_bias",         // a buffer: no optimizer state, no rule
      "norm.weight",
      "output.weight",
      "optimizer.state.tok_embeddings.weight.exp_avg",
      "optimizer.state.tok_embeddings.weight.exp_avg_sq",
      "optimizer.state.tok_embeddings.weight.step",  // 0-d tensor (capturable Adam)
      "optimizer.state.layers.0.attention.wq.weight.exp_avg",
      "optimizer.state.layers.0.attention.wq.weight.exp_avg_sq",
      "optimizer.state.layers.0.moe.experts.w1.exp_avg",
      "optimizer.state.layers.0.moe.experts.w1.exp_avg_sq",
      "#optimizer.state.norm.weight.step",  // a step kept as a Python number: a BYTE_IO item
      "#optimizer.param_groups.tok_embeddings.weight.lr",
      "#optimizer.param_groups.tok_embeddings.weight.betas",
      "#lr_scheduler",
      "#dataloader.dp_rank_0",
      "#train_state",
  });
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m),
            (Strings{"tok_embeddings.weight: weight=tok_embeddings.weight "
                     "exp_avg=optimizer.state.tok_embeddings.weight.exp_avg "
                     "exp_avg_sq=optimizer.state.tok_embeddings.weight.exp_avg_sq "
                     "step=optimizer.state.tok_embeddings.weight.step",
                     "layers.0.attention.wq.weight: weight=layers.0.attention.wq.weight "
                     "exp_avg=optimizer.state.layers.0.attention.wq.weight.exp_avg "
                     "exp_avg_sq=optimizer.state.layers.0.attention.wq.weight.exp_avg_sq",
                     "layers.0.attention_norm.weight: weight=layers.0.attention_norm.weight",
                     "layers.0.moe.experts.w1: weight=layers.0.moe.experts.w1 "
                     "exp_avg=optimizer.state.layers.0.moe.experts.w1.exp_avg "
                     "exp_avg_sq=optimizer.state.layers.0.moe.experts.w1.exp_avg_sq",
                     "norm.weight: weight=norm.weight step=optimizer.state.norm.weight.step",
                     "output.weight: weight=output.weight"}));
  EXPECT_EQ(m->unmapped_keys, (Strings{"layers.0.moe.expert_bias"}));
  EXPECT_EQ(Others(cp, *m),
            (Strings{"optimizer.param_groups.tok_embeddings.weight.lr",
                     "optimizer.param_groups.tok_embeddings.weight.betas", "lr_scheduler",
                     "dataloader.dp_rank_0", "train_state"}));
  // Item indices, not just names.
  EXPECT_EQ(m->params[0].item[static_cast<size_t>(StateKind::kWeight)], 0);
  EXPECT_EQ(m->params[0].item[static_cast<size_t>(StateKind::kStep)], 9);
  EXPECT_EQ(m->params[0].item[static_cast<size_t>(StateKind::kFp32)], -1);
}

TEST(KeyMap, TorchtitanWithModelPrefix) {
  Checkpoint cp = Keys({"model.layers.0.w.weight", "optimizer.state.layers.0.w.weight.exp_avg",
                        "model.freqs_cis_like_buffer"});
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m),
            (Strings{"layers.0.w.weight: weight=model.layers.0.w.weight "
                     "exp_avg=optimizer.state.layers.0.w.weight.exp_avg",
                     "freqs_cis_like_buffer: weight=model.freqs_cis_like_buffer"}));
}

TEST(KeyMap, Megatron) {
  const std::string dist =
      "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.param";
  Checkpoint cp = Keys({
      "embedding.word_embeddings.weight",
      "decoder.layers.self_attention.linear_qkv.weight",
      "decoder.layers.self_attention.linear_qkv.layer_norm_weight",  // TE fused layernorm
      "decoder.layers.self_attention.linear_qkv.layer_norm_bias",
      "#decoder.layers.self_attention.linear_qkv._extra_state/shard_0.0_1.2",
      "decoder.layers.mlp.linear_fc1._extra_state",  // even as a tensor: TE metadata
      "decoder.final_layernorm.weight",
      "output_layer.weight",
      // fully_reshardable: "param" is the fp32 master; flattened-range: "fp32_param".
      "optimizer.state.param.embedding.word_embeddings.weight",
      "optimizer.state.exp_avg.embedding.word_embeddings.weight",
      "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight",
      "optimizer.state.fp32_param.decoder.layers.self_attention.linear_qkv.weight",
      "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight",
      "optimizer.state.exp_avg_sq.decoder.layers.self_attention.linear_qkv.weight",
      dist,
      "#common_state/shard_0_1",
      "#rng_state/shard_0.0_1.8",
  });
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m),
            (Strings{"embedding.word_embeddings.weight: weight=embedding.word_embeddings.weight "
                     "fp32=optimizer.state.param.embedding.word_embeddings.weight "
                     "exp_avg=optimizer.state.exp_avg.embedding.word_embeddings.weight "
                     "exp_avg_sq=optimizer.state.exp_avg_sq.embedding.word_embeddings.weight",
                     "decoder.layers.self_attention.linear_qkv.weight: "
                     "weight=decoder.layers.self_attention.linear_qkv.weight "
                     "fp32=optimizer.state.fp32_param.decoder.layers.self_attention.linear_qkv.weight "
                     "exp_avg=optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight "
                     "exp_avg_sq=optimizer.state.exp_avg_sq.decoder.layers.self_attention.linear_qkv.weight",
                     "decoder.layers.self_attention.linear_qkv.layer_norm_weight: "
                     "weight=decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                     "decoder.layers.self_attention.linear_qkv.layer_norm_bias: "
                     "weight=decoder.layers.self_attention.linear_qkv.layer_norm_bias",
                     "decoder.final_layernorm.weight: weight=decoder.final_layernorm.weight",
                     "output_layer.weight: weight=output_layer.weight"}));
  EXPECT_TRUE(m->unmapped_keys.empty()) << m->unmapped_keys.front();
  EXPECT_EQ(Others(cp, *m),
            (Strings{"decoder.layers.self_attention.linear_qkv._extra_state/shard_0.0_1.2",
                     "decoder.layers.mlp.linear_fc1._extra_state", dist, "common_state/shard_0_1",
                     "rng_state/shard_0.0_1.8"}));
}

// What megatron-core 0.16 writes for a model wrapped in its DDP (keys `module.<name>`) and, with
// MoE, a ChainedOptimizer (`chained_<i>.optimizer...`): the names are the model's own.
TEST(KeyMap, MegatronDdpAndChainedOptimizerPrefixes) {
  const std::string dist = "chained_1.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.param";
  Checkpoint cp = Keys({
      "module.embedding.word_embeddings.weight",
      "module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
      "chained_0.optimizer.state.param.module.embedding.word_embeddings.weight",
      "chained_0.optimizer.state.exp_avg.module.embedding.word_embeddings.weight",
      "chained_1.optimizer.state.exp_avg_sq.module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
      "optimizer.state.exp_avg.module.decoder.final_layernorm.weight",
      dist,
  });
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m),
            (Strings{"embedding.word_embeddings.weight: weight=module.embedding.word_embeddings.weight "
                     "fp32=chained_0.optimizer.state.param.module.embedding.word_embeddings.weight "
                     "exp_avg=chained_0.optimizer.state.exp_avg.module.embedding.word_embeddings.weight",
                     "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight: "
                     "weight=module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight "
                     "exp_avg_sq=chained_1.optimizer.state.exp_avg_sq.module.decoder.layers.0.mlp.experts."
                     "local_experts.1.linear_fc1.weight",
                     "decoder.final_layernorm.weight: "
                     "exp_avg=optimizer.state.exp_avg.module.decoder.final_layernorm.weight"}));
  EXPECT_TRUE(m->unmapped_keys.empty()) << m->unmapped_keys.front();
  EXPECT_EQ(Others(cp, *m), (Strings{dist}));
}

TEST(KeyMap, StateDictHelpers) {
  // get_state_dict + flatten_optimizer_state_dict, saved as {"model": ..., **optim}.
  Checkpoint cp = Keys({
      "model.layers.0.weight",
      "model.layers.0.bias",
      "model.pos_embeddings",
      "state.layers.0.weight.exp_avg",
      "state.layers.0.weight.exp_avg_sq",
      "state.layers.0.weight.step",
      "state.layers.0.bias.exp_avg",
      "#param_groups.layers.0.weight.lr",
      "#param_groups.layers.0.weight.weight_decay",
      "encoder.pos_embeddings",  // bare, ending in "embeddings"
  });
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m),
            (Strings{"layers.0.weight: weight=model.layers.0.weight exp_avg=state.layers.0.weight.exp_avg "
                     "exp_avg_sq=state.layers.0.weight.exp_avg_sq step=state.layers.0.weight.step",
                     "layers.0.bias: weight=model.layers.0.bias exp_avg=state.layers.0.bias.exp_avg",
                     "pos_embeddings: weight=model.pos_embeddings",
                     "encoder.pos_embeddings: weight=encoder.pos_embeddings"}));
  EXPECT_EQ(Others(cp, *m),
            (Strings{"param_groups.layers.0.weight.lr", "param_groups.layers.0.weight.weight_decay"}));
  EXPECT_TRUE(m->unmapped_keys.empty());
}

TEST(KeyMap, UnmappedKeysAreListedInOrder) {
  Checkpoint cp = Keys({"bn.running_mean", "w.weight", "some_tensor", "optimizer.state.w.weight.momentum_buffer",
                        std::string(5000, 'k') + ".weight"});
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m), (Strings{"w.weight: weight=w.weight"}));
  // The over-long key is reported, not matched (and does not blow the regex stack).
  EXPECT_EQ(m->unmapped_keys, (Strings{"bn.running_mean", "some_tensor", "optimizer.state.w.weight.momentum_buffer",
                                       std::string(5000, 'k') + ".weight"}));
}

// A tensor the scanner read from the model's state dict (Item::model_tensor: a buffer or a
// frozen parameter) is the weight of its own name, whatever the name looks like; the same key
// without the mark stays unmapped.
TEST(KeyMap, ModelTensorsMapByTheirOwnName) {
  Checkpoint cp = Keys({"enc.position_gain", "emb.frozen_shift", "w.weight", "stray_tensor"});
  cp.items[0].model_tensor = true;
  cp.items[1].model_tensor = true;
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m), (Strings{"enc.position_gain: weight=enc.position_gain",
                                       "emb.frozen_shift: weight=emb.frozen_shift", "w.weight: weight=w.weight"}));
  EXPECT_EQ(m->unmapped_keys, (Strings{"stray_tensor"}));
}

TEST(KeyMap, ParamOrderIsFirstAppearanceOfAnyKey) {
  Checkpoint cp = Keys({"optimizer.state.b.weight.exp_avg", "a.weight", "b.weight", "c.bias",
                        "optimizer.state.a.weight.exp_avg"});
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->params.size(), 3u);
  EXPECT_EQ(m->params[0].name, "b.weight");
  EXPECT_EQ(m->params[1].name, "a.weight");
  EXPECT_EQ(m->params[2].name, "c.bias");
}

TEST(KeyMap, PositionalOptimizerStateMatchesParametersInOrder) {
  // {"model": model.state_dict(), "optim": optimizer.state_dict()} saved as is.
  Checkpoint cp = Keys({"model.0.weight", "model.0.bias", "model.2.weight", "optim.state.0.exp_avg",
                        "#optim.state.0.step", "optim.state.2.exp_avg", "optim.state.1.exp_avg",
                        "#optim.param_groups.0.params"});
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m), (Strings{"0.weight: weight=model.0.weight exp_avg=optim.state.0.exp_avg "
                                       "step=optim.state.0.step",
                                       "0.bias: weight=model.0.bias exp_avg=optim.state.1.exp_avg",
                                       "2.weight: weight=model.2.weight exp_avg=optim.state.2.exp_avg"}));
  EXPECT_EQ(m->positional_names, (Strings{"0.weight", "0.bias", "2.weight"}));

  // A buffer among the model tensors makes positions ambiguous: they stay unmatched.
  Checkpoint buf = Keys({"model.0.weight", "model.bn.running_mean.weight", "optim.state.0.exp_avg"});
  m = MapKeys(buf, {});
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->positional_names.empty());
  ASSERT_EQ(m->params.size(), 3u);
  EXPECT_EQ(m->params[2].name, "0");
}

TEST(KeyMap, BytesItemsAreOnlySteps) {
  Checkpoint cp = Keys({"#blob.weight", "#model.extra", "x.weight", "#optim.state.x.weight.step",
                        "#optimizer.state.x.weight.exp_avg"});
  // Even a user rule that matches them does not make them weights; a step may be a number, and
  // torch.distributed.checkpoint's `optim.` spelling is recognised.
  Result<KeyMapping> m = MapKeys(cp, {UserRule(R"(^blob\.(.+)$)", "$1")});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m), (Strings{"x.weight: weight=x.weight step=optim.state.x.weight.step"}));
  EXPECT_EQ(Others(cp, *m), (Strings{"blob.weight", "model.extra", "optimizer.state.x.weight.exp_avg"}));
  EXPECT_TRUE(m->unmapped_keys.empty());
}

TEST(KeyMap, UserRulesComeFirst) {
  Checkpoint cp = Keys({"layers.0.w.weight", "optimizer.state.layers.0.w.weight.exp_avg",
                        "bn.running_mean", "bn.running_var", "ema.layers.0.w.weight", "odd.name"});
  std::vector<KeyRule> user = {
      // First match wins: rule 1 (and the built-in "*.weight" rule) would map this as a weight.
      UserRule(R"(^ema\..*$)", "", StateKind::kWeight, "", /*ignore=*/true),
      // Overrides the built-in "*.weight" rule: parameter names without ".weight".
      UserRule(R"(^(.+)\.weight$)", "$1"),
      UserRule(R"(^optimizer\.state\.(.+)\.weight\.exp_avg$)", "$1", StateKind::kExpAvg),
      UserRule(R"(^bn\..*$)", "", StateKind::kWeight, "", true),
      UserRule(R"(^odd\.name$)", "renamed"),  // a constant parameter name
  };
  Result<KeyMapping> m = MapKeys(cp, user);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m),
            (Strings{"layers.0.w: weight=layers.0.w.weight exp_avg=optimizer.state.layers.0.w.weight.exp_avg",
                     "renamed: weight=odd.name"}));
  EXPECT_EQ(Others(cp, *m), (Strings{"bn.running_mean", "bn.running_var", "ema.layers.0.w.weight"}));
}

TEST(KeyMap, StateFromACaptureGroup) {
  Checkpoint cp = Keys({"p.w.m1", "p.w.m2", "p.w.master", "p.w.weird"});
  std::vector<KeyRule> user = {
      UserRule(R"(^p\.(\w+)\.m(1|2)$)", "$1", StateKind::kWeight, "exp_avg$2"),
  };
  // "exp_avg1" is not a state: the rule's $-state must give a state name.
  Result<KeyMapping> m = MapKeys(cp, user);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.error().message().find("\"p.w.m1\""), std::string::npos) << m.error().message();
  EXPECT_NE(m.error().message().find("exp_avg1"), std::string::npos) << m.error().message();

  // A mapping table through alternation and two rules.
  Checkpoint cp2 = Keys({"opt.w.exp_avg", "opt.w.exp_avg_sq", "opt.w.fp32_param", "opt.w.other", "w"});
  user = {UserRule(R"(^opt\.(\w+)\.(exp_avg|exp_avg_sq|fp32_param)$)", "$1", StateKind::kWeight, "$2")};
  m = MapKeys(cp2, user);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp2, *m),
            (Strings{"w: weight=w fp32=opt.w.fp32_param exp_avg=opt.w.exp_avg exp_avg_sq=opt.w.exp_avg_sq"}));
  EXPECT_EQ(m->unmapped_keys, (Strings{"opt.w.other"}));
}

TEST(KeyMap, DuplicateStateIsAnErrorNamingBothKeys) {
  // model.<fqn> and a bare <fqn> are both the weight of <fqn>.
  Checkpoint cp = Keys({"model.a.weight", "b.weight", "a.weight"});
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.error().message().find("\"model.a.weight\""), std::string::npos) << m.error().message();
  EXPECT_NE(m.error().message().find("\"a.weight\""), std::string::npos) << m.error().message();
  EXPECT_NE(m.error().message().find("weight of parameter \"a.weight\""), std::string::npos)
      << m.error().message();

  // torchtitan and state_dict-helper spellings of the same moment: two optimizers over the same
  // parameter, named as an ambiguity and left unmapped (StructureNamesAmbiguitiesAndRulesSettleThem).
  Checkpoint cp2 = Keys({"optimizer.state.x.weight.exp_avg", "state.x.weight.exp_avg"});
  m = MapKeys(cp2, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->ambiguities.size(), 1u);
  EXPECT_EQ(m->unmapped_keys, (Strings{"optimizer.state.x.weight.exp_avg", "state.x.weight.exp_avg"}));
}

TEST(KeyMap, LiteralPrefixShortcutKeepsRegexSemantics) {
  // A top-level alternation, a quantified last literal, and escapes: the prefilter must not
  // reject keys the regex accepts.
  Checkpoint cp = Keys({"b.y", "xz.w", "xyz.v", "a.b(c).w", "d1.q"});
  std::vector<KeyRule> user = {
      UserRule(R"(^a\.x|b\.y$)", "alt"),
      UserRule(R"(^xy?z\.(\w)$)", "q_$1"),
      UserRule(R"(^a\.b\(c\)\.(w)$)", "paren_$1"),
      UserRule(R"(^d\d\.(q)$)", "digit_$1"),
  };
  Result<KeyMapping> m = MapKeys(cp, user);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m), (Strings{"alt: weight=b.y", "q_w: weight=xz.w", "q_v: weight=xyz.v",
                                       "paren_w: weight=a.b(c).w", "digit_q: weight=d1.q"}));
}

TEST(KeyMap, CompileRuleErrors) {
  KeyRule bad_regex = UserRule("^(unclosed", "$1");
  Status s = CompileRule(&bad_regex);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("invalid regex"), std::string::npos) << s.message();

  KeyRule bad_group = UserRule("^(a)\\.(b)$", "$3");
  s = CompileRule(&bad_group);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("$3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("2 group"), std::string::npos) << s.message();

  KeyRule bad_state = UserRule("^(a)$", "$1", StateKind::kWeight, "$2");
  s = CompileRule(&bad_state);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();

  KeyRule no_param = UserRule("^abc$", "");
  s = CompileRule(&no_param);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);

  KeyRule defaulted = UserRule("^m\\.(.+)$", "");
  ASSERT_TRUE(CompileRule(&defaulted).ok());
  EXPECT_EQ(defaulted.param, "$1");
  KeyRule dollars = UserRule("^(.+)$", "$$literal$1");  // "$$" is a literal dollar
  EXPECT_TRUE(CompileRule(&dollars).ok());

  // MapKeys reports a bad user rule with its index.
  Result<KeyMapping> m = MapKeys(Keys({"a"}), {UserRule("^ok$", "x"), UserRule("[", "x")});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message().find("user rule 1"), std::string::npos) << m.error().message();
}

// ---- rules files ----

class RulesFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "ucpfs_rules_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string Write(const std::string& name, const std::string& text) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  // Loads a file expected to fail and checks that the message has every fragment.
  void ExpectError(const std::string& name, const std::string& text, StatusCode code,
                   const std::vector<std::string>& fragments) {
    std::string path = Write(name, text);
    Result<std::vector<KeyRule>> r = LoadRules(path);
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_EQ(r.error().code(), code) << r.error().ToString();
    EXPECT_NE(r.error().message().find(path), std::string::npos) << r.error().message();
    for (const std::string& f : fragments) {
      EXPECT_NE(r.error().message().find(f), std::string::npos) << "missing \"" << f << "\" in: " << r.error().message();
    }
  }
  std::string dir_;
};

TEST_F(RulesFiles, JsonRules) {
  std::string path = Write("rules.json", R"({
    "rules": [
      {"pattern": "^ema\\..*$", "ignore": true},
      {"pattern": "^opt\\.(\\w+)\\.(exp_avg|exp_avg_sq)$", "param": "$1", "state": "$2"},
      {"pattern": "^master\\.(.+)$", "state": "fp32"},
      {"pattern": "^(.+)\\.kernel$", "param": "$1.weight", "state": "weight"}
    ]
  })");
  Result<std::vector<KeyRule>> rules = LoadRules(path);
  ASSERT_TRUE(rules.ok()) << rules.status().ToString();
  ASSERT_EQ(rules->size(), 4u);
  EXPECT_TRUE((*rules)[0].ignore);
  EXPECT_EQ((*rules)[1].state_ref, "$2");
  EXPECT_EQ((*rules)[2].state, StateKind::kFp32);
  EXPECT_EQ((*rules)[2].param, "$1");  // defaulted
  EXPECT_EQ((*rules)[3].param, "$1.weight");

  Checkpoint cp = Keys({"dense.kernel", "opt.dense.exp_avg", "master.dense", "ema.dense.kernel"});
  // The parameter name of "opt.dense.exp_avg" is "dense", of "dense.kernel" "dense.weight":
  // different parameters, as the rules say.
  Result<KeyMapping> m = MapKeys(cp, *rules);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m), (Strings{"dense.weight: weight=dense.kernel",
                                       "dense: fp32=master.dense exp_avg=opt.dense.exp_avg"}));
  EXPECT_EQ(Others(cp, *m), (Strings{"ema.dense.kernel"}));
}

TEST_F(RulesFiles, TomlRules) {
  std::string path = Write("rules.toml", R"(
# Rules for a custom trainer.
[[rules]]
pattern = '^ema\..*$'
ignore = true

[[rules]]
pattern = '^opt\.(\w+)\.(exp_avg|exp_avg_sq)$'
param = "$1"
state = "$2"

[[rules]]
pattern = '^master\.(.+)$'
state = "fp32_param"
)");
  Result<std::vector<KeyRule>> rules = LoadRules(path);
  ASSERT_TRUE(rules.ok()) << rules.status().ToString();
  ASSERT_EQ(rules->size(), 3u);
  EXPECT_TRUE((*rules)[0].ignore);
  EXPECT_EQ((*rules)[1].state_ref, "$2");
  EXPECT_EQ((*rules)[2].state, StateKind::kFp32);

  Checkpoint cp = Keys({"dense", "opt.dense.exp_avg", "opt.dense.exp_avg_sq", "master.dense", "ema.x"});
  Result<KeyMapping> m = MapKeys(cp, *rules);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m), (Strings{"dense: weight=dense fp32=master.dense exp_avg=opt.dense.exp_avg "
                                       "exp_avg_sq=opt.dense.exp_avg_sq"}));
  EXPECT_EQ(Others(cp, *m), (Strings{"ema.x"}));

  // An empty rules list is valid in both formats.
  EXPECT_TRUE(LoadRules(Write("empty.json", R"({"rules": []})")).ok());
  Result<std::vector<KeyRule>> empty_toml = LoadRules(Write("empty.toml", "rules = []\n"));
  ASSERT_TRUE(empty_toml.ok()) << empty_toml.status().ToString();
  EXPECT_TRUE(empty_toml->empty());
}

TEST_F(RulesFiles, BadJsonFilesGivePreciseErrors) {
  const auto kInvalid = StatusCode::kInvalidArgument;
  ExpectError("syntax.json", "{\"rules\": [", kInvalid, {"invalid JSON"});
  ExpectError("shape.json", "[]", kInvalid, {"\"rules\" array"});
  ExpectError("no_pattern.json", R"({"rules": [{"pattern": "^a$", "param": "x"}, {"param": "$1"}]})", kInvalid,
              {"rules[1]", "missing \"pattern\""});
  ExpectError("regex.json", R"({"rules": [{"pattern": "^(a", "param": "$1"}]})", kInvalid,
              {"rules[0]", "invalid regex", "^(a"});
  ExpectError("state.json", R"({"rules": [{"pattern": "^a$", "param": "a"}, {"pattern": "^(b)$"},
                                          {"pattern": "^(.+)$", "state": "momentum"}]})",
              kInvalid, {"rules[2]", "unknown state \"momentum\""});
  ExpectError("field.json", R"({"rules": [{"pattern": "^(a)$", "stat": "exp_avg"}]})", kInvalid,
              {"rules[0]", "unknown field \"stat\""});
  ExpectError("type.json", R"({"rules": [{"pattern": "^(a)$", "ignore": "yes"}]})", kInvalid,
              {"rules[0]", "\"ignore\" must be true or false"});
  ExpectError("ptype.json", R"({"rules": [{"pattern": 5}]})", kInvalid, {"rules[0]", "\"pattern\" must be a string"});
  ExpectError("group.json", R"({"rules": [{"pattern": "^(a)$", "param": "$2"}]})", kInvalid,
              {"rules[0]", "$2", "1 group"});
}

TEST_F(RulesFiles, BadTomlFilesGivePreciseErrors) {
  const auto kInvalid = StatusCode::kInvalidArgument;
  ExpectError("syntax.toml", "[[rules]]\npattern = \"unterminated\n", kInvalid, {"invalid TOML", "line 2"});
  ExpectError("no_rules.toml", "title = \"x\"\n", kInvalid, {"[[rules]]"});
  ExpectError("no_pattern.toml", "[[rules]]\npattern = '^(a)$'\n[[rules]]\nparam = '$1'\n", kInvalid,
              {"rules[1]", "missing \"pattern\""});
  ExpectError("regex.toml", "[[rules]]\npattern = '^a)('\nparam = 'x'\n", kInvalid, {"rules[0]", "invalid regex"});
  ExpectError("state.toml", "[[rules]]\npattern = '^(a)$'\nstate = 'velocity'\n", kInvalid,
              {"rules[0]", "unknown state \"velocity\""});
  ExpectError("field.toml", "[[rules]]\npattern = '^(a)$'\nignored = true\n", kInvalid,
              {"rules[0]", "unknown field \"ignored\""});
  ExpectError("toplevel.toml", "extra = 1\n[[rules]]\npattern = '^(a)$'\n", kInvalid, {"unknown top-level key \"extra\""});
}

TEST_F(RulesFiles, MissingFileAndUnknownExtension) {
  Result<std::vector<KeyRule>> r = LoadRules(dir_ + "/absent.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), StatusCode::kNotFound);
  EXPECT_NE(r.error().message().find("absent.json"), std::string::npos);
  r = LoadRules(Write("rules.yaml", "rules: []"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.error().message().find(".json or .toml"), std::string::npos) << r.error().message();
}

// A checkpoint with `shape` on every tensor item whose key is in `shaped` (others stay 0-d).
Checkpoint Shaped(const std::vector<std::string>& keys, const std::map<std::string, std::vector<int64_t>>& shaped) {
  Checkpoint cp = Keys(keys);
  for (Item& it : cp.items) {
    if (auto s = shaped.find(it.key); s != shaped.end()) it.layout.shape = s->second;
  }
  return cp;
}

TEST(KeyMap, StructureFindsAnAppStateWrapper) {
  // PyTorch's DCP tutorial: dcp.save({"app": AppState(model, optimizer)}), AppState returning
  // {"model": ..., "optim": ...} from get_state_dict.
  Checkpoint cp = Keys({"app.model.net1.weight", "app.model.net1.bias", "app.model.net2.weight",
                        "app.optim.state.net1.weight.exp_avg", "app.optim.state.net1.weight.exp_avg_sq",
                        "app.optim.state.net1.weight.step", "app.optim.state.net1.bias.exp_avg",
                        "app.optim.state.net2.weight.exp_avg", "#app.optim.param_groups"});
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m),
            (Strings{"net1.weight: weight=app.model.net1.weight exp_avg=app.optim.state.net1.weight.exp_avg "
                     "exp_avg_sq=app.optim.state.net1.weight.exp_avg_sq step=app.optim.state.net1.weight.step",
                     "net1.bias: weight=app.model.net1.bias exp_avg=app.optim.state.net1.bias.exp_avg",
                     "net2.weight: weight=app.model.net2.weight exp_avg=app.optim.state.net2.weight.exp_avg"}));
  EXPECT_EQ(Others(cp, *m), (Strings{"app.optim.param_groups"}));
  EXPECT_TRUE(m->unmapped_keys.empty());
  EXPECT_EQ(m->model_prefix, "app.model.");
  EXPECT_EQ(m->optimizer_prefixes, (Strings{"app.optim."}));
  EXPECT_TRUE(m->ambiguities.empty());
}

TEST(KeyMap, StructureStripsTorchWrappersAndKeepsBuffersUnderThePrefix) {
  // Lightning-style `optimizer_0.` next to weights of a compiled, checkpoint-wrapped model under
  // `state_dict.`; a buffer under the same prefix is the model's too.
  Checkpoint cp = Keys({"state_dict._orig_mod.layers.0._checkpoint_wrapped_module.w.weight",
                        "state_dict._orig_mod.bn.running_mean", "optimizer_0.state.layers.0.w.weight.exp_avg",
                        "#optimizer_0.state.layers.0.w.weight.step", "#optimizer_0.param_groups.0.lr"});
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(Describe(cp, *m),
            (Strings{"layers.0.w.weight: weight=state_dict._orig_mod.layers.0._checkpoint_wrapped_module.w.weight "
                     "exp_avg=optimizer_0.state.layers.0.w.weight.exp_avg step=optimizer_0.state.layers.0.w.weight.step",
                     "bn.running_mean: weight=state_dict._orig_mod.bn.running_mean"}));
  EXPECT_EQ(Others(cp, *m), (Strings{"optimizer_0.param_groups.0.lr"}));
  EXPECT_EQ(StripWrapperComponents("_fsdp_wrapped_module.a._orig_mod.b"), "a.b");
  EXPECT_EQ(StripWrapperComponents("a.b"), "a.b");
}

TEST(KeyMap, StructureComparesShapes) {
  // `enc.w.weight` is named like the optimizer's parameter but has another shape: `dec.` wins.
  Checkpoint cp = Shaped({"enc.w.weight", "dec.w.weight", "opt.state.w.weight.exp_avg"},
                         {{"enc.w.weight", {3, 4}}, {"dec.w.weight", {4, 4}}, {"opt.state.w.weight.exp_avg", {4, 4}}});
  Result<KeyMapping> m = MapKeys(cp, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->model_prefix, "dec.");
  EXPECT_EQ(Describe(cp, *m), (Strings{"enc.w.weight: weight=enc.w.weight",
                                       "w.weight: weight=dec.w.weight exp_avg=opt.state.w.weight.exp_avg"}));
}

TEST(KeyMap, StructureNamesAmbiguitiesAndRulesSettleThem) {
  // Two prefixes hold the optimizer's parameters with equal shapes: no guess.
  Checkpoint two_models = Keys({"ema.w.weight", "live.w.weight", "opt.state.w.weight.exp_avg"});
  Result<KeyMapping> m = MapKeys(two_models, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->ambiguities.size(), 1u);
  EXPECT_NE(m->ambiguities[0].find("'ema.', 'live.'"), std::string::npos) << m->ambiguities[0];
  EXPECT_EQ(m->model_prefix, "");
  // --rules: the EMA copy is ignored, so `live.` is the model.
  m = MapKeys(two_models, {UserRule(R"(^ema\..*$)", "", StateKind::kWeight, "", true)});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE(m->ambiguities.empty());
  EXPECT_EQ(Describe(two_models, *m), (Strings{"w.weight: weight=live.w.weight exp_avg=opt.state.w.weight.exp_avg"}));

  // Two optimizers over the same parameter: neither is served, both named.
  Checkpoint two_optims = Keys({"model.w.weight", "opt_a.state.w.weight.exp_avg", "opt_b.state.w.weight.exp_avg"});
  m = MapKeys(two_optims, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->ambiguities.size(), 1u);
  EXPECT_NE(m->ambiguities[0].find("'opt_a.state.' and 'opt_b.state.'"), std::string::npos) << m->ambiguities[0];
  EXPECT_EQ(m->unmapped_keys, (Strings{"opt_a.state.w.weight.exp_avg", "opt_b.state.w.weight.exp_avg"}));
  m = MapKeys(two_optims, {UserRule(R"(^opt_b\..*$)", "", StateKind::kWeight, "", true)});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE(m->ambiguities.empty());
  EXPECT_EQ(Describe(two_optims, *m), (Strings{"w.weight: weight=model.w.weight exp_avg=opt_a.state.w.weight.exp_avg"}));

  // Two optimizers over disjoint parameters (a GAN's) are not ambiguous.
  Checkpoint gan = Keys({"model.g.weight", "model.d.weight", "optimizer_0.state.g.weight.exp_avg",
                         "optimizer_1.state.d.weight.exp_avg"});
  m = MapKeys(gan, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE(m->ambiguities.empty());
  EXPECT_EQ(m->optimizer_prefixes, (Strings{"optimizer_0.", "optimizer_1."}));
  EXPECT_EQ(Describe(gan, *m), (Strings{"g.weight: weight=model.g.weight exp_avg=optimizer_0.state.g.weight.exp_avg",
                                        "d.weight: weight=model.d.weight exp_avg=optimizer_1.state.d.weight.exp_avg"}));
}

TEST(KeyMap, ManyKeysMapQuickly) {
  // A 70B-sized torchtitan key set: 80 layers x 9 params, 3 optimizer tensors each, and the
  // param_groups BYTE_IO entries.
  std::vector<std::string> keys;
  const char* names[] = {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                         "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                         "feed_forward.w3.weight", "attention_norm.weight", "ffn_norm.weight"};
  for (int l = 0; l < 80; ++l) {
    for (const char* n : names) keys.push_back("layers." + std::to_string(l) + "." + n);
  }
  const size_t n_params = keys.size();
  for (size_t i = 0; i < n_params; ++i) {
    for (const char* s : {".exp_avg", ".exp_avg_sq", ".step"}) keys.push_back("optimizer.state." + keys[i] + s);
    for (const char* g : {".lr", ".betas", ".eps", ".weight_decay"}) {
      keys.push_back("#optimizer.param_groups." + keys[i] + g);
    }
  }
  Checkpoint cp = Keys(keys);
  const auto t0 = std::chrono::steady_clock::now();
  Result<KeyMapping> m = MapKeys(cp, {});
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->params.size(), n_params);
  EXPECT_TRUE(m->unmapped_keys.empty());
  EXPECT_EQ(m->other_items.size(), n_params * 4);
  for (const ParamEntry& p : m->params) {
    for (StateKind s : {StateKind::kWeight, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kStep}) {
      EXPECT_GE(p.item[static_cast<size_t>(s)], 0) << p.name;
    }
  }
  std::printf("mapped %zu keys in %.1f ms\n", keys.size(), ms);
}

}  // namespace
}  // namespace ucpfs::index
