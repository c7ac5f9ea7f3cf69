#include "batchlm/local_engine/tokenizer.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "gguf_writer.hpp"

namespace batchlm::local_engine {
namespace {

// --- A hand-built vocabulary ---------------------------------------------------------------------

// GPT-2's byte -> character table, written out independently of the tokenizer's: printable
// Latin-1 bytes stand for themselves, the other 68 move to U+0100.. in byte order.
std::string byte_char(unsigned char b) {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    int moved = 0;
    for (int byte = 0; byte < 256; ++byte) {
      const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
      const unsigned cp = printable ? static_cast<unsigned>(byte) : 0x100u + static_cast<unsigned>(moved++);
      std::string utf8;
      if (cp < 0x80) {
        utf8 += static_cast<char>(cp);
      } else {
        utf8 += static_cast<char>(0xC0 | (cp >> 6));
        utf8 += static_cast<char>(0x80 | (cp & 0x3F));
      }
      t[static_cast<std::size_t>(byte)] = utf8;
    }
    return t;
  }();
  return table[b];
}

// The vocabulary form of raw bytes, e.g. " he" -> "Ġhe".
std::string byte_level(std::string_view bytes) {
  std::string out;
  for (const char c : bytes) out += byte_char(static_cast<unsigned char>(c));
  return out;
}

constexpr Token kEndOfText = 0, kImStart = 1, kImEnd = 2, kImStartSystem = 3, kUserTool = 4;
constexpr Token kFirstByte = 5;  // ids 5..260 are the 256 byte tokens, in byte order

Token byte_id(unsigned char b) { return kFirstByte + b; }

// Specials, all 256 bytes, then one token per merge. The merge ranks are chosen to test:
//   "b c" before "a b" (rank decides, not position); "a a" (leftmost on ties);
//   "l l", "h e", "he ll", "hell o" (merging goes on until no pair has a rank);
//   "Ġ Ġ", "Ġ w" (whitespace before a word stays a piece of its own);
//   "1 2", "3 4" (merges across digits, which the smollm pre-tokenizer keeps apart).
Vocab toy_vocab(std::string pre = "gpt2") {
  Vocab vocab;
  vocab.model = "gpt2";
  vocab.pre = std::move(pre);
  vocab.tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_start|>system", "<tool>"};
  vocab.types = {TokenType::Control, TokenType::Control, TokenType::Control, TokenType::Control,
                 TokenType::UserDefined};
  for (int b = 0; b < 256; ++b) {
    vocab.tokens.push_back(byte_char(static_cast<unsigned char>(b)));
    vocab.types.push_back(TokenType::Normal);
  }
  vocab.merges = {"b c", "a b", "a a", "l l", "h e", "he ll", "hell o", "Ġ Ġ", "Ġ w", "1 2", "3 4"};
  for (const std::string& merge : vocab.merges) {
    const auto space = merge.find(' ');
    vocab.tokens.push_back(merge.substr(0, space) + merge.substr(space + 1));
    vocab.types.push_back(TokenType::Normal);
  }
  vocab.bos = kEndOfText;
  vocab.eos = kImEnd;
  return vocab;
}

class ToyTokenizer : public ::testing::Test {
 protected:
  Tokenizer tokenizer{toy_vocab()};

  Token id(std::string_view bytes) const {
    const Token t = tokenizer.find(byte_level(bytes));
    EXPECT_GE(t, 0) << "no token for '" << bytes << "'";
    return t;
  }
};

// --- BPE ----------------------------------------------------------------------------------------

TEST_F(ToyTokenizer, MergesTheLowestRankFirstWhereverItIs) {
  // "a b" is the leftmost pair but "b c" has the lower rank.
  EXPECT_EQ(tokenizer.encode("abc", false), (std::vector<Token>{id("a"), id("bc")}));
}

TEST_F(ToyTokenizer, MergesTheLeftmostPairOnEqualRanks) {
  EXPECT_EQ(tokenizer.encode("aaa", false), (std::vector<Token>{id("aa"), id("a")}));
  EXPECT_EQ(tokenizer.encode("aaaa", false), (std::vector<Token>{id("aa"), id("aa")}));
}

TEST_F(ToyTokenizer, MergesUntilNoAdjacentPairHasARank) {
  EXPECT_EQ(tokenizer.encode("hello", false), (std::vector<Token>{id("hello")}));
  EXPECT_EQ(tokenizer.encode("hell", false), (std::vector<Token>{id("hell")}));
  // "x" has no merge, so "hello" forms next to it but never joins it.
  EXPECT_EQ(tokenizer.encode("helloxhello", false),
            (std::vector<Token>{id("hello"), id("x"), id("hello")}));
}

TEST_F(ToyTokenizer, NeverMergesAcrossPreTokenizerPieces) {
  // GPT-2's pattern: "a", " " (whitespace keeps its last character for the word), " w".
  EXPECT_EQ(tokenizer.encode("a  w", false), (std::vector<Token>{id("a"), id(" "), id(" w")}));
  // Trailing whitespace is one piece.
  EXPECT_EQ(tokenizer.encode("a  ", false), (std::vector<Token>{id("a"), id("  ")}));
  // A letter run is one piece, so "b c" applies inside it; the space goes with the next word.
  EXPECT_EQ(tokenizer.encode("abc abc", false),
            (std::vector<Token>{id("a"), id("bc"), id(" "), id("a"), id("bc")}));
}

TEST(Tokenizer, SmolLMPreTokenizerSplitsEveryDigit) {
  const Tokenizer gpt2(toy_vocab("gpt2"));
  const Tokenizer smollm(toy_vocab("smollm"));
  const Token one = gpt2.find("1"), two = gpt2.find("2"), twelve = gpt2.find("12");
  EXPECT_EQ(gpt2.encode("12", false), (std::vector<Token>{twelve}));
  EXPECT_EQ(smollm.encode("12", false), (std::vector<Token>{one, two}));
}

TEST(Tokenizer, Llama3AndDefaultPreTokenizersGroupDigitsByThree) {
  const Tokenizer gpt2(toy_vocab("gpt2"));
  const Token one = gpt2.find("1"), twelve = gpt2.find("12"), three = gpt2.find("3"),
              four = gpt2.find("4"), five = gpt2.find("5"), thirty_four = gpt2.find("34");
  // GPT-2 keeps "12345" whole, so "3 4" can merge; the others cut it into "123" and "45".
  EXPECT_EQ(gpt2.encode("12345", false), (std::vector<Token>{twelve, thirty_four, five}));
  for (const char* pre : {"llama3", "llama-bpe", "default"}) {
    const Tokenizer tokenizer(toy_vocab(pre));
    EXPECT_EQ(tokenizer.encode("12345", false), (std::vector<Token>{twelve, three, four, five})) << pre;
    EXPECT_EQ(tokenizer.encode("1", false), (std::vector<Token>{one})) << pre;
  }
}

TEST(Tokenizer, Qwen2PreTokenizerSplitsEveryDigit) {
  const Tokenizer gpt2(toy_vocab("gpt2"));
  const Token one = gpt2.find("1"), two = gpt2.find("2"), three = gpt2.find("3"), four = gpt2.find("4"),
              five = gpt2.find("5"), space = gpt2.find("Ġ"), a = gpt2.find("a");
  for (const char* pre : {"qwen2", "deepseek-r1-qwen"}) {
    const Tokenizer qwen2(toy_vocab(pre));
    // Neither "1 2" nor "3 4" can merge: every digit is a piece of its own.
    EXPECT_EQ(qwen2.encode("12345", false), (std::vector<Token>{one, two, three, four, five})) << pre;
    // A space before a number is a piece of its own too; letters never take digits along.
    EXPECT_EQ(qwen2.encode("a 12a", false), (std::vector<Token>{a, space, one, two, a})) << pre;
  }
}

TEST(Tokenizer, TekkenSplitsEveryDigitAndGpt4oGroupsThem) {
  const Tokenizer gpt2(toy_vocab("gpt2"));
  const Token one = gpt2.find("1"), two = gpt2.find("2"), twelve = gpt2.find("12"), three = gpt2.find("3"),
              four = gpt2.find("4"), five = gpt2.find("5");
  EXPECT_EQ(Tokenizer(toy_vocab("tekken")).encode("12345", false), (std::vector<Token>{one, two, three, four, five}));
  // "123" and "45": "3 4" cannot merge.
  EXPECT_EQ(Tokenizer(toy_vocab("gpt-4o")).encode("12345", false), (std::vector<Token>{twelve, three, four, five}));
}

TEST(Tokenizer, OnlyLlama3AndTekkenTakeAPieceThatIsATokenWhole) {
  // "abc" is a token, but the merges make "a" + "bc" of it: "b c" ranks first, and no merge
  // joins "a" and "bc". Llama 3 and Tekken look the piece up first (llama.cpp's ignore_merges);
  // Qwen2, GPT-2 and GPT-4o do not.
  const auto with_abc = [](std::string pre) {
    Vocab vocab = toy_vocab(std::move(pre));
    vocab.tokens.push_back("abc");
    vocab.types.push_back(TokenType::Normal);
    return vocab;
  };
  const Tokenizer llama3(with_abc("llama-bpe"));
  const Token abc = llama3.find("abc"), a = llama3.find("a"), bc = llama3.find("bc");
  EXPECT_EQ(llama3.encode("abc", false), (std::vector<Token>{abc}));
  EXPECT_EQ(Tokenizer(with_abc("tekken")).encode("abc", false), (std::vector<Token>{abc}));
  for (const char* pre : {"qwen2", "gpt2", "gpt-4o"}) {
    EXPECT_EQ(Tokenizer(with_abc(pre)).encode("abc", false), (std::vector<Token>{a, bc})) << pre;
  }
}

// Every byte has its token; a byte that is no character alone (0x80 and up) is read as U+FFFD,
// as llama.cpp reads it.
TEST_F(ToyTokenizer, EncodesEveryByteAsItsByteToken) {
  const std::vector<Token> replacement = tokenizer.encode("\xEF\xBF\xBD", false);
  for (int b = 0; b < 256; ++b) {
    const std::string text(1, static_cast<char>(b));
    EXPECT_EQ(tokenizer.encode(text, false),
              b < 0x80 ? std::vector<Token>{byte_id(static_cast<unsigned char>(b))} : replacement)
        << "byte " << b;
    EXPECT_EQ(tokenizer.token_bytes(byte_id(static_cast<unsigned char>(b))), text) << "byte " << b;
  }
  std::string ascii;
  for (int b = 0; b < 128; ++b) ascii += static_cast<char>(b);
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(ascii, false)), ascii);
}

