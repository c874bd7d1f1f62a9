// kvbridge/proxy/etcd.h — the control plane on etcd (issue 25), sans-IO: an engine's lease +
// instance record, and a proxy's list + watch of the cluster's records (docs/proxy.md
// "Control plane on etcd").
//
// Both talk to etcd 3.4's v3 JSON gateway over HTTP (no gRPC): POST /v3/lease/grant,
// /v3/lease/keepalive, /v3/lease/revoke, /v3/kv/put, /v3/kv/range, /v3/watch; keys and values
// are base64 in the JSON, int64s are decimal strings. The cores below never do I/O: they emit
// EtcdCalls (which endpoint, path, body), take the replies (and, for a watch, each streamed JSON
// message) and `now`, and say when they next want a tick. etcd_client.h runs them over
// cpp-httplib; the unit tests drive them against a fake etcd.
//
//   EtcdLeaseKeeper keeper({.endpoints = 3, .key = key, .value = record, .ttl_s = 5});
//   keeper.Start(now);
//   for (EtcdCall& c : keeper.TakeCalls()) { ... keeper.OnReply(reply, now); }
//   keeper.OnTick(now);   // at keeper.next_tick()
//
//   EtcdPrefixWatcher watcher({.endpoints = 3, .prefix = "/kvbridge/c/instances/"});
//   watcher.Start(now);   // range, then watch from the listed revision + 1
//   watcher.OnStreamMessage(call_id, line, now);   // each message of the watch stream
//   for (EtcdKvUpdate& u : watcher.TakeUpdates()) apply(u);
//
// Failures: a call that fails (no answer, a non-2xx status, an etcd error such as "no leader")
// moves the core to the next endpoint and retries after `retry_backoff`; so a dead member or a
// leader election costs one retry. A watch whose start revision was compacted (etcd cancels it
// with compact_revision) and a watch stream that ends are handled: the first lists again (a
// kReset update carries the whole prefix), the second watches again from the last revision
// seen + 1 on the next endpoint, so no change is missed or applied twice.
//
// Records (what an engine writes, what a proxy accepts): EtcdRecordValue / VerifyEtcdRecord —
// {"record": "<the registration JSON, as text>", "hmac": "<hex HMAC-SHA256>"} with the HMAC over
// "kvbridge-etcd-v1\n" + key + "\n" + record, keyed by the cluster token (never written to etcd).
//
// Thread-safety: none; each core is owned by one thread.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/status.h"
#include "kvbridge/proxy/registry.h"

namespace kvbridge::proxy {

/// Standard base64 (RFC 4648, with padding), as the gateway's `bytes` fields.
std::string Base64Encode(std::string_view bytes);
/// InvalidArgument on a character outside the alphabet or a bad length.
Result<std::string> Base64Decode(std::string_view text);
/// The range_end that makes a range or watch cover every key starting with `prefix` (etcd's
/// "prefix + 1": the last byte below 0xff incremented, what follows it dropped).
std::string PrefixRangeEnd(std::string_view prefix);
/// "/kvbridge/<cluster>/instances/" — where a cluster's instance records live. The cluster name
/// must be 1-64 of [A-Za-z0-9._-] (InvalidArgument otherwise).
Result<std::string> EtcdInstancesPrefix(std::string_view cluster);

/// One HTTP call to the gateway: POST `path` with the JSON `body` to endpoint `endpoint` (an
/// index into the cores' endpoint list). `stream`: a watch, whose answer is a stream of JSON
/// messages (OnStreamMessage each), ended by the server, the network, or a CloseStream.
struct EtcdCall {
  uint64_t id = 0;
  int endpoint = 0;
  std::string path;
  std::string body;
  bool stream = false;
};

/// How a call ended. `transport` not ok: no HTTP answer (connect/read failed, timeout, or, for a
/// stream, the stream broke); else `http_status` and the whole `body` (empty for a stream).
struct EtcdReply {
  uint64_t id = 0;
  Status transport;
  int http_status = 0;
  std::string body;
};

/// An engine's registration in etcd: grant a lease of `ttl_s`, put `key` = `value` attached to
/// it, keep the lease alive every `keepalive_interval` (default ttl/3). A keepalive that finds
/// the lease gone (expired while every endpoint failed, or revoked) grants a new one and puts the
/// record again. SetValue re-puts (the record changed); Stop revokes the lease (the key goes at
/// once: proxies drop the instance).
///
/// States: kIdle -Start-> kGranting -granted-> kPutting -put-> kKept (keepalives) ;
/// any failure -> kBackoff (next endpoint) -> the step that failed ; lease gone -> kGranting ;
/// Stop -> kRevoking -> kStopped (or kStopped at once without a lease).
struct EtcdLeaseOptions {
  int endpoints = 1;
  std::string key;
  std::string value;
  int64_t ttl_s = 5;
  DurationUs keepalive_interval = 0;  // 0 = ttl / 3
  DurationUs retry_backoff = 200 * kMillisecond;
};

class EtcdLeaseKeeper {
 public:
  enum class State { kIdle, kGranting, kPutting, kKept, kBackoff, kRevoking, kStopped };

