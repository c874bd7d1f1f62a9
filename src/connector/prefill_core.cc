#include "kvbridge/connector/prefill_core.h"

#include <algorithm>
#include <utility>

#include "kvbridge/connector/kv_transfer_config.h"
#include "kvbridge/connector/tp_plan.h"
#ifdef KVBRIDGE_PLANTED_FAULTS
#include "testing/planted_faults.h"  // test-only switches (src/sim builds them in)
#endif

namespace kvbridge {

PrefillCore::PrefillCore(Options options) : options_(std::move(options)) {
  if (options_.tp_size < 1) options_.tp_size = 1;
}

bool PrefillCore::ServesRank(int prefill_rank) const {
  return prefill_rank >= 0 && prefill_rank < options_.tp_size;
}

std::vector<std::pair<int, int>> PrefillCore::ExpectedPairs(int decode_tp) const {
  // Without a head count, one that splits evenly over both sizes gives the even-split pairs.
  const int heads =
      options_.num_kv_heads > 0 ? options_.num_kv_heads : options_.tp_size * std::max(1, decode_tp);
  return TpPlanPairs(options_.tp_size, decode_tp, heads);
}

std::string_view PrefillCore::ReasonName(DoneReason r) {
  switch (r) {
    case DoneReason::kCompleted:
      return "completed";
    case DoneReason::kReleased:
      return "released";
    case DoneReason::kExpired:
      return "expired";
    case DoneReason::kAborted:
      return "aborted";
    case DoneReason::kUnclaimed:
      return "unclaimed";
    case DoneReason::kPeerLost:
      return "peer_lost";
  }
  return "unknown";
}

PrefillCore::Transfer& PrefillCore::Register(const std::string& transfer_id, TimePoint now) {
  auto it = transfers_.find(transfer_id);
  if (it != transfers_.end()) return it->second;
  // A fresh registration of an id seen before (ids are minted unique; this is a new transfer).
  tombstones_.erase(transfer_id);
  Transfer& t = transfers_[transfer_id];
  // Apply what arrived before the transfer was registered, in arrival order.
  auto [lo, hi] = parked_.equal_range(transfer_id);
  std::vector<Parked> early;
  for (auto p = lo; p != hi; ++p) early.push_back(std::move(p->second));
  parked_.erase(lo, hi);
  for (Parked& p : early) {
    if (auto* rd = std::get_if<ReadDoneMsg>(&p.msg)) {
      // Its reply ("not held") went out when it was parked; only the notification counts now.
      // Completion is checked by the caller once the siblings are mapped.
      ApplyReadDone(t, transfer_id, *rd, p.reply_token, /*already_replied=*/true,
                    /*complete=*/false, now);
    } else if (auto* hb = std::get_if<HeartbeatMsg>(&p.msg)) {
      t.lease_floor = std::max(t.lease_floor, p.received + options_.lease);
      Claim(t, hb->decode_engine_id, now);
    } else if (std::get_if<ReleaseMsg>(&p.msg)) {
      if (t.open) {
        t.open = false;
        t.reason = DoneReason::kReleased;
        ++counters_.transfers_released;
      }
    }
  }
  return t;
}

void PrefillCore::Claim(Transfer& t, const std::string& decode_engine_id, TimePoint now) {
  if (!t.claimed_by.empty() || decode_engine_id.empty()) return;
  t.claimed_by = decode_engine_id;
  if (t.under_claim_lease) {
    t.under_claim_lease = false;
    t.lease_deadline = std::max(*t.lease_deadline, now + options_.lease);
  }
}

Status PrefillCore::OnRequestAdded(const std::string& parent_id, int n,
                                   const std::string& transfer_id, TimePoint now) {
  if (n < 1) return InvalidArgumentError("n must be >= 1");
  if (parent_id.empty()) return InvalidArgumentError("empty request id");
  if (!IsValidTransferId(transfer_id)) return InvalidArgumentError("bad transfer_id");
  std::vector<std::string> ids;
  if (n == 1) {
    ids.push_back(parent_id);
  } else {
    for (int i = 0; i < n; ++i) ids.push_back(std::to_string(i) + "_" + parent_id);
  }
  for (const auto& id : ids) {
    if (sibling_to_transfer_.count(id))
      return AlreadyExistsError("request " + id + " already mapped");
  }
  Transfer& t = Register(transfer_id, now);
  for (const auto& id : ids) {
    t.siblings.emplace(id, Sibling{});
    sibling_to_transfer_[id] = transfer_id;
  }
  if (n > 1) parent_to_siblings_[parent_id] = ids;
  MaybeComplete(t, transfer_id, now);  // parked messages may have completed it already
  return OkStatus();
}

bool PrefillCore::OnRequestFinished(const std::string& request_id, const std::string& transfer_id,
                                    std::span<const int32_t> block_ids, TimePoint now) {
  auto m = sibling_to_transfer_.find(request_id);
  std::string tid = m != sibling_to_transfer_.end() ? m->second : transfer_id;
  if (m == sibling_to_transfer_.end()) {
    // Never announced (the engine skipped OnRequestAdded): register it now.
    if (!IsValidTransferId(tid)) return false;
    Register(tid, now).siblings.emplace(request_id, Sibling{});
    sibling_to_transfer_[request_id] = tid;
  }
  Transfer& t = transfers_.at(tid);
  t.siblings.try_emplace(request_id);
  // Parked or early notifications may already have completed the transfer (the sibling is
  // mapped, so the entry survives this check).
  MaybeComplete(t, tid, now);
  if (!t.open) {
    // Done before this sibling finished: nothing reads it any more; the engine frees it now.
    t.siblings.erase(request_id);
    sibling_to_transfer_.erase(request_id);
    EraseIfEmpty(tid, now);
    return false;
  }
  Sibling& s = t.siblings.at(request_id);
  s.held = true;
  s.blocks.assign(block_ids.begin(), block_ids.end());
  ++counters_.holds;
  if (!t.lease_deadline) {
    if (t.claimed_by.empty() && options_.claim_lease > 0) {
      t.lease_deadline = now + options_.claim_lease;
      t.under_claim_lease = true;
    } else {
      t.lease_deadline = std::max(now + options_.lease, t.lease_floor);
    }
  }
  return true;
}

bool PrefillCore::OnRequestAborted(const std::string& request_id, TimePoint now) {
  std::vector<std::string> ids;
  auto p = parent_to_siblings_.find(request_id);
  if (sibling_to_transfer_.count(request_id)) {
    ids.push_back(request_id);
  } else if (p != parent_to_siblings_.end()) {
    ids = p->second;
  }
  bool keep = false;
  for (const auto& id : ids) {
    auto m = sibling_to_transfer_.find(id);
    if (m == sibling_to_transfer_.end()) continue;
    const std::string tid = m->second;
    Transfer& t = transfers_.at(tid);
    Sibling& s = t.siblings.at(id);
    if (s.held) {
      keep = true;  // a READ may be running on its blocks: they go with the transfer
      continue;
    }
    t.siblings.erase(id);
    sibling_to_transfer_.erase(m);
    if (t.siblings.empty() && t.open) {
      t.open = false;
      t.reason = DoneReason::kAborted;
    }
    EraseIfEmpty(tid, now);
  }
  return keep;
}

void PrefillCore::Reply(const ReadDoneMsg& msg, uint64_t reply_token, bool valid,
                        std::string reason) {
  if (!msg.want_reply) return;
  HoldReplyMsg r{.transfer_id = msg.transfer_id,
                 .prefill_engine_id = options_.engine_id,
                 .prefill_rank = msg.prefill_rank,
                 .decode_engine_id = msg.decode_engine_id,
                 .decode_rank = msg.decode_rank,
                 .hold_valid = valid,
                 .reason = std::move(reason)};
  // Member by member: GCC 12 at -O3 reports a false -Wmaybe-uninitialized for the empty
  // PeerEndpoint of a designated-initializer temporary here.
  SendMessageAction reply;
  reply.msg = std::move(r);
  reply.reply_token = reply_token;
  actions_.push_back(std::move(reply));
}

void PrefillCore::ApplyReadDone(Transfer& t, const std::string& transfer_id, const ReadDoneMsg& msg,
                                uint64_t reply_token, bool already_replied, bool complete,
                                TimePoint now) {
  const std::pair<int, int> pair{msg.decode_rank, msg.prefill_rank};
  auto prev = t.notified.find(pair);
  if (prev != t.notified.end()) {
    ++counters_.notifications_ignored;  // duplicate: answer as the first time
    if (!already_replied) Reply(msg, reply_token, prev->second, prev->second ? "" : "duplicate");
    return;
  }
  if (t.decode_tp && *t.decode_tp != msg.decode_tp_size) {
    ++counters_.notifications_ignored;  // a second decode on one transfer id: not ours to count
    if (!already_replied) Reply(msg, reply_token, false, "decode_tp_mismatch");
    return;
  }
  bool any_held = false;
  for (const auto& [id, s] : t.siblings) any_held |= s.held;
  const bool valid = !already_replied && t.open && any_held;
  t.decode_tp = msg.decode_tp_size;
  Claim(t, msg.decode_engine_id, now);
  t.notified[pair] = valid;
  if (!already_replied) {
    Reply(msg, reply_token, valid,
          valid ? "" : (t.open ? "not_held" : std::string(ReasonName(t.reason))));
  }
  if (complete) MaybeComplete(t, transfer_id, now);
}

void PrefillCore::MaybeComplete(Transfer& t, const std::string& transfer_id, TimePoint now) {
  if (t.open && t.decode_tp) {
    bool all = true;
    for (const auto& pr : ExpectedPairs(*t.decode_tp)) all &= t.notified.count(pr) > 0;
#ifdef KVBRIDGE_PLANTED_FAULTS
    if (sim::Planted().release_before_all_ranks_read) all = !t.notified.empty();
#endif
    if (all) {
      ++counters_.transfers_completed;
      Finish(transfer_id, DoneReason::kCompleted, now);
      return;
    }
  }
  if (!t.open) Finish(transfer_id, t.reason, now);
}

void PrefillCore::Finish(const std::string& transfer_id, DoneReason reason, TimePoint now) {
  Transfer& t = transfers_.at(transfer_id);
  if (t.open) {
    t.open = false;
    t.reason = reason;
  }
  // Free every finished (held) sibling; unfinished ones stay mapped until they finish or abort.
  for (auto it = t.siblings.begin(); it != t.siblings.end();) {
#ifdef KVBRIDGE_PLANTED_FAULTS
    if (sim::Planted().one_to_one_transfer_map && std::next(it) != t.siblings.end()) {
      ++it;
      continue;
    }
    if (sim::Planted().release_without_finished_signal && !it->second.held)
      actions_.push_back(ReportBlocksFreeAction{it->first});
#endif
    if (it->second.held) {
      actions_.push_back(ReportBlocksFreeAction{it->first});
      ++counters_.holds_freed;
      sibling_to_transfer_.erase(it->first);
      it = t.siblings.erase(it);
    } else {
      ++it;
    }
  }
  EraseIfEmpty(transfer_id, now);
}

void PrefillCore::EraseIfEmpty(const std::string& transfer_id, TimePoint now) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end() || !it->second.siblings.empty()) return;
  Tombstone tomb{.reason = it->second.open ? DoneReason::kAborted : it->second.reason,
                 .notified = it->second.notified,
                 .expires = now + options_.lease};
  transfers_.erase(it);
  for (auto p = parent_to_siblings_.begin(); p != parent_to_siblings_.end();) {
    bool live = false;
    for (const auto& id : p->second) live |= sibling_to_transfer_.count(id) > 0;
    p = live ? std::next(p) : parent_to_siblings_.erase(p);
  }
  tombstones_[transfer_id] = std::move(tomb);
  tombstone_order_.emplace_back(now + options_.lease, transfer_id);
  while (static_cast<int64_t>(tombstone_order_.size()) > options_.max_tombstones) {
    auto& [exp, id] = tombstone_order_.front();
    auto tb = tombstones_.find(id);
    if (tb != tombstones_.end() && tb->second.expires == exp) tombstones_.erase(tb);
    tombstone_order_.pop_front();
  }
}

