// `kvbridge bench --multi-turn`: conversations through the chat API (bench.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
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

struct TurnSample {
  bool ok = false;
  double latency_s = 0;
  double ttft_s = -1;
  double prompt_tokens = 0;
  double cached_tokens = 0;
  std::string answer;
  std::string error;
};

// Reads a chat SSE stream as it grows: the answer's text (delta content), the usage of the last
// event carrying one, and whether a token has arrived (a delta with text, or a finish reason: a
// role-only first delta is not a token). Each byte is scanned once.
class ChatStreamReader {
 public:
  // Returns true when this call saw the first token.
  bool Feed(const std::string& body, TurnSample& s) {
    bool first = false;
    for (;;) {
      size_t end = body.find("\n\n", scanned_);
      if (end == std::string::npos) {
        scanned_ = body.size() > 1 ? body.size() - 1 : 0;
        return first;
      }
      std::string_view ev(body.data() + start_, end - start_);
      start_ = scanned_ = end + 2;
      while (!ev.empty() && (ev.front() == '\n' || ev.front() == '\r')) ev.remove_prefix(1);
      if (ev.rfind("data: ", 0) != 0 || ev == "data: [DONE]") continue;
      json j = json::parse(ev.substr(6), nullptr, false);
      if (!j.is_object()) continue;
      if (j.contains("error")) {
        error = j["error"].dump();
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        const json& u = j["usage"];
        s.prompt_tokens = u.value("prompt_tokens", 0.0);
        if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object())
          s.cached_tokens = u["prompt_tokens_details"].value("cached_tokens", 0.0);
      }
      if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) continue;
      const json& c = j["choices"][0];
      bool token = c.contains("finish_reason") && !c["finish_reason"].is_null();
      if (c.contains("delta") && c["delta"].is_object()) {
        for (const char* key : {"content", "reasoning_content"}) {
          auto it = c["delta"].find(key);
          if (it != c["delta"].end() && it->is_string() &&
              !it->get_ref<const std::string&>().empty()) {
            token = true;
            if (std::string_view(key) == "content") s.answer += it->get<std::string>();
          }
        }
      }
      if (token && !seen_token_) {
        seen_token_ = true;
        first = true;
      }
    }
  }
  std::string error;

 private:
  size_t start_ = 0;
  size_t scanned_ = 0;
  bool seen_token_ = false;
};

Result<std::vector<std::string>> InstanceUrls(const MultiTurnOptions& o, const HostPort& hp) {
  if (!o.metrics_urls.empty()) return o.metrics_urls;
  auto c = MakeClient(hp, 10);
  auto res = c->Get("/instances");
  if (!res || res->status != 200) {
    return UnavailableError("GET " + o.host +
                            "/instances failed: pass the engines' URLs (--metrics-url)");
  }
  json j = json::parse(res->body, nullptr, false);
  std::vector<std::string> urls;
  if (j.is_object() && j.contains("instances") && j["instances"].is_array()) {
    for (const auto& i : j["instances"]) {
      if (i.is_object() && i.contains("url") && i["url"].is_string()) urls.push_back(i["url"]);
    }
  }
  if (urls.empty()) return UnavailableError(o.host + "/instances lists no instance");
  return urls;
}

struct Counters {
  std::map<std::string, double> computed;  // url → kvbridge_prompt_tokens_computed_total
  double hits = 0;
  bool all = true;
};

Counters Scrape(const std::vector<std::string>& urls) {
  Counters c;
  for (const std::string& u : urls) {
    auto hp = ParseHost(u);
    double v = -1, h = -1;
    if (hp.ok()) {
      auto cl = MakeClient(*hp, 5);
      auto res = cl->Get("/metrics");
      if (res && res->status == 200) {
        v = ScrapeMetric(res->body, "kvbridge_prompt_tokens_computed_total");
        h = ScrapeMetric(res->body, "kvbridge_prefix_cache_hits_total");
      }
    }
    if (v < 0) c.all = false;
    c.computed[u] = v;
    c.hits += std::max(h, 0.0);
  }
  return c;
}

std::string DiscoverModel(const HostPort& hp) {
  auto c = MakeClient(hp, 10);
  auto res = c->Get("/v1/models");
  if (!res || res->status != 200) return "";
  json j = json::parse(res->body, nullptr, false);
  if (j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty() &&
      j["data"][0].contains("id") && j["data"][0]["id"].is_string()) {
    return j["data"][0]["id"].get<std::string>();
  }
  return "";
}

}  // namespace

