#include "batchlm/local_engine/local_backend.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <mutex>
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

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/engine.hpp"
#include "batchlm/local_engine/kv_cache.hpp"
#include "batchlm/local_engine/scheduler.hpp"

namespace batchlm::local_engine {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

namespace {

// What the engine thread sends back for one request: text pieces, then one final result.
struct Done {
  GenerateResult result;
};
struct Failed {
  Error error;
};
using Event = std::variant<std::string, Done, Failed>;
using Channel = asio::experimental::concurrent_channel<void(boost::system::error_code, Event)>;

struct Job {
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

// The engine thread: continuous batching. Every step it takes new requests off the queue into
// the scheduler, drops cancelled ones, runs one batched forward pass over the tokens the
// scheduler planned (prefill chunks and one decode token per running sequence, their keys and
// values in a paged pool with prefix sharing), samples each sequence that produced logits, and
// streams the text back to its request.
struct LocalBackend::State {
  std::shared_ptr<const Model> model;
  std::filesystem::path path;
  std::int64_t context = 0;
  std::unique_ptr<kernels::ThreadPool> threads;
  std::unique_ptr<BlockPool> blocks;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<KvStore> kv;

  // A snapshot for engine_stats(), refreshed after every step.
  mutable std::mutex stats_mutex;
  EngineStats stats;
  std::int64_t sampled = 0;  // tokens sampled, over all requests

  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::shared_ptr<Job>> queue;
  bool stopping = false;
  std::thread thread;

  // A request in the scheduler.
  struct Active {
    std::shared_ptr<Job> job;
    Generation gen;
    GenerateResult result;
    std::string reason;  // set when the engine ended it (end of turn, stop string, cancel)
    Clock::time_point start = Clock::now();
    std::optional<Clock::time_point> first;
  };
  std::unordered_map<SequenceId, Active> active;

  void fail(Job& job, ErrorKind kind, int status, std::string code, std::string message) {
    job.send(Failed{Error{kind, status, std::move(code), std::move(message), std::nullopt, false}});
  }

  void admit(const std::shared_ptr<Job>& job) {
    if (job->cancelled.load()) return;
    const auto n_prompt = static_cast<std::int64_t>(job->prompt.size());
    if (n_prompt == 0) return fail(*job, ErrorKind::Http, 400, "invalid_request", "the prompt is empty");
    if (n_prompt >= context) {
      return fail(*job, ErrorKind::Http, 400, "context_length_exceeded",
                  "the prompt has " + std::to_string(n_prompt) + " tokens; the context holds " +
                      std::to_string(context));
    }
    const std::int64_t room = context - n_prompt;
    const std::int64_t max_new =
        job->params.max_tokens > 0 ? std::min(job->params.max_tokens, room) : room;
    SequenceId id = 0;
    try {
      id = scheduler->add(job->prompt, max_new);
    } catch (const std::invalid_argument& e) {
      return fail(*job, ErrorKind::Http, 400, "context_length_exceeded", e.what());
    }
    Active a{job, Generation(model->tokenizer(), job->params), {}, {}, Clock::now(), std::nullopt};
    a.result.stats.prompt_tokens = n_prompt;
    active.emplace(id, std::move(a));
  }

  // Samples the sequence's next token from its logits and streams its text; true when the
  // request is over (end of turn, a stop string, or the client went away).
  bool sample(Active& a, std::span<const float> logits, Token& token) {
    std::string text;
    const bool done = a.gen.next(logits, token, text);
    if (!a.first) a.first = Clock::now();
    if (!text.empty()) {
      a.result.text += text;
      if (!a.job->send(text)) {
        a.reason = "cancelled";
        return true;
      }
    }
    if (done) a.reason = a.gen.finish_reason();
    return done;
  }

  void finish(const Finished& f) {
    auto it = active.find(f.id);
    if (it == active.end()) return;
    Active& a = it->second;
    std::string reason = a.reason.empty() ? std::string(to_string(f.reason)) : a.reason;
    if (reason != "cancelled" && !a.job->cancelled.load()) {
      if (std::string tail = a.gen.flush(); !tail.empty()) {
        a.result.text += tail;
        a.job->send(tail);
      }
      a.result.stats.generated_tokens = a.gen.generated();
      a.result.finish_reason = reason;
      const auto now = Clock::now();
      a.result.stats.generate_ms = a.first ? ms_between(*a.first, now) : 0;
      a.result.stats.prompt_ms = a.first ? ms_between(a.start, *a.first) : ms_between(a.start, now);
      a.job->send(Done{std::move(a.result)});
    }
    active.erase(it);
  }

