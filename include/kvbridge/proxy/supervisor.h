// kvbridge/proxy/supervisor.h — `kvbridge up`'s restart decisions, as a sans-IO state machine.
//
// `up` runs a topology's processes (the proxy, the engines) as children and keeps it serving when
// one dies: the dead child is restarted with exponential backoff while every other keeps running,
// within a restart budget per child per minute; past the budget `up` stops everything and exits
// non-zero. The Supervisor decides; the runtime (cmd_up.cc) spawns, reaps and reports, feeding it
// events with `now` and executing the actions it returns:
//
//   Supervisor sup({.policy = RestartPolicy::kOnFailure, .restart_budget = 5}, /*children=*/4);
//   for (int i = 0; i < 4; ++i) sup.OnStarted(i, now);       // after each spawn
//   auto actions = sup.OnExit(2, ExitKind::kFailed, now);     // child 2 was reaped
//   // ... a RestartScheduled{2, at}; later, at `at`:
//   actions = sup.OnTick(now);                                 // StartChild{2, restarts=1}
//   actions = sup.OnStopRequested();                           // SIGINT/SIGTERM: StopAll{0}
//
// Policies (as Docker's): kOnFailure restarts a child that died by a signal or a non-zero exit
// code (a child that exits 0 — e.g. an engine drained on purpose — stays down); kAlways restarts
// it however it ended; kNever restarts none, and any death stops the topology. Backoff: the n-th
// restart in a row waits backoff_initial * 2^(n-1), at most backoff_max; a child that ran for
// stable_after before it died starts again from backoff_initial. Budget: a child restarted
// restart_budget times within the last budget_window gets no more: StopAll{1}. When no child is
// left running or due to restart (every one exited 0 under kOnFailure), StopAll{0}.
//
// Thread-safety: none; one owner (the `up` loop) drives it.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/status.h"

namespace kvbridge::proxy {

enum class RestartPolicy { kOnFailure, kAlways, kNever };
/// Parses "on-failure" / "always" / "never"; InvalidArgument otherwise.
Result<RestartPolicy> ParseRestartPolicy(std::string_view text);
std::string_view RestartPolicyName(RestartPolicy policy);

struct SupervisorOptions {
  RestartPolicy policy = RestartPolicy::kOnFailure;
  /// Restarts of one child allowed within budget_window; the next death stops everything.
  int restart_budget = 5;
  DurationUs budget_window = 60 * kSecond;
  DurationUs backoff_initial = 500 * kMillisecond;
  DurationUs backoff_max = 30 * kSecond;
  /// A child up at least this long before it died restarts after backoff_initial again.
  DurationUs stable_after = 30 * kSecond;
};

/// How a child ended: exit code 0, or anything else (a non-zero code, a signal).
enum class ExitKind { kClean, kFailed };

// Actions the runtime executes, in order.
/// Child `child` will be started again at `at` (for the runtime to report; OnTick starts it).
struct RestartScheduled {
  int child = 0;
  TimePoint at = 0;
  int restart = 0;  // which restart of this child it will be (1 = the first)
};
/// Start child `child` again now; it has been restarted `restarts` times counting this one.
/// The runtime calls OnStarted once it is spawned.
struct StartChild {
  int child = 0;
  int restarts = 0;
};
/// A dead child stays down (its policy says so); `reason` says why, for the report.
struct LeaveDown {
  int child = 0;
  std::string reason;
};
/// Stop every child and exit `up` with `exit_code`; `reason` is for the report.
struct StopAll {
  int exit_code = 0;
  std::string reason;
};
using SupervisorAction = std::variant<RestartScheduled, StartChild, LeaveDown, StopAll>;

class Supervisor {
 public:
  Supervisor(SupervisorOptions options, int num_children);

  /// Child `child` was spawned at `now` (first start or restart).
  void OnStarted(int child, TimePoint now);
  /// Child `child` was reaped at `now`.
  std::vector<SupervisorAction> OnExit(int child, ExitKind kind, TimePoint now);
  /// Time passed; starts the restarts that are due. Call at or after deadline().
  std::vector<SupervisorAction> OnTick(TimePoint now);
  /// SIGINT/SIGTERM: StopAll{0}; every later event returns nothing.
  std::vector<SupervisorAction> OnStopRequested();

  /// When the next restart is due (nullopt: none pending, or stopping).
  std::optional<TimePoint> deadline() const;
  /// Restarts of `child` so far (StartChild actions returned for it).
  int restarts(int child) const;
  int total_restarts() const;
  bool stopping() const { return stopping_; }
  const SupervisorOptions& options() const { return options_; }

 private:
  enum class State { kNotStarted, kRunning, kRestartPending, kDown };
  struct Child {
    State state = State::kNotStarted;
    TimePoint started_at = 0;
    TimePoint restart_at = 0;
    int restarts = 0;
    int consecutive = 0;                   // restarts in a row without a stable run
    std::vector<TimePoint> restart_times;  // within the budget window
  };
  std::vector<SupervisorAction> StopEverything(int exit_code, std::string reason);

  SupervisorOptions options_;
  std::vector<Child> children_;
  bool stopping_ = false;
};

}  // namespace kvbridge::proxy
