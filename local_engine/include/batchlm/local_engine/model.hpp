#pragma once
// A Llama-family model loaded from GGUF: the hyper-parameters, the weights (views into the
// mapped file), the tokenizer, and the forward pass, written once against kernels/ops.hpp.
// Architectures: "llama" (Llama, SmolLM and the others stored as it), "qwen2" (Qwen2 and
// Qwen2.5: biases on the query, key and value products, rotary pairs in halves) and "qwen3"
// (no biases; each head's query and key RMS-normalized; heads wider than n_embd / n_heads),
// and "phi3" (Phi-3, Phi-3.5, Phi-4-mini: Q, K and V in one matrix and gate and up in another,
// which load as views of their rows; rotary pairs in halves, over part of the head for some;
// the long-context models' short rotary factors and magnitude factor), and "gemma",
// "gemma2" and "gemma3" (embeddings scaled by sqrt(n_embd), GELU in place of SiLU, queries
// scaled before attention; Gemma 2 and 3 add a norm after attention and after the MLP and
// sliding-window attention in most layers; Gemma 2 caps attention scores and logits with
// tanh, Gemma 3 normalizes each head's query and key and rotates its window layers with a
// base of their own).

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/kernels/thread_pool.hpp"
#include "batchlm/local_engine/gguf.hpp"
#include "batchlm/local_engine/tokenizer.hpp"

namespace batchlm::local_engine {

struct ModelConfig {
  std::string architecture;   // "llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2" or "gemma3"
  std::string name;           // general.name, may be empty
  std::int64_t n_vocab = 0;
  std::int64_t n_ctx_train = 0;
  std::int64_t n_embd = 0;
  std::int64_t n_ff = 0;
  std::int64_t n_layers = 0;
  std::int64_t n_heads = 0;
  std::int64_t n_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t rope_dim = 0;
  float rope_base = 10000.0f;
  kernels::RopeStyle rope_style = kernels::RopeStyle::kAdjacent;
  bool rope_freq_factors = false;   // factors divide the angles: Llama 3.1's rope_freqs, Phi-3's short ones
  // Phi-3's long-context models have two sets: rope_factors_short runs where the context the
  // model runs at (Model::load's) is at most the original one, rope_factors_long past it, as
  // llama.cpp chooses them; long_context says which. A model loaded for the short ones stops its
  // context at n_ctx_orig (n_ctx_usable).
  bool rope_long_factors = false;
  bool long_context = false;
  std::int64_t n_ctx_orig = 0;      // rope.scaling.original_context_length (0: none given)
  float rope_attn_factor = 1.0f;    // rope.scaling.attn_factor: multiplies each cosine and sine
  float rope_freq_scale = 1.0f;     // linear rotary scaling: 1 / rope.scaling.factor
  // Sliding-window attention (Gemma 2 and 3): the layers marked in swa_layers see the last
  // sliding_window positions only, and rotate with their own base and scale.
  std::int64_t sliding_window = 0;
  std::vector<bool> swa_layers;     // n_layers entries where sliding_window > 0
  float rope_base_swa = 10000.0f;
  float rope_freq_scale_swa = 1.0f;
  // Gemma: the token embeddings are multiplied by embd_scale, the MLP is GELU-gated, queries
  // are multiplied by q_scale after rotation (the scores then unscaled), and with post_norms
  // the attention's and the MLP's outputs are RMS-normalized before each residual addition.
  float embd_scale = 1.0f;
  bool gelu = false;
  float q_scale = 0.0f;             // 0: scores scaled by 1 / sqrt(head_dim) instead
  bool post_norms = false;
  float attn_softcap = 0.0f;        // Gemma 2: scores capped as cap * tanh(score / cap); 0: none
  float final_softcap = 0.0f;       // Gemma 2: logits capped likewise; 0: none
  bool qkv_bias = false;            // attn_q/k/v.bias are added to the products
  bool qk_norm = false;             // attn_q_norm/attn_k_norm normalize each head (Qwen3)
  float rms_eps = 1e-5f;
  bool tied_embeddings = false;

