#include "kvbridge/connector/write_prefill_core.h"

#include <algorithm>
#include <utility>

#include "connector/remote_load.h"
#include "kvbridge/connector/tp_plan.h"
#ifdef KVBRIDGE_PLANTED_FAULTS
#include "kvbridge/sim/planted_faults.h"  // test-only switches (src/sim builds them in)
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
  next_write_id_ = std::max<uint64_t>(1, options_.first_write_id);
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

std::vector<int> WritePrefillCore::DecodeRanksWrittenBy(int decode_tp) const {
  // Without a head count, one that splits evenly over both sizes gives the even-split pairs.
  const int heads =
      options_.num_kv_heads > 0 ? options_.num_kv_heads : options_.tp_size * std::max(1, decode_tp);
  std::vector<int> out;
  for (const auto& [d, p] : TpPlanPairs(options_.tp_size, decode_tp, heads)) {
    if (p == options_.rank) out.push_back(d);
  }
  return out;
}

std::vector<int> WritePrefillCore::ExpectedDecodeRanks(const Transfer& t) const {
  if (!t.decode_tp) return {};
  return DecodeRanksWrittenBy(*t.decode_tp);
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
  if (request_to_transfer_.count(request_id)) {
    return AlreadyExistsError("request " + request_id + " is already registered");
  }
  if (transfers_.count(transfer_id)) {
    return AlreadyExistsError("transfer " + transfer_id + " is already registered");
  }
  tombstones_.erase(transfer_id);
  Transfer& t = transfers_[transfer_id];
  t.request_id = request_id;
  t.num_prompt_tokens = num_prompt_tokens;
  t.layer_computed.assign(static_cast<size_t>(options_.num_layers), false);
  request_to_transfer_[request_id] = transfer_id;
  // Messages that came first, in arrival order.
  auto [lo, hi] = parked_.equal_range(transfer_id);
  std::vector<ControlMessage> msgs;
  for (auto it = lo; it != hi; ++it) msgs.push_back(std::move(it->second.msg));
  parked_.erase(lo, hi);
  for (ControlMessage& m : msgs) {
    if (!transfers_.count(transfer_id)) break;
    Transfer& tt = transfers_.at(transfer_id);
    if (auto* wb = std::get_if<WriteBlocksMsg>(&m)) {
      AddTarget(transfer_id, tt, *wb, now);
    } else if (auto* wc = std::get_if<WriteCancelMsg>(&m)) {
      ApplyCancel(transfer_id, tt, *wc, now);
    } else if (std::holds_alternative<ReleaseMsg>(m)) {
      if (tt.close == CloseReason::kNone) {
        ++counters_.transfers_released;
        Close(transfer_id, tt, CloseReason::kReleased, now);
      }
    }
  }
  if (transfers_.count(transfer_id)) Advance(transfer_id, now);
  return OkStatus();
}

void WritePrefillCore::OnLayerComputed(const std::string& request_id, int layer,
                                       std::span<const int32_t> block_table, TimePoint now) {
  auto rt = request_to_transfer_.find(request_id);
  if (rt == request_to_transfer_.end()) return;  // not a WRITE-mode prefill request
  const std::string tid = rt->second;
  Transfer& t = transfers_.at(tid);
  if (layer < 0 || layer >= options_.num_layers || t.layer_computed[layer] || t.gone) return;
  if (block_table.size() >= t.blocks.size())
    t.blocks.assign(block_table.begin(), block_table.end());
  t.layer_computed[layer] = true;
  ++t.layers_computed;
  if (t.first_layer_at < 0) t.first_layer_at = now;
  t.last_layer_at = now;
  if (t.close != CloseReason::kNone) return;
  for (auto& [d, g] : t.targets) PostLayer(tid, t, g, layer, now);
  Advance(tid, now);
}

