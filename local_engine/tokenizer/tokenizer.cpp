#include "batchlm/local_engine/tokenizer.hpp"
#include "utf8.hpp"

// Two tokenizers, chosen by tokenizer.ggml.model, both meant to give llama.cpp's ids
// (src/llama-vocab.cpp, src/unicode.cpp) exactly.
//
// Byte-level BPE as GPT-2 introduced it and llama.cpp runs it for `tokenizer.ggml.model =
// "gpt2"` vocabularies. Encoding a text takes four steps:
//
//   1. Special tokens. The text of control, user-defined and unknown-type tokens is cut out
//      first and becomes those ids directly (control and unknown ones only with parse_special).
//      A vocabulary that llama.cpp takes for Phi-3's also drops the whitespace after most of
//      them (Vocab::strip_after_special).
//   2. Pre-tokenizer. Each remaining stretch of text is split into pieces by the model family's
//      sequence of regular expressions (tokenizer.ggml.pre); BPE never merges across pieces.
//   3. BPE. Each piece starts as one symbol per byte; the adjacent pair with the lowest merge
//      rank is merged (the leftmost on a tie) until no adjacent pair has a merge.
//   4. Lookup. Every final symbol is a vocabulary token.
//
// Token text is stored "byte-level encoded": every byte maps to one printable code point (the
// GPT-2 bytes_to_unicode table), so a token such as "Ġworld" stands for the bytes " world".
// Because every merge joins two tokens into a token, the BPE works on token ids throughout
// and never builds strings; the pair -> merge table is keyed by the two ids.
//
// The ids are meant to be identical to llama.cpp's. Text that is not valid UTF-8 is first read
// as llama.cpp reads it (as_llama_reads below): each byte its decoder does not take becomes
// U+FFFD, and the forms it takes that the standard does not (overlong, surrogates) become the
// code point's own bytes. So decode(encode(x)) == x for valid UTF-8 only. (A vocabulary may
// lack the byte tokens of bytes that valid UTF-8 never holds, 0xF5-0xFF among them: kept as
// bytes, they would have no token at all.)
//
// SentencePiece's BPE, as llama.cpp runs it for `tokenizer.ggml.model = "llama"` vocabularies
// (Llama 2, Mistral 7B, Phi-3, ...). There are no merge rules; each token has a score
// (tokenizer.ggml.scores), and any two adjacent symbols whose joined text is a token may join.
//
//   1. Special tokens, as for BPE, except that llama.cpp's end-of-generation texts ("</s>",
//      "<|end|>", ...) are control tokens whatever type the file gives them.
//   2. Escape. In each remaining stretch of text every space becomes U+2581 "▁", and, with
//      add_space_prefix (the default), one more "▁" goes in front of a stretch that starts the
//      text or follows a special token. There is no pre-tokenizer: joins cross words.
//   3. Join by score. The stretch starts as one symbol per character, a character being as
//      many bytes as its first byte announces (the rest of the text permitting), whether or not
//      they are valid UTF-8. Of the adjacent pairs whose joined text is a token, of any type,
//      the one with the highest score joins (the leftmost on a tie), until none is left.
//   4. Lookup with byte fallback. A final symbol whose text is a token is that token. Only a
//      symbol that never joined can fail to be one (every join makes a token's text), and it
//      becomes one byte token "<0xXX>" per byte; failing that, the token whose text is the
//      byte itself; failing that, UNK, once for each run of such bytes.
//
// SentencePiece also "resegments": a final symbol whose token may not be output is split back
// into the two symbols it was joined from. llama.cpp keeps that step but only ever records
// pairs whose joined text is a token, so every symbol it would resegment is a token already,
// and the step never splits anything; this tokenizer leaves it out. Where llama.cpp throws for
// a byte without a token (std::out_of_range), this tokenizer gives UNK, or drops the byte when
// the vocabulary has no UNK either.
//
// Decoding turns a "▁" of a normal token back into a space and a byte token into its byte.
// Invalid UTF-8 goes through steps 2-4 as llama.cpp's does (it does not replace it with
// U+FFFD here); every byte comes back, but a "▁" that such a symbol swallowed comes back as
// the bytes of "▁" rather than a space.

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace batchlm::local_engine {

namespace {

// --- UTF-8 ------------------------------------------------------------------------------------

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// The code point of the complete sequence of `length` bytes at s[i].
char32_t decode_utf8(std::string_view s, std::size_t i, std::size_t length) {
  const auto byte = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[i + k])); };
  switch (length) {
    case 1: return byte(0);
    case 2: return ((byte(0) & 0x1F) << 6) | (byte(1) & 0x3F);
    case 3: return ((byte(0) & 0x0F) << 12) | ((byte(1) & 0x3F) << 6) | (byte(2) & 0x3F);
    default:
      return ((byte(0) & 0x07) << 18) | ((byte(1) & 0x3F) << 12) | ((byte(2) & 0x3F) << 6) |
             (byte(3) & 0x3F);
  }
}

// --- The byte-level alphabet --------------------------------------------------------------------

// GPT-2's bytes_to_unicode: the 188 bytes that are printable Latin-1 characters ('!'..'~',
// U+00A1..U+00AC, U+00AE..U+00FF) stand for themselves; the other 68 (controls, space, DEL,
// U+0080..U+00A0, soft hyphen) are moved, in byte order, to U+0100, U+0101, ... U+0143. So a
// space is "Ġ" (U+0120) and a newline "Ċ" (U+010A).
struct ByteAlphabet {
  std::array<char32_t, 256> char_of_byte{};
  std::array<std::int16_t, 0x144> byte_of_char{};  // by code point; -1: not in the alphabet
};

constexpr ByteAlphabet make_byte_alphabet() {
  ByteAlphabet alphabet;
  for (auto& b : alphabet.byte_of_char) b = -1;
  char32_t next_moved = 0x100;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const char32_t cp = printable ? static_cast<char32_t>(b) : next_moved++;
    alphabet.char_of_byte[b] = cp;
    alphabet.byte_of_char[cp] = static_cast<std::int16_t>(b);
  }
  return alphabet;
}

constexpr ByteAlphabet kByteAlphabet = make_byte_alphabet();

// The vocabulary form of raw bytes: each byte as its alphabet character.
void append_byte_level(std::string& out, std::string_view bytes) {
  for (const char c : bytes) utf8::append(out, kByteAlphabet.char_of_byte[static_cast<unsigned char>(c)]);
}

