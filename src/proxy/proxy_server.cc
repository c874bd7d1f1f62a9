// The proxy runtime: wires PdFlow and InstanceRegistry to sockets with Boost.Beast coroutines.
//
// Per client request one FlowCtx owns the PdFlow. Leg events feed it; cancels and releases it
// returns run at once, legs to send and writes to the client queue and run in order (so writes to
// the client never interleave). A leg that is the only one running (READ mode's prefill, then its
// decode; --colocated's one leg) runs inline in the request's own coroutine, which writes to the
// client between the leg's reads; WRITE mode's two concurrent legs are spawned coroutines, and
// the request's coroutine sleeps on a timer they cancel to wake it. Everything of one connection
// runs on one strand (or the one event-loop thread), so the flow needs no lock.
//
// Legs reuse keep-alive connections from an UpstreamPool (upstream_pool.h), which keeps them as
// registered Asio sockets: a leg's connection goes back to the pool only after its whole response
// (a streamed one: after its end), when both sides keep it alive and no byte is left over; a leg
// that fails on a reused connection before any response byte arrived (the engine closed it while
// idle) is retried once on a new one.
//
// TLS (ProxyOptions::ssl_*): every connection is a Stream (stream.h), plain or TLS. The proxy's
// own port speaks HTTPS only when it has a certificate; a leg speaks HTTPS when its engine's URL
// is https:// (verified against ssl_ca_certs, tls.h). The plain path is unchanged but for one
// branch per operation; on TLS, writes go through the SSL engine asynchronously (no write-at-once).
#include "kvbridge/proxy/proxy_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <utility>  // before asio: its awaitable.hpp uses std::exchange without including it

#include "kvbridge/common/logging.h"
#include "kvbridge/common/metrics.h"
#include "kvbridge/common/process_metrics.h"
#include "kvbridge/proxy/etcd_client.h"
#include "kvbridge/proxy/kv_routing.h"
#include "kvbridge/proxy/timeline.h"
#include "proxy/stream.h"
#include "proxy/tls.h"
#include "proxy/upstream_pool.h"

namespace kvbridge::proxy {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using net::awaitable;
using net::ip::tcp;
using nlohmann::json;
namespace ssl = net::ssl;

constexpr auto kAwait = net::use_awaitable;

std::string_view ToStd(beast::string_view s) { return {s.data(), s.size()}; }

// Writes all of `buffers` on a non-blocking socket: first at once (a small write into a send
// buffer with room completes there and then), the rest, if any, asynchronously. An async write
// that completes at once still costs a trip through the event loop's queue; this does not. A TLS
// stream writes asynchronously only (a synchronous SSL write on a non-blocking socket could stop
// with a record half sent).
template <typename ConstBufferSequence>
awaitable<beast::error_code> WriteNow(Stream& stream, const ConstBufferSequence& buffers) {
  beast::error_code ec;
  if (stream.is_tls()) {
    co_await net::async_write(stream, buffers, net::redirect_error(kAwait, ec));
    co_return ec;
  }
  tcp::socket& sock = stream.lowest_layer();
  const size_t total = net::buffer_size(buffers);
  size_t n = sock.write_some(buffers, ec);
  if (ec == net::error::would_block || ec == net::error::try_again) {
    ec = {};
    n = 0;
  }
  if (ec || n == total) co_return ec;
  beast::buffers_suffix<ConstBufferSequence> rest(buffers);
  rest.consume(n);
  co_await net::async_write(sock, rest, net::redirect_error(kAwait, ec));
  co_return ec;
}

struct HostPort {
  std::string host;
  std::string port;
  bool tls = false;  // https://
};

Result<HostPort> SplitUrl(const std::string& url) {
  std::string rest = url;
  bool tls = false;
  if (rest.rfind("http://", 0) == 0) {
    rest = rest.substr(7);
  } else if (rest.rfind("https://", 0) == 0) {
    rest = rest.substr(8);
    tls = true;
  }
  auto slash = rest.find('/');
  if (slash != std::string::npos) rest = rest.substr(0, slash);
  auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == rest.size()) {
    return InvalidArgumentError("url must look like http[s]://HOST:PORT, got '" + url + "'");
  }
  return HostPort{rest.substr(0, colon), rest.substr(colon + 1), tls};
}

// Closes `socket` when the timer fires first (a TLS handshake, a whole short call, that takes
// too long); Cancel() (or the destructor) disarms it.
class CloseAfter {
 public:
  CloseAfter(tcp::socket& socket, DurationUs timeout) : timer_(socket.get_executor()) {
    timer_.expires_after(std::chrono::microseconds(timeout));
    timer_.async_wait([&socket](beast::error_code ec) {
      if (ec) return;
      beast::error_code ignore;
      socket.close(ignore);
    });
  }
  ~CloseAfter() { timer_.cancel(); }
  CloseAfter(const CloseAfter&) = delete;
  CloseAfter& operator=(const CloseAfter&) = delete;

 private:
  net::steady_timer timer_;
};

// The TLS client handshake of a new leg or call to `hp` (within `timeout`); an error in words.
awaitable<Result<bool>> ClientHandshake(Stream& stream, const HostPort& hp, DurationUs timeout) {
  ssl::stream<tcp::socket>& tls = *stream.tls();
  if (Status s = PrepareClientTls(tls, hp.host); !s.ok()) co_return s;
  beast::error_code ec;
  {
    CloseAfter guard(stream.lowest_layer(), timeout);
    co_await tls.async_handshake(ssl::stream_base::client, net::redirect_error(kAwait, ec));
  }
  if (ec) {
    co_return UnavailableError("TLS handshake with https://" + hp.host + ":" + hp.port + ": " +
                               TlsErrorText(ec, tls));
  }
  co_return true;
}

// Resolves host:port; an IP literal (the common case) skips the resolver, which would hop to its
// own thread for getaddrinfo on every leg.
awaitable<beast::error_code> Connect(beast::tcp_stream& stream, const HostPort& hp) {
  beast::error_code ec;
  auto addr = net::ip::make_address(hp.host, ec);
  if (!ec) {
    tcp::endpoint ep(addr, static_cast<unsigned short>(std::atoi(hp.port.c_str())));
    co_await stream.async_connect(ep, net::redirect_error(kAwait, ec));
    co_return ec;
  }
  tcp::resolver resolver(co_await net::this_coro::executor);
  auto results = co_await resolver.async_resolve(hp.host, hp.port, net::redirect_error(kAwait, ec));
  if (ec) co_return ec;
  co_await stream.async_connect(results, net::redirect_error(kAwait, ec));
  co_return ec;
}

// Reads from `sock` into `buf` and feeds `parser` until its header (`header_only`) or its whole
// message is parsed, parsing what is buffered right here: one plain socket read per wait instead
// of Beast's composed read operations (their type-erased executor hops and trips through the event
// loop). Errors as Beast's async_read / async_read_header: http::error::end_of_stream at EOF
// before any byte, else the socket's or the parser's error (partial_message at EOF mid-message).
template <bool isRequest, class Body>
awaitable<beast::error_code> ReadMessage(Stream& sock, beast::flat_buffer& buf,
                                         http::parser<isRequest, Body>& parser, bool header_only) {
  beast::error_code ec;
  auto done = [&] { return header_only ? parser.is_header_done() : parser.is_done(); };
  for (;;) {
    while (buf.size() > 0 && !done()) {
      const size_t used = parser.put(buf.data(), ec);
      buf.consume(used);
      if (ec == http::error::need_more) {
        ec = {};
        break;
      }
      if (ec) co_return ec;
      if (used == 0) break;
    }
    if (done()) co_return ec;
    const size_t room = std::clamp<size_t>(buf.capacity() - buf.size(), 4096, 65536);
    const size_t n =
        co_await sock.async_read_some(buf.prepare(room), net::redirect_error(kAwait, ec));
    buf.commit(n);
    // A TLS peer that closes without close_notify: the same as EOF here (the HTTP framing says
    // whether the message was whole).
    if (ec == ssl::error::stream_truncated) ec = net::error::eof;
    if (ec == net::error::eof) {
      if (!parser.got_some() && buf.size() == 0) co_return http::error::end_of_stream;
      ec = {};  // what was buffered is parsed already: asio reports EOF on a read of 0 bytes
      parser.put_eof(ec);
      if (!ec && !done()) ec = http::error::partial_message;
      co_return ec;
    }
    if (ec) co_return ec;
  }
}

std::string ErrorJson(int status, std::string_view type, std::string_view message) {
  return json{{"error", {{"message", message}, {"type", type}, {"code", status}}}}.dump();
}

struct HttpReply {
  int status = 0;
  std::string content_type;
  std::string body;
};

