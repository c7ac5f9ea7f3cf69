// Weight upload, matrix products and embedding lookup on the GPU (cuda.hpp).
//
// Three kinds of kernels, all reading the device layout of quant.cuh (quants and scales apart,
// every row a whole number of aligned 16-byte chunks):
//
// - matvec_kernel<T, N, R> (n <= kMatvecMaxTokens): 4-warp blocks; a row group of R
//   consecutive rows is shared by `splits` warps (1, 2 or 4, chosen on the host so that small
//   matrices still put enough loads in flight). Lane l of slice s walks the chunks
//   s * 32 + l, stepping by splits * 32 (one 16-byte load per row per step: a warp reads 512
//   contiguous bytes of each row), dequantizes in registers and multiplies with the N tokens
//   of x (float4 loads through L1: one x load serves R rows). Quantized chunks are first
//   summed with the integer quants, then scaled once per chunk: acc += d * sum(q * x)
//   (+ m * sum(x) for Q4_1). Lanes are reduced with shuffles, the slices of a group in shared
//   memory (fixed order: deterministic), and every row of the grid is written.
// - tc_kernel<T> (n > kMatvecMaxTokens): x is converted to F16 in `scratch` first
//   (f32_to_f16_kernel); each block computes a 128-row x 64-token tile of y with WMMA
//   16x16x16 F16 fragments and F32 accumulators, stepping through cols 32 at a time (one
//   quant block per row and step). The weight tile is dequantized to F16 in shared memory,
//   double-buffered with one __syncthreads per step (global loads for step k+1 are issued
//   before the MMAs of step k). The result goes through shared memory to y with bounds
//   checks, so rows and n need not be multiples of the tile. When the matrix has few tiles
//   (few rows and tokens), the cols are split over blockIdx.z and the partial tiles summed by
//   split_sum_kernel in a fixed order (tc_plan), so that small products fill the device.
// - get_rows_kernel<T>: one thread per (id, chunk), dequantizing with the same rounding as the
//   CPU (__fmul_rn/__fadd_rn: no FMA contraction), so the result is bit-exact.
//
// Requirements checked on the host (std::invalid_argument): a supported type, cols a positive
// multiple of 32 (for every type, F16/BF16/F32 included), w.data, x, out and scratch 16-byte
// aligned (cudaMalloc gives 256), scratch present when n > kMatvecMaxTokens.

#include <mma.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.cuh"
#include "quant.cuh"

namespace batchlm::kernels::cuda {

namespace detail {
namespace {

// ---------------------------------------------------------------------------------------------
// Matrix-vector kernels.

inline constexpr int kMvWarps = 4;                 // warps per block
inline constexpr int kMvThreads = kMvWarps * kWarp;

// Rows per warp: more rows reuse each x load more often (fewer L1 loads per FMA), at the cost
// of registers (R * N accumulators, twice that for quantized types).
template <int N>
constexpr int mv_rows_per_warp() {
  return N <= 4 ? 4 : 2;
}
// Blocks per SM the register allocation must allow (__launch_bounds__): one token is
// memory-bound and wants occupancy (6 blocks: at most 85 registers); more tokens are more
// compute than memory and get more registers (4 blocks: 128; 3 blocks: 170) rather than spill.
template <int N>
constexpr int mv_min_blocks() {
  return N == 1 ? 6 : N <= 4 ? 4 : 3;
}

template <DType T, int N, int R>
__global__ void __launch_bounds__(kMvThreads, mv_min_blocks<N>())
    matvec_kernel(const uint4* __restrict__ quants, const void* __restrict__ scales,
                  std::int64_t rows, std::int64_t chunks_per_row, std::int64_t blocks_per_row,
                  const float* __restrict__ x, std::int64_t cols, float* __restrict__ y,
                  int splits) {
  using C = Chunk<T>;
  // The block's warps form kMvWarps / splits row groups of R rows; the `splits` warps of a
  // group share its rows, warp `slice` taking the chunks slice * 32 + lane, stepping by
  // splits * 32 (each warp still reads 512 contiguous bytes of a row per step). Their sums
  // meet in shared memory at the end.
  __shared__ float partial[kMvWarps][R][N];
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int groups = kMvWarps / splits;  // splits is 1, 2 or 4 (checked on the host)
  const int group = warp / splits, slice = warp % splits;
  const std::int64_t block_row0 = static_cast<std::int64_t>(blockIdx.x) * groups * R;
  const std::int64_t row0 = block_row0 + static_cast<std::int64_t>(group) * R;
  // A row group past the end (in the last block) does no work but still reaches the
  // __syncthreads below: no thread leaves early.
  // 32-bit chunk indices: chunks_per_row <= cols / 4 <= 2^28 (cols checked on the host).
  const int chunk_end = row0 < rows ? static_cast<int>(chunks_per_row) : 0;

  // Rows past the end are clamped to the last row: their loads stay in bounds and their
  // results are never written.
  const uint4* wrow[R];
  std::int64_t srow[R];  // index of the row's first block scale
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const std::int64_t rr = min(row0 + r, rows - 1);
    wrow[r] = quants + rr * chunks_per_row;
    srow[r] = rr * blocks_per_row;
  }

  const float4* x4 = reinterpret_cast<const float4*>(x);
  const std::int64_t x4_stride = cols / 4;  // float4s per token (cols % 32 == 0)

  float acc[R][N];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < N; ++t) acc[r][t] = 0.0f;

