// The CUDA kernels of the GPU forward pass (cuda_kernels.h). Batch invariance: every output
// element is computed by code whose arithmetic depends only on its own row (and, for attention,
// on its sequence's cached KV), never on how many rows the step holds or where the row falls in a
// tile. Compiled with -fmad=false: no contraction of a*b+c behind our back, so the element-wise
// stages (RoPE, SwiGLU, softmax, norms) do the CPU's IEEE operations in the CPU's order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "model/cuda/cuda_constants.h"
#include "model/cuda/cuda_kernels.h"
#include "model/numerics_hd.h"

namespace kvbridge::cuda_internal {
namespace {

// ---- scalar conversions and exp: the CPU's, one definition (numerics_hd.h) ----

using model_internal::ExpIeee;

__device__ __forceinline__ float Bf16ToF(uint16_t h) { return model_internal::Bf16ToFloat(h); }
__device__ __forceinline__ uint16_t FToBf16(float f) { return model_internal::FloatToBf16(f); }
// The CPU decodes through a table (numerics.cc); these are the same 256 values.
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
__device__ __forceinline__ uint8_t FToFp8(float f) { return model_internal::FloatToFp8E4M3(f); }
__device__ __forceinline__ float Exp(float x) { return ExpIeee(x); }

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

// ---- matmul, pipelined: cp.async multi-stage, two tile shapes with ONE per-element K order ----
//
// The same arithmetic as MatmulKernel for every output element: one fp32 accumulator, one
// m16n8k16 mma per 16-wide k step, the steps ascending from the shard's k0 and stopping at the
// last step that starts below k1 (zeros past k1). What differs between the two tile shapes (and
// from MatmulKernel) is only which CTA and warp own an element and how the tiles reach shared
// memory, so a token's outputs are the same bits whether its step has 1 row or 2048.
// Small M (<= 16): 16 x 32 tiles (four warps side by side along N, one 16 x 8 mma each), 8
// stages of 64-wide K, so the weight stream has enough bytes in flight with one row. Large M:
// 64 x 64 tiles (2 x 2 warps of 32 x 32), 4 stages.
// Preconditions (checked by LaunchMatmul, else MatmulKernel): lda, k and every shard bound
// multiples of 8, a and w 16-byte aligned.

// BK: K per stage; smem rows BK + 8 bf16 (144 / 272 bytes: conflict-free fragment loads).

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;  // 0: no read, 16 zero bytes written
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int BK>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32)
    MatmulPipeKernel(const uint16_t* __restrict__ a, int lda, const uint16_t* __restrict__ w, int m,
                     int n, int k, int shards, const float* __restrict__ bias,
                     float* __restrict__ out) {
  constexpr int kThreads = WARPS_M * WARPS_N * 32;
  constexpr int kPk = BK, kPs = BK + 8;
  constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
  constexpr int MI = WTM / 16, NI = WTN / 8;
  extern __shared__ __align__(16) uint16_t psmem[];
  uint16_t* as = psmem;                      // [STAGES][BM][kPs]
  uint16_t* bs = psmem + STAGES * BM * kPs;  // [STAGES][BN][kPs]
  const int s = blockIdx.z;
  const int k0 = static_cast<int>(static_cast<int64_t>(s) * k / shards);
  const int k1 = static_cast<int>(static_cast<int64_t>(s + 1) * k / shards);
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = (warp / WARPS_N) * WTM, wn = (warp % WARPS_N) * WTN;
  const int g = lane >> 2, t = lane & 3;
  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  const int nk = (k1 - k0 + kPk - 1) / kPk;
  auto load = [&](int slot, int kt) {
    uint16_t* ad = as + slot * BM * kPs;
    uint16_t* bd = bs + slot * BN * kPs;
    constexpr int kChunks = kPk / 8;
    for (int c = threadIdx.x; c < BM * kChunks; c += kThreads) {
      const int row = c / kChunks, kc = (c % kChunks) * 8;
      const int gr = m0 + row, gk = kt + kc;
      const bool ok = gr < m && gk < k1;
      CpAsync16(ad + row * kPs + kc, ok ? a + static_cast<size_t>(gr) * lda + gk : a, ok);
    }
    for (int c = threadIdx.x; c < BN * kChunks; c += kThreads) {
      const int row = c / kChunks, kc = (c % kChunks) * 8;
      const int gr = n0 + row, gk = kt + kc;
      const bool ok = gr < n && gk < k1;
      CpAsync16(bd + row * kPs + kc, ok ? w + static_cast<size_t>(gr) * k + gk : w, ok);
    }
  };
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < nk) load(st, k0 + st * kPk);
    CpAsyncCommit();
  }
  for (int it = 0; it < nk; ++it) {
    CpAsyncWait<STAGES - 2>();
    __syncthreads();  // stage `it` landed for all threads; slot (it - 1) % STAGES is free
    {
      const int nx = it + STAGES - 1;
      if (nx < nk) load(nx % STAGES, k0 + nx * kPk);
      CpAsyncCommit();
    }
    const int kt = k0 + it * kPk;
    const uint16_t* at = as + (it % STAGES) * BM * kPs;
    const uint16_t* bt = bs + (it % STAGES) * BN * kPs;
#pragma unroll
    for (int kk = 0; kk < kPk; kk += kMmaK) {
      if (kt + kk < k1) {  // uniform over the CTA: the steps are a function of (k0, k1) only
        uint32_t af[MI][4], bf[NI][2];
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          const uint16_t* p = at + (wm + i * 16 + g) * kPs + kk + t * 2;
          af[i][0] = *reinterpret_cast<const uint32_t*>(p);
          af[i][1] = *reinterpret_cast<const uint32_t*>(p + 8 * kPs);
          af[i][2] = *reinterpret_cast<const uint32_t*>(p + 8);
          af[i][3] = *reinterpret_cast<const uint32_t*>(p + 8 * kPs + 8);
        }
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const uint16_t* p = bt + (wn + j * 8 + g) * kPs + kk + t * 2;
          bf[j][0] = *reinterpret_cast<const uint32_t*>(p);
          bf[j][1] = *reinterpret_cast<const uint32_t*>(p + 8);
        }
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j) Mma(acc[i][j], af[i], bf[j]);
      }
    }
  }
  CpAsyncWait<0>();
  float* o = out + static_cast<size_t>(s) * m * n;
