#include "kvbridge/connector/write_decode_core.h"

#include <algorithm>
#include <utility>

#include "connector/remote_load.h"
#include "kvbridge/common/state_table.h"
#include "kvbridge/connector/tp_plan.h"
#ifdef KVBRIDGE_PLANTED_FAULTS
#include "testing/planted_faults.h"  // test-only switches (src/sim builds them in)
#endif

namespace kvbridge {
// ------------------------------------------------------------------------------------------
// WriteDecodeCore
// ------------------------------------------------------------------------------------------

WriteDecodeCore::WriteDecodeCore(Options options) : options_(std::move(options)) {
  if (options_.tp_size < 1) options_.tp_size = 1;
  if (options_.block_size < 1) options_.block_size = 16;
  if (options_.write_timeout <= 0) options_.write_timeout = 70 * kSecond;
}

std::vector<std::pair<int, int>> WriteDecodeCore::PlanPairs(int prefill_tp) const {
  const int heads = options_.num_kv_heads > 0 ? options_.num_kv_heads
                                              : options_.tp_size * std::max(1, prefill_tp);
  return TpPlanPairs(prefill_tp, options_.tp_size, heads);
}

namespace {

using PS = WriteDecodeCore::PairState;
using RS = WriteDecodeCore::RequestState;

// A (decode rank, prefill rank) pair's legal transitions; anything else is a bug
// (FailedPrecondition: the request's load fails with it).
// clang-format off
constexpr StateTransition<PS> kPairTransitions[] = {
  // from               to
  {PS::kIdle,          PS::kWaiting},     // WriteBlocks sent
  {PS::kIdle,          PS::kFailed},      // aborted before the blocks were offered
  {PS::kWaiting,       PS::kOk},          // WriteDone(ok)
  {PS::kWaiting,       PS::kFailed},      // WriteDone(failed), or the write bound passed
  {PS::kWaiting,       PS::kCancelling},  // failed or aborted: WriteCancel sent
  {PS::kCancelling,    PS::kFailed},      // drained (WriteDone of any outcome), or the bound
};

// A request's legal transitions (the drawing in write_decode_core.h).
constexpr StateTransition<RS> kRequestTransitions[] = {
  // from               to
  {RS::kAwaitingAlloc, RS::kWaiting},     // allocated: WriteBlocks sent
  {RS::kAwaitingAlloc, RS::kReported},    // aborted before the allocation: nothing offered
  {RS::kWaiting,       RS::kFailing},     // a write failed or timed out, or the table was short
  {RS::kWaiting,       RS::kAborting},    // aborted while a pair may still write
  {RS::kWaiting,       RS::kReported},    // every pair ok (LoadDone); aborted with none in flight
  {RS::kFailing,       RS::kAborting},    // aborted while the cancelled pairs drain
  {RS::kFailing,       RS::kReported},    // drained (LoadFailed); aborted with none in flight
  {RS::kAborting,      RS::kReported},    // drained, or lease + grace passed (BlocksFree)
};
// clang-format on

}  // namespace

std::string_view WriteDecodeCore::PairStateName(PairState s) {
  switch (s) {
    case PairState::kIdle:
      return "IDLE";
    case PairState::kWaiting:
      return "WAITING";
    case PairState::kCancelling:
      return "CANCELLING";
    case PairState::kOk:
      return "OK";
    case PairState::kFailed:
      return "FAILED";
  }
  return "UNKNOWN";
}

std::string_view WriteDecodeCore::RequestStateName(RequestState s) {
  switch (s) {
    case RequestState::kAwaitingAlloc:
      return "AWAITING_ALLOC";
    case RequestState::kWaiting:
      return "WAITING";
    case RequestState::kFailing:
      return "FAILING";
    case RequestState::kAborting:
      return "ABORTING";
    case RequestState::kReported:
      return "REPORTED";
  }
  return "UNKNOWN";
}

Status WriteDecodeCore::SetState(Pair& p, PairState to) {
  return SetCheckedState(kPairTransitions, "WRITE pair", p.state, to, &PairStateName);
}

Status WriteDecodeCore::SetState(Request& r, RequestState to) {
  return SetCheckedState(kRequestTransitions, "WRITE request", r.state, to, &RequestStateName);
}

void WriteDecodeCore::Move(Request& r, Pair& p, PairState to) {
  if (Status st = SetState(p, to); !st.ok() && r.failure.ok()) r.failure = std::move(st);
}

void WriteDecodeCore::Move(Request& r, RequestState to) {
  if (Status st = SetState(r, to); !st.ok() && r.failure.ok()) r.failure = std::move(st);
}

PeerEndpoint WriteDecodeCore::Peer(const KvTransferParams& p, int prefill_rank) const {
  return PeerEndpoint{.engine_id = p.remote_engine_id,
                      .host = p.remote_host,
                      .port = p.remote_port,
                      .rank = prefill_rank};
}

void WriteDecodeCore::SendCancel(const Request& r, const Pair& pair, bool want_done) {
  actions_.push_back(
      SendMessageAction{.to = Peer(r.params, pair.prefill_rank),
                        .msg = WriteCancelMsg{.transfer_id = r.params.transfer_id,
                                              .prefill_engine_id = r.params.remote_engine_id,
                                              .prefill_rank = pair.prefill_rank,
                                              .decode_engine_id = options_.engine_id,
                                              .decode_rank = pair.decode_rank,
                                              .decode_tp_size = options_.tp_size,
                                              .want_done = want_done}});
}

Result<WriteDecodeCore::Match> WriteDecodeCore::OnRequestAdded(const std::string& request_id,
                                                               const KvTransferParams& params,
                                                               int num_prompt_tokens,
                                                               int num_local_computed_tokens,
                                                               TimePoint now) {
  (void)now;
  if (!params.do_remote_prefill) {
    return InvalidArgumentError("kv_transfer_params: do_remote_prefill is not set");
  }
  if (params.mode != KvTransferMode::kWrite) {
    return InvalidArgumentError("kv_transfer_params: not a write-mode decode leg");
  }
  const int bs = options_.block_size;
  if (num_prompt_tokens < 1) return InvalidArgumentError("empty prompt");
  const auto key = std::make_pair(params.remote_engine_id, params.transfer_id);
  RETURN_IF_ERROR(
      CheckNewRemoteLoad(requests_, by_transfer_, request_id, key, num_local_computed_tokens, bs));
  Request r;
  r.params = params;
  r.num_prompt_tokens = num_prompt_tokens;
  for (const auto& [d, p] : PlanPairs(params.tp_size)) {
    r.pairs.push_back(Pair{.decode_rank = d, .prefill_rank = p});
  }
  SkipUnpairedPrefillRanks(r);
  const int external = ExternalPromptTokens(num_prompt_tokens, num_local_computed_tokens);
  if (external == 0) {
    ++counters_.skipped;
    for (const Pair& pair : r.pairs) SendCancel(r, pair, /*want_done=*/false);
    return Match{0, false};
  }
  requests_.emplace(request_id, std::move(r));
  by_transfer_[key] = request_id;
  return Match{external, true};
}

Status WriteDecodeCore::OnBlocksAllocated(const std::string& request_id,
                                          std::span<const int32_t> block_ids,
                                          int num_local_computed_tokens, int num_external_tokens,
                                          TimePoint now) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    ++counters_.notifications_ignored;
    return NotFoundError("no WRITE request " + request_id + " awaits its blocks");
  }
  Request& r = it->second;
  // The table is the guard: a second (or late) allocation is an illegal transition and changes
  // nothing (no second WriteBlocks, no new write bound, no block offered or freed).
  RETURN_IF_ERROR(SetState(r, RequestState::kWaiting));
  if (!r.failure.ok()) {
    // Its prefill was lost before the allocation: offer nothing, fail the load now.
    Fail(r, r.failure);
    Advance(request_id, now);
    return OkStatus();
  }
  r.deadline = now + options_.write_timeout;
  const BlockSpan span =
      ExternalBlockSpan(options_.block_size, num_local_computed_tokens, num_external_tokens);
  if (!AllocationCoversLoad(span, num_local_computed_tokens, num_external_tokens,
                            block_ids.size())) {
    for (const Pair& pair : r.pairs) SendCancel(r, pair, /*want_done=*/false);
    Fail(r, UncoveredLoadError(block_ids.size()));
    Advance(request_id, now);
    return OkStatus();
  }
  r.blocks.assign(block_ids.begin() + span.first, block_ids.begin() + span.end);
  for (Pair& pair : r.pairs) {
    Move(r, pair, PairState::kWaiting);
    actions_.push_back(
        SendMessageAction{.to = Peer(r.params, pair.prefill_rank),
                          .msg = WriteBlocksMsg{.transfer_id = r.params.transfer_id,
                                                .prefill_engine_id = r.params.remote_engine_id,
                                                .prefill_rank = pair.prefill_rank,
                                                .decode_engine_id = options_.engine_id,
                                                .decode_rank = pair.decode_rank,
                                                .decode_tp_size = options_.tp_size,
                                                .num_prompt_tokens = r.num_prompt_tokens,
                                                .first_block = span.first,
                                                .block_ids = r.blocks}});
  }
  return OkStatus();
}

