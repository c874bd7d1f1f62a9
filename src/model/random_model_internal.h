// Internal: the per-tensor parameters of random_model.h's weight generator, shared by
// WriteRandomModel (host, to a safetensors file) and CudaModel::CreateRandom (straight into
// device memory). Element i of a tensor is RandomWeightBf16(state0, i, offset, a)
// (numerics_hd.h), so both produce the same bf16 bits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvbridge::model_internal {

struct RandomTensorGen {
  uint64_t state0 = 0;  ///< the tensor's SplitMix64 stream: seed * gamma ^ FNV-1a(name)
  float offset = 0.0f;  ///< 1 for norm weights, else 0
  float a = 0.0f;       ///< half-width of the uniform distribution
};

/// The generator of tensor `name` (HF name, e.g. "model.layers.0.self_attn.q_proj.weight") of
/// shape `shape` (fan-in = shape.back()) for `seed`.
RandomTensorGen RandomTensorParams(uint64_t seed, const std::string& name,
                                   const std::vector<int64_t>& shape);

}  // namespace kvbridge::model_internal
