#include "batchlm/runner/source.hpp"

#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <tuple>

#include <gtest/gtest.h>

namespace fs = std::filesystem;
using namespace batchlm::runner;
using nlohmann::json;

namespace {

EnvLookup no_env() {
  return [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
}

class SourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() / ("batchlm-source-test-" + std::to_string(rd()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    fs::path path = dir_ / name;
    std::ofstream(path) << text;
    return path.string();
  }

  static JobSpec job(const std::string& yaml) {
    return load_job_text(yaml, "jobs/t.yaml", {}, no_env());
  }

  static std::vector<Item> drain(Source& source) {
    std::vector<Item> items;
    while (auto item = source.next()) items.push_back(std::move(*item));
    return items;
  }

  static ConfigError open_error(const JobSpec& spec) {
    try {
      open_source(spec);
    } catch (const ConfigError& e) {
      return e;
    }
    ADD_FAILURE() << "open_source did not throw";
    return ConfigError("", 0, 0, "", "");
  }

  fs::path dir_;
};

const char* kQuestionTemplate = R"(
request:
  messages:
    - {role: system, content: "Answer."}
    - {role: user, content: "Q: {{question}}"}
)";

}  // namespace

TEST(RenderTemplate, SubstitutesFieldsAndNestedPaths) {
  json fields = {{"q", "why?"}, {"n", 3}, {"meta", {{"lang", "en"}, {"tags", {"a", "b"}}}}};
  EXPECT_EQ(render_template("{{q}} {{ n }} {{meta.lang}} {{meta.tags.1}}", fields), "why? 3 en b");
  EXPECT_EQ(render_template("{{meta.tags}}", fields), R"(["a","b"])");
  EXPECT_EQ(render_template("no fields {{ unclosed", fields), "no fields {{ unclosed");
}

TEST(RenderTemplate, InsertsValuesWithoutRescanningThem) {
  EXPECT_EQ(render_template("{{a}}", json{{"a", "{{b}}"}}), "{{b}}");
}

TEST(RenderTemplate, IndexTooLargeForSizeTIsAMissingField) {
  // std::stoul threw its own out_of_range ("stoul"), which is not a missing field: the error
  // reached the user without file, line or field.
  EXPECT_THROW(render_template("{{a.99999999999999999999999}}", json{{"a", {1, 2}}}), std::out_of_range);
  try {
    render_template("{{a.99999999999999999999999}}", json{{"a", {1, 2}}});
  } catch (const std::out_of_range& e) {
    EXPECT_EQ(std::string(e.what()), "no field 'a.99999999999999999999999'");
  }
}

TEST(RenderTemplate, MissingFieldThrowsOutOfRangeNamingIt) {
  try {
    render_template("{{meta.lang}}", json{{"meta", json::object()}});
    FAIL() << "expected std::out_of_range";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("meta.lang"), std::string::npos);
  }
}

TEST_F(SourceTest, JsonlItemsAreNumberedByLineSkippingBlankLines) {
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n\n  \n{\"question\": \"b\"}\r\n");
  auto source = open_source(job("input: " + in + kQuestionTemplate));
  EXPECT_EQ(source->total(), 2);
  std::vector<Item> items = drain(*source);
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[0].id, json(1));
  EXPECT_EQ(items[1].id, json(4));
  EXPECT_EQ(items[1].id_key, "4");
  EXPECT_EQ(items[1].input, (json{{"question", "b"}}));
  ASSERT_EQ(items[1].request.messages.size(), 2u);
  EXPECT_EQ(items[1].request.messages[0].content, "Answer.");
  EXPECT_EQ(items[1].request.messages[1].role, "user");
  EXPECT_EQ(items[1].request.messages[1].content, "Q: b");
  EXPECT_EQ(items[1].request.model, "");  // the dispatcher fills the backend's
}

// A byte-order mark opens the file: before the first item, or before a blank first line.
TEST_F(SourceTest, AByteOrderMarkIsNotAnItem) {
  for (const std::string& start : {std::string("\xEF\xBB\xBF"), std::string("\xEF\xBB\xBF\r\n"), std::string("\xEF\xBB\xBF  \n")}) {
    std::string in = write("bom.jsonl", start + "{\"question\": \"a\"}\n");
    std::vector<Item> items = drain(*open_source(job("input: " + in + kQuestionTemplate)));
    ASSERT_EQ(items.size(), 1u);
    EXPECT_EQ(items[0].input["question"], "a");
    EXPECT_EQ(items[0].id, json(start.size() == 3 ? 1 : 2));  // line numbers as an editor shows them
  }
}

