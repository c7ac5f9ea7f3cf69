// The tokenizer (local_engine/tokenizer/tokenizer.cpp) with the default model's vocabulary,
// loaded once: encode on arbitrary bytes, decode, and the streaming decoder.
//
// The model is $BATCHLM_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf in the source
// tree; without it the replay test is skipped (exit 77).
//
// What the tokenizer promises (tokenizer.cpp's header and tests/unit/local_engine/
// tokenizer_test.cpp): text is first read as llama.cpp reads it (each byte its decoder does not
// take becomes U+FFFD; a lead byte with its continuation bytes is one code point, written back
// as UTF-8, or U+FFFD per byte past U+10FFFF); then decode(encode(x)) == that reading, but
// that a byte without a token of its own is dropped (SmolLM2 has none for 0x04, 0x06, 0x13,
// 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, 0xF5..0xFF); with parse_special the text of
// control tokens becomes those tokens, which decode renders only when asked. So:
//
//   - encode never crashes, and every id is inside the vocabulary;
//   - for valid UTF-8 made only of bytes the vocabulary has tokens for,
//       decode(encode(x, false)) == x and decode(encode(x, true), render_special) == x,
//     and the StreamDecoder, fed the tokens one at a time, gives x;
//   - for any bytes, both round trips give the reading of x without the bytes the vocabulary
//     lacks, and the StreamDecoder gives that text with each invalid UTF-8 sequence (a
//     surrogate, which the reading keeps) replaced by U+FFFD.

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "batchlm/local_engine/gguf.hpp"
#include "batchlm/local_engine/tokenizer.hpp"
#include "fuzz_support.hpp"

using namespace batchlm;
using namespace batchlm::local_engine;

