// amx_probe: what the AMX BF16 tile product would give the CPU attention, before any kernel is
// built on it. Two questions:
//
//  1. Its arithmetic. Each F32 sum of TDPBF16PS is documented as a run of fused multiply-adds
//     (products of BF16 values are exact in F32). If the hardware really adds the products one
//     by one in index order, a split of F16 values into BF16 high and low parts gives a fixed,
//     chunking-independent rounding sequence that a portable loop can reproduce bit for bit.
//     The probe multiplies random tiles (magnitudes spread over 2^-12..2^12, so most sums round)
//     and counts the results that equal (a) one fused multiply-add per product in index order,
//     (b) each pair's two products added exactly and rounded once before the add, (c) the exact
//     sum rounded once; and how far the results and the chain (a) stray from the exact sums.
//  2. Its speed on attention's shapes: --queries queries (16 per tile, zero-padded) scored
//     against --rows F16 keys in the KV pool's transposed blocks of 16, each F16 value split
//     into BF16 high + low parts (all four cross products, so every product is exact), timed
//     against the project's score_runs on the same rows: key tiles made run by run as the
//     scores are taken, made beforehand (as a pool that kept them split would have them), and
//     query tile by query tile (4 A tiles loaded once, sums stored straight into the rows of
//     scores); and the tile products alone (one run's key tiles over and over, in cache).
//     Then the weighted sums of the same queries' probabilities (their softmax, F16-rounded)
//     over the value rows, against mix_rows: each position's four cross products one after
//     another, so the sums take their terms position by position whatever the chunking; the
//     value tiles (made once for all queries) timed apart.
//
//   amx_probe --queries 48 --rows 1536 --ghz 3.7   (the weighted sums: queries a multiple of 16)
//
// Built only where the compiler has the AMX intrinsics; on a CPU without AMX-BF16 (or a kernel
// that does not grant the tile state) it says so and exits 2.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>

#include "../../kernels/cpu/cpu_kernels.hpp"
#include "best_time.hpp"
#include "batchlm/kernels/dtype.hpp"

namespace {

namespace cpu = batchlm::kernels::cpu;

bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
  if (!tile || !bf16) return false;
  constexpr long kReqPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
}

struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// x = hi + lo exactly (x an F16 value widened, 11 significant bits): hi its upper 16 bits, lo
// the rest, whose few significant bits also sit in its upper 16; both as F32 bit patterns.
struct Split {
  __m512i hi, lo;
};
inline Split split_bf16(__m512 x) {
  const __m512i hi = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return {hi, _mm512_castps_si512(_mm512_sub_ps(x, _mm512_castsi512_ps(hi)))};
}
inline __m512i upper_to_lower(__m512i x) { return _mm512_maskz_srli_epi32(0xffff, x, 16); }

