// The element-wise kernels, paged attention and sampling of kernels/cuda against the CPU
// kernels (kernels/ops.hpp) and the CPU sampler (local_engine/sampling.hpp). Every test skips
// where there is no usable GPU.
//
// Bounds (relative L2 error over the whole output, ||gpu - ref|| / ||ref||; NaN fails):
// - rms_norm, add_rms_norm: 1e-5 against the CPU (F32 vs double sum of squares).
// - rope: 2e-6 against a double-precision evaluation of the definition (the kernel computes
//   angles and cos/sin in double); 5e-3 against the CPU kernel at positions up to 12000, whose
//   F32 angles (built by repeated multiplication) are off by up to ~3e-3 rad there.
// - swiglu: 1e-6; add, gather_rows, store_f16_paged: exact. The fused rope_store_kv and
//   swiglu_rows: the same bits as the kernels they stand for.
// - attention: 1e-5 against a double-precision softmax(q k^T) v over the same F16 cache; 2e-3
//   against the CPU kernel, which rounds queries and probabilities to F16 (the GPU does not).
//   Padding tokens' outputs are exactly zero. The split (flash-decoding) and unsplit paths
//   agree within 1e-5, and a larger max_context bound gives bit-identical results.
// - sampling: greedy rows equal kernels::argmax exactly; sampled tokens equal the token the
//   CPU sampler's distribution gives for the same uniform number (cumulative probability in
//   token-id order, the kernel's order), except when u lies within 1e-6 of a cumulative
//   boundary (rounding may go either way there: the draw must then be some kept token);
//   frequencies over 20,000 draws pass a chi-square test at significance 1e-6.

// cuda_runtime.h first: gpu_test.hpp's DeviceBuffer calls cudaMalloc(T**, size_t), the
// template overload that cuda_runtime.h declares (cuda.hpp includes only cuda_runtime_api.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "batchlm/kernels/cuda.hpp"
#include "batchlm/kernels/dtype.hpp"
#include "batchlm/kernels/ops.hpp"
#include "batchlm/kernels/thread_pool.hpp"
#include "batchlm/local_engine/sampling.hpp"
#include "gpu_test.hpp"

namespace batchlm::gpu_test {
namespace {

namespace k = batchlm::kernels;

bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

// ---------------------------------------------------------------------------------------------
// Element-wise and row operations.

TEST(CudaOps, RmsNormMatchesCpu) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(1);
  for (const std::int64_t dim : {64, 1000, 4096}) {
    const std::int64_t n = 7;
    const auto x = random_floats(n * dim, rng, 3.0f), w = random_floats(dim, rng);
    std::vector<float> ref(x.size());
    k::rms_norm(x.data(), w.data(), n, dim, 1e-5f, ref.data());
    DeviceBuffer<float> dx(x), dw(w), dout(x.size());
    dout.poison();
    kc::rms_norm(dx.get(), dw.get(), n, dim, 1e-5f, dout.get(), nullptr);
    sync();
    EXPECT_LT(relative_error(dout.download(), ref), 1e-5) << "dim " << dim;
    // In place.
    kc::rms_norm(dx.get(), dw.get(), n, dim, 1e-5f, dx.get(), nullptr);
    sync();
    EXPECT_LT(relative_error(dx.download(), ref), 1e-5) << "in place, dim " << dim;
  }
}

TEST(CudaOps, AddRmsNormMatchesCpu) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(2);
  const std::int64_t n = 5, dim = 2048;
  const auto x = random_floats(n * dim, rng), y = random_floats(n * dim, rng), w = random_floats(dim, rng);
  std::vector<float> sum = x, ref(x.size());
  k::add(sum.data(), y.data(), n * dim);
  k::rms_norm(sum.data(), w.data(), n, dim, 1e-6f, ref.data());
  DeviceBuffer<float> dx(x), dy(y), dw(w), dout(x.size());
  dout.poison();
  kc::add_rms_norm(dx.get(), dy.get(), dw.get(), n, dim, 1e-6f, dout.get(), nullptr);
  sync();
  EXPECT_EQ(dx.download(), sum);  // x += y is the same F32 addition
  EXPECT_LT(relative_error(dout.download(), ref), 1e-5);
}

TEST(CudaOps, RopeMatchesDefinitionAndCpu) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(3);
  const std::vector<std::int32_t> positions = {0, 1, 2, 17, 255, 1000, 4095, 8191, 8192, 12000};
  const auto n = static_cast<std::int64_t>(positions.size());
  for (const float base : {10000.0f, 1000000.0f}) {
    for (const std::int64_t rot_dim : {128, 64}) {
      const std::int64_t n_heads = 3, head_dim = 128;
      const auto x = random_floats(n * n_heads * head_dim, rng);
      // The definition, in double.
      std::vector<float> exact = x;
      for (std::int64_t t = 0; t < n; ++t)
        for (std::int64_t h = 0; h < n_heads; ++h)
          for (std::int64_t i = 0; i < rot_dim / 2; ++i) {
            const double angle = positions[t] * std::pow(static_cast<double>(base), -2.0 * i / rot_dim);
            const std::int64_t at = (t * n_heads + h) * head_dim + 2 * i;
            const double a = x[at], b = x[at + 1];
            exact[at] = static_cast<float>(a * std::cos(angle) - b * std::sin(angle));
            exact[at + 1] = static_cast<float>(a * std::sin(angle) + b * std::cos(angle));
          }
      std::vector<float> cpu = x;
      k::rope(cpu.data(), n, n_heads, head_dim, rot_dim, positions.data(), base);
      DeviceBuffer<float> dx(x);
      DeviceBuffer<std::int32_t> dpos(positions);
      kc::rope(dx.get(), n, n_heads, head_dim, rot_dim, dpos.get(), base, nullptr);
      sync();
      const auto gpu = dx.download();
      EXPECT_LT(relative_error(gpu, exact), 2e-6) << "base " << base << " rot_dim " << rot_dim;
      EXPECT_LT(relative_error(gpu, cpu), 5e-3) << "base " << base << " rot_dim " << rot_dim;
      // Dims past rot_dim are untouched.
      for (std::int64_t t = 0; t < n * n_heads; ++t)
        for (std::int64_t d = rot_dim; d < head_dim; ++d)
          ASSERT_EQ(gpu[t * head_dim + d], x[t * head_dim + d]);
    }
  }
}

