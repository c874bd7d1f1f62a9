#include "kvbridge/connector/decode_core.h"

#include <gtest/gtest.h>

namespace kvbridge {
namespace {

constexpr DurationUs kReply = 100 * kMillisecond;
constexpr DurationUs kRead = 1000 * kMillisecond;
constexpr DurationUs kBeat = 300 * kMillisecond;

DecodeCore MakeCore(LoadFailurePolicy policy = LoadFailurePolicy::kRecompute, int tp = 1) {
  return DecodeCore({.engine_id = "d0",
                     .tp_size = tp,
                     .block_size = 16,
                     .reply_timeout = kReply,
                     .read_timeout = kRead,
                     .heartbeat_interval = kBeat,
                     .load_failure_policy = policy});
}

KvTransferParams Params(int num_tokens = 40, int prefill_tp = 1, std::string tid = "xfer-1") {
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.transfer_id = std::move(tid);
  p.remote_engine_id = "p0";
  p.remote_host = "127.0.0.1";
  p.remote_port = 8100;
  for (int i = 0; i < (num_tokens + 15) / 16; ++i) p.remote_block_ids.push_back(100 + i);
  p.remote_num_tokens = num_tokens;
  p.tp_size = prefill_tp;
  return p;
}

template <typename T>
std::vector<T> Of(const std::vector<ConnectorAction>& acts) {
  std::vector<T> out;
  for (const auto& a : acts) {
    if (auto* x = std::get_if<T>(&a)) out.push_back(*x);
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
HoldReplyMsg Reply(bool valid, int prefill_rank = 0, std::string tid = "xfer-1") {
  return HoldReplyMsg{.transfer_id = std::move(tid),
                      .prefill_engine_id = "p0",
                      .prefill_rank = prefill_rank,
                      .decode_engine_id = "d0",
                      .decode_rank = 0,
                      .hold_valid = valid,
                      .reason = valid ? "" : "expired"};
}

const std::vector<int32_t> kTable = {20, 21, 22};

TEST(DecodeCore, MatchCountsAllButLastPromptTokenMinusLocalHit) {
  DecodeCore core = MakeCore();
  auto m = core.OnRequestAdded("a", Params(40), 40, 0, 0);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_external_tokens, 39);
  EXPECT_TRUE(m->load_async);
  auto m2 = core.OnRequestAdded("b", Params(40, 1, "xfer-2"), 40, 32, 0);
  ASSERT_TRUE(m2.ok());
  EXPECT_EQ(m2->num_external_tokens, 7);
  EXPECT_EQ(core.NumWaiting(), 2);
}

TEST(DecodeCore, FullLocalHitSkipsTheReadAndTellsThePrefill) {
  DecodeCore core = MakeCore();
  auto m = core.OnRequestAdded("a", Params(33), 33, 32, 0);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_external_tokens, 0);
  EXPECT_FALSE(m->load_async);
  auto acts = core.TakeActions();
  auto dones = ReadDones(acts);
  ASSERT_EQ(dones.size(), 1u);
  EXPECT_EQ(dones[0].transfer_id, "xfer-1");
  EXPECT_EQ(dones[0].outcome, ReadOutcome::kSkipped);
  EXPECT_FALSE(dones[0].want_reply);
  EXPECT_EQ(Of<SendMessageAction>(acts)[0].to,
            (PeerEndpoint{.engine_id = "p0", .host = "127.0.0.1", .port = 8100, .rank = 0}));
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().skipped, 1);
}

TEST(DecodeCore, ReadsOnlyMissingBlocksNotifiesWithSharedTransferIdAndWaitsForHoldReply) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("cmpl-local-7", Params(40), 40, 16, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("cmpl-local-7", kTable, 16, 23, 1).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 1u);
  EXPECT_EQ(reads[0].local_block_ids, (std::vector<int32_t>{21, 22}));
  EXPECT_EQ(reads[0].remote_block_ids, (std::vector<int32_t>{101, 102}));
  EXPECT_EQ(reads[0].transfer_id, "xfer-1");
  EXPECT_EQ(reads[0].peer.rank, 0);
  EXPECT_EQ(reads[0].local_rank, 0);
  EXPECT_EQ(core.NumReadsInFlight(), 1);

