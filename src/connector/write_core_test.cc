// WritePrefillCore and WriteDecodeCore wired through an in-test message pipe: WRITE mode's parked
// messages (block ids first / request first), duplicates, both abort paths, the lease, and the
// wire form of the WRITE messages. Every test ends with all tables empty.
#include <gtest/gtest.h>

#include <map>
#include <optional>

#include "kvbridge/connector/write_decode_core.h"
#include "kvbridge/connector/write_prefill_core.h"

namespace kvbridge {
namespace {

constexpr int kLayers = 3;

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

const std::vector<int32_t> kPrefillTable = {10, 11, 12};  // 40 tokens
const std::vector<int32_t> kDecodeTable = {0, 1, 2};

// The decode leg `request_id` of a 40-token prompt (no local hit) admitted and its blocks
// (kDecodeTable) allocated at `now`.
void AddDecode(WriteDecodeCore& decode, const std::string& request_id,
               const KvTransferParams& params, TimePoint now) {
  ASSERT_TRUE(decode.OnRequestAdded(request_id, params, 40, 0, now).ok());
  EXPECT_TRUE(decode.OnBlocksAllocated(request_id, kDecodeTable, 0, 39, now).ok());
}

// The decode's block-id messages, taken from its actions (each action must be one).
std::vector<WriteBlocksMsg> TakeWriteBlocks(WriteDecodeCore& decode) {
  std::vector<WriteBlocksMsg> out;
  for (auto& a : decode.TakeActions()) {
    out.push_back(std::get<WriteBlocksMsg>(std::get<SendMessageAction>(a).msg));
  }
  return out;
}

struct Posted {
  PostTransferAction a;
  bool cancelled = false;
};

// Two cores and a lossless in-order network that delivers on Pump(). Writes are left pending
// until the test completes them.
struct Pipe {
  WritePrefillCore prefill{{.engine_id = "p0",
                            .block_size = 16,
                            .num_layers = kLayers,
                            .lease = 10 * kSecond,
                            .max_parked_messages = 4}};
  WriteDecodeCore decode{{.engine_id = "d0", .block_size = 16, .write_timeout = 12 * kSecond}};
  std::vector<std::string> prefill_freed, decode_freed, loads_done;
  std::vector<ReportLoadFailedAction> load_failed;
  std::map<uint64_t, Posted> writes;  // write id -> posted
  std::vector<ControlMessage> to_prefill, to_decode;
  bool deliver = true;  // false: queue messages for the test to deliver

