#include "batchlm/runner/scoring.hpp"

#include <fstream>

#include <gtest/gtest.h>

using namespace batchlm::runner;
using nlohmann::json;

TEST(NormalizeNumber, RemovesFormattingButKeepsValue) {
  EXPECT_EQ(normalize_number("1,234"), "1234");
  EXPECT_EQ(normalize_number("$18"), "18");
  EXPECT_EQ(normalize_number("18."), "18");
  EXPECT_EQ(normalize_number("42.0"), "42");
  EXPECT_EQ(normalize_number("42.50"), "42.5");
  EXPECT_EQ(normalize_number("+7"), "7");
  EXPECT_EQ(normalize_number("-3"), "-3");
  EXPECT_EQ(normalize_number("-0.0"), "0");
  EXPECT_EQ(normalize_number("007"), "7");
  EXPECT_EQ(normalize_number("0.5"), "0.5");
  EXPECT_EQ(normalize_number(".5"), "0.5");
  EXPECT_EQ(normalize_number(" $1,000,000.00 "), "1000000");
}

TEST(Gsm8kGold, ReadsTheHashLineOfTheReference) {
  EXPECT_EQ(gsm8k_gold("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = "
                       "$<<9*2=18>>18 every day at the farmer’s market.\n#### 18"),
            "18");
  EXPECT_EQ(gsm8k_gold("...\n#### 1,600"), "1600");
  EXPECT_EQ(gsm8k_gold("...\n#### -12"), "-12");
  EXPECT_EQ(gsm8k_gold("42"), "42");
  EXPECT_EQ(gsm8k_gold("no number here"), std::nullopt);
}

TEST(Gsm8kStrict, TakesTheLastHashAnswer) {
  struct Case {
    const char* output;
    std::optional<std::string> expected;
  };
  std::vector<Case> cases = {
      {"She has 3 + 4 = 7 apples.\n#### 7", "7"},
      {"#### 7", "7"},
      {"####7", "7"},
      {"#### $1,250.", "1250"},
      {"#### 18 dollars", "18"},
      {"The answer is 12.\n#### 12.00", "12"},
      {"#### -5", "-5"},
      {"#### +5", "5"},
      {"First guess #### 3\nWait, recheck.\n#### 4", "4"},
      {"#### 4\n#### see above", "4"},
      {"#### : 9", "9"},
      {"The answer is 7.", std::nullopt},
      {"#### seven", std::nullopt},
      {"", std::nullopt},
  };
  for (const Case& c : cases) EXPECT_EQ(gsm8k_extract_strict(c.output), c.expected) << c.output;
}

TEST(Gsm8kFlexible, TakesTheLastNumberAnywhere) {
  struct Case {
    const char* output;
    std::optional<std::string> expected;
  };
  std::vector<Case> cases = {
      {"So she makes 9 * 2 = $18 per day.", "18"},
      {"The total is 1,234 apples", "1234"},
      {"He lost $1,000.50 overall.", "1000.5"},
      {"The temperature dropped to -4 degrees.", "-4"},
      {"10 - 3 = 7", "7"},
      {"5-3", "3"},
      {"x = 0.25", "0.25"},
      {"Answer: 42.0", "42"},
      {"Step 1: 3 boxes.\nStep 2: 4 boxes.\nTotal: 7", "7"},
      {"the values 3,4 and 5", "5"},
      {"There are 12 eggs in 1 dozen and she bought 3 dozens, so 36.", "36"},
      {"#### 18", "18"},
      {"I am not sure.", std::nullopt},
      {"Covid19 is a word", std::nullopt},
  };
  for (const Case& c : cases) EXPECT_EQ(gsm8k_extract_flexible(c.output), c.expected) << c.output;
}

TEST(Gsm8kScorer, ReportsStrictAndFlexibleSeparately) {
  auto scorer = make_scorer({ScoringKind::Gsm8k, "answer", ""});
  ASSERT_TRUE(scorer);
  json input = {{"question", "?"}, {"answer", "work\n#### 72"}};
  EXPECT_EQ(scorer->score(input, "48 + 24 = 72\n#### 72"), (json{{"strict", true}, {"flexible", true}}));
  EXPECT_EQ(scorer->score(input, "So the answer is 72."), (json{{"strict", false}, {"flexible", true}}));
  EXPECT_EQ(scorer->score(input, "#### 72\nThat makes 3 groups"),
            (json{{"strict", true}, {"flexible", false}}));
  EXPECT_EQ(scorer->score(input, "#### 70"), (json{{"strict", false}, {"flexible", false}}));
  EXPECT_EQ(scorer->score(input, "#### $72.00"), (json{{"strict", true}, {"flexible", true}}));
  EXPECT_EQ(scorer->metrics(), (std::vector<std::string>{"strict", "flexible"}));
}