TEST_F(SourceTest, JsonlRequestCarriesTemplateParameters) {
  std::string in = write("in.jsonl", "{\"question\": \"a\", \"m\": \"small\"}\n");
  auto source = open_source(job("input: " + in + R"(
request:
  messages: [{role: user, content: "{{question}}"}]
  model: "model-{{m}}"
  max_tokens: 7
  temperature: 0.5
  top_p: 0.25
  stop: [END]
  seed: 11
  extra: {logprobs: true}
backend: {base_url: "http://127.0.0.1:1/v1", stream: false}
)"));
  Item item = *source->next();
  EXPECT_EQ(item.request.model, "model-small");
  EXPECT_EQ(item.request.max_tokens, 7);
  EXPECT_EQ(item.request.temperature, 0.5);
  EXPECT_EQ(item.request.top_p, 0.25);
  EXPECT_EQ(item.request.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(item.request.seed, 11);
  EXPECT_EQ(item.request.extra, (json{{"logprobs", true}}));
  EXPECT_FALSE(item.request.stream);
}

TEST_F(SourceTest, EstimatesPromptTokensFromBytes) {
  std::string in = write("in.jsonl", "{\"question\": \"" + std::string(400, 'x') + "\"}\n");
  Item item = *open_source(job("input: " + in + kQuestionTemplate))->next();
  // 7 + 403 bytes / 4, plus framing for two messages.
  EXPECT_EQ(item.estimated_prompt_tokens, 410 / 4 + 2 * 4);
}

TEST_F(SourceTest, LinesWithoutTemplateUseTheirOwnMessagesOrPrompt) {
  std::string in = write("in.jsonl",
                         "{\"prompt\": \"hello\"}\n"
                         "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, "
                         "{\"role\": \"user\", \"content\": \"u\"}]}\n");
  std::vector<Item> items = drain(*open_source(job("input: " + in + "\n")));
  ASSERT_EQ(items.size(), 2u);
  ASSERT_EQ(items[0].request.messages.size(), 1u);
  EXPECT_EQ(items[0].request.messages[0].content, "hello");
  ASSERT_EQ(items[1].request.messages.size(), 2u);
  EXPECT_EQ(items[1].request.messages[1].content, "u");
}

TEST_F(SourceTest, LimitYieldsOnlyTheFirstItems) {
  std::string lines;
  for (int i = 0; i < 10; ++i) lines += "{\"question\": \"" + std::to_string(i) + "\"}\n";
  std::string in = write("in.jsonl", lines);
  auto source = open_source(job("input: " + in + "\nlimit: 3\n" + kQuestionTemplate));
  EXPECT_EQ(source->total(), 3);
  std::vector<Item> items = drain(*source);
  ASSERT_EQ(items.size(), 3u);
  EXPECT_EQ(items[2].input["question"], "2");
  EXPECT_EQ(open_source(job("input: " + in + "\nlimit: 30\n" + kQuestionTemplate))->total(), 10);
}

TEST_F(SourceTest, MissingTemplateFieldNamesFileLineAndField) {
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n{\"q\": \"b\"}\n");
  ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
  EXPECT_EQ(e.file(), in);
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.field(), "question");
  EXPECT_EQ(e.message(), "missing field (used by request.messages[1].content)");
}

TEST_F(SourceTest, NullTemplateFieldIsRefusedNotSentAsTheWordNull) {
  // A null question used to be sent as the four letters "null".
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n{\"question\": null}\n");
  ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
  EXPECT_EQ(e.file(), in);
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.field(), "question");
  EXPECT_EQ(e.message(), "null (used by request.messages[1].content; give it a value, or leave the item out)");
  // Nested nulls too; other non-string values are still written as JSON.
  EXPECT_THROW(render_template("{{meta.lang}}", json{{"meta", {{"lang", nullptr}}}}), std::out_of_range);
  EXPECT_EQ(render_template("{{n}} {{b}}", json{{"n", 0}, {"b", false}}), "0 false");
}

TEST_F(SourceTest, ScoredJobNeedsTheReferenceFieldOnEveryLine) {
  std::string in = write("in.jsonl", "{\"question\": \"a\", \"answer\": \"#### 1\"}\n{\"question\": \"b\"}\n");
  ConfigError e = open_error(job("input: " + in + "\nscoring: gsm8k" + kQuestionTemplate));
  EXPECT_EQ(e.file(), in);
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.field(), "answer");
  EXPECT_NE(e.message().find("scoring.reference_field"), std::string::npos) << e.message();
  e = open_error(job("input: " + in + "\nscoring: {type: exact_match, reference_field: nope}" + kQuestionTemplate));
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.field(), "nope");
  // Unscored, or scored by a pattern (which reads the output alone), the same input is fine; a
  // null reference is an item without one, left unscored.
  EXPECT_NO_THROW(open_source(job("input: " + in + kQuestionTemplate)));
  EXPECT_EQ(drain(*open_source(job("input: " + in + "\nscoring: {type: regex, pattern: x}" + kQuestionTemplate))).size(), 2u);
  std::string nulls = write("nulls.jsonl", "{\"question\": \"a\", \"answer\": null}\n");
  EXPECT_NO_THROW(open_source(job("input: " + nulls + "\nscoring: gsm8k" + kQuestionTemplate)));
}

// GSM8K scoring reads a "#### N" line or a bare number: a reference with neither would leave the
// item's scores empty, unsaid.
TEST_F(SourceTest, Gsm8kReferenceWithoutAFinalAnswerIsRefused) {
  std::string in = write("in.jsonl", "{\"question\": \"a\", \"answer\": \"so 5\\n#### 5\"}\n"
                                     "{\"question\": \"b\", \"answer\": 7}\n"
                                     "{\"question\": \"c\", \"answer\": \" $1,000 \"}\n"
                                     "{\"question\": \"d\", \"answer\": \"no hashes here\\n5 apples\"}\n");
  ConfigError e = open_error(job("input: " + in + "\nscoring: gsm8k" + kQuestionTemplate));
  EXPECT_EQ(e.file(), in);
  EXPECT_EQ(e.line(), 4);
  EXPECT_EQ(e.field(), "answer");
  EXPECT_EQ(e.message(),
            "no final answer to score against: gsm8k scoring reads a '#### N' line or a bare number, got "
            "\"no hashes here\\n5 apples\" (set scoring.reference_field to the field that holds it, or use exact or "
            "regex scoring)");
  e = open_error(job("input: " + in + "\nscoring: {type: gsm8k, reference_field: question}" + kQuestionTemplate));
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.field(), "question");
  // Other scorers take any text.
  EXPECT_NO_THROW(open_source(job("input: " + in + "\nscoring: exact_match" + kQuestionTemplate)));
  // A blank reference is an item without one, as null is; a number is its own gold.
  std::string unlabeled = write("unlabeled.jsonl", "{\"question\": \"a\", \"answer\": \"\"}\n"
                                                   "{\"question\": \"b\", \"answer\": \" \\n\"}\n"
                                                   "{\"question\": \"c\", \"answer\": 1e21}\n");
  EXPECT_NO_THROW(open_source(job("input: " + unlabeled + "\nscoring: gsm8k" + kQuestionTemplate)));
}

