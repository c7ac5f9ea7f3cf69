// The executor seam: the choice of device, and the CPU executor against Model::forward_batch.
// (The CUDA executor against the CPU one is in tests/gpu.)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/batch_engine.hpp"
#include "batchlm/local_engine/executor.hpp"
#include "batchlm/local_engine/gguf.hpp"
#include "batchlm/local_engine/model.hpp"
#include "gguf_writer.hpp"
#include "requantize.hpp"

namespace batchlm::local_engine {
namespace {

namespace fs = std::filesystem;

class ExecutorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string tmpl = (fs::temp_directory_path() / "batchlm-executor-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = new fs::path(tmpl);
    batchlm::testing::TinyLlamaOptions o;
    o.n_layers = 3;
    o.context_length = 256;
    batchlm::testing::write_tiny_llama(*dir_ / "tiny.gguf", o);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static std::shared_ptr<const Model> model() { return Model::load(*dir_ / "tiny.gguf"); }

  static bool gpu_here() {
    std::string why;
    auto ex = make_executor(model(), {.device = Device::kAuto, .threads = 1}, &why);
    return ex->device() == Device::kCuda;
  }

  static inline fs::path* dir_ = nullptr;
};

TEST_F(ExecutorTest, ParsesDeviceNames) {
  EXPECT_EQ(parse_device("auto"), Device::kAuto);
  EXPECT_EQ(parse_device("cpu"), Device::kCpu);
  EXPECT_EQ(parse_device("cuda"), Device::kCuda);
  EXPECT_FALSE(parse_device("gpu"));
  EXPECT_FALSE(parse_device("CUDA"));
  for (Device d : {Device::kAuto, Device::kCpu, Device::kCuda}) EXPECT_EQ(parse_device(to_string(d)), d);
}

TEST_F(ExecutorTest, AutoFallsBackToTheCpuAndSaysWhy) {
  std::string why = "stale";
  auto ex = make_executor(model(), {.device = Device::kAuto, .threads = 1}, &why);
  if (ex->device() == Device::kCuda) {
    EXPECT_TRUE(why.empty());
    GTEST_SKIP() << "a GPU is present: " << ex->describe();
  }
  EXPECT_EQ(ex->device(), Device::kCpu);
  EXPECT_FALSE(why.empty());
  if (!built_with_cuda()) {
    EXPECT_NE(why.find("no CUDA support"), std::string::npos) << why;
  }
  EXPECT_NE(ex->describe().find("cpu"), std::string::npos) << ex->describe();
  EXPECT_FALSE(ex->samples_on_device());
}

TEST_F(ExecutorTest, CudaWithoutAGpuIsAnErrorThatSaysWhy) {
  if (gpu_here()) GTEST_SKIP() << "a GPU is present";
  try {
    make_executor(model(), {.device = Device::kCuda, .threads = 1});
    FAIL() << "no error";
  } catch (const DeviceUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find("device 'cuda' was asked for, but "), std::string::npos) << e.what();
  }
  // The engine passes the error on before allocating anything.
  LocalBackendOptions o;
  o.device = Device::kCuda;
  o.threads = 1;
  o.context = 128;
  EXPECT_THROW(BatchEngine(model(), o), DeviceUnavailable);
}

// The GPU kernels take every weight type the loader does (the K and 5-bit ones too): a model
// of K-type matrices goes where the default model goes under kAuto, for the same reason.
TEST_F(ExecutorTest, AModelOfKTypesGoesWhereTheDefaultModelGoes) {
  batchlm::testing::TinyLlamaOptions o;
  o.n_layers = 2;
  o.n_embd = 256;
  o.n_ff = 256;
  o.context_length = 128;
  o.weight_dtype = kernels::DType::Q4_K;
  o.v_up_dtype = kernels::DType::Q6_K;
  batchlm::testing::write_tiny_llama(*dir_ / "k.gguf", o);
  const auto m = Model::load(*dir_ / "k.gguf");
  std::string why, default_why;
  auto ex = make_executor(m, {.device = Device::kAuto, .threads = 1}, &why);
  auto reference = make_executor(model(), {.device = Device::kAuto, .threads = 1}, &default_why);
  EXPECT_EQ(ex->device(), reference->device());
  EXPECT_EQ(why, default_why);
  EXPECT_EQ(why.find("do not take"), std::string::npos) << why;
  if (!built_with_cuda()) {
    EXPECT_NE(why.find("no CUDA support"), std::string::npos) << why;
  }
}

// Rows the GPU kernels cannot read (here attn_output's 5 heads of 40 values: 200) leave `auto`
// on the CPU, saying which matrix, before any GPU is looked for; `cuda` refuses with the same
// words.
TEST_F(ExecutorTest, RowsTheGpuCannotReadStayOnTheCpu) {
  batchlm::testing::TinyLlamaOptions o;
  o.n_layers = 1;
  o.n_heads = 5;
  o.n_kv_heads = 1;
  o.head_dim = 40;
  o.context_length = 128;
  batchlm::testing::write_tiny_llama(*dir_ / "w200.gguf", o);
  const auto m = Model::load(*dir_ / "w200.gguf");
  std::string why;
  auto ex = make_executor(m, {.device = Device::kAuto, .threads = 1}, &why);
  EXPECT_EQ(ex->device(), Device::kCpu);
  if (!built_with_cuda()) {
    EXPECT_NE(why.find("no CUDA support"), std::string::npos) << why;
    return;
  }
  EXPECT_EQ(why, "the GPU kernels take rows of a multiple of 32 values, and this model's attn_output rows hold 200");
  try {
    make_executor(m, {.device = Device::kCuda, .threads = 1});
    FAIL() << "no error";
  } catch (const DeviceUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find("device 'cuda' was asked for, but " + why), std::string::npos) << e.what();
  }
}

