#include "support/free_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdexcept>

namespace kvbridge::testing {
namespace {

// A TCP socket bound to 127.0.0.1:0 (no SO_REUSEADDR); sets *port. Throws on failure.
int BindLoopbackAnyPort(int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    throw std::runtime_error("bind failed");
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

}  // namespace

int FreePort() {
  int port = 0;
  ::close(BindLoopbackAnyPort(&port));
  return port;
}

RefusingPort::RefusingPort() : fd_(BindLoopbackAnyPort(&port_)) {}

RefusingPort::~RefusingPort() { ::close(fd_); }

}  // namespace kvbridge::testing