  void Pump(TimePoint now) {
    for (int i = 0; i < 100; ++i) {
      auto pa = prefill.TakeActions();
      auto da = decode.TakeActions();
      if (pa.empty() && da.empty() && (!deliver || (to_prefill.empty() && to_decode.empty())))
        return;
      for (auto& a : pa) {
        if (auto* f = std::get_if<ReportBlocksFreeAction>(&a))
          prefill_freed.push_back(f->request_id);
        if (auto* w = std::get_if<PostTransferAction>(&a)) writes[w->id] = Posted{*w};
        if (auto* c = std::get_if<CancelTransferAction>(&a)) writes.at(c->id).cancelled = true;
        if (auto* s = std::get_if<SendMessageAction>(&a)) to_decode.push_back(s->msg);
      }
      for (auto& a : da) {
        if (auto* d = std::get_if<ReportLoadDoneAction>(&a)) loads_done.push_back(d->request_id);
        if (auto* f = std::get_if<ReportLoadFailedAction>(&a)) load_failed.push_back(*f);
        if (auto* f = std::get_if<ReportBlocksFreeAction>(&a))
          decode_freed.push_back(f->request_id);
        if (auto* s = std::get_if<SendMessageAction>(&a)) to_prefill.push_back(s->msg);
      }
      if (deliver) DeliverAll(now);
    }
    FAIL() << "actions never settled";
  }
  void DeliverAll(TimePoint now) {
    auto tp = std::move(to_prefill);
    auto td = std::move(to_decode);
    to_prefill.clear();
    to_decode.clear();
    for (auto& m : tp) {
      if (auto* wb = std::get_if<WriteBlocksMsg>(&m)) prefill.OnWriteBlocks(*wb, now);
      if (auto* wc = std::get_if<WriteCancelMsg>(&m)) prefill.OnWriteCancel(*wc, now);
    }
    for (auto& m : td) decode.OnWriteDone(std::get<WriteDoneMsg>(m), now);
  }
  // Completes every pending write (cancelled ones as Cancelled).
  void CompleteWrites(TimePoint now) {
    auto w = std::move(writes);
    writes.clear();
    for (auto& [id, p] : w) {
      prefill.OnWriteCompleted(id, p.cancelled ? CancelledError("cancelled") : OkStatus(), now);
      // The agent delivers an attached WriteDone only after the WRITE's data landed.
      if (!p.cancelled && p.a.notification) to_decode.push_back(*p.a.notification);
    }
    Pump(now);
  }
  // Transfer x1 (40 tokens): the prefill leg p-1 and the decode leg d-1 admitted, the decode's
  // blocks allocated and its block ids delivered, at `now`.
  void AddBoth(TimePoint now) {
    ASSERT_TRUE(prefill.OnRequestAdded("p-1", 1, "x1", 40, now).ok());
    AddDecode(decode, "d-1", WriteParams("x1"), now);
    Pump(now);
  }
  // Layers [0, num_layers) of p-1 computed at `now` (its block table: kPrefillTable).
  void ComputeLayers(TimePoint now, int num_layers = kLayers) {
    for (int l = 0; l < num_layers; ++l) prefill.OnLayerComputed("p-1", l, kPrefillTable, now);
  }
  void ExpectIdle() {
    EXPECT_TRUE(prefill.Idle());
    EXPECT_TRUE(decode.Idle());
    EXPECT_EQ(prefill.NumHeldBlocks(), 0);
    EXPECT_EQ(prefill.NumWritesInFlight(), 0);
    EXPECT_EQ(prefill.NumParked(), 0);
    EXPECT_EQ(decode.NumWaiting(), 0);
  }
};

TEST(WriteCores, BlockIdsFirstThenPerLayerWritesThenDone) {
  Pipe p;
  auto m = p.decode.OnRequestAdded("d-1", WriteParams("x1"), 40, 0, 1);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_external_tokens, 39);
  EXPECT_TRUE(m->load_async);
  EXPECT_TRUE(p.decode.OnBlocksAllocated("d-1", kDecodeTable, 0, 39, 1).ok());
  p.Pump(1);
  EXPECT_EQ(p.prefill.NumParked(), 1);  // the block ids came first
  EXPECT_EQ(p.prefill.counters().notifications_parked, 1);
  ASSERT_TRUE(p.prefill.OnRequestAdded("p-1", 1, "x1", 40, 2).ok());
  EXPECT_EQ(p.prefill.NumParked(), 0);
  p.Pump(2);
  EXPECT_TRUE(p.writes.empty());  // nothing computed yet
  for (int l = 0; l < kLayers; ++l) {
    p.prefill.OnLayerComputed("p-1", l, kPrefillTable, 10 + l);
    p.Pump(10 + l);
    ASSERT_EQ(p.writes.size(), static_cast<size_t>(l + 1));
    const PostTransferAction& w = p.writes.rbegin()->second.a;
    EXPECT_EQ(w.layer, l);
    EXPECT_EQ(w.transfer_id, "x1");
    EXPECT_EQ(w.peer.engine_id, "d0");
    EXPECT_EQ(w.local_block_ids, kPrefillTable);
    EXPECT_EQ(w.remote_block_ids, kDecodeTable);
  }
  // A later decode step reports layers again: no new writes.
  p.prefill.OnLayerComputed("p-1", 0, kPrefillTable, 13);
  EXPECT_EQ(p.writes.size(), 3u);
  EXPECT_TRUE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 14));  // writes pending: hold
  EXPECT_EQ(p.prefill.NumHeldBlocks(), 3);
  p.Pump(14);
  EXPECT_TRUE(p.loads_done.empty());
  p.CompleteWrites(20);
  EXPECT_EQ(p.loads_done, (std::vector<std::string>{"d-1"}));
  EXPECT_EQ(p.prefill_freed, (std::vector<std::string>{"p-1"}));
  auto t = p.decode.TakeLoadTimings();
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].compute_us, 2);  // layer 0 at 10 → layer 2 at 12
  EXPECT_EQ(t[0].write_us, 10);   // first post at 10 → last done at 20
  EXPECT_EQ(t[0].overlap_us, 8);  // last layer at 12 → go at 20
  EXPECT_EQ(p.prefill.counters().transfers_completed, 1);
  EXPECT_EQ(p.prefill.counters().writes_ok, 3);
  EXPECT_EQ(p.decode.counters().loads_done, 1);
  EXPECT_EQ(p.prefill.counters().notifications_ignored, 0);
  EXPECT_EQ(p.decode.counters().notifications_ignored, 0);
  EXPECT_EQ(p.prefill.counters().lease_expired, 0);
  p.ExpectIdle();
}

TEST(WriteCores, RequestFirstComputedBeforeBlockIdsWritesAllLayersAtOnce) {
  Pipe p;
  ASSERT_TRUE(p.prefill.OnRequestAdded("p-1", 1, "x1", 40, 1).ok());
  p.ComputeLayers(2);
  EXPECT_TRUE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 3));  // parked request: held
  p.Pump(3);
  EXPECT_TRUE(p.writes.empty());
  // The decode had a prefix hit of one block: only blocks 1 and 2 are asked for.
  auto m = p.decode.OnRequestAdded("d-1", WriteParams("x1"), 40, 16, 4);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_external_tokens, 23);
  EXPECT_TRUE(p.decode.OnBlocksAllocated("d-1", std::vector<int32_t>{7, 8, 9}, 16, 23, 4).ok());
  p.Pump(4);
  ASSERT_EQ(p.writes.size(), 1u);
  const PostTransferAction& w = p.writes.begin()->second.a;
  EXPECT_EQ(w.layer, -1);  // every layer in one transfer
  EXPECT_EQ(w.local_block_ids, (std::vector<int32_t>{11, 12}));
  EXPECT_EQ(w.remote_block_ids, (std::vector<int32_t>{8, 9}));
  p.CompleteWrites(5);
  EXPECT_EQ(p.loads_done, (std::vector<std::string>{"d-1"}));
  EXPECT_EQ(p.prefill_freed, (std::vector<std::string>{"p-1"}));
  EXPECT_EQ(p.prefill.counters().holds, 1);
  EXPECT_EQ(p.prefill.counters().holds_freed, 1);
  p.ExpectIdle();
}

