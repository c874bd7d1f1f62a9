// `kvbridge bench` against a fake OpenAI engine: the request shapes it sends, the figures it
// reports, the drain check (drained late / never / lease expired) and the command's exit codes.
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvbridge/bench/bench.h"
#include "support/free_port.h"
#include "support/subprocess.h"

namespace kvbridge::bench {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

class FakeServer {
 public:
  FakeServer() : port_(testing::FreePort()) {
    server_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      json b = json::parse(req.body);
      {
        std::lock_guard<std::mutex> lock(mu_);
        bodies_.push_back(b);
      }
      active_ = 5;
      last_response_ = Clock::now();
      if (fail_status_ != 0) {
        res.status = fail_status_;
        res.set_content(R"({"error":"nope"})", "application/json");
        return;
      }
      int n = b.value("n", 1), max_tokens = b.value("max_tokens", 1);
      if (b.value("stream", false)) {
        // SSE: a role-only event, then (after first_token_ms_) one token event per choice per
        // step, 20 ms apart, then usage and [DONE].
        res.set_chunked_content_provider(
            "text/event-stream", [this, n, max_tokens](size_t, httplib::DataSink& sink) {
              auto send = [&](const std::string& ev) { return sink.write(ev.data(), ev.size()); };
              send("data: {\"choices\":[]}\n\n");
              std::this_thread::sleep_for(std::chrono::milliseconds(first_token_ms_));
              for (int t = 0; t < max_tokens && !empty_stream_; ++t) {
                if (t > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
                for (int c = 0; c < n; ++c) {
                  send("data: {\"choices\":[{\"index\":" + std::to_string(c) +
                       ",\"text\":\"x\"}]}\n\n");
                }
              }
              send(
                  "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,"
                  "\"completion_tokens\":" +
                  std::to_string(empty_stream_ ? 0 : n * max_tokens) + "}}\n\n");
              send("data: [DONE]\n\n");
              sink.done();
              return true;
            });
        return;
      }
      json out = {{"choices", json::array()},
                  {"usage",
                   {{"prompt_tokens", 100},
                    {"completion_tokens", n * max_tokens},
                    {"prompt_tokens_details", {{"cached_tokens", 25}}}}}};
      res.set_content(out.dump(), "application/json");
    });
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      // Blocks stay active for drain_ms_ after the last response, then drain (unless stuck).
      int active = 0;
      if (Clock::now() - last_response_.load() < std::chrono::milliseconds(drain_ms_)) {
        active = active_;
      }
      std::string text = "# TYPE kvbridge_kv_blocks_active gauge\n";
      text += "kvbridge_kv_blocks_active " + std::to_string(active) + "\n";
      text += "kvbridge_kv_blocks_held_for_transfer " + std::to_string(stuck_held_) + "\n";
      text += "kvbridge_kv_lease_expired_total " + std::to_string(lease_expired_) + "\n";
      text += "kvbridge_kv_notifications_ignored_total 0\n";
      res.set_content(text, "text/plain");
    });
    server_.Get("/instances", [this](const httplib::Request&, httplib::Response& res) {
      json j = {{"instances", {{{"role", "decode"}, {"url", url()}}}}};
      res.set_content(j.dump(), "application/json");
    });
    server_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"data":[{"id":"fake-model"}]})", "application/json");
    });
    EXPECT_TRUE(server_.bind_to_port("127.0.0.1", port_));
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    // stop() before the loop runs would be lost and leave the thread in accept() forever.
    for (int i = 0; i < 500 && !server_.is_running(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  ~FakeServer() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::vector<json> Bodies() {
    std::lock_guard<std::mutex> lock(mu_);
    return bodies_;
  }

  std::atomic<int> fail_status_{0};
  std::atomic<int> drain_ms_{200};
  std::atomic<int> stuck_held_{0};
  std::atomic<int> lease_expired_{0};
  std::atomic<int> first_token_ms_{150};
  std::atomic<bool> empty_stream_{false};

 private:
  int port_;
  httplib::Server server_;
  std::thread thread_;
  std::mutex mu_;
  std::vector<json> bodies_;
  std::atomic<int> active_{0};
  std::atomic<Clock::time_point> last_response_{Clock::now() - std::chrono::hours(1)};
};

BenchOptions Options(const FakeServer& s) {
  BenchOptions o;
  o.host = s.url();
  o.samples = 6;
  o.batches = {1, 3};
  o.input_tokens = 500;
  o.output_tokens = 20;
  o.best_of_n = 8;
  o.check_drain = true;
  o.drain_timeout_s = 2;
  o.synthetic_prompts = 4;
  return o;
}

TEST(BenchAgainstFake, ReportsFiguresAndDrain) {
  FakeServer s;
  int progress_lines = 0;
  auto r = RunBench(Options(s), [&](const std::string&) { ++progress_lines; });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->ok) << FormatTable(*r);
  ASSERT_EQ(r->batches.size(), 2u);
  EXPECT_GE(progress_lines, 2);
  double out_tokens = 0;
  auto bodies = s.Bodies();
  ASSERT_EQ(bodies.size(), 12u);
  for (const json& b : bodies) {
    EXPECT_EQ(b["n"], 8);
    EXPECT_EQ(b["model"], "fake-model");
    EXPECT_GE(b["max_tokens"].get<int>(), 10);
    EXPECT_LE(b["max_tokens"].get<int>(), 30);
    EXPECT_GE(b["truncate_prompt_tokens"].get<int>(), 400);
    EXPECT_LE(b["truncate_prompt_tokens"].get<int>(), 600);
    EXPECT_EQ(b["prompt"].get<std::string>().rfind("Request ", 0), 0u);
  }
  for (size_t i = 0; i < 6; ++i) out_tokens += 8 * bodies[i]["max_tokens"].get<int>();
  const BatchReport& b1 = r->batches[0];
  EXPECT_EQ(b1.concurrency, 1);
  EXPECT_EQ(b1.requests, 6);
  EXPECT_EQ(b1.errors, 0);
  EXPECT_DOUBLE_EQ(b1.mean_input_tokens, 100);
  EXPECT_DOUBLE_EQ(b1.mean_output_tokens, out_tokens / 6);  // batch 1 runs in order (c=1)
  EXPECT_DOUBLE_EQ(b1.cache_hit_rate, 0.25);
  EXPECT_GT(b1.latency_p95_s, 0);
  EXPECT_LE(b1.latency_p50_s, b1.latency_p95_s);
  ASSERT_EQ(b1.drains.size(), 1u);
  EXPECT_TRUE(b1.drains[0].drained);
  EXPECT_GE(b1.drains[0].drain_s, 0.15);  // the fake drains 200 ms after its last response
  EXPECT_LT(b1.drains[0].drain_s, 2.0);
  EXPECT_EQ(b1.drains[0].lease_expired, 0);
  json j = json::parse(ReportJson(*r));
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["batches"][1]["concurrency"], 3);
}