// Text that is not valid UTF-8 is read as llama.cpp's decoder reads it: a byte it does not take
// is U+FFFD; a lead byte with its continuation bytes is one code point even where the standard
// forbids the form (overlong: written back short; a surrogate: kept); a form past U+10FFFF is
// U+FFFD per byte. The bytes 0xF8-0xFF, which many vocabularies have no token for, are not lost.
TEST_F(ToyTokenizer, InvalidUtf8IsReadAsLlamaCppReadsIt) {
  const auto same = [&](const std::string& text, const std::string& as) {
    EXPECT_EQ(tokenizer.encode(text, false), tokenizer.encode(as, false)) << ::testing::PrintToString(text);
  };
  const std::string fffd = "\xEF\xBF\xBD";
  same("a\xFF", "a" + fffd);
  same("\xF8\xFE\xFF", fffd + fffd + fffd);
  same("ab\x80\x80" "cd", "ab" + fffd + fffd + "cd");
  same("\xE2\x82", fffd + fffd);                    // cut short: the lead and the continuation
  same("\xE2\x82x", fffd + fffd + "x");
  same("x\xC0\x80y", std::string("x\0y", 3));      // overlong NUL
  same("\xC1\xBF", "\x7F");                        // overlong DEL
  same("\xE0\x81\x81", "A");                       // overlong, three bytes
  same("\xF0\x80\x80\xA9", ")");                   // overlong, four bytes
  same("\xF4\x90\x80\x80!", fffd + fffd + fffd + fffd + "!");  // past U+10FFFF
  same("\xF7\xBF\xBF\xBF", fffd + fffd + fffd + fffd);
  // A surrogate keeps its bytes: decoding gives them back; written overlong in four bytes, it is
  // written back in three.
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xED\xA0\x80 s", false)), "\xED\xA0\x80 s");
  same("\xF0\x8D\xA0\x80", "\xED\xA0\x80");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("a\xFF", false)), "a" + fffd);
}

// Valid UTF-8 comes back byte for byte; any bytes come back as llama.cpp reads them (a string
// of random bytes decodes to valid UTF-8, surrogates apart).
TEST_F(ToyTokenizer, RoundTripsValidText) {
  std::vector<std::string> texts = {
      "", "hello world", "  leading", "trailing  ", "\n\n\t \r\n", "日本語 テキスト", "😀👍🏽🇫🇷",
      "café naïve", "x = f(1, 2) + 3.14;\n", "<|im_start|>user\nhi<|im_end|>", "<tool>x</tool>",
  };
  for (const std::string& text : texts) {
    for (const bool parse_special : {false, true}) {
      const std::vector<Token> tokens = tokenizer.encode(text, parse_special);
      EXPECT_EQ(tokenizer.decode(tokens, /*render_special=*/true), text) << "parse_special " << parse_special;
    }
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 300; ++i) {
    std::string random(rng() % 40, '\0');
    for (char& c : random) c = static_cast<char>(rng() % 256);
    const std::string back = tokenizer.decode(tokenizer.encode(random, false));
    EXPECT_FALSE(back.empty() && !random.empty()) << ::testing::PrintToString(random);
    // Decoding the tokens again and encoding that gives the same tokens: the reading is stable.
    EXPECT_EQ(tokenizer.encode(back, false), tokenizer.encode(random, false)) << ::testing::PrintToString(random);
  }
}

// --- Special tokens -----------------------------------------------------------------------------

TEST_F(ToyTokenizer, ParseSpecialTurnsControlTextIntoItsToken) {
  const std::vector<Token> tokens = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", true);
  ASSERT_GE(tokens.size(), 3u);
  EXPECT_EQ(tokens.front(), kImStart);
  EXPECT_EQ(tokens.back(), kImEnd);
  EXPECT_EQ(std::count(tokens.begin(), tokens.end(), kImStart), 1);
  const std::vector<Token> middle(tokens.begin() + 1, tokens.end() - 1);
  EXPECT_EQ(middle, tokenizer.encode("user\nhi", true));
}

TEST_F(ToyTokenizer, WithoutParseSpecialControlTextIsPlainText) {
  const std::vector<Token> tokens = tokenizer.encode("<|im_start|>user", false);
  for (const Token t : tokens) EXPECT_GE(t, kFirstByte);
  EXPECT_EQ(tokenizer.decode(tokens), "<|im_start|>user");
}

TEST_F(ToyTokenizer, LongerSpecialTextWins) {
  EXPECT_EQ(tokenizer.encode("<|im_start|>system", true), (std::vector<Token>{kImStartSystem}));
  EXPECT_EQ(tokenizer.encode("<|im_start|>sys", true).front(), kImStart);
}

TEST_F(ToyTokenizer, AdjacentAndRepeatedSpecialTokens) {
  EXPECT_EQ(tokenizer.encode("<|im_end|><|im_start|><|im_end|>", true),
            (std::vector<Token>{kImEnd, kImStart, kImEnd}));
  EXPECT_EQ(tokenizer.encode("a<|im_end|>a", true), (std::vector<Token>{id("a"), kImEnd, id("a")}));
}

TEST_F(ToyTokenizer, UserDefinedTokensAreMatchedEvenWithoutParseSpecial) {
  // As in llama.cpp and Hugging Face: added (user-defined) tokens are always split out.
  EXPECT_EQ(tokenizer.encode("a<tool>a", false), (std::vector<Token>{id("a"), kUserTool, id("a")}));
}

TEST_F(ToyTokenizer, ControlTokensRenderOnlyWhenAsked) {
  EXPECT_EQ(tokenizer.token_bytes(kImStart), "");
  EXPECT_EQ(tokenizer.token_bytes(kImStart, /*render_special=*/true), "<|im_start|>");
  EXPECT_EQ(tokenizer.token_bytes(kUserTool), "<tool>");
  const std::vector<Token> tokens = tokenizer.encode("<|im_start|>hi<|im_end|>", true);
  EXPECT_EQ(tokenizer.decode(tokens), "hi");
  EXPECT_EQ(tokenizer.decode(tokens, true), "<|im_start|>hi<|im_end|>");
  EXPECT_THROW((void)tokenizer.token_bytes(-1), std::out_of_range);
  EXPECT_THROW((void)tokenizer.token_bytes(static_cast<Token>(tokenizer.size())), std::out_of_range);
}

TEST_F(ToyTokenizer, FindsTokensAndEndsOfGeneration) {
  EXPECT_EQ(tokenizer.find("<|im_end|>"), kImEnd);
  EXPECT_EQ(tokenizer.find("Ġw"), id(" w"));
  EXPECT_EQ(tokenizer.find("no such token"), -1);
  EXPECT_TRUE(tokenizer.is_end_of_generation(kImEnd));      // eos
  EXPECT_TRUE(tokenizer.is_end_of_generation(kEndOfText));  // an end-of-text marker
  EXPECT_FALSE(tokenizer.is_end_of_generation(kImStart));
  EXPECT_FALSE(tokenizer.is_end_of_generation(id("a")));
  EXPECT_FALSE(tokenizer.is_end_of_generation(-1));
}

TEST(Tokenizer, EncodesConcurrentlyFromManyThreads) {
  const Tokenizer tokenizer(toy_vocab("smollm"));
  const std::string text = "hello world 123 <|im_start|>abc aaa\n";
  const std::vector<Token> expected = tokenizer.encode(text, true);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) mismatches[static_cast<std::size_t>(t)] += tokenizer.encode(text, true) != expected;
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches, (std::vector<int>{0, 0, 0, 0}));
}

// --- Validation ---------------------------------------------------------------------------------

template <typename F>
std::string invalid_argument_message(F&& make) {
  try {
    make();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument)";
}

TEST(Tokenizer, RejectsAnUnknownPreTokenizerByName) {
  const std::string message = invalid_argument_message([] { Tokenizer t(toy_vocab("qwen9")); });
  EXPECT_NE(message.find("unsupported pre-tokenizer 'qwen9'"), std::string::npos) << message;
  // The message lists the names this build knows, and each of them loads.
  const std::string known = "smollm, starcoder, refact, gpt2, gpt-2, default, llama3, llama-v3, llama-bpe, qwen2, "
                            "deepseek-r1-qwen, tekken, gpt-4o, llama4, kanana2, talkie, minimax-m2";
  EXPECT_NE(message.find("(tokenizer.ggml.pre; known: " + known + ")"), std::string::npos) << message;
  for (std::size_t begin = 0; begin < known.size();) {
    const std::size_t end = std::min(known.find(", ", begin), known.size());
    const std::string name = known.substr(begin, end - begin);
    EXPECT_NO_THROW(Tokenizer{toy_vocab(name)}) << name;
    begin = end + 2;
  }
}

TEST(Tokenizer, RejectsAModelOtherThanByteLevelBpeOrSentencePiece) {
  Vocab vocab = toy_vocab();
  vocab.model = "bert";
  EXPECT_NE(invalid_argument_message([&] { Tokenizer t(vocab); }).find("'bert'"), std::string::npos);
}

TEST(Tokenizer, RejectsAMergeOfUnknownTokens) {
  Vocab vocab = toy_vocab();
  vocab.merges.push_back("q zz");
  EXPECT_NE(invalid_argument_message([&] { Tokenizer t(vocab); }).find("'zz'"), std::string::npos);
  vocab.merges.back() = "nospace";
  EXPECT_NE(invalid_argument_message([&] { Tokenizer t(vocab); }).find("nospace"), std::string::npos);
}

TEST(Tokenizer, RejectsMismatchedTypesAndSpecialIds) {
  Vocab vocab = toy_vocab();
  vocab.types.pop_back();
  EXPECT_THROW(Tokenizer{vocab}, std::invalid_argument);
  vocab = toy_vocab();
  vocab.eos = static_cast<Token>(vocab.tokens.size());
  EXPECT_NE(invalid_argument_message([&] { Tokenizer t(vocab); }).find("eos"), std::string::npos);
  vocab = toy_vocab();
  vocab.tokens.push_back("a");
  vocab.types.push_back(TokenType::Normal);
  EXPECT_NE(invalid_argument_message([&] { Tokenizer t(vocab); }).find("twice"), std::string::npos);
}

// --- StreamDecoder --------------------------------------------------------------------------------

TEST_F(ToyTokenizer, StreamDecoderHoldsBackAnEmojiUntilItsLastByte) {
  StreamDecoder decoder(tokenizer);
  const std::string emoji = "\xF0\x9F\x98\x80";  // U+1F600
  EXPECT_EQ(decoder.push(id("a")), "a");
  EXPECT_EQ(decoder.push(byte_id(0xF0)), "");
  EXPECT_EQ(decoder.push(byte_id(0x9F)), "");
  EXPECT_EQ(decoder.push(byte_id(0x98)), "");
  EXPECT_EQ(decoder.push(byte_id(0x80)), emoji);
  EXPECT_EQ(decoder.finish(), "");
}

TEST_F(ToyTokenizer, StreamDecoderJoinsSplitCharactersOfAnyLength) {
  const std::string text = "é€😀a日";
  StreamDecoder decoder(tokenizer);
  std::string streamed;
  for (const char c : text) {
    const std::string chunk = decoder.push(byte_id(static_cast<unsigned char>(c)));
    // Each chunk is whole characters: it never ends inside one.
    if (!chunk.empty()) {
      EXPECT_NE(static_cast<unsigned char>(chunk.back()) & 0xC0, 0xC0u);
    }
    streamed += chunk;
  }
  streamed += decoder.finish();
  EXPECT_EQ(streamed, text);
}

