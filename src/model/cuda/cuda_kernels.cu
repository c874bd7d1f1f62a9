// The CUDA kernels of the GPU forward pass (cuda_kernels.h). Batch invariance: every output
// element is computed by code whose arithmetic depends only on its own row (and, for attention,
// on its sequence's cached KV), never on how many rows the step holds or where the row falls in a
// tile. Compiled with -fmad=false: no contraction of a*b+c behind our back, so the element-wise
// stages (RoPE, SwiGLU, softmax, norms) do the CPU's IEEE operations in the CPU's order.
#include <cuda_runtime.h>

#include <cstdint>

#include "model/cuda/cuda_constants.h"
#include "model/cuda/cuda_kernels.h"

namespace kvbridge::cuda_internal {
namespace {

// ---- scalar conversions: the CPU's (numerics.h), bit for bit ----

__device__ __forceinline__ float Bf16ToF(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}
__device__ __forceinline__ uint16_t FToBf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float Fp8ToF(uint8_t b) {
  const uint32_t exp = (b >> 3) & 0xfu, mant = b & 7u;
  float v;
  if (exp == 15 && mant == 7) {
    v = __uint_as_float(0x7fc00000u);
  } else if (exp == 0) {
    v = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9, exact
  } else {
    v = __uint_as_float(((exp - 7 + 127) << 23) | (mant << 20));
  }
  return (b & 0x80) ? -v : v;
}
__device__ __forceinline__ uint8_t FToFp8(float f) {
  if (isnan(f)) return 0x7f;
  const uint32_t u = __float_as_uint(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const float a = fabsf(f);
  if (a < 0.015625f) return sign | static_cast<uint8_t>(rintf(a * 512.0f));
  uint32_t r = u & 0x7fffffffu;
  if (r >= 0x43e00000u) return sign | 0x7e;
  r += 0x7ffffu + ((r >> 20) & 1u);
  const int exp = static_cast<int>(r >> 23) - 127 + 7;
  const uint32_t mant = (r >> 20) & 7u;
  if (exp > 15 || (exp == 15 && mant == 7)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((exp << 3) | mant);
}

// model_internal::Exp (numerics.cc): Cody-Waite + Cephes polynomial from IEEE +, -, * only.
__device__ __forceinline__ float Exp(float x) {
  if (isnan(x)) return x;
  if (x > 88.72283935546875f) return __uint_as_float(0x7f800000u);
  if (x < -103.972084045410156f) return 0.0f;
  const float k = rintf(x * 1.44269504088896341f);
  const float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int ki = static_cast<int>(k);
  if (ki > 127) return p * 2.0f * __uint_as_float(static_cast<uint32_t>(127 + 127) << 23);
  if (ki < -126) {
    return (p * __uint_as_float(static_cast<uint32_t>(ki + 64 + 127) << 23)) * 5.42101086e-20f;
  }
  return p * __uint_as_float(static_cast<uint32_t>(ki + 127) << 23);
}

// Butterfly sum over a warp: every lane ends with the same bits (each step adds a commutative
// pair), and the tree is fixed.
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- embedding ----

__global__ void EmbedKernel(const uint16_t* __restrict__ embed, const int32_t* __restrict__ tokens,
                            int h, float* __restrict__ x) {
  const int i = blockIdx.x;
  const uint16_t* e = embed + static_cast<size_t>(tokens[i]) * h;
  for (int j = threadIdx.x; j < h; j += blockDim.x)
    x[static_cast<size_t>(i) * h + j] = Bf16ToF(e[j]);
}

// ---- RMSNorm ----

__global__ void __launch_bounds__(kNormThreads)
    RmsNormKernel(const float* x, const int32_t* __restrict__ row_index, int n, int per_row,
                  size_t ldx, const float* __restrict__ w, float eps, void* y, size_t ldy,
                  bool y_bf16) {
  const int r = blockIdx.x;
  const int src = row_index != nullptr ? row_index[r] : r;
  const float* xr =
      x + static_cast<size_t>(src / per_row) * ldx + static_cast<size_t>(src % per_row) * n;
  const size_t yo = static_cast<size_t>(r / per_row) * ldy + static_cast<size_t>(r % per_row) * n;
  float s = 0.0f;
  for (int j = threadIdx.x; j < n; j += kNormThreads) s += xr[j] * xr[j];
  s = WarpSum(s);
  __shared__ float ws[kNormThreads / 32];
  if ((threadIdx.x & 31) == 0) ws[threadIdx.x >> 5] = s;
  __syncthreads();
  static_assert(kNormThreads == 256, "the tree below is written for 8 warps");
  const float ss = ((ws[0] + ws[1]) + (ws[2] + ws[3])) + ((ws[4] + ws[5]) + (ws[6] + ws[7]));
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
  for (int j = threadIdx.x; j < n; j += kNormThreads) {
    const float v = w[j] * (xr[j] * inv);
    if (y_bf16) {
      static_cast<uint16_t*>(y)[yo + j] = FToBf16(v);
    } else {
      static_cast<float*>(y)[yo + j] = v;
    }
  }
}

// ---- matmul: mma.sync m16n8k16 bf16 x bf16 -> fp32 ----

constexpr int kSk = kTileK + 8;  // smem row stride (bf16): 80 bytes, conflict-free fragments

__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Loads a [64][32] bf16 tile (rows [r0, r0+64) of src, k in [kt, kt+32) clipped to [.., k_end))
// into smem; zeros outside. 128 threads x 2 chunks of 8 elements.
__device__ __forceinline__ void LoadTile(const uint16_t* __restrict__ src, int ld, int rows, int r0,
                                         int kt, int k_end, uint16_t* dst) {
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int c = threadIdx.x + it * kMatmulThreads;
    const int row = c >> 2, kc = (c & 3) * 8;
    const int gr = r0 + row, gk = kt + kc;
    uint16_t* d = dst + row * kSk + kc;
    const size_t off = static_cast<size_t>(gr) * ld + gk;
    if (gr < rows && gk + 8 <= k_end && (off & 7) == 0) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(src + off);
    } else {
      uint16_t v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = (gr < rows && gk + e < k_end) ? src[off + e] : 0;
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(v);
    }
  }
}

__global__ void __launch_bounds__(kMatmulThreads)
    MatmulKernel(const uint16_t* __restrict__ a, int lda, const uint16_t* __restrict__ w, int m,
                 int n, int k, int shards, const float* __restrict__ bias,
                 float* __restrict__ out) {
  __shared__ __align__(16) uint16_t as[kTileM * kSk];
  __shared__ __align__(16) uint16_t bs[kTileN * kSk];
  const int s = blockIdx.z;
  const int k0 = static_cast<int>(static_cast<int64_t>(s) * k / shards);
  const int k1 = static_cast<int>(static_cast<int64_t>(s + 1) * k / shards);
  const int m0 = blockIdx.y * kTileM, n0 = blockIdx.x * kTileN;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  const int g = lane >> 2, t = lane & 3;
  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  // The fixed K order: 16-wide steps from k0 upwards (zeros past k1), the same for every m.
  for (int kt = k0; kt < k1; kt += kTileK) {
    LoadTile(a, lda, m, m0, kt, k1, as);
    LoadTile(w, k, n, n0, kt, k1, bs);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += kMmaK) {
      uint32_t af[2][4], bf[4][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint16_t* p = as + (wm + i * 16 + g) * kSk + kk + t * 2;
        af[i][0] = *reinterpret_cast<const uint32_t*>(p);
        af[i][1] = *reinterpret_cast<const uint32_t*>(p + 8 * kSk);
        af[i][2] = *reinterpret_cast<const uint32_t*>(p + 8);
        af[i][3] = *reinterpret_cast<const uint32_t*>(p + 8 * kSk + 8);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint16_t* p = bs + (wn + j * 8 + g) * kSk + kk + t * 2;
        bf[j][0] = *reinterpret_cast<const uint32_t*>(p);
        bf[j][1] = *reinterpret_cast<const uint32_t*>(p + 8);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) Mma(acc[i][j], af[i], bf[j]);
    }
    __syncthreads();
  }
  float* o = out + static_cast<size_t>(s) * m * n;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + wm + i * 16 + g + (e >> 1) * 8;
        const int col = n0 + wn + j * 8 + t * 2 + (e & 1);
        if (row < m && col < n) {
          float v = acc[i][j][e];
          if (shards == 1 && bias != nullptr) v += bias[col];
          o[static_cast<size_t>(row) * n + col] = v;
        }
      }
    }
  }
}

