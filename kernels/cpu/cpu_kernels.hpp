#pragma once
// Internal to kernels/cpu: the inner loops that have a portable and an AVX2 version.

#include <cstddef>
#include <cstdint>

#include "batchlm/kernels/dtype.hpp"

namespace batchlm::kernels::cpu {

// A tile of a matrix product: y[t * y_stride + r] = dot(w row r, x row t) for r < nr, t < nt.
// w rows are w_row_bytes apart, x rows (already in the weight's dot type) x_row_bytes apart;
// each row has n_blocks blocks (for F32/F16/BF16, n_blocks elements).
using TileFn = void (*)(const std::uint8_t* w, std::size_t w_row_bytes, int nr,
                        const std::uint8_t* x, std::size_t x_row_bytes, int nt,
                        std::int64_t n_blocks, float* y, std::int64_t y_stride);

// Quantizes one row of n floats (n a multiple of 32 for the block types) to `type`.
using QuantizeFn = void (*)(const float* x, std::int64_t n, void* out);

// dot of an F32 query (pre-rounded to F16 values) with an F16 key row, in F32.
using DotF16Fn = float (*)(const float* q, const std::uint16_t* k, std::int64_t n);
// out += p * v for an F16 row v.
using AxpyF16Fn = void (*)(float p, const std::uint16_t* v, float* out, std::int64_t n);

// Attention over gathered F16 rows (the positions a query sees, wherever their blocks are),
// for n_q queries that share the rows (the query heads of one KV head, or of several tokens
// whose sequences share these cached blocks). Scores and probabilities of query j are at
// j * ld, ld >= n_rows.
// scores[j * ld + r] = dot_f16(q + j * dim, pool + rows[r], dim) * scale, bit for bit.
using ScoreRowsFn = void (*)(const float* q, int n_q, const std::uint16_t* pool,
                             const std::int64_t* rows, std::int64_t n_rows, std::int64_t dim,
                             float scale, float* scores, std::int64_t ld);
// out + j * dim += sum over r, in order, of probs[j * ld + r] * pool[rows[r]] (the same sums
// as axpy_f16 row by row, bit for bit).
using MixRowsFn = void (*)(const float* probs, int n_q, const std::uint16_t* pool,
                           const std::int64_t* rows, std::int64_t n_rows, std::int64_t dim,
                           float* out, std::int64_t ld);

// Softmax of one row of attention scores in place, each probability then rounded to the nearest
// F16 value. The exponentials are std::exp's on every path (the AVX2 path computes glibc's
// algorithm four lanes at a time, bit for bit); the paths may differ in the last bit of the
// double sum.
using SoftmaxF16Fn = void (*)(float* x, std::int64_t n);

// out[i] = std::exp(x[i]), bit for bit on every path.
using ExpFn = void (*)(const float* x, float* out, std::int64_t n);

// Rows of floats to F16, and floats rounded to the nearest F16 value in place.
using ToF16Fn = void (*)(const float* x, std::uint16_t* out, std::int64_t n);
using RoundF16Fn = void (*)(float* x, std::int64_t n);

struct Kernels {
  const char* name;
  int tile_tokens;  // the widest tile of the matrix products (tokens; rows are always kTileRows)
  TileFn tile_q4_0;
  TileFn tile_q4_1;
  TileFn tile_q8_0;
  TileFn tile_f16;
  TileFn tile_bf16;
  TileFn tile_f32;
  QuantizeFn quantize_q8_0;
  QuantizeFn quantize_q8_1;
  DotF16Fn dot_f16;
  AxpyF16Fn axpy_f16;
  ToF16Fn to_f16;
  RoundF16Fn round_f16;
  ScoreRowsFn score_rows;
  MixRowsFn mix_rows;
  SoftmaxF16Fn softmax_f16;
  ExpFn exp_f32;
};

const Kernels& portable_kernels();
// nullptr when this build has no such code or the CPU lacks the instructions. The AVX-VNNI
// set is the AVX2 set with the 8-bit dot products done by one VNNI instruction (same results).
const Kernels* avx2_kernels();
const Kernels* avx_vnni_kernels();
// The AVX-VNNI set again with AVX-512VL encodings: the same 256-bit arithmetic (same results)
// with 32 registers, so each weight tile is used for 4 tokens instead of 2.
const Kernels* avx512_kernels();

// The row count of the largest tile the drivers ask for (its token count is tile_tokens).
inline constexpr int kTileRows = 4;
inline constexpr int kMaxTileTokens = 4;

}  // namespace batchlm::kernels::cpu
