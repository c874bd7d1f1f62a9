// Internal: the scalar numerics that the CPU forward (numerics.cc, kernels.cc) and the GPU
// kernels (cuda/cuda_kernels.cu) must compute bit for bit alike: bf16 rounding, fp8 e4m3
// encoding, exp, and the counter-based weight generator of random_model.h. One definition,
// compiled by the host compiler and by nvcc (__host__ __device__), so the two cannot drift.
//
// Every floating-point operation goes through KVB_FMUL / KVB_FADD / KVB_FSUB: plain IEEE operators
// on the host (the model library builds with -ffp-contract=off), the explicitly rounded
// intrinsics __fmul_rn / __fadd_rn / __fsub_rn on the device, which nvcc never fuses into an FMA
// whatever -fmad says. So the CPU's unfused order is kept on both sides.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVB_HD __host__ __device__ __forceinline__
#else
#define KVB_HD inline
#endif

#if defined(__CUDA_ARCH__)
#define KVB_FMUL(a, b) __fmul_rn((a), (b))
#define KVB_FADD(a, b) __fadd_rn((a), (b))
#define KVB_FSUB(a, b) __fsub_rn((a), (b))
#else
#define KVB_FMUL(a, b) ((a) * (b))
#define KVB_FADD(a, b) ((a) + (b))
#define KVB_FSUB(a, b) ((a) - (b))
#endif

namespace kvbridge::model_internal {

KVB_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
KVB_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
KVB_HD bool IsNan(float f) { return (FloatBits(f) & 0x7fffffffu) > 0x7f800000u; }
/// Round to nearest integer, ties to even (the default rounding mode on the host).
KVB_HD float RoundEven(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return __builtin_nearbyintf(x);
#endif
}

KVB_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }
/// Round to nearest even; NaN stays a (quiet) NaN.
KVB_HD uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// Encodes to fp8 e4m3 (OCP "fn"), round to nearest even, saturating to +-448; NaN -> 0x7F.
KVB_HD uint8_t FloatToFp8E4M3(float f) {
  if (IsNan(f)) return 0x7f;
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const float a = BitsFloat(u & 0x7fffffffu);
  if (a < 0.015625f) {  // below min normal 2^-6: subnormal grid of 2^-9; 8 => min normal
    const float q = RoundEven(KVB_FMUL(a, 512.0f));  // exact product
    return sign | static_cast<uint8_t>(q);
  }
  uint32_t r = u & 0x7fffffffu;
  if (r >= 0x43e00000u) return sign | 0x7e;  // >= 448 (or inf): saturate
  r += 0x7ffffu + ((r >> 20) & 1u);
  const int exp = static_cast<int>(r >> 23) - 127 + 7;
  const uint32_t mant = (r >> 20) & 7u;
  if (exp > 15 || (exp == 15 && mant == 7)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((exp << 3) | mant);
}

/// exp(x) in fp32 from IEEE +, -, * only (Cody-Waite reduction + Cephes polynomial, ~1 ulp),
/// the same bits on every x86-64 whatever libm's CPU dispatch picks, and on the GPU.
/// exp(-inf) = 0, exp(+large) = inf, NaN -> NaN.
KVB_HD float ExpIeee(float x) {
  if (IsNan(x)) return x;
  if (x > 88.72283935546875f) return BitsFloat(0x7f800000u);
  if (x < -103.972084045410156f) return 0.0f;
  const float k = RoundEven(KVB_FMUL(x, 1.44269504088896341f));
  // C1 has few significant bits, so k * C1 is exact for |k| <= 150.
  const float r = KVB_FSUB(KVB_FSUB(x, KVB_FMUL(k, 0.693359375f)), KVB_FMUL(k, -2.12194440e-4f));
  float p = 1.9875691500e-4f;
  p = KVB_FADD(KVB_FMUL(p, r), 1.3981999507e-3f);
  p = KVB_FADD(KVB_FMUL(p, r), 8.3334519073e-3f);
  p = KVB_FADD(KVB_FMUL(p, r), 4.1665795894e-2f);
  p = KVB_FADD(KVB_FMUL(p, r), 1.6666665459e-1f);
  p = KVB_FADD(KVB_FMUL(p, r), 5.0000001201e-1f);
  p = KVB_FADD(KVB_FADD(KVB_FMUL(p, KVB_FMUL(r, r)), r), 1.0f);
  const int ki = static_cast<int>(k);
  if (ki > 127)
    return KVB_FMUL(KVB_FMUL(p, 2.0f), BitsFloat(static_cast<uint32_t>(127 + 127) << 23));
  if (ki < -126) {
    // Two steps so only the last multiplication rounds into the subnormal range.
    return KVB_FMUL(KVB_FMUL(p, BitsFloat(static_cast<uint32_t>(ki + 64 + 127) << 23)),
                    5.42101086e-20f);
  }
  return KVB_FMUL(p, BitsFloat(static_cast<uint32_t>(ki + 127) << 23));
}

// ---- the random weights of random_model.h, counter-based ----
//
// Tensor t's element i is bf16(offset + a * u_i), u_i = (SplitMix64 output i of the tensor's
// stream) >> 40 scaled to [-1, 1): output i is Mix(state0 + (i + 1) * gamma), so any element
// can be computed alone (the GPU generates a tensor with one thread per element, the host in
// order; same bits).
constexpr uint64_t kSplitMixGamma = 0x9e3779b97f4a7c15ull;

KVB_HD uint64_t SplitMix64Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/// Element i of the tensor whose stream starts at state0 (see RandomTensorState).
KVB_HD uint16_t RandomWeightBf16(uint64_t state0, uint64_t i, float offset, float a) {
  const uint64_t z = SplitMix64Mix(state0 + (i + 1) * kSplitMixGamma);
  // 24 random bits, exact in fp32; minus 1 is exact too: u in [-1, 1).
  const float u = KVB_FSUB(KVB_FMUL(static_cast<float>(z >> 40), 2.0f / 16777216.0f), 1.0f);
  return FloatToBf16(KVB_FADD(offset, KVB_FMUL(a, u)));
}

}  // namespace kvbridge::model_internal
