// Layout names, rank order and pipeline split: the grammar (valid names, canonical spelling,
// every kind of invalid name with its message), the rank-order bijection over all ranks of
// several layouts (EP included), and the pipeline split formula and --pp-split.
#include <gtest/gtest.h>

#include <set>

#include "core/layout/layout.h"

namespace ucpfs::layout {
namespace {

TEST(ParseLayout, ValidNamesAndCanonicalSpelling) {
  struct Case {
    const char* in;
    int tp, pp, dp, ep, zero;
    const char* canonical;
  };
  const Case cases[] = {
      {"tp1_pp1_dp1", 1, 1, 1, 1, 0, "tp1_pp1_dp1"},
      {"tp2_pp2_dp4", 2, 2, 4, 1, 0, "tp2_pp2_dp4"},
      {"tp8_pp4_dp16_ep4", 8, 4, 16, 4, 0, "tp8_pp4_dp16_ep4"},
      {"tp2_pp1_dp4_zero1", 2, 1, 4, 1, 1, "tp2_pp1_dp4_zero1"},
      {"tp2_pp1_dp4_ep2_zero1", 2, 1, 4, 2, 1, "tp2_pp1_dp4_ep2_zero1"},
      {"tp2_pp1_dp4_ep1_zero0", 2, 1, 4, 1, 0, "tp2_pp1_dp4"},
      {"tp1024_pp1_dp1024", 1024, 1, 1024, 1, 0, "tp1024_pp1_dp1024"},
  };
  for (const Case& c : cases) {
    Result<Layout> l = ParseLayout(c.in);
    ASSERT_TRUE(l.ok()) << c.in << ": " << l.status().ToString();
    EXPECT_EQ(l->tp, c.tp) << c.in;
    EXPECT_EQ(l->pp, c.pp) << c.in;
    EXPECT_EQ(l->dp, c.dp) << c.in;
    EXPECT_EQ(l->ep, c.ep) << c.in;
    EXPECT_EQ(l->zero, c.zero) << c.in;
    EXPECT_EQ(l->name, c.canonical) << c.in;
    EXPECT_EQ(l->World(), c.tp * c.pp * c.dp) << c.in;
    // The canonical name parses to itself.
    Result<Layout> again = ParseLayout(l->name);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->name, l->name);
  }
}

TEST(ParseLayout, InvalidNamesSayWhy) {
  struct Case {
    const char* in;
    const char* message_part;
  };
  const Case cases[] = {
      {"", "empty name"},
      {"tp2_pp2", "missing part 'dp<N>'"},
      {"pp2_dp2", "missing part 'tp<N>'"},
      {"tp2_pp2_dp2_cp2", "unknown part 'cp2'"},
      {"tp2_pp2_dp2_", "empty part"},
      {"tp2__pp2_dp2", "empty part"},
      {"TP2_pp2_dp2", "unknown part 'TP2'"},
      {"tp0_pp1_dp1", "'tp' degree must be >= 1"},
      {"tp_pp1_dp1", "'tp' needs a decimal degree"},
      {"tp2x_pp1_dp1", "'tp' needs a decimal degree, got '2x'"},
      {"tp02_pp1_dp1", "leading zeros"},
      {"tp-2_pp1_dp1", "needs a decimal degree"},
      {"pp2_tp2_dp2", "out of order"},
      {"tp2_pp2_dp2_zero1_ep2", "out of order"},
      {"tp2_tp2_pp2_dp2", "given twice"},
      {"tp2_pp1_dp4_ep3", "ep3 must divide dp4"},
      {"tp2_pp1_dp4_ep0", "'ep' degree must be >= 1"},
      {"tp2_pp1_dp4_zero2", "zero2 not supported"},
      {"tp2_pp1_dp4_zero3", "zero must be 0"},
      {"tp2048_pp1_dp1024", "world size 2097152 exceeds"},
      {"tp99999999_pp1_dp1", "exceeds"},
      {"tp999999999999_pp1_dp1", "exceeds"},
  };
  for (const Case& c : cases) {
    Result<Layout> l = ParseLayout(c.in);
    ASSERT_FALSE(l.ok()) << "'" << c.in << "' should be invalid";
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << c.in;
    EXPECT_NE(l.status().message().find(c.message_part), std::string::npos)
        << c.in << " -> " << l.status().message();
    EXPECT_NE(l.status().message().find("layout '" + std::string(c.in) + "'"), std::string::npos)
        << l.status().message();
  }
}

TEST(RankOrder, MegatronOrderOnAKnownLayout) {
  Layout l = ParseLayout("tp2_pp2_dp3").value();
  // rank = tp + T*(dp + D*pp)
  EXPECT_EQ(CoordsOf(l, 0), (RankCoords{0, 0, 0, 0}));
  EXPECT_EQ(CoordsOf(l, 1), (RankCoords{1, 0, 0, 0}));
  EXPECT_EQ(CoordsOf(l, 2), (RankCoords{0, 0, 1, 0}));
  EXPECT_EQ(CoordsOf(l, 5), (RankCoords{1, 0, 2, 0}));
  EXPECT_EQ(CoordsOf(l, 6), (RankCoords{0, 1, 0, 0}));
  EXPECT_EQ(CoordsOf(l, 11), (RankCoords{1, 1, 2, 0}));
  EXPECT_EQ(RankOf(l, RankCoords{1, 1, 2, 0}), 11);
  EXPECT_EQ(RankOf(l, RankCoords{2, 0, 0, 0}), -1);
  EXPECT_EQ(RankOf(l, RankCoords{0, 2, 0, 0}), -1);
  EXPECT_EQ(RankOf(l, RankCoords{0, 0, -1, 0}), -1);
}

TEST(RankOrder, RoundTripOverAllRanks) {
  for (const char* name : {"tp1_pp1_dp1", "tp2_pp2_dp4", "tp4_pp1_dp8_ep4", "tp1_pp3_dp6_ep3",
                           "tp8_pp4_dp2_ep2_zero1", "tp3_pp5_dp7"}) {
    Layout l = ParseLayout(name).value();
    std::set<std::tuple<int, int, int>> seen;
    for (int rank = 0; rank < l.World(); ++rank) {
      RankCoords c = CoordsOf(l, rank);
      EXPECT_EQ(RankOf(l, c), rank) << name;
      EXPECT_EQ(c.ep, c.dp % l.ep) << name;
      EXPECT_EQ(rank, c.tp + l.tp * (c.dp + l.dp * c.pp)) << name;
      EXPECT_TRUE(seen.insert({c.tp, c.pp, c.dp}).second) << name << " rank " << rank;
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(l.World()));
  }
}

TEST(PipelineSplit, FloorFormula) {
  EXPECT_EQ(PipelineSplit(8, 2, std::nullopt).value(), (std::vector<int>{0, 4, 8}));
  EXPECT_EQ(PipelineSplit(10, 4, std::nullopt).value(), (std::vector<int>{0, 2, 5, 7, 10}));
  EXPECT_EQ(PipelineSplit(7, 3, std::nullopt).value(), (std::vector<int>{0, 2, 4, 7}));
  EXPECT_EQ(PipelineSplit(5, 1, std::nullopt).value(), (std::vector<int>{0, 5}));
  EXPECT_EQ(PipelineSplit(3, 3, std::nullopt).value(), (std::vector<int>{0, 1, 2, 3}));
  // Every L, P: P+1 bounds, from 0 to L, each stage floor(s*L/P).
  for (int l = 1; l <= 40; ++l) {
    for (int p = 1; p <= l; ++p) {
      std::vector<int> b = PipelineSplit(l, p, std::nullopt).value();
      ASSERT_EQ(b.size(), static_cast<size_t>(p) + 1);
      for (int s = 0; s <= p; ++s) EXPECT_EQ(b[static_cast<size_t>(s)], s * l / p);
      for (int s = 0; s < p; ++s) EXPECT_GT(b[static_cast<size_t>(s) + 1], b[static_cast<size_t>(s)]);
    }
  }
}

TEST(PipelineSplit, Errors) {
  Result<std::vector<int>> r = PipelineSplit(3, 4, std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("pp4 exceeds the 3 layers"), std::string::npos);
  EXPECT_FALSE(PipelineSplit(-1, 1, std::nullopt).ok());
  EXPECT_FALSE(PipelineSplit(4, 0, std::nullopt).ok());
  // A model without numbered layers fits one stage, and only one.
  EXPECT_EQ(PipelineSplit(0, 1, std::nullopt).value(), (std::vector<int>{0, 0}));
  EXPECT_FALSE(PipelineSplit(0, 2, std::nullopt).ok());
}

TEST(PipelineSplit, ExplicitLayersPerStage) {
  EXPECT_EQ(PipelineSplit(10, 3, std::vector<int>{3, 4, 3}).value(),
            (std::vector<int>{0, 3, 7, 10}));
  // Zero-layer stages are allowed when asked for.
  EXPECT_EQ(PipelineSplit(4, 3, std::vector<int>{4, 0, 0}).value(),
            (std::vector<int>{0, 4, 4, 4}));
  EXPECT_EQ(PipelineSplit(2, 4, std::vector<int>{0, 1, 1, 0}).value(),
            (std::vector<int>{0, 0, 1, 2, 2}));
  Result<std::vector<int>> wrong_count = PipelineSplit(10, 3, std::vector<int>{5, 5});
  ASSERT_FALSE(wrong_count.ok());
  EXPECT_NE(wrong_count.status().message().find("2 entries for pp3"), std::string::npos);
  Result<std::vector<int>> wrong_sum = PipelineSplit(10, 2, std::vector<int>{5, 4});
  ASSERT_FALSE(wrong_sum.ok());
  EXPECT_NE(wrong_sum.status().message().find("sum to 9, the model has 10"), std::string::npos)
      << wrong_sum.status().message();
  EXPECT_FALSE(PipelineSplit(10, 2, std::vector<int>{11, -1}).ok());
  EXPECT_FALSE(PipelineSplit(10, 2, std::vector<int>{6, 6}).ok());
}

TEST(PipelineSplit, ParseAndStageOfLayer) {
  EXPECT_EQ(ParsePpSplit("3,4,3").value(), (std::vector<int>{3, 4, 3}));
  EXPECT_EQ(ParsePpSplit("0").value(), (std::vector<int>{0}));
  for (const char* bad : {"", "3,,3", "3,", "a", "-1", "3;4", "999999999999"}) {
    Result<std::vector<int>> r = ParsePpSplit(bad);
    EXPECT_FALSE(r.ok()) << bad;
  }
  std::vector<int> b = {0, 3, 3, 7};
  EXPECT_EQ(StageOfLayer(b, 0), 0);
  EXPECT_EQ(StageOfLayer(b, 2), 0);
  EXPECT_EQ(StageOfLayer(b, 3), 2);  // stage 1 is empty
  EXPECT_EQ(StageOfLayer(b, 6), 2);
  EXPECT_EQ(StageOfLayer(b, 7), -1);
  EXPECT_EQ(StageOfLayer(b, -1), -1);
}

}  // namespace
}  // namespace ucpfs::layout
