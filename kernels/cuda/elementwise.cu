// Element-wise and row operations of cuda.hpp (the definitions of ops.hpp, on the device):
// rms_norm, add_rms_norm, rope, swiglu, add, gather_rows, store_f16_paged, the fused
// rope_store_kv and swiglu_rows, and qkv_bias_norm.
//
// Shapes: the norms run one 256-thread block per row (a block reduction of the sum of
// squares, F32); everything else is a grid-stride loop over its elements, so any size runs
// with a bounded grid. All index arithmetic is 64-bit. Sizes <= 0 launch nothing.

#include <cmath>
#include <stdexcept>
#include <string>

#include "common.cuh"

namespace batchlm::kernels::cuda {

namespace {

using detail::ceil_div;

constexpr int kThreads = 256;          // a multiple of 32 (block_sum needs it)
constexpr std::int64_t kMaxGrid = 65536;  // grid-stride loops: at most this many blocks

// Blocks for a grid-stride loop over `total` items, `per_block` items per block per step.
unsigned grid_for(std::int64_t total, std::int64_t per_block = kThreads) {
  const std::int64_t blocks = ceil_div(total, per_block);
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGrid ? kMaxGrid : blocks));
}

// The first thread index of this thread in a grid-stride loop, and the loop's stride.
__device__ __forceinline__ std::int64_t grid_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_stride() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

// ---------------------------------------------------------------------------------------------
// rms_norm / add_rms_norm: block b handles rows b, b + gridDim.x, ... (the row loop is uniform
// over the block, so the __syncthreads inside block_sum are reached by every thread).
// Each thread reads and writes only the elements i = threadIdx.x + k * blockDim.x of a row, and
// the writes come after the reduction, so out == x (in place) is safe (hence no __restrict__).
__global__ void rms_norm_kernel(const float* x_in, float* x_inout, const float* y,
                                const float* __restrict__ weight, std::int64_t n, std::int64_t dim,
                                float eps, float* out) {
  __shared__ float partial[detail::kWarp];
  for (std::int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    float sum = 0.0f;
    if (y != nullptr) {
      // add_rms_norm: x += y first (the thread writes the elements it later normalises).
      float* xr = x_inout + row * dim;
      const float* yr = y + row * dim;
      for (std::int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i] + yr[i];
        xr[i] = v;
        sum += v * v;
      }
    } else {
      const float* xr = x_in + row * dim;
      for (std::int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += xr[i] * xr[i];
    }
    sum = detail::block_sum(sum, partial);
    // Same expression as the CPU: 1 / sqrt(mean + eps), IEEE sqrt and division.
    const float mean = sum / static_cast<float>(dim);
    const float scale = 1.0f / sqrtf(mean + eps);
    const float* xr = (y != nullptr ? x_inout : x_in) + row * dim;
    float* o = out + row * dim;
    for (std::int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * scale * weight[i];
  }
}

unsigned row_grid(std::int64_t n) {
  return static_cast<unsigned>(n > kMaxGrid ? kMaxGrid : n);
}

// ---------------------------------------------------------------------------------------------
// rope: one thread per (token, pair i < rot_dim / 2); the thread rotates pair i of every head of
// its token with one cos/sin. The angle pos * base^(-2i/rot_dim) and its cos/sin are computed in
// double (positions reach 8k+ and more: a F32 angle of that size is off by ~1e-3 rad), then
// rounded to F32; the rotation itself is F32 as on the CPU.
// cos and sin of pair i's angle at position pos: pos * base^(-2i/rot_dim), with
// base^(-2i/rot_dim) = exp(-(2i/rot_dim) * ln(base)).
// With freq_factors (rot_dim / 2 floats, a model's rope_freqs), pair i's angle is divided by
// freq_factors[i].
// attn_factor (Phi-3's long-context magnitude) multiplies the F32 cosine and sine.
__device__ __forceinline__ void rope_cos_sin(std::int64_t i, std::int64_t rot_dim, double log_base,
                                             std::int32_t pos, const float* __restrict__ freq_factors,
                                             float attn_factor, float& c, float& s) {
  double inv_freq = exp(-(2.0 * static_cast<double>(i) / static_cast<double>(rot_dim)) * log_base);
  if (freq_factors != nullptr) inv_freq /= static_cast<double>(freq_factors[i]);
  const double angle = static_cast<double>(pos) * inv_freq;
  double sd, cd;
  sincos(angle, &sd, &cd);
  c = static_cast<float>(cd);
  s = static_cast<float>(sd);
  if (attn_factor != 1.0f) {
    c *= attn_factor;
    s *= attn_factor;
  }
}

// The rotation of one pair, rounded after every operation (no fused multiply-add), so that
// rope and rope_store_kv give the same bits.
__device__ __forceinline__ float2 rotate_pair(float a, float b, float c, float s) {
  return make_float2(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)), __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c)));
}

