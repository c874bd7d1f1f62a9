// The connector cores with tensor parallelism: the decode reads the TP plan's head slices
// (tp_plan.h) and notifies exactly the prefill ranks it read from; an engine-level PrefillCore
// (all_ranks) frees a transfer only after every (decode rank, prefill rank) pair notified.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kvbridge/connector/decode_core.h"
#include "kvbridge/connector/prefill_core.h"

namespace kvbridge {
namespace {

constexpr DurationUs kLease = 1000 * kMillisecond;
const std::vector<int32_t> kBlocks = {5, 6, 7};

PrefillCore MakePrefill(int tp, int heads) {
  return PrefillCore({.engine_id = "p0",
                      .tp_size = tp,
                      .all_ranks = true,
                      .num_kv_heads = heads,
                      .lease = kLease});
}

DecodeCore MakeDecode(int tp, int heads) {
  return DecodeCore({.engine_id = "d0",
                     .tp_size = tp,
                     .num_kv_heads = heads,
                     .block_size = 16,
                     .reply_timeout = 100 * kMillisecond,
                     .read_timeout = kLease,
                     .heartbeat_interval = 300 * kMillisecond});
}

ReadDoneMsg Done(int decode_rank, int prefill_rank, int decode_tp) {
  return ReadDoneMsg{.transfer_id = "t1",
                     .prefill_engine_id = "p0",
                     .prefill_rank = prefill_rank,
                     .decode_engine_id = "d0",
                     .decode_rank = decode_rank,
                     .decode_tp_size = decode_tp};
}

template <typename T>
std::vector<T> Of(const std::vector<ConnectorAction>& acts) {
  std::vector<T> out;
  for (const auto& a : acts) {
    if (auto* x = std::get_if<T>(&a)) out.push_back(*x);
  }
  return out;
}

std::vector<std::string> Freed(const std::vector<ConnectorAction>& acts) {
  std::vector<std::string> out;
  for (const auto& f : Of<ReportBlocksFreeAction>(acts)) out.push_back(f.request_id);
  return out;
}

std::vector<HoldReplyMsg> Replies(const std::vector<ConnectorAction>& acts) {
  std::vector<HoldReplyMsg> out;
  for (const auto& s : Of<SendMessageAction>(acts)) {
    if (auto* r = std::get_if<HoldReplyMsg>(&s.msg)) out.push_back(*r);
  }
  return out;
}

std::vector<ReadDoneMsg> ReadDones(const std::vector<ConnectorAction>& acts) {
  std::vector<ReadDoneMsg> out;
  for (const auto& s : Of<SendMessageAction>(acts)) {
    if (auto* m = std::get_if<ReadDoneMsg>(&s.msg)) out.push_back(*m);
  }
  return out;
}

TEST(PrefillCoreTp, FreesOnlyAfterEveryPairOfThePlanNotified) {
  // Prefill TP 2 -> decode TP 1, 4 KV heads: decode rank 0 reads from prefill ranks 0 and 1.
  PrefillCore core = MakePrefill(2, 4);
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  core.OnReadDone(Done(0, 1, 1), 7, 5);
  auto acts = core.TakeActions();
  EXPECT_TRUE(Freed(acts).empty());
  ASSERT_EQ(Replies(acts).size(), 1u);
  EXPECT_TRUE(Replies(acts)[0].hold_valid);
  EXPECT_EQ(Replies(acts)[0].prefill_rank, 1);  // answered as the rank it was sent to
  // A duplicate of the same pair does not count twice.
  core.OnReadDone(Done(0, 1, 1), 8, 6);
  EXPECT_TRUE(Freed(core.TakeActions()).empty());
  core.OnReadDone(Done(0, 0, 1), 9, 7);
  acts = core.TakeActions();
  EXPECT_EQ(Freed(acts), (std::vector<std::string>{"req"}));
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().transfers_completed, 1);
  EXPECT_EQ(core.counters().notifications_ignored, 1);  // the duplicate
}

TEST(PrefillCoreTp, ReplicasNobodyReadsAreNotAwaited) {
  // 2 KV heads over prefill TP 4 (ranks {0,1} hold head 0, {2,3} head 1), decode TP 1: the plan
  // reads head 0 from rank 0 and head 1 from rank 2; ranks 1 and 3 are not awaited.
  PrefillCore core = MakePrefill(4, 2);
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  core.OnReadDone(Done(0, 0, 1), 1, 5);
  EXPECT_TRUE(Freed(core.TakeActions()).empty());
  core.OnReadDone(Done(0, 2, 1), 2, 6);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"req"}));
}

