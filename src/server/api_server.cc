#include "kvbridge/server/api_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <mutex>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/logging.h"
#include "kvbridge/engine/engine.h"
#include "server/openai_protocol.h"

namespace kvbridge::server {

using nlohmann::json;

std::string HttpRequest::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (k.size() == name.size() && std::equal(k.begin(), k.end(), name.begin(), [](char a, char b) {
          return std::tolower(a) == std::tolower(b);
        })) {
      return v;
    }
  }
  return "";
}

namespace {

std::string_view ErrorType(int status) {
  switch (status) {
    case 400:
      return "invalid_request_error";
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 405:
      return "invalid_request_error";
    case 413:
      return "invalid_request_error";
    case 503:
      return "overloaded_error";
    case 504:
      return "timeout_error";
    default:
      return status >= 500 ? "internal_error" : "invalid_request_error";
  }
}

}  // namespace

std::string OpenAiErrorBody(int status, std::string_view message, std::string_view param) {
  json err{{"message", std::string(message)},
           {"type", std::string(ErrorType(status))},
           {"param", param.empty() ? json(nullptr) : json(std::string(param))},
           {"code", status}};
  return DumpJson(json{{"error", err}});
}

HttpResponse OpenAiErrorResponse(int status, std::string_view message, std::string_view param) {
  return HttpResponse{status, OpenAiErrorBody(status, message, param), "application/json"};
}

int HttpStatusFromStatus(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk:
      return 200;
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kAlreadyExists:
      return 400;
    case StatusCode::kUnauthenticated:
      return 401;
    case StatusCode::kPermissionDenied:
      return 403;
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnavailable:
      return 503;
    case StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(20);

void SetError(httplib::Response& res, int status, std::string_view message,
              std::string_view param = "") {
  res.status = status;
  res.set_content(OpenAiErrorBody(status, message, param), "application/json");
}

// cpp-httplib 0.11.4 gives handlers no socket and no is_connection_closed(); the connection's
// fd is found by its address pair (it stays open while the handler runs, so it cannot be reused).
int FindConnectionFd(const httplib::Request& req) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    struct stat st {};
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage peer{}, local{};
    socklen_t plen = sizeof(peer), llen = sizeof(local);
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &plen) != 0) continue;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &llen) != 0)
      continue;
    auto addr_port = [](const sockaddr_storage& ss, std::string* ip, int* port) {
      char buf[INET6_ADDRSTRLEN] = {0};
      if (ss.ss_family == AF_INET) {
        auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
        inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
        *port = ntohs(a->sin_port);
      } else if (ss.ss_family == AF_INET6) {
        auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
        inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
        *port = ntohs(a->sin6_port);
      } else {
        return false;
      }
      *ip = buf;
      return true;
    };
    std::string pip, lip;
    int pport = -1, lport = -1;
    if (!addr_port(peer, &pip, &pport) || !addr_port(local, &lip, &lport)) continue;
    if (pport != req.remote_port || pip != req.remote_addr) continue;
    if (req.local_port > 0 && lport != req.local_port) continue;
    found = static_cast<int>(fd);
    break;
  }
  closedir(dir);
  return found;
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

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

