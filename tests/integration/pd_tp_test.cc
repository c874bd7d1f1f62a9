// Rank-aware P/D end to end, READ and WRITE mode: a prefill engine of TP = Tp and a decode engine
// of TP = Td (ranks are threads of one engine, one KV shard and one transfer agent per rank), each
// with its KvBridgeRuntime and ApiServer; the test plays the proxy. Every decode rank gets the
// head slices of the TP plan (tp_plan.h) from the prefill ranks that hold them (READ: it reads
// them; WRITE: each prefill rank writes them). Greedy answers and top-5 logprobs must be bitwise
// equal to one colocated TP = 1 engine, for n = 1 and n = 8, and every rank must drain to 0 held /
// 0 active blocks with no lease expiry.
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "kvbridge/common/metrics.h"
#include "kvbridge/connector/kvbridge_connector.h"
#include "kvbridge/engine/engine.h"
#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "kvbridge/server/api_server.h"
#include "kvbridge/transfer/metadata.h"

namespace kvbridge {
namespace {

using nlohmann::json;

// The tiny preset: 4 attention heads, 2 KV heads (so TP 4 replicates each KV head twice).
std::shared_ptr<const Model> TinyModel() {
  static std::shared_ptr<const Model> model = [] {
    std::string dir = ::testing::TempDir() + "/kvb_pd_tp_tiny_" + std::to_string(getpid());
    auto spec = RandomModelPreset("tiny", ModelArch::kLlama, 7);
    EXPECT_TRUE(spec.ok());
    EXPECT_TRUE(WriteRandomModel(*spec, dir).ok());
    auto m = Model::Load(dir, {.num_threads = 1});
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return std::shared_ptr<const Model>(std::move(m).value());
  }();
  return model;
}

class ByteCodec : public server::TextCodec {
 public:
  std::vector<int32_t> Encode(std::string_view t) const override {
    return std::vector<int32_t>(t.begin(), t.end());
  }
  std::string Decode(std::span<const int32_t> ids) const override {
    std::string s;
    for (int32_t i : ids) s += static_cast<char>(i & 0xff);
    return s;
  }
  int32_t vocab_size() const override { return 256; }
};

struct Answer {
  std::map<int, std::vector<int32_t>> tokens;
  std::map<int, std::vector<TokenLogprob>> logprobs;
  json kv_transfer_params;
  Status error;
};

Answer RunOne(Engine& engine, EngineRequest req) {
  auto st = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
  auto out = std::make_shared<Answer>();
  auto done = std::make_shared<bool>(false);
  Status add = engine.AddRequest(std::move(req), [st, out, done](const RequestOutput& o) {
    std::lock_guard<std::mutex> l(st->first);
    for (const CompletionOutput& c : o.outputs) {
      auto& t = out->tokens[c.index];
      t.insert(t.end(), c.new_token_ids.begin(), c.new_token_ids.end());
      auto& lp = out->logprobs[c.index];
      lp.insert(lp.end(), c.new_logprobs.begin(), c.new_logprobs.end());
    }
    if (o.finished) {
      out->kv_transfer_params = o.kv_transfer_params;
      out->error = o.error;
      *done = true;
      st->second.notify_all();
    }
  });
  EXPECT_TRUE(add.ok()) << add.ToString();
  if (!add.ok()) return Answer{.error = add};
  std::unique_lock<std::mutex> l(st->first);
  EXPECT_TRUE(st->second.wait_for(l, std::chrono::seconds(60), [&] { return *done; }));
  return *out;
}

std::vector<int32_t> Prompt(int len, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back((i * 31 + salt * 17 + 5) % 256);
  return p;
}

EngineRequest Req(const std::string& id, std::vector<int32_t> prompt, int max_tokens, int n) {
  EngineRequest r;
  r.request_id = id;
  r.prompt_token_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.n = n;
  r.sampling.temperature = n > 1 ? 1.0f : 0.0f;  // n > 1: seeded sampling, siblings differ
  r.sampling.seed = 1234;
  r.sampling.ignore_eos = true;
  r.sampling.logprobs = 5;
  return r;
}

EngineConfig BaseConfig(int tp) {
  EngineConfig c;
  c.kv_dtype = KvDtype::kFp32;
  c.block_size = 16;
  c.num_blocks = 256;
  c.max_num_seqs = 64;
  c.debug_poison_kv_nan = true;  // a head slice never written shows up as NaN logits
  c.tensor_parallel_size = tp;
  return c;
}

struct PdEngine {
  std::shared_ptr<KvBridgeRuntime> kv;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<server::ApiServer> server;