  explicit EtcdLeaseKeeper(EtcdLeaseOptions options);
  void Start(TimePoint now);
  void OnReply(const EtcdReply& reply, TimePoint now);
  void OnTick(TimePoint now);
  /// A new record value: put at once when kept, else with the next put.
  void SetValue(std::string value, TimePoint now);
  void Stop(TimePoint now);

  /// Calls to make now (each answered by one OnReply with its id).
  std::vector<EtcdCall> TakeCalls();
  /// When OnTick wants to run next; nullopt while a call is out or when stopped.
  std::optional<TimePoint> next_tick() const;
  State state() const { return state_; }
  /// True while the record is in etcd under a lease this keeper keeps alive (last known).
  bool registered() const { return registered_; }
  int64_t lease_id() const { return lease_id_; }
  int endpoint() const { return endpoint_; }
  /// The last failure in words (empty when none since the last success).
  const std::string& last_error() const { return last_error_; }
  /// Leases granted so far (1 + the times the lease was found gone).
  int grants() const { return grants_; }

 private:
  void Send(std::string path, std::string body, State next);
  void Fail(std::string why, TimePoint now);
  void Grant();
  void Put();

  EtcdLeaseOptions options_;
  State state_ = State::kIdle;
  State retry_ = State::kGranting;  // what kBackoff retries
  uint64_t next_id_ = 1;
  uint64_t pending_ = 0;  // the call out, 0 = none
  std::vector<EtcdCall> calls_;
  int endpoint_ = 0;
  int64_t lease_id_ = 0;
  bool registered_ = false;
  bool value_dirty_ = false;
  TimePoint tick_at_ = 0;
  std::string last_error_;
  int grants_ = 0;
};

/// A change the watcher saw. kReset: `kvs` is the whole prefix now (after a list); kPut: `key`
/// now holds `value`; kDelete: `key` is gone. `revision`: etcd's mod revision of the change (of
/// the listing for kReset).
struct EtcdKvUpdate {
  enum class Kind { kReset, kPut, kDelete };
  Kind kind = Kind::kPut;
  std::string key;
  std::string value;
  int64_t revision = 0;
  std::vector<std::pair<std::string, std::string>> kvs;
};

struct EtcdWatchOptions {
  int endpoints = 1;
  std::string prefix;
  DurationUs retry_backoff = 200 * kMillisecond;
};

/// A proxy's view of a key prefix: range (list) it, then watch it from the listed revision + 1;
/// a compacted start revision lists again; a broken stream watches again from the last revision
/// applied + 1 on the next endpoint; an event at or below that revision (a replay) is skipped.
///
/// States: kIdle -Start-> kListing -listed-> kWatching ; list failed / stream ended ->
/// kBackoff (next endpoint) -> kListing (nothing listed yet, or compacted) | kWatching.
class EtcdPrefixWatcher {
 public:
  enum class State { kIdle, kListing, kWatching, kBackoff, kStopped };

