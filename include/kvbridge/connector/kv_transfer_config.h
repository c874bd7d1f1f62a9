// kvbridge/connector/kv_transfer_config.h — the P/D connector's configuration and the per-request
// `kv_transfer_params`, parsed and validated.
//
// `--kv-transfer-config` is JSON in the shape users know from vLLM (DESIGN.md "Conventions"):
//
//   {"kv_connector": "KVBridgeConnector", "kv_role": "kv_producer|kv_consumer|kv_both",
//    "kv_connector_extra_config": {"mode": "read", "transport": "auto", "lease_ms": 60000,
//                                  "load_failure_policy": "recompute"}}
//
//   ASSIGN_OR_RETURN(KvTransferConfig cfg, ParseKvTransferConfig(flag_text));
//   ASSIGN_OR_RETURN(KvTransferParams p, ParseKvTransferParams(body["kv_transfer_params"],
//                                                              {.block_size = 16}));
//
// Unknown keys and values are refused with an InvalidArgument naming them; a bad
// `kv_transfer_params` is an HTTP 400 with no effect on the engine. See docs/protocol.md.
//
// Thread-safety: pure functions on values.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/kv_transfer_mode.h"
#include "kvbridge/common/status.h"

namespace kvbridge {

enum class KvRole : uint8_t { kProducer = 0, kConsumer = 1, kBoth = 2 };
/// kAuto: shm, else tcp between host pools; cuda_ipc between device pools (GPU engines).
enum class KvTransport : uint8_t { kAuto = 0, kShm = 1, kTcp = 2, kUcx = 3, kCudaIpc = 4 };
enum class LoadFailurePolicy : uint8_t { kRecompute = 0, kFail = 1 };

/// "kv_producer" | "kv_consumer" | "kv_both".
std::string_view KvRoleName(KvRole r);
/// "auto" | "shm" | "tcp" | "ucx" | "cuda_ipc".
std::string_view KvTransportName(KvTransport t);
/// "recompute" | "fail".
std::string_view LoadFailurePolicyName(LoadFailurePolicy p);

/// The parsed `--kv-transfer-config`. Durations in microseconds (JSON carries milliseconds).
struct KvTransferConfig {
  KvRole role = KvRole::kBoth;
  KvTransferMode mode = KvTransferMode::kRead;  ///< extra "mode"
  KvTransport transport = KvTransport::kAuto;   ///< extra "transport"
  DurationUs lease = 60 * kSecond;              ///< extra "lease_ms", [1, 3600000]
  /// extra "claim_lease_ms", [0, 3600000]: a READ hold no decode has claimed yet (heartbeat or
  /// read_done) is freed this long after it began (min with lease); 0 = no claim lease.
  DurationUs claim_lease = 5 * kSecond;
  LoadFailurePolicy load_failure_policy = LoadFailurePolicy::kRecompute;
  DurationUs reply_timeout = 10 * kSecond;  ///< extra "reply_timeout_ms": hold reply bound
  DurationUs read_timeout = 30 * kSecond;   ///< extra "read_timeout_ms": cancel a READ after
  DurationUs heartbeat_interval = 0;        ///< extra "heartbeat_ms"; 0 = lease / 4
  int64_t max_parked_messages = 4096;       ///< extra "max_parked_messages", >= 1
  std::string engine_id;                    ///< extra "engine_id"; empty = random per start

  bool IsProducer() const { return role != KvRole::kConsumer; }
  bool IsConsumer() const { return role != KvRole::kProducer; }
  /// heartbeat_interval, or lease / 4 when 0.
  DurationUs EffectiveHeartbeat() const {
    return heartbeat_interval > 0 ? heartbeat_interval : lease / 4;
  }
  /// min(claim_lease, lease).
  DurationUs EffectiveClaimLease() const { return claim_lease < lease ? claim_lease : lease; }
};

/// Parses `--kv-transfer-config` text. InvalidArgument (message names the key and the allowed
/// values) on malformed JSON, a missing or wrong kv_connector / kv_role, any unknown key, a value
/// of the wrong type or out of range.
Result<KvTransferConfig> ParseKvTransferConfig(std::string_view json_text);
/// The JSON form (round-trips through ParseKvTransferConfig).
nlohmann::json KvTransferConfigToJson(const KvTransferConfig& c);

/// Per-request P/D parameters (DESIGN.md names). A prefill leg carries do_remote_decode +
/// transfer_id; a decode leg carries do_remote_prefill + what the prefill returned.
struct KvTransferParams {
  bool do_remote_decode = false;   ///< this engine prefills and holds for a remote decode
  bool do_remote_prefill = false;  ///< this engine loads the prompt's KV from a remote prefill
  std::string transfer_id;         ///< minted by the proxy, shared by all siblings and both legs
  std::string remote_engine_id;    ///< the prefill engine incarnation that holds the blocks
  std::string remote_host;         ///< its control endpoint (HTTP), e.g. "127.0.0.1"
  int remote_port = 0;
  std::vector<int32_t> remote_block_ids;  ///< prompt blocks on the prefill, in token order
  int remote_num_tokens = 0;              ///< prompt tokens whose KV the prefill holds
  int tp_size = 1;                        ///< the prefill's TP size
  KvTransferMode mode = KvTransferMode::kRead;
};

/// What a validator knows of the peer and of itself.
struct KvTransferParamsLimits {
  int block_size = 16;                       ///< tokens per block (must be equal at both ends)
  std::optional<int64_t> remote_num_blocks;  ///< the REMOTE pool's size, when known
  int max_tp_size = 64;
};

/// Validates a request's `kv_transfer_params` JSON. InvalidArgument naming the field on: a
/// non-object, unknown keys, wrong types, neither or both of do_remote_decode/do_remote_prefill,
/// a transfer_id that is empty, longer than 128 or not [A-Za-z0-9._:-], a port outside
/// [1, 65535], negative/duplicate/out-of-range block ids, remote_num_tokens < 1,
/// remote_block_ids.size() != ceil(remote_num_tokens / block_size), tp_size outside
/// [1, max_tp_size], or a mode other than "read"/"write".
Result<KvTransferParams> ParseKvTransferParams(const nlohmann::json& j,
                                               const KvTransferParamsLimits& limits);
/// The JSON form; only fields that apply to the leg are written.
nlohmann::json KvTransferParamsToJson(const KvTransferParams& p);

/// True when `id` is a valid transfer_id (non-empty, <= 128 chars of [A-Za-z0-9._:-]).
bool IsValidTransferId(std::string_view id);

}  // namespace kvbridge