TEST_F(ToyTokenizer, StreamDecoderReplacesInvalidBytes) {
  StreamDecoder decoder(tokenizer);
  // 0xFF can never start a character: replaced at once.
  EXPECT_EQ(decoder.push(byte_id(0xFF)), "\xEF\xBF\xBD");
  // A started character that the next byte breaks: one U+FFFD, then the byte.
  EXPECT_EQ(decoder.push(byte_id(0xE2)), "");
  EXPECT_EQ(decoder.push(id("a")), "\xEF\xBF\xBD" "a");
  // One left unfinished at the end: finish() replaces it.
  EXPECT_EQ(decoder.push(byte_id(0xE2)), "");
  EXPECT_EQ(decoder.push(byte_id(0x82)), "");
  EXPECT_EQ(decoder.finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(decoder.finish(), "");
}

TEST_F(ToyTokenizer, StreamDecoderRendersControlTokensOnlyWhenAsked) {
  StreamDecoder plain(tokenizer);
  EXPECT_EQ(plain.push(kImEnd), "");
  StreamDecoder rendered(tokenizer, /*render_special=*/true);
  EXPECT_EQ(rendered.push(kImEnd), "<|im_end|>");
}

// --- SentencePiece ("llama") ----------------------------------------------------------------------

constexpr Token kSpmUnk = 0, kSpmBos = 1, kSpmEos = 2, kSpmTool = 3, kSpmEnd = 4, kSpmEndOfText = 5;
constexpr Token kSpmFirstByte = 6;  // with byte tokens: ids 6..261 are <0x00>..<0xFF>

Token spm_byte_id(unsigned char b) { return kSpmFirstByte + b; }

// <unk>; <s>; </s>, user-defined as in Phi-3's file (llama.cpp, and so the tokenizer, takes it
// for a control token); <tool>, user-defined; <|end|> and <|endoftext|>, control; the 256 byte
// tokens (or not); then normal tokens whose scores are chosen to test:
//   "bc" above "ab" (the score decides, not the position); "aa" (the leftmost on ties);
//   "hi", then "▁hi" (joining goes on while a joined text is a token); "▁▁" (runs of spaces);
//   no "▁a" nor "é", so those stay apart or fall back to bytes.
Vocab toy_spm_vocab(bool byte_tokens = true) {
  Vocab vocab;
  vocab.model = "llama";
  vocab.add_space_prefix = true;
  vocab.add_bos = true;
  vocab.tokens = {"<unk>", "<s>", "</s>", "<tool>", "<|end|>", "<|endoftext|>"};
  vocab.types = {TokenType::Unknown, TokenType::Control, TokenType::UserDefined,
                 TokenType::UserDefined, TokenType::Control, TokenType::Control};
  vocab.scores.assign(vocab.tokens.size(), 0.0f);
  if (byte_tokens) {
    constexpr std::string_view kHex = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      vocab.tokens.push_back(std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">");
      vocab.types.push_back(TokenType::Byte);
      vocab.scores.push_back(0.0f);
    }
  }
  const std::vector<std::pair<std::string, float>> normal = {
      {"\u2581", -1000}, {"a", -1000}, {"b", -1000}, {"c", -1000}, {"h", -1000}, {"i", -1000},
      {"ab", -5}, {"bc", -1}, {"aa", -2}, {"hi", -3}, {"\u2581hi", -4}, {"\u2581\u2581", -50}};
  for (const auto& [text, score] : normal) {
    vocab.tokens.push_back(text);
    vocab.types.push_back(TokenType::Normal);
    vocab.scores.push_back(score);
  }
  vocab.bos = kSpmBos;
  vocab.eos = kSpmEos;
  vocab.unk = kSpmUnk;
  return vocab;
}

Vocab without_space_prefix(Vocab vocab) {
  vocab.add_space_prefix = false;
  return vocab;
}

class ToySpmTokenizer : public ::testing::Test {
 protected:
  Tokenizer tokenizer{toy_spm_vocab()};
  Tokenizer unprefixed{without_space_prefix(toy_spm_vocab())};

  // The id of a token given by its text, with "_" standing for "▁".
  Token id(std::string_view text) const {
    std::string escaped;
    for (const char c : text) {
      if (c == '_') {
        escaped += "\u2581";
      } else {
        escaped += c;
      }
    }
    const Token t = tokenizer.find(escaped);
    EXPECT_GE(t, 0) << "no token '" << escaped << "'";
    return t;
  }
};

TEST_F(ToySpmTokenizer, JoinsTheHighestScoreFirstWhereverItIs) {
  // "ab" is the leftmost pair but "bc" scores higher.
  EXPECT_EQ(unprefixed.encode("abc", false), (std::vector<Token>{id("a"), id("bc")}));
  EXPECT_EQ(tokenizer.encode("abc", false), (std::vector<Token>{id("_"), id("a"), id("bc")}));
}

TEST_F(ToySpmTokenizer, JoinsTheLeftmostPairOnEqualScores) {
  EXPECT_EQ(unprefixed.encode("aaa", false), (std::vector<Token>{id("aa"), id("a")}));
  EXPECT_EQ(unprefixed.encode("aaaa", false), (std::vector<Token>{id("aa"), id("aa")}));
  EXPECT_EQ(unprefixed.encode("aaaaa", false), (std::vector<Token>{id("aa"), id("aa"), id("a")}));
}

TEST_F(ToySpmTokenizer, EscapesSpacesAndAddsTheSpacePrefix) {
  EXPECT_EQ(tokenizer.encode("hi", false), (std::vector<Token>{id("_hi")}));
  EXPECT_EQ(tokenizer.encode("hi hi", false), (std::vector<Token>{id("_hi"), id("_hi")}));
  // "▁▁hi": "hi" joins first (-3), then "▁hi" (-4) beats "▁▁" (-50).
  EXPECT_EQ(tokenizer.encode(" hi", false), (std::vector<Token>{id("_"), id("_hi")}));
  EXPECT_EQ(unprefixed.encode("hi", false), (std::vector<Token>{id("hi")}));
  EXPECT_EQ(unprefixed.encode("hi hi", false), (std::vector<Token>{id("hi"), id("_hi")}));
  // The pieces give the spaces back, the prefix included.
  EXPECT_EQ(tokenizer.token_bytes(id("_hi")), " hi");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("hi hi", false)), " hi hi");
  EXPECT_EQ(unprefixed.decode(unprefixed.encode("hi hi", false)), "hi hi");
}

TEST_F(ToySpmTokenizer, EmptyTextAndOnlySpaces) {
  EXPECT_EQ(tokenizer.encode("", false), (std::vector<Token>{}));
  EXPECT_EQ(tokenizer.encode("", true), (std::vector<Token>{}));
  // "▁▁▁▁": the leftmost "▁▁" first, then the next.
  EXPECT_EQ(tokenizer.encode("   ", false), (std::vector<Token>{id("__"), id("__")}));
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("   ", false)), "    ");
  EXPECT_EQ(unprefixed.encode("   ", false), (std::vector<Token>{id("__"), id("_")}));
  EXPECT_EQ(tokenizer.encode(" ", false), (std::vector<Token>{id("__")}));
}

TEST_F(ToySpmTokenizer, FallsBackToByteTokens) {
  // No "é": its two bytes. A tab: its byte.
  EXPECT_EQ(tokenizer.encode("\xC3\xA9", false), (std::vector<Token>{id("_"), spm_byte_id(0xC3), spm_byte_id(0xA9)}));
  EXPECT_EQ(tokenizer.encode("hi\t", false), (std::vector<Token>{id("_hi"), spm_byte_id('\t')}));
  for (int b = 0; b < 256; ++b) {
    EXPECT_EQ(tokenizer.token_bytes(spm_byte_id(static_cast<unsigned char>(b))), std::string(1, static_cast<char>(b)));
  }
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("h\xC3\xA9\t", false)), " h\xC3\xA9\t");
  // A stream holds the first byte of "é" back until the second.
  StreamDecoder decoder(tokenizer);
  EXPECT_EQ(decoder.push(id("_")), " ");
  EXPECT_EQ(decoder.push(spm_byte_id(0xC3)), "");
  EXPECT_EQ(decoder.push(spm_byte_id(0xA9)), "\xC3\xA9");
  EXPECT_EQ(decoder.finish(), "");
}

TEST(SpmTokenizer, UnknownWhereThereIsNoByteToken) {
  const Tokenizer tokenizer(toy_spm_vocab(/*byte_tokens=*/false));
  const Token space = tokenizer.find("\u2581");
  // One <unk> for each character without a token, an invalid lead byte with the bytes it takes
  // along counting as one.
  EXPECT_EQ(tokenizer.encode("\xC3\xA9", false), (std::vector<Token>{space, kSpmUnk}));
  EXPECT_EQ(tokenizer.encode("\xC3\xA9\xC3\xA9", false), (std::vector<Token>{space, kSpmUnk, kSpmUnk}));
  EXPECT_EQ(tokenizer.encode("\xFF\xFF", false), (std::vector<Token>{space, kSpmUnk}));
  EXPECT_EQ(tokenizer.encode("\xFF\xFF\xFF\xFF\xFF", false), (std::vector<Token>{space, kSpmUnk, kSpmUnk}));
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xC3\xA9", false)), " ");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xC3\xA9", false), /*render_special=*/true), " <unk>");

  // Without a byte token, the token whose text is the byte itself, as llama.cpp falls back: "a"
  // here, which 0xFF took along.
  EXPECT_EQ(tokenizer.encode("\xFF" "a", false), (std::vector<Token>{space, kSpmUnk, tokenizer.find("a")}));
  Vocab with_byte_text = toy_spm_vocab(false);
  with_byte_text.tokens.push_back("\xC3");
  with_byte_text.types.push_back(TokenType::Normal);
  with_byte_text.scores.push_back(-1000);
  const Tokenizer byte_text(with_byte_text);
  EXPECT_EQ(byte_text.encode("\xC3\xA9", false),
            (std::vector<Token>{space, static_cast<Token>(with_byte_text.tokens.size() - 1), kSpmUnk}));

  // Without an unknown token either, the bytes are dropped (llama.cpp throws).
  Vocab no_unk = toy_spm_vocab(false);
  no_unk.unk = -1;
  EXPECT_EQ(Tokenizer(no_unk).encode("hi\xC3\xA9", false), (std::vector<Token>{tokenizer.find("\u2581hi")}));
}

TEST_F(ToySpmTokenizer, SpecialTokensAndTheSpacePrefixAfterThem) {
  // With parse_special, control text is its token, and the text after a special token gets the
  // space prefix as the start of the text does.
  EXPECT_EQ(tokenizer.encode("<s>hi", true), (std::vector<Token>{kSpmBos, id("_hi")}));
  EXPECT_EQ(tokenizer.encode("hi<|end|>hi", true), (std::vector<Token>{id("_hi"), kSpmEnd, id("_hi")}));
  EXPECT_EQ(tokenizer.encode("<s> hi", true), (std::vector<Token>{kSpmBos, id("_"), id("_hi")}));
  EXPECT_EQ(tokenizer.encode("<s><|end|>", true), (std::vector<Token>{kSpmBos, kSpmEnd}));
  EXPECT_EQ(unprefixed.encode("<s>hi", true), (std::vector<Token>{kSpmBos, unprefixed.find("hi")}));
  // Without it, control text is plain text.
  const std::vector<Token> plain = tokenizer.encode("<s>hi", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), kSpmBos), 0);
  EXPECT_EQ(tokenizer.decode(plain), " <s>hi");
  // User-defined tokens are cut out either way.
  EXPECT_EQ(tokenizer.encode("hi<tool>hi", false), (std::vector<Token>{id("_hi"), kSpmTool, id("_hi")}));
  EXPECT_EQ(tokenizer.encode("<tool>", false), (std::vector<Token>{kSpmTool}));
  // Control tokens render only when asked; user-defined ones always.
  EXPECT_EQ(tokenizer.token_bytes(kSpmBos), "");
  EXPECT_EQ(tokenizer.token_bytes(kSpmBos, /*render_special=*/true), "<s>");
  EXPECT_EQ(tokenizer.token_bytes(kSpmTool), "<tool>");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("<s>hi<|end|>", true)), " hi");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("<s>hi<|end|>", true), true), "<s> hi<|end|>");
}