TEST(BenchAgainstFake, StuckHoldFailsTheDrain) {
  FakeServer s;
  s.stuck_held_ = 3;
  BenchOptions o = Options(s);
  o.batches = {2};
  o.drain_timeout_s = 0.3;
  auto r = RunBench(o, {});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->ok);
  ASSERT_EQ(r->batches[0].drains.size(), 1u);
  EXPECT_FALSE(r->batches[0].drains[0].drained);
  EXPECT_EQ(r->batches[0].drains[0].blocks_held, 3);
  EXPECT_NE(FormatTable(*r).find("NOT DRAINED"), std::string::npos);
}

TEST(BenchAgainstFake, ExpiredLeaseFailsARunThatDrained) {
  FakeServer s;
  s.lease_expired_ = 1;
  BenchOptions o = Options(s);
  o.batches = {1};
  auto r = RunBench(o, {});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->batches[0].drains[0].drained);
  EXPECT_FALSE(r->ok);
}

TEST(BenchAgainstFake, RequestErrorsCountedWithTheirBody) {
  FakeServer s;
  s.fail_status_ = 400;
  BenchOptions o = Options(s);
  o.batches = {2};
  o.check_drain = false;
  auto r = RunBench(o, {});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->ok);
  EXPECT_EQ(r->batches[0].errors, 6);
  ASSERT_FALSE(r->batches[0].error_samples.empty());
  EXPECT_EQ(r->batches[0].error_samples[0], R"(HTTP 400: {"error":"nope"})");
}

