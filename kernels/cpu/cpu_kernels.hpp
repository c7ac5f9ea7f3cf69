#pragma once
// Internal to kernels/cpu: the inner loops that have a portable and an AVX2 version.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "batchlm/kernels/dtype.hpp"
#include "batchlm/kernels/ops.hpp"

namespace batchlm::kernels::cpu {

// A tile of a matrix product: y[t * y_stride + r] = dot(w row r, x row t) for r < nr, t < nt.
// w rows are w_row_bytes apart, x rows (already in the weight's dot type) x_row_bytes apart;
// each row has n_blocks blocks (for F32/F16/BF16, n_blocks elements).
using TileFn = void (*)(const std::uint8_t* w, std::size_t w_row_bytes, int nr,
                        const std::uint8_t* x, std::size_t x_row_bytes, int nt,
                        std::int64_t n_blocks, float* y, std::int64_t y_stride);

// Packed weights (pack_weights): rows in groups of kPackRows, each group's blocks one after the
// other, the block of all 8 rows together so that one 256-bit vector holds a value of each row:
//   Q4_0: d of the 8 rows (8 F16), then 4 chunks of 32 bytes       (144 bytes per block)
//   Q4_1: d of the 8 rows, m of the 8 rows, then the 4 chunks        (160 bytes)
//   Q8_0: d of the 8 rows, then 8 chunks of 32 bytes                 (272 bytes)
//   Q5_0: as Q8_0, the bytes q - 16                                  (272 bytes)
//   Q5_1: d and m of the 8 rows, then 8 chunks of the bytes q (0..31) (288 bytes)
// Chunk c holds bytes 4c..4c+3 of each row's quants (row r at 4r): for the 4-bit types the low
// nibbles are elements 4c..4c+3 and the high nibbles elements 16+4c..16+4c+3; for Q8_0
// elements 4c..4c+3. Rows past the end of the matrix are zero.
// The K types, per super-block of 256 elements (their integer scales unpacked to bytes, two
// sub-blocks to a row: pair k of row r at 16k + 2r, sub-block 2k first):
//   Q4_K: d, dmin of the 8 rows (F16), the scales of the 4 pairs of sub-blocks (64 bytes), their
//         mins (64), then 32 chunks of the GGUF nibbles: chunk c is bytes 4c..4c+3 of each
//         row's qs, low nibbles elements 64i + 4(c % 8).. (i = c / 8), high nibbles 32 later
//                                                                    (1184 bytes per super-block)
//   Q5_K: the same headers and chunks of the GGUF nibbles, then 8 chunks of the GGUF qh: chunk
//         m is bytes 4m..4m+3 of each row's qh, the fifth bits of nibble chunks 8i + m, low
//         nibbles in bit 2i, high ones in bit 2i + 1                         (1440, 1408 in GGUF)
//   Q6_K: d of the 8 rows, the signed scales of the 8 pairs of sub-blocks (128 bytes), the low
//         4 bits of the quants (0..63) in Q4_K's 32 chunks of nibbles (not Q6_K's GGUF order),
//         then 16 chunks of the GGUF qh: chunk 8n + m is bytes 32n + 4m.. of each row's qh, the
//         two high bits of nibble chunks 8(2n + p) + m, low nibbles in bits 4p..4p+1, high ones
//         in bits 4p+2..4p+3                                               (1680, as in GGUF)
// Q5_K's and Q6_K's quants as whole bytes made their packed copies 1.57x and 1.30x the GGUF
// size, and one-token products stream them from memory (now 1.5x and 1.25x faster). The high
// bits cost the tiles a load, a shift, an AND and an OR per chunk and nibble, in every pass of
// tokens: at 32 tokens Q6_K's products are about 4% slower than from bytes with AVX-512, and
// both types' about 8% with AVX2.
inline constexpr int kPackRows = 8;
// The rows of a packed tile: two groups, which AVX-512 takes at once in 512-bit vectors.
inline constexpr int kPackedTileRows = 2 * kPackRows;
std::size_t packed_block_bytes(DType t);  // 0 for types without a packed form

// The scales of the activation blocks as the packed tiles read them, one per block of each
// token's row ([block][token]), next to the quantized rows: the F16 values as floats, and for
// Q8_0 the exact sum of the 32 quants (the packed tiles multiply unsigned weight bytes and
// take the weights' offset off with it).
struct ScalesQ8_0 { float d; std::int32_t sum; };
struct ScalesQ8_1 { float d; float s; };

// Rows r < nr <= kPackedTileRows of packed groups (w: the first group's first block; a second
// group follows when nr > kPackRows) against nt tokens: y[t * y_stride + r] = dot(row r, x row
// t). x rows in the dot type, x_row_bytes apart, their scales at x_scales[b * nt + t]
// (ScalesQ8_0 or ScalesQ8_1).
// Per row and token: each block's integer dot product exactly, then in block order
// acc = fma(d_w * d_x, dot, acc) and for Q4_1 acc = fma(m_w, s_x, acc), from acc = 0: the
// portable tiles' arithmetic, bit for bit.
// `ahead`, when not null, is the next tile's first group (the layout of w), whose weights
// are prefetched while this tile's are first read.
using PackedTileFn = void (*)(const std::uint8_t* w, int nr, const std::uint8_t* x,
                              std::size_t x_row_bytes, const void* x_scales, int nt,
                              std::int64_t n_blocks, float* y, std::int64_t y_stride,
                              const std::uint8_t* ahead);

// The K types read the BlockQ8_K rows alone (d and the bsums): x_scales is null. Per row and
// token, each super-block's integer sums of portable.cpp's q45k_block / q6k_block exactly,
// then its one or two FMAs in the same order, from acc = 0.

// Quantizes one row of n floats (n a multiple of 32 for the block types) to `type`.
using QuantizeFn = void (*)(const float* x, std::int64_t n, void* out);

// out += p * v for an F16 row v.
using AxpyF16Fn = void (*)(float p, const std::uint16_t* v, float* out, std::int64_t n);

// Keys sit transposed within each block of the pool (ops.hpp PagedKv): dimension d + 1 of a
// key follows dimension d `stride` elements later (the block size), and the keys of
// consecutive slots are side by side. A run is up to kKeyRunSlots consecutive slots of one
// block and KV head: `at` is the element offset of its first key's dimension 0, `n` how many.
// The score kernels put a run's keys in the lanes of one vector.
inline constexpr std::int64_t kKeyRunSlots = 16;
struct KeyRun {
  std::int64_t at;
  std::int64_t n;
};

// The score arithmetic every path follows bit for bit: one multiply-add chain in dimension
// order, s = fma(q[d], k[d], s) from s = 0, in F32, for an F32 query (pre-rounded to F16
// values) and an F16 key whose dimensions are `stride` elements apart.
inline float key_dot(const float* q, const std::uint16_t* k, std::int64_t dim, std::int64_t stride) {
  float s = 0.0f;
  for (std::int64_t d = 0; d < dim; ++d) s = std::fma(q[d], fp16_to_fp32(k[d * stride]), s);
  return s;
}

// Attention over gathered positions (the ones a query sees, wherever their blocks are), for
// n_q queries that share them (the query heads of one KV head, or of several tokens whose
// sequences share these cached blocks). Scores and probabilities of query j are at j * ld,
// ld >= the number of positions.
// The keys come as runs; key r counts their slots in order:
// scores[j * ld + r] = key_dot(q + j * dim, key r, dim, stride) * scale, bit for bit.
// n_after more runs follow runs[n_runs - 1] in the caller's list (the next token's keys):
// their keys may be fetched ahead, never used.
using ScoreRunsFn = void (*)(const float* q, int n_q, const std::uint16_t* pool, const KeyRun* runs,
                             std::int64_t n_runs, std::int64_t n_after, std::int64_t dim, std::int64_t stride,
                             float scale, float* scores, std::int64_t ld);
// The values are rows of dim F16 values at pool + rows[r]:
// out + j * dim += sum over r, in order, of probs[j * ld + r] * pool[rows[r]] (the same sums
// as axpy_f16 row by row, bit for bit). n_after more rows follow rows[n_rows - 1] in the
// caller's list (the next token's values): they may be fetched ahead, never used.
using MixRowsFn = void (*)(const float* probs, int n_q, const std::uint16_t* pool,
                           const std::int64_t* rows, std::int64_t n_rows, std::int64_t n_after,
                           std::int64_t dim, float* out, std::int64_t ld);

// Softmax of `rows` rows of n attention scores, `ld` apart, in place, each probability then
// rounded to the nearest F16 value; every row's results are those of the row alone. The
// portable path takes std::exp; the AVX2 path a float polynomial within 2 ulp of it (terms
// below e^-87 count as e^-87, which the sum loses and F16 rounds to 0), eight lanes at a time
// (the AVX-512 build sixteen, several rows in lockstep, with the same bits). The sum is in
// double on both; the paths may differ by one F16 step.
using SoftmaxF16Fn = void (*)(float* x, std::int64_t n, std::int64_t ld, int rows);

// out[i] = std::exp(x[i]), bit for bit on every path.
using ExpFn = void (*)(const float* x, float* out, std::int64_t n);

// Rows of floats to F16, and floats rounded to the nearest F16 value in place.
using ToF16Fn = void (*)(const float* x, std::uint16_t* out, std::int64_t n);
using RoundF16Fn = void (*)(float* x, std::int64_t n);

struct Kernels {
  const char* name;
  int tile_tokens;  // the widest GGUF-layout tile (tokens; its rows are always kTileRows)
  TileFn tile_q4_0;
  TileFn tile_q4_1;
  TileFn tile_q8_0;
  TileFn tile_f16;
  TileFn tile_bf16;
  TileFn tile_f32;
  PackedTileFn packed_q4_0;  // nullptr where the path reads the GGUF layout only
  PackedTileFn packed_q4_1;
  PackedTileFn packed_q8_0;
  QuantizeFn quantize_q8_0;
  QuantizeFn quantize_q8_1;
  AxpyF16Fn axpy_f16;
  ToF16Fn to_f16;
  RoundF16Fn round_f16;
  ScoreRunsFn score_runs;
  MixRowsFn mix_rows;
  SoftmaxF16Fn softmax_f16;
  ExpFn exp_f32;
  // The 5-bit and K types in the GGUF layout, on every path (the defaults only let portable.cpp
  // set them after the others); each equals the portable tile bit for bit.
  TileFn tile_q5_0 = nullptr;
  TileFn tile_q5_1 = nullptr;
  TileFn tile_q4_k = nullptr;
  TileFn tile_q5_k = nullptr;
  TileFn tile_q6_k = nullptr;
  QuantizeFn quantize_q8_k = nullptr;
  // Q5_1's packed form (nullptr: the path reads the GGUF layout).
  PackedTileFn packed_q5_1 = nullptr;
  // The K types' packed forms (nullptr: the path reads the GGUF layout).
  PackedTileFn packed_q4_k = nullptr;
  PackedTileFn packed_q5_k = nullptr;
  PackedTileFn packed_q6_k = nullptr;
};

const Kernels& portable_kernels();
// nullptr when this build has no such code or the CPU lacks the instructions. The AVX-VNNI
// set is the AVX2 set with the 8-bit dot products done by one VNNI instruction (same results).
const Kernels* avx2_kernels();
const Kernels* avx_vnni_kernels();
// The AVX-VNNI set again with AVX-512VL encodings: the same 256-bit arithmetic (same results)
// with 32 registers, so each weight tile is used for 4 tokens instead of 2; its packed tiles
// compute 16 rows per 512-bit vector, again with the same results.
const Kernels* avx512_kernels();

// The row count of the largest GGUF-layout tile the drivers ask for (its token count is
// tile_tokens).
inline constexpr int kTileRows = 4;
inline constexpr int kMaxTileTokens = 4;

// matmul_group (ops.hpp) on the given kernels rather than the chosen ones (for tests).
void matmul_group(const Kernels& k, std::span<const Matrix> w, const float* x, std::int64_t n,
                  std::span<float* const> y, void* scratch, ThreadPool& pool);

}  // namespace batchlm::kernels::cpu