void WriteDecodeCore::Fail(Request& r, Status status) {
  if (r.failure.ok()) r.failure = std::move(status);
  if (r.state == RequestState::kWaiting) Move(r, RequestState::kFailing);
  for (Pair& pair : r.pairs) {
    if (pair.state == PairState::kWaiting) {
      SendCancel(r, pair, /*want_done=*/true);
      Move(r, pair, PairState::kCancelling);
    }
  }
}

bool WriteDecodeCore::OnRequestAborted(const std::string& request_id, TimePoint now) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  Request& r = it->second;
  bool keep = false;
  bool want_done = true;  // keep the blocks until each rank confirms its writes drained
#ifdef KVBRIDGE_PLANTED_FAULTS
  if (sim::Planted().free_decode_blocks_on_abort_during_write) want_done = false;
#endif
  for (Pair& pair : r.pairs) {
    if (pair.state == PairState::kWaiting) {
      SendCancel(r, pair, want_done);
      Move(r, pair, PairState::kCancelling);
    } else if (pair.state == PairState::kIdle) {
      SendCancel(r, pair, /*want_done=*/false);  // never asked: the prefill need not wait
      Move(r, pair, PairState::kFailed);
    }
    if (pair.state == PairState::kCancelling) keep = true;
  }
  if (keep && want_done) {
    ++counters_.aborts_mid_write;
    if (r.state != RequestState::kAborting) Move(r, RequestState::kAborting);
    (void)now;
    return true;
  }
  Move(r, RequestState::kReported);  // nothing can land: the engine frees the blocks now
  by_transfer_.erase({r.params.remote_engine_id, r.params.transfer_id});
  requests_.erase(it);
  return false;
}

