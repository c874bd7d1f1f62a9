// kvbridge/proxy/timeline.h — one client request's P/D timeline, assembled by the proxy from its
// own times and the timing each engine returns with its leg's answer (docs/metrics.md
// "Per-request P/D timeline").
//
// Each leg goes out with `X-KVBridge-Timing: 1`; the engine answers with its phase times (µs
// after its HTTP handler started) in the response header `X-KVBridge-Timing` (whole answers) or
// as an SSE comment `: kvbridge-timing {json}` before `data: [DONE]` (streams), which
// SseTimingFilter takes out of the stream the client sees. Clocks are never compared across
// processes: an engine's times are placed inside its leg's proxy-side window (sent → answer),
// centred, so the network and HTTP time before and after it split evenly.
//
//   TimelineInput in{...};                 // the proxy's times + each leg's engine timing
//   nlohmann::json tl = BuildTimeline(in); // phases (sum = latency), spans, transfer, legs
//   ObserveTimeline(tl, &registry);        // kvbridge_proxy_phase_seconds{phase,mode,backend}
//   ring.Put(tl);                          // GET /v1/requests/{id}/timeline
//
// The proxy's per-request path does the same without building JSON (issue 28: the JSON, the
// histogram look-ups and the ring's JSON destructions were ~17 % of its CPU per request):
//   observer.Observe(SummarizeTimeline(in));  // the same histograms, looked up once
//   ring.PutInput(std::move(in));             // the JSON is built when a timeline is asked for
//
// Thread-safety: TimelineRing and TimelineObserver are thread-safe; the rest are values / pure
// functions.
#pragma once

#include <array>
#include <cstddef>
#include <deque>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/kv_transfer_mode.h"
#include "kvbridge/common/metrics.h"
#include "kvbridge/common/thread_annotations.h"
#include "kvbridge/proxy/flow.h"

namespace kvbridge::proxy {

/// Request header asking an engine for its timing; the response header that carries it.
inline constexpr const char* kTimingHeader = "X-KVBridge-Timing";
/// The SSE comment line that carries a streamed leg's timing (then the JSON, then "\n\n").
inline constexpr std::string_view kSseTimingPrefix = ": kvbridge-timing ";

/// A client's X-Request-Id as the proxy and the engines use it: at most 64 characters of
/// [A-Za-z0-9.:-], any other character as '-'. Empty when `header` is.
std::string SanitizeRequestId(std::string_view header);

/// Takes the `: kvbridge-timing {json}\n\n` event out of an SSE stream passed through in chunks
/// split anywhere. Only bytes at the start of an event that could still begin that comment are
/// held back (an SSE data event starts with "data:", so in practice nothing is).
class SseTimingFilter {
 public:
  /// The bytes to pass on now, in order.
  std::string Feed(std::string_view data);
  /// At the stream's end: whatever is still held back (an incomplete comment), to pass on.
  std::string Finish();
  /// The comment's JSON text (empty until seen).
  const std::string& timing() const { return timing_; }

