// kvbridge/proxy/proxy_server.h — the P/D proxy's HTTP runtime (`kvbridge proxy`).
//
// An OpenAI-compatible front door: each POST /v1/completions or /v1/chat/completions runs one
// PdFlow (flow.h) whose legs go to the instances of an InstanceRegistry (registry.h); a decode's
// SSE stream is passed through chunk by chunk. Async I/O (Boost.Asio/Beast, C++20 coroutines,
// `threads` event-loop threads; a connection's work stays on one strand). Legs reuse keep-alive
// connections to each engine (ProxyOptions::upstream_max_idle); one that fails on a reused
// connection before any response byte is sent again, once, on a new connection.
//
// Endpoints:
//   POST /v1/completions, /v1/chat/completions   the P→D flow (streaming or not); 429 with
//                                                  Retry-After past max_pending requests in
//                                                  flight; X-Request-Timeout: SECONDS bounds one
//                                                  (flow.h ParseRequestTimeout; 400 when bad)
//   GET  /v1/models                               a decode's (else a prefill's) /v1/models
//   POST /tokenize, /detokenize                   passed to a decode (else a prefill) as they are
//   GET  /health                                  200 {"status":"ok",...} while serving
//   GET  /metrics                                 Prometheus text: kvbridge_proxy_* families
//                                                  (leg_connections_total{kind=new|reused},
//                                                  leg_retries_total, upstream_idle_connections)
//   GET  /v1/prometheus/targets                   Prometheus HTTP service discovery: this proxy
//                                                  and every known instance, label role
//   GET  /instances                               {"mode":..,"proxy_restarts":N,"instances":[{id,
//                                                  role,url,mode,healthy,static,draining,name,
//                                                  restarts,load{running,waiting,kv_usage},
//                                                  in_flight,engine_id,transfer_endpoints}]}
//   POST /v1/instances/register                  registration JSON (registry.h); 200
//                                                  {"instance_id","heartbeat_interval_ms",
//                                                  "expiry_ms"}; 409 mixed mode; 400 bad JSON
//   POST /v1/instances/heartbeat                 {"instance_id", "load"}; 404 when forgotten
//   POST /v1/instances/deregister                {"instance_id"}
// Instance URLs are http://HOST:PORT or https://HOST:PORT (TLS, verified: ProxyOptions::ssl_*).
//   POST /v1/instances/drain                     {"instance_id": ID or name}: never routed to
//                                                  again, and its engine gets POST /drain
//                                                  (200 {"status":"draining",...}; 404 unknown;
//                                                  502 when the engine's /drain failed)
// With a cluster token, the /v1/instances/* calls must carry it (header
// X-KVBridge-Cluster-Token, else 401), and every leg and release sends it.
//
//   ProxyOptions o;
//   o.port = 0;  // any free port
//   o.prefill_urls = {"http://127.0.0.1:8100"};
//   o.decode_urls = {"http://127.0.0.1:8200"};
//   ASSIGN_OR_RETURN(auto proxy, ProxyServer::Create(o));
//   proxy->Start();
//   ... proxy->port() ...
//   proxy->Stop();
//
// Thread-safety: Create/Start/Stop from one thread; the accessors are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/status.h"
#include "kvbridge/proxy/etcd_client.h"
#include "kvbridge/proxy/flow.h"
#include "kvbridge/proxy/registry.h"

