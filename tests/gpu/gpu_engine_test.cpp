// The engine on the GPU against the CPU path: the CUDA executor's logits against the CPU
// executor's on tiny random models of every weight type (mixed prefill and decode batches,
// shuffled block tables, CUDA-graph replays), greedy generation teacher-forced along the CPU's
// tokens, continuous batching, prefix caching, speculative decoding and device sampling through
// BatchEngine; and the default model against its exact reference. Skipped where no GPU is
// present.
//
// Float rounding legitimately differs between the devices (the GPU does not quantize
// activations to Q8 as the CPU does, and sums in another order), so on the tiny models greedy
// tokens are compared up to near-ties: at every step the GPU's argmax must be the CPU's unless
// the CPU's two best logits are within kTieMargin of each other, and the logits must agree
// within a relative L2 error bound. On the 30-layer default model the CPU's 8-bit rounding
// moves logits by tenths, so there both devices are measured against float64 instead.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "batchlm/local_engine/batch_engine.hpp"
#include "batchlm/local_engine/executor.hpp"
#include "batchlm/local_engine/model.hpp"
#include "exact_reference.hpp"
#include "gguf_writer.hpp"
#include "gpu_test.hpp"

namespace batchlm::local_engine {
namespace {

namespace fs = std::filesystem;
using batchlm::gpu_test::relative_error;

// Bounds, relative L2 over a row of logits: F32 and F16 weights differ from the CPU only by
// summation order (and F16 rounding of tensor-core inputs for many-token batches); quantized
// weights add the CPU's Q8 rounding of activations, which the GPU does not do.
double logits_bound(kernels::DType t) {
  switch (t) {
    case kernels::DType::F32: return 2e-3;
    case kernels::DType::F16:
    case kernels::DType::BF16: return 5e-3;
    default: return 3e-2;
  }
}
constexpr float kTieMargin = 0.05f;

class GpuEngine : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string tmpl = (fs::temp_directory_path() / "batchlm-gpu-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = new fs::path(tmpl);
    using kernels::DType;
    for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q8_0})
      write_tiny_llama(path(t), tiny(t, t == DType::BF16 ? DType::F16 : t));
    // The 5-bit and K types (K blocks are 256 wide: n_embd and n_ff multiples of 256).
    for (DType t : {DType::Q5_0, DType::Q5_1, DType::Q4_K, DType::Q5_K, DType::Q6_K})
      write_tiny_llama(path(t), tiny(t, t, /*wide=*/true));
    // The other architectures: Qwen2's biases and rotary halves, Qwen3's per-head norms and
    // heads wider than n_embd / n_heads (as tiny-qwen3 has them), Llama's rope_freqs, Phi-3's
    // stacked matrices and rotary factors; and a Q4_K_M-like mix (Q4_K, with V and up in Q6_K,
    // the embeddings Q6_K).
    for (const auto& [name, o] : variants()) write_tiny_llama(*dir_ / (name + ".gguf"), o);
    // Layers of mixed types: Q, K and V (gate and up) cannot be stacked into one product.
    batchlm::testing::TinyLlamaOptions o = tiny(DType::Q4_1, DType::Q4_1);
    o.v_up_dtype = DType::Q8_0;
    write_tiny_llama(mixed_path(), o);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override { BATCHLM_REQUIRE_GPU(); }

  static fs::path path(kernels::DType t) {
    return *dir_ / (std::string("tiny-") + std::string(kernels::to_string(t)) + ".gguf");
  }

  static fs::path mixed_path() { return *dir_ / "tiny-mixed.gguf"; }

  // A 2-layer model of 1024 positions in these types, of the writer's default width, or 256
  // wide with an n_ff of 512 (whole blocks of the K types).
  static batchlm::testing::TinyLlamaOptions tiny(kernels::DType weights, kernels::DType embedding, bool wide = false) {
    batchlm::testing::TinyLlamaOptions o;
    o.n_layers = 2;
    o.context_length = 1024;
    o.weight_dtype = weights;
    o.embedding_dtype = embedding;
    if (wide) {
      o.n_embd = 256;
      o.n_ff = 512;
    }
    return o;
  }