TEST(Gsm8kScorer, NegativeGoldMatchesNegativeAnswerOnly) {
  auto scorer = make_scorer({ScoringKind::Gsm8k, "answer", ""});
  json input = {{"answer", "#### -8"}};
  EXPECT_EQ(scorer->score(input, "#### -8"), (json{{"strict", true}, {"flexible", true}}));
  EXPECT_EQ(scorer->score(input, "#### 8"), (json{{"strict", false}, {"flexible", false}}));
}

// U+2212, the minus sign of typeset text, is a minus: a wrong sign is not a right answer.
TEST(Gsm8kScorer, TheUnicodeMinusSignIsAMinus) {
  auto scorer = make_scorer({ScoringKind::Gsm8k, "answer", ""});
  const std::string minus = "\xE2\x88\x92";
  EXPECT_EQ(scorer->score({{"answer", "#### 5"}}, "#### " + minus + "5"), (json{{"strict", false}, {"flexible", false}}));
  EXPECT_EQ(scorer->score({{"answer", "#### -5"}}, "The answer is " + minus + "5."),
            (json{{"strict", false}, {"flexible", true}}));
  EXPECT_EQ(scorer->score({{"answer", "#### -5"}}, "#### " + minus + "5"), (json{{"strict", true}, {"flexible", true}}));
  EXPECT_EQ(normalize_number(minus + "1,234.50"), "-1234.5");
  EXPECT_EQ(gsm8k_gold(minus + "7"), "-7");
  // Still an operator between numbers: "5−3" is 5 and 3.
  EXPECT_EQ(gsm8k_extract_flexible("5" + minus + "3"), "3");
}

// A reference written as a sentence's last word ("5.") is a bare number, as an answer is.
TEST(Gsm8kGold, ABareNumberMayEndInAPeriod) {
  EXPECT_EQ(gsm8k_gold("5."), "5");
  EXPECT_EQ(gsm8k_gold(" $1,200. "), "1200");
  EXPECT_EQ(gsm8k_gold("."), std::nullopt);
  EXPECT_EQ(gsm8k_gold("5.."), std::nullopt);
}

TEST(Gsm8kScorer, ItemWithoutReferenceGetsNullScore) {
  auto scorer = make_scorer({ScoringKind::Gsm8k, "answer", ""});
  EXPECT_TRUE(scorer->score(json{{"question", "?"}}, "#### 1").is_null());
  EXPECT_TRUE(scorer->score(json{{"answer", nullptr}}, "#### 1").is_null());
  EXPECT_TRUE(scorer->score(json{{"answer", "unknown"}}, "#### 1").is_null());
}

TEST(Gsm8kScorer, UsesTheConfiguredReferenceFieldAndNumericReferences) {
  auto scorer = make_scorer({ScoringKind::Gsm8k, "gold", ""});
  EXPECT_EQ(scorer->score(json{{"gold", 5}}, "#### 5"), (json{{"strict", true}, {"flexible", true}}));
}

TEST(ExactMatchScorer, ComparesTrimmedText) {
  auto scorer = make_scorer({ScoringKind::ExactMatch, "answer", ""});
  EXPECT_EQ(scorer->score(json{{"answer", "Paris"}}, "  Paris\n"), (json{{"exact", true}}));
  EXPECT_EQ(scorer->score(json{{"answer", "Paris"}}, "paris"), (json{{"exact", false}}));
  EXPECT_EQ(scorer->score(json{{"answer", 4}}, "4"), (json{{"exact", true}}));
  EXPECT_TRUE(scorer->score(json{{"q", "x"}}, "Paris").is_null());
  EXPECT_EQ(scorer->metrics(), std::vector<std::string>{"exact"});
  // Copied text's no-break and zero-width spaces, and a byte-order mark, are white space too.
  EXPECT_EQ(scorer->score(json{{"answer", "Paris"}}, "\xC2\xA0Paris\xE2\x80\x8B\n"), (json{{"exact", true}}));
  EXPECT_EQ(scorer->score(json{{"answer", "\xEF\xBB\xBFParis "}}, "Paris"), (json{{"exact", true}}));
  EXPECT_EQ(scorer->score(json{{"answer", "Par is"}}, "Par\xC2\xA0is"), (json{{"exact", false}}));
}

