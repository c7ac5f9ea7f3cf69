#pragma once
// The operations of ops.hpp on an NVIDIA GPU (kernels/cuda), for the engine's CUDA executor.
// Built only when the CUDA toolkit is found (BATCHLM_HAVE_CUDA); the binary links the CUDA
// runtime statically and runs on machines without a driver, where probe() says why not.
//
// Conventions:
// - Every pointer is device memory unless its name starts with host_. Every call is
//   asynchronous on `stream` and launches kernels only (no allocation, no synchronisation,
//   no host copies), so a sequence of calls can be captured in a CUDA graph.
// - Sizes passed by value are what the grid is shaped by. Where a call also reads sizes from
//   device arrays (lengths, positions), the host values are upper bounds and the kernels take
//   the real sizes from memory: a captured graph then replays for any batch within the bounds.
// - A token whose sequence is negative is padding: its keys and values are not stored and its
//   attention output is zero. Graph buckets pad batches this way.
// - Numerics: weights are dequantized in registers and multiplied with F32 activations (F16
//   on the tensor-core path); activations are not quantized as on the CPU. Results agree with
//   the CPU reference within rounding, not bit for bit; kernel tests state the bounds.
// - Failures throw std::runtime_error("CUDA: <what>: <error string>").

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "batchlm/kernels/dtype.hpp"
#include "batchlm/kernels/ops.hpp"

namespace batchlm::kernels::cuda {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int multiprocessors = 0;
  std::size_t memory_total = 0;
  std::size_t memory_free = 0;
  std::size_t l2_bytes = 0;
};

// The first usable device, or nullopt with `why_not` saying why (no driver, no device, a device
// older than this build supports, CUDA_VISIBLE_DEVICES empty, ...). Never throws.
std::optional<DeviceInfo> probe(std::string& why_not);

// Throws std::runtime_error "CUDA: <what>: <error string>" when e is not cudaSuccess.
void check(cudaError_t e, const char* what);

// A weight matrix on the device, in the layout upload() gives it (private to the kernels: e.g.
// quants and scales apart, so that loads are 16 bytes wide and aligned).
struct DeviceMatrix {
  DType type = DType::F32;
  const void* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};
// Whether the kernels take weights of type t: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K.
bool takes(DType t);

// The device bytes `w` takes (a multiple of 256), and the copy: `w` (host memory, GGUF layout)
// is converted and copied to `device` (device memory of device_bytes(w) bytes, owned by the
// caller). Synchronous. Throws std::invalid_argument for a type the kernels do not take.
//
// The returned matrix's `type` is its device layout's: the file's type, except Q5_0 (which
// goes up as Q8_0, the same values), Q5_1 (as Q5_K's layout: 8-bit quants with an F32 scale and
// min per 32 elements, the same values) and Q6_K (as F16: its values rounded to F16). Bytes
// per weight on the device: 4.5 (Q4_0), 5 (Q4_1), 6 (Q4_K), 8.5 (Q5_0, Q8_0), 10 (Q5_1,
// Q5_K), 16 (Q6_K, F16, BF16), 32 (F32) bits.
std::size_t device_bytes(const Matrix& w);
DeviceMatrix upload(const Matrix& w, void* device);

// ---------------------------------------------------------------------------------------------
// Matrix products. y[t * w.rows + r] = dot(w row r, x[t * w.cols ...]) for t in [0, n).
// w is a matrix upload() made (any type it takes). cols must be a multiple of 32.
// Small n (up to kMatvecMaxTokens) runs the matrix-vector kernels: one pass over the weights,
// each weight dequantized once in registers and used for every token. Larger n runs the
// tensor-core kernel: weight tiles dequantized to F16 in shared memory, x converted to F16 in
// `scratch`, F32 accumulation.
inline constexpr std::int64_t kMatvecMaxTokens = 8;
std::size_t matmul_scratch_bytes(const DeviceMatrix& w, std::int64_t n);
void matmul(const DeviceMatrix& w, const float* x, std::int64_t n, float* y, void* scratch,
            cudaStream_t stream);