void WritePrefillCore::PostLayer(const std::string& tid, Transfer& t, Target& g, int layer,
                                 TimePoint now) {
  if (g.state != TargetState::kActive) return;
  if (layer >= 0 && g.layer_posted[layer]) return;
  if (layer < 0 && g.layers_posted > 0) return;
  if (now > g.received + options_.lease) {
    // The decode stops waiting at lease + grace: never start a write it no longer expects.
    CancelTarget(g, WriteOutcome::kFailed, "expired");
    return;
  }
  PostWriteAction a;
  a.transfer_id = tid;
  a.decode = PeerEndpoint{.engine_id = g.msg.decode_engine_id,
                          .host = g.msg.decode_host,
                          .port = g.msg.decode_port,
                          .rank = g.msg.decode_rank};
  a.prefill_rank = options_.rank;
  a.decode_tp_size = g.msg.decode_tp_size;
  a.layer = layer;
  for (size_t i = 0; i < g.msg.block_ids.size(); ++i) {
    const size_t idx = static_cast<size_t>(g.msg.first_block) + i;
    if (idx >= t.blocks.size()) {
      g.write_failed = true;
      CancelTarget(g, WriteOutcome::kFailed, "the prefill's block table does not cover the blocks");
      return;
    }
    a.local_block_ids.push_back(t.blocks[idx]);
    a.remote_block_ids.push_back(g.msg.block_ids[i]);
  }
  a.write_id = next_write_id_++;
  writes_[a.write_id] = {tid, g.msg.decode_rank};
  const bool nothing_in_flight = g.inflight.empty();
  g.inflight.insert(a.write_id);
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
    attach = attach && options_.rank != options_.tp_size - 1;
#endif
  if (attach) {
    // The target's last WRITE with every earlier one landed: its notification, delivered by the
    // agent after this WRITE's data landed, is the WriteDone — no wait for the engine thread.
    Target done = g;
    done.outcome = WriteOutcome::kOk;
    a.notification = MakeDone(t, done, now);
    g.done_attached = a.write_id;
  }
  ++counters_.writes_posted;
  actions_.push_back(std::move(a));
}

void WritePrefillCore::CancelTarget(Target& g, WriteOutcome outcome, std::string reason) {
  if (g.state != TargetState::kActive) return;
  g.state = TargetState::kCancelling;
  g.outcome = outcome;
  g.reason = std::move(reason);
  for (uint64_t id : g.inflight) actions_.push_back(CancelWriteAction{id});
}

void WritePrefillCore::Reject(const WriteBlocksMsg& msg, std::string reason) {
  ++counters_.targets_failed;
  actions_.push_back(
      SendMessageAction{.to = PeerEndpoint{.engine_id = msg.decode_engine_id,
                                           .host = msg.decode_host,
                                           .port = msg.decode_port,
                                           .rank = msg.decode_rank},
                        .msg = WriteDoneMsg{.transfer_id = msg.transfer_id,
                                            .prefill_engine_id = msg.prefill_engine_id,
                                            .prefill_rank = msg.prefill_rank,
                                            .decode_engine_id = msg.decode_engine_id,
                                            .decode_rank = msg.decode_rank,
                                            .outcome = WriteOutcome::kFailed,
                                            .reason = std::move(reason)}});
}

bool WritePrefillCore::AnswerOvertakenCancel(const WriteBlocksMsg& msg) {
  auto it = overtaken_cancels_.find({msg.transfer_id, msg.decode_engine_id, msg.decode_rank});
  if (it == overtaken_cancels_.end()) return false;
  overtaken_cancels_.erase(it);
  ++counters_.targets_failed;
  actions_.push_back(SendMessageAction{.to = PeerEndpoint{.engine_id = msg.decode_engine_id,
                                                          .host = msg.decode_host,
                                                          .port = msg.decode_port,
                                                          .rank = msg.decode_rank},
                                       .msg = WriteDoneMsg{.transfer_id = msg.transfer_id,
                                                           .prefill_engine_id = options_.engine_id,
                                                           .prefill_rank = options_.rank,
                                                           .decode_engine_id = msg.decode_engine_id,
                                                           .decode_rank = msg.decode_rank,
                                                           .outcome = WriteOutcome::kCancelled,
                                                           .reason = "cancelled by the decode"}});
  return true;
}

