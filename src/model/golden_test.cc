// Golden logits from Hugging Face transformers (tests/golden/*.json, made by
// scripts/make_golden.py: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
// Qwen3ForCausalLM in float64, RoPE default/linear/dynamic/yarn/llama3). Each fixture holds the
// config.json and seed its model was made with; the model is regenerated here by the code
// behind `kvbridge make-model` (weights depend on tensor names, shapes and the seed only).
//
// Bound, for every saved logit of a row r: |ours - hf| <= kTolerance * (1 + max_j |hf_r[j]|),
// kTolerance = 1e-6 (docs/model.md "Golden logits" says why). Checked on the full rows of a few
// positions per prompt and, at every 4th position, on the top-4 logits and the row's sum and
// sum of squares (with the bounds those sums inherit). Negative controls: a wrong rms_norm_eps, a
// wrong rope_theta and a missing q/k norm each break the bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "kvbridge/model/model.h"
#include "model/rope.h"
#include "model/test_util.h"

namespace kvbridge {
namespace {

constexpr double kTolerance = 1e-6;

std::string GoldenDir() {
  const char* src = std::getenv("KVBRIDGE_SOURCE_DIR");
  return std::string(src ? src : ".") + "/tests/golden";
}

nlohmann::json ReadFixture(const std::string& name) {
  const std::string path = GoldenDir() + "/" + name + ".json";
  std::ifstream in(path);
  EXPECT_TRUE(in) << "missing fixture " << path << " (set KVBRIDGE_SOURCE_DIR)";
  if (!in) return nullptr;
  return nlohmann::json::parse(in);
}

// The fixture's model as make-model writes it, its config changed by `mutate` (negative
// controls).
struct Loaded {
  testing_model::TempDir dir;
  std::shared_ptr<Model> model;
};
std::unique_ptr<Loaded> LoadFixtureModel(const nlohmann::json& fx,
                                         const std::function<void(ModelConfig*)>& mutate = {}) {
  auto config = ModelConfig::FromJson(fx["model"]["config"].dump());
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  if (!config.ok()) return nullptr;
  RandomModelSpec spec{*config, fx["model"]["seed"].get<uint64_t>()};
  if (mutate) mutate(&spec.config);
  auto loaded = std::make_unique<Loaded>();
  loaded->model = testing_model::WriteAndLoad(loaded->dir.path(), spec);
  if (loaded->model == nullptr) return nullptr;
  return loaded;
}

// Every position's logits of `ids`, decode-style (one token per step from cached KV; the
// invariance tests make any other chunking give the same bits).
std::vector<std::vector<float>> AllLogits(const Model& model, const std::vector<int32_t>& ids) {
  std::vector<float> ks, vs;
  model.KvScales(KvDtype::kFp32, &ks, &vs);
  constexpr int kBlocks = 32;
  LocalKvCache kv(model.KvLayout(kBlocks, 16, KvDtype::kFp32), ks, vs);
  std::vector<int32_t> table(kBlocks);
  for (int i = 0; i < kBlocks; ++i) table[i] = kBlocks - 1 - i;
  std::vector<std::vector<float>> out;
  for (size_t t = 0; t < ids.size(); ++t) {
    ForwardBatch b;
    b.sequences.push_back({ids.data() + t, 1, static_cast<int>(t), table.data(), kBlocks, true});
    std::vector<float> logits;
    Status st = model.Forward(b, kv.view(), &logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    out.push_back(std::move(logits));
  }
  return out;
}

struct Comparison {
  double worst = 0;      // max |ours - hf| / (1 + max |hf row|) over every compared logit
  double worst_sum = 0;  // max |sum ours - sum hf| / its bound, likewise for the sum of squares
  int logits = 0;
  std::string where;  // the worst logit
};

// Compares `model` with every row and digest of fixture `fx`.
Comparison Compare(const Model& model, const nlohmann::json& fx) {
  Comparison cmp;
  const int vocab = model.config().vocab_size;
  auto note = [&](double ratio, const std::string& where) {
    if (ratio > cmp.worst) {
      cmp.worst = ratio;
      cmp.where = where;
    }
    ++cmp.logits;
  };
  for (const auto& p : fx["prompts"]) {
    const auto ids = p["token_ids"].get<std::vector<int32_t>>();
    const auto ours = AllLogits(model, ids);
    if (ours.size() != ids.size()) return cmp;
    const auto positions = p["row_positions"].get<std::vector<int>>();
    for (size_t i = 0; i < positions.size(); ++i) {
      const auto hf = p["rows"][i].get<std::vector<double>>();
      EXPECT_EQ(static_cast<int>(hf.size()), vocab);
      double mx = 0;
      for (double v : hf) mx = std::max(mx, std::fabs(v));
      for (int j = 0; j < vocab && j < static_cast<int>(hf.size()); ++j) {
        note(std::fabs(ours[positions[i]][j] - hf[j]) / (1 + mx),
             "pos " + std::to_string(positions[i]) + " logit " + std::to_string(j));
      }
    }
    const auto digest_positions = p["digest_positions"].get<std::vector<int>>();
    for (size_t i = 0; i < digest_positions.size(); ++i) {
      const int t = digest_positions[i];
      const auto& d = p["digests"][i];
      const double scale = 1 + d["absmax"].get<double>();
      for (const auto& top : d["top"]) {
        const int id = top[0].get<int>();
        note(std::fabs(ours[t][id] - top[1].get<double>()) / scale,
             "pos " + std::to_string(t) + " top logit " + std::to_string(id));
      }
      // Every |ours_j - hf_j| <= tol * scale implies |sum ours - sum hf| <= V tol scale and
      // |sumsq ours - sumsq hf| <= tol scale (2 sum |hf| + V tol scale).
      double sum = 0, sumsq = 0;
      for (float v : ours[t]) {
        sum += v;
        sumsq += static_cast<double>(v) * v;
      }
      const double e = kTolerance * scale;
      cmp.worst_sum =
          std::max(cmp.worst_sum, std::fabs(sum - d["sum"].get<double>()) / (vocab * e));
      cmp.worst_sum =
          std::max(cmp.worst_sum, std::fabs(sumsq - d["sumsq"].get<double>()) /
                                      (e * (2 * d["abssum"].get<double>() + vocab * e)));
    }
  }
  return cmp;
}

void CheckFixture(const std::string& name) {
  const nlohmann::json fx = ReadFixture(name);
  ASSERT_FALSE(fx.is_null());
  auto loaded = LoadFixtureModel(fx);
  ASSERT_TRUE(loaded);
  const Model& model = *loaded->model;
  const ModelConfig& c = model.config();

  // RoPE: our double frequencies against transformers' own rope function run in float64, and
  // against its stock fp32 buffer.
  const auto& rope = fx["rope"];
  const std::vector<double> inv = model_internal::RopeInverseFrequencies(c);
  const auto hf_inv = rope["inv_freq_f64"].get<std::vector<double>>();
  const auto hf_inv_stock = rope["inv_freq_stock"].get<std::vector<double>>();
  ASSERT_EQ(inv.size(), hf_inv.size());
  for (size_t i = 0; i < inv.size(); ++i) {
    EXPECT_NEAR(inv[i], hf_inv[i], 1e-13 * hf_inv[i]) << name << " inv_freq " << i;
    EXPECT_NEAR(inv[i], hf_inv_stock[i], 1e-6 * hf_inv[i]) << name << " inv_freq " << i;
  }
  EXPECT_NEAR(model_internal::RopeAttentionFactor(c), rope["attention_scaling"].get<double>(),
              1e-14)
      << name;
  EXPECT_EQ(std::string(RopeTypeName(c.rope_scaling.type)), rope["rope_type"].get<std::string>());

  for (const auto& p : fx["prompts"]) {  // byte tokens, cut at max_position_embeddings
    const auto ids = p["token_ids"].get<std::vector<int32_t>>();
    auto encoded = model.tokenizer().Encode(p["text"].get<std::string>(), true);
    ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
    std::vector<int32_t> ours = *encoded;
    ours.resize(std::min(ours.size(), ids.size()));
    EXPECT_EQ(ids, ours) << name;
  }
  const Comparison cmp = Compare(model, fx);
  EXPECT_GT(cmp.logits, 1000);
  EXPECT_LE(cmp.worst, kTolerance) << name << ": worst at " << cmp.where;
  EXPECT_LE(cmp.worst_sum, 1.0) << name << ": a row's sum or sum of squares";
  std::printf(
      "[ golden ] %s (%s, rope %s): %d logits, worst |ours - hf| / (1 + max|row|) = %.3g "
      "(bound %.0e); transformers' own fp32 error %.3g\n",
      name.c_str(), fx["model"]["class"].get<std::string>().c_str(),
      std::string(RopeTypeName(c.rope_scaling.type)).c_str(), cmp.logits, cmp.worst, kTolerance,
      fx["stock_vs_f64"].get<double>());
}

TEST(GoldenLogits, Llama) { CheckFixture("llama_tiny_seed1"); }
TEST(GoldenLogits, Qwen2) { CheckFixture("qwen2_tiny_seed2"); }
TEST(GoldenLogits, Qwen3) { CheckFixture("qwen3_tiny_seed3"); }
TEST(GoldenLogits, Mistral) { CheckFixture("mistral_tiny_seed4"); }
TEST(GoldenLogits, RopeLlama3) { CheckFixture("llama3rope_tiny_seed5"); }
TEST(GoldenLogits, RopeLinear) { CheckFixture("linear_tiny_seed6"); }
TEST(GoldenLogits, RopeDynamic) { CheckFixture("dynamic_tiny_seed7"); }
TEST(GoldenLogits, RopeYarnQwen3) { CheckFixture("yarn_qwen3_tiny_seed8"); }
TEST(GoldenLogits, RopeYarnAllKeys) { CheckFixture("yarn_llama_tiny_seed9"); }

// Dynamic NTK: transformers rescales the frequencies once a forward call reaches beyond
// max_position_embeddings (for the whole call, so a position's logits would depend on the
// tokens after it); we serve up to max_position_embeddings, where it is default RoPE exactly.
TEST(GoldenLogits, RopeDynamicRefusesPositionsBeyondMaxPositionEmbeddings) {
  const nlohmann::json fx = ReadFixture("dynamic_tiny_seed7");
  ASSERT_FALSE(fx.is_null());
  EXPECT_GT(fx["dynamic_prefix_changes_beyond_max"].get<double>(), 1e-3);
  auto loaded = LoadFixtureModel(fx);
  ASSERT_TRUE(loaded);
  const Model& model = *loaded->model;
  ASSERT_EQ(model.config().max_position_embeddings, 128);
  std::vector<float> ks, vs;
  model.KvScales(KvDtype::kFp32, &ks, &vs);
  LocalKvCache kv(model.KvLayout(9, 16, KvDtype::kFp32), ks, vs);
  std::vector<int32_t> table = {0, 1, 2, 3, 4, 5, 6, 7, 8};
  const int32_t token = 65;
  ForwardBatch b;
  b.sequences.push_back({&token, 1, 128, table.data(), 9, true});
  std::vector<float> logits;
  Status st = model.Forward(b, kv.view(), &logits);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("exceed max_position_embeddings 128"), std::string::npos)
      << st.ToString();
}

// Negative controls: each mistake must break the bound the real model meets.
double WorstWith(const std::string& name, const std::function<void(ModelConfig*)>& mutate) {
  const nlohmann::json fx = ReadFixture(name);
  if (fx.is_null()) return 0;
  auto loaded = LoadFixtureModel(fx, mutate);
  if (!loaded) return 0;
  const double worst = Compare(*loaded->model, fx).worst;
  std::printf("[ golden ] %s, mutated: worst %.3g (bound %.0e)\n", name.c_str(), worst, kTolerance);
  return worst;
}

TEST(GoldenLogits, WrongRmsNormEpsFails) {
  // The Llama (1e-5) and Qwen (1e-6) conventions swapped.
  EXPECT_GT(WorstWith("llama_tiny_seed1", [](ModelConfig* c) { c->rms_norm_eps = 1e-6; }),
            kTolerance);
  EXPECT_GT(WorstWith("qwen3_tiny_seed3", [](ModelConfig* c) { c->rms_norm_eps = 1e-5; }),
            kTolerance);
}

TEST(GoldenLogits, WrongRopeThetaFails) {
  EXPECT_GT(WorstWith("llama_tiny_seed1", [](ModelConfig* c) { c->rope_theta *= 1.01; }),
            kTolerance);
  EXPECT_GT(WorstWith("llama3rope_tiny_seed5", [](ModelConfig* c) { c->rope_theta *= 1.01; }),
            kTolerance);
}

TEST(GoldenLogits, MissingQkNormFails) {
  // The same weights read as a Llama (no q/k norm; everything else equal).
  EXPECT_GT(WorstWith("qwen3_tiny_seed3",
                      [](ModelConfig* c) {
                        c->arch = ModelArch::kLlama;
                        c->qk_norm = false;
                      }),
            kTolerance);
}

TEST(GoldenLogits, IgnoredRopeScalingFails) {
  EXPECT_GT(WorstWith("llama3rope_tiny_seed5",
                      [](ModelConfig* c) { c->rope_scaling.type = RopeType::kDefault; }),
            kTolerance);
  EXPECT_GT(WorstWith("yarn_qwen3_tiny_seed8",
                      [](ModelConfig* c) { c->rope_scaling.attention_factor = 1.0; }),
            kTolerance);
}

}  // namespace
}  // namespace kvbridge
