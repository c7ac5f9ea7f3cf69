// The Tekken and GPT-4o (o200k) pre-tokenizers against llama.cpp: the ids it gives for 1,833
// texts (its own tokenizer test texts, texts written for these patterns, seeded random strings)
// with a vocabulary in which any two bytes merge, so that a text split anywhere else mostly
// gets other ids. tests/reference/make_pretokenizer_goldens.py wrote
// tests/reference/pretokenizers/tokenize.json; the vocabulary is written again here
// (byte_pair_vocab, as tiny_gguf --vocab writes it) and must be the goldens' file byte for byte.

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "batchlm/local_engine/gguf.hpp"
#include "batchlm/local_engine/tokenizer.hpp"
#include "gguf_writer.hpp"
#include "requantize.hpp"

namespace batchlm::local_engine {
namespace {

namespace fs = std::filesystem;

const nlohmann::json& goldens() {
  static const nlohmann::json json = [] {
    const fs::path path = fs::path(BATCHLM_SOURCE_DIR) / "tests/reference/pretokenizers/tokenize.json";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path.string());
    return nlohmann::json::parse(in);
  }();
  return json;
}

// The text as a JSON string, so that whitespace and control characters show.
std::string quoted(const std::string& text) { return nlohmann::json(text).dump(); }

// The byte-pair vocabulary with tokenizer.ggml.pre = pre, as a file and read back; its sha256.
struct Written {
  Tokenizer tokenizer;
  std::string sha256;
};

Written write_and_load(const std::string& pre) {
  const fs::path dir = testing::fresh_dir("pretokenizer");
  const fs::path path = dir / (pre + ".gguf");
  testing::write_vocab_gguf(path, testing::byte_pair_vocab(), pre);
  Written written{Tokenizer(Vocab::from_gguf(gguf::File::open(path))), testing::sha256_file(path)};
  fs::remove_all(dir);
  return written;
}

// Encodes every text and compares with `expected`, showing the first few texts that differ.
void expect_ids(const Tokenizer& tokenizer, const std::string& name, const nlohmann::json& expected) {
  const nlohmann::json& texts = goldens()["texts"];
  ASSERT_EQ(texts.size(), expected.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::string text = texts[i];
    const std::vector<Token> tokens = tokenizer.encode(text, /*parse_special=*/false);
    if (tokens != expected[i].get<std::vector<Token>>() && ++differ <= 5) {
      ADD_FAILURE() << name << ", text " << i << ": " << quoted(text) << "\n  ours:  " << nlohmann::json(tokens).dump()
                    << "\n  llama: " << expected[i].dump();
    }
    // Valid UTF-8 without special-token text: the ids spell it exactly.
    EXPECT_EQ(tokenizer.decode(tokens), text) << name << ", text " << i;
  }
  EXPECT_EQ(differ, 0u) << name << ": " << differ << " of " << texts.size() << " texts get other ids than llama.cpp's";
}

class PreTokenizerGoldens : public ::testing::TestWithParam<std::string> {};

TEST_P(PreTokenizerGoldens, EncodesEveryTextAsLlamaCppDoes) {
  const std::string pre = GetParam();
  const nlohmann::json& golden = goldens()["pretokenizers"][pre];
  ASSERT_GE(goldens()["texts"].size(), 1800u);
  const Written written = write_and_load(pre);
  ASSERT_EQ(written.sha256, golden["vocab_sha256"])
      << "the byte-pair vocabulary is not the goldens' (regenerate them: tests/reference/README.md)";
  EXPECT_EQ(written.tokenizer.vocab().pre, pre);
  // The file has no add_bos_token; llama.cpp adds a BOS for Tekken, not for GPT-4o.
  EXPECT_EQ(written.tokenizer.add_bos(), golden["add_bos"].get<bool>());
  expect_ids(written.tokenizer, pre, golden["ids"]);
}

INSTANTIATE_TEST_SUITE_P(LlamaCpp, PreTokenizerGoldens, ::testing::Values("tekken", "gpt-4o"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param == "gpt-4o" ? std::string("gpt_4o") : info.param;
                         });

// llama.cpp runs the same pattern for these names (the goldens' script checked that its ids are
// gpt-4o's on every text).
TEST(PreTokenizerAliases, SplitAsGpt4o) {
  const nlohmann::json& aliases = goldens()["gpt-4o_aliases"];
  ASSERT_EQ(aliases, nlohmann::json({"llama4", "kanana2", "talkie", "minimax-m2"}));
  for (const std::string alias : aliases) {
    const Written written = write_and_load(alias);
    EXPECT_FALSE(written.tokenizer.add_bos()) << alias;
    expect_ids(written.tokenizer, alias, goldens()["pretokenizers"]["gpt-4o"]["ids"]);
  }
}

}  // namespace
}  // namespace batchlm::local_engine
