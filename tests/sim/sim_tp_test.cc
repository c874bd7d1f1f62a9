// The simulator with tensor-parallel engines: for each (prefill TP, decode TP, KV heads) the
// decode reads and notifies per (decode rank, prefill rank) pair of the TP plan (tp_plan.h) and
// the prefill frees a transfer only after every pair notified. Clean and faulty seeds must keep
// every invariant (docs/sim.md) at every topology.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>

#include "kvbridge/common/logging.h"
#include "kvbridge/sim/simulator.h"

namespace kvbridge::sim {
namespace {

const bool kQuiet = SetLogLevel("off");

// (prefill TP, decode TP, KV heads)
using Topo = std::tuple<int, int, int>;

void RunTopology(Workload w, Topo t, uint64_t first, uint64_t count,
                 KvTransferMode mode = KvTransferMode::kRead) {
  SimOptions opts;
  opts.workload = w;
  opts.mode = mode;
  opts.prefill_tp = std::get<0>(t);
  opts.decode_tp = std::get<1>(t);
  opts.num_kv_heads = std::get<2>(t);
  uint64_t ran = 0, moved = 0, ok = 0;
  for (uint64_t s = first; s < first + count; ++s) {
    SimResult r = RunSimulation(s, opts);
    ++ran;
    moved += static_cast<uint64_t>(mode == KvTransferMode::kRead ? r.reads : r.writes);
    ok += static_cast<uint64_t>(r.answered_ok);
    ASSERT_TRUE(r.ok) << r.Summary() << "\n  topology p" << std::get<0>(t) << " d" << std::get<1>(t)
                      << " heads " << std::get<2>(t);
  }
  EXPECT_EQ(ran, count);  // a fixed set of seeds, however slow the machine
  EXPECT_GT(moved, 0u);
  EXPECT_GT(ok, 0u);
}

const Topo kTopologies[] = {{1, 1, 2}, {2, 2, 2}, {2, 1, 2}, {1, 2, 2}, {4, 2, 8},
                            {2, 4, 8}, {4, 1, 2}, {1, 4, 1}, {4, 4, 2}};

TEST(SimTp, CleanSeedsKeepEveryInvariantAtEveryTopology) {
  for (const Topo& t : kTopologies) RunTopology(Workload::kClean, t, 700001, 60);
}

TEST(SimTp, FaultSeedsKeepEveryInvariantAtEveryTopology) {
  for (const Topo& t : kTopologies) RunTopology(Workload::kFaults, t, 710001, 40);
}

TEST(SimTp, AbortsDuringLoadsAtEveryTopology) {
  for (const Topo& t : kTopologies) RunTopology(Workload::kAbortLoad, t, 720001, 30);
}

// WRITE: each prefill rank writes the decode ranks the TP plan pairs it with (replicated KV
// heads included: an unpaired prefill rank is told to skip).
TEST(SimTp, WriteCleanSeedsAtEveryTopology) {
  for (const Topo& t : kTopologies)
    RunTopology(Workload::kClean, t, 740001, 30, KvTransferMode::kWrite);
}

TEST(SimTp, WriteFaultSeedsAndAbortsAtEveryTopology) {
  for (const Topo& t : kTopologies) {
    RunTopology(Workload::kFaults, t, 750001, 20, KvTransferMode::kWrite);
    RunTopology(Workload::kAbortLoad, t, 760001, 20, KvTransferMode::kWrite);
  }
}

TEST(SimTp, RunsReplayExactly) {
  SimOptions opts;
  opts.workload = Workload::kFaults;
  opts.prefill_tp = 2;
  opts.decode_tp = 4;
  opts.num_kv_heads = 2;
  opts.trace = true;
  SimResult a = RunSimulation(730001, opts);
  SimResult b = RunSimulation(730001, opts);
  EXPECT_EQ(a.trace, b.trace);
  EXPECT_NE(a.trace.find("tp: prefill 2 ranks, decode 4 ranks, 2 KV heads"), std::string::npos);
}

}  // namespace
}  // namespace kvbridge::sim
