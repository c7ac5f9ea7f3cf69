// Log-probabilities and logit biases on the embedded engine: position_logprobs against a
// log-softmax written out here, the Sampler's biases, Generation's alignment of tokens with the
// text it lets out (stop strings, characters split across tokens), and the BatchEngine and
// LocalBackend on the default model (batched as alone, with and without drafts).

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>

#include "batchlm/local_engine/batch_engine.hpp"
#include "batchlm/local_engine/engine.hpp"
#include "default_model.hpp"
#include "batchlm/local_engine/local_backend.hpp"
#include "batchlm/local_engine/sampling.hpp"

namespace batchlm::local_engine {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;

// ---- position_logprobs -------------------------------------------------------------------------

std::vector<double> log_softmax(const std::vector<float>& logits) {
  double max = logits[0];
  for (float l : logits) max = std::max<double>(max, l);
  double sum = 0;
  for (float l : logits) sum += std::exp(l - max);
  std::vector<double> out;
  for (float l : logits) out.push_back(l - max - std::log(sum));
  return out;
}

TEST(PositionLogprobs, AreTheLogSoftmaxOfTheLogitsWithTheBestFirst) {
  const std::vector<float> logits = {1.5f, -2.0f, 3.25f, 0.0f, 3.25f, -40.0f, 2.0f};
  const std::vector<double> expected = log_softmax(logits);
  const PositionLogprobs p = position_logprobs(logits, 1, 4);
  EXPECT_EQ(p.token, 1);
  EXPECT_NEAR(p.logprob, expected[1], 1e-6);
  // Ties by the lower id: 2 before 4.
  ASSERT_EQ(p.top.size(), 4u);
  const std::vector<Token> order = {2, 4, 6, 0};
  for (std::size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(p.top[i].first, order[i]) << i;
    EXPECT_NEAR(p.top[i].second, expected[static_cast<std::size_t>(order[i])], 1e-6) << i;
  }
  double total = 0;
  for (double lp : expected) total += std::exp(lp);
  EXPECT_NEAR(total, 1.0, 1e-12);
}

TEST(PositionLogprobs, NoAlternativesAndMoreThanTheVocabulary) {
  const std::vector<float> logits = {0.0f, 1.0f};
  EXPECT_TRUE(position_logprobs(logits, 0, 0).top.empty());
  EXPECT_NEAR(position_logprobs(logits, 0, 0).logprob, std::log(1.0 / (1.0 + std::exp(1.0))), 1e-6);
  EXPECT_EQ(position_logprobs(logits, 0, 20).top.size(), 2u);
}

TEST(PositionLogprobs, FarTokensAreExactToo) {
  // Tokens 200 nats below the best are skipped from the sum but still get their own logprob.
  std::vector<float> logits(1000, -200.0f);
  logits[7] = 5.0f;
  const PositionLogprobs p = position_logprobs(logits, 3, 2);
  EXPECT_NEAR(p.logprob, -205.0f, 1e-3);
  EXPECT_EQ(p.top[0].first, 7);
  EXPECT_NEAR(p.top[0].second, 0.0f, 1e-6);
  EXPECT_EQ(p.top[1].first, 0);
}

// ---- logit_bias ----------------------------------------------------------------------------------

TEST(LogitBias, MovesGreedyAndSampledChoices) {
  const std::vector<float> logits = {1.0f, 4.0f, 2.0f, 3.0f};
  SamplingParams greedy{.temperature = 0.0f};
  EXPECT_EQ(Sampler(greedy).sample(logits), 1);
  greedy.logit_bias = {{1, -100.0f}};
  EXPECT_TRUE(greedy.adjusted());
  EXPECT_EQ(Sampler(greedy).sample(logits), 3);
  greedy.logit_bias = {{0, 100.0f}, {2, 2.5f}};
  EXPECT_EQ(Sampler(greedy).sample(logits), 0);

  // Sampled: a token biased by -100 never comes, one biased by +100 always does.
  SamplingParams sampled{.temperature = 1.0f, .seed = 7};
  sampled.logit_bias = {{1, -100.0f}, {3, -100.0f}};
  Sampler banned(sampled);
  for (int i = 0; i < 200; ++i) {
    const Token t = banned.sample(logits);
    EXPECT_TRUE(t == 0 || t == 2) << t;
  }
  sampled.logit_bias = {{0, 100.0f}};
  Sampler forced(sampled);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(forced.sample(logits), 0);
}

// ---- the default model -----------------------------------------------------------------------------

using testing::default_model;
const fs::path& model_path() { return testing::default_model_path(); }

std::string bytes_of(const std::vector<TokenLogprob>& logprobs) {
  std::string s;
  for (const TokenLogprob& t : logprobs) s += t.token;
  return s;
}

// Feeds `tokens` to a Generation with made-up log-probabilities (token i: -i), collecting the
// text and entries as an engine would.
struct Fed {
  std::string text;
  std::vector<TokenLogprob> logprobs;
  std::string reason;
};
Fed feed(const Tokenizer& tokenizer, const std::vector<Token>& tokens, std::vector<std::string> stop) {
  GenerateParams params;
  params.stop = std::move(stop);
  params.logprobs = 1;
  Generation gen(tokenizer, params, {});
  Fed out;
  auto take = [&] {
    for (TokenLogprob& t : gen.take_logprobs()) out.logprobs.push_back(std::move(t));
  };
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    PositionLogprobs lp{tokens[i], -static_cast<float>(i), {{tokens[i], -static_cast<float>(i)}}};
    std::string text;
    const bool done = gen.accept(tokens[i], text, &lp);
    out.text += text;
    take();
    if (done) break;
  }
  out.text += gen.flush();
  take();
  out.reason = gen.finish_reason();
  return out;
}

