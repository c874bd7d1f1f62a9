// kvbridge/proxy/registry.h — the proxy's instance registry and routing, sans-IO.
//
// Holds the prefill and decode instances the proxy may route to: static ones (from
// `--prefill URL --decode URL`, never expire; health set by the runtime's probes) and registered
// ones (POST /v1/instances/register, kept alive by heartbeats carrying their load; dropped when
// no heartbeat came for `heartbeat_timeout`). All instances share the proxy's KV mode: a
// registration in another mode is refused (FailedPrecondition, with the reason).
//
//   InstanceRegistry reg({.mode = KvTransferMode::kRead, .heartbeat_timeout = 3 * kSecond});
//   RETURN_IF_ERROR(reg.AddStatic(Role::kPrefill, "http://127.0.0.1:8100"));
//   RETURN_IF_ERROR(reg.Register(info, load, now));
//   reg.Heartbeat(info.id, load, now);
//   std::vector<std::string> dropped = reg.Expire(now);
//   std::optional<Endpoint> ep = reg.Pick(Role::kDecode, /*exclude=*/{});
//
// Routing: kLeastLoaded picks the healthy instance with the smallest
// (running + waiting from its last heartbeat + legs the proxy has in flight to it), then the
// lowest KV usage, ties broken round-robin; kRoundRobin cycles through healthy instances.
//
// Thread-safety: none (the proxy runtime wraps it in a mutex; the simulator drives it directly).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/status.h"
#include "kvbridge/proxy/flow.h"

namespace kvbridge::proxy {

/// kKvAware: the KV-aware router (kv_routing.h) picks by cached prefix against load; where it has
/// no choice to make (no prompt ids, a retry), Pick acts as kLeastLoaded.
enum class RoutingPolicy { kLeastLoaded, kRoundRobin, kKvAware };
/// Parses "least-loaded" / "round-robin" / "kv-aware"; InvalidArgument otherwise.
Result<RoutingPolicy> ParseRoutingPolicy(std::string_view text);

/// An engine's load, from its heartbeats. kv_usage is the fraction of KV blocks in use, [0, 1].
struct InstanceLoad {
  int running = 0;
  int waiting = 0;
  double kv_usage = 0.0;
};

/// What an engine registers. JSON shape (POST /v1/instances/register):
///   {"instance_id": "...", "role": "prefill|decode", "url": "http://127.0.0.1:8100",
///    "mode": "read|write", "engine_id": "...", "transfer_endpoints": ["tcp://127.0.0.1:9100"],
///    "tp_size": 1, "name": "decode-0", "restarts": 0, "kv_role": "kv_consumer",
///    "load": {"running": 0, "waiting": 0, "kv_usage": 0.0}}
/// instance_id defaults to the url. transfer_endpoints' first "scheme://host:port" gives the
/// Endpoint's transfer_host/transfer_port (WRITE mode needs them). tp_size (optional, default 1,
/// an integer in [1, 64]) is the engine's tensor-parallel size: WRITE mode's decode leg names the
/// prefill's. name (optional, [A-Za-z0-9._-]{1,64}) is a stable name across restarts (`kvbridge up`
/// gives "prefill-0", "decode-1", ...): a registration under a name another instance holds
/// replaces that one (the restarted engine is a new incarnation at a new url). restarts
/// (optional, integer >= 0) is how many times `up` restarted it. kv_role (optional:
/// kv_producer|kv_consumer|kv_both, vLLM's names) "kv_both" says the engine takes either leg: it
/// is registered under `role` and kv-aware routing (kv_routing.h) may also send it the other
/// role's leg when it holds more of a prompt (least-loaded and round-robin never do).
struct InstanceInfo {
  std::string id;
  Role role = Role::kPrefill;
  std::string url;
  KvTransferMode mode = KvTransferMode::kRead;
  std::string engine_id;
  std::vector<std::string> transfer_endpoints;
  int tp_size = 1;
  std::string name;
  int restarts = 0;
  bool kv_both = false;  ///< kv_role "kv_both": may also serve the other role's leg
};

/// One instance as GET /instances shows it.
struct InstanceState {
  InstanceInfo info;
  InstanceLoad load;
  bool is_static = false;
  bool healthy = true;
  bool draining = false;    // told to drain: never picked again
  bool from_store = false;  // from the etcd control plane (etcd.h): no heartbeat expiry
  TimePoint last_heartbeat = 0;
  int in_flight = 0;  // legs the proxy has open to it
};

struct RegistryOptions {
  KvTransferMode mode = KvTransferMode::kRead;
  DurationUs heartbeat_timeout = 3 * kSecond;
  RoutingPolicy policy = RoutingPolicy::kLeastLoaded;
};

class InstanceRegistry {
 public:
  explicit InstanceRegistry(RegistryOptions options) : options_(options) {}

