// What the OpenAI client reads from a server (client/src/openai.cpp): streamed answers (SSE
// events carrying chat.completion.chunk JSON), whole JSON answers, error responses with their
// retry headers, and parse_answer_json on any text.
//
// Input: a mode byte, then per mode
//   0 stream:  a byte for the HTTP status / content type / transport error, a byte seeding the
//              chunk sizes, then the body;
//   1 body:    the body of a non-streaming answer;
//   2 error:   header lines ("name: value\n") up to an empty line, then the body of a non-2xx
//              response;
//   3 json:    any text for parse_answer_json.
//
// Promised: every answer becomes exactly one of a completion or an error, never an exception.
// Checked: a stream gives the same outcome whatever its chunking; the text passed to the sink
// is the completion's text; timings are finite and not negative; retry hints lie in [0, 1 day];
// an error has a message; parse_answer_json reads valid JSON as nlohmann::json does.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "batchlm/client/openai.hpp"
#include "fuzz_support.hpp"

using namespace batchlm;
using namespace batchlm::client;

namespace {

std::string describe(const Outcome& o) {
  if (o.ok()) return "completion '" + o.completion->text + "' finish '" + o.completion->finish_reason + "'";
  return "error " + std::string(to_string(o.error->kind)) + " " + std::to_string(o.error->http_status) + " '" +
         o.error->message + "' code '" + o.error->code + "'";
}

bool same(const Outcome& a, const Outcome& b) {
  if (a.ok() != b.ok()) return false;
  if (a.ok()) {
    return a.completion->text == b.completion->text &&
           a.completion->finish_reason == b.completion->finish_reason &&
           a.completion->usage.prompt_tokens == b.completion->usage.prompt_tokens &&
           a.completion->usage.completion_tokens == b.completion->usage.completion_tokens &&
           a.completion->usage.reported == b.completion->usage.reported &&
           a.completion->logprobs.has_value() == b.completion->logprobs.has_value() &&
           (!a.completion->logprobs || a.completion->logprobs->size() == b.completion->logprobs->size());
  }
  return a.error->kind == b.error->kind && a.error->message == b.error->message &&
         a.error->code == b.error->code && a.error->http_status == b.error->http_status;
}

void check_error(const Error& error) {
  FUZZ_CHECK(!error.message.empty(), "an error without a message");
  if (error.retry_after) {
    FUZZ_CHECK(error.retry_after->count() >= 0 && *error.retry_after <= std::chrono::hours(24),
               "retry hint out of range: " + std::to_string(error.retry_after->count()) + " ms");
  }
  // What the writer does with it: a record line, invalid UTF-8 replaced.
  (void)error.to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// What the sink was handed: text, and log-probabilities.
struct Sunk {
  std::string text;
  std::string reasoning;
  std::vector<batchlm::TokenLogprob> logprobs;
  batchlm::TokenSink sink() {
    return [this](std::string_view piece, std::span<const batchlm::TokenLogprob> lp, batchlm::TextPart part) {
      if (part == batchlm::TextPart::kReasoning) {
        reasoning += piece;
        return;
      }
      text += piece;
      logprobs.insert(logprobs.end(), lp.begin(), lp.end());
    };
  }
};

void check_outcome(const Outcome& o, const Sunk& sunk) {
  const std::string& streamed = sunk.text;
  FUZZ_CHECK(o.completion.has_value() != o.error.has_value(), "not exactly one of completion and error");
  for (const double t : {o.timings.ttft_ms, o.timings.tpot_ms, o.timings.total_ms})
    FUZZ_CHECK(std::isfinite(t) && t >= 0, "timing " + std::to_string(t));
  if (o.ok()) {
    FUZZ_CHECK(streamed == o.completion->text, "the sink got '" + streamed + "', the completion has '" +
                                                    o.completion->text + "'");
    FUZZ_CHECK(sunk.reasoning == o.completion->reasoning, "the sink got reasoning '" + sunk.reasoning +
                                                              "', the completion has '" + o.completion->reasoning + "'");
    const std::size_t kept = o.completion->logprobs ? o.completion->logprobs->size() : 0;
    FUZZ_CHECK(sunk.logprobs.size() == kept, "the sink got " + std::to_string(sunk.logprobs.size()) +
                                                 " log-probabilities, the completion has " + std::to_string(kept));
    for (std::size_t i = 0; i < kept; ++i)
      FUZZ_CHECK(sunk.logprobs[i].token == (*o.completion->logprobs)[i].token, "a log-probability's token differs");
    // What the writer does with them: part of a record line, which must be valid JSON text.
    if (o.completion->logprobs) {
      const std::string line = batchlm::logprobs_json(*o.completion->logprobs).dump();
      FUZZ_CHECK(!nlohmann::json::parse(line, nullptr, false).is_discarded(), "logprobs_json wrote invalid JSON");
    }
  } else {
    check_error(*o.error);
  }
}

HttpResponse response_for(std::uint8_t choice) {
  HttpResponse response;
  static constexpr int kStatuses[] = {200, 200, 200, 201, 400, 429, 500, 503};
  response.status = kStatuses[choice & 7];
  if (choice & 8) response.headers.emplace_back("content-type", "application/json");
  else response.headers.emplace_back("content-type", "text/event-stream");
  if (choice & 16) response.headers.emplace_back("retry-after", "2");
  if (choice & 32) {
    Error e;
    e.kind = (choice & 64) ? ErrorKind::Connection : ErrorKind::Timeout;
    e.message = "transport";
    response.error = e;
  }
  return response;
}

Outcome stream(std::string_view body, std::uint8_t response_choice, std::uint32_t seed, SseLimits limits,
               Sunk& streamed) {
  const auto started = std::chrono::steady_clock::now();  // the request is sent
  StreamedAnswer answer(limits, streamed.sink());
  HttpResponse response = response_for(response_choice);
  const bool success = response.status >= 200 && response.status < 300;
  std::string_view rest = body;
  while (!rest.empty()) {
    seed = seed * 1103515245u + 12345u;
    const std::size_t n = seed == 0 ? rest.size() : std::min(rest.size(), std::size_t{1} + (seed >> 16) % 33);
    // As the HTTP client does: body bytes of a 2xx go to the handler, others to the body.
    if (success) {
      if (!answer.feed(rest.substr(0, n))) break;
    } else {
      response.body.append(rest.substr(0, n));
    }
    rest.remove_prefix(n);
  }
  return answer.finish(response, started);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::InputReader input(data, size);
  const std::uint8_t mode = input.byte() % 4;
  if (mode == 0) {
    const std::uint8_t response_choice = input.byte();
    const std::uint32_t seed = input.byte();
    const std::string_view body = input.rest();
    SseLimits limits;
    limits.max_line_bytes = 4096;
    limits.max_event_bytes = 8192;
    Sunk streamed_whole, streamed_chunks;
    const Outcome whole = stream(body, response_choice, 0, limits, streamed_whole);
    const Outcome chunks = stream(body, response_choice, seed * 2654435761u + 1, limits, streamed_chunks);
    check_outcome(whole, streamed_whole);
    check_outcome(chunks, streamed_chunks);
    FUZZ_CHECK(same(whole, chunks), "in one piece: " + describe(whole) + "\nin chunks: " + describe(chunks));
  } else if (mode == 1) {
    const std::string_view body = input.rest();
    Sunk streamed;
    Timings timings;
    timings.total_ms = 12;
    const Outcome o = answer_from_body(200, body, timings, streamed.sink());
    check_outcome(o, streamed);
  } else if (mode == 2) {
    HttpResponse response;
    response.status = 400 + input.byte() % 200;
    while (!input.empty()) {
      const std::string_view line = input.until('\n');
      if (line.empty()) break;
      const std::size_t colon = line.find(':');
      if (colon == std::string_view::npos) continue;
      std::string_view value = line.substr(colon + 1);
      while (value.starts_with(' ')) value.remove_prefix(1);
      response.headers.emplace_back(std::string(line.substr(0, colon)), std::string(value));
    }
    response.body = std::string(input.rest());
    const Error error = http_error(response);
    FUZZ_CHECK(error.kind == ErrorKind::Http && error.http_status == response.status, "not an HTTP error");
    check_error(error);
  } else {
    const std::string_view text = input.rest();
    const nlohmann::json value = parse_answer_json(text);
    const nlohmann::json strict = nlohmann::json::parse(text, nullptr, false);
    if (!strict.is_discarded()) FUZZ_CHECK(value == strict, "valid JSON read differently");
  }
  return 0;
}
