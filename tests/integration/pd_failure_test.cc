// READ-mode release paths with `kvbridge serve` processes (DESIGN.md "Failures, aborts,
// security"): the test plays the proxy over HTTP on 127.0.0.1 and kills, aborts or rejects at
// the moments the issue names, then checks from /metrics that every block came back — never
// through the lease: a decode that died after its READ began is observed (its connection closed).
//
// "After its READ began" is made deterministic with the decode's test-only switch
// KVBRIDGE_DEBUG_READ_DONE_DELAY_MS (refused unless KVBRIDGE_DEBUG=1; docs/protocol.md): the
// decode's READ lands but is reported late, so the test sees kvbridge_kv_transfers_inflight = 1
// and SIGKILLs the decode before it notifies the prefill.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

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
using testing::MetricsDrained;
using testing::ScrapeMetricAt;
using testing::SpawnServe;
using testing::Subprocess;
using testing::WaitFor;
using testing::WaitForHttpOk;
using Clock = std::chrono::steady_clock;

const char* kToken = "fail-secret";

int64_t MsSince(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// The tiny model, made once per test binary.
const std::string& Model() {
  static const std::string model = [] {
    const std::string m = MakeTempDir("kvb_pd_fail") + "/tiny";
    EXPECT_EQ(MakeModel(m, "tiny", 5, 60'000), 0);
    return m;
  }();
  return model;
}

using Engine = testing::ServedEngine;

// `extra` is merged into kv_connector_extra_config; `env` is set for the child only.
Engine Serve(const std::string& name, const std::string& role, const std::string& transport,
             json extra = json::object(),
             const std::vector<std::pair<std::string, std::string>>& env = {}) {
  json x = {{"transport", transport}, {"lease_ms", 30000}, {"reply_timeout_ms", 2000}};
  x.update(extra);
  Engine e = SpawnServe({.model_dir = Model(),
                         .num_kv_blocks = 128,
                         .role = role,
                         .extra_config = x,
                         .cluster_token = kToken,
                         .env = env,
                         .log_path = MakeTempDir("kvb_pd_fail_log") + "/" + name + ".log"});
  EXPECT_TRUE(WaitForHttpOk("127.0.0.1", e.port, "/health", 60'000)) << e.proc->ReadLog();
  return e;
}

double Scrape(int port, const std::string& name, const std::string& labels = "") {
  return ScrapeMetricAt(port, name, labels);
}

// Nothing active, held, running or waiting; connector tables empty; no READ in flight.
bool Drained(int port) { return MetricsDrained(port); }

httplib::Headers Tok() { return {{"X-KVBridge-Cluster-Token", kToken}}; }

std::string Prompt(int k) {
  return "Prompt " + std::to_string(k) + " for the release paths: " + std::string(40, 'a' + k % 26);
}

// The proxy's prefill leg: returns the prefill's kv_transfer_params.
json PrefillLeg(const Engine& p, const std::string& prompt, const std::string& tid) {
  json body{{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
  body["kv_transfer_params"] = {{"do_remote_decode", true}, {"transfer_id", tid}};
  httplib::Client c("127.0.0.1", p.port);
  c.set_read_timeout(60, 0);
  auto r = c.Post("/v1/completions", Tok(), body.dump(), "application/json");
  EXPECT_TRUE(r);
  if (!r) return json();
  EXPECT_EQ(r->status, 200) << r->body;
  return json::parse(r->body).value("kv_transfer_params", json());
}

json ClientBody(const std::string& prompt, int max_tokens) {
  return json{{"model", "tiny"},  {"prompt", prompt}, {"max_tokens", max_tokens},
              {"temperature", 0}, {"logprobs", 5},    {"ignore_eos", true}};
}

class PdFailure : public ::testing::TestWithParam<std::string> {};

// (a) The decode is SIGKILLed after its READ began (landed, not yet reported): nobody will ever
// notify the prefill, but its agent sees the decode's connection close (issue 21: peer loss is
// observed, not waited out) and frees the hold within 2 s of the kill — far inside the lease.
TEST_P(PdFailure, DecodeKilledAfterReadBeganPrefillFreesWithinTwoSeconds) {
  constexpr int kLeaseMs = 30000;
  Engine p = Serve("prefill", "kv_producer", GetParam(), {{"lease_ms", kLeaseMs}});
  Engine d =
      Serve("decode", "kv_consumer", GetParam(), {{"lease_ms", 3600000}, {"heartbeat_ms", 3000000}},
            {{"KVBRIDGE_DEBUG", "1"}, {"KVBRIDGE_DEBUG_READ_DONE_DELAY_MS", "60000"}});
  const std::string prompt = Prompt(1);
  json params = PrefillLeg(p, prompt, "kill-decode-1");
  ASSERT_TRUE(params.is_object());
  // The engine's stats snapshot trails its final output by up to one step.
  EXPECT_TRUE(
      WaitFor([&] { return Scrape(p.port, "kvbridge_kv_blocks_held_for_transfer") > 0; }, 1000));

  std::atomic<bool> leg_ended{false};
  std::thread leg([&] {
    json body = ClientBody(prompt, 8);
    body["kv_transfer_params"] = params;
    httplib::Client c("127.0.0.1", d.port);
    c.set_read_timeout(30, 0);
    auto r = c.Post("/v1/completions", Tok(), body.dump(), "application/json");
    EXPECT_FALSE(r && r->status == 200) << "the decode died; no answer can come";
    leg_ended = true;
  });
  // The READ was posted and its end is held back by the switch.
  ASSERT_TRUE(
      WaitFor([&] { return Scrape(d.port, "kvbridge_kv_transfers_inflight") == 1; }, 10'000))
      << d.proc->ReadLog();
  EXPECT_TRUE(WaitFor(
      [&] { return Scrape(d.port, "kvbridge_requests_waiting_for_remote_kv") == 1; }, 1000));
  EXPECT_GT(Scrape(p.port, "kvbridge_kv_blocks_held_for_transfer"), 0);
  const auto t_kill = Clock::now();
  d.proc->Signal(SIGKILL);
  EXPECT_EQ(d.proc->Wait(5000), 128 + SIGKILL);

  // Freed within 2 s of the kill, by the loss (the lease has 30 s to go).
  ASSERT_TRUE(
      WaitFor([&] { return Scrape(p.port, "kvbridge_kv_blocks_held_for_transfer") == 0; }, 2000))
      << p.proc->ReadLog();
  const int64_t freed_after_kill = MsSince(t_kill);
  std::printf("[pd_failure] %s: decode SIGKILLed, prefill hold freed %lld ms later\n",
              GetParam().c_str(), static_cast<long long>(freed_after_kill));
  EXPECT_LE(freed_after_kill, 2000);
  leg.join();
  EXPECT_TRUE(leg_ended);
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_peer_lost_total"), 1);
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_peer_lost_released_total"), 1);
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_lease_expired_total"), 0);
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_claim_expired_total"), 0);
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_notifications_ignored_total"), 0);
  EXPECT_TRUE(WaitFor([&] { return Drained(p.port); }, 2000)) << p.proc->ReadLog();
}

// Reads one streamed chunk of a request and then drops the connection (a client leaving).
// Returns what was read.
std::string StreamOneChunkAndLeave(int port, const std::string& body) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
      "application/json\r\nX-KVBridge-Cluster-Token: " +
      std::string(kToken) + "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" +
      body;
  (void)!send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string got;
  char buf[4096];
  const auto t0 = Clock::now();
  timeval tv{.tv_sec = 1, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  while (got.find("data: {") == std::string::npos && MsSince(t0) < 30'000) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n > 0) got.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return got;
}

// (b) The client leaves the prefill leg before the prefill finished: the request is aborted,
// nothing is held, no lease is involved.
TEST_P(PdFailure, PrefillAbortedBeforeFinishingHoldsNothing) {
  Engine p = Serve("prefill", "kv_producer", GetParam());
  // A prefill leg that would run for long (streamed, many tokens): it is aborted mid-way.
  json body{{"model", "tiny"},  {"prompt", Prompt(2)}, {"max_tokens", 900},
            {"temperature", 0}, {"stream", true},      {"ignore_eos", true}};
  body["kv_transfer_params"] = {{"do_remote_decode", true}, {"transfer_id", "abort-prefill-1"}};
  const std::string got = StreamOneChunkAndLeave(p.port, body.dump());
  ASSERT_NE(got.find("data: {"), std::string::npos) << got;
  EXPECT_TRUE(WaitFor([&] { return Drained(p.port); }, 3000)) << p.proc->ReadLog();
  EXPECT_EQ(Scrape(p.port, "kvbridge_requests_finished_total", "reason=\"abort\""), 1);
  EXPECT_EQ(Scrape(p.port, "kvbridge_http_client_disconnects_total"), 1);
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_lease_expired_total"), 0);
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_notifications_ignored_total"), 0);
  // A late release by the proxy for that transfer is harmless.
  httplib::Client c("127.0.0.1", p.port);
  auto rel =
      c.Post("/v1/kv/release", Tok(), R"({"transfer_id":"abort-prefill-1"})", "application/json");
  ASSERT_TRUE(rel);
  EXPECT_EQ(rel->status, 200);
  EXPECT_TRUE(WaitFor([&] { return Drained(p.port); }, 2000));
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_notifications_ignored_total"), 0);
}

// (c) The prefill dies after answering (the decodes already know it as a peer): policy
// "recompute" answers exactly as a colocated engine; policy "fail" answers with an error status,
// bounded (reply_timeout 2 s), not a hang. Both count one load failure and drain.
TEST_P(PdFailure, PrefillKilledAfterAnsweringRecomputesOrFails) {
  Engine colo = Serve("colocated", "", GetParam());
  Engine p = Serve("prefill", "kv_producer", GetParam());
  Engine drec =
      Serve("decode-recompute", "kv_consumer", GetParam(), {{"load_failure_policy", "recompute"}});
  Engine dfail = Serve("decode-fail", "kv_consumer", GetParam(), {{"load_failure_policy", "fail"}});
  // Warm-up: both decodes connect to the prefill's agent.
  for (Engine* d : {&drec, &dfail}) {
    const std::string prompt = Prompt(3);
    json params = PrefillLeg(p, prompt, "warm-" + std::to_string(d->port));
    json body = ClientBody(prompt, 2);
    body["kv_transfer_params"] = params;
    httplib::Client c("127.0.0.1", d->port);
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/completions", Tok(), body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
  }
  const std::string prompt = Prompt(4);
  json params_rec = PrefillLeg(p, prompt, "dead-prefill-rec");
  json params_fail = PrefillLeg(p, prompt, "dead-prefill-fail");
  p.proc->Signal(SIGKILL);
  ASSERT_EQ(p.proc->Wait(5000), 128 + SIGKILL);

  json body = ClientBody(prompt, 8);
  httplib::Client cc("127.0.0.1", colo.port);
  cc.set_read_timeout(60, 0);
  auto ref = cc.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(ref);
  ASSERT_EQ(ref->status, 200);

  body["kv_transfer_params"] = params_rec;
  httplib::Client rc("127.0.0.1", drec.port);
  rc.set_read_timeout(60, 0);
  auto rr = rc.Post("/v1/completions", Tok(), body.dump(), "application/json");
  ASSERT_TRUE(rr);
  ASSERT_EQ(rr->status, 200) << rr->body;
  json a = json::parse(rr->body)["choices"][0], b = json::parse(ref->body)["choices"][0];
  EXPECT_EQ(a["text"], b["text"]);
  // Floats print round-trip exactly: equal text means bitwise-equal logprobs.
  EXPECT_EQ(a["logprobs"].dump(), b["logprobs"].dump());
  EXPECT_EQ(Scrape(drec.port, "kvbridge_kv_load_failures_total"), 1);

  body["kv_transfer_params"] = params_fail;
  httplib::Client fc("127.0.0.1", dfail.port);
  fc.set_read_timeout(60, 0);
  const auto t0 = Clock::now();
  auto fr = fc.Post("/v1/completions", Tok(), body.dump(), "application/json");
  ASSERT_TRUE(fr) << "no answer: the decode hung";
  EXPECT_GE(fr->status, 400) << fr->body;
  EXPECT_NE(fr->status, 200);
  EXPECT_TRUE(json::parse(fr->body, nullptr, false).contains("error")) << fr->body;
  EXPECT_LT(MsSince(t0), 15'000);
  EXPECT_EQ(Scrape(dfail.port, "kvbridge_kv_load_failures_total"), 1);

  for (Engine* d : {&drec, &dfail}) {
    EXPECT_TRUE(WaitFor([&] { return Drained(d->port); }, 3000)) << d->proc->ReadLog();
    EXPECT_EQ(Scrape(d->port, "kvbridge_kv_lease_expired_total"), 0);
  }
}

// (d) The decode refuses the leg before admission (bad kv_transfer_params → 400, no effect);
// the proxy then releases explicitly and the prefill drains at once, far inside the lease.
TEST_P(PdFailure, DecodeRejectionThenExplicitReleaseDrainsAtOnce) {
  Engine p = Serve("prefill", "kv_producer", GetParam());
  Engine d = Serve("decode", "kv_consumer", GetParam());
  const std::string prompt = Prompt(5);
  json params = PrefillLeg(p, prompt, "rejected-1");
  ASSERT_TRUE(params.is_object());
  // The engine's stats snapshot trails its final output by up to one step.
  EXPECT_TRUE(
      WaitFor([&] { return Scrape(p.port, "kvbridge_kv_blocks_held_for_transfer") > 0; }, 1000));
  const double held = Scrape(p.port, "kvbridge_kv_blocks_held_for_transfer");
  EXPECT_GT(held, 0);

  httplib::Client dc("127.0.0.1", d.port);
  dc.set_read_timeout(30, 0);
  // Malformed: one block id too few for remote_num_tokens. Refused at the door.
  json bad = params;
  bad["remote_block_ids"].erase(bad["remote_block_ids"].size() - 1);
  json body = ClientBody(prompt, 4);
  body["kv_transfer_params"] = bad;
  auto r1 = dc.Post("/v1/completions", Tok(), body.dump(), "application/json");
  ASSERT_TRUE(r1);
  EXPECT_EQ(r1->status, 400) << r1->body;
  // Without the cluster token: 403, no effect either.
  body["kv_transfer_params"] = params;
  auto r2 = dc.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r2);
  EXPECT_EQ(r2->status, 403) << r2->body;
  EXPECT_TRUE(WaitFor([&] { return Drained(d.port); }, 1000));
  // The decode never admitted anything: the prefill still holds, waiting for someone.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_blocks_held_for_transfer"), held);

  httplib::Client pc("127.0.0.1", p.port);
  auto no_tok = pc.Post("/v1/kv/release", R"({"transfer_id":"rejected-1"})", "application/json");
  ASSERT_TRUE(no_tok);
  EXPECT_EQ(no_tok->status, 403);
  const auto t0 = Clock::now();
  auto rel =
      pc.Post("/v1/kv/release", Tok(), R"({"transfer_id":"rejected-1"})", "application/json");
  ASSERT_TRUE(rel);
  EXPECT_EQ(rel->status, 200) << rel->body;
  EXPECT_TRUE(WaitFor([&] { return Drained(p.port); }, 1000)) << p.proc->ReadLog();
  EXPECT_LT(MsSince(t0), 1000);
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_lease_expired_total"), 0);
  EXPECT_EQ(Scrape(p.port, "kvbridge_kv_notifications_ignored_total"), 0);
}

// The test-only switch is refused without KVBRIDGE_DEBUG=1: the engine does not start.
TEST(PdFailureSwitch, DebugDelayRefusedWithoutDebugFlag) {
  const int port = FreePort();
  json cfg = {{"kv_connector", "KVBridgeConnector"},
              {"kv_role", "kv_consumer"},
              {"kv_connector_extra_config", {{"transport", "tcp"}}}};
  setenv("KVBRIDGE_DEBUG_READ_DONE_DELAY_MS", "100", 1);
  Subprocess s({KvbridgeBin(), "serve", Model(), "--port", std::to_string(port),
                "--kv-transfer-config", cfg.dump()},
               MakeTempDir("kvb_pd_fail_switch") + "/serve.log");
  unsetenv("KVBRIDGE_DEBUG_READ_DONE_DELAY_MS");
  EXPECT_NE(s.Wait(60'000), 0);
  EXPECT_NE(s.ReadLog().find("KVBRIDGE_DEBUG=1"), std::string::npos) << s.ReadLog();
}

INSTANTIATE_TEST_SUITE_P(Transports, PdFailure, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kvbridge
