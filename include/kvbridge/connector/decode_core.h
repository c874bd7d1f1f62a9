// kvbridge/connector/decode_core.h — the decode half of the READ-mode P/D protocol, sans-IO.
//
// For a parent request with do_remote_prefill (DESIGN.md "READ mode" steps 2, 3, 5;
// docs/protocol.md): computes how many prompt tokens arrive remotely (all but the last prompt
// token, minus the local prefix hit), then, once the engine allocated blocks, posts ONE READ per
// (transfer, decode rank, prefill rank) pair for only the blocks the prefix cache lacks. After a
// READ lands it notifies that prefill rank with the shared transfer_id and its rank (ReadDoneMsg)
// and uses the bytes only after the prefill replies "hold valid". Any failure ("hold gone", no
// reply within reply_timeout, a failed or timed-out READ) applies the load-failure policy, but
// only once no READ of the request can still land. An abort mid-READ cancels and keeps the
// destination blocks until every READ ended.
//
//   DecodeCore core({.engine_id = "d0-9f", .block_size = 16});
//   ASSIGN_OR_RETURN(auto match, core.OnRequestAdded("cmpl-1", params, 40, 0, now)); // {39, true}
//   core.OnBlocksAllocated("cmpl-1", block_table, 0, 39, now);  // → PostRead(read_id=1, ...)
//   core.OnReadCompleted(1, OkStatus(), now);                   // → SendMessage(ReadDone ok)
//   core.OnHoldReply(reply, now);                               // → ReportLoadDone("cmpl-1")
//
// Request states: kAwaitingAlloc → kLoading → reported (done | failed | freed after abort);
// the entry stays, silently absorbing replies, until no READ and no reply is outstanding.
// Each request is reported exactly once; completions and replies for requests not waiting
// (unknown, aborted, already reported) are dropped and counted.
//
// Thread-safety: not thread-safe; one owner thread (the engine thread, or the simulator).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/status.h"
#include "kvbridge/connector/actions.h"
#include "kvbridge/connector/kv_transfer_config.h"
#include "kvbridge/connector/messages.h"

namespace kvbridge {

class DecodeCore {
 public:
  struct Options {
    std::string engine_id;  ///< this decode engine incarnation
    int tp_size = 1;        ///< this engine's TP size (decode ranks 0..tp_size-1)
    /// The model's global KV heads, for the TP plan (tp_plan.h) that says which head slices
    /// each decode rank reads from which prefill rank. 0: assume enough heads that they split
    /// evenly over both TP sizes.
    int num_kv_heads = 0;
    int block_size = 16;
    DurationUs reply_timeout = 10 * kSecond;
    DurationUs read_timeout = 30 * kSecond;
    DurationUs heartbeat_interval = 15 * kSecond;  ///< > 0
    LoadFailurePolicy load_failure_policy = LoadFailurePolicy::kRecompute;
  };
  struct Match {
    int num_external_tokens = 0;
    bool load_async = false;
  };
  struct Counters {
    int64_t reads_posted = 0;
    int64_t reads_ok = 0;
    int64_t reads_failed = 0;  ///< failed or cancelled READs
    int64_t loads_done = 0;
    int64_t load_failures = 0;  ///< ReportLoadFailed emitted
    int64_t hold_gone = 0;      ///< of those: a prefill replied "hold not valid"
    int64_t reply_timeouts = 0;
    int64_t read_timeouts = 0;
    int64_t skipped = 0;                ///< requests whose prefix cache had every needed block
    int64_t notifications_ignored = 0;  ///< completions/replies for no waiting request
    int64_t peer_lost = 0;              ///< requests failed because their prefill was lost
  };

  explicit DecodeCore(Options options);

  /// A parent request with do_remote_prefill (read mode) is about to be allocated.
  /// `num_local_computed_tokens` is its local prefix hit (multiple of block_size). Returns the
  /// tokens that arrive remotely: max(0, num_prompt_tokens - 1 - num_local_computed_tokens), with
  /// load_async = true when > 0. When 0, the prefill is told at once (ReadDone "skipped") and no
  /// entry is kept. Errors (nothing changes): InvalidArgument when params are not a read-mode
  /// decode leg or remote_num_tokens != num_prompt_tokens or the block count disagrees with
  /// block_size; AlreadyExists when the (remote engine, transfer_id) or request id is active;
  /// Unimplemented for write mode.
  Result<Match> OnRequestAdded(const std::string& request_id, const KvTransferParams& params,
                               int num_prompt_tokens, int num_local_computed_tokens, TimePoint now);
  /// The engine allocated `block_ids` (the request's whole block table) for a request that got
  /// num_external_tokens > 0. Posts the READs. A table too short fails the load. NotFound
  /// (counted as ignored) for a request not admitted here; FailedPrecondition (the request
  /// table's "illegal READ request state transition ...") for one not awaiting its allocation
  /// (a second allocation): nothing changes.
  Status OnBlocksAllocated(const std::string& request_id, std::span<const int32_t> block_ids,
                           int num_local_computed_tokens, int num_external_tokens, TimePoint now);
  /// Returns true when the engine must keep the request's blocks until ReportBlocksFree
  /// (a READ may still land); false when it may free them now (or the request is unknown).
  bool OnRequestAborted(const std::string& request_id, TimePoint now);

