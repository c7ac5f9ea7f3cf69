// step_cost: what one batched decode step of the model costs on the CPU kernels: --sequences
// sequences that share --prefix cached positions (the same blocks of the pool, as the prefix
// cache leaves them) and have --tail positions of their own each, one new token per sequence,
// with every token's logits, through Model::forward_batch over a paged KV store laid out as a
// busy pool leaves it (own blocks interleaved across sequences). The cached keys and values are
// F16 normals, not a real prompt's: the arithmetic and the memory traffic are the same. The
// median of --reps steps after --warmup.
//
//   step_cost --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 --sequences 32 --prefix 1568 --tail 176

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/model.hpp"

int main(int argc, char** argv) {
  using namespace batchlm::local_engine;
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  int threads = 2, reps = 20, warmup = 3;
  std::int64_t sequences = 32, prefix = 1568, tail = 176;
  CLI::App app{"Times one batched decode step of the model over a paged KV store"};
  app.add_option("--model", model_path, "GGUF model")->check(CLI::ExistingFile);
  app.add_option("--threads", threads, "Kernel threads (the caller included)")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "Timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--sequences", sequences, "Decoding sequences, one token each")->check(CLI::Range(1, 512));
  app.add_option("--prefix", prefix, "Positions every sequence shares (a multiple of 16)")->check(CLI::NonNegativeNumber);
  app.add_option("--tail", tail, "Positions of each sequence's own before its new token")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  constexpr std::int64_t kBlock = 16;
  if (prefix % kBlock != 0) {
    std::fprintf(stderr, "step_cost: --prefix must be a multiple of %lld\n", static_cast<long long>(kBlock));
    return 2;
  }

  const std::shared_ptr<Model> model = Model::load(model_path);
  const ModelConfig& c = model->config();
  const std::int64_t n_ctx = prefix + tail + 1;  // the new token's own position included
  const std::int64_t own_blocks = (n_ctx - prefix + kBlock - 1) / kBlock;
  const std::int64_t n_blocks = prefix / kBlock + sequences * own_blocks;
  KvStore store(c, kBlock, n_blocks);
  const KvPool& kv = store.pool();
  {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<std::uint16_t> table(4096);
    for (auto& x : table) x = batchlm::kernels::fp32_to_fp16(normal(rng));
    const auto total = static_cast<std::size_t>(kv.layer_stride * c.n_layers);
    for (std::size_t i = 0; i < total; ++i) {
      kv.k[i] = table[(i * 2654435761u) % table.size()];
      kv.v[i] = table[(i * 40503u + 17) % table.size()];
    }
  }
  // The shared blocks first, then each sequence's own, interleaved as a busy pool leaves them.
  std::vector<std::vector<std::int32_t>> tables(static_cast<std::size_t>(sequences));
  for (std::int64_t s = 0; s < sequences; ++s) {
    for (std::int64_t b = 0; b < prefix / kBlock; ++b) tables[s].push_back(static_cast<std::int32_t>(b));
    for (std::int64_t b = 0; b < own_blocks; ++b)
      tables[s].push_back(static_cast<std::int32_t>(prefix / kBlock + b * sequences + s));
  }
  const std::vector<std::span<const std::int32_t>> spans(tables.begin(), tables.end());
  std::vector<std::int32_t> sequence_of(static_cast<std::size_t>(sequences)), rows(sequence_of.size());
  std::vector<Token> tokens(sequence_of.size());
  const std::vector<std::int32_t> positions(sequence_of.size(), static_cast<std::int32_t>(n_ctx - 1));
  for (std::int64_t s = 0; s < sequences; ++s) {
    sequence_of[s] = rows[s] = static_cast<std::int32_t>(s);
    tokens[s] = static_cast<Token>((s * 7919 + 11) % c.n_vocab);
  }
  std::vector<float> logits(static_cast<std::size_t>(sequences * c.n_vocab));
  const Batch batch{tokens, positions, sequence_of, spans, rows};

  batchlm::kernels::ThreadPool pool(threads);
  std::vector<double> ms;
  for (int rep = 0; rep < warmup + reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    model->forward_batch(batch, kv, logits, pool);
    const std::chrono::duration<double, std::milli> d = std::chrono::steady_clock::now() - t0;
    if (rep >= warmup) ms.push_back(d.count());
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  std::printf("%s: %s kernels, %d threads, %lld sequences, prefix %lld, tail %lld: %.3f ms per step "
              "(min %.3f, median of %d), %.4f ms per token\n",
              model_path.c_str(), batchlm::kernels::cpu_simd_name(), threads, static_cast<long long>(sequences),
              static_cast<long long>(prefix), static_cast<long long>(tail), med, ms.front(), reps,
              med / static_cast<double>(sequences));
  return 0;
}
