#include "kvbridge/bench/bench.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace kvbridge::bench {
namespace {

TEST(Bench, PercentileInterpolates) {
  EXPECT_EQ(Percentile({}, 0.5), 0.0);
  EXPECT_EQ(Percentile({7}, 0.9), 7.0);
  EXPECT_DOUBLE_EQ(Percentile({4, 1, 3, 2}, 0.5), 2.5);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4, 5}, 0.75), 4.0);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4, 5}, 0.95), 4.8);
  EXPECT_DOUBLE_EQ(Percentile({1, 2}, 1.0), 2.0);
}

TEST(Bench, ParseBatches) {
  EXPECT_EQ(*ParseBatches("3,4,16"), (std::vector<int>{3, 4, 16}));
  EXPECT_EQ(*ParseBatches("1"), (std::vector<int>{1}));
  for (const char* bad : {"", "3,,4", "a", "0", "-2", "4x"}) {
    EXPECT_EQ(ParseBatches(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(Bench, LoadPromptsReadsModelInput) {
  std::string path = ::testing::TempDir() + "/prompts.jsonl";
  {
    std::ofstream f(path);
    f << R"({"model_input":"first"})"
      << "\n\n"
      << R"({"model_input":"second","x":1})"
      << "\n";
  }
  auto p = LoadPrompts(path);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, (std::vector<std::string>{"first", "second"}));
  {
    std::ofstream f(path);
    f << R"({"model_input":"ok"})"
      << "\n"
      << R"({"prompt":"no"})"
      << "\n";
  }
  auto bad = LoadPrompts(path);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(":2:"), std::string::npos);
  EXPECT_FALSE(LoadPrompts(path + ".absent").ok());
  std::remove(path.c_str());
}

TEST(Bench, SyntheticPromptsAreDeterministicAndDistinct) {
  auto a = MakeSyntheticPrompts(5, 1), b = MakeSyntheticPrompts(5, 1),
       c = MakeSyntheticPrompts(5, 2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(a.size(), 5u);
  EXPECT_NE(a[0], a[1]);
}

TEST(Bench, BadOptionsAreInvalidArgument) {
  BenchOptions o;
  o.samples = 0;
  EXPECT_EQ(RunBench(o, {}).status().code(), StatusCode::kInvalidArgument);
  o.samples = 1;
  o.host = "nohost";
  EXPECT_EQ(RunBench(o, {}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvbridge::bench

namespace kvbridge::bench {
namespace {

TEST(ProgressThrottle, RedrawsOnATerminal) {
  ProgressThrottle t(/*tty=*/true);
  const auto now = std::chrono::steady_clock::now();
  EXPECT_EQ(t.Format("batch c=1: 1/4 done", now),
            "\r" + std::string("batch c=1: 1/4 done") + std::string(79 - 20, ' '));
  EXPECT_EQ(t.Format("batch c=1: 2/4 done", now).substr(0, 20), "\rbatch c=1: 2/4 done");
}

TEST(ProgressThrottle, WritesALineEveryIntervalIntoAFile) {
  using std::chrono::milliseconds;
  ProgressThrottle t(/*tty=*/false, milliseconds(5000));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(t.Format("batch c=1: 0/8 done", t0), "batch c=1: 0/8 done\n");
  // 200 ms apart, as RunBench reports: nothing until 5 s passed.
  for (int i = 1; i < 25; ++i) EXPECT_EQ(t.Format("batch c=1: x", t0 + milliseconds(200 * i)), "");
  EXPECT_EQ(t.Format("batch c=1: 5/8 done", t0 + milliseconds(5000)), "batch c=1: 5/8 done\n");
  // A new batch is shown at once.
  EXPECT_EQ(t.Format("batch c=4: 0/8 done", t0 + milliseconds(5200)), "batch c=4: 0/8 done\n");
}

TEST(ParsePhaseTotals, SumsOverModeAndBackend) {
  const std::string text =
      "# TYPE kvbridge_proxy_phase_seconds histogram\n"
      "kvbridge_proxy_phase_seconds_bucket{phase=\"decode\",mode=\"read\",backend=\"shm\",le=\"1\"}"
      " 2\n"
      "kvbridge_proxy_phase_seconds_sum{phase=\"decode\",mode=\"read\",backend=\"shm\"} 0.5\n"
      "kvbridge_proxy_phase_seconds_count{phase=\"decode\",mode=\"read\",backend=\"shm\"} 2\n"
      "kvbridge_proxy_phase_seconds_sum{phase=\"decode\",mode=\"read\",backend=\"tcp\"} 0.25\n"
      "kvbridge_proxy_phase_seconds_count{phase=\"decode\",mode=\"read\",backend=\"tcp\"} 1\n"
      "kvbridge_proxy_phase_seconds_sum{phase=\"transfer\",mode=\"read\",backend=\"shm\"} 0.01\n"
      "kvbridge_proxy_phase_seconds_count{phase=\"transfer\",mode=\"read\",backend=\"shm\"} 2\n"
      "kvbridge_proxy_request_seconds_sum 9\n";
  const auto t = ParsePhaseTotals(text);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_DOUBLE_EQ(t.at("decode").first, 0.75);
  EXPECT_DOUBLE_EQ(t.at("decode").second, 3);
  EXPECT_DOUBLE_EQ(t.at("transfer").first, 0.01);
  EXPECT_TRUE(ParsePhaseTotals("").empty());
}

}  // namespace
}  // namespace kvbridge::bench
