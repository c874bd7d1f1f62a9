#include "kvbridge/connector/decode_core.h"

#include <algorithm>
#include <set>
#include <utility>

#include "connector/remote_load.h"
#include "kvbridge/common/state_table.h"
#include "kvbridge/connector/tp_plan.h"
#ifdef KVBRIDGE_PLANTED_FAULTS
#include "testing/planted_faults.h"  // test-only switches (src/sim builds them in)
#endif

namespace kvbridge {

DecodeCore::DecodeCore(Options options) : options_(std::move(options)) {
  if (options_.heartbeat_interval <= 0) options_.heartbeat_interval = 15 * kSecond;
  if (options_.tp_size < 1) options_.tp_size = 1;
  if (options_.block_size < 1) options_.block_size = 16;
}

namespace {

using PS = DecodeCore::PairState;
using RS = DecodeCore::RequestState;

// The legal transitions; anything else is a bug (FailedPrecondition, the request's load fails).
// clang-format off
constexpr StateTransition<PS> kPairTransitions[] = {
  // from                 to
  {PS::kIdle,            PS::kReading},        // OnBlocksAllocated posts the READ
  {PS::kIdle,            PS::kFailed},         // failed or aborted before any READ
  {PS::kReading,         PS::kCancelling},     // failed or aborted: cancel asked
  {PS::kReading,         PS::kAwaitingReply},  // landed: ReadDone(ok) sent, reply awaited
  {PS::kReading,         PS::kFailed},         // failed, or ended after an abort
  {PS::kCancelling,      PS::kFailed},         // the cancelled READ ended
  {PS::kAwaitingReply,   PS::kValid},          // hold valid
  {PS::kAwaitingReply,   PS::kFailed},         // hold gone, or no reply in time
};
constexpr StateTransition<RS> kRequestTransitions[] = {
  // from                 to
  {RS::kAwaitingAlloc,   RS::kLoading},    // OnBlocksAllocated
  {RS::kAwaitingAlloc,   RS::kFailing},
  {RS::kAwaitingAlloc,   RS::kAborting},
  {RS::kLoading,         RS::kFailing},    // a READ or hold failed
  {RS::kLoading,         RS::kAborting},
  {RS::kLoading,         RS::kReported},   // every pair valid: ReportLoadDone
  {RS::kFailing,         RS::kAborting},
  {RS::kFailing,         RS::kReported},   // drained: ReportLoadFailed
  {RS::kAborting,        RS::kReported},   // drained: ReportBlocksFree
};
// clang-format on

}  // namespace

std::string_view DecodeCore::PairStateName(PairState s) {
  switch (s) {
    case PairState::kIdle:
      return "IDLE";
    case PairState::kReading:
      return "READING";
    case PairState::kCancelling:
      return "CANCELLING";
    case PairState::kAwaitingReply:
      return "AWAITING_REPLY";
    case PairState::kValid:
      return "VALID";
    case PairState::kFailed:
      return "FAILED";
  }
  return "UNKNOWN";
}

std::string_view DecodeCore::RequestStateName(RequestState s) {
  switch (s) {
    case RequestState::kAwaitingAlloc:
      return "AWAITING_ALLOC";
    case RequestState::kLoading:
      return "LOADING";
    case RequestState::kFailing:
      return "FAILING";
    case RequestState::kAborting:
      return "ABORTING";
    case RequestState::kReported:
      return "REPORTED";
  }
  return "UNKNOWN";
}

Status DecodeCore::SetState(Pair& p, PairState to) {
  return SetCheckedState(kPairTransitions, "READ pair", p.state, to, &PairStateName);
}

Status DecodeCore::SetState(Request& r, RequestState to) {
  return SetCheckedState(kRequestTransitions, "READ request", r.state, to, &RequestStateName);
}

void DecodeCore::Move(Request& r, Pair& p, PairState to) {
  if (Status st = SetState(p, to); !st.ok() && r.failure.ok()) r.failure = std::move(st);
}

void DecodeCore::Move(Request& r, RequestState to) {
  if (Status st = SetState(r, to); !st.ok() && r.failure.ok()) r.failure = std::move(st);
}
PeerEndpoint DecodeCore::Peer(const KvTransferParams& p, int prefill_rank) const {
  return PeerEndpoint{.engine_id = p.remote_engine_id,
                      .host = p.remote_host,
                      .port = p.remote_port,
                      .rank = prefill_rank};
}

std::vector<DecodeCore::Pair> DecodeCore::PlanPairs(int prefill_tp) const {
  const int heads = options_.num_kv_heads > 0 ? options_.num_kv_heads
                                              : options_.tp_size * std::max(1, prefill_tp);
  std::vector<Pair> out;
  // Only the pairs and head indices matter here; the runtime turns heads into bytes.
  auto plan = PlanTpTransfer({.prefill_tp = prefill_tp,
                              .decode_tp = options_.tp_size,
                              .num_kv_heads = heads,
                              .head_dim = 1,
                              .block_size = 1,
                              .dtype_bytes = 1});
  if (!plan.ok()) return out;
  for (const TpSlice& s : plan->slices) {
    const bool whole = s.src_whole && s.dst_whole;
    out.push_back(Pair{.decode_rank = s.decode_rank,
                       .prefill_rank = s.prefill_rank,
                       .src_head_begin = whole ? 0 : s.src_head_begin,
                       .dst_head_begin = whole ? 0 : s.dst_head_begin,
                       .head_count = whole ? 0 : s.head_count});
  }
  return out;
}

void DecodeCore::SendReadDone(const std::string& request_id, const Request& r, const Pair& pair,
                              ReadOutcome outcome, bool want_reply) {
  // The shared transfer_id, never request_id (DESIGN.md pitfall 2).
  ReadDoneMsg m{.transfer_id = r.params.transfer_id,
                .prefill_engine_id = r.params.remote_engine_id,
                .prefill_rank = pair.prefill_rank,
                .decode_engine_id = options_.engine_id,
                .decode_rank = pair.decode_rank,
                .decode_tp_size = options_.tp_size,
                .outcome = outcome,
                .want_reply = want_reply};
#ifdef KVBRIDGE_PLANTED_FAULTS
  if (sim::Planted().notify_with_local_request_id) m.transfer_id = request_id;
#endif
  actions_.push_back(SendMessageAction{.to = Peer(r.params, pair.prefill_rank), .msg = m});
}

Result<DecodeCore::Match> DecodeCore::OnRequestAdded(const std::string& request_id,
                                                     const KvTransferParams& params,
                                                     int num_prompt_tokens,
                                                     int num_local_computed_tokens, TimePoint now) {
  queued_.erase(request_id);  // admitted (whatever the outcome): no more queued heartbeats
  if (!params.do_remote_prefill) {
    return InvalidArgumentError("kv_transfer_params: do_remote_prefill is not set");
  }
  if (params.mode == KvTransferMode::kWrite) {
    return UnimplementedError("kv_transfer_params: write mode is not supported by this engine");
  }
  if (params.remote_num_tokens != num_prompt_tokens) {
    return InvalidArgumentError(
        "kv_transfer_params.remote_num_tokens " + std::to_string(params.remote_num_tokens) +
        " != the request's prompt tokens " + std::to_string(num_prompt_tokens));
  }
  const int bs = options_.block_size;
  if (static_cast<int64_t>(params.remote_block_ids.size()) !=
      (static_cast<int64_t>(num_prompt_tokens) + bs - 1) / bs) {
    return InvalidArgumentError(
        "kv_transfer_params.remote_block_ids: " + std::to_string(params.remote_block_ids.size()) +
        " ids do not cover " + std::to_string(num_prompt_tokens) + " tokens at block_size " +
        std::to_string(bs));
  }
  const auto key = std::make_pair(params.remote_engine_id, params.transfer_id);
  RETURN_IF_ERROR(
      CheckNewRemoteLoad(requests_, by_transfer_, request_id, key, num_local_computed_tokens, bs));
  Request r;
  r.params = params;
  r.pairs = PlanPairs(params.tp_size);
  if (r.pairs.empty()) {
    return InvalidArgumentError("kv_transfer_params.tp_size " + std::to_string(params.tp_size) +
                                ": no TP plan to decode TP " + std::to_string(options_.tp_size));
  }
  // The last prompt token is always computed here (its logits give the first decode token).
  const int external = ExternalPromptTokens(num_prompt_tokens, num_local_computed_tokens);
  if (external == 0) {
    ++counters_.skipped;
    for (const Pair& pair : r.pairs)
      SendReadDone(request_id, r, pair, ReadOutcome::kSkipped, false);
    return Match{0, false};
  }
  r.next_heartbeat = now + options_.heartbeat_interval;
  requests_.emplace(request_id, std::move(r));
  by_transfer_[key] = request_id;
  return Match{external, true};
}

Status DecodeCore::OnBlocksAllocated(const std::string& request_id,
                                     std::span<const int32_t> block_ids,
                                     int num_local_computed_tokens, int num_external_tokens,
                                     TimePoint now) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    ++counters_.notifications_ignored;
    return NotFoundError("no READ request " + request_id + " awaits its blocks");
  }
  Request& r = it->second;
  // The table is the guard: a second (or late) allocation is an illegal transition and changes
  // nothing (no READ is posted twice, no block is freed).
  RETURN_IF_ERROR(SetState(r, RequestState::kLoading));
  const BlockSpan span =
      ExternalBlockSpan(options_.block_size, num_local_computed_tokens, num_external_tokens);
  if (!AllocationCoversLoad(span, num_local_computed_tokens, num_external_tokens,
                            block_ids.size()) ||
      static_cast<int64_t>(r.params.remote_block_ids.size()) < span.end) {
    Fail(request_id, r, UncoveredLoadError(block_ids.size()));
    Advance(request_id);
    return OkStatus();
  }
  std::vector<int32_t> local(block_ids.begin() + span.first, block_ids.begin() + span.end);
  std::vector<int32_t> remote(r.params.remote_block_ids.begin() + span.first,
                              r.params.remote_block_ids.begin() + span.end);
  for (Pair& pair : r.pairs) {
    pair.read_id = next_read_id_++;
    Move(r, pair, PairState::kReading);
    pair.deadline = now + options_.read_timeout;
    by_read_[pair.read_id] = request_id;
    ++counters_.reads_posted;
    actions_.push_back(PostTransferAction{.op = KvTransferMode::kRead,
                                          .id = pair.read_id,
                                          .request_id = request_id,
                                          .transfer_id = r.params.transfer_id,
                                          .peer = Peer(r.params, pair.prefill_rank),
                                          .local_rank = pair.decode_rank,
                                          .peer_tp_size = r.params.tp_size,
                                          .src_head_begin = pair.src_head_begin,
                                          .dst_head_begin = pair.dst_head_begin,
                                          .head_count = pair.head_count,
                                          .local_block_ids = local,
                                          .remote_block_ids = remote});
  }
  return OkStatus();
}

