// The OpenAI wire format of `batchlm serve` without a socket: parse_request / parse_request_body
// (every validation rule, the field named in ApiError::param(), the message), and the JSON of
// whole responses, stream chunks, usage and errors.

#include "batchlm/server/openai_api.hpp"

#include <functional>
#include <limits>
#include <regex>
#include <set>
#include <string>

#include <gtest/gtest.h>

namespace batchlm::server {
namespace {

using nlohmann::json;

constexpr const char* kModel = "tiny-llama";

json chat_body(json extra = json::object()) {
  json body = {{"model", kModel}, {"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})}};
  body.update(extra);
  return body;
}

json completion_body_json(json extra = json::object()) {
  json body = {{"model", kModel}, {"prompt", "Once upon a time"}};
  body.update(extra);
  return body;
}

ApiRequest chat(json extra = json::object()) { return parse_request(Endpoint::kChat, chat_body(std::move(extra)), kModel); }
ApiRequest completion(json extra = json::object()) {
  return parse_request(Endpoint::kCompletions, completion_body_json(std::move(extra)), kModel);
}

// The ApiError `f` throws (a failure, and a default error, when it throws none).
ApiError error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no ApiError thrown";
  return ApiError(0, "", "", "");
}

ApiError chat_error(json body) {
  return error_of([&] { parse_request(Endpoint::kChat, body, kModel); });
}
ApiError completion_error(json body) {
  return error_of([&] { parse_request(Endpoint::kCompletions, body, kModel); });
}

// A 400 invalid_request_error naming `param`, with `message` exactly, and no code.
void expect_invalid(const ApiError& e, const std::string& param, const std::string& message) {
  EXPECT_EQ(e.status(), 400) << e.what();
  EXPECT_EQ(e.type(), "invalid_request_error") << e.what();
  EXPECT_EQ(e.param(), param) << e.what();
  EXPECT_EQ(std::string(e.what()), message);
  EXPECT_EQ(e.code(), "") << e.what();
}

// A 400 with code unsupported_parameter naming `param`.
void expect_unsupported(const ApiError& e, const std::string& param, const std::string& message) {
  EXPECT_EQ(e.status(), 400) << e.what();
  EXPECT_EQ(e.type(), "invalid_request_error") << e.what();
  EXPECT_EQ(e.param(), param) << e.what();
  EXPECT_EQ(e.code(), "unsupported_parameter") << e.what();
  EXPECT_EQ(std::string(e.what()), message);
}

// ---- a valid request ---------------------------------------------------------------------------

TEST(ParseRequest, MinimalChatHasNoDefaults) {
  ApiRequest r = chat();
  EXPECT_EQ(r.endpoint, Endpoint::kChat);
  ASSERT_EQ(r.request.messages.size(), 1u);
  EXPECT_EQ(r.request.messages[0].role, "user");
  EXPECT_EQ(r.request.messages[0].content, "Hi");
  EXPECT_FALSE(r.request.prompt.has_value());
  EXPECT_EQ(r.request.model, kModel);
  EXPECT_FALSE(r.request.max_tokens.has_value());  // chat: until the context or end of turn
  EXPECT_FALSE(r.request.temperature.has_value());
  EXPECT_FALSE(r.request.top_p.has_value());
  EXPECT_FALSE(r.request.seed.has_value());
  EXPECT_TRUE(r.request.stop.empty());
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.request.stream);
  EXPECT_FALSE(r.include_usage);
  EXPECT_TRUE(r.request.extra.is_null());
}

TEST(ParseRequest, ChatCarriesEverySamplingField) {
  ApiRequest r = chat({{"max_tokens", 32}, {"temperature", 0.5}, {"top_p", 0.9}, {"top_k", 40},
                       {"seed", -7}, {"stop", json::array({"\n\n", "END"})}, {"stream", true},
                       {"stream_options", {{"include_usage", true}}}});
  EXPECT_EQ(r.request.max_tokens, 32);
  EXPECT_EQ(r.request.temperature, 0.5);
  EXPECT_EQ(r.request.top_p, 0.9);
  EXPECT_EQ(r.request.extra, json({{"top_k", 40}}));
  EXPECT_EQ(r.request.seed, -7);
  EXPECT_EQ(r.request.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.request.stream);
  EXPECT_TRUE(r.include_usage);
  // -1 is llama.cpp's "a random seed": no seed.
  EXPECT_FALSE(chat({{"seed", -1}}).request.seed.has_value());
  EXPECT_EQ(chat({{"seed", -2}}).request.seed, -2);
}

TEST(ParseRequest, MessagesKeepTheirOrderAndRoles) {
  json body = chat_body();
  body["messages"] = json::array({{{"role", "system"}, {"content", "Be brief."}},
                                  {{"role", "user"}, {"content", "Hi"}},
                                  {{"role", "assistant"}, {"content", "Hello!"}},
                                  {{"role", "user"}, {"content", "Bye"}}});
  ApiRequest r = parse_request(Endpoint::kChat, body, kModel);
  ASSERT_EQ(r.request.messages.size(), 4u);
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}};
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(r.request.messages[i].role, expected[i].first) << i;
    EXPECT_EQ(r.request.messages[i].content, expected[i].second) << i;
  }
}

TEST(ParseRequest, DeveloperRoleBecomesSystem) {
  json body = chat_body();
  body["messages"] = json::array({{{"role", "developer"}, {"content", "Be brief."}},
                                  {{"role", "user"}, {"content", "Hi"}}});
  ApiRequest r = parse_request(Endpoint::kChat, body, kModel);
  ASSERT_EQ(r.request.messages.size(), 2u);
  EXPECT_EQ(r.request.messages[0].role, "system");
  EXPECT_EQ(r.request.messages[0].content, "Be brief.");
}

// Text parts are joined with a line break between them, as vLLM and llama.cpp's server join them
// ("Describe:" and "the cat" do not run together).
TEST(ParseRequest, ContentAsArrayOfTextPartsIsJoinedByLines) {
  json body = chat_body();
  body["messages"][0]["content"] = json::array({{{"type", "text"}, {"text", "Describe:"}},
                                                {{"type", "text"}, {"text", "the cat"}},
                                                {{"type", "text"}, {"text", ""}}});
  ApiRequest r = parse_request(Endpoint::kChat, body, kModel);
  EXPECT_EQ(r.request.messages[0].content, "Describe:\nthe cat\n");
  body["messages"][0]["content"] = json::array({{{"type", "text"}, {"text", "one"}}});
  EXPECT_EQ(parse_request(Endpoint::kChat, body, kModel).request.messages[0].content, "one");
  // An empty array is refused, as the OpenAI API does (ContentMustBeAStringOrTextParts).
}

TEST(ParseRequest, AssistantMessageMayOmitContent) {
  json body = chat_body();
  body["messages"].push_back({{"role", "assistant"}, {"content", nullptr}});
  body["messages"].push_back({{"role", "assistant"}});
  ApiRequest r = parse_request(Endpoint::kChat, body, kModel);
  ASSERT_EQ(r.request.messages.size(), 3u);
  EXPECT_EQ(r.request.messages[1].content, "");
  EXPECT_EQ(r.request.messages[2].content, "");
}

TEST(ParseRequest, UnknownFieldsAreIgnored) {
  ApiRequest r = chat({{"user", "someone"}, {"metadata", {{"a", 1}}}, {"store", false},
                       {"x_made_up", json::array({1, 2})},
                       {"service_tier", "auto"}});
  EXPECT_EQ(r.request.messages.size(), 1u);
  EXPECT_TRUE(r.request.extra.is_null());
}

TEST(ParseRequest, NullFieldsCountAsAbsent) {
  ApiRequest r = chat({{"max_tokens", nullptr}, {"temperature", nullptr}, {"stop", nullptr},
                       {"n", nullptr}, {"tools", nullptr}, {"stream_options", nullptr}, {"model", nullptr}});
  EXPECT_FALSE(r.request.max_tokens.has_value());
  EXPECT_FALSE(r.request.temperature.has_value());
  EXPECT_EQ(r.request.model, "");
}

TEST(ParseRequest, NeutralValuesOfUnsupportedFieldsAreAccepted) {
  ApiRequest r = chat({{"n", 1}, {"presence_penalty", 0}, {"frequency_penalty", 0.0}, {"logit_bias", json::object()},
                       {"logprobs", false}, {"top_logprobs", 0}, {"tools", json::array()},
                       {"functions", json::array()}, {"response_format", {{"type", "text"}}}});
  EXPECT_EQ(r.request.messages.size(), 1u);
  ApiRequest c = completion({{"echo", false}, {"best_of", 1}, {"suffix", ""}});
  EXPECT_EQ(c.request.prompt, "Once upon a time");
}

// ---- the model -------------------------------------------------------------------------------