// The two elements of a head that pair p holds: pair p < rot_pairs is rotated, (2p, 2p + 1)
// with adjacent pairs, (p, p + rot_pairs) with pairs in halves; a pair past the rotated ones,
// (2p, 2p + 1) either way (elements rot_dim .. head_dim - 1, copied).
__device__ __forceinline__ void pair_elements(std::int64_t p, std::int64_t rot_pairs, bool halves,
                                              std::int64_t& e0, std::int64_t& e1) {
  if (halves && p < rot_pairs) {
    e0 = p;
    e1 = p + rot_pairs;
  } else {
    e0 = 2 * p;
    e1 = 2 * p + 1;
  }
}

__global__ void rope_kernel(float* x, std::int64_t n, std::int64_t n_heads, std::int64_t head_dim,
                            std::int64_t pairs, std::int64_t rot_dim,
                            const std::int32_t* __restrict__ positions, double log_base, bool halves,
                            const float* __restrict__ freq_factors, float attn_factor) {
  const std::int64_t total = n * pairs;
  for (std::int64_t idx = grid_index(); idx < total; idx += grid_stride()) {
    const std::int64_t t = idx / pairs;
    const std::int64_t i = idx % pairs;
    float c, s;
    rope_cos_sin(i, rot_dim, log_base, positions[t], freq_factors, attn_factor, c, s);
    std::int64_t e0, e1;
    pair_elements(i, pairs, halves, e0, e1);
    float* v = x + t * n_heads * head_dim;
    for (std::int64_t h = 0; h < n_heads; ++h, v += head_dim) {
      const float2 r = rotate_pair(v[e0], v[e1], c, s);
      v[e0] = r.x;
      v[e1] = r.y;
    }
  }
}

// The pool row of token t (block * block_size + pos % block_size), or -1 where
// store_f16_paged writes nothing: padding (seq < 0), pos < 0, past the table, a negative block.
__device__ __forceinline__ std::int64_t pool_row(std::int64_t t, std::int64_t block_size,
                                                 const std::int32_t* __restrict__ block_tables,
                                                 std::int32_t max_blocks,
                                                 const std::int32_t* __restrict__ sequence_of,
                                                 const std::int32_t* __restrict__ positions) {
  const std::int32_t seq = sequence_of[t];
  if (seq < 0) return -1;
  const std::int64_t pos = positions[t];
  if (pos < 0) return -1;
  const std::int64_t slot_block = pos / block_size;
  if (slot_block >= max_blocks) return -1;
  const std::int64_t block = block_tables[static_cast<std::int64_t>(seq) * max_blocks + slot_block];
  if (block < 0) return -1;
  return block * block_size + pos % block_size;
}

