// `kvbridge generate`: a minimal colocated generation loop over Model::Forward with a local
// paged KV cache (the engine module does the real scheduling).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "apps/command_registry.h"
#include "apps/model_source.h"
#include "kvbridge/model/cuda_model.h"
#include "kvbridge/model/model.h"
#include "kvbridge/model/tensor_parallel.h"

namespace {

struct GenerateOptions {
  std::string model_dir;
  std::string prompt;
  std::string prompt_ids;
  int max_tokens = 32;
  float temperature = 0.0f;
  uint64_t seed = 0;
  std::string kv_dtype = "fp32";  // same default as `serve --kv-cache-dtype auto`
  std::string dtype = "auto";     // resident weight type, as `serve --dtype`
  int threads = 0;
  int tensor_parallel_size = 1;
  std::string device = "cpu";  // cpu | cuda | cuda:N
};

// Valid UTF-8 and printable ASCII pass through; other bytes print as \xNN (random-weight
// models emit arbitrary bytes, which must not garble the terminal).
std::string Printable(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int len = 0;
    if (c >= 0x20 && c < 0x7f) {
      len = 1;
    } else if (c == '\n' || c == '\t') {
      len = 1;
    } else if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
    }
    bool ok = len > 0 && i + len <= s.size();
    for (int k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s[i + k]) & 0xc0) == 0x80;
    if (ok) {
      out.append(s, i, len);
      i += len;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
      ++i;
    }
  }
  return out;
}

int32_t Sample(const float* logits, int vocab, float temperature, std::mt19937_64& rng) {
  int32_t best = 0;
  for (int i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  if (temperature <= 0.0f) return best;
  std::vector<double> p(vocab);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - logits[best]) / temperature);
    sum += p[i];
  }
  double r = std::uniform_real_distribution<double>(0.0, sum)(rng);
  for (int i = 0; i < vocab; ++i) {
    r -= p[i];
    if (r <= 0) return i;
  }
  return best;
}

