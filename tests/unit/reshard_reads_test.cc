// Reshard reads (views/reshard_reads.h) on a small synthetic torchtitan checkpoint whose
// matrix is known by hand: two source shards split by rows, each holding rows 0-1 (file 0) or
// 2-3 (file 1) of wq and wo (4x4 float32), and file 2 holding wo's exp_avg whole.
//  - tp2: wq is column-parallel (rank r takes rows 2r..2r+1: all of one shard's wq part), wo is
//    row-parallel (rank r takes columns 2r..2r+1: half of each shard's wo part), exp_avg like wo.
//  - dp2 ZeRO-1: each rank's model.pt holds everything; optim.pt's flat fp32 (the weights) and
//    exp_avg are split in halves: rank 0 gets wq (exp_avg: zeros, wq has none), rank 1 wo.
// Also: the tally equals what a real read of every file fetches from each source.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>

#include "core/byte_source.h"
#include "core/layout/layout.h"
#include "tests/unit/counting_source.h"
#include "views/reshard_reads.h"

namespace ucpfs::views {
namespace {

constexpr int kW = static_cast<int>(TargetState::kWeight);
constexpr int kExpAvg = static_cast<int>(TargetState::kExpAvg);

using ::ucpfs::testing::CountingSource;  // counts the bytes actually read, per source

// A fragment of rows [row, row + n_rows) of a 4x4 float32 tensor at byte_offset of file_id.
slice::Fragment Rows(int64_t row, int64_t n_rows, uint32_t file_id, uint64_t byte_offset) {
  slice::Fragment f;
  f.box.offsets = {row, 0};
  f.box.sizes = {n_rows, 4};
  f.flat_hi = f.box.Volume();
  f.file_id = file_id;
  f.byte_offset = byte_offset;
  return f;
}

struct Fixture {
  std::shared_ptr<TargetInput> input;
  std::vector<std::shared_ptr<const CountingSource>> sources;
};

Fixture MakeCheckpoint() {
  Fixture fx;
  // Files 0 and 1: [wq rows, wo rows] (32 + 32 bytes each); file 2: wo's exp_avg (64 bytes).
  const std::vector<std::byte> ones(64, std::byte{1});
  fx.sources = {std::make_shared<CountingSource>("__0_0.distcp", ones),
                std::make_shared<CountingSource>("__1_0.distcp", ones),
                std::make_shared<CountingSource>("exp_avg.bin", ones)};
  auto files = std::make_shared<std::vector<std::shared_ptr<const ByteSource>>>(fx.sources.begin(), fx.sources.end());
  auto in = std::make_shared<TargetInput>();
  const char* names[] = {"layers.0.attention.wq.weight", "layers.0.attention.wo.weight"};
  for (int p = 0; p < 2; ++p) {
    TargetParam tp;
    tp.name = names[p];
    auto w = std::make_shared<slice::TensorLayout>();
    w->shape = {4, 4};
    w->fragments = {Rows(0, 2, 0, 32u * static_cast<uint64_t>(p)), Rows(2, 2, 1, 32u * static_cast<uint64_t>(p))};
    tp.states[kW] = w;
    tp.dtypes[kW] = DType::kFloat32;
    tp.keys[kW] = tp.name;
    if (p == 1) {
      auto m = std::make_shared<slice::TensorLayout>();
      m->shape = {4, 4};
      m->fragments = {Rows(0, 4, 2, 0)};
      tp.states[kExpAvg] = m;
      tp.dtypes[kExpAvg] = DType::kFloat32;
      tp.keys[kExpAvg] = "optim." + tp.name + ".exp_avg";
    }
    in->params.push_back(std::move(tp));
  }
  in->files = files;
  fx.input = in;
  return fx;
}

ReshardReads Compute(const Fixture& fx, const std::string& layout_name) {
  auto layout = layout::ParseLayout(layout_name);
  EXPECT_TRUE(layout.ok());
  auto plan = TargetPlan::Make(fx.input, *layout);
  EXPECT_TRUE(plan.ok()) << plan.error().ToString();
  auto reads = ComputeReshardReads(*plan, *fx.input->files);
  EXPECT_TRUE(reads.ok()) << reads.error().ToString();
  return std::move(*reads);
}

const RankFileReads& File(const RankReads& r, const std::string& name) {
  for (const auto& f : r.files) {
    if (f.name == name) return f;
  }
  ADD_FAILURE() << "rank " << r.rank << " has no " << name;
  return r.files.front();
}

using Bytes = std::vector<uint64_t>;

TEST(ReshardReads, Tp2ReadsHalfOfEachShardForRowParallel) {
  const Fixture fx = MakeCheckpoint();
  const ReshardReads reads = Compute(fx, "tp2_pp1_dp1");
  ASSERT_EQ(reads.ranks.size(), 2u);
  // model.pt: rank r has wq rows 2r..2r+1 (32 bytes, all from file r) and wo columns 2r..2r+1
  // (8 bytes of each of 4 rows: 16 from each file).
  EXPECT_EQ(File(reads.ranks[0], "model.pt").read_n_bytes, (Bytes{48, 16, 0}));
  EXPECT_EQ(File(reads.ranks[1], "model.pt").read_n_bytes, (Bytes{16, 48, 0}));
  // optim.pt: wo's exp_avg columns: half of file 2 each.
  EXPECT_EQ(File(reads.ranks[0], "optim.pt").read_n_bytes, (Bytes{0, 0, 32}));
  EXPECT_EQ(File(reads.ranks[1], "optim.pt").read_n_bytes, (Bytes{0, 0, 32}));
  for (const auto& r : reads.ranks) {
    EXPECT_EQ(r.ReadTotal(), r.PayloadTotal()) << "rank " << r.rank;  // same dtype, no padding
    EXPECT_EQ(r.PayloadTotal(), 64u + 32u);
    for (const auto& f : r.files) EXPECT_EQ(f.zero_n_bytes, 0u);
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(reads.sources[i].read_n_bytes, 64u) << i;
    EXPECT_EQ(reads.sources[i].distinct_n_bytes, 64u) << i;  // every byte read once
    EXPECT_TRUE(reads.sources[i].distinct_exact);
    EXPECT_EQ(reads.sources[i].fan_out, 2) << i;
  }
  EXPECT_EQ(reads.ReadTotal(), 192u);
}

TEST(ReshardReads, Zero1SplitsTheFlatOptimizerState) {
  const Fixture fx = MakeCheckpoint();
  const ReshardReads reads = Compute(fx, "tp1_pp1_dp2_zero1");
  ASSERT_EQ(reads.ranks.size(), 2u);
  for (const auto& r : reads.ranks) {
    EXPECT_EQ(File(r, "model.pt").read_n_bytes, (Bytes{64, 64, 0})) << "rank " << r.rank;
  }
  // Flat fp32 = [wq; wo] (32 elements, padded to a multiple of 4: no padding), 16 per rank.
  const RankFileReads& o0 = File(reads.ranks[0], "optim.pt");
  const RankFileReads& o1 = File(reads.ranks[1], "optim.pt");
  EXPECT_EQ(o0.read_n_bytes, (Bytes{32, 32, 0}));  // fp32 <- wq; exp_avg: wq has none
  EXPECT_EQ(o0.zero_n_bytes, 64u);
  EXPECT_EQ(o1.read_n_bytes, (Bytes{32, 32, 64}));  // fp32 <- wo; exp_avg <- wo's
  EXPECT_EQ(o1.zero_n_bytes, 0u);
  for (const auto* o : {&o0, &o1}) EXPECT_EQ(o->payload_n_bytes, 128u);  // fp32 + exp_avg, 16 elems each
  EXPECT_EQ(reads.sources[0].read_n_bytes, 192u);  // model.pt twice + half of the flat fp32 twice
  EXPECT_EQ(reads.sources[0].distinct_n_bytes, 64u);
  EXPECT_EQ(reads.sources[2].read_n_bytes, 64u);
  EXPECT_EQ(reads.sources[2].fan_out, 1);
}

// The tally is what a real read of each rank file fetches from each source (contiguous runs
// here, so the read fetches exactly those bytes).
TEST(ReshardReads, MatchesTheBytesARealReadFetches) {
  for (const char* name : {"tp2_pp1_dp1", "tp1_pp1_dp2_zero1", "tp1_pp1_dp1"}) {
    const Fixture fx = MakeCheckpoint();
    const ReshardReads reads = Compute(fx, name);
    auto layout = layout::ParseLayout(name);
    ASSERT_TRUE(layout.ok());
    auto plan = TargetPlan::Make(fx.input, *layout);
    ASSERT_TRUE(plan.ok());
    for (int r = 0; r < layout->World(); ++r) {
      auto files = plan->Build(r);
      ASSERT_TRUE(files.ok());
      for (const auto& f : {files->model, files->optim, files->extra}) {
        if (!f) continue;
        std::vector<std::byte> buf(f->Size());
        ASSERT_TRUE(f->ReadAt(0, buf).ok());
      }
    }
    for (size_t i = 0; i < fx.sources.size(); ++i) {
      EXPECT_EQ(fx.sources[i]->bytes_read(), reads.sources[i].read_n_bytes) << name << " file " << i;
    }
  }
}

TEST(ReshardReads, AProviderThatCannotTellIsAnError) {
  // A LazyTorchFile over a provider with no DescribeReads: the tally fails rather than miss it.
  struct Opaque final : format::TensorBytesProvider {
    Status Read(uint64_t, std::span<std::byte> out) const override {
      std::memset(out.data(), 0, out.size());
      return Status::Ok();
    }
  };
  format::SaveValue v = format::SaveValue::Dict();
  v.Set("t", format::SaveValue::Tensor(DType::kFloat32, {2}, std::make_shared<Opaque>()));
  auto file = format::LazyTorchFile::Build(v, "x.pt");
  ASSERT_TRUE(file.ok());
  Status st = (*file)->DescribeReads(0, (*file)->Size(), [](const SourceRun&) {});
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  // A slice of a plain source reports the source's own bytes.
  auto base = std::make_shared<MemorySource>("base", std::vector<std::byte>(100));
  auto slice = SliceSource::Make(base, 10, 50);
  ASSERT_TRUE(slice.ok());
  std::vector<SourceRun> runs;
  ASSERT_TRUE((*slice)->DescribeReads(5, 20, [&](const SourceRun& r) { runs.push_back(r); }).ok());
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].file, base.get());
  EXPECT_EQ(runs[0].byte_offset, 15u);
  EXPECT_EQ(runs[0].ReadBytes(), 20u);
  EXPECT_FALSE((*slice)->DescribeReads(40, 20, [](const SourceRun&) {}).ok());
}

}  // namespace
}  // namespace ucpfs::views
