// A chat message's tool-calling fields read from JSON, held to the API's form, and the tool
// fields the embedded engine takes.

#include <gtest/gtest.h>

#include "batchlm/core/engine_fields.hpp"
#include "batchlm/core/types.hpp"

namespace batchlm {
namespace {

using nlohmann::json;

const json kCall = {{"id", "call_a"},
                    {"type", "function"},
                    {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}};

std::optional<std::pair<std::string, std::string>> read(const std::string& role, const json& m, ChatMessage* out = nullptr) {
  ChatMessage message{role, ""};
  auto problem = read_tool_fields(m, message);
  if (out) *out = message;
  return problem;
}

TEST(ReadToolFields, TakesAnAssistantsCallsAndAToolsIdAndName) {
  ChatMessage assistant;
  EXPECT_EQ(read("assistant", {{"tool_calls", {kCall}}}, &assistant), std::nullopt);
  EXPECT_TRUE(assistant.calls_tools());
  EXPECT_EQ(assistant.tool_calls, json::array({kCall}));

  ChatMessage tool;
  EXPECT_EQ(read("tool", {{"tool_call_id", "call_a"}, {"name", "get_weather"}}, &tool), std::nullopt);
  EXPECT_EQ(tool.tool_call_id, "call_a");
  EXPECT_EQ(tool.name, "get_weather");
  EXPECT_FALSE(tool.calls_tools());

  // Absent, null or an empty list: no calls.
  for (const json& m : {json::object(), json{{"tool_calls", nullptr}}, json{{"tool_calls", json::array()}}}) {
    ChatMessage plain;
    EXPECT_EQ(read("assistant", m, &plain), std::nullopt) << m.dump();
    EXPECT_FALSE(plain.calls_tools());
  }
  // A call may leave its type out (the API's only type is assumed).
  json untyped = kCall;
  untyped.erase("type");
  EXPECT_EQ(read("assistant", {{"tool_calls", {untyped}}}), std::nullopt);
}

TEST(ReadToolFields, TakesAnAssistantsReasoningGivenApart) {
  ChatMessage assistant;
  EXPECT_EQ(read("assistant", {{"reasoning_content", "Add them."}}, &assistant), std::nullopt);
  EXPECT_EQ(assistant.reasoning, "Add them.");
  // Given empty is given (a template then writes an empty block); null or absent is not given.
  EXPECT_EQ(read("assistant", {{"reasoning_content", ""}}, &assistant), std::nullopt);
  EXPECT_EQ(assistant.reasoning, "");
  EXPECT_EQ(read("assistant", {{"reasoning_content", nullptr}}, &assistant), std::nullopt);
  EXPECT_EQ(assistant.reasoning, std::nullopt);

  const auto p = read("user", {{"reasoning_content", "x"}});
  ASSERT_TRUE(p);
  EXPECT_EQ(p->first, ".reasoning_content");
  EXPECT_EQ(p->second, "only an assistant message has reasoning (this one's role is user)");
  const auto q = read("assistant", {{"reasoning_content", 3}});
  ASSERT_TRUE(q);
  EXPECT_EQ(q->first + ": " + q->second, ".reasoning_content: expected a string, got number");
}

TEST(ReadToolFields, NamesTheFieldAndWhatIsWrong) {
  const auto problem = [](const std::string& role, const json& m) {
    auto p = read(role, m);
    return p ? p->first + ": " + p->second : std::string("none");
  };
  const auto with = [](const char* key, json value) {
    json call = kCall;
    if (std::string(key).starts_with("function.")) {
      call["function"][std::string(key).substr(9)] = std::move(value);
    } else {
      call[key] = std::move(value);
    }
    return json{{"tool_calls", {call}}};
  };
  EXPECT_EQ(problem("user", {{"tool_calls", {kCall}}}),
            ".tool_calls: only an assistant message calls tools (this one's role is user)");
  EXPECT_EQ(problem("assistant", {{"tool_calls", kCall}}),
            ".tool_calls: expected a list of {id, type, function}, got object");
  EXPECT_EQ(problem("assistant", {{"tool_calls", {"get_weather"}}}),
            ".tool_calls[0]: expected {id, type, function}, got string");
  EXPECT_EQ(problem("assistant", with("id", "")),
            ".tool_calls[0].id: required: a non-empty string (the id a tool message answers with tool_call_id)");
  EXPECT_EQ(problem("assistant", with("type", "code_interpreter")),
            ".tool_calls[0].type: expected \"function\", got \"code_interpreter\"");
  EXPECT_EQ(problem("assistant", with("function", "get_weather")), ".tool_calls[0].function: required: {name, arguments}");
  EXPECT_EQ(problem("assistant", with("function.name", 3)), ".tool_calls[0].function.name: required: a non-empty string");
  EXPECT_EQ(problem("assistant", with("function.arguments", {{"city", "Paris"}})),
            ".tool_calls[0].function.arguments: required: a string, the arguments as JSON text (e.g. "
            "'{\"city\": \"Paris\"}'), not object");
  EXPECT_EQ(problem("user", {{"tool_call_id", "call_a"}}),
            ".tool_call_id: only a tool message answers a call (this one's role is user)");
  EXPECT_EQ(problem("tool", {{"tool_call_id", 7}}), ".tool_call_id: expected a string, got number");
  EXPECT_EQ(problem("tool", json::object()), ".tool_call_id: required: the id of the call this tool message answers");
  EXPECT_TRUE(problem("assistant", {{"function_call", {{"name", "f"}, {"arguments", "{}"}}}})
                  .starts_with(".function_call: the older single call is not sent"));
  EXPECT_EQ(problem("user", {{"name", true}}), ".name: expected a string, got boolean");
}

TEST(UnansweredToolMessage, NamesAToolMessageWhoseCallNoEarlierMessageMade) {
  ChatMessage assistant{"assistant", ""};
  assistant.tool_calls = json::array({kCall});
  ChatMessage answer{"tool", "18 C"};
  answer.tool_call_id = "call_a";
  ChatMessage stray{"tool", "?"};
  stray.tool_call_id = "call_z";
  EXPECT_EQ(unanswered_tool_message(std::vector<ChatMessage>{{"user", "Weather?"}, assistant, answer}), std::nullopt);
  const auto problem = unanswered_tool_message(std::vector<ChatMessage>{{"user", "Weather?"}, assistant, answer, stray});
  ASSERT_TRUE(problem);
  EXPECT_EQ(problem->first, 3u);
  EXPECT_EQ(problem->second, "answers the call 'call_z', which no earlier assistant message made");
  // The answer must come after the call.
  EXPECT_TRUE(unanswered_tool_message(std::vector<ChatMessage>{{"user", "Weather?"}, answer, assistant}));
}

TEST(EngineToolFields, TakesFunctionToolsAndTheChoicesItCanHonour) {
  const json weather = {{"type", "function"},
                        {"function", {{"name", "get_weather"}, {"description", "Weather"}, {"parameters", {{"type", "object"}}}}}};
  EXPECT_EQ(engine_field_problem("tools", json::array({weather})), std::nullopt);
  EXPECT_EQ(engine_field_problem("tools", json::array()), std::nullopt);
  EXPECT_EQ(engine_field_problem("tool_choice", "auto"), std::nullopt);
  EXPECT_EQ(engine_field_problem("tool_choice", "none"), std::nullopt);
  EXPECT_EQ(engine_field_problem("parallel_tool_calls", true), std::nullopt);
  const auto problem = [](const std::string& key, const json& value) {
    return engine_field_problem(key, value).value_or("none");
  };
  EXPECT_EQ(problem("tools", weather), "expected a list of {type: function, function: {name, description, parameters}}");
  EXPECT_EQ(problem("tools", json::array({{{"type", "code_interpreter"}}})),
            "tools[0]: expected {type: function, function: {...}} (the embedded engine calls function tools only)");
  EXPECT_EQ(problem("tools", json::array({{{"type", "function"}, {"function", {{"name", ""}}}}})),
            "tools[0].function.name: required: a non-empty string");
  EXPECT_EQ(problem("tools", json::array({{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", "x"}}}}})),
            "tools[0].function.parameters: expected a JSON schema (an object)");
  EXPECT_EQ(engine_field_problem("tool_choice", "required"), std::nullopt);  // a forced call (tool_choice_problem)
  EXPECT_TRUE(problem("tool_choice", 3).starts_with("expected \"auto\", \"none\", \"required\""));
  EXPECT_EQ(engine_field_problem("parallel_tool_calls", false), std::nullopt);  // with tool_choice
  EXPECT_TRUE(requested_tools({{"tools", {weather}}, {"tool_choice", "required"}}));
  EXPECT_TRUE(problem("functions", json::array({weather["function"]})).starts_with("the embedded engine calls tools given as 'tools'"));

  EXPECT_TRUE(requested_tools({{"tools", {weather}}}));
  EXPECT_TRUE(requested_tools({{"tools", {weather}}, {"tool_choice", "auto"}}));
  EXPECT_FALSE(requested_tools({{"tools", {weather}}, {"tool_choice", "none"}}));
  EXPECT_FALSE(requested_tools({{"tools", json::array()}}));
  EXPECT_FALSE(requested_tools(json()));
}

}  // namespace
}  // namespace batchlm
