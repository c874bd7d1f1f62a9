#include "kvbridge/connector/prefill_core.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace kvbridge {
namespace {

constexpr DurationUs kLease = 1000 * kMillisecond;

PrefillCore MakeCore(int64_t max_parked = 16) {
  return PrefillCore(
      {.engine_id = "p0", .tp_size = 1, .lease = kLease, .max_parked_messages = max_parked});
}

ReadDoneMsg Done(const std::string& tid, int decode_rank = 0, int decode_tp = 1,
                 ReadOutcome outcome = ReadOutcome::kOk, bool want_reply = true) {
  return ReadDoneMsg{.transfer_id = tid,
                     .prefill_engine_id = "p0",
                     .prefill_rank = 0,
                     .decode_engine_id = "d0",
                     .decode_rank = decode_rank,
                     .decode_tp_size = decode_tp,
                     .outcome = outcome,
                     .want_reply = want_reply};
}

std::vector<std::string> Freed(const std::vector<ConnectorAction>& acts) {
  std::vector<std::string> out;
  for (const auto& a : acts) {
    if (auto* f = std::get_if<ReportBlocksFreeAction>(&a)) out.push_back(f->request_id);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::pair<uint64_t, HoldReplyMsg>> Replies(const std::vector<ConnectorAction>& acts) {
  std::vector<std::pair<uint64_t, HoldReplyMsg>> out;
  for (const auto& a : acts) {
    if (auto* s = std::get_if<SendMessageAction>(&a)) {
      if (auto* h = std::get_if<HoldReplyMsg>(&s->msg)) out.emplace_back(s->reply_token, *h);
    }
  }
  return out;
}

const std::vector<int32_t> kBlocks = {4, 5, 6};

TEST(PrefillCore, MapAccumulatesSiblings) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 3, "t1", 0).ok());
  EXPECT_EQ(core.Siblings("t1"), (std::vector<std::string>{"0_req", "1_req", "2_req"}));
  EXPECT_EQ(core.NumTransfers(), 1);
  EXPECT_EQ(core.OnRequestAdded("req", 3, "t1", 0).code(), StatusCode::kAlreadyExists);
  // A second parent naming the same transfer joins the same entry (1:many, never overwritten).
  ASSERT_TRUE(core.OnRequestAdded("other", 1, "t1", 0).ok());
  EXPECT_EQ(core.Siblings("t1").size(), 4u);
  EXPECT_EQ(core.NumTransfers(), 1);
}

TEST(PrefillCore, OneNotificationReleasesEveryFinishedSiblingAndWaitsForUnfinished) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 3, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("0_req", "t1", kBlocks, 10));
  EXPECT_TRUE(core.OnRequestFinished("1_req", "t1", kBlocks, 11));
  EXPECT_EQ(core.NumHeldBlocks(), 3);
  EXPECT_TRUE(core.IsHeld("t1", std::vector<int32_t>{5, 6}));
  EXPECT_FALSE(core.IsHeld("t1", std::vector<int32_t>{5, 7}));
  EXPECT_FALSE(core.IsHeld("t2", std::vector<int32_t>{5}));
  EXPECT_TRUE(core.TakeActions().empty());

  core.OnReadDone(Done("t1"), /*reply_token=*/42, 20);
  auto acts = core.TakeActions();
  EXPECT_EQ(Freed(acts), (std::vector<std::string>{"0_req", "1_req"}));
  auto replies = Replies(acts);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].first, 42u);
  EXPECT_TRUE(replies[0].second.hold_valid);
  EXPECT_EQ(replies[0].second.transfer_id, "t1");
  EXPECT_EQ(replies[0].second.decode_rank, 0);
  // The unfinished sibling keeps the key; it is freed (not held) when it finishes.
  EXPECT_EQ(core.Siblings("t1"), (std::vector<std::string>{"2_req"}));
  EXPECT_FALSE(core.Idle());
  EXPECT_EQ(core.NumHeldBlocks(), 0);
  EXPECT_FALSE(core.OnRequestFinished("2_req", "t1", kBlocks, 30));
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().holds, 2);
  EXPECT_EQ(core.counters().holds_freed, 2);
  EXPECT_EQ(core.counters().transfers_completed, 1);
  EXPECT_EQ(core.counters().lease_expired, 0);
  EXPECT_EQ(core.counters().notifications_ignored, 0);
  EXPECT_FALSE(core.NextDeadline().has_value());
}

