// Internal: the matmul kernels whose arithmetic order is fixed (DESIGN.md "numerics").
//
// Every output element y[m][n] = dot(x[m, 0:k], w[n, 0:k]) is computed the same way whatever
// m, n, the tile it falls in, the thread that computes it, or the instruction set:
//   acc[l] = fma(x[8i + l], w[8i + l], acc[l]) for i = 0 .. k/8-1 (8 lanes, ascending i);
//   s = ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7));
//   then s = fma(x[j], w[j], s) for the tail j = 8*(k/8) .. k-1.
// x is fp32; w is fp32, bf16 or fp16, widened exactly to fp32 before its product (bf16 by a
// 16-bit shift, fp16 by F16C or the scalar decoder — both exact). fma is the fused, correctly
// rounded IEEE operation, so the three paths below (AVX-512, AVX2+FMA, portable std::fma per
// lane) give bitwise identical results: the run-time dispatch never changes a result, only
// its speed. The AVX-512 path holds two output elements' 8-lane accumulators in one zmm
// register (two rows of x against one column of w); it changes where lanes live, not what
// they compute.
#pragma once

#include <cstdint>

namespace kvbridge::model_internal {

/// Element type of a weight matrix as it is resident (usually as stored in the checkpoint).
enum class WeightType : uint8_t { kF32, kBf16, kF16 };

/// Bytes of one element of `t`.
inline int WeightTypeSize(WeightType t) { return t == WeightType::kF32 ? 4 : 2; }
/// "F32", "BF16" or "F16" (the safetensors names).
const char* WeightTypeName(WeightType t);

/// A pointer to weight elements of one type (not owning). Offset counts elements.
struct WeightPtr {
  const void* data = nullptr;
  WeightType type = WeightType::kF32;
  WeightPtr Offset(int64_t elems) const {
    return {static_cast<const uint8_t*>(data) + elems * WeightTypeSize(type), type};
  }
};

/// The instruction-set paths. All give the same bits.
enum class KernelIsa : uint8_t { kPortable, kAvx2, kAvx512 };
/// "portable", "avx2+fma" or "avx512".
const char* KernelIsaName(KernelIsa isa);
/// Whether this CPU can run `isa` (AVX2 needs avx2+fma+f16c; AVX-512 needs avx512f/dq/bw/vl
/// + fma + f16c).
bool KernelIsaSupported(KernelIsa isa);
/// The path MatMulNT uses: the widest supported, or KVBRIDGE_KERNEL=portable|avx2|avx512 from
/// the environment when that one is supported (read once, at first use).
KernelIsa DefaultKernelIsa();

/// y[i*ldy + j] = Dot(x + i*ldx, w + j*ldw, k) for i < m, j < n. Single-threaded; uses
/// per-thread scratch buffers (thread-safe, not reentrant from a signal handler).
void MatMulNT(const float* x, int m, int ldx, WeightPtr w, int n, int ldw, int k, float* y,
              int ldy);
inline void MatMulNT(const float* x, int m, int ldx, const float* w, int n, int ldw, int k,
                     float* y, int ldy) {
  MatMulNT(x, m, ldx, WeightPtr{w, WeightType::kF32}, n, ldw, k, y, ldy);
}
/// MatMulNT on a given path (tests compare every supported path with the portable one).
/// `isa` must be supported.
void MatMulNTWith(KernelIsa isa, const float* x, int m, int ldx, WeightPtr w, int n, int ldw, int k,
                  float* y, int ldy);

/// The fixed-order dot product above.
float Dot(const float* a, const float* b, int k);

/// MatMulNT forced onto the portable path (tests check it is bitwise equal to MatMulNT).
void MatMulNTPortable(const float* x, int m, int ldx, const float* w, int n, int ldw, int k,
                      float* y, int ldy);

/// Name of DefaultKernelIsa().
const char* KernelPath();

/// Widens `n` weights starting at `w` to fp32 (exact).
void WidenWeights(WeightPtr w, int64_t n, float* out);

// ---- element-wise kernels of the forward pass: every operation separately rounded (no fma),
// in the order written, so vector and scalar paths give the same bits (tested) ----

/// y[i] = model_internal::Exp(x[i]) (numerics.h), bitwise.
void ExpArray(const float* x, int n, float* y);
/// gate[i] = gate[i] / (1 + Exp(-gate[i])) * up[i] (SiLU(gate) * up, HF order).
void SiluMul(float* gate, const float* up, int64_t n);
/// One chunk of the online softmax of one query head over `n` KV positions:
///   s[t] *= scale (t < n); m = max(*mx, max_t s[t]); c = Exp(*mx - m);
///   *den *= c; acc[d] *= c (d < hd);
///   for t ascending: p = Exp(s[t] - m); *den += p; acc[d] += p * v[t * hd + d];
///   *mx = m.
void OnlineSoftmaxChunk(float* s, int n, float scale, const float* v, int hd, float* mx, float* den,
                        float* acc);
/// The three above on a given path (tests).
void ExpArrayWith(KernelIsa isa, const float* x, int n, float* y);
void SiluMulWith(KernelIsa isa, float* gate, const float* up, int64_t n);
void OnlineSoftmaxChunkWith(KernelIsa isa, float* s, int n, float scale, const float* v, int hd,
                            float* mx, float* den, float* acc);

}  // namespace kvbridge::model_internal
