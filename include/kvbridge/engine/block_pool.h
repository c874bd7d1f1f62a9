// kvbridge/engine/block_pool.h — the bookkeeping of the paged KV cache: which block is free,
// which is referenced by requests, which is held for a transfer, which is a prefix-cache entry.
//
// The pool hands out block ids in [0, num_blocks); the memory behind them lives in KvCacheStorage
// (kv_cache_storage.h) in the layout of kv_cache_view.h. Rules (DESIGN.md "The KV cache",
// docs/engine.md "Block pool"):
//   - every block is in exactly one of three sets:
//       free          ref == 0, hold == 0, no hash     (the free list)
//       cached-free   ref == 0, hold == 0, has a hash  (the LRU list; evicted when free runs out)
//       active        ref > 0 or hold > 0              (referenced by a live request or held)
//     so free + cached_free + active == num_blocks, always (CheckInvariants()).
//   - a FULL block is hashed by a chain: hash_i = XXH3-128(hash_{i-1} || tokens of block i),
//     hash_{-1} = XXH3-128(model fingerprint), so equal prompts hash equally across processes.
//   - a block with ref > 0 or hold > 0 is never evicted or handed out again.
//   - prepare, then apply: a call that fails changes nothing.
//
//   ASSIGN_OR_RETURN(auto pool, BlockPool::Create({.num_blocks = 1024, .block_size = 16}));
//   std::vector<BlockHash> hashes;
//   AppendBlockHashes(RootBlockHash(fingerprint), prompt, 16, &hashes);
//   std::vector<int32_t> table;
//   int hit_blocks = pool->MatchPrefix(hashes, &table);           // no state change
//   std::vector<int32_t> hits = table;
//   RETURN_IF_ERROR(pool->Allocate(needed - hit_blocks, hits, &table));  // refs hits + new
//   ... after the forward pass filled block i: pool->CacheFullBlock(table[i], hashes[i]);
//   pool->Release(table);                                           // request finished
//
// Thread-safety: not thread-safe; the engine thread owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvbridge/common/block_hash.h"
#include "kvbridge/common/status.h"

namespace kvbridge {

/// Told of every hash the prefix cache gains (a block registered by CacheFullBlock) or loses (a
/// cached-free block evicted by Allocate) — the source of the engine's KV events (kv_events.h).
/// Called synchronously on the pool's thread, after the change.
class BlockCacheListener {
 public:
  virtual ~BlockCacheListener() = default;
  virtual void OnBlockCached(const BlockHash& hash) = 0;
  virtual void OnBlockEvicted(const BlockHash& hash) = 0;
};

struct BlockPoolOptions {
  int64_t num_blocks = 0;  ///< > 0 and < 2^31
  int block_size = 16;     ///< tokens per block, > 0
  bool enable_prefix_caching = true;
};

class BlockPool {
 public:
  /// Errors: InvalidArgument (num_blocks or block_size out of range).
  static Result<std::unique_ptr<BlockPool>> Create(const BlockPoolOptions& options);

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int block_size() const { return options_.block_size; }
  bool prefix_caching_enabled() const { return options_.enable_prefix_caching; }

  /// Longest cached prefix of `hashes`: appends the block ids of the leading hashes that have a
  /// cached block to `block_ids` and returns how many. Changes nothing (call Allocate to take
  /// them). Always 0 when prefix caching is off.
  int MatchPrefix(std::span<const BlockHash> hashes, std::vector<int32_t>* block_ids) const;

