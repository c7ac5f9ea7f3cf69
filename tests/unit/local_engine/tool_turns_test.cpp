// Tool calling in the embedded engine's chat templates: Qwen 2.5's and Qwen 3's tool turns
// rendered as Jinja renders them (tests/reference/tool_turns/renders.json, made by
// tests/reference/make_tool_turn_goldens.py from llama.cpp's copies of the templates), and the
// calls read back from what a model writes.

#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "batchlm/local_engine/tokenizer.hpp"

namespace batchlm::local_engine {
namespace {

using nlohmann::json;

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

ChatTemplate template_from(std::string text) {
  Vocab vocab;
  vocab.model = "gpt2";
  vocab.pre = "gpt2";
  vocab.tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  vocab.types = {TokenType::Control, TokenType::Control, TokenType::Control};
  vocab.bos = 0;
  vocab.eos = 2;
  vocab.chat_template = std::move(text);
  return ChatTemplate::from_vocab(vocab);
}

std::vector<ChatMessage> messages_from(const json& list) {
  std::vector<ChatMessage> out;
  for (const json& m : list) {
    ChatMessage message{m["role"].get<std::string>(), m.value("content", std::string())};
    if (auto problem = read_tool_fields(m, message)) ADD_FAILURE() << problem->first << ": " << problem->second;
    out.push_back(std::move(message));
  }
  return out;
}

// Today's date as Llama 3.2's template writes it (strftime_now("%d %b %Y")), for the renderings'
// @DATE@.
std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[32];
  std::strftime(text, sizeof text, "%d %b %Y", &local);
  return text;
}

TEST(ToolTurns, QwenAndLlamaTemplatesRenderToolsCallsAndResultsAsJinjaDoes) {
  const std::filesystem::path source(BATCHLM_SOURCE_DIR);
  // Read in order: the tools' keys reach the prompt as written.
  const auto renders = nlohmann::ordered_json::parse(read_file(source / "tests/reference/tool_turns/renders.json"));
  ASSERT_EQ(renders.size(), 43u);
  std::set<std::string> seen;
  for (const auto& r : renders) {
    const std::string name = r["template"].get<std::string>();
    SCOPED_TRACE(name + ": " + r["case"].get<std::string>());
    const std::string text = read_file(source / "models/vocab/templates" / name);
    if (text.empty()) GTEST_SKIP() << name << " is absent (scripts/fetch-vocabs.sh fetches it)";
    const ChatTemplate chat = template_from(text);
    ASSERT_EQ(chat.call_format(), name.starts_with("Qwen") ? CallFormat::kTagged : CallFormat::kJson);
    std::string expected = r["expected"].get<std::string>();
    if (const std::size_t at = expected.find("@DATE@"); at != std::string::npos) expected.replace(at, 6, today());
    // Template variables (enable_thinking) the engine writes as the answer's opening.
    nlohmann::ordered_json extra = nlohmann::ordered_json::object();
    if (r.contains("chat_template_kwargs")) extra["chat_template_kwargs"] = r["chat_template_kwargs"];
    EXPECT_EQ(chat.apply(messages_from(r["messages"]), true, r["tools"]) + answer_prefix(chat, extra), expected);
    seen.insert(name);
  }
  EXPECT_EQ(seen.size(), 5u);
}

// Qwen 3's enable_thinking false writes an empty <think> block after the generation prompt, and a
// forced call opens after it; a template without the switch (Qwen 2.5's) leaves it unread.
TEST(ToolTurns, TheAnswersOpeningTakesThinkingOffBeforeAForcedCall) {
  const std::filesystem::path templates = std::filesystem::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates";
  const std::string qwen3 = read_file(templates / "Qwen-Qwen3-0.6B.jinja");
  const std::string qwen25 = read_file(templates / "Qwen-Qwen2.5-7B-Instruct.jinja");
  if (qwen3.empty() || qwen25.empty()) GTEST_SKIP() << "Qwen's templates are absent (scripts/fetch-vocabs.sh fetches them)";
  const ChatTemplate three = template_from(qwen3), two = template_from(qwen25);
  EXPECT_EQ(three.thinking_off(), "<think>\n\n</think>\n\n");
  EXPECT_EQ(two.thinking_off(), "");
  const auto extra = nlohmann::ordered_json::parse(R"({"chat_template_kwargs": {"enable_thinking": false},
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": "required"})");
  EXPECT_EQ(answer_prefix(three, extra), "<think>\n\n</think>\n\n<tool_call>\n");
  EXPECT_EQ(answer_prefix(two, extra), "<tool_call>\n");
  nlohmann::ordered_json on = extra;
  on["chat_template_kwargs"]["enable_thinking"] = true;
  on["tool_choice"] = "auto";
  EXPECT_EQ(answer_prefix(three, on), "");
  EXPECT_EQ(answer_prefix(three, nullptr), "");
}

TEST(ToolTurns, ATemplateWithoutToolsRefusesThemAndKeepsItsToolRole) {
  const ChatTemplate smollm = template_from(
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
      "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
      "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}");
  EXPECT_FALSE(smollm.calls_tools());
  const std::vector<ChatMessage> messages = {{"user", "Weather?"}};
  const json tools = json::array({{{"type", "function"}, {"function", {{"name", "get_weather"}}}}});
  try {
    (void)smollm.apply(messages, true, tools);
    ADD_FAILURE() << "tools were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("does not list tools"), std::string::npos) << e.what();
  }
  // No tools (null or an empty list): the conversation as before.
  EXPECT_EQ(smollm.apply(messages, true, json::array()), smollm.apply(messages, true));
}

TEST(ParseToolCalls, ReadsEveryCallAndTheTextAroundThem) {
  const auto parsed = parse_tool_calls(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"C\", \"city\": \"Zürich\"}}\n"
      "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>");
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->content, "Let me check.");
  ASSERT_EQ(parsed->calls.size(), 2u);
  const json& first = parsed->calls[0];
  EXPECT_EQ(first["type"], "function");
  EXPECT_EQ(first["function"]["name"], "get_weather");
  // The arguments as JSON text, keys in the order the model wrote them.
  EXPECT_EQ(first["function"]["arguments"], "{\"unit\":\"C\",\"city\":\"Zürich\"}");
  EXPECT_EQ(parsed->calls[1]["function"], (json{{"name", "get_time"}, {"arguments", "{}"}}));
  std::set<std::string> ids;
  for (const json& call : parsed->calls) {
    const std::string id = call["id"].get<std::string>();
    EXPECT_TRUE(id.starts_with("call_") && id.size() == 29) << id;
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 2u);

