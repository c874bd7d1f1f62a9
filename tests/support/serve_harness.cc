#include "support/serve_harness.h"

#include <httplib.h>
#include <stdlib.h>

#include "kvbridge/common/metrics.h"
#include "support/free_port.h"

namespace kvbridge::testing {

using nlohmann::json;

json TransferConfigJson(const std::string& role, const json& extra) {
  return json{{"kv_connector", "KVBridgeConnector"},
              {"kv_role", role},
              {"kv_connector_extra_config", extra}};
}

ServedEngine SpawnServe(const ServeSpec& spec) {
  ServedEngine e;
  e.port = spec.port != 0 ? spec.port : FreePort();
  e.log = spec.log_path;
  std::vector<std::string> argv = spec.launcher;
  argv.insert(argv.end(), {KvbridgeBin(), "serve", spec.model_dir, "--port", std::to_string(e.port),
                           "--served-model-name", spec.served_model_name});
  if (!spec.host.empty()) argv.insert(argv.end(), {"--host", spec.host});
  if (spec.num_kv_blocks > 0) {
    argv.insert(argv.end(), {"--num-kv-blocks", std::to_string(spec.num_kv_blocks)});
  }
  if (!spec.role.empty()) {
    argv.insert(argv.end(),
                {"--kv-transfer-config", TransferConfigJson(spec.role, spec.extra_config).dump()});
    if (!spec.cluster_token.empty()) {
      argv.insert(argv.end(), {"--cluster-token", spec.cluster_token});
    }
  }
  argv.insert(argv.end(), spec.extra_args.begin(), spec.extra_args.end());
  // The child inherits the environment at fork: set the switches around the spawn only.
  for (const auto& [k, v] : spec.env) setenv(k.c_str(), v.c_str(), 1);
  e.proc = std::make_unique<Subprocess>(argv, e.log);
  for (const auto& [k, v] : spec.env) unsetenv(k.c_str());
  return e;
}

int MakeModel(const std::string& out, const std::string& preset, int seed, int timeout_ms,
              const std::vector<std::string>& extra_args) {
  std::vector<std::string> argv = {KvbridgeBin(), "make-model", "--preset", preset};
  if (seed >= 0) argv.insert(argv.end(), {"--seed", std::to_string(seed)});
  argv.insert(argv.end(), {"--out", out});
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  Subprocess make(argv);
  return make.Wait(timeout_ms);
}

double ScrapeMetricAt(int port, const std::string& name, const std::string& labels) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(5, 0);
  auto r = c.Get("/metrics");
  return r && r->status == 200 ? ScrapeMetric(r->body, name, labels) : -2;
}

bool MetricsDrained(int port) {
  for (const char* name :
       {"kvbridge_kv_blocks_active", "kvbridge_kv_blocks_held_for_transfer",
        "kvbridge_kv_transfer_table_entries", "kvbridge_kv_transfers_inflight",
        "kvbridge_kv_notifications_parked", "kvbridge_requests_running",
        "kvbridge_requests_waiting", "kvbridge_requests_waiting_for_remote_kv"}) {
    if (ScrapeMetricAt(port, name) != 0) return false;
  }
  return true;
}

}  // namespace kvbridge::testing
