#include "batchlm/client/openai.hpp"

#include <gtest/gtest.h>

namespace batchlm::client {
namespace {

using std::chrono::milliseconds;

HttpResponse with_headers(Headers headers, int status = 429, std::string body = {}) {
  HttpResponse response;
  response.status = status;
  response.headers = std::move(headers);
  response.body = std::move(body);
  return response;
}

Request chat_request() {
  Request request;
  request.model = "gpt-4o-mini";
  request.messages = {{"system", "Be brief."}, {"user", "2+2?"}};
  return request;
}

// The endpoint's path goes after the base URL's path and before its query (Azure's
// ?api-version=...), which every request keeps.
TEST(EndpointUrl, PathBeforeTheQuery) {
  EXPECT_EQ(endpoint_url("http://h:8000/v1", false), "http://h:8000/v1/chat/completions");
  EXPECT_EQ(endpoint_url("http://h:8000/v1//", true), "http://h:8000/v1/completions");
  EXPECT_EQ(endpoint_url("https://r.example.com/openai/deployments/d?api-version=2024-10-21", false),
            "https://r.example.com/openai/deployments/d/chat/completions?api-version=2024-10-21");
  EXPECT_EQ(endpoint_url("http://h/v1/?a=1&b=2", true), "http://h/v1/completions?a=1&b=2");
  EXPECT_EQ(endpoint_url("http://h", false), "http://h/chat/completions");
}

TEST(ToOpenAIBody, MapsModelMessagesAndStreamingOptions) {
  const auto body = to_openai_body(chat_request());
  EXPECT_EQ(body["model"], "gpt-4o-mini");
  ASSERT_EQ(body["messages"].size(), 2u);
  EXPECT_EQ(body["messages"][0].dump(), R"({"role":"system","content":"Be brief."})");
  EXPECT_EQ(body["messages"][1]["content"], "2+2?");
  EXPECT_EQ(body["stream"], true);
  EXPECT_EQ(body["stream_options"]["include_usage"], true);
}

// A message's parts (an image beside its text) go in place of its content, and its other keys
// beside the fields this client writes, which they do not replace.
TEST(ToOpenAIBody, SendsContentPartsAndOtherMessageKeysAsGiven) {
  Request request = chat_request();
  ChatMessage& user = request.messages[1];
  user.content = "What is in it?";
  user.parts = nlohmann::ordered_json::parse(
      R"([{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}])");
  user.fields = nlohmann::ordered_json::parse(R"({"cache_control": {"type": "ephemeral"}, "role": "system"})");
  const auto body = to_openai_body(request);
  EXPECT_EQ(body["messages"][1].dump(),
            R"({"role":"user","content":[{"type":"text","text":"What is in it?"},{"type":"image_url","image_url":)"
            R"({"url":"https://x/y.png"}}],"cache_control":{"type":"ephemeral"}})");
  EXPECT_EQ(body["messages"][0].dump(), R"({"role":"system","content":"Be brief."})");
}

TEST(ToOpenAIBody, LeavesUnsetFieldsOut) {
  const auto body = to_openai_body(chat_request());
  for (const char* key : {"max_tokens", "temperature", "top_p", "stop", "seed"})
    EXPECT_FALSE(body.contains(key)) << key;
}

TEST(ToOpenAIBody, MapsSamplingFields) {
  Request request = chat_request();
  request.max_tokens = 512;
  request.temperature = 0.0;
  request.top_p = 0.9;
  request.stop = {"\n\n", "####"};
  request.seed = 1234;
  const auto body = to_openai_body(request);
  EXPECT_EQ(body["max_tokens"], 512);
  EXPECT_EQ(body["temperature"], 0.0);
  EXPECT_EQ(body["top_p"], 0.9);
  EXPECT_EQ(body["stop"], (nlohmann::json{"\n\n", "####"}));
  EXPECT_EQ(body["seed"], 1234);
}

TEST(ToOpenAIBody, NonStreamingSendsNoStreamOptions) {
  Request request = chat_request();
  request.stream = false;
  request.extra = {{"stream_options", {{"include_usage", true}}}};
  const auto body = to_openai_body(request);
  EXPECT_EQ(body["stream"], false);
  EXPECT_FALSE(body.contains("stream_options"));
}

TEST(ToOpenAIBody, PassesExtraFieldsButTypedFieldsWin) {
  Request request = chat_request();
  request.temperature = 0.5;
  request.extra = {{"response_format", {{"type", "json_object"}}},
                   {"temperature", 1.5},
                   {"stream", false},
                   {"logprobs", true}};
  const auto body = to_openai_body(request);
  EXPECT_EQ(body["response_format"]["type"], "json_object");
  EXPECT_EQ(body["logprobs"], true);
  EXPECT_EQ(body["temperature"], 0.5);
  EXPECT_EQ(body["stream"], true);
}

TEST(ToOpenAIBody, ExtraFieldsFollowTheTypedOnesInTheOrderGiven) {
  // A server that writes tools into a prompt (vLLM, llama.cpp's) sees them as the job wrote them.
  Request request = chat_request();
  request.max_tokens = 8;
  request.extra = nlohmann::ordered_json::parse(
      R"({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "logprobs": true})");
  EXPECT_EQ(to_openai_body(request).dump(),
            R"({"model":"gpt-4o-mini","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"2+2?"}],)"
            R"("max_tokens":8,"stream":true,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],)"
            R"("logprobs":true,"stream_options":{"include_usage":true}})");
}