std::uint16_t bf16_bits(float x) { return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(x) >> 16); }
float bf16_value(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

// Question 1.
void probe_arithmetic(std::mt19937& rng) {
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-12, 12), sign(0, 1);
  const auto random_bf16 = [&] {
    const float x = std::ldexp(unit(rng), expo(rng)) * (sign(rng) != 0 ? -1.0f : 1.0f);
    return bf16_bits(x);  // truncated to BF16
  };
  alignas(64) std::uint16_t a[16][32], b[16][32];
  alignas(64) float c[16][16];
  long fma_order = 0, pair_once = 0, once = 0, total = 0;
  double worst_ulps = 0.0, worst_fma_ulps = 0.0;
  for (int trial = 0; trial < 200; ++trial) {
    for (auto& row : a)
      for (auto& x : row) x = random_bf16();
    for (auto& row : b)
      for (auto& x : row) x = random_bf16();
    std::memset(c, 0, sizeof c);
    _tile_loadd(0, c, 64);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float seq = 0.0f, pairs = 0.0f;
        long double all = 0.0L;
        for (int k = 0; k < 16; ++k) {
          const float a0 = bf16_value(a[m][2 * k]), a1 = bf16_value(a[m][2 * k + 1]);
          const float b0 = bf16_value(b[k][2 * n]), b1 = bf16_value(b[k][2 * n + 1]);
          seq = std::fma(a0, b0, seq);
          seq = std::fma(a1, b1, seq);
          pairs = static_cast<float>(static_cast<double>(pairs) +
                                     (static_cast<double>(a0) * b0 + static_cast<double>(a1) * b1));
          all += static_cast<long double>(a0) * b0 + static_cast<long double>(a1) * b1;
        }
        fma_order += std::bit_cast<std::uint32_t>(seq) == std::bit_cast<std::uint32_t>(c[m][n]);
        pair_once += std::bit_cast<std::uint32_t>(pairs) == std::bit_cast<std::uint32_t>(c[m][n]);
        once += std::bit_cast<std::uint32_t>(static_cast<float>(all)) == std::bit_cast<std::uint32_t>(c[m][n]);
        const float rounded = static_cast<float>(all);
        const float ulp = std::nextafter(std::fabs(rounded), INFINITY) - std::fabs(rounded);
        worst_ulps = std::max(worst_ulps, static_cast<double>(std::fabs(static_cast<long double>(c[m][n]) - all) / ulp));
        worst_fma_ulps = std::max(worst_fma_ulps, static_cast<double>(std::fabs(static_cast<long double>(seq) - all) / ulp));
        ++total;
      }
  }
  std::printf("TDPBF16PS sums equal to: one fused multiply-add per product in order %ld/%ld, "
              "each pair added exactly then rounded %ld/%ld, the exact sum rounded once %ld/%ld; "
              "worst distance from the exact sum %.2f units in the last place (the chain of fused "
              "multiply-adds: %.2f)\n",
              fma_order, total, pair_once, total, once, total, worst_ulps, worst_fma_ulps);
}

// Question 2. The B tiles of one run of 16 keys (dims block_size = 16 apart): for the high and
// the low parts, dims 0-31 and 32-63, row p holds dims (2p, 2p + 1) of every key side by side.
void key_tiles(const std::uint16_t* base, std::uint32_t* out /* [4][16][16] */) {
  for (int p = 0; p < 32; ++p) {
    const Split e = split_bf16(_mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 2 * p * 16))));
    const Split o = split_bf16(_mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (2 * p + 1) * 16))));
    const __m512i hi = _mm512_or_si512(o.hi, upper_to_lower(e.hi));
    const __m512i lo = _mm512_or_si512(o.lo, upper_to_lower(e.lo));
    const int half = p / 16, row = p % 16;
    _mm512_storeu_si512(out + ((0 + half) * 16 + row) * 16, hi);
    _mm512_storeu_si512(out + ((2 + half) * 16 + row) * 16, lo);
  }
}

// The A tiles of 16 queries (rows past n zero): high dims 0-31, high 32-63, low 0-31, low 32-63.
void query_tiles(const float* q, int n, std::uint16_t* out /* [4][16][32] */) {
  std::memset(out, 0, 4 * 16 * 32 * sizeof(std::uint16_t));
  for (int m = 0; m < n; ++m)
    for (int d = 0; d < 64; ++d) {
      const float x = q[m * 64 + d];
      const std::uint16_t hi = bf16_bits(x);
      const std::uint16_t lo = bf16_bits(x - bf16_value(hi));
      out[((d / 32) * 16 + m) * 32 + d % 32] = hi;
      out[((2 + d / 32) * 16 + m) * 32 + d % 32] = lo;
    }
}

// Tiles 0-3: a query tile's A tiles (query_tiles' layout).
inline void load_query_tiles(const std::uint16_t* a) {
  _tile_loadd(0, a, 64);
  _tile_loadd(1, a + 16 * 32, 64);
  _tile_loadd(2, a + 2 * 16 * 32, 64);
  _tile_loadd(3, a + 3 * 16 * 32, 64);
}