WriteDoneMsg WritePrefillCore::MakeDone(const Transfer& t, const Target& g, TimePoint now) const {
  WriteDoneMsg m{.transfer_id = g.msg.transfer_id,
                 .prefill_engine_id = options_.engine_id,
                 .prefill_rank = options_.rank,
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

void WritePrefillCore::RecordOk(const Target& g) {
  ++counters_.targets_ok;
  if (g.first_post >= 0 && g.last_done >= g.first_post) {
    counters_.transfer_us_sum += g.last_done - g.first_post;
    transfer_times_.push_back(g.last_done - g.first_post);
  }
}

void WritePrefillCore::SendDone(const Transfer& t, Target& g, TimePoint now) {
  if (g.outcome == WriteOutcome::kOk) {
    RecordOk(g);
  } else {
    ++counters_.targets_failed;
  }
#ifdef KVBRIDGE_PLANTED_FAULTS
  if (sim::Planted().prefill_rank_never_sends_write_done && options_.rank == options_.tp_size - 1 &&
      g.outcome == WriteOutcome::kOk)
    return;
#endif
  actions_.push_back(SendMessageAction{.to = PeerEndpoint{.engine_id = g.msg.decode_engine_id,
                                                          .host = g.msg.decode_host,
                                                          .port = g.msg.decode_port,
                                                          .rank = g.msg.decode_rank},
                                       .msg = MakeDone(t, g, now)});
}

void WritePrefillCore::AddTarget(const std::string& tid, Transfer& t, const WriteBlocksMsg& msg,
                                 TimePoint now) {
  if (msg.prefill_rank != options_.rank) {
    Reject(msg, "rank " + std::to_string(msg.prefill_rank) + " is not this prefill rank");
    return;
  }
  if (t.decode_tp && *t.decode_tp != msg.decode_tp_size) {
    Reject(msg, "decode tp_size differs from an earlier message of this transfer");
    return;
  }
  const std::vector<int> ranks = DecodeRanksWrittenBy(msg.decode_tp_size);
  if (std::find(ranks.begin(), ranks.end(), msg.decode_rank) == ranks.end()) {
    Reject(msg, "decode rank " + std::to_string(msg.decode_rank) + " is not written by rank " +
                    std::to_string(options_.rank));
    return;
  }
  if (AnswerOvertakenCancel(msg)) return;
  if (t.targets.count(msg.decode_rank)) {
    ++counters_.notifications_ignored;  // duplicate
    return;
  }
  if (t.close != CloseReason::kNone) {
    Reject(msg, std::string(ReasonName(t.close)));
    return;
  }
  const int bs = options_.block_size;
  const int64_t prompt_blocks = (static_cast<int64_t>(t.num_prompt_tokens) + bs - 1) / bs;
  if (msg.num_prompt_tokens != t.num_prompt_tokens ||
      static_cast<int64_t>(msg.first_block) + static_cast<int64_t>(msg.block_ids.size()) >
          prompt_blocks) {
    Reject(msg, "prompt mismatch: the decode has " + std::to_string(msg.num_prompt_tokens) +
                    " prompt tokens, this prefill " + std::to_string(t.num_prompt_tokens));
    return;
  }
  t.decode_tp = msg.decode_tp_size;
  Target& g = t.targets[msg.decode_rank];
  g.msg = msg;
  g.received = now;
  g.layer_posted.assign(static_cast<size_t>(options_.num_layers), false);
  if (t.layers_computed == options_.num_layers) {
    PostLayer(tid, t, g, -1, now);  // everything is final: one transfer over all layers
  } else {
    for (int l = 0; l < options_.num_layers; ++l) {
      if (t.layer_computed[l]) PostLayer(tid, t, g, l, now);
    }
  }
}

void WritePrefillCore::ApplyCancel(const std::string& tid, Transfer& t, const WriteCancelMsg& msg,
                                   TimePoint now) {
  (void)tid;
  (void)now;
  if (msg.prefill_rank != options_.rank || (t.decode_tp && *t.decode_tp != msg.decode_tp_size)) {
    ++counters_.notifications_ignored;
    return;
  }
  auto it = t.targets.find(msg.decode_rank);
  if (it == t.targets.end()) {
    // Skip (nothing needed), or a cancel before any block ids: this decode rank is settled.
    const std::vector<int> ranks = DecodeRanksWrittenBy(msg.decode_tp_size);
    if (ranks.empty() && !msg.want_done && !t.decode_tp) {
      // This rank is the source of no slice for a decode of this TP (its heads are replicas the
      // plan reads elsewhere): the decode's skip names that TP, and with it this rank has no
      // pair left to wait for (Advance completes it).
      t.decode_tp = msg.decode_tp_size;
      return;
    }
    if (std::find(ranks.begin(), ranks.end(), msg.decode_rank) == ranks.end()) {
      ++counters_.notifications_ignored;
      return;
    }
    t.decode_tp = msg.decode_tp_size;
    Target& g = t.targets[msg.decode_rank];
    g.msg = WriteBlocksMsg{.transfer_id = tid,
                           .prefill_engine_id = options_.engine_id,
                           .prefill_rank = options_.rank,
                           .decode_engine_id = msg.decode_engine_id,
                           .decode_rank = msg.decode_rank,
                           .decode_tp_size = msg.decode_tp_size};
    g.state = TargetState::kCancelling;  // settles to kDone in Advance (nothing in flight)
    g.want_done = false;                 // no route back to a decode that never sent its endpoint
    g.outcome = WriteOutcome::kCancelled;
    g.reason = msg.want_done ? "cancelled by the decode" : "skipped";
    // The decode keeps its blocks until it hears back; its WriteBlocks (the route) is late.
    if (msg.want_done) overtaken_cancels_.insert({tid, msg.decode_engine_id, msg.decode_rank});
    return;
  }
  Target& g = it->second;
  if (g.state != TargetState::kActive) return;  // crossed our WriteDone or a close: no-op
  g.want_done = msg.want_done;
  CancelTarget(g, WriteOutcome::kCancelled, "cancelled by the decode");
}

void WritePrefillCore::Close(const std::string& tid, Transfer& t, CloseReason reason,
                             TimePoint now) {
  (void)tid;
  (void)now;
  if (t.close != CloseReason::kNone) return;
  t.close = reason;
  for (auto& [d, g] : t.targets)
    CancelTarget(g, WriteOutcome::kFailed, std::string(ReasonName(reason)));
}

void WritePrefillCore::Advance(const std::string& tid, TimePoint now) {
  auto it = transfers_.find(tid);
  if (it == transfers_.end()) return;
  Transfer& t = it->second;
  bool drained = true;
  for (auto& [d, g] : t.targets) {
    if (g.state == TargetState::kActive && !g.write_failed &&
        g.layers_posted == options_.num_layers && g.inflight.empty()) {
      g.state = TargetState::kDone;
      g.outcome = WriteOutcome::kOk;
      SendDone(t, g, now);
    } else if (g.state == TargetState::kCancelling && g.inflight.empty()) {
      g.state = TargetState::kDone;
      if (g.want_done) SendDone(t, g, now);
    }
    if (!g.inflight.empty() || g.state == TargetState::kCancelling) drained = false;
  }
  if (t.close == CloseReason::kNone) {
    // Complete once the decode's TP is known and every pair this rank writes is done (none,
    // for a rank that is the source of no slice).
    const std::vector<int> expected = ExpectedDecodeRanks(t);
    bool complete = t.decode_tp.has_value();
    for (int d : expected) {
      auto g = t.targets.find(d);
      if (g == t.targets.end() || g->second.state != TargetState::kDone) complete = false;
    }
    if (complete) {
      t.close = CloseReason::kCompleted;
      t.lease_deadline.reset();
      ++counters_.transfers_completed;
      if (t.first_layer_at >= 0) counters_.compute_us_sum += t.last_layer_at - t.first_layer_at;
    }
  }
  if (t.close == CloseReason::kNone || !drained) return;
  if (t.held || t.aborted_keep) {
    ++counters_.holds_freed;
    actions_.push_back(ReportBlocksFreeAction{t.request_id});
    t.held = false;
    t.aborted_keep = false;
  }
  if (!t.gone) return;  // the engine still runs it: OnRequestFinished/Aborted erases
  const CloseReason reason = t.close;
  request_to_transfer_.erase(t.request_id);
  for (auto& [d, g] : t.targets) {
    for (uint64_t id : g.inflight) writes_.erase(id);
  }
  transfers_.erase(it);
  Bury(tid, reason, now);
}

void WritePrefillCore::Bury(const std::string& tid, CloseReason reason, TimePoint now) {
  tombstones_[tid] = Tombstone{reason, now + options_.lease};
  tombstone_order_.emplace_back(now + options_.lease, tid);
  while (static_cast<int64_t>(tombstones_.size()) > options_.max_tombstones &&
         !tombstone_order_.empty()) {
    auto [exp, id] = tombstone_order_.front();
    tombstone_order_.pop_front();
    auto tb = tombstones_.find(id);
    if (tb != tombstones_.end() && tb->second.expires == exp) tombstones_.erase(tb);
  }
}

bool WritePrefillCore::OnRequestFinished(const std::string& request_id,
                                         std::span<const int32_t> block_ids, TimePoint now) {
  auto rt = request_to_transfer_.find(request_id);
  if (rt == request_to_transfer_.end()) return false;
  const std::string tid = rt->second;
  Transfer& t = transfers_.at(tid);
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
          PostLayer(tid, t, g, -1, now);
        } else {
          for (int l = 0; l < options_.num_layers; ++l) PostLayer(tid, t, g, l, now);
        }
      }
    }
  }
  Advance(tid, now);
  auto it = transfers_.find(tid);
  if (it == transfers_.end()) return false;  // completed and drained: free now
  Transfer& tt = it->second;
  tt.held = true;
  ++counters_.holds;
  if (tt.close == CloseReason::kNone) tt.lease_deadline = now + options_.lease;
  return true;
}

bool WritePrefillCore::OnRequestAborted(const std::string& request_id, TimePoint now) {
  auto rt = request_to_transfer_.find(request_id);
  if (rt == request_to_transfer_.end()) return false;
  const std::string tid = rt->second;
  Transfer& t = transfers_.at(tid);
  t.gone = true;
  if (t.close == CloseReason::kNone) {
    ++counters_.transfers_aborted;
    Close(tid, t, CloseReason::kAborted, now);
  }
  bool drained = true;
  for (const auto& [d, g] : t.targets) drained = drained && g.inflight.empty();
  t.aborted_keep = !drained;  // cleared (and reported) once the cancelled writes ended
  Advance(tid, now);
  return !drained;
}

void WritePrefillCore::Park(ControlMessage msg, const std::string& tid, TimePoint now) {
  if (static_cast<int64_t>(parked_.size()) >= options_.max_parked_messages) {
    ++counters_.parked_dropped;
    ++counters_.notifications_ignored;
    if (auto* wb = std::get_if<WriteBlocksMsg>(&msg)) Reject(*wb, "too many parked messages");
    return;
  }
  ++counters_.notifications_parked;
  parked_.emplace(tid, Parked{std::move(msg), now + options_.lease});
}

void WritePrefillCore::OnAbortedBeforeAdmission(const std::string& transfer_id, TimePoint now) {
  if (transfers_.count(transfer_id)) return;  // admitted: OnRequestAborted handles it
  auto [lo, hi] = parked_.equal_range(transfer_id);
  for (auto it = lo; it != hi; ++it) {
    if (auto* wb = std::get_if<WriteBlocksMsg>(&it->second.msg)) Reject(*wb, "aborted");
  }
  parked_.erase(lo, hi);
  Bury(transfer_id, CloseReason::kAborted, now);
}

