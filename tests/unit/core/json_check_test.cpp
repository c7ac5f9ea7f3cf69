// check_json: the first problem of a JSON text, found without building it.

#include "batchlm/core/json_check.hpp"

#include <chrono>
#include <optional>
#include <string>

#include <gtest/gtest.h>

namespace batchlm {
namespace {

TEST(CheckJson, ValidTextHasNoProblem) {
  EXPECT_FALSE(check_json(R"({"a": [1, 2.5, -3e10, "x", true, null, {"b": {}}]})", 4));
  EXPECT_FALSE(check_json("18446744073709551615", 0));  // the largest unsigned 64-bit integer
  EXPECT_FALSE(check_json("123456789012345678901234567890", 0));  // read as a double
}

TEST(CheckJson, SyntaxErrorsSayWhereReadingStopped) {
  auto problem = check_json(R"({"a": 1,})", 8);
  ASSERT_TRUE(problem);
  EXPECT_EQ(problem->kind, JsonProblem::Kind::kSyntax);
  EXPECT_EQ(problem->byte, 9u);
  problem = check_json("", 8);
  ASSERT_TRUE(problem);
  EXPECT_EQ(problem->kind, JsonProblem::Kind::kSyntax);
  problem = check_json(R"({"a": 1} {"b": 2})", 8);  // one value, then more text
  ASSERT_TRUE(problem);
  EXPECT_EQ(problem->kind, JsonProblem::Kind::kSyntax);
  EXPECT_EQ(problem->byte, 10u);
  EXPECT_EQ(problem->detail, "unexpected '{'; expected end of input");
}

// What was wrong, without the input the parser quotes (which may not be UTF-8).
TEST(CheckJson, SyntaxErrorsSayWhatWasWrong) {
  EXPECT_EQ(check_json(R"({"a": 1,})", 8)->detail, "unexpected '}'; expected string literal");
  EXPECT_EQ(check_json("{\"a\": \"\xc3(\"}", 8)->detail, "invalid string: ill-formed UTF-8 byte");
  EXPECT_EQ(check_json(R"({"a": "\ud800"})", 8)->detail,
            "invalid string: surrogate U+D800..U+DBFF must be followed by U+DC00..U+DFFF");
  EXPECT_EQ(check_json("tru", 8)->detail, "invalid literal");
}

TEST(CheckJson, NumbersBeyondADoubleAreNamed) {
  auto problem = check_json(R"({"n": 1e400})", 8);
  ASSERT_TRUE(problem);
  EXPECT_EQ(problem->kind, JsonProblem::Kind::kNumberOutOfRange);
  EXPECT_EQ(problem->token, "1e400");
  EXPECT_EQ(problem->byte, 11u);  // the number's last character
}

TEST(CheckJson, DepthCountsArraysAndObjects) {
  EXPECT_FALSE(check_json(R"([{"a": [1]}])", 3));
  auto problem = check_json(R"([{"a": [1]}])", 2);
  ASSERT_TRUE(problem);
  EXPECT_EQ(problem->kind, JsonProblem::Kind::kTooDeep);
  // Far deeper than the stack would take if the value were built and copied.
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  problem = check_json(deep, 256);
  ASSERT_TRUE(problem);
  EXPECT_EQ(problem->kind, JsonProblem::Kind::kTooDeep);
  // Closing brackets give the depth back: many shallow values side by side are fine.
  std::string wide = "[";
  for (int i = 0; i < 10'000; ++i) wide += "[[1]],";
  wide += "[]]";
  EXPECT_FALSE(check_json(wide, 3));
}

// The same value as nlohmann's own ordered parse, keys in the order written, for texts with
// objects small and large, nested in arrays and objects.
TEST(ParseOrderedJson, BuildsWhatNlohmannBuilds) {
  std::string many = "{";
  for (int i = 0; i < 300; ++i) many += (i ? "," : "") + std::string("\"k") + std::to_string((i * 7919) % 300) + "\":" + std::to_string(i);
  many += "}";
  for (const std::string& text :
       {std::string("{}"), std::string("[]"), std::string("3"), std::string("\"s\""), std::string("null"),
        std::string(R"({"b":1,"a":[true,false,null,1.5,-2,18446744073709551615,{"z":{},"y":[[]]}],"c":"\u00e9"})"),
        "[" + many + "," + many + "]", R"({"x":)" + many + R"(,"w":1})"}) {
    std::optional<std::string> duplicate;
    const nlohmann::ordered_json value = parse_ordered_json(text, &duplicate);
    EXPECT_EQ(value, nlohmann::ordered_json::parse(text)) << text.substr(0, 80);
    EXPECT_EQ(value.dump(), nlohmann::ordered_json::parse(text).dump()) << text.substr(0, 80);
    EXPECT_FALSE(duplicate) << text.substr(0, 80);
  }
}

// A repeated key keeps its first place and its last value, as nlohmann's parse does, in small
// objects and in indexed ones, and the first repeat's path is said.
TEST(ParseOrderedJson, RepeatedKeysKeepTheirPlaceAndTheLastValue) {
  std::optional<std::string> duplicate;
  nlohmann::ordered_json value = parse_ordered_json(R"({"a":1,"b":2,"a":3})", &duplicate);
  EXPECT_EQ(value.dump(), R"({"a":3,"b":2})");
  EXPECT_EQ(duplicate, "a");

  std::string text = R"({"list":[0,{"in":{)";
  for (int i = 0; i < 100; ++i) text += (i ? "," : "") + std::string("\"k") + std::to_string(i) + "\":" + std::to_string(i);
  text += R"(,"k40":"again","k99":"last","k7":[]}}]})";
  value = parse_ordered_json(text, &duplicate);
  EXPECT_EQ(value.dump(), nlohmann::ordered_json::parse(text).dump());
  EXPECT_EQ(duplicate, "list[1].in.k40");
  EXPECT_EQ(value["list"][1]["in"].size(), 100u);
  EXPECT_EQ(value["list"][1]["in"]["k99"], "last");
}

// One object of 300,000 keys (about 3.4 MB) is built in linear time: nlohmann's insert would
// compare about 4.5 * 10^10 keys (minutes). The bound is generous: well under a second here.
TEST(ParseOrderedJson, ManyKeysInOneObjectAreBuiltInLinearTime) {
  std::string text = "{";
  for (int i = 0; i < 300'000; ++i) text += (i ? ",\"" : "\"") + std::to_string(i) + "\":0";
  text += "}";
  const auto start = std::chrono::steady_clock::now();
  const nlohmann::ordered_json value = parse_ordered_json(text);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(value.size(), 300'000u);
  EXPECT_EQ(value.begin().key(), "0");
  EXPECT_EQ((--value.end()).key(), "299999");
  EXPECT_LT(seconds, 20.0);
}

}  // namespace
}  // namespace batchlm
