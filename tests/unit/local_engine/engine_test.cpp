// The engine on a random-weight tiny Llama (write_tiny_llama): generation limits, determinism,
// seeds, stop strings, cancellation and streaming; the Sampler and StopMatcher on their own;
// LocalBackend behind the Backend seam in an io_context (usage, concurrency, errors,
// per-operation cancellation).

#include "batchlm/local_engine/engine.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/system/system_error.hpp>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/local_backend.hpp"
#include "batchlm/local_engine/sampling.hpp"
#include "gguf_writer.hpp"

namespace batchlm::local_engine {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

// One tiny model for the whole program, in a directory removed at exit.
class TinyModelFile {
 public:
  static const TinyModelFile& get() {
    static const TinyModelFile instance;
    return instance;
  }
  const fs::path& path() const { return path_; }
  const std::shared_ptr<const Model>& model() const { return model_; }
  ~TinyModelFile() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

 private:
  TinyModelFile() {
    std::string tmpl = (fs::temp_directory_path() / "batchlm-engine-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
    path_ = dir_ / "tiny.gguf";
    batchlm::testing::write_tiny_llama(path_);
    model_ = Model::load(path_);
  }
  fs::path dir_, path_;
  std::shared_ptr<const Model> model_;
};

std::shared_ptr<const Model> tiny_model() { return TinyModelFile::get().model(); }

GenerateParams greedy(std::int64_t max_tokens) {
  GenerateParams p;
  p.max_tokens = max_tokens;
  p.sampling.temperature = 0;
  p.ignore_eos = true;
  return p;
}

// What generate() streamed, piece by piece.
struct Streamed {
  std::vector<std::string> pieces;
  std::string joined() const {
    std::string s;
    for (const auto& p : pieces) s += p;
    return s;
  }
};

GenerateResult generate(Engine& engine, std::string_view prompt, const GenerateParams& params,
                        Streamed* streamed = nullptr) {
  const std::vector<Token> tokens = engine.text_prompt(prompt);
  return engine.generate(tokens, params, [&](std::string_view piece) {
    if (streamed) streamed->pieces.emplace_back(piece);
    return true;
  });
}

// ---- Engine ----------------------------------------------------------------------------------

TEST(Engine, ContextDefaultsToTheTrainingContextAndIsCapped) {
  Engine whole(tiny_model(), EngineOptions{1, 0});
  EXPECT_EQ(whole.context(), 256);  // the tiny model's llama.context_length
  EXPECT_EQ(whole.threads(), 1);
  Engine small(tiny_model(), EngineOptions{1, 40});
  EXPECT_EQ(small.context(), 40);
  Engine large(tiny_model(), EngineOptions{1, 100000});
  EXPECT_EQ(large.context(), 256);
}

TEST(Engine, ChatPromptAppliesChatMl) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  const std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", "Hello world"}};
  const std::vector<Token> tokens = engine.chat_prompt(messages);
  const Tokenizer& tok = engine.model().tokenizer();
  EXPECT_EQ(tok.decode(tokens, /*render_special=*/true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n"
            "<|im_start|>assistant\n");
  ASSERT_FALSE(tokens.empty());
  EXPECT_EQ(tokens.front(), tok.find("<|im_start|>"));  // a special token, not its characters
  EXPECT_EQ(std::count(tokens.begin(), tokens.end(), tok.find("<|im_end|>")), 2);
}

// OpenAI's roles, as `batchlm serve` takes them: a developer message is a system message; a
// tool message is refused by name where the template does not list tools (it would render a
// turn the model never saw).
TEST(Engine, ChatPromptTakesDeveloperAsSystemAndRefusesToolMessages) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  const std::vector<ChatMessage> developer = {{"developer", "Be brief."}, {"user", "Hello world"}};
  const std::vector<ChatMessage> system = {{"system", "Be brief."}, {"user", "Hello world"}};
  EXPECT_EQ(engine.chat_prompt(developer), engine.chat_prompt(system));
  const std::vector<ChatMessage> tool = {{"user", "Hello"}, {"assistant", "Calling."}, {"tool", "42"}};
  try {
    engine.chat_prompt(tool);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "messages[2].role: a tool's result, but this model's chat template (chatml) does not list "
                           "tools; the embedded engine calls tools with templates that do, as Qwen 2.5's and Qwen 3's "
                           "(<tool_call> ... </tool_call>) and Llama 3.1's, 3.2's and 3.3's");
  }
}

TEST(Engine, MaxTokensStopsWithLengthAfterExactlyThatMany) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  for (std::int64_t n : {1, 2, 7, 20}) {
    const GenerateResult r = generate(engine, "Hello world", greedy(n));
    EXPECT_EQ(r.finish_reason, "length") << n;
    EXPECT_EQ(r.stats.generated_tokens, n);
    EXPECT_EQ(r.stats.decode_steps, n - 1);
    EXPECT_EQ(r.stats.prompt_tokens, static_cast<std::int64_t>(engine.text_prompt("Hello world").size()));
  }
}

TEST(Engine, NoMaxTokensRunsUntilTheContextIsFull) {
  Engine engine(tiny_model(), EngineOptions{1, 24});
  const auto n_prompt = static_cast<std::int64_t>(engine.text_prompt("Hello world").size());
  const GenerateResult r = generate(engine, "Hello world", greedy(0));
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_EQ(r.stats.generated_tokens, 24 - n_prompt);
  // A max_tokens beyond the room left is cut to it.
  const GenerateResult capped = generate(engine, "Hello world", greedy(1000));
  EXPECT_EQ(capped.stats.generated_tokens, 24 - n_prompt);
  EXPECT_EQ(capped.text, r.text);
}

TEST(Engine, PromptThatFillsTheContextThrowsInvalidArgument) {
  Engine engine(tiny_model(), EngineOptions{1, 16});
  const std::vector<Token> fits(15, 40);   // leaves room for one token
  const std::vector<Token> full(16, 40);
  const std::vector<Token> longer(100, 40);
  const GenerateResult r = engine.generate(fits, greedy(10), nullptr);
  EXPECT_EQ(r.stats.generated_tokens, 1);
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_THROW(engine.generate(full, greedy(10), nullptr), std::invalid_argument);
  EXPECT_THROW(engine.generate(longer, greedy(10), nullptr), std::invalid_argument);
  EXPECT_THROW(engine.generate(std::vector<Token>{}, greedy(10), nullptr), std::invalid_argument);
  // The engine still works after the errors.
  EXPECT_EQ(engine.generate(fits, greedy(10), nullptr).text, r.text);
}

TEST(Engine, PromptLongerThanOneBatchIsSplit) {
  // More than Model::kMaxBatch prompt tokens go through forward() in chunks.
  const fs::path dir = TinyModelFile::get().path().parent_path();
  batchlm::testing::TinyLlamaOptions options;
  options.context_length = 1024;
  batchlm::testing::write_tiny_llama(dir / "long.gguf", options);
  auto model = Model::load(dir / "long.gguf");
  Engine engine(model, EngineOptions{2, 0});
  std::vector<Token> prompt(Model::kMaxBatch + 100);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<Token>(3 + i % 250);
  const GenerateResult r = engine.generate(prompt, greedy(4), nullptr);
  EXPECT_EQ(r.stats.prompt_tokens, Model::kMaxBatch + 100);
  EXPECT_EQ(r.stats.generated_tokens, 4);

  // The same as running the prompt through the model in chunks of another size and decoding
  // greedily by hand.
  KvCache cache(model->config(), 1024);
  const std::int64_t V = model->config().n_vocab;
  std::vector<float> logits(static_cast<std::size_t>(V));
  kernels::ThreadPool pool(2);
  for (std::size_t i = 0; i < prompt.size(); i += 100) {
    const std::size_t n = std::min<std::size_t>(100, prompt.size() - i);
    model->forward(std::span<const Token>(prompt).subspan(i, n), cache, logits, false, pool);
  }
  StreamDecoder decoder(model->tokenizer());
  std::string text;
  for (int step = 0; step < 4; ++step) {
    const Token next[1] = {static_cast<Token>(kernels::argmax(logits.data(), V))};
    text += decoder.push(next[0]);
    if (step < 3) model->forward(next, cache, logits, false, pool);
  }
  text += decoder.finish();
  EXPECT_EQ(r.text, text);
}

TEST(Engine, GreedyIsDeterministic) {
  Engine a(tiny_model(), EngineOptions{1, 0});
  Engine b(tiny_model(), EngineOptions{2, 0});
  const GenerateResult first = generate(a, "Hello world", greedy(24));
  EXPECT_FALSE(first.text.empty());
  EXPECT_EQ(generate(a, "Hello world", greedy(24)).text, first.text);  // the same engine again
  EXPECT_EQ(generate(b, "Hello world", greedy(24)).text, first.text);  // another engine
  // Greedy ignores the seed.
  GenerateParams seeded = greedy(24);
  seeded.sampling.seed = 99;
  EXPECT_EQ(generate(a, "Hello world", seeded).text, first.text);
  EXPECT_NE(generate(a, "the cat and the dog", greedy(24)).text, first.text);
}

TEST(Engine, SameSeedSameTextDifferentSeedsDiffer) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  auto sampled = [&](std::uint64_t seed) {
    GenerateParams p = greedy(24);
    p.sampling.temperature = 1.5f;
    p.sampling.seed = seed;
    return generate(engine, "Hello world", p).text;
  };
  EXPECT_EQ(sampled(7), sampled(7));
  std::set<std::string> texts;
  for (std::uint64_t seed = 1; seed <= 6; ++seed) texts.insert(sampled(seed));
  EXPECT_GE(texts.size(), 4u) << "six seeds at temperature 1.5 gave mostly the same text";
}

TEST(Engine, StreamedPiecesConcatenateToTheText) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  GenerateParams p = greedy(40);
  p.sampling.temperature = 1.0f;
  p.sampling.seed = 3;
  Streamed streamed;
  const GenerateResult r = generate(engine, "Hello world", p, &streamed);
  EXPECT_EQ(streamed.joined(), r.text);
  EXPECT_GE(streamed.pieces.size(), 2u);
  for (const auto& piece : streamed.pieces) EXPECT_FALSE(piece.empty());
}

