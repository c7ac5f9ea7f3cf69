// The tokenizer against llama.cpp's own tokenizer tests: for each vocabulary,
// models/vocab/ggml-vocab-NAME.gguf (the vocabulary of a model family, without weights),
// .gguf.inp (texts) and .gguf.out (the ids llama.cpp's test-tokenizer-0 expects for them), as
// scripts/fetch-vocabs.sh extracts them from the llama.cpp that llama-cpp-python 0.3.36 vendors.
// Skipped (not passed) when the files have not been fetched. The byte-level BPE vocabularies
// (gpt-2, llama-bpe, qwen2, refact, starcoder) and the SentencePiece ones (llama-spm, the
// vocabulary of LLaMA and Llama 2, and phi-3) share the same texts.
//
// The format, as test-tokenizer-0 reads it: the texts are the .inp file cut at every
// "\n__ggml_vocab_test__\n", untrimmed (several are whitespace only; one is empty); line i of
// .out holds the ids of text i, separated by spaces. Texts are tokenized with neither BOS nor
// special-token parsing.

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "batchlm/local_engine/gguf.hpp"
#include "batchlm/local_engine/tokenizer.hpp"

namespace batchlm::local_engine {
namespace {

namespace fs = std::filesystem;

const fs::path kVocabDir = fs::path(BATCHLM_SOURCE_DIR) / "models/vocab";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> read_texts(const fs::path& path) {
  constexpr std::string_view kSeparator = "\n__ggml_vocab_test__\n";
  const std::string all = read_file(path);
  std::vector<std::string> texts;
  for (std::size_t position = 0; position < all.size();) {
    const std::size_t next = all.find(kSeparator, position);
    if (next == std::string::npos) {
      texts.push_back(all.substr(position));
      break;
    }
    texts.push_back(all.substr(position, next - position));
    position = next + kSeparator.size();
  }
  return texts;
}

// The text as a JSON string, so that whitespace and control characters show.
std::string quoted(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::vector<std::vector<Token>> read_ids(const fs::path& path) {
  std::ifstream in(path);
  std::vector<std::vector<Token>> ids;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::vector<Token>& tokens = ids.emplace_back();
    for (Token t; fields >> t;) tokens.push_back(t);
  }
  return ids;
}

fs::path vocab_path(const std::string& name) { return kVocabDir / ("ggml-vocab-" + name + ".gguf"); }

// Whether the vocabulary and its tests are there; the skip message names the first one absent.
::testing::AssertionResult fetched(const std::string& name) {
  const fs::path vocab = vocab_path(name);
  for (const fs::path& path : {vocab, fs::path(vocab).concat(".inp"), fs::path(vocab).concat(".out")}) {
    if (!fs::exists(path)) {
      return ::testing::AssertionFailure() << path << " is absent (scripts/fetch-vocabs.sh fetches it)";
    }
  }
  return ::testing::AssertionSuccess();
}

struct TestTexts {
  std::vector<std::string> texts;
  std::vector<std::vector<Token>> ids;  // llama.cpp's, text by text
};

TestTexts read_tests(const std::string& name) {
  const fs::path inp_path = fs::path(vocab_path(name)).concat(".inp");
  const fs::path out_path = fs::path(vocab_path(name)).concat(".out");
  TestTexts tests{read_texts(inp_path), read_ids(out_path)};
  EXPECT_EQ(tests.texts.size(), tests.ids.size()) << inp_path << " and " << out_path << " hold different numbers of tests";
  EXPECT_GE(tests.texts.size(), 30u) << inp_path;
  return tests;
}

// The parameter is llama.cpp's name for the vocabulary, which is also its tokenizer.ggml.pre.
class LlamaCppVocab : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaCppVocab, EncodesEveryTestTextAsLlamaCppDoes) {
  const std::string name = GetParam();
  if (const auto present = fetched(name); !present) GTEST_SKIP() << present.message();

  const Tokenizer tokenizer(Vocab::from_gguf(gguf::File::open(vocab_path(name))));
  EXPECT_EQ(tokenizer.vocab().model, "gpt2");
  EXPECT_EQ(tokenizer.vocab().pre, name);

  const TestTexts tests = read_tests(name);
  const std::vector<std::string>& texts = tests.texts;
  const std::vector<std::vector<Token>>& expected = tests.ids;
  ASSERT_EQ(texts.size(), expected.size());

  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::string& text = texts[i];
    const std::vector<Token> tokens = tokenizer.encode(text, /*parse_special=*/false);
    EXPECT_EQ(tokens, expected[i]) << name << ", test " << i << ": " << quoted(text);
    // Every text is valid UTF-8 without special-token text, so the ids spell it exactly.
    EXPECT_EQ(tokenizer.decode(tokens), text) << name << ", test " << i << ": " << quoted(text);
  }
}

