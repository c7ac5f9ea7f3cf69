#pragma once
// A JSON text checked before it is built into a value: its syntax, numbers that fit a double,
// and how deep arrays and objects nest. nlohmann's copy and dump recurse once per level, so a
// value built from 200 KB of '[' (100,000 levels) overflows the stack where it is next copied
// or written; the check reads the text without recursion and stops at the first problem.
// Input lines (runner) and request bodies (server) are checked with it.

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace batchlm {

struct JsonProblem {
  enum class Kind {
    kSyntax,            // not valid JSON
    kNumberOutOfRange,  // a number beyond a double (integers past 64 bits are read as doubles)
    kTooDeep,           // arrays and objects nested deeper than the limit
  };
  Kind kind;
  std::size_t byte = 0;  // 1-based position where reading stopped; 0 for kTooDeep
  std::string token;     // kNumberOutOfRange: the number as written
  // kSyntax: what the parser found there, in its words ("unexpected '}'; expected string
  // literal", "invalid string: ill-formed UTF-8 byte"), without the input it quotes.
  std::string detail;

  // "at byte 15: unexpected '}'; expected string literal" (kSyntax) or "at byte 15".
  std::string where() const {
    return "at byte " + std::to_string(byte) + (detail.empty() ? "" : ": " + detail);
  }
};

// The first problem in `text`, or none. `max_depth` counts arrays and objects: "[[1]]" is 2.
std::optional<JsonProblem> check_json(std::string_view text, std::size_t max_depth);

// The value of a text that check_json passed, keys in the order written, built in time linear in
// the text: nlohmann's own parse into an ordered_json looks through an object's keys at every
// key, so one object of 100,000 keys (a megabyte) takes many seconds. A key given twice keeps
// its first place and its last value, as nlohmann's parse does; `duplicate`, when given, is set
// to the first such key's path ("a.b[2].c").
// `wide`, when given, is set to the first integer written past 64 bits (which the value holds
// as the nearest double): its path and its digits as written.
struct WideInteger {
  std::string path;
  std::string digits;
};
nlohmann::ordered_json parse_ordered_json(std::string_view text, std::optional<std::string>* duplicate = nullptr,
                                          std::optional<WideInteger>* wide = nullptr);

}  // namespace batchlm