  void step(std::vector<float>& logits) {
    StepPlan plan = scheduler->plan();
    if (plan.empty()) return;
    std::vector<std::int32_t> positions(plan.positions.begin(), plan.positions.end());
    std::vector<std::span<const std::int32_t>> tables;
    tables.reserve(plan.entries.size());
    for (const auto& e : plan.entries) tables.emplace_back(e.block_table);
    const std::size_t n_vocab = static_cast<std::size_t>(model->config().n_vocab);
    logits.resize(plan.logits_rows.size() * n_vocab);
    model->forward_batch(Batch{plan.tokens, positions, plan.sequence_of, tables, plan.logits_rows},
                         kv->pool(), logits, *threads);
    std::vector<StepResult> results;
    std::size_t row = 0;
    for (const auto& e : plan.entries) {
      if (!e.wants_logits) continue;
      const std::span<const float> l(logits.data() + row++ * n_vocab, n_vocab);
      StepResult r{e.id, 0, false};
      if (auto it = active.find(e.id); it != active.end()) {
        ++sampled;
        r.finished = sample(it->second, l, r.token);
      } else {
        r.finished = true;
      }
      results.push_back(r);
    }
    scheduler->complete(plan, results);
  }

  void publish_stats() {
    const SchedulerStats s = scheduler->stats();
    std::lock_guard lock(stats_mutex);
    stats.running = s.running;
    stats.waiting = s.waiting;
    stats.preemptions = s.preemptions;
    stats.prompt_tokens_computed = s.prompt_tokens_computed;
    stats.prompt_tokens_cached = s.prompt_tokens_cached;
    stats.generated_tokens = sampled;
    stats.steps = s.steps;
    stats.blocks_used = s.blocks_used;
    stats.blocks_total = s.blocks_total;
    stats.block_size = blocks->block_size();
  }

