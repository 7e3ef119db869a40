// Target views (views/target.h): rank files of a small in-memory Llama-like torchtitan
// checkpoint for a few layouts, read back with the project's own TorchFile reader and checked
// against a naive element-by-element slice of the global tensors: model.pt keys and order,
// local tensor bytes, optim.pt structure, ZeRO-1 partitions, ucp_info.json, and that building
// reads no tensor data.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "core/byte_source.h"
#include "core/format/torch_file.h"
#include "views/target.h"

namespace ucpfs::views {
namespace {

// Counts reads, so tests can prove that building a file reads no tensor data.
class CountingSource final : public ByteSource {
 public:
  CountingSource(std::string name, std::vector<std::byte> bytes, std::atomic<int>* reads)
      : inner_(std::move(name), std::move(bytes)), reads_(reads) {}
  uint64_t Size() const override { return inner_.Size(); }
  const std::string& Name() const override { return inner_.Name(); }
  Status ReadAt(uint64_t byte_offset, std::span<std::byte> out) const override {
    ++*reads_;
    return inner_.ReadAt(byte_offset, out);
  }

 private:
  MemorySource inner_;
  std::atomic<int>* reads_;
};

constexpr int kW = static_cast<int>(TargetState::kWeight);
constexpr int kStep = static_cast<int>(TargetState::kStep);

uint64_t Volume(const std::vector<int64_t>& s) {
  uint64_t v = 1;
  for (int64_t x : s) v *= static_cast<uint64_t>(x);
  return v;
}

// Global value of element e of state s of param p: exact in float32.
float Value(int s, size_t p, uint64_t e) { return static_cast<float>(s * 100000 + static_cast<int>(p) * 1000 + static_cast<int>(e)); }

struct Fixture {
  std::shared_ptr<TargetInput> input;
  std::atomic<int> reads{0};
};

std::unique_ptr<Fixture> MakeModel() {
  auto fx = std::make_unique<Fixture>();
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"tok_embeddings.weight", {8, 4}},
      {"layers.0.attention.wq.weight", {4, 4}},
      {"layers.0.attention.wo.weight", {4, 4}},
      {"layers.0.feed_forward.w1.weight", {6, 4}},
      {"layers.0.feed_forward.w2.weight", {4, 6}},
      {"layers.0.attention_norm.weight", {4}},
      {"layers.1.attention.wq.weight", {4, 4}},
      {"layers.1.attention.wo.weight", {4, 4}},
      {"layers.1.feed_forward.w1.weight", {6, 4}},
      {"layers.1.feed_forward.w2.weight", {4, 6}},
      {"layers.1.attention_norm.weight", {4}},
      {"norm.weight", {4}},
      {"output.weight", {8, 4}},
  };
  auto in = std::make_shared<TargetInput>();
  auto files = std::make_shared<std::vector<std::shared_ptr<const ByteSource>>>();
  for (size_t p = 0; p < shapes.size(); ++p) {
    TargetParam tp;
    tp.name = shapes[p].first;
    for (int s = 0; s < kNumTargetStates; ++s) {
      const std::vector<int64_t> shape = s == kStep ? std::vector<int64_t>{} : shapes[p].second;
      const uint64_t n = Volume(shape);
      std::vector<float> v(n);
      for (uint64_t e = 0; e < n; ++e) v[e] = s == kStep ? 7.0f : Value(s, p, e);
      std::vector<std::byte> bytes(n * 4);
      std::memcpy(bytes.data(), v.data(), bytes.size());
      const uint32_t file_id = static_cast<uint32_t>(files->size());
      files->push_back(std::make_shared<CountingSource>(tp.name + "." + std::to_string(s), std::move(bytes),
                                                        &fx->reads));
      auto l = std::make_shared<slice::TensorLayout>();
      l->shape = shape;
      slice::Fragment f;
      f.box.offsets.assign(shape.size(), 0);
      f.box.sizes = shape;
      f.flat_hi = n;
      f.file_id = file_id;
      l->fragments.push_back(f);
      tp.states[s] = l;
      tp.dtypes[s] = DType::kFloat32;
      tp.keys[s] = "key." + tp.name + "." + TargetStateName(static_cast<TargetState>(s));
    }
    const bool norm = tp.name.find("norm") != std::string::npos;
    using format::SaveValue;
    tp.hyper = {{"lr", SaveValue::Float(0.001)},
                {"betas", SaveValue::Tuple({SaveValue::Float(0.9), SaveValue::Float(0.95)})},
                {"weight_decay", SaveValue::Float(norm ? 0.0 : 0.1)},
                {"foreach", SaveValue::None()}};
    in->params.push_back(std::move(tp));
  }
  in->files = files;
  fx->input = in;
  return fx;
}