HttpRequest ToHttpRequest(const httplib::Request& req) {
  HttpRequest r;
  r.method = req.method;
  r.path = req.path;
  r.body = req.body;
  for (const auto& [k, v] : req.headers) r.headers.emplace(k, v);
  for (const auto& m : req.matches) r.path_matches.push_back(m.str());
  r.remote_addr = req.remote_addr;
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
using HttpServer = BacklogServer<httplib::Server>;
using HttpsServer = BacklogServer<httplib::SSLServer>;  // --ssl-certfile / --ssl-keyfile

// One HTTP generation request: its engine requests (one per prompt) and their outputs.
struct Job {
  Job(const ParsedRequest& parsed, const Tokenizer& tok, std::string id, std::string model)
      : builder(parsed, tok, std::move(id), std::move(model), UnixSeconds()) {}
  std::mutex mu;
  std::condition_variable cv;
  ResponseBuilder builder;               // guarded by mu
  uint64_t version = 0;                  // guarded by mu; bumps on every engine output
  std::vector<std::string> request_ids;  // set before the first AddRequest returns; then const
  std::atomic<bool> aborted{false};
};

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
  std::mutex stop_call_mu;  // serializes Stop()
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopped = false;  // guarded by stop_mu

  std::mutex jobs_mu;
  std::set<std::shared_ptr<Job>> live_jobs;  // guarded by jobs_mu

  MetricsRegistry metrics;
  Gauge* in_flight = nullptr;
  Counter* disconnects = nullptr;
  Counter* engine_rejections = nullptr;

  void AbortJob(Job& job) {
    if (job.aborted.exchange(true)) return;
    for (const std::string& id : job.request_ids) engine->Abort(id);
  }
  void Track(const std::shared_ptr<Job>& job) {
    std::lock_guard<std::mutex> l(jobs_mu);
    if (live_jobs.insert(job).second) in_flight->Add(1);
  }
  void Untrack(const std::shared_ptr<Job>& job) {
    std::lock_guard<std::mutex> l(jobs_mu);
    if (live_jobs.erase(job) > 0) in_flight->Add(-1);
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
  if (stopping.load()) return SetError(res, 503, "the server is shutting down");
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

  const std::string id =
      (endpoint == Endpoint::kCompletions ? "cmpl-" : "chatcmpl-") + RandomHex(24);
  auto job = std::make_shared<Job>(parsed, tokenizer, id, config.served_model_name);
  const size_t num_prompts = parsed.prompts.size();
  for (size_t p = 0; p < num_prompts; ++p) {
    job->request_ids.push_back(num_prompts == 1 ? id : id + "-" + std::to_string(p));
  }
  Track(job);
  for (size_t p = 0; p < num_prompts; ++p) {
    EngineRequest er;
    er.request_id = job->request_ids[p];
    er.prompt_token_ids = std::move(parsed.prompts[p]);
    er.sampling = parsed.sampling;
    er.kv_transfer_params = parsed.kv_transfer_params;
    er.arrival_time = SteadyNow();
    Status s = engine->AddRequest(std::move(er), [job, p](const RequestOutput& out) {
      {
        std::lock_guard<std::mutex> l(job->mu);
        job->builder.Apply(p, out);
        ++job->version;
      }
      job->cv.notify_all();
    });
    if (!s.ok()) {
      // Nothing was queued for prompt p; end the prompts already queued.
      for (size_t q = 0; q < p; ++q) engine->Abort(job->request_ids[q]);
      job->aborted = true;
      Untrack(job);
      if (s.code() == StatusCode::kResourceExhausted) engine_rejections->Inc();
      return SetError(res, HttpStatusFromStatus(s), s.message());
    }
  }

  const int fd = FindConnectionFd(req);
  if (!parsed.stream) {
    std::unique_lock<std::mutex> l(job->mu);
    while (!job->builder.AllFinished()) {
      job->cv.wait_for(l, kPollInterval);
      if (job->builder.AllFinished()) break;
      if (!job->aborted && (ConnectionClosed(fd) || stopping.load())) {
        if (!stopping.load()) disconnects->Inc();
        l.unlock();
        AbortJob(*job);  // never call the engine while holding job->mu (its callback takes it)
        l.lock();
      }
    }
    Status s = job->builder.FirstError();
    json out = job->builder.FinalBody();
    l.unlock();
    Untrack(job);
    if (!s.ok()) return SetError(res, HttpStatusFromStatus(s), s.message());
    res.status = 200;
    res.set_content(DumpJson(out), "application/json");
    return;
  }

  auto seen = std::make_shared<uint64_t>(~uint64_t{0});
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job, fd, seen](size_t, httplib::DataSink& sink) -> bool {
        std::string frames;
        bool done = false;
        {
          std::unique_lock<std::mutex> l(job->mu);
          job->cv.wait_for(l, kPollInterval, [&] { return job->version != *seen; });
          *seen = job->version;
          frames = job->builder.TakeStreamFrames();
          done = job->builder.StreamDone();
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
          std::lock_guard<std::mutex> l(job->mu);
          finished = job->builder.AllFinished();
        }
        if (!finished) {
          if (!success && !stopping.load()) disconnects->Inc();
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
             res.set_content("{}", "application/json");
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
  if (config.max_n < 1) return InvalidArgumentError("max_n must be >= 1");
  if (config.max_model_len < 0) return InvalidArgumentError("max_model_len must be >= 0");
  if (config.port < 0 || config.port > 65535) return InvalidArgumentError("port out of range");
  std::signal(SIGPIPE, SIG_IGN);

  auto impl = std::make_unique<Impl>(std::move(tokenizer));
  Impl* d = impl.get();
  d->config = std::move(config);
  d->engine = engine;
  d->limits = ProtocolLimits{d->config.served_model_name, d->config.max_model_len, d->config.max_n,
                             d->config.max_logprobs, d->config.chat_templates.get()};
  d->in_flight = &d->metrics.AddGauge(
      "kvbridge_http_generation_requests_in_flight",
      "Completion and chat requests accepted and not yet answered (or streamed) to the end.");
  d->disconnects = &d->metrics.AddCounter(
      "kvbridge_http_client_disconnects_total",
      "Generation requests aborted because the client went away before the answer.");
  d->engine_rejections = &d->metrics.AddCounter(
      "kvbridge_http_engine_rejections_total",
      "Generation requests refused with 503 because the engine queue was full.");

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
  d->svr->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  d->svr->set_keep_alive_timeout(d->config.keep_alive_timeout_s);
  d->svr->set_payload_max_length(64u << 20);
  d->svr->set_pre_routing_handler([d](const httplib::Request& req, httplib::Response& res) {
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
  std::lock_guard<std::mutex> call(d->stop_call_mu);
  if (d->stopping.exchange(true)) return;
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard<std::mutex> l(d->jobs_mu);
    jobs.assign(d->live_jobs.begin(), d->live_jobs.end());
  }
  for (auto& job : jobs) d->AbortJob(*job);
  if (d->started) {
    d->svr->stop();
    if (d->listen_thread.joinable()) d->listen_thread.join();
  }
  {
    std::lock_guard<std::mutex> l(d->stop_mu);
    d->stopped = true;
  }
  d->stop_cv.notify_all();
}

void ApiServer::Wait() {
  std::unique_lock<std::mutex> l(impl_->stop_mu);
  impl_->stop_cv.wait(l, [this] { return impl_->stopped; });
}

bool ApiServer::CheckClusterToken(const HttpRequest& req) const {
  if (impl_->config.cluster_token.empty()) return true;
  return ConstantTimeEquals(req.Header("X-KVBridge-Cluster-Token"), impl_->config.cluster_token);
}

MetricsRegistry& ApiServer::metrics() { return impl_->metrics; }

}  // namespace kvbridge::server