// A stop string that is a control token's text ("<|im_start|>", which a model may write after
// its turn instead of ending it) stops where that token is generated: the token is never
// written as text, so the string alone would never be seen. Its log-probability is not an
// entry, as the end of the turn's is not.
TEST(GenerationStops, AtAControlTokenWhoseTextIsAStopString) {
  REQUIRE_DEFAULT_MODEL();
  const Tokenizer& tok = default_model()->tokenizer();
  const Token start = tok.find("<|im_start|>");
  ASSERT_GE(start, 0);
  std::vector<Token> tokens = tok.encode("Hello there", false);
  const std::size_t before = tokens.size();
  tokens.push_back(start);
  for (Token t : tok.encode("user more", false)) tokens.push_back(t);
  const Fed stopped = feed(tok, tokens, {"<|im_start|>"});
  EXPECT_EQ(stopped.text, "Hello there");
  EXPECT_EQ(stopped.reason, "stop");
  EXPECT_EQ(stopped.logprobs.size(), before);
  // Without it the token passes unwritten; text that merely reads like it is not a control token.
  const Fed on = feed(tok, tokens, {});
  EXPECT_EQ(on.text, "Hello thereuser more");
  EXPECT_EQ(feed(tok, tokens, {"<|im_start"}).text, "Hello thereuser more");
}

TEST(GenerationLogprobs, OneEntryPerTokenOfTheText) {
  REQUIRE_DEFAULT_MODEL();
  const Tokenizer& tok = default_model()->tokenizer();
  const std::vector<Token> tokens = tok.encode("The answer is 42, naïvely — done.", false);
  const Fed fed = feed(tok, tokens, {});
  ASSERT_EQ(fed.logprobs.size(), tokens.size());
  EXPECT_EQ(bytes_of(fed.logprobs), fed.text);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(fed.logprobs[i].logprob, -static_cast<double>(i));
    ASSERT_EQ(fed.logprobs[i].top_logprobs.size(), 1u);
    EXPECT_EQ(fed.logprobs[i].top_logprobs[0].token, fed.logprobs[i].token);
  }
}

TEST(GenerationLogprobs, AStopStringKeepsTheTokensThatStartBeforeIt) {
  REQUIRE_DEFAULT_MODEL();
  const Tokenizer& tok = default_model()->tokenizer();
  const std::vector<Token> tokens = tok.encode("Step one. Answer: 42\nQuestion: next", false);
  // A stop string at a token boundary: the tokens before it, which make up the text.
  const Fed fed = feed(tok, tokens, {" Answer"});
  EXPECT_EQ(fed.reason, "stop");
  EXPECT_EQ(fed.text, "Step one.");
  EXPECT_EQ(bytes_of(fed.logprobs), fed.text);
  // One that starts inside a token (" Answer"): that token is kept, whole.
  const Fed inside = feed(tok, tokens, {"nswer"});
  EXPECT_EQ(inside.text, "Step one. A");
  EXPECT_EQ(bytes_of(inside.logprobs), "Step one. Answer");
  EXPECT_EQ(inside.logprobs.size(), fed.logprobs.size() + 1);
}