// One request on a fresh connection, whole response; Unavailable when the peer cannot be reached
// (or, https, does not prove itself with a certificate `tls` verifies: the message says why).
awaitable<Result<HttpReply>> HttpCall(http::verb verb, std::string url, std::string target,
                                      std::string body, std::string token, DurationUs timeout,
                                      ssl::context* tls) {
  auto ex = co_await net::this_coro::executor;
  auto hp = SplitUrl(url);
  if (!hp.ok()) co_return hp.status();
  beast::tcp_stream tcp_stream(ex);
  tcp_stream.expires_after(std::chrono::microseconds(timeout));
  beast::error_code ec = co_await Connect(tcp_stream, *hp);
  if (ec) co_return UnavailableError("connect " + url + ": " + ec.message());
  tcp_stream.expires_never();
  std::optional<Stream> opened;
  if (hp->tls) {
    if (tls == nullptr) co_return UnavailableError(url + ": no TLS client context");
    opened.emplace(tcp_stream.release_socket(), *tls);
    auto shaken = co_await ClientHandshake(*opened, *hp, timeout);
    if (!shaken.ok()) co_return shaken.status();
  } else {
    opened.emplace(tcp_stream.release_socket());
  }
  Stream& stream = *opened;
  CloseAfter guard(stream.lowest_layer(), timeout);
  http::request<http::string_body> req{verb, target, 11};
  req.set(http::field::host, hp->host + ":" + hp->port);
  if (!token.empty()) req.set(kClusterTokenHeader, token);
  if (verb == http::verb::post) {
    req.set(http::field::content_type, "application/json");
    req.body() = std::move(body);
    req.prepare_payload();
  }
  req.keep_alive(false);
  co_await http::async_write(stream, req, net::redirect_error(kAwait, ec));
  if (ec) co_return UnavailableError("write " + url + ": " + ec.message());
  beast::flat_buffer buf;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64u << 20);
  co_await http::async_read(stream, buf, parser, net::redirect_error(kAwait, ec));
  if (ec) co_return UnavailableError("read " + url + ": " + ec.message());
  auto& res = parser.get();
  HttpReply reply;
  reply.status = static_cast<int>(res.result_int());
  reply.content_type = std::string(res[http::field::content_type]);
  reply.body = std::move(res.body());
  beast::error_code ignore;
  stream.lowest_layer().shutdown(tcp::socket::shutdown_both, ignore);
  co_return reply;
}

}  // namespace

struct ProxyServer::Impl {
  explicit Impl(const ProxyOptions& o)
      : options(o),
        registry(RegistryOptions{o.mode, o.heartbeat_timeout, o.routing}),
        request_seconds(metrics.AddHistogram("kvbridge_proxy_request_seconds",
                                             "Client request latency through the proxy.",
                                             Histogram::LatencyBucketsSeconds())),
        in_flight(
            metrics.AddGauge("kvbridge_proxy_requests_in_flight", "Client requests being served.")),
        expired(metrics.AddCounter("kvbridge_proxy_instances_expired_total",
                                   "Registered instances dropped for missed heartbeats.")),
        kv_index(KvIndexOptions{o.kv_index_max_blocks}),
        kv_router(KvRouteOptions{.kv_aware = o.routing == RoutingPolicy::kKvAware,
                                 .pd_skip_threshold = o.pd_skip_threshold}),
        acceptor(ioc),
        pool(BasicUpstreamPool<Stream>::Options{o.upstream_max_idle, o.upstream_idle_timeout}) {
    AddKvMetrics();
    for (Outcome oc : {Outcome::kOk, Outcome::kBadRequest, Outcome::kNoInstance,
                       Outcome::kPrefillError, Outcome::kDecodeError, Outcome::kUnreachable,
                       Outcome::kClientDisconnected, Outcome::kTimeout}) {
      outcome_counters[oc] =
          &metrics.AddCounter("kvbridge_proxy_requests_total", "Client requests by outcome.",
                              "outcome=\"" + std::string(OutcomeName(oc)) + "\"");
    }
    for (Role r : {Role::kPrefill, Role::kDecode}) {
      std::string label = "role=\"" + std::string(RoleName(r)) + "\"";
      int i = r == Role::kPrefill ? 0 : 1;
      m_leg_seconds[i] =
          &metrics.AddHistogram("kvbridge_proxy_leg_seconds", "Leg latency, sent to response end.",
                                Histogram::LatencyBucketsSeconds(), label);
      m_leg_first_byte_seconds[i] = &metrics.AddHistogram(
          "kvbridge_proxy_leg_first_byte_seconds", "Leg latency, sent to status line.",
          Histogram::LatencyBucketsSeconds(), label);
      metrics.AddCallbackGauge(
          "kvbridge_proxy_instances_known", "Instances in the registry.",
          [this, r] { return CountInstances(r, false); }, label);
      metrics.AddCallbackGauge(
          "kvbridge_proxy_instances_healthy", "Instances routable now.",
          [this, r] { return CountInstances(r, true); }, label);
    }
    m_overloaded = &metrics.AddCounter("kvbridge_proxy_requests_total",
                                       "Client requests by outcome.", "outcome=\"overloaded\"");
    AddProcessMetrics(metrics);
    m_releases_ok =
        &metrics.AddCounter("kvbridge_proxy_releases_total",
                            "Holds released at a prefill by transfer_id.", "result=\"ok\"");
    m_releases_failed =
        &metrics.AddCounter("kvbridge_proxy_releases_total",
                            "Holds released at a prefill by transfer_id.", "result=\"failed\"");
    m_leg_connections_new =
        &metrics.AddCounter("kvbridge_proxy_leg_connections_total",
                            "Upstream connections legs used, by kind.", "kind=\"new\"");
    m_leg_connections_reused =
        &metrics.AddCounter("kvbridge_proxy_leg_connections_total",
                            "Upstream connections legs used, by kind.", "kind=\"reused\"");
    m_leg_retries = &metrics.AddCounter(
        "kvbridge_proxy_leg_retries_total",
        "Legs sent again on a new connection after a reused one failed before any response byte.");
    metrics.AddCallbackGauge("kvbridge_proxy_upstream_idle_connections",
                             "Keep-alive upstream connections waiting in the pool.",
                             [this] { return static_cast<double>(pool.IdleCount()); });
    m_registrations_ok = &metrics.AddCounter("kvbridge_proxy_registrations_total",
                                             "Instance registrations.", "result=\"ok\"");
    m_registrations_refused = &metrics.AddCounter("kvbridge_proxy_registrations_total",
                                                  "Instance registrations.", "result=\"refused\"");
  }

  double CountInstances(Role r, bool healthy_only) {
    std::lock_guard<std::mutex> lock(mu);
    int n = 0;
    for (const auto& st : registry.List()) {
      if (st.info.role == r && (!healthy_only || st.healthy)) ++n;
    }
    return n;
  }

