// Plain values: torch.save blobs of plain data (every kind the writer knows, bytes included)
// decode back to the same description with lazily read tensors; objects that are not plain
// data, and hostile nesting, are refused with the path and the reason.
#include "core/format/plain_value.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "core/format/torch_writer.h"

namespace ucpfs::format {
namespace {

class BytesProvider final : public TensorBytesProvider {
 public:
  explicit BytesProvider(std::vector<std::byte> bytes) : bytes_(std::move(bytes)) {}
  Status Read(uint64_t byte_offset, std::span<std::byte> out) const override {
    if (!out.empty()) std::memcpy(out.data(), bytes_.data() + byte_offset, out.size());
    return Status::Ok();
  }

 private:
  std::vector<std::byte> bytes_;
};

// Renders `root` as a torch.save file held in memory.
std::shared_ptr<const ByteSource> Saved(const SaveValue& root) {
  auto lazy = LazyTorchFile::Build(root, "blob.pt");
  EXPECT_TRUE(lazy.ok()) << lazy.error().ToString();
  std::vector<std::byte> bytes((*lazy)->Size());
  EXPECT_TRUE((*lazy)->ReadAt(0, bytes).ok());
  return std::make_shared<MemorySource>("blob.pt", std::move(bytes));
}

std::vector<std::byte> TensorBytes(const SaveValue& v) {
  uint64_t n = ItemSize(v.tensor().dtype);
  for (int64_t d : v.tensor().shape) n *= static_cast<uint64_t>(d);
  std::vector<std::byte> out(n);
  EXPECT_TRUE(v.tensor().provider->Read(0, out).ok());
  return out;
}

TEST(PlainValue, RoundTripsEveryPlainKind) {
  std::vector<std::byte> data(24);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i * 7 + 1);
  SaveValue tensor = SaveValue::Tensor(DType::kFloat32, {2, 3}, std::make_shared<BytesProvider>(data));
  SaveValue inner = SaveValue::OrderedDict();
  inner.Set(SaveValue::Int(3), SaveValue::Str("three"));
  inner.Set("neg", SaveValue::Int(-70000));
  SaveValue root = SaveValue::Dict();
  root.Set("none", SaveValue::None());
  root.Set("yes", SaveValue::Bool(true));
  root.Set("big", SaveValue::Int(int64_t{1} << 40));
  root.Set("lr", SaveValue::Float(3e-4));
  root.Set("name", SaveValue::Str("h\xc3\xa9llo"));
  root.Set("raw", SaveValue::Bytes(std::string("\x00\xff\x80" "abc\x7f", 7)));
  root.Set("list", SaveValue::List({SaveValue::Int(1), SaveValue::Str("x")}));
  root.Set("betas", SaveValue::Tuple({SaveValue::Float(0.9), SaveValue::Float(0.95)}));
  root.Set("inner", inner);
  root.Set("t", tensor);