namespace kvbridge::proxy {

/// The header that carries the cluster token on legs, releases and registrations.
inline constexpr const char* kClusterTokenHeader = "X-KVBridge-Cluster-Token";

struct ProxyOptions {
  std::string host = "127.0.0.1";
  int port = 10001;                       // 0 = an ephemeral port (see port())
  std::vector<std::string> prefill_urls;  // static instances, http://HOST:PORT
  std::vector<std::string> decode_urls;
  KvTransferMode mode = KvTransferMode::kRead;
  RoutingPolicy routing = RoutingPolicy::kLeastLoaded;
  bool prefill_forward_n = false;
  /// No P/D (FlowOptions::colocated): each request goes whole to one decode-role instance.
  bool colocated = false;
  std::string cluster_token;  // empty = none
  DurationUs heartbeat_timeout = 3 * kSecond;
  DurationUs heartbeat_interval = 1 * kSecond;  // told to registering engines
  DurationUs request_timeout = 600 * kSecond;
  DurationUs connect_timeout = 2 * kSecond;
  DurationUs health_probe_interval = 1 * kSecond;  // static instances' GET /health
  int max_attempts = 3;
  /// A request finding no routable instance of a role (every one draining or restarting) waits
  /// this long for one before its 503 (FlowOptions::instance_wait; 0 = 503 at once).
  DurationUs instance_wait = 30 * kSecond;
  /// Client requests in flight (accepted, not answered) past which new ones get 429 Too Many
  /// Requests with `Retry-After: retry_after_s` at once instead of queueing (0 = no bound).
  int max_pending = 1024;
  int retry_after_s = 1;
  /// How many times `kvbridge up` restarted this proxy (shown in /metrics and /instances).
  int restart_count = 0;
  int threads = 1;
  /// Keep-alive connections to engines kept idle per host:port for later legs (0: a new
  /// connection per leg). A connection is reused only after a complete response.
  int upstream_max_idle = 16;
  /// An idle upstream connection older than this is closed (keep it below the engines'
  /// keep-alive timeout, 2 s for `kvbridge serve`).
  DurationUs upstream_idle_timeout = 1 * kSecond;
  /// TLS, as `kvbridge serve` names it: both set = the proxy's port speaks HTTPS only (PEM
  /// certificate chain and key; Create fails with InvalidArgument naming a file that cannot be
  /// read or a key that does not match). The same certificate is presented to engines that ask
  /// for a client certificate (engines with --ssl-ca-certs).
  std::string ssl_certfile;
  std::string ssl_keyfile;
  /// PEM CA bundle that verifies https:// engines (their chain, and the URL's host name or IP
  /// address in the certificate's subjectAltName); empty = the system's CA store. A leg, release
  /// or probe to an engine whose certificate does not verify fails before any HTTP byte is sent
  /// ("TLS handshake with https://H:P: certificate verify failed: <OpenSSL's reason>").
  std::string ssl_ca_certs;
  /// KV-aware routing is routing = kKvAware; the P/D skip (kv_routing.h) is this threshold in
  /// tokens the chosen decode may lack (< 0: off). Either one makes the proxy follow every
  /// engine's GET /v1/kv/events (long polls of kv_events_poll_ms) into a KvIndex of at most
  /// kv_index_max_blocks hashes, and take each request's prompt ids: from prompt_ids when set
  /// (in process, server::PromptTokenizer over the model directory), else from an engine's
  /// POST /tokenize. A request whose ids cannot be had is routed by the registry alone.
  int pd_skip_threshold = -1;
  std::function<Result<std::vector<int32_t>>(std::string_view path, std::string_view body)>
      prompt_ids;
  int kv_events_poll_ms = 2000;
  size_t kv_index_max_blocks = size_t{1} << 20;
  /// The etcd control plane (etcd_client.h; `--etcd`): members empty = off. When set, the proxy
  /// lists and watches `etcd_prefix` (EtcdInstancesPrefix(cluster)) into its registry: records
  /// whose HMAC verifies under cluster_token are routed to, others ignored with a log line; an
  /// instance leaves when its key does (lease expired or revoked). Their load comes from their
  /// GET /health, probed every health_probe_interval like static instances'.
  EtcdClientOptions etcd;
  std::string etcd_prefix;
};

class ProxyServer {
 public:
  /// Validates the options, adds the static instances and binds the listening socket.
  /// InvalidArgument for bad options/urls; Unavailable when the address cannot be bound.
  static Result<std::unique_ptr<ProxyServer>> Create(const ProxyOptions& options);
  ~ProxyServer();
  ProxyServer(const ProxyServer&) = delete;
  ProxyServer& operator=(const ProxyServer&) = delete;

  /// Starts the event-loop threads; returns at once.
  void Start();
  /// Stops serving and joins the threads (in-flight requests are dropped). Idempotent.
  void Stop();
  /// The bound port.
  int port() const;
  /// A snapshot of the instances (as GET /instances).
  std::vector<InstanceState> Instances() const;
  /// The /metrics text.
  std::string MetricsText() const;

  struct Impl;

 private:
  explicit ProxyServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge::proxy
