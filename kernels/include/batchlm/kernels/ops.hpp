#pragma once
// The operations the forward pass is written against. kernels/cpu implements them with
// threads and SIMD (AVX2 + FMA + F16C where the CPU has them, portable code otherwise, chosen
// once at run time) and is the reference for other devices.
//
// Numerics follow the GGUF ecosystem's CPU conventions so that our tokens match llama.cpp's:
// activations are quantized to the weight's "dot type" (Q8_0 for Q4_0/Q8_0 weights, Q8_1 for
// Q4_1, F16 for F16, BF16 for BF16) and quantized dot products run on integers, block by block,
// without dequantizing the matrix; the KV cache holds F16; attention rounds queries and
// probabilities to F16 as a F16 matrix product would. Each block's integer dot product is
// exact and enters the sum with one FMA per block, in block order; llama.cpp keeps partial
// float sums instead, so logits agree with its to rounding (tests/reference/README.md).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "batchlm/kernels/dtype.hpp"
#include "batchlm/kernels/thread_pool.hpp"

namespace batchlm::kernels {

// A row-major weight matrix in its stored type: `rows` rows of `cols` elements.
// `packed`, when set, is the same matrix as pack_weights(*this) lays it out; the CPU matrix
// products then read that copy where their SIMD path has kernels for it (data stays the GGUF
// bytes, for get_rows and for copies to other devices).
struct Matrix {
  DType type = DType::F32;
  const void* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  const void* packed = nullptr;
};

// A copy of a quantized matrix's weights with rows interleaved in groups of 8, so that one
// vector instruction works on 8 rows at once and the block scales of a row group are applied
// once per token (kernels/cpu/cpu_kernels.hpp describes the layout). Built once, at load.
class PackedWeights {
 public:
  PackedWeights() = default;
  const void* data() const { return bytes_.get(); }  // nullptr when empty
  std::size_t size() const { return size_; }

