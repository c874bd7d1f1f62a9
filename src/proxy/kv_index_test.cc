#include "kvbridge/proxy/kv_index.h"

#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>

#include "kvbridge/proxy/kv_routing.h"

namespace kvbridge::proxy {
namespace {

constexpr int kBs = 4;
const BlockHash kRoot = RootBlockHash("model-fp");

// The chain of a prompt as the engines hash it.
std::vector<BlockHash> Chain(const std::vector<int32_t>& ids) {
  std::vector<BlockHash> hs;
  AppendBlockHashes(kRoot, ids, kBs, &hs);
  return hs;
}

std::vector<int32_t> Iota(int n, int start = 0) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

KvEventBatch Snapshot(const std::string& inc, uint64_t seq, std::vector<BlockHash> hashes) {
  KvEventBatch b;
  b.incarnation = inc;
  b.block_size = kBs;
  b.root = kRoot;
  b.head_seq = seq;
  b.next_since = seq;
  b.reset = true;
  b.snapshot = std::move(hashes);
  return b;
}

KvEventBatch Events(const std::string& inc, std::vector<KvEvent> events) {
  KvEventBatch b;
  b.incarnation = inc;
  b.block_size = kBs;
  b.root = kRoot;
  b.events = std::move(events);
  b.head_seq = b.events.empty() ? 0 : b.events.back().seq;
  b.next_since = b.head_seq;
  return b;
}

KvEvent Stored(uint64_t seq, const BlockHash& h) { return {seq, KvEventOp::kStored, h}; }
KvEvent Removed(uint64_t seq, const BlockHash& h) { return {seq, KvEventOp::kRemoved, h}; }

const std::vector<std::string> kAbc = {"a", "b", "c"};

TEST(KvIndex, SnapshotEventsAndPrefixLengths) {
  KvIndex index;
  std::vector<BlockHash> p = Chain(Iota(16));  // 4 blocks
  EXPECT_EQ(index.NextQuery("a", 2000), "since=0&timeout_ms=2000");
  ASSERT_TRUE(index.Apply("a", Snapshot("ia", 10, {p[0], p[1]})).ok());
  ASSERT_TRUE(index.Apply("b", Snapshot("ib", 0, {p[0]})).ok());
  EXPECT_EQ(index.NextQuery("a", 2000), "since=10&incarnation=ia&timeout_ms=2000");
  EXPECT_EQ(index.PrefixBlocks(p, kAbc), (std::vector<int>{2, 1, 0}));
  // a stores blocks 2 and 3; b stores block 2 but not 1: its prefix stops at 1.
  ASSERT_TRUE(index.Apply("a", Events("ia", {Stored(11, p[2]), Stored(12, p[3])})).ok());
  ASSERT_TRUE(index.Apply("b", Events("ib", {Stored(1, p[2])})).ok());
  EXPECT_EQ(index.PrefixBlocks(p, kAbc), (std::vector<int>{4, 1, 0}));
  // a evicts block 1: the chain breaks there even though 2 and 3 are still indexed.
  ASSERT_TRUE(index.Apply("a", Events("ia", {Removed(13, p[1])})).ok());
  EXPECT_EQ(index.PrefixBlocks(p, kAbc), (std::vector<int>{1, 1, 0}));
  EXPECT_EQ(index.num_blocks(), 3u);   // distinct: p0 p2 p3
  EXPECT_EQ(index.num_entries(), 5u);  // a: p0 p2 p3; b: p0 p2
  EXPECT_EQ(index.Engine("a")->next_since, 13u);
  EXPECT_EQ(index.Engine("a")->num_blocks, 3u);
  // Another prompt sharing only the first block.
  std::vector<int32_t> other = Iota(16);
  other[5] = 999;
  EXPECT_EQ(index.PrefixBlocks(Chain(other), kAbc), (std::vector<int>{1, 1, 0}));
  EXPECT_EQ(index.PrefixBlocks({}, kAbc), (std::vector<int>{0, 0, 0}));
}

TEST(KvIndex, DuplicateAndStaleEventsAreSkipped) {
  KvIndex index;
  std::vector<BlockHash> p = Chain(Iota(8));
  ASSERT_TRUE(index.Apply("a", Snapshot("i", 0, {})).ok());
  ASSERT_TRUE(index.Apply("a", Events("i", {Stored(1, p[0]), Stored(2, p[1])})).ok());
  // The same batch again (a retried poll), then an older one: nothing changes.
  ASSERT_TRUE(index.Apply("a", Events("i", {Stored(1, p[0]), Stored(2, p[1])})).ok());
  ASSERT_TRUE(index.Apply("a", Events("i", {Removed(2, p[1])})).ok());
  EXPECT_EQ(index.PrefixBlocks(p, kAbc)[0], 2);
  EXPECT_EQ(index.Engine("a")->next_since, 2u);
}

TEST(KvIndex, GapAsksForASnapshotWhichHeals) {
  KvIndex index;
  std::vector<BlockHash> p = Chain(Iota(12));
  ASSERT_TRUE(index.Apply("a", Snapshot("i", 5, {p[0]})).ok());
  Status s = index.Apply("a", Events("i", {Stored(7, p[1])}));  // 6 lost
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_EQ(index.Engine("a")->gaps, 1u);
  EXPECT_EQ(index.NextQuery("a", 0), "since=0&timeout_ms=0");  // asks for a snapshot
  EXPECT_EQ(index.PrefixBlocks(p, kAbc)[0], 0);                // not trusted until then
  // Events without a snapshot are refused while one is due.
  EXPECT_FALSE(index.Apply("a", Events("i", {Stored(8, p[2])})).ok());
  ASSERT_TRUE(index.Apply("a", Snapshot("i", 8, {p[0], p[1], p[2]})).ok());
  EXPECT_EQ(index.PrefixBlocks(p, kAbc)[0], 3);
  EXPECT_EQ(index.Engine("a")->resets, 2u);
}

TEST(KvIndex, IncarnationChangeDropsTheOldEntries) {
  KvIndex index;
  std::vector<BlockHash> p = Chain(Iota(12));
  ASSERT_TRUE(index.Apply("a", Snapshot("old", 3, {p[0], p[1], p[2]})).ok());
  ASSERT_TRUE(index.Apply("b", Snapshot("ib", 3, {p[0], p[1]})).ok());
  // Events of another incarnation without a reset: refused, snapshot due.
  EXPECT_FALSE(index.Apply("a", Events("new", {Stored(1, p[0])})).ok());
  // The restarted engine's snapshot (empty cache): a's entries vanish, b's stay.
  ASSERT_TRUE(index.Apply("a", Snapshot("new", 0, {})).ok());
  EXPECT_EQ(index.PrefixBlocks(p, kAbc), (std::vector<int>{0, 2, 0}));
  EXPECT_EQ(index.num_entries(), 2u);
  EXPECT_EQ(index.num_blocks(), 2u);
}

TEST(KvIndex, DroppedEngineLeavesNothing) {
  KvIndex index;
  std::vector<BlockHash> p = Chain(Iota(12));
  ASSERT_TRUE(index.Apply("a", Snapshot("i", 3, {p[0], p[1], p[2]})).ok());
  ASSERT_TRUE(index.Apply("b", Snapshot("j", 3, {p[0]})).ok());
  index.DropEngine("a");
  EXPECT_FALSE(index.Engine("a").has_value());
  EXPECT_EQ(index.num_blocks(), 1u);
  EXPECT_EQ(index.num_entries(), 1u);
  EXPECT_EQ(index.PrefixBlocks(p, kAbc), (std::vector<int>{0, 1, 0}));
  index.DropEngine("zzz");  // unknown: no-op
  // Its slot is reused by a new engine, with no leftover bits.
  ASSERT_TRUE(index.Apply("c", Snapshot("k", 0, {})).ok());
  EXPECT_EQ(index.PrefixBlocks(p, kAbc), (std::vector<int>{0, 1, 0}));
}

TEST(KvIndex, CapEvictsTheLeastRecentlyStored) {
  KvIndex index({.max_blocks = 3});
  std::vector<BlockHash> p = Chain(Iota(20));  // 5 blocks
  ASSERT_TRUE(index.Apply("a", Snapshot("i", 0, {})).ok());
  ASSERT_TRUE(index.Apply("b", Snapshot("j", 0, {})).ok());
  ASSERT_TRUE(
      index.Apply("a", Events("i", {Stored(1, p[0]), Stored(2, p[1]), Stored(3, p[2])})).ok());
  ASSERT_TRUE(index.Apply("b", Events("j", {Stored(1, p[0])})).ok());  // p0 most recent now
  ASSERT_TRUE(index.Apply("a", Events("i", {Stored(4, p[3]), Stored(5, p[4])})).ok());
  // p1 then p2 went (least recently stored); p0 (touched by b) stayed, for both engines.
  EXPECT_EQ(index.num_blocks(), 3u);
  EXPECT_EQ(index.evictions(), 2u);
  EXPECT_EQ(index.num_entries(), 4u);  // a: p0 p3 p4; b: p0
  EXPECT_EQ(index.PrefixBlocks(p, kAbc), (std::vector<int>{1, 1, 0}));
  EXPECT_EQ(index.Engine("a")->num_blocks, 3u);
}

TEST(KvIndex, AtMost64Engines) {
  KvIndex index;
  for (int i = 0; i < KvIndex::kMaxEngines; ++i) {
    ASSERT_TRUE(index.Apply("e" + std::to_string(i), Snapshot("i", 0, {})).ok());
  }
  EXPECT_EQ(index.Apply("one-more", Snapshot("i", 0, {})).code(), StatusCode::kResourceExhausted);
  index.DropEngine("e7");
  EXPECT_TRUE(index.Apply("one-more", Snapshot("i", 0, {})).ok());
}

// A model engine for the index's fault tests: its events and cached set, answering a query as
// KvEventLog does (reset for another/no incarnation, a since past the head or before the ring).
struct ModelEngine {
  std::string name;
  std::string inc;
  std::vector<KvEvent> events;  // all of this incarnation; the ring keeps the last `ring`
  std::set<std::string> cached;
  std::map<std::string, BlockHash> by_hex;
  size_t ring = 16;
  int restarts = 0;