  std::string RenderMetrics() {
    std::string text = metrics.Render();
    text += "# HELP kvbridge_proxy_instance_in_flight Legs the proxy has open to each instance.\n";
    text += "# TYPE kvbridge_proxy_instance_in_flight gauge\n";
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& st : registry.List()) {
      text += "kvbridge_proxy_instance_in_flight{role=\"" + std::string(RoleName(st.info.role)) +
              "\",instance=\"" + st.info.url + "\"} " + std::to_string(st.in_flight) + "\n";
    }
    // `kvbridge up`'s restarts: the proxy's own (--restart-count) and each named instance's, as
    // its registration says (names are [A-Za-z0-9._-]: safe in a label).
    text += "# HELP kvbridge_up_restarts_total Restarts by kvbridge up, per process.\n";
    text += "# TYPE kvbridge_up_restarts_total counter\n";
    text += "kvbridge_up_restarts_total{role=\"proxy\",name=\"proxy\"} " +
            std::to_string(options.restart_count) + "\n";
    for (const auto& st : registry.List()) {
      if (st.info.name.empty()) continue;
      text += "kvbridge_up_restarts_total{role=\"" + std::string(RoleName(st.info.role)) +
              "\",name=\"" + st.info.name + "\"} " + std::to_string(st.info.restarts) + "\n";
    }
    return text;
  }

  json InstancesJson() {
    json list = json::array();
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& st : registry.List()) {
      list.push_back({{"id", st.info.id},
                      {"role", RoleName(st.info.role)},
                      {"url", st.info.url},
                      {"mode", KvTransferModeName(st.info.mode)},
                      {"healthy", st.healthy},
                      {"static", st.is_static},
                      {"engine_id", st.info.engine_id},
                      {"transfer_endpoints", st.info.transfer_endpoints},
                      {"tp_size", st.info.tp_size},
                      {"name", st.info.name},
                      {"restarts", st.info.restarts},
                      {"kv_both", st.info.kv_both},
                      {"draining", st.draining},
                      {"in_flight", st.in_flight},
                      {"load",
                       {{"running", st.load.running},
                        {"waiting", st.load.waiting},
                        {"kv_usage", st.load.kv_usage}}}});
    }
    return json{{"mode", KvTransferModeName(options.mode)},
                {"proxy_restarts", options.restart_count},
                {"instances", list}};
  }

  // Prometheus HTTP service discovery (docs/metrics.md "Prometheus"): this proxy (as the scraper
  // reached it: its Host header) and every instance it knows, healthy or not, labelled by role.
  json PrometheusTargets(std::string_view self) {
    json groups = json::array();
    groups.push_back({{"targets", {self}}, {"labels", {{"role", "proxy"}}}});
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& st : registry.List()) {
      std::string target = st.info.url;
      if (target.rfind("http://", 0) == 0) target = target.substr(7);
      groups.push_back(
          {{"targets", {target}},
           {"labels", {{"role", RoleName(st.info.role)}, {"instance_id", st.info.id}}}});
    }
    return groups;
  }

  bool TokenOk(const http::request<http::string_body>& req) {
    if (options.cluster_token.empty()) return true;
    auto it = req.find(kClusterTokenHeader);
    return it != req.end() && it->value() == options.cluster_token;
  }

  awaitable<void> Accept();
  awaitable<void> Session(tcp::socket sock);
  awaitable<bool> Handle(Stream& sock, http::request<http::string_body>& req);
  awaitable<bool> RunFlow(Stream& sock, http::request<http::string_body>& req);
  awaitable<void> Housekeeping();
  // KV-aware routing (kv_routing.h): metrics, a follower per engine, a request's prompt ids.
  void AddKvMetrics();
  void FollowNewEngines();
  awaitable<void> FollowKvEvents(std::string id, std::string url);
  awaitable<std::optional<std::vector<int32_t>>> PromptIds(std::string path, std::string body);
  awaitable<void> Release(ReleaseHold rel, std::string request_id);
  awaitable<HttpReply> DrainInstance(std::string key);

  ProxyOptions options;
  std::mutex mu;  // guards registry
  InstanceRegistry registry;
  MetricsRegistry metrics;
  Histogram& request_seconds;
  Gauge& in_flight;
  Counter& expired;
  std::map<Outcome, Counter*> outcome_counters;
  Histogram* m_leg_seconds[2] = {nullptr, nullptr};
  Histogram* m_leg_first_byte_seconds[2] = {nullptr, nullptr};
  Counter* m_releases_ok = nullptr;
  Counter* m_releases_failed = nullptr;
  Counter* m_registrations_ok = nullptr;
  Counter* m_registrations_refused = nullptr;
  Counter* m_leg_connections_new = nullptr;
  Counter* m_leg_connections_reused = nullptr;
  Counter* m_leg_retries = nullptr;
  KvIndex kv_index;                           // guarded by mu
  KvRouter kv_router;                         // guarded by mu
  std::set<std::string> kv_followed;          // guarded by mu: engines with a follower running
  Counter* m_kv_route_skip = nullptr;         // decode alone
  Counter* m_kv_route_pd = nullptr;           // both legs
  Counter* m_kv_route_no_ids = nullptr;       // no prompt ids: the registry's pick
  Histogram* m_kv_route_seconds = nullptr;    // the decision (hashes + index + scores)
  Histogram* m_prompt_ids_seconds = nullptr;  // tokenizing/templating (or /tokenize)
  TimelineRing timelines{1024};               // GET /v1/requests/{id}/timeline
  // kvbridge_proxy_phase_seconds, per request, without building the timeline's JSON.
  TimelineObserver timeline_observer{&metrics};
  Counter* m_overloaded = nullptr;
  std::atomic<int> pending{0};  // client requests in flight (RunFlow), for max_pending
  // Destroyed before the members above, which its coroutine frames still point at.
  net::io_context ioc;
  tcp::acceptor acceptor;
  // TLS contexts (tls.h): the proxy's own port (null: plain HTTP) and its https:// legs.
  std::shared_ptr<ssl::context> server_tls;
  std::shared_ptr<ssl::context> client_tls;
  // After ioc and the contexts: its idle connections belong to ioc and must close before it goes.
  BasicUpstreamPool<Stream> pool;
  std::vector<std::thread> threads;
  bool started = false;
  // The etcd control plane (ProxyOptions::etcd): the feed's thread applies its updates to the
  // registry through etcd_sync, under mu.
  std::unique_ptr<EtcdRegistrySync> etcd_sync;  // guarded by mu
  std::unique_ptr<EtcdWatchFeed> etcd_feed;
  void ApplyEtcd(std::vector<EtcdKvUpdate> updates);
  int bound_port = 0;
};

namespace {

using Request = http::request<http::string_body>;

// A whole response, its head written by hand and sent with the body in one gather write: what
// Beast's message + serializer would send (status line, Server, Content-Type, Content-Length,
// Connection as keep_alive() sets it), without allocating each field and running a serializer.
awaitable<bool> WriteWhole(Stream& sock, const Request& req, int status, std::string content_type,
                           std::string body, std::string extra_head = {}) {
  const auto code = static_cast<http::status>(status);
  // 1xx, 204 and 304 carry no body and no Content-Length (RFC 9110 8.6).
  const bool bodyless = (status >= 100 && status < 200) || status == 204 || status == 304;
  if (bodyless) body.clear();
  std::string head;
  head.reserve(128 + content_type.size());
  head += req.version() == 10 ? "HTTP/1.0 " : "HTTP/1.1 ";
  head += std::to_string(status);
  head += ' ';
  head += ToStd(http::obsolete_reason(code));
  head += "\r\nServer: kvbridge-proxy\r\nContent-Type: ";
  head += content_type.empty() ? std::string_view("application/json") : content_type;
  head += "\r\n";
  if (!bodyless) {
    head += "Content-Length: ";
    head += std::to_string(body.size());
    head += "\r\n";
  }
  head += extra_head;  // whole "Name: value\r\n" lines
  const bool keep = req.keep_alive();
  if (req.version() >= 11 && !keep) head += "Connection: close\r\n";
  if (req.version() == 10 && keep) head += "Connection: keep-alive\r\n";
  head += "\r\n";
  const beast::error_code ec = co_await WriteNow(
      sock, std::array<net::const_buffer, 2>{net::buffer(head), net::buffer(body)});
  co_return !ec;
}

// What one client request's coroutines share. Everything of one request runs on one executor (the
// event-loop thread, or the connection's strand), so nothing here needs a lock.
struct FlowCtx : std::enable_shared_from_this<FlowCtx> {
  FlowCtx(ProxyServer::Impl* impl_in, const net::any_io_executor& ex_in, FlowOptions o,
          InstancePicker picker, Stream* client_in, const Request* req_in, TimePoint t0_in)
      : impl(impl_in),
        ex(ex_in),
        flow(o, MintTransferId(), std::move(picker)),
        wake(ex_in),
        deadline_timer(ex_in),
        client(client_in),
        req(req_in),
        t0(t0_in) {}

  // Takes the flow's actions: cancels and releases at once (closing a leg's socket wakes the
  // coroutine waiting on it, inline or spawned), the rest (legs to send, writes to the client)
  // queued for Drain in order. Wakes RunFlow when it sleeps, even when nothing was queued: the
  // event may still have ended the flow (a WRITE prefill leg that ends after the decode answered
  // returns no action but makes done() true).
  void Push(std::vector<Action> actions);
  bool Cancelled(int leg_id) const {
    return std::find(cancelled.begin(), cancelled.end(), leg_id) != cancelled.end();
  }
  // The socket a leg uses now (nullptr: none), so a cancel can close it.
  void SetLegSocket(int leg_id, tcp::socket* socket) {
    for (auto& [id, s] : leg_sockets) {
      if (id == leg_id) {
        s = socket;
        return;
      }
    }
    if (socket != nullptr) leg_sockets.emplace_back(leg_id, socket);
  }
  void CountOutcome();
  // The request's timeline (timeline.h) into the ring and the phase histograms; once, at its end.
  void RecordTimeline();
  // (Re)arms the timer for the flow's deadline() (its bound, or its next instance re-pick) when
  // that changed; OnTick runs when it fires.
  void ArmDeadline();
  TimePoint armed_at = -1;
  // Starts watching the client for a disconnect, once per flow. Called when a leg's request is on
  // its way (or RunFlow is about to sleep), not at the start: the watch costs a system call, and
  // there it runs while the engine works instead of before the leg is sent.
  void WatchClientOnce();