// rope_store_kv: one thread per (token, pair p < head_dim / 2). Pair p of every query head is
// rotated (p < rot_pairs) or copied into q_out; pair p of every key head is rotated likewise
// and stored, with the value pair, as F16 at the token's pool row. The same bits as rope on
// the queries and keys, then store_f16_paged of keys and values.
struct RopeStoreArgs {
  const float* q;
  const float* k;
  const float* v;
  std::int64_t stride_q, stride_k, stride_v;
  std::int64_t n, n_heads, n_kv_heads, head_dim, rot_pairs, rot_dim;
  double log_base;
  bool halves;
  const float* freq_factors;
  float attn_factor;
  std::int64_t block_size;
  const std::int32_t* block_tables;
  std::int32_t max_blocks;
  const std::int32_t* sequence_of;
  const std::int32_t* positions;
  float* q_out;
  std::uint16_t* k_pool;
  std::uint16_t* v_pool;
};

__global__ void rope_store_kv_kernel(const RopeStoreArgs a) {
  const std::int64_t half = a.head_dim / 2, total = a.n * half;
  const std::int64_t width = a.n_kv_heads * a.head_dim;  // a pool row
  for (std::int64_t idx = grid_index(); idx < total; idx += grid_stride()) {
    const std::int64_t t = idx / half, p = idx % half;
    const bool rotated = p < a.rot_pairs;
    float c = 1.0f, s = 0.0f;
    if (rotated) rope_cos_sin(p, a.rot_dim, a.log_base, a.positions[t], a.freq_factors, a.attn_factor, c, s);
    std::int64_t e0, e1;
    pair_elements(p, a.rot_pairs, a.halves, e0, e1);
    const float* qi = a.q + t * a.stride_q;
    float* qo = a.q_out + t * a.n_heads * a.head_dim;
    for (std::int64_t h = 0; h < a.n_heads; ++h, qi += a.head_dim, qo += a.head_dim) {
      const float x0 = qi[e0], x1 = qi[e1];
      const float2 r = rotated ? rotate_pair(x0, x1, c, s) : make_float2(x0, x1);
      qo[e0] = r.x;
      qo[e1] = r.y;
    }
    const std::int64_t row =
        pool_row(t, a.block_size, a.block_tables, a.max_blocks, a.sequence_of, a.positions);
    if (row < 0) continue;
    const float* ki = a.k + t * a.stride_k;
    const float* vi = a.v + t * a.stride_v;
    for (std::int64_t h = 0; h < a.n_kv_heads; ++h, ki += a.head_dim, vi += a.head_dim) {
      const float2 r = rotated ? rotate_pair(ki[e0], ki[e1], c, s) : make_float2(ki[e0], ki[e1]);
      const std::int64_t at = row * width + h * a.head_dim;
      // Round to nearest even, as the CPU's fp32_to_fp16.
      a.k_pool[at + e0] = __half_as_ushort(__float2half_rn(r.x));
      a.k_pool[at + e1] = __half_as_ushort(__float2half_rn(r.y));
      a.v_pool[at + e0] = __half_as_ushort(__float2half_rn(vi[e0]));
      a.v_pool[at + e1] = __half_as_ushort(__float2half_rn(vi[e1]));
    }
  }
}

// qkv_bias_norm: one warp per (token, head), over the query heads, then the key heads, then
// the value heads. A lane holds elements lane, lane + 32, ... of its head (head_dim <= 256:
// at most 8), adds their bias, and where the head has a norm weight the warp sums the squares
// and scales (rms_norm's expression, F32 sums in another order than the CPU's).
constexpr int kMaxHeadPerLane = 8;
struct BiasNormArgs {
  float* q;
  float* k;
  float* v;
  std::int64_t stride_q, stride_k, stride_v;
  std::int64_t n, n_heads, n_kv_heads, head_dim;
  QkvExtras extras;
};

