#include "proxy/upstream_pool.h"

#include <boost/asio/socket_base.hpp>
#include <boost/system/error_code.hpp>
#include <utility>

#include "proxy/stream.h"

namespace kvbridge::proxy {

template <typename Conn>
struct BasicUpstreamPool<Conn>::State {
  struct Idle {
    uint64_t id = 0;  // names this idle spell for its watch
    Socket socket;
    TimePoint since = 0;
    bool watched = false;
  };
  std::mutex mu;
  uint64_t next_id = 1;
  std::map<std::string, std::vector<Idle>> idle;  // per key, oldest first
  // Where the watches' MSG_PEEK receives land (the byte is never read). It must not move: an Idle
  // moves in its vector. A pending watch always belongs to a socket in `idle`, and every way out
  // of `idle` (Take, the watch, Sweep, the destructor) cancels or ends it first.
  char peek_sink = 0;

  // Removes and returns the idle spell `id` of `key` (nullopt when it was taken or dropped).
  std::optional<Socket> Remove(const std::string& key, uint64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = idle.find(key);
    if (it == idle.end()) return std::nullopt;
    auto& list = it->second;
    for (auto i = list.begin(); i != list.end(); ++i) {
      if (i->id != id) continue;
      std::optional<Socket> out(std::move(i->socket));
      list.erase(i);
      if (list.empty()) idle.erase(it);
      return out;
    }
    return std::nullopt;
  }
};

namespace {

// The TCP socket under a pooled connection (the watch, cancels and closes act on it).
boost::asio::ip::tcp::socket& TcpOf(boost::asio::ip::tcp::socket& s) { return s; }
boost::asio::ip::tcp::socket& TcpOf(Stream& s) { return s.lowest_layer(); }

template <typename Conn>
void Close(Conn& socket) {
  boost::system::error_code ignore;
  TcpOf(socket).close(ignore);
}

}  // namespace

// Starts watching an idle connection (called with the pool's mutex held, so no Take can hand the
// socket out before its watch exists). Readable while idle = closed by the engine or bytes unasked
// for: drop it. A 1-byte MSG_PEEK receive rather than async_wait: Asio 1.74's epoll reactor
// re-registers the descriptor (epoll_ctl MOD) for every async_wait; the receive costs one
// speculative recv. The handler owns only a weak reference: the pool may be gone when it runs.
template <typename Conn>
void BasicUpstreamPool<Conn>::Watch(const std::shared_ptr<State>& state, const std::string& key,
                                    Socket& socket, uint64_t id, char* sink) {
  TcpOf(socket).async_receive(
      boost::asio::buffer(sink, 1), boost::asio::socket_base::message_peek,
      [weak = std::weak_ptr<State>(state), key, id](const boost::system::error_code& ec, size_t) {
        if (ec == boost::asio::error::operation_aborted) return;  // taken, closed
        auto st = weak.lock();
        if (!st) return;
        if (auto s = st->Remove(key, id)) Close(*s);
      });
}

template <typename Conn>
BasicUpstreamPool<Conn>::BasicUpstreamPool(Options options)
    : options_(options), state_(std::make_shared<State>()) {}

template <typename Conn>
BasicUpstreamPool<Conn>::~BasicUpstreamPool() {
  std::map<std::string, std::vector<typename State::Idle>> all;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    all.swap(state_->idle);
  }
  for (auto& [key, list] : all) {
    for (typename State::Idle& i : list) Close(i.socket);
  }
}

template <typename Conn>
std::optional<Conn> BasicUpstreamPool<Conn>::Take(const std::string& key, TimePoint now) {
  std::vector<Socket> to_close;
  std::optional<Socket> out;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->idle.find(key);
    if (it == state_->idle.end()) return std::nullopt;
    auto& list = it->second;
    while (!list.empty()) {
      typename State::Idle& i = list.back();
      if (now - i.since > options_.idle_timeout || !TcpOf(i.socket).is_open()) {
        to_close.push_back(std::move(i.socket));
      } else {
        // Cancelling the watch's receive costs no system call; the next read then waits for the
        // response without a speculative recv.
        if (i.watched) {
          boost::system::error_code ignore;
          TcpOf(i.socket).cancel(ignore);
        }
        out.emplace(std::move(i.socket));
      }
      list.pop_back();
      if (out) break;
    }
    if (list.empty()) state_->idle.erase(it);
  }
  for (Socket& s : to_close) Close(s);
  return out;
}

template <typename Conn>
void BasicUpstreamPool<Conn>::Put(const std::string& key, Socket socket, TimePoint now) {
  if (!TcpOf(socket).is_open()) return;
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (options_.max_idle_per_host > 0) {
      auto& list = state_->idle[key];
      if (static_cast<int>(list.size()) < options_.max_idle_per_host) {
        id = state_->next_id++;
        list.push_back(typename State::Idle{id, std::move(socket), now});
        return;
      }
    }
  }
  Close(socket);
}

template <typename Conn>
int BasicUpstreamPool<Conn>::Sweep(TimePoint now) {
  std::vector<Socket> to_close;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto it = state_->idle.begin(); it != state_->idle.end();) {
      auto& list = it->second;
      size_t keep = 0;
      for (size_t k = 0; k < list.size(); ++k) {
        if (now - list[k].since > options_.idle_timeout) {
          to_close.push_back(std::move(list[k].socket));
          continue;
        }
        if (!list[k].watched) {
          list[k].watched = true;
          Watch(state_, it->first, list[k].socket, list[k].id, &state_->peek_sink);
        }
        if (keep != k) list[keep] = std::move(list[k]);
        ++keep;
      }
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(keep), list.end());
      it = list.empty() ? state_->idle.erase(it) : std::next(it);
    }
  }
  for (Socket& s : to_close) Close(s);
  return static_cast<int>(to_close.size());
}

template <typename Conn>
size_t BasicUpstreamPool<Conn>::IdleCount(const std::string& key) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!key.empty()) {
    auto it = state_->idle.find(key);
    return it == state_->idle.end() ? 0 : it->second.size();
  }
  size_t n = 0;
  for (const auto& [k, list] : state_->idle) n += list.size();
  return n;
}

template class BasicUpstreamPool<boost::asio::ip::tcp::socket>;
template class BasicUpstreamPool<Stream>;

}  // namespace kvbridge::proxy
