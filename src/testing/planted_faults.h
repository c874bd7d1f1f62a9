// testing/planted_faults.h — test-only switches that plant known P/D protocol bugs into the
// real connector cores, so the simulator's tests can prove that it finds them. Not a public
// header: it lives in src/testing (included as "testing/planted_faults.h"), outside include/.
//
// This header compiles to nothing unless KVBRIDGE_PLANTED_FAULTS is defined, and only the sim
// test targets define it (they build their own copy of the connector core,
// `kvbridge_connector_core_faults`, in src/sim/CMakeLists.txt). Production libraries and the
// `kvbridge` binary never see these switches, so they cannot be turned on outside tests.
//
//   #ifdef KVBRIDGE_PLANTED_FAULTS
//   kvbridge::sim::Planted().ignore_early_notifications = true;   // this thread only
//   #endif
//
// Each switch mirrors one of DESIGN.md's known failure modes; the hook sites are one-line
// `#ifdef KVBRIDGE_PLANTED_FAULTS` blocks in
// src/connector/{prefill,decode,write_prefill,write_decode}_core.cc and connector_logic.cc.
//
// Thread-safety: thread_local; each test thread sets its own.
#pragma once

#ifdef KVBRIDGE_PLANTED_FAULTS

namespace kvbridge::sim {

struct PlantedFaults {
  /// PrefillCore: a completion frees only one sibling of the transfer (a 1:1 transfer_id ->
  /// request map keeps only the last sibling; DESIGN.md pitfall 1).
  bool one_to_one_transfer_map = false;
  /// DecodeCore: ReadDone names the decode's local request id instead of the shared transfer_id
  /// (DESIGN.md pitfall 2).
  bool notify_with_local_request_id = false;
  /// PrefillCore: a transfer that ends frees siblings the engine has not finished (no gating on
  /// the engine's finished signal; DESIGN.md pitfall 3).
  bool release_without_finished_signal = false;
  /// PrefillCore: a message for a transfer not registered yet is dropped instead of parked.
  bool ignore_early_notifications = false;
  /// PrefillCore: a ReadDone arriving after the lease fired is answered "hold valid" (the decode
  /// then uses bytes read from blocks that were freed and possibly reused during the read).
  bool reuse_blocks_on_lease_during_read = false;
  /// DecodeCore: an abort during a load lets the engine free the destination blocks at once,
  /// while the READ may still land in them.
  bool free_decode_blocks_on_abort_during_load = false;
  /// DecodeCore (TP): only decode rank 0 notifies the prefill ranks it read from; the other
  /// decode ranks use their READ without a ReadDone (the prefill's hold is never released by
  /// them).
  bool only_decode_rank0_notifies = false;
  /// PrefillCore (TP): a transfer completes at its first (decode rank, prefill rank)
  /// notification instead of waiting for every pair of the TP plan.
  bool release_before_all_ranks_read = false;
  /// WriteDecodeCore (WRITE): an abort during a write lets the engine free the destination
  /// blocks at once (the writes are cancelled without asking for the drained confirmation, and
  /// a late WriteDone for the forgotten request is dropped silently), while a WRITE may still
  /// land in them.
  bool free_decode_blocks_on_abort_during_write = false;
  /// WritePrefillCore (WRITE): the last prefill rank (tp_size - 1; rank 0 without TP) never
  /// sends its WriteDone(ok) — its writes land, it frees its blocks, the decode never hears.
  bool prefill_rank_never_sends_write_done = false;
  /// WriteDecodeCore (WRITE, TP): the decode proceeds at the first pair's WriteDone(ok) instead
  /// of waiting for every (decode rank, prefill rank) pair of the TP plan.
  bool decode_proceeds_at_first_write_done = false;
  /// ConnectorLogic (the hook mapping, both modes): RequestFinished of a set's last sibling is
  /// not forwarded to the prefill cores — the engine frees that sibling's blocks at once and the
  /// transfer waits for a sibling the cores never hear finish.
  bool forget_last_finished_sibling = false;
  /// WriteDecodeCore (WRITE, issue 21): a prefill only suspected lost (its heartbeats stopped,
  /// PeerLoss::kSuspected) is treated as gone — the decode frees its WRITE targets at once,
  /// though the prefill may still be alive and writing into them.
  bool free_write_targets_on_suspected_loss = false;
};

/// This thread's switches (all off by default).
inline PlantedFaults& Planted() {
  static thread_local PlantedFaults faults;
  return faults;
}

}  // namespace kvbridge::sim

#endif  // KVBRIDGE_PLANTED_FAULTS