// The inverse: the bytes a byte-level token text stands for. Characters outside the alphabet
// (a vocabulary may hold a few) are kept as their own UTF-8, and so are stray invalid bytes.
std::string bytes_of_byte_level(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const utf8::Sequence seq = utf8::classify(text, i);
    if (seq.status != utf8::Status::Complete) {
      out += text[i++];
      continue;
    }
    const char32_t cp = decode_utf8(text, i, seq.length);
    if (cp < kByteAlphabet.byte_of_char.size() && kByteAlphabet.byte_of_char[cp] >= 0) {
      out += static_cast<char>(kByteAlphabet.byte_of_char[cp]);
    } else {
      out.append(text.substr(i, seq.length));
    }
    i += seq.length;
  }
  return out;
}

// "<0x41>" -> 0x41 for Byte-type tokens; -1 for any other text.
int parse_byte_token(std::string_view text) {
  if (text.size() != 6 || text.substr(0, 3) != "<0x" || text[5] != '>') return -1;
  int value = 0;
  for (const char c : text.substr(3, 2)) {
    int digit = -1;
    if (c >= '0' && c <= '9') digit = c - '0';
    if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

// --- Pre-tokenizer --------------------------------------------------------------------------------

// \s as llama.cpp (and Hugging Face's Rust regex) define it: the Unicode White_Space property.
// PCRE2's own \s under UCP misses U+0085, so the patterns spell the class out. {WS} in a pattern
// below is replaced by this list, inside brackets.
constexpr std::string_view kWhitespaceClass =
    "\\t\\n\\x0B\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
    "\\x{205F}\\x{3000}";

// GPT-2: contractions, letters, numbers and other symbols each with an optional leading space,
// and whitespace, keeping the last whitespace character for the word that follows. (llama.cpp
// writes it without the final "|\s+" but its hand-written matcher behaves as if it were there;
// the two alternatives only differ where a gap would be left, and gaps become pieces anyway.)
constexpr std::string_view kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^{WS}\\p{L}\\p{N}]+|[{WS}]+(?![^{WS}])|[{WS}]+";

// Llama 3 (tiktoken cl100k style): case-insensitive contractions, a letter run that may take one
// leading non-letter, numbers in groups of at most three, symbols that take trailing newlines.
constexpr std::string_view kLlama3Pattern =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^{WS}\\p{L}\\p{N}]+[\\r\\n]*|[{WS}]*[\\r\\n]+|[{WS}]+(?![^{WS}])|[{WS}]+";

// Qwen2 and Qwen2.5 (and DeepSeek-R1's Qwen distills): Llama 3's pattern with every digit its
// own piece; unlike Llama 3, a piece that is itself a token still goes through the merges.
constexpr std::string_view kQwen2Pattern =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}| ?[^{WS}\\p{L}\\p{N}]+[\\r\\n]*|[{WS}]*[\\r\\n]+|[{WS}]+(?![^{WS}])|[{WS}]+";

// Tekken (Mistral Nemo, Mistral Small 3, Pixtral) and GPT-4o's o200k (Phi-4-mini, Llama 4): a
// word is capitals then small letters ("Camel", "HTTPServer") or capitals alone ("ALL"), after
// at most one non-letter; symbols take trailing newlines and slashes. Tekken makes every digit
// a piece; o200k groups digits by three and lets a word take a contraction ("DON'T"). The case
// classes are llama.cpp's, which runs these patterns with std::regex on a copy of the text in
// which every non-ASCII letter is one placeholder: a capital is a letter other than a-z, a
// small letter one other than A-Z. So a non-ASCII letter is both ("ÉCOLE" is "É" and "COLE"),
// and combining marks, which the models' own patterns count with letters, are not letters.
constexpr std::string_view kTekkenPattern =
    "[^\\r\\n\\p{L}\\p{N}]?[^\\P{L}a-z]*[^\\P{L}A-Z]+|[^\\r\\n\\p{L}\\p{N}]?[^\\P{L}a-z]+[^\\P{L}A-Z]*|"
    "\\p{N}| ?[^{WS}\\p{L}\\p{N}]+[\\r\\n/]*|[{WS}]*[\\r\\n]+|[{WS}]+(?![^{WS}])|[{WS}]+";

constexpr std::string_view kGpt4oPattern =
    "[^\\r\\n\\p{L}\\p{N}]?[^\\P{L}a-z]*[^\\P{L}A-Z]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
    "[^\\r\\n\\p{L}\\p{N}]?[^\\P{L}a-z]+[^\\P{L}A-Z]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
    "\\p{N}{1,3}| ?[^{WS}\\p{L}\\p{N}]+[\\r\\n/]*|[{WS}]*[\\r\\n]+|[{WS}]+(?![^{WS}])|[{WS}]+";

// The pre-tokenizers this build knows: the tokenizer.ggml.pre values that name each (llama.cpp's
// names for the same patterns), the patterns, and whether a piece that is itself a token is taken
// whole, whatever the merges would make of it (llama.cpp's ignore_merges), and whether a
// vocabulary without tokenizer.ggml.add_bos_token adds a BOS (llama.cpp does for these two only).
struct PreTokenizerKind {
  std::vector<std::string_view> names;
  std::vector<std::string_view> patterns;
  bool ignore_merges = false;
  bool bos_by_default = false;
};

