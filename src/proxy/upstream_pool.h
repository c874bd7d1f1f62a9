// The proxy's keep-alive pool of upstream connections (internal to src/proxy).
//
// Each leg to an engine used to open a new TCP connection; the pool keeps connections whose last
// response completed cleanly so the next leg to the same host:port skips the connect (and the
// engine's accept). It holds the Asio sockets themselves, still registered with the event loop,
// as nginx keeps its upstream keep-alive connections: handing one out or taking it back costs no
// system call (no epoll_ctl ADD/DEL, no FIONBIO, no liveness peek per leg). Sweep (the proxy
// runs it every 200 ms) closes connections idle too long and starts watching the others with a
// pending 1-byte MSG_PEEK receive: an idle HTTP/1.1 connection has nothing to read, so when that
// receive completes (the engine closed the connection, or sent bytes unasked for) the pool drops
// and closes it. Take cancels the watch (no system call either).
//
//   UpstreamPool pool({.max_idle_per_host = 16, .idle_timeout = 1 * kSecond});
//   if (auto s = pool.Take("127.0.0.1:8100", SteadyNow())) { ... reuse *s ... }
//   pool.Put("127.0.0.1:8100", std::move(socket), SteadyNow());  // after a complete response
//
// Rules: a connection goes back only after a complete response on a connection both sides keep
// alive (the caller checks); Take hands out the most recently returned one first and drops,
// closing them, those idle longer than idle_timeout; the watch drops those the peer has closed or
// written to (a peer that closes a connection just as a leg takes it is the caller's case: it
// sends the request again, once, on a new connection); at most max_idle_per_host wait per host
// (Put closes the surplus); max_idle_per_host = 0 disables the pool (Take finds nothing, Put
// closes).
//
// Why the watch starts at a sweep and not at Put: under load a connection is idle for
// microseconds, and arming a watch costs a system call (Asio 1.74's epoll reactor re-registers the
// descriptor with epoll_ctl MOD for every async_wait; a receive costs one speculative recv). An
// engine closes an idle connection at its keep-alive timeout (2 s for `kvbridge serve`, above
// idle_timeout), so a connection not yet watched is one idle less than a sweep period; one the
// engine closed anyway (it died) is the caller's case: the request fails before any response byte
// and goes again, once, on a new connection. The pool's sockets must belong to an io_context that
// outlives the pool (destroy the pool first).
//
// Thread-safety: every member is thread-safe (one mutex). Sockets are handed over whole: the pool
// never touches a socket it has handed out (Take cancels the watch before it returns).
//
// BasicUpstreamPool<Conn> holds any connection type whose lowest_layer() is the TCP socket (the
// watch, cancels and closes act on it): UpstreamPool holds plain sockets, the proxy's pool its
// Streams (stream.h: plain or TLS; a TLS connection's key should name the scheme, so that a
// plain and a TLS engine on one host:port never share one). Instantiated for those two.
#pragma once

#include <boost/asio/ip/tcp.hpp>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvbridge/common/clock.h"

namespace kvbridge::proxy {

template <typename Conn>
class BasicUpstreamPool {
 public:
  using Socket = Conn;

  struct Options {
    int max_idle_per_host = 16;
    DurationUs idle_timeout = 1 * kSecond;  // keep below the engines' keep-alive timeout (2 s)
  };

  explicit BasicUpstreamPool(Options options);
  ~BasicUpstreamPool();  // closes every idle connection
  BasicUpstreamPool(const BasicUpstreamPool&) = delete;
  BasicUpstreamPool& operator=(const BasicUpstreamPool&) = delete;

  /// An idle, open connection to `key` ("host:port"), most recently returned first; the caller
  /// owns it. nullopt when there is none.
  std::optional<Socket> Take(const std::string& key, TimePoint now);
  /// Gives back an open connection after a complete response. Closes it instead when the pool
  /// is disabled or the host already has max_idle_per_host idle.
  void Put(const std::string& key, Socket socket, TimePoint now);
  /// Closes the connections idle longer than idle_timeout (returns how many) and starts watching
  /// the others that are not watched yet.
  int Sweep(TimePoint now);
  /// Idle connections held for `key` (all keys when empty).
  size_t IdleCount(const std::string& key = "") const;
  bool enabled() const { return options_.max_idle_per_host > 0; }

 private:
  struct State;  // shared with the idle watches, which may outlive the pool
  static void Watch(const std::shared_ptr<State>& state, const std::string& key, Socket& socket,
                    uint64_t id, char* sink);
  const Options options_;
  std::shared_ptr<State> state_;
};

class Stream;
extern template class BasicUpstreamPool<boost::asio::ip::tcp::socket>;
extern template class BasicUpstreamPool<Stream>;
using UpstreamPool = BasicUpstreamPool<boost::asio::ip::tcp::socket>;

}  // namespace kvbridge::proxy