  // The architecture variants, by name, with the weight type their logits bound is for.
  static std::vector<std::pair<std::string, batchlm::testing::TinyLlamaOptions>> variants() {
    using kernels::DType;
    std::vector<std::pair<std::string, batchlm::testing::TinyLlamaOptions>> v;
    batchlm::testing::TinyLlamaOptions qwen2 = tiny(DType::Q8_0, DType::Q8_0);
    qwen2.architecture = "qwen2";
    v.emplace_back("qwen2-q8_0", qwen2);
    batchlm::testing::TinyLlamaOptions qwen3 = tiny(DType::F32, DType::F32);
    qwen3.architecture = "qwen3";
    qwen3.head_dim = 32;  // 4 heads of 32 over n_embd 64
    v.emplace_back("qwen3-f32", qwen3);
    batchlm::testing::TinyLlamaOptions q3 = batchlm::testing::tiny_qwen3_reference();
    q3.context_length = 1024;
    q3.weight_dtype = DType::Q4_K;
    q3.embedding_dtype = DType::Q6_K;
    v.emplace_back("qwen3-q4_k", q3);
    batchlm::testing::TinyLlamaOptions freqs = tiny(DType::F16, DType::F16);
    freqs.rope_freqs = {1.0f, 1.0f, 1.5f, 2.0f, 4.0f, 8.0f, 8.0f, 8.0f};  // head_dim 16
    v.emplace_back("llama-rope-freqs-f16", freqs);
    batchlm::testing::TinyLlamaOptions km = tiny(DType::Q4_K, DType::Q6_K, /*wide=*/true);
    km.v_up_dtype = DType::Q6_K;
    v.emplace_back("llama-q4_k_m", km);
    // Phi-3: Q, K and V (gate and up) stacked in the file; the long-context factors and
    // magnitude; Phi-4-mini's rotation of three quarters of each head.
    batchlm::testing::TinyLlamaOptions phi = tiny(DType::Q8_0, DType::Q8_0);
    phi.context_length = 4096;
    phi.architecture = "phi3";
    for (int i = 0; i < 8; ++i) {  // head_dim 16
      phi.rope_factors_short.push_back(1.0f + static_cast<float>(i));
      phi.rope_factors_long.push_back(40.0f - static_cast<float>(i));
    }
    phi.rope_attn_factor = 1.1902f;
    phi.original_context_length = 1024;
    v.emplace_back("phi3-q8_0", phi);
    batchlm::testing::TinyLlamaOptions phi4 = tiny(DType::Q4_K, DType::Q8_0, /*wide=*/true);
    phi4.architecture = "phi3";
    phi4.rope_dim = 48;  // of 64
    v.emplace_back("phi3-partial-q4_k", phi4);
    return v;
  }
  static fs::path variant_path(const std::string& name) { return *dir_ / (name + ".gguf"); }

  static inline fs::path* dir_ = nullptr;
};

// One sequence's greedy continuation on `cpu`, teacher-forced through `gpu`: every step's
// logits compared. Both executors have fresh pools of the same shape.
void compare_greedy(Executor& cpu, Executor& gpu, const std::vector<Token>& prompt, int steps,
                    std::int64_t n_vocab, double bound, const std::string& what) {
  const std::vector<std::int32_t> table = {3, 0, 5, 1, 7, 2, 6, 4};  // shuffled blocks
  const std::vector<std::span<const std::int32_t>> tables = {table};
  std::vector<Token> tokens = prompt;
  std::vector<float> a(n_vocab), b(n_vocab);
  std::size_t done = 0;  // tokens already in both caches
  for (int step = 0; step < steps; ++step) {
    const std::vector<Token> fresh(tokens.begin() + static_cast<std::ptrdiff_t>(done), tokens.end());
    std::vector<std::int32_t> positions(fresh.size()), seq(fresh.size(), 0);
    std::iota(positions.begin(), positions.end(), static_cast<std::int32_t>(done));
    const std::vector<std::int32_t> rows = {static_cast<std::int32_t>(fresh.size() - 1)};
    const Batch batch{fresh, positions, seq, tables, rows};
    cpu.forward(batch, a);
    gpu.forward(batch, b);
    const double error = relative_error(b, a);
    EXPECT_LT(error, bound) << what << " step " << step;
    std::vector<float> sorted = a;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    const auto best_cpu = std::max_element(a.begin(), a.end()) - a.begin();
    const auto best_gpu = std::max_element(b.begin(), b.end()) - b.begin();
    const float margin = sorted[0] - sorted[1];
    if (margin >= kTieMargin) {
      EXPECT_EQ(best_gpu, best_cpu) << what << " step " << step << ": margin " << margin;
    }
    if (std::getenv("BATCHLM_TEST_VERBOSE") != nullptr)
      std::printf("%s step %d: logits vs cpu %.4f, cpu's margin %.3f, argmax %s\n", what.c_str(), step, error,
                  margin, best_gpu == best_cpu ? "same" : "differs");
    done = tokens.size();
    tokens.push_back(static_cast<Token>(best_cpu));
  }
}

