#include "batchlm/local_engine/batch_engine.hpp"

#include "batchlm/core/engine_fields.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/kv_cache.hpp"

namespace batchlm::local_engine {

namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

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
                            std::int64_t bytes_per_token, std::int64_t available_bytes,
                            bool device_memory) {
  if (o.kv_tokens < 0) throw std::invalid_argument("kv_tokens must be >= 0");
  if (o.kv_bytes < 0) throw std::invalid_argument("kv_bytes must be >= 0");
  std::int64_t tokens = 0;
  if (o.kv_tokens > 0) {
    tokens = o.kv_tokens;
  } else if (o.kv_bytes > 0) {
    tokens = o.kv_bytes / bytes_per_token;
  } else {
    if (device_memory) {
      // A GPU's memory is there for the engine: the pool takes what the weights left, and
      // every block beyond the running sequences' is prefix cache.
      tokens = available_bytes / bytes_per_token;
    } else {
      tokens = static_cast<std::int64_t>(o.max_sequences) * context;
      if (available_bytes > 0) tokens = std::min(tokens, available_bytes / 4 / bytes_per_token);
    }
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

void BatchEngine::ForwardCost::add(double tokens, double ms) {
  // Forget slowly, so the fit follows the machine's load and the batch sizes of late.
  constexpr double kKeep = 0.98;
  w = kKeep * w + 1;
  x = kKeep * x + tokens;
  y = kKeep * y + ms;
  xx = kKeep * xx + tokens * tokens;
  xy = kKeep * xy + tokens * ms;
}

bool BatchEngine::ForwardCost::fitted(double& fixed, double& per_token) const {
  const double var = w * xx - x * x;
  if (w < 4 || var <= 1e-9 * w * xx) return false;  // too few steps, or all of one size
  per_token = std::max(0.0, (w * xy - x * y) / var);
  fixed = std::max(0.0, (y - per_token * x) / w);
  return fixed + per_token > 0;
}

namespace {

// The options checked alike by the engine and by check(): returns the token budget.
std::int64_t checked_budget(const LocalBackendOptions& options) {
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
  return budget;
}

// The drafting model and the layers it drafts with (none for kNone and kNgram). Throws
// std::invalid_argument for self-drafting layers the model lacks, DraftModelUnusable for a draft
// model that cannot be loaded or does not share the vocabulary.
std::pair<std::shared_ptr<const Model>, std::int64_t> drafter_for(const std::shared_ptr<const Model>& model,
                                                                  const SpeculativeOptions& speculative,
                                                                  bool check_only, std::int64_t context) {
  const ModelConfig& c = model->config();
  switch (speculative.method) {
    case SpecMethod::kNone:
    case SpecMethod::kNgram: return {nullptr, 0};
    case SpecMethod::kSelf: {
      const std::int64_t layers =
          speculative.layers > 0 ? speculative.layers : std::max<std::int64_t>(1, c.n_layers / 4);
      if (layers >= c.n_layers)
        throw std::invalid_argument("speculative.layers must be less than the model's " +
                                    std::to_string(c.n_layers) + " layers, not " + std::to_string(layers));
      return {model, layers};
    }
    case SpecMethod::kDraft: {
      try {
        std::shared_ptr<const Model> drafter = Model::load(speculative.model, check_only, context);
        check_same_vocabulary(*model, *drafter);
        return {drafter, drafter->config().n_layers};
      } catch (const gguf::Error& e) {
        throw DraftModelUnusable(e.what());
      } catch (const std::invalid_argument& e) {
        throw DraftModelUnusable(e.what());
      }
    }
  }
  return {nullptr, 0};
}

// KV bytes per token: the model's K and V in F16, and the drafter's layers beside them.
std::int64_t kv_bytes_per_token(const ModelConfig& c, const Model* drafter, std::int64_t draft_layers) {
  std::int64_t bytes = 2 * c.n_layers * c.kv_width() * 2;
  if (drafter != nullptr) bytes += 2 * draft_layers * drafter->config().kv_width() * 2;
  return bytes;
}

// A CPU pool set larger than the memory available: refused where it is written at start (it
// would exhaust the memory before the first request); else the memory there is (the run warns).
std::int64_t cpu_pool_past_memory(const LocalBackendOptions& options, std::int64_t pool_bytes) {
  if (options.kv_tokens <= 0 && options.kv_bytes <= 0) return 0;
  const std::int64_t available = available_memory_bytes();
  if (available <= 0 || pool_bytes <= available) return 0;
  if (options.kv_commit)
    throw std::invalid_argument((options.kv_tokens > 0 ? "kv_tokens " + std::to_string(options.kv_tokens)
                                                       : "kv_bytes " + std::to_string(options.kv_bytes)) +
                                " is a KV pool of " + gguf::human_bytes(static_cast<double>(pool_bytes)) +
                                ", more than the memory available now (" +
                                gguf::human_bytes(static_cast<double>(available)) +
                                "), and it is written at start: give a smaller one");
  return available;
}

}  // namespace

Device BatchEngine::check(const std::shared_ptr<const Model>& model, const LocalBackendOptions& options) {
  checked_budget(options);
  // Where the constructor opens the step log: that it could be opened for appending, without
  // creating it.
  if (!options.step_log.empty()) {
    const std::filesystem::path& log = options.step_log;
    const std::filesystem::path parent = log.has_parent_path() ? log.parent_path() : ".";
    std::error_code ec;
    const bool exists = std::filesystem::exists(log, ec);
    const int err = std::filesystem::is_directory(log, ec)                              ? EISDIR
                    : ::access(exists ? log.c_str() : parent.c_str(), W_OK) != 0 ? errno
                                                                                    : 0;
    if (err != 0)
      throw StepLogUnwritable("cannot open '" + options.step_log.string() + "' for writing: " + std::strerror(err));
  }
  SpeculativeOptions speculative = options.speculative;
  if (speculative.method != SpecMethod::kNone) validate(speculative);
  const ModelConfig& c = model->config();
  const std::int64_t context = choose_context(c, options.context);
  check_loaded_for(c, context);
  const std::optional<std::string> no_gpu = gpu_refusal(*model, options.device);
  if (options.device == Device::kCuda && no_gpu)
    throw DeviceUnavailable("device 'cuda' was asked for, but " + *no_gpu);
  const auto [drafter, draft_layers] = drafter_for(model, speculative, /*check_only=*/true, options.context);
  const bool gpu = options.device != Device::kCpu && !no_gpu;
  // A drafting model runs where the target does.
  if (gpu && drafter && drafter != model)
    if (const std::optional<std::string> why = gpu_refusal(*drafter, Device::kCuda))
      throw DeviceUnavailable("device 'cuda' was asked for, but " + *why);
  const std::int64_t bytes_per_token = kv_bytes_per_token(c, drafter.get(), draft_layers);
  // A pool set in tokens or bytes is checked against one context anywhere; the memory only on
  // the CPU (a GPU's is known once it holds the weights).
  const std::int64_t pool_tokens =
      kv_pool_tokens(options, context, bytes_per_token, gpu ? 0 : available_memory_bytes(), gpu);
  const std::int64_t block = options.block_size;
  if (!gpu) cpu_pool_past_memory(options, (pool_tokens + block - 1) / block * block * bytes_per_token);
  return gpu ? Device::kCuda : Device::kCpu;
}

BatchEngine::BatchEngine(std::shared_ptr<const Model> model, const LocalBackendOptions& options,
                         const ExecutorWrapper& wrap_executor)
    : model_(std::move(model)), speculative_(options.speculative), created_(Clock::now()) {
  const std::int64_t budget = checked_budget(options);
  // Opened before the pool is allocated and written, so a bad path fails at once.
  if (!options.step_log.empty()) {
    step_log_.reset(std::fopen(options.step_log.c_str(), "a"));
    if (!step_log_)
      throw StepLogUnwritable("cannot open '" + options.step_log.string() + "' for writing: " +
                              std::strerror(errno));
  }
  if (speculative_.method != SpecMethod::kNone) validate(speculative_);
  const ModelConfig& c = model_->config();
  context_ = choose_context(c, options.context);
  check_loaded_for(c, context_);
  // The device: the target's weights go there first, then a drafting model's, and the KV
  // pools share what memory is left.
  threads_ = std::make_unique<kernels::ThreadPool>(options.threads);
  ExecutorOptions device{.device = options.device,
                         .thread_pool = threads_.get(),
                         .context = context_,
                         .graphs = options.cuda_graphs};
  executor_ = make_executor(model_, device, &no_gpu_);
  if (wrap_executor) executor_ = wrap_executor(std::move(executor_));
  device.device = executor_->device();  // a drafting model runs where the target does

  const auto [drafter, draft_layers] = drafter_for(model_, speculative_, /*check_only=*/false, options.context);
  std::unique_ptr<Executor> draft_executor;
  if (drafter) {
    ExecutorOptions d = device;
    d.layers = draft_layers;
    draft_executor = make_executor(drafter, d);
  }

  // On the CPU pages of the pool are touched only as blocks are first used, unless kv_commit
  // writes them all now.
  const std::int64_t block = options.block_size;
  const std::int64_t bytes_per_token = kv_bytes_per_token(c, drafter.get(), draft_layers);
  const std::int64_t pool_tokens =
      kv_pool_tokens(options, context_, bytes_per_token, executor_->pool_memory_available(),
                     executor_->device() != Device::kCpu);
  const std::int64_t n_blocks = (pool_tokens + block - 1) / block;
  // A pool set larger than the memory available is taken (the system promises pages it may not
  // have) and said so; written at start, it would exhaust the memory before the first request.
  if (executor_->device() == Device::kCpu) pool_past_memory_ = cpu_pool_past_memory(options, n_blocks * block * bytes_per_token);
  executor_->allocate_pool(block, n_blocks);
  kv_bytes_per_token_ = bytes_per_token;
  if (options.kv_commit) executor_->commit_pool();

  if (speculative_.method == SpecMethod::kNgram)
    proposer_ = make_ngram_proposer(speculative_.ngram_min, speculative_.ngram_max);
  if (drafter)
    proposer_ = make_model_proposer(drafter, std::move(draft_executor), options.block_size, pool_tokens,
                                    options.kv_commit);
  blocks_ = std::make_unique<BlockPool>(BlockPoolOptions{options.block_size, n_blocks, options.kv_recycle});
  scheduler_ = std::make_unique<Scheduler>(
      *blocks_, SchedulerOptions{options.max_sequences, budget, budget});
}

BatchEngine::~BatchEngine() = default;

int BatchEngine::threads() const { return threads_->size(); }

std::int64_t BatchEngine::pool_tokens() const { return blocks_->n_blocks() * blocks_->block_size(); }

bool BatchEngine::samples_on_device() const { return executor_->samples_on_device(); }

std::string BatchEngine::device() const {
  std::string d = executor_->describe();
  if (!no_gpu_.empty()) d += "; no GPU: " + no_gpu_;
  return d;
}

SequenceId BatchEngine::add(std::vector<Token> prompt, const GenerateParams& params,
                            TextSink on_text) {
  const auto n_prompt = static_cast<std::int64_t>(prompt.size());
  if (n_prompt == 0) throw RequestRejected("invalid_request", "the prompt is empty");
  // On a device that samples, such rows would send the whole step's sampling to the host, whose
  // generator differs from the device's: other requests' seeded draws would change.
  if (executor_->samples_on_device()) {
    const SamplingParams& sp = params.sampling;
    const auto asked = cpu_only_sampling({.penalty = sp.presence_penalty != 0.0f || sp.frequency_penalty != 0.0f
                                                         ? "presence_penalty', 'frequency_penalty"
                                                     : sp.repetition_penalty != 1.0f ? "repetition_penalty"
                                                                                     : "",
                                          .min_p = params.sampling.min_p > 0.0f,
                                          .min_tokens = params.sampling.min_tokens > 0,
                                          .bad_words = !params.sampling.bad_words.empty(),
                                          .logit_bias = !params.sampling.logit_bias.empty(),
                                          .logprobs = params.logprobs >= 0,
                                          .json_object = params.json_object,
                                          .forced_call = params.forced_call,
                                          .json_schema = params.json_schema != nullptr});
    if (asked)
      throw RequestRejected("unsupported_parameter", "'" + asked->first + "': " + asked->second +
                                                         " on the CPU only, and this engine samples on the GPU "
                                                         "(serve --device cpu, or a job's backend.device: cpu, runs them)");
  }
  if (params.logprobs > kMaxLogprobs)
    throw RequestRejected("invalid_request", "'top_logprobs': at most " + std::to_string(kMaxLogprobs) +
                                                 " most likely tokens per position, not " +
                                                 std::to_string(params.logprobs));
  if (n_prompt >= context_) {
    throw RequestRejected("context_length_exceeded",
                          prompt_past_context(model_->config(), n_prompt, context_));
  }
  // Checked here: a bad id found by the forward pass would fail the whole batch's step.
  const std::int64_t n_vocab = model_->config().n_vocab;
  for (std::size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= n_vocab)
      throw RequestRejected("invalid_request", "prompt token " + std::to_string(i) + " is id " +
                                                   std::to_string(prompt[i]) + ", outside the vocabulary of " +
                                                   std::to_string(n_vocab));
  }
  for (const auto& [token, bias] : params.sampling.logit_bias) {
    if (token < 0 || token >= n_vocab)
      throw RequestRejected("invalid_request", "'logit_bias': token " + std::to_string(token) +
                                                   " is outside the vocabulary of " + std::to_string(n_vocab));
  }
  const std::int64_t room = context_ - n_prompt;
  if (params.refuse_past_context && params.max_tokens > room)
    throw RequestRejected("context_length_exceeded",
                          "'max_tokens': the context holds " + std::to_string(context_) + " tokens and the prompt has " +
                              std::to_string(n_prompt) + ", which leaves room for " + std::to_string(room) +
                              " more, not " + std::to_string(params.max_tokens));
  const std::int64_t max_new = params.max_tokens > 0 ? std::min(params.max_tokens, room) : room;
  Generation gen(model_->tokenizer(), params, prompt);
  SequenceId id = 0;
  try {
    id = scheduler_->add(std::move(prompt), max_new);
  } catch (const std::invalid_argument& e) {
    throw RequestRejected("context_length_exceeded", e.what());
  }
  Active a{std::move(on_text),
           std::move(gen),
           params.sampling,
           {},
           {},
           Clock::now(),
           std::nullopt,
           DraftLength(speculative_.k_min, speculative_.k_max)};
  a.result.stats.prompt_tokens = n_prompt;
  active_.emplace(id, std::move(a));
  return id;
}

void BatchEngine::cancel(SequenceId id) {
  auto it = active_.find(id);
  if (it == active_.end()) return;
  it->second.reason = "cancelled";
  scheduler_->cancel(id);
  for (const Finished& f : scheduler_->take_finished()) finish(f);
}

bool BatchEngine::idle() const { return active_.empty(); }

bool BatchEngine::emit(Active& a, const std::string& text, bool done) {
  if (!a.first) a.first = Clock::now();
  std::vector<TokenLogprob> logprobs = a.gen.take_logprobs();
  if (!text.empty() || !logprobs.empty()) {
    a.result.text += text;
    a.result.logprobs.insert(a.result.logprobs.end(), logprobs.begin(), logprobs.end());
    if (a.on_text && !a.on_text(text, logprobs)) {
      a.reason = "cancelled";
      return true;
    }
  }
  if (done) a.reason = a.gen.finish_reason();
  return done;
}

void BatchEngine::finish(const Finished& f) {
  auto it = active_.find(f.id);
  if (it == active_.end()) return;
  if (proposer_) proposer_->forget(f.id);
  Active& a = it->second;
  const std::string reason = a.reason.empty() ? std::string(to_string(f.reason)) : a.reason;
  GenerateResult result = std::move(a.result);
  result.tokens = f.generated;
  if (reason != "cancelled" && reason != "error") {
    std::string tail = a.gen.flush();
    std::vector<TokenLogprob> logprobs = a.gen.take_logprobs();
    if (!tail.empty() || !logprobs.empty()) {
      result.text += tail;
      result.logprobs.insert(result.logprobs.end(), logprobs.begin(), logprobs.end());
      if (a.on_text) a.on_text(tail, logprobs);
    }
  }
  result.stats.generated_tokens = a.gen.generated();
  result.finish_reason = reason;
  const auto now = Clock::now();
  result.stats.generate_ms = a.first ? ms_between(*a.first, now) : 0;
  result.stats.prompt_ms = a.first ? ms_between(a.start, *a.first) : ms_between(a.start, now);
  finished_.emplace_back(f.id, std::move(result));
  active_.erase(it);
}

double BatchEngine::draft_cost(std::int64_t decoding) const {
  // One drafted token against one sequence's share of a target pass: at one sequence the
  // weights' reading dominates and a few more tokens are nearly free; in a large batch every
  // token costs about as much as a sequence's own.
  double fixed = 0, per_token = 0;
  double cost = 0.1;
  if (forward_cost_.fitted(fixed, per_token)) {
    const double share = fixed / static_cast<double>(std::max<std::int64_t>(decoding, 1)) + per_token;
    cost = per_token / share;
    if (proposer_->runs_model()) cost += draft_ms_per_token_ / share;
  }
  return std::clamp(cost, 0.01, 10.0);
}

AcceptanceCurve& BatchEngine::curve(int evidence) {
  if (curves_.empty())
    curves_.assign(static_cast<std::size_t>(std::max(speculative_.ngram_max, 1)) + 1,
                   AcceptanceCurve(speculative_.k_max));
  return curves_[static_cast<std::size_t>(std::clamp(evidence, 0, static_cast<int>(curves_.size()) - 1))];
}

int BatchEngine::draft_while_planning(SequenceId id, double cost) {
  auto it = active_.find(id);
  if (it == active_.end() || it->second.sampling.adjusted() || it->second.gen.constrained()) return 0;
  const auto t0 = Clock::now();
  const DraftRequest request{id, scheduler_->tokens(id), speculative_.k_max, &it->second.sampling};
  Draft& d = planned_drafts_[id];
  proposer_->propose(std::span(&request, 1), std::span(&d, 1));
  const auto k = static_cast<std::size_t>(
      curve(d.evidence).best(cost, speculative_.k_min, static_cast<int>(d.tokens.size())));
  if (d.tokens.size() > k) d.tokens.resize(k);
  if (d.q.size() > k) d.q.resize(k);
  draft_ms_ += ms_between(t0, Clock::now());
  return static_cast<int>(k);
}

void BatchEngine::draft(StepPlan& plan, std::vector<Draft>& drafts) {
  std::vector<DraftRequest> requests;
  std::vector<std::size_t> entry_of;
  for (std::size_t i = 0; i < plan.entries.size(); ++i) {
    const PlannedSequence& e = plan.entries[i];
    if (e.max_drafts < 1) continue;
    const Active& a = active_.at(e.id);
    requests.push_back({e.id, scheduler_->tokens(e.id), e.max_drafts, &a.sampling});
    entry_of.push_back(i);
  }
  drafts.assign(plan.entries.size(), Draft{});
  if (requests.empty()) return;
  std::vector<Draft> proposed(requests.size());
  const auto t0 = Clock::now();
  if (proposer_->runs_model()) {
    proposer_->propose(requests, proposed);
  } else {
    for (std::size_t r = 0; r < requests.size(); ++r) {
      auto it = planned_drafts_.find(requests[r].id);
      if (it != planned_drafts_.end()) proposed[r] = std::move(it->second);
    }
  }
  const double ms = ms_between(t0, Clock::now());
  draft_ms_ += ms;
  std::vector<std::vector<Token>> lists(plan.entries.size());
  std::int64_t drafted = 0;
  for (std::size_t r = 0; r < requests.size(); ++r) {
    if (std::ssize(proposed[r].tokens) > requests[r].max_tokens) {
      proposed[r].tokens.resize(static_cast<std::size_t>(requests[r].max_tokens));
      if (!proposed[r].q.empty()) proposed[r].q.resize(static_cast<std::size_t>(requests[r].max_tokens));
    }
    lists[entry_of[r]] = proposed[r].tokens;
    drafted += std::ssize(proposed[r].tokens);
    drafts[entry_of[r]] = std::move(proposed[r]);
  }
  if (proposer_->runs_model() && drafted > 0) {
    // Per drafted token of one sequence: the rounds ran all sequences together.
    std::int64_t rounds = 0;
    for (const auto& l : lists) rounds = std::max<std::int64_t>(rounds, std::ssize(l));
    const double per_token = ms / static_cast<double>(rounds) /
                             static_cast<double>(std::max<std::size_t>(requests.size(), 1));
    draft_ms_per_token_ = draft_ms_per_token_ == 0 ? per_token : 0.9 * draft_ms_per_token_ + 0.1 * per_token;
  }
  plan.add_drafts(lists);
}

void BatchEngine::step() {
  const auto t0 = Clock::now();
  StepPlan plan;
  if (proposer_) {
    const double cost = draft_cost(decoding_);
    planned_drafts_.clear();
    // A request with penalties, biases or JSON mode gets no drafts: its verification would
    // need the adjusted or masked logits of every drafted position.
    if (proposer_->runs_model()) {
      plan = scheduler_->plan([&](SequenceId id) {
        auto it = active_.find(id);
        return it == active_.end() || it->second.sampling.adjusted() || it->second.gen.constrained()
                   ? 0
                   : it->second.length.wanted(cost);
      });
    } else {
      plan = scheduler_->plan([&](SequenceId id) { return draft_while_planning(id, cost); });
    }
  } else {
    plan = scheduler_->plan();
  }
  if (plan.empty()) {
    for (const Finished& f : scheduler_->take_finished()) finish(f);
    return;
  }
  std::vector<Draft> drafts;
  if (proposer_) draft(plan, drafts);

  std::vector<std::int32_t> positions(plan.positions.begin(), plan.positions.end());
  std::vector<std::span<const std::int32_t>> tables;
  tables.reserve(plan.entries.size());
  for (const auto& e : plan.entries) tables.emplace_back(e.block_table);
  const std::size_t n_vocab = static_cast<std::size_t>(model_->config().n_vocab);
  const Batch batch{plan.tokens, positions, plan.sequence_of, tables, plan.logits_rows};
  // Without drafts to verify, a device that samples sends back token ids alone (penalized
  // requests are refused there).
  const bool device_sampling =
      executor_->samples_on_device() &&
      std::none_of(plan.entries.begin(), plan.entries.end(),
                   [](const PlannedSequence& e) { return e.n_drafts > 0; });
  std::vector<Token> sampled;
  const auto t_forward = Clock::now();
  if (!plan.copies.empty()) executor_->copy_blocks(plan.copies);
  if (device_sampling) {
    std::vector<RowSampling> sampling;
    for (const PlannedSequence& e : plan.entries) {
      if (!e.wants_logits) continue;
      RowSampling r{.params = SamplingParams{.temperature = 0.0f}};
      if (auto it = active_.find(e.id); it != active_.end()) {
        r.params = it->second.sampling;
        r.counter = static_cast<std::uint64_t>(it->second.gen.generated());
      }
      sampling.push_back(r);
    }
    sampled.resize(sampling.size());
    executor_->forward_sample(batch, sampling, sampled);
  } else {
    logits_.resize(plan.logits_rows.size() * n_vocab);
    executor_->forward(batch, logits_);
  }
  const double forward_ms = ms_between(t_forward, Clock::now());
  forward_cost_.add(static_cast<double>(plan.tokens.size()), forward_ms);

  // Each entry's first logits (or sampled) row.
  std::vector<std::size_t> first_row(plan.entries.size(), 0);
  for (std::size_t i = 0, row = 0; i < plan.entries.size(); ++i) {
    first_row[i] = row;
    if (plan.entries[i].wants_logits) row += static_cast<std::size_t>(plan.entries[i].n_logits());
  }
  const auto logits_of = [&](std::size_t i) {
    return std::span<const float>(logits_.data() + first_row[i] * n_vocab,
                                  static_cast<std::size_t>(plan.entries[i].n_logits()) * n_vocab);
  };

  // The rows that sample one token each are sampled on the kernel threads (a greedy pick scans
  // the whole vocabulary); each sequence's sampler is used by one thread only. What the tokens
  // mean is then taken in order, below.
  std::vector<Token> picked(plan.entries.size(), 0);
  std::vector<std::optional<PositionLogprobs>> logprobs(plan.entries.size());
  // Rows with a NaN or an infinity: their request fails (below), the others go on. Checked on
  // the sampling threads with the rows they sample, and below for rows of drafts to verify.
  std::vector<char> broken(plan.entries.size(), 0);
  if (!device_sampling) {
    std::vector<std::size_t> sampling;  // entries
    for (std::size_t i = 0; i < plan.entries.size(); ++i) {
      const PlannedSequence& e = plan.entries[i];
      if (e.wants_logits && e.n_drafts == 0 && active_.contains(e.id)) sampling.push_back(i);
    }
    threads_->parallel_for(static_cast<std::int64_t>(sampling.size()), 1, [&](std::int64_t b, std::int64_t e, int) {
      for (std::int64_t j = b; j < e; ++j) {
        const std::size_t i = sampling[static_cast<std::size_t>(j)];
        broken[i] = broken_logits(logits_of(i));
        if (broken[i]) continue;
        Generation& gen = active_.find(plan.entries[i].id)->second.gen;
        picked[i] = gen.sampler().sample(gen.constrain(logits_of(i)));
        if (gen.logprobs() >= 0) logprobs[i] = position_logprobs(logits_of(i), picked[i], gen.logprobs());
      }
    });
  }

  std::vector<StepResult> results;
  decoding_ = 0;
  for (std::size_t i = 0; i < plan.entries.size(); ++i) {
    const PlannedSequence& e = plan.entries[i];
    if (!e.wants_logits) continue;
    StepResult r{e.id, 0, false, 0};
    auto it = active_.find(e.id);
    if (it == active_.end()) {
      r.finished = true;
      results.push_back(r);
      continue;
    }
    Active& a = it->second;
    std::string text;
    if (e.decode) {
      ++decoding_;
      ++decode_passes_;
    }
    // On a device that samples, the row's token is -1 where its logits were broken.
    if (broken[i] || (e.n_drafts > 0 && broken_logits(logits_of(i))) ||
        (device_sampling && e.n_drafts == 0 && sampled[first_row[i]] < 0)) {
      a.reason = "error";
      a.result.error = broken_logits_message(a.gen.generated());
      r.finished = true;
    } else if (e.n_drafts == 0) {
      ++sampled_;
      r.token = device_sampling ? sampled[first_row[i]] : picked[i];
      const bool done = a.gen.accept(r.token, text, logprobs[i] ? &*logprobs[i] : nullptr);
      r.finished = emit(a, text, done);
    } else {
      const Verdict verdict = verify(a.gen.sampler(), logits_of(i), static_cast<std::int64_t>(n_vocab), drafts[i]);
      if (proposer_->runs_model()) {
        a.length.update(e.n_drafts, verdict.accepted);
      } else {
        curve(drafts[i].evidence).update(e.n_drafts, verdict.accepted);
      }
      int fed = 0;
      for (Token token : verdict.tokens) {
        // Token k of the verdict was chosen at the position of row k of the entry's logits.
        std::optional<PositionLogprobs> lp;
        if (a.gen.logprobs() >= 0)
          lp = position_logprobs(logits_of(i).subspan(static_cast<std::size_t>(fed) * n_vocab, n_vocab), token,
                                 a.gen.logprobs());
        ++fed;
        ++sampled_;
        const bool done = a.gen.accept(token, text, lp ? &*lp : nullptr);
        r.token = token;
        r.finished = emit(a, text, done);
        if (r.finished) break;
      }
      r.accepted = fed - 1;
    }
    results.push_back(r);
  }
  scheduler_->complete(plan, results);
  for (const Finished& f : scheduler_->take_finished()) finish(f);
  const double ms = ms_between(t0, Clock::now());
  step_ms_ += ms;
  if (step_log_) log_step(plan, t0, forward_ms, ms);
}

void BatchEngine::log_step(const StepPlan& plan, std::chrono::steady_clock::time_point start, double forward_ms, double ms) {
  std::int64_t decode = 0, drafts = 0, prompt = 0;
  for (const PlannedSequence& e : plan.entries) {
    if (e.decode) {
      ++decode;
      drafts += e.n_drafts;
    } else {
      prompt += e.n_tokens;
    }
  }
  const SchedulerStats s = scheduler_->stats();
  std::fprintf(step_log_.get(),
               "{\"step\":%llu,\"t\":%.6f,\"sequences\":%zu,\"decode\":%lld,\"drafts\":%lld,"
               "\"prompt\":%lld,\"tokens\":%zu,\"forward_ms\":%.3f,\"step_ms\":%.3f,\"running\":%lld,"
               "\"waiting\":%lld,\"blocks_used\":%lld}\n",
               static_cast<unsigned long long>(plan.step), std::chrono::duration<double>(start - created_).count(),
               plan.entries.size(), static_cast<long long>(decode), static_cast<long long>(drafts),
               static_cast<long long>(prompt), plan.tokens.size(), forward_ms, ms,
               static_cast<long long>(s.running), static_cast<long long>(s.waiting),
               static_cast<long long>(s.blocks_used));
  std::fflush(step_log_.get());
}

std::vector<std::pair<SequenceId, GenerateResult>> BatchEngine::take_finished() {
  return std::exchange(finished_, {});
}

EngineStats BatchEngine::stats() const {
  const SchedulerStats s = scheduler_->stats();
  EngineStats stats;
  stats.running = s.running;
  stats.waiting = s.waiting;
  stats.preemptions = s.preemptions;
  stats.prompt_tokens_computed = s.prompt_tokens_computed;
  stats.prompt_tokens_cached = s.prompt_tokens_cached;
  stats.recomputed_tokens = s.recomputed_tokens;
  stats.generated_tokens = sampled_;
  stats.steps = s.steps;
  stats.blocks_used = s.blocks_used;
  stats.blocks_total = s.blocks_total;
  stats.block_size = blocks_->block_size();
  if (proposer_) {
    stats.speculative = std::string(to_string(speculative_.method));
    stats.drafted_tokens = s.drafted_tokens;
    stats.accepted_tokens = s.accepted_tokens;
    stats.decode_passes = decode_passes_;
    stats.draft_ms = draft_ms_;
    stats.step_ms = step_ms_;
  }
  return stats;
}

}  // namespace batchlm::local_engine