TEST(ParseRequest, NoModelIsServed) {
  json body = chat_body();
  body.erase("model");
  ApiRequest r = parse_request(Endpoint::kChat, body, kModel);
  EXPECT_EQ(r.request.model, "");
  body["model"] = "";
  EXPECT_EQ(parse_request(Endpoint::kChat, body, kModel).request.model, "");
}

TEST(ParseRequest, AnotherModelIs404ModelNotFound) {
  ApiError e = chat_error(chat_body({{"model", "gpt-4o"}}));
  EXPECT_EQ(e.status(), 404);
  EXPECT_EQ(e.type(), "invalid_request_error");
  EXPECT_EQ(e.param(), "model");
  EXPECT_EQ(e.code(), "model_not_found");
  EXPECT_EQ(std::string(e.what()), "the model 'gpt-4o' does not exist; this server serves 'tiny-llama'");

  ApiError c = completion_error(completion_body_json({{"model", "Tiny-Llama"}}));  // case matters
  EXPECT_EQ(c.status(), 404);
  EXPECT_EQ(c.code(), "model_not_found");
}

TEST(ParseRequest, ModelMustBeAString) {
  expect_invalid(chat_error(chat_body({{"model", 3}})), "model", "'model' must be a string, not an integer");
}

// ---- messages ----------------------------------------------------------------------------------

TEST(ParseRequest, MessagesAreRequired) {
  json body = chat_body();
  body.erase("messages");
  expect_invalid(chat_error(body), "messages", "'messages' is required");
  body["messages"] = nullptr;
  expect_invalid(chat_error(body), "messages", "'messages' is required");
}

TEST(ParseRequest, MessagesMustNotBeEmpty) {
  expect_invalid(chat_error(chat_body({{"messages", json::array()}})), "messages",
                 "'messages' must not be empty");
}

TEST(ParseRequest, MessagesMustBeAnArray) {
  expect_invalid(chat_error(chat_body({{"messages", "Hi"}})), "messages",
                 "'messages' must be an array, not a string");
  expect_invalid(chat_error(chat_body({{"messages", {{"role", "user"}}}})), "messages",
                 "'messages' must be an array, not an object");
}

TEST(ParseRequest, EachMessageMustBeAnObject) {
  json body = chat_body();
  body["messages"].push_back("Hi again");
  expect_invalid(chat_error(body), "messages[1]", "'messages[1]' must be an object, not a string");
}

TEST(ParseRequest, RoleIsRequiredAndKnown) {
  json body = chat_body();
  body["messages"][0].erase("role");
  expect_invalid(chat_error(body), "messages[0].role", "'messages[0].role' is required and must be a string");
  body["messages"][0]["role"] = 1;
  expect_invalid(chat_error(body), "messages[0].role", "'messages[0].role' is required and must be a string");
  body["messages"][0]["role"] = "wizard";
  expect_invalid(chat_error(body), "messages[0].role",
                 "'messages[0].role' must be one of system, developer, user, assistant, tool, not 'wizard'");
}

const json kCall = {{"id", "call_a"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}};

TEST(ParseRequest, AConversationsCallsAndResultsAreTaken) {
  json body = chat_body();
  body["messages"].push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {kCall}}});
  body["messages"].push_back({{"role", "tool"}, {"tool_call_id", "call_a"}, {"content", "18 C"}});
  const ApiRequest r = parse_request(Endpoint::kChat, body, kModel);
  ASSERT_EQ(r.request.messages.size(), 3u);
  EXPECT_EQ(r.request.messages[1].tool_calls, json::array({kCall}));
  EXPECT_EQ(r.request.messages[2].role, "tool");
  EXPECT_EQ(r.request.messages[2].tool_call_id, "call_a");
  EXPECT_EQ(r.request.messages[2].content, "18 C");
}

TEST(ParseRequest, ToolMessagesAndCallsAreHeldToTheApisForm) {
  json body = chat_body();
  body["messages"].push_back({{"role", "tool"}, {"tool_call_id", "call_z"}, {"content", "42"}});
  expect_invalid(chat_error(body), "messages[1].tool_call_id",
                 "'messages[1].tool_call_id' answers the call 'call_z', which no earlier assistant message made");
  body["messages"][1] = {{"role", "tool"}, {"content", "42"}};
  expect_invalid(chat_error(body), "messages[1].tool_call_id",
                 "'messages[1].tool_call_id': required: the id of the call this tool message answers");
  body["messages"][1] = {{"role", "assistant"}, {"tool_calls", json::array({{{"id", "x"}}})}};
  expect_invalid(chat_error(body), "messages[1].tool_calls[0].function", "'messages[1].tool_calls[0].function': required: {name, arguments}");
  body["messages"][1] = {{"role", "assistant"}, {"content", "x"}, {"function_call", {{"name", "f"}}}};
  expect_unsupported(chat_error(body), "messages[1].function_call",
                     "function calling (give calls as 'tool_calls') is not supported by this server");
  body["messages"][1] = {{"role", "function"}, {"content", "42"}};
  expect_unsupported(chat_error(body), "messages[1].role",
                     "the role 'function' (give results as 'tool' messages) is not supported by this server");
}

TEST(ParseRequest, AnEmptyListOfToolCallsIsNone) {
  // Some clients write [] for an assistant turn that called no tool.
  json body = chat_body();
  body["messages"].push_back({{"role", "assistant"}, {"content", "Hello"}, {"tool_calls", json::array()}});
  body["messages"].push_back({{"role", "user"}, {"content", "And?"}});
  ApiRequest r = parse_request(Endpoint::kChat, body, kModel);
  ASSERT_EQ(r.request.messages.size(), 3u);
  EXPECT_EQ(r.request.messages[1].role, "assistant");
  EXPECT_EQ(r.request.messages[1].content, "Hello");
}

TEST(ParseRequest, ContentIsRequiredExceptForTheAssistant) {
  json body = chat_body();
  body["messages"][0].erase("content");
  expect_invalid(chat_error(body), "messages[0].content", "'messages[0].content' is required");
}

TEST(ParseRequest, ContentMustBeAStringOrTextParts) {
  json body = chat_body();
  body["messages"][0]["content"] = 5;
  expect_invalid(chat_error(body), "messages[0].content",
                 "'messages[0].content' must be a string or an array of text parts, not an integer");

  body["messages"][0]["content"] = json::array();
  expect_invalid(chat_error(body), "messages[0].content",
                 "'messages[0].content' must not be an empty array: give at least one text part, or a string");

  body["messages"][0]["content"] = json::array({"plain"});
  expect_invalid(chat_error(body), "messages[0].content[0]",
                 "'messages[0].content[0]' must be an object, not a string");

  body["messages"][0]["content"] = json::array({{{"text", "x"}}});
  expect_invalid(chat_error(body), "messages[0].content[0].type", "'messages[0].content[0].type' is required");

  body["messages"][0]["content"] = json::array({{{"type", "text"}, {"text", "a"}}, {{"type", "text"}}});
  expect_invalid(chat_error(body), "messages[0].content[1].text", "'messages[0].content[1].text' must be a string");

  body["messages"][0]["content"] =
      json::array({{{"type", "image_url"}, {"image_url", {{"url", "http://x/y.png"}}}}});
  expect_unsupported(chat_error(body), "messages[0].content[0].type",
                     "content of type 'image_url' is not supported by this server");
}

// ---- the prompt (completions) --------------------------------------------------------------

TEST(ParseRequest, CompletionPromptAndDefaults) {
  ApiRequest r = completion();
  EXPECT_EQ(r.endpoint, Endpoint::kCompletions);
  ASSERT_TRUE(r.request.prompt.has_value());
  EXPECT_EQ(*r.request.prompt, "Once upon a time");
  EXPECT_TRUE(r.request.messages.empty());
  EXPECT_EQ(r.request.max_tokens, 16);  // the completions API's default
  EXPECT_EQ(completion({{"max_tokens", 100}}).request.max_tokens, 100);
}

TEST(ParseRequest, CompletionPromptAsOneStringArray) {
  ApiRequest r = completion({{"prompt", json::array({"The sky is"})}});
  EXPECT_EQ(r.request.prompt, "The sky is");
}

TEST(ParseRequest, CompletionPromptErrors) {
  json body = completion_body_json();
  body.erase("prompt");
  expect_invalid(completion_error(body), "prompt", "'prompt' is required");
  expect_unsupported(completion_error(completion_body_json({{"prompt", json::array({"a", "b"})}})), "prompt",
                     "more than one prompt per request is not supported by this server");
  expect_unsupported(completion_error(completion_body_json({{"prompt", json::array({1, 2, 3})}})), "prompt",
                     "a prompt of token ids is not supported by this server");
  expect_unsupported(completion_error(completion_body_json({{"prompt", json::array({7})}})), "prompt",
                     "a prompt of token ids is not supported by this server");
  expect_invalid(completion_error(completion_body_json({{"prompt", 12}})), "prompt",
                 "'prompt' must be a string, not an integer");
  expect_invalid(completion_error(completion_body_json({{"prompt", json::array()}})), "prompt",
                 "'prompt' is an empty array: give a string");
  expect_unsupported(completion_error(completion_body_json({{"prompt", json::array({json::array({504, 3575})})}})),
                     "prompt", "a list of prompts of token ids is not supported by this server");
  expect_invalid(completion_error(completion_body_json({{"prompt", json::array({nullptr})}})), "prompt[0]",
                 "'prompt[0]' must be a string, not null");
}

