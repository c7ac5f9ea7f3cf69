// Tool calls on the remote path: the tool-calling fields of a conversation sent as the API takes
// them, and an answer's calls read back, whole or streamed in fragments.

#include <gtest/gtest.h>

#include "batchlm/client/openai.hpp"

namespace batchlm::client {
namespace {

using nlohmann::json;

HttpResponse stream_response() {
  HttpResponse response;
  response.status = 200;
  response.headers = {{"content-type", "text/event-stream"}};
  return response;
}

// `body` fed in pieces of `chunk` bytes (0: whole).
Outcome streamed(const std::string& body, std::size_t chunk = 0) {
  StreamedAnswer answer(SseLimits{}, {});
  if (chunk == 0) chunk = body.size();
  for (std::size_t at = 0; at < body.size(); at += chunk)
    if (!answer.feed(std::string_view(body).substr(at, chunk))) break;
  return answer.finish(stream_response(), std::chrono::steady_clock::now());
}

std::string event(const json& delta, const json& finish_reason = nullptr) {
  return "data: " + json{{"choices", json::array({{{"index", 0}, {"delta", delta}, {"finish_reason", finish_reason}}})}}.dump() +
         "\n\n";
}

json call_fragment(int index, json fields) {
  fields["index"] = index;
  return {{"tool_calls", json::array({std::move(fields)})}};
}

const json kWeather = {{"id", "call_a"},
                       {"type", "function"},
                       {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}};
const json kTime = {{"id", "call_b"},
                    {"type", "function"},
                    {"function", {{"name", "get_time"}, {"arguments", "{\"zone\": \"CET\"}"}}}};

TEST(ToolCallsBody, AnAssistantsCallsAndAToolsAnswerAreSentAsTheApiTakesThem) {
  Request request;
  request.messages = {{"user", "Weather in Paris?"}, {"assistant", ""}, {"tool", "18 C, clear"}};
  request.messages[1].tool_calls = json::array({kWeather});
  request.messages[2].tool_call_id = "call_a";
  request.messages[2].name = "get_weather";
  const json body = to_openai_body(request);
  EXPECT_EQ(body["messages"][0], (json{{"role", "user"}, {"content", "Weather in Paris?"}}));
  EXPECT_EQ(body["messages"][1], (json{{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {kWeather}}}));
  EXPECT_EQ(body["messages"][2],
            (json{{"role", "tool"}, {"content", "18 C, clear"}, {"tool_call_id", "call_a"}, {"name", "get_weather"}}));

  // An assistant message with text beside its calls keeps the text.
  request.messages[1].content = "Let me look.";
  EXPECT_EQ(to_openai_body(request)["messages"][1]["content"], "Let me look.");
}

TEST(ToolCallsStream, FragmentsOfTwoCallsAreJoinedInIndexOrderInAnyChunking) {
  // As the API streams parallel calls: each call's id, type and name with empty arguments, then
  // its arguments in pieces; here the two calls' pieces are interleaved, and the second call's
  // head comes first.
  const std::string body =
      event({{"role", "assistant"}, {"content", nullptr}}) +
      event(call_fragment(1, {{"id", "call_b"}, {"type", "function"}, {"function", {{"name", "get_time"}, {"arguments", ""}}}})) +
      event(call_fragment(0, {{"id", "call_a"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", ""}}}})) +
      event(call_fragment(0, {{"function", {{"arguments", "{\"city\""}}}})) +
      event(call_fragment(1, {{"function", {{"arguments", "{\"zone\": "}}}})) +
      event(call_fragment(0, {{"function", {{"arguments", ": \"Paris\"}"}}}})) +
      event(call_fragment(1, {{"function", {{"arguments", "\"CET\"}"}}}})) + event(json::object(), "tool_calls") +
      "data: [DONE]\n\n";
  for (const std::size_t chunk : {std::size_t{0}, std::size_t{1}, std::size_t{13}}) {
    SCOPED_TRACE(chunk);
    const Outcome o = streamed(body, chunk);
    ASSERT_TRUE(o.ok()) << o.error->message;
    EXPECT_EQ(o.completion->text, "");
    EXPECT_EQ(o.completion->finish_reason, "tool_calls");
    EXPECT_EQ(o.completion->tool_calls, json::array({kWeather, kTime}));
    EXPECT_TRUE(o.completion->function_call.is_null());
    EXPECT_GT(o.completion->timings.total_ms, 0.0);
  }
}

TEST(ToolCallsStream, TextBesideCallsIsKeptAndAnAnswerWithoutCallsHasNone) {
  const Outcome both = streamed(event({{"content", "Checking."}}) +
                                event(call_fragment(0, {{"id", "call_a"}, {"type", "function"},
                                                        {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}})) +
                                event(json::object(), "tool_calls") + "data: [DONE]\n\n");
  ASSERT_TRUE(both.ok()) << both.error->message;
  EXPECT_EQ(both.completion->text, "Checking.");
  EXPECT_EQ(both.completion->tool_calls, json::array({kWeather}));

  const Outcome plain = streamed(event({{"content", "4"}}, "stop") + "data: [DONE]\n\n");
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain.completion->tool_calls.is_null());
}

TEST(ToolCallsStream, AnIdNameOrTypeRepeatedInEveryFragmentIsKeptOnce) {
  const std::string repeated =
      event(call_fragment(0, {{"id", "call_a"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", "{\"city\""}}}})) +
      event(call_fragment(0, {{"id", "call_a"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", ": \"Paris\"}"}}}})) +
      event(json::object(), "tool_calls") + "data: [DONE]\n\n";
  const Outcome r = streamed(repeated);
  ASSERT_TRUE(r.ok()) << r.error->message;
  EXPECT_EQ(r.completion->tool_calls, json::array({kWeather}));
}

// As Gemini's OpenAI-compatible endpoint and proxies in front of it send calls: no index, and
// ids and types empty. A name that differs starts a call of its own.
TEST(ToolCallsStream, CallsWithoutIndexOrIdAreNotJoinedIntoOne) {
  const auto no_index = [](json fields) { return json{{"tool_calls", json::array({std::move(fields)})}}; };
  const std::string body =
      event(no_index({{"id", ""}, {"type", ""}, {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}})) +
      event(no_index({{"id", ""}, {"type", ""}, {"function", {{"name", "get_time"}, {"arguments", "{\"zone\": \"CET\"}"}}}})) +
      event(json::object(), "stop") + "data: [DONE]\n\n";
  const Outcome o = streamed(body);
  ASSERT_TRUE(o.ok()) << o.error->message;
  json weather = kWeather, time = kTime;
  weather.erase("id");
  time.erase("id");
  EXPECT_EQ(o.completion->tool_calls, json::array({weather, time}));

  // Both calls in one delta, without ids.
  const Outcome one = streamed(event({{"tool_calls", json::array({{{"function", kWeather["function"]}}, {{"function", kTime["function"]}}})}}) +
                               event(json::object(), "tool_calls") + "data: [DONE]\n\n");
  ASSERT_TRUE(one.ok()) << one.error->message;
  EXPECT_EQ(one.completion->tool_calls, json::array({weather, time}));
}

// A proxy that numbers every call 0: the second call (another id) gets a place of its own, and
// the fragments after it go to it.
TEST(ToolCallsStream, AnIndexGivenToTwoCallsKeepsThemApart) {
  const std::string body =
      event(call_fragment(0, {{"id", "call_a"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": "}}}})) +
      event(call_fragment(0, {{"function", {{"arguments", "\"Paris\"}"}}}})) +
      event(call_fragment(0, {{"id", "call_b"}, {"type", "function"}, {"function", {{"name", "get_time"}, {"arguments", "{\"zone\": "}}}})) +
      event(call_fragment(0, {{"function", {{"arguments", "\"CET\"}"}}}})) + event(json::object(), "tool_calls") +
      "data: [DONE]\n\n";
  const Outcome o = streamed(body);
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(o.completion->tool_calls, json::array({kWeather, kTime}));
}

