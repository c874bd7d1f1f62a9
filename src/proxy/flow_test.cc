#include "kvbridge/proxy/flow.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace kvbridge::proxy {
namespace {

using nlohmann::json;

constexpr const char* kTid = "0123456789abcdef0123456789abcdef";

Endpoint Ep(const std::string& id) {
  Endpoint e;
  e.id = id;
  e.url = "http://" + id;
  e.engine_id = "engine-" + id;
  e.transfer_host = "10.0.0.1";
  e.transfer_port = 7000;
  return e;
}

// Picks the first instance of the role that is not excluded, in list order.
InstancePicker ListPicker(std::vector<Endpoint> prefills, std::vector<Endpoint> decodes) {
  return [prefills, decodes](Role role,
                             const std::vector<std::string>& exclude) -> std::optional<Endpoint> {
    for (const Endpoint& e : role == Role::kPrefill ? prefills : decodes) {
      if (std::find(exclude.begin(), exclude.end(), e.id) == exclude.end()) return e;
    }
    return std::nullopt;
  };
}

template <typename T>
const T& As(const Action& a) {
  EXPECT_TRUE(std::holds_alternative<T>(a)) << "action index " << a.index();
  return std::get<T>(a);
}

std::string PrefillAnswer(const std::string& tid = kTid) {
  json j = {{"id", "cmpl-p"},
            {"choices", {{{"text", "x"}}}},
            {"kv_transfer_params",
             {{"do_remote_decode", false},
              {"transfer_id", tid},
              {"remote_engine_id", "eng-p"},
              {"remote_host", "127.0.0.1"},
              {"remote_port", 7100},
              {"remote_block_ids", {1, 2, 3}},
              {"remote_num_tokens", 40},
              {"tp_size", 1}}}};
  return j.dump();
}

const std::string kClientBody =
    R"({"model":"m","prompt":"hello","max_tokens":20,"n":8,"stream":false,"min_tokens":5,)"
    R"("logprobs":2,"stream_options":{"include_usage":true},)"
    R"("kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[666]}})";

struct Harness {
  explicit Harness(FlowOptions opts = {}, std::vector<Endpoint> p = {Ep("p1"), Ep("p2")},
                   std::vector<Endpoint> d = {Ep("d1"), Ep("d2")})
      : flow(opts, kTid, ListPicker(std::move(p), std::move(d))) {}
  // Feeds a whole leg response (status, body, done).
  std::vector<Action> Answer(int leg, int status, const std::string& body,
                             const std::string& ct = "application/json") {
    std::vector<Action> all = flow.OnLegStatus(leg, status, ct, now++);
    auto d = flow.OnLegData(leg, body, now++);
    all.insert(all.end(), d.begin(), d.end());
    auto e = flow.OnLegDone(leg, now++);
    all.insert(all.end(), e.begin(), e.end());
    return all;
  }
  PdFlow flow;
  TimePoint now = 1000;
};

TEST(PdFlowRead, PrefillLegShapeStripsClientParamsAndOutputFields) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  ASSERT_EQ(a.size(), 1u);
  const SendLeg& leg = As<SendLeg>(a[0]);
  EXPECT_EQ(leg.role, Role::kPrefill);
  EXPECT_EQ(leg.instance.id, "p1");
  EXPECT_EQ(leg.path, "/v1/completions");
  EXPECT_FALSE(leg.stream);
  json b = json::parse(leg.body);
  EXPECT_EQ(b["max_tokens"], 1);
  EXPECT_EQ(b["stream"], false);
  EXPECT_EQ(b["n"], 1);
  EXPECT_EQ(b["prompt"], "hello");
  EXPECT_EQ(b["model"], "m");
  EXPECT_FALSE(b.contains("min_tokens"));
  EXPECT_FALSE(b.contains("logprobs"));
  EXPECT_FALSE(b.contains("stream_options"));
  EXPECT_EQ(b["kv_transfer_params"], json({{"do_remote_decode", true}, {"transfer_id", kTid}}));
}

TEST(PdFlowRead, PrefillForwardNSendsClientN) {
  FlowOptions o;
  o.prefill_forward_n = true;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  EXPECT_EQ(json::parse(As<SendLeg>(a[0]).body)["n"], 8);
}

TEST(PdFlowRead, DecodeLegCarriesClientBodyAndPrefillParams) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int pleg = As<SendLeg>(a[0]).leg_id;
  a = h.Answer(pleg, 200, PrefillAnswer());
  ASSERT_EQ(a.size(), 1u);
  const SendLeg& d = As<SendLeg>(a[0]);
  EXPECT_EQ(d.role, Role::kDecode);
  EXPECT_EQ(d.instance.id, "d1");
  EXPECT_FALSE(d.stream);
  json b = json::parse(d.body);
  EXPECT_EQ(b["n"], 8);
  EXPECT_EQ(b["max_tokens"], 20);
  EXPECT_EQ(b["min_tokens"], 5);
  EXPECT_EQ(b["logprobs"], 2);
  json expected = {{"do_remote_prefill", true},   {"transfer_id", kTid},
                   {"remote_engine_id", "eng-p"}, {"remote_host", "127.0.0.1"},
                   {"remote_port", 7100},         {"remote_block_ids", {1, 2, 3}},
                   {"remote_num_tokens", 40},     {"tp_size", 1}};
  EXPECT_EQ(b["kv_transfer_params"], expected);  // the client's 666 block id is gone

  a = h.Answer(d.leg_id, 200, R"({"choices":[]})");
  ASSERT_EQ(a.size(), 1u);
  const Respond& r = As<Respond>(a[0]);
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, R"({"choices":[]})");
  EXPECT_EQ(h.flow.outcome(), Outcome::kOk);
  EXPECT_TRUE(h.flow.done());
  auto legs = h.flow.legs();
  ASSERT_EQ(legs.size(), 2u);
  EXPECT_EQ(legs[0].status, 200);
  EXPECT_EQ(legs[1].instance_id, "d1");
}