TEST(ParseRequest, ChatIgnoresPromptAndCompletionsIgnoresMessages) {
  // Each endpoint reads only its own input field; the other is an unknown field.
  ApiRequest r = chat({{"prompt", 5}});
  EXPECT_FALSE(r.request.prompt.has_value());
  ApiRequest c = completion({{"messages", "x"}});
  EXPECT_TRUE(c.request.messages.empty());
}

// ---- max_tokens --------------------------------------------------------------------------------

TEST(ParseRequest, MaxCompletionTokensWinsOverMaxTokens) {
  EXPECT_EQ(chat({{"max_completion_tokens", 7}}).request.max_tokens, 7);
  EXPECT_EQ(chat({{"max_tokens", 9}}).request.max_tokens, 9);
  EXPECT_EQ(chat({{"max_completion_tokens", 7}, {"max_tokens", 9}}).request.max_tokens, 7);
  // A bad max_tokens next to a valid max_completion_tokens is not read.
  EXPECT_EQ(chat({{"max_completion_tokens", 7}, {"max_tokens", "lots"}}).request.max_tokens, 7);
  // max_completion_tokens: null falls back to max_tokens.
  EXPECT_EQ(chat({{"max_completion_tokens", nullptr}, {"max_tokens", 9}}).request.max_tokens, 9);
}

TEST(ParseRequest, MaxCompletionTokensIsAChatField) {
  // The completions endpoint has only max_tokens: a limit under the chat name is refused, not
  // passed over for the default of 16 (null, as everywhere, is as if it were not there).
  for (const json& body : {completion_body_json({{"max_completion_tokens", 5}}),
                           completion_body_json({{"max_completion_tokens", 5}, {"max_tokens", 5}})})
    expect_invalid(completion_error(body), "max_completion_tokens",
                   "'max_completion_tokens' is a chat completions field; the completions API's limit is 'max_tokens'");
  EXPECT_EQ(completion({{"max_completion_tokens", nullptr}}).request.max_tokens, 16);
  EXPECT_EQ(completion({{"max_tokens", 5}}).request.max_tokens, 5);
}

TEST(ParseRequest, MaxTokensRange) {
  expect_invalid(chat_error(chat_body({{"max_tokens", 0}})), "max_tokens",
                 "'max_tokens' must be between 1 and 2147483647, not 0");
  expect_invalid(chat_error(chat_body({{"max_completion_tokens", -3}})), "max_completion_tokens",
                 "'max_completion_tokens' must be between 1 and 2147483647, not -3");
  expect_invalid(chat_error(chat_body({{"max_tokens", 2147483648LL}})), "max_tokens",
                 "'max_tokens' must be between 1 and 2147483647, not 2147483648");
  expect_invalid(chat_error(chat_body({{"max_tokens", std::numeric_limits<std::uint64_t>::max()}})), "max_tokens",
                 "'max_tokens' must be between 1 and 2147483647, not 18446744073709551615");
  expect_invalid(completion_error(completion_body_json({{"max_tokens", 0}})), "max_tokens",
                 "'max_tokens' must be between 1 and 2147483647, not 0");
  EXPECT_EQ(chat({{"max_tokens", 1}}).request.max_tokens, 1);
  EXPECT_EQ(chat({{"max_tokens", 2147483647}}).request.max_tokens, 2147483647);
}

TEST(ParseRequest, MaxTokensType) {
  expect_invalid(chat_error(chat_body({{"max_tokens", "64"}})), "max_tokens",
                 "'max_tokens' must be an integer, not a string (\"64\")");
  expect_invalid(chat_error(chat_body({{"max_tokens", 1.5}})), "max_tokens",
                 "'max_tokens' must be an integer, not a number (1.5)");
  expect_invalid(chat_error(chat_body({{"max_tokens", true}})), "max_tokens",
                 "'max_tokens' must be an integer, not a boolean (true)");
  EXPECT_EQ(chat({{"max_tokens", 64.0}}).request.max_tokens, 64);  // an integral float is fine
}

TEST(ParseRequest, ErrorsShowValuesShortly) {
  // Arrays and objects by their type, long strings cut at a character boundary.
  expect_invalid(chat_error(chat_body({{"max_tokens", json::array({1, 2})}})), "max_tokens",
                 "'max_tokens' must be an integer, not an array");
  expect_invalid(chat_error(chat_body({{"seed", json::object()}})), "seed", "'seed' must be an integer, not an object");
  const std::string long_text = std::string(63, 'x') + "é" + std::string(100, 'y');
  expect_invalid(chat_error(chat_body({{"max_tokens", long_text}})), "max_tokens",
                 "'max_tokens' must be an integer, not a string (\"" + std::string(63, 'x') + "...\")");
  ApiError e = chat_error(chat_body({{"model", long_text}}));
  EXPECT_EQ(std::string(e.what()), "the model '" + std::string(63, 'x') + "...' does not exist; this server serves 'tiny-llama'");
}

// ---- temperature, top_p, top_k, seed, stop -------------------------------------------------

TEST(ParseRequest, TemperatureRange) {
  EXPECT_EQ(chat({{"temperature", 0}}).request.temperature, 0.0);
  EXPECT_EQ(chat({{"temperature", 2}}).request.temperature, 2.0);
  expect_invalid(chat_error(chat_body({{"temperature", -0.1}})), "temperature",
                 "'temperature' must be between 0.0 and 2.0, not -0.1");
  expect_invalid(chat_error(chat_body({{"temperature", 2.5}})), "temperature",
                 "'temperature' must be between 0.0 and 2.0, not 2.5");
  expect_invalid(chat_error(chat_body({{"temperature", "hot"}})), "temperature",
                 "'temperature' must be a number, not a string");
  expect_invalid(completion_error(completion_body_json({{"temperature", 3}})), "temperature",
                 "'temperature' must be between 0.0 and 2.0, not 3");
}

// 0 is taken, as OpenAI takes it: only the likeliest token (LocalBackend makes it greedy).
TEST(ParseRequest, TopPRangeIsZeroToOne) {
  EXPECT_EQ(chat({{"top_p", 1}}).request.top_p, 1.0);
  EXPECT_EQ(chat({{"top_p", 0.01}}).request.top_p, 0.01);
  EXPECT_EQ(chat({{"top_p", 0}}).request.top_p, 0.0);
  expect_invalid(chat_error(chat_body({{"top_p", -0.1}})), "top_p", "'top_p' must be between 0.0 and 1.0, not -0.1");
  expect_invalid(chat_error(chat_body({{"top_p", 1.5}})), "top_p", "'top_p' must be between 0.0 and 1.0, not 1.5");
  expect_invalid(chat_error(chat_body({{"top_p", nullptr}, {"temperature", json::array()}})), "temperature",
                 "'temperature' must be a number, not an array");
}

TEST(ParseRequest, TopKGoesToExtraAndMinusOneMeansNoLimit) {
  EXPECT_EQ(chat({{"top_k", 0}}).request.extra, json({{"top_k", 0}}));
  EXPECT_EQ(chat({{"top_k", -1}}).request.extra, json({{"top_k", 0}}));
  expect_invalid(chat_error(chat_body({{"top_k", -2}})), "top_k",
                 "'top_k' must be between -1 and 2147483647, not -2");
  expect_invalid(chat_error(chat_body({{"top_k", "5"}})), "top_k",
                 "'top_k' must be an integer, not a string (\"5\")");
}

