#include "kvbridge/common/metrics.h"

#include <gtest/gtest.h>

namespace kvbridge {
namespace {

TEST(Metrics, RendersPrometheusText) {
  MetricsRegistry reg;
  reg.AddCounter("kvb_requests_total", "Requests.", "outcome=\"ok\"").Inc(3);
  reg.AddGauge("kvb_running", "Running.").Set(2);
  reg.AddCallbackGauge("kvb_blocks", "Blocks.", [] { return 7.0; });
  auto& h = reg.AddHistogram("kvb_lat_seconds", "Latency.", {0.1, 1.0});
  h.Observe(0.05);
  h.Observe(0.5);
  h.Observe(5);
  std::string text = reg.Render();
  EXPECT_NE(text.find("# TYPE kvb_requests_total counter\nkvb_requests_total{outcome=\"ok\"} 3\n"),
            std::string::npos);
  // Bounds as the shortest decimal that reads back (as Prometheus clients write them).
  EXPECT_NE(text.find("kvb_lat_seconds_bucket{le=\"0.1\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("kvb_lat_seconds_bucket{le=\"1\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvb_lat_seconds_bucket{le=\"+Inf\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("kvb_lat_seconds_count 3\n"), std::string::npos);
  EXPECT_EQ(ScrapeMetric(text, "kvb_running"), 2.0);
  EXPECT_EQ(ScrapeMetric(text, "kvb_blocks"), 7.0);
  EXPECT_EQ(ScrapeMetric(text, "kvb_requests_total", "outcome=\"ok\""), 3.0);
  EXPECT_EQ(ScrapeMetric(text, "kvb_absent"), -1.0);
}

TEST(Metrics, ValuesRenderShortestRoundTrip) {
  MetricsRegistry reg;
  reg.AddGauge("g_a", "A.").Set(0.3);
  reg.AddGauge("g_b", "B.").Set(1.0 / 3.0);
  reg.AddGauge("g_c", "C.").Set(2.5e-7);
  const std::string text = reg.Render();
  EXPECT_NE(text.find("g_a 0.3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("g_b 0.3333333333333333\n"), std::string::npos) << text;
  EXPECT_NE(text.find("g_c 2.5e-07\n"), std::string::npos) << text;
}

TEST(Metrics, PrometheusLabelsEscapeValues) {
  EXPECT_EQ(PrometheusLabels({{"model_name", "org/m"}, {"engine", "0"}}),
            "model_name=\"org/m\",engine=\"0\"");
  EXPECT_EQ(PrometheusLabels({{"k", "a\"b\\c\nd"}}), "k=\"a\\\"b\\\\c\\nd\"");
  EXPECT_EQ(PrometheusLabels({}), "");
}

TEST(Metrics, SameNameReturnsSameMetric) {
  MetricsRegistry reg;
  Counter& a = reg.AddCounter("c_total", "C.");
  Counter& b = reg.AddCounter("c_total", "C.");
  EXPECT_EQ(&a, &b);
}

}  // namespace
}  // namespace kvbridge
