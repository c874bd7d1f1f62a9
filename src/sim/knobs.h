// sim/knobs.h — every seeded choice of one simulated run (topology, workload, fault rates) and the
// connector settings they stand for. Internal to src/sim (not installed): the simulator's parts
// share these declarations.
#pragma once

#include <cstdint>
#include <string>

#include "kvbridge/common/clock.h"
#include "kvbridge/connector/kv_transfer_config.h"
#include "kvbridge/sim/simulator.h"

namespace kvbridge::sim::internal {

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
  // Peer loss (issue 21): a crash is told to every live peer after a detection delay (kGone);
  // a suspicion tells one engine that a live peer is lost (kSuspected: it is not); the proxy
  // may die (its flows stop, its legs' connections close).
  DurationUs detect_lo = 20 * kMillisecond, detect_hi = 1000 * kMillisecond;
  int suspicions = 0;
  bool proxy_death = false;
  DurationUs claim_lease = 1 * kSecond;  // <= lease in every run
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

// The connector settings the knobs stand for (the rest at KvTransferConfig's defaults; the
// heartbeat is lease / 4). The mode is the run's: a release no core knows yet goes to its cores.
KvTransferConfig SimTransferConfig(const Knobs& k);

}  // namespace kvbridge::sim::internal