TEST(PdFlowRead, StreamingPassesDecodeBytesThrough) {
  Harness h;
  auto a = h.flow.OnClientRequest(
      {"/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}],"stream":true})"},
      0);
  json pb = json::parse(As<SendLeg>(a[0]).body);
  EXPECT_EQ(pb["stream"], false);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  const SendLeg d = As<SendLeg>(a[0]);
  EXPECT_TRUE(d.stream);
  EXPECT_EQ(d.path, "/v1/chat/completions");
  // The stream starts with the decode's first bytes, not its status line (until then a failed
  // pair can still be retried).
  EXPECT_TRUE(h.flow.OnLegStatus(d.leg_id, 200, "text/event-stream", 5).empty());
  a = h.flow.OnLegData(d.leg_id, "data: {\"a\":1}\n\n", 6);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<StartStream>(a[0]).content_type, "text/event-stream");
  EXPECT_EQ(As<StartStream>(a[0]).status, 200);
  EXPECT_EQ(As<StreamChunk>(a[1]).data, "data: {\"a\":1}\n\n");
  a = h.flow.OnLegData(d.leg_id, "data: [DONE]\n\n", 7);
  EXPECT_EQ(As<StreamChunk>(a[0]).data, "data: [DONE]\n\n");
  a = h.flow.OnLegDone(d.leg_id, 8);
  ASSERT_EQ(a.size(), 1u);
  As<EndStream>(a[0]);
  EXPECT_EQ(h.flow.outcome(), Outcome::kOk);
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowRead, Decode4xxForwardedAsIsAndPrefillReleasedAtOnce) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  int dleg = As<SendLeg>(a[0]).leg_id;
  a = h.flow.OnLegStatus(dleg, 400, "application/json", 10);
  ASSERT_EQ(a.size(), 1u);  // release before the body arrives
  const ReleaseHold& rel = As<ReleaseHold>(a[0]);
  EXPECT_EQ(rel.prefill.id, "p1");
  EXPECT_EQ(rel.transfer_id, kTid);
  EXPECT_TRUE(h.flow.OnLegData(dleg, R"({"error":"max_tokens too big"})", 11).empty());
  a = h.flow.OnLegDone(dleg, 12);
  ASSERT_EQ(a.size(), 1u);
  const Respond& r = As<Respond>(a[0]);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body, R"({"error":"max_tokens too big"})");
  EXPECT_EQ(h.flow.outcome(), Outcome::kDecodeError);
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowRead, Decode4xxOnStreamingRequestIsWholeResponseNotStream) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", R"({"prompt":"x","stream":true})"}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 422, "bad", "text/plain");
  ASSERT_EQ(a.size(), 2u);
  As<ReleaseHold>(a[0]);
  EXPECT_EQ(As<Respond>(a[1]).status, 422);
  EXPECT_EQ(As<Respond>(a[1]).content_type, "text/plain");
  EXPECT_EQ(As<Respond>(a[1]).body, "bad");
}

TEST(PdFlowRead, PrefillErrorForwardedWithoutRelease) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 400, R"({"error":{"message":"prompt too long"}})");
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).status, 400);
  EXPECT_EQ(As<Respond>(a[0]).body, R"({"error":{"message":"prompt too long"}})");
  EXPECT_EQ(h.flow.outcome(), Outcome::kPrefillError);
}

TEST(PdFlowRead, PrefillUnreachableRetriedOnAnother) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int first = As<SendLeg>(a[0]).leg_id;
  a = h.flow.OnLegError(first, LegFailure::kUnreachable, UnavailableError("refused"), 1);
  ASSERT_EQ(a.size(), 1u);
  const SendLeg& retry = As<SendLeg>(a[0]);
  EXPECT_EQ(retry.role, Role::kPrefill);
  EXPECT_EQ(retry.instance.id, "p2");
  EXPECT_NE(retry.leg_id, first);
  // The second one is unreachable too: no third prefill; 502 and nothing to release.
  a = h.flow.OnLegError(retry.leg_id, LegFailure::kUnreachable, UnavailableError("refused"), 2);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).status, 502);
  EXPECT_EQ(h.flow.outcome(), Outcome::kUnreachable);
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowRead, PrefillBrokenAfterSendReleasesAnd502) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.flow.OnLegError(As<SendLeg>(a[0]).leg_id, LegFailure::kBroken, InternalError("reset"), 1);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<ReleaseHold>(a[0]).prefill.id, "p1");
  EXPECT_EQ(As<Respond>(a[1]).status, 502);
  EXPECT_EQ(h.flow.outcome(), Outcome::kPrefillError);
}

TEST(PdFlowRead, DecodeUnreachableRetriedThenReleased) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  a = h.flow.OnLegError(As<SendLeg>(a[0]).leg_id, LegFailure::kUnreachable, UnavailableError("x"),
                        5);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<SendLeg>(a[0]).instance.id, "d2");
  a = h.flow.OnLegError(As<SendLeg>(a[0]).leg_id, LegFailure::kUnreachable, UnavailableError("x"),
                        6);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<ReleaseHold>(a[0]).transfer_id, kTid);
  EXPECT_EQ(As<Respond>(a[1]).status, 502);
}

TEST(PdFlowRead, NoDecodeAfterPrefillReleasesAnd503) {
  Harness h(FlowOptions{}, {Ep("p1")}, {});
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<ReleaseHold>(a[0]).prefill.id, "p1");
  EXPECT_EQ(As<Respond>(a[1]).status, 503);
  EXPECT_EQ(h.flow.outcome(), Outcome::kNoInstance);
}

