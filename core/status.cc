#include "core/status.h"

namespace ucpfs {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kDataLoss: return "data loss";
    case StatusCode::kIo: return "I/O error";
    case StatusCode::kNoSpace: return "no space";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kOutOfRange: return "out of range";
    case StatusCode::kResourceExhausted: return "limit exceeded";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

Status Status::WithContext(const std::string& context) const {
  if (ok()) return *this;
  return Status(code_, context + ": " + message_, sys_errno_);
}

Status IoError(std::string msg, int sys_errno) {
  return Status(StatusCode::kIo, std::move(msg), sys_errno);
}

}  // namespace ucpfs
