// kvbridge/model/tensor_parallel.h — tensor parallelism inside one engine: T ranks, each a thread
// with its own slice of the weights and its own KV cache, whose logits are bitwise identical to
// the single-rank Model::Forward (DESIGN.md "The model and its numerics").
//
// Rank r owns
//   - query heads [r*H/T, (r+1)*H/T) (column slices of q_proj and its bias);
//   - KV heads [r*Hkv/T, (r+1)*Hkv/T) when Hkv >= T; when Hkv < T (T a multiple of Hkv) the KV
//     heads are replicated as vLLM does: rank r holds the single head floor(r*Hkv/T), the one its
//     query heads attend to (column slices of k_proj/v_proj and their biases);
//   - row-parallel shards [r*8/T, (r+1)*8/T) of the 8 fixed K-shards of o_proj and down_proj
//     (their K columns) and the matching columns of gate_proj/up_proj;
// as separate memory. Embeddings, norms and lm_head are replicated (shared, read-only).
// After attention and after the MLP the ranks publish their shards' partial sums; each output
// element is then the same fixed tree ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)) as at T=1, so
// greedy tokens and logprobs do not depend on T. Ranks run concurrently, one thread each, with a
// barrier between layer stages; rank 0 runs on the calling thread. When the model was loaded
// with more threads than T (ModelLoadOptions::num_threads), each rank also splits its matmuls
// and attention over the model's thread pool (same bits).
//
//   RETURN_IF_ERROR(ValidateTensorParallelSize(model->config(), 2));
//   ASSIGN_OR_RETURN(auto tp, TensorParallelModel::Create(model, 2));
//   std::vector<LocalKvCache> kv;  // one per rank, with tp->KvLayout(r, 64, 16, KvDtype::kFp32)
//   std::vector<PagedKvView> views = {kv[0].view(), kv[1].view()};
//   RETURN_IF_ERROR(tp->Forward(batch, views, &logits));  // == model->Forward(...) bitwise
//
// Thread-safety: Forward calls on one object are serialized (each uses every rank thread);
// the other methods are const and safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/status.h"
#include "kvbridge/model/config.h"
#include "kvbridge/model/forward.h"

namespace kvbridge {

class Model;

/// A half-open range of global head indices [begin, end).
struct HeadRange {
  int begin = 0;
  int end = 0;
  int size() const { return end - begin; }
};

/// Checks that `tp_size` T is usable with `config`: T >= 1, T divides 8 (the fixed K-shards of
/// the row-parallel matmuls), T divides num_attention_heads, and num_key_value_heads is a
/// multiple of T or T a multiple of num_key_value_heads. InvalidArgument naming the rule and
/// the numbers otherwise.
Status ValidateTensorParallelSize(const ModelConfig& config, int tp_size);

/// Global KV heads held by `rank` of `tp_size` ranks of a model with `num_kv_heads` KV heads
/// (see the header comment; replicated when num_kv_heads < tp_size). Arguments must satisfy
/// ValidateTensorParallelSize.
HeadRange TpKvHeads(int num_kv_heads, int tp_size, int rank);
/// Global query heads of `rank`: [r*H/T, (r+1)*H/T).
HeadRange TpQueryHeads(int num_attention_heads, int tp_size, int rank);

class TensorParallelModel {
 public:
  /// Slices `model`'s layer weights into `tp_size` ranks (copies: each rank owns its slice) and
  /// starts tp_size - 1 rank threads. tp_size 1 makes no copies and runs Model::Forward.
  /// Errors: InvalidArgument (see ValidateTensorParallelSize, null model).
  static Result<std::unique_ptr<TensorParallelModel>> Create(std::shared_ptr<const Model> model,
                                                             int tp_size);
  ~TensorParallelModel();
  TensorParallelModel(const TensorParallelModel&) = delete;
  TensorParallelModel& operator=(const TensorParallelModel&) = delete;

  int tp_size() const;
  const Model& model() const;
  HeadRange kv_heads(int rank) const;
  /// The KV layout rank `rank` needs: the model's, with num_kv_heads = kv_heads(rank).size().
  PagedKvLayout KvLayout(int rank, int num_blocks, int block_size, KvDtype dtype) const;
  /// Bytes of fp32 weights owned by `rank` (its q/k/v/o, gate/up/down slices and biases; at
  /// tp_size 1 the whole decoder layers).
  size_t RankWeightBytes(int rank) const;
  /// Bytes of the weights every rank reads but none owns a slice of (embeddings, norms,
  /// lm_head, o_proj bias).
  size_t ReplicatedWeightBytes() const;

  /// One step (see Model::Forward) with rank r's KV in `rank_kv[r]` (size tp_size; each view's
  /// layout must be KvLayout(r, ...) with the same block size, block count and dtype on every
  /// rank). Writes each rank's KV heads of every token through the shared block tables, then
  /// calls batch.on_layer_kv_written(layer) on the calling thread once every rank has written
  /// that layer. `logits` is [sequences with compute_logits][vocab_size], bitwise equal to
  /// Model::Forward with the full KV. Errors (nothing written): as Model::Forward, plus
  /// InvalidArgument when rank_kv has the wrong size or its views disagree.
  Status Forward(const ForwardBatch& batch, std::span<const PagedKvView> rank_kv,
                 std::vector<float>* logits) const;

  struct Impl;

 private:
  explicit TensorParallelModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge
