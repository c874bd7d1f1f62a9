#include "kvbridge/engine/kv_event_log.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <thread>
#include <vector>

namespace kvbridge {
namespace {

BlockHash H(uint64_t i) { return BlockHash{i, i * 7 + 1}; }

std::set<std::string> HexSet(const std::vector<BlockHash>& hs) {
  std::set<std::string> out;
  for (const BlockHash& h : hs) out.insert(BlockHashHex(h));
  return out;
}

TEST(BlockHashHex, RoundTripAndLayout) {
  EXPECT_EQ(BlockHashHex(BlockHash{.lo = 1, .hi = 0xABull << 56}),
            "ab000000000000000000000000000001");
  auto back = ParseBlockHashHex("AB000000000000000000000000000001");
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, (BlockHash{.lo = 1, .hi = 0xABull << 56}));
  EXPECT_FALSE(ParseBlockHashHex("ab").has_value());
  EXPECT_FALSE(ParseBlockHashHex("zz000000000000000000000000000001").has_value());
}

TEST(KvEventLog, PoolReportsStoresAndEvictionsInOrder) {
  auto log = std::make_shared<KvEventLog>(
      KvEventLogOptions{.block_size = 4, .model_fingerprint = "m", .incarnation = "inc1"});
  auto pool = BlockPool::Create({.num_blocks = 2, .block_size = 4});
  ASSERT_TRUE(pool.ok());
  (*pool)->set_cache_listener(log.get());
  std::vector<BlockHash> hs;
  AppendBlockHashes(RootBlockHash("m"), std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}, 4, &hs);
  std::vector<int32_t> a;
  ASSERT_TRUE((*pool)->Allocate(2, {}, &a).ok());
  (*pool)->CacheFullBlock(a[0], hs[0]);
  (*pool)->CacheFullBlock(a[1], hs[1]);
  (*pool)->CacheFullBlock(a[1], hs[1]);  // already hashed: no event
  ASSERT_TRUE((*pool)->Release(std::vector<int32_t>{a[1], a[0]}).ok());
  std::vector<int32_t> b;
  ASSERT_TRUE((*pool)->Allocate(1, {}, &b).ok());  // evicts the LRU head: a[1] (hs[1])

  EXPECT_EQ(log->root(), RootBlockHash("m"));
  EXPECT_EQ(log->head_seq(), 3u);
  EXPECT_EQ(log->num_cached(), 1u);
  KvEventBatch r = log->Read(0, "inc1", 100);
  EXPECT_FALSE(r.reset);
  EXPECT_EQ(r.incarnation, "inc1");
  EXPECT_EQ(r.block_size, 4);
  EXPECT_EQ(r.head_seq, 3u);
  EXPECT_EQ(r.next_since, 3u);
  ASSERT_EQ(r.events.size(), 3u);
  EXPECT_EQ(r.events[0], (KvEvent{1, KvEventOp::kStored, hs[0]}));
  EXPECT_EQ(r.events[1], (KvEvent{2, KvEventOp::kStored, hs[1]}));
  EXPECT_EQ(r.events[2], (KvEvent{3, KvEventOp::kRemoved, hs[1]}));
  // From the middle, and capped by max_events.
  r = log->Read(1, "inc1", 1);
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_EQ(r.events[0].seq, 2u);
  EXPECT_EQ(r.next_since, 2u);
  // Up to date: nothing, no reset.
  r = log->Read(3, "inc1", 100);
  EXPECT_FALSE(r.reset);
  EXPECT_TRUE(r.events.empty());
  EXPECT_EQ(r.next_since, 3u);
}

TEST(KvEventLog, SinceOlderThanTheBufferGetsASnapshot) {
  KvEventLog log({.capacity = 4, .block_size = 16, .incarnation = "a"});
  for (uint64_t i = 1; i <= 8; ++i) log.OnBlockCached(H(i));
  log.OnBlockEvicted(H(2));
  log.OnBlockEvicted(H(5));                // seqs 1..10; the ring keeps 7..10
  KvEventBatch r = log.Read(6, "a", 100);  // 7 is the oldest kept: still continuous
  EXPECT_FALSE(r.reset);
  ASSERT_EQ(r.events.size(), 4u);
  EXPECT_EQ(r.events.front().seq, 7u);
  r = log.Read(5, "a", 100);  // 6 was dropped: gap
  EXPECT_TRUE(r.reset);
  EXPECT_TRUE(r.events.empty());
  EXPECT_EQ(r.next_since, 10u);
  EXPECT_EQ(HexSet(r.snapshot), HexSet({H(1), H(3), H(4), H(6), H(7), H(8)}));
}

