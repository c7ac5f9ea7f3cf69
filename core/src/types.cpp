#include "batchlm/core/types.hpp"

#include <cstdio>

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

std::size_t Request::text_bytes() const {
  std::size_t bytes = prompt ? prompt->size() : 0;
  for (const ChatMessage& m : messages) bytes += m.content.size();
  return bytes;
}

double EngineStats::cache_hit_rate() const {
  const std::int64_t total = prompt_tokens_computed + prompt_tokens_cached;
  return total > 0 ? static_cast<double>(prompt_tokens_cached) / static_cast<double>(total) : 0.0;
}

double EngineStats::acceptance_rate() const {
  return drafted_tokens > 0 ? static_cast<double>(accepted_tokens) / static_cast<double>(drafted_tokens)
                            : 0.0;
}

double EngineStats::tokens_per_pass() const {
  return decode_passes > 0
             ? static_cast<double>(decode_passes + accepted_tokens) / static_cast<double>(decode_passes)
             : 0.0;
}

double EngineStats::draft_time_share() const { return step_ms > 0 ? draft_ms / step_ms : 0.0; }

std::string EngineStats::brief() const {
  auto percent = [](double x) { return std::to_string(static_cast<int>(x * 100.0 + 0.5)) + "%"; };
  std::string s = std::to_string(running) + " run " + std::to_string(waiting) + " wait";
  if (preemptions > 0) s.append(" ").append(std::to_string(preemptions)).append(" preempted");  // not " " + ...: GCC 12's -Wrestrict false alarm
  s += " cache " + percent(cache_hit_rate());
  if (blocks_total > 0)
    s += " kv " + percent(static_cast<double>(blocks_used) / static_cast<double>(blocks_total));
  if (!speculative.empty() && drafted_tokens > 0) {
    char pass[16];
    std::snprintf(pass, sizeof pass, "%.1f", tokens_per_pass());
    s += " spec " + percent(acceptance_rate()) + " x" + pass;
  }
  return s;
}

nlohmann::json EngineStats::to_json() const {
  nlohmann::json j = {{"running", running},
          {"waiting", waiting},
          {"preemptions", preemptions},
          {"prompt_tokens_computed", prompt_tokens_computed},
          {"prompt_tokens_cached", prompt_tokens_cached},
          {"cache_hit_rate", cache_hit_rate()},
          {"generated_tokens", generated_tokens},
          {"steps", steps},
          {"blocks_used", blocks_used},
          {"blocks_total", blocks_total},
          {"block_size", block_size}};
  if (!speculative.empty()) {
    j["speculative"] = {{"method", speculative},
                        {"drafted_tokens", drafted_tokens},
                        {"accepted_tokens", accepted_tokens},
                        {"acceptance_rate", acceptance_rate()},
                        {"decode_passes", decode_passes},
                        {"tokens_per_pass", tokens_per_pass()},
                        {"draft_time_share", draft_time_share()}};
  }
  return j;
}

}  // namespace batchlm