// Tile 4 += one run's products with the query tile in tiles 0-3 (high dims 0-31, high 32-63,
// low 0-31, low 32-63), from the run's key tiles (key_tiles): qh.kh, ql.kh, qh.kl, ql.kl, each
// over both halves of the dimensions.
inline void run_products(const std::uint32_t* kr) {
  _tile_loadd(5, kr, 64);
  _tile_loadd(6, kr + 16 * 16, 64);
  _tile_dpbf16ps(4, 0, 5);
  _tile_dpbf16ps(4, 1, 6);
  _tile_dpbf16ps(4, 2, 5);
  _tile_dpbf16ps(4, 3, 6);
  _tile_loadd(7, kr + 2 * 16 * 16, 64);
  _tile_loadd(5, kr + 3 * 16 * 16, 64);
  _tile_dpbf16ps(4, 0, 7);
  _tile_dpbf16ps(4, 1, 5);
  _tile_dpbf16ps(4, 2, 7);
  _tile_dpbf16ps(4, 3, 5);
}

// Scores of n_q queries over n_runs full runs: per query tile, per run, the 8 tile products
// qh.kh, ql.kh, qh.kl, ql.kl over both halves of the dimensions; the run's key tiles are made
// once per run and used by every query tile.
void amx_scores(const float* q, int n_q, const std::uint16_t* pool, const cpu::KeyRun* runs, std::int64_t n_runs,
                float scale, float* scores, std::int64_t ld, const std::uint32_t* converted = nullptr) {
  const int groups = (n_q + 15) / 16;
  std::vector<std::uint16_t> qt(static_cast<std::size_t>(groups) * 4 * 16 * 32);
  for (int g = 0; g < groups; ++g) query_tiles(q + g * 16 * 64, std::min(16, n_q - g * 16), qt.data() + g * 4 * 16 * 32);
  alignas(64) std::uint32_t kt[4 * 16 * 16];
  alignas(64) float c[16 * 16];
  for (std::int64_t r = 0; r < n_runs; ++r) {
    const std::uint32_t* kr = kt;
    if (converted != nullptr) {
      kr = converted + r * 4 * 16 * 16;
    } else {
      key_tiles(pool + runs[r].at, kt);
    }
    for (int g = 0; g < groups; ++g) {
      _tile_zero(4);
      load_query_tiles(qt.data() + g * 4 * 16 * 32);
      run_products(kr);
      _tile_stored(4, c, 64);
      const int rows = std::min(16, n_q - g * 16);
      const __m512 vs = _mm512_set1_ps(scale);
      for (int m = 0; m < rows; ++m)
        _mm512_storeu_ps(scores + (g * 16 + m) * ld + r * 16, _mm512_mul_ps(_mm512_load_ps(c + m * 16), vs));
    }
  }
}

// The same products in the other order: per query tile (its 4 A tiles loaded once), every run,
// the sums stored straight into the rows of scores; then one pass scales them. Keys from tiles
// made beforehand; n_q a multiple of 16.
void amx_scores_by_query_tile(const float* q, int n_q, std::int64_t n_runs, const std::uint32_t* converted,
                              float scale, float* scores, std::int64_t ld) {
  std::vector<std::uint16_t> qt(4 * 16 * 32);
  for (int g = 0; g < n_q / 16; ++g) {
    query_tiles(q + g * 16 * 64, 16, qt.data());
    load_query_tiles(qt.data());
    for (std::int64_t r = 0; r < n_runs; ++r) {
      const std::uint32_t* kr = converted + r * 4 * 16 * 16;
      _tile_zero(4);
      run_products(kr);
      _tile_stored(4, scores + g * 16 * ld + r * 16, ld * 4);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int m = 0; m < n_q; ++m)
    for (std::int64_t j = 0; j < n_runs * 16; j += 16)
      _mm512_storeu_ps(scores + m * ld + j, _mm512_mul_ps(_mm512_loadu_ps(scores + m * ld + j), vs));
}

// Weighted sums. A position's four cross products go one after another (ph.vh, pl.vh, ph.vl,
// pl.vl), so every sum takes its terms position by position whatever the chunking. The value
// tiles of rows [0, n_rows) (n_rows a multiple of 8): per chunk of 8 positions and per 16
// dimensions, row 2j holds position j's high parts, each twice in its dword, row 2j + 1 its low
// parts.
void value_tiles(const std::uint16_t* pool, const std::int64_t* rows, std::int64_t n_rows,
                 std::uint32_t* out /* [n_rows / 8][4][16][16] */) {
  for (std::int64_t r = 0; r < n_rows; ++r) {
    const std::uint16_t* v = pool + rows[r];
    std::uint32_t* chunk = out + (r / 8) * 4 * 16 * 16;
    const std::int64_t j = r % 8;
    for (int c = 0; c < 4; ++c) {
      const Split x = split_bf16(_mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c))));
      _mm512_storeu_si512(chunk + (c * 16 + 2 * j) * 16, _mm512_or_si512(x.hi, upper_to_lower(x.hi)));
      _mm512_storeu_si512(chunk + (c * 16 + 2 * j + 1) * 16, _mm512_or_si512(x.lo, upper_to_lower(x.lo)));
    }
  }
}

