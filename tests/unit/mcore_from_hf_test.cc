// MegatronCoreFromHf (views/mcore_from_hf.h): a small in-memory Hugging Face Llama (GQA: 4 heads
// in 2 key-value groups of head dim 2, SwiGLU) renamed and fused as Megatron-Core's GPTModel holds it,
// checked element by element against a naive interleave of the source tensors (linear_qkv per query
// group, linear_fc1 = [gate; up]); GPTModel's order and `_extra_state` entries; the Megatron preset's
// split of the result at tp2 ([gate_r; up_r], the vocabulary padded by repeating its last row); and
// tied embeddings; the refusals (no heads, a name with no Megatron-Core counterpart).
#include "views/mcore_from_hf.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "core/byte_source.h"
#include "core/slice/local_view.h"
#include "core/slice/slice.h"

namespace ucpfs::views {
namespace {

constexpr int kW = static_cast<int>(TargetState::kWeight);
constexpr int64_t kHidden = 8, kHeads = 4, kGroups = 2, kHeadDim = 2, kFfn = 6, kVocab = 10;

// Element e of source parameter p is p * 1000 + e (exact in float32).
float Value(size_t p, int64_t e) { return static_cast<float>(static_cast<int64_t>(p) * 1000 + e); }

struct Model {
  std::shared_ptr<TargetInput> input;
  std::map<std::string, size_t> index;  // HF name -> position (its values' p)
};

Model MakeHf(bool with_head = true, bool qwen = false) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {{"model.embed_tokens.weight", {kVocab, kHidden}}};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    shapes.push_back({p + "self_attn.q_proj.weight", {kHeads * kHeadDim, kHidden}});
    shapes.push_back({p + "self_attn.k_proj.weight", {kGroups * kHeadDim, kHidden}});
    shapes.push_back({p + "self_attn.v_proj.weight", {kGroups * kHeadDim, kHidden}});
    shapes.push_back({p + "self_attn.o_proj.weight", {kHidden, kHeads * kHeadDim}});
    shapes.push_back({p + "mlp.gate_proj.weight", {kFfn, kHidden}});
    shapes.push_back({p + "mlp.up_proj.weight", {kFfn, kHidden}});
    shapes.push_back({p + "mlp.down_proj.weight", {kHidden, kFfn}});
    shapes.push_back({p + "input_layernorm.weight", {kHidden}});
    shapes.push_back({p + "post_attention_layernorm.weight", {kHidden}});
    if (qwen) {  // Qwen2's attention biases, Qwen3's per-head q/k norms
      shapes.push_back({p + "self_attn.q_proj.bias", {kHeads * kHeadDim}});
      shapes.push_back({p + "self_attn.k_proj.bias", {kGroups * kHeadDim}});
      shapes.push_back({p + "self_attn.v_proj.bias", {kGroups * kHeadDim}});
      shapes.push_back({p + "self_attn.q_norm.weight", {kHeadDim}});
      shapes.push_back({p + "self_attn.k_norm.weight", {kHeadDim}});
    }
  }
  shapes.push_back({"model.norm.weight", {kHidden}});
  if (with_head) shapes.push_back({"lm_head.weight", {kVocab, kHidden}});
  Model m;
  m.input = std::make_shared<TargetInput>();
  auto files = std::make_shared<std::vector<std::shared_ptr<const ByteSource>>>();
  for (size_t p = 0; p < shapes.size(); ++p) {
    int64_t n = 1;
    for (int64_t s : shapes[p].second) n *= s;
    std::vector<std::byte> bytes(static_cast<size_t>(n) * 4);
    for (int64_t e = 0; e < n; ++e) {
      const float v = Value(p, e);
      std::memcpy(bytes.data() + e * 4, &v, 4);
    }
    files->push_back(std::make_shared<MemorySource>(shapes[p].first, std::move(bytes)));
    auto layout = std::make_shared<slice::TensorLayout>();
    layout->shape = shapes[p].second;
    slice::Fragment f;
    f.box.offsets.assign(layout->shape.size(), 0);
    f.box.sizes = layout->shape;
    f.flat_hi = static_cast<uint64_t>(n);
    f.file_id = static_cast<uint32_t>(p);
    layout->fragments.push_back(f);
    TargetParam tp;
    tp.name = shapes[p].first;
    tp.states[kW] = layout;
    tp.dtypes[kW] = DType::kFloat32;
    tp.keys[kW] = tp.name;
    m.input->params.push_back(std::move(tp));
    m.index[shapes[p].first] = p;
  }
  m.input->files = files;
  m.input->preset = layout::Preset::kMegatronCore;
  m.input->model_facts.num_attention_heads = kHeads;
  m.input->model_facts.num_query_groups = kGroups;
  m.input->model_facts.hidden_size = kHidden;
  m.input->vocab_size = kVocab;
  return m;
}