void WriteDecodeCore::OnAbortedBeforeAdmission(const KvTransferParams& params) {
  if (!params.do_remote_prefill || params.mode != KvTransferMode::kWrite) return;
  Request r;
  r.params = params;
  for (const auto& [d, p] : PlanPairs(params.tp_size)) {
    r.pairs.push_back(Pair{.decode_rank = d, .prefill_rank = p});
    SendCancel(r, r.pairs.back(), /*want_done=*/false);
  }
  SkipUnpairedPrefillRanks(r);
}

void WriteDecodeCore::SkipUnpairedPrefillRanks(const Request& r) {
  // Replicated KV heads with Tp > Td: the plan reads each head from one prefill holder, so some
  // prefill ranks write to no decode rank. Each still holds the request's blocks until it knows
  // the decode's TP; a skip from decode rank 0 tells it that it has no pair (never the lease).
  std::set<int> sources;
  for (const Pair& p : r.pairs) sources.insert(p.prefill_rank);
  for (int p = 0; p < std::max(1, r.params.tp_size); ++p) {
    if (sources.count(p) == 0) SendCancel(r, Pair{.decode_rank = 0, .prefill_rank = p}, false);
  }
}

void WriteDecodeCore::OnWriteDone(const WriteDoneMsg& msg, TimePoint now) {
  auto k = by_transfer_.find({msg.prefill_engine_id, msg.transfer_id});
  if (k == by_transfer_.end() || msg.decode_engine_id != options_.engine_id) {
#ifdef KVBRIDGE_PLANTED_FAULTS
    if (sim::Planted().free_decode_blocks_on_abort_during_write) return;  // forgot it silently
#endif
    ++counters_.notifications_ignored;
    return;
  }
  const std::string request_id = k->second;
  Request& r = requests_.at(request_id);
  Pair* pair = nullptr;
  for (Pair& p : r.pairs) {
    if (p.decode_rank == msg.decode_rank && p.prefill_rank == msg.prefill_rank) pair = &p;
  }
  if (pair == nullptr ||
      (pair->state != PairState::kWaiting && pair->state != PairState::kCancelling)) {
    ++counters_.notifications_ignored;
    return;
  }
  if (pair->state == PairState::kCancelling) {
    Move(r, *pair, PairState::kFailed);  // drained (whatever it says, we no longer use it)
  } else if (msg.outcome == WriteOutcome::kOk) {
    Move(r, *pair, PairState::kOk);
    r.timing.compute_us = std::max(r.timing.compute_us, msg.compute_us);
    r.timing.write_us = std::max(r.timing.write_us, msg.write_us);
    // Overlap at go G = since_last_layer_us + (G - now); the largest over the ranks.
    r.overlap_base = std::max(r.overlap_base, msg.since_last_layer_us - now);
    r.timing.last_layer_at_us = std::max(r.timing.last_layer_at_us, msg.last_layer_at_us);
  } else {
    Move(r, *pair, PairState::kFailed);
    ++counters_.write_failures;
    Fail(r, UnavailableError("prefill rank " + std::to_string(msg.prefill_rank) +
                             " could not write: " + WriteOutcomeName(msg.outcome).data() +
                             (msg.reason.empty() ? "" : " (" + msg.reason + ")")));
  }
  Advance(request_id, now);
}

