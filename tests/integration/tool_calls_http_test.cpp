// Tool calls over real HTTP: the OpenAI backend against the fake server, which answers a
// request with tools by calling them (streamed a few characters at a time, as the API does) and
// refuses a conversation whose tool messages answer no call, as the API does.

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "integration_support.hpp"

namespace {

using batchlm::ChatMessage;
using batchlm::ErrorKind;
using batchlm::Outcome;
using batchlm::Request;
using batchlm::client::OpenAIBackend;
using batchlm::integration::backend_options;
using batchlm::integration::chat_request;
using batchlm::integration::run_on;
using batchlm::testing::FakeOpenAIServer;
using nlohmann::json;

const json kTools = json::array(
    {{{"type", "function"}, {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}},
     {{"type", "function"}, {"function", {{"name", "get_time"}, {"parameters", {{"type", "object"}}}}}}});

// The calls the fake server makes for `question`, in the order it makes them.
json expected_calls(const std::string& question, int count) {
  json calls = json::array();
  for (int k = 0; k < count; ++k) {
    const json arguments = {{"query", question}, {"call", k}};
    calls.push_back({{"type", "function"},
                     {"function", {{"name", kTools[k]["function"]["name"]}, {"arguments", arguments.dump(-1, ' ', true)}}}});
  }
  return calls;
}

// `calls` without their ids (the server numbers them per response), after checking each has one.
json without_ids(json calls) {
  for (auto& call : calls) {
    EXPECT_TRUE(call.contains("id") && call["id"].is_string() && !call["id"].get<std::string>().empty()) << call.dump();
    call.erase("id");
  }
  return calls;
}

class ToolCallsTest : public ::testing::Test {
 protected:
  Outcome complete(const Request& request, const std::string& fault = {}) {
    OpenAIBackend backend(ioc_.get_executor(), backend_options(server_, fault));
    return run_on(ioc_, backend.complete(request, {}));
  }

  boost::asio::io_context ioc_;
  FakeOpenAIServer server_;
};

TEST_F(ToolCallsTest, ParallelCallsArriveWholeStreamedOrNotInAnyChunking) {
  // Non-ASCII in the arguments: the stream's fragments split the JSON text anywhere.
  const std::string question = "Weather and time in Zürich?";
  for (const bool stream : {true, false}) {
    for (const std::string fault : {"", "byte_chunks", "crlf"}) {
      SCOPED_TRACE(std::string(stream ? "stream " : "whole ") + fault);
      Request request = chat_request(question, stream);
      request.extra = {{"tools", kTools}};
      const Outcome o = complete(request, fault);
      ASSERT_TRUE(o.ok()) << o.error->message;
      EXPECT_EQ(o.completion->finish_reason, "tool_calls");
      EXPECT_EQ(o.completion->text, "");
      EXPECT_EQ(without_ids(o.completion->tool_calls), expected_calls(question, 2));
      const json arguments = json::parse(o.completion->tool_calls[0]["function"]["arguments"].get<std::string>());
      EXPECT_EQ(arguments["query"], question);
      EXPECT_TRUE(o.completion->usage.reported);
    }
  }
}

TEST_F(ToolCallsTest, OneCallWhenParallelCallsAreOff) {
  Request request = chat_request("Weather?");
  request.extra = {{"tools", kTools}, {"parallel_tool_calls", false}};
  const Outcome o = complete(request);
  ASSERT_TRUE(o.ok()) << o.error->message;
  EXPECT_EQ(without_ids(o.completion->tool_calls), expected_calls("Weather?", 1));
}

TEST_F(ToolCallsTest, ACallsResultSentBackIsAnsweredWithText) {
  // The round trip a tool-using client makes: the calls, then each call's result as a tool
  // message naming it.
  Request first = chat_request("Weather in Paris?");
  first.extra = {{"tools", kTools}, {"parallel_tool_calls", false}};
  const Outcome calls = complete(first);
  ASSERT_TRUE(calls.ok()) << calls.error->message;
  ASSERT_EQ(calls.completion->tool_calls.size(), 1u);

  for (const bool stream : {true, false}) {
    Request second = chat_request("Weather in Paris?", stream);
    second.extra = first.extra;
    ChatMessage assistant{"assistant", ""};
    assistant.tool_calls = calls.completion->tool_calls;
    ChatMessage result{"tool", "18 C, clear"};
    result.tool_call_id = calls.completion->tool_calls[0]["id"].get<std::string>();
    second.messages.push_back(assistant);
    second.messages.push_back(result);
    const Outcome o = complete(second);
    ASSERT_TRUE(o.ok()) << o.error->message;
    EXPECT_EQ(o.completion->text, "The tool said: 18 C, clear");
    EXPECT_EQ(o.completion->finish_reason, "stop");
    EXPECT_TRUE(o.completion->tool_calls.is_null());
  }
}

TEST_F(ToolCallsTest, AToolMessageThatAnswersNoCallIsRefusedByTheApi) {
  Request request = chat_request("Weather?");
  ChatMessage result{"tool", "18 C"};
  result.tool_call_id = "call_nobody_made";
  request.messages.push_back(result);
  const Outcome o = complete(request);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error->kind, ErrorKind::Http);
  EXPECT_EQ(o.error->http_status, 400);
  EXPECT_NE(o.error->message.find("must be a response to a preceding message with 'tool_calls'"), std::string::npos)
      << o.error->message;
}

TEST_F(ToolCallsTest, AStreamCutInsideACallIsAnErrorNotAPartialCall) {
  Request request = chat_request("Weather?");
  request.extra = {{"tools", kTools}};
  for (const std::string fault : {"reset_after=3", "truncate;after=4"}) {
    SCOPED_TRACE(fault);
    const Outcome o = complete(request, fault);
    ASSERT_FALSE(o.ok());
    EXPECT_TRUE(o.error->kind == ErrorKind::Connection || o.error->kind == ErrorKind::Truncated)
        << batchlm::to_string(o.error->kind) << ": " << o.error->message;
  }
}

}  // namespace
