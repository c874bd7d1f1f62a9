// src/bench/bench_internal.h — HTTP helpers shared by the bench's modes (bench.cc, multi_turn.cc).
//
// Thread-safety: pure functions; a client is used by one thread.
#pragma once

#include <httplib.h>

#include <memory>
#include <string>

#include "kvbridge/common/status.h"

namespace kvbridge::bench::internal {

struct HostPort {
  std::string host;
  int port = 0;
};

/// "http://HOST:PORT[/...]" → host and port. InvalidArgument otherwise.
Result<HostPort> ParseHost(std::string url);
/// A keep-alive client with TCP_NODELAY, 5 s connect and `timeout_s` read/write timeouts.
std::unique_ptr<httplib::Client> MakeClient(const HostPort& hp, double timeout_s);

}  // namespace kvbridge::bench::internal