void WritePrefillCore::OnWriteBlocks(const WriteBlocksMsg& msg, TimePoint now) {
  if (msg.prefill_engine_id != options_.engine_id) {
    ++counters_.notifications_ignored;
    Reject(msg, "incarnation");
    return;
  }
  auto it = transfers_.find(msg.transfer_id);
  if (it != transfers_.end()) {
    AddTarget(msg.transfer_id, it->second, msg, now);
    Advance(msg.transfer_id, now);
    return;
  }
  auto tb = tombstones_.find(msg.transfer_id);
  if (tb != tombstones_.end() && tb->second.expires > now) {
    if (AnswerOvertakenCancel(msg)) {
      // the pair was settled by the decode's cancel; confirmed now
    } else if (tb->second.reason == CloseReason::kCompleted) {
      ++counters_.notifications_ignored;  // a duplicate after completion
    } else {
      Reject(msg, std::string(ReasonName(tb->second.reason)));
    }
    return;
  }
  Park(msg, msg.transfer_id, now);
}

void WritePrefillCore::OnWriteCancel(const WriteCancelMsg& msg, TimePoint now) {
  if (msg.prefill_engine_id != options_.engine_id) {
    ++counters_.notifications_ignored;
    return;
  }
  auto it = transfers_.find(msg.transfer_id);
  if (it != transfers_.end()) {
    ApplyCancel(msg.transfer_id, it->second, msg, now);
    Advance(msg.transfer_id, now);
    return;
  }
  auto tb = tombstones_.find(msg.transfer_id);
  if (tb != tombstones_.end() && tb->second.expires > now) return;  // crossed the end: no-op
  Park(msg, msg.transfer_id, now);
}