// out[i * w.cols ...] = row ids[i] of w, dequantized to F32, for i < n: the CPU's
// dequantize_row bit for bit, except for Q6_K (rounded to F16 by upload).
void get_rows(const DeviceMatrix& w, const std::int32_t* ids, std::int64_t n, float* out,
              cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Element-wise and row operations (same definitions as ops.hpp).
void rms_norm(const float* x, const float* weight, std::int64_t n, std::int64_t dim, float eps,
              float* out, cudaStream_t stream);
// The residual and the next norm in one pass: x += y, then out = rms_norm(x).
void add_rms_norm(float* x, const float* y, const float* weight, std::int64_t n,
                  std::int64_t dim, float eps, float* out, cudaStream_t stream);
// rope as ops.hpp has it: pairs adjacent or in halves of each head (style), each angle
// divided by its freq_factors entry where given (device memory, rot_dim / 2 floats), each
// cosine and sine multiplied by attn_factor (Phi-3's long-context magnitude).
void rope(float* x, std::int64_t n, std::int64_t n_heads, std::int64_t head_dim,
          std::int64_t rot_dim, const std::int32_t* positions, float base, cudaStream_t stream,
          RopeStyle style = RopeStyle::kAdjacent, const float* freq_factors = nullptr,
          float attn_factor = 1.0f);
void swiglu(float* gate, const float* up, std::int64_t n, cudaStream_t stream);
// out[t * width + i] = silu(gate[t * stride + i]) * up[t * stride + i] for t < n, i < width:
// swiglu over rows read with a stride (gate and up may be the two halves of one product's
// rows). out must not overlap gate or up.
void swiglu_rows(const float* gate, const float* up, std::int64_t n, std::int64_t width, std::int64_t stride,
                 float* out, cudaStream_t stream);
void add(float* x, const float* y, std::int64_t n, cudaStream_t stream);
// dst[i * width ...] = src[rows[i] * width ...] for i < n (gathering the rows whose logits are
// wanted). dst and src must not overlap.
void gather_rows(const float* src, const std::int32_t* rows, std::int64_t n, std::int64_t width,
                 float* dst, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Paged KV cache and attention, on the block tables of the CPU path (ops.hpp PagedKv): for one
// layer, position slot j of block b, kv head h at pool + (b * block_size + j) * kv_stride +
// h * head_dim, in F16, for keys and values alike (the CPU pool keeps its keys transposed within
// each block; this pool is the GPU's own).
struct PagedBatch {
  std::int64_t block_size = 16;
  const std::int32_t* block_tables = nullptr;  // [n_seqs][max_blocks], row-major
  std::int32_t max_blocks = 0;                 // the table's row length
  const std::int32_t* sequence_of = nullptr;   // per token; < 0: padding
  const std::int32_t* positions = nullptr;     // per token
};

// Stores n rows of `width` floats (the keys or values of n tokens) as F16 at their positions.
void store_f16_paged(const float* x, std::int64_t n, std::int64_t width, const PagedBatch& batch,
                     std::uint16_t* pool, cudaStream_t stream);

// A step's queries, keys and values: rows of n_heads (keys, values: n_kv_heads) * head_dim
// floats, token t's at q + t * stride_q, and so on (the three may be parts of one product's
// rows, as when Q, K and V are one stacked matrix).
struct QkvRows {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  std::int64_t stride_q = 0, stride_k = 0, stride_v = 0;
};
// In one launch, what rope of the queries and of the keys (at batch.positions), then
// store_f16_paged of keys (k_pool) and values (v_pool) do, bit for bit: the rotated queries go
// to q_out ([n][n_heads * head_dim]; it may be in.q when that is contiguous), the keys and
// values to the pools (pool rows of n_kv_heads * head_dim). head_dim even, rot_dim even and at
// most head_dim; throws std::invalid_argument otherwise.
// style, freq_factors and attn_factor as rope's.
void rope_store_kv(const QkvRows& in, std::int64_t n, std::int64_t n_heads, std::int64_t n_kv_heads,
                   std::int64_t head_dim, std::int64_t rot_dim, float base, const PagedBatch& batch,
                   float* q_out, std::uint16_t* k_pool, std::uint16_t* v_pool, cudaStream_t stream,
                   RopeStyle style = RopeStyle::kAdjacent, const float* freq_factors = nullptr,
                   float attn_factor = 1.0f);

// What some architectures do to the queries, keys and values before rope (Qwen2's biases,
// Qwen3's per-head norms): biases added (q_bias: n_heads * head_dim floats, k_bias and v_bias:
// n_kv_heads * head_dim), then every query and key head RMS-normalized with its weight (q_norm,
// k_norm: head_dim floats, rms_norm's definition with eps). Null pointers skip their part; all
// are device memory.
struct QkvExtras {
  const float* q_bias = nullptr;
  const float* k_bias = nullptr;
  const float* v_bias = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float eps = 1e-6f;
};
// In place on rows laid out as QkvRows's (token t's queries at q + t * stride_q, ...). head_dim
// at most 256 (std::invalid_argument otherwise). Launches nothing when `extras` is empty.
void qkv_bias_norm(float* q, float* k, float* v, std::int64_t stride_q, std::int64_t stride_k,
                   std::int64_t stride_v, std::int64_t n, std::int64_t n_heads, std::int64_t n_kv_heads,
                   std::int64_t head_dim, const QkvExtras& extras, cudaStream_t stream);

// The queries of a step, grouped by sequence: the tokens of sequence s are the contiguous
// range [query_start[s], query_start[s + 1]) at consecutive positions from first_position[s]
// (a prefill chunk, or one decode token plus its drafts). Query j of sequence s sees positions
// [0, first_position[s] + j] (causal).
struct AttentionBatch {
  AttentionShape shape;  // ops.hpp: heads, kv heads, head_dim, kv_stride, scale
  const std::uint16_t* k_pool = nullptr;
  const std::uint16_t* v_pool = nullptr;
  std::int64_t block_size = 16;
  const std::int32_t* block_tables = nullptr;  // [n_seqs][max_blocks]
  std::int32_t max_blocks = 0;
  std::int32_t n_seqs = 0;                     // grid bound: sequences (padding has 0 queries)
  const std::int32_t* query_start = nullptr;   // [n_seqs + 1]
  const std::int32_t* first_position = nullptr;  // [n_seqs]
  std::int32_t max_queries = 0;  // grid bound: the most query tokens of one sequence
  std::int32_t max_context = 0;  // grid bound: the largest first_position + queries
};
// Decode-shaped batches (max_queries small) split each sequence's context into chunks that run
// in parallel and are merged (flash-decoding); prefill-shaped ones tile queries and keys with
// an online softmax. Head dims up to 256, multiples of 8 (checked: std::invalid_argument).
std::size_t attention_scratch_bytes(const AttentionBatch& batch, std::int64_t n_tokens);
void attention_paged(const AttentionBatch& batch, const float* q, std::int64_t n_tokens,
                     float* out, void* scratch, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Sampling on the device: only token ids come back to the host. Per row: temperature <= 0 or
// top_k == 1 is the argmax (the first on ties); otherwise softmax(logits / temperature)
// restricted to the top_k most likely tokens (0: all), then to the smallest most-likely set
// whose probability reaches top_p, then one draw. The draw's uniform number comes from a
// counter-based generator keyed by (seed, counter), so a request's tokens depend on its seed
// and its step only, not on what else is in the batch. A row with a NaN or an infinity anywhere
// gives -1.
struct SampleParams {
  float temperature = 0.0f;
  float top_p = 1.0f;
  std::int32_t top_k = 0;
  std::uint64_t seed = 0;
  std::uint64_t counter = 0;  // e.g. the number of tokens the request has generated
};
// The uniform [0, 1) number the sampler uses for (seed, counter): exposed so tests can compute
// the expected token on the host.
double sample_uniform(std::uint64_t seed, std::uint64_t counter);
std::size_t sample_scratch_bytes(std::int64_t rows, std::int64_t n_vocab);
void sample(const float* logits, std::int64_t rows, std::int64_t n_vocab,
            const SampleParams* params, std::int32_t* tokens, void* scratch, cudaStream_t stream);

}  // namespace batchlm::kernels::cuda
