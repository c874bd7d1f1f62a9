// kvbridge/bench/bench.h — `kvbridge bench`: a load generator for /v1/completions that proves
// the KV drains.
//
// For each concurrency level in `batches`, sends `samples` requests with that many in flight
// (prompts from a JSONL file's `model_input` field, or built here), then reports latency
// percentiles, throughput (requests and output tokens per second), token means, the prefix-cache
// hit rate and, with `stream`, TTFT and TPOT; with drain checking on, it
// then polls every instance's /metrics until kvbridge_kv_blocks_active and
// kvbridge_kv_blocks_held_for_transfer are 0 (bounded by drain_timeout_s after the batch's last
// response) and reads kvbridge_kv_lease_expired_total / kvbridge_kv_notifications_ignored_total,
// which must be 0 in a fault-free run (DESIGN.md invariants).
//
//   BenchOptions o;
//   o.host = "http://127.0.0.1:10001";
//   o.batches = {4, 8};
//   o.samples = 32;
//   o.best_of_n = 8;
//   o.check_drain = true;  // instances from GET {host}/instances
//   ASSIGN_OR_RETURN(BenchReport r, RunBench(o, [](const std::string& line) { ... }));
//   std::puts(FormatTable(r).c_str());
//   return r.ok ? 0 : 1;
//
// Thread-safety: RunBench is reentrant (it starts and joins its own worker threads).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge::bench {

struct BenchOptions {
  std::string host = "http://127.0.0.1:10001";  // base URL of the proxy (or an engine)
  std::string path = "/v1/completions";
  std::string prompts_file;           // JSONL rows with "model_input"; empty = built prompts
  std::string model;                  // "model" field; empty = the first id of GET /v1/models
  int samples = 32;                   // requests per batch
  std::vector<int> batches = {1, 4};  // concurrency levels, one batch each
  int input_tokens = 0;               // > 0: sent as truncate_prompt_tokens, jittered ±100 (min 1)
  int output_tokens = 32;             // max_tokens, jittered ±10 (min 1)
  int best_of_n = 1;                  // sent as n
  double max_latency_s = 0;           // > 0: stop the sweep once a batch's mean and p50 exceed it
  bool shuffle = true;
  uint64_t seed = 0;
  bool stream = false;  // SSE requests (with stream_options.include_usage); adds TTFT/TPOT
  double request_timeout_s = 600;
  bool check_drain = false;
  std::vector<std::string> drain_urls;  // empty with check_drain: every instance of /instances
  double drain_timeout_s = 5;
  int synthetic_prompts = 64;  // how many prompts to build without prompts_file
};

/// One instance's drain after a batch.
struct DrainReport {
  std::string url;
  bool drained = false;
  double drain_s = -1;  // from the batch's last response to both gauges at 0
  double blocks_active = -1;
  double blocks_held = -1;
  double lease_expired = -1;          // kvbridge_kv_lease_expired_total (-1: absent)
  double notifications_ignored = -1;  // kvbridge_kv_notifications_ignored_total
  std::string error;                  // why it failed, empty when ok
};

struct BatchReport {
  int concurrency = 0;
  int requests = 0;
  int errors = 0;
  double duration_s = 0;
  double requests_per_s = 0;
  double latency_mean_s = 0, latency_p50_s = 0, latency_p75_s = 0, latency_p90_s = 0,
         latency_p95_s = 0;
  // Streaming only (BenchOptions::stream), as vLLM's benchmark_serving defines them: TTFT = time
  // to the first SSE event that carries a choice; TPOT = (latency - TTFT) / (tokens per choice -
  // 1), tokens per choice = usage.completion_tokens / n, for requests with more than one token.
  int ttft_count = 0;  // requests with a TTFT (0 without streaming)
  double ttft_mean_s = 0, ttft_p50_s = 0, ttft_p99_s = 0;
  int tpot_count = 0;
  double tpot_mean_s = 0, tpot_p50_s = 0, tpot_p99_s = 0;
  double output_tokens_per_s = 0;          // sum usage.completion_tokens / duration_s
  double mean_input_tokens = 0;            // usage.prompt_tokens per request
  double mean_output_tokens = 0;           // usage.completion_tokens per request (all n choices)
  double cache_hit_rate = 0;               // sum cached_tokens / sum prompt_tokens
  std::vector<std::string> error_samples;  // the first few errors, "HTTP 400: body"
  std::vector<DrainReport> drains;
  // Raw per-request figures of the successful requests, ascending (for CDFs and plots):
  // latencies, and TTFTs when streaming.
  std::vector<double> latencies_s, ttfts_s;
  // Mean seconds per request of each P/D phase during the batch, from the proxy's
  // kvbridge_proxy_phase_seconds (docs/metrics.md "Per-request P/D timeline"): the change of
  // each phase's _sum over the change of its _count. Empty when --host does not export them.
  std::map<std::string, double> phase_mean_s;
};

/// Per phase label, the (sum, count) totals of kvbridge_proxy_phase_seconds in a /metrics text
/// (summed over the other labels).
std::map<std::string, std::pair<double, double>> ParsePhaseTotals(const std::string& metrics);

