// CudaModel (kvbridge/model/cuda_model.h): device memory, uploads and the step's launch
// sequence. The kernels are in cuda_kernels.cu; the CPU-side planning in cuda_plan.cc.
#include "kvbridge/model/cuda_model.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>

#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "model/cuda/cuda_kernels.h"
#include "model/cuda/cuda_plan.h"
#include "model/model_impl.h"
#include "model/numerics.h"
#include "model/random_model_internal.h"
#include "model/rope.h"

namespace kvbridge {

using cuda_internal::AlignUp256;

namespace {

std::string Mib(size_t bytes) {
  char s[32];
  std::snprintf(s, sizeof(s), "%.1f MiB", static_cast<double>(bytes) / 1048576.0);
  return s;
}

Status CudaError(cudaError_t e, const std::string& what) {
  return InternalError(what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

#define KVB_CUDA_RETURN(expr, what)                                                   \
  do {                                                                                \
    const cudaError_t kvb_e = (expr);                                                 \
    if (kvb_e != cudaSuccess) {                                                       \
      cudaGetLastError(); /* a later call's cudaGetLastError must not see it again */ \
      return CudaError(kvb_e, what);                                                  \
    }                                                                                 \
  } while (0)

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = model_internal::FloatToBf16(v[i]);
  return out;
}

// One device allocation carved into 256-byte aligned pieces.
class Arena {
 public:
  void Reserve(size_t bytes) { size_ += AlignUp256(bytes); }
  size_t size() const { return size_; }
  Status Allocate(const std::string& what, int device) {
    if (size_ == 0) return OkStatus();
    const cudaError_t e = cudaMalloc(&base_, size_);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      base_ = nullptr;
      return ResourceExhaustedError(what + " (" + Mib(size_) + ") do not fit on GPU " +
                                    std::to_string(device) + ": " + Mib(free_b) + " free of " +
                                    Mib(total_b) + " (" + cudaGetErrorString(e) + ")");
    }
    return OkStatus();
  }
  template <class T>
  T* Take(size_t bytes) {
    T* p = reinterpret_cast<T*>(static_cast<uint8_t*>(base_) + used_);
    used_ += AlignUp256(bytes);
    return p;
  }
  ~Arena() {
    if (base_ != nullptr) cudaFree(base_);
  }

 private:
  void* base_ = nullptr;
  size_t size_ = 0, used_ = 0;
};

}  // namespace

Status CudaDeviceAvailable(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return UnavailableError(std::string("no CUDA device: ") + cudaGetErrorString(e));
  }
  if (count == 0) return UnavailableError("no CUDA device: none found");
  if (device < 0 || device >= count) {
    return UnavailableError("no CUDA device " + std::to_string(device) + ": this machine has " +
                            std::to_string(count));
  }
  return OkStatus();
}

struct CudaModel::Impl {
  std::shared_ptr<const Model> model;  // Create: the host model the weights come from
  bool random = false;                 // CreateRandom: generated on the device from `seed`
  uint64_t seed = 0;
  ModelConfig c;
  CudaModelOptions opt;
  std::string device_name;
  cuda_internal::StepLimits limits;
  CudaMemoryReport mem;
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;

  Arena weight_arena, act_arena, kv_arena;
  int32_t* host_meta = nullptr;
  float* host_logits = nullptr;

  struct Layer {
    float* in_norm = nullptr;
    float* q_norm = nullptr;  // [head_dim] (Qwen3) or null
    float* k_norm = nullptr;
    uint16_t* wqkv = nullptr;  // [q_dim + 2 kv_dim][hidden]
    float* bqkv = nullptr;     // [q_dim + 2 kv_dim] or null
    uint16_t* wo = nullptr;    // [hidden][q_dim]
    float* bo = nullptr;
    float* post_norm = nullptr;
    uint16_t* wgu = nullptr;    // [2 intermediate][hidden]: gate rows, then up rows
    uint16_t* wdown = nullptr;  // [hidden][intermediate]
  };
  std::vector<Layer> layers;
  uint16_t* embed = nullptr;
  uint16_t* lm_head = nullptr;
  float* final_norm = nullptr;
  float* rope_cos = nullptr;
  float* rope_sin = nullptr;

  float* x = nullptr;
  uint16_t* hb = nullptr;
  float* qkv = nullptr;
  uint16_t* attn = nullptr;
  float* partial = nullptr;
  float* gu = nullptr;
  uint16_t* act = nullptr;
  float* logits = nullptr;
  int32_t* meta = nullptr;
  float* attn_scratch = nullptr;
  size_t attn_scratch_floats = 0;

