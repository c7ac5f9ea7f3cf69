// The 5-bit and K weight types (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): their layouts against an
// independent decoder (gguf-py's, through tests/reference/quant_vectors.json), the test
// quantizers' round trip, the portable matrix product against a float64 dot product of the
// dequantized weights and activations, and get_rows.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../../../kernels/cpu/cpu_kernels.hpp"
#include "batchlm/kernels/ops.hpp"
#include "gguf_writer.hpp"

namespace {

using namespace batchlm::kernels;
namespace fs = std::filesystem;

constexpr DType kNewTypes[] = {DType::Q5_0, DType::Q5_1, DType::Q4_K, DType::Q5_K, DType::Q6_K};

std::string name_of(DType t) { return std::string(to_string(t)); }

// Deterministic in the seed on every platform (std::normal_distribution is not).
std::vector<float> random_normal(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) {
    const double u1 = (static_cast<double>(rng() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    x = scale * static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  return v;
}

std::vector<float> dequantize_bytes(DType t, const std::vector<std::byte>& bytes, std::int64_t n) {
  std::vector<float> out(static_cast<std::size_t>(n));
  dequantize_row(t, bytes.data(), n, out.data());
  return out;
}

// The first element whose bits differ, or "" when none does.
std::string first_difference(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]))
      return "element " + std::to_string(i) + ": " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
  return "";
}

// ---- The layouts against gguf-py -------------------------------------------------------------

nlohmann::json read_vectors() {
  const fs::path p = fs::path(BATCHLM_SOURCE_DIR) / "tests/reference/quant_vectors.json";
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  return nlohmann::json::parse(f);
}

std::vector<std::byte> from_hex(const std::string& hex) {
  std::vector<std::byte> out(hex.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<std::byte>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return out;
}

// Seeded random blocks (finite F16 scales among them: negative, subnormal, zero) decode to
// gguf-py's floats exactly, through the kernels and through the test writer's decoder.
TEST(QuantTypes, DequantizeMatchesGgufPy) {
  const nlohmann::json vectors = read_vectors();
  std::map<std::string, DType> by_name;
  for (DType t : kNewTypes) by_name[name_of(t)] = t;
  std::set<std::string> seen;
  for (const auto& c : vectors.at("cases")) {
    const std::string name = c.at("type");
    ASSERT_TRUE(by_name.contains(name)) << name;
    seen.insert(name);
    const DType t = by_name[name];
    const std::vector<std::byte> bytes = from_hex(c.at("bytes"));
    const std::int64_t n = c.at("blocks").get<std::int64_t>() * block_size(t);
    ASSERT_EQ(bytes.size(), row_bytes(t, n)) << name;
    std::vector<float> expected;
    for (const auto& v : c.at("values")) expected.push_back(static_cast<float>(v.get<double>()));
    ASSERT_EQ(static_cast<std::int64_t>(expected.size()), n) << name;

    const std::vector<float> kernel = dequantize_bytes(t, bytes, n);
    EXPECT_EQ(first_difference(kernel, expected), "") << name << ": dequantize_row";
    const std::vector<float> writer = batchlm::testing::dequantize(t, bytes, n);
    EXPECT_EQ(first_difference(writer, expected), "") << name << ": the test writer's dequantize";
  }
  EXPECT_EQ(seen.size(), std::size(kNewTypes));
}

// ---- The test quantizers ---------------------------------------------------------------------

// RMS of (dequantize(quantize(x)) - x) over RMS of x.
double round_trip_error(DType t, const std::vector<float>& x) {
  const std::vector<std::byte> q = batchlm::testing::quantize(t, x);
  EXPECT_EQ(q.size(), row_bytes(t, static_cast<std::int64_t>(x.size()))) << name_of(t);
  const std::vector<float> back = batchlm::testing::dequantize(t, q, static_cast<std::int64_t>(x.size()));
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    err += (double(back[i]) - x[i]) * (double(back[i]) - x[i]);
    norm += double(x[i]) * x[i];
  }
  return std::sqrt(err / norm);
}