TEST_F(GpuEngine, GreedyLogitsMatchTheCpuForEveryWeightType) {
  using kernels::DType;
  std::vector<std::pair<fs::path, DType>> models;
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1,
                  DType::Q8_0, DType::Q4_K, DType::Q5_K, DType::Q6_K})
    models.emplace_back(path(t), t);
  models.emplace_back(mixed_path(), DType::Q4_1);  // Q4_1, with V and up in Q8_0
  for (const auto& [name, o] : variants()) models.emplace_back(variant_path(name), o.weight_dtype);
  for (const auto& [file, t] : models) {
    const auto model = Model::load(file);
    auto cpu = make_executor(model, {.device = Device::kCpu, .threads = 2, .context = 512});
    auto gpu = make_executor(model, {.device = Device::kCuda, .context = 512});
    ASSERT_EQ(gpu->device(), Device::kCuda);
    cpu->allocate_pool(16, 8);
    gpu->allocate_pool(16, 8);
    // A prompt long enough for the tensor-core path (more than 8 tokens), then decode steps
    // through the CUDA graphs.
    std::vector<Token> prompt(40);
    for (std::size_t i = 0; i < prompt.size(); ++i)
      prompt[i] = static_cast<Token>((i * 37 + 11) % model->config().n_vocab);
    compare_greedy(*cpu, *gpu, prompt, 60, model->config().n_vocab, logits_bound(t), file.filename().string());
  }
}

// A mixed batch (two prefill chunks and three decoding sequences, logits of some rows), then
// the same decode batch replayed from a graph with other contents, and the eager path; for a
// Llama, a Qwen3 (per-head norms, wide heads) and a Qwen2 (biases: padding tokens in a graph's
// bucket get them too, and must still store nothing).
TEST_F(GpuEngine, MixedBatchesAndGraphReplaysMatchTheCpu) {
  for (const fs::path& file : {path(kernels::DType::Q4_1), variant_path("qwen3-q4_k"), variant_path("qwen2-q8_0"),
                               variant_path("phi3-q8_0")}) {
  SCOPED_TRACE(file.filename().string());
  const auto model = Model::load(file);
  const ModelConfig& c = model->config();
  auto cpu = make_executor(model, {.device = Device::kCpu, .threads = 2, .context = 256});
  auto gpu = make_executor(model, {.device = Device::kCuda, .context = 256});
  auto eager = make_executor(model, {.device = Device::kCuda, .context = 256, .graphs = false});
  for (Executor* e : {cpu.get(), gpu.get(), eager.get()}) e->allocate_pool(16, 64);

  std::mt19937 rng(7);
  std::uniform_int_distribution<Token> token(0, static_cast<Token>(c.n_vocab - 1));
  // Five sequences with their own shuffled blocks.
  std::vector<std::int32_t> ids(64);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::vector<std::int32_t>> tables(5);
  for (int s = 0; s < 5; ++s) tables[s].assign(ids.begin() + s * 12, ids.begin() + (s + 1) * 12);
  std::vector<std::span<const std::int32_t>> spans(tables.begin(), tables.end());
  std::vector<std::int32_t> length(5, 0);

  auto step = [&](const std::vector<int>& counts, bool all_rows, const std::string& what) {
    std::vector<Token> tokens;
    std::vector<std::int32_t> positions, seq, rows;
    for (int s = 0; s < 5; ++s) {
      for (int j = 0; j < counts[s]; ++j) {
        tokens.push_back(token(rng));
        positions.push_back(length[s] + j);
        seq.push_back(s);
        if (all_rows || j + 1 == counts[s]) rows.push_back(static_cast<std::int32_t>(tokens.size() - 1));
      }
      length[s] += counts[s];
    }
    const Batch batch{tokens, positions, seq, spans, rows};
    std::vector<float> a(rows.size() * c.n_vocab), b(a.size()), e(a.size());
    cpu->forward(batch, a);
    gpu->forward(batch, b);
    eager->forward(batch, e);
    EXPECT_LT(relative_error(b, a), logits_bound(kernels::DType::Q4_1)) << what;
    EXPECT_LT(relative_error(e, a), logits_bound(kernels::DType::Q4_1)) << what;
    EXPECT_LT(relative_error(b, e), 1e-5) << what << ": a graph replay differs from eager launches";
  };
  step({30, 1, 17, 5, 2}, false, "mixed prefill");
  step({3, 4, 2, 1, 6}, true, "verify-shaped, every row");
  for (int i = 0; i < 20; ++i) step({1, 1, 1, 1, 1}, true, "decode " + std::to_string(i));
  step({1, 0, 1, 0, 1}, true, "decode, fewer sequences in the same bucket");
  step({0, 1, 0, 0, 0}, true, "decode, one sequence");
  step({40, 1, 1, 1, 1}, false, "a long chunk beside decodes");
  }
}

