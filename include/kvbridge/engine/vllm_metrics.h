// kvbridge/engine/vllm_metrics.h — the `vllm:` metric families a vLLM dashboard reads, next to
// the engine's own kvbridge_* ones.
//
// Names, types, help texts' meaning, labels (`model_name`, `engine`) and histogram bucket bounds
// are those of vLLM v1's Prometheus logger (vllm/v1/metrics/loggers.py, PrometheusStatLogger;
// docs.vllm.ai "Production Metrics"), so an existing Grafana dashboard or alert written for vLLM
// works on a kvbridge engine unchanged. `engine` is vLLM's data-parallel engine index: always
// "0" here (one engine core per process; Prometheus' `instance` label tells processes apart).
// docs/metrics.md "vLLM-compatible families" maps each family to its kvbridge_* twin.
//
//   VllmMetrics vllm(&registry, "Qwen3-0.6B", /*max_model_len=*/4096);
//   vllm.OnFirstToken(0.120);
//   vllm.OnFinished({.arrival = a, .scheduled = s, .first_token = f, .finished = e, ...});
//
// Request-level observations count each scheduled sequence (each of n siblings) as one request,
// as vLLM v1 counts each of the n child requests of a parallel-sampling request.
//
// Thread-safety: every method may be called from any thread (the metrics are atomic); the
// scheduler calls them on the engine thread.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/metrics.h"

namespace kvbridge {

class VllmMetrics {
 public:
  /// One finished sequence. Times are the scheduler's `now` values (µs, one clock); -1 = the
  /// event never happened (e.g. aborted while waiting: no scheduled / first token).
  struct Finished {
    TimePoint arrival = 0;       ///< the request reached the engine (HTTP handler start)
    TimePoint scheduled = -1;    ///< first scheduled for compute (vLLM ignores re-schedules)
    TimePoint first_token = -1;  ///< first output token sampled
    TimePoint finished = 0;      ///< last token / the finish
    int prompt_tokens = 0;
    int generation_tokens = 0;
    std::string_view finish_reason;  ///< "stop" | "length" | "abort" | "error"
  };

  /// Registers every family in `registry` with labels {model_name, engine="0"}; every
  /// request_success_total{finished_reason} series exists from the start (value 0), as in vLLM.
  /// `max_model_len` bounds the 1-2-5 token-count buckets.
  VllmMetrics(MetricsRegistry* registry, std::string_view model_name, int max_model_len);

  /// The rendered label set `model_name="...",engine="0"` of every family.
  static std::string Labels(std::string_view model_name);
  /// vLLM's bucket bounds (seconds; tokens for TokenCountBuckets).
  static std::vector<double> TimeToFirstTokenBuckets();
  static std::vector<double> InterTokenLatencyBuckets();
  static std::vector<double> RequestLatencyBuckets();
  /// 1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets).
  static std::vector<double> TokenCountBuckets(int max_value);

  /// Scheduler state after a step: vllm:num_requests_running / _waiting (waiting includes
  /// requests waiting for remote KV, which vLLM keeps in its waiting queue) and
  /// vllm:kv_cache_usage_perc (fraction 0..1 of blocks in use).
  void SetSchedulerState(int running, int waiting, double kv_cache_usage);
  void OnPrefixCacheLookup(int queried_tokens, int hit_tokens);
  void OnPromptTokens(int tokens);
  void OnGenerationTokens(int tokens);
  void OnPreemption();
  void OnFirstToken(double seconds);
  void OnInterToken(double seconds);
  void OnFinished(const Finished& f);

 private:
  Gauge* running_ = nullptr;
  Gauge* waiting_ = nullptr;
  Gauge* kv_usage_ = nullptr;
  Counter* prefix_queries_ = nullptr;
  Counter* prefix_hits_ = nullptr;
  Counter* prompt_tokens_ = nullptr;
  Counter* generation_tokens_ = nullptr;
  Counter* preemptions_ = nullptr;
  std::array<Counter*, 5> success_{};  // by kFinishReasons
  Histogram* ttft_ = nullptr;
  Histogram* itl_ = nullptr;
  Histogram* tpot_ = nullptr;  // vllm:time_per_output_token_seconds (deprecated twin of itl_)
  Histogram* e2e_ = nullptr;
  Histogram* queue_ = nullptr;
  Histogram* inference_ = nullptr;
  Histogram* prefill_ = nullptr;
  Histogram* decode_ = nullptr;
  Histogram* prompt_len_ = nullptr;
  Histogram* generation_len_ = nullptr;
};

}  // namespace kvbridge
