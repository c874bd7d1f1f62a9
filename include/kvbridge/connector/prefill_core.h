// kvbridge/connector/prefill_core.h — the prefill half of the READ-mode P/D protocol, sans-IO.
//
// Holds the prompt blocks of requests with do_remote_decode under a lease until the decode that
// reads them says it is done (DESIGN.md "READ mode" steps 1, 3, 4; docs/protocol.md has the
// sequence diagram and the state table). The transfer table is keyed by (this engine's
// incarnation, transfer_id) and maps to the SET of sibling requests sharing the transfer
// (DESIGN.md pitfall 1): one completion frees every finished sibling, a sibling finishing later is
// freed when it finishes, unmapping one sibling leaves the others, the key goes with the last.
//
//   PrefillCore core({.engine_id = "p0-1a2b", .lease = 60 * kSecond});
//   core.OnRequestAdded("cmpl-1", /*n=*/1, "xfer-1", now);
//   bool hold = core.OnRequestFinished("cmpl-1", "xfer-1", blocks, now);   // true
//   core.OnReadDone(read_done_msg, reply_token, now);   // → SendMessage(HoldReply valid),
//                                                       //   ReportBlocksFree("cmpl-1")
//   for (auto& a : core.TakeActions()) ...
//
// Transfer states: kOpen (siblings mapped; held blocks stay) → kDone(reason) when every expected
// decode rank notified (kCompleted), an explicit release came (kReleased) or the lease ran out
// (kExpired). In kDone every held sibling is freed at once and every later-finishing sibling is
// not held. The entry leaves the table with its last sibling and leaves a tombstone (TTL = lease)
// so late duplicates are recognised and answered consistently.
//
// Claim lease (DESIGN.md "Failures"; docs/protocol.md "Claim lease"): a hold that no decode has
// claimed yet (no heartbeat or read_done naming the transfer) lives under Options::claim_lease
// (a few seconds), so a hold whose proxy died between the legs is not kept for a whole lease;
// the first claim puts it under the usual heartbeat-extended lease. The claiming decode is
// remembered: OnPeerLost(that decode) releases its holds at once (READ: safe, the decode's
// hold reply then says "peer_lost" and it recomputes).
//
// Messages naming a transfer this engine has not registered are parked (at most
// max_parked_messages, TTL = lease) and applied when it registers; dropped and counted at TTL.
//
// Thread-safety: not thread-safe; one owner thread (the engine thread, or the simulator).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/status.h"
#include "kvbridge/connector/actions.h"
#include "kvbridge/connector/messages.h"

namespace kvbridge {

class PrefillCore {
 public:
  struct Options {
    std::string engine_id;  ///< this engine incarnation (kv_transfer_params.remote_engine_id)
    /// The engine's TP size. One core covers every rank (the ranks share one block table): it
    /// takes messages for any prefill rank in [0, tp_size) and completes a transfer when every
    /// (decode rank, prefill rank) pair of the TP plan (tp_plan.h) has notified.
    int tp_size = 1;
    /// The model's global KV heads (the TP plan depends on them when fewer than a TP size).
    /// 0: assume enough heads that they split evenly over both TP sizes.
    int num_kv_heads = 0;
    DurationUs lease = 60 * kSecond;
    /// A hold no decode has claimed yet is freed this long after its first hold (counted in
    /// claims_expired); 0: no claim lease (the lease applies from the first hold).
    DurationUs claim_lease = 0;
    int64_t max_parked_messages = 4096;
    int64_t max_tombstones = 65536;
  };
  /// Why a transfer left kOpen.
  enum class DoneReason : uint8_t {
    kCompleted = 0,
    kReleased = 1,
    kExpired = 2,
    kAborted = 3,
    kUnclaimed = 4,  ///< the claim lease passed with no decode's claim
    kPeerLost = 5,   ///< the decode that claimed it was lost (OnPeerLost)
  };

  struct Counters {
    int64_t holds = 0;                  ///< siblings whose blocks were held
    int64_t holds_freed = 0;            ///< ReportBlocksFree emitted
    int64_t lease_expired = 0;          ///< transfers freed by the lease
    int64_t claims_expired = 0;         ///< transfers freed by the claim lease (never claimed)
    int64_t peer_lost = 0;              ///< transfers freed because their decode was lost
    int64_t transfers_completed = 0;    ///< every expected decode rank notified
    int64_t transfers_released = 0;     ///< explicit release (proxy / decode skip)
    int64_t notifications_parked = 0;   ///< messages parked (total)
    int64_t notifications_ignored = 0;  ///< duplicate, late, misrouted, stale or dropped at TTL
    int64_t parked_dropped = 0;         ///< of those: parked messages dropped (TTL or full)
  };

  explicit PrefillCore(Options options);

  /// A parent request with do_remote_decode entered the engine: maps its n siblings ("{i}_{id}"
  /// for n > 1, else `parent_id`) to `transfer_id` and applies parked messages for it.
  /// AlreadyExists when a sibling id is already mapped; InvalidArgument for n < 1 or a bad id.
  Status OnRequestAdded(const std::string& parent_id, int n, const std::string& transfer_id,
                        TimePoint now);
  /// The engine finished `request_id` (any reason but abort): returns true when its blocks are
  /// held (the engine keeps them until ReportBlocksFree(request_id)), false when the transfer is
  /// already done (the engine frees them now). `block_ids` are the prompt's blocks.
  bool OnRequestFinished(const std::string& request_id, const std::string& transfer_id,
                         std::span<const int32_t> block_ids, TimePoint now);
  /// The engine aborted `request_id` (a sibling id or a parent id with n > 1). Returns true when
  /// blocks of it are held (they stay until ReportBlocksFree); unfinished siblings are unmapped.
  bool OnRequestAborted(const std::string& request_id, TimePoint now);

  /// A request with do_remote_decode `transfer_id` was aborted before the engine admitted it
  /// (OnRequestAdded never ran): nothing was or will be held for it. Drops the messages parked
  /// for it at once (a proxy's release racing the abort: dropped, not counted ignored) and
  /// leaves a tombstone (TTL = lease) so later messages for it are answered, not parked for a
  /// lease. A no-op when the transfer is registered (its own abort path owns it).
  void OnAbortedBeforeAdmission(const std::string& transfer_id, TimePoint now);

  /// A decode rank's ReadDone. Answers with HoldReplyMsg on `reply_token` when want_reply.
  void OnReadDone(const ReadDoneMsg& msg, uint64_t reply_token, TimePoint now);
  /// A queued or reading decode extends the lease to now + lease.
  void OnHeartbeat(const HeartbeatMsg& msg, TimePoint now);
  /// Explicit release (the proxy). NotFound when prefill_engine_id names another incarnation;
  /// OK otherwise (applied, parked, or a duplicate no-op).
  Status OnRelease(const ReleaseMsg& msg, TimePoint now);
  /// Fires leases and drops expired parked messages.
  void OnTick(TimePoint now);
  /// The decode engine incarnation `decode_engine_id` is lost (either PeerLoss: a READ hold is
  /// safe to free on a suspicion too). Every open transfer it claimed is freed now (reason
  /// "peer_lost"), and messages it sent that are parked are dropped. Returns the transfers
  /// freed.
  int64_t OnPeerLost(const std::string& decode_engine_id, TimePoint now);
  /// Open transfers claimed by `decode_engine_id` and the distinct blocks they hold (per-peer
  /// accounting).
  std::pair<int64_t, int64_t> BoundTo(const std::string& decode_engine_id) const;
  /// The earliest claim-lease deadline of a hold no decode has claimed (nullopt: none).
  std::optional<TimePoint> EarliestClaimDeadline() const;