  PagedKvView view;
  cuda_internal::KvParams kvp;

  // Stage timing (SetStageTiming): an event after each stage of a step.
  bool timing = false;
  std::vector<cudaEvent_t> timing_events;
  std::vector<const char*> timing_stage;  // the stage that ends at timing_events[i]
  std::vector<std::pair<std::string, double>> stage_ms;
  int timing_used = 0;
  Status Mark(const char* stage) {
    if (!timing) return OkStatus();
    if (timing_used == static_cast<int>(timing_events.size())) {
      timing_events.push_back(nullptr);
      timing_stage.push_back(nullptr);
      KVB_CUDA_RETURN(cudaEventCreate(&timing_events.back()), "cudaEventCreate");
    }
    timing_stage[timing_used] = stage;
    KVB_CUDA_RETURN(cudaEventRecord(timing_events[timing_used], stream), "cudaEventRecord");
    ++timing_used;
    return OkStatus();
  }
  void CollectTiming() {  // after the step synchronized
    for (int i = 1; i < timing_used; ++i) {
      float ms = 0.0f;
      if (cudaEventElapsedTime(&ms, timing_events[i - 1], timing_events[i]) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      auto it = std::find_if(stage_ms.begin(), stage_ms.end(),
                             [&](const auto& p) { return p.first == timing_stage[i]; });
      if (it == stage_ms.end()) {
        stage_ms.emplace_back(timing_stage[i], ms);
      } else {
        it->second += ms;
      }
    }
    timing_used = 0;
  }

  ~Impl() {
    cudaSetDevice(opt.device);  // the engine may drop it on another thread
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (cudaEvent_t e : timing_events) cudaEventDestroy(e);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (host_meta != nullptr) cudaFreeHost(host_meta);
    if (host_logits != nullptr) cudaFreeHost(host_logits);
  }

  Status Upload(void* dst, const void* src, size_t bytes) {
    KVB_CUDA_RETURN(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "weight upload");
    return OkStatus();
  }
  // Uploads matrices back to back as bf16 (exact for bf16-resident weights; fp16/fp32 ones
  // are rounded to nearest even).
  Status UploadBf16(uint16_t* dst, std::initializer_list<const model_internal::Matrix*> ms) {
    for (const model_internal::Matrix* m : ms) {
      const std::vector<uint16_t> h = ToBf16(m->ToFloat32());
      RETURN_IF_ERROR(Upload(dst, h.data(), h.size() * 2));
      dst += h.size();
    }
    return OkStatus();
  }

  Status Init();
  Status Forward(const ForwardBatch& batch, std::vector<float>* logits_out);
};

Status CudaModel::Impl::Init() {
  const int dev = opt.device;
  KVB_CUDA_RETURN(cudaSetDevice(dev), "cudaSetDevice");
  cudaDeviceProp prop{};
  KVB_CUDA_RETURN(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  if (prop.major < 8) {
    return UnimplementedError(std::string("GPU ") + prop.name + " is sm_" +
                              std::to_string(prop.major) + std::to_string(prop.minor) +
                              ": the kernels need bf16 tensor cores (sm_80 or newer)");
  }
  {
    char s[96];
    std::snprintf(s, sizeof(s), " (sm_%d%d, %d SMs, %zu MiB)", prop.major, prop.minor,
                  prop.multiProcessorCount, prop.totalGlobalMem >> 20);
    device_name = std::string(prop.name) + s;
  }
  const int hsz = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), im = c.intermediate_size;
  const int nqkv = qd + 2 * kvd;
  const int max_len = opt.max_model_len == 0 ? c.max_position_embeddings : opt.max_model_len;
  if (opt.block_size <= 0 || opt.block_size > 1024 || opt.max_num_batched_tokens <= 0 ||
      opt.max_num_seqs <= 0 || max_len <= 0 || max_len > c.max_position_embeddings ||
      opt.num_blocks < 0 || opt.num_blocks >= (int64_t{1} << 31)) {
    return InvalidArgumentError(
        "CudaModel: block_size must be in [1, 1024], max_num_batched_tokens and max_num_seqs > "
        "0, max_model_len in [1, max_position_embeddings], num_blocks in [0, 2^31)");
  }
  ASSIGN_OR_RETURN(
      cuda_internal::AttentionPlan ap,
      cuda_internal::PlanAttention(1, c.num_attention_heads, c.num_key_value_heads, c.head_dim));
  (void)ap;
  {
    const size_t smem = cuda_internal::AttentionSmemBytes(
        c.head_dim, static_cast<int>(opt.kv_dtype), c.num_attention_heads / c.num_key_value_heads);
    if (c.head_dim % 4 != 0 ||
        smem > std::min<size_t>(cuda_internal::kAttentionMaxSmem, prop.sharedMemPerBlockOptin)) {
      return UnimplementedError(
          "CudaModel: attention for head_dim " + std::to_string(c.head_dim) + ", " +
          std::to_string(c.num_attention_heads / c.num_key_value_heads) +
          " query heads per KV head and KV " + std::string(KvDtypeName(opt.kv_dtype)) + " needs " +
          std::to_string(smem) + " bytes of shared memory per block (and head_dim % 4 == 0); GPU " +
          std::to_string(opt.device) + " allows " + std::to_string(prop.sharedMemPerBlockOptin));
    }
  }
  limits.max_rows = opt.max_num_batched_tokens;
  limits.max_seqs = opt.max_num_seqs;
  limits.max_table_blocks = opt.max_num_seqs * cuda_internal::BlocksFor(max_len, opt.block_size);
  limits.max_len = max_len;

  KVB_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  // ---- weights: uploaded from the host model, or generated on the device (CreateRandom) ----
  const model_internal::Weights* w = random ? nullptr : &model->impl().weights;
  std::vector<float> cos_table, sin_table;
  model_internal::BuildRopeTables(c, &cos_table, &sin_table);
  const size_t half = static_cast<size_t>(c.head_dim / 2);
  const size_t vocab_elems = static_cast<size_t>(c.vocab_size) * hsz;
  weight_arena.Reserve(vocab_elems * 2);
  if (!c.tie_word_embeddings) weight_arena.Reserve(vocab_elems * 2);
  weight_arena.Reserve(hsz * 4);  // final norm
  weight_arena.Reserve(cos_table.size() * 4);
  weight_arena.Reserve(sin_table.size() * 4);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    weight_arena.Reserve(hsz * 4);
    if (c.qk_norm) {
      weight_arena.Reserve(c.head_dim * 4);
      weight_arena.Reserve(c.head_dim * 4);
    }
    weight_arena.Reserve(static_cast<size_t>(nqkv) * hsz * 2);
    if (c.qkv_bias) weight_arena.Reserve(nqkv * 4);
    weight_arena.Reserve(static_cast<size_t>(hsz) * qd * 2);
    if (c.o_bias) weight_arena.Reserve(hsz * 4);
    weight_arena.Reserve(hsz * 4);
    weight_arena.Reserve(2 * static_cast<size_t>(im) * hsz * 2);
    weight_arena.Reserve(static_cast<size_t>(hsz) * im * 2);
  }
  RETURN_IF_ERROR(weight_arena.Allocate("weights", dev));
  // One matrix [rows][cols] (bf16) / one vector [n] (fp32) named as in the checkpoint.
  const auto mat = [&](uint16_t* dst, const std::string& name, const model_internal::Matrix* hm,
                       int64_t rows, int64_t cols) -> Status {
    if (random) {
      const model_internal::RandomTensorGen g =
          model_internal::RandomTensorParams(seed, name, {rows, cols});
      cuda_internal::LaunchRandomBf16(dst, static_cast<size_t>(rows) * cols, g.state0, g.offset,
                                      g.a, stream);
      return OkStatus();
    }
    if (hm->rows != rows || hm->cols != cols) return InternalError("CudaModel: shape of " + name);
    return UploadBf16(dst, {hm});
  };
  const auto vec = [&](float* dst, const std::string& name, const std::vector<float>* hv,
                       int64_t n) -> Status {
    if (random) {
      const model_internal::RandomTensorGen g = model_internal::RandomTensorParams(seed, name, {n});
      cuda_internal::LaunchRandomF32(dst, static_cast<size_t>(n), g.state0, g.offset, g.a, stream);
      return OkStatus();
    }
    if (static_cast<int64_t>(hv->size()) != n) return InternalError("CudaModel: size of " + name);
    return Upload(dst, hv->data(), n * 4);
  };
  embed = weight_arena.Take<uint16_t>(vocab_elems * 2);
  RETURN_IF_ERROR(
      mat(embed, "model.embed_tokens.weight", w ? &w->embed : nullptr, c.vocab_size, hsz));
  if (c.tie_word_embeddings) {
    lm_head = embed;
  } else {
    lm_head = weight_arena.Take<uint16_t>(vocab_elems * 2);
    RETURN_IF_ERROR(mat(lm_head, "lm_head.weight", w ? &w->lm_head : nullptr, c.vocab_size, hsz));
  }
  final_norm = weight_arena.Take<float>(hsz * 4);
  RETURN_IF_ERROR(vec(final_norm, "model.norm.weight", w ? &w->final_norm : nullptr, hsz));
  if (cos_table.size() != static_cast<size_t>(c.max_position_embeddings) * half) {
    return InternalError("CudaModel: unexpected RoPE table size");
  }
  rope_cos = weight_arena.Take<float>(cos_table.size() * 4);
  rope_sin = weight_arena.Take<float>(sin_table.size() * 4);
  RETURN_IF_ERROR(Upload(rope_cos, cos_table.data(), cos_table.size() * 4));
  RETURN_IF_ERROR(Upload(rope_sin, sin_table.data(), sin_table.size() * 4));
  layers.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const model_internal::LayerWeights* lw = w ? &w->layers[l] : nullptr;
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer& d = layers[l];
    d.in_norm = weight_arena.Take<float>(hsz * 4);
    RETURN_IF_ERROR(
        vec(d.in_norm, p + "input_layernorm.weight", lw ? &lw->input_norm : nullptr, hsz));
    if (c.qk_norm) {
      d.q_norm = weight_arena.Take<float>(c.head_dim * 4);
      d.k_norm = weight_arena.Take<float>(c.head_dim * 4);
      RETURN_IF_ERROR(
          vec(d.q_norm, p + "self_attn.q_norm.weight", lw ? &lw->q_norm : nullptr, c.head_dim));
      RETURN_IF_ERROR(
          vec(d.k_norm, p + "self_attn.k_norm.weight", lw ? &lw->k_norm : nullptr, c.head_dim));
    }
    d.wqkv = weight_arena.Take<uint16_t>(static_cast<size_t>(nqkv) * hsz * 2);
    RETURN_IF_ERROR(mat(d.wqkv, p + "self_attn.q_proj.weight", lw ? &lw->wq : nullptr, qd, hsz));
    RETURN_IF_ERROR(mat(d.wqkv + static_cast<size_t>(qd) * hsz, p + "self_attn.k_proj.weight",
                        lw ? &lw->wk : nullptr, kvd, hsz));
    RETURN_IF_ERROR(mat(d.wqkv + static_cast<size_t>(qd + kvd) * hsz, p + "self_attn.v_proj.weight",
                        lw ? &lw->wv : nullptr, kvd, hsz));
    if (c.qkv_bias) {
      d.bqkv = weight_arena.Take<float>(nqkv * 4);
      RETURN_IF_ERROR(vec(d.bqkv, p + "self_attn.q_proj.bias", lw ? &lw->bq : nullptr, qd));
      RETURN_IF_ERROR(vec(d.bqkv + qd, p + "self_attn.k_proj.bias", lw ? &lw->bk : nullptr, kvd));
      RETURN_IF_ERROR(
          vec(d.bqkv + qd + kvd, p + "self_attn.v_proj.bias", lw ? &lw->bv : nullptr, kvd));
    }
    d.wo = weight_arena.Take<uint16_t>(static_cast<size_t>(hsz) * qd * 2);
    RETURN_IF_ERROR(mat(d.wo, p + "self_attn.o_proj.weight", lw ? &lw->wo : nullptr, hsz, qd));
    if (c.o_bias) {
      d.bo = weight_arena.Take<float>(hsz * 4);
      RETURN_IF_ERROR(vec(d.bo, p + "self_attn.o_proj.bias", lw ? &lw->bo : nullptr, hsz));
    }
    d.post_norm = weight_arena.Take<float>(hsz * 4);
    RETURN_IF_ERROR(vec(d.post_norm, p + "post_attention_layernorm.weight",
                        lw ? &lw->post_norm : nullptr, hsz));
    d.wgu = weight_arena.Take<uint16_t>(2 * static_cast<size_t>(im) * hsz * 2);
    RETURN_IF_ERROR(mat(d.wgu, p + "mlp.gate_proj.weight", lw ? &lw->w_gate : nullptr, im, hsz));
    RETURN_IF_ERROR(mat(d.wgu + static_cast<size_t>(im) * hsz, p + "mlp.up_proj.weight",
                        lw ? &lw->w_up : nullptr, im, hsz));
    d.wdown = weight_arena.Take<uint16_t>(static_cast<size_t>(hsz) * im * 2);
    RETURN_IF_ERROR(mat(d.wdown, p + "mlp.down_proj.weight", lw ? &lw->w_down : nullptr, hsz, im));
  }
  KVB_CUDA_RETURN(cudaGetLastError(), "weight generation launch");
  KVB_CUDA_RETURN(cudaStreamSynchronize(stream), "weight generation");
  mem.weight_bytes = weight_arena.size();

  // ---- activations (for max_num_batched_tokens rows) ----
  const cuda_internal::ActivationSizes as = cuda_internal::ActivationBytes(c, limits);
  act_arena.Reserve(as.Total());
  RETURN_IF_ERROR(act_arena.Allocate("activations for max_num_batched_tokens " +
                                         std::to_string(limits.max_rows) + " and max_num_seqs " +
                                         std::to_string(limits.max_seqs),
                                     dev));
  x = act_arena.Take<float>(as.x);
  hb = act_arena.Take<uint16_t>(as.hb);
  qkv = act_arena.Take<float>(as.qkv);
  attn = act_arena.Take<uint16_t>(as.attn);
  partial = act_arena.Take<float>(as.partial);
  gu = act_arena.Take<float>(as.gu);
  act = act_arena.Take<uint16_t>(as.act);
  logits = act_arena.Take<float>(as.logits);
  meta = act_arena.Take<int32_t>(as.meta);
  attn_scratch = as.attn_scratch > 0 ? act_arena.Take<float>(as.attn_scratch) : nullptr;
  attn_scratch_floats = as.attn_scratch / sizeof(float);
  mem.activation_bytes = act_arena.size();
  {
    const cudaError_t e1 = cudaMallocHost(reinterpret_cast<void**>(&host_meta), as.meta);
    const cudaError_t e2 = cudaMallocHost(reinterpret_cast<void**>(&host_logits),
                                          static_cast<size_t>(limits.max_seqs) * c.vocab_size * 4);
    if (e1 != cudaSuccess || e2 != cudaSuccess) {
      return ResourceExhaustedError("pinned host staging buffers (" + Mib(as.meta + as.logits) +
                                    ") could not be allocated");
    }
  }
  events.resize(c.num_hidden_layers, nullptr);
  for (cudaEvent_t& e : events) {
    KVB_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  }

  // ---- KV pool ----
  PagedKvLayout layout;
  layout.num_layers = c.num_hidden_layers;
  layout.num_kv_heads = c.num_key_value_heads;
  layout.head_dim = c.head_dim;
  layout.block_size = opt.block_size;
  layout.num_blocks = 0;
  layout.dtype = opt.kv_dtype;
  const size_t per_block = layout.BlockBytes() * static_cast<size_t>(c.num_hidden_layers);
  int64_t blocks = opt.num_blocks;
  size_t free_b = 0, total_b = 0;
  KVB_CUDA_RETURN(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  if (blocks == 0) {
    // Leave the per-layer alignment slack out of the budget.
    const size_t slack = static_cast<size_t>(c.num_hidden_layers) * 256;
    ASSIGN_OR_RETURN(blocks,
                     CudaKvBlocksForUtilization(total_b, free_b > slack ? free_b - slack : 0,
                                                mem.weight_bytes + mem.activation_bytes + slack,
                                                opt.gpu_memory_utilization, per_block));
    blocks = std::min<int64_t>(blocks, (int64_t{1} << 31) - 1);
  }
  layout.num_blocks = static_cast<int>(blocks);
  for (int l = 0; l < c.num_hidden_layers; ++l) kv_arena.Reserve(layout.LayerBytes());
  RETURN_IF_ERROR(kv_arena.Allocate("KV cache of " + std::to_string(blocks) + " blocks (" +
                                        std::string(KvDtypeName(opt.kv_dtype)) + ")",
                                    dev));
  view.layout = layout;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    view.layer_base.push_back(kv_arena.Take<uint8_t>(layout.LayerBytes()));
  }
  if (opt.kv_dtype == KvDtype::kFp8E4M3) {  // as Model::KvScales
    view.k_scale = c.fp8_k_scale;
    view.v_scale = c.fp8_v_scale;
  } else {
    view.k_scale.assign(c.num_hidden_layers, 1.0f);
    view.v_scale.assign(c.num_hidden_layers, 1.0f);
  }
  if (kv_arena.size() > 0) {
    KVB_CUDA_RETURN(cudaMemset(view.layer_base[0], 0, kv_arena.size()), "KV pool zero fill");
  }
  mem.kv_bytes = kv_arena.size();
  kvp.num_kv_heads = layout.num_kv_heads;
  kvp.head_dim = layout.head_dim;
  kvp.block_size = layout.block_size;
  kvp.dtype = static_cast<int>(layout.dtype);
  kvp.half_block_bytes = layout.HalfBlockBytes();
  KVB_CUDA_RETURN(cudaDeviceSynchronize(), "CudaModel setup");
  KVB_CUDA_RETURN(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  mem.device_total = total_b;
  mem.device_free = free_b;
  return OkStatus();
}