const std::vector<PreTokenizerKind>& pre_tokenizer_kinds() {
  static const std::vector<PreTokenizerKind> kinds = {
      // Every digit its own piece first, then GPT-2's pattern.
      {{"smollm", "starcoder", "refact"}, {"\\p{N}", kGpt2Pattern}},
      {{"gpt2", "gpt-2"}, {kGpt2Pattern}},
      // llama.cpp's fallback for a vocabulary that names no known pre-tokenizer.
      {{"default", ""}, {"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2Pattern, "\\p{N}+", "[0-9][0-9][0-9]"}},
      {{"llama3", "llama-v3", "llama-bpe"}, {kLlama3Pattern}, true, true},
      {{"qwen2", "deepseek-r1-qwen"}, {kQwen2Pattern}},
      {{"tekken"}, {kTekkenPattern}, true, true},
      {{"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"}, {kGpt4oPattern}},
  };
  return kinds;
}

// The kind a tokenizer.ggml.pre value names, or nullptr.
const PreTokenizerKind* find_pre_tokenizer(std::string_view name) {
  for (const PreTokenizerKind& k : pre_tokenizer_kinds())
    if (std::find(k.names.begin(), k.names.end(), name) != k.names.end()) return &k;
  return nullptr;
}

std::string expand_whitespace(std::string_view pattern) {
  std::string out;
  for (std::size_t i = 0; i < pattern.size();) {
    if (pattern.substr(i, 4) == "{WS}") {
      out += kWhitespaceClass;
      i += 4;
    } else {
      out += pattern[i++];
    }
  }
  return out;
}

struct CodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};
using RegexCode = std::unique_ptr<pcre2_code, CodeDeleter>;
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

std::string pcre2_message(int error_code) {
  std::array<PCRE2_UCHAR, 256> buffer{};
  pcre2_get_error_message(error_code, buffer.data(), buffer.size());
  return reinterpret_cast<const char*>(buffer.data());
}

// A byte range [begin, end) of the text being tokenized.
struct Range {
  std::size_t begin = 0;
  std::size_t end = 0;
};

// Splits text into the pieces that BPE works on, by a sequence of regular expressions: the
// first splits the whole text, each later one splits every piece the one before produced.
// Within a piece, each match is a piece and so is each stretch of text between matches (it is
// kept, not dropped). A regex sees only its piece: a lookahead at the piece's end sees the end.
class PreTokenizer {
 public:
  // Throws std::invalid_argument for a pre-tokenizer this build does not know.
  explicit PreTokenizer(std::string_view name) {
    const PreTokenizerKind* kind = find_pre_tokenizer(name);
    if (kind == nullptr) {
      std::string known;
      for (const PreTokenizerKind& k : pre_tokenizer_kinds()) {
        for (const std::string_view n : k.names) {
          if (!n.empty()) known += (known.empty() ? "" : ", ") + std::string(n);
        }
      }
      throw std::invalid_argument("tokenizer: unsupported pre-tokenizer '" + std::string(name) +
                                  "' (tokenizer.ggml.pre; known: " + known + ")");
    }
    ignore_merges_ = kind->ignore_merges;
    for (const std::string_view pattern : kind->patterns) {
      const std::string expanded = expand_whitespace(pattern);
      int error = 0;
      PCRE2_SIZE error_offset = 0;
      RegexCode code(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(expanded.data()), expanded.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &error_offset, nullptr));
      if (!code) {
        throw std::logic_error("tokenizer: pattern '" + expanded + "' does not compile at offset " +
                               std::to_string(error_offset) + ": " + pcre2_message(error));
      }
      // JIT makes matching several times faster; where it is unavailable the interpreter runs.
      (void)pcre2_jit_compile(code.get(), PCRE2_JIT_COMPLETE);
      regexes_.push_back(std::move(code));
    }
  }

  bool ignore_merges() const { return ignore_merges_; }

  // Appends the pieces of text (offsets into text) to `pieces`. `scratch` is reused storage.
  void split(std::string_view text, std::vector<Range>& pieces, std::vector<Range>& scratch) const {
    // PCRE2 in UTF mode needs valid UTF-8. Invalid bytes are matched as U+FFFD (as llama.cpp
    // decodes them) in a copy, and the piece boundaries are mapped back to the original bytes.
    std::string sanitized;
    std::vector<std::size_t> original_offset;  // (sanitized.size() + 1): sanitized -> original
    std::string_view subject = text;
    if (utf8::first_invalid(text) != std::string_view::npos) {
      sanitized.reserve(text.size() + 8);
      original_offset.reserve(text.size() + 8);
      for (std::size_t i = 0; i < text.size();) {
        const utf8::Sequence seq = utf8::classify(text, i);
        if (seq.status == utf8::Status::Complete) {
          sanitized.append(text.substr(i, seq.length));
          for (std::size_t k = 0; k < seq.length; ++k) original_offset.push_back(i + k);
          i += seq.length;
        } else {
          // One U+FFFD per invalid byte, as llama.cpp does.
          sanitized.append(kReplacementCharacter);
          original_offset.insert(original_offset.end(), kReplacementCharacter.size(), i);
          i += 1;
        }
      }
      original_offset.push_back(text.size());
      subject = sanitized;
    }

    std::vector<Range>& current = scratch;
    current.assign(1, Range{0, subject.size()});
    std::vector<Range> next;
    MatchData match(pcre2_match_data_create(1, nullptr));
    if (!match) throw std::bad_alloc();
    for (const RegexCode& regex : regexes_) {
      next.clear();
      next.reserve(current.size() * 2);
      for (const Range piece : current) split_piece(regex.get(), match.get(), subject, piece, next);
      current.swap(next);
    }

    for (const Range piece : current) {
      if (original_offset.empty()) {
        pieces.push_back(piece);
      } else {
        pieces.push_back({original_offset[piece.begin], original_offset[piece.end]});
      }
    }
  }

 private:
  static void split_piece(pcre2_code* regex, pcre2_match_data* match, std::string_view subject,
                          Range piece, std::vector<Range>& out) {
    const auto* base = reinterpret_cast<PCRE2_SPTR>(subject.data() + piece.begin);
    const std::size_t length = piece.end - piece.begin;
    std::size_t position = 0;   // where the next search starts, relative to the piece
    std::size_t kept_to = 0;    // everything before this is in `out` already
    while (position < length) {
      const int rc = pcre2_match(regex, base, length, position, PCRE2_NO_UTF_CHECK, match, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) throw std::runtime_error("tokenizer: pre-tokenizer regex failed: " + pcre2_message(rc));
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
      const std::size_t start = ovector[0], end = ovector[1];
      if (end == start) {
        // None of the patterns can match empty; should one ever, step over one character.
        position = start + utf8::classify(subject, piece.begin + start).length;
        continue;
      }
      if (start > kept_to) out.push_back({piece.begin + kept_to, piece.begin + start});
      out.push_back({piece.begin + start, piece.begin + end});
      kept_to = position = end;
    }
    if (kept_to < length) out.push_back({piece.begin + kept_to, piece.end});
  }

  std::vector<RegexCode> regexes_;
  bool ignore_merges_ = false;
};

// --- BPE --------------------------------------------------------------------------------------

constexpr Token kNoToken = -1;   // a byte whose one-character token the vocabulary lacks
constexpr Token kMergedAway = -2;  // a symbol absorbed by its left neighbour

struct Merge {
  std::int32_t rank;
  Token result;
};

std::uint64_t pair_key(Token left, Token right) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32) |
         static_cast<std::uint32_t>(right);
}

// One symbol of the piece being merged, in a doubly linked list over the piece's bytes.
struct Symbol {
  Token token;
  std::int32_t prev;  // -1 at the start
  std::int32_t next;  // -1 at the end
};

// A pair that may merge. It is stale once either side has changed since it was queued, which
// the token ids tell: a symbol's token changes with every merge it takes part in.
struct Candidate {
  std::int32_t rank;
  std::int32_t left, right;  // symbol indices
  Token left_token, right_token, result;
};

// Orders the heap so that the top is the lowest rank, and of equal ranks the leftmost.
struct LaterCandidate {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.left > b.left;
  }
};

// --- SentencePiece BPE ---------------------------------------------------------------------------

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581, which stands for a space

