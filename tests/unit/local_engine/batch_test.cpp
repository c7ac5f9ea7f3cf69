// Continuous batching at the model level: several sequences in one forward pass, their keys and
// values scattered over a shuffled pool of blocks, give the same logits and the same greedy
// tokens as each sequence run alone with its own contiguous cache.

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/engine.hpp"
#include "batchlm/local_engine/model.hpp"
#include "gguf_writer.hpp"

namespace {

using namespace batchlm::local_engine;
namespace fs = std::filesystem;

struct Alone {
  std::vector<Token> tokens;               // greedy continuation
  std::vector<std::vector<float>> logits;  // at each step
};

Alone run_alone(const Model& m, const std::vector<Token>& prompt, int steps,
                batchlm::kernels::ThreadPool& pool) {
  Alone out;
  KvCache cache(m.config(), 256);
  std::vector<float> logits(m.config().n_vocab);
  m.forward(prompt, cache, logits, false, pool);
  for (int i = 0; i < steps; ++i) {
    out.logits.push_back(logits);
    const Token t = static_cast<Token>(batchlm::kernels::argmax(logits.data(), logits.size()));
    out.tokens.push_back(t);
    const Token one[1] = {t};
    m.forward(one, cache, logits, false, pool);
  }
  return out;
}

// Runs the prompts together: one batch with every prompt, then one batch per step with a token
// of each sequence; blocks of 8 positions handed out from a shuffled pool.
std::vector<Alone> run_batched(const Model& m, const std::vector<std::vector<Token>>& prompts,
                               int steps, batchlm::kernels::ThreadPool& pool) {
  const std::int64_t block = 8, n_blocks = 96;
  const KvStore store(m.config(), block, n_blocks);
  const KvPool& kv_pool = store.pool();
  std::vector<std::int32_t> free_blocks(n_blocks);
  for (std::int64_t i = 0; i < n_blocks; ++i) free_blocks[i] = static_cast<std::int32_t>(i);
  std::shuffle(free_blocks.begin(), free_blocks.end(), std::mt19937(3));

  const std::size_t n_seq = prompts.size();
  std::vector<std::vector<std::int32_t>> tables(n_seq);
  std::vector<std::int64_t> length(n_seq, 0);
  auto grow = [&](std::size_t s, std::int64_t positions) {
    while (static_cast<std::int64_t>(tables[s].size()) * block < positions) {
      tables[s].push_back(free_blocks.back());
      free_blocks.pop_back();
    }
  };
  std::vector<Alone> out(n_seq);
  std::vector<Token> tokens;
  std::vector<std::int32_t> positions, sequence_of, rows;
  auto run = [&] {
    std::vector<std::span<const std::int32_t>> spans(tables.begin(), tables.end());
    std::vector<float> logits(rows.size() * m.config().n_vocab);
    m.forward_batch(Batch{tokens, positions, sequence_of, spans, rows}, kv_pool, logits, pool);
    for (std::size_t s = 0; s < n_seq; ++s) {
      std::vector<float> l(logits.begin() + s * m.config().n_vocab,
                           logits.begin() + (s + 1) * m.config().n_vocab);
      out[s].tokens.push_back(static_cast<Token>(batchlm::kernels::argmax(l.data(), l.size())));
      out[s].logits.push_back(std::move(l));
    }
    tokens.clear(), positions.clear(), sequence_of.clear(), rows.clear();
  };
  for (std::size_t s = 0; s < n_seq; ++s) {
    grow(s, static_cast<std::int64_t>(prompts[s].size()));
    for (std::size_t i = 0; i < prompts[s].size(); ++i) {
      tokens.push_back(prompts[s][i]);
      positions.push_back(static_cast<std::int32_t>(i));
      sequence_of.push_back(static_cast<std::int32_t>(s));
    }
    rows.push_back(static_cast<std::int32_t>(tokens.size() - 1));
    length[s] = static_cast<std::int64_t>(prompts[s].size());
  }
  run();
  for (int step = 1; step < steps; ++step) {
    for (std::size_t s = 0; s < n_seq; ++s) {
      grow(s, length[s] + 1);
      tokens.push_back(out[s].tokens.back());
      positions.push_back(static_cast<std::int32_t>(length[s]++));
      sequence_of.push_back(static_cast<std::int32_t>(s));
      rows.push_back(static_cast<std::int32_t>(tokens.size() - 1));
    }
    run();
  }
  return out;
}

void expect_same(const std::vector<Alone>& alone, const std::vector<Alone>& batched) {
  for (std::size_t s = 0; s < alone.size(); ++s) {
    EXPECT_EQ(batched[s].tokens, alone[s].tokens) << "sequence " << s;
    for (std::size_t i = 0; i < alone[s].logits.size(); ++i) {
      float diff = 0;
      for (std::size_t j = 0; j < alone[s].logits[i].size(); ++j)
        diff = std::max(diff, std::fabs(alone[s].logits[i][j] - batched[s].logits[i][j]));
      EXPECT_LE(diff, 1e-5f) << "sequence " << s << " step " << i;
    }
  }
}

TEST(BatchedForward, TinyModelsMatchOneSequenceAtATime) {
  const fs::path dir = fs::temp_directory_path() / ("batchlm-batch-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  // (The K types, which need wider models, in quant_types_model_test.cpp.)
  for (auto type : {batchlm::kernels::DType::F32, batchlm::kernels::DType::Q4_1,
                    batchlm::kernels::DType::Q8_0, batchlm::kernels::DType::Q5_0,
                    batchlm::kernels::DType::Q5_1}) {
    batchlm::testing::TinyLlamaOptions options;
    options.weight_dtype = type;
    options.embedding_dtype = type == batchlm::kernels::DType::F32 ? type : batchlm::kernels::DType::Q8_0;
    const fs::path path = dir / ("tiny-" + std::string(batchlm::kernels::to_string(type)) + ".gguf");
    batchlm::testing::write_tiny_llama(path, options);
    const auto m = Model::load(path);
    batchlm::kernels::ThreadPool pool(2);
    const std::vector<std::vector<Token>> prompts = {
        m->tokenizer().encode("Hello world, the and ing", true),
        m->tokenizer().encode("<|im_start|>user\nHi there<|im_end|>\n", true),
        m->tokenizer().encode("a", true)};
    std::vector<Alone> alone;
    for (const auto& p : prompts) alone.push_back(run_alone(*m, p, 12, pool));
    expect_same(alone, run_batched(*m, prompts, 12, pool));
  }
  fs::remove_all(dir);
}

TEST(BatchedForward, RealModelMatchesOneSequenceAtATime) {
  const fs::path path = fs::path(BATCHLM_SOURCE_DIR) / "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(path)) GTEST_SKIP() << path << " is absent (scripts/fetch-model.sh fetches it)";
  const auto m = Model::load(path);
  batchlm::kernels::ThreadPool pool(2);
  const std::vector<std::vector<Token>> prompts = {
      m->tokenizer().encode("Once upon a time, in a small village by the sea,", true),
      m->tokenizer().encode("<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n", true),
      m->tokenizer().encode("def fibonacci(n):", true)};
  std::vector<Alone> alone;
  for (const auto& p : prompts) alone.push_back(run_alone(*m, p, 16, pool));
  expect_same(alone, run_batched(*m, prompts, 16, pool));
}

// The engine keeps the cache of the previous request: a prompt sharing its prefix computes only
// the rest, and generates exactly what a fresh engine generates.
TEST(Engine, ReusesTheSharedPrefixOfThePreviousRequest) {
  const fs::path dir = fs::temp_directory_path() / ("batchlm-prefix-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  batchlm::testing::TinyLlamaOptions options;
  options.weight_dtype = batchlm::kernels::DType::Q4_1;
  options.embedding_dtype = batchlm::kernels::DType::Q8_0;
  batchlm::testing::write_tiny_llama(dir / "tiny.gguf", options);
  const std::shared_ptr<const Model> m = Model::load(dir / "tiny.gguf");
  GenerateParams params;
  params.max_tokens = 10;
  params.sampling.temperature = 0;
  params.ignore_eos = true;
  const std::string shared = "Hello world, the and ing. Hello world, the and ing. ";
  Engine warm(m, EngineOptions{2, 256});
  const auto first = warm.generate(warm.text_prompt(shared + "first"), params, nullptr);
  EXPECT_EQ(first.stats.cached_prompt_tokens, 0);
  const auto prompt = warm.text_prompt(shared + "second one");
  const auto second = warm.generate(prompt, params, nullptr);
  EXPECT_GT(second.stats.cached_prompt_tokens, 10);
  EXPECT_LT(second.stats.cached_prompt_tokens, second.stats.prompt_tokens);
  // The same prompt again reuses all but its last token.
  const auto again = warm.generate(prompt, params, nullptr);
  EXPECT_EQ(again.stats.cached_prompt_tokens, again.stats.prompt_tokens - 1);
  Engine fresh(m, EngineOptions{2, 256});
  const auto reference = fresh.generate(prompt, params, nullptr);
  EXPECT_EQ(second.text, reference.text);
  EXPECT_EQ(again.text, reference.text);
  fs::remove_all(dir);
}

TEST(BatchedForward, RejectsAnInconsistentBatch) {
  const fs::path dir = fs::temp_directory_path() / ("batchlm-batch-bad-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  batchlm::testing::write_tiny_llama(dir / "tiny.gguf");
  const auto m = Model::load(dir / "tiny.gguf");
  batchlm::kernels::ThreadPool pool(1);
  const KvStore store(m->config(), 4, 2);  // blocks of 4 positions, 2 of them
  const KvPool& kv = store.pool();
  const std::int32_t table[1] = {1};
  const std::span<const std::int32_t> tables[1] = {table};
  const Token tokens[2] = {3, 4};
  const std::int32_t seq[2] = {0, 0};
  std::vector<float> logits(m->config().n_vocab);
  const std::int32_t beyond[2] = {3, 4};  // position 4 needs a second block
  const std::int32_t last[1] = {1};
  EXPECT_THROW(m->forward_batch(Batch{tokens, beyond, seq, tables, last}, kv, logits, pool),
               std::invalid_argument);
  const std::int32_t outside[1] = {7};
  const std::span<const std::int32_t> bad_tables[1] = {outside};
  const std::int32_t ok_pos[2] = {0, 1};
  EXPECT_THROW(m->forward_batch(Batch{tokens, ok_pos, seq, bad_tables, last}, kv, logits, pool),
               std::invalid_argument);
  const std::int32_t unordered[2] = {1, 0};
  std::vector<float> two(2 * m->config().n_vocab);
  EXPECT_THROW(m->forward_batch(Batch{tokens, ok_pos, seq, tables, unordered}, kv, two, pool),
               std::invalid_argument);
  EXPECT_NO_THROW(m->forward_batch(Batch{tokens, ok_pos, seq, tables, last}, kv, logits, pool));
  fs::remove_all(dir);
}

}  // namespace
