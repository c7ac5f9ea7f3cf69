// forward_cost: what one sequence's forward pass over n tokens costs on the CPU kernels, for
// the n that speculative verification and small batches run (1 to 64). Each n is timed after
// a context of --context positions, with the last token's logits (a prompt chunk) and with
// every token's logits (a verification): the median of --reps runs after --warmup runs, each
// run rolling the cache back to the context first.
//
//   forward_cost --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/model.hpp"
#include "best_time.hpp"

using namespace batchlm::local_engine;
using batchlm::bench::median;

int main(int argc, char** argv) {
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  int threads = 2, reps = 30, warmup = 5;
  std::int64_t context = 64;
  std::vector<std::int64_t> sizes = {1, 2, 3, 4, 5, 8, 16, 32, 64};
  CLI::App app{"Times one sequence's forward pass over n tokens"};
  app.add_option("--model", model_path, "GGUF model")->check(CLI::ExistingFile);
  app.add_option("--threads", threads, "Kernel threads (the caller included)")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "Timed runs per n")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "Untimed runs per n first")->check(CLI::NonNegativeNumber);
  app.add_option("--context", context, "Positions already in the cache")->check(CLI::NonNegativeNumber);
  app.add_option("--n", sizes, "Token counts")->check(CLI::Range(1, 512));
  CLI11_PARSE(app, argc, argv);

  const std::shared_ptr<Model> model = Model::load(model_path);
  const ModelConfig& c = model->config();
  batchlm::kernels::ThreadPool pool(threads);
  const std::int64_t max_n = *std::max_element(sizes.begin(), sizes.end());
  KvCache cache(c, context + max_n);
  // Token ids spread over the vocabulary; what they are does not change the arithmetic.
  std::vector<Token> tokens(static_cast<std::size_t>(std::max(context, max_n)));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<Token>((i * 7919 + 11) % c.n_vocab);
  std::vector<float> logits(static_cast<std::size_t>(max_n * c.n_vocab));
  // The context goes in as prompt chunks no longer than one forward pass takes.
  for (std::int64_t done = 0; done < context;) {
    const std::int64_t chunk = std::min(Model::kMaxBatch, context - done);
    model->forward(std::span(tokens).subspan(static_cast<std::size_t>(done), static_cast<std::size_t>(chunk)), cache,
                   logits, false, pool);
    done += chunk;
  }

  const auto time = [&](std::int64_t n, bool all_logits) {
    std::vector<double> ms;
    for (int rep = 0; rep < warmup + reps; ++rep) {
      cache.resize(context);
      const auto t0 = std::chrono::steady_clock::now();
      model->forward(std::span(tokens).first(n), cache, logits, all_logits, pool);
      const auto t1 = std::chrono::steady_clock::now();
      if (rep >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    return median(ms);
  };

  std::printf("%s: %s kernels, %d threads, context %lld, median of %d runs after %d\n",
              model_path.c_str(), batchlm::kernels::cpu_simd_name(), threads,
              static_cast<long long>(context), reps, warmup);
  std::printf("%4s  %12s  %12s  %18s\n", "n", "last (ms)", "all (ms)", "all: ms per extra");
  double one = 0;
  for (const std::int64_t n : sizes) {
    const double last = time(n, false), all = time(n, true);
    if (n == 1) one = all;
    if (n > 1 && one > 0) {
      std::printf("%4lld  %12.3f  %12.3f  %18.3f\n", static_cast<long long>(n), last, all, (all - one) / static_cast<double>(n - 1));
    } else {
      std::printf("%4lld  %12.3f  %12.3f  %18s\n", static_cast<long long>(n), last, all, "");
    }
  }
  return 0;
}