// out[q] += the weighted sums of n_q queries (a multiple of 16) over the rows whose value tiles
// are vt: per query tile its 4 accumulator tiles (64 dimensions) stay in tiles 0-3 across the
// rows; per chunk of 8 positions the probability tile (each position's high and low parts as
// one dword, twice) is made in a buffer that stays in L1 and multiplied into all four. (Making
// all of a query tile's probability tiles first, then the products, was slower: 0.95-0.99 ns
// per pair against 0.57.)
void amx_mix(const float* probs, int n_q, std::int64_t ld, const std::uint32_t* vt, std::int64_t n_rows,
             float* out) {
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  alignas(64) std::uint32_t at[16 * 16];
  for (int g = 0; g < n_q / 16; ++g) {
    float* o = out + g * 16 * 64;
    _tile_loadd(0, o, 256);
    _tile_loadd(1, o + 16, 256);
    _tile_loadd(2, o + 32, 256);
    _tile_loadd(3, o + 48, 256);
    for (std::int64_t r0 = 0; r0 < n_rows; r0 += 8) {
      for (int m = 0; m < 16; ++m) {
        const Split p = split_bf16(_mm512_maskz_loadu_ps(0x00ff, probs + (g * 16 + m) * ld + r0));
        const __m512i pair = _mm512_or_si512(p.lo, upper_to_lower(p.hi));
        _mm512_store_si512(at + m * 16, _mm512_maskz_permutexvar_epi32(0xffff, twice, pair));
      }
      const std::uint32_t* chunk = vt + (r0 / 8) * 4 * 16 * 16;
      _tile_loadd(4, at, 64);
      _tile_loadd(5, chunk, 64);
      _tile_loadd(6, chunk + 256, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, chunk + 512, 64);
      _tile_loadd(5, chunk + 768, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, o, 256);
    _tile_stored(1, o + 16, 256);
    _tile_stored(2, o + 32, 256);
    _tile_stored(3, o + 48, 256);
  }
}

// How two paths' results compare with the exact ones: each one's worst error relative to the
// sum of the terms' magnitudes, and how many results the two give as the same bits.
struct Agreement {
  double worst_ref = 0.0, worst_amx = 0.0;
  long same = 0;
  void add(float ref, float amx, long double exact, long double magnitude) {
    worst_ref = std::max(worst_ref, static_cast<double>(std::fabs(ref - exact) / magnitude));
    worst_amx = std::max(worst_amx, static_cast<double>(std::fabs(amx - exact) / magnitude));
    same += std::bit_cast<std::uint32_t>(ref) == std::bit_cast<std::uint32_t>(amx);
  }
};

}  // namespace

