// kvbridge/common/clock.h — time as a value.
//
// Sans-IO cores (scheduler, connector, proxy flow) never read a clock: they take `now`
// (a TimePoint) as an argument. The runtime passes SteadyNow(); the simulator passes its
// virtual clock. TimePoint is microseconds since an arbitrary epoch.
#pragma once

#include <cstdint>

namespace kvbridge {

/// Microseconds since an arbitrary, per-process epoch (monotonic).
using TimePoint = int64_t;
/// A span of microseconds.
using DurationUs = int64_t;

constexpr DurationUs kMillisecond = 1000;
constexpr DurationUs kSecond = 1000 * kMillisecond;

/// Real monotonic time (std::chrono::steady_clock) in microseconds. Only runtimes call this.
TimePoint SteadyNow();

}  // namespace kvbridge