  /// Adds a static instance at `url` (http://host:port). InvalidArgument for a malformed url;
  /// AlreadyExists when the url is already known.
  Status AddStatic(Role role, const std::string& url);
  /// Registers (or re-registers, replacing) an instance; a registered instance of another id
  /// with the same non-empty name (an earlier incarnation) is removed and its id appended to
  /// `replaced`. InvalidArgument for a missing url or a bad name; FailedPrecondition when its
  /// mode differs from the proxy's (mixed READ/WRITE is refused).
  Status Register(const InstanceInfo& info, const InstanceLoad& load, TimePoint now,
                  std::vector<std::string>* replaced = nullptr);
  /// Register for an instance whose record is in the control-plane store (etcd.h): it never
  /// expires for missed heartbeats (its lease in the store does that), it leaves by Remove.
  Status RegisterFromStore(const InstanceInfo& info, const InstanceLoad& load, TimePoint now,
                           std::vector<std::string>* replaced = nullptr);
  /// Records a heartbeat. NotFound when `id` is unknown (expired: the engine re-registers).
  Status Heartbeat(const std::string& id, const InstanceLoad& load, TimePoint now);
  /// Drops registered instances whose last heartbeat is older than heartbeat_timeout; returns
  /// their ids.
  std::vector<std::string> Expire(TimePoint now);
  /// Removes an instance (a registered engine that said goodbye). NotFound when unknown.
  Status Remove(const std::string& id);
  /// Marks an instance healthy or not (runtime probes of static instances).
  void SetHealthy(const std::string& id, bool healthy);
  /// Marks an instance draining: Pick never returns it again (it stays listed until it
  /// deregisters or expires). NotFound when unknown.
  Status SetDraining(const std::string& id);
  /// The instance whose id or, failing that, name is `key`.
  std::optional<InstanceState> Find(const std::string& key) const;
  /// Picks an instance of `role` whose id and url are not in `exclude`; nullopt when none is
  /// healthy. (A url in `exclude` keeps a decode leg off the engine that holds the prefill: one
  /// engine cannot READ from itself.)
  std::optional<Endpoint> Pick(Role role, const std::vector<std::string>& exclude);
  /// The healthy instances of `role`, ordered by id (valid until the registry next changes).
  std::vector<const InstanceState*> Healthy(Role role) const;
  /// In-flight leg accounting for routing and metrics.
  void LegStarted(const std::string& id);
  void LegFinished(const std::string& id);
  /// Every instance, ordered by id.
  std::vector<InstanceState> List() const;
  std::optional<InstanceState> Get(const std::string& id) const;
  const RegistryOptions& options() const { return options_; }

 private:
  RegistryOptions options_;
  std::map<std::string, InstanceState> instances_;
  uint64_t rr_counter_[2] = {0, 0};
};

/// Parses an InstanceInfo (+ its load) from the registration JSON above. InvalidArgument with the
/// field at fault.
Result<std::pair<InstanceInfo, InstanceLoad>> ParseRegistration(std::string_view json_text);
/// Parses {"running":..,"waiting":..,"kv_usage":..} (missing fields are 0).
Result<InstanceLoad> ParseLoad(std::string_view json_text);
/// The registration JSON for `info` and `load` (inverse of ParseRegistration).
std::string RegistrationJson(const InstanceInfo& info, const InstanceLoad& load);
/// Endpoint of an instance state (transfer host/port from its first transfer endpoint).
Endpoint ToEndpoint(const InstanceInfo& info);

}  // namespace kvbridge::proxy
