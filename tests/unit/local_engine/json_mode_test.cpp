// JSON mode: JsonState against nlohmann's parser as the oracle (valid objects, their prefixes,
// mutated texts), its limits, JsonMask on the default model's vocabulary, and the engine's
// output in JSON mode.

#include "batchlm/local_engine/json_mode.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "batchlm/local_engine/batch_engine.hpp"
#include "batchlm/local_engine/engine.hpp"
#include "default_model.hpp"

namespace batchlm::local_engine {
namespace {

using nlohmann::json;

bool accepts(std::string_view text) { return JsonState().accepts(text); }
bool complete(std::string_view text) {
  JsonState s;
  return s.feed(text) && s.complete();
}
// What the oracle says: a whole JSON object; nullopt when it cannot tell (a number past a
// double's range, which RFC 8259 allows and this parser refuses to hold).
// Whether every run of whitespace outside strings is one JsonState takes: none, one space, or a
// line break and up to kMaxIndent spaces or tabs.
bool spaced_as_taken(std::string_view text) {
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') continue;
    std::size_t end = i;
    while (end < text.size() && std::string_view(" \t\n\r").find(text[end]) != std::string_view::npos) ++end;
    const std::string_view run = text.substr(i, end - i);
    const bool taken = run == " " || (run[0] == '\n' && run.size() <= 1 + JsonState::kMaxIndent &&
                                      run.substr(1).find_first_not_of(" \t") == std::string_view::npos);
    if (!taken) return false;
    i = end - 1;
  }
  return true;
}

// What JsonState should say of `text`: an object, spaced as it takes (none when the text is
// beyond what the parser reads).
std::optional<bool> oracle(std::string_view text) {
  try {
    return json::parse(text).is_object() && spaced_as_taken(text);
  } catch (const json::out_of_range&) {
    return std::nullopt;
  } catch (const json::exception&) {
    return false;
  }
}
bool is_object(std::string_view text) { return oracle(text).value_or(false); }

TEST(JsonState, TakesObjectsWithEveryKindOfValue) {
  for (const std::string_view text : {
           R"({})", R"( { } )", R"({"a": 1})", "{\n  \"a\": [1, -2.5e+3, 0, 0.25, 1E-2, true, false, null],\n  \"b\": {}\n}\n",
           R"({"s": "esc \" \\ \/ \b \f \n \r \t \u00e9 \ud83d\ude00", "e": [], "n": [[]], "o": [{}]})",
           "{\"utf8\": \"h\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80\"}", R"({"a":{"b":{"c":[1,{"d":null}]}}})"}) {
    SCOPED_TRACE(text);
    ASSERT_TRUE(is_object(text));
    EXPECT_TRUE(complete(text));
    // Every proper prefix is a prefix, not yet an object (but for trailing whitespace).
    const std::size_t end = text.find_last_not_of(" \n") + 1;
    for (std::size_t n = 0; n < end; ++n) {
      JsonState s;
      ASSERT_TRUE(s.feed(text.substr(0, n))) << n;
      EXPECT_FALSE(s.complete()) << n;
    }
  }
}

TEST(JsonState, RefusesWhatIsNotAnObjectAtTheFirstWrongByte) {
  for (const std::string_view text : {
           "[]", "\"s\"", "1", "true", "{,}", "{\"a\" 1}", "{\"a\":}", "{\"a\":1,}", "{\"a\":01}",
           "{\"a\":1.}", "{\"a\":-}", "{\"a\":1e}", "{\"a\":.5}", "{\"a\":+1}", "{\"a\":tru}", "{\"a\":nul1}",
           "{\"a\":\"\\x\"}", "{\"a\":\"\\u12g4\"}", "{\"a\":\"tab\there\"}", "{\"a\":\"\xC0\x80\"}",
           "{\"a\":\"\xED\xA0\x80\"}", "{\"a\":\"\xF5\x80\x80\x80\"}", "{\"a\":\"\x80\"}", "{\"a\":\"\\udc00\"}",
           "{\"a\":\"\\ud800x\"}", "{\"a\":\"\\ud800\\u0041\"}", "{\"a\":[1}", "{\"a\":1]", "{} x", "{}{}", "{'a':1}"}) {
    SCOPED_TRACE(text);
    EXPECT_FALSE(is_object(text));
    EXPECT_FALSE(complete(text));
  }
  // Refused at the byte that makes it wrong, not before.
  JsonState s;
  EXPECT_TRUE(s.feed("{\"a\": 0"));
  EXPECT_FALSE(JsonState(s).feed('1'));
  EXPECT_TRUE(JsonState(s).feed('.'));
  EXPECT_TRUE(JsonState(s).feed('}'));
  // A \u escape is refused at the hex digit that rules it out, so no prefix taken is a dead
  // end: after a high surrogate only DC00-DFFF may follow, and a low one never stands alone.
  JsonState high;
  ASSERT_TRUE(high.feed("{\"a\": \"\\ud83d\\u"));
  EXPECT_FALSE(JsonState(high).feed('0'));
  EXPECT_FALSE(JsonState(high).accepts("d1"));
  EXPECT_FALSE(JsonState(high).accepts("dB"));
  EXPECT_TRUE(JsonState(high).accepts("dC"));
  EXPECT_TRUE(JsonState(high).accepts("dfff\""));
  JsonState alone;
  ASSERT_TRUE(alone.feed("{\"a\": \"\\ud"));
  EXPECT_FALSE(JsonState(alone).feed('c'));
  EXPECT_FALSE(JsonState(alone).feed('F'));
  EXPECT_TRUE(JsonState(alone).feed('b'));
  EXPECT_TRUE(JsonState(alone).feed('7'));
}