TEST(Engine, StopStringEndsGenerationBeforeIt) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  const GenerateResult free_run = generate(engine, "Hello world", greedy(40));
  ASSERT_GE(free_run.text.size(), 12u) << free_run.text;
  // A stop string taken from what greedy decoding writes, so it is hit: three bytes that first
  // occur after some text (the earliest such position from the middle on).
  std::size_t first = std::string::npos;
  for (std::size_t p = free_run.text.size() / 2; p > 0 && first == std::string::npos; --p)
    if (free_run.text.find(free_run.text.substr(p, 3)) == p) first = p;
  ASSERT_NE(first, std::string::npos) << free_run.text;
  const std::string stop = free_run.text.substr(first, 3);
  GenerateParams p = greedy(40);
  p.stop = {"a string that never appears", stop};
  Streamed streamed;
  const GenerateResult r = generate(engine, "Hello world", p, &streamed);
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.text, free_run.text.substr(0, first));
  EXPECT_FALSE(r.text.empty());
  EXPECT_EQ(r.text.find(stop), std::string::npos);
  EXPECT_EQ(streamed.joined(), r.text);
  for (const auto& piece : streamed.pieces) EXPECT_EQ(piece.find(stop), std::string::npos);
  EXPECT_LT(r.stats.generated_tokens, free_run.stats.generated_tokens);

  // A stop string that is never hit changes nothing.
  GenerateParams never = greedy(40);
  never.stop = {"\x01\x02never"};
  const GenerateResult same = generate(engine, "Hello world", never);
  EXPECT_EQ(same.text, free_run.text);
  EXPECT_EQ(same.finish_reason, "length");
}

TEST(Engine, EndOfTurnTokenStopsUnlessIgnored) {
  // At temperature 2 the tiny model samples <|im_end|> now and then: find a seed that does.
  Engine engine(tiny_model(), EngineOptions{1, 0});
  GenerateParams p;
  p.max_tokens = 200;
  p.sampling.temperature = 2.0f;
  std::optional<GenerateResult> ended;
  for (std::uint64_t seed = 1; seed <= 60 && !ended; ++seed) {
    p.sampling.seed = seed;
    GenerateResult r = generate(engine, "Hello world", p);
    if (r.finish_reason == "stop") ended = std::move(r);
    else EXPECT_EQ(r.finish_reason, "length");
  }
  ASSERT_TRUE(ended) << "no seed sampled an end-of-turn token";
  EXPECT_LT(ended->stats.generated_tokens, 200);  // the end-of-turn token counted
  EXPECT_EQ(ended->text.find("<|im_end|>"), std::string::npos);

  // The same seed with ignore_eos goes on past it, from the same text.
  p.ignore_eos = true;
  const GenerateResult past = generate(engine, "Hello world", p);
  EXPECT_EQ(past.finish_reason, "length");
  EXPECT_EQ(past.stats.generated_tokens, 200);
  EXPECT_EQ(past.text.substr(0, ended->text.size()), ended->text);
  EXPECT_GT(past.text.size(), ended->text.size());
}

// vLLM's stop_token_ids: the output ends with the token, its text included; a control token
// shows none, as the end of the turn does not.
TEST(Engine, AStopTokenIdEndsTheOutputAfterItsText) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  const GenerateResult free_run = generate(engine, "Hello world", greedy(30));
  ASSERT_EQ(free_run.tokens.size(), 30u);
  // The first token that does not occur before it, at least three in.
  std::size_t k = 3;
  while (k < free_run.tokens.size() &&
         std::find(free_run.tokens.begin(), free_run.tokens.begin() + static_cast<std::ptrdiff_t>(k), free_run.tokens[k]) !=
             free_run.tokens.begin() + static_cast<std::ptrdiff_t>(k))
    ++k;
  ASSERT_LT(k, free_run.tokens.size());
  GenerateParams p = greedy(30);
  p.stop_token_ids = {free_run.tokens[k]};
  Streamed streamed;
  const GenerateResult r = generate(engine, "Hello world", p, &streamed);
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.stats.generated_tokens, static_cast<std::int64_t>(k) + 1);
  const std::vector<Token> through(free_run.tokens.begin(), free_run.tokens.begin() + static_cast<std::ptrdiff_t>(k) + 1);
  EXPECT_EQ(r.tokens, through);
  // The text of the run cut there by max_tokens (a character the last token leaves incomplete
  // comes out as U+FFFD either way).
  EXPECT_EQ(r.text, generate(engine, "Hello world", greedy(static_cast<std::int64_t>(k) + 1)).text);
  EXPECT_EQ(streamed.joined(), r.text);

  // A control token, forced first: nothing is written.
  const Token start = engine.model().tokenizer().find("<|im_start|>");
  ASSERT_GE(start, 0);
  GenerateParams control = greedy(30);
  control.sampling.logit_bias = {{start, 100.0f}};
  control.stop_token_ids = {start};
  const GenerateResult c = generate(engine, "Hello world", control);
  EXPECT_EQ(c.finish_reason, "stop");
  EXPECT_EQ(c.text, "");
  EXPECT_EQ(c.stats.generated_tokens, 1);
}

// min_tokens: the end of the turn, stop token ids and stop strings cannot end the output within
// the first min_tokens tokens.
TEST(Engine, MinTokensHoldsOffEveryWayOfStopping) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  const Token end = engine.model().tokenizer().find("<|im_end|>");
  ASSERT_GE(end, 0);
  GenerateParams p;
  p.max_tokens = 30;
  p.sampling.temperature = 0.0f;
  p.sampling.logit_bias = {{end, 100.0f}};  // the end of the turn first, were it not held back
  EXPECT_EQ(generate(engine, "Hello world", p).stats.generated_tokens, 1);
  p.sampling.min_tokens = 5;
  GenerateResult r = generate(engine, "Hello world", p);
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(r.stats.generated_tokens, 6);
  ASSERT_EQ(r.tokens.size(), 6u);
  EXPECT_EQ(r.tokens.back(), end);
  for (std::size_t i = 0; i < 5; ++i) EXPECT_NE(r.tokens[i], end);

  // A stop token id, as the end of the turn.
  const GenerateResult free_run = generate(engine, "Hello world", greedy(30));
  GenerateParams ids = greedy(30);
  ids.stop_token_ids = {free_run.tokens[0]};
  EXPECT_EQ(generate(engine, "Hello world", ids).stats.generated_tokens, 1);
  ids.sampling.min_tokens = 4;
  const GenerateResult held = generate(engine, "Hello world", ids);
  EXPECT_GE(held.stats.generated_tokens, 5);
  for (std::size_t i = 0; i < 4 && i < held.tokens.size(); ++i) EXPECT_NE(held.tokens[i], free_run.tokens[0]);

  // A stop string in the free run's first bytes stops at once without; with every token held,
  // the run is the free one.
  ASSERT_GE(free_run.text.size(), 3u);
  GenerateParams strings = greedy(30);
  strings.stop = {free_run.text.substr(0, 3)};
  EXPECT_EQ(generate(engine, "Hello world", strings).text, "");
  strings.sampling.min_tokens = 30;
  const GenerateResult whole = generate(engine, "Hello world", strings);
  EXPECT_EQ(whole.text, free_run.text);
  EXPECT_EQ(whole.finish_reason, "length");
}

// bad_words: the free run's own tokens, held back where they would complete a word.
TEST(Engine, BadWordsChangeTheRunWhereTheyWouldBeCompleted) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  const GenerateResult free_run = generate(engine, "Hello world", greedy(20));
  ASSERT_EQ(free_run.tokens.size(), 20u);
  // The first pair of tokens, from the fourth on, that the run has not made before.
  const auto& t = free_run.tokens;
  std::size_t k = 3;
  const auto seen_before = [&](std::size_t k) {
    for (std::size_t i = 1; i < k; ++i)
      if (t[i - 1] == t[k - 1] && t[i] == t[k]) return true;
    return false;
  };
  while (k < t.size() && seen_before(k)) ++k;
  ASSERT_LT(k, t.size());
  GenerateParams p = greedy(20);
  p.sampling.bad_words = {{t[k - 1], t[k]}};
  const GenerateResult r = generate(engine, "Hello world", p);
  ASSERT_EQ(r.tokens.size(), 20u);
  EXPECT_TRUE(std::equal(r.tokens.begin(), r.tokens.begin() + static_cast<std::ptrdiff_t>(k), t.begin()));
  EXPECT_NE(r.tokens[k], t[k]);
  for (std::size_t i = 1; i < r.tokens.size(); ++i) EXPECT_FALSE(r.tokens[i - 1] == t[k - 1] && r.tokens[i] == t[k]) << i;
  p.sampling.bad_words = {{free_run.tokens[0]}};
  const GenerateResult never = generate(engine, "Hello world", p);
  for (const Token t : never.tokens) EXPECT_NE(t, free_run.tokens[0]);
}

// A word as it is tokenized alone, and after a space where that gives as many tokens, another
// first; whitespace before it is dropped, and a word of whitespace alone is none.
TEST(Engine, BadWordSequencesAreTheWordAloneAndAfterASpace) {
  const Tokenizer& tok = tiny_model()->tokenizer();
  for (const std::string word : {"Hello", "world", "ab", "Hello world"}) {
    SCOPED_TRACE(word);
    const std::vector<Token> alone = tok.encode(word, false), spaced = tok.encode(" " + word, false);
    std::vector<std::vector<Token>> expected = {alone};
    if (spaced.size() == alone.size() && spaced.front() != alone.front()) expected.push_back(spaced);
    EXPECT_EQ(bad_word_sequences(tok, std::vector<std::string>{word}), expected);
    EXPECT_EQ(bad_word_sequences(tok, std::vector<std::string>{" \t" + word}), expected);
  }
  EXPECT_TRUE(bad_word_sequences(tok, std::vector<std::string>{" ", ""}).empty());
}

TEST(Engine, OnTextReturningFalseCancels) {
  Engine engine(tiny_model(), EngineOptions{1, 0});
  std::vector<std::string> pieces;
  const std::vector<Token> prompt = engine.text_prompt("Hello world");
  const GenerateResult r = engine.generate(prompt, greedy(100), [&](std::string_view piece) {
    pieces.emplace_back(piece);
    return false;
  });
  EXPECT_EQ(r.finish_reason, "cancelled");
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(r.text, pieces[0]);
  EXPECT_LT(r.stats.generated_tokens, 10);
  // The next request starts from a clean cache.
  EXPECT_EQ(generate(engine, "Hello world", greedy(30)).text,
            Engine(tiny_model(), EngineOptions{1, 0}).generate(prompt, greedy(30), nullptr).text);
}

// ---- Sampler ---------------------------------------------------------------------------------

std::vector<float> random_logits(std::mt19937& rng, int n) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(static_cast<std::size_t>(n));
  for (float& x : logits) x = normal(rng);
  return logits;
}