TEST(WriteCores, DecodeSkipsWhenItsPrefixCacheHasEverything) {
  Pipe p;
  // 33 tokens, local hit of 32: the last token is recomputed, nothing arrives remotely.
  auto m = p.decode.OnRequestAdded("d-1", WriteParams("x1"), 33, 32, 1);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_external_tokens, 0);
  EXPECT_FALSE(m->load_async);
  p.Pump(1);
  EXPECT_EQ(p.prefill.NumParked(), 1);  // the skip is parked until the request comes
  ASSERT_TRUE(p.prefill.OnRequestAdded("p-1", 1, "x1", 33, 2).ok());
  p.Pump(2);
  // The transfer is settled: the prefill's blocks are not held at finish.
  EXPECT_FALSE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 3));
  p.Pump(3);
  EXPECT_TRUE(p.writes.empty());
  EXPECT_EQ(p.decode.counters().skipped, 1);
  EXPECT_EQ(p.prefill.counters().notifications_ignored, 0);
  p.ExpectIdle();
}

TEST(WriteCores, WritesDoneBeforeTheRequestFinishesFreeAtFinish) {
  Pipe p;
  p.AddBoth(1);
  p.ComputeLayers(2);
  p.Pump(2);
  p.CompleteWrites(3);
  EXPECT_EQ(p.loads_done, (std::vector<std::string>{"d-1"}));
  EXPECT_FALSE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 4));  // free now
  EXPECT_TRUE(p.prefill_freed.empty());
  p.ExpectIdle();
}

TEST(WriteCores, DuplicateAndUnknownMessagesAreCountedNoOps) {
  Pipe p;
  ASSERT_TRUE(p.prefill.OnRequestAdded("p-1", 1, "x1", 40, 1).ok());
  p.deliver = false;
  AddDecode(p.decode, "d-1", WriteParams("x1"), 1);
  p.Pump(1);
  ASSERT_EQ(p.to_prefill.size(), 1u);
  const WriteBlocksMsg wb = std::get<WriteBlocksMsg>(p.to_prefill[0]);
  p.prefill.OnWriteBlocks(wb, 1);
  p.prefill.OnWriteBlocks(wb, 1);  // duplicate
  EXPECT_EQ(p.prefill.counters().notifications_ignored, 1);
  p.to_prefill.clear();
  p.deliver = true;
  p.ComputeLayers(2);
  EXPECT_TRUE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 2));
  p.Pump(2);
  EXPECT_EQ(p.writes.size(), 3u);  // not 6
  p.deliver = false;
  p.CompleteWrites(3);
  ASSERT_EQ(p.to_decode.size(), 1u);
  const WriteDoneMsg done = std::get<WriteDoneMsg>(p.to_decode[0]);
  EXPECT_EQ(done.outcome, WriteOutcome::kOk);
  p.decode.OnWriteDone(done, 3);
  p.decode.OnWriteDone(done, 3);  // duplicate
  EXPECT_EQ(p.decode.counters().notifications_ignored, 1);
  p.prefill.OnWriteCompleted(999, OkStatus(), 3);  // unknown completion
  EXPECT_EQ(p.prefill.counters().notifications_ignored, 2);
  p.prefill.OnWriteBlocks(wb, 4);  // late duplicate after completion
  EXPECT_EQ(p.prefill.counters().notifications_ignored, 3);
  WriteDoneMsg stranger = done;
  stranger.transfer_id = "nope";
  p.decode.OnWriteDone(stranger, 4);
  EXPECT_EQ(p.decode.counters().notifications_ignored, 2);
  p.to_decode.clear();
  p.Pump(4);
  EXPECT_EQ(p.loads_done, (std::vector<std::string>{"d-1"}));
  EXPECT_EQ(p.prefill.counters().writes_posted, 3);
  p.ExpectIdle();
}

TEST(WriteCores, DecodeAbortMidWriteKeepsBlocksUntilThePrefillConfirmsDrained) {
  Pipe p;
  p.AddBoth(1);
  p.prefill.OnLayerComputed("p-1", 0, kPrefillTable, 2);
  p.Pump(2);
  ASSERT_EQ(p.writes.size(), 1u);
  EXPECT_EQ(p.decode.WritableBlocksByTransfer().at("x1"), kDecodeTable);
  EXPECT_TRUE(p.decode.OnRequestAborted("d-1", 3));  // a write is in flight: keep the blocks
  EXPECT_TRUE(p.decode.WritableBlocksByTransfer().empty());
  p.Pump(3);
  EXPECT_TRUE(p.writes.begin()->second.cancelled);        // the prefill cancels its write
  EXPECT_TRUE(p.decode_freed.empty());                    // not freed before the drain
  p.prefill.OnLayerComputed("p-1", 1, kPrefillTable, 4);  // no new write after the cancel
  p.Pump(4);
  EXPECT_EQ(p.writes.size(), 1u);
  p.CompleteWrites(5);  // cancelled → WriteDone(cancelled) → decode frees
  EXPECT_EQ(p.decode_freed, (std::vector<std::string>{"d-1"}));
  EXPECT_TRUE(p.loads_done.empty());
  EXPECT_TRUE(p.load_failed.empty());
  // The prefill request finishes later: its transfer is settled, nothing held.
  p.prefill.OnLayerComputed("p-1", 2, kPrefillTable, 6);
  EXPECT_FALSE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 6));
  p.Pump(6);
  EXPECT_EQ(p.decode.counters().aborts_mid_write, 1);
  EXPECT_EQ(p.prefill.counters().notifications_ignored, 0);
  EXPECT_EQ(p.decode.counters().notifications_ignored, 0);
  p.ExpectIdle();
}

// The request table is the guard against engine bugs: a second allocation (while the first's
// writes are under way, and again after an abort) is the illegal transition the table names, and
// it changes nothing: no second WriteBlocks, no new offer or write bound, no block freed twice.
TEST(WriteCores, SecondAllocationIsAnIllegalTransitionAndChangesNothing) {
  Pipe p;
  p.AddBoth(1);
  p.prefill.OnLayerComputed("p-1", 0, kPrefillTable, 2);
  p.Pump(2);
  ASSERT_EQ(p.writes.size(), 1u);
  const auto offered = p.decode.WritableBlocksByTransfer();
  const auto deadline = p.decode.NextDeadline();
  const WriteDecodeCore::Counters before = p.decode.counters();

  Status st = p.decode.OnBlocksAllocated("d-1", std::vector<int32_t>{5, 6, 7}, 0, 39, 3);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(), "illegal WRITE request state transition WAITING -> WAITING");
  EXPECT_TRUE(p.decode.TakeActions().empty());
  EXPECT_EQ(p.decode.WritableBlocksByTransfer(), offered);
  EXPECT_EQ(p.decode.NextDeadline(), deadline);
  EXPECT_EQ(p.decode.NumWaiting(), 1);
  EXPECT_EQ(p.decode.counters().notifications_ignored, before.notifications_ignored);

  // Aborted mid-write: the blocks are kept until the drain; a late allocation is refused too.
  EXPECT_TRUE(p.decode.OnRequestAborted("d-1", 4));
  p.Pump(4);
  st = p.decode.OnBlocksAllocated("d-1", kDecodeTable, 0, 39, 5);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(), "illegal WRITE request state transition ABORTING -> WAITING");
  EXPECT_TRUE(p.decode.TakeActions().empty());
  EXPECT_TRUE(p.decode.WritableBlocksByTransfer().empty());
  EXPECT_TRUE(p.decode_freed.empty());
  p.CompleteWrites(6);  // drained → the blocks are freed, once
  EXPECT_EQ(p.decode_freed, (std::vector<std::string>{"d-1"}));
  EXPECT_TRUE(p.loads_done.empty());
  EXPECT_TRUE(p.load_failed.empty());
  // Once reported the entry is gone: a third allocation names no request.
  EXPECT_EQ(p.decode.OnBlocksAllocated("d-1", kDecodeTable, 0, 39, 7).code(),
            StatusCode::kNotFound);
  p.prefill.OnLayerComputed("p-1", 1, kPrefillTable, 8);
  p.prefill.OnLayerComputed("p-1", 2, kPrefillTable, 8);
  EXPECT_FALSE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 8));
  p.Pump(8);
  EXPECT_EQ(p.decode_freed.size(), 1u);
  p.ExpectIdle();
}

TEST(WriteCores, DecodeAbortWithoutAnyDrainFreesAfterTheWriteTimeout) {
  Pipe p;
  p.deliver = false;  // the prefill never hears of it
  AddDecode(p.decode, "d-1", WriteParams("x1"), 1);
  EXPECT_TRUE(p.decode.OnRequestAborted("d-1", 2));
  p.Pump(2);
  p.decode.OnTick(1 + 12 * kSecond - 1);
  p.Pump(1 + 12 * kSecond - 1);
  EXPECT_TRUE(p.decode_freed.empty());
  EXPECT_EQ(p.decode.NextDeadline(), 1 + 12 * kSecond);
  p.decode.OnTick(1 + 12 * kSecond);
  p.Pump(1 + 12 * kSecond);
  EXPECT_EQ(p.decode_freed, (std::vector<std::string>{"d-1"}));
  EXPECT_EQ(p.decode.counters().write_timeouts, 0);  // an abort, not a timeout
  p.to_prefill.clear();
  p.ExpectIdle();
}

// The decode's write_cancel overtakes its own write_blocks (found by the simulator, seeds 504,
// 787, 271): the prefill settles the pair on the cancel, then answers the late block ids with
// write_done(cancelled), so the aborted decode frees at once instead of at its write timeout.
TEST(WriteCores, CancelThatOvertakesItsBlockIdsIsConfirmedWhenTheyArrive) {
  Pipe p;
  p.deliver = false;
  ASSERT_TRUE(p.prefill.OnRequestAdded("p-1", 1, "x1", 40, 1).ok());
  AddDecode(p.decode, "d-1", WriteParams("x1"), 1);
  p.Pump(1);
  ASSERT_EQ(p.to_prefill.size(), 1u);                // write_blocks, still on the wire
  EXPECT_TRUE(p.decode.OnRequestAborted("d-1", 2));  // asked already: keep blocks until confirmed
  p.Pump(2);
  ASSERT_EQ(p.to_prefill.size(), 2u);
  ASSERT_TRUE(std::holds_alternative<WriteCancelMsg>(p.to_prefill[1]));
  EXPECT_TRUE(std::get<WriteCancelMsg>(p.to_prefill[1]).want_done);
  std::swap(p.to_prefill[0], p.to_prefill[1]);  // the cancel arrives first
  p.deliver = true;
  p.DeliverAll(3);
  p.Pump(3);
  EXPECT_EQ(p.decode_freed, (std::vector<std::string>{"d-1"}));  // at 3, not at the timeout
  EXPECT_TRUE(p.writes.empty());  // nothing was written into the aborted decode's blocks
  EXPECT_EQ(p.prefill.counters().notifications_ignored, 0);
  EXPECT_EQ(p.decode.counters().notifications_ignored, 0);
  EXPECT_EQ(p.decode.counters().write_timeouts, 0);
  // The prefill leg still computes and finishes; it holds nothing for this transfer.
  p.ComputeLayers(4);
  EXPECT_FALSE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 4));
  p.Pump(4);
  EXPECT_TRUE(p.writes.empty());
  p.ExpectIdle();
}

