// kvbridge/connector/write_prefill_core.h — the prefill half of the WRITE-mode P/D protocol (the
// prefill pushes), sans-IO; the decode half is write_decode_core.h.
//
// DESIGN.md "WRITE mode"; docs/protocol.md "WRITE mode" has the sequence and the state tables.
// The proxy sends both legs at once. The decode reserves blocks for the parent and sends
// WriteBlocksMsg{transfer_id, decode engine + rank, the blocks its prefix cache lacks} to each
// prefill rank that writes to it (the TP plan's pairs, TpPlanPairs). The prefill parks whichever of
// the request and the block-id message comes first; once both are there, it posts one WRITE per
// layer right after that layer of the request's final prefill chunk is computed (the transfer
// overlaps the rest of the forward pass), and after the last layer's data landed it sends
// WriteDoneMsg(ok) and releases its own blocks. The decode proceeds when every writing rank said
// ok.
//
//   WritePrefillCore p({.engine_id = "p0", .block_size = 16, .num_layers = 2});
//   WriteDecodeCore d({.engine_id = "d0", .block_size = 16});
//   d.OnRequestAdded("c1", params, 40, 0, now);            // {39 external tokens, async}
//   d.OnBlocksAllocated("c1", table, 0, 39, now);          // → SendMessage(WriteBlocks)
//   p.OnRequestAdded("c1", 1, "xfer-1", 40, now);
//   p.OnWriteBlocks(write_blocks, now);
//   p.OnLayerComputed("c1", 0, prefill_table, now);        // → PostWrite(layer 0)
//   p.OnLayerComputed("c1", 1, prefill_table, now);        // → PostWrite(layer 1)
//   p.OnRequestFinished("c1", prefill_table, now);         // true: hold until the writes drain
//   p.OnWriteCompleted(1, OkStatus(), now); p.OnWriteCompleted(2, OkStatus(), now);
//                                                          // → SendMessage(WriteDone ok),
//                                                          //   ReportBlocksFree("c1")
//   d.OnWriteDone(write_done, now);                        // → ReportLoadDone("c1")
//
// Safety: a decode block that a write may still reach is never freed. An aborted decode sends
// WriteCancelMsg and keeps its blocks until WriteDoneMsg (any outcome: "drained") arrives or
// write_timeout (= the prefill's lease + a grace) passed; the prefill never posts or keeps a
// write for a WriteBlocks older than its lease, so after lease + grace nothing can land.
//
// Thread-safety: not thread-safe; one owner thread each (the engine thread, or the simulator).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/status.h"
#include "kvbridge/connector/actions.h"
#include "kvbridge/connector/kv_transfer_config.h"
#include "kvbridge/connector/messages.h"

