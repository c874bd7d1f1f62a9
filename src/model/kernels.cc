#include "model/kernels.h"

// gcc 12 reports its own AVX-512 intrinsics (_mm512_undefined_* behind the broadcasts and
// shuffles) as maybe-uninitialized — and, in some inlining contexts, uninitialized (the `__Y`
// of _mm512_shuffle_f32x4) — once inlined: a known false positive. clang has no such warning
// group (and -Werror rejects the unknown name), so the pragma is gcc's alone.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>
#include <type_traits>

#include "model/numerics.h"

namespace kvbridge::model_internal {
namespace {

// Element tags for the weight types (the data is raw little-endian bytes, read with memcpy).
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

inline float WidenOne(const float* p) { return *p; }
inline float WidenOne(const Bf16* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return Bf16ToFloat(h);
}
inline float WidenOne(const Fp16* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return Fp16ToFloat(h);
}

// 64-byte aligned per-thread scratch (packed operands of the AVX-512 path).
class Scratch {
 public:
  ~Scratch() { std::free(p_); }
  float* Get(size_t floats) {
    if (floats > cap_) {
      std::free(p_);
      cap_ = std::max(floats, cap_ * 2);
      p_ = static_cast<float*>(std::aligned_alloc(64, (cap_ * 4 + 63) / 64 * 64));
      if (p_ == nullptr) std::abort();
    }
    return p_;
  }

