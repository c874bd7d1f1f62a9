// The simulator's event loop: setup, engines (the real Scheduler + BlockPool), crashes, and the run
// (include/kvbridge/sim/simulator.h, docs/sim.md).
#include "sim/sim.h"

namespace kvbridge::sim {

std::string SimResult::Summary() const {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "seed %llu: %s%s%s mode=%s faults=%d requests=%d ok=%d aborts=%d reads=%d "
                "writes=%d crashes=%d lease_expired=%d events=%lld t=%.3fs",
                static_cast<unsigned long long>(seed), ok ? "PASS" : "FAIL ",
                ok ? "" : std::string(ViolationKindName(violation)).c_str(), ok ? "" : ":",
                std::string(KvTransferModeName(mode)).c_str(), faults ? 1 : 0, requests,
                answered_ok, client_aborts, reads, writes, crashes, lease_expired,
                static_cast<long long>(events), static_cast<double>(at) / kSecond);
  std::string s = buf;
  if (!ok) s += " — " + message;
  return s;
}

}  // namespace kvbridge::sim

namespace kvbridge::sim::internal {

// ------------------------------------------------------------------------------------------
// Sim: setup

void Sim::Trace(const char* fmt, ...) {
  if (!opts_.trace) return;
  char buf[1024];
  int n = std::snprintf(buf, sizeof(buf), "%12.3fms  ", static_cast<double>(now_) / kMillisecond);
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf + n, sizeof(buf) - static_cast<size_t>(n), fmt, ap);
  va_end(ap);
  trace_ += buf;
  trace_ += '\n';
}

void Sim::Violate(ViolationKind kind, const std::string& message) {
  if (!result_.ok) return;  // the first violation is the one reported
  result_.ok = false;
  result_.violation = kind;
  result_.message = message;
  result_.at = now_;
  Trace("VIOLATION %s: %s", std::string(ViolationKindName(kind)).c_str(), message.c_str());
}

void Sim::StartEngine(Engine& e) {
  e.up = true;
  e.engine_id = e.name + "-i" + std::to_string(e.incarnation);
  auto pool = BlockPool::Create({.num_blocks = e.prefill ? k_.prefill_blocks : k_.decode_blocks,
                                 .block_size = k_.block_size,
                                 .enable_prefix_caching = e.prefix_caching});
  e.pool = std::move(pool.value());
  e.conn = std::make_unique<SimConnector>(this, e.index, e.engine_id, e.port, k_);
  SchedulerConfig sc;
  sc.max_num_seqs = 32;
  sc.max_num_batched_tokens = k_.max_batched_tokens;
  sc.max_model_len = 256;
  sc.vocab_size = kVocab;
  sc.eos_token_ids = {kEos};
  sc.model_fingerprint = kFingerprint;
  sc.default_seed = seed_;
  e.sched = std::make_unique<Scheduler>(sc, e.pool.get(), e.conn.get(), nullptr);
  e.in_step = false;
  e.step_scheduled = false;
  e.timer_at = -1;
  e.batch = ScheduledBatch{};
  e.deferred.clear();
  e.leg_of.clear();
  e.req_of.clear();
  e.accum.clear();
  Trace("engine %s up (incarnation %d, %lld blocks of %d, prefix caching %s)", e.engine_id.c_str(),
        e.incarnation, static_cast<long long>(e.pool->num_blocks()), k_.block_size,
        e.prefix_caching ? "on" : "off");
}

int Sim::EngineByName(const std::string& name) const {
  for (const Engine& e : engines_) {
    if (e.name == name) return e.index;
  }
  return -1;
}

// ------------------------------------------------------------------------------------------
// Engines

void Sim::Wake(int ei) {
  Engine& e = engines_[ei];
  if (!e.up || e.in_step || e.step_scheduled) return;
  e.step_scheduled = true;
  const int inc = e.incarnation;
  At(now_, [this, ei, inc] { EngineStep(ei, inc); });
}

