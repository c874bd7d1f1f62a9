// kvbridge/common/kv_events.h — the wire format of an engine's KV event stream
// (`GET /v1/kv/events`), shared by the engine that serves it (engine/kv_event_log.h) and the
// proxies that follow it (proxy/kv_index.h).
//
// An engine tells which block hashes (block_hash.h) its prefix cache stores and evicts. Events
// are numbered 1, 2, ... per engine *incarnation* (a random id minted at each start): a reader
// keeps (incarnation, last seq applied) and asks for what follows. When it cannot be continued —
// another incarnation (the engine restarted), a `since` older than the engine's bounded buffer or
// newer than its head — the answer is a *reset*: drop everything known of this engine, take the
// snapshot (every hash cached as of `next_since`), then continue from there.
//
//   GET /v1/kv/events?since=SEQ&incarnation=INC&timeout_ms=T&max_events=M
//   200 {"incarnation": "9c1f...", "block_size": 16, "root": "<hex32>", "head_seq": 812,
//        "next_since": 812, "reset": false, "snapshot": [],
//        "events": [{"seq": 811, "op": "stored", "hash": "<hex32>"},
//                   {"seq": 812, "op": "removed", "hash": "<hex32>"}]}
//
// `root` is RootBlockHash(model fingerprint): a proxy hashes prompts from it. `next_since` is
// what the reader passes as `since` next (the last event's seq, or the snapshot's seq).
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/block_hash.h"
#include "kvbridge/common/status.h"

namespace kvbridge {

enum class KvEventOp { kStored, kRemoved };
std::string_view KvEventOpName(KvEventOp op);  // "stored" / "removed"

struct KvEvent {
  uint64_t seq = 0;
  KvEventOp op = KvEventOp::kStored;
  BlockHash hash;
  friend bool operator==(const KvEvent&, const KvEvent&) = default;
};

/// One answer of the stream.
struct KvEventBatch {
  std::string incarnation;
  int block_size = 0;
  BlockHash root;
  uint64_t head_seq = 0;    ///< the engine's last seq (0: none yet)
  uint64_t next_since = 0;  ///< the reader's next `since`
  bool reset = false;       ///< drop this engine's entries, then apply `snapshot` and `events`
  std::vector<BlockHash> snapshot;  ///< when reset: every hash cached as of seq next_since
  std::vector<KvEvent> events;      ///< ascending seq, consecutive
};

std::string KvEventBatchJson(const KvEventBatch& batch);
/// Errors: InvalidArgument naming the field at fault.
Result<KvEventBatch> ParseKvEventBatch(std::string_view json);

}  // namespace kvbridge
