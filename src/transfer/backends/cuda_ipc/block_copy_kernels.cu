// cuda_ipc/block_copy_kernels.cu — the gather/scatter kernel, its launch, and the pattern
// fill/verify kernels used by tests and benchmarks.
//
// Kernel shape (why): a KV transfer is many independent blocks of 4 KiB..256 KiB. One launch
// covers the whole list; a persistent grid (as many CTAs as can be resident) of warps loops over
// work items = (pair, chunk of 32 x kUnroll x 16 bytes). Each lane issues kUnroll independent
// 16-byte loads before its first store, so enough bytes are in flight to cover DRAM latency,
// and a warp's accesses are 512 contiguous bytes per step (fully coalesced). Consecutive items
// are chunks of the same block and go to neighbouring warps, which keeps DRAM pages open.
#include <algorithm>
#include <cstdint>

#include "transfer/backends/cuda_ipc/block_copy.h"
#include "transfer/backends/cuda_ipc/block_copy_launch.h"
#include "transfer/backends/cuda_ipc/cuda_status.h"

namespace kvbridge::cuda_ipc {
namespace {

constexpr int kThreads = 256;

struct CopyParams {
  const uint4* src;
  uint4* dst;
  uint64_t block_words;  // 16-byte words per block
  uint32_t chunks_per_block;
  uint32_t count;
  uint32_t read;  // 1: src = remote pool (READ); 0: src = local pool (WRITE)
};

struct InlinePairs {
  BlockPair p[kInlinePairs];
};
struct DevicePairs {
  const BlockPair* p;
};

__device__ __forceinline__ BlockPair PairAt(const InlinePairs& a, uint32_t i) { return a.p[i]; }
__device__ __forceinline__ BlockPair PairAt(const DevicePairs& a, uint32_t i) { return a.p[i]; }

template <bool kStreaming>
__device__ __forceinline__ uint4 Load(const uint4* p) {
  if constexpr (kStreaming) return __ldcs(p);
  return *p;
}
template <bool kStreaming>
__device__ __forceinline__ void Store(uint4* p, uint4 v) {
  if constexpr (kStreaming) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

// Absolute device addresses of one unit of a segment list (AddressPair).
struct InlineAddresses {
  AddressPair p[kInlineAddressPairs];
};
struct DeviceAddresses {
  const AddressPair* p;
};
__device__ __forceinline__ AddressPair PairAt(const InlineAddresses& a, uint32_t i) {
  return a.p[i];
}
__device__ __forceinline__ AddressPair PairAt(const DeviceAddresses& a, uint32_t i) {
  return a.p[i];
}

// Source and destination of pair `p`: block ids against the two bases, or absolute addresses.
__device__ __forceinline__ void Endpoints(const CopyParams& prm, const BlockPair& bp,
                                          const uint4*& s, uint4*& d) {
  const uint64_t src_block = prm.read ? bp.remote : bp.local;
  const uint64_t dst_block = prm.read ? bp.local : bp.remote;
  s = prm.src + src_block * prm.block_words;
  d = prm.dst + dst_block * prm.block_words;
}
__device__ __forceinline__ void Endpoints(const CopyParams& prm, const AddressPair& ap,
                                          const uint4*& s, uint4*& d) {
  s = reinterpret_cast<const uint4*>(prm.read ? ap.remote : ap.local);
  d = reinterpret_cast<uint4*>(prm.read ? ap.local : ap.remote);
}

template <int kUnroll, bool kStreaming, typename Pairs>
__global__ void __launch_bounds__(kThreads)
    BlockCopyKernel(const __grid_constant__ CopyParams prm, const __grid_constant__ Pairs pairs) {
  constexpr uint32_t kChunkWords = 32 * kUnroll;
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t n_warps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t total = prm.count * prm.chunks_per_block;  // < 2^31, checked on the host
  for (uint32_t item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < total;
       item += n_warps) {
    const uint32_t p = item / prm.chunks_per_block;
    const uint32_t c = item - p * prm.chunks_per_block;
    const uint4* s;
    uint4* d;
    Endpoints(prm, PairAt(pairs, p), s, d);
    const uint64_t first = uint64_t{c} * kChunkWords;
    s += first + lane;
    d += first + lane;
    const uint64_t left = prm.block_words - first;
    uint4 v[kUnroll];
    if (left >= kChunkWords) {
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) v[j] = Load<kStreaming>(s + 32 * j);
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) Store<kStreaming>(d + 32 * j, v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (lane + 32 * j < left) v[j] = Load<kStreaming>(s + 32 * j);
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (lane + 32 * j < left) Store<kStreaming>(d + 32 * j, v[j]);
      }
    }
  }
}

__host__ __device__ __forceinline__ uint64_t Pattern(uint64_t seed, uint64_t word) {
  uint64_t z = seed + (word + 1) * 0x9E3779B97F4A7C15ull;  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void FillKernel(uint64_t* base, uint64_t words, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < words;
       i += uint64_t{gridDim.x} * blockDim.x) {
    base[i] = Pattern(seed, i);
  }
}

__global__ void VerifyKernel(const uint64_t* base, uint64_t block_words8, uint64_t blocks,
                             const int32_t* src_of, uint64_t src_seed, uint64_t poison_seed,
                             unsigned long long* mismatches) {
  const uint64_t words = block_words8 * blocks;
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < words;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t d = i / block_words8;
    const uint64_t off = i - d * block_words8;
    const int32_t s = src_of[d];
    const uint64_t expect =
        s >= 0 ? Pattern(src_seed, uint64_t(s) * block_words8 + off) : Pattern(poison_seed, i);
    bad += base[i] != expect;
  }
  if (bad) atomicAdd(mismatches, bad);
}