TEST(Sampler, GreedySettingsPickTheArgmax) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 50; ++trial) {
    const std::vector<float> logits = random_logits(rng, 300);
    const auto best = static_cast<Token>(kernels::argmax(logits.data(), 300));
    Sampler zero_temperature(SamplingParams{.temperature = 0.0f, .seed = std::uint64_t(trial)});
    Sampler top_one(SamplingParams{.temperature = 1.0f, .top_k = 1, .seed = std::uint64_t(trial)});
    Sampler tiny_nucleus(SamplingParams{.temperature = 1.0f, .top_p = 1e-6f, .seed = std::uint64_t(trial)});
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(zero_temperature.sample(logits), best);
      EXPECT_EQ(top_one.sample(logits), best);
      EXPECT_EQ(tiny_nucleus.sample(logits), best);
    }
  }
}

TEST(Sampler, PenaltiesLowerTheLogitsOfGeneratedTokens) {
  const std::vector<float> logits = {2.0f, 1.9f, 1.0f, 0.0f};
  Sampler frequency(SamplingParams{.temperature = 0.0f, .frequency_penalty = 0.06f});
  EXPECT_EQ(frequency.sample(logits), 0);
  frequency.observe(0);
  EXPECT_EQ(frequency.sample(logits), 0);  // 2.0 - 0.06 > 1.9
  frequency.observe(0);
  EXPECT_EQ(frequency.sample(logits), 1);  // 2.0 - 0.12 < 1.9: the count matters
  Sampler presence(SamplingParams{.temperature = 0.0f, .presence_penalty = 0.5f});
  presence.observe(0);
  EXPECT_EQ(presence.sample(logits), 1);
  presence.observe(1);
  presence.observe(1);
  presence.observe(1);
  EXPECT_EQ(presence.sample(logits), 0);  // 1.5 against 1.4: presence counts once
  // Negative penalties favour what was generated; tokens outside the row are ignored.
  Sampler favour(SamplingParams{.temperature = 0.0f, .presence_penalty = -1.5f});
  favour.observe(2);
  favour.observe(99);
  EXPECT_EQ(favour.sample(logits), 2);
  // Sampling at a temperature draws from the penalized distribution.
  Sampler hot(SamplingParams{.temperature = 1.0f, .presence_penalty = 2.0f});
  hot.observe(0);
  const TokenDistribution d = hot.distribution(logits);
  EXPECT_NEAR(d.probability(0) / d.probability(1), std::exp(0.0 - 1.9), 1e-6);
  // Without penalties nothing is kept.
  Sampler plain(SamplingParams{.temperature = 0.0f});
  plain.observe(0);
  plain.observe(0);
  EXPECT_EQ(plain.sample(logits), 0);
}

// The repetition penalty (vLLM's and Hugging Face's): every token of the prompt or generated so
// far has its logit divided by it where positive and multiplied by it where not, once however
// often it came, before the other penalties.
TEST(Sampler, TheRepetitionPenaltyScalesTheLogitsOfThePromptsAndGeneratedTokens) {
  const std::vector<float> logits = {2.0f, 1.5f, -1.0f, -1.2f, 0.0f};
  Sampler s(SamplingParams{.temperature = 1.0f, .repetition_penalty = 1.5f});
  const std::vector<Token> prompt = {2, 0, 2, 77};  // repeated, and outside the row: ignored
  s.observe_prompt(prompt);
  TokenDistribution d = s.distribution(logits);
  // 0: 2.0 / 1.5; 1: untouched; 2: -1.0 * 1.5; 3: untouched.
  EXPECT_NEAR(std::log(d.probability(0) / d.probability(1)), 2.0 / 1.5 - 1.5, 1e-6);
  EXPECT_NEAR(std::log(d.probability(2) / d.probability(3)), -1.5 + 1.2, 1e-6);
  s.observe(1);
  s.observe(1);
  d = s.distribution(logits);
  EXPECT_NEAR(std::log(d.probability(1) / d.probability(4)), 1.5 / 1.5, 1e-6);  // once, however often
  EXPECT_NEAR(std::log(d.probability(0) / d.probability(1)), 2.0 / 1.5 - 1.0, 1e-6);

  // Greedy: the prompt's best token gives way to the next.
  Sampler greedy(SamplingParams{.temperature = 0.0f, .repetition_penalty = 1.5f});
  EXPECT_EQ(greedy.sample(logits), 0);
  greedy.observe_prompt(std::vector<Token>{0});
  EXPECT_EQ(greedy.sample(logits), 1);  // 1.33 < 1.5
  // Below 1 it favours what came before; with presence_penalty after it.
  Sampler favour(SamplingParams{.temperature = 0.0f, .presence_penalty = 0.2f, .repetition_penalty = 0.5f});
  favour.observe_prompt(std::vector<Token>{1});
  EXPECT_EQ(favour.sample(logits), 1);  // 1.5 / 0.5 = 3 > 2
  favour.observe(1);
  EXPECT_EQ(favour.sample(logits), 1);  // 3 - 0.2 > 2
  // At 1 the prompt is not kept, and nothing changes.
  Sampler none(SamplingParams{.temperature = 0.0f, .repetition_penalty = 1.0f});
  none.observe_prompt(std::vector<Token>{0});
  EXPECT_EQ(none.sample(logits), 0);
  EXPECT_FALSE(none.params().penalized());
  EXPECT_TRUE(greedy.params().penalized() && greedy.params().adjusted());
}

// min_tokens: the tokens held back cannot be sampled, whatever their logit or bias, until that
// many tokens have been observed; then they are as before.
TEST(Sampler, MinTokensHoldsBackTheEndsUntilEnoughAreGenerated) {
  const std::vector<float> logits = {0.5f, 3.0f, 1.0f, 2.0f};
  Sampler s(SamplingParams{.temperature = 0.0f, .logit_bias = {{3, 5.0f}}, .min_tokens = 2});
  s.hold_back({1, 3, 99});  // 99: outside the row, ignored
  EXPECT_TRUE(s.params().adjusted());
  EXPECT_EQ(s.sample(logits), 2);
  s.observe(2);
  EXPECT_EQ(s.sample(logits), 2);
  s.observe(2);
  EXPECT_EQ(s.sample(logits), 3);  // 2 + 5
  // Sampled, a held-back token has no probability at all.
  Sampler hot(SamplingParams{.temperature = 1.5f, .min_tokens = 1});
  hot.hold_back({1});
  const TokenDistribution d = hot.distribution(logits);
  EXPECT_EQ(d.probability(1), 0.0);
  EXPECT_NEAR(d.probability(0) + d.probability(2) + d.probability(3), 1.0, 1e-12);
  hot.observe(0);
  EXPECT_GT(hot.distribution(logits).probability(1), 0.3);
  // Nothing held back: nothing changes.
  Sampler none(SamplingParams{.temperature = 0.0f, .min_tokens = 3});
  EXPECT_EQ(none.sample(logits), 1);
}

// bad_words: a sequence's last token is held back where the tokens generated last are the rest
// of it; a one-token sequence always.
TEST(Sampler, BadWordsHoldBackTheTokenThatWouldCompleteOne) {
  const std::vector<float> logits = {0.5f, 3.0f, 1.0f, 2.0f, 1.5f};
  Sampler s(SamplingParams{.temperature = 0.0f, .bad_words = {{4, 2, 1}, {0}, {3, 3}}});
  EXPECT_TRUE(s.params().adjusted());
  EXPECT_EQ(s.sample(logits), 1);
  s.observe(4);
  EXPECT_EQ(s.sample(logits), 1);
  s.observe(2);
  EXPECT_EQ(s.sample(logits), 3);  // 4, 2 then 1 would complete the first
  s.observe(3);
  EXPECT_EQ(s.sample(logits), 1);
  s.observe(1);
  s.observe(3);
  EXPECT_EQ(s.sample(logits), 1);
  // 0 never, and 3 not after a 3: the best two held back.
  const std::vector<float> narrow = {9.0f, -1.0f, -5.0f, 8.0f, -9.0f};
  EXPECT_EQ(s.sample(narrow), 1);
  s.observe(1);
  EXPECT_EQ(s.sample(narrow), 3);
}

TEST(Sampler, GreedyTiesGoToTheFirst) {
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f, 2.0f};
  Sampler s(SamplingParams{.temperature = 0.0f});
  EXPECT_EQ(s.sample(logits), 1);
}

// Counts of `draws` samples from `logits`, one Sampler per seed (what requests with different
// seeds see) or one Sampler for all.
std::vector<int> histogram(const std::vector<float>& logits, SamplingParams params, int draws,
                           bool sampler_per_seed) {
  std::vector<int> counts(logits.size(), 0);
  Sampler shared(params);
  for (int i = 0; i < draws; ++i) {
    if (sampler_per_seed) {
      params.seed = static_cast<std::uint64_t>(i) + 1;
      Sampler s(params);
      ++counts[static_cast<std::size_t>(s.sample(logits))];
    } else {
      ++counts[static_cast<std::size_t>(shared.sample(logits))];
    }
  }
  return counts;
}

