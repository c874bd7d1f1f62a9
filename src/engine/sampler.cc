#include "kvbridge/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

namespace kvbridge {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double Clean(float v) { return std::isnan(v) ? kNegInf : static_cast<double>(v); }

// Higher value first, then lower id.
struct ByValueDesc {
  const double* v;
  bool operator()(int32_t a, int32_t b) const { return v[a] != v[b] ? v[a] > v[b] : a < b; }
};

int32_t Argmax(std::span<const double> x) {
  int32_t best = 0;
  for (int32_t i = 1; i < static_cast<int32_t>(x.size()); ++i) {
    if (x[i] > x[best]) best = i;
  }
  return best;
}

}  // namespace

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

double UniformFromKey(uint64_t seed, uint64_t sibling, uint64_t position) {
  uint64_t h = SplitMix64(SplitMix64(SplitMix64(seed) ^ sibling) ^ position);
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

Status ValidateSamplingParams(const SamplingParams& p, int vocab_size) {
  if (p.n < 1) return InvalidArgumentError("n must be >= 1");
  if (p.max_tokens < 1) return InvalidArgumentError("max_tokens must be >= 1");
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens) {
    return InvalidArgumentError("min_tokens must be in [0, max_tokens]");
  }
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return InvalidArgumentError("temperature must be finite and >= 0");
  }
  if (!(p.top_p > 0 && p.top_p <= 1)) return InvalidArgumentError("top_p must be in (0, 1]");
  if (p.top_k < 0) return InvalidArgumentError("top_k must be >= 0 (0 = off)");
  if (p.logprobs < -1 || p.logprobs > vocab_size) {
    return InvalidArgumentError("logprobs must be in [-1, vocab_size]");
  }
  for (int32_t t : p.stop_token_ids) {
    if (t < 0 || t >= vocab_size) {
      return InvalidArgumentError("stop_token_ids: " + std::to_string(t) +
                                  " outside the vocabulary");
    }
  }
  for (const std::string& s : p.stop) {
    if (s.empty()) return InvalidArgumentError("stop strings must not be empty");
  }
  return OkStatus();
}

int32_t SampleToken(std::span<const float> logits, const SamplingParams& params, uint64_t seed,
                    int sibling, int position, std::span<const int32_t> banned,
                    std::vector<double>* scratch) {
  const int32_t v = static_cast<int32_t>(logits.size());
  std::vector<double>& x = *scratch;
  x.resize(v);
  for (int32_t i = 0; i < v; ++i) x[i] = Clean(logits[i]);
  for (int32_t b : banned) {
    if (b >= 0 && b < v) x[b] = kNegInf;
  }
  int32_t best = Argmax(x);
  if (x[best] == kNegInf) return 0;  // nothing sampleable: lowest id (documented)
  if (params.temperature == 0 || params.top_k == 1) return best;

  const double inv_t = 1.0 / params.temperature;
  const double m = x[best];
  // Unnormalized probabilities, in place.
  for (int32_t i = 0; i < v; ++i) x[i] = x[i] == kNegInf ? 0.0 : std::exp((x[i] - m) * inv_t);

  const double u =
      UniformFromKey(seed, static_cast<uint64_t>(sibling), static_cast<uint64_t>(position));
  const bool use_top_k = params.top_k > 0 && params.top_k < v;
  const bool use_top_p = params.top_p < 1.0f;
  if (!use_top_k && !use_top_p) {
    double z = 0;
    for (double p : x) z += p;
    double target = u * z, acc = 0;
    int32_t last = best;
    for (int32_t i = 0; i < v; ++i) {
      if (x[i] <= 0) continue;
      acc += x[i];
      last = i;
      if (acc > target) return i;
    }
    return last;  // rounding at the very top of the range
  }

  std::vector<int32_t> order(v);
  std::iota(order.begin(), order.end(), 0);
  ByValueDesc cmp{x.data()};
  int32_t keep = v;
  if (use_top_k) {
    keep = params.top_k;
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), cmp);
  } else {
    std::sort(order.begin(), order.end(), cmp);
  }
  while (keep > 1 && x[order[keep - 1]] <= 0) --keep;  // drop zero-mass tail
  if (use_top_p) {
    double z = 0;
    for (int32_t i = 0; i < keep; ++i) z += x[order[i]];
    const double threshold = static_cast<double>(params.top_p) * z;
    double acc = 0;
    int32_t k = 0;
    while (k < keep) {
      acc += x[order[k++]];
      if (acc >= threshold) break;
    }
    keep = k;
  }
  double z = 0;
  for (int32_t i = 0; i < keep; ++i) z += x[order[i]];
  double target = u * z, acc = 0;
  for (int32_t i = 0; i < keep; ++i) {
    acc += x[order[i]];
    if (acc > target) return order[i];
  }
  return order[keep - 1];
}

TokenLogprob ComputeLogprobs(std::span<const float> logits, int32_t token, int top_k) {
  const int32_t v = static_cast<int32_t>(logits.size());
  std::vector<double> x(v);
  for (int32_t i = 0; i < v; ++i) x[i] = Clean(logits[i]);
  double m = x[Argmax(x)];
  double sum = 0;
  if (m != kNegInf) {
    for (double xi : x) sum += xi == kNegInf ? 0.0 : std::exp(xi - m);
  }
  const double lse = m + std::log(sum);
  auto lp = [&](int32_t i) -> float {
    if (m == kNegInf || x[i] == kNegInf) return -std::numeric_limits<float>::infinity();
    return static_cast<float>(x[i] - lse);
  };
  TokenLogprob out;
  out.token = token;
  out.logprob = (token >= 0 && token < v) ? lp(token) : -std::numeric_limits<float>::infinity();
  int k = std::clamp(top_k, 0, static_cast<int>(v));
  if (k > 0) {
    std::vector<int32_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), ByValueDesc{x.data()});
    out.top.reserve(k);
    for (int i = 0; i < k; ++i) out.top.push_back({order[i], lp(order[i])});
  }
  return out;
}

}  // namespace kvbridge
