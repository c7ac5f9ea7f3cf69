// fma_probe: how many products a second one core's vector units give attention in each number
// format the CPU offers, from the throughput of the one instruction each format's dot products
// would be built on (`--chains` independent accumulators, so latency does not bound it):
//
//   vfmadd231ps  16 F32 products, F32 sums (what the engine's attention kernels use)
//   vdpbf16ps    32 BF16 products, F32 sums (AVX512-BF16)
//   vfmadd231ph  32 F16 products, F16 sums (AVX512-FP16)
//
//   fma_probe --seconds 0.5
//
// Prints instructions and products per nanosecond for each the CPU has. Built only where the
// compiler takes the AVX-512 BF16 and FP16 flags, for x86-64 CPUs with AVX-512 (the whole file
// is compiled for it); a format the CPU lacks is reported as such.

#include <immintrin.h>

#include <chrono>
#include <cstdio>

#include <CLI/CLI.hpp>

namespace {

constexpr int kChains = 12;

bool cpu_has(int leaf, int subleaf, char reg, int bit) {
  unsigned r[4] = {};
  __asm__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(subleaf));
  return (r[reg - 'a'] >> bit) & 1;
}

using Clock = std::chrono::steady_clock;

// Keeps the sums from being optimized away (stored, not reduced: GCC 12 warns of an
// uninitialized value inside _mm512_reduce_add_ps).
void keep(__m512 v) {
  float lanes[16];
  _mm512_storeu_ps(lanes, v);
  volatile float sink = lanes[0];
  (void)sink;
}

// Sixteen copies of v, loaded (as for _mm512_reduce_add_ps, GCC 12 may warn inside _mm512_set1_ps).
__m512 splat(float v) {
  float lanes[16];
  for (float& lane : lanes) lane = v;
  return _mm512_loadu_ps(lanes);
}

// Each runs its instruction on twelve independent accumulators (named variables: GCC kept an
// array of them in memory, and merged chains that started alike), in rounds of kRound until `seconds` pass, and returns instructions
// per ns.
constexpr long kRound = 1'000'000;
#define BATCHLM_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

double per_ns(long long instructions, Clock::time_point start) {
  return static_cast<double>(instructions) / (std::chrono::duration<double>(Clock::now() - start).count() * 1e9);
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double fma_ps(double seconds) {
// Each chain starts elsewhere: chains alike would be merged into one by the compiler.
#define BATCHLM_DECLARE(i) __m512 c##i = splat(static_cast<float>(i));
#define BATCHLM_STEP(i) c##i = _mm512_fmadd_ps(a, b, c##i);
#define BATCHLM_SUM(i) total = _mm512_add_ps(total, c##i);
  BATCHLM_CHAINS(BATCHLM_DECLARE)
  __m512 a = splat(1.0001f), b = splat(0.9999f);
  __asm__("" : "+v"(a), "+v"(b));  // in registers, not folded into the instructions as constants
  long long done = 0;
  const auto start = Clock::now();
  do {
    for (long k = 0; k < kRound; ++k) {
      BATCHLM_CHAINS(BATCHLM_STEP)
    }
    done += kRound * kChains;
  } while (seconds_since(start) < seconds);
  const double r = per_ns(done, start);
  __m512 total = _mm512_setzero_ps();
  BATCHLM_CHAINS(BATCHLM_SUM)
  keep(total);
  return r;
#undef BATCHLM_STEP
}

double dp_bf16(double seconds) {
#define BATCHLM_STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
  BATCHLM_CHAINS(BATCHLM_DECLARE)
  __m512bh a = _mm512_cvtne2ps_pbh(splat(1.0001f), splat(0.9999f));
  __m512bh b = _mm512_cvtne2ps_pbh(splat(0.5f), splat(0.25f));
  __asm__("" : "+v"(a), "+v"(b));
  long long done = 0;
  const auto start = Clock::now();
  do {
    for (long k = 0; k < kRound; ++k) {
      BATCHLM_CHAINS(BATCHLM_STEP)
    }
    done += kRound * kChains;
  } while (seconds_since(start) < seconds);
  const double r = per_ns(done, start);
  __m512 total = _mm512_setzero_ps();
  BATCHLM_CHAINS(BATCHLM_SUM)
  keep(total);
  return r;
#undef BATCHLM_STEP
#undef BATCHLM_DECLARE
#undef BATCHLM_SUM
}

double fma_ph(double seconds) {
#define BATCHLM_DECLARE(i) __m512h c##i = _mm512_castps_ph(splat(static_cast<float>(i)));
#define BATCHLM_STEP(i) c##i = _mm512_fmadd_ph(a, b, c##i);
#define BATCHLM_SUM(i) total = _mm512_add_ph(total, c##i);
  BATCHLM_CHAINS(BATCHLM_DECLARE)
  _Float16 ones[32], small[32];
  for (int i = 0; i < 32; ++i) {
    ones[i] = static_cast<_Float16>(1.0f);
    small[i] = static_cast<_Float16>(0.001f);
  }
  __m512h a = _mm512_loadu_ph(ones), b = _mm512_loadu_ph(small);
  __asm__("" : "+v"(a), "+v"(b));
  long long done = 0;
  const auto start = Clock::now();
  do {
    for (long k = 0; k < kRound; ++k) {
      BATCHLM_CHAINS(BATCHLM_STEP)
    }
    done += kRound * kChains;
  } while (seconds_since(start) < seconds);
  const double r = per_ns(done, start);
  __m512h total = _mm512_setzero_ph();
  BATCHLM_CHAINS(BATCHLM_SUM)
  _Float16 lanes[32];
  _mm512_storeu_ph(lanes, total);
  volatile float sink = static_cast<float>(lanes[0]);
  (void)sink;
  return r;
#undef BATCHLM_STEP
#undef BATCHLM_DECLARE
#undef BATCHLM_SUM
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Products per ns one core gives in F32, BF16 and F16 vector arithmetic"};
  double seconds = 0.5;
  app.add_option("--seconds", seconds, "Time per instruction")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const bool avx512f = cpu_has(7, 0, 'b', 16);
  const bool bf16 = cpu_has(7, 1, 'a', 5);
  const bool fp16 = cpu_has(7, 0, 'd', 23);
  if (!avx512f) {
    std::fprintf(stderr, "fma_probe: this CPU has no AVX-512\n");
    return 2;
  }
  std::printf("%-12s %-26s %14s %14s\n", "instruction", "arithmetic", "instr/ns", "products/ns");
  const double ps = fma_ps(seconds);
  std::printf("%-12s %-26s %14.2f %14.1f\n", "vfmadd231ps", "16 F32 products, F32 sums", ps, ps * 16);
  if (bf16) {
    const double r = dp_bf16(seconds);
    std::printf("%-12s %-26s %14.2f %14.1f\n", "vdpbf16ps", "32 BF16 products, F32 sums", r, r * 32);
  } else {
    std::printf("%-12s %-26s %14s %14s\n", "vdpbf16ps", "(no AVX512-BF16)", "-", "-");
  }
  if (fp16) {
    const double r = fma_ph(seconds);
    std::printf("%-12s %-26s %14.2f %14.1f\n", "vfmadd231ph", "32 F16 products, F16 sums", r, r * 32);
  } else {
    std::printf("%-12s %-26s %14s %14s\n", "vfmadd231ph", "(no AVX512-FP16)", "-", "-");
  }
  return 0;
}
