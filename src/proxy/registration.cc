#include "kvbridge/proxy/registration.h"

#include <httplib.h>

#include <nlohmann/json.hpp>

#include "kvbridge/common/http_client.h"
#include "kvbridge/common/logging.h"
#include "kvbridge/proxy/proxy_server.h"

namespace kvbridge::proxy {
namespace {

using nlohmann::json;

std::string InstanceId(const RegistrationOptions& o) {
  std::string id = o.info.id.empty() ? o.info.url : o.info.id;
  while (!id.empty() && id.back() == '/') id.pop_back();
  return id;
}

Status Post(const RegistrationOptions& o, const std::string& path, const std::string& body) {
  Result<HttpTarget> target = ParseHttpTarget(o.proxy);
  if (!target.ok()) return target.status().WithPrefix("--proxy");
  std::unique_ptr<httplib::Client> cli = MakeHttpClient(*target, o.tls);
  cli->set_tcp_nodelay(true);
  auto secs = o.request_timeout / kSecond;
  auto usecs = o.request_timeout % kSecond;
  cli->set_connection_timeout(secs, usecs);
  cli->set_read_timeout(secs, usecs);
  cli->set_write_timeout(secs, usecs);
  httplib::Headers headers;
  if (!o.cluster_token.empty()) headers.emplace(kClusterTokenHeader, o.cluster_token);
  auto res = cli->Post(path.c_str(), headers, body, "application/json");
  if (!res) {
    return UnavailableError("proxy " + o.proxy + path + ": " +
                            HttpErrorText(*cli, res.error(), o.tls));
  }
  std::string what =
      "proxy " + path + " answered " + std::to_string(res->status) + ": " + res->body;
  switch (res->status) {
    case 200:
      return OkStatus();
    case 400:
      return InvalidArgumentError(what);
    case 401:
      return UnauthenticatedError(what);
    case 404:
      return NotFoundError(what);
    case 409:
      return FailedPreconditionError(what);
    default:
      return UnavailableError(what);
  }
}

}  // namespace

Status RegisterWithProxy(const RegistrationOptions& options, const InstanceLoad& load) {
  InstanceInfo info = options.info;
  info.id = InstanceId(options);
  return Post(options, "/v1/instances/register", RegistrationJson(info, load));
}

Status SendHeartbeat(const RegistrationOptions& options, const InstanceLoad& load) {
  json j = {{"instance_id", InstanceId(options)},
            {"load",
             {{"running", load.running}, {"waiting", load.waiting}, {"kv_usage", load.kv_usage}}}};
  return Post(options, "/v1/instances/heartbeat", j.dump());
}

Status Deregister(const RegistrationOptions& options) {
  json j = {{"instance_id", InstanceId(options)}};
  return Post(options, "/v1/instances/deregister", j.dump());
}

RegistrationClient::RegistrationClient(RegistrationOptions options, LoadFn load)
    : options_(std::move(options)), load_(std::move(load)) {}

std::unique_ptr<RegistrationClient> RegistrationClient::Start(RegistrationOptions options,
                                                              LoadFn load) {
  if (!load) load = [] { return InstanceLoad{}; };
  std::unique_ptr<RegistrationClient> c(
      new RegistrationClient(std::move(options), std::move(load)));
  c->thread_ = std::thread([p = c.get()] { p->Run(); });
  return c;
}

RegistrationClient::~RegistrationClient() { Stop(); }

Status RegistrationClient::last_status() const {
  MutexLock lock(&mu_);
  return last_status_;
}

void RegistrationClient::Run() {
  Status previous;
  for (;;) {
    Status s;
    if (!registered_.load()) {
      s = RegisterWithProxy(options_, load_());
      if (s.ok()) {
        registered_.store(true);
        KVB_LOG_INFO("registered with proxy {} as {} {}", options_.proxy,
                     RoleName(options_.info.role), InstanceId(options_));
      }
    } else {
      s = SendHeartbeat(options_, load_());
      if (s.code() == StatusCode::kNotFound) {
        registered_.store(false);
        KVB_LOG_WARN("proxy {} forgot this instance; registering again", options_.proxy);
        s = RegisterWithProxy(options_, load_());
        if (s.ok()) registered_.store(true);
      }
    }
    if (!s.ok() && s.code() != previous.code()) {
      KVB_LOG_WARN("proxy registration: {}", s.ToString());
    }
    previous = s;
    MutexLock lock(&mu_);
    last_status_ = s;
    if (cv_.wait_for(lock.native(), std::chrono::microseconds(options_.heartbeat_interval),
                     [this]() REQUIRES(mu_) { return stop_; })) {
      break;
    }
  }
}

void RegistrationClient::Stop() {
  {
    MutexLock lock(&mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (registered_.exchange(false)) Deregister(options_).IgnoreError();
}

}  // namespace kvbridge::proxy
