// tests/support/free_port.h — ports for multi-process tests, so `ctest -j2` never collides.
#pragma once

namespace kvbridge::testing {

/// Returns a TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read back,
/// closed). Ports are handed out from the kernel's ephemeral range, so parallel tests differ.
/// Not for a port that must stay dead: another process may bind it, or an outgoing connection
/// to it may be given it as its own source port (a TCP self-connect); use RefusingPort.
int FreePort();

/// A port on 127.0.0.1 where every connect is refused (ECONNREFUSED) for this object's life: a
/// socket bound to it that never listens. Held bound, it can be neither taken by another process
/// nor handed to an outgoing connection as its source port, so "an instance that is down" stays
/// down however busy the machine is.
class RefusingPort {
 public:
  RefusingPort();  // throws std::runtime_error when no socket can be bound
  ~RefusingPort();
  RefusingPort(const RefusingPort&) = delete;
  RefusingPort& operator=(const RefusingPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace kvbridge::testing
