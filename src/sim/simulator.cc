// The deterministic P/D simulator (include/kvbridge/sim/simulator.h, docs/sim.md).
//
// Layout of this file:
//   Knobs        every seeded choice of a run (topology, workload, fault rates)
//   SimConnector the KvConnector around the runtime's own ConnectorLogic (the hook mapping and
//                the real cores, connector_logic.h) with the simulator as its sink, plus a ledger
//   Sim          the event loop: engines (real Scheduler + BlockPool), proxy flows (real PdFlow),
//                HTTP legs, control network, transfer layer, crashes, client aborts, invariants
#include "kvbridge/sim/simulator.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "kvbridge/connector/connector_logic.h"
#include "kvbridge/connector/decode_core.h"
#include "kvbridge/connector/kv_transfer_config.h"
#include "kvbridge/connector/messages.h"
#include "kvbridge/connector/prefill_core.h"
#include "kvbridge/connector/tp_plan.h"
#include "kvbridge/connector/write_decode_core.h"
#include "kvbridge/connector/write_prefill_core.h"
#include "kvbridge/engine/block_pool.h"
#include "kvbridge/engine/kv_connector.h"
#include "kvbridge/engine/scheduler.h"
#include "kvbridge/proxy/flow.h"

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
  }
  return "unknown";
}

namespace {
constexpr std::pair<Workload, std::string_view> kWorkloadNames[] = {
    {Workload::kMixed, "mixed"},          {Workload::kClean, "clean"},
    {Workload::kFaults, "faults"},        {Workload::kPrefillN, "prefill-n"},
    {Workload::kEarlyRace, "early-race"}, {Workload::kLeaseRead, "lease-read"},
    {Workload::kAbortLoad, "abort-load"},
};
}  // namespace

std::string_view WorkloadName(Workload w) {
  for (const auto& [k, name] : kWorkloadNames) {
    if (k == w) return name;
  }
  return "unknown";
}

Result<Workload> ParseWorkload(std::string_view name) {
  for (const auto& [k, n] : kWorkloadNames) {
    if (n == name) return k;
  }
  return InvalidArgumentError("unknown workload '" + std::string(name) +
                              "' (mixed|clean|faults|prefill-n|early-race|lease-read|abort-load)");
}

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

namespace {

using json = nlohmann::json;

constexpr int kVocab = 32;
constexpr int32_t kEos = 0;
constexpr int kPortBase = 1000;
const char kFingerprint[] = "sim-model-fingerprint";

// ------------------------------------------------------------------------------------------
// Knobs: every seeded choice of one run.
struct Knobs {
  bool faults = false;
  int num_prefill = 1;
  int num_decode = 1;
  int block_size = 4;
  std::vector<bool> prefix_caching;  // per engine (prefills first)
  int64_t prefill_blocks = 128;
  int64_t decode_blocks = 256;
  int max_batched_tokens = 64;
  bool prefill_forward_n = false;
  int num_requests = 8;
  DurationUs arrival_window = 300 * kMillisecond;
  double abort_prob = 0.15;
  DurationUs abort_window = 30 * kMillisecond;
  // Control network and HTTP.
  DurationUs msg_delay_lo = 50, msg_delay_hi = 1000;
  double msg_loss = 0, msg_dup = 0, msg_tail = 0;
  DurationUs msg_tail_hi = 0;
  DurationUs http_delay_lo = 100, http_delay_hi = 2000;
  // Transfers.
  double read_fail = 0, read_slow = 0;
  DurationUs read_slow_lo = 0, read_slow_hi = 0;
  // Connector timing.
  DurationUs lease = 10 * kSecond;
  DurationUs reply_timeout = 2 * kSecond;
  DurationUs read_timeout = 8 * kSecond;
  // Crashes and junk.
  int crashes = 0;
  int junk = 0;
  DurationUs hang_bound = 120 * kSecond;
  // Tensor parallelism: every prefill engine has prefill_tp ranks, every decode decode_tp; the
  // decode reads (and notifies) per (decode rank, prefill rank) pair of the TP plan.
  int prefill_tp = 1;
  int decode_tp = 1;
  int num_kv_heads = 1;
  // WRITE mode: the prefill pushes each layer's KV as the (stand-in) forward pass computes it;
  // WRITEs fail and run slow at the READ rates.
  bool write_mode = false;
  int num_layers = 1;
};

// ------------------------------------------------------------------------------------------
class Sim;

struct InMsg {
  ControlMessage msg;
  uint64_t reply_token = 0;
};
struct InReadEnded {
  uint64_t read_id = 0;
  Status status;
};
struct InWriteEnded {
  uint64_t write_id = 0;
  Status status;
};
using InEvent = std::variant<InMsg, InReadEnded, InWriteEnded>;

// The connector settings the knobs stand for (the rest at KvTransferConfig's defaults; the
// heartbeat is lease / 4). The mode is the run's: a release no core knows yet goes to its cores.
KvTransferConfig SimTransferConfig(const Knobs& k) {
  KvTransferConfig c;
  c.lease = k.lease;
  c.reply_timeout = k.reply_timeout;
  c.read_timeout = k.read_timeout;
  c.mode = k.write_mode ? KvTransferMode::kWrite : KvTransferMode::kRead;
  return c;
}

// The engine-side connector: the runtime's own ConnectorLogic (connector_logic.h: the hook
// mapping and the four cores) behind the engine's KvConnector hooks, with the simulator as its
// sink (fake transfers and network). It also keeps a ledger of what the engine holds, drains and
// loads, to check that every report names a request in the right state, exactly once.
class SimConnector final : public KvConnector, private ConnectorSink {
 public:
  SimConnector(Sim* sim, int engine, const std::string& engine_id, int port, const Knobs& k)
      : sim_(sim),
        engine_(engine),
        engine_id_(engine_id),
        port_(port),
        logic_(SimTransferConfig(k),
               {.engine_id = engine_id,
                .tp_size = engine < k.num_prefill ? k.prefill_tp : k.decode_tp,
                .num_kv_heads = k.num_kv_heads,
                .block_size = k.block_size,
                .num_layers = k.num_layers},
               this) {}