void PrefillCore::Park(ControlMessage msg, const std::string& transfer_id, uint64_t reply_token,
                       TimePoint now) {
#ifdef KVBRIDGE_PLANTED_FAULTS
  if (sim::Planted().ignore_early_notifications) {
    ++counters_.notifications_ignored;
    return;
  }
#endif
  if (static_cast<int64_t>(parked_.size()) >= options_.max_parked_messages) {
    ++counters_.notifications_ignored;
    ++counters_.parked_dropped;
    return;
  }
  ++counters_.notifications_parked;
  parked_.emplace(transfer_id, Parked{std::move(msg), reply_token, now, now + options_.lease});
}

void PrefillCore::OnReadDone(const ReadDoneMsg& msg, uint64_t reply_token, TimePoint now) {
  if (msg.prefill_engine_id != options_.engine_id || !ServesRank(msg.prefill_rank)) {
    ++counters_.notifications_ignored;  // meant for another incarnation or rank
    Reply(msg, reply_token, false, "incarnation");
    return;
  }
  auto it = transfers_.find(msg.transfer_id);
  if (it != transfers_.end()) {
    ApplyReadDone(it->second, msg.transfer_id, msg, reply_token, false, true, now);
    return;
  }
  auto tb = tombstones_.find(msg.transfer_id);
  if (tb != tombstones_.end()) {
    // The transfer is gone. A duplicate is ignored; a first ReadDone arriving after a release
    // (the proxy's, racing an aborted decode) is the normal race and answered with the reason
    // (simulator seed 16).
    auto n = tb->second.notified.find({msg.decode_rank, msg.prefill_rank});
    if (n != tb->second.notified.end()) ++counters_.notifications_ignored;
    bool valid = n != tb->second.notified.end() && n->second;
#ifdef KVBRIDGE_PLANTED_FAULTS
    if (sim::Planted().reuse_blocks_on_lease_during_read &&
        (tb->second.reason == DoneReason::kExpired || tb->second.reason == DoneReason::kUnclaimed))
      valid = true;
#endif
    Reply(msg, reply_token, valid, valid ? "" : std::string(ReasonName(tb->second.reason)));
    return;
  }
  // Unknown: nothing was held for it, so the bytes read are not the prompt's. Say so now, and
  // park the notification so the transfer is released at once if it registers later.
  Reply(msg, reply_token, false, "unknown");
  ReadDoneMsg parked = msg;
  parked.want_reply = false;
  Park(parked, msg.transfer_id, 0, now);
}