// Rotary pairs in halves of each head (Qwen's and Phi-3's layout), angles divided by per-pair
// factors (Llama 3.1's rope_freqs, Phi-3's short factors) and Phi-3's magnitude, against the
// definition in double and the CPU.
TEST(CudaOps, RopeInHalvesAndWithFreqFactorsMatchesDefinitionAndCpu) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(13);
  const std::vector<std::int32_t> positions = {0, 1, 3, 100, 2047, 8191, 31000};
  const auto n = static_cast<std::int64_t>(positions.size());
  const std::int64_t n_heads = 3, head_dim = 64;
  for (const k::RopeStyle style : {k::RopeStyle::kAdjacent, k::RopeStyle::kHalves}) {
    for (const std::int64_t rot_dim : {64, 32}) {
      for (const bool with_factors : {false, true}) {
        std::vector<float> factors(static_cast<std::size_t>(rot_dim / 2));
        for (std::size_t i = 0; i < factors.size(); ++i) factors[i] = 1.0f + 0.37f * static_cast<float>(i);
        const float* host_factors = with_factors ? factors.data() : nullptr;
        // With the factors, Phi-3.5's magnitude too.
        const float attn_factor = with_factors ? 1.1902f : 1.0f;
        const float base = 500000.0f;
        const auto x = random_floats(n * n_heads * head_dim, rng);
        std::vector<float> exact = x;
        const std::int64_t half = rot_dim / 2;
        for (std::int64_t t = 0; t < n; ++t)
          for (std::int64_t h = 0; h < n_heads; ++h)
            for (std::int64_t i = 0; i < half; ++i) {
              double angle = positions[t] * std::pow(static_cast<double>(base), -2.0 * i / rot_dim);
              if (with_factors) angle /= factors[i];
              const std::int64_t at = (t * n_heads + h) * head_dim;
              const std::int64_t e0 = style == k::RopeStyle::kHalves ? i : 2 * i;
              const std::int64_t e1 = style == k::RopeStyle::kHalves ? i + half : 2 * i + 1;
              const double a = x[at + e0], b = x[at + e1];
              const double c = std::cos(angle) * attn_factor, sn = std::sin(angle) * attn_factor;
              exact[at + e0] = static_cast<float>(a * c - b * sn);
              exact[at + e1] = static_cast<float>(a * sn + b * c);
            }
        std::vector<float> cpu = x;
        k::rope(cpu.data(), n, n_heads, head_dim, rot_dim,
                k::rope_angles(n, rot_dim, positions.data(), base, host_factors, attn_factor).data(), style);
        DeviceBuffer<float> dx(x), dfactors(factors);
        DeviceBuffer<std::int32_t> dpos(positions);
        kc::rope(dx.get(), n, n_heads, head_dim, rot_dim, dpos.get(), base, nullptr, style,
                 with_factors ? dfactors.get() : nullptr, attn_factor);
        sync();
        const auto gpu = dx.download();
        const std::string what = std::string(style == k::RopeStyle::kHalves ? "halves" : "adjacent") + " rot_dim " +
                                 std::to_string(rot_dim) + (with_factors ? " with factors" : "");
        EXPECT_LT(relative_error(gpu, exact), 2e-6) << what;
        EXPECT_LT(relative_error(gpu, cpu), 5e-3) << what;
        for (std::int64_t r = 0; r < n * n_heads; ++r)
          for (std::int64_t d = rot_dim; d < head_dim; ++d) ASSERT_EQ(gpu[r * head_dim + d], x[r * head_dim + d]) << what;
      }
    }
  }
}

// Biases, then per-head RMS norms of the queries and keys, in place, stacked or apart: against
// the CPU's add and rms_norm (as the forward pass applies them), any part left out.
TEST(CudaOps, QkvBiasNormMatchesTheCpu) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(21);
  struct Case {
    std::int64_t heads, kv_heads, dim;
    bool bias, norm, stacked;
  };
  for (const Case c : {Case{14, 2, 64, true, false, true}, Case{4, 2, 128, false, true, true},
                       Case{8, 8, 256, true, true, false}, Case{3, 1, 40, true, true, true},
                       Case{2, 1, 8, false, true, false}}) {
    const std::int64_t n = 13, QW = c.heads * c.dim, KV = c.kv_heads * c.dim, row = QW + 2 * KV;
    const std::string what = std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " heads of " +
                             std::to_string(c.dim) + (c.bias ? ", biases" : "") + (c.norm ? ", norms" : "") +
                             (c.stacked ? ", stacked" : ", apart");
    const auto qkv = random_floats(n * row, rng, 2.0f);
    const auto qb = random_floats(QW, rng, 0.5f), kb = random_floats(KV, rng, 0.5f), vb = random_floats(KV, rng, 0.5f);
    auto qn = random_floats(c.dim, rng, 0.2f), kn = random_floats(c.dim, rng, 0.2f);
    for (auto& w : qn) w += 1.0f;
    for (auto& w : kn) w += 1.0f;
    // The CPU's steps on rows apart.
    std::vector<float> q(n * QW), kk(n * KV), v(n * KV);
    for (std::int64_t t = 0; t < n; ++t) {
      std::copy_n(qkv.begin() + t * row, QW, q.begin() + t * QW);
      std::copy_n(qkv.begin() + t * row + QW, KV, kk.begin() + t * KV);
      std::copy_n(qkv.begin() + t * row + QW + KV, KV, v.begin() + t * KV);
    }
    std::vector<float> want_q = q, want_k = kk, want_v = v;
    if (c.bias) {
      for (std::int64_t t = 0; t < n; ++t) {
        k::add(want_q.data() + t * QW, qb.data(), QW);
        k::add(want_k.data() + t * KV, kb.data(), KV);
        k::add(want_v.data() + t * KV, vb.data(), KV);
      }
    }
    if (c.norm) {
      k::rms_norm(want_q.data(), qn.data(), n * c.heads, c.dim, 1e-6f, want_q.data());
      k::rms_norm(want_k.data(), kn.data(), n * c.kv_heads, c.dim, 1e-6f, want_k.data());
    }
    DeviceBuffer<float> dqkv(qkv), dq(q), dk(kk), dv(v), dqb(qb), dkb(kb), dvb(vb), dqn(qn), dkn(kn);
    kc::QkvExtras extras;
    if (c.bias) {
      extras.q_bias = dqb.get();
      extras.k_bias = dkb.get();
      extras.v_bias = dvb.get();
    }
    if (c.norm) {
      extras.q_norm = dqn.get();
      extras.k_norm = dkn.get();
    }
    extras.eps = 1e-6f;
    std::vector<float> got_q(n * QW), got_k(n * KV), got_v(n * KV);
    if (c.stacked) {
      kc::qkv_bias_norm(dqkv.get(), dqkv.get() + QW, dqkv.get() + QW + KV, row, row, row, n, c.heads, c.kv_heads,
                        c.dim, extras, nullptr);
      sync();
      const auto back = dqkv.download();
      for (std::int64_t t = 0; t < n; ++t) {
        std::copy_n(back.begin() + t * row, QW, got_q.begin() + t * QW);
        std::copy_n(back.begin() + t * row + QW, KV, got_k.begin() + t * KV);
        std::copy_n(back.begin() + t * row + QW + KV, KV, got_v.begin() + t * KV);
      }
    } else {
      kc::qkv_bias_norm(dq.get(), dk.get(), dv.get(), QW, KV, KV, n, c.heads, c.kv_heads, c.dim, extras, nullptr);
      sync();
      got_q = dq.download();
      got_k = dk.download();
      got_v = dv.download();
    }
    EXPECT_LT(relative_error(got_q, want_q), 1e-6) << what;
    EXPECT_LT(relative_error(got_k, want_k), 1e-6) << what;
    EXPECT_EQ(got_v, want_v) << what;  // one F32 addition, or nothing
  }
  // Heads wider than 256 values are refused; no extras launches nothing.
  EXPECT_THROW(kc::qkv_bias_norm(nullptr, nullptr, nullptr, 512, 512, 512, 1, 1, 1, 512, kc::QkvExtras{}, nullptr),
               std::invalid_argument);
  kc::qkv_bias_norm(nullptr, nullptr, nullptr, 64, 64, 64, 4, 1, 1, 64, kc::QkvExtras{}, nullptr);
  sync();
}

TEST(CudaOps, SwigluAddGatherMatchCpu) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(4);
  const std::int64_t n = 100003;
  const auto g = random_floats(n, rng, 4.0f), u = random_floats(n, rng);
  std::vector<float> ref = g;
  k::swiglu(ref.data(), u.data(), n);
  DeviceBuffer<float> dg(g), du(u);
  kc::swiglu(dg.get(), du.get(), n, nullptr);
  sync();
  EXPECT_LT(relative_error(dg.download(), ref), 1e-6);

  std::vector<float> sum = g;
  k::add(sum.data(), u.data(), n);
  dg.upload(g);
  kc::add(dg.get(), du.get(), n, nullptr);
  sync();
  EXPECT_EQ(dg.download(), sum);

  const std::int64_t width = 1000, src_rows = 9;
  const auto src = random_floats(src_rows * width, rng);
  const std::vector<std::int32_t> rows = {8, 0, 3, 3, -1, 7};
  DeviceBuffer<float> dsrc(src), ddst(rows.size() * width);
  DeviceBuffer<std::int32_t> drows(rows);
  ddst.poison();
  kc::gather_rows(dsrc.get(), drows.get(), static_cast<std::int64_t>(rows.size()), width, ddst.get(), nullptr);
  sync();
  const auto dst = ddst.download();
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (std::int64_t c = 0; c < width; ++c) {
      const float want = rows[i] >= 0 ? src[rows[i] * width + c] : 0.0f;  // a negative id: zeros
      ASSERT_EQ(dst[i * width + c], want) << "row " << i << " col " << c;
    }
}