template <int kUnroll, bool kStreaming>
const void* KernelFor(bool inline_pairs) {
  return inline_pairs
             ? reinterpret_cast<const void*>(&BlockCopyKernel<kUnroll, kStreaming, InlinePairs>)
             : reinterpret_cast<const void*>(&BlockCopyKernel<kUnroll, kStreaming, DevicePairs>);
}

const void* SelectKernel(int unroll, bool streaming, bool inline_pairs) {
  if (unroll == 4)
    return streaming ? KernelFor<4, true>(inline_pairs) : KernelFor<4, false>(inline_pairs);
  return streaming ? KernelFor<8, true>(inline_pairs) : KernelFor<8, false>(inline_pairs);
}

}  // namespace

Result<int> BlockCopyOccupancy(int unroll, bool streaming) {
  int per_sm = 0;
  KVB_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, SelectKernel(unroll, streaming, false), kThreads, 0));
  return per_sm;
}

Status LaunchBlockCopy(int unroll, bool streaming, int max_ctas, CopyOp op,
                       const BlockRegion& local, const BlockRegion& remote,
                       const BlockPair* device_pairs, std::span<const BlockPair> inline_pairs,
                       uint32_t count, cudaStream_t stream) {
  CopyParams prm{};
  const bool read = op == CopyOp::kRead;
  prm.src = static_cast<const uint4*>(read ? remote.base : local.base);
  prm.dst = static_cast<uint4*>(read ? local.base : remote.base);
  prm.block_words = local.block_bytes / 16;
  const uint64_t chunk_bytes = uint64_t{32} * unroll * 16;
  prm.chunks_per_block = static_cast<uint32_t>((local.block_bytes + chunk_bytes - 1) / chunk_bytes);
  prm.count = count;
  prm.read = read ? 1 : 0;
  const uint64_t items = uint64_t{count} * prm.chunks_per_block;
  const uint64_t warps_per_cta = kThreads / 32;
  const int ctas =
      static_cast<int>(std::min<uint64_t>(max_ctas, (items + warps_per_cta - 1) / warps_per_cta));
  const bool use_inline = device_pairs == nullptr;
  const void* fn = SelectKernel(unroll, streaming, use_inline);
  InlinePairs inl;
  DevicePairs dev{device_pairs};
  void* args[2] = {&prm, nullptr};
  if (use_inline) {
    std::copy(inline_pairs.begin(), inline_pairs.end(), inl.p);
    args[1] = &inl;
  } else {
    args[1] = &dev;
  }
  KVB_CUDA_RETURN_IF_ERROR(cudaLaunchKernel(fn, dim3(ctas), dim3(kThreads), args, 0, stream));
  return OkStatus();
}

template <int kUnroll, bool kStreaming>
const void* AddressKernelFor(bool inline_pairs) {
  return inline_pairs
             ? reinterpret_cast<const void*>(&BlockCopyKernel<kUnroll, kStreaming, InlineAddresses>)
             : reinterpret_cast<const void*>(
                   &BlockCopyKernel<kUnroll, kStreaming, DeviceAddresses>);
}

