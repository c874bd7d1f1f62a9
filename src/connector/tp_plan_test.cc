#include "kvbridge/connector/tp_plan.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace kvbridge {
namespace {

using Pairs = std::vector<std::pair<int, int>>;

TEST(TpRankHeads, SplitsEvenlyAndReplicatesWhenFewerHeadsThanRanks) {
  EXPECT_EQ(TpRankHeads(0, 1, 8), (TpHeadRange{0, 8}));
  EXPECT_EQ(TpRankHeads(1, 2, 8), (TpHeadRange{4, 4}));
  EXPECT_EQ(TpRankHeads(3, 4, 8), (TpHeadRange{6, 2}));
  EXPECT_EQ(TpRankHeads(0, 4, 2), (TpHeadRange{0, 1}));
  EXPECT_EQ(TpRankHeads(1, 4, 2), (TpHeadRange{0, 1}));
  EXPECT_EQ(TpRankHeads(2, 4, 2), (TpHeadRange{1, 1}));
  EXPECT_EQ(TpRankHeads(3, 4, 1), (TpHeadRange{0, 1}));
  EXPECT_EQ(TpRankHeads(4, 4, 8), (TpHeadRange{0, 0}));  // out of range
}

// Simulates a READ of every slice: each prefill rank's half block holds, at every byte, the
// global head that byte belongs to; after copying, each decode byte must hold its own global
// head and have been written exactly once.
void CheckCoverage(const TpPlanInput& in) {
  SCOPED_TRACE("Tp=" + std::to_string(in.prefill_tp) + " Td=" + std::to_string(in.decode_tp) +
               " Hkv=" + std::to_string(in.num_kv_heads));
  auto plan = PlanTpTransfer(in);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const uint64_t per_head = static_cast<uint64_t>(in.block_size) * in.head_dim * in.dtype_bytes;
  std::vector<std::vector<int>> src(static_cast<size_t>(in.prefill_tp));
  for (int p = 0; p < in.prefill_tp; ++p) {
    const TpHeadRange r = TpRankHeads(p, in.prefill_tp, in.num_kv_heads);
    ASSERT_EQ(plan->PrefillHalfBlockBytes(p), per_head * r.count);
    for (int j = 0; j < r.count; ++j) {
      for (uint64_t b = 0; b < per_head; ++b) src[p].push_back(r.begin + j);
    }
  }
  uint64_t read_bytes = 0, needed_bytes = 0;
  std::set<std::pair<int, int>> seen_pairs;
  for (int d = 0; d < in.decode_tp; ++d) {
    const TpHeadRange r = TpRankHeads(d, in.decode_tp, in.num_kv_heads);
    const uint64_t half = plan->DecodeHalfBlockBytes(d);
    ASSERT_EQ(half, per_head * r.count);
    needed_bytes += half;
    std::vector<int> dst(half, -1);
    std::vector<int> writes(half, 0);
    for (const TpSlice& s : plan->ForDecodeRank(d)) {
      EXPECT_TRUE(seen_pairs.insert({s.decode_rank, s.prefill_rank}).second) << "pair twice";
      ASSERT_EQ(s.src_range.length, s.dst_range.length);
      ASSERT_EQ(s.src_range.length, per_head * s.head_count);
      ASSERT_LE(s.src_range.offset + s.src_range.length, src[s.prefill_rank].size());
      ASSERT_LE(s.dst_range.offset + s.dst_range.length, half);
      EXPECT_EQ(s.src_whole, s.src_range.length == src[s.prefill_rank].size());
      EXPECT_EQ(s.dst_whole, s.dst_range.length == half);
      read_bytes += s.src_range.length;
      for (uint64_t i = 0; i < s.src_range.length; ++i) {
        dst[s.dst_range.offset + i] = src[s.prefill_rank][s.src_range.offset + i];
        ++writes[s.dst_range.offset + i];
      }
    }
    for (uint64_t b = 0; b < half; ++b) {
      ASSERT_EQ(writes[b], 1) << "decode rank " << d << " byte " << b;
      ASSERT_EQ(dst[b], r.begin + static_cast<int>(b / per_head)) << "decode rank " << d;
    }
  }
  EXPECT_EQ(read_bytes, needed_bytes);  // each needed byte read once, nothing more
  // Notification accounting agrees with the slices.
  for (int p = 0; p < in.prefill_tp; ++p) {
    for (int d : plan->DecodeRanksReadingFrom(p)) EXPECT_TRUE(seen_pairs.count({d, p}));
  }
  EXPECT_EQ(TpPlanPairs(in.prefill_tp, in.decode_tp, in.num_kv_heads), plan->Pairs());
}

TEST(PlanTpTransfer, EveryNeededByteCoveredExactlyOnce) {
  const std::vector<std::pair<int, int>> tps = {{1, 1}, {2, 2}, {2, 1}, {1, 2}, {4, 2},
                                                {2, 4}, {4, 1}, {1, 4}, {4, 4}, {8, 2}};
  int cases = 0;
  for (auto [tp, td] : tps) {
    for (int hkv : {1, 2, 4, 8}) {
      for (int dtype : {4, 2, 1}) {
        CheckCoverage({.prefill_tp = tp,
                       .decode_tp = td,
                       .num_kv_heads = hkv,
                       .head_dim = 8,
                       .block_size = 4,
                       .dtype_bytes = dtype});
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 120);
}

TEST(PlanTpTransfer, UnevenHeadSplits) {
  CheckCoverage({.prefill_tp = 2,
                 .decode_tp = 3,
                 .num_kv_heads = 3,
                 .head_dim = 2,
                 .block_size = 2,
                 .dtype_bytes = 4});
  CheckCoverage({.prefill_tp = 3,
                 .decode_tp = 2,
                 .num_kv_heads = 5,
                 .head_dim = 2,
                 .block_size = 2,
                 .dtype_bytes = 2});
}

TEST(PlanTpTransfer, HomogeneousIsRankToRankWholeBlocks) {
  auto plan = PlanTpTransfer({.prefill_tp = 2,
                              .decode_tp = 2,
                              .num_kv_heads = 4,
                              .head_dim = 64,
                              .block_size = 16,
                              .dtype_bytes = 4});
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->slices.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const TpSlice& s = plan->slices[r];
    EXPECT_EQ(s.decode_rank, r);
    EXPECT_EQ(s.prefill_rank, r);
    EXPECT_EQ(s.head_count, 2);
    EXPECT_EQ(s.src_range, (TpByteRange{0, 2 * 16 * 64 * 4}));
    EXPECT_TRUE(s.src_whole);
    EXPECT_TRUE(s.dst_whole);
  }
}

TEST(PlanTpTransfer, PrefillTp2ToDecodeTp1ReadsBothHalvesIntoPlace) {
  auto plan = PlanTpTransfer({.prefill_tp = 2,
                              .decode_tp = 1,
                              .num_kv_heads = 4,
                              .head_dim = 8,
                              .block_size = 16,
                              .dtype_bytes = 4});
  ASSERT_TRUE(plan.ok());
  const uint64_t head = 16 * 8 * 4;
  ASSERT_EQ(plan->slices.size(), 2u);
  EXPECT_EQ(plan->slices[0].prefill_rank, 0);
  EXPECT_EQ(plan->slices[0].src_range, (TpByteRange{0, 2 * head}));
  EXPECT_EQ(plan->slices[0].dst_range, (TpByteRange{0, 2 * head}));
  EXPECT_TRUE(plan->slices[0].src_whole);
  EXPECT_FALSE(plan->slices[0].dst_whole);
  EXPECT_EQ(plan->slices[1].prefill_rank, 1);
  EXPECT_EQ(plan->slices[1].src_range, (TpByteRange{0, 2 * head}));
  EXPECT_EQ(plan->slices[1].dst_range, (TpByteRange{2 * head, 2 * head}));
}

TEST(PlanTpTransfer, PrefillTp1ToDecodeTp2ReadsSubRanges) {
  auto plan = PlanTpTransfer({.prefill_tp = 1,
                              .decode_tp = 2,
                              .num_kv_heads = 4,
                              .head_dim = 8,
                              .block_size = 16,
                              .dtype_bytes = 2});
  ASSERT_TRUE(plan.ok());
  const uint64_t head = 16 * 8 * 2;
  EXPECT_EQ(plan->Pairs(), (Pairs{{0, 0}, {1, 0}}));
  EXPECT_EQ(plan->slices[1].src_range, (TpByteRange{2 * head, 2 * head}));
  EXPECT_EQ(plan->slices[1].dst_range, (TpByteRange{0, 2 * head}));
  EXPECT_FALSE(plan->slices[1].src_whole);
  EXPECT_TRUE(plan->slices[1].dst_whole);
  EXPECT_EQ(plan->DecodeRanksReadingFrom(0), (std::vector<int>{0, 1}));
}

TEST(PlanTpTransfer, ReplicatedHeadsSpreadOverReplicasDeterministically) {
  // Hkv = 2 < Tp = 4: prefill ranks {0,1} hold head 0, {2,3} head 1. Same TP on the decode:
  // each decode replica reads its own rank's copy.
  EXPECT_EQ(TpPlanPairs(4, 4, 2), (Pairs{{0, 0}, {1, 1}, {2, 2}, {3, 3}}));
  // Decode TP 1 holds both heads: it reads head 0 from rank 0 and head 1 from rank 2; prefill
  // ranks 1 and 3 are neither read nor notified.
  EXPECT_EQ(TpPlanPairs(4, 1, 2), (Pairs{{0, 0}, {0, 2}}));
  // Hkv = 1: every rank holds the one head.
  EXPECT_EQ(TpPlanPairs(4, 2, 1), (Pairs{{0, 0}, {1, 1}}));
  EXPECT_EQ(TpPlanPairs(2, 4, 1), (Pairs{{0, 0}, {1, 1}, {2, 0}, {3, 1}}));
  EXPECT_EQ(TpPlanPairs(1, 4, 2), (Pairs{{0, 0}, {1, 0}, {2, 0}, {3, 0}}));
  auto plan = PlanTpTransfer({.prefill_tp = 4,
                              .decode_tp = 1,
                              .num_kv_heads = 2,
                              .head_dim = 2,
                              .block_size = 2,
                              .dtype_bytes = 4});
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->DecodeRanksReadingFrom(1).empty());
  EXPECT_EQ(plan->DecodeRanksReadingFrom(2), (std::vector<int>{0}));
}

TEST(PlanTpTransfer, MatchesTheEvenSplitPairsWhenHeadsDivide) {
  EXPECT_EQ(TpPlanPairs(2, 4, 8), (Pairs{{0, 0}, {1, 0}, {2, 1}, {3, 1}}));
  EXPECT_EQ(TpPlanPairs(4, 1, 8), (Pairs{{0, 0}, {0, 1}, {0, 2}, {0, 3}}));
  EXPECT_EQ(TpPlanPairs(4, 2, 8), (Pairs{{0, 0}, {0, 1}, {1, 2}, {1, 3}}));
}

TEST(PlanTpTransfer, RejectsBadSizes) {
  EXPECT_EQ(PlanTpTransfer({.prefill_tp = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanTpTransfer({.decode_tp = 2000}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanTpTransfer({.num_kv_heads = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanTpTransfer({.dtype_bytes = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(TpPlanPairs(0, 1, 1).empty());
}

}  // namespace
}  // namespace kvbridge
