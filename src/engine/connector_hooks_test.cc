// The engine's KvConnector hook points, exercised with a fake connector at the boundary and
// two in-process engines standing in for a prefill and a decode (KV copied between their pools).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cstring>

#include "engine/engine_test_util.h"
#include "kvbridge/engine/engine_core.h"

namespace kvbridge {
namespace {

using testing_engine::BitwiseEqual;
using testing_engine::FakeConnector;
using testing_engine::InstallFake;
using testing_engine::LogitsLog;
using testing_engine::MakeCore;
using testing_engine::Prompt;
using testing_engine::Req;
using testing_engine::RunAll;
using testing_engine::SmallConfig;

void CopyBlocks(EngineCore& from, const std::vector<int32_t>& src, EngineCore& to,
                const std::vector<int32_t>& dst) {
  ASSERT_EQ(src.size(), dst.size());
  const PagedKvView& a = from.storage().view();
  const PagedKvView& b = to.storage().view();
  const size_t bb = a.layout.BlockBytes();
  ASSERT_EQ(bb, b.layout.BlockBytes());
  for (int l = 0; l < a.layout.num_layers; ++l) {
    for (size_t i = 0; i < src.size(); ++i) {
      std::memcpy(b.layer_base[l] + dst[i] * bb, a.layer_base[l] + src[i] * bb, bb);
    }
  }
}

std::vector<int32_t> Greedy(const std::vector<int32_t>& prompt, int max_tokens) {
  auto core = MakeCore(SmallConfig());
  TimePoint now = 0;
  EXPECT_TRUE(core->AddRequest(Req("ref", prompt, max_tokens), now).ok());
  return RunAll(*core, &now)["ref"].tokens.at(0);
}

TEST(ConnectorHooks, FactoryGetsThePoolMemoryFingerprintAndMetrics) {
  EngineConfig c = SmallConfig(32);
  FakeConnector** fake = InstallFake(&c);
  MetricsRegistry metrics;
  auto core = MakeCore(c, &metrics);
  ASSERT_NE(*fake, nullptr);
  const EngineHooks& h = (*fake)->hooks;
  EXPECT_EQ(h.kv_view.layer_base, core->storage().view().layer_base);
  EXPECT_EQ(h.kv_view.layout.num_blocks, 32);
  EXPECT_EQ(h.model_fingerprint, core->model().fingerprint());
  EXPECT_EQ(h.metrics, &metrics);
  EXPECT_TRUE(static_cast<bool>(h.wake));
  EXPECT_EQ(h.kv_shm_fd, core->storage().shm_fd());
  EXPECT_EQ(h.kv_layer_offsets, core->storage().layer_offsets());
  // Every step polls.
  ASSERT_TRUE(core->Step(1).ok());
  ASSERT_TRUE(core->Step(2).ok());
  EXPECT_EQ((*fake)->calls->polls, 2);
}

// The pool is a memfd: a second mapping of the fd at each layer's offset sees the same bytes
// (what a same-host peer's shm backend does).
TEST(ConnectorHooks, PoolIsAMemfdThatASecondMappingSees) {
  EngineConfig c = SmallConfig(32);
  FakeConnector** fake = InstallFake(&c);
  auto core = MakeCore(c);
  const EngineHooks& h = (*fake)->hooks;
  const PagedKvView& v = core->storage().view();
  ASSERT_GE(h.kv_shm_fd, 0);
  ASSERT_EQ(h.kv_layer_offsets.size(), static_cast<size_t>(v.layout.num_layers));
  struct stat st;
  ASSERT_EQ(::fstat(h.kv_shm_fd, &st), 0);
  const size_t lb = v.layout.LayerBytes();
  ASSERT_GE(static_cast<size_t>(st.st_size), h.kv_layer_offsets.back() + lb);
  void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED,
                   h.kv_shm_fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  uint8_t* peer = static_cast<uint8_t*>(p);
  for (int l = 0; l < v.layout.num_layers; ++l) {
    EXPECT_EQ(h.kv_layer_offsets[l] % 64, 0u);
    if (l > 0) {
      EXPECT_GE(h.kv_layer_offsets[l], h.kv_layer_offsets[l - 1] + lb);
    }
    v.layer_base[l][lb - 1] = static_cast<uint8_t>(0xA0 + l);   // engine writes...
    EXPECT_EQ(peer[h.kv_layer_offsets[l] + lb - 1], 0xA0 + l);  // ...the peer mapping sees it
    peer[h.kv_layer_offsets[l]] = static_cast<uint8_t>(0x50 + l);
    EXPECT_EQ(v.layer_base[l][0], 0x50 + l);
  }
  ::munmap(p, static_cast<size_t>(st.st_size));
}

TEST(ConnectorHooks, PrefillHoldsBlocksUntilFinishedSendingAndReturnsParams) {
  EngineConfig c = SmallConfig();
  FakeConnector** fake = InstallFake(&c);
  auto p = MakeCore(c);
  (*fake)->hold_on_finish = true;
  (*fake)->finish_params = {{"transfer_id", "t-1"}, {"remote_block_ids", {1, 2, 3}}};
  TimePoint now = 0;
  EngineRequest r = Req("x", Prompt(40, 1), 1);
  r.kv_transfer_params = {{"do_remote_decode", true}};
  ASSERT_TRUE(p->AddRequest(r, now).ok());
  auto out = RunAll(*p, &now);
  EXPECT_EQ(out["x"].kv_transfer_params, (*fake)->finish_params);
  EXPECT_EQ(out["x"].reasons.at(0), "length");
  auto& calls = *(*fake)->calls;
  ASSERT_EQ(calls.finished.size(), 1u);
  EXPECT_EQ(calls.finished[0], std::make_pair(std::string("x"), std::string("length")));
  ASSERT_EQ(calls.finished_blocks[0].size(), 3u);  // 40 prompt tokens in blocks of 16
  EXPECT_EQ(p->pool().NumHeld(), 3);
  EXPECT_EQ(p->pool().NumActive(), 3);
  EXPECT_EQ(p->Stats().kv_blocks_held_for_transfer, 3);
  EXPECT_EQ(p->scheduler().num_held(), 1u);
  // An unrelated report changes nothing; finished_sending frees exactly once.
  (*fake)->next_report.finished_sending = {"unknown"};
  ASSERT_TRUE(p->Step(now += 1000).ok());
  EXPECT_EQ(p->pool().NumHeld(), 3);
  (*fake)->next_report.finished_sending = {"x"};
  ASSERT_TRUE(p->Step(now += 1000).ok());
  EXPECT_EQ(p->pool().NumHeld(), 0);
  EXPECT_EQ(p->pool().NumActive(), 0);
  (*fake)->next_report.finished_sending = {"x"};  // duplicate: no effect
  ASSERT_TRUE(p->Step(now += 1000).ok());
  EXPECT_EQ(p->pool().NumActive(), 0);
  EXPECT_TRUE(p->pool().CheckInvariants().ok());
  EXPECT_TRUE(calls.aborted.empty());
}

TEST(ConnectorHooks, PrefillSiblingsHoldSeparatelyAndReleaseOneByOne) {
  EngineConfig c = SmallConfig();
  FakeConnector** fake = InstallFake(&c);
  auto p = MakeCore(c);
  (*fake)->hold_on_finish = true;
  TimePoint now = 0;
  ASSERT_TRUE(p->AddRequest(Req("x", Prompt(40, 1), 1, 2), now).ok());
  RunAll(*p, &now);
  auto& calls = *(*fake)->calls;
  ASSERT_EQ(calls.finished.size(), 2u);
  EXPECT_EQ(calls.finished[0].first, "0_x");
  EXPECT_EQ(calls.finished[1].first, "1_x");
  EXPECT_EQ(calls.finished_blocks[0], calls.finished_blocks[1]);  // shared prompt blocks
  EXPECT_EQ(p->pool().NumHeld(), 3);
  (*fake)->next_report.finished_sending = {"0_x"};
  ASSERT_TRUE(p->Step(now += 1000).ok());
  EXPECT_EQ(p->pool().NumHeld(), 3);  // still held by the other sibling
  (*fake)->next_report.finished_sending = {"1_x"};
  ASSERT_TRUE(p->Step(now += 1000).ok());
  EXPECT_EQ(p->pool().NumActive(), 0);
}

// Prefill engine P computes the prompt and holds it; decode engine D loads it (the test copies
// the blocks, as a transfer would), recomputes only the last prompt token, forks and decodes.
TEST(ConnectorHooks, DecodeWaitsForRemoteKvThenRecomputesLastTokenAndForks) {
  const auto prompt = Prompt(40, 6);
  EngineConfig pc = SmallConfig();
  FakeConnector** pfake = InstallFake(&pc);
  auto p = MakeCore(pc);
  FakeConnector* pf = *pfake;
  pf->hold_on_finish = true;
  LogitsLog plog;
  plog.Attach(*p);
  TimePoint now = 0;
  ASSERT_TRUE(p->AddRequest(Req("x", prompt, 1), now).ok());
  RunAll(*p, &now);
  std::vector<int32_t> held = pf->calls->finished_blocks.at(0);

  EngineConfig dc = SmallConfig();
  FakeConnector** dfake = InstallFake(&dc);
  auto d = MakeCore(dc);
  FakeConnector* df = *dfake;
  df->match_by_parent.emplace("x", KvConnector::Match{40, true});
  std::vector<std::pair<std::string, int>> chunks;  // (id, start_pos) of x's chunks
  LogitsLog dlog;
  dlog.Attach(*d);
  auto observer = [&](const ScheduledBatch& b, std::span<const float>) {
    for (auto& ch : b.chunks) {
      if (ch.request_id == "x") chunks.emplace_back(ch.request_id, ch.start_pos);
    }
  };
  // Chain the two observers.
  d->set_logits_observer(
      [&, inner = dlog](const ScheduledBatch& b, std::span<const float> l) mutable {
        observer(b, l);
        size_t row = 0;
        for (const ScheduledChunk& c : b.chunks) {
          if (!c.compute_logits) continue;
          dlog.rows[{c.request_id, c.start_pos + c.num_tokens - 1}] =
              std::vector<float>(l.begin() + row * dlog.vocab, l.begin() + (row + 1) * dlog.vocab);
          ++row;
        }
      });
  ASSERT_TRUE(d->AddRequest(Req("x", prompt, 6, 4), now).ok());
  ASSERT_TRUE(d->AddRequest(Req("other", Prompt(9, 2), 3), now).ok());
  ASSERT_TRUE(d->Step(now += 1000).ok());
  EXPECT_EQ(d->scheduler().GetState("x"), RequestState::kWaitingForRemoteKvs);
  EXPECT_EQ(d->Stats().waiting_for_remote_kv, 1);
  // Asked once per parent request, connector-bound or not.
  ASSERT_EQ(df->calls->matched, (std::vector<std::string>{"x", "other"}));
  EXPECT_EQ(df->calls->matched_local.at(0), 0);
  ASSERT_EQ(df->calls->allocs.size(), 1u);
  const auto alloc = df->calls->allocs[0];
  EXPECT_EQ(alloc.id, "x");
  EXPECT_EQ(alloc.local, 0);
  EXPECT_EQ(alloc.external, 40);
  ASSERT_EQ(alloc.blocks.size(), 3u);
  // The step loop is not blocked: the other request runs to completion meanwhile.
  std::map<std::string, testing_engine::Collected> outs;
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(d->Step(now += 1000).ok());
    testing_engine::Collect(d->TakeOutputs(), &outs);
  }
  EXPECT_TRUE(outs["other"].finished);
  EXPECT_EQ(d->scheduler().GetState("x"), RequestState::kWaitingForRemoteKvs);
  EXPECT_TRUE(chunks.empty());