// Normal data, rows of several scales: each type's relative RMS error is within its bound, the
// 5- and 6-bit types' clearly below Q4_0's, Q4_K's below it, and Q6_K's below all of them; quantizing is
// deterministic and the writer's decoder agrees with the kernels'.
TEST(QuantTypes, RoundTripErrorIsWithinEachTypesBound) {
  std::vector<float> x = random_normal(256 * 24, 11);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] *= std::pow(10.0f, static_cast<float>(i / 512 % 4) - 2.0f);
  const double q4_0 = round_trip_error(DType::Q4_0, x);
  // Measured: Q4_0 0.088, Q5_0 0.044, Q5_1 0.039, Q4_K 0.076, Q5_K 0.038, Q6_K 0.019 (printed
  // below); the bounds leave a margin. Q4_K's quants have Q4_0's 4 bits: it gains only from its
  // fitted scale and min per 32.
  const std::map<DType, double> bounds = {{DType::Q5_0, 0.055}, {DType::Q5_1, 0.05}, {DType::Q4_K, 0.085},
                                          {DType::Q5_K, 0.05}, {DType::Q6_K, 0.025}};
  std::map<DType, double> errors;
  for (const auto& [t, bound] : bounds) {
    errors[t] = round_trip_error(t, x);
    std::printf("[ note ] %s round trip: relative RMS error %.4f (Q4_0 %.4f)\n", name_of(t).c_str(), errors[t], q4_0);
    EXPECT_LT(errors[t], bound) << name_of(t);
    EXPECT_GT(errors[t], 0.0) << name_of(t);
    const std::vector<std::byte> a = batchlm::testing::quantize(t, x), b = batchlm::testing::quantize(t, x);
    EXPECT_EQ(a, b) << name_of(t);
    const auto n = static_cast<std::int64_t>(x.size());
    EXPECT_EQ(first_difference(batchlm::testing::dequantize(t, a, n), dequantize_bytes(t, a, n)), "") << name_of(t);
  }
  for (DType t : {DType::Q5_0, DType::Q5_1, DType::Q5_K, DType::Q6_K})
    EXPECT_LT(errors[t], 0.6 * q4_0) << name_of(t);
  EXPECT_LT(errors[DType::Q4_K], 0.92 * q4_0);
  for (DType t : {DType::Q5_0, DType::Q5_1, DType::Q4_K, DType::Q5_K})
    EXPECT_LT(errors[DType::Q6_K], 0.7 * errors[t]) << name_of(t);
}

// Blocks of zeros decode to zeros; a block whose values are all equal (all negative, all
// positive) and one with a single nonzero value decode close to what they were.
TEST(QuantTypes, ZeroAndDegenerateBlocks) {
  for (DType t : kNewTypes) {
    const auto n = static_cast<std::size_t>(block_size(t));
    for (const float fill : {0.0f, -0.25f, 0.5f}) {
      std::vector<float> x(2 * n, fill);
      x[n + 3] = 1.5f;  // the second block has one value apart
      const auto back = batchlm::testing::dequantize(t, batchlm::testing::quantize(t, x), static_cast<std::int64_t>(x.size()));
      for (std::size_t i = 0; i < x.size(); ++i) {
        ASSERT_TRUE(std::isfinite(back[i])) << name_of(t) << " element " << i;
        if (fill == 0.0f && i < n) {
          ASSERT_EQ(back[i], 0.0f) << name_of(t) << " element " << i;
        }
        // One step of the coarsest quantization of the block's range (4 bits of 1.75).
        ASSERT_NEAR(back[i], x[i], 0.12) << name_of(t) << " fill " << fill << " element " << i;
      }
    }
  }
}

// ---- The matrix product ----------------------------------------------------------------------

// Random bytes for `blocks` blocks of type t with their F16 fields set to small finite values,
// so every quant and scale value appears (Q6_K's scale -128 included).
std::vector<std::byte> random_blocks(DType t, std::int64_t blocks, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(static_cast<std::size_t>(blocks) * block_bytes(t));
  for (std::byte& b : out) b = static_cast<std::byte>(rng() & 0xff);
  std::uniform_real_distribution<float> scale(0.0005f, 0.01f);
  const auto set_f16 = [&](std::size_t at, float v) {
    const std::uint16_t h = fp32_to_fp16(v);
    std::memcpy(out.data() + at, &h, 2);
  };
  for (std::int64_t k = 0; k < blocks; ++k) {
    const std::size_t base = static_cast<std::size_t>(k) * block_bytes(t);
    const float sign = k % 3 == 1 ? -1.0f : 1.0f;
    switch (t) {
      case DType::Q5_0: set_f16(base, sign * scale(rng)); break;
      case DType::Q5_1:
      case DType::Q4_K:
      case DType::Q5_K:
        set_f16(base, sign * scale(rng));
        set_f16(base + 2, scale(rng) * (t == DType::Q5_1 ? -20.0f : 1.0f));
        break;
      case DType::Q6_K: set_f16(base + offsetof(BlockQ6_K, d), sign * scale(rng) * 0.1f); break;
      default: break;
    }
  }
  return out;
}