 private:
  float* p_ = nullptr;
  size_t cap_ = 0;
};
thread_local Scratch tl_xpack, tl_wpack;

// ---------- portable path: 8 lanes emulated with std::fma (bitwise equal to the SIMD paths) --

inline float ReduceLanes(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  const float t0 = s0 + s2, t1 = s1 + s3;
  return t0 + t1;
}

template <int MR, int NR, class WT>
void TilePortable(const float* x, int ldx, const WT* w, int ldw, int k, float* y, int ldy) {
  float acc[MR][NR][8] = {};
  const int k8 = k & ~7;
  for (int p = 0; p < k8; p += 8) {
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NR; ++j) {
        for (int l = 0; l < 8; ++l) {
          acc[i][j][l] =
              std::fma(x[i * ldx + p + l], WidenOne(w + static_cast<int64_t>(j) * ldw + p + l),
                       acc[i][j][l]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = ReduceLanes(acc[i][j]);
      for (int p = k8; p < k; ++p) {
        s = std::fma(x[i * ldx + p], WidenOne(w + static_cast<int64_t>(j) * ldw + p), s);
      }
      y[i * ldy + j] = s;
    }
  }
}

template <class WT>
void MatMulPortable(const float* x, int m, int ldx, const WT* w, int n, int ldw, int k, float* y,
                    int ldy) {
  constexpr int kMr = 4, kNr = 3;
  int j = 0;
  for (; j + kNr <= n; j += kNr) {
    int i = 0;
    for (; i + kMr <= m; i += kMr) {
      TilePortable<kMr, kNr>(x + static_cast<int64_t>(i) * ldx, ldx,
                             w + static_cast<int64_t>(j) * ldw, ldw, k,
                             y + static_cast<int64_t>(i) * ldy + j, ldy);
    }
    for (; i < m; ++i) {
      TilePortable<1, kNr>(x + static_cast<int64_t>(i) * ldx, ldx,
                           w + static_cast<int64_t>(j) * ldw, ldw, k,
                           y + static_cast<int64_t>(i) * ldy + j, ldy);
    }
  }
  for (; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      TilePortable<1, 1>(x + static_cast<int64_t>(i) * ldx, ldx, w + static_cast<int64_t>(j) * ldw,
                         ldw, k, y + static_cast<int64_t>(i) * ldy + j, ldy);
    }
  }
}

// ---------- AVX2 + FMA (+ F16C) building blocks; also inlined into the AVX-512 path ----------

#define KVB_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVB_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))
#define KVB_INLINE inline __attribute__((always_inline))

// 8 weights widened exactly to fp32: bf16 by a 16-bit left shift, fp16 by vcvtph2ps.
KVB_AVX2 KVB_INLINE __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
KVB_AVX2 KVB_INLINE __m256 Load8(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
KVB_AVX2 KVB_INLINE __m256 Load8(const Fp16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KVB_AVX2 KVB_INLINE float ReduceYmm(__m256 a) {
  // (a0+a4, a1+a5, a2+a6, a3+a7) -> (s0+s2, s1+s3) -> t0+t1: the same tree as ReduceLanes.
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// One MR x NR tile, one ymm accumulator (8 lanes) per output element, weights widened in the
// loop. x rows and w rows are read in place.
template <int MR, int NR, class WT>
KVB_AVX2 KVB_INLINE void YmmTile(const float* x, int ldx, const WT* w, int ldw, int k, float* y,
                                 int ldy) {
  __m256 acc[MR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  const int k8 = k & ~7;
  for (int p = 0; p < k8; p += 8) {
    __m256 wv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) wv[j] = Load8(w + static_cast<int64_t>(j) * ldw + p);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + static_cast<int64_t>(i) * ldx + p);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      float s = ReduceYmm(acc[i][j]);
      for (int p = k8; p < k; ++p) {
        s = std::fma(x[static_cast<int64_t>(i) * ldx + p],
                     WidenOne(w + static_cast<int64_t>(j) * ldw + p), s);
      }
      y[static_cast<int64_t>(i) * ldy + j] = s;
    }
  }
}

// Column tiles of NR (then single columns), row tiles of MR (then single rows).
template <int MR, int NR, class WT>
KVB_AVX2 KVB_INLINE void YmmDriver(const float* x, int m, int ldx, const WT* w, int n, int ldw,
                                   int k, float* y, int ldy) {
  int j = 0;
  for (; j + NR <= n; j += NR) {
    const WT* wj = w + static_cast<int64_t>(j) * ldw;
    int i = 0;
    for (; i + MR <= m; i += MR) {
      YmmTile<MR, NR>(x + static_cast<int64_t>(i) * ldx, ldx, wj, ldw, k,
                      y + static_cast<int64_t>(i) * ldy + j, ldy);
    }
    for (; i < m; ++i) {
      YmmTile<1, NR>(x + static_cast<int64_t>(i) * ldx, ldx, wj, ldw, k,
                     y + static_cast<int64_t>(i) * ldy + j, ldy);
    }
  }
  for (; j < n; ++j) {
    const WT* wj = w + static_cast<int64_t>(j) * ldw;
    int i = 0;
    for (; i + MR <= m; i += MR) {
      YmmTile<MR, 1>(x + static_cast<int64_t>(i) * ldx, ldx, wj, ldw, k,
                     y + static_cast<int64_t>(i) * ldy + j, ldy);
    }
    for (; i < m; ++i) {
      YmmTile<1, 1>(x + static_cast<int64_t>(i) * ldx, ldx, wj, ldw, k,
                    y + static_cast<int64_t>(i) * ldy + j, ldy);
    }
  }
}

// Widens columns [j0, j0 + nc) of w (k elements each) into a dense fp32 block [nc][k].
template <class WT>
KVB_AVX2 void WidenColumns(const WT* w, int ldw, int nc, int k, float* out) {
  const int k8 = k & ~7;
  for (int j = 0; j < nc; ++j) {
    const WT* src = w + static_cast<int64_t>(j) * ldw;
    float* dst = out + static_cast<int64_t>(j) * k;
    int p = 0;
    for (; p < k8; p += 8) _mm256_storeu_ps(dst + p, Load8(src + p));
    for (; p < k; ++p) dst[p] = WidenOne(src + p);
  }
}

// AVX2 path: 4 x 3 tiles (12 accumulators + 3 weight vectors + 1 x vector = 16 ymm). With
// many rows, narrow weights are first widened into an fp32 block of columns reused by every
// row tile.
// Blocks of 64 rows: a block of x stays in L2 while the column tiles sweep over it.
template <class WT>
KVB_AVX2 void Avx2RowBlocks(const float* x, int m, int ldx, const WT* w, int n, int ldw, int k,
                            float* y, int ldy) {
  constexpr int kRowBlock = 64;
  for (int i0 = 0; i0 < m; i0 += kRowBlock) {
    YmmDriver<4, 3>(x + static_cast<int64_t>(i0) * ldx, std::min(kRowBlock, m - i0), ldx, w, n, ldw,
                    k, y + static_cast<int64_t>(i0) * ldy, ldy);
  }
}

template <class WT>
KVB_AVX2 void MatMulAvx2(const float* x, int m, int ldx, const WT* w, int n, int ldw, int k,
                         float* y, int ldy) {
  if (m < 4) {
    YmmDriver<2, 4>(x, m, ldx, w, n, ldw, k, y, ldy);
    return;
  }
  if (std::is_same_v<WT, float> || m < 16) {
    Avx2RowBlocks(x, m, ldx, w, n, ldw, k, y, ldy);
    return;
  }
  const int cols = std::max(3, std::min(n, (1 << 17) / std::max(k, 1) / 3 * 3));
  float* buf = tl_wpack.Get(static_cast<size_t>(cols) * k);
  for (int j0 = 0; j0 < n; j0 += cols) {
    const int nc = std::min(cols, n - j0);
    WidenColumns(w + static_cast<int64_t>(j0) * ldw, ldw, nc, k, buf);
    Avx2RowBlocks(x, m, ldx, static_cast<const float*>(buf), nc, k, k, y + j0, ldy);
  }
}

// ---------- AVX-512 path ----------
//
// Large m: x is packed in row pairs, [pair][chunk][16] = x[2p][8c..8c+8] then x[2p+1][same];
// a weight panel of 8 columns is widened and packed as [chunk][column][8]. One zmm register
// holds the 8-lane accumulators of rows (2p, 2p+1) against one column: it is multiplied by the
// column's 8 weights broadcast to both halves (vbroadcastf32x8, a plain load). A tile is 3 row
// pairs x 8 columns = 24 accumulators; every weight vector is reused by 6 rows and every x
// vector by 8 columns. Small m: YmmTile with up to 24 accumulators (32 ymm registers).

constexpr int kPairTile = 3;  // row pairs per register tile
constexpr int kPanel = 8;     // columns per weight panel
constexpr int kBigRows = 16;  // from this many rows on, the packed pair kernel

KVB_AVX512 KVB_INLINE __m512 SumHalves(__m512 a, __m512 b) {
  // Quarters [a.q0, a.q2, b.q0, b.q2] + [a.q1, a.q3, b.q1, b.q3]: s_l = acc_l + acc_{l+4}.
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
KVB_AVX512 KVB_INLINE __m512 SumPairs(__m512 a, __m512 b) {
  // Per quarter [a0+a2, a1+a3, b0+b2, b1+b3]: t0 = s0 + s2, t1 = s1 + s3.
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
KVB_AVX512 KVB_INLINE __m512 SumAdjacent(__m512 a, __m512 b) {
  // Per quarter [a0+a1, a2+a3, b0+b1, b2+b3]: t0 + t1.
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// The lane tree of 8 pair accumulators (columns 0..7) at once: returns
// [row 2p: col 0..7 | row 2p+1: col 0..7], each element reduced exactly as ReduceLanes.
KVB_AVX512 KVB_INLINE __m512 ReducePairPanel(const __m512* a) {
  const __m512 s01 = SumHalves(a[0], a[1]), s23 = SumHalves(a[2], a[3]);
  const __m512 s45 = SumHalves(a[4], a[5]), s67 = SumHalves(a[6], a[7]);
  const __m512 t0 = SumPairs(s01, s23), t1 = SumPairs(s45, s67);
  const __m512 r = SumAdjacent(t0, t1);
  // r lanes: row0 c0,c2,c4,c6 | row1 c0,c2,c4,c6 | row0 c1,c3,c5,c7 | row1 c1,c3,c5,c7.
  const __m512i idx = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm512_permutexvar_ps(idx, r);
}

// Runs chunks [0, nchunks) of a 2*RP-row x 8-column tile. The accumulators start at zero or,
// when `state_in` is set, at the exact 8-lane state a previous K block left there; they end
// in `state_out` (the next K block continues from it) or, when that is null, reduced by the
// lane tree into `res` ([pair][row 2p cols 0..7 | row 2p+1 cols 0..7]). Splitting K into
// blocks this way keeps every lane's fma sequence unchanged.
template <int RP>
KVB_AVX512 KVB_INLINE void PairTile(const float* xp, int64_t pair_stride, const float* wp,
                                    int nchunks, const float* state_in, float* state_out,
                                    float* res) {
  __m512 acc[RP][kPanel];
#pragma GCC unroll 8
  for (int i = 0; i < RP; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < kPanel; ++j) {
      acc[i][j] = state_in != nullptr ? _mm512_load_ps(state_in + (i * kPanel + j) * 16)
                                      : _mm512_setzero_ps();
    }
  }
  for (int c = 0; c < nchunks; ++c) {
    __m512 xv[RP];
#pragma GCC unroll 8
    for (int i = 0; i < RP; ++i) xv[i] = _mm512_load_ps(xp + i * pair_stride + c * 16);
    const float* wc = wp + c * (kPanel * 8);
#pragma GCC unroll 8
    for (int j = 0; j < kPanel; ++j) {
      const __m512 wv = _mm512_broadcast_f32x8(_mm256_load_ps(wc + j * 8));
#pragma GCC unroll 8
      for (int i = 0; i < RP; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  if (state_out != nullptr) {
#pragma GCC unroll 8
    for (int i = 0; i < RP; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < kPanel; ++j)
        _mm512_store_ps(state_out + (i * kPanel + j) * 16, acc[i][j]);
    }
    return;
  }
#pragma GCC unroll 8
  for (int i = 0; i < RP; ++i) _mm512_store_ps(res + i * 16, ReducePairPanel(acc[i]));
}

// Small m (decode, attention): one zmm holds the 8-lane accumulators of one row against two
// columns [col 2q | col 2q+1]; the two columns' 8 weights are loaded, joined and widened into
// one zmm, the row's 8 x values broadcast to both halves. MR rows x CP column pairs per tile.
template <class WT>
KVB_AVX512 KVB_INLINE __m512 Load16(const WT* a, const WT* b);
template <>
KVB_AVX512 KVB_INLINE __m512 Load16(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
template <>
KVB_AVX512 KVB_INLINE __m512 Load16(const Bf16* a, const Bf16* b) {
  // a's 8 words broadcast to the four 128-bit lanes, b's merged into lanes 2-3 (loads and a
  // blend), then one in-lane byte shuffle puts word 4*(lane&1)+t of its lane in the high half
  // of dword t and zeroes the low half — bf16 << 16, exactly the fp32 value. Measured faster
  // than one vpermt2w (a multi-uop permute on the FMA port): 154 vs 139 GFLOP/s at m = 8.
  __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  t = _mm512_mask_broadcast_i32x4(t, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  const __m512i ctl =
      _mm512_set_epi8(15, 14, -1, -1, 13, 12, -1, -1, 11, 10, -1, -1, 9, 8, -1, -1, 7, 6, -1, -1, 5,
                      4, -1, -1, 3, 2, -1, -1, 1, 0, -1, -1, 15, 14, -1, -1, 13, 12, -1, -1, 11, 10,
                      -1, -1, 9, 8, -1, -1, 7, 6, -1, -1, 5, 4, -1, -1, 3, 2, -1, -1, 1, 0, -1, -1);
  return _mm512_castsi512_ps(_mm512_shuffle_epi8(t, ctl));
}
template <>
KVB_AVX512 KVB_INLINE __m512 Load16(const Fp16* a, const Fp16* b) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_cvtph_ps(h);
}

// x is packed for the tile as [chunk][row][8] (row i of chunk c at xp + c * xcs + 8 * i), so
// one pointer with constant offsets addresses every row (separate row pointers spilled the
// integer registers); x / ldx (unpacked) serve the K % 8 tail.
template <int MR, int CP, class WT>
KVB_AVX512 KVB_INLINE void ColPairTile(const float* xp, int64_t xcs, const float* x, int ldx,
                                       const WT* w, int64_t ldw, int k, float* y, int ldy) {
  constexpr int kAcc = MR * CP, kPad = (kAcc + 7) / 8 * 8;
  __m512 acc[kPad];
#pragma GCC unroll 32
  for (int q = 0; q < kPad; ++q) acc[q] = _mm512_setzero_ps();
  const int k8 = k & ~7;
  const WT* wr[2 * CP];
#pragma GCC unroll 32
  for (int c = 0; c < 2 * CP; ++c) wr[c] = w + c * ldw;
  const float* xc = xp;
  auto chunk = [&](int p) KVB_AVX512 {
    __m512 wv[CP];
#pragma GCC unroll 16
    for (int q = 0; q < CP; ++q) wv[q] = Load16(wr[2 * q] + p, wr[2 * q + 1] + p);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 xb = _mm512_broadcast_f32x8(_mm256_loadu_ps(xc + 8 * i));
#pragma GCC unroll 16
      for (int q = 0; q < CP; ++q) acc[i * CP + q] = _mm512_fmadd_ps(xb, wv[q], acc[i * CP + q]);
    }
    xc += xcs;
  };
  // Decode streams these weights from memory: at every cache line of K, the same line of the
  // next tile's rows (2 * CP rows on) is prefetched into L2. Measured on qwen2.5-0.5b's gate/up
  // shape streaming 200 MB of bf16 (one thread, CPU time): 10.2 -> 12.0 GB/s at m = 1, 7.2 ->
  // 9.0 GB/s at m = 8 (the former 2 KB-ahead prefetch along each row mostly fetched the
  // current tile's next row).
  constexpr int kLine = 64 / static_cast<int>(sizeof(WT));
  const int64_t ahead = 2 * CP * ldw;
  int p = 0;
  for (; p + kLine <= k8; p += kLine) {
#pragma GCC unroll 32
    for (int c = 0; c < 2 * CP; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[c] + ahead + p), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int u = 0; u < kLine; u += 8) chunk(p + u);
  }
  for (; p < k8; p += 8) chunk(p);
  alignas(64) float res[kPad * 2];
#pragma GCC unroll 4
  for (int g = 0; g < kPad / 8; ++g) _mm512_store_ps(res + 16 * g, ReducePairPanel(acc + 8 * g));
  // res[16g + e] / res[16g + 8 + e]: the first / second column of accumulator 8g + e.
  for (int a = 0; a < kAcc; ++a) {
    const int i = a / CP, q = a % CP;
    for (int h = 0; h < 2; ++h) {
      float s = res[16 * (a / 8) + 8 * h + a % 8];
      const int col = 2 * q + h;
      const WT* wc = w + static_cast<int64_t>(col) * ldw;
      const float* xr = x + static_cast<int64_t>(i) * ldx;
      for (int pp = k8; pp < k; ++pp) s = std::fma(xr[pp], WidenOne(wc + pp), s);
      y[static_cast<int64_t>(i) * ldy + col] = s;
    }
  }
}

// MR rows: tiles of CP column pairs, then narrower tiles of 8, 4, 2, 1 pairs for the columns
// left over (e.g. 4 of a 112-column o_proj slice at 8 rows); an odd last column is not done
// here.
template <int MR, int CP, class WT>
KVB_AVX512 KVB_INLINE void ColPairRows(const float* xp, int64_t xcs, const float* x, int ldx,
                                       const WT* w, int n, int ldw, int k, float* y, int ldy) {
  int j = 0;
  auto tile = [&]<int P>() KVB_AVX512 {
    ColPairTile<MR, P>(xp, xcs, x, ldx, w + static_cast<int64_t>(j) * ldw, ldw, k, y + j, ldy);
    j += 2 * P;
  };
  while (j + 2 * CP <= n) tile.template operator()<CP>();
  auto narrower = [&]<int P>() KVB_AVX512 {
    if constexpr (P < CP) {
      if (j + 2 * P <= n) tile.template operator()<P>();
    }
  };
  narrower.template operator()<8>();
  narrower.template operator()<4>();
  narrower.template operator()<2>();
  narrower.template operator()<1>();
}

template <class WT>
KVB_AVX512 void SmallAvx512(const float* x, int m, int ldx, const WT* w, int n, int ldw, int k,
                            float* y, int ldy) {
  // Pack x as [chunk][row][8]; one row is that layout already.
  const int nch = k / 8;
  const float* xp = x;
  if (m > 1) {
    float* buf = tl_xpack.Get(static_cast<size_t>(nch) * m * 8);
    for (int c = 0; c < nch; ++c) {
      for (int i = 0; i < m; ++i) {
        _mm256_store_ps(buf + (static_cast<size_t>(c) * m + i) * 8,
                        _mm256_loadu_ps(x + static_cast<int64_t>(i) * ldx + c * 8));
      }
    }
    xp = buf;
  }
  const int64_t xcs = static_cast<int64_t>(m) * 8;
  int i = 0;
  while (i < m) {
    const int rem = m - i;
    const float* xi = x + static_cast<int64_t>(i) * ldx;
    const float* xpi = xp + static_cast<int64_t>(i) * 8;
    float* yi = y + static_cast<int64_t>(i) * ldy;
    if (rem >= 8) {
      ColPairRows<8, 3>(xpi, xcs, xi, ldx, w, n, ldw, k, yi, ldy);
      i += 8;
    } else if (rem >= 4) {
      ColPairRows<4, 6>(xpi, xcs, xi, ldx, w, n, ldw, k, yi, ldy);
      i += 4;
    } else if (rem >= 2) {
      ColPairRows<2, 8>(xpi, xcs, xi, ldx, w, n, ldw, k, yi, ldy);
      i += 2;
    } else {
      ColPairRows<1, 12>(xpi, xcs, xi, ldx, w, n, ldw, k, yi, ldy);
      i += 1;
    }
  }
  if (n % 2 != 0) {  // the odd last column, whole K
    const int j = n - 1;
    YmmDriver<2, 8>(x, m, ldx, w + static_cast<int64_t>(j) * ldw, 1, ldw, k, y + j, ldy);
  }
}

constexpr int kMaxBlockChunks = 128;  // K block: a packed 8-column panel is <= 32 KB (L1)

template <class WT>
KVB_AVX512 void MatMulAvx512(const float* x, int m, int ldx, const WT* w, int n, int ldw, int k,
                             float* y, int ldy) {
  const int nch = k / 8, k8 = nch * 8;
  if (nch == 0) {
    YmmDriver<2, 8>(x, m, ldx, w, n, ldw, k, y, ldy);
    return;
  }
  if (m < kBigRows) {
    SmallAvx512(x, m, ldx, w, n, ldw, k, y, ldy);
    return;
  }
  const int64_t pair_stride = static_cast<int64_t>(nch) * 16;  // floats per packed pair
  const int pairs = (m + 1) / 2;
  // Row pairs per block: the packed x block stays within ~1 MB (L2).
  int block_pairs = static_cast<int>((1 << 20) / 4 / pair_stride) / kPairTile * kPairTile;
  block_pairs = std::clamp(block_pairs, kPairTile, 32 * kPairTile);
  block_pairs = std::min(block_pairs, (pairs + kPairTile - 1) / kPairTile * kPairTile);
  // K blocks of at most kMaxBlockChunks chunks, as even as possible.
  const int kblocks = (nch + kMaxBlockChunks - 1) / kMaxBlockChunks;
  const int kc = (nch + kblocks - 1) / kblocks;
  float* xp = tl_xpack.Get(static_cast<size_t>(block_pairs) * pair_stride +
                           (kblocks > 1 ? static_cast<size_t>(block_pairs) * kPanel * 16 : 0));
  float* state = kblocks > 1 ? xp + static_cast<size_t>(block_pairs) * pair_stride : nullptr;
  float* wp = tl_wpack.Get(static_cast<size_t>(kc) * kPanel * 8);
  alignas(64) float res[kPairTile * 16];
  for (int pb = 0; pb < pairs; pb += block_pairs) {
    const int np = std::min(block_pairs, pairs - pb);
    for (int q = 0; q < np; ++q) {
      const int r0 = 2 * (pb + q);
      const float* x0 = x + static_cast<int64_t>(r0) * ldx;
      const float* x1 = r0 + 1 < m ? x0 + ldx : nullptr;
      float* dst = xp + q * pair_stride;
      for (int c = 0; c < nch; ++c) {
        _mm256_store_ps(dst + c * 16, _mm256_loadu_ps(x0 + c * 8));
        _mm256_store_ps(dst + c * 16 + 8,
                        x1 != nullptr ? _mm256_loadu_ps(x1 + c * 8) : _mm256_setzero_ps());
      }
    }
    for (int j0 = 0; j0 < n; j0 += kPanel) {
      const int nr = std::min(kPanel, n - j0);
      for (int c0 = 0; c0 < nch; c0 += kc) {
        const int cn = std::min(kc, nch - c0);
        const bool first = c0 == 0, last = c0 + cn == nch;
        for (int jj = 0; jj < kPanel; ++jj) {
          float* dst = wp + jj * 8;
          if (jj < nr) {
            const WT* src = w + static_cast<int64_t>(j0 + jj) * ldw + c0 * 8;
            for (int c = 0; c < cn; ++c) {
              _mm256_store_ps(dst + c * (kPanel * 8), Load8(src + c * 8));
            }
          } else {
            for (int c = 0; c < cn; ++c) {
              _mm256_store_ps(dst + c * (kPanel * 8), _mm256_setzero_ps());
            }
          }
        }
        for (int q = 0; q < np; q += kPairTile) {
          const int rp = std::min(kPairTile, np - q);
          const float* xq = xp + q * pair_stride + c0 * 16;
          float* st = state != nullptr ? state + static_cast<size_t>(q) * kPanel * 16 : nullptr;
          const float* in = first ? nullptr : st;
          float* out = last ? nullptr : st;
          if (rp == 3) {
            PairTile<3>(xq, pair_stride, wp, cn, in, out, res);
          } else if (rp == 2) {
            PairTile<2>(xq, pair_stride, wp, cn, in, out, res);
          } else {
            PairTile<1>(xq, pair_stride, wp, cn, in, out, res);
          }
          if (!last) continue;
          for (int t = 0; t < 2 * rp; ++t) {
            const int row = 2 * (pb + q) + t;
            if (row >= m) break;
            const float* r = res + t * 8;
            float* yr = y + static_cast<int64_t>(row) * ldy + j0;
            if (k8 == k && nr == kPanel) {
              _mm256_storeu_ps(yr, _mm256_load_ps(r));
              continue;
            }
            const float* xr = x + static_cast<int64_t>(row) * ldx;
            for (int c = 0; c < nr; ++c) {
              float s = r[c];
              const WT* wc = w + static_cast<int64_t>(j0 + c) * ldw;
              for (int p = k8; p < k; ++p) s = std::fma(xr[p], WidenOne(wc + p), s);
              yr[c] = s;
            }
          }
        }
      }
    }
  }
}

// ---------- element-wise: exp, SiLU, online softmax ----------

// model_internal::Exp on 8 lanes, the same operations in the same order (numerics.cc).
KVB_AVX2 KVB_INLINE __m256 Exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(k, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i ki = _mm256_cvttps_epi32(k);
  const __m256 normal = _mm256_mul_ps(
      p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ki, _mm256_set1_epi32(127)), 23)));
  const __m256 big = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_set1_ps(2.0f)),
                                   _mm256_castsi256_ps(_mm256_set1_epi32(254 << 23)));
  const __m256 small =
      _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(
                                         _mm256_add_epi32(ki, _mm256_set1_epi32(64 + 127)), 23))),
                    _mm256_set1_ps(5.42101086e-20f));
  __m256 y = normal;
  y = _mm256_blendv_ps(y, big, _mm256_castsi256_ps(_mm256_cmpgt_epi32(ki, _mm256_set1_epi32(127))));
  y = _mm256_blendv_ps(y, small,
                       _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(-126), ki)));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(),
                       _mm256_cmp_ps(x, _mm256_set1_ps(-103.972084045410156f), _CMP_LT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

KVB_AVX2 void ExpArrayAvx2(const float* x, int n, float* y) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, Exp8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = Exp(x[i]);
}