// Pearson's chi-square of `counts` against probabilities `p` (zero-probability cells must be
// empty).
double chi_square(const std::vector<int>& counts, const std::vector<double>& p) {
  double total = 0, chi = 0;
  for (int c : counts) total += c;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (p[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "cell " << i << " has probability 0";
      continue;
    }
    const double expected = total * p[i];
    chi += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  return chi;
}

std::vector<double> softmax(const std::vector<float>& logits, double temperature) {
  std::vector<double> p(logits.size());
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (std::size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp((logits[i] - max) / temperature);
  for (double& x : p) x /= sum;
  return p;
}

// With 5 cells (4 degrees of freedom) chi-square exceeds 25 with probability about 5e-5; a
// sampler that ignored the temperature would score in the thousands here.
constexpr double kChiSquareBound4 = 25.0;

TEST(Sampler, SamplesFollowTheSoftmaxAtTheTemperature) {
  const std::vector<float> logits = {1.0f, 0.5f, 0.0f, -1.0f, 2.0f};
  for (const float temperature : {0.7f, 1.0f, 2.0f}) {
    for (const bool per_seed : {true, false}) {
      SamplingParams params{.temperature = temperature, .seed = 42};
      const std::vector<int> counts = histogram(logits, params, 20000, per_seed);
      EXPECT_LT(chi_square(counts, softmax(logits, temperature)), kChiSquareBound4)
          << "T " << temperature << (per_seed ? ", a sampler per seed" : ", one sampler");
      // The wrong temperature is rejected by the same bound (the test can fail).
      EXPECT_GT(chi_square(counts, softmax(logits, temperature * 1.5)), kChiSquareBound4);
    }
  }
}

TEST(Sampler, TopKAndTopPRenormaliseOverTheKeptTokens) {
  const std::vector<float> logits = {1.0f, 0.5f, 0.0f, -1.0f, 2.0f};
  const std::vector<double> full = softmax(logits, 1.0);  // 0.23, 0.14, 0.08, 0.03, 0.52
  auto restricted = [&](std::set<int> kept) {
    std::vector<double> p(full.size(), 0.0);
    double sum = 0;
    for (int i : kept) sum += full[static_cast<std::size_t>(i)];
    for (int i : kept) p[static_cast<std::size_t>(i)] = full[static_cast<std::size_t>(i)] / sum;
    return p;
  };
  // top_k 2: the two best tokens, 4 and 0 (1 degree of freedom: 15 is p ~ 1e-4).
  EXPECT_LT(chi_square(histogram(logits, {.temperature = 1.0f, .top_k = 2}, 20000, true),
                       restricted({4, 0})), 15.0);
  // top_p 0.7: tokens 4 (0.52) and 0 (0.75 cumulative) make the nucleus.
  EXPECT_LT(chi_square(histogram(logits, {.temperature = 1.0f, .top_p = 0.7f}, 20000, true),
                       restricted({4, 0})), 15.0);
  // top_p 0.8: one more, token 1 (0.89 cumulative).
  EXPECT_LT(chi_square(histogram(logits, {.temperature = 1.0f, .top_p = 0.8f}, 20000, true),
                       restricted({4, 0, 1})), 20.0);
  // top_k 3 and top_p 0.7 together: the smaller set.
  EXPECT_LT(chi_square(histogram(logits, {.temperature = 1.0f, .top_p = 0.7f, .top_k = 3}, 20000, true),
                       restricted({4, 0})), 15.0);
}

TEST(Sampler, SameSeedSameSequence) {
  std::mt19937 rng(5);
  const std::vector<float> logits = random_logits(rng, 100);
  auto sequence = [&](std::uint64_t seed) {
    Sampler s(SamplingParams{.temperature = 1.5f, .seed = seed});
    std::vector<Token> out;
    for (int i = 0; i < 50; ++i) out.push_back(s.sample(logits));
    return out;
  };
  EXPECT_EQ(sequence(11), sequence(11));
  EXPECT_NE(sequence(11), sequence(12));
}

// What the sampler's distribution is, written the plain way: every token within 30 nats of the
// best (after temperature), sorted by logit with the lower id first on ties, the first top_k of
// them, then the shortest run of those whose probability reaches top_p; weights exp(x) in F32.
// Returned as token -> weight.
std::map<Token, double> reference_distribution(const std::vector<float>& logits, const SamplingParams& p) {
  const float max = *std::max_element(logits.begin(), logits.end());
  std::vector<Token> order;
  for (std::size_t i = 0; i < logits.size(); ++i)
    if ((logits[i] - max) / p.temperature > -30.0f) order.push_back(static_cast<Token>(i));
  std::stable_sort(order.begin(), order.end(), [&](Token a, Token b) {
    return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)];
  });
  if (p.top_k > 0 && static_cast<std::size_t>(p.top_k) < order.size()) order.resize(static_cast<std::size_t>(p.top_k));
  const auto weight = [&](Token id) {
    return static_cast<double>(std::exp((logits[static_cast<std::size_t>(id)] - max) / p.temperature));
  };
  if (p.min_p > 0.0f) {
    // Those whose weight (relative to the best's 1) is at least min_p.
    std::vector<Token> kept;
    for (const Token id : order)
      if (static_cast<float>(weight(id)) >= p.min_p) kept.push_back(id);
    if (kept.empty()) kept.push_back(order.front());
    order = kept;
  }
  if (p.top_p < 1.0f) {
    double total = 0.0;
    for (const Token id : order) total += weight(id);
    double sum = 0.0;
    for (std::size_t i = 0; i < order.size(); ++i) {
      sum += weight(order[i]);
      if (sum >= p.top_p * total) {
        order.resize(i + 1);
        break;
      }
    }
  }
  std::map<Token, double> out;
  for (const Token id : order) out[id] = weight(id);
  return out;
}

void expect_reference_distribution(const std::vector<float>& logits, const SamplingParams& p, const std::string& what) {
  Sampler sampler(p);
  const TokenDistribution d = sampler.distribution(logits);
  const std::map<Token, double> want = reference_distribution(logits, p);
  ASSERT_EQ(d.tokens.size(), want.size()) << what;
  double total = 0.0;
  for (std::size_t i = 0; i < d.tokens.size(); ++i) {
    if (i > 0) {
      ASSERT_LT(d.tokens[i - 1], d.tokens[i]) << what << ": the tokens are listed in id order";
    }
    const auto it = want.find(d.tokens[i]);
    ASSERT_NE(it, want.end()) << what << ": token " << d.tokens[i] << " kept, which the reference leaves out";
    ASSERT_EQ(d.weights[i], it->second) << what << ": token " << d.tokens[i];
    total += d.weights[i];
  }
  EXPECT_NEAR(d.total, total, 1e-12 * total) << what;
}

// The kept tokens and their weights are the plain sort's, over rows of a real vocabulary's size,
// small rows, and rows full of equal logits (where the lower id goes first at a cut).
TEST(Sampler, TheDistributionIsThatOfSortingTheLogits) {
  std::mt19937 rng(17);
  std::vector<std::vector<float>> rows;
  for (const int n : {1, 2, 7, 300, 49152}) rows.push_back(random_logits(rng, n));
  std::vector<float> wide = random_logits(rng, 5000);
  for (float& x : wide) x *= 4.0f;  // a spread wider than 30 nats: some tokens drop out
  rows.push_back(wide);
  std::uniform_int_distribution<int> level(0, 3);
  std::vector<float> ties(2000);
  for (float& x : ties) x = static_cast<float>(level(rng));
  rows.push_back(ties);
  rows.push_back({0.0f, -0.0f, 0.0f, -0.0f, -1.0f});  // -0 and +0 are equal logits
  rows.push_back(std::vector<float>(64, 1.5f));       // all equal
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (const float t : {0.01f, 0.3f, 1.0f, 2.5f, 100.0f})
      for (const float top_p : {1.0f, 0.99f, 0.9f, 0.5f, 0.01f, 0.0f})
        for (const int top_k : {0, 2, 40, 1999}) {
          const SamplingParams p{.temperature = t, .top_p = top_p, .top_k = top_k, .seed = 1};
          expect_reference_distribution(rows[r], p,
                                        "row " + std::to_string(r) + " t " + std::to_string(t) + " top_p " +
                                            std::to_string(top_p) + " top_k " + std::to_string(top_k));
          if (HasFatalFailure()) return;
        }
  }
}

// min_p keeps the tokens whose probability is at least min_p times the best's, with top_k (both
// runs of the best) and before top_p.
TEST(Sampler, MinPKeepsTheTokensNearTheBest) {
  std::mt19937 rng(29);
  std::vector<std::vector<float>> rows = {random_logits(rng, 49152), random_logits(rng, 300)};
  std::uniform_int_distribution<int> level(0, 3);
  std::vector<float> ties(2000);
  for (float& x : ties) x = static_cast<float>(level(rng));
  rows.push_back(ties);
  for (std::size_t r = 0; r < rows.size(); ++r)
    for (const float t : {0.3f, 1.0f, 2.5f})
      for (const float min_p : {1e-6f, 0.05f, 0.3f, 1.0f})
        for (const float top_p : {1.0f, 0.9f})
          for (const int top_k : {0, 40}) {
            const SamplingParams p{.temperature = t, .top_p = top_p, .top_k = top_k, .min_p = min_p, .seed = 1};
            expect_reference_distribution(rows[r], p,
                                          "row " + std::to_string(r) + " t " + std::to_string(t) + " min_p " +
                                              std::to_string(min_p) + " top_p " + std::to_string(top_p) +
                                              " top_k " + std::to_string(top_k));
            if (HasFatalFailure()) return;
          }
  // 1 keeps the best alone (all of them, where they tie).
  Sampler best_only(SamplingParams{.temperature = 1.0f, .min_p = 1.0f});
  EXPECT_EQ(best_only.distribution(std::vector<float>{1.0f, 3.0f, 2.0f, 3.0f}).tokens, (std::vector<Token>{1, 3}));
  // exp(-1) = 0.37 of the best: kept at 0.3, not at 0.4.
  Sampler wide(SamplingParams{.temperature = 1.0f, .min_p = 0.3f}), narrow(SamplingParams{.temperature = 1.0f, .min_p = 0.4f});
  EXPECT_EQ(wide.distribution(std::vector<float>{1.0f, 2.0f, 0.0f}).tokens, (std::vector<Token>{0, 1}));
  EXPECT_EQ(narrow.distribution(std::vector<float>{1.0f, 2.0f, 0.0f}).tokens, (std::vector<Token>{1}));
}

TEST(Sampler, EqualLogitsAtACutKeepTheLowerIds) {
  const std::vector<float> logits = {1.0f, 2.0f, 2.0f, 0.0f, 2.0f, 2.0f};
  Sampler top_two(SamplingParams{.temperature = 1.0f, .top_k = 2});
  EXPECT_EQ(top_two.distribution(logits).tokens, (std::vector<Token>{1, 2}));
  // Four equal best tokens hold 0.8 of the probability: 0.5 needs three of them.
  Sampler half(SamplingParams{.temperature = 1.0f, .top_p = 0.5f});
  EXPECT_EQ(half.distribution(logits).tokens, (std::vector<Token>{1, 2, 4}));
  // Ranked by the logits themselves: 1.0000001 is above 1, though 10 less either is -9 in F32.
  const std::vector<float> close = {10.0f, 1.0f, 1.0000001f};
  Sampler two(SamplingParams{.temperature = 1.0f, .top_k = 2});
  EXPECT_EQ(two.distribution(close).tokens, (std::vector<Token>{0, 2}));
}

