#include "gguf_writer.hpp"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numbers>
#include <random>
#include <stdexcept>
#include <utility>

namespace batchlm::testing {

static_assert(std::endian::native == std::endian::little, "GGUF is little-endian");

namespace {

// Appends `value`'s bytes (little-endian, as the host is). resize + memcpy rather than
// insert, which GCC 12 flags with a false -Wstringop-overflow on a fresh vector.
template <class T>
void put(std::vector<std::byte>& out, T value) {
  const std::size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

void put_string(std::vector<std::byte>& out, std::string_view s) {
  put<std::uint64_t>(out, s.size());
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), p, p + s.size());
}

template <class T>
GgufValue scalar(GgufType type, T value) {
  GgufValue v;
  v.type = static_cast<std::uint32_t>(type);
  put(v.bytes, value);
  return v;
}

std::uint64_t align_up(std::uint64_t n, std::uint64_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

std::int64_t element_count(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

// ---- Quantization: one block of 32 floats at a time, as ggml's reference code does it. -------

kernels::BlockQ8_0 quantize_q8_0(const float* x) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  // d = amax / 127, q = round(x / d); ggml multiplies by the reciprocal, and so do we, so that
  // the blocks match llama.cpp's to the bit.
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ8_0 block{};
  block.d = kernels::fp32_to_fp16(d);
  for (int j = 0; j < 32; ++j) block.qs[j] = static_cast<std::int8_t>(std::round(x[j] * id));
  return block;
}

kernels::BlockQ8_1 quantize_q8_1(const float* x) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ8_1 block{};
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    block.qs[j] = static_cast<std::int8_t>(std::round(x[j] * id));
    sum += block.qs[j];
  }
  block.d = kernels::fp32_to_fp16(d);
  block.s = kernels::fp32_to_fp16(static_cast<float>(sum) * d);
  return block;
}

kernels::BlockQ4_0 quantize_q4_0(const float* x) {
  // The signed value of largest magnitude maps to q = 0, i.e. -8 after the offset: d = max / -8.
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ4_0 block{};
  block.d = kernels::fp32_to_fp16(d);
  for (int j = 0; j < 16; ++j) {
    // x * id lies in [-8, 8], so the sum is in [0.5, 16.5] and the truncation is well defined.
    const int lo = std::min(15, static_cast<int>(x[j] * id + 8.5f));
    const int hi = std::min(15, static_cast<int>(x[j + 16] * id + 8.5f));
    block.qs[j] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
  return block;
}

kernels::BlockQ4_1 quantize_q4_1(const float* x) {
  float min = x[0], max = x[0];
  for (int j = 1; j < 32; ++j) {
    min = std::min(min, x[j]);
    max = std::max(max, x[j]);
  }
  const float d = (max - min) / 15.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ4_1 block{};
  block.d = kernels::fp32_to_fp16(d);
  block.m = kernels::fp32_to_fp16(min);
  for (int j = 0; j < 16; ++j) {
    const int lo = std::min(15, static_cast<int>((x[j] - min) * id + 0.5f));
    const int hi = std::min(15, static_cast<int>((x[j + 16] - min) * id + 0.5f));
    block.qs[j] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
  return block;
}

kernels::BlockQ5_0 quantize_q5_0(const float* x) {
  // As Q4_0 with 5 bits: the signed value of largest magnitude maps to q = 0, d = max / -16.
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -16.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ5_0 block{};
  block.d = kernels::fp32_to_fp16(d);
  std::uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    // x * id lies in [-16, 16], so the sum is in [0.5, 32.5].
    const int lo = std::min(31, static_cast<int>(x[j] * id + 16.5f));
    const int hi = std::min(31, static_cast<int>(x[j + 16] * id + 16.5f));
    block.qs[j] = static_cast<std::uint8_t>((lo & 0x0f) | ((hi & 0x0f) << 4));
    qh |= static_cast<std::uint32_t>(lo >> 4) << j;
    qh |= static_cast<std::uint32_t>(hi >> 4) << (j + 16);
  }
  std::memcpy(block.qh, &qh, sizeof qh);
  return block;
}

kernels::BlockQ5_1 quantize_q5_1(const float* x) {
  float min = x[0], max = x[0];
  for (int j = 1; j < 32; ++j) {
    min = std::min(min, x[j]);
    max = std::max(max, x[j]);
  }
  const float d = (max - min) / 31.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  kernels::BlockQ5_1 block{};
  block.d = kernels::fp32_to_fp16(d);
  block.m = kernels::fp32_to_fp16(min);
  std::uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    const int lo = std::min(31, static_cast<int>((x[j] - min) * id + 0.5f));
    const int hi = std::min(31, static_cast<int>((x[j + 16] - min) * id + 0.5f));
    block.qs[j] = static_cast<std::uint8_t>((lo & 0x0f) | ((hi & 0x0f) << 4));
    qh |= static_cast<std::uint32_t>(lo >> 4) << j;
    qh |= static_cast<std::uint32_t>(hi >> 4) << (j + 16);
  }
  std::memcpy(block.qh, &qh, sizeof qh);
  return block;
}

// ---- The K types: one super-block of 256 floats at a time. --------------------------------
// Plain formulas of our own (not ggml's search for the best scales): good enough for tests,
// and every field of the layout is exercised.

int clamped_round(float v, int lo, int hi) {
  return std::clamp(static_cast<int>(std::round(v)), lo, hi);
}

// Q4_K / Q5_K without the bit packing: per sub-block of 32 a scale and a min, x ~ d * sc_j * q
// - dmin * m_j with q in 0..max_q (fit_scale_min); d and dmin are the largest sub-block scale
// and min over 63, and sc_j, m_j their 6-bit multiples.
struct ScaledMin {
  std::uint16_t d = 0, dmin = 0;
  std::uint8_t sc[8] = {}, m[8] = {};
  std::uint8_t q[256] = {};
};

// One sub-block of 32: x ~ scale * q - min with q in 0..max_q, min >= 0. Starts from the
// range [min(0, lowest), highest], then refines a few times by least squares: the best scale
// and min for the current q, then q for those (min kept >= 0); keeps the best fit seen.
void fit_scale_min(const float* x, int max_q, float& scale, float& min) {
  float lo = 0.0f, hi = x[0];
  for (int l = 0; l < 32; ++l) {
    lo = std::min(lo, x[l]);
    hi = std::max(hi, x[l]);
  }
  scale = (hi - lo) / static_cast<float>(max_q);
  min = -lo;
  if (scale == 0.0f) return;
  const auto error = [&](float s, float m) {
    double e = 0;
    for (int l = 0; l < 32; ++l) {
      const float q = static_cast<float>(clamped_round((x[l] + m) / s, 0, max_q));
      e += (double(s) * q - m - x[l]) * (double(s) * q - m - x[l]);
    }
    return e;
  };
  double best = error(scale, min);
  float s = scale, m = min;
  for (int iteration = 0; iteration < 4; ++iteration) {
    double sq = 0, sqq = 0, sx = 0, sqx = 0;
    for (int l = 0; l < 32; ++l) {
      const double q = clamped_round((x[l] + m) / s, 0, max_q);
      sq += q, sqq += q * q, sx += x[l], sqx += q * x[l];
    }
    const double det = 32 * sqq - sq * sq;
    if (det <= 0) break;
    double a = (32 * sqx - sq * sx) / det, b = (sx - a * sq) / 32;  // x ~ a q + b
    if (b > 0) b = 0, a = sqx / sqq;
    if (a <= 0) break;
    s = static_cast<float>(a);
    m = static_cast<float>(-b);
    const double e = error(s, m);
    if (e < best) best = e, scale = s, min = m;
  }
}

ScaledMin quantize_scaled_min(const float* x, int max_q) {
  float scale[8], min[8];
  float max_scale = 0.0f, max_min = 0.0f;
  for (int j = 0; j < 8; ++j) {
    fit_scale_min(x + 32 * j, max_q, scale[j], min[j]);
    max_scale = std::max(max_scale, scale[j]);
    max_min = std::max(max_min, min[j]);
  }
  ScaledMin out;
  out.d = kernels::fp32_to_fp16(max_scale / 63.0f);
  out.dmin = kernels::fp32_to_fp16(max_min / 63.0f);
  // The rest from the stored (rounded) d and dmin, so that the blocks decode to what they mean.
  const float d = kernels::fp16_to_fp32(out.d), dmin = kernels::fp16_to_fp32(out.dmin);
  for (int j = 0; j < 8; ++j) {
    out.sc[j] = static_cast<std::uint8_t>(d > 0.0f ? clamped_round(scale[j] / d, 0, 63) : 0);
    out.m[j] = static_cast<std::uint8_t>(dmin > 0.0f ? clamped_round(min[j] / dmin, 0, 63) : 0);
    const float step = d * static_cast<float>(out.sc[j]);
    const float offset = dmin * static_cast<float>(out.m[j]);
    for (int l = 0; l < 32; ++l) {
      const float v = x[32 * j + l];
      out.q[32 * j + l] = static_cast<std::uint8_t>(step > 0.0f ? clamped_round((v + offset) / step, 0, max_q) : 0);
    }
  }
  return out;
}

// The 12 bytes of eight 6-bit scales and mins: bytes 0-3 hold sc_0..3 in their low 6 bits,
// bytes 4-7 m_0..3; sub-blocks 4..7 keep their low 4 bits in bytes 8-11 (sc low, m high) and
// their top 2 bits in the top bits of bytes 0-3 (sc) and 4-7 (m).
void pack_scales(const ScaledMin& s, std::uint8_t* scales) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = static_cast<std::uint8_t>(s.sc[j] | ((s.sc[j + 4] >> 4) << 6));
    scales[j + 4] = static_cast<std::uint8_t>(s.m[j] | ((s.m[j + 4] >> 4) << 6));
    scales[j + 8] = static_cast<std::uint8_t>((s.sc[j + 4] & 0x0f) | ((s.m[j + 4] & 0x0f) << 4));
  }
}

// Element 64i + l in the low nibble of qs[32i + l], element 64i + 32 + l in its high nibble.
void pack_nibbles(const std::uint8_t* q, std::uint8_t* qs) {
  for (int i = 0; i < 4; ++i)
    for (int l = 0; l < 32; ++l)
      qs[32 * i + l] = static_cast<std::uint8_t>((q[64 * i + l] & 0x0f) | ((q[64 * i + 32 + l] & 0x0f) << 4));
}

kernels::BlockQ4_K quantize_q4_k(const float* x) {
  const ScaledMin s = quantize_scaled_min(x, 15);
  kernels::BlockQ4_K block{};
  block.d = s.d;
  block.dmin = s.dmin;
  pack_scales(s, block.scales);
  pack_nibbles(s.q, block.qs);
  return block;
}

kernels::BlockQ5_K quantize_q5_k(const float* x) {
  const ScaledMin s = quantize_scaled_min(x, 31);
  kernels::BlockQ5_K block{};
  block.d = s.d;
  block.dmin = s.dmin;
  pack_scales(s, block.scales);
  pack_nibbles(s.q, block.qs);
  // The fifth bit of element 64i + l is bit 2i of qh[l], of element 64i + 32 + l bit 2i + 1.
  for (int i = 0; i < 4; ++i)
    for (int l = 0; l < 32; ++l) {
      block.qh[l] = static_cast<std::uint8_t>(block.qh[l] | ((s.q[64 * i + l] >> 4) << (2 * i)));
      block.qh[l] = static_cast<std::uint8_t>(block.qh[l] | ((s.q[64 * i + 32 + l] >> 4) << (2 * i + 1)));
    }
  return block;
}

kernels::BlockQ6_K quantize_q6_k(const float* x) {
  // Per sub-block of 16 a signed scale that maps its value of largest magnitude to q - 32 =
  // -32 (as Q4_0 does); d is the largest |scale| over 127 and sc_j the int8 multiples of d.
  float scale[16];
  float max_abs_scale = 0.0f;
  for (int j = 0; j < 16; ++j) {
    float amax = 0.0f, max = 0.0f;
    for (int l = 0; l < 16; ++l) {
      if (std::fabs(x[16 * j + l]) > amax) {
        amax = std::fabs(x[16 * j + l]);
        max = x[16 * j + l];
      }
    }
    scale[j] = max / -32.0f;
    max_abs_scale = std::max(max_abs_scale, std::fabs(scale[j]));
  }
  kernels::BlockQ6_K block{};
  block.d = kernels::fp32_to_fp16(max_abs_scale / 127.0f);
  const float d = kernels::fp16_to_fp32(block.d);
  std::uint8_t q[256];
  for (int j = 0; j < 16; ++j) {
    const int sc = d > 0.0f ? clamped_round(scale[j] / d, -127, 127) : 0;
    block.scales[j] = static_cast<std::int8_t>(sc);
    const float step = d * static_cast<float>(sc);
    for (int l = 0; l < 16; ++l)
      q[16 * j + l] = static_cast<std::uint8_t>(sc != 0 ? clamped_round(x[16 * j + l] / step, -32, 31) + 32 : 32);
  }
  // Each half of 128: for l < 32, element l (low nibble of ql[l], qh bits 0-1), 32 + l (low
  // nibble of ql[32 + l], bits 2-3), 64 + l (high nibble of ql[l], bits 4-5), 96 + l (high
  // nibble of ql[32 + l], bits 6-7).
  for (int h = 0; h < 2; ++h) {
    const std::uint8_t* qh_half = q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      const int q0 = qh_half[l], q1 = qh_half[32 + l], q2 = qh_half[64 + l], q3 = qh_half[96 + l];
      block.ql[64 * h + l] = static_cast<std::uint8_t>((q0 & 0x0f) | ((q2 & 0x0f) << 4));
      block.ql[64 * h + 32 + l] = static_cast<std::uint8_t>((q1 & 0x0f) | ((q3 & 0x0f) << 4));
      block.qh[32 * h + l] = static_cast<std::uint8_t>((q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6));
    }
  }
  return block;
}

template <class Block, class F>
void quantize_blocks(std::vector<std::byte>& out, std::span<const float> values, F quantize_block,
                     std::size_t elements = 32) {
  for (std::size_t i = 0; i < values.size(); i += elements) put<Block>(out, quantize_block(&values[i]));
}

template <class Block>
Block block_at(std::span<const std::byte> data, std::int64_t index) {
  Block block;
  std::memcpy(&block, data.data() + static_cast<std::size_t>(index) * sizeof(Block), sizeof block);
  return block;
}

}  // namespace

// ---- GgufValue -----------------------------------------------------------------------------

GgufValue GgufValue::u8(std::uint8_t v) { return scalar(GgufType::U8, v); }
GgufValue GgufValue::i8(std::int8_t v) { return scalar(GgufType::I8, v); }
GgufValue GgufValue::u16(std::uint16_t v) { return scalar(GgufType::U16, v); }
GgufValue GgufValue::i16(std::int16_t v) { return scalar(GgufType::I16, v); }
GgufValue GgufValue::u32(std::uint32_t v) { return scalar(GgufType::U32, v); }
GgufValue GgufValue::i32(std::int32_t v) { return scalar(GgufType::I32, v); }
GgufValue GgufValue::f32(float v) { return scalar(GgufType::F32, v); }
GgufValue GgufValue::boolean(bool v) { return scalar(GgufType::Bool, static_cast<std::uint8_t>(v)); }
GgufValue GgufValue::u64(std::uint64_t v) { return scalar(GgufType::U64, v); }
GgufValue GgufValue::i64(std::int64_t v) { return scalar(GgufType::I64, v); }
GgufValue GgufValue::f64(double v) { return scalar(GgufType::F64, v); }

GgufValue GgufValue::str(std::string_view v) {
  GgufValue value;
  value.type = static_cast<std::uint32_t>(GgufType::String);
  put_string(value.bytes, v);
  return value;
}

GgufValue GgufValue::array(GgufType element_type, const std::vector<GgufValue>& items) {
  GgufValue value;
  value.type = static_cast<std::uint32_t>(GgufType::Array);
  put<std::uint32_t>(value.bytes, static_cast<std::uint32_t>(element_type));
  put<std::uint64_t>(value.bytes, items.size());
  for (const GgufValue& item : items) {
    if (item.type != static_cast<std::uint32_t>(element_type)) {
      throw std::invalid_argument("GgufValue::array: an item's type differs from the element type");
    }
    value.bytes.insert(value.bytes.end(), item.bytes.begin(), item.bytes.end());
  }
  return value;
}

GgufValue GgufValue::str_array(const std::vector<std::string>& items) {
  std::vector<GgufValue> values;
  values.reserve(items.size());
  for (const std::string& s : items) values.push_back(str(s));
  return array(GgufType::String, values);
}

GgufValue GgufValue::i32_array(std::span<const std::int32_t> items) {
  std::vector<GgufValue> values;
  for (std::int32_t v : items) values.push_back(i32(v));
  return array(GgufType::I32, values);
}

GgufValue GgufValue::u32_array(std::span<const std::uint32_t> items) {
  std::vector<GgufValue> values;
  for (std::uint32_t v : items) values.push_back(u32(v));
  return array(GgufType::U32, values);
}

GgufValue GgufValue::f32_array(std::span<const float> items) {
  std::vector<GgufValue> values;
  for (float v : items) values.push_back(f32(v));
  return array(GgufType::F32, values);
}

GgufValue GgufValue::raw(std::uint32_t type, std::vector<std::byte> bytes) {
  GgufValue value;
  value.type = type;
  value.bytes = std::move(bytes);
  return value;
}

// ---- Quantization --------------------------------------------------------------------------

std::vector<std::byte> quantize(DType type, std::span<const float> values) {
  if (values.size() % static_cast<std::size_t>(kernels::block_size(type)) != 0) {
    throw std::invalid_argument("quantize: " + std::to_string(values.size()) +
                                " values are not whole blocks of " +
                                std::string(kernels::to_string(type)));
  }
  std::vector<std::byte> out;
  out.reserve(kernels::row_bytes(type, static_cast<std::int64_t>(values.size())));
  switch (type) {
    case DType::F32:
      for (float v : values) put(out, v);
      break;
    case DType::F16:
      for (float v : values) put(out, kernels::fp32_to_fp16(v));
      break;
    case DType::BF16:
      for (float v : values) put(out, kernels::fp32_to_bf16(v));
      break;
    case DType::Q8_0: quantize_blocks<kernels::BlockQ8_0>(out, values, quantize_q8_0); break;
    case DType::Q8_1: quantize_blocks<kernels::BlockQ8_1>(out, values, quantize_q8_1); break;
    case DType::Q4_0: quantize_blocks<kernels::BlockQ4_0>(out, values, quantize_q4_0); break;
    case DType::Q4_1: quantize_blocks<kernels::BlockQ4_1>(out, values, quantize_q4_1); break;
    case DType::Q5_0: quantize_blocks<kernels::BlockQ5_0>(out, values, quantize_q5_0); break;
    case DType::Q5_1: quantize_blocks<kernels::BlockQ5_1>(out, values, quantize_q5_1); break;
    case DType::Q4_K: quantize_blocks<kernels::BlockQ4_K>(out, values, quantize_q4_k, 256); break;
    case DType::Q5_K: quantize_blocks<kernels::BlockQ5_K>(out, values, quantize_q5_k, 256); break;
    case DType::Q6_K: quantize_blocks<kernels::BlockQ6_K>(out, values, quantize_q6_k, 256); break;
    default:
      throw std::invalid_argument("quantize: no quantizer for " + std::string(kernels::to_string(type)));
  }
  return out;
}

std::vector<float> dequantize(DType type, std::span<const std::byte> data, std::int64_t n) {
  if (n % kernels::block_size(type) != 0 || data.size() < kernels::row_bytes(type, n)) {
    throw std::invalid_argument("dequantize: too few bytes or not whole blocks");
  }
  std::vector<float> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const auto index = static_cast<std::size_t>(i);
    switch (type) {
      case DType::F32: std::memcpy(&out[index], data.data() + 4 * index, 4); break;
      case DType::F16:
      case DType::BF16: {
        std::uint16_t h;
        std::memcpy(&h, data.data() + 2 * index, 2);
        out[index] = type == DType::F16 ? kernels::fp16_to_fp32(h) : kernels::bf16_to_fp32(h);
        break;
      }
      case DType::Q8_0: {
        const auto block = block_at<kernels::BlockQ8_0>(data, i / 32);
        out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(block.qs[i % 32]);
        break;
      }
      case DType::Q8_1: {
        const auto block = block_at<kernels::BlockQ8_1>(data, i / 32);
        out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(block.qs[i % 32]);
        break;
      }
      case DType::Q4_0:
      case DType::Q4_1: {
        // Byte j holds element j in its low nibble and element j + 16 in its high nibble.
        const std::int64_t j = i % 32;
        const auto nibble = [&](const std::uint8_t* qs) {
          return j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
        };
        if (type == DType::Q4_0) {
          const auto block = block_at<kernels::BlockQ4_0>(data, i / 32);
          out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(nibble(block.qs) - 8);
        } else {
          const auto block = block_at<kernels::BlockQ4_1>(data, i / 32);
          out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(nibble(block.qs)) +
                       kernels::fp16_to_fp32(block.m);
        }
        break;
      }
      case DType::Q5_0:
      case DType::Q5_1: {
        // The low four bits as in Q4_0 / Q4_1; the fifth bit of element j is bit j of qh.
        const std::int64_t j = i % 32;
        const auto q = [&](const std::uint8_t* qs, const std::uint8_t* qh) {
          const int low = j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
          return low | (((qh[j / 8] >> (j % 8)) & 1) << 4);
        };
        if (type == DType::Q5_0) {
          const auto block = block_at<kernels::BlockQ5_0>(data, i / 32);
          out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(q(block.qs, block.qh) - 16);
        } else {
          const auto block = block_at<kernels::BlockQ5_1>(data, i / 32);
          out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(q(block.qs, block.qh)) +
                       kernels::fp16_to_fp32(block.m);
        }
        break;
      }
      case DType::Q4_K:
      case DType::Q5_K: {
        // Sub-block j of 32; each 64 elements (pair) share 32 bytes of qs, low then high nibbles.
        const std::int64_t e = i % 256, j = e / 32, l = e % 32, pair = e / 64;
        const int high = e % 64 >= 32 ? 1 : 0;
        const auto value = [&](const auto& block, int fifth) {
          const std::uint8_t byte = block.qs[32 * pair + l];
          const int q = (high ? byte >> 4 : byte & 0x0f) | (fifth << 4);
          // The 6-bit scale and min of sub-block j (see pack_scales).
          const std::uint8_t* s = block.scales;
          const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
          const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
          return kernels::fp16_to_fp32(block.d) * static_cast<float>(sc) * static_cast<float>(q) -
                 kernels::fp16_to_fp32(block.dmin) * static_cast<float>(m);
        };
        if (type == DType::Q4_K) {
          out[index] = value(block_at<kernels::BlockQ4_K>(data, i / 256), 0);
        } else {
          const auto block = block_at<kernels::BlockQ5_K>(data, i / 256);
          out[index] = value(block, (block.qh[l] >> (2 * pair + high)) & 1);
        }
        break;
      }
      case DType::Q6_K: {
        const auto block = block_at<kernels::BlockQ6_K>(data, i / 256);
        // Half h of 128 elements; within it, quarter s of 32 and position l.
        const std::int64_t e = i % 256, h = e / 128, s = e % 128 / 32, l = e % 32;
        const std::uint8_t low = block.ql[64 * h + 32 * (s % 2) + l];
        const int q = (s < 2 ? low & 0x0f : low >> 4) | (((block.qh[32 * h + l] >> (2 * s)) & 3) << 4);
        out[index] = kernels::fp16_to_fp32(block.d) * static_cast<float>(block.scales[e / 16]) *
                     static_cast<float>(q - 32);
        break;
      }
      default:
        throw std::invalid_argument("dequantize: no dequantizer for " + std::string(kernels::to_string(type)));
    }
  }
  return out;
}