// ---- the row-parallel shard tree + residual ----

__global__ void ResidualTreeKernel(float* __restrict__ x, const float* __restrict__ p, size_t total,
                                   int n, const float* __restrict__ bias) {
  const size_t e = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= total) return;
  float v = ((p[e] + p[total + e]) + (p[2 * total + e] + p[3 * total + e])) +
            ((p[4 * total + e] + p[5 * total + e]) + (p[6 * total + e] + p[7 * total + e]));
  if (bias != nullptr) v += bias[e % n];
  x[e] += v;
}

// ---- RoPE ----

__global__ void RopeKernel(float* __restrict__ qkv, int ld, const int32_t* __restrict__ pos,
                           int heads, int hd, const float* __restrict__ cos_t,
                           const float* __restrict__ sin_t) {
  const int i = blockIdx.x, half = hd / 2;
  const float* cs = cos_t + static_cast<size_t>(pos[i]) * half;
  const float* sn = sin_t + static_cast<size_t>(pos[i]) * half;
  float* row = qkv + static_cast<size_t>(i) * ld;
  for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
    float* v = row + (idx / half) * hd;
    const int j = idx % half;
    const float x1 = v[j], x2 = v[j + half];
    v[j] = x1 * cs[j] - x2 * sn[j];
    v[j + half] = x2 * cs[j] + x1 * sn[j];
  }
}

