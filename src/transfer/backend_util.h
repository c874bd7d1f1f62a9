// src/transfer/backend_util.h — pieces every transport backend (backends/<name>/) needs alike:
// the inbound connections an accept thread owns, the accept call itself, joining a connection's
// own thread from any thread, a job split into parts, and the bounds check of a segment against a
// peer's mapped layers. The backends differ in how they move bytes, not in these.
//
//   InboundConns<Channel> inbound_;
//   // accept thread:
//   for (int fd; (fd = AcceptRetrying(listen_fd)) >= 0;) {
//     auto ch = std::make_shared<Channel>(fd, ...);
//     if (!inbound_.Add(ch, [](const Channel& c) { return !c.alive(); })) return;  // shut down
//     ch->StartReader();
//   }
//   // Shutdown(): std::list<std::shared_ptr<Channel>> conns;
//   //             if (!inbound_.Shut(&conns)) return;  ... join the accept thread, Close each
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <utility>

#include "kvbridge/common/status.h"
#include "kvbridge/transfer/backend.h"

namespace kvbridge::transfer {

/// Accepts one connection on `listen_fd` (close-on-exec), retrying EINTR and ECONNABORTED.
/// Returns the fd, or -1 once the listener is shut down or closed (the accept loop ends).
inline int AcceptRetrying(int listen_fd) {
  for (;;) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0 || (errno != EINTR && errno != ECONNABORTED)) return fd;
  }
}

/// Joins a connection's own thread; from that very thread (a callback closing its connection)
/// detaches it instead, since a thread cannot join itself.
inline void JoinOrDetach(std::thread& t) {
  if (!t.joinable()) return;
  if (t.get_id() == std::this_thread::get_id()) {
    t.detach();
  } else {
    t.join();
  }
}

/// The connections a backend accepted. Thread-safe: the accept thread adds, Shutdown takes.
template <typename Conn>
class InboundConns {
 public:
  /// Adds `c`, first closing and dropping every held connection for which `gone(conn)` is true
  /// (its peer left). False, and `c` not added, once Shut has run.
  template <typename Gone>
  bool Add(std::shared_ptr<Conn> c, Gone gone) {
    std::lock_guard<std::mutex> l(mu_);
    if (shut_) return false;
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (gone(**it)) {
        (*it)->Close();
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
    conns_.push_back(std::move(c));
    return true;
  }

  /// Refuses later Adds and moves the held connections to *out (for the caller to Close once
  /// its accept thread has ended). False when Shut already ran.
  bool Shut(std::list<std::shared_ptr<Conn>>* out) {
    std::lock_guard<std::mutex> l(mu_);
    if (shut_) return false;
    shut_ = true;
    out->swap(conns_);
    return true;
  }

 private:
  std::mutex mu_;
  bool shut_ = false;
  std::list<std::shared_ptr<Conn>> conns_;
};

/// A job split into parts that finish on any threads: the last part to finish calls
/// job->finish once with the combined status — Unavailable (the peer is gone) over any other
/// error, any error over Cancelled, Cancelled over OK.
class JobParts {
 public:
  explicit JobParts(int parts) : remaining_(parts) {}

  void Done(const std::shared_ptr<TransferJob>& job, Status s) {
    if (!s.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      if (status_.ok() || status_.code() == StatusCode::kCancelled ||
          (s.code() == StatusCode::kUnavailable && status_.code() != StatusCode::kUnavailable)) {
        status_ = std::move(s);
      }
    }
    // acq_rel: the last part must see every other part's status write.
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      Status final_status;
      {
        std::lock_guard<std::mutex> l(mu_);
        final_status = status_;
      }
      if (job->finish) job->finish(std::move(final_status));
    }
  }

 private:
  std::atomic<int> remaining_;
  std::mutex mu_;
  Status status_;
};

/// True when `s` lies inside the peer's layer `s.remote_layer` of `layer_bytes[i]` bytes.
inline bool SegmentFitsPeer(const Segment& s, std::span<const uint64_t> layer_bytes) {
  return s.remote_layer < layer_bytes.size() && s.remote_offset <= layer_bytes[s.remote_layer] &&
         s.length <= layer_bytes[s.remote_layer] - s.remote_offset;
}

}  // namespace kvbridge::transfer
