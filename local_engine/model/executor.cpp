// The CPU executor (Model::forward_batch over a KvStore in host memory) and the choice of
// device.

#include "batchlm/local_engine/executor.hpp"

#include <stdexcept>
#include <string>
#include <vector>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/batch_engine.hpp"
#include "executor_cuda.hpp"

namespace batchlm::local_engine {

std::string_view to_string(Device d) {
  switch (d) {
    case Device::kAuto: return "auto";
    case Device::kCpu: return "cpu";
    case Device::kCuda: return "cuda";
  }
  return "?";
}

std::optional<Device> parse_device(std::string_view s) {
  if (s == "auto") return Device::kAuto;
  if (s == "cpu") return Device::kCpu;
  if (s == "cuda") return Device::kCuda;
  return std::nullopt;
}

void Executor::forward_sample(const Batch&, std::span<const RowSampling>, std::span<Token>) {
  throw std::logic_error("this executor does not sample on the device");
}

namespace {

class CpuExecutor final : public Executor {
 public:
  CpuExecutor(std::shared_ptr<const Model> model, const ExecutorOptions& options)
      : model_(std::move(model)),
        layers_(options.layers > 0 ? std::min(options.layers, model_->config().n_layers)
                                   : model_->config().n_layers) {
    if (options.thread_pool != nullptr) {
      threads_ = options.thread_pool;
    } else {
      own_threads_ = std::make_unique<kernels::ThreadPool>(options.threads);
      threads_ = own_threads_.get();
    }
  }

  std::string describe() const override {
    return std::string("cpu (") + kernels::cpu_simd_name() + ", " +
           std::to_string(threads_->size()) + " threads)";
  }
  Device device() const override { return Device::kCpu; }
  std::int64_t pool_memory_available() const override { return available_memory_bytes(); }

  void allocate_pool(std::int64_t block_size, std::int64_t n_blocks) override {
    if (store_) throw std::logic_error("allocate_pool: the pool exists already");
    store_ = std::make_unique<KvStore>(model_->config(), block_size, n_blocks, layers_);
  }
  std::int64_t n_blocks() const override { return store_ ? store_->pool().n_blocks : 0; }
  void commit_pool() override {
    if (!store_) throw std::logic_error("commit_pool: allocate_pool first");
    store_->commit(*threads_);
  }

  void copy_blocks(std::span<const BlockCopy> copies) override {
    if (!store_) throw std::logic_error("copy_blocks: allocate_pool first");
    for (const BlockCopy& c : copies) store_->copy_block(c.from, c.to);
  }

  void forward(const Batch& batch, std::span<float> logits) override {
    if (!store_) throw std::logic_error("forward: allocate_pool first");
    Batch b = batch;
    b.layers = layers_;
    model_->forward_batch(b, store_->pool(), logits, *threads_);
  }

  kernels::ThreadPool& threads() override { return *threads_; }

 private:
  std::shared_ptr<const Model> model_;
  std::int64_t layers_;
  std::unique_ptr<kernels::ThreadPool> own_threads_;
  kernels::ThreadPool* threads_ = nullptr;
  std::unique_ptr<KvStore> store_;
};

}  // namespace

bool built_with_cuda() {
#ifdef BATCHLM_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

bool gpu_runs_network(const ModelConfig& c, std::string& why_not) {
  // Gemma's steps (GELU, the scaled embeddings and queries, post-norms, sliding windows, soft
  // caps) and linear rotary scaling are the CPU pass's only.
  if (c.gelu) {
    why_not = "the GPU forward pass does not run the '" + c.architecture + "' architecture (GELU MLPs, "
              "post-norms, sliding-window attention): it runs on the CPU";
    return false;
  }
  if (c.rope_freq_scale != 1.0f) {
    why_not = "the GPU forward pass does not run linearly scaled rotary positions (rope.scaling.factor)";
    return false;
  }
  // The GPU attention and the per-head steps before it hold a head in at most 256 floats, in
  // groups of 8.
  if (c.head_dim >= 8 && c.head_dim <= 256 && c.head_dim % 8 == 0) return true;
  why_not = "the GPU forward pass does not run this '" + c.architecture + "' model's heads of " +
            std::to_string(c.head_dim) + " (it takes multiples of 8 up to 256)";
  return false;
}

std::optional<std::string> gpu_refusal(const Model& model, Device device) {
  if (device == Device::kCpu) return std::nullopt;
  std::string why_not;
#ifdef BATCHLM_HAVE_CUDA
  if (gpu_runs_network(model.config(), why_not) && cuda_takes_model(model, why_not) && cuda_device_usable(why_not))
    return std::nullopt;
#else
  if (gpu_runs_network(model.config(), why_not))
    why_not = "this build has no CUDA support (nvcc was not found when it was built)";
#endif
  return why_not;
}

std::unique_ptr<Executor> make_executor(std::shared_ptr<const Model> model,
                                        const ExecutorOptions& options, std::string* why) {
  if (options.layers < 0) throw std::invalid_argument("executor: layers must be >= 0");
  if (model->check_only()) throw std::logic_error("make_executor: the model was loaded to be checked only");
  if (why != nullptr) why->clear();
  if (options.device != Device::kCpu) {
    std::optional<std::string> why_not = gpu_refusal(*model, options.device);
#ifdef BATCHLM_HAVE_CUDA
    if (!why_not) {
      // What the upload finds wrong (a value past F16's range, memory the card lacks) leaves
      // `auto` on the CPU, with the reason.
      try {
        return make_cuda_executor(model, options);
      } catch (const std::exception& e) {
        why_not = std::string("the GPU could not take the model: ") + e.what();
      }
    }
#endif
    if (options.device == Device::kCuda)
      throw DeviceUnavailable("device 'cuda' was asked for, but " + *why_not);
    if (why != nullptr) *why = *why_not;
  }
  return std::make_unique<CpuExecutor>(std::move(model), options);
}

}  // namespace batchlm::local_engine
