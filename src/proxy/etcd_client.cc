#include "kvbridge/proxy/etcd_client.h"

#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvbridge/common/logging.h"

namespace kvbridge::proxy {
namespace {

using nlohmann::json;

bool IsLoopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

// A watch stream idle this long is reopened from the last revision (a member that went away
// without closing the connection is left behind at the latest then).
constexpr DurationUs kStreamIdleTimeout = 30 * kSecond;

// Blocking calls to the members, one thread at a time; Abort() (any thread) breaks the stream in
// progress.
class Transport {
 public:
  explicit Transport(EtcdClientOptions o) : o_(std::move(o)), tokens_(o_.endpoints.size()) {}

  EtcdReply Call(const EtcdCall& c) {
    EtcdReply r;
    r.id = c.id;
    auto cli = Client(c.endpoint, o_.request_timeout);
    if (!Authenticate(c.endpoint)) {
      r.transport = UnavailableError("etcd " + Url(c.endpoint) + ": authentication failed");
      return r;
    }
    auto res = cli->Post(c.path.c_str(), Headers(c.endpoint), c.body, "application/json");
    if (!res) {
      r.transport = UnavailableError("etcd " + Url(c.endpoint) + c.path + ": " +
                                     HttpErrorText(*cli, res.error(), o_.tls));
      return r;
    }
    if (res->status == 401 && !o_.user.empty()) tokens_[c.endpoint].clear();  // expired token
    r.http_status = res->status;
    r.body = std::move(res->body);
    return r;
  }

  // The stream's messages go to on_message (false from it closes the stream).
  EtcdReply Stream(const EtcdCall& c, const std::function<bool(std::string_view)>& on_message) {
    EtcdReply r;
    r.id = c.id;
    if (!Authenticate(c.endpoint)) {
      r.transport = UnavailableError("etcd " + Url(c.endpoint) + ": authentication failed");
      return r;
    }
    std::shared_ptr<httplib::Client> cli = Client(c.endpoint, kStreamIdleTimeout);
    {
      std::lock_guard<std::mutex> lock(stream_mu_);
      if (aborted_) {
        r.transport = CancelledError("stopped");
        return r;
      }
      stream_ = cli;
    }
    std::string buffer;
    bool closed_by_us = false;
    httplib::Request req;
    req.method = "POST";
    req.path = c.path;
    req.headers = Headers(c.endpoint);
    req.body = c.body;
    req.set_header("Content-Type", "application/json");
    int status = 0;
    req.response_handler = [&](const httplib::Response& res) {
      status = res.status;
      return true;
    };
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      buffer.append(data, n);
      size_t start = 0;
      for (size_t nl; (nl = buffer.find('\n', start)) != std::string::npos; start = nl + 1) {
        std::string_view line(buffer.data() + start, nl - start);
        if (line.empty() || status != 200) continue;
        if (!on_message(line)) {
          closed_by_us = true;
          return false;
        }
      }
      buffer.erase(0, start);
      return true;
    };
    auto res = cli->send(req);
    {
      std::lock_guard<std::mutex> lock(stream_mu_);
      stream_.reset();
    }
    if (closed_by_us) {
      r.transport = CancelledError("closed");
    } else if (!res) {
      r.transport = UnavailableError("etcd " + Url(c.endpoint) + c.path + ": " +
                                     HttpErrorText(*cli, res.error(), o_.tls));
    } else {
      r.http_status = res->status;
      if (res->status == 200) {
        r.transport = UnavailableError("etcd " + Url(c.endpoint) + " ended the watch stream");
      } else {
        r.body = buffer;
      }
    }
    return r;
  }

  void Abort() {
    std::lock_guard<std::mutex> lock(stream_mu_);
    aborted_ = true;
    if (stream_) stream_->stop();
  }

  std::string Url(int endpoint) const { return o_.endpoints[endpoint].Url(); }

 private:
  std::shared_ptr<httplib::Client> Client(int endpoint, DurationUs read_timeout) {
    std::shared_ptr<httplib::Client> cli = MakeHttpClient(o_.endpoints[endpoint], o_.tls);
    cli->set_tcp_nodelay(true);
    cli->set_connection_timeout(o_.request_timeout / kSecond, o_.request_timeout % kSecond);
    cli->set_read_timeout(read_timeout / kSecond, read_timeout % kSecond);
    cli->set_write_timeout(o_.request_timeout / kSecond, o_.request_timeout % kSecond);
    return cli;
  }

  httplib::Headers Headers(int endpoint) {
    httplib::Headers h;
    if (!tokens_[endpoint].empty()) h.emplace("Authorization", tokens_[endpoint]);
    return h;
  }