__global__ void qkv_bias_norm_kernel(const BiasNormArgs a) {
  const std::int64_t heads = a.n_heads + 2 * a.n_kv_heads;
  const std::int64_t total = a.n * heads;
  const int lane = static_cast<int>(threadIdx.x) % detail::kWarp;
  const std::int64_t warps = grid_stride() / detail::kWarp;
  for (std::int64_t w = grid_index() / detail::kWarp; w < total; w += warps) {
    const std::int64_t t = w / heads, slot = w % heads;
    float* x;
    const float* bias;
    const float* weight;
    if (slot < a.n_heads) {
      x = a.q + t * a.stride_q + slot * a.head_dim;
      bias = a.extras.q_bias != nullptr ? a.extras.q_bias + slot * a.head_dim : nullptr;
      weight = a.extras.q_norm;
    } else if (slot < a.n_heads + a.n_kv_heads) {
      const std::int64_t h = slot - a.n_heads;
      x = a.k + t * a.stride_k + h * a.head_dim;
      bias = a.extras.k_bias != nullptr ? a.extras.k_bias + h * a.head_dim : nullptr;
      weight = a.extras.k_norm;
    } else {
      const std::int64_t h = slot - a.n_heads - a.n_kv_heads;
      x = a.v + t * a.stride_v + h * a.head_dim;
      bias = a.extras.v_bias != nullptr ? a.extras.v_bias + h * a.head_dim : nullptr;
      weight = nullptr;
    }
    if (bias == nullptr && weight == nullptr) continue;  // the same for the whole warp
    float vals[kMaxHeadPerLane];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxHeadPerLane; ++j) {
      const std::int64_t i = lane + j * detail::kWarp;
      vals[j] = 0.0f;
      if (i < a.head_dim) {
        vals[j] = bias != nullptr ? x[i] + bias[i] : x[i];
        sum += vals[j] * vals[j];
      }
    }
    float scale = 1.0f;
    if (weight != nullptr) {
      sum = detail::warp_sum(sum);
      scale = 1.0f / sqrtf(sum / static_cast<float>(a.head_dim) + a.extras.eps);
    }
#pragma unroll
    for (int j = 0; j < kMaxHeadPerLane; ++j) {
      const std::int64_t i = lane + j * detail::kWarp;
      if (i < a.head_dim) x[i] = weight != nullptr ? vals[j] * scale * weight[i] : vals[j];
    }
  }
}

// silu(g) * u, one expression for swiglu and swiglu_rows (their bits are the same).
__device__ __forceinline__ float swiglu_one(float g, float u) { return g / (1.0f + expf(-g)) * u; }

__global__ void swiglu_kernel(float* gate, const float* up, std::int64_t n) {
  for (std::int64_t i = grid_index(); i < n; i += grid_stride()) gate[i] = swiglu_one(gate[i], up[i]);
}

// out[t][i] = silu(gate[t][i]) * up[t][i], rows of `stride` in, of `width` out (swiglu's
// expression: the same bits).
__global__ void swiglu_rows_kernel(const float* gate, const float* up, std::int64_t n, std::int64_t width,
                                   std::int64_t stride, float* out) {
  const std::int64_t total = n * width;
  for (std::int64_t idx = grid_index(); idx < total; idx += grid_stride()) {
    const std::int64_t t = idx / width, i = idx % width;
    out[idx] = swiglu_one(gate[t * stride + i], up[t * stride + i]);
  }
}

__global__ void add_kernel(float* x, const float* y, std::int64_t n) {
  for (std::int64_t i = grid_index(); i < n; i += grid_stride()) x[i] += y[i];
}

// A negative row id gives a row of zeros (never a read out of bounds below the table).
__global__ void gather_rows_kernel(const float* __restrict__ src, const std::int32_t* __restrict__ rows,
                                   std::int64_t n, std::int64_t width, float* __restrict__ dst) {
  const std::int64_t total = n * width;
  for (std::int64_t idx = grid_index(); idx < total; idx += grid_stride()) {
    const std::int64_t i = idx / width, c = idx % width;
    const std::int32_t r = rows[i];
    dst[idx] = r >= 0 ? src[static_cast<std::int64_t>(r) * width + c] : 0.0f;
  }
}

