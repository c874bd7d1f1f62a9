#include "kvbridge/connector/kv_transfer_config.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

namespace kvbridge {
namespace {

using nlohmann::json;

Status Bad(std::string msg) { return InvalidArgumentError(std::move(msg)); }

Result<std::string> GetEnum(const json& obj, const std::string& where, const std::string& key,
                            const std::vector<std::string>& allowed) {
  const json& v = obj.at(key);
  std::string list;
  for (const auto& a : allowed) list += (list.empty() ? "" : "|") + a;
  if (!v.is_string()) return Bad(where + key + " must be a string, one of " + list);
  std::string s = v.get<std::string>();
  if (std::find(allowed.begin(), allowed.end(), s) == allowed.end()) {
    return Bad(where + key + ": unknown value \"" + s + "\" (allowed: " + list + ")");
  }
  return s;
}

Result<int64_t> GetInt(const json& obj, const std::string& where, const std::string& key,
                       int64_t lo, int64_t hi) {
  const json& v = obj.at(key);
  if (!v.is_number_integer()) return Bad(where + key + " must be an integer");
  int64_t x = v.get<int64_t>();
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) x = hi + 1;
  if (x < lo || x > hi) {
    return Bad(where + key + " = " + v.dump() + " out of range [" + std::to_string(lo) + ", " +
               std::to_string(hi) + "]");
  }
  return x;
}

bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '-';
}

}  // namespace

std::string_view KvRoleName(KvRole r) {
  switch (r) {
    case KvRole::kProducer:
      return "kv_producer";
    case KvRole::kConsumer:
      return "kv_consumer";
    case KvRole::kBoth:
      return "kv_both";
  }
  return "kv_both";
}
std::string_view KvTransportName(KvTransport t) {
  switch (t) {
    case KvTransport::kAuto:
      return "auto";
    case KvTransport::kShm:
      return "shm";
    case KvTransport::kTcp:
      return "tcp";
    case KvTransport::kUcx:
      return "ucx";
    case KvTransport::kCudaIpc:
      return "cuda_ipc";
  }
  return "auto";
}
std::string_view LoadFailurePolicyName(LoadFailurePolicy p) {
  return p == LoadFailurePolicy::kFail ? "fail" : "recompute";
}

bool IsValidTransferId(std::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), IsIdChar);
}

namespace {

// Keys of other connectors' recipes (vLLM's KVTransferConfig and its P2pNccl, NIXL, Mooncake
// and LMCache connectors' kv_connector_extra_config) with no same-named notion here: the
// kvbridge setting to use instead.
const std::map<std::string, std::string>& ForeignKeys() {
  static const auto* keys = [] {
    const std::string proxy =
        "serve --proxy HOST:PORT (the kvbridge proxy the engine registers "
        "and heartbeats with; docs/proxy.md)";
    const std::string ports =
        "no port setting: each rank's transfer agent binds its own port and the prefill's "
        "kv_transfer_params carry it (remote_port); serve --advertise-host sets the address";
    const std::string buffer =
        "serve --kv-cache-memory / --num-kv-blocks (the KV cache itself is the transfer buffer)";
    return new std::map<std::string, std::string>{
        {"proxy_ip", proxy},
        {"proxy_port", proxy},
        {"proxy_ping_port", proxy},
        {"http_port", "serve --port"},
        {"kv_ip", "serve --advertise-host"},
        {"kv_port", ports},
        {"handshake_port", ports},
        {"notify_port", ports},
        {"side_channel_port", ports},
        {"backend", "kv_connector_extra_config.transport (auto|shm|tcp|ucx|cuda_ipc)"},
        {"mooncake_protocol", "kv_connector_extra_config.transport (auto|shm|tcp|ucx|cuda_ipc)"},
        {"kv_buffer_size", buffer},
        {"kv_buffer_device", buffer + " and serve --device"},
        {"mem_pool_size_gb", buffer},
        {"kv_rank", "kv_role (kv_producer|kv_consumer|kv_both): kvbridge has no fixed P/D ranks"},
        {"kv_parallel_size",
         "kv_role (kv_producer|kv_consumer|kv_both): kvbridge has no fixed P/D ranks"},
        {"kv_connector_module_path", "kv_connector \"KVBridgeConnector\" (built in)"},
    };
  }();
  return *keys;
}

}  // namespace