// An input rewritten while the job runs, with as many lines, is not read on as if it were the
// one checked: the first changed line stops it, named.
TEST_F(SourceTest, ALineRewrittenWhileTheJobRunsIsNotReadOn) {
  // Lines longer than the reader's buffer, each ending in what differs: the second line's end is
  // read from the file after the rewrite.
  const auto text = [](const std::string& second) {
    const std::string pad = std::string(20000, 'x');
    return "{\"pad\": \"" + pad + "\", \"q\": \"a\"}\n{\"pad\": \"" + pad + "\", \"q\": \"" + second +
           "\"}\n{\"pad\": \"" + pad + "\", \"q\": \"c\"}\n";
  };
  std::string in = write("in.jsonl", text("b"));
  auto source = open_source(job("input: " + in + "\nrequest: {messages: [{role: user, content: \"{{q}}\"}]}\n"));
  ASSERT_TRUE(source->next());
  write("in.jsonl", text("B"));
  try {
    source->next();
    ADD_FAILURE() << "the rewritten line was read on";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.line(), 2);
    EXPECT_EQ(e.message(), "input changed while the job ran (this line is not the one checked at the start)");
  }
}

// An input line's message without content is refused, as in a job file; an assistant message
// that calls tools may leave it out.
TEST_F(SourceTest, LineMessageWithoutContentIsRefused) {
  std::string in = write("in.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n"
                                     "{\"messages\": [{\"role\": \"user\"}]}\n");
  ConfigError e = open_error(job("input: " + in + "\n"));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.field(), "messages[0].content");
  EXPECT_EQ(e.message(), "required (a string or a list of content parts)");
  in = write("batch.jsonl",
             R"({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null}]}})"
             "\n");
  e = open_error(job("input: " + in + "\n"));
  EXPECT_EQ(e.field(), "body.messages[1].content");
  in = write("calls.jsonl",
             R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "1"}]})"
             "\n");
  EXPECT_NO_THROW(open_source(job("input: " + in + "\n")));
}

// Content parts beyond plain text (an image, a text part with cache_control) and message keys
// the reader does not know go to an API as given, their text joined into content for estimates;
// the embedded engine reads the text alone and refuses a part that is not text, naming it.
TEST_F(SourceTest, ContentPartsBeyondTextGoToAnApiAsGiven) {
  const std::string image = R"({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}})";
  const std::string cached = R"({"type": "text", "text": "Describe it.", "cache_control": {"type": "ephemeral"}})";
  std::string in = write("batch.jsonl",
                         R"({"custom_id": "a", "body": {"messages": [{"role": "user", "content": [)" + cached + ", " + image +
                             R"(], "prefix": false}]}})" "\n"
                             R"({"custom_id": "b", "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]}})" "\n");
  std::vector<Item> items = drain(*open_source(job("input: " + in + "\nbackend: {base_url: http://h/v1}\n")));
  ASSERT_EQ(items.size(), 2u);
  const batchlm::ChatMessage& m = items[0].request.messages.at(0);
  EXPECT_EQ(m.content, "Describe it.");
  EXPECT_EQ(m.parts, nlohmann::ordered_json::parse("[" + cached + ", " + image + "]"));
  EXPECT_EQ(m.fields, nlohmann::ordered_json::parse(R"({"prefix": false})"));
  // The image is counted as an image, not as its base64's length.
  EXPECT_GT(items[0].estimated_prompt_tokens, 700);
  // Plain text parts are joined as before, and nothing is kept beside them.
  const batchlm::ChatMessage& plain = items[1].request.messages.at(0);
  EXPECT_EQ(plain.content, "one\ntwo");
  EXPECT_TRUE(plain.parts.is_null());
  EXPECT_TRUE(plain.fields.is_null());

  // The embedded engine: the image is refused where it is, the text part's hint is left.
  ConfigError e = open_error(job("input: " + in + "\n"));
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.field(), "body.messages[0].content[1].type");
  EXPECT_EQ(e.message(), "'image_url' parts need an API backend (backend.base_url): the embedded engine reads text only");
  std::string text_only = write("text.jsonl", R"({"messages": [{"role": "user", "content": [)" + cached + R"(]}]})" "\n");
  items = drain(*open_source(job("input: " + text_only + "\n")));
  ASSERT_EQ(items.size(), 1u);
  EXPECT_EQ(items[0].request.messages.at(0).content, "Describe it.");
  EXPECT_TRUE(items[0].request.messages.at(0).parts.is_null());

  // Parts that are not parts, a text part without text, and an empty list are said so.
  const std::pair<std::string, std::string> bad[] = {
      {R"([{"text": "x"}])", "body.messages[0].content[0]"},
      {R"(["x"])", "body.messages[0].content[0]"},
      {R"([{"type": "text", "text": 5}])", "body.messages[0].content[0].text"},
      {R"([])", "body.messages[0].content"},
  };
  for (const auto& [content, field] : bad) {
    std::string f = write("bad.jsonl", R"({"custom_id": "a", "body": {"messages": [{"role": "user", "content": )" + content + "}]}}\n");
    e = open_error(job("input: " + f + "\nbackend: {base_url: http://h/v1}\n"));
    EXPECT_EQ(e.field(), field) << content;
  }
}

// A model placeholder that a line fills with nothing would send the backend's model for it.
TEST_F(SourceTest, AModelPlaceholderALineLeavesEmptyIsRefused) {
  std::string in = write("in.jsonl", "{\"q\": \"a\", \"m\": \"gpt-4o\"}\n{\"q\": \"b\", \"m\": \" \"}\n");
  ConfigError e = open_error(job("input: " + in + "\nbackend: {base_url: http://h/v1}\n"
                                 "request: {model: \"{{m}}\", messages: [{role: user, content: \"{{q}}\"}]}\n"));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.field(), "request.model");
  EXPECT_EQ(e.message(), "'{{m}}' gives this line an empty model; give each line one, or leave request.model out for "
                         "the backend's");
}

// A Batch-API line's empty model would go out as the job's, which the line never named.
TEST_F(SourceTest, BatchLineWithAnEmptyModelIsRefused) {
  std::string in = write("batch.jsonl", R"({"custom_id": "a", "body": {"model": "", "messages": [{"role": "user", "content": "hi"}]}})"
                                        "\n");
  ConfigError e = open_error(job("input: " + in + "\n"));
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.field(), "body.model");
  EXPECT_EQ(e.message(), "empty; name a model, or leave the key out for the job's");
}