// ---- KV cache write / read ----

__device__ __forceinline__ size_t KvOffset(const KvParams& kv, int block, int which, int head,
                                           int slot) {
  const size_t es = kv.dtype == 0 ? 4 : (kv.dtype == 1 ? 2 : 1);
  return static_cast<size_t>(block) * 2 * kv.half_block_bytes + which * kv.half_block_bytes +
         (static_cast<size_t>(head) * kv.block_size + slot) * kv.head_dim * es;
}
__device__ __forceinline__ void StoreOne(uint8_t* p, int d, int dtype, float v, float scale) {
  if (dtype == 0) {
    reinterpret_cast<float*>(p)[d] = v;
  } else if (dtype == 1) {
    reinterpret_cast<uint16_t*>(p)[d] = FToBf16(v);
  } else {
    p[d] = FToFp8(v / scale);
  }
}
__device__ __forceinline__ float LoadOne(const uint8_t* p, int d, int dtype, float scale) {
  if (dtype == 0) return reinterpret_cast<const float*>(p)[d];
  if (dtype == 1) return Bf16ToF(reinterpret_cast<const uint16_t*>(p)[d]);
  return Fp8ToF(p[d]) * scale;
}

__global__ void KvWriteKernel(const float* __restrict__ qkv, int ld, int k_col, int v_col,
                              const int32_t* __restrict__ pos,
                              const int32_t* __restrict__ table_off,
                              const int32_t* __restrict__ tables, KvParams kv, uint8_t* base,
                              float k_scale, float v_scale) {
  const int i = blockIdx.x;
  const int p = pos[i];
  const int block = tables[table_off[i] + p / kv.block_size];
  const int slot = p % kv.block_size;
  const float* row = qkv + static_cast<size_t>(i) * ld;
  for (int idx = threadIdx.x; idx < kv.num_kv_heads * kv.head_dim; idx += blockDim.x) {
    const int head = idx / kv.head_dim, d = idx % kv.head_dim;
    StoreOne(base + KvOffset(kv, block, 0, head, slot), d, kv.dtype, row[k_col + idx], k_scale);
    StoreOne(base + KvOffset(kv, block, 1, head, slot), d, kv.dtype, row[v_col + idx], v_scale);
  }
}