  ProxyServer::Impl* impl;
  net::any_io_executor ex;
  PdFlow flow;
  std::deque<Action> pending;  // SendLeg and client writes, in order
  net::steady_timer wake;      // RunFlow sleeps on it while spawned legs run
  net::steady_timer deadline_timer;
  bool sleeping = false;
  std::vector<std::pair<int, tcp::socket*>> leg_sockets;
  std::vector<int> cancelled;  // legs the flow cancelled: never retried
  int legs_running = 0;        // leg coroutines started and not yet ended
  bool finished = false;
  bool client_watched = false;
  // The client side.
  Stream* client;
  const Request* req;
  TimePoint t0;
  bool client_ok = true;
  bool counted = false;
  char client_peek = 0;                        // WatchClient's receive lands here (never read)
  std::optional<net::steady_timer> tls_watch;  // WatchClient's hang-up poll, TLS clients only
  std::optional<http::response<http::empty_body>> stream_head;
  std::optional<http::response_serializer<http::empty_body>> serializer;
  // The timeline: the X-Request-Id (client-supplied or the transfer_id), and per leg its engine
  // timing (header, or the stream's comment) and whether it streamed.
  std::string request_id;
  std::map<int, std::string> leg_timing;
  std::map<int, bool> leg_stream;
  std::map<int, SseTimingFilter> sse_filters;
  TimePoint responded_at = -1;  // the client's response's last byte was written
  bool timeline_recorded = false;
};

void FlowCtx::Push(std::vector<Action> actions) {
  for (auto& a : actions) {
    if (auto* c = std::get_if<CancelLeg>(&a)) {
      cancelled.push_back(c->leg_id);
      for (auto& [id, s] : leg_sockets) {
        if (id == c->leg_id && s != nullptr) {
          beast::error_code ignore;
          s->close(ignore);
        }
      }
    } else if (auto* r = std::get_if<ReleaseHold>(&a)) {
      net::co_spawn(ex, impl->Release(std::move(*r), request_id), net::detached);
    } else {
      pending.push_back(std::move(a));
    }
  }
  ArmDeadline();
  if (sleeping) wake.cancel();
}

void FlowCtx::ArmDeadline() {
  const std::optional<TimePoint> d = flow.deadline();
  if (finished || !d) {
    if (armed_at >= 0) deadline_timer.cancel();
    armed_at = -1;
    return;
  }
  if (*d == armed_at) return;
  armed_at = *d;
  deadline_timer.expires_after(
      std::chrono::microseconds(std::max<DurationUs>(0, *d - SteadyNow())));
  deadline_timer.async_wait([self = shared_from_this(), at = *d](beast::error_code ec) {
    if (ec || self->finished || self->armed_at != at) return;
    self->armed_at = -1;
    self->Push(self->flow.OnTick(SteadyNow()));
  });
}

// Counted before the answer's last write, so a client that has its answer sees it in /metrics.
void FlowCtx::CountOutcome() {
  if (counted || !flow.client_done()) return;
  counted = true;
  impl->outcome_counters[flow.outcome()]->Inc();
  impl->request_seconds.Observe(static_cast<double>(SteadyNow() - t0) / kSecond);
}

void FlowCtx::RecordTimeline() {
  if (timeline_recorded) return;
  timeline_recorded = true;
  TimelineInput in;
  in.request_id = request_id;
  in.transfer_id = flow.transfer_id();
  in.mode = impl->options.mode;
  in.path = std::string(req->target());
  in.stream = flow.client_stream();
  in.outcome = flow.outcome();
  in.received = t0;
  in.responded = responded_at >= 0 ? responded_at : SteadyNow();
  for (const LegRecord& r : flow.legs()) {
    LegTiming l;
    l.record = r;
    l.stream = leg_stream[r.leg_id];
    l.engine_timing = leg_timing[r.leg_id];
    in.legs.push_back(std::move(l));
  }
  // No prefill leg: --colocated, or KV-aware routing sent the request to a decode alone.
  in.colocated = impl->options.colocated ||
                 std::none_of(in.legs.begin(), in.legs.end(),
                              [](const LegTiming& l) { return l.record.role == Role::kPrefill; });
  // No JSON here: the histograms from a summary, the timeline built when someone asks for it.
  impl->timeline_observer.Observe(SummarizeTimeline(in));
  KVB_LOG_DEBUG("request {} transfer {}: {} in {} ms", request_id, flow.transfer_id(),
                OutcomeName(flow.outcome()),
                static_cast<double>(in.responded - in.received) / kMillisecond);
  impl->timelines.PutInput(std::move(in));
}

awaitable<void> RunLeg(ProxyServer::Impl* impl, std::shared_ptr<FlowCtx> ctx, SendLeg leg,
                       bool inline_leg);
void WatchClient(std::shared_ptr<FlowCtx> ctx, Stream* sock);

void FlowCtx::WatchClientOnce() {
  if (client_watched || finished || flow.client_done()) return;
  client_watched = true;
  WatchClient(shared_from_this(), client);
}

// Executes the queued actions in order. A leg runs inline (awaited right here, in the request's
// own coroutine: no spawned coroutine, no wake-up hop) when it is the only one: no other leg
// running and none queued behind it — READ mode's prefill then decode, --colocated's one leg.
// WRITE mode's two concurrent legs are spawned. Called from an inline leg (`in_leg`), it writes
// to the client what the leg's events produced and leaves a queued leg for RunFlow.
awaitable<void> Drain(const std::shared_ptr<FlowCtx>& ctx, bool in_leg) {
  beast::error_code ec;
  while (!ctx->pending.empty()) {
    if (in_leg && std::holds_alternative<SendLeg>(ctx->pending.front())) co_return;
    Action a = std::move(ctx->pending.front());
    ctx->pending.pop_front();
    if (auto* s = std::get_if<SendLeg>(&a)) {
      const bool more = std::any_of(ctx->pending.begin(), ctx->pending.end(), [](const Action& x) {
        return std::holds_alternative<SendLeg>(x);
      });
      const bool run_inline = ctx->legs_running == 0 && !more;
      ++ctx->legs_running;
      if (run_inline) {
        co_await RunLeg(ctx->impl, ctx, std::move(*s), /*inline_leg=*/true);
      } else {
        net::co_spawn(ctx->ex, RunLeg(ctx->impl, ctx, std::move(*s), false), net::detached);
      }
      continue;
    }
    if (!ctx->client_ok) continue;  // the client is gone; its bytes have nowhere to go
    Stream& sock = *ctx->client;
    if (auto* w = std::get_if<Respond>(&a)) {
      ctx->CountOutcome();
      std::string extra = "X-Request-Id: " + ctx->request_id + "\r\n";
      // A 503 (no instance came within --instance-wait-ms, or every engine refused: full or
      // draining) is an overload answer too: the client is told when to try again.
      if (w->status == 503) {
        extra += "Retry-After: " + std::to_string(ctx->impl->options.retry_after_s) + "\r\n";
      }
      ctx->client_ok = co_await WriteWhole(sock, *ctx->req, w->status, w->content_type,
                                           std::move(w->body), std::move(extra));
      ctx->responded_at = SteadyNow();
    } else if (auto* st = std::get_if<StartStream>(&a)) {
      auto& head = ctx->stream_head.emplace();
      head.version(ctx->req->version());
      head.result(static_cast<unsigned>(st->status));
      head.set(http::field::server, "kvbridge-proxy");
      head.set(http::field::content_type, st->content_type);
      head.set(http::field::cache_control, "no-cache");
      head.set("X-Request-Id", ctx->request_id);
      head.keep_alive(ctx->req->keep_alive());
      head.chunked(true);
      ctx->serializer.emplace(head);
      co_await http::async_write_header(sock, *ctx->serializer, net::redirect_error(kAwait, ec));
      ctx->client_ok = !ec;
    } else if (auto* ch = std::get_if<StreamChunk>(&a)) {
      ctx->client_ok = !co_await WriteNow(sock, http::make_chunk(net::buffer(ch->data)));
    } else if (std::holds_alternative<EndStream>(a)) {
      ctx->CountOutcome();
      ctx->client_ok = !co_await WriteNow(sock, http::make_chunk_last());
      ctx->responded_at = SteadyNow();
    }
    if (!ctx->client_ok) ctx->Push(ctx->flow.OnClientDisconnect(SteadyNow()));
  }
}

// The request head of a leg, written by hand: the fields are few and fixed, and a Beast message
// would allocate each one and run a serializer per leg.
std::string LegHead(const SendLeg& leg, const std::string& host_port, const std::string& token,
                    const std::string& request_id, bool keep_alive) {
  std::string head;
  head.reserve(200 + leg.path.size() + token.size());
  head += "POST ";
  head += leg.path;
  head += " HTTP/1.1\r\nHost: ";
  head += host_port;
  head += "\r\nContent-Type: application/json\r\n";
  if (leg.stream) head += "Accept: text/event-stream\r\n";
  if (!token.empty()) {
    head += kClusterTokenHeader;
    head += ": ";
    head += token;
    head += "\r\n";
  }
  head += "X-Request-Id: ";
  head += request_id;
  head += "\r\n";
  head += kTimingHeader;  // the engine's phase times come back with its answer (timeline.h)
  head += ": 1\r\n";
  if (!keep_alive) head += "Connection: close\r\n";
  head += "Content-Length: ";
  head += std::to_string(leg.body.size());
  head += "\r\n\r\n";
  return head;
}

awaitable<void> RunLeg(ProxyServer::Impl* impl, std::shared_ptr<FlowCtx> ctx, SendLeg leg,
                       bool inline_leg) {
  const int role = leg.role == Role::kPrefill ? 0 : 1;
  const TimePoint t0 = SteadyNow();
  struct Finish {  // in-flight accounting, whatever way the leg ends
    ProxyServer::Impl* impl;
    FlowCtx* ctx;
    int leg_id;
    const std::string& id;
    ~Finish() {
      ctx->SetLegSocket(leg_id, nullptr);
      --ctx->legs_running;
      std::lock_guard<std::mutex> lock(impl->mu);
      impl->registry.LegFinished(id);
    }
  } finish{impl, ctx.get(), leg.leg_id, leg.instance.id};
  {
    std::lock_guard<std::mutex> lock(impl->mu);
    impl->registry.LegStarted(leg.instance.id);
  }
  auto fail = [&](LegFailure f, std::string what) {
    ctx->Push(ctx->flow.OnLegError(leg.leg_id, f, UnavailableError(std::move(what)), SteadyNow()));
  };
  // An inline leg writes to the client what its events produced before it reads on; false when
  // the leg was cancelled meanwhile (the client went away, the flow timed out).
  auto drain = [&]() -> awaitable<bool> {
    if (inline_leg) co_await Drain(ctx, /*in_leg=*/true);
    co_return !ctx->Cancelled(leg.leg_id);
  };
  auto hp = SplitUrl(leg.instance.url);
  if (!hp.ok()) {
    fail(LegFailure::kUnreachable, hp.status().message());
    co_return;
  }
  const std::string host_port = hp->host + ":" + hp->port;
  // A TLS connection is never handed to a plain leg or the other way round.
  const std::string pool_key = hp->tls ? "https://" + host_port : host_port;
  const bool pooling = impl->pool.enabled();
  const std::string head = LegHead(leg, host_port, impl->options.cluster_token, ctx->request_id,
                                   /*keep_alive=*/pooling);
  ctx->leg_stream[leg.leg_id] = leg.stream;
  const std::array<net::const_buffer, 2> request{net::buffer(head), net::buffer(leg.body)};
  beast::error_code ec;
  // Attempt 0 takes a pooled connection when there is one; attempt 1 exists only to redo a
  // request that a reused connection lost before any response byte.
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::optional<Stream> sock;
    if (attempt == 0 && pooling) sock = impl->pool.Take(pool_key, SteadyNow());
    const bool reused = sock.has_value();
    if (!reused) {
      beast::tcp_stream stream(ctx->ex);
      ctx->SetLegSocket(leg.leg_id, &stream.socket());
      stream.expires_after(std::chrono::microseconds(impl->options.connect_timeout));
      ec = co_await Connect(stream, *hp);
      ctx->SetLegSocket(leg.leg_id, nullptr);
      if (ctx->Cancelled(leg.leg_id)) co_return;
      if (ec) {
        // A retry follows a request that may have reached the engine: not "unreachable".
        fail(attempt == 0 ? LegFailure::kUnreachable : LegFailure::kBroken,
             "connect: " + ec.message());
        co_return;
      }
      stream.socket().set_option(tcp::no_delay(true), ec);
      stream.socket().non_blocking(true, ec);  // for WriteNow; once per connection
      stream.expires_never();
      if (hp->tls) {
        // Verified before any byte of the request goes: an engine whose certificate does not
        // verify never sees the leg (its body, the cluster token).
        sock.emplace(stream.release_socket(), *impl->client_tls);
        ctx->SetLegSocket(leg.leg_id, &sock->lowest_layer());
        auto shaken = co_await ClientHandshake(*sock, *hp, impl->options.connect_timeout);
        ctx->SetLegSocket(leg.leg_id, nullptr);
        if (ctx->Cancelled(leg.leg_id)) co_return;
        if (!shaken.ok()) {
          KVB_LOG_WARN("leg to {}: {}", leg.instance.url, shaken.status().message());
          fail(attempt == 0 ? LegFailure::kUnreachable : LegFailure::kBroken,
               std::string(shaken.status().message()));
          co_return;
        }
      } else {
        sock.emplace(stream.release_socket());
      }
      impl->m_leg_connections_new->Inc();
    } else {
      impl->m_leg_connections_reused->Inc();
    }
    ctx->SetLegSocket(leg.leg_id, &sock->lowest_layer());
    // No per-operation timer (it would arm and cancel one on every read and write): the flow's
    // own deadline (FlowOptions::timeout = request_timeout) cancels a leg that takes too long.
    ec = co_await WriteNow(*sock, request);
    if (ctx->Cancelled(leg.leg_id)) co_return;
    if (ec) {
      if (reused) {
        impl->m_leg_retries->Inc();
        continue;
      }
      fail(LegFailure::kBroken, "write: " + ec.message());
      co_return;
    }
    ctx->WatchClientOnce();
    beast::flat_buffer buf;
    buf.reserve(8192);  // else Beast reads 512 bytes at a time at first
    http::response_parser<http::buffer_body> parser;
    parser.body_limit(1ull << 32);
    ec = co_await ReadMessage(*sock, buf, parser, /*header_only=*/true);
    if (ctx->Cancelled(leg.leg_id)) co_return;
    if (ec) {
      if (reused && !parser.got_some() && buf.size() == 0) {
        impl->m_leg_retries->Inc();
        continue;
      }
      fail(LegFailure::kBroken, "read header: " + ec.message());
      co_return;
    }
    const TimePoint t1 = SteadyNow();
    impl->m_leg_first_byte_seconds[role]->Observe(static_cast<double>(t1 - t0) / kSecond);
    if (auto timing = parser.get().find(kTimingHeader); timing != parser.get().end()) {
      ctx->leg_timing[leg.leg_id] = std::string(ToStd(timing->value()));
    }
    ctx->Push(ctx->flow.OnLegStatus(leg.leg_id, static_cast<int>(parser.get().result_int()),
                                    ToStd(parser.get()[http::field::content_type]), t1));
    if (!co_await drain()) co_return;
    char chunk[16384];
    while (!parser.is_done()) {
      parser.get().body().data = chunk;
      parser.get().body().size = sizeof(chunk);
      size_t used = 0;
      if (buf.size() > 0) {
        // Body bytes that came with the header (all of a small answer): parsed right here, no
        // async read and its trip through the event loop.
        used = parser.put(buf.data(), ec);
        buf.consume(used);
        if (ec == http::error::need_buffer || ec == http::error::need_more) ec = {};
      }
      size_t got = sizeof(chunk) - parser.get().body().size;
      if (!ec && used == 0 && got == 0) {
        // read_some, not read: an SSE event must reach the client as soon as it arrives.
        co_await http::async_read_some(*sock, buf, parser, net::redirect_error(kAwait, ec));
        if (ctx->Cancelled(leg.leg_id)) co_return;
        if (ec == http::error::need_buffer) ec = {};
        got = sizeof(chunk) - parser.get().body().size;
      }
      if (got > 0 && leg.stream) {
        // The engine's timing comment stays out of the client's stream.
        const std::string pass = ctx->sse_filters[leg.leg_id].Feed(std::string_view(chunk, got));
        if (!pass.empty()) ctx->Push(ctx->flow.OnLegData(leg.leg_id, pass, SteadyNow()));
        if (!co_await drain()) co_return;
      } else if (got > 0) {
        ctx->Push(ctx->flow.OnLegData(leg.leg_id, std::string_view(chunk, got), SteadyNow()));
        if (!co_await drain()) co_return;
      }
      if (ec) {
        fail(LegFailure::kBroken, "read body: " + ec.message());
        co_return;
      }
    }
    const TimePoint t2 = SteadyNow();
    ctx->SetLegSocket(leg.leg_id, nullptr);
    // Back to the pool before the flow hears of the end, so the flow's next leg can reuse it.
    if (pooling && parser.keep_alive() && buf.size() == 0 && sock->lowest_layer().is_open()) {
      impl->pool.Put(pool_key, std::move(*sock), t2);
    } else {
      beast::error_code ignore;
      sock->lowest_layer().shutdown(tcp::socket::shutdown_both, ignore);
    }
    impl->m_leg_seconds[role]->Observe(static_cast<double>(t2 - t0) / kSecond);
    if (leg.stream) {
      SseTimingFilter& f = ctx->sse_filters[leg.leg_id];
      if (std::string rest = f.Finish(); !rest.empty()) {
        ctx->Push(ctx->flow.OnLegData(leg.leg_id, rest, t2));
      }
      if (!f.timing().empty()) ctx->leg_timing[leg.leg_id] = f.timing();
    }
    ctx->Push(ctx->flow.OnLegDone(leg.leg_id, t2));
    co_return;
  }
  fail(LegFailure::kBroken, "connection lost twice before a response");
}