TEST(KvEventLog, OtherIncarnationOrAheadOfHeadGetsASnapshot) {
  KvEventLog log({.block_size = 16, .incarnation = "new"});
  log.OnBlockCached(H(1));
  log.OnBlockCached(H(2));
  for (const auto& [since, inc] : std::vector<std::pair<uint64_t, std::string>>{
           {0, ""}, {2, "old"}, {0, "old"}, {3, "new"}, {99, "new"}}) {
    KvEventBatch r = log.Read(since, inc, 100);
    EXPECT_TRUE(r.reset) << since << " " << inc;
    EXPECT_EQ(r.incarnation, "new");
    EXPECT_EQ(r.next_since, 2u);
    EXPECT_EQ(HexSet(r.snapshot), HexSet({H(1), H(2)}));
  }
  // A random incarnation per log when none is given.
  KvEventLog a({}), b({});
  EXPECT_EQ(a.incarnation().size(), 16u);
  EXPECT_NE(a.incarnation(), b.incarnation());
}

TEST(KvEventLog, LongPollWakesOnAnEventAndOnClose) {
  KvEventLog log({.incarnation = "i"});
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    log.OnBlockCached(H(9));
  });
  KvEventBatch r = log.WaitAndRead(0, "i", 10, std::chrono::seconds(30));
  t.join();
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_EQ(r.events[0].hash, H(9));
  // Nothing new: waits out a short timeout and answers empty.
  r = log.WaitAndRead(1, "i", 10, std::chrono::milliseconds(10));
  EXPECT_TRUE(r.events.empty());
  EXPECT_FALSE(r.reset);
  std::thread c([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    log.Close();
  });
  r = log.WaitAndRead(1, "i", 10, std::chrono::seconds(30));  // returns at Close, not in 30 s
  c.join();
  EXPECT_TRUE(r.events.empty());
}

TEST(KvEventLog, JsonRoundTripAndRoute) {
  auto log = std::make_shared<KvEventLog>(
      KvEventLogOptions{.block_size = 8, .model_fingerprint = "fp", .incarnation = "i"});
  log->OnBlockCached(H(1));
  log->OnBlockEvicted(H(1));
  Route route = KvEventsRoute(log, "tok");
  EXPECT_EQ(route.method, "GET");
  EXPECT_EQ(route.pattern, "/v1/kv/events");
  HttpRequest req;
  req.query = {{"since", "0"}, {"incarnation", "i"}};
  EXPECT_EQ(route.handler(req).status, 401);
  req.headers.emplace(std::string(kClusterTokenHeader), "tok");
  HttpResponse res = route.handler(req);
  ASSERT_EQ(res.status, 200);
  auto b = ParseKvEventBatch(res.body);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->incarnation, "i");
  EXPECT_EQ(b->block_size, 8);
  EXPECT_EQ(b->root, RootBlockHash("fp"));
  EXPECT_FALSE(b->reset);
  ASSERT_EQ(b->events.size(), 2u);
  EXPECT_EQ(b->events[1], (KvEvent{2, KvEventOp::kRemoved, H(1)}));
  EXPECT_EQ(KvEventBatchJson(*b), res.body);
  req.query = {{"since", "x"}};
  EXPECT_EQ(route.handler(req).status, 400);
  EXPECT_FALSE(ParseKvEventBatch("[]").ok());
  EXPECT_FALSE(ParseKvEventBatch(R"({"incarnation":"i","block_size":8,"root":"00","head_seq":0,
      "next_since":0,"reset":false,"events":[]})")
                   .ok());
}

}  // namespace
}  // namespace kvbridge
