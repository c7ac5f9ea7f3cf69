// sample_cost: what choosing one token from a row of the model's logits costs on the CPU, for the
// sampling settings a job uses (temperature, top-p, top-k), on rows the model itself made: the
// prompt's last position and the greedy continuation after it. Prints the best time over
// --reps draws per row, the median over rows, and how many tokens each row's distribution keeps.
//
//   sample_cost --model models/SmolLM2-135M-Instruct.Q4_1.gguf

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/model.hpp"
#include "batchlm/local_engine/sampling.hpp"
#include "best_time.hpp"

using namespace batchlm::local_engine;
using batchlm::bench::median;

int main(int argc, char** argv) {
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string prompt =
      "Write a short story (3-5 paragraphs) for young children, using only simple words a 3-year-old would "
      "understand. The story should use the verb 'swim', the noun 'boat' and the adjective 'fast'.\n\nOnce upon a time";
  int threads = 2, reps = 20, rows = 16;
  CLI::App app{"Times drawing one token from a row of logits"};
  app.add_option("--model", model_path, "GGUF model")->check(CLI::ExistingFile);
  app.add_option("--threads", threads, "Kernel threads for the forward passes")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "Timed draws per row (the best is kept)")->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "Rows of logits: the prompt's last and the greedy tokens after it")
      ->check(CLI::Range(1, 256));
  app.add_option("--prompt", prompt, "Text the rows follow");
  CLI11_PARSE(app, argc, argv);

  const std::shared_ptr<Model> model = Model::load(model_path);
  const ModelConfig& c = model->config();
  batchlm::kernels::ThreadPool pool(threads);
  std::vector<Token> tokens = model->tokenizer().encode(prompt, false);
  KvCache cache(c, static_cast<std::int64_t>(tokens.size()) + rows + 1);
  const auto n_vocab = static_cast<std::size_t>(c.n_vocab);
  std::vector<std::vector<float>> logit_rows;
  std::vector<float> logits(n_vocab);
  for (std::size_t done = 0; done < tokens.size();) {
    const std::size_t chunk = std::min<std::size_t>(static_cast<std::size_t>(Model::kMaxBatch), tokens.size() - done);
    model->forward(std::span(tokens).subspan(done, chunk), cache, logits, false, pool);
    done += chunk;
  }
  for (int r = 0; r < rows; ++r) {
    logit_rows.push_back(logits);
    const Token next = static_cast<Token>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    const Token one[1] = {next};
    model->forward(std::span<const Token>(one), cache, logits, false, pool);
  }

  struct Setting {
    const char* name;
    SamplingParams params;
  };
  const auto make = [](float t, float p, int k) {
    SamplingParams s;
    s.temperature = t;
    s.top_p = p;
    s.top_k = k;
    s.seed = 7;
    return s;
  };
  const std::vector<Setting> settings = {
      {"greedy", make(0.0f, 1.0f, 0)},         {"t=1", make(1.0f, 1.0f, 0)},
      {"t=0.7", make(0.7f, 1.0f, 0)},          {"t=1 top_p=0.95", make(1.0f, 0.95f, 0)},
      {"t=0.7 top_p=0.9", make(0.7f, 0.9f, 0)}, {"t=0.8 top_k=40", make(0.8f, 1.0f, 40)},
      {"t=0.2", make(0.2f, 1.0f, 0)},          {"t=0.2 top_p=0.95", make(0.2f, 0.95f, 0)},
  };
  std::printf("%zu rows of %zu logits, %d draws each (best per row, median over rows)\n", logit_rows.size(), n_vocab,
              reps);
  std::printf("%-18s %12s %14s\n", "setting", "us / token", "tokens kept");
  for (const Setting& s : settings) {
    std::vector<double> us;
    std::vector<double> kept;
    for (const auto& row : logit_rows) {
      Sampler sampler(s.params);
      double best = 1e30;
      volatile Token sink = 0;
      for (int rep = 0; rep <= reps; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        sink = sampler.sample(row);
        const double t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        if (rep > 0) best = std::min(best, t);
      }
      (void)sink;
      us.push_back(best);
      kept.push_back(sampler.greedy() ? 1.0 : static_cast<double>(Sampler(s.params).distribution(row).tokens.size()));
    }
    std::printf("%-18s %12.1f %14.0f\n", s.name, median(us), median(kept));
  }
  return 0;
}
