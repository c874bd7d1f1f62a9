#include "kvbridge/bench/bench.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "bench/bench_internal.h"
#include "kvbridge/common/metrics.h"

namespace kvbridge::bench {

namespace internal {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

Result<HostPort> ParseHost(std::string url) {
  if (url.rfind("http://", 0) == 0) url = url.substr(7);
  auto slash = url.find('/');
  if (slash != std::string::npos) url = url.substr(0, slash);
  auto colon = url.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return InvalidArgumentError("URL must look like http://HOST:PORT, got '" + url + "'");
  }
  int port = std::atoi(url.c_str() + colon + 1);
  if (port <= 0 || port > 65535) return InvalidArgumentError("bad port in '" + url + "'");
  return HostPort{url.substr(0, colon), port};
}

std::unique_ptr<httplib::Client> MakeClient(const HostPort& hp, double timeout_s) {
  auto c = std::make_unique<httplib::Client>(hp.host, hp.port);
  auto sec = static_cast<time_t>(timeout_s);
  auto usec = static_cast<time_t>((timeout_s - static_cast<double>(sec)) * 1e6);
  c->set_connection_timeout(5, 0);
  c->set_read_timeout(sec, usec);
  c->set_write_timeout(sec, usec);
  c->set_keep_alive(true);
  c->set_tcp_nodelay(true);  // headers and body go in separate writes: no Nagle stall
  return c;
}

Result<std::vector<std::string>> InstanceUrls(const std::string& host) {
  ASSIGN_OR_RETURN(HostPort hp, ParseHost(host));
  auto c = MakeClient(hp, 10);
  auto res = c->Get("/instances");
  if (!res)
    return UnavailableError("GET " + host + "/instances: " + httplib::to_string(res.error()));
  if (res->status != 200) {
    return UnavailableError("GET " + host + "/instances answered " + std::to_string(res->status) +
                            "; pass --check-drain URL...");
  }
  json j = json::parse(res->body, nullptr, false);
  std::vector<std::string> urls;
  if (j.is_object() && j.contains("instances") && j["instances"].is_array()) {
    for (const auto& i : j["instances"]) {
      if (i.is_object() && i.contains("url") && i["url"].is_string()) urls.push_back(i["url"]);
    }
  }
  if (urls.empty()) return UnavailableError(host + "/instances lists no instance");
  return urls;
}

std::vector<DrainReport> CheckDrain(const std::vector<std::string>& urls,
                                    std::chrono::steady_clock::time_point since, double timeout_s) {
  std::vector<DrainReport> out;
  for (const auto& u : urls) {
    DrainReport d;
    d.url = u;
    out.push_back(d);
  }
  const auto deadline =
      since + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  for (;;) {
    bool all = true;
    for (DrainReport& d : out) {
      if (d.drained) continue;
      auto hp = ParseHost(d.url);
      if (!hp.ok()) {
        d.error = hp.status().message();
        continue;
      }
      auto c = MakeClient(*hp, 2);
      auto res = c->Get("/metrics");
      if (!res || res->status != 200) {
        d.error = "GET " + d.url + "/metrics failed";
        all = false;
        continue;
      }
      d.blocks_active = ScrapeMetric(res->body, "kvbridge_kv_blocks_active");
      d.blocks_held = ScrapeMetric(res->body, "kvbridge_kv_blocks_held_for_transfer");
      d.lease_expired = ScrapeMetric(res->body, "kvbridge_kv_lease_expired_total");
      d.notifications_ignored = ScrapeMetric(res->body, "kvbridge_kv_notifications_ignored_total");
      if (d.blocks_active < 0 || d.blocks_held < 0) {
        d.error =
            d.url + " exports no kvbridge_kv_blocks_active/kvbridge_kv_blocks_held_for_transfer";
        continue;  // cannot be proven drained; fails below
      }
      if (d.blocks_active == 0 && d.blocks_held == 0) {
        d.drained = true;
        d.error.clear();
        d.drain_s = std::max(0.0, std::chrono::duration<double>(Clock::now() - since).count());
      } else {
        all = false;
      }
    }
    if (all || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (DrainReport& d : out) {
    if (!d.drained && d.error.empty()) {
      char buf[256];
      std::snprintf(buf, sizeof(buf),
                    "not drained %.1f s after the last response: active=%g held=%g", timeout_s,
                    d.blocks_active, d.blocks_held);
      d.error = buf;
    }
    if (d.drained && d.lease_expired > 0) d.error = "leases expired in a fault-free run";
    if (d.drained && d.notifications_ignored > 0) d.error = "notifications were ignored";
  }
  return out;
}

nlohmann::json DrainJson(const DrainReport& d) {
  return {{"url", d.url},
          {"drained", d.drained},
          {"drain_s", d.drain_s},
          {"blocks_active", d.blocks_active},
          {"blocks_held", d.blocks_held},
          {"lease_expired_total", d.lease_expired},
          {"notifications_ignored_total", d.notifications_ignored},
          {"error", d.error}};
}

}  // namespace internal

namespace {

using internal::HostPort;
using internal::MakeClient;
using internal::ParseHost;
using internal::Seconds;

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Sample {
  bool ok = false;
  double latency_s = 0;
  double ttft_s = -1;  // streaming: to the first event that carries a choice
  double n = 1;
  double prompt_tokens = 0;
  double completion_tokens = 0;
  double cached_tokens = 0;
  std::string error;
};

// Usage of a whole JSON response, or of the last SSE event that carries one.
bool ReadUsage(const std::string& body, bool stream, Sample& s) {
  json usage;
  if (!stream) {
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return false;
    if (j.contains("usage")) usage = j["usage"];
  } else {
    std::istringstream in(body);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("data: ", 0) != 0 || line == "data: [DONE]") continue;
      json j = json::parse(line.substr(6), nullptr, false);
      if (j.is_discarded()) return false;
      if (j.is_object() && j.contains("error")) return false;
      if (j.is_object() && j.contains("usage") && j["usage"].is_object()) usage = j["usage"];
    }
  }
  if (usage.is_object()) {
    s.prompt_tokens = usage.value("prompt_tokens", 0.0);
    s.completion_tokens = usage.value("completion_tokens", 0.0);
    if (usage.contains("prompt_tokens_details") && usage["prompt_tokens_details"].is_object()) {
      s.cached_tokens = usage["prompt_tokens_details"].value("cached_tokens", 0.0);
    }
  }
  return true;
}

// Finds, in a growing SSE body, the first complete event whose JSON carries a choice (the first
// token, as vLLM's benchmark_serving times TTFT). Scans each byte once.
class FirstTokenScanner {
 public:
  bool SeesFirstToken(const std::string& body) {
    for (;;) {
      size_t end = body.find("\n\n", scanned_);
      if (end == std::string::npos) {
        scanned_ = body.size() > 1 ? body.size() - 1 : 0;
        return false;
      }
      std::string_view ev(body.data() + start_, end - start_);
      start_ = scanned_ = end + 2;
      while (!ev.empty() && (ev.front() == '\n' || ev.front() == '\r')) ev.remove_prefix(1);
      if (ev.rfind("data: ", 0) != 0 || ev == "data: [DONE]") continue;
      json j = json::parse(ev.substr(6), nullptr, false);
      if (j.is_object() && j.contains("choices") && j["choices"].is_array() &&
          !j["choices"].empty()) {
        return true;
      }
    }
  }

