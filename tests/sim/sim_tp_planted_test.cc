// Proof that the simulator finds TP accounting bugs: each planted TP fault
// (include/kvbridge/sim/planted_faults.h) is reported as its matching invariant violation within
// a bounded number of seeds, and the same seed passes with the fault off.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <set>

#include "kvbridge/common/logging.h"
#include "kvbridge/sim/planted_faults.h"
#include "kvbridge/sim/simulator.h"

#ifndef KVBRIDGE_PLANTED_FAULTS
#error "this test needs the planted-fault build (kvbridge_sim_faults)"
#endif

namespace kvbridge::sim {
namespace {

const bool kQuiet = SetLogLevel("off");

void ExpectFound(const char* name, const std::function<void(PlantedFaults&)>& plant,
                 SimOptions opts, const std::set<ViolationKind>& expected, uint64_t max_seeds) {
  Planted() = PlantedFaults{};
  plant(Planted());
  uint64_t found = 0;
  SimResult hit;
  for (uint64_t s = 1; s <= max_seeds && found == 0; ++s) {
    SimResult r = RunSimulation(s, opts);
    if (!r.ok) {
      found = s;
      hit = r;
    }
  }
  Planted() = PlantedFaults{};
  ASSERT_NE(found, 0u) << name << ": not found within " << max_seeds << " seeds";
  std::printf("[planted] %s: found at seed %llu: %s\n", name,
              static_cast<unsigned long long>(found), hit.Summary().c_str());
  EXPECT_TRUE(expected.count(hit.violation))
      << name << ": reported " << ViolationKindName(hit.violation) << ": " << hit.message;
  SimResult clean = RunSimulation(found, opts);
  EXPECT_TRUE(clean.ok) << clean.Summary();
}

SimOptions Tp(int p, int d, int heads) {
  SimOptions o;
  o.workload = Workload::kClean;
  o.prefill_tp = p;
  o.decode_tp = d;
  o.num_kv_heads = heads;
  return o;
}

// Decode ranks other than 0 never notify: their prefill pairs stay unacknowledged, the hold is
// only freed by the lease — a leak that the fault-free run reports (lease fired / not drained).
TEST(PlantedTpFaults, MissingRankNotificationIsALeak) {
  ExpectFound(
      "only decode rank 0 notifies", [](PlantedFaults& p) { p.only_decode_rank0_notifies = true; },
      Tp(2, 2, 2), {ViolationKind::kLeak, ViolationKind::kLeaseExpired}, 50);
}

// The prefill frees at the first pair's notification while other decode ranks still read: the
// source blocks are freed under a running READ. The later pairs' ReadDone is answered "hold gone"
// (the hold-valid reply is what protects the decode from using those bytes), so a fault-free run
// reports the load failure; a decode that used the bytes anyway would be stale_kv_used.
TEST(PlantedTpFaults, ReleaseBeforeAllRanksReadIsCaught) {
  ExpectFound(
      "release before all ranks read",
      [](PlantedFaults& p) { p.release_before_all_ranks_read = true; }, Tp(2, 1, 2),
      {ViolationKind::kEarlyFree, ViolationKind::kStaleKvUsed, ViolationKind::kLoadFailed}, 50);
}

}  // namespace
}  // namespace kvbridge::sim