namespace kvbridge {

/// The prefill half of WRITE mode: one core per engine, for every TP rank (as PrefillCore). Each
/// rank keeps its own state machine (its own lease, parked messages and write
/// ids: each rank's agent writes on its own); the engine's events go to every rank, a decode's
/// block-id or cancel message to the rank it names. Counters are summed over the ranks.
///
/// Transfer entry states (per rank): kCollecting (request and/or block-id messages present; writes
/// posted as layers are computed) → kClosing (aborted, released or lease expired: in-flight writes
/// are cancelled and every decode rank is told WriteDone(failed) once they drained) → gone (a
/// tombstone of TTL = lease remembers why, so late messages are answered consistently).
/// A transfer completes when every expected decode rank has had WriteDone(ok) (or skipped). A
/// rank that is the source of no slice for the decode's TP (replicated KV heads, Tp > Td) is
/// told so by a skip (WriteCancel, want_done = false, from decode rank 0) and completes on it.
class WritePrefillCore {
 public:
  struct Options {
    std::string engine_id;  ///< this engine incarnation
    /// The engine's TP size. One core covers every rank (the ranks share one block table): it
    /// takes messages for any prefill rank in [0, tp_size), rank r's write ids count up from
    /// (r << kRankShift) + 1, and the request's blocks are freed once, when the last rank that
    /// held them lets go.
    int tp_size = 1;
    /// The model's global KV heads, for the TP plan (tp_plan.h) that says which decode ranks
    /// this rank writes to (TpPlanPairs). 0: assume enough heads that they split evenly.
    int num_kv_heads = 0;
    int block_size = 16;
    int num_layers = 1;  ///< layers of the model (a target is done after all of them)
    DurationUs lease = 60 * kSecond;
    int64_t max_parked_messages = 4096;
    int64_t max_tombstones = 65536;
  };
  struct Counters {
    int64_t holds = 0;                ///< requests whose blocks were held at finish
    int64_t holds_freed = 0;          ///< ReportBlocksFree emitted
    int64_t lease_expired = 0;        ///< transfers closed by the lease
    int64_t transfers_completed = 0;  ///< every expected decode rank got WriteDone(ok)
    int64_t transfers_released = 0;   ///< explicit release (proxy)
    int64_t transfers_aborted = 0;    ///< the prefill request was aborted
    int64_t writes_posted = 0;
    int64_t writes_ok = 0;
    int64_t writes_failed = 0;   ///< failed or cancelled writes
    int64_t targets_ok = 0;      ///< WriteDone(ok) sent
    int64_t targets_failed = 0;  ///< WriteDone(failed|cancelled) sent
    int64_t notifications_parked = 0;
    int64_t notifications_ignored = 0;  ///< duplicate, late, unknown completions and messages
    int64_t parked_dropped = 0;         ///< parked messages dropped (TTL or full)
    int64_t peer_lost = 0;              ///< targets cancelled because their decode was lost
    int64_t transfer_us_sum = 0;        ///< over targets_ok: first WRITE posted → last WRITE done
    int64_t compute_us_sum = 0;         ///< over completed transfers: first → last layer computed
  };

  /// A write id's prefill rank is `id >> kRankShift`.
  static constexpr int kRankShift = 40;

  explicit WritePrefillCore(Options options);
  /// Per target written completely: first WRITE posted → last WRITE done (µs), in order (rank
  /// by rank).
  std::vector<int64_t> TakeTransferTimes();

  /// A parent request with do_remote_decode in write mode entered the engine. The prefill leg
  /// of a WRITE transfer carries n = 1 (the proxy's shape): InvalidArgument otherwise, and for a
  /// bad id; AlreadyExists when the transfer or request is already registered. Applies parked
  /// messages for the transfer.
  Status OnRequestAdded(const std::string& request_id, int n, const std::string& transfer_id,
                        int num_prompt_tokens, TimePoint now);
  /// Layer `layer` of `request_id`'s final prefill chunk was written to the KV cache (every
  /// prompt position's KV of that layer is final); `block_table` is its block table (token
  /// order). Posts that layer's WRITE to every decode rank waiting for it. Ignored for unknown
  /// requests and for layers already seen (later decode steps).
  void OnLayerComputed(const std::string& request_id, int layer,
                       std::span<const int32_t> block_table, TimePoint now);
  /// The engine finished `request_id` (any reason but abort). True: hold its blocks until
  /// ReportBlocksFree(request_id) (writes pending, or the block-id messages not all in yet,
  /// under the lease; one ReportBlocksFree follows, after the last holding rank); false: free them
  /// now.
  bool OnRequestFinished(const std::string& request_id, std::span<const int32_t> block_ids,
                         TimePoint now);
  /// The engine aborted `request_id`. Cancels its writes and tells every decode rank
  /// (WriteDone failed "aborted") once they drained. True: keep its blocks until
  /// ReportBlocksFree (a write may still read them).
  bool OnRequestAborted(const std::string& request_id, TimePoint now);

