// Internal: the shapes shared by the CUDA kernels (cuda_kernels.cu) and their CPU-side plans
// (cuda_plan.h). Plain constants, included by nvcc and the host compiler alike.
#pragma once

#include <cstddef>

namespace kvbridge::cuda_internal {

constexpr int kTileM = 64;           ///< rows of X per matmul CTA
constexpr int kTileN = 64;           ///< rows of W (output columns) per matmul CTA
constexpr int kTileK = 32;           ///< K per shared-memory stage (two mma k-steps)
constexpr int kMmaK = 16;            ///< K of one mma.sync m16n8k16: the unit of the fixed K order
constexpr int kMatmulThreads = 128;  ///< 4 warps, each 32 x 32 of the 64 x 64 tile
constexpr int kMatmulSmallM = 16;    ///< rows up to which the 16 x 32 tile shape runs
constexpr int kMatmulMediumM = 128;  ///< then 64 x 64 tiles up to here, 128 x 128 above
constexpr int kRowParallelShards = 8;  ///< as the CPU (model_impl.h)
constexpr int kAttentionChunk = 16;    ///< as the CPU (model_impl.h)
/// Attention partitions (positions, aligned): each from a fresh softmax state, folded in order.
constexpr int kAttentionPartition = 128;
constexpr int kAttentionThreads = 128;  ///< one per position of a partition
/// Dynamic shared memory an attention CTA may take (H100/H200: 227 KiB opt-in per block).
constexpr size_t kAttentionMaxSmem = 227 * 1024;
/// Bytes of one staged K or V row: head_dim elements as stored, padded by 4 (no bank conflicts).
constexpr int AttentionRowBytes(int head_dim, int kv_dtype) {
  return head_dim * (kv_dtype == 0 ? 4 : (kv_dtype == 1 ? 2 : 1)) + 4;
}
/// Shared memory of one attention CTA (cuda_kernels.cu CarveSmem): K and V rows of a partition,
/// and per query head of the group: q, the partition's and the running acc, scores, chunk maxes and
/// corrections, (m, den) x 3, the running fold.
constexpr size_t AttentionSmemBytes(int head_dim, int kv_dtype, int group) {
  return 2 * static_cast<size_t>(kAttentionPartition) * AttentionRowBytes(head_dim, kv_dtype) +
         4 * static_cast<size_t>(group) *
             (3 * head_dim + kAttentionPartition + 2 * (kAttentionPartition / kAttentionChunk) + 6);
}
/// At most this much scratch for the partition states of the split (decode) attention.
constexpr size_t kAttentionScratchMaxBytes = size_t{64} << 20;
constexpr int kMaxHeadDim = 256;
constexpr int kNormThreads = 256;

}  // namespace kvbridge::cuda_internal
