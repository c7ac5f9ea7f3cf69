#include "batchlm/local_engine/engine.hpp"

#include "batchlm/core/engine_fields.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace batchlm::local_engine {

namespace {

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

std::int64_t choose_context(const ModelConfig& c, std::int64_t requested) {
  if (requested > 0) return std::min(requested, c.n_ctx_usable());
  return std::min<std::int64_t>(c.n_ctx_usable(), 4096);
}

std::string prompt_past_context(const ModelConfig& c, std::int64_t n_prompt, std::int64_t context) {
  return "the prompt has " + std::to_string(n_prompt) + " tokens; " + context_holds(c, context) +
         (n_prompt == context ? ", which leaves no room to generate" : "");
}

void check_loaded_for(const ModelConfig& c, std::int64_t context) {
  if (c.rope_long_factors && c.n_ctx_orig > 0 && c.long_context != (context > c.n_ctx_orig))
    throw std::invalid_argument("the model was loaded for a context " + std::string(c.long_context ? "past" : "within") +
                                " its original " + std::to_string(c.n_ctx_orig) + " (its rotary factors), and is run at " +
                                std::to_string(context) + ": load it with the context it runs at");
}

std::string context_holds(const ModelConfig& c, std::int64_t context) {
  std::string text = "the context holds " + std::to_string(context) + " tokens";
  if (c.n_ctx_usable() < c.n_ctx_train && context == c.n_ctx_usable())
    text += " (the model's own holds " + std::to_string(c.n_ctx_train) + "; a longer context, asked for, runs its "
            "long-context rotary factors)";
  else if (context < c.n_ctx_train)
    text += " (the model's own holds " + std::to_string(c.n_ctx_train) + ")";
  return text;
}

Engine::Engine(std::shared_ptr<const Model> model, const EngineOptions& options)
    : model_(std::move(model)),
      context_(choose_context(model_->config(), options.context)),
      pool_(options.threads),
      cache_(model_->config(), context_),
      logits_(static_cast<std::size_t>(model_->config().n_vocab)) {
  check_loaded_for(model_->config(), context_);
}

Generation::Generation(const Tokenizer& tokenizer, const GenerateParams& params, std::span<const Token> prompt)
    : tokenizer_(&tokenizer),
      ignore_eos_(params.ignore_eos),
      sampler_(params.sampling),
      decoder_(tokenizer),
      stops_(params.stop),
      logprobs_(params.logprobs),
      json_(params.json_object && !params.json_schema ? std::optional<JsonState>(JsonState()) : std::nullopt),
      schema_(params.json_schema),
      json_mask_(tokenizer) {
  if (schema_) schema_state_.emplace(*schema_);
  sampler_.observe_prompt(prompt);
  for (const std::string& stop : params.stop) {
    if (stop.empty()) continue;
    const Token t = tokenizer.find(stop);
    if (t >= 0 && tokenizer.token_view(t).empty() && tokenizer.token_bytes(t, true) == stop) stop_tokens_.push_back(t);
  }
  stop_ids_ = params.stop_token_ids;
  if (params.sampling.min_tokens > 0) {
    // Every token that would end the output is held back until min_tokens are out.
    std::vector<Token> ends = ignore_eos_ ? std::vector<Token>{} : tokenizer.end_of_generation_tokens();
    ends.insert(ends.end(), stop_tokens_.begin(), stop_tokens_.end());
    ends.insert(ends.end(), stop_ids_.begin(), stop_ids_.end());
    sampler_.hold_back(std::move(ends));
  }
}

std::span<const float> Generation::constrain(std::span<const float> logits) {
  if (!json_ && !schema_state_) return logits;
  masked_.assign(logits.begin(), logits.end());
  const std::size_t left = json_ ? json_mask_.apply(*json_, masked_) : json_mask_.apply(*schema_state_, masked_);
  if (left == 0) return logits;  // nothing fits: left to the end of this token
  return masked_;
}

bool Generation::next(std::span<const float> logits, Token& token, std::string& text) {
  if (broken_logits(logits)) throw std::runtime_error(broken_logits_message(generated_));
  token = sampler_.sample(constrain(logits));
  if (logprobs_ < 0) return accept(token, text);
  const PositionLogprobs lp = position_logprobs(logits, token, logprobs_);
  return accept(token, text, &lp);
}

TokenLogprob Generation::describe(const PositionLogprobs& p) const {
  TokenLogprob out{tokenizer_->token_bytes(p.token), p.logprob, {}};
  out.top_logprobs.reserve(p.top.size());
  // An alternative that is a control token (the end of the turn) shows its text, not "".
  for (const auto& [t, lp] : p.top) out.top_logprobs.push_back({tokenizer_->token_bytes(t, true), lp});
  return out;
}

void Generation::settle(std::int64_t decoded_before, const std::string& decoded) {
  // Tokens whose character the decoder completed now end where its text ends.
  if (!decoded.empty()) {
    for (Pending& p : pending_)
      if (p.end < 0) p.end = decoded_before + static_cast<std::int64_t>(decoded.size());
  }
  // Final: every token whose text the stop matcher let out, or, once it stopped, every token
  // whose text starts before what it let out ends (the rest is dropped).
  const bool over = stops_.stopped();
  std::size_t n = 0;
  while (n < pending_.size() && ((pending_[n].end >= 0 && pending_[n].end <= released_) ||
                                 (over && pending_[n].start < released_)))
    ++n;
  for (std::size_t i = 0; i < n; ++i) ready_.push_back(std::move(pending_[i].logprob));
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(n));
  if (over) pending_.clear();
}

