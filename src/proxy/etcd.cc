#include "kvbridge/proxy/etcd.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

namespace kvbridge::proxy {
namespace {

using nlohmann::json;

constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// The gateway writes int64 as a decimal string; accept a number too.
int64_t Int64Field(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    if (s.empty() || s.size() > 20) return 0;
    char* end = nullptr;
    long long v = std::strtoll(s.c_str(), &end, 10);
    return end == s.c_str() + s.size() ? static_cast<int64_t>(v) : 0;
  }
  return 0;
}

// An etcd error in a 200 answer (a streamed RPC's {"error": {...}}) or the gateway's own
// {"error": "...", "code": N} of a non-2xx answer, in words; empty when there is none.
std::string ErrorText(const json& j) {
  auto it = j.find("error");
  if (it == j.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    if (auto m = it->find("message"); m != it->end() && m->is_string())
      return m->get<std::string>();
  }
  return it->dump();
}

std::string ReplyProblem(const EtcdReply& r) {
  if (!r.transport.ok()) return r.transport.ToString();
  return "HTTP " + std::to_string(r.http_status) + ": " + r.body.substr(0, 200);
}

std::string Hex(const unsigned char* p, size_t n) {
  static const char* kHex = "0123456789abcdef";
  std::string s;
  s.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    s += kHex[p[i] >> 4];
    s += kHex[p[i] & 15];
  }
  return s;
}

std::string RecordHmac(std::string_view key, std::string_view record, std::string_view token) {
  std::string msg = "kvbridge-etcd-v1\n";
  msg += key;
  msg += "\n";
  msg += record;
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac, &len);
  return Hex(mac, len);
}

}  // namespace

std::string Base64Encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint32_t{static_cast<unsigned char>(in[i])} << 16) |
                 (uint32_t{static_cast<unsigned char>(in[i + 1])} << 8) |
                 uint32_t{static_cast<unsigned char>(in[i + 2])};
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += kB64[(v >> 6) & 63];
    out += kB64[v & 63];
  }
  if (i + 1 == in.size()) {
    uint32_t v = uint32_t{static_cast<unsigned char>(in[i])} << 16;
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    uint32_t v = (uint32_t{static_cast<unsigned char>(in[i])} << 16) |
                 (uint32_t{static_cast<unsigned char>(in[i + 1])} << 8);
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += kB64[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

Result<std::string> Base64Decode(std::string_view in) {
  if (in.size() % 4 != 0) return InvalidArgumentError("base64 length is not a multiple of 4");
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (size_t i = 0; i < in.size(); i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = in[i + k];
      int d;
      if (c >= 'A' && c <= 'Z') {
        d = c - 'A';
      } else if (c >= 'a' && c <= 'z') {
        d = c - 'a' + 26;
      } else if (c >= '0' && c <= '9') {
        d = c - '0' + 52;
      } else if (c == '+') {
        d = 62;
      } else if (c == '/') {
        d = 63;
      } else if (c == '=' && i + 4 == in.size() && k >= 2) {
        d = 0;
        ++pad;
      } else {
        return InvalidArgumentError("not base64");
      }
      if (pad > 0 && c != '=') return InvalidArgumentError("not base64");
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    out += static_cast<char>((v >> 16) & 255);
    if (pad < 2) out += static_cast<char>((v >> 8) & 255);
    if (pad < 1) out += static_cast<char>(v & 255);
  }
  return out;
}

std::string PrefixRangeEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    unsigned char last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key (etcd's "\0" range end)
}

Result<std::string> EtcdInstancesPrefix(std::string_view cluster) {
  bool ok = !cluster.empty() && cluster.size() <= 64;
  for (char c : cluster) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') {
      ok = false;
    }
  }
  if (!ok) {
    return InvalidArgumentError("cluster name must be 1-64 of [A-Za-z0-9._-], got '" +
                                std::string(cluster) + "'");
  }
  return "/kvbridge/" + std::string(cluster) + "/instances/";
}

std::string EtcdRecordValue(std::string_view key, std::string_view record, std::string_view token) {
  json j = {{"record", record}, {"hmac", token.empty() ? "" : RecordHmac(key, record, token)}};
  return j.dump();
}

