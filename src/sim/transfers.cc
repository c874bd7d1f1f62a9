// The simulator's fake transfer layer: READs and per-layer WRITEs of seeded duration, failure and
// partial progress on cancel, and the checks on what they touch.
#include "sim/sim.h"

namespace kvbridge::sim::internal {

// ------------------------------------------------------------------------------------------
// Transfers

void Sim::PostRead(int engine, const PostTransferAction& a) {
  ++result_.reads;
  Engine& d = engines_[engine];
  const uint64_t key = next_read_key_++;
  Read r;
  r.dst = engine;
  r.dst_inc = d.incarnation;
  r.read_id = a.id;
  r.request_id = a.request_id;
  r.transfer_id = a.transfer_id;
  r.decode_rank = a.local_rank;
  r.prefill_rank = a.peer.rank;
  r.src = a.peer.port - kPortBase;
  r.src_blocks = a.remote_block_ids;
  r.dst_blocks = a.local_block_ids;
  DurationUs dur = 200 + 20 * static_cast<DurationUs>(a.remote_block_ids.size()) + Uniform(0, 3000);
  if (r.src < 0 || r.src >= static_cast<int>(engines_.size()) || !engines_[r.src].up ||
      engines_[r.src].engine_id != a.peer.engine_id) {
    r.tainted = true;
    r.status = UnavailableError("no such peer " + a.peer.engine_id);
    dur = Uniform(100, 3000);
  } else {
    const Engine& s = engines_[r.src];
    r.src_inc = s.incarnation;
    for (int32_t b : r.src_blocks) {
      if (b < 0 || b >= s.pool->num_blocks()) {
        r.status = InvalidArgumentError("remote block out of range");
        r.tainted = true;
      } else if (s.pool->RefCount(b) == 0 && s.pool->HoldCount(b) == 0) {
        r.tainted = true;  // not held: whatever is read is not the prompt's KV
      }
    }
    DrawTransferFault(r.status, dur);
    pending_pairs_.insert(
        {r.src, r.src_inc, a.transfer_id, d.engine_id, a.local_rank, a.peer.rank});
  }
  for (int32_t b : r.dst_blocks) {
    if (b < 0 || b >= d.pool->num_blocks()) {
      Violate(ViolationKind::kCrash, "READ into a block out of range");
      return;
    }
  }
  r.end_at = now_ + dur;
  Trace("xfer: %s posts READ %llu for %s: %zu blocks from %s (%.3fms%s)", d.engine_id.c_str(),
        static_cast<unsigned long long>(a.id), a.request_id.c_str(), r.src_blocks.size(),
        a.peer.engine_id.c_str(), static_cast<double>(dur) / kMillisecond,
        r.status.ok() ? "" : ", will fail");
  read_key_[{r.dst, r.dst_inc, r.read_id}] = key;
  const uint64_t v = r.version;
  reads_.emplace(key, std::move(r));
  At(now_ + dur, [this, key, v] { EndRead(key, v); });
}

void Sim::DrawTransferFault(Status& status, DurationUs& dur) {
  if (k_.faults && Chance(k_.read_fail)) {
    status = UnavailableError("simulated transfer failure");
    dur = Uniform(0, dur);
  } else if (k_.faults && Chance(k_.read_slow)) {
    dur = Uniform(k_.read_slow_lo, k_.read_slow_hi);
  }
}

template <typename Transfer, typename End>
bool Sim::CancelInFlight(Transfer& t, const char* why, End end) {
  if (t.cancelled) return false;
  t.cancelled = true;
  const TimePoint stop = now_ + Uniform(0, 2000);
  if (stop < t.end_at) {
    t.end_at = stop;
    t.status = CancelledError(why);
  }
  At(t.end_at, [end, v = ++t.version] { end(v); });
  return true;
}

// The in-flight READ or WRITE `key` taken out of `in_flight` when `version` is its current end
// event; nullopt for a stale event (it was cancelled since, or has ended).
template <typename Transfer>
std::optional<Transfer> TakeIfCurrent(std::map<uint64_t, Transfer>& in_flight, uint64_t key,
                                      uint64_t version) {
  auto it = in_flight.find(key);
  if (it == in_flight.end() || it->second.version != version) return std::nullopt;
  Transfer t = std::move(it->second);
  in_flight.erase(it);
  return t;
}

void Sim::CancelRead(int engine, uint64_t read_id) {
  auto k = read_key_.find({engine, engines_[engine].incarnation, read_id});
  if (k == read_key_.end()) return;
  Read& r = reads_.at(k->second);
  const uint64_t key = k->second;
  if (!CancelInFlight(r, "READ cancelled", [this, key](uint64_t v) { EndRead(key, v); })) return;
  Trace("xfer: cancel READ %llu of %s (ends in %.3fms)", static_cast<unsigned long long>(read_id),
        engines_[engine].engine_id.c_str(), static_cast<double>(r.end_at - now_) / kMillisecond);
}

void Sim::EndRead(uint64_t key, uint64_t version) {
  std::optional<Read> taken = TakeIfCurrent(reads_, key, version);
  if (!taken) return;
  Read& r = *taken;
  read_key_.erase({r.dst, r.dst_inc, r.read_id});
  Engine& d = engines_[r.dst];
  if (!d.up || d.incarnation != r.dst_inc) return;
  if (r.tainted && r.status.ok()) tainted_loads_.insert({r.dst, r.dst_inc, r.request_id});
  Trace("xfer: READ %llu of %s ends: %s%s", static_cast<unsigned long long>(r.read_id),
        d.engine_id.c_str(), r.status.ToString().c_str(),
        r.tainted ? " (source blocks were not held throughout)" : "");
  d.conn->Push(InReadEnded{r.read_id, r.status});
  Wake(r.dst);
}

void Sim::PostWrite(int engine, const PostTransferAction& a) {
  ++result_.writes;
  const Engine& p = engines_[engine];
  const uint64_t key = next_read_key_++;
  Write w;
  w.src = engine;
  w.src_inc = p.incarnation;
  w.write_id = a.id;
  w.transfer_id = a.transfer_id;
  w.decode_rank = a.peer.rank;
  w.prefill_rank = a.local_rank;
  w.layer = a.layer;
  w.src_blocks = a.local_block_ids;
  w.dst_blocks = a.remote_block_ids;
  w.notification = a.notification;
  w.dst = a.peer.port - kPortBase;
  for (int32_t b : w.src_blocks) {
    if (b < 0 || b >= p.pool->num_blocks()) {
      Violate(ViolationKind::kCrash, "WRITE from a block out of range");
      return;
    }
    if (p.pool->RefCount(b) == 0 && p.pool->HoldCount(b) == 0) w.tainted = true;
  }
  DurationUs dur = 100 + 10 * static_cast<DurationUs>(w.dst_blocks.size()) + Uniform(0, 1500);
  if (w.dst < 0 || w.dst >= static_cast<int>(engines_.size()) || !engines_[w.dst].up ||
      engines_[w.dst].engine_id != a.peer.engine_id) {
    w.status = UnavailableError("no such peer " + a.peer.engine_id);
    dur = Uniform(100, 3000);
  } else {
    const Engine& d = engines_[w.dst];
    w.started = true;
    w.dst_inc = d.incarnation;
    for (int32_t b : w.dst_blocks) {
      if (b < 0 || b >= d.pool->num_blocks()) {
        Violate(ViolationKind::kCrash, "WRITE into a block out of range");
        return;
      }
    }
    DrawTransferFault(w.status, dur);
  }
  w.end_at = now_ + dur;
  Trace("xfer: %s posts WRITE %llx of %s layer %d: %zu blocks to %s rank %d (%.3fms%s%s)",
        p.engine_id.c_str(), static_cast<unsigned long long>(a.id), a.transfer_id.c_str(), a.layer,
        w.dst_blocks.size(), a.peer.engine_id.c_str(), a.peer.rank,
        static_cast<double>(dur) / kMillisecond, w.status.ok() ? "" : ", will fail",
        a.notification ? ", carries write_done" : "");
  write_key_[{w.src, w.src_inc, w.write_id}] = key;
  writes_.emplace(key, std::move(w));
  At(now_ + dur, [this, key] { EndWrite(key, 0); });
}

void Sim::CancelWrite(int engine, uint64_t write_id) {
  auto k = write_key_.find({engine, engines_[engine].incarnation, write_id});
  if (k == write_key_.end()) return;
  Write& w = writes_.at(k->second);
  const uint64_t key = k->second;
  if (!CancelInFlight(w, "WRITE cancelled", [this, key](uint64_t v) { EndWrite(key, v); })) {
    return;
  }
  Trace("xfer: cancel WRITE %llx of %s (ends in %.3fms)", static_cast<unsigned long long>(write_id),
        engines_[engine].engine_id.c_str(), static_cast<double>(w.end_at - now_) / kMillisecond);
}

void Sim::EndWrite(uint64_t key, uint64_t version) {
  std::optional<Write> taken = TakeIfCurrent(writes_, key, version);
  if (!taken) return;
  Write& w = *taken;
  write_key_.erase({w.src, w.src_inc, w.write_id});
  const bool landed = w.started && engines_[w.dst].up && engines_[w.dst].incarnation == w.dst_inc;
  Trace("xfer: WRITE %llx of %s ends: %s%s", static_cast<unsigned long long>(w.write_id),
        engines_[w.src].engine_id.c_str(), w.status.ToString().c_str(),
        w.tainted ? " (source blocks were not held throughout)" : "");
  if (landed) {
    // Bytes reached the decode's blocks (a failed or cancelled WRITE may have landed a part):
    // each block must still be the one the decode offered for this pair.
    const Engine& d = engines_[w.dst];
    auto t = targets_.find({w.dst, w.dst_inc, w.transfer_id, w.decode_rank, w.prefill_rank});
    const std::string what = engines_[w.src].engine_id + " rank " + std::to_string(w.prefill_rank) +
                             "'s WRITE of " + w.transfer_id + " into " + d.engine_id + " rank " +
                             std::to_string(w.decode_rank);
    if (t == targets_.end()) {
      Violate(ViolationKind::kWriteIntoReusedBlock, what + ": blocks the decode never offered");
      return;
    }
    WriteTarget& tg = t->second;
    for (int32_t b : w.dst_blocks) {
      if (std::find(tg.blocks.begin(), tg.blocks.end(), b) == tg.blocks.end()) {
        Violate(ViolationKind::kWriteIntoReusedBlock,
                what + ": block " + std::to_string(b) + " was not offered");
        return;
      }
      if (tg.reported) {
        Violate(ViolationKind::kWriteIntoReusedBlock,
                what + ": landed in block " + std::to_string(b) +
                    " after the decode reported the request (its blocks are the engine's again)");
        return;
      }
      if (tg.drained) {
        Violate(ViolationKind::kWriteIntoReusedBlock,
                what + ": landed in block " + std::to_string(b) +
                    " after the decode was told the writes drained");
        return;
      }
      if (tg.freed.count(b) || (d.pool->RefCount(b) == 0 && d.pool->HoldCount(b) == 0)) {
        Violate(ViolationKind::kWriteIntoReusedBlock,
                what + ": landed in block " + std::to_string(b) +
                    ", freed (its owner may have changed) since the decode offered it");
        return;
      }
    }
    if (w.status.ok()) tg.landed[w.layer].insert(w.dst_blocks.begin(), w.dst_blocks.end());
    if (w.tainted) tg.tainted = true;
  }
  Engine& p = engines_[w.src];
  if (p.up && p.incarnation == w.src_inc) {
    p.conn->Push(InWriteEnded{w.write_id, w.status});
    Wake(w.src);
  }
  if (landed && w.status.ok() && w.notification) {
    // The agent's notification: delivered after the WRITE's data landed.
    SendControl(w.dst, *w.notification, 0, engines_[w.src].engine_id);
  }
}

void Sim::CheckWriteLoad(int engine, const std::string& request_id,
                         const std::string& transfer_id) {
  if (!k_.write_mode) return;
  const Engine& e = engines_[engine];
  for (const auto& [dr, pr] : TpPlanPairs(k_.prefill_tp, k_.decode_tp, k_.num_kv_heads)) {
    auto t = targets_.find({engine, e.incarnation, transfer_id, dr, pr});
    const std::string pair =
        "decode rank " + std::to_string(dr) + " / prefill rank " + std::to_string(pr);
    if (t == targets_.end()) {
      Violate(ViolationKind::kUsedBeforeWriteDone, e.engine_id + " uses the KV of " + request_id +
                                                       " without offering blocks to " + pair);
      return;
    }
    const WriteTarget& tg = t->second;
    if (!tg.done_ok) {
      Violate(ViolationKind::kUsedBeforeWriteDone, e.engine_id + " uses the KV of " + request_id +
                                                       " before " + pair + " said write_done(ok)");
      return;
    }
    const auto all = tg.landed.find(-1);
    for (int l = 0; l < k_.num_layers; ++l) {
      const auto layer = tg.landed.find(l);
      for (int32_t b : tg.blocks) {
        const bool in_all = all != tg.landed.end() && all->second.count(b);
        const bool in_layer = layer != tg.landed.end() && layer->second.count(b);
        if (!in_all && !in_layer) {
          Violate(ViolationKind::kUsedBeforeWriteDone,
                  e.engine_id + " uses the KV of " + request_id + ": layer " + std::to_string(l) +
                      " of block " + std::to_string(b) + " never landed from " + pair);
          return;
        }
      }
    }
    if (tg.tainted) {
      Violate(ViolationKind::kStaleKvUsed,
              e.engine_id + " uses the KV of " + request_id + ", written from prefill blocks " +
                  "that were freed (or gone) during the WRITE (" + pair + ")");
      return;
    }
  }
}

void Sim::ObserveWriteTargets(int ei) {
  for (const TargetKey& key : open_targets_) {
    const auto& [dst, inc, tid, dr, pr] = key;
    if ((ei >= 0 && dst != ei) || !engines_[dst].up || engines_[dst].incarnation != inc) continue;
    const BlockPool& pool = *engines_[dst].pool;
    WriteTarget& tg = targets_.at(key);
    for (int32_t b : tg.blocks) {
      if (pool.RefCount(b) == 0 && pool.HoldCount(b) == 0) tg.freed.insert(b);
    }
  }
}

void Sim::CheckReadsAtPrefillFree(int engine, const std::string& transfer_id, bool excused) {
  if (excused) return;
  const Engine& p = engines_[engine];
  auto it = pending_pairs_.lower_bound({engine, p.incarnation, transfer_id, "", -1, -1});
  if (it == pending_pairs_.end() || std::get<0>(*it) != engine ||
      std::get<1>(*it) != p.incarnation || std::get<2>(*it) != transfer_id) {
    return;
  }
  const auto& [src, inc, tid, decode, decode_rank, prefill_rank] = *it;
  bool in_flight = false;
  for (const auto& [key, r] : reads_) {
    in_flight = in_flight || (r.src == src && r.src_inc == inc && r.transfer_id == tid &&
                              engines_[r.dst].engine_id == decode && r.decode_rank == decode_rank &&
                              r.prefill_rank == prefill_rank);
  }
  Violate(ViolationKind::kEarlyFree,
          p.engine_id + " freed the blocks of transfer " + transfer_id + " while " + decode +
              " rank " + std::to_string(decode_rank) + "'s READ from prefill rank " +
              std::to_string(prefill_rank) + " was still pending (" +
              (in_flight ? "in flight" : "done, its read_done not received yet") + ")");
}

void Sim::CheckLoadTaint(int engine, const std::string& request_id) {
  const Engine& e = engines_[engine];
  if (tainted_loads_.count({engine, e.incarnation, request_id})) {
    Violate(ViolationKind::kStaleKvUsed,
            e.engine_id + " uses the KV of " + request_id +
                ", read from prefill blocks that were freed (or gone) during the READ");
  }
}

void Sim::MarkTargetsReported(int engine, const std::string& transfer_id) {
  const int inc = engines_[engine].incarnation;
  for (auto& [key, t] : targets_) {
    if (std::get<0>(key) == engine && std::get<1>(key) == inc && std::get<2>(key) == transfer_id)
      t.reported = true;
  }
}

void Sim::OnLoadFailed(int engine, const std::string& request_id, const Status& status) {
  // Without injected faults a load may only fail when its client left (the proxy's release
  // races the decode's ReadDone); anything else is a safety net firing.
  if (k_.faults) return;
  const Engine& e = engines_[engine];
  auto it = e.leg_of.find(request_id);
  if (it != e.leg_of.end() && flows_[it->second.flow].client_aborted) return;
  Violate(ViolationKind::kLoadFailed, e.engine_id + ": remote load of " + request_id +
                                          " failed without injected faults: " + status.ToString());
}

}  // namespace kvbridge::sim::internal