 private:
  size_t start_ = 0;    // where the next event begins
  size_t scanned_ = 0;  // bytes already searched for the event separator
};

Result<std::string> DiscoverModel(const HostPort& hp) {
  auto c = MakeClient(hp, 10);
  auto res = c->Get("/v1/models");
  if (!res || res->status != 200) return std::string();
  json j = json::parse(res->body, nullptr, false);
  if (j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty() &&
      j["data"][0].contains("id") && j["data"][0]["id"].is_string()) {
    return j["data"][0]["id"].get<std::string>();
  }
  return std::string();
}

}  // namespace

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  q = std::clamp(q, 0.0, 1.0);
  double pos = q * static_cast<double>(v.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(pos));
  size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

Result<std::vector<int>> ParseBatches(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > 4096) {
      return InvalidArgumentError("--batches wants positive integers like 3,4,8; got '" + text +
                                  "'");
    }
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) return InvalidArgumentError("--batches is empty");
  return out;
}

Result<std::vector<std::string>> LoadPrompts(const std::string& path) {
  std::ifstream in(path);
  if (!in) return InvalidArgumentError("cannot open prompts file " + path);
  std::vector<std::string> out;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("model_input") ||
        !j["model_input"].is_string()) {
      return InvalidArgumentError(path + ":" + std::to_string(n) +
                                  ": want a JSON object with a string \"model_input\"");
    }
    out.push_back(j["model_input"].get<std::string>());
  }
  if (out.empty()) return InvalidArgumentError(path + " holds no prompts");
  return out;
}

std::vector<std::string> MakeSyntheticPrompts(int count, uint64_t seed) {
  static const char* kWords[] = {
      "the",      "cache",    "block",   "engine",   "prefill", "decode", "token",   "river",
      "mountain", "quiet",    "bright",  "signal",   "number",  "garden", "window",  "silver",
      "answer",   "question", "history", "science",  "music",   "travel", "morning", "ocean",
      "careful",  "simple",   "machine", "language", "story",   "future", "people",  "energy"};
  constexpr size_t kN = sizeof(kWords) / sizeof(kWords[0]);
  std::mt19937_64 rng(seed);
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) {
    std::string p = "Request " + std::to_string(i) + ": write a short story about";
    int words = 150 + static_cast<int>(rng() % 200);
    for (int w = 0; w < words; ++w) {
      p += ' ';
      p += kWords[rng() % kN];
    }
    p += '.';
    out.push_back(std::move(p));
  }
  return out;
}

std::map<std::string, std::pair<double, double>> ParsePhaseTotals(const std::string& metrics) {
  std::map<std::string, std::pair<double, double>> out;
  std::istringstream is(metrics);
  std::string line;
  static const std::string kSum = "kvbridge_proxy_phase_seconds_sum{";
  static const std::string kCount = "kvbridge_proxy_phase_seconds_count{";
  while (std::getline(is, line)) {
    const bool sum = line.rfind(kSum, 0) == 0;
    if (!sum && line.rfind(kCount, 0) != 0) continue;
    const size_t at = line.find("phase=\"");
    const size_t sp = line.rfind(' ');
    if (at == std::string::npos || sp == std::string::npos) continue;
    const size_t end = line.find('"', at + 7);
    const std::string phase = line.substr(at + 7, end - at - 7);
    const double v = std::strtod(line.c_str() + sp + 1, nullptr);
    (sum ? out[phase].first : out[phase].second) += v;
  }
  return out;
}

std::string ProgressThrottle::Format(const std::string& line,
                                     std::chrono::steady_clock::time_point now) {
  if (tty_) {
    std::string out = "\r" + line;
    if (out.size() < 79) out.append(79 - out.size(), ' ');
    return out;
  }
  const std::string batch = line.substr(0, line.find(':'));
  if (printed_ && batch == last_batch_ && now - last_ < interval_) return "";
  printed_ = true;
  last_ = now;
  last_batch_ = batch;
  return line + "\n";
}

