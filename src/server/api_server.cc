#include "kvbridge/server/api_server.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/logging.h"
#include "kvbridge/common/thread_annotations.h"
#include "kvbridge/engine/engine.h"
#include "server/openai_protocol.h"

namespace kvbridge::server {

using nlohmann::json;

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(20);

void SetError(httplib::Response& res, int status, std::string_view message,
              std::string_view param = "") {
  res.status = status;
  res.set_content(OpenAiErrorBody(status, message, param), "application/json");
  // 503: the engine admitted nothing (its queue is full: --max-waiting-requests; draining;
  // shutting down). Told when to try again, as the proxy's 429 is.
  if (status == 503) res.set_header("Retry-After", "1");
}

// The socket of the plain-HTTP connection the calling thread serves (PlainHttpServer sets it for
// the connection's lifetime; handlers and content providers run on that thread).
thread_local int t_connection_fd = -1;

// True on the thread answering a connection the HTTP thread pool had no room to queue
// (BoundedThreadPool): its request gets 503 with Retry-After and the connection is closed.
thread_local bool t_shed_connection = false;

// httplib's ThreadPool with a bounded queue. A connection is served by one of `threads` workers
// for its whole keep-alive life; connections past them wait in a queue — at most `max_queued`:
// a connection past that is handed to one shedding thread instead, which reads its request and
// answers 503 (t_shed_connection) at once, so the engine's connection queue is bounded as its
// request queue (--max-waiting-requests) is, and a flood is told to come back rather than
// queued for minutes. (0.11.4's own ThreadPool queues without bound.)
class BoundedThreadPool final : public httplib::TaskQueue {
 public:
  BoundedThreadPool(int threads, int max_queued, Counter* shed)
      : max_queued_(static_cast<size_t>(std::max(0, max_queued))), shed_(shed) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Work(/*shedder=*/false); });
    workers_.emplace_back([this] { Work(/*shedder=*/true); });
  }
  ~BoundedThreadPool() override = default;

  void enqueue(std::function<void()> fn) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (jobs_.size() < max_queued_) {
        jobs_.push_back(std::move(fn));
      } else {
        shed_jobs_.push_back(std::move(fn));
        if (shed_ != nullptr) shed_->Inc();
      }
    }
    cv_.notify_all();
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutdown_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  void Work(bool shedder) {
    t_shed_connection = shedder;
    std::deque<std::function<void()>>& mine = shedder ? shed_jobs_ : jobs_;
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !mine.empty() || shutdown_; });
        if (shutdown_ && mine.empty()) return;
        fn = std::move(mine.front());
        mine.pop_front();
      }
      fn();
    }
  }

  const size_t max_queued_;
  Counter* shed_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;       // GUARDED_BY(mu_)
  std::deque<std::function<void()>> shed_jobs_;  // GUARDED_BY(mu_)
  bool shutdown_ = false;                        // GUARDED_BY(mu_)
  std::vector<std::thread> workers_;
};

// The socket of the connection `req` came on: TLS requests carry their SSL*, plain ones are
// served by PlainHttpServer on this thread. -1 when unknown (then no disconnect is detected).
int RequestSocket(const httplib::Request& req) {
  if (req.ssl != nullptr) return SSL_get_fd(req.ssl);
  return t_connection_fd;
}

// True once the peer closed (FIN/RST). A peer that only half-closes its sending side after the
// request counts as gone too (HTTP clients do not do that while waiting for an answer).
bool ConnectionClosed(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  if (p.revents & POLLIN) {
    char c;
    return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
  }
  return false;
}

// poll() for `events` on fd up to timeout_ms, retrying on EINTR; true when ready.
bool PollFor(int fd, short events, int timeout_ms) {
  pollfd p{fd, events, 0};
  int n;
  do {
    n = poll(&p, 1, timeout_ms);
  } while (n < 0 && errno == EINTR);
  return n > 0;
}

int TimeoutMs(time_t sec, time_t usec) { return static_cast<int>(sec * 1000 + usec / 1000); }