Status WritePrefillCore::OnRelease(const ReleaseMsg& msg, TimePoint now) {
  if (!msg.prefill_engine_id.empty() && msg.prefill_engine_id != options_.engine_id) {
    return NotFoundError("engine " + msg.prefill_engine_id + " is not this incarnation");
  }
  auto it = transfers_.find(msg.transfer_id);
  if (it != transfers_.end()) {
    if (it->second.close == CloseReason::kNone) {
      ++counters_.transfers_released;
      Close(msg.transfer_id, it->second, CloseReason::kReleased, now);
    }
    Advance(msg.transfer_id, now);
    return OkStatus();
  }
  auto tb = tombstones_.find(msg.transfer_id);
  if (tb != tombstones_.end() && tb->second.expires > now) return OkStatus();
  Park(msg, msg.transfer_id, now);
  return OkStatus();
}

void WritePrefillCore::OnWriteCompleted(uint64_t write_id, const Status& status, TimePoint now) {
  auto w = writes_.find(write_id);
  if (w == writes_.end()) {
    ++counters_.notifications_ignored;
    return;
  }
  const auto [tid, rank] = w->second;
  writes_.erase(w);
  auto it = transfers_.find(tid);
  if (it == transfers_.end()) return;
  auto g = it->second.targets.find(rank);
  if (g == it->second.targets.end()) return;
  Target& tg = g->second;
  tg.inflight.erase(write_id);
  if (status.ok()) {
    ++counters_.writes_ok;
    tg.last_done = now;
    if (tg.done_attached == write_id && tg.state == TargetState::kActive && tg.inflight.empty()) {
      tg.state = TargetState::kDone;  // the agent delivered our WriteDone(ok) with the data
      tg.outcome = WriteOutcome::kOk;
      RecordOk(tg);
    } else if (tg.done_attached == write_id && tg.state == TargetState::kCancelling) {
      // Landed before the cancel: the decode got WriteDone(ok) (its drained confirmation).
      tg.state = TargetState::kDone;
      RecordOk(tg);
    }
  } else {
    ++counters_.writes_failed;
    tg.write_failed = true;
    CancelTarget(tg, WriteOutcome::kFailed, "write failed: " + status.message());
  }
  Advance(tid, now);
}

void WritePrefillCore::OnTick(TimePoint now) {
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    ++counters_.parked_dropped;
    ++counters_.notifications_ignored;
    if (auto* wb = std::get_if<WriteBlocksMsg>(&it->second.msg)) Reject(*wb, "expired");
    it = parked_.erase(it);
  }
  while (!tombstone_order_.empty() && tombstone_order_.front().first <= now) {
    auto [exp, id] = tombstone_order_.front();
    tombstone_order_.pop_front();
    auto tb = tombstones_.find(id);
    if (tb != tombstones_.end() && tb->second.expires == exp) {
      tombstones_.erase(tb);
      auto oc = overtaken_cancels_.lower_bound({id, "", INT32_MIN});
      while (oc != overtaken_cancels_.end() && std::get<0>(*oc) == id)
        oc = overtaken_cancels_.erase(oc);
    }
  }
  std::vector<std::string> tids;
  for (auto& [tid, t] : transfers_) tids.push_back(tid);
  for (const std::string& tid : tids) {
    auto it = transfers_.find(tid);
    if (it == transfers_.end()) continue;
    Transfer& t = it->second;
    if (t.close == CloseReason::kNone && t.lease_deadline && *t.lease_deadline <= now) {
      ++counters_.lease_expired;
      Close(tid, t, CloseReason::kExpired, now);
    }
    for (auto& [d, g] : t.targets) {
      if (g.state == TargetState::kActive && g.received + options_.lease <= now) {
        CancelTarget(g, WriteOutcome::kFailed, "expired");
      }
    }
    Advance(tid, now);
  }
}