  static std::unique_ptr<PdEngine> Start(KvRole role, int tp, KvTransport transport,
                                         KvTransferMode mode = KvTransferMode::kRead) {
    auto e = std::make_unique<PdEngine>();
    KvTransferConfig cfg;
    cfg.role = role;
    cfg.transport = transport;
    cfg.mode = mode;
    cfg.lease = 30 * kSecond;
    cfg.reply_timeout = 5 * kSecond;
    auto kv = KvBridgeRuntime::Create({.config = cfg, .cluster_token = "secret"});
    EXPECT_TRUE(kv.ok()) << kv.status().ToString();
    e->kv = *kv;
    EngineConfig ec = BaseConfig(tp);
    ec.connector_factory = e->kv->Factory();
    auto engine = Engine::Create(ec, TinyModel());
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    if (!engine.ok()) return nullptr;
    e->engine = std::move(engine).value();
    server::ServerConfig sc;
    sc.port = 0;
    sc.num_http_threads = 4;
    sc.cluster_token = "secret";
    sc.validate_kv_transfer_params = e->kv->ValidateHook();
    auto srv = server::ApiServer::Create(sc, e->engine.get(), std::make_shared<ByteCodec>());
    EXPECT_TRUE(srv.ok()) << srv.status().ToString();
    e->server = std::move(srv).value();
    EXPECT_TRUE(e->kv->InstallRoutes(*e->server).ok());
    EXPECT_TRUE(e->server->Start().ok());
    e->kv->SetAdvertisedEndpoint("127.0.0.1", e->server->port());
    return e;
  }
  ~PdEngine() {
    if (server) server->Stop();
    if (engine) engine->Shutdown();
  }
  bool WaitDrained(int ms = 10000) {
    for (int i = 0; i < ms / 10; ++i) {
      EngineStats s = engine->Stats();
      if (s.kv_blocks_active == 0 && s.kv_blocks_held_for_transfer == 0 && kv->Stats().idle &&
          s.running == 0 && s.waiting == 0 && s.waiting_for_remote_kv == 0) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  double Metric(const std::string& name) { return ScrapeMetric(engine->metrics().Render(), name); }
};

void ExpectSameAnswer(const Answer& pd, const Answer& ref, int n) {
  ASSERT_TRUE(pd.error.ok()) << pd.error.ToString();
  ASSERT_EQ(pd.tokens.size(), static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(pd.tokens.at(i), ref.tokens.at(i)) << "sibling " << i;
    const auto& a = pd.logprobs.at(i);
    const auto& b = ref.logprobs.at(i);
    ASSERT_EQ(a.size(), b.size());
    for (size_t t = 0; t < a.size(); ++t) {
      EXPECT_EQ(a[t].token, b[t].token);
      EXPECT_EQ(std::memcmp(&a[t].logprob, &b[t].logprob, sizeof(float)), 0)
          << "sibling " << i << " token " << t << ": " << a[t].logprob << " vs " << b[t].logprob;
      ASSERT_EQ(a[t].top.size(), 5u);
      ASSERT_EQ(b[t].top.size(), 5u);
      for (size_t k = 0; k < 5; ++k) {
        EXPECT_EQ(a[t].top[k].token, b[t].top[k].token);
        EXPECT_EQ(std::memcmp(&a[t].top[k].logprob, &b[t].top[k].logprob, sizeof(float)), 0);
      }
    }
  }
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

class PdTp : public ::testing::TestWithParam<TpCase> {};

TEST_P(PdTp, AnswersEqualColocatedTp1AndEveryRankDrains) {
  const auto [tp_p, tp_d, transport] = GetParam();
  auto ref_engine = Engine::Create(BaseConfig(1), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto p = PdEngine::Start(KvRole::kProducer, tp_p, transport);
  auto d = PdEngine::Start(KvRole::kConsumer, tp_d, transport);
  ASSERT_TRUE(p && d);
  int k = 0;
  for (int n : {1, 8}) {
    for (int len : {17, 40}) {
      ++k;
      const std::string id = "tp-" + std::to_string(k);
      auto prompt = Prompt(len, k);
      Answer ref = RunOne(**ref_engine, Req(id, prompt, 6, n));
      Answer pd = PdRequest(*p, *d, id, "xfer-" + std::to_string(k), prompt, 6, n, tp_p);
      SCOPED_TRACE("n=" + std::to_string(n) + " len=" + std::to_string(len));
      ExpectSameAnswer(pd, ref, n);
      EXPECT_TRUE(p->WaitDrained()) << "prefill did not drain";
      EXPECT_TRUE(d->WaitDrained()) << "decode did not drain";
    }
  }
  // Every decode rank's agent connected to the prefill ranks of its slices: with 2 KV heads,
  // the decode reads from min(Tp, 2) prefill ranks in all (the replicas of TP 4 are not read).
  EXPECT_EQ(static_cast<int>(d->kv->PeerBackends().size()), std::min(tp_p, 2));
  // Bytes read equal exactly the decode's whole KV of the loaded blocks (each byte once):
  // 4 requests of 16 + 39 remote tokens -> 1 + 3 blocks each, x2 for n (same prompts).
  const int layers = TinyModel()->config().num_hidden_layers;
  const int head_dim = TinyModel()->config().head_dim;
  const double block_bytes = 2.0 * 2 * 16 * head_dim * 4 * layers;  // K+V, 2 heads, fp32
  EXPECT_EQ(d->Metric("kvbridge_kv_transfer_bytes_total"), 2 * (1 + 3) * block_bytes);
  for (PdEngine* e : {p.get(), d.get()}) {
    EXPECT_EQ(e->engine->Stats().kv_blocks_held_for_transfer, 0);
    EXPECT_EQ(e->engine->Stats().kv_blocks_active, 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_lease_expired_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_notifications_ignored_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_load_failures_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_notifications_parked"), 0);
  }
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
  auto ref_engine = Engine::Create(BaseConfig(1), TinyModel());
  ASSERT_TRUE(ref_engine.ok());
  auto p = PdEngine::Start(KvRole::kProducer, tp_p, transport, KvTransferMode::kWrite);
  auto d = PdEngine::Start(KvRole::kConsumer, tp_d, transport, KvTransferMode::kWrite);
  ASSERT_TRUE(p && d);
  int k = 0;
  for (int n : {1, 8}) {
    for (int len : {17, 40}) {
      ++k;
      const std::string id = "tpw-" + std::to_string(k);
      auto prompt = Prompt(len, k);
      Answer ref = RunOne(**ref_engine, Req(id, prompt, 6, n));
      Answer pd = PdWriteRequest(*p, *d, id, "wxfer-" + std::to_string(k), prompt, 6, n, tp_p);
      SCOPED_TRACE("n=" + std::to_string(n) + " len=" + std::to_string(len));
      ExpectSameAnswer(pd, ref, n);
      EXPECT_TRUE(p->WaitDrained()) << "prefill did not drain";
      EXPECT_TRUE(d->WaitDrained()) << "decode did not drain";
    }
  }
  // Bytes written equal exactly the decode's whole KV of the loaded blocks (each byte once):
  // 4 requests of 16 + 39 remote tokens -> 1 + 3 blocks each, x2 for n (same prompts).
  const int layers = TinyModel()->config().num_hidden_layers;
  const int head_dim = TinyModel()->config().head_dim;
  const double block_bytes = 2.0 * 2 * 16 * head_dim * 4 * layers;  // K+V, 2 heads, fp32
  EXPECT_EQ(p->Metric("kvbridge_kv_transfer_bytes_total"), 2 * (1 + 3) * block_bytes);
  for (PdEngine* e : {p.get(), d.get()}) {
    EXPECT_EQ(e->engine->Stats().kv_blocks_held_for_transfer, 0);
    EXPECT_EQ(e->engine->Stats().kv_blocks_active, 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_lease_expired_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_notifications_ignored_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_load_failures_total"), 0);
    EXPECT_EQ(e->Metric("kvbridge_kv_notifications_parked"), 0);
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
                      TpCase{2, 1, KvTransport::kShm}, TpCase{1, 2, KvTransport::kShm}),
    [](const ::testing::TestParamInfo<TpCase>& i) {
      return "p" + std::to_string(std::get<0>(i.param)) + "_d" +
             std::to_string(std::get<1>(i.param)) +
             (std::get<2>(i.param) == KvTransport::kTcp ? "_tcp" : "_shm");
    });

// A prefill rank the decode never reads (KV heads replicated, Tp > Td) would hold its blocks
// until the lease in WRITE mode: the decode refuses that topology up front.
TEST(PdTpWriteRefusal, UnreadPrefillRanksAreRefused) {
  auto d = PdEngine::Start(KvRole::kConsumer, 1, KvTransport::kTcp, KvTransferMode::kWrite);
  ASSERT_TRUE(d);
  EngineRequest dec = Req("r-1", Prompt(40, 1), 4, 1);
  dec.kv_transfer_params = json{{"do_remote_prefill", true},
                                {"transfer_id", "wr-1"},
                                {"mode", "write"},
                                {"remote_engine_id", "nobody"},
                                {"remote_host", "127.0.0.1"},
                                {"remote_port", 1},
                                {"tp_size", 4}};
  Answer a = RunOne(*d->engine, dec);
  EXPECT_EQ(a.error.code(), StatusCode::kUnimplemented) << a.error.ToString();
  EXPECT_NE(a.error.message().find("not all read"), std::string::npos) << a.error.ToString();
  EXPECT_TRUE(d->WaitDrained());
}

// GET /v1/kv/metadata/<rank> serves each rank's agent metadata: TP size, rank and head range.
TEST(PdTpMetadata, EveryRankServesItsHeadRange) {
  auto p = PdEngine::Start(KvRole::kProducer, 2, KvTransport::kTcp);
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
