// Issue 21, the cores' side: peer loss as an input (OnPeerLost) and the claim lease. A READ hold
// claimed by a decode that is lost is freed at once (its hold reply then says "peer_lost"); a
// hold nobody claims lives only the claim lease; a READ decode fails its loads from a lost
// prefill at once, but reports only after no READ can land; a WRITE decode frees its targets on
// a lost prefill only when no byte can land (PeerLoss::kGone) — a heartbeat timeout alone
// (kSuspected) fails the request and keeps the targets until a WriteDone or the write bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kvbridge/connector/connector_cores.h"
#include "kvbridge/connector/decode_core.h"
#include "kvbridge/connector/prefill_core.h"
#include "kvbridge/connector/write_decode_core.h"
#include "kvbridge/connector/write_prefill_core.h"

namespace kvbridge {
namespace {

constexpr DurationUs kLease = 10 * kSecond;
constexpr DurationUs kClaim = 2 * kSecond;
const std::vector<int32_t> kBlocks = {4, 5, 6};

template <typename T>
std::vector<T> Of(const std::vector<ConnectorAction>& acts) {
  std::vector<T> out;
  for (const auto& a : acts) {
    if (auto* x = std::get_if<T>(&a)) out.push_back(*x);
  }
  return out;
}
template <typename M>
std::vector<M> Msgs(const std::vector<ConnectorAction>& acts) {
  std::vector<M> out;
  for (const auto& s : Of<SendMessageAction>(acts)) {
    if (auto* m = std::get_if<M>(&s.msg)) out.push_back(*m);
  }
  return out;
}
std::vector<std::string> Freed(const std::vector<ConnectorAction>& acts) {
  std::vector<std::string> out;
  for (const auto& f : Of<ReportBlocksFreeAction>(acts)) out.push_back(f.request_id);
  return out;
}

PrefillCore MakePrefill(DurationUs claim_lease = kClaim) {
  return PrefillCore(
      {.engine_id = "p0", .tp_size = 1, .lease = kLease, .claim_lease = claim_lease});
}
ReadDoneMsg Done(const std::string& tid, const std::string& decode = "d0",
                 ReadOutcome outcome = ReadOutcome::kOk) {
  return ReadDoneMsg{.transfer_id = tid,
                     .prefill_engine_id = "p0",
                     .prefill_rank = 0,
                     .decode_engine_id = decode,
                     .decode_rank = 0,
                     .decode_tp_size = 1,
                     .outcome = outcome,
                     .want_reply = true};
}
HeartbeatMsg Beat(const std::string& tid, const std::string& decode = "d0") {
  return HeartbeatMsg{.transfer_id = tid,
                      .prefill_engine_id = "p0",
                      .prefill_rank = 0,
                      .decode_engine_id = decode,
                      .decode_rank = 0};
}
// A finished, held prefill request `id` of transfer `tid` at `now`.
void Hold(PrefillCore& core, const std::string& id, const std::string& tid, TimePoint now) {
  ASSERT_TRUE(core.OnRequestAdded(id, 1, tid, now).ok());
  ASSERT_TRUE(core.OnRequestFinished(id, tid, kBlocks, now));
}

TEST(ClaimLease, AHoldNobodyClaimsIsFreedAtTheClaimLease) {
  PrefillCore core = MakePrefill();
  Hold(core, "a", "t1", 1000);
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(1000 + kClaim));
  core.OnTick(1000 + kClaim - 1);
  EXPECT_TRUE(core.TakeActions().empty());
  core.OnTick(1000 + kClaim);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"a"}));
  EXPECT_EQ(core.counters().claims_expired, 1);
  EXPECT_EQ(core.counters().lease_expired, 0);
  EXPECT_TRUE(core.Idle());
  // A decode that comes after all is told why (and recomputes).
  core.OnReadDone(Done("t1"), 7, 1000 + kClaim + 1);
  auto replies = Msgs<HoldReplyMsg>(core.TakeActions());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_FALSE(replies[0].hold_valid);
  EXPECT_EQ(replies[0].reason, "unclaimed");
}