TEST(ParseRetryAfter, MillisecondsHeaderWins) {
  auto r = with_headers({{"retry-after", "7"}, {"retry-after-ms", "1500"}});
  EXPECT_EQ(parse_retry_after(r), milliseconds(1500));
}

TEST(ParseRetryAfter, SecondsIncludingFractions) {
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "3"}})), milliseconds(3000));
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", " 0.25 "}})), milliseconds(250));
}

TEST(ParseRetryAfter, HttpDateRelativeToNow) {
  // Sun, 06 Nov 1994 08:49:37 GMT is 784111777 seconds after the epoch.
  const auto now = std::chrono::system_clock::time_point(std::chrono::seconds(784111777 - 30));
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "Sun, 06 Nov 1994 08:49:37 GMT"}}), now),
            milliseconds(30'000));
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "Sunday, 06-Nov-94 08:49:37 GMT"}}), now),
            milliseconds(30'000));
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "Sun Nov  6 08:49:37 1994"}}), now),
            milliseconds(30'000));
}

TEST(ParseRetryAfter, DateInThePastIsZero) {
  const auto now = std::chrono::system_clock::time_point(std::chrono::seconds(784111777 + 60));
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "Sun, 06 Nov 1994 08:49:37 GMT"}}), now),
            milliseconds(0));
}

// Found by fuzzing (tests/fuzz/corpus/openai_answer): a date in the year 997 overflowed the
// clock's nanoseconds (undefined behaviour) on its way to a time point.
TEST(ParseRetryAfter, DatesBeyondTheClockAreClamped) {
  const auto now = std::chrono::system_clock::time_point(std::chrono::seconds(784111777));
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "Sun, 06 Nov 0997 00:49:37 GMT"}}), now),
            milliseconds(0));
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "Fri, 31 Dec 9999 23:59:59 GMT"}}), now),
            std::chrono::hours(24));
}

TEST(ParseRetryAfter, NegativeValuesAreZero) {
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after-ms", "-20"}})), milliseconds(0));
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "-3"}})), milliseconds(0));
}

TEST(ParseRetryAfter, GarbageIsNullopt) {
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "soon"}})), std::nullopt);
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "10s"}})), std::nullopt);
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after", "Sun, 32 Nov 1994 08:49:37 GMT"}})), std::nullopt);
  EXPECT_EQ(parse_retry_after(with_headers({})), std::nullopt);
}

TEST(ParseRetryAfter, GarbageMillisecondsFallBackToRetryAfter) {
  EXPECT_EQ(parse_retry_after(with_headers({{"retry-after-ms", "x"}, {"retry-after", "2"}})),
            milliseconds(2000));
}

TEST(ParseShouldRetry, ReadsTrueAndFalse) {
  EXPECT_EQ(parse_should_retry(with_headers({{"x-should-retry", "true"}})), true);
  EXPECT_EQ(parse_should_retry(with_headers({{"x-should-retry", "False"}})), false);
  EXPECT_EQ(parse_should_retry(with_headers({{"x-should-retry", "maybe"}})), std::nullopt);
  EXPECT_EQ(parse_should_retry(with_headers({})), std::nullopt);
}

TEST(HttpError, TakesCodeAndMessageFromJsonBody) {
  auto response = with_headers(
      {{"retry-after-ms", "250"}, {"x-should-retry", "true"}}, 429,
      R"({"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}})");
  const Error error = http_error(response);
  EXPECT_EQ(error.kind, ErrorKind::Http);
  EXPECT_EQ(error.http_status, 429);
  EXPECT_EQ(error.code, "rate_limit_exceeded");
  EXPECT_EQ(error.message, "Rate limit reached");
  EXPECT_EQ(error.retry_after, milliseconds(250));
  EXPECT_EQ(error.should_retry, true);
}

TEST(HttpError, FallsBackToTypeWhenCodeIsNull) {
  const Error error = http_error(with_headers(
      {}, 400, R"({"error":{"message":"bad","type":"invalid_request_error","code":null}})"));
  EXPECT_EQ(error.code, "invalid_request_error");
  EXPECT_EQ(error.message, "bad");
  EXPECT_EQ(error.retry_after, std::nullopt);
  EXPECT_EQ(error.should_retry, std::nullopt);
}

TEST(HttpError, UsesRawBodyWhenNotJson) {
  const Error error = http_error(with_headers({}, 502, "<html>Bad Gateway</html>"));
  EXPECT_EQ(error.http_status, 502);
  EXPECT_EQ(error.message, "<html>Bad Gateway</html>");
  EXPECT_TRUE(error.code.empty());
}

