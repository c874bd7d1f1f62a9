// Internal: the fp32 kernels whose arithmetic order is fixed (DESIGN.md "numerics").
//
// Every output element y[m][n] = dot(x[m, 0:k], w[n, 0:k]) is computed the same way whatever
// m, n, the tile it falls in, or the thread that computes it:
//   acc[l] = fma(x[8i + l], w[8i + l], acc[l]) for i = 0 .. k/8-1 (8 lanes, ascending i);
//   s = ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7));
//   then s = fma(x[j], w[j], s) for the tail j = 8*(k/8) .. k-1.
// fma is the fused, correctly rounded IEEE operation: the AVX2+FMA path and the portable path
// (std::fma per lane) give bitwise identical results, so the dispatch below never changes a
// result — only its speed.
#pragma once

#include <cstdint>

namespace kvbridge::model_internal {

/// y[i*ldy + j] = Dot(x + i*ldx, w + j*ldw, k) for i < m, j < n. Single-threaded.
void MatMulNT(const float* x, int m, int ldx, const float* w, int n, int ldw, int k, float* y,
              int ldy);

/// The fixed-order dot product above.
float Dot(const float* a, const float* b, int k);

/// MatMulNT forced onto the portable path (tests check it is bitwise equal to MatMulNT).
void MatMulNTPortable(const float* x, int m, int ldx, const float* w, int n, int ldw, int k,
                      float* y, int ldy);

/// "avx2+fma" or "portable".
const char* KernelPath();

}  // namespace kvbridge::model_internal
