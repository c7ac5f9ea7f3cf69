#pragma once
// The continuous-batching engine, synchronous: requests are added, step() runs one scheduler
// step (one batched forward pass of the target model, preceded by drafting when speculative
// decoding is on), text streams to each request's sink, and finished requests come out of
// take_finished(). LocalBackend runs it on its engine thread; tests drive it directly.
//
//   BatchEngine engine(model, options);
//   SequenceId id = engine.add(prompt, params, on_text);
//   while (!engine.idle()) engine.step();
//   for (auto& [id, result] : engine.take_finished()) ...

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "batchlm/core/types.hpp"
#include "batchlm/local_engine/engine.hpp"
#include "batchlm/local_engine/executor.hpp"
#include "batchlm/local_engine/scheduler.hpp"
#include "batchlm/local_engine/spec.hpp"

namespace batchlm::local_engine {

struct LocalBackendOptions {
  std::filesystem::path model;  // a GGUF file
  int threads = 0;              // compute threads; 0: one per hardware thread
  std::int64_t context = 0;     // tokens per sequence; 0: min(training context, 4096)
  int max_sequences = 32;       // sequences decoded together (continuous batching)
  std::int64_t token_budget = 0;  // tokens in one batched forward pass; 0: the model's maximum
                                  // (512); at least max_sequences
  int block_size = 16;          // tokens per KV block
  // The KV pool: kv_tokens if set, else kv_bytes if set, else enough for max_sequences full
  // contexts but at most a quarter of the memory available now. Never less than one context.
  std::int64_t kv_tokens = 0;
  std::int64_t kv_bytes = 0;
  // Reuse the blocks of finished sequences that no other sequence shared before taking pool
  // memory never used (BlockPoolOptions::recycle): the pool's memory then grows only with the
  // running sequences, at the cost of a prefix cache that forgets unshared prompts sooner.
  bool kv_recycle = false;
  // Write the whole pool once at start-up (Executor::commit_pool), so requests never wait for
  // fresh memory to be mapped; the pool's memory is then resident from the start.
  bool kv_commit = false;
  // When set, one JSON line per engine step is appended to this file: its time, sequences,
  // decode and prompt tokens, and how long the forward pass and the whole step took (for
  // finding where a batch run's time goes). Throws std::invalid_argument naming step_log when
  // the file cannot be opened.
  std::filesystem::path step_log;
  SpeculativeOptions speculative;  // method kNone: off
  Device device = Device::kAuto;   // auto: CUDA when a usable GPU is present, else the CPU
  bool cuda_graphs = true;         // CUDA: replay decode steps from captured graphs
  // A chat answer that opens with a <think> block (or whose prompt opened one, as DeepSeek-R1
  // distills' do) gives the block's text as Completion::reasoning, apart from the content, as
  // reasoning APIs do (`reasoning_content`); false: it stays at the head of the text.
  bool split_reasoning = true;
};

// The pool size in tokens those options give for a model with `bytes_per_token` of keys and
// values (all layers); `available_bytes` is the memory free now. On the CPU the default is
// max_sequences contexts within a quarter of that memory; in device memory (a GPU's, after the
// weights) it is all of it. Never less than one context. Throws std::invalid_argument when the
// options are out of range (the message names the option).
std::int64_t kv_pool_tokens(const LocalBackendOptions& options, std::int64_t context,
                            std::int64_t bytes_per_token, std::int64_t available_bytes,
                            bool device_memory = false);
// MemAvailable from /proc/meminfo (0 when unknown).
std::int64_t available_memory_bytes();

// A request the engine refuses; code is the OpenAI-style error code ("invalid_request",
// "context_length_exceeded").
struct RequestRejected : std::invalid_argument {
  RequestRejected(std::string code, const std::string& message)
      : std::invalid_argument(message), code(std::move(code)) {}
  std::string code;
};

// LocalBackendOptions::step_log cannot be opened for writing; `detail` says why without the
// option's name, for callers that name it their own way.
struct StepLogUnwritable : std::invalid_argument {
  explicit StepLogUnwritable(std::string detail)
      : std::invalid_argument("step_log: " + detail), detail(std::move(detail)) {}
  std::string detail;
};

// The draft model (speculative.model) could not be loaded, or cannot draft for the model (another
// vocabulary). The message starts with its path.
struct DraftModelUnusable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class BatchEngine {
  struct Active;

 public:
  // Receives each piece of text as it becomes final, with the log-probabilities of its tokens
  // when they were asked for (GenerateParams::logprobs); returns false to cancel the request.
  using TextSink = std::function<bool(std::string_view text, std::span<const TokenLogprob> logprobs)>;

  // Takes the executor the engine made and returns the one it uses: tests put a stand-in
  // around it (the device-sampling path, run on the CPU).
  using ExecutorWrapper = std::function<std::unique_ptr<Executor>(std::unique_ptr<Executor>)>;

