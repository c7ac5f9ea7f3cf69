#pragma once
// One sequence at a time through the model: prompt in chunks, then token by token, with
// sampling, stop strings and streaming text. `batchlm generate` calls it directly; the engine
// thread of LocalBackend calls it for each request it takes off its queue.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "batchlm/core/types.hpp"
#include "batchlm/kernels/thread_pool.hpp"
#include "batchlm/local_engine/json_mode.hpp"
#include "batchlm/local_engine/json_schema.hpp"
#include "batchlm/local_engine/model.hpp"
#include "batchlm/local_engine/sampling.hpp"

namespace batchlm::local_engine {

struct EngineOptions {
  int threads = 0;             // 0: one per hardware thread
  std::int64_t context = 0;    // tokens per sequence; 0: min(training context, 4096)
};

// The tokens a sequence may hold: `requested` capped at the model's training context, or when
// 0, the training context up to 4,096.
std::int64_t choose_context(const ModelConfig& c, std::int64_t requested);
// Throws std::invalid_argument where the model's rotary factors are not the ones for `context`
// (a Phi-3 long-context model loaded for another context than the one it is run at).
void check_loaded_for(const ModelConfig& c, std::int64_t context);
// "the context holds N tokens", with the model's own where N is less (a setting can raise it).
std::string context_holds(const ModelConfig& c, std::int64_t context);
// Why a prompt of n_prompt >= context tokens is refused.
std::string prompt_past_context(const ModelConfig& c, std::int64_t n_prompt, std::int64_t context);

// The most alternatives a request can ask for at each position (OpenAI's top_logprobs limit).
inline constexpr int kMaxLogprobs = 20;

struct GenerateParams {
  std::int64_t max_tokens = 0;  // 0: until the context is full
  // A max_tokens the context has no room for (after the prompt) is refused
  // (RequestRejected, context_length_exceeded) instead of shortened to the room there is.
  bool refuse_past_context = false;
  SamplingParams sampling;
  std::vector<std::string> stop;
  // vLLM's stop_token_ids: generating one of these ends the output ("stop"). Its text is part of
  // the output, unless it is a control token (which, like the end of the turn, shows none).
  // sampling.min_tokens holds them back with the end of the turn.
  std::vector<Token> stop_token_ids;
  bool ignore_eos = false;      // keep going past end-of-generation tokens (benchmarks)
  // Log-probabilities of the generated tokens (position_logprobs): -1 none, else with this
  // many of the most likely tokens at each position (0-20).
  int logprobs = -1;
  // JSON mode: only tokens that keep the output a prefix of one JSON object are sampled, and
  // generation stops ("stop") when the object closes (json_mode.hpp).
  bool json_object = false;
  // Structured outputs: the same, held to this schema (json_schema.hpp); takes precedence over
  // json_object.
  std::shared_ptr<const JsonSchema> json_schema;
  // The schema holds the answer to a tool call (a forced tool_choice), not to response_format.
  bool forced_call = false;
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
  std::string finish_reason;  // "stop" (end of turn or a stop string), "length", "cancelled",
                              // "error" (then `error` says what went wrong)
  std::string error;
  GenerateStats stats;
  // With GenerateParams::logprobs >= 0: one entry per token of `text` (Generation::take_logprobs).
  std::vector<TokenLogprob> logprobs;
};

// The output side of one request: samples each next token, recognises the end of the turn and
// the stop strings, and turns tokens into text that never splits a UTF-8 character nor shows
// the start of a stop string. Engine::generate and LocalBackend's batching loop both use it.
class Generation {
 public:
  // `prompt`: the request's, which the repetition penalty counts (Sampler::observe_prompt).
  Generation(const Tokenizer& tokenizer, const GenerateParams& params, std::span<const Token> prompt);
  // Samples the next token from `logits` and sets `text` to the text that became final (maybe
  // empty). True when generation is over for a reason of its own (finish_reason() says which).
  // With log-probabilities asked for, takes the token's from `logits`.
  bool next(std::span<const float> logits, Token& token, std::string& text);
  // The same for a token chosen elsewhere (speculative decoding's verifier, a batch's sampling
  // threads), with its log-probabilities when they were asked for.
  bool accept(Token token, std::string& text, const PositionLogprobs* logprobs = nullptr);
  Sampler& sampler() { return sampler_; }
  // The logits to sample from: in JSON mode or under a schema a copy with the tokens that cannot
  // come next masked out, else `logits` themselves.
  std::span<const float> constrain(std::span<const float> logits);
  // In JSON mode or under a schema (only the tokens they allow are sampled; speculative drafts
  // are not).
  bool constrained() const { return json_.has_value() || schema_state_.has_value(); }
  // The text held back so far, when generation ends for another reason (length).
  std::string flush();
  // -1 when no log-probabilities were asked for, else the alternatives per token.
  int logprobs() const { return logprobs_; }
  // The log-probabilities of the tokens whose text became final since the last call, in order.
  // A token belongs to the output when its text starts in it: one cut by a stop string is
  // there, the end of the turn and anything after a stop string are not. A token that ends
  // inside a UTF-8 character comes out with the token that completes the character.
  std::vector<TokenLogprob> take_logprobs();
  const std::string& finish_reason() const { return reason_; }  // "" while it goes on
  std::int64_t generated() const { return generated_; }         // tokens sampled