void Sim::EngineStep(int ei, int inc) {
  Engine& e = engines_[ei];
  if (!e.up || e.incarnation != inc) return;
  e.step_scheduled = false;
  if (e.in_step) return;
  std::vector<std::function<void()>> deferred;
  deferred.swap(e.deferred);
  for (auto& fn : deferred) fn();
  CheckReadTargets(ei);  // before Schedule can hand a freed block out again
  ObserveWriteTargets(ei);
  e.sched->PollConnector(now_);
  CheckReadTargets(ei);
  ObserveWriteTargets(ei);
  DrainOutputs(e);
  e.batch = e.sched->Schedule(now_);
  DrainOutputs(e);
  if (e.batch.empty()) {
    if (!e.deferred.empty()) Wake(ei);
    ArmTimer(e);
    return;
  }
  e.in_step = true;
  const DurationUs dur = 500 + 20 * e.batch.num_tokens + Uniform(0, 1000);
  if (opts_.trace) {
    std::string ids;
    for (const ScheduledChunk& c : e.batch.chunks) {
      ids += " " + c.request_id + "[" + std::to_string(c.start_pos) + "+" +
             std::to_string(c.num_tokens) + "]";
    }
    Trace("%s step:%s (%.3fms)", e.engine_id.c_str(), ids.c_str(),
          static_cast<double>(dur) / kMillisecond);
  }
  if (k_.write_mode && e.prefill) {
    // The stand-in forward pass computes the layers in order over the step; each layer's end
    // is reported as the engine does (KvConnector::OnLayerKvWritten), so WRITEs overlap it.
    const uint64_t step = e.step = next_step_++;
    for (int l = 0; l < k_.num_layers; ++l) {
      At(now_ + dur * (l + 1) / k_.num_layers,
         [this, ei, inc, step, l] { LayerDone(ei, inc, step, l); });
    }
  }
  At(now_ + dur, [this, ei, inc] { StepDone(ei, inc); });
}

void Sim::LayerDone(int ei, int inc, uint64_t step, int layer) {
  Engine& e = engines_[ei];
  if (!e.up || e.incarnation != inc || !e.in_step || e.step != step) return;
  std::vector<KvConnector::LayerKvChunk> chunks;
  for (const ScheduledChunk& c : e.batch.chunks) {
    chunks.push_back(
        {.request_id = c.request_id,
         .block_ids = std::span<const int32_t>(c.block_table, static_cast<size_t>(c.num_blocks)),
         .end_pos = c.start_pos + c.num_tokens,
         .completes_tokens = c.compute_logits});
  }
  e.conn->OnLayerKvWritten(layer, chunks, now_);
}

void Sim::StepDone(int ei, int inc) {
  Engine& e = engines_[ei];
  if (!e.up || e.incarnation != inc) return;
  // The stand-in model: seeded logits, no forward pass.
  std::vector<float> logits(static_cast<size_t>(e.batch.num_logit_rows) * kVocab);
  for (float& x : logits) x = static_cast<float>(Uniform(0, 1000)) / 100.0f;
  Status st = e.sched->UpdateFromOutput(e.batch, logits, now_);
  if (!st.ok()) Violate(ViolationKind::kCrash, "UpdateFromOutput: " + st.ToString());
  e.in_step = false;
  e.batch = ScheduledBatch{};
  DrainOutputs(e);
  Wake(ei);
}

void Sim::ArmTimer(Engine& e) {
  std::optional<TimePoint> d = e.conn->NextDeadline();
  if (!d) return;
  const TimePoint at = std::max(*d, now_ + 1);
  if (e.timer_at >= 0 && e.timer_at <= at && e.timer_at > now_) return;  // an earlier one is armed
  e.timer_at = at;
  const int ei = e.index, inc = e.incarnation;
  At(at, [this, ei, inc, at] {
    Engine& x = engines_[ei];
    if (!x.up || x.incarnation != inc || x.timer_at != at) return;
    x.timer_at = -1;
    Wake(ei);
  });
}

void Sim::DrainOutputs(Engine& e) {
  for (RequestOutput& out : e.sched->TakeOutputs()) {
    Engine::Accum& acc = e.accum[out.request_id];
    for (CompletionOutput& co : out.outputs) {
      auto& toks = acc.tokens[co.index];
      toks.insert(toks.end(), co.new_token_ids.begin(), co.new_token_ids.end());
      if (co.finished) acc.finish[co.index] = co.finish_reason;
    }
    if (!out.finished) continue;
    auto lit = e.leg_of.find(out.request_id);
    Engine::Accum done = std::move(acc);
    e.accum.erase(out.request_id);
    if (lit == e.leg_of.end()) continue;
    const LegRef ref = lit->second;
    e.leg_of.erase(lit);
    e.req_of.erase(ref);
    bool aborted = false;
    for (const auto& [i, r] : done.finish) aborted |= r == "abort";
    if (!out.error.ok()) {
      json err = {{"error", {{"message", out.error.ToString()}, {"type", "engine_error"}}}};
      AnswerLeg(e, ref, out.error.code() == StatusCode::kInvalidArgument ? 400 : 500, err.dump());
      continue;
    }
    if (!aborted && static_cast<int>(done.finish.size()) != done.n) {
      Violate(ViolationKind::kSiblingAccounting, e.engine_id + " finished " + out.request_id +
                                                     " with " + std::to_string(done.finish.size()) +
                                                     " of " + std::to_string(done.n) + " siblings");
    }
    json choices = json::array();
    for (const auto& [i, r] : done.finish) {
      choices.push_back({{"index", i}, {"token_ids", done.tokens[i]}, {"finish_reason", r}});
    }
    json body = {{"id", out.request_id}, {"object", "text_completion"}, {"choices", choices}};
    if (!out.kv_transfer_params.is_null()) body["kv_transfer_params"] = out.kv_transfer_params;
    AnswerLeg(e, ref, 200, body.dump());
  }
}

void Sim::CrashEngine(int ei) {
  Engine& e = engines_[ei];
  if (!e.up) return;
  ++result_.crashes;
  Trace("CRASH %s", e.engine_id.c_str());
  dead_lease_expired_ += e.conn->lease_expired() + e.conn->wdecode().counters().write_timeouts;
  dead_ignored_ += e.conn->notifications_ignored();
  dead_load_failures_ +=
      e.conn->decode().counters().load_failures + e.conn->wdecode().counters().load_failures;
  // Open legs break.
  for (const auto& [id, ref] : e.leg_of) {
    const LegRef r = ref;
    At(now_ + Uniform(k_.http_delay_lo, k_.http_delay_hi),
       [this, r] { LegError(r, proxy::LegFailure::kBroken, "connection reset"); });
  }
  // Transfers: reads into this engine vanish with its memory; reads from it fail promptly.
  for (auto it = reads_.begin(); it != reads_.end();) {
    Read& r = it->second;
    if (r.dst == ei) {
      read_key_.erase({r.dst, r.dst_inc, r.read_id});
      it = reads_.erase(it);
      continue;
    }
    if (r.src == ei) {
      r.tainted = true;
      r.status = UnavailableError("peer " + e.engine_id + " lost");
      r.end_at = std::min(r.end_at, now_ + Uniform(100, 3000));
      const uint64_t key = it->first, v = ++r.version;
      At(r.end_at, [this, key, v] { EndRead(key, v); });
    }
    ++it;
  }
  // WRITEs: from this engine they stop (its completions go nowhere); into it they fail promptly.
  for (auto it = writes_.begin(); it != writes_.end();) {
    Write& w = it->second;
    if (w.src == ei) {
      write_key_.erase({w.src, w.src_inc, w.write_id});
      it = writes_.erase(it);
      continue;
    }
    if (w.dst == ei && w.started) {
      w.status = UnavailableError("peer " + e.engine_id + " lost");
      w.end_at = std::min(w.end_at, now_ + Uniform(100, 3000));
      const uint64_t key = it->first, v = ++w.version;
      At(w.end_at, [this, key, v] { EndWrite(key, v); });
    }
    ++it;
  }
  // Its peers notice within about a second (issue 21): the connection closed, nothing of it can
  // land any more (its WRITEs stopped above).
  const std::string lost = e.engine_id;
  for (const Engine& x : engines_) {
    if (!x.up || x.index == ei) continue;
    const int xi = x.index, xinc = x.incarnation;
    At(now_ + LossUniform(k_.detect_lo, k_.detect_hi),
       [this, xi, xinc, lost] { DeliverPeerLost(xi, xinc, lost, PeerLoss::kGone); });
  }
  At(now_ + 2 * kSecond, [this, lost] { CheckPeerReleased(lost); });
  e.up = false;
  e.sched.reset();
  e.conn.reset();
  e.pool.reset();
  e.deferred.clear();
  e.leg_of.clear();
  e.req_of.clear();
  e.accum.clear();
  At(now_ + Uniform(20, 300) * kMillisecond, [this, ei] {
    Engine& x = engines_[ei];
    ++x.incarnation;
    StartEngine(x);
  });
}