#pragma unroll
  for (int i = 0; i < MI; ++i) {
#pragma unroll
    for (int j = 0; j < NI; ++j) {
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

// The tile shapes: (BM, BN, warps along M, along N, stages, BK). Small: M <= kMatmulSmallM (decode
// of few sequences, bandwidth: 16 x 32 tiles, 4 stages of 128-wide K); medium: M <= kMatmulMediumM
// (64 x 64, 4 warps of 32 x 32; measured faster here than 128 x 32 tiles); large: prefill
// (128 x 128 tiles, 8 warps of 64 x 32).
template <int BM, int BN, int WM, int WN, int ST, int BK = 64>
struct TileShape {
  static constexpr int kThreads = WM * WN * 32;
  static constexpr size_t kSmem = static_cast<size_t>(ST) * (BM + BN) * (BK + 8) * 2;
  static void Launch(const uint16_t* a, int lda, const uint16_t* w, int m, int n, int k, int shards,
                     const float* bias, float* out, cudaStream_t stream) {
    const dim3 grid((n + BN - 1) / BN, (m + BM - 1) / BM, shards);
    MatmulPipeKernel<BM, BN, WM, WN, ST, BK>
        <<<grid, kThreads, kSmem, stream>>>(a, lda, w, m, n, k, shards, bias, out);
  }
  static void SetSmem() {
    cudaFuncSetAttribute(MatmulPipeKernel<BM, BN, WM, WN, ST, BK>,
                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
  }
};
using SmallTile = TileShape<16, 32, 1, 4, 8>;
using SmallTile16 = TileShape<16, 16, 1, 2, 8>;         // variant 1: twice the CTAs
using SmallTileK128 = TileShape<16, 32, 1, 4, 4, 128>;  // variant 2: 256-byte row segments
using SmallTile64 = TileShape<16, 64, 1, 4, 6>;         // variant 3: 16 x 16 per warp
using MediumTile = TileShape<64, 64, 2, 2, 4>;
using MediumTile128 = TileShape<128, 64, 2, 4, 4>;  // variant 1: one M tile up to 128 rows
using LargeTile = TileShape<128, 128, 2, 4, 3>;

// Tile-shape variants (KVB_MATMUL_SMALL / KVB_MATMUL_MEDIUM, read once; for the speed bench and
// the device tests, which run the invariance cases under each): every variant keeps the
// per-element K order, so the choice never changes a bit.
int EnvVariant(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr ? std::atoi(e) : 0;
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
//
// A row attends over positions [0, pos] in PARTITIONS of kAttentionPartition (P) positions
// aligned to absolute positions (partition j = [j P, (j + 1) P) clipped to pos + 1). Inside a
// partition, the online softmax of the CPU over 16-position chunks from a fresh state (max -inf,
// den 0, acc 0): chunk c's running max M_c = max(M_{c-1}, max of its scores), corr_c =
// exp(M_{c-1} - M_c), den = den * corr_c + p_t and acc[d] = acc[d] * corr_c + p_t v_t[d] for t
// ascending, p_t = exp(s_t - M_c), s_t = (sum over d ascending of q[d] k_t[d]) * scale. The
// partitions' states are folded in ascending j (Fold). All of it is a function of the row's
// position and its cached KV only, so every schedule gives the same bits: one CTA per (row, KV
// head) walking its partitions in order (AttentionSeqKernel: prefill, many rows), or one CTA per
// (row, KV head, partition) writing its state to scratch and a warp per (row, head) folding them
// in order (AttentionPartKernel + AttentionCombineKernel: decode, few rows). A CTA of
// kAttentionThreads threads (one per position of the partition) computes a partition for all
// the query heads of its KV head: K/V rows staged once in shared memory as stored (rows padded
// by 4 bytes: conflict-free), scores thread-per-position, the softmax recurrences
// thread-per-(head, dim).

constexpr int kMaxDimsPerLane = kMaxHeadDim / 32;
constexpr int kChunksPerPartition = kAttentionPartition / kAttentionChunk;
static_assert(kAttentionThreads == kAttentionPartition, "one thread per partition position");

__device__ __forceinline__ float Neg_inf() { return __uint_as_float(0xff800000u); }

// Shared-memory layout of one attention CTA (AttentionSmemBytes on the host mirrors it).
struct AttnSmem {
  uint8_t* k;    // [P][row_bytes]
  uint8_t* v;    // [P][row_bytes]
  float* q;      // [group][hd]
  float* p;      // [group][P]: scores, then probabilities
  float* mrun;   // [group][chunks]: running max after chunk c
  float* corr;   // [group][chunks]
  float* mden;   // [group][2]: the partition's (m, den)
  float* fold;   // [group][2]: (a, b) of the fold
  float* pacc;   // [group][hd]: the partition's acc
  float* racc;   // [group][hd]: the running fold (AttentionSeqKernel)
  float* rmden;  // [group][2]: the running (m, den)
};
__device__ __forceinline__ AttnSmem CarveSmem(void* base, int row_bytes, int group, int hd) {
  AttnSmem m;
  uint8_t* b = static_cast<uint8_t*>(base);
  m.k = b;
  b += static_cast<size_t>(kAttentionPartition) * row_bytes;
  m.v = b;
  b += static_cast<size_t>(kAttentionPartition) * row_bytes;
  float* f = reinterpret_cast<float*>(b);
  m.q = f;
  f += group * hd;
  m.p = f;
  f += group * kAttentionPartition;
  m.mrun = f;
  f += group * kChunksPerPartition;
  m.corr = f;
  f += group * kChunksPerPartition;
  m.mden = f;
  f += group * 2;
  m.fold = f;
  f += group * 2;
  m.pacc = f;
  f += group * hd;
  m.racc = f;
  f += group * hd;
  m.rmden = f;
  return m;
}

template <int DT>
__device__ __forceinline__ float KvAt(const uint8_t* row, int d, float scale) {
  if constexpr (DT == 0) {
    return reinterpret_cast<const float*>(row)[d];
  } else if constexpr (DT == 1) {
    return Bf16ToF(reinterpret_cast<const uint16_t*>(row)[d]);
  } else {
    return Fp8ToF(row[d]) * scale;
  }
}

__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(gmem));
}

// Stages K/V rows of positions [p0, p0 + n) (KV head g) into shared memory: one warp per
// position at a time (the block lookup once per row), lanes over 4-byte words, every copy in
// flight at once (cp.async), then waits.
template <int DT>
__device__ __forceinline__ void StageRows(const KvParams& kv, const uint8_t* __restrict__ base,
                                          const int32_t* __restrict__ bt, int g, int p0, int n,
                                          int row_bytes, const AttnSmem& sm) {
  constexpr int es = DT == 0 ? 4 : (DT == 1 ? 2 : 1);
  const int words = kv.head_dim * es / 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int t = warp; t < n; t += warps) {
    const int p = p0 + t;
    const int block = bt[p / kv.block_size], slot = p % kv.block_size;
    const uint32_t* kg = reinterpret_cast<const uint32_t*>(base + KvOffset(kv, block, 0, g, slot));
    const uint32_t* vg = reinterpret_cast<const uint32_t*>(base + KvOffset(kv, block, 1, g, slot));
    uint32_t* ks = reinterpret_cast<uint32_t*>(sm.k + static_cast<size_t>(t) * row_bytes);
    uint32_t* vs = reinterpret_cast<uint32_t*>(sm.v + static_cast<size_t>(t) * row_bytes);
    for (int w = lane; w < words; w += 32) {
      CpAsync4(ks + w, kg + w);
      CpAsync4(vs + w, vg + w);
    }
  }
  CpAsyncCommit();
  CpAsyncWait<0>();
}

// The partition [p0, p1) of row i, KV head g: leaves (m, den) per head in sm.mden and acc in
// sm.pacc ([group][hd]; thread-per-(head, dim) items it = threadIdx.x + k * threads).
template <int DT>
__device__ void PartitionCta(const KvParams& kv, const uint8_t* __restrict__ base,
                             const int32_t* __restrict__ bt, int g, int group, int p0, int p1,
                             float k_scale, float v_scale, float scale, int row_bytes,
                             const AttnSmem& sm, int items) {
  const int hd = kv.head_dim, n = p1 - p0, tid = threadIdx.x;
  StageRows<DT>(kv, base, bt, g, p0, n, row_bytes, sm);
  __syncthreads();
  // Scores: thread t, every head of the group, dims ascending.
  if (tid < n) {
    const uint8_t* kr = sm.k + static_cast<size_t>(tid) * row_bytes;
    for (int h0 = 0; h0 < group; h0 += 8) {
      float sc[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) sc[u] = 0.0f;
#pragma unroll 4
      for (int d = 0; d < hd; ++d) {
        const float kv_d = KvAt<DT>(kr, d, k_scale);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (h0 + u < group) sc[u] += sm.q[(h0 + u) * hd + d] * kv_d;
        }
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (h0 + u < group) sm.p[(h0 + u) * kAttentionPartition + tid] = sc[u] * scale;
      }
    }
  }
  __syncthreads();
  const int nc = (n + kAttentionChunk - 1) / kAttentionChunk;
  // Running max and corrections: one thread per head (chunk maxes are exact in any order).
  if (tid < group) {
    float m = Neg_inf();
    for (int c = 0; c < nc; ++c) {
      float cm = Neg_inf();
      const int t1 = min(n, (c + 1) * kAttentionChunk);
      for (int t = c * kAttentionChunk; t < t1; ++t)
        cm = fmaxf(cm, sm.p[tid * kAttentionPartition + t]);
      const float nm = fmaxf(m, cm);
      sm.corr[tid * kChunksPerPartition + c] = Exp(m - nm);
      sm.mrun[tid * kChunksPerPartition + c] = nm;
      m = nm;
    }
    sm.mden[tid * 2] = m;
  }
  __syncthreads();
  for (int idx = tid; idx < group * n; idx += blockDim.x) {
    const int h = idx / n, t = idx % n;
    float& x = sm.p[h * kAttentionPartition + t];
    x = Exp(x - sm.mrun[h * kChunksPerPartition + t / kAttentionChunk]);
  }
  __syncthreads();
  if (tid < group) {
    float den = 0.0f;
    for (int c = 0; c < nc; ++c) {
      den *= sm.corr[tid * kChunksPerPartition + c];
      const int t1 = min(n, (c + 1) * kAttentionChunk);
#pragma unroll
      for (int u = 0; u < kAttentionChunk; ++u) {
        const int t = c * kAttentionChunk + u;
        if (t < t1) den += sm.p[tid * kAttentionPartition + t];
      }
    }
    sm.mden[tid * 2 + 1] = den;
  }
  // acc of (head, dim) items, four chains at a time.
  for (int k0 = 0; k0 < items; k0 += 4) {
    float a4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int hh[4], dd[4];
    bool ok[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int it = tid + (k0 + u) * blockDim.x;
      ok[u] = k0 + u < items && it < group * hd;
      hh[u] = ok[u] ? it / hd : 0;
      dd[u] = ok[u] ? it % hd : 0;
    }
    for (int c = 0; c < nc; ++c) {
#pragma unroll
      for (int u = 0; u < 4; ++u) a4[u] *= sm.corr[hh[u] * kChunksPerPartition + c];
      const int t1 = min(n, (c + 1) * kAttentionChunk);
#pragma unroll
      for (int x = 0; x < kAttentionChunk; ++x) {
        const int t = c * kAttentionChunk + x;
        if (t < t1) {
          const uint8_t* vr = sm.v + static_cast<size_t>(t) * row_bytes;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            a4[u] += sm.p[hh[u] * kAttentionPartition + t] * KvAt<DT>(vr, dd[u], v_scale);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (ok[u]) sm.pacc[tid + (k0 + u) * blockDim.x] = a4[u];
    }
  }
  __syncthreads();  // mden, pacc visible; K/V/p free for the next partition
}

__device__ __forceinline__ void LoadGroupQuery(const float* __restrict__ qkv, int ld, int i, int g,
                                               int group, int hd, const AttnSmem& sm) {
  const float* q = qkv + static_cast<size_t>(i) * ld + static_cast<size_t>(g) * group * hd;
  for (int idx = threadIdx.x; idx < group * hd; idx += blockDim.x) sm.q[idx] = q[idx];
}

// (rm, rden, racc) <- fold with (m, den, acc): the fixed fold of ascending partitions.
__device__ __forceinline__ float FoldA(float rm, float m) { return Exp(rm - fmaxf(rm, m)); }
__device__ __forceinline__ float FoldB(float rm, float m) { return Exp(m - fmaxf(rm, m)); }

// One CTA per (row, KV head): the row's partitions in order, folded as they come.
template <int DT>
__global__ void __launch_bounds__(kAttentionThreads)
    AttentionSeqKernel(const float* __restrict__ qkv, int ld, const int32_t* __restrict__ pos,
                       const int32_t* __restrict__ table_off, const int32_t* __restrict__ tables,
                       KvParams kv, const uint8_t* __restrict__ base, float k_scale, float v_scale,
                       int nh, float scale, int row_bytes, uint16_t* __restrict__ out) {
  extern __shared__ __align__(16) uint8_t asmem[];
  const int hd = kv.head_dim, i = blockIdx.x, g = blockIdx.y, tid = threadIdx.x;
  const int group = nh / kv.num_kv_heads;
  const AttnSmem sm = CarveSmem(asmem, row_bytes, group, hd);
  const int items = (group * hd + blockDim.x - 1) / blockDim.x;
  const int ps = pos[i];
  const int32_t* bt = tables + table_off[i];
  LoadGroupQuery(qkv, ld, i, g, group, hd, sm);
  __syncthreads();
  for (int p0 = 0; p0 <= ps; p0 += kAttentionPartition) {
    const int p1 = min(p0 + kAttentionPartition, ps + 1);
    PartitionCta<DT>(kv, base, bt, g, group, p0, p1, k_scale, v_scale, scale, row_bytes, sm, items);
    if (p0 == 0) {
      if (tid < group) {
        sm.rmden[tid * 2] = sm.mden[tid * 2];
        sm.rmden[tid * 2 + 1] = sm.mden[tid * 2 + 1];
      }
      for (int it = tid; it < group * hd; it += blockDim.x) sm.racc[it] = sm.pacc[it];
    } else {
      if (tid < group) {
        const float rm = sm.rmden[tid * 2], m = sm.mden[tid * 2];
        const float fa = FoldA(rm, m), fb = FoldB(rm, m);
        sm.fold[tid * 2] = fa;
        sm.fold[tid * 2 + 1] = fb;
        sm.rmden[tid * 2] = fmaxf(rm, m);
        sm.rmden[tid * 2 + 1] = sm.rmden[tid * 2 + 1] * fa + sm.mden[tid * 2 + 1] * fb;
      }
      __syncthreads();
      for (int it = tid; it < group * hd; it += blockDim.x) {
        const int h = it / hd;
        sm.racc[it] = sm.racc[it] * sm.fold[h * 2] + sm.pacc[it] * sm.fold[h * 2 + 1];
      }
    }
    __syncthreads();
  }
  uint16_t* o = out + static_cast<size_t>(i) * nh * hd + static_cast<size_t>(g) * group * hd;
  for (int it = tid; it < group * hd; it += blockDim.x) {
    o[it] = FToBf16(sm.racc[it] / sm.rmden[(it / hd) * 2 + 1]);
  }
}

// Scratch state of (row i, partition j, head): [m, den, acc[hd]] at ((i * parts + j) * nh + head)
// * (hd + 2) floats.
template <int DT>
__global__ void __launch_bounds__(kAttentionThreads)
    AttentionPartKernel(const float* __restrict__ qkv, int ld, const int32_t* __restrict__ pos,
                        const int32_t* __restrict__ table_off, const int32_t* __restrict__ tables,
                        KvParams kv, const uint8_t* __restrict__ base, float k_scale, float v_scale,
                        int nh, float scale, int row_bytes, int parts,
                        float* __restrict__ scratch) {
  extern __shared__ __align__(16) uint8_t asmem[];
  const int hd = kv.head_dim, i = blockIdx.x, g = blockIdx.y, j = blockIdx.z, tid = threadIdx.x;
  const int ps = pos[i];
  const int p0 = j * kAttentionPartition;
  if (p0 > ps) return;  // the whole CTA
  const int p1 = min(p0 + kAttentionPartition, ps + 1);
  const int group = nh / kv.num_kv_heads;
  const AttnSmem sm = CarveSmem(asmem, row_bytes, group, hd);
  const int items = (group * hd + blockDim.x - 1) / blockDim.x;
  LoadGroupQuery(qkv, ld, i, g, group, hd, sm);
  __syncthreads();
  PartitionCta<DT>(kv, base, tables + table_off[i], g, group, p0, p1, k_scale, v_scale, scale,
                   row_bytes, sm, items);
  const auto state = [&](int h) {
    return scratch + ((static_cast<size_t>(i) * parts + j) * nh + g * group + h) * (hd + 2);
  };
  if (tid < group) {
    state(tid)[0] = sm.mden[tid * 2];
    state(tid)[1] = sm.mden[tid * 2 + 1];
  }
  for (int it = tid; it < group * hd; it += blockDim.x) state(it / hd)[2 + it % hd] = sm.pacc[it];
}

// One warp per (row, head): folds the row's partitions in ascending order (as AttentionSeqKernel).
__global__ void AttentionCombineKernel(const int32_t* __restrict__ pos, int nh, int hd, int parts,
                                       const float* __restrict__ scratch,
                                       uint16_t* __restrict__ out) {
  const int i = blockIdx.x, head = blockIdx.y, lane = threadIdx.x & 31;
  const int np = pos[i] / kAttentionPartition + 1;
  float racc[kMaxDimsPerLane];
  float rm = 0.0f, rden = 0.0f;
  for (int j = 0; j < np; ++j) {
    const float* st = scratch + ((static_cast<size_t>(i) * parts + j) * nh + head) * (hd + 2);
    const float m = st[0], den = st[1];
    if (j == 0) {
      rm = m;
      rden = den;
#pragma unroll
      for (int e = 0; e < kMaxDimsPerLane; ++e) {
        const int d = lane + 32 * e;
        racc[e] = d < hd ? st[2 + d] : 0.0f;
      }
    } else {
      const float fa = FoldA(rm, m), fb = FoldB(rm, m);
      rm = fmaxf(rm, m);
      rden = rden * fa + den * fb;
#pragma unroll
      for (int e = 0; e < kMaxDimsPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < hd) racc[e] = racc[e] * fa + st[2 + d] * fb;
      }
    }
  }
  uint16_t* o = out + static_cast<size_t>(i) * nh * hd + static_cast<size_t>(head) * hd;
#pragma unroll
  for (int e = 0; e < kMaxDimsPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < hd) o[d] = FToBf16(racc[e] / rden);
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

// ---- random weights (random_model.h), one thread per element ----

__global__ void RandomBf16Kernel(uint16_t* __restrict__ dst, size_t count, uint64_t state0,
                                 float offset, float a) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = model_internal::RandomWeightBf16(state0, i, offset, a);
  }
}
__global__ void RandomF32Kernel(float* __restrict__ dst, size_t count, uint64_t state0,
                                float offset, float a) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = Bf16ToF(model_internal::RandomWeightBf16(state0, i, offset, a));
  }
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