// A gateway's error page is said by its title, not its markup.
TEST(HttpError, AnHtmlPageIsSaidByItsTitle) {
  const std::string nginx =
      "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1></center>"
      "\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";
  Error error = http_error(with_headers({}, 502, nginx));
  EXPECT_EQ(error.http_status, 502);
  EXPECT_EQ(error.message, "502 Bad Gateway (an HTML page)");
  error = http_error(with_headers({}, 504, "\n<!DOCTYPE html><HTML><HEAD><TITLE>\n  Gateway\n\tTime-out </TITLE>"));
  EXPECT_EQ(error.message, "Gateway Time-out (an HTML page)");
  // No title, or an empty one: the body as it is.
  error = http_error(with_headers({}, 503, "<html><title> </title>down</html>"));
  EXPECT_EQ(error.message, "<html><title> </title>down</html>");
}

TEST(HttpError, TruncatesLongRawBody) {
  const Error error = http_error(with_headers({}, 500, std::string(10'000, 'x')));
  EXPECT_LT(error.message.size(), 600u);
  EXPECT_EQ(error.message.substr(0, 500), std::string(500, 'x'));
}

// The cut falls between UTF-8 characters: "é" is two bytes, and byte 500 is the second of one.
TEST(HttpError, TruncatesARawBodyBetweenCharacters) {
  std::string body = "x";
  while (body.size() < 2'000) body += "\xc3\xa9";
  const Error error = http_error(with_headers({}, 500, body));
  EXPECT_EQ(error.message, body.substr(0, 499) + "...");
}

TEST(HttpError, EmptyBodyNamesStatus) {
  EXPECT_EQ(http_error(with_headers({}, 503)).message, "HTTP 503");
}

TEST(HttpError, RedirectNamesItsLocation) {
  const Error error = http_error(with_headers({{"location", "https://api.example.com/v1/chat/completions"}}, 302));
  EXPECT_EQ(error.kind, ErrorKind::Http);
  EXPECT_EQ(error.http_status, 302);
  EXPECT_EQ(error.message, "HTTP 302 redirect to https://api.example.com/v1/chat/completions, not followed");
}

}  // namespace
TEST(ParseAnswerJson, ValidJsonIsReadAsItIs) {
  EXPECT_EQ(parse_answer_json(R"({"a": "\ud83d\ude00 ok", "b": "\\ud800"})"),
            (nlohmann::json{{"a", "\xF0\x9F\x98\x80 ok"}, {"b", "\\ud800"}}));
  EXPECT_TRUE(parse_answer_json("{\"a\": ").is_discarded());
  EXPECT_TRUE(parse_answer_json("not json").is_discarded());
}

TEST(ParseAnswerJson, InvalidUtf8BytesBecomeReplacementCharacters) {
  // A lone continuation byte, a cut-off sequence, an overlong form, an encoded surrogate.
  const std::string text = "{\"content\": \"a\x80" "b\xE2\x82" "c\xC0\xAF" "d\xED\xA0\x80" "e\"}";
  const nlohmann::json j = parse_answer_json(text);
  ASSERT_FALSE(j.is_discarded());
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(j["content"], "a" + r + "b" + r + r + "c" + r + r + "d" + r + r + r + "e");
}

// ---- streamed and whole answers, without a server --------------------------------------------

HttpResponse stream_response() { return with_headers({{"content-type", "text/event-stream"}}, 200); }

TEST(StreamedAnswer, ReadsTextFinishReasonAndUsageInAnyChunking) {
  const std::string body =
      "data: {\"choices\": [{\"index\": 0, \"delta\": {\"role\": \"assistant\", \"content\": \"Hel\"}}]}\r\n\r\n"
      "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"lo\"}, \"finish_reason\": \"stop\"}]}\n\n"
      "data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 7, \"completion_tokens\": 2}}\n\n"
      "data: [DONE]\n\n";
  for (const std::size_t chunk : {body.size(), std::size_t{1}, std::size_t{5}}) {
    std::string sunk;
    StreamedAnswer answer(SseLimits{}, [&](std::string_view piece, std::span<const TokenLogprob>, TextPart) { sunk += piece; });
    for (std::size_t at = 0; at < body.size(); at += chunk) ASSERT_TRUE(answer.feed(std::string_view(body).substr(at, chunk)));
    const Outcome o = answer.finish(stream_response(), std::chrono::steady_clock::now());
    ASSERT_TRUE(o.ok()) << o.error->message;
    EXPECT_EQ(o.completion->text, "Hello");
    EXPECT_EQ(sunk, "Hello");
    EXPECT_EQ(o.completion->finish_reason, "stop");
    EXPECT_EQ(o.completion->usage.prompt_tokens, 7);
    EXPECT_EQ(o.completion->usage.completion_tokens, 2);
  }
}

Outcome streamed(std::string_view body, const HttpResponse& response = stream_response()) {
  StreamedAnswer answer(SseLimits{}, {});
  answer.feed(body);
  return answer.finish(response, std::chrono::steady_clock::now());
}

TEST(StreamedAnswer, StreamWithoutAnEndIsTruncated) {
  StreamedAnswer answer(SseLimits{}, {});
  ASSERT_TRUE(answer.feed("data: {\"choices\": [{\"delta\": {\"content\": \"x\"}}]}\n\n"));
  const Outcome o = answer.finish(stream_response(), std::chrono::steady_clock::now());
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::Truncated);
}

// What a gateway sends when its upstream fails: [DONE] without an answer. Each is an error
// (and retried), never a success with no text and no finish reason.
TEST(StreamedAnswer, DoneWithoutChoicesIsAProtocolError) {
  for (const std::string body : {
           "data: {\"id\": \"x\", \"object\": \"chat.completion.chunk\"}\n\ndata: [DONE]\n\n",
           "data: {\"choices\": []}\n\ndata: [DONE]\n\n",
           "data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 3, \"completion_tokens\": 0}}\n\ndata: [DONE]\n\n",
           "data: {\"choices\": [{\"index\": 1, \"delta\": {\"content\": \"x\"}, \"finish_reason\": \"stop\"}]}\n\n"
           "data: [DONE]\n\n",
           "data: [DONE]\n\n"}) {
    const Outcome o = streamed(body);
    ASSERT_FALSE(o.ok()) << body;
    EXPECT_EQ(o.error->kind, ErrorKind::Protocol) << body;
    EXPECT_EQ(o.error->message, "stream has no choices") << body;
    EXPECT_EQ(o.error->http_status, 200);
  }
}

TEST(StreamedAnswer, DoneWithoutAFinishReasonIsAProtocolError) {
  for (const std::string body : {
           "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"the answer\"}}]}\n\ndata: [DONE]\n\n",
           "data: {\"choices\": [{\"delta\": {\"content\": \"the answer\"}, \"finish_reason\": null}]}\n\n"
           "data: {\"choices\": [{\"delta\": {}, \"finish_reason\": \"\"}]}\n\ndata: [DONE]\n\n"}) {
    const Outcome o = streamed(body);
    ASSERT_FALSE(o.ok()) << body;
    EXPECT_EQ(o.error->kind, ErrorKind::Protocol) << body;
    EXPECT_EQ(o.error->message, "stream ended with [DONE] but without a finish reason") << body;
  }
}

TEST(StreamedAnswer, ContentThatIsNotAStringIsAProtocolError) {
  StreamedAnswer answer(SseLimits{}, {});
  EXPECT_FALSE(answer.feed("data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": 12345}}]}\n\n"
                           "data: {\"choices\": [{\"index\": 0, \"delta\": {}, \"finish_reason\": \"stop\"}]}\n\n"
                           "data: [DONE]\n\n"));
  const Outcome o = answer.finish(stream_response(), std::chrono::steady_clock::now());
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::Protocol);
  EXPECT_EQ(o.error->message, "expected a string as delta.content, got number: 12345");

  const Outcome text = streamed("data: {\"choices\": [{\"text\": [\"a\"], \"finish_reason\": \"stop\"}]}\n\ndata: [DONE]\n\n");
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.error->message, "expected a string as text, got array: [\"a\"]");
}

