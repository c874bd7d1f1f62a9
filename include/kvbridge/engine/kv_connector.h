// kvbridge/engine/kv_connector.h — the hooks through which the engine's scheduler talks to a
// P/D KV connector (after the shape of vLLM's KVConnectorBase_V1 scheduler/worker API).
//
// The engine thread calls every method; none may block, read a clock (time comes in as `now`)
// or assume a thread. Transfer progress happens elsewhere (the transfer agent's threads); the
// connector calls `EngineHooks::wake` when something finished so the engine calls Poll() soon.
//
// Request lifecycle with a connector (DESIGN.md "READ mode"):
//   decode side (do_remote_prefill):
//     AddRequest → local prefix match → GetNumNewMatchedTokens → (num_external > 0, async)
//     → blocks allocated for the parent → UpdateStateAfterAlloc → WAITING_FOR_REMOTE_KVS
//     → Poll().finished_recving has it → the engine marks the prompt computed except its last
//       token, forks the n siblings, and decodes.
//     → Poll().failed_recving has it → recompute locally or fail, per `recompute`.
//   prefill side (do_remote_decode): the request runs normally; when a sibling finishes,
//     RequestFinished says whether to hold its blocks; held blocks stay until Poll() lists the
//     request in finished_sending, and then the engine frees them exactly once.
//
// Thread-safety: engine thread only (see above).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/metrics.h"
#include "kvbridge/common/status.h"

namespace kvbridge {

/// What the connector may know about a request (engine-owned; valid for the call only).
struct ConnectorRequestInfo {
  std::string request_id;  ///< the scheduled id: "{i}_{parent}" for a sibling, else the parent id
  std::string parent_id;   ///< the client request id
  int sibling_index = 0;   ///< i, or 0 when n == 1
  int n = 1;
  int num_prompt_tokens = 0;
  const std::vector<int32_t>* prompt_token_ids = nullptr;
  const nlohmann::json* kv_transfer_params = nullptr;  ///< validated, may be null json
};

class KvConnector {
 public:
  virtual ~KvConnector() = default;

  struct Match {
    int num_external_tokens =
        0;  ///< prompt tokens (after the local prefix hit) that will arrive remotely
    bool load_async = false;  ///< true: the request waits in WAITING_FOR_REMOTE_KVS
  };
  /// Called once per parent request when it enters the engine's waiting queue (before any
  /// GetNumNewMatchedTokens), so a decode still queued can keep the prefill's hold alive
  /// (heartbeat). Default: nothing.
  virtual void RequestQueued(const ConnectorRequestInfo& req, TimePoint now) {}

  /// Called once per parent request before its first allocation. `num_local_computed_tokens` is
  /// its local prefix-cache hit (a multiple of block_size). Errors fail the request (HTTP 400/503).
  virtual Result<Match> GetNumNewMatchedTokens(const ConnectorRequestInfo& req,
                                               int num_local_computed_tokens, TimePoint now) = 0;

  /// After the engine allocated blocks for a request that got num_external_tokens > 0:
  /// `block_ids` is its whole block table (the first num_local_computed_tokens / block_size
  /// blocks are local prefix hits; the rest are the destination of the remote load).
  virtual void UpdateStateAfterAlloc(const ConnectorRequestInfo& req,
                                     std::span<const int32_t> block_ids,
                                     int num_local_computed_tokens, int num_external_tokens,
                                     TimePoint now) = 0;

  struct FinishDecision {
    bool hold_blocks = false;           ///< true: keep the blocks until finished_sending lists it
    nlohmann::json kv_transfer_params;  ///< returned to the client in the final output
  };
  /// Called once per scheduled request (each sibling) when it finishes for any reason other than
  /// abort ("length", "stop"). `block_ids` covers the prompt (and any generated tokens).
  virtual FinishDecision RequestFinished(const ConnectorRequestInfo& req,
                                         std::span<const int32_t> block_ids,
                                         std::string_view finish_reason, TimePoint now) = 0;

  /// Called when a request is aborted (any state). Returns true when the engine must keep the
  /// request's blocks until a later Poll() lists it in `finished_recving`, `failed_recving` or
  /// `finished_sending` (a load or send may still touch them); false frees them now.
  virtual bool RequestAborted(const ConnectorRequestInfo& req, TimePoint now) = 0;

  struct LoadFailure {
    std::string request_id;
    bool recompute = true;  ///< true: compute the prompt locally; false: fail the request
    Status status;
  };
  struct StepReport {
    std::vector<std::string>
        finished_sending;  ///< held/aborted requests whose blocks may be freed now
    std::vector<std::string> finished_recving;  ///< remote KV landed and validated: proceed
    std::vector<LoadFailure> failed_recving;
  };
  /// Called at every engine step and whenever `wake` fired. Each id is reported exactly once.
  virtual StepReport Poll(TimePoint now) = 0;

