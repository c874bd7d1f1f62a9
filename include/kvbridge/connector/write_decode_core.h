// kvbridge/connector/write_decode_core.h — the decode half of the WRITE-mode P/D protocol (the
// prefill pushes), sans-IO; the prefill half is write_prefill_core.h.
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

/// The decode half of WRITE mode (one per decode engine; it sends for all its ranks).
///
/// Request states (RequestState; the table is kRequestTransitions in write_decode_core.cc):
///
///   kAwaitingAlloc ─alloc─► kWaiting ─every pair ok──────────────────► kReported (LoadDone)
///     │                       │  └─a write failed / timed out─► kFailing
///     │                       │                                   │ └─drained─► kReported
///     │                       │                                   │ abort        (LoadFailed)
///     │                       └─abort, a pair may still write─► kAborting
///     │                                         drained, or lease + grace─► kReported (BlocksFree)
///     └─abort (nothing offered yet)─► kReported (the engine frees the blocks now)
///
/// An abort before the allocation offers nothing, so the entry goes at once; one after it keeps
/// the blocks (kAborting) until every pair drained. A request is reported exactly once and its
/// entry goes with the report; WriteDone for no waiting pair is dropped and counted.
class WriteDecodeCore {
 public:
  struct Options {
    std::string engine_id;  ///< this decode engine incarnation
    int tp_size = 1;
    /// The model's global KV heads, for the TP plan's (decode rank, prefill rank) pairs
    /// (TpPlanPairs). 0: assume enough heads that they split evenly over both TP sizes.
    int num_kv_heads = 0;
    int block_size = 16;
    /// Bound on waiting for a prefill rank's WriteDone after WriteBlocks (and on keeping an
    /// aborted request's blocks): the prefill's lease plus a grace for message delays.
    DurationUs write_timeout = 70 * kSecond;
    LoadFailurePolicy load_failure_policy = LoadFailurePolicy::kRecompute;
  };
  struct Match {
    int num_external_tokens = 0;
    bool load_async = false;
  };
  struct Counters {
    int64_t loads_done = 0;
    int64_t load_failures = 0;   ///< ReportLoadFailed emitted
    int64_t write_failures = 0;  ///< WriteDone(failed|cancelled) received for a waiting pair
    int64_t write_timeouts = 0;
    int64_t skipped = 0;  ///< requests whose prefix cache had every needed block
    int64_t aborts_mid_write = 0;
    int64_t notifications_ignored = 0;
    int64_t peer_lost = 0;  ///< requests failed because their prefill was lost
    /// Sum over loads_done of the overlap: the prefill's last layer computed → this decode's go
    /// (microseconds; the prefill part measured there, plus the time here since WriteDone
    /// arrived; the one-way message delay is not included).
    int64_t overlap_us_sum = 0;
    int64_t write_us_sum = 0;    ///< sum of the prefill's first write posted → last write done
    int64_t compute_us_sum = 0;  ///< sum of the prefill's final-chunk compute times
  };
  /// What one finished load measured (for metrics), taken with TakeLoadTimings().
  struct LoadTiming {
    int64_t overlap_us = 0;        ///< estimate: prefill's last layer → write_done sent + here
    int64_t last_layer_at_us = 0;  ///< the prefill's clock (write_done's last_layer_at_us), max
    int64_t go_at = 0;             ///< `now` of the go
    int64_t write_us = 0;
    int64_t compute_us = 0;
  };

  explicit WriteDecodeCore(Options options);

  /// A parent request with do_remote_prefill in write mode is about to be allocated. Returns the
  /// tokens that arrive remotely: max(0, num_prompt_tokens - 1 - num_local_computed_tokens);
  /// when 0, each prefill rank is told at once (WriteCancel, want_done = false) and no entry is
  /// kept. Prefill ranks that the TP plan reads nothing from (replicated heads, params.tp_size >
  /// this TP) get that skip at once in every case. InvalidArgument when params are not a
  /// write-mode decode leg or the local hit is not a multiple of block_size; AlreadyExists when
  /// the transfer or request is active.
  Result<Match> OnRequestAdded(const std::string& request_id, const KvTransferParams& params,
                               int num_prompt_tokens, int num_local_computed_tokens, TimePoint now);
  /// The engine allocated `block_ids` (the whole table). Sends WriteBlocks to every prefill rank.
  /// NotFound (counted as ignored) for a request not admitted here; FailedPrecondition (the
  /// request table's "illegal WRITE request state transition ...") for one not awaiting its
  /// allocation (a second allocation): nothing changes.
  Status OnBlocksAllocated(const std::string& request_id, std::span<const int32_t> block_ids,
                           int num_local_computed_tokens, int num_external_tokens, TimePoint now);
  /// True when the engine must keep the blocks until ReportBlocksFree (a write may land).
  bool OnRequestAborted(const std::string& request_id, TimePoint now);
  /// Aborted while still queued (before OnRequestAdded): tells each prefill rank (paired or not)
  /// it is not needed (WriteCancel, want_done = false). Keeps no state.
  void OnAbortedBeforeAdmission(const KvTransferParams& params);
  /// A prefill rank's WriteDone.
  void OnWriteDone(const WriteDoneMsg& msg, TimePoint now);
  void OnTick(TimePoint now);
  /// The prefill engine incarnation `prefill_engine_id` is lost. Every request it writes to
  /// fails (ReportLoadFailed, or ReportBlocksFree when aborted). kGone: no byte of it can land
  /// any more, so the pairs settle and the blocks go now. kSuspected (only its heartbeats
  /// stopped): the request fails and WriteCancel goes out, but its blocks stay reserved until a
  /// WriteDone or the write bound (lease + grace) — DESIGN.md: late writes must never land in
  /// reused blocks. A request not allocated yet fails at its allocation (nothing was offered).
  /// Returns the requests failed.
  int64_t OnPeerLost(const std::string& prefill_engine_id, PeerLoss loss, TimePoint now);
  /// Requests bound to `prefill_engine_id` and the blocks offered to it (per-peer accounting).
  std::pair<int64_t, int64_t> BoundTo(const std::string& prefill_engine_id) const;

