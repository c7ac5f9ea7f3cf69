// matmul_cost: what the CPU matrix product of one quantized weight matrix costs for a batch
// of --tokens activation rows, the step a decode batch spends most of its matrix time in.
// Shape defaults are SmolLM2-135M's feed-forward gate (1536 x 576). --copies holds that many
// matrices and each rep runs them all in turn, so with enough copies the weights stream from
// memory as in a forward pass (30 layers, 7 matrices apiece); --copies 1 keeps them in cache.
// Prints the median (and least) time per product over --reps passes after --warmup passes and
// the multiply-accumulates per nanosecond across all threads.
//
//   matmul_cost --threads 2 --type q4_1 --rows 1536 --cols 576 --tokens 32 --copies 64
//   matmul_cost --threads 2 --type q4_k --rows 1536 --cols 1536 --tokens 32

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "batchlm/kernels/dtype.hpp"
#include "batchlm/kernels/ops.hpp"
#include "batchlm/kernels/thread_pool.hpp"

namespace {

namespace k = batchlm::kernels;

// One row of random blocks of `type` (dtype.hpp's block layouts): scales about 0.01 (the K
// types' 6- and 8-bit sub-block scales random), quants and fifth bits uniform.
std::vector<std::uint8_t> random_row_bytes(k::DType type, std::int64_t cols, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.005f, 0.02f);
  std::vector<std::uint8_t> out(k::row_bytes(type, cols));
  for (auto& b : out) b = static_cast<std::uint8_t>(byte(rng));
  const auto fill = [&](auto* blocks) {
    for (std::int64_t b = 0; b < cols / k::block_size(type); ++b) {
      auto& blk = blocks[b];
      blk.d = k::fp32_to_fp16(scale(rng));
      if constexpr (requires { blk.m; }) blk.m = k::fp32_to_fp16(-8.0f * scale(rng));
      if constexpr (requires { blk.dmin; }) blk.dmin = k::fp32_to_fp16(scale(rng));
    }
  };
  switch (type) {
    case k::DType::Q4_0: fill(reinterpret_cast<k::BlockQ4_0*>(out.data())); break;
    case k::DType::Q4_1: fill(reinterpret_cast<k::BlockQ4_1*>(out.data())); break;
    case k::DType::Q5_0: fill(reinterpret_cast<k::BlockQ5_0*>(out.data())); break;
    case k::DType::Q5_1: fill(reinterpret_cast<k::BlockQ5_1*>(out.data())); break;
    case k::DType::Q4_K: fill(reinterpret_cast<k::BlockQ4_K*>(out.data())); break;
    case k::DType::Q5_K: fill(reinterpret_cast<k::BlockQ5_K*>(out.data())); break;
    case k::DType::Q6_K: fill(reinterpret_cast<k::BlockQ6_K*>(out.data())); break;
    default: fill(reinterpret_cast<k::BlockQ8_0*>(out.data())); break;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, reps = 20, warmup = 3, copies = 64;
  std::int64_t rows = 1536, cols = 576, tokens = 32;
  std::string type_name = "q4_1";
  CLI::App app{"Times one quantized matrix product for a batch of tokens"};
  app.add_option("--threads", threads, "Kernel threads (the caller included)")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "Timed passes")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Untimed passes first")->check(CLI::NonNegativeNumber);
  app.add_option("--type", type_name, "Weight type")->check(CLI::IsMember({"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"}));
  app.add_option("--rows", rows, "Matrix rows (outputs)")->check(CLI::PositiveNumber);
  app.add_option("--cols", cols, "Matrix columns (a multiple of 32; of 256 for the K types)")->check(CLI::PositiveNumber);
  app.add_option("--tokens", tokens, "Activation rows")->check(CLI::PositiveNumber);
  app.add_option("--copies", copies, "Matrices run in turn (1: weights stay in cache)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const std::pair<const char*, k::DType> names[] = {
      {"q4_0", k::DType::Q4_0}, {"q4_1", k::DType::Q4_1}, {"q5_0", k::DType::Q5_0}, {"q5_1", k::DType::Q5_1},
      {"q8_0", k::DType::Q8_0}, {"q4_k", k::DType::Q4_K}, {"q5_k", k::DType::Q5_K}, {"q6_k", k::DType::Q6_K}};
  const k::DType type = std::find_if(std::begin(names), std::end(names), [&](const auto& n) { return type_name == n.first; })->second;
  const std::int64_t blocks = cols / k::block_size(type);
  if (cols % k::block_size(type) != 0) {
    std::fprintf(stderr, "matmul_cost: --cols must be a multiple of %lld for %s\n",
                 static_cast<long long>(k::block_size(type)), type_name.c_str());
    return 2;
  }

  std::mt19937 rng(11);
  // One random row, then each matrix's rows are it rotated by whole blocks: random enough for
  // the arithmetic, and quick to build.
  const std::vector<std::uint8_t> row = random_row_bytes(type, cols, rng);
  const std::size_t row_bytes = row.size();
  std::vector<std::vector<std::uint8_t>> data(static_cast<std::size_t>(copies));
  std::vector<k::PackedWeights> packed;
  std::vector<k::Matrix> matrices;
  for (int c = 0; c < copies; ++c) {
    auto& bytes = data[c];
    bytes.resize(row_bytes * static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r)
      std::rotate_copy(row.begin(), row.begin() + static_cast<std::ptrdiff_t>((r + c) % blocks * (row_bytes / blocks)),
                       row.end(), bytes.begin() + static_cast<std::ptrdiff_t>(r * row_bytes));
    k::Matrix m{type, bytes.data(), rows, cols, nullptr};
    packed.push_back(k::pack_weights(m));
    m.packed = packed.back().data();
    matrices.push_back(m);
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(tokens * cols));
  for (auto& v : x) v = normal(rng);
  std::vector<float> y(static_cast<std::size_t>(tokens * rows));
  std::vector<std::uint8_t> scratch(k::activation_bytes(matrices[0], tokens));

  k::ThreadPool pool(threads);
  std::vector<double> ms;
  for (int rep = 0; rep < warmup + reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const k::Matrix& m : matrices) k::matmul(m, x.data(), tokens, y.data(), scratch.data(), pool);
    const std::chrono::duration<double, std::milli> d = std::chrono::steady_clock::now() - t0;
    if (rep >= warmup) ms.push_back(d.count() / copies);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  double check = 0;
  for (float v : y) check += v;
  const double macs = static_cast<double>(rows) * static_cast<double>(cols) * static_cast<double>(tokens);
  std::printf("%s %lldx%lld tokens %lld copies %d threads %d: %.4f ms per product (min %.4f), %.1f MAC/ns, checksum %.4f\n",
              type_name.c_str(), static_cast<long long>(rows), static_cast<long long>(cols),
              static_cast<long long>(tokens), copies, threads, med, ms.front(), macs / (med * 1e6), check);
  return 0;
}
