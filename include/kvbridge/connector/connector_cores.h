// kvbridge/connector/connector_cores.h — the four sans-IO protocol cores of one engine (READ
// prefill, READ decode, WRITE prefill, WRITE decode; each covers every TP rank of the engine),
// built from one KvTransferConfig and driven together. ConnectorLogic (connector_logic.h) owns one
// and maps the engine's hooks onto it, for the runtime and the simulator alike: same options, same
// action order, same deadlines.
//
//   ConnectorCores cores(config, {.engine_id = "p0-1a2b", .tp_size = 2, .num_kv_heads = 8,
//                                 .block_size = 16, .num_layers = 32});
//   RETURN_IF_ERROR(cores.prefill.OnRequestAdded("cmpl-1", 1, "tid-1", now));
//   cores.OnTick(now);
//   for (ConnectorAction& a : cores.TakeActions()) Perform(a);
//
// Thread-safety: not thread-safe; one owner thread (the engine thread, or the simulator).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/connector/actions.h"
#include "kvbridge/connector/decode_core.h"
#include "kvbridge/connector/kv_transfer_config.h"
#include "kvbridge/connector/prefill_core.h"
#include "kvbridge/connector/write_decode_core.h"
#include "kvbridge/connector/write_prefill_core.h"

namespace kvbridge {

/// One engine's connector cores. The members are used directly for the per-core events.
struct ConnectorCores {
  /// What the cores need to know of the engine (the rest comes from the KvTransferConfig).
  struct Shape {
    std::string engine_id;  ///< this engine incarnation
    int rank = 0;           ///< this process's rank (the prefill cores serve all ranks anyway)
    int tp_size = 1;        ///< this engine's TP ranks, >= 1
    int num_kv_heads = 0;   ///< the model's global KV heads (0: they split evenly)
    int block_size = 16;    ///< tokens per KV block
    int num_layers = 1;     ///< the model's layers (a WRITE target is done after all of them)
  };

  /// Cores for `shape` with config's lease, timeouts, heartbeat (EffectiveHeartbeat), parked
  /// message bound and load-failure policy.
  ConnectorCores(const KvTransferConfig& config, const Shape& shape);

  /// The WRITE decode's bound on a WRITE: the prefill's lease plus a grace for message delays
  /// (max(2 s, lease / 4)).
  static DurationUs WriteTimeout(const KvTransferConfig& config);

  /// Every core's pending actions, in the order prefill, decode, wprefill, wdecode.
  std::vector<ConnectorAction> TakeActions();
  /// Timers of every core (leases, reply / read / write timeouts, heartbeats).
  void OnTick(TimePoint now);
  /// Tells every core (none is skipped); true when any keeps the request's blocks for now.
  bool OnRequestAborted(const std::string& request_id, TimePoint now);
  /// The peer engine incarnation `engine_id` is lost: tells every core (each acts on what is
  /// bound to it in its role; PeerLoss says what may still land). Returns the holds, requests
  /// and targets released or failed.
  int64_t OnPeerLost(const std::string& engine_id, PeerLoss loss, TimePoint now);
  /// Per-peer accounting: what is bound to `engine_id` now (READ holds it claimed + WRITE
  /// requests writing from it) and the blocks of them.
  std::pair<int64_t, int64_t> BoundTo(const std::string& engine_id) const;
  /// The earliest deadline of any core, or nullopt when none has one.
  std::optional<TimePoint> NextDeadline() const;
  /// True when no core has work in flight.
  bool Idle() const;

  PrefillCore prefill;
  DecodeCore decode;
  WritePrefillCore wprefill;  // WRITE mode, prefill side
  WriteDecodeCore wdecode;    // WRITE mode, decode side
};

}  // namespace kvbridge
