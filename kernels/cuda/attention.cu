// Paged causal attention over the F16 KV pool (cuda.hpp attention_paged), F32 arithmetic with
// an online softmax.
//
// One kernel serves both batch shapes. A CTA (128 threads, 4 warps) takes, for one sequence s
// and one kv head, a tile of kRows = 16 "rows": the pairs (query j, head g of the kv head's
// group) numbered r = j * group + g, so that the query heads of a GQA group share every K/V
// tile the CTA loads (a decode token is one tile of `group` rows; a prefill chunk is
// ceil(queries * group / 16) tiles). Keys are walked in tiles of 32 positions staged in shared
// memory; each warp owns 4 rows, lane i owns key i of the tile for the scores and dims
// i, i + 32, ... (those below head_dim) of the rows' accumulators. head_dim is any multiple
// of 8 up to 256 (16-byte rows of halves): 64 and 128 as most models have, 80 and 96 too.
//
// Flash-decoding: when the grid of (sequence, row tile, kv head) CTAs is small (decode, or a
// short prefill over a long context), the context is also split: CTA z of `splits` handles the
// chunks of kChunk positions c = z, z + splits, z + 2 * splits, ... and writes its partial
// (max, sum, unnormalised accumulator) to scratch; a merge kernel combines the partials of each
// (token, head). The split count is a function of the host values only (n_seqs, max_queries,
// max_context, n_tokens, the shape), so attention_scratch_bytes and the launch agree, and a CTA whose
// chunks all lie past its sequence's real length does no work: a graph captured at the bounds
// replays correctly for any smaller batch. Without splits the kernel normalises and writes the
// output itself.
//
// Tokens that no sequence covers (padding: outside [query_start[0], query_start[n_seqs])) get a
// zero output (the merge kernel writes it, or a small kernel when there is no merge).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "common.cuh"