  Result<Match> GetNumNewMatchedTokens(const ConnectorRequestInfo& req, int num_local_computed,
                                       TimePoint now) override {
    return logic_.GetNumNewMatchedTokens(req, num_local_computed, now);
  }
  void UpdateStateAfterAlloc(const ConnectorRequestInfo& req, std::span<const int32_t> block_ids,
                             int num_local_computed, int num_external, TimePoint now) override {
    logic_.UpdateStateAfterAlloc(req, block_ids, num_local_computed, num_external, now);
  }
  FinishDecision RequestFinished(const ConnectorRequestInfo& req,
                                 std::span<const int32_t> block_ids, std::string_view finish_reason,
                                 TimePoint now) override {
    return logic_.RequestFinished(req, block_ids, finish_reason, now);
  }
  bool RequestAborted(const ConnectorRequestInfo& req, TimePoint now) override;
  void RequestQueued(const ConnectorRequestInfo& req, TimePoint now) override {
    logic_.RequestQueued(req, now);
  }
  StepReport Poll(TimePoint now) override;
  void OnLayerKvWritten(int layer, std::span<const LayerKvChunk> chunks, TimePoint now) override {
    // What arrived during the forward pass is taken first, as the runtime does.
    if (!logic_.WantsLayers()) return;
    HandleInbox(now);
    logic_.OnLayerKvWritten(layer, chunks, now);
  }
  std::optional<TimePoint> NextDeadline() const override { return logic_.NextDeadline(); }
  bool Idle() const override { return logic_.Idle() && inbox_.empty(); }

  void Push(InEvent e) { inbox_.push_back(std::move(e)); }
  const PrefillCore& prefill() const { return logic_.cores().prefill; }
  const DecodeCore& decode() const { return logic_.cores().decode; }
  const WritePrefillCore& wprefill() const { return logic_.cores().wprefill; }
  const WriteDecodeCore& wdecode() const { return logic_.cores().wdecode; }
  size_t num_ledger_held() const { return held_.size(); }
  size_t num_ledger_held_read() const {
    size_t n = 0;
    for (const auto& [id, h] : held_) n += h.write ? 0 : 1;
    return n;
  }
  size_t num_ledger_draining() const { return draining_.size(); }
  size_t num_ledger_loading() const { return loading_.size(); }
  size_t num_write_decodes() const { return logic_.NumAwaitingAlloc(); }
  size_t inbox_size() const { return inbox_.size(); }
  int64_t lease_expired() const {
    return prefill().counters().lease_expired + wprefill().counters().lease_expired;
  }
  int64_t notifications_ignored() const {
    return prefill().counters().notifications_ignored + decode().counters().notifications_ignored +
           wprefill().counters().notifications_ignored + wdecode().counters().notifications_ignored;
  }