TEST_F(ToySpmTokenizer, ControlLookingTextsAreControlTokens) {
  // "</s>" is user-defined in this vocabulary, as in Phi-3's; like llama.cpp, the tokenizer
  // takes it for a control token that ends generation.
  EXPECT_EQ(tokenizer.vocab().types[kSpmEos], TokenType::Control);
  EXPECT_EQ(tokenizer.encode("hi</s>", true), (std::vector<Token>{id("_hi"), kSpmEos}));
  const std::vector<Token> plain = tokenizer.encode("hi</s>", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), kSpmEos), 0);
  EXPECT_EQ(tokenizer.token_bytes(kSpmEos), "");
  EXPECT_TRUE(tokenizer.is_end_of_generation(kSpmEos));
  EXPECT_TRUE(tokenizer.is_end_of_generation(kSpmEndOfText));
  EXPECT_FALSE(tokenizer.is_end_of_generation(kSpmBos));
  EXPECT_FALSE(tokenizer.is_end_of_generation(kSpmTool));
}

TEST(SpmTokenizer, Phi3DropsTheWhitespaceAfterMostSpecialTokens) {
  Vocab vocab = toy_spm_vocab();
  vocab.strip_after_special = true;
  const Tokenizer phi3(vocab);
  const Token space = phi3.find("\u2581"), space_hi = phi3.find("\u2581hi");
  EXPECT_EQ(phi3.encode("<|end|>\n hi", true), (std::vector<Token>{kSpmEnd, space_hi}));
  EXPECT_EQ(phi3.encode("<tool> \t\r\nhi", false), (std::vector<Token>{kSpmTool, space_hi}));
  EXPECT_EQ(phi3.encode("<|end|>  ", true), (std::vector<Token>{kSpmEnd}));
  // Not after <s>, <unk> or <|endoftext|>.
  EXPECT_EQ(phi3.encode("<s> hi", true), (std::vector<Token>{kSpmBos, space, space_hi}));
  EXPECT_EQ(phi3.encode("<|endoftext|> hi", true), (std::vector<Token>{kSpmEndOfText, space, space_hi}));
  // Without the flag, the whitespace stays.
  const Tokenizer plain(toy_spm_vocab());
  EXPECT_EQ(plain.encode("<|end|>\n hi", true),
            (std::vector<Token>{kSpmEnd, space, spm_byte_id('\n'), space_hi}));
}

// Gemma's turn tokens, user-defined here: <end_of_turn> is taken for a control token that ends
// generation, as llama.cpp does, <start_of_turn> is not; both are cut out of a chat prompt.
TEST(SpmTokenizer, GemmasEndOfTurnEndsGeneration) {
  Vocab vocab = without_space_prefix(toy_spm_vocab());
  for (const char* text : {"<start_of_turn>", "<end_of_turn>"}) {
    vocab.tokens.push_back(text);
    vocab.types.push_back(TokenType::UserDefined);
    vocab.scores.push_back(0.0f);
  }
  const Tokenizer gemma(vocab);
  const Token start = gemma.find("<start_of_turn>"), end = gemma.find("<end_of_turn>");
  EXPECT_TRUE(gemma.is_end_of_generation(end));
  EXPECT_EQ(gemma.vocab().types[static_cast<std::size_t>(end)], TokenType::Control);
  EXPECT_FALSE(gemma.is_end_of_generation(start));
  EXPECT_EQ(gemma.encode("<start_of_turn>hi<end_of_turn>\n", true),
            (std::vector<Token>{start, gemma.find("hi"), end, spm_byte_id('\n')}));
}

TEST_F(ToySpmTokenizer, InvalidUtf8KeepsEveryByte) {
  // A lead byte takes as many bytes as it announces, whatever they are, as in llama.cpp: here
  // 0xE2 takes the "▁" that the space became, which then comes back as the bytes of "▁".
  EXPECT_EQ(tokenizer.encode("\xE2 hi", false),
            (std::vector<Token>{id("_"), spm_byte_id(0xE2), spm_byte_id(0xE2), spm_byte_id(0x96),
                                spm_byte_id(0x81), id("hi")}));
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("\xE2 hi", false)), " \xE2\xE2\x96\x81hi");
  // A truncated character at the end, and stray continuation bytes.
  EXPECT_EQ(tokenizer.encode("hi\xE2\x96", false), (std::vector<Token>{id("_hi"), spm_byte_id(0xE2), spm_byte_id(0x96)}));
  EXPECT_EQ(tokenizer.encode("\x80\x80", false), (std::vector<Token>{id("_"), spm_byte_id(0x80), spm_byte_id(0x80)}));
  // Any bytes: no byte is lost or added, apart from spaces written as "▁" (which the bytes of
  // an invalid character may swallow).
  const auto escaped = [](std::string_view text) {
    std::string out;
    for (const char c : text) {
      if (c == ' ') {
        out += "\u2581";
      } else {
        out += c;
      }
    }
    return out;
  };
  std::mt19937 rng(2024);
  for (int i = 0; i < 500; ++i) {
    std::string text(rng() % 40, '\0');
    for (char& c : text) {
      c = static_cast<char>(rng() % 256);
      if (c == '<') c = ' ';  // keep special-token text out
    }
    for (const bool parse_special : {false, true}) {
      const std::vector<Token> tokens = tokenizer.encode(text, parse_special);
      EXPECT_EQ(escaped(tokenizer.decode(tokens)), escaped(text.empty() ? "" : " " + text));
    }
  }
}

TEST(SpmTokenizer, RejectsScoresThatDoNotMatchTheTokens) {
  Vocab vocab = toy_spm_vocab();
  vocab.scores.pop_back();
  EXPECT_NE(invalid_argument_message([&] { Tokenizer t(vocab); }).find("scores"), std::string::npos);
  vocab = toy_spm_vocab();
  vocab.scores.back() = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(invalid_argument_message([&] { Tokenizer t(vocab); }).find("not a number"), std::string::npos);
  // A "llama" vocabulary needs no merges, nor a known pre-tokenizer (llama.cpp ignores it).
  vocab = toy_spm_vocab();
  vocab.pre = "whatever";
  vocab.merges = {"a b"};
  EXPECT_NO_THROW(Tokenizer{vocab});
}

// --- Chat template --------------------------------------------------------------------------------

// SmolLM2-135M-Instruct's tokenizer.chat_template, as in its GGUF (with real newlines).
const std::string kSmolLM2Template =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

ChatTemplate template_from(std::string text) {
  Vocab vocab = toy_vocab();
  vocab.chat_template = std::move(text);
  return ChatTemplate::from_vocab(vocab);
}

TEST(ChatTemplate, FindsSmolLM2sDefaultSystemMessage) {
  const ChatTemplate chat = template_from(kSmolLM2Template);
  EXPECT_EQ(chat.name(), "chatml");
  EXPECT_EQ(chat.default_system(), "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
}

// A chat template from llama.cpp's copies (models/templates/), which scripts/fetch-vocabs.sh
// extracts into models/vocab/templates/; empty where it has not run.
std::string read_template(const std::string& name) {
  std::ifstream in(std::filesystem::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates" / name, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Qwen2.5's template: a longer program with a branch for tools, whose default system message is
// found among constants that only open the system turn, and whose conversation is plain ChatML.
TEST(ChatTemplate, ReadsQwen25sTemplate) {
  const std::string text = read_template("Qwen-Qwen2.5-7B-Instruct.jinja");
  if (text.empty()) GTEST_SKIP() << "Qwen2.5's template is absent (scripts/fetch-vocabs.sh fetches it)";
  const ChatTemplate chat = template_from(text);
  EXPECT_EQ(chat.default_system(), "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  const std::vector<ChatMessage> messages = {{"user", "2+2?"}, {"assistant", "4"}, {"user", "And 3+3?"}};
  EXPECT_EQ(chat.apply(messages, true),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
            "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<ChatMessage> with_system = {{"system", "Be brief."}, {"user", "Hi"}};
  EXPECT_EQ(chat.apply(with_system, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

// Qwen3's template: ChatML with no default system message, and assistant turns' reasoning.
TEST(ChatTemplate, ReadsQwen3sTemplate) {
  const std::string text = read_template("Qwen-Qwen3-0.6B.jinja");
  if (text.empty()) GTEST_SKIP() << "Qwen3's template is absent (scripts/fetch-vocabs.sh fetches it)";
  const ChatTemplate chat = template_from(text);
  EXPECT_EQ(chat.default_system(), "");
  EXPECT_TRUE(chat.reasoning_turns());
  const std::vector<ChatMessage> messages = {{"user", "2+2?"}, {"assistant", "4"}, {"user", "And 3+3?"}};
  EXPECT_EQ(chat.apply(messages, true),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
            "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n");
  // Reasoning: dropped before the last user turn, kept after it (an empty block for a last
  // assistant message); a user turn that is a tool's response is not a query. The expected texts
  // are Jinja's renderings of this template.
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"user", "2+2?"}, {"assistant", "<think>\nhmm\n</think>\n\n4"}, {"user", "And 3+3?"}}, true),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"user", "2+2?"}, {"assistant", "<think>\nr\n</think>\n\nanswer"}}, true),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nanswer<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"system", "S"}, {"user", "2+2?"}, {"assistant", "plain"}}, true),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n"
            "</think>\n\nplain<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"user", "a"}, {"assistant", "x</think>\ny"}, {"assistant", "<think>q</think>z"},
                                                {"user", "<tool_response>t</tool_response>"}},
                       true),
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\n\ny<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nq\n</think>\n\nz<|im_end|>\n<|im_start|>user\n<tool_response>t</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n");
}

// ---- Llama 3 ----
// The expected texts are what Jinja (Python's jinja2, with llama.cpp's and Hugging Face's
// settings: trim_blocks, lstrip_blocks) renders from these templates, less the leading
// <|begin_of_text|>, which the tokenizer adds (Llama 3 vocabularies set add_bos_token).

// Three conversations: plain (a message to trim), a system message (trimmed), and a system
// message later on (an ordinary turn).
const std::vector<std::vector<ChatMessage>>& llama3_conversations() {
  static const std::vector<std::vector<ChatMessage>> all = {
      {{"user", "2+2?"}, {"assistant", "4"}, {"user", "  And 3+3?\n"}},
      {{"system", " Be brief. "}, {"user", "Hi"}},
      {{"user", "Hi"}, {"system", "Now in French."}, {"user", "Bye"}},
  };
  return all;
}

// The rendered turns after the system turn, for each conversation, with the generation prompt.
std::vector<std::string> llama3_turns() {
  const std::string u = "<|start_header_id|>user<|end_header_id|>\n\n", a = "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return {u + "2+2?<|eot_id|>" + a + "4<|eot_id|>" + u + "And 3+3?<|eot_id|>" + a,
          u + "Hi<|eot_id|>" + a,
          u + "Hi<|eot_id|><|start_header_id|>system<|end_header_id|>\n\nNow in French.<|eot_id|>" + u + "Bye<|eot_id|>" + a};
}

// Llama 3.0's template (Meta's tokenizer_config.json): no system turn of its own.
TEST(ChatTemplate, Llama30TurnsWithTrimmedContents) {
  const ChatTemplate chat = template_from(
      "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
      "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
      "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}");
  EXPECT_EQ(chat.name(), "llama3");
  EXPECT_EQ(chat.date(), "");
  const std::vector<std::string> turns = llama3_turns();
  EXPECT_EQ(chat.apply(llama3_conversations()[0], true), turns[0]);
  EXPECT_EQ(chat.apply(llama3_conversations()[1], true),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" + turns[1]);
  EXPECT_EQ(chat.apply(llama3_conversations()[2], true), turns[2]);
  // Python's strip(), as Jinja's trim: Unicode spaces too.
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"user", "\u3000\u2009Hi\u00a0\u2028"}}, false),
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
  // Without the generation prompt, the conversation ends with its last turn.
  EXPECT_EQ(chat.apply(llama3_conversations()[1], false),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
}

