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
  Q8_0 = 8,   // 32 elements: fp16 scale d, 32 int8 q;                  x = d * q
  Q8_1 = 9,   // 32 elements: fp16 d, fp16 s = d * sum(q), 32 int8 q (activations only)
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

inline constexpr std::int64_t kQuantBlock = 32;

// nullopt for ids this build does not know (the GGUF reader reports those as errors).
std::optional<DType> dtype_from_id(std::uint32_t id);
std::string_view to_string(DType t);
std::int64_t block_size(DType t);   // elements per block (1 for F32/F16/BF16)
std::size_t block_bytes(DType t);   // bytes per block
// Bytes of a row of `n` elements; `n` must be a multiple of block_size(t).
inline std::size_t row_bytes(DType t, std::int64_t n) {
  return static_cast<std::size_t>(n / block_size(t)) * block_bytes(t);
}

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
