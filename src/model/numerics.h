// Internal: scalar conversions between fp32 and the storage dtypes (bf16, fp16, fp8 e4m3).
// All round to nearest, ties to even; fp8 saturates to +-448 (OCP "satfinite"), NaN -> 0x7F.
#pragma once

#include <cstdint>
#include <cstring>

#include "model/numerics_hd.h"  // FloatBits, BitsFloat, bf16, FloatToFp8E4M3, ExpIeee

namespace kvbridge::model_internal {

float Fp16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);

/// Decodes an fp8 e4m3 (OCP, "fn": no inf; 0x7F/0xFF are NaN) byte.
float Fp8E4M3ToFloat(uint8_t b);

/// exp(x) in fp32 from IEEE +, -, * only (Cody-Waite reduction + Cephes polynomial, ~1 ulp),
/// so softmax and SiLU give the same bits on every x86-64 whatever libm's CPU dispatch picks.
/// exp(-inf) = 0, exp(+large) = inf, NaN -> NaN. ExpIeee (numerics_hd.h), compiled here; the
/// GPU kernels compile the same definition.
float Exp(float x);

}  // namespace kvbridge::model_internal