  // Throws std::invalid_argument naming a bad option, DraftModelUnusable for a draft model that
  // cannot be used.
  BatchEngine(std::shared_ptr<const Model> model, const LocalBackendOptions& options,
              const ExecutorWrapper& wrap_executor = {});
  // What the constructor would refuse of `options` for `model` (which may be loaded check-only),
  // without allocating or uploading anything: the limits, the speculative settings and draft
  // model, a GPU asked for that cannot run it, a KV pool too small for one context or one
  // written at start larger than the memory. The step log is not opened. Throws as it does
  // (DeviceUnavailable too). Returns where the forward passes would run (kCuda or kCpu) as far
  // as can be told without the weights: under kAuto, what the upload refuses (a value past
  // F16's range, memory the card lacks) still leaves the run on the CPU.
  static Device check(const std::shared_ptr<const Model>& model, const LocalBackendOptions& options);
  ~BatchEngine();
  BatchEngine(const BatchEngine&) = delete;
  BatchEngine& operator=(const BatchEngine&) = delete;

  // Queues a request; throws RequestRejected (empty prompt, longer than the context, a biased
  // token outside the vocabulary; penalties, biases or log-probabilities on an engine that
  // samples on the GPU).
  SequenceId add(std::vector<Token> prompt, const GenerateParams& params, TextSink on_text);
  // Ends a request at once (its blocks freed); it comes out of take_finished() as "cancelled".
  void cancel(SequenceId id);
  bool idle() const;
  // One scheduler step; nothing when idle.
  void step();
  // Requests that ended since the last call, with their text and statistics.
  std::vector<std::pair<SequenceId, GenerateResult>> take_finished();

  EngineStats stats() const;
  const Model& model() const { return *model_; }
  std::int64_t context() const { return context_; }
  // The KV pool: tokens it holds (whole blocks) and its bytes, a draft model's pool included.
  std::int64_t pool_tokens() const;
  std::int64_t pool_bytes() const { return pool_tokens() * kv_bytes_per_token_; }
  // The memory available at start where the pool was set larger than it (on the CPU), else 0.
  std::int64_t pool_past_memory() const { return pool_past_memory_; }
  int threads() const;
  // Where the forward passes run, for the log (and why not on a GPU, when auto fell back).
  std::string device() const;
  // Whether tokens are sampled on the device (a GPU's): requests with what only the CPU's
  // sampler applies (cpu_sampling_field) are then refused.
  bool samples_on_device() const;

 private:
  // A request in the scheduler.
  struct Active {
    TextSink on_text;
    Generation gen;
    SamplingParams sampling;
    GenerateResult result;
    std::string reason;  // set when the engine ended it (end of turn, stop string, cancel)
    std::chrono::steady_clock::time_point start;
    std::optional<std::chrono::steady_clock::time_point> first;
    DraftLength length;  // model proposers; n-gram drafts follow curves_
  };
  // Least squares over recent steps: forward time ~ fixed + per_token * tokens.
  struct ForwardCost {
    double w = 0, x = 0, y = 0, xx = 0, xy = 0;
    void add(double tokens, double ms);
    bool fitted(double& fixed, double& per_token) const;
  };

  void finish(const Finished& f);
  // Hands the text and log-probabilities that became final to the request; true when it is over.
  bool emit(Active& a, const std::string& text, bool done);
  void draft(StepPlan& plan, std::vector<Draft>& drafts);
  // A proposer without a model, asked while the step is planned: its draft for `id`, cut by
  // the acceptance of drafts of the same evidence, kept for draft(); returns its length.
  int draft_while_planning(SequenceId id, double cost);
  AcceptanceCurve& curve(int evidence);
  double draft_cost(std::int64_t decoding) const;
  // One line of the step log (LocalBackendOptions::step_log) for a step that began at `start`.
  void log_step(const StepPlan& plan, std::chrono::steady_clock::time_point start, double forward_ms, double ms);

  std::shared_ptr<const Model> model_;
  std::int64_t context_ = 0;
  std::int64_t kv_bytes_per_token_ = 0;  // K and V, F16, every layer the pool holds
  std::int64_t pool_past_memory_ = 0;
  SpeculativeOptions speculative_;
  std::unique_ptr<kernels::ThreadPool> threads_;
  std::unique_ptr<BlockPool> blocks_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<Executor> executor_;
  std::string no_gpu_;  // why auto did not pick a GPU
  std::unique_ptr<Proposer> proposer_;
  std::unordered_map<SequenceId, Active> active_;
  std::vector<std::pair<SequenceId, GenerateResult>> finished_;
  std::vector<float> logits_;
  std::int64_t sampled_ = 0;
  double draft_ms_ = 0, step_ms_ = 0;
  std::int64_t decode_passes_ = 0;
  ForwardCost forward_cost_;
  struct CloseFile {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, CloseFile> step_log_;
  std::chrono::steady_clock::time_point created_;
  double draft_ms_per_token_ = 0;  // moving average, model proposers
  std::unordered_map<SequenceId, Draft> planned_drafts_;  // draft_while_planning's, this step
  std::vector<AcceptanceCurve> curves_;  // by evidence, proposers without a model
  std::int64_t decoding_ = 0;      // decoding sequences in the last step
};

}  // namespace batchlm::local_engine
