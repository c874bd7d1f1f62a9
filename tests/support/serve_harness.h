// tests/support/serve_harness.h — `kvbridge serve` engines as child processes, for the P/D tests
// that play the proxy over HTTP (pd_serve_test, pd_tls_test, pd_failure_test, pd_timeline_test),
// and the model every multi-process test makes (MakeModel; the `up` tests too).
//
//   const std::string model = MakeTempDir("kvb_x") + "/tiny";
//   ASSERT_EQ(MakeModel(model, "tiny", 5), 0);
//   ServedEngine p = SpawnServe({.model_dir = model, .role = "kv_producer",
//                                .extra_config = {{"transport", "tcp"}}, .log_path = log});
//   ASSERT_TRUE(WaitForHttpOk("127.0.0.1", p.port, "/health", 60'000)) << p.proc->ReadLog();
//   EXPECT_EQ(ScrapeMetricAt(p.port, "kvbridge_kv_lease_expired_total"), 0);
//
// Not thread-safe: SpawnServe sets the child's extra environment in this process around the fork.
#pragma once

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/subprocess.h"

namespace kvbridge::testing {

/// How to start one `kvbridge serve`.
struct ServeSpec {
  std::string model_dir;
  std::string served_model_name = "tiny";
  /// --num-kv-blocks; 0 passes none (the server's default).
  int num_kv_blocks = 0;
  /// "kv_producer" | "kv_consumer"; empty: colocated, no --kv-transfer-config.
  std::string role;
  /// kv_connector_extra_config (only with a role).
  nlohmann::json extra_config = nlohmann::json::object();
  /// --cluster-token (only with a role); empty passes none.
  std::string cluster_token;
  /// Environment set for the child only.
  std::vector<std::pair<std::string, std::string>> env;
  /// Where the child's stdout and stderr go.
  std::string log_path;
  /// 0: a FreePort().
  int port = 0;
  /// --host; empty passes none (the server's default).
  std::string host;
  /// More arguments, after the others (--ssl-certfile F, --proxy H:P, ...).
  std::vector<std::string> extra_args;
  /// Runs the engine under this command (e.g. {"ip", "netns", "exec", "ns1"}); empty: directly.
  std::vector<std::string> launcher;
};

/// A running `kvbridge serve` (killed when `proc` is destroyed).
struct ServedEngine {
  std::unique_ptr<Subprocess> proc;
  int port = 0;
  std::string log;
};

/// The --kv-transfer-config JSON for `role` with `extra` as kv_connector_extra_config.
nlohmann::json TransferConfigJson(const std::string& role, const nlohmann::json& extra);

/// Starts `kvbridge serve` per `spec`; does not wait for it to be healthy.
ServedEngine SpawnServe(const ServeSpec& spec);

/// Runs `kvbridge make-model --preset <preset> [--seed <seed>] --out <out> [extra_args...]`
/// (seed < 0: none); returns its exit code (-1 when it ran past `timeout_ms`).
int MakeModel(const std::string& out, const std::string& preset, int seed = -1,
              int timeout_ms = 120'000, const std::vector<std::string>& extra_args = {});

/// The value of metric `name` (with `labels`, e.g. `reason="abort"`) from
/// http://127.0.0.1:port/metrics (5 s read timeout); -2 when it does not answer 200, -1 when the
/// metric is absent (kvbridge::ScrapeMetric).
double ScrapeMetricAt(int port, const std::string& name, const std::string& labels = "");

/// True when nothing is active, held, running or waiting, the connector's tables are empty and
/// no transfer is in flight, read from the engine's /metrics.
bool MetricsDrained(int port);

/// Polls `pred` every 10 ms until it holds or `ms` milliseconds pass; returns whether it held.
template <typename Pred>
bool WaitFor(Pred pred, int ms) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(ms)) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

}  // namespace kvbridge::testing