// Watches the client socket while a flow runs: EOF (or an error) = disconnect. A plain completion
// handler, not a spawned coroutine (one fewer coroutine frame and executor hop per request), armed
// before the flow can end; RunFlow cancels it at the end (no system call). A 1-byte MSG_PEEK
// receive rather than async_wait(wait_read): Asio's epoll reactor re-registers the descriptor
// (epoll_ctl MOD) for every async_wait, while a receive queued after the request's read drained
// the socket costs no system call. Bytes that arrive (a pipelined request) end the watch and stay
// for the session to read. A TLS client's bytes cannot be told apart from outside the SSL engine
// (its close_notify alert is a record like any other), so for TLS they start a poll for the
// socket's hang-up (POLLRDHUP, every 20 ms, as the engines' server watches) until the flow ends.
void PollClientHangUp(std::shared_ptr<FlowCtx> ctx) {
  FlowCtx* c = ctx.get();
  c->tls_watch->expires_after(std::chrono::milliseconds(20));
  c->tls_watch->async_wait([ctx = std::move(ctx)](beast::error_code ec) mutable {
    if (ec || ctx->finished) return;
    pollfd p{ctx->client->lowest_layer().native_handle(), POLLRDHUP, 0};
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0) {
      ctx->Push(ctx->flow.OnClientDisconnect(SteadyNow()));
      return;
    }
    PollClientHangUp(std::move(ctx));
  });
}

void WatchClient(std::shared_ptr<FlowCtx> ctx, Stream* sock) {
  FlowCtx* c = ctx.get();
  sock->lowest_layer().async_receive(
      net::buffer(&c->client_peek, 1), tcp::socket::message_peek,
      [ctx = std::move(ctx)](beast::error_code ec, size_t n) mutable {
        if (ec == net::error::operation_aborted || ctx->finished) return;
        if (ec || n == 0) {
          ctx->Push(ctx->flow.OnClientDisconnect(SteadyNow()));
        } else if (ctx->client->is_tls()) {
          ctx->tls_watch.emplace(ctx->ex);
          PollClientHangUp(std::move(ctx));
        }
      });
}

}  // namespace