// These files have no tokenizer.ggml.add_bos_token; as llama.cpp does, a BOS is added for Llama
// 3's pre-tokenizer and for none of the other BPE ones.
TEST(LlamaCppVocabBos, AddedForLlama3WithoutTheKey) {
  for (const auto& [name, add_bos] : {std::pair{"llama-bpe", true}, std::pair{"qwen2", false}, std::pair{"gpt-2", false}}) {
    const fs::path path = kVocabDir / ("ggml-vocab-" + std::string(name) + ".gguf");
    if (!fs::exists(path)) GTEST_SKIP() << path << " is absent (scripts/fetch-vocabs.sh fetches it)";
    const gguf::File file = gguf::File::open(path);
    ASSERT_FALSE(file.find("tokenizer.ggml.add_bos_token")) << name;
    const Tokenizer tokenizer(Vocab::from_gguf(file));
    EXPECT_EQ(tokenizer.add_bos(), add_bos) << name;
  }
}

std::string test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(LlamaCpp, LlamaCppVocab,
                         ::testing::Values("gpt-2", "llama-bpe", "qwen2", "refact", "starcoder"), test_name);

// --- SentencePiece ------------------------------------------------------------------------------

// The text llama.cpp's llama_detokenize(tokens, remove_special = false, unparse_special = false)
// gives, which test-tokenizer-0 checks its ids against: the pieces joined, except that with
// add_space_prefix the first token's piece loses one leading space (its "remove_space": the
// prefix encode() put there). A first token that renders empty, such as a BOS, ends that.
std::string llama_detokenize(const Tokenizer& tokenizer, const std::vector<Token>& tokens) {
  std::string text = tokenizer.decode(tokens);
  if (tokenizer.vocab().add_space_prefix && !tokens.empty() && tokenizer.token_bytes(tokens[0]).starts_with(' ')) {
    text.erase(0, 1);
  }
  return text;
}

// The text a StreamDecoder gives for the tokens.
std::string streamed(const Tokenizer& tokenizer, const std::vector<Token>& tokens) {
  StreamDecoder decoder(tokenizer);
  std::string text;
  for (const Token t : tokens) text += decoder.push(t);
  return text + decoder.finish();
}

// llama-spm and phi-3: tokenizer.ggml.model "llama", pre "default".
class LlamaCppSpmVocab : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaCppSpmVocab, EncodesEveryTestTextAsLlamaCppDoes) {
  const std::string name = GetParam();
  if (const auto present = fetched(name); !present) GTEST_SKIP() << present.message();

  const Tokenizer tokenizer(Vocab::from_gguf(gguf::File::open(vocab_path(name))));
  EXPECT_EQ(tokenizer.vocab().model, "llama");
  EXPECT_TRUE(tokenizer.vocab().add_space_prefix);  // no key: llama.cpp's default

  const TestTexts tests = read_tests(name);
  ASSERT_EQ(tests.texts.size(), tests.ids.size());
  for (std::size_t i = 0; i < tests.texts.size(); ++i) {
    const std::string& text = tests.texts[i];
    const std::vector<Token> tokens = tokenizer.encode(text, /*parse_special=*/false);
    EXPECT_EQ(tokens, tests.ids[i]) << name << ", test " << i << ": " << quoted(text);
  }
}

// Every text is valid UTF-8 without special-token text or U+2581, so llama.cpp's ids give it
// back exactly through llama_detokenize; the pieces themselves, as decode() and a stream join
// them, start with the space that add_space_prefix put in front.
TEST_P(LlamaCppSpmVocab, DecodesLlamaCppsIdsAsLlamaCppDoes) {
  const std::string name = GetParam();
  if (const auto present = fetched(name); !present) GTEST_SKIP() << present.message();

  const Tokenizer tokenizer(Vocab::from_gguf(gguf::File::open(vocab_path(name))));
  const TestTexts tests = read_tests(name);
  ASSERT_EQ(tests.texts.size(), tests.ids.size());
  for (std::size_t i = 0; i < tests.texts.size(); ++i) {
    const std::string& text = tests.texts[i];
    const std::vector<Token>& tokens = tests.ids[i];
    const std::string spaced = text.empty() ? "" : " " + text;
    EXPECT_EQ(tokenizer.decode(tokens), spaced) << name << ", test " << i << ": " << quoted(text);
    EXPECT_EQ(llama_detokenize(tokenizer, tokens), text) << name << ", test " << i << ": " << quoted(text);
    EXPECT_EQ(streamed(tokenizer, tokens), spaced) << name << ", test " << i << ": " << quoted(text);
  }
}

INSTANTIATE_TEST_SUITE_P(LlamaCpp, LlamaCppSpmVocab, ::testing::Values("llama-spm", "phi-3"), test_name);

