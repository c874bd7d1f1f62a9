// kvbridge/engine/engine_core.h — one engine without its thread: model + KV cache + scheduler +
// connector, advanced one step at a time by whoever owns it.
//
// Engine (engine.h) runs an EngineCore on its own thread; tests, benchmarks and the simulator
// drive one directly with their own clock (DESIGN.md "Sans-IO cores": time comes in as `now`).
//
//   ASSIGN_OR_RETURN(auto core, EngineCore::Create(config, model, &metrics, /*wake=*/{}));
//   RETURN_IF_ERROR(core->AddRequest(std::move(request), now));
//   while (core->scheduler().HasUnfinished()) {
//     RETURN_IF_ERROR(core->Step(now).status());
//     for (RequestOutput& out : core->TakeOutputs()) Deliver(out);
//   }
//
// A step: Poll the connector (apply finished/failed loads and sends) → Schedule → copy-on-write
// block copies → Model::Forward (or CudaModel::Forward with config.cuda_device >= 0) → sample,
// stop checks, outputs.
//
// Thread-safety: not thread-safe; one thread owns it (the `wake` callback given to the
// connector may be called from any thread and is the caller's business).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/metrics.h"
#include "kvbridge/common/status.h"
#include "kvbridge/engine/block_pool.h"
#include "kvbridge/engine/kv_cache_storage.h"
#include "kvbridge/engine/kv_connector.h"
#include "kvbridge/engine/request.h"
#include "kvbridge/engine/scheduler.h"
#include "kvbridge/model/cuda_model.h"
#include "kvbridge/model/tensor_parallel.h"

namespace kvbridge {

class EngineCore {
 public:
  /// Sizes and allocates the KV cache (config.num_blocks, else kv_cache_memory_bytes over all
  /// ranks) — one KvCacheStorage per tensor-parallel rank, sharing one block pool — builds
  /// the scheduler and — when config.connector_factory is set — the connector, passing it the
  /// pool's memory, the model fingerprint, `metrics` and `wake`.
  /// With config.cuda_device >= 0 the model runs on that GPU (CudaModel, which owns the KV pool
  /// in device memory; no KvCacheStorage, no tensor-parallel model).
  /// Errors: InvalidArgument (bad config: block_size, max_num_seqs, max_num_batched_tokens,
  /// max_model_len beyond the model's, tensor_parallel_size — see ValidateTensorParallelSize;
  /// a GPU engine with tensor_parallel_size > 1 or a connector), ResourceExhausted (KV budget
  /// below one block; device memory), Unavailable (no CUDA device), Unimplemented (built without
  /// CUDA), or the connector factory's error.
  static Result<std::unique_ptr<EngineCore>> Create(const EngineConfig& config,
                                                    std::shared_ptr<const Model> model,
                                                    MetricsRegistry* metrics,
                                                    std::function<void()> wake);
  ~EngineCore();

  /// See Scheduler::AddRequest (errors: InvalidArgument, AlreadyExists).
  Status AddRequest(EngineRequest request, TimePoint now);
  /// See Scheduler::Abort. False for unknown ids.
  bool Abort(const std::string& request_id, TimePoint now);
  /// Validation that needs no engine state (safe from any thread: reads immutable config).
  /// Errors: InvalidArgument.
  Status ValidateRequest(const EngineRequest& request) const;

  struct StepResult {
    int num_tokens = 0;          ///< tokens computed by the forward pass (0: no forward ran)
    int num_sequences = 0;       ///< chunks in the batch
    bool made_progress = false;  ///< a forward ran or outputs were produced
  };
  /// One engine step at time `now`. A forward error fails the batch's requests (their outputs
  /// carry the error) and is returned too.
  Result<StepResult> Step(TimePoint now);
  /// Outputs produced so far (production order), each for one client request id.
  std::vector<RequestOutput> TakeOutputs() { return scheduler_->TakeOutputs(); }
  /// Ids of unfinished client requests.
  std::vector<std::string> RequestIds() const;

  EngineStats Stats() const;
  /// When the connector needs Poll() even with no traffic.
  std::optional<TimePoint> NextDeadline() const;
  /// True when a step could do something without new input: running or admissible work.
  bool HasRunnableWork() const;

  /// Test/debug hook: called after each forward with the batch and its logits
  /// ([batch.num_logit_rows][vocab_size]), before sampling.
  using LogitsObserver = std::function<void(const ScheduledBatch&, std::span<const float>)>;
  void set_logits_observer(LogitsObserver observer) { logits_observer_ = std::move(observer); }

  Scheduler& scheduler() { return *scheduler_; }
  const Scheduler& scheduler() const { return *scheduler_; }
  BlockPool& pool() { return *pool_; }
  const BlockPool& pool() const { return *pool_; }
  /// Rank 0's KV storage (with tensor_parallel_size 1 the whole cache). CPU engines only.
  KvCacheStorage& storage() { return *storages_[0]; }
  /// Rank `rank`'s KV storage (its KV heads of every block; block ids shared by all ranks).
  KvCacheStorage& storage(int rank) { return *storages_.at(rank); }
  int tp_size() const { return static_cast<int>(storages_.size()); }
  /// CPU engines only.
  const TensorParallelModel& tp_model() const { return *tp_model_; }
  /// The GPU model (and its device KV pool) of a config.cuda_device >= 0 engine, else null.
  CudaModel* cuda_model() { return cuda_model_.get(); }
  KvConnector* connector() { return connector_.get(); }
  const Model& model() const { return *model_; }
  const EngineConfig& config() const { return config_; }
  int max_model_len() const { return max_model_len_; }
  /// The clock Step reads once the forward pass is done, so a token's time (TTFT, ITL, the
  /// request's first_token / finished) is when it exists, not when its step began. Unset (the
  /// default, for deterministic drivers): the step's `now`. The threaded Engine sets SteadyNow.
  void set_clock(std::function<TimePoint()> clock) { clock_ = std::move(clock); }

 private:
  EngineCore() = default;
  // Create's halves: the CPU model + host KV storages, then pool/scheduler/connector.
  Status CreateCpuModel(MetricsRegistry* metrics, int64_t* num_blocks, size_t* kv_bytes);
  Status Finish(MetricsRegistry* metrics, std::function<void()> wake, int64_t num_blocks,
                size_t kv_bytes);
  EngineConfig config_;
  std::shared_ptr<const Model> model_;
  int max_model_len_ = 0;
  int vocab_size_ = 0;
  std::unique_ptr<TensorParallelModel> tp_model_;
  std::unique_ptr<CudaModel> cuda_model_;  // config_.cuda_device >= 0: replaces tp_model_/storages_
  std::vector<std::unique_ptr<KvCacheStorage>> storages_;  // one per rank
  std::vector<PagedKvView> kv_views_;                      // storages_[r]->view()
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<KvConnector> connector_;
  std::unique_ptr<Scheduler> scheduler_;
  std::vector<float> logits_;
  LogitsObserver logits_observer_;
  std::function<TimePoint()> clock_;
};

}  // namespace kvbridge