void WriteDecodeCore::Advance(const std::string& request_id, TimePoint now) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  Request& r = it->second;
  bool all_ok = r.state == RequestState::kWaiting;
  bool go_early = false;  // (planted fault only: proceed at the first pair's WriteDone(ok))
#ifdef KVBRIDGE_PLANTED_FAULTS
  go_early = sim::Planted().decode_proceeds_at_first_write_done &&
             r.state != RequestState::kAborting && r.failure.ok() &&
             std::any_of(r.pairs.begin(), r.pairs.end(),
                         [](const Pair& p) { return p.state == PairState::kOk; });
#endif
  for (const Pair& p : r.pairs) {
    if (go_early && p.state == PairState::kWaiting) continue;
    if (p.state == PairState::kWaiting || p.state == PairState::kCancelling) return;
    if (p.state != PairState::kOk) all_ok = false;
  }
  if (r.state == RequestState::kAborting) {
    actions_.push_back(ReportBlocksFreeAction{request_id});
  } else if (!r.failure.ok()) {
    ++counters_.load_failures;
    actions_.push_back(ReportLoadFailedAction{
        .request_id = request_id,
        .recompute = options_.load_failure_policy == LoadFailurePolicy::kRecompute,
        .status = r.failure});
  } else if (all_ok) {
    ++counters_.loads_done;
    LoadTiming t = r.timing;
    t.overlap_us = now + r.overlap_base;
    t.go_at = now;
    counters_.overlap_us_sum += t.overlap_us;
    counters_.write_us_sum += t.write_us;
    counters_.compute_us_sum += t.compute_us;
    timings_.push_back(t);
    actions_.push_back(ReportLoadDoneAction{request_id});
  } else {
    return;  // not allocated yet
  }
  Move(r, RequestState::kReported);
  by_transfer_.erase({r.params.remote_engine_id, r.params.transfer_id});
  requests_.erase(it);
}