// A PagedBatch over device copies of the block tables ([sequences][max_blocks]), sequence ids
// and positions.
kc::PagedBatch paged_batch(std::int64_t block_size, DeviceBuffer<std::int32_t>& tables, std::int64_t max_blocks,
                           DeviceBuffer<std::int32_t>& sequence_of, DeviceBuffer<std::int32_t>& positions) {
  kc::PagedBatch batch;
  batch.block_size = block_size;
  batch.block_tables = tables.get();
  batch.max_blocks = static_cast<std::int32_t>(max_blocks);
  batch.sequence_of = sequence_of.get();
  batch.positions = positions.get();
  return batch;
}

// store_f16_paged writes each real token's row where its block table says, as the CPU does,
// and padding tokens (sequence -1) write nothing: every other byte of the pool is unchanged.
TEST(CudaOps, StoreF16PagedMatchesCpuAndSkipsPadding) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(5);
  const std::int64_t width = 96, block = 16, n_blocks = 12, max_blocks = 4;
  std::vector<std::int32_t> order(n_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  // Two sequences, tables of 4 blocks each (flattened [2][4]).
  const std::vector<std::int32_t> tables(order.begin(), order.begin() + 2 * max_blocks);
  const std::vector<std::int32_t> sequence_of = {1, 0, -1, 1, 0, -1, 1};
  const std::vector<std::int32_t> positions = {0, 15, 3, 16, 63, 9, 47};
  const auto n = static_cast<std::int64_t>(sequence_of.size());
  const auto x = random_floats(n * width, rng);
  std::vector<std::uint16_t> pool(n_blocks * block * width);
  for (auto& h : pool) h = static_cast<std::uint16_t>(rng());
  // The CPU reference, on the real tokens only.
  std::vector<std::uint16_t> ref = pool;
  const std::span<const std::int32_t> spans[2] = {std::span(tables).subspan(0, max_blocks),
                                                  std::span(tables).subspan(max_blocks, max_blocks)};
  for (std::int64_t t = 0; t < n; ++t) {
    if (sequence_of[t] < 0) continue;
    const k::PagedKv kv{ref.data(), ref.data(), block, spans, &sequence_of[t]};
    k::store_f16_paged(x.data() + t * width, 1, width, &positions[t], kv, ref.data());
  }
  DeviceBuffer<float> dx(x);
  DeviceBuffer<std::uint16_t> dpool(pool);
  DeviceBuffer<std::int32_t> dtables(tables), dseq(sequence_of), dpos(positions);
  const kc::PagedBatch batch = paged_batch(block, dtables, max_blocks, dseq, dpos);
  kc::store_f16_paged(dx.get(), n, width, batch, dpool.get(), nullptr);
  sync();
  const auto got = dpool.download();
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_EQ(std::memcmp(got.data(), ref.data(), got.size() * sizeof(std::uint16_t)), 0);
}

// rope_store_kv does in one launch what rope (queries, keys) and store_f16_paged (keys, values)
// do, bit for bit: with Q, K and V as parts of one stacked product's rows and as three
// contiguous arrays; partial rotary dims (the rest copied); GQA; padding tokens, whose queries
// are still rotated (as rope does) and whose keys and values write nothing.
TEST(CudaOps, RopeStoreKvEqualsRopeThenStores) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(12);
  const std::int64_t block = 16, n_blocks = 10, max_blocks = 5;
  std::vector<std::int32_t> order(n_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::int32_t> tables(order.begin(), order.begin() + 2 * max_blocks);
  tables[max_blocks + 2] = -1;  // sequence 1's third block is not there
  // The last three tokens write nothing: a block of -1 (sequence 1, position 35), a position
  // past the table (80 = max_blocks * block), a negative position. Their queries still rotate.
  const std::vector<std::int32_t> sequence_of = {0, 1, -1, 0, 1, 1, -1, 0, 1, 0, 1};
  const std::vector<std::int32_t> positions = {5, 0, 2, 79, 16, 31, 7, 40, 35, 80, -3};
  const auto n = static_cast<std::int64_t>(sequence_of.size());
  // The pool rows the real tokens own; every other row keeps its bytes.
  std::vector<bool> written(n_blocks * block, false);
  for (std::int64_t t = 0; t < 8; ++t) {
    if (sequence_of[t] < 0) continue;
    const std::int32_t b = tables[sequence_of[t] * max_blocks + positions[t] / block];
    written[b * block + positions[t] % block] = true;
  }
  DeviceBuffer<std::int32_t> dtables(tables), dseq(sequence_of), dpos(positions);
  const kc::PagedBatch batch = paged_batch(block, dtables, max_blocks, dseq, dpos);
  struct Case {
    std::int64_t heads, kv_heads, dim, rot;
    bool stacked;
    k::RopeStyle style = k::RopeStyle::kAdjacent;
    bool factors = false;
  };
  for (const Case c : {Case{9, 3, 64, 64, true}, Case{9, 3, 64, 64, false}, Case{4, 4, 80, 32, true},
                       Case{8, 2, 128, 0, false}, Case{6, 1, 16, 8, true},
                       Case{14, 2, 64, 64, true, k::RopeStyle::kHalves},
                       Case{4, 2, 128, 128, false, k::RopeStyle::kHalves, true},
                       Case{4, 4, 80, 32, true, k::RopeStyle::kHalves}, Case{9, 3, 64, 64, true, k::RopeStyle::kAdjacent, true}}) {
    std::vector<float> factors(static_cast<std::size_t>(std::max<std::int64_t>(c.rot / 2, 1)));
    for (std::size_t i = 0; i < factors.size(); ++i) factors[i] = 1.0f + static_cast<float>(i % 5);
    DeviceBuffer<float> dfactors(factors);
    const float* f = c.factors ? dfactors.get() : nullptr;
    const std::int64_t QW = c.heads * c.dim, KV = c.kv_heads * c.dim, row = QW + 2 * KV;
    const auto qkv = random_floats(n * row, rng, 3.0f);
    std::vector<float> q(n * QW), kk(n * KV), v(n * KV);
    for (std::int64_t t = 0; t < n; ++t) {
      std::copy_n(qkv.begin() + t * row, QW, q.begin() + t * QW);
      std::copy_n(qkv.begin() + t * row + QW, KV, kk.begin() + t * KV);
      std::copy_n(qkv.begin() + t * row + QW + KV, KV, v.begin() + t * KV);
    }
    std::vector<std::uint16_t> pool(n_blocks * block * KV);
    for (auto& h : pool) h = static_cast<std::uint16_t>(rng());
    const std::string what = std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " heads, dim " +
                             std::to_string(c.dim) + ", rot " + std::to_string(c.rot) +
                             (c.stacked ? ", stacked" : ", apart") +
                             (c.style == k::RopeStyle::kHalves ? ", halves" : "") + (c.factors ? ", factors" : "");
    // The reference: rope, rope, store, store.
    DeviceBuffer<float> rq(q), rk(kk), rv(v);
    DeviceBuffer<std::uint16_t> rkp(pool), rvp(pool);
    const float attn = c.factors ? 1.25f : 1.0f;
    kc::rope(rq.get(), n, c.heads, c.dim, c.rot, dpos.get(), 100000.0f, nullptr, c.style, f, attn);
    kc::rope(rk.get(), n, c.kv_heads, c.dim, c.rot, dpos.get(), 100000.0f, nullptr, c.style, f, attn);
    kc::store_f16_paged(rk.get(), n, KV, batch, rkp.get(), nullptr);
    kc::store_f16_paged(rv.get(), n, KV, batch, rvp.get(), nullptr);
    // The fused kernel.
    DeviceBuffer<float> dqkv(qkv), dq(q), dk(kk), dv(v), dq_out(n * QW);
    DeviceBuffer<std::uint16_t> dkp(pool), dvp(pool);
    dq_out.poison();
    const kc::QkvRows in = c.stacked ? kc::QkvRows{dqkv.get(), dqkv.get() + QW, dqkv.get() + QW + KV, row, row, row}
                                     : kc::QkvRows{dq.get(), dk.get(), dv.get(), QW, KV, KV};
    kc::rope_store_kv(in, n, c.heads, c.kv_heads, c.dim, c.rot, 100000.0f, batch, dq_out.get(), dkp.get(), dvp.get(),
                      nullptr, c.style, f, attn);
    sync();
    const auto want_q = rq.download(), got_q = dq_out.download();
    EXPECT_EQ(std::memcmp(got_q.data(), want_q.data(), got_q.size() * sizeof(float)), 0) << what;
    const auto want_k = rkp.download(), got_k = dkp.download(), want_v = rvp.download(), got_v = dvp.download();
    EXPECT_EQ(got_k, want_k) << what;
    EXPECT_EQ(got_v, want_v) << what;
    std::int64_t kept = 0, changed = 0;
    for (std::int64_t r = 0; r < n_blocks * block; ++r) {
      const auto same = [&](const std::vector<std::uint16_t>& got) {
        return std::equal(got.begin() + r * KV, got.begin() + (r + 1) * KV, pool.begin() + r * KV);
      };
      if (!written[r]) kept += same(got_k) && same(got_v);
      else changed += !same(got_k);
    }
    EXPECT_EQ(kept, n_blocks * block - 6) << what << ": rows no token owns were written";
    EXPECT_EQ(changed, 6) << what << ": a real token's key row was not written";
    if (!c.stacked) {  // in place, as the executor uses it when Q, K and V are apart
      kc::rope_store_kv(in, n, c.heads, c.kv_heads, c.dim, c.rot, 100000.0f, batch, dq.get(), dkp.get(), dvp.get(),
                        nullptr, c.style, f, attn);
      sync();
      const auto in_place = dq.download();
      EXPECT_EQ(std::memcmp(in_place.data(), want_q.data(), in_place.size() * sizeof(float)), 0) << what;
    }
  }
  const kc::QkvRows narrow{nullptr, nullptr, nullptr, 10, 64, 64};
  EXPECT_THROW(kc::rope_store_kv(narrow, 1, 1, 1, 64, 64, 1e4f, batch, nullptr, nullptr, nullptr, nullptr),
               std::invalid_argument);
  const kc::QkvRows fine{nullptr, nullptr, nullptr, 64, 64, 64};
  EXPECT_THROW(kc::rope_store_kv(fine, 1, 1, 1, 64, 66, 1e4f, batch, nullptr, nullptr, nullptr, nullptr),
               std::invalid_argument);
}

