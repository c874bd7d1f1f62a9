#include "kvbridge/engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace kvbridge {
namespace {

TEST(Sampler, GreedyPicksArgmaxLowestIdOnTies) {
  std::vector<double> scratch;
  SamplingParams p;
  p.temperature = 0;
  std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(SampleToken(logits, p, 1, 0, 0, {}, &scratch), 1);
  std::vector<int32_t> banned = {1};
  EXPECT_EQ(SampleToken(logits, p, 1, 0, 0, banned, &scratch), 3);
  logits[2] = std::nanf("");
  EXPECT_EQ(SampleToken(logits, p, 1, 0, 0, banned, &scratch), 3);
}

TEST(Sampler, UniformIsAPureFunctionOfTheKey) {
  EXPECT_EQ(UniformFromKey(42, 0, 7), UniformFromKey(42, 0, 7));
  EXPECT_NE(UniformFromKey(42, 0, 7), UniformFromKey(42, 1, 7));
  EXPECT_NE(UniformFromKey(42, 0, 7), UniformFromKey(42, 0, 8));
  EXPECT_NE(UniformFromKey(42, 0, 7), UniformFromKey(43, 0, 7));
  for (uint64_t i = 0; i < 1000; ++i) {
    double u = UniformFromKey(i, i % 3, i * 7);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
}

TEST(Sampler, TemperatureSamplingFollowsTheDistribution) {
  std::vector<double> scratch;
  SamplingParams p;
  p.temperature = 1.0f;
  std::vector<float> logits = {0.0f, std::log(3.0f)};  // p = 0.25, 0.75
  int ones = 0;
  for (int pos = 0; pos < 20000; ++pos) ones += SampleToken(logits, p, 9, 0, pos, {}, &scratch);
  // The draws are a fixed function of the keys, so this count is fixed; it must sit near 0.75.
  EXPECT_NEAR(ones / 20000.0, 0.75, 0.01);
  // Temperature 0.25 sharpens: p(1) = 3^4 / (1 + 3^4) = 0.9878.
  p.temperature = 0.25f;
  ones = 0;
  for (int pos = 0; pos < 20000; ++pos) ones += SampleToken(logits, p, 9, 0, pos, {}, &scratch);
  EXPECT_NEAR(ones / 20000.0, 81.0 / 82.0, 0.005);
}

TEST(Sampler, TopKAndTopPRestrictTheCandidates) {
  std::vector<double> scratch;
  SamplingParams p;
  p.temperature = 1.0f;
  // probs 0.5, 0.3, 0.2 (as logs), shuffled ids.
  std::vector<float> logits = {std::log(0.2f), std::log(0.5f), std::log(0.3f)};
  p.top_k = 2;
  std::vector<int> seen(3);
  for (int pos = 0; pos < 2000; ++pos) ++seen[SampleToken(logits, p, 3, 0, pos, {}, &scratch)];
  EXPECT_EQ(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
  p.top_k = 0;
  p.top_p = 0.5f;  // the most likely token alone reaches 0.5
  for (int pos = 0; pos < 200; ++pos) EXPECT_EQ(SampleToken(logits, p, 3, 0, pos, {}, &scratch), 1);
  p.top_p = 0.75f;  // needs 0.5 + 0.3
  seen.assign(3, 0);
  for (int pos = 0; pos < 2000; ++pos) ++seen[SampleToken(logits, p, 3, 0, pos, {}, &scratch)];
  EXPECT_EQ(seen[0], 0);
  EXPECT_NEAR(seen[1] / 2000.0, 0.5 / 0.8, 0.04);
  std::vector<int32_t> banned = {1};
  for (int pos = 0; pos < 200; ++pos) {
    EXPECT_NE(SampleToken(logits, p, 3, 0, pos, banned, &scratch), 1);
  }
}

TEST(Sampler, LogprobsAreLogSoftmaxWithDeterministicTies) {
  std::vector<float> logits = {1.0f, 3.0f, 3.0f, -2.0f};
  TokenLogprob lp = ComputeLogprobs(logits, 3, 3);
  double lse = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(-2.0));
  EXPECT_EQ(lp.token, 3);
  EXPECT_EQ(lp.logprob, static_cast<float>(-2.0 - lse));
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].token, 1);
  EXPECT_EQ(lp.top[1].token, 2);
  EXPECT_EQ(lp.top[2].token, 0);
  EXPECT_EQ(lp.top[0].logprob, static_cast<float>(3.0 - lse));
  EXPECT_EQ(lp.top[2].logprob, static_cast<float>(1.0 - lse));
  EXPECT_TRUE(ComputeLogprobs(logits, 0, 0).top.empty());
}

TEST(Sampler, ValidateRejectsBadParams) {
  auto bad = [](auto mutate) {
    SamplingParams p;
    mutate(p);
    return ValidateSamplingParams(p, 10).code();
  };
  EXPECT_EQ(bad([](SamplingParams&) {}), StatusCode::kOk);
  EXPECT_EQ(bad([](SamplingParams& p) { p.n = 0; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.max_tokens = 0; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.min_tokens = 17; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.temperature = -1; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.temperature = NAN; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.top_p = 0; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.top_p = 1.5; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.top_k = -1; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.logprobs = 11; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.stop_token_ids = {10}; }), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](SamplingParams& p) { p.stop = {""}; }), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvbridge
