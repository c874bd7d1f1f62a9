// kvbridge/model/model.h — a loaded Llama-family model and its batch-invariant forward pass.
//
// The model module: config (config.h), weights (safetensors.h), tokenizer (tokenizer.h) and the
// forward pass (forward.h + kv_cache_view.h). fp32 compute on CPU with our own kernels, so a
// token's logits are bitwise identical whatever else is in the batch, however its prompt was
// chunked and wherever its KV was computed (DESIGN.md "The model and its numerics").
//
//   ASSIGN_OR_RETURN(std::shared_ptr<Model> model, Model::Load("models/small"));
//   LocalKvCache kv(model->KvLayout(/*num_blocks=*/64, /*block_size=*/16, KvDtype::kBf16),
//                   model->KvScales());
//   std::vector<int32_t> ids = model->tokenizer().Encode("Hello", true);
//   std::vector<int32_t> table = {0};
//   ForwardBatch batch;
//   batch.sequences.push_back({ids.data(), (int)ids.size(), 0, table.data(), 1, true});
//   std::vector<float> logits;
//   RETURN_IF_ERROR(model->Forward(batch, kv.view(), &logits));  // [1][vocab_size]
//
// Thread-safety: a loaded Model is immutable; Forward may run concurrently from several
// threads as long as the calls write disjoint KV blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/status.h"
#include "kvbridge/model/config.h"
#include "kvbridge/model/forward.h"
#include "kvbridge/model/tokenizer.h"

namespace kvbridge {

struct RandomModelSpec;  // kvbridge/model/random_model.h

/// The type the linear weights and embeddings are kept in (vLLM's --dtype values). kAuto keeps
/// each tensor as stored (BF16/F16/F32 used in place from the memory-mapped file; F64 becomes
/// fp32); the others convert every tensor at load (round to nearest even when narrowing).
/// Compute is fp32 either way: narrow weights are widened exactly inside the matmul kernel.
enum class WeightDtype { kAuto, kBfloat16, kFloat16, kFloat32 };
/// "auto", "bfloat16" (or "bf16"), "float16" ("half", "fp16"), "float32" ("float", "fp32").
/// InvalidArgument naming the value otherwise.
Result<WeightDtype> ParseWeightDtype(std::string_view s);
const char* WeightDtypeName(WeightDtype d);

struct ModelLoadOptions {
  /// Threads used inside one Forward (matmul output columns, attention rows x heads); they
  /// never change the arithmetic. 0 = std::thread::hardware_concurrency(), capped at 8.
  int num_threads = 0;
  /// Resident weight type (see WeightDtype).
  WeightDtype dtype = WeightDtype::kAuto;
};

class Model {
 public:
  /// Loads `dir/config.json` and the weights (model.safetensors or sharded with
  /// model.safetensors.index.json, memory-mapped; BF16/F16/F32 matrices are used in place
  /// unless options.dtype converts them; norms and biases become fp32).
  /// Errors: NotFound (missing file), InvalidArgument naming file, tensor and expected vs
  /// found shape/dtype, Unimplemented (unsupported config features).
  static Result<std::shared_ptr<Model>> Load(const std::string& dir, ModelLoadOptions options = {});
  /// A weightless model: the config, byte tokenizer and fingerprint of random-model preset
  /// `spec` (random_model.h) and no weights in host memory, for a GPU engine that generates the
  /// weights straight into device memory (CudaModel::Create of a weightless model =
  /// CudaModel::CreateRandom(spec)): `serve qwen2.5-7b --device cuda` never allocates the 15 GB
  /// on the host. Its fingerprint is XXH3-128 over the canonical config JSON and the text
  /// "weightless random model seed=S" (equal for every engine of the same preset and seed; not
  /// equal to the fingerprint of the same preset written by make-model and loaded, which hashes
  /// the weights). Forward returns FailedPrecondition; weight_bytes() is 0.
  /// Errors: InvalidArgument (invalid config, a vocabulary the byte tokenizer cannot serve).
  static Result<std::shared_ptr<Model>> CreateWeightless(const RandomModelSpec& spec);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const;
  const Tokenizer& tokenizer() const;
  /// 32 lowercase hex digits: XXH3-128 over the canonical config JSON and every tensor
  /// (name, shape, fp32 values, in name order). Equal models give equal fingerprints on any
  /// host; seeds the prefix-cache hash chain and is checked at transfer handshake. Computed
  /// over the resident values (equal to the stored ones unless options.dtype narrowed them).
  const std::string& fingerprint() const;
  /// Bytes of weights resident for compute: every matrix in its resident type (mapped in
  /// place or converted) plus the fp32 norms and biases.
  size_t weight_bytes() const;
  /// Total size of the model's safetensors files.
  uint64_t weight_file_bytes() const;
  /// The resident types of the matrices, e.g. "BF16", "F32" or "BF16+F32" ("none" when
  /// weightless).
  std::string weight_types() const;
  /// The preset spec of a weightless model (CreateWeightless), else null.
  const RandomModelSpec* weightless_spec() const;

  /// The KV layout this model needs (all KV heads on one rank).
  PagedKvLayout KvLayout(int num_blocks, int block_size, KvDtype dtype) const;
  /// The fp8 scales of config (per layer), or all 1.0 when `dtype` is not fp8.
  void KvScales(KvDtype dtype, std::vector<float>* k_scale, std::vector<float>* v_scale) const;

  /// One step over `batch` (see forward.h). For every sequence, writes the K/V of its tokens
  /// into `kv` at positions [start_pos, start_pos + num_tokens) through its block table, then
  /// attends over positions [0, pos] of that sequence. `logits` is resized to
  /// [number of sequences with compute_logits][vocab_size], in batch order.
  /// Errors (nothing written when the batch is invalid): InvalidArgument for a token id
  /// outside the vocabulary, a position beyond max_position_embeddings, a block table too
  /// short or naming a block outside the cache, or a `kv` whose layout does not match
  /// KvLayout (layers, kv heads, head_dim) or whose scales are missing or not positive.
  Status Forward(const ForwardBatch& batch, const PagedKvView& kv,
                 std::vector<float>* logits) const;

  struct Impl;  // internal (src/model/model_impl.h); exposed for the reference tests

  const Impl& impl() const { return *impl_; }

 private:
  explicit Model(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// An owned, zero-filled paged KV cache (for tests, benchmarks and `kvbridge generate`; the
/// engine has its own block pool). Move-only.
class LocalKvCache {
 public:
  LocalKvCache(const PagedKvLayout& layout, std::vector<float> k_scale, std::vector<float> v_scale);
  LocalKvCache(LocalKvCache&&) = default;
  LocalKvCache& operator=(LocalKvCache&&) = default;
  LocalKvCache(const LocalKvCache&) = delete;
  LocalKvCache& operator=(const LocalKvCache&) = delete;
  const PagedKvView& view() const { return view_; }
  /// Bytes of one block of one layer (K and V).
  uint8_t* BlockData(int layer, int block) {
    return view_.layer_base[layer] + static_cast<size_t>(block) * view_.layout.BlockBytes();
  }

 private:
  std::vector<std::vector<uint8_t>> layers_;
  PagedKvView view_;
};

}  // namespace kvbridge
