// engine_field_problem: which extra body fields the embedded engine honours, which change
// nothing, and which it refuses (rather than ignoring them in silence).

#include "batchlm/core/engine_fields.hpp"
#include "batchlm/core/json_schema.hpp"

#include <gtest/gtest.h>

namespace batchlm {
namespace {

using nlohmann::json;

bool ok(const char* key, const json& value) { return !engine_field_problem(key, value).has_value(); }
std::string problem(const char* key, const json& value) { return engine_field_problem(key, value).value_or("<none>"); }

TEST(EngineFields, TopKIsHonoured) {
  EXPECT_TRUE(ok("top_k", 40));
  EXPECT_TRUE(ok("top_k", 0));
  EXPECT_TRUE(ok("top_k", -1));
  EXPECT_EQ(problem("top_k", -2), "expected an integer from -1 (no limit) to 2147483647, not -2");
  EXPECT_EQ(problem("top_k", "40"), "expected an integer from -1 (no limit) to 2147483647, not \"40\"");
  EXPECT_FALSE(ok("top_k", 4.5));
  EXPECT_TRUE(ok("top_k", 40.0));  // a whole number written with a point
  EXPECT_FALSE(ok("top_k", 1ll << 40));
}

TEST(EngineFields, TheTemplatesThinkingSwitchIsTheOnlyTemplateVariableTaken) {
  EXPECT_TRUE(ok("chat_template_kwargs", {{"enable_thinking", false}}));
  EXPECT_TRUE(ok("chat_template_kwargs", json::object()));
  EXPECT_EQ(problem("chat_template_kwargs", {{"enable_thinking", "no"}}), "'enable_thinking' must be true or false, not \"no\"");
  EXPECT_EQ(problem("chat_template_kwargs", {{"thinking", true}}),
            "the embedded engine takes only 'enable_thinking' among the template's variables, not 'thinking'; remove it, "
            "or run the job against an API that does (--base-url)");
  EXPECT_EQ(problem("chat_template_kwargs", json::array()), "expected an object of template variables, not []");
  using ojson = nlohmann::ordered_json;
  EXPECT_EQ(requested_thinking(ojson{{"chat_template_kwargs", {{"enable_thinking", false}}}}), false);
  EXPECT_EQ(requested_thinking(ojson{{"chat_template_kwargs", {{"enable_thinking", true}}}}), true);
  EXPECT_EQ(requested_thinking(ojson{{"chat_template_kwargs", {{"enable_thinking", nullptr}}}}), std::nullopt);
  EXPECT_EQ(requested_thinking(ojson::object()), std::nullopt);
}

TEST(EngineFields, PenaltiesAreHonouredInTheApiRange) {
  EXPECT_TRUE(ok("presence_penalty", 0.5));
  EXPECT_TRUE(ok("frequency_penalty", -2));
  EXPECT_TRUE(ok("frequency_penalty", 2.0));
  EXPECT_EQ(problem("frequency_penalty", 2.5), "expected a number from -2 to 2, not 2.5");
  EXPECT_EQ(problem("presence_penalty", "high"), "expected a number from -2 to 2, not \"high\"");
  EXPECT_TRUE(ok("repetition_penalty", 1.1));
  EXPECT_TRUE(ok("repetition_penalty", 0.8));
  EXPECT_TRUE(ok("repetition_penalty", nullptr));
  EXPECT_EQ(problem("repetition_penalty", 0), "expected a number above 0 and at most 100 (1: none), not 0");
  EXPECT_EQ(problem("repetition_penalty", -1.2), "expected a number above 0 and at most 100 (1: none), not -1.2");
  EXPECT_EQ(problem("repetition_penalty", "1.1"), "expected a number above 0 and at most 100 (1: none), not \"1.1\"");
}

TEST(EngineFields, FieldsThatChangeNothingPass) {
  for (const char* key : {"user", "metadata", "store", "service_tier", "stream", "stream_options"})
    EXPECT_TRUE(ok(key, "anything")) << key;
  EXPECT_TRUE(ok("n", 1));
  EXPECT_TRUE(ok("presence_penalty", 0));
  EXPECT_TRUE(ok("frequency_penalty", 0.0));
  EXPECT_TRUE(ok("repetition_penalty", 1.0));
  EXPECT_TRUE(ok("logit_bias", json::object()));
  EXPECT_TRUE(ok("logprobs", false));
  EXPECT_TRUE(ok("top_logprobs", 0));
  EXPECT_TRUE(ok("response_format", {{"type", "text"}}));
  EXPECT_TRUE(ok("tools", json::array()));
  EXPECT_TRUE(ok("tool_choice", "none"));
  EXPECT_TRUE(ok("tool_choice", "required"));
  EXPECT_TRUE(ok("tool_choice", {{"type", "function"}, {"function", {{"name", "f"}}}}));
  EXPECT_EQ(problem("tool_choice", "any"),
            "expected \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}, not \"any\"");
  EXPECT_FALSE(ok("tool_choice", {{"type", "function"}, {"function", {{"name", ""}}}}));
  EXPECT_TRUE(ok("parallel_tool_calls", false));  // checked with tool_choice
  EXPECT_EQ(problem("parallel_tool_calls", "no"), "expected true or false");
  EXPECT_TRUE(ok("presence_penalty", nullptr));
  // Without tools, the tool settings change nothing; null means "not set" for any field.
  EXPECT_TRUE(ok("tool_choice", "auto"));
  EXPECT_TRUE(ok("parallel_tool_calls", true));
  EXPECT_TRUE(ok("modalities", json::array({"text"})));
  EXPECT_TRUE(ok("reasoning_effort", nullptr));
  EXPECT_TRUE(ok("audio", nullptr));
}

TEST(EngineFields, FieldsThatWouldChangeTheOutputAreRefusedWithTheReason) {
  EXPECT_EQ(problem("response_format", {{"type", "json_schema"}}),
            "expected {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}");
  EXPECT_EQ(problem("response_format", {{"type", "xml"}}),
            "expected an object whose type is text, json_object or json_schema, not {\"type\":\"xml\"}");
  const json person = {{"type", "object"},
                       {"properties", {{"name", {{"type", "string"}}}, {"age", {{"type", "integer"}, {"minimum", 0}}}}}};
  EXPECT_EQ(problem("response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "p"}, {"schema", person}}}}),
            "json_schema.schema at /properties/age/minimum: 'minimum' is not supported by the embedded engine's "
            "structured outputs (it follows type, enum, const, properties, required, additionalProperties, items, "
            "minItems, maxItems, minLength, maxLength, anyOf, oneOf and $ref); remove it, or run the job against an "
            "API that does (--base-url)");
  json followed = person;
  followed["properties"]["age"].erase("minimum");
  const json format = {{"type", "json_schema"}, {"json_schema", {{"name", "p"}, {"schema", followed}, {"strict", true}}}};
  EXPECT_TRUE(ok("response_format", format));
  ASSERT_NE(requested_json_schema({{"response_format", format}}), nullptr);
  EXPECT_EQ(*requested_json_schema({{"response_format", format}}), followed);
  EXPECT_EQ(requested_json_schema({{"response_format", {{"type", "json_object"}}}}), nullptr);
  EXPECT_FALSE(requested_json_object({{"response_format", format}}));
  EXPECT_TRUE(ok("response_format", {{"type", "json_object"}}));
  EXPECT_TRUE(requested_json_object({{"response_format", {{"type", "json_object"}}}}));
  EXPECT_FALSE(requested_json_object({{"response_format", {{"type", "text"}}}}));
  EXPECT_EQ(problem("tools", json::array({{{"type", "function"}}})), "tools[0].function: required: {name, description, parameters}");
  EXPECT_TRUE(problem("modalities", json::array({"text", "audio"})).starts_with("the embedded engine generates text only"));
  EXPECT_EQ(problem("n", 2), "several answers per item are not supported (one request, one answer)");
  EXPECT_TRUE(ok("min_p", 0.05));
  EXPECT_TRUE(ok("min_p", 0));
  EXPECT_EQ(problem("min_p", 2), "expected a number from 0 (no limit) to 1, not 2");
  EXPECT_TRUE(ok("ignore_eos", true));
  EXPECT_TRUE(ok("ignore_eos", false));
  EXPECT_EQ(problem("ignore_eos", 1), "expected true (generate past the end-of-turn token, to max_tokens) or false, not 1");
}

TEST(EngineFields, RequestFieldsBelongOutsideTheExtraOnes) {
  EXPECT_EQ(problem("max_completion_tokens", 64),
            "set it as request.max_tokens (the embedded engine does not read it from the extra fields)");
  EXPECT_EQ(problem("temperature", 0.2),
            "set it as request.temperature (the embedded engine does not read it from the extra fields)");
}

TEST(EngineFields, UnknownFieldsAreNamed) {
  EXPECT_EQ(problem("typical_p", 0.5),
            "the embedded engine does not use 'typical_p' (of the extra fields it takes top_k, min_p, presence_penalty, "
            "frequency_penalty, repetition_penalty, logit_bias, min_tokens, stop_token_ids, bad_words, logprobs, "
            "top_logprobs, response_format, ignore_eos, tools, tool_choice, parallel_tool_calls and chat_template_kwargs); "
            "remove it, or run the job against an API that does (--base-url)");
}

// vLLM's min_tokens, stop_token_ids and bad_words: a whole number of tokens, a list of token
// ids, a list of words; a min_tokens above the request's max_tokens is named.
TEST(EngineFields, MinTokensAndStopTokenIdsAreTaken) {
  using ojson = nlohmann::ordered_json;
  EXPECT_TRUE(ok("min_tokens", 0));
  EXPECT_TRUE(ok("min_tokens", 64.0));
  EXPECT_EQ(problem("min_tokens", -1), "expected a whole number of tokens from 0 to 16777216, not -1");
  EXPECT_EQ(problem("min_tokens", 1.5), "expected a whole number of tokens from 0 to 16777216, not 1.5");
  EXPECT_EQ(problem("min_tokens", "8"), "expected a whole number of tokens from 0 to 16777216, not \"8\"");
  EXPECT_TRUE(ok("stop_token_ids", json::array()));
  EXPECT_TRUE(ok("stop_token_ids", {0, 2, 151645}));
  EXPECT_EQ(problem("stop_token_ids", 2), "expected a list of token ids, not 2");
  EXPECT_EQ(problem("stop_token_ids", {1, "2"}), "[1] is not a token id (a whole number from 0): \"2\"");
  EXPECT_EQ(problem("stop_token_ids", {-1}), "[0] is not a token id (a whole number from 0): -1");
  EXPECT_EQ(problem("stop_token_ids", json(std::vector<int>(1025, 1))), "names 1025 tokens; at most 1024 are allowed");
  EXPECT_TRUE(ok("bad_words", {"darn", " heck it"}));
  EXPECT_EQ(problem("bad_words", "darn"), "expected a list of words, not \"darn\"");
  EXPECT_EQ(problem("bad_words", {"ok", "  "}), "[1] is not a word (a string with more than whitespace): \"  \"");
  EXPECT_EQ(problem("bad_words", {3}), "[0] is not a word (a string with more than whitespace): 3");
  EXPECT_EQ(problem("bad_words", {std::string(300, 'a')}), "[0] is 300 bytes long; at most 256 are allowed");
  EXPECT_EQ(requested_bad_words(ojson{{"bad_words", {"a", "b"}}}), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(requested_min_tokens(ojson{{"min_tokens", 12}}), 12);
  EXPECT_EQ(requested_min_tokens(ojson::object()), 0);
  EXPECT_EQ(requested_stop_token_ids(ojson{{"stop_token_ids", {5, 9}}}), (std::vector<std::int64_t>{5, 9}));
  EXPECT_TRUE(requested_stop_token_ids(ojson()).empty());
  EXPECT_EQ(min_tokens_problem(ojson{{"min_tokens", 12}}, 8),
            "asks for at least 12 tokens, more than max_tokens (8) lets out");
  EXPECT_EQ(min_tokens_problem(ojson{{"min_tokens", 8}}, 8), std::nullopt);
  EXPECT_EQ(min_tokens_problem(ojson{{"min_tokens", 8}}, std::nullopt), std::nullopt);
  EXPECT_EQ(min_tokens_problem(ojson::object(), 0), std::nullopt);
}

TEST(EngineFields, LogitBiasIsTokenIdsAndBiasesWithinRange) {
  EXPECT_TRUE(ok("logit_bias", {{"50256", -100}, {"0", 100}, {"12", 2.5}}));
  EXPECT_EQ(problem("logit_bias", json::array()), "expected an object of token ids and biases, not []");
  EXPECT_EQ(problem("logit_bias", {{"-1", 1}}),
            "the key '-1' is not a token id (a whole number written as a string, like \"1234\")");
  EXPECT_EQ(problem("logit_bias", {{"hello", 1}}),
            "the key 'hello' is not a token id (a whole number written as a string, like \"1234\")");
  EXPECT_EQ(problem("logit_bias", {{"7", 100.5}}), "the bias of token 7 must be a number from -100 to 100, not 100.5");
  EXPECT_EQ(problem("logit_bias", {{"7", "1"}}), "the bias of token 7 must be a number from -100 to 100, not \"1\"");
  json many = json::object();
  for (int i = 0; i <= 1024; ++i) many[std::to_string(i)] = 1;
  EXPECT_EQ(problem("logit_bias", many), "names 1025 tokens; at most 1024 are allowed");
  EXPECT_EQ(requested_logit_bias({{"logit_bias", {{"7", -100}, {"12", 2.5}}}}),
            (std::vector<std::pair<std::int64_t, double>>{{7, -100.0}, {12, 2.5}}));
  EXPECT_TRUE(requested_logit_bias({{"top_k", 3}}).empty());
}

TEST(EngineFields, LogprobsInTheChatAndTheCompletionsForm) {
  EXPECT_TRUE(ok("logprobs", true));
  EXPECT_TRUE(ok("logprobs", 0));
  EXPECT_TRUE(ok("logprobs", 20));
  EXPECT_TRUE(ok("top_logprobs", 20));
  EXPECT_EQ(problem("logprobs", 21), "expected true, false or a number of most likely tokens from 0 to 20, not 21");
  EXPECT_EQ(problem("logprobs", 1.5), "expected true, false or a number of most likely tokens from 0 to 20, not 1.5");
  EXPECT_EQ(problem("top_logprobs", -1), "expected a whole number from 0 to 20, not -1");
  EXPECT_EQ(problem("top_logprobs", true), "expected a whole number from 0 to 20, not true");

  EXPECT_EQ(requested_logprobs(json::object()), -1);
  EXPECT_EQ(requested_logprobs({{"logprobs", false}, {"top_logprobs", 0}}), -1);
  EXPECT_EQ(requested_logprobs({{"logprobs", true}}), 0);
  EXPECT_EQ(requested_logprobs({{"logprobs", true}, {"top_logprobs", 5}}), 5);
  EXPECT_EQ(requested_logprobs({{"logprobs", 3}}), 3);
  EXPECT_EQ(requested_logprobs({{"logprobs", 0}}), 0);

  EXPECT_FALSE(top_logprobs_problem({{"logprobs", true}, {"top_logprobs", 5}}));
  EXPECT_FALSE(top_logprobs_problem({{"logprobs", false}, {"top_logprobs", 0}}));
  EXPECT_FALSE(top_logprobs_problem({{"logprobs", 4}, {"top_logprobs", 4}}));
  EXPECT_EQ(top_logprobs_problem({{"top_logprobs", 2}}), "needs logprobs: true");
  EXPECT_EQ(top_logprobs_problem({{"logprobs", false}, {"top_logprobs", 2}}), "needs logprobs: true");
  EXPECT_EQ(top_logprobs_problem({{"logprobs", 4}, {"top_logprobs", 2}}),
            "asks for 2 most likely tokens where logprobs asks for 4");
}

// tool_choice "required" or a named function holds the answer to one call: to a tool that is
// there, and whose parameters are a schema the engine can hold the call to.
TEST(EngineFields, AForcedToolChoiceNeedsItsToolAndAParametersSchemaTheEngineFollows) {
  const nlohmann::ordered_json weather = {
      {"type", "function"},
      {"function", {{"name", "get_weather"},
                    {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}, {"required", {"city"}}}}}}};
  const nlohmann::ordered_json time = {{"type", "function"}, {"function", {{"name", "get_time"}}}};
  const auto with = [&](nlohmann::ordered_json choice) {
    nlohmann::ordered_json extra = {{"tools", {weather, time}}};
    if (!choice.is_null()) extra["tool_choice"] = std::move(choice);
    return extra;
  };
  const nlohmann::ordered_json named = {{"type", "function"}, {"function", {{"name", "get_time"}}}};
  EXPECT_FALSE(tool_choice_problem(with(nullptr)));
  EXPECT_FALSE(tool_choice_problem(with("required")));
  EXPECT_FALSE(tool_choice_problem(with(named)));
  EXPECT_EQ(tool_choice_problem({{"tool_choice", "required"}}),
            std::make_pair(std::string("tool_choice"), std::string("forces a call, but no tools are given")));
  nlohmann::ordered_json other = named;
  other["function"]["name"] = "get_date";
  EXPECT_EQ(tool_choice_problem(with(other)),
            std::make_pair(std::string("tool_choice"),
                           std::string("names the function \"get_date\", which is not among the tools")));
  // One call where the model decides cannot be promised; a forced choice makes exactly one.
  nlohmann::ordered_json one = with("auto");
  one["parallel_tool_calls"] = false;
  ASSERT_TRUE(tool_choice_problem(one));
  EXPECT_EQ(tool_choice_problem(one)->first, "parallel_tool_calls");
  one["tool_choice"] = "required";
  EXPECT_FALSE(tool_choice_problem(one));
  // A forced tool's parameters the schema follower cannot hold a call to, named where.
  nlohmann::ordered_json bounded = with(nlohmann::ordered_json{{"type", "function"}, {"function", {{"name", "get_weather"}}}});
  bounded["tools"][0]["function"]["parameters"]["properties"]["city"]["minimum"] = 3;
  const auto schema = tool_choice_problem(bounded);
  ASSERT_TRUE(schema);
  EXPECT_EQ(schema->first, "tools");
  EXPECT_TRUE(schema->second.starts_with("tools[0].function.parameters at /properties/city/minimum: a forced call is "
                                         "held to its tool's parameters, and 'minimum' is not supported"))
      << schema->second;
  // ... but only where the call is forced to that tool.
  nlohmann::ordered_json elsewhere = bounded;
  elsewhere["tool_choice"] = named;
  EXPECT_FALSE(tool_choice_problem(elsewhere));

  // The schema: the named tool's call, or any tool's, with the arguments under the template's key.
  const auto only = forced_call_schema(with(named), "parameters");
  ASSERT_TRUE(only);
  EXPECT_EQ(*only, json::parse(R"({"type": "object", "properties": {"name": {"const": "get_time"},
      "parameters": {"type": "object"}}, "required": ["name", "parameters"], "additionalProperties": false})"));
  // "required" among several: one of their names, and an object of arguments.
  const auto any = forced_call_schema(with("required"), "arguments");
  ASSERT_TRUE(any);
  EXPECT_EQ(*any, json::parse(R"({"type": "object", "properties": {"name": {"enum": ["get_weather", "get_time"]},
      "arguments": {"type": "object"}}, "required": ["name", "arguments"], "additionalProperties": false})"));
  EXPECT_NO_THROW((void)compile_json_schema(*any));
  // Of one tool: held to its parameters.
  nlohmann::ordered_json alone = {{"tools", {weather}}, {"tool_choice", "required"}};
  EXPECT_EQ((*forced_call_schema(alone, "arguments"))["properties"]["arguments"]["required"], json::array({"city"}));
  EXPECT_FALSE(forced_call_schema(with("auto"), "arguments"));
  EXPECT_FALSE(forced_call_schema(with(nullptr), "arguments"));