// A Llama 3 template (a fine-tune's) that writes out a whole system turn: its default system
// message, as the ChatML path finds one.
TEST(ChatTemplate, Llama3DefaultSystemMessage) {
  const ChatTemplate chat = template_from(
      "{% if messages[0]['role'] != 'system' %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nYou are Bob.<|eot_id|>' }}"
      "{% endif %}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
      "message['content'] | trim + '<|eot_id|>' }}{% endfor %}");
  EXPECT_EQ(chat.default_system(), "You are Bob.");
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"user", "Hi"}}, false),
            "<|start_header_id|>system<|end_header_id|>\n\nYou are Bob.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"system", "S"}, {"user", "Hi"}}, false),
            "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
}

// Llama 3.1, 3.2 and 3.3's own templates (llama.cpp's copies, which scripts/fetch-vocabs.sh
// extracts): the system turn with the knowledge date and the day's date, then the rest. 3.1 and
// 3.3 set the date to 26 Jul 2024; 3.2 asks for today's (strftime_now).
TEST(ChatTemplate, Llama31To33OpenWithTheDatedSystemTurn) {
  for (const char* name : {"meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
                           "meta-llama-Llama-3.3-70B-Instruct.jinja"}) {
    const std::string text = read_template(name);
    if (text.empty()) GTEST_SKIP() << name << " is absent (scripts/fetch-vocabs.sh fetches it)";
    const ChatTemplate chat = template_from(text);
    EXPECT_EQ(chat.name(), "llama3") << name;
    std::string date = "26 Jul 2024";
    if (std::string_view(name).find("3.2") != std::string_view::npos) {
      EXPECT_EQ(chat.date(), "today") << name;
      const std::time_t now = std::time(nullptr);
      char buffer[32];
      std::strftime(buffer, sizeof buffer, "%d %b %Y", std::localtime(&now));
      date = buffer;
    } else {
      EXPECT_EQ(chat.date(), "26 Jul 2024") << name;
    }
    const std::string head = "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: " + date + "\n\n";
    const std::vector<std::string> turns = llama3_turns();
    EXPECT_EQ(chat.apply(llama3_conversations()[0], true), head + "<|eot_id|>" + turns[0]) << name;
    EXPECT_EQ(chat.apply(llama3_conversations()[1], true), head + "Be brief.<|eot_id|>" + turns[1]) << name;
    EXPECT_EQ(chat.apply(llama3_conversations()[2], true), head + "<|eot_id|>" + turns[2]) << name;
  }
}

// ---- DeepSeek-R1's distills ----
// The expected texts are what Jinja (jinja2 with trim_blocks and lstrip_blocks, bos_token empty:
// the tokenizer adds it) renders from llama.cpp's copies of the distills' templates; the Qwen
// one there asks for enable_thinking, rendered as true (the model's own template has no such
// switch).
TEST(ChatTemplate, DeepSeekR1DistillTemplates) {
  const std::string u = "<\uff5cUser\uff5c>", a = "<\uff5cAssistant\uff5c>", end = "<\uff5cend\u2581of\u2581sentence\uff5c>";
  for (const char* name : {"deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"}) {
    const std::string text = read_template(name);
    if (text.empty()) GTEST_SKIP() << name << " is absent (scripts/fetch-vocabs.sh fetches it)";
    const ChatTemplate chat = template_from(text);
    EXPECT_EQ(chat.name(), "deepseek-r1") << name;
    EXPECT_TRUE(chat.opens_reasoning()) << name;
    EXPECT_EQ(chat.default_system(), "") << name;
    using M = std::vector<ChatMessage>;
    EXPECT_EQ(chat.apply(M{{"user", "2+2?"}, {"assistant", "4"}, {"user", "And 3+3?"}}, true),
              u + "2+2?" + a + "4" + end + u + "And 3+3?" + a + "<think>\n")
        << name;
    EXPECT_EQ(chat.apply(M{{"system", "Be brief."}, {"user", "Hi"}}, true), "Be brief." + u + "Hi" + a + "<think>\n") << name;
    // A system message anywhere goes first; the last one wins.
    EXPECT_EQ(chat.apply(M{{"user", "Hi"}, {"system", "Now in French."}, {"user", "Bye"}}, true),
              "Now in French." + u + "Hi" + u + "Bye" + a + "<think>\n")
        << name;
    EXPECT_EQ(chat.apply(M{{"system", "S1"}, {"system", "S2"}, {"user", "x"}}, true), "S2" + u + "x" + a + "<think>\n") << name;
    // An assistant turn keeps what follows its last </think>; contents are not trimmed.
    EXPECT_EQ(chat.apply(M{{"user", "a"},
                           {"assistant", "<think>\nr\n</think>\n\nanswer"},
                           {"assistant", "x</think>y</think>\nz"},
                           {"user", " b\n"}},
                         true),
              u + "a" + a + "\n\nanswer" + end + a + "\nz" + end + u + " b\n" + a + "<think>\n")
        << name;
    EXPECT_EQ(chat.apply(M{{"system", "Be brief."}, {"user", "Hi"}}, false), "Be brief." + u + "Hi") << name;
  }
}

// The distills' first templates ended the prompt with the assistant's tag alone.
TEST(ChatTemplate, AnEarlierDeepSeekR1TemplateDoesNotOpenTheReasoning) {
  const ChatTemplate chat = template_from(
      "{% set ns = namespace(system_prompt='') %}{% for message in messages %}{% if message['role'] == 'system' %}"
      "{% set ns.system_prompt = message['content'] %}{% endif %}{% endfor %}{{bos_token}}{{ns.system_prompt}}"
      "{% for message in messages %}{% if message['role'] == 'user' %}{{'<\uff5cUser\uff5c>' + message['content']}}{% endif %}"
      "{% if message['role'] == 'assistant' %}{{'<\uff5cAssistant\uff5c>' + message['content'] + "
      "'<\uff5cend\u2581of\u2581sentence\uff5c>'}}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}{{'<\uff5cAssistant\uff5c>'}}{% endif %}");
  EXPECT_EQ(chat.name(), "deepseek-r1");
  EXPECT_FALSE(chat.opens_reasoning());
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"user", "Hi"}}, true), "<\uff5cUser\uff5c>Hi<\uff5cAssistant\uff5c>");
}

// ---- Phi-3 ----
// Phi-3.5's template (llama.cpp's copy); the expected texts are jinja2's renderings of it.
TEST(ChatTemplate, Phi35TurnsWithSystemMessages) {
  const std::string text = read_template("microsoft-Phi-3.5-mini-instruct.jinja");
  if (text.empty()) GTEST_SKIP() << "Phi-3.5's template is absent (scripts/fetch-vocabs.sh fetches it)";
  const ChatTemplate chat = template_from(text);
  EXPECT_EQ(chat.name(), "phi3");
  EXPECT_TRUE(chat.system_turns());
  using M = std::vector<ChatMessage>;
  EXPECT_EQ(chat.apply(M{{"user", "2+2?"}, {"assistant", "4"}, {"user", "And 3+3?"}}, true),
            "<|user|>\n2+2?<|end|>\n<|assistant|>\n4<|end|>\n<|user|>\nAnd 3+3?<|end|>\n<|assistant|>\n");
  EXPECT_EQ(chat.apply(M{{"system", "Be brief."}, {"user", "Hi"}}, true),
            "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n");
  EXPECT_EQ(chat.apply(M{{"system", ""}, {"user", "Hi"}}, true), "<|user|>\nHi<|end|>\n<|assistant|>\n");
  EXPECT_EQ(chat.apply(M{{"user", "Hi"}, {"system", "Now in French."}, {"user", " Bye\n"}}, true),
            "<|user|>\nHi<|end|>\n<|system|>\nNow in French.<|end|>\n<|user|>\n Bye\n<|end|>\n<|assistant|>\n");
}

// A Phi-3 template with system turns but no test of their content writes an empty one too
// (the expected text is jinja2's rendering).
TEST(ChatTemplate, Phi3TemplateWithoutTheContentTestWritesEmptySystemTurns) {
  const ChatTemplate chat = template_from(
      "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
      "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
      "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}");
  EXPECT_TRUE(chat.system_turns());
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"system", ""}, {"user", "Hi"}}, true),
            "<|system|>\n<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n");
}

// Phi-3-mini's first template (its tokenizer_config.json): no system turns, the assistant's tag
// after every user turn. The same text for the conversations it renders.
TEST(ChatTemplate, Phi3FirstTemplateLeavesSystemMessagesOut) {
  const ChatTemplate chat = template_from(
      "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}{{'<|user|>' + '\\n' + "
      "message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}{% elif (message['role'] == 'assistant') %}"
      "{{message['content'] + '<|end|>' + '\\n'}}{% endif %}{% endfor %}");
  EXPECT_EQ(chat.name(), "phi3");
  EXPECT_FALSE(chat.system_turns());
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"system", "S"}, {"user", "2+2?"}, {"assistant", "4"}, {"user", "3+3?"}}, true),
            "<|user|>\n2+2?<|end|>\n<|assistant|>\n4<|end|>\n<|user|>\n3+3?<|end|>\n<|assistant|>\n");
}

// Phi-4-mini's template: its tags built as '<|' + role + '|>', no newlines; every message a
// turn, an empty system message too. The expected texts are jinja2's renderings of it.
TEST(ChatTemplate, Phi4MiniTagsTakeNoNewlines) {
  const ChatTemplate chat = template_from(
      "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
      "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
      "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}");
  EXPECT_EQ(chat.name(), "phi3");
  EXPECT_TRUE(chat.system_turns());
  using M = std::vector<ChatMessage>;
  EXPECT_EQ(chat.apply(M{{"user", "2+2?"}, {"assistant", "4"}, {"user", "And 3+3?"}}, true),
            "<|user|>2+2?<|end|><|assistant|>4<|end|><|user|>And 3+3?<|end|><|assistant|>");
  EXPECT_EQ(chat.apply(M{{"system", "Be brief."}, {"user", " Hi\n"}}, true), "<|system|>Be brief.<|end|><|user|> Hi\n<|end|><|assistant|>");
  EXPECT_EQ(chat.apply(M{{"system", ""}, {"user", "Hi"}}, true), "<|system|><|end|><|user|>Hi<|end|><|assistant|>");
}

// ---- Mistral ----
// Templates with the features of Mistral's (the tags' spaces, the answer's space and trim, where
// the system message goes); the expected texts are jinja2's renderings of these templates with
// eos_token "</s>", the EOS token's text in the vocabulary used here.
ChatTemplate mistral_template(std::string text) {
  Vocab vocab = toy_vocab();
  vocab.tokens.push_back("</s>");
  vocab.types.push_back(TokenType::Control);
  vocab.eos = static_cast<Token>(vocab.tokens.size() - 1);
  vocab.chat_template = std::move(text);
  return ChatTemplate::from_vocab(vocab);
}

