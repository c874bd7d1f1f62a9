#include "kvbridge/common/http_route.h"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

namespace kvbridge {

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

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

bool ClusterTokenMatches(const HttpRequest& req, std::string_view token) {
  if (token.empty()) return true;
  return ConstantTimeEquals(req.Header(kClusterTokenHeader), token);
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
  using nlohmann::json;
  json err{{"message", std::string(message)},
           {"type", std::string(ErrorType(status))},
           {"param", param.empty() ? json(nullptr) : json(std::string(param))},
           {"code", status}};
  // Invalid UTF-8 in a message (a client's bytes echoed back) is replaced, never thrown.
  return json{{"error", err}}.dump(-1, ' ', false, json::error_handler_t::replace);
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

}  // namespace kvbridge
