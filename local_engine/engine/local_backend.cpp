#include "batchlm/local_engine/local_backend.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>
#include <variant>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/experimental/concurrent_channel.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/engine.hpp"

namespace batchlm::local_engine {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

namespace {

// What the engine thread sends back for one request: text pieces, then one final result.
struct Finished {
  GenerateResult result;
};
struct Failed {
  Error error;
};
using Event = std::variant<std::string, Finished, Failed>;
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

struct LocalBackend::State {
  std::shared_ptr<const Model> model;
  std::unique_ptr<Engine> engine;
  std::filesystem::path path;

  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::shared_ptr<Job>> queue;
  std::shared_ptr<Job> current;  // the job on the engine now, so shutdown can cancel it
  bool stopping = false;
  std::thread thread;

  void run() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock lock(mutex);
        wake.wait(lock, [&] { return stopping || !queue.empty(); });
        if (stopping) return;
        job = std::move(queue.front());
        queue.pop_front();
        current = job;
      }
      if (job->cancelled.load()) continue;
      try {
        GenerateResult r = engine->generate(job->prompt, job->params, [&](std::string_view text) {
          return job->send(std::string(text));
        });
        job->send(Finished{std::move(r)});
      } catch (const std::invalid_argument& e) {
        Error err{ErrorKind::Http, 400, "context_length_exceeded", e.what(), std::nullopt, false};
        job->send(Failed{std::move(err)});
      } catch (const std::exception& e) {
        Error err{ErrorKind::Internal, 0, "", std::string("engine: ") + e.what(), std::nullopt,
                  false};
        job->send(Failed{std::move(err)});
      }
      std::lock_guard lock(mutex);
      current.reset();
    }
  }
};

LocalBackend::LocalBackend(asio::any_io_executor executor, const LocalBackendOptions& options)
    : executor_(std::move(executor)), state_(std::make_shared<State>()) {
  state_->path = options.model;
  state_->model = Model::load(options.model);
  state_->engine = std::make_unique<Engine>(state_->model,
                                            EngineOptions{options.threads, options.context});
  state_->thread = std::thread([s = state_.get()] { s->run(); });
}

LocalBackend::~LocalBackend() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
    for (auto& job : state_->queue) job->cancelled = true;
    if (state_->current) state_->current->cancelled = true;
  }
  state_->wake.notify_all();
  state_->thread.join();
}

std::string LocalBackend::describe() const {
  const ModelConfig& c = state_->model->config();
  return "local " + state_->path.string() + " (" + (c.name.empty() ? c.architecture : c.name) +
         ", " + std::to_string(state_->engine->threads()) + " threads, " +
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
    job->prompt = state_->engine->chat_prompt(request.messages);
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
    const GenerateResult& r = std::get<Finished>(event).result;
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