// The length of the character that starts with byte `lead`, counted as llama.cpp counts it (its
// unicode_len_utf8): from the lead byte's top bits alone, so a stray continuation byte is a
// character of one byte and an invalid lead byte takes the bytes after it along.
std::size_t character_length(char lead) {
  const auto byte = static_cast<unsigned char>(lead);
  if (byte < 0xC0) return 1;
  if (byte < 0xE0) return 2;
  if (byte < 0xF0) return 3;
  return 4;
}

// One symbol of the stretch being joined: escaped[begin, begin + length), in a doubly linked list.
struct SpmSymbol {
  std::uint32_t begin;
  std::uint32_t length;  // 0 once joined into its left neighbour
  std::int32_t prev;     // -1 at the start
  std::int32_t next;     // -1 at the end
};

// Two adjacent symbols whose joined text is a token, `length` bytes long. It is stale once
// either symbol has joined another since it was queued: lengths only grow, so theirs no longer
// add up to `length`.
struct SpmCandidate {
  float score;  // of the joined token
  std::int32_t left, right;
  std::uint32_t length;
};

// Orders the heap so that the top is the highest score, and of equal scores the leftmost.
struct LowerScore {
  bool operator()(const SpmCandidate& a, const SpmCandidate& b) const {
    if (a.score < b.score) return true;
    if (b.score < a.score) return false;
    return a.left > b.left;
  }
};

// The whitespace of C's isspace in the "C" locale, which llama.cpp strips after special tokens.
bool is_ascii_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

// Per-call storage, reused across the pieces of one encode() call.
struct Workspace {
  std::vector<Range> pieces, split_scratch;
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
  std::string byte_level;
  std::string escaped;
  std::vector<SpmSymbol> spm_symbols;
  std::vector<SpmCandidate> spm_heap;
};

struct Fragment {
  Range range;           // the text, when token is kNoToken
  Token token = kNoToken;
};

// Texts at which generation stops besides the eos/eot/eom ids, as in llama.cpp's
// end-of-generation set: the end of a turn or a document in the families it knows, and the
// fill-in-the-middle padding, repository and file separators. For SmolLM2 that adds
// <|endoftext|> (0) and <reponame> (4) to <|im_end|> (2), the same three llama.cpp stops at.
constexpr std::array<std::string_view, 18> kEndOfGenerationTexts = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "<|end_of_text|>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
    "<REPO>", "<reponame>", "<|file_sep|>", "<PAD>",
};

// Texts that llama.cpp makes end of generation, and control tokens, whatever type the file
// gives them (its "control-looking token" override). Applied to "llama" vocabularies, where it
// matters for Phi-3: its "</s>" is user-defined in the file, and so would otherwise be cut out
// of plain text and rendered without render_special. (llama.cpp's exceptions to the list, for
// gpt-oss, Solar Open, Gemma 4 and PLaMo, concern BPE vocabularies.)
constexpr std::array<std::string_view, 22> kControlLookingEndTexts = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\xEF\xBD\x9C" "end\xE2\x96\x81" "of\xE2\x96\x81" "sentence\xEF\xBD\x9C>",  // DeepSeek's, fullwidth bars
    "[e~[",
};

// The special tokens after which a Phi-3 vocabulary keeps the whitespace (strip_after_special).
constexpr std::array<std::string_view, 3> kKeepSpaceAfter = {"<unk>", "<s>", "<|endoftext|>"};

template <std::size_t N>
bool is_one_of(const std::array<std::string_view, N>& texts, std::string_view text) {
  return std::find(texts.begin(), texts.end(), text) != texts.end();
}

// The token text with every "▁" turned back into a space.
std::string unescape_spaces(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    if (text.substr(i, kSpaceMark.size()) == kSpaceMark) {
      out += ' ';
      i += kSpaceMark.size();
    } else {
      out += text[i++];
    }
  }
  return out;
}

}  // namespace

// --- Vocab::from_gguf -----------------------------------------------------------------------------

namespace {

const gguf::Array& require_array(const gguf::File& file, const std::string& key,
                                 gguf::ValueType element_type) {
  const gguf::Array& array = file.require(key).as_array(key);
  if (array.element_type != element_type && !array.items.empty()) {
    file.fail("metadata key '" + key + "' is an array of " +
              std::string(gguf::to_string(array.element_type)) + ", expected an array of " +
              std::string(gguf::to_string(element_type)));
  }
  return array;
}

}  // namespace

namespace {
Vocab read_vocab(const gguf::File& file);
}  // namespace

Vocab Vocab::from_gguf(const gguf::File& file) {
  try {
    return read_vocab(file);
  } catch (const gguf::Error& e) {
    // A value's own accessors (as_string, as_i64) do not know the file: its path goes first.
    const std::string path = file.path().string();
    if (std::string_view(e.what()).starts_with(path + ": ")) throw;
    file.fail(e.what());
  }
}