std::filesystem::path fresh_dir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
  return tmpl;
}

void write_file(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

// ---- GgufWriter ----------------------------------------------------------------------------

GgufWriter& GgufWriter::add(std::string key, GgufValue value) {
  metadata_.emplace_back(std::move(key), std::move(value));
  return *this;
}

GgufWriter& GgufWriter::set_alignment(std::uint32_t alignment) {
  alignment_ = std::has_single_bit(alignment) ? alignment : 32;
  return add("general.alignment", GgufValue::u32(alignment));
}

GgufWriter& GgufWriter::add_tensor(std::string name, DType type, std::vector<std::int64_t> shape,
                                   std::vector<std::byte> data) {
  if (shape.empty() || shape[0] % kernels::block_size(type) != 0) {
    throw std::invalid_argument("add_tensor " + name + ": rows are not whole blocks");
  }
  const std::int64_t rows = element_count(shape) / shape[0];
  if (data.size() != kernels::row_bytes(type, shape[0]) * static_cast<std::size_t>(rows)) {
    throw std::invalid_argument("add_tensor " + name + ": " + std::to_string(data.size()) +
                                " bytes do not match the shape");
  }
  tensors_.push_back(Tensor{std::move(name), type, std::move(shape), std::move(data), {}});
  return *this;
}

GgufWriter& GgufWriter::add_tensor(std::string name, DType type, std::vector<std::int64_t> shape,
                                   std::span<const float> values) {
  if (static_cast<std::int64_t>(values.size()) != element_count(shape)) {
    throw std::invalid_argument("add_tensor " + name + ": " + std::to_string(values.size()) +
                                " values do not match the shape");
  }
  auto data = quantize(type, values);
  return add_tensor(std::move(name), type, std::move(shape), std::move(data));
}

GgufWriter& GgufWriter::override_tensor(std::string_view name, TensorOverride override_with) {
  for (Tensor& tensor : tensors_) {
    if (tensor.name == name) {
      tensor.override_with = std::move(override_with);
      return *this;
    }
  }
  throw std::invalid_argument("override_tensor: no tensor " + std::string(name));
}

GgufWriter& GgufWriter::set_magic(std::string magic) {
  magic_ = std::move(magic);
  return *this;
}

GgufWriter& GgufWriter::set_version(std::uint32_t version) {
  version_ = version;
  return *this;
}

GgufWriter& GgufWriter::set_tensor_count(std::uint64_t count) {
  tensor_count_ = count;
  return *this;
}

GgufWriter& GgufWriter::set_kv_count(std::uint64_t count) {
  kv_count_ = count;
  return *this;
}

GgufWriter& GgufWriter::append_bytes(std::vector<std::byte> bytes) {
  trailer_.insert(trailer_.end(), bytes.begin(), bytes.end());
  return *this;
}

GgufWriter::Encoded GgufWriter::encode() const {
  Encoded encoded;
  std::vector<std::byte>& out = encoded.bytes;

  // Header.
  const auto* magic = reinterpret_cast<const std::byte*>(magic_.data());
  out.insert(out.end(), magic, magic + magic_.size());
  put<std::uint32_t>(out, version_);
  put<std::uint64_t>(out, tensor_count_.value_or(tensors_.size()));
  put<std::uint64_t>(out, kv_count_.value_or(metadata_.size()));

  for (const auto& [key, value] : metadata_) {
    put_string(out, key);
    put<std::uint32_t>(out, value.type);
    out.insert(out.end(), value.bytes.begin(), value.bytes.end());
  }

  // Tensor table: each tensor's data at the next aligned offset after the previous one's.
  std::uint64_t cursor = 0;
  for (const Tensor& tensor : tensors_) {
    const std::uint64_t offset = align_up(cursor, alignment_);
    encoded.tensor_offsets.push_back(offset);
    cursor = offset + tensor.data.size();

    const TensorOverride& o = tensor.override_with;
    std::vector<std::uint64_t> dims(tensor.shape.begin(), tensor.shape.end());
    if (o.dims) dims = *o.dims;
    put_string(out, tensor.name);
    put<std::uint32_t>(out, o.n_dims.value_or(static_cast<std::uint32_t>(dims.size())));
    for (std::uint64_t d : dims) put<std::uint64_t>(out, d);
    put<std::uint32_t>(out, o.type_id.value_or(static_cast<std::uint32_t>(tensor.type)));
    put<std::uint64_t>(out, o.offset.value_or(offset));
  }

  // Data section. No padding after the last tensor, so any shorter prefix of the file cuts
  // into some tensor's data.
  encoded.data_start = align_up(out.size(), alignment_);
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    out.resize(encoded.data_start + encoded.tensor_offsets[i]);
    out.insert(out.end(), tensors_[i].data.begin(), tensors_[i].data.end());
  }
  if (tensors_.empty()) out.resize(encoded.data_start);
  out.insert(out.end(), trailer_.begin(), trailer_.end());
  return encoded;
}

void GgufWriter::write(const std::filesystem::path& path) const { write_file(path, encode().bytes); }

void GgufWriter::write_truncated(const std::filesystem::path& path, std::size_t size) const {
  const Encoded encoded = encode();
  write_file(path, std::span(encoded.bytes).first(std::min(size, encoded.bytes.size())));
}

// ---- Tiny Llama ----------------------------------------------------------------------------

namespace {

std::string utf8(std::uint32_t code_point) {
  std::string out;
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xc0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  } else {
    out += static_cast<char>(0xe0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  }
  return out;
}

// GPT-2's byte-level alphabet: a byte that is a printable Latin-1 character stands for itself;
// the other 68 (controls, space, DEL, NBSP, soft hyphen) take the code points 256, 257, ... in
// byte order, so that every token is printable text ("Ġ" is the space, "Ċ" the newline).
std::vector<std::string> byte_level_alphabet() {
  std::vector<std::string> alphabet(256);
  std::uint32_t next = 256;
  for (std::uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    alphabet[b] = utf8(printable ? b : next++);
  }
  return alphabet;
}

// Deterministic in the seed on every platform (std::normal_distribution is not).
class NormalRandom {
 public:
  explicit NormalRandom(std::uint64_t seed) : engine_(seed) {}