// ---- attention ----

constexpr int kMaxDimsPerLane = kMaxHeadDim / 32;

__global__ void AttentionKernel(const float* __restrict__ qkv, int ld,
                                const int32_t* __restrict__ pos,
                                const int32_t* __restrict__ table_off,
                                const int32_t* __restrict__ tables, KvParams kv,
                                const uint8_t* __restrict__ base, float k_scale, float v_scale,
                                int nh, float scale, uint16_t* __restrict__ out) {
  extern __shared__ float smem[];
  const int hd = kv.head_dim;
  float* ks = smem;
  float* vs = smem + kAttentionChunk * hd;
  const int i = blockIdx.x, g = blockIdx.y;
  const int group = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int head = g * group + warp;
  const int ps = pos[i];
  const int32_t* bt = tables + table_off[i];
  const float* q = qkv + static_cast<size_t>(i) * ld + static_cast<size_t>(head) * hd;
  float qr[kMaxDimsPerLane], acc[kMaxDimsPerLane];
#pragma unroll
  for (int e = 0; e < kMaxDimsPerLane; ++e) {
    const int d = lane + 32 * e;
    qr[e] = d < hd ? q[d] : 0.0f;
    acc[e] = 0.0f;
  }
  float mx = __uint_as_float(0xff800000u), den = 0.0f;  // -inf
  for (int c0 = 0; c0 <= ps; c0 += kAttentionChunk) {
    const int cn = min(kAttentionChunk, ps + 1 - c0);
    for (int idx = threadIdx.x; idx < cn * hd; idx += blockDim.x) {
      const int tt = idx / hd, d = idx % hd;
      const int p = c0 + tt;
      const int block = bt[p / kv.block_size], slot = p % kv.block_size;
      ks[idx] = LoadOne(base + KvOffset(kv, block, 0, g, slot), d, kv.dtype, k_scale);
      vs[idx] = LoadOne(base + KvOffset(kv, block, 1, g, slot), d, kv.dtype, v_scale);
    }
    __syncthreads();
    float sc[kAttentionChunk];
    float cmax = __uint_as_float(0xff800000u);
#pragma unroll
    for (int tt = 0; tt < kAttentionChunk; ++tt) {
      sc[tt] = 0.0f;
      if (tt < cn) {
        float part = 0.0f;
#pragma unroll
        for (int e = 0; e < kMaxDimsPerLane; ++e) {
          const int d = lane + 32 * e;
          if (d < hd) part += qr[e] * ks[tt * hd + d];
        }
        sc[tt] = WarpSum(part) * scale;
        cmax = fmaxf(cmax, sc[tt]);
      }
    }
    const float new_max = fmaxf(mx, cmax);
    const float corr = Exp(mx - new_max);
    den *= corr;
#pragma unroll
    for (int e = 0; e < kMaxDimsPerLane; ++e) acc[e] *= corr;
#pragma unroll
    for (int tt = 0; tt < kAttentionChunk; ++tt) {
      if (tt < cn) {
        const float pr = Exp(sc[tt] - new_max);
        den += pr;
#pragma unroll
        for (int e = 0; e < kMaxDimsPerLane; ++e) {
          const int d = lane + 32 * e;
          if (d < hd) acc[e] += pr * vs[tt * hd + d];
        }
      }
    }
    mx = new_max;
    __syncthreads();
  }
  uint16_t* o = out + static_cast<size_t>(i) * nh * hd + static_cast<size_t>(head) * hd;
#pragma unroll
  for (int e = 0; e < kMaxDimsPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < hd) o[d] = FToBf16(acc[e] / den);
  }
}