  // Parameters with their own definitions and references (as pydantic writes them) keep pointing
  // at the same places once they sit inside the call: "#" is the parameters, not the call.
  nlohmann::ordered_json defs = {{"tools", {weather}}, {"tool_choice", "required"}};
  defs["tools"][0]["function"]["parameters"] = nlohmann::ordered_json::parse(R"({"type": "object",
      "$defs": {"Unit": {"enum": ["C", "F"]}, "Pair": {"type": "array", "items": {"$ref": "#/$defs/Unit"}}},
      "properties": {"unit": {"$ref": "#/$defs/Unit"}, "same": {"$ref": "#/properties/unit"},
                     "children": {"type": "array", "items": {"$ref": "#"}}}})");
  EXPECT_FALSE(tool_choice_problem(defs));
  const auto moved = forced_call_schema(defs, "parameters");
  ASSERT_TRUE(moved);
  EXPECT_EQ((*moved)["$defs"]["Pair"]["items"]["$ref"], "#/$defs/Unit");
  const json& parameters = (*moved)["properties"]["parameters"];
  EXPECT_FALSE(parameters.contains("$defs"));
  EXPECT_EQ(parameters["properties"]["unit"]["$ref"], "#/$defs/Unit");
  EXPECT_EQ(parameters["properties"]["same"]["$ref"], "#/properties/parameters/properties/unit");
  EXPECT_EQ(parameters["properties"]["children"]["items"]["$ref"], "#/properties/parameters");
  EXPECT_NO_THROW((void)compile_json_schema(*moved));

  // "required" among more tools than a call's name can be held to one of.
  nlohmann::ordered_json many = {{"tool_choice", "required"}, {"tools", nlohmann::ordered_json::array()}};
  for (int i = 0; i < 65; ++i) {
    nlohmann::ordered_json tool = time;
    tool["function"]["name"] = "t" + std::to_string(i);
    many["tools"].push_back(tool);
  }
  ASSERT_TRUE(tool_choice_problem(many));
  EXPECT_EQ(tool_choice_problem(many)->first, "tool_choice");
  many["tools"].erase(64);
  EXPECT_FALSE(tool_choice_problem(many));
  EXPECT_NO_THROW((void)compile_json_schema(*forced_call_schema(many, "arguments")));
}

