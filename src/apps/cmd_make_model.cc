// `kvbridge make-model`: writes a deterministic random-weight model (HF layout); with
// --tokenizer DIR, laid out like a downloaded checkpoint of that tokenizer.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "apps/command_registry.h"
#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "kvbridge/model/tokenizer.h"

namespace {

namespace fs = std::filesystem;

struct MakeModelOptions {
  std::string preset = "small";
  uint64_t seed = 0;
  std::string out;
  std::string arch;  // empty: the preset's own
  std::string tokenizer_dir;
};

// Real checkpoints pad the embedding past the tokenizer's ids (Qwen2.5/3: 151669 ids, 151936
// rows); make-model rounds up to a multiple of this when the preset's vocabulary is too small.
constexpr int kVocabMultiple = 64;

// Fits `spec` to the tokenizer of `dir` (its tokenizer.json). A preset whose vocabulary covers
// the tokenizer's ids (added tokens included: the real-shaped presets) keeps its config (the
// published one); a smaller one (the byte presets) gets those ids rounded up to
// kVocabMultiple and the tokenizer's BOS/EOS/PAD.
kvbridge::Result<kvbridge::Tokenizer> FitToTokenizer(const std::string& dir,
                                                     kvbridge::RandomModelSpec* spec) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return kvbridge::NotFoundError("--tokenizer " + dir + ": not a directory");
  }
  if (!fs::is_regular_file(fs::path(dir) / "tokenizer.json", ec)) {
    return kvbridge::NotFoundError("--tokenizer " + dir +
                                   ": no tokenizer.json there (a Hugging Face checkpoint's "
                                   "tokenizer directory is needed)");
  }
  ASSIGN_OR_RETURN(kvbridge::Tokenizer tok, kvbridge::Tokenizer::Load(dir, spec->config));
  kvbridge::ModelConfig& c = spec->config;
  if (c.vocab_size < tok.vocab_size()) {
    c.vocab_size = (tok.vocab_size() + kVocabMultiple - 1) / kVocabMultiple * kVocabMultiple;
    c.bos_token_id = tok.bos_id();
    c.eos_token_ids.clear();
    if (tok.eos_id() >= 0) c.eos_token_ids.push_back(tok.eos_id());
    c.pad_token_id = tok.pad_id();
  }
  RETURN_IF_ERROR(c.Validate());
  return tok;
}

kvbridge::Status CopyCheckpointFiles(const std::string& from, const std::string& to,
                                     const kvbridge::ModelConfig& c) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}) {
    const fs::path src = fs::path(from) / name;
    std::error_code ec;
    if (!fs::exists(src, ec)) continue;  // tokenizer.json exists (checked before)
    fs::copy_file(src, fs::path(to) / name, fs::copy_options::overwrite_existing, ec);
    if (ec) {
      return kvbridge::InvalidArgumentError("copying " + src.string() + " to " + to + ": " +
                                            ec.message());
    }
    // A read-only source (a shared cache) must not make the copy read-only.
    fs::permissions(fs::path(to) / name, fs::perms::owner_write, fs::perm_options::add, ec);
  }
  // What transformers writes for a model whose generation settings come from its config.
  nlohmann::json gen{{"_from_model_config", true}, {"transformers_version", "4.51.0"}};
  if (c.bos_token_id >= 0) gen["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) gen["eos_token_id"] = c.eos_token_ids[0];
  if (c.eos_token_ids.size() > 1) gen["eos_token_id"] = c.eos_token_ids;
  if (c.pad_token_id >= 0) gen["pad_token_id"] = c.pad_token_id;
  const std::string path = to + "/generation_config.json";
  std::ofstream out(path, std::ios::trunc);
  out << gen.dump(2) << "\n";
  out.close();
  if (!out) return kvbridge::DataLossError(path + ": write failed");
  return kvbridge::OkStatus();
}

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
  std::optional<kvbridge::Tokenizer> tok;
  if (!o.tokenizer_dir.empty()) {
    auto fitted = FitToTokenizer(o.tokenizer_dir, &*spec);
    if (!fitted.ok()) {
      std::fprintf(stderr, "error: %s\n", fitted.status().ToString().c_str());
      return 1;
    }
    tok = *std::move(fitted);
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
  if (tok) {
    if (auto st = CopyCheckpointFiles(o.tokenizer_dir, o.out, spec->config); !st.ok()) {
      std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
      return 1;
    }
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
  if (tok) {
    std::printf("tokenizer from %s: %d ids (vocab %d), bos %d, eos %d\n", o.tokenizer_dir.c_str(),
                tok->vocab_size(), c.vocab_size, tok->bos_id(), tok->eos_id());
  }
  return 0;
}

const bool kRegistered = kvbridge::apps::RegisterCommand(
    "make-model", "Write a deterministic random-weight model (config.json + model.safetensors)",
    [](CLI::App& sub) -> kvbridge::apps::CommandMain {
      auto o = std::make_shared<MakeModelOptions>();
      sub.add_option("--preset", o->preset,
                     "tiny | small (any arch) | qwen2.5-0.5b | qwen3-0.6b | llama-3.2-1b | "
                     "qwen2.5-7b (15 GB; shapes and config.json of the real checkpoints, random "
                     "bf16 weights)")
          ->check(CLI::IsMember(kvbridge::RandomModelPresetNames()))
          ->capture_default_str();
      sub.add_option("--seed", o->seed, "weight seed")->capture_default_str();
      sub.add_option("--out", o->out, "output directory")->required();
      sub.add_option("--arch", o->arch,
                     "llama | mistral | qwen2 (q/k/v bias, tied embeddings) | qwen3 (q/k norm, "
                     "tied); default: the preset's own (llama for tiny/small)")
          ->check(CLI::IsMember({"llama", "mistral", "qwen2", "qwen3"}));
      sub.add_option("--tokenizer", o->tokenizer_dir,
                     "a Hugging Face tokenizer directory (tokenizer.json, optional "
                     "tokenizer_config.json and chat_template.jinja): copied into the model with "
                     "a generation_config.json. tiny/small: the vocabulary becomes its ids "
                     "rounded up to a multiple of 64 and BOS/EOS/PAD its tokens; the "
                     "real-shaped presets keep their published config. Default: the byte "
                     "tokenizer");
      return [o] { return RunMakeModel(*o); };
    });

}  // namespace