// The activation quantization from its documented formula (portable.cpp): per block of 32
// (Q8_0, Q8_1) or 256 (Q8_K) d = max|x| / 127, q = x * (127 / max|x|) rounded half to even;
// Q8_0 and Q8_1 store d in F16, Q8_1 also s = d * sum(q) in F16, Q8_K d in F32 and the sums of
// each 16 q. Returns the bytes, the dequantized values (F16 d where stored so) and, for Q8_1,
// each block's s as stored.
struct Activations {
  std::vector<std::uint8_t> bytes;
  std::vector<double> values;
  std::vector<double> s;
};

Activations quantize_activations(DType xt, const float* x, std::int64_t cols) {
  Activations a;
  const std::int64_t bs = block_size(xt);
  a.bytes.resize(row_bytes(xt, cols));
  a.values.resize(static_cast<std::size_t>(cols));
  for (std::int64_t b = 0; b < cols / bs; ++b) {
    const float* xb = x + b * bs;
    float amax = 0.0f;
    for (std::int64_t j = 0; j < bs; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    std::vector<int> q(static_cast<std::size_t>(bs));
    for (std::int64_t j = 0; j < bs; ++j) q[j] = static_cast<int>(std::nearbyint(xb[j] * id));
    std::uint8_t* out = a.bytes.data() + b * block_bytes(xt);
    double dx = d;
    if (xt == DType::Q8_K) {
      BlockQ8_K blk{};
      blk.d = d;
      for (int j = 0; j < 256; ++j) {
        blk.qs[j] = static_cast<std::int8_t>(q[j]);
        blk.bsums[j / 16] = static_cast<std::int16_t>(blk.bsums[j / 16] + q[j]);
      }
      std::memcpy(out, &blk, sizeof blk);
    } else {
      const std::uint16_t dh = fp32_to_fp16(d);
      dx = fp16_to_fp32(dh);
      int sum = 0;
      for (int j = 0; j < 32; ++j) sum += q[j];
      const std::uint16_t s = fp32_to_fp16(d * static_cast<float>(sum));
      std::memcpy(out, &dh, 2);
      if (xt == DType::Q8_1) {
        std::memcpy(out + 2, &s, 2);
        a.s.push_back(fp16_to_fp32(s));
      }
      for (int j = 0; j < 32; ++j) out[(xt == DType::Q8_1 ? 4 : 2) + j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(q[j]));
    }
    for (std::int64_t j = 0; j < bs; ++j) a.values[b * bs + j] = dx * q[j];
  }
  return a;
}

DType activation_type(DType t) {
  switch (t) {
    case DType::Q5_0: return DType::Q8_0;
    case DType::Q5_1: return DType::Q8_1;
    default: return DType::Q8_K;
  }
}

// The portable product of each new type, for weights from the test quantizer and from random
// bytes, against the float64 dot product of the dequantized weights and the dequantized
// activations (quantized here from the documented formula, whose bytes must be the kernels'):
// what is left is float rounding in the per-block sums, and for Q5_1 the F16 rounding of the
// activations' s = d * sum(q), which the product uses for the min term. Shapes of one block
// and of several super-blocks, row counts that leave partial tiles, and 1 to 9 tokens. The
// chosen SIMD path gives the portable results bit for bit.
TEST(QuantTypes, PortableMatmulMatchesFloat64Dot) {
  const cpu::Kernels& portable = cpu::portable_kernels();
  ThreadPool pool(2);
  std::uint64_t seed = 1000;
  for (DType t : kNewTypes) {
    const DType xt = activation_type(t);
    const std::int64_t bs = block_size(t);
    for (const std::int64_t cols : {bs, 3 * bs, 8 * bs})
      for (const bool from_bytes : {false, true})
        for (const std::int64_t rows : {1, 5, 9}) {
          ++seed;
          std::vector<std::byte> w;
          if (from_bytes) {
            w = random_blocks(t, rows * cols / bs, seed);
          } else {
            w = batchlm::testing::quantize(t, random_normal(static_cast<std::size_t>(rows * cols), seed, 0.05f));
          }
          const std::vector<float> deq = batchlm::testing::dequantize(t, w, rows * cols);
          const Matrix m{t, w.data(), rows, cols};
          for (const std::int64_t n : {1, 4, 9}) {
            const std::vector<float> x = random_normal(static_cast<std::size_t>(n * cols), seed * 31 + n);
            std::vector<float> y(static_cast<std::size_t>(n * rows), -1.0f), chosen(y.size(), -1.0f);
            std::vector<std::uint8_t> scratch(activation_bytes(m, n));
            float* const out[1] = {y.data()};
            cpu::matmul_group(portable, std::span(&m, 1), x.data(), n, out, scratch.data(), pool);
            matmul(m, x.data(), n, chosen.data(), scratch.data(), pool);
            EXPECT_EQ(first_difference(chosen, y), "") << cpu_simd_name() << " " << name_of(t) << " cols " << cols
                                                        << " rows " << rows << " n " << n;
            for (std::int64_t tok = 0; tok < n; ++tok) {
              const Activations a = quantize_activations(xt, x.data() + tok * cols, cols);
              std::vector<std::uint8_t> kernel_bytes(a.bytes.size());
              if (xt == DType::Q8_0) portable.quantize_q8_0(x.data() + tok * cols, cols, kernel_bytes.data());
              if (xt == DType::Q8_1) portable.quantize_q8_1(x.data() + tok * cols, cols, kernel_bytes.data());
              if (xt == DType::Q8_K) portable.quantize_q8_k(x.data() + tok * cols, cols, kernel_bytes.data());
              ASSERT_EQ(kernel_bytes, a.bytes) << name_of(xt) << " of token " << tok;
              for (std::int64_t r = 0; r < rows; ++r) {
                double ref = 0, mag = 0, s_term = 0;
                for (std::int64_t c = 0; c < cols; ++c) {
                  ref += static_cast<double>(deq[r * cols + c]) * a.values[c];
                  mag += std::fabs(static_cast<double>(deq[r * cols + c]) * a.values[c]);
                }
                // Q5_1: the product takes m * s with s in F16 (within 2^-11 of d * sum(q)).
                for (std::size_t b = 0; b < a.s.size(); ++b) {
                  BlockQ5_1 blk;
                  std::memcpy(&blk, w.data() + (r * cols / 32 + static_cast<std::int64_t>(b)) * sizeof blk, sizeof blk);
                  s_term += std::fabs(static_cast<double>(fp16_to_fp32(blk.m)) * a.s[b]);
                }
                const double tol = 1e-5 * mag + 0x1.0p-10 * s_term + 1e-6;
                EXPECT_NEAR(y[tok * rows + r], ref, tol) << name_of(t) << (from_bytes ? " random bytes" : " quantized")
                                                          << " cols " << cols << " rows " << rows << " token " << tok
                                                          << " row " << r;
              }
            }
          }
        }
  }
}

// get_rows decodes rows (any order, repeated) to the test writer's values, bit for bit.
TEST(QuantTypes, GetRowsEqualsDequantize) {
  for (DType t : kNewTypes) {
    const std::int64_t rows = 6, cols = 2 * block_size(t);
    const std::vector<std::byte> w = random_blocks(t, rows * 2, 77);
    const std::vector<float> deq = batchlm::testing::dequantize(t, w, rows * cols);
    const std::vector<std::int32_t> ids = {4, 0, 5, 4, 2};
    std::vector<float> got(ids.size() * static_cast<std::size_t>(cols));
    get_rows(Matrix{t, w.data(), rows, cols}, ids, got.data());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::span<const float> want(deq.data() + ids[i] * cols, static_cast<std::size_t>(cols));
      EXPECT_EQ(first_difference(std::span<const float>(got).subspan(i * cols, cols), want), "")
          << name_of(t) << " row " << ids[i];
    }
  }
}

}  // namespace
