#include "kvbridge/proxy/supervisor.h"

#include <gtest/gtest.h>

namespace kvbridge::proxy {
namespace {

template <typename T>
const T& As(const SupervisorAction& a) {
  EXPECT_TRUE(std::holds_alternative<T>(a)) << "action index " << a.index();
  return std::get<T>(a);
}

SupervisorOptions Opts(RestartPolicy policy = RestartPolicy::kOnFailure, int budget = 3) {
  SupervisorOptions o;
  o.policy = policy;
  o.restart_budget = budget;
  o.budget_window = 60 * kSecond;
  o.backoff_initial = 500 * kMillisecond;
  o.backoff_max = 4 * kSecond;
  o.stable_after = 30 * kSecond;
  return o;
}

// Starts children 0..n-1 at `now`.
Supervisor Started(SupervisorOptions o, int n, TimePoint now = 0) {
  Supervisor s(o, n);
  for (int i = 0; i < n; ++i) s.OnStarted(i, now);
  return s;
}

TEST(Supervisor, DeadChildRestartsAfterBackoffOthersUntouched) {
  Supervisor s = Started(Opts(), 3);
  auto a = s.OnExit(1, ExitKind::kFailed, 10 * kSecond);
  ASSERT_EQ(a.size(), 1u);
  const RestartScheduled r = As<RestartScheduled>(a[0]);
  EXPECT_EQ(r.child, 1);
  EXPECT_EQ(r.at, 10 * kSecond + 500 * kMillisecond);
  EXPECT_EQ(r.restart, 1);
  EXPECT_EQ(s.deadline(), std::optional<TimePoint>(r.at));
  EXPECT_TRUE(s.OnTick(r.at - 1).empty());
  a = s.OnTick(r.at);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<StartChild>(a[0]).child, 1);
  EXPECT_EQ(As<StartChild>(a[0]).restarts, 1);
  EXPECT_FALSE(s.deadline().has_value());
  s.OnStarted(1, r.at);
  EXPECT_EQ(s.restarts(0), 0);
  EXPECT_EQ(s.restarts(1), 1);
  EXPECT_EQ(s.restarts(2), 0);
  EXPECT_EQ(s.total_restarts(), 1);
  EXPECT_TRUE(s.OnTick(r.at + kSecond).empty());  // once
}

TEST(Supervisor, BackoffDoublesUpToItsMaxAndResetsAfterAStableRun) {
  SupervisorOptions o = Opts(RestartPolicy::kOnFailure, /*budget=*/100);
  Supervisor s = Started(o, 1);
  TimePoint now = 0;
  std::vector<DurationUs> delays;
  for (int i = 0; i < 6; ++i) {
    now += kSecond;  // dies a second after each start: not stable
    auto a = s.OnExit(0, ExitKind::kFailed, now);
    ASSERT_EQ(a.size(), 1u);
    const TimePoint at = As<RestartScheduled>(a[0]).at;
    delays.push_back(at - now);
    now = at;
    ASSERT_EQ(s.OnTick(now).size(), 1u);
    s.OnStarted(0, now);
  }
  EXPECT_EQ(delays, (std::vector<DurationUs>{500 * kMillisecond, 1 * kSecond, 2 * kSecond,
                                             4 * kSecond, 4 * kSecond, 4 * kSecond}));
  // Up for 30 s: the next death starts from the initial backoff again.
  now += 30 * kSecond;
  auto a = s.OnExit(0, ExitKind::kFailed, now);
  EXPECT_EQ(As<RestartScheduled>(a[0]).at - now, 500 * kMillisecond);
}

TEST(Supervisor, BudgetSpentStopsEverythingNonZero) {
  Supervisor s = Started(Opts(RestartPolicy::kOnFailure, /*budget=*/2), 2);
  TimePoint now = 0;
  for (int i = 0; i < 2; ++i) {
    now += kSecond;
    auto a = s.OnExit(0, ExitKind::kFailed, now);
    ASSERT_EQ(a.size(), 1u);
    now = As<RestartScheduled>(a[0]).at;
    ASSERT_EQ(s.OnTick(now).size(), 1u);
    s.OnStarted(0, now);
  }
  auto a = s.OnExit(0, ExitKind::kFailed, now + kSecond);
  ASSERT_EQ(a.size(), 1u);
  const StopAll& stop = As<StopAll>(a[0]);
  EXPECT_EQ(stop.exit_code, 1);
  EXPECT_NE(stop.reason.find("--restart-budget 2"), std::string::npos) << stop.reason;
  EXPECT_TRUE(s.stopping());
  EXPECT_TRUE(s.OnExit(1, ExitKind::kFailed, now + 2 * kSecond).empty());  // stopping: nothing
  EXPECT_TRUE(s.OnStopRequested().empty());
}

TEST(Supervisor, BudgetIsPerMinute) {
  Supervisor s = Started(Opts(RestartPolicy::kOnFailure, /*budget=*/1), 1);
  auto a = s.OnExit(0, ExitKind::kFailed, kSecond);
  TimePoint now = As<RestartScheduled>(a[0]).at;
  s.OnTick(now);
  s.OnStarted(0, now);
  // The one restart of the budget was 61 s ago: out of the window, so another is allowed.
  a = s.OnExit(0, ExitKind::kFailed, 62 * kSecond);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<RestartScheduled>(a[0]).restart, 2);
  now = As<RestartScheduled>(a[0]).at;
  s.OnTick(now);
  s.OnStarted(0, now);
  // Within the window of that one: spent.
  a = s.OnExit(0, ExitKind::kFailed, now + kSecond);
  EXPECT_EQ(As<StopAll>(a[0]).exit_code, 1);
}