namespace {

std::unique_ptr<Tokenizer> tokenizer;
std::array<bool, 256> has_byte_token{};

std::filesystem::path model_path() {
  if (const char* env = std::getenv("BATCHLM_MODEL"); env != nullptr && *env != '\0') return env;
  return std::filesystem::path(BATCHLM_SOURCE_DIR) / "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

// GPT-2's bytes_to_unicode, written out here rather than taken from the tokenizer: the
// printable Latin-1 bytes stand for themselves, the other 68 move to U+0100 onwards.
std::string byte_level_char(int b) {
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  unsigned cp = static_cast<unsigned>(b);
  if (!printable) {
    cp = 256;
    for (int c = 0; c < b; ++c) {
      const bool p = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
      if (!p) ++cp;
    }
  }
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// U+FFFD for each maximal subpart of an ill-formed sequence (Unicode table 3-7), as the
// StreamDecoder promises at the end of a stream.
std::string replace_invalid(std::string_view s) {
  std::string out;
  std::size_t i = 0;
  while (i < s.size()) {
    const auto lead = static_cast<unsigned char>(s[i]);
    std::size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (lead < 0x80) need = 1;
    else if (lead >= 0xC2 && lead <= 0xDF) need = 2;
    else if (lead == 0xE0) need = 3, lo = 0xA0;
    else if (lead == 0xED) need = 3, hi = 0x9F;
    else if (lead >= 0xE1 && lead <= 0xEF) need = 3;
    else if (lead == 0xF0) need = 4, lo = 0x90;
    else if (lead == 0xF4) need = 4, hi = 0x8F;
    else if (lead >= 0xF1 && lead <= 0xF3) need = 4;
    std::size_t got = need == 0 ? 0 : 1;
    while (got > 0 && got < need && i + got < s.size()) {
      const auto c = static_cast<unsigned char>(s[i + got]);
      if (c < (got == 1 ? lo : 0x80) || c > (got == 1 ? hi : 0xBF)) break;
      ++got;
    }
    if (need > 0 && got == need) {
      out.append(s.substr(i, need));
      i += need;
    } else {
      out += "\xEF\xBF\xBD";
      i += got == 0 ? 1 : got;
    }
  }
  return out;
}

std::string show(std::string_view s) {
  std::string out;
  for (const char c : s) {
    const auto b = static_cast<unsigned char>(c);
    if (b >= 0x20 && b < 0x7f && b != '\\') {
      out += c;
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", b);
      out += hex;
    }
  }
  return out;
}

// The text as llama.cpp's decoder reads it into code points, written back as UTF-8: decoded to
// code points first (U+FFFD where a byte is not taken, or past U+10FFFF, one per byte), then
// encoded.
std::string llama_reading(std::string_view s) {
  std::vector<std::uint32_t> cps;
  std::vector<std::size_t> widths;
  for (std::size_t i = 0; i < s.size();) {
    const auto lead = static_cast<unsigned char>(s[i]);
    const std::size_t width = lead < 0x80 ? 1 : lead < 0xC0 ? 0 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : lead < 0xF8 ? 4 : 0;
    std::uint32_t cp = width == 1 ? lead : width == 2 ? (lead & 0x1Fu) : width == 3 ? (lead & 0x0Fu) : (lead & 0x07u);
    bool ok = width > 0 && i + width <= s.size();
    for (std::size_t k = 1; ok && k < width; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      ok = (c >> 6) == 2;
      cp = (cp << 6) | (c & 0x3Fu);
    }
    if (!ok || cp > 0x10FFFF) {
      cps.push_back(0xFFFD);
      ++i;
    } else {
      cps.push_back(cp);
      i += width;
    }
  }
  std::string out;
  for (std::uint32_t cp : cps) {
    // n bytes: the lead's n high bits set, then continuation bytes of six bits each.
    const std::size_t n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    std::string bytes(n, '\0');
    for (std::size_t k = n - 1; k > 0; --k, cp >>= 6) bytes[k] = static_cast<char>(0x80 | (cp & 0x3F));
    bytes[0] = static_cast<char>(n == 1 ? cp : ((0xFF00u >> n) & 0xFFu) | cp);
    out += bytes;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::filesystem::path path = model_path();
  if (!std::filesystem::exists(path)) {
    std::fprintf(stderr, "tokenizer fuzz: model not found: %s (scripts/fetch-model.sh downloads it)\n",
                 path.c_str());
    return 77;
  }
  tokenizer = std::make_unique<Tokenizer>(Vocab::from_gguf(gguf::File::open(path)));
  for (int b = 0; b < 256; ++b) has_byte_token[b] = tokenizer->find(byte_level_char(b)) >= 0;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (!tokenizer) {
    std::fprintf(stderr, "tokenizer fuzz: no model loaded\n");
    std::abort();
  }
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const bool valid = fuzz::valid_utf8(text);
  std::string representable;
  for (const char c : valid ? std::string(text) : llama_reading(text))
    if (has_byte_token[static_cast<unsigned char>(c)]) representable += c;
  const bool exact = valid && representable.size() == text.size();

  for (const bool parse_special : {false, true}) {
    const std::vector<Token> tokens = tokenizer->encode(text, parse_special);
    for (const Token t : tokens)
      FUZZ_CHECK(t >= 0 && static_cast<std::size_t>(t) < tokenizer->size(), "token id " + std::to_string(t));
    const std::string decoded = tokenizer->decode(tokens, /*render_special=*/parse_special);
    FUZZ_CHECK(!exact || decoded == text, "valid UTF-8 does not round-trip (parse_special " +
                                              std::to_string(parse_special) + "): '" + show(text) + "' -> '" +
                                              show(decoded) + "'");
    FUZZ_CHECK(decoded == representable, "round trip (parse_special " + std::to_string(parse_special) +
                                             ") gives '" + show(decoded) + "', expected '" + show(representable) + "'");

    StreamDecoder stream(*tokenizer, /*render_special=*/parse_special);
    std::string streamed;
    for (const Token t : tokens) streamed += stream.push(t);
    streamed += stream.finish();
    FUZZ_CHECK(!exact || streamed == text, "streamed '" + show(streamed) + "', expected '" + show(text) + "'");
    FUZZ_CHECK(streamed == replace_invalid(decoded),
               "streamed '" + show(streamed) + "', expected '" + show(replace_invalid(decoded)) + "'");
  }
  return 0;
}