TEST(ToolCallsStream, FragmentsWithoutAnIndexContinueTheLastCallUntilANewIdStartsTheNext) {
  const auto no_index = [](json fields) { return json{{"tool_calls", json::array({std::move(fields)})}}; };
  const std::string body =
      event(no_index({{"id", "call_a"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": "}}}})) +
      event(no_index({{"function", {{"arguments", "\"Paris\"}"}}}})) +
      event(no_index({{"id", "call_b"}, {"type", "function"}, {"function", {{"name", "get_time"}, {"arguments", "{\"zone\": "}}}})) +
      event(no_index({{"function", {{"arguments", "\"CET\"}"}}}})) + event(json::object(), "tool_calls") +
      "data: [DONE]\n\n";
  const Outcome o = streamed(body);
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(o.completion->tool_calls, json::array({kWeather, kTime}));
}

TEST(ToolCallsStream, TheOlderFunctionCallIsJoinedToo) {
  const std::string body = event({{"function_call", {{"name", "get_weather"}, {"arguments", ""}}}}) +
                           event({{"function_call", {{"arguments", "{\"city\""}}}}) +
                           event({{"function_call", {{"arguments", ": \"Paris\"}"}}}}) +
                           event(json::object(), "function_call") + "data: [DONE]\n\n";
  const Outcome o = streamed(body);
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(o.completion->function_call, (json{{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}));
  EXPECT_TRUE(o.completion->tool_calls.is_null());
  EXPECT_EQ(o.completion->finish_reason, "function_call");
}

TEST(ToolCallsStream, MalformedCallsAreProtocolErrorsThatSayWhatCame) {
  const std::string end = event(json::object(), "tool_calls") + "data: [DONE]\n\n";
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"tool_calls", {{"id", "call_a"}}}}, "expected a list of tool calls as delta.tool_calls, got object"},
      {{{"tool_calls", json::array({"call_a"})}}, "expected an object as delta.tool_calls[0], got string"},
      {{{"tool_calls", json::array({{{"index", -1}, {"id", "x"}}})}}, "delta.tool_calls[].index, got number: -1"},
      {{{"tool_calls", json::array({{{"index", "0"}, {"id", "x"}}})}}, "delta.tool_calls[].index, got string"},
      {{{"tool_calls", json::array({{{"index", 5000}, {"id", "x"}}})}}, "delta.tool_calls[].index, got number: 5000"},
      {{{"function_call", "get_weather"}}, "expected an object as delta.function_call, got string"},
  };
  for (const auto& [delta, message] : cases) {
    SCOPED_TRACE(delta.dump());
    const Outcome o = streamed(event(delta) + end);
    ASSERT_FALSE(o.ok());
    EXPECT_EQ(o.error->kind, ErrorKind::Protocol);
    EXPECT_NE(o.error->message.find(message), std::string::npos) << o.error->message;
  }
}