void PrefillCore::OnAbortedBeforeAdmission(const std::string& transfer_id, TimePoint now) {
  if (!IsValidTransferId(transfer_id) || transfers_.count(transfer_id)) return;
  auto [lo, hi] = parked_.equal_range(transfer_id);
  for (auto p = lo; p != hi; ++p) {
    // A release had nothing to release (simulator seed 36); anything else names a transfer
    // that never existed here.
    if (!std::holds_alternative<ReleaseMsg>(p->second.msg)) ++counters_.notifications_ignored;
    ++counters_.parked_dropped;
  }
  parked_.erase(lo, hi);
  if (tombstones_.count(transfer_id)) return;
  tombstones_[transfer_id] =
      Tombstone{.reason = DoneReason::kAborted, .notified = {}, .expires = now + options_.lease};
  tombstone_order_.emplace_back(now + options_.lease, transfer_id);
  while (static_cast<int64_t>(tombstone_order_.size()) > options_.max_tombstones) {
    auto& [exp, id] = tombstone_order_.front();
    auto tb = tombstones_.find(id);
    if (tb != tombstones_.end() && tb->second.expires == exp) tombstones_.erase(tb);
    tombstone_order_.pop_front();
  }
}

void PrefillCore::OnHeartbeat(const HeartbeatMsg& msg, TimePoint now) {
  if (msg.prefill_engine_id != options_.engine_id || !ServesRank(msg.prefill_rank)) {
    ++counters_.notifications_ignored;
    return;
  }
  auto it = transfers_.find(msg.transfer_id);
  if (it != transfers_.end()) {
    Transfer& t = it->second;
    if (!t.open) return;  // done: nothing to extend (not an error: it raced with completion)
    Claim(t, msg.decode_engine_id, now);
    if (t.lease_deadline) {
      t.lease_deadline = std::max(*t.lease_deadline, now + options_.lease);
    } else {
      t.lease_floor = std::max(t.lease_floor, now + options_.lease);
    }
    return;
  }
  if (tombstones_.count(msg.transfer_id)) return;  // raced with completion: harmless
  Park(msg, msg.transfer_id, 0, now);
}