// A reference the input gives as a JSON number is compared as a number: the file's 1.10 is read
// as 1.1, and its own spelling must still match.
TEST(ExactMatchScorer, ANumericReferenceIsComparedAsANumber) {
  auto scorer = make_scorer({ScoringKind::ExactMatch, "answer", ""});
  const json decimal = json::parse(R"({"answer": 1.10})");
  EXPECT_EQ(scorer->score(decimal, "1.10"), (json{{"exact", true}}));
  EXPECT_EQ(scorer->score(decimal, "1.1"), (json{{"exact", true}}));
  EXPECT_EQ(scorer->score(decimal, "1.11"), (json{{"exact", false}}));
  EXPECT_EQ(scorer->score(decimal, "about 1.10"), (json{{"exact", false}}));
  EXPECT_EQ(scorer->score(json::parse(R"({"answer": 1e2})"), "100"), (json{{"exact", true}}));
  EXPECT_EQ(scorer->score(json::parse(R"({"answer": -0})"), "-0"), (json{{"exact", true}}));
  EXPECT_EQ(scorer->score(json{{"answer", 42}}, " 42.0\n"), (json{{"exact", true}}));
  EXPECT_EQ(scorer->score(json{{"answer", 42}}, "+42"), (json{{"exact", false}}));
  EXPECT_EQ(scorer->score(json{{"answer", 42}}, "4,2"), (json{{"exact", false}}));
  // Integers as integers: 2^53 + 1 is not 2^53, though both are the same double.
  EXPECT_EQ(scorer->score(json{{"answer", 9007199254740993}}, "9007199254740992"), (json{{"exact", false}}));
  EXPECT_EQ(scorer->score(json{{"answer", 9007199254740993}}, "9007199254740993"), (json{{"exact", true}}));
  EXPECT_EQ(scorer->score(json{{"answer", std::uint64_t{18446744073709551615u}}}, "18446744073709551615"),
            (json{{"exact", true}}));
  // A reference written as text is compared as text.
  EXPECT_EQ(scorer->score(json{{"answer", "1.10"}}, "1.1"), (json{{"exact", false}}));
}

TEST(RegexScorer, SearchesTheOutput) {
  auto scorer = make_scorer({ScoringKind::Regex, "answer", "^(yes|no)\\b"});
  EXPECT_EQ(scorer->score(json::object(), "yes, because"), (json{{"match", true}}));
  EXPECT_EQ(scorer->score(json::object(), "maybe yes"), (json{{"match", false}}));
  EXPECT_EQ(scorer->metrics(), std::vector<std::string>{"match"});
}

TEST(RegexScorer, PerlSyntaxOverUtf8) {
  auto scorer = make_scorer({ScoringKind::Regex, "answer", "(?i)^answer:\\s*(\\d+)\\b(?!%)"});
  EXPECT_EQ(scorer->score(json::object(), "ANSWER: 42"), (json{{"match", true}}));
  EXPECT_EQ(scorer->score(json::object(), "answer: 42%"), (json{{"match", false}}));
  // '.' is one character, not one byte; text that is not UTF-8 still gets an answer.
  EXPECT_EQ(make_scorer({ScoringKind::Regex, "answer", "^.$"})->score(json::object(), "é"), (json{{"match", true}}));
  EXPECT_EQ(make_scorer({ScoringKind::Regex, "answer", "42"})->score(json::object(), "\xff\xfe 42"),
            (json{{"match", true}}));
  EXPECT_EQ(scorer->score(json::object(), ""), (json{{"match", false}}));
  // \b, \w, \d and \s are Unicode's, as in Python 3's re.
  EXPECT_EQ(make_scorer({ScoringKind::Regex, "answer", "\\bcaf\xC3\xA9\\b"})->score(json::object(), "caf\xC3\xA9 au lait"),
            (json{{"match", true}}));
  EXPECT_EQ(make_scorer({ScoringKind::Regex, "answer", "^\\d+$"})->score(json::object(), "\xD9\xA4\xD9\xA2"),
            (json{{"match", true}}));
  EXPECT_EQ(make_scorer({ScoringKind::Regex, "answer", "x\\s42"})->score(json::object(), "x\xC2\xA0" "42"),
            (json{{"match", true}}));
}

