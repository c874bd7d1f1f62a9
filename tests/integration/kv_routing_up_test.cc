// KV-aware routing end to end with real engines: `kvbridge up 2p2d --routing kv-aware
// --pd-skip-threshold 16` on the tiny model (prefix caching on). A conversation's second turn goes
// to the prefill and the decode that served its first turn — asserted from the engines' own
// counters: only that prefill computes, and exactly the tokens past its cached blocks; only that
// decode serves it, from its prefix cache — and a request its decode already holds (all but <= 16
// tokens) skips the prefill leg with answers (text and logprobs) bitwise those of the P/D path.
// Skips, saying why, while `kvbridge up` or the P/D engine is not built.
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "kvbridge/common/metrics.h"
#include "support/up_harness.h"

namespace kvbridge {
namespace {

using nlohmann::json;
using testing::KvbridgeBin;

using testing::PortOf;

std::string Get(int port, const std::string& path) {
  return testing::GetBody("http://127.0.0.1:" + std::to_string(port), path);
}

json Complete(int port, const json& body) {
  json r = testing::PostJson(port, "/v1/completions", body);
  if (r["_status"] != 200) return json{{"error", r.dump()}};
  return r;
}

// Every engine's counters, by role and url.
struct Snapshot {
  std::map<std::string, double> computed, prompt, hits;  // url → counter
};

Snapshot Read(const json& instances) {
  Snapshot s;
  for (const auto& i : instances) {
    const std::string url = i["url"];
    const std::string m = Get(PortOf(url), "/metrics");
    s.computed[url] = ScrapeMetric(m, "kvbridge_prompt_tokens_computed_total");
    s.prompt[url] = ScrapeMetric(m, "kvbridge_prompt_tokens_total");
    s.hits[url] = ScrapeMetric(m, "kvbridge_prefix_cache_hits_total");
  }
  return s;
}

// The one url whose counter moved between `a` and `b` (empty when none or several did).
std::string Moved(const std::map<std::string, double>& a, const std::map<std::string, double>& b,
                  const std::vector<std::string>& among) {
  std::string out;
  for (const std::string& u : among) {
    if (b.at(u) != a.at(u)) {
      if (!out.empty()) return "<several>";
      out = u;
    }
  }
  return out;
}

// Waits until the proxy's index stops growing (the engines' events of the last request are in).
void SettleIndex(int proxy_port) {
  double last = -1;
  for (int i = 0; i < 100; ++i) {
    double now = ScrapeMetric(Get(proxy_port, "/metrics"), "kvbridge_proxy_kv_index_entries");
    if (now > 0 && now == last) return;
    last = now;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

TEST(KvRoutingUp, SecondTurnGoesToTheFirstTurnsEnginesAndSkipIsBitwisePd) {
  const std::string bin = KvbridgeBin();
  if (::access(bin.c_str(), X_OK) != 0) GTEST_SKIP() << "kvbridge binary not built at " << bin;
  const std::string dir = testing::MakeTempDir("kvb-kvroute-");
  ASSERT_EQ(testing::MakeModel(dir + "/model", "tiny", 0, 300'000), 0);
  testing::UpTopology up(dir, {"2p2d", "--model", dir + "/model", "--routing", "kv-aware",
                               "--pd-skip-threshold", "16"});
  ASSERT_TRUE(up.WaitReady()) << up.ReadLog();
  const int port = up.port();
  json instances = json::parse(Get(port, "/instances"), nullptr, false)["instances"];
  std::vector<std::string> prefills, decodes;
  for (const auto& i : instances) (i["role"] == "prefill" ? prefills : decodes).push_back(i["url"]);
  ASSERT_EQ(prefills.size(), 2u);
  ASSERT_EQ(decodes.size(), 2u);

  // Two conversations' first turns, then each one's second turn.
  const std::vector<std::string> first = {
      "Conversation one: tell me about the rivers and the mountains of the north, please.",
      "Conversation two: a short poem about silver windows in the quiet morning light."};
  std::vector<std::string> second;
  std::vector<std::string> prefill_of, decode_of;
  std::vector<double> first_tokens;
  for (const std::string& q : first) {
    Snapshot a = Read(instances);
    json r = Complete(port, {{"prompt", q}, {"max_tokens", 12}, {"temperature", 0}});
    ASSERT_TRUE(r.contains("choices")) << r.dump();
    first_tokens.push_back(r["usage"]["prompt_tokens"].get<double>());
    SettleIndex(port);
    Snapshot b = Read(instances);
    prefill_of.push_back(Moved(a.computed, b.computed, prefills));
    decode_of.push_back(Moved(a.prompt, b.prompt, decodes));
    ASSERT_EQ(prefill_of.back().rfind("http", 0), 0u) << prefill_of.back();
    ASSERT_EQ(decode_of.back().rfind("http", 0), 0u) << decode_of.back();
    second.push_back(q + r["choices"][0]["text"].get<std::string>() +
                     " And now, in one more sentence, what would you add to that?");
  }
  for (size_t c = 0; c < second.size(); ++c) {
    Snapshot a = Read(instances);
    json r = Complete(port, {{"prompt", second[c]}, {"max_tokens", 12}, {"temperature", 0}});
    ASSERT_TRUE(r.contains("choices")) << r.dump();
    SettleIndex(port);
    Snapshot b = Read(instances);
    const double prompt_tokens = r["usage"]["prompt_tokens"].get<double>();
    const double cached = 16 * std::floor(first_tokens[c] / 16);  // turn 1's full blocks
    // Only turn 1's prefill computed, and only what lies past its cached full blocks.
    EXPECT_EQ(Moved(a.computed, b.computed, prefills), prefill_of[c]) << "conversation " << c;
    EXPECT_EQ(b.computed[prefill_of[c]] - a.computed[prefill_of[c]], prompt_tokens - cached)
        << "conversation " << c;
    // Turn 1's decode served it, finding turn 1's blocks in its own prefix cache.
    EXPECT_EQ(Moved(a.prompt, b.prompt, decodes), decode_of[c]) << "conversation " << c;
    EXPECT_GE(b.hits[decode_of[c]] - a.hits[decode_of[c]], cached) << "conversation " << c;
  }
  const std::string metrics = Get(port, "/metrics");
  EXPECT_EQ(ScrapeMetric(metrics, "kvbridge_proxy_kv_routes_total", "path=\"skip\""), 0.0);

  // The skip path answers bitwise as the P/D path: the same request twice, cold (P/D) then held
  // by its decode (all but <= 16 tokens: skipped).
  const json req = {{"prompt", "Bitwise check: the garden, the ocean and the careful machine."},
                    {"max_tokens", 10},
                    {"temperature", 0},
                    {"logprobs", 5}};
  const double skips = ScrapeMetric(metrics, "kvbridge_proxy_kv_routes_total", "path=\"skip\"");
  json pd = Complete(port, req);
  ASSERT_TRUE(pd.contains("choices")) << pd.dump();
  SettleIndex(port);
  json skip = Complete(port, req);
  ASSERT_TRUE(skip.contains("choices")) << skip.dump();
  EXPECT_EQ(ScrapeMetric(Get(port, "/metrics"), "kvbridge_proxy_kv_routes_total", "path=\"skip\""),
            skips + 1);
  EXPECT_EQ(skip["choices"][0]["text"], pd["choices"][0]["text"]);
  EXPECT_EQ(skip["choices"][0]["logprobs"].dump(), pd["choices"][0]["logprobs"].dump());
  EXPECT_EQ(up.Stop(), 0) << up.ReadLog();
}

// `up 2p2d --routing kv-aware --decode-kv-role kv_both`, skip off: a conversation's second turn
// (its prompt = the first turn's prompt + the answer's ids + a new question, as ids) is prefilled
// by the decode that generated the answer — it holds the prompt and the answer, more than the
// first turn's prefill — computing exactly the tokens past its cached full blocks (fewer than
// that prefill would: the answer's full blocks); no prefill computes; the other decode serves
// the decode leg (one engine is never both legs), computing only the last prompt token; and the
// answer (text and logprobs) is bitwise the one an engine serving it alone gives.
TEST(KvRoutingUp, KvBothDecodePrefillsTheNextTurnFromTheAnswerItGenerated) {
  const std::string bin = KvbridgeBin();
  if (::access(bin.c_str(), X_OK) != 0) GTEST_SKIP() << "kvbridge binary not built at " << bin;
  const std::string dir = testing::MakeTempDir("kvb-kvboth-");
  ASSERT_EQ(testing::MakeModel(dir + "/model", "tiny", 0, 300'000), 0);
  testing::UpTopology up(dir, {"2p2d", "--model", dir + "/model", "--routing", "kv-aware",
                               "--decode-kv-role", "kv_both"});
  ASSERT_TRUE(up.WaitReady()) << up.ReadLog();
  const int port = up.port();
  json instances = json::parse(Get(port, "/instances"), nullptr, false)["instances"];
  std::vector<std::string> prefills, decodes, all;
  for (const auto& i : instances) {
    (i["role"] == "prefill" ? prefills : decodes).push_back(i["url"]);
    all.push_back(i["url"]);
    EXPECT_EQ(i["kv_both"].get<bool>(), i["role"] == "decode") << i.dump();
  }
  ASSERT_EQ(prefills.size(), 2u);
  ASSERT_EQ(decodes.size(), 2u);

  std::vector<int32_t> turn1;
  for (int i = 0; i < 37; ++i) turn1.push_back(20 + (i * 7) % 150);
  const json gen_opts = {{"max_tokens", 40},
                         {"temperature", 0},
                         {"ignore_eos", true},
                         {"logprobs", 1},
                         {"return_tokens_as_token_ids", true}};
  json req1 = gen_opts;
  req1["prompt"] = turn1;
  Snapshot a = Read(instances);
  json r1 = Complete(port, req1);
  ASSERT_TRUE(r1.contains("choices")) << r1.dump();
  SettleIndex(port);
  Snapshot b = Read(instances);
  const std::string prefill1 = Moved(a.computed, b.computed, prefills);
  const std::string decode1 = Moved(a.prompt, b.prompt, decodes);
  ASSERT_EQ(prefill1.rfind("http", 0), 0u) << prefill1;
  ASSERT_EQ(decode1.rfind("http", 0), 0u) << decode1;
  std::vector<int32_t> answer;
  for (const auto& t : r1["choices"][0]["logprobs"]["tokens"]) {
    answer.push_back(std::stoi(t.get<std::string>().substr(9)));  // "token_id:N"
  }
  ASSERT_EQ(answer.size(), 40u);

  std::vector<int32_t> turn2 = turn1;
  turn2.insert(turn2.end(), answer.begin(), answer.end());
  for (int i = 0; i < 21; ++i) turn2.push_back(30 + (i * 11) % 120);
  json req2 = gen_opts;
  req2["prompt"] = turn2;
  json r2 = Complete(port, req2);
  ASSERT_TRUE(r2.contains("choices")) << r2.dump();
  SettleIndex(port);
  Snapshot c = Read(instances);
  const double n2 = static_cast<double>(turn2.size());
  // The decode computed turn 1's prompt's KV (read) and every answer token's but the last.
  const double decode_cached = 16 * std::floor((turn1.size() + answer.size() - 1) / 16.0);
  const double prefill_cached = 16 * std::floor(turn1.size() / 16.0);
  ASSERT_GT(decode_cached, prefill_cached);
  for (const std::string& p : prefills) EXPECT_EQ(c.computed[p], b.computed[p]) << p;
  EXPECT_EQ(c.computed[decode1] - b.computed[decode1], n2 - decode_cached);
  EXPECT_EQ(c.hits[decode1] - b.hits[decode1], decode_cached);
  const std::string decode2 = decode1 == decodes[0] ? decodes[1] : decodes[0];
  EXPECT_EQ(Moved(b.prompt, c.prompt, {decode2}), decode2);  // served the decode leg
  EXPECT_EQ(c.computed[decode2] - b.computed[decode2], 1.0);
  // In all, turn 2 computed the answer's full blocks fewer than turn 1's prefill would have.
  double total = 0;
  for (const std::string& u : all) total += c.computed[u] - b.computed[u];
  EXPECT_EQ(total, n2 - decode_cached + 1);
  EXPECT_LT(total, n2 - prefill_cached + 1);

  // Bitwise the answer of an engine serving the request alone (a prefill engine, no P/D).
  json alone = Complete(PortOf(prefills[0]), req2);
  ASSERT_TRUE(alone.contains("choices")) << alone.dump();
  EXPECT_EQ(r2["choices"][0]["text"], alone["choices"][0]["text"]);
  EXPECT_EQ(r2["choices"][0]["logprobs"].dump(), alone["choices"][0]["logprobs"].dump());
  const std::string pm = Get(port, "/metrics");
  EXPECT_EQ(ScrapeMetric(pm, "kvbridge_proxy_kv_routes_total", "path=\"skip\""), 0.0);
  // Fault-free: no lease fired, no load failed (no engine read from itself).
  for (const std::string& u : all) {
    const std::string m = Get(PortOf(u), "/metrics");
    EXPECT_EQ(ScrapeMetric(m, "kvbridge_kv_lease_expired_total"), 0.0) << u;
    EXPECT_LE(ScrapeMetric(m, "kvbridge_kv_load_failures_total"), 0.0) << u;
  }
  EXPECT_EQ(up.Stop(), 0) << up.ReadLog();
}

}  // namespace
}  // namespace kvbridge
