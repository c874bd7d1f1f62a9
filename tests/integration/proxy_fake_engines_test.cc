// The proxy runtime against fake OpenAI engines (httplib servers in this process that record the
// legs they get): leg shapes, kv_transfer_params stripping, error forwarding, release on decode
// failure, streaming pass-through, client disconnect, registration and heartbeat expiry.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <nlohmann/json.hpp>
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
  explicit FakeEngine(bool prefill) : prefill_(prefill), port_(testing::FreePort()) {
    auto handler = [this](const httplib::Request& req, httplib::Response& res) {
      Record(req);
      json body = json::parse(req.body, nullptr, false);
      if (fail_status_ != 0) {
        res.status = fail_status_;
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
    server_.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("ok", "text/plain");
    });
    server_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"object":"list","data":[{"id":"fake"}]})", "application/json");
    });
    EXPECT_TRUE(server_.bind_to_port("127.0.0.1", port_));
    thread_ = std::thread([this] { server_.listen_after_bind(); });
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
  // Waits until `n` calls to `path` arrived (bounded).
  std::vector<Recorded> WaitCalls(const std::string& path, size_t n) {
    for (int i = 0; i < 300 && Calls(path).size() < n; ++i) std::this_thread::sleep_for(10ms);
    return Calls(path);
  }

  int fail_status_ = 0;
  std::string fail_body_;
  int sse_events_ = 3;
  int sse_delay_ms_ = 1;
  std::atomic<bool> stream_broken_{false};

 private:
  void Record(const httplib::Request& req) {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back({req.path, json::parse(req.body, nullptr, false),
                      req.get_header_value(kClusterTokenHeader)});
  }
  bool prefill_;
  int port_;
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

const std::string kBody =
    R"({"model":"fake","prompt":"hi","max_tokens":16,"n":4,"min_tokens":2,"logprobs":1,)"
    R"("kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[999],)"
    R"("transfer_id":"client-chosen"}})";

TEST(ProxyFakeEngines, ReadFlowLegShapesAndStripping) {
  FakeEngine p(true), d(false);
  ProxyOptions o;
  o.prefill_urls = {p.url()};
  o.decode_urls = {d.url()};
  auto proxy = StartProxy(o);
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

TEST(ProxyFakeEngines, PrefillForwardN) {
  FakeEngine p(true), d(false);
  ProxyOptions o;
  o.prefill_urls = {p.url()};
  o.decode_urls = {d.url()};
  o.prefill_forward_n = true;
  auto proxy = StartProxy(o);
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
  ProxyOptions o;
  o.prefill_urls = {p.url()};
  o.decode_urls = {d.url()};
  auto proxy = StartProxy(o);
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
  for (int i = 0; i < 100 && ScrapeMetric(proxy->MetricsText(), "kvbridge_proxy_releases_total",
                                          "result=\"ok\"") < 1;
       ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(ScrapeMetric(proxy->MetricsText(), "kvbridge_proxy_requests_total",
                         "outcome=\"decode_error\""),
            1.0);
}

TEST(ProxyFakeEngines, PrefillErrorForwardedAsIs) {
  FakeEngine p(true), d(false);
  p.fail_status_ = 413;
  p.fail_body_ = R"({"error":"prompt too long"})";
  ProxyOptions o;
  o.prefill_urls = {p.url()};
  o.decode_urls = {d.url()};
  auto proxy = StartProxy(o);
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/chat/completions", R"({"messages":[]})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 413);
  EXPECT_EQ(res->body, R"({"error":"prompt too long"})");
  EXPECT_TRUE(d.Calls("/v1/chat/completions").empty());
}

TEST(ProxyFakeEngines, DecodeUnreachableReleasesPrefill) {
  FakeEngine p(true);
  ProxyOptions o;
  o.prefill_urls = {p.url()};
  o.decode_urls = {"http://127.0.0.1:" + std::to_string(testing::FreePort())};
  auto proxy = StartProxy(o);
  httplib::Client cli("127.0.0.1", proxy->port());
  auto res = cli.Post("/v1/completions", kBody, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 502);
  EXPECT_NE(res->body.find("no decode reachable"), std::string::npos) << res->body;
  EXPECT_EQ(p.WaitCalls("/v1/kv/release", 1).size(), 1u);
}

TEST(ProxyFakeEngines, UnreachablePrefillRetriedOnAnother) {
  FakeEngine p(true), d(false);
  ProxyOptions o;
  o.prefill_urls = {"http://127.0.0.1:" + std::to_string(testing::FreePort()), p.url()};
  o.decode_urls = {d.url()};
  o.routing = RoutingPolicy::kRoundRobin;
  o.health_probe_interval = 3600 * kSecond;  // keep the dead one "healthy" so it gets picked
  auto proxy = StartProxy(o);
  httplib::Client cli("127.0.0.1", proxy->port());
  for (int i = 0; i < 4; ++i) {
    auto res = cli.Post("/v1/completions", kBody, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
  }
  EXPECT_EQ(p.Calls("/v1/completions").size(), 4u);
}

TEST(ProxyFakeEngines, StreamingPassThrough) {
  FakeEngine p(true), d(false);
  d.sse_events_ = 5;
  ProxyOptions o;
  o.prefill_urls = {p.url()};
  o.decode_urls = {d.url()};
  auto proxy = StartProxy(o);
  httplib::Client cli("127.0.0.1", proxy->port());
  std::string got;
  std::string content_type;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt":"hi","stream":true,"stream_options":{"include_usage":true}})";
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    got.append(data, len);
    return true;
  };
  auto res = cli.send(req);
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
  ProxyOptions o;
  o.prefill_urls = {p.url()};
  o.decode_urls = {d.url()};
  auto proxy = StartProxy(o);
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
  for (int i = 0; i < 100 && ScrapeMetric(proxy->MetricsText(), "kvbridge_proxy_requests_total",
                                          "outcome=\"client_disconnected\"") < 1;
       ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(ScrapeMetric(proxy->MetricsText(), "kvbridge_proxy_requests_total",
                         "outcome=\"client_disconnected\""),
            1.0);
}

TEST(ProxyFakeEngines, RegistrationHeartbeatExpiryAndMixedModeRefused) {
  FakeEngine p(true), d(false);
  ProxyOptions o;
  o.heartbeat_timeout = 600 * kMillisecond;
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
  write.info.mode = KvMode::kWrite;
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
  EXPECT_EQ(res->status, 503);                             // no decode: never an empty 200
  EXPECT_EQ(p.WaitCalls("/v1/kv/release", 1).size(), 1u);  // the prefill's hold is released
  EXPECT_EQ(ScrapeMetric(proxy->MetricsText(), "kvbridge_proxy_instances_expired_total"), 1.0);

  prefill_client->Stop();  // deregisters
  EXPECT_TRUE(proxy->Instances().empty());
}

TEST(ProxyFakeEngines, BadRequestsAndUnknownPaths) {
  FakeEngine p(true), d(false);
  ProxyOptions o;
  o.prefill_urls = {p.url()};
  o.decode_urls = {d.url()};
  auto proxy = StartProxy(o);
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

}  // namespace
}  // namespace kvbridge::proxy
