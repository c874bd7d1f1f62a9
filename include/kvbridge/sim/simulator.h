// kvbridge/sim/simulator.h — deterministic simulation of P/D serving with fault injection.
//
// One run puts M prefill and N decode engines, a proxy and a client workload in one process on a
// virtual clock, and drives the REAL code: each engine is the real Scheduler + BlockPool
// (src/engine) with the real connector cores PrefillCore + DecodeCore (READ mode) and
// WritePrefillCore + WriteDecodeCore (WRITE mode, src/connector) behind a KvConnector adapter;
// each client request is driven by the real proxy PdFlow (src/proxy). Only the edges are
// simulated: the model step (seeded duration and logits, no forward pass; its layers end in
// order over the step), the KV transfer layer (READs and per-layer WRITEs of seeded duration,
// failure and partial progress), the control network
// (seeded delay, reordering, duplication, loss) and the HTTP legs, engine crashes and restarts
// (new incarnation) and client disconnects. Every choice comes from one std::mt19937_64 seeded
// with the run's seed: a run is a pure function of (seed, options) and replays exactly.
//
// After every event the simulator checks DESIGN.md's invariants (docs/sim.md lists them); the
// first violation ends the run and is reported with the seed.
//
//   kvbridge::sim::SimOptions opts;            // workload: mixed (faults on half the seeds)
//   opts.trace = true;                          // keep a readable event trace
//   kvbridge::sim::SimResult r = kvbridge::sim::RunSimulation(/*seed=*/42, opts);
//   if (!r.ok) std::printf("seed %llu: %s: %s\n%s", ..., ViolationKindName(r.violation).data(),
//                          r.message.c_str(), r.trace.c_str());
//
// `kvbridge sim --seed S [--seeds N] [--trace] [--workload mixed|clean|faults|...]` is the CLI.
//
// Thread-safety: RunSimulation is reentrant; concurrent runs share nothing (planted faults, a
// test-only build option, are per thread).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/kv_transfer_mode.h"
#include "kvbridge/common/status.h"

namespace kvbridge::sim {

/// The invariant a run broke (DESIGN.md "Invariants"; docs/sim.md has the exact checks).
enum class ViolationKind : uint8_t {
  kNone = 0,
  kLeak,                 ///< at quiescence: active/held blocks, a connector table or a read left
  kHang,                 ///< a client request not terminal within the bound, or no quiescence
  kEarlyFree,            ///< a block freed while an in-flight READ may still write into it
  kStaleKvUsed,          ///< a decode used KV read from blocks freed during the READ
  kExactlyOnce,          ///< a release/report for a request not held/loading, or twice
  kSiblingAccounting,    ///< connector holds vs engine holds disagree; wrong number of choices
  kPoolAccounting,       ///< BlockPool::CheckInvariants failed
  kLeaseExpired,         ///< a lease fired in a run without injected faults
  kNotificationIgnored,  ///< a notification was ignored in a run without injected faults
  kLoadFailed,           ///< a remote load failed in a run without injected faults
  kBadAnswer,            ///< a client got an error in a run without injected faults
  kCrash,                ///< an exception escaped the code under test
  /// WRITE: a write landed in a decode block that was freed (its owner may have changed) since
  /// the decode offered it in WriteBlocks, or after the decode was told the writes drained
  kWriteIntoReusedBlock,
  /// WRITE: a decode used its KV before every writing rank's write_done(ok) and every layer of
  /// every offered block landed
  kUsedBeforeWriteDone,
  /// Issue 21's release bounds: what a dead peer held bound here (READ holds it claimed, WRITE
  /// targets it wrote) is not released within 2 s of its death; a hold no decode claimed is not
  /// freed within the claim lease + 1 s (the proxy died between the legs)
  kPeerLossNotReleased,
};
/// "leak", "hang", "early_free", "stale_kv_used", "exactly_once", "sibling_accounting",
/// "pool_accounting", "lease_expired", "notification_ignored", "load_failed", "bad_answer",
/// "crash", "write_into_reused_block", "used_before_write_done", "peer_loss_not_released",
/// "none".
std::string_view ViolationKindName(ViolationKind kind);

/// What a run simulates. Fields left unset are drawn from the seed.
enum class Workload : uint8_t {
  kMixed = 0,  ///< faults on odd seeds, none on even seeds
  kClean,      ///< no injected faults (client aborts still happen: they are not faults)
  kFaults,     ///< injected faults on every seed
  kPrefillN,   ///< clean, prefill legs carry the client's n (prefill-side sibling sets)
  kEarlyRace,  ///< clean, many client aborts right after the request (release races the leg)
  kLeaseRead,  ///< faults: heavy message loss and slow READs (leases fire during READs)
  kAbortLoad,  ///< clean, client aborts while decodes load
  /// faults: 1-2 engine crashes (their peers told within 1 s), 1-3 false suspicions (a live
  /// peer reported lost by its heartbeats), the proxy dies on 30% of the seeds
  kPeerLoss,
};
std::string_view WorkloadName(Workload w);

/// How KV moves in a run (DESIGN.md): the decode READs (pull) or the prefill WRITEs (push).
/// Parses "mixed", "clean", "faults", "prefill-n", "early-race", "lease-read", "abort-load",
/// "peer-loss".
Result<Workload> ParseWorkload(std::string_view name);

struct SimOptions {
  Workload workload = Workload::kMixed;
  bool trace = false;                  ///< keep the event trace in SimResult::trace
  std::optional<int> num_requests;     ///< client requests (default: seeded in [4, 24])
  std::optional<bool> prefix_caching;  ///< default: seeded per engine
  DurationUs hang_bound = 0;       ///< per request, from its arrival (0: 120 s clean, 900 s faults)
  int64_t max_events = 2'000'000;  ///< a run past this many events is a hang
  /// Tensor parallelism (ranks per prefill / decode engine, the model's KV heads); unset: half
  /// the seeds draw them from {1, 2, 4} (heads from {1, 2, 4, 8}), the other half run TP 1.
  std::optional<int> prefill_tp;
  std::optional<int> decode_tp;
  std::optional<int> num_kv_heads;
  /// READ or WRITE for every engine and flow of the run; unset: half the seeds (a random stream
  /// of their own) run WRITE, except the prefill-n workload (always READ: a WRITE prefill leg
  /// has n = 1).
  std::optional<KvTransferMode> mode;
};

struct SimResult {
  uint64_t seed = 0;
  bool ok = true;
  bool faults = false;  ///< faults were injected in this run
  ViolationKind violation = ViolationKind::kNone;
  std::string message;  ///< what broke, with ids
  TimePoint at = 0;     ///< virtual time of the violation (or the end), microseconds
  int64_t events = 0;
  // What the run did (for the summary line and sanity checks in tests).
  int requests = 0;     ///< client requests
  int answered_ok = 0;  ///< answered 200
  int client_aborts = 0;
  KvTransferMode mode = KvTransferMode::kRead;
  int reads = 0;   ///< READs posted
  int writes = 0;  ///< WRITEs posted (WRITE mode)
  int crashes = 0;
  int lease_expired = 0;
  std::string trace;            ///< when SimOptions::trace
  std::string Summary() const;  ///< one line: seed, outcome, counts
};

/// Runs one seeded simulation to quiescence (or to the first violation).
SimResult RunSimulation(uint64_t seed, const SimOptions& options);

}  // namespace kvbridge::sim