// "ip", port of a socket's peer (getpeername) or local end (getsockname), numeric as httplib has
// them.
void SocketAddress(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  auto* sa = reinterpret_cast<sockaddr*>(&ss);
  if ((peer ? getpeername(fd, sa, &len) : getsockname(fd, sa, &len)) != 0) return;
  char host[NI_MAXHOST] = {0};
  if (getnameinfo(sa, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return;
  ip = host;
  port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

// One plain-HTTP connection as a cpp-httplib Stream: reads buffered (the request parser reads a
// byte at a time), both directions bounded by the server's read/write timeouts, writes with
// MSG_NOSIGNAL. cpp-httplib 0.11.4 keeps its own socket stream out of its header.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(int fd, int read_timeout_ms, int write_timeout_ms)
      : fd_(fd), read_timeout_ms_(read_timeout_ms), write_timeout_ms_(write_timeout_ms) {}

  bool is_readable() const override { return PollFor(fd_, POLLIN, read_timeout_ms_); }
  bool is_writable() const override { return PollFor(fd_, POLLOUT, write_timeout_ms_); }
  ssize_t read(char* ptr, size_t size) override {
    if (buffered() == 0) {
      if (!is_readable()) return -1;
      if (size >= sizeof(buf_)) return Recv(ptr, size);
      const ssize_t n = Recv(buf_, sizeof(buf_));
      if (n <= 0) return n;
      begin_ = 0;
      end_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, buffered());
    std::memcpy(ptr, buf_ + begin_, n);
    begin_ += n;
    return static_cast<ssize_t>(n);
  }
  using httplib::Stream::write;
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    do {
      n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    SocketAddress(fd_, /*peer=*/true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    SocketAddress(fd_, /*peer=*/false, ip, port);
  }
  socket_t socket() const override { return fd_; }
  /// Bytes read from the socket and not yet consumed (a pipelined next request).
  size_t buffered() const { return end_ - begin_; }

 private:
  ssize_t Recv(char* ptr, size_t size) {
    ssize_t n;
    do {
      n = ::recv(fd_, ptr, size, 0);
    } while (n < 0 && errno == EINTR);
    return n;
  }

  int fd_;
  int read_timeout_ms_, write_timeout_ms_;
  char buf_[4096];
  size_t begin_ = 0, end_ = 0;
};

std::string RandomHex(int n) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += kHex[rng() & 15];
  return s;
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

HttpRequest ToHttpRequest(const httplib::Request& req) {
  HttpRequest r;
  r.method = req.method;
  r.path = req.path;
  r.body = req.body;
  for (const auto& [k, v] : req.headers) r.headers.emplace(k, v);
  for (const auto& m : req.matches) r.path_matches.push_back(m.str());
  r.remote_addr = req.remote_addr;
  for (const auto& [k, v] : req.params) r.query.emplace(k, v);
  return r;
}

// cpp-httplib 0.11.4 listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, compiled into
// Debian's library): 64 clients connecting at once overflow the accept queue and some see their
// connection dropped ("Read" errors). Re-calling listen() on the bound socket raises it.
template <typename Base>
class BacklogServer : public Base {
 public:
  using Base::Base;
  bool RaiseListenBacklog(int backlog) const { return ::listen(this->svr_sock_, backlog) == 0; }
};

// Plain HTTP with each connection served here instead of in the library, so that the thread
// serving it knows its socket (t_connection_fd) and a handler can watch that one socket for the
// client going away. 0.11.4 gives handlers no socket, but lets a subclass serve a connection
// (process_and_close_socket is virtual, process_request protected); the loop keeps the
// library's keep-alive rules: at most keep_alive_max_count_ requests, an idle connection closed
// after keep_alive_timeout_sec_, the last request answered with "Connection: close".
class PlainHttpServer final : public BacklogServer<httplib::Server> {
 private:
  bool process_and_close_socket(socket_t sock) override {
    // A response's headers and body go out in separate writes: with Nagle the body waits for
    // the peer's delayed ACK of the headers (~40 ms) on a keep-alive connection (the proxy's
    // legs), which added ~45 ms to half the P/D requests' first token.
    const int one = 1;
    ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ConnectionStream strm(sock, TimeoutMs(read_timeout_sec_, read_timeout_usec_),
                          TimeoutMs(write_timeout_sec_, write_timeout_usec_));
    t_connection_fd = sock;
    bool ret = false;
    // A shed connection (BoundedThreadPool) gets one answer, its 503, then is closed.
    const size_t max_requests = t_shed_connection ? 1 : keep_alive_max_count_;
    for (size_t left = max_requests; left > 0 && NextRequestArrives(strm); --left) {
      bool connection_closed = false;
      ret = process_request(strm, /*close_connection=*/left == 1, connection_closed, nullptr);
      if (!ret || connection_closed) break;
    }
    t_connection_fd = -1;
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ret;
  }

  // Waits (in slices, so Stop() is not held up by idle connections) until the next request's
  // bytes arrive; false when the keep-alive timeout passes or the server stops.
  bool NextRequestArrives(const ConnectionStream& strm) const {
    if (strm.buffered() > 0) return true;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(keep_alive_timeout_sec_);
    while (svr_sock_ != INVALID_SOCKET) {
      if (PollFor(strm.socket(), POLLIN, 50)) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
    }
    return false;
  }
};
using HttpServer = PlainHttpServer;
using HttpsServer = BacklogServer<httplib::SSLServer>;  // --ssl-certfile / --ssl-keyfile

// One HTTP generation request: its engine requests (one per prompt) and their outputs.
struct Job {
  Job(const ParsedRequest& parsed, const Tokenizer& tok, std::string id, std::string model)
      : builder(parsed, tok, std::move(id), std::move(model), UnixSeconds()) {}
  Mutex mu;
  std::condition_variable cv;
  ResponseBuilder builder GUARDED_BY(mu);
  uint64_t version GUARDED_BY(mu) = 0;   // bumps on every engine output
  std::vector<std::string> request_ids;  // set before the first AddRequest returns; then const
  std::atomic<bool> aborted{false};
  // The leg's timing (docs/metrics.md "Per-request P/D timeline"); set before the first
  // AddRequest, then const, except `times` (one per prompt, from its final output).
  TimePoint received = 0;  // the HTTP handler started
  TimePoint added = 0;     // parsed and tokenized: the engine requests are queued
  bool want_timing = false;
  nlohmann::json kv_transfer_params;
  std::vector<RequestTimes> times GUARDED_BY(mu);
};

// A client's X-Request-Id as this engine uses it inside its request ids (so every log line that
// names the request names it too): at most 64 characters of [A-Za-z0-9.:-], others as '-'
// ('_' splits sibling ids). Empty when absent.
std::string SanitizedRequestId(const std::string& header) {
  std::string out;
  for (char c : header.substr(0, 64)) {
    const bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == ':' || c == '-';
    out += ok ? c : '-';
  }
  return out;
}

// "prefill" | "decode" | "colocated", and "read" | "write" | "colocated", from the request's
// kv_transfer_params.
std::pair<const char*, const char*> RoleAndMode(const json& kv) {
  if (!kv.is_object()) return {"colocated", "colocated"};
  const char* mode = kv.value("mode", std::string("read")) == "write" ? "write" : "read";
  if (kv.value("do_remote_decode", false)) return {"prefill", mode};
  if (kv.value("do_remote_prefill", false)) return {"decode", mode};
  return {"colocated", "colocated"};
}

// One leg's timing as the proxy reads it (X-KVBridge-Timing, or the stream's
// ": kvbridge-timing" comment): times in µs after the HTTP handler started, absent when the
// event did not happen; "kv" is the decode's load record (READ: read_posted/read_ended/ack,
// WRITE: write_requested/write_done and the prefill's write_micros; bytes, blocks, backend).
// A request of several prompts (`times`: one per prompt) gives one timing: the earliest start
// and the latest end of each phase, the sum of bytes/blocks, and "prompts".
json TimingJson(const Job& job, const std::vector<RequestTimes>& times, TimePoint responded) {
  auto [role, mode] = RoleAndMode(job.kv_transfer_params);
  auto earliest = [&](TimePoint RequestTimes::*f) {
    TimePoint v = -1;
    for (const RequestTimes& t : times) {
      if (t.*f >= 0 && (v < 0 || t.*f < v)) v = t.*f;
    }
    return v;
  };
  auto latest = [&](TimePoint RequestTimes::*f) {
    TimePoint v = -1;
    for (const RequestTimes& t : times) v = std::max(v, t.*f);
    return v;
  };
  json at = json::object();
  auto put = [&](json& j, const std::string& key, TimePoint v) {
    if (v >= 0) j[key] = v - job.received;
  };
  put(at, "added", job.added);
  put(at, "scheduled", earliest(&RequestTimes::scheduled));
  put(at, "kv_wait_start", earliest(&RequestTimes::remote_kv_wait_start));
  put(at, "kv_wait_end", latest(&RequestTimes::remote_kv_wait_end));
  put(at, "first_token", earliest(&RequestTimes::first_token));
  put(at, "finished", latest(&RequestTimes::finished));
  put(at, "responded", responded);
  json out = {{"role", role}, {"mode", mode}, {"request_id", job.request_ids[0]}, {"t", at}};
  if (times.size() > 1) out["prompts"] = times.size();
  json kv = json::object();
  std::map<std::string, TimePoint> points;  // phase -> host µs, merged over prompts
  for (const RequestTimes& t : times) {
    if (!t.kv_load.is_object()) continue;
    for (const auto& [k, v] : t.kv_load.items()) {
      if (k.size() > 3 && k.compare(k.size() - 3, 3, "_us") == 0 && v.is_number_integer()) {
        const std::string phase = k.substr(0, k.size() - 3);
        const bool start =
            phase == "admitted" || phase == "read_posted" || phase == "write_requested";
        auto [it, fresh] = points.emplace(phase, v.get<TimePoint>());
        if (!fresh)
          it->second = start ? std::min(it->second, v.get<TimePoint>())
                             : std::max(it->second, v.get<TimePoint>());
      } else if (k == "backend") {
        kv.emplace(k, v);
      } else if (k == "write_micros" && v.is_number()) {
        kv[k] = std::max(kv.value(k, int64_t{0}), v.get<int64_t>());
      } else if ((k == "bytes" || k == "blocks" || k == "reads" || k == "writes") &&
                 v.is_number()) {
        kv[k] = kv.value(k, int64_t{0}) + v.get<int64_t>();
      }
    }
  }
  for (const auto& [phase, v] : points) put(kv, phase, v);
  if (!kv.empty()) out["kv"] = std::move(kv);
  return out;
}

}  // namespace

struct ApiServer::Impl {
  explicit Impl(Tokenizer tok) : tokenizer(std::move(tok)) {}
  ServerConfig config;
  Engine* engine = nullptr;
  Tokenizer tokenizer;
  ProtocolLimits limits;
  std::unique_ptr<httplib::Server> svr;  // HttpServer, or HttpsServer with TLS
  std::function<bool(int)> raise_backlog;
  std::thread listen_thread;
  int bound_port = -1;
  bool started = false;
  std::atomic<bool> stopping{false};
  std::atomic<bool> draining{false};
  Mutex stop_call_mu;  // serializes Stop()
  Mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopped GUARDED_BY(stop_mu) = false;

  Mutex jobs_mu;
  std::set<std::shared_ptr<Job>> live_jobs GUARDED_BY(jobs_mu);

  MetricsRegistry metrics;
  // kvbridge_request_phase_seconds{phase,mode,backend}: one request's phases on this engine.
  void ObservePhases(const Job& job, const RequestTimes& t) {
    auto [role, mode] = RoleAndMode(job.kv_transfer_params);
    (void)role;
    std::string backend = "none";
    TimePoint read_posted = -1, read_ended = -1, ack = -1;
    if (t.kv_load.is_object()) {
      backend = t.kv_load.value("backend", std::string("none"));
      read_posted = t.kv_load.value("read_posted_us", TimePoint{-1});
      read_ended = t.kv_load.value("read_ended_us", TimePoint{-1});
      ack = t.kv_load.value("ack_us", TimePoint{-1});
      if (read_posted < 0) {  // WRITE: from the WriteBlocks sent to the WriteDone received
        read_posted = t.kv_load.value("write_requested_us", TimePoint{-1});
        read_ended = t.kv_load.value("write_done_us", TimePoint{-1});
      }
    }
    const TimePoint queue_end = t.remote_kv_wait_start >= 0 ? t.remote_kv_wait_start : t.scheduled;
    const TimePoint ready = t.remote_kv_wait_end >= 0 ? t.remote_kv_wait_end : t.scheduled;
    const std::pair<const char*, std::pair<TimePoint, TimePoint>> phases[] = {
        {"tokenize", {job.received, job.added}},
        {"queue", {job.added, queue_end}},
        {"kv_wait", {t.remote_kv_wait_start, t.remote_kv_wait_end}},
        {"transfer", {read_posted, read_ended}},
        {"hold_valid_reply", {read_ended, ack}},
        {"first_token", {ready, t.first_token}},
        {"decode", {t.first_token, t.finished}},
    };
    for (const auto& [phase, span] : phases) {
      if (span.first < 0 || span.second < span.first) continue;
      metrics
          .AddHistogram("kvbridge_request_phase_seconds",
                        "One request's phases on this engine (docs/metrics.md).",
                        Histogram::PhaseBucketsSeconds(),
                        PrometheusLabels({{"phase", phase}, {"mode", mode}, {"backend", backend}}))
          .Observe(static_cast<double>(span.second - span.first) / kSecond);
    }
  }
  Gauge* m_in_flight = nullptr;
  Counter* m_disconnects = nullptr;
  Counter* m_engine_rejections = nullptr;
  Counter* m_shed_connections = nullptr;

  void AbortJob(Job& job) {
    if (job.aborted.exchange(true)) return;
    for (const std::string& id : job.request_ids) engine->Abort(id);
  }
  void Track(const std::shared_ptr<Job>& job) {
    MutexLock l(&jobs_mu);
    if (live_jobs.insert(job).second) m_in_flight->Add(1);
  }
  void Untrack(const std::shared_ptr<Job>& job) {
    MutexLock l(&jobs_mu);
    if (live_jobs.erase(job) > 0) m_in_flight->Add(-1);
  }

  // kvbridge_http_requests_total{code}: counted before the response is written (so a client
  // that reads /metrics after its answer sees it): successes when the handler returns, errors
  // (>= 400, whoever set them) in the error handler, which httplib calls before writing.
  void CountResponse(int status) {
    metrics
        .AddCounter("kvbridge_http_requests_total", "HTTP responses by status code.",
                    "code=\"" + std::to_string(status) + "\"")
        .Inc();
  }
  httplib::Server::Handler Counted(httplib::Server::Handler h) {
    return [this, h = std::move(h)](const httplib::Request& req, httplib::Response& res) {
      h(req, res);
      if (res.status < 400) CountResponse(res.status < 0 ? 200 : res.status);
    };
  }
  void InstallRoutes();
  void HandleGenerate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res);
};

void ApiServer::Impl::HandleGenerate(Endpoint endpoint, const httplib::Request& req,
                                     httplib::Response& res) {
  // The request's arrival, before parsing and tokenization (vLLM's arrival_time): TTFT and
  // e2e latency count from here.
  const TimePoint received = SteadyNow();
  if (stopping.load()) return SetError(res, 503, "the server is shutting down");
  if (draining.load()) return SetError(res, 503, "the server is draining");
  json body;
  if (auto err = ParseBody(req.body, &body)) {
    return SetError(res, err->status, err->message, err->param);
  }
  ParsedRequest parsed;
  std::optional<ApiError> err;
  if (endpoint == Endpoint::kCompletions) {
    err = ParseCompletionRequest(body, tokenizer, limits, &parsed);
  } else {
    // Key order matters to a template (tojson of tools): parsed once more, keeping it.
    const auto ordered = nlohmann::ordered_json::parse(req.body, nullptr, false);
    err = ParseChatRequest(body, tokenizer, limits, &parsed, &ordered);
  }
  if (err) return SetError(res, err->status, err->message, err->param);

  if (!parsed.kv_transfer_params.is_null()) {
    if (!config.validate_kv_transfer_params) {
      return SetError(res, 400, "P/D is not configured on this engine", "kv_transfer_params");
    }
    if (!config.cluster_token.empty() &&
        !ConstantTimeEquals(req.get_header_value("X-KVBridge-Cluster-Token"),
                            config.cluster_token)) {
      return SetError(res, 403, "kv_transfer_params need the cluster token", "kv_transfer_params");
    }
    // A prefill names the ids it prefilled: a decode that tokenized the prompt otherwise (another
    // tokenizer or model) must not use that KV.
    if (auto it = parsed.kv_transfer_params.find(kPromptDigestKey);
        it != parsed.kv_transfer_params.end()) {
      const std::string mine = PromptDigest(parsed.prompts[0]);
      if (!it->is_string() || it->get<std::string>() != mine) {
        return SetError(res, 500,
                        "kv_transfer_params: the prefill prefilled other prompt ids (" +
                            (it->is_string() ? it->get<std::string>() : it->dump()) +
                            " as count:digest) than this engine's (" + mine +
                            "): prefill and decode must serve the same model with the same "
                            "tokenizer",
                        "kv_transfer_params");
      }
      parsed.kv_transfer_params.erase(it);
    }
    Status s = config.validate_kv_transfer_params(parsed.kv_transfer_params);
    if (!s.ok()) return SetError(res, HttpStatusFromStatus(s), s.message(), "kv_transfer_params");
  }

  // A client's (or the proxy's) X-Request-Id is part of the engine's ids, as vLLM makes
  // "cmpl-{X-Request-Id}"; a random tail keeps a repeated header from clashing.
  const std::string xrid = SanitizedRequestId(req.get_header_value("X-Request-Id"));
  const std::string id = (endpoint == Endpoint::kCompletions ? "cmpl-" : "chatcmpl-") +
                         (xrid.empty() ? RandomHex(24) : xrid + "-" + RandomHex(8));
  auto job = std::make_shared<Job>(parsed, tokenizer, id, config.served_model_name);
  job->received = received;
  job->want_timing = req.has_header("X-KVBridge-Timing");
  job->kv_transfer_params = parsed.kv_transfer_params;
  const size_t num_prompts = parsed.prompts.size();
  for (size_t p = 0; p < num_prompts; ++p) {
    job->request_ids.push_back(num_prompts == 1 ? id : id + "-" + std::to_string(p));
  }
  {
    MutexLock l(&job->mu);
    job->times.resize(num_prompts);
  }
  Track(job);
  job->added = SteadyNow();
  for (size_t p = 0; p < num_prompts; ++p) {
    EngineRequest er;
    er.request_id = job->request_ids[p];
    er.prompt_token_ids = std::move(parsed.prompts[p]);
    er.sampling = parsed.sampling;
    er.kv_transfer_params = parsed.kv_transfer_params;
    er.arrival_time = received;
    Status s = engine->AddRequest(std::move(er), [job, p](const RequestOutput& out) {
      {
        MutexLock l(&job->mu);
        job->builder.Apply(p, out);
        if (out.finished) job->times[p] = out.times;
        ++job->version;
      }
      job->cv.notify_all();
    });
    if (!s.ok()) {
      // Nothing was queued for prompt p; end the prompts already queued.
      for (size_t q = 0; q < p; ++q) engine->Abort(job->request_ids[q]);
      job->aborted = true;
      Untrack(job);
      if (s.code() == StatusCode::kResourceExhausted) m_engine_rejections->Inc();
      return SetError(res, HttpStatusFromStatus(s), s.message());
    }
  }

  const int fd = RequestSocket(req);
  if (!parsed.stream) {
    MutexLock l(&job->mu);
    while (!job->builder.AllFinished()) {
      job->cv.wait_for(l.native(), kPollInterval);
      if (job->builder.AllFinished()) break;
      if (!job->aborted && (ConnectionClosed(fd) || stopping.load())) {
        if (!stopping.load()) m_disconnects->Inc();
        l.Unlock();
        AbortJob(*job);  // never call the engine while holding job->mu (its callback takes it)
        l.Lock();
      }
    }
    Status s = job->builder.FirstError();
    json out = job->builder.FinalBody();
    const std::vector<RequestTimes> times = job->times;
    l.Unlock();
    Untrack(job);
    if (!s.ok()) return SetError(res, HttpStatusFromStatus(s), s.message());
    for (const RequestTimes& t : times) ObservePhases(*job, t);
    res.status = 200;
    res.set_content(DumpJson(out), "application/json");
    if (job->want_timing) {
      res.set_header("X-KVBridge-Timing", TimingJson(*job, times, SteadyNow()).dump());
    }
    return;
  }

  auto seen = std::make_shared<uint64_t>(~uint64_t{0});
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job, fd, seen](size_t, httplib::DataSink& sink) -> bool {
        std::string frames;
        bool done = false;
        std::vector<RequestTimes> times;
        {
          MutexLock l(&job->mu);
          job->cv.wait_for(l.native(), kPollInterval,
                           [&]() REQUIRES(job->mu) { return job->version != *seen; });
          *seen = job->version;
          frames = job->builder.TakeStreamFrames();
          done = job->builder.StreamDone();
          if (done) times = job->times;
        }
        if (done && !times.empty()) {
          for (const RequestTimes& t : times) ObservePhases(*job, t);
          if (job->want_timing) {
            // An SSE comment (ignored by SSE clients) before [DONE]; the proxy strips it.
            const std::string comment =
                ": kvbridge-timing " + TimingJson(*job, times, SteadyNow()).dump() + "\n\n";
            static constexpr std::string_view kDone = "data: [DONE]\n\n";
            const bool ends_done =
                frames.size() >= kDone.size() &&
                frames.compare(frames.size() - kDone.size(), kDone.size(), kDone) == 0;
            frames.insert(ends_done ? frames.size() - kDone.size() : frames.size(), comment);
          }
        }
        if (!frames.empty() && !sink.write(frames.data(), frames.size())) return false;
        if (done) {
          sink.done();
          return true;
        }
        if (stopping.load()) return false;
        return !ConnectionClosed(fd);
      },
      [this, job](bool success) {
        bool finished;
        {
          MutexLock l(&job->mu);
          finished = job->builder.AllFinished();
        }
        if (!finished) {
          if (!success && !stopping.load()) m_disconnects->Inc();
          AbortJob(*job);
        }
        Untrack(job);
      });
}