TEST(StreamedAnswer, NullContentIsNoText) {
  const Outcome o = streamed(
      "data: {\"choices\": [{\"index\": 0, \"delta\": {\"role\": \"assistant\", \"content\": null}}]}\n\n"
      "data: {\"choices\": [{\"index\": 0, \"delta\": null, \"finish_reason\": null}]}\n\n"
      "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"ok\"}, \"finish_reason\": \"stop\"}]}\n\n"
      "data: [DONE]\n\n");
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(o.completion->text, "ok");
  EXPECT_EQ(o.completion->finish_reason, "stop");
}

TEST(StreamedAnswer, DeltaOrFinishReasonOfTheWrongTypeIsAProtocolError) {
  Outcome o = streamed("data: {\"choices\": [{\"index\": 0, \"delta\": \"hi\"}]}\n\n"
                       "data: {\"choices\": [{\"index\": 0, \"delta\": {}, \"finish_reason\": \"stop\"}]}\n\n"
                       "data: [DONE]\n\n");
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::Protocol);
  EXPECT_EQ(o.error->message, "expected an object as delta, got string: \"hi\"");

  o = streamed("data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"x\"}, \"finish_reason\": 17}]}\n\n"
               "data: [DONE]\n\n");
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::Protocol);
  EXPECT_EQ(o.error->message, "expected a string as finish_reason, got number: 17");
}

TEST(StreamedAnswer, JsonThatIsNotAnObjectSaysWhatItIs) {
  const Outcome o = streamed("data: [1,2,3]\n\ndata: [DONE]\n\n");
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::Protocol);
  EXPECT_EQ(o.error->message, "expected a JSON object, got array: [1,2,3]");
  EXPECT_EQ(streamed("data: null\n\n").error->message, "expected a JSON object, got null: null");
  EXPECT_EQ(streamed("data: {oops\n\n").error->message, "malformed JSON in stream: {oops");
}