TEST(ParseRequest, SeedIsAnyInteger) {
  EXPECT_EQ(chat({{"seed", std::numeric_limits<std::int64_t>::min()}}).request.seed,
            std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(chat({{"seed", 0}}).request.seed, 0);
  expect_invalid(chat_error(chat_body({{"seed", 0.5}})), "seed", "'seed' must be an integer, not a number (0.5)");
  // Whole numbers past what a double holds exactly: out of range, or to be written in digits.
  expect_invalid(chat_error(chat_body({{"seed", 1.8446744073709552e19}})), "seed",
                 "'seed' must be between -9223372036854775808 and 9223372036854775807, not 1.8446744073709552e+19");
  expect_invalid(chat_error(chat_body({{"max_tokens", 1e20}})), "max_tokens",
                 "'max_tokens' must be between 1 and 2147483647, not 1e+20");
  expect_invalid(chat_error(chat_body({{"seed", 0x1p63}})), "seed",
                 "'seed' must be between -9223372036854775808 and 9223372036854775807, not 9.223372036854776e+18");
  expect_invalid(chat_error(chat_body({{"seed", 1e17}})), "seed",
                 "'seed' must be written as an integer (digits only) when it is this large, not 1e+17");
}

TEST(ParseRequest, StopStringsAndList) {
  EXPECT_EQ(chat({{"stop", "END"}}).request.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(chat({{"stop", ""}}).request.stop.empty());
  EXPECT_EQ(chat({{"stop", json::array({"", "a"})}}).request.stop, std::vector<std::string>{"a"});
  expect_invalid(chat_error(chat_body({{"stop", 1}})), "stop",
                 "'stop' must be a string or an array of strings, not an integer");
  // `param` names the item, as it does for messages.
  expect_invalid(chat_error(chat_body({{"stop", json::array({"a", 2})}})), "stop[1]",
                 "'stop[1]' must be a string, not an integer");
  json many = json::array();
  for (int i = 0; i < 17; ++i) many.push_back(std::string("s") + std::to_string(i));
  expect_invalid(chat_error(chat_body({{"stop", many}})), "stop", "'stop' has 17 strings; at most 16 are allowed");
  many.erase(many.begin());
  EXPECT_EQ(chat({{"stop", many}}).request.stop.size(), 16u);
}

// ---- stream ------------------------------------------------------------------------------------

TEST(ParseRequest, StreamMustBeABoolean) {
  expect_invalid(chat_error(chat_body({{"stream", "yes"}})), "stream", "'stream' must be a boolean, not a string");
  expect_invalid(chat_error(chat_body({{"stream", 1}})), "stream", "'stream' must be a boolean, not an integer");
  ApiRequest r = chat({{"stream", false}});
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.request.stream);
}

TEST(ParseRequest, StreamOptionsWithoutStreamIs400) {
  expect_invalid(chat_error(chat_body({{"stream_options", {{"include_usage", true}}}})), "stream_options",
                 "'stream_options' is only allowed when 'stream' is true");
  expect_invalid(chat_error(chat_body({{"stream", false}, {"stream_options", {{"include_usage", true}}}})),
                 "stream_options", "'stream_options' is only allowed when 'stream' is true");
  expect_invalid(completion_error(completion_body_json({{"stream_options", json::object()}})), "stream_options",
                 "'stream_options' is only allowed when 'stream' is true");
}

TEST(ParseRequest, StreamOptionsShape) {
  expect_invalid(chat_error(chat_body({{"stream", true}, {"stream_options", true}})), "stream_options",
                 "'stream_options' must be an object, not a boolean");
  expect_invalid(chat_error(chat_body({{"stream", true}, {"stream_options", {{"include_usage", "yes"}}}})),
                 "stream_options.include_usage", "'stream_options.include_usage' must be a boolean, not a string");
  ApiRequest r = chat({{"stream", true}, {"stream_options", json::object()}});
  EXPECT_TRUE(r.stream);
  EXPECT_FALSE(r.include_usage);
  EXPECT_FALSE(chat({{"stream", true}, {"stream_options", {{"include_usage", false}}}}).include_usage);
  EXPECT_TRUE(completion({{"stream", true}, {"stream_options", {{"include_usage", true}}}}).include_usage);
}

// ---- unsupported parameters ------------------------------------------------------------------

TEST(ParseRequest, NChoicesFromOneTo128) {
  EXPECT_EQ(chat().n, 1);
  EXPECT_EQ(chat({{"n", 1}}).n, 1);
  EXPECT_EQ(chat({{"n", 3}}).n, 3);
  EXPECT_EQ(completion({{"n", 128}}).n, 128);
  EXPECT_EQ(chat({{"n", 2.0}}).n, 2);
  expect_invalid(chat_error(chat_body({{"n", 0}})), "n", "'n' must be between 1 and 128, not 0");
  expect_invalid(chat_error(chat_body({{"n", 129}})), "n", "'n' must be between 1 and 128, not 129");
  EXPECT_EQ(chat_error(chat_body({{"n", "2"}})).param(), "n");
  EXPECT_EQ(chat_error(chat_body({{"n", 1.5}})).param(), "n");
}

TEST(ParseRequest, LogprobsInEachApisForm) {
  // Chat: logprobs true and top_logprobs N.
  ApiRequest r = chat({{"logprobs", true}, {"top_logprobs", 3}});
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(json(r.request.extra), json({{"logprobs", true}, {"top_logprobs", 3}}));
  r = chat({{"logprobs", true}});
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.request.extra, json({{"logprobs", true}}));
  r = chat({{"logprobs", false}, {"top_logprobs", 0}});
  EXPECT_FALSE(r.logprobs);
  EXPECT_TRUE(r.request.extra.is_null());
  expect_invalid(chat_error(chat_body({{"top_logprobs", 3}})), "top_logprobs", "'top_logprobs' needs 'logprobs': true");
  expect_invalid(chat_error(chat_body({{"logprobs", true}, {"top_logprobs", 21}})), "top_logprobs",
                 "'top_logprobs' must be between 0 and 20, not 21");
  EXPECT_EQ(chat_error(chat_body({{"logprobs", 5}})).param(), "logprobs");
  // Completions: logprobs N.
  ApiRequest c = completion({{"logprobs", 5}});
  EXPECT_TRUE(c.logprobs);
  EXPECT_EQ(c.request.extra, json({{"logprobs", 5}}));
  EXPECT_EQ(completion_error(completion_body_json({{"logprobs", true}})).param(), "logprobs");
  EXPECT_EQ(completion_error(completion_body_json({{"logprobs", 21}})).param(), "logprobs");
  expect_invalid(completion_error(completion_body_json({{"top_logprobs", 2}})), "top_logprobs",
                 "'top_logprobs' is a chat completions parameter; text completions take 'logprobs': N");
}

TEST(ParseRequest, ToolsGoToTheEngineAndWhatItCannotHonourIsRefused) {
  const json tool = {{"type", "function"}, {"function", {{"name", "f"}, {"parameters", json::object()}}}};
  const ApiRequest r = chat({{"tools", json::array({tool})}, {"tool_choice", "auto"}, {"parallel_tool_calls", true}});
  EXPECT_EQ(json(r.request.extra), (json{{"tools", {tool}}, {"tool_choice", "auto"}, {"parallel_tool_calls", true}}));
  expect_invalid(chat_error(chat_body({{"tools", json::array({{{"type", "function"}}})}})), "tools",
                 "'tools': tools[0].function: required: {name, description, parameters}");
  // A forced call: any of the tools, or the one named, which must be there.
  EXPECT_EQ(chat({{"tools", json::array({tool})}, {"tool_choice", "required"}}).request.extra["tool_choice"], "required");
  const json named = {{"type", "function"}, {"function", {{"name", "f"}}}};
  EXPECT_EQ(json(chat({{"tools", json::array({tool})}, {"tool_choice", named}, {"parallel_tool_calls", false}})
                     .request.extra["tool_choice"]),
            named);
  expect_invalid(chat_error(chat_body({{"tools", json::array({tool})}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "g"}}}}}})),
                 "tool_choice", "'tool_choice': names the function \"g\", which is not among the tools");
  expect_invalid(chat_error(chat_body({{"tool_choice", "required"}})), "tool_choice",
                 "'tool_choice': forces a call, but no tools are given");
  expect_invalid(chat_error(chat_body({{"tools", json::array({tool})}, {"tool_choice", "any"}})), "tool_choice",
                 "'tool_choice': expected \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": "
                 "{\"name\": ...}}, not \"any\"");
  expect_unsupported(chat_error(chat_body({{"tools", json::array({tool})}, {"parallel_tool_calls", false}})), "parallel_tool_calls",
                     "'parallel_tool_calls': the embedded engine cannot hold the model to one call where it decides "
                     "(parallel_tool_calls: false with tool_choice \"auto\"); a forced tool_choice (\"required\" or a "
                     "named function) makes one call");
  expect_unsupported(chat_error(chat_body({{"functions", json::array({tool["function"]})}})), "functions",
                     "'functions' (give them as 'tools') is not supported by this server");
  expect_invalid(completion_error(completion_body_json({{"tools", json::array({tool})}})), "tools",
                 "'tools' is a chat completions parameter");
}

