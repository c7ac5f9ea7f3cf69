#include "batchlm/local_engine/local_backend.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <tuple>
#include <variant>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/experimental/concurrent_channel.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "batchlm/core/engine_fields.hpp"
#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/engine.hpp"
#include "batchlm/local_engine/gguf.hpp"
#include "batchlm/local_engine/kv_cache.hpp"
#include "batchlm/local_engine/scheduler.hpp"

namespace batchlm::local_engine {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

namespace {

// What the engine thread sends back for one request: text pieces (with their tokens'
// log-probabilities when asked for), then one final result.
struct Piece {
  std::string text;
  std::vector<TokenLogprob> logprobs;
};
struct Done {
  GenerateResult result;
};
struct Failed {
  Error error;
};
using Event = std::variant<Piece, Done, Failed>;
using Channel = asio::experimental::concurrent_channel<void(boost::system::error_code, Event)>;

struct Job {
  // What the caller sent, until the preparing thread turns it into `prompt`.
  Request request;
  std::vector<Token> prompt;
  GenerateParams params;
  std::shared_ptr<Channel> channel;
  std::atomic<bool> cancelled{false};

  // Sends from the engine thread; waits while the buffer is full. False once cancelled.
  bool send(Event event) {
    while (!cancelled.load()) {
      if (channel->try_send(boost::system::error_code{}, std::move(event))) return true;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return false;
  }
};

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

// Two threads. The preparing thread renders each request's chat template and tokenizes it, so
// that a long prompt holds up neither the caller's thread (serve's I/O thread, which writes
// every other stream) nor the engine's steps; a prompt the tokenizer refuses fails there.
// The engine thread: continuous batching. Every step it takes new requests off the queue into
// the BatchEngine, cancels those whose caller went away, runs one engine step (drafting,
// one batched forward pass, sampling or verifying) and streams the text back to each request.
struct LocalBackend::State {
  std::filesystem::path path;
  std::unique_ptr<BatchEngine> engine;
  // The most text bytes one token can stand for: no token's stored text is shorter than the
  // bytes it decodes to (byte-level and SentencePiece forms only add).
  std::size_t max_token_bytes = 1;
  bool split_reasoning = true;  // LocalBackendOptions::split_reasoning

  // A snapshot for engine_stats(), refreshed after every step.
  mutable std::mutex stats_mutex;
  EngineStats stats;

  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::shared_ptr<Job>> queue;
  bool stopping = false;
  std::thread thread;

  // Requests waiting to be tokenized, in arrival order (guarded by `mutex`, woken by
  // `prepare_wake`).
  std::condition_variable prepare_wake;
  std::deque<std::shared_ptr<Job>> to_prepare;
  std::thread preparing;
  std::unordered_map<SequenceId, std::shared_ptr<Job>> jobs;  // in the engine

  static void fail(Job& job, ErrorKind kind, int status, std::string code, std::string message) {
    job.send(Failed{Error{kind, status, std::move(code), std::move(message), std::nullopt, false}});
  }

  void admit(const std::shared_ptr<Job>& job) {
    if (job->cancelled.load()) return;
    try {
      Job* raw = job.get();
      const SequenceId id =
          engine->add(job->prompt, job->params, [raw](std::string_view text, std::span<const TokenLogprob> logprobs) {
            return raw->send(Piece{std::string(text), {logprobs.begin(), logprobs.end()}});
          });
      jobs.emplace(id, job);
    } catch (const RequestRejected& e) {
      fail(*job, ErrorKind::Http, 400, e.code, e.what());
    }
  }

  void deliver_finished() {
    for (auto& [id, result] : engine->take_finished()) {
      auto it = jobs.find(id);
      if (it == jobs.end()) continue;
      if (result.finish_reason == "error" && !it->second->cancelled.load()) {
        fail(*it->second, ErrorKind::Internal, 0, "model_error", result.error);
      } else if (result.finish_reason != "cancelled" && !it->second->cancelled.load()) {
        it->second->send(Done{std::move(result)});
      }
      jobs.erase(it);
    }
  }

  void publish_stats() {
    std::lock_guard lock(stats_mutex);
    stats = engine->stats();
  }