TEST(JsonState, BoundsDepthWhitespaceAndNumbers) {
  std::string deep = "{\"a\":";
  for (int i = 1; i < JsonState::kMaxDepth; ++i) deep += "[";
  EXPECT_TRUE(accepts(deep));
  EXPECT_FALSE(accepts(deep + "["));
  // (append, not "..." + std::string(...): GCC 12 warns falsely of overlapping copies at -O3)
  // Whitespace: none, one space, or a line break and an indent of up to kMaxIndent.
  EXPECT_TRUE(complete("{\"a\":1,\"b\":[true,null]}"));
  EXPECT_TRUE(complete("{ \"a\" : 1 , \"b\" : [ true ] }"));
  EXPECT_TRUE(complete("{\n  \"a\": 1,\n  \"b\": [\n\t\ttrue\n  ]\n}"));
  EXPECT_TRUE(accepts(std::string("{\n").append(JsonState::kMaxIndent, ' ')));
  EXPECT_FALSE(accepts(std::string("{\n").append(JsonState::kMaxIndent + 1, ' ')));
  for (const char* run : {"  ", "\n\n", " \n", "\t", "\r\n", "\n \n"})
    EXPECT_FALSE(accepts(std::string("{\"a\":") + run)) << ::testing::PrintToString(run);
  EXPECT_FALSE(accepts("\n\r\n {"));
  EXPECT_TRUE(accepts(std::string("{\"a\":").append(JsonState::kMaxNumber, '1').append("}")));
  EXPECT_FALSE(accepts(std::string("{\"a\":").append(JsonState::kMaxNumber + 1, '1')));
  // A point, an exponent mark or a sign is taken only where the digit it needs still fits, so
  // the number can always end.
  const std::string full = std::string("{\"a\":").append(JsonState::kMaxNumber - 1, '1');
  for (const char* tail : {".", "e", "E", "e+"}) EXPECT_FALSE(accepts(full + tail)) << tail;
  const std::string room = std::string("{\"a\":").append(JsonState::kMaxNumber - 2, '1');
  EXPECT_TRUE(complete(room + ".5}"));
  EXPECT_TRUE(complete(room + "e5}"));
  EXPECT_FALSE(accepts(room + "e+"));
  EXPECT_TRUE(complete(std::string("{\"a\":").append(JsonState::kMaxNumber - 3, '1').append("e-5}")));
  EXPECT_TRUE(complete(std::string("{\"a\":-").append(JsonState::kMaxNumber - 1, '1').append("}")));
  // After the object, whitespace only.
  EXPECT_TRUE(complete("{}\n  "));
  EXPECT_FALSE(accepts("{} ,"));
}

std::string key(std::size_t n) {
  std::string k = "k";
  return k.append(std::to_string(n));
}