 private:
  void HandleInbox(TimePoint now);

  // ConnectorSink: the simulator performs the transfers and carries the messages.
  Status PostTransfer(const TransferAction& t) override;
  Status CancelTransfer(KvTransferMode op, uint64_t id) override;
  void Send(const SendMessageAction& a) override;
  void OnReport(const ConnectorLogic::Report& r) override;
  void Note(const RequestNote& n) override;
  std::pair<std::string, int> AdvertisedEndpoint() const override { return {"sim", port_}; }

  Sim* sim_;
  int engine_;
  std::string engine_id_;
  int port_;
  ConnectorLogic logic_;  // the runtime's hook mapping and cores
  std::vector<InEvent> inbox_;
  struct Held {
    std::string transfer_id;
    bool write = false;
  };
  std::map<std::string, Held> held_;             // finished, blocks held for a transfer
  std::set<std::string> draining_;               // aborted, blocks kept until a report
  std::set<std::string> loading_;                // waiting for remote KV
  std::map<std::string, std::string> load_tid_;  // loading request -> transfer_id
  std::set<std::string> released_;               // READ transfers the proxy released here
  int64_t leases_before_poll_ = 0;               // PrefillCore's lease expiries when Poll began
};

// ------------------------------------------------------------------------------------------
struct LegRef {
  int flow = -1;
  int leg = 0;
  friend bool operator<(const LegRef& a, const LegRef& b) {
    return std::tie(a.flow, a.leg) < std::tie(b.flow, b.leg);
  }
};

struct Engine {
  int index = 0;
  bool prefill = true;
  bool up = true;
  int incarnation = 1;
  std::string engine_id;
  std::string name;  // "p0", "d1": the proxy's instance id
  int port = 0;
  bool prefix_caching = true;
  std::unique_ptr<BlockPool> pool;
  std::unique_ptr<SimConnector> conn;
  std::unique_ptr<Scheduler> sched;
  bool in_step = false;
  bool step_scheduled = false;
  uint64_t step = 0;  // the running step's id (layer events of WRITE mode check it)
  TimePoint timer_at = -1;
  ScheduledBatch batch;
  std::vector<std::function<void()>> deferred;  // scheduler calls held back during a step
  std::map<std::string, LegRef> leg_of;         // engine request id -> leg (until answered)
  std::map<LegRef, std::string> req_of;
  struct Accum {
    int n = 1;
    std::map<int, std::vector<int32_t>> tokens;
    std::map<int, std::string> finish;
  };
  std::map<std::string, Accum> accum;
  int64_t next_request = 0;
};

struct FlowState {
  int id = 0;
  std::unique_ptr<proxy::PdFlow> flow;
  TimePoint arrival = 0;
  int n = 1;
  bool client_aborted = false;
  int responses = 0;
  bool finished = false;  // flow.done() seen
};

struct Read {
  int dst = 0;
  int dst_inc = 0;
  uint64_t read_id = 0;
  std::string request_id;
  std::string transfer_id;
  int decode_rank = 0;
  int prefill_rank = 0;
  int src = -1;
  int src_inc = 0;
  std::vector<int32_t> src_blocks, dst_blocks;
  bool tainted = false;
  bool cancelled = false;
  Status status;  // how it will end
  TimePoint end_at = 0;
  uint64_t version = 0;
};

// WRITE mode: one WRITE in flight (a prefill rank into a decode rank's blocks, one layer or all).
struct Write {
  int src = 0;
  int src_inc = 0;
  uint64_t write_id = 0;
  int dst = -1;
  int dst_inc = 0;
  std::string transfer_id;
  int decode_rank = 0;
  int prefill_rank = 0;
  int layer = -1;
  std::vector<int32_t> src_blocks, dst_blocks;
  std::optional<WriteDoneMsg> notification;
  bool started = false;  // reached the decode's memory (false: no such peer, nothing lands)
  bool tainted = false;  // its source blocks lost their hold during the write
  bool cancelled = false;
  Status status;
  TimePoint end_at = 0;
  uint64_t version = 0;
};

// WRITE mode: what one (decode engine incarnation, transfer, decode rank, prefill rank) pair
// offered in its WriteBlocks, and what happened to those blocks since. Block "generations": a
// destination block seen free (ref 0, hold 0) after the offer may have a new owner, so any
// write landing in it later is corruption.
struct WriteTarget {
  std::vector<int32_t> blocks;              // the decode blocks offered
  std::set<int32_t> freed;                  // offered blocks seen free since the offer
  std::map<int, std::set<int32_t>> landed;  // layer (-1: all) -> blocks landed ok
  bool done_ok = false;                     // the decode core took a WriteDone(ok) for the pair
  bool drained = false;  // a WriteDone (any outcome) reached the decode: nothing may land now
  bool tainted = false;  // a write of it read source blocks that were not held throughout
};
using TargetKey = std::tuple<int, int, std::string, int, int>;  // dst, inc, tid, drank, prank

class Sim {
 public:
  Sim(uint64_t seed, const SimOptions& opts) : seed_(seed), opts_(opts), rng_(seed) {}

