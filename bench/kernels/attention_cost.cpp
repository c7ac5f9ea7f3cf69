// attention_cost: what the CPU paged-attention kernel costs for one layer of a decode step in
// which --sequences sequences share a --prefix of cached positions (a few-shot prompt through
// the prefix cache) and each has --tail positions of its own, one query token apiece. Shape
// defaults are SmolLM2-135M's (9 query heads, 3 KV heads, 64 dimensions, 30 layers). Each rep
// runs every layer in turn over its own cache, as a forward pass does, so a layer's rows have
// left the caches by the time it comes round again. Prints the median (and least) time per
// layer over --reps passes after --warmup passes, and the time per (query head, position) pair.
//
//   attention_cost --threads 2 --sequences 32 --prefix 1536 --tail 200

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include <CLI/CLI.hpp>

#include "batchlm/kernels/dtype.hpp"
#include "batchlm/kernels/ops.hpp"
#include "batchlm/kernels/thread_pool.hpp"

int main(int argc, char** argv) {
  int threads = 2, reps = 10, warmup = 2, layers = 30;
  std::int64_t sequences = 32, prefix = 1536, tail = 200, n_heads = 9, n_kv_heads = 3, dim = 64;
  CLI::App app{"Times one layer of paged attention for a batch of decoding sequences"};
  app.add_option("--threads", threads, "Kernel threads (the caller included)")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "Timed calls")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Untimed calls first")->check(CLI::NonNegativeNumber);
  app.add_option("--sequences", sequences, "Sequences, one query token each")->check(CLI::PositiveNumber);
  app.add_option("--prefix", prefix, "Positions every sequence shares (a multiple of 16)")->check(CLI::NonNegativeNumber);
  app.add_option("--tail", tail, "Positions of each sequence's own")->check(CLI::NonNegativeNumber);
  app.add_option("--layers", layers, "Layers, each with its own cache")->check(CLI::PositiveNumber);
  app.add_option("--heads", n_heads, "Query heads")->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", n_kv_heads, "KV heads")->check(CLI::PositiveNumber);
  app.add_option("--dim", dim, "Head dimension")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (prefix % 16 != 0 || n_heads % n_kv_heads != 0) {
    std::fprintf(stderr, "attention_cost: --prefix must be a multiple of 16 and --heads of --kv-heads\n");
    return 2;
  }

  constexpr std::int64_t kBlock = 16;
  const std::int64_t n_ctx = prefix + tail + 1;  // the query's own position included
  const std::int64_t own_blocks = (n_ctx - prefix + kBlock - 1) / kBlock;
  const std::int64_t n_blocks = prefix / kBlock + sequences * own_blocks;
  const std::int64_t stride = n_kv_heads * dim;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Values from a table of F16 normals: drawing each one would take longer than the timing.
  std::vector<std::uint16_t> table(4096);
  for (auto& x : table) x = batchlm::kernels::fp32_to_fp16(normal(rng));
  const std::size_t layer_size = static_cast<std::size_t>(n_blocks * kBlock * stride);
  // 64-byte aligned, as the engine's KV store is: each 64-value row is two cache lines.
  struct Free {
    void operator()(std::uint16_t* p) const { std::free(p); }
  };
  const std::size_t total = layer_size * static_cast<std::size_t>(layers);
  const std::size_t bytes = (total * sizeof(std::uint16_t) + 63) & ~std::size_t{63};
  const std::unique_ptr<std::uint16_t[], Free> k_mem(static_cast<std::uint16_t*>(std::aligned_alloc(64, bytes)));
  const std::unique_ptr<std::uint16_t[], Free> v_mem(static_cast<std::uint16_t*>(std::aligned_alloc(64, bytes)));
  const std::span<std::uint16_t> k(k_mem.get(), total), v(v_mem.get(), total);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = table[(i * 2654435761u) % table.size()];
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = table[(i * 40503u + 17) % table.size()];
  // The shared blocks first, then each sequence's own, interleaved as a busy pool leaves them.
  std::vector<std::vector<std::int32_t>> tables(static_cast<std::size_t>(sequences));
  for (std::int64_t s = 0; s < sequences; ++s) {
    for (std::int64_t b = 0; b < prefix / kBlock; ++b) tables[s].push_back(static_cast<std::int32_t>(b));
    for (std::int64_t b = 0; b < own_blocks; ++b)
      tables[s].push_back(static_cast<std::int32_t>(prefix / kBlock + b * sequences + s));
  }
  std::vector<std::span<const std::int32_t>> spans(tables.begin(), tables.end());
  std::vector<std::int32_t> sequence_of(static_cast<std::size_t>(sequences));
  std::vector<std::int32_t> positions(static_cast<std::size_t>(sequences), static_cast<std::int32_t>(n_ctx - 1));
  for (std::int64_t s = 0; s < sequences; ++s) sequence_of[s] = static_cast<std::int32_t>(s);
  const batchlm::kernels::AttentionShape shape{n_heads, n_kv_heads, dim, stride, 1.0f / std::sqrt(static_cast<float>(dim))};
  std::vector<float> q(static_cast<std::size_t>(sequences * n_heads * dim));
  for (auto& x : q) x = normal(rng);
  std::vector<float> out(q.size());

  batchlm::kernels::ThreadPool pool(threads);
  std::vector<double> ms;
  for (int rep = 0; rep < warmup + reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int layer = 0; layer < layers; ++layer) {
      const std::size_t at = layer_size * static_cast<std::size_t>(layer);
      const batchlm::kernels::PagedKv kv{k.data() + at, v.data() + at, kBlock, spans, sequence_of.data()};
      batchlm::kernels::attention_paged(shape, q.data(), sequences, positions.data(), kv, out.data(), pool);
    }
    const std::chrono::duration<double, std::milli> d = std::chrono::steady_clock::now() - t0;
    if (rep >= warmup) ms.push_back(d.count() / layers);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double pairs = static_cast<double>(sequences * n_heads * n_ctx);
  double check = 0;
  for (float x : out) check += x;
  std::printf("sequences %lld prefix %lld tail %lld threads %d: %.3f ms per layer (min %.3f), %.3f ns per head-position pair per thread, checksum %.6f\n",
              static_cast<long long>(sequences), static_cast<long long>(prefix), static_cast<long long>(tail),
              threads, med, ms.front(), med * 1e6 * threads / pairs, check);
  return 0;
}
