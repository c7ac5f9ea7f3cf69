// The tokenizer against llama.cpp's own tokenizer tests: for each vocabulary,
// models/vocab/ggml-vocab-NAME.gguf (the vocabulary of a model family, without weights),
// .gguf.inp (texts) and .gguf.out (the ids llama.cpp's test-tokenizer-0 expects for them), as
// scripts/fetch-vocabs.sh extracts them from the llama.cpp that llama-cpp-python 0.3.36 vendors.
// Skipped (not passed) when the files have not been fetched.
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

// The parameter is llama.cpp's name for the vocabulary, which is also its tokenizer.ggml.pre.
class LlamaCppVocab : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaCppVocab, EncodesEveryTestTextAsLlamaCppDoes) {
  const std::string name = GetParam();
  const fs::path vocab_path = kVocabDir / ("ggml-vocab-" + name + ".gguf");
  const fs::path inp_path = fs::path(vocab_path).concat(".inp");
  const fs::path out_path = fs::path(vocab_path).concat(".out");
  for (const fs::path& path : {vocab_path, inp_path, out_path}) {
    if (!fs::exists(path)) GTEST_SKIP() << path << " is absent (scripts/fetch-vocabs.sh fetches it)";
  }

  const Tokenizer tokenizer(Vocab::from_gguf(gguf::File::open(vocab_path)));
  EXPECT_EQ(tokenizer.vocab().model, "gpt2");
  EXPECT_EQ(tokenizer.vocab().pre, name);

  const std::vector<std::string> texts = read_texts(inp_path);
  const std::vector<std::vector<Token>> expected = read_ids(out_path);
  ASSERT_EQ(texts.size(), expected.size()) << inp_path << " and " << out_path << " hold different numbers of tests";
  ASSERT_GE(texts.size(), 30u) << inp_path;

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

INSTANTIATE_TEST_SUITE_P(LlamaCpp, LlamaCppVocab,
                         ::testing::Values("gpt-2", "llama-bpe", "qwen2", "refact", "starcoder"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string test_name = info.param;
                           for (char& c : test_name) {
                             if (c == '-') c = '_';
                           }
                           return test_name;
                         });

}  // namespace
}  // namespace batchlm::local_engine
