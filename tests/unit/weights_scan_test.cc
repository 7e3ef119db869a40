// ScanWeights on directories written at test time with the project's own lazy writers
// (format/safetensors.h, torch_writer.h, byte-exact with the real libraries per their own tests):
// tensors are found at the right bytes, and every way an index and its shards can disagree is
// refused with kCorrupt naming the file (the e2e test weights_only_test.py covers the real
// producers and the mount).
#include "index/weights_scan.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/format/safetensors.h"
#include "core/format/torch_writer.h"
#include "core/io/file_source.h"
#include "core/slice/slice.h"
#include "index/hf_config.h"
#include "index/key_map.h"
#include "index/source_facts.h"

namespace ucpfs::index {
namespace {

namespace fs = std::filesystem;

// Element i of every tensor is float(seed + i).
class Iota final : public format::TensorBytesProvider {
 public:
  explicit Iota(float seed) : seed_(seed) {}
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    for (size_t k = 0; k < out.size(); ++k) {
      const uint64_t at = byte_offset + k;
      const float v = seed_ + static_cast<float>(at / 4);
      std::byte b[4];
      std::memcpy(b, &v, 4);
      out[k] = b[at % 4];
    }
    return Status::Ok();
  }

 private:
  float seed_;
};

format::SaveTensor F32(std::vector<int64_t> shape, float seed) {
  return {DType::kFloat32, std::move(shape), std::make_shared<Iota>(seed)};
}

void WriteSource(const ByteSource& src, const fs::path& path) {
  std::vector<std::byte> bytes(src.Size());
  ASSERT_TRUE(src.ReadAt(0, bytes).ok());
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
}

void WriteSafetensors(const fs::path& path, std::vector<std::pair<std::string, format::SaveTensor>> tensors) {
  auto f = format::LazySafetensorsFile::Build(std::move(tensors), {{"format", "pt"}}, path.string());
  ASSERT_TRUE(f.ok()) << f.error().ToString();
  WriteSource(**f, path);
}

void WriteText(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

class WeightsScanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ucpfs-weights-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Two shards and their index: a,b in shard 1, c in shard 2.
  void Sharded() {
    WriteSafetensors(dir_ / "model-00001-of-00002.safetensors", {{"b", F32({2, 3}, 10)}, {"a", F32({4}, 0)}});
    WriteSafetensors(dir_ / "model-00002-of-00002.safetensors", {{"c", F32({3}, 20)}});
    WriteText(dir_ / "model.safetensors.index.json",
              R"({"metadata": {"total_size": 52}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                  "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})");
  }

  // The bytes of `item` as float32 values.
  std::vector<float> Values(const Checkpoint& c, const Item& item) {
    std::vector<std::shared_ptr<const ByteSource>> files;
    for (const SourceFile& f : c.files) {
      auto s = FileSource::Open((dir_ / f.rel_path).string());
      EXPECT_TRUE(s.ok());
      files.push_back(*s);
    }
    std::vector<std::byte> bytes(item.layout.NumElems() * 4);
    EXPECT_TRUE(slice::ReadTensorBytes(item.layout, DType::kFloat32, files, 0, bytes).ok());
    std::vector<float> v(item.layout.NumElems());
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  }

  fs::path dir_;
};

