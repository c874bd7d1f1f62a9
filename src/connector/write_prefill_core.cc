#include "kvbridge/connector/write_prefill_core.h"

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
// WritePrefillCore
// ------------------------------------------------------------------------------------------

WritePrefillCore::WritePrefillCore(Options options) : options_(std::move(options)) {
  if (options_.tp_size < 1) options_.tp_size = 1;
  if (options_.block_size < 1) options_.block_size = 16;
  if (options_.num_layers < 1) options_.num_layers = 1;
  if (options_.lease <= 0) options_.lease = 60 * kSecond;
  if (options_.max_parked_messages < 1) options_.max_parked_messages = 1;
  if (options_.max_tombstones < 1) options_.max_tombstones = 1;
  for (int r = 0; r < options_.tp_size; ++r) {
    ranks_.push_back(
        Rank{.rank = r, .next_write_id = (static_cast<uint64_t>(r) << kRankShift) + 1});
  }
}

WritePrefillCore::Rank& WritePrefillCore::RankFor(int prefill_rank) {
  // A rank this core does not run goes to the first, which refuses it (not its rank).
  if (prefill_rank >= 0 && prefill_rank < static_cast<int>(ranks_.size()))
    return ranks_[static_cast<size_t>(prefill_rank)];
  return ranks_[0];
}

void WritePrefillCore::SetHeadSlice(int prefill_rank, int decode_rank, int decode_tp,
                                    PostTransferAction& a) const {
  if (options_.tp_size == 1 && decode_tp == 1) return;  // whole blocks
  const int heads =
      options_.num_kv_heads > 0 ? options_.num_kv_heads : options_.tp_size * std::max(1, decode_tp);
  // Only the pairs and head indices matter here; the runtime turns heads into bytes.
  auto plan = PlanTpTransfer({.prefill_tp = options_.tp_size,
                              .decode_tp = decode_tp,
                              .num_kv_heads = heads,
                              .head_dim = 1,
                              .block_size = 1,
                              .dtype_bytes = 1});
  if (!plan.ok()) return;
  for (const TpSlice& s : plan->slices) {
    if (s.decode_rank != decode_rank || s.prefill_rank != prefill_rank) continue;
    if (s.src_whole && s.dst_whole) return;
    a.src_head_begin = s.src_head_begin;
    a.dst_head_begin = s.dst_head_begin;
    a.head_count = s.head_count;
    return;
  }
}

bool WritePrefillCore::Hold(const std::string& request_id, const std::set<int>& ranks) {
  if (ranks.empty()) return false;
  holders_[request_id].insert(ranks.begin(), ranks.end());
  return true;
}

namespace {

using TS = WritePrefillCore::TargetState;

// Answers a decode rank's block ids with a WriteDone(outcome) that no WRITE carries (a refusal,
// or the confirmation of an empty drain), as engine `prefill_engine_id` rank `prefill_rank`.
void AnswerBlocks(WritePrefillCore::Counters& counters, std::vector<ConnectorAction>& actions,
                  const WriteBlocksMsg& msg, const std::string& prefill_engine_id, int prefill_rank,
                  WriteOutcome outcome, std::string reason) {
  ++counters.targets_failed;
  actions.push_back(SendMessageAction{.to = PeerEndpoint{.engine_id = msg.decode_engine_id,
                                                         .host = msg.decode_host,
                                                         .port = msg.decode_port,
                                                         .rank = msg.decode_rank},
                                      .msg = WriteDoneMsg{.transfer_id = msg.transfer_id,
                                                          .prefill_engine_id = prefill_engine_id,
                                                          .prefill_rank = prefill_rank,
                                                          .decode_engine_id = msg.decode_engine_id,
                                                          .decode_rank = msg.decode_rank,
                                                          .outcome = outcome,
                                                          .reason = std::move(reason)}});
}

// A target's legal transitions; anything else is a bug (FailedPrecondition: the target fails).
// clang-format off
constexpr StateTransition<TS> kTargetTransitions[] = {
  // from               to
  {TS::kActive,        TS::kCancelling},  // cancelled by the decode, a close, a failed WRITE
  {TS::kActive,        TS::kDone},        // every layer written: WriteDone(ok)
  {TS::kCancelling,    TS::kDone},        // drained: WriteDone(outcome) when wanted
};
// clang-format on

}  // namespace

std::string_view WritePrefillCore::TargetStateName(TargetState s) {
  switch (s) {
    case TargetState::kActive:
      return "ACTIVE";
    case TargetState::kCancelling:
      return "CANCELLING";
    case TargetState::kDone:
      return "DONE";
  }
  return "UNKNOWN";
}

Status WritePrefillCore::SetState(Target& g, TargetState to) {
  return SetCheckedState(kTargetTransitions, "WRITE target", g.state, to, &TargetStateName);
}

void WritePrefillCore::Move(Target& g, TargetState to) {
  if (Status st = SetState(g, to); !st.ok()) {
    g.write_failed = true;  // the decode hears WriteDone(failed) naming it
    g.outcome = WriteOutcome::kFailed;
    g.reason = st.message();
  }
}

