#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace kvbridge::model_internal {

namespace {

// transformers' get_mscale: 1 for scale <= 1, else 0.1 * m * ln(scale) + 1.
double YarnMscale(double scale, double m) {
  if (scale <= 1) return 1.0;
  return 0.1 * m * std::log(scale) + 1.0;
}

// The dimension (of d) at which a frequency makes `rotations` turns over `context` positions.
double YarnCorrectionDim(double rotations, int d, double theta, int context) {
  return d * std::log(context / (rotations * 2 * std::numbers::pi)) / (2 * std::log(theta));
}

}  // namespace

std::vector<double> RopeInverseFrequencies(const ModelConfig& c) {
  const int d = c.head_dim, half = d / 2;
  const RopeScaling& s = c.rope_scaling;
  std::vector<double> inv(half);
  for (int i = 0; i < half; ++i) inv[i] = std::pow(c.rope_theta, -2.0 * i / d);
  switch (s.type) {
    case RopeType::kDefault:
    case RopeType::kDynamic:
      break;
    case RopeType::kLinear:
      for (double& f : inv) f /= s.factor;
      break;
    case RopeType::kLlama3: {
      const double orig = s.original_max_position_embeddings;
      const double low_wavelen = orig / s.low_freq_factor;
      const double high_wavelen = orig / s.high_freq_factor;
      for (double& f : inv) {
        const double wavelen = 2 * std::numbers::pi / f;
        if (wavelen < high_wavelen) continue;  // high frequency: kept
        if (wavelen > low_wavelen) {           // low frequency: interpolated
          f /= s.factor;
          continue;
        }
        const double smooth =
            (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
      break;
    }
    case RopeType::kYarn: {
      const int orig = s.original_max_position_embeddings;
      double low = YarnCorrectionDim(s.beta_fast, d, c.rope_theta, orig);
      double high = YarnCorrectionDim(s.beta_slow, d, c.rope_theta, orig);
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(d - 1));
      if (low == high) high += 0.001;  // as transformers: avoids a division by zero
      for (int i = 0; i < half; ++i) {
        const double pos_freq = std::pow(c.rope_theta, 2.0 * i / d);
        const double extrapolation = 1.0 / pos_freq;
        const double interpolation = 1.0 / (s.factor * pos_freq);
        const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
        const double extrapolation_factor = 1 - ramp;
        inv[i] = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
      }
      break;
    }
  }
  return inv;
}

double RopeAttentionFactor(const ModelConfig& c) {
  const RopeScaling& s = c.rope_scaling;
  if (s.type != RopeType::kYarn) return 1.0;
  if (s.attention_factor > 0) return s.attention_factor;
  if (s.mscale != 0 && s.mscale_all_dim != 0) {
    return YarnMscale(s.factor, s.mscale) / YarnMscale(s.factor, s.mscale_all_dim);
  }
  return YarnMscale(s.factor, 1.0);
}

void BuildRopeTables(const ModelConfig& c, std::vector<float>* cos_table,
                     std::vector<float>* sin_table) {
  const int half = c.head_dim / 2;
  const std::vector<double> inv = RopeInverseFrequencies(c);
  const double factor = RopeAttentionFactor(c);
  cos_table->resize(static_cast<size_t>(c.max_position_embeddings) * half);
  sin_table->resize(cos_table->size());
  for (int pos = 0; pos < c.max_position_embeddings; ++pos) {
    for (int i = 0; i < half; ++i) {
      const double angle = pos * inv[i];
      const size_t e = static_cast<size_t>(pos) * half + i;
      (*cos_table)[e] = static_cast<float>(std::cos(angle) * factor);
      (*sin_table)[e] = static_cast<float>(std::sin(angle) * factor);
    }
  }
}

}  // namespace kvbridge::model_internal