TEST(PrefillCoreTp, DecodeTpLargerThanPrefillWaitsForEveryDecodeRank) {
  // Prefill TP 1 -> decode TP 2: both decode ranks read prefill rank 0.
  PrefillCore core = MakePrefill(1, 8);
  ASSERT_TRUE(core.OnRequestAdded("req", 2, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("0_req", "t1", kBlocks, 0));
  EXPECT_TRUE(core.OnRequestFinished("1_req", "t1", kBlocks, 0));
  core.OnReadDone(Done(1, 0, 2), 1, 5);
  EXPECT_TRUE(Freed(core.TakeActions()).empty());
  core.OnReadDone(Done(0, 0, 2), 2, 6);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"0_req", "1_req"}));
}

TEST(PrefillCoreTp, MissingRankNotificationIsFreedByTheLeaseOnly) {
  PrefillCore core = MakePrefill(2, 4);
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  core.OnReadDone(Done(0, 0, 1), 1, 5);
  core.OnTick(kLease - 1);
  EXPECT_TRUE(Freed(core.TakeActions()).empty());
  EXPECT_EQ(core.NumHeldBlocks(), 3);
  core.OnTick(kLease);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"req"}));
  EXPECT_EQ(core.counters().lease_expired, 1);
  // The late notification is answered "expired", not valid.
  core.OnReadDone(Done(0, 1, 1), 3, kLease + 1);
  auto replies = Replies(core.TakeActions());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_FALSE(replies[0].hold_valid);
  EXPECT_EQ(replies[0].reason, "expired");
}

TEST(PrefillCoreTp, RankOutsideTheEngineIsIgnored) {
  PrefillCore core = MakePrefill(2, 4);
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  core.OnReadDone(Done(0, 2, 1), 1, 5);
  auto acts = core.TakeActions();
  EXPECT_TRUE(Freed(acts).empty());
  ASSERT_EQ(Replies(acts).size(), 1u);
  EXPECT_FALSE(Replies(acts)[0].hold_valid);
  EXPECT_EQ(core.counters().notifications_ignored, 1);
}

TEST(PrefillCoreTp, PerRankCoreCountsOnlyItsOwnPairs) {
  // A per-rank core (all_ranks = false) for prefill rank 1 of TP 2; decode TP 1.
  PrefillCore core({.engine_id = "p0", .rank = 1, .tp_size = 2, .num_kv_heads = 4});
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  core.OnReadDone(Done(0, 0, 1), 1, 5);  // another rank's: ignored
  EXPECT_TRUE(Freed(core.TakeActions()).empty());
  core.OnReadDone(Done(0, 1, 1), 2, 6);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"req"}));
}

KvTransferParams Params(int prefill_tp) {
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.transfer_id = "t1";
  p.remote_engine_id = "p0";
  p.remote_host = "127.0.0.1";
  p.remote_port = 8100;
  p.remote_block_ids = {100, 101, 102};
  p.remote_num_tokens = 40;
  p.tp_size = prefill_tp;
  return p;
}

TEST(DecodeCoreTp, ReadsThePlansHeadSlicesAndNotifiesEachSourceRank) {
  // Prefill TP 2 -> decode TP 1, 4 KV heads: two READs into the two halves of each block.
  DecodeCore core = MakeDecode(1, 4);
  ASSERT_TRUE(core.OnRequestAdded("a", Params(2), 40, 0, 0).ok());
  core.OnBlocksAllocated("a", std::vector<int32_t>{20, 21, 22}, 0, 39, 0);
  auto reads = Of<PostReadAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[0].prefill.rank, 0);
  EXPECT_EQ(reads[0].src_head_begin, 0);
  EXPECT_EQ(reads[0].dst_head_begin, 0);
  EXPECT_EQ(reads[0].head_count, 2);
  EXPECT_EQ(reads[1].prefill.rank, 1);
  EXPECT_EQ(reads[1].src_head_begin, 0);
  EXPECT_EQ(reads[1].dst_head_begin, 2);
  EXPECT_EQ(reads[1].head_count, 2);
  EXPECT_EQ(reads[1].local_block_ids, (std::vector<int32_t>{20, 21, 22}));
  EXPECT_EQ(reads[1].remote_block_ids, (std::vector<int32_t>{100, 101, 102}));
  core.OnReadCompleted(reads[0].read_id, OkStatus(), 1);
  core.OnReadCompleted(reads[1].read_id, OkStatus(), 1);
  auto dones = ReadDones(core.TakeActions());
  ASSERT_EQ(dones.size(), 2u);
  EXPECT_EQ(dones[0].prefill_rank, 0);
  EXPECT_EQ(dones[1].prefill_rank, 1);
  EXPECT_EQ(dones[1].decode_rank, 0);
  EXPECT_EQ(dones[1].decode_tp_size, 1);
  core.OnHoldReply({.transfer_id = "t1",
                    .prefill_engine_id = "p0",
                    .prefill_rank = 0,
                    .decode_engine_id = "d0",
                    .decode_rank = 0,
                    .hold_valid = true},
                   2);
  EXPECT_TRUE(Of<ReportLoadDoneAction>(core.TakeActions()).empty());  // rank 1 not yet
  core.OnHoldReply({.transfer_id = "t1",
                    .prefill_engine_id = "p0",
                    .prefill_rank = 1,
                    .decode_engine_id = "d0",
                    .decode_rank = 0,
                    .hold_valid = true},
                   3);
  EXPECT_EQ(Of<ReportLoadDoneAction>(core.TakeActions()).size(), 1u);
  EXPECT_TRUE(core.Idle());
}