KVB_AVX2 void SiluMulAvx2(float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = Exp8(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(
        gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) gate[i] = gate[i] / (1.0f + Exp(-gate[i])) * up[i];
}

void SiluMulPortable(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + Exp(-g)) * up[i];
  }
}

void OnlineSoftmaxChunkPortable(float* s, int n, float scale, const float* v, int hd, float* mx,
                                float* den, float* acc) {
  float cmax = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) {
    s[t] *= scale;
    cmax = std::max(cmax, s[t]);
  }
  const float new_max = std::max(*mx, cmax);
  const float corr = Exp(*mx - new_max);
  *den *= corr;
  for (int d = 0; d < hd; ++d) acc[d] *= corr;
  for (int t = 0; t < n; ++t) {
    const float pr = Exp(s[t] - new_max);
    *den += pr;
    const float* vt = v + static_cast<int64_t>(t) * hd;
    for (int d = 0; d < hd; ++d) acc[d] += pr * vt[d];
  }
  *mx = new_max;
}

KVB_AVX2 void OnlineSoftmaxChunkAvx2(float* s, int n, float scale, const float* v, int hd,
                                     float* mx, float* den, float* acc) {
  float cmax = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) {
    s[t] *= scale;
    cmax = std::max(cmax, s[t]);
  }
  const float new_max = std::max(*mx, cmax);
  const float corr = Exp(*mx - new_max);
  *den *= corr;
  const int hd8 = hd & ~7;
  const __m256 c = _mm256_set1_ps(corr);
  for (int d = 0; d < hd8; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), c));
  for (int d = hd8; d < hd; ++d) acc[d] *= corr;
  alignas(32) float e[16], pr[16];
  for (int t0 = 0; t0 < n; t0 += 16) {
    const int cnt = std::min(16, n - t0);
    for (int t = 0; t < cnt; ++t) e[t] = s[t0 + t] - new_max;
    ExpArrayAvx2(e, cnt, pr);
    for (int t = 0; t < cnt; ++t) *den += pr[t];
    // acc[d] += p_t * v[t][d] for t ascending, per element in the scalar order; blocks of 64
    // elements stay in registers across the positions (no store/reload per position).
    const float* v0 = v + static_cast<int64_t>(t0) * hd;
    int d = 0;
    for (; d + 64 <= hd8; d += 64) {
      __m256 a[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) a[r] = _mm256_loadu_ps(acc + d + 8 * r);
      for (int t = 0; t < cnt; ++t) {
        const __m256 p = _mm256_set1_ps(pr[t]);
        const float* vt = v0 + static_cast<int64_t>(t) * hd + d;
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
          a[r] = _mm256_add_ps(a[r], _mm256_mul_ps(p, _mm256_loadu_ps(vt + 8 * r)));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) _mm256_storeu_ps(acc + d + 8 * r, a[r]);
    }
    for (; d < hd8; d += 8) {
      __m256 a = _mm256_loadu_ps(acc + d);
      for (int t = 0; t < cnt; ++t) {
        a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(pr[t]),
                                           _mm256_loadu_ps(v0 + static_cast<int64_t>(t) * hd + d)));
      }
      _mm256_storeu_ps(acc + d, a);
    }
    for (; d < hd; ++d) {
      for (int t = 0; t < cnt; ++t) acc[d] += pr[t] * v0[static_cast<int64_t>(t) * hd + d];
    }
  }
  *mx = new_max;
}

