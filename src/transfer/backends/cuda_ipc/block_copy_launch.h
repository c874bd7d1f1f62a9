// cuda_ipc/block_copy_launch.h — internal: the kernel launch behind CopyEngine.
#pragma once

#include <cuda_runtime.h>

#include <span>

#include "transfer/backends/cuda_ipc/block_copy.h"

namespace kvbridge::cuda_ipc {

/// Resident CTAs per SM of the copy kernel variant (unroll 4 or 8).
Result<int> BlockCopyOccupancy(int unroll, bool streaming);

/// One launch over `count` pairs, read from `device_pairs` or, when it is null, from
/// `inline_pairs` (<= kInlinePairs, passed in the kernel parameters). Inputs already validated.
Status LaunchBlockCopy(int unroll, bool streaming, int max_ctas, CopyOp op,
                       const BlockRegion& local, const BlockRegion& remote,
                       const BlockPair* device_pairs, std::span<const BlockPair> inline_pairs,
                       uint32_t count, cudaStream_t stream);

/// Same kernel over absolute address pairs of `unit_bytes` each (CopyEngine::PostAddresses).
Status LaunchAddressCopy(int unroll, bool streaming, int max_ctas, CopyOp op, uint64_t unit_bytes,
                         const AddressPair* device_pairs, std::span<const AddressPair> inline_pairs,
                         uint32_t count, cudaStream_t stream);

}  // namespace kvbridge::cuda_ipc
