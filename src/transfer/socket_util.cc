#include "transfer/socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

namespace kvbridge::transfer::net {

void Fd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {
Status SockError(int err, std::string_view what) {
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return UnavailableError(std::string(what) + ": peer timed out");
  }
  return UnavailableError(std::string(what) + ": " + std::strerror(err));
}
}  // namespace

Status SendAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t r = ::send(fd, c, n, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return SockError(errno, "send");
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return OkStatus();
}

Status RecvAll(int fd, void* p, size_t n, bool idle_ok) {
  char* c = static_cast<char*>(p);
  bool got_any = false;
  while (n > 0) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r == 0) return UnavailableError("connection closed by peer");
    if (r < 0) {
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && idle_ok && !got_any) {
        return DeadlineExceededError("idle");
      }
      return SockError(errno, "recv");
    }
    got_any = true;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return OkStatus();
}

namespace {
// Advances iov past `n` bytes; returns the new start index.
size_t Advance(struct iovec* iov, size_t i, size_t count, size_t n) {
  while (n > 0 && i < count) {
    if (n >= iov[i].iov_len) {
      n -= iov[i].iov_len;
      iov[i].iov_len = 0;
      ++i;
    } else {
      iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + n;
      iov[i].iov_len -= n;
      n = 0;
    }
  }
  while (i < count && iov[i].iov_len == 0) ++i;
  return i;
}
}  // namespace

Status SendIov(int fd, struct iovec* iov, size_t count) {
  size_t i = 0;
  while (i < count && iov[i].iov_len == 0) ++i;
  while (i < count) {
    struct msghdr msg {};
    msg.msg_iov = iov + i;
    msg.msg_iovlen = std::min<size_t>(count - i, IOV_MAX);
    ssize_t r = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return SockError(errno, "sendmsg");
    }
    i = Advance(iov, i, count, static_cast<size_t>(r));
  }
  return OkStatus();
}

Status RecvIov(int fd, struct iovec* iov, size_t count) {
  size_t i = 0;
  while (i < count && iov[i].iov_len == 0) ++i;
  while (i < count) {
    struct msghdr msg {};
    msg.msg_iov = iov + i;
    msg.msg_iovlen = std::min<size_t>(count - i, IOV_MAX);
    ssize_t r = ::recvmsg(fd, &msg, MSG_WAITALL);
    if (r == 0) return UnavailableError("connection closed by peer");
    if (r < 0) {
      if (errno == EINTR) continue;
      return SockError(errno, "recvmsg");
    }
    i = Advance(iov, i, count, static_cast<size_t>(r));
  }
  return OkStatus();
}

Status Discard(int fd, uint64_t n) {
  char buf[65536];
  while (n > 0) {
    size_t k = static_cast<size_t>(std::min<uint64_t>(n, sizeof(buf)));
    RETURN_IF_ERROR(RecvAll(fd, buf, k));
    n -= k;
  }
  return OkStatus();
}

Status SendFrame(int fd, const wire::FrameHeader& h, std::string_view meta, struct iovec* payload,
                 size_t payload_count) {
  uint8_t head[wire::kFrameHeaderBytes];
  wire::FrameHeader hh = h;
  hh.meta_len = static_cast<uint32_t>(meta.size());
  wire::EncodeFrameHeader(hh, head);
  std::vector<struct iovec> iov;
  iov.reserve(2 + payload_count);
  iov.push_back({head, sizeof(head)});
  if (!meta.empty()) iov.push_back({const_cast<char*>(meta.data()), meta.size()});
  for (size_t i = 0; i < payload_count; ++i) iov.push_back(payload[i]);
  return SendIov(fd, iov.data(), iov.size());
}

Status RecvFrameHead(int fd, wire::FrameHeader* h, std::string* meta, bool idle_ok) {
  uint8_t head[wire::kFrameHeaderBytes];
  RETURN_IF_ERROR(RecvAll(fd, head, sizeof(head), idle_ok));
  ASSIGN_OR_RETURN(*h, wire::DecodeFrameHeader(head, sizeof(head)));
  meta->resize(h->meta_len);
  if (h->meta_len > 0) RETURN_IF_ERROR(RecvAll(fd, meta->data(), meta->size()));
  return OkStatus();
}

