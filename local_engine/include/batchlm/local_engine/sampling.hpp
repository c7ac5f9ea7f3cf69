#pragma once
// Choosing the next token from logits (greedy, temperature, top-k, top-p, a seed per request),
// and watching the generated text for stop strings.

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "batchlm/local_engine/tokenizer.hpp"

namespace batchlm::local_engine {

struct SamplingParams {
  float temperature = 0.8f;  // <= 0: greedy
  float top_p = 1.0f;        // nucleus: the smallest set of tokens with this much probability
  int top_k = 0;             // 0: no limit
  // min-p: only tokens whose probability is at least min_p times the best's (0: no limit).
  // Like top_k it keeps a run of the best; top_p then cuts what both leave.
  float min_p = 0.0f;
  std::uint64_t seed = 0;
  // OpenAI's penalties over the tokens generated so far: each token's logit less
  // frequency_penalty times its count, and presence_penalty once it has appeared at all.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // vLLM's and Hugging Face's repetition_penalty (> 0; 1: none): the logit of every token in the
  // prompt or generated so far divided by it where positive, multiplied by it where not, before
  // the other penalties and the biases.
  float repetition_penalty = 1.0f;
  // OpenAI's logit_bias: added to these tokens' logits before sampling (-100 bans a token in
  // practice, 100 forces it).
  std::vector<std::pair<Token, float>> logit_bias;
  // vLLM's min_tokens: the tokens that would end the generation (Sampler::hold_back) cannot be
  // sampled until this many have been generated.
  std::int64_t min_tokens = 0;
  // vLLM's bad_words as token sequences (bad_word_sequences): a sequence's last token cannot be
  // sampled where the tokens generated last are the rest of it (a one-token sequence: never).
  std::vector<std::vector<Token>> bad_words;
  bool penalized() const { return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f; }
  // Logits changed before sampling (penalties or biases): sampled on the CPU only, and not
  // drafted for (a verifier sees the model's own logits).
  bool adjusted() const { return penalized() || !logit_bias.empty() || min_tokens > 0 || !bad_words.empty(); }
};

// The model's log-probabilities at one position, a log-softmax of its logits as they are
// (before temperature, top-k, top-p, penalties and biases): the chosen token's, and the `top`
// most likely tokens' (most likely first, the lower id first on ties).
struct PositionLogprobs {
  Token token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<Token, float>> top;
};
PositionLogprobs position_logprobs(std::span<const float> logits, Token token, int top);

// The distribution a Sampler draws from: tokens with unnormalised weights, in id order (which
// probability() relies on); every token not listed has probability 0.
struct TokenDistribution {
  std::vector<Token> tokens;
  std::vector<double> weights;
  double total = 0.0;

  bool empty() const { return tokens.empty(); }
  // The probability of `token` (0 when not listed), by binary search of the ids.
  double probability(Token token) const;
  // Draws with u uniform in [0, 1).
  Token draw(double u) const;
  // A point mass on `token`.
  static TokenDistribution point(Token token);
};

// Whether a row of the model's raw logits holds a NaN or an infinity: the forward pass broke
// down (weights or settings of the model that do not work), and no token can be chosen from it.
bool broken_logits(std::span<const float> logits);
// What a request that met broken logits fails with.
std::string broken_logits_message(std::int64_t generated);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  Token sample(std::span<const float> logits);

  // True when sample() takes the argmax (temperature <= 0 or top_k == 1) and uses no randomness.
  bool greedy() const { return params_.temperature <= 0.0f || params_.top_k == 1; }
  // The distribution sample() draws from for these logits (not for a greedy sampler).
  // sample(logits) == distribution(logits).draw(uniform()) for the same generator state.
  TokenDistribution distribution(std::span<const float> logits);
  // [0, 1) from the request's own generator (53 bits).
  double uniform();
  const SamplingParams& params() const { return params_; }
  // A token generated for this request, counted for the penalties.
  void observe(Token token);
  // The request's prompt, which the repetition penalty counts as well.
  void observe_prompt(std::span<const Token> prompt);
  // The tokens that end the generation (the end of the turn, stop tokens): their logits are
  // -infinity, after the penalties and biases, while fewer than min_tokens tokens have been
  // observed.
  void hold_back(std::vector<Token> ends);

 private:
  // The logits with the penalties and biases applied (a copy), or the logits themselves
  // without any.
  std::span<const float> adjust(std::span<const float> logits);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<Token, std::int32_t>> counts_;  // generated tokens and their counts
  std::vector<Token> seen_;  // for the repetition penalty: the prompt's and generated tokens, sorted, once each
  std::vector<Token> ends_;  // held back until min_tokens
  std::int64_t observed_ = 0;  // tokens generated
  std::vector<Token> recent_;  // for bad_words: the tokens generated last, as many as the longest less one
  std::size_t recent_limit_ = 0;
  std::vector<Token> banned_;  // adjust()'s: the tokens it sets to -infinity
  std::vector<float> adjusted_;
};

// Watches text as it is generated for any of the stop strings. feed() returns the part of the
// text that is safe to show: everything except a tail that could still become a stop string.
// Once a stop string is seen, stopped() is true and the text before it has been returned.
// Text fed with `armed` false (the first min_tokens tokens') cannot stop the generation: a
// stop string counts only where it ends in text fed armed.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  std::string feed(std::string_view text, bool armed = true);
  std::string finish();  // the held-back tail, when generation ends for another reason
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::size_t longest_ = 0;
  std::string pending_;
  std::size_t unarmed_ = 0;  // how much of pending_ was fed unarmed (its start)
  bool stopped_ = false;
};

}  // namespace batchlm::local_engine