TEST_F(WeightsScanTest, ShardedSafetensorsWithIndex) {
  Sharded();
  ASSERT_TRUE(IsWeightsDirectory(LocalTree(dir_)));
  auto c = ScanWeights(LocalTree(dir_));
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_EQ(c->format, "weights");
  EXPECT_EQ(c->flavor, "safetensors");
  ASSERT_EQ(c->items.size(), 3u);
  // Shard 1's own order (the library sorts by name), then shard 2.
  EXPECT_EQ(c->items[0].key, "a");
  EXPECT_EQ(c->items[1].key, "b");
  EXPECT_EQ(c->items[2].key, "c");
  EXPECT_EQ(Values(*c, c->items[0]), (std::vector<float>{0, 1, 2, 3}));
  EXPECT_EQ(Values(*c, c->items[1]), (std::vector<float>{10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(Values(*c, c->items[2]), (std::vector<float>{20, 21, 22}));
  // Keys map to themselves, "model." prefixes included.
  auto m = MapKeys(*c, {});
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->params.size(), 3u);
  EXPECT_EQ(m->params[0].name, "a");
}

// A Hugging Face folder's config.json: its facts recorded (and stored), the file in the table so
// its identity is checked, not listed as a weight file; a bad one recorded as an error, not fatal.
TEST_F(WeightsScanTest, HfConfigBesideTheWeights) {
  Sharded();
  WriteText(dir_ / "config.json",
            R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": null, "intermediate_size": 48,
                "num_hidden_layers": 2, "vocab_size": 250, "hidden_act": "silu", "tie_word_embeddings": false})");
  auto c = ScanWeights(LocalTree(dir_));
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  const auto* w = std::get_if<WeightsSourceFacts>(&c->facts);
  ASSERT_NE(w, nullptr);
  ASSERT_TRUE(w->hf_config.has_value()) << w->hf_config_error;
  EXPECT_EQ(w->hf_config->architecture, "LlamaForCausalLM");
  EXPECT_EQ(w->hf_config->KvHeads(), 2);
  EXPECT_EQ(w->hf_config->HeadDim(), 8);  // hidden / heads: head_dim is null
  EXPECT_EQ(w->hf_config->tie_word_embeddings, std::optional<bool>(false));
  EXPECT_EQ(std::count(w->files.begin(), w->files.end(), "config.json"), 0);
  EXPECT_EQ(c->files.back().rel_path, "config.json");
  auto decoded = DecodeSourceFacts(EncodeSourceFacts(c->facts));
  ASSERT_TRUE(decoded.ok()) << decoded.error().ToString();
  EXPECT_EQ(std::get<WeightsSourceFacts>(*decoded).hf_config, w->hf_config);
  auto facts = MegatronCoreFactsOf(*w->hf_config);
  ASSERT_TRUE(facts.ok());
  EXPECT_EQ(facts->num_query_groups, 2);
  EXPECT_EQ(facts->vocab_size, 250);

  WriteText(dir_ / "config.json", R"({"model_type": "llama", "num_attention_heads": "four"})");
  c = ScanWeights(LocalTree(dir_));
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  w = std::get_if<WeightsSourceFacts>(&c->facts);
  EXPECT_FALSE(w->hf_config.has_value());
  EXPECT_NE(w->hf_config_error.find("num_attention_heads"), std::string::npos) << w->hf_config_error;
  EXPECT_NE(w->hf_config_error.find("config.json"), std::string::npos) << w->hf_config_error;

  HfModelConfig gemma = {};
  gemma.model_type = "gemma";
  auto refused = MegatronCoreFactsOf(gemma);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("gemma"), std::string::npos);
}

TEST_F(WeightsScanTest, TorchStateDict) {
  format::SaveValue sd = format::SaveValue::OrderedDict();
  sd.Set("model.embed_tokens.weight", format::SaveValue::Tensor(F32({2, 2}, 5)));
  sd.Set("model.norm.weight", format::SaveValue::Tensor(F32({2}, 7)));
  auto f = format::LazyTorchFile::Build(sd, "pytorch_model.bin");
  ASSERT_TRUE(f.ok());
  WriteSource(**f, dir_ / "pytorch_model.bin");
  auto c = ScanWeights(LocalTree(dir_));
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  ASSERT_EQ(c->items.size(), 2u);
  EXPECT_EQ(c->items[0].key, "model.embed_tokens.weight");
  EXPECT_EQ(Values(*c, c->items[0]), (std::vector<float>{5, 6, 7, 8}));
  auto m = MapKeys(*c, {});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->params[0].name, "model.embed_tokens.weight");  // not stripped to embed_tokens.weight
  // A Hugging Face Trainer's files beside pytorch_model.bin do not make it ambiguous.
  WriteText(dir_ / "optimizer.pt", "not read");
  WriteText(dir_ / "training_args.bin", "not read");
  c = ScanWeights(LocalTree(dir_));
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_EQ(c->items.size(), 2u);
  ASSERT_EQ(c->files.size(), 1u);
  EXPECT_EQ(c->files[0].rel_path, "pytorch_model.bin");
}

