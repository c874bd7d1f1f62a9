// kvbridge/connector/kvbridge_connector.h — the runtime P/D connector: the I/O shell around the
// sans-IO ConnectorLogic (connector_logic.h: hook mapping and cores), wired to transfer agents,
// threads and HTTP.
//
// One KvBridgeRuntime per engine process. It makes the engine's KvConnector (through Factory())
// and hands out the connector's HTTP routes as plain data (http_route.h) for the engine's HTTP
// server to install, so this library does not link the server:
//
//   ASSIGN_OR_RETURN(KvTransferConfig cfg, ParseKvTransferConfig(flag));
//   ASSIGN_OR_RETURN(auto kv, KvBridgeRuntime::Create({.config = cfg, .cluster_token = tok}));
//   engine_config.connector_factory = kv->Factory();
//   ASSIGN_OR_RETURN(auto engine, Engine::Create(engine_config, model));
//   server_config.validate_kv_transfer_params = kv->ValidateHook();
//   server_config.cluster_token = tok;
//   ASSIGN_OR_RETURN(auto server, server::ApiServer::Create(server_config, engine.get(), codec));
//   for (Route& r : kv->Routes()) RETURN_IF_ERROR(server->RegisterRoute(std::move(r)));
//   RETURN_IF_ERROR(server->Start());
//   kv->SetAdvertisedEndpoint("127.0.0.1", server->port());  // what prefills return to proxies
//
// HTTP routes (docs/protocol.md): GET /v1/kv/metadata/<rank> (that TP rank's transfer-agent
// metadata: endpoints, tp_size, tp_rank, head range; 404 past the engine's ranks),
// GET /v1/kv/metadata (rank 0's transfer-agent metadata,
// JSON), POST /v1/kv/release {"transfer_id", ["prefill_engine_id"]} (the proxy's explicit
// release), both behind the cluster token when one is configured.
//
// The decode fetches a prefill's agent metadata once per prefill incarnation with GET
// /v1/kv/metadata on kv_transfer_params.remote_host:remote_port, then READs blocks with the agent
// and sends control messages (messages.h) as agent notifications; the prefill answers ReadDone
// on the notification's reply path.
//
// Thread-safety: Create/Factory/Routes/SetAdvertisedEndpoint from the controlling thread
// before serving; ValidateHook and the routes run on HTTP threads; the KvConnector runs on the
// engine thread (kv_connector.h). Internal threads: one metadata fetcher, one transfer (READ and
// WRITE) watcher.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvbridge/common/http_client.h"
#include "kvbridge/common/http_route.h"
#include "kvbridge/common/status.h"
#include "kvbridge/connector/kv_transfer_config.h"
#include "kvbridge/engine/kv_connector.h"

namespace kvbridge {

struct KvBridgeOptions {
  KvTransferConfig config;
  std::string cluster_token;  ///< sent on metadata fetches; required by our routes; proven by the
                              ///< agents' handshakes
  std::string advertise_host = "127.0.0.1";  ///< remote_host returned by a prefill
  int advertise_port = 0;                    ///< remote_port; set later with SetAdvertisedEndpoint
  std::string bind_host = "127.0.0.1";       ///< transfer agent's tcp listen address
  /// The peers' control endpoints speak HTTPS (true when this engine serves HTTPS: the engines of
  /// one P/D cluster are all https or all http). Metadata fetches then verify the peer per
  /// `peer_tls` and fail (the load falls back per kv_load_failure_policy) when it does not.
  bool peer_https = false;
  HttpClientTls peer_tls;
  /// Informational: the engine's hooks (EngineHooks::tp_size / ranks) decide the TP size and
  /// the connector serves every rank (one transfer agent per rank). tp_size must be 1 or the
  /// engine's (else the connector refuses to start); tp_rank is not used.
  int tp_rank = 0;
  int tp_size = 1;
  /// Test-only: flip one byte of the first block of every READ after it lands (the
  /// "corrupted transfer must change the logprobs" check). Never set outside tests.
  bool debug_corrupt_first_read_block = false;
};

/// Counters and gauges of the live connector (also exported as kvbridge_kv_* metrics).
struct KvBridgeStats {
  int64_t transfers = 0;           ///< prefill transfer-table entries
  int64_t held_blocks = 0;         ///< distinct blocks held for transfers
  int64_t parked = 0;              ///< parked messages
  int64_t waiting_for_remote = 0;  ///< decode requests waiting for remote KV
  int64_t reads_inflight = 0;
  int64_t lease_expired = 0;
  int64_t notifications_ignored = 0;
  int64_t load_failures = 0;
  int64_t loads_done = 0;
  double bytes_read = 0;
  // WRITE mode (docs/metrics.md): prefill side
  int64_t writes_inflight = 0;
  double bytes_written = 0;
  int64_t write_targets_done = 0;     ///< (transfer, decode rank) written completely
  int64_t write_transfer_us_sum = 0;  ///< over those: first WRITE posted → last WRITE done, µs
  int64_t write_compute_us_sum = 0;   ///< over completed transfers: first → last layer of the
                                      ///< request's final chunk, µs
  // WRITE mode: decode side
  int64_t write_loads_done = 0;
  int64_t write_overlap_us_sum = 0;  ///< over those: prefill's last layer computed → go, µs
  bool idle = true;
};

class KvBridgeRuntime {
 public:
  /// InvalidArgument for a bad tp_rank/tp_size. Both modes run in every engine: a request's
  /// kv_transfer_params.mode picks READ or WRITE (the config's mode is what it registers).
  static Result<std::shared_ptr<KvBridgeRuntime>> Create(KvBridgeOptions options);
  ~KvBridgeRuntime();
  KvBridgeRuntime(const KvBridgeRuntime&) = delete;
  KvBridgeRuntime& operator=(const KvBridgeRuntime&) = delete;

  /// The engine's connector factory (one engine per runtime; a second call to the factory fails
  /// with FailedPrecondition). The connector registers the engine's KV pool with a new
  /// transfer agent and its metrics in EngineHooks::metrics.
  KvConnectorFactory Factory();
  /// ServerConfig::validate_kv_transfer_params: parses, checks the role (do_remote_decode needs
  /// kv_producer|kv_both, do_remote_prefill needs kv_consumer|kv_both) and normalizes in place.
  /// InvalidArgument (HTTP 400) with no effect otherwise.
  std::function<Status(nlohmann::json&)> ValidateHook() const;
  /// GET /v1/kv/metadata, GET /v1/kv/metadata/<rank> and POST /v1/kv/release, each behind
  /// the cluster token (403 without it) when one is configured. Install them before the server
  /// starts; the handlers hold the runtime alive and may run on any thread, concurrently.
  std::vector<Route> Routes();
  /// remote_host/remote_port that this engine's prefill answers carry (its HTTP endpoint).
  void SetAdvertisedEndpoint(const std::string& host, int port);
  /// This engine incarnation's id (remote_engine_id): config engine_id, else "kvb-<random hex>".
  const std::string& engine_id() const;
  /// Snapshot (thread-safe).
  KvBridgeStats Stats() const;
  /// The backend ("shm", "tcp", "ucx") chosen for each peer agent this engine has connected to
  /// (peer agent name -> backend name); empty before the first remote load. Thread-safe.
  std::map<std::string, std::string> PeerBackends() const;
  /// The backends this engine's transfer agent offers to peers (its metadata's endpoints, sorted;
  /// "shm" only when the KV pool is shareable); empty before the engine exists. Thread-safe.
  std::vector<std::string> LocalBackends() const;

  class Impl;

 private:
  explicit KvBridgeRuntime(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace kvbridge
