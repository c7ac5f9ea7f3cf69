// The CPU kernels: conversions, quantized dot products against a plain float reference, the
// AVX2 path against the portable one, and the drivers (matmul, attention, rope, norm).

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../../../kernels/cpu/cpu_kernels.hpp"
#include "kernel_paths.hpp"
#include "batchlm/kernels/ops.hpp"

namespace {

using namespace batchlm::kernels;
using batchlm::kernels::testing::same_bits;
using batchlm::kernels::testing::simd_paths;

std::vector<float> random_floats(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

TEST(Fp16, RoundTripsEveryHalf) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = fp16_to_fp32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(fp32_to_fp16(f), h) << std::hex << h;
  }
}

TEST(Fp16, RoundsToNearestEven) {
  EXPECT_EQ(fp32_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(fp32_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(fp32_to_fp16(1e6f), 0x7c00);  // overflow to infinity
  EXPECT_EQ(fp32_to_fp16(1.0f + 1.0f / 2048), 0x3c00);  // halfway, to even
  EXPECT_EQ(fp32_to_fp16(1.0f + 3.0f / 2048), 0x3c02);  // halfway, to even (up)
  EXPECT_EQ(fp32_to_fp16(5.96046448e-8f), 0x0001);      // smallest subnormal
  EXPECT_FLOAT_EQ(bf16_to_fp32(fp32_to_bf16(3.140625f)), 3.140625f);
}

// Quantizes a float row into `type` blocks the way GGUF writers do (for the tests).
std::vector<std::uint8_t> quantize_weights(DType type, const std::vector<float>& x) {
  std::vector<std::uint8_t> out(row_bytes(type, static_cast<std::int64_t>(x.size())));
  const std::size_t nb = x.size() / 32;
  for (std::size_t b = 0; b < nb; ++b) {
    const float* xb = x.data() + b * 32;
    if (type == DType::Q4_1) {
      float mn = xb[0], mx = xb[0];
      for (int j = 0; j < 32; ++j) mn = std::min(mn, xb[j]), mx = std::max(mx, xb[j]);
      const float d = (mx - mn) / 15.0f, id = d ? 1.0f / d : 0.0f;
      auto* blk = reinterpret_cast<BlockQ4_1*>(out.data()) + b;
      blk->d = fp32_to_fp16(d);
      blk->m = fp32_to_fp16(mn);
      for (int j = 0; j < 16; ++j) {
        const int lo = std::min(15, static_cast<int>((xb[j] - mn) * id + 0.5f));
        const int hi = std::min(15, static_cast<int>((xb[j + 16] - mn) * id + 0.5f));
        blk->qs[j] = static_cast<std::uint8_t>(lo | (hi << 4));
      }
    } else if (type == DType::Q4_0) {
      float amax = 0, max = 0;
      for (int j = 0; j < 32; ++j)
        if (std::fabs(xb[j]) > amax) amax = std::fabs(xb[j]), max = xb[j];
      const float d = max / -8.0f, id = d ? 1.0f / d : 0.0f;
      auto* blk = reinterpret_cast<BlockQ4_0*>(out.data()) + b;
      blk->d = fp32_to_fp16(d);
      for (int j = 0; j < 16; ++j) {
        const int lo = std::min(15, static_cast<int>(xb[j] * id + 8.5f));
        const int hi = std::min(15, static_cast<int>(xb[j + 16] * id + 8.5f));
        blk->qs[j] = static_cast<std::uint8_t>(lo | (hi << 4));
      }
    } else if (type == DType::Q8_0) {
      cpu::portable_kernels().quantize_q8_0(xb, 32, out.data() + b * sizeof(BlockQ8_0));
    }
  }
  if (type == DType::F16 || type == DType::BF16) {
    auto* o = reinterpret_cast<std::uint16_t*>(out.data());
    for (std::size_t i = 0; i < x.size(); ++i) o[i] = type == DType::F16 ? fp32_to_fp16(x[i]) : fp32_to_bf16(x[i]);
  }
  if (type == DType::F32) std::memcpy(out.data(), x.data(), x.size() * 4);
  return out;
}

class MatmulTest : public ::testing::TestWithParam<DType> {};

// A matrix of `rows` random rows quantized to `type` (the GGUF bytes).
std::vector<std::uint8_t> random_matrix(DType type, std::int64_t rows, std::int64_t cols,
                                        std::uint64_t seed) {
  std::vector<std::uint8_t> w;
  for (std::int64_t r = 0; r < rows; ++r) {
    auto row = quantize_weights(type, random_floats(cols, seed + r, 0.5f));
    w.insert(w.end(), row.begin(), row.end());
  }
  return w;
}

// matmul of quantized weights must be close to the float product of the dequantized weights
// (the activations' 8-bit rounding is the only further error), on every thread count, from the
// GGUF layout and, for the types that have one, from the packed copy.
TEST_P(MatmulTest, MatchesDequantizedReference) {
  const DType type = GetParam();
  const std::int64_t rows = 37, cols = 256, n = 5;
  const std::vector<std::uint8_t> w = random_matrix(type, rows, cols, 100);
  const Matrix m{type, w.data(), rows, cols};
  const PackedWeights packed = pack_weights(m);
  const bool quantized = type == DType::Q4_0 || type == DType::Q4_1 || type == DType::Q8_0;
  ASSERT_EQ(packed.data() != nullptr, quantized) << to_string(type);
  std::vector<float> deq(rows * cols);
  std::vector<std::int32_t> ids(rows);
  for (std::int64_t r = 0; r < rows; ++r) ids[r] = static_cast<std::int32_t>(r);
  get_rows(m, ids, deq.data());
  const auto x = random_floats(n * cols, 7);
  std::vector<Matrix> forms = {m};
  if (quantized) forms.push_back(Matrix{type, w.data(), rows, cols, packed.data()});
  for (const Matrix& f : forms)
    for (int threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      std::vector<float> y(n * rows);
      std::vector<std::uint8_t> scratch(activation_bytes(f, n));
      matmul(f, x.data(), n, y.data(), scratch.data(), pool);
      for (std::int64_t t = 0; t < n; ++t)
        for (std::int64_t r = 0; r < rows; ++r) {
          double ref = 0, mag = 0;
          for (std::int64_t c = 0; c < cols; ++c) {
            ref += static_cast<double>(deq[r * cols + c]) * x[t * cols + c];
            mag += std::fabs(deq[r * cols + c] * x[t * cols + c]);
          }
          const double tol = (type == DType::F32 ? 1e-5 : type == DType::BF16 ? 1e-2 : 2e-2) * mag + 1e-4;
          EXPECT_NEAR(y[t * rows + r], ref, tol)
              << to_string(type) << (f.packed ? " packed" : "") << " t=" << t << " r=" << r;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Types, MatmulTest,
                         ::testing::Values(DType::F32, DType::F16, DType::BF16, DType::Q8_0,
                                           DType::Q4_0, DType::Q4_1),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// The AVX2 path computes what the portable path computes, up to float summation order; the
// AVX-VNNI and AVX-512VL paths compute what the AVX2 path computes bit for bit, for every tile
// shape they offer.
TEST(Avx2, AgreesWithPortable) {
  const cpu::Kernels* avx2 = cpu::avx2_kernels();
  if (avx2 == nullptr) GTEST_SKIP() << "this CPU or build has no AVX2 path";
  std::vector<const cpu::Kernels*> paths = {avx2};
  if (const cpu::Kernels* k = cpu::avx_vnni_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx512_kernels()) paths.push_back(k);
  const cpu::Kernels& ref = cpu::portable_kernels();
  const std::int64_t cols = 320;
  constexpr int kTokens = cpu::kMaxTileTokens;
  const auto x = random_floats(kTokens * cols, 3);
  // Quantization is exact: the same blocks bit for bit.
  for (const cpu::Kernels* k : paths)
    for (bool q81 : {false, true}) {
      const std::size_t bytes = row_bytes(q81 ? DType::Q8_1 : DType::Q8_0, cols);
      std::vector<std::uint8_t> a(bytes), b(bytes);
      (q81 ? ref.quantize_q8_1 : ref.quantize_q8_0)(x.data(), cols, a.data());
      (q81 ? k->quantize_q8_1 : k->quantize_q8_0)(x.data(), cols, b.data());
      EXPECT_EQ(a, b) << k->name << (q81 ? " Q8_1" : " Q8_0");
    }
  struct Case { DType w, act; cpu::TileFn cpu::Kernels::*fn; };
  const Case cases[] = {{DType::Q4_0, DType::Q8_0, &cpu::Kernels::tile_q4_0},
                        {DType::Q4_1, DType::Q8_1, &cpu::Kernels::tile_q4_1},
                        {DType::Q8_0, DType::Q8_0, &cpu::Kernels::tile_q8_0},
                        {DType::F16, DType::F16, &cpu::Kernels::tile_f16},
                        {DType::F32, DType::F32, &cpu::Kernels::tile_f32}};
  for (const Case& c : cases) {
    std::vector<std::uint8_t> w;
    for (int r = 0; r < 4; ++r) {
      auto row = quantize_weights(c.w, random_floats(cols, 50 + r));
      w.insert(w.end(), row.begin(), row.end());
    }
    const std::size_t xrb = row_bytes(c.act, cols);
    std::vector<std::uint8_t> xq(kTokens * xrb);
    for (int t = 0; t < kTokens; ++t) {
      if (c.act == DType::Q8_0) ref.quantize_q8_0(x.data() + t * cols, cols, xq.data() + t * xrb);
      if (c.act == DType::Q8_1) ref.quantize_q8_1(x.data() + t * cols, cols, xq.data() + t * xrb);
      if (c.act == DType::F16 || c.act == DType::F32) {
        auto row = quantize_weights(c.act, std::vector<float>(x.begin() + t * cols, x.begin() + (t + 1) * cols));
        std::memcpy(xq.data() + t * xrb, row.data(), xrb);
      }
    }
    const std::int64_t nb = cols / block_size(c.w);
    const std::size_t wrb = row_bytes(c.w, cols);
    for (int nr = 1; nr <= 4; ++nr) {
      // The reference values: portable, and AVX2 two tokens at a time.
      float ya[4 * kTokens] = {}, y2[4 * kTokens] = {};
      (ref.*c.fn)(w.data(), wrb, nr, xq.data(), xrb, kTokens, nb, ya, 4);
      for (int t0 = 0; t0 < kTokens; t0 += 2)
        (avx2->*c.fn)(w.data(), wrb, nr, xq.data() + t0 * xrb, xrb, 2, nb, y2 + t0 * 4, 4);
      for (const cpu::Kernels* k : paths)
        for (int nt = 1; nt <= k->tile_tokens; ++nt) {
          float yb[4 * kTokens] = {};
          (k->*c.fn)(w.data(), wrb, nr, xq.data(), xrb, nt, nb, yb, 4);
          for (int t = 0; t < nt; ++t)
            for (int r = 0; r < nr; ++r) {
              EXPECT_NEAR(ya[t * 4 + r], yb[t * 4 + r], 1e-3f * (1.0f + std::fabs(ya[t * 4 + r])))
                  << k->name << " " << to_string(c.w) << " tile " << nr << "x" << nt;
              EXPECT_EQ(y2[t * 4 + r], yb[t * 4 + r]) << k->name << " " << to_string(c.w) << " tile " << nr << "x" << nt;
            }
        }
    }
  }
}

// The packed layout: 8 rows per group, each block of the group packed_block_bytes long; types
// without a packed form get none.
TEST(Packed, SizesAndTypes) {
  for (const DType t : {DType::F32, DType::F16, DType::BF16}) {
    std::vector<std::uint8_t> w(row_bytes(t, 64) * 3);
    const PackedWeights p = pack_weights(Matrix{t, w.data(), 3, 64});
    EXPECT_EQ(p.data(), nullptr) << to_string(t);
    EXPECT_EQ(p.size(), 0u) << to_string(t);
  }
  for (const DType t : {DType::Q4_0, DType::Q4_1, DType::Q8_0}) {
    const std::vector<std::uint8_t> w = random_matrix(t, 13, 96, 5);
    const PackedWeights p = pack_weights(Matrix{t, w.data(), 13, 96});
    ASSERT_NE(p.data(), nullptr) << to_string(t);
    EXPECT_EQ(p.size(), 2 * 3 * cpu::packed_block_bytes(t)) << to_string(t);  // 2 groups of 3 blocks
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.data()) % 64, 0u);
  }
  std::vector<std::uint8_t> w(row_bytes(DType::Q8_0, 64));
  EXPECT_THROW(pack_weights(Matrix{DType::Q8_0, w.data(), 1, 48}), std::invalid_argument);
}

// Products of packed matrices on every SIMD path are bit for bit the portable path's (which
// reads the GGUF layout): row counts that leave one or two groups of a 16-row tile partly
// filled, token counts across the passes of the packed tiles (1..9, 17, 33), and each token's
// result is what it gets alone (the portable path computes every (row, token) on its own).
// Every block, quantized from its own range, reaches its type's extreme quants (4-bit 0 and
// 15, 8-bit -127 or 127), weights and activations alike.
TEST(Packed, AgreesBitForBitWithPortable) {
  const std::vector<const cpu::Kernels*> paths = simd_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU or build has no SIMD path";
  const cpu::Kernels& portable = cpu::portable_kernels();
  const std::int64_t cols = 320;
  ThreadPool pool(3);
  for (const DType type : {DType::Q4_0, DType::Q4_1, DType::Q8_0})
    for (const std::int64_t rows : {1, 7, 8, 13, 16, 37}) {
      const std::vector<std::uint8_t> w = random_matrix(type, rows, cols, 200 + rows);
      const PackedWeights packed = pack_weights(Matrix{type, w.data(), rows, cols});
      const Matrix plain{type, w.data(), rows, cols}, fast{type, w.data(), rows, cols, packed.data()};
      for (const std::int64_t n : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33}) {
        const auto x = random_floats(n * cols, 300 + n);
        std::vector<std::uint8_t> scratch(activation_bytes(fast, n));
        std::vector<float> ref(n * rows), got(n * rows);
        float* const ref_out[1] = {ref.data()};
        float* const got_out[1] = {got.data()};
        cpu::matmul_group(portable, std::span(&plain, 1), x.data(), n, ref_out, scratch.data(), pool);
        // The portable path ignores the packed copy: the same values from it.
        cpu::matmul_group(portable, std::span(&fast, 1), x.data(), n, got_out, scratch.data(), pool);
        std::string where;
        EXPECT_TRUE(same_bits(ref, got, &where)) << "portable " << to_string(type) << " rows " << rows << " n " << n << " " << where;
        for (const cpu::Kernels* k : paths) {
          std::fill(got.begin(), got.end(), -1.0f);
          cpu::matmul_group(*k, std::span(&fast, 1), x.data(), n, got_out, scratch.data(), pool);
          EXPECT_TRUE(same_bits(ref, got, &where))
              << k->name << " " << to_string(type) << " rows " << rows << " n " << n << " " << where;
        }
      }
    }
}

// Q5_0 is packed as the Q8_0 blocks of the same values (bytes q - 16), Q5_1 with its quants in
// bytes: their products from the packed copy, on every path, are the portable 5-bit tiles' bit
// for bit. Random blocks reach every 5-bit value, fifth bits included.
TEST(Packed, FiveBitTypesAgreeBitForBitWithPortable) {
  const cpu::Kernels& portable = cpu::portable_kernels();
  std::vector<const cpu::Kernels*> paths = simd_paths();
  paths.push_back(&portable);
  const std::int64_t cols = 320;
  ThreadPool pool(3);
  std::mt19937 rng(55);
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  for (const DType type : {DType::Q5_0, DType::Q5_1})
  for (const std::int64_t rows : {1, 7, 8, 13, 16, 37}) {
    std::vector<std::uint8_t> w(row_bytes(type, cols) * rows);
    for (auto& b : w) b = static_cast<std::uint8_t>(rng());
    for (std::int64_t i = 0; i < rows * cols / 32; ++i) {
      // d (and Q5_1's m) finite.
      std::uint8_t* blk = w.data() + i * block_bytes(type);
      const std::uint16_t d = fp32_to_fp16(scale(rng)), m = fp32_to_fp16(scale(rng));
      std::memcpy(blk, &d, 2);
      if (type == DType::Q5_1) std::memcpy(blk + 2, &m, 2);
    }
    const PackedWeights packed = pack_weights(Matrix{type, w.data(), rows, cols});
    ASSERT_NE(packed.data(), nullptr);
    EXPECT_EQ(packed.size(), static_cast<std::size_t>((rows + 7) / 8 * 10) * cpu::packed_block_bytes(type));
    EXPECT_EQ(cpu::packed_block_bytes(type), type == DType::Q5_0 ? 272u : 288u);
    const Matrix plain{type, w.data(), rows, cols}, fast{type, w.data(), rows, cols, packed.data()};
    for (const std::int64_t n : {1, 2, 3, 4, 5, 8, 9, 17, 33}) {
      const auto x = random_floats(n * cols, 500 + n);
      std::vector<std::uint8_t> scratch(activation_bytes(fast, n));
      std::vector<float> ref(n * rows), got(n * rows);
      float* const ref_out[1] = {ref.data()};
      float* const got_out[1] = {got.data()};
      cpu::matmul_group(portable, std::span(&plain, 1), x.data(), n, ref_out, scratch.data(), pool);
      for (const cpu::Kernels* k : paths) {
        std::fill(got.begin(), got.end(), -1.0f);
        cpu::matmul_group(*k, std::span(&fast, 1), x.data(), n, got_out, scratch.data(), pool);
        std::string where;
        EXPECT_TRUE(same_bits(ref, got, &where))
            << k->name << " " << to_string(type) << " rows " << rows << " n " << n << " " << where;
      }
    }
  }
}

// A group of packed and GGUF-layout matrices of several dot types, read from one converted
// copy of x per type: each output is what the matrix gives alone, and the scratch that
// group_activation_bytes sizes is enough (and activation_bytes for each alone).
TEST(Packed, GroupOfMixedMatricesEqualsEachAlone) {
  const std::int64_t cols = 192, n = 11;
  struct Spec { DType type; std::int64_t rows; bool pack; };
  const Spec specs[] = {{DType::Q4_1, 21, true}, {DType::Q4_0, 13, true}, {DType::F16, 5, false},
                        {DType::Q8_0, 37, true}, {DType::Q4_1, 9, false}, {DType::Q8_0, 3, false}};
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<PackedWeights> packed;
  std::vector<Matrix> group;
  for (const Spec& s : specs) {
    bytes.push_back(random_matrix(s.type, s.rows, cols, 400 + s.rows));
    packed.push_back(s.pack ? pack_weights(Matrix{s.type, bytes.back().data(), s.rows, cols}) : PackedWeights{});
    group.push_back(Matrix{s.type, bytes.back().data(), s.rows, cols, packed.back().data()});
  }
  const auto x = random_floats(n * cols, 9);
  ThreadPool pool(2);
  std::vector<std::vector<float>> together(group.size());
  std::vector<float*> outs;
  for (std::size_t i = 0; i < group.size(); ++i) {
    together[i].resize(n * group[i].rows);
    outs.push_back(together[i].data());
  }
  std::vector<std::uint8_t> scratch(group_activation_bytes(group, n));
  matmul_group(group, x.data(), n, outs, scratch.data(), pool);
  for (std::size_t i = 0; i < group.size(); ++i) {
    std::vector<float> alone(n * group[i].rows);
    std::vector<std::uint8_t> own(activation_bytes(group[i], n));
    matmul(group[i], x.data(), n, alone.data(), own.data(), pool);
    std::string where;
    EXPECT_TRUE(same_bits(alone, together[i], &where)) << "matrix " << i << " " << where;
  }
}

// Activation rows quantized to Q8_0 and Q8_1 give the same bytes on every path: random rows
// of several scales, a row of zeros, and rows whose largest value is negative or lands the
// others exactly on a half step.
TEST(Quantize, EveryPathGivesThePortableBytes) {
  std::vector<const cpu::Kernels*> paths;
  if (const cpu::Kernels* k = cpu::avx2_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx_vnni_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx512_kernels()) paths.push_back(k);
  if (paths.empty()) GTEST_SKIP() << "no vector path on this CPU";
  const std::int64_t n = 8 * 32;
  std::vector<std::vector<float>> rows;
  for (const float scale : {1e-3f, 1.0f, 40.0f, 6e4f}) {
    auto row = random_floats(n, 300 + static_cast<unsigned>(scale));
    for (float& v : row) v *= scale;
    rows.push_back(row);
  }
  rows.push_back(std::vector<float>(n, 0.0f));
  std::vector<float> edges(n);
  for (std::int64_t i = 0; i < n; ++i) edges[i] = (i % 32 == 5) ? -127.0f : static_cast<float>(i % 32) - 15.5f;
  rows.push_back(edges);
  for (const auto& row : rows) {
    std::vector<std::uint8_t> want0(n / 32 * sizeof(BlockQ8_0)), want1(n / 32 * sizeof(BlockQ8_1));
    cpu::portable_kernels().quantize_q8_0(row.data(), n, want0.data());
    cpu::portable_kernels().quantize_q8_1(row.data(), n, want1.data());
    for (const cpu::Kernels* k : paths) {
      std::vector<std::uint8_t> got0(want0.size()), got1(want1.size());
      k->quantize_q8_0(row.data(), n, got0.data());
      k->quantize_q8_1(row.data(), n, got1.data());
      EXPECT_EQ(got0, want0) << k->name << " Q8_0, row max " << *std::max_element(row.begin(), row.end());
      EXPECT_EQ(got1, want1) << k->name << " Q8_1, row max " << *std::max_element(row.begin(), row.end());
    }
  }
}

// The gathered-position attention kernels give bit for bit what key_dot / axpy_f16 give key
// by key and row by row, on every path: for the head size with a fast path (64) and others
// (40, 3), with scores spaced by a leading dimension, runs of 16 keys and shorter ones (blocks
// of 16, 5 and 1, runs starting mid-block), run counts that end inside a pass, and query
// counts that take every pass width (one to eight at a time).
TEST(Attention, RowKernelsMatchKeyByKey) {
  std::vector<const cpu::Kernels*> paths = {&cpu::portable_kernels()};
  if (const cpu::Kernels* k = cpu::avx2_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx_vnni_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx512_kernels()) paths.push_back(k);
  for (const std::int64_t dim : {64, 40, 3})
    for (const std::int64_t block : {16, 5, 1})
      for (const std::int64_t n_rows : {1, 37, 70})
        for (const int n_q : {1, 2, 3, 4, 5, 7, 8, 11, 12, 17, 48}) {
          const std::int64_t width = 3 * dim, ld = n_rows + 5, n_blocks = 80;
          const auto pf = random_floats(n_blocks * block * width, 60);
          std::vector<std::uint16_t> pool(pf.size());
          for (std::size_t i = 0; i < pf.size(); ++i) pool[i] = fp32_to_fp16(pf[i]);
          // Positions 3 .. 3 + n_rows of a sequence over shuffled blocks, KV head 1: the keys
          // as runs of the transposed layout, the values as row offsets.
          std::vector<std::int32_t> table(n_blocks);
          for (std::int64_t i = 0; i < n_blocks; ++i) table[i] = static_cast<std::int32_t>(i);
          std::shuffle(table.begin(), table.end(), std::mt19937(7));
          std::vector<cpu::KeyRun> runs;
          std::vector<std::int64_t> keys, rows;
          for (std::int64_t p = 3; p < 3 + n_rows;) {
            const std::int64_t slot = p % block;
            const std::int64_t n = std::min({3 + n_rows - p, block - slot, cpu::kKeyRunSlots});
            const std::int64_t at = table[p / block] * block * width + dim * block + slot;
            runs.push_back({at, n});
            for (std::int64_t i = 0; i < n; ++i) {
              keys.push_back(at + i);
              rows.push_back((table[(p + i) / block] * block + (p + i) % block) * width + dim);
            }
            p += n;
          }
          auto q = random_floats(n_q * dim, 61);
          cpu::portable_kernels().round_f16(q.data(), n_q * dim);
          const auto probs = random_floats(n_q * ld, 62);
          for (const cpu::Kernels* k : paths) {
            std::vector<float> scores(n_q * ld, -1.0f);
            k->score_runs(q.data(), n_q, pool.data(), runs.data(), static_cast<std::int64_t>(runs.size()), 0, dim, block,
                          0.125f, scores.data(), ld);
            std::vector<float> out(n_q * dim, 0.5f), expected(n_q * dim, 0.5f);
            k->mix_rows(probs.data(), n_q, pool.data(), rows.data(), n_rows, 0, dim, out.data(), ld);
            for (std::int64_t j = 0; j < n_q; ++j) {
              for (std::int64_t r = 0; r < n_rows; ++r) {
                ASSERT_EQ(scores[j * ld + r], cpu::key_dot(q.data() + j * dim, pool.data() + keys[r], dim, block) * 0.125f)
                    << k->name << " dim " << dim << " block " << block << " queries " << n_q << " query " << j
                    << " key " << r;
                k->axpy_f16(probs[j * ld + r], pool.data() + rows[r], expected.data() + j * dim, dim);
              }
              for (std::int64_t r = n_rows; r < ld; ++r) ASSERT_EQ(scores[j * ld + r], -1.0f) << "wrote past the keys";
            }
            for (std::size_t i = 0; i < out.size(); ++i)
              ASSERT_EQ(out[i], expected[i]) << k->name << " dim " << dim << " rows " << n_rows << " at " << i;
            // The same lists in two calls, the first told that the rest follows (fetched ahead,
            // never used): the same bits.
            const auto half_runs = static_cast<std::int64_t>(runs.size()) / 2;
            std::int64_t half_keys = 0;
            for (std::int64_t i = 0; i < half_runs; ++i) half_keys += runs[i].n;
            std::vector<float> split_scores(n_q * ld, -1.0f);
            k->score_runs(q.data(), n_q, pool.data(), runs.data(), half_runs,
                          static_cast<std::int64_t>(runs.size()) - half_runs, dim, block, 0.125f, split_scores.data(), ld);
            k->score_runs(q.data(), n_q, pool.data(), runs.data() + half_runs,
                          static_cast<std::int64_t>(runs.size()) - half_runs, 0, dim, block, 0.125f,
                          split_scores.data() + half_keys, ld);
            std::string where;
            ASSERT_TRUE(same_bits(scores, split_scores, &where)) << k->name << " scores in two calls, " << where;
            const std::int64_t half_rows = n_rows / 2;
            std::vector<float> split_out(n_q * dim, 0.5f);
            k->mix_rows(probs.data(), n_q, pool.data(), rows.data(), half_rows, n_rows - half_rows, dim, split_out.data(), ld);
            k->mix_rows(probs.data() + half_rows, n_q, pool.data(), rows.data() + half_rows, n_rows - half_rows, 0, dim,
                        split_out.data(), ld);
            ASSERT_TRUE(same_bits(out, split_out, &where)) << k->name << " sums in two calls, " << where;
          }
        }
}

// key_dot is the plain chain of multiply-adds in F32 (a double sum of the same products
// would differ in the last bits; the chain is what every path reproduces).
TEST(Attention, KeyDotIsAChainOfMultiplyAdds) {
  const std::uint16_t k[6] = {fp32_to_fp16(1.5f), 0, fp32_to_fp16(-2.0f), 0, fp32_to_fp16(0.25f), 0};
  const float q[3] = {2.0f, 0.5f, 8.0f};
  EXPECT_EQ(cpu::key_dot(q, k, 3, 2), 4.0f);  // 3 - 1 + 2
  const auto qs = random_floats(64, 5);
  const auto ks = random_floats(64, 6);
  std::vector<std::uint16_t> kh(64);
  for (int i = 0; i < 64; ++i) kh[i] = fp32_to_fp16(ks[i]);
  float chain = 0.0f;
  for (int i = 0; i < 64; ++i) chain = std::fma(qs[i], fp16_to_fp32(kh[i]), chain);
  EXPECT_EQ(cpu::key_dot(qs.data(), kh.data(), 64, 1), chain);
}

// transpose_key_blocks is what store_keys_paged writes, given what store_f16_paged writes.
TEST(Attention, KeyStoreIsTheValueStoreTransposedPerBlock) {
  const std::int64_t block = 4, n_blocks = 6, width = 10;
  const std::vector<std::int32_t> table = {4, 1, 5, 0};
  const std::span<const std::int32_t> tables[1] = {table};
  const std::int64_t n = 14;
  const auto x = random_floats(n * width, 70);
  std::vector<std::int32_t> pos(n), seq(n, 0);
  for (std::int64_t p = 0; p < n; ++p) pos[p] = static_cast<std::int32_t>(p);
  std::vector<std::uint16_t> rows(n_blocks * block * width, 7), keys(rows.size(), 7), transposed(rows.size());
  const PagedKv kv{keys.data(), rows.data(), block, tables, seq.data()};
  store_f16_paged(x.data(), n, width, pos.data(), kv, rows.data());
  store_keys_paged(x.data(), n, width, pos.data(), kv, keys.data());
  transpose_key_blocks(rows.data(), n_blocks, block, width, transposed.data());
  for (const std::int32_t b : table)
    for (std::int64_t i = 0; i < block * width; ++i) {
      const std::int64_t slot = i % block, c = i / block;
      if (b == 0 && slot >= 2) continue;  // positions 14, 15 were never stored
      ASSERT_EQ(keys[b * block * width + i], transposed[b * block * width + i]) << "block " << b << " at " << i;
      ASSERT_EQ(keys[b * block * width + i], fp32_to_fp16(x[(std::find(table.begin(), table.end(), b) - table.begin()) * block * width + slot * width + c]));
    }
}

// The softmax's exponentials are std::exp's bit for bit on every path: a spread of bit patterns
// over the whole float range, the edges where expf stops being finite, and the special values.
TEST(Attention, ExpIsStdExpBitForBit) {
  std::vector<float> x;
  for (std::uint64_t bits = 0; bits < (1ull << 32); bits += 4093) x.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
  for (const float edge : {88.0f, 88.7228f, 88.7229f, -87.33f, -88.0f, -103.28f, -103.97f, -104.0f, 0.0f, -0.0f,
                           1e-30f, -1e-30f, 0.5f, -0.5f, std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    for (const float direction : {-INFINITY, INFINITY}) {
      float v = edge;
      for (int step = 0; step < 8; ++step) x.push_back(v = std::nextafter(v, direction));
    }
  // Softmax inputs: x - max, in [-60, 0].
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-60.0f, 0.0f);
  for (int i = 0; i < 100000; ++i) x.push_back(u(rng));
  std::vector<const cpu::Kernels*> paths = {&cpu::portable_kernels()};
  if (const cpu::Kernels* k = cpu::avx2_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx_vnni_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx512_kernels()) paths.push_back(k);
  for (const cpu::Kernels* k : paths) {
    std::vector<float> y(x.size());
    k->exp_f32(x.data(), y.data(), static_cast<std::int64_t>(x.size()));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float e = std::exp(x[i]);
      if (std::bit_cast<std::uint32_t>(e) != std::bit_cast<std::uint32_t>(y[i]) && !(std::isnan(e) && std::isnan(y[i]))) {
        if (++wrong <= 5) ADD_FAILURE() << k->name << ": exp(" << x[i] << ") = " << y[i] << ", std::exp gives " << e;
      }
    }
    EXPECT_EQ(wrong, 0u) << k->name << " on " << x.size() << " values";
  }
}

// Softmax rows on every path: probabilities within F16 rounding of the exact ones, each an F16
// value, and the paths agree to one F16 step (the vector exp differs from std::exp in the last
// float bits at most).
TEST(Attention, SoftmaxF16MatchesExactOnEveryPath) {
  std::vector<const cpu::Kernels*> paths = {&cpu::portable_kernels()};
  if (const cpu::Kernels* k = cpu::avx2_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx_vnni_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx512_kernels()) paths.push_back(k);
  for (const std::int64_t n : {1, 7, 8, 37, 1700}) {
    auto row = random_floats(n, 70 + static_cast<unsigned>(n));
    for (std::int64_t i = 0; i < n; ++i) row[i] *= 30.0f;  // scores from about -30 to 30
    if (n > 8) row[3] = -200.0f;                            // a term that vanishes
    double mx = -1e30, sum = 0;
    for (float v : row) mx = std::max<double>(mx, v);
    for (float v : row) sum += std::exp(static_cast<double>(v) - mx);
    std::vector<std::vector<float>> results;
    for (const cpu::Kernels* k : paths) {
      std::vector<float> x = row;
      k->softmax_f16(x.data(), n, n, 1);
      for (std::int64_t i = 0; i < n; ++i) {
        const double exact = std::exp(static_cast<double>(row[i]) - mx) / sum;
        EXPECT_NEAR(x[i], exact, exact * 1e-3 + 1e-7) << k->name << " n " << n << " at " << i;
        EXPECT_EQ(fp16_to_fp32(fp32_to_fp16(x[i])), x[i]) << "not an F16 value: " << k->name;
      }
      results.push_back(std::move(x));
    }
    for (std::size_t p = 1; p < results.size(); ++p)
      for (std::int64_t i = 0; i < n; ++i)
        EXPECT_NEAR(results[p][i], results[0][i], std::fabs(results[0][i]) * 1e-3 + 1e-8)
            << paths[p]->name << " n " << n << " at " << i;
  }
}

// The vector paths' softmax rows are the same bits (the AVX-512 path runs sixteen lanes where
// the others run eight, with the same exponentials and the same double sums), for lengths
// around every vector width and its tails.
TEST(Attention, SoftmaxF16VectorPathsAgreeBitForBit) {
  const cpu::Kernels* avx2 = cpu::avx2_kernels();
  if (avx2 == nullptr) GTEST_SKIP() << "no AVX2 on this CPU";
  std::vector<const cpu::Kernels*> others;
  if (const cpu::Kernels* k = cpu::avx_vnni_kernels()) others.push_back(k);
  if (const cpu::Kernels* k = cpu::avx512_kernels()) others.push_back(k);
  for (std::int64_t n = 1; n <= 70; ++n)
    for (const float spread : {1.0f, 30.0f, 120.0f}) {
      auto row = random_floats(n, 900 + static_cast<unsigned>(n));
      for (float& v : row) v *= spread;
      std::vector<float> expected = row;
      avx2->softmax_f16(expected.data(), n, n, 1);
      for (const cpu::Kernels* k : others) {
        std::vector<float> x = row;
        k->softmax_f16(x.data(), n, n, 1);
        std::string where;
        EXPECT_TRUE(same_bits(expected, x, &where)) << k->name << " n " << n << " spread " << spread << " " << where;
      }
    }
}

// Several rows in one call (the AVX-512 path runs up to four in lockstep) give each row the
// bits it gets alone, on every path, for row counts around the lockstep widths and lengths
// around the vector widths; the rows are `ld` apart with other values between them untouched.
TEST(Attention, SoftmaxF16RowsInOneCallEqualRowsAlone) {
  std::vector<const cpu::Kernels*> paths = {&cpu::portable_kernels()};
  if (const cpu::Kernels* k = cpu::avx2_kernels()) paths.push_back(k);
  if (const cpu::Kernels* k = cpu::avx512_kernels()) paths.push_back(k);
  for (const cpu::Kernels* k : paths)
    for (const std::int64_t n : {1, 15, 16, 17, 24, 31, 33, 47, 300, 1701})
      for (const int rows : {1, 2, 3, 4, 5, 7, 9}) {
        const std::int64_t ld = n + 5;
        auto x = random_floats(rows * ld, 3000 + static_cast<unsigned>(n * 16 + rows));
        for (float& v : x) v *= 20.0f;
        std::vector<float> alone = x;
        for (int r = 0; r < rows; ++r) k->softmax_f16(alone.data() + r * ld, n, n, 1);
        k->softmax_f16(x.data(), n, ld, rows);
        std::string where;
        EXPECT_TRUE(same_bits(alone, x, &where)) << k->name << " n " << n << " rows " << rows << " " << where;
      }
}

TEST(Attention, MatchesSoftmaxReference) {
  const AttentionShape s{4, 2, 16, 2 * 16, 0.25f};
  const std::int64_t n_ctx = 9, n = 3;
  const auto kf = random_floats(n_ctx * s.kv_stride, 11), vf = random_floats(n_ctx * s.kv_stride, 12);
  std::vector<std::uint16_t> k(kf.size()), v(vf.size());
  for (std::size_t i = 0; i < kf.size(); ++i) k[i] = fp32_to_fp16(kf[i]), v[i] = fp32_to_fp16(vf[i]);
  const auto q = random_floats(n * s.n_heads * s.head_dim, 13);
  const std::int32_t positions[3] = {6, 7, 8};
  std::vector<float> out(q.size());
  ThreadPool pool(2);
  attention(s, q.data(), n, positions, k.data(), v.data(), out.data(), pool);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t h = 0; h < s.n_heads; ++h) {
      const std::int64_t kvh = h / 2;
      std::vector<double> p(positions[t] + 1);
      double sum = 0, mx = -1e30;
      for (std::int64_t j = 0; j <= positions[t]; ++j) {
        double d = 0;
        for (std::int64_t i = 0; i < s.head_dim; ++i)
          d += q[(t * s.n_heads + h) * s.head_dim + i] * fp16_to_fp32(k[j * s.kv_stride + kvh * s.head_dim + i]);
        p[j] = d * s.scale;
        mx = std::max(mx, p[j]);
      }
      for (auto& x : p) sum += (x = std::exp(x - mx));
      for (std::int64_t i = 0; i < s.head_dim; ++i) {
        double ref = 0;
        for (std::int64_t j = 0; j <= positions[t]; ++j)
          ref += p[j] / sum * fp16_to_fp32(v[j * s.kv_stride + kvh * s.head_dim + i]);
        EXPECT_NEAR(out[(t * s.n_heads + h) * s.head_dim + i], ref, 5e-3);
      }
    }
}

// Two sequences with their caches scattered over a shuffled block pool, their tokens mixed in
// one batch: the paged kernel gives bit for bit what the contiguous one gives per sequence, and
// store_keys_paged / store_f16_paged put each position where the block table says.
TEST(Attention, PagedEqualsContiguousPerSequence) {
  const AttentionShape s{4, 2, 16, 2 * 16, 0.25f};
  const std::int64_t block = 4, n_blocks = 12;
  const std::int64_t lens[2] = {13, 22};  // positions filled per sequence (the last ones queried)
  std::vector<std::int32_t> order(n_blocks);
  for (std::int64_t i = 0; i < n_blocks; ++i) order[i] = static_cast<std::int32_t>(i);
  std::shuffle(order.begin(), order.end(), std::mt19937(5));
  std::vector<std::int32_t> table0(order.begin(), order.begin() + 4);   // 16 positions
  std::vector<std::int32_t> table1(order.begin() + 4, order.begin() + 10);  // 24 positions
  const std::span<const std::int32_t> tables[2] = {table0, table1};
  std::vector<std::uint16_t> kpool(n_blocks * block * s.kv_stride), vpool(kpool.size());
  std::vector<std::vector<std::uint16_t>> kc(2), vc(2);
  ThreadPool pool(2);
  for (int q = 0; q < 2; ++q) {
    const auto kf = random_floats(lens[q] * s.kv_stride, 20 + q), vf = random_floats(lens[q] * s.kv_stride, 30 + q);
    kc[q].resize(kf.size());
    vc[q].resize(vf.size());
    for (std::size_t i = 0; i < kf.size(); ++i) kc[q][i] = fp32_to_fp16(kf[i]), vc[q][i] = fp32_to_fp16(vf[i]);
    std::vector<std::int32_t> pos(lens[q]), seq(lens[q], q);
    for (std::int64_t p = 0; p < lens[q]; ++p) pos[p] = static_cast<std::int32_t>(p);
    const PagedKv kv{kpool.data(), vpool.data(), block, tables, seq.data()};
    store_keys_paged(kf.data(), lens[q], s.kv_stride, pos.data(), kv, kpool.data());
    store_f16_paged(vf.data(), lens[q], s.kv_stride, pos.data(), kv, vpool.data());
  }
  // The batch: the last 3 positions of sequence 1 and the last 2 of sequence 0, interleaved.
  const std::int32_t positions[5] = {19, 11, 20, 12, 21};
  const std::int32_t sequence_of[5] = {1, 0, 1, 0, 1};
  const auto q = random_floats(5 * s.n_heads * s.head_dim, 40);
  std::vector<float> paged(q.size());
  const PagedKv kv{kpool.data(), vpool.data(), block, tables, sequence_of};
  attention_paged(s, q.data(), 5, positions, kv, paged.data(), pool);
  const std::int64_t row = s.n_heads * s.head_dim;
  for (int t = 0; t < 5; ++t) {
    std::vector<float> ref(row);
    attention(s, q.data() + t * row, 1, &positions[t], kc[sequence_of[t]].data(),
              vc[sequence_of[t]].data(), ref.data(), pool);
    for (std::int64_t i = 0; i < row; ++i) ASSERT_EQ(paged[t * row + i], ref[i]) << "token " << t << " element " << i;
  }
}

// A pool of blocks of 4 positions in which blocks 0..5 hold a prefix of 24 positions shared by
// sequences 0 and 1; sequence 2 shares only blocks 0..2, sequence 3 nothing. Keys transposed
// within each block, as the engine stores them.
struct SharedPrefixPool {
  static constexpr std::int64_t kBlock = 4, kBlocks = 40;
  std::vector<std::vector<std::int32_t>> tables = {
      {0, 1, 2, 3, 4, 5, 10, 11}, {0, 1, 2, 3, 4, 5, 12, 13, 14}, {0, 1, 2, 20, 21, 22, 23}, {30, 31, 32}};
  std::int64_t lens[4] = {30, 35, 27, 12};
  std::vector<std::span<const std::int32_t>> spans{tables.begin(), tables.end()};
  std::vector<std::uint16_t> k, v;

  explicit SharedPrefixPool(std::int64_t kv_stride) {
    const auto kf = random_floats(kBlocks * kBlock * kv_stride, 80), vf = random_floats(kf.size(), 81);
    k.resize(kf.size());
    v.resize(kf.size());
    for (std::size_t i = 0; i < kf.size(); ++i) k[i] = fp32_to_fp16(kf[i]), v[i] = fp32_to_fp16(vf[i]);
  }
  PagedKv paged(const std::int32_t* sequence_of) const { return {k.data(), v.data(), kBlock, spans, sequence_of}; }
  // A contiguous copy of positions 0..n_ctx-1 of a sequence: keys and values by position.
  void contiguous(int seq, std::int64_t n_ctx, std::int64_t kv_stride, std::vector<std::uint16_t>& kc,
                  std::vector<std::uint16_t>& vc) const {
    const auto& table = tables[static_cast<std::size_t>(seq)];
    kc.assign(static_cast<std::size_t>(n_ctx * kv_stride), 0);
    vc.assign(kc.size(), 0);
    for (std::int64_t p = 0; p < n_ctx; ++p) {
      const std::int64_t b = table[p / kBlock];
      std::copy_n(v.data() + (b * kBlock + p % kBlock) * kv_stride, kv_stride, vc.data() + p * kv_stride);
      for (std::int64_t c = 0; c < kv_stride; ++c) kc[p * kv_stride + c] = k[b * kBlock * kv_stride + c * kBlock + p % kBlock];
    }
  }
};

// Sequences that share cached prefix blocks (the same block ids at the start of their tables),
// one that diverges part-way, one that shares nothing, decoding tokens and a run of prompt
// tokens in one batch: every token's output is bit for bit what it gets alone over a
// contiguous copy of its cache, for the head size with a fast path and one without.
TEST(Attention, SharedPrefixBlocksGiveTheSameResultAsAlone) {
  for (const std::int64_t dim : {64, 40}) {
    const AttentionShape s{6, 2, dim, 2 * dim, 0.2f};
    const SharedPrefixPool pool_kv(s.kv_stride);
    // The batch: the last position of every sequence, and the 6 positions before sequence 1's.
    std::vector<std::int32_t> positions, sequence_of;
    for (int seq = 0; seq < 4; ++seq) positions.push_back(static_cast<std::int32_t>(pool_kv.lens[seq] - 1)), sequence_of.push_back(seq);
    for (int p = 28; p < 34; ++p) positions.push_back(p), sequence_of.push_back(1);
    const auto n = static_cast<std::int64_t>(positions.size());
    const std::int64_t row = s.n_heads * s.head_dim;
    const auto q = random_floats(n * row, 82);
    std::vector<float> batched(q.size());
    ThreadPool pool(2);
    attention_paged(s, q.data(), n, positions.data(), pool_kv.paged(sequence_of.data()), batched.data(), pool);
    std::vector<std::uint16_t> kc, vc;
    for (std::int64_t t = 0; t < n; ++t) {
      pool_kv.contiguous(sequence_of[t], positions[t] + 1, s.kv_stride, kc, vc);
      std::vector<float> alone(row);
      attention(s, q.data() + t * row, 1, &positions[t], kc.data(), vc.data(), alone.data(), pool);
      for (std::int64_t i = 0; i < row; ++i)
        ASSERT_EQ(batched[t * row + i], alone[i]) << "dim " << dim << " token " << t << " element " << i;
    }
  }
}

// Sliding windows (and Gemma 2's score cap): tokens of sequences that share prefix blocks, at
// positions far apart, with early prompt tokens in the same items; every token's result is the
// bits it gets alone, on any number of threads, and near the exact sums over its window.
TEST(Attention, WindowedTokensEqualEachAloneAndTheExactSums) {
  for (const std::int64_t dim : {64, 40}) {
    for (const std::int64_t window : {1, 2, 3, 5, 9, 20, 25, 64}) {
      for (const float cap : {0.0f, 0.7f}) {
        AttentionShape s{6, 2, dim, 2 * dim, 0.2f};
        s.window = window;
        s.softcap = cap;
        const SharedPrefixPool pool_kv(s.kv_stride);
        std::vector<std::int32_t> positions, sequence_of;
        for (int seq = 0; seq < 4; ++seq) positions.push_back(static_cast<std::int32_t>(pool_kv.lens[seq] - 1)), sequence_of.push_back(seq);
        for (int p = 28; p < 34; ++p) positions.push_back(p), sequence_of.push_back(1);
        for (int p : {0, 1, 2, 5, 13}) positions.push_back(p), sequence_of.push_back(0);
        for (int p : {3, 26}) positions.push_back(p), sequence_of.push_back(2);
        const auto n = static_cast<std::int64_t>(positions.size());
        const std::int64_t row = s.n_heads * s.head_dim;
        const auto q = random_floats(n * row, 82);
        for (const int threads : {1, 2, 8, 64}) {
          std::vector<float> batched(q.size());
          ThreadPool pool(threads);
          attention_paged(s, q.data(), n, positions.data(), pool_kv.paged(sequence_of.data()), batched.data(), pool);
          std::vector<std::uint16_t> kc, vc;
          for (std::int64_t t = 0; t < n; ++t) {
            const std::int64_t n_ctx = positions[t] + 1;
            pool_kv.contiguous(sequence_of[t], n_ctx, s.kv_stride, kc, vc);
            std::vector<float> alone(row);
            attention(s, q.data() + t * row, 1, &positions[t], kc.data(), vc.data(), alone.data(), pool);
            for (std::int64_t i = 0; i < row; ++i)
              ASSERT_EQ(batched[t * row + i], alone[i])
                  << "dim " << dim << " window " << window << " cap " << cap << " threads " << threads << " token " << t;
            // The exact sums over positions p - window + 1 .. p.
            const std::int64_t lo = std::max<std::int64_t>(0, positions[t] - window + 1);
            for (std::int64_t h = 0; h < s.n_heads; ++h) {
              const std::int64_t kvh = h / (s.n_heads / s.n_kv_heads);
              std::vector<double> w;
              for (std::int64_t p = lo; p < n_ctx; ++p) {
                double d = 0;
                for (std::int64_t i = 0; i < dim; ++i)
                  d += static_cast<double>(fp16_to_fp32(fp32_to_fp16(q[t * row + h * dim + i]))) *
                       fp16_to_fp32(kc[p * s.kv_stride + kvh * dim + i]);
                d *= s.scale;
                w.push_back(cap != 0.0f ? cap * std::tanh(d / cap) : d);
              }
              const double top = *std::max_element(w.begin(), w.end());
              double sum = 0;
              for (double& e : w) sum += (e = std::exp(e - top));
              for (std::int64_t i = 0; i < dim; ++i) {
                double o = 0;
                for (std::int64_t p = lo; p < n_ctx; ++p) o += w[p - lo] / sum * fp16_to_fp32(vc[p * s.kv_stride + kvh * dim + i]);
                ASSERT_NEAR(batched[t * row + h * dim + i], o, 2e-3) << "dim " << dim << " window " << window << " token " << t;
              }
            }
          }
        }
      }
    }
  }
}

// A token's attention is the same bits whichever way the threads split it: one item per query
// head (few tokens on many threads) or one per token and KV head, whose rows are read once for
// the group (the rest).
TEST(Attention, SameBitsPerQueryHeadAndPerKvHead) {
  for (const std::int64_t dim : {64, 40}) {
    const AttentionShape s{6, 2, dim, 2 * dim, 0.2f};
    const std::int64_t block = 16, n_ctx = 300, n_blocks = (n_ctx + block - 1) / block;
    std::vector<std::int32_t> table(n_blocks);
    for (std::int64_t i = 0; i < n_blocks; ++i) table[i] = static_cast<std::int32_t>(n_blocks - 1 - i);
    const std::span<const std::int32_t> tables[1] = {table};
    const auto kf = random_floats(n_blocks * block * s.kv_stride, 90), vf = random_floats(kf.size(), 91);
    std::vector<std::uint16_t> kpool(kf.size()), vpool(kf.size());
    for (std::size_t i = 0; i < kf.size(); ++i) kpool[i] = fp32_to_fp16(kf[i]), vpool[i] = fp32_to_fp16(vf[i]);
    const std::int32_t positions[2] = {n_ctx - 2, n_ctx - 1};
    const std::int32_t sequence_of[2] = {0, 0};
    const PagedKv kv{kpool.data(), vpool.data(), block, tables, sequence_of};
    const std::int64_t row = s.n_heads * s.head_dim;
    const auto q = random_floats(2 * row, 92);
    // One token on 8 threads: 2 (token, KV head) items, a fourth of the threads, so one item per
    // query head. On 2 threads, and two tokens on 8: one item per token and KV head.
    ThreadPool many(8), two(2);
    std::vector<float> per_head(row), per_kv_head(row), pair(2 * row);
    attention_paged(s, q.data() + row, 1, positions + 1, kv, per_head.data(), many);
    attention_paged(s, q.data() + row, 1, positions + 1, kv, per_kv_head.data(), two);
    attention_paged(s, q.data(), 2, positions, kv, pair.data(), many);
    for (std::int64_t i = 0; i < row; ++i) {
      ASSERT_EQ(per_head[i], per_kv_head[i]) << "dim " << dim << " element " << i;
      ASSERT_EQ(per_head[i], pair[row + i]) << "dim " << dim << " element " << i;
    }
  }
}

TEST(Rope, RotatesPairsByPosition) {
  std::vector<float> x = {1, 0, 1, 0, 0, 1, 0, 1};  // 1 token, 2 heads of 4
  const std::int32_t pos[1] = {3};
  rope(x.data(), 1, 2, 4, 4, pos, 10000.0f);
  EXPECT_NEAR(x[0], std::cos(3.0f), 1e-6);
  EXPECT_NEAR(x[1], std::sin(3.0f), 1e-6);
  EXPECT_NEAR(x[2], std::cos(3.0f / 100.0f), 1e-6);  // theta = 3 * 10000^(-2/4)
  EXPECT_NEAR(x[5], std::cos(3.0f), 1e-6);
  EXPECT_NEAR(x[4], -std::sin(3.0f), 1e-6);
}

// Angles taken once and used for several tensors (a forward pass's layers, its queries and keys)
// rotate exactly as rope from the positions does: the cosines and sines of each token's first
// rot_dim dimensions, with the rest of each head untouched.
TEST(Rope, AnglesTakenOnceRotateTheSame) {
  const std::int64_t n = 5, n_heads = 3, head_dim = 16, rot_dim = 12;
  const std::int32_t pos[n] = {0, 7, 8, 1500, 8191};
  const auto x = random_floats(n * n_heads * head_dim, 41);
  std::vector<float> direct = x;
  rope(direct.data(), n, n_heads, head_dim, rot_dim, pos, 100000.0f);
  const std::vector<float> angles = rope_angles(n, rot_dim, pos, 100000.0f);
  ASSERT_EQ(angles.size(), static_cast<std::size_t>(n * rot_dim));
  EXPECT_EQ(angles[3 * rot_dim], std::cos(1500.0f));
  EXPECT_EQ(angles[3 * rot_dim + 1], std::sin(1500.0f));
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<float> again = x;
    rope(again.data(), n, n_heads, head_dim, rot_dim, angles.data());
    std::string where;
    EXPECT_TRUE(same_bits(direct, again, &where)) << where;
  }
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t h = 0; h < n_heads; ++h)
      for (std::int64_t d = rot_dim; d < head_dim; ++d) {
        const std::int64_t i = (t * n_heads + h) * head_dim + d;
        EXPECT_EQ(direct[i], x[i]) << "dimension " << d << " is past rot_dim";
      }
}

