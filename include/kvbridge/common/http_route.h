// kvbridge/common/http_route.h — HTTP routes as plain data: a request, a response and a route
// (method, path pattern, handler), with no server behind them.
//
// A module that serves HTTP routes (the connector's /v1/kv/*) returns a std::vector<Route>; the
// process that owns the HTTP server (`kvbridge serve`) installs them. So protocol libraries stay
// free of the HTTP server library, and their handlers are testable as plain functions.
//
//   std::vector<Route> routes = runtime->Routes();
//   for (Route& r : routes) RETURN_IF_ERROR(server->RegisterRoute(std::move(r)));
//
// Errors use OpenAI's shape {"error":{"message","type","param","code"}} (docs/api.md).
//
// Thread-safety: values and pure functions; a handler states its own thread-safety (the server
// runs handlers concurrently on its HTTP threads).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge {

/// A request as route handlers see it.
struct HttpRequest {
  std::string method;
  std::string path;
  std::string body;
  std::multimap<std::string, std::string> headers;  ///< names as sent (lookup: Header())
  std::vector<std::string> path_matches;  ///< regex captures of the route pattern, [0] = whole path
  std::string remote_addr;
  /// Query parameters, decoded ("?since=5" → {"since", "5"}).
  std::multimap<std::string, std::string> query;
  /// First value of header `name` (case-insensitive), or "" when absent.
  std::string Header(std::string_view name) const;
};

/// A whole (non-streaming) response from a route handler.
struct HttpResponse {
  int status = 200;
  std::string body;
  std::string content_type = "application/json";
};

using RouteHandler = std::function<HttpResponse(const HttpRequest&)>;

/// One route: `method` GET|POST|PUT|DELETE; `pattern` an ECMAScript regex matched against the
/// whole path (captures land in HttpRequest::path_matches).
struct Route {
  std::string method;
  std::string pattern;
  RouteHandler handler;
};

/// The header that carries the cluster token (DESIGN.md "Security").
inline constexpr std::string_view kClusterTokenHeader = "X-KVBridge-Cluster-Token";

/// True when `token` is empty (none configured) or `req` carries it in kClusterTokenHeader;
/// compared in constant time.
bool ClusterTokenMatches(const HttpRequest& req, std::string_view token);
/// Equality whose time depends only on the lengths (for secrets).
bool ConstantTimeEquals(std::string_view a, std::string_view b);

/// The OpenAI error body {"error":{"message","type","param","code"}}; `param` null when empty;
/// `code` is the HTTP status. type: "invalid_request_error" (400), "authentication_error"
/// (401), "permission_error" (403), "not_found_error" (404), "overloaded_error" (503),
/// "internal_error" (500).
std::string OpenAiErrorBody(int status, std::string_view message, std::string_view param = "");
/// OpenAiErrorBody as a whole response.
HttpResponse OpenAiErrorResponse(int status, std::string_view message, std::string_view param = "");
/// HTTP status for a library Status: InvalidArgument/OutOfRange/FailedPrecondition/
/// AlreadyExists → 400, Unauthenticated → 401, PermissionDenied → 403, NotFound → 404,
/// ResourceExhausted/Unavailable → 503, DeadlineExceeded → 504, others → 500; OK → 200.
int HttpStatusFromStatus(const Status& status);

}  // namespace kvbridge