// Element c of token t goes to pool[(block * block_size + pos % block_size) * width + c] with
// block = block_tables[seq * max_blocks + pos / block_size]. Padding tokens (seq < 0) and
// positions the table cannot hold (pos < 0, pos / block_size >= max_blocks, a negative block
// id) write nothing.
__global__ void store_f16_paged_kernel(const float* __restrict__ x, std::int64_t n, std::int64_t width,
                                       std::int64_t block_size,
                                       const std::int32_t* __restrict__ block_tables,
                                       std::int32_t max_blocks,
                                       const std::int32_t* __restrict__ sequence_of,
                                       const std::int32_t* __restrict__ positions,
                                       std::uint16_t* __restrict__ pool) {
  const std::int64_t total = n * width;
  for (std::int64_t idx = grid_index(); idx < total; idx += grid_stride()) {
    const std::int64_t t = idx / width, c = idx % width;
    const std::int64_t row = pool_row(t, block_size, block_tables, max_blocks, sequence_of, positions);
    if (row < 0) continue;
    // Round to nearest even, as the CPU's fp32_to_fp16.
    pool[row * width + c] = __half_as_ushort(__float2half_rn(x[idx]));
  }
}

}  // namespace

void rms_norm(const float* x, const float* weight, std::int64_t n, std::int64_t dim, float eps,
              float* out, cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return;
  rms_norm_kernel<<<row_grid(n), kThreads, 0, stream>>>(x, nullptr, nullptr, weight, n, dim, eps, out);
  detail::check_launch("rms_norm");
}

void add_rms_norm(float* x, const float* y, const float* weight, std::int64_t n,
                  std::int64_t dim, float eps, float* out, cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return;
  rms_norm_kernel<<<row_grid(n), kThreads, 0, stream>>>(nullptr, x, y, weight, n, dim, eps, out);
  detail::check_launch("add_rms_norm");
}

void rope(float* x, std::int64_t n, std::int64_t n_heads, std::int64_t head_dim,
          std::int64_t rot_dim, const std::int32_t* positions, float base, cudaStream_t stream,
          RopeStyle style, const float* freq_factors, float attn_factor) {
  if (rot_dim < 0 || rot_dim % 2 != 0 || rot_dim > head_dim) {
    throw std::invalid_argument("rope: rot_dim " + std::to_string(rot_dim) +
                                " must be even and at most head_dim " + std::to_string(head_dim));
  }
  const std::int64_t pairs = rot_dim / 2;
  if (n <= 0 || n_heads <= 0 || pairs == 0) return;
  rope_kernel<<<grid_for(n * pairs), kThreads, 0, stream>>>(
      x, n, n_heads, head_dim, pairs, rot_dim, positions, std::log(static_cast<double>(base)),
      style == RopeStyle::kHalves, freq_factors, attn_factor);
  detail::check_launch("rope");
}

void rope_store_kv(const QkvRows& in, std::int64_t n, std::int64_t n_heads, std::int64_t n_kv_heads,
                   std::int64_t head_dim, std::int64_t rot_dim, float base, const PagedBatch& batch,
                   float* q_out, std::uint16_t* k_pool, std::uint16_t* v_pool, cudaStream_t stream,
                   RopeStyle style, const float* freq_factors, float attn_factor) {
  if (head_dim <= 0 || head_dim % 2 != 0)
    throw std::invalid_argument("rope_store_kv: head_dim " + std::to_string(head_dim) + " must be even");
  if (rot_dim < 0 || rot_dim % 2 != 0 || rot_dim > head_dim) {
    throw std::invalid_argument("rope_store_kv: rot_dim " + std::to_string(rot_dim) +
                                " must be even and at most head_dim " + std::to_string(head_dim));
  }
  if (batch.block_size <= 0) throw std::invalid_argument("rope_store_kv: block_size must be positive");
  if (n_heads < 0 || n_kv_heads < 0 || in.stride_q < n_heads * head_dim || in.stride_k < n_kv_heads * head_dim ||
      in.stride_v < n_kv_heads * head_dim)
    throw std::invalid_argument("rope_store_kv: a row stride is smaller than its heads");
  if (n <= 0) return;
  const RopeStoreArgs a{in.q, in.k, in.v, in.stride_q, in.stride_k, in.stride_v, n, n_heads, n_kv_heads,
                        head_dim, rot_dim / 2, rot_dim, std::log(static_cast<double>(base)),
                        style == RopeStyle::kHalves, freq_factors, attn_factor, batch.block_size, batch.block_tables, batch.max_blocks, batch.sequence_of,
                        batch.positions, q_out, k_pool, v_pool};
  rope_store_kv_kernel<<<grid_for(n * (head_dim / 2)), kThreads, 0, stream>>>(a);
  detail::check_launch("rope_store_kv");
}

