#pragma once
// The OpenAI chat-completions API over HttpClient, streaming (SSE with
// stream_options.include_usage) and not.

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/any_io_executor.hpp>

#include "batchlm/client/http.hpp"
#include "batchlm/client/sse.hpp"
#include "batchlm/core/backend.hpp"

namespace batchlm::client {

struct OpenAIOptions {
  std::string base_url = "https://api.openai.com/v1";  // ".../v1"; see endpoint_url
  std::string api_key;                                 // sent as a bearer token when not empty
  Headers extra_headers;
  HttpTimeouts timeouts;
  SseLimits sse_limits;
  std::size_t max_response_bytes = 64 << 20;
  HttpClientOptions http;
};

// Where a request goes: the base URL (trailing slashes dropped) with "/chat/completions", or
// "/completions" for a text prompt, and then the base URL's query if it has one (Azure's
// "?api-version=..." goes on every request).
std::string endpoint_url(std::string_view base_url, bool text_prompt);

// The JSON body for a Request (model, messages, sampling fields, stop, seed, extra fields;
// with stream: true and stream_options.include_usage when streaming), in that order.
nlohmann::ordered_json to_openai_body(const Request& request);

// JSON from a server's answer. Text that is JSON but for invalid UTF-8 bytes or unpaired
// surrogate escapes ("\ud83d" alone) is read with U+FFFD in their place, as a decoder would
// show it, rather than failing the item; anything else that is not JSON is discarded
// (is_discarded()).
nlohmann::json parse_answer_json(std::string_view text);

// Server hints from response headers: `retry-after-ms` (milliseconds, wins), else
// `Retry-After` as seconds or as an HTTP date (relative to `now`). Negative values are zero.
std::optional<std::chrono::milliseconds> parse_retry_after(
    const HttpResponse& response,
    std::chrono::system_clock::time_point now = std::chrono::system_clock::now());

// `x-should-retry: true|false`, when present.
std::optional<bool> parse_should_retry(const HttpResponse& response);

// Maps a non-2xx response to an Error: status, the API error's code and message from the body
// ({"error": {"message", "type", "code"}}), retry hints.
Error http_error(const HttpResponse& response);

// A chat.completion (or text_completion) JSON body read into an Outcome: the non-streaming
// answer, or what a server that ignores `stream: true` sends instead of a stream. `timings`
// is the transfer's; the text goes to `sink` when there is one. Without choice 0's finish
// reason, or with a field of the wrong type (a number as content), it is a Protocol error.
Outcome answer_from_body(int status, std::string_view body, Timings timings, const TokenSink& sink = {});

// A choice's `logprobs` in either form an API gives it: chat completions' {"content": [{token,
// logprob, bytes, top_logprobs}, ...]}, or text completions' {"tokens", "token_logprobs",
// "top_logprobs": [{token: logprob, ...}, ...]}. A token's `bytes`, when given, are its exact
// bytes. nullopt for null or anything else; entries that are not understood are skipped.
std::optional<std::vector<TokenLogprob>> parse_logprobs(const nlohmann::json& value);

// A streamed answer as it arrives: the SSE events of a 2xx body read into text, tool calls,
// finish reason and usage, or the error that ends the stream. OpenAIBackend::complete feeds it each chunk of
// the body and asks it for the Outcome once the transfer is over; it does no I/O itself.
class StreamedAnswer {
 public:
  using Clock = std::chrono::steady_clock;

  // `sink` gets each piece of text (content or reasoning) as its event is read.
  StreamedAnswer(SseLimits limits, TokenSink sink);

  // The next bytes of the body. False when the transfer should stop: the stream failed (an
  // error event, malformed JSON, a line or event over the limits).
  bool feed(std::string_view chunk);

  // The outcome once the transfer has ended with `response` (its status, headers and transport
  // error; its body is what feed() saw). `started`: when the request was sent. Called once:
  // the text moves into the outcome. A success needs choice 0's finish reason; once it has
  // come, a transport failure (a reset, the idle timeout) no longer fails the answer.
  Outcome finish(const HttpResponse& response, Clock::time_point started);

  // Whether what came is a whole answer: choice 0's finish reason has arrived.
  bool answered() const { return !finish_reason_.empty(); }

 private:
  void on_event(const SseEvent& event);
  // Adds a chunk's `delta.tool_calls` and `delta.function_call` fragments to the calls so far.
  // False, with error_ set, when they are malformed.
  bool add_call_fragments(const nlohmann::json& delta);
  // A piece of output (text or a call's fragment) arrived now: for the timings.
  void note_delta();

  // The most tool calls one answer may hold, and the highest index a fragment may give.
  static constexpr long long kMaxToolCalls = 1024;

  SseParser parser_;
  TokenSink sink_;
  std::string text_;
  std::string reasoning_;  // delta.reasoning_content (or .reasoning) put together
  std::string finish_reason_;
  Usage usage_;
  std::optional<std::vector<TokenLogprob>> logprobs_;
  std::map<long long, nlohmann::json> tool_calls_;  // by the fragments' index
  // Where an index a server gave two calls (with different ids) points now: the second call's
  // own slot, past the indices a server may give.
  std::map<long long, long long> tool_call_slots_;
  long long last_tool_call_ = 0;
  nlohmann::json function_call_;
  bool done_ = false;        // `data: [DONE]` seen
  bool saw_event_ = false;
  bool choice_seen_ = false; // a chunk carried choice 0
  std::string raw_;          // the body while no event has been seen (a JSON answer instead of a stream)
  std::string head_;         // the first bytes of the body, for an error about what it is
  std::optional<Error> error_;
  std::size_t deltas_ = 0;
  Clock::time_point first_delta_at_{};
  Clock::time_point last_delta_at_{};
};

class OpenAIBackend final : public Backend {
 public:
  OpenAIBackend(boost::asio::any_io_executor executor, OpenAIOptions options);
  ~OpenAIBackend() override;

  boost::asio::awaitable<Outcome> complete(const Request& request, TokenSink sink) override;
  std::string describe() const override;

  HttpClient& http() { return http_; }

 private:
  OpenAIOptions options_;
  HttpClient http_;
};

}  // namespace batchlm::client