TEST(ParseRequest, ReasoningBackAndTheThinkingSwitchGoToTheEngine) {
  const ApiRequest r = chat({{"messages", json::array({{{"role", "user"}, {"content", "2+2?"}},
                                                       {{"role", "assistant"}, {"content", "4"}, {"reasoning_content", "Add."}},
                                                       {{"role", "user"}, {"content", "3+3?"}}})},
                             {"chat_template_kwargs", {{"enable_thinking", false}}}});
  EXPECT_EQ(r.request.messages[1].reasoning, "Add.");
  EXPECT_EQ(r.request.messages[0].reasoning, std::nullopt);
  EXPECT_EQ(json(r.request.extra["chat_template_kwargs"]), (json{{"enable_thinking", false}}));
  expect_invalid(chat_error(chat_body({{"messages", json::array({{{"role", "user"}, {"content", "x"}, {"reasoning_content", "y"}}})}})),
                 "messages[0].reasoning_content",
                 "'messages[0].reasoning_content': only an assistant message has reasoning (this one's role is user)");
  expect_unsupported(chat_error(chat_body({{"chat_template_kwargs", {{"reasoning_effort", "low"}}}})), "chat_template_kwargs",
                     "'chat_template_kwargs': the embedded engine takes only 'enable_thinking' among the template's "
                     "variables, not 'reasoning_effort'");
  // A text completion has no template: ignored, as unknown fields are.
  const ApiRequest text = parse_request(Endpoint::kCompletions,
                                        completion_body_json({{"chat_template_kwargs", {{"reasoning_effort", "low"}}}}), kModel);
  EXPECT_FALSE(text.request.extra.is_object() && text.request.extra.contains("chat_template_kwargs"));
}

TEST(ParseRequest, ToolsKeepTheirKeysInTheOrderTheClientWroteThem) {
  // The engine writes the tools into the prompt as a template would, keys as given.
  const std::string tool =
      R"({"type": "function", "function": {"name": "set", "description": "Set it.", "parameters": )"
      R"({"type": "object", "properties": {"room": {"type": "string"}, "celsius": {"type": "number"}}, "required": ["room"]}}})";
  const ApiRequest r = parse_request_body(
      Endpoint::kChat, R"({"messages": [{"role": "user", "content": "hi"}], "tools": [)" + tool + "]}", kModel);
  EXPECT_EQ(r.request.extra["tools"][0].dump(), nlohmann::ordered_json::parse(tool).dump());
  EXPECT_NE(r.request.extra["tools"][0].dump(), json::parse(tool).dump());  // not sorted
}

TEST(ParseRequest, OutputModalitiesOtherThanTextAreUnsupported) {
  EXPECT_EQ(chat({{"modalities", {"text"}}}).request.messages.size(), 1u);
  EXPECT_EQ(chat({{"modalities", json::array()}, {"audio", nullptr}}).request.messages.size(), 1u);
  expect_unsupported(chat_error(chat_body({{"modalities", {"text", "audio"}}})), "modalities",
                     "the output modality 'audio' is not supported by this server");
  expect_unsupported(chat_error(chat_body({{"audio", {{"voice", "alloy"}, {"format", "wav"}}}})), "audio",
                     "audio output is not supported by this server");
  expect_invalid(chat_error(chat_body({{"modalities", "text"}})), "modalities",
                 "'modalities' must be an array of strings, not a string");
  expect_invalid(chat_error(chat_body({{"modalities", {"text", 1}}})), "modalities",
                 "'modalities[1]' must be a string, not an integer");
  // Not fields of the completions API: unknown there, ignored.
  EXPECT_TRUE(completion({{"modalities", {"audio"}}, {"audio", {{"voice", "alloy"}}}}).request.prompt.has_value());
}

TEST(ParseRequest, PenaltiesGoToTheEngine) {
  ApiRequest r = chat({{"presence_penalty", 0.5}, {"frequency_penalty", -1}});
  EXPECT_EQ(r.request.extra["presence_penalty"], 0.5);
  EXPECT_EQ(r.request.extra["frequency_penalty"], -1.0);
  EXPECT_FALSE(chat({{"presence_penalty", 0}}).request.extra.contains("presence_penalty"));
  EXPECT_EQ(completion({{"frequency_penalty", 2}}).request.extra["frequency_penalty"], 2.0);
  // Out of the API's range is a plain 400.
  expect_invalid(chat_error(chat_body({{"presence_penalty", 3}})), "presence_penalty",
                 "'presence_penalty' must be between -2.0 and 2.0, not 3");
  expect_invalid(chat_error(chat_body({{"frequency_penalty", "no"}})), "frequency_penalty",
                 "'frequency_penalty' must be a number, not a string");
}

// vLLM's and llama.cpp's sampling extensions: ignore_eos, min_p, repetition_penalty, min_tokens and
// stop_token_ids (and bad_words) reach the engine; those it does not have are refused unless they are set to do
// nothing.
TEST(ParseRequest, SamplingExtensionsAreTakenOrRefused) {
  EXPECT_EQ(chat({{"ignore_eos", true}}).request.extra, json({{"ignore_eos", true}}));
  EXPECT_TRUE(chat({{"ignore_eos", false}}).request.extra.is_null());
  EXPECT_EQ(completion({{"ignore_eos", true}}).request.extra["ignore_eos"], true);
  expect_invalid(chat_error(chat_body({{"ignore_eos", 1}})), "ignore_eos", "'ignore_eos' must be a boolean, not an integer");
  EXPECT_EQ(chat({{"min_p", 0.05}}).request.extra, json({{"min_p", 0.05}}));
  EXPECT_TRUE(chat({{"min_p", 0}}).request.extra.is_null());
  expect_invalid(chat_error(chat_body({{"min_p", 1.5}})), "min_p", "'min_p' must be between 0.0 and 1.0, not 1.5");
  EXPECT_EQ(chat({{"min_p", 0}, {"repetition_penalty", 1}, {"min_tokens", 0}, {"typical_p", 1.0},
                  {"stop_token_ids", json::array()}, {"use_beam_search", false}})
                .request.messages.size(),
            1u);
  expect_unsupported(chat_error(chat_body({{"typical_p", 0.9}})), "typical_p", "'typical_p' is not supported by this server");
  EXPECT_EQ(chat({{"repetition_penalty", 1.1}}).request.extra, json({{"repetition_penalty", 1.1}}));
  EXPECT_EQ(completion({{"repetition_penalty", 0.9}}).request.extra["repetition_penalty"], 0.9);
  expect_invalid(chat_error(chat_body({{"repetition_penalty", 0}})), "repetition_penalty",
                 "'repetition_penalty' must be above 0 (1: none), not 0");
  expect_invalid(chat_error(chat_body({{"repetition_penalty", 101}})), "repetition_penalty",
                 "'repetition_penalty' must be between 0.0 and 100.0, not 101");
  EXPECT_EQ(completion({{"min_tokens", 20}}).request.extra, json({{"min_tokens", 20}}));
  EXPECT_EQ(chat({{"min_tokens", 3.0}}).request.extra["min_tokens"], 3);
  expect_invalid(chat_error(chat_body({{"min_tokens", -1}})), "min_tokens",
                 "'min_tokens' must be between 0 and 16777216, not -1");
  expect_invalid(chat_error(chat_body({{"min_tokens", 2.5}})), "min_tokens", "'min_tokens' must be an integer, not a number (2.5)");
  EXPECT_EQ(chat({{"stop_token_ids", {2, 7}}}).request.extra, json({{"stop_token_ids", {2, 7}}}));
  EXPECT_EQ(completion({{"stop_token_ids", {0}}}).request.extra["stop_token_ids"], json({0}));
  expect_invalid(chat_error(chat_body({{"stop_token_ids", 2}})), "stop_token_ids",
                 "'stop_token_ids' must be an array of token ids, not an integer");
  expect_invalid(chat_error(chat_body({{"stop_token_ids", {3, -2}}})), "stop_token_ids",
                 "'stop_token_ids' [1] is not a token id (a whole number from 0): -2");
  EXPECT_EQ(chat({{"bad_words", {"darn"}}}).request.extra, json({{"bad_words", {"darn"}}}));
  EXPECT_TRUE(chat({{"bad_words", json::array()}}).request.extra.is_null());
  expect_invalid(chat_error(chat_body({{"bad_words", "darn"}})), "bad_words",
                 "'bad_words' must be an array of strings, not a string");
  expect_invalid(chat_error(chat_body({{"bad_words", {""}}})), "bad_words",
                 "'bad_words' [0] is not a word (a string with more than whitespace): \"\"");
  expect_unsupported(chat_error(chat_body({{"use_beam_search", true}})), "use_beam_search",
                     "beam search is not supported by this server");
}

TEST(ParseRequest, LogitBiasIsPassedToTheEngine) {
  ApiRequest r = chat({{"logit_bias", {{"50256", -100}, {"7", 2.5}}}});
  EXPECT_EQ(r.request.extra, json({{"logit_bias", {{"50256", -100}, {"7", 2.5}}}}));
  expect_invalid(chat_error(chat_body({{"logit_bias", json::array()}})), "logit_bias",
                 "'logit_bias' must be an object, not an array");
  expect_invalid(chat_error(chat_body({{"logit_bias", {{"token", 1}}}})), "logit_bias",
                 "'logit_bias' the key 'token' is not a token id (a whole number written as a string, like \"1234\")");
  expect_invalid(completion_error(completion_body_json({{"logit_bias", {{"3", -101}}}})), "logit_bias",
                 "'logit_bias' the bias of token 3 must be a number from -100 to 100, not -101");
}