  float next() {
    // Box-Muller; u1 in (0, 1] keeps the log finite.
    const double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(engine_() >> 11) * 0x1.0p-53;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2));
  }

 private:
  std::mt19937_64 engine_;
};

// llama.cpp's general.file_type (LLAMA_FTYPE_*) for a model whose matrices are `type`.
std::uint32_t file_type(DType type) {
  switch (type) {
    case DType::F32: return 0;
    case DType::F16: return 1;
    case DType::Q4_0: return 2;
    case DType::Q4_1: return 3;
    case DType::Q8_0: return 7;
    case DType::Q5_0: return 8;
    case DType::Q5_1: return 9;
    case DType::Q4_K: return 15;  // Q4_K_M
    case DType::Q5_K: return 17;  // Q5_K_M
    case DType::Q6_K: return 18;
    case DType::BF16: return 32;
    default: break;
  }
  throw std::invalid_argument("write_tiny_llama: no model file type for " +
                              std::string(kernels::to_string(type)));
}

}  // namespace

TinyLlamaOptions tiny_qwen3_reference() {
  TinyLlamaOptions o;
  o.architecture = "qwen3";
  o.n_embd = 256;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.head_dim = 128;
  o.n_ff = 512;
  o.n_layers = 2;
  o.context_length = 4096;
  o.rope_freq_base = 1e6f;
  o.rms_norm_eps = 1e-6f;
  o.seed = 3;
  return o;
}

TinyLlamaInfo tiny_llama_vocab() {
  TinyLlamaInfo info;
  // Special tokens first, as in SmolLM2: <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2.
  info.tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  const auto alphabet = byte_level_alphabet();
  info.tokens.insert(info.tokens.end(), alphabet.begin(), alphabet.end());
  // Merges by rank, chosen so that common English words ("Hello", " world", " the", " and",
  // "ing") become single tokens. Each merge's result is a token, after the byte tokens.
  info.merges = {
      "Ġ t",   "Ġ a",    "h e",     "i n",    "r e",  "o n",    "Ġt he", "e r",   "Ġ s",
      "a t",   "Ġ w",    "Ġ o",     "e n",    "Ġ c",  "i t",    "i s",   "a n",   "o r",
      "e s",   "Ġ b",    "e d",     "Ġ f",    "in g", "Ġ p",    "o u",   "Ġa n",  "Ġan d",
      "l l",   "H e",    "He ll",   "Hell o", "Ġw or", "Ġwor l", "Ġworl d", "Ġ is", "Ġ m",
      "Ġ d",   "a r",    "Ċ Ċ",     "Ġ Ġ",    "Ġ h",
  };
  for (const std::string& merge : info.merges) {
    const auto space = merge.find(' ');
    info.tokens.push_back(merge.substr(0, space) + merge.substr(space + 1));
  }
  info.n_vocab = static_cast<std::int64_t>(info.tokens.size());
  return info;
}

namespace {

// The tokenizer keys of a byte-level BPE vocabulary whose first three tokens are control tokens
// (<|endoftext|>, <|im_start|>, <|im_end|>), add_bos_token only where given.
void add_vocab(GgufWriter& writer, const TinyLlamaInfo& info, const std::string& pre, std::optional<bool> add_bos) {
  std::vector<std::int32_t> token_types(info.tokens.size(), 1);  // normal
  for (int special = 0; special < 3; ++special) token_types[static_cast<std::size_t>(special)] = 3;  // control
  writer.add("tokenizer.ggml.model", GgufValue::str("gpt2"))
      .add("tokenizer.ggml.pre", GgufValue::str(pre))
      .add("tokenizer.ggml.tokens", GgufValue::str_array(info.tokens))
      .add("tokenizer.ggml.token_type", GgufValue::i32_array(token_types))
      .add("tokenizer.ggml.merges", GgufValue::str_array(info.merges))
      .add("tokenizer.ggml.bos_token_id", GgufValue::u32(1))
      .add("tokenizer.ggml.eos_token_id", GgufValue::u32(2))
      .add("tokenizer.ggml.unknown_token_id", GgufValue::u32(0))
      .add("tokenizer.ggml.padding_token_id", GgufValue::u32(2));
  if (add_bos) writer.add("tokenizer.ggml.add_bos_token", GgufValue::boolean(*add_bos));
}

}  // namespace