  const int step = splits * kWarp;
  // Not unrolled: the registers stay few (occupancy, not unrolling, keeps loads in flight).
#pragma unroll 1
  for (int c = slice * kWarp + lane; c < chunk_end; c += step) {
    uint4 raw[R];
    BlockScale bs[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      raw[r] = __ldg(wrow[r] + c);
      // The block of chunk c: c * E / 32 (Q4: c, Q8_0: c / 2).
      if constexpr (C::kScaled) {
        bs[r] = load_scale<T>(scales,
                              srow[r] + static_cast<std::int64_t>(c) * C::kElems / kBlockElems);
      }
    }
    // x of chunk c, quad i, token t: float4 index t * x4_stride + c * kQuads + i
    // (elements c * E + 4i .. + 3), in bounds since c < chunks_per_row = cols / E.
    const float4* xc = x4 + c * C::kQuads;

    if constexpr (C::kScaled) {
      // Sum the integer quants times x over the chunk (one scale per chunk), then scale.
      float part[R][N];
      float xsum[N];
#pragma unroll
      for (int t = 0; t < N; ++t) {
        xsum[t] = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) part[r][t] = 0.0f;
      }
#pragma unroll
      for (int i = 0; i < C::kQuads; ++i) {
        float w[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r) C::quad(raw[r], i, w[r]);
#pragma unroll
        for (int t = 0; t < N; ++t) {
          const float4 xv = __ldg(xc + t * x4_stride + i);
          if constexpr (C::kHasMin) xsum[t] += (xv.x + xv.y) + (xv.z + xv.w);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float s = part[r][t];
            s = fmaf(w[r][0], xv.x, s);
            s = fmaf(w[r][1], xv.y, s);
            s = fmaf(w[r][2], xv.z, s);
            s = fmaf(w[r][3], xv.w, s);
            part[r][t] = s;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < N; ++t) {
          acc[r][t] = fmaf(bs[r].d, part[r][t], acc[r][t]);
          if constexpr (C::kHasMin) acc[r][t] = fmaf(bs[r].m, xsum[t], acc[r][t]);
        }
    } else {
#pragma unroll
      for (int i = 0; i < C::kQuads; ++i) {
        float w[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r) C::quad(raw[r], i, w[r]);
#pragma unroll
        for (int t = 0; t < N; ++t) {
          const float4 xv = __ldg(xc + t * x4_stride + i);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float s = acc[r][t];
            s = fmaf(w[r][0], xv.x, s);
            s = fmaf(w[r][1], xv.y, s);
            s = fmaf(w[r][2], xv.z, s);
            s = fmaf(w[r][3], xv.w, s);
            acc[r][t] = s;
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < N; ++t) {
      const float v = warp_sum(acc[r][t]);  // all 32 lanes of every warp are here
      if (lane == 0) partial[warp][r][t] = v;
    }
  __syncthreads();
  // One thread per (group, row, token) adds the group's slices in a fixed order.
  for (int i = static_cast<int>(threadIdx.x); i < groups * R * N; i += kMvThreads) {
    const int g = i / (R * N), r = (i / N) % R, t = i % N;
    const std::int64_t row = block_row0 + static_cast<std::int64_t>(g) * R + r;
    if (row < rows) {
      float v = 0.0f;
      for (int sl = 0; sl < splits; ++sl) v += partial[g * splits + sl][r][t];
      y[t * rows + row] = v;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core kernel.

namespace wmma = nvcuda::wmma;

inline constexpr int kTcM = 128;   // weight rows per block
inline constexpr int kTcN = 64;    // tokens per block
inline constexpr int kTcK = 32;    // cols per step: one quant block
inline constexpr int kTcThreads = 256;  // 8 warps: 4 along rows x 2 along tokens, 32x32 each
inline constexpr int kTcLds = kTcK + 8;  // smem row stride of the A and B tiles, in halfs
inline constexpr int kTcLdc = kTcM + 4;  // smem row stride of the C tile, in floats
// WMMA needs 32-byte aligned fragment pointers and ldm a multiple of 8 halfs / 4 floats:
// fragment rows start at multiples of 16 rows: 16 * 40 * 2 = 1280 bytes and 16 * 132 * 4 =
// 8448 bytes are multiples of 32; k offsets 0 and 16 halfs are 0 and 32 bytes.
static_assert(kTcLds % 8 == 0 && (16 * kTcLds * 2) % 32 == 0);
static_assert(kTcLdc % 4 == 0 && (16 * kTcLdc * 4) % 32 == 0);
inline constexpr int kTcABytes = 2 * kTcM * kTcLds * 2;  // two buffers
inline constexpr int kTcBBytes = 2 * kTcN * kTcLds * 2;
inline constexpr int kTcCBytes = kTcN * kTcLdc * 4;
inline constexpr int kTcSmemBytes =
    std::max(kTcABytes + kTcBBytes, kTcCBytes);  // C reuses the A/B space after the k loop
static_assert(kTcSmemBytes <= 48 * 1024, "static shared memory limit");
static_assert((kTcM * kTcLds * 2) % 32 == 0 && (kTcN * kTcLds * 2) % 32 == 0 &&
              kTcABytes % 32 == 0);
// Loader roles: A: thread = (row tid / 2, half tid % 2) -> 16 elements of one row;
// B: thread = (token tid / 4, part tid % 4) -> 8 halfs of one token.
static_assert(kTcThreads == 2 * kTcM && kTcThreads == 4 * kTcN && kTcK == 32);

__device__ __forceinline__ std::uint32_t pack_half2(float a, float b) {
  return static_cast<std::uint32_t>(__half_as_ushort(__float2half_rn(a))) |
         (static_cast<std::uint32_t>(__half_as_ushort(__float2half_rn(b))) << 16);
}

// One thread's part of a weight tile step: elements 16h .. 16h + 15 of block kb of one row,
// loaded raw (load), then dequantized to F16 into shared memory (store).
template <DType T>
struct TcA {
  using C = Chunk<T>;
  // Chunks a thread loads: Q4 (E = 32): the block's single chunk (both halves load it and take
  // their nibbles); otherwise 16 / E chunks.
  static constexpr int kChunks = C::kElems >= 16 ? 1 : 16 / C::kElems;
  uint4 raw[kChunks];
  BlockScale bs;

  __device__ __forceinline__ void load(const uint4* __restrict__ quants,
                                       const void* __restrict__ scales, std::int64_t row,
                                       std::int64_t chunks_per_row, std::int64_t blocks_per_row,
                                       std::int64_t kb, int h) {
    // First chunk of block kb: kb * 32 / E; this half's chunks start 16h / E further (not for
    // Q4, whose one chunk holds both halves).
    std::int64_t first = row * chunks_per_row + kb * (kBlockElems / C::kElems);
    if constexpr (C::kElems < kBlockElems) first += h * (16 / C::kElems);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) raw[j] = __ldg(quants + first + j);
    if constexpr (C::kScaled) bs = load_scale<T>(scales, row * blocks_per_row + kb);
  }

  // dst: 16 halfs, 16-byte aligned.
  __device__ __forceinline__ void store(__half* dst, int h) const {
    if constexpr (T == DType::F16) {
      // Already F16: copy the bits (kChunks == 2).
      reinterpret_cast<uint4*>(dst)[0] = raw[0];
      reinterpret_cast<uint4*>(dst)[1] = raw[1];
    } else {
      float v[16];
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // quad q: elements 16h + 4q .. + 3
        float w[4];
        if constexpr (C::kQuads == 8) {
          C::quad(raw[0], 4 * h + q, w);  // Q4: quads 4h .. 4h + 3 of the block
        } else {
          C::quad(raw[q / C::kQuads], q % C::kQuads, w);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          float e = w[k];
          if constexpr (C::kHasMin) {
            e = fmaf(bs.d, e, bs.m);
          } else if constexpr (C::kScaled) {
            e = bs.d * e;
          }
          v[4 * q + k] = e;
        }
      }
      uint4 lo, hi;
      lo.x = pack_half2(v[0], v[1]);
      lo.y = pack_half2(v[2], v[3]);
      lo.z = pack_half2(v[4], v[5]);
      lo.w = pack_half2(v[6], v[7]);
      hi.x = pack_half2(v[8], v[9]);
      hi.y = pack_half2(v[10], v[11]);
      hi.z = pack_half2(v[12], v[13]);
      hi.w = pack_half2(v[14], v[15]);
      reinterpret_cast<uint4*>(dst)[0] = lo;
      reinterpret_cast<uint4*>(dst)[1] = hi;
    }
  }
};

// out[z * n * rows + t * rows + r] for the tile (blockIdx.x: tokens, blockIdx.y: rows) and the
// k range of split z = blockIdx.z: steps [z * k_per_split, min(+ k_per_split, cols / 32)),
// never empty (tc_plan). With one split, out is y. xh: n x cols F16.
template <DType T>
__global__ void __launch_bounds__(kTcThreads)
    tc_kernel(const uint4* __restrict__ quants, const void* __restrict__ scales,
              std::int64_t rows, std::int64_t chunks_per_row, std::int64_t blocks_per_row,
              const __half* __restrict__ xh, std::int64_t n, std::int64_t cols,
              std::int64_t k_per_split, float* __restrict__ out) {
  __shared__ __align__(128) unsigned char smem[kTcSmemBytes];
  __half* const As = reinterpret_cast<__half*>(smem);                // [2][kTcM][kTcLds]
  __half* const Bs = reinterpret_cast<__half*>(smem + kTcABytes);    // [2][kTcN][kTcLds]
  float* const Cs = reinterpret_cast<float*>(smem);                  // [kTcN][kTcLdc], at the end

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarp;
  const int wm = warp % 4;  // rows wm * 32 .. + 31 of the tile
  const int wn = warp / 4;  // tokens wn * 32 .. + 31 of the tile
  const std::int64_t row0 = static_cast<std::int64_t>(blockIdx.y) * kTcM;
  const std::int64_t tok0 = static_cast<std::int64_t>(blockIdx.x) * kTcN;

  // Loader roles. Rows and tokens past the end are clamped to the last one: loads stay in
  // bounds and only feed outputs that are not written.
  const int a_row = tid / 2, a_half = tid % 2;
  const std::int64_t a_grow = min(row0 + a_row, rows - 1);
  const int b_tok = tid / 4, b_part = tid % 4;
  const std::int64_t b_gtok = min(tok0 + b_tok, n - 1);
  const __half* const b_src = xh + b_gtok * cols + 8 * b_part;  // + kb * 32 per step

  const std::int64_t kb_begin = static_cast<std::int64_t>(blockIdx.z) * k_per_split;
  const std::int64_t kb_end = min(kb_begin + k_per_split, cols / kTcK);
  float* const y = out + static_cast<std::int64_t>(blockIdx.z) * n * rows;
  TcA<T> a;
  uint4 b;

  // The first step into buffer 0.
  a.load(quants, scales, a_grow, chunks_per_row, blocks_per_row, kb_begin, a_half);
  b = __ldg(reinterpret_cast<const uint4*>(b_src + kb_begin * kTcK));
  a.store(As + a_row * kTcLds + 16 * a_half, a_half);
  *reinterpret_cast<uint4*>(Bs + b_tok * kTcLds + 8 * b_part) = b;
  __syncthreads();

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  for (std::int64_t kb = kb_begin; kb < kb_end; ++kb) {
    const int cur = static_cast<int>((kb - kb_begin) & 1);
    const bool has_next = kb + 1 < kb_end;
    if (has_next) {  // issue the next step's global loads before this step's MMAs
      a.load(quants, scales, a_grow, chunks_per_row, blocks_per_row, kb + 1, a_half);
      b = __ldg(reinterpret_cast<const uint4*>(b_src + (kb + 1) * kTcK));
    }
    const __half* const Ab = As + cur * kTcM * kTcLds;
    const __half* const Bb = Bs + cur * kTcN * kTcLds;
#pragma unroll
    for (int kk = 0; kk < kTcK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb[2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        wmma::load_matrix_sync(fa[i], Ab + (wm * 32 + i * 16) * kTcLds + kk, kTcLds);
      // B (k x token) is stored token-major, i.e. column-major: element (k, t) at t * ld + k.
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::load_matrix_sync(fb[j], Bb + (wn * 32 + j * 16) * kTcLds + kk, kTcLds);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    if (has_next) {
      // Buffer cur ^ 1 was last read in step kb - 1, which every warp finished before the
      // __syncthreads that ended it.
      const int nxt = cur ^ 1;
      a.store(As + (nxt * kTcM + a_row) * kTcLds + 16 * a_half, a_half);
      *reinterpret_cast<uint4*>(Bs + (nxt * kTcN + b_tok) * kTcLds + 8 * b_part) = b;
    }
    __syncthreads();  // this step's reads done, the next step's tile written
  }

  // The loop ended with __syncthreads: the A/B space is free for the C tile, stored
  // column-major (element (row m, token t) at Cs[t * kTcLdc + m]).
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(Cs + (wn * 32 + j * 16) * kTcLdc + wm * 32 + i * 16, acc[i][j],
                              kTcLdc, wmma::mem_col_major);
  __syncthreads();
  // Consecutive threads write consecutive rows of one token: coalesced in y.
  for (int idx = tid; idx < kTcM * kTcN; idx += kTcThreads) {
    const int t = idx / kTcM, m = idx % kTcM;
    const std::int64_t gr = row0 + m, gt = tok0 + t;
    if (gr < rows && gt < n) y[gt * rows + gr] = Cs[t * kTcLdc + m];
  }
}

// xh[i] = half(x[i]) for i < count (count a multiple of 4; x 16-byte, xh 8-byte aligned).
__global__ void f32_to_f16_kernel(const float4* __restrict__ x, uint2* __restrict__ xh,
                                  std::int64_t count4) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count4; i += stride) {
    const float4 v = __ldg(x + i);
    xh[i] = make_uint2(pack_half2(v.x, v.y), pack_half2(v.z, v.w));
  }
}

// y[i] = sum over s < splits of partial[s * count + i], in order (deterministic).
__global__ void split_sum_kernel(const float* __restrict__ partial, int splits, std::int64_t count,
                                 float* __restrict__ y) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count; i += stride) {
    float v = 0.0f;
    for (int sp = 0; sp < splits; ++sp) v += partial[sp * count + i];
    y[i] = v;
  }
}

// ---------------------------------------------------------------------------------------------
// get_rows.

template <DType T>
__global__ void get_rows_kernel(const uint4* __restrict__ quants, const void* __restrict__ scales,
                                std::int64_t rows, std::int64_t chunks_per_row,
                                std::int64_t blocks_per_row, const std::int32_t* __restrict__ ids,
                                std::int64_t n, std::int64_t cols, float* __restrict__ out) {
  using C = Chunk<T>;
  const std::int64_t total = n * chunks_per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       idx < total; idx += stride) {
    const std::int64_t i = idx / chunks_per_row, c = idx % chunks_per_row;
    const std::int64_t id = ids[i];
    float4* const o = reinterpret_cast<float4*>(out + i * cols + c * C::kElems);
    if (id < 0 || id >= rows) {
#pragma unroll
      for (int q = 0; q < C::kQuads; ++q) o[q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      continue;
    }
    const uint4 raw = __ldg(quants + id * chunks_per_row + c);
    BlockScale bs;
    if constexpr (C::kScaled) {
      bs = load_scale<T>(scales, id * blocks_per_row + c * C::kElems / kBlockElems);
    }
#pragma unroll
    for (int q = 0; q < C::kQuads; ++q) {
      float w[4];
      C::quad(raw, q, w);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // The CPU's arithmetic, rounding for rounding: d * q (+ m), never fused.
        if constexpr (C::kHasMin) {
          w[k] = __fadd_rn(__fmul_rn(bs.d, w[k]), bs.m);
        } else if constexpr (C::kScaled) {
          w[k] = __fmul_rn(bs.d, w[k]);
        }
      }
      o[q] = make_float4(w[0], w[1], w[2], w[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

[[noreturn]] void invalid(const std::string& what) { throw std::invalid_argument(what); }

// Throws std::invalid_argument unless the shape and type are ones the kernels take.
void check_shape(DType type, std::int64_t rows, std::int64_t cols, const char* what) {
  if (chunk_elems(type) == 0) {
    invalid(std::string(what) + ": type " + std::string(to_string(type)) +
            " is not supported by the CUDA kernels");
  }
  if (rows < 0) invalid(std::string(what) + ": negative rows");
  if (cols <= 0 || cols % kBlockElems != 0) {
    invalid(std::string(what) + ": cols must be a positive multiple of 32 (got " +
            std::to_string(cols) + ")");
  }
  // The kernels index chunks within a row with 32-bit integers.
  if (cols > (std::int64_t{1} << 30)) invalid(std::string(what) + ": cols too large");
}

void check_device_matrix(const DeviceMatrix& w, const char* what) {
  check_shape(w.type, w.rows, w.cols, what);
  if (w.data == nullptr || !aligned16(w.data)) {
    invalid(std::string(what) + ": weight data missing or not 16-byte aligned");
  }
}

struct Parts {
  const uint4* quants;
  const void* scales;
  WeightLayout layout;
};

Parts parts_of(const DeviceMatrix& w) {
  const WeightLayout l = weight_layout(w.type, w.rows, w.cols);
  const auto* base = static_cast<const unsigned char*>(w.data);
  return {reinterpret_cast<const uint4*>(base), base + l.scale_offset, l};
}

unsigned grid_1d(std::int64_t items, int threads) {
  // Grid-stride kernels: any cap is correct; this one keeps every SM busy.
  const std::int64_t blocks = std::clamp<std::int64_t>(ceil_div(items, threads), 1, 65535);
  return static_cast<unsigned>(blocks);
}

// How many warps share a row group (1, 2 or 4): more when the matrix has few row groups for
// the device (so that enough loads are in flight) and each warp still gets at least a whole
// 32-chunk step of every row. Many-row matrices (e.g. the output projection) keep 1.
inline constexpr std::int64_t kMvTargetWarps = 2048;  // ~16 per SM on a 132-SM device
int matvec_splits(std::int64_t rows, std::int64_t chunks_per_row, int rows_per_warp) {
  int splits = 1;
  const std::int64_t row_groups = ceil_div(rows, rows_per_warp);
  while (splits < kMvWarps && chunks_per_row >= 2 * splits * kWarp &&
         row_groups * splits < kMvTargetWarps) {
    splits *= 2;
  }
  return splits;
}

template <DType T, int N>
void launch_matvec(const Parts& p, std::int64_t rows, const float* x, std::int64_t cols, float* y,
                   cudaStream_t stream) {
  constexpr int R = mv_rows_per_warp<N>();
  const int splits = matvec_splits(rows, p.layout.chunks_per_row, R);
  const std::int64_t rows_per_block = static_cast<std::int64_t>(kMvWarps / splits) * R;
  const std::int64_t blocks = ceil_div(rows, rows_per_block);
  if (blocks > INT_MAX) invalid("matmul: too many rows");
  matvec_kernel<T, N, R><<<static_cast<unsigned>(blocks), kMvThreads, 0, stream>>>(
      p.quants, p.scales, rows, p.layout.chunks_per_row, p.layout.blocks_per_row, x, cols, y,
      splits);
  check_launch("matmul (matvec)");
}

template <DType T>
void matvec_n(const Parts& p, std::int64_t rows, const float* x, std::int64_t n, std::int64_t cols,
              float* y, cudaStream_t stream) {
  static_assert(kMatvecMaxTokens == 8, "one case per token count below");
  switch (n) {
    case 1: launch_matvec<T, 1>(p, rows, x, cols, y, stream); break;
    case 2: launch_matvec<T, 2>(p, rows, x, cols, y, stream); break;
    case 3: launch_matvec<T, 3>(p, rows, x, cols, y, stream); break;
    case 4: launch_matvec<T, 4>(p, rows, x, cols, y, stream); break;
    case 5: launch_matvec<T, 5>(p, rows, x, cols, y, stream); break;
    case 6: launch_matvec<T, 6>(p, rows, x, cols, y, stream); break;
    case 7: launch_matvec<T, 7>(p, rows, x, cols, y, stream); break;
    case 8: launch_matvec<T, 8>(p, rows, x, cols, y, stream); break;
    default: invalid("matmul: matvec token count out of range");
  }
}

// The tensor-core grid: tiles of kTcM rows x kTcN tokens, and when there are fewer tiles than
// the device wants blocks (few rows and tokens: e.g. 2048 rows x 32 tokens is 16 tiles), the
// cols split into `splits` ranges of k_per_split steps (each at least kTcMinSplitSteps), whose
// partial products go to scratch and are summed in a second kernel in a fixed order.
inline constexpr std::int64_t kTcTargetBlocks = 256;  // ~2 per SM on a 132-SM device
inline constexpr std::int64_t kTcMinSplitSteps = 8;
inline constexpr std::int64_t kTcMaxSplits = 16;

struct TcPlan {
  std::int64_t row_tiles = 0, tok_tiles = 0;
  std::int64_t splits = 1, k_per_split = 0;
  std::size_t xh_bytes = 0;       // scratch: x as F16, n x cols
  std::size_t partial_bytes = 0;  // scratch after it: splits x n x rows floats (splits > 1)
};

TcPlan tc_plan(std::int64_t rows, std::int64_t cols, std::int64_t n) {
  TcPlan p;
  p.row_tiles = ceil_div(rows, kTcM);
  p.tok_tiles = ceil_div(n, kTcN);
  const std::int64_t k_steps = cols / kTcK;
  const std::int64_t tiles = p.row_tiles * p.tok_tiles;
  std::int64_t splits = 1;
  if (tiles < kTcTargetBlocks) {
    splits = std::min({ceil_div(kTcTargetBlocks, tiles),
                       std::max<std::int64_t>(1, k_steps / kTcMinSplitSteps), kTcMaxSplits});
  }
  p.k_per_split = ceil_div(k_steps, splits);
  p.splits = ceil_div(k_steps, p.k_per_split);  // every split non-empty
  p.xh_bytes =
      round_up(static_cast<std::size_t>(n) * static_cast<std::size_t>(cols) * 2, kLayoutAlign);
  p.partial_bytes = p.splits > 1 ? round_up(static_cast<std::size_t>(p.splits) *
                                                static_cast<std::size_t>(n) *
                                                static_cast<std::size_t>(rows) * 4,
                                            kLayoutAlign)
                                 : 0;
  return p;
}

template <DType T>
void launch_tc(const Parts& p, const TcPlan& plan, std::int64_t rows, const __half* xh,
               std::int64_t n, std::int64_t cols, float* partial, float* y, cudaStream_t stream) {
  if (plan.row_tiles > 65535 || plan.tok_tiles > INT_MAX || plan.splits > 65535) {
    invalid("matmul: matrix too large");
  }
  // Token tiles vary fastest, so the blocks that share a weight tile run at the same time
  // and read it from L2.
  const dim3 grid(static_cast<unsigned>(plan.tok_tiles), static_cast<unsigned>(plan.row_tiles),
                  static_cast<unsigned>(plan.splits));
  float* const out = plan.splits > 1 ? partial : y;
  tc_kernel<T><<<grid, kTcThreads, 0, stream>>>(p.quants, p.scales, rows,
                                                p.layout.chunks_per_row,
                                                p.layout.blocks_per_row, xh, n, cols,
                                                plan.k_per_split, out);
  check_launch("matmul (tensor cores)");
  if (plan.splits > 1) {
    const std::int64_t count = n * rows;
    split_sum_kernel<<<grid_1d(count, 256), 256, 0, stream>>>(
        partial, static_cast<int>(plan.splits), count, y);
    check_launch("matmul (split sum)");
  }
}

template <DType T>
void launch_get_rows(const Parts& p, std::int64_t rows, const std::int32_t* ids, std::int64_t n,
                     std::int64_t cols, float* out, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const std::int64_t items = n * p.layout.chunks_per_row;
  get_rows_kernel<T><<<grid_1d(items, kThreads), kThreads, 0, stream>>>(
      p.quants, p.scales, rows, p.layout.chunks_per_row, p.layout.blocks_per_row, ids, n, cols,
      out);
  check_launch("get_rows");
}

// Calls f.template operator()<T>() for the runtime device layout (one of the eight).
template <typename F>
void with_type(DType type, F&& f) {
  switch (type) {
    case DType::Q4_0: f.template operator()<DType::Q4_0>(); break;
    case DType::Q4_1: f.template operator()<DType::Q4_1>(); break;
    case DType::Q8_0: f.template operator()<DType::Q8_0>(); break;
    case DType::Q4_K: f.template operator()<DType::Q4_K>(); break;
    case DType::Q5_K: f.template operator()<DType::Q5_K>(); break;
    case DType::F16: f.template operator()<DType::F16>(); break;
    case DType::BF16: f.template operator()<DType::BF16>(); break;
    case DType::F32: f.template operator()<DType::F32>(); break;
    default: invalid("unsupported type " + std::string(to_string(type)));
  }
}

}  // namespace
}  // namespace detail

// ---------------------------------------------------------------------------------------------

bool takes(DType t) { return detail::chunk_elems(detail::device_type(t)) != 0; }

std::size_t device_bytes(const Matrix& w) {
  const DType dt = detail::device_type(w.type);
  detail::check_shape(dt, w.rows, w.cols, "device_bytes");
  return detail::weight_layout(dt, w.rows, w.cols).total;
}

namespace detail {
namespace {

// One 32-element block of a file type that goes up repacked (Q5_0, Q5_1, Q4_K, Q5_K): its
// integer quants and the F32 scale and min of its values d * q + m, the CPU's dequantization
// (dequantize_row) rounding for rounding. Q5_0's q is q - 16 with m = 0.
struct RepackedBlock {
  int q[32];
  float d = 0.0f, m = 0.0f;
  std::uint16_t d16 = 0;  // Q5_0: the file's fp16 scale, kept as Q8_0's
};

RepackedBlock repacked_block(DType t, const unsigned char* row, std::int64_t b) {
  RepackedBlock out;
  switch (t) {
    case DType::Q5_0: {
      BlockQ5_0 blk;
      std::memcpy(&blk, row + static_cast<std::size_t>(b) * sizeof blk, sizeof blk);
      for (int e = 0; e < 32; ++e) out.q[e] = q5_quant(blk.qs, blk.qh, e) - 16;
      out.d16 = blk.d;
      break;
    }
    case DType::Q5_1: {
      BlockQ5_1 blk;
      std::memcpy(&blk, row + static_cast<std::size_t>(b) * sizeof blk, sizeof blk);
      for (int e = 0; e < 32; ++e) out.q[e] = q5_quant(blk.qs, blk.qh, e);
      out.d = fp16_to_fp32(blk.d);
      out.m = fp16_to_fp32(blk.m);
      break;
    }
    case DType::Q4_K:
    case DType::Q5_K: {
      // Sub-block j of super-block b / 8.
      const std::size_t bytes = block_bytes(t);
      const unsigned char* base = row + static_cast<std::size_t>(b / 8) * bytes;
      const int j = static_cast<int>(b % 8);
      BlockQ5_K k5{};
      BlockQ4_K k4{};
      const std::uint8_t* qh = nullptr;
      const std::uint8_t* qs = nullptr;
      if (t == DType::Q5_K) {
        std::memcpy(&k5, base, sizeof k5);
        std::memcpy(&k4, base, 16);  // d, dmin, scales
        qh = k5.qh;
        qs = k5.qs;
      } else {
        std::memcpy(&k4, base, sizeof k4);
        qs = k4.qs;
      }
      std::uint8_t sc = 0, mn = 0;
      k_scale_min(k4.scales, j, sc, mn);
      out.d = fp16_to_fp32(k4.d) * static_cast<float>(sc);
      out.m = -(fp16_to_fp32(k4.dmin) * static_cast<float>(mn));
      for (int e = 0; e < 32; ++e) out.q[e] = k45_quant(qs, qh, 32 * j + e);
      break;
    }
    default: invalid("upload: internal: no repacking for " + std::string(to_string(t)));
  }
  return out;
}

}  // namespace
}  // namespace detail

DeviceMatrix upload(const Matrix& w, void* device) {
  using detail::WeightLayout;
  const DType dt = detail::device_type(w.type);
  detail::check_shape(dt, w.rows, w.cols, "upload");
  if (device == nullptr || !detail::aligned16(device)) {
    detail::invalid("upload: device memory missing or not 16-byte aligned");
  }
  if (w.data == nullptr && w.rows > 0) detail::invalid("upload: no host data");
  if (w.cols % block_size(w.type) != 0) {
    detail::invalid("upload: cols " + std::to_string(w.cols) + " is not a whole number of " +
                    std::string(to_string(w.type)) + " blocks");
  }
  const WeightLayout l = detail::weight_layout(dt, w.rows, w.cols);
  static const unsigned char kZeros[detail::kLayoutAlign] = {};
  const auto* src = static_cast<const unsigned char*>(w.data);
  const std::size_t src_row = row_bytes(w.type, w.cols);
  const auto bpr = static_cast<std::size_t>(l.blocks_per_row);

  if (dt == w.type && detail::scale_entry_bytes(dt) == 0) {
    // F32 / F16 / BF16: the GGUF rows as they are, then zero padding (less than 256 bytes, or
    // 256 for an empty matrix).
    if (l.quant_bytes != static_cast<std::size_t>(w.rows) * src_row) {
      detail::invalid("upload: internal layout mismatch");
    }
    if (l.quant_bytes > 0) {
      check(cudaMemcpy(device, w.data, l.quant_bytes, cudaMemcpyHostToDevice), "upload");
    }
    const std::size_t pad = l.total - l.quant_bytes;
    if (pad > sizeof kZeros) detail::invalid("upload: internal padding mismatch");
    if (pad > 0) {
      check(cudaMemcpy(static_cast<unsigned char*>(device) + l.quant_bytes, kZeros, pad,
                       cudaMemcpyHostToDevice),
            "upload");
    }
  } else if (dt == DType::F16) {
    // Q6_K: each row dequantized as the CPU does, then rounded to F16.
    std::vector<unsigned char> host(l.total, 0);
    std::vector<float> values(static_cast<std::size_t>(w.cols));
    auto* halves = reinterpret_cast<std::uint16_t*>(host.data());
    for (std::int64_t r = 0; r < w.rows; ++r) {
      dequantize_row(w.type, src + static_cast<std::size_t>(r) * src_row, w.cols, values.data());
      for (std::int64_t c = 0; c < w.cols; ++c) {
        const float v = values[static_cast<std::size_t>(c)];
        const std::uint16_t h = fp32_to_fp16(v);
        // |v| past 65504 would become an infinity the CPU never sees.
        if (!std::isfinite(fp16_to_fp32(h)) && std::isfinite(v))
          detail::invalid("upload: a " + std::string(to_string(w.type)) + " value (" + std::to_string(v) + ", row " +
                          std::to_string(r) + ") is past F16's range, which the GPU holds this type in");
        halves[r * w.cols + c] = h;
      }
    }
    check(cudaMemcpy(device, host.data(), l.total, cudaMemcpyHostToDevice), "upload");
  } else if (w.type == DType::Q4_0 || w.type == DType::Q4_1 || w.type == DType::Q8_0) {
    // Split every block into its quants (the chunk part) and its scale(s).
    std::vector<unsigned char> host(l.total, 0);
    const std::size_t src_block = block_bytes(w.type);
    // Bytes of the fp16 scale(s) at the start of a block, then its quants.
    const std::size_t head = detail::scale_entry_bytes(w.type);  // 2 (d) or 4 (d, m)
    const std::size_t qs_bytes = src_block - head;                // 16 (Q4) or 32 (Q8_0)
    for (std::int64_t r = 0; r < w.rows; ++r) {
      for (std::size_t b = 0; b < bpr; ++b) {
        const unsigned char* block = src + static_cast<std::size_t>(r) * src_row + b * src_block;
        const std::size_t flat = static_cast<std::size_t>(r) * bpr + b;
        // Q4: chunk r * bpr + b (16 bytes); Q8_0: chunks 2(r * bpr + b) and + 1 (32 bytes).
        std::memcpy(host.data() + flat * qs_bytes, block + head, qs_bytes);
        // Little-endian on both sides: Q4_1's {d, m} becomes d | m << 16.
        std::memcpy(host.data() + l.scale_offset + flat * head, block, head);
      }
    }
    check(cudaMemcpy(device, host.data(), l.total, cudaMemcpyHostToDevice), "upload");
  } else {
    // Q5_0 (as Q8_0), Q5_1 and Q5_K (as "Q5_K"), Q4_K: every 32-element block's quants
    // repacked into the device layout's chunks, its scale (and min) beside them.
    std::vector<unsigned char> host(l.total, 0);
    for (std::int64_t r = 0; r < w.rows; ++r) {
      const unsigned char* row = src + static_cast<std::size_t>(r) * src_row;
      for (std::size_t b = 0; b < bpr; ++b) {
        const detail::RepackedBlock k = detail::repacked_block(w.type, row, static_cast<std::int64_t>(b));
        const std::size_t flat = static_cast<std::size_t>(r) * bpr + b;
        unsigned char* scale = host.data() + l.scale_offset + flat * detail::scale_entry_bytes(dt);
        if (dt == DType::Q4_K) {
          unsigned char* qs = host.data() + flat * 16;
          for (int e = 0; e < 16; ++e) qs[e] = static_cast<unsigned char>(k.q[e] | (k.q[e + 16] << 4));
        } else {
          auto* qs = reinterpret_cast<std::int8_t*>(host.data() + flat * 32);
          for (int e = 0; e < 32; ++e) qs[e] = static_cast<std::int8_t>(k.q[e]);
        }
        if (dt == DType::Q8_0) {
          std::memcpy(scale, &k.d16, sizeof k.d16);
        } else {
          std::memcpy(scale, &k.d, sizeof k.d);
          std::memcpy(scale + sizeof k.d, &k.m, sizeof k.m);
        }
      }
    }
    check(cudaMemcpy(device, host.data(), l.total, cudaMemcpyHostToDevice), "upload");
  }
  // A copy from pageable memory may return before the DMA lands: wait for it, so that work
  // on any stream (non-blocking ones included) sees the weights.
  check(cudaStreamSynchronize(cudaStreamLegacy), "upload: synchronize");
  return DeviceMatrix{dt, device, w.rows, w.cols};
}

std::size_t matmul_scratch_bytes(const DeviceMatrix& w, std::int64_t n) {
  if (n <= kMatvecMaxTokens || w.cols <= 0 || w.cols % detail::kBlockElems != 0 || w.rows <= 0) {
    return 0;
  }
  const detail::TcPlan plan = detail::tc_plan(w.rows, w.cols, n);
  return plan.xh_bytes + plan.partial_bytes;
}

void matmul(const DeviceMatrix& w, const float* x, std::int64_t n, float* y, void* scratch,
            cudaStream_t stream) {
  detail::check_device_matrix(w, "matmul");
  if (n < 0) detail::invalid("matmul: negative token count");
  if (n == 0 || w.rows == 0) return;
  if (x == nullptr || !detail::aligned16(x)) {
    detail::invalid("matmul: x missing or not 16-byte aligned");
  }
  if (y == nullptr) detail::invalid("matmul: y missing");
  const detail::Parts p = detail::parts_of(w);

  if (n <= kMatvecMaxTokens) {
    detail::with_type(w.type, [&]<DType T>() {
      detail::matvec_n<T>(p, w.rows, x, n, w.cols, y, stream);
    });
    return;
  }
  if (scratch == nullptr || !detail::aligned16(scratch)) {
    detail::invalid("matmul: scratch missing or not 16-byte aligned");
  }
  // scratch (matmul_scratch_bytes): x as F16, then the split partial sums if any.
  const detail::TcPlan plan = detail::tc_plan(w.rows, w.cols, n);
  auto* xh = static_cast<__half*>(scratch);
  auto* partial = reinterpret_cast<float*>(static_cast<unsigned char*>(scratch) + plan.xh_bytes);
  const std::int64_t count4 = n * w.cols / 4;  // cols % 32 == 0
  detail::f32_to_f16_kernel<<<detail::grid_1d(count4, 256), 256, 0, stream>>>(
      reinterpret_cast<const float4*>(x), reinterpret_cast<uint2*>(xh), count4);
  detail::check_launch("matmul (x to F16)");
  detail::with_type(w.type, [&]<DType T>() {
    detail::launch_tc<T>(p, plan, w.rows, xh, n, w.cols, partial, y, stream);
  });
}

void get_rows(const DeviceMatrix& w, const std::int32_t* ids, std::int64_t n, float* out,
              cudaStream_t stream) {
  detail::check_device_matrix(w, "get_rows");
  if (n < 0) detail::invalid("get_rows: negative count");
  if (n == 0) return;
  if (ids == nullptr) detail::invalid("get_rows: ids missing");
  if (out == nullptr || !detail::aligned16(out)) {
    detail::invalid("get_rows: out missing or not 16-byte aligned");
  }
  const detail::Parts p = detail::parts_of(w);
  detail::with_type(w.type, [&]<DType T>() {
    detail::launch_get_rows<T>(p, w.rows, ids, n, w.cols, out, stream);
  });
}

}  // namespace batchlm::kernels::cuda
