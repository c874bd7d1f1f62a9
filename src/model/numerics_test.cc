#include "model/numerics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace kvbridge::model_internal {
namespace {

TEST(Fp8E4M3, EveryCodeRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;  // NaN codes
    const float f = Fp8E4M3ToFloat(static_cast<uint8_t>(b));
    EXPECT_EQ(FloatToFp8E4M3(f), static_cast<uint8_t>(b)) << "code " << b << " value " << f;
  }
}

TEST(Fp8E4M3, KnownValuesAndRounding) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0xff)));
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);  // tie between 1.0 and 1.125 -> even (1.0)
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3a);  // tie between 1.125 and 1.25 -> even (1.25)
  EXPECT_EQ(FloatToFp8E4M3(1.06f), 0x38);
  EXPECT_EQ(FloatToFp8E4M3(1.07f), 0x39);
  EXPECT_EQ(FloatToFp8E4M3(1.1f), 0x39);
  EXPECT_EQ(FloatToFp8E4M3(1000.0f), 0x7e);  // saturates
  EXPECT_EQ(FloatToFp8E4M3(-1000.0f), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(460.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(std::nanf("")), 0x7f);
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.0f, -10)), 0x00);  // tie 0 vs 2^-9 -> even (0)
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(3.0f, -10)), 0x02);  // tie 1 vs 2 (x 2^-9) -> 2
  EXPECT_EQ(FloatToFp8E4M3(0.0155f), 0x08);                // rounds up into the first normal
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
}

TEST(Exp, WithinTwoUlpOfLibmAndExactAtTheEdges) {
  EXPECT_EQ(Exp(0.0f), 1.0f);
  EXPECT_EQ(Exp(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isinf(Exp(100.0f)));
  EXPECT_TRUE(std::isnan(Exp(std::nanf(""))));
  EXPECT_EQ(Exp(-200.0f), 0.0f);
  for (float x = -87.0f; x < 88.5f; x += 0.0123f) {
    const double want = std::exp(static_cast<double>(x));
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    ASSERT_LE(std::fabs(Exp(x) - want), 2 * ulp) << x;
  }
  for (float x = -103.0f; x < -87.0f; x += 0.31f) {  // subnormal results
    const double want = std::exp(static_cast<double>(x));
    ASSERT_LE(std::fabs(Exp(x) - want), std::ldexp(1.0, -149) + want * 1e-6) << x;
  }
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToBf16(f), h);
  }
}

TEST(Fp16, ConvertsBothWays) {
  EXPECT_EQ(Fp16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(Fp16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFloat(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(Fp16ToFloat(0x7c00)));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToFp16(f), h) << h;
  }
}

}  // namespace
}  // namespace kvbridge::model_internal