// A row with an infinity or a NaN (which the engine fails the request for before sampling) still
// gives a token of the row, with every setting, rather than reading outside it.
TEST(Sampler, BrokenRowsStillGiveATokenOfTheRow) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> long_row(100, 1.0f);  // past the vector argmax's short-row loop
  long_row[40] = inf;
  long_row[70] = nan;
  for (const std::vector<float>& logits : {std::vector<float>{0.0f, inf, 1.0f}, std::vector<float>{nan, 2.0f, -inf},
                                            std::vector<float>{nan, nan, nan}, long_row}) {
    for (const SamplingParams& p : {SamplingParams{.temperature = 1.0f}, SamplingParams{.temperature = 1.0f, .top_p = 0.5f},
                                    SamplingParams{.temperature = 1.0f, .top_k = 2}}) {
      Sampler s(p);
      const Token t = s.sample(logits);
      EXPECT_TRUE(t >= 0 && static_cast<std::size_t>(t) < logits.size()) << t;
    }
  }
}

// sample() draws what distribution() describes: the same token as distribution().draw() with
// the generator in the same state, draw after draw.
TEST(Sampler, SampleDrawsFromTheDistribution) {
  std::mt19937 rng(23);
  const std::vector<float> logits = random_logits(rng, 49152);
  for (const SamplingParams& p : {SamplingParams{.temperature = 1.0f, .seed = 3},
                                 SamplingParams{.temperature = 0.7f, .top_p = 0.9f, .seed = 4},
                                 SamplingParams{.temperature = 1.2f, .top_k = 50, .seed = 5}}) {
    Sampler a(p), b(p);
    for (int i = 0; i < 200; ++i) {
      const TokenDistribution d = b.distribution(logits);
      ASSERT_EQ(a.sample(logits), d.draw(b.uniform())) << "draw " << i;
    }
  }
}

// ---- StopMatcher -----------------------------------------------------------------------------

TEST(StopMatcher, WithoutStopsPassesEverything) {
  StopMatcher m({});
  EXPECT_EQ(m.feed("abc"), "abc");
  EXPECT_EQ(m.feed(""), "");
  EXPECT_EQ(m.finish(), "");
  StopMatcher empty_only({""});  // an empty stop string is ignored, not matched everywhere
  EXPECT_EQ(empty_only.feed("abc"), "abc");
  EXPECT_FALSE(empty_only.stopped());
}

TEST(StopMatcher, HoldsBackAPartialMatchUntilItCompletes) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.feed("abcE"), "abc");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.feed("N"), "");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.feed("D and more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.feed("later"), "");
  EXPECT_EQ(m.finish(), "");
}

TEST(StopMatcher, ReleasesAHeldTailThatIsNotAStop) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.feed("abEN"), "ab");
  EXPECT_EQ(m.feed("x"), "ENx");
  EXPECT_EQ(m.feed("E"), "");
  EXPECT_EQ(m.feed("E"), "E");  // "EE": only the second E can still start "END"
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcher, StopInsideOneFeedReturnsTheTextBeforeIt) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(m.feed("abSTOPcd"), "ab");
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcher, EarliestOfSeveralStopsWins) {
  StopMatcher m({"world", "lo w"});
  EXPECT_EQ(m.feed("hello world"), "hel");
  StopMatcher n({"lo w", "ell"});
  EXPECT_EQ(n.feed("hel"), "h");   // "el" could become "ell"
  EXPECT_EQ(n.feed("lo world"), "");  // "ell" at 1 comes before "lo w" at 3
  EXPECT_TRUE(n.stopped());
}

TEST(StopMatcher, OverlappingPrefixes) {
  StopMatcher m({"aab"});
  EXPECT_EQ(m.feed("aaa"), "a");
  EXPECT_EQ(m.feed("b"), "");
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcher, FinishFlushesTheHeldTail) {
  StopMatcher m({"END", "<|x|>"});
  EXPECT_EQ(m.feed("abcEN"), "abc");
  EXPECT_EQ(m.finish(), "EN");
  StopMatcher n({"<|x|>"});
  EXPECT_EQ(n.feed("q<|"), "q");
  EXPECT_EQ(n.finish(), "<|");
}

// Text fed unarmed (the first min_tokens tokens') cannot stop: a stop string counts where it ends
// in armed text, even when it starts in the text before.
TEST(StopMatcher, OnlyAStopEndingInArmedTextStops) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.feed("abEND", false), "abEND");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.feed("xEN", false), "x");  // "EN" may still become a stop that ends armed
  EXPECT_EQ(m.feed("D!", true), "");
  EXPECT_TRUE(m.stopped());
  StopMatcher n({"END"});
  EXPECT_EQ(n.feed("EN", false), "");
  EXPECT_EQ(n.feed("D", false), "END");  // completed unarmed: text
  EXPECT_EQ(n.feed("END", true), "");
  EXPECT_TRUE(n.stopped());
  // A stop string's start taken from an unarmed match's end: "aXa" + "Xa" holds a second "aXa".
  StopMatcher o({"aXa"});
  EXPECT_EQ(o.feed("aXa", false), "aX");
  EXPECT_EQ(o.feed("Xa", true), "");
  EXPECT_TRUE(o.stopped());
  StopMatcher q({"END"});
  EXPECT_EQ(q.feed("xEN", false), "x");
  EXPECT_EQ(q.finish(), "EN");
}

// Random texts, stop strings and chunkings against a plain model of the rule: generation stops
// at the first chunk after which the text so far contains a stop string, and the text shown is
// everything before the earliest stop string in it. (So when one stop string completes inside a
// chunk and another that starts earlier completes only in a later chunk, the first one wins:
// generation has stopped by then.) The text shown never contains a stop string and is never
// ahead of that rule, chunk by chunk.
TEST(StopMatcher, RandomChunkingsFollowTheRule) {
  std::mt19937 rng(9);
  const std::string alphabet = "abAB";
  int stopped = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string text;
    const int length = static_cast<int>(rng() % 30);
    for (int i = 0; i < length; ++i) text += alphabet[rng() % 2 + (rng() % 5 == 0 ? 2 : 0)];
    std::vector<std::string> stops;
    for (int s = 0; s < 1 + static_cast<int>(rng() % 2); ++s) {
      std::string stop;
      for (int i = 0; i < 1 + static_cast<int>(rng() % 4); ++i) stop += alphabet[rng() % 3];
      stops.push_back(stop);
    }
    std::vector<std::size_t> chunk_sizes;
    for (std::size_t i = 0; i < text.size();) {
      chunk_sizes.push_back(std::min<std::size_t>(text.size() - i, 1 + rng() % 4));
      i += chunk_sizes.back();
    }
    // The rule.
    std::string expected = text;
    bool expect_stop = false;
    for (std::size_t end = 0, c = 0; c < chunk_sizes.size() && !expect_stop; ++c) {
      end += chunk_sizes[c];
      std::size_t cut = std::string::npos;
      for (const auto& s : stops) cut = std::min(cut, text.substr(0, end).find(s));
      if (cut != std::string::npos) {
        expected = text.substr(0, cut);
        expect_stop = true;
      }
    }

    std::string described = "text '" + text + "', stops";
    for (const auto& s : stops) described += " '" + s + "'";
    described += ", fed";
    StopMatcher m(stops);
    std::string shown;
    std::size_t i = 0;
    for (std::size_t n : chunk_sizes) {
      described += " '" + text.substr(i, n) + "'";
      shown += m.feed(std::string_view(text).substr(i, n));
      i += n;
      ASSERT_EQ(expected.compare(0, shown.size(), shown), 0) << described << ": shown '" << shown << "'";
    }
    EXPECT_EQ(m.stopped(), expect_stop) << described;
    shown += m.finish();
    ASSERT_EQ(shown, expected) << described;
    for (const auto& s : stops) EXPECT_EQ(shown.find(s), std::string::npos) << described;
    stopped += expect_stop;
  }
  EXPECT_GT(stopped, 500);  // both outcomes are well represented
  EXPECT_LT(stopped, 2900);
}

// The same text fed whole: the earliest stop string in it wins, wherever it ends.
TEST(StopMatcher, OneFeedCutsAtTheEarliestStart) {
  StopMatcher whole({"aAa", "A"});
  EXPECT_EQ(whole.feed("aaAab"), "a");
  StopMatcher chunked({"aAa", "A"});
  EXPECT_EQ(chunked.feed("aaA"), "aa");  // "A" is complete first; "aAa" never will be
  EXPECT_TRUE(chunked.stopped());
}

// ---- LocalBackend ----------------------------------------------------------------------------

Request hello_request(int max_tokens, std::int64_t seed = 1) {
  Request r;
  r.messages = {{"user", "Hello world"}};
  r.max_tokens = max_tokens;
  r.temperature = 0.0;
  r.seed = seed;
  return r;
}

// The result of one complete() call run as its own coroutine.
struct Call {
  std::function<void()> on_piece;  // runs inside the sink after each piece is stored
  std::optional<Outcome> outcome;
  std::vector<std::string> pieces;
  std::exception_ptr thrown;
  std::string joined() const {
    std::string s;
    for (const auto& p : pieces) s += p;
    return s;
  }
};

// Runs complete() and stores what it returned, streamed and threw.
asio::awaitable<void> call_complete(Backend& backend, Request request, Call& call) {
  try {
    Outcome outcome = co_await backend.complete(request, [&call](std::string_view piece, std::span<const TokenLogprob>, TextPart) {
      call.pieces.emplace_back(piece);
      if (call.on_piece) call.on_piece();
    });
    call.outcome = std::move(outcome);
  } catch (...) {
    call.thrown = std::current_exception();
  }
}

