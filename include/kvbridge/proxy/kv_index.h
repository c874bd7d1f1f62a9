// kvbridge/proxy/kv_index.h — the proxy's view of which engine's prefix cache holds which block,
// built from the engines' KV event streams (common/kv_events.h), sans-IO.
//
// One entry per block hash: a bit per engine that reported it stored. A follower per engine
// (the runtime's long poll of GET /v1/kv/events, or a test) asks NextQuery(id) for the query of
// its next poll and hands each answer to Apply(id, batch). A reset batch (the engine restarted,
// or the follower fell behind the engine's buffer) replaces everything known of that engine by
// its snapshot; events continue from the cursor; a gap (events lost) or events of an unknown
// incarnation make the next poll ask for a snapshot. Duplicated or stale events are skipped by
// their seq. Whatever the events, the index only ever changes a route, never an answer: an entry
// is a hint that an engine may hold a block.
//
//   KvIndex index({.max_blocks = 1 << 20});
//   std::string q = index.NextQuery("decode-0", /*timeout_ms=*/2000);   // "since=0&..."
//   ... GET url + "/v1/kv/events?" + q → ParseKvEventBatch → index.Apply("decode-0", batch);
//   std::vector<BlockHash> hashes;  AppendBlockHashes(index.Engine("decode-0")->root, ids, 16,
//                                                     &hashes);
//   std::vector<int> blocks = index.PrefixBlocks(hashes, {"decode-0", "decode-1"});
//
// Memory: at most max_blocks distinct hashes (each ~100 bytes with its map and LRU nodes); past
// the cap the least recently stored hash goes (for every engine). An engine's entries go when it
// is dropped (DropEngine) or its incarnation changes. At most kMaxEngines (64) engines are
// indexed at once; another one gets ResourceExhausted from Apply and counts as holding nothing.
//
// Cost: PrefixBlocks is one hash-map lookup per prompt block until no candidate still matches,
// whatever the number of candidates (bit masks), so linear in the prompt's blocks.
//
// Thread-safety: none (the runtime wraps it in the proxy's mutex).
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvbridge/common/block_hash.h"
#include "kvbridge/common/kv_events.h"
#include "kvbridge/common/status.h"

namespace kvbridge::proxy {

struct KvIndexOptions {
  /// Distinct block hashes kept (>= 1); the least recently stored goes past it.
  size_t max_blocks = size_t{1} << 20;
};

/// What the index knows of one engine's stream.
struct KvEngineView {
  std::string incarnation;  ///< "" until the first batch, or after a gap (a snapshot is due)
  uint64_t next_since = 0;  ///< the `since` of the next poll
  int block_size = 0;       ///< tokens per block (from the stream; 0 until the first batch)
  BlockHash root;           ///< the engine's hash-chain root
  size_t num_blocks = 0;    ///< hashes indexed for this engine now
  uint64_t resets = 0;      ///< snapshots applied
  uint64_t gaps = 0;        ///< batches refused (gap, unknown incarnation)
};

class KvIndex {
 public:
  static constexpr int kMaxEngines = 64;

  explicit KvIndex(KvIndexOptions options = {});

  /// "since=S&incarnation=I&timeout_ms=T" for engine `id`'s next poll (since=0 and no
  /// incarnation for an engine not seen yet: the answer is a snapshot).
  std::string NextQuery(const std::string& id, int timeout_ms) const;
  /// Applies one answer of engine `id`'s stream (the rules at the top). Errors, after which the
  /// next query asks for a snapshot: FailedPrecondition (a gap in the seqs, or events of another
  /// incarnation without a reset); ResourceExhausted (kMaxEngines engines indexed already).
  Status Apply(const std::string& id, const KvEventBatch& batch);
  /// Forgets engine `id` and its entries (it left the registry). No-op when unknown.
  void DropEngine(const std::string& id);

  /// For a prompt's chain `hashes`, the number of leading blocks each of `engines` holds
  /// (0 for one not indexed); out[i] for engines[i].
  std::vector<int> PrefixBlocks(std::span<const BlockHash> hashes,
                                std::span<const std::string> engines) const;

  std::optional<KvEngineView> Engine(const std::string& id) const;
  std::vector<std::string> Engines() const;
  /// Distinct hashes indexed.
  size_t num_blocks() const { return entries_.size(); }
  /// (hash, engine) pairs indexed.
  size_t num_entries() const;
  /// Hashes dropped for the cap so far.
  uint64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    uint64_t mask = 0;  // bit s: engine of slot s holds it
    std::list<BlockHash>::iterator lru;
  };
  struct EngineState {
    KvEngineView view;
    int slot = -1;
  };
  void Insert(const BlockHash& h, int slot);
  void Remove(const BlockHash& h, int slot);
  void ClearSlot(int slot);
  void ApplyEvent(const KvEvent& e, EngineState& st);

  KvIndexOptions options_;
  std::map<std::string, EngineState> engines_;
  uint64_t free_slots_ = ~uint64_t{0};
  size_t slot_count_[kMaxEngines] = {};
  std::unordered_map<BlockHash, Entry, BlockHashHasher> entries_;
  std::list<BlockHash> lru_;  // front = least recently stored
  uint64_t evictions_ = 0;
};

}  // namespace kvbridge::proxy