void Sim::DeliverPeerLost(int ei, int inc, const std::string& lost, PeerLoss loss) {
  Engine& x = engines_[ei];
  if (!x.up || x.incarnation != inc) return;
  Trace("%s: told peer %s is lost (%s)", x.engine_id.c_str(), lost.c_str(),
        std::string(PeerLossName(loss)).c_str());
  x.conn->Push(InPeerLost{lost, loss});
  Wake(ei);
}

void Sim::CheckPeerReleased(const std::string& lost) {
  for (const Engine& e : engines_) {
    if (!e.up) continue;
    const auto [bound, blocks] = e.conn->BoundTo(lost);
    if (blocks > 0) {
      Violate(ViolationKind::kPeerLossNotReleased,
              e.engine_id + " still has " + std::to_string(bound) + " transfer(s) (" +
                  std::to_string(blocks) + " blocks) bound to " + lost + ", 2 s after it died");
      return;
    }
  }
}

void Sim::SuspectPeer(int attempt) {
  // An engine with work bound to a live peer is told that peer is lost (its heartbeats
  // stopped, say) while it is in fact alive and working: only what is safe may be freed.
  std::vector<std::pair<int, int>> cands;  // (observer, suspected)
  for (const Engine& o : engines_) {
    if (!o.up) continue;
    for (const Engine& p : engines_) {
      if (p.up && p.index != o.index && o.conn->BoundTo(p.engine_id).first > 0)
        cands.emplace_back(o.index, p.index);
    }
  }
  if (cands.empty()) {
    if (attempt < 200) At(now_ + 2 * kMillisecond, [this, attempt] { SuspectPeer(attempt + 1); });
    return;
  }
  const auto [o, p] =
      cands[static_cast<size_t>(LossUniform(0, static_cast<int64_t>(cands.size()) - 1))];
  DeliverPeerLost(o, engines_[o].incarnation, engines_[p].engine_id, PeerLoss::kSuspected);
}

void Sim::KillProxy() {
  if (proxy_dead_) return;
  proxy_dead_ = true;
  Trace("PROXY DIES");
  for (FlowState& f : flows_) {
    if (f.flow && !f.finished) f.proxy_lost = true;
  }
  // Its legs' connections close: each engine aborts what it was serving for it.
  for (Engine& e : engines_) {
    if (!e.up) continue;
    for (const auto& [ref, id] : e.req_of) {
      const int ei = e.index, inc = e.incarnation;
      const std::string rid = id;
      At(now_ + Uniform(k_.http_delay_lo, k_.http_delay_hi), [this, ei, inc, rid] {
        Engine& x = engines_[ei];
        if (!x.up || x.incarnation != inc) return;
        Trace("%s: proxy connection closed, abort %s", x.engine_id.c_str(), rid.c_str());
        Defer(x, [this, ei, rid] { engines_[ei].sched->Abort(rid, now_); });
      });
    }
  }
}