namespace {

Vocab read_vocab(const gguf::File& file) {
  Vocab vocab;
  vocab.model = file.get_string("tokenizer.ggml.model");
  vocab.pre = file.find_string("tokenizer.ggml.pre").value_or("default");

  const std::string tokens_key = "tokenizer.ggml.tokens";
  const gguf::Array& tokens = require_array(file, tokens_key, gguf::ValueType::String);
  if (tokens.items.empty()) file.fail("metadata key '" + tokens_key + "' is empty");
  if (tokens.items.size() > static_cast<std::size_t>(INT32_MAX)) {
    file.fail("metadata key '" + tokens_key + "' has more tokens than a token id can number");
  }
  vocab.tokens.reserve(tokens.items.size());
  for (const gguf::Value& item : tokens.items) vocab.tokens.push_back(item.as_string(tokens_key));

  const std::string types_key = "tokenizer.ggml.token_type";
  if (file.find(types_key) != nullptr) {
    const gguf::Array& types = file.require(types_key).as_array(types_key);
    // llama.cpp reads the first n_tokens entries and rejects fewer.
    if (types.items.size() < vocab.tokens.size()) {
      file.fail("metadata key '" + types_key + "' has " + std::to_string(types.items.size()) +
                " entries for " + std::to_string(vocab.tokens.size()) + " tokens");
    }
    vocab.types.reserve(vocab.tokens.size());
    for (std::size_t i = 0; i < vocab.tokens.size(); ++i) {
      const std::int64_t type = types.items[i].as_i64(types_key);
      // Out-of-range types are Undefined, as in llama.cpp.
      vocab.types.push_back(type >= 0 && type <= 6 ? static_cast<TokenType>(type) : TokenType::Undefined);
    }
  } else {
    vocab.types.assign(vocab.tokens.size(), TokenType::Normal);
  }

  const bool spm = vocab.model == "llama";
  if (spm) {
    // SentencePiece joins by score, so a "llama" vocabulary must have them (llama.cpp would take
    // every score as 0 and join in text order).
    const std::string scores_key = "tokenizer.ggml.scores";
    const gguf::Array& scores = file.require(scores_key).as_array(scores_key);
    // As in llama.cpp: F32 or I32, and at least one per token (the first n_tokens are read).
    if (scores.element_type != gguf::ValueType::F32 && scores.element_type != gguf::ValueType::I32 &&
        !scores.items.empty()) {
      file.fail("metadata key '" + scores_key + "' is an array of " +
                std::string(gguf::to_string(scores.element_type)) + ", expected an array of " +
                std::string(gguf::to_string(gguf::ValueType::F32)));
    }
    if (scores.items.size() < vocab.tokens.size()) {
      file.fail("metadata key '" + scores_key + "' has " + std::to_string(scores.items.size()) +
                " entries for " + std::to_string(vocab.tokens.size()) + " tokens");
    }
    vocab.scores.reserve(vocab.tokens.size());
    for (std::size_t i = 0; i < vocab.tokens.size(); ++i) {
      vocab.scores.push_back(static_cast<float>(scores.items[i].as_f64(scores_key)));
    }
  }

  const std::string merges_key = "tokenizer.ggml.merges";
  if (vocab.model == "gpt2" || file.find(merges_key) != nullptr) {
    const gguf::Array& merges = require_array(file, merges_key, gguf::ValueType::String);
    vocab.merges.reserve(merges.items.size());
    for (const gguf::Value& item : merges.items) vocab.merges.push_back(item.as_string(merges_key));
  }

  // An id past the vocabulary is ignored rather than fatal, as llama.cpp does: published files
  // exist whose padding id is one past the end, and nothing here depends on it. llama.cpp then
  // keeps its default, which for "llama" vocabularies is bos 1, eos 2 and unk 0 (if the
  // vocabulary is that large); here the BPE ones have none.
  const auto token_id = [&](const std::string& key, Token default_id = -1) -> Token {
    const std::optional<std::uint64_t> id = file.find_u64(key);
    if (id && *id < vocab.tokens.size()) return static_cast<Token>(*id);
    return default_id >= 0 && static_cast<std::size_t>(default_id) < vocab.tokens.size() ? default_id : -1;
  };
  vocab.bos = token_id("tokenizer.ggml.bos_token_id", spm ? 1 : -1);
  vocab.eos = token_id("tokenizer.ggml.eos_token_id", spm ? 2 : -1);
  vocab.eot = token_id("tokenizer.ggml.eot_token_id");
  vocab.eom = token_id("tokenizer.ggml.eom_token_id");
  vocab.unk = token_id("tokenizer.ggml.unknown_token_id", spm ? 0 : -1);
  vocab.pad = token_id("tokenizer.ggml.padding_token_id");
  // Without the key, llama.cpp adds a BOS for every "llama" vocabulary, and for the BPE ones
  // whose pre-tokenizer says so (PreTokenizerKind::bos_by_default).
  const PreTokenizerKind* kind = find_pre_tokenizer(vocab.pre);
  vocab.add_bos = file.find_bool("tokenizer.ggml.add_bos_token").value_or(spm || (kind != nullptr && kind->bos_by_default));
  vocab.add_space_prefix = file.find_bool("tokenizer.ggml.add_space_prefix").value_or(spm);
  // llama.cpp marks the special tokens of Phi-3 by the model's name (lower-cased).
  std::string name = file.find_string("general.name").value_or("");
  for (char& c : name) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  vocab.strip_after_special = name.find("phi-3") != std::string::npos || name.find("phi3") != std::string::npos;
  vocab.chat_template = file.find_string("tokenizer.chat_template").value_or("");

  // Converters often leave the end-of-turn id out; find it by its text, as llama.cpp does.
  const auto find_text = [&](std::initializer_list<std::string_view> texts) -> Token {
    for (const std::string_view text : texts) {
      const auto it = std::find(vocab.tokens.begin(), vocab.tokens.end(), text);
      if (it != vocab.tokens.end()) return static_cast<Token>(it - vocab.tokens.begin());
    }
    return -1;
  };
  if (vocab.eot < 0) vocab.eot = find_text({"<|im_end|>", "<|eot_id|>", "<|end|>"});
  if (vocab.eom < 0) vocab.eom = find_text({"<|eom_id|>"});
  return vocab;
}

}  // namespace

// --- Tokenizer --------------------------------------------------------------------------------

struct Tokenizer::Impl {
  Vocab vocab;
  bool spm = false;  // "llama": SentencePiece; else "gpt2": byte-level BPE
  std::optional<PreTokenizer> pre_tokenizer;  // "gpt2" only
  // Token text -> id. The keys view vocab.tokens, which never changes after construction.
  std::unordered_map<std::string_view, Token> ids;
  // Raw byte -> "gpt2": the id of the token that is that byte's alphabet character; "llama":
  // its fallback token, <0xXX> or else the byte's own text. kNoToken where there is none.
  std::array<Token, 256> byte_tokens{};
  // (left id, right id) -> rank and merged id; pair_key() packs the two ids. 48,900 entries
  // for SmolLM2, one lookup per adjacent pair a piece ever forms.
  std::unordered_map<std::uint64_t, Merge> merges;
  // Id -> the bytes the token stands for when special tokens are rendered.
  std::vector<std::string> pieces;
  // Tokens cut out of the text before pre-tokenizing: longest text first, then lowest id.
  std::vector<Token> special_tokens;
  std::vector<bool> strip_after;        // by id: the whitespace after this special token goes
  std::vector<bool> end_of_generation;  // by id

  explicit Impl(Vocab v) : vocab(std::move(v)), spm(vocab.model == "llama") {
    if (!spm) pre_tokenizer.emplace(vocab.pre);
  }

  void encode_text(std::string_view text, Workspace& work, std::vector<Token>& out) const;
  void encode_piece(std::string_view piece, Workspace& work, std::vector<Token>& out) const;
  void encode_spm(std::string_view text, bool space_prefix, Workspace& work, std::vector<Token>& out) const;
};