std::vector<float> Read(const slice::TensorLayout& l, const TargetInput& in) {
  std::vector<std::byte> bytes(l.NumElems() * 4);
  const Status s = slice::ReadTensorBytes(l, DType::kFloat32, *in.files, 0, bytes);
  EXPECT_TRUE(s.ok()) << s.ToString();
  std::vector<float> v(l.NumElems());
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

// Rows [lo, lo + n) of HF parameter `name` (width `w`), as values.
void AppendRows(const Model& m, const std::string& name, int64_t lo, int64_t n, int64_t w, std::vector<float>* out) {
  for (int64_t e = lo * w; e < (lo + n) * w; ++e) out->push_back(Value(m.index.at(name), e));
}

const TargetParam* Find(const TargetInput& in, const std::string& name) {
  for (const auto& p : in.params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

TEST(MegatronCoreFromHf, NamesOrderAndFusedValues) {
  Model m = MakeHf();
  auto out = MegatronCoreFromHf(*m.input);
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  const TargetInput& in = **out;
  EXPECT_EQ(in.preset, layout::Preset::kMegatron);
  std::vector<std::string> names;
  for (const auto& p : in.params) {
    names.push_back(p.name);
    for (const auto& [last, v] : p.model_siblings) names.push_back(p.name + " +" + last);
  }
  const std::vector<std::string> layer = {
      "input_layernorm.weight",
      "self_attention.linear_proj.weight",
      "self_attention.linear_proj.weight +_extra_state",
      "self_attention.linear_qkv.weight",
      "self_attention.linear_qkv.weight +_extra_state",
      "pre_mlp_layernorm.weight",
      "mlp.linear_fc1.weight",
      "mlp.linear_fc1.weight +_extra_state",
      "mlp.linear_fc2.weight",
      "mlp.linear_fc2.weight +_extra_state"};
  std::vector<std::string> want = {"embedding.word_embeddings.weight"};
  for (int l = 0; l < 2; ++l) {
    for (const auto& n : layer) want.push_back("decoder.layers." + std::to_string(l) + "." + n);
  }
  want.insert(want.end(), {"decoder.final_layernorm.weight", "output_layer.weight", "output_layer.weight +_extra_state"});
  EXPECT_EQ(names, want);

  // linear_qkv: per query group g, its 2 query heads, then its key head, then its value head.
  const std::string hf = "model.layers.1.self_attn.";
  std::vector<float> qkv;
  for (int64_t g = 0; g < kGroups; ++g) {
    const int64_t q_rows = kHeads / kGroups * kHeadDim;
    AppendRows(m, hf + "q_proj.weight", g * q_rows, q_rows, kHidden, &qkv);
    AppendRows(m, hf + "k_proj.weight", g * kHeadDim, kHeadDim, kHidden, &qkv);
    AppendRows(m, hf + "v_proj.weight", g * kHeadDim, kHeadDim, kHidden, &qkv);
  }
  const TargetParam* fused = Find(in, "decoder.layers.1.self_attention.linear_qkv.weight");
  ASSERT_NE(fused, nullptr);
  EXPECT_EQ(fused->states[kW]->shape, (std::vector<int64_t>{(kHeads + 2 * kGroups) * kHeadDim, kHidden}));
  ASSERT_TRUE(slice::ValidateCoverage(*fused->states[kW], "linear_qkv").ok());
  EXPECT_EQ(Read(*fused->states[kW], in), qkv);

  std::vector<float> fc1;
  AppendRows(m, "model.layers.0.mlp.gate_proj.weight", 0, kFfn, kHidden, &fc1);
  AppendRows(m, "model.layers.0.mlp.up_proj.weight", 0, kFfn, kHidden, &fc1);
  const TargetParam* gate_up = Find(in, "decoder.layers.0.mlp.linear_fc1.weight");
  ASSERT_NE(gate_up, nullptr);
  EXPECT_EQ(Read(*gate_up->states[kW], in), fc1);
  EXPECT_EQ(Find(in, "decoder.layers.0.pre_mlp_layernorm.weight")->states[kW],
            m.input->params[m.index.at("model.layers.0.post_attention_layernorm.weight")].states[kW]);
}

// The Megatron preset's split of the result at tp2: rank 1 holds [gate_1; up_1], its query groups'
// rows, and vocabulary rows 128..255 of the padded 256, each past the 10 real ones the last row.
TEST(MegatronCoreFromHf, SplitAtTp2) {
  Model m = MakeHf();
  auto layout = layout::ParseLayout("tp2_pp1_dp1");
  ASSERT_TRUE(layout.ok());
  auto plan = TargetPlan::Make(m.input, *layout);
  ASSERT_TRUE(plan.ok()) << plan.error().ToString();
  auto out = MegatronCoreFromHf(*m.input);
  ASSERT_TRUE(out.ok());
  const TargetInput& in = **out;
  const auto& patterns = plan->patterns();
  ASSERT_EQ(patterns.size(), in.params.size());
  const std::vector<int> bounds = {0, 2};
  const layout::RankCoords r1 = layout::CoordsOf(*layout, 1);
  for (size_t i = 0; i < in.params.size(); ++i) {
    const TargetParam& p = in.params[i];
    auto view = layout::TargetSlice(plan->preset(), p.name, patterns[i], p.states[kW]->shape, *layout, bounds, r1);
    ASSERT_TRUE(view.ok()) << view.error().ToString();
    auto local = slice::LocalLayout(*p.states[kW], view->local_shape, view->cat_dim, view->pieces);
    ASSERT_TRUE(local.ok()) << local.error().ToString();
    const std::vector<float> got = Read(*local, in);
    std::vector<float> want;
    if (p.name == "decoder.layers.0.mlp.linear_fc1.weight") {
      AppendRows(m, "model.layers.0.mlp.gate_proj.weight", kFfn / 2, kFfn / 2, kHidden, &want);
      AppendRows(m, "model.layers.0.mlp.up_proj.weight", kFfn / 2, kFfn / 2, kHidden, &want);
    } else if (p.name == "decoder.layers.0.self_attention.linear_qkv.weight") {
      AppendRows(m, "model.layers.0.self_attn.q_proj.weight", 4, 4, kHidden, &want);  // group 1
      AppendRows(m, "model.layers.0.self_attn.k_proj.weight", 2, 2, kHidden, &want);
      AppendRows(m, "model.layers.0.self_attn.v_proj.weight", 2, 2, kHidden, &want);
    } else if (p.name == "output_layer.weight") {
      EXPECT_EQ(view->local_shape, (std::vector<int64_t>{128, kHidden}));
      for (int row = 128; row < 256; ++row) AppendRows(m, "lm_head.weight", kVocab - 1, 1, kHidden, &want);
    } else {
      continue;
    }
    EXPECT_EQ(got, want) << p.name;
  }
  auto files = plan->Build(1);
  ASSERT_TRUE(files.ok()) << files.error().ToString();
  EXPECT_NE(files->model, nullptr);
}

// Tied (no lm_head): the embedding alone, and model.pt's output_layer._extra_state on the last stage only.
TEST(MegatronCoreFromHf, TiedEmbeddings) {
  Model m = MakeHf(/*with_head=*/false);
  auto out = MegatronCoreFromHf(*m.input);
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  EXPECT_EQ((*out)->params.back().name, "decoder.final_layernorm.weight");
  EXPECT_EQ((*out)->params.front().model_siblings.size(), 1u);
  for (const char* name : {"tp1_pp1_dp1", "tp1_pp2_dp1"}) {
    auto layout = layout::ParseLayout(name);
    ASSERT_TRUE(layout.ok());
    auto plan = TargetPlan::Make(m.input, *layout);
    ASSERT_TRUE(plan.ok()) << plan.error().ToString();
    for (int r = 0; r < layout->World(); ++r) {
      auto files = plan->Build(r);
      ASSERT_TRUE(files.ok()) << files.error().ToString();
      std::vector<std::byte> bytes(files->model->Size());
      ASSERT_TRUE(files->model->ReadAt(0, bytes).ok());
      const std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      const bool last = r == layout->World() - 1, first = r == 0;
      EXPECT_EQ(text.find("output_layer._extra_state") != std::string::npos, last) << name << " rank " << r;
      EXPECT_EQ(text.find("output_layer.weight") != std::string::npos, last && !first) << name << " rank " << r;
      EXPECT_EQ(text.find("embedding.word_embeddings._extra_state"), std::string::npos);
    }
  }
}

// Qwen2 / Qwen3: linear_qkv.bias fused per query group like the weight (and followed by the layer's
// _extra_state), q_norm / k_norm as q_layernorm / k_layernorm.
TEST(MegatronCoreFromHf, AttentionBiasesAndQkNorms) {
  Model m = MakeHf(/*with_head=*/true, /*qwen=*/true);
  auto out = MegatronCoreFromHf(*m.input);
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  const TargetInput& in = **out;
  const std::string hf = "model.layers.0.self_attn.";
  std::vector<float> want;
  for (int64_t g = 0; g < kGroups; ++g) {
    AppendRows(m, hf + "q_proj.bias", g * 4, 4, 1, &want);
    AppendRows(m, hf + "k_proj.bias", g * 2, 2, 1, &want);
    AppendRows(m, hf + "v_proj.bias", g * 2, 2, 1, &want);
  }
  const TargetParam* bias = Find(in, "decoder.layers.0.self_attention.linear_qkv.bias");
  ASSERT_NE(bias, nullptr);
  EXPECT_EQ(Read(*bias->states[kW], in), want);
  EXPECT_EQ(bias->model_siblings.size(), 1u);
  EXPECT_TRUE(Find(in, "decoder.layers.0.self_attention.linear_qkv.weight")->model_siblings.empty());
  EXPECT_NE(Find(in, "decoder.layers.1.self_attention.q_layernorm.weight"), nullptr);
  EXPECT_NE(Find(in, "decoder.layers.1.self_attention.k_layernorm.weight"), nullptr);
  auto layout = layout::ParseLayout("tp2_pp1_dp1");
  ASSERT_TRUE(layout.ok());
  auto plan = TargetPlan::Make(m.input, *layout);
  ASSERT_TRUE(plan.ok()) << plan.error().ToString();
  ASSERT_TRUE(plan->Build(1).ok());
}

TEST(MegatronCoreFromHf, Refusals) {
  Model m = MakeHf();
  m.input->model_facts.num_attention_heads = 0;
  auto out = MegatronCoreFromHf(*m.input);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.error().message().find("attention heads is unknown"), std::string::npos);

  Model odd = MakeHf();
  odd.input->params[1].name = "model.layers.0.self_attn.rotary_mystery.weight";
  out = MegatronCoreFromHf(*odd.input);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.error().message().find("rotary_mystery"), std::string::npos);

  Model wrong_heads = MakeHf();
  wrong_heads.input->model_facts.num_query_groups = 1;  // k_proj has 2 heads' rows
  out = MegatronCoreFromHf(*wrong_heads.input);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.error().message().find("do not fit"), std::string::npos);
}

}  // namespace
}  // namespace ucpfs::views
