// The SIMD tiles of the 5-bit and K types and the SIMD Q8_K quantization against the portable
// ones, which define their arithmetic (portable.cpp): every path gives the same bits, through
// the tile functions directly and through matmul_group.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "../../../kernels/cpu/cpu_kernels.hpp"
#include "kernel_paths.hpp"
#include "batchlm/kernels/ops.hpp"

namespace {

using namespace batchlm::kernels;
using batchlm::kernels::testing::same_bits;
using batchlm::kernels::testing::simd_paths;

constexpr DType kTypes[] = {DType::Q5_0, DType::Q5_1, DType::Q4_K, DType::Q5_K, DType::Q6_K};

bool is_k(DType t) { return t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K; }

DType x_type(DType t) {
  if (is_k(t)) return DType::Q8_K;
  return t == DType::Q5_0 ? DType::Q8_0 : DType::Q8_1;
}

// The path's tile for t, the portable one where it has none (as ops.cpp's tile_for).
cpu::TileFn tile_of(const cpu::Kernels& k, DType t) {
  const cpu::Kernels& p = cpu::portable_kernels();
  switch (t) {
    case DType::Q5_0: return k.tile_q5_0 ? k.tile_q5_0 : p.tile_q5_0;
    case DType::Q5_1: return k.tile_q5_1 ? k.tile_q5_1 : p.tile_q5_1;
    case DType::Q4_K: return k.tile_q4_k ? k.tile_q4_k : p.tile_q4_k;
    case DType::Q5_K: return k.tile_q5_k ? k.tile_q5_k : p.tile_q5_k;
    default: return k.tile_q6_k ? k.tile_q6_k : p.tile_q6_k;
  }
}

cpu::QuantizeFn quantize_of(const cpu::Kernels& k) {
  return k.quantize_q8_k ? k.quantize_q8_k : cpu::portable_kernels().quantize_q8_k;
}

// A finite F16 value with random sign, exponent (subnormals included) and mantissa.
std::uint16_t finite_half(std::mt19937_64& rng) {
  for (;;) {
    const auto h = static_cast<std::uint16_t>(rng());
    if ((h & 0x7c00) != 0x7c00) return h;
  }
}

void set_half(std::uint8_t* p, std::uint16_t h) { std::memcpy(p, &h, 2); }

// Random bytes for every block of `rows` rows of n_blocks blocks of t, with each F16 scale
// field finite; Q8_K blocks get a finite d in [2^-20, 2^4) and the bsums of their quants.
std::vector<std::uint8_t> random_blocks(DType t, std::int64_t rows, std::int64_t n_blocks, std::mt19937_64& rng) {
  const std::size_t bb = block_bytes(t);
  std::vector<std::uint8_t> out(bb * static_cast<std::size_t>(rows * n_blocks));
  for (auto& b : out) b = static_cast<std::uint8_t>(rng());
  std::uniform_real_distribution<float> exponent(-20.0f, 4.0f);
  for (std::size_t at = 0; at < out.size(); at += bb) {
    std::uint8_t* blk = out.data() + at;
    switch (t) {
      case DType::Q5_0:
      case DType::Q8_0: set_half(blk, finite_half(rng)); break;
      case DType::Q5_1:
      case DType::Q8_1:
      case DType::Q4_K:
      case DType::Q5_K:
        set_half(blk, finite_half(rng));
        set_half(blk + 2, finite_half(rng));
        break;
      case DType::Q6_K: set_half(blk + offsetof(BlockQ6_K, d), finite_half(rng)); break;
      case DType::Q8_K: {
        auto* q = reinterpret_cast<BlockQ8_K*>(blk);
        q->d = std::exp2(exponent(rng));
        for (int g = 0; g < 16; ++g) {
          int sum = 0;
          for (int j = 0; j < 16; ++j) sum += q->qs[16 * g + j];
          q->bsums[g] = static_cast<std::int16_t>(sum);
        }
        break;
      }
      default: ADD_FAILURE() << "no random blocks of " << to_string(t);
    }
  }
  return out;
}

TEST(QuantTypesSimd, EveryPathHasItsOwnKernels) {
  for (const cpu::Kernels* k : simd_paths()) {
    EXPECT_NE(k->tile_q5_0, nullptr) << k->name;
    EXPECT_NE(k->tile_q5_1, nullptr) << k->name;
    EXPECT_NE(k->tile_q4_k, nullptr) << k->name;
    EXPECT_NE(k->tile_q5_k, nullptr) << k->name;
    EXPECT_NE(k->tile_q6_k, nullptr) << k->name;
    EXPECT_NE(k->quantize_q8_k, nullptr) << k->name;
  }
}

// Each tile shape the drivers use (nr 1..4, nt 1..tile_tokens) over rows and tokens that are
// not the first of their matrices, and outputs with a stride wider than the tile.
TEST(QuantTypesSimd, TilesAgreeBitForBit) {
  const std::vector<const cpu::Kernels*> paths = simd_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU or build has no SIMD path";
  const cpu::Kernels& portable = cpu::portable_kernels();
  std::mt19937_64 rng(7);
  for (const DType type : kTypes) {
    const std::int64_t max_blocks = is_k(type) ? 5 : 20;
    for (std::int64_t nb = 1; nb <= max_blocks; ++nb) {
      const std::int64_t rows = 6, tokens = 6, ys = 7;
      const std::vector<std::uint8_t> w = random_blocks(type, rows, nb, rng);
      const std::vector<std::uint8_t> x = random_blocks(x_type(type), tokens, nb, rng);
      const std::size_t wrb = row_bytes(type, nb * block_size(type)), xrb = row_bytes(x_type(type), nb * block_size(type));
      for (const cpu::Kernels* k : paths)
        for (int nr = 1; nr <= cpu::kTileRows; ++nr)
          for (int nt = 1; nt <= k->tile_tokens; ++nt) {
            std::vector<float> ref(tokens * ys, -1.0f), got(tokens * ys, -1.0f);
            tile_of(portable, type)(w.data() + wrb, wrb, nr, x.data() + xrb, xrb, nt, nb, ref.data(), ys);
            tile_of(*k, type)(w.data() + wrb, wrb, nr, x.data() + xrb, xrb, nt, nb, got.data(), ys);
            std::string where;
            EXPECT_TRUE(same_bits(ref.data(), got.data(), ref.size(), &where))
                << k->name << " " << to_string(type) << " blocks " << nb << " tile " << nr << "x" << nt << " " << where;
          }
    }
  }
}

// Through matmul_group, which quantizes x with the path's own quantization: row counts with
// partial row tiles, token counts that go row at a time (up to tile_tokens) and in tiles with
// partial token tiles.
TEST(QuantTypesSimd, MatmulAgreesBitForBit) {
  const std::vector<const cpu::Kernels*> paths = simd_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU or build has no SIMD path";
  const cpu::Kernels& portable = cpu::portable_kernels();
  ThreadPool pool(2);
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const DType type : kTypes) {
    const std::int64_t max_blocks = is_k(type) ? 5 : 20;
    for (std::int64_t nb = 1; nb <= max_blocks; ++nb)
      for (const std::int64_t rows : {1, 3, 4, 5, 13}) {
        const std::int64_t cols = nb * block_size(type);
        const std::vector<std::uint8_t> w = random_blocks(type, rows, nb, rng);
        const Matrix m{type, w.data(), rows, cols};
        for (const std::int64_t n : {1, 2, 3, 4, 5, 6, 7, 8, 9, 33}) {
          std::vector<float> x(static_cast<std::size_t>(n * cols));
          for (auto& v : x) v = normal(rng);
          std::vector<std::uint8_t> scratch(group_activation_bytes(std::span(&m, 1), n));
          std::vector<float> ref(n * rows), got(n * rows);
          float* const ref_out[1] = {ref.data()};
          float* const got_out[1] = {got.data()};
          cpu::matmul_group(portable, std::span(&m, 1), x.data(), n, ref_out, scratch.data(), pool);
          for (const cpu::Kernels* k : paths) {
            std::fill(got.begin(), got.end(), -1.0f);
            cpu::matmul_group(*k, std::span(&m, 1), x.data(), n, got_out, scratch.data(), pool);
            std::string where;
            EXPECT_TRUE(same_bits(ref.data(), got.data(), ref.size(), &where))
                << k->name << " " << to_string(type) << " blocks " << nb << " rows " << rows << " n " << n << " " << where;
          }
        }
      }
  }
}