std::string describe_exception(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

// Runs `io` until every call in `calls` has an outcome or threw, or `timeout` passes.
bool run_until_done(asio::io_context& io, const std::vector<Call*>& calls,
                    std::chrono::milliseconds timeout = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto all_done = [&] {
    return std::all_of(calls.begin(), calls.end(), [](Call* c) { return c->outcome || c->thrown; });
  };
  while (!all_done() && std::chrono::steady_clock::now() < deadline) {
    io.restart();
    io.run_for(20ms);
  }
  return all_done();
}

// One hello request of max_tokens per call, all started on io at once; the calls to wait for.
std::vector<Call*> spawn_hello_calls(asio::io_context& io, Backend& backend, std::vector<Call>& calls,
                                     int max_tokens) {
  std::vector<Call*> pointers;
  for (auto& call : calls) {
    asio::co_spawn(io, call_complete(backend, hello_request(max_tokens), call), asio::detached);
    pointers.push_back(&call);
  }
  return pointers;
}

LocalBackendOptions tiny_options(std::int64_t context = 0) {
  LocalBackendOptions o;
  o.model = TinyModelFile::get().path();
  o.threads = 1;
  o.context = context;
  return o;
}

TEST(LocalBackend, CompletesARequestWithUsageAndStreamedText) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  Call call;
  asio::co_spawn(io, call_complete(backend, hello_request(8), call), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&call}));
  ASSERT_FALSE(call.thrown) << describe_exception(call.thrown);
  ASSERT_TRUE(call.outcome->ok()) << call.outcome->error->message;
  const Completion& c = *call.outcome->completion;
  EXPECT_TRUE(c.usage.reported);
  EXPECT_GT(c.usage.prompt_tokens, 0);
  EXPECT_GE(c.usage.completion_tokens, 1);
  EXPECT_LE(c.usage.completion_tokens, 8);
  EXPECT_TRUE(c.finish_reason == "length" || c.finish_reason == "stop") << c.finish_reason;
  if (c.finish_reason == "length") {
    EXPECT_EQ(c.usage.completion_tokens, 8);
  }
  EXPECT_EQ(call.joined(), c.text);
  EXPECT_FALSE(c.text.empty());
  EXPECT_GE(c.timings.total_ms, c.timings.ttft_ms);
  EXPECT_GT(c.timings.total_ms, 0.0);

  // The same text as the engine gives for the chat prompt.
  Engine engine(tiny_model(), EngineOptions{1, 0});
  const std::vector<ChatMessage> messages = {{"user", "Hello world"}};
  GenerateParams p;
  p.max_tokens = 8;
  p.sampling.temperature = 0;
  const GenerateResult expected = engine.generate(engine.chat_prompt(messages), p, nullptr);
  EXPECT_EQ(c.text, expected.text);
  EXPECT_EQ(c.usage.prompt_tokens, expected.stats.prompt_tokens);
  EXPECT_EQ(c.usage.completion_tokens, expected.stats.generated_tokens);
}

TEST(LocalBackend, ExtraFieldsItWouldIgnoreFailTheRequest) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  Request refused = hello_request(4);
  refused.extra = {{"top_k", 3}, {"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", {{"type", "array"}}}}}}}};
  Request taken = hello_request(4);
  taken.extra = {{"top_k", 3}, {"user", "someone"}, {"presence_penalty", 0}};
  Call bad, good;
  asio::co_spawn(io, call_complete(backend, refused, bad), asio::detached);
  asio::co_spawn(io, call_complete(backend, taken, good), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&bad, &good}));
  ASSERT_TRUE(bad.outcome && !bad.outcome->ok());
  EXPECT_EQ(bad.outcome->error->kind, ErrorKind::Http);
  EXPECT_EQ(bad.outcome->error->http_status, 400);
  EXPECT_EQ(bad.outcome->error->code, "unsupported_parameter");
  EXPECT_EQ(bad.outcome->error->message,
            "'response_format': json_schema.schema at the root: the root must admit objects only (\"type\": "
            "\"object\"), as OpenAI's structured outputs ask; this one admits arrays; remove it, or run the job "
            "against an API that does (--base-url)");
  ASSERT_TRUE(good.outcome && good.outcome->ok()) << good.outcome->error->message;
}

// OpenAI's penalties and vLLM's repetition_penalty reach the sampler: the batched engine and the
// single-sequence one give the same greedy text with them, and another without.
TEST(LocalBackend, PenaltiesFromTheExtraFieldsReachTheSampler) {
  struct Case {
    nlohmann::ordered_json extra;
    SamplingParams sampling;
  };
  const std::vector<Case> cases = {
      {{{"frequency_penalty", 2.0}, {"presence_penalty", 1.0}},
       {.temperature = 0.0f, .presence_penalty = 1.0f, .frequency_penalty = 2.0f}},
      {{{"repetition_penalty", 1.8}}, {.temperature = 0.0f, .repetition_penalty = 1.8f}},
  };
  Engine engine(tiny_model(), EngineOptions{1, 0});
  const std::vector<ChatMessage> messages = {{"user", "Hello world"}};
  GenerateParams p;
  p.max_tokens = 24;
  p.sampling.temperature = 0;
  const std::string plain = engine.generate(engine.chat_prompt(messages), p, nullptr).text;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.extra.dump());
    asio::io_context io;
    LocalBackend backend(io.get_executor(), tiny_options());
    Request penalized = hello_request(24);
    penalized.temperature = 0;
    penalized.extra = c.extra;
    Call call;
    asio::co_spawn(io, call_complete(backend, penalized, call), asio::detached);
    ASSERT_TRUE(run_until_done(io, {&call}));
    ASSERT_TRUE(call.outcome && call.outcome->ok()) << call.outcome->error->message;
    p.sampling = c.sampling;
    EXPECT_EQ(call.outcome->completion->text, engine.generate(engine.chat_prompt(messages), p, nullptr).text);
    EXPECT_NE(call.outcome->completion->text, plain);
  }
}

// ignore_eos (vLLM's and llama.cpp's extension, in a job's extra fields or a serve request)
// generates past the end-of-turn token: biased to come first, it ends the answer at once
// without it and not at all with it; vLLM's min_tokens holds it off for that many tokens.
TEST(LocalBackend, IgnoreEosAndMinTokensFromTheExtraFieldsHoldOffTheEndOfTurn) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  Engine engine(tiny_model(), EngineOptions{1, 0});
  const Token end = engine.model().tokenizer().find("<|im_end|>");
  ASSERT_GE(end, 0);
  const nlohmann::ordered_json bias = {{std::to_string(end), 100}};
  Request ends = hello_request(12), goes_on = hello_request(12), least = hello_request(12);
  ends.extra = {{"logit_bias", bias}};
  goes_on.extra = {{"logit_bias", bias}, {"ignore_eos", true}};
  least.extra = {{"logit_bias", bias}, {"min_tokens", 4}};
  Call stopped, past, held;
  asio::co_spawn(io, call_complete(backend, ends, stopped), asio::detached);
  asio::co_spawn(io, call_complete(backend, goes_on, past), asio::detached);
  asio::co_spawn(io, call_complete(backend, least, held), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&stopped, &past, &held}));
  for (const Call* c : {&stopped, &past, &held}) ASSERT_TRUE(c->outcome && c->outcome->ok()) << c->outcome->error->message;
  EXPECT_EQ(stopped.outcome->completion->finish_reason, "stop");
  EXPECT_EQ(stopped.outcome->completion->usage.completion_tokens, 1);
  EXPECT_EQ(past.outcome->completion->finish_reason, "length");
  EXPECT_EQ(past.outcome->completion->usage.completion_tokens, 12);
  EXPECT_EQ(held.outcome->completion->finish_reason, "stop");
  EXPECT_EQ(held.outcome->completion->usage.completion_tokens, 5);
}

// stop_token_ids from the extra fields: the answer ends where the first of them is generated.
// An id outside the vocabulary and a min_tokens above max_tokens are 400s naming the field.
TEST(LocalBackend, StopTokenIdsFromTheExtraFieldsEndTheAnswer) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  Engine engine(tiny_model(), EngineOptions{1, 0});
  Request plain = hello_request(12);
  Call b;
  asio::co_spawn(io, call_complete(backend, plain, b), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&b}));
  ASSERT_TRUE(b.outcome && b.outcome->ok()) << b.outcome->error->message;
  // The plain answer's third token, as a stop token id: the answer ends where it first comes.
  const std::string text = b.outcome->completion->text;
  ASSERT_EQ(b.outcome->completion->usage.completion_tokens, 12);
  const std::vector<Token> prompt = chat_prompt_tokens(engine.model(), plain.messages);
  GenerateParams greedy_params = greedy(12);
  greedy_params.ignore_eos = false;
  const GenerateResult direct = engine.generate(prompt, greedy_params, [](std::string_view) { return true; });
  ASSERT_EQ(direct.text, text);
  Request stopping = hello_request(12);
  stopping.extra = {{"stop_token_ids", {direct.tokens[2]}}};
  Call c;
  asio::co_spawn(io, call_complete(backend, stopping, c), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&c}));
  ASSERT_TRUE(c.outcome && c.outcome->ok()) << c.outcome->error->message;
  const std::int64_t first = std::find(direct.tokens.begin(), direct.tokens.end(), direct.tokens[2]) - direct.tokens.begin();
  EXPECT_EQ(c.outcome->completion->finish_reason, "stop");
  EXPECT_EQ(c.outcome->completion->usage.completion_tokens, first + 1);
  greedy_params.max_tokens = first + 1;
  EXPECT_EQ(c.outcome->completion->text, engine.generate(prompt, greedy_params, [](std::string_view) { return true; }).text);

  Request outside = hello_request(12), over = hello_request(3);
  outside.extra = {{"stop_token_ids", {2, 1 << 30}}};
  over.extra = {{"min_tokens", 4}};
  Call d, e;
  asio::co_spawn(io, call_complete(backend, outside, d), asio::detached);
  asio::co_spawn(io, call_complete(backend, over, e), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&d, &e}));
  ASSERT_TRUE(d.outcome && !d.outcome->ok() && e.outcome && !e.outcome->ok());
  EXPECT_EQ(d.outcome->error->http_status, 400);
  EXPECT_TRUE(d.outcome->error->message.starts_with("'stop_token_ids': token 1073741824 is outside the vocabulary"))
      << d.outcome->error->message;
  EXPECT_EQ(e.outcome->error->http_status, 400);
  EXPECT_EQ(e.outcome->error->message, "'min_tokens': asks for at least 4 tokens, more than max_tokens (3) lets out");
}

// bad_words from the extra fields reach the sampler: the text of the plain answer's first token,
// as a word, makes another answer.
TEST(LocalBackend, BadWordsFromTheExtraFieldsReachTheSampler) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  Engine engine(tiny_model(), EngineOptions{1, 0});
  Request plain = hello_request(8);
  const std::vector<Token> prompt = chat_prompt_tokens(engine.model(), plain.messages);
  GenerateParams params = greedy(8);
  params.ignore_eos = false;
  const GenerateResult direct = engine.generate(prompt, params, [](std::string_view) { return true; });
  ASSERT_FALSE(direct.tokens.empty());
  const std::string word = engine.model().tokenizer().token_bytes(direct.tokens[0]);
  const auto sequences = bad_word_sequences(engine.model().tokenizer(), std::vector<std::string>{word});
  ASSERT_FALSE(sequences.empty()) << word;
  Request banned = hello_request(8);
  banned.extra = {{"bad_words", {word}}};
  Call a, b;
  asio::co_spawn(io, call_complete(backend, plain, a), asio::detached);
  asio::co_spawn(io, call_complete(backend, banned, b), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&a, &b}));
  ASSERT_TRUE(a.outcome && a.outcome->ok() && b.outcome && b.outcome->ok());
  EXPECT_EQ(a.outcome->completion->text, direct.text);
  params.sampling.bad_words = sequences;
  EXPECT_EQ(b.outcome->completion->text, engine.generate(prompt, params, [](std::string_view) { return true; }).text);
  if (sequences[0] == std::vector<Token>{direct.tokens[0]}) {
    EXPECT_NE(b.outcome->completion->text, direct.text);
  }
}

