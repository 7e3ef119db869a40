// ScanDcp on real and synthetic DCP checkpoints generated at test time:
//   tests/e2e/fixtures/gen_dcp113_llama.py  real torch 1.13 gloo saves (3 and 4 ranks)
//   tests/e2e/fixtures/gen_dcp2x.py         torch-free 2.x-style, rank-local and Megatron
//                                            torch_dist directories plus corrupt variants
// Every tensor is gathered from its fragments twice — by a naive element-by-element oracle that
// also checks exact-once coverage, and by slice::ReadTensorBytes — and compared bit for bit with
// the generator's expected_raw/<key>.bin. Then a catalogue of broken directories checks codes and
// messages, and a seeded corruption loop checks that damaged files never crash the scanner.
// Fixtures are generated once per process into a temp dir (kept when UCPFS_KEEP_FIXTURES is set).
#include "index/dcp_scan.h"
#include "index/run_dir.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "core/io/file_source.h"
#include "core/slice/slice.h"
#include "index/dcp_metadata.h"

namespace ucpfs::index {
namespace {

namespace fs = std::filesystem;

constexpr const char* kPython = "/usr/bin/python3";

fs::path FixtureScripts() {
  if (const char* env = std::getenv("UCPFS_TEST_DATA"); env != nullptr && *env != '\0') {
    return fs::path(env).parent_path() / "e2e" / "fixtures";
  }
  return fs::path(__FILE__).parent_path().parent_path() / "e2e" / "fixtures";
}

// Single-quoted for /bin/sh.
std::string Quote(const fs::path& p) {
  std::string out = "'";
  for (char ch : p.string()) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// gen_dcp2x.py --variant all writes OUTDIR and OUTDIR_<variant> siblings.
fs::path Sibling(const fs::path& dir, const std::string& suffix) {
  return dir.parent_path() / (dir.filename().string() + "_" + suffix);
}

std::vector<std::byte> ReadWhole(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  if (!c.empty()) std::memcpy(out.data(), c.data(), c.size());
  return out;
}

// Generated fixtures, made on first use and removed at exit.
class Fixtures {
 public:
  static Fixtures& Get() {
    static Fixtures f;
    return f;
  }

  // gen_dcp2x.py --variant all: the 2.x directory; siblings via Sibling() (empty on failure).
  const fs::path& X2() {
    if (!x2_tried_) {
      x2_tried_ = true;
      x2_ = root_ / "x2";
      if (!Run(std::string(kPython) + " " + Quote(FixtureScripts() / "gen_dcp2x.py") + " " +
                   Quote(x2_) + " --variant all",
               "gen_dcp2x")) {
        x2_.clear();
      }
    }
    return x2_;
  }

  // A torch 1.13 save: directory and expected stem (…_expected.pt without extension).
  struct D113 {
    fs::path dir;
    fs::path expected_stem;
  };
  const D113* Torch113(int ranks, bool single_file, int seed) {
    const std::string name = "d113_r" + std::to_string(ranks) +
                             (single_file ? "_single" : "_multi") + "_s" + std::to_string(seed);
    if (auto it = d113_.find(name); it != d113_.end())
      return it->second.dir.empty() ? nullptr : &it->second;
    D113& d = d113_[name];
    if (!HaveTorch()) return nullptr;
    const fs::path dir = root_ / name;
    const fs::path expected = root_ / (name + "_expected.pt");
    if (Run(std::string(kPython) + " " + Quote(FixtureScripts() / "gen_dcp113_llama.py") + " " +
                Quote(dir) + " --ranks " + std::to_string(ranks) + " --seed " +
                std::to_string(seed) + " --single-file-per-rank " + (single_file ? "1" : "0") +
                " --expected " + Quote(expected),
            name)) {
      d.dir = dir;
      d.expected_stem = root_ / (name + "_expected");
    }
    return d.dir.empty() ? nullptr : &d;
  }

  bool HaveTorch() {
    if (have_torch_ < 0) {
      have_torch_ =
          std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) == 0;
    }
    return have_torch_ == 1;
  }
  bool HavePython() const { return fs::exists(kPython); }

  // A fresh scratch directory for a test that edits a copy of a fixture.
  fs::path Scratch(const std::string& name) {
    fs::path p = root_ / "scratch" / (name + "_" + std::to_string(scratch_n_++));
    fs::create_directories(p);
    return p;
  }

  const std::string& log() const { return log_; }

 private:
  Fixtures() {
    std::string tmpl = (fs::temp_directory_path() / "ucpfs_dcp_scan_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) != nullptr) root_ = tmpl;
  }
  ~Fixtures() {
    if (std::getenv("UCPFS_KEEP_FIXTURES") == nullptr && !root_.empty()) {
      std::error_code ec;
      fs::remove_all(root_, ec);
    } else if (!root_.empty()) {
      std::fprintf(stderr, "fixtures kept in %s\n", root_.c_str());
    }
  }

  bool Run(const std::string& cmd, const std::string& tag) {
    const fs::path log = root_ / (tag + ".log");
    const int rc = std::system((cmd + " >" + Quote(log) + " 2>&1").c_str());
    if (rc != 0) {
      std::ifstream in(log);
      log_ += "$ " + cmd + "\n" + std::string(std::istreambuf_iterator<char>(in), {}) + "\n";
    }
    return rc == 0;
  }

  fs::path root_;
  fs::path x2_;
  bool x2_tried_ = false;
  std::map<std::string, D113> d113_;
  int have_torch_ = -1;
  int scratch_n_ = 0;
  std::string log_;
};

#define REQUIRE_X2()                                                          \
  if (!Fixtures::Get().HavePython()) GTEST_SKIP() << kPython << " not found"; \
  const fs::path x2 = Fixtures::Get().X2();                                   \
  ASSERT_FALSE(x2.empty()) << "gen_dcp2x.py failed:\n" << Fixtures::Get().log()

struct Expected {
  bool is_bytes = false;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<std::byte> raw;
};

// Reads <stem>.json and <stem>_raw/<key>.bin, keeping the json's key order.
std::vector<std::pair<std::string, Expected>> LoadExpected(const fs::path& stem) {
  std::ifstream in(stem.string() + ".json");
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(in, nullptr, false);
  std::vector<std::pair<std::string, Expected>> out;
  if (j.is_discarded()) return out;
  for (auto& [key, v] : j.items()) {
    Expected e;
    e.is_bytes = v["kind"] == "bytes";
    if (!e.is_bytes) {
      e.dtype = *DTypeFromTorchName(v["dtype"].get<std::string>());
      e.shape = v["shape"].get<std::vector<int64_t>>();
      e.raw = ReadWhole(fs::path(stem.string() + "_raw") / (key + ".bin"));
    }
    out.emplace_back(key, std::move(e));
  }
  return out;
}

const Item* FindItem(const Checkpoint& c, const std::string& key) {
  for (const Item& i : c.items) {
    if (i.key == key) return &i;
  }
  return nullptr;
}

// Naive oracle: gathers the tensor element by element from its fragments (each file read whole),
// counting how often each element is written (must be exactly once).
std::vector<std::byte> NaiveGather(const fs::path& dir, const Checkpoint& c, const Item& item,
                                   std::string* problem) {
  const uint64_t isz = ItemSize(item.dtype);
  const uint64_t n = item.layout.NumElems();
  std::vector<std::byte> out(n * isz);
  std::vector<int> count(n, 0);
  std::map<uint32_t, std::vector<std::byte>> files;
  std::vector<int64_t> gstride(item.layout.shape.size(), 1);
  for (size_t d = gstride.size(); d-- > 1;) gstride[d - 1] = gstride[d] * item.layout.shape[d];
  for (const slice::Fragment& f : item.layout.fragments) {
    if (f.dtype != item.dtype) {
      *problem = "fragment dtype differs from item dtype";
      return {};
    }
    auto& bytes = files[f.file_id];
    if (bytes.empty()) bytes = ReadWhole(dir / c.files[f.file_id].rel_path);
    const size_t rank = f.box.sizes.size();
    std::vector<int64_t> bstride(rank, 1);
    for (size_t d = rank; d-- > 1;) bstride[d - 1] = bstride[d] * f.box.sizes[d];
    for (uint64_t e = f.flat_lo; e < f.flat_hi; ++e) {
      uint64_t g = 0;
      uint64_t src = f.byte_offset + (e - f.flat_lo) * isz;
      if (!f.strides.empty()) src = f.byte_offset;
      uint64_t rem = e;
      for (size_t d = 0; d < rank; ++d) {
        const uint64_t idx = rem / static_cast<uint64_t>(bstride[d]);
        rem %= static_cast<uint64_t>(bstride[d]);
        g += (static_cast<uint64_t>(f.box.offsets[d]) + idx) * static_cast<uint64_t>(gstride[d]);
        if (!f.strides.empty()) src += idx * static_cast<uint64_t>(f.strides[d]) * isz;
      }
      if (g >= n || src + isz > bytes.size()) {
        *problem = "element outside tensor or file";
        return {};
      }
      std::memcpy(out.data() + g * isz, bytes.data() + src, isz);
      ++count[g];
    }
  }
  for (uint64_t e = 0; e < n; ++e) {
    if (count[e] != 1) {
      *problem = "element " + std::to_string(e) + " written " + std::to_string(count[e]) + " times";
      return {};
    }
  }
  return out;
}

std::vector<std::shared_ptr<const ByteSource>> OpenFiles(const fs::path& dir, const Checkpoint& c) {
  std::vector<std::shared_ptr<const ByteSource>> out;
  for (const SourceFile& f : c.files) {
    auto src = FileSource::Open((dir / f.rel_path).string());
    EXPECT_TRUE(src.ok()) << src.status().ToString();
    out.push_back(src.ok() ? std::shared_ptr<const ByteSource>(*src) : nullptr);
  }
  return out;
}

// Every expected tensor: same dtype and shape, gathered bytes equal (oracle and ReadTensorBytes);
// every expected byte item is a kBytes item holding a torch.save zip.
void CheckAgainstExpected(const fs::path& dir, const Checkpoint& c,
                          const std::vector<std::pair<std::string, Expected>>& expected) {
  auto files = OpenFiles(dir, c);
  size_t checked = 0;
  for (const auto& [key, e] : expected) {
    SCOPED_TRACE(dir.filename().string() + ": " + key);
    const Item* item = FindItem(c, key);
    ASSERT_NE(item, nullptr);
    ++checked;
    if (e.is_bytes) {
      ASSERT_EQ(item->kind, ItemKind::kBytes);
      ASSERT_LT(item->file_id, c.files.size());
      std::byte head[4];
      ASSERT_TRUE(files[item->file_id]->ReadAt(item->byte_offset, head).ok());
      EXPECT_EQ(0, std::memcmp(head, "PK\x03\x04", 4));
      EXPECT_GT(item->n_bytes, 100u);
      continue;
    }
    ASSERT_EQ(item->kind, ItemKind::kTensor);
    EXPECT_EQ(item->dtype, e.dtype);
    EXPECT_EQ(item->layout.shape, e.shape);
    std::string problem;
    std::vector<std::byte> got = NaiveGather(dir, c, *item, &problem);
    ASSERT_TRUE(problem.empty()) << problem;
    ASSERT_EQ(got.size(), e.raw.size());
    EXPECT_TRUE(got == e.raw) << "naive gather differs";
    std::vector<std::byte> via_slice(e.raw.size());
    Status st = slice::ReadTensorBytes(item->layout, item->dtype, files, 0, via_slice);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(via_slice == e.raw) << "ReadTensorBytes differs";
  }
  EXPECT_GT(checked, 0u);
}

std::vector<std::string> Keys(const Checkpoint& c) {
  std::vector<std::string> out;
  for (const Item& i : c.items) out.push_back(i.key);
  return out;
}

void ExpectError(const Result<Checkpoint>& r, StatusCode code,
                 const std::vector<std::string>& needles) {
  ASSERT_FALSE(r.ok()) << "scan succeeded";
  EXPECT_EQ(r.error().code(), code) << r.error().ToString();
  for (const auto& n : needles) {
    EXPECT_NE(r.error().message().find(n), std::string::npos)
        << "'" << n << "' not in: " << r.error().message();
  }
}

fs::path CopyOf(const fs::path& src, const std::string& name) {
  fs::path dst = Fixtures::Get().Scratch(name);
  fs::copy(src, dst, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  return dst;
}

// ------------------------------------------------------------------------ synthetic 2.x

TEST(DcpScan, Torch2xLayoutAndData) {
  REQUIRE_X2();
  const fs::path dir = x2;
  EXPECT_TRUE(IsDcpDirectory(LocalTree(dir.string())));
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  auto r = ScanDcp(LocalTree(dir.string()),
                   [&](uint64_t done, uint64_t total) { calls.emplace_back(done, total); });
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  const Checkpoint& c = *r;
  EXPECT_EQ(c.format, "dcp");
  EXPECT_EQ(c.flavor, "torch-2.x");

  auto expected = LoadExpected(Sibling(x2, "expected"));
  ASSERT_FALSE(expected.empty());
  std::vector<std::string> want;
  for (const auto& [k, e] : expected) want.push_back(k);
  EXPECT_EQ(Keys(c), want);  // state_dict_metadata order
  ASSERT_EQ(calls.size(), c.items.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i], std::make_pair(uint64_t{i + 1}, uint64_t{c.items.size()}));
  }

  // Files: the metadata and 3 ranks x 2 files, each with its size and mtime.
  std::set<std::string> names;
  for (const SourceFile& f : c.files) {
    names.insert(f.rel_path);
    EXPECT_EQ(f.n_bytes, fs::file_size(dir / f.rel_path)) << f.rel_path;
    EXPECT_GT(f.mtime_ns, 0);
  }
  EXPECT_EQ(names,
            (std::set<std::string>{".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                                   "__1_1.distcp", "__2_0.distcp", "__2_1.distcp"}));

  const Item* emb = FindItem(c, "tok_embeddings.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->dtype, DType::kBFloat16);
  ASSERT_EQ(emb->layout.fragments.size(), 3u);  // torch.chunk: 13 + 13 + 11 rows
  EXPECT_EQ(emb->layout.fragments[0].box, (slice::Box{{0, 0}, {13, 16}}));
  EXPECT_EQ(emb->layout.fragments[1].box, (slice::Box{{13, 0}, {13, 16}}));
  EXPECT_EQ(emb->layout.fragments[2].box, (slice::Box{{26, 0}, {11, 16}}));
  for (const auto& f : emb->layout.fragments) {
    EXPECT_TRUE(f.strides.empty());
    EXPECT_EQ(f.flat_lo, 0u);
    EXPECT_EQ(f.flat_hi, f.box.Volume());
    EXPECT_EQ(f.dtype, DType::kBFloat16);
  }
  const Item* wk = FindItem(c, "layers.0.attention.wk.weight");
  ASSERT_NE(wk, nullptr);
  EXPECT_EQ(wk->layout.fragments.size(), 2u);  // 2 + 2 + 0 rows: the empty chunk has no fragment
  const Item* wo = FindItem(c, "layers.0.attention.wo.weight");
  ASSERT_NE(wo, nullptr);
  ASSERT_EQ(wo->layout.fragments.size(), 3u);
  EXPECT_TRUE(wo->layout.fragments[0].strides.empty());
  EXPECT_EQ(wo->layout.fragments[1].strides, (std::vector<int64_t>{1, 6}));  // stored transposed
  const Item* norm = FindItem(c, "norm.weight");
  ASSERT_NE(norm, nullptr);
  ASSERT_EQ(norm->layout.fragments.size(), 1u);
  EXPECT_EQ(c.files[norm->layout.fragments[0].file_id].rel_path.substr(0, 4), "__2_");
  const Item* step = FindItem(c, "optimizer.state.norm.weight.step");
  ASSERT_NE(step, nullptr);
  EXPECT_TRUE(step->layout.shape.empty());
  ASSERT_EQ(step->layout.fragments.size(), 1u);
  EXPECT_TRUE(step->layout.fragments[0].box.sizes.empty());
  EXPECT_EQ(step->layout.fragments[0].flat_hi, 1u);
  const Item* lr = FindItem(c, "optimizer.param_groups.norm.weight.lr");
  ASSERT_NE(lr, nullptr);
  EXPECT_EQ(lr->kind, ItemKind::kBytes);

  CheckAgainstExpected(dir, c, expected);
}

TEST(DcpScan, RankLocalMetadataMergedAndReplicasDropped) {
  REQUIRE_X2();
  const fs::path dir = Sibling(x2, "ranklocal");
  ASSERT_FALSE(fs::exists(dir / ".metadata"));
  EXPECT_TRUE(IsDcpDirectory(LocalTree(dir.string())));
  auto r = ScanDcp(LocalTree(dir.string()));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->flavor, "torch-2.x");
  auto base = ScanDcp(LocalTree(x2.string()));
  ASSERT_TRUE(base.ok());
  EXPECT_EQ(Keys(*r), Keys(*base));
  size_t n_meta = 0;
  for (const auto& f : r->files) n_meta += f.rel_path.ends_with(".metadata");
  EXPECT_EQ(n_meta, 3u);
  // Every rank stored its replica of the replicated tensors; one is kept.
  for (const char* k :
       {"norm.weight", "layers.0.attention_norm.weight", "optimizer.state.norm.weight.step"}) {
    const Item* item = FindItem(*r, k);
    ASSERT_NE(item, nullptr) << k;
    EXPECT_EQ(item->layout.fragments.size(), 1u) << k;
  }
  auto expected = LoadExpected(Sibling(x2, "ranklocal_expected"));
  CheckAgainstExpected(dir, *r, expected);
}

TEST(DcpScan, MegatronTorchDistFlattenedRange) {
  REQUIRE_X2();
  const fs::path dir = Sibling(x2, "megatron");
  EXPECT_TRUE(IsDcpDirectory(LocalTree(dir.string())));
  auto r = ScanDcp(LocalTree(dir.string()));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  const Checkpoint& c = *r;
  EXPECT_EQ(c.flavor, "megatron-torch_dist");
  // The layer-stacked [2, 24, 16] is indexed as one [24, 16] tensor per layer.
  EXPECT_EQ(FindItem(c, "decoder.layers.self_attention.linear_qkv.weight"), nullptr);
  const Item* qkv = FindItem(c, "decoder.layers.1.self_attention.linear_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->layout.shape, (std::vector<int64_t>{24, 16}));
  ASSERT_EQ(qkv->layout.fragments.size(), 2u);
  EXPECT_EQ(qkv->layout.fragments[1].box, (slice::Box{{12, 0}, {12, 16}}));

  // exp_avg of linear_proj [2,16,16], TP column split [1,16,8]: saved as [2,1,2,128] with flat
  // ranges [0,77) and [77,128) per local chunk; layer 1's part of it.
  const Item* ea =
      FindItem(c, "optimizer.state.exp_avg.decoder.layers.1.self_attention.linear_proj.weight");
  ASSERT_NE(ea, nullptr);
  EXPECT_EQ(ea->dtype, DType::kFloat32);
  EXPECT_EQ(ea->layout.shape, (std::vector<int64_t>{16, 16}));
  ASSERT_EQ(ea->layout.fragments.size(), 4u);
  std::set<std::tuple<std::vector<int64_t>, uint64_t, uint64_t>> frags;
  for (const auto& f : ea->layout.fragments) {
    EXPECT_EQ(f.box.sizes, (std::vector<int64_t>{16, 8}));
    EXPECT_TRUE(f.strides.empty());
    frags.emplace(f.box.offsets, f.flat_lo, f.flat_hi);
  }
  EXPECT_TRUE(frags.contains({{0, 8}, 0, 77}));
  EXPECT_TRUE(frags.contains({{0, 8}, 77, 128}));
  // Items come layer by layer, as Megatron's state_dict lists them.
  std::vector<std::string> order;
  for (const Item& i : c.items) {
    if (i.key.starts_with("decoder.layers.")) order.push_back(i.key);
  }
  EXPECT_EQ(order, (std::vector<std::string>{"decoder.layers.0.self_attention.linear_qkv.weight",
                                             "decoder.layers.0.self_attention.linear_proj.weight",
                                             "decoder.layers.0.input_layernorm.weight",
                                             "decoder.layers.1.self_attention.linear_qkv.weight",
                                             "decoder.layers.1.self_attention.linear_proj.weight",
                                             "decoder.layers.1.input_layernorm.weight"}));
  const Item* fl = FindItem(c, "optimizer.state.fp32_param.decoder.final_layernorm.weight");
  ASSERT_NE(fl, nullptr);
  ASSERT_EQ(fl->layout.fragments.size(), 1u);
  EXPECT_EQ(fl->layout.fragments[0].box, (slice::Box{{0}, {16}}));

  const Item* common = FindItem(c, "common.pt");
  ASSERT_NE(common, nullptr);
  EXPECT_EQ(common->kind, ItemKind::kBytes);
  EXPECT_EQ(c.files[common->file_id].rel_path, "common.pt");
  EXPECT_EQ(common->n_bytes, fs::file_size(dir / "common.pt"));
  bool has_json = false;
  for (const auto& f : c.files) has_json |= f.rel_path == "metadata.json";
  EXPECT_TRUE(has_json);

  auto expected = LoadExpected(Sibling(x2, "megatron_expected"));
  EXPECT_EQ(c.items.size(), expected.size() + 1);  // + common.pt
  CheckAgainstExpected(dir, c, expected);
}

// ------------------------------------------------------------------------ real torch 1.13

void CheckTorch113(int ranks, bool single, int seed) {
  if (!Fixtures::Get().HavePython() || !Fixtures::Get().HaveTorch())
    GTEST_SKIP() << "no torch at " << kPython;
  const auto* d = Fixtures::Get().Torch113(ranks, single, seed);
  ASSERT_NE(d, nullptr) << "gen_dcp113_llama.py failed:\n" << Fixtures::Get().log();
  auto r = ScanDcp(LocalTree(d->dir.string()));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  const Checkpoint& c = *r;
  EXPECT_EQ(c.flavor, "torch-1.13");
  auto expected = LoadExpected(d->expected_stem);
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(c.items.size(), expected.size());
  CheckAgainstExpected(d->dir, c, expected);

  const Item* emb = FindItem(c, "tok_embeddings.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->layout.fragments.size(), static_cast<size_t>(ranks));  // 37 rows, uneven
  const Item* wo1 = FindItem(c, "layers.1.attention.wo.weight");
  ASSERT_NE(wo1, nullptr);
  ASSERT_EQ(wo1->layout.fragments.size(), 1u);
  EXPECT_EQ(wo1->layout.fragments[0].strides, (std::vector<int64_t>{1, 16}));  // column-major
  const Item* w1 = FindItem(c, "layers.0.feed_forward.w1.weight");
  ASSERT_NE(w1, nullptr);
  if (ranks == 4) {
    ASSERT_EQ(w1->layout.fragments.size(), 4u);  // 2x2 grid
    EXPECT_EQ(w1->layout.fragments[3].box, (slice::Box{{12, 8}, {12, 8}}));
  }
  const Item* step = FindItem(c, "optimizer.state.norm.weight.step");
  ASSERT_NE(step, nullptr);
  EXPECT_TRUE(step->layout.shape.empty());
  const Item* ts = FindItem(c, "train_state");
  ASSERT_NE(ts, nullptr);
  EXPECT_EQ(ts->kind, ItemKind::kBytes);
  size_t n_data = 0;
  for (const auto& f : c.files) n_data += f.rel_path.ends_with(".distcp");
  if (single)
    EXPECT_EQ(n_data, static_cast<size_t>(ranks));
  else
    EXPECT_GT(n_data, 50u);  // one file per item
}

TEST(DcpScan, Torch113ThreeRanksFilePerItem) { CheckTorch113(3, false, 2); }
TEST(DcpScan, Torch113FourRanksGrid) { CheckTorch113(4, true, 3); }

// ------------------------------------------------------------------------ composite folders

TEST(DcpScan, SubdirectoriesRepeatingKeysAreARunNotOneCheckpoint) {
  // Two saves of the same model (keys repeat): not one checkpoint, the run directory lists both.
  // One checkpoint in several DCP folders with disjoint keys (Accelerate's save_state) is the
  // e2e_producers_dcp test's accelerate_fsdp case, saved by Accelerate itself.
  REQUIRE_X2();
  const fs::path run = Fixtures::Get().Scratch("run_of_two");
  fs::create_directories(run);
  fs::copy(x2, run / "step-10", fs::copy_options::recursive);
  fs::copy(Sibling(x2, "ranklocal"), run / "step-20", fs::copy_options::recursive);
  EXPECT_FALSE(IsDcpDirectory(LocalTree(run.string())));
  EXPECT_TRUE(DcpCompositeParts(LocalTree(run.string())).empty());
  auto found = FindRunCheckpoints(LocalTree(run.string()));
  ASSERT_TRUE(found.ok()) << found.error().ToString();
  ASSERT_EQ(found->checkpoints.size(), 2u);
  // One DCP subdirectory alone is not a composite either, and a symlinked one is never followed.
  const fs::path one = Fixtures::Get().Scratch("one_part");
  fs::create_directories(one);
  fs::copy(x2, one / "pytorch_model_fsdp_0", fs::copy_options::recursive);
  fs::create_directory_symlink(Sibling(x2, "ranklocal"), one / "optimizer_0");
  EXPECT_TRUE(DcpCompositeParts(LocalTree(one.string())).empty());
  ExpectError(ScanDcp(LocalTree(one.string())), StatusCode::kNotFound, {"DCP subdirectories with disjoint keys"});
}

// ------------------------------------------------------------------------ errors

TEST(DcpScan, MissingDirectoryOrMetadata) {
  REQUIRE_X2();
  ExpectError(ScanDcp(LocalTree((Sibling(x2, "does-not-exist")).string())), StatusCode::kNotFound,
              {"does-not-exist"});
  fs::path d = CopyOf(x2, "nometa");
  fs::remove(d / ".metadata");
  EXPECT_FALSE(IsDcpDirectory(LocalTree(d.string())));
  ExpectError(ScanDcp(LocalTree(d.string())), StatusCode::kNotFound, {".metadata"});
}

TEST(DcpScan, TruncatedMetadata) {
  REQUIRE_X2();
  fs::path d = CopyOf(x2, "truncmeta");
  fs::resize_file(d / ".metadata", fs::file_size(d / ".metadata") / 2);
  ExpectError(ScanDcp(LocalTree(d.string())), StatusCode::kCorrupt, {".metadata"});
}

TEST(DcpScan, StorageEntryPastEndOfFile) {
  REQUIRE_X2();
  fs::path d = CopyOf(x2, "pasteof");
  fs::resize_file(d / "__1_0.distcp", 100);
  ExpectError(ScanDcp(LocalTree(d.string())), StatusCode::kCorrupt, {"__1_0.distcp", "past the end"});
}

TEST(DcpScan, MissingDataFile) {
  REQUIRE_X2();
  fs::path d = CopyOf(x2, "nofile");
  fs::remove(d / "__2_1.distcp");
  ExpectError(ScanDcp(LocalTree(d.string())), StatusCode::kCorrupt, {"__2_1.distcp", "missing"});
}

TEST(DcpScan, CorruptCatalogue) {
  REQUIRE_X2();
  const std::string wq = "layers.0.attention.wq.weight";
  struct Case {
    const char* kind;
    StatusCode code;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"shape", StatusCode::kCorrupt, {wq, "[16, 6]", "[6, 16]", ".distcp"}},
      {"gap", StatusCode::kCorrupt, {wq, ".metadata"}},
      {"overlap", StatusCode::kCorrupt, {wq, ".metadata"}},
      {"nostorage", StatusCode::kCorrupt, {wq, "no storage_data entry", ".metadata"}},
      {"transform", StatusCode::kUnsupported, {wq, "stream.zstd/1"}},
      {"safetensors", StatusCode::kUnsupported, {"safetensors", "__1_0.distcp"}},
      {"v112", StatusCode::kUnsupported, {"1.12", ".metadata"}},
      {"replica",
       StatusCode::kCorrupt,
       {"norm.weight", "covered twice by replicas with different data"}},
      {"relpath", StatusCode::kCorrupt, {"leaves the checkpoint directory", ".metadata"}},
      {"mcore_shape",
       StatusCode::kCorrupt,
       {"optimizer.state.exp_avg.embedding.word_embeddings.weight",
        "nd_reformulated_orig_global_shape"}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.kind);
    const fs::path d = Sibling(x2, "corrupt") / k.kind;
    ASSERT_TRUE(fs::exists(d));
    ExpectError(ScanDcp(LocalTree(d.string())), k.code, k.needles);
  }
}

TEST(DcpScan, MegatronOtherBackendUnsupported) {
  REQUIRE_X2();
  fs::path d = CopyOf(Sibling(x2, "megatron"), "zarr");
  std::ofstream(d / "metadata.json")
      << R"({"sharded_backend": "zarr", "sharded_backend_version": 1})";
  ExpectError(ScanDcp(LocalTree(d.string())), StatusCode::kUnsupported, {"zarr", "metadata.json"});
  std::ofstream(d / "metadata.json") << "{not json";
  ExpectError(ScanDcp(LocalTree(d.string())), StatusCode::kCorrupt, {"metadata.json"});
}

TEST(DcpMetadata, RootMustBeAMetadataObject) {
  const uint8_t int_pickle[] = {0x80, 0x02, 'K', 0x05, '.'};  // protocol 2: the int 5
  std::vector<std::byte> bytes(sizeof(int_pickle));
  std::memcpy(bytes.data(), int_pickle, sizeof(int_pickle));
  auto r = ParseDcpMetadata(bytes, "x/.metadata");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.error().message().find("x/.metadata: root is a"), std::string::npos)
      << r.error().message();
  auto empty = ParseDcpMetadata({}, "y/.metadata");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.error().code(), StatusCode::kCorrupt);
}

TEST(DcpMetadata, ParsesTorch2xFields) {
  REQUIRE_X2();
  const auto bytes = ReadWhole(x2 / ".metadata");
  auto md = ParseDcpMetadata(bytes, ".metadata");
  ASSERT_TRUE(md.ok()) << md.error().ToString();
  EXPECT_EQ(md->flavor, "torch-2.x");
  ASSERT_FALSE(md->entries.empty());
  EXPECT_EQ(md->entries[0].fqn, "tok_embeddings.weight");
  EXPECT_EQ(md->entries[0].dtype, DType::kBFloat16);
  EXPECT_EQ(md->entries[0].size, (std::vector<int64_t>{37, 16}));
  ASSERT_EQ(md->entries[0].chunks.size(), 3u);
  EXPECT_EQ(md->entries[0].chunks[2].offsets, (std::vector<int64_t>{26, 0}));
  EXPECT_EQ(md->entries[0].chunks[2].sizes, (std::vector<int64_t>{11, 16}));
  auto it = md->storage.find(DcpStorageKey{"train_state.step", false, {}});
  ASSERT_NE(it, md->storage.end());
  EXPECT_TRUE(it->second.relative_path.ends_with(".distcp"));
  EXPECT_TRUE(it->second.transform_descriptors.empty());
  auto step = md->storage.find(DcpStorageKey{"optimizer.state.norm.weight.step", true, {}});
  EXPECT_NE(step, md->storage.end());  // 0-d: offsets () is not None
  EXPECT_TRUE(md->nd_orig_shape.empty());
}

// Every prefix of the metadata fails cleanly.
TEST(DcpScan, EveryMetadataPrefixFailsCleanly) {
  REQUIRE_X2();
  fs::path d = CopyOf(x2, "prefixes");
  const auto full = ReadWhole(d / ".metadata");
  for (size_t n = 0; n < full.size(); n += 37) {
    {
      std::ofstream out(d / ".metadata", std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(full.data()), static_cast<std::streamsize>(n));
    }
    auto r = ScanDcp(LocalTree(d.string()));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_TRUE(r.error().code() == StatusCode::kCorrupt) << n << ": " << r.error().ToString();
  }
}

// Seeded random byte damage in metadata and data files: the scanner returns (ok or an error),
// never crashes. Seed from UCPFS_TEST_SEED, else 1 (printed).
TEST(DcpScan, RandomDamageNeverCrashes) {
  REQUIRE_X2();
  uint64_t seed = 1;
  if (const char* s = std::getenv("UCPFS_TEST_SEED")) seed = std::strtoull(s, nullptr, 10);
  std::printf("UCPFS_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const fs::path src = Sibling(x2, "ranklocal");
  std::vector<fs::path> names;
  for (const auto& e : fs::directory_iterator(src)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  fs::path d = CopyOf(src, "damage");
  int failures = 0;
  for (int iter = 0; iter < 60; ++iter) {
    const fs::path victim = d / names[rng() % names.size()];
    auto bytes = ReadWhole(src / victim.filename());
    auto damaged = bytes;
    const int n_flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < n_flips && !damaged.empty(); ++i) {
      damaged[rng() % damaged.size()] = static_cast<std::byte>(rng() & 0xFF);
    }
    {
      std::ofstream out(victim, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(damaged.data()),
                static_cast<std::streamsize>(damaged.size()));
    }
    auto r = ScanDcp(LocalTree(d.string()));
    failures += !r.ok();
    {
      std::ofstream out(victim, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(bytes.data()),
                static_cast<std::streamsize>(bytes.size()));
    }
  }
  std::printf("%d of 60 damaged scans failed cleanly\n", failures);
  EXPECT_TRUE(ScanDcp(LocalTree(d.string())).ok());
}

}  // namespace
}  // namespace ucpfs::index

namespace ucpfs::index {
namespace {

// Inputs the fuzzer found; each must give a clean error. (Regression: a TensorStorageMetadata
// without properties made the walker ask the graph for the kind of kNoNode.)
TEST(DcpMetadataRegression, FuzzFindings) {
  const char* env = std::getenv("UCPFS_TEST_DATA");
  ASSERT_NE(env, nullptr);
  for (const char* name : {"fuzz_regress_props_nonode.metadata"}) {
    auto src = FileSource::Open(std::string(env) + "/dcp/" + name);
    ASSERT_TRUE(src.ok()) << src.error().ToString();
    auto bytes = ReadRange(**src, 0, (*src)->Size());
    ASSERT_TRUE(bytes.ok());
    auto md = ParseDcpMetadata(*bytes, name);
    EXPECT_FALSE(md.ok()) << name;
    EXPECT_NE(md.status().message().find(name), std::string::npos) << md.status().ToString();
  }
}

}  // namespace
}  // namespace ucpfs::index