  std::int64_t kv_width() const { return n_kv_heads * head_dim; }
  // The longest context the model runs at as loaded: the training context, or the original one
  // where the short rotary factors run.
  std::int64_t n_ctx_usable() const {
    return rope_long_factors && !long_context && n_ctx_orig > 0 ? std::min(n_ctx_train, n_ctx_orig) : n_ctx_train;
  }
  std::int64_t q_width() const { return n_heads * head_dim; }  // n_embd but where heads are wider
};

struct LayerWeights {
  kernels::Matrix attn_q, attn_k, attn_v, attn_out, ffn_gate, ffn_up, ffn_down;
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  // Where ModelConfig::qkv_bias: added to the query, key and value products (before rotation).
  const float* attn_q_bias = nullptr;
  const float* attn_k_bias = nullptr;
  const float* attn_v_bias = nullptr;
  // Where ModelConfig::qk_norm: each head's RMS-norm weights (head_dim) for queries and keys.
  const float* attn_q_norm = nullptr;
  const float* attn_k_norm = nullptr;
  // Where ModelConfig::post_norms: the norms of the attention's and the MLP's outputs.
  const float* attn_post_norm = nullptr;
  const float* ffn_post_norm = nullptr;
};

// Where the keys and values of a batch live, in F16: for layer l a pool of n_blocks blocks of
// block_size positions at k + l * layer_stride (v likewise), in the layout of kernels::PagedKv.
struct KvPool {
  std::uint16_t* k = nullptr;
  std::uint16_t* v = nullptr;
  std::int64_t layer_stride = 0;  // elements between layers
  std::int64_t block_size = 16;
  std::int64_t n_blocks = 0;
};

// One forward pass over tokens of any number of sequences (continuous batching): token i of
// sequence sequence_of[i] at positions[i], its keys and values stored through that sequence's
// block table. Each sequence's earlier positions must already be in the pool.
struct Batch {
  std::span<const Token> tokens;
  std::span<const std::int32_t> positions;
  std::span<const std::int32_t> sequence_of;                   // index into block_tables
  std::span<const std::span<const std::int32_t>> block_tables;
  std::span<const std::int32_t> logits_rows;  // increasing token indices whose logits are wanted
  // Early exit: only the first `layers` layers run, then the final norm and the output head
  // (the KvPool then needs only those layers). 0: every layer.
  std::int64_t layers = 0;
};

// The memory of a KvPool: n_blocks blocks of block_size positions for every layer, in F16.
// Left uninitialised: pages are touched only as blocks are first written. 64-byte aligned, so
// a head's row of 64 values is two whole cache lines (at malloc's 16-byte offset it spans
// three, and attention over rows that are not in cache slows by a third).
class KvStore {
 public:
  // n_layers: the layers it holds (0: all of the model's).
  KvStore(const ModelConfig& config, std::int64_t block_size, std::int64_t n_blocks,
          std::int64_t n_layers = 0);
  const KvPool& pool() const { return pool_; }
  // Writes zeros over the whole store, shared among the pool's threads: every page is then
  // mapped (see Executor::commit_pool).
  void commit(kernels::ThreadPool& threads);
  // Block `from`'s keys and values copied over block `to`'s, in every layer (Executor::copy_blocks).
  void copy_block(std::int64_t from, std::int64_t to);

 private:
  struct Free {
    void operator()(std::uint16_t* p) const;
  };
  std::unique_ptr<std::uint16_t[], Free> k_, v_;
  std::size_t elements_ = 0;  // in each of k_ and v_
  std::int64_t layers_ = 0;
  KvPool pool_;
};

// The keys and values of one sequence: a store of one block that holds every position.
class KvCache {
 public:
  KvCache(const ModelConfig& config, std::int64_t capacity)
      : capacity_(capacity), store_(config, capacity, 1) {}
  std::int64_t capacity() const { return capacity_; }
  std::int64_t size() const { return size_; }   // positions filled
  void resize(std::int64_t n);                   // drop positions >= n (n <= size)
  const KvPool& pool() const { return store_.pool(); }

 private:
  friend class Model;
  std::int64_t capacity_;
  std::int64_t size_ = 0;
  KvStore store_;
};

class Model {
 public:
  // Maps the file and checks every tensor the architecture needs against the metadata.
  // Throws gguf::Error naming the file and the problem. `check_only`: the same checks, without
  // the kernels' packed copies of the weights (a dry run's), for a model that is never run.
  // `context`: the context asked for (0: the default), which decides the rotary factors of
  // Phi-3's long-context models (ModelConfig::long_context): an engine runs the model at the
  // context it was loaded for.
  static std::shared_ptr<Model> load(const std::filesystem::path& path, bool check_only = false,
                                     std::int64_t context = 0);
  bool check_only() const { return check_only_; }

  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const ChatTemplate& chat_template() const;  // throws when the template is unsupported
  const gguf::File& file() const { return file_; }
  // The most tokens one forward() call takes; longer prompts are split by the caller.
  static constexpr std::int64_t kMaxBatch = 512;

  // Runs `tokens` at the next positions of `cache` (appending their keys and values) and writes
  // the logits of the last token (all_logits = false) or of every token into `logits`
  // ([n][n_vocab]). tokens.size() <= kMaxBatch and the cache must have room.
  void forward(std::span<const Token> tokens, KvCache& cache, std::span<float> logits,
               bool all_logits, kernels::ThreadPool& pool) const;

  // The batched, paged form: writes the logits of batch.logits_rows into `logits`
  // ([logits_rows.size()][n_vocab]). Throws std::invalid_argument for an inconsistent batch
  // (sizes, a position its block table does not cover, a block outside the pool, a token
  // outside the vocabulary). forward() is the case of one sequence in one block.
  void forward_batch(const Batch& batch, const KvPool& kv, std::span<float> logits,
                     kernels::ThreadPool& pool) const;
  // The checks forward_batch makes, for a pool of n_blocks blocks of block_size positions and a
  // logits buffer of logits_size floats; returns the layers the batch runs.
  std::int64_t check_batch(const Batch& batch, std::int64_t block_size, std::int64_t n_blocks,
                           std::size_t logits_size) const;

  // The weights, for executors that copy them to another device.
  const kernels::Matrix& token_embedding() const { return token_embd_; }
  const kernels::Matrix& output() const { return output_; }
  const float* output_norm() const { return output_norm_; }
  std::span<const LayerWeights> layers() const { return layers_; }
  // rope_dim / 2 factors where ModelConfig::rope_freq_factors, else nullptr: for Phi-3's
  // long-context models, the set that runs (ModelConfig::long_context).
  const float* rope_freqs() const { return rope_freqs_; }

 private:
  explicit Model(gguf::File file);
  struct Scratch;

  gguf::File file_;
  ModelConfig config_;
  kernels::Matrix token_embd_, output_;
  std::vector<kernels::PackedWeights> packed_;  // the matrices' packed copies (Matrix::packed)
  bool check_only_ = false;
  const float* output_norm_ = nullptr;
  const float* rope_freqs_ = nullptr;
  std::vector<LayerWeights> layers_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_template_;
};

}  // namespace batchlm::local_engine
