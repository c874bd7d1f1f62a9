// The vllm:* families: names, types, labels and bucket bounds as vLLM v1 exports them
// (vllm/v1/metrics/loggers.py), cumulative monotone histograms, and exact values after a known
// sequence of requests driven through the scheduler with synthetic logits and explicit times.
#include "kvbridge/engine/vllm_metrics.h"

#include <gtest/gtest.h>

#include <map>
#include <sstream>

#include "kvbridge/engine/scheduler.h"

namespace kvbridge {
namespace {

// One histogram's series of a rendered registry: le bounds (as written) and cumulative counts.
struct Hist {
  std::vector<std::string> le;
  std::vector<double> counts;
  double sum = -1;
  double count = -1;
};

// Parses every sample line "name{labels} value"; returns name -> labels -> value.
std::map<std::string, std::map<std::string, double>> Samples(const std::string& text) {
  std::map<std::string, std::map<std::string, double>> out;
  std::istringstream is(text);
  std::string line;
  while (std::getline(is, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    const std::string key = line.substr(0, sp);
    const size_t brace = key.find('{');
    const std::string name = key.substr(0, brace);
    const std::string labels =
        brace == std::string::npos ? "" : key.substr(brace + 1, key.size() - brace - 2);
    out[name][labels] = std::stod(line.substr(sp + 1));
  }
  return out;
}

std::map<std::string, std::string> Types(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream is(text);
  std::string line;
  while (std::getline(is, line)) {
    if (line.rfind("# TYPE ", 0) != 0) continue;
    std::istringstream ls(line.substr(7));
    std::string name, type;
    ls >> name >> type;
    out[name] = type;
  }
  return out;
}

// The series of histogram `name` (in bound order, as rendered).
Hist ReadHist(const std::string& text, const std::string& name) {
  Hist h;
  std::istringstream is(text);
  std::string line;
  const std::string bucket = name + "_bucket{";
  while (std::getline(is, line)) {
    if (line.rfind(bucket, 0) == 0) {
      const size_t le = line.find("le=\"");
      const size_t end = line.find('"', le + 4);
      h.le.push_back(line.substr(le + 4, end - le - 4));
      h.counts.push_back(std::stod(line.substr(line.rfind(' ') + 1)));
    } else if (line.rfind(name + "_sum{", 0) == 0) {
      h.sum = std::stod(line.substr(line.rfind(' ') + 1));
    } else if (line.rfind(name + "_count{", 0) == 0) {
      h.count = std::stod(line.substr(line.rfind(' ') + 1));
    }
  }
  return h;
}

// `b` as the registry renders bounds, +Inf appended.
std::vector<std::string> Bounds(const std::vector<double>& b) {
  std::vector<std::string> out;
  MetricsRegistry r;
  r.AddHistogram("x", "x", b);
  for (const std::string& le : ReadHist(r.Render(), "x").le) out.push_back(le);
  return out;
}

constexpr const char* kLabels = "model_name=\"org/m\\\"1\",engine=\"0\"";

TEST(VllmMetrics, FamiliesHaveVllmNamesTypesLabelsAndBuckets) {
  MetricsRegistry reg;
  VllmMetrics v(&reg, "org/m\"1", 64);
  const std::string text = reg.Render();
  const std::map<std::string, std::string> want = {
      {"vllm:num_requests_running", "gauge"},
      {"vllm:num_requests_waiting", "gauge"},
      {"vllm:kv_cache_usage_perc", "gauge"},
      {"vllm:prefix_cache_queries_total", "counter"},
      {"vllm:prefix_cache_hits_total", "counter"},
      {"vllm:prompt_tokens_total", "counter"},
      {"vllm:generation_tokens_total", "counter"},
      {"vllm:num_preemptions_total", "counter"},
      {"vllm:request_success_total", "counter"},
      {"vllm:time_to_first_token_seconds", "histogram"},
      {"vllm:inter_token_latency_seconds", "histogram"},
      {"vllm:time_per_output_token_seconds", "histogram"},
      {"vllm:e2e_request_latency_seconds", "histogram"},
      {"vllm:request_queue_time_seconds", "histogram"},
      {"vllm:request_inference_time_seconds", "histogram"},
      {"vllm:request_prefill_time_seconds", "histogram"},
      {"vllm:request_decode_time_seconds", "histogram"},
      {"vllm:request_prompt_tokens", "histogram"},
      {"vllm:request_generation_tokens", "histogram"},
  };
  EXPECT_EQ(Types(text), want);
  // Every sample carries both labels (the value escaped); request_success_total has every
  // finish reason from the start.
  for (const auto& [name, series] : Samples(text)) {
    for (const auto& [labels, value] : series) {
      EXPECT_NE(labels.find(kLabels), std::string::npos) << name << "{" << labels << "}";
    }
  }
  const auto s = Samples(text);
  for (const char* r : {"stop", "length", "abort", "error", "repetition"}) {
    EXPECT_EQ(s.at("vllm:request_success_total")
                  .count(std::string(kLabels) + ",finished_reason=\"" + r + "\""),
              1u)
        << r;
  }
  // vLLM's bounds (loggers.py), +Inf last.
  EXPECT_EQ(ReadHist(text, "vllm:time_to_first_token_seconds").le,
            (Bounds({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
                     1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0})));
  const std::vector<std::string> itl =
      (Bounds({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0}));
  EXPECT_EQ(ReadHist(text, "vllm:inter_token_latency_seconds").le, itl);
  EXPECT_EQ(ReadHist(text, "vllm:time_per_output_token_seconds").le, itl);
  const std::vector<std::string> req =
      (Bounds({0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}));
  for (const char* n : {"vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                        "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                        "vllm:request_decode_time_seconds"}) {
    EXPECT_EQ(ReadHist(text, n).le, req) << n;
  }
  // build_1_2_5_buckets(64) = [1, 2, 5, 10, 20, 50].
  const std::vector<std::string> tokens = {"1", "2", "5", "10", "20", "50", "+Inf"};
  EXPECT_EQ(ReadHist(text, "vllm:request_prompt_tokens").le, tokens);
  EXPECT_EQ(ReadHist(text, "vllm:request_generation_tokens").le, tokens);
  EXPECT_EQ(VllmMetrics::TokenCountBuckets(1000),
            (std::vector<double>{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000}));
}

constexpr TimePoint kBase = 10 * kSecond;
TimePoint At(double seconds) { return kBase + static_cast<TimePoint>(seconds * kSecond); }

// Greedy logits favouring token 3 (never EOS) in every row.
std::vector<float> Favour3(const ScheduledBatch& b) {
  std::vector<float> l(static_cast<size_t>(b.num_logit_rows) * 8, 0.0f);
  for (int r = 0; r < b.num_logit_rows; ++r) l[static_cast<size_t>(r) * 8 + 3] = 5.0f;
  return l;
}

EngineRequest Req(std::string id, int len, int max_tokens, int n) {
  EngineRequest r;
  r.request_id = std::move(id);
  for (int i = 0; i < len; ++i) r.prompt_token_ids.push_back(i % 7);
  r.sampling.max_tokens = max_tokens;
  r.sampling.n = n;
  r.sampling.temperature = 0;
  return r;
}

// a: 8 prompt tokens, 3 output; b: 4 prompt tokens, n = 2 siblings of 2 output tokens. Both
// arrive at 0 s, are scheduled at 0.5 s, get their first token at 1.0 s; b's siblings finish at
// 1.25 s, a at 1.75 s (its tokens 0.25 s and 0.5 s apart).
TEST(VllmMetrics, ValuesAfterAKnownSequenceOfRequests) {
  auto pool = std::move(BlockPool::Create({.num_blocks = 32, .block_size = 4})).value();
  SchedulerConfig c;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 64;
  c.vocab_size = 8;
  c.eos_token_ids = {7};
  c.model_fingerprint = "fp";
  c.served_model_name = "org/m\"1";
  MetricsRegistry reg;
  Scheduler sched(c, pool.get(), nullptr, &reg);
  ASSERT_TRUE(sched.AddRequest(Req("a", 8, 3, 1), At(0)).ok());
  ASSERT_TRUE(sched.AddRequest(Req("b", 4, 2, 2), At(0)).ok());
  for (double t : {0.5, 1.0, 1.25}) {
    ScheduledBatch b = sched.Schedule(At(t));
    ASSERT_FALSE(b.empty());
    const double done = t == 0.5 ? 1.0 : t == 1.0 ? 1.25 : 1.75;
    ASSERT_TRUE(sched.UpdateFromOutput(b, Favour3(b), At(done)).ok());
  }
  std::vector<RequestOutput> outs = sched.TakeOutputs();
  EXPECT_FALSE(sched.HasUnfinished());
  // The final outputs carry the group's times.
  for (const RequestOutput& o : outs) {
    if (!o.finished) continue;
    EXPECT_EQ(o.times.arrival, At(0));
    EXPECT_EQ(o.times.scheduled, At(0.5));
    EXPECT_EQ(o.times.first_token, At(1.0));
    EXPECT_EQ(o.times.finished, o.request_id == "a" ? At(1.75) : At(1.25));
  }

  const std::string text = reg.Render();
  const auto s = Samples(text);
  const std::string l = kLabels;
  auto value = [&](const std::string& name, const std::string& extra = "") {
    return s.at(name).at(extra.empty() ? l : l + "," + extra);
  };
  EXPECT_EQ(value("vllm:request_success_total", "finished_reason=\"length\""), 3);
  EXPECT_EQ(value("vllm:request_success_total", "finished_reason=\"stop\""), 0);
  EXPECT_EQ(value("vllm:generation_tokens_total"), 3 + 2 + 2);
  EXPECT_EQ(value("vllm:prompt_tokens_total"), 8 + 4);
  EXPECT_EQ(value("vllm:prefix_cache_queries_total"), 8 + 4);
  EXPECT_EQ(value("vllm:prefix_cache_hits_total"), 0);
  // The kvbridge_* twins agree where they count the same thing.
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_generation_tokens_total"), 7);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_prompt_tokens_total"), 12);