void ApiServer::Impl::InstallRoutes() {
  svr->Post("/v1/completions", Counted([this](const httplib::Request& req, httplib::Response& res) {
              HandleGenerate(Endpoint::kCompletions, req, res);
            }));
  svr->Post("/v1/chat/completions",
            Counted([this](const httplib::Request& req, httplib::Response& res) {
              HandleGenerate(Endpoint::kChatCompletions, req, res);
            }));
  // vLLM's tokenizer endpoints (outside /v1/, as vLLM has them; no API key, as vLLM).
  auto tokenizer_route = [this](bool tokenize) {
    return Counted([this, tokenize](const httplib::Request& req, httplib::Response& res) {
      json body, out;
      std::optional<ApiError> err = ParseBody(req.body, &body);
      if (!err && tokenize) {
        const auto ordered = body.is_object() && body.contains("messages")
                                 ? nlohmann::ordered_json::parse(req.body, nullptr, false)
                                 : nlohmann::ordered_json();
        err = Tokenize(body, tokenizer, limits, &out, ordered.is_null() ? nullptr : &ordered);
      } else if (!err) {
        err = Detokenize(body, tokenizer, limits, &out);
      }
      if (err) return SetError(res, err->status, err->message, err->param);
      res.set_content(DumpJson(out), "application/json");
    });
  };
  svr->Post("/tokenize", tokenizer_route(true));
  svr->Post("/detokenize", tokenizer_route(false));
  svr->Get("/v1/models", Counted([this](const httplib::Request&, httplib::Response& res) {
             json model{
                 {"id", config.served_model_name},   {"object", "model"},
                 {"created", UnixSeconds()},         {"owned_by", "kvbridge"},
                 {"root", config.served_model_name}, {"max_model_len", config.max_model_len}};
             res.set_content(DumpJson(json{{"object", "list"}, {"data", json::array({model})}}),
                             "application/json");
           }));
  svr->Get("/health", Counted([this](const httplib::Request&, httplib::Response& res) {
             if (stopping.load()) return SetError(res, 503, "the server is shutting down");
             if (draining.load()) {
               res.status = 503;
               res.set_content(R"({"status":"draining"})", "application/json");
               return;
             }
             // The load a proxy routes by (docs/proxy.md "Control plane on etcd": proxies that
             // find this engine in etcd read its load here, point to point).
             const EngineStats st = engine->Stats();
             const double usage = st.kv_blocks_total > 0
                                      ? static_cast<double>(st.kv_blocks_active) /
                                            static_cast<double>(st.kv_blocks_total)
                                      : 0.0;
             res.set_content(DumpJson(json{{"load",
                                            {{"running", st.running},
                                             {"waiting", st.waiting + st.waiting_for_remote_kv},
                                             {"kv_usage", usage}}}}),
                             "application/json");
           }));
  svr->Get("/metrics", Counted([this](const httplib::Request&, httplib::Response& res) {
             res.set_content(engine->metrics().Render() + metrics.Render(),
                             "text/plain; version=0.0.4; charset=utf-8");
           }));
}