// -m with a Batch-API file whose bodies name their model: the bodies win, and the run says so.
TEST_F(SourceTest, AModelFlagThatBatchBodiesOverrideIsWarnedAbout) {
  std::string in = write("batch.jsonl",
                         R"({"custom_id": "a", "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}})"
                         "\n"
                         R"({"custom_id": "b", "body": {"messages": [{"role": "user", "content": "hi"}]}})"
                         "\n");
  const std::string yaml = "input: " + in + "\nbackend: {base_url: http://h/v1}\n";
  auto flagged = open_source(load_job_text(yaml, "jobs/t.yaml", {Override{"backend.model", "foo", true, "-m"}}, no_env()));
  ASSERT_EQ(flagged->warnings().size(), 1u);
  EXPECT_EQ(flagged->warnings()[0],
            "-m: backend.model: 'foo' is not sent for the 1 Batch-API line whose body names its own model "
            "('gpt-4o-mini' on line 1): a body's model wins; take the model out of the bodies to use this one");
  // The file's own model is the default the bodies were written against: nothing to say.
  EXPECT_TRUE(open_source(job(yaml))->warnings().empty());
  // With request.model set, that is the job's model; a -m (backend.model) is not what the
  // bodies override, and the file's model is not quoted as the flag's.
  const std::string with_request_model =
      yaml + "request: {model: file-model, messages: [{role: user, content: hi}]}\n";
  EXPECT_TRUE(open_source(load_job_text(with_request_model, "jobs/t.yaml", {Override{"backend.model", "foo", true, "-m"}},
                                        no_env()))
                  ->warnings()
                  .empty());
}

TEST_F(SourceTest, PromptThatIsNotAStringNamesItsType) {
  std::string in = write("in.jsonl", "{\"prompt\": \"hi\"}\n{\"prompt\": 5}\n");
  ConfigError e = open_error(job("input: " + in + "\n"));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.field(), "prompt");
  EXPECT_EQ(e.message(), "expected a string, got number");
}

TEST_F(SourceTest, LineThatIsNotAnObjectIsAnError) {
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n[1, 2]\n");
  ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(), "expected a JSON object, got array");
  std::string broken = write("broken.jsonl", "{\"question\": \"a\"}\n\n{\"question\": \n");
  EXPECT_EQ(open_error(job("input: " + broken + kQuestionTemplate)).line(), 3);
}

TEST_F(SourceTest, LineThatIsNotUtf8SaysSo) {
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n{\"question\": \"caf\xFF\"}\n");
  ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(), "not valid UTF-8 (byte 0xFF at byte 17); JSON Lines are UTF-8");
}

TEST_F(SourceTest, InputFieldsNoItemHasAreWarnedAbout) {
  std::string in = write("in.jsonl", "{\"question\": \"a\", \"id\": 1}\n{\"question\": \"b\", \"level\": 2}\n");
  auto source = open_source(job("input: " + in + "\noutput: {input_fields: [questoin, level, id]}\n" + kQuestionTemplate));
  ASSERT_EQ(source->warnings().size(), 1u);
  EXPECT_EQ(source->warnings()[0], "jobs/t.yaml:2:24: output.input_fields: no item of " + in +
                                       " has the field 'questoin'; records will not have it");
  // Given by --set, the --set is named.
  auto set = open_source(load_job_text("input: " + in + kQuestionTemplate, "jobs/t.yaml",
                                       {Override{"output.input_fields", "[foo]"}}, no_env()));
  ASSERT_EQ(set->warnings().size(), 1u);
  EXPECT_EQ(set->warnings()[0].rfind("--set: output.input_fields: no item of ", 0), 0u) << set->warnings()[0];
  EXPECT_TRUE(open_source(job("input: " + in + "\noutput: {input_fields: [question]}\n" + kQuestionTemplate))
                  ->warnings()
                  .empty());
}

TEST_F(SourceTest, BatchLinesMustAskForChatCompletions) {
  const std::string good = R"({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}})";
  auto second = [&](const std::string& line) {
    return open_error(job("input: " + write("b.jsonl", good + "\n" + line + "\n") + "\n"));
  };
  ConfigError e = second(R"({"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"messages": [{"role": "user", "content": "hi"}]}})");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.field(), "url");
  EXPECT_EQ(e.message(), "expected \"/v1/chat/completions\" (only chat completions are supported), got \"/v1/embeddings\"");
  e = second(R"({"custom_id": "b", "method": "GET", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}})");
  EXPECT_EQ(e.field(), "method");
  e = second(R"({"custom_id": "b", "body": {"messages": [{"role": "wizard", "content": "hi"}]}})");
  EXPECT_EQ(e.field(), "body.messages[0].role");
  EXPECT_EQ(e.message(), "bad value 'wizard' (expected one of: system, developer, user, assistant, tool)");
  // Without method and url the line is still a chat completion.
  EXPECT_EQ(drain(*open_source(job("input: " + write("c.jsonl", good + "\n" + R"({"custom_id": "b", "body": {"messages": [{"role": "user", "content": "x"}]}})" + "\n") + "\n"))).size(), 2u);
}

// Found by fuzzing (tests/fuzz/corpus/source): a number beyond a double escaped as nlohmann's
// out_of_range, which named neither the file nor the line.
TEST_F(SourceTest, NumberOutOfRangeNamesTheLine) {
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n{\"question\": 1e999}\n");
  ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
  EXPECT_EQ(e.file(), in);
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(), "number out of range, 1e999 (at byte 18)");
}

// A line that is not JSON says where reading stopped and what was found there.
TEST_F(SourceTest, InvalidJsonLineSaysWhatWasWrong) {
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n{\"question\": \"b\",}\n");
  ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(), "not valid JSON (at byte 18: unexpected '}'; expected string literal)");
}