TEST(PdFlowRead, NoPrefillIs503) {
  Harness h(FlowOptions{}, {}, {Ep("d1")});
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).status, 503);
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowRead, PrefillAnswerWithoutParamsIs502AndReleased) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, R"({"choices":[]})");
  ASSERT_EQ(a.size(), 2u);
  As<ReleaseHold>(a[0]);
  EXPECT_EQ(As<Respond>(a[1]).status, 502);
}

TEST(PdFlowRead, PrefillAnswerForOtherTransferIs502) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer("ffff"));
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<ReleaseHold>(a[0]).transfer_id, kTid);
  EXPECT_EQ(As<Respond>(a[1]).status, 502);
}

TEST(PdFlowRead, EmptyDecode200IsNeverPassedOn) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, "");
  ASSERT_EQ(a.size(), 2u);
  As<ReleaseHold>(a[0]);
  EXPECT_EQ(As<Respond>(a[1]).status, 502);
  EXPECT_EQ(h.flow.outcome(), Outcome::kDecodeError);
}

TEST(PdFlowRead, ClientDisconnectDuringPrefillCancelsAndReleases) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int pleg = As<SendLeg>(a[0]).leg_id;
  a = h.flow.OnClientDisconnect(3);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, pleg);
  EXPECT_EQ(As<ReleaseHold>(a[1]).transfer_id, kTid);
  EXPECT_EQ(h.flow.outcome(), Outcome::kClientDisconnected);
  EXPECT_TRUE(h.flow.done());
  // A late answer from the cancelled leg changes nothing.
  EXPECT_TRUE(h.Answer(pleg, 200, PrefillAnswer()).empty());
}

TEST(PdFlowRead, ClientDisconnectMidStreamCancelsDecodeAndReleases) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", R"({"prompt":"x","stream":true})"}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  int dleg = As<SendLeg>(a[0]).leg_id;
  h.flow.OnLegStatus(dleg, 200, "text/event-stream", 4);
  h.flow.OnLegData(dleg, "data: 1\n\n", 5);
  a = h.flow.OnClientDisconnect(6);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, dleg);
  EXPECT_EQ(As<ReleaseHold>(a[1]).prefill.id, "p1");
  EXPECT_TRUE(h.flow.OnLegData(dleg, "data: 2\n\n", 7).empty());
  EXPECT_TRUE(h.flow.OnClientDisconnect(8).empty());  // once
}

TEST(PdFlowRead, DecodeBreaksMidStreamEndsWithErrorEventAndReleases) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", R"({"prompt":"x","stream":true})"}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  int dleg = As<SendLeg>(a[0]).leg_id;
  h.flow.OnLegStatus(dleg, 200, "text/event-stream", 4);
  EXPECT_EQ(h.flow.OnLegData(dleg, "data: 1\n\n", 5).size(), 2u);  // StartStream, the chunk
  a = h.flow.OnLegError(dleg, LegFailure::kBroken, InternalError("eof"), 6);
  ASSERT_EQ(a.size(), 3u);
  As<ReleaseHold>(a[0]);
  EXPECT_EQ(As<StreamChunk>(a[1]).data.rfind("data: {\"error\"", 0), 0u);
  As<EndStream>(a[2]);
  EXPECT_EQ(h.flow.outcome(), Outcome::kDecodeError);
}

TEST(PdFlowRead, DecodeBreaksBeforeItsFirstByteIsAWhole502) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", R"({"prompt":"x","stream":true})"}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  int dleg = As<SendLeg>(a[0]).leg_id;
  EXPECT_TRUE(h.flow.OnLegStatus(dleg, 200, "text/event-stream", 4).empty());
  a = h.flow.OnLegError(dleg, LegFailure::kBroken, InternalError("eof"), 5);
  ASSERT_EQ(a.size(), 2u);
  As<ReleaseHold>(a[0]);
  EXPECT_EQ(As<Respond>(a[1]).status, 502);
}

TEST(PdFlowRead, EmptyStreamStillStartsAndEnds) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", R"({"prompt":"x","stream":true})"}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  int dleg = As<SendLeg>(a[0]).leg_id;
  h.flow.OnLegStatus(dleg, 200, "", 4);
  a = h.flow.OnLegDone(dleg, 5);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<StartStream>(a[0]).content_type, "text/event-stream");
  As<EndStream>(a[1]);
  EXPECT_EQ(h.flow.outcome(), Outcome::kOk);
}

TEST(PdFlowRead, PrefillRefusal503GoesToAnotherPrefill) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  const SendLeg first = As<SendLeg>(a[0]);
  // A draining (or full) engine answers 503 at admission: it holds nothing, so no release.
  a = h.flow.OnLegStatus(first.leg_id, 503, "application/json", 1);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, first.leg_id);
  const SendLeg retry = As<SendLeg>(a[1]);
  EXPECT_EQ(retry.instance.id, "p2");
  EXPECT_EQ(retry.body, first.body);  // same transfer_id: p1 admitted nothing
  EXPECT_TRUE(h.flow.OnLegData(first.leg_id, "busy", 2).empty());
  a = h.Answer(retry.leg_id, 200, PrefillAnswer());
  ASSERT_EQ(a.size(), 1u);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, "{}");
  EXPECT_EQ(As<Respond>(a[0]).status, 200);
  EXPECT_EQ(h.flow.outcome(), Outcome::kOk);
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowRead, DecodeRefusal503GoesToAnotherDecodeThenIsForwarded) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  const SendLeg d1 = As<SendLeg>(a[0]);
  a = h.flow.OnLegStatus(d1.leg_id, 503, "application/json", 10);
  ASSERT_EQ(a.size(), 2u);  // the hold stays for the next decode: no release
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, d1.leg_id);
  const SendLeg d2 = As<SendLeg>(a[1]);
  EXPECT_EQ(d2.instance.id, "d2");
  EXPECT_EQ(d2.body, d1.body);
  // d2 refuses too and no decode is left: released at its status line, its answer forwarded.
  a = h.flow.OnLegStatus(d2.leg_id, 503, "application/json", 11);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<ReleaseHold>(a[0]).transfer_id, kTid);
  EXPECT_TRUE(h.flow.OnLegData(d2.leg_id, R"({"error":"full"})", 12).empty());
  a = h.flow.OnLegDone(d2.leg_id, 13);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).status, 503);
  EXPECT_EQ(As<Respond>(a[0]).body, R"({"error":"full"})");
  EXPECT_EQ(h.flow.outcome(), Outcome::kDecodeError);
}