std::vector<float> ReadF32(const ByteSource& src, const format::TensorRecord& t) {
  std::vector<std::byte> b(t.n_bytes);
  Status s = src.ReadAt(t.data_offset, b);
  EXPECT_TRUE(s.ok()) << s.ToString();
  std::vector<float> v(b.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// Naive local tensor: pieces (global boxes) concatenated along cat_dim, zeros beyond.
std::vector<float> NaiveLocal(int s, size_t p, const std::vector<int64_t>& global_shape,
                              const std::vector<int64_t>& local_shape, int cat_dim,
                              const nlohmann::json& pieces) {
  const uint64_t n = Volume(local_shape);
  std::vector<float> out(n, 0.0f);
  for (uint64_t e = 0; e < n; ++e) {
    std::vector<int64_t> idx(local_shape.size());
    uint64_t r = e;
    for (size_t d = local_shape.size(); d-- > 0;) {
      idx[d] = static_cast<int64_t>(r % static_cast<uint64_t>(local_shape[d]));
      r /= static_cast<uint64_t>(local_shape[d]);
    }
    int64_t pos = local_shape.empty() ? 0 : idx[static_cast<size_t>(cat_dim)];
    for (const auto& piece : pieces) {
      auto off = piece["offsets"].get<std::vector<int64_t>>();
      auto sz = piece["sizes"].get<std::vector<int64_t>>();
      if (!local_shape.empty() && pos >= sz[static_cast<size_t>(cat_dim)]) {
        pos -= sz[static_cast<size_t>(cat_dim)];
        continue;
      }
      uint64_t g = 0;
      for (size_t d = 0; d < global_shape.size(); ++d) {
        int64_t gi = off[d] + (static_cast<int>(d) == cat_dim ? pos : idx[d]);
        g = g * static_cast<uint64_t>(global_shape[d]) + static_cast<uint64_t>(gi);
      }
      out[e] = Value(s, p, g);
      break;
    }
  }
  return out;
}

nlohmann::json InfoJson(const ByteSource& src) {
  std::string text(src.Size(), '\0');
  EXPECT_TRUE(src.ReadAt(0, std::as_writable_bytes(std::span<char>(text))).ok());
  return nlohmann::json::parse(text);
}

size_t ParamIndex(const TargetInput& in, const std::string& name) {
  for (size_t i = 0; i < in.params.size(); ++i) {
    if (in.params[i].name == name) return i;
  }
  ADD_FAILURE() << name;
  return 0;
}

int CatDimOf(const nlohmann::json& pieces, const std::vector<int64_t>& global_shape,
             const std::vector<int64_t>& local_shape) {
  // The dim where the local shape differs from the piece sizes, else 0.
  if (pieces.empty()) return 0;
  auto sz = pieces[0]["sizes"].get<std::vector<int64_t>>();
  for (size_t d = 0; d < local_shape.size(); ++d) {
    if (sz[d] != local_shape[d] || (pieces.size() == 1 && sz[d] != global_shape[d])) return static_cast<int>(d);
  }
  return 0;
}

struct Built {
  std::vector<RankFiles> ranks;
  layout::Layout layout;
};

Built BuildAll(Fixture& fx, const std::string& name) {
  Built b;
  auto l = layout::ParseLayout(name);
  EXPECT_TRUE(l.ok());
  b.layout = *l;
  auto plan = TargetPlan::Make(fx.input, *l);
  EXPECT_TRUE(plan.ok()) << plan.error().ToString();
  for (int r = 0; r < l->World(); ++r) {
    auto rf = plan->Build(r);
    EXPECT_TRUE(rf.ok()) << rf.error().ToString();
    b.ranks.push_back(*rf);
  }
  EXPECT_EQ(fx.reads.load(), 0) << "building read tensor data";
  return b;
}

// Checks every model.pt tensor against the naive slice described by ucp_info.json; returns the
// keys per rank.
std::vector<std::vector<std::string>> CheckModel(Fixture& fx, const Built& b) {
  std::vector<std::vector<std::string>> keys;
  for (const auto& rf : b.ranks) {
    auto info = InfoJson(*rf.info);
    auto tf = format::TorchFile::Open(rf.model);
    EXPECT_TRUE(tf.ok()) << tf.error().ToString();
    std::map<std::string, nlohmann::json> entries;
    for (const auto& t : info["tensors"]) {
      if (t["file"] == "model.pt") entries[t["key"].get<std::string>()] = t;
    }
    keys.emplace_back();
    size_t last = 0;
    for (const auto& t : tf->tensors()) {
      keys.back().push_back(t.key);
      EXPECT_EQ(t.dtype, DType::kFloat32);
      const auto& e = entries.at(t.key);
      const size_t p = ParamIndex(*fx.input, e["param"].get<std::string>());
      if (keys.back().size() > 1) {
        EXPECT_GT(p, last) << "model.pt not in source order";
      }
      last = p;
      auto gshape = e["global_shape"].get<std::vector<int64_t>>();
      const int cat = CatDimOf(e["pieces"], gshape, t.shape);
      EXPECT_EQ(ReadF32(*rf.model, t), NaiveLocal(kW, p, gshape, t.shape, cat, e["pieces"])) << t.key;
    }
  }
  return keys;
}

// The number of param_groups in a rank's optim.pt.
size_t GroupCount(const std::shared_ptr<const ByteSource>& optim) {
  auto opt = format::TorchFile::Open(optim);
  EXPECT_TRUE(opt.ok());
  if (!opt.ok()) return 0;
  const auto& g = opt->graph();
  return g.items(g.DictGet(g.root(), "param_groups")).size();
}

// Source groups with identical hyper-parameters (the Hugging Face Trainer's decay / no-decay
// groups with weight_decay 0) stay two groups: the framework's optimizer has two, and
// load_state_dict refuses another count. Without source groups, identical ones are one group.
TEST(TargetTest, IdenticalSourceGroupsStaySeparate) {
  auto fx = MakeModel();
  auto in = std::make_shared<TargetInput>(*fx->input);
  for (auto& p : in->params) {
    p.hyper = {{"lr", format::SaveValue::Float(0.001)}, {"weight_decay", format::SaveValue::Float(0.0)}};
    p.group = p.name.find("norm") != std::string::npos ? 1 : 0;
  }
  fx->input = in;
  EXPECT_EQ(GroupCount(BuildAll(*fx, "tp1_pp1_dp1").ranks[0].optim), 2u);
  for (auto& p : in->params) p.group = -1;
  EXPECT_EQ(GroupCount(BuildAll(*fx, "tp1_pp1_dp1").ranks[0].optim), 1u);
}

// optim.pt names what an Adam/AdamW needs and the source lacks, as "ucpfs_missing" beside
// 'state' and 'param_groups': the fixture's groups have no eps; then no step either.
std::vector<std::string> Missing(const std::shared_ptr<const ByteSource>& optim) {
  auto opt = format::TorchFile::Open(optim);
  EXPECT_TRUE(opt.ok());
  std::vector<std::string> out;
  if (!opt.ok()) return out;
  const auto& g = opt->graph();
  const pickle::NodeId list = g.DictGet(g.root(), "ucpfs_missing");
  if (g.kind(list) != pickle::Kind::kList) return out;
  for (pickle::NodeId n : g.items(list)) out.emplace_back(g.text(n));
  return out;
}

TEST(TargetTest, OptimNamesWhatTheSourceLacks) {
  auto fx = MakeModel();
  EXPECT_EQ(Missing(BuildAll(*fx, "tp2_pp1_dp1").ranks[1].optim), std::vector<std::string>{"eps"});
  auto in = std::make_shared<TargetInput>(*fx->input);
  for (auto& p : in->params) {
    p.states[kStep] = nullptr;
    p.hyper.emplace_back("eps", format::SaveValue::Float(1e-8));
  }
  fx->input = in;
  EXPECT_EQ(Missing(BuildAll(*fx, "tp1_pp1_dp1").ranks[0].optim), std::vector<std::string>{"step"});
}

TEST(TargetTest, Tp2SplitsColumnRowAndReplicates) {
  auto fx = MakeModel();
  auto b = BuildAll(*fx, "tp2_pp1_dp1");
  ASSERT_EQ(b.ranks.size(), 2u);
  const auto keys = CheckModel(*fx, b);
  ASSERT_EQ(keys[0].size(), fx->input->params.size());
  for (size_t i = 0; i < keys[0].size(); ++i) EXPECT_EQ(keys[0][i], fx->input->params[i].name);
  // wq: rows split; wo: columns split; norms replicated.
  auto tf = format::TorchFile::Open(b.ranks[1].model);
  ASSERT_TRUE(tf.ok());
  for (const auto& t : tf->tensors()) {
    if (t.key == "layers.0.attention.wq.weight") {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 4}));
      const size_t p = ParamIndex(*fx->input, t.key);
      EXPECT_EQ(ReadF32(*b.ranks[1].model, t)[0], Value(kW, p, 8));  // row 2, col 0
    }
    if (t.key == "layers.0.attention.wo.weight") {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{4, 2}));
      const size_t p = ParamIndex(*fx->input, t.key);
      EXPECT_EQ(ReadF32(*b.ranks[1].model, t)[0], Value(kW, p, 2));  // row 0, col 2
    }
    if (t.key == "norm.weight") {
      EXPECT_EQ(t.shape, (std::vector<int64_t>{4}));
    }
  }
  // optim.pt: state i for every model.pt position, step, exp_avg, param_groups.
  ASSERT_TRUE(b.ranks[0].optim);
  auto opt = format::TorchFile::Open(b.ranks[0].optim);
  ASSERT_TRUE(opt.ok()) << opt.error().ToString();
  std::map<std::string, format::TensorRecord> ot;
  for (const auto& t : opt->tensors()) ot[t.key] = t;
  for (size_t i = 0; i < keys[0].size(); ++i) {
    const std::string k = "state." + std::to_string(i);
    ASSERT_TRUE(ot.count(k + ".step")) << k;
    EXPECT_TRUE(ot.at(k + ".step").shape.empty());
    EXPECT_EQ(ReadF32(*b.ranks[0].optim, ot.at(k + ".step")), std::vector<float>{7.0f});
    ASSERT_TRUE(ot.count(k + ".exp_avg"));
    ASSERT_TRUE(ot.count(k + ".exp_avg_sq"));
    ASSERT_TRUE(ot.count("fp32." + keys[0][i]));
  }
  const auto& g = opt->graph();
  auto groups = g.DictGet(g.root(), "param_groups");
  ASSERT_EQ(g.kind(groups), pickle::Kind::kList);
  ASSERT_EQ(g.items(groups).size(), 2u);  // weight_decay 0.1 and 0.0
  size_t n_params = 0;
  for (auto grp : g.items(groups)) {
    auto params = g.items(g.DictGet(grp, "params"));
    auto names = g.items(g.DictGet(grp, "param_names"));
    ASSERT_EQ(params.size(), names.size());
    for (size_t j = 0; j < params.size(); ++j) {
      EXPECT_EQ(g.text(names[j]), keys[0][static_cast<size_t>(g.int_value(params[j]))]);
    }
    n_params += params.size();
    EXPECT_EQ(g.kind(g.DictGet(grp, "lr")), pickle::Kind::kFloat);
    EXPECT_EQ(g.items(g.DictGet(grp, "betas")).size(), 2u);
  }
  EXPECT_EQ(n_params, keys[0].size());
  // ucp_info.json.
  auto info = InfoJson(*b.ranks[1].info);
  EXPECT_EQ(info["layout"], "tp2_pp1_dp1");
  EXPECT_EQ(info["rank"], 1);
  EXPECT_EQ(info["coords"]["tp"], 1);
  EXPECT_EQ(info["coords"]["pp"], 0);
  bool saw_moment = false;
  for (const auto& t : info["tensors"]) {
    EXPECT_TRUE(t.contains("dtype") && t.contains("pattern") && t.contains("flat_range"));
    if (t["state"] == "exp_avg") {
      saw_moment = true;
      EXPECT_EQ(t["file"], "optim.pt");
      EXPECT_TRUE(t["flat_range"].is_null());
    }
  }
  EXPECT_TRUE(saw_moment);
  // Reads happened only now.
  EXPECT_GT(fx->reads.load(), 0);
}

