#include "kvbridge/proxy/registry.h"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>
#include <tuple>

namespace kvbridge::proxy {
namespace {

using nlohmann::json;

int RoleIndex(Role role) { return role == Role::kPrefill ? 0 : 1; }

constexpr int64_t kMaxTpSize = 64;  // as kv_transfer_params' tp_size

bool ValidUrl(const std::string& url) {
  const size_t scheme = url.rfind("http://", 0) == 0 ? 7 : url.rfind("https://", 0) == 0 ? 8 : 0;
  if (scheme == 0) return false;
  std::string rest = url.substr(scheme);
  auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 >= rest.size()) return false;
  for (size_t i = colon + 1; i < rest.size(); ++i) {
    if (rest[i] < '0' || rest[i] > '9') return false;
  }
  // Host: a name or an IP literal; nothing that could break a metric label or a request line.
  for (size_t i = 0; i < colon; ++i) {
    char c = rest[i];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_' &&
        c != '[' && c != ']' && c != ':') {
      return false;
    }
  }
  return colon + 1 < rest.size() && rest.size() - colon - 1 <= 5;
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') {
      return false;
    }
  }
  return true;
}

std::string TrimSlash(std::string url) {
  while (!url.empty() && url.back() == '/') url.pop_back();
  return url;
}

}  // namespace

Result<RoutingPolicy> ParseRoutingPolicy(std::string_view text) {
  if (text == "least-loaded") return RoutingPolicy::kLeastLoaded;
  if (text == "round-robin") return RoutingPolicy::kRoundRobin;
  if (text == "kv-aware") return RoutingPolicy::kKvAware;
  return InvalidArgumentError("unknown routing policy '" + std::string(text) +
                              "' (kv-aware|least-loaded|round-robin)");
}

Endpoint ToEndpoint(const InstanceInfo& info) {
  Endpoint ep;
  ep.id = info.id;
  ep.url = info.url;
  ep.engine_id = info.engine_id;
  ep.tp_size = info.tp_size;
  if (!info.transfer_endpoints.empty()) {
    std::string e = info.transfer_endpoints.front();
    auto scheme = e.find("://");
    if (scheme != std::string::npos) e = e.substr(scheme + 3);
    auto colon = e.rfind(':');
    if (colon != std::string::npos) {
      ep.transfer_host = e.substr(0, colon);
      ep.transfer_port = std::atoi(e.c_str() + colon + 1);
    }
  }
  return ep;
}

Status InstanceRegistry::AddStatic(Role role, const std::string& raw_url) {
  std::string url = TrimSlash(raw_url);
  if (!ValidUrl(url)) {
    return InvalidArgumentError(
        "instance url must look like http://HOST:PORT or https://HOST:PORT, got '" + raw_url + "'");
  }
  // One engine may serve both roles (kv_both): the second role gets its own key.
  std::string id = url;
  for (const auto& [key, st] : instances_) {
    if (st.info.url != url) continue;
    if (st.info.role == role) return AlreadyExistsError("instance " + url + " already listed");
    id = url + "#" + std::string(RoleName(role));
  }
  InstanceState st;
  st.info.id = id;
  st.info.role = role;
  st.info.url = url;
  st.info.mode = options_.mode;
  st.is_static = true;
  instances_[id] = std::move(st);
  return OkStatus();
}

Status InstanceRegistry::Register(const InstanceInfo& raw, const InstanceLoad& load, TimePoint now,
                                  std::vector<std::string>* replaced) {
  InstanceInfo info = raw;
  info.url = TrimSlash(info.url);
  if (!ValidUrl(info.url)) {
    return InvalidArgumentError(
        "registration url must look like http://HOST:PORT or https://HOST:PORT, got '" + raw.url +
        "'");
  }
  if (info.id.empty()) info.id = info.url;
  if (!info.name.empty() && !ValidName(info.name)) {
    return InvalidArgumentError("registration name must be 1-64 of [A-Za-z0-9._-], got '" +
                                info.name + "'");
  }
  if (info.restarts < 0) return InvalidArgumentError("registration restarts must be >= 0");
  if (info.mode != options_.mode) {
    return FailedPreconditionError(
        "instance " + info.id + " runs KV mode " + std::string(KvTransferModeName(info.mode)) +
        " but this proxy runs " + std::string(KvTransferModeName(options_.mode)) +
        "; mixed READ/WRITE instances are refused");
  }
  auto it = instances_.find(info.id);
  if (it != instances_.end() && it->second.is_static) {
    return AlreadyExistsError("instance " + info.id + " is listed statically");
  }
  InstanceState st;
  st.info = std::move(info);
  st.load = load;
  st.last_heartbeat = now;
  if (it != instances_.end()) {
    st.in_flight = it->second.in_flight;
    st.draining = it->second.draining;
  }
  if (!st.info.name.empty()) {
    // The same name at another id is an earlier incarnation (restarted at a new url): gone.
    for (auto old = instances_.begin(); old != instances_.end();) {
      if (!old->second.is_static && old->first != st.info.id &&
          old->second.info.name == st.info.name) {
        if (replaced != nullptr) replaced->push_back(old->first);
        old = instances_.erase(old);
      } else {
        ++old;
      }
    }
  }
  instances_[st.info.id] = std::move(st);
  return OkStatus();
}