// The GPU holds Q6_K matrices in F16: a value past its range (here 1e6 in attn_v) is found by
// the upload, which leaves `auto` on the CPU with that reason; `cuda` refuses with it. Without
// a GPU, the reason is that there is none, found first.
TEST_F(ExecutorTest, AQ6KValuePastF16sRangeStaysOnTheCpu) {
  batchlm::testing::TinyLlamaOptions o;
  o.n_layers = 1;
  o.n_embd = 256;
  o.n_ff = 256;
  o.context_length = 128;
  o.v_up_dtype = kernels::DType::Q6_K;
  batchlm::testing::write_tiny_llama(*dir_ / "q6.gguf", o);
  const std::string name = "blk.0.attn_v.weight";
  {
    const auto f = gguf::File::open(*dir_ / "q6.gguf");
    const std::vector<std::int64_t> shape = f.tensor(name).shape;
    std::vector<float> values(f.tensor(name).n_elements, 0.01f);
    values[7] = 1e6f;
    batchlm::testing::write_file(
        *dir_ / "q6-big.gguf",
        batchlm::testing::edit(f, {.drop = [&](const std::string& n) { return n == name; },
                                   .add = [&](batchlm::testing::GgufWriter& w) {
                                     w.add_tensor(name, kernels::DType::Q6_K, shape, values);
                                   }}));
  }
  const auto m = Model::load(*dir_ / "q6-big.gguf");
  ASSERT_EQ(m->config().n_embd, 256);
  std::string why;
  auto ex = make_executor(m, {.device = Device::kAuto, .threads = 1}, &why);
  EXPECT_EQ(ex->device(), Device::kCpu);
  EXPECT_FALSE(why.empty());
  if (!gpu_here()) {
    EXPECT_EQ(why.find("F16"), std::string::npos) << why;
    return;
  }
  EXPECT_NE(why.find("the GPU could not take the model: "), std::string::npos) << why;
  EXPECT_NE(why.find("a Q6_K value ("), std::string::npos) << why;
  EXPECT_NE(why.find("is past F16's range"), std::string::npos) << why;
  try {
    make_executor(m, {.device = Device::kCuda, .threads = 1});
    FAIL() << "no error";
  } catch (const DeviceUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find("device 'cuda' was asked for, but " + why), std::string::npos) << e.what();
  }
}