TEST(PdFlowRead, ClientTimeoutShorterThanTheProxysBoundsTheRequest) {
  FlowOptions o;
  o.timeout = 1000;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody, /*timeout=*/250}, 50);
  EXPECT_EQ(h.flow.deadline(), std::optional<TimePoint>(300));
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  const int dleg = As<SendLeg>(a[0]).leg_id;
  a = h.flow.OnTick(300);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, dleg);
  EXPECT_EQ(As<ReleaseHold>(a[1]).transfer_id, kTid);
  EXPECT_EQ(As<Respond>(a[2]).status, 504);
  EXPECT_EQ(h.flow.outcome(), Outcome::kTimeout);
  // A longer client timeout does not extend the proxy's; none at all leaves it.
  Harness l(o);
  l.flow.OnClientRequest({"/v1/completions", kClientBody, 5000}, 0);
  EXPECT_EQ(l.flow.deadline(), std::optional<TimePoint>(1000));
  Harness c;  // no proxy bound: the client's alone
  c.flow.OnClientRequest({"/v1/completions", kClientBody, 70}, 5);
  EXPECT_EQ(c.flow.deadline(), std::optional<TimePoint>(75));
}

// Issue 21: a rolling restart of the only prefill. With instance_wait the request waits for an
// instance (picking again every instance_poll, on OnTick) instead of a 503 at once.
TEST(PdFlowRead, NoPrefillWaitsForOneWithinInstanceWait) {
  FlowOptions o;
  o.instance_wait = 1000;
  o.instance_poll = 100;
  std::vector<Endpoint> prefills;  // none yet; the picker sees the list as it is now
  InstancePicker picker =
      [&prefills](Role role, const std::vector<std::string>& exclude) -> std::optional<Endpoint> {
    if (role == Role::kDecode) return Ep("d1");
    for (const Endpoint& e : prefills) {
      if (std::find(exclude.begin(), exclude.end(), e.id) == exclude.end()) return e;
    }
    return std::nullopt;
  };
  PdFlow flow(o, kTid, picker);
  EXPECT_TRUE(flow.OnClientRequest({"/v1/completions", kClientBody}, 0).empty());
  EXPECT_EQ(flow.deadline(), std::optional<TimePoint>(100));
  EXPECT_TRUE(flow.OnTick(100).empty());  // still none
  EXPECT_EQ(flow.deadline(), std::optional<TimePoint>(200));
  prefills.push_back(Ep("p1"));  // back from its restart
  auto a = flow.OnTick(200);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<SendLeg>(a[0]).instance.id, "p1");
  EXPECT_FALSE(flow.deadline().has_value());
  EXPECT_FALSE(flow.done());

  // Nobody comes back: 503 once instance_wait has passed, nothing to release.
  PdFlow lonely(o, kTid, ListPicker({}, {Ep("d1")}));
  EXPECT_TRUE(lonely.OnClientRequest({"/v1/completions", kClientBody}, 0).empty());
  for (TimePoint t = 100; t < 1000; t += 100) EXPECT_TRUE(lonely.OnTick(t).empty()) << t;
  a = lonely.OnTick(1000);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).status, 503);
  EXPECT_EQ(lonely.outcome(), Outcome::kNoInstance);
  EXPECT_TRUE(lonely.done());
}

TEST(PdFlowRead, NoDecodeAfterThePrefillWaitsKeepingTheHold) {
  FlowOptions o;
  o.instance_wait = 500;
  o.instance_poll = 100;
  std::vector<Endpoint> decodes;
  InstancePicker picker = [&decodes](Role role,
                                     const std::vector<std::string>&) -> std::optional<Endpoint> {
    if (role == Role::kPrefill) return Ep("p1");
    if (decodes.empty()) return std::nullopt;
    return decodes.front();
  };
  PdFlow flow(o, kTid, picker);
  auto a = flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  const int pleg = As<SendLeg>(a[0]).leg_id;
  EXPECT_TRUE(flow.OnLegStatus(pleg, 200, "application/json", 1).empty());
  EXPECT_TRUE(flow.OnLegData(pleg, PrefillAnswer(), 2).empty());
  EXPECT_TRUE(flow.OnLegDone(pleg, 3).empty());  // no decode: no release, it waits
  EXPECT_EQ(flow.deadline(), std::optional<TimePoint>(103));
  decodes.push_back(Ep("d2"));
  a = flow.OnTick(103);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<SendLeg>(a[0]).instance.id, "d2");
  EXPECT_EQ(json::parse(As<SendLeg>(a[0]).body)["kv_transfer_params"]["transfer_id"], kTid);
  // A client that leaves while the flow waits gets its hold released.
  PdFlow gone(o, kTid, ListPicker({Ep("p1")}, {}));
  a = gone.OnClientRequest({"/v1/completions", kClientBody}, 0);
  const int g = As<SendLeg>(a[0]).leg_id;
  gone.OnLegStatus(g, 200, "application/json", 1);
  gone.OnLegData(g, PrefillAnswer(), 2);
  EXPECT_TRUE(gone.OnLegDone(g, 3).empty());
  a = gone.OnClientDisconnect(50);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<ReleaseHold>(a[0]).transfer_id, kTid);
  EXPECT_TRUE(gone.done());
}