  core.OnReadCompleted(reads[0].id, OkStatus(), 2);
  auto acts = core.TakeActions();
  auto dones = ReadDones(acts);
  ASSERT_EQ(dones.size(), 1u);
  EXPECT_EQ(dones[0].transfer_id, "xfer-1");  // never the local request id
  EXPECT_EQ(dones[0].prefill_engine_id, "p0");
  EXPECT_EQ(dones[0].decode_engine_id, "d0");
  EXPECT_EQ(dones[0].outcome, ReadOutcome::kOk);
  EXPECT_TRUE(dones[0].want_reply);
  EXPECT_TRUE(Of<ReportLoadDoneAction>(acts).empty());  // not before the hold reply
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(2 + kReply));

  core.OnHoldReply(Reply(true), 3);
  acts = core.TakeActions();
  ASSERT_EQ(Of<ReportLoadDoneAction>(acts).size(), 1u);
  EXPECT_EQ(Of<ReportLoadDoneAction>(acts)[0].request_id, "cmpl-local-7");
  EXPECT_TRUE(core.Idle());
  // Late duplicates change nothing and are counted.
  core.OnHoldReply(Reply(true), 4);
  core.OnReadCompleted(reads[0].id, OkStatus(), 5);
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_EQ(core.counters().notifications_ignored, 2);
  EXPECT_EQ(core.counters().loads_done, 1);
}

TEST(DecodeCore, HoldGoneAppliesRecomputePolicy) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40), 40, 0, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("a", kTable, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  ASSERT_EQ(reads[0].local_block_ids, kTable);
  core.OnReadCompleted(reads[0].id, OkStatus(), 1);
  core.TakeActions();
  core.OnHoldReply(Reply(false), 2);
  auto fails = Of<ReportLoadFailedAction>(core.TakeActions());
  ASSERT_EQ(fails.size(), 1u);
  EXPECT_EQ(fails[0].request_id, "a");
  EXPECT_TRUE(fails[0].recompute);
  EXPECT_EQ(fails[0].status.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().load_failures, 1);
  EXPECT_EQ(core.counters().hold_gone, 1);
}

TEST(DecodeCore, NoReplyInTimeAppliesFailPolicy) {
  DecodeCore core = MakeCore(LoadFailurePolicy::kFail);
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40), 40, 0, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("a", kTable, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  core.OnReadCompleted(reads[0].id, OkStatus(), 10);
  core.TakeActions();
  core.OnTick(10 + kReply - 1);
  EXPECT_TRUE(Of<ReportLoadFailedAction>(core.TakeActions()).empty());
  core.OnTick(10 + kReply);
  auto fails = Of<ReportLoadFailedAction>(core.TakeActions());
  ASSERT_EQ(fails.size(), 1u);
  EXPECT_FALSE(fails[0].recompute);
  EXPECT_EQ(fails[0].status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().reply_timeouts, 1);
}

TEST(DecodeCore, AbortMidReadKeepsBlocksUntilTheReadEnds) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40), 40, 0, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("a", kTable, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  EXPECT_TRUE(core.OnRequestAborted("a", 1));
  auto acts = core.TakeActions();
  ASSERT_EQ(Of<CancelTransferAction>(acts).size(), 1u);
  EXPECT_EQ(Of<CancelTransferAction>(acts)[0].id, reads[0].id);
  EXPECT_TRUE(Of<ReportBlocksFreeAction>(acts).empty());  // bytes may still land
  EXPECT_FALSE(core.Idle());
  core.OnReadCompleted(reads[0].id, CancelledError("cancelled"), 2);
  acts = core.TakeActions();
  ASSERT_EQ(Of<ReportBlocksFreeAction>(acts).size(), 1u);
  EXPECT_EQ(Of<ReportBlocksFreeAction>(acts)[0].request_id, "a");
  auto dones = ReadDones(acts);
  ASSERT_EQ(dones.size(), 1u);
  EXPECT_EQ(dones[0].outcome, ReadOutcome::kAborted);
  EXPECT_FALSE(dones[0].want_reply);
  EXPECT_TRUE(Of<ReportLoadDoneAction>(acts).empty());
  EXPECT_TRUE(core.Idle());
}

