// READ-mode P/D with `kvbridge serve` processes as users run them (tcp transport): the test plays
// the proxy over HTTP and compares with a colocated `kvbridge serve`.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvbridge/common/metrics.h"
#include "support/free_port.h"
#include "support/serve_harness.h"
#include "support/subprocess.h"

namespace kvbridge {
namespace {

using nlohmann::json;
using testing::FreePort;
using testing::KvbridgeBin;
using testing::MakeModel;
using testing::MakeTempDir;
using testing::ScrapeMetricAt;
using testing::SpawnServe;
using testing::Subprocess;
using testing::WaitFor;
using testing::WaitForHttpOk;

const char* kToken = "pd-secret";

std::unique_ptr<Subprocess> Serve(const std::string& model, int port, const std::string& log,
                                  const std::string& role) {
  return SpawnServe({.model_dir = model,
                     .num_kv_blocks = 128,
                     .role = role,
                     .extra_config = {{"transport", "tcp"},
                                      {"lease_ms", 30000},
                                      {"load_failure_policy", "recompute"}},
                     .cluster_token = kToken,
                     .log_path = log,
                     .port = port})
      .proc;
}

double Scrape(int port, const std::string& name) { return ScrapeMetricAt(port, name); }

TEST(PdServe, ReadModeAnswersEqualColocatedAndDrains) {
  const std::string dir = MakeTempDir("kvb_pd_serve");
  const std::string model = dir + "/tiny";
  ASSERT_EQ(MakeModel(model, "tiny", 5, 60'000), 0);

  // A bad config is refused at start with a message naming the key.
  Subprocess bad({KvbridgeBin(), "serve", model, "--port", std::to_string(FreePort()),
                  "--kv-transfer-config", R"({"kv_connector":"KVBridgeConnector","kv_role":"x"})"},
                 dir + "/bad.log");
  EXPECT_NE(bad.Wait(60'000), 0);
  EXPECT_NE(bad.ReadLog().find("kv_role"), std::string::npos) << bad.ReadLog();

  const int cport = FreePort(), pport = FreePort(), dport = FreePort();
  auto colo = Serve(model, cport, dir + "/colo.log", "");
  auto pre = Serve(model, pport, dir + "/prefill.log", "kv_producer");
  auto dec = Serve(model, dport, dir + "/decode.log", "kv_consumer");
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", cport, "/health", 60'000)) << colo->ReadLog();
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", pport, "/health", 60'000)) << pre->ReadLog();
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", dport, "/health", 60'000)) << dec->ReadLog();

  httplib::Headers tok{{"X-KVBridge-Cluster-Token", kToken}};
  httplib::Client pc("127.0.0.1", pport), dc("127.0.0.1", dport), cc("127.0.0.1", cport);
  for (auto* c : {&pc, &dc, &cc}) c->set_read_timeout(60, 0);
  int k = 0;
  for (int n : {1, 8}) {
    for (const std::string& prompt :
         {std::string("P/D in one line."), std::string(70, 'q') + " and a tail"}) {
      ++k;
      json body{{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
      body["kv_transfer_params"] = {{"do_remote_decode", true},
                                    {"transfer_id", "serve-" + std::to_string(k)}};
      auto pr = pc.Post("/v1/completions", tok, body.dump(), "application/json");
      ASSERT_TRUE(pr);
      ASSERT_EQ(pr->status, 200) << pr->body;
      json params = json::parse(pr->body).at("kv_transfer_params");
      json client{{"model", "tiny"},
                  {"prompt", prompt},
                  {"max_tokens", 8},
                  {"n", n},
                  {"temperature", n > 1 ? 1.0 : 0.0},
                  {"seed", 42},
                  {"logprobs", 5},
                  {"ignore_eos", true}};
      json dbody = client;
      dbody["kv_transfer_params"] = params;
      auto dr = dc.Post("/v1/completions", tok, dbody.dump(), "application/json");
      auto cr = cc.Post("/v1/completions", client.dump(), "application/json");
      ASSERT_TRUE(dr && cr);
      ASSERT_EQ(dr->status, 200) << dr->body;
      ASSERT_EQ(cr->status, 200) << cr->body;
      json a = json::parse(dr->body)["choices"], b = json::parse(cr->body)["choices"];
      ASSERT_EQ(a.size(), static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(a[i]["text"], b[i]["text"]) << "n=" << n << " i=" << i;
        // JSON numbers print floats round-trip exactly: equal text means bitwise-equal logprobs.
        EXPECT_EQ(a[i]["logprobs"].dump(), b[i]["logprobs"].dump()) << "n=" << n << " i=" << i;
      }
    }
  }
  // Drained on both sides, with no safety net used.
  EXPECT_TRUE(WaitFor(
      [&] {
        return Scrape(pport, "kvbridge_kv_blocks_held_for_transfer") == 0 &&
               Scrape(dport, "kvbridge_kv_transfers_inflight") == 0 &&
               Scrape(pport, "kvbridge_kv_transfer_table_entries") == 0;
      },
      5000));
  EXPECT_GT(Scrape(dport, "kvbridge_kv_transfer_bytes_total"), 0);
  for (int port : {pport, dport}) {
    EXPECT_EQ(Scrape(port, "kvbridge_kv_lease_expired_total"), 0);
    EXPECT_EQ(Scrape(port, "kvbridge_kv_notifications_ignored_total"), 0);
    EXPECT_EQ(Scrape(port, "kvbridge_kv_load_failures_total"), 0);
  }
}

// Two hosts, played by two network namespaces joined by a veth pair (issue 22): the prefill
// serves in namespace A (169.254.76.1), the decode in namespace B (169.254.76.2), each started
// with `ip netns exec` and --cluster-token (non-loopback hosts); the KV moves between them over
// tcp, then over ucx. The test plays the proxy from threads that join each namespace; answers
// must be bitwise those of a colocated engine in the test's own namespace, and both sides drain.
// Skips, saying why, when namespaces cannot be made (not root, no iproute2).
class PdServeNetns : public ::testing::TestWithParam<std::string> {};

bool Sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }

// Subprocess execs without a PATH search.
std::string IpBin() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "ip";
}

// `kvbridge serve` inside network namespace `ns` (ip netns exec), on host:port, with `extra` as
// kv_connector_extra_config and `args` after the others.
std::unique_ptr<Subprocess> ServeIn(const std::string& ns, const std::string& host,
                                    const std::string& model, int port, const std::string& role,
                                    const json& extra, const std::string& log,
                                    std::vector<std::string> args) {
  return SpawnServe({.model_dir = model,
                     .num_kv_blocks = 128,
                     .role = role,
                     .extra_config = extra,
                     .cluster_token = kToken,
                     .log_path = log,
                     .port = port,
                     .host = host,
                     .extra_args = std::move(args),
                     .launcher = {IpBin(), "netns", "exec", ns}})
      .proc;
}

// Runs `f` on a thread that joined network namespace `ns` (setns is per thread for CLONE_NEWNET).
void InNetns(const std::string& ns, const std::function<void()>& f) {
  std::thread t([&] {
    const int fd = ::open(("/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0) << ns;
    ASSERT_EQ(::setns(fd, CLONE_NEWNET), 0) << ns;
    ::close(fd);
    f();
  });
  t.join();
}

TEST_P(PdServeNetns, ReadModeAcrossNamespacesEqualsColocated) {
  const std::string transport = GetParam();
  const std::string tag = std::to_string(::getpid() % 100000);
  const std::string na = "kvbpd-a-" + tag, nb = "kvbpd-b-" + tag, va = "vpa" + tag,
                    vb = "vpb" + tag;
  if (!Sh("ip netns add " + na))
    GTEST_SKIP() << "ip netns does not work here (need root and iproute2)";
  struct Cleanup {
    std::string a, b;
    ~Cleanup() {
      Sh("ip netns del " + a);
      Sh("ip netns del " + b);
    }
  } cleanup{na, nb};
  const std::string ha = "169.254.76.1", hb = "169.254.76.2";
  const bool ok =
      Sh("ip netns add " + nb) &&
      Sh("ip link add " + va + " netns " + na + " type veth peer name " + vb + " netns " + nb) &&
      Sh("ip -n " + na + " addr add " + ha + "/30 dev " + va) &&
      Sh("ip -n " + nb + " addr add " + hb + "/30 dev " + vb) &&
      Sh("ip -n " + na + " link set " + va + " up") &&
      Sh("ip -n " + nb + " link set " + vb + " up") && Sh("ip -n " + na + " link set lo up") &&
      Sh("ip -n " + nb + " link set lo up");
  if (!ok) GTEST_SKIP() << "could not create a veth pair between network namespaces";
  // UCX's tcp transport offers only running links: wait for both ends (bounded).
  ASSERT_TRUE(WaitFor(
      [&] {
        return Sh("ip -n " + na + " link show dev " + va + " | grep -q 'state UP'") &&
               Sh("ip -n " + nb + " link show dev " + vb + " | grep -q 'state UP'");
      },
      5000))
      << "the veth pair did not come up";

  const std::string dir = MakeTempDir("kvb_pd_netns");
  const std::string model = dir + "/tiny";
  ASSERT_EQ(MakeModel(model, "tiny", 5, 60'000), 0);
  const int cport = FreePort(), pport = FreePort(), dport = FreePort();
  const json extra = {{"transport", transport}, {"lease_ms", 30000}};
  auto serve_in = [&](const std::string& ns, const std::string& host, int port,
                      const std::string& role, const std::string& log) {
    return ServeIn(ns, host, model, port, role, extra, log, {});
  };
  auto colo = Serve(model, cport, dir + "/colo.log", "");
  auto pre = serve_in(na, ha, pport, "kv_producer", dir + "/prefill.log");
  auto dec = serve_in(nb, hb, dport, "kv_consumer", dir + "/decode.log");
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", cport, "/health", 60'000)) << colo->ReadLog();
  bool up = false;
  InNetns(na, [&] { up = WaitForHttpOk(ha, pport, "/health", 60'000); });
  ASSERT_TRUE(up) << pre->ReadLog();
  InNetns(nb, [&] { up = WaitForHttpOk(hb, dport, "/health", 60'000); });
  ASSERT_TRUE(up) << dec->ReadLog();

  httplib::Headers tok{{"X-KVBridge-Cluster-Token", kToken}};
  httplib::Client cc("127.0.0.1", cport);
  cc.set_read_timeout(60, 0);
  int k = 0;
  for (int n : {1, 4}) {
    ++k;
    const std::string prompt =
        std::string(40, 'q') + " across two hosts, request " + std::to_string(k);
    json body{{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
    body["kv_transfer_params"] = {{"do_remote_decode", true},
                                  {"transfer_id", "netns-" + transport + "-" + std::to_string(k)}};
    json params;
    InNetns(na, [&] {
      httplib::Client pc(ha, pport);
      pc.set_read_timeout(60, 0);
      auto pr = pc.Post("/v1/completions", tok, body.dump(), "application/json");
      ASSERT_TRUE(pr);
      ASSERT_EQ(pr->status, 200) << pr->body;
      params = json::parse(pr->body).at("kv_transfer_params");
    });
    ASSERT_FALSE(params.is_null()) << pre->ReadLog();
    EXPECT_EQ(params.at("remote_host"), ha);
    json client{{"model", "tiny"},    {"prompt", prompt}, {"max_tokens", 8}, {"n", n},
                {"temperature", 1.0}, {"seed", 42},       {"logprobs", 5},   {"ignore_eos", true}};
    json dbody = client;
    dbody["kv_transfer_params"] = params;
    std::string dtext;
    InNetns(nb, [&] {
      httplib::Client dc(hb, dport);
      dc.set_read_timeout(60, 0);
      auto dr = dc.Post("/v1/completions", tok, dbody.dump(), "application/json");
      ASSERT_TRUE(dr);
      ASSERT_EQ(dr->status, 200) << dr->body;
      dtext = dr->body;
    });
    ASSERT_FALSE(dtext.empty()) << dec->ReadLog();
    auto cr = cc.Post("/v1/completions", client.dump(), "application/json");
    ASSERT_TRUE(cr);
    ASSERT_EQ(cr->status, 200) << cr->body;
    json a = json::parse(dtext)["choices"], b = json::parse(cr->body)["choices"];
    ASSERT_EQ(a.size(), static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(a[i]["text"], b[i]["text"]) << transport << " n=" << n << " i=" << i;
      EXPECT_EQ(a[i]["logprobs"].dump(), b[i]["logprobs"].dump()) << transport << " n=" << n;
    }
  }
  // The KV crossed the link (the decode loaded it, nothing was recomputed) and both sides drain.
  double bytes = 0, fails = -1;
  bool drained = false;
  InNetns(nb, [&] {
    httplib::Client m(hb, dport);
    auto get = [&](const std::string& name) {
      auto r = m.Get("/metrics");
      return r ? ScrapeMetric(r->body, name) : -2.0;
    };
    bytes = get("kvbridge_kv_transfer_bytes_total");
    fails = get("kvbridge_kv_load_failures_total");
    drained = WaitFor([&] { return get("kvbridge_kv_transfers_inflight") == 0; }, 5000);
  });
  EXPECT_GT(bytes, 0);
  EXPECT_EQ(fails, 0);
  EXPECT_TRUE(drained);
  InNetns(na, [&] {
    httplib::Client m(ha, pport);
    auto get = [&](const std::string& name) {
      auto r = m.Get("/metrics");
      return r ? ScrapeMetric(r->body, name) : -2.0;
    };
    drained = WaitFor(
        [&] {
          return get("kvbridge_kv_blocks_held_for_transfer") == 0 &&
                 get("kvbridge_kv_transfer_table_entries") == 0;
        },
        5000);
    EXPECT_EQ(ScrapeMetric(m.Get("/metrics")->body, "kvbridge_kv_handshake_refused_total",
                           "side=\"serve\""),
              0);
  });
  EXPECT_TRUE(drained);
}

INSTANTIATE_TEST_SUITE_P(Transports, PdServeNetns, ::testing::Values("tcp", "ucx"),
                         [](const auto& info) { return info.param; });

// The topology of issue 22 across the two namespaces: `kvbridge proxy` and the prefill in A, the
// decode in B, over tcp and ucx, in READ and WRITE mode (param "transport-mode"). The client (a
// thread in A) talks to the proxy only; answers bitwise equal to a colocated engine; drained.
class PdProxyNetns : public ::testing::TestWithParam<std::string> {};

TEST_P(PdProxyNetns, ProxyAndPrefillInOneNamespaceDecodeInAnother) {
  const std::string transport = GetParam().substr(0, GetParam().find('-'));
  const std::string mode = GetParam().substr(GetParam().find('-') + 1);
  const std::string tag = std::to_string(::getpid() % 100000);
  const std::string na = "kvbpx-a-" + tag, nb = "kvbpx-b-" + tag, va = "vxa" + tag,
                    vb = "vxb" + tag;
  if (!Sh("ip netns add " + na))
    GTEST_SKIP() << "ip netns does not work here (need root and iproute2)";
  struct Cleanup {
    std::string a, b;
    ~Cleanup() {
      Sh("ip netns del " + a);
      Sh("ip netns del " + b);
    }
  } cleanup{na, nb};
  const std::string ha = "169.254.75.1", hb = "169.254.75.2";
  const bool ok =
      Sh("ip netns add " + nb) &&
      Sh("ip link add " + va + " netns " + na + " type veth peer name " + vb + " netns " + nb) &&
      Sh("ip -n " + na + " addr add " + ha + "/30 dev " + va) &&
      Sh("ip -n " + nb + " addr add " + hb + "/30 dev " + vb) &&
      Sh("ip -n " + na + " link set " + va + " up") &&
      Sh("ip -n " + nb + " link set " + vb + " up") && Sh("ip -n " + na + " link set lo up") &&
      Sh("ip -n " + nb + " link set lo up");
  if (!ok) GTEST_SKIP() << "could not create a veth pair between network namespaces";
  ASSERT_TRUE(WaitFor(
      [&] {
        return Sh("ip -n " + na + " link show dev " + va + " | grep -q 'state UP'") &&
               Sh("ip -n " + nb + " link show dev " + vb + " | grep -q 'state UP'");
      },
      5000))
      << "the veth pair did not come up";

  const std::string dir = MakeTempDir("kvb_pd_proxy_netns");
  const std::string model = dir + "/tiny";
  ASSERT_EQ(MakeModel(model, "tiny", 5, 60'000), 0);
  const int cport = FreePort(), pport = FreePort(), dport = FreePort(), xport = FreePort();
  const json extra = {{"transport", transport}, {"mode", mode}, {"lease_ms", 30000}};
  auto serve_in = [&](const std::string& ns, const std::string& host, int port,
                      const std::string& role, const std::string& log) {
    return ServeIn(ns, host, model, port, role, extra, log,
                   {"--proxy", ha + ":" + std::to_string(xport)});
  };
  // The engines register with the proxy (engine ids, roles, mode) and heartbeat to it.
  Subprocess proxy({IpBin(), "netns", "exec", na, KvbridgeBin(), "proxy", "--host", ha, "--port",
                    std::to_string(xport), "--mode", mode, "--cluster-token", kToken},
                   dir + "/proxy.log");
  auto colo = Serve(model, cport, dir + "/colo.log", "");
  auto pre = serve_in(na, ha, pport, "kv_producer", dir + "/prefill.log");
  auto dec = serve_in(nb, hb, dport, "kv_consumer", dir + "/decode.log");

  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", cport, "/health", 60'000)) << colo->ReadLog();
  bool up = false;
  InNetns(na, [&] { up = WaitForHttpOk(ha, pport, "/health", 60'000); });
  ASSERT_TRUE(up) << pre->ReadLog();
  InNetns(nb, [&] { up = WaitForHttpOk(hb, dport, "/health", 60'000); });
  ASSERT_TRUE(up) << dec->ReadLog();
  InNetns(na, [&] {
    httplib::Client px(ha, xport);
    up = WaitFor(
        [&] {
          auto r = px.Get("/health");
          if (!r || r->status != 200) return false;
          json j = json::parse(r->body, nullptr, false);
          return j.is_object() && j.value("prefill_healthy", 0) >= 1 &&
                 j.value("decode_healthy", 0) >= 1;
        },
        60'000);
  });
  ASSERT_TRUE(up) << proxy.ReadLog() << pre->ReadLog() << dec->ReadLog();

  httplib::Client cc("127.0.0.1", cport);
  cc.set_read_timeout(60, 0);
  for (int n : {1, 4}) {
    json client{{"model", "tiny"},
                {"prompt", std::string(40, 'w') + " " + GetParam() + " n=" + std::to_string(n)},
                {"max_tokens", 8},
                {"n", n},
                {"temperature", 1.0},
                {"seed", 42},
                {"logprobs", 5},
                {"ignore_eos", true}};
    std::string via_proxy;
    InNetns(na, [&] {
      httplib::Client px(ha, xport);
      px.set_read_timeout(60, 0);
      auto r = px.Post("/v1/completions", client.dump(), "application/json");
      ASSERT_TRUE(r);
      ASSERT_EQ(r->status, 200) << r->body;
      via_proxy = r->body;
    });
    ASSERT_FALSE(via_proxy.empty()) << proxy.ReadLog();
    auto cr = cc.Post("/v1/completions", client.dump(), "application/json");
    ASSERT_TRUE(cr);
    ASSERT_EQ(cr->status, 200) << cr->body;
    json a = json::parse(via_proxy)["choices"], b = json::parse(cr->body)["choices"];
    ASSERT_EQ(a.size(), static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(a[i]["text"], b[i]["text"]) << GetParam() << " n=" << n << " i=" << i;
      EXPECT_EQ(a[i]["logprobs"].dump(), b[i]["logprobs"].dump()) << GetParam() << " n=" << n;
    }
  }
  // The KV crossed the link on the decode's side, nothing recomputed, both sides drained.
  double bytes = 0, fails = -1;
  bool drained = false;
  InNetns(nb, [&] {
    httplib::Client m(hb, dport);
    auto get = [&](const std::string& name) {
      auto r = m.Get("/metrics");
      return r ? ScrapeMetric(r->body, name) : -2.0;
    };
    fails = get("kvbridge_kv_load_failures_total");
    bytes = get("kvbridge_kv_transfer_bytes_total");
    drained = WaitFor([&] { return get("kvbridge_kv_transfers_inflight") == 0; }, 5000);
  });
  EXPECT_EQ(fails, 0);
  EXPECT_TRUE(drained);
  double pbytes = 0;
  InNetns(na, [&] {
    httplib::Client m(ha, pport);
    auto get = [&](const std::string& name) {
      auto r = m.Get("/metrics");
      return r ? ScrapeMetric(r->body, name) : -2.0;
    };
    pbytes = get("kvbridge_kv_transfer_bytes_total");
    drained = WaitFor(
        [&] {
          return get("kvbridge_kv_blocks_held_for_transfer") == 0 &&
                 get("kvbridge_kv_transfer_table_entries") == 0;
        },
        5000);
  });
  EXPECT_TRUE(drained);
  // READ: the decode pulled; WRITE: the prefill pushed. Either way bytes crossed.
  EXPECT_GT(std::max(bytes, pbytes), 0) << "no KV bytes counted on either side";
}

INSTANTIATE_TEST_SUITE_P(TransportsAndModes, PdProxyNetns,
                         ::testing::Values("tcp-read", "tcp-write", "ucx-read", "ucx-write"),
                         [](const auto& info) {
                           std::string n = info.param;
                           n[n.find('-')] = '_';
                           return n;
                         });

}  // namespace
}  // namespace kvbridge
