// Internal: the loaded weights and the forward pass behind kvbridge::Model.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "kvbridge/model/safetensors.h"
#include "model/kernels.h"
#include "model/thread_pool.h"

namespace kvbridge {

namespace model_internal {

/// Number of fixed K-shards of every row-parallel matmul (o_proj, down_proj), at every TP size.
constexpr int kRowParallelShards = 8;
/// Attention walks the KV in chunks of this many positions, aligned to absolute positions.
constexpr int kAttentionChunk = 16;

/// A [rows][cols] row-major weight matrix, resident in its WeightType: either a view of the
/// memory-mapped safetensors bytes (the model keeps the mapping alive) or, when converted at
/// load (ModelLoadOptions::dtype, F64 files, unaligned F32), its own copy. Move-only (a copy
/// would point into the original's storage).
struct Matrix {
  WeightPtr ptr;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> owned;  // the converted copy ptr points into, or empty for a view

  Matrix() = default;
  Matrix(Matrix&&) = default;
  Matrix& operator=(Matrix&&) = default;
  Matrix(const Matrix&) = delete;
  Matrix& operator=(const Matrix&) = delete;

  bool empty() const { return rows == 0; }
  WeightType type() const { return ptr.type; }
  /// Row r (cols elements).
  WeightPtr Row(int64_t r) const { return ptr.Offset(r * cols); }
  size_t bytes() const { return static_cast<size_t>(rows * cols) * WeightTypeSize(ptr.type); }
  /// The values widened to fp32 (a copy; tests and reference code).
  std::vector<float> ToFloat32() const;
};

/// Weights of one decoder layer, HF layout: a linear's weight is [out][in] row-major.
struct LayerWeights {
  std::vector<float> input_norm;      // [hidden]
  Matrix wq, wk, wv;                  // [q_dim|kv_dim][hidden]
  std::vector<float> bq, bk, bv;      // [q_dim|kv_dim] or empty
  std::vector<float> q_norm, k_norm;  // [head_dim] (Qwen3 per-head RMSNorm) or empty
  Matrix wo;                          // [hidden][q_dim]
  std::vector<float> bo;              // [hidden] or empty
  std::vector<float> post_norm;       // [hidden]
  Matrix w_gate, w_up;                // [intermediate][hidden]
  Matrix w_down;                      // [hidden][intermediate]
};

struct Weights {
  Matrix embed;  // [vocab][hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden]
  Matrix lm_head;                 // [vocab][hidden]; empty when tied (use embed)
  const Matrix& LmHead() const { return lm_head.empty() ? embed : lm_head; }
  /// Bytes resident for compute: every matrix in its type + the fp32 norms and biases.
  size_t bytes = 0;
  /// The files' tensors that matrices view in place (kept mapped); null when all were copied.
  std::shared_ptr<const TensorStore> mapped;
};

/// y[i][j] = x[i] . w[b + j] for rows i < m, columns j < e - b of a [n][k] weight matrix:
/// the call every linear layer makes (kernel over a contiguous slice of rows).
inline void LinearSlice(const float* x, int m, const Matrix& w, int64_t b, int64_t e, float* y,
                        int ldy) {
  const int k = static_cast<int>(w.cols);
  MatMulNT(x, m, k, w.Row(b), static_cast<int>(e - b), k, k, y + b, ldy);
}

/// (name, expected shape, destination) for every tensor the config needs, in load order: an
/// fp32 vector (`dest`: norms, biases) or a matrix kept in its weight type (`matrix`).
struct TensorSlot {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float>* dest = nullptr;
  Matrix* matrix = nullptr;
};
std::vector<TensorSlot> TensorSlots(const ModelConfig& c, Weights* w);

}  // namespace model_internal

struct Model::Impl {
  ModelConfig config;
  Tokenizer tokenizer{0, -1, -1, -1};
  std::string fingerprint;
  model_internal::Weights weights;
  uint64_t weight_file_bytes = 0;
  /// RoPE table: [max_position_embeddings][head_dim / 2] cos, then the same for sin.
  std::vector<float> rope_cos, rope_sin;
  std::unique_ptr<model_internal::ThreadPool> pool;
  /// Set for a weightless model (Model::CreateWeightless): no weights, no RoPE tables, no pool.
  std::optional<RandomModelSpec> weightless;

  Status Forward(const ForwardBatch& batch, const PagedKvView& kv,
                 std::vector<float>* logits) const;
};

}  // namespace kvbridge
