// Internal: the pieces of the forward pass shared by Model::Forward (one rank, pool-threaded)
// and TensorParallelModel::Forward (T rank threads). Both build a step from exactly these
// functions, so every element is computed by the same arithmetic at every TP size.
#pragma once

#include <cstdint>
#include <vector>

#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/status.h"
#include "kvbridge/model/config.h"
#include "kvbridge/model/forward.h"

namespace kvbridge::model_internal {

/// One token of the step: its sequence (index into batch.sequences), position and id.
struct Row {
  int seq;
  int pos;
  int32_t token;
};

/// Checks a view against the model: layers, `expected_kv_heads` (the rank's heads), head_dim,
/// block_size/num_blocks, dtype, one base pointer and finite positive scales per layer.
Status CheckView(const ModelConfig& c, const PagedKvView& kv, int expected_kv_heads);

/// Validates every sequence of `batch` against the config and the KV layout (block size and
/// count) and flattens it into rows; `logit_rows` gets the row index of each logit request.
/// Nothing is written. Errors: InvalidArgument naming the sequence.
Status BuildRows(const ModelConfig& c, const PagedKvLayout& layout, const ForwardBatch& batch,
                 std::vector<Row>* rows, std::vector<int>* logit_rows);

/// Writes one head vector (n floats) into the cache through the dtype; `scale` divides.
void StoreKv(const float* src, int n, KvDtype dtype, float scale, uint8_t* dst);
/// Reads one head vector back as fp32; `scale` multiplies.
void LoadKv(const uint8_t* src, int n, KvDtype dtype, float scale, float* dst);

/// y = RMSNorm(x) * w for rows [row_begin, row_end) of x[.][h] (HF LlamaRMSNorm); y may be x.
void RmsNormRows(const float* x, int row_begin, int row_end, int h, const float* w, float eps,
                 float* y);

/// Rotates one head vector (head_dim floats) at `pos` with the model's RoPE tables
/// ([max_pos][head_dim/2] cos and sin).
void ApplyRope(float* vec, int head_dim, int pos, const float* rope_cos, const float* rope_sin);

/// Scratch buffers of AttendKvHead, sized for `group` query heads.
struct AttentionScratch {
  AttentionScratch(int group, int head_dim);
  std::vector<float> kbuf, vbuf, scores, acc, mx, den;
};

/// Attention of the `group` query heads at `qg` ([group][head_dim], contiguous) that share KV
/// head `kv_head` (index inside `kv`'s layout) for a token at `pos` of sequence `sq`: walks
/// positions [0, pos] in kAttentionChunk-aligned chunks with an online softmax. Query heads are
/// independent rows, so any subset of a group gives the same bits for each head.
void AttendKvHead(const float* qg, int group, const SequenceChunk& sq, int pos,
                  const PagedKvLayout& layout, const uint8_t* base, int kv_head, float k_scale,
                  float v_scale, float attn_scale, AttentionScratch* s, float* out);

/// The fixed shard tree: ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)), p_s = p[s * stride].
inline float ShardTreeSum(const float* p, size_t stride) {
  return ((p[0] + p[stride]) + (p[2 * stride] + p[3 * stride])) +
         ((p[4 * stride] + p[5 * stride]) + (p[6 * stride] + p[7 * stride]));
}

/// First K index of row-parallel shard s (s in [0, 8]) of a K-long reduction.
inline int ShardBegin(int s, int k) { return static_cast<int>(int64_t{s} * k / 8); }

}  // namespace kvbridge::model_internal