// ------------------------------------------------------------------------------------------
// Run

SimResult Sim::Run() {
  result_.seed = seed_;
  DrawKnobs();
  result_.faults = k_.faults;
  result_.mode = k_.write_mode ? KvTransferMode::kWrite : KvTransferMode::kRead;
  Trace(
      "seed %llu workload %s: %d prefill + %d decode, block_size %d, faults %s, "
      "prefill_forward_n %d, %d requests",
      static_cast<unsigned long long>(seed_), std::string(WorkloadName(opts_.workload)).c_str(),
      k_.num_prefill, k_.num_decode, k_.block_size, k_.faults ? "on" : "off",
      k_.prefill_forward_n ? 1 : 0, k_.num_requests);
  Trace("tp: prefill %d ranks, decode %d ranks, %d KV heads", k_.prefill_tp, k_.decode_tp,
        k_.num_kv_heads);
  Trace("mode: %s, %d layers", k_.write_mode ? "write" : "read", k_.num_layers);
  for (int i = 0; i < k_.num_prefill + k_.num_decode; ++i) {
    Engine e;
    e.index = i;
    e.prefill = i < k_.num_prefill;
    e.name = e.prefill ? "p" + std::to_string(i) : "d" + std::to_string(i - k_.num_prefill);
    e.port = kPortBase + i;
    e.prefix_caching = k_.prefix_caching[static_cast<size_t>(i)];
    engines_.push_back(std::move(e));
  }
  for (Engine& e : engines_) StartEngine(e);
  flows_.resize(static_cast<size_t>(k_.num_requests));
  result_.requests = k_.num_requests;
  for (int i = 0; i < k_.num_requests; ++i) {
    flows_[i].id = i;
    flows_[i].arrival = Uniform(0, k_.arrival_window);
    At(flows_[i].arrival, [this, i] { StartFlow(i); });
  }
  for (int c = 0; c < k_.crashes; ++c) {
    const int ei = static_cast<int>(Uniform(0, static_cast<int64_t>(engines_.size()) - 1));
    At(Uniform(0, k_.arrival_window + 50 * kMillisecond), [this, ei] { CrashEngine(ei); });
  }
  for (int s = 0; s < k_.suspicions; ++s) {
    At(LossUniform(0, k_.arrival_window + 200 * kMillisecond), [this] { SuspectPeer(0); });
  }
  if (k_.proxy_death) {
    At(LossUniform(0, k_.arrival_window + 50 * kMillisecond), [this] { KillProxy(); });
  }
  for (int j = 0; j < k_.junk; ++j) {
    At(Uniform(0, k_.arrival_window + 100 * kMillisecond), [this] { InjectJunk(); });
  }
  int64_t events = 0;
  while (!events_.empty() && result_.ok) {
    auto node = events_.extract(events_.begin());
    now_ = node.key().first;
    ++events;
    try {
      node.mapped()();
    } catch (const std::exception& ex) {
      Violate(ViolationKind::kCrash, std::string("exception: ") + ex.what());
      break;
    }
    if (!result_.ok) break;
    CheckAll();
    if (events > opts_.max_events) {
      Violate(ViolationKind::kHang, "no quiescence after " + std::to_string(events) + " events");
    }
  }
  if (result_.ok) CheckQuiescence();
  result_.events = events;
  if (result_.ok) result_.at = now_;
  result_.lease_expired = static_cast<int>(SumLeaseExpired());
  if (opts_.trace) result_.trace = std::move(trace_);
  return result_;
}

}  // namespace kvbridge::sim::internal

namespace kvbridge::sim {

SimResult RunSimulation(uint64_t seed, const SimOptions& options) {
  internal::Sim sim(seed, options);
  return sim.Run();
}

}  // namespace kvbridge::sim