int RunGenerate(const GenerateOptions& o) {
  using Clock = std::chrono::steady_clock;
  auto weight_dtype = kvbridge::ParseWeightDtype(o.dtype);
  if (!weight_dtype.ok()) {
    std::fprintf(stderr, "error: --dtype: %s\n", weight_dtype.status().ToString().c_str());
    return 2;
  }
  auto device = kvbridge::ParseDeviceSpec(o.device);
  if (!device.ok()) {
    std::fprintf(stderr, "error: %s\n", device.status().ToString().c_str());
    return 2;
  }
  bool weightless = false;
  auto loaded = kvbridge::apps::LoadModelOrPreset(
      o.model_dir, *device >= 0, {.num_threads = o.threads, .dtype = *weight_dtype}, &weightless);
  if (!loaded.ok()) {
    std::fprintf(stderr, "error: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  const kvbridge::Model& model = **loaded;
  // The CPU path (a weightless preset runs on the GPU only: no TP model, no host KV).
  std::unique_ptr<kvbridge::TensorParallelModel> tp;
  if (*device < 0) {
    auto created = kvbridge::TensorParallelModel::Create(*loaded, o.tensor_parallel_size);
    if (!created.ok()) {
      std::fprintf(stderr, "error: %s\n", created.status().ToString().c_str());
      return 2;
    }
    tp = std::move(created).value();
  }
  const auto& tok = model.tokenizer();
  std::vector<int32_t> ids;
  if (!o.prompt_ids.empty()) {
    auto parsed = tok.ParseTokenIds(o.prompt_ids);
    if (!parsed.ok()) {
      std::fprintf(stderr, "error: %s\n", parsed.status().ToString().c_str());
      return 2;
    }
    ids = *parsed;
  } else {
    auto encoded = tok.Encode(o.prompt, /*add_special_tokens=*/true);
    if (!encoded.ok()) {
      std::fprintf(stderr, "error: %s\n", encoded.status().ToString().c_str());
      return 2;
    }
    ids = *std::move(encoded);
  }
  if (ids.empty()) {
    std::fprintf(stderr, "error: empty prompt\n");
    return 2;
  }
  if (o.kv_dtype != "fp32" && o.kv_dtype != "bf16" && o.kv_dtype != "fp8") {
    std::fprintf(stderr, "error: --kv-dtype must be fp32|bf16|fp8, got '%s'\n", o.kv_dtype.c_str());
    return 2;
  }
  kvbridge::KvDtype dtype = kvbridge::KvDtype::kBf16;
  if (o.kv_dtype == "fp32") dtype = kvbridge::KvDtype::kFp32;
  if (o.kv_dtype == "fp8") dtype = kvbridge::KvDtype::kFp8E4M3;
  const int block_size = 16;
  const int total = static_cast<int>(ids.size()) + o.max_tokens;
  if (total > model.config().max_position_embeddings) {
    std::fprintf(stderr, "error: prompt + max tokens (%d) exceed max_position_embeddings %d\n",
                 total, model.config().max_position_embeddings);
    return 2;
  }
  const int num_blocks = (total + block_size - 1) / block_size;
  std::vector<float> ks, vs;
  model.KvScales(dtype, &ks, &vs);
  // One KV cache per tensor-parallel rank (its KV heads), all indexed by the same block table.
  std::vector<kvbridge::LocalKvCache> kv;
  std::vector<kvbridge::PagedKvView> views;
  for (int r = 0; tp != nullptr && r < tp->tp_size(); ++r) {
    kv.emplace_back(tp->KvLayout(r, num_blocks, block_size, dtype), ks, vs);
  }
  for (const auto& k : kv) views.push_back(k.view());
  std::vector<int32_t> table(num_blocks);
  for (int i = 0; i < num_blocks; ++i) table[i] = i;
  // --device cuda: the same loop over CudaModel (its own device KV pool of num_blocks blocks).
  std::unique_ptr<kvbridge::CudaModel> gpu;
  if (*device >= 0) {
    if (o.tensor_parallel_size != 1) {
      std::fprintf(stderr, "error: --device cuda runs --tensor-parallel-size 1 only\n");
      return 2;
    }
    auto created = kvbridge::CudaModel::Create(
        *loaded, {.device = *device,
                  .kv_dtype = dtype,
                  .block_size = block_size,
                  .num_blocks = num_blocks,
                  .max_num_batched_tokens = std::max<int>(16, static_cast<int>(ids.size())),
                  .max_num_seqs = 1,
                  .max_model_len = total});
    if (!created.ok()) {
      std::fprintf(stderr, "error: --device %s: %s\n", o.device.c_str(),
                   created.status().ToString().c_str());
      return 1;
    }
    gpu = std::move(created).value();
  }
  auto forward = [&](const kvbridge::ForwardBatch& b, std::vector<float>* l) {
    return gpu != nullptr ? gpu->Forward(b, l) : tp->Forward(b, views, l);
  };

  std::mt19937_64 rng(o.seed);
  std::vector<float> logits;
  const int vocab = model.config().vocab_size;
  const auto t0 = Clock::now();
  kvbridge::ForwardBatch prefill;
  prefill.sequences.push_back(
      {ids.data(), static_cast<int>(ids.size()), 0, table.data(), num_blocks, true});
  if (auto st = forward(prefill, &logits); !st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  const auto t1 = Clock::now();
  std::vector<int32_t> out;
  int pos = static_cast<int>(ids.size());
  int32_t next = Sample(logits.data(), vocab, o.temperature, rng);
  std::string eos_note;
  while (true) {
    out.push_back(next);
    if (next == tok.eos_id()) {
      eos_note = " (stopped at EOS)";
      break;
    }
    if (static_cast<int>(out.size()) >= o.max_tokens) break;
    kvbridge::ForwardBatch step;
    step.sequences.push_back({&next, 1, pos, table.data(), num_blocks, true});
    if (auto st = forward(step, &logits); !st.ok()) {
      std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
      return 1;
    }
    ++pos;
    next = Sample(logits.data(), vocab, o.temperature, rng);
  }
  const auto t2 = Clock::now();
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf("%s\n", Printable(tok.Decode(out)).c_str());
  std::fprintf(stderr,
               "prompt %zu tokens in %.3f s (%.0f tok/s); generated %zu tokens%s in %.3f s "
               "(%.1f tok/s); kv %s; tp %d; device %s; weights %s %zu bytes; model %s\n",
               ids.size(), prefill_s, ids.size() / std::max(prefill_s, 1e-9), out.size(),
               eos_note.c_str(), decode_s,
               out.size() > 1 ? (out.size() - 1) / std::max(decode_s, 1e-9) : 0.0,
               o.kv_dtype.c_str(), o.tensor_parallel_size,
               gpu != nullptr ? (o.device + " " + gpu->device_name()).c_str() : "cpu",
               model.weight_types().c_str(), model.weight_bytes(), model.fingerprint().c_str());
  return 0;
}

const bool kRegistered = kvbridge::apps::RegisterCommand(
    "generate", "Generate a completion with a local model (no server)",
    [](CLI::App& sub) -> kvbridge::apps::CommandMain {
      auto o = std::make_shared<GenerateOptions>();
      sub.add_option("model_dir", o->model_dir,
                     "model directory (config.json + safetensors); with --device cuda also a "
                     "preset name (qwen2.5-7b, ...: random weights generated on the GPU, seed 0)")
          ->required();
      auto* p = sub.add_option("--prompt", o->prompt, "prompt text (byte tokenizer, BOS added)");
      auto* pi = sub.add_option("--prompt-ids", o->prompt_ids, "prompt as token ids \"1,2,3\"");
      p->excludes(pi);
      sub.add_option("--max-tokens", o->max_tokens, "tokens to generate")
          ->check(CLI::Range(1, 1 << 20))
          ->capture_default_str();
      sub.add_option("--temperature", o->temperature, "0 = greedy")
          ->check(CLI::Range(0.0, 100.0))
          ->capture_default_str();
      sub.add_option("--seed", o->seed, "sampling seed")->capture_default_str();
      sub.add_option("--kv-dtype", o->kv_dtype, "fp32 | bf16 | fp8")
          ->check(CLI::IsMember({"fp32", "bf16", "fp8"}))
          ->capture_default_str();
      sub.add_option("--dtype", o->dtype,
                     "weights kept as: auto (as stored, memory-mapped) | bfloat16 | float16 | "
                     "float32")
          ->capture_default_str();
      sub.add_option("--threads", o->threads, "compute threads at TP 1 (0 = all cores)")
          ->capture_default_str();
      sub.add_option("--tensor-parallel-size,--tp", o->tensor_parallel_size,
                     "tensor-parallel ranks (threads, one each); divides 8 and the head count; "
                     "output is bitwise the same at every size")
          ->capture_default_str();
      sub.add_option("--device", o->device,
                     "cpu, or cuda[:N] (the forward pass and KV cache on GPU N)")
          ->capture_default_str();
      return [o] { return RunGenerate(*o); };
    });

}  // namespace