// The K types' packed copies (cpu_kernels.hpp): their size, and products from them on every
// SIMD path bit for bit the portable tiles' on the GGUF layout, through matmul_group: row counts
// that leave one or two groups of a 16-row tile partly filled, token counts across the passes
// of the packed tiles, 1 to 5 super-blocks. Random blocks reach every quant, scale and min.
TEST(QuantTypesSimd, PackedKTypesAgreeBitForBit) {
  const std::vector<const cpu::Kernels*> paths = simd_paths();
  const cpu::Kernels& portable = cpu::portable_kernels();
  EXPECT_EQ(portable.packed_q4_k, nullptr);
  EXPECT_EQ(portable.packed_q5_k, nullptr);
  EXPECT_EQ(portable.packed_q6_k, nullptr);
  for (const cpu::Kernels* k : paths) {
    EXPECT_NE(k->packed_q4_k, nullptr) << k->name;
    EXPECT_NE(k->packed_q5_k, nullptr) << k->name;
    EXPECT_NE(k->packed_q6_k, nullptr) << k->name;
  }
  EXPECT_EQ(cpu::packed_block_bytes(DType::Q4_K), 1184u);
  EXPECT_EQ(cpu::packed_block_bytes(DType::Q5_K), 1440u);
  EXPECT_EQ(cpu::packed_block_bytes(DType::Q6_K), 1680u);
  // Against the GGUF blocks of the group's 8 rows: the scales and mins unpacked to bytes take
  // 128 bytes where Q4_K's and Q5_K's 12 per block take 96; the quants keep their bits.
  EXPECT_EQ(cpu::packed_block_bytes(DType::Q4_K), 8 * block_bytes(DType::Q4_K) + 32);
  EXPECT_EQ(cpu::packed_block_bytes(DType::Q5_K), 8 * block_bytes(DType::Q5_K) + 32);
  EXPECT_EQ(cpu::packed_block_bytes(DType::Q6_K), 8 * block_bytes(DType::Q6_K));
  ThreadPool pool(2);
  std::mt19937_64 rng(19);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const DType type : {DType::Q4_K, DType::Q5_K, DType::Q6_K})
    for (std::int64_t nb = 1; nb <= 5; ++nb)
      for (const std::int64_t rows : {1, 7, 8, 13, 16, 37}) {
        const std::int64_t cols = nb * kSuperBlock;
        const std::vector<std::uint8_t> w = random_blocks(type, rows, nb, rng);
        const PackedWeights packed = pack_weights(Matrix{type, w.data(), rows, cols});
        ASSERT_NE(packed.data(), nullptr) << to_string(type);
        EXPECT_EQ(packed.size(), static_cast<std::size_t>((rows + 7) / 8 * nb) * cpu::packed_block_bytes(type));
        const Matrix plain{type, w.data(), rows, cols}, fast{type, w.data(), rows, cols, packed.data()};
        // No block scales beside the Q8_K rows: the packed matrix needs the plain one's bytes.
        EXPECT_EQ(activation_bytes(fast, 5), activation_bytes(plain, 5));
        for (const std::int64_t n : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33}) {
          std::vector<float> x(static_cast<std::size_t>(n * cols));
          for (auto& v : x) v = normal(rng);
          std::vector<std::uint8_t> scratch(activation_bytes(fast, n));
          std::vector<float> ref(n * rows), got(n * rows);
          float* const ref_out[1] = {ref.data()};
          float* const got_out[1] = {got.data()};
          cpu::matmul_group(portable, std::span(&plain, 1), x.data(), n, ref_out, scratch.data(), pool);
          std::string where;
          // The portable path ignores the packed copy.
          cpu::matmul_group(portable, std::span(&fast, 1), x.data(), n, got_out, scratch.data(), pool);
          EXPECT_TRUE(same_bits(ref.data(), got.data(), ref.size(), &where))
              << "portable " << to_string(type) << " blocks " << nb << " rows " << rows << " n " << n << " " << where;
          for (const cpu::Kernels* k : paths) {
            std::fill(got.begin(), got.end(), -1.0f);
            cpu::matmul_group(*k, std::span(&fast, 1), x.data(), n, got_out, scratch.data(), pool);
            EXPECT_TRUE(same_bits(ref.data(), got.data(), ref.size(), &where))
                << k->name << " packed " << to_string(type) << " blocks " << nb << " rows " << rows << " n " << n << " " << where;
          }
        }
      }
}

