// SimConnector: the simulator as the sink of the runtime's ConnectorLogic, and its ledger
// (sim/sim_connector.h).
#include "sim/sim.h"

namespace kvbridge::sim::internal {

// ------------------------------------------------------------------------------------------
// SimConnector

bool SimConnector::RequestAborted(const ConnectorRequestInfo& req, TimePoint now) {
  loading_.erase(req.request_id);
  load_tid_.erase(req.request_id);
  const bool keep = logic_.RequestAborted(req, now);
  if (keep && !draining_.insert(req.request_id).second) {
    sim_->Violate(ViolationKind::kExactlyOnce, "request " + req.request_id + " drained twice");
  }
  return keep;
}

void SimConnector::UpdateStateAfterAlloc(const ConnectorRequestInfo& req,
                                         std::span<const int32_t> block_ids, int num_local_computed,
                                         int num_external, TimePoint now) {
  Status st = logic_.UpdateStateAfterAlloc(req, block_ids, num_local_computed, num_external, now);
  // A second allocation of one request is an engine bug the cores refuse (nothing changes).
  if (st.code() == StatusCode::kFailedPrecondition) {
    sim_->Violate(ViolationKind::kExactlyOnce,
                  "request " + req.request_id + " allocated twice: " + st.ToString());
  }
}

void SimConnector::HandleInbox(TimePoint now) {
  std::vector<InEvent> in;
  in.swap(inbox_);
  for (InEvent& e : in) {
    if (auto* r = std::get_if<InReadEnded>(&e)) {
      logic_.OnTransferEnded(KvTransferMode::kRead, r->read_id, r->status, now);
    } else if (auto* w = std::get_if<InWriteEnded>(&e)) {
      logic_.OnTransferEnded(KvTransferMode::kWrite, w->write_id, w->status, now);
    } else if (auto* pl = std::get_if<InPeerLost>(&e)) {
      const int64_t n = logic_.OnPeerLost(pl->engine_id, pl->loss, now);
      if (sim_->tracing()) {
        sim_->Trace("  %s: peer %s lost (%s): %lld released or failed", engine_id_.c_str(),
                    pl->engine_id.c_str(), std::string(PeerLossName(pl->loss)).c_str(),
                    static_cast<long long>(n));
      }
    } else {
      InMsg& m = std::get<InMsg>(e);
      if (auto* rd = std::get_if<ReadDoneMsg>(&m.msg)) {
        sim_->OnReadDoneTaken(engine_, *rd);  // this pair's READ is no longer pending
      } else if (auto* wd = std::get_if<WriteDoneMsg>(&m.msg)) {
        sim_->OnWriteDoneTaken(engine_, *wd);
      }
      // A release for another incarnation is refused (the runtime answers it 404).
      logic_.OnMessage(m.msg, m.reply_token, now).IgnoreError();
    }
  }
}

KvConnector::StepReport SimConnector::Poll(TimePoint now) {
  leases_before_poll_ = prefill().counters().lease_expired + prefill().counters().claims_expired;
  peer_lost_before_poll_ = prefill().counters().peer_lost;
  HandleInbox(now);
  StepReport out = logic_.Poll(now);
  // The ledger: every report names a request in the matching state, once.
  for (const std::string& id : out.finished_sending) {
    if (!held_.erase(id) && !draining_.erase(id)) {
      sim_->Violate(ViolationKind::kExactlyOnce,
                    engine_id_ + " reports blocks of " + id +
                        " free, but the engine neither finished-and-held nor drains it");
    }
  }
  for (const std::string& id : out.finished_recving) {
    if (draining_.erase(id)) continue;
    if (!loading_.erase(id)) {
      sim_->Violate(ViolationKind::kExactlyOnce,
                    engine_id_ + " reports load done for " + id + ", which is not loading");
      continue;
    }
    sim_->CheckLoadTaint(engine_, id);
    load_tid_.erase(id);
  }
  for (const LoadFailure& f : out.failed_recving) {
    if (draining_.erase(f.request_id)) continue;
    if (!loading_.erase(f.request_id)) {
      sim_->Violate(ViolationKind::kExactlyOnce, engine_id_ + " reports load failed for " +
                                                     f.request_id + ", which is not loading");
      continue;
    }
    load_tid_.erase(f.request_id);
    sim_->OnLoadFailed(engine_, f.request_id, f.status);
  }
  return out;
}

Status SimConnector::PostTransfer(const TransferAction& t) {
  if (t.op == KvTransferMode::kRead) {
    sim_->PostRead(engine_, t);
  } else {
    sim_->PostWrite(engine_, t);
  }
  return OkStatus();  // every simulated transfer ends through the inbox
}

Status SimConnector::CancelTransfer(KvTransferMode op, uint64_t id) {
  if (op == KvTransferMode::kRead) {
    sim_->CancelRead(engine_, id);
  } else {
    sim_->CancelWrite(engine_, id);
  }
  return OkStatus();
}

void SimConnector::Send(const SendMessageAction& a) { sim_->SendFromEngine(engine_, a); }

void SimConnector::Note(const RequestNote& n) {
  switch (n.kind) {
    case RequestNote::Kind::kLoadStarted:
      if (!loading_.insert(n.request_id).second) {
        sim_->Violate(ViolationKind::kExactlyOnce, "request " + n.request_id + " loads twice");
      }
      load_tid_[n.request_id] = n.transfer_id;
      if (n.mode == KvTransferMode::kWrite) write_tid_[n.request_id] = n.transfer_id;
      break;
    case RequestNote::Kind::kHeld:
      if (!held_
               .emplace(n.request_id, Held{.transfer_id = n.transfer_id,
                                           .write = n.mode == KvTransferMode::kWrite})
               .second) {
        sim_->Violate(ViolationKind::kExactlyOnce, "request " + n.request_id + " held twice");
      }
      break;
    case RequestNote::Kind::kReleased:
      released_.insert(n.transfer_id);
      break;
    case RequestNote::Kind::kPrefillAdmitted:
      break;
  }
}

void SimConnector::OnReport(const ConnectorLogic::Report& r) {
  const std::string& rid =
      std::visit([](const auto& x) -> const std::string& { return x.request_id; }, r);
  if (auto w = write_tid_.find(rid); w != write_tid_.end()) {
    sim_->MarkTargetsReported(engine_, w->second);
    write_tid_.erase(w);
  }
  if (const auto* ld = std::get_if<ReportLoadDoneAction>(&r)) {
    if (sim_->tracing())
      sim_->Trace("  %s: load done %s", engine_id_.c_str(), ld->request_id.c_str());
    // WRITE: checked when the core decides to go, before the rest of the inbox is taken.
    if (auto t = load_tid_.find(ld->request_id); t != load_tid_.end())
      sim_->CheckWriteLoad(engine_, ld->request_id, t->second);
  } else if (const auto* lf = std::get_if<ReportLoadFailedAction>(&r)) {
    if (sim_->tracing()) {
      sim_->Trace("  %s: load failed %s (%s)", engine_id_.c_str(), lf->request_id.c_str(),
                  lf->status.ToString().c_str());
    }
  } else {
    const auto& bf = std::get<ReportBlocksFreeAction>(r);
    if (sim_->tracing())
      sim_->Trace("  %s: blocks free %s", engine_id_.c_str(), bf.request_id.c_str());
    if (auto h = held_.find(bf.request_id); h != held_.end() && !h->second.write) {
      // A READ hold freed while a READ pair of its transfer is still pending (in flight, or its
      // read_done not taken yet) is an early free, unless the proxy released it or its lease
      // fired (the decode is then told "hold gone"). Checked when the core decides, before the
      // rest of the inbox is taken.
      const std::string& tid = h->second.transfer_id;
      const bool excused =
          released_.count(tid) > 0 ||
          prefill().counters().lease_expired + prefill().counters().claims_expired >
              leases_before_poll_ ||
          prefill().counters().peer_lost > peer_lost_before_poll_;
      sim_->CheckReadsAtPrefillFree(engine_, tid, excused);
    }
  }
}

}  // namespace kvbridge::sim::internal
