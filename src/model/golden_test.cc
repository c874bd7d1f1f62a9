// Golden logits from Hugging Face transformers (tests/golden/*.json, made by
// scripts/make_golden.py with LlamaForCausalLM / Qwen2ForCausalLM in float64). The models are
// regenerated here from their preset/arch/seed by the code behind `kvbridge make-model`.
// Assertion, for every saved logit: |ours - hf| <= 1e-4 * max(1, |hf|).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvbridge/model/model.h"
#include "model/test_util.h"

namespace kvbridge {
namespace {

std::string GoldenDir() {
  const char* src = std::getenv("KVBRIDGE_SOURCE_DIR");
  return std::string(src ? src : ".") + "/tests/golden";
}

void CheckFixture(const std::string& name) {
  const std::string path = GoldenDir() + "/" + name;
  std::ifstream in(path);
  ASSERT_TRUE(in) << "missing fixture " << path << " (set KVBRIDGE_SOURCE_DIR)";
  nlohmann::json fx = nlohmann::json::parse(in);
  const auto& m = fx["model"];
  const ModelArch arch = m["arch"] == "qwen2" ? ModelArch::kQwen2 : ModelArch::kLlama;
  testing_model::TempDir dir;
  auto model = testing_model::MakeAndLoad(dir.path(), m["preset"].get<std::string>().c_str(), arch,
                                          m["seed"].get<uint64_t>());
  ASSERT_TRUE(model);
  const int vocab = model->config().vocab_size;
  std::vector<float> ks, vs;
  model->KvScales(KvDtype::kFp32, &ks, &vs);
  int checked = 0;
  double worst = 0;
  for (const auto& p : fx["prompts"]) {
    const auto ids = p["token_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(ids, *model->tokenizer().Encode(p["text"].get<std::string>(), true));
    LocalKvCache kv(model->KvLayout(16, 16, KvDtype::kFp32), ks, vs);
    std::vector<int32_t> table(16);
    for (int i = 0; i < 16; ++i) table[i] = 15 - i;
    // Decode-style, one token at a time (every position's logits; invariance makes any other
    // chunking give the same bits).
    std::vector<std::vector<float>> ours;
    for (size_t t = 0; t < ids.size(); ++t) {
      ForwardBatch b;
      b.sequences.push_back({ids.data() + t, 1, static_cast<int>(t), table.data(), 16, true});
      std::vector<float> logits;
      ASSERT_TRUE(model->Forward(b, kv.view(), &logits).ok());
      ours.push_back(logits);
    }
    const auto positions = p["positions"].get<std::vector<int>>();
    for (size_t i = 0; i < positions.size(); ++i) {
      const auto hf = p["logits"][i].get<std::vector<double>>();
      ASSERT_EQ(static_cast<int>(hf.size()), vocab);
      for (int j = 0; j < vocab; ++j) {
        const double err = std::fabs(ours[positions[i]][j] - hf[j]);
        worst = std::max(worst, err / std::max(1.0, std::fabs(hf[j])));
        ASSERT_LE(err, 1e-4 * std::max(1.0, std::fabs(hf[j])))
            << name << " prompt '" << p["text"] << "' pos " << positions[i] << " logit " << j;
        ++checked;
      }
    }
  }
  std::printf("[ golden ] %s: %d logits within 1e-4 * max(1, |hf|); worst ratio %.3g (hf %s)\n",
              name.c_str(), checked, worst, fx["transformers"].get<std::string>().c_str());
  EXPECT_GT(checked, 1000);
}

TEST(GoldenLogits, LlamaMatchesTransformers) { CheckFixture("llama_tiny_seed1.json"); }
TEST(GoldenLogits, Qwen2MatchesTransformers) { CheckFixture("qwen2_tiny_seed2.json"); }

}  // namespace
}  // namespace kvbridge