// A group of packed matrices of all three dot types, K types among them, from one converted
// scratch of group_activation_bytes: each product is the one alone, bit for bit.
TEST(QuantTypesSimd, PackedKTypesInAGroup) {
  std::vector<const cpu::Kernels*> paths = simd_paths();
  paths.push_back(&cpu::portable_kernels());
  ThreadPool pool(2);
  std::mt19937_64 rng(23);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::int64_t cols = 512, n = 6;
  const DType types[] = {DType::Q4_K, DType::Q5_1, DType::Q6_K, DType::Q5_0, DType::Q5_K};
  const std::int64_t rows[] = {9, 16, 21, 8, 3};
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<PackedWeights> packed;
  std::vector<Matrix> group;
  for (int i = 0; i < 5; ++i) {
    bytes.push_back(random_blocks(types[i], rows[i], cols / block_size(types[i]), rng));
    packed.push_back(pack_weights(Matrix{types[i], bytes.back().data(), rows[i], cols}));
    group.push_back(Matrix{types[i], bytes.back().data(), rows[i], cols, packed.back().data()});
  }
  std::vector<float> x(static_cast<std::size_t>(n * cols));
  for (auto& v : x) v = normal(rng);
  std::size_t alone_bytes = 0;
  for (const Matrix& m : group) alone_bytes = std::max(alone_bytes, activation_bytes(m, n));
  for (const cpu::Kernels* k : paths) {
    std::vector<std::vector<float>> ys(5), alone(5);
    std::vector<float*> outs;
    for (int i = 0; i < 5; ++i) {
      ys[i].assign(static_cast<std::size_t>(n * rows[i]), -1.0f);
      alone[i].assign(static_cast<std::size_t>(n * rows[i]), -2.0f);
      outs.push_back(ys[i].data());
      std::vector<std::uint8_t> scratch(alone_bytes);
      float* const out[1] = {alone[i].data()};
      cpu::matmul_group(*k, std::span(&group[i], 1), x.data(), n, out, scratch.data(), pool);
    }
    std::vector<std::uint8_t> scratch(group_activation_bytes(group, n));
    cpu::matmul_group(*k, group, x.data(), n, outs, scratch.data(), pool);
    for (int i = 0; i < 5; ++i) {
      std::string where;
      EXPECT_TRUE(same_bits(alone[i].data(), ys[i].data(), ys[i].size(), &where))
          << k->name << " " << to_string(types[i]) << " " << where;
    }
  }
}