TEST(GenerationLogprobs, TokensSplittingACharacterComeOutWithIt) {
  REQUIRE_DEFAULT_MODEL();
  const Tokenizer& tok = default_model()->tokenizer();
  // A character the vocabulary has no token for is spelled in byte tokens.
  std::vector<Token> tokens = tok.encode("a \xF0\x9F\xA6\x86 b", false);
  const Fed fed = feed(tok, tokens, {});
  EXPECT_EQ(fed.text, "a \xF0\x9F\xA6\x86 b");
  ASSERT_EQ(fed.logprobs.size(), tokens.size());
  EXPECT_EQ(bytes_of(fed.logprobs), fed.text);
  bool partial = false;
  for (const TokenLogprob& t : fed.logprobs) partial = partial || logprob_token_text(t.token) != t.token;
  EXPECT_TRUE(partial) << "expected a token that is not whole UTF-8";
}

TEST(GenerationLogprobs, TheEndOfTheTurnHasNoEntry) {
  REQUIRE_DEFAULT_MODEL();
  const Tokenizer& tok = default_model()->tokenizer();
  std::vector<Token> tokens = tok.encode("Done", false);
  tokens.push_back(tok.vocab().eos);
  const Fed fed = feed(tok, tokens, {});
  EXPECT_EQ(fed.reason, "stop");
  EXPECT_EQ(fed.logprobs.size(), tokens.size() - 1);
  EXPECT_EQ(bytes_of(fed.logprobs), "Done");
}

struct EngineRun {
  std::map<std::size_t, GenerateResult> results;
  std::map<std::size_t, std::string> streamed;
  std::map<std::size_t, std::vector<TokenLogprob>> streamed_logprobs;
};

EngineRun run_engine(const std::vector<std::string>& prompts, const GenerateParams& params, bool together,
               SpecMethod method = SpecMethod::kNone) {
  LocalBackendOptions o;
  o.threads = 2;
  o.context = 512;
  o.max_sequences = 4;
  o.speculative.method = method;
  BatchEngine engine(default_model(), o);
  EngineRun run;
  std::map<SequenceId, std::size_t> index;
  auto drain = [&] {
    while (!engine.idle()) {
      engine.step();
      for (auto& [id, result] : engine.take_finished()) run.results[index.at(id)] = std::move(result);
    }
  };
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    index[engine.add(text_prompt_tokens(*default_model(), prompts[i]), params,
                     [&run, i](std::string_view text, std::span<const TokenLogprob> logprobs) {
                       run.streamed[i] += text;
                       run.streamed_logprobs[i].insert(run.streamed_logprobs[i].end(), logprobs.begin(),
                                                       logprobs.end());
                       return true;
                     })] = i;
    if (!together) drain();
  }
  drain();
  return run;
}

bool same(const std::vector<TokenLogprob>& a, const std::vector<TokenLogprob>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].token != b[i].token || a[i].logprob != b[i].logprob || a[i].top_logprobs.size() != b[i].top_logprobs.size())
      return false;
    for (std::size_t k = 0; k < a[i].top_logprobs.size(); ++k)
      if (a[i].top_logprobs[k].token != b[i].top_logprobs[k].token ||
          a[i].top_logprobs[k].logprob != b[i].top_logprobs[k].logprob)
        return false;
  }
  return true;
}

const std::vector<std::string>& prompts() {
  static const std::vector<std::string> p = {
      "Question: Janet has 3 apples and buys 5 more. How many apples does she have?\nAnswer:",
      "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.\n",
      "Write a haiku about the sea:\n"};
  return p;
}

GenerateParams greedy(std::int64_t max_tokens, int logprobs = -1) {
  GenerateParams params;
  params.max_tokens = max_tokens;
  params.sampling.temperature = 0.0f;
  params.logprobs = logprobs;
  return params;
}

