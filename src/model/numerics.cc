#include "model/numerics.h"

#include <array>
#include <cmath>
#include <limits>

namespace kvbridge::model_internal {

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Subnormal or zero: mant * 2^-24 (exact in fp32).
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t FloatToFp16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00u;
  if (a >= 65520.0f) return sign | 0x7c00u;  // rounds to inf
  if (a < 6.103515625e-05f) {                // below min normal 2^-14: subnormal, step 2^-24
    const float q = std::nearbyint(a * 16777216.0f);
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t r = u & 0x7fffffffu;
  r += 0xfffu + ((r >> 13) & 1u);
  const uint32_t exp = (r >> 23) - 112;
  return sign | static_cast<uint16_t>((exp << 10) | ((r >> 13) & 0x3ffu));
}

namespace {
std::array<float, 256> MakeFp8Table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int exp = (b >> 3) & 0xf;
    const int mant = b & 7;
    float v;
    if (exp == 15 && mant == 7) {
      v = std::nanf("");
    } else if (exp == 0) {
      v = std::ldexp(static_cast<float>(mant), -9);
    } else {
      v = std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, exp - 7);
    }
    t[b] = (b & 0x80) ? -v : v;
  }
  return t;
}
const std::array<float, 256> kFp8Table = MakeFp8Table();
}  // namespace

float Exp(float x) {
  if (std::isnan(x)) return x;
  if (x > 88.72283935546875f) return std::numeric_limits<float>::infinity();
  if (x < -103.972084045410156f) return 0.0f;
  const float k = std::nearbyint(x * 1.44269504088896341f);
  // C1 has few significant bits, so k * C1 is exact for |k| <= 150.
  const float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int ki = static_cast<int>(k);
  if (ki > 127) return p * 2.0f * BitsFloat(static_cast<uint32_t>(127 + 127) << 23);
  if (ki < -126) {
    // Two steps so only the last multiplication rounds into the subnormal range.
    return (p * BitsFloat(static_cast<uint32_t>(ki + 64 + 127) << 23)) * 5.42101086e-20f;
  }
  return p * BitsFloat(static_cast<uint32_t>(ki + 127) << 23);
}

float Fp8E4M3ToFloat(uint8_t b) { return kFp8Table[b]; }

uint8_t FloatToFp8E4M3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const float a = std::fabs(f);
  if (a < 0.015625f) {  // below min normal 2^-6: subnormal grid of 2^-9; 8 => min normal
    const float q = std::nearbyint(a * 512.0f);
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

}  // namespace kvbridge::model_internal
