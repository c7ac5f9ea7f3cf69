#pragma once
// The values that cross the Backend seam: what the runner asks for (Request) and what a
// backend answers (Outcome = Completion or Error). Both backends, the remote client and the
// embedded engine, speak only these types.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace batchlm {

struct ChatMessage {
  std::string role;     // "system" | "user" | "assistant" | ...
  std::string content;
  // The API's tool-calling fields, sent as given: an assistant message's calls (null, or a
  // non-empty array of {id, type, function: {name, arguments}}; its content then goes as null
  // when empty), a tool message's `tool_call_id`, and a message's `name`. Empty: not sent.
  nlohmann::json tool_calls;
  std::string tool_call_id;
  std::string name;
  // An assistant message's reasoning, given apart from its content (the API's
  // `reasoning_content`, as a reasoning model's answer returns it); nullopt: not given. A
  // template that keeps reasoning (Qwen 3's) then writes it in place of a <think> block found
  // in the content.
  std::optional<std::string> reasoning;
  // For an API backend, where a Batch-API body or an input line's `messages` gives them: the
  // content parts as given, where some part is more than {type: text, text} (an image, audio, a
  // text part with cache_control), sent in place of `content`, which then holds the text parts
  // joined; and the message's other keys, sent beside the ones above. Null where there are none.
  nlohmann::ordered_json parts;
  nlohmann::ordered_json fields;

  bool calls_tools() const { return tool_calls.is_array() && !tool_calls.empty(); }
  // Bytes of the message's text: its content, its reasoning and its calls as JSON.
  std::size_t text_bytes() const;
};

// Reads a chat message's tool-calling fields (`tool_calls`, `tool_call_id`, `name`) and an
// assistant's `reasoning_content` (a string, or null for none) from its JSON object `m` into
// `message`, whose role is set. Returns the first problem as (the field's
// path below the message, e.g. ".tool_calls[0].function.arguments", what is wrong), or nullopt.
// Calls are held to the API's form: an assistant's list of {id, type: function, function:
// {name, arguments}}, the arguments a string (the JSON text); an empty list is no calls. A tool
// message must name the call it answers; the older `function_call` is refused.
std::optional<std::pair<std::string, std::string>> read_tool_fields(const nlohmann::json& m, ChatMessage& message);

// The first tool message of a conversation whose tool_call_id no earlier assistant message's
// calls have (the API refuses it), as (its index, what is wrong); nullopt when there is none.
std::optional<std::pair<std::size_t, std::string>> unanswered_tool_message(std::span<const ChatMessage> messages);

// One chat-completion call. Fields left empty are not sent, so the server's defaults apply.
struct Request {
  std::string model;
  std::vector<ChatMessage> messages;
  // A text completion (/v1/completions) instead of a chat: the prompt as given, no chat
  // template; messages are then empty.
  std::optional<std::string> prompt;
  std::optional<int> max_tokens;
  // max_tokens as the client's limit to honour: where the context has no room for that many
  // after the prompt, the embedded engine refuses the request (context_length_exceeded), as
  // OpenAI's API does, rather than cutting it short. The server sets it for a max_tokens a
  // client gave; jobs leave it off, and an item runs at most to the end of the context.
  bool max_tokens_exact = false;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::vector<std::string> stop;
  std::optional<std::int64_t> seed;
  bool stream = true;
  // Further body fields passed through as given (e.g. from an OpenAI Batch-API line's body:
  // response_format, logprobs, ...). A JSON object or null. Keys stay in the order given: the
  // embedded engine writes `tools` into the prompt as written, as a Python template would.
  nlohmann::ordered_json extra;

  // Bytes of prompt text: the prompt, or every message's content and calls, and the tools.
  std::size_t text_bytes() const;
};

struct Usage {
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;
  bool reported = false;  // false: the backend did not say; counts are estimates or zero
};

// Per-attempt timings, measured by the backend from the moment the request is handed to it.
struct Timings {
  double ttft_ms = 0;   // time to first content token (non-streaming: time to the full body)
  double tpot_ms = 0;   // mean time per output token after the first
  double total_ms = 0;  // whole attempt
};

// A generated token's log-probability, and the most likely tokens at its position, as an API
// returns them when asked (`logprobs`). `token` is the token's bytes: a token may end inside a
// UTF-8 character, so they need not be valid UTF-8 (logprob_token_text shows them as text).
struct TopLogprob {
  std::string token;
  double logprob = 0;
};
struct TokenLogprob {
  std::string token;
  double logprob = 0;
  std::vector<TopLogprob> top_logprobs;  // most likely first; empty when none were asked for
};

struct Completion {
  std::string text;
  std::string finish_reason;  // "stop", "length", ... as the backend reported it
  // Where the backend's own context ended the output ("length" short of max_tokens, or with
  // none): the context's size in tokens, prompt and output together; else 0.
  std::int64_t cut_at_context = 0;
  Usage usage;
  Timings timings;
  // One entry per token of `text`, when the request asked for log-probabilities and the
  // backend returned them.
  std::optional<std::vector<TokenLogprob>> logprobs;
  // The tools the model called (an API's `tool_calls`, streamed fragments put together): an
  // array of {id, type, function: {name, arguments}}, or null when it called none. `arguments`
  // is the JSON text the model wrote, kept as it came.
  nlohmann::json tool_calls;
  // The older single call (`function_call`: {name, arguments}) an API gives for `functions`,
  // or null.
  nlohmann::json function_call;
  // The reasoning the model wrote before its answer, where the backend gives it apart from
  // `text` (an API's `reasoning_content` or `reasoning`; the embedded engine's <think> block);
  // empty when there was none or it is part of `text`.
  std::string reasoning;
};