TinyLlamaInfo byte_pair_vocab() {
  TinyLlamaInfo info;
  info.tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  const auto alphabet = byte_level_alphabet();
  info.tokens.insert(info.tokens.end(), alphabet.begin(), alphabet.end());
  // Each pair (first byte * 256 + second) ranked by a hash of it, splitmix64's finalizer, so the
  // order is the same on every platform.
  const auto hash = [](std::uint64_t x) {
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  std::vector<std::pair<std::uint64_t, std::uint32_t>> ranked;
  for (std::uint32_t pair = 0; pair < 256 * 256; ++pair) ranked.emplace_back(hash(pair), pair);
  std::sort(ranked.begin(), ranked.end());
  for (const auto& [key, pair] : ranked) {
    const std::string& left = alphabet[pair >> 8];
    const std::string& right = alphabet[pair & 255];
    info.merges.push_back(left + " " + right);
    info.tokens.push_back(left + right);
  }
  info.n_vocab = static_cast<std::int64_t>(info.tokens.size());
  return info;
}

void write_vocab_gguf(const std::filesystem::path& path, const TinyLlamaInfo& vocab, const std::string& pre) {
  GgufWriter writer;
  writer.add("general.architecture", GgufValue::str("llama"))
      .add("general.name", GgufValue::str("vocab-" + pre))
      .add("llama.block_count", GgufValue::u32(1))
      .add("llama.context_length", GgufValue::u32(256))
      .add("llama.embedding_length", GgufValue::u32(64))
      .add("llama.feed_forward_length", GgufValue::u32(128))
      .add("llama.attention.head_count", GgufValue::u32(4))
      .add("llama.attention.head_count_kv", GgufValue::u32(4))
      .add("llama.attention.layer_norm_rms_epsilon", GgufValue::f32(1e-5f))
      .add("llama.vocab_size", GgufValue::u32(static_cast<std::uint32_t>(vocab.tokens.size())))
      .add("llama.rope.dimension_count", GgufValue::u32(16));
  add_vocab(writer, vocab, pre, std::nullopt);
  writer.write(path);
}

TinyLlamaInfo write_tiny_llama(const std::filesystem::path& path, const TinyLlamaOptions& options) {
  const TinyLlamaOptions& o = options;
  if (o.n_heads <= 0 || o.n_kv_heads <= 0 || (o.head_dim == 0 && o.n_embd % o.n_heads != 0) || o.head_dim < 0 ||
      o.n_heads % o.n_kv_heads != 0 || o.n_layers <= 0 || o.n_ff <= 0) {
    throw std::invalid_argument("write_tiny_llama: inconsistent sizes");
  }
  for (DType type : {o.weight_dtype, o.embedding_dtype, o.v_up_dtype.value_or(o.weight_dtype)}) {
    (void)file_type(type);  // rejects Q8_1
    const std::int64_t block = kernels::block_size(type);
    if (o.n_embd % block != 0 || o.n_ff % block != 0) {
      throw std::invalid_argument("write_tiny_llama: n_embd and n_ff must be multiples of " +
                                  std::to_string(block) + " for " +
                                  std::string(kernels::to_string(type)));
    }
  }

  TinyLlamaInfo info = tiny_llama_vocab();
  info.head_dim = o.head_dim > 0 ? o.head_dim : o.n_embd / o.n_heads;
  const std::int64_t q_dim = o.n_heads * info.head_dim;
  const std::int64_t n_vocab = info.n_vocab;
  const std::int64_t kv_dim = o.n_kv_heads * info.head_dim;

  GgufWriter writer;
  const std::string& arch = o.architecture;
  const bool gemma = arch == "gemma" || arch == "gemma2" || arch == "gemma3";
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3" && arch != "phi3" && !gemma)
    throw std::invalid_argument("write_tiny_llama: architecture " + arch);
  const bool fused = arch == "phi3";
  if (fused && o.v_up_dtype) throw std::invalid_argument("write_tiny_llama: phi3's fused matrices have one type");
  const std::int64_t rope_dim = o.rope_dim > 0 ? o.rope_dim : info.head_dim;
  const std::string a = arch + ".";
  writer.add("general.architecture", GgufValue::str(arch))
      .add("general.name", GgufValue::str("tiny-" + arch))
      .add("general.file_type", GgufValue::u32(file_type(o.weight_dtype)))
      .add("general.quantization_version", GgufValue::u32(2))
      .add(a + "block_count", GgufValue::u32(static_cast<std::uint32_t>(o.n_layers)))
      .add(a + "context_length", GgufValue::u32(static_cast<std::uint32_t>(o.context_length)))
      .add(a + "embedding_length", GgufValue::u32(static_cast<std::uint32_t>(o.n_embd)))
      .add(a + "feed_forward_length", GgufValue::u32(static_cast<std::uint32_t>(o.n_ff)))
      .add(a + "attention.head_count", GgufValue::u32(static_cast<std::uint32_t>(o.n_heads)))
      .add(a + "attention.head_count_kv", GgufValue::u32(static_cast<std::uint32_t>(o.n_kv_heads)))
      .add(a + "rope.freq_base", GgufValue::f32(o.rope_freq_base))
      .add(a + "attention.layer_norm_rms_epsilon", GgufValue::f32(o.rms_norm_eps))
      .add(a + "vocab_size", GgufValue::u32(static_cast<std::uint32_t>(n_vocab)))
      .add(a + "rope.dimension_count", GgufValue::u32(static_cast<std::uint32_t>(rope_dim)));
  if (o.rope_attn_factor > 0.0f) writer.add(a + "rope.scaling.attn_factor", GgufValue::f32(o.rope_attn_factor));
  if (o.original_context_length > 0)
    writer.add(a + "rope.scaling.original_context_length",
               GgufValue::u32(static_cast<std::uint32_t>(o.original_context_length)));
  if (o.sliding_window > 0)
    writer.add(a + "attention.sliding_window", GgufValue::u32(static_cast<std::uint32_t>(o.sliding_window)));
  if (o.sliding_window_pattern > 0)
    writer.add(a + "attention.sliding_window_pattern", GgufValue::u32(static_cast<std::uint32_t>(o.sliding_window_pattern)));
  if (o.rope_freq_base_swa > 0.0f) writer.add(a + "rope.freq_base_swa", GgufValue::f32(o.rope_freq_base_swa));
  if (o.attn_softcap > 0.0f) writer.add(a + "attn_logit_softcapping", GgufValue::f32(o.attn_softcap));
  if (o.final_softcap > 0.0f) writer.add(a + "final_logit_softcapping", GgufValue::f32(o.final_softcap));
  if (o.rope_scaling_factor > 0.0f)
    writer.add(a + "rope.scaling.type", GgufValue::str("linear")).add(a + "rope.scaling.factor", GgufValue::f32(o.rope_scaling_factor));
  if (o.head_dim > 0) {
    writer.add(a + "attention.key_length", GgufValue::u32(static_cast<std::uint32_t>(o.head_dim)))
        .add(a + "attention.value_length", GgufValue::u32(static_cast<std::uint32_t>(o.head_dim)));
  }

  add_vocab(writer, info, "smollm", false);
  writer.add("tokenizer.chat_template",
             GgufValue::str(!o.chat_template.empty()
                                ? o.chat_template
                                : "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                                  "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
                                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"));

  // Weights: normal with std 0.5 / sqrt(row length) for matrices, so that a matrix-vector
  // product keeps activations near unit scale (0.04 to 0.06 at the default sizes); the
  // embedding at 0.1; RMSNorm weights near 1. All drawn in tensor order from one stream.
  NormalRandom random(o.seed);
  const auto matrix = [&](const std::string& name, DType type, std::int64_t row_length,
                          std::int64_t rows, float std_dev) {
    std::vector<float> values(static_cast<std::size_t>(row_length * rows));
    for (float& v : values) v = std_dev * random.next();
    if (name != o.q3_k_tensor) {
      writer.add_tensor(name, type, {row_length, rows}, values);
      return;
    }
    // Q3_K: 110 bytes per 256 elements, written as bytes of the same size, then retyped.
    if (row_length % 256 != 0) throw std::invalid_argument("q3_k_tensor " + name + ": rows are not whole blocks");
    const std::int64_t bytes = row_length / 256 * 110 * rows;
    writer.add_tensor(name, DType::F16, {bytes / 2}, std::vector<std::byte>(static_cast<std::size_t>(bytes)));
    writer.override_tensor(name, {.type_id = 11, .dims = std::vector<std::uint64_t>{static_cast<std::uint64_t>(row_length),
                                                                                    static_cast<std::uint64_t>(rows)}});
  };
  // Matrices of one row length written as one, their rows one after the other (drawn in the
  // order they would be apart).
  const auto stacked = [&](const std::string& name, DType type, std::int64_t row_length, std::vector<std::int64_t> rows,
                           float std_dev) {
    std::vector<float> values;
    std::int64_t total = 0;
    for (const std::int64_t r : rows) {
      total += r;
      for (std::int64_t i = 0; i < r * row_length; ++i) values.push_back(std_dev * random.next());
    }
    writer.add_tensor(name, type, {row_length, total}, values);
  };
  const auto norm = [&](const std::string& name) {
    std::vector<float> values(static_cast<std::size_t>(o.n_embd));
    for (float& v : values) v = 1.0f + 0.1f * random.next();
    writer.add_tensor(name, DType::F32, {o.n_embd}, values);
  };
  const auto scale = [](std::int64_t row_length) {
    return 0.5f / std::sqrt(static_cast<float>(row_length));
  };

  matrix("token_embd.weight", o.embedding_dtype, o.n_embd, n_vocab, 0.1f);
  // llama.cpp stores attn_q and attn_k with each head's rows permuted for its rotary mode; with
  // random weights there is nothing to permute.
  for (std::int64_t layer = 0; layer < o.n_layers; ++layer) {
    const std::string prefix = "blk." + std::to_string(layer) + ".";
    norm(prefix + "attn_norm.weight");
    if (fused) {
      stacked(prefix + "attn_qkv.weight", o.weight_dtype, o.n_embd, {q_dim, kv_dim, kv_dim}, scale(o.n_embd));
    } else {
      matrix(prefix + "attn_q.weight", o.weight_dtype, o.n_embd, q_dim, scale(o.n_embd));
      matrix(prefix + "attn_k.weight", o.weight_dtype, o.n_embd, kv_dim, scale(o.n_embd));
      matrix(prefix + "attn_v.weight", o.v_up_dtype.value_or(o.weight_dtype), o.n_embd, kv_dim, scale(o.n_embd));
    }
    if (arch == "qwen2") {
      for (const auto& [which, rows] : {std::pair{"q", q_dim}, std::pair{"k", kv_dim}, std::pair{"v", kv_dim}}) {
        std::vector<float> bias(static_cast<std::size_t>(rows));
        for (float& b : bias) b = 0.1f * random.next();
        writer.add_tensor(prefix + "attn_" + which + ".bias", DType::F32, {rows}, bias);
      }
    }
    if (arch == "qwen3" || arch == "gemma3") {
      for (const char* which : {"q", "k"}) {
        std::vector<float> weight(static_cast<std::size_t>(info.head_dim));
        for (float& w : weight) w = 1.0f + 0.1f * random.next();
        writer.add_tensor(prefix + "attn_" + which + "_norm.weight", DType::F32, {info.head_dim}, weight);
      }
    }
    matrix(prefix + "attn_output.weight", o.weight_dtype, q_dim, o.n_embd, scale(q_dim));
    if (arch == "gemma2" || arch == "gemma3") norm(prefix + "post_attention_norm.weight");
    norm(prefix + "ffn_norm.weight");
    if (fused) {
      stacked(prefix + "ffn_up.weight", o.weight_dtype, o.n_embd, {o.n_ff, o.n_ff}, scale(o.n_embd));  // gate, up
    } else {
      matrix(prefix + "ffn_gate.weight", o.weight_dtype, o.n_embd, o.n_ff, scale(o.n_embd));
      matrix(prefix + "ffn_up.weight", o.v_up_dtype.value_or(o.weight_dtype), o.n_embd, o.n_ff, scale(o.n_embd));
    }
    matrix(prefix + "ffn_down.weight", o.weight_dtype, o.n_ff, o.n_embd, scale(o.n_ff));
    if (arch == "gemma2" || arch == "gemma3") norm(prefix + "post_ffw_norm.weight");
  }
  norm("output_norm.weight");
  if (!o.rope_freqs.empty()) {
    if (static_cast<std::int64_t>(o.rope_freqs.size()) != info.head_dim / 2)
      throw std::invalid_argument("write_tiny_llama: rope_freqs must have head_dim / 2 factors");
    writer.add_tensor("rope_freqs.weight", DType::F32, {info.head_dim / 2}, o.rope_freqs);
  }
  for (const auto& [name, factors] : {std::pair{"rope_factors_short.weight", &o.rope_factors_short},
                                      std::pair{"rope_factors_long.weight", &o.rope_factors_long}}) {
    if (factors->empty()) continue;
    if (static_cast<std::int64_t>(factors->size()) != rope_dim / 2)
      throw std::invalid_argument(std::string("write_tiny_llama: ") + name + " must have rope_dim / 2 factors");
    writer.add_tensor(name, DType::F32, {rope_dim / 2}, *factors);
  }
  // Gemma and Gemma 2 always reuse the embedding matrix as their output head.
  if (!o.tied && arch != "gemma" && arch != "gemma2") matrix("output.weight", o.embedding_dtype, o.n_embd, n_vocab, scale(o.n_embd));

  writer.write(path);
  return info;
}

}  // namespace batchlm::testing
