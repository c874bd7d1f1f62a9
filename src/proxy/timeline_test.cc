// The proxy's per-request timeline: the SSE timing filter at every split, the phases of a READ,
// WRITE and colocated request from known times (exact values, sum = latency), clamping of
// inconsistent engine times, the ring.
#include "kvbridge/proxy/timeline.h"

#include <gtest/gtest.h>

namespace kvbridge::proxy {
namespace {

using nlohmann::json;

TEST(SseTimingFilter, TakesTheCommentOutAtEverySplit) {
  const std::string before = "data: {\"a\":1}\n\ndata: {\"b\":2}\n\n";
  const std::string comment = ": kvbridge-timing {\"t\":{\"responded\":5}}\n\n";
  const std::string after = "data: [DONE]\n\n";
  const std::string stream = before + comment + after;
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    for (size_t cut2 = cut; cut2 <= stream.size(); cut2 += 7) {
      SseTimingFilter f;
      std::string out = f.Feed(std::string_view(stream).substr(0, cut));
      out += f.Feed(std::string_view(stream).substr(cut, cut2 - cut));
      out += f.Feed(std::string_view(stream).substr(cut2));
      out += f.Finish();
      ASSERT_EQ(out, before + after) << "cuts " << cut << " " << cut2;
      ASSERT_EQ(f.timing(), "{\"t\":{\"responded\":5}}") << "cuts " << cut << " " << cut2;
    }
  }
  // Byte by byte.
  SseTimingFilter f;
  std::string out;
  for (char c : stream) out += f.Feed(std::string_view(&c, 1));
  EXPECT_EQ(out + f.Finish(), before + after);
  EXPECT_EQ(f.timing(), "{\"t\":{\"responded\":5}}");
}

TEST(SseTimingFilter, PassesOtherCommentsAndHoldsBackNothingElse) {
  SseTimingFilter f;
  // A data event's bytes go on at once, even mid-event.
  EXPECT_EQ(f.Feed("data: {\"x\""), "data: {\"x\"");
  EXPECT_EQ(f.Feed(":1}\n\n: keep-alive\n\n"), ":1}\n\n: keep-alive\n\n");
  // A possible start of the timing comment waits; an incomplete one comes out at the end.
  EXPECT_EQ(f.Feed(": kvb"), "");
  EXPECT_EQ(f.Finish(), ": kvb");
  EXPECT_EQ(f.timing(), "");
}

TEST(SanitizeRequestId, KeepsSafeCharactersOnly) {
  EXPECT_EQ(SanitizeRequestId("abc-123.x:y"), "abc-123.x:y");
  EXPECT_EQ(SanitizeRequestId("a_b c\"d\n"), "a-b-c-d-");
  EXPECT_EQ(SanitizeRequestId(std::string(100, 'z')), std::string(64, 'z'));
  EXPECT_EQ(SanitizeRequestId(""), "");
}

constexpr TimePoint kT0 = 1'000'000'000;  // the proxy read the client's request (µs)

LegTiming Leg(int id, Role role, TimePoint sent, TimePoint first_byte, TimePoint ended, json engine,
              bool stream = false) {
  LegTiming l;
  l.record.leg_id = id;
  l.record.role = role;
  l.record.instance_id = role == Role::kPrefill ? "p0" : "d0";
  l.record.sent_at = kT0 + sent;
  l.record.first_byte_at = kT0 + first_byte;
  l.record.ended_at = kT0 + ended;
  l.record.status = 200;
  l.stream = stream;
  if (!engine.is_null()) l.engine_timing = engine.dump();
  return l;
}

std::map<std::string, double> Phases(const json& tl) {
  std::map<std::string, double> out;
  for (const json& p : tl["phases"]) out[p["phase"]] = p["ms"];
  return out;
}

// A READ request, µs after kT0: prefill leg sent at 100, its answer's header at 10'100 (the
// engine's span 9'000: 500 each way), done 10'200; decode leg sent 10'300, streamed, ended
// 60'300 (engine span 49'000), client's response done at 60'500.
TEST(BuildTimeline, ReadPhasesAddUpToTheLatency) {
  TimelineInput in;
  in.request_id = "req-1";
  in.transfer_id = "t1";
  in.mode = KvTransferMode::kRead;
  in.stream = true;
  in.outcome = Outcome::kOk;
  in.received = kT0;
  in.responded = kT0 + 60'500;
  in.legs.push_back(Leg(1, Role::kPrefill, 100, 10'100, 10'200,
                        {{"role", "prefill"},
                         {"t",
                          {{"added", 300},
                           {"scheduled", 1'300},
                           {"first_token", 8'300},
                           {"finished", 8'300},
                           {"responded", 9'000}}}}));
  in.legs.push_back(Leg(2, Role::kDecode, 10'300, 10'400, 60'300,
                        {{"role", "decode"},
                         {"t",
                          {{"added", 200},
                           {"kv_wait_start", 700},
                           {"kv_wait_end", 4'200},
                           {"scheduled", 4'300},
                           {"first_token", 9'200},
                           {"finished", 48'000},
                           {"responded", 49'000}}},
                         {"kv",
                          {{"read_posted", 1'000},
                           {"read_ended", 3'000},
                           {"ack", 3'600},
                           {"bytes", 4'000'000},
                           {"blocks", 20},
                           {"reads", 1},
                           {"backend", "shm"}}}},
                        /*stream=*/true));
  const json tl = BuildTimeline(in);
  EXPECT_EQ(tl["mode"], "read");
  EXPECT_EQ(tl["latency_ms"], 60.5);
  EXPECT_EQ(tl["sum_ms"], 60.5);
  EXPECT_EQ(tl["clamped_ms"], 0.0);
  // Prefill engine t=0 at 100 + (10'000 - 9'000)/2 = 600; decode at 10'300 + 500 = 10'800.
  const std::map<std::string, double> want = {
      {"proxy_queue", 0.1},        {"prefill_http_in", 0.5}, {"prefill_tokenize", 0.3},
      {"prefill_queue", 1.0},      {"prefill_compute", 7.0}, {"prefill_http_out", 1.3},
      {"proxy_relay", 0.1},        {"decode_http_in", 0.5},  {"decode_tokenize", 0.2},
      {"decode_queue", 0.5},       {"transfer", 2.3},        {"hold_valid_reply", 0.6},
      {"first_decode_token", 5.6}, {"decode", 38.8},         {"decode_http_out", 1.5},
      {"proxy_respond", 0.2}};
  const auto got = Phases(tl);
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [k, v] : want) EXPECT_NEAR(got.at(k), v, 1e-9) << k;
  // Phases are consecutive from 0.
  double at = 0;
  for (const json& p : tl["phases"]) {
    EXPECT_NEAR(p["start_ms"].get<double>(), at, 1e-9) << p;
    at += p["ms"].get<double>();
  }
  EXPECT_NEAR(at, 60.5, 1e-9);
  // The hold: the prefill's finish (600 + 8'300) to the hold-valid reply (10'800 + 3'600).
  ASSERT_EQ(tl["spans"].size(), 1u);
  EXPECT_EQ(tl["spans"][0]["span"], "hold");
  EXPECT_NEAR(tl["spans"][0]["start_ms"].get<double>(), 8.9, 1e-9);
  EXPECT_NEAR(tl["spans"][0]["ms"].get<double>(), 5.5, 1e-9);
  EXPECT_NEAR(tl["release_ms"].get<double>(), 14.4, 1e-9);
  // 4 MB in 2 ms = 2 GB/s.
  EXPECT_EQ(tl["transfer"]["backend"], "shm");
  EXPECT_EQ(tl["transfer"]["blocks"], 20);
  EXPECT_NEAR(tl["transfer"]["gbps"].get<double>(), 2.0, 1e-9);
  EXPECT_EQ(tl["legs"].size(), 2u);
  EXPECT_EQ(tl["legs"][1]["engine"]["kv"]["backend"], "shm");

  MetricsRegistry reg;
  ObserveTimeline(tl, &reg);
  const std::string text = reg.Render();
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_proxy_phase_seconds_count",
                         "phase=\"transfer\",mode=\"read\",backend=\"shm\""),
            1.0);
  EXPECT_DOUBLE_EQ(ScrapeMetric(text, "kvbridge_proxy_phase_seconds_sum",
                                "phase=\"prefill_compute\",mode=\"read\",backend=\"shm\""),
                   0.007);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_proxy_kv_transfer_gbps_count"), 1.0);
}

TEST(BuildTimeline, InconsistentEngineTimesAreClampedAndStillSum) {
  TimelineInput in;
  in.mode = KvTransferMode::kRead;
  in.outcome = Outcome::kOk;
  in.received = kT0;
  in.responded = kT0 + 10'000;
  // The prefill claims 6 ms inside a 5 ms leg: its answer (5 ms) and the decode leg's start
  // (5 ms) move to 6 ms.
  in.legs.push_back(
      Leg(1, Role::kPrefill, 0, 5'000, 5'000,
          {{"t", {{"scheduled", 1'000}, {"first_token", 6'000}, {"responded", 6'000}}}}));
  in.legs.push_back(Leg(2, Role::kDecode, 5'000, 6'000, 9'000, json()));
  const json tl = BuildTimeline(in);
  EXPECT_EQ(tl["sum_ms"], 10.0);
  EXPECT_NEAR(tl["clamped_ms"].get<double>(), 2.0, 1e-9);
  for (const json& p : tl["phases"]) EXPECT_GE(p["ms"].get<double>(), 0.0) << p;
  // No decode timing: its phases merge into decode_http_out.
  EXPECT_EQ(Phases(tl).count("decode"), 0u);
  EXPECT_NEAR(Phases(tl).at("decode_http_out"), 3.0, 1e-9);
}

// A WRITE decode leg: sent at 100, its answer's header at 19'000, done 19'100; the engine's
// span 18'000; `kv` its load record (null: none).
LegTiming WriteDecodeLeg(json kv) {
  json engine = {{"t",
                  {{"added", 100},
                   {"kv_wait_start", 200},
                   {"kv_wait_end", 9'000},
                   {"first_token", 10'000},
                   {"finished", 18'000},
                   {"responded", 18'000}}}};
  if (!kv.is_null()) engine["kv"] = std::move(kv);
  return Leg(1, Role::kDecode, 100, 19'000, 19'100, engine);
}

TEST(BuildTimeline, WriteAndColocatedPhases) {
  TimelineInput w;
  w.mode = KvTransferMode::kWrite;
  w.outcome = Outcome::kOk;
  w.received = kT0;
  w.responded = kT0 + 20'000;
  w.legs.push_back(WriteDecodeLeg(json()));
  w.legs.push_back(Leg(
      2, Role::kPrefill, 150, 9'150, 9'200,
      {{"t", {{"added", 100}, {"scheduled", 500}, {"first_token", 8'000}, {"responded", 8'000}}}}));
  json tl = BuildTimeline(w);
  EXPECT_EQ(tl["mode"], "write");
  EXPECT_EQ(tl["sum_ms"], 20.0);
  EXPECT_EQ(tl["clamped_ms"], 0.0);
  auto p = Phases(tl);
  EXPECT_NEAR(p.at("kv_wait"), 8.8, 1e-9);
  EXPECT_NEAR(p.at("decode"), 8.0, 1e-9);
  ASSERT_EQ(tl["spans"].size(), 2u);
  EXPECT_EQ(tl["spans"][1]["span"], "prefill_compute");
  EXPECT_NEAR(tl["spans"][1]["ms"].get<double>(), 7.5, 1e-9);

  TimelineInput c;
  c.colocated = true;
  c.outcome = Outcome::kOk;
  c.received = kT0;
  c.responded = kT0 + 5'000;
  c.legs.push_back(Leg(1, Role::kDecode, 0, 4'000, 4'000,
                       {{"t",
                         {{"added", 0},
                          {"scheduled", 1'000},
                          {"first_token", 2'000},
                          {"finished", 3'000},
                          {"responded", 4'000}}}}));
  tl = BuildTimeline(c);
  EXPECT_EQ(tl["mode"], "colocated");
  p = Phases(tl);
  EXPECT_EQ(p.size(), 8u);  // zero-length phases kept (their points exist)
  EXPECT_NEAR(p.at("prefill"), 1.0, 1e-9);
  EXPECT_NEAR(p.at("proxy_respond"), 1.0, 1e-9);
}

// WRITE with the decode's load record: the transfer is the bytes that landed over the prefill's
// own write time; the release is the last WriteDone.
TEST(BuildTimeline, WriteTransferAndReleaseFromTheDecodesRecord) {
  TimelineInput w;
  w.mode = KvTransferMode::kWrite;
  w.outcome = Outcome::kOk;
  w.received = kT0;
  w.responded = kT0 + 20'000;
  // The decode leg: its t = 0 lies at 550 (sent 100, answer header at 19'000, span 18'000).
  w.legs.push_back(WriteDecodeLeg({{"write_requested", 300},
                                   {"write_done", 8'900},
                                   {"bytes", 4'000'000},
                                   {"blocks", 8},
                                   {"writes", 1},
                                   {"write_micros", 2'000},
                                   {"backend", "shm"}}));
  json tl = BuildTimeline(w);
  const json& tr = tl["transfer"];
  EXPECT_EQ(tr["bytes"], 4'000'000);
  EXPECT_EQ(tr["blocks"], 8);
  EXPECT_EQ(tr["writes"], 1);
  EXPECT_EQ(tr["backend"], "shm");
  EXPECT_DOUBLE_EQ(tr["ms"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(tr["gbps"].get<double>(), 2.0);         // 4 MB in 2 ms
  EXPECT_DOUBLE_EQ(tl["release_ms"].get<double>(), 9.45);  // 0.55 + 8.9
  ASSERT_EQ(tl["spans"].size(), 1u);                       // no prefill leg: only the transfer span
  EXPECT_EQ(tl["spans"][0]["span"], "transfer");
  EXPECT_DOUBLE_EQ(tl["spans"][0]["start_ms"].get<double>(), 0.85);
  EXPECT_DOUBLE_EQ(tl["spans"][0]["ms"].get<double>(), 8.6);
  EXPECT_EQ(tl["sum_ms"], 20.0);
}

// The proxy's per-request path (SummarizeTimeline + TimelineObserver, the ring holding inputs)
// gives the same histograms and the same timeline JSON as BuildTimeline + ObserveTimeline.
TEST(SummarizeTimeline, SameHistogramsAndTimelineAsTheJsonPath) {
  TimelineInput in;
  in.request_id = "req-9";
  in.transfer_id = "t9";
  in.mode = KvTransferMode::kRead;
  in.outcome = Outcome::kOk;
  in.received = kT0;
  in.responded = kT0 + 60'500;
  in.legs.push_back(Leg(1, Role::kPrefill, 100, 10'100, 10'200,
                        {{"t",
                          {{"added", 300},
                           {"scheduled", 1'300},
                           {"first_token", 8'300},
                           {"finished", 8'300},
                           {"responded", 9'000}}}}));
  in.legs.push_back(Leg(2, Role::kDecode, 10'300, 10'400, 60'300,
                        {{"t",
                          {{"added", 200},
                           {"kv_wait_start", 700},
                           {"kv_wait_end", 4'200},
                           {"scheduled", 4'300},
                           {"first_token", 9'200},
                           {"finished", 48'000},
                           {"responded", 49'000}}},
                         {"kv",
                          {{"read_posted", 1'000},
                           {"read_ended", 3'000},
                           {"ack", 3'600},
                           {"bytes", 4'000'000},
                           {"backend", "shm"}}}},
                        /*stream=*/true));
  TimelineInput colo;
  colo.colocated = true;
  colo.outcome = Outcome::kOk;
  colo.received = kT0;
  colo.responded = kT0 + 900;
  colo.legs.push_back(Leg(1, Role::kDecode, 100, 700, 800, json()));  // no engine timing
  TimelineInput failed = colo;
  failed.outcome = Outcome::kDecodeError;
  TimelineInput write;  // WRITE: the transfer's rate from the prefill's write time
  write.mode = KvTransferMode::kWrite;
  write.outcome = Outcome::kOk;
  write.received = kT0;
  write.responded = kT0 + 20'000;
  write.legs.push_back(Leg(1, Role::kDecode, 100, 19'000, 19'100,
                           {{"t", {{"added", 100}, {"finished", 18'000}, {"responded", 18'000}}},
                            {"kv",
                             {{"write_requested", 300},
                              {"write_done", 8'900},
                              {"write_micros", 2'000},
                              {"bytes", 4'000'000},
                              {"backend", "tcp"}}}}));

  MetricsRegistry by_json, by_summary;
  TimelineObserver observer(&by_summary);
  for (const TimelineInput* t : {&in, &colo, &failed, &write, &in}) {
    ObserveTimeline(BuildTimeline(*t), &by_json);
    observer.Observe(SummarizeTimeline(*t));
  }
  EXPECT_EQ(by_summary.Render(), by_json.Render());
  EXPECT_EQ(ScrapeMetric(by_summary.Render(), "kvbridge_proxy_phase_seconds_count",
                         "phase=\"transfer\",mode=\"read\",backend=\"shm\""),
            2.0);
  EXPECT_EQ(ScrapeMetric(by_summary.Render(), "kvbridge_proxy_phase_seconds_count",
                         "phase=\"http_out\",mode=\"colocated\",backend=\"none\""),
            1.0);

  EXPECT_EQ(ScrapeMetric(by_summary.Render(), "kvbridge_proxy_kv_transfer_gbps_count",
                         "mode=\"write\",backend=\"tcp\""),
            1.0);

  TimelineRing ring(2);
  ring.PutInput(in);
  ring.PutInput(colo);
  EXPECT_EQ(*ring.Get("t9"), BuildTimeline(in));
  EXPECT_EQ(*ring.Get("req-9"), BuildTimeline(in));
  ring.Put(BuildTimeline(failed));  // a built one and inputs side by side; "t9" is evicted
  EXPECT_FALSE(ring.Get("t9").has_value());
}

TEST(TimelineRing, BoundedAndFoundByEitherId) {
  TimelineRing ring(2);
  ring.Put({{"request_id", "a"}, {"transfer_id", "ta"}});
  ring.Put({{"request_id", "b"}, {"transfer_id", "tb"}});
  ring.Put({{"request_id", "c"}, {"transfer_id", "tc"}});
  EXPECT_FALSE(ring.Get("a").has_value());
  EXPECT_EQ((*ring.Get("tb"))["request_id"], "b");
  EXPECT_EQ((*ring.Get("c"))["transfer_id"], "tc");
}

}  // namespace
}  // namespace kvbridge::proxy
