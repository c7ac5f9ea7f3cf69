#pragma once
// What the harnesses share: a checked property that names itself when it fails, and a reader
// that splits one fuzz input into the several values a harness needs.
//
// A harness returns normally for input that is handled as the parser promises (parsed, or
// refused with the parser's own error type). Anything else ends the process: an exception of
// another type escapes (std::terminate), a sanitizer reports, or FUZZ_CHECK aborts with the
// property it found broken. libFuzzer then saves the input; replay_main.cpp names the file.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

// `what`: a std::string_view-convertible explanation (the values involved), built only on failure.
#define FUZZ_CHECK(condition, what)                                                           \
  do {                                                                                        \
    if (!(condition)) {                                                                       \
      std::fprintf(stderr, "%s:%d: property violated: %s\n", __FILE__, __LINE__, #condition); \
      ::batchlm::fuzz::explain(what);                                                         \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

namespace batchlm::fuzz {

inline void explain(std::string_view what) {
  std::fprintf(stderr, "  %.*s\n", static_cast<int>(what.size()), what.data());
}

// Reads a fuzz input front to back. Every read succeeds: past the end it yields zeros and
// empty strings, so any input is a valid (if short) one.
class InputReader {
 public:
  InputReader(const std::uint8_t* data, std::size_t size)
      : text_(reinterpret_cast<const char*>(data), size) {}

  bool empty() const { return text_.empty(); }
  std::size_t remaining() const { return text_.size(); }

  std::uint8_t byte() {
    if (text_.empty()) return 0;
    const auto b = static_cast<std::uint8_t>(text_.front());
    text_.remove_prefix(1);
    return b;
  }

  // The bytes up to the next `separator` (which is consumed), or all that is left.
  std::string_view until(char separator) {
    const std::size_t at = text_.find(separator);
    std::string_view part = text_.substr(0, at);
    text_.remove_prefix(at == std::string_view::npos ? text_.size() : at + 1);
    return part;
  }

  // All that is left.
  std::string_view rest() {
    std::string_view part = text_;
    text_ = {};
    return part;
  }

 private:
  std::string_view text_;
};

// Whether `s` is valid UTF-8: no stray continuation bytes, overlong forms, surrogates or
// code points past U+10FFFF.
inline bool valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    std::uint32_t cp = len == 1 ? c : c & (0x7F >> len);
    for (std::size_t k = 1; k < len; ++k) {
      const auto next = static_cast<unsigned char>(s[i + k]);
      if ((next & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (next & 0x3F);
    }
    static constexpr std::uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kLeast[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

}  // namespace batchlm::fuzz