TEST(DecodeCore, AbortBeforeAllocationFreesAtOnceAndTellsThePrefill) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40), 40, 0, 0).ok());
  EXPECT_FALSE(core.OnRequestAborted("a", 1));
  auto acts = core.TakeActions();
  EXPECT_TRUE(Of<ReportBlocksFreeAction>(acts).empty());
  ASSERT_EQ(ReadDones(acts).size(), 1u);
  EXPECT_EQ(ReadDones(acts)[0].outcome, ReadOutcome::kAborted);
  EXPECT_TRUE(core.Idle());
  EXPECT_FALSE(core.OnRequestAborted("unknown", 2));
}

TEST(DecodeCore, AbortWhileAwaitingReplyFreesNowAndAbsorbsTheReply) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40), 40, 0, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("a", kTable, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  core.OnReadCompleted(reads[0].id, OkStatus(), 1);
  core.TakeActions();
  EXPECT_FALSE(core.OnRequestAborted("a", 2));  // no READ in flight: free now
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_FALSE(core.Idle());
  core.OnHoldReply(Reply(true), 3);
  EXPECT_TRUE(core.TakeActions().empty());  // not reported: the request is gone
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().notifications_ignored, 0);
  EXPECT_EQ(core.counters().loads_done, 0);
}

TEST(DecodeCore, PrefillTpTwoNeedsBothReadsAndBothReplies) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40, 2), 40, 0, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("a", kTable, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[0].peer.rank, 0);
  EXPECT_EQ(reads[1].peer.rank, 1);
  EXPECT_NE(reads[0].id, reads[1].id);
  core.OnReadCompleted(reads[1].id, OkStatus(), 1);
  core.OnHoldReply(Reply(true, 1), 2);
  EXPECT_TRUE(Of<ReportLoadDoneAction>(core.TakeActions()).empty());
  core.OnReadCompleted(reads[0].id, OkStatus(), 3);
  core.OnHoldReply(Reply(true, 0), 4);
  EXPECT_EQ(Of<ReportLoadDoneAction>(core.TakeActions()).size(), 1u);
  EXPECT_TRUE(core.Idle());
}