Result<std::string> VerifyEtcdRecord(std::string_view key, std::string_view value,
                                     std::string_view token) {
  json j = json::parse(value, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgumentError("not a JSON object");
  auto rec = j.find("record");
  auto mac = j.find("hmac");
  if (rec == j.end() || !rec->is_string() || mac == j.end() || !mac->is_string()) {
    return InvalidArgumentError("lacks a string 'record' and 'hmac'");
  }
  const std::string& record = rec->get_ref<const std::string&>();
  const std::string& got = mac->get_ref<const std::string&>();
  if (token.empty()) return record;  // a proxy without a token trusts the store alone
  const std::string want = RecordHmac(key, record, token);
  if (got.size() != want.size() || CRYPTO_memcmp(got.data(), want.data(), want.size()) != 0) {
    return UnauthenticatedError("its HMAC does not verify under the cluster token");
  }
  return record;
}

// --- EtcdLeaseKeeper ----------------------------------------------------------------------

EtcdLeaseKeeper::EtcdLeaseKeeper(EtcdLeaseOptions options) : options_(std::move(options)) {
  options_.endpoints = std::max(1, options_.endpoints);
  options_.ttl_s = std::max<int64_t>(1, options_.ttl_s);
  if (options_.keepalive_interval <= 0) {
    options_.keepalive_interval = std::max<DurationUs>(options_.ttl_s * kSecond / 3, kMillisecond);
  }
}

void EtcdLeaseKeeper::Start(TimePoint now) {
  (void)now;
  if (state_ != State::kIdle) return;
  Grant();
}

void EtcdLeaseKeeper::Send(std::string path, std::string body, State next) {
  EtcdCall c;
  c.id = next_id_++;
  c.endpoint = endpoint_;
  c.path = std::move(path);
  c.body = std::move(body);
  pending_ = c.id;
  state_ = next;
  calls_.push_back(std::move(c));
}

void EtcdLeaseKeeper::Grant() {
  registered_ = false;
  lease_id_ = 0;
  Send("/v3/lease/grant", json{{"TTL", std::to_string(options_.ttl_s)}}.dump(), State::kGranting);
}

void EtcdLeaseKeeper::Put() {
  value_dirty_ = false;
  Send("/v3/kv/put",
       json{{"key", Base64Encode(options_.key)},
            {"value", Base64Encode(options_.value)},
            {"lease", std::to_string(lease_id_)}}
           .dump(),
       State::kPutting);
}

void EtcdLeaseKeeper::Fail(std::string why, TimePoint now) {
  last_error_ = std::move(why);
  retry_ = state_;
  endpoint_ = (endpoint_ + 1) % options_.endpoints;
  state_ = State::kBackoff;
  tick_at_ = now + options_.retry_backoff;
}

void EtcdLeaseKeeper::OnReply(const EtcdReply& r, TimePoint now) {
  if (r.id != pending_ || pending_ == 0) return;  // a stale answer
  pending_ = 0;
  json j;
  if (r.transport.ok()) j = json::parse(r.body, nullptr, false);
  const bool parsed = r.transport.ok() && !j.is_discarded() && j.is_object();
  std::string err = parsed ? ErrorText(j) : "";
  switch (state_) {
    case State::kGranting: {
      const int64_t id = parsed ? Int64Field(j, "ID") : 0;
      if (r.http_status != 200 || !parsed || !err.empty() || id == 0) {
        return Fail("lease grant: " + (err.empty() ? ReplyProblem(r) : err), now);
      }
      lease_id_ = id;
      ++grants_;
      Put();
      return;
    }
    case State::kPutting: {
      if (err.find("lease not found") != std::string::npos) {
        last_error_ = "put: " + err;
        Grant();
        return;
      }
      if (r.http_status != 200 || !parsed || !err.empty()) {
        return Fail("put: " + (err.empty() ? ReplyProblem(r) : err), now);
      }
      registered_ = true;
      last_error_.clear();
      if (value_dirty_) {
        Put();
        return;
      }
      state_ = State::kKept;
      tick_at_ = now + options_.keepalive_interval;
      return;
    }
    case State::kKept: {  // a keepalive's answer: {"result":{"ID":..,"TTL":..}}
      const json* res =
          parsed && j.contains("result") && j["result"].is_object() ? &j["result"] : nullptr;
      if (r.http_status != 200 || res == nullptr || !err.empty()) {
        return Fail("keepalive: " + (err.empty() ? ReplyProblem(r) : err), now);
      }
      if (Int64Field(*res, "TTL") <= 0) {  // the lease is gone: its key went with it
        last_error_ = "keepalive: lease " + std::to_string(lease_id_) + " expired";
        Grant();
        return;
      }
      last_error_.clear();
      if (value_dirty_) {
        Put();
        return;
      }
      tick_at_ = now + options_.keepalive_interval;
      return;
    }
    case State::kRevoking:
      state_ = State::kStopped;
      registered_ = false;
      return;
    default:
      return;
  }
}

void EtcdLeaseKeeper::OnTick(TimePoint now) {
  if (pending_ != 0 || now < tick_at_) return;
  if (state_ == State::kBackoff) {
    if (retry_ == State::kPutting && lease_id_ != 0) {
      Put();
    } else if (retry_ == State::kKept && lease_id_ != 0) {
      state_ = State::kKept;
      OnTick(now);
    } else {
      Grant();
    }
    return;
  }
  if (state_ == State::kKept) {
    Send("/v3/lease/keepalive", json{{"ID", std::to_string(lease_id_)}}.dump(), State::kKept);
  }
}

void EtcdLeaseKeeper::SetValue(std::string value, TimePoint now) {
  options_.value = std::move(value);
  value_dirty_ = true;
  if (state_ == State::kKept && pending_ == 0) {
    (void)now;
    Put();
  }
}

void EtcdLeaseKeeper::Stop(TimePoint now) {
  (void)now;
  if (state_ == State::kStopped || state_ == State::kRevoking) return;
  if (lease_id_ == 0) {
    state_ = State::kStopped;
    pending_ = 0;
    return;
  }
  pending_ = 0;  // whatever was out no longer matters
  Send("/v3/lease/revoke", json{{"ID", std::to_string(lease_id_)}}.dump(), State::kRevoking);
}

std::vector<EtcdCall> EtcdLeaseKeeper::TakeCalls() { return std::exchange(calls_, {}); }

std::optional<TimePoint> EtcdLeaseKeeper::next_tick() const {
  if (pending_ != 0 || state_ == State::kStopped || state_ == State::kIdle) return std::nullopt;
  if (state_ == State::kKept || state_ == State::kBackoff) return tick_at_;
  return std::nullopt;
}

// --- EtcdPrefixWatcher --------------------------------------------------------------------

EtcdPrefixWatcher::EtcdPrefixWatcher(EtcdWatchOptions options) : options_(std::move(options)) {
  options_.endpoints = std::max(1, options_.endpoints);
}

void EtcdPrefixWatcher::Start(TimePoint now) {
  (void)now;
  if (state_ != State::kIdle) return;
  List();
}

void EtcdPrefixWatcher::List() {
  EtcdCall c;
  c.id = next_id_++;
  c.endpoint = endpoint_;
  c.path = "/v3/kv/range";
  c.body = json{{"key", Base64Encode(options_.prefix)},
                {"range_end", Base64Encode(PrefixRangeEnd(options_.prefix))}}
               .dump();
  pending_ = c.id;
  state_ = State::kListing;
  ++lists_;
  calls_.push_back(std::move(c));
}

void EtcdPrefixWatcher::Watch() {
  EtcdCall c;
  c.id = next_id_++;
  c.endpoint = endpoint_;
  c.path = "/v3/watch";
  c.stream = true;
  c.body = json{{"create_request",
                 {{"key", Base64Encode(options_.prefix)},
                  {"range_end", Base64Encode(PrefixRangeEnd(options_.prefix))},
                  {"start_revision", std::to_string(revision_ + 1)}}}}
               .dump();
  pending_ = c.id;
  state_ = State::kWatching;
  ++watches_;
  calls_.push_back(std::move(c));
}

void EtcdPrefixWatcher::Fail(std::string why, TimePoint now, bool relist) {
  last_error_ = std::move(why);
  if (relist) need_list_ = true;
  if (state_ == State::kWatching && pending_ != 0) closes_.push_back(pending_);
  pending_ = 0;
  endpoint_ = (endpoint_ + 1) % options_.endpoints;
  state_ = State::kBackoff;
  tick_at_ = now + options_.retry_backoff;
}

void EtcdPrefixWatcher::OnReply(const EtcdReply& r, TimePoint now) {
  if (r.id != pending_ || pending_ == 0 || state_ == State::kStopped) return;
  if (state_ == State::kWatching) {
    pending_ = 0;  // the stream ended: the shell closed it already
    Fail("watch stream ended: " + ReplyProblem(r), now, /*relist=*/false);
    return;
  }
  if (state_ != State::kListing) return;
  pending_ = 0;
  json j;
  if (r.transport.ok()) j = json::parse(r.body, nullptr, false);
  const bool parsed = r.transport.ok() && !j.is_discarded() && j.is_object();
  const std::string err = parsed ? ErrorText(j) : "";
  if (r.http_status != 200 || !parsed || !err.empty() || !j.contains("header")) {
    Fail("range: " + (err.empty() ? ReplyProblem(r) : err), now, /*relist=*/true);
    return;
  }
  EtcdKvUpdate u;
  u.kind = EtcdKvUpdate::Kind::kReset;
  u.revision = Int64Field(j["header"], "revision");
  if (auto kvs = j.find("kvs"); kvs != j.end() && kvs->is_array()) {
    for (const json& kv : *kvs) {
      if (!kv.is_object()) continue;
      auto key = Base64Decode(kv.value("key", ""));
      auto value = Base64Decode(kv.value("value", ""));
      if (!key.ok() || !value.ok()) continue;
      u.kvs.emplace_back(std::move(*key), std::move(*value));
    }
  }
  revision_ = u.revision;
  need_list_ = false;
  last_error_.clear();
  updates_.push_back(std::move(u));
  Watch();
}

void EtcdPrefixWatcher::OnStreamMessage(uint64_t call_id, std::string_view message, TimePoint now) {
  if (call_id != pending_ || state_ != State::kWatching) return;
  json j = json::parse(message, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    Fail("watch: a message that is not JSON", now, /*relist=*/false);
    return;
  }
  if (std::string err = ErrorText(j); !err.empty()) {
    Fail("watch: " + err, now, /*relist=*/false);
    return;
  }
  auto res = j.find("result");
  if (res == j.end() || !res->is_object()) return;
  if (res->value("canceled", false)) {
    const int64_t compact = Int64Field(*res, "compact_revision");
    if (compact > 0) {
      Fail("watch from revision " + std::to_string(revision_ + 1) + " canceled: compacted at " +
               std::to_string(compact) + "; listing again",
           now, /*relist=*/true);
    } else {
      Fail("watch canceled: " + res->value("cancel_reason", std::string("no reason")), now,
           /*relist=*/false);
    }
    return;
  }
  auto events = res->find("events");
  if (events == res->end() || !events->is_array()) return;
  const int64_t applied = revision_;
  for (const json& ev : *events) {
    if (!ev.is_object() || !ev.contains("kv") || !ev["kv"].is_object()) continue;
    const json& kv = ev["kv"];
    const int64_t rev = Int64Field(kv, "mod_revision");
    if (rev <= applied) continue;  // replayed after a restart
    auto key = Base64Decode(kv.value("key", ""));
    if (!key.ok()) continue;
    EtcdKvUpdate u;
    u.key = std::move(*key);
    u.revision = rev;
    if (ev.value("type", std::string("PUT")) == "DELETE") {
      u.kind = EtcdKvUpdate::Kind::kDelete;
    } else {
      auto value = Base64Decode(kv.value("value", ""));
      if (!value.ok()) continue;
      u.kind = EtcdKvUpdate::Kind::kPut;
      u.value = std::move(*value);
    }
    revision_ = std::max(revision_, rev);
    updates_.push_back(std::move(u));
  }
  last_error_.clear();
}

void EtcdPrefixWatcher::OnTick(TimePoint now) {
  if (state_ != State::kBackoff || now < tick_at_) return;
  if (need_list_) {
    List();
  } else {
    Watch();
  }
}

void EtcdPrefixWatcher::Stop() {
  if (state_ == State::kWatching && pending_ != 0) closes_.push_back(pending_);
  pending_ = 0;
  state_ = State::kStopped;
}

std::vector<EtcdCall> EtcdPrefixWatcher::TakeCalls() { return std::exchange(calls_, {}); }
std::vector<uint64_t> EtcdPrefixWatcher::TakeCloses() { return std::exchange(closes_, {}); }
std::vector<EtcdKvUpdate> EtcdPrefixWatcher::TakeUpdates() { return std::exchange(updates_, {}); }

std::optional<TimePoint> EtcdPrefixWatcher::next_tick() const {
  if (state_ == State::kBackoff) return tick_at_;
  return std::nullopt;
}

// --- EtcdRegistrySync ---------------------------------------------------------------------

void EtcdRegistrySync::Drop(const std::string& key, InstanceRegistry& registry,
                            std::vector<std::string>* log, const char* why) {
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return;
  if (registry.Remove(it->second).ok() && log != nullptr) {
    log->push_back("etcd: instance " + it->second + " dropped (" + why + ")");
  }
  by_key_.erase(it);
}

void EtcdRegistrySync::Put(const std::string& key, const std::string& value,
                           InstanceRegistry& registry, TimePoint now,
                           std::vector<std::string>* log) {
  auto reject = [&](const std::string& why) {
    ++rejected_;
    if (log != nullptr) log->push_back("etcd: record " + key + " ignored: " + why);
    Drop(key, registry, log, "its record no longer verifies");
  };
  Result<std::string> record = VerifyEtcdRecord(key, value, token_);
  if (!record.ok()) return reject(std::string(record.status().message()));
  auto parsed = ParseRegistration(*record);
  if (!parsed.ok()) return reject(std::string(parsed.status().message()));
  InstanceInfo info = parsed->first;
  if (info.id.empty()) info.id = info.url;
  while (!info.id.empty() && info.id.back() == '/') info.id.pop_back();
  // A key names one instance: a new incarnation under the same key replaces the old one.
  if (auto it = by_key_.find(key); it != by_key_.end() && it->second != info.id) {
    Drop(key, registry, log, "a new incarnation took its key");
  }
  std::vector<std::string> replaced;
  Status s = registry.RegisterFromStore(info, parsed->second, now, &replaced);
  if (!s.ok()) return reject(std::string(s.message()));
  for (const std::string& old : replaced) {
    for (auto it = by_key_.begin(); it != by_key_.end();) {
      it = it->second == old ? by_key_.erase(it) : std::next(it);
    }
  }
  const bool fresh = by_key_.find(key) == by_key_.end();
  by_key_[key] = info.id;
  if (fresh && log != nullptr) {
    log->push_back("etcd: instance " + info.id + " (" + std::string(RoleName(info.role)) + " " +
                   info.url + ") from " + key);
  }
}

void EtcdRegistrySync::Apply(const EtcdKvUpdate& u, InstanceRegistry& registry, TimePoint now,
                             std::vector<std::string>* log) {
  switch (u.kind) {
    case EtcdKvUpdate::Kind::kPut:
      Put(u.key, u.value, registry, now, log);
      return;
    case EtcdKvUpdate::Kind::kDelete:
      Drop(u.key, registry, log, "its key was deleted: lease expired or revoked");
      return;
    case EtcdKvUpdate::Kind::kReset: {
      std::map<std::string, const std::string*> listed;
      for (const auto& [k, v] : u.kvs) listed[k] = &v;
      std::vector<std::string> gone;
      for (const auto& [k, id] : by_key_) {
        if (listed.find(k) == listed.end()) gone.push_back(k);
      }
      for (const std::string& k : gone) Drop(k, registry, log, "not listed any more");
      for (const auto& [k, v] : listed) Put(k, *v, registry, now, log);
      return;
    }
  }
}

}  // namespace kvbridge::proxy
