#include "kvbridge/common/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace kvbridge {
namespace {

void AtomicAdd(std::atomic<double>& a, double v) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

std::string FormatDouble(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::ostringstream os;
    os << static_cast<long long>(v);
    return os.str();
  }
  // The shortest of 15..17 significant digits that reads back as v: 0.3 renders "0.3" (as
  // Prometheus clients write bounds, so le="0.3" matches), not 0.29999999999999999.
  for (int digits = 15; digits <= 17; ++digits) {
    std::ostringstream os;
    os.precision(digits);
    os << v;
    if (digits == 17 || std::strtod(os.str().c_str(), nullptr) == v) return os.str();
  }
  return "";
}

std::string WithLabels(const std::string& name, const std::string& labels,
                       const std::string& extra = "") {
  std::string all = labels;
  if (!extra.empty()) all = all.empty() ? extra : all + "," + extra;
  return all.empty() ? name : name + "{" + all + "}";
}

}  // namespace

void Counter::Inc(double v) { AtomicAdd(value_, v); }
void Gauge::Add(double v) { AtomicAdd(value_, v); }

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::Observe(double v) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  std::lock_guard<std::mutex> lock(mu_);
  counts_[i]++;
  sum_ += v;
  count_++;
}

std::vector<double> Histogram::LatencyBucketsSeconds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}
std::vector<double> Histogram::FineLatencyBucketsSeconds() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
}

std::vector<double> Histogram::PhaseBucketsSeconds() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}

uint64_t Histogram::Count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}
double Histogram::Sum() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sum_;
}
std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> out(counts_.size());
  uint64_t acc = 0;
  for (size_t i = 0; i < counts_.size(); ++i) out[i] = (acc += counts_[i]);
  return out;
}

MetricsRegistry::Family& MetricsRegistry::GetFamily(const std::string& name,
                                                    const std::string& type,
                                                    const std::string& help) {
  auto& f = families_[name];
  if (f.type.empty()) {
    f.type = type;
    f.help = help;
  }
  return f;
}

Counter& MetricsRegistry::AddCounter(const std::string& name, const std::string& help,
                                     const std::string& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = GetFamily(name, "counter", help).counters[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                                 const std::string& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = GetFamily(name, "gauge", help).gauges[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                         std::vector<double> bounds, const std::string& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = GetFamily(name, "histogram", help).histograms[labels];
  if (!slot) slot = std::make_unique<Histogram>(std::move(bounds));
  return *slot;
}

void MetricsRegistry::AddCallbackGauge(const std::string& name, const std::string& help,
                                       std::function<double()> fn, const std::string& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  GetFamily(name, "gauge", help).callbacks[labels] = std::move(fn);
}

std::string MetricsRegistry::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream os;
  for (const auto& [name, f] : families_) {
    os << "# HELP " << name << " " << f.help << "\n# TYPE " << name << " " << f.type << "\n";
    for (const auto& [labels, c] : f.counters)
      os << WithLabels(name, labels) << " " << FormatDouble(c->Value()) << "\n";
    for (const auto& [labels, g] : f.gauges)
      os << WithLabels(name, labels) << " " << FormatDouble(g->Value()) << "\n";
    for (const auto& [labels, fn] : f.callbacks)
      os << WithLabels(name, labels) << " " << FormatDouble(fn()) << "\n";
    for (const auto& [labels, h] : f.histograms) {
      auto cum = h->CumulativeCounts();
      const auto& b = h->bounds();
      for (size_t i = 0; i < cum.size(); ++i) {
        std::string le = "le=\"" + (i < b.size() ? FormatDouble(b[i]) : std::string("+Inf")) + "\"";
        os << WithLabels(name + "_bucket", labels, le) << " " << cum[i] << "\n";
      }
      os << WithLabels(name + "_sum", labels) << " " << FormatDouble(h->Sum()) << "\n";
      os << WithLabels(name + "_count", labels) << " " << h->Count() << "\n";
    }
  }
  return os.str();
}

std::string PrometheusLabels(
    std::initializer_list<std::pair<std::string_view, std::string_view>> labels) {
  std::string out;
  for (const auto& [key, value] : labels) {
    if (!out.empty()) out += ',';
    out += key;
    out += "=\"";
    for (char c : value) {
      if (c == '\\' || c == '"') {
        out += '\\';
        out += c;
      } else if (c == '\n') {
        out += "\\n";
      } else {
        out += c;
      }
    }
    out += '"';
  }
  return out;
}

double ScrapeMetric(const std::string& text, const std::string& name, const std::string& labels) {
  std::istringstream is(text);
  std::string line;
  double total = 0;
  bool found = false;
  while (std::getline(is, line)) {
    if (line.empty() || line[0] == '#') continue;
    size_t sp = line.rfind(' ');
    if (sp == std::string::npos) continue;
    std::string key = line.substr(0, sp);
    std::string key_name = key.substr(0, key.find('{'));
    if (key_name != name) continue;
    if (!labels.empty() && key.find(labels) == std::string::npos) continue;
    total += std::strtod(line.c_str() + sp + 1, nullptr);
    found = true;
  }
  return found ? total : -1.0;
}

}  // namespace kvbridge