  std::vector<ConnectorAction> TakeActions();
  std::vector<LoadTiming> TakeLoadTimings();
  std::optional<TimePoint> NextDeadline() const;
  bool Idle() const { return requests_.empty(); }
  int64_t NumWaiting() const;
  /// Decode blocks a prefill may write now, per transfer_id (the tcp backend's serving check).
  std::map<std::string, std::vector<int32_t>> WritableBlocksByTransfer() const;
  const Counters& counters() const { return counters_; }
  const Options& options() const { return options_; }

 public:
  /// One (decode rank, prefill rank) pair's state (the table is in write_decode_core.cc).
  enum class PairState : uint8_t { kIdle, kWaiting, kCancelling, kOk, kFailed };
  /// One admitted request's state (the table and the drawing above; write_decode_core.cc).
  enum class RequestState : uint8_t {
    kAwaitingAlloc,  // admitted with remote tokens; the engine has not allocated its blocks
    kWaiting,        // allocated, WriteBlocks sent: waiting for every pair's WriteDone
    kFailing,        // the load failed (`failure`): waiting for the cancelled pairs to drain
    kAborting,       // aborted after the allocation: blocks kept until every pair drained
    kReported,       // reported to the engine (the entry goes with it)
  };
  static std::string_view PairStateName(PairState s);
  static std::string_view RequestStateName(RequestState s);

 private:
  struct Pair {
    int decode_rank = 0;
    int prefill_rank = 0;
    PairState state = PairState::kIdle;
  };
  struct Request {
    KvTransferParams params;
    int num_prompt_tokens = 0;
    std::vector<Pair> pairs;
    std::vector<int32_t> blocks;  // destination blocks
    RequestState state = RequestState::kAwaitingAlloc;
    Status failure;  // first failure (kFailing; an illegal transition lands here too)
    TimePoint deadline = 0;
    LoadTiming timing;
    int64_t overlap_base = INT64_MIN / 2;  // max over ok ranks of since_last_layer_us - arrival
    // Blocks allocated and offered: the write bound (deadline) runs.
    bool allocated() const {
      return state == RequestState::kWaiting || state == RequestState::kFailing ||
             state == RequestState::kAborting;
    }
  };

  // The checked transitions: an illegal one changes nothing and returns FailedPrecondition;
  // Move fails the request's load with it instead.
  [[nodiscard]] static Status SetState(Pair& p, PairState to);
  [[nodiscard]] static Status SetState(Request& r, RequestState to);
  static void Move(Request& r, Pair& p, PairState to);
  static void Move(Request& r, RequestState to);
  PeerEndpoint Peer(const KvTransferParams& p, int prefill_rank) const;
  // The TP plan's (decode rank, prefill rank) pairs against a prefill of `prefill_tp` ranks.
  std::vector<std::pair<int, int>> PlanPairs(int prefill_tp) const;
  void SendCancel(const Request& r, const Pair& pair, bool want_done);
  // Sends a skip (WriteCancel, want_done = false, from decode rank 0) to every prefill rank that
  // is the source of none of r's pairs.
  void SkipUnpairedPrefillRanks(const Request& r);
  void Fail(Request& r, Status status);
  void Advance(const std::string& request_id, TimePoint now);

  Options options_;
  std::map<std::string, Request> requests_;
  std::map<std::pair<std::string, std::string>, std::string> by_transfer_;  // (engine, tid)
  std::vector<ConnectorAction> actions_;
  std::vector<LoadTiming> timings_;
  Counters counters_;
};

}  // namespace kvbridge
