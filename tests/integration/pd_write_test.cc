// WRITE-mode P/D end to end with real engines in one process: a prefill engine and a decode
// engine, each with its KvBridgeRuntime (transfer agent on 127.0.0.1) and ApiServer (for the
// connector's HTTP routes); the test plays the proxy's WRITE flow (both legs at once). Answers
// and top-5 logprobs must be bitwise equal to one colocated engine, aborts must not corrupt
// later requests, and everything must drain with no lease expiry and nothing ignored.
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
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

// A WRITE-mode engine.
std::unique_ptr<PdEngine> StartEngine(KvRole role, KvTransport transport,
                                      bool prefix_caching = true,
                                      LoadFailurePolicy policy = LoadFailurePolicy::kRecompute,
                                      std::shared_ptr<const Model> model = nullptr) {
  return PdEngine::Start({.role = role,
                          .transport = transport,
                          .mode = KvTransferMode::kWrite,
                          .policy = policy,
                          .prefix_caching = prefix_caching,
                          .model = std::move(model)});
}

json PrefillParams(const std::string& tid) {
  return json{{"do_remote_decode", true}, {"transfer_id", tid}, {"mode", "write"}};
}
json DecodeParams(PdEngine& p, const std::string& tid) {
  return json{{"do_remote_prefill", true},
              {"transfer_id", tid},
              {"mode", "write"},
              {"remote_engine_id", p.kv->engine_id()},
              {"remote_host", "127.0.0.1"},
              {"remote_port", p.server->port()},
              {"tp_size", 1}};
}

// The proxy's WRITE flow: both legs at once (the decode leg first when decode_first, so the
// prefill sees the block ids first; else the request first). Returns the decode's result.
Result1 PdWriteRequest(PdEngine& p, PdEngine& d, const std::string& id, const std::string& tid,
                       const std::vector<int32_t>& prompt, int max_tokens, int n,
                       bool decode_first) {
  EngineRequest pre = Req("p-" + id, prompt, 1, 1);
  pre.kv_transfer_params = PrefillParams(tid);
  EngineRequest dec = Req(id, prompt, max_tokens, n);
  dec.kv_transfer_params = DecodeParams(p, tid);
  std::future<Result1> first = std::async(std::launch::async, [&] {
    return decode_first ? RunOne(*d.engine, dec) : RunOne(*p.engine, pre);
  });
  if (decode_first) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  Result1 second = decode_first ? RunOne(*p.engine, pre) : RunOne(*d.engine, dec);
  Result1 a = first.get();
  Result1& pr = decode_first ? second : a;
  EXPECT_TRUE(pr.error.ok()) << pr.error.ToString();
  return decode_first ? a : second;
}

void ExpectClean(PdEngine& e) {
  EXPECT_EQ(e.Metric("kvbridge_kv_lease_expired_total"), 0);
  EXPECT_EQ(e.Metric("kvbridge_kv_notifications_ignored_total"), 0);
  EXPECT_EQ(e.Metric("kvbridge_kv_notifications_parked"), 0);
  KvBridgeStats s = e.kv->Stats();
  EXPECT_EQ(s.transfers, 0);
  EXPECT_EQ(s.held_blocks, 0);
  EXPECT_EQ(s.writes_inflight, 0);
  EXPECT_EQ(s.waiting_for_remote, 0);
}

// The decode's WRITE load record (the per-request timeline's transfer, docs/metrics.md): when
// it asked for blocks, the bytes that landed (the listed blocks of every layer), the backend and
// the prefill's write time, in causal order. Returns whether there was one (false: nothing was
// asked for, every block cached or a 1-token prompt).
bool ExpectWriteLoadRecord(const Result1& pd, KvTransport transport) {
  const nlohmann::json& kv = pd.times.kv_load;
  if (!kv.is_object() || !kv.contains("writes")) return false;
  EXPECT_EQ(kv.value("writes", 0), 1);
  const int64_t blocks = kv.value("blocks", int64_t{0});
  EXPECT_GT(blocks, 0);
  const EngineConfig c = BaseConfig();
  const PagedKvLayout l = TinyModel()->KvLayout(c.num_blocks, c.block_size, c.kv_dtype);
  EXPECT_EQ(kv.value("bytes", int64_t{0}),
            blocks * static_cast<int64_t>(l.BlockBytes()) * l.num_layers)
      << kv.dump();
  EXPECT_EQ(kv.value("backend", std::string()), transport == KvTransport::kTcp ? "tcp" : "shm");
  EXPECT_LE(kv.value("admitted_us", int64_t{0}), kv.value("write_requested_us", int64_t{-1}));
  EXPECT_LE(kv.value("write_requested_us", int64_t{0}), kv.value("write_done_us", int64_t{-1}));
  EXPECT_LE(kv.value("write_done_us", int64_t{0}), kv.value("load_done_us", int64_t{-1}));
  EXPECT_GE(kv.value("write_micros", int64_t{-1}), 0);
  return true;
}

