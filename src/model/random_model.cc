#include "kvbridge/model/random_model.h"

#include <cmath>
#include <filesystem>
#include <fstream>

#include "kvbridge/model/safetensors.h"
#include "model/model_impl.h"
#include "model/numerics.h"

namespace kvbridge {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// Uniform in [-1, 1) with 24 random bits; exact in fp32.
float Uniform(uint64_t& state) {
  return static_cast<float>(SplitMix64(state) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

}  // namespace

Result<RandomModelSpec> RandomModelPreset(std::string_view preset, ModelArch arch, uint64_t seed) {
  ModelConfig c;
  c.arch = arch;
  c.vocab_size = 264;  // 256 bytes + BOS/EOS/PAD, padded to a multiple of 8
  c.bos_token_id = 256;
  c.eos_token_ids = {257};
  c.pad_token_id = 258;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = arch == ModelArch::kQwen2 ? 1e-6 : 1e-5;
  c.tie_word_embeddings = arch == ModelArch::kQwen2;
  c.qkv_bias = arch == ModelArch::kQwen2;
  c.o_bias = false;
  if (preset == "tiny") {
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.max_position_embeddings = 1024;
  } else if (preset == "small") {
    c.hidden_size = 256;
    c.intermediate_size = 768;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 4;
    c.head_dim = 32;
    c.max_position_embeddings = 4096;
  } else {
    return InvalidArgumentError("unknown preset '" + std::string(preset) +
                                "' (expected tiny or small)");
  }
  c.fp8_k_scale.assign(c.num_hidden_layers, 1.0f);
  c.fp8_v_scale.assign(c.num_hidden_layers, 1.0f);
  RETURN_IF_ERROR(c.Validate());
  return RandomModelSpec{c, seed};
}

Status WriteRandomModel(const RandomModelSpec& spec, const std::string& dir) {
  const ModelConfig& c = spec.config;
  RETURN_IF_ERROR(c.Validate());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return InvalidArgumentError(dir + ": cannot create directory: " + ec.message());

  model_internal::Weights unused;
  auto slots = model_internal::TensorSlots(c, &unused);
  std::vector<SafetensorsTensor> tensors;
  for (const auto& slot : slots) {
    uint64_t state = spec.seed * 0x9e3779b97f4a7c15ull ^ Fnv1a(slot.name);
    size_t count = 1;
    for (int64_t d : slot.shape) count *= static_cast<size_t>(d);
    // Norm weights ~ 1 + U(-0.1, 0.1); biases ~ U(-0.5, 0.5); embeddings ~ U(-1, 1); linear
    // weights ~ U(-a, a) with a = sqrt(3 / fan_in), so activations keep unit variance.
    const bool is_norm = slot.name.find("norm") != std::string::npos;
    const bool is_bias = slot.name.ends_with(".bias");
    const bool is_embed = slot.name == "model.embed_tokens.weight";
    const float a = is_norm    ? 0.1f
                    : is_bias  ? 0.5f
                    : is_embed ? 1.0f
                               : std::sqrt(3.0f / static_cast<float>(slot.shape.back()));
    SafetensorsTensor t{slot.name, "BF16", slot.shape, std::string(count * 2, '\0')};
    for (size_t i = 0; i < count; ++i) {
      const float v = (is_norm ? 1.0f : 0.0f) + a * Uniform(state);
      const uint16_t h = model_internal::FloatToBf16(v);
      std::memcpy(t.data.data() + 2 * i, &h, 2);
    }
    tensors.push_back(std::move(t));
  }
  RETURN_IF_ERROR(WriteSafetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}}));
  std::ofstream out(dir + "/config.json", std::ios::trunc);
  if (!out) return InvalidArgumentError(dir + "/config.json: cannot open for writing");
  out << c.ToJson("bfloat16").dump(2) << "\n";
  out.close();
  if (!out) return DataLossError(dir + "/config.json: write failed");
  return OkStatus();
}

}  // namespace kvbridge