TEST(ParseRequest, ResponseFormatIsTextJsonModeOrASchema) {
  EXPECT_EQ(chat({{"response_format", {{"type", "json_object"}}}}).request.extra,
            json({{"response_format", {{"type", "json_object"}}}}));
  EXPECT_TRUE(chat({{"response_format", {{"type", "text"}}}}).request.extra.is_null());
  EXPECT_EQ(completion({{"response_format", {{"type", "json_object"}}}}).request.extra["response_format"]["type"],
            "json_object");
  // A schema the engine can follow reaches it; one it cannot is a 400 that says where.
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "string"}}}}}, {"required", {"a"}}};
  EXPECT_EQ(json(chat({{"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", schema}, {"strict", true}}}}}})
                    .request.extra),
            json({{"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", schema}}}}}}));
  expect_invalid(chat_error(chat_body({{"response_format", {{"type", "json_schema"}, {"json_schema", json::object()}}}})),
                 "response_format",
                 "'response_format' of type json_schema needs 'json_schema': {'name': ..., 'schema': {...}}");
  expect_invalid(
      chat_error(chat_body({{"response_format",
                             {{"type", "json_schema"},
                              {"json_schema", {{"name", "x"}, {"schema", {{"type", "object"}, {"allOf", json::array()}}}}}}}})),
      "response_format",
      "'response_format.json_schema.schema' at /allOf: 'allOf' is not supported by the embedded engine's structured "
      "outputs (it follows type, enum, const, properties, required, additionalProperties, items, minItems, maxItems, "
      "minLength, maxLength, anyOf, oneOf and $ref)");
  expect_unsupported(chat_error(chat_body({{"response_format", {{"type", "grammar"}}}})), "response_format",
                     "response_format 'grammar' is not supported by this server");
  expect_invalid(chat_error(chat_body({{"response_format", "json"}})), "response_format",
                 "'response_format' must be an object with a 'type'");
  expect_invalid(chat_error(chat_body({{"response_format", json::object()}})), "response_format",
                 "'response_format' must be an object with a 'type'");
}

TEST(ParseRequest, CompletionOnlyUnsupportedFields) {
  expect_unsupported(completion_error(completion_body_json({{"echo", true}})), "echo",
                     "'echo' is not supported by this server");
  expect_invalid(completion_error(completion_body_json({{"echo", "yes"}})), "echo",
                 "'echo' must be a boolean, not a string");
  expect_unsupported(completion_error(completion_body_json({{"best_of", 3}})), "best_of",
                     "best_of > 1 is not supported by this server");
  expect_invalid(completion_error(completion_body_json({{"best_of", 0}})), "best_of",
                 "'best_of' must be between 1 and 128, not 0");
  expect_unsupported(completion_error(completion_body_json({{"suffix", "the end"}})), "suffix",
                     "'suffix' is not supported by this server");
  // On the chat endpoint these are unknown fields, ignored.
  EXPECT_EQ(chat({{"echo", true}, {"best_of", 3}, {"suffix", "x"}}).request.messages.size(), 1u);
}

// ---- the raw body ------------------------------------------------------------------------------

TEST(ParseRequestBody, ValidJsonIsParsed) {
  ApiRequest r = parse_request_body(Endpoint::kChat,
                                    R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})", kModel);
  EXPECT_EQ(r.request.messages.at(0).content, "Hi");
  EXPECT_EQ(r.request.max_tokens, 3);
  ApiRequest c = parse_request_body(Endpoint::kCompletions, R"({"prompt": "x"})", kModel);
  EXPECT_EQ(c.request.prompt, "x");
  EXPECT_EQ(c.request.max_tokens, 16);
}

TEST(ParseRequestBody, InvalidJsonIs400WithThePosition) {
  ApiError e = error_of([] { parse_request_body(Endpoint::kChat, R"({"messages": [})", kModel); });
  expect_invalid(e, "", "the request body is not valid JSON (at byte 15: unexpected '}'; expected '[', '{', or a literal)");
  EXPECT_EQ(e.body()["error"]["param"], nullptr);

  expect_invalid(error_of([] { parse_request_body(Endpoint::kChat, "", kModel); }), "",
                 "the request body is not valid JSON (at byte 1: unexpected end of input; expected '[', '{', or a "
                 "literal)");
  expect_invalid(error_of([] { parse_request_body(Endpoint::kChat, "{\"prompt\": \"\xff\"}", kModel); }), "",
                 "the request body is not valid JSON (at byte 13: invalid string: ill-formed UTF-8 byte)");
}

// Found by fuzzing (tests/fuzz/corpus/server_request): a number beyond a double escaped as
// nlohmann's out_of_range, and the connection closed without an answer.
TEST(ParseRequestBody, NumberOutOfRangeIs400WithThePosition) {
  expect_invalid(error_of([] { parse_request_body(Endpoint::kChat, "1e999", kModel); }), "",
                 "the request body has a number out of range, 1e999 (at byte 5)");
  expect_invalid(error_of([] { parse_request_body(Endpoint::kChat, R"({"max_tokens": -2e400})", kModel); }), "",
                 "the request body has a number out of range, -2e400 (at byte 21)");
}

TEST(ParseRequestBody, DeepNestingIs400) {
  // 100,000 levels (200 KB) overflowed the stack of the dump in the error message.
  const std::string deep = R"({"max_tokens": )" + std::string(100'000, '[') + std::string(100'000, ']') + "}";
  expect_invalid(error_of([&] { parse_request_body(Endpoint::kChat, deep, kModel); }), "",
                 "the request body nests arrays and objects more than 64 deep");
  // 64 levels are fine.
  const std::string ok = R"({"messages": [{"role": "user", "content": "x"}], "metadata": )" +
                         std::string(63, '[') + std::string(63, ']') + "}";
  EXPECT_EQ(parse_request_body(Endpoint::kChat, ok, kModel).request.messages.size(), 1u);
}

TEST(ParseRequestBody, BodyMustBeAnObject) {
  expect_invalid(error_of([] { parse_request_body(Endpoint::kChat, "[1, 2]", kModel); }), "",
                 "the request body must be a JSON object, not an array");
  expect_invalid(error_of([] { parse_request_body(Endpoint::kCompletions, "\"hi\"", kModel); }), "",
                 "the request body must be a JSON object, not a string");
  expect_invalid(error_of([] { parse_request_body(Endpoint::kChat, "null", kModel); }), "",
                 "the request body must be a JSON object, not null");
}

TEST(ParseRequestBody, ErrorsAreCheckedInBodyOrder) {
  // The model is checked before the messages: a wrong model and no messages is a 404.
  ApiError e = error_of([] { parse_request_body(Endpoint::kChat, R"({"model": "other"})", kModel); });
  EXPECT_EQ(e.status(), 404);
  EXPECT_EQ(e.code(), "model_not_found");
}

// ---- errors as JSON ------------------------------------------------------------------------------

TEST(ApiErrorBody, NamesEveryField) {
  ApiError e(400, "invalid_request_error", "temperature", "too hot", "bad_value");
  EXPECT_EQ(e.body(), json::parse(R"({"error": {"message": "too hot", "type": "invalid_request_error",
                                     "param": "temperature", "code": "bad_value"}})"));
  ApiError bare(500, "server_error", "", "boom");
  EXPECT_EQ(bare.body(), json::parse(R"({"error": {"message": "boom", "type": "server_error",
                                        "param": null, "code": null}})"));
}

ApiError engine_error(const std::string& code, const std::string& message, Endpoint endpoint = Endpoint::kChat) {
  return error_from_outcome(Error{ErrorKind::Http, 400, code, message, std::nullopt, false}, endpoint);
}

TEST(ErrorFromOutcome, EngineClientErrorsKeepStatusAndCode) {
  ApiError e = engine_error("context_length_exceeded", "the prompt has 5000 tokens; the context holds 4096");
  EXPECT_EQ(e.status(), 400);
  EXPECT_EQ(e.type(), "invalid_request_error");
  EXPECT_EQ(e.code(), "context_length_exceeded");
  EXPECT_EQ(std::string(e.what()), "the prompt has 5000 tokens; the context holds 4096");
}