TEST_F(ExecutorTest, CpuExecutorIsModelForwardBatch) {
  const auto m = model();
  const ModelConfig& c = m->config();
  auto ex = make_executor(m, {.device = Device::kCpu, .threads = 2});
  EXPECT_THROW(ex->forward(Batch{}, {}), std::logic_error);  // no pool yet
  ex->allocate_pool(16, 8);
  EXPECT_EQ(ex->n_blocks(), 8);
  EXPECT_THROW(ex->allocate_pool(16, 8), std::logic_error);
  KvStore store(c, 16, 8);
  kernels::ThreadPool threads(2);

  // Two sequences, one prefilling 20 tokens over two blocks (shuffled ids), one of 3 tokens.
  const std::vector<Token> tokens = [&] {
    std::vector<Token> t(23);
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<Token>((i * 7 + 3) % c.n_vocab);
    return t;
  }();
  std::vector<std::int32_t> positions(23), sequence_of(23);
  for (int i = 0; i < 20; ++i) positions[i] = i, sequence_of[i] = 0;
  for (int i = 20; i < 23; ++i) positions[i] = i - 20, sequence_of[i] = 1;
  const std::vector<std::int32_t> t0 = {5, 2}, t1 = {7};
  const std::vector<std::span<const std::int32_t>> tables = {t0, t1};
  const std::vector<std::int32_t> rows = {3, 19, 22};
  const Batch batch{tokens, positions, sequence_of, tables, rows};

  std::vector<float> expected(rows.size() * c.n_vocab), got(expected.size(), -1.0f);
  m->forward_batch(batch, store.pool(), expected, threads);
  ex->forward(batch, got);
  EXPECT_EQ(got, expected);

  // An inconsistent batch is refused as Model::forward_batch refuses it.
  const std::vector<std::int32_t> far = {200};
  const std::vector<std::int32_t> one_seq = {0};
  const std::vector<Token> one_token = {1};
  EXPECT_THROW(ex->forward(Batch{one_token, far, one_seq, tables, one_seq}, got), std::invalid_argument);
  // It has no device sampling.
  const RowSampling greedy{};
  Token out = 0;
  EXPECT_THROW(ex->forward_sample(batch, std::span(&greedy, 1), std::span(&out, 1)), std::logic_error);
}

TEST_F(ExecutorTest, LayersRunOnlyTheFirstLayers) {
  const auto m = model();
  const ModelConfig& c = m->config();
  auto ex = make_executor(m, {.device = Device::kCpu, .threads = 1, .layers = 1});
  ex->allocate_pool(16, 4);
  KvStore store(c, 16, 4, 1);
  kernels::ThreadPool threads(1);
  const std::vector<Token> tokens = {1, 2, 3, 4, 5};
  std::vector<std::int32_t> positions(5), sequence_of(5, 0);
  std::iota(positions.begin(), positions.end(), 0);
  const std::vector<std::int32_t> t0 = {3};
  const std::vector<std::span<const std::int32_t>> tables = {t0};
  const std::vector<std::int32_t> rows = {4};
  Batch batch{tokens, positions, sequence_of, tables, rows};
  std::vector<float> got(c.n_vocab), early(c.n_vocab), full(c.n_vocab);
  ex->forward(batch, got);  // the executor's own layer count, whatever the batch says
  batch.layers = 1;
  m->forward_batch(batch, store.pool(), early, threads);
  EXPECT_EQ(got, early);
  KvStore all(c, 16, 4);
  batch.layers = 0;
  m->forward_batch(batch, all.pool(), full, threads);
  EXPECT_NE(got, full);
}

TEST_F(ExecutorTest, EngineReportsItsDevice) {
  LocalBackendOptions o;
  o.device = Device::kCpu;
  o.threads = 1;
  o.context = 128;
  BatchEngine engine(model(), o);
  EXPECT_EQ(engine.device().rfind("cpu (", 0), 0u) << engine.device();
  EXPECT_EQ(engine.device().find("no GPU"), std::string::npos) << engine.device();
}