  // etcd auth: a token per member (a token is only valid where it was issued, with the simple
  // token provider etcd 3.4 defaults to).
  bool Authenticate(int endpoint) {
    if (o_.user.empty() || !tokens_[endpoint].empty()) return true;
    auto cli = Client(endpoint, o_.request_timeout);
    json body = {{"name", o_.user}, {"password", o_.password}};
    auto res = cli->Post("/v3/auth/authenticate", body.dump(), "application/json");
    if (!res || res->status != 200) {
      KVB_LOG_WARN("etcd {}: authenticate as {} failed: {}", Url(endpoint), o_.user,
                   res ? std::to_string(res->status) + " " + res->body
                       : HttpErrorText(*cli, res.error(), o_.tls));
      return false;
    }
    json j = json::parse(res->body, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("token") || !j["token"].is_string()) {
      return false;
    }
    tokens_[endpoint] = j["token"].get<std::string>();
    return true;
  }

  EtcdClientOptions o_;
  std::vector<std::string> tokens_;
  std::mutex stream_mu_;
  std::shared_ptr<httplib::Client> stream_;
  bool aborted_ = false;
};

// Waits until `at` (or forever when nullopt), or until stop.
template <typename Pred>
void WaitUntil(std::mutex& mu, std::condition_variable& cv, std::optional<TimePoint> at,
               Pred stop) {
  std::unique_lock<std::mutex> lock(mu);
  if (!at) {
    cv.wait(lock, stop);
    return;
  }
  const DurationUs left = *at - SteadyNow();
  if (left > 0) cv.wait_for(lock, std::chrono::microseconds(left), stop);
}

}  // namespace

Result<EtcdClientOptions> ParseEtcdOptions(std::string_view endpoints, std::string_view user,
                                           std::string_view ca_file) {
  EtcdClientOptions o;
  std::string list(endpoints);
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    std::string one = list.substr(start, comma - start);
    if (!one.empty()) {
      auto t = ParseHttpTarget(one);
      if (!t.ok()) return t.status().WithPrefix("--etcd");
      o.endpoints.push_back(*t);
    }
    start = comma + 1;
  }
  if (o.endpoints.empty()) return InvalidArgumentError("--etcd names no member");
  if (!user.empty()) {
    auto colon = user.find(':');
    if (colon == std::string_view::npos || colon == 0) {
      return InvalidArgumentError("--etcd-user must be USER:PASSWORD");
    }
    o.user = std::string(user.substr(0, colon));
    o.password = std::string(user.substr(colon + 1));
  }
  o.tls.ca_file = std::string(ca_file);
  for (const HttpTarget& t : o.endpoints) {
    if (IsLoopback(t.host)) continue;
    const bool tls_verified = t.https && !o.tls.ca_file.empty();
    if (o.user.empty() && !tls_verified) {
      return InvalidArgumentError(
          "refusing etcd member " + t.Url() +
          " off loopback without authentication: anyone who can write to it could register an "
          "engine and receive prompts; give --etcd-user USER:PASSWORD (etcd auth enabled) or "
          "https:// members with --etcd-ca CA.pem");
    }
  }
  return o;
}

// --- EtcdRegistration -----------------------------------------------------------------------

struct EtcdRegistration::Impl {
  Impl(EtcdClientOptions o, EtcdLeaseOptions lo)
      : endpoints(o.endpoints.size()), transport(o), keeper(std::move(lo)) {}
  size_t endpoints;
  Transport transport;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool has_value = false;
  std::string value;
  EtcdLeaseKeeper keeper;  // the thread's own
  std::thread thread;
};

EtcdRegistration::EtcdRegistration(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<EtcdRegistration> EtcdRegistration::Start(EtcdClientOptions options,
                                                          std::string key, std::string value,
                                                          int64_t ttl_s) {
  EtcdLeaseOptions lo;
  lo.endpoints = static_cast<int>(options.endpoints.size());
  lo.key = std::move(key);
  lo.value = std::move(value);
  lo.ttl_s = ttl_s;
  lo.retry_backoff = options.retry_backoff;
  std::unique_ptr<EtcdRegistration> r(
      new EtcdRegistration(std::make_unique<Impl>(options, std::move(lo))));
  EtcdRegistration* self = r.get();
  r->impl_->thread = std::thread([self] {
    Impl& m = *self->impl_;
    EtcdLeaseKeeper& k = m.keeper;
    k.Start(SteadyNow());
    bool was_registered = false;
    std::string last_logged;
    for (;;) {
      // A reply may make the next call (grant -> put): run them until none is left.
      for (auto calls = k.TakeCalls(); !calls.empty(); calls = k.TakeCalls()) {
        for (EtcdCall& c : calls) k.OnReply(m.transport.Call(c), SteadyNow());
      }
      if (k.state() == EtcdLeaseKeeper::State::kStopped) break;
      self->registered_.store(k.registered());
      self->lease_id_.store(k.lease_id());
      self->grants_.store(k.grants());
      if (k.registered() && !was_registered) {
        KVB_LOG_INFO("etcd: registered (lease {:x}, via {})", k.lease_id(),
                     m.transport.Url(k.endpoint()));
      }
      was_registered = k.registered();
      if (!k.last_error().empty() && k.last_error() != last_logged) {
        KVB_LOG_WARN("etcd registration: {}", k.last_error());
      }
      last_logged = k.last_error();
      bool stopping = false;
      {
        std::unique_lock<std::mutex> lock(m.mu);
        if (m.has_value) {
          m.has_value = false;
          k.SetValue(std::move(m.value), SteadyNow());
          continue;
        }
        stopping = m.stop;
      }
      if (stopping) {
        // Revoke: the key goes now rather than at the lease's expiry. One try per member,
        // starting with the one that answered last.
        const int64_t lease = k.lease_id();
        k.Stop(SteadyNow());
        k.TakeCalls();
        const int n = static_cast<int>(m.endpoints);
        for (int i = 0; i < n && lease != 0; ++i) {
          EtcdCall c;
          c.endpoint = (k.endpoint() + i) % n;
          c.path = "/v3/lease/revoke";
          c.body = json{{"ID", std::to_string(lease)}}.dump();
          EtcdReply rr = m.transport.Call(c);
          if (rr.transport.ok() && rr.http_status == 200) break;
        }
        break;
      }
      WaitUntil(m.mu, m.cv, k.next_tick(), [&] { return m.stop || m.has_value; });
      k.OnTick(SteadyNow());
    }
  });
  return r;
}

void EtcdRegistration::SetValue(std::string value) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->value = std::move(value);
    impl_->has_value = true;
  }
  impl_->cv.notify_all();
}

