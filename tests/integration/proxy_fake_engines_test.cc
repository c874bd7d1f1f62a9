// The proxy runtime against fake OpenAI engines (httplib servers in this process that record the
// legs they get): leg shapes, kv_transfer_params stripping, error forwarding, release on decode
// failure, streaming pass-through, client disconnect, registration and heartbeat expiry.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "kvbridge/common/metrics.h"
#include "kvbridge/proxy/proxy_server.h"
#include "kvbridge/proxy/registration.h"
#include "support/free_port.h"

namespace kvbridge::proxy {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr const char* kToken = "s3cret";

struct Recorded {
  std::string path;
  json body;
  std::string token;
};

// A fake engine: prefill answers with kv_transfer_params naming the transfer_id it got; decode
// answers JSON or SSE. Everything it receives is recorded.
class FakeEngine {
 public:
  // keep_alive_max: requests the server answers on one connection before it closes it.
  explicit FakeEngine(bool prefill, int keep_alive_max = 5) : prefill_(prefill) {
    server_.set_keep_alive_max_count(keep_alive_max);
    auto handler = [this](const httplib::Request& req, httplib::Response& res) {
      const size_t index = Record(req);
      struct Active {  // requests being answered now, and the most at once
        FakeEngine* e;
        explicit Active(FakeEngine* f) : e(f) {
          const int now = ++e->active_;
          int seen = e->max_active_.load();
          while (now > seen && !e->max_active_.compare_exchange_weak(seen, now)) {
          }
        }
        ~Active() { --e->active_; }
      } active(this);
      if (!prefill_ && write_prefill_ != nullptr) WaitForWritePrefill(req, index);
      if (answer_delay_ms_ > 0) std::this_thread::sleep_for(answer_delay_ms_ * 1ms);
      json body = json::parse(req.body, nullptr, false);
      if (fail_status_ != 0) {
        res.status = fail_status_;
        if (fail_body_delay_ms_ > 0) {  // the status line now, the body later
          res.set_chunked_content_provider(
              "application/json", [this](size_t, httplib::DataSink& sink) {
                std::this_thread::sleep_for(std::chrono::milliseconds(fail_body_delay_ms_));
                sink.write(fail_body_.data(), fail_body_.size());
                sink.done();
                return true;
              });
          return;
        }
        res.set_content(fail_body_, "application/json");
        return;
      }
      if (prefill_) {
        json params = body["kv_transfer_params"];
        json out = {{"id", "cmpl-p"},
                    {"choices", {{{"text", "a"}}}},
                    {"kv_transfer_params",
                     {{"transfer_id", params.value("transfer_id", "")},
                      {"remote_engine_id", "eng-p"},
                      {"remote_host", "127.0.0.1"},
                      {"remote_port", 7100},
                      {"remote_block_ids", {4, 5}},
                      {"remote_num_tokens", 20},
                      {"tp_size", 1}}}};
        res.set_content(out.dump(), "application/json");
        return;
      }
      if (body.value("stream", false)) {
        res.set_chunked_content_provider(
            "text/event-stream", [this](size_t offset, httplib::DataSink& sink) {
              for (int i = 0; i < sse_events_; ++i) {
                std::string ev = "data: {\"i\":" + std::to_string(i) + "}\n\n";
                if (!sink.write(ev.data(), ev.size())) {
                  stream_broken_ = true;
                  return false;
                }
                std::this_thread::sleep_for(std::chrono::milliseconds(sse_delay_ms_));
              }
              std::string done = "data: [DONE]\n\n";
              if (!sink.write(done.data(), done.size())) {
                stream_broken_ = true;
                return false;
              }
              sink.done();
              return true;
            });
        return;
      }
      res.set_content(R"({"id":"cmpl-d","choices":[{"text":"decoded"}]})", "application/json");
    };
    server_.Post("/v1/completions", handler);
    server_.Post("/v1/chat/completions", handler);
    server_.Post("/v1/kv/release", [this](const httplib::Request& req, httplib::Response& res) {
      Record(req);
      res.set_content(R"({"released":true})", "application/json");
    });
    // vLLM's tokenizer routes: an echo of what arrived; a body with "bad" is refused.
    auto tokenizer_route = [this](const httplib::Request& req, httplib::Response& res) {
      Record(req);
      json body = json::parse(req.body, nullptr, false);
      if (body.is_object() && body.contains("bad")) {
        res.status = 400;
        res.set_content(R"({"error":{"message":"bad","code":400}})", "application/json");
        return;
      }
      res.set_content(json({{"engine", prefill_ ? "prefill" : "decode"}, {"got", body}}).dump(),
                      "application/json");
    };
    server_.Post("/tokenize", tokenizer_route);
    server_.Post("/detokenize", tokenizer_route);
    server_.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("ok", "text/plain");
    });
    server_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"object":"list","data":[{"id":"fake"}]})", "application/json");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    EXPECT_GT(port_, 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    // stop() before the loop runs would be lost and leave the thread in accept() forever.
    for (int i = 0; i < 500 && !server_.is_running(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  ~FakeEngine() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::vector<Recorded> Calls(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Recorded> out;
    for (auto& r : calls_) {
      if (r.path == path) out.push_back(r);
    }
    return out;
  }
  // Waits until `n` calls to `path` arrived (bounded, 10 s).
  std::vector<Recorded> WaitCalls(const std::string& path, size_t n) {
    for (int i = 0; i < 1000 && Calls(path).size() < n; ++i) std::this_thread::sleep_for(10ms);
    return Calls(path);
  }

  int fail_status_ = 0;
  std::string fail_body_;
  int fail_body_delay_ms_ = 0;
  int sse_events_ = 3;
  int sse_delay_ms_ = 1;
  int answer_delay_ms_ = 0;  // before any answer
  // A WRITE decode: answers only once its prefill leg reached this engine (WaitForWritePrefill).
  FakeEngine* write_prefill_ = nullptr;
  std::atomic<bool> stream_broken_{false};
  std::atomic<int> active_{0};
  std::atomic<int> max_active_{0};

 private:
  // Returns the call's index in calls_.
  size_t Record(const httplib::Request& req) {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back({req.path, json::parse(req.body, nullptr, false),
                      req.get_header_value(kClusterTokenHeader)});
    return calls_.size() - 1;
  }
  // As a real WRITE decode waits for the KV its prefill writes, this one answers once the
  // prefill leg of its transfer_id reached write_prefill_ — or once a later decode leg reached
  // this engine (the proxy cancelled this leg and sent the pair again). Bounded (10 s). Without
  // it the decode could answer before the proxy saw its prefill leg fail, and the pair would
  // never be retried: a race that only load would lose.
  void WaitForWritePrefill(const httplib::Request& req, size_t index) {
    const json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("kv_transfer_params")) return;
    const std::string tid = body["kv_transfer_params"].value("transfer_id", "");
    auto released = [&] {
      for (const auto& c : write_prefill_->Calls("/v1/completions")) {
        if (c.body.is_object() &&
            c.body.value("kv_transfer_params", json::object()).value("transfer_id", "") == tid) {
          return true;
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = index + 1; i < calls_.size(); ++i) {
        if (calls_[i].path == "/v1/completions") return true;
      }
      return false;
    };
    for (int i = 0; i < 10000 && !released(); ++i) std::this_thread::sleep_for(1ms);
  }
  bool prefill_;
  int port_ = -1;
  httplib::Server server_;
  std::thread thread_;
  std::mutex mu_;
  std::vector<Recorded> calls_;
};

std::unique_ptr<ProxyServer> StartProxy(ProxyOptions o) {
  o.port = 0;
  o.cluster_token = kToken;
  auto p = ProxyServer::Create(o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  (*p)->Start();
  return std::move(p).value();
}

// StartProxy with one static prefill and one static decode; `tune` sets other options first.
std::unique_ptr<ProxyServer> StartProxy(const std::string& prefill_url,
                                        const std::string& decode_url,
                                        const std::function<void(ProxyOptions&)>& tune = {}) {
  ProxyOptions o;
  o.prefill_urls = {prefill_url};
  o.decode_urls = {decode_url};
  if (tune) tune(o);
  return StartProxy(o);
}

// Waits (bounded, 5 s: a loaded machine may not run the proxy's thread for a while) until the
// proxy's `name{labels}` reaches `value`; returns its value then. Outcomes are counted when a flow
// ends, which may be just after the client has its answer.
double WaitMetric(ProxyServer& proxy, const std::string& name, const std::string& labels,
                  double value) {
  for (int i = 0; i < 500 && ScrapeMetric(proxy.MetricsText(), name, labels) < value; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  return ScrapeMetric(proxy.MetricsText(), name, labels);
}

// Polls `pred` every 10 ms until it holds (bounded, 5 s); returns whether it held.
bool WaitUntil(const std::function<bool()>& pred) {
  for (int i = 0; i < 500 && !pred(); ++i) std::this_thread::sleep_for(10ms);
  return pred();
}

// A streamed POST /v1/completions of `body`; the bytes received are appended to *got.
httplib::Request StreamRequest(const std::string& body, std::string* got) {
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [got](const char* data, size_t len, uint64_t, uint64_t) {
    got->append(data, len);
    return true;
  };
  return req;
}

const std::string kBody =
    R"({"model":"fake","prompt":"hi","max_tokens":16,"n":4,"min_tokens":2,"logprobs":1,)"
    R"("kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[999],)"
    R"("transfer_id":"client-chosen"}})";

// POSTs kBody to /v1/completions `times` times on `cli`; every answer must be 200.
void PostOk(httplib::Client& cli, int times) {
  for (int i = 0; i < times; ++i) {
    auto res = cli.Post("/v1/completions", kBody, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
  }
}

TEST(ProxyFakeEngines, ReadFlowLegShapesAndStripping) {
  FakeEngine p(true), d(false);
  auto proxy = StartProxy(p.url(), d.url());
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/completions", kBody, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, R"({"id":"cmpl-d","choices":[{"text":"decoded"}]})");

  auto pre = p.Calls("/v1/completions");
  auto dec = d.Calls("/v1/completions");
  ASSERT_EQ(pre.size(), 1u);
  ASSERT_EQ(dec.size(), 1u);
  const json& pb = pre[0].body;
  std::string tid = pb["kv_transfer_params"]["transfer_id"];
  EXPECT_EQ(tid.size(), 32u);
  EXPECT_NE(tid, "client-chosen");
  EXPECT_EQ(pb["kv_transfer_params"], json({{"do_remote_decode", true}, {"transfer_id", tid}}));
  EXPECT_EQ(pb["max_tokens"], 1);
  EXPECT_EQ(pb["n"], 1);
  EXPECT_EQ(pb["stream"], false);
  EXPECT_FALSE(pb.contains("min_tokens"));
  EXPECT_FALSE(pb.contains("logprobs"));
  EXPECT_EQ(pre[0].token, kToken);

  const json& db = dec[0].body;
  EXPECT_EQ(db["n"], 4);
  EXPECT_EQ(db["max_tokens"], 16);
  EXPECT_EQ(db["min_tokens"], 2);
  EXPECT_EQ(db["kv_transfer_params"], json({{"do_remote_prefill", true},
                                            {"transfer_id", tid},
                                            {"remote_engine_id", "eng-p"},
                                            {"remote_host", "127.0.0.1"},
                                            {"remote_port", 7100},
                                            {"remote_block_ids", {4, 5}},
                                            {"remote_num_tokens", 20},
                                            {"tp_size", 1}}));
  EXPECT_EQ(dec[0].token, kToken);
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(p.Calls("/v1/kv/release").empty());  // success: the decode notifies, not us

  std::string metrics = proxy->MetricsText();
  EXPECT_EQ(ScrapeMetric(metrics, "kvbridge_proxy_requests_total", "outcome=\"ok\""), 1.0);
  EXPECT_EQ(ScrapeMetric(metrics, "kvbridge_proxy_leg_seconds_count", "role=\"decode\""), 1.0);

  auto models = cli.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->body, R"({"object":"list","data":[{"id":"fake"}]})");
}

// /tokenize and /detokenize go to one engine (a decode when there is one) as they are; its
// status and body come back as they are.
TEST(ProxyFakeEngines, TokenizeAndDetokenizeGoToOneEngine) {
  FakeEngine p(true), d(false);
  auto proxy = StartProxy(p.url(), d.url());
  httplib::Client cli("127.0.0.1", proxy->port());
  for (const char* path : {"/tokenize", "/detokenize"}) {
    const json body = {{"model", "fake"}, {"prompt", "h\u00e9"}, {"tokens", {1, 2}}};
    auto res = cli.Post(path, body.dump(), "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(json::parse(res->body), json({{"engine", "decode"}, {"got", body}})) << path;
    res = cli.Post(path, R"({"bad":1})", "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400);
    EXPECT_EQ(res->body, R"({"error":{"message":"bad","code":400}})");
  }
  EXPECT_EQ(d.Calls("/tokenize").size(), 2u);
  EXPECT_EQ(d.Calls("/detokenize").size(), 2u);
  EXPECT_TRUE(p.Calls("/tokenize").empty());
  EXPECT_TRUE(d.Calls("/v1/completions").empty());
  // Only a prefill: it answers.
  auto only_prefill = StartProxy([&] {
    ProxyOptions o;
    o.prefill_urls = {p.url()};
    return o;
  }());
  httplib::Client cli2("127.0.0.1", only_prefill->port());
  auto res = cli2.Post("/tokenize", R"({"prompt":"x"})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(json::parse(res->body)["engine"], "prefill") << res->body;
}

TEST(ProxyFakeEngines, PrefillForwardN) {
  FakeEngine p(true), d(false);
  auto proxy = StartProxy(p.url(), d.url(), [](ProxyOptions& o) { o.prefill_forward_n = true; });
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/completions", kBody, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(p.Calls("/v1/completions").at(0).body["n"], 4);
}

TEST(ProxyFakeEngines, Decode4xxForwardedWithBodyAndPrefillReleased) {
  FakeEngine p(true), d(false);
  d.fail_status_ = 400;
  d.fail_body_ = R"({"error":{"message":"max_tokens too large","code":400}})";
  auto proxy = StartProxy(p.url(), d.url());
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/completions", kBody, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_EQ(res->body, d.fail_body_);
  std::string tid = p.Calls("/v1/completions").at(0).body["kv_transfer_params"]["transfer_id"];
  auto rel = p.WaitCalls("/v1/kv/release", 1);
  ASSERT_EQ(rel.size(), 1u);
  EXPECT_EQ(rel[0].body, json({{"transfer_id", tid}}));
  EXPECT_EQ(rel[0].token, kToken);
  EXPECT_EQ(WaitMetric(*proxy, "kvbridge_proxy_releases_total", "result=\"ok\"", 1), 1.0);
  EXPECT_EQ(WaitMetric(*proxy, "kvbridge_proxy_requests_total", "outcome=\"decode_error\"", 1),
            1.0);
}

TEST(ProxyFakeEngines, Decode4xxReleasesThePrefillAtTheStatusLineBeforeItsBody) {
  FakeEngine p(true), d(false);
  d.fail_status_ = 429;
  d.fail_body_ = R"({"error":{"message":"slow down","code":429}})";
  d.fail_body_delay_ms_ = 1500;
  auto proxy = StartProxy(p.url(), d.url());
  std::atomic<bool> answered{false};
  int status = 0;
  std::string body;
  std::thread client([&] {
    httplib::Client cli("127.0.0.1", proxy->port());
    auto res = cli.Post("/v1/completions", kBody, "application/json");
    if (res) {
      status = res->status;
      body = res->body;
    }
    answered = true;
  });
  auto rel = p.WaitCalls("/v1/kv/release", 1);  // bounded at 10 s
  const bool before_answer = !answered.load();
  client.join();
  ASSERT_EQ(rel.size(), 1u);
  EXPECT_TRUE(before_answer) << "the release waited for the decode's body";
  EXPECT_EQ(rel[0].body["transfer_id"],
            p.Calls("/v1/completions").at(0).body["kv_transfer_params"]["transfer_id"]);
  EXPECT_EQ(status, 429);
  EXPECT_EQ(body, d.fail_body_);
}

TEST(ProxyFakeEngines, PrefillErrorForwardedAsIs) {
  FakeEngine p(true), d(false);
  p.fail_status_ = 413;
  p.fail_body_ = R"({"error":"prompt too long"})";
  auto proxy = StartProxy(p.url(), d.url());
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/chat/completions", R"({"messages":[]})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 413);
  EXPECT_EQ(res->body, R"({"error":"prompt too long"})");
  EXPECT_TRUE(d.Calls("/v1/chat/completions").empty());
}

TEST(ProxyFakeEngines, DecodeUnreachableReleasesPrefill) {
  FakeEngine p(true);
  testing::RefusingPort dead;
  auto proxy = StartProxy(p.url(), "http://127.0.0.1:" + std::to_string(dead.port()));
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/completions", kBody, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 502);
  EXPECT_NE(res->body.find("no decode reachable"), std::string::npos) << res->body;
  EXPECT_EQ(p.WaitCalls("/v1/kv/release", 1).size(), 1u);
}

TEST(ProxyFakeEngines, UnreachablePrefillRetriedOnAnother) {
  FakeEngine p(true), d(false);
  testing::RefusingPort dead;
  ProxyOptions o;
  o.prefill_urls = {"http://127.0.0.1:" + std::to_string(dead.port()), p.url()};
  o.decode_urls = {d.url()};
  o.routing = RoutingPolicy::kRoundRobin;
  o.health_probe_interval = 3600 * kSecond;  // keep the dead one "healthy" so it gets picked
  auto proxy = StartProxy(o);
  httplib::Client cli("127.0.0.1", proxy->port());
  PostOk(cli, 4);
  EXPECT_EQ(p.Calls("/v1/completions").size(), 4u);
}

// A draining (or full) engine refuses with 503 at admission: the proxy sends the leg elsewhere.
TEST(ProxyFakeEngines, Refusing503PrefillRetriedOnAnother) {
  FakeEngine busy(true), p(true), d(false);
  busy.fail_status_ = 503;
  busy.fail_body_ = R"({"error":{"message":"draining"}})";
  ProxyOptions o;
  o.prefill_urls = {busy.url(), p.url()};
  o.decode_urls = {d.url()};
  o.routing = RoutingPolicy::kRoundRobin;
  auto proxy = StartProxy(o);
  httplib::Client cli("127.0.0.1", proxy->port());
  PostOk(cli, 4);
  EXPECT_EQ(p.Calls("/v1/completions").size(), 4u);
  EXPECT_EQ(busy.Calls("/v1/kv/release").size(), 0u);  // it admitted nothing
}

// Issue 21: WRITE fails over like READ. Half the pairs first name a dead prefill; each is sent
// again to the live one with a fresh transfer_id, its first decode leg cancelled.
TEST(ProxyFakeEngines, WriteUnreachablePrefillRetriesThePair) {
  FakeEngine p(true), d(false);
  d.write_prefill_ = &p;
  testing::RefusingPort dead;
  ProxyOptions o;
  o.mode = KvTransferMode::kWrite;
  o.prefill_urls = {"http://127.0.0.1:" + std::to_string(dead.port()), p.url()};
  o.decode_urls = {d.url()};
  o.routing = RoutingPolicy::kRoundRobin;
  o.health_probe_interval = 3600 * kSecond;  // keep the dead one "healthy" so it gets picked
  auto proxy = StartProxy(o);
  httplib::Client cli("127.0.0.1", proxy->port());
  PostOk(cli, 4);
  auto pre = p.Calls("/v1/completions");
  ASSERT_EQ(pre.size(), 4u);
  std::set<std::string> decode_tids;
  for (const auto& c : d.Calls("/v1/completions")) {
    decode_tids.insert(c.body["kv_transfer_params"]["transfer_id"].get<std::string>());
  }
  std::set<std::string> prefill_tids;
  for (const auto& c : pre) {
    const std::string tid = c.body["kv_transfer_params"]["transfer_id"];
    EXPECT_EQ(tid.size(), 32u) << tid;  // minted afresh, not derived
    prefill_tids.insert(tid);
    EXPECT_TRUE(decode_tids.count(tid)) << "no decode leg for transfer " << tid;
  }
  EXPECT_EQ(prefill_tids.size(), 4u);
  EXPECT_EQ(WaitMetric(*proxy, "kvbridge_proxy_requests_total", "outcome=\"ok\"", 4), 4.0);
  EXPECT_EQ(p.Calls("/v1/kv/release").size(), 0u);
}

// A request that finds no prefill (the only one restarting) waits --instance-wait-ms for one:
// it registers 300 ms later and the request is answered 200.
TEST(ProxyFakeEngines, RequestWaitsForAnInstanceThatComesBack) {
  FakeEngine p(true), d(false);
  ProxyOptions o;
  o.decode_urls = {d.url()};
  o.instance_wait = 5 * kSecond;
  auto proxy = StartProxy(o);
  std::thread later([&] {
    std::this_thread::sleep_for(300ms);
    RegistrationOptions ro;
    ro.proxy = "127.0.0.1:" + std::to_string(proxy->port());
    ro.cluster_token = kToken;
    ro.info.role = Role::kPrefill;
    ro.info.url = p.url();
    EXPECT_TRUE(RegisterWithProxy(ro, {}).ok());
  });
  httplib::Client cli("127.0.0.1", proxy->port());
  const auto start = std::chrono::steady_clock::now();
  auto res = cli.Post("/v1/completions", kBody, "application/json");
  later.join();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  EXPECT_GE(std::chrono::steady_clock::now() - start, 250ms);
  EXPECT_EQ(p.Calls("/v1/completions").size(), 1u);
}

// Overload: past --max-pending requests in flight the proxy answers 429 with Retry-After at
// once; every request it accepted completes; nothing stays in flight after.
TEST(ProxyFakeEngines, BurstAboveMaxPendingGets429WithRetryAfter) {
  FakeEngine p(true), d(false);
  d.answer_delay_ms_ = 400;
  auto proxy = StartProxy(p.url(), d.url(), [](ProxyOptions& o) {
    o.max_pending = 3;
    o.retry_after_s = 2;
  });
  constexpr int kClients = 12;
  std::atomic<int> ok{0}, rejected{0}, other{0}, ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&] {
      httplib::Client cli("127.0.0.1", proxy->port());
      cli.set_read_timeout(30, 0);
      ++ready;
      for (int w = 0; w < 2000 && !go; ++w) std::this_thread::sleep_for(1ms);
      auto res = cli.Post("/v1/completions", kBody, "application/json");
      if (res && res->status == 200) {
        ++ok;
      } else if (res && res->status == 429 && res->get_header_value("Retry-After") == "2" &&
                 res->body.find("too_many_requests") != std::string::npos) {
        ++rejected;
      } else {
        ++other;
      }
    });
  }
  for (int w = 0; w < 2000 && ready < kClients; ++w) std::this_thread::sleep_for(1ms);
  go = true;
  for (auto& t : clients) t.join();
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(ok + rejected, kClients);
  EXPECT_GE(ok.load(), 3);  // the first three at least were accepted
  EXPECT_GE(rejected.load(), 1);
  EXPECT_LE(d.max_active_.load(), 3);  // never more than the bound reached an engine
  EXPECT_EQ(WaitMetric(*proxy, "kvbridge_proxy_requests_total", "outcome=\"overloaded\"", rejected),
            static_cast<double>(rejected));
  EXPECT_EQ(WaitMetric(*proxy, "kvbridge_proxy_requests_total", "outcome=\"ok\"", ok),
            static_cast<double>(ok));
  // A flow leaves the in-flight gauge just after its answer (and the fake engine its handler
  // just after writing it): bounded waits, not a look at one instant.
  EXPECT_TRUE(WaitUntil([&] {
    return ScrapeMetric(proxy->MetricsText(), "kvbridge_proxy_requests_in_flight") == 0.0;
  }));
  EXPECT_TRUE(WaitUntil([&] { return d.active_.load() == 0; }));
  EXPECT_EQ(p.Calls("/v1/kv/release").size(), 0u);
}

// The client's X-Request-Timeout bounds the request end to end: past it the proxy cancels the
// decode leg and releases the prefill's hold.
TEST(ProxyFakeEngines, ClientTimeoutHeaderCancelsTheLegsAndReleases) {
  FakeEngine p(true), d(false);
  d.sse_events_ = 400;
  d.sse_delay_ms_ = 10;  // 4 s of stream unless cancelled
  auto proxy = StartProxy(p.url(), d.url());
  httplib::Client cli("127.0.0.1", proxy->port());
  std::string got;
  httplib::Request req = StreamRequest(R"({"prompt":"hi","stream":true})", &got);
  req.set_header(kRequestTimeoutHeader, "0.3");
  const auto start = std::chrono::steady_clock::now();
  auto res = cli.send(req);
  ASSERT_TRUE(res);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  EXPECT_EQ(res->status, 200);  // the stream had started: the timeout is its last event
  EXPECT_NE(got.find("request timed out"), std::string::npos) << got;
  for (int i = 0; i < 200 && !d.stream_broken_; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(d.stream_broken_.load()) << "the decode leg was not cancelled";
  auto rel = p.WaitCalls("/v1/kv/release", 1);
  ASSERT_EQ(rel.size(), 1u);
  EXPECT_EQ(rel[0].body["transfer_id"],
            p.Calls("/v1/completions").at(0).body["kv_transfer_params"]["transfer_id"]);
  EXPECT_EQ(WaitMetric(*proxy, "kvbridge_proxy_requests_total", "outcome=\"timeout\"", 1), 1.0);
  // A bad value is the client's error, before any leg.
  httplib::Headers bad = {{kRequestTimeoutHeader, "soon"}};
  auto r400 = cli.Post("/v1/completions", bad, kBody, "application/json");
  ASSERT_TRUE(r400);
  EXPECT_EQ(r400->status, 400);
  EXPECT_NE(r400->body.find("X-Request-Timeout"), std::string::npos) << r400->body;
  EXPECT_EQ(p.Calls("/v1/completions").size(), 1u);
}

TEST(ProxyFakeEngines, StreamingPassThrough) {
  FakeEngine p(true), d(false);
  d.sse_events_ = 5;
  auto proxy = StartProxy(p.url(), d.url());
  httplib::Client cli("127.0.0.1", proxy->port());
  std::string got;
  auto res = cli.send(StreamRequest(
      R"({"prompt":"hi","stream":true,"stream_options":{"include_usage":true}})", &got));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  std::string expected;
  for (int i = 0; i < 5; ++i) expected += "data: {\"i\":" + std::to_string(i) + "}\n\n";
  expected += "data: [DONE]\n\n";
  EXPECT_EQ(got, expected);
  auto dec = d.Calls("/v1/completions");
  ASSERT_EQ(dec.size(), 1u);
  EXPECT_EQ(dec[0].body["stream"], true);
  EXPECT_EQ(dec[0].body["stream_options"], json({{"include_usage", true}}));
  EXPECT_FALSE(p.Calls("/v1/completions").at(0).body.contains("stream_options"));
}

TEST(ProxyFakeEngines, ClientDisconnectMidStreamCancelsDecodeAndReleases) {
  FakeEngine p(true), d(false);
  d.sse_events_ = 400;
  d.sse_delay_ms_ = 10;  // 4 s of stream unless cancelled
  auto proxy = StartProxy(p.url(), d.url());
  // A raw client: send the request, read the first bytes, then close.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(proxy->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  std::string body = R"({"prompt":"hi","stream":true})";
  std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  char buf[4096];
  std::string got;
  while (got.find("data: {\"i\":1}") == std::string::npos) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0);
    got.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 200 && !d.stream_broken_; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(d.stream_broken_.load()) << "the decode leg was not cancelled";
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  auto rel = p.WaitCalls("/v1/kv/release", 1);
  ASSERT_EQ(rel.size(), 1u);
  EXPECT_EQ(rel[0].body["transfer_id"],
            p.Calls("/v1/completions").at(0).body["kv_transfer_params"]["transfer_id"]);
  EXPECT_EQ(
      WaitMetric(*proxy, "kvbridge_proxy_requests_total", "outcome=\"client_disconnected\"", 1),
      1.0);
}

TEST(ProxyFakeEngines, RegistrationHeartbeatExpiryAndMixedModeRefused) {
  FakeEngine p(true), d(false);
  ProxyOptions o;
  o.heartbeat_timeout = 600 * kMillisecond;
  o.instance_wait = 200 * kMillisecond;  // the 503 below comes after it
  auto proxy = StartProxy(o);
  std::string addr = "127.0.0.1:" + std::to_string(proxy->port());

  RegistrationOptions ro;
  ro.proxy = addr;
  ro.cluster_token = kToken;
  ro.heartbeat_interval = 100 * kMillisecond;
  ro.info.role = Role::kPrefill;
  ro.info.url = p.url();
  ro.info.engine_id = "eng-p";
  ro.info.transfer_endpoints = {"tcp://127.0.0.1:7100"};
  auto prefill_client = RegistrationClient::Start(ro, [] { return InstanceLoad{1, 2, 0.5}; });

  // Decode registers once and never heartbeats: it must expire.
  RegistrationOptions rd = ro;
  rd.info.role = Role::kDecode;
  rd.info.url = d.url();
  ASSERT_TRUE(RegisterWithProxy(rd, {}).ok());

  // Wrong token and mixed mode are refused.
  RegistrationOptions bad = rd;
  bad.cluster_token = "nope";
  EXPECT_EQ(RegisterWithProxy(bad, {}).code(), StatusCode::kUnauthenticated);
  RegistrationOptions write = rd;
  write.info.mode = KvTransferMode::kWrite;
  write.info.url = "http://127.0.0.1:1";
  Status refused = RegisterWithProxy(write, {});
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("mixed READ/WRITE"), std::string::npos);

  for (int i = 0; i < 100 && !prefill_client->registered(); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(prefill_client->registered());
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/completions", kBody, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);

  auto inst = json::parse(cli.Get("/instances")->body);
  ASSERT_EQ(inst["instances"].size(), 2u);
  for (const auto& i : inst["instances"]) {
    if (i["role"] == "prefill") {
      EXPECT_EQ(i["url"], p.url());
      EXPECT_EQ(i["mode"], "read");
      EXPECT_EQ(i["healthy"], true);
      EXPECT_EQ(i["load"]["waiting"], 2);
      EXPECT_EQ(i["transfer_endpoints"], json({"tcp://127.0.0.1:7100"}));
    }
  }
  std::this_thread::sleep_for(1200ms);  // two heartbeat timeouts
  auto after = proxy->Instances();
  ASSERT_EQ(after.size(), 1u);  // the decode expired; the heartbeating prefill stayed
  EXPECT_EQ(after[0].info.role, Role::kPrefill);
  EXPECT_EQ(after[0].load.running, 1);
  EXPECT_EQ(SendHeartbeat(rd, {}).code(), StatusCode::kNotFound);
  res = cli.Post("/v1/completions", kBody, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 503);  // no decode (after --instance-wait-ms): never an empty 200
  EXPECT_EQ(p.WaitCalls("/v1/kv/release", 1).size(), 1u);  // the prefill's hold is released
  EXPECT_EQ(ScrapeMetric(proxy->MetricsText(), "kvbridge_proxy_instances_expired_total"), 1.0);

  prefill_client->Stop();  // deregisters
  EXPECT_TRUE(proxy->Instances().empty());
}

TEST(ProxyFakeEngines, BadRequestsAndUnknownPaths) {
  FakeEngine p(true), d(false);
  auto proxy = StartProxy(p.url(), d.url());
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/completions", "{not json", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  res = cli.Get("/nope");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  res = cli.Post("/v1/instances/heartbeat", R"({"instance_id":"x"})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 401);  // no token
  EXPECT_TRUE(p.Calls("/v1/completions").empty());
}

TEST(ProxyFakeEngines, RegistrationClientRetriesAndRegistersAgainAfterProxyRestart) {
  FakeEngine d(false);
  int port = testing::FreePort();
  RegistrationOptions ro;
  ro.proxy = "http://127.0.0.1:" + std::to_string(port);
  ro.heartbeat_interval = 50 * kMillisecond;
  ro.info.role = Role::kDecode;
  ro.info.url = d.url();
  auto client = RegistrationClient::Start(ro, {});
  std::this_thread::sleep_for(150ms);
  EXPECT_FALSE(client->registered());
  EXPECT_EQ(client->last_status().code(), StatusCode::kUnavailable);

  ProxyOptions o;
  o.port = port;
  auto proxy = ProxyServer::Create(o);
  ASSERT_TRUE(proxy.ok()) << proxy.status().ToString();
  (*proxy)->Start();
  for (int i = 0; i < 200 && (*proxy)->Instances().empty(); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ((*proxy)->Instances().size(), 1u);
  EXPECT_TRUE(client->registered());

  proxy->reset();  // the proxy restarts and forgets everything
  auto again = ProxyServer::Create(o);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  (*again)->Start();
  for (int i = 0; i < 200 && (*again)->Instances().empty(); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ((*again)->Instances().size(), 1u);
  EXPECT_EQ((*again)->Instances()[0].info.url, d.url());
  client->Stop();
  EXPECT_TRUE((*again)->Instances().empty());  // deregistered on Stop
}

TEST(ProxyFakeEngines, LegsReuseKeepAliveConnections) {
  FakeEngine p(true, 1000), d(false, 1000);
  auto proxy = StartProxy(p.url(), d.url());
  httplib::Client cli("127.0.0.1", proxy->port());
  PostOk(cli, 6);
  // One connection per engine, then every later leg reuses it.
  std::string m = proxy->MetricsText();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"new\""), 2.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"reused\""), 10.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_retries_total"), 0.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_upstream_idle_connections"), 2.0);

  // A streamed decode leg goes back to the pool only after its end, and is reused after it.
  std::string got;
  auto res = cli.send(StreamRequest(R"({"prompt":"hi","stream":true})", &got));
  ASSERT_TRUE(res);
  EXPECT_EQ(got, "data: {\"i\":0}\n\ndata: {\"i\":1}\n\ndata: {\"i\":2}\n\ndata: [DONE]\n\n");
  PostOk(cli, 1);
  m = proxy->MetricsText();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"new\""), 2.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"reused\""), 14.0);
}