std::string_view WritePrefillCore::ReasonName(CloseReason r) {
  switch (r) {
    case CloseReason::kNone:
      return "open";
    case CloseReason::kAborted:
      return "aborted";
    case CloseReason::kReleased:
      return "released";
    case CloseReason::kExpired:
      return "expired";
    case CloseReason::kCompleted:
      return "completed";
  }
  return "open";
}

std::vector<int> WritePrefillCore::DecodeRanksWrittenBy(const Rank& k, int decode_tp) const {
  // Without a head count, one that splits evenly over both sizes gives the even-split pairs.
  const int heads =
      options_.num_kv_heads > 0 ? options_.num_kv_heads : options_.tp_size * std::max(1, decode_tp);
  std::vector<int> out;
  for (const auto& [d, p] : TpPlanPairs(options_.tp_size, decode_tp, heads)) {
    if (p == k.rank) out.push_back(d);
  }
  return out;
}

std::vector<int> WritePrefillCore::ExpectedDecodeRanks(const Rank& k, const Transfer& t) const {
  if (!t.decode_tp) return {};
  return DecodeRanksWrittenBy(k, *t.decode_tp);
}

Status WritePrefillCore::OnRequestAdded(const std::string& request_id, int n,
                                        const std::string& transfer_id, int num_prompt_tokens,
                                        TimePoint now) {
  if (n != 1) {
    return InvalidArgumentError("write mode: the prefill leg must have n = 1 (got " +
                                std::to_string(n) + "); the decode forks the siblings");
  }
  if (!IsValidTransferId(transfer_id)) return InvalidArgumentError("bad transfer_id");
  if (request_id.empty()) return InvalidArgumentError("empty request id");
  if (num_prompt_tokens < 1) return InvalidArgumentError("empty prompt");
  Status first;  // every rank registers; the first error
  for (Rank& k : ranks_) {
    Status st = AddRequest(k, request_id, transfer_id, num_prompt_tokens, now);
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

Status WritePrefillCore::AddRequest(Rank& k, const std::string& request_id,
                                    const std::string& transfer_id, int num_prompt_tokens,
                                    TimePoint now) {
  if (k.request_to_transfer.count(request_id)) {
    return AlreadyExistsError("request " + request_id + " is already registered");
  }
  if (k.transfers.count(transfer_id)) {
    return AlreadyExistsError("transfer " + transfer_id + " is already registered");
  }
  k.tombstones.erase(transfer_id);
  Transfer& t = k.transfers[transfer_id];
  t.request_id = request_id;
  t.num_prompt_tokens = num_prompt_tokens;
  t.layer_computed.assign(static_cast<size_t>(options_.num_layers), false);
  k.request_to_transfer[request_id] = transfer_id;
  // Messages that came first, in arrival order.
  auto [lo, hi] = k.parked.equal_range(transfer_id);
  std::vector<ControlMessage> msgs;
  for (auto it = lo; it != hi; ++it) msgs.push_back(std::move(it->second.msg));
  k.parked.erase(lo, hi);
  for (ControlMessage& m : msgs) {
    if (!k.transfers.count(transfer_id)) break;
    Transfer& tt = k.transfers.at(transfer_id);
    if (auto* wb = std::get_if<WriteBlocksMsg>(&m)) {
      AddTarget(k, transfer_id, tt, *wb, now);
    } else if (auto* wc = std::get_if<WriteCancelMsg>(&m)) {
      ApplyCancel(k, transfer_id, tt, *wc);
    } else if (std::holds_alternative<ReleaseMsg>(m)) {
      if (tt.close == CloseReason::kNone) {
        ++k.counters.transfers_released;
        Close(k, tt, CloseReason::kReleased);
      }
    }
  }
  if (k.transfers.count(transfer_id)) Advance(k, transfer_id, now);
  return OkStatus();
}

void WritePrefillCore::OnLayerComputed(const std::string& request_id, int layer,
                                       std::span<const int32_t> block_table, TimePoint now) {
  for (Rank& k : ranks_) {
    auto rt = k.request_to_transfer.find(request_id);
    if (rt == k.request_to_transfer.end()) continue;  // not a WRITE-mode prefill request
    const std::string tid = rt->second;
    Transfer& t = k.transfers.at(tid);
    if (layer < 0 || layer >= options_.num_layers || t.layer_computed[layer] || t.gone) continue;
    if (block_table.size() >= t.blocks.size())
      t.blocks.assign(block_table.begin(), block_table.end());
    t.layer_computed[layer] = true;
    ++t.layers_computed;
    if (t.first_layer_at < 0) t.first_layer_at = now;
    t.last_layer_at = now;
    if (t.close != CloseReason::kNone) continue;
    for (auto& [d, g] : t.targets) PostLayer(k, tid, t, g, layer, now);
    Advance(k, tid, now);
  }
}

void WritePrefillCore::PostLayer(Rank& k, const std::string& tid, Transfer& t, Target& g, int layer,
                                 TimePoint now) {
  if (g.state != TargetState::kActive) return;
  if (layer >= 0 && g.layer_posted[layer]) return;
  if (layer < 0 && g.layers_posted > 0) return;
  if (now > g.received + options_.lease) {
    // The decode stops waiting at lease + grace: never start a write it no longer expects.
    CancelTarget(k, g, WriteOutcome::kFailed, "expired");
    return;
  }
  PostTransferAction a;
  a.op = KvTransferMode::kWrite;
  a.transfer_id = tid;
  a.peer = PeerEndpoint{.engine_id = g.msg.decode_engine_id,
                        .host = g.msg.decode_host,
                        .port = g.msg.decode_port,
                        .rank = g.msg.decode_rank};
  a.local_rank = k.rank;
  a.peer_tp_size = g.msg.decode_tp_size;
  a.layer = layer;
  SetHeadSlice(k.rank, g.msg.decode_rank, g.msg.decode_tp_size, a);
  for (size_t i = 0; i < g.msg.block_ids.size(); ++i) {
    const size_t idx = static_cast<size_t>(g.msg.first_block) + i;
    if (idx >= t.blocks.size()) {
      g.write_failed = true;
      CancelTarget(k, g, WriteOutcome::kFailed,
                   "the prefill's block table does not cover the blocks");
      return;
    }
    a.local_block_ids.push_back(t.blocks[idx]);
    a.remote_block_ids.push_back(g.msg.block_ids[i]);
  }
  a.id = k.next_write_id++;
  k.writes[a.id] = {tid, g.msg.decode_rank};
  const bool nothing_in_flight = g.inflight.empty();
  g.inflight.insert(a.id);
  if (layer < 0) {
    std::fill(g.layer_posted.begin(), g.layer_posted.end(), true);
    g.layers_posted = options_.num_layers;
  } else {
    g.layer_posted[layer] = true;
    ++g.layers_posted;
  }
  if (g.first_post < 0) g.first_post = now;
  bool attach = nothing_in_flight && g.layers_posted == options_.num_layers;
#ifdef KVBRIDGE_PLANTED_FAULTS
  if (sim::Planted().prefill_rank_never_sends_write_done)
    attach = attach && k.rank != options_.tp_size - 1;
#endif
  if (attach) {
    // The target's last WRITE with every earlier one landed: its notification, delivered by the
    // agent after this WRITE's data landed, is the WriteDone — no wait for the engine thread.
    Target done = g;
    done.outcome = WriteOutcome::kOk;
    a.notification = MakeDone(k, t, done, now);
    g.done_attached = a.id;
  }
  ++k.counters.writes_posted;
  k.actions.push_back(std::move(a));
}

void WritePrefillCore::CancelTarget(Rank& k, Target& g, WriteOutcome outcome, std::string reason) {
  if (g.state != TargetState::kActive) return;
  Move(g, TargetState::kCancelling);
  g.outcome = outcome;
  g.reason = std::move(reason);
  for (uint64_t id : g.inflight)
    k.actions.push_back(CancelTransferAction{KvTransferMode::kWrite, id});
}

void WritePrefillCore::Reject(Rank& k, const WriteBlocksMsg& msg, std::string reason) {
  AnswerBlocks(k.counters, k.actions, msg, msg.prefill_engine_id, msg.prefill_rank,
               WriteOutcome::kFailed, std::move(reason));
}

bool WritePrefillCore::AnswerOvertakenCancel(Rank& k, const WriteBlocksMsg& msg) {
  auto it = k.overtaken_cancels.find({msg.transfer_id, msg.decode_engine_id, msg.decode_rank});
  if (it == k.overtaken_cancels.end()) return false;
  k.overtaken_cancels.erase(it);
  AnswerBlocks(k.counters, k.actions, msg, options_.engine_id, k.rank, WriteOutcome::kCancelled,
               "cancelled by the decode");
  return true;
}

WriteDoneMsg WritePrefillCore::MakeDone(const Rank& k, const Transfer& t, const Target& g,
                                        TimePoint now) const {
  WriteDoneMsg m{.transfer_id = g.msg.transfer_id,
                 .prefill_engine_id = options_.engine_id,
                 .prefill_rank = k.rank,
                 .decode_engine_id = g.msg.decode_engine_id,
                 .decode_rank = g.msg.decode_rank,
                 .outcome = g.outcome,
                 .reason = g.outcome == WriteOutcome::kOk ? std::string() : g.reason};
  if (t.first_layer_at >= 0) {
    m.compute_us = std::max<int64_t>(0, t.last_layer_at - t.first_layer_at);
  }
  const TimePoint last_done = g.last_done >= 0 ? g.last_done : now;
  if (g.first_post >= 0 && last_done >= g.first_post) m.write_us = last_done - g.first_post;
  if (t.last_layer_at >= 0) {
    m.since_last_layer_us = std::max<int64_t>(0, now - t.last_layer_at);
    m.last_layer_at_us = t.last_layer_at;
  }
  return m;
}

void WritePrefillCore::RecordOk(Rank& k, const Target& g) {
  ++k.counters.targets_ok;
  if (g.first_post >= 0 && g.last_done >= g.first_post) {
    k.counters.transfer_us_sum += g.last_done - g.first_post;
    k.transfer_times.push_back(g.last_done - g.first_post);
  }
}

void WritePrefillCore::SendDone(Rank& k, const Transfer& t, Target& g, TimePoint now) {
  if (g.outcome == WriteOutcome::kOk) {
    RecordOk(k, g);
  } else {
    ++k.counters.targets_failed;
  }
#ifdef KVBRIDGE_PLANTED_FAULTS
  if (sim::Planted().prefill_rank_never_sends_write_done && k.rank == options_.tp_size - 1 &&
      g.outcome == WriteOutcome::kOk)
    return;
#endif
  k.actions.push_back(SendMessageAction{.to = PeerEndpoint{.engine_id = g.msg.decode_engine_id,
                                                           .host = g.msg.decode_host,
                                                           .port = g.msg.decode_port,
                                                           .rank = g.msg.decode_rank},
                                        .msg = MakeDone(k, t, g, now)});
}

void WritePrefillCore::AddTarget(Rank& k, const std::string& tid, Transfer& t,
                                 const WriteBlocksMsg& msg, TimePoint now) {
  if (msg.prefill_rank != k.rank) {
    Reject(k, msg, "rank " + std::to_string(msg.prefill_rank) + " is not this prefill rank");
    return;
  }
  if (t.decode_tp && *t.decode_tp != msg.decode_tp_size) {
    Reject(k, msg, "decode tp_size differs from an earlier message of this transfer");
    return;
  }
  const std::vector<int> ranks = DecodeRanksWrittenBy(k, msg.decode_tp_size);
  if (std::find(ranks.begin(), ranks.end(), msg.decode_rank) == ranks.end()) {
    Reject(k, msg,
           "decode rank " + std::to_string(msg.decode_rank) + " is not written by rank " +
               std::to_string(k.rank));
    return;
  }
  if (AnswerOvertakenCancel(k, msg)) return;
  if (t.targets.count(msg.decode_rank)) {
    ++k.counters.notifications_ignored;  // duplicate
    return;
  }
  if (t.close != CloseReason::kNone) {
    Reject(k, msg, std::string(ReasonName(t.close)));
    return;
  }
  const int bs = options_.block_size;
  const int64_t prompt_blocks = (static_cast<int64_t>(t.num_prompt_tokens) + bs - 1) / bs;
  if (msg.num_prompt_tokens != t.num_prompt_tokens ||
      static_cast<int64_t>(msg.first_block) + static_cast<int64_t>(msg.block_ids.size()) >
          prompt_blocks) {
    Reject(k, msg,
           "prompt mismatch: the decode has " + std::to_string(msg.num_prompt_tokens) +
               " prompt tokens, this prefill " + std::to_string(t.num_prompt_tokens));
    return;
  }
  t.decode_tp = msg.decode_tp_size;
  Target& g = t.targets[msg.decode_rank];
  g.msg = msg;
  g.received = now;
  g.layer_posted.assign(static_cast<size_t>(options_.num_layers), false);
  if (t.layers_computed == options_.num_layers) {
    PostLayer(k, tid, t, g, -1, now);  // everything is final: one transfer over all layers
  } else {
    for (int l = 0; l < options_.num_layers; ++l) {
      if (t.layer_computed[l]) PostLayer(k, tid, t, g, l, now);
    }
  }
}

void WritePrefillCore::ApplyCancel(Rank& k, const std::string& tid, Transfer& t,
                                   const WriteCancelMsg& msg) {
  if (msg.prefill_rank != k.rank || (t.decode_tp && *t.decode_tp != msg.decode_tp_size)) {
    ++k.counters.notifications_ignored;
    return;
  }
  auto it = t.targets.find(msg.decode_rank);
  if (it == t.targets.end()) {
    // Skip (nothing needed), or a cancel before any block ids: this decode rank is settled.
    const std::vector<int> ranks = DecodeRanksWrittenBy(k, msg.decode_tp_size);
    if (ranks.empty() && !msg.want_done && !t.decode_tp) {
      // This rank is the source of no slice for a decode of this TP (its heads are replicas the
      // plan reads elsewhere): the decode's skip names that TP, and with it this rank has no
      // pair left to wait for (Advance completes it).
      t.decode_tp = msg.decode_tp_size;
      return;
    }
    if (std::find(ranks.begin(), ranks.end(), msg.decode_rank) == ranks.end()) {
      ++k.counters.notifications_ignored;
      return;
    }
    t.decode_tp = msg.decode_tp_size;
    Target& g = t.targets[msg.decode_rank];
    g.msg = WriteBlocksMsg{.transfer_id = tid,
                           .prefill_engine_id = options_.engine_id,
                           .prefill_rank = k.rank,
                           .decode_engine_id = msg.decode_engine_id,
                           .decode_rank = msg.decode_rank,
                           .decode_tp_size = msg.decode_tp_size};
    g.state = TargetState::kCancelling;  // settles to kDone in Advance (nothing in flight)
    g.want_done = false;                 // no route back to a decode that never sent its endpoint
    g.outcome = WriteOutcome::kCancelled;
    g.reason = msg.want_done ? "cancelled by the decode" : "skipped";
    // The decode keeps its blocks until it hears back; its WriteBlocks (the route) is late.
    if (msg.want_done) k.overtaken_cancels.insert({tid, msg.decode_engine_id, msg.decode_rank});
    return;
  }
  Target& g = it->second;
  if (g.state != TargetState::kActive) return;  // crossed our WriteDone or a close: no-op
  g.want_done = msg.want_done;
  CancelTarget(k, g, WriteOutcome::kCancelled, "cancelled by the decode");
}

void WritePrefillCore::Close(Rank& k, Transfer& t, CloseReason reason) {
  if (t.close != CloseReason::kNone) return;
  t.close = reason;
  for (auto& [d, g] : t.targets)
    CancelTarget(k, g, WriteOutcome::kFailed, std::string(ReasonName(reason)));
}

void WritePrefillCore::Advance(Rank& k, const std::string& tid, TimePoint now) {
  auto it = k.transfers.find(tid);
  if (it == k.transfers.end()) return;
  Transfer& t = it->second;
  bool drained = true;
  for (auto& [d, g] : t.targets) {
    if (g.state == TargetState::kActive && !g.write_failed &&
        g.layers_posted == options_.num_layers && g.inflight.empty()) {
      Move(g, TargetState::kDone);
      g.outcome = g.write_failed ? WriteOutcome::kFailed : WriteOutcome::kOk;
      SendDone(k, t, g, now);
    } else if (g.state == TargetState::kCancelling && g.inflight.empty()) {
      Move(g, TargetState::kDone);
      if (g.want_done) SendDone(k, t, g, now);
    }
    if (!g.inflight.empty() || g.state == TargetState::kCancelling) drained = false;
  }
  if (t.close == CloseReason::kNone) {
    // Complete once the decode's TP is known and every pair this rank writes is done (none,
    // for a rank that is the source of no slice).
    const std::vector<int> expected = ExpectedDecodeRanks(k, t);
    bool complete = t.decode_tp.has_value();
    for (int d : expected) {
      auto g = t.targets.find(d);
      if (g == t.targets.end() || g->second.state != TargetState::kDone) complete = false;
    }
    if (complete) {
      t.close = CloseReason::kCompleted;
      t.lease_deadline.reset();
      ++k.counters.transfers_completed;
      if (t.first_layer_at >= 0) k.counters.compute_us_sum += t.last_layer_at - t.first_layer_at;
    }
  }
  if (t.close == CloseReason::kNone || !drained) return;
  if (t.held || t.aborted_keep) {
    ++k.counters.holds_freed;
    k.actions.push_back(ReportBlocksFreeAction{t.request_id});
    t.held = false;
    t.aborted_keep = false;
  }
  if (!t.gone) return;  // the engine still runs it: OnRequestFinished/Aborted erases
  const CloseReason reason = t.close;
  k.request_to_transfer.erase(t.request_id);
  for (auto& [d, g] : t.targets) {
    for (uint64_t id : g.inflight) k.writes.erase(id);
  }
  k.transfers.erase(it);
  Bury(k, tid, reason, now);
}

void WritePrefillCore::Bury(Rank& k, const std::string& tid, CloseReason reason, TimePoint now) {
  k.tombstones[tid] = Tombstone{reason, now + options_.lease};
  k.tombstone_order.emplace_back(now + options_.lease, tid);
  while (static_cast<int64_t>(k.tombstones.size()) > options_.max_tombstones &&
         !k.tombstone_order.empty()) {
    auto [exp, id] = k.tombstone_order.front();
    k.tombstone_order.pop_front();
    auto tb = k.tombstones.find(id);
    if (tb != k.tombstones.end() && tb->second.expires == exp) k.tombstones.erase(tb);
  }
}

bool WritePrefillCore::OnRequestFinished(const std::string& request_id,
                                         std::span<const int32_t> block_ids, TimePoint now) {
  std::set<int> holding;
  for (Rank& k : ranks_) {
    if (Finish(k, request_id, block_ids, now)) holding.insert(k.rank);
  }
  return Hold(request_id, holding);
}

bool WritePrefillCore::Finish(Rank& k, const std::string& request_id,
                              std::span<const int32_t> block_ids, TimePoint now) {
  auto rt = k.request_to_transfer.find(request_id);
  if (rt == k.request_to_transfer.end()) return false;
  const std::string tid = rt->second;
  Transfer& t = k.transfers.at(tid);
  t.finished = true;
  t.gone = true;
  if (block_ids.size() >= t.blocks.size()) t.blocks.assign(block_ids.begin(), block_ids.end());
  // Every layer's KV is final now (covers engines that do not report layers).
  if (t.layers_computed < options_.num_layers) {
    if (t.first_layer_at < 0) t.first_layer_at = now;
    t.last_layer_at = now;
    std::fill(t.layer_computed.begin(), t.layer_computed.end(), true);
    t.layers_computed = options_.num_layers;
    if (t.close == CloseReason::kNone) {
      for (auto& [d, g] : t.targets) {
        if (g.layers_posted == 0) {
          PostLayer(k, tid, t, g, -1, now);
        } else {
          for (int l = 0; l < options_.num_layers; ++l) PostLayer(k, tid, t, g, l, now);
        }
      }
    }
  }
  Advance(k, tid, now);
  auto it = k.transfers.find(tid);
  if (it == k.transfers.end()) return false;  // completed and drained: free now
  Transfer& tt = it->second;
  tt.held = true;
  ++k.counters.holds;
  if (tt.close == CloseReason::kNone) tt.lease_deadline = now + options_.lease;
  return true;
}

bool WritePrefillCore::OnRequestAborted(const std::string& request_id, TimePoint now) {
  std::set<int> holding;
  for (Rank& k : ranks_) {
    if (Abort(k, request_id, now)) holding.insert(k.rank);
  }
  return Hold(request_id, holding);
}

bool WritePrefillCore::Abort(Rank& k, const std::string& request_id, TimePoint now) {
  auto rt = k.request_to_transfer.find(request_id);
  if (rt == k.request_to_transfer.end()) return false;
  const std::string tid = rt->second;
  Transfer& t = k.transfers.at(tid);
  t.gone = true;
  if (t.close == CloseReason::kNone) {
    ++k.counters.transfers_aborted;
    Close(k, t, CloseReason::kAborted);
  }
  bool drained = true;
  for (const auto& [d, g] : t.targets) drained = drained && g.inflight.empty();
  t.aborted_keep = !drained;  // cleared (and reported) once the cancelled writes ended
  Advance(k, tid, now);
  return !drained;
}

void WritePrefillCore::Park(Rank& k, ControlMessage msg, const std::string& tid, TimePoint now) {
  if (static_cast<int64_t>(k.parked.size()) >= options_.max_parked_messages) {
    ++k.counters.parked_dropped;
    ++k.counters.notifications_ignored;
    if (auto* wb = std::get_if<WriteBlocksMsg>(&msg)) Reject(k, *wb, "too many parked messages");
    return;
  }
  ++k.counters.notifications_parked;
  k.parked.emplace(tid, Parked{std::move(msg), now + options_.lease});
}

void WritePrefillCore::OnAbortedBeforeAdmission(const std::string& transfer_id, TimePoint now) {
  for (Rank& k : ranks_) AbortQueued(k, transfer_id, now);
}

void WritePrefillCore::AbortQueued(Rank& k, const std::string& transfer_id, TimePoint now) {
  if (k.transfers.count(transfer_id)) return;  // admitted: OnRequestAborted handles it
  auto [lo, hi] = k.parked.equal_range(transfer_id);
  for (auto it = lo; it != hi; ++it) {
    if (auto* wb = std::get_if<WriteBlocksMsg>(&it->second.msg)) Reject(k, *wb, "aborted");
  }
  k.parked.erase(lo, hi);
  Bury(k, transfer_id, CloseReason::kAborted, now);
}

void WritePrefillCore::OnWriteBlocks(const WriteBlocksMsg& msg, TimePoint now) {
  Rank& k = RankFor(msg.prefill_rank);
  if (msg.prefill_engine_id != options_.engine_id) {
    ++k.counters.notifications_ignored;
    Reject(k, msg, "incarnation");
    return;
  }
  auto it = k.transfers.find(msg.transfer_id);
  if (it != k.transfers.end()) {
    AddTarget(k, msg.transfer_id, it->second, msg, now);
    Advance(k, msg.transfer_id, now);
    return;
  }
  auto tb = k.tombstones.find(msg.transfer_id);
  if (tb != k.tombstones.end() && tb->second.expires > now) {
    if (AnswerOvertakenCancel(k, msg)) {
      // the pair was settled by the decode's cancel; confirmed now
    } else if (tb->second.reason == CloseReason::kCompleted) {
      ++k.counters.notifications_ignored;  // a duplicate after completion
    } else {
      Reject(k, msg, std::string(ReasonName(tb->second.reason)));
    }
    return;
  }
  Park(k, msg, msg.transfer_id, now);
}

int64_t WritePrefillCore::OnPeerLost(const std::string& decode_engine_id, TimePoint now) {
  int64_t cancelled = 0;
  for (Rank& k : ranks_) {
    std::vector<std::string> touched;
    for (auto& [tid, t] : k.transfers) {
      for (auto& [d, g] : t.targets) {
        if (g.msg.decode_engine_id != decode_engine_id || g.state != TargetState::kActive) continue;
        g.want_done = false;  // nobody to tell
        CancelTarget(k, g, WriteOutcome::kFailed, "decode " + decode_engine_id + " lost");
        ++k.counters.peer_lost;
        ++cancelled;
        touched.push_back(tid);
      }
    }
    for (const std::string& tid : touched) Advance(k, tid, now);
    for (auto it = k.parked.begin(); it != k.parked.end();) {
      const auto* wb = std::get_if<WriteBlocksMsg>(&it->second.msg);
      const auto* wc = std::get_if<WriteCancelMsg>(&it->second.msg);
      const bool from = (wb != nullptr && wb->decode_engine_id == decode_engine_id) ||
                        (wc != nullptr && wc->decode_engine_id == decode_engine_id);
      if (from) {
        ++k.counters.parked_dropped;
        it = k.parked.erase(it);
      } else {
        ++it;
      }
    }
  }
  return cancelled;
}

void WritePrefillCore::OnWriteCancel(const WriteCancelMsg& msg, TimePoint now) {
  Rank& k = RankFor(msg.prefill_rank);
  if (msg.prefill_engine_id != options_.engine_id) {
    ++k.counters.notifications_ignored;
    return;
  }
  auto it = k.transfers.find(msg.transfer_id);
  if (it != k.transfers.end()) {
    ApplyCancel(k, msg.transfer_id, it->second, msg);
    Advance(k, msg.transfer_id, now);
    return;
  }
  auto tb = k.tombstones.find(msg.transfer_id);
  if (tb != k.tombstones.end() && tb->second.expires > now) return;  // crossed the end: no-op
  Park(k, msg, msg.transfer_id, now);
}

Status WritePrefillCore::OnRelease(const ReleaseMsg& msg, TimePoint now) {
  Status first;
  bool any_ok = false;
  for (Rank& k : ranks_) {
    Status st = Release(k, msg, now);
    any_ok = any_ok || st.ok();
    if (first.ok() && !st.ok()) first = st;
  }
  return any_ok ? OkStatus() : first;
}

Status WritePrefillCore::Release(Rank& k, const ReleaseMsg& msg, TimePoint now) {
  if (!msg.prefill_engine_id.empty() && msg.prefill_engine_id != options_.engine_id) {
    return NotFoundError("engine " + msg.prefill_engine_id + " is not this incarnation");
  }
  auto it = k.transfers.find(msg.transfer_id);
  if (it != k.transfers.end()) {
    if (it->second.close == CloseReason::kNone) {
      ++k.counters.transfers_released;
      Close(k, it->second, CloseReason::kReleased);
    }
    Advance(k, msg.transfer_id, now);
    return OkStatus();
  }
  auto tb = k.tombstones.find(msg.transfer_id);
  if (tb != k.tombstones.end() && tb->second.expires > now) return OkStatus();
  Park(k, msg, msg.transfer_id, now);
  return OkStatus();
}

void WritePrefillCore::OnWriteCompleted(uint64_t write_id, const Status& status, TimePoint now) {
  const uint64_t r = write_id >> kRankShift;
  if (r >= ranks_.size()) {
    ++ignored_;
    return;
  }
  Rank& k = ranks_[r];
  auto w = k.writes.find(write_id);
  if (w == k.writes.end()) {
    ++k.counters.notifications_ignored;
    return;
  }
  const auto [tid, rank] = w->second;
  k.writes.erase(w);
  auto it = k.transfers.find(tid);
  if (it == k.transfers.end()) return;
  auto g = it->second.targets.find(rank);
  if (g == it->second.targets.end()) return;
  Target& tg = g->second;
  tg.inflight.erase(write_id);
  if (status.ok()) {
    ++k.counters.writes_ok;
    tg.last_done = now;
    if (tg.done_attached == write_id && tg.state == TargetState::kActive && tg.inflight.empty()) {
      Move(tg, TargetState::kDone);  // the agent delivered our WriteDone(ok) with the data
      tg.outcome = WriteOutcome::kOk;
      RecordOk(k, tg);
    } else if (tg.done_attached == write_id && tg.state == TargetState::kCancelling) {
      // Landed before the cancel: the decode got WriteDone(ok) (its drained confirmation).
      Move(tg, TargetState::kDone);
      RecordOk(k, tg);
    }
  } else {
    ++k.counters.writes_failed;
    tg.write_failed = true;
    CancelTarget(k, tg, WriteOutcome::kFailed, "write failed: " + status.message());
  }
  Advance(k, tid, now);
}

void WritePrefillCore::OnTick(TimePoint now) {
  for (Rank& k : ranks_) Tick(k, now);
}

void WritePrefillCore::Tick(Rank& k, TimePoint now) {
  for (auto it = k.parked.begin(); it != k.parked.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    ++k.counters.parked_dropped;
    ++k.counters.notifications_ignored;
    if (auto* wb = std::get_if<WriteBlocksMsg>(&it->second.msg)) Reject(k, *wb, "expired");
    it = k.parked.erase(it);
  }
  while (!k.tombstone_order.empty() && k.tombstone_order.front().first <= now) {
    auto [exp, id] = k.tombstone_order.front();
    k.tombstone_order.pop_front();
    auto tb = k.tombstones.find(id);
    if (tb != k.tombstones.end() && tb->second.expires == exp) {
      k.tombstones.erase(tb);
      auto oc = k.overtaken_cancels.lower_bound({id, "", INT32_MIN});
      while (oc != k.overtaken_cancels.end() && std::get<0>(*oc) == id)
        oc = k.overtaken_cancels.erase(oc);
    }
  }
  std::vector<std::string> tids;
  for (auto& [tid, t] : k.transfers) tids.push_back(tid);
  for (const std::string& tid : tids) {
    auto it = k.transfers.find(tid);
    if (it == k.transfers.end()) continue;
    Transfer& t = it->second;
    if (t.close == CloseReason::kNone && t.lease_deadline && *t.lease_deadline <= now) {
      ++k.counters.lease_expired;
      Close(k, t, CloseReason::kExpired);
    }
    for (auto& [d, g] : t.targets) {
      if (g.state == TargetState::kActive && g.received + options_.lease <= now) {
        CancelTarget(k, g, WriteOutcome::kFailed, "expired");
      }
    }
    Advance(k, tid, now);
  }
}

std::vector<ConnectorAction> WritePrefillCore::TakeActions() {
  std::vector<ConnectorAction> out;
  for (Rank& k : ranks_) {
    for (ConnectorAction& a : k.actions) {
      if (auto* f = std::get_if<ReportBlocksFreeAction>(&a)) {
        // The ranks share one block table: free when the last rank that held lets go.
        auto h = holders_.find(f->request_id);
        if (h != holders_.end()) {
          h->second.erase(k.rank);
          if (!h->second.empty()) continue;
          holders_.erase(h);
        }
      }
      out.push_back(std::move(a));
    }
    k.actions.clear();
  }
  return out;
}

std::vector<int64_t> WritePrefillCore::TakeTransferTimes() {
  std::vector<int64_t> out;
  for (Rank& k : ranks_) {
    out.insert(out.end(), k.transfer_times.begin(), k.transfer_times.end());
    k.transfer_times.clear();
  }
  return out;
}

std::optional<TimePoint> WritePrefillCore::NextDeadline() const {
  std::optional<TimePoint> best;
  auto take = [&](TimePoint t) {
    if (!best || t < *best) best = t;
  };
  for (const Rank& k : ranks_) {
    for (const auto& [tid, p] : k.parked) take(p.expires);
    for (const auto& [tid, t] : k.transfers) {
      if (t.close == CloseReason::kNone && t.lease_deadline) take(*t.lease_deadline);
      for (const auto& [d, g] : t.targets) {
        if (g.state == TargetState::kActive) take(g.received + options_.lease);
      }
    }
  }
  return best;
}

bool WritePrefillCore::Idle() const {
  return holders_.empty() && std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& k) {
           return k.transfers.empty() && k.parked.empty();
         });
}

