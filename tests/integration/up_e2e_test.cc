// End to end with real engines: `kvbridge up 1p1d` / `1p3d` (READ mode, prefix caching off), greedy
// answers through the proxy equal to one colocated engine's (n>1, streaming and not),
// client-supplied kv_transfer_params without effect, `kvbridge bench --check-drain` exits 0, and
// SIGTERM stops the topology with exit 0; WRITE mode too, also with TP 2 prefills (2x2, 2x1);
// `up 1p1d --prefill-forward-n` under concurrency 16 with n=8 drains clean; the qwen3-0.6b preset
// (real shape, Qwen3 tokenizer) P/D bitwise equal to colocated. Skips, saying why,
// while the engine does not speak P/D.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/common/metrics.h"
#include "support/free_port.h"
#include "support/subprocess.h"
#include "support/up_harness.h"

namespace kvbridge {
namespace {

using nlohmann::json;
using testing::ExpectEveryInstanceDrained;
using testing::GetBody;
using testing::KvbridgeBin;
using testing::Subprocess;

std::string Capture(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

std::string SkipReason() {
  std::string bin = KvbridgeBin();
  if (::access(bin.c_str(), X_OK) != 0) return "kvbridge binary not built at " + bin;
  std::string help = Capture("'" + bin + "' serve --help 2>&1");
  if (help.find("--kv-transfer-config") == std::string::npos) {
    return "`kvbridge serve` does not advertise --kv-transfer-config (P/D not built yet)";
  }
  if (Capture("'" + bin + "' --help 2>&1").find(" up ") == std::string::npos) {
    return "`kvbridge up` is not in this build";
  }
  return "";
}

json Post(int port, const std::string& path, const json& body) {
  return testing::PostJson(port, path, body);
}

// The concatenated text of choice `index` of an SSE completion stream.
std::string StreamText(int port, const json& body, int index) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(120, 0);
  std::string all;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    all.append(d, n);
    return true;
  };
  auto r = c.send(req);
  if (!r || r->status != 200) return "<error>";
  std::string text;
  size_t pos = 0;
  while ((pos = all.find("data: ", pos)) != std::string::npos) {
    size_t end = all.find("\n\n", pos);
    std::string ev =
        all.substr(pos + 6, end == std::string::npos ? std::string::npos : end - pos - 6);
    pos = end == std::string::npos ? all.size() : end;
    json j = json::parse(ev, nullptr, false);
    if (j.is_discarded() || !j.contains("choices")) continue;
    for (const auto& ch : j["choices"]) {
      if (ch.value("index", -1) == index) text += ch.value("text", "");
    }
  }
  return text;
}

// One colocated engine on `model` (the reference the P/D answers must equal), healthy; *port
// is its port. Null (after a failure) when it did not come up.
std::unique_ptr<Subprocess> StartSolo(const std::string& dir, const std::string& model, int* port,
                                      int timeout_ms = 120'000) {
  *port = testing::FreePort();
  auto solo = std::make_unique<Subprocess>(
      std::vector<std::string>{KvbridgeBin(), "serve", model, "--port", std::to_string(*port),
                               "--no-enable-prefix-caching"},
      dir + "/solo.log");
  if (!testing::WaitForHttpOk("127.0.0.1", *port, "/health", timeout_ms)) {
    ADD_FAILURE() << solo->ReadLog();
    return nullptr;
  }
  return solo;
}

class UpEndToEnd : public ::testing::TestWithParam<std::string> {};

TEST_P(UpEndToEnd, GreedyAnswersMatchColocatedAndKvDrains) {
  std::string why = SkipReason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string bin = KvbridgeBin();
  const std::string dir = testing::MakeTempDir("kvb-up-");
  const std::string model = dir + "/model";
  ASSERT_EQ(testing::MakeModel(model, "tiny", 0, 300'000), 0);
  int solo_port = 0;
  auto solo = StartSolo(dir, model, &solo_port);
  ASSERT_TRUE(solo);

  // The parameter is "TOPOLOGY", "TOPOLOGY:MODE" or "TOPOLOGY:MODE:tpPxD" (prefill TP P, decode
  // TP D).
  const std::string param = GetParam();
  const size_t colon = param.find(':');
  const std::string topology = param.substr(0, colon);
  std::string mode = colon == std::string::npos ? "read" : param.substr(colon + 1);
  int prefill_tp = 1, decode_tp = 1;
  if (const size_t c2 = mode.find(":tp"); c2 != std::string::npos) {
    ASSERT_EQ(std::sscanf(mode.c_str() + c2, ":tp%dx%d", &prefill_tp, &decode_tp), 2) << param;
    mode.resize(c2);
  }
  testing::UpTopology up(
      dir, {topology, "--mode", mode, "--model", model, "--no-prefix-caching", "--prefill-tp",
            std::to_string(prefill_tp), "--decode-tp", std::to_string(decode_tp)});
  ASSERT_TRUE(up.WaitReady()) << up.ReadLog();
  const int port = up.port();

  json body = {{"prompt", "The quick brown fox jumps over the lazy dog and"},
               {"max_tokens", 12},
               {"temperature", 0},
               {"n", 3}};
  json want = Post(solo_port, "/v1/completions", body);
  ASSERT_EQ(want["_status"], 200) << want.dump();
  json got = Post(port, "/v1/completions", body);
  ASSERT_EQ(got["_status"], 200) << got.dump();
  ASSERT_EQ(got["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got["choices"][i]["text"], want["choices"][0]["text"]) << "choice " << i;
  }
  // Client-supplied kv_transfer_params have no effect.
  json sneaky = body;
  sneaky["kv_transfer_params"] = {
      {"do_remote_prefill", true}, {"remote_block_ids", {0, 1, 2}}, {"transfer_id", "mine"}};
  json got2 = Post(port, "/v1/completions", sneaky);
  ASSERT_EQ(got2["_status"], 200) << got2.dump();
  EXPECT_EQ(got2["choices"][0]["text"], want["choices"][0]["text"]);
  // Streaming, n=2: the same greedy text.
  json sbody = body;
  sbody["stream"] = true;
  sbody["n"] = 2;
  EXPECT_EQ(StreamText(port, sbody, 1), want["choices"][0]["text"].get<std::string>());

  // TP engines run their ranks as threads on the same few cores: a shorter bench keeps the test
  // time small.
  const bool tp = prefill_tp > 1 || decode_tp > 1;
  Subprocess bench({bin, "bench", "--host", up.host(), "--samples", tp ? "4" : "12", "--batches",
                    tp ? "2" : "2,4", "--best-of-n", "4", "--input-tokens", "200",
                    "--output-tokens", "12", "--check-drain", "--drain-timeout", "5"},
                   dir + "/bench.log");
  EXPECT_EQ(bench.Wait(300'000), 0) << bench.ReadLog();

  // Every instance drained with no safety net used, and registered its TP size (the WRITE decode
  // leg names the prefill's).
  const json instances = ExpectEveryInstanceDrained(up.host());
  EXPECT_EQ(instances.size(), 1u + static_cast<size_t>(topology[2] - '0')) << instances.dump();
  for (const auto& i : instances) {
    EXPECT_EQ(i["tp_size"], i["role"] == "prefill" ? prefill_tp : decode_tp) << i.dump();
  }
  EXPECT_EQ(up.Stop(), 0) << up.ReadLog();
}

// "1p1d:write" also guards the proxy against a WRITE flow whose prefill leg ends after the decode
// leg answered (it once left the client's keep-alive connection unread forever). The ":tp" cases
// run WRITE with a TP 2 prefill through the proxy: the decode leg names tp_size 2 from the
// prefill's registration (tiny model: 2 KV heads, so Tp = Td pairs rank to rank and (2, 1) has
// the decode's one rank take a head from each prefill rank).
INSTANTIATE_TEST_SUITE_P(Topologies, UpEndToEnd,
                         ::testing::Values("1p1d", "1p3d", "1p1d:write", "1p3d:write",
                                           "1p1d:write:tp2x2", "1p1d:write:tp2x1"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == ':') c = '_';
                           }
                           return name;
                         });

const json kSmallRequest = {
    {"prompt", "The quick brown fox"}, {"max_tokens", 6}, {"temperature", 0}};

// The supervision tests (issue 21): `up TOPOLOGY` on the tiny model, prefix caching off, a cluster
// token and a restart policy in its --config file (as a user would write one); `load` is the
// light load the drains and restarts happen under.
class UpSupervised : public ::testing::Test {
 protected:
  // Starts up and waits for it; fails the test (ASSERT in the caller: check HasFatalFailure)
  // when it is not ready.
  void StartUp(const std::string& topology, const std::string& restart,
               std::vector<std::string> extra = {}) {
    std::string why = SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
    dir_ = testing::MakeTempDir("kvb-upsup-");
    ASSERT_EQ(testing::MakeModel(dir_ + "/model", "tiny", 0, 300'000), 0);
    {
      std::ofstream cfg(dir_ + "/up.toml");
      cfg << "cluster_token = \"" << kToken << "\"\nrestart = \"" << restart << "\"\n";
    }
    std::vector<std::string> args = {topology,  "--config",      dir_ + "/up.toml",
                                     "--model", dir_ + "/model", "--no-prefix-caching"};
    args.insert(args.end(), extra.begin(), extra.end());
    up_ = std::make_unique<testing::UpTopology>(dir_, std::move(args));
    ASSERT_TRUE(up_->WaitReady()) << up_->ReadLog();
    pids_ = up_->Pids();
  }
  // POST /v1/instances/drain {"instance_id": name} to the proxy, with the token.
  void DrainThroughProxy(const std::string& name) {
    httplib::Client cli("127.0.0.1", up_->port());
    httplib::Headers h = {{"X-KVBridge-Cluster-Token", kToken}};
    auto res =
        cli.Post("/v1/instances/drain", h, json{{"instance_id", name}}.dump(), "application/json");
    ASSERT_TRUE(res) << name;
    EXPECT_EQ(res->status, 200) << name << ": " << res->body;
  }
  // The log of child `name` (DIR/logs/NAME.log).
  std::string ChildLog(const std::string& name) const {
    std::ifstream f(dir_ + "/logs/" + name + ".log");
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  static void ExpectNoFailure(const testing::LoadLoop& load) {
    const auto failures = load.failures();
    EXPECT_TRUE(failures.empty()) << failures.size() << " failed, first: " << failures.front();
  }

  static constexpr const char* kToken = "supervision-test-token";
  std::string dir_;
  std::unique_ptr<testing::UpTopology> up_;
  std::map<std::string, int> pids_;
};
class UpSupervision : public UpSupervised {};
class UpDrain : public UpSupervised {};
class UpRollingRestart : public UpSupervised {};

// Issue 21: one crash is not an outage. SIGKILL of the decode of `up 1p1d` (on a quiet topology:
// every block freed first): up reports it, restarts it (a new incarnation registering under the
// same name), the prefill and the proxy are never restarted, and requests sent after the restart
// succeed.
TEST_F(UpSupervision, KilledDecodeIsRestartedTheOthersKeepRunning) {
  StartUp("1p1d", "on-failure", {"--restart-budget", "3"});
  if (HasFatalFailure() || IsSkipped()) return;
  const std::string host = up_->host();
  ASSERT_EQ(pids_.size(), 3u) << up_->ReadLog();
  json first = Post(up_->port(), "/v1/completions", kSmallRequest);
  ASSERT_EQ(first["_status"], 200) << first.dump();
  const std::string old_url = testing::InstanceNamed(host, "decode-0").value("url", "");
  // The first request's blocks freed (the prefill's hold ends when the decode's notification
  // arrives, just after the answer): the kill finds nothing in flight, as the test means.
  ExpectEveryInstanceDrained(host);

  ASSERT_EQ(::kill(pids_["decode-0"], SIGKILL), 0);
  ASSERT_TRUE(testing::WaitRestarted(host, "decode-0", 1)) << up_->ReadLog();
  // A new incarnation at a new url; the old one is gone from the registry.
  EXPECT_NE(testing::InstanceNamed(host, "decode-0").value("url", ""), old_url);
  json inst = json::parse(GetBody(host, "/instances"));
  EXPECT_EQ(inst["instances"].size(), 2u) << inst.dump();
  for (int i = 0; i < 4; ++i) {
    json got = Post(up_->port(), "/v1/completions", kSmallRequest);
    EXPECT_EQ(got["_status"], 200) << got.dump();
    EXPECT_EQ(got["choices"][0]["text"], first["choices"][0]["text"]);
  }
  const std::string log = up_->ReadLog();
  EXPECT_NE(log.find("decode-0 (pid " + std::to_string(pids_["decode-0"]) + ") killed by signal 9"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("decode-0 restarted (restart 1"), std::string::npos) << log;
  // The others were never restarted: same processes, alive, 0 restarts.
  EXPECT_EQ(::kill(pids_["prefill-0"], 0), 0);
  EXPECT_EQ(::kill(pids_["proxy"], 0), 0);
  EXPECT_EQ(log.find("prefill-0 restarted"), std::string::npos) << log;
  EXPECT_EQ(log.find("proxy restarted"), std::string::npos) << log;
  const std::string metrics = GetBody(host, "/metrics");
  EXPECT_EQ(ScrapeMetric(metrics, "kvbridge_up_restarts_total", "name=\"decode-0\""), 1.0);
  EXPECT_EQ(ScrapeMetric(metrics, "kvbridge_up_restarts_total", "name=\"prefill-0\""), 0.0);
  EXPECT_EQ(ScrapeMetric(metrics, "kvbridge_up_restarts_total", "name=\"proxy\""), 0.0);
  EXPECT_EQ(testing::InstanceNamed(host, "prefill-0").value("restarts", -1), 0);
  ExpectEveryInstanceDrained(host);
  EXPECT_EQ(up_->Stop(), 0) << up_->ReadLog();
}

// Issue 21: graceful drain. Under a light load (2 clients in a loop), decode-0 of `up 1p2d` is
// drained by SIGTERM and decode-1 through the proxy (POST /v1/instances/drain); each finishes what
// it had, exits 0 and comes back (--restart always) — and no request fails.
TEST_F(UpDrain, DrainedDecodesUnderLoadLoseNoRequest) {
  StartUp("1p2d", "always");
  if (HasFatalFailure() || IsSkipped()) return;
  const std::string host = up_->host();
  ASSERT_EQ(pids_.size(), 4u) << up_->ReadLog();
  json body = kSmallRequest;
  body["max_tokens"] = 48;  // long enough that a drain finds requests in flight
  testing::LoadLoop load(up_->port(), body, /*clients=*/2);
  load.WaitOk(5);
  ASSERT_EQ(::kill(pids_["decode-0"], SIGTERM), 0);
  EXPECT_TRUE(testing::WaitRestarted(host, "decode-0", 1)) << up_->ReadLog();
  load.WaitOk(load.ok() + 5);
  // Through the proxy, by name: routed around at once, then the engine drains.
  DrainThroughProxy("decode-1");
  EXPECT_TRUE(testing::WaitRestarted(host, "decode-1", 1)) << up_->ReadLog();
  load.WaitOk(load.ok() + 5);
  load.Stop();
  ExpectNoFailure(load);
  EXPECT_GE(load.ok(), 15);
  std::printf("UpDrain: %d requests answered 200, %zu failed, across 2 drains + restarts\n",
              load.ok(), load.failures().size());
  const std::string log = up_->ReadLog();
  for (const char* name : {"decode-0", "decode-1"}) {
    EXPECT_NE(log.find(std::string(name) + " (pid " + std::to_string(pids_[name]) +
                       ") exited with code 0"),
              std::string::npos)
        << log;
  }
  EXPECT_NE(ChildLog("decode-0").find("drained in"), std::string::npos) << ChildLog("decode-0");
  ExpectEveryInstanceDrained(host);
  EXPECT_EQ(up_->Stop(), 0) << up_->ReadLog();
}

// Issue 21: a rolling restart of every engine of `up 1p3d` under light load (2 looping clients):
// each in turn drained through the proxy (POST /v1/instances/drain, by name), restarted by up
// (--restart always) and back before the next — the only prefill included (requests wait for
// it: --instance-wait-ms) — and no request fails.
TEST_F(UpRollingRestart, EveryEngineOf1p3dOneAtATimeNoFailedRequest) {
  StartUp("1p3d", "always");
  if (HasFatalFailure() || IsSkipped()) return;
  const std::string host = up_->host();
  json body = kSmallRequest;
  body["max_tokens"] = 32;
  testing::LoadLoop load(up_->port(), body, /*clients=*/2);
  load.WaitOk(5);
  for (const char* name : {"prefill-0", "decode-0", "decode-1", "decode-2"}) {
    DrainThroughProxy(name);
    EXPECT_TRUE(testing::WaitRestarted(host, name, 1)) << name << "\n" << up_->ReadLog();
    load.WaitOk(load.ok() + 3);
  }
  load.Stop();
  ExpectNoFailure(load);
  std::printf("UpRollingRestart 1p3d: %d requests answered 200, %zu failed, 4 engines restarted\n",
              load.ok(), load.failures().size());
  const std::string metrics = GetBody(host, "/metrics");
  for (const char* name : {"prefill-0", "decode-0", "decode-1", "decode-2"}) {
    EXPECT_EQ(
        ScrapeMetric(metrics, "kvbridge_up_restarts_total", "name=\"" + std::string(name) + "\""),
        1.0)
        << name;
  }
  ExpectEveryInstanceDrained(host);
  EXPECT_EQ(up_->Stop(), 0) << up_->ReadLog();
}

// The prefill gets the client's n (its 1:many sibling path) while 16 requests with n=8 are in
// flight; every request succeeds and, afterwards, every instance holds nothing, no lease expired
// and no notification was ignored (DESIGN.md: fault-free runs need no safety net).
TEST(UpPrefillForwardN, Concurrency16WithN8DrainsClean) {
  std::string why = SkipReason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string dir = testing::MakeTempDir("kvb-upfn-");
  ASSERT_EQ(testing::MakeModel(dir + "/model", "tiny", 0, 300'000), 0);
  testing::UpTopology up(
      dir, {"1p1d", "--model", dir + "/model", "--no-prefix-caching", "--prefill-forward-n"});
  ASSERT_TRUE(up.WaitReady()) << up.ReadLog();
  const std::string host = up.host();
  Subprocess bench({KvbridgeBin(), "bench", "--host", host, "--samples", "32", "--batches", "16",
                    "--best-of-n", "8", "--input-tokens", "150", "--output-tokens", "12",
                    "--check-drain", "--drain-timeout", "5"},
                   dir + "/bench.log");
  EXPECT_EQ(bench.Wait(300'000), 0) << bench.ReadLog();
  EXPECT_NE(bench.ReadLog().find("result: OK"), std::string::npos) << bench.ReadLog();

  // The same facts, read straight from every instance.
  EXPECT_EQ(ExpectEveryInstanceDrained(host).size(), 2u);
  const std::string pm = GetBody(host, "/metrics");
  EXPECT_EQ(ScrapeMetric(pm, "kvbridge_proxy_requests_total", "outcome=\"ok\""), 32.0);
  EXPECT_EQ(ScrapeMetric(pm, "kvbridge_proxy_releases_total", "result=\"ok\""), 0.0);
  EXPECT_EQ(up.Stop(), 0) << up.ReadLog();
}

// `kvbridge bench --overload 10 --json` against `host`: its report (null, after a failure, when
// it printed none).
json RunOverloadBench(const std::string& dir, const std::string& name, const std::string& host) {
  Subprocess bench({KvbridgeBin(), "bench", "--host", host, "--overload", "10",
                    "--overload-seconds", "10", "--probe-seconds", "3", "--input-tokens", "100",
                    "--output-tokens", "16", "--drain-timeout", "10", "--json"},
                   dir + "/" + name + ".log");
  const int rc = bench.Wait(180'000);
  const std::string log = bench.ReadLog();
  const size_t brace = log.find("\n{");
  json r = brace == std::string::npos ? json() : json::parse(log.substr(brace), nullptr, false);
  if (!r.is_object()) {
    ADD_FAILURE() << name << ": no report (exit " << rc << "):\n" << log;
    return nullptr;
  }
  EXPECT_EQ(rc, 0) << log;
  std::printf(
      "%s overload: capacity %.1f req/s, offered %.1f for %.1f s: sent %d (%.1f req/s), 200 %d, "
      "429 %d, 503 %d, errors %d, late %d; accepted p50 %.2f s p99 %.2f s\n",
      name.c_str(), r.value("capacity_rps", 0.0), r.value("offered_rps", 0.0),
      r.value("duration_s", 0.0), r.value("sent", 0), r.value("sent_rps", 0.0),
      r.value("ok_200", 0), r.value("rejected_429", 0), r.value("rejected_503", 0),
      r.value("errors", 0), r.value("late", 0), r.value("accepted_p50_s", 0.0),
      r.value("accepted_p99_s", 0.0));
  for (const auto& i : r["instances"]) {
    std::printf("  %s %s: RSS %.1f -> peak %.1f MiB, peak waiting %g, peak in flight %g\n",
                i.value("role", "").c_str(), i.value("url", "").c_str(),
                i.value("rss_before_bytes", -1.0) / 1048576,
                i.value("rss_peak_bytes", -1.0) / 1048576, i.value("waiting_peak", -1.0),
                i.value("in_flight_peak", -1.0));
  }
  // Every answer a 200 or a refusal with Retry-After; refusals seen; all drained.
  EXPECT_TRUE(r.value("ok", false)) << r.dump();
  EXPECT_GT(r.value("ok_200", 0), 0) << r.dump();
  EXPECT_EQ(r.value("errors", -1), 0) << r.dump();
  EXPECT_EQ(r.value("missing_retry_after", -1), 0) << r.dump();
  EXPECT_GE(r.value("offered_rps", 0.0), 9.9 * r.value("capacity_rps", 0.0)) << r.dump();
  for (const auto& d : r["drains"]) EXPECT_TRUE(d.value("drained", false)) << d.dump();
  // Memory bounded: no process grew by more than 128 MiB resident over the run (queues are
  // bounded, the KV pool is fixed: what could grow is what a bound failed to stop).
  for (const auto& i : r["instances"]) {
    const double before = i.value("rss_before_bytes", -1.0);
    const double peak = i.value("rss_peak_bytes", -1.0);
    EXPECT_GT(before, 0) << i.dump();
    EXPECT_LT(peak - before, 128.0 * 1048576) << i.dump();
  }
  return r;
}

// Issue 21's overload measure, bounded: ten times the measured capacity for 10 s (`kvbridge bench
// --overload 10`), first against `up 1p1d` whose proxy admits 8 requests at once (--max-pending
// 8: the rest get 429), then against one engine alone whose own queues refuse (503): 4 requests
// waiting (--max-waiting-requests 4, --max-num-seqs 2) and 4 connections waiting for one of its 8
// HTTP threads (--max-queued-connections 4). Every answer is a 200 (an
// accepted request completed) or a refusal with Retry-After, refusals happen, no engine dies or
// grows (resident memory sampled every 200 ms; queue gauges within their bounds), and every
// instance drains afterwards with nothing left in flight at the proxy.
TEST(UpOverload, TenTimesCapacityIsRefusedWithRetryAfterAndDrains) {
  std::string why = SkipReason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string dir = testing::MakeTempDir("kvb-upover-");
  const std::string model = dir + "/model";
  ASSERT_EQ(testing::MakeModel(model, "tiny", 0, 300'000), 0);
  {
    testing::UpTopology up(dir, {"1p1d", "--model", model, "--no-prefix-caching",
                                 "--proxy-arg=--max-pending", "--proxy-arg=8"});
    ASSERT_TRUE(up.WaitReady()) << up.ReadLog();
    const auto pids = up.Pids();
    json r = RunOverloadBench(dir, "bench-up", up.host());
    if (r.is_object()) {
      EXPECT_GT(r.value("rejected_429", 0), 0) << r.dump();
      EXPECT_EQ(r.value("proxy_in_flight_after", -1.0), 0.0) << r.dump();
      for (const auto& i : r["instances"]) {
        if (i["role"] == "proxy") {
          EXPECT_LE(i.value("in_flight_peak", 99.0), 8.0) << i.dump();
        }
      }
    }
    // No child died (none restarted, every one still the process up started).
    const std::string log = up.ReadLog();
    EXPECT_EQ(log.find(" restarted ("), std::string::npos) << log;
    for (const auto& [name, pid] : pids) EXPECT_EQ(::kill(pid, 0), 0) << name;
    ExpectEveryInstanceDrained(up.host());
    EXPECT_EQ(up.Stop(), 0) << up.ReadLog();
  }
  const int port = testing::FreePort();
  Subprocess engine({KvbridgeBin(), "serve", model, "--port", std::to_string(port),
                     "--no-enable-prefix-caching", "--max-waiting-requests", "4", "--max-num-seqs",
                     "2", "--http-threads", "8", "--max-queued-connections", "4"},
                    dir + "/engine.log");
  ASSERT_TRUE(testing::WaitForHttpOk("127.0.0.1", port, "/health", 120'000)) << engine.ReadLog();
  json r = RunOverloadBench(dir, "bench-engine", "http://127.0.0.1:" + std::to_string(port));
  if (r.is_object()) {
    EXPECT_GT(r.value("rejected_503", 0), 0) << r.dump();
    for (const auto& i : r["instances"]) EXPECT_LE(i.value("waiting_peak", 99.0), 4.0) << i.dump();
  }
  // Both of the engine's bounds refused: its request queue and its connection queue.
  const std::string m = GetBody("http://127.0.0.1:" + std::to_string(port), "/metrics");
  EXPECT_GT(ScrapeMetric(m, "kvbridge_http_engine_rejections_total"), 0) << m;
  EXPECT_GT(ScrapeMetric(m, "kvbridge_http_connections_shed_total"), 0) << m;
  std::printf(
      "engine alone: %g requests refused by its queue (--max-waiting-requests 4), %g "
      "connections shed (--http-threads 8, --max-queued-connections 4)\n",
      ScrapeMetric(m, "kvbridge_http_engine_rejections_total"),
      ScrapeMetric(m, "kvbridge_http_connections_shed_total"));
  EXPECT_TRUE(engine.Running()) << engine.ReadLog();
}

// A tokenizer directory of ../shared (absent outside the project's machines: "").
// Resolved from the source tree (KVBRIDGE_SOURCE_DIR, set by ctest), not from the working
// directory.
std::string SharedTokenizer(const std::string& name) {
  const char* src = std::getenv("KVBRIDGE_SOURCE_DIR");
  const std::string root = src != nullptr ? std::string(src) + "/.." : "..";
  const std::string dir = root + "/shared/data/tokenizers/" + name;
  return ::access((dir + "/tokenizer.json").c_str(), R_OK) == 0 ? dir : "";
}

// `up 1p1d` on a tiny random model with the Qwen3 tokenizer (make-model --tokenizer): /tokenize
// and /detokenize through the proxy give Hugging Face's ids; a P/D answer is bitwise the
// colocated engine's (ids and logprobs, via return_tokens_as_token_ids), its streamed text the
// whole text; bad input (invalid UTF-8, a prompt past max_model_len, ids outside the vocabulary)
// is a 400 before any leg holds anything.
TEST(UpTokenizer, Qwen3PdAnswersEqualColocatedBitwise) {
  std::string why = SkipReason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string tok_dir = SharedTokenizer("qwen3");
  if (tok_dir.empty()) GTEST_SKIP() << "../shared/data/tokenizers/qwen3 is absent";
  const std::string dir = testing::MakeTempDir("kvb-uptok-");
  const std::string model = dir + "/model";
  ASSERT_EQ(testing::MakeModel(model, "tiny", 0, 300'000, {"--tokenizer", tok_dir}), 0);
  // Laid out like a checkpoint; the vocabulary is the tokenizer's 151669 ids padded to 64.
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
    EXPECT_EQ(::access((model + "/" + f).c_str(), R_OK), 0) << f;
  }
  std::ifstream cf(model + "/config.json");
  const json config = json::parse(cf, nullptr, false);
  EXPECT_EQ(config.value("vocab_size", 0), 151680) << config.dump();
  EXPECT_EQ(config.value("eos_token_id", json()), 151645) << config.dump();  // <|im_end|>

  int solo_port = 0;
  auto solo = StartSolo(dir, model, &solo_port);
  ASSERT_TRUE(solo);
  testing::UpTopology up(dir, {"1p1d", "--model", model, "--no-prefix-caching"});
  ASSERT_TRUE(up.WaitReady()) << up.ReadLog();
  const int port = up.port();

  // Hugging Face's ids for Qwen3 (the same as @huggingface/tokenizers and the model card's
  // "hello world" -> [14990, 1879]); Qwen adds no BOS.
  for (int p : {solo_port, port}) {
    json t = Post(p, "/tokenize", {{"prompt", "hello world"}, {"return_token_strs", true}});
    ASSERT_EQ(t["_status"], 200) << t.dump();
    EXPECT_EQ(t["tokens"], json({14990, 1879})) << p;
    EXPECT_EQ(t["token_strs"], json({"hello", "\u0120world"})) << p;
    EXPECT_EQ(t["count"], 2);
    EXPECT_EQ(t["max_model_len"], 1024);
    t = Post(p, "/tokenize", {{"prompt", ""}});
    EXPECT_EQ(t["tokens"], json::array()) << t.dump();
    json d = Post(p, "/detokenize", {{"tokens", {14990, 1879, 151645}}});
    ASSERT_EQ(d["_status"], 200) << d.dump();
    EXPECT_EQ(d["prompt"], "hello world<|im_end|>");  // special tokens kept
    d = Post(p, "/detokenize", {{"tokens", {151669}}});
    EXPECT_EQ(d["_status"], 400) << d.dump();
  }

  // Chat: the checkpoint's template (Qwen3's ChatML from tokenizer_config.json), no second BOS;
  // chat_template_kwargs reach it (enable_thinking false writes an empty think block).
  const json messages = {{{"role", "user"}, {"content", "hello world"}}};
  const std::string chatml = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n";
  for (int p : {solo_port, port}) {
    json want_ids = Post(p, "/tokenize", {{"prompt", chatml}, {"add_special_tokens", false}});
    json got_ids = Post(p, "/tokenize", {{"messages", messages}});
    ASSERT_EQ(got_ids["_status"], 200) << got_ids.dump();
    EXPECT_EQ(got_ids["tokens"], want_ids["tokens"]) << p;
    want_ids = Post(p, "/tokenize", {{"prompt", chatml + "<think>\n\n</think>\n\n"}});
    got_ids =
        Post(p, "/tokenize",
             {{"messages", messages}, {"chat_template_kwargs", {{"enable_thinking", false}}}});
    EXPECT_EQ(got_ids["tokens"], want_ids["tokens"]) << p;
  }
  json chat = {{"messages", messages}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}};
  json chat_want = Post(solo_port, "/v1/chat/completions", chat);
  json chat_got = Post(port, "/v1/chat/completions", chat);
  ASSERT_EQ(chat_got["_status"], 200) << chat_got.dump();
  EXPECT_EQ(chat_got["choices"][0]["message"], chat_want["choices"][0]["message"]);
  EXPECT_EQ(chat_got["usage"]["prompt_tokens"],
            Post(port, "/tokenize", {{"prompt", chatml}})["count"]);  // the ChatML prompt's ids

  json body = {{"prompt", "Écris un poème sur la mer 🌊, s'il te plaît:"},
               {"max_tokens", 24},
               {"temperature", 0},
               {"ignore_eos", true},
               {"logprobs", 3},
               {"return_tokens_as_token_ids", true}};
  json want = Post(solo_port, "/v1/completions", body);
  ASSERT_EQ(want["_status"], 200) << want.dump();
  json got = Post(port, "/v1/completions", body);
  ASSERT_EQ(got["_status"], 200) << got.dump();
  EXPECT_EQ(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]);  // ids + logprobs
  EXPECT_EQ(got["choices"][0]["text"], want["choices"][0]["text"]);
  EXPECT_EQ(got["usage"]["prompt_tokens"], want["usage"]["prompt_tokens"]);
  EXPECT_EQ(want["choices"][0]["logprobs"]["tokens"].size(), 24u);
  // The text is the decode of those ids, also when streamed (chunks never split a character).
  json ids = json::array();
  for (const auto& t : want["choices"][0]["logprobs"]["tokens"]) {
    ids.push_back(std::stoi(t.get<std::string>().substr(std::string("token_id:").size())));
  }
  json plain = Post(solo_port, "/detokenize", {{"tokens", ids}});
  json whole = body;
  whole.erase("logprobs");
  whole.erase("return_tokens_as_token_ids");
  json text = Post(port, "/v1/completions", whole);
  ASSERT_EQ(text["_status"], 200) << text.dump();
  EXPECT_EQ(text["choices"][0]["text"], got["choices"][0]["text"]);
  json streamed = whole;
  streamed["stream"] = true;
  EXPECT_EQ(StreamText(port, streamed, 0), text["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(StreamText(solo_port, streamed, 0), text["choices"][0]["text"].get<std::string>());
  // Stops (vLLM's semantics) run where the tokens are made, the decode: a stop string from
  // the middle of the answer cuts it there, P/D equal to colocated in text, ids and logprobs,
  // whole and streamed; the completing token's ids still count.
  {
    const std::string full = text["choices"][0]["text"];
    auto ascii = [](char ch) { return ch >= 'a' && ch <= 'z'; };
    size_t at = 1;
    while (at + 1 < full.size() &&
           !(ascii(full[at]) && ascii(full[at + 1]) && full.find(full.substr(at, 2)) == at)) {
      ++at;
    }
    ASSERT_LT(at + 1, full.size()) << "no two lowercase letters in " << full;
    json stopped = body;
    stopped["stop"] = {full.substr(at, 2)};
    json s_want = Post(solo_port, "/v1/completions", stopped);
    json s_got = Post(port, "/v1/completions", stopped);
    ASSERT_EQ(s_got["_status"], 200) << s_got.dump();
    EXPECT_EQ(s_want["choices"][0]["text"], full.substr(0, at));
    EXPECT_EQ(s_want["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(s_want["choices"][0]["stop_reason"], full.substr(at, 2));
    EXPECT_EQ(s_got["choices"][0], s_want["choices"][0]);
    EXPECT_EQ(s_got["usage"]["completion_tokens"], s_want["usage"]["completion_tokens"]);
    EXPECT_LT(s_want["usage"]["completion_tokens"].get<int>(), 24);
    json s_stream = stopped;
    s_stream.erase("logprobs");
    s_stream.erase("return_tokens_as_token_ids");
    s_stream["stream"] = true;
    EXPECT_EQ(StreamText(port, s_stream, 0), full.substr(0, at));
    EXPECT_EQ(StreamText(solo_port, s_stream, 0), full.substr(0, at));
  }
  // /detokenize keeps special tokens, the completion skips them: equal when there are none.
  bool special = false;
  for (const auto& id : ids) special = special || id.get<int>() >= 151643;
  if (!special) {
    EXPECT_EQ(plain["prompt"], text["choices"][0]["text"]);
  }

  // Bad input: refused before any leg, nothing held afterwards.
  const std::string host = up.host();
  for (int p : {solo_port, port}) {
    json r = testing::PostRaw(p, "/v1/completions", "{\"prompt\":\"caf\xC3\",\"max_tokens\":2}");
    EXPECT_EQ(r["_status"], 400) << r.dump();
    std::string long_prompt;
    for (int i = 0; i < 1100; ++i) long_prompt += " hello";
    r = Post(p, "/v1/completions", {{"prompt", long_prompt}, {"max_tokens", 2}});
    EXPECT_EQ(r["_status"], 400) << r.dump();
    EXPECT_NE(r.dump().find("maximum context length is 1024"), std::string::npos) << r.dump();
    r = Post(p, "/v1/completions", {{"prompt", {1, 151669}}, {"max_tokens", 2}});
    EXPECT_EQ(r["_status"], 400) << r.dump();
  }
  EXPECT_EQ(ExpectEveryInstanceDrained(host).size(), 2u);

  EXPECT_EQ(up.Stop(), 0) << up.ReadLog();
}

// `up 1p1d` on the qwen3-0.6b preset (random bf16 weights, the real shape: 28 layers, 16/8 heads
// of 128, q/k norm, tied 151936 x 1024 embeddings; 1.19 GB) with the Qwen3 tokenizer: P/D answers
// are bitwise the colocated engine's — ids and logprobs (return_tokens_as_token_ids; JSON numbers
// print floats round-trip exactly) — for a greedy completion, n = 3 seeded samples and a chat
// request; every instance drains. Few tokens each: a decode step reads the whole 1.2 GB.
TEST(UpRealShape, Qwen3_0_6bPdAnswersEqualColocatedBitwise) {
  std::string why = SkipReason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string tok_dir = SharedTokenizer("qwen3");
  if (tok_dir.empty()) GTEST_SKIP() << "../shared/data/tokenizers/qwen3 is absent";
  const auto t0 = std::chrono::steady_clock::now();
  const std::string bin = KvbridgeBin();
  const std::string dir = testing::MakeTempDir("kvb-upq3-");
  const std::string model = dir + "/model";
  ASSERT_EQ(testing::MakeModel(model, "qwen3-0.6b", 0, 300'000, {"--tokenizer", tok_dir}), 0);
  std::ifstream cf(model + "/config.json");
  const json config = json::parse(cf, nullptr, false);
  EXPECT_EQ(config.value("architectures", json()), json({"Qwen3ForCausalLM"})) << config.dump();
  EXPECT_EQ(config.value("num_hidden_layers", 0), 28) << config.dump();
  EXPECT_EQ(config.value("vocab_size", 0), 151936) << config.dump();

  // Both started at once; the engines memory-map the same file (one copy in the page cache).
  const int solo_port = testing::FreePort();
  Subprocess solo(
      {bin, "serve", model, "--port", std::to_string(solo_port), "--no-enable-prefix-caching"},
      dir + "/solo.log");
  testing::UpTopology up(
      dir, {"1p1d", "--model", model, "--no-prefix-caching", "--ready-timeout", "600"});
  const int port = up.port();
  ASSERT_TRUE(testing::WaitForHttpOk("127.0.0.1", solo_port, "/health", 600'000)) << solo.ReadLog();
  ASSERT_TRUE(up.WaitReady()) << up.ReadLog();
  const double ready_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  auto expect_same_choices = [](const json& got, const json& want, size_t n, const char* what) {
    ASSERT_EQ(want["_status"], 200) << what << ": " << want.dump();
    ASSERT_EQ(got["_status"], 200) << what << ": " << got.dump();
    ASSERT_EQ(want["choices"].size(), n) << what << ": " << want.dump();
    ASSERT_EQ(got["choices"].size(), n) << what << ": " << got.dump();
    for (size_t i = 0; i < n; ++i) {
      const json& g = got["choices"][i];
      const json& w = want["choices"][i];
      EXPECT_FALSE(w["logprobs"].is_null()) << what << " choice " << i;
      EXPECT_EQ(g["logprobs"].dump(), w["logprobs"].dump()) << what << " choice " << i;
      EXPECT_EQ(g.value("text", json()), w.value("text", json())) << what << " choice " << i;
      EXPECT_EQ(g.value("message", json()), w.value("message", json())) << what << " choice " << i;
    }
    // usage.prompt_tokens_details.cached_tokens differs: the decode leg counts the KV it pulled
    // from the prefill (so it is > 0: the answer really went through P/D).
    EXPECT_GT(got["usage"]["prompt_tokens_details"].value("cached_tokens", 0), 0) << what;
    EXPECT_EQ(got["usage"]["prompt_tokens"], want["usage"]["prompt_tokens"]) << what;
    EXPECT_EQ(got["usage"]["completion_tokens"], want["usage"]["completion_tokens"]) << what;
  };

  // Greedy, the prompt's ids through the real tokenizer.
  json greedy = {{"prompt", "The capital of France is"},
                 {"max_tokens", 4},
                 {"temperature", 0},
                 {"ignore_eos", true},
                 {"logprobs", 3},
                 {"return_tokens_as_token_ids", true}};
  json want = Post(solo_port, "/v1/completions", greedy);
  expect_same_choices(Post(port, "/v1/completions", greedy), want, 1, "greedy");
  EXPECT_EQ(want["usage"]["prompt_tokens"], 5) << want.dump();  // Qwen3 ids, no BOS
  EXPECT_EQ(want["choices"][0]["logprobs"]["tokens"].size(), 4u) << want.dump();

  // n = 3 seeded samples (the prefill leg samples nothing for them; each sibling its own stream).
  json sampled = {{"prompt", "Écris un poème sur la mer 🌊:"},
                  {"max_tokens", 3},
                  {"n", 3},
                  {"temperature", 1.0},
                  {"seed", 42},
                  {"ignore_eos", true},
                  {"logprobs", 2},
                  {"return_tokens_as_token_ids", true}};
  expect_same_choices(Post(port, "/v1/completions", sampled),
                      Post(solo_port, "/v1/completions", sampled), 3, "n=3 seeded");

  // Chat: Qwen3's own template (tokenizer_config.json), top-2 logprobs per token.
  json chat = {{"messages", {{{"role", "user"}, {"content", "hello world"}}}},
               {"max_tokens", 3},
               {"temperature", 0},
               {"ignore_eos", true},
               {"logprobs", true},
               {"top_logprobs", 2}};
  expect_same_choices(Post(port, "/v1/chat/completions", chat),
                      Post(solo_port, "/v1/chat/completions", chat), 1, "chat");

  EXPECT_EQ(ExpectEveryInstanceDrained("http://127.0.0.1:" + std::to_string(port)).size(), 2u);
  EXPECT_EQ(up.Stop(), 0) << up.ReadLog();
  solo.Signal(SIGTERM);
  solo.Wait(60'000);
  std::filesystem::remove_all(dir + "/model");  // 1.2 GB
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("qwen3-0.6b up 1p1d: ready after %.1f s, %.1f s in all\n", ready_s, total_s);
}

// A listening socket on 127.0.0.1 (port 0: any free one); returns the fd (-1 on failure) and
// sets *port.
int ListenLoopback(int want_port, int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(want_port));
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

// `up` never picks a port for a child to bind later (another process could take it in between):
// each child binds its own (`--port 0 --port-file`) and up reads it back. A proxy port that is
// taken fails up at once with the bind error; with --port 0, while this process keeps taking
// free ports, 1p2d comes up and every printed endpoint is the port its child really serves on.
TEST(UpPorts, ChildrenBindTheirOwnPortsWhileOtherProcessesTakePorts) {
  std::string why = SkipReason();
  if (!why.empty()) GTEST_SKIP() << why;
  const std::string dir = testing::MakeTempDir("kvb-upports-");
  const std::string model = dir + "/model";
  ASSERT_EQ(testing::MakeModel(model, "tiny", 0, 300'000), 0);

  int busy_port = 0;
  const int busy_fd = ListenLoopback(0, &busy_port);
  ASSERT_GE(busy_fd, 0);
  {
    const std::string busy_dir = dir + "/busy";
    std::filesystem::create_directories(busy_dir);
    testing::UpTopology up(busy_dir,
                           {"1p1d", "--port", std::to_string(busy_port), "--model", model});
    EXPECT_EQ(up.process().Wait(60'000), 1) << up.ReadLog();
    const std::string log = up.ReadLog();
    EXPECT_NE(log.find("proxy (pid"), std::string::npos) << log;
    EXPECT_NE(log.find("cannot listen on 127.0.0.1:" + std::to_string(busy_port)),
              std::string::npos)
        << log;
    EXPECT_EQ(log.find(": ready in"), std::string::npos) << log;
  }

  // Other processes taking free ports meanwhile: a thread holds up to 300 more.
  std::atomic<bool> stop{false};
  std::vector<int> taken_fds;
  std::set<int> taken_ports = {busy_port};
  std::thread taker([&] {
    for (int i = 0; i < 300 && !stop.load(); ++i) {
      int port = 0;
      const int fd = ListenLoopback(0, &port);
      if (fd >= 0) {
        taken_fds.push_back(fd);
        taken_ports.insert(port);
      }
      usleep(5'000);
    }
  });
  testing::UpTopology up(dir, {"1p2d", "--port", "0", "--model", model});
  const bool ready = up.WaitReady();
  stop = true;
  taker.join();
  ASSERT_TRUE(ready) << up.ReadLog();

  // "  NAME  http://127.0.0.1:PORT  pid N  log ..." per child, then the proxy's API line.
  const std::string log = up.ReadLog();
  std::map<std::string, int> printed;
  static const std::regex kLine(R"(\n  (\S+) +http://127\.0\.0\.1:([0-9]+) +pid)");
  for (std::sregex_iterator it(log.begin(), log.end(), kLine), end; it != end; ++it) {
    printed[(*it)[1].str()] = std::stoi((*it)[2].str());
  }
  ASSERT_EQ(printed.size(), 4u) << log;
  ASSERT_EQ(printed.count("proxy") + printed.count("prefill-0") + printed.count("decode-0") +
                printed.count("decode-1"),
            4u)
      << log;
  const int proxy_port = printed["proxy"];
  EXPECT_NE(
      log.find("OpenAI API: http://127.0.0.1:" + std::to_string(proxy_port) + "/v1/completions"),
      std::string::npos)
      << log;
  std::set<int> distinct;
  for (const auto& [name, port] : printed) {
    distinct.insert(port);
    EXPECT_EQ(taken_ports.count(port), 0u) << name << " printed a port this test holds: " << port;
    // The child's own report of its bound port.
    std::ifstream pf(dir + "/logs/" + name + ".port");
    int file_port = 0;
    pf >> file_port;
    EXPECT_EQ(file_port, port) << name;
    EXPECT_FALSE(GetBody("http://127.0.0.1:" + std::to_string(port), "/health").empty()) << name;
  }
  EXPECT_EQ(distinct.size(), 4u);
  // The proxy knows every engine by its printed endpoint, healthy.
  json inst = json::parse(GetBody("http://127.0.0.1:" + std::to_string(proxy_port), "/instances"),
                          nullptr, false);
  ASSERT_TRUE(inst.is_object() && inst["instances"].is_array()) << inst.dump();
  std::set<std::string> registered, want;
  for (const auto& i : inst["instances"]) {
    EXPECT_TRUE(i.value("healthy", false)) << i.dump();
    registered.insert(i.value("url", ""));
  }
  for (const auto& [name, port] : printed) {
    if (name != "proxy") want.insert("http://127.0.0.1:" + std::to_string(port));
  }
  EXPECT_EQ(registered, want);
  json got = Post(proxy_port, "/v1/completions",
                  {{"prompt", "The quick brown fox"}, {"max_tokens", 4}, {"temperature", 0}});
  EXPECT_EQ(got["_status"], 200) << got.dump();

  EXPECT_EQ(up.Stop(), 0) << up.ReadLog();
  for (int fd : taken_fds) ::close(fd);
  ::close(busy_fd);
}

}  // namespace
}  // namespace kvbridge