// Special tokens, which the test texts leave out. The ids and texts are what llama.cpp (the one
// llama-cpp-python 0.3.36 vendors, as bench/engine/setup-llama-server.sh builds it) gives for
// these vocabularies, loaded vocab_only, through llama_tokenize(add_special = false) and
// llama_detokenize.
struct SpecialCase {
  std::string text;
  bool parse_special;
  std::vector<Token> ids;
  std::string detokenized;  // llama_detokenize(ids, remove_special = false, unparse_special = true)
};

void expect_cases(const std::string& name, const std::vector<SpecialCase>& cases) {
  const Tokenizer tokenizer(Vocab::from_gguf(gguf::File::open(vocab_path(name))));
  for (const SpecialCase& c : cases) {
    const std::vector<Token> tokens = tokenizer.encode(c.text, c.parse_special);
    EXPECT_EQ(tokens, c.ids) << name << ": " << quoted(c.text) << ", parse_special " << c.parse_special;
    std::string detokenized = tokenizer.decode(tokens, /*render_special=*/true);
    if (!tokens.empty() && tokenizer.token_bytes(tokens[0], true).starts_with(' ')) detokenized.erase(0, 1);
    EXPECT_EQ(detokenized, c.detokenized) << name << ": " << quoted(c.text) << ", parse_special " << c.parse_special;
  }
}

TEST(LlamaCppSpmSpecialTokens, LlamaSpm) {
  if (const auto present = fetched("llama-spm"); !present) GTEST_SKIP() << present.message();
  expect_cases("llama-spm", {
      // A text after a special token gets the space prefix too; <s> and </s> are control tokens.
      {"<s>hi</s> there", true, {1, 7251, 2, 29871, 727}, "<s> hi</s>  there"},
      {"<s>hi</s> there", false, {529, 29879, 29958, 2918, 829, 29879, 29958, 727}, "<s>hi</s> there"},
      {"<s> hi", true, {1, 29871, 7251}, "<s>  hi"},
      {"hi<s>", true, {7251, 1}, "hi<s>"},
      {"<unk>x", true, {0, 921}, "<unk> x"},
      {" ", true, {259}, " "},
      // Invalid UTF-8: a lead byte takes the next bytes along, whatever they are, and the
      // symbol falls back to byte tokens (0xE2 'a' 0xFF); a truncated character likewise.
      {"\xE2" "a\xFF b", false, {29871, 229, 100, 258, 289}, "\xE2" "a\xFF b"},
      {"\xC3", false, {29871, 198}, "\xC3"},
      {"\xF0\x9F\xA6\x99 llama", false, {29871, 243, 162, 169, 156, 11148, 3304}, "\xF0\x9F\xA6\x99 llama"},
  });
}

TEST(LlamaCppSpmSpecialTokens, Phi3) {
  if (const auto present = fetched("phi-3"); !present) GTEST_SKIP() << present.message();
  const Vocab vocab = Vocab::from_gguf(gguf::File::open(vocab_path("phi-3")));
  EXPECT_TRUE(vocab.strip_after_special);  // general.name "Phi3"
  expect_cases("phi-3", {
      // The whitespace after <|system|>, <|end|>, <|user|> and <|assistant|> goes.
      {"<|system|>  \t\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n", true,
       {32006, 1522, 11473, 29889, 32007, 32010, 6324, 32007, 32001},
       "<|system|> Be brief.<|end|><|user|> Hi<|end|><|assistant|>"},
      // But not after <s>, <unk> or <|endoftext|>; "</s>", user-defined in the file, is a
      // control token to llama.cpp, so plain text without parse_special.
      {"<s> x</s>  y<unk> z", true, {1, 29871, 921, 2, 343, 0, 29871, 503}, "<s>  x</s> y<unk>  z"},
      {"<s> x</s>  y<unk> z", false, {529, 29879, 29958, 921, 829, 29879, 29958, 29871, 343, 29966, 2960, 29958, 503},
       "<s> x</s>  y<unk> z"},
      {"a</s>b", false, {263, 829, 29879, 29958, 29890}, "a</s>b"},
      {"a</s>b", true, {263, 2, 289}, "a</s> b"},
      {"<|endoftext|>  x", true, {32000, 259, 921}, "<|endoftext|>   x"},
  });
  const Tokenizer tokenizer(vocab);
  EXPECT_EQ(tokenizer.token_bytes(2), "");  // "</s>", control
  EXPECT_TRUE(tokenizer.is_end_of_generation(2));
  EXPECT_TRUE(tokenizer.is_end_of_generation(32000));  // eos, <|endoftext|>
  EXPECT_TRUE(tokenizer.is_end_of_generation(32007));  // <|end|>
  EXPECT_FALSE(tokenizer.is_end_of_generation(32001));
}

}  // namespace
}  // namespace batchlm::local_engine
