#pragma once
// Where forward passes run: a model's weights and a paged KV pool on one device. The scheduler's
// block ids index the executor's pool, wherever it lives.
//
// - CPU: Model::forward_batch over a KvStore in host memory (the reference).
// - CUDA (when built with it and a GPU is present): weights uploaded once, the pool in device
//   memory, per-step metadata in one copy, decode steps replayed from CUDA graphs, sampling on
//   the device so that only token ids come back.
//
//   auto ex = make_executor(model, {.device = Device::kAuto});
//   ex->allocate_pool(16, n_blocks);
//   ex->forward(batch, logits);

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

#include "batchlm/kernels/thread_pool.hpp"
#include "batchlm/local_engine/kv_cache.hpp"
#include "batchlm/local_engine/model.hpp"
#include "batchlm/local_engine/sampling.hpp"

namespace batchlm::local_engine {

enum class Device { kAuto, kCpu, kCuda };
std::string_view to_string(Device d);
// "auto", "cpu" or "cuda"; nullopt otherwise.
std::optional<Device> parse_device(std::string_view s);

struct ExecutorOptions {
  Device device = Device::kAuto;  // kCuda without a usable GPU is an error; kAuto falls back
  int threads = 0;                // CPU compute threads when `thread_pool` is null; 0: all
  kernels::ThreadPool* thread_pool = nullptr;  // borrowed (outlives the executor), or null
  std::int64_t layers = 0;        // run only the first `layers` layers (early exit); 0: all
  std::int64_t context = 4096;    // the longest sequence (bounds block tables on the device)
  bool graphs = true;             // CUDA: replay decode steps from captured graphs
};

// How one logits row is sampled on the device; `counter` is the request's tokens so far, which
// with the seed keys the draw (so it does not depend on the rest of the batch).
struct RowSampling {
  SamplingParams params;
  std::uint64_t counter = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;

  // One line for the log: the device and what it runs with.
  virtual std::string describe() const = 0;
  virtual Device device() const = 0;
  // Bytes the KV pool may take by default: on the CPU the memory available now, on a GPU what
  // is free after the weights and the executor's own buffers.
  virtual std::int64_t pool_memory_available() const = 0;
  // The pool: n_blocks blocks of block_size positions for the layers this executor runs. Once,
  // before the first forward.
  virtual void allocate_pool(std::int64_t block_size, std::int64_t n_blocks) = 0;
  virtual std::int64_t n_blocks() const = 0;
  // Writes every page of the pool once, after allocate_pool, so that no forward pass waits for
  // the system to map and zero fresh memory (on this machine 1-3 s per GB, paid the first time
  // each block is used). Device memory is committed when it is allocated: a no-op there.
  virtual void commit_pool() {}

  // Each copy's `from` block over its `to` block, keys and values of every layer, before the
  // next forward pass (which sees the copied rows). Throws std::out_of_range for a block
  // outside the pool.
  virtual void copy_blocks(std::span<const BlockCopy> copies) = 0;

  // Model::forward_batch's contract: the logits of batch.logits_rows into `logits`. The batch's
  // layers field is ignored (the executor's own count applies). Throws std::invalid_argument
  // for an inconsistent batch.
  virtual void forward(const Batch& batch, std::span<float> logits) = 0;

  // Whether forward_sample() exists: sampling on the device, so that only token ids come back.
  // The CPU executor has none (the engine samples from logits on the host).
  virtual bool samples_on_device() const { return false; }
  // The forward pass, then row i of batch.logits_rows sampled with sampling[i] into tokens[i]:
  // -1 where that row holds a NaN or an infinity (the engine fails its request).
  // Throws std::logic_error where samples_on_device() is false.
  virtual void forward_sample(const Batch& batch, std::span<const RowSampling> sampling,
                              std::span<Token> tokens);

  // The host threads (the CPU executor computes on them; others lend them to host-side work).
  virtual kernels::ThreadPool& threads() = 0;
};

// kCuda was asked for and cannot be had; the message says why.
struct DeviceUnavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The executor for `options.device`: kAuto picks CUDA when this build has it and a usable GPU
// is present, the CPU otherwise; `why` (when not null) receives the reason no GPU is used, or
// is cleared. Throws DeviceUnavailable, std::invalid_argument for bad options.
std::unique_ptr<Executor> make_executor(std::shared_ptr<const Model> model,
                                        const ExecutorOptions& options,
                                        std::string* why = nullptr);

// Whether this build contains the CUDA executor.
bool built_with_cuda();

// Why `device` cannot run `model` on a GPU (kCuda: make_executor would throw this reason; kAuto:
// the model would run on the CPU), or nullopt where it can; always nullopt for kCpu. Asks the
// network, the matrix types and the GPU, without uploading anything.
std::optional<std::string> gpu_refusal(const Model& model, Device device);

// Whether the GPU forward pass runs this network (every architecture the loader takes, with
// heads of a multiple of 8 up to 256 values). Where it does not, why_not names what it lacks.
// Decided in every build (the executor kAuto picks asks it before looking for a GPU); the
// matrix types are asked of the CUDA kernels separately.
bool gpu_runs_network(const ModelConfig& config, std::string& why_not);

}  // namespace batchlm::local_engine
