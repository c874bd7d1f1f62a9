#include "kvbridge/engine/engine_core.h"

#include <algorithm>
#include <string>

#include "kvbridge/common/logging.h"
#include "kvbridge/model/model.h"
#include "kvbridge/model/tensor_parallel.h"

namespace kvbridge {

Result<std::unique_ptr<EngineCore>> EngineCore::Create(const EngineConfig& config,
                                                       std::shared_ptr<const Model> model,
                                                       MetricsRegistry* metrics,
                                                       std::function<void()> wake) {
  if (model == nullptr) return InvalidArgumentError("engine: no model");
  if (config.block_size <= 0 || config.block_size > 1024) {
    return InvalidArgumentError("engine: block_size must be in [1, 1024]");
  }
  if (config.max_num_seqs <= 0) return InvalidArgumentError("engine: max_num_seqs must be > 0");
  if (config.max_num_batched_tokens <= 0) {
    return InvalidArgumentError("engine: max_num_batched_tokens must be > 0");
  }
  if (config.num_blocks < 0) return InvalidArgumentError("engine: num_blocks must be >= 0");
  const ModelConfig& mc = model->config();
  for (int32_t e : config.eos_token_ids.value_or(std::vector<int32_t>{})) {
    if (e < 0 || e >= mc.vocab_size) {
      return InvalidArgumentError("engine: eos_token_id " + std::to_string(e) +
                                  " outside the vocabulary [0, " + std::to_string(mc.vocab_size) +
                                  ")");
    }
  }
  int max_len = config.max_model_len == 0 ? mc.max_position_embeddings : config.max_model_len;
  if (max_len <= 1 || max_len > mc.max_position_embeddings) {
    return InvalidArgumentError("engine: max_model_len " + std::to_string(max_len) +
                                " must be in [2, " + std::to_string(mc.max_position_embeddings) +
                                "] (the model's max_position_embeddings)");
  }

  const int tp = config.tensor_parallel_size;
  RETURN_IF_ERROR(ValidateTensorParallelSize(mc, tp).WithPrefix("engine"));

  std::unique_ptr<EngineCore> core(new EngineCore());
  core->config_ = config;
  core->model_ = model;
  core->max_model_len_ = max_len;
  core->vocab_size_ = mc.vocab_size;

  int64_t num_blocks = config.num_blocks;
  size_t kv_bytes = 0;
  if (config.cuda_device >= 0) {
    // The GPU engine: CudaModel owns weights, activations and the KV pool in device memory.
    if (tp != 1) {
      return InvalidArgumentError("engine: --device cuda runs tensor_parallel_size 1 only (got " +
                                  std::to_string(tp) + ")");
    }
    ASSIGN_OR_RETURN(
        core->cuda_model_,
        CudaModel::Create(model, {.device = config.cuda_device,
                                  .kv_dtype = config.kv_dtype,
                                  .block_size = config.block_size,
                                  .num_blocks = config.num_blocks,
                                  .gpu_memory_utilization = config.gpu_memory_utilization,
                                  .max_num_batched_tokens = config.max_num_batched_tokens,
                                  .max_num_seqs = config.max_num_seqs,
                                  .max_model_len = max_len}));
    if (config.debug_poison_kv_nan) RETURN_IF_ERROR(core->cuda_model_->FillKv(0xFF));
    num_blocks = core->cuda_model_->kv_view().layout.num_blocks;
    kv_bytes = core->cuda_model_->memory().kv_bytes;
    const CudaMemoryReport& mr = core->cuda_model_->memory();
    KVB_LOG_INFO(
        "engine: GPU {} {}: weights {} MiB, activations {} MiB, KV {} MiB; {} MiB free of {} MiB",
        config.cuda_device, core->cuda_model_->device_name(), mr.weight_bytes >> 20,
        mr.activation_bytes >> 20, mr.kv_bytes >> 20, mr.device_free >> 20, mr.device_total >> 20);
  } else {
    RETURN_IF_ERROR(core->CreateCpuModel(metrics, &num_blocks, &kv_bytes));
  }
  RETURN_IF_ERROR(core->Finish(metrics, std::move(wake), num_blocks, kv_bytes));
  return core;
}

Status EngineCore::CreateCpuModel(MetricsRegistry* metrics, int64_t* num_blocks_out,
                                  size_t* kv_bytes_out) {
  EngineCore* core = this;
  const EngineConfig& config = config_;
  const std::shared_ptr<const Model>& model = model_;
  const int tp = config.tensor_parallel_size;
  ASSIGN_OR_RETURN(core->tp_model_, TensorParallelModel::Create(model, tp));
  // kv_cache_memory_bytes covers every rank's storage: one block costs the sum of its ranks'
  // bytes (more than T=1's when KV heads are replicated).
  PagedKvLayout budget_layout = model->KvLayout(1, config.block_size, config.kv_dtype);
  budget_layout.num_kv_heads = 0;
  for (int r = 0; r < tp; ++r) budget_layout.num_kv_heads += core->tp_model_->kv_heads(r).size();
  int64_t num_blocks = config.num_blocks;
  if (num_blocks == 0) {
    ASSIGN_OR_RETURN(num_blocks,
                     KvCacheStorage::BlocksForBudget(budget_layout, config.kv_cache_memory_bytes));
  }
  if (num_blocks >= (int64_t{1} << 31)) return InvalidArgumentError("engine: too many blocks");
  // One storage (memfd) per rank, all indexed by the same block ids.
  size_t kv_bytes = 0;
  for (int r = 0; r < tp; ++r) {
    PagedKvLayout layout = core->tp_model_->KvLayout(r, static_cast<int>(num_blocks),
                                                     config.block_size, config.kv_dtype);
    ASSIGN_OR_RETURN(std::unique_ptr<KvCacheStorage> storage, KvCacheStorage::Create(layout));
    model->KvScales(config.kv_dtype, &storage->mutable_view().k_scale,
                    &storage->mutable_view().v_scale);
    if (config.debug_poison_kv_nan) storage->FillNaN();
    kv_bytes += storage->TotalBytes();
    core->kv_views_.push_back(storage->view());
    core->storages_.push_back(std::move(storage));
  }
  for (int r = 0; r < tp; ++r) {
    const size_t bytes = core->tp_model_->RankWeightBytes(r);
    if (tp > 1) {
      KVB_LOG_INFO("engine: TP rank {}/{}: {} weight bytes ({:.2f} MiB), KV heads [{}, {})", r, tp,
                   bytes, bytes / 1048576.0, core->tp_model_->kv_heads(r).begin,
                   core->tp_model_->kv_heads(r).end);
    }
    if (metrics != nullptr) {
      metrics
          ->AddGauge("kvbridge_tp_rank_weight_bytes",
                     "Bytes of the weights one tensor-parallel rank computes with (its slices of "
                     "q/k/v/o and gate/up/down in their resident type, viewed in place in the "
                     "model's weights; replicated embeddings, norms and lm_head not counted).",
                     "rank=\"" + std::to_string(r) + "\"")
          .Set(static_cast<double>(bytes));
    }
  }
  if (tp > 1) {
    KVB_LOG_INFO("engine: TP {}: {} replicated weight bytes shared by all ranks", tp,
                 core->tp_model_->ReplicatedWeightBytes());
  }
  *num_blocks_out = num_blocks;
  *kv_bytes_out = kv_bytes;
  return OkStatus();
}

Status EngineCore::Finish(MetricsRegistry* metrics, std::function<void()> wake, int64_t num_blocks,
                          size_t kv_bytes) {
  EngineCore* core = this;
  const EngineConfig& config = config_;
  const std::shared_ptr<const Model>& model = model_;
  const ModelConfig& mc = model->config();
  const int tp = config.tensor_parallel_size;
  const int max_len = max_model_len_;
  ASSIGN_OR_RETURN(core->pool_,
                   BlockPool::Create({.num_blocks = num_blocks,
                                      .block_size = config.block_size,
                                      .enable_prefix_caching = config.enable_prefix_caching}));
  core->pool_->set_cache_listener(config.kv_cache_listener.get());

  SchedulerConfig sc;
  sc.max_num_seqs = config.max_num_seqs;
  sc.max_num_batched_tokens = config.max_num_batched_tokens;
  sc.max_model_len = max_len;
  sc.vocab_size = mc.vocab_size;
  if (config.eos_token_ids) {
    sc.eos_token_ids = *config.eos_token_ids;
  } else {
    for (int e : mc.eos_token_ids) sc.eos_token_ids.push_back(e);
  }
  const int tok_eos = model->tokenizer().eos_id();
  sc.tokenizer_eos_token_id = tok_eos;
  if (tok_eos >= 0 && std::find(sc.eos_token_ids.begin(), sc.eos_token_ids.end(), tok_eos) ==
                          sc.eos_token_ids.end()) {
    sc.eos_token_ids.push_back(tok_eos);
  }
  sc.model_fingerprint = model->fingerprint();
  sc.default_seed = config.seed;
  sc.served_model_name = config.served_model_name;
  sc.tokenizer = model->tokenizer();
  core->scheduler_ =
      std::make_unique<Scheduler>(std::move(sc), core->pool_.get(), nullptr, metrics);

  if (config.connector_factory && core->cuda_model_ != nullptr) {
    // The GPU engine: one rank, its KV pool in device memory (moved by cuda_ipc).
    EngineHooks hooks;
    hooks.kv_view = core->cuda_model_->kv_view();
    hooks.kv_cuda_device = core->cuda_model_->device();
    CudaModel* gpu = core->cuda_model_.get();
    hooks.kv_xor_byte = [gpu](int layer, size_t offset, uint8_t mask) {
      return gpu->XorKvByte(layer, offset, mask);
    };
    hooks.model_fingerprint = model->fingerprint();
    hooks.metrics = metrics;
    hooks.tp_size = 1;
    KvRankHooks& rh = hooks.ranks.emplace_back();
    rh.kv_view = hooks.kv_view;
    rh.kv_head_begin = 0;
    rh.kv_head_end = mc.num_key_value_heads;
    hooks.wake = wake ? std::move(wake) : std::function<void()>([] {});
    ASSIGN_OR_RETURN(core->connector_, config.connector_factory(hooks));
    if (core->connector_ == nullptr)
      return InvalidArgumentError("engine: connector factory returned null");
    core->scheduler_->set_connector(core->connector_.get());
  } else if (config.connector_factory) {
    EngineHooks hooks;
    hooks.kv_view = core->storages_[0]->view();
    hooks.model_fingerprint = model->fingerprint();
    hooks.metrics = metrics;
    hooks.kv_shm_fd = core->storages_[0]->shm_fd();
    if (hooks.kv_shm_fd >= 0) hooks.kv_layer_offsets = core->storages_[0]->layer_offsets();
    hooks.tp_size = tp;
    for (int r = 0; r < tp; ++r) {
      const KvCacheStorage& st = *core->storages_[r];
      KvRankHooks& rh = hooks.ranks.emplace_back();
      rh.rank = r;
      rh.kv_view = st.view();
      rh.kv_head_begin = core->tp_model_->kv_heads(r).begin;
      rh.kv_head_end = core->tp_model_->kv_heads(r).end;
      rh.kv_shm_fd = st.shm_fd();
      if (rh.kv_shm_fd >= 0) rh.kv_layer_offsets = st.layer_offsets();
    }
    hooks.wake = wake ? std::move(wake) : std::function<void()>([] {});
    ASSIGN_OR_RETURN(core->connector_, config.connector_factory(hooks));
    if (core->connector_ == nullptr)
      return InvalidArgumentError("engine: connector factory returned null");
    core->scheduler_->set_connector(core->connector_.get());
  }
  KVB_LOG_INFO(
      "engine: {} KV blocks of {} tokens ({} MiB over {} rank(s), {}), max_model_len {}, prefix "
      "caching {}",
      num_blocks, config.block_size, kv_bytes >> 20, tp,
      config.cuda_device >= 0 ? "GPU " + std::to_string(config.cuda_device) : std::string("host"),
      max_len, config.enable_prefix_caching ? "on" : "off");
  return OkStatus();
}

EngineCore::~EngineCore() {
  // The connector may reference the pool's memory: drop it first.
  if (scheduler_) scheduler_->set_connector(nullptr);
  connector_.reset();
}

Status EngineCore::ValidateRequest(const EngineRequest& request) const {
  return scheduler_->ValidateRequest(request);
}

Status EngineCore::AddRequest(EngineRequest request, TimePoint now) {
  return scheduler_->AddRequest(std::move(request), now);
}

bool EngineCore::Abort(const std::string& request_id, TimePoint now) {
  return scheduler_->Abort(request_id, now);
}

std::vector<std::string> EngineCore::RequestIds() const { return scheduler_->RequestIds(); }

Result<EngineCore::StepResult> EngineCore::Step(TimePoint now) {
  StepResult r;
  scheduler_->PollConnector(now);
  ScheduledBatch batch = scheduler_->Schedule(now);
  if (batch.empty()) {
    r.made_progress = false;
    return r;
  }
  for (auto [src, dst] : batch.block_copies) {
    for (auto& storage : storages_) storage->CopyBlock(src, dst);
    if (cuda_model_ != nullptr) {
      Status cs = cuda_model_->CopyBlock(src, dst);
      if (!cs.ok()) {
        scheduler_->FailBatch(batch, cs, now);
        return cs;
      }
    }
  }
  ForwardBatch fb = batch.ToForwardBatch();
  std::vector<KvConnector::LayerKvChunk> layer_chunks;
  if (connector_ != nullptr && connector_->WantsLayerKvWritten()) {
    for (const ScheduledChunk& c : batch.chunks) {
      layer_chunks.push_back(
          {.request_id = c.request_id,
           .block_ids = std::span<const int32_t>(c.block_table, static_cast<size_t>(c.num_blocks)),
           .end_pos = c.start_pos + c.num_tokens,
           .completes_tokens = c.compute_logits});
    }
    fb.on_layer_kv_written = [this, &layer_chunks, now](int layer) {
      connector_->OnLayerKvWritten(layer, layer_chunks, now);
    };
  }
  Status st = cuda_model_ != nullptr ? cuda_model_->Forward(fb, &logits_)
                                     : tp_model_->Forward(fb, kv_views_, &logits_);
  if (!st.ok()) {
    KVB_LOG_ERROR("engine: forward failed: {}", st.ToString());
    scheduler_->FailBatch(batch, st, now);
    return st;
  }
  if (logits_observer_) logits_observer_(batch, logits_);
  RETURN_IF_ERROR(scheduler_->UpdateFromOutput(batch, logits_, clock_ ? clock_() : now));
  r.num_tokens = batch.num_tokens;
  r.num_sequences = static_cast<int>(batch.chunks.size());
  r.made_progress = true;
  return r;
}

EngineStats EngineCore::Stats() const {
  EngineStats s;
  s.running = scheduler_->num_running();
  s.waiting = scheduler_->num_waiting();
  s.waiting_for_remote_kv = scheduler_->num_waiting_for_remote();
  s.kv_blocks_total = pool_->num_blocks();
  s.kv_blocks_active = pool_->NumActive();
  s.kv_blocks_held_for_transfer = pool_->NumHeld();
  s.kv_blocks_cached_free = pool_->NumCachedFree();
  s.kv_blocks_free = pool_->NumFree();
  return s;
}

std::optional<TimePoint> EngineCore::NextDeadline() const {
  if (connector_ == nullptr) return std::nullopt;
  return connector_->NextDeadline();
}

bool EngineCore::HasRunnableWork() const {
  return scheduler_->num_running() > 0 || scheduler_->num_waiting() > 0;
}

}  // namespace kvbridge
