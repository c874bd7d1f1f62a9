#include "kvbridge/proxy/timeline.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

namespace kvbridge::proxy {
namespace {

using nlohmann::json;

double Ms(DurationUs us) { return std::round(static_cast<double>(us)) / 1000.0; }

// One leg's engine timing, its times placed on the proxy's clock.
struct EngineTimes {
  bool ok = false;
  json raw;
  json t;  // objects when ok (null otherwise: nothing allocated for a leg without timing)
  json kv;
  TimePoint base = 0;  // proxy time of the engine's t = 0 (its HTTP handler started)

  TimePoint At(const json& j, const char* key) const {
    if (!ok) return -1;
    auto it = j.find(key);
    return it != j.end() && it->is_number_integer() ? base + it->get<int64_t>() : -1;
  }
  TimePoint T(const char* key) const { return At(t, key); }
  TimePoint Kv(const char* key) const { return At(kv, key); }
};

// Places the engine's times inside the leg's proxy-side window, centred: the engine's span
// (t = 0 to its answer: the header for a whole answer, the last frame for a stream) sits in the
// proxy's (sent to first byte, or to the end of a stream), the rest split evenly before and
// after it (network, HTTP, the proxy's own reads).
EngineTimes Place(const LegTiming* leg) {
  EngineTimes e;
  if (leg == nullptr || leg->engine_timing.empty()) return e;
  json j = json::parse(leg->engine_timing, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("t") || !j["t"].is_object()) return e;
  e.ok = true;
  e.t = j["t"];
  e.kv = j.contains("kv") && j["kv"].is_object() ? j["kv"] : json::object();
  const LegRecord& r = leg->record;
  TimePoint end = leg->stream ? r.ended_at : r.first_byte_at;
  if (end < 0) end = r.ended_at;
  const int64_t engine_span = e.t.value("responded", int64_t{0});
  const DurationUs proxy_span = end >= r.sent_at ? end - r.sent_at : 0;
  e.base = r.sent_at + std::max<DurationUs>(0, (proxy_span - engine_span) / 2);
  e.raw = std::move(j);
  return e;
}

const LegTiming* LastLeg(const TimelineInput& in, Role role) {
  const LegTiming* out = nullptr;
  for (const LegTiming& l : in.legs) {
    if (l.record.role == role) out = &l;
  }
  return out;
}

// Consecutive phases from `t0` to `t_end`: each named phase ends at its point; a point that is
// unknown (-1) merges its phase into the next; a point out of order is clamped (and counted).
class PhaseList {
 public:
  PhaseList(TimePoint t0, TimePoint t_end) : t0_(t0), t_end_(t_end), prev_(t0) {}
  void Add(const char* phase, TimePoint end) {
    if (end < 0) return;
    TimePoint at = std::clamp(end, prev_, std::max(prev_, t_end_));
    clamped_ += std::llabs(at - end);
    phases_.push_back({phase, Ms(prev_ - t0_), Ms(at - prev_)});
    sum_ += at - prev_;
    prev_ = at;
  }
  void Close(const char* phase) { Add(phase, t_end_); }
  std::vector<TimelinePhase>& phases() { return phases_; }
  DurationUs sum() const { return sum_; }
  DurationUs clamped() const { return clamped_; }