TEST(DecodeCoreTp, HomogeneousTpReadsWholeBlocksRankToRank) {
  DecodeCore core = MakeDecode(2, 4);
  ASSERT_TRUE(core.OnRequestAdded("a", Params(2), 40, 0, 0).ok());
  core.OnBlocksAllocated("a", std::vector<int32_t>{20, 21, 22}, 0, 39, 0);
  auto reads = Of<PostReadAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(reads[r].decode_rank, r);
    EXPECT_EQ(reads[r].prefill.rank, r);
    EXPECT_EQ(reads[r].head_count, 0);  // whole blocks
  }
}

TEST(DecodeCoreTp, DecodeTp2FromPrefillTp1ReadsSubRangesOfOneRank) {
  DecodeCore core = MakeDecode(2, 4);
  ASSERT_TRUE(core.OnRequestAdded("a", Params(1), 40, 0, 0).ok());
  core.OnBlocksAllocated("a", std::vector<int32_t>{20, 21, 22}, 0, 39, 0);
  auto reads = Of<PostReadAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[1].decode_rank, 1);
  EXPECT_EQ(reads[1].prefill.rank, 0);
  EXPECT_EQ(reads[1].src_head_begin, 2);
  EXPECT_EQ(reads[1].dst_head_begin, 0);
  EXPECT_EQ(reads[1].head_count, 2);
}

TEST(DecodeCoreTp, AbortBeforeAdmissionTellsEveryPlannedPrefillRank) {
  DecodeCore core = MakeDecode(1, 2);
  core.OnAbortedBeforeAdmission(Params(4));  // plan: prefill ranks 0 and 2
  auto dones = ReadDones(core.TakeActions());
  ASSERT_EQ(dones.size(), 2u);
  EXPECT_EQ(dones[0].prefill_rank, 0);
  EXPECT_EQ(dones[1].prefill_rank, 2);
  EXPECT_EQ(dones[0].outcome, ReadOutcome::kAborted);
}

TEST(TpCores, EndToEndEveryPairNotifiesAndTheHoldIsFreedOnce) {
  // Table of (Tp, Td, Hkv): run the decode core against the engine-level prefill core.
  struct Case {
    int tp, td, heads;
  };
  for (Case c : {Case{1, 1, 4}, Case{2, 2, 4}, Case{2, 1, 4}, Case{1, 2, 4}, Case{4, 2, 8},
                 Case{2, 4, 8}, Case{4, 1, 2}, Case{1, 4, 1}, Case{4, 4, 2}}) {
    SCOPED_TRACE(std::to_string(c.tp) + "," + std::to_string(c.td) + "," + std::to_string(c.heads));
    PrefillCore p = MakePrefill(c.tp, c.heads);
    DecodeCore d = MakeDecode(c.td, c.heads);
    ASSERT_TRUE(p.OnRequestAdded("req", 1, "t1", 0).ok());
    ASSERT_TRUE(p.OnRequestFinished("req", "t1", kBlocks, 0));
    ASSERT_TRUE(d.OnRequestAdded("a", Params(c.tp), 40, 0, 0).ok());
    d.OnBlocksAllocated("a", std::vector<int32_t>{20, 21, 22}, 0, 39, 0);
    auto reads = Of<PostReadAction>(d.TakeActions());
    int freed = 0, done = 0;
    for (size_t i = 0; i < reads.size(); ++i) {
      d.OnReadCompleted(reads[i].read_id, OkStatus(), 1);
      for (const ReadDoneMsg& m : ReadDones(d.TakeActions())) {
        EXPECT_EQ(freed, 0) << "freed before the last pair notified";
        p.OnReadDone(m, 1, 2);
        auto acts = p.TakeActions();
        freed += static_cast<int>(Freed(acts).size());
        for (const HoldReplyMsg& r : Replies(acts)) {
          EXPECT_TRUE(r.hold_valid);
          d.OnHoldReply(r, 3);
          done += static_cast<int>(Of<ReportLoadDoneAction>(d.TakeActions()).size());
        }
      }
    }
    EXPECT_EQ(freed, 1);
    EXPECT_EQ(done, 1);
    EXPECT_TRUE(p.Idle());
    EXPECT_TRUE(d.Idle());
  }
}

}  // namespace
}  // namespace kvbridge