bool MatmulPipelined(const uint16_t* a, int lda, const uint16_t* w, int k, int shards) {
  return lda % 8 == 0 && k % (8 * shards) == 0 && (reinterpret_cast<uintptr_t>(a) & 15) == 0 &&
         (reinterpret_cast<uintptr_t>(w) & 15) == 0;
}

void LaunchMatmul(const uint16_t* a, int lda, const uint16_t* w, int m, int n, int k, int shards,
                  const float* bias, float* out, cudaStream_t stream) {
  if (m <= 0 || n <= 0) return;
  if (!MatmulPipelined(a, lda, w, k, shards)) {
    const dim3 grid((n + kTileN - 1) / kTileN, (m + kTileM - 1) / kTileM, shards);
    MatmulKernel<<<grid, kMatmulThreads, 0, stream>>>(a, lda, w, m, n, k, shards, bias, out);
    return;
  }
  static bool attrs_set[64] = {};  // per device: the dynamic shared memory the shapes take
  static const int small_variant = EnvVariant("KVB_MATMUL_SMALL");
  static const int medium_variant = EnvVariant("KVB_MATMUL_MEDIUM");
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 0 && dev < 64 && !attrs_set[dev]) {
    SmallTile::SetSmem();
    SmallTile16::SetSmem();
    SmallTileK128::SetSmem();
    SmallTile64::SetSmem();
    MediumTile::SetSmem();
    MediumTile128::SetSmem();
    LargeTile::SetSmem();
    attrs_set[dev] = true;
  }
  if (m <= kMatmulSmallM) {
    switch (small_variant) {
      case 1:
        SmallTile16::Launch(a, lda, w, m, n, k, shards, bias, out, stream);
        break;
      case 2:
        SmallTileK128::Launch(a, lda, w, m, n, k, shards, bias, out, stream);
        break;
      case 3:
        SmallTile64::Launch(a, lda, w, m, n, k, shards, bias, out, stream);
        break;
      case 4:
        SmallTile::Launch(a, lda, w, m, n, k, shards, bias, out, stream);
        break;
      default:  // 0 and 2: the fastest measured on the H200 (docs/gpu.md "Speed")
        SmallTileK128::Launch(a, lda, w, m, n, k, shards, bias, out, stream);
    }
  } else if (m <= kMatmulMediumM) {
    if (medium_variant == 1) {
      MediumTile128::Launch(a, lda, w, m, n, k, shards, bias, out, stream);
    } else {
      MediumTile::Launch(a, lda, w, m, n, k, shards, bias, out, stream);
    }
  } else {
    LargeTile::Launch(a, lda, w, m, n, k, shards, bias, out, stream);
  }
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