 private:
  TimePoint t0_, t_end_, prev_;
  DurationUs sum_ = 0, clamped_ = 0;
  std::vector<TimelinePhase> phases_;
};

void AddSpan(std::vector<TimelinePhase>& spans, const char* name, TimePoint from, TimePoint to,
             TimePoint t0) {
  if (from < 0 || to < 0 || to < from) return;
  spans.push_back({name, Ms(from - t0), Ms(to - from)});
}

// READ: the decode's first READ posted to its last ended. WRITE: the prefill's own measure
// (first write posted to last write done, the slowest rank), carried by WriteDone. -1: unknown.
DurationUs TransferMicros(const EngineTimes& de) {
  const TimePoint posted = de.Kv("read_posted"), done = de.Kv("read_ended");
  DurationUs took = posted >= 0 && done >= posted ? done - posted : -1;
  if (took < 0 && de.kv.contains("write_micros") && de.kv["write_micros"].is_number_integer()) {
    took = de.kv["write_micros"].get<int64_t>();
  }
  return took;
}

// What BuildTimeline and SummarizeTimeline share: the phases, spans and engine times of one
// request, without any JSON of the proxy's own.
struct Core {
  const char* mode = "read";
  EngineTimes pe, de;
  PhaseList pl;
  std::vector<TimelinePhase> spans;
  TimePoint release = -1;  // READ: the hold-valid reply
  Core(TimePoint t0, TimePoint t_end) : pl(t0, t_end) {}
};

Core Compute(const TimelineInput& in) {
  const TimePoint t0 = in.received;
  const TimePoint t_end = std::max(in.responded, t0);
  Core c(t0, t_end);
  c.mode = in.colocated ? "colocated" : in.mode == KvTransferMode::kWrite ? "write" : "read";
  const LegTiming* p_leg = LastLeg(in, Role::kPrefill);
  const LegTiming* d_leg = LastLeg(in, Role::kDecode);
  c.pe = Place(p_leg);
  c.de = Place(d_leg);
  const EngineTimes& pe = c.pe;
  const EngineTimes& de = c.de;
  PhaseList& pl = c.pl;
  auto sent = [](const LegTiming* l) { return l != nullptr ? l->record.sent_at : -1; };
  auto ended = [](const LegTiming* l) { return l != nullptr ? l->record.ended_at : -1; };
  // The decode's queue ends where its KV wait starts (P/D) or where it is scheduled.
  const TimePoint d_queue_end =
      de.T("kv_wait_start") >= 0 ? de.T("kv_wait_start") : de.T("scheduled");
  if (in.colocated) {
    pl.Add("proxy_queue", sent(d_leg));
    pl.Add("http_in", de.ok ? de.base : -1);
    pl.Add("tokenize", de.T("added"));
    pl.Add("queue", de.T("scheduled"));
    pl.Add("prefill", de.T("first_token"));
    pl.Add("decode", de.T("finished"));
    pl.Add("http_out", ended(d_leg));
  } else if (in.mode == KvTransferMode::kWrite) {
    TimePoint first_sent = sent(d_leg);
    if (p_leg != nullptr && (first_sent < 0 || p_leg->record.sent_at < first_sent)) {
      first_sent = p_leg->record.sent_at;
    }
    pl.Add("proxy_queue", first_sent);
    pl.Add("decode_http_in", de.ok ? de.base : -1);
    pl.Add("decode_tokenize", de.T("added"));
    pl.Add("decode_queue", d_queue_end);
    pl.Add("kv_wait", de.T("kv_wait_end"));
    pl.Add("first_decode_token", de.T("first_token"));
    pl.Add("decode", de.T("finished"));
    pl.Add("decode_http_out", ended(d_leg));
    AddSpan(c.spans, "prefill_queue", pe.T("added"), pe.T("scheduled"), t0);
    AddSpan(c.spans, "prefill_compute", pe.T("scheduled"), pe.T("first_token"), t0);
    // The decode asked for its blocks (WriteBlocks) until the last prefill rank's WriteDone:
    // the prefill frees its blocks as it sends that, so it is the release.
    AddSpan(c.spans, "transfer", de.Kv("write_requested"), de.Kv("write_done"), t0);
    c.release = de.Kv("write_done");
  } else {
    pl.Add("proxy_queue", sent(p_leg));
    pl.Add("prefill_http_in", pe.ok ? pe.base : -1);
    pl.Add("prefill_tokenize", pe.T("added"));
    pl.Add("prefill_queue", pe.T("scheduled"));
    pl.Add("prefill_compute", pe.T("first_token"));
    pl.Add("prefill_http_out", ended(p_leg));
    pl.Add("proxy_relay", sent(d_leg));
    pl.Add("decode_http_in", de.ok ? de.base : -1);
    pl.Add("decode_tokenize", de.T("added"));
    pl.Add("decode_queue", d_queue_end);
    pl.Add("transfer", de.Kv("read_ended") >= 0 ? de.Kv("read_ended") : de.T("kv_wait_end"));
    pl.Add("hold_valid_reply", de.Kv("ack"));
    pl.Add("first_decode_token", de.T("first_token"));
    pl.Add("decode", de.T("finished"));
    pl.Add("decode_http_out", ended(d_leg));
    // The prefill holds the prompt's blocks from its finish until the decode's hold-valid
    // reply, when it frees them (READ mode: every reading rank notified).
    AddSpan(c.spans, "hold", pe.T("finished"), de.Kv("ack"), t0);
    c.release = de.Kv("ack");
  }
  pl.Close("proxy_respond");
  return c;
}

// Histograms cover 100 µs .. 60 s; GB/s 0.1 .. 2500.
std::vector<double> GbpsBuckets() {
  return {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500};
}

}  // namespace

std::string SanitizeRequestId(std::string_view header) {
  std::string out;
  for (char c : header.substr(0, std::min<size_t>(header.size(), 64))) {
    const bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == ':' || c == '-';
    out += ok ? c : '-';
  }
  return out;
}

std::string SseTimingFilter::Feed(std::string_view data) {
  std::string buf = std::move(pending_);
  pending_.clear();
  buf.append(data);
  std::string out;
  size_t i = 0;
  while (i < buf.size()) {
    if (at_event_start_) {
      const size_t avail = buf.size() - i;
      const size_t m = std::min(avail, kSseTimingPrefix.size());
      if (std::string_view(buf).substr(i, m) == kSseTimingPrefix.substr(0, m)) {
        const size_t end =
            avail < kSseTimingPrefix.size() ? std::string::npos : buf.find("\n\n", i);
        if (end == std::string::npos) {
          pending_ = buf.substr(i);  // undecided, or the comment's end has not come yet
          break;
        }
        const size_t json_at = i + kSseTimingPrefix.size();
        timing_ = buf.substr(json_at, end - json_at);
        i = end + 2;
        continue;  // still at an event's start
      }
      at_event_start_ = false;
    }
    if (prev_newline_ && buf[i] == '\n') {  // "\n" | "\n" across two chunks: an event ended
      out += '\n';
      ++i;
      prev_newline_ = false;
      at_event_start_ = true;
      continue;
    }
    const size_t end = buf.find("\n\n", i);
    if (end == std::string::npos) {
      out.append(buf, i, std::string::npos);
      prev_newline_ = buf.back() == '\n';
      break;
    }
    out.append(buf, i, end + 2 - i);
    i = end + 2;
    prev_newline_ = false;
    at_event_start_ = true;
  }
  return out;
}

std::string SseTimingFilter::Finish() {
  std::string rest = std::move(pending_);
  pending_.clear();
  return rest;
}

json BuildTimeline(const TimelineInput& in) {
  const TimePoint t0 = in.received;
  const TimePoint t_end = std::max(in.responded, t0);
  Core c = Compute(in);
  const EngineTimes& de = c.de;
  PhaseList& pl = c.pl;
  json out = {{"request_id", in.request_id},
              {"transfer_id", in.transfer_id},
              {"mode", c.mode},
              {"path", in.path},
              {"stream", in.stream},
              {"outcome", OutcomeName(in.outcome)},
              {"latency_ms", Ms(t_end - t0)}};
  if (c.release >= 0) out["release_ms"] = Ms(c.release - t0);
  json spans = json::array();
  for (const TimelinePhase& sp : c.spans) {
    spans.push_back({{"span", sp.phase}, {"start_ms", sp.start_ms}, {"ms", sp.ms}});
  }
  json phases = json::array();
  for (const TimelinePhase& ph : pl.phases()) {
    phases.push_back({{"phase", ph.phase}, {"start_ms", ph.start_ms}, {"ms", ph.ms}});
  }
  out["phases"] = std::move(phases);
  out["sum_ms"] = Ms(pl.sum());
  out["clamped_ms"] = Ms(pl.clamped());
  out["spans"] = std::move(spans);
  if (de.ok && !de.kv.empty()) {
    json tr = json::object();
    for (const char* k : {"bytes", "blocks", "reads", "writes", "backend"}) {
      if (de.kv.contains(k)) tr[k] = de.kv[k];
    }
    const DurationUs took = TransferMicros(de);
    if (took >= 0) {
      tr["ms"] = Ms(took);
      if (tr.contains("bytes") && took > 0) {
        tr["gbps"] = tr["bytes"].get<double>() / static_cast<double>(took) / 1e3;
      }
    }
    out["transfer"] = std::move(tr);
  }
  json legs = json::array();
  for (const LegTiming& l : in.legs) {
    const LegRecord& r = l.record;
    json j = {{"role", RoleName(r.role)},
              {"instance", r.instance_id},
              {"status", r.status},
              {"sent_ms", Ms(r.sent_at - t0)},
              {"first_byte_ms", r.first_byte_at >= 0 ? json(Ms(r.first_byte_at - t0)) : json()},
              {"ended_ms", r.ended_at >= 0 ? json(Ms(r.ended_at - t0)) : json()}};
    if (!l.engine_timing.empty()) {
      json e = json::parse(l.engine_timing, nullptr, false);
      if (!e.is_discarded()) j["engine"] = std::move(e);
    }
    legs.push_back(std::move(j));
  }
  out["legs"] = std::move(legs);
  return out;
}

void ObserveTimeline(const json& timeline, MetricsRegistry* metrics) {
  if (timeline.value("outcome", std::string()) != "ok") return;
  const std::string mode = timeline.value("mode", std::string("read"));
  std::string backend = "none";
  if (auto tr = timeline.find("transfer"); tr != timeline.end() && tr->contains("backend")) {
    backend = (*tr)["backend"].get<std::string>();
  }
  const std::string base = PrometheusLabels({{"mode", mode}, {"backend", backend}});
  for (const json& p : timeline.value("phases", json::array())) {
    metrics
        ->AddHistogram("kvbridge_proxy_phase_seconds",
                       "Phases of one client request through the proxy (docs/metrics.md).",
                       Histogram::PhaseBucketsSeconds(),
                       PrometheusLabels({{"phase", p["phase"].get<std::string>()}}) + "," + base)
        .Observe(p["ms"].get<double>() / 1000.0);
  }
  if (auto tr = timeline.find("transfer"); tr != timeline.end() && tr->contains("gbps")) {
    metrics
        ->AddHistogram("kvbridge_proxy_kv_transfer_gbps",
                       "KV transfer rate of one request's READ, GB/s (bytes / read time).",
                       GbpsBuckets(), base)
        .Observe((*tr)["gbps"].get<double>());
  }
}

TimelineSummary SummarizeTimeline(const TimelineInput& in) {
  TimelineSummary out;
  out.ok = in.outcome == Outcome::kOk;
  if (!out.ok) return out;
  Core c = Compute(in);
  out.mode = c.mode;
  out.phases = std::move(c.pl.phases());
  const EngineTimes& de = c.de;
  if (de.ok && !de.kv.empty()) {
    if (auto b = de.kv.find("backend"); b != de.kv.end()) {
      out.backend = b->is_string() ? b->get<std::string>() : b->dump();
    }
    const DurationUs took = TransferMicros(de);
    auto bytes = de.kv.find("bytes");
    if (took > 0 && bytes != de.kv.end() && bytes->is_number()) {
      out.gbps = bytes->get<double>() / static_cast<double>(took) / 1e3;
    }
  }
  return out;
}

void TimelineObserver::Observe(const TimelineSummary& s) {
  if (!s.ok) return;
  MutexLock l(&mu_);
  auto b = backends_.find(s.backend);
  if (b == backends_.end()) b = backends_.insert(s.backend).first;
  const std::string_view backend = *b, mode = s.mode;
  auto labels = [&] { return PrometheusLabels({{"mode", s.mode}, {"backend", s.backend}}); };
  for (const TimelinePhase& p : s.phases) {
    Histogram*& h = phase_[{std::string_view(p.phase), mode, backend}];
    if (h == nullptr) {
      h = &metrics_->AddHistogram(
          "kvbridge_proxy_phase_seconds",
          "Phases of one client request through the proxy (docs/metrics.md).",
          Histogram::PhaseBucketsSeconds(),
          PrometheusLabels({{"phase", p.phase}}) + "," + labels());
    }
    h->Observe(p.ms / 1000.0);
  }
  if (s.gbps >= 0) {
    Histogram*& h = gbps_[{mode, backend}];
    if (h == nullptr) {
      h = &metrics_->AddHistogram(
          "kvbridge_proxy_kv_transfer_gbps",
          "KV transfer rate of one request's READ, GB/s (bytes / read time).", GbpsBuckets(),
          labels());
    }
    h->Observe(s.gbps);
  }
}

void TimelineRing::PushLocked(Entry e) {
  ring_.push_back(std::move(e));
  while (ring_.size() > capacity_) ring_.pop_front();
}

void TimelineRing::Put(json timeline) {
  MutexLock l(&mu_);
  PushLocked(Entry{std::move(timeline), {}});
}

void TimelineRing::PutInput(TimelineInput input) {
  MutexLock l(&mu_);
  PushLocked(Entry{std::nullopt, std::move(input)});
}

std::optional<json> TimelineRing::Get(std::string_view id) const {
  MutexLock l(&mu_);
  for (auto it = ring_.rbegin(); it != ring_.rend(); ++it) {
    if (it->built) {
      if (it->built->value("request_id", std::string()) == id ||
          it->built->value("transfer_id", std::string()) == id) {
        return *it->built;
      }
    } else if (it->input.request_id == id || it->input.transfer_id == id) {
      return BuildTimeline(it->input);
    }
  }
  return std::nullopt;
}

}  // namespace kvbridge::proxy