// Each case: what to break, and a text the error must contain.
struct Broken {
  const char* what;
  void (*apply)(const fs::path&);
  StatusCode code;
  const char* needle;
};

TEST_F(WeightsScanTest, DisagreementsAreRefused) {
  const Broken cases[] = {
      {"index names a missing shard",
       [](const fs::path& d) { fs::remove(d / "model-00002-of-00002.safetensors"); }, StatusCode::kCorrupt,
       "model-00002-of-00002.safetensors, which is missing"},
      {"a shard holds a tensor the index does not assign to it",
       [](const fs::path& d) {
         WriteSafetensors(d / "model-00002-of-00002.safetensors", {{"c", F32({3}, 20)}, {"d", F32({1}, 0)}});
       },
       StatusCode::kCorrupt, "'d'"},
      {"the index assigns a tensor to a shard that lacks it",
       [](const fs::path& d) { WriteSafetensors(d / "model-00002-of-00002.safetensors", {{"e", F32({3}, 20)}}); },
       StatusCode::kCorrupt, "'e'"},
      {"the index leaves the directory",
       [](const fs::path& d) {
         WriteText(d / "model.safetensors.index.json", R"({"weight_map": {"a": "../x.safetensors"}})");
       },
       StatusCode::kCorrupt, "../x.safetensors"},
      {"the index is not JSON",
       [](const fs::path& d) { WriteText(d / "model.safetensors.index.json", "{\"weight_map\": "); },
       StatusCode::kCorrupt, "model.safetensors.index.json"},
      {"a shard is a symlink",
       [](const fs::path& d) {
         fs::rename(d / "model-00002-of-00002.safetensors", d / "elsewhere");
         fs::create_symlink(d / "elsewhere", d / "model-00002-of-00002.safetensors");
       },
       StatusCode::kInvalidArgument, "model-00002-of-00002.safetensors"},
      {"a shard is truncated",
       [](const fs::path& d) { fs::resize_file(d / "model-00002-of-00002.safetensors", 20); },
       StatusCode::kCorrupt, "model-00002-of-00002.safetensors"},
  };
  for (const Broken& b : cases) {
    SCOPED_TRACE(b.what);
    fs::remove_all(dir_);
    fs::create_directory(dir_);
    Sharded();
    b.apply(dir_);
    auto c = ScanWeights(LocalTree(dir_));
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.error().code(), b.code) << c.error().ToString();
    EXPECT_NE(c.error().message().find(b.needle), std::string::npos) << c.error().ToString();
  }
}

TEST_F(WeightsScanTest, AmbiguousOrEmptyDirectories) {
  EXPECT_FALSE(IsWeightsDirectory(LocalTree(dir_)));
  EXPECT_EQ(ScanWeights(LocalTree(dir_)).error().code(), StatusCode::kNotFound);
  // The same name in two un-indexed safetensors files.
  WriteSafetensors(dir_ / "a.safetensors", {{"w", F32({1}, 0)}});
  WriteSafetensors(dir_ / "b.safetensors", {{"w", F32({1}, 0)}});
  auto c = ScanWeights(LocalTree(dir_));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code(), StatusCode::kCorrupt);
  EXPECT_NE(c.error().message().find("'w' is stored twice"), std::string::npos) << c.error().ToString();
  // Two torch files without an index.
  fs::remove_all(dir_);
  fs::create_directory(dir_);
  WriteText(dir_ / "a.pt", std::string("PK\x03\x04x", 5));  // each begins as a zip does
  WriteText(dir_ / "b.pt", std::string("PK\x03\x04y", 5));
  ASSERT_TRUE(IsWeightsDirectory(LocalTree(dir_)));
  c = ScanWeights(LocalTree(dir_));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code(), StatusCode::kUnsupported);
  // Files named as torch files that are some other program's data: no weights, each named.
  fs::remove_all(dir_);
  fs::create_directory(dir_);
  WriteText(dir_ / "a.bin", "not a torch file");
  WriteText(dir_ / "b.pt", "y");
  c = ScanWeights(LocalTree(dir_));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code(), StatusCode::kNotFound);
  EXPECT_NE(c.error().message().find("a.bin, b.pt: not torch.save files"), std::string::npos) << c.error().ToString();
}

}  // namespace
}  // namespace ucpfs::index
