// `kvbridge make-model`: writes a deterministic random-weight model (HF layout).
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "apps/command_registry.h"
#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"

namespace {

struct MakeModelOptions {
  std::string preset = "small";
  uint64_t seed = 0;
  std::string out;
  std::string arch;  // empty: the preset's own
};

int RunMakeModel(const MakeModelOptions& o) {
  kvbridge::Result<kvbridge::RandomModelSpec> spec = kvbridge::InvalidArgumentError("unreachable");
  if (o.arch.empty()) {
    spec = kvbridge::RandomModelPreset(o.preset, o.seed);
  } else {
    auto arch = kvbridge::ParseModelArch(o.arch);
    if (!arch.ok()) {
      std::fprintf(stderr, "error: %s\n", arch.status().ToString().c_str());
      return 1;
    }
    spec = kvbridge::RandomModelPreset(o.preset, *arch, o.seed);
  }
  if (!spec.ok()) {
    std::fprintf(stderr, "error: %s\n", spec.status().ToString().c_str());
    return 1;
  }
  // Progress on stderr for files over 64 MB (the real-shaped presets are 1-2.5 GB).
  const auto start = std::chrono::steady_clock::now();
  int last_percent = -1;
  auto progress = [&](uint64_t done, uint64_t total) {
    if (total < (64ull << 20)) return;
    const int percent = static_cast<int>(done * 100 / total);
    if (percent / 5 == last_percent / 5 && done != total) return;
    last_percent = percent;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "make-model: model.safetensors %3d%% (%.0f / %.0f MB, %.1f s)\n", percent,
                 done / 1e6, total / 1e6, s);
  };
  if (auto st = kvbridge::WriteRandomModel(*spec, o.out, progress); !st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  auto model = kvbridge::Model::Load(o.out, {.num_threads = 1});
  if (!model.ok()) {
    std::fprintf(stderr, "error: reloading the written model: %s\n",
                 model.status().ToString().c_str());
    return 1;
  }
  const auto& c = (*model)->config();
  std::printf(
      "wrote %s: preset %s, arch %s, seed %llu, hidden %d, layers %d, heads %d/%d, head_dim %d, "
      "vocab %d, rope %s, fingerprint %s\n",
      o.out.c_str(), o.preset.c_str(), std::string(kvbridge::ModelArchName(c.arch)).c_str(),
      static_cast<unsigned long long>(o.seed), c.hidden_size, c.num_hidden_layers,
      c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size,
      std::string(kvbridge::RopeTypeName(c.rope_scaling.type)).c_str(),
      (*model)->fingerprint().c_str());
  return 0;
}

const bool kRegistered = kvbridge::apps::RegisterCommand(
    "make-model", "Write a deterministic random-weight model (config.json + model.safetensors)",
    [](CLI::App& sub) -> kvbridge::apps::CommandMain {
      auto o = std::make_shared<MakeModelOptions>();
      sub.add_option("--preset", o->preset,
                     "tiny | small (any arch) | qwen2.5-0.5b | qwen3-0.6b | llama-3.2-1b (shapes "
                     "and config.json of the real checkpoints, random bf16 weights)")
          ->check(CLI::IsMember(kvbridge::RandomModelPresetNames()))
          ->capture_default_str();
      sub.add_option("--seed", o->seed, "weight seed")->capture_default_str();
      sub.add_option("--out", o->out, "output directory")->required();
      sub.add_option("--arch", o->arch,
                     "llama | mistral | qwen2 (q/k/v bias, tied embeddings) | qwen3 (q/k norm, "
                     "tied); default: the preset's own (llama for tiny/small)")
          ->check(CLI::IsMember({"llama", "mistral", "qwen2", "qwen3"}));
      return [o] { return RunMakeModel(*o); };
    });

}  // namespace