// swiglu_rows over the two halves of a stacked gate/up product equals swiglu on them apart.
TEST(CudaOps, SwigluRowsEqualsSwiglu) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(13);
  const std::int64_t n = 37, F = 1536;
  const auto gate_up = random_floats(n * 2 * F, rng, 4.0f);
  std::vector<float> g(n * F), u(n * F);
  for (std::int64_t t = 0; t < n; ++t) {
    std::copy_n(gate_up.begin() + t * 2 * F, F, g.begin() + t * F);
    std::copy_n(gate_up.begin() + t * 2 * F + F, F, u.begin() + t * F);
  }
  DeviceBuffer<float> dg(g), du(u), dgu(gate_up), dout(n * F);
  kc::swiglu(dg.get(), du.get(), n * F, nullptr);
  dout.poison();
  kc::swiglu_rows(dgu.get(), dgu.get() + F, n, F, 2 * F, dout.get(), nullptr);
  sync();
  const auto want = dg.download(), got = dout.download();
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  EXPECT_THROW(kc::swiglu_rows(dgu.get(), dgu.get(), n, F, F - 1, dout.get(), nullptr), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Paged attention.

struct Seq {
  std::int32_t first_position;
  std::int32_t queries;
};

struct AttentionCase {
  k::AttentionShape shape;
  std::int64_t block_size = 16;
  std::vector<Seq> seqs;
  std::int64_t lead_padding = 0;   // padding tokens before the first sequence's tokens
  std::int64_t tail_padding = 0;   // and after the last
  float q_scale = 1.0f;
  std::uint32_t seed = 0;
};

// The host side of a case: pools, block tables, queries, and the per-token view for the CPU.
struct AttentionData {
  AttentionCase c;
  std::int64_t n_tokens = 0, max_blocks = 0, row = 0;
  std::int32_t max_queries = 0, max_context = 0;
  std::vector<float> q;
  std::vector<std::uint16_t> k_pool, v_pool;
  std::vector<std::int32_t> tables;  // [n_seqs][max_blocks]
  std::vector<std::int32_t> query_start, first_position;
  std::vector<std::int32_t> positions, sequence_of;  // per token; -1: padding
};

constexpr std::uint16_t kF16NaN = 0x7e00;

// Block ids are shuffled over a pool with spare blocks; every slot that no sequence fills (the
// spare blocks, the tail of each sequence's last block) holds NaN, and table entries past a
// sequence's blocks name a NaN block: a kernel that reads a position it should not sees NaN.
AttentionData make_attention(const AttentionCase& c) {
  AttentionData d;
  d.c = c;
  std::mt19937 rng(c.seed);
  const auto& s = c.shape;
  d.row = s.n_heads * s.head_dim;
  std::int64_t total_blocks = 0;
  for (const Seq& q : c.seqs) {
    const std::int64_t ctx = q.first_position + q.queries;
    d.max_queries = std::max(d.max_queries, q.queries);
    d.max_context = std::max<std::int32_t>(d.max_context, static_cast<std::int32_t>(ctx));
    const std::int64_t blocks = (ctx + c.block_size - 1) / c.block_size;
    d.max_blocks = std::max(d.max_blocks, blocks + 1);
    total_blocks += blocks;
  }
  const std::int64_t pool_blocks = total_blocks + 6;
  std::vector<std::int32_t> ids(pool_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  const std::int32_t nan_block = ids.back();  // never given to a sequence
  d.k_pool.assign(pool_blocks * c.block_size * s.kv_stride, kF16NaN);
  d.v_pool = d.k_pool;
  d.tables.assign(c.seqs.size() * d.max_blocks, nan_block);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::size_t next = 0;
  d.query_start.push_back(static_cast<std::int32_t>(c.lead_padding));
  for (std::int64_t t = 0; t < c.lead_padding; ++t) d.positions.push_back(0), d.sequence_of.push_back(-1);
  for (std::size_t si = 0; si < c.seqs.size(); ++si) {
    const Seq& q = c.seqs[si];
    const std::int64_t ctx = q.first_position + q.queries;
    for (std::int64_t b = 0; b * c.block_size < ctx; ++b) d.tables[si * d.max_blocks + b] = ids[next++];
    for (std::int64_t p = 0; p < ctx; ++p) {
      const std::int64_t at = (d.tables[si * d.max_blocks + p / c.block_size] * c.block_size + p % c.block_size) * s.kv_stride;
      for (std::int64_t e = 0; e < s.n_kv_heads * s.head_dim; ++e) {
        d.k_pool[at + e] = k::fp32_to_fp16(normal(rng));
        d.v_pool[at + e] = k::fp32_to_fp16(normal(rng));
      }
    }
    for (std::int32_t j = 0; j < q.queries; ++j) {
      d.positions.push_back(q.first_position + j);
      d.sequence_of.push_back(static_cast<std::int32_t>(si));
    }
    d.query_start.push_back(d.query_start.back() + q.queries);
    d.first_position.push_back(q.first_position);
  }
  for (std::int64_t t = 0; t < c.tail_padding; ++t) d.positions.push_back(0), d.sequence_of.push_back(-1);
  d.n_tokens = static_cast<std::int64_t>(d.positions.size());
  d.q = random_floats(d.n_tokens * d.row, rng, c.q_scale);
  return d;
}

// The GPU result. extra_seqs empty sequences and larger bounds model a graph captured for a
// bigger batch; the outputs are poisoned first.
struct Bounds {
  std::int32_t extra_seqs = 0;
  std::int32_t max_queries = 0;  // 0: the exact value
  std::int32_t max_context = 0;  // 0: the exact value
};

std::vector<float> gpu_attention(const AttentionData& d, const Bounds& bounds = {}) {
  std::vector<std::int32_t> query_start = d.query_start, first_position = d.first_position;
  std::vector<std::int32_t> tables = d.tables;
  for (std::int32_t e = 0; e < bounds.extra_seqs; ++e) {
    query_start.push_back(query_start.back());  // no queries
    first_position.push_back(0);
    tables.insert(tables.end(), d.max_blocks, -1);
  }
  DeviceBuffer<float> dq(d.q), dout(d.q.size());
  DeviceBuffer<std::uint16_t> dk(d.k_pool), dv(d.v_pool);
  DeviceBuffer<std::int32_t> dtables(tables), dstart(query_start), dfirst(first_position);
  kc::AttentionBatch b;
  b.shape = d.c.shape;
  b.k_pool = dk.get();
  b.v_pool = dv.get();
  b.block_size = d.c.block_size;
  b.block_tables = dtables.get();
  b.max_blocks = static_cast<std::int32_t>(d.max_blocks);
  b.n_seqs = static_cast<std::int32_t>(d.c.seqs.size()) + bounds.extra_seqs;
  b.query_start = dstart.get();
  b.first_position = dfirst.get();
  b.max_queries = bounds.max_queries > 0 ? bounds.max_queries : d.max_queries;
  b.max_context = bounds.max_context > 0 ? bounds.max_context : d.max_context;
  const std::size_t scratch_bytes = kc::attention_scratch_bytes(b, d.n_tokens);
  DeviceBuffer<std::uint8_t> scratch(scratch_bytes);
  scratch.poison();
  dout.poison();
  kc::attention_paged(b, dq.get(), d.n_tokens, dout.get(), scratch_bytes > 0 ? scratch.get() : nullptr, nullptr);
  sync();
  return dout.download();
}

// The CPU kernel on the real tokens (they are contiguous); zeros for padding. The CPU pool
// holds keys transposed within each block (ops.hpp PagedKv): the same keys rewritten so.
std::vector<float> cpu_attention(const AttentionData& d) {
  std::vector<float> out(d.q.size(), 0.0f);
  const std::int64_t block_elems = d.c.block_size * d.c.shape.kv_stride;
  std::vector<std::uint16_t> keys(d.k_pool.size());
  k::transpose_key_blocks(d.k_pool.data(), static_cast<std::int64_t>(d.k_pool.size()) / block_elems, d.c.block_size,
                          d.c.shape.kv_stride, keys.data());
  std::vector<std::span<const std::int32_t>> spans;
  for (std::size_t si = 0; si < d.c.seqs.size(); ++si)
    spans.emplace_back(d.tables.data() + si * d.max_blocks, static_cast<std::size_t>(d.max_blocks));
  const std::int64_t first = d.query_start.front(), n = d.query_start.back() - first;
  const k::PagedKv kv{keys.data(), d.v_pool.data(), d.c.block_size, spans, d.sequence_of.data() + first};
  k::ThreadPool pool(4);
  k::attention_paged(d.c.shape, d.q.data() + first * d.row, n, d.positions.data() + first, kv,
                     out.data() + first * d.row, pool);
  return out;
}

// softmax(q k^T * scale) v in double over the same F16 cache (queries not rounded).
std::vector<float> exact_attention(const AttentionData& d) {
  const auto& s = d.c.shape;
  const std::int64_t group = s.n_heads / s.n_kv_heads, D = s.head_dim;
  std::vector<float> out(d.q.size(), 0.0f);
  std::vector<double> p, o(D);
  for (std::int64_t t = 0; t < d.n_tokens; ++t) {
    const std::int32_t seq = d.sequence_of[t];
    if (seq < 0) continue;
    const std::int64_t ctx = d.positions[t] + 1;
    for (std::int64_t h = 0; h < s.n_heads; ++h) {
      const std::int64_t kvh = h / group;
      const float* q = d.q.data() + (t * s.n_heads + h) * D;
      p.assign(ctx, 0.0);
      double mx = -INFINITY;
      for (std::int64_t j = 0; j < ctx; ++j) {
        const std::int64_t at = (d.tables[seq * d.max_blocks + j / d.c.block_size] * d.c.block_size + j % d.c.block_size) *
                                    s.kv_stride + kvh * D;
        double dot = 0;
        for (std::int64_t e = 0; e < D; ++e) dot += static_cast<double>(q[e]) * k::fp16_to_fp32(d.k_pool[at + e]);
        p[j] = dot * s.scale;
        mx = std::max(mx, p[j]);
      }
      double sum = 0;
      for (auto& x : p) sum += (x = std::exp(x - mx));
      std::fill(o.begin(), o.end(), 0.0);
      for (std::int64_t j = 0; j < ctx; ++j) {
        const std::int64_t at = (d.tables[seq * d.max_blocks + j / d.c.block_size] * d.c.block_size + j % d.c.block_size) *
                                    s.kv_stride + kvh * D;
        for (std::int64_t e = 0; e < D; ++e) o[e] += p[j] / sum * k::fp16_to_fp32(d.v_pool[at + e]);
      }
      for (std::int64_t e = 0; e < D; ++e) out[(t * s.n_heads + h) * D + e] = static_cast<float>(o[e]);
    }
  }
  return out;
}

// The rows of the real tokens only, and whether every padding row is exactly zero.
std::vector<float> real_rows(const AttentionData& d, const std::vector<float>& v) {
  return std::vector<float>(v.begin() + d.query_start.front() * d.row, v.begin() + d.query_start.back() * d.row);
}
bool padding_is_zero(const AttentionData& d, const std::vector<float>& v) {
  for (std::int64_t t = 0; t < d.n_tokens; ++t) {
    if (d.sequence_of[t] >= 0) continue;
    for (std::int64_t i = 0; i < d.row; ++i)
      if (v[t * d.row + i] != 0.0f) return false;
  }
  return true;
}

void check_attention(const AttentionCase& c, const Bounds& bounds = {}) {
  const AttentionData d = make_attention(c);
  const auto gpu = gpu_attention(d, bounds);
  const auto exact = exact_attention(d), cpu = cpu_attention(d);
  const std::string what = "heads " + std::to_string(c.shape.n_heads) + "/" + std::to_string(c.shape.n_kv_heads) +
                           " dim " + std::to_string(c.shape.head_dim) + " seed " + std::to_string(c.seed);
  const auto g = real_rows(d, gpu);
  ASSERT_TRUE(all_finite(g)) << what;
  EXPECT_TRUE(padding_is_zero(d, gpu)) << what;
  const double vs_exact = relative_error(g, real_rows(d, exact)), vs_cpu = relative_error(g, real_rows(d, cpu));
  EXPECT_LT(vs_exact, 1e-5) << what;
  EXPECT_LT(vs_cpu, 2e-3) << what;
  if (std::getenv("BATCHLM_TEST_VERBOSE") != nullptr)
    std::printf("attention %s: vs exact %.3g, vs cpu %.3g (cpu vs exact %.3g)\n", what.c_str(), vs_exact, vs_cpu,
                relative_error(real_rows(d, cpu), real_rows(d, exact)));
}

k::AttentionShape shape(std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, std::int64_t stride_pad = 0) {
  return k::AttentionShape{heads, kv_heads, dim, kv_heads * dim + stride_pad, 1.0f / std::sqrt(static_cast<float>(dim))};
}

// Decode tokens at contexts 1, 15, 16, 17, 300 and 2000 (one query each), GQA ratios 1, 3, 8.
TEST(CudaAttention, DecodeBatchesMatchReference) {
  BATCHLM_REQUIRE_GPU();
  std::uint32_t seed = 100;
  for (const auto& sh : {shape(4, 4, 64), shape(6, 2, 128), shape(8, 1, 64), shape(16, 2, 128)}) {
    AttentionCase c;
    c.shape = sh;
    c.seed = seed++;
    for (const std::int32_t ctx : {1, 15, 16, 17, 300, 2000}) c.seqs.push_back({ctx - 1, 1});
    check_attention(c);
  }
}

// Decode tokens, drafts (a few queries), prefill chunks (from position 0 and continuing a
// cache) and padding tokens in one batch; block sizes 16 and 32.
TEST(CudaAttention, MixedBatchesMatchReference) {
  BATCHLM_REQUIRE_GPU();
  std::uint32_t seed = 200;
  for (const auto& sh : {shape(4, 4, 64), shape(6, 2, 128), shape(8, 1, 128), shape(24, 3, 64)}) {
    for (const std::int64_t block : {16, 32}) {
      AttentionCase c;
      c.shape = sh;
      c.block_size = block;
      c.seed = seed++;
      c.lead_padding = 2;
      c.tail_padding = 3;
      c.seqs = {{14, 1}, {0, 33}, {260, 40}, {16, 1}, {1995, 5}, {0, 1}, {299, 1}, {150, 17}};
      check_attention(c);
    }
  }
}

// One long prefill chunk late in a long context; large scores (a peaky softmax); head dims from
// 8 to 256 (the largest shared-memory footprint), multiples of 32 and not (16, 48, 80, 96, 200:
// lanes past the last dim hold no accumulator); a row stride with room between positions, and
// one that is not a multiple of 8 halves (the kernel's unaligned load path).
TEST(CudaAttention, PrefillAndShapesMatchReference) {
  BATCHLM_REQUIRE_GPU();
  AttentionCase c;
  c.shape = shape(8, 2, 128);
  c.seqs = {{1900, 100}};
  c.seed = 300;
  check_attention(c);
  c.seqs = {{0, 70}, {500, 3}};
  c.q_scale = 6.0f;
  c.seed = 301;
  check_attention(c);
  c.q_scale = 1.0f;
  for (const auto& sh : {shape(4, 2, 32), shape(8, 4, 256), shape(4, 2, 64, 32), shape(4, 2, 64, 4), shape(4, 2, 8),
                         shape(4, 4, 16), shape(6, 2, 48), shape(8, 2, 80, 8), shape(4, 1, 96), shape(4, 2, 200)}) {
    c.shape = sh;
    c.seqs = {{0, 20}, {700, 1}, {33, 2}};
    c.seed += 1;
    check_attention(c);
  }
}

// Many sequences (fewer splits than chunks: each split walks several chunks) and the bounds of a
// graph captured for a bigger batch (empty sequences, more queries and context than used).
TEST(CudaAttention, LargeBatchesAndLooseBoundsMatchReference) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(400);
  AttentionCase c;
  c.shape = shape(8, 8, 64);
  c.seed = 401;
  for (int i = 0; i < 40; ++i) c.seqs.push_back({static_cast<std::int32_t>(rng() % 2000), 1});
  check_attention(c);
  c.seqs.resize(5);
  c.tail_padding = 11;
  check_attention(c, Bounds{7, 8, 4096});
  check_attention(c, Bounds{1200, 1, 0});  // grid large enough that nothing is split
}

// The same decode batch through the split path and, with a bound of 1024 sequences (a grid big
// enough that the context is not split), the unsplit one: they agree to rounding; a larger
// max_context bound changes only how many splits find no work: bit-identical results.
TEST(CudaAttention, SplitAndUnsplitPathsAgree) {
  BATCHLM_REQUIRE_GPU();
  AttentionCase c;
  c.shape = shape(8, 2, 128);
  c.seed = 500;
  c.seqs = {{1999, 1}, {299, 1}, {16, 1}, {1200, 1}};
  const AttentionData d = make_attention(c);
  const auto split = gpu_attention(d);
  const auto wider = gpu_attention(d, Bounds{0, 0, 4 * d.max_context});
  const auto unsplit = gpu_attention(d, Bounds{1024, 0, 0});
  ASSERT_TRUE(all_finite(split));
  EXPECT_EQ(std::memcmp(split.data(), wider.data(), split.size() * sizeof(float)), 0);
  EXPECT_LT(relative_error(split, unsplit), 1e-5);
}

// The executor's use: attention captured once in a CUDA graph at fixed bounds (8 sequences, one
// query each, a context bound of 1024), then replayed with new metadata for smaller batches
// (fewer sequences, padding tokens, shorter contexts): every replay matches the reference.
TEST(CudaAttention, CapturedGraphReplaysSmallerBatches) {
  BATCHLM_REQUIRE_GPU();
  constexpr std::int32_t kSeqs = 8, kContext = 1024;
  constexpr std::int64_t kTokens = 8, kBlock = 16, kMaxBlocks = kContext / kBlock + 1;
  const auto sh = shape(8, 2, 64);
  std::vector<AttentionData> cases;
  std::uint32_t seed = 900;
  for (const std::vector<std::int32_t>& contexts :
       std::vector<std::vector<std::int32_t>>{{1024, 1, 17, 300, 513, 1000, 64, 2}, {5, 900, 33}, {1}, {1023, 256}}) {
    AttentionCase c;
    c.shape = sh;
    c.block_size = kBlock;
    c.seed = seed++;
    for (const std::int32_t ctx : contexts) c.seqs.push_back({ctx - 1, 1});
    c.tail_padding = kTokens - static_cast<std::int64_t>(contexts.size());
    cases.push_back(make_attention(c));
  }
  std::size_t pool_elems = 0;
  for (const auto& d : cases) pool_elems = std::max(pool_elems, d.k_pool.size());
  DeviceBuffer<float> dq(kTokens * cases[0].row), dout(kTokens * cases[0].row);
  DeviceBuffer<std::uint16_t> dk(pool_elems), dv(pool_elems);
  DeviceBuffer<std::int32_t> dtables(kSeqs * kMaxBlocks), dstart(kSeqs + 1), dfirst(kSeqs);
  kc::AttentionBatch b;
  b.shape = sh;
  b.k_pool = dk.get();
  b.v_pool = dv.get();
  b.block_size = kBlock;
  b.block_tables = dtables.get();
  b.max_blocks = static_cast<std::int32_t>(kMaxBlocks);
  b.n_seqs = kSeqs;
  b.query_start = dstart.get();
  b.first_position = dfirst.get();
  b.max_queries = 1;
  b.max_context = kContext;
  const std::size_t scratch_bytes = kc::attention_scratch_bytes(b, kTokens);
  DeviceBuffer<std::uint8_t> scratch(scratch_bytes);

  cudaStream_t stream = nullptr;
  kc::check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  kc::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  kc::attention_paged(b, dq.get(), kTokens, dout.get(), scratch_bytes > 0 ? scratch.get() : nullptr, stream);
  kc::check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  kc::check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");

  for (const AttentionData& d : cases) {
    ASSERT_LE(d.max_blocks, kMaxBlocks);
    // The metadata at the captured bounds: tables of kMaxBlocks, unused sequences empty.
    std::vector<std::int32_t> tables(kSeqs * kMaxBlocks, -1), start(d.query_start), first(d.first_position);
    for (std::size_t si = 0; si < d.c.seqs.size(); ++si)
      std::copy_n(d.tables.begin() + si * d.max_blocks, d.max_blocks, tables.begin() + si * kMaxBlocks);
    const std::int32_t end = start.back();
    start.resize(kSeqs + 1, end);
    first.resize(kSeqs, 0);
    dtables.upload(tables);
    dstart.upload(start);
    dfirst.upload(first);
    std::vector<std::uint16_t> kp = d.k_pool, vp = d.v_pool;
    kp.resize(pool_elems, kF16NaN);
    vp.resize(pool_elems, kF16NaN);
    dk.upload(kp);
    dv.upload(vp);
    dq.upload(d.q);
    dout.poison();
    scratch.poison();
    kc::check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    kc::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const auto gpu = dout.download();
    const auto g = real_rows(d, gpu);
    ASSERT_TRUE(all_finite(g)) << d.c.seqs.size() << " sequences";
    EXPECT_TRUE(padding_is_zero(d, gpu)) << d.c.seqs.size() << " sequences";
    EXPECT_LT(relative_error(g, real_rows(d, exact_attention(d))), 1e-5) << d.c.seqs.size() << " sequences";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaAttention, RejectsUnsupportedHeadDims) {
  BATCHLM_REQUIRE_GPU();
  for (const std::int64_t dim : {0, 4, 12, 36, 264, 288}) {
    kc::AttentionBatch b;
    b.shape = shape(4, 2, dim);
    b.n_seqs = 1;
    b.max_queries = 1;
    b.max_context = 10;
    EXPECT_THROW(kc::attention_scratch_bytes(b, 1), std::invalid_argument) << dim;
    EXPECT_THROW(kc::attention_paged(b, nullptr, 1, nullptr, nullptr, nullptr), std::invalid_argument) << dim;
  }
}

// ---------------------------------------------------------------------------------------------
// Sampling.

std::vector<std::int32_t> gpu_sample(const std::vector<float>& logits, std::int64_t n_vocab,
                                     const std::vector<kc::SampleParams>& params) {
  const auto rows = static_cast<std::int64_t>(params.size());
  DeviceBuffer<float> dl(logits);
  DeviceBuffer<kc::SampleParams> dp(params);
  DeviceBuffer<std::int32_t> dt(params.size());
  const std::size_t scratch_bytes = kc::sample_scratch_bytes(rows, n_vocab);
  DeviceBuffer<std::uint8_t> scratch(scratch_bytes);
  dt.poison(0x7f);  // 0x7f7f7f7f: no token, and not the -1 of a broken row
  kc::sample(dl.get(), rows, n_vocab, dp.get(), dt.get(), scratch_bytes > 0 ? scratch.get() : nullptr, nullptr);
  sync();
  return dt.download();
}

TEST(CudaSample, GreedyEqualsArgmaxIncludingTies) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(600);
  for (const std::int64_t n_vocab : {1, 12, 1000, 151936}) {
    std::vector<float> logits;
    std::vector<kc::SampleParams> params;
    for (int r = 0; r < 12; ++r) {
      auto row = random_floats(n_vocab, rng, 3.0f);
      if (n_vocab > 3) {
        const auto top = std::max_element(row.begin(), row.end()) - row.begin();
        if (r % 4 == 1) row[(top + n_vocab / 2) % n_vocab] = row[top];  // a tie after (or before) it
        if (r % 4 == 2) std::fill(row.begin(), row.end(), 0.5f);         // all equal
        if (r % 4 == 3) row[n_vocab - 1] = row[0] = row[top] + 1.0f;     // first and last tie
        if (r == 5) row[2] = -0.0f, row[1] = 0.0f, std::fill(row.begin() + 3, row.end(), -1.0f), row[0] = -2.0f;
      }
      logits.insert(logits.end(), row.begin(), row.end());
      kc::SampleParams p;
      p.temperature = r % 3 == 0 ? 0.0f : 0.8f;
      p.top_k = r % 3 == 0 ? 0 : 1;  // top_k == 1 is greedy at any temperature
      p.seed = static_cast<std::uint64_t>(r);
      params.push_back(p);
    }
    const auto tokens = gpu_sample(logits, n_vocab, params);
    for (std::size_t r = 0; r < params.size(); ++r)
      EXPECT_EQ(tokens[r], k::argmax(logits.data() + r * n_vocab, n_vocab)) << "vocab " << n_vocab << " row " << r;
  }
}

// A broken forward pass gives -1, greedy or not, and the engine fails that request (it got
// token 0 and went on). As the CPU's broken_logits: a NaN or an infinity anywhere in a row,
// largest or not. Rows without one, in the same launch, give their token.
TEST(CudaSample, RowsWithANonFiniteValueGiveMinusOne) {
  BATCHLM_REQUIRE_GPU();
  constexpr std::int64_t n_vocab = 1000;
  std::vector<float> logits;
  std::vector<kc::SampleParams> params;
  for (int r = 0; r < 12; ++r) {
    std::vector<float> row(n_vocab, 0.25f);
    row[3] = 2.0f;  // a clear largest value
    switch (r / 2) {
      case 0: std::fill(row.begin(), row.end(), NAN); break;
      case 1: row[7] = INFINITY; break;
      case 2: row[999] = NAN; break;        // not the largest, in the last element
      case 3: row[512] = -INFINITY; break;  // the first thread's second element
      case 4: row[0] = NAN; break;
      case 5: break;                        // none: its token is 3
    }
    logits.insert(logits.end(), row.begin(), row.end());
    kc::SampleParams p;
    p.temperature = r % 2 == 0 ? 0.0f : 0.8f;
    p.seed = static_cast<std::uint64_t>(r);
    params.push_back(p);
  }
  const auto tokens = gpu_sample(logits, n_vocab, params);
  for (std::size_t r = 0; r < params.size(); ++r) {
    if (r >= 10 && r % 2 == 0) EXPECT_EQ(tokens[r], 3) << "row " << r;  // greedy
    else if (r >= 10) EXPECT_TRUE(tokens[r] >= 0 && tokens[r] < n_vocab) << "row " << r << ": " << tokens[r];
    else EXPECT_EQ(tokens[r], -1) << "row " << r;
  }
}

// The CPU sampler's distribution for these logits and parameters (its kept set and weights).
local_engine::TokenDistribution cpu_distribution(std::span<const float> logits, const kc::SampleParams& p) {
  local_engine::SamplingParams sp;
  sp.temperature = p.temperature;
  sp.top_p = p.top_p;
  sp.top_k = p.top_k;
  sp.seed = p.seed;
  local_engine::Sampler sampler(sp);
  return sampler.distribution(logits);
}

// The kernel's draw order: the kept tokens by id, with their cumulative probabilities.
struct IdOrder {
  std::vector<std::int32_t> tokens;
  std::vector<double> cum;
};
IdOrder id_order(const local_engine::TokenDistribution& dist) {
  std::vector<std::size_t> order(dist.tokens.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return dist.tokens[a] < dist.tokens[b]; });
  IdOrder out;
  double cum = 0.0;
  for (const std::size_t i : order) {
    cum += dist.weights[i] / dist.total;
    out.tokens.push_back(dist.tokens[i]);
    out.cum.push_back(cum);
  }
  return out;
}

