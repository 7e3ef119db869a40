// ScanMegatronLegacy on small Megatron-LM legacy saves written at test time by torch 1.13
// (/usr/bin/python3, argparse.Namespace args, a tp2 pp2 GPT with SwiGLU, GQA-free fused QKV,
// padded vocabulary, tied embeddings and an FP32Optimizer state dict): every global tensor is
// gathered from its fragments and compared with the value the writer put at each global element;
// then a catalogue of broken saves checks codes and messages (each names the file). The real
// Megatron-Core producer is exercised by tests/e2e/megatron_legacy_test.py.
#include "index/megatron_scan.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/io/file_source.h"
#include "core/slice/slice.h"
#include "index/checkpoint_builder.h"
#include "index/scanner.h"

namespace ucpfs::index {
namespace {

namespace fs = std::filesystem;

constexpr const char* kPython = "/usr/bin/python3";

// Writes ROOT/<variant> (a save directory) for each VARIANT given: one python, one `import
// torch`, for every variant the tests use. Global tensor G of a parameter holds
// 1000 * (parameter number) + row-major index; each rank stores Megatron's slice of it.
constexpr const char* kWriter = R"PY(
import argparse, os, sys, torch
TP, PP, H, FFN, VOCAB, PADDED = 2, 2, 4, 4, 7, 8
def args(**kw):
    a = argparse.Namespace(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP, num_layers=2,
        hidden_size=H, num_attention_heads=2, group_query_attention=False, num_query_groups=None,
        kv_channels=2, ffn_hidden_size=FFN, padded_vocab_size=PADDED, make_vocab_size_divisible_by=2,
        vocab_size=VOCAB, swiglu=True, untie_embeddings_and_output_weights=False,
        use_distributed_optimizer=False, expert_model_parallel_size=1, num_experts=None)
    a.__dict__.update(kw)
    return a
# (name on its stage, global shape, split): split 0 / 1 = column / row, 's' = SwiGLU, None = replicated
LAYER = [("input_layernorm.weight", [H], None), ("self_attention.linear_qkv.weight", [3 * H, H], 0),
         ("self_attention.linear_proj.weight", [H, H], 1), ("mlp.linear_fc1.weight", [2 * FFN, H], 's'),
         ("mlp.linear_fc2.weight", [H, FFN], 1)]
STAGES = [[("embedding.word_embeddings.weight", [PADDED, H], 0)] + [("decoder.layers.0." + n, s, k) for n, s, k in LAYER],
          [("decoder.layers.0." + n, s, k) for n, s, k in LAYER] + [("decoder.final_layernorm.weight", [H], None),
                                                                   ("output_layer.weight", [PADDED, H], 0)]]
def glob(stage, name):
    return name.replace("layers.0.", "layers.%d." % stage) if name.startswith("decoder.layers") else name
NUMBER = {}
for s, params in enumerate(STAGES):
    for n, _, _ in params:
        g = "embedding.word_embeddings.weight" if n == "output_layer.weight" else glob(s, n)
        NUMBER.setdefault(g, len(NUMBER))
def full(g, shape):
    return (torch.arange(int(torch.tensor(shape).prod())) + 1000 * NUMBER[g]).float().view(shape)
def local(t, split, r):
    if split is None: return t.clone()
    if split == 's':
        a, b = t.chunk(2, 0)
        return torch.cat([a.chunk(TP, 0)[r], b.chunk(TP, 0)[r]]).clone()
    return t.chunk(TP, split)[r].clone()
def buffer_layout(params, s, bucket_size):
    # Megatron-Core's grad buffer (param_and_grad_buffer.py, read, not copied): reverse order,
    # starts padded to 64, a bucket closed at >= bucket_size elements, the tied embedding's copy
    # in a bucket of its own, bucket ends padded to 128 and stripped from the world tensors.
    shared = "embedding.word_embeddings.weight" if s == 0 else "output_layer.weight"
    st = {"start": 0, "bucket": 0, "before": 0, "n": 0}
    def close(end):
        st["before"] += end - st["bucket"]
        st["bucket"] = (end + 127) // 128 * 128
        st["n"] = 0
        return st["bucket"]
    offsets, end = {}, 0
    for n, numel in reversed(params):
        start = (st["start"] + 63) // 64 * 64
        if n == shared and st["n"]:
            start = close(start)
        offsets[n] = st["before"] + start - st["bucket"]
        end = start + numel
        st["n"] += 1
        st["start"] = close(end) if (bucket_size and end - st["bucket"] >= bucket_size) or n == shared else end
    if st["n"]:
        close(end)
    return offsets, st["before"]
def write(out, variant):
    it = os.path.join(out, "iter_0000003")
    for s in range(PP):
        for r in range(TP):
            model, state, groups = {}, {}, [[], []]
            for n, shape, split in STAGES[s]:
                g = "embedding.word_embeddings.weight" if n == "output_layer.weight" else glob(s, n)
                t = local(full(g, shape), split, r)
                if variant == "shape" and r == 1 and n.endswith("linear_fc2.weight"):
                    t = torch.zeros(H, FFN // TP + 1)
                model[n] = t
                model[n.rsplit(".", 1)[0] + "._extra_state"] = None
                i = len(state)
                state[i] = {"exp_avg": t * 2, "exp_avg_sq": t * 3, "step": torch.tensor(3.0)}
                groups[1 if t.dim() == 1 else 0].append(i)
            a = args()
            if variant == "tp0": a.tensor_model_parallel_size = 0
            if variant == "tphuge": a.tensor_model_parallel_size = 1 << 40
            if variant == "moe": a.num_experts = 8
            if variant == "mismatch" and (s, r) == (1, 1): a.hidden_size = 8
            if variant == "layers": a.num_layers = 4
            if variant in ("nulltok", "nulltok_over"): a.tokenizer_type = "NullTokenizer"
            if variant == "nulltok_over": a.vocab_size = PADDED
            opt = {"state": state, "param_groups": [
                {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "lr": 0.1, "params": groups[0]},
                {"wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False, "lr": 0.1, "params": groups[1]}]}
            d = os.path.join(it, "mp_rank_%02d_%03d" % (r, s))
            os.makedirs(d, exist_ok=True)
            if variant.startswith("do"):  # the distributed optimizer: distrib_optim.pt
                a.use_distributed_optimizer = True
                if variant == "do_buckets": a.overlap_grad_reduce, a.ddp_bucket_size = True, 40
                for g in opt["param_groups"]:
                    del g["params"]
                    g["step"] = 3.0
                opt = {"optimizer": {"param_groups": opt["param_groups"]}}
                offsets, numel = buffer_layout([(n, model[n].numel()) for n, _, _ in STAGES[s]], s,
                                               40 if variant == "do_buckets" and s == 0 else None)
                if variant == "do_numel": numel += 64  # consistent sizes, but not Megatron's layout
                world = torch.zeros(numel)
                for n, _, _ in STAGES[s]:
                    world[offsets[n]:offsets[n] + model[n].numel()] = model[n].flatten()
                key = (torch.bfloat16 if variant == "do_dtype" else torch.float32, torch.float32)
                buf = {"param": world, "exp_avg": world * 2, "exp_avg_sq": world * 3, "numel_unpadded": numel}
                if variant == "do_trunc": buf["exp_avg"] = buf["exp_avg"][:-1].clone()
                do = {"buckets_coalesced": True, 0: {key: buf}}
                if variant == "do_nogbuf": do = {"buckets_coalesced": True}
                if variant == "do_lists": do = {0: {key: [buf]}}
                torch.save(do, os.path.join(d, "distrib_optim.pt"))
            sd = {"args": a, "checkpoint_version": 2.0 if variant == "version2" else 3.0, "iteration": 3,
                  "model": model, "optimizer": opt, "rng_state": [{"torch_rng_state": torch.get_rng_state()}]}
            if variant == "noargs": del sd["args"]
            torch.save(sd, os.path.join(d, "model_optim_rng.pt"))
    open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w").write("3\n")
root = sys.argv[1]
for v in sys.argv[2:]:
    write(os.path.join(root, v), v)
)PY";

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

class MegatronScanTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) return;
    std::string tmpl = (fs::temp_directory_path() / "ucpfs-megatron-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return;
    root_ = new fs::path(tmpl);
    std::ofstream(*root_ / "writer.py") << kWriter;
  }
  static void TearDownTestSuite() {
    if (root_ != nullptr && std::getenv("UCPFS_KEEP_FIXTURES") == nullptr) fs::remove_all(*root_);
    delete root_;
    root_ = nullptr;
  }
  void SetUp() override {
    if (root_ == nullptr) GTEST_SKIP() << "torch 1.13 at /usr/bin/python3 is needed";
  }
  // A save directory written for `variant`. The first call writes every variant at once
  // (starting python and importing torch per variant took minutes on a loaded 2-core machine).
  static fs::path Save(const std::string& variant) {
    static const char* const kVariants[] = {"good", "do", "do_buckets", "do_dtype", "do_lists", "do_nogbuf",
                                            "do_numel", "do_trunc", "layers", "mismatch", "moe", "noargs", "nulltok", "nulltok_over",
                                            "shape", "tp0", "tphuge", "version2"};
    const fs::path dir = *root_ / variant;
    if (!fs::exists(dir)) {
      std::string cmd = std::string(kPython) + " " + Quote((*root_ / "writer.py").string()) + " " +
                        Quote(root_->string());
      for (const char* v : kVariants) {
        if (!fs::exists(*root_ / v)) cmd += std::string(" ") + v;
      }
      if (!fs::exists(dir) && cmd.find(" " + variant) == std::string::npos) cmd += " " + Quote(variant);
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    return dir;
  }
  // A copy of the good save to break.
  static fs::path Copy(const std::string& name) {
    const fs::path dir = *root_ / ("copy-" + name);
    fs::remove_all(dir);
    fs::copy(Save("good"), dir, fs::copy_options::recursive);
    return dir;
  }
  static inline fs::path* root_ = nullptr;
};

std::vector<float> Gather(const Checkpoint& c, const Item& item, const std::string& dir) {
  std::vector<std::shared_ptr<const ByteSource>> files;
  for (const SourceFile& f : c.files) {
    auto src = FileSource::Open(dir + "/" + f.rel_path);
    EXPECT_TRUE(src.ok()) << src.error().message();
    files.push_back(std::move(*src));
  }
  std::vector<float> out(item.layout.NumElems());
  Status s = slice::ReadTensorBytes(item.layout, DType::kFloat32, files, 0,
                                    std::as_writable_bytes(std::span(out.data(), out.size())));
  EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

TEST_F(MegatronScanTest, GlobalTensorsFromEveryRank) {
  const fs::path dir = Save("good");
  ASSERT_TRUE(IsMegatronLegacyDirectory(LocalTree(dir.string())));
  auto scanner = ScannerFor(LocalTree(dir.string()));
  ASSERT_TRUE(scanner.ok());
  EXPECT_EQ((*scanner)->Name(), "megatron");
  auto c = ScanMegatronLegacy(LocalTree(dir.string()));
  ASSERT_TRUE(c.ok()) << c.error().message();
  EXPECT_EQ(c->format, "megatron");
  EXPECT_EQ(c->flavor, "megatron-lm-legacy tp2 pp2 iter_0000003");
  std::map<std::string, const Item*> items;
  for (const Item& it : c->items) items[it.key] = &it;
  // The parameters' numbers as the writer gives them: stage 0, then stage 1's new names.
  const std::vector<std::pair<std::string, std::vector<int64_t>>> params = {
      {"embedding.word_embeddings.weight", {8, 4}},       {"decoder.layers.0.input_layernorm.weight", {4}},
      {"decoder.layers.0.self_attention.linear_qkv.weight", {12, 4}},
      {"decoder.layers.0.self_attention.linear_proj.weight", {4, 4}},
      {"decoder.layers.0.mlp.linear_fc1.weight", {8, 4}}, {"decoder.layers.0.mlp.linear_fc2.weight", {4, 4}},
      {"decoder.layers.1.input_layernorm.weight", {4}},
      {"decoder.layers.1.self_attention.linear_qkv.weight", {12, 4}},
      {"decoder.layers.1.self_attention.linear_proj.weight", {4, 4}},
      {"decoder.layers.1.mlp.linear_fc1.weight", {8, 4}}, {"decoder.layers.1.mlp.linear_fc2.weight", {4, 4}},
      {"decoder.final_layernorm.weight", {4}}};
  EXPECT_EQ(items.count("output_layer.weight"), 0u) << "the tied copy of the last stage is not read";
  for (size_t n = 0; n < params.size(); ++n) {
    const auto& [name, shape] = params[n];
    for (const auto& [key, factor] : std::vector<std::pair<std::string, float>>{
             {name, 1.0f}, {"optimizer.state." + name + ".exp_avg", 2.0f}, {"optimizer.state." + name + ".exp_avg_sq", 3.0f}}) {
      ASSERT_EQ(items.count(key), 1u) << key;
      EXPECT_EQ(items[key]->layout.shape, shape) << key;
      const std::vector<float> got = Gather(*c, *items[key], dir.string());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], factor * static_cast<float>(1000 * n + i)) << key << " element " << i;
      }
    }
    EXPECT_EQ(items.count("optimizer.state." + name + ".step"), 1u) << name;
    EXPECT_EQ(items.count("optimizer.state." + name + ".fp32_param"), 0u) << "fp32 parameters are their own master";
  }
  auto facts = MegatronModelFacts(*c);
  ASSERT_TRUE(facts.ok());
  EXPECT_EQ(facts->vocab_size, 7);
  EXPECT_EQ(facts->vocab_pad_multiple, 2);
  EXPECT_EQ(facts->num_query_groups, 2);
  EXPECT_EQ(facts->gated_linear_unit, true);
}

// Tp rank 1's copies of the replicated layer norms (and their moments) are not read but kept
// for `ucpfs verify`:
// equal to rank 0's in the writer's save; one changed float is reported, naming its file.
TEST_F(MegatronScanTest, TpReplicatedCopiesAreCompared) {
  auto open_all = [](const Checkpoint& c, const fs::path& dir) {
    std::vector<std::shared_ptr<const ByteSource>> files;
    for (const SourceFile& f : c.files) {
      auto src = FileSource::Open((dir / f.rel_path).string());
      EXPECT_TRUE(src.ok()) << src.error().message();
      files.push_back(std::move(*src));
    }
    return files;
  };
  const fs::path good = Save("good");
  auto c = ScanMegatronLegacy(LocalTree(good.string()));
  ASSERT_TRUE(c.ok()) << c.error().message();
  std::set<std::string> keys;
  for (const Item& r : c->replicas) keys.insert(r.key);
  std::set<std::string> want;
  for (const char* name : {"decoder.layers.0.input_layernorm.weight", "decoder.layers.1.input_layernorm.weight",
                           "decoder.final_layernorm.weight"}) {
    for (const std::string suffix : {"", ".exp_avg", ".exp_avg_sq"}) {
      want.insert(suffix.empty() ? std::string(name) : "optimizer.state." + std::string(name) + suffix);
    }
  }
  EXPECT_EQ(keys, want) << "the norms and their Adam moments, as tp rank 1 stores them";
  uint64_t compared = 0;
  EXPECT_TRUE(CheckTpReplicas(*c, open_all(*c, good), &compared).empty());
  EXPECT_EQ(compared, c->replicas.size());

  // Change the first float of one copy in a copy of the save.
  const Item& victim = c->replicas.front();
  ASSERT_EQ(victim.layout.fragments.size(), 1u);
  const slice::Fragment& f = victim.layout.fragments.front();
  const std::string rel = c->files.at(f.file_id).rel_path;
  const fs::path broken = Copy("replica");
  {
    std::fstream file(broken / rel, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(f.byte_offset));
    const float other = 12345.0f;
    file.write(reinterpret_cast<const char*>(&other), sizeof(other));
  }
  auto b = ScanMegatronLegacy(LocalTree(broken.string()));
  ASSERT_TRUE(b.ok()) << "the scan itself does not read the copies: " << b.error().message();
  const std::vector<Status> problems = CheckTpReplicas(*b, open_all(*b, broken));
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].code(), StatusCode::kCorrupt);
  EXPECT_NE(problems[0].message().find(rel), std::string::npos) << problems[0].message();
  EXPECT_NE(problems[0].message().find(victim.key), std::string::npos) << problems[0].message();
}

