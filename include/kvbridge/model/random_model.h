// kvbridge/model/random_model.h — deterministic random-weight models (`kvbridge make-model`).
//
// No weights can be downloaded here, so the default model is made: an HF-valid config.json
// and one model.safetensors with BF16 weights drawn from a seeded SplitMix64 stream per tensor
// (independent of platform and library versions). Same preset + arch + seed => same bytes =>
// same Model::fingerprint(). Preset sizes are pinned in docs/model.md.
//
//   ASSIGN_OR_RETURN(RandomModelSpec spec, RandomModelPreset("tiny", ModelArch::kLlama, 1));
//   RETURN_IF_ERROR(WriteRandomModel(spec, "/tmp/tiny"));
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/common/status.h"
#include "kvbridge/model/config.h"

namespace kvbridge {

struct RandomModelSpec {
  ModelConfig config;
  uint64_t seed = 0;
};

/// "tiny" | "small" for arch llama (untied, no bias) or qwen2 (q/k/v bias, tied embeddings).
/// InvalidArgument for an unknown preset.
Result<RandomModelSpec> RandomModelPreset(std::string_view preset, ModelArch arch, uint64_t seed);

/// Writes `dir/config.json` and `dir/model.safetensors` (creating `dir`).
Status WriteRandomModel(const RandomModelSpec& spec, const std::string& dir);

}  // namespace kvbridge