/// How `kvbridge bench` shows RunBench's progress lines. On a terminal every line redraws in
/// place ("\r" + the line padded); otherwise (a file, a pipe) a line ends in "\n" and is written
/// at most every `interval`, and at once when the batch changes (the text before ':').
/// Returns what to write for `line` at `now` (empty: nothing).
class ProgressThrottle {
 public:
  explicit ProgressThrottle(bool tty, std::chrono::milliseconds interval = std::chrono::seconds(5))
      : tty_(tty), interval_(interval) {}
  std::string Format(const std::string& line, std::chrono::steady_clock::time_point now);

 private:
  bool tty_;
  std::chrono::milliseconds interval_;
  bool printed_ = false;
  std::chrono::steady_clock::time_point last_{};
  std::string last_batch_;
};

struct BenchReport {
  std::vector<BatchReport> batches;
  std::string stop_reason;  // non-empty when --max-latency ended the sweep early
  bool ok = true;           // no request error, every drain within bound, no lease/notification
};

/// Runs the sweep. `progress` (may be empty) gets a one-line status every ~200 ms while a batch
/// runs. InvalidArgument for bad options or an unreadable/empty prompts file; Unavailable when
/// the instance list for drain checking cannot be fetched. Request errors are not a Status: they
/// are counted in the report (and make ok false).
Result<BenchReport> RunBench(const BenchOptions& options,
                             const std::function<void(const std::string&)>& progress);

/// A human-readable table (one row per batch, then drain lines).
std::string FormatTable(const BenchReport& report);
/// The machine-readable summary (`--json`).
std::string ReportJson(const BenchReport& report);

/// Reads prompts from JSONL rows with a string "model_input". InvalidArgument naming the line.
Result<std::vector<std::string>> LoadPrompts(const std::string& path);
/// `count` deterministic prompts of a few hundred words each from `seed`.
std::vector<std::string> MakeSyntheticPrompts(int count, uint64_t seed);
/// The q-quantile (0..1) of `values` by linear interpolation between closest ranks; 0 when empty.
double Percentile(std::vector<double> values, double q);
/// Parses "3,4,8" into {3,4,8}; InvalidArgument for empty, non-numeric or < 1 entries.
Result<std::vector<int>> ParseBatches(const std::string& text);

// --- `kvbridge bench --multi-turn` ---------------------------------------------------------------
//
// Conversations through POST /v1/chat/completions, streamed (TTFT): rows of a JSONL file with a
// "turns" list of user messages (MT-bench's question.jsonl). Turn k+1's messages are turn k's
// plus the model's answer (assistant) plus the next user message. Turns run as phases: every
// conversation's turn 1 (`concurrency` in flight), then every turn 2, ... so that the engines'
// counters read between phases belong to one turn (each phase in its own seeded order): prompt
// tokens computed (kvbridge_prompt_tokens_computed_total, summed over every instance of GET
// {host}/instances or `metrics_urls`) and prefix-cache hits. Greedy (temperature 0), fixed
// max_tokens: two runs against different routings see the same conversations.

struct MultiTurnOptions {
  std::string host = "http://127.0.0.1:10001";
  std::string prompts_file;  // JSONL rows with a "turns" list of strings
  std::string model;         // empty = the first id of GET /v1/models
  int conversations = 0;     // 0 = every row
  int concurrency = 8;       // conversations in flight within a turn
  int max_turns = 0;         // 0 = every turn of the longest row
  int output_tokens = 64;    // max_tokens of each answer
  double request_timeout_s = 600;
  std::vector<std::string> metrics_urls;  // empty: every instance GET {host}/instances lists
  /// Each turn sends the conversations in its own order (a shuffle seeded by seed + turn), as
  /// users answer at different times: a router cannot lean on the order repeating.
  uint64_t seed = 0;
};

struct TurnReport {
  int turn = 0;  // 1-based
  int requests = 0;
  int errors = 0;
  double duration_s = 0;
  double ttft_mean_s = 0, ttft_p50_s = 0, ttft_p90_s = 0;
  double latency_p50_s = 0;
  double prompt_tokens = 0;             // sum of usage.prompt_tokens
  double usage_cached_tokens = 0;       // sum of usage.prompt_tokens_details.cached_tokens
  double prompt_tokens_computed = -1;   // engines' counter delta (-1: not exported)
  double prefix_cache_hit_tokens = -1;  // engines' kvbridge_prefix_cache_hits_total delta
  /// 1 - prompt_tokens_computed / prompt_tokens: the share of prompt tokens no engine computed
  /// (in P/D a decode loading the prefill's KV does not compute it: only the prefill counts).
  double cache_hit_rate = 0;
  std::vector<std::pair<std::string, double>> computed_by_instance;  // url → delta
  std::vector<std::string> error_samples;
};

struct MultiTurnReport {
  std::vector<TurnReport> turns;
  bool ok = true;  // no request error
};

