// kvbridge/engine/kv_event_log.h — an engine's KV events: the block hashes its prefix cache
// stores and evicts, numbered per engine incarnation, kept in a bounded buffer and served to any
// number of followers (`GET /v1/kv/events`, wire format in common/kv_events.h).
//
// The block pool reports each change (BlockCacheListener, on the engine thread); the log gives it
// the next seq, appends it to a ring of `capacity` events (the oldest dropped) and keeps the set
// of hashes cached now, from which a reader that fell behind the ring (or that follows another
// incarnation, or none yet) gets a snapshot. Read/WaitAndRead are what the HTTP route calls.
//
//   auto log = std::make_shared<KvEventLog>(KvEventLogOptions{.block_size = 16,
//                                                            .model_fingerprint = fp});
//   engine_config.kv_cache_listener = log;               // the pool reports into it
//   server->RegisterRoute(KvEventsRoute(log, cluster_token));
//   KvEventBatch b = log->Read(/*since=*/0, /*incarnation=*/"", /*max_events=*/1024);
//   // b.reset: b.snapshot is every hash cached now; next time Read(b.next_since, b.incarnation)
//
// Rules of Read(since, incarnation): a reset (snapshot of the cached set at head, no events)
// when `incarnation` is not this log's (an empty one included), when since > head (a reader
// ahead of this log: it followed a log that no longer exists) or when events after `since` were
// already dropped from the ring (since + 1 < the oldest kept seq); otherwise the events with
// seq > since, at most max_events, in order.
//
// Thread-safety: thread-safe. The listener calls come from the engine thread; Read,
// WaitAndRead and Close from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_set>

#include "kvbridge/common/http_route.h"
#include "kvbridge/common/kv_events.h"
#include "kvbridge/common/thread_annotations.h"
#include "kvbridge/engine/block_pool.h"

namespace kvbridge {

struct KvEventLogOptions {
  /// Events kept for readers that ask for what follows `since` (>= 1). A reader further behind
  /// gets a snapshot. 65536 events ≈ 2.5 MiB.
  size_t capacity = 65536;
  /// The engine's tokens per block and model fingerprint (the hash chain's root).
  int block_size = 16;
  std::string model_fingerprint;
  /// Empty: 16 random hex digits (std::random_device), a new one per log, i.e. per engine start.
  std::string incarnation;
};

class KvEventLog : public BlockCacheListener {
 public:
  explicit KvEventLog(KvEventLogOptions options);

  void OnBlockCached(const BlockHash& hash) override;
  void OnBlockEvicted(const BlockHash& hash) override;

  /// See the rules above. max_events >= 1 (0 is taken as 1).
  KvEventBatch Read(uint64_t since, std::string_view incarnation, size_t max_events) const;
  /// Read, but when it would return no events and no reset, waits up to `timeout` for one (a
  /// long poll); returns early on Close().
  KvEventBatch WaitAndRead(uint64_t since, std::string_view incarnation, size_t max_events,
                           std::chrono::milliseconds timeout);
  /// Wakes every waiter; later waits return at once (engine shutdown).
  void Close();

  const std::string& incarnation() const { return incarnation_; }
  int block_size() const { return options_.block_size; }
  const BlockHash& root() const { return root_; }
  uint64_t head_seq() const;
  /// Hashes cached now (the snapshot's size).
  size_t num_cached() const;

 private:
  void Append(KvEventOp op, const BlockHash& hash);
  KvEventBatch ReadLocked(uint64_t since, std::string_view incarnation, size_t max_events) const
      REQUIRES(mu_);
  bool HasNewsLocked(uint64_t since, std::string_view incarnation) const REQUIRES(mu_);

  const KvEventLogOptions options_;
  const std::string incarnation_;
  const BlockHash root_;
  mutable Mutex mu_;
  std::condition_variable cv_;
  std::deque<KvEvent> ring_ GUARDED_BY(mu_);  // seqs head - size + 1 .. head
  uint64_t head_seq_ GUARDED_BY(mu_) = 0;
  std::unordered_set<BlockHash, BlockHashHasher> cached_ GUARDED_BY(mu_);
  int waiters_ GUARDED_BY(mu_) = 0;
  bool closed_ GUARDED_BY(mu_) = false;
};

/// GET /v1/kv/events?since=SEQ&incarnation=INC&timeout_ms=T&max_events=M (all optional: since
/// 0, incarnation "", timeout_ms 0 = answer at once, at most 30000; max_events 4096, at most
/// 65536). 200 with KvEventBatchJson; 400 for a query value that is not an integer; 401 without
/// `cluster_token` (when one is set) in X-KVBridge-Cluster-Token. The handler blocks its HTTP
/// thread for the long poll.
Route KvEventsRoute(std::shared_ptr<KvEventLog> log, std::string cluster_token);

}  // namespace kvbridge