namespace {
int g_attention_schedule = -1;  // SetAttentionScheduleForTest

template <int DT>
void LaunchAttentionT(const float* qkv, int ld, int m, const int32_t* pos, const int32_t* table_off,
                      const int32_t* tables, const KvParams& kv, const uint8_t* base, float k_scale,
                      float v_scale, int nh, float scale, uint16_t* out, int max_pos,
                      float* scratch, size_t scratch_floats, cudaStream_t stream) {
  const int group = nh / kv.num_kv_heads;
  const size_t smem = AttentionSmemBytes(kv.head_dim, kv.dtype, group);
  const int row_bytes = AttentionRowBytes(kv.head_dim, kv.dtype);
  static bool attrs_set[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 0 && dev < 64 && !attrs_set[dev]) {
    int optin = 0;  // CudaModel checked at start that smem fits under it
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    const int lim = static_cast<int>(std::min<size_t>(kAttentionMaxSmem, optin));
    cudaFuncSetAttribute(AttentionSeqKernel<DT>, cudaFuncAttributeMaxDynamicSharedMemorySize, lim);
    cudaFuncSetAttribute(AttentionPartKernel<DT>, cudaFuncAttributeMaxDynamicSharedMemorySize, lim);
    attrs_set[dev] = true;
  }
  const int parts = max_pos / kAttentionPartition + 1;
  const size_t need = static_cast<size_t>(m) * parts * nh * (kv.head_dim + 2);
  const bool split = g_attention_schedule == 1 || (g_attention_schedule == -1 && parts > 1);
  if (split && scratch != nullptr && need <= scratch_floats) {
    AttentionPartKernel<DT><<<dim3(m, kv.num_kv_heads, parts), kAttentionThreads, smem, stream>>>(
        qkv, ld, pos, table_off, tables, kv, base, k_scale, v_scale, nh, scale, row_bytes, parts,
        scratch);
    AttentionCombineKernel<<<dim3(m, nh), 32, 0, stream>>>(pos, nh, kv.head_dim, parts, scratch,
                                                           out);
    return;
  }
  AttentionSeqKernel<DT><<<dim3(m, kv.num_kv_heads), kAttentionThreads, smem, stream>>>(
      qkv, ld, pos, table_off, tables, kv, base, k_scale, v_scale, nh, scale, row_bytes, out);
}
}  // namespace

