// The two ceilings of the decode roofline (issue 19), measured on the GPU the bench runs on:
// a read-only streaming kernel (16-byte loads, 8 in flight per thread, a persistent grid; the
// loaded words are folded into one XOR per thread so nothing is optimised away) and a dense
// tensor-core loop (mma.sync m16n8k16 bf16 -> fp32 from registers, 8 independent accumulators
// per warp, no memory traffic in the loop).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "bench/cuda_roofline.h"

namespace kvbridge::bench {
namespace {

__global__ void StreamReadKernel(const uint4* __restrict__ p, size_t n,
                                 uint32_t* __restrict__ sink) {
  uint32_t x = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 8; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) sink[0] = x;  // practically never: keeps the loads alive
}

__global__ void FillKernel(uint4* p, size_t n) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint32_t a = static_cast<uint32_t>(i * 2654435761u);
    p[i] = make_uint4(a, a ^ 0x5bd1e995u, a + 7u, ~a);
  }
}

__global__ void MmaLoopKernel(int iters, float* __restrict__ sink) {
  uint32_t a[4], b[2];
  const uint32_t seed = threadIdx.x * 0x9e3779b9u + blockIdx.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = (seed + i) & 0x3f803f80u;  // small bf16 pairs
  b[0] = (seed ^ 0x3c003c00u) & 0x3f803f80u;
  b[1] = b[0] ^ 0x00800080u;
  float c[8][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  if (s == 1.2345f) sink[0] = s;
}

}  // namespace

double MeasureReadBandwidth(size_t bytes, int reps, std::string* error) {
  uint4* p = nullptr;
  uint32_t* sink = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess || cudaMalloc(&sink, 4) != cudaSuccess) {
    cudaGetLastError();
    *error = "roofline: cudaMalloc of the stream buffer failed";
    return 0.0;
  }
  const size_t n = bytes / 16;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  FillKernel<<<sms * 8, 256>>>(p, n);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  double best = 0.0;
  for (int r = 0; r < reps + 1; ++r) {
    cudaEventRecord(e0);
    StreamReadKernel<<<sms * 4, 512>>>(p, n, sink);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    if (r > 0) best = std::max(best, static_cast<double>(bytes) / (ms * 1e-3));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const cudaError_t e = cudaGetLastError();
  cudaFree(p);
  cudaFree(sink);
  if (e != cudaSuccess) {
    *error = std::string("roofline stream: ") + cudaGetErrorString(e);
    return 0.0;
  }
  return best;
}

double MeasureMmaPeak(int reps, std::string* error) {
  float* sink = nullptr;
  cudaMalloc(&sink, 4);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int blocks = sms * 4, threads = 256, iters = 4096;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  double best = 0.0;
  for (int r = 0; r < reps + 1; ++r) {
    cudaEventRecord(e0);
    MmaLoopKernel<<<blocks, threads>>>(iters, sink);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    const double flops =
        2.0 * 16 * 8 * 16 * 8.0 * iters * (static_cast<double>(blocks) * threads / 32);
    if (r > 0) best = std::max(best, flops / (ms * 1e-3));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const cudaError_t e = cudaGetLastError();
  cudaFree(sink);
  if (e != cudaSuccess) {
    *error = std::string("roofline mma: ") + cudaGetErrorString(e);
    return 0.0;
  }
  return best;
}

}  // namespace kvbridge::bench