// The kernel's draw for uniform u: the first token in id order whose cumulative probability
// exceeds u (the last one if rounding leaves none). `margin` receives the distance from u to
// the nearest cumulative boundary (below it, rounding on the device may pick a neighbour).
std::int32_t expected_draw(const IdOrder& ids, double u, double& margin) {
  const auto it = std::upper_bound(ids.cum.begin(), ids.cum.end(), u);
  const auto i = static_cast<std::size_t>(it - ids.cum.begin());
  margin = u;
  if (i < ids.cum.size()) margin = std::min(margin, ids.cum[i] - u);
  if (i > 0) margin = std::min(margin, u - ids.cum[i - 1]);
  if (i + 1 < ids.cum.size()) margin = std::min(margin, ids.cum[i + 1] - u);
  return ids.tokens[std::min(i, ids.tokens.size() - 1)];
}

// True when no cumulative probability in the order top-p keeps tokens in (logit descending, the
// lower id first) is within `gap` of top_p: the kept set cannot depend on rounding. `full` is
// the CPU's distribution of `row` without top-p (its tokens in id order).
bool top_p_is_clear(std::span<const float> row, const local_engine::TokenDistribution& full, float top_p, double gap) {
  std::vector<std::size_t> order(full.tokens.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return row[static_cast<std::size_t>(full.tokens[a])] > row[static_cast<std::size_t>(full.tokens[b])];
  });
  double cum = 0.0;
  for (const std::size_t i : order) {
    cum += full.weights[i] / full.total;
    if (std::abs(cum - top_p) < gap) return false;
  }
  return true;
}