TEST_F(SourceTest, DeeplyNestedLineIsAnError) {
  // 100,000 levels (200 KB) overflowed the stack where the item's input was copied.
  std::string in = write("in.jsonl", "{\"question\": " + std::string(100'000, '[') + std::string(100'000, ']') + "}\n");
  ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.message(), "arrays and objects nested more than 256 deep");
  std::string ok = write("ok.jsonl", "{\"question\": " + std::string(255, '[') + std::string(255, ']') + "}\n");
  EXPECT_EQ(open_source(job("input: " + ok + kQuestionTemplate))->total(), 1);
}

TEST_F(SourceTest, LongLinesAreReadWhole) {
  // Longer than the reader's 64 KiB chunks, with a CRLF end, and a last line without an end.
  const std::string question(200'000, 'q');
  std::string in = write("in.jsonl", "{\"question\": \"" + question + "\"}\r\n{\"question\": \"b\"}");
  std::vector<Item> items = drain(*open_source(job("input: " + in + kQuestionTemplate)));
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[0].input["question"], question);
  EXPECT_EQ(items[1].input["question"], "b");
  EXPECT_EQ(items[1].id, json(2));
}

TEST_F(SourceTest, LineLongerThan16MiBIsAnError) {
  // A file that is not JSONL may have no line end at all: it is not read into memory whole.
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n" + std::string((std::size_t{16} << 20) + 1, 'x'));
  ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(), "line longer than 16 MiB (is this a JSONL file?)");
}

TEST_F(SourceTest, BatchMaxTokensBeyondAnIntIsAnError) {
  // 4294967297 used to become max_tokens 1.
  for (const char* value : {"4294967297", "18446744073709551615", "0"}) {
    std::string in = write("batch.jsonl", std::string(R"({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": )") + value + "}}\n");
    ConfigError e = open_error(job("input: " + in + "\n"));
    EXPECT_EQ(e.field(), "body.max_tokens") << value;
    EXPECT_EQ(e.message(), "expected an integer from 1 to 2147483647") << value;
  }
}

TEST_F(SourceTest, BatchLineWithAnEmptyStopStringIsAnError) {
  // An empty stop string stops nothing; an API may refuse it, and the engine would ignore it.
  for (const char* value : {R"("")", R"(["END", ""])"}) {
    std::string in = write("batch.jsonl", std::string("{\"custom_id\": \"a\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}}\n") +
                                              R"({"custom_id": "b", "body": {"messages": [{"role": "user", "content": "Hi"}], "stop": )" + value + "}}\n");
    ConfigError e = open_error(job("input: " + in + "\n"));
    EXPECT_EQ(e.line(), 2) << value;
    EXPECT_EQ(e.field(), "body.stop") << value;
    EXPECT_EQ(e.message(), "an empty string stops nothing: leave it out") << value;
  }
}

TEST_F(SourceTest, BatchFormatIsDetectedAndMapped) {
  std::string in = write("batch.jsonl", R"({"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 20, "temperature": 0.2, "top_p": 0.9, "stop": "END", "seed": 5, "response_format": {"type": "json_object"}, "stream": true}}
{"custom_id": "req-2", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]}}
)");
  auto source = open_source(
      job("input: " + in + "\nrequest: {model: fallback, max_tokens: 64}\nbackend: {base_url: http://127.0.0.1:1/v1}\n"));
  EXPECT_EQ(source->total(), 2);
  std::vector<Item> items = drain(*source);
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[0].id, json("req-1"));
  EXPECT_EQ(items[0].id_key, "\"req-1\"");
  EXPECT_EQ(items[0].input["custom_id"], "req-1");  // the whole line
  EXPECT_EQ(items[0].request.model, "gpt-x");
  // max_completion_tokens goes to an API as written (reasoning models refuse max_tokens), and
  // the job's max_tokens not beside it.
  EXPECT_EQ(items[0].request.max_tokens, std::nullopt);
  EXPECT_EQ(items[0].request.temperature, 0.2);
  EXPECT_EQ(items[0].request.top_p, 0.9);
  EXPECT_EQ(items[0].request.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(items[0].request.seed, 5);
  EXPECT_EQ(items[0].request.extra,
            (json{{"max_completion_tokens", 20}, {"response_format", {{"type", "json_object"}}}}));
  EXPECT_EQ(items[0].request.messages[0].content, "Hi");
  // What the body leaves out comes from the job.
  EXPECT_EQ(items[1].request.model, "fallback");
  EXPECT_EQ(items[1].request.max_tokens, 64);
  EXPECT_EQ(items[1].request.messages[0].content, "Hel\nlo");  // parts joined by a line break
  // The embedded engine takes it as its max_tokens; a body with both keys is refused.
  std::string local = write("local.jsonl", R"({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 20}})"
                                           "\n");
  const std::vector<Item> on_engine = drain(*open_source(job("input: " + local + "\nrequest: {max_tokens: 64}\n")));
  ASSERT_EQ(on_engine.size(), 1u);
  EXPECT_EQ(on_engine[0].request.max_tokens, 20);
  EXPECT_FALSE(on_engine[0].request.extra.contains("max_completion_tokens"));
  std::string both = write("both.jsonl", R"({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7, "max_completion_tokens": 20}})"
                                         "\n");
  const ConfigError e = open_error(job("input: " + both + "\nbackend: {base_url: http://127.0.0.1:1/v1}\n"));
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.field(), "body.max_completion_tokens");
  EXPECT_EQ(e.message(), "given with max_tokens: the two are one limit; keep one of them");
}

TEST_F(SourceTest, BodyFieldsKeepTheirKeysInTheOrderWritten) {
  // A Batch-API body's tools, and a job file's extra fields, reach the request as written: the
  // embedded engine writes tools into the prompt as a template would.
  const std::string tool = R"({"type": "function", "function": {"name": "set", "parameters": {"type": "object", )"
                           R"("properties": {"room": {"type": "string"}, "celsius": {"type": "number"}}}}})";
  std::string in = write("tools.jsonl", R"({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "Hi"}], "tools": [)" +
                                            tool + "]}}\n");
  auto source = open_source(job("input: " + in +
                                "\nrequest: {extra: {zeta: 1, alpha: {y: 2, b: 3}}}\nbackend: {base_url: http://127.0.0.1:1/v1}\n"));
  std::vector<Item> items = drain(*source);
  ASSERT_EQ(items.size(), 1u);
  EXPECT_EQ(items[0].request.extra.dump(),
            R"({"zeta":1,"alpha":{"y":2,"b":3},"tools":[)" + nlohmann::ordered_json::parse(tool).dump() + "]}");
}

