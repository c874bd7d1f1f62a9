// The connector cores with tensor parallelism: the decode reads the TP plan's head slices
// (tp_plan.h) and notifies exactly the prefill ranks it read from; an engine-level PrefillCore
// (every rank's) frees a transfer only after every (decode rank, prefill rank) pair notified. WRITE
// mode with replicated KV heads (Tp > Td): the prefill ranks the plan writes nothing from are
// settled by the decode's skip, and the engine's blocks are freed once, when the last writing
// pair drained — never by the lease.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kvbridge/connector/decode_core.h"
#include "kvbridge/connector/prefill_core.h"
#include "kvbridge/connector/write_decode_core.h"
#include "kvbridge/connector/write_prefill_core.h"

namespace kvbridge {
namespace {

constexpr DurationUs kLease = 1000 * kMillisecond;
const std::vector<int32_t> kBlocks = {5, 6, 7};

PrefillCore MakePrefill(int tp, int heads) {
  return PrefillCore({.engine_id = "p0", .tp_size = tp, .num_kv_heads = heads, .lease = kLease});
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

TEST(PrefillCoreTp, EachRanksPairCountsOnceAndARankOutsideTheEngineIsIgnored) {
  // The production core (every rank) of prefill TP 2; decode TP 1.
  PrefillCore core({.engine_id = "p0", .tp_size = 2, .num_kv_heads = 4});
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  core.OnReadDone(Done(0, 2, 1), 1, 4);  // no prefill rank 2 here: ignored
  EXPECT_TRUE(Freed(core.TakeActions()).empty());
  EXPECT_EQ(core.counters().notifications_ignored, 1);
  core.OnReadDone(Done(0, 1, 1), 2, 5);  // rank 1's pair: rank 0's still expected
  EXPECT_TRUE(Freed(core.TakeActions()).empty());
  core.OnReadDone(Done(0, 0, 1), 3, 6);
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
  EXPECT_TRUE(core.OnBlocksAllocated("a", std::vector<int32_t>{20, 21, 22}, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[0].peer.rank, 0);
  EXPECT_EQ(reads[0].src_head_begin, 0);
  EXPECT_EQ(reads[0].dst_head_begin, 0);
  EXPECT_EQ(reads[0].head_count, 2);
  EXPECT_EQ(reads[1].peer.rank, 1);
  EXPECT_EQ(reads[1].src_head_begin, 0);
  EXPECT_EQ(reads[1].dst_head_begin, 2);
  EXPECT_EQ(reads[1].head_count, 2);
  EXPECT_EQ(reads[1].local_block_ids, (std::vector<int32_t>{20, 21, 22}));
  EXPECT_EQ(reads[1].remote_block_ids, (std::vector<int32_t>{100, 101, 102}));
  core.OnReadCompleted(reads[0].id, OkStatus(), 1);
  core.OnReadCompleted(reads[1].id, OkStatus(), 1);
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
  EXPECT_TRUE(core.OnBlocksAllocated("a", std::vector<int32_t>{20, 21, 22}, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(reads[r].local_rank, r);
    EXPECT_EQ(reads[r].peer.rank, r);
    EXPECT_EQ(reads[r].head_count, 0);  // whole blocks
  }
}

TEST(DecodeCoreTp, DecodeTp2FromPrefillTp1ReadsSubRangesOfOneRank) {
  DecodeCore core = MakeDecode(2, 4);
  ASSERT_TRUE(core.OnRequestAdded("a", Params(1), 40, 0, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("a", std::vector<int32_t>{20, 21, 22}, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[1].local_rank, 1);
  EXPECT_EQ(reads[1].peer.rank, 0);
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
    EXPECT_TRUE(d.OnBlocksAllocated("a", std::vector<int32_t>{20, 21, 22}, 0, 39, 0).ok());
    auto reads = Of<PostTransferAction>(d.TakeActions());
    int freed = 0, done = 0;
    for (size_t i = 0; i < reads.size(); ++i) {
      d.OnReadCompleted(reads[i].id, OkStatus(), 1);
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

// ---- WRITE mode with replicated KV heads ----

constexpr int kWriteLayers = 2;
const std::vector<int32_t> kPrefillTable = {10, 11, 12};  // 40 tokens
const std::vector<int32_t> kDecodeTable = {0, 1, 2};

KvTransferParams WriteParams(int prefill_tp) {
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.transfer_id = "w1";
  p.mode = KvTransferMode::kWrite;
  p.remote_engine_id = "p0";
  p.remote_host = "127.0.0.1";
  p.remote_port = 1;
  p.tp_size = prefill_tp;
  return p;
}

WritePrefillCore MakeWritePrefill(int tp, int heads) {
  return WritePrefillCore({.engine_id = "p0",
                           .tp_size = tp,
                           .num_kv_heads = heads,
                           .block_size = 16,
                           .num_layers = kWriteLayers,
                           .lease = kLease});
}

WriteDecodeCore MakeWriteDecode(int tp, int heads) {
  return WriteDecodeCore({.engine_id = "d0",
                          .tp_size = tp,
                          .num_kv_heads = heads,
                          .block_size = 16,
                          .write_timeout = kLease + 500 * kMillisecond});
}

template <typename M>
std::vector<M> Msgs(const std::vector<ConnectorAction>& acts) {
  std::vector<M> out;
  for (const auto& s : Of<SendMessageAction>(acts)) {
    if (auto* m = std::get_if<M>(&s.msg)) out.push_back(*m);
  }
  return out;
}

// Delivers decode -> prefill messages.
void Deliver(WritePrefillCore& p, const std::vector<ConnectorAction>& decode_acts, TimePoint now) {
  for (const auto& s : Of<SendMessageAction>(decode_acts)) {
    if (auto* wb = std::get_if<WriteBlocksMsg>(&s.msg)) p.OnWriteBlocks(*wb, now);
    if (auto* wc = std::get_if<WriteCancelMsg>(&s.msg)) p.OnWriteCancel(*wc, now);
  }
}

TEST(WriteCoresTp, DecodeSkipsThePrefillRanksThePlanWritesNothingFrom) {
  // Prefill TP 4 -> decode TP 1, 2 KV heads: decode rank 0 gets head 0 from prefill rank 0 and
  // head 1 from prefill rank 2; ranks 1 and 3 hold replicas and are told at admission.
  WriteDecodeCore d = MakeWriteDecode(1, 2);
  auto m = d.OnRequestAdded("a", WriteParams(4), 40, 0, 0);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->num_external_tokens, 39);
  auto acts = d.TakeActions();
  auto skips = Msgs<WriteCancelMsg>(acts);
  ASSERT_EQ(acts.size(), 2u);
  ASSERT_EQ(skips.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(skips[i].prefill_rank, 2 * static_cast<int>(i) + 1);
    EXPECT_EQ(skips[i].decode_rank, 0);
    EXPECT_EQ(skips[i].decode_tp_size, 1);
    EXPECT_EQ(skips[i].transfer_id, "w1");
    EXPECT_EQ(skips[i].prefill_engine_id, "p0");
    EXPECT_FALSE(skips[i].want_done);
  }
  EXPECT_TRUE(d.OnBlocksAllocated("a", kDecodeTable, 0, 39, 1).ok());
  auto wbs = Msgs<WriteBlocksMsg>(d.TakeActions());
  ASSERT_EQ(wbs.size(), 2u);
  EXPECT_EQ(wbs[0].prefill_rank, 0);
  EXPECT_EQ(wbs[1].prefill_rank, 2);
  EXPECT_TRUE(d.OnRequestAborted("a", 2));                      // block ids sent: keep the blocks
  EXPECT_EQ(Msgs<WriteCancelMsg>(d.TakeActions()).size(), 2u);  // to ranks 0 and 2 only

  // Every prefill rank is a source when the heads split evenly (no skip); and aborted while
  // queued, the decode tells all four ranks, the replicas included.
  WriteDecodeCore even = MakeWriteDecode(1, 4);
  ASSERT_TRUE(even.OnRequestAdded("b", WriteParams(4), 40, 0, 0).ok());
  EXPECT_TRUE(even.TakeActions().empty());
  WriteDecodeCore queued = MakeWriteDecode(1, 2);
  queued.OnAbortedBeforeAdmission(WriteParams(4));
  std::vector<int> ranks;
  for (const WriteCancelMsg& c : Msgs<WriteCancelMsg>(queued.TakeActions())) {
    EXPECT_FALSE(c.want_done);
    ranks.push_back(c.prefill_rank);
  }
  EXPECT_EQ(ranks, (std::vector<int>{0, 2, 1, 3}));
}

TEST(WriteCoresTp, ReplicaRanksReleaseAtTheSkipAndTheBlocksAreFreedOnceAfterTheLastWrite) {
  WritePrefillCore p = MakeWritePrefill(4, 2);
  WriteDecodeCore d = MakeWriteDecode(1, 2);
  ASSERT_TRUE(p.OnRequestAdded("p-1", 1, "w1", 40, 0).ok());
  ASSERT_TRUE(d.OnRequestAdded("a", WriteParams(4), 40, 0, 0).ok());
  Deliver(p, d.TakeActions(), 1);  // the skips to ranks 1 and 3
  EXPECT_TRUE(p.TakeActions().empty());
  EXPECT_TRUE(d.OnBlocksAllocated("a", kDecodeTable, 0, 39, 1).ok());
  Deliver(p, d.TakeActions(), 2);
  std::vector<PostTransferAction> writes;
  for (int l = 0; l < kWriteLayers; ++l) {
    p.OnLayerComputed("p-1", l, kPrefillTable, 3);
    for (const auto& w : Of<PostTransferAction>(p.TakeActions())) writes.push_back(w);
  }
  // Two layers from each writing rank (0 and 2), none from the replicas.
  ASSERT_EQ(writes.size(), 4u);
  for (const auto& w : writes) {
    EXPECT_TRUE(w.local_rank == 0 || w.local_rank == 2) << w.local_rank;
    EXPECT_EQ(w.peer.rank, 0);
  }
  // Finished with writes in flight: held (by ranks 0 and 2 only).
  EXPECT_TRUE(p.OnRequestFinished("p-1", kPrefillTable, 4));
  EXPECT_EQ(p.NumHeldBlocks(), 3);
  std::vector<std::string> freed;
  std::vector<WriteDoneMsg> dones;
  for (size_t i = 0; i < writes.size(); ++i) {
    EXPECT_TRUE(freed.empty()) << "freed before the last writing pair drained";
    p.OnWriteCompleted(writes[i].id, OkStatus(), 5 + static_cast<TimePoint>(i));
    auto acts = p.TakeActions();
    for (const auto& f : Freed(acts)) freed.push_back(f);
    // Layer 1's WRITEs were posted with layer 0's in flight: WriteDone follows as a message.
    EXPECT_FALSE(writes[i].notification.has_value());
    for (const WriteDoneMsg& w : Msgs<WriteDoneMsg>(acts)) dones.push_back(w);
  }
  EXPECT_EQ(freed, (std::vector<std::string>{"p-1"}));  // once, at the last write
  ASSERT_EQ(dones.size(), 2u);
  for (const WriteDoneMsg& w : dones) d.OnWriteDone(w, 9);
  EXPECT_EQ(Of<ReportLoadDoneAction>(d.TakeActions()).size(), 1u);
  // Nothing waits for the lease: past it, no expiry and no second free.
  p.OnTick(10 * kLease);
  d.OnTick(10 * kLease);
  EXPECT_TRUE(p.TakeActions().empty());
  EXPECT_TRUE(d.TakeActions().empty());
  const WritePrefillCore::Counters c = p.counters();
  EXPECT_EQ(c.lease_expired, 0);
  EXPECT_EQ(c.transfers_completed, 4);  // every rank: two by their writes, two by the skip
  EXPECT_EQ(c.targets_ok, 2);
  EXPECT_EQ(c.writes_posted, 4);
  EXPECT_EQ(c.notifications_ignored, 0);
  EXPECT_EQ(c.holds, 2);
  EXPECT_EQ(c.holds_freed, 2);
  EXPECT_EQ(p.rank_counters(1).holds, 0);
  EXPECT_EQ(p.rank_counters(3).holds, 0);
  EXPECT_TRUE(p.Idle());
  EXPECT_TRUE(d.Idle());
}

TEST(WriteCoresTp, ALateSkipIsWhatFreesTheReplicaRanksHold) {
  // The prefill finishes before any decode message: every rank holds (the decode's TP is not
  // known yet). The writing ranks drain first; the free comes exactly when the last skip lands.
  WritePrefillCore p = MakeWritePrefill(4, 2);
  WriteDecodeCore d = MakeWriteDecode(1, 2);
  ASSERT_TRUE(p.OnRequestAdded("p-1", 1, "w1", 40, 0).ok());
  EXPECT_TRUE(p.OnRequestFinished("p-1", kPrefillTable, 1));
  ASSERT_TRUE(d.OnRequestAdded("a", WriteParams(4), 40, 0, 2).ok());
  auto skips = d.TakeActions();
  ASSERT_EQ(skips.size(), 2u);
  EXPECT_TRUE(d.OnBlocksAllocated("a", kDecodeTable, 0, 39, 2).ok());
  Deliver(p, d.TakeActions(), 3);  // the block ids: one all-layer WRITE per writing rank
  auto writes = Of<PostTransferAction>(p.TakeActions());
  ASSERT_EQ(writes.size(), 2u);
  for (const auto& w : writes) {
    EXPECT_EQ(w.layer, -1);
    p.OnWriteCompleted(w.id, OkStatus(), 4);
    ASSERT_TRUE(w.notification.has_value());
    d.OnWriteDone(*w.notification, 4);
  }
  EXPECT_TRUE(Freed(p.TakeActions()).empty());  // ranks 1 and 3 still hold
  EXPECT_EQ(p.NumHeldBlocks(), 3);
  EXPECT_EQ(Of<ReportLoadDoneAction>(d.TakeActions()).size(), 1u);
  std::vector<ConnectorAction> first{skips[0]}, second{skips[1]};
  Deliver(p, first, 5);
  EXPECT_TRUE(Freed(p.TakeActions()).empty());
  Deliver(p, second, 6);
  EXPECT_EQ(Freed(p.TakeActions()), (std::vector<std::string>{"p-1"}));
  EXPECT_EQ(p.NumHeldBlocks(), 0);
  EXPECT_TRUE(p.Idle());
  // A duplicate skip (its transfer ended) changes nothing.
  Deliver(p, first, 7);
  EXPECT_TRUE(p.TakeActions().empty());
  p.OnTick(10 * kLease);
  EXPECT_TRUE(p.TakeActions().empty());
  EXPECT_EQ(p.counters().lease_expired, 0);
  EXPECT_EQ(p.counters().holds, 4);
  EXPECT_EQ(p.counters().holds_freed, 4);
}

TEST(WriteCoresTp, WithoutTheSkipAReplicaRankHoldsUntilTheLease) {
  // The safety net still works (and shows what the skip saves): rank 3's skip is lost, so the
  // engine's blocks stay held until rank 3's lease fires.
  WritePrefillCore p = MakeWritePrefill(4, 2);
  WriteDecodeCore d = MakeWriteDecode(1, 2);
  ASSERT_TRUE(p.OnRequestAdded("p-1", 1, "w1", 40, 0).ok());
  ASSERT_TRUE(d.OnRequestAdded("a", WriteParams(4), 40, 0, 0).ok());
  auto skips = d.TakeActions();
  ASSERT_EQ(skips.size(), 2u);
  Deliver(p, std::vector<ConnectorAction>{skips[0]}, 1);  // rank 1 only
  EXPECT_TRUE(d.OnBlocksAllocated("a", kDecodeTable, 0, 39, 1).ok());
  Deliver(p, d.TakeActions(), 1);
  EXPECT_TRUE(p.OnRequestFinished("p-1", kPrefillTable, 2));
  for (const auto& w : Of<PostTransferAction>(p.TakeActions())) {
    p.OnWriteCompleted(w.id, OkStatus(), 3);
  }
  EXPECT_TRUE(Freed(p.TakeActions()).empty());
  p.OnTick(2 + kLease - 1);
  EXPECT_TRUE(Freed(p.TakeActions()).empty());
  p.OnTick(2 + kLease);
  EXPECT_EQ(Freed(p.TakeActions()), (std::vector<std::string>{"p-1"}));
  EXPECT_EQ(p.counters().lease_expired, 1);
  EXPECT_EQ(p.rank_counters(3).lease_expired, 1);
}

TEST(WriteCoresTp, ASkipNamingAWritingRankOrAnotherTpIsNotASettlement) {
  // Rank 0 writes to decode rank 0 at Td = 1: a skip is that pair's "nothing needed", not the
  // replica settlement. A replica's skip for a second Td after the first is ignored.
  WritePrefillCore p = MakeWritePrefill(4, 2);
  ASSERT_TRUE(p.OnRequestAdded("p-1", 1, "w1", 40, 0).ok());
  WriteCancelMsg skip{.transfer_id = "w1",
                      .prefill_engine_id = "p0",
                      .prefill_rank = 1,
                      .decode_engine_id = "d0",
                      .decode_rank = 0,
                      .decode_tp_size = 1,
                      .want_done = false};
  p.OnWriteCancel(skip, 1);
  WriteCancelMsg other = skip;
  other.decode_tp_size = 2;  // at Td = 2 rank 1 writes to decode rank 1: not a replica there
  p.OnWriteCancel(other, 1);
  EXPECT_EQ(p.counters().notifications_ignored, 1);
  WriteCancelMsg wants = skip;
  wants.prefill_rank = 3;
  wants.want_done = true;  // an abort needs a confirmation: a replica has nothing to confirm
  p.OnWriteCancel(wants, 1);
  EXPECT_EQ(p.counters().notifications_ignored, 2);
  EXPECT_EQ(p.counters().transfers_completed, 1);  // rank 1 only
  EXPECT_FALSE(p.OnRequestAborted("p-1", 2));
  EXPECT_TRUE(p.TakeActions().empty());
  EXPECT_TRUE(p.Idle());
}

}  // namespace
}  // namespace kvbridge