void WriteDecodeCore::OnTick(TimePoint now) {
  std::vector<std::string> due;
  for (const auto& [id, r] : requests_) {
    if (r.allocated() && r.deadline <= now) due.push_back(id);
  }
  for (const std::string& id : due) {
    Request& r = requests_.at(id);
    if (r.state != RequestState::kAborting) {
      ++counters_.write_timeouts;
      Fail(r, DeadlineExceededError("no WriteDone from the prefill within " +
                                    std::to_string(options_.write_timeout / kMillisecond) + " ms"));
    }
    // lease + grace passed: the prefill posts and keeps no write beyond its lease.
    for (Pair& p : r.pairs) {
      if (p.state == PairState::kWaiting || p.state == PairState::kCancelling) {
        Move(r, p, PairState::kFailed);
      }
    }
    Advance(id, now);
  }
}

int64_t WriteDecodeCore::OnPeerLost(const std::string& prefill_engine_id, PeerLoss loss,
                                    TimePoint now) {
  bool settle = loss == PeerLoss::kGone;  // no byte can land: the pairs in flight are done
#ifdef KVBRIDGE_PLANTED_FAULTS
  if (sim::Planted().free_write_targets_on_suspected_loss) settle = true;
#endif
  std::vector<std::string> bound;
  for (const auto& [id, r] : requests_) {
    if (r.params.remote_engine_id == prefill_engine_id) bound.push_back(id);
  }
  int64_t failed = 0;
  for (const std::string& id : bound) {
    Request& r = requests_.at(id);
    Status why = UnavailableError("prefill " + prefill_engine_id + " lost (" +
                                  std::string(PeerLossName(loss)) + ")");
    if (r.state == RequestState::kAwaitingAlloc) {
      if (r.failure.ok()) r.failure = std::move(why);  // fails at its allocation
      ++failed;
      ++counters_.peer_lost;
      continue;
    }
    if (settle) {
      for (Pair& p : r.pairs) {
        if (p.state == PairState::kWaiting || p.state == PairState::kCancelling)
          Move(r, p, PairState::kFailed);
      }
    }
    if (r.state == RequestState::kWaiting) {
      ++failed;
      ++counters_.peer_lost;
      Fail(r, std::move(why));  // kSuspected: WriteCancel(want_done) to the pairs still waiting
    }
    Advance(id, now);
  }
  return failed;
}

std::pair<int64_t, int64_t> WriteDecodeCore::BoundTo(const std::string& prefill_engine_id) const {
  int64_t requests = 0, blocks = 0;
  for (const auto& [id, r] : requests_) {
    if (r.params.remote_engine_id != prefill_engine_id) continue;
    ++requests;
    if (r.allocated()) blocks += static_cast<int64_t>(r.blocks.size());
  }
  return {requests, blocks};
}

std::vector<ConnectorAction> WriteDecodeCore::TakeActions() {
  std::vector<ConnectorAction> out;
  out.swap(actions_);
  return out;
}

std::vector<WriteDecodeCore::LoadTiming> WriteDecodeCore::TakeLoadTimings() {
  std::vector<LoadTiming> out;
  out.swap(timings_);
  return out;
}

std::optional<TimePoint> WriteDecodeCore::NextDeadline() const {
  std::optional<TimePoint> best;
  for (const auto& [id, r] : requests_) {
    if (r.allocated() && (!best || r.deadline < *best)) best = r.deadline;
  }
  return best;
}

int64_t WriteDecodeCore::NumWaiting() const {
  int64_t n = 0;
  for (const auto& [id, r] : requests_) n += r.state == RequestState::kAborting ? 0 : 1;
  return n;
}

std::map<std::string, std::vector<int32_t>> WriteDecodeCore::WritableBlocksByTransfer() const {
  std::map<std::string, std::vector<int32_t>> out;
  for (const auto& [id, r] : requests_) {
    if (r.state != RequestState::kWaiting || !r.failure.ok()) continue;
    auto& v = out[r.params.transfer_id];
    v.insert(v.end(), r.blocks.begin(), r.blocks.end());
  }
  return out;
}

}  // namespace kvbridge