template <class WT>
KVB_AVX2 void WidenAvx2(const WT* w, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, Load8(w + i));
  for (; i < n; ++i) out[i] = WidenOne(w + i);
}

// ---------- dispatch ----------

bool CpuHas(const char* feature) {
  __builtin_cpu_init();
  const std::string_view f(feature);
  if (f == "avx2") return __builtin_cpu_supports("avx2");
  if (f == "fma") return __builtin_cpu_supports("fma");
  if (f == "avx512f") return __builtin_cpu_supports("avx512f");
  if (f == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
  return false;
}

// F16C: CPUID.1:ECX bit 29 (not in __builtin_cpu_supports on every gcc).
bool CpuHasF16c() {
  unsigned a, b, c, d;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
  return (c >> 29) & 1u;
}

KernelIsa PickIsa() {
  KernelIsa best = KernelIsa::kPortable;
  if (KernelIsaSupported(KernelIsa::kAvx512)) {
    best = KernelIsa::kAvx512;
  } else if (KernelIsaSupported(KernelIsa::kAvx2)) {
    best = KernelIsa::kAvx2;
  }
  if (const char* e = std::getenv("KVBRIDGE_KERNEL"); e != nullptr) {
    const std::string_view v(e);
    for (KernelIsa i : {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
      if ((v == KernelIsaName(i) || (v == "avx2" && i == KernelIsa::kAvx2)) &&
          KernelIsaSupported(i)) {
        return i;
      }
    }
  }
  return best;
}

template <class WT>
void Run(KernelIsa isa, const float* x, int m, int ldx, const WT* w, int n, int ldw, int k,
         float* y, int ldy) {
  switch (isa) {
    case KernelIsa::kAvx512:
      MatMulAvx512(x, m, ldx, w, n, ldw, k, y, ldy);
      return;
    case KernelIsa::kAvx2:
      MatMulAvx2(x, m, ldx, w, n, ldw, k, y, ldy);
      return;
    case KernelIsa::kPortable:
      MatMulPortable(x, m, ldx, w, n, ldw, k, y, ldy);
      return;
  }
}

}  // namespace

const char* WeightTypeName(WeightType t) {
  switch (t) {
    case WeightType::kF32:
      return "F32";
    case WeightType::kBf16:
      return "BF16";
    case WeightType::kF16:
      return "F16";
  }
  return "?";
}

const char* KernelIsaName(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kPortable:
      return "portable";
    case KernelIsa::kAvx2:
      return "avx2+fma";
    case KernelIsa::kAvx512:
      return "avx512";
  }
  return "?";
}

