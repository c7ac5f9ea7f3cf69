#include "batchlm/local_engine/json_mode.hpp"

#include <array>
#include <limits>

#include "batchlm/local_engine/json_schema.hpp"

namespace batchlm::local_engine {

namespace {

bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
int hex_digit(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

constexpr std::string_view kLiterals[] = {"true", "false", "null"};

}  // namespace

bool JsonState::push(bool object) {
  if (depth_ >= kMaxDepth) return false;
  if (object) objects_ |= std::uint64_t{1} << depth_;
  else objects_ &= ~(std::uint64_t{1} << depth_);
  ++depth_;
  mode_ = object ? Mode::kObjectFirstKey : Mode::kArrayFirst;
  return true;
}

void JsonState::pop() {
  --depth_;
  mode_ = depth_ == 0 ? Mode::kDone : Mode::kAfterValue;
}

bool JsonState::value(unsigned char c) {
  switch (c) {
    case '{': return push(true);
    case '[': return push(false);
    case '"':
      mode_ = Mode::kString;
      key_ = false;
      return true;
    case 't': case 'f': case 'n':
      mode_ = Mode::kLiteral;
      literal_ = c == 't' ? 0 : c == 'f' ? 1 : 2;
      at_ = 1;
      return true;
    default: break;
  }
  if (c == '-' || is_digit(c)) {
    mode_ = Mode::kNumber;
    num_ = c == '-' ? Num::kSign : c == '0' ? Num::kZero : Num::kInt;
    length_ = 1;
    return true;
  }
  return false;
}

bool JsonState::after_value(unsigned char c) {
  const bool object = top_is_object();
  if (c == ',') {
    mode_ = object ? Mode::kObjectKey : Mode::kValue;
    return true;
  }
  if (c == (object ? '}' : ']')) {
    pop();
    return true;
  }
  return false;
}

bool JsonState::space(unsigned char c) {
  if (spaces_ == 0) {
    spaces_ = c == ' ' ? kOneSpace : 1;
    return c == ' ' || c == '\n';
  }
  if (spaces_ == kOneSpace || c == '\n' || c == '\r' || spaces_ > kMaxIndent) return false;
  ++spaces_;  // a space or a tab of the indent
  return true;
}

bool JsonState::feed(unsigned char c) {
  // Whitespace between tokens, in the forms space() takes.
  switch (mode_) {
    case Mode::kStart: case Mode::kValue: case Mode::kArrayFirst: case Mode::kObjectFirstKey:
    case Mode::kObjectKey: case Mode::kColon: case Mode::kAfterValue: case Mode::kDone:
      if (is_space(c)) return space(c);
      spaces_ = 0;
      break;
    default: break;
  }
  switch (mode_) {
    case Mode::kStart: return c == '{' && push(true);
    case Mode::kArrayFirst:
      if (c == ']') {
        pop();
        return true;
      }
      return value(c);
    case Mode::kValue: return value(c);
    case Mode::kObjectFirstKey:
      if (c == '}') {
        pop();
        return true;
      }
      [[fallthrough]];
    case Mode::kObjectKey:
      if (c != '"') return false;
      mode_ = Mode::kString;
      key_ = true;
      return true;
    case Mode::kColon:
      if (c != ':') return false;
      mode_ = Mode::kValue;
      return true;
    case Mode::kAfterValue: return after_value(c);
    case Mode::kString:
      if (utf8_left_ > 0) {
        if (c < utf8_lo_ || c > utf8_hi_) return false;
        --utf8_left_;
        utf8_lo_ = 0x80;
        utf8_hi_ = 0xBF;
        return true;
      }
      if (c == '"') {
        mode_ = key_ ? Mode::kColon : Mode::kAfterValue;
        return true;
      }
      if (c == '\\') {
        mode_ = Mode::kEscape;
        return true;
      }
      if (c < 0x20) return false;
      if (c < 0x80) return true;
      // The lead byte of a UTF-8 character: how many continuation bytes follow, and the range
      // of the first (which rules out overlong forms, surrogates and values past U+10FFFF).
      if (c >= 0xC2 && c <= 0xDF) utf8_left_ = 1;
      else if (c == 0xE0) utf8_left_ = 2, utf8_lo_ = 0xA0;
      else if (c == 0xED) utf8_left_ = 2, utf8_hi_ = 0x9F;
      else if (c >= 0xE1 && c <= 0xEF) utf8_left_ = 2;
      else if (c == 0xF0) utf8_left_ = 3, utf8_lo_ = 0x90;
      else if (c == 0xF4) utf8_left_ = 3, utf8_hi_ = 0x8F;
      else if (c >= 0xF1 && c <= 0xF3) utf8_left_ = 3;
      else return false;
      return true;
    case Mode::kEscape:
      if (c == 'u') {
        mode_ = Mode::kHex;
        hex_left_ = 4;
        hex_ = 0;
        low_ = false;
        return true;
      }
      if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
        mode_ = Mode::kString;
        return true;
      }
      return false;
    case Mode::kHex: {
      const int d = hex_digit(c);
      if (d < 0) return false;
      hex_ = static_cast<std::uint16_t>(hex_ * 16 + d);
      --hex_left_;
      // A surrogate is refused at the digit that rules it in or out, so every prefix taken can
      // still end: after a high surrogate only a low one (DC00-DFFF), else never a lone low one.
      if (hex_left_ == 3 && low_ && hex_ != 0xD) return false;
      if (hex_left_ == 2 && (hex_ >= 0xDC && hex_ <= 0xDF) != low_) return false;
      if (hex_left_ > 0) return true;
      const bool high = hex_ >= 0xD800 && hex_ <= 0xDBFF, low = hex_ >= 0xDC00 && hex_ <= 0xDFFF;
      if (low_ != low || (low_ && high)) return false;  // a low surrogate only right after a high one
      mode_ = high ? Mode::kLowBackslash : Mode::kString;
      return true;
    }
    case Mode::kLowBackslash:
      if (c != '\\') return false;
      mode_ = Mode::kLowU;
      return true;
    case Mode::kLowU:
      if (c != 'u') return false;
      mode_ = Mode::kHex;
      hex_left_ = 4;
      hex_ = 0;
      low_ = true;
      return true;
    case Mode::kNumber: {
      // A byte that extends the number counts against its length; one that ends it does not.
      // A sign, a point or an exponent mark needs a digit after it, so it is taken only where
      // that digit still fits: every number taken can end within the limit.
      const auto extend = [&](Num next) {
        num_ = next;
        const bool wants_digit = next == Num::kDot || next == Num::kExp || next == Num::kExpSign;
        return ++length_ + (wants_digit ? 1 : 0) <= kMaxNumber;
      };
      switch (num_) {
        case Num::kSign:
          if (!is_digit(c)) return false;
          return extend(c == '0' ? Num::kZero : Num::kInt);
        case Num::kDot:
          if (!is_digit(c)) return false;
          return extend(Num::kFrac);
        case Num::kExp:
          if (c == '+' || c == '-') return extend(Num::kExpSign);
          [[fallthrough]];
        case Num::kExpSign:
          if (!is_digit(c)) return false;
          return extend(Num::kExpDigits);
        case Num::kInt:
        case Num::kFrac:
        case Num::kExpDigits:
          if (is_digit(c)) return extend(num_);
          [[fallthrough]];
        case Num::kZero:
          if (c == '.' && (num_ == Num::kZero || num_ == Num::kInt)) return extend(Num::kDot);
          if ((c == 'e' || c == 'E') && num_ != Num::kExpDigits) return extend(Num::kExp);
          // The number is whole: the byte belongs to what follows it.
          mode_ = Mode::kAfterValue;
          return feed(c);
      }
      return false;
    }
    case Mode::kLiteral: {
      const std::string_view word = kLiterals[literal_];
      if (c != static_cast<unsigned char>(word[at_])) return false;
      if (++at_ == word.size()) mode_ = Mode::kAfterValue;
      return true;
    }
    case Mode::kDone: return false;  // whitespace was taken above
  }
  return false;
}

bool JsonState::feed(std::string_view bytes) {
  for (const char c : bytes)
    if (!feed(static_cast<unsigned char>(c))) return false;
  return true;
}

const std::vector<std::uint16_t>& JsonMask::plain_tokens() const {
  if (plain_.empty()) {
    // Whole UTF-8 characters, none of them a quote, a backslash or a control character.
    const auto n = static_cast<Token>(tokenizer_->size());
    plain_.assign(static_cast<std::size_t>(n), 0);
    for (Token t = 0; t < n; ++t) {
      if (tokenizer_->is_end_of_generation(t)) continue;
      const std::string_view bytes = tokenizer_->token_view(t);
      JsonState s;
      bool ok = !bytes.empty() && bytes.size() < 0xFFFF && s.feed("{\"");
      std::uint16_t chars = 0;
      for (const char c : bytes) {
        ok = ok && c != '"' && c != '\\' && s.feed(static_cast<unsigned char>(c));
        chars = static_cast<std::uint16_t>(chars + ((static_cast<unsigned char>(c) & 0xC0) != 0x80));
      }
      plain_[static_cast<std::size_t>(t)] = ok && s.in_plain_string() ? chars : 0;
    }
  }
  return plain_;
}

std::size_t JsonMask::apply(const JsonState& state, std::span<float> logits) const { return mask(state, logits); }

std::size_t JsonMask::apply(const SchemaState& state, std::span<float> logits) const { return mask(state, logits); }

template <class State>
std::size_t JsonMask::mask(const State& state, std::span<float> logits) const {
  const bool complete = state.complete();
  // Most tokens are ruled out by their first byte: 256 feeds decide it for all of them.
  std::array<bool, 256> first{};
  for (int c = 0; c < 256; ++c) {
    State s = state;
    first[static_cast<std::size_t>(c)] = s.feed(static_cast<unsigned char>(c));
  }
  // Of the tokens that pass, most that fail do so at their second byte (a space, then a word
  // where only punctuation may come): each pair of first bytes is fed once, when first met.
  pairs_.assign(65536, 0);  // 0: not yet fed; 1: it continues the text; 2: it does not
  const auto pair_ok = [&](std::string_view bytes) {
    const auto b0 = static_cast<unsigned char>(bytes[0]), b1 = static_cast<unsigned char>(bytes[1]);
    std::uint8_t& known = pairs_[static_cast<std::size_t>(b0) << 8 | b1];
    if (known == 0) {
      State s = state;
      known = s.feed(b0) && s.feed(b1) ? 1 : 2;
    }
    return known == 1;
  };
  // Inside a string, between characters, plain text tokens continue it as far as its length
  // allows.
  const std::vector<std::uint16_t>* plain = state.in_plain_string() ? &plain_tokens() : nullptr;
  const std::int64_t room = plain ? state.plain_room() : 0;
  allowed_.assign(logits.size(), false);
  std::size_t left = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const auto t = static_cast<Token>(i);
    bool ok;
    if (plain && i < plain->size() && (*plain)[i] != 0) {
      ok = (*plain)[i] <= room;
    } else if (tokenizer_->is_end_of_generation(t)) {
      ok = complete;
    } else {
      const std::string_view bytes = tokenizer_->token_view(t);
      ok = !complete && !bytes.empty() && first[static_cast<unsigned char>(bytes[0])] &&
           (bytes.size() < 2 || pair_ok(bytes)) && (bytes.size() <= 2 || state.accepts(bytes));
    }
    allowed_[i] = ok;
    left += ok ? 1 : 0;
  }
  if (left == 0) return 0;
  constexpr float kOff = -std::numeric_limits<float>::infinity();
  for (std::size_t i = 0; i < logits.size(); ++i)
    if (!allowed_[i]) logits[i] = kOff;
  return left;
}

}  // namespace batchlm::local_engine