void DecodeCore::Fail(const std::string& request_id, Request& r, Status status) {
  if (r.failure.ok()) r.failure = std::move(status);
  if (r.state == RequestState::kAwaitingAlloc || r.state == RequestState::kLoading)
    Move(r, RequestState::kFailing);
  // No other READ of this request may land in blocks we are about to recompute into: cancel.
  for (Pair& pair : r.pairs) {
    if (pair.state == PairState::kReading) {
      Move(r, pair, PairState::kCancelling);
      actions_.push_back(CancelTransferAction{KvTransferMode::kRead, pair.read_id});
    } else if (pair.state == PairState::kIdle) {
      Move(r, pair, PairState::kFailed);  // never read: the prefill may release now
      SendReadDone(request_id, r, pair, ReadOutcome::kFailed, false);
    }
  }
}

bool DecodeCore::OnRequestAborted(const std::string& request_id, TimePoint now) {
  queued_.erase(request_id);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  Request& r = it->second;
  // Loaded (or failed): the engine owns its blocks again.
  if (r.state == RequestState::kReported) return false;
  if (r.state != RequestState::kAborting) Move(r, RequestState::kAborting);
  bool in_flight = false;
  for (Pair& pair : r.pairs) {
    if (pair.state == PairState::kIdle) {
      // Never read: tell the prefill now so it releases without waiting for the lease.
      SendReadDone(request_id, r, pair, ReadOutcome::kAborted, false);
      Move(r, pair, PairState::kFailed);
    } else if (pair.state == PairState::kReading) {
      Move(r, pair, PairState::kCancelling);
      actions_.push_back(CancelTransferAction{KvTransferMode::kRead, pair.read_id});
      in_flight = true;
    } else if (pair.state == PairState::kCancelling) {
      in_flight = true;
    }
  }
  // The engine frees now; nothing more to report.
  if (!in_flight) Move(r, RequestState::kReported);
  Advance(request_id);
#ifdef KVBRIDGE_PLANTED_FAULTS
  if (sim::Planted().free_decode_blocks_on_abort_during_load) return false;
#endif
  return in_flight;
}

