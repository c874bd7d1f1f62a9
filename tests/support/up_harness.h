// tests/support/up_harness.h — `kvbridge up` topologies as children of a test, and what the
// up/proxy end-to-end tests do with them (tests/integration/up_e2e_test.cc, kv_routing_up_test.cc).
//
//   const std::string dir = MakeTempDir("kvb-x-");
//   ASSERT_EQ(MakeModel(dir + "/model", "tiny", 0), 0);   // serve_harness.h
//   UpTopology up(dir, {"1p1d", "--model", dir + "/model"});
//   ASSERT_TRUE(up.WaitReady()) << up.ReadLog();
//   json got = PostJson(up.port(), "/v1/completions", {{"prompt", "hi"}, {"max_tokens", 4}});
//   LoadLoop load(up.port(), body, /*clients=*/2);   // clients posting in a loop
//   load.WaitOk(5);
//   load.Stop();
//   ExpectEveryInstanceDrained(up.host());
//   EXPECT_EQ(up.Stop(), 0);
//
// Every wait is bounded. Thread-safety: LoadLoop's counters may be read from any thread; the rest
// belongs to the test's thread.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "support/serve_harness.h"
#include "support/subprocess.h"

namespace kvbridge::testing {

/// POST `body` (JSON) to 127.0.0.1:port/path: the answer's JSON (or {"raw": body} when it is not
/// JSON) with "_status" added; {"transport_error": ...} when no answer came.
nlohmann::json PostJson(int port, const std::string& path, const nlohmann::json& body,
                        int read_timeout_s = 120);
/// The same with a raw body (sent as application/json).
nlohmann::json PostRaw(int port, const std::string& path, const std::string& body,
                       int read_timeout_s = 60);
/// GET url + path ("http://127.0.0.1:PORT"): the body of a 200, else "".
std::string GetBody(const std::string& url, const std::string& path);
int PortOf(const std::string& url);

/// `kvbridge up ARGS...` (ARGS start with the topology) with --port (a FreePort unless ARGS
/// give one), --log-dir DIR/logs and --ready-timeout 240 (unless ARGS give them); its output
/// goes to DIR/up.log. SIGTERM, then SIGKILL, when destroyed (Subprocess).
class UpTopology {
 public:
  UpTopology(const std::string& dir, std::vector<std::string> args);
  /// Waits (bounded, 240 s) for "ready in" in up's output; false when up exited or it timed out.
  bool WaitReady();
  int port() const { return port_; }
  std::string host() const { return "http://127.0.0.1:" + std::to_string(port_); }
  Subprocess& process() { return *process_; }
  std::string ReadLog() const { return process_->ReadLog(); }
  /// The pids up printed when ready, by child name ("proxy", "prefill-0", "decode-1", ...).
  std::map<std::string, int> Pids() const;
  /// SIGTERM to up; its exit code (-1 when it did not exit within timeout_ms).
  int Stop(int timeout_ms = 60'000);

 private:
  int port_ = 0;
  std::unique_ptr<Subprocess> process_;
};

/// GET /instances' entry named `name` at the proxy `host` (null when absent).
nlohmann::json InstanceNamed(const std::string& host, const std::string& name);
/// Waits (bounded, 120 s) until the proxy lists `name` healthy, not draining, with `restarts`
/// restarts.
bool WaitRestarted(const std::string& host, const std::string& name, int restarts);

/// Reads GET /instances from the proxy at `host` and checks every instance's own /metrics: no
/// block active or held, no lease expired, no notification ignored (DESIGN.md: fault-free runs
/// need no safety net). A request's blocks are freed just after its answer (the prefill's hold
/// when the decode's done-notification arrives; the gauges are published by the engine loop),
/// so each instance gets up to 10 s for its gauges to reach 0 before they are asserted. Returns
/// the instance list (empty on a malformed answer).
nlohmann::json ExpectEveryInstanceDrained(const std::string& host);

/// `clients` threads, each posting `body` to 127.0.0.1:port/v1/completions in a loop (a new
/// connection per request, as a restarting client would) until Stop(); counts the 200s and
/// keeps every other answer.
class LoadLoop {
 public:
  LoadLoop(int port, nlohmann::json body, int clients);
  ~LoadLoop() { Stop(); }
  /// Waits (bounded, 60 s) until at least `n` requests were answered 200 in all.
  void WaitOk(int n);
  /// Stops and joins the clients (a request in flight finishes first).
  void Stop();
  int ok() const { return ok_.load(); }
  std::vector<std::string> failures() const;

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> ok_{0};
  mutable std::mutex mu_;
  std::vector<std::string> failures_;
  std::vector<std::thread> threads_;
};

}  // namespace kvbridge::testing