// A block copied over another holds the same keys and values in every layer: a token that reads
// the copy gets the logits it gets from the original.
TEST_F(ExecutorTest, CopiedBlocksReadAsTheOriginals) {
  const auto m = model();
  const ModelConfig& c = m->config();
  auto ex = make_executor(m, {.device = Device::kCpu, .threads = 2});
  ex->allocate_pool(4, 8);
  std::vector<Token> tokens = {5, 9, 2, 7, 11, 3};
  std::vector<std::int32_t> positions = {0, 1, 2, 3, 4, 5}, sequence_of(6, 0);
  const std::vector<std::int32_t> original = {3, 6};
  std::vector<std::span<const std::int32_t>> tables = {original};
  const std::vector<std::int32_t> last = {5};
  std::vector<float> expected(c.n_vocab), got(c.n_vocab, -1.0f);
  ex->forward(Batch{tokens, positions, sequence_of, tables, last}, expected);

  const BlockCopy copies[] = {{3, 1}, {6, 4}};
  ex->copy_blocks(copies);
  // The last token again, over the copies: its keys and values are rewritten in block 4.
  const std::vector<std::int32_t> copied = {1, 4};
  tables = {copied};
  const std::vector<Token> one = {tokens[5]};
  const std::vector<std::int32_t> at = {5}, first = {0};
  ex->forward(Batch{one, at, first, tables, first}, got);
  EXPECT_EQ(got, expected);

  const BlockCopy outside[] = {{2, 8}};
  EXPECT_THROW(ex->copy_blocks(outside), std::out_of_range);
  auto bare = make_executor(m, {.device = Device::kCpu, .threads = 1});
  EXPECT_THROW(bare->copy_blocks(copies), std::logic_error);  // no pool yet
}

// A prompt that shares 21 tokens with an earlier one takes 16 from a cached block and 5 from a
// copy of the next, and generates what an engine that computed everything generates.
TEST_F(ExecutorTest, EngineTakesPartOfABlockFromTheCacheAndGeneratesTheSame) {
  LocalBackendOptions o;
  o.device = Device::kCpu;
  o.threads = 2;
  o.context = 128;
  GenerateParams params;
  params.max_tokens = 8;
  params.sampling.temperature = 0;
  params.ignore_eos = true;
  const auto n_vocab = static_cast<std::size_t>(model()->config().n_vocab);
  std::vector<Token> earlier(40), later;
  for (std::size_t i = 0; i < earlier.size(); ++i) earlier[i] = static_cast<Token>((40 + 7 * i) % n_vocab);
  later.assign(earlier.begin(), earlier.begin() + 21);
  for (std::size_t i = 0; i < 12; ++i) later.push_back(static_cast<Token>((9 + 5 * i) % n_vocab));

  const auto run = [&](BatchEngine& engine, const std::vector<Token>& prompt) {
    engine.add(prompt, params, nullptr);
    while (!engine.idle()) engine.step();
    auto finished = engine.take_finished();
    EXPECT_EQ(finished.size(), 1u);
    return finished.empty() ? GenerateResult{} : finished[0].second;
  };
  BatchEngine warm(model(), o);
  run(warm, earlier);
  const EngineStats before = warm.stats();
  const GenerateResult reused = run(warm, later);
  const EngineStats after = warm.stats();
  EXPECT_EQ(after.prompt_tokens_cached - before.prompt_tokens_cached, 21);
  EXPECT_EQ(after.prompt_tokens_computed - before.prompt_tokens_computed, 12);

  BatchEngine fresh(model(), o);
  // A token id outside the vocabulary is refused when the request is added, not in a step.
  std::vector<Token> bad = later;
  bad[3] = static_cast<Token>(n_vocab);
  EXPECT_THROW(fresh.add(bad, params, nullptr), RequestRejected);
  bad[3] = -1;
  EXPECT_THROW(fresh.add(bad, params, nullptr), RequestRejected);
  const GenerateResult computed = run(fresh, later);
  EXPECT_EQ(fresh.stats().prompt_tokens_cached, 0);
  ASSERT_EQ(reused.tokens.size(), 8u);
  EXPECT_EQ(reused.tokens, computed.tokens);
  EXPECT_EQ(reused.text, computed.text);
}