// Expects `code` and every fragment of `needles` in the message.
void ExpectError(const Result<Checkpoint>& r, StatusCode code, const std::vector<std::string>& needles) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), code) << r.error().message();
  for (const std::string& n : needles) EXPECT_NE(r.error().message().find(n), std::string::npos) << r.error().message();
}

// Megatron-LM's NullTokenizer has args.vocab_size + 1 tokens (its EOD id is vocab_size): that is the
// vocabulary the views pad from and strip to; one past padded_vocab_size is corrupt.
TEST_F(MegatronScanTest, NullTokenizerAddsItsEodRow) {
  EXPECT_EQ(MegatronTokenizerVocab(7, "NullTokenizer"), 8);
  EXPECT_EQ(MegatronTokenizerVocab(7, "GPT2BPETokenizer"), 7);
  EXPECT_EQ(MegatronTokenizerVocab(0, "NullTokenizer"), 0) << "an unknown vocabulary stays unknown";
  auto c = ScanMegatronLegacy(LocalTree(Save("nulltok").string()));
  ASSERT_TRUE(c.ok()) << c.error().message();
  auto facts = MegatronModelFacts(*c);
  ASSERT_TRUE(facts.ok());
  EXPECT_EQ(facts->vocab_size, 8);
  ExpectError(ScanMegatronLegacy(LocalTree(Save("nulltok_over").string())), StatusCode::kCorrupt,
              {"model_optim_rng.pt", "exceeds padded_vocab_size 8"});
}

