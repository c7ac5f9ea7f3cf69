// The CUDA executor: the forward pass of model/llama.cpp on the GPU (the llama, qwen2, qwen3 and
// phi3 architectures: biases, per-head norms, wide heads, rotary pairs in halves, rotary factors
// and magnitude), written against kernels/cuda.hpp.
//
// Memory, all allocated when the executor is made (nothing is allocated per step):
// - the weights, uploaded once into one arena (tied embeddings shared);
// - activations for Model::kMaxBatch tokens, the logits of as many rows, and one scratch
//   buffer shared by the matrix products, attention and sampling (they run one after another
//   on one stream);
// - the step's metadata: a pinned host buffer and its device twin, filled on the host and sent
//   in one copy (sampling parameters, token ids, positions, sequence of each token, logits
//   rows, per-sequence query ranges and first positions, then the block tables, last, so that
//   only the rows in use travel);
// - the KV pool (allocate_pool): keys and values of every layer this executor runs, F16.
//
// Decode steps (one token per sequence, every token's logits) are replayed from CUDA graphs,
// one per batch-size bucket (powers of two), captured on first use with the batch padded to
// the bucket: padding tokens have sequence -1 (nothing stored, zero attention) and their rows
// are not read back. The graphs' kernels take sizes from the metadata, and the grid bounds are
// fixed (the bucket, one query per sequence, the executor's context), so a replay serves any
// batch of the bucket's size or less.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "batchlm/kernels/cuda.hpp"
#include "batchlm/kernels/dtype.hpp"
#include "executor_cuda.hpp"

