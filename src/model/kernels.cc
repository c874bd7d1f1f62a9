#include "model/kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace kvbridge::model_internal {
namespace {

// ---------- portable path: 8 lanes emulated with std::fma (bitwise equal to the AVX2 path) ----

struct Lanes {
  float v[8];
};

inline float ReduceLanes(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  const float t0 = s0 + s2, t1 = s1 + s3;
  return t0 + t1;
}

template <int MR, int NR>
void TilePortable(const float* x, int ldx, const float* w, int ldw, int k, float* y, int ldy) {
  Lanes acc[MR][NR] = {};
  const int k8 = k & ~7;
  for (int p = 0; p < k8; p += 8) {
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NR; ++j) {
        for (int l = 0; l < 8; ++l) {
          acc[i][j].v[l] = std::fma(x[i * ldx + p + l], w[j * ldw + p + l], acc[i][j].v[l]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = ReduceLanes(acc[i][j].v);
      for (int p = k8; p < k; ++p) s = std::fma(x[i * ldx + p], w[j * ldw + p], s);
      y[i * ldy + j] = s;
    }
  }
}

// ---------- AVX2 + FMA path ----------

#define KVB_AVX2 __attribute__((target("avx2,fma")))

KVB_AVX2 inline float ReduceAvx(__m256 a) {
  // (a0+a4, a1+a5, a2+a6, a3+a7) -> (s0+s2, s1+s3) -> t0+t1: the same tree as ReduceLanes.
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

template <int MR, int NR>
KVB_AVX2 void TileAvx(const float* x, int ldx, const float* w, int ldw, int k, float* y, int ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  const int k8 = k & ~7;
  for (int p = 0; p < k8; p += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + p);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = ReduceAvx(acc[i][j]);
      for (int p = k8; p < k; ++p) s = std::fma(x[i * ldx + p], w[j * ldw + p], s);
      y[i * ldy + j] = s;
    }
  }
}

bool DetectAvx2Fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
const bool kUseAvx2 = DetectAvx2Fma();

constexpr int kMr = 4;
constexpr int kNr = 3;

template <bool kAvx>
void MatMulImpl(const float* x, int m, int ldx, const float* w, int n, int ldw, int k, float* y,
                int ldy) {
  auto tile = [&](auto mr, auto nr, int i, int j) {
    constexpr int MR = decltype(mr)::value, NR = decltype(nr)::value;
    if constexpr (kAvx) {
      TileAvx<MR, NR>(x + static_cast<int64_t>(i) * ldx, ldx, w + static_cast<int64_t>(j) * ldw,
                      ldw, k, y + static_cast<int64_t>(i) * ldy + j, ldy);
    } else {
      TilePortable<MR, NR>(x + static_cast<int64_t>(i) * ldx, ldx,
                           w + static_cast<int64_t>(j) * ldw, ldw, k,
                           y + static_cast<int64_t>(i) * ldy + j, ldy);
    }
  };
  using M4 = std::integral_constant<int, kMr>;
  using M1 = std::integral_constant<int, 1>;
  using N3 = std::integral_constant<int, kNr>;
  using N1 = std::integral_constant<int, 1>;
  // Cache blocking over rows only; it changes which tile computes an element, never how.
  constexpr int kRowBlock = 64;
  for (int i0 = 0; i0 < m; i0 += kRowBlock) {
    const int i1 = std::min(m, i0 + kRowBlock);
    int j = 0;
    for (; j + kNr <= n; j += kNr) {
      int i = i0;
      for (; i + kMr <= i1; i += kMr) tile(M4{}, N3{}, i, j);
      for (; i < i1; ++i) tile(M1{}, N3{}, i, j);
    }
    for (; j < n; ++j) {
      int i = i0;
      for (; i + kMr <= i1; i += kMr) tile(M4{}, N1{}, i, j);
      for (; i < i1; ++i) tile(M1{}, N1{}, i, j);
    }
  }
}

}  // namespace

void MatMulNT(const float* x, int m, int ldx, const float* w, int n, int ldw, int k, float* y,
              int ldy) {
  if (m <= 0 || n <= 0) return;
  if (kUseAvx2) {
    MatMulImpl<true>(x, m, ldx, w, n, ldw, k, y, ldy);
  } else {
    MatMulImpl<false>(x, m, ldx, w, n, ldw, k, y, ldy);
  }
}

void MatMulNTPortable(const float* x, int m, int ldx, const float* w, int n, int ldw, int k,
                      float* y, int ldy) {
  if (m <= 0 || n <= 0) return;
  MatMulImpl<false>(x, m, ldx, w, n, ldw, k, y, ldy);
}

float Dot(const float* a, const float* b, int k) {
  float y;
  MatMulNT(a, 1, k, b, 1, k, k, &y, 1);
  return y;
}

const char* KernelPath() { return kUseAvx2 ? "avx2+fma" : "portable"; }

}  // namespace kvbridge::model_internal
