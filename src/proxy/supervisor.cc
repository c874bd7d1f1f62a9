#include "kvbridge/proxy/supervisor.h"

#include <algorithm>

namespace kvbridge::proxy {

Result<RestartPolicy> ParseRestartPolicy(std::string_view text) {
  if (text == "on-failure") return RestartPolicy::kOnFailure;
  if (text == "always") return RestartPolicy::kAlways;
  if (text == "never") return RestartPolicy::kNever;
  return InvalidArgumentError("--restart must be on-failure|always|never, got '" +
                              std::string(text) + "'");
}

std::string_view RestartPolicyName(RestartPolicy policy) {
  switch (policy) {
    case RestartPolicy::kOnFailure:
      return "on-failure";
    case RestartPolicy::kAlways:
      return "always";
    case RestartPolicy::kNever:
      return "never";
  }
  return "unknown";
}

Supervisor::Supervisor(SupervisorOptions options, int num_children)
    : options_(options), children_(static_cast<size_t>(std::max(0, num_children))) {
  if (options_.restart_budget < 0) options_.restart_budget = 0;
  if (options_.backoff_initial < 0) options_.backoff_initial = 0;
  if (options_.backoff_max < options_.backoff_initial) {
    options_.backoff_max = options_.backoff_initial;
  }
}

void Supervisor::OnStarted(int child, TimePoint now) {
  if (child < 0 || child >= static_cast<int>(children_.size()) || stopping_) return;
  Child& c = children_[child];
  c.state = State::kRunning;
  c.started_at = now;
}

std::vector<SupervisorAction> Supervisor::StopEverything(int exit_code, std::string reason) {
  stopping_ = true;
  return {StopAll{exit_code, std::move(reason)}};
}

std::vector<SupervisorAction> Supervisor::OnExit(int child, ExitKind kind, TimePoint now) {
  std::vector<SupervisorAction> out;
  if (stopping_ || child < 0 || child >= static_cast<int>(children_.size())) return out;
  Child& c = children_[child];
  if (c.state != State::kRunning) return out;
  if (options_.policy == RestartPolicy::kNever) {
    c.state = State::kDown;
    return StopEverything(1, "--restart never: a child ended, so the topology stops");
  }
  if (options_.policy == RestartPolicy::kOnFailure && kind == ExitKind::kClean) {
    c.state = State::kDown;
    out.emplace_back(LeaveDown{child, "it exited with code 0 (--restart on-failure)"});
    const bool any_left = std::any_of(children_.begin(), children_.end(), [](const Child& x) {
      return x.state == State::kRunning || x.state == State::kRestartPending ||
             x.state == State::kNotStarted;
    });
    if (!any_left) {
      stopping_ = true;
      out.emplace_back(StopAll{0, "every child has exited with code 0"});
    }
    return out;
  }
  // The budget: restarts of this child within the last window.
  auto& times = c.restart_times;
  times.erase(std::remove_if(times.begin(), times.end(),
                             [&](TimePoint t) { return t <= now - options_.budget_window; }),
              times.end());
  if (static_cast<int>(times.size()) >= options_.restart_budget) {
    c.state = State::kDown;
    return StopEverything(1, "restarted " + std::to_string(times.size()) + " times within " +
                                 std::to_string(options_.budget_window / kSecond) +
                                 " s (--restart-budget " + std::to_string(options_.restart_budget) +
                                 "); giving up");
  }
  if (now - c.started_at >= options_.stable_after) c.consecutive = 0;
  DurationUs delay = options_.backoff_initial;
  for (int i = 0; i < c.consecutive && delay < options_.backoff_max; ++i) delay *= 2;
  delay = std::min(delay, options_.backoff_max);
  ++c.consecutive;
  c.state = State::kRestartPending;
  c.restart_at = now + delay;
  times.push_back(now);
  out.emplace_back(RestartScheduled{child, c.restart_at, c.restarts + 1});
  return out;
}

std::vector<SupervisorAction> Supervisor::OnTick(TimePoint now) {
  std::vector<SupervisorAction> out;
  if (stopping_) return out;
  for (size_t i = 0; i < children_.size(); ++i) {
    Child& c = children_[i];
    if (c.state != State::kRestartPending || now < c.restart_at) continue;
    ++c.restarts;
    c.state = State::kNotStarted;  // until OnStarted
    out.emplace_back(StartChild{static_cast<int>(i), c.restarts});
  }
  return out;
}

std::vector<SupervisorAction> Supervisor::OnStopRequested() {
  if (stopping_) return {};
  return StopEverything(0, "stop requested");
}

std::optional<TimePoint> Supervisor::deadline() const {
  if (stopping_) return std::nullopt;
  std::optional<TimePoint> next;
  for (const Child& c : children_) {
    if (c.state == State::kRestartPending && (!next || c.restart_at < *next)) next = c.restart_at;
  }
  return next;
}

int Supervisor::restarts(int child) const {
  if (child < 0 || child >= static_cast<int>(children_.size())) return 0;
  return children_[child].restarts;
}

int Supervisor::total_restarts() const {
  int n = 0;
  for (const Child& c : children_) n += c.restarts;
  return n;
}

}  // namespace kvbridge::proxy