Status PrefillCore::OnRelease(const ReleaseMsg& msg, TimePoint now) {
  if (!IsValidTransferId(msg.transfer_id)) return InvalidArgumentError("bad transfer_id");
  if (!msg.prefill_engine_id.empty() && msg.prefill_engine_id != options_.engine_id) {
    return NotFoundError("engine " + msg.prefill_engine_id + " is not this incarnation (" +
                         options_.engine_id + ")");
  }
  auto it = transfers_.find(msg.transfer_id);
  // A release of a transfer that is already done is the proxy's normal race with the decode's
  // ReadDone (the client left after the READ completed): a no-op, not an ignored notification
  // (fault-free runs keep notifications_ignored at 0; found by the simulator, seed 200004).
  if (it != transfers_.end()) {
    if (!it->second.open) return OkStatus();
    ++counters_.transfers_released;
    Finish(msg.transfer_id, DoneReason::kReleased, now);
    return OkStatus();
  }
  if (tombstones_.count(msg.transfer_id)) return OkStatus();
  Park(msg, msg.transfer_id, 0, now);
  return OkStatus();
}

void PrefillCore::OnTick(TimePoint now) {
  std::vector<std::string> expired;
  for (const auto& [id, t] : transfers_) {
    if (t.open && t.lease_deadline && *t.lease_deadline <= now) expired.push_back(id);
  }
  for (const auto& id : expired) {
    if (transfers_.at(id).under_claim_lease) {
      ++counters_.claims_expired;
      Finish(id, DoneReason::kUnclaimed, now);
    } else {
      ++counters_.lease_expired;
      Finish(id, DoneReason::kExpired, now);
    }
  }
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (it->second.expires <= now) {
      // A parked release whose transfer never registered had nothing to release (its request
      // was aborted before admission): dropped, not ignored (simulator seed 36).
      if (!std::holds_alternative<ReleaseMsg>(it->second.msg)) ++counters_.notifications_ignored;
      ++counters_.parked_dropped;
      it = parked_.erase(it);
    } else {
      ++it;
    }
  }
  while (!tombstone_order_.empty() && tombstone_order_.front().first <= now) {
    auto& [exp, id] = tombstone_order_.front();
    auto tb = tombstones_.find(id);
    if (tb != tombstones_.end() && tb->second.expires == exp) tombstones_.erase(tb);
    tombstone_order_.pop_front();
  }
}

