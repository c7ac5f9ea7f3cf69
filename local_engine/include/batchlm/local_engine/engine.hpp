#pragma once
// One sequence at a time through the model: prompt in chunks, then token by token, with
// sampling, stop strings and streaming text. `batchlm generate` calls it directly; the engine
// thread of LocalBackend calls it for each request it takes off its queue.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "batchlm/core/types.hpp"
#include "batchlm/kernels/thread_pool.hpp"
#include "batchlm/local_engine/model.hpp"
#include "batchlm/local_engine/sampling.hpp"

namespace batchlm::local_engine {

struct EngineOptions {
  int threads = 0;             // 0: one per hardware thread
  std::int64_t context = 0;    // tokens per sequence; 0: min(training context, 4096)
};

struct GenerateParams {
  std::int64_t max_tokens = 0;  // 0: until the context is full
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool ignore_eos = false;      // keep going past end-of-generation tokens (benchmarks)
};

struct GenerateStats {
  std::int64_t prompt_tokens = 0;
  std::int64_t cached_prompt_tokens = 0;  // reused from the previous request's cache
  std::int64_t generated_tokens = 0;  // sampled tokens, an end-of-generation token included
  std::int64_t decode_steps = 0;      // single-token forward passes after the prompt
  double prompt_ms = 0;               // the prompt's forward passes and the first sample
  double generate_ms = 0;             // the decode steps and their samples
};

struct GenerateResult {
  std::string text;
  std::vector<Token> tokens;  // the generated token ids, an end-of-generation token included
  std::string finish_reason;  // "stop" (end of turn or a stop string), "length", "cancelled"
  GenerateStats stats;
};

// The output side of one request: samples each next token, recognises the end of the turn and
// the stop strings, and turns tokens into text that never splits a UTF-8 character nor shows
// the start of a stop string. Engine::generate and LocalBackend's batching loop both use it.
class Generation {
 public:
  Generation(const Tokenizer& tokenizer, const GenerateParams& params);
  // Samples the next token from `logits` and sets `text` to the text that became final (maybe
  // empty). True when generation is over for a reason of its own (finish_reason() says which).
  bool next(std::span<const float> logits, Token& token, std::string& text);
  // The same for a token chosen elsewhere (speculative decoding's verifier).
  bool accept(Token token, std::string& text);
  Sampler& sampler() { return sampler_; }
  // The text held back so far, when generation ends for another reason (length).
  std::string flush();
  const std::string& finish_reason() const { return reason_; }  // "" while it goes on
  std::int64_t generated() const { return generated_; }         // tokens sampled

 private:
  const Tokenizer* tokenizer_;
  bool ignore_eos_;
  Sampler sampler_;
  StreamDecoder decoder_;
  StopMatcher stops_;
  std::string reason_;
  std::int64_t generated_ = 0;
};

// A raw-text prompt, tokenized with special tokens recognised (and a BOS if the model wants
// one); and the chat template applied to messages, then tokenized the same way.
std::vector<Token> text_prompt_tokens(const Model& model, std::string_view text);
std::vector<Token> chat_prompt_tokens(const Model& model, std::span<const ChatMessage> messages);

class Engine {
 public:
  Engine(std::shared_ptr<const Model> model, const EngineOptions& options);

  const Model& model() const { return *model_; }
  std::int64_t context() const { return context_; }
  int threads() const { return pool_.size(); }

  // The chat template applied to `messages`, tokenized with special tokens recognised.
  std::vector<Token> chat_prompt(std::span<const ChatMessage> messages) const;
  // Raw text, tokenized with special tokens recognised (and a BOS if the model wants one).
  std::vector<Token> text_prompt(std::string_view text) const;

  // Generates a continuation of `prompt`, reusing the keys and values of the longest prefix it
  // shares with what the cache holds from the previous request (few-shot prompts share most of
  // their tokens). on_text receives each piece of text as it becomes
  // final (never half a UTF-8 character, never part of a stop string) and returns false to
  // cancel. Throws std::invalid_argument when the prompt does not fit the context.
  GenerateResult generate(std::span<const Token> prompt, const GenerateParams& params,
                          const std::function<bool(std::string_view)>& on_text);

 private:
  std::shared_ptr<const Model> model_;
  std::int64_t context_;
  kernels::ThreadPool pool_;
  KvCache cache_;
  std::vector<Token> cached_;  // the tokens whose keys and values cache_ holds, in order
  std::vector<float> logits_;
};

}  // namespace batchlm::local_engine