  /// A request with do_remote_prefill `params` (read mode) entered the engine's waiting queue.
  /// Until OnRequestAdded (admission) or an abort, it sends a heartbeat to each prefill rank
  /// every heartbeat_interval (DESIGN.md READ step 4: "a decode still queued extends [the lease]
  /// by heartbeat"), so a long queue does not cost the hold; the first one goes at once, which
  /// claims the hold (the prefill's claim lease, prefill_core.h). Other params: ignored.
  void OnRequestQueued(const std::string& request_id, const KvTransferParams& params,
                       TimePoint now);
  /// A request with do_remote_prefill `params` was aborted before OnRequestAdded (still queued
  /// in the engine): tells each prefill rank (ReadDone "aborted", no reply) so it releases now
  /// instead of at lease end, and stops its queued heartbeats.
  void OnAbortedBeforeAdmission(const KvTransferParams& params);

  /// READ `read_id` ended: OK (all bytes landed) or an error / Cancelled (no more bytes land).
  void OnReadCompleted(uint64_t read_id, const Status& status, TimePoint now);
  /// A prefill rank's answer to our ReadDone.
  void OnHoldReply(const HoldReplyMsg& msg, TimePoint now);
  /// Fires read and reply timeouts and sends due heartbeats.
  void OnTick(TimePoint now);
  /// The prefill engine incarnation `prefill_engine_id` is lost (either PeerLoss: a READ lands
  /// only in our own blocks, and only while our READ runs). Every request reading from it fails
  /// now (its READs are cancelled, replies no longer awaited; the policy applies once no READ
  /// can land), and its queued requests stop heartbeating. Returns the requests failed.
  int64_t OnPeerLost(const std::string& prefill_engine_id, TimePoint now);

  std::vector<ConnectorAction> TakeActions();
  std::optional<TimePoint> NextDeadline() const;
  /// True when no request entry remains (no READ, no awaited reply).
  bool Idle() const { return requests_.empty() && queued_.empty(); }
  /// Requests waiting for remote KV (not yet reported).
  int64_t NumWaiting() const;
  /// READs posted and not yet completed.
  int64_t NumReadsInFlight() const;
  const Counters& counters() const { return counters_; }
  const Options& options() const { return options_; }

 public:
  // The state machines (their tables are in decode_core.cc). One (decode rank, prefill rank)
  // pair's READ. Transitions: kPairTransitions (decode_core.cc).
  enum class PairState : uint8_t {
    kIdle,           // no READ yet (awaiting allocation)
    kReading,        // READ posted
    kCancelling,     // cancel asked, completion not yet in
    kAwaitingReply,  // READ landed, ReadDone sent, reply awaited
    kValid,          // prefill said the hold was valid
    kFailed,         // this pair's READ/hold failed; its prefill rank was told
  };
  // One admitted request. Transitions: kRequestTransitions (decode_core.cc).
  enum class RequestState : uint8_t {
    kAwaitingAlloc,  // admitted with remote tokens; the engine has not allocated its blocks
    kLoading,        // blocks allocated, READs posted or pending replies
    kFailing,        // a READ or hold failed (`failure`); waiting for in-flight READs to end
    kAborting,       // the engine aborted it; waiting for in-flight READs to end
    kReported,       // load done / failed / blocks free reported; kept while replies are due
  };
  static std::string_view PairStateName(PairState s);
  static std::string_view RequestStateName(RequestState s);

 private:
  struct Pair {
    int decode_rank = 0;
    int prefill_rank = 0;
    int src_head_begin = 0;  // the slice of the TP plan (rank-local heads)
    int dst_head_begin = 0;
    int head_count = 0;  // 0: whole blocks on both sides
    uint64_t read_id = 0;
    PairState state = PairState::kIdle;
    TimePoint deadline = 0;  // read or reply deadline, by state
  };
  struct Request {
    KvTransferParams params;
    std::vector<Pair> pairs;
    RequestState state = RequestState::kAwaitingAlloc;
    Status failure;  // first failure (kFailing; an illegal transition lands here too)
    TimePoint next_heartbeat = 0;
    bool aborted() const {
      return state == RequestState::kAborting || state == RequestState::kReported;
    }
  };

  // The checked transitions: an illegal one changes nothing and returns FailedPrecondition.
  [[nodiscard]] static Status SetState(Pair& p, PairState to);
  [[nodiscard]] static Status SetState(Request& r, RequestState to);
  // As SetState; an illegal transition fails the request's load with that status (reported to
  // the engine as ReportLoadFailed once nothing is in flight) instead of being dropped.
  void Move(Request& r, Pair& p, PairState to);
  void Move(Request& r, RequestState to);
  PeerEndpoint Peer(const KvTransferParams& p, int prefill_rank) const;
  /// The pairs (and head slices) for a prefill of TP `prefill_tp`; empty when it cannot plan.
  std::vector<Pair> PlanPairs(int prefill_tp) const;
  void SendReadDone(const std::string& request_id, const Request& r, const Pair& pair,
                    ReadOutcome outcome, bool want_reply);
  void Fail(const std::string& request_id, Request& r, Status status);
  void Advance(const std::string& request_id);
  void SendHeartbeats(const KvTransferParams& p);

  Options options_;
  std::map<std::string, Request> requests_;                                 // request id -> entry
  std::map<std::pair<std::string, std::string>, std::string> by_transfer_;  // (engine, tid) -> req
  std::map<uint64_t, std::string> by_read_;                                 // read id -> req
  struct Queued {
    KvTransferParams params;
    TimePoint next_heartbeat = 0;
  };
  std::map<std::string, Queued> queued_;  // request id -> queued before admission
  uint64_t next_read_id_ = 1;
  std::vector<ConnectorAction> actions_;
  Counters counters_;
};

}  // namespace kvbridge