  void run() {
    std::vector<float> logits;
    for (;;) {
      std::deque<std::shared_ptr<Job>> arrived;
      {
        std::unique_lock lock(mutex);
        if (queue.empty() && active.empty()) publish_stats();
        wake.wait(lock, [&] { return stopping || !queue.empty() || !active.empty(); });
        if (stopping) return;
        arrived.swap(queue);
      }
      try {
        for (const auto& job : arrived) admit(job);
        for (auto& [id, a] : active) {
          if (a.job->cancelled.load()) {
            a.reason = "cancelled";
            scheduler->cancel(id);
          }
        }
        step(logits);
        for (const Finished& f : scheduler->take_finished()) finish(f);
        publish_stats();
      } catch (const std::exception& e) {
        // A bug, not a request's fault: fail every request in flight rather than hang them.
        for (auto& [id, a] : active) {
          scheduler->cancel(id);
          fail(*a.job, ErrorKind::Internal, 0, "", std::string("engine: ") + e.what());
        }
        active.clear();
        (void)scheduler->take_finished();
      }
    }
  }
};

std::int64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream fields(line);
    std::string key;
    std::int64_t kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

std::int64_t kv_pool_tokens(const LocalBackendOptions& o, std::int64_t context,
                            std::int64_t bytes_per_token, std::int64_t available_bytes) {
  if (o.kv_tokens < 0) throw std::invalid_argument("kv_tokens must be >= 0");
  if (o.kv_bytes < 0) throw std::invalid_argument("kv_bytes must be >= 0");
  std::int64_t tokens = 0;
  if (o.kv_tokens > 0) {
    tokens = o.kv_tokens;
  } else if (o.kv_bytes > 0) {
    tokens = o.kv_bytes / bytes_per_token;
  } else {
    tokens = static_cast<std::int64_t>(o.max_sequences) * context;
    if (available_bytes > 0) tokens = std::min(tokens, available_bytes / 4 / bytes_per_token);
    return std::max(tokens, context);
  }
  if (tokens < context) {
    throw std::invalid_argument(
        (o.kv_tokens > 0 ? "kv_tokens " + std::to_string(o.kv_tokens)
                         : "kv_bytes " + std::to_string(o.kv_bytes) + " (" +
                               std::to_string(tokens) + " tokens)") +
        " is less than one context of " + std::to_string(context) + " tokens");
  }
  return tokens;
}

LocalBackend::LocalBackend(asio::any_io_executor executor, const LocalBackendOptions& options)
    : executor_(std::move(executor)), state_(std::make_shared<State>()) {
  if (options.max_sequences < 1) throw std::invalid_argument("max_sequences must be >= 1");
  if (options.block_size < 1 || options.block_size > 256)
    throw std::invalid_argument("block_size must be in 1..256, not " + std::to_string(options.block_size));
  const std::int64_t budget = options.token_budget > 0 ? options.token_budget : Model::kMaxBatch;
  if (budget > Model::kMaxBatch)
    throw std::invalid_argument("token_budget must be at most " + std::to_string(Model::kMaxBatch));
  if (budget < options.max_sequences) {
    throw std::invalid_argument("token_budget " + std::to_string(budget) +
                                " is less than max_sequences " + std::to_string(options.max_sequences) +
                                ": every running sequence needs a token each step");
  }
  State& s = *state_;
  s.path = options.model;
  s.model = Model::load(options.model);
  const ModelConfig& c = s.model->config();
  s.context = options.context > 0 ? std::min(options.context, c.n_ctx_train)
                                  : std::min<std::int64_t>(c.n_ctx_train, 4096);
  s.threads = std::make_unique<kernels::ThreadPool>(options.threads);
  // Pages of the pool are touched only as blocks are first used.
  const std::int64_t block = options.block_size;
  const std::int64_t bytes_per_token = 2 * c.n_layers * c.kv_width() * 2;  // K and V, F16
  const std::int64_t pool_tokens =
      kv_pool_tokens(options, s.context, bytes_per_token, available_memory_bytes());
  const std::int64_t n_blocks = (pool_tokens + block - 1) / block;
  s.blocks = std::make_unique<BlockPool>(BlockPoolOptions{options.block_size, n_blocks});
  s.scheduler = std::make_unique<Scheduler>(
      *s.blocks, SchedulerOptions{options.max_sequences, budget, budget});
  s.kv = std::make_unique<KvStore>(c, block, n_blocks);
  s.publish_stats();
  s.thread = std::thread([p = state_.get()] { p->run(); });
}

LocalBackend::~LocalBackend() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
    for (auto& job : state_->queue) job->cancelled = true;
  }
  state_->wake.notify_all();
  state_->thread.join();
}

std::optional<EngineStats> LocalBackend::engine_stats() const {
  std::lock_guard lock(state_->stats_mutex);
  EngineStats stats = state_->stats;
  return stats;
}

std::string LocalBackend::model_name() const { return state_->path.stem().string(); }

std::int64_t LocalBackend::context() const { return state_->context; }

std::string LocalBackend::describe() const {
  const ModelConfig& c = state_->model->config();
  return "local " + state_->path.string() + " (" + (c.name.empty() ? c.architecture : c.name) +
         ", " + std::to_string(state_->threads->size()) + " threads, " +
         kernels::cpu_simd_name() + ")";
}

asio::awaitable<Outcome> LocalBackend::complete(const Request& request, TokenSink sink) {
  // A cancellation must come back as an Outcome (and stop the engine's work on this request),
  // not as an exception from the next co_await.
  co_await asio::this_coro::throw_if_cancelled(false);
  const auto start = Clock::now();
  auto job = std::make_shared<Job>();
  job->channel = std::make_shared<Channel>(co_await asio::this_coro::executor, 256);
  try {
    job->prompt = request.prompt ? text_prompt_tokens(*state_->model, *request.prompt)
                                 : chat_prompt_tokens(*state_->model, request.messages);
  } catch (const std::exception& e) {
    co_return Outcome::failure(Error{ErrorKind::Http, 400, "invalid_request", e.what(),
                                     std::nullopt, false});
  }
  GenerateParams& p = job->params;
  p.max_tokens = request.max_tokens.value_or(0);
  p.sampling.temperature = static_cast<float>(request.temperature.value_or(1.0));
  p.sampling.top_p = static_cast<float>(request.top_p.value_or(1.0));
  if (request.extra.is_object() && request.extra.contains("top_k") &&
      request.extra["top_k"].is_number_integer()) {
    p.sampling.top_k = request.extra["top_k"].get<int>();
  }
  p.sampling.seed = request.seed ? static_cast<std::uint64_t>(*request.seed)
                                 : std::random_device{}() * 0x9e3779b97f4a7c15ull;
  p.stop = request.stop;
  {
    std::lock_guard lock(state_->mutex);
    state_->queue.push_back(job);
  }
  state_->wake.notify_one();

  Timings timings;
  std::optional<Clock::time_point> first;
  std::string text;
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
    if (auto* piece = std::get_if<std::string>(&event)) {
      if (!first) {
        first = now;
        timings.ttft_ms = ms_between(start, now);
      }
      text += *piece;
      if (sink) sink(*piece);
      continue;
    }
    timings.total_ms = ms_between(start, now);
    if (auto* failed = std::get_if<Failed>(&event)) co_return Outcome::failure(failed->error, timings);
    const GenerateResult& r = std::get<Done>(event).result;
    if (!first) timings.ttft_ms = timings.total_ms;
    if (r.stats.generated_tokens > 1 && first) {
      timings.tpot_ms = ms_between(*first, now) / static_cast<double>(r.stats.generated_tokens - 1);
    }
    Completion c;
    c.text = std::move(text);
    c.finish_reason = r.finish_reason;
    c.usage = Usage{r.stats.prompt_tokens, r.stats.generated_tokens, true};
    c.timings = timings;
    co_return Outcome::success(std::move(c));
  }
}

}  // namespace batchlm::local_engine
