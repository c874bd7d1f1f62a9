// Internal: the loaded weights and the forward pass behind kvbridge::Model.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvbridge/model/model.h"
#include "model/thread_pool.h"

namespace kvbridge {

namespace model_internal {

/// Number of fixed K-shards of every row-parallel matmul (o_proj, down_proj), at every TP size.
constexpr int kRowParallelShards = 8;
/// Attention walks the KV in chunks of this many positions, aligned to absolute positions.
constexpr int kAttentionChunk = 16;

/// Weights of one decoder layer, HF layout: a linear's weight is [out][in] row-major.
struct LayerWeights {
  std::vector<float> input_norm;      // [hidden]
  std::vector<float> wq, wk, wv;      // [q_dim|kv_dim][hidden]
  std::vector<float> bq, bk, bv;      // [q_dim|kv_dim] or empty
  std::vector<float> q_norm, k_norm;  // [head_dim] (Qwen3 per-head RMSNorm) or empty
  std::vector<float> wo;              // [hidden][q_dim]
  std::vector<float> bo;              // [hidden] or empty
  std::vector<float> post_norm;       // [hidden]
  std::vector<float> w_gate, w_up;    // [intermediate][hidden]
  std::vector<float> w_down;          // [hidden][intermediate]
};

struct Weights {
  std::vector<float> embed;  // [vocab][hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab][hidden]; empty when tied (use embed)
  const std::vector<float>& LmHead() const { return lm_head.empty() ? embed : lm_head; }
};

/// (name, expected shape, destination) for every tensor the config needs, in load order.
struct TensorSlot {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float>* dest;
};
std::vector<TensorSlot> TensorSlots(const ModelConfig& c, Weights* w);

}  // namespace model_internal

struct Model::Impl {
  ModelConfig config;
  Tokenizer tokenizer{0, -1, -1, -1};
  std::string fingerprint;
  model_internal::Weights weights;
  /// RoPE table: [max_position_embeddings][head_dim / 2] cos, then the same for sin.
  std::vector<float> rope_cos, rope_sin;
  std::unique_ptr<model_internal::ThreadPool> pool;

  Status Forward(const ForwardBatch& batch, const PagedKvView& kv,
                 std::vector<float>* logits) const;
};

}  // namespace kvbridge