// Once choice 0 has its finish reason the answer is whole: a reset or a server that keeps the
// connection open afterwards (the idle timeout) takes nothing from it.
TEST(StreamedAnswer, TransportFailureAfterTheFinishReasonKeepsTheAnswer) {
  const std::string body =
      "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"42\"}, \"finish_reason\": \"stop\"}]}\n\n";
  const std::string usage = "data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 7, \"completion_tokens\": 1}}\n\n";
  for (const ErrorKind kind : {ErrorKind::Connection, ErrorKind::Timeout}) {
    HttpResponse broken = stream_response();
    broken.error = Error{kind, 0, "", "Recv failure: Connection reset by peer", std::nullopt, std::nullopt};
    Outcome o = streamed(body + usage, broken);
    ASSERT_TRUE(o.ok()) << o.error->message;
    EXPECT_EQ(o.completion->text, "42");
    EXPECT_EQ(o.completion->finish_reason, "stop");
    EXPECT_TRUE(o.completion->usage.reported);
    EXPECT_EQ(o.completion->usage.prompt_tokens, 7);

    o = streamed(body, broken);  // the usage chunk never came: the caller estimates it
    ASSERT_TRUE(o.ok()) << o.error->message;
    EXPECT_FALSE(o.completion->usage.reported);

    // Before the finish reason the answer may be cut short.
    o = streamed("data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"42\"}}]}\n\n", broken);
    ASSERT_FALSE(o.ok());
    EXPECT_EQ(o.error->kind, kind);
  }
  // A cancelled attempt stays cancelled.
  HttpResponse cancelled = stream_response();
  cancelled.error = Error{ErrorKind::Cancelled, 0, "", "request cancelled", std::nullopt, std::nullopt};
  const Outcome o = streamed(body, cancelled);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::Cancelled);
}

TEST(StreamedAnswer, UsageWithCountsThatAreNotNonNegativeIntegersIsNotReported) {
  const std::string answer =
      "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"ok\"}, \"finish_reason\": \"stop\"}]}\n\n";
  for (const std::string usage : {R"({"prompt_tokens": "many", "completion_tokens": -5})",
                                  R"({"prompt_tokens": 10, "completion_tokens": -5})",
                                  R"({"prompt_tokens": 10.5, "completion_tokens": 3})",
                                  R"({"prompt_tokens": 10})",
                                  R"({"prompt_tokens": 10, "completion_tokens": 18446744073709551615})"}) {
    const Outcome o = streamed(answer + "data: {\"choices\": [], \"usage\": " + usage + "}\n\ndata: [DONE]\n\n");
    ASSERT_TRUE(o.ok()) << o.error->message;
    EXPECT_FALSE(o.completion->usage.reported) << usage;
    EXPECT_EQ(o.completion->usage.prompt_tokens, 0) << usage;
    EXPECT_EQ(o.completion->usage.completion_tokens, 0) << usage;

    const Outcome whole = answer_from_body(
        200, R"({"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}], "usage": )" + usage + "}", {});
    ASSERT_TRUE(whole.ok()) << whole.error->message;
    EXPECT_FALSE(whole.completion->usage.reported) << usage;
  }
  const Outcome zero = streamed(answer + "data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 0, "
                                         "\"completion_tokens\": 0}}\n\ndata: [DONE]\n\n");
  ASSERT_TRUE(zero.ok());
  EXPECT_TRUE(zero.completion->usage.reported);
}

// A base URL that answers with a web page (a UI, a captive proxy): the error says what came.
TEST(StreamedAnswer, BodyThatIsNoStreamNamesItsTypeAndStart) {
  const HttpResponse html = with_headers({{"content-type", "text/html; charset=utf-8"}}, 200);
  Outcome o = streamed("<html><body>Gateway says hi</body></html>", html);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::Protocol);
  EXPECT_EQ(o.error->http_status, 200);
  EXPECT_EQ(o.error->message,
            "expected text/event-stream, got text/html; charset=utf-8: <html><body>Gateway says hi</body></html>");

  // Only the start of a long body, cut between characters.
  std::string page = "a";
  for (int i = 0; i < 200; ++i) page += "\xC3\xA9";  // é: byte 100 is the second of one
  o = streamed(page, html);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->message, "expected text/event-stream, got text/html; charset=utf-8: " + page.substr(0, 99) + "...");
  // A whole answer under another label (a server that says text/plain) is still an answer; a
  // part of one is not.
  o = streamed("data: {\"choices\": [{\"delta\": {\"content\": \"x\"}, \"finish_reason\": \"stop\"}]}\n\n",
               with_headers({{"content-type", "text/plain"}}, 200));
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(o.completion->text, "x");
  o = streamed("data: {\"choices\": [{\"delta\": {\"content\": \"x\"}}]}\n\n", html);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::Protocol);
  EXPECT_EQ(o.error->message.rfind("expected text/event-stream, got text/html", 0), 0u) << o.error->message;

  o = streamed("", with_headers({{"content-type", "text/plain"}}, 200));
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->message, "expected text/event-stream, got text/plain with an empty body");
  // A whole JSON answer (a server that ignored "stream") under another label is an answer too;
  // other JSON under it is not.
  o = streamed(R"({"choices": [{"message": {"content": "whole"}, "finish_reason": "stop"}]})",
               with_headers({{"content-type", "text/plain; charset=utf-8"}}, 200));
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(o.completion->text, "whole");
  EXPECT_EQ(o.completion->finish_reason, "stop");
  o = streamed(R"({"status": "ok"})", with_headers({{"content-type", "text/plain"}}, 200));
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->message, R"(expected text/event-stream, got text/plain: {"status": "ok"})");

  // The stream's own type, with parameters or in capitals, is a stream.
  o = streamed("data: {\"choices\": [{\"delta\": {\"content\": \"x\"}, \"finish_reason\": \"stop\"}]}\n\n",
               with_headers({{"content-type", "Text/Event-Stream; charset=utf-8"}}, 200));
  ASSERT_TRUE(o.ok()) << o.error->message;
}

