// sim/sim.h — the simulator's state and event loop (class Sim), shared by its parts: knobs.cc (the
// draw), sim_connector.cc (the sink and ledger), network.cc (HTTP legs, proxy flows, control
// network), transfers.cc (fake READs and WRITEs), invariants.cc (the checks) and event_loop.cc
// (setup, engines, the run). Internal to src/sim (not installed): the simulator's parts share these
// declarations.
#pragma once

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
#include "sim/knobs.h"
#include "sim/sim_connector.h"

namespace kvbridge::sim::internal {

using json = nlohmann::json;

constexpr int kVocab = 32;
constexpr int32_t kEos = 0;
constexpr int kPortBase = 1000;
inline constexpr char kFingerprint[] = "sim-model-fingerprint";

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
  bool finished = false;    // flow.done() seen
  bool proxy_lost = false;  // the proxy died before the flow ended (its client got a reset)
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
  bool drained = false;   // a WriteDone (any outcome) reached the decode: nothing may land now
  bool tainted = false;   // a write of it read source blocks that were not held throughout
  bool reported = false;  // the decode reported its request: the blocks are the engine's again
};
using TargetKey = std::tuple<int, int, std::string, int, int>;  // dst, inc, tid, drank, prank

class Sim {
 public:
  Sim(uint64_t seed, const SimOptions& opts)
      : seed_(seed), opts_(opts), rng_(seed), loss_rng_(seed ^ 0x7065'6572'6c6f'7373ULL) {}

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
  // The decode reported WRITE request `transfer_id` (load done / failed, blocks free): nothing
  // of its pairs may land any more.
  void MarkTargetsReported(int engine, const std::string& transfer_id);
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
  void DrawLossKnobs();
  int64_t LossUniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(loss_rng_);
  }
  void At(TimePoint t, std::function<void()> fn) {
    events_.emplace(std::make_pair(std::max(t, now_), next_seq_++), std::move(fn));
  }

  // Engines.
  void StartEngine(Engine& e);
  void CrashEngine(int ei);
  // Peer loss (issue 21): engine `ei` (incarnation `inc`) is told that `lost` is lost.
  void DeliverPeerLost(int ei, int inc, const std::string& lost, PeerLoss loss);
  // 2 s after `lost` died: nothing bound to it may be left on a live engine.
  void CheckPeerReleased(const std::string& lost);
  // Tells an engine that a live peer it has work bound to is lost (a false suspicion).
  void SuspectPeer(int attempt);
  void KillProxy();
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
  std::mt19937_64 loss_rng_;  // peer-loss events (DrawLossKnobs)
  bool proxy_dead_ = false;
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

}  // namespace kvbridge::sim::internal
