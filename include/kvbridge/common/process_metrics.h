// kvbridge/common/process_metrics.h — this process's own figures for /metrics.
//
// Thread-safety: the gauges are read at Render() time from /proc; safe from any thread.
#pragma once

#include "kvbridge/common/metrics.h"

namespace kvbridge {

/// Adds this process's memory to `registry`: process_resident_memory_bytes (resident set, from
/// /proc/self/statm; the name Prometheus' client libraries give it) and
/// kvbridge_process_resident_memory_peak_bytes (its high-water mark, VmHWM of /proc/self/status).
/// -1 where /proc cannot be read.
void AddProcessMetrics(MetricsRegistry& registry);

}  // namespace kvbridge