Tokenizer::Tokenizer(Vocab vocab) {
  if (vocab.model != "gpt2" && vocab.model != "llama") {
    throw std::invalid_argument("unsupported tokenizer model " + gguf::quote_name(vocab.model) +
                                " (byte-level BPE, \"gpt2\", and SentencePiece, \"llama\", are supported)");
  }
  impl_ = std::make_unique<Impl>(std::move(vocab));
  Impl& impl = *impl_;
  const Vocab& v = impl.vocab;
  const std::size_t n = v.tokens.size();
  if (n == 0) throw std::invalid_argument("tokenizer: the vocabulary is empty");
  if (n > static_cast<std::size_t>(INT32_MAX)) throw std::invalid_argument("tokenizer: vocabulary too large");
  if (!v.types.empty() && v.types.size() != n) {
    throw std::invalid_argument("tokenizer: " + std::to_string(v.types.size()) + " token types for " +
                                std::to_string(n) + " tokens");
  }
  if (v.types.empty()) impl.vocab.types.assign(n, TokenType::Normal);
  if (impl.spm) {
    if (v.scores.size() != n) {
      throw std::invalid_argument("tokenizer: " + std::to_string(v.scores.size()) + " scores for " +
                                  std::to_string(n) + " tokens");
    }
    for (std::size_t id = 0; id < n; ++id) {
      if (std::isnan(v.scores[id])) {
        throw std::invalid_argument("tokenizer: the score of token " + std::to_string(id) + " is not a number");
      }
    }
  }

  const std::array<std::pair<const char*, Token>, 6> special_ids = {{
      {"bos", v.bos}, {"eos", v.eos}, {"eot", v.eot}, {"eom", v.eom}, {"unk", v.unk}, {"pad", v.pad}}};
  for (const auto& [name, id] : special_ids) {
    if (id < -1 || id >= static_cast<Token>(n)) {
      throw std::invalid_argument(std::string("tokenizer: ") + name + " id " + std::to_string(id) +
                                  " is outside the vocabulary of " + std::to_string(n));
    }
  }

  impl.ids.reserve(n);
  for (std::size_t id = 0; id < n; ++id) {
    const std::string& text = v.tokens[id];
    if (text.empty()) continue;  // can be neither matched nor merged into
    const auto [it, inserted] = impl.ids.emplace(text, static_cast<Token>(id));
    if (!inserted) {
      throw std::invalid_argument("tokenizer: token '" + text + "' appears twice, as ids " +
                                  std::to_string(it->second) + " and " + std::to_string(id));
    }
  }

  for (int b = 0; b < 256; ++b) {
    std::string text;
    if (impl.spm) {
      constexpr std::string_view kHex = "0123456789ABCDEF";
      text = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
      if (!impl.ids.contains(text)) text = std::string(1, static_cast<char>(b));
    } else {
      utf8::append(text, kByteAlphabet.char_of_byte[b]);
    }
    const auto it = impl.ids.find(text);
    impl.byte_tokens[b] = it == impl.ids.end() ? kNoToken : it->second;
  }

  // SentencePiece has no merge rules; a "llama" vocabulary's, if it had any, would go unused.
  const std::size_t merge_count = impl.spm ? 0 : v.merges.size();
  impl.merges.reserve(merge_count);
  for (std::size_t rank = 0; rank < merge_count; ++rank) {
    const std::string& merge = v.merges[rank];
    // "a b": split at the first space after the first character, as llama.cpp does.
    const std::size_t space = merge.find(' ', 1);
    const auto lookup = [&](std::string_view text) {
      const auto it = impl.ids.find(text);
      if (it == impl.ids.end()) {
        throw std::invalid_argument("tokenizer: merge " + std::to_string(rank) + " '" + merge +
                                    "' names '" + std::string(text) + "', which is not a token");
      }
      return it->second;
    };
    if (space == std::string::npos || space + 1 == merge.size()) {
      throw std::invalid_argument("tokenizer: merge " + std::to_string(rank) + " '" + merge +
                                  "' is not two tokens separated by a space");
    }
    const std::string_view left = std::string_view(merge).substr(0, space);
    const std::string_view right = std::string_view(merge).substr(space + 1);
    const Token left_id = lookup(left), right_id = lookup(right);
    const Token result = lookup(std::string(left) + std::string(right));
    // A repeated pair keeps its first (best) rank.
    impl.merges.emplace(pair_key(left_id, right_id), Merge{static_cast<std::int32_t>(rank), result});
  }

  impl.pieces.resize(n);
  impl.end_of_generation.assign(n, false);
  for (std::size_t id = 0; id < n; ++id) {
    const std::string& text = v.tokens[id];
    if (impl.spm && is_one_of(kControlLookingEndTexts, text)) {
      impl.vocab.types[id] = TokenType::Control;
      impl.end_of_generation[id] = true;
    }
    switch (v.types[id]) {
      case TokenType::Normal:
        impl.pieces[id] = impl.spm ? unescape_spaces(text) : bytes_of_byte_level(text);
        break;
      case TokenType::Byte: {
        // A byte token whose text is not "<0xXX>" (none is known) renders as its text.
        const int byte = parse_byte_token(text);
        impl.pieces[id] = byte >= 0    ? std::string(1, static_cast<char>(byte))
                          : impl.spm ? text
                                     : bytes_of_byte_level(text);
        break;
      }
      case TokenType::Control:
      case TokenType::Unknown:
      case TokenType::UserDefined:
        // Stored as the raw text, not byte-level encoded.
        impl.pieces[id] = text;
        if (!text.empty()) impl.special_tokens.push_back(static_cast<Token>(id));
        break;
      case TokenType::Unused:
      case TokenType::Undefined:
        break;  // render as nothing, as in llama.cpp
    }
    if (std::find(kEndOfGenerationTexts.begin(), kEndOfGenerationTexts.end(), text) !=
        kEndOfGenerationTexts.end()) {
      impl.end_of_generation[id] = true;
    }
  }
  for (const Token id : {v.eos, v.eot, v.eom}) {
    if (id >= 0) impl.end_of_generation[static_cast<std::size_t>(id)] = true;
  }
  // llama.cpp cuts longer special texts out first; equal lengths go by id here, so the order
  // is deterministic.
  std::stable_sort(impl.special_tokens.begin(), impl.special_tokens.end(), [&](Token a, Token b) {
    return v.tokens[static_cast<std::size_t>(a)].size() > v.tokens[static_cast<std::size_t>(b)].size();
  });
  impl.strip_after.assign(n, false);
  if (v.strip_after_special) {
    for (const Token id : impl.special_tokens) {
      impl.strip_after[static_cast<std::size_t>(id)] = !is_one_of(kKeepSpaceAfter, v.tokens[static_cast<std::size_t>(id)]);
    }
  }
}

Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;