const std::vector<std::vector<ChatMessage>>& mistral_conversations() {
  static const std::vector<std::vector<ChatMessage>> all = {
      {{"user", "Hello"}, {"assistant", "  Hi there "}, {"user", "Who are you"}},
      {{"system", "S"}, {"user", "Hello"}, {"assistant", "Hi"}, {"user", "Q"}},
      {{"system", "S"}, {"user", "Hello"}, {"assistant", "Hi"}},
  };
  return all;
}

// v0.1/v0.2: " [INST] ... [/INST]", the answer after a space, the system message in the first turn.
TEST(ChatTemplate, MistralV02SystemInTheFirstTurn) {
  const ChatTemplate chat = mistral_template(
      "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}{%- set loop_messages = "
      "messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}{{- bos_token }}{%- for message in "
      "loop_messages %}{%- if message['role'] == 'user' %}{%- if loop.first and system_message is defined %}{{- ' [INST] ' "
      "+ system_message + '\\n\\n' + message['content'] + ' [/INST]' }}{%- else %}{{- ' [INST] ' + message['content'] + ' "
      "[/INST]' }}{%- endif %}{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif "
      "%}{%- endfor %}");
  EXPECT_EQ(chat.name(), "mistral");
  const auto& c = mistral_conversations();
  EXPECT_EQ(chat.apply(c[0], true), " [INST] Hello [/INST]   Hi there </s> [INST] Who are you [/INST]");
  EXPECT_EQ(chat.apply(c[1], true), " [INST] S\n\nHello [/INST] Hi</s> [INST] Q [/INST]");
  EXPECT_EQ(chat.apply(c[2], true), " [INST] S\n\nHello [/INST] Hi</s>");
}

// v0.3: "[INST] ...[/INST]", the answer trimmed after a space, the system message in the last
// message when that is a user turn.
TEST(ChatTemplate, MistralV03SystemInTheLastTurn) {
  const ChatTemplate chat = mistral_template(
      "{%- if messages[0][\"role\"] == \"system\" %}{%- set system_message = messages[0][\"content\"] %}{%- set "
      "loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}{{- bos_token }}{%- for "
      "message in loop_messages %}{%- if message[\"role\"] == \"user\" %}{%- if loop.last and system_message is defined "
      "%}{{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}{%- else %}{{- \"[INST] \" + "
      "message[\"content\"] + \"[/INST]\" }}{%- endif %}{%- elif message[\"role\"] == \"assistant\" %}{{- \" \" + "
      "message[\"content\"]|trim + eos_token }}{%- endif %}{%- endfor %}");
  const auto& c = mistral_conversations();
  EXPECT_EQ(chat.apply(c[0], true), "[INST] Hello[/INST] Hi there</s>[INST] Who are you[/INST]");
  EXPECT_EQ(chat.apply(c[1], true), "[INST] Hello[/INST] Hi</s>[INST] S\n\nQ[/INST]");
  EXPECT_EQ(chat.apply(c[2], true), "[INST] Hello[/INST] Hi</s>");
}

// The first v0.2 template: no system message (the template raises, here std::invalid_argument),
// and turns that must alternate.
TEST(ChatTemplate, MistralWithoutASystemMessageAndTurnsInOrder) {
  const ChatTemplate chat = mistral_template(
      "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' "
      "[/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}");
  const auto& c = mistral_conversations();
  EXPECT_EQ(chat.apply(c[0], true), "[INST] Hello [/INST]  Hi there </s>[INST] Who are you [/INST]");
  const auto error = [&](const std::vector<ChatMessage>& m) {
    try {
      (void)chat.apply(m, true);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(error(c[1]), "messages[0]: this model's chat template takes no system message");
  EXPECT_NE(error({{"user", "a"}, {"user", "b"}}).find("messages[1]: this model's chat template takes user and assistant "
                                                       "messages in turn"),
            std::string::npos);
  EXPECT_NE(error({{"assistant", "a"}}).find("so this one must be user, not assistant"), std::string::npos);
  // An [INST] <<SYS>> template other than Llama 2's is refused.
  EXPECT_THROW(template_from("{% for m in messages %}[INST] <<SYS>>\n{{ m['content'] }}\n<</SYS>> [/INST]{% endfor %}"),
               std::invalid_argument);
}

// Llama 2's shape: each user turn from the BOS token's text (the first BOS is the tokenizer's,
// as for the other templates), contents stripped, the system message in a <<SYS>> block at the
// head of the first turn. The expected texts are jinja2's renderings less the leading "<s>".
TEST(ChatTemplate, Llama2TurnsWithTheSystemBlock) {
  Vocab vocab = toy_vocab();
  for (const char* text : {"<s>", "</s>"}) {
    vocab.tokens.push_back(text);
    vocab.types.push_back(TokenType::Control);
  }
  vocab.bos = static_cast<Token>(vocab.tokens.size() - 2);
  vocab.eos = static_cast<Token>(vocab.tokens.size() - 1);
  vocab.chat_template =
      "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
      "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
      "{% for message in loop_messages %}{% if loop.index0 == 0 and system_message != false %}{% set content = "
      "'<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = "
      "message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' "
      "[/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
      "{% endfor %}";
  const ChatTemplate chat = ChatTemplate::from_vocab(vocab);
  EXPECT_EQ(chat.name(), "llama2");
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"user", "Hello"}, {"assistant", "  Hi there "}, {"user", " Who are you\n"}}, true),
            "[INST] Hello [/INST] Hi there </s><s>[INST] Who are you [/INST]");
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"system", " S "}, {"user", "Hello "}, {"assistant", "Hi"}, {"user", "Q"}}, true),
            "[INST] <<SYS>>\n S \n<</SYS>>\n\nHello [/INST] Hi </s><s>[INST] Q [/INST]");
  EXPECT_EQ(chat.apply(std::vector<ChatMessage>{{"system", "S"}, {"user", "Hello"}}, true), "[INST] <<SYS>>\nS\n<</SYS>>\n\nHello [/INST]");
  EXPECT_THROW((void)chat.apply(std::vector<ChatMessage>{{"user", "a"}, {"user", "b"}}, true), std::invalid_argument);
}