Result<KvTransferConfig> ParseKvTransferConfig(std::string_view json_text) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("--kv-transfer-config: not valid JSON");
  if (!j.is_object()) return Bad("--kv-transfer-config: must be a JSON object");
  const std::string top = "--kv-transfer-config: ";
  static const std::set<std::string> kTopKeys = {"kv_connector", "kv_role",
                                                 "kv_connector_extra_config", "engine_id",
                                                 "kv_load_failure_policy"};
  for (const auto& [k, v] : j.items()) {
    if (auto f = ForeignKeys().find(k); f != ForeignKeys().end()) {
      return Bad(top + "\"" + k +
                 "\" (vLLM's, for other connectors) has no kvbridge meaning "
                 "here; use " +
                 f->second);
    }
    if (!kTopKeys.count(k)) {
      return Bad(top + "unknown key \"" + k +
                 "\" (allowed: kv_connector, kv_role, kv_connector_extra_config)");
    }
  }
  if (!j.contains("kv_connector"))
    return Bad(top + "kv_connector is required (\"KVBridgeConnector\")");
  if (!j.contains("kv_role"))
    return Bad(top + "kv_role is required (kv_producer|kv_consumer|kv_both)");
  KvTransferConfig c;
  {
    ASSIGN_OR_RETURN(std::string s, GetEnum(j, top, "kv_connector", {"KVBridgeConnector"}));
    (void)s;
  }
  {
    ASSIGN_OR_RETURN(std::string s,
                     GetEnum(j, top, "kv_role", {"kv_producer", "kv_consumer", "kv_both"}));
    c.role = s == "kv_producer" ? KvRole::kProducer
                                : (s == "kv_consumer" ? KvRole::kConsumer : KvRole::kBoth);
  }
  // vLLM's KVTransferConfig fields that mean here what they mean there.
  if (j.contains("kv_load_failure_policy")) {
    ASSIGN_OR_RETURN(std::string s,
                     GetEnum(j, top, "kv_load_failure_policy", {"recompute", "fail"}));
    c.load_failure_policy = s == "fail" ? LoadFailurePolicy::kFail : LoadFailurePolicy::kRecompute;
  }
  if (j.contains("engine_id")) {
    const json& v = j.at("engine_id");
    if (!v.is_string() || !IsValidTransferId(v.get<std::string>())) {
      return Bad(top + "engine_id must be a string of 1-128 chars [A-Za-z0-9._:-]");
    }
    c.engine_id = v.get<std::string>();
  }
  if (!j.contains("kv_connector_extra_config")) return c;
  const json& x = j.at("kv_connector_extra_config");
  if (!x.is_object()) return Bad(top + "kv_connector_extra_config must be an object");
  const std::string where = top + "kv_connector_extra_config.";
  static const std::set<std::string> kExtraKeys = {"mode",
                                                   "transport",
                                                   "lease_ms",
                                                   "claim_lease_ms",
                                                   "load_failure_policy",
                                                   "reply_timeout_ms",
                                                   "read_timeout_ms",
                                                   "heartbeat_ms",
                                                   "max_parked_messages",
                                                   "engine_id",
                                                   "send_type",
                                                   "backends"};
  for (const auto& [k, v] : x.items()) {
    if (auto f = ForeignKeys().find(k); f != ForeignKeys().end()) {
      return Bad(where + k + " (another connector's key) has no kvbridge meaning here; use " +
                 f->second);
    }
    if (!kExtraKeys.count(k)) {
      std::string list;
      for (const auto& a : kExtraKeys) list += (list.empty() ? "" : ", ") + a;
      return Bad(where + "unknown key \"" + k + "\" (allowed: " + list + ")");
    }
  }
  if (x.contains("mode")) {
    ASSIGN_OR_RETURN(std::string s, GetEnum(x, where, "mode", {"read", "write"}));
    c.mode = s == "write" ? KvTransferMode::kWrite : KvTransferMode::kRead;
  }
  // P2pNcclConnector's send_type: PUT / PUT_ASYNC = the prefill pushes (kvbridge's write
  // mode), GET = the decode pulls (read mode).
  if (x.contains("send_type")) {
    if (x.contains("mode")) return Bad(where + "give mode or send_type, not both");
    ASSIGN_OR_RETURN(std::string s, GetEnum(x, where, "send_type", {"PUT", "PUT_ASYNC", "GET"}));
    c.mode = s == "GET" ? KvTransferMode::kRead : KvTransferMode::kWrite;
  }
  // NixlConnector's backends: ["UCX"] is kvbridge's ucx transport.
  if (x.contains("backends")) {
    if (x.contains("transport")) return Bad(where + "give transport or backends, not both");
    const json& b = x.at("backends");
    if (!b.is_array() || b.size() != 1 || b[0] != "UCX") {
      return Bad(where +
                 "backends: only [\"UCX\"] has a kvbridge equivalent (transport \"ucx\"); "
                 "use transport (auto|shm|tcp|ucx)");
    }
    c.transport = KvTransport::kUcx;
  }
  if (x.contains("transport")) {
    ASSIGN_OR_RETURN(std::string s,
                     GetEnum(x, where, "transport", {"auto", "shm", "tcp", "ucx", "cuda_ipc"}));
    c.transport = s == "shm"        ? KvTransport::kShm
                  : s == "tcp"      ? KvTransport::kTcp
                  : s == "ucx"      ? KvTransport::kUcx
                  : s == "cuda_ipc" ? KvTransport::kCudaIpc
                                    : KvTransport::kAuto;
  }
  if (x.contains("load_failure_policy")) {
    ASSIGN_OR_RETURN(std::string s,
                     GetEnum(x, where, "load_failure_policy", {"recompute", "fail"}));
    c.load_failure_policy = s == "fail" ? LoadFailurePolicy::kFail : LoadFailurePolicy::kRecompute;
  }
  constexpr int64_t kHourMs = 3600 * 1000;
  if (x.contains("lease_ms")) {
    ASSIGN_OR_RETURN(int64_t ms, GetInt(x, where, "lease_ms", 1, kHourMs));
    c.lease = ms * kMillisecond;
  }
  if (x.contains("claim_lease_ms")) {
    ASSIGN_OR_RETURN(int64_t ms, GetInt(x, where, "claim_lease_ms", 0, kHourMs));
    c.claim_lease = ms * kMillisecond;
  }
  if (x.contains("reply_timeout_ms")) {
    ASSIGN_OR_RETURN(int64_t ms, GetInt(x, where, "reply_timeout_ms", 1, kHourMs));
    c.reply_timeout = ms * kMillisecond;
  }
  if (x.contains("read_timeout_ms")) {
    ASSIGN_OR_RETURN(int64_t ms, GetInt(x, where, "read_timeout_ms", 1, kHourMs));
    c.read_timeout = ms * kMillisecond;
  }
  if (x.contains("heartbeat_ms")) {
    ASSIGN_OR_RETURN(int64_t ms, GetInt(x, where, "heartbeat_ms", 0, kHourMs));
    c.heartbeat_interval = ms * kMillisecond;
  }
  if (x.contains("max_parked_messages")) {
    ASSIGN_OR_RETURN(c.max_parked_messages, GetInt(x, where, "max_parked_messages", 1, 1 << 24));
  }
  if (x.contains("engine_id")) {
    const json& v = x.at("engine_id");
    if (!v.is_string() || !IsValidTransferId(v.get<std::string>())) {
      return Bad(where + "engine_id must be a string of 1-128 chars [A-Za-z0-9._:-]");
    }
    c.engine_id = v.get<std::string>();
  }
  if (c.heartbeat_interval >= c.lease) {
    return Bad(where + "heartbeat_ms must be smaller than lease_ms");
  }
  return c;
}

