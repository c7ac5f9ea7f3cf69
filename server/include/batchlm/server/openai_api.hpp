#pragma once
// The OpenAI wire format as `batchlm serve` speaks it: request bodies of /v1/chat/completions
// and /v1/completions checked and turned into a batchlm::Request, and the JSON of responses,
// stream chunks and errors. No I/O here, so every rule is unit-tested on its own.

#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "batchlm/core/types.hpp"

namespace batchlm::server {

// A request the API refuses: the HTTP status and the OpenAI error object's fields.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, std::string param, std::string message,
           std::string code = {});
  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }
  // The whole message, NUL characters (a request's text may hold them) and all; what() ends at
  // the first.
  const std::string& message() const { return message_; }
  // {"error": {"message", "type", "param", "code"}} (param and code null when empty).
  nlohmann::json body() const;

 private:
  int status_;
  std::string type_, param_, code_, message_;
};

enum class Endpoint { kChat, kCompletions };

// The most choices one request may ask for (`n`).
inline constexpr int kMaxChoices = 128;

struct ApiRequest {
  Endpoint endpoint = Endpoint::kChat;
  Request request;             // for the backend; request.stream mirrors `stream`
  int n = 1;                   // choices to generate, each its own engine sequence
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool logprobs = false;       // log-probabilities asked for (the counts are in request.extra)
  std::string max_tokens_param = "max_tokens";  // the name the client gave the limit by
};

// Checks a request body against the endpoint's schema and what the engine supports. Unknown
// fields are ignored (clients send many); fields that would change the output in a way the
// engine cannot honour (tool_choice "required", audio output, ...) are refused. The body's keys
// are read in order: tools reach the model's prompt as the client wrote them. `served_model`:
// a body that names another model gets 404 model_not_found; a body without one is served.
// Throws ApiError naming the field (param) and what was wrong.
ApiRequest parse_request(Endpoint endpoint, const nlohmann::ordered_json& body, std::string_view served_model);
// The same from the raw body text (400 when it is not a JSON object).
ApiRequest parse_request_body(Endpoint endpoint, std::string_view body_text, std::string_view served_model);

// What a response needs besides the completion.
struct ResponseContext {
  Endpoint endpoint = Endpoint::kChat;
  std::string id;       // "chatcmpl-..." / "cmpl-..."
  std::int64_t created = 0;
  std::string model;
  // Text completions: the prompt's length in characters, where the text_offset of the
  // completion's tokens starts (as OpenAI counts them, with or without echo).
  std::int64_t prompt_chars = 0;
};

// Characters in UTF-8 text: its bytes that do not continue a character.
std::int64_t utf8_chars(std::string_view text);

// A fresh id for the endpoint: "chatcmpl-" or "cmpl-" and 24 random hex digits.
std::string new_response_id(Endpoint endpoint);

// The whole (non-streaming) response: one choice, or several (`n`) indexed in order.
nlohmann::json completion_body(const ResponseContext& ctx, const Completion& completion);
nlohmann::json completion_body(const ResponseContext& ctx, std::span<const Completion> choices);
// The usage of a request's choices: the prompt once, the output tokens of every choice.
Usage total_usage(std::span<const Completion> choices);
// A choice's `logprobs` value for these tokens: chat {"content": [...]} (logprobs_json), or
// the text completions form {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, its
// offsets counted in characters from text_offset (the prompt's length: ResponseContext), which
// moves past the tokens (a stream's chunks carry it from one to the next).
nlohmann::json choice_logprobs(Endpoint endpoint, std::span<const TokenLogprob> logprobs, std::int64_t& text_offset);
// One stream chunk carrying text of choice `index` (chat: a delta; the choice's first chunk
// also carries the role), and its tokens' `logprobs` (choice_logprobs) when asked for. Reasoning
// (`part`) goes in a chat delta's `reasoning_content`.
nlohmann::json text_chunk(const ResponseContext& ctx, std::string_view text, bool first, bool include_usage,
                          int index = 0, nlohmann::json logprobs = nullptr, TextPart part = TextPart::kContent);
// A chat stream's chunk carrying choice `index`'s tool calls, whole, each with its `index` (and the
// role, with null content, where it is the choice's first chunk).
nlohmann::json tool_calls_chunk(const ResponseContext& ctx, const nlohmann::json& calls, bool first,
                                bool include_usage, int index = 0);
// The chunk that ends choice `index` (empty delta or text, finish_reason set).
nlohmann::json finish_chunk(const ResponseContext& ctx, std::string_view finish_reason,
                            bool include_usage, int index = 0);
// The last chunk when stream_options.include_usage: no choices, the usage.
nlohmann::json usage_chunk(const ResponseContext& ctx, const Usage& usage);
// {"prompt_tokens", "completion_tokens", "total_tokens"}
nlohmann::json usage_json(const Usage& usage);

// The HTTP status and error body for a failed backend outcome of a request to `endpoint`: the
// engine's own 4xx keep their status, name the field they refuse (the prompt, "messages" or
// "prompt", when they concern it) and keep their code, but for the engine's generic
// "invalid_request", which is null like the server's own validation errors; anything else is a
// 500.
// max_tokens_param: the name the client gave max_tokens by (max_completion_tokens in a chat).
ApiError error_from_outcome(const Error& error, Endpoint endpoint, std::string_view max_tokens_param = "max_tokens");
// The field a prompt comes in: "messages" for chat, "prompt" for completions.
const char* prompt_param(Endpoint endpoint);

}  // namespace batchlm::server