 private:
  std::string pending_;
  std::string timing_;
  bool at_event_start_ = true;
  bool prev_newline_ = false;  // the last byte passed on was '\n' (half of an event's end)
};

/// One leg as the proxy saw it, and the engine's timing JSON (empty: none came back).
struct LegTiming {
  LegRecord record;
  bool stream = false;
  std::string engine_timing;
};

struct TimelineInput {
  std::string request_id;  ///< the X-Request-Id (client-supplied or minted)
  std::string transfer_id;
  KvTransferMode mode = KvTransferMode::kRead;
  bool colocated = false;
  std::string path;
  bool stream = false;
  Outcome outcome = Outcome::kPending;
  TimePoint received = 0;   ///< the proxy read the client's request
  TimePoint responded = 0;  ///< the client's response was written
  std::vector<LegTiming> legs;
};

/// The timeline:
///   {"request_id", "transfer_id", "mode": "read"|"write"|"colocated", "path", "stream",
///    "outcome", "latency_ms",
///    "phases": [{"phase", "start_ms", "ms"}...]   consecutive, from 0 to latency_ms (so they sum
///                                                 to it); a phase whose end is unknown merges
///                                                 into the next,
///    "sum_ms", "clamped_ms" (how far engine times had to move to stay in order: 0 when the
///    placement is consistent), "spans": [{"span": "hold"|"prefill_queue"|..., "start_ms",
///    "ms"}], "release_ms" (READ: the hold-valid reply, when the prefill freed the hold; WRITE:
///    the last WriteDone, sent as the prefill frees its blocks),
///    "transfer": {"bytes", "blocks", "reads" | "writes", "backend", "ms", "gbps"} (READ: the
///    decode's reads, first posted to last ended; WRITE: the bytes that landed in the decode's
///    pool, over the prefill's first-write-posted to last-write-done time),
///    "legs": [{"role", "instance", "status", "sent_ms", "first_byte_ms", "ended_ms",
///              "engine": the engine's timing JSON}]}
/// Times in ms after `received`. READ phases: proxy_queue, prefill_http_in, prefill_tokenize,
/// prefill_queue, prefill_compute, prefill_http_out, proxy_relay, decode_http_in,
/// decode_tokenize, decode_queue, transfer, hold_valid_reply, first_decode_token, decode,
/// decode_http_out, proxy_respond. WRITE: proxy_queue, decode_http_in, decode_tokenize,
/// decode_queue, kv_wait (prefill + its layer writes), first_decode_token, decode,
/// decode_http_out, proxy_respond (the prefill's queue and compute and the transfer as spans).
/// Colocated: proxy_queue, http_in, tokenize, queue, prefill, decode, http_out, proxy_respond.
nlohmann::json BuildTimeline(const TimelineInput& in);

/// kvbridge_proxy_phase_seconds{phase,mode,backend} for each phase of a timeline whose outcome
/// is "ok", and kvbridge_proxy_kv_transfer_gbps{mode,backend} for its transfer.
void ObserveTimeline(const nlohmann::json& timeline, MetricsRegistry* metrics);

/// One phase or span of a timeline: its name (a string literal), start and length in ms after
/// `received`.
struct TimelinePhase {
  const char* phase;
  double start_ms;
  double ms;
};

/// What ObserveTimeline takes from a timeline, computed from its input without building the
/// JSON (the same phases, to the value, as BuildTimeline's).
struct TimelineSummary {
  bool ok = false;               ///< outcome "ok": only those are observed
  const char* mode = "read";     ///< "read" | "write" | "colocated"
  std::string backend = "none";  ///< the transfer's backend as the decode reported it
  std::vector<TimelinePhase> phases;
  double gbps = -1;  ///< the transfer's GB/s; < 0 when unknown
};
TimelineSummary SummarizeTimeline(const TimelineInput& in);

/// ObserveTimeline for summaries: the same histograms, each looked up once per (phase, mode,
/// backend) instead of per request. Thread-safe.
class TimelineObserver {
 public:
  explicit TimelineObserver(MetricsRegistry* metrics) : metrics_(metrics) {}
  void Observe(const TimelineSummary& s);

 private:
  MetricsRegistry* metrics_;
  Mutex mu_;
  std::set<std::string, std::less<>> backends_ GUARDED_BY(mu_);  // the keys' backend names
  std::map<std::array<std::string_view, 3>, Histogram*> phase_ GUARDED_BY(mu_);
  std::map<std::array<std::string_view, 2>, Histogram*> gbps_ GUARDED_BY(mu_);
};

/// The last `capacity` timelines, found by request_id or transfer_id. A timeline put as its
/// input is built (BuildTimeline) only when Get returns it.
class TimelineRing {
 public:
  explicit TimelineRing(size_t capacity) : capacity_(capacity) {}
  void Put(nlohmann::json timeline);
  void PutInput(TimelineInput input);
  /// The newest timeline whose request_id or transfer_id is `id`.
  std::optional<nlohmann::json> Get(std::string_view id) const;

 private:
  struct Entry {
    std::optional<nlohmann::json> built;
    TimelineInput input;  // when !built
  };
  void PushLocked(Entry e) REQUIRES(mu_);
  size_t capacity_;
  mutable Mutex mu_;
  std::deque<Entry> ring_ GUARDED_BY(mu_);  // newest last
};

}  // namespace kvbridge::proxy
