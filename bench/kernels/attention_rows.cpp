// attention_rows: what each of the CPU attention's row kernels costs on its own, per (query,
// position) pair, with the rows in cache: the scores of --queries queries over --rows F16 keys
// in the pool's transposed blocks of 16 (score_runs), the softmax of the queries' rows of scores (softmax_f16, all in one call), and the
// probability-weighted sums of the value rows (mix_rows). The queries stand for one attention
// item: 48 for 16 tokens sharing a prefix (three query heads per KV head), 3 for one token's own
// rows, 1 for a query head decoding alone. One thread; the best of --reps timed calls. With
// --ghz (the core clock) it prints cycles per pair too.
//
//   attention_rows --queries 48 --rows 1536 --ghz 3.55
//   attention_rows --queries 3 --rows 1536 --path avx2

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "../../kernels/cpu/cpu_kernels.hpp"
#include "best_time.hpp"
#include "batchlm/kernels/dtype.hpp"

namespace {

namespace cpu = batchlm::kernels::cpu;

const cpu::Kernels* find_path(const std::string& name) {
  if (name == "portable") return &cpu::portable_kernels();
  if (name == "avx2") return cpu::avx2_kernels();
  if (name == "avx-vnni") return cpu::avx_vnni_kernels();
  if (name == "avx512") return cpu::avx512_kernels();
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  int queries = 48, reps = 30;
  std::int64_t rows = 1536;
  double ghz = 0.0;
  std::string path = "best";
  CLI::App app{"Times the CPU attention's row kernels (scores, softmax, weighted sums) on cached rows"};
  app.add_option("--queries", queries, "Queries sharing the rows")->check(CLI::Range(1, 256));
  app.add_option("--rows", rows, "Key and value rows")->check(CLI::Range(1, 1 << 20));
  app.add_option("--reps", reps, "Timed calls (the best one counts)")->check(CLI::PositiveNumber);
  app.add_option("--ghz", ghz, "Core clock, for cycles per pair")->check(CLI::NonNegativeNumber);
  app.add_option("--path", path, "Kernel path: best, portable, avx2, avx-vnni, avx512")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const cpu::Kernels* k = path == "best" ? cpu::avx512_kernels() : find_path(path);
  if (path == "best" && k == nullptr) k = cpu::avx_vnni_kernels();
  if (path == "best" && k == nullptr) k = cpu::avx2_kernels();
  if (path == "best" && k == nullptr) k = &cpu::portable_kernels();
  if (k == nullptr) {
    std::fprintf(stderr, "attention_rows: no %s path on this CPU or in this build\n", path.c_str());
    return 2;
  }

  // The rows sit in a pool laid out as the KV store is, blocks of 16 positions in order: the
  // values a position's three KV heads side by side, the keys transposed within the block;
  // this benchmark's head is the middle one.
  constexpr std::int64_t kDim = 64, kStride = 3 * kDim;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Free {
    void operator()(std::uint16_t* p) const { std::free(p); }
  };
  const auto pool_bytes = static_cast<std::size_t>((rows * kStride * 2 + 63) / 64 * 64);
  std::unique_ptr<std::uint16_t, Free> pool(static_cast<std::uint16_t*>(std::aligned_alloc(64, pool_bytes)));
  for (std::int64_t i = 0; i < rows * kStride; ++i) pool.get()[i] = batchlm::kernels::fp32_to_fp16(normal(rng));
  constexpr std::int64_t kBlock = 16;
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) offsets[static_cast<std::size_t>(r)] = r * kStride + kDim;
  std::vector<cpu::KeyRun> runs;
  for (std::int64_t r = 0; r < rows; r += kBlock)
    runs.push_back({r * kStride + kDim * kBlock, std::min(kBlock, rows - r)});
  std::vector<float> q(static_cast<std::size_t>(queries * kDim));
  for (float& x : q) x = normal(rng);
  k->round_f16(q.data(), queries * kDim);

  const auto n_pairs = static_cast<double>(queries) * static_cast<double>(rows);
  const auto best_ns = [&](auto&& call) { return batchlm::bench::best_call_ns(reps, call) / n_pairs; };
  std::vector<float> scores(static_cast<std::size_t>(queries * rows)), probs;
  const double t_score = best_ns([&] {
    k->score_runs(q.data(), queries, pool.get(), runs.data(), static_cast<std::int64_t>(runs.size()), 0, kDim, kBlock,
                  0.125f, scores.data(), rows);
  });
  // The softmax works in place: each timed call starts from a copy of the scores, whose cost
  // is timed apart and taken off.
  const double t_copy = best_ns([&] { probs = scores; });
  const double t_softmax = best_ns([&] {
    probs = scores;
    k->softmax_f16(probs.data(), rows, rows, queries);
  }) - t_copy;
  std::vector<float> out(static_cast<std::size_t>(queries * kDim));
  const double t_mix = best_ns([&] {
    std::fill(out.begin(), out.end(), 0.0f);
    k->mix_rows(probs.data(), queries, pool.get(), offsets.data(), rows, 0, kDim, out.data(), rows);
  });
  double checksum = 0.0;
  for (const float x : out) checksum += x;

  std::printf("%s, %d queries x %lld rows, 1 thread, ns per pair: scores %.3f, softmax %.3f, weighted sums %.3f",
              k->name, queries, static_cast<long long>(rows), t_score, t_softmax, t_mix);
  if (ghz > 0)
    std::printf(" (cycles: %.2f, %.2f, %.2f)", t_score * ghz, t_softmax * ghz, t_mix * ghz);
  std::printf(", checksum %.6f\n", checksum);
  return 0;
}