/// Reads rows with a "turns" list of strings. InvalidArgument naming the line.
Result<std::vector<std::vector<std::string>>> LoadConversations(const std::string& path);
/// Runs the conversations. InvalidArgument for bad options or file; Unavailable when the
/// instances' list cannot be read. Request errors are counted (ok false), not a Status.
Result<MultiTurnReport> RunMultiTurn(const MultiTurnOptions& options,
                                     const std::function<void(const std::string&)>& progress);
std::string FormatMultiTurn(const MultiTurnReport& report);
/// {"turns": [{"turn": 1, "requests", "errors", "ttft_p50_s", "ttft_p90_s", "ttft_mean_s",
///  "latency_p50_s", "prompt_tokens", "prompt_tokens_computed", "prefix_cache_hit_tokens",
///  "cache_hit_rate", "usage_cached_tokens", "duration_s", "computed_by_instance": {url: n}}, ...],
///  "ok": true}
std::string MultiTurnJson(const MultiTurnReport& report);

// --- `kvbridge bench --overload X`
// ----------------------------------------------------------------
//
// Issue 21's overload measure: first the topology's capacity, measured (a closed loop of
// `probe_concurrency` clients for `probe_seconds`: requests answered 200 per second), then an open
// loop offering `factor` times that rate for `seconds` (arrivals evenly spaced, each sent by one of
// `clients` threads; an arrival that finds no free thread goes late and is counted). Every answer
// must be a 200 (an accepted request completed) or a refusal — 429, or 503 (an engine's bounded
// queue) — carrying Retry-After. Meanwhile every instance's /metrics is sampled every 200 ms
// (process_resident_memory_bytes, kvbridge_requests_waiting, the proxy's
// kvbridge_proxy_requests_in_flight); afterwards every instance must drain (as --check-drain) and
// the proxy hold nothing in flight. `host` may also be one engine (no proxy): then its own
// admission bound (`serve --max-waiting-requests`, 503 + Retry-After) is what is measured.
//
//   OverloadOptions o;
//   o.host = "http://127.0.0.1:10001";
//   ASSIGN_OR_RETURN(OverloadReport r, RunOverload(o, progress));
//   std::puts(FormatOverload(r).c_str());

struct OverloadOptions {
  std::string host = "http://127.0.0.1:10001";  // the proxy
  std::string path = "/v1/completions";
  std::string model;          // "model" field; empty = the first id of GET /v1/models
  double factor = 10;         // offered rate = factor x capacity
  double seconds = 10;        // how long the overload is offered
  int probe_concurrency = 4;  // the closed loop that measures capacity
  double probe_seconds = 3;
  double capacity_rps = 0;         // > 0: use this capacity, no probe
  int clients = 256;               // sender threads of the open loop
  int input_tokens = 0;            // > 0: truncate_prompt_tokens
  int output_tokens = 16;          // max_tokens
  double request_timeout_s = 120;  // per request: past it a request counts as an error
  double drain_timeout_s = 10;     // after the last answer
  uint64_t seed = 0;
};

/// One instance (or the proxy) as sampled during the run; -1 = not exported.
struct InstanceSample {
  std::string url;
  std::string role;              // "proxy", "prefill", "decode"
  double rss_before_bytes = -1;  // process_resident_memory_bytes before the overload
  double rss_peak_bytes = -1;    // its highest sample during the overload and the drain
  double rss_after_bytes = -1;   // after the drain
  double waiting_peak = -1;      // kvbridge_requests_waiting (engines)
  double in_flight_peak = -1;    // kvbridge_proxy_requests_in_flight (the proxy)
};

struct OverloadReport {
  double capacity_rps = 0;  // measured (or given)
  int probe_requests = 0, probe_errors = 0;
  double offered_rps = 0;  // factor x capacity
  double duration_s = 0;   // first send to last answer
  int sent = 0;
  double sent_rps = 0;  // achieved: the arrivals over the time from the first to the last
  int ok = 0;           // 200: accepted and completed
  int rejected_429 = 0;
  int rejected_503 = 0;
  int missing_retry_after = 0;  // refusals without a Retry-After header
  int errors = 0;               // anything else: transport error, timeout, other status
  int late = 0;                 // arrivals sent > 50 ms after their time (no free client)
  double goodput_rps = 0;       // ok / duration
  double accepted_p50_s = 0, accepted_p99_s = 0, rejected_p99_s = 0;
  std::vector<InstanceSample> instances;
  std::vector<DrainReport> drains;
  double proxy_in_flight_after = -1;
  std::vector<std::string> error_samples;
  bool ok_all = false;  // refusals seen, all with Retry-After, no error, drained, 0 in flight
};

/// Runs the measure. `host` is a proxy (its GET /instances names the engines to watch and drain)
/// or an engine alone (watched and drained itself: its own bounded queue is what refuses).
/// InvalidArgument for bad options; Unavailable when the capacity probe gets no 200. Request
/// errors are counted, not a Status.
Result<OverloadReport> RunOverload(const OverloadOptions& options,
                                   const std::function<void(const std::string&)>& progress);
std::string FormatOverload(const OverloadReport& report);
std::string OverloadJson(const OverloadReport& report);

}  // namespace kvbridge::bench
