// Megatron-Core layer-stacked tensors split per layer and expert: key naming, fragments (size-1
// chunks, whole boxes across layers, strided storage), order, and refusals.
#include "index/mcore_unstack.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ucpfs::index {
namespace {

using Shape = std::vector<int64_t>;

slice::Fragment Frag(Shape offsets, Shape sizes, uint64_t byte_offset, uint64_t flat_lo = 0,
                     uint64_t flat_hi = 0) {
  slice::Fragment f;
  f.box.offsets = std::move(offsets);
  f.box.sizes = std::move(sizes);
  f.byte_offset = byte_offset;
  f.flat_lo = flat_lo;
  f.flat_hi = flat_hi ? flat_hi : f.box.Volume();
  return f;
}

Item Tensor(std::string key, Shape shape, std::vector<slice::Fragment> frags) {
  Item item;
  item.key = std::move(key);
  item.dtype = DType::kFloat32;
  item.layout.shape = std::move(shape);
  item.layout.fragments = std::move(frags);
  return item;
}

Item Bytes(std::string key) {
  Item item;
  item.key = std::move(key);
  item.kind = ItemKind::kBytes;
  return item;
}

std::vector<std::string> Keys(const std::vector<Item>& items) {
  std::vector<std::string> out;
  for (const Item& i : items) out.push_back(i.key);
  return out;
}

TEST(McoreUnstack, StackedAxesAndKeys) {
  EXPECT_EQ(StackedAxes("decoder.layers.self_attention.linear_qkv.weight"), 1);
  EXPECT_EQ(StackedAxes("decoder.layers.3.self_attention.linear_qkv.weight"), 0);
  EXPECT_EQ(StackedAxes("optimizer.state.exp_avg.module.decoder.layers.mlp.linear_fc2.weight"), 1);
  EXPECT_EQ(StackedAxes("decoder.layers.mlp.experts.experts.linear_fc1.weight"), 2);
  EXPECT_EQ(StackedAxes("decoder.layers.mlp.experts.local_experts.linear_fc1.weight"), 2);
  EXPECT_EQ(StackedAxes("embedding.word_embeddings.weight"), 0);
  EXPECT_EQ(StackedAxes("decoder.layers"), 0);  // the last component marks nothing
  EXPECT_EQ(UnstackedKey("module.decoder.layers.mlp.experts.experts.linear_fc1.weight", {2, 1}),
            "module.decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight");
  EXPECT_EQ(UnstackedKey("decoder.layers.final.weight", {7}), "decoder.layers.7.final.weight");
}

// What megatron-core 0.16 writes: each layer's chunk has size 1 on the layer axis.
TEST(McoreUnstack, SizeOneChunksBecomeOneItemPerLayerInLayerOrder) {
  std::vector<Item> items = {
      Tensor("embedding.word_embeddings.weight", {8, 4}, {Frag({0, 0}, {8, 4}, 0)}),
      Tensor("decoder.layers.linear_qkv.weight", {2, 6, 4},
             {Frag({0, 0, 0}, {1, 3, 4}, 100), Frag({0, 3, 0}, {1, 3, 4}, 200), Frag({1, 0, 0}, {1, 3, 4}, 300),
              Frag({1, 3, 0}, {1, 3, 4}, 400)}),
      Bytes("decoder.layers.linear_qkv._extra_state/shard_0_2"),
      Tensor("decoder.layers.linear_proj.weight", {2, 4, 4}, {Frag({1, 0, 0}, {1, 4, 4}, 500), Frag({0, 0, 0}, {1, 4, 4}, 600)}),
      Tensor("decoder.final_layernorm.weight", {4}, {Frag({0}, {4}, 700)}),
  };
  auto out = UnstackMegatronItems(std::move(items));
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  EXPECT_EQ(Keys(*out), (std::vector<std::string>{
                            "embedding.word_embeddings.weight", "decoder.layers.0.linear_qkv.weight",
                            "decoder.layers.0.linear_proj.weight", "decoder.layers.1.linear_qkv.weight",
                            "decoder.layers.1.linear_proj.weight",
                            "decoder.layers.linear_qkv._extra_state/shard_0_2",  // after the run
                            "decoder.final_layernorm.weight"}));
  const Item& qkv1 = (*out)[3];
  EXPECT_EQ(qkv1.layout.shape, (Shape{6, 4}));
  ASSERT_EQ(qkv1.layout.fragments.size(), 2u);
  EXPECT_EQ(qkv1.layout.fragments[0].box, (slice::Box{{0, 0}, {3, 4}}));
  EXPECT_EQ(qkv1.layout.fragments[0].byte_offset, 300u);
  EXPECT_EQ(qkv1.layout.fragments[1].box, (slice::Box{{3, 0}, {3, 4}}));
  EXPECT_EQ(qkv1.layout.fragments[1].flat_hi, 12u);
  EXPECT_EQ((*out)[2].layout.fragments[0].byte_offset, 600u);
  for (const Item& item : *out) {
    if (item.kind == ItemKind::kTensor) {
      EXPECT_TRUE(slice::ValidateCoverage(item.layout, item.key).ok()) << item.key;
    }
  }
}

// Flat ranges with size 1 on the stacked axes (the distributed optimizer's flattened_range) keep
// their range; layers x experts give one item per (layer, expert).
TEST(McoreUnstack, FlatRangesAndExperts) {
  std::vector<Item> items = {
      Tensor("optimizer.state.exp_avg.decoder.layers.linear_fc2.weight", {2, 2, 3},
             {Frag({0, 0, 0}, {1, 2, 3}, 0, 0, 4), Frag({0, 0, 0}, {1, 2, 3}, 64, 4, 6),
              Frag({1, 0, 0}, {1, 2, 3}, 128)}),
      Tensor("decoder.layers.mlp.experts.experts.linear_fc1.weight", {1, 2, 2, 2},
             {Frag({0, 1, 0, 0}, {1, 1, 2, 2}, 16), Frag({0, 0, 0, 0}, {1, 1, 2, 2}, 0)}),
  };
  auto out = UnstackMegatronItems(std::move(items));
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  EXPECT_EQ(Keys(*out), (std::vector<std::string>{
                            "optimizer.state.exp_avg.decoder.layers.0.linear_fc2.weight",
                            "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
                            "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
                            "optimizer.state.exp_avg.decoder.layers.1.linear_fc2.weight"}));
  const Item& l0 = (*out)[0];
  ASSERT_EQ(l0.layout.fragments.size(), 2u);
  EXPECT_EQ(l0.layout.fragments[1].flat_lo, 4u);
  EXPECT_EQ(l0.layout.fragments[1].flat_hi, 6u);
  EXPECT_EQ(l0.layout.fragments[1].byte_offset, 64u);
  EXPECT_EQ((*out)[2].layout.shape, (Shape{2, 2}));
  EXPECT_EQ((*out)[2].layout.fragments[0].byte_offset, 16u);
}

// A whole box over several layers (another saver's single chunk) is cut per layer: contiguous
// storage steps by one layer's bytes, strided storage by the layer axis' stride.
TEST(McoreUnstack, WholeBoxesAcrossLayersAreCut) {
  slice::Fragment strided = Frag({0, 0}, {2, 3}, 1000);
  strided.strides = {1, 2};  // stored transposed
  std::vector<Item> items = {
      Tensor("decoder.layers.linear_proj.weight", {3, 2, 2}, {Frag({0, 0, 0}, {3, 2, 2}, 0)}),
      Tensor("decoder.layers.norm.weight", {2, 3}, {strided}),
  };
  auto out = UnstackMegatronItems(std::move(items));
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  ASSERT_EQ(out->size(), 5u);
  EXPECT_EQ((*out)[0].key, "decoder.layers.0.linear_proj.weight");
  EXPECT_EQ((*out)[2].key, "decoder.layers.1.linear_proj.weight");
  EXPECT_EQ((*out)[2].layout.fragments[0].byte_offset, 16u);  // 4 floats per layer
  EXPECT_EQ((*out)[4].layout.fragments[0].byte_offset, 32u);
  EXPECT_EQ((*out)[3].key, "decoder.layers.1.norm.weight");
  EXPECT_EQ((*out)[3].layout.fragments[0].byte_offset, 1004u);  // layer stride 1 element
  EXPECT_EQ((*out)[3].layout.fragments[0].strides, (Shape{2}));
  EXPECT_EQ((*out)[3].layout.fragments[0].box, (slice::Box{{0}, {3}}));
}

TEST(McoreUnstack, Refusals) {
  // A flat range spanning two layers cannot be cut into boxes.
  std::vector<Item> across = {
      Tensor("decoder.layers.linear_proj.weight", {2, 2}, {Frag({0, 0}, {2, 2}, 0, 1, 3), Frag({0, 0}, {2, 2}, 8, 0, 1),
                                                           Frag({0, 0}, {2, 2}, 16, 3, 4)})};
  auto a = UnstackMegatronItems(std::move(across));
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.error().code(), StatusCode::kUnsupported);
  EXPECT_NE(a.error().message().find("decoder.layers.linear_proj.weight"), std::string::npos);
  // A split key that is also saved as such.
  std::vector<Item> twice = {Tensor("decoder.layers.0.w", {2}, {Frag({0}, {2}, 0)}),
                             Tensor("decoder.layers.w", {1, 2}, {Frag({0, 0}, {1, 2}, 8)})};
  auto t = UnstackMegatronItems(std::move(twice));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().code(), StatusCode::kCorrupt);
  // Not enough dims for the stacked axes: kept as is.
  std::vector<Item> flat = {Tensor("decoder.layers.scale", {}, {Frag({}, {}, 0)})};
  auto f = UnstackMegatronItems(std::move(flat));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(Keys(*f), (std::vector<std::string>{"decoder.layers.scale"}));
}

}  // namespace
}  // namespace ucpfs::index