TEST_F(SourceTest, BatchLineAskingForSeveralAnswersIsAnError) {
  std::string in = write("batch.jsonl",
                         R"({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}})"
                         "\n"
                         R"({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"n": 2, "messages": [{"role": "user", "content": "hi"}]}})"
                         "\n");
  ConfigError e = open_error(job("input: " + in + "\n"));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.field(), "body.n");
}

TEST_F(SourceTest, BatchFieldsTheEmbeddedEngineWouldIgnoreAreErrors) {
  const std::string line1 =
      R"({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "top_k": 5, "user": "u", "presence_penalty": 0}})";
  const std::string line2 =
      R"({"custom_id": "b", "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}}}}}})";
  std::string in = write("batch.jsonl", line1 + "\n" + line2 + "\n");
  ConfigError e = open_error(job("input: " + in + "\n"));
  EXPECT_EQ(e.file(), in);
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.field(), "body.response_format");
  EXPECT_TRUE(e.message().starts_with("json_schema.schema at /properties/n/minimum: 'minimum' is not supported"))
      << e.message();
  // A min_tokens past the line's own max_tokens.
  std::string least = write("least.jsonl", line1 + "\n" +
                                               R"({"custom_id": "c", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 9}})"
                                               "\n");
  ConfigError over = open_error(job("input: " + least + "\n"));
  EXPECT_EQ(over.line(), 2);
  EXPECT_EQ(over.field(), "body.min_tokens");
  EXPECT_EQ(over.message(), "asks for at least 9 tokens, more than max_tokens (4) lets out");
  // The first line alone runs on the engine; through an API the second passes through.
  std::string first = write("first.jsonl", line1 + "\n");
  EXPECT_EQ(drain(*open_source(job("input: " + first + "\n")))[0].request.extra["top_k"], 5);
  std::vector<Item> items = drain(*open_source(job("input: " + in + "\nbackend: {base_url: http://127.0.0.1:1/v1}\n")));
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[1].request.extra["response_format"]["type"], "json_schema");
}

TEST_F(SourceTest, DuplicateCustomIdNamesBothLines) {
  std::string body = R"("body": {"messages": [{"role": "user", "content": "x"}]})";
  std::string in = write("batch.jsonl", "{\"custom_id\": \"a\", " + body + "}\n{\"custom_id\": \"b\", " +
                                            body + "}\n{\"custom_id\": \"a\", " + body + "}\n");
  ConfigError e = open_error(job("input: " + in + "\n"));
  EXPECT_EQ(e.file(), in);
  EXPECT_EQ(e.line(), 3);
  EXPECT_EQ(e.field(), "custom_id");
  EXPECT_EQ(e.message(), "duplicate custom_id \"a\" (first on line 1)");
}

// custom_id is a string, as the Batch API has it: a number is refused as one (5 and "5" would
// be two items), an empty one names nothing; a body that is there but no object is not "missing".
TEST_F(SourceTest, BatchCustomIdAndBodyErrorsSayWhatIsWrong) {
  const std::string body = R"("body": {"messages": [{"role": "user", "content": "x"}]})";
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {R"({"custom_id": 5.5, )" + body + "}", "custom_id", "must be a string, got a number (write it in quotes: \"5.5\")"},
      {R"({"custom_id": 5, )" + body + "}", "custom_id", "must be a string, got a number (write it in quotes: \"5\")"},
      {R"({"custom_id": true, )" + body + "}", "custom_id", "must be a string, got a boolean"},
      {R"({"custom_id": "", )" + body + "}", "custom_id", "must not be empty (it names the item in the output)"},
      {R"({"custom_id": null, )" + body + "}", "custom_id", "missing (a string) in a Batch-API line"},
      {R"({"custom_id": "a", "body": "x"})", "body", "must be an object (the request's body), got a string"},
      {R"({"custom_id": "a", "body": []})", "body", "must be an object (the request's body), got an array"},
  };
  for (const auto& [text, field, message] : cases) {
    std::string in = write("batch.jsonl", std::string(R"({"custom_id": "first", )") + body + "}\n" + text + "\n");
    ConfigError e = open_error(job("input: " + in + "\n"));
    EXPECT_EQ(e.line(), 2) << text;
    EXPECT_EQ(e.field(), field) << text;
    EXPECT_EQ(e.message(), message) << text;
  }
}

// An integer past 64 bits would be held as the nearest double, and reach prompts, references
// and the output as other digits: the line is refused, naming the field; within 64 bits, and
// floats of any size, pass as written.
TEST_F(SourceTest, IntegersPast64BitsAreAnErrorNamingTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"question": "a", "id": 12345678901234567890123})", "id"},
      {R"({"question": "a", "x": [1, {"n": -9223372036854775809}]})", "x[1].n"},
      {R"({"question": "a", "ref": 18446744073709551616})", "ref"},
  };
  for (const auto& [text, field] : cases) {
    std::string in = write("in.jsonl", "{\"question\": \"a\"}\n" + text + "\n");
    ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
    EXPECT_EQ(e.line(), 2) << text;
    EXPECT_EQ(e.field(), field) << text;
    EXPECT_TRUE(e.message().starts_with("the integer ")) << e.message();
    EXPECT_TRUE(e.message().ends_with(" does not fit in 64 bits, and would not keep its digits; write it as a string"))
        << e.message();
  }
  std::string in = write("in.jsonl", R"({"question": "a", "big": 18446744073709551615, "low": -9223372036854775808, )"
                                     R"("f": 1.5e300, "g": 12345678901234567890123.0})" "\n");
  const std::vector<Item> items = drain(*open_source(job("input: " + in + kQuestionTemplate)));
  ASSERT_EQ(items.size(), 1u);
  EXPECT_EQ(items[0].input["big"].dump(), "18446744073709551615");
  EXPECT_EQ(items[0].input["low"].dump(), "-9223372036854775808");
}

