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
constexpr int kRowParallelShards = 8;  ///< as the CPU (model_impl.h)
constexpr int kAttentionChunk = 16;    ///< as the CPU (model_impl.h)
/// Attention partitions (positions, aligned): each from a fresh softmax state, folded in order.
constexpr int kAttentionPartition = 128;
/// At most this much scratch for the partition states of the split (decode) attention.
constexpr size_t kAttentionScratchMaxBytes = size_t{64} << 20;
constexpr int kMaxHeadDim = 256;
constexpr int kNormThreads = 256;

}  // namespace kvbridge::cuda_internal
