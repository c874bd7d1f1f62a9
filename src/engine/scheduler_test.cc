// Scheduler tests without a model: synthetic logits drive the sampling.
#include "kvbridge/engine/scheduler.h"

#include <gtest/gtest.h>

#include "engine/engine_test_util.h"

namespace kvbridge {
namespace {

using testing_engine::FakeConnector;

TEST(RequestState, TransitionTable) {
  using S = RequestState;
  EXPECT_TRUE(CheckTransition(S::kWaiting, S::kRunning).ok());
  EXPECT_TRUE(CheckTransition(S::kWaiting, S::kWaitingForRemoteKvs).ok());
  EXPECT_TRUE(CheckTransition(S::kWaitingForRemoteKvs, S::kWaiting).ok());
  EXPECT_TRUE(CheckTransition(S::kRunning, S::kPreempted).ok());
  EXPECT_TRUE(CheckTransition(S::kPreempted, S::kRunning).ok());
  EXPECT_TRUE(CheckTransition(S::kRunning, S::kFinishedLength).ok());
  EXPECT_TRUE(CheckTransition(S::kWaitingForRemoteKvs, S::kFinishedAborted).ok());
  EXPECT_EQ(CheckTransition(S::kWaitingForRemoteKvs, S::kRunning).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckTransition(S::kWaitingForRemoteKvs, S::kPreempted).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckTransition(S::kWaiting, S::kPreempted).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckTransition(S::kFinishedStopped, S::kRunning).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckTransition(S::kFinishedAborted, S::kFinishedAborted).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(RequestStateName(S::kWaitingForRemoteKvs), "WAITING_FOR_REMOTE_KVS");
}

struct Rig {
  std::unique_ptr<BlockPool> pool;
  FakeConnector connector;
  std::unique_ptr<Scheduler> sched;
  explicit Rig(int64_t blocks = 16, int budget = 64) {
    pool = std::move(BlockPool::Create({.num_blocks = blocks, .block_size = 4})).value();
    SchedulerConfig c;
    c.max_num_batched_tokens = budget;
    c.max_model_len = 64;
    c.vocab_size = 8;
    c.eos_token_ids = {7};
    c.model_fingerprint = "fp";
    sched = std::make_unique<Scheduler>(c, pool.get(), &connector);
  }
  // Logits favouring `token` in every row.
  static std::vector<float> Favour(const ScheduledBatch& b, int token) {
    std::vector<float> l(static_cast<size_t>(b.num_logit_rows) * 8, 0.0f);
    for (int r = 0; r < b.num_logit_rows; ++r) l[r * 8 + token] = 5.0f;
    return l;
  }
};

EngineRequest R(std::string id, int len, int max_tokens, int n = 1, int salt = 0) {
  EngineRequest r;
  r.request_id = std::move(id);
  for (int i = 0; i < len; ++i) r.prompt_token_ids.push_back((i + salt) % 7);
  r.sampling.max_tokens = max_tokens;
  r.sampling.n = n;
  r.sampling.temperature = 0;
  return r;
}

TEST(Scheduler, ChunksPrefillUnderTheTokenBudget) {
  Rig rig(16, 5);
  ASSERT_TRUE(rig.sched->AddRequest(R("a", 12, 2), 0).ok());
  std::vector<int> starts;
  for (int step = 0; step < 3; ++step) {
    ScheduledBatch b = rig.sched->Schedule(step);
    ASSERT_EQ(b.chunks.size(), 1u);
    starts.push_back(b.chunks[0].start_pos);
    EXPECT_EQ(b.chunks[0].num_tokens, step < 2 ? 5 : 2);
    EXPECT_EQ(b.chunks[0].compute_logits, step == 2);
    EXPECT_EQ(b.chunks[0].num_blocks, (b.chunks[0].start_pos + b.chunks[0].num_tokens + 3) / 4);
    ASSERT_TRUE(rig.sched->UpdateFromOutput(b, Rig::Favour(b, 3), step).ok());
  }
  EXPECT_EQ(starts, (std::vector<int>{0, 5, 10}));
  auto outs = rig.sched->TakeOutputs();
  ASSERT_EQ(outs.size(), 1u);
  EXPECT_EQ(outs[0].outputs.at(0).new_token_ids, std::vector<int32_t>{3});
}

TEST(Scheduler, EosStopsUnlessIgnored) {
  Rig rig;
  ASSERT_TRUE(rig.sched->AddRequest(R("a", 3, 5), 0).ok());
  EngineRequest ig = R("b", 3, 2);
  ig.sampling.ignore_eos = true;
  ASSERT_TRUE(rig.sched->AddRequest(ig, 0).ok());
  for (int step = 0; step < 3 && rig.sched->HasUnfinished(); ++step) {
    ScheduledBatch b = rig.sched->Schedule(step);
    ASSERT_TRUE(rig.sched->UpdateFromOutput(b, Rig::Favour(b, 7), step).ok());
  }
  std::map<std::string, std::string> reason;
  for (auto& o : rig.sched->TakeOutputs()) {
    for (auto& co : o.outputs) {
      if (co.finished) reason[o.request_id] = co.finish_reason;
    }
  }
  EXPECT_EQ(reason["a"], "stop");
  EXPECT_EQ(reason["b"], "length");
  EXPECT_EQ(rig.pool->NumActive(), 0);
}

TEST(Scheduler, BadLogitsFailTheBatchAndTellTheConnector) {
  Rig rig;
  ASSERT_TRUE(rig.sched->AddRequest(R("a", 6, 5, 2), 0).ok());
  ScheduledBatch b = rig.sched->Schedule(1);
  ASSERT_TRUE(rig.sched->UpdateFromOutput(b, Rig::Favour(b, 1), 1).ok());  // forks
  b = rig.sched->Schedule(2);
  ASSERT_EQ(b.chunks.size(), 2u);
  std::vector<float> wrong(3);
  EXPECT_EQ(rig.sched->UpdateFromOutput(b, wrong, 2).code(), StatusCode::kInvalidArgument);
  auto outs = rig.sched->TakeOutputs();
  ASSERT_FALSE(outs.empty());
  EXPECT_TRUE(outs.back().finished);
  EXPECT_EQ(outs.back().error.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rig.connector.calls->aborted, (std::vector<std::string>{"0_a", "1_a"}));
  EXPECT_EQ(rig.pool->NumActive(), 0);
  EXPECT_FALSE(rig.sched->HasUnfinished());
}

TEST(Scheduler, RemoteLoadWaitsOnlyForBlocksOfTheWholePrompt) {
  // 4 blocks of 4: the 12-token prompt needs 3; a running 5-token request holds 2.
  Rig rig(4);
  ASSERT_TRUE(rig.sched->AddRequest(R("busy", 5, 3, 1, /*salt=*/3), 0).ok());  // no shared prefix
  ScheduledBatch b = rig.sched->Schedule(0);
  ASSERT_TRUE(rig.sched->UpdateFromOutput(b, Rig::Favour(b, 1), 0).ok());
  rig.connector.match_by_parent.emplace("x", KvConnector::Match{12, true});
  ASSERT_TRUE(rig.sched->AddRequest(R("x", 12, 2), 0).ok());
  b = rig.sched->Schedule(1);
  EXPECT_TRUE(rig.connector.calls->allocs.empty());  // not asked while it could not allocate
  EXPECT_EQ(
      std::count(rig.connector.calls->matched.begin(), rig.connector.calls->matched.end(), "x"), 0);
  ASSERT_TRUE(rig.sched->UpdateFromOutput(b, Rig::Favour(b, 1), 1).ok());
  for (int step = 2; step < 6 && rig.connector.calls->allocs.empty(); ++step) {
    b = rig.sched->Schedule(step);
    ASSERT_TRUE(rig.sched->UpdateFromOutput(b, Rig::Favour(b, 1), step).ok());
  }
  ASSERT_EQ(rig.connector.calls->allocs.size(), 1u);
  EXPECT_EQ(
      std::count(rig.connector.calls->matched.begin(), rig.connector.calls->matched.end(), "x"), 1);
  EXPECT_EQ(rig.sched->GetState("x"), RequestState::kWaitingForRemoteKvs);
  EXPECT_EQ(rig.pool->NumActive(), 3);
  EXPECT_FALSE(rig.sched->HasUnfinished() && rig.sched->GetState("busy").has_value());
  ASSERT_TRUE(rig.sched->Abort("x", 9));
  EXPECT_EQ(rig.pool->NumActive(), 0);
}

}  // namespace
}  // namespace kvbridge

namespace kvbridge {
namespace {

TEST(Scheduler, ConnectorMatchBeyondThePromptFailsTheRequest) {
  Rig rig;
  rig.connector.match_by_parent.emplace("x", KvConnector::Match{20, true});
  ASSERT_TRUE(rig.sched->AddRequest(R("x", 12, 2), 0).ok());
  ScheduledBatch b = rig.sched->Schedule(0);
  EXPECT_TRUE(b.empty());
  auto outs = rig.sched->TakeOutputs();
  ASSERT_EQ(outs.size(), 1u);
  EXPECT_TRUE(outs[0].finished);
  EXPECT_EQ(outs[0].error.code(), StatusCode::kInternal);
  EXPECT_TRUE(rig.connector.calls->allocs.empty());
  EXPECT_EQ(rig.pool->NumActive(), 0);
}

}  // namespace
}  // namespace kvbridge
