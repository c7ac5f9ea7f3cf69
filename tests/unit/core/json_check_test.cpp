// check_json: the first problem of a JSON text, found without building it.

#include "batchlm/core/json_check.hpp"

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

}  // namespace
}  // namespace batchlm