void DecodeCore::OnRequestQueued(const std::string& request_id, const KvTransferParams& params,
                                 TimePoint now) {
  if (!params.do_remote_prefill || params.mode != KvTransferMode::kRead) return;
  // The first heartbeat goes at once: it claims the hold (the prefill's claim lease is short,
  // docs/protocol.md "Claim lease"), then one every heartbeat_interval until admission.
  SendHeartbeats(params);
  queued_[request_id] =
      Queued{.params = params, .next_heartbeat = now + options_.heartbeat_interval};
}

// To the prefill ranks of the TP plan only (the pairs that will read and notify): a rank whose
// replicas nobody reads is never contacted (tp_plan.h's notification rule).
void DecodeCore::SendHeartbeats(const KvTransferParams& p) {
  std::map<int, int> decode_rank_of;  // prefill rank -> the first decode rank reading from it
  for (const Pair& pair : PlanPairs(p.tp_size))
    decode_rank_of.emplace(pair.prefill_rank, pair.decode_rank);
  for (const auto& [pr, d] : decode_rank_of) {
    actions_.push_back(
        SendMessageAction{.to = Peer(p, pr),
                          .msg = HeartbeatMsg{.transfer_id = p.transfer_id,
                                              .prefill_engine_id = p.remote_engine_id,
                                              .prefill_rank = pr,
                                              .decode_engine_id = options_.engine_id,
                                              .decode_rank = d}});
  }
}