int main(int argc, char** argv) {
  int queries = 48, reps = 30;
  std::int64_t rows = 1536;
  double ghz = 0.0;
  CLI::App app{"Probes the AMX BF16 tile product for the CPU attention: its arithmetic and its speed"};
  app.add_option("--queries", queries, "Queries sharing the rows")->check(CLI::Range(1, 256));
  app.add_option("--rows", rows, "Key rows (a multiple of 16)")->check(CLI::Range(16, 1 << 20));
  app.add_option("--reps", reps, "Timed calls (the best one counts)")->check(CLI::PositiveNumber);
  app.add_option("--ghz", ghz, "Core clock, for cycles per pair")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (rows % 16 != 0) {
    std::fprintf(stderr, "amx_probe: --rows must be a multiple of 16\n");
    return 2;
  }
  if (!cpu_has_amx_bf16()) {
    std::fprintf(stderr, "amx_probe: this CPU (or its kernel) offers no AMX-BF16 tiles\n");
    return 2;
  }
  const cpu::Kernels* k = cpu::avx512_kernels();
  if (k == nullptr) {
    std::fprintf(stderr, "amx_probe: no AVX-512 kernels to compare with\n");
    return 2;
  }
  configure_tiles();
  std::mt19937 rng(7);
  probe_arithmetic(rng);

  // The pool as attention_rows lays it out: blocks of 16 positions, three KV heads, the keys
  // transposed within the block; the middle head is scored.
  constexpr std::int64_t kDim = 64, kStride = 3 * kDim, kBlock = 16;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> pool(static_cast<std::size_t>(rows * kStride + 32));
  for (auto& x : pool) x = batchlm::kernels::fp32_to_fp16(normal(rng));
  std::vector<cpu::KeyRun> runs;
  for (std::int64_t r = 0; r < rows; r += kBlock) runs.push_back({r * kStride + kDim * kBlock, kBlock});
  std::vector<float> q(static_cast<std::size_t>(queries * kDim));
  for (float& x : q) x = normal(rng);
  k->round_f16(q.data(), queries * kDim);

  const auto n_pairs = static_cast<double>(queries) * static_cast<double>(rows);
  const auto best_ns = [&](auto&& call) { return batchlm::bench::best_call_ns(reps, call) / n_pairs; };
  std::vector<float> ref(static_cast<std::size_t>(queries * rows)), amx(ref.size());
  const double t_ref = best_ns([&] {
    k->score_runs(q.data(), queries, pool.data(), runs.data(), static_cast<std::int64_t>(runs.size()), 0, kDim,
                  kBlock, 0.125f, ref.data(), rows);
  });
  const double t_amx = best_ns([&] {
    amx_scores(q.data(), queries, pool.data(), runs.data(), static_cast<std::int64_t>(runs.size()), 0.125f,
               amx.data(), rows);
  });
  // With every key's tiles made beforehand (as a pool that kept them would have them).
  std::vector<std::uint32_t> converted(runs.size() * 4 * 16 * 16);
  for (std::size_t r = 0; r < runs.size(); ++r) key_tiles(pool.data() + runs[r].at, converted.data() + r * 4 * 16 * 16);
  std::vector<float> amx_pre(ref.size());
  const double t_pre = best_ns([&] {
    amx_scores(q.data(), queries, pool.data(), runs.data(), static_cast<std::int64_t>(runs.size()), 0.125f,
               amx_pre.data(), rows, converted.data());
  });
  if (amx_pre != amx) {
    std::fprintf(stderr, "amx_probe: the scores from tiles made beforehand differ\n");
    return 1;
  }
  double t_by_query = 0.0;
  if (queries % 16 == 0) {
    std::fill(amx_pre.begin(), amx_pre.end(), std::nanf(""));
    t_by_query = best_ns([&] {
      amx_scores_by_query_tile(q.data(), queries, static_cast<std::int64_t>(runs.size()), converted.data(), 0.125f,
                               amx_pre.data(), rows);
    });
    if (amx_pre != amx) {
      std::fprintf(stderr, "amx_probe: the scores by query tile differ\n");
      return 1;
    }
  }
  // The tile products alone: the same calls with the key tiles of the first run throughout.
  alignas(64) std::uint32_t kt[4 * 16 * 16];
  key_tiles(pool.data() + runs[0].at, kt);
  const double t_products = best_ns([&] {
    for (std::int64_t r = 0; r < rows / 16; ++r)
      for (int g = 0; g < (queries + 15) / 16; ++g) {
        run_products(kt);
      }
  });
  // Against the exact scores (long double sums of the same F16 values): both paths' worst
  // error in units of the score's magnitude, and how many scores the two paths give alike.
  Agreement scores_agree;
  for (int m = 0; m < queries; ++m)
    for (std::int64_t j = 0; j < rows; ++j) {
      const std::int64_t blk = j / kBlock, slot = j % kBlock;
      long double exact = 0.0L, mag = 0.0L;
      for (std::int64_t d = 0; d < kDim; ++d) {
        const float kv = batchlm::kernels::fp16_to_fp32(pool[static_cast<std::size_t>(runs[blk].at + d * kBlock + slot)]);
        exact += static_cast<long double>(q[m * kDim + d]) * kv;
        mag += std::fabs(static_cast<long double>(q[m * kDim + d]) * kv);
      }
      exact *= 0.125L;
      mag *= 0.125L;
      const std::size_t i = static_cast<std::size_t>(m * rows + j);
      scores_agree.add(ref[i], amx[i], exact, mag);
    }
  std::printf("%d queries x %lld keys, 1 thread, ns per pair: score_runs (%s) %.3f, AMX BF16 split %.3f "
              "(key tiles made beforehand %.3f, and query tile by query tile %.3f; tile products alone %.3f)",
              queries, static_cast<long long>(rows), k->name, t_ref, t_amx, t_pre, t_by_query, t_products);
  if (ghz > 0)
    std::printf("; cycles %.2f, %.2f (%.2f, %.2f; %.2f)", t_ref * ghz, t_amx * ghz, t_pre * ghz, t_by_query * ghz,
                t_products * ghz);
  std::printf("\nworst error / sum of |products|: score_runs %.3g, AMX %.3g; scores alike %ld of %.0f\n",
              scores_agree.worst_ref, scores_agree.worst_amx, scores_agree.same, n_pairs);
  // The weighted sums, where the queries fill whole tiles (rows are a multiple of 16 already):
  // the probabilities are each query's softmax of the scores above (F16-rounded, as
  // softmax_f16 leaves them).
  if (queries % 16 == 0) {
    std::vector<float> probs = ref;
    k->softmax_f16(probs.data(), rows, rows, queries);
    std::vector<std::int64_t> offsets(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) offsets[static_cast<std::size_t>(r)] = r * kStride + kDim;
    std::vector<float> mix_ref(static_cast<std::size_t>(queries * kDim)), mix_amx(mix_ref.size());
    const double t_mix_ref = best_ns([&] {
      std::fill(mix_ref.begin(), mix_ref.end(), 0.0f);
      k->mix_rows(probs.data(), queries, pool.data(), offsets.data(), rows, 0, kDim, mix_ref.data(), rows);
    });
    std::vector<std::uint32_t> vt(static_cast<std::size_t>(rows / 8) * 4 * 16 * 16);
    const double t_value_tiles = best_ns([&] { value_tiles(pool.data(), offsets.data(), rows, vt.data()); });
    const double t_mix_amx = best_ns([&] {
      std::fill(mix_amx.begin(), mix_amx.end(), 0.0f);
      amx_mix(probs.data(), queries, rows, vt.data(), rows, mix_amx.data());
    });
    Agreement sums_agree;
    for (int m = 0; m < queries; ++m)
      for (std::int64_t d = 0; d < kDim; ++d) {
        long double exact = 0.0L, mag = 0.0L;
        for (std::int64_t r = 0; r < rows; ++r) {
          const long double term = static_cast<long double>(probs[static_cast<std::size_t>(m * rows + r)]) *
                                   batchlm::kernels::fp16_to_fp32(pool[static_cast<std::size_t>(offsets[r] + d)]);
          exact += term;
          mag += std::fabs(term);
        }
        const std::size_t i = static_cast<std::size_t>(m * kDim + d);
        sums_agree.add(mix_ref[i], mix_amx[i], exact, mag);
      }
    std::printf("weighted sums, ns per pair: mix_rows %.3f, AMX BF16 split %.3f (+ value tiles %.3f)", t_mix_ref,
                t_mix_amx, t_value_tiles);
    if (ghz > 0) std::printf("; cycles %.2f, %.2f (+ %.2f)", t_mix_ref * ghz, t_mix_amx * ghz, t_value_tiles * ghz);
    std::printf("\nworst error / sum of |terms|: mix_rows %.3g, AMX %.3g; sums alike %ld of %d\n",
                sums_agree.worst_ref, sums_agree.worst_amx, sums_agree.same, queries * static_cast<int>(kDim));
  }
  _tile_release();
  return 0;
}
