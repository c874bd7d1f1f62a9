// kvbridge/common/metrics.h — Prometheus-style counters, gauges and histograms.
//
// A MetricsRegistry owns named metric families and renders them in the Prometheus text
// exposition format (version 0.0.4, https://prometheus.io/docs/instrumenting/exposition_formats/).
//
//   MetricsRegistry reg;
//   Counter& c = reg.AddCounter("kvbridge_requests_total", "Requests received.");
//   c.Inc();
//   Histogram& h = reg.AddHistogram("kvbridge_ttft_seconds", "Time to first token.",
//                                   Histogram::LatencyBucketsSeconds());
//   h.Observe(0.012);
//   std::string text = reg.Render();
//
// Thread-safety: every metric may be updated from any thread; Add* and Render take a lock.
// Metric references stay valid for the registry's lifetime.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvbridge {

/// Monotonic counter (a double, so byte and second totals fit).
class Counter {
 public:
  void Inc(double v = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// Value that goes up and down.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// Cumulative histogram with fixed upper bounds (plus +Inf).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double v);
  /// Bounds from 1 ms to 60 s, roughly x2.5 apart: for TTFT and request latency.
  static std::vector<double> LatencyBucketsSeconds();
  /// Bounds from 100 us to 2.5 s: for inter-token latency and transfer times.
  static std::vector<double> FineLatencyBucketsSeconds();
  /// Bounds from 100 us to 60 s: for the phases of one request (docs/metrics.md timelines).
  static std::vector<double> PhaseBucketsSeconds();
  uint64_t Count() const;
  double Sum() const;
  /// Cumulative count of observations <= bounds()[i]; index bounds().size() is +Inf.
  std::vector<uint64_t> CumulativeCounts() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket, last = +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

class MetricsRegistry {
 public:
  /// `labels` is a rendered label set such as `outcome="ok"` (empty for none). Adding the same
  /// name+labels twice returns the existing metric.
  Counter& AddCounter(const std::string& name, const std::string& help,
                      const std::string& labels = "");
  Gauge& AddGauge(const std::string& name, const std::string& help, const std::string& labels = "");
  Histogram& AddHistogram(const std::string& name, const std::string& help,
                          std::vector<double> bounds, const std::string& labels = "");
  /// A gauge whose value is read by `fn` at Render() time (fn must be thread-safe).
  void AddCallbackGauge(const std::string& name, const std::string& help,
                        std::function<double()> fn, const std::string& labels = "");
  /// Prometheus text format, families in name order.
  std::string Render() const;

 private:
  struct Family {
    std::string type;
    std::string help;
    std::map<std::string, std::unique_ptr<Counter>> counters;
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
    std::map<std::string, std::function<double()>> callbacks;
  };
  Family& GetFamily(const std::string& name, const std::string& type, const std::string& help);
  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
};

/// A rendered label set `k1="v1",k2="v2"` in the given order, each value escaped as the text
/// format requires (backslash, double quote and newline). For MetricsRegistry's `labels`.
std::string PrometheusLabels(
    std::initializer_list<std::pair<std::string_view, std::string_view>> labels);

/// Parses one sample `name` (optionally `name{labels}`) from Prometheus text; returns the sum of
/// all matching samples, or -1 when absent. For tests and `kvbridge bench --check-drain`.
double ScrapeMetric(const std::string& text, const std::string& name,
                    const std::string& labels = "");

}  // namespace kvbridge
