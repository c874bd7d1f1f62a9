#include "kvbridge/common/clock.h"

#include <chrono>

namespace kvbridge {

TimePoint SteadyNow() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace kvbridge