  SimResult Run();

  // Used by SimConnector.
  void Violate(ViolationKind kind, const std::string& message);
  void PostRead(int engine, const PostTransferAction& a);
  void DrawTpKnobs();
  void CancelRead(int engine, uint64_t read_id);
  void PostWrite(int engine, const PostTransferAction& a);
  void CancelWrite(int engine, uint64_t write_id);
  void CheckWriteLoad(int engine, const std::string& request_id, const std::string& transfer_id);
  void CheckReadsAtPrefillFree(int engine, const std::string& transfer_id, bool excused);
  void OnWriteDoneTaken(int engine, const WriteDoneMsg& msg) {
    auto t = targets_.find(
        {engine, engines_[engine].incarnation, msg.transfer_id, msg.decode_rank, msg.prefill_rank});
    if (t != targets_.end() && msg.outcome == WriteOutcome::kOk &&
        msg.decode_engine_id == engines_[engine].engine_id) {
      t->second.done_ok = true;
    }
  }
  void OnReadDoneTaken(int engine, const ReadDoneMsg& msg) {
    pending_pairs_.erase({engine, engines_[engine].incarnation, msg.transfer_id,
                          msg.decode_engine_id, msg.decode_rank, msg.prefill_rank});
  }
  void SendFromEngine(int engine, const SendMessageAction& a);
  void CheckLoadTaint(int engine, const std::string& request_id);
  void OnLoadFailed(int engine, const std::string& request_id, const Status& status);
  void Trace(const char* fmt, ...) __attribute__((format(printf, 2, 3)));
  bool tracing() const { return opts_.trace; }
  TimePoint now() const { return now_; }

 private:
  // Randomness.
  int64_t Uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  bool Chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  void DrawKnobs();
  void DrawModeKnobs();
  void At(TimePoint t, std::function<void()> fn) {
    events_.emplace(std::make_pair(std::max(t, now_), next_seq_++), std::move(fn));
  }

  // Engines.
  void StartEngine(Engine& e);
  void CrashEngine(int ei);
  void Wake(int ei);
  void EngineStep(int ei, int inc);
  void StepDone(int ei, int inc);
  void DrainOutputs(Engine& e);
  void ArmTimer(Engine& e);
  void Defer(Engine& e, std::function<void()> fn) {
    e.deferred.push_back(std::move(fn));
    Wake(e.index);
  }
  int EngineByName(const std::string& name) const;

  // HTTP legs and flows.
  void StartFlow(int fid);
  void Exec(int fid, std::vector<proxy::Action> actions);
  void LegArrive(int ei, int inc, LegRef ref, std::string body);
  void AnswerLeg(Engine& e, LegRef ref, int status, std::string body);
  void LegError(LegRef ref, proxy::LegFailure f, const std::string& why);
  void CheckAnswer(FlowState& f, int status, const std::string& body);

  // Control network.
  void SendControl(int to_engine, const ControlMessage& msg, uint64_t reply_token_route,
                   const std::string& from);
  void Deliver(int to_engine, const std::string& wire, int reply_to);
  void InjectJunk();