void SetAttentionScheduleForTest(int schedule) { g_attention_schedule = schedule; }

void LaunchAttention(const float* qkv, int ld, int m, const int32_t* pos, const int32_t* table_off,
                     const int32_t* tables, const KvParams& kv, const uint8_t* base, float k_scale,
                     float v_scale, int nh, float scale, uint16_t* out, int max_pos, float* scratch,
                     size_t scratch_floats, cudaStream_t stream) {
  if (m <= 0) return;
  if (kv.dtype == 0) {
    LaunchAttentionT<0>(qkv, ld, m, pos, table_off, tables, kv, base, k_scale, v_scale, nh, scale,
                        out, max_pos, scratch, scratch_floats, stream);
  } else if (kv.dtype == 1) {
    LaunchAttentionT<1>(qkv, ld, m, pos, table_off, tables, kv, base, k_scale, v_scale, nh, scale,
                        out, max_pos, scratch, scratch_floats, stream);
  } else {
    LaunchAttentionT<2>(qkv, ld, m, pos, table_off, tables, kv, base, k_scale, v_scale, nh, scale,
                        out, max_pos, scratch, scratch_floats, stream);
  }
}

void LaunchRandomBf16(uint16_t* dst, size_t count, uint64_t state0, float offset, float a,
                      cudaStream_t stream) {
  if (count == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>(Blocks(count, 256), 132 * 64));
  RandomBf16Kernel<<<blocks, 256, 0, stream>>>(dst, count, state0, offset, a);
}

void LaunchRandomF32(float* dst, size_t count, uint64_t state0, float offset, float a,
                     cudaStream_t stream) {
  if (count == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>(Blocks(count, 256), 132 * 64));
  RandomF32Kernel<<<blocks, 256, 0, stream>>>(dst, count, state0, offset, a);
}

void LaunchSiluMul(const float* gu, int m, int im, uint16_t* act, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(m) * im;
  if (total > 0) SiluMulKernel<<<Blocks(total, 256), 256, 0, stream>>>(gu, total, im, act);
}

}  // namespace kvbridge::cuda_internal
