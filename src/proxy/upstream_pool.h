// The proxy's keep-alive pool of upstream connections (internal to src/proxy).
//
// Each leg to an engine used to open a new TCP connection; the pool keeps connections whose last
// response completed cleanly so the next leg to the same host:port skips the connect (and the
// engine's accept). It holds plain file descriptors, not Asio sockets: a leg runs on its client
// connection's strand, and a descriptor re-wrapped by the next leg's socket carries no executor
// from the previous one.
//
//   UpstreamPool pool({.max_idle_per_host = 16, .idle_timeout = 1 * kSecond});
//   if (auto c = pool.Take("127.0.0.1:8100", SteadyNow())) { ... reuse c->fd ... }
//   pool.Put("127.0.0.1:8100", {fd, AF_INET}, SteadyNow());  // after a complete response
//
// Rules: a connection goes back only after a complete response on a connection both sides keep
// alive (the caller checks); Take hands out the most recently returned one first and drops, closing
// them, those idle longer than idle_timeout and those the peer has closed or written to since
// (a non-blocking peek); at most max_idle_per_host wait per host (Put closes the surplus);
// max_idle_per_host = 0 disables the pool (Take finds nothing, Put closes).
//
// Thread-safety: every member is thread-safe (one mutex).
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvbridge/common/clock.h"

namespace kvbridge::proxy {

struct PooledConnection {
  int fd = -1;
  int family = 0;  // AF_INET / AF_INET6, to re-wrap the descriptor
};

class UpstreamPool {
 public:
  struct Options {
    int max_idle_per_host = 16;
    DurationUs idle_timeout = 1 * kSecond;  // keep below the engines' keep-alive timeout (2 s)
  };

  explicit UpstreamPool(Options options) : options_(options) {}
  ~UpstreamPool();  // closes every idle connection
  UpstreamPool(const UpstreamPool&) = delete;
  UpstreamPool& operator=(const UpstreamPool&) = delete;

  /// An idle connection to `key` ("host:port") that is still usable; the caller owns its fd.
  /// nullopt when there is none.
  std::optional<PooledConnection> Take(const std::string& key, TimePoint now);
  /// Gives back a connection after a complete response. Takes ownership of conn.fd (closes it when
  /// the pool is disabled or the host already has max_idle_per_host idle).
  void Put(const std::string& key, PooledConnection conn, TimePoint now);
  /// Closes the connections idle longer than idle_timeout; returns how many.
  int Sweep(TimePoint now);
  /// Idle connections held for `key` (all keys when empty).
  size_t IdleCount(const std::string& key = "") const;
  bool enabled() const { return options_.max_idle_per_host > 0; }

 private:
  struct Idle {
    PooledConnection conn;
    TimePoint since = 0;
  };
  const Options options_;
  mutable std::mutex mu_;
  std::map<std::string, std::vector<Idle>> idle_;  // per key, oldest first
};

}  // namespace kvbridge::proxy