  std::vector<ConnectorAction> TakeActions();
  /// Earliest lease or parked-message TTL, if any.
  std::optional<TimePoint> NextDeadline() const;
  /// True when no transfer is mapped and nothing is parked.
  bool Idle() const;

  /// True when `transfer_id` is open and its held siblings hold every block in `block_ids` (the
  /// tcp backend's serving-side check).
  bool IsHeld(const std::string& transfer_id, std::span<const int32_t> block_ids) const;
  /// Held blocks per open transfer (for the transfer agent's hold check snapshot).
  std::map<std::string, std::vector<int32_t>> HeldBlocksByTransfer() const;
  /// Distinct blocks held across all transfers.
  int64_t NumHeldBlocks() const;
  int64_t NumTransfers() const { return static_cast<int64_t>(transfers_.size()); }
  int64_t NumParked() const { return static_cast<int64_t>(parked_.size()); }
  /// Sibling ids mapped to `transfer_id` (sorted; empty when unknown).
  std::vector<std::string> Siblings(const std::string& transfer_id) const;
  const Counters& counters() const { return counters_; }
  const Options& options() const { return options_; }

 private:
  struct Sibling {
    bool held = false;
    std::vector<int32_t> blocks;
  };
  struct Transfer {
    std::map<std::string, Sibling> siblings;
    bool open = true;
    DoneReason reason = DoneReason::kCompleted;
    std::optional<TimePoint> lease_deadline;  // set at the first hold
    TimePoint lease_floor = 0;                // heartbeats before the first hold
    std::string claimed_by;                   // the decode engine that claimed it ("" : none)
    bool under_claim_lease = false;           // lease_deadline is the claim lease's
    std::optional<int> decode_tp;
    // (decode rank, prefill rank) -> hold was valid at its ReadDone
    std::map<std::pair<int, int>, bool> notified;
  };
  struct Tombstone {
    DoneReason reason;
    std::map<std::pair<int, int>, bool> notified;
    TimePoint expires;
  };
  struct Parked {
    ControlMessage msg;
    uint64_t reply_token;
    TimePoint received;
    TimePoint expires;
  };

  Transfer& Register(const std::string& transfer_id, TimePoint now);
  // A decode named the transfer (heartbeat, read_done): the first claim puts a hold under the
  // claim lease under the usual lease from now.
  void Claim(Transfer& t, const std::string& decode_engine_id, TimePoint now);
  bool ServesRank(int prefill_rank) const;
  /// The (decode rank, prefill rank) pairs that must notify before a transfer completes.
  std::vector<std::pair<int, int>> ExpectedPairs(int decode_tp) const;
  void ApplyReadDone(Transfer& t, const std::string& transfer_id, const ReadDoneMsg& msg,
                     uint64_t reply_token, bool already_replied, bool complete, TimePoint now);
  void MaybeComplete(Transfer& t, const std::string& transfer_id, TimePoint now);
  void Finish(const std::string& transfer_id, DoneReason reason, TimePoint now);
  void EraseIfEmpty(const std::string& transfer_id, TimePoint now);
  void Reply(const ReadDoneMsg& msg, uint64_t reply_token, bool valid, std::string reason);
  void Park(ControlMessage msg, const std::string& transfer_id, uint64_t reply_token,
            TimePoint now);
  static std::string_view ReasonName(DoneReason r);

  Options options_;
  std::map<std::string, Transfer> transfers_;               // transfer_id -> entry
  std::map<std::string, std::string> sibling_to_transfer_;  // request id -> transfer_id
  std::map<std::string, std::vector<std::string>> parent_to_siblings_;
  std::map<std::string, Tombstone> tombstones_;
  std::deque<std::pair<TimePoint, std::string>> tombstone_order_;
  std::multimap<std::string, Parked> parked_;  // transfer_id -> parked, in order
  std::vector<ConnectorAction> actions_;
  Counters counters_;
};

}  // namespace kvbridge
