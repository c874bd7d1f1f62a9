#include "kvbridge/connector/connector_logic.h"

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "kvbridge/connector/tp_plan.h"

#ifdef KVBRIDGE_PLANTED_FAULTS
#include "testing/planted_faults.h"  // test-only switches (src/sim builds them in)
#endif

namespace kvbridge {
namespace {

// A parse result kept for a parent is dropped past this many parents (a miss parses again).
constexpr size_t kMaxParsedParents = 16384;

}  // namespace

ConnectorLogic::ConnectorLogic(const KvTransferConfig& config, const ConnectorCores::Shape& shape,
                               ConnectorSink* sink)
    : config_(config), shape_(shape), sink_(sink), cores_(config, shape) {}

Result<std::optional<KvTransferParams>> ConnectorLogic::ParamsOf(const ConnectorRequestInfo& req) {
  if (req.kv_transfer_params == nullptr || req.kv_transfer_params->is_null()) {
    return std::optional<KvTransferParams>();
  }
  auto it = params_.find(req.parent_id);
  if (it != params_.end() && it->second.raw == *req.kv_transfer_params) return it->second.params;
  if (params_.size() >= kMaxParsedParents) params_.clear();
  Result<KvTransferParams> p =
      ParseKvTransferParams(*req.kv_transfer_params, {.block_size = shape_.block_size});
  ParsedParams parsed{.raw = *req.kv_transfer_params,
                      .params = p.ok() ? Result<std::optional<KvTransferParams>>(std::move(*p))
                                       : Result<std::optional<KvTransferParams>>(p.status()),
                      .open = std::max(1, req.n)};
  auto [pos, _] = params_.insert_or_assign(req.parent_id, std::move(parsed));
  return pos->second.params;
}

void ConnectorLogic::ForgetParams(const ConnectorRequestInfo& req) {
  auto it = params_.find(req.parent_id);
  if (it == params_.end()) return;
  // The parent itself (n == 1, or aborted before it forked) ends every use; a sibling one.
  if (req.request_id == req.parent_id || --it->second.open <= 0) params_.erase(it);
}

void ConnectorLogic::RequestQueued(const ConnectorRequestInfo& req, TimePoint now) {
  // A decode leg waiting in the engine's queue heartbeats the prefill (DESIGN.md READ step 4).
  auto p = ParamsOf(req);
  if (p.ok() && *p && (*p)->do_remote_prefill && (*p)->mode == KvTransferMode::kRead) {
    cores_.decode.OnRequestQueued(req.request_id, **p, now);
  }
  Drain(now);
}

Result<KvConnector::Match> ConnectorLogic::GetNumNewMatchedTokens(const ConnectorRequestInfo& req,
                                                                  int num_local_computed,
                                                                  TimePoint now) {
  ASSIGN_OR_RETURN(std::optional<KvTransferParams> p, ParamsOf(req));
  if (!p) return KvConnector::Match{};
  if (p->do_remote_decode && !config_.IsProducer()) {
    return InvalidArgumentError("this engine is not a kv_producer");
  }
  if (!p->do_remote_decode && !config_.IsConsumer()) {
    return InvalidArgumentError("this engine is not a kv_consumer");
  }
  Result<KvConnector::Match> m = p->mode == KvTransferMode::kWrite
                                     ? WriteRequestAdded(req, *p, num_local_computed, now)
                                     : ReadRequestAdded(req, *p, num_local_computed, now);
  if (m.ok() && m->load_async) {
    sink_->Note({.kind = RequestNote::Kind::kLoadStarted,
                 .mode = p->mode,
                 .request_id = req.request_id,
                 .transfer_id = p->transfer_id});
  }
  Drain(now);
  return m;
}

Result<KvConnector::Match> ConnectorLogic::ReadRequestAdded(const ConnectorRequestInfo& req,
                                                            const KvTransferParams& p,
                                                            int num_local_computed, TimePoint now) {
  KvConnector::Match m;
  if (p.do_remote_decode) {
    RETURN_IF_ERROR(cores_.prefill.OnRequestAdded(req.parent_id, req.n, p.transfer_id, now));
    sink_->Note({.kind = RequestNote::Kind::kPrefillAdmitted,
                 .mode = KvTransferMode::kRead,
                 .request_id = req.parent_id,
                 .transfer_id = p.transfer_id});
    return m;
  }
  ASSIGN_OR_RETURN(DecodeCore::Match dm,
                   cores_.decode.OnRequestAdded(req.request_id, p, req.num_prompt_tokens,
                                                num_local_computed, now));
  admitted_.insert(req.parent_id);
  m.num_external_tokens = dm.num_external_tokens;
  m.load_async = dm.load_async;
  // The prefill ranks the TP plan reads from (not unread replicas) are needed soon.
  std::set<int> sources;
  for (const auto& [dr, pr] : TpPlanPairs(p.tp_size, shape_.tp_size, shape_.num_kv_heads))
    sources.insert(pr);
  for (int r : sources) {
    sink_->PreparePeer(
        {.engine_id = p.remote_engine_id, .host = p.remote_host, .port = p.remote_port, .rank = r});
  }
  return m;
}

Result<KvConnector::Match> ConnectorLogic::WriteRequestAdded(const ConnectorRequestInfo& req,
                                                             const KvTransferParams& p,
                                                             int num_local_computed,
                                                             TimePoint now) {
  KvConnector::Match m;
  if (p.do_remote_decode) {
    Status st = cores_.wprefill.OnRequestAdded(req.request_id, req.n, p.transfer_id,
                                               req.num_prompt_tokens, now);
    if (!st.ok() && st.code() != StatusCode::kAlreadyExists) {
      // This leg will never write: answer the decode's block ids now, not at the lease.
      cores_.wprefill.OnAbortedBeforeAdmission(p.transfer_id, now);
    }
    RETURN_IF_ERROR(st);
    return m;
  }
  ASSIGN_OR_RETURN(WriteDecodeCore::Match dm,
                   cores_.wdecode.OnRequestAdded(req.request_id, p, req.num_prompt_tokens,
                                                 num_local_computed, now));
  admitted_.insert(req.parent_id);
  if (dm.num_external_tokens > 0) awaiting_alloc_.insert(req.request_id);
  m.num_external_tokens = dm.num_external_tokens;
  m.load_async = dm.load_async;
  for (int r = 0; r < p.tp_size; ++r) {
    sink_->PreparePeer(
        {.engine_id = p.remote_engine_id, .host = p.remote_host, .port = p.remote_port, .rank = r});
  }
  return m;
}

Status ConnectorLogic::UpdateStateAfterAlloc(const ConnectorRequestInfo& req,
                                             std::span<const int32_t> block_ids,
                                             int num_local_computed, int num_external,
                                             TimePoint now) {
  Status st = awaiting_alloc_.erase(req.request_id)
                  ? cores_.wdecode.OnBlocksAllocated(req.request_id, block_ids, num_local_computed,
                                                     num_external, now)
                  : cores_.decode.OnBlocksAllocated(req.request_id, block_ids, num_local_computed,
                                                    num_external, now);
  Drain(now);
  return st;
}

KvConnector::FinishDecision ConnectorLogic::RequestFinished(const ConnectorRequestInfo& req,
                                                            std::span<const int32_t> block_ids,
                                                            std::string_view finish_reason,
                                                            TimePoint now) {
  KvConnector::FinishDecision d;
  admitted_.erase(req.parent_id);
  auto parsed = ParamsOf(req);
  ForgetParams(req);
  if (!parsed.ok() || !*parsed || !(*parsed)->do_remote_decode) return d;
  const KvTransferParams& p = **parsed;
  const int bs = shape_.block_size;
  const size_t nb = static_cast<size_t>((req.num_prompt_tokens + bs - 1) / bs);
  std::vector<int32_t> prompt_blocks(block_ids.begin(),
                                     block_ids.begin() + std::min(nb, block_ids.size()));
  bool forward = true;
#ifdef KVBRIDGE_PLANTED_FAULTS
  // The mapping forgets the last sibling of a set: the engine frees its blocks at once and the
  // prefill core never hears that the sibling finished.
  if (sim::Planted().forget_last_finished_sibling && req.n > 1 && req.sibling_index == req.n - 1) {
    forward = false;
  }
#endif
  if (forward && p.mode == KvTransferMode::kWrite) {
    d.hold_blocks = cores_.wprefill.OnRequestFinished(req.request_id, prompt_blocks, now);
  } else if (forward) {
    d.hold_blocks =
        cores_.prefill.OnRequestFinished(req.request_id, p.transfer_id, prompt_blocks, now);
  }
  if (d.hold_blocks) {
    sink_->Note({.kind = RequestNote::Kind::kHeld,
                 .mode = p.mode,
                 .request_id = req.request_id,
                 .transfer_id = p.transfer_id});
  }
  KvTransferParams out;
  out.do_remote_prefill = true;
  out.transfer_id = p.transfer_id;
  out.remote_engine_id = shape_.engine_id;
  std::tie(out.remote_host, out.remote_port) = sink_->AdvertisedEndpoint();
  out.remote_block_ids = prompt_blocks;
  out.remote_num_tokens = req.num_prompt_tokens;
  out.tp_size = shape_.tp_size;
  out.mode = p.mode;
  d.kv_transfer_params = KvTransferParamsToJson(out);
  Drain(now);
  return d;
}

bool ConnectorLogic::RequestAborted(const ConnectorRequestInfo& req, TimePoint now) {
  const bool keep = cores_.OnRequestAborted(req.request_id, now);
  awaiting_alloc_.erase(req.request_id);
  auto parsed = ParamsOf(req);
  ForgetParams(req);
  if (req.request_id == req.parent_id && parsed.ok() && *parsed) {
    const KvTransferParams& p = **parsed;
    const bool write = p.mode == KvTransferMode::kWrite;
    // A prefill leg aborted (maybe before admission): block ids (WRITE) or a release (READ)
    // parked for its transfer are answered or dropped now, not after a lease (a no-op when the
    // transfer was registered).
    if (p.do_remote_decode) {
      if (write) {
        cores_.wprefill.OnAbortedBeforeAdmission(p.transfer_id, now);
      } else {
        cores_.prefill.OnAbortedBeforeAdmission(p.transfer_id, now);
      }
    }
    // A decode leg aborted while still queued (the cores never admitted it): its heartbeats
    // stop and the prefill must not wait for its lease.
    if (p.do_remote_prefill && !admitted_.count(req.parent_id)) {
      if (write) {
        cores_.wdecode.OnAbortedBeforeAdmission(p);
      } else {
        cores_.decode.OnAbortedBeforeAdmission(p);
      }
    }
  }
  admitted_.erase(req.parent_id);
  Drain(now);
  return keep;
}

void ConnectorLogic::OnLayerKvWritten(int layer, std::span<const KvConnector::LayerKvChunk> chunks,
                                      TimePoint now) {
  if (!WantsLayers()) return;  // no WRITE-mode prefill request here
  for (const KvConnector::LayerKvChunk& c : chunks) {
    if (c.completes_tokens)
      cores_.wprefill.OnLayerComputed(std::string(c.request_id), layer, c.block_ids, now);
  }
  Drain(now);
}

KvConnector::StepReport ConnectorLogic::Poll(TimePoint now) {
  cores_.OnTick(now);
  Drain(now);
  KvConnector::StepReport out = std::move(report_);
  report_ = KvConnector::StepReport{};
  return out;
}

void ConnectorLogic::OnTransferEnded(KvTransferMode op, uint64_t id, const Status& status,
                                     TimePoint now) {
  EndTransfer(op, id, status, now);
  Drain(now);
}

void ConnectorLogic::EndTransfer(KvTransferMode op, uint64_t id, const Status& status,
                                 TimePoint now) {
  if (op == KvTransferMode::kRead) {
    cores_.decode.OnReadCompleted(id, status, now);
  } else {
    cores_.wprefill.OnWriteCompleted(id, status, now);
  }
}

int64_t ConnectorLogic::OnPeerLost(const std::string& engine_id, PeerLoss loss, TimePoint now) {
  const int64_t n = cores_.OnPeerLost(engine_id, loss, now);
  Drain(now);
  return n;
}

Status ConnectorLogic::OnMessage(const ControlMessage& msg, uint64_t reply_token, TimePoint now) {
  Status st = OkStatus();
  if (const auto* rd = std::get_if<ReadDoneMsg>(&msg)) {
    cores_.prefill.OnReadDone(*rd, reply_token, now);
  } else if (const auto* hr = std::get_if<HoldReplyMsg>(&msg)) {
    cores_.decode.OnHoldReply(*hr, now);
  } else if (const auto* hb = std::get_if<HeartbeatMsg>(&msg)) {
    cores_.prefill.OnHeartbeat(*hb, now);
  } else if (const auto* rel = std::get_if<ReleaseMsg>(&msg)) {
    st = OnRelease(*rel, now);
  } else if (const auto* wb = std::get_if<WriteBlocksMsg>(&msg)) {
    // The decode's agent must be known before the first WRITE (and the WriteDone) to it.
    if (wb->prefill_engine_id == shape_.engine_id && !wb->decode_host.empty() &&
        wb->decode_port > 0) {
      sink_->PreparePeer({.engine_id = wb->decode_engine_id,
                          .host = wb->decode_host,
                          .port = wb->decode_port,
                          .rank = wb->decode_rank});
    }
    cores_.wprefill.OnWriteBlocks(*wb, now);
  } else if (const auto* wc = std::get_if<WriteCancelMsg>(&msg)) {
    cores_.wprefill.OnWriteCancel(*wc, now);
  } else if (const auto* wd = std::get_if<WriteDoneMsg>(&msg)) {
    cores_.wdecode.OnWriteDone(*wd, now);
  }
  Drain(now);
  return st;
}

Status ConnectorLogic::OnRelease(const ReleaseMsg& msg, TimePoint now) {
  // A release names a WRITE transfer when the WRITE cores know it, or (registered nowhere yet)
  // when this engine serves WRITE mode.
  if (cores_.wprefill.Knows(msg.transfer_id) ||
      (config_.mode == KvTransferMode::kWrite &&
       cores_.prefill.Siblings(msg.transfer_id).empty())) {
    return cores_.wprefill.OnRelease(msg, now);
  }
  Status st = cores_.prefill.OnRelease(msg, now);  // not ok: another incarnation (404)
  if (st.ok()) {
    sink_->Note({.kind = RequestNote::Kind::kReleased,
                 .mode = KvTransferMode::kRead,
                 .request_id = "",
                 .transfer_id = msg.transfer_id});
  }
  return st;
}

void ConnectorLogic::Drain(TimePoint now) {
  for (int round = 0; round < kMaxActionRounds; ++round) {
    std::vector<ConnectorAction> acts = cores_.TakeActions();
    if (acts.empty()) return;
    for (ConnectorAction& a : acts) Perform(a, now);
  }
}

void ConnectorLogic::Perform(ConnectorAction& a, TimePoint now) {
  if (auto* t = std::get_if<PostTransferAction>(&a)) {
    if (Status st = sink_->PostTransfer(*t); !st.ok()) EndTransfer(t->op, t->id, st, now);
  } else if (auto* c = std::get_if<CancelTransferAction>(&a)) {
    if (Status st = sink_->CancelTransfer(c->op, c->id); !st.ok())
      EndTransfer(c->op, c->id, st, now);
  } else if (auto* s = std::get_if<SendMessageAction>(&a)) {
    if (auto* wb = std::get_if<WriteBlocksMsg>(&s->msg)) {
      // Where the prefill's WRITEs and WriteDone find this decode.
      std::tie(wb->decode_host, wb->decode_port) = sink_->AdvertisedEndpoint();
    }
    sink_->Send(*s);
  } else if (auto* ld = std::get_if<ReportLoadDoneAction>(&a)) {
    report_.finished_recving.push_back(ld->request_id);
    sink_->OnReport(*ld);
  } else if (auto* lf = std::get_if<ReportLoadFailedAction>(&a)) {
    report_.failed_recving.push_back({lf->request_id, lf->recompute, lf->status});
    sink_->OnReport(*lf);
  } else if (auto* bf = std::get_if<ReportBlocksFreeAction>(&a)) {
    report_.finished_sending.push_back(bf->request_id);
    sink_->OnReport(*bf);
  }
}

}  // namespace kvbridge