TEST(Supervisor, OnFailureLeavesACleanExitDownAlwaysRestartsIt) {
  Supervisor s = Started(Opts(RestartPolicy::kOnFailure), 2);
  auto a = s.OnExit(0, ExitKind::kClean, kSecond);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<LeaveDown>(a[0]).child, 0);
  EXPECT_FALSE(s.deadline().has_value());
  // The last one exits 0 too: nothing left to supervise.
  a = s.OnExit(1, ExitKind::kClean, 2 * kSecond);
  ASSERT_EQ(a.size(), 2u);
  As<LeaveDown>(a[0]);
  EXPECT_EQ(As<StopAll>(a[1]).exit_code, 0);

  Supervisor always = Started(Opts(RestartPolicy::kAlways), 1);
  a = always.OnExit(0, ExitKind::kClean, kSecond);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<RestartScheduled>(a[0]).child, 0);
}

TEST(Supervisor, NeverStopsEverythingOnAnyExit) {
  Supervisor s = Started(Opts(RestartPolicy::kNever), 3);
  auto a = s.OnExit(2, ExitKind::kFailed, kSecond);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<StopAll>(a[0]).exit_code, 1);
}

TEST(Supervisor, StopRequestedStopsWithZeroAndCancelsPendingRestarts) {
  Supervisor s = Started(Opts(), 2);
  s.OnExit(0, ExitKind::kFailed, kSecond);
  ASSERT_TRUE(s.deadline().has_value());
  auto a = s.OnStopRequested();
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(As<StopAll>(a[0]).exit_code, 0);
  EXPECT_FALSE(s.deadline().has_value());
  EXPECT_TRUE(s.OnTick(10 * kSecond).empty());
  // Children that die while everything stops are not restarted.
  EXPECT_TRUE(s.OnExit(1, ExitKind::kFailed, 11 * kSecond).empty());
}

TEST(Supervisor, EventsForUnknownOrNotRunningChildrenAreIgnored) {
  Supervisor s = Started(Opts(), 1);
  EXPECT_TRUE(s.OnExit(5, ExitKind::kFailed, 1).empty());
  EXPECT_TRUE(s.OnExit(-1, ExitKind::kFailed, 1).empty());
  ASSERT_EQ(s.OnExit(0, ExitKind::kFailed, 1).size(), 1u);
  EXPECT_TRUE(s.OnExit(0, ExitKind::kFailed, 2).empty());  // already pending a restart
  EXPECT_EQ(s.restarts(7), 0);
}

TEST(Supervisor, ParseRestartPolicy) {
  EXPECT_EQ(*ParseRestartPolicy("on-failure"), RestartPolicy::kOnFailure);
  EXPECT_EQ(*ParseRestartPolicy("always"), RestartPolicy::kAlways);
  EXPECT_EQ(*ParseRestartPolicy("never"), RestartPolicy::kNever);
  EXPECT_EQ(ParseRestartPolicy("sometimes").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RestartPolicyName(RestartPolicy::kAlways), "always");
}

}  // namespace
}  // namespace kvbridge::proxy
