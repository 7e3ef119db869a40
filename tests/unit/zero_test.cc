// ZeRO partition arithmetic: DeepSpeed's verified examples (docs/formats.md "ZeRO partitions"),
// and seeded properties: both directions agree and tile every element exactly once.
#include "core/layout/zero.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "tests/unit/test_seed.h"

namespace ucpfs::layout {
namespace {

TEST(ZeroFlatGroup, DeepSpeedExampleDp2Total150) {
  // A real engine, dp=2: group 1 totals 150 elements -> padded 152, partitions of 76; rank 1's
  // group_paddings is 2.
  const std::vector<uint64_t> numels = {16, 64, 70};
  Result<ZeroFlatGroup> g = MakeZeroFlatGroup(numels, 2);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->total_elems, 150u);
  EXPECT_EQ(g->padded_elems, 152u);
  EXPECT_EQ(g->partition_elems, 76u);
  EXPECT_EQ(g->PaddingOf(0), 0u);
  EXPECT_EQ(g->PaddingOf(1), 2u);
  // The 70-element parameter starts at 80: in rank 1's window at 4.
  EXPECT_EQ(FragmentsOfParam(*g, 2), (std::vector<ZeroFragment>{{1, 0, 4, 70}}));
  // The 64-element one straddles the boundary at 76.
  EXPECT_EQ(FragmentsOfParam(*g, 1), (std::vector<ZeroFragment>{{0, 0, 16, 60}, {1, 60, 0, 4}}));
}

TEST(ZeroFlatGroup, PaddingCanFillWholeWindows) {
  // 3 elements over dp=4: padded to 8, partitions of 2; ranks 2 and 3 hold only padding.
  const std::vector<uint64_t> numels = {3};
  Result<ZeroFlatGroup> g = MakeZeroFlatGroup(numels, 4);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->padded_elems, 8u);
  EXPECT_EQ(g->PaddingOf(1), 1u);
  EXPECT_EQ(g->PaddingOf(2), 2u);
  EXPECT_EQ(g->PaddingOf(3), 2u);
  EXPECT_TRUE(FragmentsInWindow(*g, 3).empty());
  EXPECT_EQ(MakeZeroFlatGroup(numels, 0).error().code(), StatusCode::kInvalidArgument);
  const std::vector<uint64_t> huge = {UINT64_MAX, 2};
  EXPECT_EQ(MakeZeroFlatGroup(huge, 2).error().code(), StatusCode::kInvalidArgument);
}

TEST(Zero3, PerParameterSlicesAndEmptyRanks) {
  // 1 element over dp=3: rank 0 holds it, ranks 1 and 2 only padding.
  EXPECT_EQ(Zero3PartitionElems(1, 3), 1u);
  EXPECT_EQ(Zero3FragmentOf(1, 3, 0), (ZeroFragment{0, 0, 0, 1}));
  EXPECT_EQ(Zero3FragmentOf(1, 3, 2).n_elems, 0u);
  // 10 over dp=3: pn 4; ranks hold 4, 4, 2.
  EXPECT_EQ(Zero3FragmentOf(10, 3, 1), (ZeroFragment{1, 4, 0, 4}));
  EXPECT_EQ(Zero3FragmentOf(10, 3, 2), (ZeroFragment{2, 8, 0, 2}));
}

TEST(Zero3, SubGroupsCloseAtTheSize) {
  // DeepSpeed with sub_group_size 200 gave sub-groups of 231, 200, 200 elements per rank.
  const std::vector<uint64_t> pn = {31, 200, 150, 50, 120, 80};
  const auto groups = Zero3SubGroups(pn, 200);
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0], (std::pair<size_t, size_t>{0, 2}));
  EXPECT_EQ(groups[1], (std::pair<size_t, size_t>{2, 4}));
  EXPECT_EQ(groups[2], (std::pair<size_t, size_t>{4, 6}));
  EXPECT_EQ(Zero3SubGroups(pn, 1'000'000'000).size(), 1u);
  EXPECT_TRUE(Zero3SubGroups({}, 10).empty());
}

TEST(ZeroFlatGroup, BothDirectionsTileEveryElementOnce) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed());
  for (int round = 0; round < 300; ++round) {
    std::vector<uint64_t> numels(1 + rng() % 8);
    for (auto& n : numels) n = rng() % 5 == 0 ? 0 : rng() % 300;
    const int dp = 1 + static_cast<int>(rng() % 6);
    Result<ZeroFlatGroup> g = MakeZeroFlatGroup(numels, dp);
    ASSERT_TRUE(g.ok());
    ASSERT_EQ(g->padded_elems % (2 * static_cast<uint64_t>(dp)), 0u);
    ASSERT_GE(g->padded_elems, g->total_elems);
    ASSERT_LT(g->padded_elems - g->total_elems, 2 * static_cast<uint64_t>(dp));
    // Parameter -> fragments: consecutive, in rank order, tiling the parameter.
    std::vector<std::vector<IndexedFragment>> by_rank(static_cast<size_t>(dp));
    for (size_t i = 0; i < numels.size(); ++i) {
      uint64_t next = 0;
      int last_rank = -1;
      for (const ZeroFragment& f : FragmentsOfParam(*g, i)) {
        ASSERT_EQ(f.param_elem_offset, next);
        ASSERT_GT(f.dp_rank, last_rank);
        ASSERT_LE(f.partition_elem_offset + f.n_elems, g->partition_elems);
        ASSERT_EQ(g->WindowStart(f.dp_rank) + f.partition_elem_offset, g->param_starts[i] + next);
        next += f.n_elems;
        last_rank = f.dp_rank;
        by_rank[static_cast<size_t>(f.dp_rank)].push_back({i, f});
      }
      ASSERT_EQ(next, numels[i]);
    }
    // Window -> parameters: exactly the same fragments, and the window's real part plus its
    // padding is the whole window.
    for (int d = 0; d < dp; ++d) {
      const auto in_window = FragmentsInWindow(*g, d);
      ASSERT_EQ(in_window.size(), by_rank[static_cast<size_t>(d)].size());
      uint64_t real = 0;
      for (size_t k = 0; k < in_window.size(); ++k) {
        ASSERT_EQ(in_window[k].param, by_rank[static_cast<size_t>(d)][k].param);
        ASSERT_EQ(in_window[k].fragment, by_rank[static_cast<size_t>(d)][k].fragment);
        real += in_window[k].fragment.n_elems;
      }
      ASSERT_EQ(real + g->PaddingOf(d), g->partition_elems);
    }
  }
}

TEST(Zero3, SlicesTileTheParameter) {
  std::mt19937_64 rng(ucpfs::testing::TestSeed() + 1);
  for (int round = 0; round < 300; ++round) {
    const uint64_t numel = rng() % 100;
    const int dp = 1 + static_cast<int>(rng() % 7);
    uint64_t next = 0;
    for (int d = 0; d < dp; ++d) {
      const ZeroFragment f = Zero3FragmentOf(numel, dp, d);
      ASSERT_LE(f.n_elems, Zero3PartitionElems(numel, dp));
      if (f.n_elems == 0) continue;
      ASSERT_EQ(f.param_elem_offset, next);
      next += f.n_elems;
    }
    ASSERT_EQ(next, numel);
  }
}

}  // namespace
}  // namespace ucpfs::layout