// What only the CPU's sampler applies, field by field; values that change nothing are not it.
TEST(EngineFields, CpuSamplingFieldsAreNamedInTheEnginesOrder) {
  using ojson = nlohmann::ordered_json;
  const auto field = [](const ojson& extra) {
    const auto f = cpu_sampling_field(extra);
    return f ? f->first + ": " + f->second : std::string("<none>");
  };
  EXPECT_EQ(field(ojson()), "<none>");
  EXPECT_EQ(field(ojson::object()), "<none>");
  EXPECT_EQ(field({{"top_k", 40}, {"ignore_eos", true}, {"user", "u"}}), "<none>");
  EXPECT_EQ(field({{"presence_penalty", 0}, {"frequency_penalty", 0.0}, {"min_p", 0}}), "<none>");
  EXPECT_EQ(field({{"logprobs", false}, {"response_format", {{"type", "text"}}}}), "<none>");
  EXPECT_EQ(field({{"presence_penalty", 0.5}}), "presence_penalty: penalties are applied");
  EXPECT_EQ(field({{"frequency_penalty", -1}}), "frequency_penalty: penalties are applied");
  EXPECT_EQ(field({{"repetition_penalty", 1.1}}), "repetition_penalty: penalties are applied");
  EXPECT_EQ(field({{"repetition_penalty", 1}}), "<none>");
  EXPECT_EQ(field({{"min_p", 0.05}}), "min_p: min-p is applied");
  EXPECT_EQ(field({{"min_tokens", 4}}), "min_tokens: the end of the turn is held back");
  EXPECT_EQ(field({{"min_tokens", 0}, {"stop_token_ids", {2}}, {"bad_words", json::array()}}), "<none>");
  EXPECT_EQ(field({{"bad_words", {"no"}}}), "bad_words: bad words are held back");  // a stop token is checked anywhere
  EXPECT_EQ(field({{"logit_bias", {{"42", 0}}}}), "logit_bias: biases are applied");
  EXPECT_EQ(field({{"logit_bias", ojson::object()}}), "<none>");
  EXPECT_EQ(field({{"logprobs", true}}), "logprobs: log-probabilities are computed");
  EXPECT_EQ(field({{"logprobs", 0}}), "logprobs: log-probabilities are computed");
  EXPECT_EQ(field({{"response_format", {{"type", "json_object"}}}}), "response_format: JSON mode is applied");
  const ojson schema = {{"type", "json_schema"},
                        {"json_schema", {{"name", "n"}, {"schema", {{"type", "object"}}}}}};
  EXPECT_EQ(field({{"response_format", schema}}), "response_format: JSON schemas are followed");
  const ojson tool = {{"type", "function"},
                      {"function", {{"name", "f"}, {"parameters", {{"type", "object"}}}}}};
  EXPECT_EQ(field({{"tools", {tool}}}), "<none>");  // the model decides: nothing is forced
  EXPECT_EQ(field({{"tools", {tool}}, {"tool_choice", "required"}}),
            "tool_choice: forced calls are held to their tool's schema");
  EXPECT_EQ(field({{"tools", {tool}}, {"tool_choice", "none"}}), "<none>");
  // The first in the engine's order is named.
  EXPECT_EQ(field({{"response_format", {{"type", "json_object"}}}, {"min_p", 0.1}, {"frequency_penalty", 1}}),
            "frequency_penalty: penalties are applied");
}

// A base URL's password is left out of what is shown and recorded.
TEST(WithoutPassword, WritesTheUserInformationsPasswordAsStars) {
  EXPECT_EQ(without_password("http://user:s3cret@host:8000/v1"), "http://user:***@host:8000/v1");
  EXPECT_EQ(without_password("https://u:p@h/v1?x=a@b"), "https://u:***@h/v1?x=a@b");
  EXPECT_EQ(without_password("https://u:p:q@h"), "https://u:***@h");
  // No password, or an @ outside the authority: as it is.
  for (const char* url : {"http://user@host/v1", "http://host/v1?to=a@b:c", "http://host:8000/v1", "host/x"})
    EXPECT_EQ(without_password(url), url);
}

}  // namespace
}  // namespace batchlm