void DecodeCore::OnAbortedBeforeAdmission(const KvTransferParams& params) {
  for (auto it = queued_.begin(); it != queued_.end();) {
    const bool same = it->second.params.transfer_id == params.transfer_id &&
                      it->second.params.remote_engine_id == params.remote_engine_id;
    it = same ? queued_.erase(it) : std::next(it);
  }
  if (!params.do_remote_prefill || params.mode != KvTransferMode::kRead) return;
  Request r;
  r.params = params;
  for (const Pair& pair : PlanPairs(params.tp_size)) {
    SendReadDone("", r, pair, ReadOutcome::kAborted, false);
  }
}

void DecodeCore::OnReadCompleted(uint64_t read_id, const Status& status, TimePoint now) {
  auto rd = by_read_.find(read_id);
  if (rd == by_read_.end()) {
    ++counters_.notifications_ignored;
    return;
  }
  const std::string request_id = rd->second;
  by_read_.erase(rd);
  Request& r = requests_.at(request_id);
  auto pit = std::find_if(r.pairs.begin(), r.pairs.end(),
                          [&](const Pair& p) { return p.read_id == read_id; });
  Pair& pair = *pit;
  if (pair.state != PairState::kReading && pair.state != PairState::kCancelling) {
    ++counters_.notifications_ignored;
    Advance(request_id);
    return;
  }
  if (status.ok())
    ++counters_.reads_ok;
  else
    ++counters_.reads_failed;
  if (r.aborted()) {
    Move(r, pair, PairState::kFailed);
    SendReadDone(request_id, r, pair, ReadOutcome::kAborted, false);
  } else if (!status.ok() || pair.state == PairState::kCancelling || !r.failure.ok()) {
    Move(r, pair, PairState::kFailed);
    SendReadDone(request_id, r, pair, ReadOutcome::kFailed, false);
    Fail(request_id, r,
         status.ok() ? CancelledError("READ cancelled") : status.WithPrefix("READ failed"));
  } else {
#ifdef KVBRIDGE_PLANTED_FAULTS
    if (sim::Planted().only_decode_rank0_notifies && pair.decode_rank != 0) {
      // Trusts its READ, never tells the prefill rank (set unchecked: a planted fault).
      pair.state = PairState::kValid;
      Advance(request_id);
      return;
    }
#endif
    Move(r, pair, PairState::kAwaitingReply);
    pair.deadline = now + options_.reply_timeout;
    SendReadDone(request_id, r, pair, ReadOutcome::kOk, true);
  }
  Advance(request_id);
}