// The CUDA executor's block copies (part of a block from the prefix cache): a token that reads
// copied blocks gets the logits it gets from the originals (the same kernels on the same keys
// and values).
TEST_F(GpuEngine, CopiedBlocksReadAsTheOriginals) {
  const auto model = Model::load(path(kernels::DType::Q4_1));
  auto gpu = make_executor(model, {.device = Device::kCuda, .context = 256});
  gpu->allocate_pool(4, 16);
  // Five tokens, then the sixth alone: the sixth is then computed the same way both times.
  const std::vector<Token> tokens = {5, 9, 2, 7, 11};
  const std::vector<std::int32_t> positions = {0, 1, 2, 3, 4}, seq(5, 0), last = {4};
  const std::vector<std::int32_t> original = {3, 12};
  std::vector<std::span<const std::int32_t>> tables = {original};
  std::vector<float> expected(model->config().n_vocab), got(expected.size(), -1.0f);
  gpu->forward(Batch{tokens, positions, seq, tables, last}, expected);
  const std::vector<Token> one = {3};
  const std::vector<std::int32_t> at = {5}, first = {0};
  gpu->forward(Batch{one, at, first, tables, first}, expected);
  const BlockCopy copies[] = {{3, 1}, {12, 9}};
  gpu->copy_blocks(copies);
  const std::vector<std::int32_t> copied = {1, 9};
  tables = {copied};
  gpu->forward(Batch{one, at, first, tables, first}, got);
  EXPECT_LT(relative_error(got, expected), 1e-5);
  const BlockCopy outside[] = {{2, 16}};
  EXPECT_THROW(gpu->copy_blocks(outside), std::out_of_range);
}