  /// One chunk of a forward pass as OnLayerKvWritten reports it (views valid for the call).
  struct LayerKvChunk {
    std::string_view request_id;         ///< the scheduled id
    std::span<const int32_t> block_ids;  ///< its block table (token order)
    int end_pos = 0;  ///< KV of positions [0, end_pos) of this layer is final after the call
    /// True when this chunk ends the request's known tokens (a prompt's last chunk, or a decode
    /// step): every position's KV of the layer is final.
    bool completes_tokens = false;
  };
  /// WRITE mode: called after the forward pass wrote layer `layer`'s K/V for `chunks` (every
  /// chunk of the batch), before the next layer is computed.
  virtual void OnLayerKvWritten(int layer, std::span<const LayerKvChunk> chunks, TimePoint now) {}
  /// False when OnLayerKvWritten does nothing (READ mode): the engine then sets no per-layer
  /// callback, so a GPU forward pass never waits on the host between layers.
  virtual bool WantsLayerKvWritten() const { return true; }

  /// The record of request `request_id`'s finished remote KV load, taken once (the engine asks
  /// when the request's final output is emitted): phase times (SteadyNow µs, keys ending in
  /// "_us"), "bytes", "blocks", "backend". Null when there is none. Default: null.
  virtual nlohmann::json TakeLoadRecord(const std::string& request_id) { return nullptr; }

  /// The next time Poll() must run even with no traffic (lease expiry, reply timeout), if any.
  virtual std::optional<TimePoint> NextDeadline() const = 0;
  /// True when no transfer, hold, parked message or pending notification remains.
  virtual bool Idle() const = 0;
};

/// One tensor-parallel rank's KV cache, as the connector registers it with that rank's transfer
/// agent. Every rank's storage uses the same block ids (one block pool / block table shared by
/// all ranks: block b is block b in every rank's storage); the rank's layout has
/// `num_kv_heads = kv_head_end - kv_head_begin`.
struct KvRankHooks {
  int rank = 0;
  PagedKvView kv_view;  ///< this rank's memory; layout.num_kv_heads = heads of this rank
  /// Global KV heads [kv_head_begin, kv_head_end) held by this rank. With num_key_value_heads
  /// >= tp_size: [r*Hkv/T, (r+1)*Hkv/T). With fewer KV heads than ranks (T a multiple of Hkv)
  /// heads are replicated as vLLM does: rank r holds the one head floor(r*Hkv/T).
  int kv_head_begin = 0;
  int kv_head_end = 0;
  int kv_shm_fd = -1;                      ///< this rank's memfd (engine-owned), -1: not shareable
  std::vector<uint64_t> kv_layer_offsets;  ///< layer l's offset inside kv_shm_fd (when >= 0)
};

/// What the engine gives its connector at creation.
struct EngineHooks {
  /// Rank 0's memory (to register with a transfer agent); with tp_size 1 the whole pool.
  PagedKvView kv_view;
  std::string model_fingerprint;       ///< hex digest of config + weights
  MetricsRegistry* metrics = nullptr;  ///< register kvbridge_kv_* metrics here
  std::function<void()> wake;          ///< thread-safe: asks the engine thread to Poll() soon
  /// The memfd that holds the pool (engine-owned, valid while the engine lives; do not close),
  /// so a same-host peer can map it (transfer shm backend). -1: the pool is not shareable.
  int kv_shm_fd = -1;
  /// Byte offset of layer l's region (kv_view.layer_base[l]) inside kv_shm_fd; size num_layers
  /// when kv_shm_fd >= 0, else empty.
  std::vector<uint64_t> kv_layer_offsets;
  /// >= 0: the pool (kv_view, ranks[0].kv_view) is device memory of CUDA device
  /// kv_cuda_device, one cudaMalloc (a GPU engine, `--device cuda`); the connector registers it
  /// as MemoryKind::kCuda and moves it with cuda_ipc. -1: host memory.
  int kv_cuda_device = -1;
  /// With kv_cuda_device >= 0: XORs byte `offset` of layer `layer` of the device pool with `mask`
  /// (the host cannot write device memory; the connector's debug corruption uses this).
  std::function<Status(int layer, size_t offset, uint8_t mask)> kv_xor_byte;
  /// Tensor-parallel size of the engine (`--tensor-parallel-size`), >= 1.
  int tp_size = 1;
  /// One entry per rank (size tp_size); ranks[0] mirrors kv_view / kv_shm_fd / kv_layer_offsets
  /// above, which keep meaning rank 0 so tp_size-1 code needs no change.
  std::vector<KvRankHooks> ranks;
};

using KvConnectorFactory = std::function<Result<std::unique_ptr<KvConnector>>(const EngineHooks&)>;

}  // namespace kvbridge