void DecodeCore::OnHoldReply(const HoldReplyMsg& msg, TimePoint now) {
  auto bt = by_transfer_.find({msg.prefill_engine_id, msg.transfer_id});
  if (bt == by_transfer_.end() || msg.decode_engine_id != options_.engine_id) {
    ++counters_.notifications_ignored;
    return;
  }
  const std::string request_id = bt->second;
  Request& r = requests_.at(request_id);
  auto pit = std::find_if(r.pairs.begin(), r.pairs.end(), [&](const Pair& p) {
    return p.prefill_rank == msg.prefill_rank && p.decode_rank == msg.decode_rank;
  });
  if (pit == r.pairs.end() || pit->state != PairState::kAwaitingReply) {
    ++counters_.notifications_ignored;
    return;
  }
  if (msg.hold_valid) {
    Move(r, *pit, PairState::kValid);
  } else {
    Move(r, *pit, PairState::kFailed);
    if (!r.aborted()) {
      ++counters_.hold_gone;
      Fail(request_id, r,
           UnavailableError("prefill " + msg.prefill_engine_id + " rank " +
                            std::to_string(msg.prefill_rank) + " hold gone: " + msg.reason));
    }
  }
  Advance(request_id);
}

void DecodeCore::Advance(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  Request& r = it->second;
  bool in_flight = false, awaiting = false, all_valid = r.state == RequestState::kLoading;
  for (const Pair& p : r.pairs) {
    in_flight |= p.state == PairState::kReading || p.state == PairState::kCancelling;
    awaiting |= p.state == PairState::kAwaitingReply;
    all_valid &= p.state == PairState::kValid;
  }
  if (r.state != RequestState::kReported && !in_flight) {
    if (r.state == RequestState::kAborting) {
      Move(r, RequestState::kReported);
      actions_.push_back(ReportBlocksFreeAction{request_id});
    } else if (!r.failure.ok()) {
      Move(r, RequestState::kReported);
      ++counters_.load_failures;
      actions_.push_back(ReportLoadFailedAction{
          .request_id = request_id,
          .recompute = options_.load_failure_policy == LoadFailurePolicy::kRecompute,
          .status = r.failure});
    } else if (all_valid) {
      Move(r, RequestState::kReported);
      ++counters_.loads_done;
      actions_.push_back(ReportLoadDoneAction{request_id});
    }
  }
  if (r.state == RequestState::kReported && !in_flight && !awaiting) {
    for (const Pair& p : r.pairs) by_read_.erase(p.read_id);
    by_transfer_.erase({r.params.remote_engine_id, r.params.transfer_id});
    requests_.erase(it);
  }
}

int64_t DecodeCore::OnPeerLost(const std::string& prefill_engine_id, TimePoint now) {
  (void)now;
  for (auto it = queued_.begin(); it != queued_.end();) {
    it =
        it->second.params.remote_engine_id == prefill_engine_id ? queued_.erase(it) : std::next(it);
  }
  std::vector<std::string> bound;
  for (const auto& [id, r] : requests_) {
    if (r.params.remote_engine_id == prefill_engine_id) bound.push_back(id);
  }
  int64_t failed = 0;
  for (const std::string& id : bound) {
    Request& r = requests_.at(id);
    for (Pair& p : r.pairs) {
      if (p.state == PairState::kAwaitingReply) Move(r, p, PairState::kFailed);  // none will come
    }
    if (!r.aborted() && r.state != RequestState::kReported) {
      ++failed;
      ++counters_.peer_lost;
      Fail(id, r, UnavailableError("prefill " + prefill_engine_id + " lost"));
    }
    Advance(id);
  }
  return failed;
}