TEST(EngineLogprobs, GreedyTokensAreTheMostLikelyAndMatchTheText) {
  REQUIRE_DEFAULT_MODEL();
  GenerateParams params = greedy(24, 3);
  params.stop = {"\n\n"};
  const EngineRun run = run_engine(prompts(), params, true);
  for (const auto& [i, r] : run.results) {
    SCOPED_TRACE(prompts()[i]);
    ASSERT_FALSE(r.logprobs.empty());
    EXPECT_EQ(bytes_of(r.logprobs).substr(0, r.text.size()), r.text);
    EXPECT_TRUE(same(run.streamed_logprobs.at(i), r.logprobs));
    EXPECT_EQ(run.streamed.at(i), r.text);
    for (const TokenLogprob& t : r.logprobs) {
      ASSERT_EQ(t.top_logprobs.size(), 3u);
      EXPECT_EQ(t.top_logprobs[0].token, t.token);
      EXPECT_EQ(t.top_logprobs[0].logprob, t.logprob);
      EXPECT_LE(t.logprob, 0.0);
      double mass = 0;
      for (const TopLogprob& a : t.top_logprobs) mass += std::exp(a.logprob);
      EXPECT_LE(mass, 1.0 + 1e-6);
      EXPECT_GE(t.top_logprobs[0].logprob, t.top_logprobs[1].logprob);
      EXPECT_GE(t.top_logprobs[1].logprob, t.top_logprobs[2].logprob);
    }
  }
}

TEST(EngineLogprobs, BatchedAloneAndWithDraftsAreTheSame) {
  REQUIRE_DEFAULT_MODEL();
  const GenerateParams params = greedy(20, 2);
  const EngineRun alone = run_engine(prompts(), params, false);
  const EngineRun together = run_engine(prompts(), params, true);
  const EngineRun drafted = run_engine(prompts(), params, true, SpecMethod::kNgram);
  for (std::size_t i = 0; i < prompts().size(); ++i) {
    SCOPED_TRACE(prompts()[i]);
    EXPECT_EQ(together.results.at(i).tokens, alone.results.at(i).tokens);
    EXPECT_TRUE(same(together.results.at(i).logprobs, alone.results.at(i).logprobs));
    EXPECT_EQ(drafted.results.at(i).tokens, alone.results.at(i).tokens);
    EXPECT_TRUE(same(drafted.results.at(i).logprobs, alone.results.at(i).logprobs));
  }
}

TEST(EngineLogprobs, SampledTokensCarryTheirOwnLogprob) {
  REQUIRE_DEFAULT_MODEL();
  GenerateParams params;
  params.max_tokens = 16;
  params.sampling.temperature = 1.0f;
  params.sampling.seed = 11;
  params.logprobs = 0;
  const EngineRun run = run_engine({prompts()[2]}, params, true);
  const GenerateResult& r = run.results.at(0);
  ASSERT_EQ(r.logprobs.size(), static_cast<std::size_t>(r.stats.generated_tokens) -
                                   (r.finish_reason == "stop" ? 1u : 0u));
  for (std::size_t k = 0; k < r.logprobs.size(); ++k) {
    EXPECT_TRUE(r.logprobs[k].top_logprobs.empty());
    EXPECT_EQ(r.logprobs[k].token, default_model()->tokenizer().token_bytes(r.tokens[k]));
  }
}

TEST(EngineLogprobs, ABiasedTokenOutsideTheVocabularyOrTooManyAlternativesAreRefused) {
  REQUIRE_DEFAULT_MODEL();
  LocalBackendOptions o;
  o.threads = 1;
  o.context = 128;
  BatchEngine engine(default_model(), o);
  const std::vector<Token> prompt = text_prompt_tokens(*default_model(), "Hello");
  GenerateParams params;
  params.sampling.logit_bias = {{static_cast<Token>(default_model()->config().n_vocab), 1.0f}};
  EXPECT_THROW(engine.add(prompt, params, nullptr), RequestRejected);
  params.sampling.logit_bias.clear();
  params.logprobs = kMaxLogprobs + 1;
  EXPECT_THROW(engine.add(prompt, params, nullptr), RequestRejected);
}

TEST(EngineLogprobs, ABiasBansTheGreedyTokenAndDraftsStayOff) {
  REQUIRE_DEFAULT_MODEL();
  GenerateParams params = greedy(12);
  const EngineRun plain = run_engine({prompts()[1]}, params, true);
  const Token first = plain.results.at(0).tokens.at(0);
  params.sampling.logit_bias = {{first, -100.0f}};
  const EngineRun biased = run_engine({prompts()[1]}, params, true, SpecMethod::kNgram);
  const GenerateResult& r = biased.results.at(0);
  for (Token t : r.tokens) EXPECT_NE(t, first);
  EXPECT_NE(r.tokens, plain.results.at(0).tokens);
}

// ---- LocalBackend -------------------------------------------------------------------------------

struct Call {
  std::optional<Outcome> outcome;
  std::string streamed;
  std::vector<TokenLogprob> logprobs;
};

