#include "kvbridge/engine/vllm_metrics.h"

namespace kvbridge {
namespace {

// vLLM's FinishReason strings (vllm/v1/engine: stop, length, abort, error, repetition); this
// engine never finishes with "repetition", its series stays 0.
constexpr std::array<std::string_view, 5> kFinishReasons = {"stop", "length", "abort", "error",
                                                            "repetition"};

double Seconds(TimePoint from, TimePoint to) {
  return static_cast<double>(to - from) / static_cast<double>(kSecond);
}

}  // namespace

std::string VllmMetrics::Labels(std::string_view model_name) {
  return PrometheusLabels({{"model_name", model_name}, {"engine", "0"}});
}

std::vector<double> VllmMetrics::TimeToFirstTokenBuckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}

std::vector<double> VllmMetrics::InterTokenLatencyBuckets() {
  return {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
          0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
}

std::vector<double> VllmMetrics::RequestLatencyBuckets() {
  return {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
          30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

std::vector<double> VllmMetrics::TokenCountBuckets(int max_value) {
  std::vector<double> out;
  for (double scale = 1;; scale *= 10) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (m * scale > max_value) return out;
      out.push_back(m * scale);
    }
  }
}

VllmMetrics::VllmMetrics(MetricsRegistry* registry, std::string_view model_name,
                         int max_model_len) {
  MetricsRegistry& r = *registry;
  const std::string l = Labels(model_name);
  running_ = &r.AddGauge("vllm:num_requests_running",
                         "Sequences in the running batch (kvbridge_requests_running).", l);
  waiting_ = &r.AddGauge(
      "vllm:num_requests_waiting",
      "Sequences waiting, preempted or waiting for remote KV (kvbridge_requests_waiting + "
      "kvbridge_requests_waiting_for_remote_kv).",
      l);
  kv_usage_ = &r.AddGauge("vllm:kv_cache_usage_perc",
                          "Fraction of KV blocks in use, 0..1 (kvbridge_kv_blocks_active / "
                          "kvbridge_kv_blocks_total).",
                          l);
  prefix_queries_ = &r.AddCounter("vllm:prefix_cache_queries_total",
                                  "Prompt tokens looked up in the prefix cache.", l);
  prefix_hits_ =
      &r.AddCounter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", l);
  prompt_tokens_ = &r.AddCounter("vllm:prompt_tokens_total",
                                 "Prompt tokens of requests whose prefill completed.", l);
  generation_tokens_ = &r.AddCounter("vllm:generation_tokens_total", "Sampled tokens.", l);
  preemptions_ =
      &r.AddCounter("vllm:num_preemptions_total", "Sequences preempted for lack of KV blocks.", l);
  for (size_t i = 0; i < kFinishReasons.size(); ++i) {
    success_[i] =
        &r.AddCounter("vllm:request_success_total", "Finished sequences by finish reason.",
                      l + "," + PrometheusLabels({{"finished_reason", kFinishReasons[i]}}));
  }
  ttft_ = &r.AddHistogram("vllm:time_to_first_token_seconds",
                          "Arrival to first sampled token, per sequence.",
                          TimeToFirstTokenBuckets(), l);
  itl_ = &r.AddHistogram("vllm:inter_token_latency_seconds",
                         "Time between consecutive tokens of a sequence.",
                         InterTokenLatencyBuckets(), l);
  tpot_ =
      &r.AddHistogram("vllm:time_per_output_token_seconds",
                      "Time between consecutive tokens of a sequence (vLLM's deprecated name of "
                      "vllm:inter_token_latency_seconds).",
                      InterTokenLatencyBuckets(), l);
  e2e_ = &r.AddHistogram("vllm:e2e_request_latency_seconds", "Arrival to finish of a sequence.",
                         RequestLatencyBuckets(), l);
  queue_ = &r.AddHistogram("vllm:request_queue_time_seconds",
                           "Arrival to first scheduled (waiting, incl. waiting for remote KV).",
                           RequestLatencyBuckets(), l);
  inference_ = &r.AddHistogram("vllm:request_inference_time_seconds",
                               "First scheduled to last token.", RequestLatencyBuckets(), l);
  prefill_ = &r.AddHistogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                             RequestLatencyBuckets(), l);
  decode_ = &r.AddHistogram("vllm:request_decode_time_seconds", "First token to last token.",
                            RequestLatencyBuckets(), l);
  prompt_len_ = &r.AddHistogram("vllm:request_prompt_tokens", "Prompt tokens per sequence.",
                                TokenCountBuckets(max_model_len), l);
  generation_len_ =
      &r.AddHistogram("vllm:request_generation_tokens", "Generated tokens per sequence.",
                      TokenCountBuckets(max_model_len), l);
}

void VllmMetrics::SetSchedulerState(int running, int waiting, double kv_cache_usage) {
  running_->Set(running);
  waiting_->Set(waiting);
  kv_usage_->Set(kv_cache_usage);
}

void VllmMetrics::OnPrefixCacheLookup(int queried_tokens, int hit_tokens) {
  prefix_queries_->Inc(queried_tokens);
  prefix_hits_->Inc(hit_tokens);
}

void VllmMetrics::OnPromptTokens(int tokens) { prompt_tokens_->Inc(tokens); }
void VllmMetrics::OnGenerationTokens(int tokens) { generation_tokens_->Inc(tokens); }
void VllmMetrics::OnPreemption() { preemptions_->Inc(); }
void VllmMetrics::OnFirstToken(double seconds) { ttft_->Observe(seconds); }

void VllmMetrics::OnInterToken(double seconds) {
  itl_->Observe(seconds);
  tpot_->Observe(seconds);
}

void VllmMetrics::OnFinished(const Finished& f) {
  for (size_t i = 0; i < kFinishReasons.size(); ++i) {
    if (kFinishReasons[i] == f.finish_reason) success_[i]->Inc();
  }
  // The phases exist only for a sequence that was scheduled and produced a token (an abort
  // while queued has none); vLLM observes them for every finished request.
  if (f.scheduled < 0 || f.first_token < 0) return;
  e2e_->Observe(Seconds(f.arrival, f.finished));
  queue_->Observe(Seconds(f.arrival, f.scheduled));
  prefill_->Observe(Seconds(f.scheduled, f.first_token));
  inference_->Observe(Seconds(f.scheduled, f.finished));
  decode_->Observe(Seconds(f.first_token, f.finished));
  prompt_len_->Observe(f.prompt_tokens);
  generation_len_->Observe(f.generation_tokens);
}

}  // namespace kvbridge
