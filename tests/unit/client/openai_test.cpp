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

TEST(ToOpenAIBody, MapsModelMessagesAndStreamingOptions) {
  const auto body = to_openai_body(chat_request());
  EXPECT_EQ(body["model"], "gpt-4o-mini");
  ASSERT_EQ(body["messages"].size(), 2u);
  EXPECT_EQ(body["messages"][0], (nlohmann::json{{"role", "system"}, {"content", "Be brief."}}));
  EXPECT_EQ(body["messages"][1]["content"], "2+2?");
  EXPECT_EQ(body["stream"], true);
  EXPECT_EQ(body["stream_options"]["include_usage"], true);
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

TEST(HttpError, TruncatesLongRawBody) {
  const Error error = http_error(with_headers({}, 500, std::string(10'000, 'x')));
  EXPECT_LT(error.message.size(), 600u);
  EXPECT_EQ(error.message.substr(0, 500), std::string(500, 'x'));
}

TEST(HttpError, EmptyBodyNamesStatus) {
  EXPECT_EQ(http_error(with_headers({}, 503)).message, "HTTP 503");
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

TEST(ParseAnswerJson, UnpairedSurrogateEscapesBecomeReplacementCharacters) {
  const nlohmann::json j = parse_answer_json(R"({"content": "x\ud83d y \ude00 z \ud83d\ude00", "k\udc00": 1})");
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["content"], "x\xEF\xBF\xBD y \xEF\xBF\xBD z \xF0\x9F\x98\x80");
  EXPECT_TRUE(j.contains("k\xEF\xBF\xBD"));
}

}  // namespace batchlm::client