int64_t WritePrefillCore::NumTransfers() const {
  int64_t n = 0;
  for (const Rank& k : ranks_) n = std::max(n, static_cast<int64_t>(k.transfers.size()));
  return n;
}

int64_t WritePrefillCore::NumParked() const {
  int64_t n = 0;
  for (const Rank& k : ranks_) n += static_cast<int64_t>(k.parked.size());
  return n;
}

bool WritePrefillCore::Knows(const std::string& transfer_id) const {
  return std::any_of(ranks_.begin(), ranks_.end(), [&](const Rank& k) {
    return k.transfers.count(transfer_id) > 0 || k.tombstones.count(transfer_id) > 0;
  });
}

int64_t WritePrefillCore::NumHeldBlocks() const {
  int64_t n = 0;
  for (const Rank& k : ranks_) {
    std::set<int32_t> blocks;
    for (const auto& [tid, t] : k.transfers) {
      if (t.held || t.aborted_keep) blocks.insert(t.blocks.begin(), t.blocks.end());
    }
    n = std::max(n, static_cast<int64_t>(blocks.size()));
  }
  return n;
}

int64_t WritePrefillCore::NumWritesInFlight() const {
  int64_t n = 0;
  for (const Rank& k : ranks_) n += static_cast<int64_t>(k.writes.size());
  return n;
}

const WritePrefillCore::Counters& WritePrefillCore::rank_counters(int r) const {
  return ranks_.at(static_cast<size_t>(r)).counters;
}

WritePrefillCore::Counters WritePrefillCore::counters() const {
  Counters s;
  for (const Rank& r : ranks_) {
    const Counters& k = r.counters;
    s.holds += k.holds;
    s.holds_freed += k.holds_freed;
    s.lease_expired += k.lease_expired;
    s.transfers_completed += k.transfers_completed;
    s.transfers_released += k.transfers_released;
    s.transfers_aborted += k.transfers_aborted;
    s.writes_posted += k.writes_posted;
    s.writes_ok += k.writes_ok;
    s.writes_failed += k.writes_failed;
    s.targets_ok += k.targets_ok;
    s.targets_failed += k.targets_failed;
    s.peer_lost += k.peer_lost;
    s.notifications_parked += k.notifications_parked;
    s.notifications_ignored += k.notifications_ignored;
    s.parked_dropped += k.parked_dropped;
    s.transfer_us_sum += k.transfer_us_sum;
    s.compute_us_sum += k.compute_us_sum;
  }
  s.notifications_ignored += ignored_;
  return s;
}

}  // namespace kvbridge