  void prepare() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock lock(mutex);
        prepare_wake.wait(lock, [&] { return stopping || !to_prepare.empty(); });
        if (stopping) return;
        job = std::move(to_prepare.front());
        to_prepare.pop_front();
      }
      if (job->cancelled.load()) continue;
      try {
        const Model& model = engine->model();
        // A text completion needs no chat template: a model whose template this build does not
        // support still completes prompts.
        job->prompt = job->request.prompt
                          ? text_prompt_tokens(model.tokenizer(), *job->request.prompt)
                          : request_prompt_tokens(model.tokenizer(), model.chat_template(), job->request);
      } catch (const std::exception& e) {
        fail(*job, ErrorKind::Http, 400, "invalid_request", e.what());
        continue;
      }
      job->request = {};
      {
        std::lock_guard lock(mutex);
        if (stopping) return;
        queue.push_back(std::move(job));
      }
      wake.notify_one();
    }
  }

  void run() {
    for (;;) {
      std::deque<std::shared_ptr<Job>> arrived;
      {
        std::unique_lock lock(mutex);
        if (queue.empty() && jobs.empty()) publish_stats();
        wake.wait(lock, [&] { return stopping || !queue.empty() || !jobs.empty(); });
        if (stopping) return;
        arrived.swap(queue);
      }
      try {
        for (const auto& job : arrived) admit(job);
        std::vector<SequenceId> gone;
        for (const auto& [id, job] : jobs)
          if (job->cancelled.load()) gone.push_back(id);
        for (SequenceId id : gone) engine->cancel(id);
        engine->step();
        // Stats first: a caller that has its last answer reads stats that count the step
        // which gave it (the run's summary against its step log).
        publish_stats();
        deliver_finished();
      } catch (const std::exception& e) {
        // A bug, not a request's fault: fail every request in flight rather than hang them.
        for (auto& [id, job] : jobs) {
          engine->cancel(id);
          fail(*job, ErrorKind::Internal, 0, "", std::string("engine: ") + e.what());
        }
        jobs.clear();
        (void)engine->take_finished();
      }
    }
  }
};

LocalBackend::LocalBackend(asio::any_io_executor executor, const LocalBackendOptions& options)
    : executor_(std::move(executor)), state_(std::make_shared<State>()) {
  State& s = *state_;
  s.path = options.model;
  s.split_reasoning = options.split_reasoning;
  s.engine = std::make_unique<BatchEngine>(Model::load(options.model, /*check_only=*/false, options.context), options);
  for (const std::string& t : s.engine->model().tokenizer().vocab().tokens)
    s.max_token_bytes = std::max(s.max_token_bytes, t.size());
  s.publish_stats();
  s.thread = std::thread([p = state_.get()] { p->run(); });
  s.preparing = std::thread([p = state_.get()] { p->prepare(); });
}

LocalBackend::~LocalBackend() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
    for (auto& job : state_->queue) job->cancelled = true;
    for (auto& job : state_->to_prepare) job->cancelled = true;
  }
  state_->wake.notify_all();
  state_->prepare_wake.notify_all();
  state_->thread.join();
  state_->preparing.join();
}

std::optional<EngineStats> LocalBackend::engine_stats() const {
  std::lock_guard lock(state_->stats_mutex);
  EngineStats stats = state_->stats;
  return stats;
}

std::string LocalBackend::model_name() const { return state_->path.stem().string(); }

std::int64_t LocalBackend::context() const { return state_->engine->context(); }

std::int64_t LocalBackend::vocab_size() const { return state_->engine->model().config().n_vocab; }

std::optional<std::string> LocalBackend::tools_problem() const {
  try {
    return local_engine::tools_problem(state_->engine->model().chat_template());
  } catch (const std::exception& e) {
    return std::string(e.what());  // no template this build supports: none to show tools in
  }
}

bool LocalBackend::samples_on_device() const { return state_->engine->samples_on_device(); }

std::int64_t LocalBackend::pool_bytes() const { return state_->engine->pool_bytes(); }

std::int64_t LocalBackend::pool_past_memory() const { return state_->engine->pool_past_memory(); }

std::size_t LocalBackend::prompt_bytes_limit() const {
  return static_cast<std::size_t>(state_->engine->context()) * state_->max_token_bytes;
}

std::string LocalBackend::describe() const {
  const BatchEngine& engine = *state_->engine;
  const ModelConfig& c = engine.model().config();
  std::string spec;
  if (const EngineStats stats = engine.stats(); !stats.speculative.empty())
    spec = ", speculative " + stats.speculative;
  return "local " + state_->path.string() + " (" + (c.name.empty() ? c.architecture : c.name) + spec +
         ", KV pool of " + std::to_string(engine.pool_tokens()) + " tokens, " +
         gguf::human_bytes(static_cast<double>(engine.pool_bytes())) + ") on " +
         engine.device();
}

asio::awaitable<Outcome> LocalBackend::complete(const Request& request, TokenSink sink) {
  // A cancellation must come back as an Outcome (and stop the engine's work on this request),
  // not as an exception from the next co_await.
  co_await asio::this_coro::throw_if_cancelled(false);
  const auto start = Clock::now();
  auto job = std::make_shared<Job>();
  job->channel = std::make_shared<Channel>(co_await asio::this_coro::executor, 256);
  // A prompt so long that even at the most bytes a token can cover it overflows the context is
  // refused before it is tokenized: tokenizing megabytes here would hold up every other
  // request's stream for seconds.
  const std::size_t bytes = request.text_bytes();
  if (const auto at_least = static_cast<std::int64_t>(bytes / state_->max_token_bytes);
      at_least >= state_->engine->context()) {
    co_return Outcome::failure(
        Error{ErrorKind::Http, 400, "context_length_exceeded",
              "the prompt is at least " + std::to_string(at_least) + " tokens (" + std::to_string(bytes) +
                  " bytes, at most " + std::to_string(state_->max_token_bytes) +
                  " per token); " + context_holds(state_->engine->model().config(), state_->engine->context()),
              std::nullopt, false});
  }
  if (request.extra.is_object()) {
    for (const auto& [key, value] : request.extra.items())
      if (const auto problem = engine_field_problem(key, value))
        co_return Outcome::failure(
            Error{ErrorKind::Http, 400, "unsupported_parameter", "'" + key + "': " + *problem, std::nullopt, false});
    if (const auto problem = top_logprobs_problem(request.extra))
      co_return Outcome::failure(
          Error{ErrorKind::Http, 400, "invalid_request", "'top_logprobs': " + *problem, std::nullopt, false});
    if (const auto problem = tool_choice_problem(request.extra))
      co_return Outcome::failure(Error{ErrorKind::Http, 400, "invalid_request",
                                       "'" + problem->first + "': " + problem->second, std::nullopt, false});
    if (const auto problem = min_tokens_problem(request.extra, request.max_tokens))
      co_return Outcome::failure(
          Error{ErrorKind::Http, 400, "invalid_request", "'min_tokens': " + *problem, std::nullopt, false});
  }
  // Tools are shown to the model (and its calls read back) unless tool_choice is "none"; a
  // template that does not list them refuses them when the prompt is made.
  const bool tools = !request.prompt && requested_tools(request.extra);
  // A forced tool_choice holds the answer to one call in the template's form: Qwen's opens it
  // with "<tool_call>\n" in the prompt and the model writes the call's JSON; Llama's answer is
  // the call's JSON alone. Either way it is read as the JSON of one call.
  // A chat needs the model's template; a text completion does not, and runs whatever it is.
  const ChatTemplate* chat = nullptr;
  if (!request.prompt) {
    try {
      chat = &state_->engine->model().chat_template();
    } catch (const std::exception&) {
      // Said without the model's path, which a client of `serve` has no use for.
    }
    if (chat == nullptr)
      co_return Outcome::failure(Error{ErrorKind::Http, 400, "invalid_request",
                                       std::string("the model's chat template is not one this build supports "
                                                   "(supported: ") + kSupportedChatTemplates +
                                           "): send a text completion (a prompt) instead",
                                       std::nullopt, false});
  }
  const std::optional<nlohmann::json> forced =
      tools && chat->calls_tools() ? forced_call_schema(request.extra, call_arguments_key(chat->call_format()))
                                   : std::nullopt;
  job->request = request;  // its prompt is made on the preparing thread
  GenerateParams& p = job->params;
  p.max_tokens = request.max_tokens.value_or(0);
  p.refuse_past_context = request.max_tokens_exact;  // without max_tokens there is nothing to refuse
  p.sampling.temperature = static_cast<float>(request.temperature.value_or(1.0));
  p.sampling.top_p = static_cast<float>(request.top_p.value_or(1.0));
  // top_p 0 keeps only the likeliest token, as OpenAI reads it: greedy.
  if (p.sampling.top_p <= 0.0f) p.sampling.temperature = 0.0f;
  if (request.extra.is_object()) {
    if (const auto k = request.extra.find("top_k"); k != request.extra.end() && k->is_number())
      p.sampling.top_k = static_cast<int>(k->get<double>());  // checked to be whole above
    if (const auto v = request.extra.find("presence_penalty"); v != request.extra.end() && v->is_number())
      p.sampling.presence_penalty = v->get<float>();
    if (const auto v = request.extra.find("frequency_penalty"); v != request.extra.end() && v->is_number())
      p.sampling.frequency_penalty = v->get<float>();
    if (const auto v = request.extra.find("repetition_penalty"); v != request.extra.end() && v->is_number())
      p.sampling.repetition_penalty = v->get<float>();  // checked to be above 0 above
    if (const auto v = request.extra.find("ignore_eos"); v != request.extra.end() && v->is_boolean())
      p.ignore_eos = v->get<bool>();
    if (const auto v = request.extra.find("min_p"); v != request.extra.end() && v->is_number())
      p.sampling.min_p = v->get<float>();  // checked to be from 0 to 1 above
    const std::int64_t n_vocab = vocab_size();
    for (const auto& [token, bias] : requested_logit_bias(request.extra)) {
      if (token >= n_vocab)
        co_return Outcome::failure(Error{ErrorKind::Http, 400, "invalid_request",
                                         "'logit_bias': token " + std::to_string(token) +
                                             " is outside the vocabulary of " + std::to_string(n_vocab),
                                         std::nullopt, false});
      p.sampling.logit_bias.emplace_back(static_cast<Token>(token), static_cast<float>(bias));
    }
    for (const std::int64_t token : requested_stop_token_ids(request.extra)) {
      if (token >= n_vocab)
        co_return Outcome::failure(Error{ErrorKind::Http, 400, "invalid_request",
                                         "'stop_token_ids': token " + std::to_string(token) +
                                             " is outside the vocabulary of " + std::to_string(n_vocab),
                                         std::nullopt, false});
      p.stop_token_ids.push_back(static_cast<Token>(token));
    }
    p.sampling.min_tokens = requested_min_tokens(request.extra);
    if (const std::vector<std::string> words = requested_bad_words(request.extra); !words.empty())
      p.sampling.bad_words = bad_word_sequences(state_->engine->model().tokenizer(), words);
    p.logprobs = requested_logprobs(request.extra);
    p.json_object = requested_json_object(request.extra);
    if (const nlohmann::ordered_json* schema = requested_json_schema(request.extra))
      p.json_schema = std::make_shared<const JsonSchema>(compile_json_schema(*schema));  // checked above
  }
  // The answer is the call; a response_format would be for text beside it, and there is none.
  if (forced) {
    p.forced_call = true;
    try {
      p.json_schema = std::make_shared<const JsonSchema>(compile_json_schema(*forced));
    } catch (const SchemaError& e) {  // the parameters were checked above (tool_choice_problem)
      co_return Outcome::failure(
          Error{ErrorKind::Http, 400, "invalid_request", std::string("'tools': ") + e.what(), std::nullopt, false});
    }
  }
  // -1 asks for a random seed, as in llama.cpp.
  p.sampling.seed = request.seed && *request.seed != -1 ? static_cast<std::uint64_t>(*request.seed)
                                                        : std::random_device{}() * 0x9e3779b97f4a7c15ull;
  if (!forced) p.stop = request.stop;  // stop strings are for text; they would cut a forced call's JSON
  {
    std::lock_guard lock(state_->mutex);
    state_->to_prepare.push_back(job);
  }
  state_->prepare_wake.notify_one();

  Timings timings;
  std::optional<Clock::time_point> first;
  std::string text;       // the content (all of the answer when the reasoning is not split off)
  std::string reasoning;  // the <think> block's text, when it is
  std::vector<TokenLogprob> logprobs;
  // Log-probabilities go out with the text they came with, or the next text that goes.
  std::vector<TokenLogprob> pending;
  // A chat answer's opening <think> block is reasoning, given apart from the content, unless
  // the options keep it in the text; a constrained answer (JSON, a forced call) has none.
  std::optional<ReasoningSplit> split;
  if (state_->split_reasoning && !request.prompt && !p.json_object && !p.json_schema)
    split.emplace(chat->opens_reasoning());
  // With tools, the sink gets the content up to where a call may begin: once a <tool_call> has
  // begun, the rest is held until the answer is whole (calls, or text after all).
  ToolCallStream calls(forced ? CallFormat::kJson : chat != nullptr ? chat->call_format() : CallFormat::kNone);
  const auto send = [&](std::string_view piece, TextPart part) {
    if (sink) sink(piece, pending, part);
    pending.clear();
  };
  const auto add_content = [&](std::string_view piece) {
    text += piece;
    if (!tools) {
      send(piece, TextPart::kContent);
    } else if (const std::string out = calls.add(piece); !out.empty()) {
      send(out, TextPart::kContent);
    }
  };
  const auto add_parts = [&](const ReasoningSplit::Parts& parts) {
    // The log-probabilities go with the content when there is some, else with the reasoning.
    if (!parts.reasoning.empty()) {
      reasoning += parts.reasoning;
      if (parts.content.empty()) {
        send(parts.reasoning, TextPart::kReasoning);
      } else if (sink) {
        sink(parts.reasoning, {}, TextPart::kReasoning);
      }
    }
    if (!parts.content.empty()) add_content(parts.content);
  };
  for (;;) {
    // A cancellation that arrived while this coroutine ran (inside the sink, say) is seen here;
    // one that arrives while it waits aborts the receive.
    boost::system::error_code ec;
    Event event;
    if (!(co_await asio::this_coro::cancellation_state).cancelled()) {
      std::tie(ec, event) =
          co_await job->channel->async_receive(asio::as_tuple(asio::use_awaitable));
    } else {
      ec = asio::error::operation_aborted;
    }
    const auto now = Clock::now();
    if (ec) {
      job->cancelled = true;
      timings.total_ms = ms_between(start, now);
      co_return Outcome::failure(Error{ErrorKind::Cancelled, 0, "", "cancelled", std::nullopt, false},
                                 timings);
    }
    if (auto* piece = std::get_if<Piece>(&event)) {
      if (!first && !piece->text.empty()) {
        first = now;
        timings.ttft_ms = ms_between(start, now);
      }
      logprobs.insert(logprobs.end(), piece->logprobs.begin(), piece->logprobs.end());
      pending.insert(pending.end(), piece->logprobs.begin(), piece->logprobs.end());
      if (split) {
        add_parts(split->add(piece->text));
      } else {
        add_content(piece->text);  // a token that ends no character still brings its log-probability
      }
      continue;
    }
    timings.total_ms = ms_between(start, now);
    if (auto* failed = std::get_if<Failed>(&event)) co_return Outcome::failure(failed->error, timings);
    const GenerateResult& r = std::get<Done>(event).result;
    if (!first) timings.ttft_ms = timings.total_ms;
    if (r.stats.generated_tokens > 1 && first) {
      timings.tpot_ms = ms_between(*first, now) / static_cast<double>(r.stats.generated_tokens - 1);
    }
    if (split) add_parts(split->finish());
    Completion c;
    c.finish_reason = r.finish_reason;
    if (tools) {
      if (auto parsed = calls.finish()) {
        // The calls, and the text beside them; an answer that ended on its own ended to call.
        // The stream gets the text after (or between) the calls that it has not had.
        if (const std::string tail = calls.unsent_content(*parsed); !tail.empty() || !pending.empty())
          send(tail, TextPart::kContent);
        c.tool_calls = std::move(parsed->calls);
        if (c.finish_reason == "stop") c.finish_reason = "tool_calls";
        text = std::move(parsed->content);
      } else if (!calls.rest().empty() || !pending.empty()) {
        send(calls.rest(), TextPart::kContent);
      }
    } else if (!pending.empty()) {
      send("", TextPart::kContent);
    }
    c.text = std::move(text);
    c.reasoning = std::move(reasoning);
    c.usage = Usage{r.stats.prompt_tokens, r.stats.generated_tokens, true};
    if (r.finish_reason == "length" && (job->params.max_tokens <= 0 || r.stats.generated_tokens < job->params.max_tokens))
      c.cut_at_context = context();
    c.timings = timings;
    if (job->params.logprobs >= 0) c.logprobs = std::move(logprobs);
    co_return Outcome::success(std::move(c));
  }
}

}  // namespace batchlm::local_engine