void qkv_bias_norm(float* q, float* k, float* v, std::int64_t stride_q, std::int64_t stride_k,
                   std::int64_t stride_v, std::int64_t n, std::int64_t n_heads, std::int64_t n_kv_heads,
                   std::int64_t head_dim, const QkvExtras& extras, cudaStream_t stream) {
  if (head_dim <= 0 || head_dim > kMaxHeadPerLane * detail::kWarp)
    throw std::invalid_argument("qkv_bias_norm: head_dim " + std::to_string(head_dim) + " must be in 1..256");
  if (n_heads < 0 || n_kv_heads < 0 || stride_q < n_heads * head_dim || stride_k < n_kv_heads * head_dim ||
      stride_v < n_kv_heads * head_dim)
    throw std::invalid_argument("qkv_bias_norm: a row stride is smaller than its heads");
  const bool any = extras.q_bias != nullptr || extras.k_bias != nullptr || extras.v_bias != nullptr ||
                   extras.q_norm != nullptr || extras.k_norm != nullptr;
  if (n <= 0 || !any) return;
  const BiasNormArgs a{q, k, v, stride_q, stride_k, stride_v, n, n_heads, n_kv_heads, head_dim, extras};
  const std::int64_t warps = n * (n_heads + 2 * n_kv_heads);
  qkv_bias_norm_kernel<<<grid_for(warps * detail::kWarp), kThreads, 0, stream>>>(a);
  detail::check_launch("qkv_bias_norm");
}

void swiglu_rows(const float* gate, const float* up, std::int64_t n, std::int64_t width, std::int64_t stride,
                 float* out, cudaStream_t stream) {
  if (stride < width) throw std::invalid_argument("swiglu_rows: stride is smaller than width");
  if (n <= 0 || width <= 0) return;
  swiglu_rows_kernel<<<grid_for(n * width), kThreads, 0, stream>>>(gate, up, n, width, stride, out);
  detail::check_launch("swiglu_rows");
}

void swiglu(float* gate, const float* up, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  swiglu_kernel<<<grid_for(n), kThreads, 0, stream>>>(gate, up, n);
  detail::check_launch("swiglu");
}

void add(float* x, const float* y, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, y, n);
  detail::check_launch("add");
}

void gather_rows(const float* src, const std::int32_t* rows, std::int64_t n, std::int64_t width,
                 float* dst, cudaStream_t stream) {
  if (n <= 0 || width <= 0) return;
  gather_rows_kernel<<<grid_for(n * width), kThreads, 0, stream>>>(src, rows, n, width, dst);
  detail::check_launch("gather_rows");
}

void store_f16_paged(const float* x, std::int64_t n, std::int64_t width, const PagedBatch& batch,
                     std::uint16_t* pool, cudaStream_t stream) {
  if (batch.block_size <= 0) throw std::invalid_argument("store_f16_paged: block_size must be positive");
  if (n <= 0 || width <= 0) return;
  store_f16_paged_kernel<<<grid_for(n * width), kThreads, 0, stream>>>(
      x, n, width, batch.block_size, batch.block_tables, batch.max_blocks, batch.sequence_of,
      batch.positions, pool);
  detail::check_launch("store_f16_paged");
}

}  // namespace batchlm::kernels::cuda
