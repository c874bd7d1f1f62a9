#include "kvbridge/transfer/metadata.h"

#include <xxhash.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace kvbridge::transfer {

namespace {
// Typed getters that refuse what nlohmann would convert with undefined behaviour (a float or
// out-of-range number read as an integer, a double out of float range).
uint64_t GetU64(const nlohmann::json& j, const char* key) {
  const auto& v = j.at(key);
  if (!v.is_number_unsigned())
    throw std::invalid_argument(std::string(key) + " is not an unsigned integer");
  return v.get<uint64_t>();
}
int GetInt(const nlohmann::json& j, const char* key) {
  const auto& v = j.at(key);
  if (!v.is_number_integer()) throw std::invalid_argument(std::string(key) + " is not an integer");
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int>::max()))
      throw std::invalid_argument(std::string(key) + " out of range");
    return static_cast<int>(u);
  }
  int64_t x = v.get<int64_t>();
  if (x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
    throw std::invalid_argument(std::string(key) + " out of range");
  return static_cast<int>(x);
}
std::vector<uint64_t> GetU64s(const nlohmann::json& j, const char* key) {
  const auto& v = j.at(key);
  if (!v.is_array()) throw std::invalid_argument(std::string(key) + " is not an array");
  std::vector<uint64_t> out;
  for (const auto& e : v) {
    if (!e.is_number_unsigned())
      throw std::invalid_argument(std::string(key) + " has a non-integer");
    out.push_back(e.get<uint64_t>());
  }
  return out;
}
std::vector<float> GetFloats(const nlohmann::json& j, const char* key) {
  const auto& v = j.at(key);
  if (!v.is_array()) throw std::invalid_argument(std::string(key) + " is not an array");
  std::vector<float> out;
  for (const auto& e : v) {
    if (!e.is_number()) throw std::invalid_argument(std::string(key) + " has a non-number");
    double d = e.get<double>();
    if (!(std::fabs(d) <= std::numeric_limits<float>::max()))
      throw std::invalid_argument(std::string(key) + " out of float range");
    out.push_back(static_cast<float>(d));
  }
  return out;
}
std::map<std::string, std::string> GetStrMap(const nlohmann::json& j, const char* key) {
  const auto& v = j.at(key);
  if (!v.is_object()) throw std::invalid_argument(std::string(key) + " is not an object");
  std::map<std::string, std::string> out;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!it.value().is_string())
      throw std::invalid_argument(std::string(key) + " has a non-string");
    out[it.key()] = it.value().get<std::string>();
  }
  return out;
}
std::string GetStr(const nlohmann::json& j, const char* key) {
  const auto& v = j.at(key);
  if (!v.is_string()) throw std::invalid_argument(std::string(key) + " is not a string");
  return v.get<std::string>();
}
}  // namespace

uint64_t ComputeCompatHash(const AgentMetadata& m) {
  // Appended piece by piece: GCC 12 at -O3 reports a false -Werror=restrict inside the inlined
  // std::string operator+ chain (GCC bug 105329).
  std::string s = "v";
  s.append(std::to_string(m.version));
  s.append("|fp=").append(m.model_fingerprint);
  s.append("|dt=").append(KvDtypeName(m.layout.dtype));
  s.append("|hd=").append(std::to_string(m.layout.head_dim));
  s.append("|bs=").append(std::to_string(m.layout.block_size));
  s.append("|nl=").append(std::to_string(m.layout.num_layers));
  s.append("|mk=").append(MemoryKindName(m.memory_kind));
  return XXH64(s.data(), s.size(), 0x6b76627269646765ULL);
}

std::string EncodeMetadata(const AgentMetadata& m) {
  nlohmann::json j;
  j["version"] = m.version;
  j["agent_name"] = m.agent_name;
  j["incarnation"] = m.incarnation;
  j["host_id"] = m.host_id;
  j["endpoints"] = m.endpoints;
  j["tp_size"] = m.tp_size;
  j["tp_rank"] = m.tp_rank;
  j["head_begin"] = m.head_begin;
  j["head_count"] = m.head_count;
  j["layout"] = {{"num_layers", m.layout.num_layers}, {"num_kv_heads", m.layout.num_kv_heads},
                 {"head_dim", m.layout.head_dim},     {"block_size", m.layout.block_size},
                 {"num_blocks", m.layout.num_blocks}, {"dtype", KvDtypeName(m.layout.dtype)}};
  j["block_bytes"] = m.layout.BlockBytes();
  j["layer_base"] = m.layer_base;
  j["layer_bytes"] = m.layer_bytes;
  j["memory_kind"] = std::string(MemoryKindName(m.memory_kind));
  j["k_scale"] = m.k_scale;
  j["v_scale"] = m.v_scale;
  j["model_fingerprint"] = m.model_fingerprint;
  j["compat_hash"] = m.compat_hash;
  j["backend_blobs"] = m.backend_blobs;
  return j.dump();
}

