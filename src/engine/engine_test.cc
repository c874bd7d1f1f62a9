// The threaded Engine front door: submission from several threads, callbacks on the engine
// thread, Abort from any thread, Stats, metrics, connector wake-ups, Shutdown.
#include "kvbridge/engine/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "engine/engine_test_util.h"
#include "kvbridge/model/model.h"

namespace kvbridge {
namespace {

using testing_engine::Collected;
using testing_engine::FakeConnector;
using testing_engine::InstallFake;
using testing_engine::Prompt;
using testing_engine::Req;
using testing_engine::SmallConfig;
using testing_engine::TinyModel;

// Collects one request's outputs; Wait() blocks (bounded) until its final output.
class Sink {
 public:
  Engine::OutputCallback Callback() {
    return [this](const RequestOutput& o) {
      std::lock_guard<std::mutex> lock(mu_);
      if (thread_id_ == std::thread::id()) thread_id_ = std::this_thread::get_id();
      testing_engine::Collect({o}, &all_);
      if (o.finished) {
        done_ = true;
        cv_.notify_all();
      }
    };
  }
  bool Wait(std::chrono::seconds limit = std::chrono::seconds(60)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [this] { return done_; });
  }
  Collected Get(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    return all_[id];
  }
  std::thread::id thread_id() {
    std::lock_guard<std::mutex> lock(mu_);
    return thread_id_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::map<std::string, Collected> all_;
  std::thread::id thread_id_;
};

std::vector<int32_t> GreedyCore(const std::vector<int32_t>& prompt, int max_tokens) {
  auto core = testing_engine::MakeCore(SmallConfig());
  TimePoint now = 0;
  EXPECT_TRUE(core->AddRequest(Req("ref", prompt, max_tokens), now).ok());
  return testing_engine::RunAll(*core, &now)["ref"].tokens.at(0);
}

TEST(Engine, ServesRequestsFromSeveralThreads) {
  auto engine_or = Engine::Create(SmallConfig(), TinyModel());
  ASSERT_TRUE(engine_or.ok()) << engine_or.status().ToString();
  auto engine = std::move(engine_or).value();
  constexpr int kThreads = 4;
  std::vector<std::unique_ptr<Sink>> sinks;
  for (int i = 0; i < kThreads; ++i) sinks.push_back(std::make_unique<Sink>());
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      EXPECT_TRUE(
          engine
              ->AddRequest(Req("r" + std::to_string(i), Prompt(10 + i, i), 6), sinks[i]->Callback())
              .ok());
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_TRUE(sinks[i]->Wait());
    Collected c = sinks[i]->Get("r" + std::to_string(i));
    EXPECT_TRUE(c.finished);
    EXPECT_EQ(c.tokens.at(0), GreedyCore(Prompt(10 + i, i), 6));
    EXPECT_NE(sinks[i]->thread_id(), std::this_thread::get_id());
  }
  // Stats are published after each step; the engine drains to zero.
  for (int i = 0; i < 1000 && engine->Stats().kv_blocks_active != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EngineStats s = engine->Stats();
  EXPECT_EQ(s.kv_blocks_active, 0);
  EXPECT_EQ(s.kv_blocks_total, 256);
  EXPECT_EQ(s.running, 0);
  std::string text = engine->metrics().Render();
  for (const char* name :
       {"kvbridge_requests_running", "kvbridge_requests_waiting",
        "kvbridge_requests_waiting_for_remote_kv", "kvbridge_kv_blocks_active",
        "kvbridge_kv_blocks_held_for_transfer", "kvbridge_prefix_cache_queries_total",
        "kvbridge_prefix_cache_hits_total", "kvbridge_time_to_first_token_seconds_count",
        "kvbridge_inter_token_latency_seconds_count"}) {
    EXPECT_GE(ScrapeMetric(text, name), 0.0) << name;
  }
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_kv_blocks_total"), 256.0);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_generation_tokens_total"), 24.0);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_time_to_first_token_seconds_count"), 4.0);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_inter_token_latency_seconds_count"), 20.0);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_requests_finished_total", "reason=\"length\""), 4.0);
  // The vllm:* twins (vllm_metrics_test checks them in detail), the gauges published per step.
  const std::string vl = "model_name=\"kvbridge\",engine=\"0\"";
  EXPECT_EQ(ScrapeMetric(text, "vllm:num_requests_running", vl), 0.0);
  EXPECT_EQ(ScrapeMetric(text, "vllm:num_requests_waiting", vl), 0.0);
  EXPECT_EQ(ScrapeMetric(text, "vllm:kv_cache_usage_perc", vl), 0.0);
  EXPECT_EQ(ScrapeMetric(text, "vllm:generation_tokens_total", vl), 24.0);
  EXPECT_EQ(ScrapeMetric(text, "vllm:request_success_total", "finished_reason=\"length\""), 4.0);
  engine->Shutdown();
}

