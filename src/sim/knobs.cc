// The simulator's knobs: the seeded draw of a run's topology, workload and fault rates
// (sim/knobs.h).
#include "sim/sim.h"

namespace kvbridge::sim {

namespace {
constexpr std::pair<Workload, std::string_view> kWorkloadNames[] = {
    {Workload::kMixed, "mixed"},          {Workload::kClean, "clean"},
    {Workload::kFaults, "faults"},        {Workload::kPrefillN, "prefill-n"},
    {Workload::kEarlyRace, "early-race"}, {Workload::kLeaseRead, "lease-read"},
    {Workload::kAbortLoad, "abort-load"}, {Workload::kPeerLoss, "peer-loss"},
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
                              "' (mixed|clean|faults|prefill-n|early-race|lease-read|abort-load|"
                              "peer-loss)");
}

}  // namespace kvbridge::sim

namespace kvbridge::sim::internal {

// The connector settings the knobs stand for (the rest at KvTransferConfig's defaults; the
// heartbeat is lease / 4). The mode is the run's: a release no core knows yet goes to its cores.
KvTransferConfig SimTransferConfig(const Knobs& k) {
  KvTransferConfig c;
  c.lease = k.lease;
  c.claim_lease = k.claim_lease;
  c.reply_timeout = k.reply_timeout;
  c.read_timeout = k.read_timeout;
  c.mode = k.write_mode ? KvTransferMode::kWrite : KvTransferMode::kRead;
  return c;
}

void Sim::DrawKnobs() {
  Workload w = opts_.workload;
  switch (w) {
    case Workload::kMixed:
      k_.faults = seed_ % 2 == 1;
      break;
    case Workload::kFaults:
    case Workload::kLeaseRead:
    case Workload::kPeerLoss:
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
  DrawLossKnobs();
}

void Sim::DrawLossKnobs() {
  // Issue 21's events, from a stream of their own (loss_rng_, also used when they fire): every
  // other knob of a seed stays what it was.
  if (!k_.faults) return;
  if (opts_.workload == Workload::kPeerLoss) {
    k_.crashes = 1 + static_cast<int>(loss_rng_() % 2);
    k_.suspicions = 1 + static_cast<int>(loss_rng_() % 3);
    k_.proxy_death = loss_rng_() % 10 < 3;
  } else {
    k_.suspicions = static_cast<int>(loss_rng_() % 3);
    k_.proxy_death = loss_rng_() % 10 == 0;
  }
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

}  // namespace kvbridge::sim::internal
