// The simulator's invariants (DESIGN.md "Invariants"): no leak, no hang, no early reuse, exactly
// once, fault-free runs need no safety net.
#include "sim/sim.h"

namespace kvbridge::sim {

std::string_view ViolationKindName(ViolationKind kind) {
  switch (kind) {
    case ViolationKind::kNone:
      return "none";
    case ViolationKind::kLeak:
      return "leak";
    case ViolationKind::kHang:
      return "hang";
    case ViolationKind::kEarlyFree:
      return "early_free";
    case ViolationKind::kStaleKvUsed:
      return "stale_kv_used";
    case ViolationKind::kExactlyOnce:
      return "exactly_once";
    case ViolationKind::kSiblingAccounting:
      return "sibling_accounting";
    case ViolationKind::kPoolAccounting:
      return "pool_accounting";
    case ViolationKind::kLeaseExpired:
      return "lease_expired";
    case ViolationKind::kNotificationIgnored:
      return "notification_ignored";
    case ViolationKind::kLoadFailed:
      return "load_failed";
    case ViolationKind::kBadAnswer:
      return "bad_answer";
    case ViolationKind::kCrash:
      return "crash";
    case ViolationKind::kWriteIntoReusedBlock:
      return "write_into_reused_block";
    case ViolationKind::kUsedBeforeWriteDone:
      return "used_before_write_done";
    case ViolationKind::kPeerLossNotReleased:
      return "peer_loss_not_released";
  }
  return "unknown";
}

}  // namespace kvbridge::sim