TEST(ClaimLease, AClaimPutsTheHoldUnderTheUsualLease) {
  PrefillCore core = MakePrefill();
  // Claimed after the hold: the lease runs from the claim.
  Hold(core, "a", "t1", 0);
  core.OnHeartbeat(Beat("t1"), 1 * kSecond);
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(1 * kSecond + kLease));
  core.OnTick(kClaim);
  EXPECT_TRUE(core.TakeActions().empty());
  // Claimed before the hold (the decode's heartbeat came first, parked): the lease from the hold.
  core.OnHeartbeat(Beat("t2"), 2 * kSecond);
  Hold(core, "b", "t2", 3 * kSecond);
  EXPECT_EQ(core.BoundTo("d0"), (std::pair<int64_t, int64_t>{2, 3}));
  core.OnTick(3 * kSecond + kClaim);
  EXPECT_TRUE(core.TakeActions().empty());
  core.OnTick(1 * kSecond + kLease);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"a"}));
  core.OnReadDone(Done("t2"), 1, 4 * kSecond);  // completes t2
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"b"}));
  EXPECT_EQ(core.counters().lease_expired, 1);
  EXPECT_EQ(core.counters().claims_expired, 0);
  EXPECT_TRUE(core.Idle());
}

TEST(ClaimLease, ZeroMeansTheLeaseFromTheFirstHold) {
  PrefillCore core = MakePrefill(/*claim_lease=*/0);
  Hold(core, "a", "t1", 0);
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(kLease));
}

TEST(PeerLoss, ReadHoldsOfALostDecodeAreFreedAtOnceAndOnlyThose) {
  PrefillCore core = MakePrefill();
  Hold(core, "a", "t1", 0);
  Hold(core, "b", "t2", 0);
  Hold(core, "c", "t3", 0);
  core.OnHeartbeat(Beat("t1", "d0"), 1);
  core.OnHeartbeat(Beat("t2", "d1"), 1);
  core.OnHeartbeat(Beat("t9", "d0"), 1);  // parked: t9 not registered yet
  ASSERT_EQ(core.NumParked(), 1);
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_EQ(core.OnPeerLost("d0", 2), 1);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"a"}));
  EXPECT_EQ(core.NumParked(), 0);  // what the lost decode said is dropped
  EXPECT_EQ(core.counters().peer_lost, 1);
  EXPECT_EQ(core.counters().lease_expired, 0);
  EXPECT_EQ(core.BoundTo("d0"), (std::pair<int64_t, int64_t>{0, 0}));
  // Its late read_done (it was only suspected, say) is told the hold is gone.
  core.OnReadDone(Done("t1", "d0"), 5, 3);
  auto replies = Msgs<HoldReplyMsg>(core.TakeActions());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_FALSE(replies[0].hold_valid);
  EXPECT_EQ(replies[0].reason, "peer_lost");
  // Nothing else moves: d1's hold stays, the unclaimed one waits for its claim lease.
  EXPECT_EQ(core.OnPeerLost("d0", 4), 0);
  EXPECT_EQ(core.OnPeerLost("nobody", 4), 0);
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_EQ(core.NumTransfers(), 2);
  core.OnTick(kClaim);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"c"}));
  core.OnReadDone(Done("t2", "d1"), 6, kClaim + 1);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"b"}));
  EXPECT_TRUE(core.Idle());
}

KvTransferParams ReadParams(const std::string& tid) {
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.transfer_id = tid;
  p.remote_engine_id = "p0";
  p.remote_host = "127.0.0.1";
  p.remote_port = 8100;
  p.remote_block_ids = {100, 101, 102};
  p.remote_num_tokens = 40;
  return p;
}

TEST(PeerLoss, AQueuedDecodeClaimsAtOnce) {
  DecodeCore core({.engine_id = "d0", .heartbeat_interval = 5 * kSecond});
  core.OnRequestQueued("q", ReadParams("t1"), 0);
  auto beats = Msgs<HeartbeatMsg>(core.TakeActions());
  ASSERT_EQ(beats.size(), 1u);
  EXPECT_EQ(beats[0].transfer_id, "t1");
  EXPECT_EQ(beats[0].decode_engine_id, "d0");
  // A lost prefill stops the queued heartbeats.
  EXPECT_EQ(core.OnPeerLost("p0", 1), 0);
  EXPECT_TRUE(core.Idle());
}

