#pragma once
// A fake OpenAI chat-completions server for tests and benchmarks: Boost.Beast over Asio
// coroutines, HTTP/1.1 keep-alive, streaming (SSE) and non-streaming answers, scripted GSM8K
// answers with a known accuracy, and faults injected on demand.
//
// Endpoints
//   POST /v1/chat/completions  streaming when the body says "stream": true
//   GET  /v1/models
//   GET  /_stats   {"requests": N, "connections": C, "authorized": A,
//                   "per_item": {"<last user message>": n}, "arrival_ms": [...],
//                   "last_body": "<the last chat request's body>"}
//   POST /_reset   clears the stats (and with them the per-item attempt counts)
//
// Tools: a request with `tools` is answered by calling each function tool (only the first with
// `parallel_tool_calls: false`), finish reason "tool_calls", the arguments {"query": the last
// user message, "call": k} as JSON text, streamed as the API streams them (id and name first,
// then the arguments 7 characters at a time). A conversation that ends with a tool's result is
// answered "The tool said: <its content>". A tool message that answers no earlier call, or a
// call without an id, a name or string arguments, gets a 400 as from the API.
//
// Fault spec: `;`-separated `key` or `key=value` items, in the request header
// `x-fake-fault: <spec>` or in a FaultRule. Several faults may be combined (`cr;byte_chunks`).
//   status=CODE            answer with this HTTP status and an OpenAI error body
//   retry_after=S          `Retry-After: S` (seconds, or any text given, e.g. an HTTP date)
//   retry_after_date=S     `Retry-After` as an HTTP date S seconds from now
//   retry_after_ms=MS      `retry-after-ms: MS`
//   should_retry=true|false  `x-should-retry`
//   code=TEXT              the error body's code (e.g. insufficient_quota)
//   message=TEXT           the error body's message
//   no_body                send the error status with an empty body
//   after=N                content chunks sent before a mid-stream fault fires (default 2)
//   reset_after=N          after N content chunks close the socket with RST (SO_LINGER 0)
//   stall_ms=MS            after `after` chunks send nothing for MS, then carry on
//   truncate               after `after` chunks end the body cleanly, no finish_reason or [DONE]
//   error_event            after `after` chunks send `data: {"error": {...}}` and end the stream
//   event_error            the same as an `event: error` event
//   malformed              after `after` chunks send a data line that is not valid JSON
//   crlf | cr              SSE lines end in CRLF | a lone CR
//   byte_chunks            every byte of the body in its own HTTP chunk, each written at once
//   ignore_stream          answer a streaming request with a chat.completion JSON body
//   no_usage               no usage object, in a stream (even when asked for) or a JSON body
//   oversize[=BYTES]       a BYTES-long body (non-streaming) or one BYTES-long SSE data line
//                          (streaming); default 100 MiB
//   slow_first_byte=MS     wait MS before sending anything, headers included
//   at_end                 reset_after, stall_ms and truncate fire after the last chunk (the
//                          finish reason, then the usage when asked for) instead of [DONE]
//   pings=N                after the last chunk (the finish reason, then the usage), N SSE
//                          comments (`: ping`), ping_ms apart, before [DONE]
//   ping_ms=MS             the spacing of `pings` (default 100)
//   late_text=TEXT         after the finish reason, one more content delta of TEXT
//   gzip                   a non-streaming answer's body gzipped (Content-Encoding: gzip),
//                          though the request did not ask for it
//   content_encoding=TEXT  a non-streaming answer says `Content-Encoding: TEXT`, its body as it is
//   html                   answer 200 with an HTML page (Content-Type text/html)
//   redirect=CODE          answer with this 3xx status and a Location (an empty body)
//   location=URL           the redirect's Location (default /v1/chat/completions)
// Mid-stream faults apply to streaming requests; a non-streaming request with one of them is
// answered normally except for `reset_after` (reset before any byte) and `truncate` (half of
// the body, then the connection is closed).
// On the command line a list of specs is separated by `,` (so a fault spec holds no comma:
// use retry_after_date for dates).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace batchlm::testing {

