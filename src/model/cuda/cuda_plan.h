// Internal: the CPU-side logic of the CUDA forward pass — tile plans, launch parameters and the
// packing of one step's metadata (tokens, positions, block tables) into one upload. Plain C++
// (no CUDA headers), unit-tested without a GPU (cuda_plan_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/status.h"
#include "kvbridge/model/config.h"
#include "kvbridge/model/forward.h"
#include "model/cuda/cuda_constants.h"

namespace kvbridge::cuda_internal {

// Matmul: Y[m][n] = X[m][k] . W[n][k]^T, bf16 in, fp32 accumulate (mma.sync m16n8k16).
struct MatmulPlan {
  int grid_x = 0, grid_y = 0, grid_z = 0;  ///< n tiles, m tiles, shards
  int threads = kMatmulThreads;
  /// K range of each shard: [k_begin[s], k_end[s]); with one shard [0, k).
  std::vector<int> k_begin, k_end;
  /// mma k-steps each output element of shard s takes (ceil((k_end - k_begin) / kTileK) * 2):
  /// a function of k and s only, never of m — the batch-invariance argument.
  std::vector<int> k_steps;
};
/// shards is 1 (column-parallel: q/k/v, gate/up, lm_head) or kRowParallelShards (o_proj,
/// down_proj: shard s covers [s*k/8, (s+1)*k/8), the CPU's ShardBegin).
MatmulPlan PlanMatmul(int m, int n, int k, int shards);

struct AttentionPlan {
  int grid_x = 0, grid_y = 0;  ///< rows, kv heads
  int threads = 0;             ///< one warp per query head of the group
  size_t smem_bytes = 0;       ///< one chunk of K and V as fp32
  int dims_per_lane = 0;       ///< ceil(head_dim / 32)
};
/// InvalidArgument when head_dim > kMaxHeadDim or the group (query heads per KV head) > 32.
Result<AttentionPlan> PlanAttention(int rows, int num_heads, int num_kv_heads, int head_dim);

/// Step limits: what the preallocated device buffers hold.
struct StepLimits {
  int max_rows = 0;          ///< max_num_batched_tokens
  int max_seqs = 0;          ///< max_num_seqs
  int max_table_blocks = 0;  ///< packed block-table entries (max_seqs * blocks of max_model_len)
  int max_len = 0;           ///< max_model_len (sizes the attention partition scratch)
};

/// One step's metadata, packed into one int32 buffer uploaded with one copy:
///   [0, m) tokens | [m, 2m) positions | [2m, 3m) offset of the row's block table inside the
///   tables area | [3m, 3m + nl) logit rows | tables (per sequence, the blocks its positions
///   [0, start_pos + num_tokens) need, batch order).
struct PackedStep {
  std::vector<int32_t> buf;
  int rows = 0;
  int logit_rows = 0;
  int table_entries = 0;
  size_t TokensAt() const { return 0; }
  size_t PosAt() const { return static_cast<size_t>(rows); }
  size_t TableOffAt() const { return 2 * static_cast<size_t>(rows); }
  size_t LogitRowsAt() const { return 3 * static_cast<size_t>(rows); }
  size_t TablesAt() const { return 3 * static_cast<size_t>(rows) + logit_rows; }
};
/// Validates `batch` exactly as Model::Forward does (model_internal::BuildRows) and against
/// `limits`, then packs it. Errors: InvalidArgument naming the sequence or the limit.
Status PackStep(const ModelConfig& config, const PagedKvLayout& layout, const ForwardBatch& batch,
                const StepLimits& limits, PackedStep* out);

/// Max blocks one sequence of `max_model_len` positions needs.
inline int BlocksFor(int positions, int block_size) {
  return (positions + block_size - 1) / block_size;
}

/// Device activation bytes for the given shapes and limits (what CudaModel preallocates).
struct ActivationSizes {
  size_t x = 0, hb = 0, qkv = 0, attn = 0, partial = 0, gu = 0, act = 0, logits = 0, meta = 0;
  /// Partition states of the split attention: min(kAttentionScratchMaxBytes, what max_rows rows
  /// at max_len would need).
  size_t attn_scratch = 0;
  size_t Total() const;
};
ActivationSizes ActivationBytes(const ModelConfig& c, const StepLimits& limits);

/// Rounds up to the 256-byte alignment of every device sub-allocation.
inline size_t AlignUp256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace kvbridge::cuda_internal