TEST(PrefillCore, ReleaseWaitsForEveryExpectedDecodeRank) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  core.OnReadDone(Done("t1", 0, 2), 1, 5);  // decode TP 2: ranks 0 and 1 both read rank 0
  auto acts = core.TakeActions();
  EXPECT_TRUE(Freed(acts).empty());
  ASSERT_EQ(Replies(acts).size(), 1u);
  EXPECT_TRUE(Replies(acts)[0].second.hold_valid);
  core.OnReadDone(Done("t1", 1, 2), 2, 6);
  acts = core.TakeActions();
  EXPECT_EQ(Freed(acts), (std::vector<std::string>{"req"}));
  EXPECT_TRUE(Replies(acts)[0].second.hold_valid);
  EXPECT_TRUE(core.Idle());
}

TEST(PrefillCore, UnmappingOneSiblingLeavesOthersAndKeyGoesWithLast) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 2, "t1", 0).ok());
  EXPECT_FALSE(core.OnRequestAborted("1_req", 1));  // unfinished: engine frees now
  EXPECT_EQ(core.Siblings("t1"), (std::vector<std::string>{"0_req"}));
  EXPECT_TRUE(core.OnRequestFinished("0_req", "t1", kBlocks, 2));
  core.OnReadDone(Done("t1"), 1, 3);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"0_req"}));
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.NumTransfers(), 0);
}

TEST(PrefillCore, AbortingEveryUnfinishedSiblingEmptiesTheTable) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 4, "t1", 0).ok());
  EXPECT_FALSE(core.OnRequestAborted("req", 1));  // the parent id aborts all its siblings
  EXPECT_TRUE(core.Idle());
  EXPECT_TRUE(core.TakeActions().empty());
}

TEST(PrefillCore, AbortOfHeldSiblingKeepsBlocksUntilRelease) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  EXPECT_TRUE(core.OnRequestAborted("req", 1));  // a READ may be running on its blocks
  EXPECT_TRUE(core.TakeActions().empty());
  core.OnReadDone(Done("t1"), 1, 2);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"req"}));
  EXPECT_TRUE(core.Idle());
}

TEST(PrefillCore, ParkedEarlyNotificationAppliedOnRegistration) {
  PrefillCore core = MakeCore();
  core.OnReadDone(Done("t1"), 7, 0);  // before the transfer exists
  auto acts = core.TakeActions();
  auto replies = Replies(acts);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].first, 7u);
  EXPECT_FALSE(replies[0].second.hold_valid);  // nothing was held for it
  EXPECT_EQ(replies[0].second.reason, "unknown");
  EXPECT_EQ(core.NumParked(), 1);
  EXPECT_FALSE(core.Idle());
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(kLease));

  ASSERT_TRUE(core.OnRequestAdded("req", 2, "t1", 10).ok());
  EXPECT_EQ(core.NumParked(), 0);
  // The decode is already done with it: siblings finishing now are not held.
  EXPECT_FALSE(core.OnRequestFinished("0_req", "t1", kBlocks, 11));
  EXPECT_FALSE(core.OnRequestFinished("1_req", "t1", kBlocks, 11));
  EXPECT_TRUE(core.TakeActions().empty());
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().notifications_parked, 1);
  EXPECT_EQ(core.counters().notifications_ignored, 0);
  EXPECT_EQ(core.counters().holds, 0);
}

TEST(PrefillCore, ParkedReleaseAndHeartbeatAppliedOnRegistration) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRelease({.transfer_id = "t1"}, 0).ok());
  EXPECT_EQ(core.NumParked(), 1);
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 5).ok());
  EXPECT_FALSE(core.OnRequestFinished("req", "t1", kBlocks, 6));
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().transfers_released, 1);

  // A heartbeat parked at t=500ms sets the lease floor to 1500ms.
  core.OnHeartbeat({.transfer_id = "t2",
                    .prefill_engine_id = "p0",
                    .prefill_rank = 0,
                    .decode_engine_id = "d0",
                    .decode_rank = 0},
                   500 * kMillisecond);
  ASSERT_TRUE(core.OnRequestAdded("r2", 1, "t2", 501 * kMillisecond).ok());
  EXPECT_TRUE(core.OnRequestFinished("r2", "t2", kBlocks, 502 * kMillisecond));
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(1502 * kMillisecond));
}