TEST(DecodeCore, OneFailedReadCancelsTheOtherAndReportsOnlyAfterItEnds) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40, 2), 40, 0, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("a", kTable, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  core.OnReadCompleted(reads[0].id, UnavailableError("peer lost"), 1);
  auto acts = core.TakeActions();
  ASSERT_EQ(Of<CancelTransferAction>(acts).size(), 1u);
  EXPECT_EQ(Of<CancelTransferAction>(acts)[0].id, reads[1].id);
  EXPECT_TRUE(Of<ReportLoadFailedAction>(acts).empty());
  ASSERT_EQ(ReadDones(acts).size(), 1u);
  EXPECT_EQ(ReadDones(acts)[0].outcome, ReadOutcome::kFailed);
  core.OnReadCompleted(reads[1].id, OkStatus(), 2);  // landed before the cancel took
  acts = core.TakeActions();
  ASSERT_EQ(Of<ReportLoadFailedAction>(acts).size(), 1u);
  EXPECT_EQ(Of<ReportLoadFailedAction>(acts)[0].status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(ReadDones(acts).size(), 1u);  // rank 1 told too, so it releases
  EXPECT_TRUE(core.Idle());
}

TEST(DecodeCore, ReadTimeoutCancelsThenFails) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40), 40, 0, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("a", kTable, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  core.OnTick(kRead);
  auto acts = core.TakeActions();
  ASSERT_EQ(Of<CancelTransferAction>(acts).size(), 1u);
  EXPECT_TRUE(Of<ReportLoadFailedAction>(acts).empty());
  core.OnReadCompleted(reads[0].id, CancelledError("cancelled"), kRead + 1);
  auto fails = Of<ReportLoadFailedAction>(core.TakeActions());
  ASSERT_EQ(fails.size(), 1u);
  EXPECT_EQ(fails[0].status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(core.counters().read_timeouts, 1);
  EXPECT_TRUE(core.Idle());
}

TEST(DecodeCore, HeartbeatsWhileQueued) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40), 40, 0, 0).ok());
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(kBeat));
  core.OnTick(kBeat - 1);
  EXPECT_TRUE(core.TakeActions().empty());
  core.OnTick(kBeat);
  auto sends = Of<SendMessageAction>(core.TakeActions());
  ASSERT_EQ(sends.size(), 1u);
  EXPECT_EQ(std::get<HeartbeatMsg>(sends[0].msg), (HeartbeatMsg{.transfer_id = "xfer-1",
                                                                .prefill_engine_id = "p0",
                                                                .prefill_rank = 0,
                                                                .decode_engine_id = "d0",
                                                                .decode_rank = 0}));
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(2 * kBeat));
}

TEST(DecodeCore, RefusesInconsistentParamsWithNoEffect) {
  DecodeCore core = MakeCore();
  EXPECT_EQ(core.OnRequestAdded("a", Params(40), 41, 0, 0).status().code(),
            StatusCode::kInvalidArgument);
  KvTransferParams w = Params(40);
  w.mode = KvTransferMode::kWrite;
  EXPECT_EQ(core.OnRequestAdded("a", w, 40, 0, 0).status().code(), StatusCode::kUnimplemented);
  KvTransferParams short_ids = Params(40);
  short_ids.remote_block_ids.pop_back();
  EXPECT_EQ(core.OnRequestAdded("a", short_ids, 40, 0, 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(core.Idle());
  EXPECT_TRUE(core.TakeActions().empty());
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40), 40, 0, 0).ok());
  EXPECT_EQ(core.OnRequestAdded("b", Params(40), 40, 0, 0).status().code(),
            StatusCode::kAlreadyExists);
}

TEST(DecodeCore, AbortBeforeAdmissionTellsEveryPrefillRank) {
  DecodeCore core = MakeCore();
  core.OnAbortedBeforeAdmission(Params(40, 2));
  auto dones = ReadDones(core.TakeActions());
  ASSERT_EQ(dones.size(), 2u);
  EXPECT_EQ(dones[0].prefill_rank, 0);
  EXPECT_EQ(dones[1].prefill_rank, 1);
  EXPECT_EQ(dones[0].outcome, ReadOutcome::kAborted);
  EXPECT_FALSE(dones[0].want_reply);
  EXPECT_EQ(dones[0].transfer_id, "xfer-1");
  EXPECT_TRUE(core.Idle());
}

// A second allocation while the READ is in flight is the illegal transition the request table
// names: nothing changes (no second READ into other blocks), and the load completes once.
TEST(DecodeCore, SecondAllocationIsAnIllegalTransitionAndChangesNothing) {
  DecodeCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("a", Params(40), 40, 0, 0).ok());
  EXPECT_TRUE(core.OnBlocksAllocated("a", kTable, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 1u);
  Status st = core.OnBlocksAllocated("a", std::vector<int32_t>{7, 8, 9}, 0, 39, 1);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(), "illegal READ request state transition LOADING -> LOADING");
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_EQ(core.NumReadsInFlight(), 1);
  EXPECT_EQ(core.counters().reads_posted, 1);
  EXPECT_EQ(core.counters().notifications_ignored, 0);
  core.OnReadCompleted(reads[0].id, OkStatus(), 2);
  ASSERT_EQ(Of<SendMessageAction>(core.TakeActions()).size(), 1u);  // ReadDone(ok)
  core.OnHoldReply(Reply(true), 3);
  auto done = Of<ReportLoadDoneAction>(core.TakeActions());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].request_id, "a");
  EXPECT_TRUE(core.Idle());
}