Result<AgentMetadata> DecodeMetadata(std::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return InvalidArgumentError("metadata is not a JSON object");
  AgentMetadata m;
  uint64_t block_bytes = 0;
  try {
    m.version = static_cast<uint32_t>(GetInt(j, "version"));
    m.agent_name = GetStr(j, "agent_name");
    m.incarnation = GetU64(j, "incarnation");
    m.host_id = GetStr(j, "host_id");
    m.endpoints = GetStrMap(j, "endpoints");
    m.tp_size = GetInt(j, "tp_size");
    m.tp_rank = GetInt(j, "tp_rank");
    m.head_begin = GetInt(j, "head_begin");
    m.head_count = GetInt(j, "head_count");
    const auto& l = j.at("layout");
    if (!l.is_object()) return InvalidArgumentError("metadata: layout is not an object");
    m.layout.num_layers = GetInt(l, "num_layers");
    m.layout.num_kv_heads = GetInt(l, "num_kv_heads");
    m.layout.head_dim = GetInt(l, "head_dim");
    m.layout.block_size = GetInt(l, "block_size");
    m.layout.num_blocks = GetInt(l, "num_blocks");
    std::string dt = GetStr(l, "dtype");
    if (dt == "fp32") {
      m.layout.dtype = KvDtype::kFp32;
    } else if (dt == "bf16") {
      m.layout.dtype = KvDtype::kBf16;
    } else if (dt == "fp8") {
      m.layout.dtype = KvDtype::kFp8E4M3;
    } else {
      return InvalidArgumentError("metadata: unknown dtype '" + dt + "'");
    }
    m.layer_base = GetU64s(j, "layer_base");
    m.layer_bytes = GetU64s(j, "layer_bytes");
    std::string mk = GetStr(j, "memory_kind");
    if (mk == "host") {
      m.memory_kind = MemoryKind::kHost;
    } else if (mk == "cuda") {
      m.memory_kind = MemoryKind::kCuda;
    } else {
      return InvalidArgumentError("metadata: unknown memory_kind '" + mk + "'");
    }
    m.k_scale = GetFloats(j, "k_scale");
    m.v_scale = GetFloats(j, "v_scale");
    m.model_fingerprint = GetStr(j, "model_fingerprint");
    m.compat_hash = GetU64(j, "compat_hash");
    m.backend_blobs = GetStrMap(j, "backend_blobs");
    block_bytes = GetU64(j, "block_bytes");
  } catch (const std::exception& e) {
    return InvalidArgumentError(std::string("metadata: ") + e.what());
  }
  const PagedKvLayout& l = m.layout;
  if (m.agent_name.empty()) return InvalidArgumentError("metadata: empty agent_name");
  if (l.num_layers <= 0 || l.num_layers > 100000 || l.num_kv_heads <= 0 || l.num_kv_heads > 65536 ||
      l.head_dim <= 0 || l.head_dim > 65536 || l.block_size <= 0 || l.block_size > 65536 ||
      l.num_blocks <= 0) {
    return InvalidArgumentError("metadata: layout has an out-of-range dimension");
  }
  if (l.BlockBytes() > (uint64_t{1} << 32))
    return InvalidArgumentError("metadata: blocks too large");
  if (block_bytes != l.BlockBytes()) {
    return InvalidArgumentError("metadata: block_bytes does not match the layout");
  }
  if (m.layer_base.size() != static_cast<size_t>(l.num_layers) ||
      m.layer_bytes.size() != static_cast<size_t>(l.num_layers)) {
    return InvalidArgumentError("metadata: layer_base/layer_bytes need one entry per layer");
  }
  if (m.compat_hash != ComputeCompatHash(m)) {
    return InvalidArgumentError("metadata: compat_hash does not match its fields (corrupt)");
  }
  return m;
}

Status CheckCompatible(const AgentMetadata& local, const AgentMetadata& peer) {
  auto mismatch = [](const std::string& field, const std::string& a, const std::string& b) {
    return FailedPreconditionError("peer metadata mismatch: " + field + " (local " + a + ", peer " +
                                   b + ")");
  };
  if (local.version != peer.version) {
    return mismatch("version", std::to_string(local.version), std::to_string(peer.version));
  }
  if (local.model_fingerprint != peer.model_fingerprint) {
    return mismatch("model_fingerprint", local.model_fingerprint, peer.model_fingerprint);
  }
  if (local.layout.dtype != peer.layout.dtype) {
    return mismatch("dtype", std::string(KvDtypeName(local.layout.dtype)),
                    std::string(KvDtypeName(peer.layout.dtype)));
  }
  if (local.layout.head_dim != peer.layout.head_dim) {
    return mismatch("head_dim", std::to_string(local.layout.head_dim),
                    std::to_string(peer.layout.head_dim));
  }
  if (local.layout.block_size != peer.layout.block_size) {
    return mismatch("block_size", std::to_string(local.layout.block_size),
                    std::to_string(peer.layout.block_size));
  }
  if (local.layout.num_layers != peer.layout.num_layers) {
    return mismatch("num_layers", std::to_string(local.layout.num_layers),
                    std::to_string(peer.layout.num_layers));
  }
  if (local.memory_kind != peer.memory_kind) {
    return mismatch("memory_kind", std::string(MemoryKindName(local.memory_kind)),
                    std::string(MemoryKindName(peer.memory_kind)));
  }
  if (peer.compat_hash != ComputeCompatHash(peer)) {
    return FailedPreconditionError("peer metadata mismatch: compat_hash does not match its fields");
  }
  for (size_t i = 0; i < peer.layer_bytes.size(); ++i) {
    if (peer.layer_bytes[i] < peer.layout.LayerBytes()) {
      return mismatch("layer_bytes[" + std::to_string(i) + "]",
                      ">= " + std::to_string(peer.layout.LayerBytes()),
                      std::to_string(peer.layer_bytes[i]));
    }
  }
  if (peer.agent_name == local.agent_name) {
    return FailedPreconditionError("peer metadata mismatch: agent_name equals ours ('" +
                                   local.agent_name + "')");
  }
  return OkStatus();
}

}  // namespace kvbridge::transfer