// Runs `draws` counters of one parameter set over one row of logits, and checks each token
// against expected_draw. Returns the tokens.
std::vector<std::int32_t> check_draws(const std::vector<float>& row, const kc::SampleParams& base, int draws,
                                      const std::string& what) {
  const auto n_vocab = static_cast<std::int64_t>(row.size());
  std::vector<float> logits;
  logits.reserve(row.size() * draws);
  std::vector<kc::SampleParams> params;
  for (int i = 0; i < draws; ++i) {
    logits.insert(logits.end(), row.begin(), row.end());
    kc::SampleParams p = base;
    p.counter = base.counter + static_cast<std::uint64_t>(i);
    params.push_back(p);
  }
  const auto tokens = gpu_sample(logits, n_vocab, params);
  const auto dist = cpu_distribution(row, base);
  const IdOrder ids = id_order(dist);
  int near_boundary = 0, mismatches = 0;
  for (int i = 0; i < draws; ++i) {
    const double u = kc::sample_uniform(params[i].seed, params[i].counter);
    EXPECT_TRUE(u >= 0.0 && u < 1.0);
    double margin = 0;
    const std::int32_t want = expected_draw(ids, u, margin);
    if (margin < 1e-6) {
      ++near_boundary;
      EXPECT_GT(dist.probability(tokens[i]), 0.0) << what << " draw " << i;
      continue;
    }
    if (tokens[i] != want && ++mismatches <= 5)
      ADD_FAILURE() << what << " draw " << i << ": got " << tokens[i] << ", want " << want << " (u " << u << ")";
  }
  EXPECT_EQ(mismatches, 0) << what;
  // With 12 tokens a draw this close to a boundary is rare; with 32000 tokens whose
  // probabilities are ~3e-5 apart, about 7% of the draws are.
  EXPECT_LE(near_boundary, std::max(3, draws / 10)) << what;
  return tokens;
}

