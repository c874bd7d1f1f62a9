// Test helpers for the engine tests: the tiny model, a synchronous driver, output collection
// and a scriptable fake KvConnector (a fake at the engine/connector boundary).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/engine/engine_core.h"
#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"

namespace kvbridge::testing_engine {

/// The `tiny` preset (seed 7), written once per test binary into the gtest temp dir.
inline std::shared_ptr<const Model> TinyModel() {
  static std::shared_ptr<const Model> model = [] {
    std::string dir = ::testing::TempDir() + "/kvb_engine_tiny_" + std::to_string(getpid());
    auto spec = RandomModelPreset("tiny", ModelArch::kLlama, 7);
    EXPECT_TRUE(spec.ok());
    Status st = WriteRandomModel(*spec, dir);
    EXPECT_TRUE(st.ok()) << st.ToString();
    auto m = Model::Load(dir, {.num_threads = 1});
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return std::shared_ptr<const Model>(std::move(m).value());
  }();
  return model;
}

inline EngineConfig SmallConfig(int64_t num_blocks = 256) {
  EngineConfig c;
  c.block_size = 16;
  c.num_blocks = num_blocks;
  c.max_num_seqs = 64;
  c.max_num_batched_tokens = 2048;
  c.debug_poison_kv_nan = true;  // any read of unwritten KV shows up as NaN logits
  return c;
}

inline std::unique_ptr<EngineCore> MakeCore(const EngineConfig& c,
                                            MetricsRegistry* metrics = nullptr) {
  auto r = EngineCore::Create(c, TinyModel(), metrics, {});
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return std::move(r).value();
}

/// Byte prompt of `len` tokens, varied by `salt`.
inline std::vector<int32_t> Prompt(int len, int salt = 0) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back((i * 31 + salt * 17 + 5) % 256);
  return p;
}

inline EngineRequest Req(std::string id, std::vector<int32_t> prompt, int max_tokens = 8,
                         int n = 1) {
  EngineRequest r;
  r.request_id = std::move(id);
  r.prompt_token_ids = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.n = n;
  r.sampling.temperature = 0;
  r.sampling.ignore_eos = true;
  return r;
}

struct Collected {
  std::map<int, std::vector<int32_t>> tokens;  // by sibling index
  std::map<int, std::vector<TokenLogprob>> logprobs;
  std::map<int, std::string> reasons;
  std::map<int, CompletionOutput> final_output;  // the finishing CompletionOutput (its ids)
  bool finished = false;
  int outputs_after_finish = 0;
  int num_cached_tokens = -1;
  Status error;
  nlohmann::json kv_transfer_params;
};

inline void Collect(std::vector<RequestOutput> outs, std::map<std::string, Collected>* all) {
  for (RequestOutput& o : outs) {
    Collected& c = (*all)[o.request_id];
    if (c.finished) ++c.outputs_after_finish;
    for (CompletionOutput& co : o.outputs) {
      auto& t = c.tokens[co.index];
      t.insert(t.end(), co.new_token_ids.begin(), co.new_token_ids.end());
      auto& l = c.logprobs[co.index];
      l.insert(l.end(), co.new_logprobs.begin(), co.new_logprobs.end());
      if (co.finished) {
        c.reasons[co.index] = co.finish_reason;
        c.final_output[co.index] = co;
      }
    }
    c.num_cached_tokens = o.num_cached_tokens;
    if (o.finished) {
      c.finished = true;
      c.error = o.error;
      c.kv_transfer_params = o.kv_transfer_params;
    }
  }
}

/// Steps until no request is unfinished (bounded), collecting outputs. `now` advances 1 ms a step.
inline std::map<std::string, Collected> RunAll(EngineCore& core, TimePoint* now,
                                               std::map<std::string, Collected> all = {}) {
  Collect(core.TakeOutputs(), &all);
  for (int i = 0; i < 5000 && core.scheduler().HasUnfinished(); ++i) {
    *now += kMillisecond;
    auto r = core.Step(*now);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    Collect(core.TakeOutputs(), &all);
  }
  EXPECT_FALSE(core.scheduler().HasUnfinished());
  return all;
}

