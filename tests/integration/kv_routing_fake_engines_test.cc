// KV-aware routing in the proxy runtime against fake engines (httplib servers in this process)
// that serve GET /v1/kv/events from a real KvEventLog (the engine's own route): the proxy follows
// every stream, routes a prompt to the prefill and decode holding its blocks, forgets a restarted
// engine's entries (new incarnation), heals after its stream was down, rebuilds its index after
// its own restart, drops a deregistered engine's entries, and with --pd-skip-threshold sends a
// request the decode already holds to that decode alone.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <thread>

#include "kvbridge/common/metrics.h"
#include "kvbridge/engine/kv_event_log.h"
#include "kvbridge/proxy/proxy_server.h"

namespace kvbridge::proxy {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr const char* kFingerprint = "fake-model";
constexpr int kBs = 16;

std::shared_ptr<KvEventLog> NewLog() {
  return std::make_shared<KvEventLog>(
      KvEventLogOptions{.block_size = kBs, .model_fingerprint = kFingerprint});
}

class KvFakeEngine {
 public:
  explicit KvFakeEngine(bool prefill) : prefill_(prefill), log_(NewLog()) {
    auto handler = [this](const httplib::Request& req, httplib::Response& res) {
      json body = json::parse(req.body, nullptr, false);
      {
        std::lock_guard<std::mutex> l(mu_);
        legs_.push_back(body);
      }
      if (prefill_) {
        json out = {{"choices", {{{"text", "a"}}}},
                    {"kv_transfer_params",
                     {{"transfer_id", body["kv_transfer_params"].value("transfer_id", "")},
                      {"remote_engine_id", "eng"},
                      {"remote_host", "127.0.0.1"},
                      {"remote_port", 7100},
                      {"remote_block_ids", {1}},
                      {"remote_num_tokens", 1}}}};
        res.set_content(out.dump(), "application/json");
        return;
      }
      res.set_content(R"({"choices":[{"text":"decoded"}]})", "application/json");
    };
    server_.Post("/v1/completions", handler);
    server_.Post("/v1/kv/release", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("{}", "application/json");
    });
    server_.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("ok", "text/plain");
    });
    server_.Get("/v1/kv/events", [this](const httplib::Request& req, httplib::Response& res) {
      if (down_) {
        res.status = 503;
        return;
      }
      HttpRequest r;
      for (const auto& [k, v] : req.params) r.query.emplace(k, v);
      std::shared_ptr<KvEventLog> log;
      {
        std::lock_guard<std::mutex> l(mu_);
        log = log_;
      }
      HttpResponse out = KvEventsRoute(log, "").handler(r);
      res.status = out.status;
      res.set_content(out.body, out.content_type);
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 500 && !server_.is_running(); ++i) std::this_thread::sleep_for(2ms);
  }
  ~KvFakeEngine() {
    Restart();  // wakes long polls
    log_->Close();
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // The engine's prefix cache stores the blocks of `ids`.
  void Cache(const std::vector<int32_t>& ids) {
    std::vector<BlockHash> hs;
    AppendBlockHashes(RootBlockHash(kFingerprint), ids, kBs, &hs);
    for (const BlockHash& h : hs) log()->OnBlockCached(h);
  }
  void Evict(const std::vector<int32_t>& ids) {
    std::vector<BlockHash> hs;
    AppendBlockHashes(RootBlockHash(kFingerprint), ids, kBs, &hs);
    for (const BlockHash& h : hs) log()->OnBlockEvicted(h);
  }
  // A restart: a new incarnation with an empty cache.
  void Restart() {
    std::shared_ptr<KvEventLog> old;
    {
      std::lock_guard<std::mutex> l(mu_);
      old = log_;
      log_ = NewLog();
    }
    old->Close();
  }
  void SetDown(bool down) { down_ = down; }
  size_t legs() {
    std::lock_guard<std::mutex> l(mu_);
    return legs_.size();
  }
  json last_leg() {
    std::lock_guard<std::mutex> l(mu_);
    return legs_.empty() ? json() : legs_.back();
  }

 private:
  std::shared_ptr<KvEventLog> log() {
    std::lock_guard<std::mutex> l(mu_);
    return log_;
  }
  bool prefill_;
  std::mutex mu_;
  std::shared_ptr<KvEventLog> log_;
  std::vector<json> legs_;
  std::atomic<bool> down_{false};
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
};

struct Cluster {
  Cluster() {
    for (int i = 0; i < 2; ++i) {
      prefills.push_back(std::make_unique<KvFakeEngine>(true));
      decodes.push_back(std::make_unique<KvFakeEngine>(false));
    }
  }
  ProxyOptions Options(int skip = -1) {
    ProxyOptions o;
    o.port = 0;
    o.routing = RoutingPolicy::kKvAware;
    o.pd_skip_threshold = skip;
    o.kv_events_poll_ms = 100;
    for (auto& p : prefills) o.prefill_urls.push_back(p->url());
    for (auto& d : decodes) o.decode_urls.push_back(d->url());
    return o;
  }
  std::vector<std::unique_ptr<KvFakeEngine>> prefills, decodes;
};