TEST(PeerLoss, AReadDecodeFailsAtOnceButReportsOnlyWhenNoReadCanLand) {
  DecodeCore core({.engine_id = "d0", .reply_timeout = 10 * kSecond});
  ASSERT_TRUE(core.OnRequestAdded("a", ReadParams("t1"), 40, 0, 0).ok());
  ASSERT_TRUE(core.OnBlocksAllocated("a", std::vector<int32_t>{20, 21, 22}, 0, 39, 0).ok());
  ASSERT_TRUE(core.OnRequestAdded("b", ReadParams("t2"), 40, 0, 0).ok());
  ASSERT_TRUE(core.OnBlocksAllocated("b", std::vector<int32_t>{30, 31, 32}, 0, 39, 0).ok());
  auto reads = Of<PostTransferAction>(core.TakeActions());
  ASSERT_EQ(reads.size(), 2u);
  core.OnReadCompleted(reads[0].id, OkStatus(), 1);  // a: ReadDone sent, reply awaited
  core.TakeActions();
  EXPECT_EQ(core.OnPeerLost("p0", 2), 2);
  auto acts = core.TakeActions();
  // a: the reply will never come: fails now, not at the reply timeout.
  auto failed = Of<ReportLoadFailedAction>(acts);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].request_id, "a");
  EXPECT_EQ(failed[0].status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(failed[0].status.message(), "prefill p0 lost");
  // b: its READ is cancelled; the report waits for the READ's end (no byte lands after it).
  auto cancels = Of<CancelTransferAction>(acts);
  ASSERT_EQ(cancels.size(), 1u);
  EXPECT_EQ(cancels[0].id, reads[1].id);
  core.OnReadCompleted(reads[1].id, UnavailableError("peer lost"), 3);
  failed = Of<ReportLoadFailedAction>(core.TakeActions());
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].request_id, "b");
  EXPECT_EQ(core.counters().peer_lost, 2);
  EXPECT_EQ(core.counters().reply_timeouts, 0);
  EXPECT_TRUE(core.Idle());
}

KvTransferParams WriteParams(const std::string& tid) {
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.transfer_id = tid;
  p.mode = KvTransferMode::kWrite;
  p.remote_engine_id = "p0";
  p.remote_host = "127.0.0.1";
  p.remote_port = 1;
  return p;
}
const std::vector<int32_t> kDecodeTable = {0, 1, 2};
constexpr DurationUs kWriteBound = 12 * kSecond;

WriteDecodeCore MakeWriteDecode() {
  return WriteDecodeCore({.engine_id = "d0", .block_size = 16, .write_timeout = kWriteBound});
}
void AddWriteDecode(WriteDecodeCore& core, const std::string& id, const std::string& tid,
                    TimePoint now) {
  ASSERT_TRUE(core.OnRequestAdded(id, WriteParams(tid), 40, 0, now).ok());
  ASSERT_TRUE(core.OnBlocksAllocated(id, kDecodeTable, 0, 39, now).ok());
  ASSERT_EQ(Msgs<WriteBlocksMsg>(core.TakeActions()).size(), 1u);
}

TEST(PeerLoss, WriteTargetsOfAGonePrefillAreFreedNow) {
  WriteDecodeCore core = MakeWriteDecode();
  AddWriteDecode(core, "a", "t1", 0);
  AddWriteDecode(core, "b", "t2", 0);
  EXPECT_TRUE(core.OnRequestAborted("b", 1));  // aborted mid-write: kept until drained
  auto cancels = Msgs<WriteCancelMsg>(core.TakeActions());
  ASSERT_EQ(cancels.size(), 1u);
  EXPECT_EQ(core.BoundTo("p0"), (std::pair<int64_t, int64_t>{2, 6}));
  EXPECT_EQ(core.OnPeerLost("p0", PeerLoss::kGone, 2), 1);
  auto acts = core.TakeActions();
  auto failed = Of<ReportLoadFailedAction>(acts);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].request_id, "a");
  EXPECT_EQ(failed[0].status.message(), "prefill p0 lost (gone)");
  EXPECT_EQ(Freed(acts), (std::vector<std::string>{"b"}));
  EXPECT_TRUE(Msgs<WriteCancelMsg>(acts).empty());  // nobody to tell
  EXPECT_TRUE(core.WritableBlocksByTransfer().empty());
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().write_timeouts, 0);
}