Status LaunchAddressCopy(int unroll, bool streaming, int max_ctas, CopyOp op, uint64_t unit_bytes,
                         const AddressPair* device_pairs, std::span<const AddressPair> inline_pairs,
                         uint32_t count, cudaStream_t stream) {
  CopyParams prm{};
  prm.block_words = unit_bytes / 16;
  const uint64_t chunk_bytes = uint64_t{32} * unroll * 16;
  prm.chunks_per_block = static_cast<uint32_t>((unit_bytes + chunk_bytes - 1) / chunk_bytes);
  prm.count = count;
  prm.read = op == CopyOp::kRead ? 1 : 0;
  const uint64_t items = uint64_t{count} * prm.chunks_per_block;
  const uint64_t warps_per_cta = kThreads / 32;
  const int ctas =
      static_cast<int>(std::min<uint64_t>(max_ctas, (items + warps_per_cta - 1) / warps_per_cta));
  const bool use_inline = device_pairs == nullptr;
  const void* fn = unroll == 4 ? (streaming ? AddressKernelFor<4, true>(use_inline)
                                            : AddressKernelFor<4, false>(use_inline))
                               : (streaming ? AddressKernelFor<8, true>(use_inline)
                                            : AddressKernelFor<8, false>(use_inline));
  InlineAddresses inl;
  DeviceAddresses dev{device_pairs};
  void* args[2] = {&prm, nullptr};
  if (use_inline) {
    std::copy(inline_pairs.begin(), inline_pairs.end(), inl.p);
    args[1] = &inl;
  } else {
    args[1] = &dev;
  }
  KVB_CUDA_RETURN_IF_ERROR(cudaLaunchKernel(fn, dim3(ctas), dim3(kThreads), args, 0, stream));
  return OkStatus();
}

Status FillPattern(void* base, uint64_t bytes, uint64_t seed, cudaStream_t stream) {
  if (base == nullptr || bytes % 16 != 0) return InvalidArgumentError("FillPattern: bad region");
  FillKernel<<<1024, 256, 0, stream>>>(static_cast<uint64_t*>(base), bytes / 8, seed);
  return CudaStatus(cudaGetLastError(), "FillKernel launch");
}

Result<uint64_t> VerifyBlocks(const BlockRegion& region, std::span<const int32_t> src_of,
                              uint64_t src_seed, uint64_t poison_seed, cudaStream_t stream) {
  if (region.base == nullptr || region.block_bytes % 16 != 0 || region.block_bytes == 0 ||
      src_of.size() != region.block_count) {
    return InvalidArgumentError("VerifyBlocks: bad region or src_of size");
  }
  int32_t* d_src = nullptr;
  unsigned long long* d_bad = nullptr;
  KVB_CUDA_RETURN_IF_ERROR(cudaMalloc(&d_src, std::max<size_t>(4, src_of.size_bytes())));
  Status st = CudaStatus(cudaMalloc(&d_bad, sizeof(*d_bad)), "cudaMalloc");
  unsigned long long bad = 0;
  if (st.ok())
    st = CudaStatus(
        cudaMemcpyAsync(d_src, src_of.data(), src_of.size_bytes(), cudaMemcpyHostToDevice, stream),
        "upload");
  if (st.ok()) st = CudaStatus(cudaMemsetAsync(d_bad, 0, sizeof(*d_bad), stream), "memset");
  if (st.ok()) {
    VerifyKernel<<<2048, 256, 0, stream>>>(static_cast<const uint64_t*>(region.base),
                                           region.block_bytes / 8, region.block_count, d_src,
                                           src_seed, poison_seed, d_bad);
    st = CudaStatus(cudaGetLastError(), "VerifyKernel launch");
  }
  if (st.ok())
    st = CudaStatus(cudaMemcpyAsync(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream),
                    "download");
  if (st.ok()) st = CudaStatus(cudaStreamSynchronize(stream), "verify sync");
  cudaFree(d_src);
  if (d_bad) cudaFree(d_bad);
  if (!st.ok()) return st;
  return static_cast<uint64_t>(bad);
}

}  // namespace kvbridge::cuda_ipc