  /// A request with do_remote_decode (write mode) for `transfer_id` was aborted before
  /// OnRequestAdded (still queued): answers its parked block-id messages WriteDone(failed
  /// "aborted") and remembers the transfer as aborted (TTL = lease) for later ones.
  void OnAbortedBeforeAdmission(const std::string& transfer_id, TimePoint now);
  /// A decode rank's block ids, for the prefill rank the message names (out of range: refused).
  /// Answered with WriteDone(failed) when the transfer was aborted, released or expired, the
  /// incarnation is not ours, or the prompt does not match.
  void OnWriteBlocks(const WriteBlocksMsg& msg, TimePoint now);
  /// A decode rank stops (abort) or never needed writes (skip, want_done = false).
  void OnWriteCancel(const WriteCancelMsg& msg, TimePoint now);
  /// Explicit release (the proxy: the decode leg failed), on every rank. NotFound for another
  /// incarnation.
  Status OnRelease(const ReleaseMsg& msg, TimePoint now);
  /// WRITE `write_id` ended: OK (landed at the decode) or an error / Cancelled (no more bytes).
  /// An id of no rank here is counted as ignored.
  void OnWriteCompleted(uint64_t write_id, const Status& status, TimePoint now);
  /// Fires leases, write bounds and parked-message TTLs.
  void OnTick(TimePoint now);
  /// The decode engine incarnation `decode_engine_id` is lost (either PeerLoss: this side only
  /// stops writing). Every active target in it is cancelled without a WriteDone (its writes in
  /// flight are cancelled; this engine's blocks are freed once they drained, as for a decode's
  /// cancel), and its parked block ids are dropped. Returns the targets cancelled.
  int64_t OnPeerLost(const std::string& decode_engine_id, TimePoint now);

  std::vector<ConnectorAction> TakeActions();
  std::optional<TimePoint> NextDeadline() const;
  /// True when no transfer is registered, nothing is parked and no blocks are held.
  bool Idle() const;
  int64_t NumTransfers() const;  ///< max over ranks
  int64_t NumParked() const;     ///< sum over ranks
  /// True when `transfer_id` is registered or recently ended here (routes a proxy release).
  bool Knows(const std::string& transfer_id) const;
  /// Distinct blocks held for unfinished writes (requests finished and held; max over ranks:
  /// they share one block table).
  int64_t NumHeldBlocks() const;
  /// WRITEs posted and not yet completed (sum over ranks).
  int64_t NumWritesInFlight() const;
  Counters counters() const;                   ///< sums over ranks
  const Counters& rank_counters(int r) const;  ///< rank r in [0, tp_size)
  int tp_size() const { return options_.tp_size; }
  const Options& options() const { return options_; }

 public:
  /// One (prefill rank, decode rank) target's state (the table is in write_prefill_core.cc).
  enum class TargetState : uint8_t { kActive, kCancelling, kDone };
  static std::string_view TargetStateName(TargetState s);

 private:
  struct Target {
    WriteBlocksMsg msg;
    TargetState state = TargetState::kActive;
    bool want_done = true;  // false: skipped, or cancelled without confirmation
    std::vector<bool> layer_posted;
    int layers_posted = 0;
    std::set<uint64_t> inflight;
    uint64_t done_attached = 0;  // write id whose notification is our WriteDone(ok)
    bool write_failed = false;
    WriteOutcome outcome = WriteOutcome::kOk;
    std::string reason;
    TimePoint received = 0;
    TimePoint first_post = -1;
    TimePoint last_done = -1;
  };
  enum class CloseReason : uint8_t { kNone, kAborted, kReleased, kExpired, kCompleted };
  struct Transfer {
    std::string request_id;  // empty until the request registered
    int num_prompt_tokens = 0;
    std::vector<int32_t> blocks;  // the request's block table, once known
    std::vector<bool> layer_computed;
    int layers_computed = 0;
    TimePoint first_layer_at = -1;
    TimePoint last_layer_at = -1;
    bool finished = false;      // the engine finished the request
    bool held = false;          // its blocks are held until ReportBlocksFree
    bool aborted_keep = false;  // aborted with blocks kept until the writes drained
    bool gone = false;          // the engine no longer knows the request (finished or aborted)
    CloseReason close = CloseReason::kNone;
    std::optional<int> decode_tp;
    std::map<int, Target> targets;  // decode rank -> target
    std::optional<TimePoint> lease_deadline;
  };
  // The checked transition: an illegal one changes nothing and returns FailedPrecondition;
  // Move fails the target with it (the decode is told WriteDone(failed) with that reason).
  [[nodiscard]] static Status SetState(Target& g, TargetState to);
  static void Move(Target& g, TargetState to);
  struct Tombstone {
    CloseReason reason;
    TimePoint expires;
  };
  struct Parked {
    ControlMessage msg;
    TimePoint expires;
  };