TEST(PrefillCore, ParkedMessageDroppedAndCountedAtTtl) {
  PrefillCore core = MakeCore();
  core.OnReadDone(Done("ghost", 0, 1, ReadOutcome::kOk, false), 0, 0);
  EXPECT_TRUE(core.TakeActions().empty());  // want_reply false: no reply
  core.OnTick(kLease - 1);
  EXPECT_EQ(core.NumParked(), 1);
  core.OnTick(kLease);
  EXPECT_EQ(core.NumParked(), 0);
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().parked_dropped, 1);
  EXPECT_EQ(core.counters().notifications_ignored, 1);
}

TEST(PrefillCore, ParkingIsBounded) {
  PrefillCore core = MakeCore(/*max_parked=*/2);
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(core.OnRelease({.transfer_id = "t" + std::to_string(i)}, 0).ok());
  EXPECT_EQ(core.NumParked(), 2);
  EXPECT_EQ(core.counters().parked_dropped, 3);
}

TEST(PrefillCore, DuplicateAndUnknownMessagesChangeNothing) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 2, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("0_req", "t1", kBlocks, 1));
  core.OnReadDone(Done("t1"), 1, 2);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"0_req"}));
  // Duplicate while a sibling keeps the entry: answered as before, nothing freed again.
  core.OnReadDone(Done("t1"), 2, 3);
  auto acts = core.TakeActions();
  EXPECT_TRUE(Freed(acts).empty());
  ASSERT_EQ(Replies(acts).size(), 1u);
  EXPECT_TRUE(Replies(acts)[0].second.hold_valid);
  EXPECT_FALSE(core.OnRequestFinished("1_req", "t1", kBlocks, 4));
  EXPECT_TRUE(core.Idle());
  // Duplicate after the entry is gone (tombstone): same answer, nothing freed, not parked.
  core.OnReadDone(Done("t1"), 3, 5);
  acts = core.TakeActions();
  EXPECT_TRUE(Freed(acts).empty());
  ASSERT_EQ(Replies(acts).size(), 1u);
  EXPECT_TRUE(Replies(acts)[0].second.hold_valid);
  EXPECT_TRUE(core.OnRelease({.transfer_id = "t1"}, 6).ok());
  core.OnHeartbeat({.transfer_id = "t1", .prefill_engine_id = "p0"}, 7);
  EXPECT_TRUE(core.Idle());
  // Wrong incarnation: refused with a "hold gone" reply, counted, not parked.
  ReadDoneMsg stale = Done("t9");
  stale.prefill_engine_id = "p0-old";
  core.OnReadDone(stale, 9, 8);
  acts = core.TakeActions();
  ASSERT_EQ(Replies(acts).size(), 1u);
  EXPECT_FALSE(Replies(acts)[0].second.hold_valid);
  EXPECT_EQ(Replies(acts)[0].second.reason, "incarnation");
  EXPECT_EQ(core.OnRelease({.transfer_id = "t9", .prefill_engine_id = "p0-old"}, 9).code(),
            StatusCode::kNotFound);
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().holds_freed, 1);
  // The duplicate ReadDones and the stale incarnation; a release after the end is not counted.
  EXPECT_EQ(core.counters().notifications_ignored, 3);
}

TEST(PrefillCore, LeaseExpiryFreesAndCounts) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 2, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("0_req", "t1", kBlocks, 100));
  EXPECT_TRUE(core.OnRequestFinished("1_req", "t1", kBlocks, 200));
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(100 + kLease));
  core.OnTick(99 + kLease);
  EXPECT_TRUE(core.TakeActions().empty());
  core.OnTick(100 + kLease);
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"0_req", "1_req"}));
  EXPECT_EQ(core.counters().lease_expired, 1);
  EXPECT_TRUE(core.Idle());
  // A late ReadDone learns the hold is gone.
  core.OnReadDone(Done("t1"), 5, 101 + kLease);
  auto replies = Replies(core.TakeActions());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_FALSE(replies[0].second.hold_valid);
  EXPECT_EQ(replies[0].second.reason, "expired");
}

