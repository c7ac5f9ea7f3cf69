// engine_bench: decode throughput of the engine on a device (bench/README.md, "GPU").
//
//   engine_bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --sequences 1,8,64,256
//   engine_bench --random-1b q4_1 --sequences 1,64          # a 1B-class Llama, random weights
//
// For each sequence count: that many requests with distinct short prompts, greedy, ignore_eos,
// --tokens new tokens each, all added at once; the time from the first step to the last, and
// the decode tokens/s over the steps after every prompt is in (prefill excluded). With
// --no-graphs-too, each count runs again with CUDA graphs off; with --no-graphs, only so (each
// kernel is then its own launch, as a kernel profiler counts them: bench/gpu/run.sh profile).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "batchlm/local_engine/batch_engine.hpp"
#include "batchlm/local_engine/model.hpp"
#include "gguf_writer.hpp"

namespace le = batchlm::local_engine;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

struct Result {
  double decode_tokens_per_s = 0;
  double total_s = 0;
  std::int64_t tokens = 0;
};

Result run(const std::shared_ptr<const le::Model>& model, le::Device device, bool graphs,
           int sequences, int tokens) {
  le::LocalBackendOptions o;
  o.device = device;
  o.cuda_graphs = graphs;
  o.context = 512;
  o.max_sequences = std::max(sequences, 1);
  o.token_budget = std::max<std::int64_t>(le::Model::kMaxBatch, sequences);
  le::BatchEngine engine(model, o);
  le::GenerateParams params;
  params.max_tokens = tokens;
  params.ignore_eos = true;
  params.sampling.temperature = 0.0f;
  const std::int64_t n_vocab = model->config().n_vocab;
  for (int s = 0; s < sequences; ++s) {
    std::vector<le::Token> prompt(16);
    for (std::size_t i = 0; i < prompt.size(); ++i)
      prompt[i] = static_cast<le::Token>((s * 7919 + static_cast<int>(i) * 104729) % n_vocab);
    engine.add(prompt, params, nullptr);
  }
  const auto start = Clock::now();
  Clock::time_point decode_start{};
  std::int64_t at_decode_start = 0;
  while (!engine.idle()) {
    engine.step();
    const batchlm::EngineStats s = engine.stats();
    if (decode_start == Clock::time_point{} && s.waiting == 0 &&
        s.prompt_tokens_computed + s.prompt_tokens_cached >= 16LL * sequences) {
      decode_start = Clock::now();
      at_decode_start = s.generated_tokens;
    }
    engine.take_finished();
  }
  const auto end = Clock::now();
  Result r;
  r.tokens = engine.stats().generated_tokens;
  r.total_s = std::chrono::duration<double>(end - start).count();
  const double decode_s = std::chrono::duration<double>(end - decode_start).count();
  r.decode_tokens_per_s = static_cast<double>(r.tokens - at_decode_start) / decode_s;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Decode throughput of the engine"};
  std::string model_path, random_1b, sequences_arg = "1,8,64,256", device_arg = "cuda";
  int tokens = 128;
  bool no_graphs_too = false, no_graphs = false;
  app.add_option("--model", model_path, "GGUF model");
  app.add_option("--random-1b", random_1b, "Write and run a 1B-class Llama with random weights: q4_1, q4_k_m (Q4_K, V and up Q6_K) or f16")
      ->check(CLI::IsMember({"q4_1", "q4_k_m", "f16"}));
  app.add_option("--sequences", sequences_arg, "Comma-separated sequence counts");
  app.add_option("--tokens", tokens, "New tokens per sequence")->check(CLI::Range(2, 4096));
  app.add_option("--device", device_arg, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_flag("--no-graphs-too", no_graphs_too, "Also run each count with CUDA graphs off");
  app.add_flag("--no-graphs", no_graphs, "Run with CUDA graphs off only (for a kernel profiler)")
      ->excludes("--no-graphs-too");
  CLI11_PARSE(app, argc, argv);
  if (model_path.empty() == random_1b.empty()) {
    std::fprintf(stderr, "engine_bench: give --model or --random-1b\n");
    return 2;
  }
  if (!random_1b.empty()) {
    // Llama-3.2-1B's shape: 16 layers, 2048 wide, 8192 feed-forward, 32 heads over 8 KV heads;
    // the tiny test vocabulary keeps the file small, so the output head is not what is timed.
    batchlm::testing::TinyLlamaOptions o;
    o.n_embd = 2048;
    o.n_ff = 8192;
    o.n_heads = 32;
    o.n_kv_heads = 8;
    o.n_layers = 16;
    o.context_length = 2048;
    using batchlm::kernels::DType;
    o.weight_dtype = random_1b == "f16" ? DType::F16 : random_1b == "q4_k_m" ? DType::Q4_K : DType::Q4_1;
    if (random_1b == "q4_k_m") o.v_up_dtype = DType::Q6_K;
    o.embedding_dtype = o.weight_dtype;
    model_path = (fs::temp_directory_path() / ("batchlm-random-1b-" + random_1b + ".gguf")).string();
    if (!fs::exists(model_path)) batchlm::testing::write_tiny_llama(model_path, o);
  }
  const auto model = le::Model::load(model_path);
  const le::Device device = *le::parse_device(device_arg);

  std::vector<int> counts;
  std::stringstream list(sequences_arg);
  for (std::string item; std::getline(list, item, ',');) counts.push_back(std::stoi(item));

  std::printf("model %s, %d new tokens per sequence, device %s\n", model_path.c_str(), tokens,
              device_arg.c_str());
  std::printf("%10s %8s %16s %10s %10s\n", "sequences", "graphs", "decode tok/s", "total s", "tokens");
  for (int n : counts) {
    for (bool graphs : {true, false}) {
      if (!graphs && !no_graphs_too && !no_graphs) continue;
      if (graphs && no_graphs) continue;
      run(model, device, graphs, std::min(n, 4), 8);  // warm-up: module load, graph capture
      const Result r = run(model, device, graphs, n, tokens);
      std::printf("%10d %8s %16.0f %10.3f %10lld\n", n, graphs ? "on" : "off", r.decode_tokens_per_s,
                  r.total_s, static_cast<long long>(r.tokens));
      std::fflush(stdout);
    }
  }
  return 0;
}
