// kvbridge/proxy/registration.h — the engine side of proxy registration (`serve --proxy H:P`).
//
// An engine registers its role, HTTP address, transfer endpoints and KV mode with the proxy,
// then heartbeats its load every interval; the proxy drops an instance whose heartbeats stop
// (proxy_server.h describes the endpoints). If the proxy forgets the engine (restart, expiry),
// the next heartbeat gets 404 and the client registers again.
//
//   RegistrationOptions o;
//   o.proxy = "127.0.0.1:10001";
//   o.info = {.id = "", .role = Role::kDecode, .url = "http://127.0.0.1:8200",
//             .mode = KvTransferMode::kRead, .engine_id = engine_id,
//             .transfer_endpoints = {"tcp://127.0.0.1:9200"}};
//   o.cluster_token = token;
//   auto client = RegistrationClient::Start(o, [&] { return CurrentLoad(); });  // thread
//   ...
//   client->Stop();  // deregisters (best effort) and joins
//
// Thread-safety: RegistrationClient's methods may be called from any thread; `load` is called
// from the client's own thread and must be thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/http_client.h"
#include "kvbridge/common/status.h"
#include "kvbridge/common/thread_annotations.h"
#include "kvbridge/proxy/registry.h"

namespace kvbridge::proxy {

struct RegistrationOptions {
  std::string proxy;  // "HOST:PORT", "http://HOST:PORT" or "https://HOST:PORT" (TLS, per `tls`)
  HttpClientTls tls;  // verifies an https proxy; the client certificate shown when it asks
  InstanceInfo info;  // info.id empty = the proxy uses info.url
  std::string cluster_token;
  DurationUs heartbeat_interval = 1 * kSecond;
  DurationUs request_timeout = 2 * kSecond;
};

/// One registration call. Ok on 200; FailedPrecondition when refused (mixed READ/WRITE, the
/// message says why); Unauthenticated on 401; InvalidArgument on 400; Unavailable when the proxy
/// cannot be reached.
Status RegisterWithProxy(const RegistrationOptions& options, const InstanceLoad& load);
/// One heartbeat. NotFound when the proxy no longer knows the instance (register again).
Status SendHeartbeat(const RegistrationOptions& options, const InstanceLoad& load);
/// Tells the proxy to drop the instance now. NotFound when it did not know it.
Status Deregister(const RegistrationOptions& options);

class RegistrationClient {
 public:
  using LoadFn = std::function<InstanceLoad()>;
  /// Starts the heartbeat thread: it registers (retrying every interval until the proxy answers),
  /// then heartbeats every interval, registering again on NotFound. Never fails: progress is
  /// visible through registered() and last_status(), and logged.
  static std::unique_ptr<RegistrationClient> Start(RegistrationOptions options, LoadFn load);
  ~RegistrationClient();
  RegistrationClient(const RegistrationClient&) = delete;
  RegistrationClient& operator=(const RegistrationClient&) = delete;

  /// True once the proxy accepted the registration (and no heartbeat since got 404).
  bool registered() const { return registered_.load(); }
  /// The last call's outcome.
  Status last_status() const;
  /// Stops heartbeating, deregisters (best effort, when registered) and joins. Idempotent.
  void Stop();

 private:
  RegistrationClient(RegistrationOptions options, LoadFn load);
  void Run();

  RegistrationOptions options_;
  LoadFn load_;
  std::atomic<bool> registered_{false};
  mutable Mutex mu_;
  std::condition_variable cv_;
  bool stop_ GUARDED_BY(mu_) = false;
  Status last_status_ GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace kvbridge::proxy