struct FaultSpec {
  int status = 0;  // 0: no status fault
  std::optional<std::string> retry_after;
  std::optional<int> retry_after_date_s;
  std::optional<long long> retry_after_ms;
  std::optional<bool> should_retry;
  std::string code;
  std::string message = "injected fault";
  bool no_body = false;

  int after = 2;
  std::optional<int> reset_after;
  int stall_ms = 0;
  bool truncate = false;
  bool error_event = false;
  bool event_error = false;
  bool malformed = false;
  bool crlf = false;
  bool cr = false;
  bool byte_chunks = false;
  bool ignore_stream = false;
  bool no_usage = false;
  std::optional<std::size_t> oversize_bytes;
  int slow_first_byte_ms = 0;
  bool at_end = false;
  int pings = 0;
  int ping_ms = 100;
  std::optional<std::string> late_text;
  bool gzip = false;
  std::optional<std::string> content_encoding;
  bool html = false;
  int redirect = 0;  // 0: no redirect
  std::string location = "/v1/chat/completions";

  // Throws std::invalid_argument on an unknown key or a bad value.
  static FaultSpec parse(std::string_view spec);
};

// Fires with `probability` per chat request; `first_attempts_only` > 0 limits it to the first
// k requests of each item (counted per last user message). The draw is a hash of the seed, the
// item and its attempt number, so the same run sees the same faults whatever the order of
// arrival. When it fires, one of `faults` is chosen (by the same hash).
struct FaultRule {
  std::vector<FaultSpec> faults;
  double probability = 1.0;
  int first_attempts_only = 0;
  std::uint64_t seed = 0;
  std::string only_item;  // non-empty: only items whose last user message contains this
};

struct FakeOpenAIOptions {
  int ttft_ms = 0;          // before the first content chunk
  int tokens = 16;          // words of generated text per answer (capped by max_tokens)
  int token_delay_ms = 0;   // between content chunks
  std::string gsm8k_path;   // JSONL with `question` and `answer` ("... #### N")
  int wrong_every = 0;      // answer N+1 on questions whose line number is a multiple; 0: never
};

struct FakeOpenAIStats {
  std::uint64_t requests = 0;     // chat-completion requests
  std::uint64_t connections = 0;  // accepted TCP connections
  std::uint64_t authorized = 0;   // chat-completion requests with an Authorization header
  // The last chat-completion request's Authorization and Content-Type fields, each value on a
  // line of its own (a field sent twice shows twice).
  std::string last_authorization, last_content_type;
  std::string last_body;  // the last chat-completion request's body, as sent
  std::map<std::string, std::uint64_t> per_item;  // by last user message
  // When each chat-completion request arrived, in ms since the server started (or was reset).
  std::vector<double> arrival_ms;
};

class FakeOpenAIServer {
 public:
  // Starts listening at once on host:port (port 0: any free port), served by `threads`
  // threads of its own. Only loopback addresses belong in tests.
  explicit FakeOpenAIServer(FakeOpenAIOptions options = {}, int threads = 1,
                            std::string host = "127.0.0.1", std::uint16_t port = 0);
  ~FakeOpenAIServer();  // stops: closes the listener and every connection, joins the threads
  FakeOpenAIServer(const FakeOpenAIServer&) = delete;
  FakeOpenAIServer& operator=(const FakeOpenAIServer&) = delete;

  std::uint16_t port() const;
  std::string host() const;
  std::string base_url() const;  // "http://127.0.0.1:PORT/v1"

  FakeOpenAIStats stats() const;
  std::uint64_t requests() const;
  std::uint64_t connections() const;
  std::uint64_t requests_for(const std::string& item) const;
  void reset_stats();

  // Take effect for requests that arrive afterwards.
  void set_options(FakeOpenAIOptions options);  // reloads the GSM8K file when it changed
  void set_rules(std::vector<FaultRule> rules);
  void clear_rules();

  // The text a plain (non-GSM8K) answer of `tokens` words holds.
  static std::string generated_text(int tokens);

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace batchlm::testing