TEST(WriteCores, PrefillAbortMidWriteTellsTheDecodeWhichRecomputes) {
  Pipe p;
  p.AddBoth(1);
  p.prefill.OnLayerComputed("p-1", 0, kPrefillTable, 2);
  p.Pump(2);
  EXPECT_TRUE(p.prefill.OnRequestAborted("p-1", 3));  // keep: the write may still read them
  p.Pump(3);
  EXPECT_TRUE(p.writes.begin()->second.cancelled);
  EXPECT_TRUE(p.load_failed.empty());  // not before the cancelled write ended
  p.CompleteWrites(4);
  EXPECT_EQ(p.prefill_freed, (std::vector<std::string>{"p-1"}));
  ASSERT_EQ(p.load_failed.size(), 1u);
  EXPECT_EQ(p.load_failed[0].request_id, "d-1");
  EXPECT_TRUE(p.load_failed[0].recompute);
  EXPECT_EQ(p.load_failed[0].status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(p.decode.counters().load_failures, 1);
  p.ExpectIdle();
}

TEST(WriteCores, PrefillAbortBeforeBlockIdsAnswersTheLateBlockIdsWithFailure) {
  Pipe p;
  p.decode = WriteDecodeCore({.engine_id = "d0",
                              .block_size = 16,
                              .write_timeout = 12 * kSecond,
                              .load_failure_policy = LoadFailurePolicy::kFail});
  ASSERT_TRUE(p.prefill.OnRequestAdded("p-1", 1, "x1", 40, 1).ok());
  EXPECT_FALSE(p.prefill.OnRequestAborted("p-1", 2));  // nothing in flight: free now
  AddDecode(p.decode, "d-1", WriteParams("x1"), 3);
  p.Pump(3);
  ASSERT_EQ(p.load_failed.size(), 1u);
  EXPECT_FALSE(p.load_failed[0].recompute);  // policy "fail"
  EXPECT_NE(p.load_failed[0].status.message().find("aborted"), std::string::npos);
  p.ExpectIdle();
}

TEST(WriteCores, FailedWriteFailsTheLoadAndFreesBothSides) {
  Pipe p;
  p.AddBoth(1);
  p.ComputeLayers(2);
  EXPECT_TRUE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 2));
  p.Pump(2);
  ASSERT_EQ(p.writes.size(), 3u);
  const uint64_t first = p.writes.begin()->first;
  p.writes.erase(first);
  p.prefill.OnWriteCompleted(first, UnavailableError("peer lost"), 3);
  p.Pump(3);
  for (auto& [id, w] : p.writes) EXPECT_TRUE(w.cancelled);
  EXPECT_TRUE(p.load_failed.empty());
  p.CompleteWrites(4);
  ASSERT_EQ(p.load_failed.size(), 1u);
  EXPECT_TRUE(p.load_failed[0].recompute);
  EXPECT_EQ(p.prefill_freed, (std::vector<std::string>{"p-1"}));
  EXPECT_EQ(p.prefill.counters().writes_failed, 3);
  p.ExpectIdle();
}

TEST(WriteCores, LeaseFreesAPrefillWhoseBlockIdsNeverCame) {
  Pipe p;
  ASSERT_TRUE(p.prefill.OnRequestAdded("p-1", 1, "x1", 40, 1).ok());
  EXPECT_TRUE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 2));
  EXPECT_EQ(p.prefill.NextDeadline(), 2 + 10 * kSecond);
  p.prefill.OnTick(2 + 10 * kSecond);
  p.Pump(2 + 10 * kSecond);
  EXPECT_EQ(p.prefill_freed, (std::vector<std::string>{"p-1"}));
  EXPECT_EQ(p.prefill.counters().lease_expired, 1);
  // The block ids arrive late: answered "expired", the decode recomputes.
  AddDecode(p.decode, "d-1", WriteParams("x1"), 3 + 10 * kSecond);
  p.Pump(3 + 10 * kSecond);
  ASSERT_EQ(p.load_failed.size(), 1u);
  EXPECT_NE(p.load_failed[0].status.message().find("expired"), std::string::npos);
  p.ExpectIdle();
}

TEST(WriteCores, ParkedBlockIdsExpireWithAnAnswerAndTheParkingIsBounded) {
  Pipe p;
  for (int i = 0; i < 5; ++i) {
    const std::string id = "d-" + std::to_string(i);
    AddDecode(p.decode, id, WriteParams("x" + std::to_string(i)), 1);
  }
  p.Pump(1);
  EXPECT_EQ(p.prefill.NumParked(), 4);  // max_parked_messages: the fifth is refused at once
  EXPECT_EQ(p.load_failed.size(), 1u);
  p.prefill.OnTick(1 + 10 * kSecond);
  p.Pump(1 + 10 * kSecond);
  EXPECT_EQ(p.load_failed.size(), 5u);
  EXPECT_EQ(p.prefill.counters().parked_dropped, 5);
  p.ExpectIdle();
}

