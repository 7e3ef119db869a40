// Status and Result<T>: how every fallible ucpfs function reports errors.
//
// Not for: errno mapping (that happens once, at the FUSE boundary in fs/).
// Invariants: a Status is either ok() or carries a code and a message with context
// (file, byte offset, reason); sys_errno is the exact errno when the error came from
// a syscall, 0 otherwise. Result<T> holds exactly one of a value or a non-ok Status.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace ucpfs {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller asked for something malformed
  kNotFound,         // a named thing does not exist
  kCorrupt,          // an input file violates its format
  kDataLoss,         // bytes that should exist could not be recovered
  kIo,               // a system call failed (see sys_errno)
  kNoSpace,
  kUnsupported,      // a valid input this version does not handle
  kOutOfRange,       // offset/length outside an object
  kResourceExhausted,// a configured limit (memory, depth, count) was reached
  kInternal,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message, int sys_errno = 0)
      : code_(code), message_(std::move(message)), sys_errno_(sys_errno) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  int sys_errno() const { return sys_errno_; }

  // "corrupt: model.pt: offset 120: bad local header signature"
  std::string ToString() const;

  // Returns a copy whose message is prefixed with `context + ": "`.
  Status WithContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int sys_errno_ = 0;
};

inline Status CorruptError(std::string msg) { return Status(StatusCode::kCorrupt, std::move(msg)); }
inline Status InvalidArgumentError(std::string msg) { return Status(StatusCode::kInvalidArgument, std::move(msg)); }
inline Status NotFoundError(std::string msg) { return Status(StatusCode::kNotFound, std::move(msg)); }
inline Status UnsupportedError(std::string msg) { return Status(StatusCode::kUnsupported, std::move(msg)); }
inline Status OutOfRangeError(std::string msg) { return Status(StatusCode::kOutOfRange, std::move(msg)); }
inline Status ResourceExhaustedError(std::string msg) { return Status(StatusCode::kResourceExhausted, std::move(msg)); }
inline Status InternalError(std::string msg) { return Status(StatusCode::kInternal, std::move(msg)); }
Status IoError(std::string msg, int sys_errno);

// std::expected-shaped result: either a T or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(v_).ok() && "Result constructed from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }
  const Status& error() const { return std::get<Status>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace ucpfs

#define UCPFS_CONCAT_INNER(a, b) a##b
#define UCPFS_CONCAT(a, b) UCPFS_CONCAT_INNER(a, b)

// Returns early with the Status if `expr` (a Status) is not ok.
#define UCPFS_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::ucpfs::Status ucpfs_status_ = (expr);          \
    if (!ucpfs_status_.ok()) return ucpfs_status_;   \
  } while (0)

// `UCPFS_ASSIGN_OR_RETURN(auto x, F())`: unwraps a Result or returns its Status.
#define UCPFS_ASSIGN_OR_RETURN(lhs, expr) \
  UCPFS_ASSIGN_OR_RETURN_IMPL(UCPFS_CONCAT(ucpfs_result_, __LINE__), lhs, expr)
#define UCPFS_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.error();                \
  lhs = std::move(tmp).value()