// Found by fuzzing (tests/fuzz/corpus/openai_answer): an error event without data, or an error
// object whose message is "", gave an error with an empty message.
TEST(StreamedAnswer, ErrorsAlwaysHaveAMessage) {
  StreamedAnswer bare(SseLimits{}, {});
  EXPECT_FALSE(bare.feed("event: error\ndata\n\n"));
  Outcome o = bare.finish(stream_response(), std::chrono::steady_clock::now());
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::StreamError);
  EXPECT_EQ(o.error->message, "error event in stream");

  StreamedAnswer empty_message(SseLimits{}, {});
  EXPECT_FALSE(empty_message.feed("data: {\"error\": {\"message\": \"\", \"code\": \"overloaded\"}}\n\n"));
  o = empty_message.finish(stream_response(), std::chrono::steady_clock::now());
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->message, "error in stream");
  EXPECT_EQ(o.error->code, "overloaded");

  o = answer_from_body(200, R"({"error": ""})", {});
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->message, "error in response");
}

TEST(AnswerFromBody, ReadsAChatCompletion) {
  std::string sunk;
  const Outcome o = answer_from_body(
      200, R"({"choices": [{"message": {"content": "4"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})",
      {}, [&](std::string_view piece, std::span<const TokenLogprob>, TextPart) { sunk += piece; });
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o.completion->text, "4");
  EXPECT_EQ(sunk, "4");
  EXPECT_EQ(o.completion->usage.prompt_tokens, 3);
  EXPECT_EQ(answer_from_body(200, "[]", {}).error->kind, ErrorKind::Protocol);
  EXPECT_EQ(answer_from_body(200, "[]", {}).error->message, "expected a JSON object, got array: []");
}

TEST(AnswerFromBody, AChoiceWithoutAFinishReasonOrWithContentOfTheWrongTypeIsAProtocolError) {
  for (const std::string body : {R"({"choices": [{"message": {"content": "4"}}]})",
                                 R"({"choices": [{"message": {"content": "4"}, "finish_reason": ""}]})",
                                 R"({"choices": [{"message": {"content": 4}, "finish_reason": "stop"}]})",
                                 R"({"choices": [{"message": "4", "finish_reason": "stop"}]})",
                                 R"({"choices": [{"text": 4, "finish_reason": "stop"}]})",
                                 R"({"choices": [{"message": {"content": "4"}, "finish_reason": 1}]})"}) {
    const Outcome o = answer_from_body(200, body, {});
    ASSERT_FALSE(o.ok()) << body;
    EXPECT_EQ(o.error->kind, ErrorKind::Protocol) << body;
  }
  const Outcome refusal = answer_from_body(200, R"({"choices": [{"message": {"content": null}, "finish_reason": "stop"}]})", {});
  ASSERT_TRUE(refusal.ok()) << refusal.error->message;
  EXPECT_EQ(refusal.completion->text, "");
}

TEST(ParseAnswerJson, UnpairedSurrogateEscapesBecomeReplacementCharacters) {
  const nlohmann::json j = parse_answer_json(R"({"content": "x\ud83d y \ude00 z \ud83d\ude00", "k\udc00": 1})");
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["content"], "x\xEF\xBF\xBD y \xEF\xBF\xBD z \xF0\x9F\x98\x80");
  EXPECT_TRUE(j.contains("k\xEF\xBF\xBD"));
}

// ---- log-probabilities ---------------------------------------------------------------------------