// A prompt the context cannot hold is refused, naming the model's own context where the
// engine's is set lower (a setting can raise it), and only then.
TEST_F(ExecutorTest, PromptPastTheContextNamesTheModelsOwnWhereItIsLarger) {
  LocalBackendOptions o;
  o.device = Device::kCpu;
  o.threads = 1;
  o.context = 64;
  const std::int64_t own = model()->config().n_ctx_train;
  ASSERT_GT(own, 64);
  BatchEngine engine(model(), o);
  GenerateParams params;
  try {
    engine.add(std::vector<Token>(64, 42), params, nullptr);
    ADD_FAILURE() << "a 64-token prompt fit a 64-token context";
  } catch (const RequestRejected& e) {
    EXPECT_EQ(e.code, "context_length_exceeded");
    EXPECT_EQ(std::string(e.what()), "the prompt has 64 tokens; the context holds 64 tokens (the model's own holds " +
                                         std::to_string(own) + "), which leaves no room to generate");
  }
  o.context = own;
  BatchEngine full(model(), o);
  try {
    full.add(std::vector<Token>(static_cast<std::size_t>(own), 42), params, nullptr);
    ADD_FAILURE() << "a prompt as long as the context fit it";
  } catch (const RequestRejected& e) {
    EXPECT_EQ(std::string(e.what()),
              "the prompt has " + std::to_string(own) + " tokens; the context holds " + std::to_string(own) +
                  " tokens, which leaves no room to generate");
  }
}

// The engine's path for an executor that samples on the device, run on the CPU: the wrapped
// executor's logits, each row's argmax as its token, and -1 for a row with a NaN or an
// infinity, as the CUDA sampler gives.
class SamplesOnDevice final : public Executor {
 public:
  SamplesOnDevice(std::unique_ptr<Executor> inner, std::int64_t n_vocab) : inner_(std::move(inner)), n_vocab_(n_vocab) {}
  std::string describe() const override { return inner_->describe(); }
  Device device() const override { return inner_->device(); }
  std::int64_t pool_memory_available() const override { return inner_->pool_memory_available(); }
  void allocate_pool(std::int64_t block_size, std::int64_t n_blocks) override { inner_->allocate_pool(block_size, n_blocks); }
  std::int64_t n_blocks() const override { return inner_->n_blocks(); }
  void copy_blocks(std::span<const BlockCopy> copies) override { inner_->copy_blocks(copies); }
  void forward(const Batch& batch, std::span<float> logits) override { inner_->forward(batch, logits); }
  bool samples_on_device() const override { return true; }
  void forward_sample(const Batch& batch, std::span<const RowSampling> sampling, std::span<Token> tokens) override {
    std::vector<float> logits(sampling.size() * static_cast<std::size_t>(n_vocab_));
    inner_->forward(batch, logits);
    ++sampled_passes;
    for (std::size_t i = 0; i < sampling.size(); ++i) {
      const SamplingParams& p = sampling[i].params;
      if (p.temperature > 0.0f && p.top_k != 1) ADD_FAILURE() << "the stand-in only picks the argmax";
      const std::span<const float> row(logits.data() + i * static_cast<std::size_t>(n_vocab_), static_cast<std::size_t>(n_vocab_));
      tokens[i] = broken_logits(row) ? -1 : static_cast<Token>(kernels::argmax(row.data(), n_vocab_));
    }
  }
  kernels::ThreadPool& threads() override { return inner_->threads(); }

  int sampled_passes = 0;

 private:
  std::unique_ptr<Executor> inner_;
  std::int64_t n_vocab_;
};