TEST_F(MegatronScanTest, BadArgs) {
  ExpectError(ScanMegatronLegacy(LocalTree(Save("noargs").string())), StatusCode::kCorrupt,
              {"mp_rank_00_000/model_optim_rng.pt", "no 'args'"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("tp0").string())), StatusCode::kCorrupt, {"tensor_model_parallel_size = 0"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("tphuge").string())), StatusCode::kCorrupt,
              {"model_optim_rng.pt", "tensor_model_parallel_size = 1099511627776 is out of range"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("moe").string())), StatusCode::kUnsupported, {"mixture-of-experts"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("version2").string())), StatusCode::kUnsupported, {"checkpoint_version 2"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("mismatch").string())), StatusCode::kCorrupt,
              {"mp_rank_01_001/model_optim_rng.pt", "differ from rank 0's"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("layers").string())), StatusCode::kCorrupt,
              {"mp_rank_00_000/model_optim_rng.pt", "args give it 2"});
}

TEST_F(MegatronScanTest, ShapesThatDoNotMakeOneTensor) {
  ExpectError(ScanMegatronLegacy(LocalTree(Save("shape").string())), StatusCode::kCorrupt,
              {"mp_rank_01_000/model_optim_rng.pt", "linear_fc2.weight"});
}

TEST_F(MegatronScanTest, MissingRankAndTruncatedFile) {
  fs::path d = Copy("missing");
  fs::remove_all(d / "iter_0000003" / "mp_rank_01_001");
  ExpectError(ScanMegatronLegacy(LocalTree(d.string())), StatusCode::kCorrupt, {"mp_rank_01_001", "is missing"});

  d = Copy("nofile");
  fs::remove(d / "iter_0000003" / "mp_rank_01_000" / "model_optim_rng.pt");
  ExpectError(ScanMegatronLegacy(LocalTree(d.string())), StatusCode::kCorrupt, {"mp_rank_01_000/model_optim_rng.pt", "missing"});

  d = Copy("truncated");
  const fs::path f = d / "iter_0000003" / "mp_rank_01_000" / "model_optim_rng.pt";
  fs::resize_file(f, fs::file_size(f) / 2);
  auto r = ScanMegatronLegacy(LocalTree(d.string()));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("mp_rank_01_000/model_optim_rng.pt"), std::string::npos) << r.error().message();

  d = Copy("extra");
  fs::create_directory(d / "iter_0000003" / "mp_rank_02_000");
  ExpectError(ScanMegatronLegacy(LocalTree(d.string())), StatusCode::kCorrupt, {"mp_rank_02_000", "beyond args' tp 2"});
}

