// Internal: RoPE frequencies and tables for every supported rope type (config.h RopeType),
// following transformers' modeling_rope_utils (there computed in fp32, here in double).
#pragma once

#include <vector>

#include "kvbridge/model/config.h"

namespace kvbridge::model_internal {

/// inv_freq[i], i in [0, head_dim / 2): the angle per position of rotary pair i.
///   default: theta^(-2i/d)
///   linear:  default / factor
///   dynamic: default (transformers rescales only once a forward call reaches beyond
///            max_position_embeddings, which Forward refuses; docs/model.md "RoPE")
///   llama3:  default, / factor where the wavelength 2pi/f exceeds orig / low_freq_factor,
///            unchanged below orig / high_freq_factor, smoothly interpolated in between
///   yarn:    interpolation 1/(factor theta^(2i/d)) and extrapolation theta^(-2i/d) blended by
///            a linear ramp over the correction range [low, high] of beta_fast/beta_slow
std::vector<double> RopeInverseFrequencies(const ModelConfig& c);

/// The factor cos and sin are multiplied by: yarn's attention factor (given, or
/// 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio); 1 for every other type.
double RopeAttentionFactor(const ModelConfig& c);

/// Tables [max_position_embeddings][head_dim / 2]: cos(pos * inv_freq[i]) * attention factor,
/// and the same for sin, computed in double and rounded once to fp32.
void BuildRopeTables(const ModelConfig& c, std::vector<float>* cos_table,
                     std::vector<float>* sin_table);

}  // namespace kvbridge::model_internal
