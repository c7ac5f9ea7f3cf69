#include "batchlm/kernels/dtype.hpp"

#include <bit>
#include <stdexcept>
#include <string>

namespace batchlm::kernels {

std::optional<DType> dtype_from_id(std::uint32_t id) {
  switch (id) {
    case 0: return DType::F32;
    case 1: return DType::F16;
    case 2: return DType::Q4_0;
    case 3: return DType::Q4_1;
    case 6: return DType::Q5_0;
    case 7: return DType::Q5_1;
    case 8: return DType::Q8_0;
    case 9: return DType::Q8_1;
    case 12: return DType::Q4_K;
    case 13: return DType::Q5_K;
    case 14: return DType::Q6_K;
    case 15: return DType::Q8_K;
    case 30: return DType::BF16;
    default: return std::nullopt;
  }
}

std::string_view to_string(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::Q4_0: return "Q4_0";
    case DType::Q4_1: return "Q4_1";
    case DType::Q5_0: return "Q5_0";
    case DType::Q5_1: return "Q5_1";
    case DType::Q8_0: return "Q8_0";
    case DType::Q8_1: return "Q8_1";
    case DType::Q4_K: return "Q4_K";
    case DType::Q5_K: return "Q5_K";
    case DType::Q6_K: return "Q6_K";
    case DType::Q8_K: return "Q8_K";
    case DType::BF16: return "BF16";
  }
  return "?";
}

std::int64_t block_size(DType t) {
  switch (t) {
    case DType::F32:
    case DType::F16:
    case DType::BF16: return 1;
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
    case DType::Q8_K: return kSuperBlock;
    default: return kQuantBlock;
  }
}

std::size_t block_bytes(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16:
    case DType::BF16: return 2;
    case DType::Q4_0: return sizeof(BlockQ4_0);
    case DType::Q4_1: return sizeof(BlockQ4_1);
    case DType::Q5_0: return sizeof(BlockQ5_0);
    case DType::Q5_1: return sizeof(BlockQ5_1);
    case DType::Q8_0: return sizeof(BlockQ8_0);
    case DType::Q8_1: return sizeof(BlockQ8_1);
    case DType::Q4_K: return sizeof(BlockQ4_K);
    case DType::Q5_K: return sizeof(BlockQ5_K);
    case DType::Q6_K: return sizeof(BlockQ6_K);
    case DType::Q8_K: return sizeof(BlockQ8_K);
  }
  return 0;
}

namespace {

template <typename Block>
const Block* blocks_of(const void* row) {
  return static_cast<const Block*>(row);
}

}  // namespace

