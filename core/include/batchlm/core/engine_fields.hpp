#pragma once
// Which body fields beyond a Request's own the embedded engine honours. A job's `request.extra`
// and the body of an OpenAI Batch-API line pass fields through to an API as they are; the
// embedded engine reads `top_k`, `presence_penalty` and `frequency_penalty` among them, so any
// other field that would change the output (logit_bias, logprobs, JSON mode, tools, ...) is
// refused rather than silently ignored. Fields that change nothing (`user`, `metadata`, a zero penalty, `n: 1`, ...)
// pass. The runner checks jobs with it before a run starts; LocalBackend checks each request.

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace batchlm {

// Why the embedded engine cannot honour body field `key` with this value; nullopt when it
// honours it or the field changes nothing.
std::optional<std::string> engine_field_problem(std::string_view key, const nlohmann::json& value);

}  // namespace batchlm