TEST(WriteCores, ProxyReleaseMidWriteCancelsAndFreesOnceDrained) {
  Pipe p;
  p.AddBoth(1);
  p.ComputeLayers(2);
  EXPECT_TRUE(p.prefill.OnRequestFinished("p-1", kPrefillTable, 2));
  p.Pump(2);
  EXPECT_EQ(p.prefill.OnRelease({.transfer_id = "x1", .prefill_engine_id = "other"}, 3).code(),
            StatusCode::kNotFound);
  ASSERT_TRUE(p.prefill.OnRelease({.transfer_id = "x1", .prefill_engine_id = ""}, 3).ok());
  p.Pump(3);
  EXPECT_TRUE(p.prefill_freed.empty());
  p.CompleteWrites(4);
  EXPECT_EQ(p.prefill_freed, (std::vector<std::string>{"p-1"}));
  EXPECT_EQ(p.load_failed.size(), 1u);
  EXPECT_EQ(p.prefill.counters().transfers_released, 1);
  p.ExpectIdle();
}

TEST(WriteCores, PromptMismatchAndBadRequestsAreRefused) {
  Pipe p;
  EXPECT_EQ(p.prefill.OnRequestAdded("p-1", 2, "x1", 40, 1).code(),
            StatusCode::kInvalidArgument);  // n must be 1 on a write prefill leg
  ASSERT_TRUE(p.prefill.OnRequestAdded("p-1", 1, "x1", 40, 1).ok());
  EXPECT_EQ(p.prefill.OnRequestAdded("p-2", 1, "x1", 40, 1).code(), StatusCode::kAlreadyExists);
  KvTransferParams read = WriteParams("x1");
  read.mode = KvTransferMode::kRead;
  EXPECT_EQ(p.decode.OnRequestAdded("d-0", read, 40, 0, 1).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(p.decode.OnRequestAdded("d-1", WriteParams("x1"), 41, 0, 1).ok());
  EXPECT_TRUE(p.decode.OnBlocksAllocated("d-1", kDecodeTable, 0, 40, 1).ok());
  p.Pump(1);
  ASSERT_EQ(p.load_failed.size(), 1u);
  EXPECT_NE(p.load_failed[0].status.message().find("prompt mismatch"), std::string::npos);
  EXPECT_FALSE(p.prefill.OnRequestAborted("p-1", 2));
  p.Pump(2);
  p.ExpectIdle();
}

TEST(WriteCores, PrefillRankWritesOnlyTheDecodeRanksItServes) {
  // decode tp 2, prefill tp 1: prefill rank 0 writes to both decode ranks; done after both.
  WritePrefillCore prefill({.engine_id = "p0", .block_size = 16, .num_layers = 1});
  WriteDecodeCore decode({.engine_id = "d0", .tp_size = 2, .block_size = 16});
  ASSERT_TRUE(prefill.OnRequestAdded("p-1", 1, "x1", 40, 1).ok());
  AddDecode(decode, "d-1", WriteParams("x1"), 1);
  const std::vector<WriteBlocksMsg> wbs = TakeWriteBlocks(decode);
  ASSERT_EQ(wbs.size(), 2u);
  EXPECT_EQ(wbs[0].decode_rank, 0);
  EXPECT_EQ(wbs[1].decode_rank, 1);
  prefill.OnWriteBlocks(wbs[0], 2);
  prefill.OnLayerComputed("p-1", 0, kPrefillTable, 2);
  EXPECT_TRUE(prefill.OnRequestFinished("p-1", kPrefillTable, 2));
  std::vector<uint64_t> ids;
  std::optional<WriteDoneMsg> first_done;
  for (auto& a : prefill.TakeActions()) {
    ids.push_back(std::get<PostTransferAction>(a).id);
    first_done = std::get<PostTransferAction>(a).notification;
  }
  ASSERT_EQ(ids.size(), 1u);
  prefill.OnWriteCompleted(ids[0], OkStatus(), 3);
  EXPECT_TRUE(prefill.TakeActions().empty());  // rank 1 still expected: still held
  ASSERT_TRUE(first_done.has_value());         // rank 0's WriteDone rode on its one WRITE
  EXPECT_EQ(first_done->decode_rank, 0);
  decode.OnWriteDone(*first_done, 3);
  EXPECT_TRUE(decode.TakeActions().empty());
  prefill.OnWriteBlocks(wbs[1], 4);
  auto acts = prefill.TakeActions();
  ASSERT_EQ(acts.size(), 1u);
  const auto& w = std::get<PostTransferAction>(acts[0]);
  EXPECT_EQ(w.peer.rank, 1);
  EXPECT_EQ(w.layer, -1);
  ASSERT_TRUE(w.notification.has_value());
  const WriteDoneMsg second_done = *w.notification;
  prefill.OnWriteCompleted(w.id, OkStatus(), 5);
  acts = prefill.TakeActions();
  ASSERT_EQ(acts.size(), 1u);  // the blocks are free (WriteDone rode on the WRITE)
  EXPECT_TRUE(std::holds_alternative<ReportBlocksFreeAction>(acts[0]));
  decode.OnWriteDone(second_done, 5);
  acts = decode.TakeActions();
  ASSERT_EQ(acts.size(), 1u);
  EXPECT_EQ(std::get<ReportLoadDoneAction>(acts[0]).request_id, "d-1");
  EXPECT_TRUE(prefill.Idle());
  EXPECT_TRUE(decode.Idle());
}

TEST(WriteCores, PairsFollowTheTpPlanWhenKvHeadsAreFewerThanTheTpSize) {
  // One KV head, prefill tp 2 (the head replicated on both ranks), decode tp 1: the plan reads
  // the head from prefill rank 0 only (tp_plan.h), where the even split would use both ranks.
  WritePrefillCore prefill(
      {.engine_id = "p0", .tp_size = 2, .num_kv_heads = 1, .block_size = 16, .num_layers = 1});
  WriteDecodeCore decode({.engine_id = "d0", .tp_size = 1, .num_kv_heads = 1, .block_size = 16});
  KvTransferParams params = WriteParams("x1");
  params.tp_size = 2;
  ASSERT_TRUE(prefill.OnRequestAdded("p-1", 1, "x1", 40, 1).ok());
  AddDecode(decode, "d-1", params, 1);
  std::vector<WriteBlocksMsg> wbs;
  std::vector<WriteCancelMsg> skips;  // rank 1 writes nothing: told so at admission
  for (auto& a : decode.TakeActions()) {
    const ControlMessage& m = std::get<SendMessageAction>(a).msg;
    if (auto* wb = std::get_if<WriteBlocksMsg>(&m)) wbs.push_back(*wb);
    if (auto* wc = std::get_if<WriteCancelMsg>(&m)) skips.push_back(*wc);
  }
  ASSERT_EQ(wbs.size(), 1u);
  EXPECT_EQ(wbs[0].prefill_rank, 0);
  EXPECT_EQ(wbs[0].decode_rank, 0);
  EXPECT_EQ(wbs[0].decode_tp_size, 1);
  ASSERT_EQ(skips.size(), 1u);
  EXPECT_EQ(skips[0].prefill_rank, 1);
  EXPECT_FALSE(skips[0].want_done);
  // Prefill rank 1 is no source of decode rank 0: a message naming it there is refused.
  WriteBlocksMsg stray = wbs[0];
  stray.prefill_rank = 1;
  prefill.OnWriteBlocks(stray, 2);
  auto acts = prefill.TakeActions();
  ASSERT_EQ(acts.size(), 1u);
  const auto& refused = std::get<WriteDoneMsg>(std::get<SendMessageAction>(acts[0]).msg);
  EXPECT_NE(refused.outcome, WriteOutcome::kOk);
  EXPECT_EQ(refused.prefill_rank, 1);
  EXPECT_EQ(refused.decode_rank, 0);
  prefill.OnWriteCancel(skips[0], 2);  // the skip settles rank 1
  EXPECT_TRUE(prefill.TakeActions().empty());
  // Rank 0 completes with decode rank 0 alone.
  prefill.OnWriteBlocks(wbs[0], 2);
  prefill.OnLayerComputed("p-1", 0, kPrefillTable, 2);
  acts = prefill.TakeActions();
  ASSERT_EQ(acts.size(), 1u);
  const auto& w = std::get<PostTransferAction>(acts[0]);
  EXPECT_EQ(w.peer.rank, 0);
  EXPECT_EQ(w.local_rank, 0);
  EXPECT_EQ(w.local_block_ids, std::vector<int32_t>(kPrefillTable.begin(), kPrefillTable.end()));
  EXPECT_EQ(w.remote_block_ids, std::vector<int32_t>(kDecodeTable.begin(), kDecodeTable.end()));
  ASSERT_TRUE(w.notification.has_value());
  const WriteDoneMsg done = *w.notification;
  prefill.OnWriteCompleted(w.id, OkStatus(), 3);
  EXPECT_FALSE(prefill.OnRequestFinished("p-1", kPrefillTable, 3));  // complete: free at once
  EXPECT_EQ(prefill.rank_counters(0).transfers_completed, 1);
  decode.OnWriteDone(done, 3);
  acts = decode.TakeActions();
  ASSERT_EQ(acts.size(), 1u);
  EXPECT_EQ(std::get<ReportLoadDoneAction>(acts[0]).request_id, "d-1");
  EXPECT_TRUE(prefill.TakeActions().empty());
  EXPECT_TRUE(prefill.Idle());
  EXPECT_TRUE(decode.Idle());

  // Without a head count the cores assume an even split: the decode writes to both ranks.
  WriteDecodeCore even({.engine_id = "d1", .tp_size = 1, .block_size = 16});
  AddDecode(even, "d-2", params, 4);
  std::vector<int> ranks;
  for (const WriteBlocksMsg& wb : TakeWriteBlocks(even)) ranks.push_back(wb.prefill_rank);
  EXPECT_EQ(ranks, (std::vector<int>{0, 1}));
  EXPECT_TRUE(even.OnRequestAborted("d-2", 5));  // writes may land: keep the blocks
}

TEST(WriteCores, PrefillRanksHoldTheSharedBlocksUntilTheLastRankIsDone) {
  // Prefill tp 2 -> decode tp 2, 2 KV heads: pairs (0 <- 0) and (1 <- 1). The engine's one block
  // table is freed once, after both ranks' writes landed; the decode goes on after both.
  WritePrefillCore prefill(
      {.engine_id = "p0", .tp_size = 2, .num_kv_heads = 2, .block_size = 16, .num_layers = 1});
  WriteDecodeCore decode({.engine_id = "d0", .tp_size = 2, .num_kv_heads = 2, .block_size = 16});
  KvTransferParams params = WriteParams("x1");
  params.tp_size = 2;
  ASSERT_TRUE(prefill.OnRequestAdded("p-1", 1, "x1", 40, 1).ok());
  AddDecode(decode, "d-1", params, 1);
  const std::vector<WriteBlocksMsg> wbs = TakeWriteBlocks(decode);
  ASSERT_EQ(wbs.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(wbs[r].decode_rank, r);
    EXPECT_EQ(wbs[r].prefill_rank, r);
    prefill.OnWriteBlocks(wbs[r], 2);
  }
  prefill.OnLayerComputed("p-1", 0, kPrefillTable, 2);
  EXPECT_TRUE(prefill.OnRequestFinished("p-1", kPrefillTable, 2));
  std::vector<PostTransferAction> ws;
  for (auto& a : prefill.TakeActions()) ws.push_back(std::get<PostTransferAction>(a));
  ASSERT_EQ(ws.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ws[r].local_rank, r);
    EXPECT_EQ(ws[r].peer.rank, r);
    EXPECT_EQ(ws[r].peer_tp_size, 2);
    EXPECT_EQ(ws[r].id >> WritePrefillCore::kRankShift, static_cast<uint64_t>(r));
    ASSERT_TRUE(ws[r].notification.has_value());
    EXPECT_EQ(ws[r].notification->prefill_rank, r);
  }
  EXPECT_EQ(prefill.NumWritesInFlight(), 2);
  prefill.OnWriteCompleted(ws[0].id, OkStatus(), 3);
  EXPECT_TRUE(prefill.TakeActions().empty());  // rank 1 still writes: still held
  EXPECT_EQ(prefill.NumHeldBlocks(), 3);
  decode.OnWriteDone(*ws[0].notification, 3);
  EXPECT_TRUE(decode.TakeActions().empty());  // one pair of two
  prefill.OnWriteCompleted(ws[1].id, OkStatus(), 4);
  auto acts = prefill.TakeActions();
  ASSERT_EQ(acts.size(), 1u);
  EXPECT_EQ(std::get<ReportBlocksFreeAction>(acts[0]).request_id, "p-1");
  decode.OnWriteDone(*ws[1].notification, 4);
  acts = decode.TakeActions();
  ASSERT_EQ(acts.size(), 1u);
  EXPECT_EQ(std::get<ReportLoadDoneAction>(acts[0]).request_id, "d-1");
  EXPECT_EQ(prefill.counters().transfers_completed, 2);
  EXPECT_EQ(prefill.counters().targets_ok, 2);
  // A completion for an unknown rank is counted, not routed.
  prefill.OnWriteCompleted(uint64_t{7} << WritePrefillCore::kRankShift, OkStatus(), 5);
  EXPECT_EQ(prefill.counters().notifications_ignored, 1);
  EXPECT_TRUE(prefill.Idle());
  EXPECT_TRUE(decode.Idle());
}