TEST(ParseLogprobs, ChatFormTakesTheExactBytes) {
  const auto lp = parse_logprobs(nlohmann::json::parse(R"({"content": [
      {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
          {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}, {"token": "Hey", "logprob": -1.5}]},
      {"token": "\\xe2", "logprob": -3, "bytes": [226], "top_logprobs": []},
      {"token": "no logprob"},
      {"token": "!", "logprob": -0.1}]})"));
  ASSERT_TRUE(lp);
  ASSERT_EQ(lp->size(), 3u);
  EXPECT_EQ((*lp)[0].token, "Hi");
  EXPECT_EQ((*lp)[0].logprob, -0.5);
  ASSERT_EQ((*lp)[0].top_logprobs.size(), 2u);
  EXPECT_EQ((*lp)[0].top_logprobs[1].token, "Hey");
  EXPECT_EQ((*lp)[1].token, "\xE2");  // from the bytes, not the escaped text
  EXPECT_EQ((*lp)[2].token, "!");
  EXPECT_TRUE((*lp)[2].top_logprobs.empty());
  // Round trip through the form batchlm writes.
  const auto again = parse_logprobs({{"content", logprobs_json(*lp)}});
  ASSERT_TRUE(again);
  ASSERT_EQ(again->size(), 3u);
  EXPECT_EQ((*again)[1].token, "\xE2");
  EXPECT_EQ((*again)[0].top_logprobs[1].logprob, -1.5);
}

TEST(ParseLogprobs, CompletionsFormListsTheMostLikelyFirst) {
  const auto lp = parse_logprobs(nlohmann::json::parse(R"({
      "tokens": [" a", " b"], "token_logprobs": [-0.2, null],
      "top_logprobs": [{" c": -3.0, " a": -0.2, " d": -1.0}, null], "text_offset": [0, 2]})"));
  ASSERT_TRUE(lp);
  ASSERT_EQ(lp->size(), 1u);  // a null logprob is skipped
  EXPECT_EQ((*lp)[0].token, " a");
  ASSERT_EQ((*lp)[0].top_logprobs.size(), 3u);
  EXPECT_EQ((*lp)[0].top_logprobs[0].token, " a");
  EXPECT_EQ((*lp)[0].top_logprobs[1].token, " d");
  EXPECT_EQ((*lp)[0].top_logprobs[2].token, " c");
}

TEST(ParseLogprobs, EscapedBytesOfTheCompletionsFormAreReadBack) {
  const auto lp = parse_logprobs(nlohmann::json::parse(R"({
      "tokens": ["\\xe4", "bytes:\\xe2\\x80", "a\\x41", "\\x9"], "token_logprobs": [-1, -2, -3, -4],
      "top_logprobs": [{"\\xe4": -1, "x": -5}, null, null, null]})"));
  ASSERT_TRUE(lp);
  ASSERT_EQ(lp->size(), 4u);
  EXPECT_EQ((*lp)[0].token, "\xE4");
  EXPECT_EQ((*lp)[0].top_logprobs[0].token, "\xE4");
  EXPECT_EQ((*lp)[1].token, "\xE2\x80");
  EXPECT_EQ((*lp)[2].token, "a\\x41");  // an ASCII byte is never escaped: the text as it is
  EXPECT_EQ((*lp)[3].token, "\\x9");
}

TEST(ParseLogprobs, NullOrOtherValuesAreNone) {
  EXPECT_FALSE(parse_logprobs(nullptr));
  EXPECT_FALSE(parse_logprobs(nlohmann::json::array()));
  EXPECT_FALSE(parse_logprobs({{"content", "x"}}));
  EXPECT_FALSE(parse_logprobs({{"tokens", {"a"}}}));
  const auto empty = parse_logprobs({{"content", nlohmann::json::array()}});
  ASSERT_TRUE(empty);
  EXPECT_TRUE(empty->empty());
}

TEST(StreamedAnswer, CollectsEachChunksLogprobsAndHandsThemToTheSink) {
  const std::string body =
      "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"Hel\"}, \"logprobs\": {\"content\": "
      "[{\"token\": \"Hel\", \"logprob\": -1.0, \"top_logprobs\": []}]}}]}\n\n"
      "data: {\"choices\": [{\"index\": 1, \"delta\": {\"content\": \"Other\"}, \"logprobs\": {\"content\": "
      "[{\"token\": \"Other\", \"logprob\": -9.0, \"top_logprobs\": []}]}}]}\n\n"
      "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"lo\"}, \"logprobs\": {\"content\": "
      "[{\"token\": \"lo\", \"logprob\": -2.0, \"top_logprobs\": []}]}, \"finish_reason\": \"stop\"}]}\n\n"
      "data: [DONE]\n\n";
  std::vector<std::pair<std::string, std::size_t>> sunk;
  StreamedAnswer answer(SseLimits{}, [&](std::string_view piece, std::span<const TokenLogprob> lp, TextPart) {
    sunk.emplace_back(std::string(piece), lp.size());
  });
  ASSERT_TRUE(answer.feed(body));
  const Outcome o = answer.finish(stream_response(), std::chrono::steady_clock::now());
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(o.completion->text, "Hello");
  ASSERT_TRUE(o.completion->logprobs);
  ASSERT_EQ(o.completion->logprobs->size(), 2u);
  EXPECT_EQ((*o.completion->logprobs)[0].token, "Hel");
  EXPECT_EQ((*o.completion->logprobs)[1].logprob, -2.0);
  EXPECT_EQ(sunk, (std::vector<std::pair<std::string, std::size_t>>{{"Hel", 1}, {"lo", 1}}));

  // A stream without them has none.
  StreamedAnswer plain(SseLimits{}, {});
  ASSERT_TRUE(plain.feed("data: {\"choices\": [{\"delta\": {\"content\": \"x\"}, \"logprobs\": null, "
                         "\"finish_reason\": \"stop\"}]}\n\ndata: [DONE]\n\n"));
  const Outcome p = plain.finish(stream_response(), std::chrono::steady_clock::now());
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p.completion->logprobs);
}