Status InstanceRegistry::RegisterFromStore(const InstanceInfo& info, const InstanceLoad& load,
                                           TimePoint now, std::vector<std::string>* replaced) {
  RETURN_IF_ERROR(Register(info, load, now, replaced));
  std::string id = info.id.empty() ? TrimSlash(info.url) : info.id;
  instances_[id].from_store = true;
  return OkStatus();
}

Status InstanceRegistry::Heartbeat(const std::string& id, const InstanceLoad& load, TimePoint now) {
  auto it = instances_.find(id);
  if (it == instances_.end() || it->second.is_static) {
    return NotFoundError("instance " + id + " is not registered (expired?); register again");
  }
  it->second.load = load;
  it->second.last_heartbeat = now;
  it->second.healthy = true;
  return OkStatus();
}

std::vector<std::string> InstanceRegistry::Expire(TimePoint now) {
  std::vector<std::string> dropped;
  for (auto it = instances_.begin(); it != instances_.end();) {
    if (!it->second.is_static && !it->second.from_store &&
        now - it->second.last_heartbeat > options_.heartbeat_timeout) {
      dropped.push_back(it->first);
      it = instances_.erase(it);
    } else {
      ++it;
    }
  }
  return dropped;
}

Status InstanceRegistry::Remove(const std::string& id) {
  if (instances_.erase(id) == 0) return NotFoundError("instance " + id + " is not known");
  return OkStatus();
}

void InstanceRegistry::SetHealthy(const std::string& id, bool healthy) {
  auto it = instances_.find(id);
  if (it != instances_.end()) it->second.healthy = healthy;
}

Status InstanceRegistry::SetDraining(const std::string& id) {
  auto it = instances_.find(id);
  if (it == instances_.end()) return NotFoundError("instance " + id + " is not known");
  it->second.draining = true;
  return OkStatus();
}

std::optional<InstanceState> InstanceRegistry::Find(const std::string& key) const {
  if (auto st = Get(key)) return st;
  for (const auto& [id, st] : instances_) {
    if (!st.info.name.empty() && st.info.name == key) return st;
  }
  return std::nullopt;
}

std::optional<Endpoint> InstanceRegistry::Pick(Role role, const std::vector<std::string>& exclude) {
  std::vector<const InstanceState*> candidates;
  for (const auto& [id, st] : instances_) {
    if (st.info.role != role || !st.healthy || st.draining) continue;
    if (std::find(exclude.begin(), exclude.end(), id) != exclude.end()) continue;
    if (std::find(exclude.begin(), exclude.end(), st.info.url) != exclude.end()) continue;
    candidates.push_back(&st);
  }
  if (candidates.empty()) return std::nullopt;
  uint64_t& rr = rr_counter_[RoleIndex(role)];
  size_t start = rr++ % candidates.size();
  if (options_.policy == RoutingPolicy::kRoundRobin) return ToEndpoint(candidates[start]->info);
  // Least loaded; scanning from the round-robin start breaks ties fairly.
  const InstanceState* best = nullptr;
  std::tuple<int, double> best_key;
  for (size_t k = 0; k < candidates.size(); ++k) {
    const InstanceState* st = candidates[(start + k) % candidates.size()];
    std::tuple<int, double> key{st->load.running + st->load.waiting + st->in_flight,
                                st->load.kv_usage};
    if (best == nullptr || key < best_key) {
      best = st;
      best_key = key;
    }
  }
  return ToEndpoint(best->info);
}

std::vector<const InstanceState*> InstanceRegistry::Healthy(Role role) const {
  std::vector<const InstanceState*> out;
  for (const auto& [id, st] : instances_) {
    if (st.info.role == role && st.healthy) out.push_back(&st);
  }
  return out;
}

void InstanceRegistry::LegStarted(const std::string& id) {
  auto it = instances_.find(id);
  if (it != instances_.end()) ++it->second.in_flight;
}

void InstanceRegistry::LegFinished(const std::string& id) {
  auto it = instances_.find(id);
  if (it != instances_.end() && it->second.in_flight > 0) --it->second.in_flight;
}

std::vector<InstanceState> InstanceRegistry::List() const {
  std::vector<InstanceState> out;
  for (const auto& [id, st] : instances_) out.push_back(st);
  return out;
}