bool Generation::accept(Token token, std::string& text, const PositionLogprobs* logprobs) {
  ++generated_;
  sampler_.observe(token);
  text.clear();
  if (!ignore_eos_ && tokenizer_->is_end_of_generation(token)) {
    reason_ = "stop";  // what the stop matcher holds comes out in flush()
    return true;
  }
  if (std::find(stop_tokens_.begin(), stop_tokens_.end(), token) != stop_tokens_.end()) {
    reason_ = "stop";  // as at the end of the turn: the token is not part of the output
    return true;
  }
  // A stop token id ends the output after its text (a control token's is none).
  const bool stop_id = std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end();
  if (stop_id && tokenizer_->token_view(token).empty()) {
    reason_ = "stop";
    return true;
  }
  // JSON mode and schemas: the object closed with this token ends the output (a token they
  // refuse, which the mask lets through only when none fits, ends the constraint).
  bool closed = false;
  if (json_) {
    if (!json_->feed(tokenizer_->token_view(token))) json_.reset();
    else closed = json_->complete();
  }
  if (schema_state_) {
    if (!schema_state_->feed(tokenizer_->token_view(token))) schema_state_.reset();
    else closed = schema_state_->complete();
  }
  const std::string decoded = decoder_.push(token);
  const std::int64_t before = decoded_;
  decoded_ += static_cast<std::int64_t>(decoded.size());
  if (logprobs_ >= 0 && logprobs) pending_.push_back({describe(*logprobs), before, -1});
  text = stops_.feed(decoded, armed());
  released_ += static_cast<std::int64_t>(text.size());
  if (stops_.stopped() || closed || stop_id) reason_ = "stop";
  if (logprobs_ >= 0) settle(before, decoded);
  return stops_.stopped() || closed || stop_id;
}

std::string Generation::flush() {
  if (stops_.stopped()) return {};
  const std::string decoded = decoder_.finish();
  decoded_ += static_cast<std::int64_t>(decoded.size());
  std::string text = stops_.feed(decoded, armed());  // the last token's
  text += stops_.finish();
  released_ += static_cast<std::int64_t>(text.size());
  // Everything is out now (what the decoder held as replacement characters if incomplete).
  for (Pending& p : pending_) ready_.push_back(std::move(p.logprob));
  pending_.clear();
  return text;
}

std::vector<TokenLogprob> Generation::take_logprobs() {
  std::vector<TokenLogprob> out;
  out.swap(ready_);
  return out;
}

