#include "batchlm/core/engine_fields.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace batchlm {

namespace {

using nlohmann::json;

constexpr const char* kElsewhere = "; remove it, or run the job against an API that does (--base-url)";

// Fields with no effect on what is generated: identification, storage, streaming (the backend
// decides that), tiers.
constexpr std::array<std::string_view, 8> kNoEffect = {"user",        "metadata",       "store",
                                                       "service_tier", "stream",         "stream_options",
                                                       "prompt_cache_key", "safety_identifier"};

}  // namespace

std::optional<std::string> engine_field_problem(std::string_view key, const json& value) {
  // In the API a null field is one not set.
  if (value.is_null()) return std::nullopt;
  for (const std::string_view k : kNoEffect)
    if (key == k) return std::nullopt;
  if (key == "top_k") {
    if (value.is_number() && value.get<double>() == std::floor(value.get<double>()) && value.get<double>() >= -1 &&
        value.get<double>() <= std::numeric_limits<int>::max())
      return std::nullopt;
    return std::string("expected an integer from -1 (no limit) to 2147483647, not ") + value.dump();
  }
  if (key == "n") {
    if (value.is_null() || (value.is_number_integer() && value.get<std::int64_t>() == 1)) return std::nullopt;
    return std::string("several answers per item are not supported (one request, one answer)");
  }
  if (key == "presence_penalty" || key == "frequency_penalty") {
    if (value.is_null() || (value.is_number() && value.get<double>() >= -2.0 && value.get<double>() <= 2.0))
      return std::nullopt;
    return "expected a number from -2 to 2, not " + value.dump();
  }
  if (key == "repetition_penalty") {
    if (value.is_null() || (value.is_number() && value.get<double>() == 1.0)) return std::nullopt;
    return std::string("the embedded engine does not apply repetition penalties") + kElsewhere;
  }
  if (key == "logit_bias") {
    if (value.is_null() || (value.is_object() && value.empty())) return std::nullopt;
    return std::string("the embedded engine does not apply logit biases") + kElsewhere;
  }
  if (key == "logprobs" || key == "top_logprobs") {
    if (value.is_null() || value == false || (key == "top_logprobs" && value == 0)) return std::nullopt;
    return std::string("the embedded engine does not return log probabilities") + kElsewhere;
  }
  if (key == "response_format") {
    if (value.is_null() || (value.is_object() && value.value("type", json()) == "text")) return std::nullopt;
    return std::string("the embedded engine has no JSON mode or structured outputs (only {\"type\": \"text\"})") +
           kElsewhere;
  }
  if (key == "tools" || key == "functions") {
    if (value.is_null() || (value.is_array() && value.empty())) return std::nullopt;
    return std::string("the embedded engine does not call tools") + kElsewhere;
  }
  // Without tools (refused above when there are any) these change nothing.
  if (key == "tool_choice" || key == "function_call" || key == "parallel_tool_calls") return std::nullopt;
  if (key == "modalities") {
    if (value == json::array({"text"})) return std::nullopt;
    return std::string("the embedded engine generates text only (modalities: [\"text\"])") + kElsewhere;
  }
  if (key == "max_completion_tokens" || key == "max_tokens" || key == "temperature" || key == "top_p" ||
      key == "stop" || key == "seed" || key == "messages" || key == "model")
    return "set it as request." + std::string(key == "max_completion_tokens" ? "max_tokens" : key) +
           " (the embedded engine does not read it from the extra fields)";
  return "the embedded engine does not use '" + std::string(key) +
         "' (of the extra fields it takes top_k, presence_penalty and frequency_penalty)" + kElsewhere;
}

}  // namespace batchlm