awaitable<void> ProxyServer::Impl::Release(ReleaseHold rel, std::string request_id) {
  json body = {{"transfer_id", rel.transfer_id}};
  auto r = co_await HttpCall(http::verb::post, rel.prefill.url, "/v1/kv/release", body.dump(),
                             options.cluster_token, options.connect_timeout, client_tls.get());
  if (r.ok() && r->status / 100 == 2) {
    m_releases_ok->Inc();
  } else {
    m_releases_failed->Inc();
    KVB_LOG_WARN(
        "request {}: release of transfer {} at {} failed: {}", request_id, rel.transfer_id,
        rel.prefill.url,
        r.ok() ? "HTTP " + std::to_string(r->status) + " " + r->body : r.status().ToString());
  }
}

// POST /v1/instances/drain: route around the instance from now on, then tell the engine to drain
// (POST /drain: it refuses new requests, finishes what it has, deregisters and exits 0).
awaitable<HttpReply> ProxyServer::Impl::DrainInstance(std::string key) {
  std::optional<InstanceState> st;
  {
    std::lock_guard<std::mutex> lock(mu);
    st = registry.Find(key);
    if (st) registry.SetDraining(st->info.id).IgnoreError();
  }
  HttpReply reply;
  reply.content_type = "application/json";
  if (!st) {
    reply.status = 404;
    reply.body = ErrorJson(404, "instance_error", "instance " + key + " is not known (id or name)");
    co_return reply;
  }
  KVB_LOG_INFO("draining {} ({})", st->info.id, st->info.url);
  std::string url = st->info.url;
  std::string target = "/drain";
  std::string body = "{}";
  std::string token = options.cluster_token;
  Result<HttpReply> r =
      co_await HttpCall(http::verb::post, std::move(url), std::move(target), std::move(body),
                        std::move(token), options.connect_timeout, client_tls.get());
  if (r.ok() && r->status / 100 == 2) {
    json j = {{"status", "draining"}, {"instance_id", st->info.id}, {"url", st->info.url}};
    reply.status = 200;
    reply.body = j.dump();
    co_return reply;
  }
  std::string why = r.ok() ? "answered " + std::to_string(r->status) + " " + r->body
                           : "failed: " + r.status().ToString();
  reply.status = 502;
  reply.body =
      ErrorJson(502, "bad_gateway",
                "instance " + st->info.id + " is routed around, but its POST /drain " + why);
  co_return reply;
}

awaitable<bool> ProxyServer::Impl::RunFlow(Stream& sock, Request& req) {
  struct Pending {  // counted while this request is in flight, however it ends
    std::atomic<int>& n;
    int value;
    explicit Pending(std::atomic<int>& c) : n(c), value(n.fetch_add(1) + 1) {}
    ~Pending() { n.fetch_sub(1); }
  } counted_pending(pending);
  // Overload: past max_pending requests in flight, refuse at once (the client retries later)
  // rather than queue without bound in front of engines that are full already.
  if (options.max_pending > 0 && counted_pending.value > options.max_pending) {
    m_overloaded->Inc();
    std::string body = ErrorJson(429, "too_many_requests",
                                 "the proxy has " + std::to_string(options.max_pending) +
                                     " requests in flight (--max-pending); retry later");
    const std::string retry_after =
        "Retry-After: " + std::to_string(options.retry_after_s) + "\r\n";
    co_return co_await WriteWhole(sock, req, 429, "application/json", std::move(body), retry_after);
  }
  DurationUs client_timeout = 0;
  if (auto it = req.find(kRequestTimeoutHeader); it != req.end()) {
    Result<DurationUs> t = ParseRequestTimeout(ToStd(it->value()));
    if (!t.ok()) {
      outcome_counters[Outcome::kBadRequest]->Inc();
      std::string body = ErrorJson(400, "invalid_request_error", t.status().message());
      co_return co_await WriteWhole(sock, req, 400, "application/json", std::move(body));
    }
    client_timeout = *t;
  }
  auto ex = co_await net::this_coro::executor;
  const TimePoint t0 = SteadyNow();
  FlowOptions fo;
  fo.mode = options.mode;
  fo.prefill_forward_n = options.prefill_forward_n;
  fo.colocated = options.colocated;
  fo.max_attempts = options.max_attempts;
  fo.timeout = options.request_timeout;
  fo.instance_wait = options.instance_wait;
  fo.mint_transfer_id = [] { return MintTransferId(); };
  InstancePicker picker = [this](Role role, const std::vector<std::string>& exclude) {
    std::lock_guard<std::mutex> lock(mu);
    return registry.Pick(role, exclude);
  };
  if (kv_router.active()) {
    std::optional<std::vector<int32_t>> ids =
        co_await PromptIds(std::string(req.target()), req.body());
    if (ids) {
      const TimePoint t1 = SteadyNow();
      KvRouteDecision d;
      {
        std::lock_guard<std::mutex> lock(mu);
        d = kv_router.Decide(*ids, registry, kv_index, options.colocated);
      }
      m_kv_route_seconds->Observe(static_cast<double>(SteadyNow() - t1) / kSecond);
      (d.skip_prefill ? m_kv_route_skip : m_kv_route_pd)->Inc();
      fo = DecidedFlowOptions(d, fo);
      picker = DecidedPicker(d, std::move(picker));
    } else {
      m_kv_route_no_ids->Inc();
    }
  }
  auto ctx = std::make_shared<FlowCtx>(this, ex, fo, std::move(picker), &sock, &req, t0);
  ctx->request_id = SanitizeRequestId(ToStd(req["X-Request-Id"]));
  if (ctx->request_id.empty()) ctx->request_id = ctx->flow.transfer_id();
  in_flight.Add(1);
  ctx->Push(ctx->flow.OnClientRequest(
      {std::string(req.target()), std::move(req.body()), client_timeout}, t0));
  beast::error_code ec;
  for (;;) {
    co_await Drain(ctx, /*in_leg=*/false);
    if (ctx->flow.done()) break;
    // Spawned legs are running: sleep until one of them (or the client, or the deadline) pushes.
    ctx->WatchClientOnce();
    ctx->sleeping = true;
    ctx->wake.expires_at(net::steady_timer::time_point::max());
    co_await ctx->wake.async_wait(net::redirect_error(kAwait, ec));
    ctx->sleeping = false;
  }
  ctx->finished = true;
  ctx->deadline_timer.cancel();
  if (ctx->client_watched) {
    beast::error_code ignore;
    sock.lowest_layer().cancel(ignore);  // ends WatchClient
    if (ctx->tls_watch) ctx->tls_watch->cancel();
  }
  in_flight.Add(-1);
  ctx->CountOutcome();
  ctx->RecordTimeline();
  co_return ctx->client_ok && ctx->flow.outcome() != Outcome::kClientDisconnected;
}

