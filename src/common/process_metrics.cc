#include "kvbridge/common/process_metrics.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace kvbridge {

void AddProcessMetrics(MetricsRegistry& registry) {
  registry.AddCallbackGauge("process_resident_memory_bytes", "Resident memory size in bytes.", [] {
    std::FILE* f = std::fopen("/proc/self/statm", "r");
    if (f == nullptr) return -1.0;
    long pages = 0, resident = 0;
    const bool ok = std::fscanf(f, "%ld %ld", &pages, &resident) == 2;
    std::fclose(f);
    return ok ? static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) : -1.0;
  });
  registry.AddCallbackGauge(
      "kvbridge_process_resident_memory_peak_bytes", "Peak resident memory size in bytes (VmHWM).",
      [] {
        std::FILE* f = std::fopen("/proc/self/status", "r");
        if (f == nullptr) return -1.0;
        char line[256];
        double out = -1;
        while (std::fgets(line, sizeof(line), f) != nullptr) {
          long kib = 0;
          if (std::strncmp(line, "VmHWM:", 6) == 0 && std::sscanf(line + 6, "%ld", &kib) == 1) {
            out = static_cast<double>(kib) * 1024.0;
            break;
          }
        }
        std::fclose(f);
        return out;
      });
}

}  // namespace kvbridge
