// Proof that the simulator finds bugs: each planted fault (src/testing/planted_faults.h,
// compiled only into this test's copy of the connector core) must be reported as its matching
// invariant violation within a bounded number of seeds, and the failing seed must pass with the
// fault switched off.
#include "testing/planted_faults.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <set>
#include <string>

#include "kvbridge/common/logging.h"
#include "kvbridge/sim/simulator.h"

#ifndef KVBRIDGE_PLANTED_FAULTS
#error "this test needs the planted-fault build (kvbridge_sim_faults)"
#endif

namespace kvbridge::sim {
namespace {

const bool kQuiet = SetLogLevel("off");

struct Case {
  const char* name;
  std::function<void(PlantedFaults&)> plant;
  Workload workload;
  std::set<ViolationKind> expected;
  uint64_t max_seeds;
  KvTransferMode mode = KvTransferMode::kRead;
};

void ExpectFound(const Case& c) {
  SimOptions opts;
  opts.workload = c.workload;
  opts.mode = c.mode;
  Planted() = PlantedFaults{};
  c.plant(Planted());
  uint64_t found = 0;
  SimResult hit;
  for (uint64_t s = 1; s <= c.max_seeds && found == 0; ++s) {
    SimResult r = RunSimulation(s, opts);
    if (!r.ok) {
      found = s;
      hit = r;
    }
  }
  Planted() = PlantedFaults{};
  ASSERT_NE(found, 0u) << c.name << ": not found within " << c.max_seeds << " seeds";
  std::printf("[planted] %s: found at seed %llu: %s\n", c.name,
              static_cast<unsigned long long>(found), hit.Summary().c_str());
  EXPECT_TRUE(c.expected.count(hit.violation))
      << c.name << ": reported " << ViolationKindName(hit.violation) << ": " << hit.message;
  // The same seed with the fault switched off keeps every invariant: the fault caused it.
  SimResult clean = RunSimulation(found, opts);
  EXPECT_TRUE(clean.ok) << clean.Summary();
}

TEST(PlantedFaults, OneToOneTransferMapLeaksSiblings) {
  ExpectFound({"1:1 transfer map",
               [](PlantedFaults& p) { p.one_to_one_transfer_map = true; },
               Workload::kPrefillN,
               {ViolationKind::kLeak},
               200});
}

TEST(PlantedFaults, NotifyingWithTheLocalRequestIdFailsLoads) {
  ExpectFound({"notify with local request id",
               [](PlantedFaults& p) { p.notify_with_local_request_id = true; },
               Workload::kClean,
               {ViolationKind::kNotificationIgnored, ViolationKind::kLoadFailed},
               50});
}

TEST(PlantedFaults, ReleasingWithoutTheFinishedSignalBreaksExactlyOnce) {
  ExpectFound({"release without finished signal",
               [](PlantedFaults& p) { p.release_without_finished_signal = true; },
               Workload::kEarlyRace,
               {ViolationKind::kExactlyOnce},
               400});
}

TEST(PlantedFaults, IgnoringEarlyNotificationsLeavesHolds) {
  ExpectFound({"ignore early notifications",
               [](PlantedFaults& p) { p.ignore_early_notifications = true; },
               Workload::kEarlyRace,
               {ViolationKind::kNotificationIgnored, ViolationKind::kLeaseExpired},
               400});
}

TEST(PlantedFaults, ReusingBlocksWhenTheLeaseFiresDuringAReadUsesStaleKv) {
  ExpectFound({"reuse blocks on lease during read",
               [](PlantedFaults& p) { p.reuse_blocks_on_lease_during_read = true; },
               Workload::kLeaseRead,
               {ViolationKind::kStaleKvUsed},
               400});
}

TEST(PlantedFaults, FreeingDecodeBlocksOnAbortDuringALoadIsAnEarlyFree) {
  ExpectFound({"free decode blocks on abort during load",
               [](PlantedFaults& p) { p.free_decode_blocks_on_abort_during_load = true; },
               Workload::kAbortLoad,
               {ViolationKind::kEarlyFree, ViolationKind::kExactlyOnce},
               400});
}

// WRITE: the decode frees its reserved blocks at an abort without waiting for the prefill's
// drained confirmation; a WRITE still in flight lands in a block that was freed since the decode
// offered it — its owner may have changed.
TEST(PlantedFaults, FreeingDecodeBlocksOnAbortDuringAWriteIsAWriteIntoAReusedBlock) {
  ExpectFound({"free decode blocks on abort during write",
               [](PlantedFaults& p) { p.free_decode_blocks_on_abort_during_write = true; },
               Workload::kAbortLoad,
               {ViolationKind::kWriteIntoReusedBlock},
               400,
               KvTransferMode::kWrite});
}

// WRITE: a prefill rank's writes land but it never sends WriteDone(ok). The decode waits for it
// until its write timeout (the prefill's lease + a grace) and then fails the load: in a run
// without injected faults that safety net firing is the violation.
TEST(PlantedFaults, APrefillRankThatNeverSendsWriteDoneIsCaught) {
  ExpectFound({"prefill rank never sends write_done",
               [](PlantedFaults& p) { p.prefill_rank_never_sends_write_done = true; },
               Workload::kClean,
               {ViolationKind::kLoadFailed},
               50,
               KvTransferMode::kWrite});
}

// Issue 21, WRITE: a decode that treats a prefill only suspected lost (its heartbeats stopped;
// it is alive and writing) as gone frees its WRITE targets at once; the prefill's WRITEs then
// land in blocks the engine owns again.
TEST(PlantedFaults, FreeingWriteTargetsOnASuspectedPrefillIsCaught) {
  ExpectFound({"free WRITE targets on a suspected loss",
               [](PlantedFaults& p) { p.free_write_targets_on_suspected_loss = true; },
               Workload::kPeerLoss,
               {ViolationKind::kWriteIntoReusedBlock},
               300,
               KvTransferMode::kWrite});
}

// The hook mapping itself (ConnectorLogic, shared by the runtime and the simulator): a
// RequestFinished of a set's last sibling that never reaches the prefill cores. The engine frees
// that sibling's blocks at once while the transfer waits for it; before the simulator drove the
// runtime's mapping, a bug here was invisible to it.
TEST(PlantedFaults, AMappingThatForgetsAFinishedSiblingIsCaught) {
  ExpectFound({"mapping forgets the last finished sibling",
               [](PlantedFaults& p) { p.forget_last_finished_sibling = true; },
               Workload::kPrefillN,
               {ViolationKind::kLeak, ViolationKind::kSiblingAccounting},
               200});
}

}  // namespace
}  // namespace kvbridge::sim