// ---- SwiGLU ----

__global__ void SiluMulKernel(const float* __restrict__ gu, size_t total, int im,
                              uint16_t* __restrict__ act) {
  const size_t e = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= total) return;
  const size_t i = e / im, j = e % im;
  const float g = gu[i * 2 * im + j];
  const float u = gu[i * 2 * im + im + j];
  act[e] = FToBf16(g / (1.0f + Exp(-g)) * u);
}

inline unsigned Blocks(size_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace

void LaunchEmbed(const uint16_t* embed, const int32_t* tokens, int m, int h, float* x,
                 cudaStream_t stream) {
  if (m > 0) EmbedKernel<<<m, 256, 0, stream>>>(embed, tokens, h, x);
}

void LaunchRmsNorm(const float* x, const int32_t* row_index, int rows, int n, int per_row,
                   size_t ldx, const float* w, float eps, void* y, size_t ldy, bool y_bf16,
                   cudaStream_t stream) {
  if (rows > 0) {
    RmsNormKernel<<<rows, kNormThreads, 0, stream>>>(x, row_index, n, per_row, ldx, w, eps, y, ldy,
                                                     y_bf16);
  }
}

void LaunchMatmul(const uint16_t* a, int lda, const uint16_t* w, int m, int n, int k, int shards,
                  const float* bias, float* out, cudaStream_t stream) {
  if (m <= 0 || n <= 0) return;
  const dim3 grid((n + kTileN - 1) / kTileN, (m + kTileM - 1) / kTileM, shards);
  MatmulKernel<<<grid, kMatmulThreads, 0, stream>>>(a, lda, w, m, n, k, shards, bias, out);
}

void LaunchResidualTree(float* x, const float* partial, int m, int n, const float* bias,
                        cudaStream_t stream) {
  const size_t total = static_cast<size_t>(m) * n;
  if (total > 0)
    ResidualTreeKernel<<<Blocks(total, 256), 256, 0, stream>>>(x, partial, total, n, bias);
}

void LaunchRope(float* qkv, int ld, int m, const int32_t* pos, int nh, int nkv, int hd,
                const float* cos, const float* sin, cudaStream_t stream) {
  if (m > 0) RopeKernel<<<m, 128, 0, stream>>>(qkv, ld, pos, nh + nkv, hd, cos, sin);
}

void LaunchKvWrite(const float* qkv, int ld, int k_col, int v_col, int m, const int32_t* pos,
                   const int32_t* table_off, const int32_t* tables, const KvParams& kv,
                   uint8_t* base, float k_scale, float v_scale, cudaStream_t stream) {
  if (m > 0) {
    KvWriteKernel<<<m, 128, 0, stream>>>(qkv, ld, k_col, v_col, pos, table_off, tables, kv, base,
                                         k_scale, v_scale);
  }
}

void LaunchAttention(const float* qkv, int ld, int m, const int32_t* pos, const int32_t* table_off,
                     const int32_t* tables, const KvParams& kv, const uint8_t* base, float k_scale,
                     float v_scale, int nh, float scale, uint16_t* out, cudaStream_t stream) {
  if (m <= 0) return;
  const int group = nh / kv.num_kv_heads;
  const size_t smem = 2 * static_cast<size_t>(kAttentionChunk) * kv.head_dim * sizeof(float);
  const dim3 grid(m, kv.num_kv_heads);
  AttentionKernel<<<grid, 32 * group, smem, stream>>>(qkv, ld, pos, table_off, tables, kv, base,
                                                      k_scale, v_scale, nh, scale, out);
}

void LaunchSiluMul(const float* gu, int m, int im, uint16_t* act, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(m) * im;
  if (total > 0) SiluMulKernel<<<Blocks(total, 256), 256, 0, stream>>>(gu, total, im, act);
}

}  // namespace kvbridge::cuda_internal