  void Op(std::mt19937& rng, const std::vector<BlockHash>& universe) {
    const BlockHash& h = universe[rng() % universe.size()];
    const std::string hex = BlockHashHex(h);
    const bool store = cached.count(hex) == 0;
    if (store) {
      cached.insert(hex);
      by_hex[hex] = h;
    } else {
      cached.erase(hex);
    }
    events.push_back({events.size() + 1, store ? KvEventOp::kStored : KvEventOp::kRemoved, h});
  }
  void Restart() {
    inc = name + "-i" + std::to_string(++restarts);
    events.clear();
    cached.clear();
  }
  KvEventBatch Answer(const std::string& query, size_t max_events) const {
    uint64_t since = std::stoull(query.substr(6, query.find('&') - 6));
    std::string qinc;
    if (auto p = query.find("incarnation="); p != std::string::npos)
      qinc = query.substr(p + 12, query.find('&', p) - p - 12);
    const uint64_t head = events.size();
    const uint64_t oldest = head >= ring ? head - ring + 1 : 1;
    KvEventBatch b;
    b.incarnation = inc;
    b.block_size = kBs;
    b.root = kRoot;
    b.head_seq = head;
    if (qinc != inc || since > head || since + 1 < oldest) {
      b.reset = true;
      for (const std::string& hex : cached) b.snapshot.push_back(by_hex.at(hex));
      b.next_since = head;
      return b;
    }
    for (uint64_t s = since + 1; s <= head && b.events.size() < max_events; ++s)
      b.events.push_back(events[s - 1]);
    b.next_since = b.events.empty() ? since : b.events.back().seq;
    return b;
  }
};

// Batches lost, duplicated, reordered, stale; events dropped (gaps); engines restarting: the
// index never holds more than its cap, heals to the engines' true sets once the streams are
// clean, and leaves nothing behind when the engines go. Never a wrong answer either way: an
// entry only steers a route.
TEST(KvIndex, FaultyStreamsHealAndNeverLeak) {
  std::vector<BlockHash> universe;
  for (uint64_t i = 0; i < 60; ++i) universe.push_back(BlockHash{i * 7919 + 1, i});
  for (size_t cap : {size_t{1000}, size_t{40}}) {
    for (uint32_t seed = 1; seed <= 20; ++seed) {
      std::mt19937 rng(seed);
      KvIndex index({.max_blocks = cap});
      std::vector<ModelEngine> engines(3);
      const std::vector<std::string> ids = {"e0", "e1", "e2"};
      for (size_t e = 0; e < engines.size(); ++e) {
        engines[e].name = ids[e];
        engines[e].inc = ids[e] + "-i0";
      }
      std::vector<std::vector<KvEventBatch>> old(engines.size());  // for stale replays
      for (int step = 0; step < 400; ++step) {
        const size_t e = rng() % engines.size();
        for (int k = 0; k < 3; ++k) engines[e].Op(rng, universe);
        if (rng() % 50 == 0) engines[e].Restart();
        KvEventBatch b = engines[e].Answer(index.NextQuery(ids[e], 0), 1 + rng() % 6);
        const unsigned fault = rng() % 10;
        if (fault == 0) continue;  // the answer is lost
        if (fault == 1 && b.events.size() > 1) b.events.erase(b.events.begin());  // a gap
        if (fault == 2 && !old[e].empty()) {  // a stale answer first
          (void)index.Apply(ids[e], old[e][rng() % old[e].size()]);
        }
        (void)index.Apply(ids[e], b);
        if (fault == 3) (void)index.Apply(ids[e], b);  // duplicated
        old[e].push_back(b);
        if (old[e].size() > 20) old[e].erase(old[e].begin());
        ASSERT_LE(index.num_blocks(), cap);
      }
      // Clean streams from here: every engine converges to its true set.
      for (int round = 0; round < 20; ++round) {
        for (size_t e = 0; e < engines.size(); ++e) {
          (void)index.Apply(ids[e], engines[e].Answer(index.NextQuery(ids[e], 0), 1000));
        }
      }
      if (cap >= universe.size() * engines.size()) {
        for (size_t e = 0; e < engines.size(); ++e) {
          for (const BlockHash& h : universe) {
            const std::string one[1] = {ids[e]};
            const BlockHash span[1] = {h};
            EXPECT_EQ(index.PrefixBlocks(span, one)[0], engines[e].cached.count(BlockHashHex(h)))
                << "seed " << seed << " engine " << e;
          }
        }
      }
      for (const std::string& id : ids) index.DropEngine(id);
      EXPECT_EQ(index.num_blocks(), 0u) << "seed " << seed;
      EXPECT_EQ(index.num_entries(), 0u) << "seed " << seed;
    }
  }
}

// --- routing -----------------------------------------------------------------------------------

InstanceInfo Info(const std::string& id, Role role) {
  InstanceInfo info;
  info.id = id;
  info.role = role;
  info.url = "http://127.0.0.1:" + std::to_string(8000 + static_cast<int>(id[1] - '0') +
                                                  (role == Role::kPrefill ? 0 : 100));
  return info;
}

struct Cluster {
  Cluster() {
    for (const char* id : {"p0", "p1"})
      EXPECT_TRUE(reg.Register(Info(id, Role::kPrefill), {}, 0).ok());
    for (const char* id : {"d0", "d1"})
      EXPECT_TRUE(reg.Register(Info(id, Role::kDecode), {}, 0).ok());
    for (const char* id : {"p0", "p1", "d0", "d1"}) {
      EXPECT_TRUE(index.Apply(id, Snapshot(std::string("inc-") + id, 0, {})).ok());
    }
  }
  void Hold(const std::string& id, const std::vector<BlockHash>& hs) {
    KvEventBatch b = Snapshot("inc-" + id, 1, hs);
    EXPECT_TRUE(index.Apply(id, b).ok());
  }
  InstanceRegistry reg{RegistryOptions{.policy = RoutingPolicy::kKvAware}};
  KvIndex index;
};

double ScoreOf(const KvRouteDecision& d, const std::string& id) {
  for (const KvCandidate& c : d.candidates) {
    if (c.id == id) return c.score;
  }
  ADD_FAILURE() << "no candidate " << id;
  return 0;
}

TEST(KvRouter, PicksEachRoleByItsOverlapAgainstLoad) {
  Cluster c;
  std::vector<int32_t> prompt = Iota(18);  // 4 full blocks + 2 tokens
  std::vector<BlockHash> p = Chain(prompt);
  c.Hold("p1", {p[0], p[1]});              // the prefill that ran turn 1
  c.Hold("d0", {p[0], p[1], p[2], p[3]});  // the decode that decoded it
  c.Hold("d1", {p[0]});
  ASSERT_TRUE(c.reg.Heartbeat("d0", {.running = 3, .waiting = 1, .kv_usage = 0.5}, 1).ok());
  KvRouter router({.kv_aware = true});
  KvRouteDecision d = router.Decide(prompt, c.reg, c.index, false);
  ASSERT_TRUE(d.prefill && d.decode);
  EXPECT_EQ(d.prefill->id, "p1");
  EXPECT_EQ(d.decode->id, "d0");  // full overlap beats the idle d1 despite its load
  EXPECT_EQ(d.prefill_cached_tokens, 8);
  EXPECT_EQ(d.decode_cached_tokens, 16);
  EXPECT_EQ(d.prompt_tokens, 18);
  EXPECT_FALSE(d.skip_prefill);
  // score = overlap/4 - 0.5 * queue / (1 + max queue) - 0.25 * kv_usage
  EXPECT_DOUBLE_EQ(ScoreOf(d, "d0"), 1.0 - 0.5 * 4 / 5.0 - 0.25 * 0.5);
  EXPECT_DOUBLE_EQ(ScoreOf(d, "d1"), 0.25);
  EXPECT_DOUBLE_EQ(ScoreOf(d, "p0"), 0.0);
  EXPECT_DOUBLE_EQ(ScoreOf(d, "p1"), 0.5);
  // Heavier load with only a partial overlap loses to an idle partial one.
  ASSERT_TRUE(c.reg.Heartbeat("d0", {.running = 30, .waiting = 10, .kv_usage = 1.0}, 2).ok());
  c.Hold("d0", {p[0], p[1]});
  d = router.Decide(prompt, c.reg, c.index, false);
  EXPECT_EQ(d.decode->id, "d1");  // 0.25 against 0.5 - 0.5*40/41 - 0.25
}

TEST(KvRouter, NoOverlapIsLeastLoadedWithRoundRobinTies) {
  Cluster c;
  KvRouter router({.kv_aware = true});
  std::vector<int32_t> prompt = Iota(40);
  std::vector<std::string> decodes;
  for (int i = 0; i < 4; ++i)
    decodes.push_back(router.Decide(prompt, c.reg, c.index, true).decode->id);
  EXPECT_EQ(decodes, (std::vector<std::string>{"d0", "d1", "d0", "d1"}));
  c.reg.LegStarted("d0");
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(router.Decide(prompt, c.reg, c.index, true).decode->id, "d1");
  // Colocated: no prefill chosen.
  EXPECT_FALSE(router.Decide(prompt, c.reg, c.index, true).prefill.has_value());
  // An engine the index does not follow yet counts as holding nothing.
  c.index.DropEngine("d1");
  c.Hold("d0", Chain(prompt));
  EXPECT_EQ(router.Decide(prompt, c.reg, c.index, true).decode->id, "d0");
}

TEST(KvRouter, SkipThresholdIsInTokensOfThePromptTheDecodeLacks) {
  Cluster c;
  std::vector<int32_t> prompt = Iota(18);  // 16 cacheable tokens + 2
  c.Hold("d1", Chain(prompt));
  for (int threshold : {0, 1, 2, 3, 100}) {
    KvRouter router({.kv_aware = true, .pd_skip_threshold = threshold});
    KvRouteDecision d = router.Decide(prompt, c.reg, c.index, false);
    EXPECT_EQ(d.decode->id, "d1");
    EXPECT_EQ(d.skip_prefill, threshold >= 2) << threshold;
    EXPECT_EQ(d.prefill.has_value(), threshold < 2) << threshold;
  }
  // Skip without kv-aware: the registry's pick (least-loaded) and its own overlap.
  KvRouter skip_only({.kv_aware = false, .pd_skip_threshold = 2});
  int skipped = 0;
  for (int i = 0; i < 4; ++i) {
    KvRouteDecision d = skip_only.Decide(prompt, c.reg, c.index, false);
    EXPECT_FALSE(d.prefill.has_value());
    if (d.skip_prefill) {
      ++skipped;
      EXPECT_EQ(d.decode->id, "d1");
    }
  }
  EXPECT_EQ(skipped, 2);  // the registry alternates d0 / d1
  // Both off: nothing decided.
  KvRouter off({});
  EXPECT_FALSE(off.active());
  KvRouteDecision d = off.Decide(prompt, c.reg, c.index, false);
  EXPECT_FALSE(d.decode || d.prefill || d.skip_prefill);
}

// The decision drives the sans-IO flow: fake engines (the registry), fake clock (now values).
TEST(KvRouter, DecisionDrivesTheFlowLegs) {
  Cluster c;
  std::vector<int32_t> prompt = Iota(18);
  c.Hold("p1", Chain(prompt));
  c.Hold("d1", {Chain(prompt)[0]});
  KvRouter router({.kv_aware = true, .pd_skip_threshold = 4});
  auto fallback = [&](Role role, const std::vector<std::string>& exclude) {
    return c.reg.Pick(role, exclude);
  };
  const std::string body = R"({"model":"m","prompt":[0,1,2],"max_tokens":4})";
  // P/D: the decided prefill first; after its answer, the decided decode.
  KvRouteDecision d = router.Decide(prompt, c.reg, c.index, false);
  ASSERT_FALSE(d.skip_prefill);
  PdFlow flow(DecidedFlowOptions(d, {}), "tid", DecidedPicker(d, fallback));
  TimePoint now = 100;
  std::vector<Action> a = flow.OnClientRequest({"/v1/completions", body}, now++);
  ASSERT_EQ(a.size(), 1u);
  const SendLeg& pre = std::get<SendLeg>(a[0]);
  EXPECT_EQ(pre.role, Role::kPrefill);
  EXPECT_EQ(pre.instance.id, "p1");
  flow.OnLegStatus(pre.leg_id, 200, "application/json", now++);
  flow.OnLegData(pre.leg_id, R"({"kv_transfer_params":{"transfer_id":"tid"}})", now++);
  a = flow.OnLegDone(pre.leg_id, now++);
  ASSERT_FALSE(a.empty());
  const SendLeg& dec = std::get<SendLeg>(a[0]);
  EXPECT_EQ(dec.role, Role::kDecode);
  EXPECT_EQ(dec.instance.id, "d1");
  // An unreachable decided instance falls back to the registry's pick.
  a = flow.OnLegError(dec.leg_id, LegFailure::kUnreachable, UnavailableError("refused"), now++);
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(std::get<SendLeg>(a[0]).instance.id, "d0");

  // Skip: the decode holds all but 2 tokens → one leg, the client's body, to that decode.
  c.Hold("d1", Chain(prompt));
  d = router.Decide(prompt, c.reg, c.index, false);
  ASSERT_TRUE(d.skip_prefill);
  PdFlow skip(DecidedFlowOptions(d, {}), "tid2", DecidedPicker(d, fallback));
  a = skip.OnClientRequest({"/v1/completions", body}, now++);
  ASSERT_EQ(a.size(), 1u);
  const SendLeg& only = std::get<SendLeg>(a[0]);
  EXPECT_EQ(only.role, Role::kDecode);
  EXPECT_EQ(only.instance.id, "d1");
  EXPECT_EQ(nlohmann::json::parse(only.body), nlohmann::json::parse(body));
  skip.OnLegStatus(only.leg_id, 200, "application/json", now++);
  skip.OnLegData(only.leg_id, R"({"choices":[]})", now++);
  a = skip.OnLegDone(only.leg_id, now++);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<Respond>(a[0]));  // nothing to release
  EXPECT_TRUE(skip.done());
}

// A kv_both decode (vLLM's kv_role "kv_both") that holds more of a prompt than any prefill (a
// conversation's next turn: it decoded the answer) takes the prefill leg; the decode leg goes to
// another decode (one engine cannot READ from itself).
TEST(KvRouter, KvBothDecodeTakesThePrefillLegOfAPromptItHoldsMoreOf) {
  Cluster c;
  InstanceInfo both = Info("d0", Role::kDecode);
  both.kv_both = true;
  ASSERT_TRUE(c.reg.Register(both, {.running = 4, .waiting = 0, .kv_usage = 0.5}, 0).ok());
  std::vector<int32_t> prompt = Iota(26);  // 6 full blocks + 2 tokens
  std::vector<BlockHash> p = Chain(prompt);
  c.Hold("p1", {p[0], p[1]});              // turn 1's prompt
  c.Hold("d0", {p[0], p[1], p[2], p[3]});  // turn 1's prompt + its answer
  KvRouter router({.kv_aware = true});
  KvRouteDecision d = router.Decide(prompt, c.reg, c.index, false);
  ASSERT_TRUE(d.prefill && d.decode);
  EXPECT_EQ(d.prefill->id, "d0");
  EXPECT_EQ(d.prefill_cached_tokens, 16);
  EXPECT_EQ(d.decode->id, "d1");  // d0 scored best as decode too, but holds the prefill
  EXPECT_EQ(d.decode_cached_tokens, 0);
  // Scored as a prefill, d0's queue is its waiting requests only (0): 4/6 - 0.25 * 0.5; its
  // running sequences count when it is scored as a decode: 4/6 - 0.5 * 4/5 - 0.25 * 0.5.
  const KvCandidate* as_prefill = nullptr;
  const KvCandidate* as_decode = nullptr;
  for (const KvCandidate& k : d.candidates) {
    if (k.id != "d0") continue;
    (k.role == Role::kPrefill ? as_prefill : as_decode) = &k;
  }
  ASSERT_TRUE(as_prefill && as_decode);
  EXPECT_TRUE(as_prefill->cross_role);
  EXPECT_FALSE(as_decode->cross_role);
  EXPECT_DOUBLE_EQ(as_prefill->score, 4.0 / 6 - 0.25 * 0.5);
  EXPECT_DOUBLE_EQ(as_decode->score, 4.0 / 6 - 0.5 * 4 / 5.0 - 0.25 * 0.5);
  EXPECT_DOUBLE_EQ(ScoreOf(d, "p1"), 2.0 / 6);

  // Its queue outweighing the extra blocks: the prefill that holds less but is idle.
  ASSERT_TRUE(c.reg.Heartbeat("d0", {.running = 4, .waiting = 10, .kv_usage = 0.5}, 1).ok());
  d = router.Decide(prompt, c.reg, c.index, false);
  EXPECT_EQ(d.prefill->id, "p1");  // 2/6 against 4/6 - 0.5 * 10/11 - 0.125
  ASSERT_TRUE(c.reg.Heartbeat("d0", {.running = 4, .waiting = 0, .kv_usage = 0.5}, 2).ok());

  // Holding no more than a prefill (here: the same blocks) keeps the leg on the prefills, and a
  // first turn (nothing held anywhere) never goes to a decode's prefill side.
  c.Hold("p1", {p[0], p[1], p[2], p[3]});
  EXPECT_EQ(router.Decide(prompt, c.reg, c.index, false).prefill->id, "p1");
  std::vector<int32_t> fresh = Iota(26, 500);
  for (int i = 0; i < 4; ++i) {
    d = router.Decide(fresh, c.reg, c.index, false);
    EXPECT_EQ(d.prefill->id[0], 'p') << i;
  }
  // Not kv_both: never a prefill candidate.
  c.Hold("p1", {p[0]});
  c.Hold("d1", {p[0], p[1], p[2], p[3], p[4]});
  d = router.Decide(prompt, c.reg, c.index, false);
  EXPECT_EQ(d.prefill->id, "d0");  // d0 (4 blocks, kv_both), not d1 (5 blocks, kv_consumer)
  EXPECT_EQ(d.decode->id, "d1");
}

// One engine listed as both roles (a kv_both engine given as --prefill and --decode): a request
// does not get both legs on it while another engine can take one. The flow keeps its decode leg
// off the prefill's url, whatever the picker (registry round-robin here), and the router
// re-picks; alone, the engine still gets both (a fake answering both legs).
TEST(KvRouter, OneEngineIsNotBothLegsWhileAnotherCanBe) {
  InstanceRegistry reg{RegistryOptions{.policy = RoutingPolicy::kRoundRobin}};
  ASSERT_TRUE(reg.AddStatic(Role::kPrefill, "http://127.0.0.1:9000").ok());
  ASSERT_TRUE(reg.AddStatic(Role::kDecode, "http://127.0.0.1:9000").ok());  // id ...#decode
  ASSERT_TRUE(reg.AddStatic(Role::kDecode, "http://127.0.0.1:9001").ok());
  auto picker = [&](Role role, const std::vector<std::string>& exclude) {
    return reg.Pick(role, exclude);
  };
  const std::string body = R"({"model":"m","prompt":[0,1,2],"max_tokens":4})";
  TimePoint now = 100;
  for (int i = 0; i < 4; ++i) {  // round-robin would give the 9000 decode every other time
    const std::string tid = "tid" + std::to_string(i);
    PdFlow flow({}, tid, picker);
    std::vector<Action> a = flow.OnClientRequest({"/v1/completions", body}, now++);
    ASSERT_EQ(a.size(), 1u);
    const SendLeg& pre = std::get<SendLeg>(a[0]);
    EXPECT_EQ(pre.instance.url, "http://127.0.0.1:9000");
    flow.OnLegStatus(pre.leg_id, 200, "application/json", now++);
    flow.OnLegData(pre.leg_id, R"({"kv_transfer_params":{"transfer_id":")" + tid + R"("}})", now++);
    a = flow.OnLegDone(pre.leg_id, now++);
    ASSERT_FALSE(a.empty());
    EXPECT_EQ(std::get<SendLeg>(a[0]).instance.url, "http://127.0.0.1:9001") << i;
  }
  // The registry alone: a url in exclude keeps that engine out.
  EXPECT_FALSE(reg.Pick(Role::kPrefill, {"http://127.0.0.1:9000"}).has_value());
  // The only engine: both legs go to it.
  {
    InstanceRegistry one{RegistryOptions{.policy = RoutingPolicy::kRoundRobin}};
    ASSERT_TRUE(one.AddStatic(Role::kPrefill, "http://127.0.0.1:9000").ok());
    ASSERT_TRUE(one.AddStatic(Role::kDecode, "http://127.0.0.1:9000").ok());
    PdFlow flow({}, "tid-one", [&](Role role, const std::vector<std::string>& exclude) {
      return one.Pick(role, exclude);
    });
    std::vector<Action> a = flow.OnClientRequest({"/v1/completions", body}, now++);
    ASSERT_EQ(a.size(), 1u);
    const SendLeg& pre = std::get<SendLeg>(a[0]);
    flow.OnLegStatus(pre.leg_id, 200, "application/json", now++);
    flow.OnLegData(pre.leg_id, R"({"kv_transfer_params":{"transfer_id":"tid-one"}})", now++);
    a = flow.OnLegDone(pre.leg_id, now++);
    ASSERT_FALSE(a.empty());
    EXPECT_EQ(std::get<SendLeg>(a[0]).instance.id, "http://127.0.0.1:9000#decode");
  }

  // The router: the best decode (the engine holding everything) is the best prefill too.
  KvIndex index;
  std::vector<int32_t> prompt = Iota(18);
  ASSERT_TRUE(index.Apply("http://127.0.0.1:9000", Snapshot("i0", 1, Chain(prompt))).ok());
  ASSERT_TRUE(index.Apply("http://127.0.0.1:9000#decode", Snapshot("i0", 1, Chain(prompt))).ok());
  ASSERT_TRUE(index.Apply("http://127.0.0.1:9001", Snapshot("i1", 0, {})).ok());
  KvRouter router({.kv_aware = true});
  KvRouteDecision d = router.Decide(prompt, reg, index, false);
  ASSERT_TRUE(d.prefill && d.decode);
  EXPECT_EQ(d.prefill->url, "http://127.0.0.1:9000");
  EXPECT_EQ(d.decode->url, "http://127.0.0.1:9001");
  // With the skip threshold met the request goes to that decode alone: no conflict to resolve.
  KvRouter skip({.kv_aware = true, .pd_skip_threshold = 2});
  d = skip.Decide(prompt, reg, index, false);
  EXPECT_TRUE(d.skip_prefill);
  EXPECT_EQ(d.decode->url, "http://127.0.0.1:9000");
  // A decided instance named by url in exclude is not returned by the decided picker.
  auto decided = DecidedPicker(d, picker);
  EXPECT_EQ(decided(Role::kDecode, {"http://127.0.0.1:9000"})->url, "http://127.0.0.1:9001");
}

}  // namespace
}  // namespace kvbridge::proxy
