// kvbridge/proxy/etcd_client.h — the I/O shells of the etcd control plane (etcd.h's cores over
// cpp-httplib): an engine's registration (`serve --etcd`) and a proxy's registry feed
// (`proxy --etcd`). docs/proxy.md "Control plane on etcd".
//
//   ASSIGN_OR_RETURN(EtcdClientOptions eo, ParseEtcdOptions("http://127.0.0.1:2379", "", ""));
//   auto reg = EtcdRegistration::Start(eo, key, EtcdRecordValue(key, record, token), 5);
//   ... reg->Stop();   // revokes the lease: the record goes at once
//
//   auto feed = EtcdWatchFeed::Start(eo, prefix, [&](std::vector<EtcdKvUpdate> u) { ... });
//   ... feed->Stop();
//
// Trust: ParseEtcdOptions refuses an endpoint off loopback unless the store authenticates this
// client (a user, or https with a CA that verifies the members): an open store would let anyone
// write an "engine" record and receive prompts (the records' HMAC stops forged records, but not
// deleted ones, and the store is the cluster's availability).
//
// Thread-safety: Start/Stop from one thread; registered()/last_error() from any. The feed's
// callback runs on the feed's own thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/http_client.h"
#include "kvbridge/common/status.h"
#include "kvbridge/proxy/etcd.h"

namespace kvbridge::proxy {

struct EtcdClientOptions {
  std::vector<HttpTarget> endpoints;  // the members, tried in turn
  std::string user;                   // etcd auth (POST /v3/auth/authenticate); empty = none
  std::string password;
  HttpClientTls tls;  // verifies https members (ca_file), the client certificate they may ask for
  DurationUs request_timeout = 2 * kSecond;
  DurationUs retry_backoff = 200 * kMillisecond;
};

/// Parses `--etcd http://H:P[,https://H:P...]`, `--etcd-user USER:PASSWORD` (may be empty) and
/// `--etcd-ca FILE` (may be empty). InvalidArgument for a malformed list, and for a member off
/// loopback (127.0.0.0/8, ::1, localhost) when neither a user nor https with a CA is given
/// (the message says which flag to add).
Result<EtcdClientOptions> ParseEtcdOptions(std::string_view endpoints, std::string_view user,
                                           std::string_view ca_file);

/// Runs an EtcdLeaseKeeper on its own thread.
class EtcdRegistration {
 public:
  static std::unique_ptr<EtcdRegistration> Start(EtcdClientOptions options, std::string key,
                                                 std::string value, int64_t ttl_s);
  ~EtcdRegistration();
  EtcdRegistration(const EtcdRegistration&) = delete;
  EtcdRegistration& operator=(const EtcdRegistration&) = delete;

  /// Puts a new value (same key, same lease).
  void SetValue(std::string value);
  bool registered() const { return registered_.load(); }
  int64_t lease_id() const { return lease_id_.load(); }
  int grants() const { return grants_.load(); }
  /// Revokes the lease (best effort, one try per member within request_timeout) and joins.
  /// Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit EtcdRegistration(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> registered_{false};
  std::atomic<int64_t> lease_id_{0};
  std::atomic<int> grants_{0};
};

/// Runs an EtcdPrefixWatcher on its own thread; `apply` gets each batch of updates in order.
class EtcdWatchFeed {
 public:
  using Apply = std::function<void(std::vector<EtcdKvUpdate>)>;
  static std::unique_ptr<EtcdWatchFeed> Start(EtcdClientOptions options, std::string prefix,
                                              Apply apply);
  ~EtcdWatchFeed();
  EtcdWatchFeed(const EtcdWatchFeed&) = delete;
  EtcdWatchFeed& operator=(const EtcdWatchFeed&) = delete;

  int lists() const { return lists_.load(); }
  int watches() const { return watches_.load(); }
  int64_t revision() const { return revision_.load(); }
  /// Closes the stream and joins. Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit EtcdWatchFeed(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::atomic<int> lists_{0};
  std::atomic<int> watches_{0};
  std::atomic<int64_t> revision_{0};
};

}  // namespace kvbridge::proxy