// The length of the valid UTF-8 character at s[i] (1-4), or 0 when the bytes there are not one
// (a stray continuation byte, a truncated sequence, an overlong form, a surrogate, > U+10FFFF).
std::size_t utf8_char_length(std::string_view s, std::size_t i);
// `text` as a message quotes it: whole when at most `max` bytes, else its first `max` or a few
// fewer, cut before a character rather than through one, and "..." after.
std::string utf8_excerpt(std::string_view text, std::size_t max);
// The offset of the first byte of `s` that is not part of a valid UTF-8 character, or npos.
std::size_t first_invalid_utf8(std::string_view s);
// `s` with each byte that is not part of a valid UTF-8 character replaced by replacement(byte).
std::string replace_invalid_utf8(std::string_view s, std::string (*replacement)(unsigned char byte));
// A token's bytes as JSON text: as they are when valid UTF-8, else each byte outside a valid
// character written as the four characters \xNN (the `bytes` field keeps the exact bytes).
std::string logprob_token_text(std::string_view bytes);
// Text from a file (a model's metadata) made safe for a terminal and for a C string: control
// characters (C0, DEL, C1, NUL included) and bytes outside valid UTF-8 written as \xNN; the
// bidirectional controls and the line and paragraph separators as \uNNNN.
std::string terminal_safe(std::string_view text);
// A URL with the password of its user information ("https://user:secret@host/...") written as
// "***", for messages and records; any other URL as it is.
std::string without_password(std::string_view url);
// Log-probabilities in the chat-completions form: [{"token", "logprob", "bytes",
// "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...].
nlohmann::json logprobs_json(std::span<const TokenLogprob> logprobs);

enum class ErrorKind {
  Http,        // a non-2xx status
  Timeout,     // a stage deadline passed (connect, first byte, idle, total): message says which
  Connection,  // could not connect, or the connection broke
  Protocol,    // malformed JSON or SSE, an unexpected body
  Truncated,   // the stream ended without [DONE] and without a finish reason
  TooLarge,    // a line, an event or a response exceeded its cap
  StreamError, // an error object or `event: error` inside a 200 stream
  Cancelled,   // the caller cancelled the request
  Internal,    // a bug or an unexpected local failure
};

std::string_view to_string(ErrorKind kind);

struct Error {
  ErrorKind kind = ErrorKind::Internal;
  int http_status = 0;    // 0 when there was no HTTP status
  std::string code;       // the API's error code when it gave one, e.g. "insufficient_quota"
  std::string message;
  // Server hints, parsed from headers: `retry-after-ms` / `Retry-After` (seconds or HTTP date),
  // and `x-should-retry: true|false`.
  std::optional<std::chrono::milliseconds> retry_after;
  std::optional<bool> should_retry;

  nlohmann::json to_json() const;  // {"kind": "http", "status": 429, "code": ..., "message": ...}
};

// Exactly one of completion / error is set.
struct Outcome {
  std::optional<Completion> completion;
  std::optional<Error> error;
  Timings timings;  // also set for failed attempts, as far as they got

  bool ok() const { return completion.has_value(); }
  static Outcome success(Completion c) {
    Outcome o;
    o.timings = c.timings;
    o.completion = std::move(c);
    return o;
  }
  static Outcome failure(Error e, Timings t = {}) {
    Outcome o;
    o.error = std::move(e);
    o.timings = t;
    return o;
  }
};

// What an engine behind a backend is doing, for the progress bar and the summary (the embedded
// engine reports it; remote APIs do not).
struct EngineStats {
  std::int64_t running = 0;      // sequences being decoded or prefilled
  std::int64_t waiting = 0;      // queued, not yet admitted (preempted ones included)
  std::int64_t preemptions = 0;  // since start
  // Each prompt token counts once, run through the model or taken from the prefix cache,
  // whichever came first; tokens run through the model again after a preemption count apart.
  std::int64_t prompt_tokens_computed = 0;
  std::int64_t prompt_tokens_cached = 0;
  std::int64_t recomputed_tokens = 0;
  std::int64_t generated_tokens = 0;
  std::int64_t steps = 0;        // batched forward passes
  std::int64_t blocks_used = 0;  // KV blocks held by sequences
  std::int64_t blocks_total = 0;
  std::int64_t block_size = 0;   // tokens per block
  // Speculative decoding ("" when off): drafts scored by the model, drafts accepted, decoding
  // sequence-steps (each yields its accepted drafts plus one token), and the time spent
  // drafting against the time spent stepping the engine.
  std::string speculative;
  std::int64_t drafted_tokens = 0;
  std::int64_t accepted_tokens = 0;
  std::int64_t decode_passes = 0;
  double draft_ms = 0;
  double step_ms = 0;

  // Share of prompt tokens served from the prefix cache, 0..1 (0 before any prompt).
  double cache_hit_rate() const;
  // Drafts accepted / drafted, 0..1; tokens each decoding sequence got per target pass (>= 1);
  // the share of engine time spent drafting, 0..1. All 0 before any draft.
  double acceptance_rate() const;
  double tokens_per_pass() const;
  double draft_time_share() const;
  // "12 run 20 wait 3 preempted cache 87% kv 41% spec 72% x2.4": a short field for the
  // progress bar.
  std::string brief() const;
  nlohmann::json to_json() const;
};

// Which part of an answer a streamed piece belongs to: the content, or the reasoning a model
// writes before it (Completion::reasoning).
enum class TextPart { kContent, kReasoning };

// Receives each piece of output text as it arrives (one call per streamed delta), with the
// log-probabilities of the tokens it completes when the request asked for them (else empty),
// and which part of the answer it is.
using TokenSink =
    std::function<void(std::string_view delta, std::span<const TokenLogprob> logprobs, TextPart part)>;

}  // namespace batchlm