std::vector<ConnectorAction> WritePrefillCore::TakeActions() {
  std::vector<ConnectorAction> out;
  out.swap(actions_);
  return out;
}

std::optional<TimePoint> WritePrefillCore::NextDeadline() const {
  std::optional<TimePoint> best;
  auto take = [&](TimePoint t) {
    if (!best || t < *best) best = t;
  };
  for (const auto& [tid, p] : parked_) take(p.expires);
  for (const auto& [tid, t] : transfers_) {
    if (t.close == CloseReason::kNone && t.lease_deadline) take(*t.lease_deadline);
    for (const auto& [d, g] : t.targets) {
      if (g.state == TargetState::kActive) take(g.received + options_.lease);
    }
  }
  return best;
}

int64_t WritePrefillCore::NumHeldBlocks() const {
  std::set<int32_t> blocks;
  for (const auto& [tid, t] : transfers_) {
    if (t.held || t.aborted_keep) blocks.insert(t.blocks.begin(), t.blocks.end());
  }
  return static_cast<int64_t>(blocks.size());
}

// ------------------------------------------------------------------------------------------
// WritePrefillRanks
// ------------------------------------------------------------------------------------------

WritePrefillRanks::WritePrefillRanks(WritePrefillCore::Options options) {
  const int tp = std::max(1, options.tp_size);
  for (int r = 0; r < tp; ++r) {
    WritePrefillCore::Options o = options;
    o.rank = r;
    o.tp_size = tp;
    o.first_write_id = (static_cast<uint64_t>(r) << kRankShift) + 1;
    cores_.emplace_back(std::move(o));
  }
}