 private:
  friend PackedWeights pack_weights(const Matrix& w);
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte[], Free> bytes_;
  std::size_t size_ = 0;
};
// w's weights packed (Q4_0, Q4_1, Q8_0, Q5_0 as Q8_0 blocks of the same values, Q5_1 with its
// quants in bytes; cols a multiple of 32; Q4_K, Q5_K, Q6_K, cols a multiple of 256, with
// their scales unpacked and their quants' bits as in the file); empty for the other types,
// which have no packed form. Products of a packed matrix are the portable path's bit for bit on
// every path (each block's integer dot product, then one FMA per block in block order); the
// SIMD paths' GGUF-layout tiles, used without a packed copy, sum in another order.
PackedWeights pack_weights(const Matrix& w);

// Which SIMD path the CPU kernels use ("avx2" or "portable"); BATCHLM_CPU_SIMD=portable forces
// the portable path.
const char* cpu_simd_name();

// y[t * w.rows + r] = dot(w row r, x[t * w.cols ...]) for t in [0, n).
// `scratch` must hold activation_bytes(w, n) bytes (the quantized copy of x).
std::size_t activation_bytes(const Matrix& w, std::int64_t n);
void matmul(const Matrix& w, const float* x, std::int64_t n, float* y, void* scratch,
            ThreadPool& pool);

// Several products of the same input (the query, key and value projections; the gate and up
// projections): x is converted once per dot type and all rows run in one parallel pass.
// Every w must have the same cols; y[i] receives [n][w[i].rows]. scratch: the sum of
// activation_bytes over the distinct dot types (group_activation_bytes).
std::size_t group_activation_bytes(std::span<const Matrix> w, std::int64_t n);
void matmul_group(std::span<const Matrix> w, const float* x, std::int64_t n,
                  std::span<float* const> y, void* scratch, ThreadPool& pool);

// out[i * w.cols ...] = row ids[i] of w, dequantized.
void get_rows(const Matrix& w, std::span<const std::int32_t> ids, float* out);

// out = x / rms(x) * weight, per row of `dim`, for n rows (in place allowed). With a pool, the
// rows are shared among its threads (the same values).
void rms_norm(const float* x, const float* weight, std::int64_t n, std::int64_t dim, float eps,
              float* out);
void rms_norm(const float* x, const float* weight, std::int64_t n, std::int64_t dim, float eps,
              float* out, ThreadPool& pool);

// Which dims of a head a rotary pair joins: (2i, 2i+1) in llama's GGUF layout (its converter
// permutes the query and key rows so that this is so), (i, i + rot_dim/2) in the layout of
// Qwen2 and the other models stored as their checkpoints have them ("NeoX" style). Pair i
// turns by the same angle either way.
enum class RopeStyle { kAdjacent, kHalves };

// Rotary embedding of the first rot_dim dims of each head, pair i by the angle
// pos * base^(-2i/rot_dim). x is [n][n_heads][head_dim].
void rope(float* x, std::int64_t n, std::int64_t n_heads, std::int64_t head_dim,
          std::int64_t rot_dim, const std::int32_t* positions, float base);
// The same rotation from angles taken once for every layer of a forward pass: rope_angles gives
// rot_dim floats per token (the cosine and sine of pair i at 2i and 2i + 1, as rope computes
// them), and rope with them gives rope's values bit for bit. With freq_factors (rot_dim / 2
// floats, a model's rope_freqs tensor, as Llama 3.1 and later have, or Phi-3's short factors),
// pair i's angle is divided by freq_factors[i]; attn_factor (Phi-3's long-context magnitude)
// multiplies each cosine and sine.
// freq_scale (linear rotary scaling: 1 / the scaling factor) multiplies each angle after the
// factors divide it, as llama.cpp's rotation does.
std::vector<float> rope_angles(std::int64_t n, std::int64_t rot_dim, const std::int32_t* positions, float base,
                               const float* freq_factors = nullptr, float attn_factor = 1.0f,
                               float freq_scale = 1.0f);
void rope(float* x, std::int64_t n, std::int64_t n_heads, std::int64_t head_dim, std::int64_t rot_dim,
          const float* cos_sin, RopeStyle style = RopeStyle::kAdjacent);

// gate[i] = silu(gate[i]) * up[i], the exponential std::exp's bit for bit at vector speed. With a
// pool, shared among its threads (the same values).
void swiglu(float* gate, const float* up, std::int64_t n);
void swiglu(float* gate, const float* up, std::int64_t n, ThreadPool& pool);
// gate[i] = gelu(gate[i]) * up[i], GELU's tanh form as llama.cpp's CPU backend takes it: the
// input rounded to F16 and looked up in a table of F16 results (0 at or below -10, the input
// itself at or above 10).
void geglu(float* gate, const float* up, std::int64_t n, ThreadPool& pool);
// x[i] = cap * tanh(x[i] / cap): Gemma 2's soft capping of attention scores and logits.
void softcap(float* x, std::int64_t n, float cap);
void add(float* x, const float* y, std::int64_t n);  // x += y
// A residual step: x += y, then out = rms_norm(x), row by row in one pass shared among the
// pool's threads (the values of add, then rms_norm). out may be y.
void add_rms_norm(float* x, const float* y, const float* weight, std::int64_t n, std::int64_t dim,
                  float eps, float* out, ThreadPool& pool);

// Causal attention of n query tokens of one sequence over its F16 KV cache.
// q: [n][n_heads][head_dim]; the KV cache of this layer: key/value of position p, kv head h at
// k + p * kv_stride + h * head_dim. Query i sits at position positions[i] and sees cache
// positions [0, positions[i]]. out: [n][n_heads][head_dim]. Grouped-query: query head h uses
// kv head h / (n_heads / n_kv_heads).
struct AttentionShape {
  std::int64_t n_heads = 0;
  std::int64_t n_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t kv_stride = 0;  // elements between positions in k and v
  float scale = 1.0f;
  // Sliding-window attention (Gemma): a query at position p sees positions p - window + 1 .. p
  // only. 0: every earlier position.
  std::int64_t window = 0;
  // Gemma 2: each score (after scale) becomes softcap * tanh(score / softcap). 0: none.
  float softcap = 0.0f;
};
void attention(const AttentionShape& shape, const float* q, std::int64_t n,
               const std::int32_t* positions, const std::uint16_t* k, const std::uint16_t* v,
               float* out, ThreadPool& pool);

// The paged form: keys and values live in a pool of blocks of `block_size` positions, each
// block block_size * kv_stride elements (for one layer). Values by position: slot j of block b,
// kv head h at v_pool + (b * block_size + j) * kv_stride + h * head_dim. Keys transposed within
// the block, dimension after dimension: element c = h * head_dim + d of slot j of block b at
// k_pool + b * block_size * kv_stride + c * block_size + j, so that the keys of consecutive
// slots lie side by side (the CPU kernels take 16 of them per vector). The CUDA path keeps its
// own pool with keys laid out as values (cuda.hpp). The batch may mix tokens of several
// sequences: token i belongs to sequence sequence_of[i], sits at positions[i] and sees that
// sequence's positions [0, positions[i]] through its block table
// (block_tables[sequence_of[i]][p / block_size]). Same arithmetic as attention(), which is the
// case of one sequence in one block.
struct PagedKv {
  const std::uint16_t* k_pool = nullptr;
  const std::uint16_t* v_pool = nullptr;
  std::int64_t block_size = 16;
  std::span<const std::span<const std::int32_t>> block_tables;
  const std::int32_t* sequence_of = nullptr;  // per token
};
void attention_paged(const AttentionShape& shape, const float* q, std::int64_t n,
                     const std::int32_t* positions, const PagedKv& kv, float* out,
                     ThreadPool& pool);

// Stores n rows of `width` floats as F16 at their positions in the paged pool: as values
// (the v_pool layout of PagedKv) and as keys (transposed within each block). `pool` is
// v_pool or k_pool made writable.
void store_f16_paged(const float* x, std::int64_t n, std::int64_t width,
                     const std::int32_t* positions, const PagedKv& kv, std::uint16_t* pool);
void store_keys_paged(const float* x, std::int64_t n, std::int64_t width,
                      const std::int32_t* positions, const PagedKv& kv, std::uint16_t* pool);

// n_blocks blocks of keys laid out as values ((b * block_size + j) * width + c) rewritten in
// the key layout of PagedKv (b * block_size * width + c * block_size + j).
void transpose_key_blocks(const std::uint16_t* rows, std::int64_t n_blocks, std::int64_t block_size,
                          std::int64_t width, std::uint16_t* out);

// Index of the largest value (the first one on ties).
std::int64_t argmax(const float* x, std::int64_t n);

// out[i] = std::exp(x[i]) bit for bit, at vector speed. out may be x.
void exp_f32(const float* x, float* out, std::int64_t n);

}  // namespace batchlm::kernels