TEST(ProxyFakeEngines, PoolOffOpensAConnectionPerLeg) {
  FakeEngine p(true, 1000), d(false, 1000);
  auto proxy = StartProxy(p.url(), d.url(), [](ProxyOptions& o) { o.upstream_max_idle = 0; });
  httplib::Client cli("127.0.0.1", proxy->port());
  PostOk(cli, 3);
  std::string m = proxy->MetricsText();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"new\""), 6.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"reused\""), 0.0);
}

TEST(ProxyFakeEngines, EngineClosingAfterEachResponseIsNotReused) {
  FakeEngine p(true, 1), d(false, 1);  // "Connection: close" on every response
  auto proxy = StartProxy(p.url(), d.url());
  httplib::Client cli("127.0.0.1", proxy->port());
  PostOk(cli, 3);
  std::string m = proxy->MetricsText();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"new\""), 6.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_retries_total"), 0.0);
}

// A raw HTTP/1.1 engine (prefill and decode at once) that answers the first request of each
// connection and keeps it alive, then, per `drop_from`, reads the next request on it and closes
// the connection without a byte — what an engine closing an idle connection races into.
class DroppingEngine {
 public:
  explicit DroppingEngine(int drop_from) : drop_from_(drop_from) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    EXPECT_EQ(::listen(listen_fd_, 16), 0);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }
  ~DroppingEngine() {
    stop_ = true;
    accept_thread_.join();
    for (int fd : conn_fds_) ::shutdown(fd, SHUT_RDWR);
    for (auto& t : conn_threads_) t.join();
    for (int fd : conn_fds_) ::close(fd);
    ::close(listen_fd_);
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int connections() const { return connections_; }
  int answered() const { return answered_; }
  int dropped() const { return dropped_; }

 private:
  void AcceptLoop() {
    while (!stop_) {
      pollfd pfd{listen_fd_, POLLIN, 0};
      if (::poll(&pfd, 1, 20) <= 0) continue;
      int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      ++connections_;
      conn_fds_.push_back(fd);
      conn_threads_.emplace_back([this, fd] { Serve(fd); });
    }
  }
  // Reads one request (headers + Content-Length body); false on EOF or error.
  static bool ReadRequest(int fd) {
    std::string in;
    char buf[4096];
    size_t head_end;
    while ((head_end = in.find("\r\n\r\n")) == std::string::npos) {
      ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) return false;
      in.append(buf, static_cast<size_t>(n));
    }
    size_t body_len = 0;
    auto cl = in.find("Content-Length: ");
    if (cl != std::string::npos && cl < head_end) body_len = std::stoul(in.substr(cl + 16));
    while (in.size() < head_end + 4 + body_len) {
      ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) return false;
      in.append(buf, static_cast<size_t>(n));
    }
    return true;
  }
  void Serve(int fd) {
    for (int i = 0; ReadRequest(fd); ++i) {
      if (i >= drop_from_) {
        ++dropped_;
        ::shutdown(fd, SHUT_RDWR);
        return;
      }
      const std::string body =
          R"({"choices":[{"text":"ok"}],"kv_transfer_params":{"remote_block_ids":[1]}})";
      std::string res = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
                        std::to_string(body.size()) + "\r\n\r\n" + body;
      // Counted before the send: the proxy can answer its client, and the test read the count,
      // before this thread runs again.
      ++answered_;
      if (::send(fd, res.data(), res.size(), MSG_NOSIGNAL) < 0) return;
    }
  }
  const int drop_from_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0}, answered_{0}, dropped_{0};
  std::thread accept_thread_;
  std::vector<int> conn_fds_;  // accept thread only, until joined
  std::vector<std::thread> conn_threads_;
};