namespace batchlm::local_engine {

namespace kc = batchlm::kernels::cuda;
using kernels::DType;

namespace {

constexpr std::size_t kAlign = 256;

std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A cudaMalloc'd buffer, freed with its owner.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(std::size_t bytes, const char* what) : bytes_(bytes) {
    kc::check(cudaMalloc(&p_, std::max<std::size_t>(bytes, 1)), what);
  }
  ~DeviceMemory() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceMemory(DeviceMemory&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(o.bytes_) {}
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  template <typename T = void>
  T* get() const { return static_cast<T*>(p_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

// cudaMallocHost'd memory, for the one metadata copy per step.
class PinnedMemory {
 public:
  explicit PinnedMemory(std::size_t bytes) {
    kc::check(cudaMallocHost(&p_, std::max<std::size_t>(bytes, 1)), "cudaMallocHost (step metadata)");
  }
  ~PinnedMemory() { cudaFreeHost(p_); }
  PinnedMemory(const PinnedMemory&) = delete;
  PinnedMemory& operator=(const PinnedMemory&) = delete;
  std::byte* get() const { return static_cast<std::byte*>(p_); }

 private:
  void* p_ = nullptr;
};

// Matrices that can be stacked into one: the same type and width (a product over their rows
// then gives, per token, the rows of each one after the other).
bool stackable(std::initializer_list<const kernels::Matrix*> parts) {
  const kernels::Matrix& first = **parts.begin();
  return std::all_of(parts.begin(), parts.end(), [&](const kernels::Matrix* m) {
    return m->type == first.type && m->cols == first.cols && m->data != nullptr;
  });
}
kernels::Matrix stacked_shape(std::initializer_list<const kernels::Matrix*> parts) {
  kernels::Matrix whole{(*parts.begin())->type, nullptr, 0, (*parts.begin())->cols, nullptr};
  for (const kernels::Matrix* m : parts) whole.rows += m->rows;
  return whole;
}

// Q, K and V of one type and width are one matrix on the device, their rows stacked (qkv:
// one product for the three), and so are gate and up (gate_up); such a stacked matrix has
// rows > 0, and then q, k, v (gate, up) are unused.
struct DeviceLayer {
  kc::DeviceMatrix q, k, v, out, gate, up, down;
  kc::DeviceMatrix qkv, gate_up;
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  kc::QkvExtras extras;  // biases and per-head norms, where the architecture has them
};

// Where each array of the step metadata sits, in bytes from the start of the buffer.
struct MetadataLayout {
  std::size_t sample = 0, tokens = 0, positions = 0, sequence_of = 0, logits_rows = 0,
              query_start = 0, first_position = 0, tables = 0;
  std::size_t size_for(std::int64_t sequences, std::int64_t max_blocks) const {
    return tables + static_cast<std::size_t>(sequences * max_blocks) * sizeof(std::int32_t);
  }

  // The layout for steps of up to tokens_cap tokens; `total` receives its size in bytes.
  static MetadataLayout make(std::int64_t tokens_cap, std::int64_t max_blocks, std::size_t& total) {
    MetadataLayout m;
    std::size_t at = 0;
    auto take = [&](std::size_t bytes) {
      const std::size_t here = at;
      at = align_up(at + bytes);
      return here;
    };
    const auto t = static_cast<std::size_t>(tokens_cap);
    m.sample = take(t * sizeof(kc::SampleParams));
    m.tokens = take(t * sizeof(std::int32_t));
    m.positions = take(t * sizeof(std::int32_t));
    m.sequence_of = take(t * sizeof(std::int32_t));
    m.logits_rows = take(t * sizeof(std::int32_t));
    m.query_start = take((t + 1) * sizeof(std::int32_t));
    m.first_position = take(t * sizeof(std::int32_t));
    m.tables = take(t * static_cast<std::size_t>(max_blocks) * sizeof(std::int32_t));
    total = at;
    return m;
  }
};

// The shape of one step, as the kernels are launched for it.
struct StepShape {
  std::int64_t tokens = 0;     // rows through the matrix products (padded in graphs)
  std::int64_t sequences = 0;  // groups in the attention grid (padded in graphs)
  std::int64_t outputs = 0;    // logits rows
  std::int32_t max_queries = 0;
  std::int32_t max_context = 0;
  bool sample = false;
  bool gather = false;  // outputs < tokens: gather the wanted rows before the last layer's tail
};

class CudaExecutor final : public Executor {
 public:
  CudaExecutor(std::shared_ptr<const Model> model, const ExecutorOptions& options, kc::DeviceInfo info)
      : model_(std::move(model)), info_(std::move(info)), options_(options) {
    const ModelConfig& c = model_->config();
    layers_ = options.layers > 0 ? std::min(options.layers, c.n_layers) : c.n_layers;
    if (options.context < 1) throw std::invalid_argument("executor: context must be >= 1");
    if (options.thread_pool != nullptr) {
      threads_ = options.thread_pool;
    } else {
      own_threads_ = std::make_unique<kernels::ThreadPool>(options.threads);
      threads_ = own_threads_.get();
    }
    kc::check(cudaSetDevice(info_.ordinal), "cudaSetDevice");
    kc::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    upload_weights();
    allocate_activations();
  }

  ~CudaExecutor() override {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string describe() const override {
    char memory[64];
    std::snprintf(memory, sizeof memory, "%.1f GiB", static_cast<double>(info_.memory_total) / (1 << 30));
    return "cuda: " + info_.name + " (compute " + std::to_string(info_.sm_major) + "." +
           std::to_string(info_.sm_minor) + ", " + memory + ", weights " +
           std::to_string(weight_bytes_ >> 20) + " MiB" + (options_.graphs ? ", CUDA graphs" : "") + ")";
  }
  Device device() const override { return Device::kCuda; }

  std::int64_t pool_memory_available() const override {
    std::size_t free = 0, total = 0;
    kc::check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    // Leave room for the graphs, the runtime and other users of the card.
    const std::size_t reserve = std::max<std::size_t>(total / 20, std::size_t{512} << 20);
    return free > reserve ? static_cast<std::int64_t>(free - reserve) : 0;
  }

  void allocate_pool(std::int64_t block_size, std::int64_t n_blocks) override {
    if (pool_k_.get() != nullptr) throw std::logic_error("allocate_pool: the pool exists already");
    if (block_size < 1 || n_blocks < 1) throw std::invalid_argument("allocate_pool: empty pool");
    const ModelConfig& c = model_->config();
    block_size_ = block_size;
    n_blocks_ = n_blocks;
    layer_stride_ = n_blocks * block_size * c.kv_width();
    const auto bytes = static_cast<std::size_t>(layers_ * layer_stride_) * sizeof(std::uint16_t);
    pool_k_ = DeviceMemory(bytes, "cudaMalloc (KV pool, keys)");
    pool_v_ = DeviceMemory(bytes, "cudaMalloc (KV pool, values)");
    max_blocks_ = (options_.context + kMaxDraftSlack + block_size - 1) / block_size;
    std::size_t total = 0;
    layout_ = MetadataLayout::make(Model::kMaxBatch, max_blocks_, total);
    meta_host_ = std::make_unique<PinnedMemory>(total);
    meta_device_ = DeviceMemory(total, "cudaMalloc (step metadata)");
    scratch_ = DeviceMemory(scratch_bytes(), "cudaMalloc (scratch)");
  }
  std::int64_t n_blocks() const override { return n_blocks_; }

  void copy_blocks(std::span<const BlockCopy> copies) override {
    if (pool_k_.get() == nullptr) throw std::logic_error("copy_blocks: allocate_pool first");
    // One strided copy per block and store: a block's run in each layer, layer_stride apart.
    const std::size_t block_bytes = static_cast<std::size_t>(block_size_ * model_->config().kv_width()) * sizeof(std::uint16_t);
    const std::size_t pitch = static_cast<std::size_t>(layer_stride_) * sizeof(std::uint16_t);
    for (const BlockCopy& c : copies) {
      if (c.from < 0 || c.from >= n_blocks_ || c.to < 0 || c.to >= n_blocks_)
        throw std::out_of_range("copy_blocks: block " + std::to_string(c.from) + " to " + std::to_string(c.to) +
                                " outside the pool of " + std::to_string(n_blocks_));
      if (c.from == c.to) continue;
      for (auto* bytes : {pool_k_.get<std::uint8_t>(), pool_v_.get<std::uint8_t>()}) {
        kc::check(cudaMemcpy2DAsync(bytes + static_cast<std::size_t>(c.to) * block_bytes, pitch,
                                    bytes + static_cast<std::size_t>(c.from) * block_bytes, pitch, block_bytes,
                                    static_cast<std::size_t>(layers_), cudaMemcpyDeviceToDevice, stream_),
                  "copy KV blocks");
      }
    }
  }

  void forward(const Batch& batch, std::span<float> logits) override {
    const auto n_out = static_cast<std::int64_t>(batch.logits_rows.size());
    if (!run(batch, logits.size(), nullptr)) return;
    kc::check(cudaMemcpyAsync(logits.data(), logits_dev_.get(),
                              static_cast<std::size_t>(n_out * model_->config().n_vocab) * sizeof(float),
                              cudaMemcpyDeviceToHost, stream_),
              "copy logits to the host");
    kc::check(cudaStreamSynchronize(stream_), "forward");
  }

  bool samples_on_device() const override { return true; }

  void forward_sample(const Batch& batch, std::span<const RowSampling> sampling,
                      std::span<Token> tokens) override {
    const auto n_out = batch.logits_rows.size();
    if (sampling.size() != n_out || tokens.size() < n_out)
      throw std::invalid_argument("forward_sample: one sampling entry and one token per logits row");
    const std::size_t logits_size = n_out * static_cast<std::size_t>(model_->config().n_vocab);
    if (!run(batch, logits_size, &sampling)) return;
    kc::check(cudaMemcpyAsync(tokens.data(), tokens_dev_.get(), n_out * sizeof(std::int32_t),
                              cudaMemcpyDeviceToHost, stream_),
              "copy sampled tokens to the host");
    kc::check(cudaStreamSynchronize(stream_), "forward");
  }

  kernels::ThreadPool& threads() override { return *threads_; }

 private:
  // Positions a sequence may reach past its context: a decode token's drafts are scored at
  // positions beyond the last one kept.
  static constexpr std::int64_t kMaxDraftSlack = 64;

  void upload_weights() {
    const ModelConfig& c = model_->config();
    std::vector<const kernels::Matrix*> matrices;
    std::vector<std::pair<const float*, std::int64_t>> vectors;
    matrices.push_back(&model_->token_embedding());
    const bool tied = model_->output().data == model_->token_embedding().data;
    if (!tied) matrices.push_back(&model_->output());
    vectors.emplace_back(model_->output_norm(), c.n_embd);
    std::vector<kernels::Matrix> stacked_shapes;
    // Per layer: whether Q/K/V, and gate/up, go up stacked (decided here, used below).
    std::vector<std::array<bool, 2>> stack(static_cast<std::size_t>(layers_));
    for (std::int64_t li = 0; li < layers_; ++li) {
      const LayerWeights& l = model_->layers()[li];
      auto& [qkv, gate_up] = stack[static_cast<std::size_t>(li)];
      qkv = stackable({&l.attn_q, &l.attn_k, &l.attn_v});
      gate_up = stackable({&l.ffn_gate, &l.ffn_up});
      if (qkv)
        stacked_shapes.push_back(stacked_shape({&l.attn_q, &l.attn_k, &l.attn_v}));
      else
        matrices.insert(matrices.end(), {&l.attn_q, &l.attn_k, &l.attn_v});
      if (gate_up)
        stacked_shapes.push_back(stacked_shape({&l.ffn_gate, &l.ffn_up}));
      else
        matrices.insert(matrices.end(), {&l.ffn_gate, &l.ffn_up});
      matrices.insert(matrices.end(), {&l.attn_out, &l.ffn_down});
      vectors.emplace_back(l.attn_norm, c.n_embd);
      vectors.emplace_back(l.ffn_norm, c.n_embd);
      for (const auto& [p, n] : {std::pair{l.attn_q_bias, c.q_width()}, std::pair{l.attn_k_bias, c.kv_width()},
                                 std::pair{l.attn_v_bias, c.kv_width()}, std::pair{l.attn_q_norm, c.head_dim},
                                 std::pair{l.attn_k_norm, c.head_dim}})
        if (p != nullptr) vectors.emplace_back(p, n);
    }
    if (model_->rope_freqs() != nullptr) vectors.emplace_back(model_->rope_freqs(), c.rope_dim / 2);
    std::size_t total = 0;
    for (const kernels::Matrix* m : matrices) total += align_up(kc::device_bytes(*m));
    for (const kernels::Matrix& m : stacked_shapes) total += align_up(kc::device_bytes(m));
    for (const auto& [p, n] : vectors) total += align_up(static_cast<std::size_t>(n) * sizeof(float));
    weights_ = DeviceMemory(total, "cudaMalloc (weights)");
    weight_bytes_ = total;

    auto* base = weights_.get<std::byte>();
    std::size_t at = 0;
    std::map<const void*, kc::DeviceMatrix> uploaded;
    auto put = [&](const kernels::Matrix& m) {
      const kc::DeviceMatrix d = kc::upload(m, base + at);
      at += align_up(kc::device_bytes(m));
      return d;
    };
    auto matrix = [&](const kernels::Matrix& m) {
      if (auto it = uploaded.find(m.data); it != uploaded.end()) return it->second;
      const kc::DeviceMatrix d = put(m);
      uploaded.emplace(m.data, d);
      return d;
    };
    // The rows of `parts` (stackable) copied one after the other on the host, then uploaded.
    auto stacked = [&](std::initializer_list<const kernels::Matrix*> parts) {
      kernels::Matrix whole = stacked_shape(parts);
      std::vector<unsigned char> rows;
      rows.reserve(kernels::row_bytes(whole.type, whole.cols) * static_cast<std::size_t>(whole.rows));
      for (const kernels::Matrix* m : parts) {
        const auto* p = static_cast<const unsigned char*>(m->data);
        rows.insert(rows.end(), p, p + kernels::row_bytes(m->type, m->cols) * static_cast<std::size_t>(m->rows));
      }
      whole.data = rows.data();
      return put(whole);
    };
    auto vector = [&](const float* host, std::int64_t n) {
      auto* dst = reinterpret_cast<float*>(base + at);
      kc::check(cudaMemcpy(dst, host, static_cast<std::size_t>(n) * sizeof(float), cudaMemcpyHostToDevice),
                "upload a norm weight");
      at += align_up(static_cast<std::size_t>(n) * sizeof(float));
      return static_cast<const float*>(dst);
    };
    token_embd_ = matrix(model_->token_embedding());
    output_ = matrix(model_->output());
    output_norm_ = vector(model_->output_norm(), c.n_embd);
    if (model_->rope_freqs() != nullptr) rope_freqs_ = vector(model_->rope_freqs(), c.rope_dim / 2);
    auto optional = [&](const float* host, std::int64_t n) { return host != nullptr ? vector(host, n) : nullptr; };
    for (std::int64_t li = 0; li < layers_; ++li) {
      const LayerWeights& l = model_->layers()[li];
      DeviceLayer d;
      const auto [qkv, gate_up] = stack[static_cast<std::size_t>(li)];
      if (qkv) {
        d.qkv = stacked({&l.attn_q, &l.attn_k, &l.attn_v});
      } else {
        d.q = matrix(l.attn_q);
        d.k = matrix(l.attn_k);
        d.v = matrix(l.attn_v);
      }
      d.out = matrix(l.attn_out);
      if (gate_up) {
        d.gate_up = stacked({&l.ffn_gate, &l.ffn_up});
      } else {
        d.gate = matrix(l.ffn_gate);
        d.up = matrix(l.ffn_up);
      }
      d.down = matrix(l.ffn_down);
      d.attn_norm = vector(l.attn_norm, c.n_embd);
      d.ffn_norm = vector(l.ffn_norm, c.n_embd);
      d.extras.q_bias = optional(l.attn_q_bias, c.q_width());
      d.extras.k_bias = optional(l.attn_k_bias, c.kv_width());
      d.extras.v_bias = optional(l.attn_v_bias, c.kv_width());
      d.extras.q_norm = optional(l.attn_q_norm, c.head_dim);
      d.extras.k_norm = optional(l.attn_k_norm, c.head_dim);
      d.extras.eps = c.rms_eps;
      layers_dev_.push_back(d);
    }
  }

  void allocate_activations() {
    const ModelConfig& c = model_->config();
    const auto T = static_cast<std::size_t>(Model::kMaxBatch);
    const auto E = static_cast<std::size_t>(c.n_embd), KV = static_cast<std::size_t>(c.kv_width()),
               F = static_cast<std::size_t>(c.n_ff), V = static_cast<std::size_t>(c.n_vocab),
               QW = static_cast<std::size_t>(c.q_width());
    auto floats = [&](std::size_t n, const char* what) { return DeviceMemory(n * sizeof(float), what); };
    x_ = floats(T * E, "cudaMalloc (activations)");
    x2_ = floats(T * E, "cudaMalloc (activations)");
    xn_ = floats(T * E, "cudaMalloc (activations)");
    q_ = floats(T * QW, "cudaMalloc (activations)");
    att_ = floats(T * QW, "cudaMalloc (activations)");
    att2_ = floats(T * QW, "cudaMalloc (activations)");
    tmp_ = floats(T * E, "cudaMalloc (activations)");
    gate_ = floats(T * F, "cudaMalloc (activations)");
    // The stacked products write their rows side by side; the separate ones write K, V and up
    // into rows of their own. Only the buffers some layer uses are allocated (models mix types
    // rarely, so most need one set or the other).
    auto any = [&](bool stacked, auto member) {
      return std::any_of(layers_dev_.begin(), layers_dev_.end(),
                         [&](const DeviceLayer& l) { return ((l.*member).rows > 0) == stacked; });
    };
    if (any(true, &DeviceLayer::qkv)) qkv_ = floats(T * (QW + 2 * KV), "cudaMalloc (activations)");
    if (any(false, &DeviceLayer::qkv)) {
      k_ = floats(T * KV, "cudaMalloc (activations)");
      v_ = floats(T * KV, "cudaMalloc (activations)");
    }
    if (any(true, &DeviceLayer::gate_up)) gate_up_ = floats(T * 2 * F, "cudaMalloc (activations)");
    if (any(false, &DeviceLayer::gate_up)) up_ = floats(T * F, "cudaMalloc (activations)");
    logits_dev_ = floats(T * V, "cudaMalloc (logits)");
    tokens_dev_ = DeviceMemory(T * sizeof(std::int32_t), "cudaMalloc (sampled tokens)");
  }

  kc::AttentionBatch attention_batch(const StepShape& s, std::int64_t layer) const {
    const ModelConfig& c = model_->config();
    kc::AttentionBatch a;
    a.shape = kernels::AttentionShape{c.n_heads, c.n_kv_heads, c.head_dim, c.kv_width(),
                                      1.0f / std::sqrt(static_cast<float>(c.head_dim))};
    a.k_pool = pool_k_.get<std::uint16_t>() + layer * layer_stride_;
    a.v_pool = pool_v_.get<std::uint16_t>() + layer * layer_stride_;
    a.block_size = block_size_;
    a.block_tables = meta<std::int32_t>(layout_.tables);
    a.max_blocks = static_cast<std::int32_t>(max_blocks_);
    a.n_seqs = static_cast<std::int32_t>(s.sequences);
    a.query_start = meta<std::int32_t>(layout_.query_start);
    a.first_position = meta<std::int32_t>(layout_.first_position);
    a.max_queries = s.max_queries;
    a.max_context = s.max_context;
    return a;
  }

  std::size_t scratch_bytes() const {
    const ModelConfig& c = model_->config();
    const std::int64_t T = Model::kMaxBatch;
    std::size_t bytes = kc::matmul_scratch_bytes(output_, T);
    for (const DeviceLayer& l : layers_dev_)
      for (const kc::DeviceMatrix* m : {&l.q, &l.k, &l.v, &l.out, &l.gate, &l.up, &l.down, &l.qkv, &l.gate_up})
        if (m->rows > 0) bytes = std::max(bytes, kc::matmul_scratch_bytes(*m, T));
    // Attention at its largest grid: every token its own sequence at the longest context, and
    // one sequence of every token.
    StepShape widest{T, T, T, 1, static_cast<std::int32_t>(max_context()), false, false};
    bytes = std::max(bytes, kc::attention_scratch_bytes(attention_batch(widest, 0), T));
    StepShape longest{T, 1, T, static_cast<std::int32_t>(T), static_cast<std::int32_t>(max_context()),
                      false, false};
    bytes = std::max(bytes, kc::attention_scratch_bytes(attention_batch(longest, 0), T));
    bytes = std::max(bytes, kc::sample_scratch_bytes(T, c.n_vocab));
    return bytes;
  }

  std::int64_t max_context() const { return max_blocks_ * block_size_; }

  template <typename T>
  T* meta(std::size_t offset) const {
    return reinterpret_cast<T*>(meta_device_.get<std::byte>() + offset);
  }
  template <typename T>
  T* host_meta(std::size_t offset) const {
    return reinterpret_cast<T*>(meta_host_->get() + offset);
  }

  // Checks the batch, writes its metadata (padded to `shape` when replaying a graph), sends
  // it, and launches the step. False when there is nothing to run.
  bool run(const Batch& batch, std::size_t logits_size, const std::span<const RowSampling>* sampling) {
    if (pool_k_.get() == nullptr) throw std::logic_error("forward: allocate_pool first");
    const auto n = static_cast<std::int64_t>(batch.tokens.size());
    if (n == 0) return false;
    Batch b = batch;
    b.layers = 0;
    model_->check_batch(b, block_size_, n_blocks_, logits_size);
    const auto n_out = static_cast<std::int64_t>(batch.logits_rows.size());

    // Group the tokens by sequence: each sequence's tokens must be one contiguous run at
    // consecutive positions (as the scheduler lays them out).
    std::vector<std::int32_t> group_of(static_cast<std::size_t>(n));
    std::vector<std::int32_t> starts, firsts, seqs;
    for (std::int64_t i = 0; i < n; ++i) {
      const bool same = i > 0 && batch.sequence_of[i] == batch.sequence_of[i - 1];
      if (same) {
        if (batch.positions[i] != batch.positions[i - 1] + 1)
          throw std::invalid_argument("forward: the tokens of a sequence must be at consecutive positions");
      } else {
        if (std::find(seqs.begin(), seqs.end(), batch.sequence_of[i]) != seqs.end())
          throw std::invalid_argument("forward: the tokens of a sequence must be contiguous");
        seqs.push_back(batch.sequence_of[i]);
        starts.push_back(static_cast<std::int32_t>(i));
        firsts.push_back(batch.positions[i]);
      }
      group_of[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(seqs.size() - 1);
    }
    const auto groups = static_cast<std::int64_t>(seqs.size());
    std::int32_t max_queries = 0, max_ctx = 0;
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::int32_t end = g + 1 < groups ? starts[g + 1] : static_cast<std::int32_t>(n);
      max_queries = std::max(max_queries, end - starts[g]);
      max_ctx = std::max(max_ctx, firsts[g] + (end - starts[g]));
    }
    if (max_ctx > max_context())
      throw std::invalid_argument("forward: position " + std::to_string(max_ctx - 1) +
                                  " is beyond the executor's context of " + std::to_string(max_context()));

    const bool decode = groups == n && n_out == n;
    const std::int64_t bucket = decode && options_.graphs ? graph_bucket(n) : 0;
    StepShape shape;
    shape.tokens = bucket > 0 ? bucket : n;
    shape.sequences = bucket > 0 ? bucket : groups;
    shape.outputs = bucket > 0 ? bucket : n_out;
    shape.max_queries = bucket > 0 ? 1 : max_queries;
    shape.max_context = bucket > 0 ? static_cast<std::int32_t>(max_context()) : max_ctx;
    shape.sample = sampling != nullptr;
    shape.gather = n_out < n;

    // The metadata, padded to the shape.
    auto* sp = host_meta<kc::SampleParams>(layout_.sample);
    auto* tok = host_meta<std::int32_t>(layout_.tokens);
    auto* pos = host_meta<std::int32_t>(layout_.positions);
    auto* seq = host_meta<std::int32_t>(layout_.sequence_of);
    auto* rows = host_meta<std::int32_t>(layout_.logits_rows);
    auto* qs = host_meta<std::int32_t>(layout_.query_start);
    auto* fp = host_meta<std::int32_t>(layout_.first_position);
    auto* tables = host_meta<std::int32_t>(layout_.tables);
    for (std::int64_t i = 0; i < shape.tokens; ++i) {
      const bool real = i < n;
      tok[i] = real ? batch.tokens[i] : 0;
      pos[i] = real ? batch.positions[i] : 0;
      seq[i] = real ? group_of[i] : -1;
    }
    for (std::int64_t i = 0; i < shape.outputs; ++i) {
      rows[i] = i < n_out ? batch.logits_rows[i] : static_cast<std::int32_t>(i);
      kc::SampleParams p;  // padding rows: greedy
      if (sampling != nullptr && i < n_out) {
        const RowSampling& r = (*sampling)[static_cast<std::size_t>(i)];
        p.temperature = r.params.temperature;
        p.top_p = r.params.top_p;
        p.top_k = r.params.top_k;
        p.seed = r.params.seed;
        p.counter = r.counter;
      }
      sp[i] = p;
    }
    for (std::int64_t g = 0; g <= shape.sequences; ++g)
      qs[g] = g < groups ? starts[g] : static_cast<std::int32_t>(n);
    for (std::int64_t g = 0; g < shape.sequences; ++g) fp[g] = g < groups ? firsts[g] : 0;
    for (std::int64_t g = 0; g < groups; ++g) {
      const auto& table = batch.block_tables[static_cast<std::size_t>(seqs[g])];
      std::int32_t* row = tables + g * max_blocks_;
      const auto used = std::min<std::int64_t>(static_cast<std::int64_t>(table.size()), max_blocks_);
      std::copy_n(table.begin(), used, row);
      std::fill(row + used, row + max_blocks_, 0);
    }
    const std::size_t bytes = layout_.size_for(groups, max_blocks_);
    kc::check(cudaMemcpyAsync(meta_device_.get(), meta_host_->get(), bytes, cudaMemcpyHostToDevice, stream_),
              "copy step metadata");

    if (bucket > 0) {
      const GraphKey key{bucket, shape.sample};
      auto it = graphs_.find(key);
      if (it == graphs_.end()) it = graphs_.emplace(key, capture(shape)).first;
      kc::check(cudaGraphLaunch(it->second, stream_), "cudaGraphLaunch");
    } else {
      launch(shape);
    }
    return true;
  }

  static std::int64_t graph_bucket(std::int64_t n) {
    std::int64_t b = 1;
    while (b < n) b *= 2;
    return b <= Model::kMaxBatch ? b : 0;
  }

  cudaGraphExec_t capture(const StepShape& shape) {
    cudaGraph_t graph = nullptr;
    kc::check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      launch(shape);
    } catch (...) {
      cudaStreamEndCapture(stream_, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      throw;
    }
    kc::check(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    kc::check(e, "cudaGraphInstantiate");
    return exec;
  }

  // The forward pass (and sampling) for a step whose metadata is on the device.
  void launch(const StepShape& s) {
    const ModelConfig& c = model_->config();
    const std::int64_t n = s.tokens, E = c.n_embd, KV = c.kv_width(), QW = c.q_width();
    void* scratch = scratch_.get();
    const auto* positions = meta<std::int32_t>(layout_.positions);
    const kc::PagedBatch paged{block_size_, meta<std::int32_t>(layout_.tables),
                               static_cast<std::int32_t>(max_blocks_),
                               meta<std::int32_t>(layout_.sequence_of), positions};
    float* x = x_.get<float>();
    float* xn = xn_.get<float>();
    float* q = q_.get<float>();
    float* k = k_.get<float>();
    float* v = v_.get<float>();
    float* att = att_.get<float>();
    float* tmp = tmp_.get<float>();
    float* gate = gate_.get<float>();
    float* up = up_.get<float>();
    float* qkv = qkv_.get<float>();
    float* gate_up = gate_up_.get<float>();

    kc::get_rows(token_embd_, meta<std::int32_t>(layout_.tokens), n, x, stream_);
    kc::rms_norm(x, layers_dev_[0].attn_norm, n, E, c.rms_eps, xn, stream_);
    std::int64_t rows = n;
    for (std::int64_t li = 0; li < layers_; ++li) {
      const DeviceLayer& l = layers_dev_[static_cast<std::size_t>(li)];
      float* rq = q;
      float* rk = k;
      float* rv = v;
      std::int64_t stride_q = QW, stride_kv = KV;
      if (l.qkv.rows > 0) {
        kc::matmul(l.qkv, xn, n, qkv, scratch, stream_);
        rq = qkv;
        rk = qkv + QW;
        rv = qkv + QW + KV;
        stride_q = stride_kv = QW + 2 * KV;
      } else {
        kc::matmul(l.q, xn, n, q, scratch, stream_);
        kc::matmul(l.k, xn, n, k, scratch, stream_);
        kc::matmul(l.v, xn, n, v, scratch, stream_);
      }
      kc::qkv_bias_norm(rq, rk, rv, stride_q, stride_kv, stride_kv, n, c.n_heads, c.n_kv_heads, c.head_dim, l.extras,
                        stream_);
      const kc::QkvRows in{rq, rk, rv, stride_q, stride_kv, stride_kv};
      std::uint16_t* kc_pool = pool_k_.get<std::uint16_t>() + li * layer_stride_;
      std::uint16_t* vc_pool = pool_v_.get<std::uint16_t>() + li * layer_stride_;
      kc::rope_store_kv(in, n, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim, c.rope_base, paged, q, kc_pool,
                        vc_pool, stream_, c.rope_style, rope_freqs_, c.rope_attn_factor);
      kc::attention_paged(attention_batch(s, li), q, n, att, scratch, stream_);

      // After the last layer's attention only the rows whose logits are wanted go on.
      if (li == layers_ - 1 && s.gather) {
        if (s.outputs == 0) return;
        const auto* wanted = meta<std::int32_t>(layout_.logits_rows);
        kc::gather_rows(x, wanted, s.outputs, E, x2_.get<float>(), stream_);
        kc::gather_rows(att, wanted, s.outputs, QW, att2_.get<float>(), stream_);
        x = x2_.get<float>();
        att = att2_.get<float>();
        rows = s.outputs;
      }
      kc::matmul(l.out, att, rows, tmp, scratch, stream_);
      kc::add_rms_norm(x, tmp, l.ffn_norm, rows, E, c.rms_eps, xn, stream_);
      if (l.gate_up.rows > 0) {
        kc::matmul(l.gate_up, xn, rows, gate_up, scratch, stream_);
        kc::swiglu_rows(gate_up, gate_up + c.n_ff, rows, c.n_ff, 2 * c.n_ff, gate, stream_);
      } else {
        kc::matmul(l.gate, xn, rows, gate, scratch, stream_);
        kc::matmul(l.up, xn, rows, up, scratch, stream_);
        kc::swiglu(gate, up, rows * c.n_ff, stream_);
      }
      kc::matmul(l.down, gate, rows, tmp, scratch, stream_);
      // The residual, then the next layer's input norm (or the final norm).
      const float* next_norm = li + 1 < layers_ ? layers_dev_[static_cast<std::size_t>(li + 1)].attn_norm
                                                : output_norm_;
      kc::add_rms_norm(x, tmp, next_norm, rows, E, c.rms_eps, xn, stream_);
    }
    if (s.outputs == 0) return;
    kc::matmul(output_, xn, s.outputs, logits_dev_.get<float>(), scratch, stream_);
    if (s.sample) {
      kc::sample(logits_dev_.get<float>(), s.outputs, c.n_vocab, meta<kc::SampleParams>(layout_.sample),
                 tokens_dev_.get<std::int32_t>(), scratch, stream_);
    }
  }

  struct GraphKey {
    std::int64_t bucket;
    bool sample;
    auto operator<=>(const GraphKey&) const = default;
  };

  std::shared_ptr<const Model> model_;
  kc::DeviceInfo info_;
  ExecutorOptions options_;
  std::int64_t layers_ = 0;
  std::unique_ptr<kernels::ThreadPool> own_threads_;
  kernels::ThreadPool* threads_ = nullptr;
  cudaStream_t stream_ = nullptr;

  DeviceMemory weights_;
  std::size_t weight_bytes_ = 0;
  kc::DeviceMatrix token_embd_, output_;
  const float* output_norm_ = nullptr;
  const float* rope_freqs_ = nullptr;
  std::vector<DeviceLayer> layers_dev_;

  DeviceMemory x_, x2_, xn_, q_, k_, v_, att_, att2_, tmp_, gate_, up_, logits_dev_, tokens_dev_;
  DeviceMemory qkv_, gate_up_;  // the stacked products' rows (DeviceLayer)
  DeviceMemory scratch_;

  DeviceMemory pool_k_, pool_v_;
  std::int64_t block_size_ = 16, n_blocks_ = 0, layer_stride_ = 0, max_blocks_ = 0;
  MetadataLayout layout_;
  std::unique_ptr<PinnedMemory> meta_host_;
  DeviceMemory meta_device_;
  std::map<GraphKey, cudaGraphExec_t> graphs_;
};

}  // namespace

bool cuda_device_usable(std::string& why_not) { return kc::probe(why_not).has_value(); }

bool cuda_takes_model(const Model& model, std::string& why_not) {
  std::vector<std::pair<const char*, const kernels::Matrix*>> all = {{"token_embd", &model.token_embedding()},
                                                                      {"output", &model.output()}};
  for (const LayerWeights& l : model.layers())
    for (const auto& named : {std::pair{"attn_q", &l.attn_q}, std::pair{"attn_k", &l.attn_k}, std::pair{"attn_v", &l.attn_v},
                              std::pair{"attn_output", &l.attn_out}, std::pair{"ffn_gate", &l.ffn_gate},
                              std::pair{"ffn_up", &l.ffn_up}, std::pair{"ffn_down", &l.ffn_down}})
      all.push_back(named);
  for (const auto& [name, m] : all) {
    if (!kc::takes(m->type)) {
      why_not = "the GPU kernels do not take this model's " + std::string(kernels::to_string(m->type)) + " matrices";
      return false;
    }
    // The kernels read rows in whole 32-value blocks (the float types too).
    if (m->cols % 32 != 0) {
      why_not = "the GPU kernels take rows of a multiple of 32 values, and this model's " + std::string(name) +
                " rows hold " + std::to_string(m->cols);
      return false;
    }
  }
  return true;
}

std::unique_ptr<Executor> make_cuda_executor(std::shared_ptr<const Model> model,
                                             const ExecutorOptions& options) {
  std::string why_not;
  auto info = kc::probe(why_not);
  if (!info) throw std::runtime_error("no usable GPU: " + why_not);
  return std::make_unique<CudaExecutor>(std::move(model), options, std::move(*info));
}

}  // namespace batchlm::local_engine
