#include "kvbridge/common/status.h"

#include <cstring>

namespace kvbridge {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kUnknown: return "UNKNOWN";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kAborted: return "ABORTED";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDataLoss: return "DATA_LOSS";
    case StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
  }
  return "UNKNOWN";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(StatusCodeName(code_));
  s += ": ";
  s += message_;
  return s;
}

Status Status::WithPrefix(std::string_view prefix) const {
  if (ok()) return *this;
  return Status(code_, std::string(prefix) + ": " + message_);
}

Status ErrnoToStatus(int err, std::string_view what) {
  StatusCode code = StatusCode::kInternal;
  switch (err) {
    case ENOENT: code = StatusCode::kNotFound; break;
    case EACCES:
    case EPERM: code = StatusCode::kPermissionDenied; break;
    case EINVAL: code = StatusCode::kInvalidArgument; break;
    case ENOMEM:
    case ENOSPC:
    case EMFILE: code = StatusCode::kResourceExhausted; break;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case ENOTCONN:
    case EHOSTUNREACH:
    case ENETUNREACH: code = StatusCode::kUnavailable; break;
    case ETIMEDOUT: code = StatusCode::kDeadlineExceeded; break;
    case EEXIST: code = StatusCode::kAlreadyExists; break;
    default: break;
  }
  return Status(code, std::string(what) + ": " + std::strerror(err));
}

}  // namespace kvbridge
