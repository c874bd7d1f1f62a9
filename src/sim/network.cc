// The simulator's fake network: proxy flows (the real PdFlow) and their HTTP legs, and the seeded
// control network (delay, reordering, duplication, loss, junk).
#include "sim/sim.h"

namespace kvbridge::sim::internal {

// ------------------------------------------------------------------------------------------
// Proxy flows and HTTP legs

void Sim::StartFlow(int fid) {
  FlowState& f = flows_[fid];
  if (proxy_dead_) {
    f.proxy_lost = true;  // nobody accepts the connection
    return;
  }
  json body;
  const int bs = k_.block_size;
  // Prompt: 1 token, below one block, exact multiples, shared prefixes, random.
  std::vector<int32_t> prompt;
  const int shape = static_cast<int>(Uniform(0, 6));
  int len = 1;
  switch (shape) {
    case 0:
      len = 1;
      break;
    case 1:
      len = std::max(1, bs - 1);
      break;
    case 2:
      len = bs * static_cast<int>(Uniform(1, 3));
      break;
    default:
      len = static_cast<int>(Uniform(1, 48));
  }
  if (shape >= 5) {
    // A shared prefix: one of three fixed bases (seeded per run), then a short suffix.
    const int base = static_cast<int>(Uniform(0, 2));
    std::mt19937_64 base_rng(seed_ * 31 + static_cast<uint64_t>(base));
    const int blen = bs * (1 + base) + base;  // a multiple of bs for base 0, off by one others
    for (int i = 0; i < blen; ++i) prompt.push_back(1 + static_cast<int32_t>(base_rng() % 31));
    const int suffix = static_cast<int>(Uniform(0, bs + 1));
    for (int i = 0; i < suffix; ++i) prompt.push_back(static_cast<int32_t>(Uniform(1, kVocab - 1)));
  } else {
    for (int i = 0; i < len; ++i) prompt.push_back(static_cast<int32_t>(Uniform(1, kVocab - 1)));
  }
  const int r = static_cast<int>(Uniform(0, 9));
  f.n = r < 5 ? 1 : r < 8 ? static_cast<int>(Uniform(2, 4)) : static_cast<int>(Uniform(5, 16));
  body["model"] = "sim";
  body["prompt"] = prompt;
  body["n"] = f.n;
  body["max_tokens"] = Uniform(1, 8);
  body["temperature"] = Chance(0.5) ? 0.0 : 1.0;
  body["stream"] = false;
  if (Chance(0.1)) body["kv_transfer_params"] = {{"do_remote_decode", true}};  // stripped
  std::string tid = "sim-" + std::to_string(seed_) + "-" + std::to_string(fid);
  minted_.push_back(tid);
  proxy::FlowOptions fo;
  fo.prefill_forward_n = k_.prefill_forward_n;
  fo.mode = k_.write_mode ? KvTransferMode::kWrite : KvTransferMode::kRead;
  proxy::InstancePicker picker =
      [this](proxy::Role role,
             const std::vector<std::string>& exclude) -> std::optional<proxy::Endpoint> {
    std::vector<int> cands;
    for (const Engine& e : engines_) {
      if (!e.up || e.prefill != (role == proxy::Role::kPrefill)) continue;
      if (std::find(exclude.begin(), exclude.end(), e.name) != exclude.end()) continue;
      cands.push_back(e.index);
    }
    if (cands.empty()) return std::nullopt;
    const Engine& e = engines_[cands[Uniform(0, static_cast<int64_t>(cands.size()) - 1)]];
    proxy::Endpoint ep{.id = e.name,
                       .url = "sim://" + e.name,
                       .engine_id = e.engine_id,
                       .transfer_host = "sim",
                       .transfer_port = e.port};
    ep.tp_size = e.prefill ? k_.prefill_tp : k_.decode_tp;  // as its registration says
    return ep;
  };
  f.flow = std::make_unique<proxy::PdFlow>(fo, tid, std::move(picker));
  Trace("client %d: request n=%d prompt=%zu tokens max_tokens=%d transfer %s", fid, f.n,
        prompt.size(), body["max_tokens"].get<int>(), tid.c_str());
  Exec(fid, f.flow->OnClientRequest({"/v1/completions", body.dump()}, now_));
  if (Chance(k_.abort_prob)) {
    ++result_.client_aborts;
    At(now_ + Uniform(0, k_.abort_window), [this, fid] {
      FlowState& x = flows_[fid];
      if (x.flow->client_done()) return;
      x.client_aborted = true;
      Trace("client %d: disconnects", fid);
      Exec(fid, x.flow->OnClientDisconnect(now_));
    });
  }
}

void Sim::Exec(int fid, std::vector<proxy::Action> actions) {
  FlowState& f = flows_[fid];
  if (proxy_dead_) return;  // a dead proxy acts no more
  for (proxy::Action& a : actions) {
    if (auto* s = std::get_if<proxy::SendLeg>(&a)) {
      const int ei = EngineByName(s->instance.id);
      const LegRef ref{fid, s->leg_id};
      Trace("proxy %d: send %s leg %d to %s", fid, std::string(proxy::RoleName(s->role)).c_str(),
            s->leg_id, s->instance.id.c_str());
      const DurationUs d = Uniform(k_.http_delay_lo, k_.http_delay_hi);
      if (ei < 0 || !engines_[ei].up) {
        At(now_ + d, [this, ref] { LegError(ref, proxy::LegFailure::kUnreachable, "refused"); });
        continue;
      }
      const int inc = engines_[ei].incarnation;
      At(now_ + d, [this, ei, inc, ref, body = s->body] { LegArrive(ei, inc, ref, body); });
    } else if (auto* c = std::get_if<proxy::CancelLeg>(&a)) {
      Trace("proxy %d: cancel leg %d", fid, c->leg_id);
      const LegRef ref{fid, c->leg_id};
      for (Engine& e : engines_) {
        auto it = e.req_of.find(ref);
        if (it == e.req_of.end()) continue;
        const int ei = e.index, inc = e.incarnation;
        const std::string id = it->second;
        At(now_ + Uniform(k_.http_delay_lo, k_.http_delay_hi), [this, ei, inc, id] {
          Engine& x = engines_[ei];
          if (!x.up || x.incarnation != inc) return;
          Trace("%s: connection closed, abort %s", x.engine_id.c_str(), id.c_str());
          Defer(x, [this, ei, id] { engines_[ei].sched->Abort(id, now_); });
        });
      }
      // A leg still travelling is cancelled on arrival (LegArrive checks the flow).
    } else if (auto* rh = std::get_if<proxy::ReleaseHold>(&a)) {
      Trace("proxy %d: release hold %s at %s", fid, rh->transfer_id.c_str(),
            rh->prefill.id.c_str());
      const int ei = EngineByName(rh->prefill.id);
      if (ei >= 0) SendControl(ei, ReleaseMsg{.transfer_id = rh->transfer_id}, 0, "proxy");
    } else if (auto* rs = std::get_if<proxy::Respond>(&a)) {
      Trace("proxy %d: respond %d %s", fid, rs->status, rs->body.substr(0, 160).c_str());
      CheckAnswer(f, rs->status, rs->body);
    } else if (std::get_if<proxy::EndStream>(&a)) {
      CheckAnswer(f, 200, "");
    }
  }
  if (!f.finished && f.flow->done()) {
    f.finished = true;
    Trace("proxy %d: flow done (%s)", fid,
          std::string(proxy::OutcomeName(f.flow->outcome())).c_str());
  }
}

void Sim::CheckAnswer(FlowState& f, int status, const std::string& body) {
  if (++f.responses > 1) {
    Violate(ViolationKind::kBadAnswer, "client " + std::to_string(f.id) + " answered twice");
    return;
  }
  if (status == 200) ++result_.answered_ok;
  if (k_.faults || f.client_aborted) return;
  if (status != 200) {
    Violate(ViolationKind::kBadAnswer, "client " + std::to_string(f.id) + " got " +
                                           std::to_string(status) +
                                           " in a fault-free run: " + body.substr(0, 300));
    return;
  }
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.contains("choices") || !j["choices"].is_array() ||
      static_cast<int>(j["choices"].size()) != f.n) {
    Violate(ViolationKind::kSiblingAccounting, "client " + std::to_string(f.id) +
                                                   " asked n=" + std::to_string(f.n) +
                                                   " and got: " + body.substr(0, 300));
  }
}

