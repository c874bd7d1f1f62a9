// Internal: the CUDA kernels of the GPU forward pass (cuda_kernels.cu) behind plain launch
// functions. Every launch goes on `stream` and returns without waiting; errors surface at the
// next cudaGetLastError / synchronization. Shapes: row-major, rows = the step's tokens.
// bf16 buffers are uint16_t (the bits).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvbridge::cuda_internal {

/// The paged KV layout as the kernels see it (kv_cache_view.h).
struct KvParams {
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int dtype = 0;  ///< KvDtype value: 0 fp32, 1 bf16, 2 fp8 e4m3
  size_t half_block_bytes = 0;
};

/// x[i][:] = float(embed[tokens[i]][:]).
void LaunchEmbed(const uint16_t* embed, const int32_t* tokens, int m, int h, float* x,
                 cudaStream_t stream);

/// RMSNorm of `rows` vectors of n floats (HF LlamaRMSNorm, y = w * (x * rsqrt(mean(x^2)+eps))),
/// fixed reduction tree (256 threads: strided sequential sums, warp butterfly, 8-warp tree).
/// Input row r is src = row_index ? row_index[r] : r at x + (src / per_row) * ldx +
/// (src % per_row) * n; output row r at y + (r / per_row) * ldy + (r % per_row) * n (per_row > 1:
/// per-head norms inside a token row). y may equal x. y is bf16 when y_bf16, else fp32.
void LaunchRmsNorm(const float* x, const int32_t* row_index, int rows, int n, int per_row,
                   size_t ldx, const float* w, float eps, void* y, size_t ldy, bool y_bf16,
                   cudaStream_t stream);

/// out[s][i][j] = sum over shard s's K range of a[i][k] * w[j][k] (+ bias[j] when shards == 1
/// and bias != null), i < m, j < n; shards 1 or 8 (cuda_plan.h PlanMatmul). a: [m][lda] bf16,
/// w: [n][k] bf16, out: [shards][m][n] fp32. Every element: one fp32 accumulator, one
/// m16n8k16 mma per 16-wide k step ascending from the shard's start, whatever m and whichever
/// tile shape runs (m <= kMatmulSmallM: 16 x 32 tiles with 128-wide K stages, <= kMatmulMediumM: 64 x 64, else
/// 128 x 128; a cp.async pipeline when
/// lda, k / shards are multiples of 8 and a, w 16-byte aligned, else the plain 64 x 64 kernel).
void LaunchMatmul(const uint16_t* a, int lda, const uint16_t* w, int m, int n, int k, int shards,
                  const float* bias, float* out, cudaStream_t stream);

/// x[i][j] += ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)) (+ bias[j]), p_s = partial[s][i][j].
void LaunchResidualTree(float* x, const float* partial, int m, int n, const float* bias,
                        cudaStream_t stream);

/// In place on qkv ([m][ld]; query heads at column 0, key heads right after): RoPE of the
/// nh + nkv head vectors of each row at pos[i] with tables [max_pos][hd/2].
void LaunchRope(float* qkv, int ld, int m, const int32_t* pos, int nh, int nkv, int hd,
                const float* cos, const float* sin, cudaStream_t stream);

/// Writes row i's K (qkv[i][k_col ...]) and V (qkv[i][v_col ...]) into the paged cache `base`
/// at pos[i] through the row's block table (tables + table_off[i]); fp8 stores value / scale.
void LaunchKvWrite(const float* qkv, int ld, int k_col, int v_col, int m, const int32_t* pos,
                   const int32_t* table_off, const int32_t* tables, const KvParams& kv,
                   uint8_t* base, float k_scale, float v_scale, cudaStream_t stream);

/// Attention of every query head of row i over positions [0, pos[i]] of its sequence, reading K/V
/// from the cache; output out[i][head*hd + d] as bf16. Positions go in partitions of
/// kAttentionPartition aligned to absolute positions (16-position online-softmax chunks inside,
/// from a fresh state), the partitions' states folded in ascending order: the same bits whichever
/// schedule runs. With max_pos (>= every pos[i]) spanning several partitions and
/// m * partitions * nh * (hd + 2) <= scratch_floats, one CTA per (row, KV head, partition) writes
/// states to `scratch` and a second kernel folds them (decode); else one CTA per (row, KV head)
/// walks its partitions in order. One warp per query head.
void LaunchAttention(const float* qkv, int ld, int m, const int32_t* pos, const int32_t* table_off,
                     const int32_t* tables, const KvParams& kv, const uint8_t* base, float k_scale,
                     float v_scale, int nh, float scale, uint16_t* out, int max_pos, float* scratch,
                     size_t scratch_floats, cudaStream_t stream);

/// Tests: -1 (default) picks the attention schedule by shape; 0 forces one CTA per (row, KV head)
/// walking partitions, 1 the split across CTAs (when the scratch holds it). Same bits either way.
void SetAttentionScheduleForTest(int schedule);

/// Element i of dst = model_internal::RandomWeightBf16(state0, i, offset, a) (numerics_hd.h):
/// the bits WriteRandomModel writes for that tensor; the F32 variant stores them widened.
void LaunchRandomBf16(uint16_t* dst, size_t count, uint64_t state0, float offset, float a,
                      cudaStream_t stream);
void LaunchRandomF32(float* dst, size_t count, uint64_t state0, float offset, float a,
                     cudaStream_t stream);

/// act[i][j] = bf16(silu(gu[i][j]) * gu[i][im + j]).
void LaunchSiluMul(const float* gu, int m, int im, uint16_t* act, cudaStream_t stream);

}  // namespace kvbridge::cuda_internal