// Rotary pairs in halves (Qwen2's layout) are the adjacent pairs of the same values laid out
// the other way: dims (i, i + rot_dim/2) of a head rotated in halves give, bit for bit, what
// dims (2i, 2i+1) give rotated as adjacent pairs; the dims past rot_dim stay as they are.
TEST(Rope, HalvesAreAdjacentPairsLaidOutTheOtherWay) {
  const std::int64_t n = 4, n_heads = 3, head_dim = 16, rot_dim = 12, half = rot_dim / 2;
  const std::int32_t pos[n] = {0, 9, 700, 4095};
  const auto x = random_floats(n * n_heads * head_dim, 43);
  // The same values with each head's first rot_dim dims interleaved: 2i <- i, 2i+1 <- i + half.
  std::vector<float> interleaved = x;
  for (std::int64_t r = 0; r < n * n_heads; ++r)
    for (std::int64_t i = 0; i < half; ++i) {
      interleaved[r * head_dim + 2 * i] = x[r * head_dim + i];
      interleaved[r * head_dim + 2 * i + 1] = x[r * head_dim + i + half];
    }
  const std::vector<float> angles = rope_angles(n, rot_dim, pos, 1e6f);
  std::vector<float> halves = x;
  rope(halves.data(), n, n_heads, head_dim, rot_dim, angles.data(), RopeStyle::kHalves);
  rope(interleaved.data(), n, n_heads, head_dim, rot_dim, angles.data(), RopeStyle::kAdjacent);
  for (std::int64_t r = 0; r < n * n_heads; ++r) {
    for (std::int64_t i = 0; i < half; ++i) {
      EXPECT_EQ(halves[r * head_dim + i], interleaved[r * head_dim + 2 * i]) << "row " << r << " pair " << i;
      EXPECT_EQ(halves[r * head_dim + i + half], interleaved[r * head_dim + 2 * i + 1]) << "row " << r << " pair " << i;
    }
    for (std::int64_t d = rot_dim; d < head_dim; ++d) EXPECT_EQ(halves[r * head_dim + d], x[r * head_dim + d]);
  }
  EXPECT_NE(halves, x);
}

