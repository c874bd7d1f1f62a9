#include "kvbridge/model/random_model.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvbridge/model/safetensors.h"
#include "model/model_impl.h"
#include "model/numerics.h"
#include "model/random_model_internal.h"

namespace kvbridge {
namespace {

uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

namespace model_internal {

RandomTensorGen RandomTensorParams(uint64_t seed, const std::string& name,
                                   const std::vector<int64_t>& shape) {
  // Norm weights ~ 1 + U(-0.1, 0.1); biases ~ U(-0.5, 0.5); embeddings ~ U(-1, 1); linear
  // weights ~ U(-a, a) with a = sqrt(3 / fan_in), so activations keep unit variance.
  const bool is_norm = name.find("norm") != std::string::npos;
  const bool is_bias = name.ends_with(".bias");
  const bool is_embed = name == "model.embed_tokens.weight";
  RandomTensorGen g;
  g.state0 = seed * kSplitMixGamma ^ Fnv1a(name);
  g.offset = is_norm ? 1.0f : 0.0f;
  g.a = is_norm    ? 0.1f
        : is_bias  ? 0.5f
        : is_embed ? 1.0f
                   : std::sqrt(3.0f / static_cast<float>(shape.back()));
  return g;
}

}  // namespace model_internal

namespace {
// A preset's shape; the rest of the config follows the arch.
struct PresetShape {
  const char* name;
  ModelArch arch;  // the preset's own arch
  bool fixed_arch;
  int hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, max_pos;
  bool untied = false;  // a real-shaped qwen2 preset with its own lm_head (Qwen2.5-7B)
};

constexpr PresetShape kPresets[] = {
    {"tiny", ModelArch::kLlama, false, 64, 128, 2, 4, 2, 16, 264, 1024},
    {"small", ModelArch::kLlama, false, 256, 768, 4, 8, 4, 32, 264, 4096},
    // Qwen/Qwen2.5-0.5B-Instruct
    {"qwen2.5-0.5b", ModelArch::kQwen2, true, 896, 4864, 24, 14, 2, 64, 151936, 32768},
    // Qwen/Qwen3-0.6B
    {"qwen3-0.6b", ModelArch::kQwen3, true, 1024, 3072, 28, 16, 8, 128, 151936, 40960},
    // meta-llama/Llama-3.2-1B-Instruct
    {"llama-3.2-1b", ModelArch::kLlama, true, 2048, 8192, 16, 32, 8, 64, 128256, 131072},
    // Qwen/Qwen2.5-7B-Instruct (15.2 GB in bf16: CudaModel::CreateRandom generates it on the GPU)
    {"qwen2.5-7b", ModelArch::kQwen2, true, 3584, 18944, 28, 28, 4, 128, 152064, 32768, true},
};

}  // namespace

std::vector<std::string> RandomModelPresetNames() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

Result<RandomModelSpec> RandomModelPreset(std::string_view preset, uint64_t seed) {
  for (const auto& p : kPresets) {
    if (preset == p.name) return RandomModelPreset(preset, p.arch, seed);
  }
  return RandomModelPreset(preset, ModelArch::kLlama, seed);  // the unknown-preset error
}

Result<RandomModelSpec> RandomModelPreset(std::string_view preset, ModelArch arch, uint64_t seed) {
  const PresetShape* shape = nullptr;
  for (const auto& p : kPresets) {
    if (preset == p.name) shape = &p;
  }
  if (shape == nullptr) {
    std::string names;
    for (const auto& p : kPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
    return InvalidArgumentError("unknown preset '" + std::string(preset) + "' (expected " + names +
                                ")");
  }
  if (shape->fixed_arch && arch != shape->arch) {
    return InvalidArgumentError("preset '" + std::string(preset) + "' is a " +
                                std::string(ModelArchName(shape->arch)) + " model, not " +
                                std::string(ModelArchName(arch)));
  }
  ModelConfig c;
  c.arch = arch;
  c.hidden_size = shape->hidden;
  c.intermediate_size = shape->intermediate;
  c.num_hidden_layers = shape->layers;
  c.num_attention_heads = shape->heads;
  c.num_key_value_heads = shape->kv_heads;
  c.head_dim = shape->head_dim;
  c.vocab_size = shape->vocab;
  c.max_position_embeddings = shape->max_pos;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = arch == ModelArch::kLlama || arch == ModelArch::kMistral ? 1e-5 : 1e-6;
  c.tie_word_embeddings =
      (arch == ModelArch::kQwen2 || arch == ModelArch::kQwen3) && !shape->untied;
  c.qkv_bias = arch == ModelArch::kQwen2;
  c.o_bias = false;
  c.qk_norm = arch == ModelArch::kQwen3;
  if (shape->fixed_arch) {
    // As the published checkpoints' config.json.
    if (arch == ModelArch::kLlama) {  // Llama 3.2 1B
      c.rope_theta = 500000.0;
      c.rope_scaling.type = RopeType::kLlama3;
      c.rope_scaling.factor = 32.0;
      c.rope_scaling.low_freq_factor = 1.0;
      c.rope_scaling.high_freq_factor = 4.0;
      c.rope_scaling.original_max_position_embeddings = 8192;
      c.tie_word_embeddings = true;
      c.bos_token_id = 128000;
      c.eos_token_ids = {128001, 128008, 128009};
    } else {  // Qwen2.5 / Qwen3
      c.rope_theta = 1000000.0;
      c.bos_token_id = 151643;
      c.eos_token_ids = {151645};
    }
  } else {
    c.bos_token_id = 256;  // 256 bytes + BOS/EOS/PAD, vocab padded to a multiple of 8
    c.eos_token_ids = {257};
    c.pad_token_id = 258;
    if (arch == ModelArch::kQwen3) {
      c.head_dim = 2 * shape->hidden / shape->heads;  // q_dim = 2 hidden, as Qwen3-0.6B
      c.rope_theta = 1000000.0;
    }
    if (arch == ModelArch::kMistral) c.rope_theta = 1000000.0;
  }
  c.fp8_k_scale.assign(c.num_hidden_layers, 1.0f);
  c.fp8_v_scale.assign(c.num_hidden_layers, 1.0f);
  RETURN_IF_ERROR(c.Validate());
  return RandomModelSpec{c, seed};
}

Status WriteRandomModel(const RandomModelSpec& spec, const std::string& dir,
                        const WriteProgress& progress) {
  const ModelConfig& c = spec.config;
  RETURN_IF_ERROR(c.Validate());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return InvalidArgumentError(dir + ": cannot create directory: " + ec.message());

  model_internal::Weights unused;
  const auto slots = model_internal::TensorSlots(c, &unused);
  // The safetensors header, as SerializeSafetensors writes it (keys sorted, padded with spaces
  // to a multiple of 8); tensors laid out in slot order.
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto& slot : slots) {
    uint64_t count = 1;
    for (int64_t d : slot.shape) count *= static_cast<uint64_t>(d);
    header[slot.name] = {
        {"dtype", "BF16"}, {"shape", slot.shape}, {"data_offsets", {offset, offset + 2 * count}}};
    offset += 2 * count;
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  const std::string path = dir + "/model.safetensors";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return ErrnoToStatus(errno, "open " + path);
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((uint64_t{h.size()} >> (8 * i)) & 0xff);
  out.write(len, 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  uint64_t done = 0;
  std::string data;
  for (const auto& slot : slots) {
    const model_internal::RandomTensorGen g =
        model_internal::RandomTensorParams(spec.seed, slot.name, slot.shape);
    size_t count = 1;
    for (int64_t d : slot.shape) count *= static_cast<size_t>(d);
    data.resize(count * 2);
    for (size_t i = 0; i < count; ++i) {
      const uint16_t b = model_internal::RandomWeightBf16(g.state0, i, g.offset, g.a);
      std::memcpy(data.data() + 2 * i, &b, 2);
    }
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    if (!out) return ErrnoToStatus(errno, "write " + path);
    done += data.size();
    if (progress) progress(done, offset);
  }
  out.close();
  if (!out) return ErrnoToStatus(errno, "write " + path);
  std::ofstream cfg(dir + "/config.json", std::ios::trunc);
  if (!cfg) return InvalidArgumentError(dir + "/config.json: cannot open for writing");
  cfg << c.ToJson("bfloat16").dump(2) << "\n";
  cfg.close();
  if (!cfg) return DataLossError(dir + "/config.json: write failed");
  return OkStatus();
}

}  // namespace kvbridge
