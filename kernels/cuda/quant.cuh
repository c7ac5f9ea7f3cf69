#pragma once
// Internal to kernels/cuda/matmul.cu: the device layout of weight matrices (upload) and the
// dequantization of their 16-byte chunks, shared by the matrix-vector, tensor-core and
// get_rows kernels.
//
// A matrix's device layout has a type of its own (device_type below): the file's type for
// F32, F16, BF16, Q4_0, Q4_1, Q8_0 and Q4_K; Q5_0 goes up as Q8_0 (its q - 16 as int8, the
// same scale: the same values), Q5_1 and Q5_K as the device layout "Q5_K" (q as int8, an F32
// scale and min per 32 elements: the same values), and Q6_K as F16 (its elements rounded to
// F16: sixteen scales per 256 elements have no 32-element block to ride on).
//
// Device layout of a matrix of `rows` x `cols` (cols a multiple of 32, checked by the callers):
//
//   [0, quant_bytes)                      the element data, row-major, in 16-byte "chunks":
//                                         row r, chunk c at byte (r * chunks_per_row + c) * 16.
//   [scale_offset, scale_offset + scale_bytes)   per 32-element block, row-major
//                                         (row r, block b at index r * blocks_per_row + b):
//                                         Q4_0, Q8_0: uint16 (the fp16 scale d);
//                                         Q4_1: uint32 (d in the low half, m in the high half);
//                                         Q4_K, Q5_K: two floats {d, m}, the block's element
//                                         being d * q + m (a K sub-block's d * sc and
//                                         -dmin * min, as the CPU computes them).
//   [.., total)                           zero padding; every part starts 256-byte aligned.
//
// What a chunk holds (E = elements per chunk):
//   Q4_0 / Q4_1 / Q4_K (E = 32): one whole block's 16 bytes of quants: byte j holds element j
//                         in its low nibble and element j + 16 in its high nibble (Q4_0 and
//                         Q4_1 exactly as in GGUF; a Q4_K sub-block repacked so).
//   Q8_0 / Q5_K (E = 16): half a block: 16 int8 quants. Block b = chunks 2b and 2b + 1.
//   F16 / BF16 (E = 8):   8 consecutive 16-bit values.
//   F32 (E = 4):          4 consecutive floats.
// Float types have no scales (scale_bytes = 0): their data is the GGUF row-major data as is.
//
// Because cols is a multiple of 32, every row is a whole number of chunks and of blocks, and
// every chunk is 16-byte aligned (the quant part starts at the matrix base, which the host
// checks is 16-byte aligned; cudaMalloc gives 256).

#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "batchlm/kernels/dtype.hpp"

