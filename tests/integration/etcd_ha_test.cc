// Issue 25: the control plane on etcd, end to end. A 3-member etcd cluster (Debian's etcd-server,
// started here on free loopback ports), 2 proxies (`proxy --etcd`) and 1p2d engines
// (`serve --etcd`, lease TTL 2 s), tiny model; two clients round-robin over the proxies. Then,
// under that load: a forged and a malformed record are ignored (logged, never routed to); one
// proxy is SIGKILLed (the other serves, no engine notices) and started again (it lists the
// cluster from etcd: no engine re-registers); an engine is SIGKILLed (both proxies drop it
// within its lease TTL); the etcd leader is SIGKILLed (service continues, registrations
// survive). Skips, saying why, without /usr/bin/etcd or a `serve --etcd`.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/common/http_client.h"
#include "kvbridge/proxy/etcd.h"
#include "support/free_port.h"
#include "support/subprocess.h"

namespace kvbridge {
namespace {

using nlohmann::json;
using testing::KvbridgeBin;
using testing::Subprocess;
using Clock = std::chrono::steady_clock;

constexpr const char* kEtcd = "/usr/bin/etcd";
constexpr const char* kToken = "etcd-ha-test-token";
constexpr const char* kCluster = "hatest";

std::string HelpOf(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(("'" + KvbridgeBin() + "' " + cmd + " --help 2>&1").c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

json GetJson(int port, const std::string& path) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(1, 0);
  c.set_read_timeout(5, 0);
  auto r = c.Get(path.c_str());
  if (!r || r->status != 200) return json();
  return json::parse(r->body, nullptr, false);
}

json PostJson(int port, const std::string& path, const json& body) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(1, 0);
  c.set_read_timeout(5, 0);
  auto r = c.Post(path.c_str(), body.dump(), "application/json");
  if (!r) return json();
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return json();
  j["_status"] = r->status;
  return j;
}

// The names of the instances a proxy lists (healthy or not).
std::vector<std::string> Names(int proxy_port) {
  std::vector<std::string> names;
  json j = GetJson(proxy_port, "/instances");
  if (!j.is_object() || !j["instances"].is_array()) return {"<no answer>"};
  for (const auto& i : j["instances"]) names.push_back(i.value("name", "?"));
  std::sort(names.begin(), names.end());
  return names;
}

template <typename F>
bool WaitUntil(F pred, double seconds) {
  const auto t0 = Clock::now();
  while (SecondsSince(t0) < seconds) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pred();
}

struct EtcdMember {
  std::string name;
  int client_port = 0;
  int peer_port = 0;
  std::unique_ptr<Subprocess> proc;
  std::string client_url() const { return "http://127.0.0.1:" + std::to_string(client_port); }
};

TEST(EtcdControlPlane, TwoProxiesOneClusterSurviveProxyEngineAndLeaderLoss) {
  if (::access(kEtcd, X_OK) != 0) GTEST_SKIP() << kEtcd << " not installed (apt etcd-server)";
  if (::access(KvbridgeBin().c_str(), X_OK) != 0) GTEST_SKIP() << "kvbridge not built";
  if (HelpOf("serve").find("--etcd") == std::string::npos) GTEST_SKIP() << "no serve --etcd";
  const auto t_start = Clock::now();
  const std::string bin = KvbridgeBin();
  const std::string dir = testing::MakeTempDir("kvb-etcdha-");

  // 3 etcd members on loopback; fast elections (heartbeat 100 ms, election timeout 500 ms).
  std::vector<EtcdMember> members(3);
  std::string initial, endpoints;
  for (int i = 0; i < 3; ++i) {
    members[i].name = "m" + std::to_string(i);
    members[i].client_port = testing::FreePort();
    members[i].peer_port = testing::FreePort();
    initial += (i ? "," : "") + members[i].name +
               "=http://127.0.0.1:" + std::to_string(members[i].peer_port);
    endpoints += (i ? "," : "") + members[i].client_url();
  }
  for (auto& m : members) {
    const std::string peer = "http://127.0.0.1:" + std::to_string(m.peer_port);
    m.proc = std::make_unique<Subprocess>(std::vector<std::string>{kEtcd,
                                                                   "--name",
                                                                   m.name,
                                                                   "--data-dir",
                                                                   dir + "/" + m.name,
                                                                   "--listen-client-urls",
                                                                   m.client_url(),
                                                                   "--advertise-client-urls",
                                                                   m.client_url(),
                                                                   "--listen-peer-urls",
                                                                   peer,
                                                                   "--initial-advertise-peer-urls",
                                                                   peer,
                                                                   "--initial-cluster",
                                                                   initial,
                                                                   "--initial-cluster-state",
                                                                   "new",
                                                                   "--heartbeat-interval",
                                                                   "100",
                                                                   "--election-timeout",
                                                                   "500"},
                                          dir + "/" + m.name + ".log");
  }
  for (auto& m : members) {
    ASSERT_TRUE(testing::WaitForHttpOk("127.0.0.1", m.client_port, "/health", 20'000))
        << m.proc->ReadLog();
  }

  const std::string model = dir + "/model";
  Subprocess make({bin, "make-model", "--preset", "tiny", "--seed", "0", "--out", model},
                  dir + "/make-model.log");
  ASSERT_EQ(make.Wait(120'000), 0) << make.ReadLog();

  // 2 proxies, one cluster.
  const int proxy_ports[2] = {testing::FreePort(), testing::FreePort()};
  auto proxy_argv = [&](int i) {
    return std::vector<std::string>{bin,
                                    "proxy",
                                    "--port",
                                    std::to_string(proxy_ports[i]),
                                    "--etcd",
                                    endpoints,
                                    "--etcd-cluster",
                                    kCluster,
                                    "--cluster-token",
                                    kToken,
                                    "--instance-wait-ms",
                                    "10000"};
  };
  std::unique_ptr<Subprocess> proxies[2];
  for (int i = 0; i < 2; ++i) {
    proxies[i] =
        std::make_unique<Subprocess>(proxy_argv(i), dir + "/proxy-" + std::to_string(i) + ".log");
  }
  // 1p2d, each writing its record on a lease of 2 s.
  const char* names[3] = {"prefill-0", "decode-0", "decode-1"};
  std::unique_ptr<Subprocess> engines[3];
  for (int i = 0; i < 3; ++i) {
    json cfg = {{"kv_connector", "KVBridgeConnector"},
                {"kv_role", i == 0 ? "kv_producer" : "kv_consumer"},
                {"kv_connector_extra_config", {{"mode", "read"}, {"transport", "auto"}}}};
    engines[i] =
        std::make_unique<Subprocess>(std::vector<std::string>{bin,
                                                              "serve",
                                                              model,
                                                              "--host",
                                                              "127.0.0.1",
                                                              "--port",
                                                              "0",
                                                              "--port-file",
                                                              dir + "/" + names[i] + ".port",
                                                              "--kv-transfer-config",
                                                              cfg.dump(),
                                                              "--cluster-token",
                                                              kToken,
                                                              "--no-enable-prefix-caching",
                                                              "--etcd",
                                                              endpoints,
                                                              "--etcd-cluster",
                                                              kCluster,
                                                              "--instance-name",
                                                              names[i],
                                                              "--etcd-lease-ttl-s",
                                                              "2"},
                                     dir + "/" + names[i] + ".log");
  }
  const std::vector<std::string> all = {"decode-0", "decode-1", "prefill-0"};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(WaitUntil([&] { return Names(proxy_ports[i]) == all; }, 120))
        << "proxy " << i << " lists " << json(Names(proxy_ports[i])).dump() << "\n"
        << proxies[i]->ReadLog();
  }
  const double ready_s = SecondsSince(t_start);

  // A forged record (HMAC under another token) naming an "engine" the test runs, and a malformed
  // one: written straight into etcd, as anyone with write access could.
  std::atomic<int> evil_hits{0};
  httplib::Server evil;
  evil.Post(".*", [&](const httplib::Request&, httplib::Response& res) {
    ++evil_hits;
    res.set_content(R"({"choices":[{"text":"pwned"}]})", "application/json");
  });
  const int evil_port = evil.bind_to_any_port("127.0.0.1");
  std::thread evil_thread([&] { evil.listen_after_bind(); });
  const std::string prefix = "/kvbridge/" + std::string(kCluster) + "/instances/";
  for (const std::string role : {"prefill", "decode"}) {
    const std::string key = prefix + "evil-" + role;
    json rec = {{"role", role},
                {"url", "http://127.0.0.1:" + std::to_string(evil_port)},
                {"mode", "read"},
                {"name", "evil-" + role}};
    json put = {{"key", proxy::Base64Encode(key)},
                {"value", proxy::Base64Encode(proxy::EtcdRecordValue(key, rec.dump(), "guess"))}};
    ASSERT_EQ(PostJson(members[0].client_port, "/v3/kv/put", put)["_status"], 200);
  }
  json junk = {{"key", proxy::Base64Encode(prefix + "junk")},
               {"value", proxy::Base64Encode("{\"record\": 12")}};
  ASSERT_EQ(PostJson(members[1].client_port, "/v3/kv/put", junk)["_status"], 200);

  // Load: two clients, round-robin over the proxies; a proxy that cannot be reached (killed)
  // is skipped for the other — what a client with two front doors does.
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0}, retried{0};
  // Requests in flight on decode-1 when it is SIGKILLed may fail (at most one per client): they
  // are counted apart; any other failure fails the test.
  std::atomic<bool> engine_kill_window{false};
  std::atomic<int> failed_at_engine_kill{0};
  std::mutex fail_mu;
  std::string first_failure;
  std::vector<std::thread> clients;
  for (int c = 0; c < 2; ++c) {
    clients.emplace_back([&, c] {
      const json body = {{"prompt", "The quick brown fox"}, {"max_tokens", 6}, {"temperature", 0}};
      for (int i = c; !stop; ++i) {
        bool done = false;
        std::string why;
        for (int attempt = 0; attempt < 2 && !done; ++attempt) {
          const int port = proxy_ports[(i + attempt) % 2];
          httplib::Client cli("127.0.0.1", port);
          cli.set_connection_timeout(1, 0);
          cli.set_read_timeout(30, 0);
          auto r = cli.Post("/v1/completions", body.dump(), "application/json");
          if (!r) {
            why = "proxy :" + std::to_string(port) + " " + httplib::to_string(r.error());
            if (attempt == 0) ++retried;
            continue;
          }
          if (r->status == 200 && r->body.find("pwned") == std::string::npos) {
            done = true;
          } else {
            why = std::to_string(r->status) + " " + r->body;
            break;
          }
        }
        if (done) {
          ++ok;
        } else if (engine_kill_window) {
          ++failed_at_engine_kill;
        } else {
          ++failed;
          std::lock_guard<std::mutex> lock(fail_mu);
          if (first_failure.empty()) first_failure = why;
        }
      }
    });
  }
  auto wait_ok = [&](int more) {
    const int target = ok + more;
    return WaitUntil([&] { return ok >= target; }, 60);
  };
  ASSERT_TRUE(wait_ok(6));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Names(proxy_ports[i]), all) << "a bad record is listed by proxy " << i;
    const std::string log = proxies[i]->ReadLog();
    EXPECT_NE(log.find("record " + prefix + "evil-decode ignored: its HMAC does not verify"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("record " + prefix + "junk ignored"), std::string::npos) << log;
  }

  // 1. SIGKILL proxy 0 under load: proxy 1 serves; no engine notices (none restarted, none
  // re-registers). Then proxy 0 comes back and lists the cluster from etcd alone.
  const auto t_kill_proxy = Clock::now();
  proxies[0]->Signal(SIGKILL);
  proxies[0]->Wait(5000);
  ASSERT_TRUE(wait_ok(6));
  proxies[0] = std::make_unique<Subprocess>(proxy_argv(0), dir + "/proxy-0.restarted.log");
  ASSERT_TRUE(WaitUntil([&] { return Names(proxy_ports[0]) == all; }, 30)) << proxies[0]->ReadLog();
  const double proxy_back_s = SecondsSince(t_kill_proxy);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(engines[i]->Running()) << names[i];
    // One registration per engine: the record was written once (the lease never lapsed).
    const std::string log = engines[i]->ReadLog();
    size_t count = 0;
    for (size_t p = log.find("etcd: registered"); p != std::string::npos;
         p = log.find("etcd: registered", p + 1)) {
      ++count;
    }
    EXPECT_EQ(count, 1u) << names[i] << ":\n" << log;
  }
  ASSERT_TRUE(wait_ok(4));

  // 2. SIGKILL decode-1: both proxies drop it within its lease TTL (2 s; + etcd's expiry check
  // and the watch's delivery).
  const auto t_kill_engine = Clock::now();
  engine_kill_window = true;
  engines[2]->Signal(SIGKILL);
  engines[2]->Wait(5000);
  const std::vector<std::string> left = {"decode-0", "prefill-0"};
  double dropped_s[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(WaitUntil([&] { return Names(proxy_ports[i]) == left; }, 6))
        << json(Names(proxy_ports[i])).dump();
    dropped_s[i] = SecondsSince(t_kill_engine);
  }
  EXPECT_LT(dropped_s[1], 2.0 + 1.5);
  ASSERT_TRUE(wait_ok(2));
  engine_kill_window = false;
  EXPECT_LE(failed_at_engine_kill.load(), 2);
  ASSERT_TRUE(wait_ok(4));

  // 3. SIGKILL the etcd leader: requests keep being answered, and after more than two lease
  // TTLs both proxies still list the two engines (their keepalives moved to a live member).
  int leader = -1;
  for (int i = 0; i < 3 && leader < 0; ++i) {
    json st = PostJson(members[i].client_port, "/v3/maintenance/status", json::object());
    if (st.is_object() && st.contains("leader") &&
        st["header"].value("member_id", "") == st["leader"].get<std::string>()) {
      leader = i;
    }
  }
  ASSERT_GE(leader, 0) << "no etcd leader found";
  const int ok_before_leader = ok;
  members[leader].proc->Signal(SIGKILL);
  members[leader].proc->Wait(5000);
  std::this_thread::sleep_for(std::chrono::milliseconds(5000));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Names(proxy_ports[i]), left) << "proxy " << i << " after the leader's death";
  }
  ASSERT_TRUE(wait_ok(4));
  const int ok_after_leader = ok - ok_before_leader;

