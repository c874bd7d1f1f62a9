// `kvbridge make-model`: writes a deterministic random-weight model (HF layout).
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
  std::string arch = "llama";
};

int RunMakeModel(const MakeModelOptions& o) {
  const kvbridge::ModelArch arch =
      o.arch == "qwen2" ? kvbridge::ModelArch::kQwen2 : kvbridge::ModelArch::kLlama;
  auto spec = kvbridge::RandomModelPreset(o.preset, arch, o.seed);
  if (!spec.ok()) {
    std::fprintf(stderr, "error: %s\n", spec.status().ToString().c_str());
    return 1;
  }
  if (auto st = kvbridge::WriteRandomModel(*spec, o.out); !st.ok()) {
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
      "wrote %s: preset %s, arch %s, seed %llu, hidden %d, layers %d, heads %d/%d, "
      "vocab %d, fingerprint %s\n",
      o.out.c_str(), o.preset.c_str(), o.arch.c_str(), static_cast<unsigned long long>(o.seed),
      c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
      c.vocab_size, (*model)->fingerprint().c_str());
  return 0;
}

const bool kRegistered = kvbridge::apps::RegisterCommand(
    "make-model", "Write a deterministic random-weight model (config.json + model.safetensors)",
    [](CLI::App& sub) -> kvbridge::apps::CommandMain {
      auto o = std::make_shared<MakeModelOptions>();
      sub.add_option("--preset", o->preset, "tiny | small")
          ->check(CLI::IsMember({"tiny", "small"}))
          ->capture_default_str();
      sub.add_option("--seed", o->seed, "weight seed")->capture_default_str();
      sub.add_option("--out", o->out, "output directory")->required();
      sub.add_option("--arch", o->arch, "llama | qwen2 (q/k/v bias, tied embeddings)")
          ->check(CLI::IsMember({"llama", "qwen2"}))
          ->capture_default_str();
      return [o] { return RunMakeModel(*o); };
    });

}  // namespace