Status CudaModel::Impl::Forward(const ForwardBatch& batch, std::vector<float>* logits_out) {
  if (logits_out == nullptr) return InvalidArgumentError("Forward: logits must not be null");
  cuda_internal::PackedStep ps;
  RETURN_IF_ERROR(cuda_internal::PackStep(c, view.layout, batch, limits, &ps));
  KVB_CUDA_RETURN(cudaSetDevice(opt.device), "cudaSetDevice");
  cudaGetLastError();  // launch errors below are this step's own
  const int m = ps.rows, nl = ps.logit_rows;
  const int hsz = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), im = c.intermediate_size;
  const int nqkv = qd + 2 * kvd, nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float attn_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  int max_pos = 0;  // the last position any row attends from
  for (const SequenceChunk& sq : batch.sequences) {
    max_pos = std::max(max_pos, sq.start_pos + sq.num_tokens - 1);
  }
  // The previous step's staging copies are done (it synchronized before returning).
  std::memcpy(host_meta, ps.buf.data(), ps.buf.size() * 4);
  KVB_CUDA_RETURN(
      cudaMemcpyAsync(meta, host_meta, ps.buf.size() * 4, cudaMemcpyHostToDevice, stream),
      "step metadata upload");
  const int32_t* tokens = meta + ps.TokensAt();
  const int32_t* pos = meta + ps.PosAt();
  const int32_t* toff = meta + ps.TableOffAt();
  const int32_t* lrows = meta + ps.LogitRowsAt();
  const int32_t* tables = meta + ps.TablesAt();

  using namespace cuda_internal;  // NOLINT: the launch functions
  RETURN_IF_ERROR(Mark("upload"));
  LaunchEmbed(embed, tokens, m, hsz, x, stream);
  RETURN_IF_ERROR(Mark("embed"));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const Layer& d = layers[l];
    uint8_t* base = view.layer_base[l];
    const float ks = view.k_scale[l], vs = view.v_scale[l];
    LaunchRmsNorm(x, nullptr, m, hsz, 1, hsz, d.in_norm, eps, hb, hsz, true, stream);
    RETURN_IF_ERROR(Mark("rms_norm"));
    LaunchMatmul(hb, hsz, d.wqkv, m, nqkv, hsz, 1, d.bqkv, qkv, stream);
    RETURN_IF_ERROR(Mark("qkv_proj"));
    if (c.qk_norm) {  // Qwen3: RMSNorm of every q and k head vector (in place), before RoPE
      LaunchRmsNorm(qkv, nullptr, m * nh, c.head_dim, nh, nqkv, d.q_norm, eps, qkv, nqkv, false,
                    stream);
      LaunchRmsNorm(qkv + qd, nullptr, m * nkv, c.head_dim, nkv, nqkv, d.k_norm, eps, qkv + qd,
                    nqkv, false, stream);
      RETURN_IF_ERROR(Mark("qk_norm"));
    }
    LaunchRope(qkv, nqkv, m, pos, nh, nkv, c.head_dim, rope_cos, rope_sin, stream);
    RETURN_IF_ERROR(Mark("rope"));
    LaunchKvWrite(qkv, nqkv, qd, qd + kvd, m, pos, toff, tables, kvp, base, ks, vs, stream);
    RETURN_IF_ERROR(Mark("kv_write"));
    KVB_CUDA_RETURN(cudaEventRecord(events[l], stream), "cudaEventRecord");
    LaunchAttention(qkv, nqkv, m, pos, toff, tables, kvp, base, ks, vs, nh, attn_scale, attn,
                    max_pos, attn_scratch, attn_scratch_floats, stream);
    RETURN_IF_ERROR(Mark("attention"));
    LaunchMatmul(attn, qd, d.wo, m, hsz, qd, kRowParallelShards, nullptr, partial, stream);
    RETURN_IF_ERROR(Mark("o_proj"));
    LaunchResidualTree(x, partial, m, hsz, d.bo, stream);
    RETURN_IF_ERROR(Mark("shard_tree_residual"));
    LaunchRmsNorm(x, nullptr, m, hsz, 1, hsz, d.post_norm, eps, hb, hsz, true, stream);
    RETURN_IF_ERROR(Mark("rms_norm"));
    LaunchMatmul(hb, hsz, d.wgu, m, 2 * im, hsz, 1, nullptr, gu, stream);
    RETURN_IF_ERROR(Mark("gate_up_proj"));
    LaunchSiluMul(gu, m, im, act, stream);
    RETURN_IF_ERROR(Mark("silu_mul"));
    LaunchMatmul(act, im, d.wdown, m, hsz, im, kRowParallelShards, nullptr, partial, stream);
    RETURN_IF_ERROR(Mark("down_proj"));
    LaunchResidualTree(x, partial, m, hsz, nullptr, stream);
    RETURN_IF_ERROR(Mark("shard_tree_residual"));
    if (batch.on_layer_kv_written) {
      // Layer l is enqueued whole: wait for its KV writes only now, so that while the host runs
      // the callback (WRITE mode: the pushes of layer l, on the transfer's own stream) the GPU
      // still has this layer's attention and MLP queued, and layer l + 1 is enqueued after.
      KVB_CUDA_RETURN(cudaEventSynchronize(events[l]), "layer KV write");
      batch.on_layer_kv_written(l);
    }
  }
  KVB_CUDA_RETURN(cudaGetLastError(), "forward launch");
  logits_out->assign(static_cast<size_t>(nl) * c.vocab_size, 0.0f);
  if (nl > 0) {
    LaunchRmsNorm(x, lrows, nl, hsz, 1, hsz, final_norm, eps, hb, hsz, true, stream);
    RETURN_IF_ERROR(Mark("rms_norm"));
    LaunchMatmul(hb, hsz, lm_head, nl, c.vocab_size, hsz, 1, nullptr, logits, stream);
    RETURN_IF_ERROR(Mark("lm_head"));
    KVB_CUDA_RETURN(cudaGetLastError(), "logits launch");
    KVB_CUDA_RETURN(cudaMemcpyAsync(host_logits, logits, logits_out->size() * 4,
                                    cudaMemcpyDeviceToHost, stream),
                    "logits download");
    RETURN_IF_ERROR(Mark("logits_download"));
  }
  KVB_CUDA_RETURN(cudaStreamSynchronize(stream), "forward");
  CollectTiming();
  if (nl > 0) std::memcpy(logits_out->data(), host_logits, logits_out->size() * 4);
  return OkStatus();
}