TEST_F(MegatronScanTest, TrackerFile) {
  fs::path d = Copy("nowhere");
  std::ofstream(d / "latest_checkpointed_iteration.txt") << "7";
  ExpectError(ScanMegatronLegacy(LocalTree(d.string())), StatusCode::kCorrupt,
              {"latest_checkpointed_iteration.txt", "iteration 7", "iter_0000007"});

  d = Copy("garbage");
  std::ofstream(d / "latest_checkpointed_iteration.txt") << "../etc";
  ExpectError(ScanMegatronLegacy(LocalTree(d.string())), StatusCode::kCorrupt,
              {"latest_checkpointed_iteration.txt", "neither an iteration number nor 'release'"});

  d = Copy("symlink");
  fs::rename(d / "iter_0000003", d / "elsewhere");
  fs::create_directory_symlink("elsewhere", d / "iter_0000003");
  ExpectError(ScanMegatronLegacy(LocalTree(d.string())), StatusCode::kCorrupt, {"iter_0000003", "symlink"});

  d = Copy("huge");
  std::ofstream(d / "latest_checkpointed_iteration.txt") << std::string(100, '1');
  ExpectError(ScanMegatronLegacy(LocalTree(d.string())), StatusCode::kCorrupt, {"latest_checkpointed_iteration.txt", "100 bytes"});

  // Without a tracker, the iteration directory itself is a checkpoint.
  auto c = ScanMegatronLegacy(LocalTree((Save("good") / "iter_0000003").string()));
  ASSERT_TRUE(c.ok()) << c.error().message();
  EXPECT_FALSE(c->items.empty());
}

// The distributed optimizer's distrib_optim.pt: fp32 parameters (their own masters), Adam
// moments at Megatron-Core's grad-buffer offsets, placed in the global tensors like the weights;
// with one bucket per stage and with small buckets (overlap_grad_reduce, ddp_bucket_size).
TEST_F(MegatronScanTest, DistributedOptimizer) {
  for (const std::string variant : {"do", "do_buckets"}) {
    const fs::path dir = Save(variant);
    auto c = ScanMegatronLegacy(LocalTree(dir.string()));
    ASSERT_TRUE(c.ok()) << variant << ": " << c.error().message();
    EXPECT_EQ(c->flavor, "megatron-lm-legacy tp2 pp2 distributed-optimizer iter_0000003");
    EXPECT_EQ(MegatronOptimizerStep(*c), 3.0);
    std::map<std::string, const Item*> items;
    for (const Item& it : c->items) items[it.key] = &it;
    const std::vector<std::string> names = {"embedding.word_embeddings.weight",
                                            "decoder.layers.0.input_layernorm.weight",
                                            "decoder.layers.0.self_attention.linear_qkv.weight",
                                            "decoder.layers.0.self_attention.linear_proj.weight",
                                            "decoder.layers.0.mlp.linear_fc1.weight",
                                            "decoder.layers.0.mlp.linear_fc2.weight",
                                            "decoder.layers.1.input_layernorm.weight",
                                            "decoder.layers.1.self_attention.linear_qkv.weight",
                                            "decoder.layers.1.self_attention.linear_proj.weight",
                                            "decoder.layers.1.mlp.linear_fc1.weight",
                                            "decoder.layers.1.mlp.linear_fc2.weight",
                                            "decoder.final_layernorm.weight"};
    EXPECT_EQ(items.count("optimizer.state.output_layer.weight.exp_avg"), 0u);
    for (size_t n = 0; n < names.size(); ++n) {
      for (const auto& [suffix, factor] : std::vector<std::pair<std::string, float>>{{".exp_avg", 2.0f}, {".exp_avg_sq", 3.0f}}) {
        const std::string key = "optimizer.state." + names[n] + suffix;
        ASSERT_EQ(items.count(key), 1u) << variant << " " << key;
        EXPECT_EQ(items[key]->layout.shape, items[names[n]]->layout.shape) << key;
        const std::vector<float> got = Gather(*c, *items[key], dir.string());
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], factor * static_cast<float>(1000 * n + i)) << variant << " " << key << " element " << i;
        }
      }
      EXPECT_EQ(items.count("optimizer.state." + names[n] + ".fp32_param"), 0u) << "fp32 parameters are their own master";
    }
  }
}