TEST(TargetTest, Pp2SplitsLayersByStage) {
  auto fx = MakeModel();
  auto b = BuildAll(*fx, "tp1_pp2_dp1");
  const auto keys = CheckModel(*fx, b);
  ASSERT_EQ(keys.size(), 2u);
  const std::vector<std::string> first = {"tok_embeddings.weight",
                                          "layers.0.attention.wq.weight",
                                          "layers.0.attention.wo.weight",
                                          "layers.0.feed_forward.w1.weight",
                                          "layers.0.feed_forward.w2.weight",
                                          "layers.0.attention_norm.weight"};
  EXPECT_EQ(keys[0], first);
  ASSERT_FALSE(keys[1].empty());
  EXPECT_EQ(keys[1].front(), "layers.1.attention.wq.weight");
  EXPECT_EQ(keys[1].back(), "output.weight");
  EXPECT_EQ(keys[0].size() + keys[1].size(), fx->input->params.size());
}

TEST(TargetTest, Zero1PartitionsConcatenateToPaddedFlat) {
  auto fx = MakeModel();
  auto b = BuildAll(*fx, "tp2_pp1_dp2_zero1");
  ASSERT_EQ(b.ranks.size(), 4u);
  CheckModel(*fx, b);
  for (int tp = 0; tp < 2; ++tp) {
    // The naive flat: this TP rank's local fp32 masters in model.pt order.
    const RankFiles& r0 = b.ranks[static_cast<size_t>(layout::RankOf(b.layout, {tp, 0, 0, 0}))];
    auto tf = format::TorchFile::Open(r0.model);
    ASSERT_TRUE(tf.ok());
    auto info = InfoJson(*r0.info);
    std::map<std::string, nlohmann::json> entries;
    for (const auto& t : info["tensors"]) {
      if (t["file"] == "model.pt") entries[t["key"].get<std::string>()] = t;
    }
    std::vector<float> flat;
    for (const auto& t : tf->tensors()) {
      const auto& e = entries.at(t.key);
      const size_t p = ParamIndex(*fx->input, e["param"].get<std::string>());
      auto gshape = e["global_shape"].get<std::vector<int64_t>>();
      auto local = NaiveLocal(static_cast<int>(TargetState::kFp32), p, gshape, t.shape,
                              CatDimOf(e["pieces"], gshape, t.shape), e["pieces"]);
      flat.insert(flat.end(), local.begin(), local.end());
    }
    const size_t align = 4;  // 2 * dp
    flat.resize((flat.size() + align - 1) / align * align, 0.0f);
    std::vector<float> joined;
    for (int dp = 0; dp < 2; ++dp) {
      const RankFiles& r = b.ranks[static_cast<size_t>(layout::RankOf(b.layout, {tp, 0, dp, 0}))];
      ASSERT_TRUE(r.optim);
      auto opt = format::TorchFile::Open(r.optim);
      ASSERT_TRUE(opt.ok()) << opt.error().ToString();
      bool saw = false;
      for (const auto& t : opt->tensors()) {
        if (t.key == "fp32") {
          EXPECT_EQ(t.shape.size(), 1u);
          auto v = ReadF32(*r.optim, t);
          joined.insert(joined.end(), v.begin(), v.end());
          saw = true;
        }
        if (t.key == "step") {
          EXPECT_EQ(ReadF32(*r.optim, t), std::vector<float>{7.0f});
        }
      }
      EXPECT_TRUE(saw);
      auto rinfo = InfoJson(*r.info);
      for (const auto& t : rinfo["tensors"]) {
        if (t["file"] == "optim.pt" && t["key"] == "fp32") {
          EXPECT_TRUE(t["flat_range"].is_array());
        }
      }
    }
    EXPECT_EQ(joined, flat) << "tp " << tp;
  }
}