 private:
  const Tokenizer* tokenizer_;
  bool ignore_eos_;
  Sampler sampler_;
  StreamDecoder decoder_;
  StopMatcher stops_;
  // Control tokens whose text is a stop string ("<|im_start|>"): such a token is never written
  // as text, so the matcher alone would never see it; generating one stops as the string would.
  std::vector<Token> stop_tokens_;
  std::vector<Token> stop_ids_;  // GenerateParams::stop_token_ids
  // Whether the text of the token generated last may end the output with a stop string (it is
  // past the first min_tokens).
  bool armed() const { return generated_ > sampler_.params().min_tokens; }
  std::string reason_;
  std::int64_t generated_ = 0;
  // Log-probabilities of tokens whose text is not yet final, with where their text starts and
  // ends among the decoded bytes (end -1 while the character they end in is incomplete).
  struct Pending {
    TokenLogprob logprob;
    std::int64_t start = 0;
    std::int64_t end = -1;
  };
  TokenLogprob describe(const PositionLogprobs& p) const;
  void settle(std::int64_t decoded_before, const std::string& decoded);
  int logprobs_ = -1;
  std::optional<JsonState> json_;  // JSON mode: the output so far
  std::shared_ptr<const JsonSchema> schema_;
  std::optional<SchemaState> schema_state_;  // structured outputs: the output so far
  JsonMask json_mask_;
  std::vector<float> masked_;
  std::vector<Pending> pending_;
  std::vector<TokenLogprob> ready_;
  std::int64_t decoded_ = 0;   // bytes the decoder has given the stop matcher
  std::int64_t released_ = 0;  // bytes the stop matcher has let out
};

// A raw-text prompt, tokenized with special tokens recognised (and a BOS if the model wants
// one); and the chat template applied to messages, then tokenized the same way. Roles are
// OpenAI's: a "developer" message is a system message (as `batchlm serve` takes it). Tools,
// assistant messages' calls and "tool" messages go to a template that lists tools
// (ChatTemplate::calls_tools()); with another template, and for any other role, it throws
// std::invalid_argument naming the message. `answer_prefix` is written after the generation
// prompt, as the opening of the answer (a forced call's "<tool_call>\n").
std::vector<Token> text_prompt_tokens(const Model& model, std::string_view text);
// vLLM's bad_words as the token sequences SamplingParams::bad_words holds: each word, its leading
// whitespace dropped, as it is tokenized alone, and as it is after a space where that gives as
// many tokens starting with another one (a word inside a line is tokenized with its space).
std::vector<std::vector<Token>> bad_word_sequences(const Tokenizer& tokenizer, std::span<const std::string> words);
std::vector<Token> chat_prompt_tokens(const Model& model, std::span<const ChatMessage> messages,
                                      const nlohmann::ordered_json& tools = nullptr, std::string_view answer_prefix = {});
// The same from a tokenizer and a template alone (a model file's vocabulary, without weights).
std::vector<Token> text_prompt_tokens(const Tokenizer& tokenizer, std::string_view text);
std::vector<Token> chat_prompt_tokens(const Tokenizer& tokenizer, const ChatTemplate& chat_template,
                                      std::span<const ChatMessage> messages, const nlohmann::ordered_json& tools = nullptr,
                                      std::string_view answer_prefix = {});
// A request's prompt as the embedded engine makes it: a text completion's prompt as it is; a
// chat's messages with the tools shown (requested_tools) and the answer's opening
// (answer_prefix: enable_thinking false, a forced call's frame). Throws as chat_prompt_tokens.
std::vector<Token> request_prompt_tokens(const Tokenizer& tokenizer, const ChatTemplate& chat_template,
                                         const Request& request);

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