CudaModel::CudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaModel::~CudaModel() = default;

Result<std::unique_ptr<CudaModel>> CudaModel::Create(std::shared_ptr<const Model> model,
                                                     const CudaModelOptions& options) {
  if (model == nullptr) return InvalidArgumentError("CudaModel: no model");
  // A weightless model (a preset without a directory): its weights are generated on the device.
  if (const RandomModelSpec* spec = model->weightless_spec()) return CreateRandom(*spec, options);
  RETURN_IF_ERROR(CudaDeviceAvailable(options.device));
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->c = model->config();
  impl->opt = options;
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<CudaModel>(new CudaModel(std::move(impl)));
}

Result<std::unique_ptr<CudaModel>> CudaModel::CreateRandom(const RandomModelSpec& spec,
                                                           const CudaModelOptions& options) {
  RETURN_IF_ERROR(spec.config.Validate());
  RETURN_IF_ERROR(CudaDeviceAvailable(options.device));
  auto impl = std::make_unique<Impl>();
  impl->random = true;
  impl->seed = spec.seed;
  impl->c = spec.config;
  impl->opt = options;
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<CudaModel>(new CudaModel(std::move(impl)));
}

Status CudaModel::Forward(const ForwardBatch& batch, std::vector<float>* logits) {
  return impl_->Forward(batch, logits);
}