TEST_F(MegatronScanTest, BrokenDistributedOptimizerFiles) {
  ExpectError(ScanMegatronLegacy(LocalTree(Save("do_numel").string())), StatusCode::kCorrupt,
              {"mp_rank_00_000/distrib_optim.pt", "numel_unpadded is 400", "take 336 elements"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("do_trunc").string())), StatusCode::kCorrupt,
              {"mp_rank_00_000/distrib_optim.pt", "'exp_avg' of grad buffer 0", "not a contiguous float32 vector"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("do_nogbuf").string())), StatusCode::kCorrupt,
              {"mp_rank_00_000/distrib_optim.pt", "grad buffer 0 is missing"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("do_dtype").string())), StatusCode::kCorrupt,
              {"mp_rank_00_000/distrib_optim.pt", "bfloat16 parameters, the model's are float32"});
  ExpectError(ScanMegatronLegacy(LocalTree(Save("do_lists").string())), StatusCode::kUnsupported,
              {"mp_rank_00_000/distrib_optim.pt", "buckets_coalesced"});

  const fs::path d = *root_ / "do-missing";
  fs::remove_all(d);
  fs::copy(Save("do"), d, fs::copy_options::recursive);
  fs::remove(d / "iter_0000003" / "mp_rank_01_001" / "distrib_optim.pt");
  ExpectError(ScanMegatronLegacy(LocalTree(d.string())), StatusCode::kCorrupt, {"mp_rank_01_001/distrib_optim.pt", "missing"});

  // A file cut short: the archive no longer holds what its directory says.
  const fs::path t = *root_ / "do-short";
  fs::remove_all(t);
  fs::copy(Save("do"), t, fs::copy_options::recursive);
  const fs::path f = t / "iter_0000003" / "mp_rank_01_000" / "distrib_optim.pt";
  fs::resize_file(f, fs::file_size(f) - 100);
  auto r = ScanMegatronLegacy(LocalTree(t.string()));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("mp_rank_01_000/distrib_optim.pt"), std::string::npos) << r.error().message();
}

}  // namespace
}  // namespace ucpfs::index
