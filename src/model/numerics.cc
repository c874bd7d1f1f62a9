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

float Exp(float x) { return ExpIeee(x); }

float Fp8E4M3ToFloat(uint8_t b) { return kFp8Table[b]; }

}  // namespace kvbridge::model_internal