void CudaModel::SetStageTiming(bool on) { impl_->timing = on; }
std::vector<std::pair<std::string, double>> CudaModel::StageTimes() const {
  return impl_->stage_ms;
}
void CudaModel::ResetStageTimes() { impl_->stage_ms.clear(); }

const PagedKvView& CudaModel::kv_view() const { return impl_->view; }

Status CudaModel::CopyBlock(int32_t src, int32_t dst) {
  const PagedKvLayout& l = impl_->view.layout;
  if (src < 0 || dst < 0 || src >= l.num_blocks || dst >= l.num_blocks) {
    return InvalidArgumentError("CopyBlock: block outside the pool");
  }
  KVB_CUDA_RETURN(cudaSetDevice(impl_->opt.device), "cudaSetDevice");
  for (uint8_t* base : impl_->view.layer_base) {
    KVB_CUDA_RETURN(cudaMemcpyAsync(base + static_cast<size_t>(dst) * l.BlockBytes(),
                                    base + static_cast<size_t>(src) * l.BlockBytes(),
                                    l.BlockBytes(), cudaMemcpyDeviceToDevice, impl_->stream),
                    "CopyBlock");
  }
  KVB_CUDA_RETURN(cudaStreamSynchronize(impl_->stream), "CopyBlock");
  return OkStatus();
}

Status CudaModel::XorKvByte(int layer, size_t offset, uint8_t mask) {
  if (layer < 0 || layer >= static_cast<int>(impl_->view.layer_base.size()) ||
      offset >= impl_->view.layout.LayerBytes()) {
    return InvalidArgumentError("XorKvByte: byte outside the pool");
  }
  KVB_CUDA_RETURN(cudaSetDevice(impl_->opt.device), "cudaSetDevice");
  uint8_t* p = impl_->view.layer_base[layer] + offset;
  uint8_t b = 0;
  KVB_CUDA_RETURN(cudaMemcpyAsync(&b, p, 1, cudaMemcpyDeviceToHost, impl_->stream), "XorKvByte");
  KVB_CUDA_RETURN(cudaStreamSynchronize(impl_->stream), "XorKvByte");
  b ^= mask;
  KVB_CUDA_RETURN(cudaMemcpyAsync(p, &b, 1, cudaMemcpyHostToDevice, impl_->stream), "XorKvByte");
  KVB_CUDA_RETURN(cudaStreamSynchronize(impl_->stream), "XorKvByte");
  return OkStatus();
}

Status CudaModel::FillKv(uint8_t byte) {
  KVB_CUDA_RETURN(cudaSetDevice(impl_->opt.device), "cudaSetDevice");
  for (uint8_t* base : impl_->view.layer_base) {
    KVB_CUDA_RETURN(cudaMemsetAsync(base, byte, impl_->view.layout.LayerBytes(), impl_->stream),
                    "FillKv");
  }
  KVB_CUDA_RETURN(cudaStreamSynchronize(impl_->stream), "FillKv");
  return OkStatus();
}

Status CudaModel::ReadKvLayer(int layer, std::vector<uint8_t>* bytes) const {
  if (layer < 0 || layer >= static_cast<int>(impl_->view.layer_base.size())) {
    return InvalidArgumentError("ReadKvLayer: no such layer");
  }
  KVB_CUDA_RETURN(cudaSetDevice(impl_->opt.device), "cudaSetDevice");
  bytes->resize(impl_->view.layout.LayerBytes());
  KVB_CUDA_RETURN(cudaMemcpy(bytes->data(), impl_->view.layer_base[layer], bytes->size(),
                             cudaMemcpyDeviceToHost),
                  "ReadKvLayer");
  return OkStatus();
}

Status CudaModel::WriteKvLayer(int layer, const std::vector<uint8_t>& bytes) {
  if (layer < 0 || layer >= static_cast<int>(impl_->view.layer_base.size()) ||
      bytes.size() != impl_->view.layout.LayerBytes()) {
    return InvalidArgumentError("WriteKvLayer: no such layer or wrong size");
  }
  KVB_CUDA_RETURN(cudaSetDevice(impl_->opt.device), "cudaSetDevice");
  KVB_CUDA_RETURN(
      cudaMemcpy(impl_->view.layer_base[layer], bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
      "WriteKvLayer");
  return OkStatus();
}

void* CudaModel::layer_kv_event(int layer) const {
  return static_cast<void*>(impl_->events.at(layer));
}
const CudaMemoryReport& CudaModel::memory() const { return impl_->mem; }
Result<size_t> CudaModel::DeviceFreeBytes() const {
  KVB_CUDA_RETURN(cudaSetDevice(impl_->opt.device), "cudaSetDevice");
  size_t free_b = 0, total_b = 0;
  KVB_CUDA_RETURN(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return free_b;
}
int CudaModel::device() const { return impl_->opt.device; }
const std::string& CudaModel::device_name() const { return impl_->device_name; }
const CudaModelOptions& CudaModel::options() const { return impl_->opt; }

}  // namespace kvbridge