  auto decoded = DecodePlainValue(Saved(root));
  ASSERT_TRUE(decoded.ok()) << decoded.error().ToString();
  ASSERT_EQ(decoded->kind(), SaveValue::Kind::kDict);
  const auto& items = decoded->dict_items();
  ASSERT_EQ(items.size(), root.dict_items().size());
  for (size_t i = 0; i + 1 < items.size(); ++i) {  // all but the tensor compare structurally
    EXPECT_TRUE(items[i].first.SameAs(root.dict_items()[i].first)) << i;
    EXPECT_TRUE(items[i].second.SameAs(root.dict_items()[i].second)) << items[i].first.string_value();
  }
  EXPECT_TRUE(items[8].second.ordered());
  const SaveValue& t = items.back().second;
  ASSERT_EQ(t.kind(), SaveValue::Kind::kTensor);
  EXPECT_EQ(t.tensor().dtype, DType::kFloat32);
  EXPECT_EQ(t.tensor().shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(TensorBytes(t), data);

  // What is decoded can be written again: the value survives a second round trip.
  auto again = DecodePlainValue(Saved(*decoded));
  ASSERT_TRUE(again.ok()) << again.error().ToString();
  EXPECT_TRUE(again->dict_items()[5].second.SameAs(root.dict_items()[5].second));
  EXPECT_EQ(TensorBytes(again->dict_items().back().second), data);
}

TEST(PlainValue, RefusesObjectsWithThePath) {
  SaveValue root = SaveValue::Dict();
  SaveValue sched = SaveValue::Dict();
  sched.Set("state", SaveValue::OrderedDict());
  root.Set("lr_scheduler", sched);
  auto src = Saved(root);
  // Rename the OrderedDict class so the pickle holds an arbitrary class instance.
  std::vector<std::byte> bytes(src->Size());
  ASSERT_TRUE(src->ReadAt(0, bytes).ok());
  const std::string from = "collections\nOrderedDict", to = "evilmodule\nOrderedDictX";
  ASSERT_EQ(from.size(), to.size());
  auto* p = reinterpret_cast<char*>(bytes.data());
  auto it = std::search(p, p + bytes.size(), from.begin(), from.end());
  ASSERT_NE(it, p + bytes.size());
  std::copy(to.begin(), to.end(), it);
  auto decoded = DecodePlainValue(std::make_shared<MemorySource>("sched.pt", std::move(bytes)));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.error().code(), StatusCode::kUnsupported);
  const std::string& msg = decoded.error().message();
  EXPECT_NE(msg.find("sched.pt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'lr_scheduler.state'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("evilmodule.OrderedDictX"), std::string::npos) << msg;
}

// keep_objects: instances are re-emitted as their pickle built them (what DeepSpeed's universal
// optimizer_state.pt needs: a NEWOBJ + BUILD LossScaler, a REDUCE enum), tensors keep
// requires_grad; the writer's output decodes to the same description again.
TEST(PlainValue, KeepsObjectsAndRequiresGrad) {
  std::vector<std::byte> data(8, std::byte{7});
  SaveTensor t{DType::kFloat32, {2}, std::make_shared<BytesProvider>(data)};
  t.requires_grad = true;
  SaveValue state = SaveValue::Dict();
  state.Set("cur_scale", SaveValue::Float(1.0));
  state.Set("dynamic", SaveValue::Bool(false));
  SaveValue scaler = SaveValue::Object(SaveValue::Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                                       SaveValue::Tuple(), /*newobj=*/true, state);
  SaveValue stage = SaveValue::Object(SaveValue::Global("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                                      SaveValue::Tuple({SaveValue::Int(3)}), /*newobj=*/false);
  SaveValue listy = SaveValue::Object(SaveValue::Global("m", "MyList"), SaveValue::Tuple(), true, std::nullopt,
                                      {SaveValue::Int(1), SaveValue::Int(2)},
                                      {{SaveValue::Str("k"), SaveValue::Int(3)}});
  SaveValue root = SaveValue::Dict();
  root.Set("loss_scaler", scaler);
  root.Set("zero_stage", stage);
  root.Set("listy", listy);
  root.Set("dtype", SaveValue::Global("torch", "float32"));
  root.Set("fp32", SaveValue::Tensor(t));

  // Plain decoding refuses the objects; keep_objects brings them back.
  EXPECT_EQ(DecodePlainValue(Saved(root)).status().code(), StatusCode::kUnsupported);
  PlainValueLimits keep;
  keep.keep_objects = true;
  auto decoded = DecodePlainValue(Saved(root), keep);
  ASSERT_TRUE(decoded.ok()) << decoded.error().ToString();
  const auto& items = decoded->dict_items();
  ASSERT_EQ(items.size(), 5u);
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(items[i].second.SameAs(root.dict_items()[i].second)) << i;
  const SaveValue& got = items[4].second;
  ASSERT_EQ(got.kind(), SaveValue::Kind::kTensor);
  EXPECT_TRUE(got.tensor().requires_grad);
  EXPECT_EQ(TensorBytes(got), data);
  EXPECT_TRUE(items[0].second.newobj());
  EXPECT_TRUE(items[0].second.has_state());
  EXPECT_FALSE(items[1].second.newobj());

  // A global holding a newline would inject pickle opcodes: refused by the writer.
  SaveValue bad = SaveValue::Global("os\nsystem", "x");
  EXPECT_EQ(LazyTorchFile::Build(bad, "bad.pt").status().code(), StatusCode::kInvalidArgument);
}

TEST(PlainValue, BoundsNesting) {
  SaveValue v = SaveValue::Int(1);
  for (int i = 0; i < 80; ++i) v = SaveValue::List({v});
  auto decoded = DecodePlainValue(Saved(v));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.error().code(), StatusCode::kResourceExhausted);
  PlainValueLimits deep;
  deep.max_depth = 100;
  EXPECT_TRUE(DecodePlainValue(Saved(v), deep).ok());
  PlainValueLimits few;
  few.max_nodes = 10;
  auto capped = DecodePlainValue(Saved(v), few);
  ASSERT_FALSE(capped.ok());
  EXPECT_EQ(capped.error().code(), StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace ucpfs::format
