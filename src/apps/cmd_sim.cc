// `kvbridge sim`: runs the deterministic P/D simulator (docs/sim.md).
//
//   kvbridge sim --seed 42 --trace          # replay one run with its event trace
//   kvbridge sim --seed 1 --seeds 2000      # seeds 1..2000; prints failures and seeds/s
//   kvbridge sim --seed 1 --seeds 500 --workload faults
//   kvbridge sim --seed 1 --seeds 500 --mode write   # every seed in WRITE mode (default: half)
//
// Exit status: 0 when every run passed, 1 when one broke an invariant (its seed and the
// invariant are printed; rerun it with --seed S --seeds 1 --trace), 2 on bad flags.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "apps/command_registry.h"
#include "kvbridge/common/logging.h"
#include "kvbridge/sim/simulator.h"

namespace {

struct SimFlags {
  uint64_t seed = 1;
  uint64_t seeds = 1;
  bool trace = false;
  bool quiet = false;
  std::string workload = "mixed";
  std::string mode;  // empty: drawn per seed
  int requests = 0;
};

int RunSim(const SimFlags& f) {
  kvbridge::SetLogLevel("off");  // the trace says what happened; engine logs would interleave
  auto w = kvbridge::sim::ParseWorkload(f.workload);
  if (!w.ok()) {
    std::fprintf(stderr, "kvbridge sim: %s\n", w.status().ToString().c_str());
    return 2;
  }
  kvbridge::sim::SimOptions opts;
  opts.workload = *w;
  if (!f.mode.empty()) {
    auto m = kvbridge::ParseKvTransferMode(f.mode);
    if (!m.ok()) {
      std::fprintf(stderr, "kvbridge sim: %s\n", m.status().ToString().c_str());
      return 2;
    }
    opts.mode = *m;
  }
  opts.trace = f.trace;
  if (f.requests > 0) opts.num_requests = f.requests;
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t failed = 0;
  int64_t events = 0;
  for (uint64_t s = f.seed; s < f.seed + f.seeds; ++s) {
    kvbridge::sim::SimResult r = kvbridge::sim::RunSimulation(s, opts);
    events += r.events;
    if (f.trace) std::fputs(r.trace.c_str(), stdout);
    if (!r.ok) {
      ++failed;
      std::printf("%s\n  replay: kvbridge sim --seed %llu --workload %s%s%s --trace\n",
                  r.Summary().c_str(), static_cast<unsigned long long>(s), f.workload.c_str(),
                  f.mode.empty() ? "" : " --mode ", f.mode.c_str());
    } else if (f.seeds == 1 || (!f.quiet && f.trace)) {
      std::printf("%s\n", r.Summary().c_str());
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "%llu seeds (workload %s): %llu passed, %llu failed in %.2fs: %.1f seeds/s, "
      "%.0f events/s\n",
      static_cast<unsigned long long>(f.seeds), f.workload.c_str(),
      static_cast<unsigned long long>(f.seeds - failed), static_cast<unsigned long long>(failed),
      secs, secs > 0 ? static_cast<double>(f.seeds) / secs : 0.0,
      secs > 0 ? static_cast<double>(events) / secs : 0.0);
  return failed == 0 ? 0 : 1;
}

const bool kRegistered = kvbridge::apps::RegisterCommand(
    "sim", "Deterministic simulation of the P/D protocol with fault injection",
    [](CLI::App& sub) -> kvbridge::apps::CommandMain {
      auto f = std::make_shared<SimFlags>();
      sub.add_option("--seed", f->seed, "First seed (a run is a pure function of its seed)");
      sub.add_option("--seeds", f->seeds, "Number of consecutive seeds to run")
          ->check(CLI::Range(uint64_t{1}, uint64_t{100000000}));
      sub.add_flag("--trace", f->trace, "Print each run's event trace");
      sub.add_option("--workload", f->workload,
                     "mixed|clean|faults|prefill-n|early-race|lease-read|abort-load");
      sub.add_option("--requests", f->requests, "Client requests per run (default: seeded)");
      sub.add_option("--mode", f->mode,
                     "read|write for every seed (default: half the seeds write)");
      return [f] { return RunSim(*f); };
    });

}  // namespace