std::optional<InstanceState> InstanceRegistry::Get(const std::string& id) const {
  auto it = instances_.find(id);
  if (it == instances_.end()) return std::nullopt;
  return it->second;
}

namespace {

Result<InstanceLoad> LoadFromJson(const json& j) {
  InstanceLoad load;
  if (j.is_null()) return load;
  if (!j.is_object()) return InvalidArgumentError("'load' must be an object");
  auto num = [&](const char* key, double& out) -> Status {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return OkStatus();
    if (!it->is_number())
      return InvalidArgumentError(std::string("load.") + key + " must be a number");
    out = it->get<double>();
    if (out < 0) return InvalidArgumentError(std::string("load.") + key + " must be >= 0");
    return OkStatus();
  };
  double running = 0, waiting = 0;
  RETURN_IF_ERROR(num("running", running));
  RETURN_IF_ERROR(num("waiting", waiting));
  RETURN_IF_ERROR(num("kv_usage", load.kv_usage));
  load.running = static_cast<int>(std::min(running, 1e9));
  load.waiting = static_cast<int>(std::min(waiting, 1e9));
  return load;
}

}  // namespace

Result<InstanceLoad> ParseLoad(std::string_view json_text) {
  json j = json::parse(json_text, nullptr, false);
  if (j.is_discarded()) return InvalidArgumentError("load is not valid JSON");
  return LoadFromJson(j);
}

Result<std::pair<InstanceInfo, InstanceLoad>> ParseRegistration(std::string_view json_text) {
  json j = json::parse(json_text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgumentError("registration must be a JSON object");
  }
  auto str = [&](const char* key, bool required, std::string& out) -> Status {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
      return required ? InvalidArgumentError(std::string("registration lacks '") + key + "'")
                      : OkStatus();
    }
    if (!it->is_string())
      return InvalidArgumentError(std::string("'") + key + "' must be a string");
    out = it->get<std::string>();
    return OkStatus();
  };
  InstanceInfo info;
  std::string role, mode = "read";
  RETURN_IF_ERROR(str("instance_id", false, info.id));
  RETURN_IF_ERROR(str("role", true, role));
  RETURN_IF_ERROR(str("url", true, info.url));
  RETURN_IF_ERROR(str("mode", false, mode));
  RETURN_IF_ERROR(str("engine_id", false, info.engine_id));
  RETURN_IF_ERROR(str("name", false, info.name));
  ASSIGN_OR_RETURN(info.role, ParseRole(role));
  std::string kv_role;
  RETURN_IF_ERROR(str("kv_role", false, kv_role));
  if (!kv_role.empty() && kv_role != "kv_producer" && kv_role != "kv_consumer" &&
      kv_role != "kv_both") {
    return InvalidArgumentError("'kv_role' must be kv_producer|kv_consumer|kv_both, got '" +
                                kv_role + "'");
  }
  info.kv_both = kv_role == "kv_both";
  if (auto it = j.find("restarts"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 1'000'000) {
      return InvalidArgumentError("'restarts' must be an integer >= 0");
    }
    info.restarts = static_cast<int>(it->get<int64_t>());
  }
  ASSIGN_OR_RETURN(info.mode, ParseKvTransferMode(mode));
  if (auto it = j.find("transfer_endpoints"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return InvalidArgumentError("'transfer_endpoints' must be an array");
    for (const json& e : *it) {
      if (!e.is_string()) return InvalidArgumentError("'transfer_endpoints' must hold strings");
      info.transfer_endpoints.push_back(e.get<std::string>());
    }
  }
  if (auto it = j.find("tp_size"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > kMaxTpSize) {
      return InvalidArgumentError("'tp_size' must be an integer in [1, " +
                                  std::to_string(kMaxTpSize) + "]");
    }
    info.tp_size = static_cast<int>(it->get<int64_t>());
  }
  InstanceLoad load;
  if (auto it = j.find("load"); it != j.end()) {
    ASSIGN_OR_RETURN(load, LoadFromJson(*it));
  }
  return std::make_pair(std::move(info), load);
}

std::string RegistrationJson(const InstanceInfo& info, const InstanceLoad& load) {
  json j = {{"instance_id", info.id},
            {"role", RoleName(info.role)},
            {"url", info.url},
            {"mode", KvTransferModeName(info.mode)},
            {"engine_id", info.engine_id},
            {"transfer_endpoints", info.transfer_endpoints},
            {"tp_size", info.tp_size},
            {"name", info.name},
            {"restarts", info.restarts},
            {"load",
             {{"running", load.running}, {"waiting", load.waiting}, {"kv_usage", load.kv_usage}}}};
  if (info.kv_both) j["kv_role"] = "kv_both";
  return j.dump();
}

}  // namespace kvbridge::proxy