// rope_freqs divide each pair's angle: pair i of position p turns by p * base^(-2i/rot_dim) / f[i].
TEST(Rope, FrequencyFactorsDivideTheAngles) {
  const std::int64_t rot_dim = 8;
  const std::int32_t pos[2] = {5, 1000};
  const float factors[4] = {1.0f, 2.0f, 8.0f, 0.5f};
  const std::vector<float> plain = rope_angles(2, rot_dim, pos, 10000.0f);
  const std::vector<float> slowed = rope_angles(2, rot_dim, pos, 10000.0f, factors);
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 4; ++i) {
      const double theta = pos[t] * std::pow(10000.0, -2.0 * i / rot_dim) / factors[i];
      EXPECT_NEAR(slowed[t * rot_dim + 2 * i], std::cos(theta), 1e-4) << t << " " << i;
      EXPECT_NEAR(slowed[t * rot_dim + 2 * i + 1], std::sin(theta), 1e-4) << t << " " << i;
    }
  // A factor of 1 is the plain angle, bit for bit.
  EXPECT_EQ(slowed[0], plain[0]);
  EXPECT_EQ(slowed[rot_dim + 1], plain[rot_dim + 1]);
  // Phi-3's magnitude multiplies each cosine and sine, one F32 product.
  const std::vector<float> scaled = rope_angles(2, rot_dim, pos, 10000.0f, factors, 1.25f);
  for (std::size_t i = 0; i < scaled.size(); ++i) EXPECT_EQ(scaled[i], slowed[i] * 1.25f) << i;
}

