// src/bench/bench_internal.h — HTTP helpers shared by the bench's modes (bench.cc, multi_turn.cc,
// overload.cc).
//
// Thread-safety: pure functions; a client is used by one thread.
#pragma once

#include <httplib.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvbridge/bench/bench.h"
#include "kvbridge/common/status.h"

namespace kvbridge::bench::internal {

struct HostPort {
  std::string host;
  int port = 0;
};

/// A steady-clock duration in seconds.
inline double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

/// "http://HOST:PORT[/...]" → host and port. InvalidArgument otherwise.
Result<HostPort> ParseHost(std::string url);
/// A keep-alive client with TCP_NODELAY, 5 s connect and `timeout_s` read/write timeouts.
std::unique_ptr<httplib::Client> MakeClient(const HostPort& hp, double timeout_s);
/// The urls of every instance GET {host}/instances lists. Unavailable when it cannot be read or
/// lists none.
Result<std::vector<std::string>> InstanceUrls(const std::string& host);
/// One drain report as JSON (`--json`).
nlohmann::json DrainJson(const DrainReport& d);
/// Polls every url's /metrics until kvbridge_kv_blocks_active and _held_for_transfer are 0, at
/// most `timeout_s` after `since`; reads the lease-expired and ignored-notification counters.
std::vector<DrainReport> CheckDrain(const std::vector<std::string>& urls,
                                    std::chrono::steady_clock::time_point since, double timeout_s);

}  // namespace kvbridge::bench::internal
