// READ-mode P/D end to end with real engines in one process: a prefill engine and a decode
// engine, each with its KvBridgeRuntime (transfer agent on 127.0.0.1) and ApiServer (for the
// connector's HTTP routes); the test plays the proxy. Answers and top-5 logprobs must be bitwise
// equal to one colocated engine, and everything must drain with no lease expiry.
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "kvbridge/common/metrics.h"
#include "kvbridge/connector/kvbridge_connector.h"
#include "kvbridge/engine/engine.h"
#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "kvbridge/server/api_server.h"
#include "support/pd_engine.h"

namespace kvbridge {
namespace {

using nlohmann::json;

using testing::AddRequestInBackground;
using testing::BaseConfig;
using testing::ExpectRecomputedOrFailed;
using testing::ExpectSameAnswer;
using testing::PdEngine;
using testing::Prompt;
using testing::Req;
using testing::RunOne;
using testing::TinyModel;
using testing::WaitFinished;
using Result1 = testing::PdResult;

// A READ-mode engine (`corrupt`: its first READ block arrives corrupted).
std::unique_ptr<PdEngine> StartEngine(KvRole role, KvTransport transport, bool corrupt = false,
                                      KvDtype dtype = KvDtype::kFp32,
                                      LoadFailurePolicy policy = LoadFailurePolicy::kRecompute) {
  return PdEngine::Start({.role = role,
                          .transport = transport,
                          .policy = policy,
                          .dtype = dtype,
                          .corrupt_first_read_block = corrupt});
}

bool SameLogprobs(const Result1& a, const Result1& b) {
  for (const auto& [i, lp] : a.logprobs) {
    const auto& o = b.logprobs.at(i);
    for (size_t t = 0; t < lp.size() && t < o.size(); ++t) {
      if (std::memcmp(&lp[t].logprob, &o[t].logprob, sizeof(float)) != 0) return false;
    }
  }
  return a.tokens == b.tokens;
}

// The proxy's two legs. Returns the decode's result (and the prefill's params via *params).
Result1 PdRequest(PdEngine& p, PdEngine& d, const std::string& id, const std::string& tid,
                  const std::vector<int32_t>& prompt, int max_tokens, int n,
                  json* params_out = nullptr) {
  EngineRequest pre = Req("p-" + id, prompt, 1, 1);
  pre.kv_transfer_params = json{{"do_remote_decode", true}, {"transfer_id", tid}};
  Result1 pr = RunOne(*p.engine, pre);
  EXPECT_TRUE(pr.error.ok()) << pr.error.ToString();
  json params = pr.kv_transfer_params;
  if (params_out) *params_out = params;
  EXPECT_EQ(params.value("transfer_id", ""), tid);
  EXPECT_EQ(params.value("remote_engine_id", ""), p.kv->engine_id());
  EngineRequest dec = Req(id, prompt, max_tokens, n);
  dec.kv_transfer_params = params;
  return RunOne(*d.engine, dec);
}

// The backend the decode's agent must have picked for its one peer (the prefill) under the
// configured transport: "auto" between two engines of one host is shm (both pools are memfds).
std::string ExpectedBackend(KvTransport t) {
  return t == KvTransport::kTcp ? "tcp" : t == KvTransport::kUcx ? "ucx" : "shm";
}

void ExpectBackend(PdEngine& d, KvTransport t) {
  std::map<std::string, std::string> peers = d.kv->PeerBackends();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers.begin()->second, ExpectedBackend(t)) << "peer " << peers.begin()->first;
}

class PdRead : public ::testing::TestWithParam<KvTransport> {};

TEST_P(PdRead, AnswersEqualColocatedAndEverythingDrains) {
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto p = StartEngine(KvRole::kProducer, GetParam());
  auto d = StartEngine(KvRole::kConsumer, GetParam());

  int k = 0;
  for (int n : {1, 8}) {
    for (int len : {1, 16, 17, 40, 64}) {
      ++k;
      const std::string id = "req-" + std::to_string(k);
      auto prompt = Prompt(len, k);
      Result1 ref = RunOne(**ref_engine, Req(id, prompt, 6, n));
      Result1 pd = PdRequest(*p, *d, id, "xfer-" + std::to_string(k), prompt, 6, n);
      SCOPED_TRACE("n=" + std::to_string(n) + " len=" + std::to_string(len));
      ExpectSameAnswer(pd, ref, n);
      EXPECT_TRUE(p->WaitDrained()) << "prefill did not drain";
      EXPECT_TRUE(d->WaitDrained()) << "decode did not drain";
    }
  }
  // Prompts longer than one token were read remotely: bytes moved, loads done, over the backend
  // the transport asks for.
  ExpectBackend(*d, GetParam());
  EXPECT_GT(d->kv->Stats().loads_done, 0);
  EXPECT_GT(d->Metric("kvbridge_kv_transfer_bytes_total"), 0);
  for (PdEngine* e : {p.get(), d.get()}) {
    EXPECT_EQ(e->Metric("kvbridge_kv_lease_expired_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_notifications_ignored_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_load_failures_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_transfers_inflight"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_notifications_parked"), 0);
  }
  (*ref_engine)->Shutdown();
}

TEST_P(PdRead, PartialPrefixHitReadsOnlyMissingBlocks) {
  auto p = StartEngine(KvRole::kProducer, GetParam());
  auto d = StartEngine(KvRole::kConsumer, GetParam());
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  // First: 64 tokens -> reads ceil(63/16) = 4 blocks.
  auto prompt = Prompt(64, 3);
  Result1 a = PdRequest(*p, *d, "a", "xfer-a", prompt, 4, 1);
  ASSERT_TRUE(a.error.ok());
  ASSERT_TRUE(d->WaitDrained());
  const double bytes_a = d->Metric("kvbridge_kv_transfer_bytes_total");
  ASSERT_GT(bytes_a, 0);
  const double block_bytes = bytes_a / 4;
  // Second: same first 48 tokens, new tail of 32 -> decode prefix hit 48 tokens (3 blocks),
  // reads blocks [3, ceil(79/16)) = 2 blocks.
  auto prompt2 = prompt;
  prompt2.resize(48);
  auto tail = Prompt(32, 9);
  prompt2.insert(prompt2.end(), tail.begin(), tail.end());
  Result1 b = PdRequest(*p, *d, "b", "xfer-b", prompt2, 4, 1);
  Result1 ref = RunOne(**ref_engine, Req("b", prompt2, 4, 1));
  ExpectSameAnswer(b, ref, 1);
  ASSERT_TRUE(d->WaitDrained());
  EXPECT_EQ(d->Metric("kvbridge_kv_transfer_bytes_total") - bytes_a, 2 * block_bytes);
  EXPECT_TRUE(p->WaitDrained());
  (*ref_engine)->Shutdown();
}

TEST_P(PdRead, CorruptedTransferChangesLogprobs) {
  auto p = StartEngine(KvRole::kProducer, GetParam());
  auto d = StartEngine(KvRole::kConsumer, GetParam(), /*corrupt=*/true);
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto prompt = Prompt(40, 5);
  Result1 pd = PdRequest(*p, *d, "c", "xfer-c", prompt, 4, 1);
  Result1 ref = RunOne(**ref_engine, Req("c", prompt, 4, 1));
  ASSERT_TRUE(pd.error.ok());
  EXPECT_FALSE(SameLogprobs(pd, ref)) << "a corrupted block must change the answer";
  EXPECT_TRUE(p->WaitDrained());
  EXPECT_TRUE(d->WaitDrained());
  (*ref_engine)->Shutdown();
}

TEST_P(PdRead, ExplicitReleaseFreesTheHoldAtOnce) {
  auto p = StartEngine(KvRole::kProducer, GetParam());
  EngineRequest pre = Req("p-r", Prompt(40, 1), 1, 1);
  pre.kv_transfer_params = json{{"do_remote_decode", true}, {"transfer_id", "xfer-r"}};
  Result1 pr = RunOne(*p->engine, pre);
  ASSERT_TRUE(pr.error.ok());
  // The engine's stats snapshot trails the final output by up to one step.
  for (int i = 0; i < 100 && p->engine->Stats().kv_blocks_held_for_transfer != 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(p->engine->Stats().kv_blocks_held_for_transfer, 3);
  EXPECT_EQ(p->kv->Stats().held_blocks, 3);
  httplib::Client cli("127.0.0.1", p->server->port());
  auto no_token = cli.Post("/v1/kv/release", R"({"transfer_id":"xfer-r"})", "application/json");
  ASSERT_TRUE(no_token);
  EXPECT_EQ(no_token->status, 403);
  httplib::Headers h{{"X-KVBridge-Cluster-Token", "secret"}};
  auto bad = cli.Post("/v1/kv/release", h, R"({"transfer_id":""})", "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  auto wrong =
      cli.Post("/v1/kv/release", h, R"({"transfer_id":"xfer-r","prefill_engine_id":"kvb-old"})",
               "application/json");
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 404);
  auto ok = cli.Post("/v1/kv/release", h, R"({"transfer_id":"xfer-r"})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_TRUE(p->WaitDrained(2000));
  EXPECT_EQ(p->Metric("kvbridge_kv_lease_expired_total"), 0);
}

TEST_P(PdRead, DecodeAbortedBeforeAdmissionReleasesThePrefill) {
  auto p = StartEngine(KvRole::kProducer, GetParam());
  auto d = StartEngine(KvRole::kConsumer, GetParam());
  // Decode rejects the request (remote_num_tokens disagrees with its prompt): 400, no effect;
  // the proxy then releases explicitly.
  json params;
  EngineRequest pre = Req("p-x", Prompt(40, 2), 1, 1);
  pre.kv_transfer_params = json{{"do_remote_decode", true}, {"transfer_id", "xfer-x"}};
  Result1 pr = RunOne(*p->engine, pre);
  EngineRequest dec = Req("x", Prompt(41, 2), 4, 1);
  dec.kv_transfer_params = pr.kv_transfer_params;
  Result1 dr = RunOne(*d->engine, dec);
  EXPECT_EQ(dr.error.code(), StatusCode::kInvalidArgument) << dr.error.ToString();
  httplib::Client cli("127.0.0.1", p->server->port());
  httplib::Headers h{{"X-KVBridge-Cluster-Token", "secret"}};
  auto ok = cli.Post("/v1/kv/release", h, R"({"transfer_id":"xfer-x"})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_TRUE(p->WaitDrained(2000));
  EXPECT_TRUE(d->WaitDrained(2000));
}

TEST_P(PdRead, Fp8KvAnswersEqualColocated) {
  auto ref_engine = Engine::Create(BaseConfig(KvDtype::kFp8E4M3), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto p = StartEngine(KvRole::kProducer, GetParam(), false, KvDtype::kFp8E4M3);
  auto d = StartEngine(KvRole::kConsumer, GetParam(), false, KvDtype::kFp8E4M3);
  int k = 100;
  for (int n : {1, 8}) {
    for (int len : {17, 40}) {
      ++k;
      const std::string id = "f-" + std::to_string(k);
      auto prompt = Prompt(len, k);
      Result1 ref = RunOne(**ref_engine, Req(id, prompt, 5, n));
      Result1 pd = PdRequest(*p, *d, id, "xfer-" + std::to_string(k), prompt, 5, n);
      SCOPED_TRACE("fp8 n=" + std::to_string(n) + " len=" + std::to_string(len));
      ExpectSameAnswer(pd, ref, n);
    }
  }
  ExpectBackend(*d, GetParam());
  EXPECT_TRUE(p->WaitDrained());
  EXPECT_TRUE(d->WaitDrained());
  EXPECT_EQ(p->Metric("kvbridge_kv_lease_expired_total"), 0);
  (*ref_engine)->Shutdown();
}

// The client aborts the decode leg at different moments (queued, reading, awaiting the hold
// reply, decoding): every block on both engines comes back without waiting for the lease.
TEST_P(PdRead, DecodeAbortAtAnyMomentDrainsWithoutLease) {
  auto p = StartEngine(KvRole::kProducer, GetParam());
  auto d = StartEngine(KvRole::kConsumer, GetParam());
  int k = 200;
  for (int delay_us : {0, 0, 200, 500, 1000, 2000, 5000}) {
    ++k;
    const std::string id = "ab-" + std::to_string(k);
    auto prompt = Prompt(64, k);
    EngineRequest pre = Req("p-" + id, prompt, 1, 1);
    pre.kv_transfer_params = json{{"do_remote_decode", true}, {"transfer_id", "x" + id}};
    Result1 pr = RunOne(*p->engine, pre);
    ASSERT_TRUE(pr.error.ok());
    EngineRequest dec = Req(id, prompt, 32, 4);
    dec.kv_transfer_params = pr.kv_transfer_params;
    auto finished = AddRequestInBackground(*d->engine, dec);
    ASSERT_NE(finished, nullptr);
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    d->engine->Abort(id);
    EXPECT_TRUE(WaitFinished(*finished));
    EXPECT_TRUE(d->WaitDrained(5000)) << "decode, delay " << delay_us;
    EXPECT_TRUE(p->WaitDrained(5000)) << "prefill, delay " << delay_us;
  }
  EXPECT_EQ(p->Metric("kvbridge_kv_lease_expired_total"), 0);
  EXPECT_EQ(p->Metric("kvbridge_kv_notifications_ignored_total"), 0);
  EXPECT_EQ(d->Metric("kvbridge_kv_notifications_ignored_total"), 0);
}

// The prefill dies after answering: the decode cannot fetch metadata / READ, and applies its
// policy — recompute (same answer as colocated) or fail the request.
TEST_P(PdRead, PrefillGoneAfterAnsweringRecomputesOrFails) {
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  for (LoadFailurePolicy policy : {LoadFailurePolicy::kRecompute, LoadFailurePolicy::kFail}) {
    auto p = StartEngine(KvRole::kProducer, GetParam());
    auto d = StartEngine(KvRole::kConsumer, GetParam(), false, KvDtype::kFp32, policy);
    auto prompt = Prompt(40, 77);
    EngineRequest pre = Req("p-g", prompt, 1, 1);
    pre.kv_transfer_params = json{{"do_remote_decode", true}, {"transfer_id", "xfer-g"}};
    Result1 pr = RunOne(*p->engine, pre);
    ASSERT_TRUE(pr.error.ok());
    p.reset();  // server, engine and agent gone
    EngineRequest dec = Req("g", prompt, 4, 2);
    dec.kv_transfer_params = pr.kv_transfer_params;
    Result1 dr = RunOne(*d->engine, dec);
    ExpectRecomputedOrFailed(policy, dr, **ref_engine, Req("g", prompt, 4, 2));
    EXPECT_EQ(d->Metric("kvbridge_kv_load_failures_total"), 1);
    EXPECT_TRUE(d->WaitDrained(5000));
  }
  (*ref_engine)->Shutdown();
}

// The proxy's view over HTTP: token and validation at the door, params returned in the body,
// decode text equal to a colocated engine's.
TEST_P(PdRead, OverHttpTokenValidationAndSameText) {
  auto p = StartEngine(KvRole::kProducer, GetParam());
  auto d = StartEngine(KvRole::kConsumer, GetParam());
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  server::ServerConfig rc;
  rc.port = 0;
  rc.num_http_threads = 2;
  auto ref = server::ApiServer::Create(rc, ref_engine->get(), TinyModel()->tokenizer());
  ASSERT_TRUE(ref.ok());
  ASSERT_TRUE((*ref)->Start().ok());

  const std::string prompt =
      "kvbridge moves the prompt's KV from prefill to decode, block by block.";
  json body{{"model", "kvbridge"}, {"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
  body["kv_transfer_params"] = {{"do_remote_decode", true}, {"transfer_id", "http-1"}};
  httplib::Client pc("127.0.0.1", p->server->port());
  httplib::Headers tok{{"X-KVBridge-Cluster-Token", "secret"}};
  auto r403 = pc.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r403);
  EXPECT_EQ(r403->status, 403);
  json bad = body;
  bad["kv_transfer_params"]["transfer_id"] = "";
  auto r400 = pc.Post("/v1/completions", tok, bad.dump(), "application/json");
  ASSERT_TRUE(r400);
  EXPECT_EQ(r400->status, 400) << r400->body;
  json wrong_role = body;
  wrong_role["kv_transfer_params"] = {{"do_remote_prefill", true}, {"transfer_id", "x"},
                                      {"remote_engine_id", "e"},   {"remote_host", "h"},
                                      {"remote_port", 1},          {"remote_block_ids", {0}},
                                      {"remote_num_tokens", 3}};
  auto r400b = pc.Post("/v1/completions", tok, wrong_role.dump(), "application/json");
  ASSERT_TRUE(r400b);
  EXPECT_EQ(r400b->status, 400) << r400b->body;
  EXPECT_TRUE(p->WaitDrained(2000));  // refused requests had no effect

  auto pr = pc.Post("/v1/completions", tok, body.dump(), "application/json");
  ASSERT_TRUE(pr);
  ASSERT_EQ(pr->status, 200) << pr->body;
  json params = json::parse(pr->body).at("kv_transfer_params");
  EXPECT_EQ(params.at("remote_engine_id"), p->kv->engine_id());
  EXPECT_EQ(params.at("remote_port"), p->server->port());

  json dbody{{"model", "kvbridge"}, {"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0}};
  dbody["kv_transfer_params"] = params;
  httplib::Client dc("127.0.0.1", d->server->port());
  auto dr = dc.Post("/v1/completions", tok, dbody.dump(), "application/json");
  ASSERT_TRUE(dr);
  ASSERT_EQ(dr->status, 200) << dr->body;
  json rbody{{"model", "kvbridge"}, {"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0}};
  httplib::Client cc("127.0.0.1", (*ref)->port());
  auto cr = cc.Post("/v1/completions", rbody.dump(), "application/json");
  ASSERT_TRUE(cr);
  ASSERT_EQ(cr->status, 200) << cr->body;
  EXPECT_EQ(json::parse(dr->body)["choices"][0]["text"],
            json::parse(cr->body)["choices"][0]["text"]);
  EXPECT_TRUE(p->WaitDrained());
  EXPECT_TRUE(d->WaitDrained());
  EXPECT_EQ(d->kv->Stats().loads_done, 1);
  (*ref)->Stop();
  (*ref_engine)->Shutdown();
}

// Both engines offer shm (memfd pools) and tcp; "auto" must pick shm between them.
TEST(PdReadTransport, AutoPicksShmBetweenSameHostEngines) {
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto p = StartEngine(KvRole::kProducer, KvTransport::kAuto);
  auto d = StartEngine(KvRole::kConsumer, KvTransport::kAuto);
  EXPECT_EQ(p->kv->LocalBackends(), (std::vector<std::string>{"shm", "tcp"}));
  EXPECT_EQ(d->kv->LocalBackends(), (std::vector<std::string>{"shm", "tcp"}));
  auto prompt = Prompt(40, 11);
  Result1 pd = PdRequest(*p, *d, "auto", "xfer-auto", prompt, 4, 2);
  ExpectSameAnswer(pd, RunOne(**ref_engine, Req("auto", prompt, 4, 2)), 2);
  ExpectBackend(*d, KvTransport::kAuto);
  EXPECT_GT(d->Metric("kvbridge_kv_transfer_bytes_total"), 0);
  EXPECT_TRUE(p->WaitDrained());
  EXPECT_TRUE(d->WaitDrained());
  (*ref_engine)->Shutdown();
}

// Forcing shm on a pool that is not a memfd is refused when the engine creates its connector,
// with an error that says why; "auto" on the same pool falls back to tcp only.
TEST(PdReadTransport, ForcedShmOnANonShareablePoolFailsAtStart) {
  PagedKvLayout layout{.num_layers = 2, .num_kv_heads = 2, .head_dim = 16, .block_size = 16};
  layout.num_blocks = 4;
  std::vector<std::vector<uint8_t>> mem(2, std::vector<uint8_t>(layout.LayerBytes()));
  EngineHooks hooks;
  hooks.kv_view.layout = layout;
  for (auto& m : mem) hooks.kv_view.layer_base.push_back(m.data());
  hooks.kv_view.k_scale.assign(2, 1.0f);
  hooks.kv_view.v_scale.assign(2, 1.0f);
  hooks.model_fingerprint = "f";
  hooks.wake = [] {};
  KvTransferConfig cfg;
  cfg.role = KvRole::kProducer;
  cfg.transport = KvTransport::kShm;
  auto shm = KvBridgeRuntime::Create({.config = cfg});
  ASSERT_TRUE(shm.ok());
  auto c = (*shm)->Factory()(hooks);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("shm"), std::string::npos) << c.status().ToString();
  EXPECT_NE(c.status().message().find("memfd"), std::string::npos) << c.status().ToString();
  // "auto" on the same pool starts, offering tcp only.
  cfg.transport = KvTransport::kAuto;
  auto aut = KvBridgeRuntime::Create({.config = cfg});
  ASSERT_TRUE(aut.ok());
  auto a = (*aut)->Factory()(hooks);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*aut)->LocalBackends(), (std::vector<std::string>{"tcp"}));
}

INSTANTIATE_TEST_SUITE_P(Transports, PdRead,
                         ::testing::Values(KvTransport::kTcp, KvTransport::kShm),
                         [](const auto& info) { return std::string(KvTransportName(info.param)); });

}  // namespace
}  // namespace kvbridge