awaitable<bool> ProxyServer::Impl::Handle(Stream& sock, Request& req) {
  std::string target(req.target());
  auto q = target.find('?');
  std::string path = q == std::string::npos ? target : target.substr(0, q);
  const bool get = req.method() == http::verb::get;
  const bool post = req.method() == http::verb::post;
  if (post && (path == "/v1/completions" || path == "/v1/chat/completions")) {
    co_return co_await RunFlow(sock, req);
  }
  if (get && path == "/health") {
    json j = {{"status", "ok"},
              {"prefill_healthy", CountInstances(Role::kPrefill, true)},
              {"decode_healthy", CountInstances(Role::kDecode, true)}};
    co_return co_await WriteWhole(sock, req, 200, "application/json", j.dump());
  }
  if (get && path == "/metrics") {
    co_return co_await WriteWhole(sock, req, 200, "text/plain; version=0.0.4", RenderMetrics());
  }
  if (get && path.rfind("/v1/requests/", 0) == 0 && path.size() > 22 &&
      path.compare(path.size() - 9, 9, "/timeline") == 0) {
    const std::string id = path.substr(13, path.size() - 13 - 9);
    if (std::optional<json> tl = timelines.Get(id)) {
      co_return co_await WriteWhole(sock, req, 200, "application/json", tl->dump());
    }
    co_return co_await WriteWhole(
        sock, req, 404, "application/json",
        ErrorJson(404, "not_found", "no recent request with id or transfer_id '" + id + "'"));
  }
  if (get && path == "/v1/prometheus/targets") {
    std::string self(ToStd(req[http::field::host]));
    if (self.empty()) self = options.host + ":" + std::to_string(bound_port);
    co_return co_await WriteWhole(sock, req, 200, "application/json",
                                  PrometheusTargets(self).dump());
  }
  if (get && path == "/instances") {
    co_return co_await WriteWhole(sock, req, 200, "application/json", InstancesJson().dump());
  }
  // Answered by any one engine (they all serve the same model with the same tokenizer): a
  // decode's, else a prefill's.
  const bool any_engine =
      (get && path == "/v1/models") || (post && (path == "/tokenize" || path == "/detokenize"));
  if (any_engine) {
    std::optional<Endpoint> ep;
    {
      std::lock_guard<std::mutex> lock(mu);
      ep = registry.Pick(Role::kDecode, {});
      if (!ep) ep = registry.Pick(Role::kPrefill, {});
    }
    if (!ep) {
      co_return co_await WriteWhole(sock, req, 503, "application/json",
                                    ErrorJson(503, "service_unavailable", "no instance available"));
    }
    // Named locals, not a conditional temporary: GCC 12 destroys a ?: temporary passed by
    // value to a coroutine twice (seen as free(): invalid pointer).
    std::string url = ep->url;
    std::string body;
    if (post) body = req.body();
    auto r =
        co_await HttpCall(req.method(), std::move(url), path, std::move(body),
                          options.cluster_token, options.connect_timeout * 5, client_tls.get());
    if (!r.ok()) {
      co_return co_await WriteWhole(sock, req, 502, "application/json",
                                    ErrorJson(502, "bad_gateway", r.status().ToString()));
    }
    co_return co_await WriteWhole(sock, req, r->status, r->content_type, std::move(r->body));
  }
  if (post && path.rfind("/v1/instances/", 0) == 0) {
    if (!TokenOk(req)) {
      co_return co_await WriteWhole(
          sock, req, 401, "application/json",
          ErrorJson(401, "unauthorized", "missing or wrong cluster token"));
    }
    const TimePoint now = SteadyNow();
    if (path == "/v1/instances/register") {
      auto parsed = ParseRegistration(req.body());
      Status s = parsed.status();
      std::vector<std::string> replaced;
      if (parsed.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        s = registry.Register(parsed->first, parsed->second, now, &replaced);
      }
      for (const std::string& old : replaced) {
        KVB_LOG_WARN("instance {} replaced by a new incarnation of {} at {}", old,
                     parsed->first.name, parsed->first.url);
      }
      if (!s.ok()) {
        m_registrations_refused->Inc();
        KVB_LOG_WARN("registration refused: {}", s.ToString());
        int code = s.code() == StatusCode::kFailedPrecondition ? 409
                   : s.code() == StatusCode::kAlreadyExists    ? 409
                                                               : 400;
        co_return co_await WriteWhole(sock, req, code, "application/json",
                                      ErrorJson(code, "registration_refused", s.ToString()));
      }
      m_registrations_ok->Inc();
      std::string id = parsed->first.id.empty() ? parsed->first.url : parsed->first.id;
      while (!id.empty() && id.back() == '/') id.pop_back();
      KVB_LOG_INFO("registered {} {} ({})", RoleName(parsed->first.role), parsed->first.url, id);
      json j = {{"instance_id", id},
                {"heartbeat_interval_ms", options.heartbeat_interval / kMillisecond},
                {"expiry_ms", options.heartbeat_timeout / kMillisecond}};
      co_return co_await WriteWhole(sock, req, 200, "application/json", j.dump());
    }
    json j = json::parse(req.body(), nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("instance_id") ||
        !j["instance_id"].is_string()) {
      co_return co_await WriteWhole(
          sock, req, 400, "application/json",
          ErrorJson(400, "invalid_request_error", "body must be an object with instance_id"));
    }
    std::string id = j["instance_id"].get<std::string>();
    Status s;
    if (path == "/v1/instances/heartbeat") {
      auto load = ParseLoad(j.contains("load") ? j["load"].dump() : "{}");
      s = load.status();
      if (load.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        s = registry.Heartbeat(id, *load, now);
      }
    } else if (path == "/v1/instances/deregister") {
      std::lock_guard<std::mutex> lock(mu);
      s = registry.Remove(id);
      if (s.ok()) KVB_LOG_INFO("deregistered {}", id);
    } else if (path == "/v1/instances/drain") {
      HttpReply reply = co_await DrainInstance(id);
      co_return co_await WriteWhole(sock, req, reply.status, reply.content_type,
                                    std::move(reply.body));
    } else {
      co_return co_await WriteWhole(sock, req, 404, "application/json",
                                    ErrorJson(404, "not_found", "no such endpoint"));
    }
    if (!s.ok()) {
      int code = s.code() == StatusCode::kNotFound ? 404 : 400;
      co_return co_await WriteWhole(sock, req, code, "application/json",
                                    ErrorJson(code, "instance_error", s.ToString()));
    }
    co_return co_await WriteWhole(sock, req, 200, "application/json", R"({"status":"ok"})");
  }
  co_return co_await WriteWhole(sock, req, 404, "application/json",
                                ErrorJson(404, "not_found", "no such endpoint: " + path));
}

awaitable<void> ProxyServer::Impl::Session(tcp::socket socket) {
  beast::error_code ec;
  socket.set_option(tcp::no_delay(true), ec);
  socket.non_blocking(true, ec);  // for WriteNow
  std::optional<Stream> opened;
  if (server_tls) {
    opened.emplace(std::move(socket), *server_tls);
    {
      // A client that never completes its handshake does not hold the session forever.
      CloseAfter guard(opened->lowest_layer(), options.connect_timeout * 5);
      co_await opened->tls()->async_handshake(ssl::stream_base::server,
                                              net::redirect_error(kAwait, ec));
    }
    if (ec) {
      KVB_LOG_DEBUG("TLS handshake from a client failed: {}", ec.message());
      opened->lowest_layer().close(ec);
      co_return;
    }
  } else {
    opened.emplace(std::move(socket));
  }
  Stream& sock = *opened;
  beast::flat_buffer buf;
  buf.reserve(16384);  // else Beast reads a large request 512 bytes at a time at first
  try {
    for (;;) {
      http::request_parser<http::string_body> parser;
      parser.body_limit(64u << 20);
      ec = co_await ReadMessage(sock, buf, parser, /*header_only=*/false);
      if (ec == http::error::end_of_stream || ec == net::error::eof ||
          ec == net::error::connection_reset || ec == net::error::operation_aborted ||
          ec == ssl::error::stream_truncated) {
        break;
      }
      if (ec) {
        Request dummy;
        dummy.version(11);
        dummy.keep_alive(false);
        co_await WriteWhole(sock, dummy, 400, "application/json",
                            ErrorJson(400, "invalid_request_error", ec.message()));
        break;
      }
      Request req = parser.release();
      bool keep = req.keep_alive();
      bool ok = co_await Handle(sock, req);
      if (!ok || !keep) break;
    }
  } catch (const std::exception& e) {
    KVB_LOG_ERROR("proxy session failed: {}", e.what());
  }
  sock.lowest_layer().shutdown(tcp::socket::shutdown_send, ec);
  sock.lowest_layer().close(ec);
}

awaitable<void> ProxyServer::Impl::Accept() {
  for (;;) {
    beast::error_code ec;
    // One event-loop thread serialises everything already; a strand would only add a hop.
    net::any_io_executor ex = options.threads == 1 ? net::any_io_executor(ioc.get_executor())
                                                   : net::any_io_executor(net::make_strand(ioc));
    tcp::socket sock(ex);
    co_await acceptor.async_accept(sock, net::redirect_error(kAwait, ec));
    if (ec == net::error::operation_aborted) co_return;
    if (ec) {
      KVB_LOG_WARN("accept failed: {}", ec.message());
      continue;
    }
    net::co_spawn(ex, Session(std::move(sock)), net::detached);
  }
}

awaitable<void> ProxyServer::Impl::Housekeeping() {
  auto ex = co_await net::this_coro::executor;
  net::steady_timer timer(ex);
  TimePoint next_probe = SteadyNow() + options.health_probe_interval;
  for (;;) {
    timer.expires_after(std::chrono::milliseconds(200));
    beast::error_code ec;
    co_await timer.async_wait(net::redirect_error(kAwait, ec));
    if (ec) co_return;
    const TimePoint now = SteadyNow();
    pool.Sweep(now);
    if (kv_router.active()) FollowNewEngines();
    std::vector<InstanceState> statics;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const std::string& id : registry.Expire(now)) {
        expired.Inc();
        KVB_LOG_WARN("instance {} dropped: no heartbeat for {} ms", id,
                     options.heartbeat_timeout / kMillisecond);
      }
      if (now >= next_probe) {
        for (auto& st : registry.List()) {
          if (st.is_static || st.from_store) statics.push_back(st);
        }
      }
    }
    if (now < next_probe) continue;
    next_probe = now + options.health_probe_interval;
    for (const auto& st : statics) {
      auto r = co_await HttpCall(http::verb::get, st.info.url, "/health", "", "",
                                 options.connect_timeout, client_tls.get());
      bool healthy = r.ok() && r->status == 200;
      std::lock_guard<std::mutex> lock(mu);
      auto cur = registry.Get(st.info.id);
      if (cur && cur->healthy != healthy) {
        KVB_LOG_WARN("instance {} is now {}{}", st.info.url, healthy ? "healthy" : "unhealthy",
                     healthy  ? ""
                     : r.ok() ? ": GET /health answered " + std::to_string(r->status)
                              : ": " + std::string(r.status().message()));
      }
      registry.SetHealthy(st.info.id, healthy);
      // An etcd instance's load comes point to point, in its /health answer (docs/proxy.md
      // "Control plane on etcd": why not in etcd).
      if (healthy && st.from_store) {
        json h = json::parse(r->body, nullptr, false);
        if (h.is_object() && h.contains("load")) {
          auto load = ParseLoad(h["load"].dump());
          if (load.ok()) registry.Heartbeat(st.info.id, *load, now).IgnoreError();
        }
      }
    }
  }
}

// --- KV-aware routing: followers of the engines' KV event streams, prompt ids ---------------

