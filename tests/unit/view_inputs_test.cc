// The target input from an index: a step stored as a Python number, param_groups in DCP's
// flattening of get_optimizer_state_dict, extra state (replicated and rank-local) and every
// item no view serves reported with its reason; then what the rank files of two layouts hold;
// a fused optimizer parameter whose weight is stored split (torchtitan's wqkv / wq|wk|wv).
#include "views/view_inputs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/format/torch_file.h"
#include "core/format/torch_writer.h"
#include "views/safetensors_view.h"
#include "views/universal_view.h"

namespace ucpfs::index {
namespace {

using format::SaveValue;

// One source "file" holding back-to-back torch.save blobs, plus the items that point at them.
struct Source {
  std::vector<std::byte> bytes;
  Checkpoint ckpt;

  void Blob(const std::string& key, const SaveValue& v) {
    auto lazy = format::LazyTorchFile::Build(v, key);
    ASSERT_TRUE(lazy.ok()) << lazy.error().ToString();
    Item it;
    it.key = key;
    it.kind = ItemKind::kBytes;
    it.file_id = 0;
    it.byte_offset = bytes.size();
    it.n_bytes = (*lazy)->Size();
    bytes.resize(bytes.size() + it.n_bytes);
    ASSERT_TRUE((*lazy)->ReadAt(0, std::span(bytes).subspan(it.byte_offset)).ok());
    ckpt.items.push_back(std::move(it));
  }
  // A float32 tensor [n] (or of `shape`, n elements) whose element e is base + e, stored in this file.
  void Tensor(const std::string& key, int n, float base, std::vector<int64_t> shape = {}) {
    if (shape.empty()) shape = {n};
    Item it;
    it.key = key;
    it.kind = ItemKind::kTensor;
    it.dtype = DType::kFloat32;
    it.layout.shape = shape;
    slice::Fragment f;
    f.box.offsets.assign(shape.size(), 0);
    f.box.sizes = shape;
    f.flat_hi = static_cast<uint64_t>(n);
    f.file_id = 0;
    f.byte_offset = bytes.size();
    for (int e = 0; e < n; ++e) {
      const float v = base + static_cast<float>(e);
      const size_t at = bytes.size();
      bytes.resize(at + 4);
      std::memcpy(bytes.data() + at, &v, 4);
    }
    it.layout.fragments.push_back(f);
    ckpt.items.push_back(std::move(it));
  }
  // The checkpoint's one file, listed in it and as the table its items are read from.
  FileTable Files() {
    ckpt.files = {{"__0_0.distcp", bytes.size(), 0}};
    auto files = std::make_shared<std::vector<std::shared_ptr<const ByteSource>>>();
    files->push_back(std::make_shared<MemorySource>("__0_0.distcp", bytes));
    return files;
  }
};

// The source's one file, its key mapping and its target input (warnings not collected).
Result<std::shared_ptr<views::TargetInput>> InputOf(Source& s) {
  FileTable files = s.Files();
  UCPFS_ASSIGN_OR_RETURN(KeyMapping mapping, MapKeys(s.ckpt, {}));
  return MakeTargetInput(s.ckpt, nullptr, mapping, files, nullptr);
}

std::vector<std::string> Keys(const views::TargetInput& in) {
  std::vector<std::string> out;
  for (const auto& e : in.extras) out.push_back(e.key);
  return out;
}

// A torch.save blob whose root is an instance of some class (not plain data).
SaveValue Marker() {
  SaveValue v = SaveValue::OrderedDict();
  v.Set("last_epoch", SaveValue::Int(3));
  return v;
}

// The not-served entry for DeepSpeed param groups names the key the optimizer file has: ZeRO-3
// keeps them under optimizer_state_dict.optimizer_state_dict, the others under
// optimizer_state_dict.base_optimizer_state.
TEST(DeepSpeedParamGroupsKey, NamesTheStagesKey) {
  Checkpoint c;
  c.format = "deepspeed";
  for (int stage : {1, 2, 3}) {
    DeepSpeedSourceFacts facts;
    facts.zero_stage = stage;
    facts.optimizer_file = "o.pt";
    facts.tag = "t";
    c.facts = facts;
    EXPECT_EQ(DeepSpeedParamGroupsKey(c), stage == 3 ? "optimizer_state_dict.optimizer_state_dict.param_groups"
                                                     : "optimizer_state_dict.base_optimizer_state.param_groups")
        << stage;
  }
}

TEST(MakeTargetInput, NoItemIsDropped) {
  Source s;
  s.Tensor("model.w.weight", 4, 1.0f);
  s.Tensor("optimizer.state.w.weight.exp_avg", 4, 10.0f);
  s.Tensor("optimizer.state.w.weight.exp_avg_sq", 4, 20.0f);
  s.Blob("optimizer.state.w.weight.step", SaveValue::Int(7));
  s.Blob("optimizer.param_groups.0.lr", SaveValue::Float(0.01));
  s.Blob("optimizer.param_groups.0.betas", SaveValue::Tuple({SaveValue::Float(0.9), SaveValue::Float(0.95)}));
  s.Blob("optimizer.param_groups.0.params", SaveValue::List({SaveValue::Str("w.weight")}));
  s.Blob("optimizer.param_groups.1.lr", SaveValue::Float(0.5));  // a group that names no parameter
  s.Blob("dataloader.dp_rank_0", SaveValue::Bytes("state-of-rank-0"));
  s.Blob("dataloader.dp_rank_1", SaveValue::Bytes("state-of-rank-1"));
  SaveValue train = SaveValue::Dict();
  train.Set("step", SaveValue::Int(12));
  s.Blob("train_state", train);
  s.Blob("lr_scheduler", Marker());
  s.Tensor("rng_state", 3, 0.0f);  // a tensor matched by a known non-parameter rule
  s.ckpt.files = {{"__0_0.distcp", s.bytes.size(), 0}};

  // The scheduler blob becomes an arbitrary class instance: rename OrderedDict in its pickle.
  const std::string from = "collections\nOrderedDict", to = "torch.optim\nSchedulerX_";
  ASSERT_EQ(from.size(), to.size());
  const Item& sched = s.ckpt.items[11];
  auto* begin = reinterpret_cast<char*>(s.bytes.data()) + sched.byte_offset;
  auto hit = std::search(begin, begin + sched.n_bytes, from.begin(), from.end());
  ASSERT_NE(hit, begin + sched.n_bytes);
  std::copy(to.begin(), to.end(), hit);

  auto files = std::make_shared<std::vector<std::shared_ptr<const ByteSource>>>();
  files->push_back(std::make_shared<MemorySource>("__0_0.distcp", s.bytes));
  auto mapping = MapKeys(s.ckpt, {});
  ASSERT_TRUE(mapping.ok()) << mapping.error().ToString();
  std::vector<std::string> warnings;
  auto in = MakeTargetInput(s.ckpt, nullptr, *mapping, files, [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(in.ok()) << in.error().ToString();

  ASSERT_EQ((*in)->params.size(), 1u);
  const auto& p = (*in)->params[0];
  EXPECT_EQ(p.name, "w.weight");
  ASSERT_TRUE(p.step_value.has_value());
  EXPECT_EQ(*p.step_value, 7.0);
  ASSERT_EQ(p.hyper.size(), 2u);
  EXPECT_EQ(p.hyper[0].first, "lr");
  EXPECT_EQ(p.hyper[0].second.float_value(), 0.01);
  EXPECT_EQ(p.hyper[1].first, "betas");

  EXPECT_EQ(Keys(**in), (std::vector<std::string>{"dataloader.dp_rank_0", "dataloader.dp_rank_1", "train_state",
                                                  "rng_state"}));
  EXPECT_EQ((*in)->extras[1].dp_rank, 1);
  EXPECT_EQ((*in)->extras[1].group, "dataloader.dp_rank_*");
  EXPECT_EQ((*in)->extras[2].dp_rank, -1);
  ASSERT_EQ((*in)->not_served.size(), 2u);
  EXPECT_EQ((*in)->not_served[0].key, "lr_scheduler");
  EXPECT_NE((*in)->not_served[0].reason.find("torch.optim.SchedulerX_"), std::string::npos)
      << (*in)->not_served[0].reason;
  EXPECT_EQ((*in)->not_served[1].key, "optimizer.param_groups.1.lr");
  EXPECT_NE((*in)->not_served[1].reason.find("no 'params'"), std::string::npos) << (*in)->not_served[1].reason;
  EXPECT_EQ(warnings.size(), 2u);

  // dp2: each DP rank gets its own dataloader state; dp1 cannot place them and says so.
  for (int dp : {1, 2}) {
    auto layout = layout::ParseLayout("tp1_pp1_dp" + std::to_string(dp));
    ASSERT_TRUE(layout.ok());
    auto plan = views::TargetPlan::Make(*in, *layout);
    ASSERT_TRUE(plan.ok()) << plan.error().ToString();
    for (int rank = 0; rank < dp; ++rank) {
      auto rf = plan->Build(rank);
      ASSERT_TRUE(rf.ok()) << rf.error().ToString();
      ASSERT_TRUE(rf->extra);
      auto extra = format::TorchFile::Open(rf->extra);
      ASSERT_TRUE(extra.ok()) << extra.error().ToString();
      const auto& g = extra->graph();
      std::vector<std::string> keys;
      for (const auto& [k, v] : g.dict_items(g.root())) keys.emplace_back(g.text(k));
      std::vector<std::string> want = {"train_state", "rng_state"};
      if (dp == 2) want.insert(want.begin(), "dataloader.dp_rank_" + std::to_string(rank));
      EXPECT_EQ(keys, want) << "dp" << dp << " rank " << rank;
      if (dp == 2) {
        EXPECT_EQ(g.text(g.DictGet(g.root(), want[0])), "state-of-rank-" + std::to_string(rank));
      }
      ASSERT_EQ(extra->tensors().size(), 1u);  // rng_state, with the source's bytes
      std::vector<std::byte> rng(12);
      ASSERT_TRUE(rf->extra->ReadAt(extra->tensors()[0].data_offset, rng).ok());
      float first;
      std::memcpy(&first, rng.data() + 4, 4);
      EXPECT_EQ(first, 1.0f);

      // The step is torch's 0-d float32 tensor holding the stored int.
      auto optim = format::TorchFile::Open(rf->optim);
      ASSERT_TRUE(optim.ok()) << optim.error().ToString();
      auto step = std::find_if(optim->tensors().begin(), optim->tensors().end(),
                               [](const format::TensorRecord& t) { return t.key == "state.0.step"; });
      ASSERT_NE(step, optim->tensors().end());
      EXPECT_EQ(step->dtype, DType::kFloat32);
      EXPECT_TRUE(step->shape.empty());
      float value = 0;
      ASSERT_TRUE(rf->optim->ReadAt(step->data_offset, std::as_writable_bytes(std::span(&value, 1))).ok());
      EXPECT_EQ(value, 7.0f);

      std::vector<std::byte> info(rf->info->Size());
      ASSERT_TRUE(rf->info->ReadAt(0, info).ok());
      const std::string text(reinterpret_cast<const char*>(info.data()), info.size());
      EXPECT_NE(text.find("\"lr_scheduler\""), std::string::npos);
      EXPECT_EQ(text.find("\"key\": \"dataloader.dp_rank_1\"") != std::string::npos, dp == 1) << text;
    }
  }
}

// Megatron-Core torch_dist with the DistributedOptimizer: common.pt keeps the param groups
// without their parameters, and the step in them; each parameter gets its group by Megatron's
// weight-decay rule (1-D: wd_mult 0) and the step as its own. Groups that differ by more than
// weight decay cannot be matched: reported, the step still served.
TEST(MakeTargetInput, MegatronCoreParamGroupsFromCommonPt) {
  for (const bool matchable : {true, false}) {
    Source s;
    s.ckpt.format = "dcp";
    s.ckpt.flavor = "megatron-torch_dist";
    DcpSourceFacts facts;
    facts.megatron_core = true;
    s.ckpt.facts = facts;
    s.Tensor("w.weight", 4, 1.0f, {2, 2});
    s.Tensor("ln.weight", 2, 5.0f);
    for (const char* k : {"exp_avg", "exp_avg_sq"}) {
      s.Tensor(std::string("optimizer.state.") + k + ".w.weight", 4, 10.0f, {2, 2});
      s.Tensor(std::string("optimizer.state.") + k + ".ln.weight", 2, 20.0f);
    }
    SaveValue groups = SaveValue::List();
    for (const double wd_mult : {1.0, 0.0}) {
      SaveValue g = SaveValue::Dict();
      g.Set("wd_mult", SaveValue::Float(wd_mult));
      g.Set("lr_mult", SaveValue::Float(matchable || wd_mult == 1.0 ? 1.0 : 2.0));
      g.Set("lr", SaveValue::Float(0.01));
      g.Set("betas", SaveValue::Tuple({SaveValue::Float(0.9), SaveValue::Float(0.95)}));
      g.Set("weight_decay", SaveValue::Float(0.1));
      g.Set("step", SaveValue::Float(2.0));
      groups.Append(std::move(g));
    }
    SaveValue inner = SaveValue::Dict();
    inner.Set("param_groups", std::move(groups));
    SaveValue opt = SaveValue::Dict();
    opt.Set("optimizer", std::move(inner));
    SaveValue common = SaveValue::Dict();
    common.Set("optimizer", std::move(opt));
    s.Blob("common.pt", common);
    auto in = InputOf(s);
    ASSERT_TRUE(in.ok()) << in.error().ToString();
    ASSERT_EQ((*in)->params.size(), 2u);
    for (const auto& p : (*in)->params) {
      ASSERT_TRUE(p.step_value.has_value()) << p.name;
      EXPECT_EQ(*p.step_value, 2.0);
      if (!matchable) {
        EXPECT_TRUE(p.hyper.empty()) << p.name;
        continue;
      }
      std::vector<std::string> fields;
      for (const auto& [k, v] : p.hyper) fields.push_back(k);
      EXPECT_EQ(fields, (std::vector<std::string>{"wd_mult", "lr_mult", "lr", "betas", "weight_decay"})) << p.name;
      EXPECT_EQ(p.hyper[0].second.float_value(), p.name == "w.weight" ? 1.0 : 0.0) << p.name;
    }
    bool reported = false;
    for (const auto& n : (*in)->not_served) {
      reported |= n.key == "common.pt: optimizer param_groups" &&
                  n.reason.find("more than weight decay") != std::string::npos;
    }
    EXPECT_EQ(reported, !matchable);
  }
}

}  // namespace
}  // namespace ucpfs::index

namespace ucpfs::index {
namespace {

// torchtitan's FusedQKVLinear: weights saved split (wq/wk/wv, its state_dict hook), optimizer
// state under the fused parameter (wqkv). Found by structure: the fused state goes to optim.pt
// only, at the position of its split weights, which go to model.pt only; one param group.
TEST(MakeTargetInput, FusedOptimizerStateOfSplitWeights) {
  Source s;
  s.Tensor("tok.weight", 8, 0.0f, {4, 2});
  s.Tensor("attn.qkv.wq.weight", 4, 1.0f, {2, 2});
  s.Tensor("attn.qkv.wk.weight", 2, 5.0f, {1, 2});
  s.Tensor("attn.qkv.wv.weight", 2, 7.0f, {1, 2});
  s.Tensor("other.a.weight", 4, 0.0f, {2, 2});  // weight-only siblings whose rows do not add up
  s.Tensor("other.b.weight", 4, 0.0f, {2, 2});
  const std::pair<std::string, int64_t> states[] = {{"tok.weight", 4}, {"attn.qkv.wqkv.weight", 4}, {"other.ab.weight", 5}};
  for (const auto& [p, rows] : states) {
    const int n = static_cast<int>(rows * 2);
    s.Tensor("optimizer.state." + p + ".exp_avg", n, 10.0f, {rows, 2});
    s.Tensor("optimizer.state." + p + ".exp_avg_sq", n, 20.0f, {rows, 2});
    s.Blob("optimizer.param_groups." + p + ".lr", SaveValue::Float(0.01));
  }
  auto in = InputOf(s);
  ASSERT_TRUE(in.ok()) << in.error().ToString();

  ASSERT_EQ((*in)->fused.size(), 1u);
  EXPECT_EQ((*in)->fused[0].param, "attn.qkv.wqkv.weight");
  EXPECT_EQ((*in)->fused[0].stored_as,
            (std::vector<std::string>{"attn.qkv.wq.weight", "attn.qkv.wk.weight", "attn.qkv.wv.weight"}));
  std::vector<std::string> names;
  for (const auto& p : (*in)->params) names.push_back(p.name + (p.in_model ? "" : " -model") + (p.in_optimizer ? "" : " -optim"));
  // other.ab.weight's rows (5) are not other.a + other.b (4): not fused, its state reported.
  // Source order (of each parameter's first key), the split weights right after the fused one.
  EXPECT_EQ(names, (std::vector<std::string>{"tok.weight", "other.a.weight", "other.b.weight",
                                             "attn.qkv.wqkv.weight -model", "attn.qkv.wq.weight -optim",
                                             "attn.qkv.wk.weight -optim", "attn.qkv.wv.weight -optim"}));
  ASSERT_FALSE((*in)->not_served.empty());
  EXPECT_EQ((*in)->not_served[0].key, "optimizer.state.other.ab.weight.exp_avg");

  auto layout = layout::ParseLayout("tp1_pp1_dp1");
  ASSERT_TRUE(layout.ok());
  auto rank = views::BuildRankFiles(*in, *layout, 0);
  ASSERT_TRUE(rank.ok()) << rank.error().ToString();
  auto model = format::TorchFile::Open(rank->model);
  auto optim = format::TorchFile::Open(rank->optim);
  ASSERT_TRUE(model.ok() && optim.ok());
  std::vector<std::string> model_keys, optim_keys;
  for (const auto& t : model->tensors()) model_keys.push_back(t.key);
  for (const auto& t : optim->tensors()) optim_keys.push_back(t.key + (t.shape == std::vector<int64_t>{4, 2} ? "" : "?"));
  EXPECT_EQ(model_keys, (std::vector<std::string>{"tok.weight", "other.a.weight", "other.b.weight",
                                                  "attn.qkv.wq.weight", "attn.qkv.wk.weight", "attn.qkv.wv.weight"}));
  // Positions: 0 tok, 1 other.a, 2 other.b (weights with no state), 3 the fused wqkv; its split
  // weights take none.
  EXPECT_EQ(optim_keys, (std::vector<std::string>{"state.0.exp_avg", "state.0.exp_avg_sq", "state.3.exp_avg",
                                                  "state.3.exp_avg_sq"}));
}


// Atomic files are sized at once and built when opened: same-shaped parameters of different
// patterns (column- and row-parallel weights with a cat_dim, a replicated one without) and the
// steps (an int, a tensor): every built file has the size listed and the source's values, and
// the files' builders keep the checkpoint they refer to alive (`owner`).
TEST(BuildAtomicViews, SizedAtOnceBuiltOnOpenWithTheListedSize) {
  Source s;
  s.Tensor("layers.0.attention.wq.weight", 16, 1.0f, {4, 4});
  s.Tensor("layers.0.attention.wo.weight", 16, 100.0f, {4, 4});
  s.Tensor("layers.1.attention.wq.weight", 16, 200.0f, {4, 4});
  s.Tensor("layers.0.mixer.weight", 16, 300.0f, {4, 4});
  // 4-d, so that the vocabulary tensor's two keys move its data record by 64 bytes.
  s.Tensor("tok_embeddings.weight", 256, 800.0f, {4, 4, 4, 4});
  s.Tensor("layers.0.mixer.bias", 256, 900.0f, {4, 4, 4, 4});
  s.Tensor("norm.weight", 4, 400.0f);
  s.Tensor("optimizer.state.layers.0.attention.wq.weight.exp_avg", 16, 500.0f, {4, 4});
  s.Tensor("optimizer.state.layers.0.attention.wq.weight.exp_avg_sq", 16, 600.0f, {4, 4});
  s.Blob("optimizer.state.layers.0.attention.wq.weight.step", SaveValue::Int(3));
  s.Tensor("optimizer.state.norm.weight.step", 1, 7.0f, {});
  FileTable files = s.Files();
  auto ckpt = std::make_shared<Checkpoint>(s.ckpt);
  auto mapping = MapKeys(*ckpt, {});
  ASSERT_TRUE(mapping.ok()) << mapping.error().ToString();
  PatternOptions patterns;
  patterns.preset = layout::Preset::kTorchtitan;
  auto views = BuildAtomicViews(*ckpt, ckpt, *mapping, files, patterns);
  ASSERT_TRUE(views.ok()) << views.error().ToString();
  ckpt.reset();  // the views' builders hold it now

  std::map<std::string, uint64_t> sizes;
  std::map<std::string, float> first_value;
  std::map<std::string, bool> has_cat_dim;  // the pickle's 'cat_dim' key
  for (const auto& v : *views) {
    const std::string path = v.dir + "/" + v.file;
    auto source = v.build();
    ASSERT_TRUE(source.ok()) << path << ": " << source.error().ToString();
    EXPECT_EQ((*source)->Size(), v.n_bytes) << path;
    EXPECT_EQ((*source)->Name(), "atomic/" + path);
    sizes[path] = v.n_bytes;
    std::vector<std::byte> whole(v.n_bytes);
    ASSERT_TRUE((*source)->ReadAt(0, whole).ok());
    has_cat_dim[path] = std::string_view(reinterpret_cast<const char*>(whole.data()), whole.size()).find("cat_dim") !=
                        std::string_view::npos;
    auto f = format::TorchFile::Open(*source);
    ASSERT_TRUE(f.ok()) << path << ": " << f.error().ToString();
    for (const auto& t : f->tensors()) {
      if (t.n_elems == 0) continue;
      std::vector<std::byte> raw(t.n_bytes);
      ASSERT_TRUE((*source)->ReadAt(t.data_offset, raw).ok());
      float value = 0;
      std::memcpy(&value, raw.data(), 4);
      first_value[path] = value;
    }
  }
  EXPECT_EQ(first_value["layers.0.attention.wq.weight/fp32.pt"], 1.0f);
  EXPECT_EQ(first_value["layers.0.attention.wo.weight/fp32.pt"], 100.0f);
  EXPECT_EQ(first_value["layers.1.attention.wq.weight/fp32.pt"], 200.0f);
  EXPECT_EQ(first_value["layers.0.mixer.weight/fp32.pt"], 300.0f);
  EXPECT_EQ(first_value["norm.weight/fp32.pt"], 400.0f);
  EXPECT_EQ(first_value["layers.0.attention.wq.weight/exp_avg.pt"], 500.0f);
  EXPECT_EQ(first_value["layers.0.attention.wq.weight/exp_avg_sq.pt"], 600.0f);
  EXPECT_EQ(first_value["norm.weight/step.pt"], 7.0f);
  EXPECT_EQ(sizes.count("layers.0.attention.wq.weight/step.pt"), 1u);
  // The same shape with and without a cat_dim: different pickles, each file sized as built (above).
  EXPECT_TRUE(has_cat_dim["layers.0.attention.wq.weight/fp32.pt"]);
  EXPECT_TRUE(has_cat_dim["layers.0.attention.wo.weight/fp32.pt"]);
  EXPECT_FALSE(has_cat_dim["layers.0.mixer.weight/fp32.pt"]);
  EXPECT_EQ(sizes["layers.0.attention.wq.weight/fp32.pt"], sizes["layers.1.attention.wq.weight/fp32.pt"]);
  EXPECT_EQ(first_value["tok_embeddings.weight/fp32.pt"], 800.0f);
  EXPECT_EQ(first_value["layers.0.mixer.bias/fp32.pt"], 900.0f);
  EXPECT_TRUE(has_cat_dim["tok_embeddings.weight/fp32.pt"]);
  EXPECT_FALSE(has_cat_dim["layers.0.mixer.bias/fp32.pt"]);
  EXPECT_NE(sizes["tok_embeddings.weight/fp32.pt"], sizes["layers.0.mixer.bias/fp32.pt"]);
}


// With an owner, the target views' input and safetensors/ refer to the checkpoint's own tensor
// layouts (one copy in a mount) and keep the checkpoint alive; without one they copy them.
TEST(KeptLayout, TargetInputAndSafetensorsReferToTheCheckpointsLayouts) {
  Source s;
  s.Tensor("tok_embeddings.weight", 16, 1.0f, {4, 4});
  s.Tensor("norm.weight", 4, 20.0f);
  s.Tensor("optimizer.state.norm.weight.exp_avg", 4, 30.0f);
  FileTable files = s.Files();
  auto ckpt = std::make_shared<Checkpoint>(s.ckpt);
  auto mapping = MapKeys(*ckpt, {});
  ASSERT_TRUE(mapping.ok()) << mapping.error().ToString();
  std::set<const slice::TensorLayout*> own;
  for (const Item& it : ckpt->items) own.insert(&it.layout);

  auto kept = MakeTargetInput(*ckpt, ckpt, *mapping, files, nullptr);
  auto copied = MakeTargetInput(*ckpt, nullptr, *mapping, files, nullptr);
  ASSERT_TRUE(kept.ok() && copied.ok());
  size_t n_states = 0;
  for (size_t i = 0; i < (*kept)->params.size(); ++i) {
    for (size_t k = 0; k < (*kept)->params[i].states.size(); ++k) {
      const auto& a = (*kept)->params[i].states[k];
      const auto& b = (*copied)->params[i].states[k];
      ASSERT_EQ(a == nullptr, b == nullptr);
      if (a == nullptr) continue;
      ++n_states;
      EXPECT_EQ(own.count(a.get()), 1u) << (*kept)->params[i].name;
      EXPECT_EQ(own.count(b.get()), 0u) << (*copied)->params[i].name;
      EXPECT_EQ(a->shape, b->shape);
    }
  }
  EXPECT_EQ(n_states, 3u);

  PatternOptions patterns;
  patterns.preset = layout::Preset::kTorchtitan;
  auto shards = BuildSafetensorsView(*ckpt, ckpt, *mapping, files, patterns, kDefaultSafetensorsShardBytes);
  ASSERT_TRUE(shards.ok()) << shards.error().ToString();
  const std::weak_ptr<const Checkpoint> weak = ckpt;
  ckpt.reset();
  kept->reset();
  EXPECT_FALSE(weak.expired());  // the shard's tensors hold it
  // The shard's tensors read through the kept layouts: each one's first value as written.
  ASSERT_EQ(shards->size(), 2u);  // the shard and model.safetensors.index.json
  const ByteSource& shard = *(*shards)[0].source;
  std::vector<std::byte> whole(shard.Size());
  ASSERT_TRUE(shard.ReadAt(0, whole).ok());
  uint64_t header_n = 0;
  std::memcpy(&header_n, whole.data(), 8);
  ASSERT_LE(8 + header_n, whole.size());
  const auto header = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(whole.data()) + 8, header_n));
  const std::map<std::string, float> firsts = {{"tok_embeddings.weight", 1.0f}, {"norm.weight", 20.0f}};
  for (const auto& [name, first] : firsts) {
    ASSERT_TRUE(header.contains(name)) << name;
    float value = 0;
    std::memcpy(&value, whole.data() + 8 + header_n + header[name]["data_offsets"][0].get<uint64_t>(), 4);
    EXPECT_EQ(value, first) << name;
  }
  shards->clear();
  EXPECT_TRUE(weak.expired());
}

// The same in grouped-query form (2 key-value heads of 2 query heads, head_dim 1): with the head
// dimension given, atomic/ serves the fused moments under the split names, rows picked per
// key-value head as torchtitan's _split_qkv_on_save picks them ([q q k v] per group), and no
// atomic/<wqkv>; without it, each side keeps its own names and the note names the missing fact.
TEST(BuildAtomicViews, FusedMomentsSplitPerKeyValueHead) {
  Source s;
  s.Tensor("attn.qkv.wq.weight", 4, 1.0f, {4, 1});
  s.Tensor("attn.qkv.wk.weight", 2, 5.0f, {2, 1});
  s.Tensor("attn.qkv.wv.weight", 2, 7.0f, {2, 1});
  s.Tensor("optimizer.state.attn.qkv.wqkv.weight.exp_avg", 8, 10.0f, {8, 1});
  s.Tensor("optimizer.state.attn.qkv.wqkv.weight.exp_avg_sq", 8, 20.0f, {8, 1});
  s.Blob("optimizer.state.attn.qkv.wqkv.weight.step", SaveValue::Int(3));
  FileTable files = s.Files();
  auto mapping = MapKeys(s.ckpt, {});
  ASSERT_TRUE(mapping.ok()) << mapping.error().ToString();

  auto listing = [&](const layout::ModelInfo& facts) {
    PatternOptions o;
    o.model_facts = facts;
    auto views = BuildAtomicViews(s.ckpt, nullptr, *mapping, files, o);
    EXPECT_TRUE(views.ok()) << views.error().ToString();
    std::map<std::string, std::vector<float>> out;
    for (const auto& v : views.value()) {
      auto source = v.build();
      EXPECT_TRUE(source.ok()) << source.error().ToString();
      EXPECT_EQ((*source)->Size(), v.n_bytes);
      auto f = format::TorchFile::Open(*source);
      EXPECT_TRUE(f.ok()) << f.error().ToString();
      std::vector<float> values;
      for (const auto& t : f->tensors()) {
        if (t.key != "param") continue;
        values.resize(t.n_elems);
        std::vector<std::byte> raw(t.n_bytes);
        EXPECT_TRUE((*source)->ReadAt(t.data_offset, raw).ok());
        std::memcpy(values.data(), raw.data(), raw.size());
      }
      out[v.dir + "/" + v.file] = values;
    }
    return out;
  };

  const auto bare = listing({});
  EXPECT_EQ(bare.count("attn.qkv.wqkv.weight/exp_avg.pt"), 1u);
  EXPECT_EQ(bare.count("attn.qkv.wq.weight/exp_avg.pt"), 0u);
  auto in = MakeTargetInput(s.ckpt, nullptr, *mapping, files, nullptr);
  ASSERT_TRUE(in.ok());
  ASSERT_EQ((*in)->fused.size(), 1u);
  EXPECT_NE((*in)->fused[0].note.find("head_dim"), std::string::npos) << (*in)->fused[0].note;

  layout::ModelInfo facts;
  facts.head_dim = 1;
  const auto split = listing(facts);
  EXPECT_EQ(split.count("attn.qkv.wqkv.weight/exp_avg.pt"), 0u);
  EXPECT_EQ(split.at("attn.qkv.wq.weight/fp32.pt"), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(split.at("attn.qkv.wq.weight/exp_avg.pt"), (std::vector<float>{10, 11, 14, 15}));
  EXPECT_EQ(split.at("attn.qkv.wk.weight/exp_avg.pt"), (std::vector<float>{12, 16}));
  EXPECT_EQ(split.at("attn.qkv.wv.weight/exp_avg_sq.pt"), (std::vector<float>{23, 27}));
  EXPECT_EQ(split.count("attn.qkv.wv.weight/step.pt"), 1u);
  PatternOptions o;
  o.model_facts = facts;
  ApplyPatterns(**in, o, std::nullopt);
  EXPECT_NE((*in)->fused[0].note.find("2 key-value heads of 2 query heads, head_dim 1"), std::string::npos)
      << (*in)->fused[0].note;

  // The same from the heads alone; facts that disagree are named, and nothing is split.
  layout::ModelInfo heads;
  heads.num_attention_heads = 4;
  EXPECT_EQ(listing(heads), split);
  layout::ModelInfo wrong = heads;
  wrong.head_dim = 2;
  EXPECT_EQ(listing(wrong).count("attn.qkv.wqkv.weight/exp_avg.pt"), 1u);
  o.model_facts = wrong;
  ApplyPatterns(**in, o, std::nullopt);
  EXPECT_NE((*in)->fused[0].note.find("head_dim 2"), std::string::npos) << (*in)->fused[0].note;
}

}  // namespace
}  // namespace ucpfs::index