// BatchEngine on the GPU: several prompts decoded together with a shared prefix, greedy.
// Teacher-forced agreement is the test above; here the GPU's own continuations must be the
// same whether a prompt runs alone or batched (same kernels, same rounding per row: a row's
// result does not depend on its neighbours except through the matrix path, which the batch
// size picks, so only prompts decoded in one batch are compared with each other).
TEST_F(GpuEngine, BatchEngineRunsContinuousBatchingPrefixCachingAndSpeculation) {
  const auto model = Model::load(path(kernels::DType::F16));
  const ModelConfig& c = model->config();
  std::vector<std::vector<Token>> prompts;
  std::vector<Token> prefix(40);
  for (std::size_t i = 0; i < prefix.size(); ++i) prefix[i] = static_cast<Token>((i * 13 + 5) % c.n_vocab);
  for (int p = 0; p < 6; ++p) {
    std::vector<Token> t = prefix;
    for (int j = 0; j < 5 + p; ++j) t.push_back(static_cast<Token>((p * 31 + j * 7) % c.n_vocab));
    // Repeat the prompt's own text so n-gram lookup finds something.
    t.insert(t.end(), t.begin(), t.begin() + 10);
    prompts.push_back(t);
  }
  GenerateParams params;
  params.max_tokens = 24;
  params.sampling.temperature = 0.0f;
  params.ignore_eos = true;
  auto run = [&](Device device, SpecMethod method) {
    LocalBackendOptions o;
    o.device = device;
    o.threads = 2;
    o.context = 256;
    o.max_sequences = 8;
    o.kv_tokens = 4096;
    o.speculative.method = method;
    if (method == SpecMethod::kSelf) o.speculative.layers = 1;
    BatchEngine engine(model, o);
    std::map<SequenceId, std::size_t> index;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      index[engine.add(prompts[i], params, nullptr)] = i;
      if (i == 0) engine.step();
    }
    std::vector<std::vector<Token>> out(prompts.size());
    while (!engine.idle()) {
      engine.step();
      for (auto& [id, result] : engine.take_finished()) out[index.at(id)] = result.tokens;
    }
    const EngineStats s = engine.stats();
    EXPECT_GT(s.prompt_tokens_cached, 0) << "the shared prefix was not reused";
    return out;
  };
  const auto gpu = run(Device::kCuda, SpecMethod::kNone);
  for (const auto& t : gpu) EXPECT_EQ(t.size(), 24u);
  // Greedy speculation on the GPU gives the GPU's own tokens. The verify pass (several tokens
  // per sequence) may take the tensor-core path where plain decoding takes the matrix-vector
  // one, so a near-tie could legitimately flip a token; should this fail, look at the margin
  // of the first differing token before suspecting the verifier.
  EXPECT_EQ(run(Device::kCuda, SpecMethod::kNgram), gpu);
  EXPECT_EQ(run(Device::kCuda, SpecMethod::kSelf), gpu);
}

// Sampling on the device: the same seed gives the same text, another seed another text, and
// with top_k 1 it is the greedy text.
TEST_F(GpuEngine, DeviceSamplingIsSeededPerRequest) {
  const auto model = Model::load(path(kernels::DType::F32));
  const ModelConfig& c = model->config();
  std::vector<Token> prompt(12);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<Token>((i * 5 + 1) % c.n_vocab);
  auto run = [&](std::uint64_t seed, float temperature, int top_k, int copies) {
    LocalBackendOptions o;
    o.device = Device::kCuda;
    o.context = 128;
    o.max_sequences = 8;
    o.kv_tokens = 2048;
    BatchEngine engine(model, o);
    GenerateParams params;
    params.max_tokens = 32;
    params.ignore_eos = true;
    params.sampling.temperature = temperature;
    params.sampling.top_k = top_k;
    params.sampling.seed = seed;
    for (int i = 0; i < copies; ++i) engine.add(prompt, params, nullptr);
    std::vector<std::vector<Token>> out;
    while (!engine.idle()) {
      engine.step();
      for (auto& [id, result] : engine.take_finished()) out.push_back(result.tokens);
    }
    return out;
  };
  const auto a = run(42, 1.0f, 0, 3);
  ASSERT_EQ(a.size(), 3u);
  // Copies with one seed in one batch draw the same tokens: the draw depends on the seed and
  // the step alone.
  EXPECT_EQ(a[0], a[1]);
  EXPECT_EQ(a[0], a[2]);
  EXPECT_EQ(run(42, 1.0f, 0, 1)[0], a[0]);
  EXPECT_NE(run(43, 1.0f, 0, 1)[0], a[0]);
  EXPECT_EQ(run(42, 1.0f, 1, 1)[0], run(0, 0.0f, 0, 1)[0]);
}