  explicit EtcdPrefixWatcher(EtcdWatchOptions options);
  void Start(TimePoint now);
  /// A whole reply: the range's, or the end of the watch stream.
  void OnReply(const EtcdReply& reply, TimePoint now);
  /// One JSON message of the watch stream `call_id`.
  void OnStreamMessage(uint64_t call_id, std::string_view message, TimePoint now);
  void OnTick(TimePoint now);
  void Stop();

  std::vector<EtcdCall> TakeCalls();
  /// Streams the shell must close now (a canceled watch: etcd keeps the HTTP stream open).
  std::vector<uint64_t> TakeCloses();
  std::vector<EtcdKvUpdate> TakeUpdates();
  std::optional<TimePoint> next_tick() const;
  State state() const { return state_; }
  /// The last revision applied (0 before the first list).
  int64_t revision() const { return revision_; }
  int endpoint() const { return endpoint_; }
  /// Lists made (1 + re-lists after compaction) and watches opened.
  int lists() const { return lists_; }
  int watches() const { return watches_; }
  const std::string& last_error() const { return last_error_; }

 private:
  void List();
  void Watch();
  void Fail(std::string why, TimePoint now, bool relist);

  EtcdWatchOptions options_;
  State state_ = State::kIdle;
  bool need_list_ = true;
  uint64_t next_id_ = 1;
  uint64_t pending_ = 0;
  std::vector<EtcdCall> calls_;
  std::vector<uint64_t> closes_;
  std::vector<EtcdKvUpdate> updates_;
  int endpoint_ = 0;
  int64_t revision_ = 0;
  TimePoint tick_at_ = 0;
  int lists_ = 0;
  int watches_ = 0;
  std::string last_error_;
};

/// The value an engine writes under `key`: {"record": record, "hmac": hex} (see the header).
/// An empty token gives "hmac": "" (a cluster without a token; proxies with one refuse it).
std::string EtcdRecordValue(std::string_view key, std::string_view record, std::string_view token);
/// The record text of a value under `key` when its HMAC verifies under `token` (constant-time
/// compare). InvalidArgument for a value that is not such JSON; Unauthenticated for an HMAC
/// that does not verify.
Result<std::string> VerifyEtcdRecord(std::string_view key, std::string_view value,
                                     std::string_view token);

/// Applies a watcher's updates to a proxy's InstanceRegistry: each value under the prefix is
/// verified (VerifyEtcdRecord) and parsed (ParseRegistration); a record that verifies is
/// registered as a store instance (InstanceRegistry::RegisterFromStore: no heartbeat expiry, it
/// leaves when its key does), one that does not is ignored — and an instance its key held
/// before is removed — with a line in `log`. A kReset removes the store instances whose key is
/// no longer listed.
class EtcdRegistrySync {
 public:
  explicit EtcdRegistrySync(std::string token) : token_(std::move(token)) {}
  void Apply(const EtcdKvUpdate& update, InstanceRegistry& registry, TimePoint now,
             std::vector<std::string>* log);
  /// Instance id by key, for the keys whose record is registered now.
  const std::map<std::string, std::string>& instances() const { return by_key_; }
  /// Records ignored so far (malformed, bad HMAC, refused by the registry).
  int rejected() const { return rejected_; }

 private:
  void Put(const std::string& key, const std::string& value, InstanceRegistry& registry,
           TimePoint now, std::vector<std::string>* log);
  void Drop(const std::string& key, InstanceRegistry& registry, std::vector<std::string>* log,
            const char* why);

  std::string token_;
  std::map<std::string, std::string> by_key_;
  int rejected_ = 0;
};

}  // namespace kvbridge::proxy
