#pragma once
// Element types of weight tensors, with the numeric ids and block layouts that GGUF files use.
// A block holds `block_size(t)` consecutive elements of one row in `block_bytes(t)` bytes.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace batchlm::kernels {

enum class DType : std::uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,   // 32 elements: fp16 scale d, 16 bytes of 4-bit q;       x = d * (q - 8)
  Q4_1 = 3,   // 32 elements: fp16 scale d, fp16 min m, 16 bytes of q;  x = d * q + m
  Q5_0 = 6,   // 32 elements: fp16 d, 4 bytes of fifth bits, 16 bytes of q; x = d * (q - 16)
  Q5_1 = 7,   // 32 elements: fp16 d, fp16 m, fifth bits, 16 bytes of q;   x = d * q + m
  Q8_0 = 8,   // 32 elements: fp16 scale d, 32 int8 q;                  x = d * q
  Q8_1 = 9,   // 32 elements: fp16 d, fp16 s = d * sum(q), 32 int8 q (activations only)
  // The "K" types: super-blocks of 256 elements in sub-blocks with their own integer scales.
  Q4_K = 12,  // 8 sub-blocks of 32: x = d * sc_j * q - dmin * m_j, q in 0..15, 6-bit sc_j, m_j
  Q5_K = 13,  // the same with q in 0..31
  Q6_K = 14,  // 16 sub-blocks of 16: x = d * sc_j * (q - 32), q in 0..63, 8-bit signed sc_j
  Q8_K = 15,  // 256 elements: f32 d, 256 int8 q, sums of each 16 q (activations only)
  BF16 = 30,
};

// The element layout of the 4-bit blocks: byte j holds element j in its low nibble and
// element j + 16 in its high nibble.
struct BlockQ4_0 { std::uint16_t d; std::uint8_t qs[16]; };
struct BlockQ4_1 { std::uint16_t d; std::uint16_t m; std::uint8_t qs[16]; };
struct BlockQ8_0 { std::uint16_t d; std::int8_t qs[32]; };
struct BlockQ8_1 { std::uint16_t d; std::uint16_t s; std::int8_t qs[32]; };
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8_1) == 36);

// The 5-bit blocks: the low four bits as in Q4_0/Q4_1, the fifth bit of element j in bit j of
// qh (little-endian).
struct BlockQ5_0 { std::uint16_t d; std::uint8_t qh[4]; std::uint8_t qs[16]; };
struct BlockQ5_1 { std::uint16_t d; std::uint16_t m; std::uint8_t qh[4]; std::uint8_t qs[16]; };
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24);
// Element e (0..31) of a Q5_0 / Q5_1 block: its 5-bit q.
inline int q5_quant(const std::uint8_t* qs, const std::uint8_t* qh, int e) {
  const int low = e < 16 ? qs[e] & 0x0f : qs[e - 16] >> 4;
  return low | (((qh[e / 8] >> (e % 8)) & 1) << 4);
}

inline constexpr std::int64_t kQuantBlock = 32;
inline constexpr std::int64_t kSuperBlock = 256;

// Q4_K / Q5_K: `scales` packs eight 6-bit scales and eight 6-bit mins (k_scale_min below).
// Each 64 elements 64i..64i+63 use 32 bytes of qs: element 64i + l in the low nibble of
// qs[32i + l], element 64i + 32 + l in its high nibble. Q5_K's fifth bit of those two elements
// is bit 2i, respectively 2i + 1, of qh[l].
struct BlockQ4_K { std::uint16_t d; std::uint16_t dmin; std::uint8_t scales[12]; std::uint8_t qs[128]; };
struct BlockQ5_K {
  std::uint16_t d; std::uint16_t dmin; std::uint8_t scales[12]; std::uint8_t qh[32]; std::uint8_t qs[128];
};
// Q6_K: each half of 128 elements uses 64 bytes of ql and 32 of qh. Within half h, for l < 32:
// element l takes the low nibble of ql[l] and bits 0-1 of qh[l]; element 32 + l the low
// nibble of ql[32 + l] and bits 2-3; element 64 + l the high nibble of ql[l] and bits 4-5;
// element 96 + l the high nibble of ql[32 + l] and bits 6-7. Element e's scale is scales[e / 16].
struct BlockQ6_K { std::uint8_t ql[128]; std::uint8_t qh[64]; std::int8_t scales[16]; std::uint16_t d; };
struct BlockQ8_K { float d; std::int8_t qs[256]; std::int16_t bsums[16]; };

// Element e (0..255) of a Q4_K block (qh null) or of a Q5_K block: its q.
inline int k45_quant(const std::uint8_t* qs, const std::uint8_t* qh, int e) {
  const int i = e / 64, high = e % 64 / 32, l = e % 32;
  const int low = (qs[32 * i + l] >> (4 * high)) & 0x0f;
  return qh != nullptr ? low | (((qh[l] >> (2 * i + high)) & 1) << 4) : low;
}
// Element e (0..255) of a Q6_K block: its q (0..63).
inline int q6k_quant(const std::uint8_t* ql, const std::uint8_t* qh, int e) {
  const int h = e / 128, s = e % 128 / 32, l = e % 32;
  const int low = (ql[64 * h + l + 32 * (s & 1)] >> (4 * (s >> 1))) & 0x0f;
  return low | (((qh[32 * h + l] >> (2 * s)) & 3) << 4);
}
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292);

// Sub-block j (0..7) of a Q4_K / Q5_K block: its 6-bit scale and min.
inline void k_scale_min(const std::uint8_t* q, int j, std::uint8_t& sc, std::uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = static_cast<std::uint8_t>((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
    m = static_cast<std::uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// nullopt for ids this build does not know (the GGUF reader reports those as errors).
std::optional<DType> dtype_from_id(std::uint32_t id);
std::string_view to_string(DType t);
std::int64_t block_size(DType t);   // elements per block (1 for F32/F16/BF16)
std::size_t block_bytes(DType t);   // bytes per block
// Bytes of a row of `n` elements; `n` must be a multiple of block_size(t).
inline std::size_t row_bytes(DType t, std::int64_t n) {
  return static_cast<std::size_t>(n / block_size(t)) * block_bytes(t);
}

// Row of n elements (a multiple of block_size(t)) of a weight type to floats. Throws
// std::invalid_argument for the activation-only types Q8_1 and Q8_K.
void dequantize_row(DType t, const void* row, std::int64_t n, float* out);

// IEEE half and bfloat16 conversions (round to nearest even, as the hardware does).
float fp16_to_fp32(std::uint16_t h);
std::uint16_t fp32_to_fp16(float f);
inline float bf16_to_fp32(std::uint16_t h) {
  std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
std::uint16_t fp32_to_bf16(float f);

}  // namespace batchlm::kernels