void SetTimeouts(int fd, int recv_ms, int send_ms) {
  struct timeval tv {};
  tv.tv_sec = recv_ms / 1000;
  tv.tv_usec = (recv_ms % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  tv.tv_sec = send_ms / 1000;
  tv.tv_usec = (send_ms % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

void TuneTcp(int fd, int timeout_ms) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = std::max(1, timeout_ms / 3000), intvl = 1, cnt = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  unsigned int ut = static_cast<unsigned int>(timeout_ms);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof(ut));
}

Status ParseHostPort(std::string_view s, std::string* host, int* port) {
  size_t c = s.rfind(':');
  if (c == std::string_view::npos || c == 0 || c + 1 >= s.size()) {
    return InvalidArgumentError("endpoint '" + std::string(s) + "' is not HOST:PORT");
  }
  int p = 0;
  for (char ch : s.substr(c + 1)) {
    if (ch < '0' || ch > '9') return InvalidArgumentError("bad port in '" + std::string(s) + "'");
    p = p * 10 + (ch - '0');
    if (p > 65535) return InvalidArgumentError("port out of range in '" + std::string(s) + "'");
  }
  *host = std::string(s.substr(0, c));
  *port = p;
  return OkStatus();
}

Result<Fd> TcpListen(const std::string& host, int port, int* bound_port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "socket");
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) {
    return InvalidArgumentError("bind address '" + host + "' is not an IPv4 address");
  }
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    return ErrnoToStatus(errno, "bind " + host + ":" + std::to_string(port));
  }
  if (::listen(fd.get(), 128) != 0) return ErrnoToStatus(errno, "listen");
  socklen_t len = sizeof(a);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  *bound_port = ntohs(a.sin_port);
  return fd;
}

Result<Fd> TcpConnect(const std::string& host, int port, int timeout_ms) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) {
    return InvalidArgumentError("peer address '" + host + "' is not an IPv4 address");
  }
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "socket");
  int r = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a));
  if (r != 0 && errno != EINPROGRESS) {
    return UnavailableError("connect " + host + ":" + std::to_string(port) + ": " +
                            std::strerror(errno));
  }
  if (r != 0) {
    pollfd p{fd.get(), POLLOUT, 0};
    int pr = ::poll(&p, 1, timeout_ms);
    int err = 0;
    socklen_t el = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &el);
    if (pr <= 0 || err != 0) {
      return UnavailableError("connect " + host + ":" + std::to_string(port) + ": " +
                              (pr <= 0 ? std::string("timed out") : std::strerror(err)));
    }
  }
  int fl = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK);
  TuneTcp(fd.get(), timeout_ms);
  return fd;
}

namespace {
socklen_t AbstractAddr(const std::string& name, sockaddr_un* a) {
  std::memset(a, 0, sizeof(*a));
  a->sun_family = AF_UNIX;
  std::string n = name;
  if (!n.empty() && n[0] == '@') n = n.substr(1);
  n = n.substr(0, sizeof(a->sun_path) - 2);
  std::memcpy(a->sun_path + 1, n.data(), n.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n.size());
}
}  // namespace

Result<Fd> UnixListen(const std::string& abstract_name) {
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "socket(AF_UNIX)");
  sockaddr_un a;
  socklen_t len = AbstractAddr(abstract_name, &a);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), len) != 0) {
    return ErrnoToStatus(errno, "bind " + abstract_name);
  }
  if (::listen(fd.get(), 128) != 0) return ErrnoToStatus(errno, "listen");
  return fd;
}

Result<Fd> UnixConnect(const std::string& abstract_name) {
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "socket(AF_UNIX)");
  sockaddr_un a;
  socklen_t len = AbstractAddr(abstract_name, &a);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), len) != 0) {
    return UnavailableError("connect " + abstract_name + ": " + std::strerror(errno));
  }
  return fd;
}

Status SendWithFds(int sock, std::string_view bytes, const std::vector<int>& fds) {
  if (bytes.empty()) return InvalidArgumentError("fds need at least one byte");
  struct iovec iov {
    const_cast<char*>(bytes.data()), 1
  };
  std::vector<char> ctrl(CMSG_SPACE(sizeof(int) * fds.size()));
  struct msghdr msg {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    msg.msg_control = ctrl.data();
    msg.msg_controllen = ctrl.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t r;
  do {
    r = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (r < 0 && errno == EINTR);
  if (r != 1) return SockError(errno, "sendmsg(SCM_RIGHTS)");
  return SendAll(sock, bytes.data() + 1, bytes.size() - 1);
}

Status RecvWithFds(int sock, void* p, size_t n, std::vector<Fd>* fds) {
  if (n == 0) return InvalidArgumentError("fds need at least one byte");
  struct iovec iov {
    p, 1
  };
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int) * 64)];
  struct msghdr msg {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctrl;
  msg.msg_controllen = sizeof(ctrl);
  ssize_t r;
  do {
    r = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return UnavailableError("connection closed by peer");
  if (r < 0) return SockError(errno, "recvmsg(SCM_RIGHTS)");
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->emplace_back(f);
      }
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) return InvalidArgumentError("too many fds attached");
  return RecvAll(sock, static_cast<char*>(p) + 1, n - 1);
}

void Shutdown(int fd) {
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

}  // namespace kvbridge::transfer::net