struct Case {
  KvTransport transport;
  bool prefix_caching;
};

class PdWrite : public ::testing::TestWithParam<Case> {};

TEST_P(PdWrite, AnswersEqualColocatedAndEverythingDrains) {
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto p = StartEngine(KvRole::kProducer, GetParam().transport, GetParam().prefix_caching);
  auto d = StartEngine(KvRole::kConsumer, GetParam().transport, GetParam().prefix_caching);
  int k = 0;
  int records = 0;
  for (int n : {1, 8}) {
    // 64 twice: with prefix caching on, the second decode hits 3 blocks and asks for 1.
    for (int len : {1, 16, 17, 40, 64, 64}) {
      ++k;
      const std::string id = "req-" + std::to_string(k);
      auto prompt = Prompt(len, len == 64 ? 64 : k);
      Result1 ref = RunOne(**ref_engine, Req(id, prompt, 6, n));
      Result1 pd =
          PdWriteRequest(*p, *d, id, "xfer-" + std::to_string(k), prompt, 6, n, k % 2 == 0);
      SCOPED_TRACE("n=" + std::to_string(n) + " len=" + std::to_string(len));
      ExpectSameAnswer(pd, ref, n);
      records += ExpectWriteLoadRecord(pd, GetParam().transport) ? 1 : 0;
      EXPECT_TRUE(p->WaitDrained()) << "prefill did not drain";
      EXPECT_TRUE(d->WaitDrained()) << "decode did not drain";
    }
  }
  const KvBridgeStats ds = d->kv->Stats();
  const KvBridgeStats ps = p->kv->Stats();
  EXPECT_GT(ds.write_loads_done, 0);
  EXPECT_EQ(records, ds.write_loads_done);  // every WRITE load has its record
  EXPECT_EQ(ds.loads_done, ds.write_loads_done);
  EXPECT_GT(ps.bytes_written, 0);
  EXPECT_GT(p->Metric("kvbridge_kv_transfer_bytes_total"), 0);
  EXPECT_EQ(d->Metric("kvbridge_kv_write_overlap_seconds_count"), ds.write_loads_done);
  EXPECT_EQ(p->Metric("kvbridge_kv_transfer_seconds_count"), ps.write_targets_done);
  EXPECT_EQ(d->Metric("kvbridge_kv_load_failures_total"), 0);
  std::map<std::string, std::string> peers = p->kv->PeerBackends();
  ASSERT_EQ(peers.size(), 1u);  // the prefill connected to the decode to write
  EXPECT_EQ(peers.begin()->second, GetParam().transport == KvTransport::kTcp ? "tcp" : "shm");
  for (PdEngine* e : {p.get(), d.get()}) ExpectClean(*e);
  (*ref_engine)->Shutdown();
}

// The client aborts the decode leg while the prefill writes (and at other moments), and new
// requests go to the same decode at once: their answers still equal colocated ones (no write
// lands in a reused block), and everything drains without the lease.
TEST_P(PdWrite, DecodeAbortMidWriteThenNewRequestsStillEqualColocated) {
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto p = StartEngine(KvRole::kProducer, GetParam().transport, GetParam().prefix_caching);
  auto d = StartEngine(KvRole::kConsumer, GetParam().transport, GetParam().prefix_caching);
  int k = 300;
  for (int delay_us : {0, 100, 300, 1000, 3000}) {
    ++k;
    const std::string id = "ab-" + std::to_string(k);
    auto prompt = Prompt(128, k);
    EngineRequest dec = Req(id, prompt, 32, 4);
    dec.kv_transfer_params = DecodeParams(*p, "x" + id);
    auto finished = AddRequestInBackground(*d->engine, dec);
    ASSERT_NE(finished, nullptr);
    EngineRequest pre = Req("p-" + id, prompt, 1, 1);
    pre.kv_transfer_params = PrefillParams("x" + id);
    std::future<Result1> pf =
        std::async(std::launch::async, [&] { return RunOne(*p->engine, pre); });
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    d->engine->Abort(id);
    // At once: new requests on the same decode.
    for (int j = 0; j < 2; ++j) {
      const std::string nid = id + "-n" + std::to_string(j);
      auto np = Prompt(80, k * 7 + j);
      Result1 pd = PdWriteRequest(*p, *d, nid, "x" + nid, np, 6, 2, j == 0);
      SCOPED_TRACE("delay " + std::to_string(delay_us) + " new request " + std::to_string(j));
      ExpectSameAnswer(pd, RunOne(**ref_engine, Req(nid, np, 6, 2)), 2);
    }
    EXPECT_TRUE(pf.get().error.ok());
    EXPECT_TRUE(WaitFinished(*finished));
    EXPECT_TRUE(d->WaitDrained(5000)) << "decode, delay " << delay_us;
    EXPECT_TRUE(p->WaitDrained(5000)) << "prefill, delay " << delay_us;
  }
  for (PdEngine* e : {p.get(), d.get()}) ExpectClean(*e);
  (*ref_engine)->Shutdown();
}