TEST(ErrorFromOutcome, EngineErrorsNameTheField) {
  // A prompt too long for the context is the messages' or the prompt's fault, as OpenAI says.
  EXPECT_EQ(engine_error("context_length_exceeded", "the prompt has 5000 tokens; the context holds 4096").param(),
            "messages");
  EXPECT_EQ(engine_error("context_length_exceeded", "the prompt has 5000 tokens; the context holds 4096",
                         Endpoint::kCompletions)
                .param(),
            "prompt");
  // A max_tokens the context cannot hold: under the name the client gave it.
  const Error past{ErrorKind::Http, 400, "context_length_exceeded", "'max_tokens': the context holds 64 tokens",
                   std::nullopt, false};
  EXPECT_EQ(error_from_outcome(past, Endpoint::kChat).param(), "max_tokens");
  EXPECT_EQ(error_from_outcome(past, Endpoint::kChat, "max_completion_tokens").param(), "max_completion_tokens");
  EXPECT_STREQ(error_from_outcome(past, Endpoint::kChat, "max_completion_tokens").what(),
               "'max_completion_tokens': the context holds 64 tokens");
  EXPECT_STREQ(error_from_outcome(past, Endpoint::kChat).what(), "'max_tokens': the context holds 64 tokens");
  EXPECT_EQ(error_from_outcome(past, Endpoint::kChat).code(), "context_length_exceeded");
  // The limit is the client's to honour only where the client gave one.
  EXPECT_TRUE(parse_request(Endpoint::kChat, json{{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
                                                  {"max_completion_tokens", 5}},
                            "m")
                  .request.max_tokens_exact);
  EXPECT_EQ(parse_request(Endpoint::kChat, json{{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
                                                {"max_completion_tokens", 5}},
                          "m")
                .max_tokens_param,
            "max_completion_tokens");
  EXPECT_FALSE(parse_request(Endpoint::kChat, json{{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}},
                             "m")
                   .request.max_tokens_exact);
  EXPECT_FALSE(parse_request(Endpoint::kCompletions, json{{"prompt", "hi"}}, "m").request.max_tokens_exact);  // 16 by default
  // A value the engine refuses: the field its message names, and no code, as for the server's
  // own checks.
  expect_invalid(engine_error("invalid_request", "'logit_bias': token 99999999 is outside the vocabulary of 49152"),
                 "logit_bias", "'logit_bias': token 99999999 is outside the vocabulary of 49152");
  expect_invalid(engine_error("invalid_request", "the prompt is empty", Endpoint::kCompletions), "prompt",
                 "the prompt is empty");
  // A field the engine cannot honour keeps its code.
  expect_unsupported(engine_error("unsupported_parameter",
                                  "'presence_penalty', 'frequency_penalty': penalties are applied on the CPU only"),
                     "presence_penalty",
                     "'presence_penalty', 'frequency_penalty': penalties are applied on the CPU only");
  // A quoted word that is no field name is not taken for one.
  EXPECT_EQ(engine_error("unsupported_parameter", "'the model' cannot do that").param(), "");
  // The chat template's checks name a path before a colon.
  EXPECT_EQ(engine_error("invalid_request", "tools: this model's chat template (chatml) does not list tools").param(),
            "tools");
  EXPECT_EQ(engine_error("invalid_request", "messages[1].tool_calls: this model's chat template does not show calls")
                .param(),
            "messages[1].tool_calls");
  // Only a request's own fields, written plainly.
  EXPECT_EQ(engine_error("invalid_request", "note: the model is small").param(), "messages");
  EXPECT_EQ(engine_error("invalid_request", "tools of the Model: none").param(), "messages");
}

// A NUL in a request's text (a model name) stays in the message, escaped by the JSON writer.
TEST(ApiErrorBody, KeepsTheWholeMessage) {
  const ApiError e(404, "invalid_request_error", "model", std::string("the model 'gp\0t' does not exist", 31),
                   "model_not_found");
  EXPECT_EQ(e.message().size(), 31u);
  EXPECT_EQ(e.body()["error"]["message"].get<std::string>(), e.message());
  EXPECT_NE(e.body().dump().find("gp\\u0000t"), std::string::npos) << e.body().dump();
}

TEST(ErrorFromOutcome, AnythingElseIs500) {
  ApiError internal =
      error_from_outcome(Error{ErrorKind::Internal, 0, "", "out of memory", std::nullopt, std::nullopt}, Endpoint::kChat);
  EXPECT_EQ(internal.status(), 500);
  EXPECT_EQ(internal.type(), "server_error");
  EXPECT_EQ(internal.param(), "");
  EXPECT_EQ(std::string(internal.what()), "the engine failed: out of memory");
  ApiError http500 =
      error_from_outcome(Error{ErrorKind::Http, 503, "overloaded", "busy", std::nullopt, std::nullopt}, Endpoint::kChat);
  EXPECT_EQ(http500.status(), 500);
  EXPECT_EQ(http500.code(), "overloaded");
}

// ---- responses ---------------------------------------------------------------------------------

ResponseContext chat_ctx() { return ResponseContext{Endpoint::kChat, "chatcmpl-abc", 1700000000, kModel}; }
ResponseContext text_ctx() { return ResponseContext{Endpoint::kCompletions, "cmpl-xyz", 1700000001, kModel}; }

Completion sample_completion() {
  Completion c;
  c.text = "Hello there";
  c.finish_reason = "stop";
  c.usage.prompt_tokens = 12;
  c.usage.completion_tokens = 3;
  c.usage.reported = true;
  return c;
}

TEST(ResponseId, HasThePrefixAnd24HexDigits) {
  const std::regex chat_re("chatcmpl-[0-9a-f]{24}"), text_re("cmpl-[0-9a-f]{24}");
  std::set<std::string> ids;
  for (int i = 0; i < 50; ++i) {
    std::string a = new_response_id(Endpoint::kChat);
    std::string b = new_response_id(Endpoint::kCompletions);
    EXPECT_TRUE(std::regex_match(a, chat_re)) << a;
    EXPECT_TRUE(std::regex_match(b, text_re)) << b;
    ids.insert(a);
    ids.insert(b);
  }
  EXPECT_EQ(ids.size(), 100u);
}

TEST(Usage, TotalIsTheSum) {
  Usage u;
  u.prompt_tokens = 10;
  u.completion_tokens = 5;
  EXPECT_EQ(usage_json(u), json({{"prompt_tokens", 10}, {"completion_tokens", 5}, {"total_tokens", 15}}));
}

TEST(CompletionBody, ChatShape) {
  json body = completion_body(chat_ctx(), sample_completion());
  EXPECT_EQ(body, json::parse(R"({
    "id": "chatcmpl-abc", "object": "chat.completion", "created": 1700000000, "model": "tiny-llama",
    "choices": [{"index": 0, "finish_reason": "stop", "logprobs": null,
                 "message": {"role": "assistant", "content": "Hello there"}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}})"))
      << body.dump();
}

TEST(CompletionBody, TextCompletionShape) {
  Completion c = sample_completion();
  c.finish_reason = "length";
  json body = completion_body(text_ctx(), c);
  EXPECT_EQ(body, json::parse(R"({
    "id": "cmpl-xyz", "object": "text_completion", "created": 1700000001, "model": "tiny-llama",
    "choices": [{"index": 0, "finish_reason": "length", "logprobs": null, "text": "Hello there"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}})"))
      << body.dump();
}

TEST(CompletionBody, SeveralChoicesAreIndexedInOrderAndTheUsageCountsThePromptOnce) {
  Completion a = sample_completion();
  Completion b = sample_completion();
  b.text = "Hi";
  b.finish_reason = "length";
  b.usage.completion_tokens = 7;
  const std::vector<Completion> choices = {a, b};
  json body = completion_body(chat_ctx(), choices);
  EXPECT_EQ(body, json::parse(R"({
    "id": "chatcmpl-abc", "object": "chat.completion", "created": 1700000000, "model": "tiny-llama",
    "choices": [{"index": 0, "finish_reason": "stop", "logprobs": null,
                 "message": {"role": "assistant", "content": "Hello there"}},
                {"index": 1, "finish_reason": "length", "logprobs": null,
                 "message": {"role": "assistant", "content": "Hi"}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22}})"))
      << body.dump();
  json text = completion_body(text_ctx(), choices);
  EXPECT_EQ(text["choices"][1], json::parse(R"({"index": 1, "finish_reason": "length", "logprobs": null, "text": "Hi"})"));
  EXPECT_EQ(total_usage(choices).completion_tokens, 10);
  EXPECT_EQ(total_usage(choices).prompt_tokens, 12);
  EXPECT_EQ(total_usage({}).prompt_tokens, 0);
}

TEST(CompletionBody, EmptyFinishReasonIsNull) {
  Completion c = sample_completion();
  c.finish_reason.clear();
  EXPECT_TRUE(completion_body(chat_ctx(), c)["choices"][0]["finish_reason"].is_null());
}

TEST(StreamChunks, FirstChatChunkCarriesTheRole) {
  json first = text_chunk(chat_ctx(), "Hel", true, false);
  EXPECT_EQ(first, json::parse(R"({
    "id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1700000000, "model": "tiny-llama",
    "choices": [{"index": 0, "finish_reason": null, "logprobs": null,
                 "delta": {"role": "assistant", "content": "Hel"}}]})"))
      << first.dump();
  json later = text_chunk(chat_ctx(), "lo", false, false);
  EXPECT_EQ(later["choices"][0]["delta"], json({{"content", "lo"}})) << later.dump();
  EXPECT_FALSE(later["choices"][0]["delta"].contains("role"));
  EXPECT_TRUE(later["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(later.contains("usage"));
}

TEST(StreamChunks, TextChunksCarryNullUsageWhenUsageIsRequested) {
  json chunk = text_chunk(chat_ctx(), "x", false, true);
  ASSERT_TRUE(chunk.contains("usage"));
  EXPECT_TRUE(chunk["usage"].is_null());
  json fin = finish_chunk(chat_ctx(), "stop", true);
  ASSERT_TRUE(fin.contains("usage"));
  EXPECT_TRUE(fin["usage"].is_null());
  EXPECT_FALSE(finish_chunk(chat_ctx(), "stop", false).contains("usage"));
}

TEST(StreamChunks, CompletionTextChunkShape) {
  json chunk = text_chunk(text_ctx(), " upon", true, false);
  EXPECT_EQ(chunk, json::parse(R"({
    "id": "cmpl-xyz", "object": "text_completion", "created": 1700000001, "model": "tiny-llama",
    "choices": [{"index": 0, "finish_reason": null, "logprobs": null, "text": " upon"}]})"))
      << chunk.dump();
}

TEST(StreamChunks, FinishChunkHasAnEmptyDeltaAndTheReason) {
  json chat_fin = finish_chunk(chat_ctx(), "length", false);
  EXPECT_EQ(chat_fin, json::parse(R"({
    "id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1700000000, "model": "tiny-llama",
    "choices": [{"index": 0, "finish_reason": "length", "logprobs": null, "delta": {}}]})"))
      << chat_fin.dump();
  json text_fin = finish_chunk(text_ctx(), "stop", false);
  EXPECT_EQ(text_fin["object"], "text_completion");
  EXPECT_EQ(text_fin["choices"][0]["text"], "");
  EXPECT_EQ(text_fin["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(finish_chunk(chat_ctx(), "", false)["choices"][0]["finish_reason"].is_null());
}

TEST(StreamChunks, ChunksNameTheirChoice) {
  EXPECT_EQ(text_chunk(chat_ctx(), "a", true, false, 2)["choices"][0]["index"], 2);
  EXPECT_EQ(text_chunk(chat_ctx(), "a", true, false, 2)["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(text_chunk(text_ctx(), "a", false, false, 5)["choices"][0]["index"], 5);
  EXPECT_EQ(finish_chunk(chat_ctx(), "stop", false, 3)["choices"][0]["index"], 3);
  EXPECT_EQ(finish_chunk(text_ctx(), "length", true, 1)["choices"][0]["index"], 1);
}

TEST(StreamChunks, UsageChunkHasNoChoices) {
  Usage u;
  u.prompt_tokens = 20;
  u.completion_tokens = 4;
  json chunk = usage_chunk(chat_ctx(), u);
  EXPECT_EQ(chunk, json::parse(R"({
    "id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1700000000, "model": "tiny-llama",
    "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24}})"))
      << chunk.dump();
  EXPECT_EQ(usage_chunk(text_ctx(), u)["object"], "text_completion");
  EXPECT_TRUE(usage_chunk(text_ctx(), u)["choices"].is_array());
  EXPECT_TRUE(usage_chunk(text_ctx(), u)["choices"].empty());
}


// ---- log-probabilities -------------------------------------------------------------------------

std::vector<TokenLogprob> sample_logprobs() {
  // "Hé" then "llo": the second token starts with a byte that continues no character.
  return {TokenLogprob{"H\xC3", -0.25, {{"H\xC3", -0.25}, {"J", -2.0}}},
          TokenLogprob{"\xA9llo", -0.5, {{"\xA9llo", -0.5}}}};
}

TEST(Logprobs, ChatChoicesCarryContentWithBytes) {
  Completion c = sample_completion();
  c.text = "H\xC3\xA9llo";
  c.logprobs = sample_logprobs();
  const json body = completion_body(chat_ctx(), c);
  const json& lp = body["choices"][0]["logprobs"];
  ASSERT_TRUE(lp.contains("content")) << body.dump();
  ASSERT_EQ(lp["content"].size(), 2u);
  EXPECT_EQ(lp["content"][0]["token"], "H\\xc3");
  EXPECT_EQ(lp["content"][0]["bytes"], json({72, 195}));
  EXPECT_EQ(lp["content"][0]["logprob"], -0.25);
  EXPECT_EQ(lp["content"][0]["top_logprobs"][1], json({{"token", "J"}, {"logprob", -2.0}, {"bytes", {74}}}));
  EXPECT_EQ(lp["content"][1]["token"], "\\xa9llo");
  // Not asked for: null.
  EXPECT_TRUE(completion_body(chat_ctx(), sample_completion())["choices"][0]["logprobs"].is_null());
}

TEST(Logprobs, TextCompletionChoicesCarryTokensAndCharacterOffsets) {
  Completion c = sample_completion();
  c.logprobs = sample_logprobs();
  const json lp = completion_body(text_ctx(), c)["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({"H\\xc3", "\\xa9llo"}));
  EXPECT_EQ(lp["token_logprobs"], json({-0.25, -0.5}));
  EXPECT_EQ(lp["top_logprobs"][0], json({{"H\\xc3", -0.25}, {"J", -2.0}}));
  // The chosen token is listed even with no alternatives asked for.
  EXPECT_EQ(lp["top_logprobs"][1], json({{"\\xa9llo", -0.5}}));
  // "H" and "é" are two characters; the second token's first byte belongs to "é".
  EXPECT_EQ(lp["text_offset"], json({0, 2}));
  // Counted from the start of the prompt, as OpenAI does.
  ResponseContext ctx = text_ctx();
  ctx.prompt_chars = utf8_chars("Caf\xC3\xA9: ");
  EXPECT_EQ(ctx.prompt_chars, 6);
  EXPECT_EQ(completion_body(ctx, c)["choices"][0]["logprobs"]["text_offset"], json({6, 8}));
}

TEST(Logprobs, StreamChunksCarryTheirTokensAndOffsetsRunOn) {
  const std::vector<TokenLogprob> all = sample_logprobs();
  std::int64_t offset = 0;
  const json first = choice_logprobs(Endpoint::kCompletions, std::span(all).first(1), offset);
  const json second = choice_logprobs(Endpoint::kCompletions, std::span(all).subspan(1), offset);
  EXPECT_EQ(first["text_offset"], json({0}));
  EXPECT_EQ(second["text_offset"], json({2}));
  EXPECT_EQ(offset, 5);
  const json chunk = text_chunk(chat_ctx(), "Hi", true, false, 0, choice_logprobs(Endpoint::kChat, all, offset));
  EXPECT_EQ(chunk["choices"][0]["logprobs"]["content"].size(), 2u);
  EXPECT_TRUE(text_chunk(chat_ctx(), "Hi", true, false)["choices"][0]["logprobs"].is_null());
}

}  // namespace
TEST(CompletionBody, ToolCallsGoInTheMessageAndInOneStreamChunk) {
  Completion c;
  c.finish_reason = "tool_calls";
  c.tool_calls = json::array({kCall});
  json body = completion_body(chat_ctx(), c);
  EXPECT_EQ(body["choices"][0]["message"], (json{{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {kCall}}}));
  EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
  c.text = "Checking.";
  EXPECT_EQ(completion_body(chat_ctx(), c)["choices"][0]["message"]["content"], "Checking.");

  json chunk = tool_calls_chunk(chat_ctx(), json::array({kCall, kCall}), true, false, 0);
  const json& delta = chunk["choices"][0]["delta"];
  EXPECT_EQ(delta["role"], "assistant");
  EXPECT_TRUE(delta["content"].is_null());
  ASSERT_EQ(delta["tool_calls"].size(), 2u);
  json first = kCall;
  first["index"] = 0;
  EXPECT_EQ(delta["tool_calls"][0], first);
  EXPECT_EQ(delta["tool_calls"][1]["index"], 1);
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(tool_calls_chunk(chat_ctx(), json::array({kCall}), false, false, 0)["choices"][0]["delta"].contains("role"));
}

TEST(CompletionBody, ReasoningGoesApartFromTheContent) {
  Completion c;
  c.finish_reason = "stop";
  c.text = "4";
  c.reasoning = "Add them.";
  EXPECT_EQ(completion_body(chat_ctx(), c)["choices"][0]["message"],
            (json{{"role", "assistant"}, {"content", "4"}, {"reasoning_content", "Add them."}}));
  c.reasoning.clear();
  EXPECT_FALSE(completion_body(chat_ctx(), c)["choices"][0]["message"].contains("reasoning_content"));
  const json chunk = text_chunk(chat_ctx(), "Add", true, false, 0, nullptr, TextPart::kReasoning);
  EXPECT_EQ(chunk["choices"][0]["delta"], (json{{"role", "assistant"}, {"reasoning_content", "Add"}}));
}

}  // namespace batchlm::server