// A forward pass that yields NaN (here: one token's embedding row is NaN) fails the requests it
// reaches, with an error, and no other: the sampler had no token to draw and the process
// crashed, or a greedy pick silently took token 0. The same where the device samples.
TEST_F(ExecutorTest, NotANumberInTheOutputFailsThatRequestAlone) {
  constexpr Token kPoisoned = 7;
  const fs::path path = *dir_ / "nan.gguf";
  {
    // The row's bytes as the loader sees them, found in the file and overwritten.
    const gguf::File file = gguf::File::open(*dir_ / "tiny.gguf");
    const gguf::TensorInfo& embd = file.tensor("token_embd.weight");
    ASSERT_EQ(embd.type, kernels::DType::F32);
    const auto row_bytes = static_cast<std::size_t>(embd.cols()) * sizeof(float);
    const std::string row(reinterpret_cast<const char*>(embd.data) + kPoisoned * row_bytes, row_bytes);
    std::ifstream in(*dir_ / "tiny.gguf", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::size_t at = bytes.find(row);
    ASSERT_NE(at, std::string::npos);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (std::size_t i = 0; i < row_bytes; i += sizeof(float)) std::memcpy(bytes.data() + at + i, &nan, sizeof(float));
    std::ofstream(path, std::ios::binary) << bytes;
  }
  const std::shared_ptr<const Model> broken = Model::load(path);
  LocalBackendOptions o;
  o.device = Device::kCpu;
  o.threads = 1;
  std::vector<Token> fine_tokens;  // greedy, sampled on the host
  for (const bool on_device : {false, true})
  for (const float temperature : {0.0f, 0.8f}) {
    if (on_device && temperature > 0.0f) continue;  // the stand-in picks the argmax only
    SCOPED_TRACE(std::string(on_device ? "sampled on the device" : "sampled on the host") + ", temperature " +
                 std::to_string(temperature));
    SamplesOnDevice* device = nullptr;
    BatchEngine engine(broken, o, [&](std::unique_ptr<Executor> inner) -> std::unique_ptr<Executor> {
      if (!on_device) return inner;
      auto wrapped = std::make_unique<SamplesOnDevice>(std::move(inner), broken->config().n_vocab);
      device = wrapped.get();
      return wrapped;
    });
    GenerateParams params;
    params.max_tokens = 6;
    params.ignore_eos = true;
    params.sampling.temperature = temperature;
    const SequenceId fine = engine.add({42, 43, 44}, params, nullptr);
    const SequenceId poisoned = engine.add({42, kPoisoned, 44}, params, nullptr);
    while (!engine.idle()) engine.step();
    const auto finished = engine.take_finished();
    ASSERT_EQ(finished.size(), 2u);
    EXPECT_NE(finished[0].first, finished[1].first);
    for (const auto& [id, result] : finished) {
      if (id == fine) {
        EXPECT_EQ(result.finish_reason, "length");
        EXPECT_EQ(result.tokens.size(), 6u);
        EXPECT_TRUE(result.error.empty());
        // The device's greedy picks are the host's.
        if (!on_device && temperature == 0.0f) fine_tokens = result.tokens;
        if (on_device) {
          EXPECT_EQ(result.tokens, fine_tokens);
        }
      } else {
        EXPECT_EQ(id, poisoned);
        EXPECT_EQ(result.finish_reason, "error");
        EXPECT_EQ(result.error,
                  "the model's output is not a number (NaN or infinity) at generated token 1: its weights or settings "
                  "(rope base, norm epsilon) do not work");
      }
    }
    if (on_device) {
      EXPECT_EQ(device->sampled_passes, 6);  // every step took the device path
    }
  }
  EXPECT_TRUE(broken_logits(std::vector<float>{0.0f, std::numeric_limits<float>::infinity()}));
  EXPECT_TRUE(broken_logits(std::vector<float>{0.0f, -std::numeric_limits<float>::infinity()}));
  EXPECT_TRUE(broken_logits(std::vector<float>{std::numeric_limits<float>::quiet_NaN(), 0.0f}));
  EXPECT_FALSE(broken_logits(std::vector<float>{0.0f, -3.4e38f, 3.4e38f, 1e-45f}));
}

// Where the device samples, what only the CPU's sampler applies is refused by name, first in
// the engine's order, and the rest is taken (the GPU's own test covers a real device).
TEST_F(ExecutorTest, WhereTheDeviceSamplesCpuSamplingIsRefusedByName) {
  const auto m = model();
  LocalBackendOptions o;
  o.device = Device::kCpu;
  o.threads = 1;
  o.context = 128;
  BatchEngine engine(m, o, [&](std::unique_ptr<Executor> inner) -> std::unique_ptr<Executor> {
    return std::make_unique<SamplesOnDevice>(std::move(inner), m->config().n_vocab);
  });
  ASSERT_TRUE(engine.samples_on_device());
  const std::string where = " on the CPU only, and this engine samples on the GPU (serve --device cpu, or a job's "
                            "backend.device: cpu, runs them)";
  const auto refusal = [&](const GenerateParams& p) {
    try {
      engine.add({1, 2, 3}, p, nullptr);
    } catch (const RequestRejected& e) {
      return e.code + ": " + e.what();
    }
    return std::string("<taken>");
  };
  GenerateParams plain;
  plain.max_tokens = 2;
  GenerateParams penalized = plain;
  penalized.sampling.frequency_penalty = 0.5f;
  penalized.sampling.min_p = 0.1f;
  EXPECT_EQ(refusal(penalized),
            "unsupported_parameter: 'presence_penalty', 'frequency_penalty': penalties are applied" + where);
  GenerateParams repeats = plain;
  repeats.sampling.repetition_penalty = 1.2f;
  repeats.sampling.min_p = 0.1f;
  EXPECT_EQ(refusal(repeats), "unsupported_parameter: 'repetition_penalty': penalties are applied" + where);
  GenerateParams min_p = plain;
  min_p.sampling.min_p = 0.1f;
  min_p.json_object = true;
  EXPECT_EQ(refusal(min_p), "unsupported_parameter: 'min_p': min-p is applied" + where);
  GenerateParams least = plain;
  least.sampling.min_tokens = 2;
  least.logprobs = 1;
  EXPECT_EQ(refusal(least), "unsupported_parameter: 'min_tokens': the end of the turn is held back" + where);
  GenerateParams bad = plain;
  bad.sampling.bad_words = {{5, 6}};
  EXPECT_EQ(refusal(bad), "unsupported_parameter: 'bad_words': bad words are held back" + where);
  GenerateParams stop_ids = plain;
  stop_ids.stop_token_ids = {7};  // checked on the host as tokens come: taken
  EXPECT_EQ(refusal(stop_ids), "<taken>");
  GenerateParams json_mode = plain;
  json_mode.json_object = true;
  EXPECT_EQ(refusal(json_mode), "unsupported_parameter: 'response_format': JSON mode is applied" + where);
  EXPECT_EQ(refusal(plain), "<taken>");
}

// A max_tokens the context has no room for is shortened to the room, or, asked to be taken as
// a limit to honour (a client's, in serve), refused when the request is added.
TEST_F(ExecutorTest, MaxTokensPastTheContextIsShortenedOrRefused) {
  LocalBackendOptions o;
  o.device = Device::kCpu;
  o.threads = 1;
  o.context = 64;
  GenerateParams params;
  params.max_tokens = 60;
  params.sampling.temperature = 0;
  params.ignore_eos = true;
  const std::vector<Token> prompt(10, 42);
  BatchEngine engine(model(), o);
  params.refuse_past_context = true;
  try {
    engine.add(prompt, params, nullptr);
    ADD_FAILURE() << "60 tokens after a 10-token prompt fit a 64-token context";
  } catch (const RequestRejected& e) {
    EXPECT_EQ(e.code, "context_length_exceeded");
    EXPECT_STREQ(e.what(),
                 "'max_tokens': the context holds 64 tokens and the prompt has 10, which leaves room for 54 more, "
                 "not 60");
  }
  EXPECT_TRUE(engine.idle());
  params.max_tokens = 54;  // exactly the room: accepted
  engine.add(prompt, params, nullptr);
  while (!engine.idle()) engine.step();
  auto finished = engine.take_finished();
  ASSERT_EQ(finished.size(), 1u);
  EXPECT_EQ(finished[0].second.tokens.size(), 54u);
  params.refuse_past_context = false;  // shortened to the room
  params.max_tokens = 60;
  engine.add(prompt, params, nullptr);
  while (!engine.idle()) engine.step();
  finished = engine.take_finished();
  ASSERT_EQ(finished.size(), 1u);
  EXPECT_EQ(finished[0].second.tokens.size(), 54u);
  EXPECT_EQ(finished[0].second.finish_reason, "length");
}

TEST(KvPoolSize, DeviceMemoryIsTakenWhole) {
  LocalBackendOptions o;
  o.max_sequences = 4;
  // On the CPU: max_sequences contexts, within a quarter of what is available.
  EXPECT_EQ(kv_pool_tokens(o, 1000, 100, 1'000'000'000, false), 4000);
  EXPECT_EQ(kv_pool_tokens(o, 1000, 100, 1'000'000, false), 2500);
  // In a GPU's memory: all that the weights left, never less than one context.
  EXPECT_EQ(kv_pool_tokens(o, 1000, 100, 1'000'000'000, true), 10'000'000);
  EXPECT_EQ(kv_pool_tokens(o, 1000, 100, 1'000, true), 1000);
  // Explicit sizes win either way.
  o.kv_tokens = 5000;
  EXPECT_EQ(kv_pool_tokens(o, 1000, 100, 1'000'000'000, true), 5000);
}

}  // namespace
}  // namespace batchlm::local_engine