// std::regex recursed once per character a repeated group consumed: 20,000 characters against
// (a|b)*c overflowed the stack and killed the run (tests/fuzz/findings/scoring-regex-recursion).
TEST(RegexScorer, LongOutputsAreSearchedWithoutRecursion) {
  std::string output;
  while (output.size() < 1'000'000) output += "Step: 3 + 4 = 7, and then\n";
  auto any_then_hashes = make_scorer({ScoringKind::Regex, "answer", "(.|\\n)*#### 7"});
  EXPECT_EQ(any_then_hashes->score(json::object(), output + "#### 7"), (json{{"match", true}}));
  EXPECT_EQ(make_scorer({ScoringKind::Regex, "answer", "(a|b)*c"})->score(json::object(), std::string(20'000, 'a')),
            (json{{"match", false}}));
}

// Exponential at one starting position, or quadratic over all of them: both stop at the step
// budget, in a fraction of a second, and the item is left unscored with the reason.
TEST(RegexScorer, ARunawaySearchLeavesTheItemUnscoredWithTheReason) {
  const auto gives_up = [](const json& score) {
    return score.size() == 2 && score["match"].is_null() &&
           score["error"].get<std::string>().rfind("the pattern gave up on this output", 0) == 0;
  };
  auto exponential = make_scorer({ScoringKind::Regex, "answer", "^(a|a)*\\d"});
  json score = exponential->score(json::object(), std::string(64, 'a'));
  EXPECT_TRUE(gives_up(score)) << score;
  EXPECT_EQ(exponential->score(json::object(), "aaa7"), (json{{"match", true}}));

  std::string output;
  while (output.size() < 1'000'000) output += "Step: 3 + 4 = 7, and then\n";
  auto quadratic = make_scorer({ScoringKind::Regex, "answer", "(.|\\n)*#### 7"});
  score = quadratic->score(json::object(), output);
  EXPECT_TRUE(gives_up(score)) << score;
  EXPECT_EQ(quadratic->score(json::object(), output.substr(0, 2000)), (json{{"match", false}}));

  // A repeat PCRE2 makes possessive takes a whole run in one step, and the search then retries
  // from every position of the run: quadratic in characters, which the budget counts too.
  auto digits = make_scorer({ScoringKind::Regex, "answer", "\\d+ apples"});
  score = digits->score(json::object(), std::string(200'000, '1') + " pears");
  EXPECT_TRUE(gives_up(score)) << score;
  EXPECT_EQ(digits->score(json::object(), std::string(1000, '1') + " pears"), (json{{"match", false}}));
  EXPECT_EQ(digits->score(json::object(), std::string(200'000, '1') + " apples"), (json{{"match", true}}));
  auto line_then_answer = make_scorer({ScoringKind::Regex, "answer", "[^\\n]*\\n#### \\d"});
  score = line_then_answer->score(json::object(), std::string(400'000, '0') + "\nthe answer is #### x");
  EXPECT_TRUE(gives_up(score)) << score;
}

TEST(MakeScorer, NoneGivesNoScorer) { EXPECT_EQ(make_scorer({}), nullptr); }

TEST(Gsm8kScorer, EveryReferenceAnswerOfTheSharedTestSetScoresAsCorrect) {
  // The reference solutions are model-style answers: worked steps with <<calc>> annotations,
  // then "#### N". Each must yield a gold and be judged right by both readings.
  std::ifstream in(std::string(BATCHLM_SHARED_DATA) + "/gsm8k/test.jsonl");
  ASSERT_TRUE(in) << "missing " << BATCHLM_SHARED_DATA << "/gsm8k/test.jsonl";
  auto scorer = make_scorer({ScoringKind::Gsm8k, "answer", ""});
  int lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    json item = json::parse(line);
    std::string answer = item["answer"];
    ASSERT_TRUE(gsm8k_gold(answer).has_value()) << answer;
    EXPECT_EQ(scorer->score(item, answer), (json{{"strict", true}, {"flexible", true}})) << answer;
  }
  EXPECT_EQ(lines, 1319);
}