// ---- Gemma ----
// Gemma 2's template (llama.cpp's copy, google-gemma-2-2b-it.jinja) and Gemma 3's (its
// tokenizer_config.json); the expected texts are jinja2's renderings less the leading "<bos>",
// which the tokenizer adds.
const std::string kGemma2Template =
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% "
    "endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "(message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% "
    "endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% "
    "if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}";
const std::string kGemma3Template =
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string "
    "-%}\n        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n        "
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n    {%- "
    "set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n    {%- set "
    "loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n    {%- if "
    "(message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n        {{ raise_exception(\"Conversation roles "
    "must alternate user/assistant/user/assistant/...\") }}\n    {%- endif -%}\n    {%- if (message['role'] == "
    "'assistant') -%}\n        {%- set role = \"model\" -%}\n    {%- else -%}\n        {%- set role = "
    "message['role'] -%}\n    {%- endif -%}\n    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if "
    "loop.first else \"\") }}\n    {%- if message['content'] is string -%}\n        {{ message['content'] | trim "
    "}}\n    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n       "
    "     {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n            {%- elif "
    "item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n            {%- endif -%}\n        "
    "{%- endfor -%}\n    {%- else -%}\n        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif "
    "-%}\n    {{ '<end_of_turn>\\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n    "
    "{{'<start_of_turn>model\\n'}}\n{%- endif -%}\n";

struct GemmaTurns {
  std::string user = "<start_of_turn>user\n", model = "<start_of_turn>model\n", end = "<end_of_turn>\n";
};

// What Gemma 2's and 3's templates write alike: the family's name, turns of trimmed content.
void expect_gemma_turns(const ChatTemplate& chat) {
  const GemmaTurns t;
  using M = std::vector<ChatMessage>;
  EXPECT_EQ(chat.name(), "gemma");
  EXPECT_EQ(chat.apply(M{{"user", "  2+2?\n"}, {"assistant", "\n4 "}, {"user", "\tAnd 3+3? "}}, true),
            t.user + "2+2?" + t.end + t.model + "4" + t.end + t.user + "And 3+3?" + t.end + t.model);
  EXPECT_EQ(chat.apply(M{{"user", "Hi"}}, false), t.user + "Hi" + t.end);
}

TEST(ChatTemplate, Gemma3TurnsWithTheSystemMessageAtTheHeadOfTheFirst) {
  const ChatTemplate chat = template_from(kGemma3Template);
  expect_gemma_turns(chat);
  const GemmaTurns t;
  using M = std::vector<ChatMessage>;
  // Python's strip(), as Jinja's trim: Unicode spaces too.
  EXPECT_EQ(chat.apply(M{{"user", "\u3000\u2009Hi\u00a0\u2028"}}, false), t.user + "Hi" + t.end);
  // The system message as it is, then "\n\n" (after an empty one too); the content trimmed.
  EXPECT_EQ(chat.apply(M{{"system", "Be brief."}, {"user", "Hi"}}, true), t.user + "Be brief.\n\nHi" + t.end + t.model);
  EXPECT_EQ(chat.apply(M{{"system", " Be brief.\n"}, {"user", " Hi "}}, true), t.user + " Be brief.\n\n\nHi" + t.end + t.model);
  EXPECT_EQ(chat.apply(M{{"system", ""}, {"user", "Hi"}}, true), t.user + "\n\nHi" + t.end + t.model);
  EXPECT_EQ(chat.apply(M{{"system", "S"}, {"user", "Hello"}, {"assistant", " Hi "}, {"user", "Q"}}, false),
            t.user + "S\n\nHello" + t.end + t.model + "Hi" + t.end + t.user + "Q" + t.end);
  EXPECT_EQ(chat.apply(M{{"system", "S"}}, true), t.model);
  // A template whose first_user_prefix adds one newline, as some GGUF conversions have: its own.
  std::string one_newline = kGemma3Template;
  for (std::size_t at; (at = one_newline.find("+ '\\n\\n'")) != std::string::npos;) one_newline.replace(at, 8, "+ '\\n'");
  EXPECT_EQ(template_from(one_newline).apply(M{{"system", "Be brief."}, {"user", "Hi"}}, true),
            t.user + "Be brief.\nHi" + t.end + t.model);
}

// Gemma 2's template raises on a system message; as llama.cpp's own Gemma formatting does, the
// system message goes at the head of the first user turn, trimmed, with "\n\n" after it unless
// empty (the expected texts with a system message are that formatting's).
TEST(ChatTemplate, Gemma2PutsTheSystemMessageInTheFirstTurnAsLlamaCppDoes) {
  const ChatTemplate chat = template_from(kGemma2Template);
  expect_gemma_turns(chat);
  const GemmaTurns t;
  using M = std::vector<ChatMessage>;
  EXPECT_EQ(chat.apply(M{{"user", "\u3000\u2009Hi\u00a0\u2028"}}, true), t.user + "Hi" + t.end + t.model);
  EXPECT_EQ(chat.apply(M{{"system", " Be brief.\n"}, {"user", " Hi "}}, true), t.user + "Be brief.\n\nHi" + t.end + t.model);
  EXPECT_EQ(chat.apply(M{{"system", "S"}, {"user", "Hello"}, {"assistant", " Hi "}, {"user", "Q"}}, false),
            t.user + "S\n\nHello" + t.end + t.model + "Hi" + t.end + t.user + "Q" + t.end);
  EXPECT_EQ(chat.apply(M{{"system", ""}, {"user", "Hi"}}, true), t.user + "Hi" + t.end + t.model);
  EXPECT_EQ(chat.apply(M{{"system", "  \n"}, {"user", "Hi"}}, false), t.user + "Hi" + t.end);
}

// Roles alternate user/assistant from a user message, after an optional first system message;
// the templates raise otherwise. A later system message is refused too: the templates raise
// where it stands for a user turn, and elsewhere write a "system" turn, which Gemma has not.
TEST(ChatTemplate, GemmaTurnsMustAlternate) {
  for (const std::string& text : {kGemma2Template, kGemma3Template}) {
    const ChatTemplate chat = template_from(text);
    const auto error = [&](const std::vector<ChatMessage>& m) {
      return invalid_argument_message([&] { (void)chat.apply(m, true); });
    };
    const std::string turns = ": this model's chat template takes user and assistant messages in turn (after an optional "
                              "first system message), so this one must be ";
    EXPECT_EQ(error({{"user", "a"}, {"user", "b"}}), "messages[1]" + turns + "assistant, not user");
    EXPECT_EQ(error({{"assistant", "a"}}), "messages[0]" + turns + "user, not assistant");
    EXPECT_EQ(error({{"user", "a"}, {"assistant", "b"}, {"system", "c"}}), "messages[2]" + turns + "user, not system");
    EXPECT_EQ(error({{"user", "a"}, {"system", "b"}, {"user", "c"}}), "messages[1]" + turns + "assistant, not system");
    EXPECT_EQ(error({{"system", "s"}, {"system", "t"}, {"user", "a"}}), "messages[1]" + turns + "user, not system");
  }
  // A <start_of_turn> template without Gemma's turns is refused.
  const std::string other = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}";
  EXPECT_NE(invalid_argument_message([&] { template_from(other); }).find("other than Gemma 2's and 3's"), std::string::npos);
}

TEST(ChatTemplate, InsertsTheDefaultSystemMessageWhenTheFirstMessageIsNotSystem) {
  const ChatTemplate chat = template_from(kSmolLM2Template);
  const std::vector<ChatMessage> messages = {{"user", "Hi!"}, {"assistant", "Hello."}, {"user", "2+2?"}};
  EXPECT_EQ(chat.apply(messages, true),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi!<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n"
            "<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplate, KeepsTheCallersSystemMessage) {
  const ChatTemplate chat = template_from(kSmolLM2Template);
  const std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", "Hi"}};
  EXPECT_EQ(chat.apply(messages, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
  EXPECT_EQ(chat.apply({}, true), "<|im_start|>assistant\n");
}

TEST(ChatTemplate, EmptyTemplateIsChatMLWithoutDefault) {
  const ChatTemplate chat = template_from("");
  EXPECT_EQ(chat.default_system(), "");
  const std::vector<ChatMessage> messages = {{"user", "Hi"}};
  EXPECT_EQ(chat.apply(messages, true), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, PlainChatMLHasNoDefault) {
  // The system turn opens for the message's own content: not a default.
  const ChatTemplate chat = template_from(
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
      "'<|im_end|>' + '\\n'}}{% endfor %}{% if messages[0]['role'] != 'system' %}"
      "{{ '<|im_start|>system\\n' + message['content'] }}{% endif %}");
  EXPECT_EQ(chat.default_system(), "");
}

TEST(ChatTemplate, ReadsEscapedAndConcatenatedDefaults) {
  // Qwen2.5 style: whitespace control, an escaped newline, a double-quoted literal joined by '+'.
  const ChatTemplate chat = template_from(
      "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] "
      "+ '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, it\\'s ' + \"nice.\" + "
      "'<|im_end|>\\n' -}}{%- endif %}{% for m in messages %}{{'<|im_start|>' + m['role'] }}{% endfor %}");
  EXPECT_EQ(chat.default_system(), "You are Qwen, it's nice.");
}

TEST(ChatTemplate, RejectsTemplatesThatAreNotChatMLOrLlama3) {
  try {
    template_from("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}");
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("only ChatML (<|im_start|>role ... <|im_end|>), Llama 3"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("Gemma (<start_of_turn>role ... <end_of_turn>)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(template_from("<|im_start|>{{ 'unterminated }}"), std::invalid_argument);
}

// Found by fuzzing (tests/fuzz/corpus/chat_template): '\U001FBBBB' became bytes that are not
// UTF-8, in the default system message of every chat prompt (and `inspect` then failed to
// show it).
TEST(ChatTemplate, RejectsEscapesThatAreNotCharacters) {
  const auto message_of = [](const std::string& text) -> std::string {
    try {
      template_from(text);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(message_of("{{ '<|im_start|>system\\nHi \\U001FBBBB<|im_end|>\\n' }}"),
            "chat template: \\U001FBBBB in a string literal is past U+10FFFF, not a character");
  EXPECT_EQ(message_of("{{ '<|im_start|>system\\nHi \\ud83d<|im_end|>\\n' }}"),
            "chat template: \\ud83d in a string literal is a surrogate, not a character");
  EXPECT_EQ(template_from("{{ '<|im_start|>system\\n\\U0001F600 \\u00e9<|im_end|>\\n' }}").default_system(),
            "\xF0\x9F\x98\x80 \xC3\xA9");
}

TEST(ChatTemplate, RejectsTemplatesThatAreNotUtf8) {
  EXPECT_THROW(template_from("<|im_start|>{{ 'caf\xE9' }}"), std::invalid_argument);
  try {
    template_from("<|im_start|>{{ '\xC0\x80' }}");
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "chat template: not valid UTF-8 (at byte 17)");
  }
}

// --- Vocab::from_gguf -----------------------------------------------------------------------------

namespace support = batchlm::testing;  // the GGUF writer

class TempFile {
 public:
  explicit TempFile(const std::string& name)
      : path_(std::filesystem::temp_directory_path() /
              (name + "-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "-" +
               std::to_string(reinterpret_cast<std::uintptr_t>(this)) + ".gguf")) {}
  ~TempFile() { std::filesystem::remove(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

support::GgufWriter tokenizer_gguf(const Vocab& vocab) {
  using support::GgufValue;
  std::vector<std::int32_t> types;
  for (const TokenType type : vocab.types) types.push_back(static_cast<std::int32_t>(type));
  support::GgufWriter writer;
  writer.add("general.architecture", GgufValue::str("llama"))
      .add("tokenizer.ggml.model", GgufValue::str(vocab.model))
      .add("tokenizer.ggml.pre", GgufValue::str(vocab.pre))
      .add("tokenizer.ggml.tokens", GgufValue::str_array(vocab.tokens))
      .add("tokenizer.ggml.token_type", GgufValue::i32_array(types))
      .add("tokenizer.ggml.merges", GgufValue::str_array(vocab.merges))
      .add("tokenizer.ggml.bos_token_id", GgufValue::u32(0))
      .add("tokenizer.ggml.eos_token_id", GgufValue::u32(2))
      .add("tokenizer.ggml.padding_token_id", GgufValue::u32(99999))  // out of range: ignored
      .add("tokenizer.ggml.add_bos_token", GgufValue::boolean(true))
      .add("tokenizer.chat_template", GgufValue::str(kSmolLM2Template));
  return writer;
}

TEST(VocabFromGguf, ReadsTheTokenizerKeys) {
  const Vocab expected = toy_vocab("smollm");
  const TempFile file("vocab");
  tokenizer_gguf(expected).write(file.path());
  const Vocab vocab = Vocab::from_gguf(gguf::File::open(file.path()));
  EXPECT_EQ(vocab.model, "gpt2");
  EXPECT_EQ(vocab.pre, "smollm");
  EXPECT_EQ(vocab.tokens, expected.tokens);
  EXPECT_EQ(vocab.types, expected.types);
  EXPECT_EQ(vocab.merges, expected.merges);
  EXPECT_EQ(vocab.bos, 0);
  EXPECT_EQ(vocab.eos, 2);
  EXPECT_EQ(vocab.eot, kImEnd);  // not in the file: found by its text
  EXPECT_EQ(vocab.pad, -1);
  EXPECT_EQ(vocab.unk, -1);
  EXPECT_TRUE(vocab.add_bos);
  EXPECT_EQ(vocab.chat_template, kSmolLM2Template);
  const Tokenizer tokenizer(vocab);
  EXPECT_EQ(tokenizer.encode("12", false), (std::vector<Token>{byte_id('1'), byte_id('2')}));
}

std::string gguf_error(const support::GgufWriter& writer) {
  const TempFile file("bad-vocab");
  writer.write(file.path());
  try {
    (void)Vocab::from_gguf(gguf::File::open(file.path()));
  } catch (const gguf::Error& e) {
    return e.what();
  }
  return "(no gguf::Error)";
}

TEST(VocabFromGguf, ErrorsNameTheFileAndKey) {
  support::GgufWriter missing_tokens;
  missing_tokens.add("tokenizer.ggml.model", support::GgufValue::str("gpt2"));
  const std::string missing = gguf_error(missing_tokens);
  EXPECT_NE(missing.find("tokenizer.ggml.tokens"), std::string::npos) << missing;
  EXPECT_NE(missing.find(".gguf"), std::string::npos) << missing;

  support::GgufWriter wrong_type;
  wrong_type.add("tokenizer.ggml.model", support::GgufValue::str("gpt2"))
      .add("tokenizer.ggml.tokens", support::GgufValue::str_array({"a", "b"}))
      .add("tokenizer.ggml.merges", support::GgufValue::u32(3));
  const std::string wrong = gguf_error(wrong_type);
  EXPECT_NE(wrong.find("tokenizer.ggml.merges"), std::string::npos) << wrong;

  support::GgufWriter short_types;
  const std::array<std::int32_t, 1> one_type = {1};
  short_types.add("tokenizer.ggml.model", support::GgufValue::str("gpt2"))
      .add("tokenizer.ggml.tokens", support::GgufValue::str_array({"a", "b"}))
      .add("tokenizer.ggml.token_type", support::GgufValue::i32_array(one_type))
      .add("tokenizer.ggml.merges", support::GgufValue::str_array({}));
  const std::string short_message = gguf_error(short_types);
  EXPECT_NE(short_message.find("tokenizer.ggml.token_type"), std::string::npos) << short_message;
}

// A "llama" vocabulary's file, with only the keys that have no default.
support::GgufWriter spm_gguf(const Vocab& vocab) {
  using support::GgufValue;
  std::vector<std::int32_t> types;
  for (const TokenType type : vocab.types) types.push_back(static_cast<std::int32_t>(type));
  support::GgufWriter writer;
  writer.add("general.architecture", GgufValue::str("llama"))
      .add("tokenizer.ggml.model", GgufValue::str("llama"))
      .add("tokenizer.ggml.tokens", GgufValue::str_array(vocab.tokens))
      .add("tokenizer.ggml.scores", GgufValue::f32_array(vocab.scores))
      .add("tokenizer.ggml.token_type", GgufValue::i32_array(types));
  return writer;
}

TEST(VocabFromGguf, ReadsALlamaVocabularyWithLlamaCppsDefaults) {
  const Vocab expected = toy_spm_vocab();
  const TempFile file("spm-vocab");
  spm_gguf(expected).write(file.path());
  const Vocab vocab = Vocab::from_gguf(gguf::File::open(file.path()));
  EXPECT_EQ(vocab.model, "llama");
  EXPECT_EQ(vocab.tokens, expected.tokens);
  EXPECT_EQ(vocab.types, expected.types);
  EXPECT_EQ(vocab.scores, expected.scores);
  EXPECT_TRUE(vocab.merges.empty());
  EXPECT_EQ(vocab.bos, 1);
  EXPECT_EQ(vocab.eos, 2);
  EXPECT_EQ(vocab.unk, 0);
  EXPECT_TRUE(vocab.add_bos);
  EXPECT_TRUE(vocab.add_space_prefix);
  EXPECT_FALSE(vocab.strip_after_special);
  EXPECT_EQ(vocab.eot, kSpmEnd);  // "<|end|>", found by its text
  const Tokenizer tokenizer(vocab);
  EXPECT_EQ(tokenizer.encode("hi", false), (std::vector<Token>{tokenizer.find("\u2581hi")}));
}

TEST(VocabFromGguf, ReadsALlamaVocabularysOwnSettings) {
  using support::GgufValue;
  const TempFile file("spm-vocab-keys");
  support::GgufWriter writer = spm_gguf(toy_spm_vocab());
  writer.add("general.name", GgufValue::str("Phi3 Mini"))
      .add("tokenizer.ggml.bos_token_id", GgufValue::u32(4))
      .add("tokenizer.ggml.eos_token_id", GgufValue::u32(99999))  // out of range: the default, 2
      .add("tokenizer.ggml.unknown_token_id", GgufValue::u32(3))
      .add("tokenizer.ggml.add_bos_token", GgufValue::boolean(false))
      .add("tokenizer.ggml.add_space_prefix", GgufValue::boolean(false));
  writer.write(file.path());
  const Vocab vocab = Vocab::from_gguf(gguf::File::open(file.path()));
  EXPECT_EQ(vocab.bos, 4);
  EXPECT_EQ(vocab.eos, 2);
  EXPECT_EQ(vocab.unk, 3);
  EXPECT_FALSE(vocab.add_bos);
  EXPECT_FALSE(vocab.add_space_prefix);
  EXPECT_TRUE(vocab.strip_after_special);  // "phi3" in general.name
  const Tokenizer tokenizer(vocab);
  EXPECT_EQ(tokenizer.encode("hi", false), (std::vector<Token>{tokenizer.find("hi")}));
}

TEST(VocabFromGguf, LlamaVocabularyErrorsNameTheKey) {
  using support::GgufValue;
  const Vocab vocab = toy_spm_vocab();
  std::vector<std::int32_t> types;
  for (const TokenType type : vocab.types) types.push_back(static_cast<std::int32_t>(type));
  const auto without_scores = [&] {
    support::GgufWriter writer;
    writer.add("tokenizer.ggml.model", GgufValue::str("llama"))
        .add("tokenizer.ggml.tokens", GgufValue::str_array(vocab.tokens))
        .add("tokenizer.ggml.token_type", GgufValue::i32_array(types));
    return writer;
  };
  const std::string missing = gguf_error(without_scores());
  EXPECT_NE(missing.find("tokenizer.ggml.scores"), std::string::npos) << missing;
  EXPECT_NE(missing.find(".gguf"), std::string::npos) << missing;

  support::GgufWriter short_scores = without_scores();
  const std::vector<float> fewer(vocab.scores.begin(), vocab.scores.end() - 1);
  short_scores.add("tokenizer.ggml.scores", GgufValue::f32_array(fewer));
  const std::string short_message = gguf_error(short_scores);
  EXPECT_NE(short_message.find("tokenizer.ggml.scores"), std::string::npos) << short_message;
  EXPECT_NE(short_message.find("entries for"), std::string::npos) << short_message;

  support::GgufWriter string_scores = without_scores();
  string_scores.add("tokenizer.ggml.scores", GgufValue::str_array(vocab.tokens));
  const std::string wrong = gguf_error(string_scores);
  EXPECT_NE(wrong.find("tokenizer.ggml.scores"), std::string::npos) << wrong;

  // llama.cpp also takes integer scores.
  support::GgufWriter integer_scores = without_scores();
  const std::vector<std::int32_t> integers(vocab.tokens.size(), -1);
  integer_scores.add("tokenizer.ggml.scores", GgufValue::i32_array(integers));
  EXPECT_EQ(gguf_error(integer_scores), "(no gguf::Error)");
}

// --- The real SmolLM2 vocabulary ------------------------------------------------------------------

// Expected ids were checked against Hugging Face `tokenizers` built from this GGUF's vocabulary
// and merges with SmolLM2's pre-tokenizer (digits split individually, then byte-level GPT-2),
// which llama.cpp reproduces; the golden-file test compares with llama.cpp itself.
class SmolLM2Tokenizer : public ::testing::Test {
 protected:
  static std::filesystem::path model_path() {
    return std::filesystem::path(BATCHLM_SOURCE_DIR) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
  }

  static void SetUpTestSuite() {
    if (!std::filesystem::exists(model_path())) return;
    vocab_ = std::make_unique<Vocab>(Vocab::from_gguf(gguf::File::open(model_path())));
    tokenizer_ = std::make_unique<Tokenizer>(*vocab_);
  }
  static void TearDownTestSuite() {
    tokenizer_.reset();
    vocab_.reset();
  }

  void SetUp() override {
    if (!tokenizer_) GTEST_SKIP() << "model not found: " << model_path() << " (download SmolLM2-135M-Instruct.Q4_1.gguf into models/)";
  }

  const Tokenizer& tokenizer() const { return *tokenizer_; }

  static std::unique_ptr<Vocab> vocab_;
  static std::unique_ptr<Tokenizer> tokenizer_;
};

std::unique_ptr<Vocab> SmolLM2Tokenizer::vocab_;
std::unique_ptr<Tokenizer> SmolLM2Tokenizer::tokenizer_;

TEST_F(SmolLM2Tokenizer, ReadsTheVocabularyMetadata) {
  const Vocab& vocab = tokenizer().vocab();
  EXPECT_EQ(vocab.model, "gpt2");
  EXPECT_EQ(vocab.pre, "smollm");
  EXPECT_EQ(tokenizer().size(), 49152u);
  EXPECT_EQ(vocab.merges.size(), 48900u);
  EXPECT_EQ(vocab.bos, 1);
  EXPECT_EQ(vocab.eos, 2);
  EXPECT_EQ(vocab.unk, 0);
  EXPECT_EQ(vocab.pad, 2);
  EXPECT_EQ(vocab.eot, 2);  // <|im_end|>, found by its text
  EXPECT_FALSE(tokenizer().add_bos());
  EXPECT_EQ(tokenizer().find("<|im_start|>"), 1);
  // llama.cpp's end-of-generation set for this vocabulary: <|endoftext|>, <|im_end|>, <reponame>.
  std::vector<Token> end_of_generation;
  for (Token t = 0; t < static_cast<Token>(tokenizer().size()); ++t) {
    if (tokenizer().is_end_of_generation(t)) end_of_generation.push_back(t);
  }
  EXPECT_EQ(end_of_generation, (std::vector<Token>{0, 2, 4}));
}

TEST_F(SmolLM2Tokenizer, EncodesKnownTexts) {
  EXPECT_EQ(tokenizer().encode("Hello world", false), (std::vector<Token>{19556, 905}));
  EXPECT_EQ(tokenizer().token_bytes(905), " world");
  // Every digit is a token of its own.
  EXPECT_EQ(tokenizer().encode("12345", false), (std::vector<Token>{33, 34, 35, 36, 37}));
  EXPECT_EQ(tokenizer().encode("I'm here, aren't you?", false),
            (std::vector<Token>{57, 5248, 1535, 28, 4775, 982, 346, 47}));
  EXPECT_EQ(tokenizer().encode("  indented\n\n", false), (std::vector<Token>{216, 641, 6574, 1116}));
  EXPECT_EQ(tokenizer().encode("café 😀", false), (std::vector<Token>{83, 1939, 2756, 40303, 218}));
  EXPECT_EQ(tokenizer().encode("日本語", false), (std::vector<Token>{23274, 115, 40993, 179, 120, 248}));
}

TEST_F(SmolLM2Tokenizer, ParsesChatMLSpecialTokens) {
  EXPECT_EQ(tokenizer().encode("<|im_start|>user\nHi!<|im_end|>\n", true),
            (std::vector<Token>{1, 4093, 198, 26843, 17, 2, 198}));
  EXPECT_EQ(tokenizer().encode("<|im_start|>", false), (std::vector<Token>{44, 108, 306, 79, 3738, 108, 46}));
}

TEST_F(SmolLM2Tokenizer, RoundTripsVariedText) {
  for (const std::string text : {
           "The quick brown fox jumps over the lazy dog.", "日本語のテキストです。中文测试。한국어",
           "Emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷", "Accents: café naïve résumé Ångström", "tabs\tand   spaces \t\n  end  ",
           "def f(x):\n    return x**2 + 3.14159  # comment\n", "Numbers 1,234,567.89 ²³ ٣٤٥",
           "a\u00a0b\u2003c\u3000d\u0085e", "\n\n\n", "   ", "!!!???..."}) {
    EXPECT_EQ(tokenizer().decode(tokenizer().encode(text, false)), text);
  }
  // Bytes that are no character come back as U+FFFD, one for each, as llama.cpp reads them.
  EXPECT_EQ(tokenizer().decode(tokenizer().encode("\xe2\x82 invalid \xc3", false)),
            "\xEF\xBF\xBD\xEF\xBF\xBD invalid \xEF\xBF\xBD");
}

TEST_F(SmolLM2Tokenizer, DropsBytesTheVocabularyHasNoTokenFor) {
  // SmolLM2 has no token for 0x04 (nor for 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1,
  // 0xF2, 0xF5..0xFF); llama.cpp drops such a byte where the text holds it as a character.
  EXPECT_EQ(tokenizer().encode("a\x04" "b", false), (std::vector<Token>{81, 82}));
  // 0xFF is no character: llama.cpp reads it as U+FFFD, which has tokens, so it is not lost.
  const std::vector<Token> replacement = tokenizer().encode("\xEF\xBF\xBD", false);
  ASSERT_FALSE(replacement.empty());
  EXPECT_EQ(tokenizer().encode("\xff", false), replacement);
  EXPECT_EQ(tokenizer().encode("\xf8\xf9", false).size(), 2 * replacement.size());
}

TEST_F(SmolLM2Tokenizer, StreamsAnEmojiSplitAcrossTokens) {
  // 😀 ends up split between " \xF0\x9F\x98" (40303) and "\x80" (218).
  const std::vector<Token> tokens = tokenizer().encode("café 😀!", false);
  StreamDecoder decoder(tokenizer());
  std::vector<std::string> chunks;
  for (const Token t : tokens) chunks.push_back(decoder.push(t));
  ASSERT_EQ(chunks.size(), 6u);
  EXPECT_EQ(chunks[3], " ");  // the space goes out, the emoji's first three bytes wait
  EXPECT_EQ(chunks[4], "😀");
  std::string all;
  for (const std::string& chunk : chunks) all += chunk;
  EXPECT_EQ(all + decoder.finish(), "café 😀!");
}

TEST_F(SmolLM2Tokenizer, ChatTemplateFromTheFile) {
  const ChatTemplate chat = ChatTemplate::from_vocab(tokenizer().vocab());
  EXPECT_EQ(chat.default_system(), "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  const std::vector<ChatMessage> messages = {{"user", "Hi"}};
  const std::string prompt = chat.apply(messages, true);
  const std::vector<Token> tokens = tokenizer().encode(prompt, true);
  EXPECT_EQ(tokens.front(), 1);
  EXPECT_EQ(tokenizer().decode(tokens, true), prompt);
}

}  // namespace
}  // namespace batchlm::local_engine