TEST(ParseRequestTimeout, SecondsAsADecimal) {
  EXPECT_EQ(*ParseRequestTimeout("2.5"), 2'500'000);
  EXPECT_EQ(*ParseRequestTimeout(" 30 "), 30 * kSecond);
  EXPECT_EQ(*ParseRequestTimeout("0.000001"), 1);
  EXPECT_EQ(*ParseRequestTimeout("86400"), 86400 * kSecond);
  for (const char* bad :
       {"", "0", "0.0", "-1", "1e3", "inf", "nan", "1.2.3", "5s", "86400.5", ".", "+3"}) {
    auto r = ParseRequestTimeout(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    }
  }
}

TEST(PdFlowRead, NoReleaseAfterSuccessEvenOnDisconnect) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 200, "{}");
  EXPECT_EQ(h.flow.outcome(), Outcome::kOk);
  EXPECT_TRUE(h.flow.OnClientDisconnect(20).empty());
}

TEST(PdFlowRead, TimeoutCancelsReleasesAnd504) {
  FlowOptions o;
  o.timeout = 100;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int pleg = As<SendLeg>(a[0]).leg_id;
  EXPECT_EQ(h.flow.deadline(), std::optional<TimePoint>(100));
  EXPECT_TRUE(h.flow.OnTick(99).empty());
  a = h.flow.OnTick(100);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, pleg);
  As<ReleaseHold>(a[1]);
  EXPECT_EQ(As<Respond>(a[2]).status, 504);
  EXPECT_EQ(h.flow.outcome(), Outcome::kTimeout);
  EXPECT_FALSE(h.flow.deadline().has_value());
}

TEST(PdFlowRead, NullStreamMeansNotStreaming) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", R"({"prompt":"x","stream":null})"}, 0);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<SendLeg>(a[0]).role, Role::kPrefill);
  EXPECT_FALSE(h.flow.client_stream());
}

TEST(PdFlowRead, BadBodiesAre400) {
  for (const char* body :
       {"not json", "[1,2]", R"({"stream":"yes"})", R"({"prompt":"a","n":0})",
        R"({"prompt":"a","n":2.5})", R"({"prompt":"a","max_tokens":-1})",
        R"({"prompt":"a","max_tokens":0})", R"({"prompt":"a","max_tokens":"9"})",
        R"({"messages":[],"max_completion_tokens":0})", R"({"prompt":"a","min_tokens":-2})"}) {
    Harness h;
    auto a = h.flow.OnClientRequest({"/v1/completions", body}, 0);
    ASSERT_EQ(a.size(), 1u) << body;
    EXPECT_EQ(As<Respond>(a[0]).status, 400) << body;
    EXPECT_EQ(h.flow.outcome(), Outcome::kBadRequest);
  }
}

// n, max_tokens and min_tokens never reach a prefill engine as the client sent them, so the proxy
// refuses bad ones before any leg: no prompt is prefilled or held for a request the decode refuses.
TEST(PdFlowRead, FieldsThePrefillLegOverridesAreCheckedBeforeAnyLeg) {
  struct Case {
    const char* body;
    const char* message;
  };
  for (const Case& c :
       {Case{R"({"prompt":"a","n":0})", "'n' must be an integer >= 1"},
        Case{R"({"prompt":"a","max_tokens":-1})", "'max_tokens' must be an integer >= 1"},
        Case{R"({"prompt":"a","min_tokens":1.5})", "'min_tokens' must be an integer >= 0"},
        Case{R"({"prompt":"a",)", "the request body is not valid JSON"}}) {
    Harness h;
    auto a = h.flow.OnClientRequest({"/v1/completions", c.body}, 0);
    ASSERT_EQ(a.size(), 1u) << c.body;
    const auto& r = As<Respond>(a[0]);
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(json::parse(r.body)["error"]["message"], c.message) << c.body;
    EXPECT_EQ(h.flow.outcome(), Outcome::kBadRequest);
  }
  for (const char* ok : {R"({"prompt":"a","n":null,"max_tokens":null})",
                         R"({"prompt":"a","n":3,"max_tokens":1,"min_tokens":0})"}) {
    Harness h;
    auto a = h.flow.OnClientRequest({"/v1/completions", ok}, 0);
    ASSERT_EQ(a.size(), 1u) << ok;
    EXPECT_EQ(As<SendLeg>(a[0]).role, Role::kPrefill) << ok;
  }
}

TEST(PdFlowRead, UnknownLegEventsAreIgnored) {
  Harness h;
  h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  EXPECT_TRUE(h.flow.OnLegStatus(42, 200, "", 1).empty());
  EXPECT_TRUE(h.flow.OnLegData(42, "x", 1).empty());
  EXPECT_TRUE(h.flow.OnLegDone(42, 1).empty());
  EXPECT_TRUE(h.flow.OnLegError(42, LegFailure::kBroken, InternalError("x"), 1).empty());
  EXPECT_FALSE(h.flow.done());
}

TEST(PdFlowRead, DoneWithoutStatusIsBrokenLeg) {
  Harness h;
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.flow.OnLegDone(As<SendLeg>(a[0]).leg_id, 1);
  ASSERT_EQ(a.size(), 2u);
  As<ReleaseHold>(a[0]);
  EXPECT_EQ(As<Respond>(a[1]).status, 502);
}

