// The `batchlm` executable on the embedded engine: `generate` and `inspect` on a random-weight
// tiny Llama written into the test's directory (write_tiny_llama), `run` with a local backend,
// the errors for missing and broken models; and, when it has been fetched, the real default
// model (skipped otherwise).

#include <algorithm>
#include <cctype>
#include <cstring>
#include <limits>
#include <set>

#include "gguf_writer.hpp"
#include <thread>

#include "harness.hpp"

namespace batchlm::e2e {
namespace {

const fs::path kRealModel = fs::path(BATCHLM_SOURCE_DIR) / "models/SmolLM2-135M-Instruct.Q4_1.gguf";

// The last line of `text` that parses as a JSON object.
std::optional<json> last_json_line(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  std::optional<json> found;
  while (std::getline(in, line)) {
    if (line.empty() || line.front() != '{') continue;
    try {
      found = json::parse(line);
    } catch (const std::exception&) {
    }
  }
  return found;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A temporary directory holding tiny.gguf.
class EngineCli : public ::testing::Test {
 protected:
  void SetUp() override { info_ = batchlm::testing::write_tiny_llama(dir_.path / "tiny.gguf"); }
  const fs::path& dir() const { return dir_.path; }
  // long.gguf: the tiny model with 1,024 positions. Its vocabulary spends about a token per
  // character, so a GSM8K question needs more than tiny.gguf's 256.
  void write_long_model() const {
    batchlm::testing::TinyLlamaOptions options;
    options.context_length = 1024;
    batchlm::testing::write_tiny_llama(dir() / "long.gguf", options);
  }

  RunResult generate(std::vector<std::string> extra) {
    std::vector<std::string> args = {"generate", "-m", "tiny.gguf"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_batchlm(dir(), args);
  }

  TempDir dir_;
  batchlm::testing::TinyLlamaInfo info_;
};

// ---- generate ----------------------------------------------------------------------------------

// --device as backend.device: cpu runs there, with the text auto gives on a machine without a
// GPU; cuda runs on a GPU or is refused naming the flag and the reason; the timings say where.
TEST_F(EngineCli, GenerateRunsWhereDeviceSays) {
  RunResult cpu = generate({"-p", "Hello", "-n", "8", "--temperature", "0", "--ignore-eos", "--device", "cpu",
                            "--timings"});
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  const std::optional<json> timings = last_json_line(cpu.err);
  ASSERT_TRUE(timings) << cpu.err;
  EXPECT_EQ((*timings)["device"].get<std::string>().rfind("cpu (", 0), 0u) << timings->dump();
  RunResult automatic = generate({"-p", "Hello", "-n", "8", "--temperature", "0", "--ignore-eos", "--timings"});
  ASSERT_EQ(automatic.exit_code, 0) << automatic.err;
  const std::optional<json> where = last_json_line(automatic.err);
  ASSERT_TRUE(where) << automatic.err;
  if ((*where)["device"].get<std::string>().rfind("cpu (", 0) == 0) {
    EXPECT_EQ(automatic.out, cpu.out);
  }
  RunResult cuda = generate({"-p", "Hello", "-n", "2", "--device", "cuda", "--timings"});
  if (cuda.exit_code == 0) {
    EXPECT_EQ(last_json_line(cuda.err).value_or(json())["device"].get<std::string>().rfind("cuda: ", 0), 0u) << cuda.err;
  } else {
    EXPECT_EQ(cuda.exit_code, 2);
    EXPECT_EQ(cuda.err.rfind("batchlm: error: --device: device 'cuda' was asked for, but ", 0), 0u) << cuda.err;
    EXPECT_TRUE(cuda.out.empty()) << cuda.out;
  }
  RunResult bad = generate({"-p", "Hello", "--device", "gpu"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--device"), std::string::npos) << bad.err;
}

// A forward pass that gives no numbers (here the file's last quarter of weights is NaN) is an
// error, said, with exit 2: not an answer cut short that exits 0.
TEST_F(EngineCli, GenerateSaysWhenTheModelsOutputIsNotANumber) {
  std::string bytes = read_file(dir() / "tiny.gguf");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // The data section ends the file, 4-byte aligned floats to its end.
  for (std::size_t at = bytes.size() - bytes.size() / 16 * 4; at + sizeof nan <= bytes.size(); at += sizeof nan)
    std::memcpy(bytes.data() + at, &nan, sizeof nan);
  write_file(dir() / "nan.gguf", bytes);
  RunResult r = run_batchlm(dir(), {"generate", "-m", "nan.gguf", "-p", "Hello", "-n", "8", "--temperature", "0",
                                    "--device", "cpu"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err.rfind("batchlm: error: the model's output is not a number (NaN or infinity) at generated token 1", 0),
            0u)
      << r.err;
}

TEST_F(EngineCli, GenerateGreedyPrintsTextAndTimings) {
  RunResult r = generate({"-p", "Hello", "-n", "8", "--temperature", "0", "--ignore-eos", "--timings"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.back(), '\n');
  const std::optional<json> timings = last_json_line(r.err);
  ASSERT_TRUE(timings) << r.err;
  EXPECT_EQ((*timings)["generated_tokens"], 8) << timings->dump();
  EXPECT_EQ((*timings)["decode_steps"], 7) << timings->dump();
  EXPECT_EQ((*timings)["finish_reason"], "length") << timings->dump();
  EXPECT_GT((*timings)["prompt_tokens"].get<long long>(), 0) << timings->dump();
  EXPECT_GE((*timings)["generate_ms"].get<double>(), 0.0) << timings->dump();
  EXPECT_TRUE((*timings)["simd"].is_string()) << timings->dump();
  EXPECT_GT((*timings)["generate_tok_s"].get<double>(), 0.0) << timings->dump();

  // One token comes with the prompt: no decode step, so no generation rate to report.
  RunResult one = generate({"-p", "Hello", "-n", "1", "--temperature", "0", "--timings"});
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const std::optional<json> one_timings = last_json_line(one.err);
  ASSERT_TRUE(one_timings) << one.err;
  EXPECT_TRUE((*one_timings)["generate_tok_s"].is_null()) << one_timings->dump();

  // A context beyond the model's training is lowered to it, with a note.
  RunResult wide = generate({"-p", "Hello", "-n", "2", "--temperature", "0", "--context", "100000000"});
  ASSERT_EQ(wide.exit_code, 0) << wide.err;
  EXPECT_NE(wide.err.find("--context 100000000 is beyond the longest context this model runs at"), std::string::npos) << wide.err;

  // Without --timings, no JSON on stderr.
  RunResult quiet = generate({"-p", "Hello", "-n", "8", "--temperature", "0", "--ignore-eos"});
  ASSERT_EQ(quiet.exit_code, 0) << quiet.err;
  EXPECT_FALSE(last_json_line(quiet.err)) << quiet.err;
  EXPECT_EQ(quiet.out, r.out);
}

TEST_F(EngineCli, GenerateIsReproducible) {
  const std::vector<std::string> greedy = {"-p", "Hello", "-n", "8", "--temperature", "0", "--ignore-eos"};
  RunResult first = generate(greedy);
  RunResult second = generate(greedy);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_EQ(first.out, second.out);
  // More threads than the machine runs at once are lowered to what it runs, with a note: the
  // same tokens.
  const int hardware = static_cast<int>(std::thread::hardware_concurrency());
  std::vector<std::string> crowded = greedy;
  crowded.insert(crowded.end(), {"-t", std::to_string(hardware + 3)});
  RunResult many = generate(crowded);
  ASSERT_EQ(many.exit_code, 0) << many.err;
  EXPECT_EQ(many.out, first.out);
  EXPECT_NE(many.err.find(std::to_string(hardware + 3) + " compute threads asked for"), std::string::npos) << many.err;

  // Sampling with a seed is reproducible too, and the seed matters.
  auto sampled = [&](const std::string& seed, const std::string& top_k = "0") {
    RunResult r = generate({"-p", "Hello", "-n", "16", "--temperature", "1.5", "--top-k", top_k,
                            "--top-p", "1", "--ignore-eos", "--seed", seed});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.out;
  };
  EXPECT_EQ(sampled("5"), sampled("5"));
  EXPECT_EQ(sampled("5", "-1"), sampled("5"));  // -1 is no limit too, as top_k in a request
  std::set<std::string> outputs;
  for (const char* seed : {"1", "2", "3"}) outputs.insert(sampled(seed));
  EXPECT_GE(outputs.size(), 2u);
}

TEST_F(EngineCli, GenerateChatAppliesTheTemplate) {
  RunResult raw = generate({"-p", "Hello", "-n", "4", "--temperature", "0", "--ignore-eos", "--timings"});
  RunResult chat = generate({"--chat", "-p", "Hello", "-n", "4", "--temperature", "0", "--ignore-eos",
                             "--timings"});
  RunResult system = generate({"--chat", "--system", "Be brief.", "-p", "Hello", "-n", "4",
                               "--temperature", "0", "--ignore-eos", "--timings"});
  for (const RunResult* r : {&raw, &chat, &system}) {
    ASSERT_EQ(r->exit_code, 0) << r->err;
    ASSERT_TRUE(last_json_line(r->err)) << r->err;
    EXPECT_FALSE(r->out.empty());
  }
  // "Hello" is one token; the template wraps it in <|im_start|>user\n ... <|im_start|>assistant\n.
  const auto prompt_tokens = [](const RunResult& r) {
    return (*last_json_line(r.err))["prompt_tokens"].get<long long>();
  };
  EXPECT_EQ(prompt_tokens(raw), 1);
  EXPECT_GT(prompt_tokens(chat), prompt_tokens(raw) + 5);
  EXPECT_GT(prompt_tokens(system), prompt_tokens(chat) + 3);
}

TEST_F(EngineCli, GenerateStopsBeforeAStopString) {
  RunResult free_run = generate({"-p", "Hello", "-n", "24", "--temperature", "0", "--ignore-eos"});
  ASSERT_EQ(free_run.exit_code, 0) << free_run.err;
  const std::string text = free_run.out.substr(0, free_run.out.size() - 1);  // the newline added
  ASSERT_GE(text.size(), 10u) << text;
  // Three bytes of the greedy output that first occur after its start (the earliest such
  // position from the middle on): the same run hits them, after some text.
  std::size_t at = std::string::npos;
  for (std::size_t p = text.size() / 2; p > 0 && at == std::string::npos; --p)
    if (text.find(text.substr(p, 3)) == p) at = p;
  ASSERT_NE(at, std::string::npos) << json(text).dump();
  const std::string stop = text.substr(at, 3);
  RunResult stopped = generate({"-p", "Hello", "-n", "24", "--temperature", "0", "--ignore-eos",
                                "--timings", "--stop", stop});
  ASSERT_EQ(stopped.exit_code, 0) << stopped.err;
  const std::string before = text.substr(0, at);
  EXPECT_EQ(stopped.out, before.back() == '\n' ? before : before + "\n")
      << "text " << json(text).dump() << " stop " << json(stop).dump();
  EXPECT_EQ((*last_json_line(stopped.err))["finish_reason"], "stop");
}

// An answer that ends before any text (here a stop string its first byte matches) says so on
// stderr: an empty line alone reads as a failure. The prompt may be the one argument.
TEST_F(EngineCli, GenerateThatWritesNothingSaysWhy) {
  RunResult free_run = generate({"Hello", "-n", "8", "--temperature", "0", "--ignore-eos"});
  ASSERT_EQ(free_run.exit_code, 0) << free_run.err;
  ASSERT_GE(free_run.out.size(), 2u);
  EXPECT_FALSE(contains(free_run.err, "before writing anything")) << free_run.err;
  EXPECT_EQ(generate({"-p", "Hello", "-n", "8", "--temperature", "0", "--ignore-eos"}).out, free_run.out);
  RunResult empty = generate({"Hello", "-n", "8", "--temperature", "0", "--ignore-eos", "--stop",
                              free_run.out.substr(0, 1)});
  ASSERT_EQ(empty.exit_code, 0) << empty.err;
  EXPECT_EQ(empty.out, "");
  EXPECT_TRUE(contains(empty.err, "batchlm: note: the model ended the text before writing anything (an end token "
                                  "or a stop string came first); an instruction-tuned model answers a request with "
                                  "--chat"))
      << empty.err;
  // Both ways at once is one prompt too many.
  EXPECT_EQ(generate({"Hello", "-p", "Hi", "-n", "2"}).exit_code, 2);
}

// The context, not --max-tokens, ended the answer: a note says so, where before only the finish
// reason of --timings did.
TEST_F(EngineCli, GenerateCutByTheContextSaysSo) {
  RunResult r = generate({"-p", "the cat the cat", "--context", "32", "-n", "64", "--temperature", "0", "--ignore-eos"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "batchlm: note: the context (32 tokens) ended the answer after ")) << r.err;
  EXPECT_TRUE(contains(r.err, " of 64 tokens (the prompt has ")) << r.err;
  RunResult within = generate({"-p", "the cat the cat", "--context", "32", "-n", "8", "--temperature", "0", "--ignore-eos"});
  ASSERT_EQ(within.exit_code, 0) << within.err;
  EXPECT_FALSE(contains(within.err, "ended the answer")) << within.err;
}

TEST_F(EngineCli, GeneratePromptLongerThanTheContextIsAUsageError) {
  std::string words;
  for (int i = 0; i < 40; ++i) words += " the cat";
  RunResult r = generate({"-p", words, "--context", "32", "-n", "4"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "context")) << r.err;
}

TEST_F(EngineCli, GenerateWithoutAPromptIsAUsageError) {
  RunResult r = generate({"-n", "4"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "no prompt: give --prompt TEXT or --file PATH")) << r.err;
  // Given, but empty: said so (it read as not given); a chat's empty user turn is a prompt.
  r = generate({"-n", "4", "-p", ""});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "the prompt is empty")) << r.err;
  r = generate({"-n", "2", "-p", "", "--chat", "--temperature", "0"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "batchlm: warning: the prompt is empty: the user turn says nothing")) << r.err;
  EXPECT_FALSE(contains(generate({"-n", "2", "-p", "hi", "--chat", "--temperature", "0"}).err, "warning")) << r.err;
  // A seed is a 64-bit unsigned integer: -1 wrapped around, 2^64 saturated.
  for (const char* seed : {"-1", "18446744073709551616", "1e3"}) {
    r = generate({"-n", "2", "-p", "hi", "--seed", seed});
    EXPECT_EQ(r.exit_code, 2) << seed << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "--seed: must be an integer from 0 to 18446744073709551615")) << r.err;
  }
  EXPECT_EQ(generate({"-n", "2", "-p", "hi", "--seed", "18446744073709551615"}).exit_code, 0);
}

TEST_F(EngineCli, GenerateMissingModelNamesThePath) {
  RunResult r = run_batchlm(dir(), {"generate", "-m", "no-such-model.gguf", "-p", "Hello", "-n", "4"});
  EXPECT_EQ(r.exit_code, 2) << r.err;  // a configuration error, not a crash (>= 128)
  EXPECT_TRUE(contains(r.err, "no-such-model.gguf")) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST_F(EngineCli, GenerateTruncatedModelNamesTheFile) {
  for (const std::uintmax_t size : {std::uintmax_t{0}, std::uintmax_t{3}, std::uintmax_t{2000},
                                    fs::file_size(dir() / "tiny.gguf") - 100}) {
    fs::copy_file(dir() / "tiny.gguf", dir() / "cut.gguf", fs::copy_options::overwrite_existing);
    fs::resize_file(dir() / "cut.gguf", size);
    RunResult r = run_batchlm(dir(), {"generate", "-m", "cut.gguf", "-p", "Hello", "-n", "4"});
    EXPECT_EQ(r.exit_code, 2) << size << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "cut.gguf")) << size << ": " << r.err;
    EXPECT_TRUE(contains(r.err, size == 0 ? "the file is empty" : "truncated") || contains(r.err, "past the end"))
        << size << ": " << r.err;
  }
}

TEST_F(EngineCli, GenerateNotAModelNamesTheFile) {
  write_file(dir() / "notes.gguf", "these are not the weights you are looking for\n");
  RunResult r = run_batchlm(dir(), {"generate", "-m", "notes.gguf", "-p", "Hello", "-n", "4"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "notes.gguf")) << r.err;
  EXPECT_TRUE(contains(r.err, "magic")) << r.err;
}

// A KV cache the memory cannot hold (a long context set on the command line) is said to be one,
// with what to change, not reported as "std::bad_alloc".
TEST_F(EngineCli, OutOfMemoryForTheKvCacheSaysWhatToChange) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the address sanitizer cannot start under an address-space limit";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "the address sanitizer cannot start under an address-space limit";
#endif
#endif
  batchlm::testing::TinyLlamaOptions o;
  o.context_length = std::int64_t{1} << 24;
  batchlm::testing::write_tiny_llama(dir() / "long.gguf", o);
  // 2 layers x 2 KV heads x 16 x (key, value) x 2 bytes x 2^24 positions: 4 GiB, past a 2 GiB
  // address-space limit that the program itself fits in.
  const std::string command = "ulimit -v 2000000 && exec '" + binary("batchlm") +
                              "' generate -m long.gguf -p hi -n 1 -t 1 --context 16777216";
  Process p({.args = {"/bin/sh", "-c", command}, .env = {{"BATCHLM_MODEL", ""}}, .cwd = dir(),
             .out_file = dir() / "stdout.txt", .err_file = dir() / "stderr.txt"});
  EXPECT_EQ(p.wait(std::chrono::seconds(120)), 2);
  const std::string err = read_file(dir() / "stderr.txt");
  EXPECT_TRUE(contains(err, "batchlm: error: out of memory for the model and its KV cache; a shorter --context needs "
                            "less\n"))
      << err;
  EXPECT_FALSE(contains(err, "bad_alloc")) << err;
}

// ---- inspect -----------------------------------------------------------------------------------

TEST_F(EngineCli, InspectDescribesTheModel) {
  RunResult r = run_batchlm(dir(), {"inspect", "tiny.gguf"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "tiny.gguf")) << r.out;
  EXPECT_TRUE(contains(r.out, "architecture  llama")) << r.out;
  EXPECT_TRUE(contains(r.out, "name          tiny-llama")) << r.out;
  EXPECT_TRUE(contains(r.out, "layers        2")) << r.out;
  EXPECT_TRUE(contains(r.out, "embedding     64, feed-forward 128")) << r.out;
  EXPECT_TRUE(contains(r.out, "4 query, 2 key/value, head size 16")) << r.out;
  EXPECT_TRUE(contains(r.out, "context       256")) << r.out;
  EXPECT_TRUE(contains(r.out, "output head   separate")) << r.out;
  EXPECT_TRUE(contains(r.out, "tokenizer     gpt2 (pre-tokenizer smollm), " +
                                  std::to_string(info_.n_vocab) + " tokens, " +
                                  std::to_string(info_.merges.size()) + " merges"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "eos 2 \"<|im_end|>\"")) << r.out;
  EXPECT_TRUE(contains(r.out, "chat template chatml\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "runs          yes")) << r.out;
  EXPECT_FALSE(contains(r.out, "blk.0.attn_q.weight")) << r.out;  // only with --tensors

  RunResult tensors = run_batchlm(dir(), {"inspect", "tiny.gguf", "--tensors"});
  ASSERT_EQ(tensors.exit_code, 0) << tensors.err;
  EXPECT_TRUE(contains(tensors.out, "blk.1.ffn_down.weight")) << tensors.out;
  EXPECT_TRUE(contains(tensors.out, "output.weight")) << tensors.out;
}

// A vocabulary-only GGUF (llama.cpp's tokenizer tests ship them) has no network to run, but its
// tokenizer is what it is for: inspect shows it.
TEST_F(EngineCli, InspectShowsTheTokenizerOfAVocabularyOnlyFile) {
  const fs::path vocab = fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/ggml-vocab-qwen2.gguf";
  if (!fs::exists(vocab)) GTEST_SKIP() << vocab << " is absent (scripts/fetch-vocabs.sh fetches it)";
  RunResult r = run_batchlm(dir(), {"inspect", vocab.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "tensor types  none\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "tokenizer     gpt2 (pre-tokenizer qwen2), 151936 tokens")) << r.out;
  EXPECT_TRUE(contains(r.out, "eot 151645 \"<|im_end|>\"")) << r.out;
  EXPECT_TRUE(contains(r.out, "chat template chatml, default system: \"You are a helpful assistant\"\n")) << r.out;
  EXPECT_TRUE(contains(r.out, "runs          no: the file holds no tensors (a vocabulary only)\n")) << r.out;
  // GPT-2's file has no template: ChatML is what chat prompts get, said as such.
  const fs::path gpt2 = fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/ggml-vocab-gpt-2.gguf";
  if (!fs::exists(gpt2)) return;
  r = run_batchlm(dir(), {"inspect", gpt2.string()});
  EXPECT_TRUE(contains(r.out, "chat template chatml (the file has none; chat prompts are written in ChatML)\n")) << r.out;
}

TEST_F(EngineCli, InspectQuantizedTiedModel) {
  batchlm::testing::TinyLlamaOptions options;
  options.weight_dtype = kernels::DType::Q4_1;
  options.embedding_dtype = kernels::DType::Q8_0;
  options.tied = true;
  options.n_layers = 3;
  batchlm::testing::write_tiny_llama(dir() / "q.gguf", options);
  RunResult r = run_batchlm(dir(), {"inspect", "q.gguf"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "layers        3")) << r.out;
  EXPECT_TRUE(contains(r.out, "Q4_1 x21")) << r.out;  // 7 matrices in each of 3 layers
  EXPECT_TRUE(contains(r.out, "Q8_0 x1")) << r.out;   // the embedding, also the output head
  EXPECT_TRUE(contains(r.out, "output head   tied to the embeddings")) << r.out;
}

// The architecture variants: what sets each apart from Llama is on the rope and attention lines,
// and generate runs them.
TEST_F(EngineCli, InspectDescribesQwenAndPhi3Models) {
  batchlm::testing::TinyLlamaOptions qwen2;
  qwen2.architecture = "qwen2";
  batchlm::testing::write_tiny_llama(dir() / "qwen2.gguf", qwen2);
  RunResult r = run_batchlm(dir(), {"inspect", "qwen2.gguf"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "architecture  qwen2")) << r.out;
  EXPECT_TRUE(contains(r.out, "16 dims, pairs in halves;")) << r.out;
  EXPECT_TRUE(contains(r.out, "attention     query, key and value biases")) << r.out;
  EXPECT_TRUE(contains(r.out, "runs          yes")) << r.out;

  batchlm::testing::TinyLlamaOptions qwen3;
  qwen3.architecture = "qwen3";
  qwen3.head_dim = 32;
  batchlm::testing::write_tiny_llama(dir() / "qwen3.gguf", qwen3);
  r = run_batchlm(dir(), {"inspect", "qwen3.gguf"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "4 query, 2 key/value, head size 32")) << r.out;
  EXPECT_TRUE(contains(r.out, "attention     query and key normalized per head")) << r.out;
  // With Qwen 3's template: what it does with reasoning and tools.
  qwen3.chat_template = read_file(fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/templates/Qwen-Qwen3-0.6B.jinja");
  ASSERT_FALSE(qwen3.chat_template.empty());  // scripts/fetch-vocabs.sh fetches it
  batchlm::testing::write_tiny_llama(dir() / "qwen3-chat.gguf", qwen3);
  r = run_batchlm(dir(), {"inspect", "qwen3-chat.gguf"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "chat template chatml, <think> reasoning kept after the last user turn only, thinking "
                              "switched off by enable_thinking: false, tools called in <tool_call> blocks\n"))
      << r.out;
  RunResult g = run_batchlm(dir(), {"generate", "-m", "qwen3.gguf", "-p", "Hello world", "-n", "5", "--temperature", "0"});
  EXPECT_EQ(g.exit_code, 0) << g.err;

  batchlm::testing::TinyLlamaOptions freqs;
  freqs.rope_freqs.assign(8, 4.0f);
  batchlm::testing::write_tiny_llama(dir() / "freqs.gguf", freqs);
  r = run_batchlm(dir(), {"inspect", "freqs.gguf"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "adjacent pairs, frequency factors (rope_freqs)")) << r.out;
  EXPECT_FALSE(contains(r.out, "attention     ")) << r.out;

  // A long-context Phi-3: the short factors, the magnitude, and the context they allow.
  batchlm::testing::TinyLlamaOptions phi3;
  phi3.architecture = "phi3";
  phi3.context_length = 8192;
  phi3.original_context_length = 1024;
  phi3.rope_factors_short.assign(8, 2.0f);
  phi3.rope_factors_long.assign(8, 20.0f);
  phi3.rope_attn_factor = 1.5f;
  batchlm::testing::write_tiny_llama(dir() / "phi3.gguf", phi3);
  r = run_batchlm(dir(), {"inspect", "phi3.gguf"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "architecture  phi3")) << r.out;
  EXPECT_TRUE(contains(r.out, "context       8192 (training; past its original 1024 with the long rotary factors)")) << r.out;
  EXPECT_TRUE(contains(r.out, "pairs in halves, frequency factors (rope_factors_short, rope_factors_long), magnitude 1.5;"))
      << r.out;
  g = run_batchlm(dir(), {"generate", "-m", "phi3.gguf", "-p", "Hello world", "-n", "5", "--temperature", "0"});
  EXPECT_EQ(g.exit_code, 0) << g.err;
  // Past the original context the long factors run: another network, so other greedy tokens.
  const auto greedy = [&](const char* context) {
    return run_batchlm(dir(), {"generate", "-m", "phi3.gguf", "-p", "Hello world, and more", "-n", "24", "--temperature", "0",
                               "--ignore-eos", "--context", context});
  };
  const RunResult within = greedy("1024"), past = greedy("4096");
  EXPECT_EQ(within.exit_code, 0) << within.err;
  EXPECT_EQ(past.exit_code, 0) << past.err;
  EXPECT_EQ(greedy("512").out, within.out);
  EXPECT_NE(past.out, within.out);
}

// A model with a type the engine does not run (Q3_K) is listed in full, and "runs" says why not.
TEST_F(EngineCli, InspectListsTypesTheEngineDoesNotRun) {
  batchlm::testing::TinyLlamaOptions options;
  options.n_embd = 256;
  options.n_ff = 256;
  options.q3_k_tensor = "blk.0.attn_q.weight";
  batchlm::testing::write_tiny_llama(dir() / "k.gguf", options);
  RunResult r = run_batchlm(dir(), {"inspect", "k.gguf", "--tensors"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "Q3_K x1 (27.5 KiB)")) << r.out;
  EXPECT_TRUE(contains(r.out, "runs          no: ")) << r.out;
  EXPECT_TRUE(contains(r.out, "tensor 'blk.0.attn_q.weight' is Q3_K, which the engine does not run")) << r.out;
  EXPECT_TRUE(contains(r.out, "blk.0.attn_q.weight")) << r.out;

  RunResult g = run_batchlm(dir(), {"generate", "-m", "k.gguf", "-p", "hi"});
  EXPECT_NE(g.exit_code, 0);
  EXPECT_TRUE(contains(g.err, "is Q3_K, which the engine does not run")) << g.err;
}

// A GGUF stores token texts as raw bytes. A special token that is not UTF-8 was shown with a
// strict JSON dump, which threw, and inspect reported "runs no" for a model that runs
// (tests/fuzz/findings/inspect-token-not-utf8.md).
TEST_F(EngineCli, InspectShowsASpecialTokenThatIsNotUtf8) {
  std::string bytes;
  {
    std::ifstream in(dir() / "tiny.gguf", std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  // The token's entry in tokenizer.ggml.tokens: a 64-bit length of 10, then the text.
  const std::string entry = std::string("\x0a\0\0\0\0\0\0\0", 8) + "<|im_end|>";
  const std::size_t at = bytes.find(entry);
  ASSERT_NE(at, std::string::npos);
  bytes[at + entry.size() - 1] = '\xff';
  {
    std::ofstream out(dir() / "bad_eos.gguf", std::ios::binary);
    out << bytes;
  }
  RunResult r = run_batchlm(dir(), {"inspect", "bad_eos.gguf"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "eos 2 \"<|im_end|\xef\xbf\xbd\"")) << r.out;  // U+FFFD
  EXPECT_TRUE(contains(r.out, "runs          yes")) << r.out;
}

TEST_F(EngineCli, InspectTruncatedModelNamesTheFile) {
  fs::copy_file(dir() / "tiny.gguf", dir() / "cut.gguf");
  fs::resize_file(dir() / "cut.gguf", 2000);
  RunResult r = run_batchlm(dir(), {"inspect", "cut.gguf"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "cut.gguf")) << r.err;
  EXPECT_TRUE(contains(r.err, "truncated")) << r.err;
}

// Every command that loads a model says the same when it is not there: the path, the directory
// a relative path was looked up in, and how to get or choose one.
TEST_F(EngineCli, AMissingModelSaysWhereItWasLookedForAndWhatToDo) {
  fs::create_directory(dir() / "models.gguf");
  const std::string cwd = fs::canonical(dir()).string();
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"inspect", "absent.gguf"}, {"generate", "-m", "absent.gguf", "-p", "hi"},
           {"serve", "--model", "absent.gguf", "--port", "0"}}) {
    RunResult r = run_batchlm(dir(), args);
    EXPECT_EQ(r.exit_code, 2) << args[0] << ": " << r.err;
    // A file the user named: where it was looked for, and no advice to fetch another.
    EXPECT_TRUE(contains(r.err, "model file 'absent.gguf' not found in " + cwd + "\n")) << args[0] << ": " << r.err;
  }
  // The default model, not fetched yet: how to fetch it, or to choose another.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"generate", "-p", "hi"}, {"serve", "--port", "0"}}) {
    RunResult r = run_batchlm(dir(), args);
    EXPECT_EQ(r.exit_code, 2) << args[0] << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "not found in " + cwd + "; run scripts/fetch-model.sh for the default model, or "))
        << args[0] << ": " << r.err;
  }
  RunResult directory = run_batchlm(dir(), {"inspect", "models.gguf"});
  EXPECT_EQ(directory.exit_code, 2) << directory.err;
  EXPECT_TRUE(contains(directory.err, "model file 'models.gguf' is a directory, not a GGUF file")) << directory.err;
  ASSERT_EQ(::mkfifo((dir() / "fifo.gguf").c_str(), 0600), 0);
  RunResult fifo = run_batchlm(dir(), {"inspect", "fifo.gguf"});
  EXPECT_EQ(fifo.exit_code, 2) << fifo.err;
  EXPECT_TRUE(contains(fifo.err, "model file 'fifo.gguf' is not a regular file")) << fifo.err;
}

// ---- run with a local backend ------------------------------------------------------------------

std::string local_job(const std::string& model, int limit, const std::string& backend_extra = "") {
  return "name: e2e-local\n"
         "kind: eval\n"
         "input: " + gsm8k_test_file() + "\n"
         "request:\n"
         "  messages:\n"
         "    - {role: system, content: \"Solve the problem. End with '#### <number>'.\"}\n"
         "    - {role: user, content: \"{{question}}\"}\n"
         "  max_tokens: 8\n"
         "  temperature: 0\n"
         "backend: {type: local, model: " + model + ", threads: 1" + backend_extra + "}\n"
         "concurrency: 2\n"
         "output: {path: out/local.jsonl}\n"
         "scoring: gsm8k\n"
         "limit: " + std::to_string(limit) + "\n";
}

TEST_F(EngineCli, RunALocalJobWritesEveryRecord) {
  write_long_model();
  write_file(dir() / "job.yaml", local_job("long.gguf", 5));
  RunResult r = run_batchlm(dir(), {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Once at start: the model and where it runs (here the CPU, and why not a GPU where CUDA is
  // built in).
  EXPECT_NE(r.err.find("batchlm: local long.gguf ("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(") on cpu ("), std::string::npos) << r.err;
  const std::vector<json> records = read_jsonl(dir() / "out/local.jsonl");
  ASSERT_EQ(records.size(), 5u);
  std::set<long long> ids;
  for (const auto& rec : records) {
    ids.insert(rec["id"].get<long long>());
    EXPECT_TRUE(rec["error"].is_null()) << rec.dump();
    ASSERT_TRUE(rec["output"].is_string()) << rec.dump();
    EXPECT_TRUE(rec["finish_reason"] == "length" || rec["finish_reason"] == "stop") << rec.dump();
    ASSERT_TRUE(rec["usage"].is_object()) << rec.dump();
    EXPECT_GT(rec["usage"]["prompt_tokens"].get<long long>(), 20) << rec.dump();
    EXPECT_GE(rec["usage"]["completion_tokens"].get<long long>(), 1) << rec.dump();
    EXPECT_LE(rec["usage"]["completion_tokens"].get<long long>(), 8) << rec.dump();
    EXPECT_FALSE(rec["usage"].contains("estimated")) << "the engine counts its tokens: " << rec.dump();
    EXPECT_EQ(rec["attempts"], 1) << rec.dump();
    EXPECT_TRUE(rec["score"].is_object()) << rec.dump();
    EXPECT_TRUE(rec["input"].contains("question")) << rec.dump();
  }
  EXPECT_EQ(ids, (std::set<long long>{1, 2, 3, 4, 5}));
  const json summary = json::parse(read_file(dir() / "out/local.jsonl.summary.json"));
  EXPECT_EQ(summary["counts"]["succeeded"], 5) << summary.dump(2);
  // The engine's own account: every prompt token computed or cached, no block left held.
  const json& engine = summary["engine"];
  ASSERT_TRUE(engine.is_object()) << summary.dump(2);
  long long prompt_tokens = 0, completion_tokens = 0;
  for (const auto& rec : records) {
    prompt_tokens += rec["usage"]["prompt_tokens"].get<long long>();
    completion_tokens += rec["usage"]["completion_tokens"].get<long long>();
  }
  EXPECT_EQ(engine["prompt_tokens_computed"].get<long long>() + engine["prompt_tokens_cached"].get<long long>(),
            prompt_tokens) << engine.dump();
  EXPECT_EQ(engine["generated_tokens"].get<long long>(), completion_tokens) << engine.dump();
  EXPECT_EQ(engine["blocks_used"], 0) << engine.dump();
  EXPECT_EQ(engine["running"], 0) << engine.dump();
  EXPECT_NE(r.err.find("engine: "), std::string::npos) << r.err;

  // A rerun finds every item done.
  RunResult again = run_batchlm(dir(), {"run", "job.yaml"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(read_jsonl(dir() / "out/local.jsonl").size(), 5u);
}

// The dry run of a local job counts the prompts with the model's own tokenizer and template:
// the tokens the run then reports, not four bytes a token (about 30% low on GSM8K).
TEST_F(EngineCli, DryRunOfALocalJobCountsThePromptTokensExactly) {
  write_long_model();
  write_file(dir() / "job.yaml", local_job("long.gguf", 4));
  RunResult dry = run_batchlm(dir(), {"run", "job.yaml", "--dry-run"});
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  const std::string label = "prompt tokens (counted with the model's tokenizer): ";
  const std::size_t at = dry.out.find(label);
  ASSERT_NE(at, std::string::npos) << dry.out;
  const long long counted = std::stoll(dry.out.substr(at + label.size()));
  // The engine takes the request, not an HTTP body: no streaming fields are shown.
  EXPECT_NE(dry.out.find("--- item 1: local engine, model long.gguf"), std::string::npos) << dry.out;
  EXPECT_EQ(dry.out.find("\"stream"), std::string::npos) << dry.out;
  RunResult run = run_batchlm(dir(), {"run", "job.yaml"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  long long used = 0;
  for (const auto& rec : read_jsonl(dir() / "out/local.jsonl")) used += rec["usage"]["prompt_tokens"].get<long long>();
  EXPECT_EQ(counted, used) << dry.out;

  // Prompts that leave no room in the context are counted: the run would fail them.
  const std::vector<json> records = read_jsonl(dir() / "out/local.jsonl");
  const long long shortest = std::min_element(records.begin(), records.end(), [](const json& a, const json& b) {
                               return a["usage"]["prompt_tokens"] < b["usage"]["prompt_tokens"];
                             })->at("usage")["prompt_tokens"];
  RunResult tight = run_batchlm(dir(), {"run", "job.yaml", "--dry-run", "--fresh", "--set",
                                        "backend.context=" + std::to_string(shortest)});
  ASSERT_EQ(tight.exit_code, 0) << tight.err;
  EXPECT_NE(tight.out.find("warning: 4 of the prompts counted leave no room in the context of " +
                           std::to_string(shortest) + " tokens (the first, id 1: "),
            std::string::npos)
      << tight.out;
  EXPECT_EQ(dry.out.find("leave no room"), std::string::npos) << dry.out;
}

TEST_F(EngineCli, RunALocalJobWithLogprobsRecordsThemPerToken) {
  write_long_model();
  std::string job = local_job("long.gguf", 3);
  job.replace(job.find("  temperature: 0\n"), 17, "  temperature: 0\n  extra: {logprobs: true, top_logprobs: 2}\n");
  write_file(dir() / "job.yaml", job);
  RunResult r = run_batchlm(dir(), {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<json> records = read_jsonl(dir() / "out/local.jsonl");
  ASSERT_EQ(records.size(), 3u);
  for (const auto& rec : records) {
    ASSERT_TRUE(rec["logprobs"].is_array()) << rec.dump();
    // Every generated token but an end of the turn.
    const long long tokens = rec["usage"]["completion_tokens"].get<long long>();
    EXPECT_EQ(static_cast<long long>(rec["logprobs"].size()), rec["finish_reason"] == "stop" ? tokens - 1 : tokens)
        << rec.dump();
    for (const auto& t : rec["logprobs"]) {
      EXPECT_TRUE(t["token"].is_string()) << t.dump();
      EXPECT_TRUE(t["bytes"].is_array()) << t.dump();
      EXPECT_LE(t["logprob"].get<double>(), 0.0) << t.dump();
      ASSERT_EQ(t["top_logprobs"].size(), 2u) << t.dump();
      // Greedy: the chosen token is the most likely one.
      EXPECT_EQ(t["top_logprobs"][0]["bytes"], t["bytes"]) << t.dump();
    }
  }
  // Asking for alternatives without turning log-probabilities on is an error in the job file.
  job.replace(job.find("logprobs: true, "), 16, "");
  write_file(dir() / "bad.yaml", job);
  RunResult bad = run_batchlm(dir(), {"run", "bad.yaml"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("request.extra.top_logprobs"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("needs logprobs: true"), std::string::npos) << bad.err;
}

// An answer the context cut short (short of max_tokens) says so in the record; a rerun with a
// larger context makes it again, and keeps the answers that ended on their own or at
// max_tokens. A rerun with the same context keeps everything.
TEST_F(EngineCli, AnswersCutByTheContextAreRedoneWhenItGrows) {
  write_long_model();
  std::string job = local_job("long.gguf", 6);
  job.replace(job.find("max_tokens: 8"), 13, "max_tokens: 120");
  write_file(dir() / "job.yaml", job);
  // A context 60 tokens past the longest prompt: that answer is cut at 60, and those of prompts
  // more than 60 shorter are not.
  RunResult probe = run_batchlm(dir(), {"run", "job.yaml", "-o", "probe.jsonl"});
  ASSERT_EQ(probe.exit_code, 0) << probe.err;
  long long longest = 0;
  for (const json& rec : read_jsonl(dir() / "probe.jsonl"))
    longest = std::max(longest, rec["usage"]["prompt_tokens"].get<long long>());
  const std::string context = std::to_string(longest + 60);
  RunResult first = run_batchlm(dir(), {"run", "job.yaml", "--set", "backend.context=" + context});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  std::map<std::string, json> before;
  std::set<std::string> cut;
  for (const json& rec : read_jsonl(dir() / "out/local.jsonl")) {
    const long long prompt = rec["usage"]["prompt_tokens"], completion = rec["usage"]["completion_tokens"];
    if (rec.contains("cut_at_context")) {
      EXPECT_EQ(rec["cut_at_context"], longest + 60) << rec.dump();
      EXPECT_EQ(rec["finish_reason"], "length") << rec.dump();
      EXPECT_EQ(prompt + completion, longest + 60) << rec.dump();
      EXPECT_LT(completion, 120) << rec.dump();
      cut.insert(rec["id"].dump());
    } else {
      EXPECT_TRUE(completion == 120 || rec["finish_reason"] == "stop") << rec.dump();
    }
    before[rec["id"].dump()] = rec;
  }
  ASSERT_EQ(before.size(), 6u);
  ASSERT_FALSE(cut.empty()) << "no prompt came within 120 tokens of the context: the test needs one";
  ASSERT_LT(cut.size(), 6u) << "every answer was cut: the test needs one that was not";

  RunResult same = run_batchlm(dir(), {"run", "job.yaml", "--set", "backend.context=" + context});
  ASSERT_EQ(same.exit_code, 0) << same.err;
  EXPECT_NE(same.err.find("resuming out/local.jsonl: 6 done, 0 failed to retry\n"), std::string::npos) << same.err;

  // Under other settings the cut answers are not this job's to redo: the run is refused, as
  // for any record made under other settings, and the file is left as it was.
  const std::string file_before = read_file(dir() / "out/local.jsonl");
  RunResult other = run_batchlm(dir(), {"run", "job.yaml", "--set", "backend.context=1024", "--set",
                                        "request.temperature=0.5"});
  EXPECT_EQ(other.exit_code, 2) << other.err;
  EXPECT_NE(other.err.find("6 earlier results were made with other settings than this job's (request.temperature: "
                           "0.0 -> 0.5)"),
            std::string::npos)
      << other.err;
  EXPECT_EQ(read_file(dir() / "out/local.jsonl"), file_before);

  RunResult wider = run_batchlm(dir(), {"run", "job.yaml", "--set", "backend.context=1024"});
  ASSERT_EQ(wider.exit_code, 0) << wider.err;
  EXPECT_NE(wider.err.find("resuming out/local.jsonl: " + std::to_string(6 - cut.size()) + " done, 0 failed to retry, " +
                           std::to_string(cut.size()) +
                           " cut short by a smaller context to redo (the engine's is 1024 tokens now)"),
            std::string::npos)
      << wider.err;
  const std::vector<json> after = read_jsonl(dir() / "out/local.jsonl");
  ASSERT_EQ(after.size(), 6u);
  for (const json& rec : after) {
    const std::string id = rec["id"].dump();
    if (cut.contains(id)) {
      EXPECT_FALSE(rec.contains("cut_at_context")) << rec.dump();
      EXPECT_GT(rec["usage"]["completion_tokens"].get<long long>(), before[id]["usage"]["completion_tokens"].get<long long>())
          << rec.dump();
    } else {
      EXPECT_EQ(rec, before[id]) << "kept as it was";
    }
  }
}

TEST_F(EngineCli, RunALocalJobWhosePromptsOverflowTheContextRecordsA400) {
  write_file(dir() / "job.yaml", local_job("tiny.gguf", 3, ", context: 64"));
  RunResult r = run_batchlm(dir(), {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 1) << r.err;  // the run finished, some items failed
  const std::vector<json> records = read_jsonl(dir() / "out/local.jsonl");
  ASSERT_EQ(records.size(), 3u);
  for (const auto& rec : records) {
    ASSERT_TRUE(rec["error"].is_object()) << rec.dump();
    EXPECT_EQ(rec["error"]["kind"], "http") << rec.dump();
    EXPECT_EQ(rec["error"]["status"], 400) << rec.dump();
    EXPECT_EQ(rec["error"]["code"], "context_length_exceeded") << rec.dump();
    // The setting is what holds it back, and the message says how far it could go.
    EXPECT_NE(rec["error"]["message"].get<std::string>().find("the context holds 64 tokens (the model's own holds 256)"),
              std::string::npos)
        << rec.dump();
    EXPECT_EQ(rec["attempts"], 1) << "not retried: " << rec.dump();
    EXPECT_TRUE(rec["output"].is_null()) << rec.dump();
  }
}

TEST_F(EngineCli, RunALocalJobWithAStepLogWritesALinePerStep) {
  write_long_model();
  write_file(dir() / "job.yaml", local_job("long.gguf", 3, ", step_log: steps.jsonl"));
  RunResult r = run_batchlm(dir(), {"run", "job.yaml"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<json> steps = read_jsonl(dir() / "steps.jsonl");
  const json summary = json::parse(read_file(dir() / "out/local.jsonl.summary.json"));
  const json& engine = summary["engine"];
  ASSERT_EQ(static_cast<long long>(steps.size()), engine["steps"].get<long long>()) << engine.dump();
  long long prompt = 0;
  for (const json& step : steps) {
    for (const char* key : {"step", "t", "sequences", "decode", "drafts", "prompt", "tokens", "forward_ms",
                            "step_ms", "running", "waiting", "blocks_used"})
      EXPECT_TRUE(step.contains(key)) << key << " in " << step.dump();
    prompt += step["prompt"].get<long long>();
  }
  EXPECT_EQ(prompt, engine["prompt_tokens_computed"].get<long long>()) << engine.dump();

  // A log that cannot be written is a usage error that names the field, before any item runs.
  write_file(dir() / "bad.yaml", local_job("tiny.gguf", 3, ", step_log: no-such-dir/steps.jsonl"));
  RunResult bad = run_batchlm(dir(), {"run", "bad.yaml", "-o", "out/bad.jsonl"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_TRUE(contains(bad.err, "backend.step_log")) << bad.err;
  EXPECT_TRUE(contains(bad.err, "no-such-dir/steps.jsonl")) << bad.err;
  EXPECT_FALSE(fs::exists(dir() / "out/bad.jsonl"));
  // A dry run finds it too, and creates no log where one could be written.
  RunResult dry = run_batchlm(dir(), {"run", "bad.yaml", "--dry-run"});
  EXPECT_EQ(dry.exit_code, 2) << dry.err;
  EXPECT_TRUE(contains(dry.err, "backend.step_log: cannot open 'no-such-dir/steps.jsonl' for writing")) << dry.err;
  // (In an output of its own: the job's holds the first run's results, of another model, which
  // the dry run refuses as the run would.)
  dry = run_batchlm(dir(), {"run", "bad.yaml", "--dry-run", "--set", "backend.step_log=fresh-steps.jsonl", "-o",
                            "out/bad.jsonl"});
  EXPECT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_FALSE(fs::exists(dir() / "fresh-steps.jsonl"));
  dry = run_batchlm(dir(), {"run", "bad.yaml", "--dry-run", "--set", "backend.step_log=."});
  EXPECT_EQ(dry.exit_code, 2) << dry.err;
  EXPECT_TRUE(contains(dry.err, "cannot open '.' for writing: Is a directory")) << dry.err;
}

// The engine's refusals of its settings name the job's field and where it was set: the job
// file, or the flag that overrode it. A pool larger than the memory is one of them.
TEST_F(EngineCli, RunALocalJobWithEngineSettingsItCannotTakeNamesTheField) {
  write_file(dir() / "job.yaml", local_job("tiny.gguf", 3, ", kv_memory: 1KiB"));
  RunResult r = run_batchlm(dir(), {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  // Its line and column: the value in line 10's flow map.
  const std::string line10 = "backend: {type: local, model: tiny.gguf, threads: 1, kv_memory: 1KiB}";
  const std::string at = "job.yaml:10:" + std::to_string(line10.find("1KiB") + 1);
  EXPECT_TRUE(contains(r.err, "batchlm: error: " + at + ": backend.kv_memory: kv_memory 1024 (")) << r.err;
  write_file(dir() / "job.yaml", local_job("tiny.gguf", 3));
  r = run_batchlm(dir(), {"run", "job.yaml", "--set", "backend.kv_memory=1KiB"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "batchlm: error: --set: backend.kv_memory: kv_memory 1024 (")) << r.err;
  // Only where the system refuses what it cannot give (not with overcommit_memory 1).
  std::ifstream overcommit("/proc/sys/vm/overcommit_memory");
  if (int mode = -1; overcommit >> mode && mode != 1) {
    r = run_batchlm(dir(), {"run", "job.yaml", "--set", "backend.kv_memory=1TiB"});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, "batchlm: error: --set: backend.kv_memory: not enough memory for a KV pool this large"))
        << r.err;
  }
  EXPECT_FALSE(fs::exists(dir() / "out/local.jsonl"));
}

// The dry run refuses what the run would, with the same message naming the same field: engine
// settings the model cannot take, a file without weights, a GPU a machine without one cannot
// give. Each is checked against the run's own words.
TEST_F(EngineCli, DryRunRefusesTheEngineSettingsTheRunRefuses) {
  write_file(dir() / "job.yaml", local_job("tiny.gguf", 2));
  std::vector<std::vector<std::string>> cases = {
      {"--set", "backend.kv_tokens=10"},
      {"--set", "backend.kv_memory=1KiB"},
      {"--set", "backend.max_sequences=64", "--set", "backend.token_budget=8"},
      {"--set", "backend.speculative.method=self", "--set", "backend.speculative.layers=9"},
      {"--set", "backend.speculative.method=draft", "--set", "backend.speculative.model=nope.gguf"},
      {"--set", "backend.speculative.method=draft", "--set", "backend.speculative.model=job.yaml"},
      {"--set", "backend.step_log=no-such-dir/steps.jsonl"},
      // Two at once: the same one first.
      {"--set", "backend.step_log=no-such-dir/steps.jsonl", "--set", "backend.speculative.method=self", "--set",
       "backend.speculative.layers=9"},
      {"--set", "backend.device=cuda", "--set", "backend.threads=1"},
  };
  // A vocabulary without weights.
  const fs::path vocab = fs::path(BATCHLM_SOURCE_DIR) / "models/vocab/ggml-vocab-gpt-2.gguf";
  if (fs::exists(vocab)) cases.push_back({"-m", vocab.string()});
  for (const auto& extra : cases) {
    std::vector<std::string> run = {"run", "job.yaml"};
    run.insert(run.end(), extra.begin(), extra.end());
    std::vector<std::string> dry = run;
    dry.push_back("--dry-run");
    const RunResult refused = run_batchlm(dir(), run);
    if (extra.back() == "backend.threads=1" && refused.exit_code == 0) continue;  // a machine with a GPU
    ASSERT_EQ(refused.exit_code, 2) << extra[1] << "\n" << refused.err;
    const RunResult checked = run_batchlm(dir(), dry);
    EXPECT_EQ(checked.exit_code, 2) << extra[1] << "\n" << checked.out;
    const std::string said = refused.err.substr(0, refused.err.find('\n'));
    EXPECT_TRUE(contains(checked.err, said)) << "run: " << said << "\ndry run: " << checked.err;
  }
  EXPECT_FALSE(fs::exists(dir() / "out/local.jsonl"));
}

// A bias on a token the model does not have is refused once, before any item, not item by item.
TEST_F(EngineCli, RunALocalJobBiasingATokenOutsideTheVocabularyIsAUsageError) {
  write_file(dir() / "job.yaml", local_job("tiny.gguf", 2));
  RunResult r = run_batchlm(dir(), {"run", "job.yaml", "--set", "request.extra.logit_bias={\"99999\": 5}"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "batchlm: error: --set: request.extra.logit_bias: token 99999 is outside the vocabulary of " +
                                  std::to_string(info_.n_vocab) + " (tiny)"))
      << r.err;
  EXPECT_FALSE(fs::exists(dir() / "out/local.jsonl"));
  r = run_batchlm(dir(), {"run", "job.yaml", "--dry-run", "--set", "request.extra.logit_bias={\"99999\": 5}"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "request.extra.logit_bias: token 99999 is outside the vocabulary")) << r.err;
  // A token it has runs (a GSM8K question may be too long for the tiny model's context: exit 1).
  r = run_batchlm(dir(), {"run", "job.yaml", "--set", "request.extra.logit_bias={\"3\": 5}"});
  EXPECT_NE(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "2 items: ")) << r.err;
  EXPECT_FALSE(contains(r.err, "logit_bias")) << r.err;
}

// A pool set larger than the memory available is taken where the system promises the pages,
// with a warning that the run may be ended when it fills; or refused where it does not.
TEST_F(EngineCli, RunALocalJobWithAPoolLargerThanTheMemoryWarns) {
  std::int64_t available = 0;
  {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    std::int64_t kib = 0;
    while (meminfo >> key >> kib)
      if (key == "MemAvailable:") available = kib * 1024;
      else meminfo.ignore(64, '\n');
  }
  if (available <= 0) GTEST_SKIP() << "no MemAvailable in /proc/meminfo";
  write_file(dir() / "job.yaml", local_job("tiny.gguf", 1));
  const std::string bytes = std::to_string(available / 4 * 5);
  RunResult r = run_batchlm(dir(), {"run", "job.yaml", "--set", "backend.kv_memory=" + bytes});
  if (r.exit_code == 2) {
    EXPECT_TRUE(contains(r.err, "backend.kv_memory: not enough memory for a KV pool this large")) << r.err;
  } else {
    EXPECT_TRUE(contains(r.err, "batchlm: warning: backend.kv_memory: the KV pool (")) << r.err;
    EXPECT_TRUE(contains(r.err, "is more than the memory available now")) << r.err;
  }
  // A pool that fits says nothing.
  r = run_batchlm(dir(), {"run", "job.yaml", "--fresh", "--set", "backend.kv_memory=64MiB"});
  EXPECT_FALSE(contains(r.err, "warning")) << r.err;
}

TEST_F(EngineCli, ServeWithAStepLogThatCannotBeOpenedExitsNamingTheFlag) {
  RunResult r = run_batchlm(dir(), {"serve", "--model", "tiny.gguf", "--port", "0", "--threads", "1",
                                    "--no-kv-commit", "--step-log", "no-such-dir/steps.jsonl"});
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "--step-log: cannot open 'no-such-dir/steps.jsonl'")) << r.err;
}

// An option given empty is refused, not taken as "none" or "the default": `--api-key "$KEY"`
// with KEY unset must not serve without authentication. (Whether a key is required is said in
// the listening line: serve_test.)
TEST_F(EngineCli, ServeRefusesEmptyOptions) {
  for (const std::string flag : {"--api-key", "--model", "--served-model-name", "--host"}) {
    std::vector<std::string> args = {"serve", "--port", "0", "--threads", "1", "--no-kv-commit", flag, ""};
    if (flag != "--model") args.insert(args.end(), {"--model", "tiny.gguf"});
    RunResult r = run_batchlm(dir(), args);
    EXPECT_EQ(r.exit_code, 2) << flag << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "batchlm: error: " + flag + ": empty; give a value, or leave the option out"))
        << r.err;
  }
}

TEST_F(EngineCli, RunALocalJobWithAMissingModelIsAUsageError) {
  write_file(dir() / "job.yaml", local_job("missing/model.gguf", 5));
  RunResult r = run_batchlm(dir(), {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "backend.model")) << r.err;
  EXPECT_TRUE(contains(r.err, "missing/model.gguf")) << r.err;
  EXPECT_FALSE(fs::exists(dir() / "out/local.jsonl"));
}

TEST_F(EngineCli, RunALocalJobWithABrokenModelIsAUsageError) {
  fs::copy_file(dir() / "tiny.gguf", dir() / "cut.gguf");
  fs::resize_file(dir() / "cut.gguf", 2000);
  write_file(dir() / "job.yaml", local_job("cut.gguf", 5));
  RunResult r = run_batchlm(dir(), {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "batchlm: error: job.yaml:10:31: backend.model: cut.gguf: ")) << r.err;
  EXPECT_FALSE(fs::exists(dir() / "out/local.jsonl"));
  // As a draft model, the field named is the draft's.
  write_file(dir() / "job.yaml", local_job("tiny.gguf", 5, ", speculative: {method: draft, model: cut.gguf}"));
  r = run_batchlm(dir(), {"run", "job.yaml"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, ": backend.speculative.model: cut.gguf: ")) << r.err;
  EXPECT_TRUE(contains(r.err, "job.yaml:10:")) << r.err;
  // Given on the command line, the flag is named.
  r = run_batchlm(dir(), {"run", "job.yaml", "-m", "cut.gguf", "--set", "backend.speculative.method=none"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "batchlm: error: --model: backend.model: cut.gguf: ")) << r.err;
  EXPECT_FALSE(fs::exists(dir() / "out/local.jsonl"));
}

// ---- The real default model, when fetched -------------------------------------------------------

class RealModel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kRealModel)) GTEST_SKIP() << kRealModel << " is absent (scripts/fetch-model.sh fetches it)";
  }
  TempDir dir_;
};

// Ctrl-C stops the text where it is and still ends the line and prints the timings (the
// generation cancelled), with the exit status of an interrupt.
TEST_F(RealModel, GenerateInterruptedEndsTheLineAndPrintsTimings) {
  using namespace std::chrono_literals;
  Process p({.args = {binary("batchlm"), "generate", "-m", kRealModel.string(), "-p", "Once upon a time", "-n", "4000",
                      "--ignore-eos", "--timings"},
             .env = {},
             .cwd = dir_.path,
             .out_file = dir_.path / "gen.out",
             .err_file = dir_.path / "gen.err"});
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline &&
         (!fs::exists(dir_.path / "gen.out") || fs::file_size(dir_.path / "gen.out") < 40))
    std::this_thread::sleep_for(10ms);
  p.signal(SIGINT);
  EXPECT_EQ(p.wait(30s), 130);
  const std::string out = read_file(dir_.path / "gen.out");
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.back(), '\n');
  const std::optional<json> timings = last_json_line(read_file(dir_.path / "gen.err"));
  ASSERT_TRUE(timings) << read_file(dir_.path / "gen.err");
  EXPECT_EQ((*timings)["finish_reason"], "cancelled") << timings->dump();
  EXPECT_LT((*timings)["generated_tokens"].get<int>(), 4000) << timings->dump();
}

// A question the model answers with "Paris" by a wide margin at every token (at least 1.0
// between its top two logits, whatever order the kernels sum in). "What is the capital of
// France?" is a near-tie at the first token (0.09 in llama.cpp's logits), and llama.cpp's own
// greedy answer to it does not name Paris.
TEST_F(RealModel, GenerateAnswersAChatQuestion) {
  RunResult r = run_batchlm(dir_.path, {"generate", "-m", kRealModel.string(), "--chat", "-p",
                                        "Name the capital of France.", "-n", "24",
                                        "--temperature", "0", "--timings"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string text = r.out;
  text.erase(std::remove_if(text.begin(), text.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)); }),
             text.end());
  EXPECT_FALSE(text.empty()) << r.out;
  EXPECT_TRUE(contains(r.out, "Paris")) << r.out;
  const std::optional<json> timings = last_json_line(r.err);
  ASSERT_TRUE(timings) << r.err;
  EXPECT_LE((*timings)["generated_tokens"].get<long long>(), 24);
}

TEST_F(RealModel, RunsTheShippedGsm8kJob) {
  const fs::path data = dir_.path / "data";
  fs::create_directories(data / "gsm8k");
  for (const char* name : {"test.jsonl", "train.jsonl"})
    fs::create_symlink(fs::path(BATCHLM_SHARED_DATA) / "gsm8k" / name, data / "gsm8k" / name);
  const fs::path output = dir_.path / "g.jsonl";
  RunResult r = run_batchlm(dir_.path,
                            {"run", (fs::path(BATCHLM_SOURCE_DIR) / "jobs/gsm8k.yaml").string(), "--limit", "2",
                             "--set", "request.max_tokens=48", "--output", output.string()},
                            {{"BATCHLM_DATA", data.string()}, {"BATCHLM_MODEL", kRealModel.string()}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<json> records = read_jsonl(output);
  ASSERT_EQ(records.size(), 2u);
  for (const auto& rec : records) {
    EXPECT_TRUE(rec["error"].is_null()) << rec.dump();
    EXPECT_FALSE(rec["output"].get<std::string>().empty()) << rec.dump();
    EXPECT_LE(rec["usage"]["completion_tokens"].get<long long>(), 48) << rec.dump();
    // Eight worked examples precede each question.
    EXPECT_GT(rec["usage"]["prompt_tokens"].get<long long>(), 500) << rec.dump();
    EXPECT_TRUE(rec["score"].is_object()) << rec.dump();
  }
}

// Structured synthesis: each record's output follows the job's schema.
TEST_F(RealModel, RunsTheShippedWordProblemsJob) {
  const fs::path output = dir_.path / "w.jsonl";
  RunResult r = run_batchlm(dir_.path,
                            // Seeded: the job samples at temperature 0.8, and unseeded draws made
                            // this test pass or fail by chance (sometimes 1 of 4 answers closed
                            // within max_tokens).
                            {"synth", (fs::path(BATCHLM_SOURCE_DIR) / "jobs/word-problems.yaml").string(), "--count", "4",
                             "--output", output.string(), "--set", "request.seed=1"},
                            {{"BATCHLM_MODEL", kRealModel.string()}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<json> records = read_jsonl(output);
  ASSERT_EQ(records.size(), 4u);
  int closed = 0;
  for (const auto& rec : records) {
    SCOPED_TRACE(rec.dump());
    ASSERT_TRUE(rec["error"].is_null());
    if (rec["finish_reason"] != "stop") continue;  // max_tokens cut it: the beginning of an object
    ++closed;
    const json answer = json::parse(rec["output"].get<std::string>());
    ASSERT_TRUE(answer.is_object());
    EXPECT_EQ(answer.size(), 4u);
    const std::string question = answer["question"];
    EXPECT_GE(question.size(), 10u);
    EXPECT_TRUE(answer["answer"].is_number_integer());
    EXPECT_TRUE(answer["steps"].is_array() && !answer["steps"].empty() && answer["steps"].size() <= 5);
    EXPECT_TRUE(answer["difficulty"] == "easy" || answer["difficulty"] == "medium" || answer["difficulty"] == "hard");
  }
  EXPECT_GE(closed, 2);
}

}  // namespace
}  // namespace batchlm::e2e