// min_p from the extra fields reaches the sampler: at 1 only the best token is left, so even a
// high temperature gives the greedy answer.
TEST(LocalBackend, MinPFromTheExtraFieldsReachesTheSampler) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  Request greedy = hello_request(16), hot = hello_request(16);
  greedy.temperature = 0;
  hot.temperature = 1.8;
  hot.seed = 7;
  hot.extra = {{"min_p", 1.0}};
  Call a, b;
  asio::co_spawn(io, call_complete(backend, greedy, a), asio::detached);
  asio::co_spawn(io, call_complete(backend, hot, b), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&a, &b}));
  ASSERT_TRUE(a.outcome && a.outcome->ok() && b.outcome && b.outcome->ok());
  EXPECT_EQ(b.outcome->completion->text, a.outcome->completion->text);
}

TEST(LocalBackend, DescribeNamesTheModelFile) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  const std::string d = backend.describe();
  EXPECT_NE(d.find(TinyModelFile::get().path().string()), std::string::npos) << d;
  EXPECT_NE(d.find("tiny-llama"), std::string::npos) << d;
}

TEST(LocalBackend, DescribeGivesTheKvPoolInWholeBlocks) {
  asio::io_context io;
  LocalBackendOptions o = tiny_options();
  o.kv_tokens = 1000;
  LocalBackend backend(io.get_executor(), o);
  const std::string d = backend.describe();
  EXPECT_NE(d.find("KV pool of 1008 tokens, "), std::string::npos) << d;  // 63 blocks of 16
  EXPECT_TRUE(std::regex_search(d, std::regex(R"(KV pool of 1008 tokens, \d+\.\d [KM]iB\))"))) << d;
}

TEST(LocalBackend, MissingModelThrowsGgufErrorNamingIt) {
  asio::io_context io;
  LocalBackendOptions o = tiny_options();
  o.model = TinyModelFile::get().path().parent_path() / "absent.gguf";
  try {
    LocalBackend backend(io.get_executor(), o);
    ADD_FAILURE() << "a missing model loaded";
  } catch (const gguf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("absent.gguf"), std::string::npos) << e.what();
  }
}

TEST(LocalBackend, ConcurrentRequestsAllComplete) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  std::vector<Call> calls(4);
  ASSERT_TRUE(run_until_done(io, spawn_hello_calls(io, backend, calls, 12)));
  for (const auto& call : calls) {
    ASSERT_FALSE(call.thrown) << describe_exception(call.thrown);
    ASSERT_TRUE(call.outcome->ok()) << call.outcome->error->message;
    // Greedy: every request gets the same text, and its own pieces only.
    EXPECT_EQ(call.outcome->completion->text, calls[0].outcome->completion->text);
    EXPECT_EQ(call.joined(), call.outcome->completion->text);
  }
}

TEST(LocalBackend, EngineStatsCountPrefixHitsAndFreeEveryBlock) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  const auto before = backend.engine_stats();
  ASSERT_TRUE(before.has_value());
  EXPECT_EQ(before->running, 0);
  EXPECT_EQ(before->blocks_used, 0);
  EXPECT_EQ(before->block_size, 16);
  EXPECT_GT(before->blocks_total, 0);

  // A prompt of several full blocks, then the same prompt again: the second is served from the
  // prefix cache up to its last full block.
  Request r;
  std::string long_text;
  for (int i = 0; i < 40; ++i) long_text += "word" + std::to_string(i) + " ";
  r.messages = {{"user", long_text}};
  r.max_tokens = 4;
  r.temperature = 0.0;
  Call first, second;
  asio::co_spawn(io, call_complete(backend, r, first), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&first}));
  asio::co_spawn(io, call_complete(backend, r, second), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&second}));
  ASSERT_TRUE(first.outcome && first.outcome->ok());
  ASSERT_TRUE(second.outcome && second.outcome->ok());
  EXPECT_EQ(first.outcome->completion->text, second.outcome->completion->text);

  const std::int64_t prompt = first.outcome->completion->usage.prompt_tokens;
  ASSERT_GT(prompt, 32);
  // The stats a caller reads once it has its answer count the step that gave it: no waiting.
  const std::optional<EngineStats> after = backend.engine_stats();
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->running, 0);
  EXPECT_EQ(after->waiting, 0);
  EXPECT_EQ(after->blocks_used, 0);  // finished sequences hold no blocks
  EXPECT_EQ(after->prompt_tokens_cached, (prompt - 1) / 16 * 16);
  EXPECT_EQ(after->prompt_tokens_computed + after->prompt_tokens_cached, 2 * prompt);
  EXPECT_GT(after->cache_hit_rate(), 0.0);
  EXPECT_EQ(after->preemptions, 0);
  EXPECT_GE(after->steps, 2);
  EXPECT_NE(after->brief().find("0 run 0 wait cache "), std::string::npos) << after->brief();
}

// The step log: a JSON line per step, whose prompt tokens add up to those the engine computed
// and whose decode tokens (one per running sequence, each request's first token coming from its
// prompt's last chunk) add up to the tokens generated after the first.
TEST(LocalBackend, StepLogHasALinePerStepThatAddsUpToTheStats) {
  const fs::path log = TinyModelFile::get().path().parent_path() / "steps.jsonl";
  fs::remove(log);
  asio::io_context io;
  LocalBackendOptions o = tiny_options();
  o.step_log = log;
  LocalBackend backend(io.get_executor(), o);
  std::vector<Call> calls(3);
  ASSERT_TRUE(run_until_done(io, spawn_hello_calls(io, backend, calls, 6)));
  std::int64_t completion = 0;
  for (const auto& call : calls) {
    ASSERT_TRUE(call.outcome && call.outcome->ok());
    completion += call.outcome->completion->usage.completion_tokens;
  }
  // Read at once: the stats are published before the answers they count are delivered.
  const std::optional<EngineStats> stats = backend.engine_stats();
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->running, 0);
  EXPECT_EQ(stats->generated_tokens, completion);
  std::ifstream in(log);
  ASSERT_TRUE(in) << log;
  const std::regex line_form(
      R"(\{"step":(\d+),"t":(\d+\.\d+),"sequences":(\d+),"decode":(\d+),"drafts":0,"prompt":(\d+),)"
      R"("tokens":(\d+),"forward_ms":(\d+\.\d+),"step_ms":(\d+\.\d+),"running":\d+,"waiting":\d+,)"
      R"("blocks_used":\d+\})");
  std::int64_t lines = 0, decode = 0, prompt = 0, last_step = 0;
  double last_t = 0;
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, line_form)) << line;
    ++lines;
    const std::int64_t step = std::stoll(m[1]), d = std::stoll(m[4]), p = std::stoll(m[5]);
    EXPECT_GT(step, last_step) << line;
    EXPECT_GE(std::stod(m[2]), last_t) << line;
    EXPECT_EQ(std::stoll(m[6]), d + p) << line;  // no drafts: a token per decode, the chunks
    EXPECT_LE(std::stod(m[7]), std::stod(m[8])) << line;
    EXPECT_GE(std::stoll(m[3]), 1) << line;
    last_step = step;
    last_t = std::stod(m[2]);
    decode += d;
    prompt += p;
  }
  EXPECT_EQ(lines, stats->steps);
  EXPECT_EQ(prompt, stats->prompt_tokens_computed);
  EXPECT_EQ(decode + static_cast<std::int64_t>(calls.size()), completion);
}

TEST(LocalBackend, StepLogThatCannotBeOpenedIsAnErrorNamingIt) {
  asio::io_context io;
  LocalBackendOptions o = tiny_options();
  o.step_log = TinyModelFile::get().path().parent_path() / "no-such-dir" / "steps.jsonl";
  try {
    LocalBackend backend(io.get_executor(), o);
    ADD_FAILURE() << "an unwritable step log was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("step_log: cannot open '", 0), 0u) << what;
    EXPECT_NE(what.find("no-such-dir"), std::string::npos) << what;
  }
}

TEST(LocalBackend, LimitsAreCheckedAndPoolSizeFollowsTheOptions) {
  asio::io_context io;
  LocalBackendOptions o = tiny_options(64);
  o.max_sequences = 4;
  o.block_size = 8;
  o.kv_tokens = 1000;
  {
    LocalBackend backend(io.get_executor(), o);
    const auto stats = backend.engine_stats();
    EXPECT_EQ(stats->block_size, 8);
    EXPECT_EQ(stats->blocks_total, 125);  // ceil(1000 / 8)
  }
  auto error_of = [&](LocalBackendOptions bad) -> std::string {
    try {
      LocalBackend backend(io.get_executor(), bad);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  LocalBackendOptions bad = o;
  bad.token_budget = 2;
  EXPECT_NE(error_of(bad).find("token_budget 2 is less than max_sequences 4"), std::string::npos) << error_of(bad);
  bad = o;
  bad.block_size = 0;
  EXPECT_NE(error_of(bad).find("block_size"), std::string::npos);
  bad = o;
  bad.kv_tokens = 10;
  EXPECT_NE(error_of(bad).find("kv_tokens 10 is less than one context of 64 tokens"), std::string::npos)
      << error_of(bad);
  // Written at start (serve's default), a pool larger than the memory is refused before it is
  // taken; not written, it is taken (the caller warns).
  bad = o;
  bad.kv_tokens = 0;
  bad.kv_bytes = available_memory_bytes() / 4 * 5;
  bad.kv_commit = true;
  EXPECT_NE(error_of(bad).find("kv_bytes " + std::to_string(bad.kv_bytes) + " is a KV pool of "), std::string::npos)
      << error_of(bad);
  EXPECT_NE(error_of(bad).find("more than the memory available now"), std::string::npos) << error_of(bad);
}

TEST(LocalBackend, PoolSizeDefaultsFromMemory) {
  LocalBackendOptions o;
  o.max_sequences = 32;
  // Enough memory: max_sequences full contexts.
  EXPECT_EQ(kv_pool_tokens(o, 4096, 1000, std::int64_t{1} << 40), 32 * 4096);
  // Little memory: a quarter of it...
  EXPECT_EQ(kv_pool_tokens(o, 4096, 1000, 40'000'000), 10'000);
  // ...but never less than one context.
  EXPECT_EQ(kv_pool_tokens(o, 4096, 1000, 1'000'000), 4096);
  // Unknown memory: max_sequences contexts.
  EXPECT_EQ(kv_pool_tokens(o, 4096, 1000, 0), 32 * 4096);
  o.kv_bytes = 50'000'000;
  EXPECT_EQ(kv_pool_tokens(o, 4096, 1000, 0), 50'000);
  o.kv_tokens = 8192;  // tokens win over bytes
  EXPECT_EQ(kv_pool_tokens(o, 4096, 1000, 0), 8192);
  EXPECT_GT(available_memory_bytes(), 0);
}

TEST(LocalBackend, PromptLongerThanTheContextIsANonRetryable400) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options(64));
  Request long_request = hello_request(8);
  std::string words;
  for (int i = 0; i < 80; ++i) words += " the cat";
  long_request.messages = {{"user", words}};
  Call call;
  asio::co_spawn(io, call_complete(backend, long_request, call), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&call}));
  ASSERT_FALSE(call.thrown) << describe_exception(call.thrown);
  ASSERT_FALSE(call.outcome->ok());
  const Error& e = *call.outcome->error;
  EXPECT_EQ(e.kind, ErrorKind::Http);
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.should_retry, std::optional<bool>(false));
  EXPECT_NE(e.message.find("context"), std::string::npos) << e.message;
  EXPECT_TRUE(call.pieces.empty());

  // The backend serves the next request.
  Call next;
  asio::co_spawn(io, call_complete(backend, hello_request(4), next), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&next}));
  ASSERT_TRUE(next.outcome && next.outcome->ok());
}