  CopyBlocks(*p, held, *d, alloc.blocks);
  df->next_report.finished_recving = {"x"};
  outs = RunAll(*d, &now, outs);
  // Only the last prompt token was computed here, then 5 decode steps per sibling.
  ASSERT_FALSE(chunks.empty());
  EXPECT_EQ(chunks[0].second, 39);
  EXPECT_TRUE(BitwiseEqual(dlog.rows.at({"x", 39}), plog.rows.at({"x", 39})));
  auto ref = Greedy(prompt, 6);
  ASSERT_EQ(outs["x"].tokens.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(outs["x"].tokens[i], ref) << i;
  EXPECT_EQ(outs["x"].num_cached_tokens, 40);
  EXPECT_EQ(d->pool().NumActive(), 0);
  // RequestFinished per sibling on the decode side too (the connector decides not to hold).
  EXPECT_EQ(df->calls->finished.size(), 1u + 4u);
}

TEST(ConnectorHooks, FailedLoadRecomputesFromTheLocalPrefix) {
  const auto prompt = Prompt(45, 8);
  EngineConfig dc = SmallConfig();
  FakeConnector** dfake = InstallFake(&dc);
  MetricsRegistry metrics;
  auto d = MakeCore(dc, &metrics);
  FakeConnector* df = *dfake;
  TimePoint now = 0;
  // Warm the local prefix cache with the first 2 blocks.
  std::vector<int32_t> warm(prompt.begin(), prompt.begin() + 33);
  ASSERT_TRUE(d->AddRequest(Req("warm", warm, 1), now).ok());
  RunAll(*d, &now);
  df->match_by_parent.emplace("x", KvConnector::Match{13, true});
  ASSERT_TRUE(d->AddRequest(Req("x", prompt, 5), now).ok());
  ASSERT_TRUE(d->Step(now += 1000).ok());
  EXPECT_EQ(df->calls->matched_local.back(), 32);
  ASSERT_EQ(df->calls->allocs.size(), 1u);
  EXPECT_EQ(df->calls->allocs[0].local, 32);
  EXPECT_EQ(df->calls->allocs[0].external, 13);
  EXPECT_EQ(df->calls->allocs[0].blocks.size(), 3u);
  df->next_report.failed_recving = {{"x", true, UnavailableError("peer gone")}};
  auto outs = RunAll(*d, &now);
  EXPECT_TRUE(outs["x"].error.ok());
  EXPECT_EQ(outs["x"].tokens.at(0), Greedy(prompt, 5));  // the NaN-poisoned blocks were not used
  EXPECT_EQ(ScrapeMetric(metrics.Render(), "kvbridge_remote_kv_load_failures_total"), 1.0);
  EXPECT_EQ(d->pool().NumActive(), 0);
}

TEST(ConnectorHooks, FailedLoadWithoutRecomputeFailsTheRequest) {
  EngineConfig dc = SmallConfig();
  FakeConnector** dfake = InstallFake(&dc);
  auto d = MakeCore(dc);
  (*dfake)->match_by_parent.emplace("x", KvConnector::Match{20, true});
  TimePoint now = 0;
  ASSERT_TRUE(d->AddRequest(Req("x", Prompt(20), 5, 3), now).ok());
  ASSERT_TRUE(d->Step(now += 1000).ok());
  EXPECT_EQ(d->pool().NumActive(), 2);
  (*dfake)->next_report.failed_recving = {{"x", false, UnavailableError("peer gone")}};
  auto outs = RunAll(*d, &now);
  EXPECT_TRUE(outs["x"].finished);
  EXPECT_EQ(outs["x"].error.code(), StatusCode::kUnavailable);
  EXPECT_EQ(d->pool().NumActive(), 0);
}

TEST(ConnectorHooks, AbortDuringLoadKeepsBlocksUntilPollReportsIt) {
  EngineConfig dc = SmallConfig();
  FakeConnector** dfake = InstallFake(&dc);
  auto d = MakeCore(dc);
  FakeConnector* df = *dfake;
  df->match_by_parent.emplace("x", KvConnector::Match{40, true});
  df->keep_on_abort = true;
  TimePoint now = 0;
  ASSERT_TRUE(d->AddRequest(Req("x", Prompt(40), 5), now).ok());
  ASSERT_TRUE(d->Step(now += 1000).ok());
  ASSERT_EQ(d->scheduler().GetState("x"), RequestState::kWaitingForRemoteKvs);
  ASSERT_TRUE(d->Abort("x", now));
  auto outs = d->TakeOutputs();
  ASSERT_EQ(outs.size(), 1u);
  EXPECT_TRUE(outs[0].finished);
  EXPECT_EQ(outs[0].outputs.at(0).finish_reason, "abort");
  EXPECT_EQ(df->calls->aborted, std::vector<std::string>{"x"});
  // The load may still land: the 3 destination blocks stay out of reach.
  EXPECT_EQ(d->pool().NumActive(), 3);
  EXPECT_EQ(d->scheduler().num_draining(), 1u);
  // A new request with the same id waits until the old one drained.
  EXPECT_EQ(d->AddRequest(Req("x", Prompt(40), 5), now).code(), StatusCode::kAlreadyExists);
  ASSERT_TRUE(d->Step(now += 1000).ok());
  EXPECT_EQ(d->pool().NumActive(), 3);
  df->next_report.finished_recving = {"x"};
  ASSERT_TRUE(d->Step(now += 1000).ok());
  EXPECT_EQ(d->pool().NumActive(), 0);
  EXPECT_EQ(d->scheduler().num_draining(), 0u);

  // Abort without keeping: freed at once.
  df->keep_on_abort = false;
  df->match_by_parent.erase("x");
  df->match_by_parent.emplace("y", KvConnector::Match{40, true});
  ASSERT_TRUE(d->AddRequest(Req("y", Prompt(40), 5), now).ok());
  ASSERT_TRUE(d->Step(now += 1000).ok());
  EXPECT_EQ(d->pool().NumActive(), 3);
  ASSERT_TRUE(d->Abort("y", now));
  EXPECT_EQ(d->pool().NumActive(), 0);
  EXPECT_TRUE(d->pool().CheckInvariants().ok());
}

TEST(ConnectorHooks, ConnectorErrorFailsTheRequestWithItsStatus) {
  EngineConfig dc = SmallConfig();
  FakeConnector** dfake = InstallFake(&dc);
  auto d = MakeCore(dc);
  (*dfake)->match_by_parent.emplace("x",
                                    Result<KvConnector::Match>(InvalidArgumentError("bad params")));
  TimePoint now = 0;
  ASSERT_TRUE(d->AddRequest(Req("x", Prompt(10), 5), now).ok());
  auto outs = RunAll(*d, &now);
  EXPECT_TRUE(outs["x"].finished);
  EXPECT_EQ(outs["x"].error.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d->pool().NumActive(), 0);
}

TEST(ConnectorHooks, SynchronousLoadCountsTheBlocksAsComputed) {
  const auto prompt = Prompt(40, 6);
  auto p = MakeCore(SmallConfig());
  TimePoint now = 0;
  ASSERT_TRUE(p->AddRequest(Req("x", prompt, 1), now).ok());
  // Capture P's blocks by running one step and reading the table before it finishes.
  ASSERT_TRUE(p->Step(now += 1000).ok());
  // x finished (max_tokens 1); its blocks went to the prefix cache: find them by hash.
  std::vector<BlockHash> hs;
  AppendBlockHashes(RootBlockHash(p->model().fingerprint()), prompt, 16, &hs);
  std::vector<int32_t> cached;
  ASSERT_EQ(p->pool().MatchPrefix(hs, &cached), 2);

  EngineConfig dc = SmallConfig();
  FakeConnector** dfake = InstallFake(&dc);
  auto d = MakeCore(dc);
  (*dfake)->match_by_parent.emplace("x", KvConnector::Match{32, false});
  // The fake "loads" synchronously: the test copies the blocks before the step that allocates.
  // With load_async = false the engine trusts the blocks right after UpdateStateAfterAlloc, so
  // pre-fill the blocks it will pick (a fresh pool hands out 0, 1, ...).
  CopyBlocks(*p, cached, *d, {0, 1});
  ASSERT_TRUE(d->AddRequest(Req("x", prompt, 4), now).ok());
  auto outs = RunAll(*d, &now);
  ASSERT_EQ((*dfake)->calls->allocs.size(), 1u);
  EXPECT_EQ((*dfake)->calls->allocs[0].blocks, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(outs["x"].tokens.at(0), Greedy(prompt, 4));
  EXPECT_EQ(outs["x"].num_cached_tokens, 32);
}

}  // namespace
}  // namespace kvbridge