TEST(PdFlowWrite, BothLegsTogetherDecodeNamesPrefill) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  ASSERT_EQ(a.size(), 2u);
  const SendLeg d = As<SendLeg>(a[0]);
  const SendLeg p = As<SendLeg>(a[1]);
  EXPECT_EQ(d.role, Role::kDecode);
  EXPECT_EQ(p.role, Role::kPrefill);
  json db = json::parse(d.body);
  json expected = {{"do_remote_prefill", true},
                   {"transfer_id", kTid},
                   {"mode", "write"},
                   {"remote_engine_id", "engine-p1"},
                   {"remote_host", "10.0.0.1"},
                   {"remote_port", 7000},
                   {"tp_size", 1}};
  EXPECT_EQ(db["kv_transfer_params"], expected);
  EXPECT_EQ(db["n"], 8);
  json pb = json::parse(p.body);
  EXPECT_EQ(pb["kv_transfer_params"],
            json({{"do_remote_decode", true}, {"transfer_id", kTid}, {"mode", "write"}}));
  EXPECT_EQ(pb["max_tokens"], 1);
  // Prefill answers first, then the decode: the decode's answer goes to the client.
  EXPECT_TRUE(h.Answer(p.leg_id, 200, "{}").empty());
  a = h.Answer(d.leg_id, 200, R"({"ok":1})");
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).body, R"({"ok":1})");
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowWrite, DecodeLegNamesThePickedPrefillsTpSize) {
  // The decode leg is built before the prefill answers, so the prefill's TP comes from its
  // registration (Endpoint::tp_size); a decode retried after an unreachable one names it too.
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Endpoint p1 = Ep("p1");
  p1.tp_size = 2;
  Endpoint p2 = Ep("p2");
  p2.tp_size = 4;
  Harness h(o, {p1, p2});
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  ASSERT_EQ(a.size(), 2u);
  const SendLeg d = As<SendLeg>(a[0]);
  EXPECT_EQ(As<SendLeg>(a[1]).instance.id, "p1");
  json expected = {{"do_remote_prefill", true},
                   {"transfer_id", kTid},
                   {"mode", "write"},
                   {"remote_engine_id", "engine-p1"},
                   {"remote_host", "10.0.0.1"},
                   {"remote_port", 7000},
                   {"tp_size", 2}};
  EXPECT_EQ(json::parse(d.body)["kv_transfer_params"], expected);
  a = h.flow.OnLegError(d.leg_id, LegFailure::kUnreachable, UnavailableError("refused"), 1);
  ASSERT_EQ(a.size(), 1u);
  const SendLeg retry = As<SendLeg>(a[0]);
  EXPECT_EQ(retry.instance.id, "d2");
  EXPECT_EQ(json::parse(retry.body)["kv_transfer_params"], expected);

  // Another flow picks p2 first (p1 excluded by the picker): tp_size 4.
  PdFlow f2(o, kTid, ListPicker({p2}, {Ep("d1")}));
  a = f2.OnClientRequest({"/v1/completions", kClientBody}, 0);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(json::parse(As<SendLeg>(a[0]).body)["kv_transfer_params"]["tp_size"], 4);
  // READ mode never invents a tp_size: it forwards the prefill's answer (tp_size 1 there).
  Harness r({}, {p1});
  a = r.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = r.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(json::parse(As<SendLeg>(a[0]).body)["kv_transfer_params"]["tp_size"], 1);
}

TEST(PdFlowWrite, DecodeSucceedsBeforePrefillLegEnds) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int dleg = As<SendLeg>(a[0]).leg_id, pleg = As<SendLeg>(a[1]).leg_id;
  a = h.Answer(dleg, 200, "{}");
  EXPECT_EQ(As<Respond>(a[0]).status, 200);
  EXPECT_TRUE(h.flow.client_done());
  EXPECT_FALSE(h.flow.done());  // the prefill leg is still open
  EXPECT_TRUE(h.Answer(pleg, 200, "{}").empty());
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowWrite, PrefillErrorCancelsDecodeAndIsForwarded) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int dleg = As<SendLeg>(a[0]).leg_id, pleg = As<SendLeg>(a[1]).leg_id;
  a = h.Answer(pleg, 400, "too long");
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, dleg);
  EXPECT_EQ(As<Respond>(a[1]).status, 400);
  EXPECT_EQ(As<Respond>(a[1]).body, "too long");
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowWrite, DecodeErrorReleasesPrefill) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int dleg = As<SendLeg>(a[0]).leg_id;
  a = h.Answer(dleg, 500, "boom");
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<ReleaseHold>(a[0]).prefill.id, "p1");
  EXPECT_EQ(As<Respond>(a[1]).status, 500);
}

TEST(PdFlowWrite, DecodeRefusal503GoesToAnotherDecodeNamingTheSamePrefill) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  const SendLeg d1 = As<SendLeg>(a[0]);
  const int pleg = As<SendLeg>(a[1]).leg_id;
  a = h.flow.OnLegStatus(d1.leg_id, 503, "application/json", 1);
  ASSERT_EQ(a.size(), 2u);  // the prefill leg goes on: the next decode offers its blocks
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, d1.leg_id);
  const SendLeg d2 = As<SendLeg>(a[1]);
  EXPECT_EQ(d2.instance.id, "d2");
  EXPECT_EQ(d2.body, d1.body);
  EXPECT_TRUE(h.Answer(pleg, 200, "{}").empty());
  a = h.Answer(d2.leg_id, 200, R"({"ok":1})");
  EXPECT_EQ(As<Respond>(a[0]).body, R"({"ok":1})");
  EXPECT_TRUE(h.flow.done());
}

