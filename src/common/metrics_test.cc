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
  EXPECT_NE(text.find("kvb_lat_seconds_bucket{le=\"0.10000000000000001\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("kvb_lat_seconds_bucket{le=\"1\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvb_lat_seconds_bucket{le=\"+Inf\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("kvb_lat_seconds_count 3\n"), std::string::npos);
  EXPECT_EQ(ScrapeMetric(text, "kvb_running"), 2.0);
  EXPECT_EQ(ScrapeMetric(text, "kvb_blocks"), 7.0);
  EXPECT_EQ(ScrapeMetric(text, "kvb_requests_total", "outcome=\"ok\""), 3.0);
  EXPECT_EQ(ScrapeMetric(text, "kvb_absent"), -1.0);
}

TEST(Metrics, SameNameReturnsSameMetric) {
  MetricsRegistry reg;
  Counter& a = reg.AddCounter("c_total", "C.");
  Counter& b = reg.AddCounter("c_total", "C.");
  EXPECT_EQ(&a, &b);
}

}  // namespace
}  // namespace kvbridge