Result<BenchReport> RunBench(const BenchOptions& o,
                             const std::function<void(const std::string&)>& progress) {
  if (o.samples < 1) return InvalidArgumentError("--samples must be >= 1");
  if (o.batches.empty()) return InvalidArgumentError("--batches is empty");
  for (int b : o.batches) {
    if (b < 1) return InvalidArgumentError("--batches entries must be >= 1");
  }
  if (o.best_of_n < 1) return InvalidArgumentError("--best-of-n must be >= 1");
  if (o.output_tokens < 1) return InvalidArgumentError("--output-tokens must be >= 1");
  ASSIGN_OR_RETURN(HostPort hp, ParseHost(o.host));
  std::vector<std::string> prompts;
  if (!o.prompts_file.empty()) {
    ASSIGN_OR_RETURN(prompts, LoadPrompts(o.prompts_file));
  } else {
    prompts = MakeSyntheticPrompts(std::max(1, o.synthetic_prompts), o.seed);
  }
  if (o.shuffle) std::shuffle(prompts.begin(), prompts.end(), std::mt19937_64(o.seed));
  std::string model = o.model;
  if (model.empty()) {
    ASSIGN_OR_RETURN(model, DiscoverModel(hp));
  }
  std::vector<std::string> drain_urls;
  if (o.check_drain) {
    if (!o.drain_urls.empty()) {
      drain_urls = o.drain_urls;
    } else {
      ASSIGN_OR_RETURN(drain_urls, internal::InstanceUrls(o.host));
    }
  }

  BenchReport report;
  size_t next_prompt = 0;
  for (size_t bi = 0; bi < o.batches.size(); ++bi) {
    const int conc = o.batches[bi];
    // Request bodies are fixed before the batch starts, so a seed reproduces the workload.
    std::mt19937_64 rng(o.seed * 1000003 + bi);
    std::vector<std::string> bodies;
    for (int i = 0; i < o.samples; ++i) {
      json b = {{"prompt", prompts[next_prompt++ % prompts.size()]},
                {"max_tokens", std::max(1, o.output_tokens + static_cast<int>(rng() % 21) - 10)},
                {"n", o.best_of_n},
                {"stream", o.stream}};
      if (!model.empty()) b["model"] = model;
      if (o.input_tokens > 0) {
        b["truncate_prompt_tokens"] =
            std::max(1, o.input_tokens + static_cast<int>(rng() % 201) - 100);
      }
      if (o.stream) b["stream_options"] = {{"include_usage", true}};
      bodies.push_back(b.dump());
    }
    std::vector<Sample> samples(bodies.size());
    std::atomic<int> next{0}, done{0}, errors{0};
    // The proxy's phase totals before and after the batch (none from an engine).
    auto phase_totals = [&] {
      auto c = MakeClient(hp, 5);
      auto res = c->Get("/metrics");
      return res && res->status == 200 ? ParsePhaseTotals(res->body)
                                       : std::map<std::string, std::pair<double, double>>{};
    };
    const auto phases_before = phase_totals();
    const auto t0 = Clock::now();
    std::vector<std::thread> workers;
    for (int w = 0; w < conc; ++w) {
      workers.emplace_back([&] {
        auto client = MakeClient(hp, o.request_timeout_s);
        for (;;) {
          int i = next.fetch_add(1);
          if (i >= static_cast<int>(bodies.size())) return;
          Sample& s = samples[static_cast<size_t>(i)];
          s.n = o.best_of_n;
          const auto r0 = Clock::now();
          std::string body;
          FirstTokenScanner scan;
          httplib::Result res = [&] {
            if (!o.stream) {
              return client->Post(o.path.c_str(), bodies[static_cast<size_t>(i)],
                                  "application/json");
            }
            httplib::Request req;
            req.method = "POST";
            req.path = o.path;
            req.body = bodies[static_cast<size_t>(i)];
            req.set_header("Content-Type", "application/json");
            req.set_header("Accept", "text/event-stream");
            req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
              body.append(d, n);
              if (s.ttft_s < 0 && scan.SeesFirstToken(body)) s.ttft_s = Seconds(Clock::now() - r0);
              return true;
            };
            return client->send(req);
          }();
          if (!o.stream && res) body = std::move(res->body);
          s.latency_s = Seconds(Clock::now() - r0);
          if (!res) {
            s.error = "cannot reach " + hp.host + ":" + std::to_string(hp.port) +
                      " (httplib: " + httplib::to_string(res.error()) + ")";
          } else if (res->status != 200) {
            s.error = "HTTP " + std::to_string(res->status) + ": " + body.substr(0, 300);
          } else if (body.empty()) {
            s.error = "HTTP 200 with an empty body";
          } else if (!ReadUsage(body, o.stream, s)) {
            s.error = "unparsable or error response: " + body.substr(0, 300);
          } else if (o.stream && s.ttft_s < 0) {
            s.error = "stream without a token: " + body.substr(0, 300);
          } else {
            s.ok = true;
          }
          if (!s.ok) errors.fetch_add(1);
          done.fetch_add(1);
        }
      });
    }
    std::atomic<bool> batch_over{false};
    std::thread reporter([&] {
      while (!batch_over.load()) {
        if (progress) {
          char buf[200];
          double el = Seconds(Clock::now() - t0);
          std::snprintf(buf, sizeof(buf), "batch c=%d: %d/%d done, %d errors, %.1f s, %.2f req/s",
                        conc, done.load(), o.samples, errors.load(), el,
                        el > 0 ? done.load() / el : 0.0);
          progress(buf);
        }
        for (int k = 0; k < 20 && !batch_over.load(); ++k) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
    });
    for (auto& t : workers) t.join();
    const auto t_end = Clock::now();
    batch_over = true;
    reporter.join();

    BatchReport br;
    br.concurrency = conc;
    br.requests = o.samples;
    br.duration_s = Seconds(t_end - t0);
    br.requests_per_s = br.duration_s > 0 ? o.samples / br.duration_s : 0;
    std::vector<double> lat, ttft, tpot;
    double prompt = 0, completion = 0, cached = 0;
    int ok = 0;
    for (const Sample& s : samples) {
      if (!s.ok) {
        ++br.errors;
        if (br.error_samples.size() < 5) br.error_samples.push_back(s.error);
        continue;
      }
      ++ok;
      lat.push_back(s.latency_s);
      if (s.ttft_s >= 0) {
        ttft.push_back(s.ttft_s);
        // Per choice: the n siblings stream side by side, each completion_tokens / n long.
        const double per_choice = s.completion_tokens / std::max(1.0, s.n);
        if (per_choice > 1) tpot.push_back((s.latency_s - s.ttft_s) / (per_choice - 1));
      }
      prompt += s.prompt_tokens;
      completion += s.completion_tokens;
      cached += s.cached_tokens;
    }
    if (!lat.empty()) {
      double sum = 0;
      for (double l : lat) sum += l;
      br.latency_mean_s = sum / static_cast<double>(lat.size());
      br.latency_p50_s = Percentile(lat, 0.50);
      br.latency_p75_s = Percentile(lat, 0.75);
      br.latency_p90_s = Percentile(lat, 0.90);
      br.latency_p95_s = Percentile(lat, 0.95);
    }
    auto mean = [](const std::vector<double>& v) {
      double sum = 0;
      for (double x : v) sum += x;
      return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
    };
    br.ttft_count = static_cast<int>(ttft.size());
    br.ttft_mean_s = mean(ttft);
    br.ttft_p50_s = Percentile(ttft, 0.50);
    br.ttft_p99_s = Percentile(ttft, 0.99);
    br.tpot_count = static_cast<int>(tpot.size());
    br.tpot_mean_s = mean(tpot);
    br.tpot_p50_s = Percentile(tpot, 0.50);
    br.tpot_p99_s = Percentile(tpot, 0.99);
    br.output_tokens_per_s = br.duration_s > 0 ? completion / br.duration_s : 0;
    if (ok > 0) {
      br.mean_input_tokens = prompt / ok;
      br.mean_output_tokens = completion / ok;
    }
    br.cache_hit_rate = prompt > 0 ? cached / prompt : 0;
    std::sort(lat.begin(), lat.end());
    std::sort(ttft.begin(), ttft.end());
    br.latencies_s = lat;
    br.ttfts_s = ttft;
    // The proxy counts a request's phases just after its last byte: give it a moment.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (const auto& [phase, after] : phase_totals()) {
      auto b = phases_before.find(phase);
      const double sum = after.first - (b != phases_before.end() ? b->second.first : 0);
      const double count = after.second - (b != phases_before.end() ? b->second.second : 0);
      if (count > 0) br.phase_mean_s[phase] = sum / count;
    }
    if (br.errors > 0) report.ok = false;
    if (o.check_drain) {
      br.drains = internal::CheckDrain(drain_urls, t_end, o.drain_timeout_s);
      for (const DrainReport& d : br.drains) {
        if (!d.drained || !d.error.empty()) report.ok = false;
      }
    }
    report.batches.push_back(std::move(br));
    const BatchReport& last = report.batches.back();
    if (o.max_latency_s > 0 && last.latency_mean_s > o.max_latency_s &&
        last.latency_p50_s > o.max_latency_s && bi + 1 < o.batches.size()) {
      char buf[160];
      std::snprintf(buf, sizeof(buf), "stopped after c=%d: mean %.3f s and p50 %.3f s > %.3f s",
                    conc, last.latency_mean_s, last.latency_p50_s, o.max_latency_s);
      report.stop_reason = buf;
      break;
    }
  }
  return report;
}