TEST(ToolCallsStream, MoreCallsThanAnAnswerMayHoldIsTooLarge) {
  std::string body;
  for (int i = 0; i <= 1024; ++i)
    body += event(call_fragment(i, {{"id", "c" + std::to_string(i)}, {"function", {{"name", "f"}, {"arguments", "{}"}}}}));
  const Outcome o = streamed(body + event(json::object(), "tool_calls") + "data: [DONE]\n\n");
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::TooLarge);
  EXPECT_EQ(o.error->message, "more than 1024 tool calls in one answer");
}

TEST(ToolCallsBody, AWholeAnswersCallsAreRead) {
  const json answer = {{"choices", json::array({{{"index", 0},
                                                 {"message", {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {kWeather, kTime}}}},
                                                 {"finish_reason", "tool_calls"}}})},
                       {"usage", {{"prompt_tokens", 20}, {"completion_tokens", 12}}}};
  const Outcome o = answer_from_body(200, answer.dump(), {});
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(o.completion->text, "");
  EXPECT_EQ(o.completion->tool_calls, json::array({kWeather, kTime}));
  EXPECT_EQ(o.completion->finish_reason, "tool_calls");

  const json legacy = {{"choices", json::array({{{"message", {{"content", nullptr}, {"function_call", kWeather["function"]}}},
                                                 {"finish_reason", "function_call"}}})}};
  const Outcome f = answer_from_body(200, legacy.dump(), {});
  ASSERT_TRUE(f.ok()) << f.error->message;
  EXPECT_EQ(f.completion->function_call, kWeather["function"]);

  // A whole answer's calls lose the index a server may give them and have a type.
  const Outcome indexed = answer_from_body(
      200, R"({"choices": [{"message": {"content": null, "tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}, "finish_reason": "tool_calls"}]})", {});
  ASSERT_TRUE(indexed.ok()) << indexed.error->message;
  EXPECT_EQ(indexed.completion->tool_calls, json::array({kWeather}));

  // An empty list is no calls.
  const Outcome none = answer_from_body(
      200, R"({"choices": [{"message": {"content": "hi", "tool_calls": []}, "finish_reason": "stop"}]})", {});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none.completion->tool_calls.is_null());
}

TEST(ToolCallsBody, CallsOfTheWrongTypeAreProtocolErrors) {
  for (const auto& [message, expected] : std::vector<std::pair<std::string, std::string>>{
           {R"({"content": null, "tool_calls": {"id": "x"}})", "expected a list of tool calls as message.tool_calls"},
           {R"({"content": null, "tool_calls": [1]})", "expected an object as message.tool_calls[0], got number: 1"},
           {R"({"content": null, "function_call": "f"})", "expected an object as message.function_call"}}) {
    SCOPED_TRACE(message);
    const Outcome o = answer_from_body(200, R"({"choices": [{"message": )" + message + R"(, "finish_reason": "tool_calls"}]})", {});
    ASSERT_FALSE(o.ok());
    EXPECT_EQ(o.error->kind, ErrorKind::Protocol);
    EXPECT_NE(o.error->message.find(expected), std::string::npos) << o.error->message;
  }
}

}  // namespace
}  // namespace batchlm::client
