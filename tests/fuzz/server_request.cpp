// Request bodies of `batchlm serve` (server/src/openai_api.cpp): parse_request_body on
// arbitrary bytes for /v1/chat/completions and /v1/completions, as the server calls it.
//
// Input: a byte choosing the endpoint, then the body.
//
// Promised: a body is accepted or refused with ApiError (400, or 404 for another model),
// whose JSON error body can be sent; nothing else escapes, nothing crashes. Checked on an
// accepted body: the Request is within the ranges the engine is promised (max_tokens >= 1,
// temperature in [0, 2], top_p in [0, 1], at most 16 non-empty stops, messages with a known
// role for chat, a prompt for completions).

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "batchlm/server/openai_api.hpp"
#include "fuzz_support.hpp"

using namespace batchlm;
using namespace batchlm::server;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::InputReader input(data, size);
  const Endpoint endpoint = input.byte() & 1 ? Endpoint::kCompletions : Endpoint::kChat;
  const std::string_view body = input.rest();
  try {
    const ApiRequest parsed = parse_request_body(endpoint, body, "smollm");
    const Request& r = parsed.request;
    FUZZ_CHECK(parsed.endpoint == endpoint, "endpoint");
    FUZZ_CHECK(r.stream == parsed.stream, "stream");
    FUZZ_CHECK(!parsed.include_usage || parsed.stream, "include_usage without stream");
    FUZZ_CHECK(!r.max_tokens || *r.max_tokens >= 1, "max_tokens " + std::to_string(*r.max_tokens));
    FUZZ_CHECK(!r.temperature || (*r.temperature >= 0 && *r.temperature <= 2), "temperature");
    FUZZ_CHECK(!r.top_p || (*r.top_p >= 0 && *r.top_p <= 1), "top_p");
    FUZZ_CHECK(r.stop.size() <= 16, "more than 16 stops");
    for (const std::string& s : r.stop) FUZZ_CHECK(!s.empty(), "an empty stop string");
    FUZZ_CHECK(r.model.empty() || r.model == "smollm", "another model accepted: " + r.model);
    if (endpoint == Endpoint::kChat) {
      FUZZ_CHECK(!r.prompt && !r.messages.empty(), "a chat request without messages");
      for (const ChatMessage& m : r.messages)
        FUZZ_CHECK(m.role == "system" || m.role == "user" || m.role == "assistant", "role " + m.role);
    } else {
      FUZZ_CHECK(r.prompt.has_value() && r.messages.empty(), "a completion request without a prompt");
    }
    if (r.extra.is_object() && r.extra.contains("top_k"))
      FUZZ_CHECK(r.extra["top_k"].is_number_integer() && r.extra["top_k"].get<std::int64_t>() >= 0, "top_k");
  } catch (const ApiError& e) {
    FUZZ_CHECK(e.status() == 400 || e.status() == 404, "status " + std::to_string(e.status()));
    FUZZ_CHECK(std::string(e.what()).size() > 0, "an error without a message");
    // What the server sends back: the error body, as JSON text.
    (void)e.body().dump();
  }
  return 0;
}