// Random JSON values, for the property tests.
json random_value(std::mt19937& rng, int depth) {
  const int kind = static_cast<int>(rng() % (depth > 3 ? 5 : 7));
  switch (kind) {
    case 0: return nullptr;
    case 1: return rng() % 2 == 0;
    case 2: return static_cast<std::int64_t>(rng() % 2000000) - 1000000;
    case 3: return std::ldexp(static_cast<double>(rng() % 100000) - 50000, static_cast<int>(rng() % 40) - 20);
    case 4: {
      static const std::vector<std::string> pieces = {"a", "B", " ", "\"", "\\", "\n", "\t", "/", "\x01",
                                                      "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "key"};
      std::string s;
      for (std::size_t n = rng() % 6; n > 0; --n) s += pieces[rng() % pieces.size()];
      return s;
    }
    case 5: {
      json a = json::array();
      for (std::size_t n = rng() % 4; n > 0; --n) a.push_back(random_value(rng, depth + 1));
      return a;
    }
    default: {
      json o = json::object();
      for (std::size_t n = rng() % 4; n > 0; --n) o[key(rng() % 10)] = random_value(rng, depth + 1);
      return o;
    }
  }
}

TEST(JsonState, AgreesWithAParserOnRandomAndMutatedObjects) {
  std::mt19937 rng(1234);
  int mutated_objects = 0;
  for (int i = 0; i < 3000; ++i) {
    json object = json::object();
    for (std::size_t n = rng() % 4; n > 0; --n) object[key(n)] = random_value(rng, 1);
    std::string text = object.dump(rng() % 2 == 0 ? -1 : 2, ' ', rng() % 2 == 0);
    if (text.size() > 2 && rng() % 3 != 0) {
      // A byte deleted, replaced or inserted: the state and the parser must still agree.
      const std::size_t at = rng() % text.size();
      static const std::string bytes = "{}[]\":,\\ 0-1.eEtfnu\x01\x80\xC3\xFF";
      const char b = bytes[rng() % bytes.size()];
      switch (rng() % 3) {
        case 0: text.erase(at, 1); break;
        case 1: text[at] = b; break;
        default: text.insert(at, 1, b); break;
      }
    }
    const std::optional<bool> valid = oracle(text);
    if (!valid) continue;
    mutated_objects += *valid ? 1 : 0;
    EXPECT_EQ(complete(text), *valid) << json(text).dump(-1, ' ', true, json::error_handler_t::replace);
  }
  EXPECT_GT(mutated_objects, 1000);
}

// ---- on the default model ----------------------------------------------------------------------

using testing::default_model;

TEST(JsonMask, LeavesOnlyTokensThatContinueTheText) {
  REQUIRE_DEFAULT_MODEL();
  const Tokenizer& tok = default_model()->tokenizer();
  const JsonMask mask(tok);
  const std::size_t n_vocab = static_cast<std::size_t>(default_model()->config().n_vocab);
  for (const std::string_view so_far : {"", "{", "{\"name\": \"Caf", "{\"a\": 12", "{\"a\": [true, ", "{\"a\": {}}"}) {
    SCOPED_TRACE(so_far);
    JsonState state;
    ASSERT_TRUE(state.feed(so_far));
    std::vector<float> logits(n_vocab, 0.0f);
    const std::size_t left = mask.apply(state, logits);
    EXPECT_GT(left, 0u);
    std::size_t finite = 0;
    for (std::size_t t = 0; t < n_vocab; ++t) {
      if (std::isinf(logits[t])) continue;
      ++finite;
      const auto token = static_cast<Token>(t);
      if (tok.is_end_of_generation(token)) {
        EXPECT_TRUE(state.complete());
      } else {
        EXPECT_TRUE(state.accepts(tok.token_view(token))) << t;
      }
    }
    EXPECT_EQ(finite, left);
  }
  // A closed object leaves the end of generation alone.
  JsonState closed;
  ASSERT_TRUE(closed.feed("{}"));
  std::vector<float> logits(n_vocab, 0.0f);
  const std::size_t left = mask.apply(closed, logits);
  EXPECT_GT(left, 0u);
  for (std::size_t t = 0; t < n_vocab; ++t)
    EXPECT_EQ(!std::isinf(logits[t]), tok.is_end_of_generation(static_cast<Token>(t))) << t;
}

TEST(JsonModeEngine, EveryOutputIsAnObjectOrItsBeginning) {
  REQUIRE_DEFAULT_MODEL();
  const std::vector<std::string> prompts = {
      "Describe a cat as a JSON object with the keys name, age and color.",
      "Give the capital of France in JSON.",
      "List three prime numbers."};
  LocalBackendOptions o;
  o.threads = 2;
  o.context = 512;
  o.max_sequences = 4;
  o.speculative.method = SpecMethod::kNgram;  // JSON mode turns drafting off for its requests
  BatchEngine engine(default_model(), o);
  std::map<SequenceId, std::string> label;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    for (const float temperature : {0.0f, 1.0f}) {
      GenerateParams params;
      params.max_tokens = 120;
      params.sampling.temperature = temperature;
      params.sampling.seed = 7 + i;
      params.json_object = true;
      const std::vector<ChatMessage> messages = {{"user", prompts[i]}};
      label[engine.add(chat_prompt_tokens(*default_model(), messages), params, nullptr)] =
          prompts[i] + " at temperature " + std::to_string(temperature);
    }
  }
  int closed = 0;
  while (!engine.idle()) {
    engine.step();
    for (auto& [id, result] : engine.take_finished()) {
      SCOPED_TRACE(label.at(id) + ": " + result.text);
      EXPECT_TRUE(accepts(result.text));
      if (result.finish_reason == "stop") {
        EXPECT_TRUE(is_object(result.text));
        ++closed;
      } else {
        EXPECT_EQ(result.finish_reason, "length");
      }
    }
  }
  EXPECT_GE(closed, 3);
  EXPECT_EQ(engine.stats().drafted_tokens, 0);
}

}  // namespace
}  // namespace batchlm::local_engine