std::string FormatTable(const BenchReport& r) {
  std::string out;
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%5s %6s %6s %8s %8s %8s %8s %8s %8s %8s %8s %8s %6s %8s\n",
                "conc", "reqs", "errors", "dur_s", "req/s", "mean_s", "p50_s", "p75_s", "p90_s",
                "p95_s", "in_tok", "out_tok", "cache", "tok/s");
  out += buf;
  for (const BatchReport& b : r.batches) {
    std::snprintf(
        buf, sizeof(buf),
        "%5d %6d %6d %8.2f %8.2f %8.3f %8.3f %8.3f %8.3f %8.3f %8.1f %8.1f %5.1f%% %8.1f\n",
        b.concurrency, b.requests, b.errors, b.duration_s, b.requests_per_s, b.latency_mean_s,
        b.latency_p50_s, b.latency_p75_s, b.latency_p90_s, b.latency_p95_s, b.mean_input_tokens,
        b.mean_output_tokens, 100.0 * b.cache_hit_rate, b.output_tokens_per_s);
    out += buf;
  }
  bool streamed = false;
  for (const BatchReport& b : r.batches) streamed = streamed || b.ttft_count > 0;
  if (streamed) {
    std::snprintf(buf, sizeof(buf), "%5s %12s %12s %12s %12s %12s %12s\n", "conc", "ttft_mean_ms",
                  "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms");
    out += buf;
    for (const BatchReport& b : r.batches) {
      std::snprintf(buf, sizeof(buf), "%5d %12.1f %12.1f %12.1f %12.2f %12.2f %12.2f\n",
                    b.concurrency, 1e3 * b.ttft_mean_s, 1e3 * b.ttft_p50_s, 1e3 * b.ttft_p99_s,
                    1e3 * b.tpot_mean_s, 1e3 * b.tpot_p50_s, 1e3 * b.tpot_p99_s);
      out += buf;
    }
  }
  for (const BatchReport& b : r.batches) {
    for (const std::string& e : b.error_samples)
      out += "  error (c=" + std::to_string(b.concurrency) + "): " + e + "\n";
    for (const DrainReport& d : b.drains) {
      std::snprintf(
          buf, sizeof(buf),
          "  drain c=%d %s: %s in %.3f s (lease_expired=%g notifications_ignored=%g)%s%s\n",
          b.concurrency, d.url.c_str(), d.drained ? "drained" : "NOT DRAINED", d.drain_s,
          d.lease_expired, d.notifications_ignored, d.error.empty() ? "" : " — ", d.error.c_str());
      out += buf;
    }
  }
  if (!r.stop_reason.empty()) out += r.stop_reason + "\n";
  out += r.ok ? "result: OK\n" : "result: FAILED\n";
  return out;
}