ApiServer::ApiServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ApiServer::~ApiServer() { Stop(); }

Result<std::unique_ptr<ApiServer>> ApiServer::Create(ServerConfig config, Engine* engine,
                                                     Tokenizer tokenizer) {
  if (engine == nullptr) return InvalidArgumentError("ApiServer needs an engine");
  if (config.num_http_threads < 1) return InvalidArgumentError("num_http_threads must be >= 1");
  if (config.max_queued_connections < 0) {
    return InvalidArgumentError("max_queued_connections must be >= 0");
  }
  if (config.max_n < 1) return InvalidArgumentError("max_n must be >= 1");
  if (config.max_model_len < 0) return InvalidArgumentError("max_model_len must be >= 0");
  if (config.port < 0 || config.port > 65535) return InvalidArgumentError("port out of range");
  ASSIGN_OR_RETURN(const ToolParserKind tool_parser, ParseToolParserName(config.tool_call_parser));
  ASSIGN_OR_RETURN(const ReasoningParserKind reasoning_parser,
                   ParseReasoningParserName(config.reasoning_parser));
  if (config.enable_auto_tool_choice && tool_parser == ToolParserKind::kNone) {
    // vLLM's refusal, word for word.
    return InvalidArgumentError(
        "When `--enable-auto-tool-choice` is set, `--tool-call-parser` "
        "must be set as well");
  }
  std::signal(SIGPIPE, SIG_IGN);

  auto impl = std::make_unique<Impl>(std::move(tokenizer));
  Impl* d = impl.get();
  d->config = std::move(config);
  d->engine = engine;
  d->limits = ProtocolLimits{d->config.served_model_name,
                             d->config.max_model_len,
                             d->config.max_n,
                             d->config.max_logprobs,
                             d->config.chat_templates.get(),
                             &d->config.sampling_defaults,
                             d->config.enable_auto_tool_choice,
                             tool_parser,
                             reasoning_parser};
  d->m_in_flight = &d->metrics.AddGauge(
      "kvbridge_http_generation_requests_in_flight",
      "Completion and chat requests accepted and not yet answered (or streamed) to the end.");
  d->m_disconnects = &d->metrics.AddCounter(
      "kvbridge_http_client_disconnects_total",
      "Generation requests aborted because the client went away before the answer.");
  d->m_engine_rejections = &d->metrics.AddCounter(
      "kvbridge_http_engine_rejections_total",
      "Generation requests refused with 503 because the engine queue was full.");
  d->m_shed_connections = &d->metrics.AddCounter(
      "kvbridge_http_connections_shed_total",
      "Connections answered 503 at once because every HTTP thread was busy and the connection "
      "queue was full (--max-queued-connections).");

  const ServerConfig& c = d->config;
  if (c.ssl_certfile.empty() != c.ssl_keyfile.empty()) {
    return InvalidArgumentError("TLS needs both --ssl-certfile and --ssl-keyfile");
  }
  if (!c.ssl_ca_certs.empty() && c.ssl_certfile.empty()) {
    return InvalidArgumentError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile");
  }
  if (c.ssl_certfile.empty()) {
    auto plain = std::make_unique<HttpServer>();
    d->raise_backlog = [p = plain.get()](int b) { return p->RaiseListenBacklog(b); };
    d->svr = std::move(plain);
  } else {
    for (const std::string* f : {&c.ssl_certfile, &c.ssl_keyfile, &c.ssl_ca_certs}) {
      if (!f->empty() && ::access(f->c_str(), R_OK) != 0) {
        return InvalidArgumentError("TLS: cannot read '" + *f + "'");
      }
    }
    auto tls =
        std::make_unique<HttpsServer>(c.ssl_certfile.c_str(), c.ssl_keyfile.c_str(),
                                      c.ssl_ca_certs.empty() ? nullptr : c.ssl_ca_certs.c_str());
    if (!tls->is_valid()) {
      return InvalidArgumentError(
          "TLS: cannot load --ssl-certfile '" + c.ssl_certfile + "' / --ssl-keyfile '" +
          c.ssl_keyfile + "' (PEM; the key must match the certificate)" +
          (c.ssl_ca_certs.empty() ? "" : " or --ssl-ca-certs '" + c.ssl_ca_certs + "'"));
    }
    d->raise_backlog = [p = tls.get()](int b) { return p->RaiseListenBacklog(b); };
    d->svr = std::move(tls);
  }
  const int threads = d->config.num_http_threads;
  const int max_queued = d->config.max_queued_connections;
  Counter* shed = d->m_shed_connections;
  d->svr->new_task_queue = [threads, max_queued, shed] {
    return new BoundedThreadPool(threads, max_queued, shed);
  };
  d->svr->set_keep_alive_timeout(d->config.keep_alive_timeout_s);
  d->svr->set_tcp_nodelay(true);  // (TLS connections: inherited from the listening socket)
  d->svr->set_payload_max_length(64u << 20);
  d->svr->set_pre_routing_handler([d](const httplib::Request& req, httplib::Response& res) {
    if (t_shed_connection) {
      SetError(res, 503,
               "the server has " + std::to_string(d->config.max_queued_connections) +
                   " connections waiting for one of its " +
                   std::to_string(d->config.num_http_threads) + " HTTP threads; retry later");
      res.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (!d->config.api_key.empty() && req.path.rfind("/v1/", 0) == 0) {
      const std::string auth = req.get_header_value("Authorization");
      const std::string prefix = "Bearer ";
      if (auth.rfind(prefix, 0) != 0 ||
          !ConstantTimeEquals(std::string_view(auth).substr(prefix.size()), d->config.api_key)) {
        SetError(res, 401, "missing or invalid API key (Authorization: Bearer <key>)");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  d->svr->set_error_handler(httplib::Server::HandlerWithResponse(
      [d](const httplib::Request& req, httplib::Response& res) {
        d->CountResponse(res.status);
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        std::string message = res.status == 404   ? "no route for " + req.method + " " + req.path
                              : res.status == 413 ? "the request body is too large"
                                                  : "bad request";
        res.set_content(OpenAiErrorBody(res.status, message), "application/json");
        return httplib::Server::HandlerResponse::Handled;
      }));
  d->svr->set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = std::string("internal error: ") + e.what();
        } catch (...) {
        }
        SetError(res, 500, what);
      });
  d->svr->set_logger([](const httplib::Request& req, const httplib::Response& res) {
    KVB_LOG_DEBUG("{} {} -> {}", req.method, req.path, res.status);
  });
  d->InstallRoutes();
  return std::unique_ptr<ApiServer>(new ApiServer(std::move(impl)));
}

Status ApiServer::RegisterRoute(Route route) {
  return RegisterRoute(route.method, route.pattern, std::move(route.handler));
}

Status ApiServer::RegisterRoute(std::string_view method, const std::string& pattern,
                                RouteHandler handler) {
  if (impl_->started) return FailedPreconditionError("RegisterRoute after Start");
  try {
    std::regex check(pattern);
  } catch (const std::regex_error& e) {
    return InvalidArgumentError("bad route pattern '" + pattern + "': " + e.what());
  }
  auto wrapped =
      impl_->Counted([h = std::move(handler)](const httplib::Request& req, httplib::Response& res) {
        HttpResponse r = h(ToHttpRequest(req));
        res.status = r.status;
        res.set_content(r.body, r.content_type);
      });
  if (method == "GET") {
    impl_->svr->Get(pattern, wrapped);
  } else if (method == "POST") {
    impl_->svr->Post(pattern, wrapped);
  } else if (method == "PUT") {
    impl_->svr->Put(pattern, wrapped);
  } else if (method == "DELETE") {
    impl_->svr->Delete(pattern, wrapped);
  } else {
    return InvalidArgumentError("unsupported method '" + std::string(method) + "'");
  }
  return OkStatus();
}

Status ApiServer::Start() {
  Impl* d = impl_.get();
  if (d->started) return FailedPreconditionError("ApiServer already started");
  if (d->config.port == 0) {
    d->bound_port = d->svr->bind_to_any_port(d->config.host);
    if (d->bound_port < 0) {
      return UnavailableError("cannot bind " + d->config.host + " on any port");
    }
  } else {
    if (!d->svr->bind_to_port(d->config.host, d->config.port)) {
      return UnavailableError("cannot bind " + d->config.host + ":" +
                              std::to_string(d->config.port) + " (in use or bad address)");
    }
    d->bound_port = d->config.port;
  }
  if (!d->raise_backlog(1024)) KVB_LOG_WARN("could not raise the listen backlog");
  d->started = true;
  d->listen_thread = std::thread([d] { d->svr->listen_after_bind(); });
  // cpp-httplib's stop() does nothing until the listen loop has marked itself running, and the
  // loop then blocks in accept() for good: a Stop() right after Start() (tests, a failed start
  // of a later part) would hang joining this thread. Return only once the loop runs.
  for (int i = 0; i < 5000 && !d->svr->is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!d->svr->is_running()) KVB_LOG_WARN("the HTTP listen loop did not start within 5 s");
  KVB_LOG_INFO("kvbridge serve: listening on {}://{}:{} (model '{}')",
               d->config.ssl_certfile.empty() ? "http" : "https", d->config.host, d->bound_port,
               d->config.served_model_name);
  return OkStatus();
}

int ApiServer::port() const { return impl_->bound_port; }

void ApiServer::Stop() {
  Impl* d = impl_.get();
  MutexLock call(&d->stop_call_mu);
  if (d->stopping.exchange(true)) return;
  std::vector<std::shared_ptr<Job>> jobs;
  {
    MutexLock l(&d->jobs_mu);
    jobs.assign(d->live_jobs.begin(), d->live_jobs.end());
  }
  for (auto& job : jobs) d->AbortJob(*job);
  if (d->started) {
    d->svr->stop();
    if (d->listen_thread.joinable()) d->listen_thread.join();
  }
  {
    MutexLock l(&d->stop_mu);
    d->stopped = true;
  }
  d->stop_cv.notify_all();
}

void ApiServer::Wait() {
  MutexLock l(&impl_->stop_mu);
  impl_->stop_cv.wait(l.native(), [this]() REQUIRES(impl_->stop_mu) { return impl_->stopped; });
}

void ApiServer::BeginDrain() {
  if (!impl_->draining.exchange(true)) KVB_LOG_INFO("kvbridge serve: draining");
}

bool ApiServer::draining() const { return impl_->draining.load(); }

int ApiServer::in_flight() const {
  MutexLock l(&impl_->jobs_mu);
  return static_cast<int>(impl_->live_jobs.size());
}

bool ApiServer::CheckClusterToken(const HttpRequest& req) const {
  return ClusterTokenMatches(req, impl_->config.cluster_token);
}

MetricsRegistry& ApiServer::metrics() { return impl_->metrics; }

}  // namespace kvbridge::server