TEST(AnswerFromBody, ReadsLogprobsOfAWholeAnswer) {
  std::size_t sunk = 0;
  const Outcome o = answer_from_body(
      200,
      R"({"choices": [{"text": " 4", "finish_reason": "stop", "logprobs": {"tokens": [" 4"], "token_logprobs": [-0.01], "top_logprobs": [{" 4": -0.01}]}}]})",
      {}, [&](std::string_view, std::span<const TokenLogprob> lp, TextPart) { sunk += lp.size(); });
  ASSERT_TRUE(o.ok());
  ASSERT_TRUE(o.completion->logprobs);
  EXPECT_EQ((*o.completion->logprobs)[0].token, " 4");
  EXPECT_EQ(sunk, 1u);
}

// ---- reasoning given apart from the content ---------------------------------------------------

TEST(StreamedAnswer, ReasoningDeltasAreTheAnswersReasoningAndGoToTheSinkAsSuch) {
  // DeepSeek's API, vLLM and llama.cpp's server send `reasoning_content`; later vLLM and
  // OpenRouter `reasoning`; a server that sends both sends the same text twice.
  const std::string body =
      "data: {\"choices\": [{\"delta\": {\"role\": \"assistant\", \"content\": null, \"reasoning_content\": \"Add \"}}]}\n\n"
      "data: {\"choices\": [{\"delta\": {\"reasoning\": \"them\"}}]}\n\n"
      "data: {\"choices\": [{\"delta\": {\"reasoning_content\": \".\", \"reasoning\": \".\"}}]}\n\n"
      "data: {\"choices\": [{\"delta\": {\"content\": \"4\", \"reasoning_content\": null}, \"finish_reason\": \"stop\"}]}\n\n"
      "data: [DONE]\n\n";
  std::vector<std::pair<std::string, TextPart>> sunk;
  StreamedAnswer answer(SseLimits{}, [&](std::string_view piece, std::span<const TokenLogprob>, TextPart part) {
    sunk.emplace_back(std::string(piece), part);
  });
  ASSERT_TRUE(answer.feed(body));
  const Outcome o = answer.finish(stream_response(), std::chrono::steady_clock::now());
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(o.completion->reasoning, "Add them.");
  EXPECT_EQ(o.completion->text, "4");
  EXPECT_EQ(sunk, (std::vector<std::pair<std::string, TextPart>>{{"Add ", TextPart::kReasoning},
                                                                  {"them", TextPart::kReasoning},
                                                                  {".", TextPart::kReasoning},
                                                                  {"4", TextPart::kContent}}));
}

TEST(AnswerFromBody, ReadsTheReasoningOfAWholeAnswer) {
  for (const char* key : {"reasoning_content", "reasoning"}) {
    std::vector<std::pair<std::string, TextPart>> sunk;
    const Outcome o = answer_from_body(
        200,
        R"({"choices": [{"message": {"role": "assistant", "content": "4", ")" + std::string(key) +
            R"(": "Add them."}, "finish_reason": "stop"}]})",
        {}, [&](std::string_view piece, std::span<const TokenLogprob>, TextPart part) { sunk.emplace_back(std::string(piece), part); });
    ASSERT_TRUE(o.ok()) << key;
    EXPECT_EQ(o.completion->reasoning, "Add them.") << key;
    EXPECT_EQ(o.completion->text, "4") << key;
    EXPECT_EQ(sunk, (std::vector<std::pair<std::string, TextPart>>{{"Add them.", TextPart::kReasoning}, {"4", TextPart::kContent}}));
  }
  // Reasoning that is not text is not read, and does not fail the answer.
  const Outcome o = answer_from_body(
      200, R"({"choices": [{"message": {"content": "4", "reasoning": {"effort": "low"}}, "finish_reason": "stop"}]})", {});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o.completion->reasoning, "");
}

TEST(ToOpenAIBody, SendsAnAssistantsReasoningWhereGiven) {
  Request r = chat_request();
  ChatMessage answer{"assistant", "4"};
  answer.reasoning = "Add them.";
  r.messages.push_back(answer);
  r.messages.push_back({"user", "And 3+3?"});
  const auto body = to_openai_body(r);
  EXPECT_EQ(body["messages"][2].dump(), R"({"role":"assistant","content":"4","reasoning_content":"Add them."})");
  EXPECT_FALSE(body["messages"][1].contains("reasoning_content"));
  EXPECT_FALSE(body["messages"][3].contains("reasoning_content"));
}

}  // namespace batchlm::client
