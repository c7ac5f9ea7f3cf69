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

struct Kernels {
  const char* name;
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
};

const Kernels& portable_kernels();
// nullptr when this build has no AVX2 code.
const Kernels* avx2_kernels();

// The largest tile the drivers ask for.
inline constexpr int kTileRows = 4;
inline constexpr int kTileTokens = 2;

}  // namespace batchlm::kernels::cpu