std::unique_ptr<ProxyServer> Start(const ProxyOptions& o) {
  auto p = ProxyServer::Create(o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  (*p)->Start();
  return std::move(*p);
}

// Waits (up to 5 s) until the proxy's index holds `entries` (hash, engine) pairs.
bool WaitEntries(ProxyServer& proxy, double entries) {
  for (int i = 0; i < 500; ++i) {
    if (ScrapeMetric(proxy.MetricsText(), "kvbridge_proxy_kv_index_entries") == entries)
      return true;
    std::this_thread::sleep_for(10ms);
  }
  ADD_FAILURE() << "index never reached " << entries << " entries: "
                << ScrapeMetric(proxy.MetricsText(), "kvbridge_proxy_kv_index_entries");
  return false;
}

int Send(ProxyServer& proxy, const std::vector<int32_t>& prompt) {
  httplib::Client c("127.0.0.1", proxy.port());
  c.set_read_timeout(10, 0);
  auto r = c.Post("/v1/completions", json({{"prompt", prompt}, {"max_tokens", 4}}).dump(),
                  "application/json");
  return r ? r->status : -1;
}

std::vector<int32_t> Prompt(int n, int start) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(KvRoutingFakeEngines, RoutesToTheHoldersAndForgetsARestartedEngine) {
  Cluster c;
  const std::vector<int32_t> p = Prompt(70, 0);  // 4 full blocks + 6
  c.prefills[1]->Cache(p);
  c.decodes[1]->Cache(p);
  auto proxy = Start(c.Options());
  ASSERT_TRUE(WaitEntries(*proxy, 8));
  for (int i = 0; i < 3; ++i) ASSERT_EQ(Send(*proxy, p), 200);
  EXPECT_EQ(c.prefills[1]->legs(), 3u);
  EXPECT_EQ(c.decodes[1]->legs(), 3u);
  EXPECT_EQ(c.prefills[0]->legs() + c.decodes[0]->legs(), 0u);
  EXPECT_EQ(ScrapeMetric(proxy->MetricsText(), "kvbridge_proxy_kv_routes_total", "path=\"pd\""),
            3.0);

  // The decode restarts (new incarnation, empty cache): its 4 entries vanish; with no overlap
  // left the decodes share the load again.
  c.decodes[1]->Restart();
  ASSERT_TRUE(WaitEntries(*proxy, 4));
  for (int i = 0; i < 4; ++i) ASSERT_EQ(Send(*proxy, p), 200);
  EXPECT_EQ(c.prefills[1]->legs(), 7u);  // the prefill still holds it
  EXPECT_EQ(c.decodes[0]->legs(), 2u);
  EXPECT_EQ(c.decodes[1]->legs(), 5u);

  // A stream that is down for a while: what happened meanwhile arrives once it is back.
  c.prefills[1]->SetDown(true);
  std::this_thread::sleep_for(300ms);
  c.prefills[1]->Evict(p);
  c.prefills[0]->Cache(p);
  ASSERT_TRUE(WaitEntries(*proxy, 8));  // prefills[1]'s eviction not seen yet
  c.prefills[1]->SetDown(false);
  ASSERT_TRUE(WaitEntries(*proxy, 4));
  ASSERT_EQ(Send(*proxy, p), 200);
  EXPECT_EQ(c.prefills[0]->legs(), 1u);

  // A new proxy rebuilds its index from the streams (snapshots).
  proxy->Stop();
  proxy.reset();
  proxy = Start(c.Options());
  ASSERT_TRUE(WaitEntries(*proxy, 4));
  ASSERT_EQ(Send(*proxy, p), 200);
  EXPECT_EQ(c.prefills[0]->legs(), 2u);
}

TEST(KvRoutingFakeEngines, SkipSendsAHeldPromptToItsDecodeAlone) {
  Cluster c;
  const std::vector<int32_t> p = Prompt(70, 100);
  c.decodes[0]->Cache(p);  // 64 of 70 tokens
  auto proxy = Start(c.Options(/*skip=*/6));
  ASSERT_TRUE(WaitEntries(*proxy, 4));
  ASSERT_EQ(Send(*proxy, p), 200);
  EXPECT_EQ(c.prefills[0]->legs() + c.prefills[1]->legs(), 0u);
  ASSERT_EQ(c.decodes[0]->legs(), 1u);
  json leg = c.decodes[0]->last_leg();
  EXPECT_FALSE(leg.contains("kv_transfer_params")) << leg.dump();
  EXPECT_EQ(leg["prompt"], json(p));
  // 7 tokens missing > 6: P/D.
  const std::vector<int32_t> longer = Prompt(71, 100);
  ASSERT_EQ(Send(*proxy, longer), 200);
  EXPECT_EQ(c.prefills[0]->legs() + c.prefills[1]->legs(), 1u);
  EXPECT_EQ(ScrapeMetric(proxy->MetricsText(), "kvbridge_proxy_kv_routes_total", "path=\"skip\""),
            1.0);
}

TEST(KvRoutingFakeEngines, ADeregisteredEngineLeavesNoEntries) {
  Cluster c;
  KvFakeEngine extra(false);
  extra.Cache(Prompt(64, 5));
  auto proxy = Start(c.Options());
  httplib::Client cl("127.0.0.1", proxy->port());
  json reg = {{"instance_id", "extra"}, {"role", "decode"}, {"url", extra.url()}, {"mode", "read"}};
  auto r = cl.Post("/v1/instances/register", reg.dump(), "application/json");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
  ASSERT_TRUE(WaitEntries(*proxy, 4));
  r = cl.Post("/v1/instances/deregister", json({{"instance_id", "extra"}}).dump(),
              "application/json");
  ASSERT_TRUE(r && r->status == 200);
  ASSERT_TRUE(WaitEntries(*proxy, 0));
}

}  // namespace
}  // namespace kvbridge::proxy
