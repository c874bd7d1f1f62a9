#include "proxy/upstream_pool.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace kvbridge::proxy {
namespace {

// True while the peer has neither closed the connection nor sent anything unasked for: an idle
// HTTP/1.1 connection has nothing to read, so EOF, an error or stray bytes all make it unusable.
bool StillIdle(int fd) {
  char c;
  ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

}  // namespace

UpstreamPool::~UpstreamPool() {
  for (auto& [key, list] : idle_) {
    for (Idle& i : list) ::close(i.conn.fd);
  }
}

std::optional<PooledConnection> UpstreamPool::Take(const std::string& key, TimePoint now) {
  std::vector<int> to_close;
  std::optional<PooledConnection> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(key);
    if (it == idle_.end()) return std::nullopt;
    auto& list = it->second;
    while (!list.empty()) {
      Idle i = list.back();
      list.pop_back();
      if (now - i.since > options_.idle_timeout || !StillIdle(i.conn.fd)) {
        to_close.push_back(i.conn.fd);
        continue;
      }
      out = i.conn;
      break;
    }
    if (list.empty()) idle_.erase(it);
  }
  for (int fd : to_close) ::close(fd);
  return out;
}

void UpstreamPool::Put(const std::string& key, PooledConnection conn, TimePoint now) {
  if (conn.fd < 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (options_.max_idle_per_host > 0) {
      auto& list = idle_[key];
      if (static_cast<int>(list.size()) < options_.max_idle_per_host) {
        list.push_back(Idle{conn, now});
        return;
      }
    }
  }
  ::close(conn.fd);
}

int UpstreamPool::Sweep(TimePoint now) {
  std::vector<int> to_close;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = idle_.begin(); it != idle_.end();) {
      auto& list = it->second;
      size_t keep = 0;
      for (size_t k = 0; k < list.size(); ++k) {
        if (now - list[k].since > options_.idle_timeout) {
          to_close.push_back(list[k].conn.fd);
        } else {
          list[keep++] = list[k];
        }
      }
      list.resize(keep);
      it = list.empty() ? idle_.erase(it) : std::next(it);
    }
  }
  for (int fd : to_close) ::close(fd);
  return static_cast<int>(to_close.size());
}

size_t UpstreamPool::IdleCount(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!key.empty()) {
    auto it = idle_.find(key);
    return it == idle_.end() ? 0 : it->second.size();
  }
  size_t n = 0;
  for (const auto& [k, list] : idle_) n += list.size();
  return n;
}

}  // namespace kvbridge::proxy