TEST(DecodeCore, CompletionForUnknownReadIsIgnoredAndCounted) {
  DecodeCore core = MakeCore();
  core.OnReadCompleted(77, OkStatus(), 0);
  core.OnHoldReply(Reply(true), 0);
  EXPECT_EQ(core.OnBlocksAllocated("nobody", kTable, 0, 39, 0).code(), StatusCode::kNotFound);
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_EQ(core.counters().notifications_ignored, 3);
  EXPECT_TRUE(core.Idle());
}

// A decode request still queued in the engine (not admitted: no blocks yet) heartbeats every
// prefill rank it will read from — the first at once (it claims the hold), then every interval —
// and stops at admission or at an abort before admission.
TEST(DecodeCore, HeartbeatsWhileQueuedBeforeAdmission) {
  DecodeCore core = MakeCore();
  core.OnRequestQueued("q", Params(40, 2), 0);
  core.OnRequestQueued("w", KvTransferParams{.do_remote_decode = true, .transfer_id = "x"}, 0);
  auto claims = Of<SendMessageAction>(core.TakeActions());
  ASSERT_EQ(claims.size(), 2u);  // the claim, one per prefill rank
  EXPECT_EQ(std::get<HeartbeatMsg>(claims[1].msg).prefill_rank, 1);
  EXPECT_FALSE(core.Idle());
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(kBeat));
  core.OnTick(kBeat - 1);
  EXPECT_TRUE(core.TakeActions().empty());
  core.OnTick(kBeat);
  auto sends = Of<SendMessageAction>(core.TakeActions());
  ASSERT_EQ(sends.size(), 2u);  // one per prefill rank; the prefill leg's params are ignored
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(std::get<HeartbeatMsg>(sends[r].msg), (HeartbeatMsg{.transfer_id = "xfer-1",
                                                                  .prefill_engine_id = "p0",
                                                                  .prefill_rank = r,
                                                                  .decode_engine_id = "d0",
                                                                  .decode_rank = 0}));
    EXPECT_EQ(sends[r].to.rank, r);
    EXPECT_EQ(sends[r].to.port, 8100);
  }
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(2 * kBeat));
  // Admission: the queued heartbeat stops; the admitted request's own timer takes over.
  ASSERT_TRUE(core.OnRequestAdded("q", Params(40, 2), 40, 0, kBeat + 5).ok());
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(2 * kBeat + 5));
  core.OnTick(2 * kBeat);
  EXPECT_TRUE(core.TakeActions().empty());

  // An abort before admission stops it too, and tells the prefill.
  DecodeCore c2 = MakeCore();
  c2.OnRequestQueued("q2", Params(40, 1, "xfer-2"), 0);
  c2.OnAbortedBeforeAdmission(Params(40, 1, "xfer-2"));
  auto dones = ReadDones(c2.TakeActions());
  ASSERT_EQ(dones.size(), 1u);
  EXPECT_EQ(dones[0].outcome, ReadOutcome::kAborted);
  EXPECT_TRUE(c2.Idle());
  EXPECT_FALSE(c2.NextDeadline().has_value());
  c2.OnTick(10 * kBeat);
  EXPECT_TRUE(c2.TakeActions().empty());
  // And so does the engine's abort of the request id.
  c2.OnRequestQueued("q3", Params(40, 1, "xfer-3"), 0);
  EXPECT_FALSE(c2.OnRequestAborted("q3", 1));
  EXPECT_TRUE(c2.Idle());
}

}  // namespace
}  // namespace kvbridge