std::vector<Token> Tokenizer::encode(std::string_view text, bool parse_special) const {
  const Impl& impl = *impl_;
  const Vocab& v = impl.vocab;

  // 1. Cut special tokens out, one token at a time, longest first: each token splits every
  //    text fragment that the tokens before it left, at each of its occurrences. Control and
  //    unknown tokens count only with parse_special; user-defined ones always (as in llama.cpp
  //    and Hugging Face, where added tokens are matched before the pre-tokenizer).
  std::vector<Fragment> fragments;
  if (!text.empty()) fragments.push_back({{0, text.size()}, kNoToken});
  std::vector<Fragment> next;
  for (const Token special : impl.special_tokens) {
    const TokenType type = v.types[static_cast<std::size_t>(special)];
    if (!parse_special && type != TokenType::UserDefined) continue;
    const std::string_view needle = v.tokens[static_cast<std::size_t>(special)];
    if (text.find(needle) == std::string_view::npos) continue;
    next.clear();
    for (const Fragment& fragment : fragments) {
      if (fragment.token != kNoToken) {
        next.push_back(fragment);
        continue;
      }
      const std::string_view within = text.substr(0, fragment.range.end);
      std::size_t position = fragment.range.begin;
      for (std::size_t hit; (hit = within.find(needle, position)) != std::string_view::npos;) {
        if (hit > position) next.push_back({{position, hit}, kNoToken});
        next.push_back({{hit, hit + needle.size()}, special});
        position = hit + needle.size();
        if (impl.strip_after[static_cast<std::size_t>(special)]) {
          while (position < fragment.range.end && is_ascii_space(text[position])) ++position;
        }
      }
      if (position < fragment.range.end) next.push_back({{position, fragment.range.end}, kNoToken});
    }
    fragments.swap(next);
  }

  std::vector<Token> out;
  out.reserve(text.size() / 3 + 8);
  Workspace work;
  if (impl.spm) {
    // 2-4. Escape and join each text fragment; the start of the text counts as a special token.
    bool after_special = true;
    for (const Fragment& fragment : fragments) {
      if (fragment.token != kNoToken) {
        out.push_back(fragment.token);
        after_special = true;
      } else {
        impl.encode_spm(text.substr(fragment.range.begin, fragment.range.end - fragment.range.begin),
                        v.add_space_prefix && after_special, work, out);
        after_special = false;
      }
    }
    return out;
  }

  // 2-4. Pre-tokenize and merge each text fragment.
  for (const Fragment& fragment : fragments) {
    if (fragment.token != kNoToken) {
      out.push_back(fragment.token);
    } else {
      impl.encode_text(text.substr(fragment.range.begin, fragment.range.end - fragment.range.begin),
                       work, out);
    }
  }
  return out;
}

namespace {

// `text` (not valid UTF-8) as llama.cpp reads it into code points before a byte-level BPE: a
// lead byte 110xxxxx, 1110xxxx or 11110xxx with as many continuation bytes (10xxxxxx) after it
// is one code point, whether or not the form is well-formed; any other byte is U+FFFD. Each
// code point is then written back as UTF-8, so an overlong form becomes its short one and a
// surrogate is written in three bytes. A 4-byte form past U+10FFFF, which llama.cpp cannot write
// back (its tokenizer throws), is U+FFFD for each of its bytes here.
std::string as_llama_reads(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 16);
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const auto continuation = [&](std::size_t i) { return i < text.size() && (byte(i) & 0xC0) == 0x80; };
  for (std::size_t i = 0; i < text.size();) {
    const unsigned char lead = byte(i);
    std::size_t length = 0;
    char32_t cp = 0;
    if (lead < 0x80) {
      length = 1, cp = lead;
    } else if ((lead & 0xE0) == 0xC0) {
      length = 2, cp = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      length = 3, cp = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      length = 4, cp = lead & 0x07;
    }
    bool taken = length > 0;
    for (std::size_t k = 1; taken && k < length; ++k) {
      taken = continuation(i + k);
      if (taken) cp = (cp << 6) | (byte(i + k) & 0x3F);
    }
    if (!taken || cp > 0x10FFFF) {
      out.append(kReplacementCharacter);
      i += 1;
      continue;
    }
    utf8::append(out, cp);  // a surrogate too, as three bytes (whether it came in three or four)
    i += length;
  }
  return out;
}

}  // namespace

void Tokenizer::Impl::encode_text(std::string_view text, Workspace& work, std::vector<Token>& out) const {
  std::string read;
  if (utf8::first_invalid(text) != std::string_view::npos) {
    read = as_llama_reads(text);
    text = read;
  }
  work.pieces.clear();
  pre_tokenizer->split(text, work.pieces, work.split_scratch);
  for (const Range piece : work.pieces) encode_piece(text.substr(piece.begin, piece.end - piece.begin), work, out);
}

void Tokenizer::Impl::encode_piece(std::string_view piece, Workspace& work, std::vector<Token>& out) const {
  // A byte without a token of its own is dropped, as llama.cpp and Hugging Face do. Vocabularies
  // may lack a few: SmolLM2's has no token for 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, nor for the
  // bytes UTF-8 never uses (0xC0, 0xC1, 0xF5..0xFF) and two it rarely does (0xF1, 0xF2). (Its
  // unknown token, <|endoftext|>, would end the document in the middle of the prompt.)
  const auto emit = [&](Token token) {
    if (token >= 0) out.push_back(token);
  };

  if (piece.size() == 1) {
    emit(byte_tokens[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (pre_tokenizer->ignore_merges()) {
    work.byte_level.clear();
    append_byte_level(work.byte_level, piece);
    const auto it = ids.find(work.byte_level);
    if (it != ids.end()) {
      out.push_back(it->second);
      return;
    }
  }

  // One symbol per byte, linked in order.
  std::vector<Symbol>& symbols = work.symbols;
  symbols.resize(piece.size());
  const auto count = static_cast<std::int32_t>(piece.size());
  for (std::int32_t i = 0; i < count; ++i) {
    symbols[i] = {byte_tokens[static_cast<unsigned char>(piece[i])], i - 1, i + 1 < count ? i + 1 : -1};
  }

  std::vector<Candidate>& heap = work.heap;
  heap.clear();
  const auto consider = [&](std::int32_t left, std::int32_t right) {
    if (left < 0 || right < 0) return;
    const Token left_token = symbols[left].token, right_token = symbols[right].token;
    if (left_token < 0 || right_token < 0) return;
    const auto it = merges.find(pair_key(left_token, right_token));
    if (it == merges.end()) return;
    heap.push_back({it->second.rank, left, right, left_token, right_token, it->second.result});
    std::push_heap(heap.begin(), heap.end(), LaterCandidate{});
  };
  for (std::int32_t i = 0; i + 1 < count; ++i) consider(i, i + 1);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), LaterCandidate{});
    const Candidate best = heap.back();
    heap.pop_back();
    Symbol& left = symbols[best.left];
    Symbol& right = symbols[best.right];
    if (left.token != best.left_token || left.next != best.right || right.token != best.right_token) {
      continue;  // stale: one side has merged since this pair was queued
    }
    // The right symbol joins the left one and leaves the list.
    left.token = best.result;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = best.left;
    right.token = kMergedAway;
    consider(left.prev, best.left);
    consider(best.left, left.next);
  }

  // Symbol 0 is never merged away (merges absorb rightwards), so the list starts there.
  for (std::int32_t i = 0; i >= 0; i = symbols[i].next) emit(symbols[i].token);
}

