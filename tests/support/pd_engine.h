// tests/support/pd_engine.h — in-process P/D engines for the connector's end-to-end tests
// (pd_read_test, pd_write_test, pd_tp_test): a real Engine with its KvBridgeRuntime (transfer agent
// on 127.0.0.1) and ApiServer (for the connector's HTTP routes), the tiny random model, and the
// helpers that run one request and compare answers bitwise.
//
//   auto ref = Engine::Create(BaseConfig(), TinyModel());
//   auto p = PdEngine::Start({.role = KvRole::kProducer, .transport = KvTransport::kTcp});
//   auto d = PdEngine::Start({.role = KvRole::kConsumer, .transport = KvTransport::kTcp});
//   PdResult r = RunOne(*p->engine, Req("p-a", Prompt(40, 1), 1, 1));
//   EXPECT_TRUE(d->WaitDrained());
//
// Failures are reported through GoogleTest (EXPECT_*), so these are for test bodies only.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvbridge/connector/kvbridge_connector.h"
#include "kvbridge/engine/engine.h"
#include "kvbridge/model/model.h"
#include "kvbridge/server/api_server.h"

namespace kvbridge::testing {

/// The `tiny` random llama model (seed 7), written and loaded once per process.
std::shared_ptr<const Model> TinyModel();

/// What one request produced, per sibling index.
struct PdResult {
  std::map<int, std::vector<int32_t>> tokens;
  std::map<int, std::vector<TokenLogprob>> logprobs;
  nlohmann::json kv_transfer_params;
  Status error;
  int num_cached_tokens = -1;
  RequestTimes times;  ///< the final output's (kv_load: the connector's load record)
};

/// Runs one request to completion on `engine` (waits at most 60 s).
PdResult RunOne(Engine& engine, EngineRequest req);
/// A deterministic prompt of `len` token ids in [0, 256).
std::vector<int32_t> Prompt(int len, int salt);
/// A request with top-5 logprobs and ignore_eos; n > 1 samples (seeded), n == 1 is greedy.
EngineRequest Req(const std::string& id, std::vector<int32_t> prompt, int max_tokens, int n);
/// 256 blocks of 16 tokens, 64 sequences, never-written blocks poisoned with NaN.
EngineConfig BaseConfig(KvDtype dtype = KvDtype::kFp32);

/// How to start one PdEngine.
struct PdEngineOptions {
  KvRole role = KvRole::kProducer;
  KvTransport transport = KvTransport::kAuto;
  KvTransferMode mode = KvTransferMode::kRead;
  LoadFailurePolicy policy = LoadFailurePolicy::kRecompute;
  KvDtype dtype = KvDtype::kFp32;
  bool prefix_caching = true;
  /// Test-only: the consumer corrupts its first READ block.
  bool corrupt_first_read_block = false;
  /// nullptr: TinyModel().
  std::shared_ptr<const Model> model;
  /// The engine's TP size (ranks are threads; one KV shard and transfer agent per rank).
  int tensor_parallel_size = 1;
};

/// One engine with its connector runtime (lease 30 s, reply timeout 5 s, cluster token
/// "secret") and HTTP server on an ephemeral 127.0.0.1 port.
struct PdEngine {
  std::shared_ptr<KvBridgeRuntime> kv;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<server::ApiServer> server;

  static std::unique_ptr<PdEngine> Start(const PdEngineOptions& options);
  ~PdEngine();
  /// Waits (at most `ms`) until nothing is active or held and the connector is idle.
  bool WaitDrained(int ms = 10000);
  /// The engine's metric `name` (kvbridge::ScrapeMetric over its registry).
  double Metric(const std::string& name);
};

/// Asserts that `pd` has `n` siblings whose tokens and top-5 logprobs equal `ref`'s bitwise.
void ExpectSameAnswer(const PdResult& pd, const PdResult& ref, int n);

/// A decode whose KV load failed, answered per its `policy`: kRecompute → `got` equals the
/// answer of `ref` (one colocated engine) to `req`, run now (req.sampling.n siblings); kFail →
/// `got` is an error.
void ExpectRecomputedOrFailed(LoadFailurePolicy policy, const PdResult& got, Engine& ref,
                              const EngineRequest& req);

/// Adds `req` to `engine` without waiting for it; the flag turns true with its last output
/// (finished or aborted). Null, with a test failure, when the engine refuses the request.
std::shared_ptr<std::atomic<bool>> AddRequestInBackground(Engine& engine, const EngineRequest& req);
/// Waits up to `ms` for `finished`; returns it.
bool WaitFinished(const std::atomic<bool>& finished, int ms = 5000);

}  // namespace kvbridge::testing