TEST(WriteMessages, RoundTripAndRefuseBadFields) {
  WriteBlocksMsg wb{.transfer_id = "x1",
                    .prefill_engine_id = "p0",
                    .prefill_rank = 0,
                    .decode_engine_id = "d0",
                    .decode_rank = 1,
                    .decode_tp_size = 2,
                    .decode_host = "127.0.0.1",
                    .decode_port = 8100,
                    .num_prompt_tokens = 40,
                    .first_block = 1,
                    .block_ids = {4, 5}};
  WriteDoneMsg wd{.transfer_id = "x1",
                  .prefill_engine_id = "p0",
                  .decode_engine_id = "d0",
                  .outcome = WriteOutcome::kCancelled,
                  .reason = "cancelled by the decode",
                  .compute_us = 5,
                  .write_us = 6,
                  .since_last_layer_us = 7};
  WriteCancelMsg wc{
      .transfer_id = "x1", .prefill_engine_id = "p0", .decode_engine_id = "d0", .want_done = false};
  for (const ControlMessage& m : {ControlMessage(wb), ControlMessage(wd), ControlMessage(wc)}) {
    auto back = DecodeMessage(EncodeMessage(m));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_TRUE(*back == m);
  }
  EXPECT_FALSE(DecodeMessage(R"({"type":"write_blocks","transfer_id":"x1","prefill_engine_id":"p0",
      "prefill_rank":0,"decode_engine_id":"d0","decode_rank":0,"decode_tp_size":1,
      "decode_host":"h","decode_port":1,"num_prompt_tokens":40,"first_block":0,
      "block_ids":[1,1]})")
                   .ok());  // repeated block id
  EXPECT_FALSE(DecodeMessage(R"({"type":"write_blocks","transfer_id":"x1","prefill_engine_id":"p0",
      "prefill_rank":0,"decode_engine_id":"d0","decode_rank":0,"decode_tp_size":1,
      "decode_host":"h","decode_port":1,"num_prompt_tokens":40,"first_block":0,
      "block_ids":[-1]})")
                   .ok());
  EXPECT_FALSE(DecodeMessage(R"({"type":"write_done","transfer_id":"x1","prefill_engine_id":"p0",
      "prefill_rank":0,"decode_engine_id":"d0","decode_rank":0,"outcome":"maybe",
      "compute_us":0,"write_us":0,"since_last_layer_us":0})")
                   .ok());
  EXPECT_FALSE(DecodeMessage(R"({"type":"write_cancel","transfer_id":"x1","prefill_engine_id":"p0",
      "prefill_rank":0,"decode_engine_id":"d0","decode_rank":3,"decode_tp_size":2,
      "want_done":true})")
                   .ok());  // rank outside the tp size
}

}  // namespace
}  // namespace kvbridge
