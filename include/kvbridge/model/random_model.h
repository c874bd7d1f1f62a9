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
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"
#include "kvbridge/model/config.h"

namespace kvbridge {

struct RandomModelSpec {
  ModelConfig config;
  uint64_t seed = 0;
};

/// "tiny" | "small" in any arch: llama (untied, no bias), mistral (as llama, rope_theta 1e6),
/// qwen2 (q/k/v bias, tied embeddings), qwen3 (q/k norm, no bias, tied, head_dim twice
/// hidden/heads as Qwen3 has). The shapes of real checkpoints (same config.json as the
/// published -Instruct models, random weights): "qwen2.5-0.5b" (qwen2), "qwen3-0.6b" (qwen3),
/// "llama-3.2-1b" (llama, rope_scaling llama3), whose arch is fixed: another `arch` is
/// InvalidArgument, as is an unknown preset. docs/model.md "Presets" lists every shape.
Result<RandomModelSpec> RandomModelPreset(std::string_view preset, ModelArch arch, uint64_t seed);
/// The preset in its own arch (llama for tiny and small).
Result<RandomModelSpec> RandomModelPreset(std::string_view preset, uint64_t seed);
/// Every preset name, small to large.
std::vector<std::string> RandomModelPresetNames();

/// Called after each tensor is written: bytes of model.safetensors written so far, and in all.
using WriteProgress = std::function<void(uint64_t bytes_done, uint64_t bytes_total)>;

/// Writes `dir/config.json` and `dir/model.safetensors` (creating `dir`), BF16 tensors
/// generated and written one at a time (memory: the largest tensor).
Status WriteRandomModel(const RandomModelSpec& spec, const std::string& dir,
                        const WriteProgress& progress = {});

}  // namespace kvbridge