TEST(PeerLoss, ASuspectedPrefillFailsTheRequestButKeepsItsTargetsUntilTheWriteBound) {
  WriteDecodeCore core = MakeWriteDecode();
  AddWriteDecode(core, "a", "t1", 0);
  EXPECT_EQ(core.OnPeerLost("p0", PeerLoss::kSuspected, 2 * kSecond), 1);
  auto acts = core.TakeActions();
  auto cancels = Msgs<WriteCancelMsg>(acts);
  ASSERT_EQ(cancels.size(), 1u);  // asks it to stop and confirm, in case it is alive
  EXPECT_TRUE(cancels[0].want_done);
  EXPECT_TRUE(Of<ReportLoadFailedAction>(acts).empty());  // not yet: a write may still land
  EXPECT_TRUE(core.WritableBlocksByTransfer().empty());   // no write is accepted any more
  core.OnTick(kWriteBound - 1);
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_FALSE(core.Idle());
  core.OnTick(kWriteBound);  // the prefill's lease + a grace: nothing can land now
  auto failed = Of<ReportLoadFailedAction>(core.TakeActions());
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].status.message(), "prefill p0 lost (suspected)");
  EXPECT_TRUE(core.Idle());

  // A suspected prefill that is alive after all confirms the drain: freed at its WriteDone.
  AddWriteDecode(core, "b", "t2", 20 * kSecond);
  core.OnPeerLost("p0", PeerLoss::kSuspected, 21 * kSecond);
  core.TakeActions();
  core.OnWriteDone(WriteDoneMsg{.transfer_id = "t2",
                                .prefill_engine_id = "p0",
                                .prefill_rank = 0,
                                .decode_engine_id = "d0",
                                .decode_rank = 0,
                                .outcome = WriteOutcome::kCancelled},
                   22 * kSecond);
  failed = Of<ReportLoadFailedAction>(core.TakeActions());
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].request_id, "b");
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().peer_lost, 2);
}

TEST(PeerLoss, AWriteRequestNotAllocatedYetFailsAtItsAllocationOfferingNothing) {
  WriteDecodeCore core = MakeWriteDecode();
  ASSERT_TRUE(core.OnRequestAdded("a", WriteParams("t1"), 40, 0, 0).ok());
  EXPECT_EQ(core.OnPeerLost("p0", PeerLoss::kGone, 1), 1);
  EXPECT_TRUE(core.TakeActions().empty());
  ASSERT_TRUE(core.OnBlocksAllocated("a", kDecodeTable, 0, 39, 2).ok());
  auto acts = core.TakeActions();
  EXPECT_TRUE(Msgs<WriteBlocksMsg>(acts).empty());
  ASSERT_EQ(Of<ReportLoadFailedAction>(acts).size(), 1u);
  EXPECT_TRUE(core.Idle());
}

TEST(PeerLoss, AWritePrefillStopsWritingToALostDecodeAndFreesOnceDrained) {
  WritePrefillCore core({.engine_id = "p0", .block_size = 16, .num_layers = 2, .lease = kLease});
  ASSERT_TRUE(core.OnRequestAdded("p-1", 1, "t1", 40, 0).ok());
  core.OnWriteBlocks(WriteBlocksMsg{.transfer_id = "t1",
                                    .prefill_engine_id = "p0",
                                    .prefill_rank = 0,
                                    .decode_engine_id = "d0",
                                    .decode_rank = 0,
                                    .decode_tp_size = 1,
                                    .decode_host = "127.0.0.1",
                                    .decode_port = 2,
                                    .num_prompt_tokens = 40,
                                    .first_block = 0,
                                    .block_ids = kDecodeTable},
                     0);
  core.OnLayerComputed("p-1", 0, std::vector<int32_t>{10, 11, 12}, 1);
  core.OnLayerComputed("p-1", 1, std::vector<int32_t>{10, 11, 12}, 1);
  auto writes = Of<PostTransferAction>(core.TakeActions());
  ASSERT_EQ(writes.size(), 2u);  // one per layer
  EXPECT_TRUE(core.OnRequestFinished("p-1", std::vector<int32_t>{10, 11, 12}, 1));
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_EQ(core.OnPeerLost("other", 2), 0);
  EXPECT_EQ(core.OnPeerLost("d0", 2), 1);
  auto acts = core.TakeActions();
  auto cancels = Of<CancelTransferAction>(acts);
  ASSERT_EQ(cancels.size(), 2u);
  EXPECT_EQ(cancels[0].id, writes[0].id);
  EXPECT_EQ(cancels[1].id, writes[1].id);
  EXPECT_TRUE(Freed(acts).empty());  // its writes may still read our blocks
  core.OnWriteCompleted(writes[0].id, CancelledError("cancelled"), 3);
  EXPECT_TRUE(Freed(core.TakeActions()).empty());
  core.OnWriteCompleted(writes[1].id, CancelledError("cancelled"), 4);
  acts = core.TakeActions();
  EXPECT_EQ(Freed(acts), (std::vector<std::string>{"p-1"}));
  EXPECT_TRUE(Msgs<WriteDoneMsg>(acts).empty());  // nobody to tell
  EXPECT_EQ(core.counters().peer_lost, 1);
  EXPECT_EQ(core.counters().lease_expired, 0);
  EXPECT_TRUE(core.Idle());
}

}  // namespace
}  // namespace kvbridge
