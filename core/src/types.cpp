#include "batchlm/core/types.hpp"

namespace batchlm {

std::string_view to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::Http: return "http";
    case ErrorKind::Timeout: return "timeout";
    case ErrorKind::Connection: return "connection";
    case ErrorKind::Protocol: return "protocol";
    case ErrorKind::Truncated: return "truncated";
    case ErrorKind::TooLarge: return "too_large";
    case ErrorKind::StreamError: return "stream_error";
    case ErrorKind::Cancelled: return "cancelled";
    case ErrorKind::Internal: return "internal";
  }
  return "internal";
}

nlohmann::json Error::to_json() const {
  nlohmann::json j = {{"kind", to_string(kind)}, {"message", message}};
  if (http_status != 0) j["status"] = http_status;
  if (!code.empty()) j["code"] = code;
  return j;
}

}  // namespace batchlm
