// `kvbridge bench --overload X` (bench.h): capacity probe, then X times that rate, open loop.
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench/bench_internal.h"
#include "kvbridge/bench/bench.h"
#include "kvbridge/common/metrics.h"

namespace kvbridge::bench {
namespace {

using internal::HostPort;
using internal::MakeClient;
using internal::ParseHost;
using internal::Seconds;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

// One answer, classified.
enum class Kind { kOk, k429, k503, kError };
struct Answer {
  Kind kind = Kind::kError;
  bool retry_after = false;
  double latency_s = 0;
  std::string error;
};

Answer Send(httplib::Client& client, const std::string& path, const std::string& body) {
  Answer a;
  const auto t0 = Clock::now();
  auto res = client.Post(path.c_str(), body, "application/json");
  a.latency_s = Seconds(Clock::now() - t0);
  if (!res) {
    a.error = "no answer (httplib: " + httplib::to_string(res.error()) + ")";
    return a;
  }
  a.retry_after = !res->get_header_value("Retry-After").empty();
  if (res->status == 200) {
    json j = json::parse(res->body, nullptr, false);
    if (j.is_object() && j.contains("choices")) {
      a.kind = Kind::kOk;
    } else {
      a.error = "HTTP 200 without choices: " + res->body.substr(0, 200);
    }
  } else if (res->status == 429) {
    a.kind = Kind::k429;
  } else if (res->status == 503) {
    a.kind = Kind::k503;
  } else {
    a.error = "HTTP " + std::to_string(res->status) + ": " + res->body.substr(0, 200);
  }
  return a;
}

// Samples every watched /metrics every 200 ms until stopped, keeping the peaks.
class Watcher {
 public:
  explicit Watcher(std::vector<InstanceSample>* instances) : instances_(instances) {}
  // One sample of every instance now; `first` sets rss_before, `last` rss_after.
  void SampleOnce(bool first, bool last) {
    for (InstanceSample& s : *instances_) {
      auto hp = ParseHost(s.url);
      if (!hp.ok()) continue;
      auto c = MakeClient(*hp, 2);
      auto res = c->Get("/metrics");
      if (!res || res->status != 200) continue;
      std::lock_guard<std::mutex> lock(mu_);
      const double rss = ScrapeMetric(res->body, "process_resident_memory_bytes");
      if (first) s.rss_before_bytes = rss;
      if (last) s.rss_after_bytes = rss;
      s.rss_peak_bytes = std::max(s.rss_peak_bytes, rss);
      s.waiting_peak =
          std::max(s.waiting_peak, ScrapeMetric(res->body, "kvbridge_requests_waiting"));
      s.in_flight_peak =
          std::max(s.in_flight_peak, ScrapeMetric(res->body, "kvbridge_proxy_requests_in_flight"));
    }
  }
  void Start() {
    thread_ = std::thread([this] {
      while (!stop_) {
        SampleOnce(false, false);
        for (int i = 0; i < 20 && !stop_; ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
  }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::vector<InstanceSample>* instances_;
  std::mutex mu_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

Result<OverloadReport> RunOverload(const OverloadOptions& o,
                                   const std::function<void(const std::string&)>& progress) {
  if (!(o.factor > 0) || !(o.seconds > 0)) {
    return InvalidArgumentError("--overload and --overload-seconds must be > 0");
  }
  if (o.probe_concurrency < 1 || o.clients < 1 || o.output_tokens < 1) {
    return InvalidArgumentError("--probe-concurrency, --overload-clients, --output-tokens >= 1");
  }
  ASSIGN_OR_RETURN(HostPort hp, ParseHost(o.host));
  // A proxy lists its instances; an engine alone (no /instances) is watched and drained itself.
  Result<std::vector<std::string>> listed = internal::InstanceUrls(o.host);
  const bool proxy = listed.ok();
  const std::vector<std::string> urls = proxy ? *listed : std::vector<std::string>{o.host};
  std::string model = o.model;
  if (model.empty()) {
    auto c = MakeClient(hp, 10);
    auto res = c->Get("/v1/models");
    json j = res && res->status == 200 ? json::parse(res->body, nullptr, false) : json();
    if (j.is_object() && j["data"].is_array() && !j["data"].empty() &&
        j["data"][0]["id"].is_string()) {
      model = j["data"][0]["id"];
    }
  }
  const std::vector<std::string> prompts = MakeSyntheticPrompts(64, o.seed);
  auto body_of = [&](size_t i) {
    json b = {{"prompt", prompts[i % prompts.size()]}, {"max_tokens", o.output_tokens}};
    if (!model.empty()) b["model"] = model;
    if (o.input_tokens > 0) b["truncate_prompt_tokens"] = o.input_tokens;
    return b.dump();
  };

  OverloadReport r;
  if (proxy) {
    InstanceSample s;
    s.url = o.host;
    s.role = "proxy";
    r.instances.push_back(s);
  }
  {
    auto c = MakeClient(hp, 10);
    auto res = c->Get("/instances");
    json j = res && res->status == 200 ? json::parse(res->body, nullptr, false) : json();
    for (const std::string& u : urls) {
      InstanceSample s;
      s.url = u;
      s.role = proxy ? "" : "engine";
      if (j.is_object() && j["instances"].is_array()) {
        for (const auto& i : j["instances"]) {
          if (i.value("url", "") == u) s.role = i.value("role", "");
        }
      }
      r.instances.push_back(s);
    }
  }
  Watcher watch(&r.instances);
  watch.SampleOnce(/*first=*/true, /*last=*/false);

  // 1. Capacity: a closed loop.
  if (o.capacity_rps > 0) {
    r.capacity_rps = o.capacity_rps;
  } else {
    std::atomic<int> ok{0}, errors{0};
    std::atomic<size_t> next{0};
    std::mutex first_error_mu;
    std::string first_error;
    const auto t0 = Clock::now();
    const auto until = t0 + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(o.probe_seconds));
    std::vector<std::thread> probe;
    for (int w = 0; w < o.probe_concurrency; ++w) {
      probe.emplace_back([&] {
        auto c = MakeClient(hp, o.request_timeout_s);
        while (Clock::now() < until) {
          Answer a = Send(*c, o.path, body_of(next++));
          (a.kind == Kind::kOk ? ok : errors)++;
          if (a.kind != Kind::kOk) {
            std::lock_guard<std::mutex> lock(first_error_mu);
            if (first_error.empty()) {
              first_error = a.error.empty() ? "a refusal (429/503)" : a.error;
            }
          }
        }
      });
    }
    for (auto& t : probe) t.join();
    const double el = Seconds(Clock::now() - t0);
    r.probe_requests = ok + errors;
    r.probe_errors = errors;
    r.capacity_rps = el > 0 ? ok / el : 0;
    if (ok == 0) {
      return UnavailableError("the capacity probe got no 200 from " + o.host +
                              "; first answer: " + first_error);
    }
  }
  r.offered_rps = o.factor * r.capacity_rps;
  if (progress) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "overload: capacity %.2f req/s; offering %.2f req/s for %.0f s",
                  r.capacity_rps, r.offered_rps, o.seconds);
    progress(buf);
  }

  // 2. The overload: arrival i at t0 + i / offered_rps, each taken by the next free client.
  const int total = std::max(1, static_cast<int>(r.offered_rps * o.seconds));
  std::vector<Answer> answers(static_cast<size_t>(total));
  std::atomic<int> next{0}, late{0};
  Clock::time_point last_send{};  // written by the client that sends the last arrival
  watch.Start();
  const auto t0 = Clock::now() + std::chrono::milliseconds(50);
  std::vector<std::thread> clients;
  const int n_clients = std::min(o.clients, total);
  for (int w = 0; w < n_clients; ++w) {
    clients.emplace_back([&] {
      auto c = MakeClient(hp, o.request_timeout_s);
      for (;;) {
        const int i = next++;
        if (i >= total) return;
        const auto at = t0 + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(i / r.offered_rps));
        std::this_thread::sleep_until(at);
        const auto sent_at = Clock::now();
        if (sent_at - at > std::chrono::milliseconds(50)) ++late;
        if (i == total - 1) last_send = sent_at;
        answers[static_cast<size_t>(i)] = Send(*c, o.path, body_of(static_cast<size_t>(i)));
      }
    });
  }
  for (auto& t : clients) t.join();
  const auto t_end = Clock::now();
  r.duration_s = Seconds(t_end - t0);
  r.sent = total;
  r.late = late;
  const double send_window = Seconds(last_send - t0);
  r.sent_rps = send_window > 0 ? (total - 1) / send_window : 0;
  std::vector<double> accepted, refused;
  for (const Answer& a : answers) {
    switch (a.kind) {
      case Kind::kOk:
        ++r.ok;
        accepted.push_back(a.latency_s);
        break;
      case Kind::k429:
      case Kind::k503:
        ++(a.kind == Kind::k429 ? r.rejected_429 : r.rejected_503);
        if (!a.retry_after) ++r.missing_retry_after;
        refused.push_back(a.latency_s);
        break;
      case Kind::kError:
        ++r.errors;
        if (r.error_samples.size() < 5) r.error_samples.push_back(a.error);
        break;
    }
  }
  r.goodput_rps = r.duration_s > 0 ? r.ok / r.duration_s : 0;
  r.accepted_p50_s = Percentile(accepted, 0.5);
  r.accepted_p99_s = Percentile(accepted, 0.99);
  r.rejected_p99_s = Percentile(refused, 0.99);

  // 3. The drain.
  r.drains = internal::CheckDrain(urls, t_end, o.drain_timeout_s);
  watch.Stop();
  watch.SampleOnce(/*first=*/false, /*last=*/true);
  // The proxy ends a flow just after its answer: a moment for the last ones (bounded, 2 s).
  for (int i = 0; proxy && i < 40; ++i) {
    auto c = MakeClient(hp, 5);
    auto res = c->Get("/metrics");
    if (res && res->status == 200) {
      r.proxy_in_flight_after = ScrapeMetric(res->body, "kvbridge_proxy_requests_in_flight");
    }
    if (r.proxy_in_flight_after == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!proxy) r.proxy_in_flight_after = 0;  // no proxy in front: nothing to hold
  bool drained = true;
  for (const DrainReport& d : r.drains) drained = drained && d.drained && d.error.empty();
  r.ok_all = r.rejected_429 + r.rejected_503 > 0 && r.missing_retry_after == 0 && r.errors == 0 &&
             drained && r.proxy_in_flight_after == 0;
  return r;
}

std::string FormatOverload(const OverloadReport& r) {
  std::string out;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "capacity %.2f req/s (probe: %d requests, %d errors); offered %.2f req/s "
                "(x%.1f) for %.2f s\n",
                r.capacity_rps, r.probe_requests, r.probe_errors, r.offered_rps,
                r.capacity_rps > 0 ? r.offered_rps / r.capacity_rps : 0, r.duration_s);
  out += buf;
  std::snprintf(buf, sizeof(buf),
                "sent %d at %.2f req/s (%.1fx capacity): 200 %d, 429 %d, 503 %d (without "
                "Retry-After: %d), errors %d, late sends %d\n",
                r.sent, r.sent_rps, r.capacity_rps > 0 ? r.sent_rps / r.capacity_rps : 0, r.ok,
                r.rejected_429, r.rejected_503, r.missing_retry_after, r.errors, r.late);
  out += buf;
  std::snprintf(buf, sizeof(buf),
                "goodput %.2f req/s (%.2fx capacity); accepted latency p50 %.3f s p99 %.3f s; "
                "refusal p99 %.1f ms\n",
                r.goodput_rps, r.capacity_rps > 0 ? r.goodput_rps / r.capacity_rps : 0,
                r.accepted_p50_s, r.accepted_p99_s, 1e3 * r.rejected_p99_s);
  out += buf;
  for (const InstanceSample& s : r.instances) {
    std::snprintf(buf, sizeof(buf),
                  "  %-8s %s: RSS MiB before %.1f peak %.1f after %.1f; peak waiting %g, peak in "
                  "flight %g\n",
                  s.role.c_str(), s.url.c_str(), s.rss_before_bytes / 1048576.0,
                  s.rss_peak_bytes / 1048576.0, s.rss_after_bytes / 1048576.0, s.waiting_peak,
                  s.in_flight_peak);
    out += buf;
  }
  for (const DrainReport& d : r.drains) {
    std::snprintf(buf, sizeof(buf), "  drain %s: %s in %.3f s%s%s\n", d.url.c_str(),
                  d.drained ? "drained" : "NOT DRAINED", d.drain_s, d.error.empty() ? "" : " — ",
                  d.error.c_str());
    out += buf;
  }
  std::snprintf(buf, sizeof(buf), "  proxy requests in flight after: %g\n",
                r.proxy_in_flight_after);
  out += buf;
  for (const std::string& e : r.error_samples) out += "  error: " + e + "\n";
  out += r.ok_all ? "result: OK\n" : "result: FAILED\n";
  return out;
}

std::string OverloadJson(const OverloadReport& r) {
  json inst = json::array();
  for (const InstanceSample& s : r.instances) {
    inst.push_back({{"url", s.url},
                    {"role", s.role},
                    {"rss_before_bytes", s.rss_before_bytes},
                    {"rss_peak_bytes", s.rss_peak_bytes},
                    {"rss_after_bytes", s.rss_after_bytes},
                    {"waiting_peak", s.waiting_peak},
                    {"in_flight_peak", s.in_flight_peak}});
  }
  json drains = json::array();
  for (const DrainReport& d : r.drains) drains.push_back(internal::DrainJson(d));
  return json{{"ok", r.ok_all},
              {"capacity_rps", r.capacity_rps},
              {"offered_rps", r.offered_rps},
              {"duration_s", r.duration_s},
              {"sent", r.sent},
              {"sent_rps", r.sent_rps},
              {"ok_200", r.ok},
              {"rejected_429", r.rejected_429},
              {"rejected_503", r.rejected_503},
              {"missing_retry_after", r.missing_retry_after},
              {"errors", r.errors},
              {"late", r.late},
              {"goodput_rps", r.goodput_rps},
              {"accepted_p50_s", r.accepted_p50_s},
              {"accepted_p99_s", r.accepted_p99_s},
              {"instances", inst},
              {"drains", drains},
              {"proxy_in_flight_after", r.proxy_in_flight_after},
              {"error_samples", r.error_samples}}
      .dump(2);
}

}  // namespace kvbridge::bench