  // One rank's state machine.
  struct Rank {
    int rank = 0;
    uint64_t next_write_id = 1;
    std::map<std::string, Transfer> transfers;               // transfer_id -> entry
    std::map<std::string, std::string> request_to_transfer;  // request id -> transfer_id
    std::map<uint64_t, std::pair<std::string, int>> writes;  // write id -> (tid, decode rank)
    std::map<std::string, Tombstone> tombstones;
    std::deque<std::pair<TimePoint, std::string>> tombstone_order;
    std::multimap<std::string, Parked> parked;  // transfer_id -> parked, in order
    // (transfer_id, decode engine, decode rank) settled by a WriteCancel(want_done) that came
    // before its WriteBlocks; forgotten with the transfer's tombstone.
    std::set<std::tuple<std::string, std::string, int>> overtaken_cancels;
    std::vector<ConnectorAction> actions;
    std::vector<int64_t> transfer_times;
    Counters counters;
  };

  Status AddRequest(Rank& k, const std::string& request_id, const std::string& transfer_id,
                    int num_prompt_tokens, TimePoint now);
  bool Finish(Rank& k, const std::string& request_id, std::span<const int32_t> block_ids,
              TimePoint now);
  bool Abort(Rank& k, const std::string& request_id, TimePoint now);
  void AbortQueued(Rank& k, const std::string& transfer_id, TimePoint now);
  Status Release(Rank& k, const ReleaseMsg& msg, TimePoint now);
  void Tick(Rank& k, TimePoint now);
  void AddTarget(Rank& k, const std::string& tid, Transfer& t, const WriteBlocksMsg& msg,
                 TimePoint now);
  void ApplyCancel(Rank& k, const std::string& tid, Transfer& t, const WriteCancelMsg& msg);
  void PostLayer(Rank& k, const std::string& tid, Transfer& t, Target& g, int layer, TimePoint now);
  void CancelTarget(Rank& k, Target& g, WriteOutcome outcome, std::string reason);
  void Close(Rank& k, Transfer& t, CloseReason reason);
  void SendDone(Rank& k, const Transfer& t, Target& g, TimePoint now);
  WriteDoneMsg MakeDone(const Rank& k, const Transfer& t, const Target& g, TimePoint now) const;
  void Reject(Rank& k, const WriteBlocksMsg& msg, std::string reason);
  // A decode's WriteCancel(want_done) that overtook its WriteBlocks settled the pair without a
  // route back; when the block ids arrive, confirm the (empty) drain to them. True: answered.
  bool AnswerOvertakenCancel(Rank& k, const WriteBlocksMsg& msg);
  // Sends finished targets' WriteDone, frees blocks and erases the entry when everything ended.
  void Advance(Rank& k, const std::string& tid, TimePoint now);
  void Park(Rank& k, ControlMessage msg, const std::string& tid, TimePoint now);
  void Bury(Rank& k, const std::string& tid, CloseReason reason, TimePoint now);
  void RecordOk(Rank& k, const Target& g);
  std::vector<int> ExpectedDecodeRanks(const Rank& k, const Transfer& t) const;
  // Decode ranks rank k writes to (the TP plan's pairs with this prefill rank).
  std::vector<int> DecodeRanksWrittenBy(const Rank& k, int decode_tp) const;
  // The TP plan's head slice from `prefill_rank` to `decode_rank` (none: whole blocks).
  void SetHeadSlice(int prefill_rank, int decode_rank, int decode_tp, PostTransferAction& a) const;
  // The rank a decode's message names (a rank this core does not run: the first, which refuses).
  Rank& RankFor(int prefill_rank);
  // The request's blocks stay held while any rank in `ranks` holds them.
  bool Hold(const std::string& request_id, const std::set<int>& ranks);
  static std::string_view ReasonName(CloseReason r);

  Options options_;
  std::vector<Rank> ranks_;                       // [0, tp_size)
  std::map<std::string, std::set<int>> holders_;  // request id -> ranks holding its blocks
  int64_t ignored_ = 0;                           // completions for a rank not run here
};

}  // namespace kvbridge