TEST(Engine, RejectsSynchronouslyAndAbortsFromAnyThread) {
  EngineConfig c = SmallConfig();
  c.max_waiting_requests = 2;
  auto engine = std::move(Engine::Create(c, TinyModel())).value();
  EXPECT_EQ(engine->AddRequest(Req("bad", {}), {}).code(), StatusCode::kInvalidArgument);
  Sink a;
  ASSERT_TRUE(engine->AddRequest(Req("a", Prompt(10), 1000), a.Callback()).ok());
  EXPECT_EQ(engine->AddRequest(Req("a", Prompt(10), 5), {}).code(), StatusCode::kAlreadyExists);
  std::thread([&] { engine->Abort("a"); }).join();
  ASSERT_TRUE(a.Wait());
  Collected ca = a.Get("a");
  EXPECT_TRUE(ca.finished);
  EXPECT_EQ(ca.reasons.at(0), "abort");
  engine->Abort("never-existed");  // no-op
  // The id is free again once its final output went out.
  Sink again;
  ASSERT_TRUE(engine->AddRequest(Req("a", Prompt(10), 2), again.Callback()).ok());
  ASSERT_TRUE(again.Wait());
  EXPECT_EQ(again.Get("a").tokens.at(0).size(), 2u);
  engine->Shutdown();
  EXPECT_EQ(engine->AddRequest(Req("late", Prompt(3), 2), {}).code(), StatusCode::kUnavailable);
}

// The admission bound holds under a burst from several threads: with one sequence running at a
// time and long requests, at most max_num_seqs + max_waiting_requests are accepted, plus one per
// request that finished meanwhile (adds the engine loop has taken stay counted until the waiting
// count that holds them is published).
TEST(Engine, AdmissionBoundHoldsUnderAConcurrentBurst) {
  EngineConfig c = SmallConfig();
  c.max_num_seqs = 1;
  c.max_waiting_requests = 3;
  auto engine = std::move(Engine::Create(c, TinyModel())).value();
  std::atomic<int> accepted{0}, refused{0}, finished{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        const std::string id = "r" + std::to_string(t) + "-" + std::to_string(i);
        Status st = engine->AddRequest(Req(id, Prompt(4), 900), [&](const RequestOutput& o) {
          if (o.finished) ++finished;
        });
        if (st.ok()) {
          ++accepted;
        } else {
          EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
          ++refused;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GE(accepted.load(), 3);
  EXPECT_LE(accepted.load(), 4 + finished.load());
  EXPECT_EQ(accepted + refused, 200);
  engine->Shutdown();
}

TEST(Engine, ShutdownAbortsPendingRequests) {
  auto engine = std::move(Engine::Create(SmallConfig(), TinyModel())).value();
  Sink s;
  ASSERT_TRUE(engine->AddRequest(Req("long", Prompt(10), 900), s.Callback()).ok());
  engine->Shutdown();
  ASSERT_TRUE(s.Wait(std::chrono::seconds(5)));
  Collected c = s.Get("long");
  EXPECT_TRUE(c.finished);
  EXPECT_EQ(c.reasons.at(0), "abort");
}

TEST(Engine, ConnectorWakeDrivesPollWhileIdle) {
  EngineConfig c = SmallConfig();
  FakeConnector** fake = InstallFake(&c);
  auto engine = std::move(Engine::Create(c, TinyModel())).value();
  FakeConnector* f = *fake;
  // Give the engine a moment to go idle, then wake it from another thread.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // The fake is only touched by the engine thread from here on, except through wake().
  std::thread([&] { f->hooks.wake(); }).join();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  engine->Shutdown();
  EXPECT_GE(f->calls->polls, 2);   // at least the first step and the woken one
  EXPECT_LE(f->calls->polls, 10);  // idle engine does not spin
}

}  // namespace
}  // namespace kvbridge
