#pragma once
// Internal to the tokenizer and the chat template: UTF-8 encoding of one code point, and the
// well-formed sequences of the Unicode standard.

#include <cstddef>
#include <string>
#include <string_view>

namespace batchlm::local_engine::utf8 {

inline void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

enum class Status { Complete, Truncated, Invalid };

struct Sequence {
  Status status;
  // Complete: the sequence's length. Truncated: the bytes present (a valid start that the
  // end of the buffer cuts off). Invalid: the bytes to replace by one U+FFFD, which is the
  // "maximal subpart" of Unicode's recommended practice (what Python's errors="replace" does).
  std::size_t length;
};

// Classifies the sequence that starts at s[i] by the well-formed byte sequences of the Unicode
// standard (table 3-7): no overlong forms, no surrogates, nothing above U+10FFFF.
inline Sequence classify(std::string_view s, std::size_t i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  if (lead < 0x80) return {Status::Complete, 1};
  std::size_t need = 0;
  unsigned char second_lo = 0x80, second_hi = 0xBF;  // the second byte's range depends on the lead
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 2;
  } else if (lead == 0xE0) {
    need = 3, second_lo = 0xA0;
  } else if ((lead >= 0xE1 && lead <= 0xEC) || lead == 0xEE || lead == 0xEF) {
    need = 3;
  } else if (lead == 0xED) {
    need = 3, second_hi = 0x9F;
  } else if (lead == 0xF0) {
    need = 4, second_lo = 0x90;
  } else if (lead >= 0xF1 && lead <= 0xF3) {
    need = 4;
  } else if (lead == 0xF4) {
    need = 4, second_hi = 0x8F;
  } else {
    return {Status::Invalid, 1};
  }
  for (std::size_t k = 1; k < need; ++k) {
    if (i + k >= s.size()) return {Status::Truncated, k};
    const auto byte = static_cast<unsigned char>(s[i + k]);
    const unsigned char lo = k == 1 ? second_lo : 0x80, hi = k == 1 ? second_hi : 0xBF;
    if (byte < lo || byte > hi) return {Status::Invalid, k};
  }
  return {Status::Complete, need};
}

// The byte at which `s` stops being well-formed UTF-8, or npos.
inline std::size_t first_invalid(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const Sequence seq = classify(s, i);
    if (seq.status != Status::Complete) return i;
    i += seq.length;
  }
  return std::string_view::npos;
}

}  // namespace batchlm::local_engine::utf8