// Twelve tokens, every combination of temperature, top-k (with ties at the k-th logit) and top-p
// (with ties at the threshold): each draw is the token the CPU sampler's distribution gives.
TEST(CudaSample, SmallVocabularyDrawsAreExact) {
  BATCHLM_REQUIRE_GPU();
  // Ties: ids 2 and 9 (2.0), ids 4, 6 and 11 (1.0).
  const std::vector<float> row = {0.5f, 1.5f, 2.0f, -1.0f, 1.0f, 3.0f, 1.0f, -3.0f, 0.25f, 2.0f, -0.5f, 1.0f};
  struct Case { float temperature, top_p; std::int32_t top_k; };
  const Case cases[] = {{1.0f, 1.0f, 0},  {0.7f, 1.0f, 0},  {1.3f, 1.0f, 5},  {1.0f, 1.0f, 3},  {1.0f, 1.0f, 6},
                        {1.0f, 0.8f, 0},  {0.9f, 0.6f, 7},  {2.0f, 0.9f, 0},  {1.0f, 0.0f, 0},  {0.5f, 0.95f, 4},
                        {1.0f, 1.0f, 12}, {1.0f, 1.0f, 100}, {40.0f, 1.0f, 0}, {0.05f, 1.0f, 0}};
  std::uint64_t seed = 7;
  for (const Case& cs : cases) {
    kc::SampleParams p;
    p.temperature = cs.temperature;
    p.top_p = cs.top_p;
    p.top_k = cs.top_k;
    p.seed = seed++;
    p.counter = 1000;
    if (cs.top_p < 1.0f) {
      kc::SampleParams no_p = p;
      no_p.top_p = 1.0f;
      ASSERT_TRUE(top_p_is_clear(row, cpu_distribution(row, no_p), cs.top_p, 1e-4)) << "test data";
    }
    const std::string what = "t " + std::to_string(cs.temperature) + " top_p " + std::to_string(cs.top_p) +
                             " top_k " + std::to_string(cs.top_k);
    check_draws(row, p, 2000, what);
  }
}