  stop = true;
  for (auto& t : clients) t.join();
  EXPECT_EQ(failed.load(), 0) << "first failure: " << first_failure;
  EXPECT_EQ(evil_hits.load(), 0) << "a forged record was routed to";
  std::printf(
      "EtcdControlPlane: ready in %.1f s; %d requests 200, %d failed (+%d in flight on the "
      "killed decode), %d retried on the other proxy; killed proxy listing the cluster again %.1f "
      "s after its SIGKILL; decode-1 dropped "
      "by the proxies %.2f / %.2f s after its SIGKILL (lease TTL 2 s); %d answered across the "
      "etcd leader's SIGKILL (member m%d); total %.1f s\n",
      ready_s, ok.load(), failed.load(), failed_at_engine_kill.load(), retried.load(), proxy_back_s,
      dropped_s[0], dropped_s[1], ok_after_leader, leader, SecondsSince(t_start));
  evil.stop();
  evil_thread.join();
  for (auto& e : engines) {
    if (e->Running()) e->Signal(SIGTERM);
  }
  for (auto& e : engines) e->Wait(30'000);
  for (auto& p : proxies) p->Signal(SIGTERM);
  for (auto& p : proxies) p->Wait(10'000);
  for (auto& m : members) {
    if (m.proc->Running()) m.proc->Signal(SIGTERM);
    m.proc->Wait(10'000);
  }
}

}  // namespace
}  // namespace kvbridge