// A key given twice in one line is refused, as in a job file: which value was meant?
TEST_F(SourceTest, DuplicateKeysInALineAreAnError) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"text": "a", "text": "b"})", "text"},
      {R"({"q": {"a": 1, "b": 2, "a": 3}})", "q.a"},
      {R"({"q": [1, {"x": 1}, {"y": 1, "y": 2}]})", "q[2].y"},
      {R"({"q": [[1], [2, 3], {"z": [{}, {"k": 0, "k": 0}]}]})", "q[2].z[1].k"},
  };
  for (const auto& [text, field] : cases) {
    std::string in = write("in.jsonl", "{\"question\": \"a\"}\n\n" + text + "\n");
    ConfigError e = open_error(job("input: " + in + kQuestionTemplate));
    EXPECT_EQ(e.file(), in) << text;
    EXPECT_EQ(e.line(), 3) << text;
    EXPECT_EQ(e.field(), field) << text;
    EXPECT_EQ(e.message(), "duplicate key") << text;
  }
  // The same key in two objects is no duplicate.
  std::string in = write("in.jsonl", R"({"question": "a", "x": {"question": 1}, "y": [{"k": 1}, {"k": 2}]})" "\n");
  EXPECT_EQ(drain(*open_source(job("input: " + in + kQuestionTemplate))).size(), 1u);
}

TEST_F(SourceTest, ExplicitBatchFormatRejectsPlainLines) {
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n");
  ConfigError e = open_error(job("input: {path: " + in + ", format: batch}\n"));
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.field(), "custom_id");
}

TEST_F(SourceTest, ExplicitJsonlFormatTreatsBatchLikeLinesAsPlainItems) {
  std::string in = write("in.jsonl", R"({"custom_id": "a", "body": {}, "prompt": "p"})" "\n");
  Item item = *open_source(job("input: {path: " + in + ", format: jsonl}\n"))->next();
  EXPECT_EQ(item.id, json(1));
  EXPECT_EQ(item.request.messages[0].content, "p");
}

namespace {
const char* kSynthJob = R"(kind: synth
synth:
  count: 50
  seed: 7
  variables:
    animal: [cat, dog, owl, fox, bee]
    color: [red, blue, green]
request:
  messages: [{role: user, content: "A {{color}} {{animal}}"}]
)";
}

// Variables a --set replaced, which the template no longer finds: the message says the flag
// did it, where the template's line alone would blame the template.
TEST_F(SourceTest, SynthVariablesAFlagReplacedAreBlamedOnIt) {
  try {
    open_source(load_job_text(kSynthJob, "jobs/t.yaml", {parse_override("synth.variables={x: [a]}")}, no_env()));
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message(), "{{color}} is not a synth variable (variables: x); synth.variables was set by --set");
  }
  // A template's own missing variable is the template's: no flag is named.
  std::string unknown = kSynthJob;
  unknown.replace(unknown.find("{{color}}"), std::string("{{color}}").size(), "{{size}}");
  try {
    open_source(job(unknown));
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message(), "{{size}} is not a synth variable (variables: animal, color)");
  }
}

TEST_F(SourceTest, SynthDrawsVariablesFromTheirChoices) {
  auto source = open_source(job(kSynthJob));
  EXPECT_EQ(source->total(), 50);
  std::vector<Item> items = drain(*source);
  ASSERT_EQ(items.size(), 50u);
  EXPECT_EQ(items.front().id, json(1));
  EXPECT_EQ(items.back().id, json(50));
  std::set<std::string> animals;
  for (const Item& item : items) {
    std::string animal = item.input["animal"], color = item.input["color"];
    animals.insert(animal);
    EXPECT_EQ(item.request.messages[0].content, "A " + color + " " + animal);
  }
  EXPECT_GE(animals.size(), 4u);  // 50 draws from 5 choices miss at most one, all but surely
}

TEST_F(SourceTest, SynthItemDependsOnlyOnSeedAndIndex) {
  std::vector<Item> all = drain(*open_source(job(kSynthJob)));
  std::vector<Item> first = drain(*open_source(job(std::string(kSynthJob) + "limit: 10\n")));
  ASSERT_EQ(first.size(), 10u);
  for (std::size_t i = 0; i < first.size(); ++i) EXPECT_EQ(first[i].input, all[i].input);
  // A longer run keeps the same first items.
  std::string more = kSynthJob;
  more.replace(more.find("count: 50"), 9, "count: 80");
  std::vector<Item> longer = drain(*open_source(job(more)));
  for (std::size_t i = 0; i < all.size(); ++i) EXPECT_EQ(longer[i].input, all[i].input);
  // Another seed draws other items.
  std::string reseeded = kSynthJob;
  reseeded.replace(reseeded.find("seed: 7"), 7, "seed: 8");
  std::vector<Item> other = drain(*open_source(job(reseeded)));
  int same = 0;
  for (std::size_t i = 0; i < all.size(); ++i) same += other[i].input == all[i].input;
  EXPECT_LT(same, 25);
}

TEST_F(SourceTest, SynthTemplateFieldMustBeAVariable) {
  std::string yaml = kSynthJob;
  yaml.replace(yaml.find("{{color}}"), 9, "{{colour}}");
  ConfigError e = open_error(job(yaml));
  EXPECT_EQ(e.file(), "jobs/t.yaml");
  EXPECT_EQ(e.field(), "request.messages[0].content");
  EXPECT_EQ(e.message(), "{{colour}} is not a synth variable (variables: animal, color)");
  EXPECT_EQ(e.line(), 9);  // where the message's content is written
  EXPECT_EQ(e.column(), 36);
}