// Issue 21: WRITE fails over like READ. The decode leg names its prefill, so a failed prefill
// takes the pair with it: the decode leg is cancelled at once and the pair goes again, to another
// prefill, with a fresh transfer_id.
TEST(PdFlowWrite, PrefillUnreachableRetriesThePairWithAFreshTransferId) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  int minted = 0;
  o.mint_transfer_id = [&minted] { return "fresh" + std::to_string(++minted); };
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int dleg = As<SendLeg>(a[0]).leg_id, pleg = As<SendLeg>(a[1]).leg_id;
  a = h.flow.OnLegError(pleg, LegFailure::kUnreachable, UnavailableError("refused"), 1);
  ASSERT_EQ(a.size(), 3u);  // nothing reached p1: nothing to release there
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, dleg);
  const SendLeg d = As<SendLeg>(a[1]);
  const SendLeg p = As<SendLeg>(a[2]);
  EXPECT_EQ(d.instance.id, "d1");  // the decode was not at fault
  EXPECT_EQ(p.instance.id, "p2");
  json expected = {{"do_remote_prefill", true},
                   {"transfer_id", "fresh1"},
                   {"mode", "write"},
                   {"remote_engine_id", "engine-p2"},
                   {"remote_host", "10.0.0.1"},
                   {"remote_port", 7000},
                   {"tp_size", 1}};
  EXPECT_EQ(json::parse(d.body)["kv_transfer_params"], expected);
  EXPECT_EQ(json::parse(p.body)["kv_transfer_params"],
            json({{"do_remote_decode", true}, {"transfer_id", "fresh1"}, {"mode", "write"}}));
  EXPECT_EQ(json::parse(p.body)["max_tokens"], 1);
  EXPECT_EQ(h.flow.transfer_id(), "fresh1");
  EXPECT_EQ(h.flow.pair_attempts(), 2);
  // Late events of the first pair change nothing.
  EXPECT_TRUE(h.Answer(dleg, 200, R"({"old":1})").empty());
  EXPECT_TRUE(h.Answer(p.leg_id, 200, "{}").empty());
  a = h.Answer(d.leg_id, 200, R"({"ok":1})");
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).body, R"({"ok":1})");
  EXPECT_EQ(h.flow.outcome(), Outcome::kOk);
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowWrite, PrefillBrokenAfterDecodeStartedCancelsReleasesAndRetries) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", R"({"prompt":"x","stream":true})"}, 0);
  int dleg = As<SendLeg>(a[0]).leg_id, pleg = As<SendLeg>(a[1]).leg_id;
  // The decode admitted the request (its SSE status line came) but sent no byte yet.
  EXPECT_TRUE(h.flow.OnLegStatus(dleg, 200, "text/event-stream", 1).empty());
  a = h.flow.OnLegError(pleg, LegFailure::kBroken, UnavailableError("reset"), 2);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, dleg);
  const ReleaseHold& rel = As<ReleaseHold>(a[1]);  // p1 may hold KV for the first transfer
  EXPECT_EQ(rel.prefill.id, "p1");
  EXPECT_EQ(rel.transfer_id, kTid);
  const SendLeg d = As<SendLeg>(a[2]);
  const SendLeg p = As<SendLeg>(a[3]);
  const std::string fresh = std::string(kTid) + "-2";  // no minter: deterministic
  EXPECT_EQ(json::parse(d.body)["kv_transfer_params"]["transfer_id"], fresh);
  EXPECT_EQ(json::parse(d.body)["kv_transfer_params"]["remote_engine_id"], "engine-p2");
  EXPECT_EQ(json::parse(p.body)["kv_transfer_params"]["transfer_id"], fresh);
  EXPECT_TRUE(d.stream);
  h.flow.OnLegStatus(d.leg_id, 200, "text/event-stream", 3);
  a = h.flow.OnLegData(d.leg_id, "data: 1\n\n", 4);
  ASSERT_EQ(a.size(), 2u);
  As<StartStream>(a[0]);
  // p2 breaks after the client got bytes: no retry; the stream ends with the error, the new
  // transfer is released at p2.
  a = h.flow.OnLegError(p.leg_id, LegFailure::kBroken, UnavailableError("reset"), 5);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, d.leg_id);
  EXPECT_EQ(As<ReleaseHold>(a[1]).transfer_id, fresh);
  EXPECT_EQ(As<ReleaseHold>(a[1]).prefill.id, "p2");
  EXPECT_EQ(As<StreamChunk>(a[2]).data.rfind("data: {\"error\"", 0), 0u);
  As<EndStream>(a[3]);
  EXPECT_EQ(h.flow.outcome(), Outcome::kPrefillError);
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowWrite, PrefillRefusal503RetriesThePairWithoutRelease) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int dleg = As<SendLeg>(a[0]).leg_id, pleg = As<SendLeg>(a[1]).leg_id;
  a = h.flow.OnLegStatus(pleg, 503, "application/json", 1);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, dleg);
  EXPECT_EQ(As<CancelLeg>(a[1]).leg_id, pleg);
  EXPECT_EQ(As<SendLeg>(a[2]).role, Role::kDecode);
  EXPECT_EQ(As<SendLeg>(a[3]).instance.id, "p2");
}

TEST(PdFlowWrite, PairRetriesAreBoundedThenTheFailingLegsAnswerGoesToTheClient) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  o.max_attempts = 2;
  Harness h(o, {Ep("p1"), Ep("p2"), Ep("p3")}, {Ep("d1")});
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[1]).leg_id, 500, R"({"error":"boom1"})");
  ASSERT_EQ(a.size(), 4u);  // cancel d, release at p1, the new pair
  As<ReleaseHold>(a[1]);
  const SendLeg d = As<SendLeg>(a[2]);
  EXPECT_EQ(d.instance.id, "d1");
  a = h.Answer(As<SendLeg>(a[3]).leg_id, 500, R"({"error":"boom2"})");
  ASSERT_EQ(a.size(), 3u);  // second pair of two: no third
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, d.leg_id);
  EXPECT_EQ(As<ReleaseHold>(a[1]).prefill.id, "p2");
  EXPECT_EQ(As<Respond>(a[2]).status, 500);
  EXPECT_EQ(As<Respond>(a[2]).body, R"({"error":"boom2"})");
  EXPECT_EQ(h.flow.outcome(), Outcome::kPrefillError);
  EXPECT_EQ(h.flow.pair_attempts(), 2);
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowWrite, PrefillUnreachableWithNoOtherPrefillIs502) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Harness h(o, {Ep("p1")});
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  int dleg = As<SendLeg>(a[0]).leg_id, pleg = As<SendLeg>(a[1]).leg_id;
  a = h.flow.OnLegError(pleg, LegFailure::kUnreachable, UnavailableError("refused"), 1);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(As<CancelLeg>(a[0]).leg_id, dleg);
  EXPECT_EQ(As<Respond>(a[1]).status, 502);
  EXPECT_EQ(h.flow.outcome(), Outcome::kUnreachable);
}