std::string ReportJson(const BenchReport& r) {
  json batches = json::array();
  for (const BatchReport& b : r.batches) {
    json drains = json::array();
    for (const DrainReport& d : b.drains) {
      drains.push_back(internal::DrainJson(d));
    }
    batches.push_back({{"concurrency", b.concurrency},
                       {"requests", b.requests},
                       {"errors", b.errors},
                       {"duration_s", b.duration_s},
                       {"requests_per_s", b.requests_per_s},
                       {"latency_s",
                        {{"mean", b.latency_mean_s},
                         {"p50", b.latency_p50_s},
                         {"p75", b.latency_p75_s},
                         {"p90", b.latency_p90_s},
                         {"p95", b.latency_p95_s}}},
                       {"ttft_s",
                        {{"count", b.ttft_count},
                         {"mean", b.ttft_mean_s},
                         {"p50", b.ttft_p50_s},
                         {"p99", b.ttft_p99_s}}},
                       {"tpot_s",
                        {{"count", b.tpot_count},
                         {"mean", b.tpot_mean_s},
                         {"p50", b.tpot_p50_s},
                         {"p99", b.tpot_p99_s}}},
                       {"output_tokens_per_s", b.output_tokens_per_s},
                       {"mean_input_tokens", b.mean_input_tokens},
                       {"mean_output_tokens", b.mean_output_tokens},
                       {"cache_hit_rate", b.cache_hit_rate},
                       {"error_samples", b.error_samples},
                       {"drains", drains},
                       {"latencies_s", b.latencies_s},
                       {"ttfts_s", b.ttfts_s},
                       {"phase_mean_s", b.phase_mean_s}});
  }
  return json{{"ok", r.ok}, {"stop_reason", r.stop_reason}, {"batches", batches}}.dump(2);
}

}  // namespace kvbridge::bench