void DecodeCore::OnTick(TimePoint now) {
  std::vector<std::string> touched;
  for (auto& [id, r] : requests_) {
    bool changed = false;
    for (Pair& p : r.pairs) {
      if (p.state == PairState::kReading && p.deadline <= now) {
        ++counters_.read_timeouts;
        Fail(id, r,
             DeadlineExceededError("READ of transfer " + r.params.transfer_id + " timed out"));
        changed = true;
      } else if (p.state == PairState::kAwaitingReply && p.deadline <= now) {
        Move(r, p, PairState::kFailed);
        if (!r.aborted()) {
          ++counters_.reply_timeouts;
          Fail(id, r,
               DeadlineExceededError("no hold reply from prefill " + r.params.remote_engine_id +
                                     " rank " + std::to_string(p.prefill_rank)));
        }
        changed = true;
      }
    }
    const bool waiting =
        (r.state == RequestState::kAwaitingAlloc || r.state == RequestState::kLoading) &&
        r.failure.ok();
    if (waiting && r.next_heartbeat <= now) {
      std::set<int> ranks;
      for (const Pair& p : r.pairs) {
        if (p.state == PairState::kIdle || p.state == PairState::kReading)
          ranks.insert(p.prefill_rank);
      }
      for (int pr : ranks) {
        int d = 0;
        for (const Pair& p : r.pairs) {
          if (p.prefill_rank == pr) {
            d = p.decode_rank;
            break;
          }
        }
        actions_.push_back(
            SendMessageAction{.to = Peer(r.params, pr),
                              .msg = HeartbeatMsg{.transfer_id = r.params.transfer_id,
                                                  .prefill_engine_id = r.params.remote_engine_id,
                                                  .prefill_rank = pr,
                                                  .decode_engine_id = options_.engine_id,
                                                  .decode_rank = d}});
      }
      r.next_heartbeat = now + options_.heartbeat_interval;
    }
    if (changed) touched.push_back(id);
  }
  for (const auto& id : touched) Advance(id);
  for (auto& [id, q] : queued_) {
    if (q.next_heartbeat > now) continue;
    SendHeartbeats(q.params);
    q.next_heartbeat = now + options_.heartbeat_interval;
  }
}

std::vector<ConnectorAction> DecodeCore::TakeActions() {
  std::vector<ConnectorAction> out;
  out.swap(actions_);
  return out;
}

std::optional<TimePoint> DecodeCore::NextDeadline() const {
  std::optional<TimePoint> best;
  auto consider = [&](TimePoint t) { best = best ? std::min(*best, t) : t; };
  for (const auto& [id, r] : requests_) {
    for (const Pair& p : r.pairs) {
      if (p.state == PairState::kReading || p.state == PairState::kAwaitingReply) {
        consider(p.deadline);
      }
    }
    if ((r.state == RequestState::kAwaitingAlloc || r.state == RequestState::kLoading) &&
        r.failure.ok())
      consider(r.next_heartbeat);
  }
  for (const auto& [id, q] : queued_) consider(q.next_heartbeat);
  return best;
}

int64_t DecodeCore::NumWaiting() const {
  int64_t n = 0;
  for (const auto& [id, r] : requests_) n += r.state == RequestState::kReported ? 0 : 1;
  return n;
}

int64_t DecodeCore::NumReadsInFlight() const {
  int64_t n = 0;
  for (const auto& [id, r] : requests_) {
    for (const Pair& p : r.pairs) {
      n += p.state == PairState::kReading || p.state == PairState::kCancelling;
    }
  }
  return n;
}

}  // namespace kvbridge