TEST_F(GpuEngine, PenaltiesAreRefusedWhereTheDeviceSamples) {
  const auto model = Model::load(path(kernels::DType::F32));
  LocalBackendOptions o;
  o.device = Device::kCuda;
  o.context = 128;
  o.kv_tokens = 2048;
  BatchEngine engine(model, o);
  GenerateParams params;
  params.max_tokens = 4;
  params.sampling.frequency_penalty = 0.5f;
  const std::vector<Token> prompt = {1, 2, 3};
  try {
    engine.add(prompt, params, nullptr);
    ADD_FAILURE() << "a penalized request was accepted on the GPU";
  } catch (const RequestRejected& e) {
    EXPECT_EQ(e.code, "unsupported_parameter");
  }
  params.sampling.frequency_penalty = 0.0f;
  // Biases, log-probabilities, JSON mode and schemas are CPU-side too.
  const auto refused = [&](const GenerateParams& p) {
    try {
      engine.add(prompt, p, nullptr);
    } catch (const RequestRejected& e) {
      return e.code == "unsupported_parameter";
    }
    return false;
  };
  GenerateParams biased = params;
  biased.sampling.logit_bias = {{1, 5.0f}};
  EXPECT_TRUE(refused(biased));
  GenerateParams with_logprobs = params;
  with_logprobs.logprobs = 2;
  EXPECT_TRUE(refused(with_logprobs));
  GenerateParams min_p = params;
  min_p.sampling.min_p = 0.1f;
  try {
    engine.add(prompt, min_p, nullptr);
    ADD_FAILURE() << "min_p was accepted on the GPU";
  } catch (const RequestRejected& e) {
    EXPECT_EQ(e.code, "unsupported_parameter");
    EXPECT_NE(std::string(e.what()).find("'min_p': min-p is applied on the CPU only"), std::string::npos) << e.what();
  }
  GenerateParams json_mode = params;
  json_mode.json_object = true;
  EXPECT_TRUE(refused(json_mode));
  GenerateParams schema = params;
  schema.json_schema = std::make_shared<const JsonSchema>(compile_json_schema({{"type", "object"}}));
  EXPECT_TRUE(refused(schema));
  EXPECT_NO_THROW(engine.add(prompt, params, nullptr));
}

// The dry run's check on a GPU machine says what the constructor would: a model the GPU runs
// passes under `cuda`; one it cannot (rows of 200 values) is refused there, in the
// constructor's words, and passes under `auto`, where it runs on the CPU; a pool smaller than
// one context is refused on the GPU too.
TEST_F(GpuEngine, TheDryRunsCheckAgreesWithTheConstructorOnTheGpu) {
  LocalBackendOptions o;
  o.device = Device::kCuda;
  o.threads = 1;
  o.context = 128;
  o.kv_tokens = 2048;
  const auto good = Model::load(path(kernels::DType::Q4_1));
  EXPECT_NO_THROW(BatchEngine::check(good, o));
  EXPECT_NO_THROW(BatchEngine(good, o));
  batchlm::testing::TinyLlamaOptions w = tiny(kernels::DType::F32, kernels::DType::F32);
  w.n_heads = 5;
  w.n_kv_heads = 1;
  w.head_dim = 40;
  write_tiny_llama(*dir_ / "w200.gguf", w);
  const auto odd = Model::load(*dir_ / "w200.gguf");
  std::string checked, built;
  try {
    BatchEngine::check(odd, o);
    ADD_FAILURE() << "the check passed a model the GPU cannot run";
  } catch (const DeviceUnavailable& e) {
    checked = e.what();
  }
  try {
    BatchEngine engine(odd, o);
    ADD_FAILURE() << "the engine took a model the GPU cannot run";
  } catch (const DeviceUnavailable& e) {
    built = e.what();
  }
  EXPECT_EQ(checked, built);
  EXPECT_NE(checked.find("attn_output rows hold 200"), std::string::npos) << checked;
  LocalBackendOptions a = o;
  a.device = Device::kAuto;
  EXPECT_NO_THROW(BatchEngine::check(odd, a));
  LocalBackendOptions small = o;
  small.kv_tokens = 64;  // under one context of 128
  EXPECT_THROW(BatchEngine::check(good, small), std::invalid_argument);
  EXPECT_THROW(BatchEngine(good, small), std::invalid_argument);
}