  /// True when Allocate(num_new, reuse, ...) would succeed.
  bool CanAllocate(int64_t num_new, std::span<const int32_t> reuse = {}) const;
  /// Takes one reference on each block of `reuse` (prefix hits from MatchPrefix; they leave the
  /// LRU list if they were there), then takes `num_new` fresh blocks — the free list first, then
  /// the least recently used cached-free block (its hash is forgotten) — and appends their ids to
  /// `out`. Errors (nothing changed): ResourceExhausted (not enough blocks), InvalidArgument
  /// (a reuse id that is out of range or neither active nor cached).
  Status Allocate(int64_t num_new, std::span<const int32_t> reuse, std::vector<int32_t>* out);
  /// Takes one more reference on each block (fork). Errors (nothing changed): InvalidArgument
  /// (out of range), FailedPrecondition (a block with ref == 0).
  Status Share(std::span<const int32_t> blocks);
  /// Drops one reference on each block, in order. A block left with ref == 0 and hold == 0 goes
  /// to the LRU list (most recent last) when hashed, else to the free list. Errors (nothing
  /// changed): InvalidArgument (out of range), FailedPrecondition (a block with ref == 0; a
  /// block listed k times needs ref >= k).
  Status Release(std::span<const int32_t> blocks);

  /// Registers `block` (referenced, full, its KV final) as the cached block of `hash`. No-op when
  /// prefix caching is off, the block already has a hash, or another block holds `hash`.
  void CacheFullBlock(int32_t block, const BlockHash& hash);

  /// Holds `blocks` under `key` (a transfer hold): hold += 1 on each; they stay active until
  /// ReleaseHold(key), whatever happens to request references. Errors (nothing changed):
  /// AlreadyExists (key already held), InvalidArgument (out of range), FailedPrecondition (a
  /// block neither referenced nor held).
  Status Hold(std::string_view key, std::span<const int32_t> blocks);
  /// Releases the hold `key` exactly once. Errors: FailedPrecondition (not held: never held or
  /// already released), nothing changed.
  Status ReleaseHold(std::string_view key);
  bool IsHeld(std::string_view key) const { return holds_.count(std::string(key)) > 0; }
  size_t num_holds() const { return holds_.size(); }

  int RefCount(int32_t block) const { return blocks_[block].ref; }
  int HoldCount(int32_t block) const { return blocks_[block].hold; }
  bool IsCached(int32_t block) const { return blocks_[block].has_hash; }

  int64_t NumFree() const { return num_free_; }
  int64_t NumCachedFree() const { return num_cached_free_; }
  int64_t NumActive() const { return num_active_; }
  /// Distinct blocks with hold > 0.
  int64_t NumHeld() const { return num_held_; }
  /// Blocks that Allocate can hand out now: free + cached-free.
  int64_t NumAvailable() const { return num_free_ + num_cached_free_; }
  /// Cached blocks evicted so far.
  int64_t num_evictions() const { return num_evictions_; }

  /// Sets (null: clears) the listener of cache changes; not owned, must outlive the pool's use.
  void set_cache_listener(BlockCacheListener* listener) { listener_ = listener; }

  /// Recounts every set from scratch and checks the rules above. Errors: Internal, naming the
  /// first broken rule. O(num_blocks); for tests and debug builds.
  Status CheckInvariants() const;

 private:
  struct Block {
    int ref = 0;
    int hold = 0;
    bool has_hash = false;
    BlockHash hash;
    int32_t lru_prev = -1;  // intrusive LRU list, valid while cached-free
    int32_t lru_next = -1;
    bool in_lru = false;
  };
  explicit BlockPool(const BlockPoolOptions& options);
  void LruPushBack(int32_t b);
  void LruRemove(int32_t b);
  // Called when a block's ref and hold both reached 0.
  void Retire(int32_t b);
  // Takes one fresh block (free list first, then LRU head). Caller checked availability.
  int32_t TakeFresh();

  BlockPoolOptions options_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_list_;  // a stack; back() is handed out first
  int32_t lru_head_ = -1;
  int32_t lru_tail_ = -1;
  std::unordered_map<BlockHash, int32_t, BlockHashHasher> cached_;
  std::unordered_map<std::string, std::vector<int32_t>> holds_;
  int64_t num_free_ = 0;
  int64_t num_cached_free_ = 0;
  int64_t num_active_ = 0;
  int64_t num_held_ = 0;
  int64_t num_evictions_ = 0;
  BlockCacheListener* listener_ = nullptr;
};

}  // namespace kvbridge