TEST_F(SourceTest, FewShotGoesBeforeTheLastMessageAndIsSharedByAllItems) {
  std::string train;
  for (int i = 0; i < 20; ++i)
    train += "{\"question\": \"tq" + std::to_string(i) + "\", \"answer\": \"ta" + std::to_string(i) + "\"}\n";
  std::string few = write("train.jsonl", train);
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n{\"question\": \"b\"}\n");
  std::string yaml = "input: " + in + "\nfew_shot: {path: " + few +
                     ", count: 3, seed: 5, user: 'Q: {{question}}', assistant: 'A: {{answer}}'}\n" +
                     kQuestionTemplate;
  std::vector<Item> items = drain(*open_source(job(yaml)));
  ASSERT_EQ(items.size(), 2u);
  const auto& m = items[0].request.messages;
  ASSERT_EQ(m.size(), 2u + 6u);
  EXPECT_EQ(m[0].content, "Answer.");
  std::set<std::string> questions;
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(m[1 + 2 * k].role, "user");
    EXPECT_EQ(m[2 + 2 * k].role, "assistant");
    std::string q = m[1 + 2 * k].content.substr(5);  // "Q: tq"
    EXPECT_EQ(m[2 + 2 * k].content, "A: ta" + q);  // the pair comes from one example
    questions.insert(q);
  }
  EXPECT_EQ(questions.size(), 3u);  // without replacement
  EXPECT_EQ(m.back().content, "Q: a");
  for (std::size_t i = 0; i + 1 < m.size(); ++i)
    EXPECT_EQ(items[1].request.messages[i].content, m[i].content);  // shared prefix
  // The same seed draws the same examples on every run; another seed, others.
  EXPECT_EQ(drain(*open_source(job(yaml)))[0].request.messages[3].content, m[3].content);
  std::string reseeded = yaml;
  reseeded.replace(reseeded.find("seed: 5"), 7, "seed: 6");
  std::vector<batchlm::ChatMessage> other = drain(*open_source(job(reseeded)))[0].request.messages;
  bool differs = false;
  for (std::size_t i = 1; i < 7; ++i) differs |= other[i].content != m[i].content;
  EXPECT_TRUE(differs);
}

TEST_F(SourceTest, FewShotErrorsNameTheFewShotFile) {
  std::string few = write("train.jsonl", "{\"question\": \"q\"}\n");
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n");
  ConfigError e = open_error(job("input: " + in + "\nfew_shot: {path: " + few + ", count: 2}\n" +
                                 kQuestionTemplate));
  EXPECT_EQ(e.file(), few);
  EXPECT_EQ(e.message(), "asks for 2 examples but the file has 1");
  e = open_error(job("input: " + in + "\nfew_shot: {path: " + few + ", count: 1}\n" + kQuestionTemplate));
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.field(), "answer");
  // A broken line is refused whether or not the seed draws it.
  std::string broken = write("broken.jsonl", "{\"question\": \"q1\", \"answer\": \"a1\"}\n"
                                             "{\"question\": \"q2\", \"answer\": \"a2\"}\n"
                                             "{\"question\": \"broken\", \n"
                                             "{\"question\": \"q4\", \"answer\": \"a4\"}\n");
  for (const int count : {1, 2, 3}) {
    e = open_error(job("input: " + in + "\nfew_shot: {path: " + broken + ", count: " + std::to_string(count) +
                       "}\n" + kQuestionTemplate));
    EXPECT_EQ(e.file(), broken) << count;
    EXPECT_EQ(e.line(), 3) << count;
  }
}

TEST(ShippedJobSources, Gsm8kStreamsTheTestSetWithEightShots) {
  std::string file = std::string(BATCHLM_SOURCE_DIR) + "/jobs/gsm8k.yaml";
  EnvLookup env = [](const std::string& name) -> std::optional<std::string> {
    if (name == "BATCHLM_DATA") return std::string(BATCHLM_SHARED_DATA);
    return std::nullopt;
  };
  JobSpec spec = load_job_file(file, {}, env);
  auto source = open_source(spec);
  EXPECT_EQ(source->total(), 1319);
  Item first = *source->next();
  EXPECT_EQ(first.id, json(1));
  ASSERT_EQ(first.request.messages.size(), 2u + 16u);
  EXPECT_EQ(first.request.messages.back().content, first.input["question"]);
  EXPECT_NE(first.request.messages[2].content.find("####"), std::string::npos);
}

TEST(ShippedJobSources, StoriesPromptsNameTheirWords) {
  EnvLookup env = [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
  JobSpec spec = load_job_text(builtin_stories_yaml(), "<builtin:stories>", {}, env);
  auto source = open_source(spec);
  EXPECT_EQ(source->total(), 1000);
  Item item = *source->next();
  const std::string& prompt = item.request.messages.at(0).content;
  EXPECT_NE(prompt.find("'" + item.input["verb"].get<std::string>() + "'"), std::string::npos);
  EXPECT_NE(prompt.find("'" + item.input["noun"].get<std::string>() + "'"), std::string::npos);
  EXPECT_EQ(prompt.find("{{"), std::string::npos);
}

// A resumed output's records are counted as done only where their ids are this run's items.
TEST_F(SourceTest, CountsWhichIdsAreItsOwnItems) {
  std::string in = write("in.jsonl", "{\"question\": \"a\"}\n\n{\"question\": \"b\"}\n{\"question\": \"c\"}\n");
  auto lines = open_source(job("input: " + in + kQuestionTemplate + "limit: 2\n"));  // ids 1 and 3
  EXPECT_EQ(lines->count_own({"1", "3", "4", "2", "\"1\"", "x"}), 2);
  EXPECT_EQ(lines->count_own({}), 0);
  std::string batch = write("batch.jsonl",
                            R"({"custom_id": "r-1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}})"
                            "\n"
                            R"({"custom_id": "r-2", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "ho"}]}})"
                            "\n");
  EXPECT_EQ(open_source(job("input: " + batch + "\n"))->count_own({"\"r-1\"", "\"r-2\"", "\"r-3\"", "r-1"}), 2);
  // A synth job's items are 1..count (after its limit), written as JSON numbers.
  auto synth = open_source(job(std::string(kSynthJob) + "limit: 10\n"));
  EXPECT_EQ(synth->count_own({"1", "10", "11", "0", "-1", "01", "5.0", "1e1", "\"3\""}), 2);
}
