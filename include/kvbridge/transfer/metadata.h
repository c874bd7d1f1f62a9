// kvbridge/transfer/metadata.h — what two transfer agents tell each other at handshake.
//
// Each agent exports AgentMetadata after RegisterMemory; the connector ships the encoded bytes
// (JSON text) over HTTP or control messages, and the peer imports them with
// TransferAgent::AddPeer, which refuses an incompatible peer with an error naming the field.
//
//   std::string blob = EncodeMetadata(agent->Metadata().value());   // send to the peer
//   ASSIGN_OR_RETURN(AgentMetadata m, DecodeMetadata(blob));          // on the peer
//   RETURN_IF_ERROR(CheckCompatible(local, m));                       // AddPeer does this
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/status.h"
#include "kvbridge/transfer/memory.h"

namespace kvbridge::transfer {

/// Bumped on any incompatible change of the metadata or of a backend's wire protocol.
constexpr uint32_t kTransferProtocolVersion = 1;

struct AgentMetadata {
  uint32_t version = kTransferProtocolVersion;
  std::string agent_name;    ///< Unique per rank, e.g. "prefill-0/rank1"; used as peer id.
  uint64_t incarnation = 0;  ///< Random, new at every agent start.
  std::string host_id;       ///< boot id + network namespace: equal iff shm can reach.
  /// Backend name -> endpoint ("shm" -> "@kvbridge-...", "tcp" -> "127.0.0.1:5555").
  std::map<std::string, std::string> endpoints;
  int tp_size = 1;
  int tp_rank = 0;
  int head_begin = 0;  ///< First global KV head held by this rank.
  int head_count = 0;  ///< KV heads held by this rank (== layout.num_kv_heads).
  PagedKvLayout layout;
  std::vector<uint64_t> layer_base;   ///< Per-layer base address (for one-sided backends).
  std::vector<uint64_t> layer_bytes;  ///< Per-layer registered bytes.
  MemoryKind memory_kind = MemoryKind::kHost;
  std::vector<float> k_scale;
  std::vector<float> v_scale;
  std::string model_fingerprint;
  uint64_t compat_hash = 0;  ///< ComputeCompatHash(*this), checked on decode.
  /// Backend-specific opaque blobs (e.g. "ucx" -> packed rkeys, hex), copied verbatim.
  std::map<std::string, std::string> backend_blobs;

  size_t BlockBytes() const { return layout.BlockBytes(); }
};

/// xxHash64 over the fields that must match between peers: version, model fingerprint, dtype,
/// head_dim, block_size, num_layers, memory kind.
uint64_t ComputeCompatHash(const AgentMetadata& m);

/// JSON text. Thread-safe.
std::string EncodeMetadata(const AgentMetadata& m);
/// Parses EncodeMetadata's output; InvalidArgument on malformed input (never throws), including
/// a compat_hash that does not match the fields.
Result<AgentMetadata> DecodeMetadata(std::string_view text);

/// OK when `peer` can exchange KV with `local`; else FailedPrecondition whose message names the
/// first mismatched field and both values ("peer metadata mismatch: dtype (local fp32, peer
/// bf16)"). Checks version, model_fingerprint, dtype, head_dim, block_size, num_layers,
/// memory_kind, and per-layer region sizes against the layout.
Status CheckCompatible(const AgentMetadata& local, const AgentMetadata& peer);

}  // namespace kvbridge::transfer