// A Gemma model on a GPU machine: `auto` runs it on the CPU, saying why, with the CPU's own
// greedy tokens; `cuda` is refused, by the check and the constructor alike.
TEST_F(GpuEngine, GemmaRunsOnTheCpuOfAGpuMachine) {
  batchlm::testing::TinyLlamaOptions g = tiny(kernels::DType::Q8_0, kernels::DType::Q8_0);
  g.architecture = "gemma3";
  g.sliding_window = 8;
  g.sliding_window_pattern = 2;
  g.rope_freq_base_swa = 10000.0f;
  write_tiny_llama(*dir_ / "gemma3.gguf", g);
  const auto model = Model::load(*dir_ / "gemma3.gguf");
  GenerateParams params;
  params.max_tokens = 12;
  params.ignore_eos = true;
  const std::vector<Token> prompt = {1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41};
  auto run = [&](Device device) {
    LocalBackendOptions o;
    o.device = device;
    o.threads = 2;
    o.context = 128;
    o.kv_tokens = 1024;
    BatchEngine engine(model, o);
    const SequenceId id = engine.add(prompt, params, nullptr);
    std::vector<Token> out;
    while (!engine.idle()) {
      engine.step();
      for (auto& [done, result] : engine.take_finished())
        if (done == id) out = result.tokens;
    }
    return std::make_pair(engine.device(), out);
  };
  const auto [where, tokens] = run(Device::kAuto);
  EXPECT_NE(where.find("no GPU: the GPU forward pass does not run the 'gemma3' architecture"), std::string::npos)
      << where;
  EXPECT_EQ(tokens.size(), 12u);
  EXPECT_EQ(tokens, run(Device::kCpu).second);
  LocalBackendOptions o;
  o.device = Device::kCuda;
  o.context = 128;
  o.kv_tokens = 1024;
  EXPECT_THROW(BatchEngine::check(model, o), DeviceUnavailable);
  EXPECT_THROW(BatchEngine(model, o), DeviceUnavailable);
}

// The default model against its exact reference (tests/support/exact_reference.hpp), teacher-
// forced along the exact greedy tokens of the seven llama.cpp golden prompts. The GPU does not
// round activations to 8 bits as the CPU path and llama.cpp do, so it is held much closer to
// the exact logits than the CPU is (reference_test's CpuStaysNearTheExactReference: within 2.0
// there, 1.35 measured). The GPU is also compared with llama.cpp's own tokens, for the record
// (the CPU's comparisons are reference_test's).
TEST_F(GpuEngine, DefaultModelFollowsTheExactReference) {
  const char* env = std::getenv("BATCHLM_MODEL");  // where bench/gpu/run.sh puts it
  const fs::path model_path = env != nullptr && *env != '\0'
                                  ? fs::path(env)
                                  : fs::path(BATCHLM_SOURCE_DIR) / "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(model_path)) GTEST_SKIP() << model_path << " is absent (scripts/fetch-model.sh fetches it)";
  const auto model = Model::load(model_path);
  const std::int64_t n_vocab = model->config().n_vocab;
  const bool print = std::getenv("BATCHLM_TEST_VERBOSE") != nullptr;
  const nlohmann::json exact = batchlm::testing::read_reference("exact.json");
  auto gpu = make_executor(model, {.device = Device::kCuda, .context = 512});
  gpu->allocate_pool(16, 32);
  const auto g = batchlm::testing::compare_with_exact(*gpu, exact, n_vocab, print, "gpu vs exact");
  // Measured on an H200: within 0.018 with Q, K and V as three products, 0.033 with them
  // stacked into one (another summation order); no step took another token either way. A step
  // may take another token only where two logits each off by up to kGpuTopError could swap,
  // and at most 1 step in 50. (top_error is measured on the prompt's row; the later steps are
  // taken to stay within the same bound, which the tie margin then assumes.)
  constexpr double kGpuTopError = 0.1, kGpuTie = 2 * kGpuTopError;
  EXPECT_LT(g.top_error, kGpuTopError);
  EXPECT_LT(g.differing_margin, kGpuTie);
  EXPECT_LE(g.differing * 50, g.steps);
  std::printf("[ note ] gpu against the exact reference: top logits within %.4f; %d of %d steps take another "
              "token (largest exact margin among them %.3f)\n",
              g.top_error, g.differing, g.steps, g.differing_margin);

  // Against llama.cpp's goldens: a figure to read, not a bound (llama.cpp rounds as the CPU
  // path does), so only asked for (BATCHLM_TEST_VERBOSE, as bench/gpu/run.sh sets it).
  if (print) {
    const auto l = batchlm::testing::compare_with_exact(*gpu, batchlm::testing::read_reference("generate.json"),
                                                        n_vocab, print, "gpu vs llama.cpp");
    std::printf("[ note ] gpu against llama.cpp: top 5 logits within %.4f; %d of %d steps take another token "
                "(largest llama.cpp margin among them %.3f)\n",
                l.top_error, l.differing, l.steps, l.differing_margin);
  }
}

}  // namespace
}  // namespace batchlm::local_engine