bool KernelIsaSupported(KernelIsa isa) {
  static const bool avx2 = CpuHas("avx2") && CpuHas("fma") && CpuHasF16c();
  static const bool avx512 =
      avx2 && CpuHas("avx512f") && CpuHas("avx512dq") && CpuHas("avx512bw") && CpuHas("avx512vl");
  switch (isa) {
    case KernelIsa::kPortable:
      return true;
    case KernelIsa::kAvx2:
      return avx2;
    case KernelIsa::kAvx512:
      return avx512;
  }
  return false;
}

KernelIsa DefaultKernelIsa() {
  static const KernelIsa isa = PickIsa();
  return isa;
}

void MatMulNTWith(KernelIsa isa, const float* x, int m, int ldx, WeightPtr w, int n, int ldw, int k,
                  float* y, int ldy) {
  if (m <= 0 || n <= 0) return;
  switch (w.type) {
    case WeightType::kF32:
      Run(isa, x, m, ldx, static_cast<const float*>(w.data), n, ldw, k, y, ldy);
      return;
    case WeightType::kBf16:
      Run(isa, x, m, ldx, static_cast<const Bf16*>(w.data), n, ldw, k, y, ldy);
      return;
    case WeightType::kF16:
      Run(isa, x, m, ldx, static_cast<const Fp16*>(w.data), n, ldw, k, y, ldy);
      return;
  }
}

