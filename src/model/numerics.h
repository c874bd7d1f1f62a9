// Internal: scalar conversions between fp32 and the storage dtypes (bf16, fp16, fp8 e4m3).
// All round to nearest, ties to even; fp8 saturates to +-448 (OCP "satfinite"), NaN -> 0x7F.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvbridge::model_internal {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float Fp16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);

/// Decodes an fp8 e4m3 (OCP, "fn": no inf; 0x7F/0xFF are NaN) byte.
float Fp8E4M3ToFloat(uint8_t b);
/// Encodes to fp8 e4m3, round to nearest even, saturating to +-448; NaN -> 0x7F.
uint8_t FloatToFp8E4M3(float f);

/// exp(x) in fp32 from IEEE +, -, * only (Cody-Waite reduction + Cephes polynomial, ~1 ulp),
/// so softmax and SiLU give the same bits on every x86-64 whatever libm's CPU dispatch picks.
/// exp(-inf) = 0, exp(+large) = inf, NaN -> NaN.
float Exp(float x);

}  // namespace kvbridge::model_internal