Result<std::vector<std::vector<std::string>>> LoadConversations(const std::string& path) {
  std::ifstream in(path);
  if (!in) return InvalidArgumentError("cannot open conversations file " + path);
  std::vector<std::vector<std::string>> out;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    bool good =
        j.is_object() && j.contains("turns") && j["turns"].is_array() && !j["turns"].empty();
    std::vector<std::string> turns;
    if (good) {
      for (const json& t : j["turns"]) {
        if (!t.is_string()) good = false;
        if (good) turns.push_back(t.get<std::string>());
      }
    }
    if (!good) {
      return InvalidArgumentError(
          path + ":" + std::to_string(n) +
          ": want a JSON object with a non-empty \"turns\" list of strings");
    }
    out.push_back(std::move(turns));
  }
  if (out.empty()) return InvalidArgumentError(path + " holds no conversations");
  return out;
}

Result<MultiTurnReport> RunMultiTurn(const MultiTurnOptions& o,
                                     const std::function<void(const std::string&)>& progress) {
  if (o.concurrency < 1) return InvalidArgumentError("concurrency must be >= 1");
  if (o.output_tokens < 1) return InvalidArgumentError("--output-tokens must be >= 1");
  if (o.prompts_file.empty()) return InvalidArgumentError("--multi-turn needs --prompts FILE");
  ASSIGN_OR_RETURN(HostPort hp, ParseHost(o.host));
  ASSIGN_OR_RETURN(auto convs, LoadConversations(o.prompts_file));
  if (o.conversations > 0 && static_cast<size_t>(o.conversations) < convs.size())
    convs.resize(static_cast<size_t>(o.conversations));
  std::string model = o.model.empty() ? DiscoverModel(hp) : o.model;
  ASSIGN_OR_RETURN(std::vector<std::string> urls, InstanceUrls(o, hp));
  size_t turns = 0;
  for (const auto& c : convs) turns = std::max(turns, c.size());
  if (o.max_turns > 0) turns = std::min(turns, static_cast<size_t>(o.max_turns));

  std::vector<json> messages(convs.size(), json::array());
  MultiTurnReport report;
  for (size_t t = 0; t < turns; ++t) {
    std::vector<size_t> active;
    for (size_t i = 0; i < convs.size(); ++i) {
      if (t < convs[i].size()) active.push_back(i);
    }
    std::shuffle(active.begin(), active.end(), std::mt19937_64(o.seed + t));
    for (size_t i : active) messages[i].push_back({{"role", "user"}, {"content", convs[i][t]}});
    Counters before = Scrape(urls);
    std::vector<TurnSample> samples(active.size());
    std::atomic<size_t> next{0};
    std::atomic<int> done{0};
    const auto t0 = Clock::now();
    std::vector<std::thread> workers;
    for (int w = 0; w < o.concurrency; ++w) {
      workers.emplace_back([&] {
        auto client = MakeClient(hp, o.request_timeout_s);
        for (;;) {
          size_t k = next.fetch_add(1);
          if (k >= active.size()) return;
          TurnSample& s = samples[k];
          json body = {{"messages", messages[active[k]]},
                       {"max_tokens", o.output_tokens},
                       {"temperature", 0},
                       {"stream", true},
                       {"stream_options", {{"include_usage", true}}}};
          if (!model.empty()) body["model"] = model;
          httplib::Request req;
          req.method = "POST";
          req.path = "/v1/chat/completions";
          req.body = body.dump();
          req.set_header("Content-Type", "application/json");
          req.set_header("Accept", "text/event-stream");
          std::string text;
          ChatStreamReader reader;
          const auto r0 = Clock::now();
          req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
            text.append(d, n);
            if (reader.Feed(text, s)) s.ttft_s = Seconds(Clock::now() - r0);
            return true;
          };
          httplib::Result res = client->send(req);
          s.latency_s = Seconds(Clock::now() - r0);
          if (!res) {
            s.error =
                "cannot reach " + o.host + " (httplib: " + httplib::to_string(res.error()) + ")";
          } else if (res->status != 200) {
            s.error = "HTTP " + std::to_string(res->status) + ": " + text.substr(0, 300);
          } else if (!reader.error.empty()) {
            s.error = "stream error: " + reader.error.substr(0, 300);
          } else if (s.ttft_s < 0) {
            s.error = "stream without a token: " + text.substr(0, 300);
          } else {
            s.ok = true;
          }
          done.fetch_add(1);
          if (progress) {
            char buf[160];
            std::snprintf(buf, sizeof buf, "turn %zu: %d/%zu done", t + 1, done.load(),
                          active.size());
            progress(buf);
          }
        }
      });
    }
    for (auto& w : workers) w.join();
    const double dur = Seconds(Clock::now() - t0);
    Counters after = Scrape(urls);

    TurnReport tr;
    tr.turn = static_cast<int>(t + 1);
    tr.requests = static_cast<int>(active.size());
    tr.duration_s = dur;
    std::vector<double> ttft, lat;
    for (size_t k = 0; k < active.size(); ++k) {
      TurnSample& s = samples[k];
      // The conversation goes on with the answer (an error's turn: an empty answer).
      messages[active[k]].push_back({{"role", "assistant"}, {"content", s.answer}});
      if (!s.ok) {
        ++tr.errors;
        if (tr.error_samples.size() < 3) tr.error_samples.push_back(s.error);
        continue;
      }
      ttft.push_back(s.ttft_s);
      lat.push_back(s.latency_s);
      tr.prompt_tokens += s.prompt_tokens;
      tr.usage_cached_tokens += s.cached_tokens;
    }
    double sum = 0;
    for (double v : ttft) sum += v;
    tr.ttft_mean_s = ttft.empty() ? 0 : sum / static_cast<double>(ttft.size());
    tr.ttft_p50_s = Percentile(ttft, 0.5);
    tr.ttft_p90_s = Percentile(ttft, 0.9);
    tr.latency_p50_s = Percentile(lat, 0.5);
    if (before.all && after.all) {
      tr.prompt_tokens_computed = 0;
      for (const std::string& u : urls) {
        const double d = after.computed[u] - before.computed[u];
        tr.computed_by_instance.emplace_back(u, d);
        tr.prompt_tokens_computed += d;
      }
      tr.prefix_cache_hit_tokens = after.hits - before.hits;
      tr.cache_hit_rate =
          tr.prompt_tokens > 0 ? 1.0 - tr.prompt_tokens_computed / tr.prompt_tokens : 0;
    }
    if (tr.errors > 0) report.ok = false;
    report.turns.push_back(std::move(tr));
  }
  return report;
}