void Sim::LegArrive(int ei, int inc, LegRef ref, std::string body) {
  Engine& e = engines_[ei];
  if (!e.up) {
    LegError(ref, proxy::LegFailure::kUnreachable, "refused");
    return;
  }
  if (e.incarnation != inc) {
    LegError(ref, proxy::LegFailure::kBroken, "connection reset");
    return;
  }
  json j = json::parse(body, nullptr, false);
  auto bad = [&](const std::string& why) {
    json err = {{"error", {{"message", why}, {"type", "invalid_request_error"}}}};
    AnswerLeg(e, ref, 400, err.dump());
  };
  if (j.is_discarded() || !j.is_object() || !j.contains("prompt") || !j["prompt"].is_array()) {
    bad("bad body");
    return;
  }
  EngineRequest r;
  r.request_id =
      "r" + std::to_string(ei) + "." + std::to_string(inc) + "." + std::to_string(e.next_request++);
  r.prompt_token_ids = j["prompt"].get<std::vector<int32_t>>();
  r.sampling.n = j.value("n", 1);
  r.sampling.max_tokens = j.value("max_tokens", 16);
  r.sampling.temperature = j.value("temperature", 1.0f);
  if (j.contains("kv_transfer_params")) {
    auto p = ParseKvTransferParams(j["kv_transfer_params"], {.block_size = k_.block_size});
    if (!p.ok()) {
      bad(p.status().ToString());
      return;
    }
    if (p->do_remote_decode != e.prefill) {
      bad("kv_transfer_params do not fit this engine's role");
      return;
    }
    r.kv_transfer_params = KvTransferParamsToJson(*p);
  }
  Status v = e.sched->ValidateRequest(r);
  if (!v.ok()) {
    bad(v.ToString());
    return;
  }
  Trace("%s: accepts %s for client %d leg %d (n=%d, %zu prompt tokens)", e.engine_id.c_str(),
        r.request_id.c_str(), ref.flow, ref.leg, r.sampling.n, r.prompt_token_ids.size());
  const std::string id = r.request_id;
  e.leg_of[id] = ref;
  e.req_of[ref] = id;
  e.accum[id].n = r.sampling.n;
  Defer(e, [this, ei, id, r = std::move(r)]() mutable {
    Engine& x = engines_[ei];
    Status st = x.sched->AddRequest(std::move(r), now_);
    if (!st.ok()) {
      auto it = x.leg_of.find(id);
      if (it == x.leg_of.end()) return;
      const LegRef lr = it->second;
      x.leg_of.erase(it);
      x.req_of.erase(lr);
      x.accum.erase(id);
      AnswerLeg(x, lr, 400, json({{"error", {{"message", st.ToString()}}}}).dump());
    }
  });
  // A cancel that raced ahead of the leg: the connection is already closed.
  const FlowState& f = flows_[ref.flow];
  for (const proxy::LegRecord& rec : f.flow->legs()) {
    if (rec.leg_id == ref.leg && rec.cancelled) {
      Defer(e, [this, ei, id] { engines_[ei].sched->Abort(id, now_); });
    }
  }
}