void MatMulNT(const float* x, int m, int ldx, WeightPtr w, int n, int ldw, int k, float* y,
              int ldy) {
  MatMulNTWith(DefaultKernelIsa(), x, m, ldx, w, n, ldw, k, y, ldy);
}

void MatMulNTPortable(const float* x, int m, int ldx, const float* w, int n, int ldw, int k,
                      float* y, int ldy) {
  MatMulNTWith(KernelIsa::kPortable, x, m, ldx, WeightPtr{w, WeightType::kF32}, n, ldw, k, y, ldy);
}

float Dot(const float* a, const float* b, int k) {
  float y;
  MatMulNT(a, 1, k, b, 1, k, k, &y, 1);
  return y;
}

const char* KernelPath() { return KernelIsaName(DefaultKernelIsa()); }

void ExpArrayWith(KernelIsa isa, const float* x, int n, float* y) {
  if (isa == KernelIsa::kPortable) {
    for (int i = 0; i < n; ++i) y[i] = Exp(x[i]);
    return;
  }
  ExpArrayAvx2(x, n, y);
}
void SiluMulWith(KernelIsa isa, float* gate, const float* up, int64_t n) {
  if (isa == KernelIsa::kPortable) {
    SiluMulPortable(gate, up, n);
    return;
  }
  SiluMulAvx2(gate, up, n);
}
void OnlineSoftmaxChunkWith(KernelIsa isa, float* s, int n, float scale, const float* v, int hd,
                            float* mx, float* den, float* acc) {
  if (isa == KernelIsa::kPortable) {
    OnlineSoftmaxChunkPortable(s, n, scale, v, hd, mx, den, acc);
    return;
  }
  OnlineSoftmaxChunkAvx2(s, n, scale, v, hd, mx, den, acc);
}
void ExpArray(const float* x, int n, float* y) { ExpArrayWith(DefaultKernelIsa(), x, n, y); }
void SiluMul(float* gate, const float* up, int64_t n) {
  SiluMulWith(DefaultKernelIsa(), gate, up, n);
}
void OnlineSoftmaxChunk(float* s, int n, float scale, const float* v, int hd, float* mx, float* den,
                        float* acc) {
  OnlineSoftmaxChunkWith(DefaultKernelIsa(), s, n, scale, v, hd, mx, den, acc);
}

void WidenWeights(WeightPtr w, int64_t n, float* out) {
  switch (w.type) {
    case WeightType::kF32:
      if (n > 0) std::memcpy(out, w.data, static_cast<size_t>(n) * 4);
      return;
    case WeightType::kBf16:
      if (KernelIsaSupported(KernelIsa::kAvx2)) {
        WidenAvx2(static_cast<const Bf16*>(w.data), n, out);
        return;
      }
      for (int64_t i = 0; i < n; ++i) out[i] = WidenOne(static_cast<const Bf16*>(w.data) + i);
      return;
    case WeightType::kF16:
      if (KernelIsaSupported(KernelIsa::kAvx2)) {
        WidenAvx2(static_cast<const Fp16*>(w.data), n, out);
        return;
      }
      for (int64_t i = 0; i < n; ++i) out[i] = WidenOne(static_cast<const Fp16*>(w.data) + i);
      return;
  }
}

}  // namespace kvbridge::model_internal
