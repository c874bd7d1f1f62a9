// kvbridge/model/cuda_model.h — the forward pass on one CUDA GPU, KV cache in device memory.
//
// A CudaModel is built FROM a loaded Model (its config, its weights converted to bf16 — exact
// when the checkpoint stored bf16 — and RoPE cos/sin tables built on the host as the CPU model
// builds them, so every RoPE variant the CPU model supports works unchanged), or generated
// straight into device memory from a random-model spec (CreateRandom: the same bits). It owns, in
// device memory: the weights, the paged KV pool (layout of kv_cache_view.h, layers in one
// cudaMalloc), and activation buffers preallocated for `max_num_batched_tokens` rows, so a step
// never allocates device memory.
//
//   ASSIGN_OR_RETURN(std::shared_ptr<Model> cpu, Model::Load("models/small"));
//   ASSIGN_OR_RETURN(auto gpu, CudaModel::Create(cpu, {.device = 0, .num_blocks = 64}));
//   ForwardBatch batch;  // same contract as Model::Forward (forward.h)
//   batch.sequences.push_back({ids.data(), n, 0, table.data(), 1, true});
//   std::vector<float> logits;
//   RETURN_IF_ERROR(gpu->Forward(batch, &logits));  // [1][vocab_size] fp32, on the host
//
// Numerics (docs/gpu.md "The forward pass on the GPU"): our own kernels, no cuBLAS. Matmuls are
// tensor-core mma.sync (bf16 activations x bf16 weights, fp32 accumulation) whose K loop per output
// element is one fixed ascending order of 16-wide steps for every M; o_proj/down_proj sum 8 fixed
// K-shards in the CPU's tree ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)); attention walks 16-position
// chunks aligned to absolute positions with an online softmax, reading every K/V (this step's
// too) back from the paged cache through its dtype; RMSNorm reduces in a fixed tree. So a
// token's logits are bitwise identical whatever else is in the batch, however its prompt was
// chunked or cached. GPU and CPU logits differ (bf16 activations into the matmuls): measured in
// docs/gpu.md. The residual stream, norms, RoPE, softmax and logits are fp32.
//
// Without a CUDA build every factory returns Unimplemented ("built without CUDA"); on a machine
// without a usable GPU, Unavailable ("no CUDA device: ...").
//
// Thread-safety: not thread-safe (one step at a time: the activation buffers are shared).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/status.h"
#include "kvbridge/model/forward.h"