Call complete_on(LocalBackend& backend, asio::io_context& io, const Request& request) {
  Call call;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        call.outcome = co_await backend.complete(request, [&](std::string_view text, std::span<const TokenLogprob> lp, TextPart) {
          call.streamed += text;
          call.logprobs.insert(call.logprobs.end(), lp.begin(), lp.end());
        });
      },
      asio::detached);
  io.restart();
  io.run();
  return call;
}

// The default model behind the Backend seam, and a chat request for it.
struct Served {
  Served() : backend(io.get_executor(), options()) {}
  static LocalBackendOptions options() {
    LocalBackendOptions o;
    o.model = model_path();
    o.threads = 2;
    o.context = 256;
    o.max_sequences = 2;
    return o;
  }
  Call complete(const Request& r) { return complete_on(backend, io, r); }
  asio::io_context io;
  LocalBackend backend;
};

Request chat_request(std::string text, int max_tokens) {
  Request r;
  r.messages = {{"user", std::move(text)}};
  r.max_tokens = max_tokens;
  return r;
}

TEST(LocalBackendLogprobs, ExtraFieldsAskForThemInEitherApisForm) {
  REQUIRE_DEFAULT_MODEL();
  Served served;
  Request r = chat_request("Say hello.", 8);
  r.temperature = 0;

  // Not asked: none.
  Call plain = served.complete(r);
  ASSERT_TRUE(plain.outcome && plain.outcome->ok());
  EXPECT_FALSE(plain.outcome->completion->logprobs);
  EXPECT_TRUE(plain.logprobs.empty());

  // Chat form.
  r.extra = {{"logprobs", true}, {"top_logprobs", 2}};
  Call chat = served.complete(r);
  ASSERT_TRUE(chat.outcome && chat.outcome->ok()) << chat.outcome->error->message;
  const Completion& c = *chat.outcome->completion;
  ASSERT_TRUE(c.logprobs);
  EXPECT_EQ(c.text, plain.outcome->completion->text);
  EXPECT_EQ(bytes_of(*c.logprobs).substr(0, c.text.size()), c.text);
  EXPECT_TRUE(same(chat.logprobs, *c.logprobs));
  for (const TokenLogprob& t : *c.logprobs) EXPECT_EQ(t.top_logprobs.size(), 2u);

  // Completions form: a count.
  r.extra = {{"logprobs", 1}};
  Call count = served.complete(r);
  ASSERT_TRUE(count.outcome && count.outcome->ok());
  ASSERT_TRUE(count.outcome->completion->logprobs);
  for (const TokenLogprob& t : *count.outcome->completion->logprobs) EXPECT_EQ(t.top_logprobs.size(), 1u);

  // On, with no alternatives.
  r.extra = {{"logprobs", true}};
  Call bare = served.complete(r);
  ASSERT_TRUE(bare.outcome && bare.outcome->ok());
  ASSERT_TRUE(bare.outcome->completion->logprobs);
  EXPECT_EQ(bare.outcome->completion->logprobs->size(), c.logprobs->size());
  for (const TokenLogprob& t : *bare.outcome->completion->logprobs) EXPECT_TRUE(t.top_logprobs.empty());
}

TEST(LocalBackendLogprobs, InconsistentOrOutOfRangeFieldsAre400s) {
  REQUIRE_DEFAULT_MODEL();
  Served served;
  Request r = chat_request("Hi", 2);
  auto error_of = [&](nlohmann::json extra) {
    r.extra = std::move(extra);
    Call call = served.complete(r);
    EXPECT_TRUE(call.outcome && !call.outcome->ok());
    return call.outcome && call.outcome->error ? *call.outcome->error : Error{};
  };
  Error e = error_of({{"top_logprobs", 3}});
  EXPECT_EQ(e.http_status, 400);
  EXPECT_NE(e.message.find("'top_logprobs': needs logprobs: true"), std::string::npos) << e.message;
  e = error_of({{"logprobs", 21}});
  EXPECT_NE(e.message.find("'logprobs'"), std::string::npos) << e.message;
  e = error_of({{"logit_bias", {{"99999999", 5}}}});
  EXPECT_NE(e.message.find("outside the vocabulary"), std::string::npos) << e.message;
  e = error_of({{"logit_bias", {{"abc", 5}}}});
  EXPECT_NE(e.message.find("not a token id"), std::string::npos) << e.message;
  e = error_of({{"logit_bias", {{"12", 101}}}});
  EXPECT_NE(e.message.find("from -100 to 100"), std::string::npos) << e.message;
}

}  // namespace
}  // namespace batchlm::local_engine