  // Transfers.
  // A transfer's failure knobs: fails (Unavailable, at a random point of `dur`) or runs slow.
  void DrawTransferFault(Status& status, DurationUs& dur);
  // Cancels the in-flight READ or WRITE `t` (false: it already was). The chunk on the wire still
  // lands: it ends within 2 ms, with Cancelled(`why`) unless it would have ended sooner anyway;
  // its end moves there (`end(version)`: the event scheduled before is stale now).
  template <typename Transfer, typename End>
  bool CancelInFlight(Transfer& t, const char* why, End end);
  void EndRead(uint64_t key, uint64_t version);
  void EndWrite(uint64_t key, uint64_t version);
  void LayerDone(int ei, int inc, uint64_t step, int layer);
  void ObserveWriteTargets(int ei);

  // Invariants.
  void CheckAll();
  void CheckReadTargets(int ei);
  void CheckQuiescence();
  int64_t SumLeaseExpired() const;
  int64_t SumIgnored() const;

  uint64_t seed_;
  SimOptions opts_;
  std::mt19937_64 rng_;
  Knobs k_;
  TimePoint now_ = 0;
  uint64_t next_seq_ = 0;
  std::map<std::pair<TimePoint, uint64_t>, std::function<void()>> events_;
  std::vector<Engine> engines_;
  std::vector<FlowState> flows_;
  std::map<uint64_t, Read> reads_;
  std::map<std::tuple<int, int, uint64_t>, uint64_t> read_key_;  // (dst, inc, read_id) -> key
  std::map<uint64_t, Write> writes_;
  std::map<std::tuple<int, int, uint64_t>, uint64_t> write_key_;  // (src, inc, write_id) -> key
  std::map<TargetKey, WriteTarget> targets_;
  std::set<TargetKey> open_targets_;
  // READ pairs posted whose read_done has not reached the prefill yet: (prefill engine, its
  // incarnation, transfer, decode engine id, decode rank, prefill rank).
  std::set<std::tuple<int, int, std::string, std::string, int, int>>
      pending_pairs_;  // offered, no WriteDone yet: their blocks are watched
  uint64_t next_step_ = 1;
  std::set<std::tuple<int, int, std::string>> tainted_loads_;
  std::map<uint64_t, int> reply_routes_;  // reply token -> decode engine
  uint64_t next_read_key_ = 1;
  uint64_t next_token_ = 1;
  std::vector<std::string> minted_;
  // Counters of crashed incarnations (their cores are gone).
  int64_t dead_lease_expired_ = 0, dead_ignored_ = 0, dead_load_failures_ = 0;
  SimResult result_;
  std::string trace_;
};

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

void SimConnector::HandleInbox(TimePoint now) {
  std::vector<InEvent> in;
  in.swap(inbox_);
  for (InEvent& e : in) {
    if (auto* r = std::get_if<InReadEnded>(&e)) {
      logic_.OnTransferEnded(KvTransferMode::kRead, r->read_id, r->status, now);
    } else if (auto* w = std::get_if<InWriteEnded>(&e)) {
      logic_.OnTransferEnded(KvTransferMode::kWrite, w->write_id, w->status, now);
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
  leases_before_poll_ = prefill().counters().lease_expired;
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
          released_.count(tid) > 0 || prefill().counters().lease_expired > leases_before_poll_;
      sim_->CheckReadsAtPrefillFree(engine_, tid, excused);
    }
  }
}

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

void Sim::DrawKnobs() {
  Workload w = opts_.workload;
  switch (w) {
    case Workload::kMixed:
      k_.faults = seed_ % 2 == 1;
      break;
    case Workload::kFaults:
    case Workload::kLeaseRead:
      k_.faults = true;
      break;
    default:
      k_.faults = false;
  }
  k_.num_prefill = static_cast<int>(Uniform(1, 3));
  k_.num_decode = static_cast<int>(Uniform(1, 3));
  const int sizes[] = {1, 2, 4, 16};
  k_.block_size = sizes[Uniform(1, 3)];  // 2, 4 or 16
  for (int i = 0; i < k_.num_prefill + k_.num_decode; ++i) {
    k_.prefix_caching.push_back(opts_.prefix_caching ? *opts_.prefix_caching : Chance(0.6));
  }
  k_.prefill_blocks = 64 * 16 / k_.block_size + Uniform(0, 32);
  k_.decode_blocks = 160 * 16 / k_.block_size + Uniform(0, 64);
  k_.max_batched_tokens = static_cast<int>(Uniform(16, 256));
  k_.prefill_forward_n = w == Workload::kPrefillN ? true : Chance(0.3);
  k_.num_requests = opts_.num_requests ? *opts_.num_requests : static_cast<int>(Uniform(4, 24));
  k_.arrival_window = Uniform(1, 300) * kMillisecond;
  k_.abort_prob = Chance(0.5) ? 0.0 : 0.2;
  k_.abort_window = Uniform(1, 40) * kMillisecond;
  if (w == Workload::kEarlyRace) {
    k_.abort_prob = 0.6;
    k_.abort_window = 3 * kMillisecond;
    k_.http_delay_hi = 3000;
    k_.msg_delay_hi = 200;
  }
  if (w == Workload::kAbortLoad) {
    k_.abort_prob = 0.7;
    k_.abort_window = 20 * kMillisecond;
  }
  if (k_.faults) {
    k_.msg_loss = Uniform(0, 10) / 100.0;
    k_.msg_dup = Uniform(0, 10) / 100.0;
    k_.msg_tail = 0.05;
    k_.msg_tail_hi = 500 * kMillisecond;
    k_.read_fail = Uniform(0, 8) / 100.0;
    k_.read_slow = Uniform(0, 5) / 100.0;
    k_.lease = 2 * kSecond;
    k_.reply_timeout = 500 * kMillisecond;
    k_.read_timeout = 4 * kSecond;
    k_.read_slow_lo = 500 * kMillisecond;
    k_.read_slow_hi = 6 * kSecond;
    k_.crashes = static_cast<int>(Uniform(0, 2));
    k_.junk = static_cast<int>(Uniform(0, 6));
    k_.hang_bound = 900 * kSecond;
  }
  if (w == Workload::kLeaseRead) {
    k_.msg_loss = 0.6;
    k_.read_slow = 0.5;
    k_.read_fail = 0;
    k_.crashes = 0;
    k_.read_slow_lo = 2 * kSecond;
    k_.read_slow_hi = 3500 * kMillisecond;
    k_.reply_timeout = 2 * kSecond;
  }
  if (opts_.hang_bound > 0) k_.hang_bound = opts_.hang_bound;
  DrawTpKnobs();
  DrawModeKnobs();
}

void Sim::DrawModeKnobs() {
  // From a stream of its own, as DrawTpKnobs: the other knobs of a seed stay what they were.
  std::mt19937_64 mode_rng(seed_ ^ 0x7772'6974'656d'6f64ULL);
  const bool draw_write = mode_rng() % 2 == 1;
  k_.num_layers = 1 + static_cast<int>(mode_rng() % 4);
  if (opts_.mode) {
    k_.write_mode = *opts_.mode == KvTransferMode::kWrite;
  } else {
    k_.write_mode = draw_write && opts_.workload != Workload::kPrefillN;
  }
  if (k_.write_mode) k_.prefill_forward_n = false;  // a WRITE prefill leg has n = 1
}

void Sim::DrawTpKnobs() {
  // From a stream of its own, so every other knob of a seed is what it was before TP.
  std::mt19937_64 tp_rng(seed_ ^ 0x7470'72616e6b73ULL);
  auto pick = [&](std::initializer_list<int> v) {
    return *(v.begin() + static_cast<std::ptrdiff_t>(tp_rng() % v.size()));
  };
  if (tp_rng() % 2 == 1) {  // half the seeds run TP engines
    k_.prefill_tp = pick({1, 2, 4});
    k_.decode_tp = pick({1, 2, 4});
    k_.num_kv_heads = pick({1, 2, 4, 8});
  }
  if (opts_.prefill_tp) k_.prefill_tp = *opts_.prefill_tp;
  if (opts_.decode_tp) k_.decode_tp = *opts_.decode_tp;
  if (opts_.num_kv_heads) k_.num_kv_heads = *opts_.num_kv_heads;
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

// ------------------------------------------------------------------------------------------
// Proxy flows and HTTP legs

void Sim::StartFlow(int fid) {
  FlowState& f = flows_[fid];
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
  for (const FlowState& f : flows_) {
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

}  // namespace

SimResult RunSimulation(uint64_t seed, const SimOptions& options) {
  Sim sim(seed, options);
  return sim.Run();
}

}  // namespace kvbridge::sim