/// Records every logits row by (scheduled id, position of the token that produced it).
struct LogitsLog {
  std::map<std::pair<std::string, int>, std::vector<float>> rows;
  int vocab = 0;
  void Attach(EngineCore& core) {
    vocab = core.model().config().vocab_size;
    core.set_logits_observer([this](const ScheduledBatch& b, std::span<const float> logits) {
      size_t row = 0;
      for (const ScheduledChunk& c : b.chunks) {
        if (!c.compute_logits) continue;
        rows[{c.request_id, c.start_pos + c.num_tokens - 1}] =
            std::vector<float>(logits.begin() + row * vocab, logits.begin() + (row + 1) * vocab);
        ++row;
      }
    });
  }
};

inline bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// A scriptable connector: records calls; answers from scripts the test sets.
class FakeConnector : public KvConnector {
 public:
  struct Calls {
    std::vector<std::string> matched;  // GetNumNewMatchedTokens ids
    std::vector<int> matched_local;
    struct Alloc {
      std::string id;
      std::vector<int32_t> blocks;
      int local = 0;
      int external = 0;
    };
    std::vector<Alloc> allocs;
    std::vector<std::pair<std::string, std::string>> finished;  // (id, reason)
    std::vector<std::vector<int32_t>> finished_blocks;
    std::vector<std::string> aborted;
    int polls = 0;
  };
  // Scripts.
  std::map<std::string, Result<Match>> match_by_parent;  // default: no external tokens
  bool hold_on_finish = false;
  nlohmann::json finish_params;
  bool keep_on_abort = false;
  StepReport next_report;
  std::optional<TimePoint> deadline;

  std::shared_ptr<Calls> calls = std::make_shared<Calls>();
  EngineHooks hooks;

  Result<Match> GetNumNewMatchedTokens(const ConnectorRequestInfo& req, int local,
                                       TimePoint) override {
    calls->matched.push_back(req.request_id);
    calls->matched_local.push_back(local);
    auto it = match_by_parent.find(req.parent_id);
    if (it == match_by_parent.end()) return Match{};
    return it->second;
  }
  void UpdateStateAfterAlloc(const ConnectorRequestInfo& req, std::span<const int32_t> blocks,
                             int local, int external, TimePoint) override {
    calls->allocs.push_back({req.request_id, {blocks.begin(), blocks.end()}, local, external});
  }
  FinishDecision RequestFinished(const ConnectorRequestInfo& req, std::span<const int32_t> blocks,
                                 std::string_view reason, TimePoint) override {
    calls->finished.emplace_back(req.request_id, std::string(reason));
    calls->finished_blocks.emplace_back(blocks.begin(), blocks.end());
    return {hold_on_finish, finish_params};
  }
  bool RequestAborted(const ConnectorRequestInfo& req, TimePoint) override {
    calls->aborted.push_back(req.request_id);
    return keep_on_abort;
  }
  StepReport Poll(TimePoint) override {
    ++calls->polls;
    StepReport r = std::move(next_report);
    next_report = {};
    return r;
  }
  std::optional<TimePoint> NextDeadline() const override { return deadline; }
  bool Idle() const override { return true; }
};

/// Installs a FakeConnector into `config` and returns a pointer valid while the engine lives.
inline FakeConnector** InstallFake(EngineConfig* config) {
  static thread_local FakeConnector* slot = nullptr;
  slot = nullptr;
  config->connector_factory = [](const EngineHooks& hooks) -> Result<std::unique_ptr<KvConnector>> {
    auto c = std::make_unique<FakeConnector>();
    c->hooks = hooks;
    slot = c.get();
    return std::unique_ptr<KvConnector>(std::move(c));
  };
  return &slot;
}

}  // namespace kvbridge::testing_engine
