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

// Sixteen copies of v, loaded (GCC 12 warns of an uninitialized value inside _mm512_set1_ps and
// _mm512_reduce_add_ps).
__m512 splat(float v) {
  float lanes[16];
  for (float& lane : lanes) lane = v;
  return _mm512_loadu_ps(lanes);
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Runs `step` (one instruction: an accumulator and the two operands in, the accumulator out) on
// twelve independent accumulators in rounds of a million until `seconds` pass; instructions per
// ns. The accumulators are named variables, each starting elsewhere (GCC kept an array of them
// in memory, and merged chains that started alike into one), and the operands are hidden from
// the optimizer so that they stay in registers rather than being folded in as constants.
template <class V, class A, class Step>
double chains(double seconds, A a, A b, Step step) {
#define BATCHLM_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define BATCHLM_DECLARE(i) V c##i = V(splat(static_cast<float>(i)));
#define BATCHLM_STEP(i) c##i = step(c##i, a, b);
#define BATCHLM_KEEP(i) __asm__ volatile("" : : "v"(c##i));
  BATCHLM_CHAINS(BATCHLM_DECLARE)
  __asm__("" : "+v"(a), "+v"(b));
  constexpr long kRound = 1'000'000;
  long long done = 0;
  const auto start = Clock::now();
  do {
    for (long k = 0; k < kRound; ++k) {
      BATCHLM_CHAINS(BATCHLM_STEP)
    }
    done += kRound * kChains;
  } while (seconds_since(start) < seconds);
  const double elapsed = seconds_since(start);
  BATCHLM_CHAINS(BATCHLM_KEEP)  // the sums are used: the loop cannot be dropped
#undef BATCHLM_KEEP
#undef BATCHLM_STEP
#undef BATCHLM_DECLARE
#undef BATCHLM_CHAINS
  return static_cast<double>(done) / (elapsed * 1e9);
}

double fma_ps(double seconds) {
  return chains<__m512>(seconds, splat(1.0001f), splat(0.9999f),
                        [](__m512 c, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, c); });
}

double dp_bf16(double seconds) {
  return chains<__m512>(seconds, _mm512_cvtne2ps_pbh(splat(1.0001f), splat(0.9999f)),
                        _mm512_cvtne2ps_pbh(splat(0.5f), splat(0.25f)),
                        [](__m512 c, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(c, a, b); });
}

double fma_ph(double seconds) {
  // F16 values 1 and 1/1024 in every lane, written as bits.
  const __m512h one = _mm512_castsi512_ph(_mm512_set1_epi16(0x3c00));
  const __m512h small = _mm512_castsi512_ph(_mm512_set1_epi16(0x1400));
  return chains<__m512h>(seconds, one, small, [](__m512h c, __m512h a, __m512h b) { return _mm512_fmadd_ph(a, b, c); });
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