void Tokenizer::Impl::encode_spm(std::string_view text, bool space_prefix, Workspace& work,
                                 std::vector<Token>& out) const {
  // 2. Escape.
  std::string& escaped = work.escaped;
  escaped.clear();
  escaped.reserve(text.size() + 16);
  if (space_prefix) escaped += kSpaceMark;
  for (const char c : text) {
    if (c == ' ') {
      escaped += kSpaceMark;
    } else {
      escaped += c;
    }
  }
  if (escaped.size() > static_cast<std::size_t>(INT32_MAX)) {
    throw std::length_error("tokenizer: a text of " + std::to_string(text.size()) + " bytes is too long");
  }
  const std::string_view s = escaped;

  // 3. One symbol per character, linked in order; then join by score.
  std::vector<SpmSymbol>& symbols = work.spm_symbols;
  symbols.clear();
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t length = std::min(character_length(s[i]), s.size() - i);
    const auto index = static_cast<std::int32_t>(symbols.size());
    symbols.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(length), index - 1,
                       i + length < s.size() ? index + 1 : -1});
    i += length;
  }
  if (symbols.empty()) return;

  std::vector<SpmCandidate>& heap = work.spm_heap;
  heap.clear();
  const auto consider = [&](std::int32_t left, std::int32_t right) {
    if (left < 0 || right < 0) return;
    const std::uint32_t length = symbols[left].length + symbols[right].length;
    const auto it = ids.find(s.substr(symbols[left].begin, length));
    if (it == ids.end()) return;
    heap.push_back({vocab.scores[static_cast<std::size_t>(it->second)], left, right, length});
    std::push_heap(heap.begin(), heap.end(), LowerScore{});
  };
  for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(symbols.size()); ++i) consider(i, i + 1);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), LowerScore{});
    const SpmCandidate best = heap.back();
    heap.pop_back();
    SpmSymbol& left = symbols[best.left];
    SpmSymbol& right = symbols[best.right];
    if (left.length == 0 || right.length == 0 || left.length + right.length != best.length) {
      continue;  // stale: one side has joined another since this pair was queued
    }
    // The right symbol joins the left one and leaves the list.
    left.length = best.length;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = best.left;
    right.length = 0;
    consider(left.prev, best.left);
    consider(best.left, left.next);
  }

  // 4. Lookup with byte fallback. Symbol 0 is never joined away, so the list starts there.
  for (std::int32_t i = 0; i >= 0; i = symbols[i].next) {
    const std::string_view piece = s.substr(symbols[i].begin, symbols[i].length);
    if (const auto it = ids.find(piece); it != ids.end()) {
      out.push_back(it->second);
      continue;
    }
    bool in_unknown_run = false;
    for (const char c : piece) {
      const Token byte_token = byte_tokens[static_cast<unsigned char>(c)];
      if (byte_token != kNoToken) {
        out.push_back(byte_token);
        in_unknown_run = false;
      } else if (!in_unknown_run && vocab.unk >= 0) {
        out.push_back(vocab.unk);
        in_unknown_run = true;
      }
    }
  }
}

std::string Tokenizer::token_bytes(Token t, bool render_special) const {
  if (t < 0 || static_cast<std::size_t>(t) >= impl_->pieces.size()) {
    throw std::out_of_range("tokenizer: token id " + std::to_string(t) + " is outside the vocabulary of " +
                            std::to_string(impl_->pieces.size()));
  }
  const TokenType type = impl_->vocab.types[static_cast<std::size_t>(t)];
  if (!render_special && (type == TokenType::Control || type == TokenType::Unknown)) return {};
  return impl_->pieces[static_cast<std::size_t>(t)];
}

std::string_view Tokenizer::token_view(Token t) const {
  if (t < 0 || static_cast<std::size_t>(t) >= impl_->pieces.size()) {
    throw std::out_of_range("tokenizer: token id " + std::to_string(t) + " is outside the vocabulary of " +
                            std::to_string(impl_->pieces.size()));
  }
  const TokenType type = impl_->vocab.types[static_cast<std::size_t>(t)];
  if (type == TokenType::Control || type == TokenType::Unknown) return {};
  return impl_->pieces[static_cast<std::size_t>(t)];
}

std::string Tokenizer::decode(std::span<const Token> tokens, bool render_special) const {
  std::string out;
  for (const Token t : tokens) out += token_bytes(t, render_special);
  return out;
}

std::size_t Tokenizer::size() const { return impl_->vocab.tokens.size(); }
const Vocab& Tokenizer::vocab() const { return impl_->vocab; }
bool Tokenizer::add_bos() const { return impl_->vocab.add_bos; }

bool Tokenizer::is_end_of_generation(Token t) const {
  return t >= 0 && static_cast<std::size_t>(t) < impl_->end_of_generation.size() &&
         impl_->end_of_generation[static_cast<std::size_t>(t)];
}

std::vector<Token> Tokenizer::end_of_generation_tokens() const {
  std::vector<Token> out;
  for (std::size_t id = 0; id < impl_->end_of_generation.size(); ++id)
    if (impl_->end_of_generation[id]) out.push_back(static_cast<Token>(id));
  return out;
}

Token Tokenizer::find(std::string_view text) const {
  const auto it = impl_->ids.find(text);
  return it == impl_->ids.end() ? -1 : it->second;
}

// --- StreamDecoder ------------------------------------------------------------------------------

namespace {

// Moves the text that is ready out of `pending`: every complete character, and U+FFFD for each
// invalid sequence. A valid start of a character that the buffer's end cuts off stays behind,
// unless `at_end`, when it is invalid too.
std::string take_ready_text(std::string& pending, bool at_end) {
  std::string out;
  out.reserve(pending.size());
  std::size_t i = 0;
  while (i < pending.size()) {
    const utf8::Sequence seq = utf8::classify(pending, i);
    if (seq.status == utf8::Status::Complete) {
      out.append(pending, i, seq.length);
    } else if (seq.status == utf8::Status::Truncated && !at_end) {
      break;
    } else {
      out += kReplacementCharacter;
    }
    i += seq.length;
  }
  pending.erase(0, i);
  return out;
}

}  // namespace

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool render_special)
    : tokenizer_(&tokenizer), render_special_(render_special) {}

std::string StreamDecoder::push(Token t) {
  pending_ += tokenizer_->token_bytes(t, render_special_);
  return take_ready_text(pending_, /*at_end=*/false);
}

std::string StreamDecoder::finish() { return take_ready_text(pending_, /*at_end=*/true); }

}  // namespace batchlm::local_engine