void Sim::AnswerLeg(Engine& e, LegRef ref, int status, std::string body) {
  Trace("%s: answers client %d leg %d: %d", e.engine_id.c_str(), ref.flow, ref.leg, status);
  At(now_ + Uniform(k_.http_delay_lo, k_.http_delay_hi),
     [this, ref, status, body = std::move(body)] {
       FlowState& f = flows_[ref.flow];
       std::vector<proxy::Action> acts =
           f.flow->OnLegStatus(ref.leg, status, "application/json", now_);
       auto more = f.flow->OnLegData(ref.leg, body, now_);
       acts.insert(acts.end(), more.begin(), more.end());
       more = f.flow->OnLegDone(ref.leg, now_);
       acts.insert(acts.end(), more.begin(), more.end());
       Exec(ref.flow, std::move(acts));
     });
}

void Sim::LegError(LegRef ref, proxy::LegFailure failure, const std::string& why) {
  FlowState& f = flows_[ref.flow];
  Trace("proxy %d: leg %d error (%s)", ref.flow, ref.leg, why.c_str());
  Exec(ref.flow, f.flow->OnLegError(ref.leg, failure, UnavailableError(why), now_));
}

// ------------------------------------------------------------------------------------------
// Control network

void Sim::SendFromEngine(int engine, const SendMessageAction& a) {
  const Engine& e = engines_[engine];
  if (a.reply_token != 0) {
    auto it = reply_routes_.find(a.reply_token);
    if (it == reply_routes_.end()) return;
    const int to = it->second;
    reply_routes_.erase(it);
    SendControl(to, a.msg, 0, e.engine_id);
    return;
  }
  if (std::holds_alternative<HoldReplyMsg>(a.msg)) return;  // a reply without a path: dropped
  const int to = a.to.port - kPortBase;
  if (to < 0 || to >= static_cast<int>(engines_.size())) {
    Violate(ViolationKind::kCrash,
            e.engine_id + " sends to unknown port " + std::to_string(a.to.port));
    return;
  }
  if (auto* wb = std::get_if<WriteBlocksMsg>(&a.msg)) {
    // The decode offers these blocks to a prefill rank: from now on a write may land in them.
    const TargetKey key{engine, e.incarnation, wb->transfer_id, wb->decode_rank, wb->prefill_rank};
    if (!targets_.count(key)) {
      targets_[key].blocks = wb->block_ids;
      open_targets_.insert(key);
    }
  }
  // A ReadDone that wants a reply carries its sender as the reply path.
  uint64_t route = 0;
  if (auto* rd = std::get_if<ReadDoneMsg>(&a.msg); rd != nullptr && rd->want_reply) {
    route = static_cast<uint64_t>(engine) + 1;
  }
  SendControl(to, a.msg, route, e.engine_id);
}

