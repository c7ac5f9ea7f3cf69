#pragma once
// JSON mode (OpenAI's response_format {"type": "json_object"}): the output is held to one JSON
// object. JsonState recognizes JSON text byte by byte (RFC 8259: strings with escapes and valid
// UTF-8, numbers, literals, nesting); JsonMask sets the logits of every token that cannot
// continue what was generated so far to -infinity, so sampling only ever picks a token that
// keeps the text a prefix of a valid object, and generation ends when the object closes.

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "batchlm/local_engine/tokenizer.hpp"

namespace batchlm::local_engine {

class JsonState {
 public:
  // Containers deeper than this and numbers longer than kMaxNumber bytes are refused: nothing
  // needs them, and a model that starts repeating one of them would otherwise never finish.
  // Whitespace between tokens is none, one space, or a line break and up to kMaxIndent spaces
  // or tabs (the form llama.cpp's JSON grammars allow): JSON on one line or pretty-printed
  // fits, and blank lines or long runs, which a small model may repeat until its max_tokens,
  // do not.
  static constexpr int kMaxDepth = 64;
  static constexpr int kMaxIndent = 20;
  static constexpr int kMaxNumber = 64;

  // Takes one byte; false (the state then unspecified) when it cannot continue the text.
  bool feed(unsigned char c);
  // All of `bytes`, on this state; false when one cannot continue the text.
  bool feed(std::string_view bytes);
  // Whether `bytes` can continue the text (this state unchanged).
  bool accepts(std::string_view bytes) const {
    JsonState s = *this;
    return s.feed(bytes);
  }
  // The top-level object has closed (only whitespace may follow).
  bool complete() const { return mode_ == Mode::kDone; }
  // Inside a string, between characters: any whole UTF-8 characters other than a quote, a
  // backslash or a control character continue it.
  bool in_plain_string() const { return mode_ == Mode::kString && utf8_left_ == 0; }
  // How many characters of plain text may follow there: no limit in JSON mode.
  std::int64_t plain_room() const { return INT64_MAX; }

 private:
  friend class SchemaState;  // follows a schema on top of this recognizer's reading of the text
  enum class Mode : std::uint8_t {
    kStart, kValue, kArrayFirst, kObjectFirstKey, kObjectKey, kColon, kAfterValue, kString, kEscape,
    kHex, kLowBackslash, kLowU, kNumber, kLiteral, kDone
  };
  enum class Num : std::uint8_t { kSign, kZero, kInt, kDot, kFrac, kExp, kExpSign, kExpDigits };
  bool value(unsigned char c);
  bool after_value(unsigned char c);
  bool space(unsigned char c);
  bool push(bool object);
  void pop();
  bool top_is_object() const { return (objects_ >> (depth_ - 1)) & 1u; }

  Mode mode_ = Mode::kStart;
  Num num_ = Num::kSign;
  std::uint8_t depth_ = 0;
  std::uint64_t objects_ = 0;  // bit d: the container at depth d + 1 is an object
  bool key_ = false;           // the string being read is an object's key
  bool low_ = false;           // the \u escape being read must be a low surrogate
  std::uint8_t utf8_left_ = 0;  // continuation bytes still due in a string
  std::uint8_t utf8_lo_ = 0x80, utf8_hi_ = 0xBF;  // the range of the next one
  std::uint8_t hex_left_ = 0;
  std::uint16_t hex_ = 0;
  // The whitespace run since the last token: 0 none, kOneSpace a space, else 1 + the spaces
  // and tabs after a line break.
  static constexpr std::uint8_t kOneSpace = 0xFF;
  std::uint8_t spaces_ = 0;
  std::uint8_t length_ = 0;   // bytes of the number being read
  std::uint8_t literal_ = 0;  // which of true, false, null
  std::uint8_t at_ = 0;       // bytes of it read
};

class SchemaState;

// The token-level side: which tokens can come next.
class JsonMask {
 public:
  explicit JsonMask(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}
  // Sets to -infinity the logits of tokens that cannot continue `state`: a token whose bytes
  // it refuses, a control token, and an end of generation before the object is complete (and
  // anything but one after). Returns how many tokens are left; when none would be, it changes
  // nothing and returns 0.
  std::size_t apply(const JsonState& state, std::span<float> logits) const;
  // The same for a schema (json_schema.hpp).
  std::size_t apply(const SchemaState& state, std::span<float> logits) const;

 private:
  template <class State>
  std::size_t mask(const State& state, std::span<float> logits) const;
  // By token id: how many characters of plain string text (JsonState::in_plain_string) its
  // bytes are, 0 when they are not such text; computed once.
  const std::vector<std::uint16_t>& plain_tokens() const;

  const Tokenizer* tokenizer_;
  mutable std::vector<bool> allowed_;
  mutable std::vector<std::uint16_t> plain_;
  mutable std::vector<std::uint8_t> pairs_;
};

}  // namespace batchlm::local_engine