std::vector<Token> text_prompt_tokens(const Tokenizer& tok, std::string_view text) {
  std::vector<Token> out;
  if (tok.add_bos() && tok.vocab().bos >= 0) out.push_back(tok.vocab().bos);
  std::vector<Token> body = tok.encode(text, /*parse_special=*/true);
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

std::vector<Token> chat_prompt_tokens(const Tokenizer& tok, const ChatTemplate& chat_template,
                                      std::span<const ChatMessage> messages, const nlohmann::ordered_json& tools,
                                      std::string_view answer_prefix) {
  std::vector<ChatMessage> turns(messages.begin(), messages.end());
  const bool tool_turns = chat_template.calls_tools();
  for (std::size_t i = 0; i < turns.size(); ++i) {
    std::string& role = turns[i].role;
    const auto at = [&] { return "messages[" + std::to_string(i) + "]"; };
    if (role == "developer") role = "system";
    if (role == "tool" && !tool_turns)
      throw std::invalid_argument(at() + ".role: a tool's result, but " + *tools_problem(chat_template));
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      throw std::invalid_argument(at() + ".role: the embedded engine takes system, developer, user, assistant and tool "
                                  "messages, not '" + role + "'");
    if (turns[i].calls_tools() && !tool_turns)
      throw std::invalid_argument(at() + ".tool_calls: " + *tools_problem(chat_template));
  }
  // Tools for a template that does not list them: apply() refuses them.
  return text_prompt_tokens(tok, chat_template.apply(turns, /*add_generation_prompt=*/true, tools) + std::string(answer_prefix));
}

std::vector<Token> request_prompt_tokens(const Tokenizer& tok, const ChatTemplate& chat_template, const Request& request) {
  if (request.prompt) return text_prompt_tokens(tok, *request.prompt);
  return chat_prompt_tokens(tok, chat_template, request.messages,
                            requested_tools(request.extra) ? request.extra.at("tools") : nlohmann::ordered_json(),
                            answer_prefix(chat_template, request.extra));
}

std::vector<std::vector<Token>> bad_word_sequences(const Tokenizer& tokenizer, std::span<const std::string> words) {
  std::vector<std::vector<Token>> out;
  for (const std::string& word : words) {
    const std::size_t start = word.find_first_not_of(" \t\n\r\f\v");
    if (start == std::string::npos) continue;
    const std::string_view bare = std::string_view(word).substr(start);
    std::vector<Token> alone = tokenizer.encode(bare, /*parse_special=*/false);
    std::vector<Token> spaced = tokenizer.encode(" " + std::string(bare), /*parse_special=*/false);
    if (alone.empty()) continue;
    const bool other = !spaced.empty() && spaced.size() == alone.size() && spaced.front() != alone.front();
    out.push_back(std::move(alone));
    if (other) out.push_back(std::move(spaced));
  }
  return out;
}

std::vector<Token> text_prompt_tokens(const Model& model, std::string_view text) {
  return text_prompt_tokens(model.tokenizer(), text);
}

std::vector<Token> chat_prompt_tokens(const Model& model, std::span<const ChatMessage> messages,
                                      const nlohmann::ordered_json& tools, std::string_view answer_prefix) {
  return chat_prompt_tokens(model.tokenizer(), model.chat_template(), messages, tools, answer_prefix);
}

std::vector<Token> Engine::chat_prompt(std::span<const ChatMessage> messages) const {
  return chat_prompt_tokens(*model_, messages);
}

std::vector<Token> Engine::text_prompt(std::string_view text) const {
  return text_prompt_tokens(*model_, text);
}

GenerateResult Engine::generate(std::span<const Token> prompt, const GenerateParams& params,
                                const std::function<bool(std::string_view)>& on_text) {
  const auto n_prompt = static_cast<std::int64_t>(prompt.size());
  if (n_prompt == 0) throw std::invalid_argument("the prompt is empty");
  if (n_prompt >= context_) {
    throw std::invalid_argument(prompt_past_context(model_->config(), n_prompt, context_));
  }
  const Tokenizer& tok = model_->tokenizer();
  const std::int64_t room = context_ - n_prompt;
  const std::int64_t max_tokens = params.max_tokens > 0 ? std::min(params.max_tokens, room) : room;

  GenerateResult result;
  result.stats.prompt_tokens = n_prompt;
  // Keep the keys and values of the prefix this prompt shares with the cached tokens; at least
  // the last prompt token is computed again, for its logits.
  std::int64_t keep = 0;
  const auto limit = std::min<std::int64_t>(static_cast<std::int64_t>(cached_.size()), n_prompt - 1);
  while (keep < limit && cached_[keep] == prompt[keep]) ++keep;
  cache_.resize(keep);
  cached_.resize(static_cast<std::size_t>(keep));
  result.stats.cached_prompt_tokens = keep;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = keep; i < n_prompt; i += Model::kMaxBatch) {
    const std::int64_t n = std::min(Model::kMaxBatch, n_prompt - i);
    model_->forward(prompt.subspan(i, n), cache_, logits_, /*all_logits=*/false, pool_);
    cached_.insert(cached_.end(), prompt.begin() + i, prompt.begin() + i + n);
  }

  Generation gen(tok, params, prompt);
  auto emit = [&](const std::string& text) {
    for (TokenLogprob& lp : gen.take_logprobs()) result.logprobs.push_back(std::move(lp));
    if (text.empty()) return true;
    result.text += text;
    return on_text ? on_text(text) : true;
  };

  Token next = 0;
  std::string text;
  bool done = gen.next(logits_, next, text);
  result.tokens.push_back(next);
  result.stats.prompt_ms = ms_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  for (;;) {
    if (!emit(text)) {
      result.finish_reason = "cancelled";
      break;
    }
    if (done) {
      result.finish_reason = gen.finish_reason();
      break;
    }
    if (gen.generated() >= max_tokens) {
      result.finish_reason = "length";
      break;
    }
    const Token one[1] = {next};
    model_->forward(one, cache_, logits_, /*all_logits=*/false, pool_);
    cached_.push_back(next);
    ++result.stats.decode_steps;
    done = gen.next(logits_, next, text);
    result.tokens.push_back(next);
  }
  result.stats.generated_tokens = gen.generated();
  result.stats.generate_ms = ms_since(t1);
  if (result.finish_reason != "cancelled") emit(gen.flush());
  return result;
}

}  // namespace batchlm::local_engine