Status WritePrefillRanks::OnRequestAdded(const std::string& request_id, int n,
                                         const std::string& transfer_id, int num_prompt_tokens,
                                         TimePoint now) {
  Status first;
  for (WritePrefillCore& c : cores_) {
    Status st = c.OnRequestAdded(request_id, n, transfer_id, num_prompt_tokens, now);
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

void WritePrefillRanks::OnLayerComputed(const std::string& request_id, int layer,
                                        std::span<const int32_t> block_table, TimePoint now) {
  for (WritePrefillCore& c : cores_) c.OnLayerComputed(request_id, layer, block_table, now);
}

bool WritePrefillRanks::Hold(const std::string& request_id, const std::set<int>& ranks) {
  if (ranks.empty()) return false;
  auto& h = holders_[request_id];
  h.insert(ranks.begin(), ranks.end());
  return true;
}

bool WritePrefillRanks::OnRequestFinished(const std::string& request_id,
                                          std::span<const int32_t> block_ids, TimePoint now) {
  std::set<int> ranks;
  for (WritePrefillCore& c : cores_) {
    if (c.OnRequestFinished(request_id, block_ids, now)) ranks.insert(c.options().rank);
  }
  return Hold(request_id, ranks);
}

bool WritePrefillRanks::OnRequestAborted(const std::string& request_id, TimePoint now) {
  std::set<int> ranks;
  for (WritePrefillCore& c : cores_) {
    if (c.OnRequestAborted(request_id, now)) ranks.insert(c.options().rank);
  }
  return Hold(request_id, ranks);
}

void WritePrefillRanks::OnAbortedBeforeAdmission(const std::string& transfer_id, TimePoint now) {
  for (WritePrefillCore& c : cores_) c.OnAbortedBeforeAdmission(transfer_id, now);
}

WritePrefillCore& WritePrefillRanks::CoreFor(int prefill_rank) {
  // A rank out of range goes to rank 0, which refuses it (not its rank).
  if (prefill_rank < 0 || prefill_rank >= static_cast<int>(cores_.size())) return cores_[0];
  return cores_[static_cast<size_t>(prefill_rank)];
}

void WritePrefillRanks::OnWriteBlocks(const WriteBlocksMsg& msg, TimePoint now) {
  CoreFor(msg.prefill_rank).OnWriteBlocks(msg, now);
}

void WritePrefillRanks::OnWriteCancel(const WriteCancelMsg& msg, TimePoint now) {
  CoreFor(msg.prefill_rank).OnWriteCancel(msg, now);
}

Status WritePrefillRanks::OnRelease(const ReleaseMsg& msg, TimePoint now) {
  Status first;
  bool any_ok = false;
  for (WritePrefillCore& c : cores_) {
    Status st = c.OnRelease(msg, now);
    any_ok = any_ok || st.ok();
    if (first.ok() && !st.ok()) first = st;
  }
  return any_ok ? OkStatus() : first;
}

void WritePrefillRanks::OnWriteCompleted(uint64_t write_id, const Status& status, TimePoint now) {
  const uint64_t rank = write_id >> kRankShift;
  if (rank >= cores_.size()) {
    ++ignored_;
    return;
  }
  cores_[rank].OnWriteCompleted(write_id, status, now);
}

void WritePrefillRanks::OnTick(TimePoint now) {
  for (WritePrefillCore& c : cores_) c.OnTick(now);
}

std::vector<ConnectorAction> WritePrefillRanks::TakeActions() {
  std::vector<ConnectorAction> out;
  for (WritePrefillCore& c : cores_) {
    for (ConnectorAction& a : c.TakeActions()) {
      if (auto* f = std::get_if<ReportBlocksFreeAction>(&a)) {
        // The ranks share one block table: free when the last rank that held lets go.
        auto h = holders_.find(f->request_id);
        if (h != holders_.end()) {
          h->second.erase(c.options().rank);
          if (!h->second.empty()) continue;
          holders_.erase(h);
        }
      }
      out.push_back(std::move(a));
    }
  }
  return out;
}

std::vector<int64_t> WritePrefillRanks::TakeTransferTimes() {
  std::vector<int64_t> out;
  for (WritePrefillCore& c : cores_) {
    for (int64_t us : c.TakeTransferTimes()) out.push_back(us);
  }
  return out;
}

std::optional<TimePoint> WritePrefillRanks::NextDeadline() const {
  std::optional<TimePoint> best;
  for (const WritePrefillCore& c : cores_) {
    auto d = c.NextDeadline();
    if (d && (!best || *d < *best)) best = d;
  }
  return best;
}

bool WritePrefillRanks::Idle() const {
  return holders_.empty() && std::all_of(cores_.begin(), cores_.end(),
                                         [](const WritePrefillCore& c) { return c.Idle(); });
}

int64_t WritePrefillRanks::NumTransfers() const {
  int64_t n = 0;
  for (const WritePrefillCore& c : cores_) n = std::max(n, c.NumTransfers());
  return n;
}

int64_t WritePrefillRanks::NumParked() const {
  int64_t n = 0;
  for (const WritePrefillCore& c : cores_) n += c.NumParked();
  return n;
}

bool WritePrefillRanks::Knows(const std::string& transfer_id) const {
  return std::any_of(cores_.begin(), cores_.end(),
                     [&](const WritePrefillCore& c) { return c.Knows(transfer_id); });
}

int64_t WritePrefillRanks::NumHeldBlocks() const {
  int64_t n = 0;
  for (const WritePrefillCore& c : cores_) n = std::max(n, c.NumHeldBlocks());
  return n;
}

int64_t WritePrefillRanks::NumWritesInFlight() const {
  int64_t n = 0;
  for (const WritePrefillCore& c : cores_) n += c.NumWritesInFlight();
  return n;
}

WritePrefillCore::Counters WritePrefillRanks::counters() const {
  WritePrefillCore::Counters s;
  for (const WritePrefillCore& c : cores_) {
    const auto& k = c.counters();
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