namespace kvbridge::sim::internal {

// ------------------------------------------------------------------------------------------
// Invariants

int64_t Sim::SumLeaseExpired() const {
  // A WRITE decode's write timeout (the prefill's lease + a grace) is its lease.
  int64_t n = dead_lease_expired_;
  for (const Engine& e : engines_) {
    if (e.up) n += e.conn->lease_expired() + e.conn->wdecode().counters().write_timeouts;
  }
  return n;
}
int64_t Sim::SumIgnored() const {
  int64_t n = dead_ignored_;
  for (const Engine& e : engines_) {
    if (e.up) n += e.conn->notifications_ignored();
  }
  return n;
}

void Sim::CheckReadTargets(int ei) {
  const Engine& d = engines_[ei];
  for (const auto& [key, r] : reads_) {
    if (r.dst != ei || d.incarnation != r.dst_inc) continue;
    for (int32_t b : r.dst_blocks) {
      if (d.pool->RefCount(b) == 0 && d.pool->HoldCount(b) == 0) {
        Violate(ViolationKind::kEarlyFree,
                d.engine_id + " freed block " + std::to_string(b) + " of " + r.request_id +
                    " while READ " + std::to_string(r.read_id) + " may still write into it");
        return;
      }
    }
  }
}

void Sim::CheckAll() {
  for (const Engine& e : engines_) {
    if (!e.up) continue;
    Status st = e.pool->CheckInvariants();
    if (!st.ok()) {
      Violate(ViolationKind::kPoolAccounting, e.engine_id + ": " + st.ToString());
      return;
    }
    if (e.pool->NumFree() + e.pool->NumCachedFree() + e.pool->NumActive() != e.pool->num_blocks()) {
      Violate(ViolationKind::kPoolAccounting, e.engine_id + ": free + cached + active != total");
      return;
    }
    const size_t held = e.conn->num_ledger_held();
    if (held != e.sched->num_held() || e.pool->num_holds() != e.sched->num_held() ||
        e.conn->num_ledger_draining() != e.sched->num_draining()) {
      Violate(ViolationKind::kSiblingAccounting,
              e.engine_id + ": connector holds " + std::to_string(held) + "/drains " +
                  std::to_string(e.conn->num_ledger_draining()) + ", engine holds " +
                  std::to_string(e.sched->num_held()) + "/drains " +
                  std::to_string(e.sched->num_draining()) + ", pool holds " +
                  std::to_string(e.pool->num_holds()));
      return;
    }
    const auto& c = e.conn->prefill().counters();
    const size_t held_read = e.conn->num_ledger_held_read();
    if (c.holds - c.holds_freed != static_cast<int64_t>(held_read)) {
      Violate(ViolationKind::kSiblingAccounting,
              e.engine_id + ": prefill core counts " + std::to_string(c.holds - c.holds_freed) +
                  " live READ holds, the engine " + std::to_string(held_read));
      return;
    }
  }
  // No early free: a block an in-flight READ writes into stays allocated; a READ whose source
  // blocks lose their hold is tainted (its bytes must not be used).
  for (auto& [key, r] : reads_) {
    const Engine& s = engines_[r.src >= 0 && r.src < static_cast<int>(engines_.size()) ? r.src : 0];
    if (!r.tainted && r.src >= 0) {
      if (!s.up || s.incarnation != r.src_inc) {
        r.tainted = true;
      } else {
        for (int32_t b : r.src_blocks) {
          if (s.pool->RefCount(b) == 0 && s.pool->HoldCount(b) == 0) {
            r.tainted = true;
            Trace("xfer: source block %d of READ %llu freed during the read", b,
                  static_cast<unsigned long long>(r.read_id));
            break;
          }
        }
      }
    }
    const Engine& d = engines_[r.dst];
    if (!d.up || d.incarnation != r.dst_inc) continue;
    for (int32_t b : r.dst_blocks) {
      if (d.pool->RefCount(b) == 0 && d.pool->HoldCount(b) == 0) {
        Violate(ViolationKind::kEarlyFree,
                d.engine_id + " freed block " + std::to_string(b) + " of " + r.request_id +
                    " while READ " + std::to_string(r.read_id) + " may still write into it");
        return;
      }
    }
  }
  // WRITE: a write whose source blocks lose their hold is tainted (its bytes must not be used);
  // decode blocks offered to a pair are watched until its WriteDone.
  for (auto& [key, w] : writes_) {
    const Engine& p = engines_[w.src];
    if (w.tainted || !p.up || p.incarnation != w.src_inc) continue;
    for (int32_t b : w.src_blocks) {
      if (p.pool->RefCount(b) == 0 && p.pool->HoldCount(b) == 0) {
        w.tainted = true;
        Trace("xfer: source block %d of WRITE %llx freed during the write", b,
              static_cast<unsigned long long>(w.write_id));
        break;
      }
    }
  }
  ObserveWriteTargets(-1);
  if (!k_.faults) {
    if (int64_t n = SumLeaseExpired(); n > 0) {
      Violate(ViolationKind::kLeaseExpired,
              std::to_string(n) + " lease(s) expired in a run without injected faults");
      return;
    }
    if (int64_t n = SumIgnored(); n > 0) {
      Violate(ViolationKind::kNotificationIgnored,
              std::to_string(n) + " notification(s) ignored in a run without injected faults");
      return;
    }
  }
  // Holds nobody claims (the proxy died between the legs) go within the claim lease + 1 s.
  for (const Engine& e : engines_) {
    if (!e.up) continue;
    if (auto d = e.conn->prefill().EarliestClaimDeadline(); d && now_ > *d + kSecond) {
      Violate(ViolationKind::kPeerLossNotReleased,
              e.engine_id + " still holds a transfer nobody claimed, 1 s past its claim lease");
      return;
    }
  }
  for (const FlowState& f : flows_) {
    if (f.proxy_lost) continue;  // its proxy died: the client got a reset
    if (f.flow && !f.finished && now_ > f.arrival + k_.hang_bound) {
      Violate(ViolationKind::kHang, "client " + std::to_string(f.id) + " (transfer " +
                                        f.flow->transfer_id() + ") not done after " +
                                        std::to_string(k_.hang_bound / kSecond) + " s");
      return;
    }
  }
}

void Sim::CheckQuiescence() {
  for (const FlowState& f : flows_) {
    if (f.proxy_lost) continue;
    if (!f.finished || !f.flow->client_done()) {
      Violate(ViolationKind::kHang, "quiescent, but client " + std::to_string(f.id) +
                                        " (transfer " + f.flow->transfer_id() + ") is not done");
      return;
    }
  }
  if (!reads_.empty() || !writes_.empty()) {
    Violate(ViolationKind::kLeak, "quiescent with " + std::to_string(reads_.size()) +
                                      " READs and " + std::to_string(writes_.size()) + " WRITEs");
    return;
  }
  for (const Engine& e : engines_) {
    if (!e.up) continue;
    std::string what;
    if (e.pool->NumActive() != 0) what += " active_blocks=" + std::to_string(e.pool->NumActive());
    if (e.pool->NumHeld() != 0) what += " held_blocks=" + std::to_string(e.pool->NumHeld());
    if (e.sched->HasUnfinished()) what += " requests=" + std::to_string(e.sched->num_requests());
    if (e.sched->num_held() != 0) what += " engine_holds=" + std::to_string(e.sched->num_held());
    if (e.sched->num_draining() != 0)
      what += " draining=" + std::to_string(e.sched->num_draining());
    if (e.conn->prefill().NumTransfers() != 0)
      what += " transfers=" + std::to_string(e.conn->prefill().NumTransfers());
    if (e.conn->prefill().NumParked() != 0)
      what += " parked=" + std::to_string(e.conn->prefill().NumParked());
    if (!e.conn->decode().Idle()) what += " decode_entries";
    if (e.conn->wprefill().NumTransfers() != 0)
      what += " write_transfers=" + std::to_string(e.conn->wprefill().NumTransfers());
    if (e.conn->wprefill().NumParked() != 0)
      what += " write_parked=" + std::to_string(e.conn->wprefill().NumParked());
    if (!e.conn->wprefill().Idle()) what += " write_holders";
    if (!e.conn->wdecode().Idle()) what += " write_decode_entries";
    if (e.conn->num_write_decodes() != 0)
      what += " write_unallocated=" + std::to_string(e.conn->num_write_decodes());
    if (e.conn->inbox_size() != 0) what += " inbox=" + std::to_string(e.conn->inbox_size());
    if (e.conn->num_ledger_loading() != 0)
      what += " loading=" + std::to_string(e.conn->num_ledger_loading());
    if (!what.empty()) {
      Violate(ViolationKind::kLeak, e.engine_id + " at quiescence:" + what);
      return;
    }
  }
}

}  // namespace kvbridge::sim::internal
