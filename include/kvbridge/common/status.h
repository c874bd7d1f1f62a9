// kvbridge/common/status.h — Status and Result<T>, the error type of every library call.
//
// Library code never throws across a module boundary: it returns Status (success or a
// canonical code + message) or Result<T> (a value or a non-OK Status). Codes follow
// abseil's canonical set.
//
//   Result<int> ParsePort(std::string_view s);
//   ASSIGN_OR_RETURN(int port, ParsePort(arg));
//   RETURN_IF_ERROR(server.Listen(port));
//
// Thread-safety: values; safe to copy between threads.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvbridge {

enum class StatusCode {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

/// Returns the canonical upper-snake name of `code` ("INVALID_ARGUMENT").
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  /// "INVALID_ARGUMENT: message" or "OK".
  std::string ToString() const;
  /// Returns a copy whose message is "`prefix`: message" (no-op for OK).
  Status WithPrefix(std::string_view prefix) const;
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
inline Status InvalidArgumentError(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFoundError(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status AlreadyExistsError(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status DeadlineExceededError(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
inline Status CancelledError(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status ResourceExhaustedError(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status FailedPreconditionError(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status UnimplementedError(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status OutOfRangeError(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status PermissionDeniedError(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }
inline Status UnauthenticatedError(std::string m) { return {StatusCode::kUnauthenticated, std::move(m)}; }
inline Status DataLossError(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }

/// Converts an errno value into a Status ("`what`: strerror"), once, at the OS edge.
Status ErrnoToStatus(int err, std::string_view what);

/// A value of type T or a non-OK Status. Access to value() of an error aborts (a bug).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(v_).ok() && "Result constructed from OK status");
  }
  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kvbridge

#define KVB_CONCAT_INNER_(a, b) a##b
#define KVB_CONCAT_(a, b) KVB_CONCAT_INNER_(a, b)

/// Returns the Status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                    \
  do {                                           \
    ::kvbridge::Status kvb_status_ = (expr);     \
    if (!kvb_status_.ok()) return kvb_status_;   \
  } while (0)

#define KVB_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

/// `ASSIGN_OR_RETURN(auto x, F())`: assigns F()'s value or returns its Status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  KVB_ASSIGN_OR_RETURN_IMPL_(KVB_CONCAT_(kvb_result_, __LINE__), lhs, expr)