void Sim::SendControl(int to_engine, const ControlMessage& msg, uint64_t route,
                      const std::string& from) {
  const std::string wire = EncodeMessage(msg);
  int copies = 1;
  if (k_.faults) {
    if (Chance(k_.msg_loss)) {
      Trace("net: LOST %s -> %s: %s", from.c_str(), engines_[to_engine].name.c_str(), wire.c_str());
      return;
    }
    if (Chance(k_.msg_dup)) copies = 2;
  }
  Trace("net: %s -> %s%s: %s", from.c_str(), engines_[to_engine].name.c_str(),
        copies > 1 ? " (duplicated)" : "", wire.c_str());
  for (int c = 0; c < copies; ++c) {
    DurationUs d = Uniform(k_.msg_delay_lo, k_.msg_delay_hi);
    if (Chance(k_.msg_tail)) d += Uniform(0, k_.msg_tail_hi);
    const int reply_to = route == 0 ? -1 : static_cast<int>(route - 1);
    At(now_ + d, [this, to_engine, wire, reply_to] { Deliver(to_engine, wire, reply_to); });
  }
}

void Sim::Deliver(int to_engine, const std::string& wire, int reply_to) {
  Engine& e = engines_[to_engine];
  if (!e.up) {
    Trace("net: %s is down, dropped %s", e.name.c_str(), wire.c_str());
    return;
  }
  Result<ControlMessage> m = DecodeMessage(wire);
  if (!m.ok()) {
    Violate(ViolationKind::kCrash, "undecodable control message: " + m.status().ToString());
    return;
  }
  if (auto* wd = std::get_if<WriteDoneMsg>(&*m);
      wd != nullptr && wd->decode_engine_id == e.engine_id) {
    // The prefill rank says its writes for the pair ended: nothing of them may land any more.
    auto t = targets_.find(
        {to_engine, e.incarnation, wd->transfer_id, wd->decode_rank, wd->prefill_rank});
    if (t != targets_.end()) {
      t->second.drained = true;  // (done_ok is set when the decode core takes it)
      open_targets_.erase(t->first);
    }
  }
  uint64_t token = 0;
  if (reply_to >= 0) {
    token = next_token_++;
    reply_routes_[token] = reply_to;
  }
  e.conn->Push(InMsg{std::move(*m), token});
  Wake(to_engine);
}

void Sim::InjectJunk() {
  // Late, unknown and misaddressed messages from nowhere: must change nothing.
  const int to = static_cast<int>(Uniform(0, static_cast<int64_t>(engines_.size()) - 1));
  std::string tid = minted_.empty() || Chance(0.5)
                        ? "junk-" + std::to_string(Uniform(0, 1 << 20))
                        : minted_[Uniform(0, static_cast<int64_t>(minted_.size()) - 1)];
  // Stale incarnation ids for real transfers; any id for unknown ones.
  const std::string stale = engines_[to].name + "-i0";
  ControlMessage msg;
  switch (Uniform(0, 3)) {
    case 0:
      msg = ReadDoneMsg{.transfer_id = tid,
                        .prefill_engine_id = stale,
                        .decode_engine_id = "ghost",
                        .outcome = ReadOutcome::kOk,
                        .want_reply = Chance(0.5)};
      break;
    case 1:
      msg = HoldReplyMsg{.transfer_id = tid,
                         .prefill_engine_id = stale,
                         .decode_engine_id = "ghost",
                         .hold_valid = true};
      break;
    case 2:
      msg =
          HeartbeatMsg{.transfer_id = tid, .prefill_engine_id = stale, .decode_engine_id = "ghost"};
      break;
    default:
      msg = ReleaseMsg{.transfer_id = tid, .prefill_engine_id = stale};
  }
  Trace("junk -> %s", engines_[to].name.c_str());
  SendControl(to, msg, 0, "junk");
}

}  // namespace kvbridge::sim::internal