TEST(BenchAgainstFake, StreamingReportsTtftAndTpot) {
  FakeServer s;
  BenchOptions o = Options(s);
  o.batches = {2};
  o.samples = 4;
  o.best_of_n = 2;
  o.output_tokens = 15;  // jittered ±10: 5..25 tokens per choice
  o.stream = true;
  o.check_drain = false;
  auto r = RunBench(o, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->ok) << FormatTable(*r);
  const BatchReport& b = r->batches[0];
  EXPECT_EQ(b.errors, 0);
  EXPECT_EQ(b.ttft_count, 4);  // every request: the first token comes after the role event
  EXPECT_GE(b.ttft_p50_s, 0.15);
  EXPECT_LT(b.ttft_p50_s, b.latency_p50_s);
  // Every request has more than one token per choice (max_tokens 5..25), each step >= 20 ms.
  EXPECT_EQ(b.tpot_count, 4);
  EXPECT_GE(b.tpot_p50_s, 0.019);
  for (const json& body : s.Bodies()) {
    EXPECT_EQ(body["stream"], true);
    EXPECT_EQ(body["stream_options"], json({{"include_usage", true}}));
  }
  EXPECT_NE(FormatTable(*r).find("ttft_p50_ms"), std::string::npos);
  json j = json::parse(ReportJson(*r));
  EXPECT_EQ(j["batches"][0]["ttft_s"]["count"], 4);
}

TEST(BenchAgainstFake, StreamWithoutATokenIsAnError) {
  FakeServer s;
  s.empty_stream_ = true;
  s.first_token_ms_ = 0;
  BenchOptions o = Options(s);
  o.batches = {1};
  o.samples = 2;
  o.stream = true;
  o.check_drain = false;
  auto r = RunBench(o, {});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->ok);
  EXPECT_EQ(r->batches[0].errors, 2);
  ASSERT_FALSE(r->batches[0].error_samples.empty());
  EXPECT_EQ(r->batches[0].error_samples[0].rfind("stream without a token", 0), 0u)
      << r->batches[0].error_samples[0];
}

TEST(BenchAgainstFake, CommandExitCodes) {
  std::string bin = testing::KvbridgeBin();
  if (::access(bin.c_str(), X_OK) != 0) GTEST_SKIP() << "kvbridge binary not built at " << bin;
  FakeServer s;
  std::string dir = testing::MakeTempDir("kvb-bench-");
  testing::Subprocess ok({bin, "bench", "--host", s.url(), "--samples", "3", "--batches", "1,2",
                          "--check-drain", "--drain-timeout", "2", "--json"},
                         dir + "/ok.log");
  EXPECT_EQ(ok.Wait(60'000), 0) << ok.ReadLog();
  EXPECT_NE(ok.ReadLog().find("\"ok\": true"), std::string::npos) << ok.ReadLog();
  s.fail_status_ = 500;
  testing::Subprocess bad({bin, "bench", "--host", s.url(), "--samples", "2", "--batches", "1"},
                          dir + "/bad.log");
  EXPECT_EQ(bad.Wait(60'000), 1) << bad.ReadLog();
  testing::Subprocess usage({bin, "bench", "--host", s.url(), "--batches", "0"},
                            dir + "/usage.log");
  EXPECT_EQ(usage.Wait(60'000), 2) << usage.ReadLog();
}

}  // namespace
}  // namespace kvbridge::bench
