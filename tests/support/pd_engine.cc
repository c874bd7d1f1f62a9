#include "support/pd_engine.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "kvbridge/common/metrics.h"
#include "support/tiny_model.h"

namespace kvbridge::testing {

std::shared_ptr<const Model> TinyModel() { return TinyRandomModel(7); }

// Runs one request to completion on `engine` (bounded wait).
PdResult RunOne(Engine& engine, EngineRequest req) {
  auto st = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
  auto out = std::make_shared<PdResult>();
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
      out->num_cached_tokens = o.num_cached_tokens;
      out->times = o.times;
      *done = true;
      st->second.notify_all();
    }
  });
  EXPECT_TRUE(add.ok()) << add.ToString();
  if (!add.ok()) return PdResult{.error = add};
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

EngineConfig BaseConfig(KvDtype dtype) {
  EngineConfig c;
  c.kv_dtype = dtype;
  c.block_size = 16;
  c.num_blocks = 256;
  c.max_num_seqs = 64;
  c.debug_poison_kv_nan = true;  // a block never written shows up as NaN logits
  return c;
}

std::unique_ptr<PdEngine> PdEngine::Start(const PdEngineOptions& o) {
  auto e = std::make_unique<PdEngine>();
  KvTransferConfig cfg;
  cfg.role = o.role;
  cfg.transport = o.transport;
  cfg.lease = 30 * kSecond;
  cfg.reply_timeout = 5 * kSecond;
  cfg.load_failure_policy = o.policy;
  cfg.mode = o.mode;
  auto kv = KvBridgeRuntime::Create({.config = cfg,
                                     .cluster_token = "secret",
                                     .debug_corrupt_first_read_block = o.corrupt_first_read_block});
  EXPECT_TRUE(kv.ok()) << kv.status().ToString();
  e->kv = *kv;
  EngineConfig ec = BaseConfig(o.dtype);
  ec.enable_prefix_caching = o.prefix_caching;
  ec.tensor_parallel_size = o.tensor_parallel_size;
  ec.connector_factory = e->kv->Factory();
  auto engine = Engine::Create(ec, o.model ? o.model : TinyModel());
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  e->engine = std::move(engine).value();
  server::ServerConfig sc;
  sc.port = 0;
  sc.num_http_threads = 4;
  sc.cluster_token = "secret";
  sc.validate_kv_transfer_params = e->kv->ValidateHook();
  auto srv = server::ApiServer::Create(sc, e->engine.get(), TinyModel()->tokenizer());
  EXPECT_TRUE(srv.ok()) << srv.status().ToString();
  e->server = std::move(srv).value();
  for (Route& route : e->kv->Routes()) EXPECT_TRUE(e->server->RegisterRoute(std::move(route)).ok());
  EXPECT_TRUE(e->server->Start().ok());
  e->kv->SetAdvertisedEndpoint("127.0.0.1", e->server->port());
  return e;
}

PdEngine::~PdEngine() {
  if (server) server->Stop();
  if (engine) engine->Shutdown();
}
// Waits (bounded) until nothing is active or held and the connector is idle.
bool PdEngine::WaitDrained(int ms) {
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
double PdEngine::Metric(const std::string& name) {
  return ScrapeMetric(engine->metrics().Render(), name);
}

void ExpectSameAnswer(const PdResult& pd, const PdResult& ref, int n) {
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

void ExpectRecomputedOrFailed(LoadFailurePolicy policy, const PdResult& got, Engine& ref,
                              const EngineRequest& req) {
  if (policy == LoadFailurePolicy::kRecompute) {
    ExpectSameAnswer(got, RunOne(ref, req), req.sampling.n);
  } else {
    EXPECT_FALSE(got.error.ok());
  }
}

std::shared_ptr<std::atomic<bool>> AddRequestInBackground(Engine& engine,
                                                          const EngineRequest& req) {
  auto finished = std::make_shared<std::atomic<bool>>(false);
  Status added = engine.AddRequest(req, [finished](const RequestOutput& o) {
    if (o.finished) finished->store(true);
  });
  EXPECT_TRUE(added.ok()) << added.ToString();
  return added.ok() ? finished : nullptr;
}

bool WaitFinished(const std::atomic<bool>& finished, int ms) {
  for (int i = 0; i < ms / 10 && !finished.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return finished.load();
}

}  // namespace kvbridge::testing
