// src/transfer/socket_util.h — blocking socket helpers for the backends (internal).
// Errors: Unavailable (peer closed / reset / timed out); errno converted here, once.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvbridge/common/status.h"
#include "transfer/wire.h"

namespace kvbridge::transfer::net {

/// Move-only file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { Reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset();

 private:
  int fd_ = -1;
};

/// Sends all bytes (MSG_NOSIGNAL).
Status SendAll(int fd, const void* p, size_t n);
/// Receives exactly n bytes. Unavailable on EOF/error; DeadlineExceeded on SO_RCVTIMEO expiry
/// with nothing received yet in this call when `idle_ok` (otherwise Unavailable).
Status RecvAll(int fd, void* p, size_t n, bool idle_ok = false);
/// Sends / receives every byte of the iovec list (any length; batched by IOV_MAX). Modifies iov.
Status SendIov(int fd, struct iovec* iov, size_t count);
Status RecvIov(int fd, struct iovec* iov, size_t count);
/// Reads and discards n bytes.
Status Discard(int fd, uint64_t n);

/// Sends one frame: header + meta + payload iovecs (payload_len taken from the header).
Status SendFrame(int fd, const wire::FrameHeader& h, std::string_view meta,
                 struct iovec* payload = nullptr, size_t payload_count = 0);
/// Receives a frame header and its meta (payload left in the socket).
Status RecvFrameHead(int fd, wire::FrameHeader* h, std::string* meta, bool idle_ok = false);

/// TCP listen on host:port (port 0 = ephemeral); returns fd and fills the bound port.
Result<Fd> TcpListen(const std::string& host, int port, int* bound_port);
/// TCP connect with a timeout; sets TCP_NODELAY, keepalive and TCP_USER_TIMEOUT=timeout_ms.
Result<Fd> TcpConnect(const std::string& host, int port, int timeout_ms);
/// Tunes a connected data socket (NODELAY, buffers, keepalive, user timeout).
void TuneTcp(int fd, int timeout_ms);
/// Sets SO_RCVTIMEO / SO_SNDTIMEO (0 = none).
void SetTimeouts(int fd, int recv_ms, int send_ms);
/// Splits "host:port". InvalidArgument if malformed.
Status ParseHostPort(std::string_view s, std::string* host, int* port);

/// Abstract-namespace unix stream socket ("@name" endpoints).
Result<Fd> UnixListen(const std::string& abstract_name);
Result<Fd> UnixConnect(const std::string& abstract_name);
/// Sends `bytes` with the fds attached (SCM_RIGHTS); receives them.
Status SendWithFds(int sock, std::string_view bytes, const std::vector<int>& fds);
/// Receives exactly `n` bytes; fds attached to them are appended to `fds` (owned by caller).
Status RecvWithFds(int sock, void* p, size_t n, std::vector<Fd>* fds);

/// Interrupts blocking calls on `fd` (shutdown RDWR) without closing it.
void Shutdown(int fd);

}  // namespace kvbridge::transfer::net
