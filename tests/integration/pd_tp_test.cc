// Rank-aware P/D end to end, READ and WRITE mode: a prefill engine of TP = Tp and a decode engine
// of TP = Td (ranks are threads of one engine, one KV shard and one transfer agent per rank), each
// with its KvBridgeRuntime and ApiServer; the test plays the proxy. Every decode rank gets the
// head slices of the TP plan (tp_plan.h) from the prefill ranks that hold them (READ: it reads
// them; WRITE: each prefill rank writes them). Greedy answers and top-5 logprobs must be bitwise
// equal to one colocated TP = 1 engine, for n = 1 and n = 8, and every rank must drain to 0 held /
// 0 active blocks with no lease expiry.
#include <gtest/gtest.h>
#include <httplib.h>

#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kvbridge/transfer/metadata.h"
#include "support/pd_engine.h"

namespace kvbridge {
namespace {

using nlohmann::json;
using testing::BaseConfig;
using testing::ExpectSameAnswer;
using testing::PdEngine;
using testing::Prompt;
using testing::Req;
using testing::RunOne;
using testing::TinyModel;
using Answer = testing::PdResult;

// The shared in-process engine (tests/support/pd_engine.h) at TP `tp`. The tiny preset has 4
// attention heads and 2 KV heads, so TP 4 replicates each KV head twice.
std::unique_ptr<PdEngine> StartTp(KvRole role, int tp, KvTransport transport,
                                  KvTransferMode mode = KvTransferMode::kRead) {
  return PdEngine::Start(
      {.role = role, .transport = transport, .mode = mode, .tensor_parallel_size = tp});
}

Answer PdRequest(PdEngine& p, PdEngine& d, const std::string& id, const std::string& tid,
                 const std::vector<int32_t>& prompt, int max_tokens, int n, int prefill_tp) {
  EngineRequest pre = Req("p-" + id, prompt, 1, 1);
  pre.kv_transfer_params = json{{"do_remote_decode", true}, {"transfer_id", tid}};
  Answer pr = RunOne(*p.engine, pre);
  EXPECT_TRUE(pr.error.ok()) << pr.error.ToString();
  EXPECT_EQ(pr.kv_transfer_params.value("tp_size", 0), prefill_tp);
  EngineRequest dec = Req(id, prompt, max_tokens, n);
  dec.kv_transfer_params = pr.kv_transfer_params;
  return RunOne(*d.engine, dec);
}

// (prefill TP, decode TP, transport)
using TpCase = std::tuple<int, int, KvTransport>;

// One P/D request: the prefill leg and the decode leg, as the proxy sends them in one mode.
using PdRunner = Answer (*)(PdEngine& p, PdEngine& d, const std::string& id, const std::string& tid,
                            const std::vector<int32_t>& prompt, int max_tokens, int n,
                            int prefill_tp);

// n in {1, 8} x 17- and 40-token prompts through `run`: each answer equals the colocated TP 1
// engine's bitwise, and both engines drain after each.
void RunCases(PdEngine& p, PdEngine& d, Engine& ref, const std::string& prefix, PdRunner run,
              int prefill_tp) {
  int k = 0;
  for (int n : {1, 8}) {
    for (int len : {17, 40}) {
      ++k;
      const std::string id = prefix + std::to_string(k);
      auto prompt = Prompt(len, k);
      Answer want = RunOne(ref, Req(id, prompt, 6, n));
      Answer pd = run(p, d, id, "x" + id, prompt, 6, n, prefill_tp);
      SCOPED_TRACE("n=" + std::to_string(n) + " len=" + std::to_string(len));
      ExpectSameAnswer(pd, want, n);
      EXPECT_TRUE(p.WaitDrained()) << "prefill did not drain";
      EXPECT_TRUE(d.WaitDrained()) << "decode did not drain";
    }
  }
}

// `mover` moved exactly the decode's whole KV of the loaded blocks (each byte once): 4 requests
// of 16 + 39 remote tokens -> 1 + 3 blocks each, x2 for n (same prompts). Both engines hold
// nothing, and no safety net fired.
void ExpectExactBytesAndClean(PdEngine& mover, PdEngine& p, PdEngine& d) {
  const int layers = TinyModel()->config().num_hidden_layers;
  const int head_dim = TinyModel()->config().head_dim;
  const double block_bytes = 2.0 * 2 * 16 * head_dim * 4 * layers;  // K+V, 2 heads, fp32
  EXPECT_EQ(mover.Metric("kvbridge_kv_transfer_bytes_total"), 2 * (1 + 3) * block_bytes);
  for (PdEngine* e : {&p, &d}) {
    EXPECT_EQ(e->engine->Stats().kv_blocks_held_for_transfer, 0);
    EXPECT_EQ(e->engine->Stats().kv_blocks_active, 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_lease_expired_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_notifications_ignored_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_load_failures_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_notifications_parked"), 0);
  }
}

class PdTp : public ::testing::TestWithParam<TpCase> {};

TEST_P(PdTp, AnswersEqualColocatedTp1AndEveryRankDrains) {
  const auto [tp_p, tp_d, transport] = GetParam();
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto p = StartTp(KvRole::kProducer, tp_p, transport);
  auto d = StartTp(KvRole::kConsumer, tp_d, transport);
  ASSERT_TRUE(p && d);
  RunCases(*p, *d, **ref_engine, "tp-", &PdRequest, tp_p);
  // Every decode rank's agent connected to the prefill ranks of its slices: with 2 KV heads,
  // the decode reads from min(Tp, 2) prefill ranks in all (the replicas of TP 4 are not read).
  EXPECT_EQ(static_cast<int>(d->kv->PeerBackends().size()), std::min(tp_p, 2));
  ExpectExactBytesAndClean(*d, *p, *d);  // bytes read
  (*ref_engine)->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(
    Topologies, PdTp,
    ::testing::Values(TpCase{2, 2, KvTransport::kTcp}, TpCase{2, 1, KvTransport::kTcp},
                      TpCase{1, 2, KvTransport::kTcp}, TpCase{2, 2, KvTransport::kShm},
                      TpCase{2, 1, KvTransport::kShm}, TpCase{1, 2, KvTransport::kShm},
                      TpCase{4, 1, KvTransport::kTcp}),
    [](const ::testing::TestParamInfo<TpCase>& i) {
      return "p" + std::to_string(std::get<0>(i.param)) + "_d" +
             std::to_string(std::get<1>(i.param)) +
             (std::get<2>(i.param) == KvTransport::kTcp ? "_tcp" : "_shm");
    });

// WRITE mode with TP: the proxy's flow sends both legs at once; each prefill rank writes, through
// its own agent, the head slices the TP plan reads from it into each decode rank's blocks (layer
// by layer), and the decode goes on once every planned (prefill rank -> decode rank) pair said
// WriteDone. Same answers as colocated TP 1, every rank drains, no lease expiry.
Answer PdWriteRequest(PdEngine& p, PdEngine& d, const std::string& id, const std::string& tid,
                      const std::vector<int32_t>& prompt, int max_tokens, int n, int prefill_tp) {
  EngineRequest pre = Req("p-" + id, prompt, 1, 1);
  pre.kv_transfer_params =
      json{{"do_remote_decode", true}, {"transfer_id", tid}, {"mode", "write"}};
  EngineRequest dec = Req(id, prompt, max_tokens, n);
  dec.kv_transfer_params = json{{"do_remote_prefill", true},
                                {"transfer_id", tid},
                                {"mode", "write"},
                                {"remote_engine_id", p.kv->engine_id()},
                                {"remote_host", "127.0.0.1"},
                                {"remote_port", p.server->port()},
                                {"tp_size", prefill_tp}};
  std::thread prefill_leg([&] {
    Answer pr = RunOne(*p.engine, pre);
    EXPECT_TRUE(pr.error.ok()) << pr.error.ToString();
    EXPECT_EQ(pr.kv_transfer_params.value("tp_size", 0), prefill_tp);
  });
  Answer out = RunOne(*d.engine, dec);
  prefill_leg.join();
  return out;
}

class PdTpWrite : public ::testing::TestWithParam<TpCase> {};

TEST_P(PdTpWrite, AnswersEqualColocatedTp1AndEveryRankDrains) {
  const auto [tp_p, tp_d, transport] = GetParam();
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto p = StartTp(KvRole::kProducer, tp_p, transport, KvTransferMode::kWrite);
  auto d = StartTp(KvRole::kConsumer, tp_d, transport, KvTransferMode::kWrite);
  ASSERT_TRUE(p && d);
  RunCases(*p, *d, **ref_engine, "tpw-", &PdWriteRequest, tp_p);
  ExpectExactBytesAndClean(*p, *p, *d);  // bytes written
  for (PdEngine* e : {p.get(), d.get()}) {
    KvBridgeStats s = e->kv->Stats();
    EXPECT_EQ(s.transfers, 0);
    EXPECT_EQ(s.held_blocks, 0);
    EXPECT_EQ(s.writes_inflight, 0);
    EXPECT_EQ(s.waiting_for_remote, 0);
  }
  EXPECT_EQ(d->kv->Stats().write_loads_done, 4);
  (*ref_engine)->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(
    Topologies, PdTpWrite,
    ::testing::Values(TpCase{2, 2, KvTransport::kTcp}, TpCase{2, 1, KvTransport::kTcp},
                      TpCase{1, 2, KvTransport::kTcp}, TpCase{2, 2, KvTransport::kShm},
                      TpCase{2, 1, KvTransport::kShm}, TpCase{1, 2, KvTransport::kShm},
                      // 2 KV heads over 4 prefill ranks: ranks 1 and 3 hold replicas the plan
                      // reads from ranks 0 and 2, so they write nothing; the decode's skip frees
                      // them at once (WaitDrained is far shorter than the 30 s lease).
                      TpCase{4, 1, KvTransport::kTcp}, TpCase{4, 1, KvTransport::kShm}),
    [](const ::testing::TestParamInfo<TpCase>& i) {
      return "p" + std::to_string(std::get<0>(i.param)) + "_d" +
             std::to_string(std::get<1>(i.param)) +
             (std::get<2>(i.param) == KvTransport::kTcp ? "_tcp" : "_shm");
    });

// GET /v1/kv/metadata/<rank> serves each rank's agent metadata: TP size, rank and head range.
TEST(PdTpMetadata, EveryRankServesItsHeadRange) {
  auto p = StartTp(KvRole::kProducer, 2, KvTransport::kTcp);
  ASSERT_TRUE(p);
  httplib::Client cli("127.0.0.1", p->server->port());
  httplib::Headers h{{"X-KVBridge-Cluster-Token", "secret"}};
  for (int r = 0; r < 2; ++r) {
    auto res = cli.Get("/v1/kv/metadata/" + std::to_string(r), h);
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    auto md = transfer::DecodeMetadata(res->body);
    ASSERT_TRUE(md.ok()) << md.status().ToString();
    EXPECT_EQ(md->tp_size, 2);
    EXPECT_EQ(md->tp_rank, r);
    EXPECT_EQ(md->head_begin, r);
    EXPECT_EQ(md->head_count, 1);
    EXPECT_EQ(md->agent_name, p->kv->engine_id() + "/rank" + std::to_string(r));
  }
  auto missing = cli.Get("/v1/kv/metadata/2", h);
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  auto no_token = cli.Get("/v1/kv/metadata/1");
  ASSERT_TRUE(no_token);
  EXPECT_EQ(no_token->status, 403);
}

}  // namespace
}  // namespace kvbridge
