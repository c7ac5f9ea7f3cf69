// Structured outputs: compile_json_schema (core) refuses what it cannot follow and says where;
// SchemaState (local_engine) takes exactly the texts a schema admits, byte by byte. In
// particular it never leads a text into a dead end: a value may start only where it can still
// end within JsonState's depth limit, and a property, an extra property or an array item that
// can never end (a required property that refers back to its own object) is never begun.

#include "batchlm/local_engine/json_schema.hpp"

#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "batchlm/core/json_schema.hpp"

namespace batchlm::local_engine {
namespace {

using nlohmann::json;

JsonSchema compile(std::string_view text) { return compile_json_schema(json::parse(text)); }

std::string refusal(std::string_view text) {
  try {
    compile(text);
  } catch (const SchemaError& e) {
    return e.what();
  }
  return "(compiled)";
}

bool takes(const JsonSchema& schema, std::string_view text) {
  SchemaState s(schema);
  return s.feed(text) && s.complete();
}

// Some byte continues the text the state has taken.
bool continues(const SchemaState& state) {
  for (int c = 0; c < 256; ++c) {
    SchemaState s = state;
    if (s.feed(static_cast<unsigned char>(c))) return true;
  }
  return false;
}

TEST(JsonSchemaCompile, RefusesWhatItCannotFollowAndSaysWhere) {
  const std::string pattern = refusal(R"({"type": "object", "properties": {"p": {"type": "string", "pattern": "^a"}}})");
  EXPECT_TRUE(pattern.starts_with("at /properties/p")) << pattern;
  EXPECT_EQ(refusal(R"({"type": "array"})"),
            "at the root: the root must admit objects only (\"type\": \"object\"), as OpenAI's structured outputs "
            "ask; this one admits arrays");
  // The root's only object needs itself: no text of it ever ends.
  EXPECT_EQ(refusal(R"({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})"),
            "at the root: admits no object that ends (a required property refers back to the object it is in, or "
            "the nesting it needs is deeper than 64)");
  EXPECT_EQ(refusal(R"({"type": "object", "properties": {"a": {"$ref": "#"}}})"), "(compiled)");
}

TEST(JsonSchemaState, TakesWhatTheSchemaAdmitsOnly) {
  const JsonSchema s = compile(R"({"type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer"},
                   "kind": {"enum": ["a", "b"]}, "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["name"]})");
  EXPECT_TRUE(takes(s, R"({"name": "abc"})"));
  EXPECT_TRUE(takes(s, R"({"tags": [true, false], "n": -12, "name": "", "kind": "b"})"));
  EXPECT_FALSE(takes(s, R"({})"));                            // name is required
  EXPECT_FALSE(SchemaState(s).accepts(R"({"nam": )"));         // not a property
  EXPECT_FALSE(SchemaState(s).accepts(R"({"name": "abcdef)"));  // past maxLength
  EXPECT_FALSE(SchemaState(s).accepts(R"({"n": 1.)"));          // an integer has no fraction
  EXPECT_FALSE(SchemaState(s).accepts(R"({"kind": "c)"));       // outside the enum
  EXPECT_FALSE(SchemaState(s).accepts(R"({"tags": [true, true, )"));  // past maxItems
  EXPECT_FALSE(SchemaState(s).accepts(R"({"name": "a", "name)"));     // each property once
}

// {"a": {"a": ...}} may nest until JsonState's depth limit and must close there; at every step
// of the way some byte continues the text.
TEST(JsonSchemaState, RecursionStopsAtTheDepthLimitWithoutATrap) {
  const JsonSchema s = compile(R"({"type": "object", "properties": {"a": {"$ref": "#"}}})");
  SchemaState state(s);
  int depth = 0;
  while (state.accepts(R"({"a": )")) {
    ASSERT_TRUE(state.feed(R"({"a": )"));
    ASSERT_TRUE(continues(state)) << "trapped at depth " << depth;
    ++depth;
  }
  // The innermost value is an object, which still fits; inside it no property may start, since
  // its value would be one object deeper than the limit.
  EXPECT_EQ(depth, JsonState::kMaxDepth - 1);
  ASSERT_TRUE(state.feed('{'));
  EXPECT_FALSE(state.accepts("\""));
  ASSERT_TRUE(state.accepts("}"));
  std::string rest(static_cast<std::size_t>(depth + 1), '}');
  EXPECT_TRUE(state.feed(rest));
  EXPECT_TRUE(state.complete());
}

// An optional property whose value can never end, and array items that can never end, are
// never begun: the rest of the schema is still followed.
TEST(JsonSchemaState, ValuesThatNeverEndAreNeverBegun) {
  const JsonSchema s = compile(R"({"type": "object",
    "properties": {"x": {"type": "object", "properties": {"a": {"$ref": "#/properties/x"}}, "required": ["a"]},
                   "y": {"type": "null"},
                   "list": {"type": "array", "items": {"$ref": "#/properties/x"}}}})");
  EXPECT_TRUE(takes(s, R"({"y": null, "list": []})"));
  EXPECT_FALSE(SchemaState(s).accepts(R"({"x)"));
  EXPECT_FALSE(SchemaState(s).accepts(R"({"list": [{)"));
  SchemaState state(s);
  for (const char c : std::string_view(R"({"list": [)")) {
    ASSERT_TRUE(continues(state));
    ASSERT_TRUE(state.feed(static_cast<unsigned char>(c)));
  }
  EXPECT_TRUE(state.feed("]}"));
  EXPECT_TRUE(state.complete());
}

}  // namespace
}  // namespace batchlm::local_engine