// The prefill leg fails (refused at admission: n = 2 on a WRITE prefill leg) or the proxy
// releases the transfer before the prefill computed: the decode hears WriteDone(failed) for its
// block ids and recomputes (same answer) or fails, per its policy; nothing waits for a lease.
TEST_P(PdWrite, PrefillFailedOrReleasedRecomputesOrFails) {
  auto ref_engine = Engine::Create(BaseConfig(), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  for (LoadFailurePolicy policy : {LoadFailurePolicy::kRecompute, LoadFailurePolicy::kFail}) {
    for (bool release : {false, true}) {
      SCOPED_TRACE(std::string(LoadFailurePolicyName(policy)) + (release ? " release" : " fail"));
      auto p = StartEngine(KvRole::kProducer, GetParam().transport, GetParam().prefix_caching);
      auto d =
          StartEngine(KvRole::kConsumer, GetParam().transport, GetParam().prefix_caching, policy);
      auto prompt = Prompt(96, 55);
      if (release) {
        httplib::Client cli("127.0.0.1", p->server->port());
        httplib::Headers h{{"X-KVBridge-Cluster-Token", "secret"}};
        auto ok = cli.Post("/v1/kv/release", h, R"({"transfer_id":"xfer-g"})", "application/json");
        ASSERT_TRUE(ok);
        EXPECT_EQ(ok->status, 200);
      }
      EngineRequest pre = Req("p-g", prompt, 1, release ? 1 : 2);
      pre.kv_transfer_params = PrefillParams("xfer-g");
      Result1 pr = RunOne(*p->engine, pre);
      EXPECT_EQ(pr.error.ok(), release) << pr.error.ToString();
      EngineRequest dec = Req("g", prompt, 4, 2);
      dec.kv_transfer_params = DecodeParams(*p, "xfer-g");
      Result1 dr = RunOne(*d->engine, dec);
      ExpectRecomputedOrFailed(policy, dr, **ref_engine, Req("g", prompt, 4, 2));
      EXPECT_EQ(d->Metric("kvbridge_kv_load_failures_total"), 1);
      EXPECT_TRUE(d->WaitDrained(5000));
      EXPECT_TRUE(p->WaitDrained(5000));
      EXPECT_EQ(p->Metric("kvbridge_kv_lease_expired_total"), 0);
      EXPECT_EQ(d->kv->Stats().write_loads_done, 0);
    }
  }
  (*ref_engine)->Shutdown();
}

// A WRITE prefill leg with n > 1 is refused (the decode forks the siblings); a decode leg
// without the prefill's endpoint is refused at the door; neither leaves anything behind.
TEST_P(PdWrite, BadLegsAreRefusedWithNoEffect) {
  auto p = StartEngine(KvRole::kProducer, GetParam().transport, GetParam().prefix_caching);
  EngineRequest pre = Req("p-b", Prompt(40, 3), 1, 2);
  pre.kv_transfer_params = PrefillParams("xfer-b");
  Result1 r = RunOne(*p->engine, pre);
  EXPECT_EQ(r.error.code(), StatusCode::kInvalidArgument) << r.error.ToString();
  json bad = {{"do_remote_prefill", true}, {"transfer_id", "t"}, {"mode", "write"}};
  EXPECT_FALSE(p->kv->ValidateHook()(bad).ok());
  EXPECT_TRUE(p->WaitDrained(2000));
  ExpectClean(*p);
}

// The closing figure (docs/protocol.md "WRITE mode"): for one long prompt, how much of the
// transfer the prefill's compute hides. Prints per run: the prefill leg's wall time, the final
// chunk's first → last layer, the prefill's last layer → the decode's go (the overlap), and the
// first WRITE posted → last WRITE done. KVB_WRITE_MODEL=$PWD/models/small for the 1024-token
// figure; without it the tiny model and 1000 tokens (its max_model_len is 1024).
TEST(PdWriteOverlap, LongPromptOverlapFigure) {
  std::shared_ptr<const Model> model = TinyModel();
  int len = 1000;
  if (const char* m = std::getenv("KVB_WRITE_MODEL"); m != nullptr && *m != '\0') {
    auto loaded = Model::Load(m, {.num_threads = 1});
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    model = std::shared_ptr<const Model>(std::move(loaded).value());
    len = 1024;
  }
  auto ref_engine = Engine::Create(BaseConfig(), model);
  ASSERT_TRUE(ref_engine.ok());
  std::printf(
      "| transport | prompt | prefill leg (ms) | final chunk L0→L%d (ms) | last layer → decode go "
      "(ms) | first WRITE → last done (ms) |\n",
      model->config().num_hidden_layers - 1);
  for (KvTransport t : {KvTransport::kShm, KvTransport::kTcp}) {
    auto p = StartEngine(KvRole::kProducer, t, /*prefix_caching=*/false,
                         LoadFailurePolicy::kRecompute, model);
    auto d = StartEngine(KvRole::kConsumer, t, /*prefix_caching=*/false,
                         LoadFailurePolicy::kRecompute, model);
    for (int run = 0; run < 3; ++run) {
      const std::string id = "ov-" + std::string(KvTransportName(t)) + std::to_string(run);
      auto prompt = Prompt(len, 900 + run);
      const KvBridgeStats before = d->kv->Stats();
      const KvBridgeStats pbefore = p->kv->Stats();
      EngineRequest pre = Req("p-" + id, prompt, 1, 1);
      pre.kv_transfer_params = PrefillParams("x" + id);
      EngineRequest dec = Req(id, prompt, 4, 1);
      dec.kv_transfer_params = DecodeParams(*p, "x" + id);
      std::future<Result1> df =
          std::async(std::launch::async, [&] { return RunOne(*d->engine, dec); });
      const auto t0 = std::chrono::steady_clock::now();
      Result1 pr = RunOne(*p->engine, pre);
      const double prefill_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      ASSERT_TRUE(pr.error.ok());
      Result1 dr = df.get();
      ExpectSameAnswer(dr, RunOne(**ref_engine, Req(id, prompt, 4, 1)), 1);
      ASSERT_TRUE(d->WaitDrained());
      ASSERT_TRUE(p->WaitDrained());
      const KvBridgeStats after = d->kv->Stats();
      const KvBridgeStats pafter = p->kv->Stats();
      ASSERT_EQ(after.write_loads_done - before.write_loads_done, 1);
      ASSERT_EQ(pafter.write_targets_done - pbefore.write_targets_done, 1);
      const double overlap_ms = (after.write_overlap_us_sum - before.write_overlap_us_sum) / 1e3;
      const double transfer_ms =
          (pafter.write_transfer_us_sum - pbefore.write_transfer_us_sum) / 1e3;
      const double compute_ms = (pafter.write_compute_us_sum - pbefore.write_compute_us_sum) / 1e3;
      EXPECT_GT(transfer_ms, 0);
      EXPECT_GE(overlap_ms, 0);
      EXPECT_LT(overlap_ms, prefill_ms + 1000);
      std::printf("| %s | %d | %.2f | %.2f | %.3f | %.3f |\n", KvTransportName(t).data(), len,
                  prefill_ms, compute_ms, overlap_ms, transfer_ms);
    }
    for (PdEngine* e : {p.get(), d.get()}) ExpectClean(*e);
  }
  (*ref_engine)->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(Transports, PdWrite,
                         ::testing::Values(Case{KvTransport::kTcp, true},
                                           Case{KvTransport::kShm, true},
                                           Case{KvTransport::kTcp, false},
                                           Case{KvTransport::kShm, false}),
                         [](const auto& info) {
                           return std::string(KvTransportName(info.param.transport)) +
                                  (info.param.prefix_caching ? "_prefix_on" : "_prefix_off");
                         });

}  // namespace
}  // namespace kvbridge