// Activations with one nonzero quant (1, at element e, scale 1) pick out each weight element
// alone: every path gives the portable bits, and those are the dequantized element (up to
// the rounding of the scale products), so a quant or scale taken from the wrong element or
// sub-block shows. The weights have one sub-block with nonzero scales at a time (the others
// still hold random quants).
TEST(QuantTypesSimd, EachElementMeetsItsOwnScale) {
  std::vector<const cpu::Kernels*> paths = simd_paths();
  paths.insert(paths.begin(), &cpu::portable_kernels());
  std::mt19937_64 rng(13);
  for (const DType type : kTypes) {
    const std::int64_t n = block_size(type);
    const DType xt = x_type(type);
    const int subs = type == DType::Q6_K ? 16 : is_k(type) ? 8 : 1;
    for (int sub = 0; sub < subs; ++sub) {
      std::vector<std::uint8_t> w = random_blocks(type, 1, 1, rng);
      if (type == DType::Q4_K || type == DType::Q5_K) {
        // Scale and min of sub-block `sub` only: 6-bit fields of k_scale_min set to zero.
        std::uint8_t* sc = reinterpret_cast<BlockQ4_K*>(w.data())->scales;
        for (int j = 0; j < 8; ++j) {
          if (j == sub) continue;
          if (j < 4) {
            sc[j] &= 0xc0;
            sc[j + 4] &= 0xc0;
          } else {
            sc[j + 4] = 0;
            sc[j - 4] &= 0x3f;
            sc[j] &= 0x3f;
          }
        }
      } else if (type == DType::Q6_K) {
        auto* b = reinterpret_cast<BlockQ6_K*>(w.data());
        for (int j = 0; j < 16; ++j)
          if (j != sub) b->scales[j] = 0;
      }
      std::vector<float> deq(n);
      dequantize_row(type, w.data(), n, deq.data());
      float largest = 0.0f;  // of the row's values: the scale of the rounding differences
      for (const float v : deq) largest = std::max(largest, std::fabs(v));
      for (std::int64_t e = 0; e < n; ++e) {
        std::vector<std::uint8_t> x(block_bytes(xt), 0);
        if (xt == DType::Q8_K) {
          auto* b = reinterpret_cast<BlockQ8_K*>(x.data());
          b->d = 1.0f;
          b->qs[e] = 1;
          b->bsums[e / 16] = 1;
        } else {
          set_half(x.data(), fp32_to_fp16(1.0f));
          if (xt == DType::Q8_1) set_half(x.data() + 2, fp32_to_fp16(1.0f));  // s = d * sum
          x[xt == DType::Q8_1 ? 4 + e : 2 + e] = 1;
        }
        float ref = 0.0f;
        for (const cpu::Kernels* k : paths) {
          float y = -1.0f;
          tile_of(*k, type)(w.data(), w.size(), 1, x.data(), x.size(), 1, 1, &y, 1);
          if (k == paths.front()) {
            ref = y;
            EXPECT_NEAR(y, deq[e], 1e-5f * std::fabs(deq[e]) + 1e-6f * largest + 1e-30f)
                << to_string(type) << " sub-block " << sub << " element " << e;
          } else {
            EXPECT_EQ(std::bit_cast<std::uint32_t>(y), std::bit_cast<std::uint32_t>(ref))
                << k->name << " " << to_string(type) << " sub-block " << sub << " element " << e << ": " << y << " vs " << ref;
          }
        }
      }
    }
  }
}