std::string FormatMultiTurn(const MultiTurnReport& r) {
  std::string out =
      "turn  requests  errors  ttft_p50_s  ttft_p90_s  latency_p50_s  prompt_tokens  "
      "computed  cache_hit_rate\n";
  char buf[512];
  for (const TurnReport& t : r.turns) {
    std::snprintf(buf, sizeof buf, "%4d  %8d  %6d  %10.4f  %10.4f  %13.4f  %13.0f  %8.0f  %14.3f\n",
                  t.turn, t.requests, t.errors, t.ttft_p50_s, t.ttft_p90_s, t.latency_p50_s,
                  t.prompt_tokens, t.prompt_tokens_computed, t.cache_hit_rate);
    out += buf;
    for (const auto& e : t.error_samples) out += "  error: " + e + "\n";
  }
  return out;
}

std::string MultiTurnJson(const MultiTurnReport& r) {
  json turns = json::array();
  for (const TurnReport& t : r.turns) {
    json by = json::object();
    for (const auto& [u, v] : t.computed_by_instance) by[u] = v;
    turns.push_back({{"turn", t.turn},
                     {"requests", t.requests},
                     {"errors", t.errors},
                     {"duration_s", t.duration_s},
                     {"ttft_mean_s", t.ttft_mean_s},
                     {"ttft_p50_s", t.ttft_p50_s},
                     {"ttft_p90_s", t.ttft_p90_s},
                     {"latency_p50_s", t.latency_p50_s},
                     {"prompt_tokens", t.prompt_tokens},
                     {"usage_cached_tokens", t.usage_cached_tokens},
                     {"prompt_tokens_computed", t.prompt_tokens_computed},
                     {"prefix_cache_hit_tokens", t.prefix_cache_hit_tokens},
                     {"cache_hit_rate", t.cache_hit_rate},
                     {"computed_by_instance", by},
                     {"error_samples", t.error_samples}});
  }
  return json{{"turns", turns}, {"ok", r.ok}}.dump();
}

}  // namespace kvbridge::bench