void ProxyServer::Impl::AddKvMetrics() {
  const char* help = "Requests routed by the KV-aware router / P/D skip, by path taken.";
  m_kv_route_skip = &metrics.AddCounter("kvbridge_proxy_kv_routes_total", help, "path=\"skip\"");
  m_kv_route_pd = &metrics.AddCounter("kvbridge_proxy_kv_routes_total", help, "path=\"pd\"");
  m_kv_route_no_ids =
      &metrics.AddCounter("kvbridge_proxy_kv_routes_total", help, "path=\"no_prompt_ids\"");
  m_kv_route_seconds = &metrics.AddHistogram(
      "kvbridge_proxy_kv_route_seconds",
      "KV-aware routing decision: prompt block hashes, index lookups, scores.",
      Histogram::FineLatencyBucketsSeconds());
  m_prompt_ids_seconds = &metrics.AddHistogram(
      "kvbridge_proxy_prompt_ids_seconds",
      "Getting a request's prompt ids for routing (in-process tokenizer, or an engine's "
      "/tokenize).",
      Histogram::FineLatencyBucketsSeconds());
  metrics.AddCallbackGauge("kvbridge_proxy_kv_index_blocks", "Block hashes in the KV index.",
                           [this] {
                             std::lock_guard<std::mutex> lock(mu);
                             return static_cast<double>(kv_index.num_blocks());
                           });
  metrics.AddCallbackGauge("kvbridge_proxy_kv_index_entries",
                           "(block hash, engine) pairs in the KV index.", [this] {
                             std::lock_guard<std::mutex> lock(mu);
                             return static_cast<double>(kv_index.num_entries());
                           });
}

void ProxyServer::Impl::FollowNewEngines() {
  std::vector<std::pair<std::string, std::string>> fresh;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const InstanceState& st : registry.List()) {
      if (kv_followed.insert(st.info.id).second) fresh.emplace_back(st.info.id, st.info.url);
    }
  }
  for (auto& [id, url] : fresh) {
    net::co_spawn(net::make_strand(ioc), FollowKvEvents(id, url), net::detached);
  }
}

// One engine's stream, while the engine is in the registry: long polls, each answer applied to
// the index; a lost connection or an engine restart heals by itself (same cursor, or a reset
// answered by the engine). When the engine leaves the registry its entries go.
awaitable<void> ProxyServer::Impl::FollowKvEvents(std::string id, std::string url) {
  auto ex = co_await net::this_coro::executor;
  net::steady_timer backoff(ex);
  for (;;) {
    std::string query;
    {
      std::lock_guard<std::mutex> lock(mu);
      std::optional<InstanceState> st = registry.Get(id);
      if (!st || st->info.url != url) {
        kv_index.DropEngine(id);
        kv_followed.erase(id);
        co_return;
      }
      query = kv_index.NextQuery(id, options.kv_events_poll_ms);
    }
    auto r = co_await HttpCall(
        http::verb::get, url, "/v1/kv/events?" + query, "", options.cluster_token,
        options.kv_events_poll_ms * kMillisecond + options.connect_timeout, client_tls.get());
    Status applied = OkStatus();
    if (r.ok() && r->status == 200) {
      auto batch = ParseKvEventBatch(r->body);
      std::lock_guard<std::mutex> lock(mu);
      applied = batch.ok() ? kv_index.Apply(id, *batch) : batch.status();
      if (applied.ok()) continue;
    }
    if (!applied.ok()) KVB_LOG_DEBUG("kv events of {}: {}", id, applied.ToString());
    // Unreachable, an error status (an engine without the stream: 404) or a refused batch.
    backoff.expires_after(std::chrono::milliseconds(applied.ok() ? 500 : 50));
    beast::error_code ec;
    co_await backoff.async_wait(net::redirect_error(kAwait, ec));
    if (ec) co_return;
  }
}

awaitable<std::optional<std::vector<int32_t>>> ProxyServer::Impl::PromptIds(std::string path,
                                                                            std::string body) {
  const TimePoint t0 = SteadyNow();
  std::optional<std::vector<int32_t>> out;
  std::vector<int32_t> given;  // a completion's prompt given as ids needs no tokenizer
  if (path == "/v1/completions") {
    json j = json::parse(body, nullptr, false);
    const json* p = j.is_object() && j.contains("prompt") ? &j["prompt"] : nullptr;
    if (p != nullptr && p->is_array() && !p->empty() &&
        std::all_of(p->begin(), p->end(), [](const json& v) { return v.is_number_integer(); })) {
      for (const json& v : *p) given.push_back(v.get<int32_t>());
    }
  }
  if (!given.empty()) {
    out = std::move(given);
  } else if (options.prompt_ids) {
    auto ids = options.prompt_ids(path, body);
    if (ids.ok()) out = std::move(*ids);
  } else {
    std::optional<Endpoint> ep;
    {
      std::lock_guard<std::mutex> lock(mu);
      ep = registry.Pick(Role::kDecode, {});
      if (!ep) ep = registry.Pick(Role::kPrefill, {});
    }
    if (ep) {
      std::string url = ep->url;
      auto r = co_await HttpCall(http::verb::post, std::move(url), "/tokenize", std::move(body),
                                 options.cluster_token, options.connect_timeout, client_tls.get());
      if (r.ok() && r->status == 200) {
        json j = json::parse(r->body, nullptr, false);
        if (j.is_object() && j.contains("tokens") && j["tokens"].is_array()) {
          out.emplace();
          for (const json& t : j["tokens"]) {
            if (t.is_number_integer()) out->push_back(t.get<int32_t>());
          }
        }
      }
    }
  }
  m_prompt_ids_seconds->Observe(static_cast<double>(SteadyNow() - t0) / kSecond);
  co_return out;
}

ProxyServer::ProxyServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ProxyServer::~ProxyServer() { Stop(); }

Result<std::unique_ptr<ProxyServer>> ProxyServer::Create(const ProxyOptions& options) {
  if (options.threads < 1 || options.threads > 64) {
    return InvalidArgumentError("threads must be in [1, 64]");
  }
  if (options.port < 0 || options.port > 65535) return InvalidArgumentError("bad port");
  auto impl = std::make_unique<Impl>(options);
  if (!options.ssl_certfile.empty() || !options.ssl_keyfile.empty()) {
    auto ctx = MakeServerTlsContext(options.ssl_certfile, options.ssl_keyfile);
    if (!ctx.ok()) return ctx.status();
    impl->server_tls = *ctx;
  }
  // Always made (cheap): an https:// engine may register at any time. The proxy's own
  // certificate, when it has one, is its client certificate for engines that ask (mutual TLS).
  auto client_ctx =
      MakeClientTlsContext(options.ssl_ca_certs, options.ssl_certfile, options.ssl_keyfile);
  if (!client_ctx.ok()) return client_ctx.status().WithPrefix("--ssl-ca-certs");
  impl->client_tls = *client_ctx;
  for (const auto& url : options.prefill_urls) {
    RETURN_IF_ERROR(impl->registry.AddStatic(Role::kPrefill, url).WithPrefix("--prefill"));
  }
  for (const auto& url : options.decode_urls) {
    RETURN_IF_ERROR(impl->registry.AddStatic(Role::kDecode, url).WithPrefix("--decode"));
  }
  beast::error_code ec;
  auto addr = net::ip::make_address(options.host, ec);
  if (ec) return InvalidArgumentError("bad --host '" + options.host + "': " + ec.message());
  tcp::endpoint ep(addr, static_cast<unsigned short>(options.port));
  impl->acceptor.open(ep.protocol(), ec);
  if (!ec) impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return UnavailableError("cannot listen on " + options.host + ":" +
                            std::to_string(options.port) + ": " + ec.message());
  }
  impl->bound_port = impl->acceptor.local_endpoint().port();
  return std::unique_ptr<ProxyServer>(new ProxyServer(std::move(impl)));
}

void ProxyServer::Impl::ApplyEtcd(std::vector<EtcdKvUpdate> updates) {
  std::vector<std::string> log;
  {
    std::lock_guard<std::mutex> lock(mu);
    const TimePoint now = SteadyNow();
    for (const EtcdKvUpdate& u : updates) etcd_sync->Apply(u, registry, now, &log);
  }
  for (const std::string& line : log) {
    if (line.find(" ignored: ") != std::string::npos) {
      KVB_LOG_WARN("{}", line);
    } else {
      KVB_LOG_INFO("{}", line);
    }
  }
}

void ProxyServer::Start() {
  if (impl_->started) return;
  impl_->started = true;
  if (!impl_->options.etcd.endpoints.empty()) {
    impl_->etcd_sync = std::make_unique<EtcdRegistrySync>(impl_->options.cluster_token);
    impl_->etcd_feed = EtcdWatchFeed::Start(
        impl_->options.etcd, impl_->options.etcd_prefix,
        [impl = impl_.get()](std::vector<EtcdKvUpdate> u) { impl->ApplyEtcd(std::move(u)); });
  }
  net::co_spawn(impl_->ioc, impl_->Accept(), net::detached);
  net::co_spawn(net::make_strand(impl_->ioc), impl_->Housekeeping(), net::detached);
  for (int i = 0; i < impl_->options.threads; ++i) {
    impl_->threads.emplace_back([this] { impl_->ioc.run(); });
  }
}

void ProxyServer::Stop() {
  if (!impl_) return;
  if (impl_->etcd_feed) impl_->etcd_feed->Stop();
  impl_->ioc.stop();
  for (auto& t : impl_->threads) {
    if (t.joinable()) t.join();
  }
  impl_->threads.clear();
}

int ProxyServer::port() const { return impl_->bound_port; }

std::vector<InstanceState> ProxyServer::Instances() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->registry.List();
}

std::string ProxyServer::MetricsText() const { return impl_->RenderMetrics(); }

}  // namespace kvbridge::proxy