void EtcdRegistration::Stop() {
  if (!impl_->thread.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
  registered_.store(false);
}

EtcdRegistration::~EtcdRegistration() { Stop(); }

// --- EtcdWatchFeed --------------------------------------------------------------------------

struct EtcdWatchFeed::Impl {
  Impl(EtcdClientOptions o, EtcdWatchOptions wo) : transport(o), watcher(std::move(wo)) {}
  Transport transport;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  EtcdPrefixWatcher watcher;
  Apply apply;
  std::thread thread;
};

namespace {
bool Stopping(EtcdWatchFeed::Impl& m) {
  std::lock_guard<std::mutex> lock(m.mu);
  return m.stop;
}
}  // namespace

EtcdWatchFeed::EtcdWatchFeed(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<EtcdWatchFeed> EtcdWatchFeed::Start(EtcdClientOptions options, std::string prefix,
                                                    Apply apply) {
  EtcdWatchOptions wo;
  wo.endpoints = static_cast<int>(options.endpoints.size());
  wo.prefix = std::move(prefix);
  wo.retry_backoff = options.retry_backoff;
  std::unique_ptr<EtcdWatchFeed> f(
      new EtcdWatchFeed(std::make_unique<Impl>(options, std::move(wo))));
  f->impl_->apply = std::move(apply);
  EtcdWatchFeed* self = f.get();
  f->impl_->thread = std::thread([self] {
    Impl& m = *self->impl_;
    EtcdPrefixWatcher& w = m.watcher;
    std::string last_logged;
    bool quiet = false;  // the stream just ended at its idle timeout: routine, not worth a warning
    auto flush = [&] {
      std::vector<EtcdKvUpdate> u = w.TakeUpdates();
      self->revision_.store(w.revision());
      self->lists_.store(w.lists());
      self->watches_.store(w.watches());
      if (!u.empty() && m.apply) m.apply(std::move(u));
      if (!w.last_error().empty() && w.last_error() != last_logged) {
        if (quiet) {
          KVB_LOG_DEBUG("etcd watch: {}", w.last_error());
        } else {
          KVB_LOG_WARN("etcd watch: {}", w.last_error());
        }
      }
      last_logged = w.last_error();
    };
    w.Start(SteadyNow());
    for (;;) {
      // A reply may make the next call (range -> watch): run them until none is left.
      for (auto calls = w.TakeCalls(); !calls.empty() && !Stopping(m); calls = w.TakeCalls()) {
        EtcdCall& c = calls.front();  // one call at a time: the watcher has one out
        EtcdReply r;
        quiet = false;
        if (c.stream) {
          const uint64_t id = c.id;
          const TimePoint opened = SteadyNow();
          r = m.transport.Stream(c, [&](std::string_view line) {
            w.OnStreamMessage(id, line, SteadyNow());
            bool keep = true;
            for (uint64_t closed : w.TakeCloses()) keep = keep && closed != id;
            flush();
            return keep;
          });
          quiet = !r.transport.ok() && SteadyNow() - opened >= kStreamIdleTimeout - kSecond;
        } else {
          r = m.transport.Call(c);
        }
        if (Stopping(m)) break;
        w.OnReply(r, SteadyNow());
        w.TakeCloses();
        flush();
      }
      {
        std::lock_guard<std::mutex> lock(m.mu);
        if (m.stop) break;
      }
      WaitUntil(m.mu, m.cv, w.next_tick(), [&] { return m.stop; });
      w.OnTick(SteadyNow());
    }
    w.Stop();
  });
  return f;
}

void EtcdWatchFeed::Stop() {
  if (!impl_->thread.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->transport.Abort();
  impl_->thread.join();
}

EtcdWatchFeed::~EtcdWatchFeed() { Stop(); }

}  // namespace kvbridge::proxy