namespace kvbridge {

class Model;
struct RandomModelSpec;  // kvbridge/model/random_model.h

struct CudaModelOptions {
  int device = 0;  ///< CUDA device ordinal
  KvDtype kv_dtype = KvDtype::kBf16;
  int block_size = 16;
  /// KV blocks; 0 = sized from gpu_memory_utilization (CudaKvBlocksForUtilization).
  int64_t num_blocks = 0;
  /// Fraction of the device's total memory for this model's weights + activations + KV pool
  /// (as vLLM's --gpu-memory-utilization, a per-instance share); used when num_blocks is 0.
  double gpu_memory_utilization = 0.9;
  int max_num_batched_tokens = 2048;  ///< most rows (tokens) in one step
  int max_num_seqs = 256;             ///< most sequences in one step (= most logit rows)
  int max_model_len = 0;              ///< longest sequence; 0 = max_position_embeddings
};

/// Device memory a CudaModel holds (bytes).
struct CudaMemoryReport {
  size_t weight_bytes = 0;      ///< bf16 matrices, fp32 norms/biases, RoPE tables
  size_t activation_bytes = 0;  ///< buffers for max_num_batched_tokens rows + staging
  size_t kv_bytes = 0;          ///< the KV pool
  size_t device_total = 0;      ///< cudaMemGetInfo total
  size_t device_free = 0;       ///< cudaMemGetInfo free after Create
};

/// Device memory CudaKvBlocksForUtilization leaves free for the CUDA context, other engines'
/// contexts and the transfer backend's scratch (bytes).
inline constexpr size_t kCudaFreeMargin = size_t{512} << 20;

/// The KV sizing rule, a pure function (unit-tested without a GPU), per instance as vLLM's
/// --gpu-memory-utilization: the KV pool gets utilization * total minus this engine's own
/// weights and activations (`own_static_bytes`), so engines sharing one GPU each take their
/// fraction (4 engines at 0.22 share one GPU); and never more than the device has free after the
/// static allocations minus kCudaFreeMargin (other processes' use counts there). Whole blocks of
/// `bytes_per_block` (all layers). Errors: InvalidArgument (utilization not in (0, 1],
/// bytes_per_block 0), ResourceExhausted naming the numbers when not one block fits.
Result<int64_t> CudaKvBlocksForUtilization(size_t device_total, size_t free_after_static,
                                           size_t own_static_bytes, double utilization,
                                           size_t bytes_per_block);

/// Parses a --device value: "cpu" -> -1, "cuda" -> 0, "cuda:N" -> N. InvalidArgument otherwise.
Result<int> ParseDeviceSpec(std::string_view spec);

/// OK when CUDA device `device` can be used; Unavailable "no CUDA device: ..." (no driver, no
/// GPU, ordinal out of range), Unimplemented without a CUDA build.
Status CudaDeviceAvailable(int device);

class CudaModel {
 public:
  /// Uploads `model` to GPU `options.device` and allocates the KV pool and activations. A
  /// weightless `model` (Model::CreateWeightless) is CreateRandom(*model->weightless_spec()).
  /// Errors: Unimplemented (no CUDA build; a config feature the GPU path lacks), Unavailable (no
  /// usable device), InvalidArgument (bad options), ResourceExhausted naming what did not fit
  /// (weights, activations or the KV pool, with the bytes asked and free).
  static Result<std::unique_ptr<CudaModel>> Create(std::shared_ptr<const Model> model,
                                                   const CudaModelOptions& options);
  /// Generates the random-weight model `spec` (random_model.h) straight into device memory: the
  /// same bf16 bits WriteRandomModel would write (counter-based generator, numerics_hd.h), so
  /// CreateRandom(spec) computes what Create(Model::Load(WriteRandomModel(spec))) computes, bit
  /// for bit, with no host copy of the weights (qwen2.5-7b: 15.2 GB). Errors as Create.
  static Result<std::unique_ptr<CudaModel>> CreateRandom(const RandomModelSpec& spec,
                                                         const CudaModelOptions& options);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  /// One step, contract of Model::Forward (forward.h): validates the whole batch first (nothing
  /// written on error), then per layer writes the chunk tokens' K/V into the device pool, calls
  /// batch.on_layer_kv_written(layer) once that layer's KV writes have completed on the device
  /// (the host waits on the layer's CUDA event after enqueuing the rest of the layer and before
  /// enqueuing layer + 1, so the GPU keeps computing layer `layer` during the call; no wait when
  /// unset), attends from the cache. `logits` gets [sequences with compute_logits][vocab_size]
  /// fp32, batch order. Errors: InvalidArgument as Model::Forward, plus more rows than
  /// max_num_batched_tokens, more sequences than max_num_seqs, or a block table longer than
  /// max_model_len needs; Internal for a CUDA error (the step's KV is then unspecified).
  Status Forward(const ForwardBatch& batch, std::vector<float>* logits);

  /// The device pool: layer_base are device pointers (cudaMalloc, 256-byte aligned), scales are
  /// the model's fp8 scales (1.0 unless fp8). The layout is PagedKvLayout's.
  const PagedKvView& kv_view() const;
  /// Copies block `src` to `dst` in every layer (copy-on-write), synchronously.
  Status CopyBlock(int32_t src, int32_t dst);
  /// XORs byte `offset` of layer `layer`'s region with `mask`, synchronously (debug: a corrupted
  /// block). InvalidArgument outside the pool.
  Status XorKvByte(int layer, size_t offset, uint8_t mask);
  /// Fills the whole pool with `byte` (0xFF = NaN for bf16/fp32 and fp8 e4m3), synchronously.
  Status FillKv(uint8_t byte);
  /// Copies layer `layer`'s whole region to/from the host (LayerBytes()).
  Status ReadKvLayer(int layer, std::vector<uint8_t>* bytes) const;
  Status WriteKvLayer(int layer, const std::vector<uint8_t>& bytes);

  /// Benchmarks: while on, Forward records a CUDA event after every stage of the step and adds
  /// each stage's device time to StageTimes() (by kind: "qkv_proj", "attention", ...; ms summed
  /// over the steps since the last ResetStageTimes). Costs a little; off by default.
  void SetStageTiming(bool on);
  std::vector<std::pair<std::string, double>> StageTimes() const;
  void ResetStageTimes();

  /// The cudaEvent_t (as void*) recorded after layer `layer`'s KV writes of the last Forward.
  void* layer_kv_event(int layer) const;
  const CudaMemoryReport& memory() const;
  /// cudaMemGetInfo free bytes now (for the no-growth checks).
  Result<size_t> DeviceFreeBytes() const;
  int device() const;
  /// e.g. "NVIDIA H200 (sm_90, 132 SMs, 143771 MiB)".
  const std::string& device_name() const;
  const CudaModelOptions& options() const;

  struct Impl;

 private:
  explicit CudaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge
