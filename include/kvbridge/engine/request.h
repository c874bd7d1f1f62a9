// kvbridge/engine/request.h — the engine's value types: a request and its sampling parameters,
// the outputs it produces, the engine's configuration and its stats.
//
// Plain data shared by the threaded front door (engine.h), the sans-IO core (engine_core.h,
// scheduler.h, sampler.h) and the HTTP server, so none of them needs the others' headers.
//
//   EngineRequest req{.request_id = "cmpl-1", .prompt_token_ids = ids};
//   req.sampling.n = 8; req.sampling.max_tokens = 32;
//
// Thread-safety: values; no shared state.
// CONTRACT NOTE: the serve, connector and proxy modules build on these names; extend, don't rename.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/status.h"
#include "kvbridge/engine/kv_connector.h"

namespace kvbridge {

class BlockCacheListener;  // block_pool.h

/// OpenAI-style sampling parameters of one request (all n siblings share them).
struct SamplingParams {
  int n = 1;                      ///< parallel samples; siblings are "{i}_{request_id}"
  int max_tokens = 16;            ///< generated tokens per sibling, >= 1
  int min_tokens = 0;             ///< EOS and stop strings are ignored before this many
  float temperature = 1.0f;       ///< 0 = greedy
  float top_p = 1.0f;             ///< (0, 1]
  int top_k = 0;                  ///< 0 = off
  std::optional<uint64_t> seed;   ///< per-request seed: same output whatever the batch
  /// Stop strings, matched on the output text (the tokenizer's incremental decode, special
  /// tokens skipped) across token boundaries, as vLLM's detokenizer: after each token past
  /// min_tokens that adds text, the first string of the list found in the text that could end
  /// in the new part ends the sequence (finish "stop", stop_reason the string); the token stays
  /// in the output, the text is cut where the string starts (CompletionOutput::text_len).
  /// While streaming, tokens whose text could still begin a stop string are held back.
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  /// Keep a matched stop string (and a stop token's or EOS's text) in the text.
  bool include_stop_str_in_output = false;
  int logprobs = -1;  ///< -1: none; k >= 0: sampled token's logprob + top-k
};

struct EngineRequest {
  std::string request_id;
  std::vector<int32_t> prompt_token_ids;
  SamplingParams sampling;
  /// P/D parameters (DESIGN.md "Conventions": do_remote_decode, do_remote_prefill, ...),
  /// already validated by the caller's connector; null when absent.
  nlohmann::json kv_transfer_params;
  TimePoint arrival_time = 0;
};

struct TopLogprob {
  int32_t token = 0;
  float logprob = 0;
};
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
  std::vector<TopLogprob> top;  ///< top-k, most likely first
};

/// New tokens of one sibling since its last output.
struct CompletionOutput {
  int index = 0;  ///< sibling index i in [0, n)
  std::vector<int32_t> new_token_ids;
  std::vector<TokenLogprob> new_logprobs;  ///< parallel to new_token_ids when logprobs >= 0
  bool finished = false;
  std::string finish_reason;  ///< "length" | "stop" | "abort" (when finished)
  /// When finished with "stop", vLLM's stop_reason: the stop string matched, or the id of the
  /// stop token that ended it (one of stop_token_ids, or an EOS id of the generation config
  /// other than the tokenizer's EOS); null for the tokenizer's EOS and every other finish.
  nlohmann::json stop_reason;
  /// When finished, the returned text is Decode(skip_special_tokens) of the first
  /// `text_tokens` output ids (-1: all of them; one less when a stop token or EOS ended the
  /// sequence and include_stop_str_in_output is false: its text is not returned, the id is),
  /// cut to its first `text_len` bytes when >= 0 (a stop string matched: where it starts, or
  /// where it ends with include_stop_str_in_output). Every output id is returned either way.
  int text_tokens = -1;
  int64_t text_len = -1;
};

/// Phase times of one request on this engine, on its final output: the scheduler's `now` values
/// (SteadyNow µs, this process's clock); -1 = did not happen. For per-request timelines (the
/// server returns them to the proxy, docs/metrics.md "Per-request P/D timeline").
struct RequestTimes {
  TimePoint arrival = -1;
  TimePoint scheduled = -1;             ///< first scheduled for compute
  TimePoint remote_kv_wait_start = -1;  ///< entered WAITING_FOR_REMOTE_KVS (P/D decode)
  TimePoint remote_kv_wait_end = -1;    ///< left it (remote KV landed, or the load failed)
  TimePoint first_token = -1;
  TimePoint finished = -1;  ///< the last sequence finished
  /// The connector's record of the request's remote KV load (KvConnector::TakeLoadRecord);
  /// null when none.
  nlohmann::json kv_load;
};

struct RequestOutput {
  std::string request_id;
  std::vector<CompletionOutput> outputs;  ///< only siblings with news
  int num_prompt_tokens = 0;
  int num_cached_tokens = 0;          ///< prompt tokens served from the prefix cache / remote KV
  bool finished = false;              ///< every sibling finished: last callback for this id
  nlohmann::json kv_transfer_params;  ///< set on the final output of a do_remote_decode request
  Status error;                       ///< non-OK ends the request (finished = true)
  RequestTimes times;                 ///< set on the final output (finished = true)
};

struct EngineConfig {
  /// The `model_name` label of the vllm:* metric families (the served model name).
  std::string served_model_name = "kvbridge";
  int block_size = 16;
  int64_t num_blocks = 0;  ///< explicit count; 0 = from kv_cache_memory_bytes
  int64_t kv_cache_memory_bytes = 256ll << 20;
  KvDtype kv_dtype = KvDtype::kFp32;
  bool enable_prefix_caching = true;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int max_model_len = 0;            ///< 0 = model's max_position_embeddings
  int max_waiting_requests = 1024;  ///< AddRequest beyond this: ResourceExhausted (HTTP 503)
  uint64_t seed = 0;                ///< default seed for requests without one
  /// The ids that end a sequence like EOS (unless ignore_eos) besides the tokenizer's EOS:
  /// generation_config.json's eos_token_id (LoadGenerationConfig); nullopt: config.json's.
  /// Each must lie in [0, vocab_size).
  std::optional<std::vector<int32_t>> eos_token_ids;
  bool debug_poison_kv_nan = false;  ///< fill the pool with NaN at start (tests)
  /// Tensor-parallel ranks inside this engine (threads of one process, docs/engine.md). Must
  /// divide 8 (the fixed K-shards of row-parallel matmuls) and num_attention_heads, and
  /// num_key_value_heads % T == 0 or T % num_key_value_heads == 0. Logits are bitwise equal at
  /// every valid T.
  int tensor_parallel_size = 1;
  /// Where the forward pass runs: -1 = the CPU (Model / TensorParallelModel, KV in host memory);
  /// N >= 0 = CUDA GPU N (CudaModel, KV pool and weights in device memory, logits copied to
  /// the host where the sampler runs unchanged). With a GPU: tensor_parallel_size must be 1 and
  /// connector_factory empty (P/D between GPU engines is a later issue); the KV pool has
  /// num_blocks blocks, else is sized by gpu_memory_utilization (kv_cache_memory_bytes unused).
  int cuda_device = -1;
  double gpu_memory_utilization = 0.9;   ///< cuda_device >= 0 and num_blocks == 0 (as vLLM)
  KvConnectorFactory connector_factory;  ///< empty: no P/D connector (colocated engine)
  /// Told of every prefix-cache store and eviction on the engine thread (null: none) — the
  /// engine's KV event stream (kv_event_log.h); kept alive by this config.
  std::shared_ptr<BlockCacheListener> kv_cache_listener;
};

struct EngineStats {
  int running = 0;
  int waiting = 0;
  int waiting_for_remote_kv = 0;
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_active = 0;  ///< distinct blocks referenced by a live request or held
  int64_t kv_blocks_held_for_transfer = 0;
  int64_t kv_blocks_cached_free = 0;
  int64_t kv_blocks_free = 0;
};

}  // namespace kvbridge