// Large vocabularies: a typical top-k/top-p setting (the kept set fits the kernel's shared-memory
// list), and flat or tied logits with no top-k or a large one (more than 4096 candidates: the
// kernel streams over the row).
TEST(CudaSample, LargeVocabularyDrawsAreExact) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(700);
  struct Case { float spread, temperature, top_p; std::int32_t top_k; bool quantize; };
  const Case cases[] = {{3.0f, 0.8f, 0.9f, 50, false}, {3.0f, 1.0f, 1.0f, 0, false}, {0.5f, 1.0f, 0.9f, 0, false},
                        {0.5f, 1.0f, 1.0f, 5000, true}, {1.0f, 1.0f, 0.7f, 6000, true}, {2.0f, 0.7f, 0.95f, 40, true}};
  std::uint64_t seed = 70;
  for (const Case& cs : cases) {
    const std::int64_t n_vocab = 32000;
    kc::SampleParams p;
    p.temperature = cs.temperature;
    p.top_p = cs.top_p;
    p.top_k = cs.top_k;
    p.seed = seed++;
    std::vector<float> row;
    for (int attempt = 0;; ++attempt) {
      row = random_floats(n_vocab, rng, cs.spread);
      if (cs.quantize)
        for (auto& x : row) x = std::round(x * 4.0f) / 4.0f;  // many ties, at every threshold
      kc::SampleParams no_p = p;
      no_p.top_p = 1.0f;
      if (cs.top_p >= 1.0f || top_p_is_clear(row, cpu_distribution(row, no_p), cs.top_p, 1e-6)) break;
      ASSERT_LT(attempt, 20) << "test data";
    }
    const std::string what = "spread " + std::to_string(cs.spread) + " top_p " + std::to_string(cs.top_p) +
                             " top_k " + std::to_string(cs.top_k);
    check_draws(row, p, 1000, what);
  }
}

// Frequencies over 20,000 counters against the distribution: chi-square at significance 1e-6
// (Wilson-Hilferty critical value), and nothing outside the kept set.
TEST(CudaSample, FrequenciesFollowTheDistribution) {
  BATCHLM_REQUIRE_GPU();
  const std::vector<float> row = {0.5f, 1.5f, 2.0f, -1.0f, 1.0f, 3.0f, 1.0f, -3.0f, 0.25f, 2.0f, -0.5f, 1.0f};
  kc::SampleParams p;
  p.temperature = 1.2f;
  p.top_k = 9;
  p.top_p = 0.97f;
  p.seed = 12345;
  p.counter = 0;
  constexpr int kDraws = 20000;
  const auto tokens = check_draws(row, p, kDraws, "chi-square case");
  const auto dist = cpu_distribution(row, p);
  ASSERT_GE(dist.tokens.size(), 3u);
  std::vector<int> counts(row.size(), 0);
  for (const std::int32_t t : tokens) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, static_cast<std::int32_t>(row.size()));
    ++counts[t];
  }
  double chi2 = 0.0;
  for (std::size_t t = 0; t < row.size(); ++t) {
    const double pt = dist.probability(static_cast<std::int32_t>(t));
    if (pt == 0.0) {
      EXPECT_EQ(counts[t], 0) << "token " << t << " is outside the kept set";
      continue;
    }
    const double expected = pt * kDraws;
    chi2 += (counts[t] - expected) * (counts[t] - expected) / expected;
  }
  const double df = static_cast<double>(dist.tokens.size() - 1), z = 4.753;  // upper 1e-6 tail
  const double critical = df * std::pow(1.0 - 2.0 / (9.0 * df) + z * std::sqrt(2.0 / (9.0 * df)), 3.0);
  EXPECT_LT(chi2, critical) << "df " << df;
}

// A row's token depends on its own (seed, counter) only: the same parameters in different rows
// and batches give the same token.
TEST(CudaSample, TokensDependOnSeedAndCounterOnly) {
  BATCHLM_REQUIRE_GPU();
  std::mt19937 rng(800);
  const std::int64_t n_vocab = 5000;
  const auto row = random_floats(n_vocab, rng, 2.0f);
  std::vector<float> logits;
  std::vector<kc::SampleParams> params;
  for (int i = 0; i < 64; ++i) {
    logits.insert(logits.end(), row.begin(), row.end());
    kc::SampleParams p;
    p.temperature = 1.0f;
    p.top_k = 100;
    p.seed = 42;
    p.counter = static_cast<std::uint64_t>(i % 8);
    params.push_back(p);
  }
  const auto a = gpu_sample(logits, n_vocab, params);
  std::reverse(params.begin(), params.end());
  const auto b = gpu_sample(logits, n_vocab, params);
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(a[i], a[i % 8]);
    EXPECT_EQ(b[63 - i], a[i]);
  }
}

}  // namespace
}  // namespace batchlm::gpu_test
