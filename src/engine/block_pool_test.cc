#include "kvbridge/engine/block_pool.h"

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace kvbridge {
namespace {

std::unique_ptr<BlockPool> MakePool(int64_t n, bool caching = true, int block_size = 4) {
  auto r = BlockPool::Create(
      {.num_blocks = n, .block_size = block_size, .enable_prefix_caching = caching});
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return std::move(r).value();
}

void ExpectCounts(const BlockPool& p, int64_t free, int64_t cached, int64_t active, int64_t held) {
  EXPECT_EQ(p.NumFree(), free);
  EXPECT_EQ(p.NumCachedFree(), cached);
  EXPECT_EQ(p.NumActive(), active);
  EXPECT_EQ(p.NumHeld(), held);
  EXPECT_TRUE(p.CheckInvariants().ok()) << p.CheckInvariants().ToString();
}

TEST(BlockPool, CreateRejectsBadSizes) {
  EXPECT_EQ(BlockPool::Create({.num_blocks = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create({.num_blocks = 4, .block_size = 0}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(BlockPool, AllocateReleaseAccounting) {
  auto p = MakePool(8);
  std::vector<int32_t> a;
  ASSERT_TRUE(p->Allocate(3, {}, &a).ok());
  EXPECT_EQ(a, (std::vector<int32_t>{0, 1, 2}));
  ExpectCounts(*p, 5, 0, 3, 0);
  ASSERT_TRUE(p->Share(a).ok());
  EXPECT_EQ(p->RefCount(1), 2);
  ASSERT_TRUE(p->Release(a).ok());
  ExpectCounts(*p, 5, 0, 3, 0);
  ASSERT_TRUE(p->Release(a).ok());
  ExpectCounts(*p, 8, 0, 0, 0);
}

TEST(BlockPool, FailedAllocationChangesNothing) {
  auto p = MakePool(4);
  std::vector<int32_t> a;
  ASSERT_TRUE(p->Allocate(3, {}, &a).ok());
  std::vector<int32_t> b;
  Status st = p->Allocate(2, {}, &b);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(b.empty());
  ExpectCounts(*p, 1, 0, 3, 0);
  // A release naming a block more often than it is referenced is refused as a whole.
  std::vector<int32_t> twice = {a[0], a[1], a[1]};
  EXPECT_EQ(p->Release(twice).code(), StatusCode::kFailedPrecondition);
  ExpectCounts(*p, 1, 0, 3, 0);
  EXPECT_EQ(p->Share(std::vector<int32_t>{3}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p->Share(std::vector<int32_t>{9}).code(), StatusCode::kInvalidArgument);
}

TEST(BlockPool, HashChainIsDeterministicAndSeeded) {
  std::vector<int32_t> toks = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<BlockHash> h1, h2, h3;
  AppendBlockHashes(RootBlockHash("model-a"), toks, 4, &h1);
  AppendBlockHashes(RootBlockHash("model-a"), toks, 4, &h2);
  AppendBlockHashes(RootBlockHash("model-b"), toks, 4, &h3);
  ASSERT_EQ(h1.size(), 2u);  // 9 tokens = 2 full blocks of 4
  EXPECT_EQ(h1, h2);
  EXPECT_NE(h1[0], h3[0]);
  EXPECT_EQ(h1[1], ChainBlockHash(h1[0], std::vector<int32_t>{5, 6, 7, 8}));
  // Same second block after a different first block: different hash (it is a chain).
  std::vector<int32_t> other = {9, 9, 9, 9, 5, 6, 7, 8};
  std::vector<BlockHash> h4;
  AppendBlockHashes(RootBlockHash("model-a"), other, 4, &h4);
  EXPECT_NE(h4[1], h1[1]);
}

TEST(BlockPool, PrefixCacheHitAndLruEviction) {
  auto p = MakePool(4);
  std::vector<BlockHash> hs;
  AppendBlockHashes(RootBlockHash("m"), std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}, 4, &hs);
  std::vector<int32_t> a;
  ASSERT_TRUE(p->Allocate(2, {}, &a).ok());
  p->CacheFullBlock(a[0], hs[0]);
  p->CacheFullBlock(a[1], hs[1]);
  // Release tail first so the head is evicted last.
  ASSERT_TRUE(p->Release(std::vector<int32_t>{a[1], a[0]}).ok());
  ExpectCounts(*p, 2, 2, 0, 0);

  std::vector<int32_t> hits;
  EXPECT_EQ(p->MatchPrefix(hs, &hits), 2);
  EXPECT_EQ(hits, a);
  // Taking the hits makes them active again; nothing else changes.
  std::vector<int32_t> t = hits;
  ASSERT_TRUE(p->Allocate(1, hits, &t).ok());
  ExpectCounts(*p, 1, 0, 3, 0);
  ASSERT_TRUE(p->Release(std::vector<int32_t>{t[2], t[1], t[0]}).ok());
  ExpectCounts(*p, 2, 2, 0, 0);

  // Free blocks go first; then the LRU head (a[1], released first) is evicted.
  std::vector<int32_t> b;
  ASSERT_TRUE(p->Allocate(3, {}, &b).ok());
  EXPECT_EQ(p->num_evictions(), 1);
  EXPECT_TRUE(std::find(b.begin(), b.end(), a[1]) != b.end());
  EXPECT_FALSE(p->IsCached(a[1]));
  hits.clear();
  EXPECT_EQ(p->MatchPrefix(hs, &hits), 1);  // the chain breaks at the evicted block
  ExpectCounts(*p, 0, 1, 3, 0);
}

TEST(BlockPool, PrefixCachingOff) {
  auto p = MakePool(4, /*caching=*/false);
  std::vector<BlockHash> hs;
  AppendBlockHashes(RootBlockHash("m"), std::vector<int32_t>{1, 2, 3, 4}, 4, &hs);
  std::vector<int32_t> a;
  ASSERT_TRUE(p->Allocate(1, {}, &a).ok());
  p->CacheFullBlock(a[0], hs[0]);
  EXPECT_FALSE(p->IsCached(a[0]));
  ASSERT_TRUE(p->Release(a).ok());
  std::vector<int32_t> hits;
  EXPECT_EQ(p->MatchPrefix(hs, &hits), 0);
  ExpectCounts(*p, 4, 0, 0, 0);
}

TEST(BlockPool, HoldKeepsBlocksUntilReleasedExactlyOnce) {
  auto p = MakePool(4);
  std::vector<int32_t> a;
  ASSERT_TRUE(p->Allocate(2, {}, &a).ok());
  ASSERT_TRUE(p->Hold("req-1", a).ok());
  EXPECT_EQ(p->Hold("req-1", a).code(), StatusCode::kAlreadyExists);
  ASSERT_TRUE(p->Release(a).ok());
  ExpectCounts(*p, 2, 0, 2, 2);
  // Held blocks are never handed out: only the 2 free ones are available.
  std::vector<int32_t> b;
  EXPECT_EQ(p->Allocate(3, {}, &b).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(p->ReleaseHold("req-1").ok());
  ExpectCounts(*p, 4, 0, 0, 0);
  EXPECT_EQ(p->ReleaseHold("req-1").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p->ReleaseHold("never").code(), StatusCode::kFailedPrecondition);
  ExpectCounts(*p, 4, 0, 0, 0);
  // Holding an inactive block is refused.
  EXPECT_EQ(p->Hold("x", std::vector<int32_t>{0}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p->num_holds(), 0u);
}

TEST(BlockPool, HeldCachedBlockIsNotEvicted) {
  auto p = MakePool(2);
  std::vector<BlockHash> hs;
  AppendBlockHashes(RootBlockHash("m"), std::vector<int32_t>{1, 2, 3, 4}, 4, &hs);
  std::vector<int32_t> a;
  ASSERT_TRUE(p->Allocate(1, {}, &a).ok());
  p->CacheFullBlock(a[0], hs[0]);
  ASSERT_TRUE(p->Hold("h", a).ok());
  ASSERT_TRUE(p->Release(a).ok());
  std::vector<int32_t> b;
  EXPECT_EQ(p->Allocate(2, {}, &b).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(p->Allocate(1, {}, &b).ok());
  EXPECT_NE(b[0], a[0]);
  EXPECT_TRUE(p->IsCached(a[0]));
  // A prefix hit on a held block shares it.
  std::vector<int32_t> hits;
  ASSERT_EQ(p->MatchPrefix(hs, &hits), 1);
  std::vector<int32_t> c = hits;
  ASSERT_TRUE(p->Allocate(0, hits, &c).ok());
  EXPECT_EQ(p->RefCount(a[0]), 1);
  EXPECT_EQ(p->HoldCount(a[0]), 1);
  ExpectCounts(*p, 0, 0, 2, 1);
}

// Property: random alloc / prefix-reuse / fork / free / cache / hold / release-hold sequences
// keep the accounting, never hand out a live block, and release holds exactly once.
RC_GTEST_PROP(BlockPoolProperty, AccountingHoldsUnderRandomOps,
              (const std::vector<std::tuple<uint8_t, uint8_t, uint8_t>>& ops)) {
  const int64_t kBlocks = 16;
  auto p = MakePool(kBlocks, /*caching=*/true, /*block_size=*/2);
  std::vector<BlockHash> hashes;  // a small universe of chains
  for (int32_t s = 0; s < 4; ++s) {
    std::vector<BlockHash> h;
    AppendBlockHashes(RootBlockHash("m"), std::vector<int32_t>{s, s, 1, 1, 2, 2}, 2, &h);
    hashes.insert(hashes.end(), h.begin(), h.end());
  }
  std::vector<std::vector<int32_t>> owners;
  std::map<std::string, std::vector<int32_t>> holds;
  std::set<std::string> released;
  int next_key = 0;
  for (const auto& [op, a, b] : ops) {
    switch (op % 7) {
      case 0: {  // allocate
        int k = a % 5;
        std::vector<int32_t> got;
        std::set<int32_t> live;
        for (auto& o : owners) live.insert(o.begin(), o.end());
        for (auto& [key, v] : holds) live.insert(v.begin(), v.end());
        bool expect_ok = k <= p->NumAvailable();
        Status st = p->Allocate(k, {}, &got);
        RC_ASSERT(st.ok() == expect_ok);
        if (st.ok()) {
          RC_ASSERT(static_cast<int>(got.size()) == k);
          for (int32_t g : got) RC_ASSERT(live.count(g) == 0u);  // never a live block
          owners.push_back(got);
        } else {
          RC_ASSERT(got.empty());
        }
        break;
      }
      case 1: {  // fork
        if (owners.empty()) break;
        auto& o = owners[a % owners.size()];
        RC_ASSERT(p->Share(o).ok());
        owners.push_back(o);
        break;
      }
      case 2: {  // free
        if (owners.empty()) break;
        size_t i = a % owners.size();
        RC_ASSERT(p->Release(owners[i]).ok());
        owners.erase(owners.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
      case 3: {  // cache a block of an owner
        if (owners.empty() || owners[a % owners.size()].empty()) break;
        auto& o = owners[a % owners.size()];
        p->CacheFullBlock(o[b % o.size()], hashes[b % hashes.size()]);
        break;
      }
      case 4: {  // hold an owner's blocks, then drop its references (a finished request)
        if (owners.empty()) break;
        size_t i = a % owners.size();
        std::string key = "k" + std::to_string(next_key++);
        RC_ASSERT(p->Hold(key, owners[i]).ok());
        holds[key] = owners[i];
        RC_ASSERT(p->Release(owners[i]).ok());
        owners.erase(owners.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
      case 5: {  // release a hold (or double-release one)
        if (!released.empty() && b % 3 == 0) {
          RC_ASSERT(p->ReleaseHold(*released.begin()).code() == StatusCode::kFailedPrecondition);
          break;
        }
        if (holds.empty()) break;
        auto it = holds.begin();
        std::advance(it, a % holds.size());
        RC_ASSERT(p->ReleaseHold(it->first).ok());
        released.insert(it->first);
        holds.erase(it);
        break;
      }
      case 6: {  // prefix reuse
        std::vector<int32_t> hits;
        size_t start = (a % 4) * 3;
        int n = p->MatchPrefix(std::span<const BlockHash>(hashes.data() + start, 3), &hits);
        RC_ASSERT(n == static_cast<int>(hits.size()));
        if (n == 0) break;
        std::vector<int32_t> t = hits;
        RC_ASSERT(p->Allocate(0, hits, &t).ok());
        owners.push_back(t);
        break;
      }
    }
    RC_ASSERT(p->CheckInvariants().ok());
    std::map<int32_t, int> refs;
    for (auto& o : owners)
      for (int32_t x : o) ++refs[x];
    std::set<int32_t> active;
    for (auto& [x, c] : refs) active.insert(x);
    for (auto& [key, v] : holds) active.insert(v.begin(), v.end());
    RC_ASSERT(p->NumActive() == static_cast<int64_t>(active.size()));
    RC_ASSERT(p->NumFree() + p->NumCachedFree() + p->NumActive() == kBlocks);
    for (auto& [x, c] : refs) RC_ASSERT(p->RefCount(x) == c);
  }
  // Drain: everything back, nothing leaked.
  for (auto& o : owners) RC_ASSERT(p->Release(o).ok());
  for (auto& [key, v] : holds) RC_ASSERT(p->ReleaseHold(key).ok());
  RC_ASSERT(p->NumActive() == 0);
  RC_ASSERT(p->NumHeld() == 0);
  RC_ASSERT(p->CheckInvariants().ok());
}

}  // namespace
}  // namespace kvbridge
