// Job files (runner/src/job.cpp): YAML text plus command-line overrides, loaded and validated
// by load_job_text; a job that validates then opens its source (runner/src/source.cpp) and
// renders its first items, as `batchlm run` does before it sends anything.
//
// Input: the job's YAML up to the first NUL byte; then each NUL-separated part is an override:
// parts starting with bytes 1 to 4 are the literal values of -o, -m, --backend and --base-url,
// anything else is a --set argument (key.path=value) for parse_override.
//
// The harness works in a scratch directory holding small input and few-shot files
// (in.jsonl, batch.jsonl, data/gsm8k/{test,train}.jsonl), so that relative paths in a job
// resolve. The environment is a fixed map (BATCHLM_DATA=data, EMPTY="", ...).
//
// Promised: a job loads or is refused with ConfigError naming file, line and field; never
// another exception, a crash or a hang. Checked on a job that loads: the invariants the rest
// of the program relies on (ranges, non-empty lists, a compilable scoring pattern).

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "batchlm/runner/job.hpp"
#include "batchlm/runner/pattern.hpp"
#include "batchlm/runner/source.hpp"
#include "fuzz_support.hpp"

using namespace batchlm;
using namespace batchlm::runner;

namespace {

std::filesystem::path scratch_dir;

void write(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

EnvLookup fixed_env() {
  static const std::map<std::string, std::string> env = {
      {"BATCHLM_DATA", "data"}, {"HOME", "/home/fuzz"}, {"EMPTY", ""}, {"MODEL", "m.gguf"},
      {"OPENAI_API_KEY", "sk-fuzz"}};
  return [](const std::string& name) -> std::optional<std::string> {
    const auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

void check_job(const JobSpec& job) {
  FUZZ_CHECK(!job.name.empty(), "an empty job name");
  FUZZ_CHECK(job.backend.type == "local" || job.backend.type == "openai", "backend type " + job.backend.type);
  FUZZ_CHECK(job.concurrency >= 1, "concurrency " + std::to_string(job.concurrency));
  FUZZ_CHECK(job.retry.max_attempts >= 1, "max_attempts " + std::to_string(job.retry.max_attempts));
  FUZZ_CHECK(job.retry.base.count() >= 0 && job.retry.cap >= job.retry.base, "retry base/cap");
  FUZZ_CHECK(!job.output.path.empty(), "an empty output path");
  FUZZ_CHECK(job.output.flush_every >= 1, "flush_every");
  FUZZ_CHECK(job.few_shot.count >= 0, "few_shot.count");
  FUZZ_CHECK(!job.limit || *job.limit >= 0, "limit");
  FUZZ_CHECK(!job.request.max_tokens || *job.request.max_tokens >= 1, "max_tokens");
  for (const auto& [name, choices] : job.synth.variables)
    FUZZ_CHECK(!choices.empty(), "synth variable without choices: " + name);
  if (job.input.path.empty()) {
    FUZZ_CHECK(job.kind == JobKind::Synth && job.synth.count > 0 && !job.request.messages.empty(),
               "a job without input that is not a complete synth job");
  }
  const auto& b = job.backend;
  FUZZ_CHECK(b.token_budget == 0 || b.token_budget >= b.max_sequences, "token_budget below max_sequences");
  FUZZ_CHECK(b.speculative.k_min <= b.speculative.k_max && b.speculative.ngram_min <= b.speculative.ngram_max,
             "speculative bounds");
  if (job.scoring.kind == ScoringKind::Regex) (void)Pattern(job.scoring.pattern);  // a validated pattern compiles
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  scratch_dir = std::filesystem::temp_directory_path() / ("batchlm_fuzz_job_" + std::to_string(::getpid()));
  const std::string line = R"({"question": "What is 2+3?", "answer": "2+3=5\n#### 5", "a": {"b": [1, "x"]}})";
  write(scratch_dir / "in.jsonl", line + "\n" + line + "\n");
  write(scratch_dir / "data/gsm8k/test.jsonl", line + "\n");
  write(scratch_dir / "data/gsm8k/train.jsonl", line + "\n" + line + "\n" + line + "\n");
  write(scratch_dir / "batch.jsonl",
        R"({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}})"
        "\n");
  std::filesystem::current_path(scratch_dir);
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(scratch_dir, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::InputReader input(data, size);
  const std::string_view yaml = input.until('\0');
  std::vector<Override> overrides;
  try {
    while (!input.empty()) {
      const std::string_view part = input.until('\0');
      static const char* const kFlags[] = {"--output", "--model", "--backend", "--base-url"};
      static const char* const kPaths[] = {"output.path", "backend.model", "backend.type", "backend.base_url"};
      if (!part.empty() && part.front() >= 1 && part.front() <= 4) {
        const int i = part.front() - 1;
        overrides.push_back(Override{kPaths[i], std::string(part.substr(1)), true, kFlags[i]});
      } else {
        overrides.push_back(parse_override(part));
      }
    }
    const JobSpec job = load_job_text(yaml, "job.yaml", overrides, fixed_env());
    check_job(job);
    // What `batchlm run` does next: validate the whole input, render the first items.
    const auto source = open_source(job);
    FUZZ_CHECK(source->total() >= 0, "a negative item count");
    for (int i = 0; i < 3; ++i) {
      const std::optional<Item> item = source->next();
      if (!item) break;
      FUZZ_CHECK(item->id_key == item->id.dump(), "id_key is not the id");
    }
  } catch (const ConfigError& e) {
    FUZZ_CHECK(!e.message().empty(), std::string("an error without a message: ") + e.what());
  }
  return 0;
}