void dequantize_row(DType t, const void* row, std::int64_t n, float* out) {
  const std::int64_t nb = n / block_size(t);
  switch (t) {
    case DType::F32: std::memcpy(out, row, static_cast<std::size_t>(n) * sizeof(float)); return;
    case DType::F16:
      for (std::int64_t j = 0; j < n; ++j) out[j] = fp16_to_fp32(blocks_of<std::uint16_t>(row)[j]);
      return;
    case DType::BF16:
      for (std::int64_t j = 0; j < n; ++j) out[j] = bf16_to_fp32(blocks_of<std::uint16_t>(row)[j]);
      return;
    case DType::Q8_0:
      for (std::int64_t k = 0; k < nb; ++k) {
        const BlockQ8_0& b = blocks_of<BlockQ8_0>(row)[k];
        const float d = fp16_to_fp32(b.d);
        for (int j = 0; j < 32; ++j) out[k * 32 + j] = d * static_cast<float>(b.qs[j]);
      }
      return;
    case DType::Q4_0:
      for (std::int64_t k = 0; k < nb; ++k) {
        const BlockQ4_0& b = blocks_of<BlockQ4_0>(row)[k];
        const float d = fp16_to_fp32(b.d);
        for (int j = 0; j < 16; ++j) {
          out[k * 32 + j] = d * static_cast<float>((b.qs[j] & 0x0f) - 8);
          out[k * 32 + j + 16] = d * static_cast<float>((b.qs[j] >> 4) - 8);
        }
      }
      return;
    case DType::Q4_1:
      for (std::int64_t k = 0; k < nb; ++k) {
        const BlockQ4_1& b = blocks_of<BlockQ4_1>(row)[k];
        const float d = fp16_to_fp32(b.d), m = fp16_to_fp32(b.m);
        for (int j = 0; j < 16; ++j) {
          out[k * 32 + j] = d * static_cast<float>(b.qs[j] & 0x0f) + m;
          out[k * 32 + j + 16] = d * static_cast<float>(b.qs[j] >> 4) + m;
        }
      }
      return;
    case DType::Q5_0:
      for (std::int64_t k = 0; k < nb; ++k) {
        const BlockQ5_0& b = blocks_of<BlockQ5_0>(row)[k];
        const float d = fp16_to_fp32(b.d);
        for (int e = 0; e < 32; ++e) out[k * 32 + e] = d * static_cast<float>(q5_quant(b.qs, b.qh, e) - 16);
      }
      return;
    case DType::Q5_1:
      for (std::int64_t k = 0; k < nb; ++k) {
        const BlockQ5_1& b = blocks_of<BlockQ5_1>(row)[k];
        const float d = fp16_to_fp32(b.d), m = fp16_to_fp32(b.m);
        for (int e = 0; e < 32; ++e) out[k * 32 + e] = d * static_cast<float>(q5_quant(b.qs, b.qh, e)) + m;
      }
      return;
    case DType::Q4_K:
    case DType::Q5_K:
      for (std::int64_t k = 0; k < nb; ++k) {
        // Q4_K and Q5_K share the header and the nibbles; Q5_K adds the fifth bits.
        const std::uint8_t* base = static_cast<const std::uint8_t*>(row) + k * block_bytes(t);
        const BlockQ4_K& h = *reinterpret_cast<const BlockQ4_K*>(base);
        const std::uint8_t* qh = t == DType::Q5_K ? reinterpret_cast<const BlockQ5_K*>(base)->qh : nullptr;
        const std::uint8_t* qs = t == DType::Q5_K ? reinterpret_cast<const BlockQ5_K*>(base)->qs : h.qs;
        const float d = fp16_to_fp32(h.d), dmin = fp16_to_fp32(h.dmin);
        float* o = out + k * kSuperBlock;
        for (int j = 0; j < 8; ++j) {
          std::uint8_t sc, m;
          k_scale_min(h.scales, j, sc, m);
          const float dj = d * sc, minj = dmin * m;
          for (int e = 32 * j; e < 32 * j + 32; ++e) o[e] = dj * static_cast<float>(k45_quant(qs, qh, e)) - minj;
        }
      }
      return;
    case DType::Q6_K:
      for (std::int64_t k = 0; k < nb; ++k) {
        const BlockQ6_K& b = blocks_of<BlockQ6_K>(row)[k];
        const float d = fp16_to_fp32(b.d);
        for (int e = 0; e < kSuperBlock; ++e)
          out[k * kSuperBlock + e] = d * static_cast<float>(b.scales[e / 16]) * static_cast<float>(q6k_quant(b.ql, b.qh, e) - 32);
      }
      return;
    case DType::Q8_1:
    case DType::Q8_K: break;
  }
  throw std::invalid_argument("dequantize_row: " + std::string(to_string(t)) + " is not a weight type");
}

float fp16_to_fp32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

std::uint16_t fp32_to_fp16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow
  if (abs < 0x38800000u) {  // subnormal or zero in half
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);
    const std::uint32_t e = abs >> 23;
    const std::uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - e;  // 14..24
    std::uint32_t half = m >> (shift);
    const std::uint32_t rem = m & ((1u << shift) - 1);
    const std::uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t half = ((abs - 0x38000000u) >> 13);
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<std::uint16_t>(sign | half);
}

std::uint16_t fp32_to_bf16(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

}  // namespace batchlm::kernels