  // Arguments written as text are kept as they are; none are an empty object.
  const auto text = parse_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>");
  ASSERT_TRUE(text);
  EXPECT_EQ(text->calls[0]["function"]["arguments"], "{\"a\": 1}");
  EXPECT_EQ(text->content, "");
  const auto none = parse_tool_calls("<tool_call>{\"name\": \"f\"}</tool_call>");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->calls[0]["function"]["arguments"], "{}");
}

TEST(ParseToolCalls, TextThatIsNotAWholeCallIsLeftAsItIs) {
  for (const std::string text : {
           "The answer is 4.",
           "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",          // cut short
           "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",  // not JSON
           "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                                      // no name
           "<tool_call>\n[\"get_weather\"]\n</tool_call>",                                        // not an object
           "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>",                          // arguments a number
           "<tool_call>{\"name\": \"f\"}</tool_call> then <tool_call>{\"name\": \"g\"",           // second cut short
       }) {
    EXPECT_FALSE(parse_tool_calls(text)) << text;
  }
}

// Arguments nested deeper than a request may be are text, never a value written out level by
// level (which would overflow the stack).
TEST(ParseToolCalls, ArgumentsNestedTooDeepStayText) {
  const std::size_t levels = 200000;
  const std::string deep = "{\"a\": " + std::string(levels, '[') + std::string(levels, ']') + "}";
  EXPECT_FALSE(parse_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": " + deep + "}</tool_call>"));
  ChatMessage call{"assistant", ""};
  call.tool_calls = json::array({{{"id", "c"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", deep}}}}});
  ChatMessage result{"tool", "ok"};
  result.tool_call_id = "c";
  const std::string text = read_file(std::filesystem::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates/Qwen-Qwen3-0.6B.jinja");
  if (text.empty()) GTEST_SKIP() << "Qwen3's template is absent (scripts/fetch-vocabs.sh fetches it)";
  const std::string prompt = template_from(text).apply(std::vector<ChatMessage>{{"user", "x"}, call, result}, true);
  EXPECT_NE(prompt.find("\"arguments\": " + deep + "}"), std::string::npos);
}

TEST(ParseToolCalls, AStreamHoldsBackWhatMayBeginACall) {
  EXPECT_EQ(tool_call_start("The answer"), 10u);
  EXPECT_EQ(tool_call_start("Checking <tool_call>\n{"), 9u);
  EXPECT_EQ(tool_call_start("Checking <tool_ca"), 9u);
  EXPECT_EQ(tool_call_start("Checking <"), 9u);
  EXPECT_EQ(tool_call_start("a < b"), 5u);
  EXPECT_EQ(tool_call_start(""), 0u);
}

TEST(ToolCallStream, TextGoesOutUntilACallMayBeginAndTheCallIsHeldWhole) {
  ToolCallStream stream;
  std::string sent;
  for (const char* piece : {"Let me", " check.", "\n<", "tool_", "call>\n{\"name\": ", "\"get_time\", \"arguments\": {}}",
                            "\n</tool_call>"})
    sent += stream.add(piece);
  EXPECT_EQ(sent, "Let me check.\n");
  const auto calls = stream.finish();
  ASSERT_TRUE(calls);
  EXPECT_EQ(calls->content, "Let me check.");
  ASSERT_EQ(calls->calls.size(), 1u);
  EXPECT_EQ(calls->calls[0]["function"]["name"], "get_time");

  EXPECT_EQ(stream.unsent_content(*calls), "");
  // Text after a call goes out at the end, as the whole answer's content has it.
  ToolCallStream after;
  std::string out = after.add("Checking.\n<tool_call>{\"name\": \"f\"}</tool_call>\n\nDone, ");
  out += after.add("asked.\n");
  EXPECT_EQ(out, "Checking.\n");
  const auto tail = after.finish();
  ASSERT_TRUE(tail);
  EXPECT_EQ(tail->content, "Checking.\n\n\nDone, asked.");
  EXPECT_EQ(out + after.unsent_content(*tail), "Checking.\n\n\nDone, asked.");

  // A '<' that begins no call is held only until it is clear; an unclosed call is text after all.
  ToolCallStream text;
  EXPECT_EQ(text.add("a <"), "a ");
  EXPECT_EQ(text.add("b and <tool"), "<b and ");
  EXPECT_EQ(text.add("_call>{\"name\""), "");
  EXPECT_EQ(text.add(" more"), "");
  EXPECT_FALSE(text.finish());
  EXPECT_EQ(text.rest(), "<tool_call>{\"name\" more");
  EXPECT_EQ(text.text(), "a <b and <tool_call>{\"name\" more");
}

// Qwen 3 reasons in a <think> block first: a call it writes out while reasoning ("I could write
// <tool_call>...") is part of the reasoning, and only what follows </think> is read for calls.
TEST(ToolCallStream, CallsAreReadAfterTheReasoningOnly) {
  EXPECT_EQ(answer_start("Plain"), 0u);
  EXPECT_EQ(answer_start("\n<think>\nhmm\n</think>\n\nYes"), 21u);
  EXPECT_EQ(answer_start("<think>\nstill"), std::nullopt);
  EXPECT_EQ(answer_start("Done. <think> is a tag"), 0u);  // reasoning only where it opens the answer

  const std::string call = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
  const std::string thought = "<think>\nI should write " + call + " to ask.\n</think>\n\n";
  // Reasoning alone, with a call written out in it: text, all of it.
  EXPECT_FALSE(parse_tool_calls(thought + "It is noon."));
  EXPECT_FALSE(parse_tool_calls("<think>\n" + call));  // still reasoning
  // A call after the reasoning: the call, with the reasoning in the content.
  const auto parsed = parse_tool_calls(thought + call);
  ASSERT_TRUE(parsed);
  ASSERT_EQ(parsed->calls.size(), 1u);
  EXPECT_EQ(parsed->content, "<think>\nI should write " + call + " to ask.\n</think>");

  // Streamed token by token: the reasoning goes out as it comes, calls written in it too; the
  // call after it is held.
  ToolCallStream stream;
  std::string sent;
  const std::string answer = thought + call;
  for (std::size_t i = 0; i < answer.size(); i += 3) sent += stream.add(answer.substr(i, 3));
  EXPECT_EQ(sent, thought);
  const auto streamed = stream.finish();
  ASSERT_TRUE(streamed);
  EXPECT_EQ(streamed->calls.size(), 1u);
  EXPECT_EQ(stream.unsent_content(*streamed), "");

  // Reasoning that ends in a plain answer goes out whole, the answer's '<' held only until clear.
  ToolCallStream plain;
  EXPECT_EQ(plain.add("<"), "");  // may begin <think> or <tool_call>
  EXPECT_EQ(plain.add("think>\na <tool_call> b"), "<think>\na <tool_call> b");
  EXPECT_EQ(plain.add("</think>\n\nx <"), "</think>\n\nx ");
  EXPECT_EQ(plain.add("3"), "<3");
  EXPECT_FALSE(plain.finish());
  EXPECT_EQ(plain.rest(), "");
}

// Llama 3.1's to 3.3's templates: the model answers a call with the call alone.
TEST(ParseToolCalls, LlamaAnswersThatAreCallsAlone) {
  const auto one = parse_tool_calls("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"C\"}}",
                                    CallFormat::kJson);
  ASSERT_TRUE(one);
  EXPECT_EQ(one->content, "");
  ASSERT_EQ(one->calls.size(), 1u);
  EXPECT_EQ(one->calls[0]["function"], (json{{"name", "get_weather"}, {"arguments", "{\"city\":\"Paris\",\"unit\":\"C\"}"}}));
  EXPECT_EQ(one->calls[0]["type"], "function");
  EXPECT_TRUE(one->calls[0]["id"].get<std::string>().starts_with("call_"));

  // Several, separated by ';'; "arguments" read as well; the python tag and spaces around.
  const auto several = parse_tool_calls(
      "\n<|python_tag|>{\"name\": \"a\", \"parameters\": {\"s\": \"} ; {\"}}; {\"name\": \"b\", \"arguments\": {}} \n",
      CallFormat::kJson);
  ASSERT_TRUE(several);
  ASSERT_EQ(several->calls.size(), 2u);
  EXPECT_EQ(several->calls[0]["function"]["arguments"], "{\"s\":\"} ; {\"}");
  EXPECT_EQ(several->calls[1]["function"]["name"], "b");
  EXPECT_EQ(several->content, "");

  // Anything else is the answer as it stands: text first or after, an unclosed or unnamed
  // call, arguments that are not an object, the other template's form.
  for (const char* text : {"Sure: {\"name\": \"a\", \"parameters\": {}}", "{\"name\": \"a\", \"parameters\": {}} done",
                           "{\"name\": \"a\", \"parameters\": {}", "{\"parameters\": {}}", "{\"name\": \"a\", \"parameters\": 3}",
                           "{\"name\": \"a\", \"parameters\": {}} {\"name\": \"b\", \"parameters\": {}}",
                           "{\"name\": \"a\", \"parameters\": {}};", "It is 18 C.", "",
                           "{\"name\": \"Bob\", \"age\": 3}",  // JSON with a name, but no call: no arguments
                           "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>"}) {
    const auto parsed = parse_tool_calls(text, CallFormat::kJson);
    if (std::string_view(text) == "{\"name\": \"a\", \"parameters\": {}};") {
      ASSERT_TRUE(parsed) << text;  // a trailing separator is allowed
      EXPECT_EQ(parsed->calls.size(), 1u);
    } else {
      EXPECT_FALSE(parsed) << text;
    }
  }
}

TEST(ToolCallStream, ALlamaAnswerIsHeldWholeWhenItOpensWithACall) {
  // Text goes out as it comes once it opens with anything but a call.
  ToolCallStream text(CallFormat::kJson);
  EXPECT_EQ(text.add(" "), "");
  EXPECT_EQ(text.add("It is"), " It is");
  EXPECT_EQ(text.add(" {\"name\": 1}"), " {\"name\": 1}");
  EXPECT_FALSE(text.finish());
  EXPECT_EQ(text.rest(), "");

  // A call is held from its first brace to the end.
  ToolCallStream call(CallFormat::kJson);
  std::string sent;
  const std::string answer = "\n{\"name\": \"get_time\", \"parameters\": {}}";
  for (std::size_t i = 0; i < answer.size(); i += 2) sent += call.add(answer.substr(i, 2));
  EXPECT_EQ(sent, "");
  const auto parsed = call.finish();
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->calls[0]["function"]["name"], "get_time");
  EXPECT_EQ(call.unsent_content(*parsed), "");

  // Held until clear: "<" may open the python tag or a <think>.
  ToolCallStream tag(CallFormat::kJson);
  EXPECT_EQ(tag.add("<"), "");
  EXPECT_EQ(tag.add("b>bold</b>"), "<b>bold</b>");
  ToolCallStream reasoned(CallFormat::kJson);
  EXPECT_EQ(reasoned.add("<think>\nhmm\n</think>\n\n"), "<think>\nhmm\n</think>");
  EXPECT_EQ(reasoned.add("{\"name\": \"f\", \"parameters\": {}}"), "");
  const auto after = reasoned.finish();
  ASSERT_TRUE(after);
  EXPECT_EQ(after->content, "<think>\nhmm\n</think>");
  EXPECT_EQ(reasoned.unsent_content(*after), "");
}

TEST(ToolTurns, LlamaTemplatesWriteOneCallPerTurnAndToolsBeforeAUserMessage) {
  const std::string text =
      read_file(std::filesystem::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates/meta-llama-Llama-3.1-8B-Instruct.jinja");
  if (text.empty()) GTEST_SKIP() << "Llama 3.1's template is absent (scripts/fetch-vocabs.sh fetches it)";
  const ChatTemplate chat = template_from(text);
  const json tools = json::array({{{"type", "function"}, {"function", {{"name", "f"}}}}});
  // Two calls in one message (as a model may answer them): two turns, where the template raises.
  ChatMessage two{"assistant", "Both."};
  two.tool_calls = json::array({{{"id", "a"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", "{\"x\": 1}"}}}},
                                {{"id", "b"}, {"type", "function"}, {"function", {{"name", "g"}, {"arguments", ""}}}}});
  const std::string prompt = chat.apply(std::vector<ChatMessage>{{"user", "x"}, two}, false);
  EXPECT_TRUE(prompt.ends_with(
      "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"f\", \"parameters\": {\"x\": 1}}<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"g\", \"parameters\": {}}<|eot_id|>"))
      << prompt;
  const auto error = [&](const std::vector<ChatMessage>& messages, const json& with) {
    try {
      (void)chat.apply(messages, true, with);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error({{"system", "Be brief."}}, tools),
            "messages: this model's chat template puts the tools in the first user message, and the conversation has none");
  // Llama 3.0's template, undated, lists no tools.
  const ChatTemplate llama3 = template_from(
      "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
      "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}"
      "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}");
  EXPECT_EQ(llama3.name(), "llama3");
  EXPECT_FALSE(llama3.calls_tools());
}

}  // namespace
}  // namespace batchlm::local_engine