TEST(ProxyFakeEngines, RequestLostOnAReusedConnectionIsSentAgainOnceOnANewOne) {
  DroppingEngine e(/*drop_from=*/1);
  auto proxy = StartProxy(e.url(), e.url(), [](ProxyOptions& o) {
    o.health_probe_interval = 3600 * kSecond;  // no probe connections in the counts
  });
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/completions", kBody, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->body,
            R"({"choices":[{"text":"ok"}],"kv_transfer_params":{"remote_block_ids":[1]}})");
  // Prefill on a new connection; the decode leg reuses it, loses it, and goes again on a new one.
  std::string m = proxy->MetricsText();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"new\""), 2.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"reused\""), 1.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_retries_total"), 1.0);
  EXPECT_EQ(e.connections(), 2);
  EXPECT_EQ(e.answered(), 2);
  EXPECT_EQ(e.dropped(), 1);
}

TEST(ProxyFakeEngines, RequestLostOnANewConnectionIsNotSentAgain) {
  DroppingEngine e(/*drop_from=*/0);
  auto proxy = StartProxy(e.url(), e.url(),
                          [](ProxyOptions& o) { o.health_probe_interval = 3600 * kSecond; });
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/completions", kBody, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 502);
  EXPECT_NE(res->body.find("prefill leg failed"), std::string::npos) << res->body;
  std::string m = proxy->MetricsText();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_connections_total", "kind=\"new\""), 1.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_proxy_leg_retries_total"), 0.0);
  // The one prefill leg, then the release of its possible hold (also dropped by this engine).
  for (int i = 0; i < 200 && e.dropped() < 2; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(e.dropped(), 2);
  EXPECT_EQ(e.answered(), 0);
}

}  // namespace
}  // namespace kvbridge::proxy