// A prompt is tokenized off the caller's thread: the real model's tokenizer takes a few tenths
// of a second over 400 KB of letters without a space (one pre-tokenizer piece, the slowest
// case), and serve's I/O thread, which writes every other stream, must not wait for it. No
// handler the io_context runs while the request is prepared may take a quarter of that time.
// (The prompt is too long for the context once tokenized, so it ends in a 400 without a step.)
TEST(LocalBackend, TokenizingALongPromptDoesNotHoldTheCallersThread) {
  const fs::path model = fs::path(BATCHLM_SOURCE_DIR) / "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(model)) GTEST_SKIP() << model << " is absent (scripts/fetch-model.sh fetches it)";
  std::mt19937 random(7);
  std::string letters(400'000, 'a');
  for (char& c : letters) c = static_cast<char>('a' + random() % 10);

  const Tokenizer tokenizer(Vocab::from_gguf(gguf::File::open(model)));
  const auto t0 = std::chrono::steady_clock::now();
  const std::size_t n_tokens = tokenizer.encode(letters, false).size();
  const auto tokenize_time = std::chrono::steady_clock::now() - t0;

  asio::io_context io;
  LocalBackend backend(io.get_executor(), LocalBackendOptions{model, 1, 4096});
  ASSERT_GT(n_tokens, 4096u);
  Request request;
  request.prompt = letters;
  request.max_tokens = 1;
  Call call;
  asio::co_spawn(io, call_complete(backend, request, call), asio::detached);
  std::chrono::steady_clock::duration longest{};
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!call.outcome && !call.thrown && std::chrono::steady_clock::now() < deadline) {
    const auto start = std::chrono::steady_clock::now();
    if (io.poll_one() == 0) {
      std::this_thread::sleep_for(1ms);
      continue;
    }
    longest = std::max(longest, std::chrono::steady_clock::now() - start);
  }
  ASSERT_FALSE(call.thrown) << describe_exception(call.thrown);
  ASSERT_TRUE(call.outcome);
  ASSERT_FALSE(call.outcome->ok());
  EXPECT_EQ(call.outcome->error->http_status, 400);
  EXPECT_NE(call.outcome->error->message.find("context"), std::string::npos) << call.outcome->error->message;
  const auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
  EXPECT_LT(ms(longest), ms(tokenize_time) / 4)
      << "the longest handler took " << ms(longest) << " ms; tokenizing takes " << ms(tokenize_time) << " ms";
}

// Terminal cancellation of one of two requests that the engine runs together (continuous
// batching): its coroutine is suspended in the receive, so this is the plain path:
// ErrorKind::Cancelled, the engine drops the sequence, the other one is unharmed, and the
// backend serves the next.
TEST(LocalBackend, CancellingAQueuedRequestReturnsCancelledAndTheBackendGoesOn) {
  const fs::path path = TinyModelFile::get().path().parent_path() / "long-context-queued.gguf";
  batchlm::testing::TinyLlamaOptions options;
  options.context_length = 2048;
  batchlm::testing::write_tiny_llama(path, options);
  asio::io_context io;
  LocalBackend backend(io.get_executor(), LocalBackendOptions{path, 1, 0});
  asio::cancellation_signal cancel_queued;
  Call running, queued;
  // The running request has some 1500 tokens to go (about 0.1 s) when it cancels the other.
  running.on_piece = [&] {
    if (running.pieces.size() == 1) cancel_queued.emit(asio::cancellation_type::terminal);
  };
  Request request = hello_request(1500);
  asio::co_spawn(io, call_complete(backend, request, running), asio::detached);
  asio::co_spawn(io, call_complete(backend, hello_request(8), queued),
                 asio::bind_cancellation_slot(cancel_queued.slot(), asio::detached));
  ASSERT_TRUE(run_until_done(io, {&running, &queued}));
  ASSERT_FALSE(queued.thrown) << describe_exception(queued.thrown);
  ASSERT_FALSE(queued.outcome->ok());
  EXPECT_EQ(queued.outcome->error->kind, ErrorKind::Cancelled);
  EXPECT_LE(queued.pieces.size(), 2u);  // cancelled within a step or two of its start
  ASSERT_FALSE(running.thrown) << describe_exception(running.thrown);
  ASSERT_TRUE(running.outcome->ok()) << running.outcome->error->message;
  EXPECT_EQ(running.outcome->completion->usage.completion_tokens, 1500);

  Call next;
  asio::co_spawn(io, call_complete(backend, hello_request(8), next), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&next}));
  ASSERT_FALSE(next.thrown) << describe_exception(next.thrown);
  ASSERT_TRUE(next.outcome->ok()) << next.outcome->error->message;
  EXPECT_EQ(next.joined(), next.outcome->completion->text);
}

// Terminal cancellation from a handler of its own (the way the runner's stop emits it), at a
// moment when pieces are already waiting in the channel: the sink holds the io thread for 50 ms
// on the first piece (the engine sends the rest meanwhile) and posts the emit, which then runs
// before the completion of the next receive. Backend::complete must return ErrorKind::Cancelled.
TEST(LocalBackend, CancellationWithPiecesAlreadySentReturnsCancelled) {
  asio::io_context io;
  LocalBackend backend(io.get_executor(), tiny_options());
  asio::cancellation_signal signal;
  Call call;
  call.on_piece = [&] {
    if (call.pieces.size() != 1) return;
    std::this_thread::sleep_for(50ms);
    asio::post(io, [&] { signal.emit(asio::cancellation_type::terminal); });
  };
  asio::co_spawn(io, call_complete(backend, hello_request(200), call),
                 asio::bind_cancellation_slot(signal.slot(), asio::detached));
  ASSERT_TRUE(run_until_done(io, {&call}));
  EXPECT_FALSE(call.thrown) << "complete() threw: " << describe_exception(call.thrown);
  if (call.outcome) {
    ASSERT_FALSE(call.outcome->ok());
    EXPECT_EQ(call.outcome->error->kind, ErrorKind::Cancelled);
  }
  EXPECT_LT(call.pieces.size(), 200u);

  Call next;
  asio::co_spawn(io, call_complete(backend, hello_request(8), next), asio::detached);
  ASSERT_TRUE(run_until_done(io, {&next}));
  ASSERT_FALSE(next.thrown) << describe_exception(next.thrown);
  ASSERT_TRUE(next.outcome->ok()) << next.outcome->error->message;
}

// The same cancellation arriving while complete() is running rather than suspended: here from
// inside the sink; in the runner, when its stop fires after a piece has been received but before
// the coroutine has resumed to take it. Backend::complete must still return
// ErrorKind::Cancelled (it "never throws" for request-level failures) and the engine must drop
// the request.
//
// (A complete() that let Asio throw "Operation canceled" from its next co_await, instead of
// returning Cancelled and marking the job, left the engine thread generating for nobody until
// the channel filled, and then stuck for good: this test guards against that.)
TEST(LocalBackend, CancellationDuringTheSinkReturnsCancelledAndTheBackendGoesOn) {
  // A context long enough for more pieces than the channel holds.
  const fs::path path = TinyModelFile::get().path().parent_path() / "long-context.gguf";
  batchlm::testing::TinyLlamaOptions options;
  options.context_length = 2048;
  batchlm::testing::write_tiny_llama(path, options);
  // Both on the heap: if the engine thread gets stuck they are leaked rather than destroyed
  // under it (its channel needs the io_context).
  auto io_owner = std::make_unique<asio::io_context>();
  asio::io_context& io = *io_owner;
  auto backend = std::make_unique<LocalBackend>(io.get_executor(), LocalBackendOptions{path, 1, 0});
  asio::cancellation_signal signal;
  Call call;
  call.on_piece = [&] {
    if (call.pieces.size() == 1) signal.emit(asio::cancellation_type::terminal);
  };
  Request request = hello_request(1500);
  asio::co_spawn(io, call_complete(*backend, request, call),
                 asio::bind_cancellation_slot(signal.slot(), asio::detached));
  ASSERT_TRUE(run_until_done(io, {&call}));
  EXPECT_FALSE(call.thrown) << "complete() threw: " << describe_exception(call.thrown);
  if (call.outcome) {
    ASSERT_FALSE(call.outcome->ok());
    EXPECT_EQ(call.outcome->error->kind, ErrorKind::Cancelled);
  }
  EXPECT_EQ(call.pieces.size(), 1u);

  // 1500 tokens take the tiny model well under a second; the next request must not wait for
  // more than that.
  Call next;
  asio::co_spawn(io, call_complete(*backend, hello_request(8), next), asio::detached);
  if (!run_until_done(io, {&next}, 5s)) {
    // The engine thread is stuck: ~LocalBackend would join it forever. Leak it instead.
    (void)backend.release();
    (void)io_owner.release();
    FAIL() << "the backend did not serve the next request after a cancelled one";
  }
  ASSERT_FALSE(next.thrown) << describe_exception(next.thrown);
  ASSERT_TRUE(next.outcome->ok()) << next.outcome->error->message;
}

}  // namespace
}  // namespace batchlm::local_engine