namespace batchlm::kernels::cuda::detail {

inline constexpr std::size_t kLayoutAlign = 256;
inline constexpr std::int64_t kBlockElems = 32;  // Q4_0, Q4_1, Q8_0 block size

__host__ __device__ constexpr std::size_t round_up(std::size_t v, std::size_t a) {
  return (v + a - 1) / a * a;
}

// The device layout a file type goes up in (the header above).
__host__ __device__ constexpr DType device_type(DType t) {
  switch (t) {
    case DType::Q5_0: return DType::Q8_0;
    case DType::Q5_1: return DType::Q5_K;
    case DType::Q6_K: return DType::F16;
    default: return t;
  }
}

// Elements per 16-byte chunk of a device layout, 0 for a type that is no device layout.
__host__ __device__ constexpr std::int64_t chunk_elems(DType t) {
  switch (t) {
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q4_K: return 32;
    case DType::Q8_0:
    case DType::Q5_K: return 16;
    case DType::F16:
    case DType::BF16: return 8;
    case DType::F32: return 4;
    default: return 0;
  }
}

// Bytes per block scale entry (0 for float types).
__host__ __device__ constexpr std::size_t scale_entry_bytes(DType t) {
  switch (t) {
    case DType::Q4_0:
    case DType::Q8_0: return 2;
    case DType::Q4_1: return 4;
    case DType::Q4_K:
    case DType::Q5_K: return 8;
    default: return 0;
  }
}

struct WeightLayout {
  std::int64_t chunks_per_row = 0;
  std::int64_t blocks_per_row = 0;  // 32-element blocks (cols / 32)
  std::size_t quant_bytes = 0;
  std::size_t scale_offset = 0;
  std::size_t scale_bytes = 0;
  std::size_t total = 0;
};

// Valid only for a supported type, rows >= 0 and cols a positive multiple of 32 (the host
// entry points check these before calling).
__host__ __device__ inline WeightLayout weight_layout(DType t, std::int64_t rows,
                                                      std::int64_t cols) {
  WeightLayout l;
  l.chunks_per_row = cols / chunk_elems(t);
  l.blocks_per_row = cols / kBlockElems;
  l.quant_bytes = static_cast<std::size_t>(rows) * static_cast<std::size_t>(l.chunks_per_row) * 16;
  l.scale_offset = round_up(l.quant_bytes, kLayoutAlign);
  l.scale_bytes = static_cast<std::size_t>(rows) * static_cast<std::size_t>(l.blocks_per_row) *
                  scale_entry_bytes(t);
  l.total = round_up(l.scale_offset + l.scale_bytes, kLayoutAlign);
  if (l.total == 0) l.total = kLayoutAlign;  // an empty matrix still gets a valid allocation
  return l;
}

// ---------------------------------------------------------------------------------------------
// Device helpers.

// Word i (0..3) of a 16-byte chunk. i is a compile-time constant after unrolling.
__device__ __forceinline__ std::uint32_t chunk_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// 2^23 + (byte k of v), exactly: the byte goes into the low mantissa bits of 2^23 (0x4B000000).
// Subtracting a constant near 2^23 then gives the small integer exactly (Sterbenz), without an
// int-to-float conversion instruction.
__device__ __forceinline__ float byte_plus_2p23(std::uint32_t v, int k) {
  return __uint_as_float(0x4B000000u | ((v >> (8 * k)) & 0xFFu));
}
inline constexpr float k2p23 = 8388608.0f;  // 2^23

__device__ __forceinline__ float half_lo(std::uint32_t v) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xFFFFu)));
}
__device__ __forceinline__ float half_hi(std::uint32_t v) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(v >> 16)));
}
__device__ __forceinline__ float bf16_lo(std::uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(std::uint32_t v) {
  return __uint_as_float(v & 0xFFFF0000u);
}

// Per type: a chunk's elements 4i .. 4i + 3 as floats (quad i, 0 <= i < kQuads), before the
// block scale. For the quantized types these are the integers of the format (exactly):
//   Q4_0: q - 8,  Q4_1: q,  Q8_0: q;   the element is then d * v (Q4_0, Q8_0), d * v + m (Q4_1).
// For float types they are the elements themselves.
template <DType T>
struct Chunk;

template <>
struct Chunk<DType::Q4_0> {
  static constexpr int kElems = 32;
  static constexpr int kQuads = 8;
  static constexpr bool kScaled = true;
  static constexpr bool kHasMin = false;
  __device__ __forceinline__ static void quad(const uint4& raw, int i, float (&w)[4]) {
    // Quad i < 4: low nibbles of word i (elements 4i..4i+3); quad i >= 4: high nibbles of word
    // i - 4 (elements 16 + 4(i-4) .. = 4i..4i+3).
    const std::uint32_t nib = (chunk_word(raw, i & 3) >> (i < 4 ? 0 : 4)) & 0x0F0F0F0Fu;
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = byte_plus_2p23(nib, k) - (k2p23 + 8.0f);
  }
};

template <>
struct Chunk<DType::Q4_1> {
  static constexpr int kElems = 32;
  static constexpr int kQuads = 8;
  static constexpr bool kScaled = true;
  static constexpr bool kHasMin = true;
  __device__ __forceinline__ static void quad(const uint4& raw, int i, float (&w)[4]) {
    const std::uint32_t nib = (chunk_word(raw, i & 3) >> (i < 4 ? 0 : 4)) & 0x0F0F0F0Fu;
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = byte_plus_2p23(nib, k) - k2p23;
  }
};

template <>
struct Chunk<DType::Q8_0> {
  static constexpr int kElems = 16;
  static constexpr int kQuads = 4;
  static constexpr bool kScaled = true;
  static constexpr bool kHasMin = false;
  __device__ __forceinline__ static void quad(const uint4& raw, int i, float (&w)[4]) {
    // int8 q -> unsigned q + 128 by flipping the sign bit of each byte.
    const std::uint32_t u = chunk_word(raw, i) ^ 0x80808080u;
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = byte_plus_2p23(u, k) - (k2p23 + 128.0f);
  }
};

// Q4_K's sub-blocks as Q4_1's nibbles (q), with an F32 scale and min.
template <>
struct Chunk<DType::Q4_K> : Chunk<DType::Q4_1> {};

// Q5_1 and Q5_K: q (0..31) as int8, as Q8_0's chunks hold them, with an F32 scale and min.
template <>
struct Chunk<DType::Q5_K> : Chunk<DType::Q8_0> {
  static constexpr bool kHasMin = true;
};

template <>
struct Chunk<DType::F16> {
  static constexpr int kElems = 8;
  static constexpr int kQuads = 2;
  static constexpr bool kScaled = false;
  static constexpr bool kHasMin = false;
  __device__ __forceinline__ static void quad(const uint4& raw, int i, float (&w)[4]) {
    const std::uint32_t a = chunk_word(raw, 2 * i), b = chunk_word(raw, 2 * i + 1);
    w[0] = half_lo(a);
    w[1] = half_hi(a);
    w[2] = half_lo(b);
    w[3] = half_hi(b);
  }
};

template <>
struct Chunk<DType::BF16> {
  static constexpr int kElems = 8;
  static constexpr int kQuads = 2;
  static constexpr bool kScaled = false;
  static constexpr bool kHasMin = false;
  __device__ __forceinline__ static void quad(const uint4& raw, int i, float (&w)[4]) {
    const std::uint32_t a = chunk_word(raw, 2 * i), b = chunk_word(raw, 2 * i + 1);
    w[0] = bf16_lo(a);
    w[1] = bf16_hi(a);
    w[2] = bf16_lo(b);
    w[3] = bf16_hi(b);
  }
};

template <>
struct Chunk<DType::F32> {
  static constexpr int kElems = 4;
  static constexpr int kQuads = 1;
  static constexpr bool kScaled = false;
  static constexpr bool kHasMin = false;
  __device__ __forceinline__ static void quad(const uint4& raw, int /*i*/, float (&w)[4]) {
    w[0] = __uint_as_float(raw.x);
    w[1] = __uint_as_float(raw.y);
    w[2] = __uint_as_float(raw.z);
    w[3] = __uint_as_float(raw.w);
  }
};

// The block scale (and min) of block `block` (a flat index r * blocks_per_row + b).
struct BlockScale {
  float d = 1.0f;
  float m = 0.0f;
};
template <DType T>
__device__ __forceinline__ BlockScale load_scale(const void* scales, std::int64_t block) {
  BlockScale s;
  if constexpr (T == DType::Q4_1) {
    const std::uint32_t dm = __ldg(static_cast<const unsigned int*>(scales) + block);
    s.d = half_lo(dm);
    s.m = half_hi(dm);
  } else if constexpr (T == DType::Q4_K || T == DType::Q5_K) {
    const float2 dm = __ldg(static_cast<const float2*>(scales) + block);
    s.d = dm.x;
    s.m = dm.y;
  } else if constexpr (T == DType::Q4_0 || T == DType::Q8_0) {
    const unsigned short d = __ldg(static_cast<const unsigned short*>(scales) + block);
    s.d = __half2float(__ushort_as_half(d));
  }
  return s;
}

}  // namespace batchlm::kernels::cuda::detail