TEST(TargetTest, RefusesBadLayoutAndRank) {
  auto fx = MakeModel();
  auto l = layout::ParseLayout("tp1_pp3_dp1");  // 2 layers over 3 stages
  ASSERT_TRUE(l.ok());
  EXPECT_FALSE(TargetPlan::Make(fx->input, *l).ok());
  auto l2 = layout::ParseLayout("tp1_pp1_dp1");
  ASSERT_TRUE(l2.ok());
  auto plan = TargetPlan::Make(fx->input, *l2);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->Build(1).ok());
}

std::vector<std::byte> AllBytes(const ByteSource& src) {
  std::vector<std::byte> out(src.Size());
  EXPECT_TRUE(src.ReadAt(0, out).ok()) << src.Name();
  return out;
}

// A mount sizes every rank file when a layout is listed and builds it again, alone, when it is
// opened (views/target_kind.cc): a file built with any subset must equal the one built with all.
TEST(TargetTest, BuildsOnlyTheChosenFilesWithTheSameBytes) {
  auto fx = MakeModel();
  for (const char* name : {"tp2_pp1_dp2", "tp1_pp2_dp2_zero1"}) {
    auto l = layout::ParseLayout(name);
    ASSERT_TRUE(l.ok());
    auto plan = TargetPlan::Make(fx->input, *l);
    ASSERT_TRUE(plan.ok()) << plan.error().ToString();
    for (int r = 0; r < l->World(); ++r) {
      auto all = plan->Build(r);
      ASSERT_TRUE(all.ok()) << all.error().ToString();
      ASSERT_TRUE(all->model && all->model_safetensors && all->optim && all->info) << name << " rank " << r;
      auto only = [&](int which) {
        RankFileSet want{.model = which == 0, .model_safetensors = which == 1, .optim = which == 2,
                         .extra = which == 3, .info = which == 4};
        auto got = plan->Build(r, want);
        EXPECT_TRUE(got.ok()) << got.error().ToString();
        return *got;
      };
      const std::shared_ptr<const ByteSource> RankFiles::*members[] = {
          &RankFiles::model, &RankFiles::model_safetensors, &RankFiles::optim, &RankFiles::extra, &RankFiles::info};
      for (int which = 0; which < 5; ++which) {
        const RankFiles got = only(which);
        for (int other = 0; other < 5; ++other) {
          const auto& want_src = (*all).*members[other];
          const auto& got_src = got.*members[other];
          if (other != which || want_src == nullptr) {
            EXPECT_EQ(got_src, nullptr) << name << " rank " << r << " file " << other;
            continue;
          }
          ASSERT_NE(got_src, nullptr) << name << " rank " << r << " file " << other;
          EXPECT_EQ(AllBytes(*got_src), AllBytes(*want_src)) << name << " rank " << r << " " << want_src->Name();
        }
      }
    }
  }
}