TEST(PdFlowWrite, ClientDisconnectCancelsBothAndReleases) {
  FlowOptions o;
  o.mode = KvTransferMode::kWrite;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.flow.OnClientDisconnect(1);
  ASSERT_EQ(a.size(), 3u);
  As<CancelLeg>(a[0]);
  As<CancelLeg>(a[1]);
  EXPECT_EQ(As<ReleaseHold>(a[2]).transfer_id, kTid);
  EXPECT_TRUE(h.flow.done());
}

TEST(PdFlowColocated, OneWholeLegToADecodeInstanceNothingToRelease) {
  FlowOptions o;
  o.colocated = true;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  ASSERT_EQ(a.size(), 1u);
  const SendLeg& leg = As<SendLeg>(a[0]);
  EXPECT_EQ(leg.role, Role::kDecode);
  EXPECT_EQ(leg.instance.id, "d1");
  json want = json::parse(kClientBody);
  want.erase("kv_transfer_params");
  EXPECT_EQ(json::parse(leg.body), want);  // the client's body as is, minus its kv params
  a = h.Answer(leg.leg_id, 200, R"({"choices":[{"text":"hi"}]})");
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).body, R"({"choices":[{"text":"hi"}]})");
  EXPECT_TRUE(h.flow.done());
  EXPECT_EQ(h.flow.outcome(), Outcome::kOk);
}

TEST(PdFlowColocated, ErrorForwardedWithoutRelease) {
  FlowOptions o;
  o.colocated = true;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.Answer(As<SendLeg>(a[0]).leg_id, 400, R"({"error":"bad"})");
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).status, 400);
  EXPECT_EQ(As<Respond>(a[0]).body, R"({"error":"bad"})");
  EXPECT_EQ(h.flow.outcome(), Outcome::kDecodeError);
}

TEST(PdFlowColocated, UnreachableRetriedOnAnotherThenNoInstanceIs503) {
  FlowOptions o;
  o.colocated = true;
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  a = h.flow.OnLegError(As<SendLeg>(a[0]).leg_id, LegFailure::kUnreachable,
                        UnavailableError("refused"), 1);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<SendLeg>(a[0]).instance.id, "d2");
  Harness none(o, {Ep("p1")}, {});
  a = none.flow.OnClientRequest({"/v1/completions", kClientBody}, 0);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<Respond>(a[0]).status, 503);
}

TEST(ShapePrefillBody, RejectsNonObjects) {
  EXPECT_FALSE(ShapePrefillBody("[]", false, "{}").ok());
  EXPECT_FALSE(ShapePrefillBody("{}", false, "[]").ok());
  auto r = ShapePrefillBody(R"({"max_completion_tokens":9,"best_of":3,"echo":true})", false,
                            R"({"a":1})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(json::parse(*r), json::parse(R"({"max_tokens":1,"stream":false,"n":1,)"
                                         R"("kv_transfer_params":{"a":1}})"));
}

TEST(MintTransferId, Is32HexAndUnique) {
  std::string a = MintTransferId(), b = MintTransferId();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a, b);
}

TEST(PdFlowColocated, ClientBodyGoesAsSentUnlessItHadKvParams) {
  FlowOptions o;
  o.colocated = true;
  // No kv_transfer_params: the client's text as it came (spacing, key order), not re-serialized.
  const std::string raw = R"({ "prompt": "hi",  "model":"m" ,"max_tokens":2})";
  Harness h(o);
  auto a = h.flow.OnClientRequest({"/v1/completions", raw}, 0);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<SendLeg>(a[0]).body, raw);
  // With kv_transfer_params, or text the splice could not extend (trailing space), re-serialized.
  for (const std::string& body : {std::string(R"({"prompt":"hi","kv_transfer_params":{"x":1}})"),
                                  std::string(R"({"prompt":"hi"} )")}) {
    Harness h2(o);
    a = h2.flow.OnClientRequest({"/v1/completions", body}, 0);
    ASSERT_EQ(a.size(), 1u);
    EXPECT_EQ(As<SendLeg>(a[0]).body, R"({"prompt":"hi"})") << body;
  }
  // READ mode: the decode leg splices the prefill's params into the client's own text.
  Harness h3;
  a = h3.flow.OnClientRequest({"/v1/completions", raw}, 0);
  ASSERT_EQ(a.size(), 1u);
  a = h3.Answer(As<SendLeg>(a[0]).leg_id, 200, PrefillAnswer());
  ASSERT_EQ(a.size(), 1u);
  const std::string& d = As<SendLeg>(a[0]).body;
  ASSERT_EQ(d.rfind(raw.substr(0, raw.size() - 1) + ",\"kv_transfer_params\":{", 0), 0u) << d;
  EXPECT_EQ(json::parse(d)["kv_transfer_params"]["remote_block_ids"], json({1, 2, 3}));
}

}  // namespace
}  // namespace kvbridge::proxy