int64_t PrefillCore::OnPeerLost(const std::string& decode_engine_id, TimePoint now) {
  if (decode_engine_id.empty()) return 0;
  std::vector<std::string> bound;
  for (const auto& [id, t] : transfers_) {
    if (t.open && t.claimed_by == decode_engine_id) bound.push_back(id);
  }
  for (const std::string& id : bound) {
    ++counters_.peer_lost;
    Finish(id, DoneReason::kPeerLost, now);
  }
  // What it said about transfers not registered yet names a reader that is gone.
  for (auto it = parked_.begin(); it != parked_.end();) {
    std::string from;
    if (const auto* rd = std::get_if<ReadDoneMsg>(&it->second.msg)) from = rd->decode_engine_id;
    if (const auto* hb = std::get_if<HeartbeatMsg>(&it->second.msg)) from = hb->decode_engine_id;
    if (from == decode_engine_id) {
      ++counters_.parked_dropped;
      it = parked_.erase(it);
    } else {
      ++it;
    }
  }
  return static_cast<int64_t>(bound.size());
}

std::pair<int64_t, int64_t> PrefillCore::BoundTo(const std::string& decode_engine_id) const {
  int64_t transfers = 0;
  std::set<int32_t> blocks;
  for (const auto& [tid, t] : transfers_) {
    if (!t.open || t.claimed_by != decode_engine_id) continue;
    ++transfers;
    for (const auto& [id, s] : t.siblings) {
      if (s.held) blocks.insert(s.blocks.begin(), s.blocks.end());
    }
  }
  return {transfers, static_cast<int64_t>(blocks.size())};
}