TEST(RmsNorm, NormalisesAndScales) {
  const float x[4] = {1, 2, 3, 4}, w[4] = {1, 1, 2, 2};
  float out[4];
  rms_norm(x, w, 1, 4, 0.0f, out);
  const float rms = std::sqrt((1 + 4 + 9 + 16) / 4.0f);
  EXPECT_NEAR(out[0], 1 / rms, 1e-6);
  EXPECT_NEAR(out[3], 8 / rms, 1e-6);
}

// SwiGLU is g / (1 + std::exp(-g)) * u bit for bit, alone and shared among threads, over a
// length that is no multiple of the vector, block or thread spans, with gates far enough out
// that the exponential overflows or vanishes.
TEST(Swiglu, IsTheFormulaWithStdExpBitForBit) {
  const std::int64_t n = 3 * 4096 + 1001;
  auto gate = random_floats(n, 81);
  const auto up = random_floats(n, 82);
  for (std::int64_t i = 0; i < n; ++i) gate[i] *= (i % 97 == 0) ? 200.0f : 12.0f;
  std::vector<float> expected(gate.size());
  for (std::int64_t i = 0; i < n; ++i) expected[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  std::vector<float> alone = gate, shared = gate;
  swiglu(alone.data(), up.data(), n);
  ThreadPool pool(2);
  swiglu(shared.data(), up.data(), n, pool);
  std::string where;
  EXPECT_TRUE(same_bits(expected, alone, &where)) << where;
  EXPECT_TRUE(same_bits(expected, shared, &where)) << where;
}

TEST(RmsNorm, SharedAmongThreadsGivesTheSameValues) {
  const std::int64_t n = 37, dim = 576;
  const auto x = random_floats(n * dim, 83), w = random_floats(dim, 84);
  std::vector<float> alone(x.size()), shared(x.size());
  rms_norm(x.data(), w.data(), n, dim, 1e-5f, alone.data());
  ThreadPool pool(2);
  rms_norm(x.data(), w.data(), n, dim, 1e-5f, shared.data(), pool);
  std::string where;
  EXPECT_TRUE(same_bits(alone, shared, &where)) << where;
}

// The fused residual step is add, then rms_norm, bit for bit, with its output over its input
// (as the forward pass calls it) and into a separate buffer.
TEST(RmsNorm, AddThenNormInOnePassGivesTheSameValues) {
  const std::int64_t n = 37, dim = 576;
  const auto x0 = random_floats(n * dim, 85), y = random_floats(n * dim, 86), w = random_floats(dim, 87);
  std::vector<float> x_want = x0, want(x0.size());
  add(x_want.data(), y.data(), n * dim);
  rms_norm(x_want.data(), w.data(), n, dim, 1e-5f, want.data());
  ThreadPool pool(2);
  std::vector<float> x = x0, out(x0.size());
  add_rms_norm(x.data(), y.data(), w.data(), n, dim, 1e-5f, out.data(), pool);
  std::string where;
  EXPECT_TRUE(same_bits(x_want, x, &where)) << "x: " << where;
  EXPECT_TRUE(same_bits(want, out, &where)) << "out: " << where;
  std::vector<float> x2 = x0, in_place = y;
  add_rms_norm(x2.data(), in_place.data(), w.data(), n, dim, 1e-5f, in_place.data(), pool);
  EXPECT_TRUE(same_bits(want, in_place, &where)) << "in place: " << where;
}

// argmax is the first position of the greatest value, as a scan keeping the first strictly
// greater value finds it: for lengths around its sixteen-wide blocks, the greatest value in
// each block and the tail, ties, infinities and NaNs passed over.
TEST(Argmax, FirstOfTheGreatest) {
  const auto scan = [](const std::vector<float>& x) {
    std::int64_t best = -1;
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!std::isnan(x[i]) && (best < 0 || x[i] > x[best])) best = static_cast<std::int64_t>(i);
    return best < 0 ? 0 : best;
  };
  std::mt19937 rng(5);
  for (const std::int64_t n : {1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 100, 49152}) {
    const auto base = random_floats(n, 80 + static_cast<unsigned>(n));
    for (std::int64_t at = 0; at < n; at += std::max<std::int64_t>(1, n / 40)) {
      std::vector<float> x = base;
      x[at] = 5.0f;  // above every random value
      ASSERT_EQ(argmax(x.data(), n), at) << "n " << n;
      if (at + 1 < n) {
        x[n - 1] = 5.0f;  // a tie later on: the first one wins
        ASSERT_EQ(argmax(x.data(), n), at) << "tie, n " << n;
      }
      x[static_cast<std::size_t>(rng() % n)] = std::numeric_limits<float>::quiet_NaN();
      ASSERT_EQ(argmax(x.data(), n), scan(x)) << "NaN, n " << n;
    }
    std::vector<float> x(n, -INFINITY);
    EXPECT_EQ(argmax(x.data(), n), 0);
    x[n / 2] = INFINITY;
    EXPECT_EQ(argmax(x.data(), n), n / 2);
    std::fill(x.begin(), x.end(), std::numeric_limits<float>::quiet_NaN());
    EXPECT_EQ(argmax(x.data(), n), 0) << "all NaN";
  }
}

TEST(ThreadPool, CoversTheRangeExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    for (std::int64_t n : {1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
      for (int rep = 0; rep < 50; ++rep)
        pool.parallel_for(n, 1, [&](std::int64_t b, std::int64_t e, int) {
          for (std::int64_t i = b; i < e; ++i) hits[i]++;
        });
      for (auto& h : hits) EXPECT_EQ(h.load(), 50);
    }
  }
}

}  // namespace