// A mount sizes a DP replica's ucp_info.json from its group's first rank (views/target_kind.cc,
// AddLayoutRanks) when the replicas are alike: the size must be Build's, across digit counts.
TEST(TargetTest, ReplicaInfoBytesEqualBuilt) {
  auto fx = MakeModel();
  auto l = layout::ParseLayout("tp2_pp1_dp12");
  ASSERT_TRUE(l.ok());
  auto plan = TargetPlan::Make(fx->input, *l);
  ASSERT_TRUE(plan.ok()) << plan.error().ToString();
  ASSERT_TRUE(plan->ReplicasAlike());
  std::map<int, std::pair<int, uint64_t>> first;  // tp -> (rank, info bytes) of its first replica
  for (int r = 0; r < l->World(); ++r) {
    const auto c = layout::CoordsOf(*l, r);
    auto built = plan->Build(r, RankFileSet{.model = false, .model_safetensors = false, .optim = false,
                                            .extra = false, .info = true});
    ASSERT_TRUE(built.ok()) << built.error().ToString();
    const auto [it, is_first] = first.try_emplace(c.tp, r, built->info->Size());
    if (is_first) continue;
    const int first_dp = layout::CoordsOf(*l, it->second.first).dp;
    EXPECT_EQ(TargetPlan::ReplicaInfoBytes(it->second.second, it->second.first, first_dp, r, c.dp),
              built->info->Size()) << "rank " << r;
  }
  auto z = layout::ParseLayout("tp2_pp1_dp2_zero1");
  ASSERT_TRUE(z.ok());
  auto zplan = TargetPlan::Make(fx->input, *z);
  ASSERT_TRUE(zplan.ok());
  EXPECT_FALSE(zplan->ReplicasAlike());  // ZeRO partitions optim.pt over the DP ranks
}

}  // namespace
}  // namespace ucpfs::views