  struct Want {
    const char* name;
    double count, sum;
    std::vector<std::pair<std::string, double>> buckets;  // le -> cumulative count
  };
  const std::vector<Want> wants = {
      {"vllm:time_to_first_token_seconds", 3, 3.0, {{"0.75", 0}, {"1", 3}}},
      {"vllm:inter_token_latency_seconds", 4, 0.25 * 3 + 0.5, {{"0.2", 0}, {"0.3", 3}, {"0.5", 4}}},
      {"vllm:time_per_output_token_seconds", 4, 1.25, {{"0.3", 3}, {"0.5", 4}}},
      {"vllm:e2e_request_latency_seconds", 3, 1.75 + 1.25 * 2, {{"1", 0}, {"1.5", 2}, {"2", 3}}},
      {"vllm:request_queue_time_seconds", 3, 1.5, {{"0.3", 0}, {"0.5", 3}}},
      {"vllm:request_prefill_time_seconds", 3, 1.5, {{"0.5", 3}}},
      {"vllm:request_decode_time_seconds", 3, 0.75 + 0.25 * 2, {{"0.3", 2}, {"0.8", 3}}},
      {"vllm:request_inference_time_seconds", 3, 1.25 + 0.75 * 2, {{"0.8", 2}, {"1.5", 3}}},
      {"vllm:request_prompt_tokens", 3, 8 + 4 * 2, {{"2", 0}, {"5", 2}, {"10", 3}}},
      {"vllm:request_generation_tokens", 3, 3 + 2 * 2, {{"1", 0}, {"2", 2}, {"5", 3}}},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(w.name);
    const Hist h = ReadHist(text, w.name);
    EXPECT_EQ(h.count, w.count);
    EXPECT_DOUBLE_EQ(h.sum, w.sum);
    ASSERT_FALSE(h.counts.empty());
    // Cumulative and monotone, +Inf = _count.
    for (size_t i = 1; i < h.counts.size(); ++i) EXPECT_GE(h.counts[i], h.counts[i - 1]);
    EXPECT_EQ(h.le.back(), "+Inf");
    EXPECT_EQ(h.counts.back(), h.count);
    for (const auto& [le, want] : w.buckets) {
      auto it = std::find(h.le.begin(), h.le.end(), le);
      ASSERT_NE(it, h.le.end()) << le;
      EXPECT_EQ(h.counts[static_cast<size_t>(it - h.le.begin())], want) << "le=" << le;
    }
  }
}

TEST(VllmMetrics, AbortWhileWaitingCountsTheReasonButNoPhases) {
  auto pool = std::move(BlockPool::Create({.num_blocks = 32, .block_size = 4})).value();
  SchedulerConfig c;
  c.max_model_len = 64;
  c.vocab_size = 8;
  c.model_fingerprint = "fp";
  c.served_model_name = "org/m\"1";
  MetricsRegistry reg;
  Scheduler sched(c, pool.get(), nullptr, &reg);
  ASSERT_TRUE(sched.AddRequest(Req("a", 8, 3, 1), At(0)).ok());
  EXPECT_TRUE(sched.Abort("a", At(0.1)));
  const std::string text = reg.Render();
  EXPECT_EQ(ScrapeMetric(text, "vllm:request_success_total", "finished_reason=\"abort\""), 1);
  EXPECT_EQ(ScrapeMetric(text, "vllm:e2e_request_latency_seconds_count"), 0);
  EXPECT_EQ(ScrapeMetric(text, "vllm:time_to_first_token_seconds_count"), 0);
}

}  // namespace
}  // namespace kvbridge