// quantize_q8_k on rows of random, zero, huge and tiny values, subnormals beside a normal
// maximum, and values at rounding ties (x * 127 / max exactly k + 1/2).
TEST(QuantTypesSimd, QuantizeQ8KAgreesBytewise) {
  const std::vector<const cpu::Kernels*> paths = simd_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU or build has no SIMD path";
  std::mt19937_64 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::pair<std::string, std::vector<float>>> rows;
  const auto row = [&](const std::string& name, auto value) {
    std::vector<float> v(512);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(i);
    rows.emplace_back(name, std::move(v));
  };
  row("normal", [&](std::size_t) { return normal(rng); });
  row("wide", [&](std::size_t) { return normal(rng) * std::exp2(std::uniform_real_distribution<float>(-30.0f, 30.0f)(rng)); });
  row("zeros", [](std::size_t) { return 0.0f; });
  row("signed zeros", [](std::size_t i) { return i % 2 ? -0.0f : 0.0f; });
  row("zeros then values", [&](std::size_t i) { return i < 256 ? 0.0f : normal(rng); });
  row("one value", [](std::size_t i) { return i == 300 ? -2.5f : 0.0f; });
  row("huge", [&](std::size_t i) { return i % 7 == 0 ? std::numeric_limits<float>::max() * (i % 2 ? -1.0f : 1.0f) : normal(rng) * 1e37f; });
  row("tiny", [&](std::size_t) { return normal(rng) * 1e-30f; });
  row("subnormals", [&](std::size_t i) { return i % 256 == 5 ? 1e-30f : normal(rng) * 1e-40f; });
  // max 127: the scale is 1, and k + 1/2 are ties.
  row("ties at scale 1", [&](std::size_t i) {
    if (i % 256 == 0) return 127.0f;
    return (static_cast<float>(static_cast<int>(i % 253) - 126) + 0.5f) * (i % 3 ? 1.0f : -1.0f);
  });
  // max 254: x * 1/2 ties at odd x.
  row("ties at scale 1/2", [&](std::size_t i) {
    if (i % 256 == 17) return -254.0f;
    return static_cast<float>(2 * static_cast<int>(i % 127) + 1) * (i % 5 ? 1.0f : -1.0f);
  });
  row("ties and neighbours", [&](std::size_t i) {
    if (i % 256 == 100) return 127.0f;
    const float t = static_cast<float>(static_cast<int>(i % 200) - 100) + 0.5f;
    return i % 3 == 0 ? t : i % 3 == 1 ? std::nextafter(t, 1e9f) : std::nextafter(t, -1e9f);
  });
  const cpu::QuantizeFn portable = cpu::portable_kernels().quantize_q8_k;
  for (const auto& [name, v] : rows) {
    std::vector<std::uint8_t> ref(row_bytes(DType::Q8_K, 512), 0xaa), got(ref.size());
    portable(v.data(), 512, ref.data());
    for (const cpu::Kernels* k : paths) {
      std::fill(got.begin(), got.end(), 0x55);
      quantize_of(*k)(v.data(), 512, got.data());
      EXPECT_EQ(ref, got) << k->name << " " << name;
    }
  }
  // The rows as quantized: the quants and their sums in range.
  std::vector<std::uint8_t> q(row_bytes(DType::Q8_K, 512));
  portable(rows[0].second.data(), 512, q.data());
  const auto* b = reinterpret_cast<const BlockQ8_K*>(q.data());
  int sum = 0;
  for (int j = 0; j < 16; ++j) sum += b->qs[j];
  EXPECT_EQ(b->bsums[0], sum);
}

}  // namespace