TEST(PrefillCore, HeartbeatExtendsLease) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  core.OnHeartbeat({.transfer_id = "t1",
                    .prefill_engine_id = "p0",
                    .prefill_rank = 0,
                    .decode_engine_id = "d0",
                    .decode_rank = 0},
                   600 * kMillisecond);
  EXPECT_EQ(core.NextDeadline(), std::optional<TimePoint>(1600 * kMillisecond));
  core.OnTick(kLease);
  EXPECT_TRUE(core.TakeActions().empty());
  core.OnReadDone(Done("t1"), 1, 1500 * kMillisecond);
  auto acts = core.TakeActions();
  EXPECT_EQ(Freed(acts), (std::vector<std::string>{"req"}));
  EXPECT_TRUE(Replies(acts)[0].second.hold_valid);
  EXPECT_EQ(core.counters().lease_expired, 0);
}

TEST(PrefillCore, ExplicitReleaseFreesFinishedAndLaterSiblings) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 2, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("0_req", "t1", kBlocks, 1));
  ASSERT_TRUE(core.OnRelease({.transfer_id = "t1", .prefill_engine_id = "p0"}, 2).ok());
  EXPECT_EQ(Freed(core.TakeActions()), (std::vector<std::string>{"0_req"}));
  EXPECT_FALSE(core.OnRequestFinished("1_req", "t1", kBlocks, 3));
  EXPECT_TRUE(core.Idle());
  // A decode that read before the release learns its bytes are not trustworthy.
  core.OnReadDone(Done("t1"), 4, 4);
  auto replies = Replies(core.TakeActions());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_FALSE(replies[0].second.hold_valid);
  EXPECT_EQ(replies[0].second.reason, "released");
}

TEST(PrefillCore, SkippedOrAbortedDecodeNotificationReleasesWithoutReply) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRequestAdded("req", 1, "t1", 0).ok());
  EXPECT_TRUE(core.OnRequestFinished("req", "t1", kBlocks, 0));
  core.OnReadDone(Done("t1", 0, 1, ReadOutcome::kSkipped, /*want_reply=*/false), 0, 1);
  auto acts = core.TakeActions();
  EXPECT_EQ(Freed(acts), (std::vector<std::string>{"req"}));
  EXPECT_TRUE(Replies(acts).empty());
  EXPECT_TRUE(core.Idle());
}

// The client left before the prefill leg was admitted: the proxy's release (which may arrive
// first) is dropped at the abort, not parked for a whole lease; a later one is a no-op.
TEST(PrefillCore, AbortBeforeAdmissionDropsTheParkedReleaseAtOnce) {
  PrefillCore core = MakeCore();
  ASSERT_TRUE(core.OnRelease(ReleaseMsg{.transfer_id = "t9"}, 0).ok());
  EXPECT_EQ(core.NumParked(), 1);
  EXPECT_FALSE(core.Idle());
  core.OnAbortedBeforeAdmission("t9", 10);
  EXPECT_EQ(core.NumParked(), 0);
  EXPECT_TRUE(core.Idle());
  EXPECT_FALSE(core.NextDeadline().has_value());
  // A release after the abort: answered by the tombstone, nothing parked.
  ASSERT_TRUE(core.OnRelease(ReleaseMsg{.transfer_id = "t9"}, 20).ok());
  EXPECT_EQ(core.NumParked(), 0);
  // A stray read_done for it is answered "aborted" at once.
  core.OnReadDone(Done("t9"), 7, 30);
  auto replies = Replies(core.TakeActions());
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].first, 7u);
  EXPECT_FALSE(replies[0].second.hold_valid);
  EXPECT_EQ(replies[0].second.reason, "aborted");
  EXPECT_EQ(core.NumParked(), 0);
  EXPECT_TRUE(core.Idle());
  EXPECT_EQ(core.counters().notifications_ignored, 0);
  EXPECT_EQ(core.counters().lease_expired, 0);
  EXPECT_EQ(core.counters().parked_dropped, 1);
  // A registered transfer is not touched (its own abort path owns it), and the same id may be
  // registered afresh later.
  ASSERT_TRUE(core.OnRequestAdded("r1", 1, "t10", 40).ok());
  core.OnAbortedBeforeAdmission("t10", 50);
  EXPECT_EQ(core.Siblings("t10"), (std::vector<std::string>{"r1"}));
  ASSERT_TRUE(core.OnRequestAdded("r2", 1, "t9", 60).ok());
  EXPECT_TRUE(core.OnRequestFinished("r2", "t9", kBlocks, 70));
  EXPECT_EQ(core.NumHeldBlocks(), 3);
}

}  // namespace
}  // namespace kvbridge