namespace batchlm::kernels::cuda {

namespace {

using detail::ceil_div;
using detail::kWarp;

constexpr int kThreads = 128;                   // 4 warps
constexpr int kWarps = kThreads / kWarp;
constexpr int kRowsPerWarp = 4;
constexpr int kRows = kWarps * kRowsPerWarp;    // 16 (query, head) rows per CTA
constexpr int kTile = kWarp;                    // 32 key positions per shared-memory tile
constexpr std::int64_t kChunk = 256;            // positions per split chunk (8 tiles)
constexpr int kMaxSplits = 64;                  // the merge's weights fit two per lane of a warp
constexpr std::int64_t kTargetCtas = 1024;      // split until the grid has about this many CTAs
// Partials (token, head, split) the scratch holds. attention_scratch_bytes is 0 (no split is
// possible: the context bound fits one chunk) or this many partials of head_dim + 2 floats,
// whatever the batch: the split count is capped so that n_tokens * n_heads * splits fits. A
// caller that sizes its scratch as the largest over a few extreme batch shapes thus covers
// every batch (the requirement never depends on the shape in between).
constexpr std::int64_t kMaxPartials = 16384;
constexpr int kMaxDim = 256;
constexpr int kMaxDimPerLane = kMaxDim / kWarp;  // 8 accumulator dims per lane and row
constexpr int kMergeThreads = 128;
static_assert(kChunk % kTile == 0, "a tile never straddles two chunks");
static_assert(kMaxSplits <= 2 * kWarp, "the merge computes split weights in one warp, two per lane");

// Dynamic shared memory of the main kernel for head dim d: q rows (F32), the K tile transposed
// and the V tile (F16). 192 * d bytes: 48 KiB at d = 256, the most a kernel may take without an
// opt-in attribute.
constexpr std::size_t smem_bytes(int d) {
  return static_cast<std::size_t>(kRows) * d * sizeof(float) +
         2 * static_cast<std::size_t>(kTile) * d * sizeof(std::uint16_t);
}
static_assert(smem_bytes(kMaxDim) <= 48 * 1024, "fits without cudaFuncSetAttribute");

struct Params {
  const float* q = nullptr;
  float* out = nullptr;
  float* part_acc = nullptr;  // [n_tokens * n_heads][splits][head_dim]   (splits > 1)
  float* part_ml = nullptr;   // [n_tokens * n_heads][splits][2]: max, sum (splits > 1)
  const std::uint16_t* k_pool = nullptr;
  const std::uint16_t* v_pool = nullptr;
  const std::int32_t* block_tables = nullptr;
  const std::int32_t* query_start = nullptr;
  const std::int32_t* first_position = nullptr;
  std::int64_t kv_stride = 0;
  std::int64_t block_size = 0;
  std::int64_t n_tokens = 0;
  std::int32_t max_blocks = 0;
  std::int32_t n_seqs = 0;
  std::int32_t n_heads = 0;
  std::int32_t group = 0;       // n_heads / n_kv_heads
  std::int32_t head_dim = 0;    // a multiple of 8, at most 256
  std::int32_t row_tiles = 0;   // row tiles per sequence in the grid (>= 1)
  std::int32_t splits = 1;      // gridDim.z
  float scale = 1.0f;
  bool vec = false;             // K/V rows are 16-byte aligned: load 8 halves at once
};

__device__ __forceinline__ float h2f(std::uint16_t h) { return detail::half_bits_to_float(h); }

// Offset in the pool (elements) of position p of sequence s, kv head kvh; -1 when the block
// table cannot resolve it (p < 0, past the table's row, a negative block id): such a position
// is treated as absent (zero K/V, masked score) rather than read out of bounds.
__device__ __forceinline__ std::int64_t kv_offset(const Params& P, int s, std::int64_t p, int kvh) {
  if (p < 0) return -1;
  const std::int64_t slot = p / P.block_size;
  if (slot >= P.max_blocks) return -1;
  const std::int64_t block = P.block_tables[static_cast<std::int64_t>(s) * P.max_blocks + slot];
  if (block < 0) return -1;
  return (block * P.block_size + p % P.block_size) * P.kv_stride +
         static_cast<std::int64_t>(kvh) * P.head_dim;
}

// Eight consecutive halves (group cg of a row) as raw bits; zeros when offset < 0.
__device__ __forceinline__ uint4 load8(const std::uint16_t* pool, std::int64_t offset, int cg, bool vec) {
  uint4 r = make_uint4(0u, 0u, 0u, 0u);
  if (offset < 0) return r;
  const std::uint16_t* src = pool + offset + static_cast<std::int64_t>(cg) * 8;
  if (vec) return *reinterpret_cast<const uint4*>(src);  // 16-byte aligned (checked on the host)
  std::uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = static_cast<std::uint32_t>(src[2 * e]) | (static_cast<std::uint32_t>(src[2 * e + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stages positions [p0, p0 + kTile) of sequence s (those < p_end; the others are zeros) for
// kv head kvh: kt_s[d * kTile + i] = K[p0 + i][d] (transposed, so that lane i reading key i
// at dim d hits consecutive halves: no bank conflicts), v_s[i * D + d] = V[p0 + i][d].
__device__ void load_tile(const Params& P, int s, int kvh, std::int64_t p0, std::int64_t p_end,
                          std::uint16_t* kt_s, std::uint16_t* v_s) {
  const int D = P.head_dim;
  const int groups = D / 8;  // 8-half groups per row
  const int items = kTile * groups;
  // K: consecutive threads take consecutive keys of one group, so a warp's 2-byte stores to
  // kt_s are 32 consecutive halves.
  for (int item = threadIdx.x; item < items; item += kThreads) {
    const int i = item % kTile, cg = item / kTile;
    const std::int64_t p = p0 + i;
    const std::int64_t off = p < p_end ? kv_offset(P, s, p, kvh) : -1;
    const uint4 raw = load8(P.k_pool, off, cg, P.vec);
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      kt_s[(cg * 8 + 2 * e) * kTile + i] = static_cast<std::uint16_t>(w[e] & 0xffffu);
      kt_s[(cg * 8 + 2 * e + 1) * kTile + i] = static_cast<std::uint16_t>(w[e] >> 16);
    }
  }
  // V: consecutive threads take consecutive groups of one row (coalesced 16-byte loads and
  // stores; v_s + i * D + cg * 8 is 16-byte aligned since D is a multiple of 8).
  for (int item = threadIdx.x; item < items; item += kThreads) {
    const int i = item / groups, cg = item % groups;
    const std::int64_t p = p0 + i;
    const std::int64_t off = p < p_end ? kv_offset(P, s, p, kvh) : -1;
    *reinterpret_cast<uint4*>(v_s + i * D + cg * 8) = load8(P.v_pool, off, cg, P.vec);
  }
}

// Grid: x = sequence * row_tiles + first row tile, y = kv head, z = split. 128 threads.
__global__ void __launch_bounds__(kThreads, 4) attention_kernel(const Params P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = P.head_dim;
  float* q_s = reinterpret_cast<float*>(smem_raw);                              // [kRows][D]
  std::uint16_t* kt_s = reinterpret_cast<std::uint16_t*>(q_s + kRows * D);      // [D][kTile]
  std::uint16_t* v_s = kt_s + D * kTile;                                        // [kTile][D]

  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int s = static_cast<int>(blockIdx.x / static_cast<unsigned>(P.row_tiles));
  const int rt_first = static_cast<int>(blockIdx.x % static_cast<unsigned>(P.row_tiles));
  const int kvh = static_cast<int>(blockIdx.y);
  const std::int64_t z = blockIdx.z;
  const std::int64_t splits = P.splits;
  // Everything below up to the row-tile loop is uniform over the CTA, so are the loops that
  // contain __syncthreads (they depend on s, rt, z and the sequence's sizes only).
  if (s >= P.n_seqs) return;
  const std::int64_t q0 = P.query_start[s];
  const std::int64_t nq = static_cast<std::int64_t>(P.query_start[s + 1]) - q0;
  const std::int64_t first_pos = P.first_position[s];
  if (nq <= 0) return;  // an empty (padding) sequence
  const std::int64_t group = P.group;
  const std::int64_t rows_total = nq * group;
  // Accumulator dims per lane and row, 1..8: dims e * 32 + lane for e < nd, those below D.
  const int nd = (D + kWarp - 1) / kWarp;

  // Row tiles rt_first, rt_first + row_tiles, ...: one pass when max_queries bounds nq.
  for (std::int64_t rt = rt_first; rt * kRows < rows_total; rt += P.row_tiles) {
    const std::int64_t r0 = rt * kRows;
    const std::int64_t r_end = r0 + kRows < rows_total ? r0 + kRows : rows_total;
    // Positions [0, ctx) are seen by some row of the tile (its last row sees the most).
    const std::int64_t ctx = first_pos + (r_end - 1) / group + 1;
    // A split whose chunks all lie past the context has nothing to do (the merge reads only
    // the partials of splits z with z * kChunk < a row's context <= ctx). Uniform over the CTA.
    // Without splits the rows must still be written (zeros when ctx <= 0).
    if (splits > 1 && z * kChunk >= ctx) continue;

    // This warp's rows: row warp * 4 + i of the tile. Query j sees positions [0, row_ctx).
    bool row_ok[kRowsPerWarp];
    std::int64_t row_ctx[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const std::int64_t r = r0 + warp * kRowsPerWarp + i;
      const std::int64_t j = r / group;
      row_ok[i] = r < r_end && q0 + j < P.n_tokens && q0 + j >= 0;
      row_ctx[i] = first_pos + j + 1;
    }

    __syncthreads();  // the previous row tile is done with q_s
    for (int idx = threadIdx.x; idx < kRows * D; idx += kThreads) {
      const std::int64_t r = r0 + idx / D;
      const int d = idx % D;
      float v = 0.0f;
      if (r < r_end) {
        const std::int64_t t = q0 + r / group;
        const std::int64_t h = static_cast<std::int64_t>(kvh) * group + r % group;
        if (t >= 0 && t < P.n_tokens) v = P.q[(t * P.n_heads + h) * D + d];
      }
      q_s[idx] = v;
    }
    __syncthreads();

    float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kMaxDimPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      m[i] = -INFINITY;
      l[i] = 0.0f;
#pragma unroll
      for (int e = 0; e < kMaxDimPerLane; ++e) acc[i][e] = 0.0f;
    }

    for (std::int64_t c = z; c * kChunk < ctx; c += splits) {
      const std::int64_t c_end = (c + 1) * kChunk < ctx ? (c + 1) * kChunk : ctx;
      for (std::int64_t p0 = c * kChunk; p0 < c_end; p0 += kTile) {
        __syncthreads();  // every warp is done with the previous tile
        load_tile(P, s, kvh, p0, c_end, kt_s, v_s);
        __syncthreads();

        // Scores of this lane's key against the warp's 4 rows.
        const std::int64_t p = p0 + lane;
        const bool key_ok = p < c_end && kv_offset(P, s, p, kvh) >= 0;
        float sc[kRowsPerWarp] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float* qw = q_s + warp * kRowsPerWarp * D;
#pragma unroll 1  // unrolling this loop costs ~40 registers (and spills) for no gain
        for (int d = 0; d < D; d += 4) {
          const float k0 = h2f(kt_s[(d + 0) * kTile + lane]);
          const float k1 = h2f(kt_s[(d + 1) * kTile + lane]);
          const float k2 = h2f(kt_s[(d + 2) * kTile + lane]);
          const float k3 = h2f(kt_s[(d + 3) * kTile + lane]);
#pragma unroll
          for (int i = 0; i < kRowsPerWarp; ++i) {
            const float4 qv = *reinterpret_cast<const float4*>(qw + i * D + d);  // broadcast
            sc[i] = fmaf(qv.x, k0, sc[i]);
            sc[i] = fmaf(qv.y, k1, sc[i]);
            sc[i] = fmaf(qv.z, k2, sc[i]);
            sc[i] = fmaf(qv.w, k3, sc[i]);
          }
        }

        // Online softmax per row; every lane takes part in the shuffles.
        float prob[kRowsPerWarp];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const bool ok = key_ok && row_ok[i] && p < row_ctx[i];
          const float sv = ok ? sc[i] * P.scale : -INFINITY;
          const float m_new = fmaxf(m[i], detail::warp_max(sv));  // the same in every lane
          float corr = 1.0f, pr = 0.0f;
          if (m_new != -INFINITY) {       // some key of this row is valid by now
            corr = expf(m[i] - m_new);    // 0 while m[i] is still -inf
            pr = ok ? expf(sv - m_new) : 0.0f;
          }
          l[i] = l[i] * corr + detail::warp_sum(pr);
          m[i] = m_new;
#pragma unroll
          for (int e = 0; e < kMaxDimPerLane; ++e)
            if (e < nd) acc[i][e] *= corr;
          prob[i] = pr;
        }

        // acc[i][e] += sum over the tile's keys k of prob_k * V[k][e * 32 + lane].
#pragma unroll 4
        for (int k = 0; k < kTile; ++k) {
          float w[kRowsPerWarp];
#pragma unroll
          for (int i = 0; i < kRowsPerWarp; ++i) w[i] = __shfl_sync(0xffffffffu, prob[i], k);
#pragma unroll
          for (int e = 0; e < kMaxDimPerLane; ++e) {
            if (e < nd && e * kWarp + lane < D) {
              const float v = h2f(v_s[k * D + e * kWarp + lane]);
#pragma unroll
              for (int i = 0; i < kRowsPerWarp; ++i) acc[i][e] = fmaf(w[i], v, acc[i][e]);
            }
          }
        }
      }
    }

    // The rows' results: normalised output (no split) or the partial of split z.
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      if (!row_ok[i]) continue;
      const std::int64_t r = r0 + warp * kRowsPerWarp + i;
      const std::int64_t t = q0 + r / group;
      const std::int64_t item = t * P.n_heads + static_cast<std::int64_t>(kvh) * group + r % group;
      if (splits == 1) {
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;  // l == 0: no position (bad input)
        float* o = P.out + item * D;
#pragma unroll
        for (int e = 0; e < kMaxDimPerLane; ++e)
          if (e < nd && e * kWarp + lane < D) o[e * kWarp + lane] = acc[i][e] * inv;
      } else {
        const std::int64_t part = item * splits + z;
        float* a = P.part_acc + part * D;
#pragma unroll
        for (int e = 0; e < kMaxDimPerLane; ++e)
          if (e < nd && e * kWarp + lane < D) a[e * kWarp + lane] = acc[i][e];
        if (lane == 0) {
          P.part_ml[2 * part] = m[i];
          P.part_ml[2 * part + 1] = l[i];
        }
      }
    }
  }
}

// The sequence whose query range holds token t, or -1 for padding. query_start is
// non-decreasing (sequences are contiguous ranges in order; empty ranges are padding).
__device__ int sequence_of_token(const std::int32_t* query_start, int n_seqs, std::int64_t t) {
  if (n_seqs <= 0 || t < query_start[0] || t >= query_start[n_seqs]) return -1;
  int lo = 0, hi = n_seqs;  // invariant: query_start[lo] <= t < query_start[hi]
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (query_start[mid] <= t) lo = mid;
    else hi = mid;
  }
  return lo;
}

// One CTA per (token, head) item (grid-stride): combines the partials of the splits that can
// hold positions of the token (z * kChunk < its context: the main kernel wrote exactly those,
// and maybe others), or writes zeros for padding tokens.
__global__ void __launch_bounds__(kMergeThreads) attention_merge_kernel(const Params P) {
  __shared__ float weight_s[kMaxSplits];
  const int D = P.head_dim;
  const std::int64_t splits = P.splits;
  const std::int64_t items = P.n_tokens * P.n_heads;
  for (std::int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const std::int64_t t = item / P.n_heads;
    float* o = P.out + item * D;
    const int s = sequence_of_token(P.query_start, P.n_seqs, t);
    if (s < 0) {
      for (int d = threadIdx.x; d < D; d += kMergeThreads) o[d] = 0.0f;
      continue;  // uniform over the CTA
    }
    const std::int64_t ctx = static_cast<std::int64_t>(P.first_position[s]) + (t - P.query_start[s]) + 1;
    const std::int64_t valid = ctx <= 0 ? 0 : std::min<std::int64_t>(splits, ceil_div(ctx, kChunk));
    const std::int64_t part0 = item * splits;

    __syncthreads();  // the previous item is done with weight_s
    if (threadIdx.x < kWarp) {
      const int lane = threadIdx.x;
      float mz[2], lz[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int zz = lane + k * kWarp;
        mz[k] = zz < valid ? P.part_ml[2 * (part0 + zz)] : -INFINITY;
        lz[k] = zz < valid ? P.part_ml[2 * (part0 + zz) + 1] : 0.0f;
      }
      const float mx = detail::warp_max(fmaxf(mz[0], mz[1]));
      float e[2] = {0.0f, 0.0f};
      if (mx != -INFINITY) {
#pragma unroll
        for (int k = 0; k < 2; ++k) e[k] = mz[k] != -INFINITY ? expf(mz[k] - mx) : 0.0f;
      }
      const float den = detail::warp_sum(e[0] * lz[0] + e[1] * lz[1]);
      const float inv = den > 0.0f ? 1.0f / den : 0.0f;
#pragma unroll
      for (int k = 0; k < 2; ++k) weight_s[lane + k * kWarp] = e[k] * inv;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += kMergeThreads) {
      float sum = 0.0f;
      for (std::int64_t zz = 0; zz < valid; ++zz) {
        const float w = weight_s[zz];
        if (w != 0.0f) sum = fmaf(w, P.part_acc[(part0 + zz) * D + d], sum);
      }
      o[d] = sum;
    }
  }
}

// Without splits: zeros for the padding tokens (the main kernel writes every covered token).
__global__ void attention_zero_padding_kernel(float* out, const std::int32_t* query_start, int n_seqs,
                                              std::int64_t n_tokens, std::int64_t row) {
  for (std::int64_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
    const bool covered = n_seqs > 0 && t >= query_start[0] && t < query_start[n_seqs];
    if (covered) continue;
    for (std::int64_t i = threadIdx.x; i < row; i += blockDim.x) out[t * row + i] = 0.0f;
  }
}

struct Plan {
  std::int32_t group = 1;
  std::int32_t row_tiles = 1;
  std::int32_t splits = 1;
  std::int64_t acc_floats = 0;  // scratch: partial accumulators, then (max, sum) pairs
  std::int64_t ml_floats = 0;
  std::size_t scratch_bytes = 0;
};

// The launch shape, from the host bounds only. Throws std::invalid_argument for shapes the
// kernels do not take.
Plan make_plan(const AttentionBatch& b, std::int64_t n_tokens) {
  const AttentionShape& sh = b.shape;
  auto bad = [](const std::string& why) { throw std::invalid_argument("attention_paged: " + why); };
  if (sh.head_dim < 8 || sh.head_dim > kMaxDim || sh.head_dim % 8 != 0)
    bad("head_dim " + std::to_string(sh.head_dim) + " is not a multiple of 8 in [8, 256]");
  if (sh.n_heads <= 0 || sh.n_kv_heads <= 0 || sh.n_heads % sh.n_kv_heads != 0)
    bad("n_heads must be a positive multiple of n_kv_heads");
  if (sh.n_heads > std::numeric_limits<std::int32_t>::max() || sh.n_kv_heads > 65535)
    bad("too many heads");
  if (sh.kv_stride < sh.n_kv_heads * sh.head_dim) bad("kv_stride is smaller than n_kv_heads * head_dim");
  if (b.block_size <= 0) bad("block_size must be positive");
  if (b.n_seqs < 0 || b.max_queries < 0 || b.max_context < 0 || b.max_blocks < 0 || n_tokens < 0)
    bad("negative bound");
  Plan p;
  p.group = static_cast<std::int32_t>(sh.n_heads / sh.n_kv_heads);
  const std::int64_t queries = std::max<std::int32_t>(b.max_queries, 1);
  p.row_tiles = static_cast<std::int32_t>(std::max<std::int64_t>(1, ceil_div(queries * p.group, kRows)));
  const std::int64_t grid_x = static_cast<std::int64_t>(b.n_seqs) * p.row_tiles;
  if (grid_x > std::numeric_limits<std::int32_t>::max()) bad("too many sequences x queries");
  const std::int64_t base = std::max<std::int64_t>(1, grid_x * sh.n_kv_heads);
  const std::int64_t chunks = std::max<std::int64_t>(1, ceil_div(b.max_context, kChunk));
  if (chunks > 1) {
    // Scratch for kMaxPartials partials: accumulators first, then the (max, sum) pairs.
    p.acc_floats = kMaxPartials * sh.head_dim;
    p.ml_floats = kMaxPartials * 2;
    p.scratch_bytes = static_cast<std::size_t>(ceil_div((p.acc_floats + p.ml_floats) * 4, 256) * 256);
    const std::int64_t fit = kMaxPartials / std::max<std::int64_t>(1, n_tokens * sh.n_heads);
    if (base < kTargetCtas)
      p.splits = static_cast<std::int32_t>(std::clamp<std::int64_t>(
          std::min<std::int64_t>({chunks, kMaxSplits, ceil_div(kTargetCtas, base), fit}), 1, kMaxSplits));
  }
  return p;
}

unsigned capped_grid(std::int64_t items) {
  return static_cast<unsigned>(std::clamp<std::int64_t>(items, 1, 65536));
}

}  // namespace