nlohmann::json KvTransferConfigToJson(const KvTransferConfig& c) {
  json x = {{"mode", KvTransferModeName(c.mode)},
            {"transport", KvTransportName(c.transport)},
            {"lease_ms", c.lease / kMillisecond},
            {"load_failure_policy", LoadFailurePolicyName(c.load_failure_policy)},
            {"reply_timeout_ms", c.reply_timeout / kMillisecond},
            {"read_timeout_ms", c.read_timeout / kMillisecond},
            {"heartbeat_ms", c.heartbeat_interval / kMillisecond},
            {"max_parked_messages", c.max_parked_messages}};
  if (!c.engine_id.empty()) x["engine_id"] = c.engine_id;
  if (c.claim_lease != KvTransferConfig{}.claim_lease)
    x["claim_lease_ms"] = c.claim_lease / kMillisecond;
  return json{{"kv_connector", "KVBridgeConnector"},
              {"kv_role", KvRoleName(c.role)},
              {"kv_connector_extra_config", x}};
}

Result<KvTransferParams> ParseKvTransferParams(const json& j,
                                               const KvTransferParamsLimits& limits) {
  const std::string where = "kv_transfer_params.";
  if (!j.is_object()) return Bad("kv_transfer_params must be a JSON object");
  static const std::set<std::string> kKeys = {"do_remote_decode", "do_remote_prefill",
                                              "transfer_id",      "remote_engine_id",
                                              "remote_host",      "remote_port",
                                              "remote_block_ids", "remote_num_tokens",
                                              "tp_size",          "mode"};
  for (const auto& [k, v] : j.items()) {
    if (!kKeys.count(k)) return Bad(where + k + ": unknown field");
  }
  auto present = [&](const char* k) { return j.contains(k) && !j.at(k).is_null(); };
  KvTransferParams p;
  for (const char* k : {"do_remote_decode", "do_remote_prefill"}) {
    if (!present(k)) continue;
    if (!j.at(k).is_boolean()) return Bad(where + k + " must be a boolean");
  }
  p.do_remote_decode = present("do_remote_decode") && j.at("do_remote_decode").get<bool>();
  p.do_remote_prefill = present("do_remote_prefill") && j.at("do_remote_prefill").get<bool>();
  if (p.do_remote_decode == p.do_remote_prefill) {
    return Bad(
        "kv_transfer_params: exactly one of do_remote_decode and do_remote_prefill must "
        "be true");
  }
  if (!present("transfer_id") || !j.at("transfer_id").is_string() ||
      !IsValidTransferId(j.at("transfer_id").get<std::string>())) {
    return Bad(where + "transfer_id must be a string of 1-128 chars [A-Za-z0-9._:-]");
  }
  p.transfer_id = j.at("transfer_id").get<std::string>();
  if (present("mode")) {
    ASSIGN_OR_RETURN(std::string s, GetEnum(j, where, "mode", {"read", "write"}));
    p.mode = s == "write" ? KvTransferMode::kWrite : KvTransferMode::kRead;
  }
  if (present("tp_size")) {
    ASSIGN_OR_RETURN(int64_t tp, GetInt(j, where, "tp_size", 1, limits.max_tp_size));
    p.tp_size = static_cast<int>(tp);
  }
  if (p.do_remote_decode) {
    // The prefill leg names only the transfer; remote_* describe a prefill and make no sense here.
    for (const char* k : {"remote_engine_id", "remote_host", "remote_port", "remote_block_ids",
                          "remote_num_tokens"}) {
      if (present(k)) return Bad(where + k + " is not allowed with do_remote_decode");
    }
    return p;
  }
  // Decode leg: where the prefill is.
  if (!present("remote_engine_id") || !j.at("remote_engine_id").is_string() ||
      !IsValidTransferId(j.at("remote_engine_id").get<std::string>())) {
    return Bad(where + "remote_engine_id must be a string of 1-128 chars [A-Za-z0-9._:-]");
  }
  p.remote_engine_id = j.at("remote_engine_id").get<std::string>();
  if (!present("remote_host") || !j.at("remote_host").is_string()) {
    return Bad(where + "remote_host must be a string");
  }
  p.remote_host = j.at("remote_host").get<std::string>();
  if (p.remote_host.empty() || p.remote_host.size() > 255 ||
      !std::all_of(p.remote_host.begin(), p.remote_host.end(),
                   [](char c) { return IsIdChar(c) || c == '[' || c == ']'; })) {
    return Bad(where + "remote_host must be a host name or address of 1-255 chars");
  }
  if (!present("remote_port")) return Bad(where + "remote_port is required");
  {
    ASSIGN_OR_RETURN(int64_t port, GetInt(j, where, "remote_port", 1, 65535));
    p.remote_port = static_cast<int>(port);
  }
  if (p.mode == KvTransferMode::kWrite) {
    // WRITE: the decode reserves blocks and tells the prefill; nothing about its blocks yet.
    for (const char* k : {"remote_block_ids", "remote_num_tokens"}) {
      if (present(k)) return Bad(where + k + " is not allowed in write mode");
    }
    return p;
  }
  if (!present("remote_num_tokens")) return Bad(where + "remote_num_tokens is required");
  {
    ASSIGN_OR_RETURN(int64_t n, GetInt(j, where, "remote_num_tokens", 1, 1 << 30));
    p.remote_num_tokens = static_cast<int>(n);
  }
  if (!present("remote_block_ids") || !j.at("remote_block_ids").is_array()) {
    return Bad(where + "remote_block_ids must be an array of block ids");
  }
  const json& ids = j.at("remote_block_ids");
  const int bs = std::max(1, limits.block_size);
  const int64_t want = (static_cast<int64_t>(p.remote_num_tokens) + bs - 1) / bs;
  if (static_cast<int64_t>(ids.size()) != want) {
    return Bad(where + "remote_block_ids has " + std::to_string(ids.size()) +
               " ids; remote_num_tokens " + std::to_string(p.remote_num_tokens) +
               " at block_size " + std::to_string(bs) + " needs " + std::to_string(want));
  }
  const int64_t hi = limits.remote_num_blocks ? *limits.remote_num_blocks - 1 : INT32_MAX;
  std::set<int64_t> seen;
  p.remote_block_ids.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const json& v = ids[i];
    if (!v.is_number_integer())
      return Bad(where + "remote_block_ids[" + std::to_string(i) + "] must be an integer");
    int64_t b = v.is_number_unsigned() && v.get<uint64_t>() > INT32_MAX ? int64_t{INT32_MAX} + 1
                                                                        : v.get<int64_t>();
    if (b < 0 || b > hi) {
      return Bad(where + "remote_block_ids[" + std::to_string(i) + "] = " + v.dump() +
                 " out of range [0, " + std::to_string(hi) + "]");
    }
    if (!seen.insert(b).second) {
      return Bad(where + "remote_block_ids[" + std::to_string(i) + "] = " + v.dump() + " repeats");
    }
    p.remote_block_ids.push_back(static_cast<int32_t>(b));
  }
  return p;
}

nlohmann::json KvTransferParamsToJson(const KvTransferParams& p) {
  json j;
  if (p.do_remote_decode) j["do_remote_decode"] = true;
  if (p.do_remote_prefill) j["do_remote_prefill"] = true;
  j["transfer_id"] = p.transfer_id;
  if (p.mode == KvTransferMode::kWrite) j["mode"] = "write";
  if (p.do_remote_prefill) {
    j["remote_engine_id"] = p.remote_engine_id;
    j["remote_host"] = p.remote_host;
    j["remote_port"] = p.remote_port;
    if (p.mode == KvTransferMode::kRead) {
      j["remote_block_ids"] = p.remote_block_ids;
      j["remote_num_tokens"] = p.remote_num_tokens;
    }
    j["tp_size"] = p.tp_size;
  }
  return j;
}

}  // namespace kvbridge