std::optional<TimePoint> PrefillCore::EarliestClaimDeadline() const {
  std::optional<TimePoint> best;
  for (const auto& [tid, t] : transfers_) {
    if (t.open && t.under_claim_lease && (!best || *t.lease_deadline < *best))
      best = t.lease_deadline;
  }
  return best;
}

std::vector<ConnectorAction> PrefillCore::TakeActions() {
  std::vector<ConnectorAction> out;
  out.swap(actions_);
  return out;
}

std::optional<TimePoint> PrefillCore::NextDeadline() const {
  std::optional<TimePoint> best;
  auto consider = [&](TimePoint t) { best = best ? std::min(*best, t) : t; };
  for (const auto& [id, t] : transfers_) {
    if (t.open && t.lease_deadline) consider(*t.lease_deadline);
  }
  for (const auto& [id, p] : parked_) consider(p.expires);
  return best;
}

bool PrefillCore::Idle() const { return transfers_.empty() && parked_.empty(); }

bool PrefillCore::IsHeld(const std::string& transfer_id, std::span<const int32_t> block_ids) const {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end() || !it->second.open) return false;
  std::set<int32_t> held;
  for (const auto& [id, s] : it->second.siblings) {
    if (s.held) held.insert(s.blocks.begin(), s.blocks.end());
  }
  if (held.empty()) return false;
  return std::all_of(block_ids.begin(), block_ids.end(),
                     [&](int32_t b) { return held.count(b) > 0; });
}

std::map<std::string, std::vector<int32_t>> PrefillCore::HeldBlocksByTransfer() const {
  std::map<std::string, std::vector<int32_t>> out;
  for (const auto& [tid, t] : transfers_) {
    if (!t.open) continue;
    std::set<int32_t> held;
    for (const auto& [id, s] : t.siblings) {
      if (s.held) held.insert(s.blocks.begin(), s.blocks.end());
    }
    if (!held.empty()) out[tid] = std::vector<int32_t>(held.begin(), held.end());
  }
  return out;
}

int64_t PrefillCore::NumHeldBlocks() const {
  std::set<int32_t> held;
  for (const auto& [tid, t] : transfers_) {
    for (const auto& [id, s] : t.siblings) {
      if (s.held) held.insert(s.blocks.begin(), s.blocks.end());
    }
  }
  return static_cast<int64_t>(held.size());
}

std::vector<std::string> PrefillCore::Siblings(const std::string& transfer_id) const {
  std::vector<std::string> out;
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return out;
  for (const auto& [id, s] : it->second.siblings) out.push_back(id);
  return out;
}

}  // namespace kvbridge