std::size_t attention_scratch_bytes(const AttentionBatch& batch, std::int64_t n_tokens) {
  return make_plan(batch, n_tokens).scratch_bytes;
}

void attention_paged(const AttentionBatch& batch, const float* q, std::int64_t n_tokens,
                     float* out, void* scratch, cudaStream_t stream) {
  const Plan plan = make_plan(batch, n_tokens);
  if (n_tokens <= 0) return;
  const AttentionShape& sh = batch.shape;
  const std::int64_t row = sh.n_heads * sh.head_dim;
  if (batch.n_seqs == 0) {  // every token is padding
    attention_zero_padding_kernel<<<capped_grid(n_tokens), kThreads, 0, stream>>>(
        out, batch.query_start, 0, n_tokens, row);
    detail::check_launch("attention_paged (padding)");
    return;
  }
  if (plan.splits > 1 && scratch == nullptr)
    throw std::invalid_argument("attention_paged: no scratch (attention_scratch_bytes > 0)");

  Params P;
  P.q = q;
  P.out = out;
  if (plan.splits > 1) {
    P.part_acc = static_cast<float*>(scratch);
    P.part_ml = P.part_acc + plan.acc_floats;
  }
  P.k_pool = batch.k_pool;
  P.v_pool = batch.v_pool;
  P.block_tables = batch.block_tables;
  P.query_start = batch.query_start;
  P.first_position = batch.first_position;
  P.kv_stride = sh.kv_stride;
  P.block_size = batch.block_size;
  P.n_tokens = n_tokens;
  P.max_blocks = batch.max_blocks;
  P.n_seqs = batch.n_seqs;
  P.n_heads = static_cast<std::int32_t>(sh.n_heads);
  P.group = plan.group;
  P.head_dim = static_cast<std::int32_t>(sh.head_dim);
  P.row_tiles = plan.row_tiles;
  P.splits = plan.splits;
  P.scale = sh.scale;
  const auto aligned16 = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  P.vec = sh.kv_stride % 8 == 0 && aligned16(batch.k_pool) && aligned16(batch.v_pool);

  const dim3 grid(static_cast<unsigned>(static_cast<std::int64_t>(batch.n_seqs) * plan.row_tiles),
                  static_cast<unsigned>(sh.n_kv_heads), static_cast<unsigned>(plan.splits));
  attention_kernel<<<grid, kThreads, smem_bytes(P.head_dim), stream>>>(P);
  detail::check_launch("attention_paged");
  if (plan.splits > 1) {
    attention_merge_kernel<<<capped_grid(n_tokens * sh.n_heads), kMergeThreads, 0, stream>>>(P);
    detail::check_launch("attention_paged (merge)");
  } else {
    attention_zero_padding_kernel<<<capped_grid(n_tokens), kThreads, 0, stream>>>(
        out, batch.query_start, batch.n_seqs, n_tokens, row);
    detail::check_launch("attention_paged (padding)");
  }
}

}  // namespace batchlm::kernels::cuda
