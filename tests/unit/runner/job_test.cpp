#include "batchlm/runner/job.hpp"

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <gtest/gtest.h>

namespace fs = std::filesystem;
using namespace batchlm::runner;
using namespace std::chrono_literals;

namespace {

using Env = std::map<std::string, std::string>;

EnvLookup env_of(Env values) {
  return [values = std::move(values)](const std::string& name) -> std::optional<std::string> {
    auto it = values.find(name);
    if (it == values.end()) return std::nullopt;
    return it->second;
  };
}

class JobFile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() / ("batchlm-job-test-" + std::to_string(rd()));
    fs::create_directories(dir_);
    input_ = write("in.jsonl", "{\"question\": \"1+1?\", \"answer\": \"#### 2\"}\n");
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    fs::path path = dir_ / name;
    std::ofstream(path) << text;
    return path.string();
  }

  // A job text with the temp input prepended, so each test shows only what it is about.
  std::string with_input(const std::string& rest) { return "input: " + input_ + "\n" + rest; }

  JobSpec load(const std::string& yaml, const std::vector<Override>& overrides = {},
               Env env = {}) {
    return load_job_text(yaml, "jobs/t.yaml", overrides, env_of(std::move(env)));
  }

  ConfigError error_of(const std::string& yaml, const std::vector<Override>& overrides = {},
                       Env env = {}) {
    try {
      load(yaml, overrides, std::move(env));
    } catch (const ConfigError& e) {
      return e;
    }
    ADD_FAILURE() << "no ConfigError for:\n" << yaml;
    return ConfigError("", 0, 0, "", "");
  }

  fs::path dir_;
  std::string input_;
};

}  // namespace

TEST(ConfigErrorTest, WhatReadsFileLineColumnFieldMessage) {
  ConfigError e("jobs/x.yaml", 14, 3, "retry.max_attemps", "unknown key");
  EXPECT_STREQ(e.what(), "jobs/x.yaml:14:3: retry.max_attemps: unknown key");
  EXPECT_EQ(e.line(), 14);
  EXPECT_EQ(e.column(), 3);
  EXPECT_EQ(e.field(), "retry.max_attemps");
  EXPECT_EQ(e.message(), "unknown key");
  EXPECT_STREQ(ConfigError("--set", 0, 0, "concurrency", "bad").what(), "--set: concurrency: bad");
}

TEST_F(JobFile, BackendTypeFollowsBaseUrl) {
  JobSpec remote = load(with_input("backend: {base_url: http://127.0.0.1:9/v1}\n"));
  EXPECT_EQ(remote.backend.type, "openai");
  EXPECT_EQ(remote.backend.model, "gpt-4o-mini");
  JobSpec openai = load(with_input("backend: {type: openai}\n"));
  EXPECT_EQ(openai.backend.base_url, "https://api.openai.com/v1");
  JobSpec local = load(with_input("backend: {type: local, model: m.gguf, threads: 3, context: 2048}\n"));
  EXPECT_EQ(local.backend.type, "local");
  EXPECT_EQ(local.backend.model, "m.gguf");
  EXPECT_EQ(local.backend.threads, 3);
  EXPECT_EQ(local.backend.context, 2048);
  try {
    load(with_input("backend: {type: local, threads: -1}\n"));
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("backend.threads"), std::string::npos) << e.what();
  }
}

TEST_F(JobFile, LocalEngineLimits) {
  JobSpec job = load(with_input(
      "backend: {type: local, max_sequences: 8, token_budget: 128, block_size: 32, kv_tokens: 65536}\n"));
  EXPECT_EQ(job.backend.max_sequences, 8);
  EXPECT_EQ(job.backend.token_budget, 128);
  EXPECT_EQ(job.backend.block_size, 32);
  EXPECT_EQ(job.backend.kv_tokens, 65536);
  EXPECT_EQ(job.backend.kv_bytes, 0);
  JobSpec bytes = load(with_input("backend: {type: local, kv_memory: 1.5GiB}\n"));
  EXPECT_EQ(bytes.backend.kv_bytes, 1610612736);
  JobSpec defaults = load(with_input(""));
  EXPECT_EQ(defaults.backend.max_sequences, 32);
  EXPECT_EQ(defaults.backend.token_budget, 0);
  EXPECT_EQ(defaults.backend.block_size, 16);
  EXPECT_EQ(defaults.backend.kv_tokens, 0);
  EXPECT_EQ(defaults.backend.kv_bytes, 0);
  EXPECT_TRUE(defaults.backend.kv_recycle);  // a job's items do not come back
  EXPECT_FALSE(load(with_input("backend: {kv_recycle: false}\n")).backend.kv_recycle);
  EXPECT_EQ(defaults.backend.step_log, "");
  EXPECT_EQ(load(with_input("backend: {step_log: out/steps.jsonl}\n")).backend.step_log, "out/steps.jsonl");

  auto error_of = [&](const std::string& yaml) -> std::string {
    try {
      load(with_input(yaml));
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(error_of("backend: {max_sequences: 0}\n").find("backend.max_sequences"), std::string::npos);
  EXPECT_NE(error_of("backend: {token_budget: 1000}\n").find("backend.token_budget"), std::string::npos);
  EXPECT_NE(error_of("backend: {block_size: 0}\n").find("backend.block_size"), std::string::npos);
  const std::string budget = error_of("backend: {max_sequences: 64, token_budget: 32}\n");
  EXPECT_NE(budget.find("backend.token_budget"), std::string::npos) << budget;
  EXPECT_NE(budget.find("less than max_sequences 64"), std::string::npos) << budget;
  const std::string memory = error_of("backend: {kv_memory: lots}\n");
  EXPECT_NE(memory.find("backend.kv_memory"), std::string::npos) << memory;
  EXPECT_NE(memory.find("'lots'"), std::string::npos) << memory;
  EXPECT_NE(error_of("backend: {kv_recycle: sometimes}\n").find("backend.kv_recycle"), std::string::npos);
  EXPECT_NE(error_of("backend: {step_log: [a, b]}\n").find("backend.step_log"), std::string::npos);
  // Overrides reach the same keys.
  JobSpec set = load(with_input(""), {parse_override("backend.max_sequences=4"),
                                      parse_override("backend.kv_recycle=false")});
  EXPECT_EQ(set.backend.max_sequences, 4);
  EXPECT_FALSE(set.backend.kv_recycle);
}

TEST(ByteSize, UnitsAndErrors) {
  EXPECT_EQ(parse_byte_size("1073741824"), 1073741824);
  EXPECT_EQ(parse_byte_size("512MiB"), 512ll << 20);
  EXPECT_EQ(parse_byte_size("512M"), 512ll << 20);
  EXPECT_EQ(parse_byte_size("2GiB"), 2ll << 30);
  EXPECT_EQ(parse_byte_size("2gb"), 2000000000);
  EXPECT_EQ(parse_byte_size("64k"), 65536);
  EXPECT_EQ(parse_byte_size("1.5 GiB"), 1610612736);
  EXPECT_EQ(parse_byte_size("100B"), 100);
  EXPECT_EQ(parse_byte_size(""), std::nullopt);
  EXPECT_EQ(parse_byte_size("GiB"), std::nullopt);
  EXPECT_EQ(parse_byte_size("-1G"), std::nullopt);
  EXPECT_EQ(parse_byte_size("2 parsecs"), std::nullopt);
  EXPECT_EQ(parse_byte_size("1..2G"), std::nullopt);
}

TEST_F(JobFile, MinimalJobGetsDocumentedDefaults) {
  JobSpec job = load(with_input(""));
  EXPECT_EQ(job.file, "jobs/t.yaml");
  EXPECT_EQ(job.name, "t");  // the file stem
  EXPECT_EQ(job.kind, JobKind::Eval);
  EXPECT_EQ(job.input.path, input_);
  EXPECT_EQ(job.input.format, InputFormat::Auto);
  EXPECT_EQ(job.concurrency, 32);
  EXPECT_EQ(job.backend.type, "local");  // the embedded engine with the default model
  EXPECT_EQ(job.backend.model, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  EXPECT_EQ(job.backend.threads, 0);
  EXPECT_EQ(job.backend.api_key_env, "OPENAI_API_KEY");
  EXPECT_TRUE(job.backend.stream);
  EXPECT_EQ(job.retry.max_attempts, 6);
  EXPECT_EQ(job.retry.base, 500ms);
  EXPECT_EQ(job.retry.cap, 30s);
  EXPECT_EQ(job.output.path, "out/t.jsonl");
  EXPECT_EQ(job.output.flush_every, 64);
  EXPECT_EQ(job.output.flush_interval, 1s);
  EXPECT_EQ(job.scoring.kind, ScoringKind::None);
  EXPECT_EQ(job.rate_limit.requests_per_minute, 0);
  EXPECT_FALSE(job.limit.has_value());
  EXPECT_EQ(job.grace_period, 30s);
  EXPECT_TRUE(job.request.messages.empty());
}

TEST_F(JobFile, BaseUrlAndModelDefaultFromEnvironment) {
  JobSpec job = load(with_input("backend: {type: openai}\n"), {},
                     {{"OPENAI_BASE_URL", "http://localhost:9/v1"}, {"BATCHLM_MODEL_NAME", "m"}});
  EXPECT_EQ(job.backend.base_url, "http://localhost:9/v1");
  EXPECT_EQ(job.backend.model, "m");
  JobSpec local = load(with_input(""), {}, {{"BATCHLM_MODEL", "/models/x.gguf"}});
  EXPECT_EQ(local.backend.type, "local");
  EXPECT_EQ(local.backend.model, "/models/x.gguf");
}

// An empty model name would fall back to the default model: against a paid API, one the user never
// chose. Each way of giving one is refused, naming where it was given.
TEST_F(JobFile, EmptyModelNameIsAnErrorWhereverItIsGiven) {
  const std::string api = "backend: {type: openai, base_url: http://127.0.0.1:9/v1, model: fake}\n";
  ConfigError flag = error_of(with_input(api), {Override{"backend.model", "", true, "--model"}});
  EXPECT_EQ(flag.file(), "--model");
  EXPECT_EQ(flag.field(), "backend.model");
  EXPECT_NE(flag.message().find("empty"), std::string::npos) << flag.what();
  ConfigError file = error_of(with_input("backend: {type: openai, model: \"\"}\n"));
  EXPECT_EQ(file.line(), 2);
  EXPECT_EQ(file.field(), "backend.model");
  ConfigError local = error_of(with_input("backend: {model: ''}\n"));
  EXPECT_EQ(local.field(), "backend.model");
  ConfigError request = error_of(with_input(api), {parse_override("request.model=\"\"")});
  EXPECT_EQ(request.file(), "--set");
  EXPECT_EQ(request.field(), "request.model");
  EXPECT_NE(request.message().find("empty"), std::string::npos) << request.what();
  // The API's model from a variable set but empty: no model, not the default one. The local
  // model's variable set but empty is the default GGUF, as for generate, inspect and serve.
  ConfigError name = error_of(with_input("backend: {type: openai}\n"), {}, {{"BATCHLM_MODEL_NAME", ""}});
  EXPECT_EQ(name.field(), "backend.model");
  EXPECT_EQ(name.message(), "$BATCHLM_MODEL_NAME is set but empty; name a model in it, give backend.model or --model, "
                            "or unset it for the default (gpt-4o-mini)");
  EXPECT_EQ(load(with_input(""), {}, {{"BATCHLM_MODEL", ""}}).backend.model, kDefaultLocalModel);
}

TEST_F(JobFile, OutputPathDefaultsToNameOfJob) {
  EXPECT_EQ(load(with_input("name: demo\n")).output.path, "out/demo.jsonl");
}

TEST_F(JobFile, ReadsEveryField) {
  std::string few = write("train.jsonl", "{\"question\": \"q\", \"answer\": \"a\"}\n");
  JobSpec job = load(R"(name: full
kind: eval
input: {path: )" + input_ + R"(, format: jsonl}
request:
  messages:
    - {role: system, content: "Be brief."}
    - {role: user, content: "{{question}}"}
  model: m1
  max_tokens: 128
  temperature: 0.7
  top_p: 0.9
  stop: ["\n\n", "END"]
  seed: 7
  extra: {logprobs: true, top_logprobs: 2, response_format: {type: text}, note: "01"}
few_shot: {path: )" + few + R"(, count: 1, seed: 3, user: "Q: {{question}}", assistant: "A: {{answer}}"}
backend:
  type: openai
  base_url: http://127.0.0.1:8000/v1
  model: m2
  api_key_env: MY_KEY
  headers: {X-Team: evals}
  timeouts: {connect: 2s, first_byte: 10s, idle: 5s, total: 2m}
  stream: false
concurrency: 8
rate_limit: {requests_per_minute: 500, tokens_per_minute: 200000}
retry: {max_attempts: 3, base: 100ms, cap: 5s, max_retry_after: 1m, budget_ratio: 0.5, budget_min_per_second: 2}
output: {path: o.jsonl, flush_every: 10, flush_interval: 250ms, input_fields: [question]}
scoring: {type: exact_match, reference_field: gold}
limit: 5
grace_period: 3s
)");
  EXPECT_EQ(job.name, "full");
  EXPECT_EQ(job.input.format, InputFormat::Jsonl);
  ASSERT_EQ(job.request.messages.size(), 2u);
  EXPECT_EQ(job.request.messages[0].role, "system");
  EXPECT_EQ(job.request.messages[1].content, "{{question}}");
  EXPECT_EQ(job.request.model, "m1");
  EXPECT_EQ(job.request.max_tokens, 128);
  EXPECT_DOUBLE_EQ(*job.request.temperature, 0.7);
  EXPECT_DOUBLE_EQ(*job.request.top_p, 0.9);
  EXPECT_EQ(job.request.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(job.request.seed, 7);
  // In the file's order: body fields go on as written.
  EXPECT_EQ(job.request.extra, nlohmann::ordered_json::parse(
      R"({"logprobs": true, "top_logprobs": 2, "response_format": {"type": "text"}, "note": "01"})"));
  EXPECT_EQ(job.few_shot.count, 1);
  EXPECT_EQ(job.few_shot.seed, 3u);
  EXPECT_EQ(job.few_shot.user, "Q: {{question}}");
  EXPECT_EQ(job.backend.base_url, "http://127.0.0.1:8000/v1");
  EXPECT_EQ(job.backend.model, "m2");
  EXPECT_EQ(job.backend.api_key_env, "MY_KEY");
  ASSERT_EQ(job.backend.headers.size(), 1u);
  EXPECT_EQ(job.backend.headers[0], (std::pair<std::string, std::string>{"X-Team", "evals"}));
  EXPECT_EQ(job.backend.timeouts.connect, 2s);
  EXPECT_EQ(job.backend.timeouts.first_byte, 10s);
  EXPECT_EQ(job.backend.timeouts.idle, 5s);
  EXPECT_EQ(job.backend.timeouts.total, 2min);
  EXPECT_FALSE(job.backend.stream);
  EXPECT_EQ(job.concurrency, 8);
  EXPECT_EQ(job.rate_limit.requests_per_minute, 500);
  EXPECT_EQ(job.rate_limit.tokens_per_minute, 200000);
  EXPECT_EQ(job.retry.max_attempts, 3);
  EXPECT_EQ(job.retry.base, 100ms);
  EXPECT_EQ(job.retry.cap, 5s);
  EXPECT_EQ(job.retry.max_retry_after, 1min);
  EXPECT_DOUBLE_EQ(job.retry.budget_ratio, 0.5);
  EXPECT_DOUBLE_EQ(job.retry.budget_min_per_second, 2);
  EXPECT_EQ(job.output.path, "o.jsonl");
  EXPECT_EQ(job.output.flush_every, 10);
  EXPECT_EQ(job.output.flush_interval, 250ms);
  EXPECT_EQ(job.output.input_fields, (std::vector<std::string>{"question"}));
  EXPECT_EQ(job.scoring.kind, ScoringKind::ExactMatch);
  EXPECT_EQ(job.scoring.reference_field, "gold");
  EXPECT_EQ(job.limit, 5);
  EXPECT_EQ(job.grace_period, 3s);
}

TEST_F(JobFile, StopAcceptsASingleString) {
  EXPECT_EQ(load(with_input("request: {stop: END}\n")).request.stop, std::vector<std::string>{"END"});
}

TEST_F(JobFile, AnEmptyStopStringIsRefused) {
  for (const std::string stop : {"''", "[END, '']"}) {
    const ConfigError e = error_of(with_input("request: {stop: " + stop + "}\n"));
    EXPECT_EQ(e.field(), "request.stop") << stop;
    EXPECT_EQ(e.message(), "an empty string stops nothing: leave it out") << stop;
  }
}

TEST_F(JobFile, DurationsAcceptUnitsAndBareSeconds) {
  auto grace = [&](const std::string& value) {
    return load(with_input("grace_period: " + value + "\n")).grace_period;
  };
  EXPECT_EQ(grace("0.5s"), 500ms);
  EXPECT_EQ(grace("500ms"), 500ms);
  EXPECT_EQ(grace("2m"), 120s);
  EXPECT_EQ(grace("1h"), 3600s);
  EXPECT_EQ(grace("3"), 3s);
  EXPECT_EQ(grace("1.25"), 1250ms);
  EXPECT_EQ(grace("0"), 0ms);
}

TEST_F(JobFile, BadDurationNamesExpectedForms) {
  ConfigError e = error_of(with_input("retry:\n  base: 5 parsecs\n"));
  EXPECT_EQ(e.line(), 3);
  EXPECT_EQ(e.column(), 9);
  EXPECT_EQ(e.field(), "retry.base");
  EXPECT_EQ(e.message(), "expected a duration like 500ms, 2s or 1m, got '5 parsecs'");
  EXPECT_EQ(error_of(with_input("grace_period: -1s\n")).message(), "must not be negative, got '-1s'");
}

// 1e300 seconds used to become a negative number of milliseconds (out of range for llround),
// which deadlines then added to the clock.
TEST_F(JobFile, DurationBeyondAYearIsAnError) {
  ConfigError e = error_of(with_input("retry:\n  base: 1e300s\n  cap: 1e300s\n"));
  EXPECT_EQ(e.line(), 3);
  EXPECT_EQ(e.field(), "retry.base");
  EXPECT_EQ(e.message(), "must be at most 8760h (a year), got '1e300s'");
  EXPECT_EQ(load(with_input("backend: {timeouts: {total: 8760h}}\n")).backend.timeouts.total, 8760h);
}

// The embedded engine runs backend.model for every item: a model named per request would go
// unused (a dry run would still show it). An API takes it.
TEST_F(JobFile, RequestModelIsAnErrorForTheEmbeddedEngine) {
  ConfigError e = error_of(with_input("backend: {type: local, model: m.gguf}\nrequest:\n  model: gpt-4o\n"));
  EXPECT_EQ(e.line(), 4);
  EXPECT_EQ(e.field(), "request.model");
  EXPECT_EQ(e.message(),
            "the embedded engine runs backend.model (m.gguf), one model for every item; a model named per request is "
            "for an API (--base-url): leave request.model out");
  EXPECT_EQ(error_of(with_input(""), {parse_override("request.model=x")}).field(), "request.model");
  EXPECT_EQ(load(with_input("backend: {base_url: http://127.0.0.1:1/v1}\nrequest: {model: gpt-4o}\n")).request.model,
            "gpt-4o");
}

TEST_F(JobFile, ExtraFieldsTheEmbeddedEngineWouldIgnoreAreErrors) {
  // Sent to an API they would change the output; the embedded engine would have dropped them.
  ConfigError e = error_of(with_input(
      "request:\n  extra:\n    top_k: 40\n    response_format: {type: json_schema, json_schema: {name: t, schema: "
      "{type: object, properties: {a: {type: string, pattern: '^x'}}}}}\n"));
  EXPECT_EQ(e.file(), "jobs/t.yaml");
  EXPECT_EQ(e.line(), 5);
  EXPECT_EQ(e.field(), "request.extra.response_format");
  EXPECT_EQ(e.message(),
            "json_schema.schema at /properties/a/pattern: 'pattern' is not supported by the embedded engine's structured "
            "outputs (it follows type, enum, const, properties, required, additionalProperties, items, minItems, "
            "maxItems, minLength, maxLength, anyOf, oneOf and $ref); remove it, or run the job against an API that does "
            "(--base-url) (the backend is the embedded engine)");
  // A schema it can follow passes.
  EXPECT_EQ(load(with_input("request:\n  extra:\n    response_format: {type: json_schema, json_schema: {name: t, "
                            "schema: {type: object, properties: {a: {type: string}}, required: [a]}}}\n"))
                .request.extra["response_format"]["type"],
            "json_schema");
  EXPECT_EQ(error_of(with_input("request: {extra: {frequency_penalty: 3}}\n")).message(),
            "expected a number from -2 to 2, not 3 (the backend is the embedded engine)");
  EXPECT_EQ(error_of(with_input("request: {extra: {typical_p: 0.1}}\n")).field(), "request.extra.typical_p");
  EXPECT_EQ(error_of(with_input("request: {extra: {min_p: 2}}\n")).field(), "request.extra.min_p");
  EXPECT_EQ(load(with_input("request: {extra: {min_p: 0.1}}\n")).request.extra["min_p"], 0.1);
  ConfigError least = error_of(with_input("request:\n  max_tokens: 8\n  extra: {min_tokens: 16, stop_token_ids: [2]}\n"));
  EXPECT_EQ(least.field(), "request.extra.min_tokens");
  EXPECT_EQ(least.message(), "asks for at least 16 tokens, more than max_tokens (8) lets out");
  EXPECT_GT(least.line(), 0);
  EXPECT_EQ(error_of(with_input("request: {extra: {stop_token_ids: [x]}}\n")).field(), "request.extra.stop_token_ids");
  EXPECT_EQ(load(with_input("request: {max_tokens: 8, extra: {min_tokens: 8, stop_token_ids: [2, 5]}}\n"))
                .request.extra["stop_token_ids"],
            nlohmann::json({2, 5}));
  EXPECT_EQ(error_of(with_input("backend: {type: local}\nrequest: {extra: {logprobs: 50}}\n")).field(),
            "request.extra.logprobs");
  ConfigError top = error_of(with_input("backend: {type: local}\nrequest: {extra: {top_logprobs: 3}}\n"));
  EXPECT_EQ(top.field(), "request.extra.top_logprobs");
  EXPECT_EQ(top.message(), "needs logprobs: true (the backend is the embedded engine)");
  EXPECT_EQ(error_of(with_input(""), {parse_override("request.extra.logit_bias={\"x\": 5}")}).field(),
            "request.extra.logit_bias");
  // What the engine takes, and what changes nothing, pass.
  const JobSpec local = load(with_input(
      "request: {extra: {top_k: 40, presence_penalty: 0.5, frequency_penalty: -0.5, user: me, logprobs: true, "
      "top_logprobs: 5, logit_bias: {\"7\": -100}, response_format: {type: text}}}\n"));
  EXPECT_EQ(local.request.extra["top_k"], 40);
  EXPECT_EQ(local.request.extra["presence_penalty"], 0.5);
  // Through an API every field passes through, and --backend / --base-url make it one.
  const std::string api_job = with_input("request: {extra: {frequency_penalty: 0.5, min_p: 0.1}}\n");
  EXPECT_EQ(load(with_input("backend: {base_url: http://127.0.0.1:1/v1}\nrequest: {extra: {frequency_penalty: 0.5}}\n"))
                .request.extra["frequency_penalty"],
            0.5);
  EXPECT_EQ(load(api_job, {Override{"backend.base_url", "http://127.0.0.1:1/v1", true, "--base-url"}}).backend.type,
            "openai");
  EXPECT_EQ(load(api_job, {Override{"backend.type", "openai", true, "--backend"}}).request.extra["min_p"], 0.1);
}

TEST_F(JobFile, AliasInsideItsOwnAnchorIsAnError) {
  // A list that contains itself: every walk over the tree used to recurse until the stack ran out.
  ConfigError e = error_of(with_input("request: {extra: {tools: &a [*a]}}\n"));
  EXPECT_EQ(e.file(), "jobs/t.yaml");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(), "nested more than 64 levels deep (an alias inside what its own anchor names?)");
}

TEST_F(JobFile, AliasesThatExpandBeyondTheLimitAreAnError) {
  // Nine lines that stand for 10^9 values once expanded.
  std::string yaml = with_input("request:\n  extra:\n    l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n");
  for (int i = 1; i < 9; ++i) {
    const std::string prev = "*l" + std::to_string(i - 1);
    yaml += "    l" + std::to_string(i) + ": &l" + std::to_string(i) + " [" + prev;
    for (int k = 1; k < 10; ++k) yaml += ", " + prev;
    yaml += "]\n";
  }
  ConfigError e = error_of(yaml);
  EXPECT_EQ(e.message(), "more than 2000000 values (each YAML alias counted as what its anchor names)");
  // Aliases within the bound are fine.
  EXPECT_EQ(load(with_input("backend: {base_url: http://127.0.0.1:1/v1}\nrequest:\n  stop: &s [a, b]\n  extra: {also: *s}\n"))
                .request.extra["also"],
            (nlohmann::json{"a", "b"}));
}

TEST_F(JobFile, OverrideIndexBeyondAnyListNamesTheList) {
  // std::stoul threw its own out_of_range ("stoul"), which named neither flag nor field.
  ConfigError e = error_of(with_input("request:\n  messages: [{role: user, content: hi}]\n"),
                           {parse_override("request.messages.99999999999999999999.content=x")});
  EXPECT_EQ(e.file(), "--set");
  EXPECT_EQ(e.field(), "request.messages.99999999999999999999.content");
  EXPECT_EQ(e.message(), "'request.messages' has 1 entry (0 to 0): there is no entry 99999999999999999999");
  e = error_of(with_input("request:\n  messages: [{role: user, content: hi}, {role: user, content: ho}]\n"),
               {parse_override("request.messages.5.content=x")});
  EXPECT_EQ(e.message(), "'request.messages' has 2 entries (0 to 1): there is no entry 5");
  // An index it cannot be is named as such, not as an unknown key of a message.
  for (const char* index : {"-1", "-0", "+0"}) {
    e = error_of(with_input("request:\n  messages: [{role: user, content: hi}]\n"),
                 {parse_override(std::string("request.messages.") + index + ".content=x")});
    EXPECT_EQ(e.message(), std::string("'request.messages' is a list: its entries are 0, 1, 2, ... ('") + index +
                               "' is no index)");
  }
}

TEST_F(JobFile, UnknownKeyNamesLineFieldAndNearestKey) {
  ConfigError e = error_of(with_input("concurrency: 4\nretry:\n  base: 1s\n  max_attemps: 3\n"));
  EXPECT_STREQ(e.what(), "jobs/t.yaml:5:3: retry.max_attemps: unknown key (did you mean 'max_attempts'?)");
}

TEST_F(JobFile, UnknownKeyFarFromAnyListsValidKeys) {
  ConfigError e = error_of(with_input("rate_limit: {bananas: 3}\n"));
  EXPECT_EQ(e.field(), "rate_limit.bananas");
  EXPECT_EQ(e.message(), "unknown key (valid keys: requests_per_minute, tokens_per_minute)");
}

TEST_F(JobFile, UnknownTopLevelAndMessageKeysSuggest) {
  EXPECT_EQ(error_of(with_input("concurency: 3\n")).message(),
            "unknown key (did you mean 'concurrency'?)");
  ConfigError e = error_of(with_input("request:\n  messages:\n    - {role: user, contnet: hi}\n"));
  EXPECT_EQ(e.field(), "request.messages[0].contnet");
  EXPECT_EQ(e.message(), "unknown key (did you mean 'content'?)");
  EXPECT_EQ(e.line(), 4);
}

TEST_F(JobFile, DuplicateKeyIsAnError) {
  ConfigError e = error_of(with_input("limit: 3\nlimit: 4\n"));
  EXPECT_EQ(e.field(), "limit");
  EXPECT_EQ(e.message(), "duplicate key");
  EXPECT_EQ(e.line(), 3);
}

TEST_F(JobFile, EveryUnknownKeyOfASectionIsNamedAtOnce) {
  ConfigError e = error_of(with_input("concurency: 4\nlimt: 3\nfoo: 1\n"));
  EXPECT_EQ(e.field(), "concurency");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(),
            "unknown key (did you mean 'concurrency'?); also unknown: 'limt' (line 3) (did you mean 'limit'?), "
            "'foo' (line 4)");
}

TEST_F(JobFile, DuplicateKeysAreErrorsAtAnyDepth) {
  ConfigError e = error_of(with_input("request:\n  messages:\n    - {role: user, role: system, content: hi}\n"));
  EXPECT_EQ(e.field(), "request.messages[0].role");
  EXPECT_EQ(e.message(), "duplicate key");
  EXPECT_EQ(e.line(), 4);
  e = error_of(with_input("request:\n  extra: {top_k: 5, top_k: 7}\n"));
  EXPECT_EQ(e.field(), "request.extra.top_k");
  e = error_of(with_input("backend:\n  base_url: http://h/v1\n  headers:\n    X-A: 1\n    X-A: 2\n"));
  EXPECT_EQ(e.field(), "backend.headers.X-A");
  EXPECT_EQ(e.line(), 6);
  e = error_of(with_input(""), {Override{"request.extra", "{a: 1, a: 2}"}});
  EXPECT_EQ(e.file(), "--set");
  EXPECT_EQ(e.field(), "request.extra.a");
}

// Settings that are valid but change nothing are warned about where they are written.
TEST_F(JobFile, SettingsThatChangeNothingAreWarnedAbout) {
  JobSpec job = load(with_input("request:\n  messages:\n    - {role: system, content: \"\"}\n"
                                "    - {role: user, content: \"{{question}}\"}\n"
                                "backend: {type: local, speculative: {method: ngram, model: draft.gguf}}\n"));
  ASSERT_EQ(job.warnings.size(), 2u);
  EXPECT_EQ(job.warnings[0], "jobs/t.yaml:4:31: request.messages[0].content: empty: every item's system turn says nothing");
  EXPECT_EQ(job.warnings[1],
            "jobs/t.yaml:6:60: backend.speculative.model: used only by method draft; method ngram leaves it unread");
  // The draft method reads it; content given, nothing to say.
  EXPECT_TRUE(load(with_input("request: {messages: [{role: user, content: \"{{question}}\"}]}\n"
                              "backend: {type: local, speculative: {method: draft, model: draft.gguf}}\n"))
                  .warnings.empty());
}

TEST_F(JobFile, ANulByteIsAnErrorWhereItIs) {
  ConfigError e = error_of(with_input(std::string("name: x\0y\n", 10)));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.column(), 8);
  EXPECT_EQ(e.message(), "a NUL byte, which YAML text never holds (is this a job file?)");
}

TEST_F(JobFile, BytesThatAreNotUtf8AreAnErrorWhereTheyAre) {
  ConfigError e = error_of(with_input("name: caf\xE9\n"));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.column(), 10);
  EXPECT_EQ(e.message(), "not valid UTF-8 (byte 0xE9); save the job file as UTF-8");
  EXPECT_EQ(error_of("\xFF").line(), 1);
  e = error_of(with_input(""), {Override{"name", "caf\xE9"}});
  EXPECT_EQ(e.file(), "--set");
  EXPECT_EQ(e.field(), "name");
  EXPECT_EQ(e.message(), "value is not valid UTF-8 (byte 0xE9 at offset 3)");
  e = error_of(with_input("name: ${LATIN}\n"), {}, {{"LATIN", "caf\xE9"}});
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(), "environment variable 'LATIN' is not valid UTF-8 (byte 0xE9 at offset 3)");
  EXPECT_EQ(load(with_input("name: caf\xC3\xA9\n")).name, "caf\xC3\xA9");  // UTF-8 is fine
  e = error_of(with_input(""), {}, {{"BATCHLM_MODEL", "/m/caf\xE9.gguf"}});
  EXPECT_EQ(e.field(), "backend.model");
  EXPECT_EQ(e.message(), "$BATCHLM_MODEL is not valid UTF-8 (byte 0xE9 at offset 6)");
}

TEST_F(JobFile, ASecondYamlDocumentIsAnError) {
  ConfigError e = error_of(with_input("limit: 3\n---\nlimit: 4\n"));
  EXPECT_EQ(e.line(), 4);
  EXPECT_EQ(e.message(), "a second YAML document (after '---'); a job file holds one job");
  EXPECT_EQ(load(with_input("limit: 3\n---\n")).limit, 3);  // a closing marker alone is fine
  EXPECT_EQ(load(with_input("limit: 3\n---\n...\n")).limit, 3);
  // Empty documents after it, as many as there are (the first count stopped at three).
  for (const std::string end : {"---\n---\n", "---\n# comment\n---\n", "---\n...\n---\n", "--- &x\n--- !!null\n"})
    EXPECT_EQ(load(with_input("limit: 3\n" + end)).limit, 3) << end;
  EXPECT_EQ(error_of(with_input("limit: 3\n---\n---\nlimit: 4\n")).line(), 5);
  // A lone ',' made the parser find documents without end, until memory ran out.
  for (const std::string text : {",", ",input: in.jsonl\nrequest:\n # x\n"}) {
    SCOPED_TRACE(text);
    e = error_of(text);
    EXPECT_NE(e.message().find("the YAML parser reads document after document here"), std::string::npos) << e.what();
  }
}

TEST_F(JobFile, JobFilesThatAreDirectoriesOrHugeAreRefused) {
  try {
    load_job_file(dir_.string(), {}, env_of({}));
    ADD_FAILURE() << "a directory loaded";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message(), "is a directory, not a job file");
  }
  std::string big = with_input("# ");
  big.append(std::size_t{17} << 20, 'x');
  const std::string path = write("big.yaml", big + "\n");
  try {
    load_job_file(path, {}, env_of({}));
    ADD_FAILURE() << "a 17 MiB job file loaded";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message(), "larger than 16 MiB; a job file names its data (input.path) rather than holding it");
  }
  EXPECT_EQ(load_job_file(write("ok.yaml", with_input("limit: 2\n")), {}, env_of({})).limit, 2);
}

TEST_F(JobFile, TabIndentationIsNamed) {
  ConfigError e = error_of(with_input("request:\n\tmax_tokens: 3\n"));
  EXPECT_NE(e.message().find("indented with a tab"), std::string::npos) << e.what();
}

// A missing closing quote used to take the lines after it in as text: the job ran with those
// settings gone (max_tokens unset, a prompt ending in "max_tokens: 8"), or failed lines later.
TEST_F(JobFile, AQuoteLeftOpenIsNamedWhereItOpens) {
  const std::string messages = "request:\n  messages:\n    - role: user\n";
  // Never closed: the parser takes it to the end of the file.
  ConfigError e = error_of(with_input(messages + "      content: \"{{question}}\n  max_tokens: 8\n  temperature: 0\n"));
  EXPECT_EQ(e.line(), 5);
  EXPECT_EQ(e.column(), 16);
  EXPECT_EQ(e.message(),
            "a quoted string opens here and is never closed: it runs to the end of the file, taking in line 6 "
            "(max_tokens: 8) and every line after it as text; add the closing quote");
  // Closed by the next quote, lines later: the parser stops far from the cause.
  e = error_of(with_input("output: 'out.jsonl\nlimit: 3\nconcurrency: '4'\n" + messages + "      content: x\n"));
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.column(), 9);
  EXPECT_NE(e.message().find("a quoted string opens here and runs on, taking in line 3 (limit: 3) as text, though "
                             "that line is indented like a key of its own (a string's later lines are indented past "
                             "its key): is a closing quote missing? (the YAML parser then stopped at line 4"),
            std::string::npos)
      << e.what();
  // Closed at the end of a later line, which parses: the tree confirms the quoted string.
  e = error_of(with_input(messages + "      content: \"{{question}}\n  stop: x\"\n"));
  EXPECT_EQ(e.line(), 5);
  EXPECT_NE(e.message().find("taking in line 6 (stop: x\")"), std::string::npos) << e.what();
  // A string's later lines as far in as its key: not what YAML asks, but what parsers take.
  EXPECT_EQ(load(with_input(messages + "      content: \"Reply in this form:\n      answer: <a number>\n"
                                       "      Passage: {{question}}\"\n"))
                .request.messages[0]
                .content,
            "Reply in this form: answer: <a number> Passage: {{question}}");
}

TEST_F(JobFile, QuotesThatAreNotRunawayStringsPass) {
  const std::string job = with_input(
      "# a comment's apostrophe and a \" in it\n"
      "request:\n"
      "  stop: [\"\\n\\n\", 'it''s', \"a \\\" b\", plain, x y]\n"
      "  messages:\n"
      "    - role: system\n"
      "      content: |\n"
      "        A block scalar with an open \" quote\n"
      "        and a line that reads: as a key\n"
      "    - role: user\n"
      "      content: \"a quoted string over\n"
      "        several lines, indented: more than its key\n"
      "        ends here\"\n"
      "    - role: assistant\n"
      "      content: it's plain text with \"quotes and an ' apostrophe\n"
      "    - role: user\n"
      "      content: >-\n"
      "        folded 'text\n"
      "    - role: assistant\n"
      "      content:\n"
      "        \"a value on the line below its key,\n"
      "        Question: its later lines as far in as its first\"\n"
      "    - {role: user,\n"
      "       content: \"in braces,\n"
      "       Answer: indentation means nothing\"}\n"
      "    - role: assistant\n"
      "      content: plain text that goes on\n"
      "        'on a line of its own, with a quote\n"
      "  max_tokens: 8\n");
  const JobSpec spec = load(job);
  EXPECT_EQ(spec.request.max_tokens, 8);
  ASSERT_EQ(spec.request.messages.size(), 7u);
  EXPECT_EQ(spec.request.messages[1].content, "a quoted string over several lines, indented: more than its key ends here");
  EXPECT_EQ(spec.request.messages[2].content, "it's plain text with \"quotes and an ' apostrophe");
  EXPECT_EQ(spec.request.messages[4].content, "a value on the line below its key, Question: its later lines as far in as its first");
  EXPECT_EQ(spec.request.messages[5].content, "in braces, Answer: indentation means nothing");
  EXPECT_EQ(spec.request.messages[6].content, "plain text that goes on 'on a line of its own, with a quote");
  // A parse error elsewhere is not blamed on a quote inside plain text: the tab is named.
  ConfigError e = error_of(with_input("request:\n  messages:\n    - role: user\n      content: Describe the author\n"
                                      "        'style and then\n  max_tokens: 8\n\tstop: x\n"));
  EXPECT_NE(e.message().find("indented with a tab"), std::string::npos) << e.what();
}

TEST_F(JobFile, HeaderNamesAndValuesAreChecked) {
  const std::string api = "backend:\n  base_url: http://h/v1\n  headers:\n";
  ConfigError e = error_of(with_input(api + "    \"bad header\": x\n"));
  EXPECT_EQ(e.field(), "backend.headers.bad header");
  EXPECT_EQ(e.line(), 5);
  EXPECT_EQ(e.message(), "not a valid header name (letters, digits and !#$%&'*+-.^_`|~ only)");
  e = error_of(with_input(api + "    X-A: \"x\\r\\nInjected: yes\"\n"));
  EXPECT_EQ(e.field(), "backend.headers.X-A");
  EXPECT_EQ(e.message(), "the value holds a line break or another control character");
  const JobSpec job = load(with_input(api + "    X-Trace_Id.v2: \"a\\tb c\"\n"));
  ASSERT_EQ(job.backend.headers.size(), 1u);
  EXPECT_EQ(job.backend.headers[0].second, "a\tb c");
}

// Placeholders are filled in the messages and the model only: one in stop or extra goes out as
// written, which the job is warned about (it still loads: a stop string may be "{{" on purpose).
TEST_F(JobFile, PlaceholdersOutsideTheMessagesAreWarnedAbout) {
  JobSpec job = load(with_input("backend: {base_url: http://h/v1}\n"
                                "request:\n"
                                "  messages: [{role: user, content: \"{{question}}\"}]\n"
                                "  stop: [\"END\", \"{{name}}:\"]\n"
                                "  extra: {user: \"{{id}}\", metadata: {tags: [\"a\", \"{{tag}}\"]}, note: \"{{ not closed\"}\n"));
  ASSERT_EQ(job.warnings.size(), 3u);
  EXPECT_EQ(job.warnings[0],
            "jobs/t.yaml:5:17: request.stop[1]: '{{name}}:' is sent as written: placeholders are filled in "
            "request.messages and request.model only");
  EXPECT_NE(job.warnings[1].find("request.extra.metadata.tags[1]: '{{tag}}' is sent as written"), std::string::npos)
      << job.warnings[1];
  EXPECT_NE(job.warnings[2].find("jobs/t.yaml:6:17: request.extra.user: '{{id}}' is sent as written"),
            std::string::npos)
      << job.warnings[2];
  EXPECT_TRUE(load(with_input("request: {messages: [{role: user, content: \"{{question}}\"}], stop: [\"{{\"]}\n"))
                  .warnings.empty());
}

TEST_F(JobFile, SettingsForTheOtherKindOfBackend) {
  // A base URL on the embedded engine: which one was meant?
  ConfigError e = error_of(with_input("backend: {type: local, base_url: http://h/v1}\n"));
  EXPECT_EQ(e.field(), "backend.base_url");
  EXPECT_EQ(e.line(), 2);
  e = error_of(with_input(""), {Override{"backend.type", "local", true, "--backend"},
                                Override{"backend.base_url", "http://h/v1", true, "--base-url"}});
  EXPECT_EQ(e.file(), "--base-url");
  // Engine settings on an API, API settings on the engine: warnings, the job loads.
  JobSpec job = load(with_input("backend: {base_url: http://h/v1, threads: 4, model: m.gguf, speculative: {method: ngram}}\n"));
  ASSERT_EQ(job.warnings.size(), 3u);
  EXPECT_EQ(job.warnings[0],
            "jobs/t.yaml:2:43: backend.threads: has no effect on an API (backend.type is openai); it sets up "
            "the embedded engine");
  EXPECT_NE(job.warnings[1].find("backend.speculative"), std::string::npos);
  EXPECT_EQ(job.warnings[2],
            "jobs/t.yaml:2:53: backend.model: names a GGUF file, but the backend is an API: it is sent as the "
            "model's name");
  job = load(with_input("backend: {timeouts: {total: 5s}}\n"));
  ASSERT_EQ(job.warnings.size(), 1u);
  EXPECT_EQ(job.warnings[0], "jobs/t.yaml:2:21: backend.timeouts: has no effect on the embedded engine (backend.type is local)");
  EXPECT_TRUE(load(with_input("backend: {threads: 2}\n")).warnings.empty());
}

TEST_F(JobFile, AMapMadeByASetIsBlamedOnTheSet) {
  // --set backend.timeouts.connect=1s makes backend.timeouts; no line of the file wrote it.
  JobSpec job = load(with_input(""), {Override{"backend.timeouts.connect", "1s"}});
  ASSERT_EQ(job.warnings.size(), 1u);
  EXPECT_EQ(job.warnings[0], "--set: backend.timeouts: has no effect on the embedded engine (backend.type is local)");
  // A field missing from a map a --set made: the --set, not the file.
  ConfigError e = error_of(with_input(""), {Override{"backend.speculative.method", "draft"}});
  EXPECT_EQ(e.field(), "backend.speculative.model");
  EXPECT_EQ(e.file(), "--set");
  // The same map written in the file is the file's.
  e = error_of(with_input("backend: {speculative: {k_max: 4}}\n"), {Override{"backend.speculative.method", "draft"}});
  EXPECT_EQ(e.file(), "jobs/t.yaml");
  EXPECT_EQ(e.line(), 2);
  // A one-value section a --set turns into a map keeps its value's place: the file's path is
  // the file's to fix, whatever else a flag set beside it.
  e = error_of("name: t\ninput: missing.jsonl\nrequest: {messages: [{role: user, content: \"{{q}}\"}]}\n",
               {Override{"input.format", "jsonl"}});
  EXPECT_EQ(e.field(), "input.path");
  EXPECT_EQ(e.file(), "jobs/t.yaml");
  EXPECT_EQ(e.line(), 2);
}

TEST_F(JobFile, OutputThatNamesADirectoryIsAnError) {
  ConfigError e = error_of(with_input("output: out/x.jsonl/\n"));
  EXPECT_EQ(e.field(), "output.path");
  EXPECT_EQ(e.message(), "'out/x.jsonl/' names a directory; give a file, e.g. out/x.jsonl/t.jsonl");
  e = error_of(with_input(""), {Override{"output.path", dir_.string(), true, "-o"}});
  EXPECT_EQ(e.file(), "-o");
  EXPECT_FALSE(fs::exists("out/x.jsonl"));
}

TEST_F(JobFile, ScoringNeedsReferencesAndPatternNeedsRegex) {
  ConfigError e = error_of(R"(synth: {count: 3, variables: {a: [x]}}
request: {messages: [{role: user, content: "{{a}}"}]}
scoring: gsm8k
)");
  EXPECT_EQ(e.field(), "scoring");
  EXPECT_EQ(e.line(), 3);
  EXPECT_EQ(e.message(),
            "needs reference answers from an input file; a synth job without input has none (regex scoring needs "
            "none)");
  // Regex scoring reads the output alone: a synth job may check its outputs' form.
  EXPECT_EQ(load(R"(synth: {count: 3, variables: {a: [x]}}
request: {messages: [{role: user, content: "{{a}}"}]}
scoring: {type: regex, pattern: "^Once"}
)").scoring.kind,
            ScoringKind::Regex);
  e = error_of(with_input("scoring: {type: gsm8k, pattern: x}\n"));
  EXPECT_EQ(e.field(), "scoring.pattern");
  EXPECT_EQ(e.message(), "only used by regex scoring (scoring.type: regex)");
}

TEST_F(JobFile, InputPathsThatAreNoFileSayWhatTheyAre) {
  ConfigError e = error_of("input: " + dir_.string() + "\n");
  EXPECT_EQ(e.message(), "'" + dir_.string() + "' is a directory, not a file");
  e = error_of("input: no/such.jsonl\n");
  EXPECT_EQ(e.message().rfind("input file not found: 'no/such.jsonl' (relative paths are taken from the current "
                              "directory, ", 0), 0u)
      << e.message();
}

TEST_F(JobFile, HugeIntegersAreOutOfRangeNotMalformed) {
  ConfigError e = error_of(with_input("concurrency: 99999999999999999999\n"));
  EXPECT_EQ(e.message(), "must be between 1 and 100000, got 99999999999999999999");
  // Where only the type bounds a value, one past it is too large (or too small), not "must be >= 0".
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"request: {seed: 99999999999999999999}", "too large: the largest allowed is 9223372036854775807, got 99999999999999999999"},
      {"request: {seed: -99999999999999999999}", "too small: the smallest allowed is -9223372036854775808, got -99999999999999999999"},
      {"limit: 99999999999999999999999", "too large: the largest allowed is 9223372036854775807, got 99999999999999999999999"},
      {"limit: 1e30", "too large: the largest allowed is 9223372036854775807, got 1e30"},
      {"synth: {seed: 99999999999999999999}", "too large: the largest allowed is 18446744073709551615, got 99999999999999999999"},
      {"backend: {kv_memory: 16EiB}", "too large: the largest allowed is 9000000000000000000 bytes (about 7.8EiB), got '16EiB'"},
  };
  for (const auto& [yaml, message] : cases) EXPECT_EQ(error_of(with_input(yaml + "\n")).message(), message) << yaml;
  // Written with an exponent, a whole number within the range is taken.
  EXPECT_EQ(load(with_input("limit: 1e17\n")).limit, 100000000000000000);
  EXPECT_EQ(load(with_input("backend: {kv_memory: 1EiB}\n")).backend.kv_bytes, std::int64_t{1} << 60);
}

TEST_F(JobFile, WrongTypeQuotesTheValue) {
  ConfigError e = error_of(with_input("request:\n  temperature: abc\n"));
  EXPECT_STREQ(e.what(), "jobs/t.yaml:3:16: request.temperature: expected a number, got 'abc'");
  EXPECT_EQ(error_of(with_input("concurrency: 1.5\n")).message(), "expected an integer, got '1.5'");
  EXPECT_EQ(error_of(with_input("backend: {stream: maybe}\n")).message(),
            "expected true or false, got 'maybe'");
  EXPECT_EQ(error_of(with_input("retry: [1, 2]\n")).message(), "expected a map, got a list");
  EXPECT_EQ(error_of(with_input("request: {model: [a]}\n")).message(),
            "expected a string, got a list");
  EXPECT_EQ(error_of(with_input("synth: {variables: {x: 3}}\nkind: eval\n")).message(),
            "expected a list of choices, got '3'");
}

TEST_F(JobFile, OutOfRangeValuesAreRejectedWithBounds) {
  struct Case {
    std::string yaml, field, message;
  };
  std::vector<Case> cases = {
      {"concurrency: 0", "concurrency", "must be between 1 and 100000, got 0"},
      {"retry: {max_attempts: 0}", "retry.max_attempts", "must be between 1 and 1000, got 0"},
      {"request: {temperature: 2.5}", "request.temperature", "must be between 0 and 2, got 2.5"},
      {"request: {top_p: 1.5}", "request.top_p", "must be between 0 and 1, got 1.5"},
      {"request: {max_tokens: 0}", "request.max_tokens", "must be between 1 and 2147483647, got 0"},
      {"rate_limit: {requests_per_minute: -5}", "rate_limit.requests_per_minute",
       "must be between 0 and 1e+12, got -5"},
      {"output: {flush_every: 0}", "output.flush_every", "must be between 1 and 1000000, got 0"},
      {"limit: -1", "limit", "must be >= 0, got -1"},
      {"retry: {base: 10s, cap: 1s}", "retry.cap", "must be >= retry.base (10000ms), got 1000ms"},
      {"retry: {budget_min_per_second: 0}", "retry.budget_min_per_second",
       "must be at least 0.1 (a retry every 10 s): with less, once every item has been sent the budget would never "
       "allow another retry and the run would wait for good"},
  };
  for (const Case& c : cases) {
    ConfigError e = error_of(with_input(c.yaml + "\n"));
    EXPECT_EQ(e.field(), c.field) << c.yaml;
    EXPECT_EQ(e.message(), c.message) << c.yaml;
    EXPECT_EQ(e.line(), 2) << c.yaml;
  }
}

TEST_F(JobFile, ASynthJobMadeAnEvalSaysWhatMadeIt) {
  const std::string synth = "synth: {count: 3}\nrequest:\n  messages: [{role: user, content: hi}]\n";
  ConfigError flag = error_of(synth, {parse_override("kind=eval")});
  EXPECT_EQ(flag.field(), "input");
  EXPECT_EQ(flag.message(),
            "required: kind is eval (--set), and an eval job reads its items from an input (a JSONL file, or "
            "{path, format}); for a synth job, leave kind out or set it to synth");
  ConfigError file = error_of(synth + "kind: eval\n");
  EXPECT_NE(file.message().find("required: kind is eval (line 4)"), std::string::npos) << file.message();
  // Without a synth section the job is plainly an eval job.
  EXPECT_EQ(error_of("request:\n  messages: [{role: user, content: hi}]\n").message(),
            "required (a JSONL file, or {path, format})");
}

TEST_F(JobFile, BadEnumValueListsTheValidOnes) {
  EXPECT_EQ(error_of(with_input("kind: evaluate\n")).message(),
            "bad value 'evaluate' (expected one of: eval, synth)");
  ConfigError e = error_of(with_input("scoring: gsm9k\n"));
  EXPECT_EQ(e.field(), "scoring");
  EXPECT_EQ(e.message(), "bad value 'gsm9k' (expected one of: none, gsm8k, exact_match, regex)");
  EXPECT_EQ(error_of(with_input("scoring: {type: fuzzy}\n")).field(), "scoring.type");
  EXPECT_EQ(error_of("input: {path: " + input_ + ", format: csv}\n").message(),
            "bad value 'csv' (expected one of: auto, jsonl, batch)");
  EXPECT_EQ(error_of(with_input("request:\n  messages: [{role: robot, content: x}]\n")).field(),
            "request.messages[0].role");
}

TEST_F(JobFile, MissingInputFileIsReportedAtLoad) {
  ConfigError e = error_of("name: x\ninput: " + (dir_ / "nope.jsonl").string() + "\n");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.column(), 8);
  EXPECT_EQ(e.field(), "input");
  EXPECT_EQ(e.message(), "input file not found: '" + (dir_ / "nope.jsonl").string() + "'");
  EXPECT_EQ(error_of("input: {path: /nonexistent/x.jsonl}\n").field(), "input.path");
}

TEST_F(JobFile, MissingFewShotFileIsReportedAtLoad) {
  ConfigError e = error_of(with_input("few_shot: {path: /nonexistent/train.jsonl, count: 2}\n"));
  EXPECT_EQ(e.field(), "few_shot.path");
  EXPECT_EQ(e.message(), "few-shot file not found: '/nonexistent/train.jsonl'");
  EXPECT_EQ(error_of(with_input("few_shot: {path: " + input_ + "}\n")).field(), "few_shot.count");
}

TEST_F(JobFile, InputIsRequiredForAnEvalJob) {
  ConfigError e = error_of("name: x\n");
  EXPECT_EQ(e.field(), "input");
  EXPECT_EQ(e.message(), "required (a JSONL file, or {path, format})");
  EXPECT_EQ(error_of("").field(), "input");
  // Written with nothing after it: named at its own line, not the file's first.
  for (const std::string text : {"name: x\ninput:\nrequest: {messages: [{role: user, content: hi}]}\n",
                                 "name: x\ninput: ~\n"}) {
    const ConfigError empty = error_of(text);
    EXPECT_EQ(empty.field(), "input");
    EXPECT_EQ(empty.line(), 2) << text;
    EXPECT_EQ(empty.message(), "is empty: give a JSONL file, or {path, format}");
  }
}

TEST_F(JobFile, SynthJobWithCountNeedsNoInput) {
  JobSpec job = load(R"(kind: synth
synth: {count: 5, seed: 9, variables: {animal: [cat, dog]}}
request: {messages: [{role: user, content: "A story about a {{animal}}"}]}
)");
  EXPECT_EQ(job.kind, JobKind::Synth);
  EXPECT_TRUE(job.input.path.empty());
  EXPECT_EQ(job.synth.count, 5);
  EXPECT_EQ(job.synth.seed, 9u);
  EXPECT_EQ(job.synth.variables.at("animal"), (std::vector<std::string>{"cat", "dog"}));
  ConfigError e = error_of("kind: synth\nrequest: {messages: [{role: user, content: hi}]}\n");
  EXPECT_EQ(e.field(), "synth.count");
  EXPECT_EQ(error_of("synth: {count: 3}\n").field(), "request.messages");
}

TEST_F(JobFile, SynthVariableNamesATemplateCannotReachAreErrors) {
  // {{a.b}} reads field b of a: a variable named "a.b" was accepted, then never found.
  for (const std::string name : {"\"a.b\"", "\"a b\"", "\"{a}\"", "\"\""}) {
    SCOPED_TRACE(name);
    ConfigError e = error_of("kind: synth\nsynth: {count: 3, variables: {" + name +
                             ": [x]}}\nrequest: {messages: [{role: user, content: hi}]}\n");
    EXPECT_EQ(e.line(), 2);
    EXPECT_NE(e.message().find("a variable name cannot be empty or hold '.'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(load("kind: synth\nsynth: {count: 3, variables: {topic-2_b: [x]}}\n"
                 "request: {messages: [{role: user, content: \"{{topic-2_b}}\"}]}\n")
                .synth.variables.size(),
            1u);
}

TEST_F(JobFile, InvalidYamlReportsTheParserPosition) {
  ConfigError e = error_of("name: x\nrequest: {messages: [\n  oops: : :\n");
  EXPECT_EQ(e.file(), "jobs/t.yaml");
  EXPECT_GT(e.line(), 1);
  EXPECT_GT(e.column(), 0);
  EXPECT_EQ(e.message().rfind("invalid YAML: ", 0), 0u) << e.what();
  // An unquoted ${...} in a flow map ends it early: the message says to quote it.
  e = error_of("input: in.jsonl\nfew_shot: {path: ${BATCHLM_DATA:-data}/train.jsonl, count: 8}\n");
  EXPECT_EQ(e.line(), 2);
  EXPECT_NE(e.message().find("must be quoted"), std::string::npos) << e.what();
}

TEST_F(JobFile, RootThatIsNotAMapIsAnError) {
  EXPECT_EQ(error_of("- a\n- b\n").message(), "expected a map of job settings, got a list");
}

TEST_F(JobFile, RegexScoringNeedsAValidPattern) {
  EXPECT_EQ(error_of(with_input("scoring: regex\n")).field(), "scoring.pattern");
  ConfigError e = error_of(with_input("scoring: {type: regex, pattern: \"a(b\"}\n"));
  EXPECT_EQ(e.field(), "scoring.pattern");
  EXPECT_EQ(e.message().rfind("not a valid regex", 0), 0u);
  EXPECT_EQ(load(with_input("scoring: {type: regex, pattern: '^yes'}\n")).scoring.pattern, "^yes");
  // A YAML block keeps its last line break, which the output would then have to hold: warned.
  const JobSpec block = load(with_input("scoring:\n  type: regex\n  pattern: |\n    ^42$\n"));
  EXPECT_EQ(block.scoring.pattern, "^42$\n");
  ASSERT_EQ(block.warnings.size(), 1u);
  EXPECT_NE(block.warnings[0].find("scoring.pattern: ends with a line break"), std::string::npos) << block.warnings[0];
  EXPECT_TRUE(load(with_input("scoring:\n  type: regex\n  pattern: |-\n    ^42$\n")).warnings.empty());
}

// Found by fuzzing (tests/fuzz/corpus/job): std::regex read the back-reference \777...7 into a
// long that overflowed, and recursed once per nested group. PCRE2 reads both with limits and
// says where it stopped, in characters.
TEST_F(JobFile, RegexErrorsSayWhatAndWhere) {
  ConfigError e = error_of(with_input("scoring: {type: regex, pattern: 'a{1,99999999999}'}\n"));
  EXPECT_EQ(e.field(), "scoring.pattern");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(), "not a valid regex: number too big in {} quantifier at character 10");
  EXPECT_EQ(error_of(with_input("scoring: {type: regex, pattern: 'é{1,99999999999}'}\n")).message(),
            "not a valid regex: number too big in {} quantifier at character 10");
  EXPECT_EQ(error_of(with_input("scoring: {type: regex, pattern: '" + std::string(5000, '(') + "'}\n")).message(),
            "not a valid regex: parentheses are too deeply nested at character 252");
  EXPECT_EQ(error_of(with_input("scoring: {type: regex, pattern: 'a(b'}\n")).message(),
            "not a valid regex: missing closing parenthesis at the end");
  EXPECT_EQ(error_of(with_input("scoring: {type: regex, pattern: '(a)\\2'}\n")).message(),
            "not a valid regex: reference to non-existent subpattern at character 5");
  // A long octal escape, ordinary counts and references, an escaped backslash before digits.
  EXPECT_EQ(load(with_input("scoring: {type: regex, pattern: '#### (\\7777777777777777777777) (a)\\2 b{2,3} \\\\12345678901234'}\n"))
                .scoring.kind,
            ScoringKind::Regex);
}

TEST_F(JobFile, BaseUrlMustBeHttp) {
  EXPECT_EQ(error_of(with_input("backend: {base_url: localhost:8000}\n")).field(), "backend.base_url");
  for (const char* url : {"ftp://x/v1", "http://a b/v1", "http:///v1", "http://:8000/v1", "http://h:0/v1",
                          "http://h:99999/v1", "http://h:x/v1"}) {
    ConfigError e = error_of(with_input("backend: {base_url: \"" + std::string(url) + "\"}\n"));
    EXPECT_EQ(e.field(), "backend.base_url") << url;
    EXPECT_EQ(e.line(), 2) << url;
  }
  EXPECT_NE(error_of(with_input("backend: {base_url: \"http://a b/v1\"}\n")).message().find("a space at character 9"),
            std::string::npos);
  for (const char* url : {"http://127.0.0.1:8000/v1", "https://api.example.com/v1", "http://[::1]:8000/v1",
                          "http://user@host/v1", "http://host", "http://[::1]/v1",
                          "https://x.example.com/openai/deployments/d?api-version=2024-10-21"})
    EXPECT_EQ(load(with_input("backend: {base_url: \"" + std::string(url) + "\"}\n")).backend.base_url, url);
  // Brackets are an IPv6 address's, around the whole host; a fragment never reaches a server.
  for (const char* url : {"http://[::1/v1", "http://::1]/v1", "http://[]/v1", "http://a[1]/v1", "http://[[::1]]/v1"}) {
    ConfigError e = error_of(with_input("backend: {base_url: \"" + std::string(url) + "\"}\n"));
    EXPECT_EQ(e.field(), "backend.base_url") << url;
    EXPECT_NE(e.message().find("(an IPv6 address goes in brackets"), std::string::npos) << url << ": " << e.message();
  }
  EXPECT_EQ(error_of(with_input("backend: {base_url: \"http://h/v1#x\"}\n")).message(),
            "a fragment ('#') in 'http://h/v1#x': it is never sent to a server; leave it out");
}

// Fields the request has its own keys for are set there, checked; from the extra fields they
// would go out unchecked when the typed one is unset, or be dropped without a word.
TEST_F(JobFile, ExtraFieldsMayNotStandForTheRequestsOwn) {
  const std::string api = "backend: {base_url: http://127.0.0.1:1/v1}\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"max_tokens: -1", "set it as request.max_tokens, where it is checked"},
      {"temperature: 99", "set it as request.temperature, where it is checked"},
      {"top_p: 7", "set it as request.top_p, where it is checked"},
      {"stop: [x]", "set it as request.stop, where it is checked"},
      {"seed: 1", "set it as request.seed, where it is checked"},
      {"model: other", "set it as backend.model or request.model, where it is checked"},
      {"messages: []", "set it as request.messages, where it is checked"},
      {"prompt: hi", "a job sends chats: write the text as a user message in request.messages"},
      {"stream: false", "set it as backend.stream"},
  };
  for (const auto& [field, message] : cases) {
    const std::string key = field.substr(0, field.find(':'));
    for (const std::string& backend : {api, std::string()}) {
      ConfigError e = error_of(with_input(backend + "request:\n  extra:\n    " + field + "\n"));
      EXPECT_EQ(e.field(), "request.extra." + key) << field;
      EXPECT_EQ(e.line(), backend.empty() ? 4 : 5) << field;
      EXPECT_EQ(e.message(), message) << field;
    }
  }
  // What only APIs have their own names for still passes: max_completion_tokens (reasoning
  // models), stream_options (the client adds include_usage).
  const JobSpec job = load(with_input(api + "request:\n  max_tokens: null\n  extra: {max_completion_tokens: 500, "
                                            "stream_options: {continuous_usage_stats: true}}\n"));
  EXPECT_EQ(job.request.extra["max_completion_tokens"], 500);
  // Checked as request.max_tokens is (the rate limiter counts with it), and not given beside it.
  for (const char* bad : {"0", "-3", "2147483648", "1.5", "\"9\""}) {
    const ConfigError e = error_of(with_input(api + "request:\n  extra: {max_completion_tokens: " + bad + "}\n"));
    EXPECT_EQ(e.field(), "request.extra.max_completion_tokens") << bad;
    EXPECT_EQ(e.message(), "expected an integer from 1 to 2147483647") << bad;
  }
  EXPECT_EQ(error_of(with_input(api + "request:\n  max_tokens: 10\n  extra: {max_completion_tokens: 500}\n")).message(),
            "given with request.max_tokens: the two are one limit; keep one of them (request.max_tokens: null)");
}

TEST_F(JobFile, EmptyApiKeyVariableIsRefused) {
  ConfigError e = error_of(with_input("backend: {base_url: http://127.0.0.1:1/v1, api_key_env: \"\"}\n"));
  EXPECT_EQ(e.field(), "backend.api_key_env");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.message(), "empty; name the environment variable that holds the API key (default OPENAI_API_KEY)");
}

// $OPENAI_BASE_URL is where the requests go when the job names no base_url: checked as
// backend.base_url is, and named in the error, before anything is sent.
TEST_F(JobFile, BaseUrlFromTheEnvironmentIsCheckedToo) {
  const std::string job = with_input("backend: {type: openai}\n");
  for (const char* url : {"notaurl", "ftp://x/v1", "http://a b/v1", ""}) {
    ConfigError e = error_of(job, {}, {{"OPENAI_BASE_URL", url}});
    EXPECT_EQ(e.field(), "backend.base_url") << url;
    EXPECT_EQ(e.message().rfind("$OPENAI_BASE_URL is ", 0), 0u) << e.what();
  }
  EXPECT_EQ(error_of(job, {}, {{"OPENAI_BASE_URL", "notaurl"}}).message(),
            "$OPENAI_BASE_URL is not usable: expected an http:// or https:// URL, got 'notaurl' (or give "
            "backend.base_url or --base-url)");
  EXPECT_NE(error_of(job, {}, {{"OPENAI_BASE_URL", ""}}).message().find("is set but empty"), std::string::npos);
  // Not read where the job names its own URL, nor for the embedded engine.
  EXPECT_EQ(load(with_input("backend: {base_url: http://h/v1}\n"), {}, {{"OPENAI_BASE_URL", "notaurl"}}).backend.base_url,
            "http://h/v1");
  EXPECT_EQ(load(with_input(""), {}, {{"OPENAI_BASE_URL", "notaurl"}}).backend.type, "local");
  // A scheme in capitals is the same scheme, kept in lower case; the rest as given.
  EXPECT_EQ(load(job, {}, {{"OPENAI_BASE_URL", "HTTPS://Api.Example.com/V1"}}).backend.base_url,
            "https://Api.Example.com/V1");
  EXPECT_EQ(load(with_input("backend: {base_url: Http://h/v1}\n")).backend.base_url, "http://h/v1");
  EXPECT_EQ(error_of(with_input("backend: {base_url: \"HTTPX://h/v1\"}\n")).message(),
            "expected an http:// or https:// URL, got 'HTTPX://h/v1'");
}

TEST_F(JobFile, ExpandsEnvironmentInEveryStringScalar) {
  JobSpec job = load(R"(input: ${DIR}/in.jsonl
name: run-${TAG:-dev}
request:
  messages: [{role: user, content: "Cost: $$5, ${GREETING}"}]
  stop: ["${STOP:-END}"]
backend: {headers: {X-User: "${USER_NAME}"}}
concurrency: ${CONC:-4}
)",
                     {}, {{"DIR", dir_.string()}, {"GREETING", "hi"}, {"USER_NAME", "ann"}});
  EXPECT_EQ(job.input.path, input_);
  EXPECT_EQ(job.name, "run-dev");
  EXPECT_EQ(job.request.messages[0].content, "Cost: $5, hi");
  EXPECT_EQ(job.request.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(job.backend.headers[0].second, "ann");
  EXPECT_EQ(job.concurrency, 4);
}

TEST_F(JobFile, UnsetVariableWithoutDefaultIsAnErrorAtItsLine) {
  ConfigError e = error_of(with_input("name: x\nbackend:\n  model: ${MODEL}\n"));
  EXPECT_STREQ(e.what(),
               "jobs/t.yaml:4: backend.model: environment variable 'MODEL' is not set (give a "
               "default with ${MODEL:-value})");
}

TEST(ExpandEnv, HandlesDefaultsEmptyValuesAndLiterals) {
  EnvLookup env = env_of({{"A", "1"}, {"EMPTY", ""}});
  EXPECT_EQ(expand_env("x${A}y", env, "f", 1, "k"), "x1y");
  EXPECT_EQ(expand_env("${B:-two}", env, "f", 1, "k"), "two");
  EXPECT_EQ(expand_env("${B:-}", env, "f", 1, "k"), "");
  EXPECT_EQ(expand_env("${EMPTY:-d}", env, "f", 1, "k"), "d");
  EXPECT_EQ(expand_env("${EMPTY}", env, "f", 1, "k"), "");
  EXPECT_EQ(expand_env("$$A and $$${A}", env, "f", 1, "k"), "$A and $1");
  EXPECT_EQ(expand_env("costs $5", env, "f", 1, "k"), "costs $5");
  EXPECT_EQ(expand_env("${B:-${A}}/${B:-${C:-x}y}", env, "f", 1, "k"), "1/xy");  // nested defaults
  EXPECT_THROW(expand_env("${B:-${A}", env, "f", 1, "k"), ConfigError);
  EXPECT_THROW(expand_env("${A", env, "f", 1, "k"), ConfigError);
  EXPECT_THROW(expand_env("${1X}", env, "f", 1, "k"), ConfigError);
}

TEST_F(JobFile, OverridesApplyTypedValuesBeforeValidation) {
  JobSpec job = load(with_input("concurrency: 4\n"),
                     {parse_override("concurrency=8"), parse_override("retry.base=2s"),
                      parse_override("request.stop=[a, b]"),
                      parse_override("backend.headers.X-Run=7"),
                      parse_override("scoring=gsm8k")});
  EXPECT_EQ(job.concurrency, 8);
  EXPECT_EQ(job.retry.base, 2s);
  EXPECT_EQ(job.request.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(job.backend.headers[0].second, "7");
  EXPECT_EQ(job.scoring.kind, ScoringKind::Gsm8k);
}

// A value is one YAML value: what a closed quote or bracket leaves over, or a second document,
// is refused, not dropped. And it changes only the field it names, not the aliases of an anchor
// the file set there.
TEST_F(JobFile, AnOverrideIsOneValueForOneField) {
  const std::pair<std::string, std::string> cases[] = {
      {"request.stop='Don't stop'", "--set: request.stop: value ends before 't stop'', which is left over (a quote "
                                    "inside '...' is written '', inside \"...\" \\\")"},
      {"request.stop=[a, b] c", "--set: request.stop: value ends before 'c', which is left over (a quote inside '...' "
                                "is written '', inside \"...\" \\\")"},
      {"request.stop=a\n---\nb", "--set: request.stop: value holds a second YAML document (after '---'); give one value"},
  };
  for (const auto& [set, said] : cases) EXPECT_STREQ(error_of(with_input(""), {parse_override(set)}).what(), said.c_str());
  EXPECT_EQ(load(with_input(""), {parse_override("request.stop='it''s'")}).request.stop, std::vector<std::string>{"it's"});
  JobSpec job = load(with_input("request: {max_tokens: &n 5, messages: [{role: user, content: a}]}\nconcurrency: *n\n"),
                     {parse_override("request.max_tokens=7")});
  EXPECT_EQ(job.request.max_tokens, 7);
  EXPECT_EQ(job.concurrency, 5);
  // A message repeated by an alias: only the one named changes.
  job = load(with_input("request:\n  messages: [&m {role: user, content: a}, {role: assistant, content: ok}, *m]\n"),
             {parse_override("request.messages.0.content=b")});
  EXPECT_EQ(job.request.messages[0].content, "b");
  EXPECT_EQ(job.request.messages[2].content, "a");
  // A key set keeps its place among the others: request.extra goes out in the order given.
  job = load(with_input("request:\n  messages: [{role: user, content: a}]\n  extra: {metadata: {a: 1, b: 2, c: 3}}\n"),
             {parse_override("request.extra.metadata.a=9")});
  EXPECT_EQ(job.request.extra["metadata"].dump(), R"({"a":9,"b":2,"c":3})");
  job = load(with_input("request:\n  messages: [{role: user, content: a}]\n  extra: {metadata: {a: &x 1, b: 2, c: *x}}\n"),
             {parse_override("request.extra.metadata.a=9")});
  EXPECT_EQ(job.request.extra["metadata"].dump(), R"({"a":9,"b":2,"c":1})");
}

// A key JSON has no name for (a list, a map, null) would be sent as "", colliding with the
// others; a tag batchlm does not read would leave its bare text in place. Both are refused
// where they are, in the file or in a --set.
TEST_F(JobFile, KeysAreNamesAndTagsAreYamlsOwn) {
  ConfigError e = error_of(with_input("request:\n  messages: [{role: user, content: a}]\n  extra: {metadata: {? [a, b] : c}}\n"));
  EXPECT_EQ(e.line(), 4);
  EXPECT_EQ(e.field(), "request.extra.metadata");
  EXPECT_EQ(e.message(), "a key that is a list; keys are names");
  EXPECT_EQ(error_of(with_input(""), {parse_override("request.extra={~: c}")}).message(),
            "a null key; quote it ('~') if that is the name");
  e = error_of(with_input("request:\n  messages: [{role: user, content: !include prompt.txt}]\n"));
  EXPECT_EQ(e.line(), 3);
  EXPECT_EQ(e.message(), "the YAML tag '!include' is not one batchlm reads (it would take the text after it as is); "
                         "remove it, or quote the value");
  // YAML's own tags, and a quoted '~' key, are taken.
  JobSpec job = load(with_input("request:\n  messages: [{role: user, content: !!str a}]\n  extra: {metadata: {\"~\": 1}}\n"));
  EXPECT_EQ(job.request.messages[0].content, "a");
  EXPECT_EQ(job.request.extra["metadata"]["~"], 1);
}

TEST_F(JobFile, OverrideExtendsAShorthandScalar) {
  JobSpec job = load(with_input(""), {parse_override("input.format=batch")});
  EXPECT_EQ(job.input.path, input_);
  EXPECT_EQ(job.input.format, InputFormat::Batch);
}

TEST_F(JobFile, OverrideIndexesIntoMessages) {
  JobSpec job = load(with_input("request: {messages: [{role: user, content: a}]}\n"),
                     {parse_override("request.messages.0.content=b")});
  EXPECT_EQ(job.request.messages[0].content, "b");
}

TEST_F(JobFile, OverrideWithUnknownPathNamesSetAndSuggests) {
  ConfigError e = error_of(with_input(""), {parse_override("retry.max_attemps=3")});
  EXPECT_STREQ(e.what(), "--set: retry.max_attemps: unknown key (did you mean 'max_attempts'?)");
  EXPECT_EQ(error_of(with_input(""), {parse_override("concurrency.x=1")}).file(), "--set");
  // Far from any key: every valid one, as a job file's unknown key gets.
  ConfigError far = error_of(with_input(""), {parse_override("foo=5")});
  EXPECT_EQ(far.message().rfind("unknown key (valid keys: name, kind, input, ", 0), 0u) << far.what();
  EXPECT_NE(error_of(with_input(""), {parse_override("retry.zzz=5")}).message().find("max_attempts, base"),
            std::string::npos);
}

TEST_F(JobFile, OverrideWithBadValueIsBlamedOnSet) {
  ConfigError e = error_of(with_input(""), {parse_override("concurrency=0")});
  EXPECT_STREQ(e.what(), "--set: concurrency: must be between 1 and 100000, got 0");
  // A number past a double's range is a number out of this field's, not "not a number".
  EXPECT_STREQ(error_of(with_input(""), {parse_override("request.temperature=1e400")}).what(),
               "--set: request.temperature: must be between 0 and 2, got 1e400");
  // What starts like a number is a bad index, not an unknown key.
  EXPECT_EQ(error_of(with_input(""), {parse_override("request.messages.0x0.content=x")}).message(),
            "'request.messages' is a list: its entries are 0, 1, 2, ... ('0x0' is no index)");
  // A path given empty is said to be empty, not missing.
  EXPECT_EQ(error_of(with_input(""), {parse_override("few_shot={path: '', count: 2}")}).message(),
            "empty; give the examples' file");
}

TEST(ParseOverride, SplitsAtTheFirstEquals) {
  Override o = parse_override("request.extra.note=a=b");
  EXPECT_EQ(o.path, "request.extra.note");
  EXPECT_EQ(o.value, "a=b");
  EXPECT_THROW(parse_override("concurrency"), ConfigError);
  EXPECT_THROW(parse_override("=3"), ConfigError);
  EXPECT_THROW(parse_override("a..b=3"), ConfigError);
}

TEST(ParseOverride, AnEmptyValueIsAnErrorThatSaysHowToUnset) {
  for (const char* text : {"output.path=", "output.path=  "}) {
    try {
      parse_override(text);
      ADD_FAILURE() << text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("output.path=null"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(parse_override("output.path=\"\"").value, "\"\"");
}

TEST_F(JobFile, FlagOverridesAreTakenAsTypedNotAsYaml) {
  // -o 2024 names a file, -o yes too; YAML would make them a number and a boolean.
  for (const char* name : {"2024", "yes", "[x]", "a: b"}) {
    JobSpec job = load(with_input(""), {Override{"output.path", name, true}});
    EXPECT_EQ(job.output.path, name);
  }
}

TEST_F(JobFile, EmptyOutputPathIsAnError) {
  EXPECT_STREQ(error_of(with_input(""), {Override{"output.path", "", true}}).what(),
               "--set: output.path: empty path");
  EXPECT_EQ(error_of(with_input("output: {path: ''}\n")).line(), 2);
  EXPECT_EQ(error_of(with_input("output: ''\n")).field(), "output");
}

// The output must not be a file the job reads: --fresh would empty it, a resume refuses it.
TEST_F(JobFile, OutputThatIsOneOfTheJobsOwnFilesIsAnError) {
  const std::string few = write("few.jsonl", "{\"question\": \"q\", \"answer\": \"a\"}\n");
  const std::string model = write("m.gguf", "GGUF");
  const std::string job_file = write("job.yaml", with_input(""));
  fs::create_symlink(input_, dir_ / "alias.jsonl");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {input_, "input file"},
      {(dir_ / "alias.jsonl").string(), "input file"},
      {few, "few-shot file"},
      {model, "model"},
  };
  for (const auto& [out, what] : cases) {
    ConfigError e = error_of(with_input("few_shot: {path: " + few + ", count: 1}\nbackend: {model: " + model + "}\n"),
                             {Override{"output.path", out, true}});
    EXPECT_EQ(e.field(), "output.path");
    EXPECT_NE(std::string(e.what()).find("is the job's " + what), std::string::npos) << e.what();
  }
  try {
    load_job_file(job_file, {Override{"output.path", job_file, true}}, env_of({}));
    ADD_FAILURE() << "the job file as its own output";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("is the job's job file"), std::string::npos) << e.what();
  }
  // A model path that is not this job's model (an API job) is left to the writer's check.
  EXPECT_NO_THROW(load(with_input("backend: {base_url: 'http://127.0.0.1:1/v1', model: " + model + "}\n")));
}

TEST_F(JobFile, UnclosedOrEmptyPlaceholderIsAnErrorAtItsLine) {
  ConfigError e = error_of(with_input("request:\n  messages:\n    - {role: user, content: \"Q: {{question}\"}\n"));
  EXPECT_EQ(e.line(), 4);
  EXPECT_EQ(e.field(), "request.messages[0].content");
  EXPECT_NE(std::string(e.what()).find("unclosed '{{' at character 4"), std::string::npos) << e.what();
  e = error_of(with_input("request:\n  messages:\n    - {role: user, content: \"a {{ }} b\"}\n"));
  EXPECT_NE(std::string(e.what()).find("empty placeholder '{{ }}' at character 3"), std::string::npos) << e.what();
  e = error_of(with_input("few_shot: {path: " + input_ + ", count: 1, user: \"{{question\"}\n"));
  EXPECT_EQ(e.field(), "few_shot.user");
  e = error_of(with_input("request: {model: \"m-{{\"}\n"));
  EXPECT_EQ(e.field(), "request.model");
  // Closed placeholders, and braces that are not placeholders, are fine.
  EXPECT_NO_THROW(load(with_input("request:\n  messages:\n    - {role: user, content: \"{{question}} in {a} or }}\"}\n")));
}

TEST_F(JobFile, SynthCountWithAnInputIsAnError) {
  ConfigError e = error_of(with_input("synth: {count: 3}\nrequest: {messages: [{role: user, content: x}]}\n"));
  EXPECT_EQ(e.field(), "synth.count");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(error_of(with_input(""), {parse_override("synth.count=3")}).field(), "synth.count");
}

// Nor are variables drawn, or a seed used, for the items of an input: refused at their line
// rather than ignored (a {{variable}} would then be blamed on the input's lines).
TEST_F(JobFile, SynthVariablesOrSeedWithAnInputAreErrors) {
  const std::string request = "request: {messages: [{role: user, content: \"{{style}}\"}]}\n";
  ConfigError variables = error_of(with_input("synth:\n  variables: {style: [a, b]}\n" + request));
  EXPECT_EQ(variables.field(), "synth.variables");
  EXPECT_EQ(variables.line(), 3);
  EXPECT_EQ(variables.message().rfind("not used by a job with an input", 0), 0u) << variables.what();
  ConfigError seed = error_of(with_input("synth:\n  seed: 4\n" + request));
  EXPECT_EQ(seed.field(), "synth.seed");
  EXPECT_EQ(seed.line(), 3);
  EXPECT_EQ(error_of(with_input(request), {parse_override("synth.seed=3")}).file(), "--set");
}

// A synth item's input is its drawn variables: output.input_fields may name only those.
TEST_F(JobFile, SynthInputFieldsMustBeVariables) {
  const std::string synth = "synth: {count: 2, variables: {animal: [cat], place: [sea]}}\n"
                            "request: {messages: [{role: user, content: \"{{animal}}\"}]}\n";
  EXPECT_EQ(load(synth + "output: {input_fields: [place]}\n").output.input_fields, std::vector<std::string>{"place"});
  ConfigError e = error_of(synth + "output:\n  input_fields:\n    - animal\n    - colour\n");
  EXPECT_EQ(e.field(), "output.input_fields[1]");
  EXPECT_EQ(e.line(), 6);
  EXPECT_EQ(e.message(), "'colour' is not a synth variable (variables: animal, place)");
  // An input's fields are known only once it is read (a warning then).
  EXPECT_EQ(load(with_input("output: {input_fields: [colour]}\n")).output.input_fields.size(), 1u);
}

// Flags are applied to the job's map: a file that is a list or a single value is refused as
// it is with flags as without.
TEST_F(JobFile, RootThatIsNotAMapIsAnErrorWithOverridesToo) {
  for (const Override& o : {Override{"concurrency", "4", false, "--concurrency"},
                            Override{"output.path", "x.jsonl", true, "--output"}, parse_override("limit=3")}) {
    EXPECT_EQ(error_of("- a\n- b\n", {o}).message(), "expected a map of job settings, got a list") << o.path;
    EXPECT_EQ(error_of("just text\n", {o}).message(), "expected a map of job settings, got 'just text'") << o.path;
  }
  // An empty file takes the flags as its settings.
  EXPECT_EQ(load("", {Override{"input", input_, true, "--set"}}).input.path, input_);
}

// A --set value that begins with a placeholder is the template it reads as, not YAML's map.
TEST_F(JobFile, OverrideValueStartingWithAPlaceholderIsAString) {
  const std::string job = with_input("request: {messages: [{role: user, content: a}]}\n");
  EXPECT_EQ(load(job, {parse_override("request.messages.0.content={{question}} now")}).request.messages[0].content,
            "{{question}} now");
  EXPECT_EQ(load(job, {parse_override("request.messages.0.content={{question}}")}).request.messages[0].content,
            "{{question}}");
  EXPECT_EQ(load(job, {parse_override("request.messages.0.content=\"{{question}} ${X}\"")}, {{"X", "y"}})
                .request.messages[0]
                .content,
            "{{question}} y");
  EXPECT_EQ(load(job, {parse_override("request.messages.0.content={{question}} ${X}")}, {{"X", "y"}})
                .request.messages[0]
                .content,
            "{{question}} y");
  // A flow map is still a map.
  EXPECT_EQ(load(job, {parse_override("request.extra={user: me}")}).request.extra["user"], "me");
}

// YAML nested past the parser's own bound gets the same words as past the job's.
TEST_F(JobFile, NestingPastTheParsersBoundIsNamedAsTooDeep) {
  for (int depth : {300, 3000}) {
    ConfigError e = error_of(with_input("request:\n  extra:\n    a: " + std::string(depth, '[') + std::string(depth, ']') + "\n"));
    EXPECT_EQ(e.message().rfind("nested more than 64 levels deep", 0), 0u) << depth << ": " << e.what();
    EXPECT_EQ(e.line(), 4) << depth;
  }
  ConfigError maps = error_of("a: " + [] {
    std::string text;
    for (int i = 0; i < 1500; ++i) text += "{a: ";
    return text + "1" + std::string(1500, '}');
  }());
  EXPECT_EQ(maps.message().rfind("nested more than 64 levels deep", 0), 0u) << maps.what();
  ConfigError set = error_of(with_input(""), {parse_override("request.extra.a=" + std::string(3000, '[') + std::string(3000, ']'))});
  EXPECT_EQ(set.file(), "--set");
  EXPECT_NE(set.message().find("nested more than 64 levels deep"), std::string::npos) << set.what();
}

TEST_F(JobFile, MoreThanOneAnswerPerItemIsAnError) {
  for (const char* n : {"2", "0", "'3'"}) {
    ConfigError e = error_of(with_input(std::string("request: {extra: {n: ") + n + "}}\n"));
    EXPECT_EQ(e.field(), "request.extra.n");
    EXPECT_NE(std::string(e.what()).find("n must be 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(load(with_input("request: {extra: {n: 1}}\n")).request.extra["n"], 1);
}

TEST(NearestKey, SuggestsOnlyCloseKeys) {
  std::vector<std::string> keys = {"max_attempts", "base", "cap", "budget_ratio"};
  EXPECT_EQ(nearest_key("max_attemps", keys), "max_attempts");
  EXPECT_EQ(nearest_key("bsae", keys), "base");
  EXPECT_EQ(nearest_key("cpa", keys), "cap");
  EXPECT_EQ(nearest_key("budget_ration", keys), "budget_ratio");
  EXPECT_EQ(nearest_key("zebra_stripes", keys), "");
  EXPECT_EQ(nearest_key("x", {"y"}), "");
  // The same word begun, further than a typo.
  const std::vector<std::string> top = {"name", "input", "retry", "request", "rate_limit", "output"};
  EXPECT_EQ(nearest_key("retry_policy", top), "retry");
  EXPECT_EQ(nearest_key("retries", top), "retry");
  EXPECT_EQ(nearest_key("requests", top), "request");
  EXPECT_EQ(nearest_key("outputs_dir", top), "output");
  EXPECT_EQ(nearest_key("reqs", top), "");         // a beginning of fewer than four letters
  EXPECT_EQ(nearest_key("limit_per_minute", {"limit", "rate_limit"}), "");  // more words, not an ending
  EXPECT_EQ(nearest_key("request_timeout", top), "");
}

TEST_F(JobFile, LoadJobFileReadsFromDiskAndNamesIt) {
  std::string path = write("my-job.yaml", with_input("concurrency: nope\n"));
  try {
    load_job_file(path, {}, env_of({}));
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.file(), path);
    EXPECT_EQ(e.line(), 2);
  }
  std::string good = write("my-job2.yaml", with_input(""));
  EXPECT_EQ(load_job_file(good, {}, env_of({})).name, "my-job2");
  EXPECT_THROW(load_job_file((dir_ / "missing.yaml").string(), {}, env_of({})), ConfigError);
}

TEST(ShippedJobs, Gsm8kLoadsWithTheSharedData) {
  std::string file = std::string(BATCHLM_SOURCE_DIR) + "/jobs/gsm8k.yaml";
  JobSpec job = load_job_file(file, {}, env_of({{"BATCHLM_DATA", BATCHLM_SHARED_DATA}}));
  EXPECT_EQ(job.name, "gsm8k");
  EXPECT_EQ(job.kind, JobKind::Eval);
  EXPECT_EQ(job.input.path, std::string(BATCHLM_SHARED_DATA) + "/gsm8k/test.jsonl");
  EXPECT_EQ(job.few_shot.path, std::string(BATCHLM_SHARED_DATA) + "/gsm8k/train.jsonl");
  EXPECT_EQ(job.few_shot.count, 8);
  EXPECT_EQ(job.request.temperature, 0.0);
  EXPECT_EQ(job.request.max_tokens, 512);
  EXPECT_EQ(job.scoring.kind, ScoringKind::Gsm8k);
  EXPECT_EQ(job.backend.type, "local");  // the embedded engine, unless --base-url says otherwise
  EXPECT_EQ(job.backend.model, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  EXPECT_EQ(job.concurrency, 32);
  EXPECT_EQ(job.output.path, "out/gsm8k.jsonl");
  JobSpec remote = load_job_file(file, {{"backend.base_url", "http://127.0.0.1:8000/v1"}},
                                 env_of({{"BATCHLM_DATA", BATCHLM_SHARED_DATA}}));
  EXPECT_EQ(remote.backend.type, "openai");
  EXPECT_EQ(remote.backend.model, "gpt-4o-mini");
}

TEST(ShippedJobs, StoriesLoadsAsASynthJob) {
  std::string file = std::string(BATCHLM_SOURCE_DIR) + "/jobs/stories.yaml";
  JobSpec job = load_job_file(file, {}, env_of({}));
  EXPECT_EQ(job.kind, JobKind::Synth);
  EXPECT_EQ(job.synth.count, 1000);
  EXPECT_EQ(job.request.temperature, 1.0);
  EXPECT_EQ(job.scoring.kind, ScoringKind::None);
  EXPECT_EQ(job.output.path, "out/stories.jsonl");
  for (const char* name : {"verb", "noun", "adjective", "feature"}) {
    ASSERT_TRUE(job.synth.variables.count(name)) << name;
    EXPECT_GE(job.synth.variables.at(name).size(), 20u) << name;
  }
}

TEST(ShippedJobs, BuiltinStoriesIsTheShippedFile) {
  std::ifstream in(std::string(BATCHLM_SOURCE_DIR) + "/jobs/stories.yaml", std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(builtin_stories_yaml(), text.str());
  JobSpec job = load_job_text(builtin_stories_yaml(), "<builtin:stories>", {}, env_of({}));
  EXPECT_EQ(job.name, "stories");
}

namespace batchlm::runner {
namespace {

// A record names the model that made it: for the embedded engine its file name, whatever the
// path it was given by or a request (a Batch line's "gpt-4o-mini") names; for an API the
// request's model, else the backend's.
TEST(ModelLabel, LocalModelsByFileNameApisByTheRequestsModel) {
  JobSpec local;
  local.backend.type = "local";
  local.backend.model = "/srv/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  EXPECT_EQ(model_label(local, ""), "SmolLM2-135M-Instruct.Q4_1.gguf");
  EXPECT_EQ(model_label(local, "gpt-4o-mini"), "SmolLM2-135M-Instruct.Q4_1.gguf");
  JobSpec api;
  api.backend.type = "openai";
  api.backend.model = "gpt-4o-mini";
  EXPECT_EQ(model_label(api, ""), "gpt-4o-mini");
  EXPECT_EQ(model_label(api, "gpt-4o"), "gpt-4o");
}

// The extra fields go on in the order written, but a job's settings (what resuming compares)
// hold them sorted, as they always have: writing them in another order changes nothing sent.
TEST_F(JobFile, TheOrderOfExtraFieldsChangesNoSettings) {
  const JobSpec one = load(with_input("request: {extra: {zeta: 1, alpha: {y: 2, b: 3}}}\nbackend: {base_url: http://127.0.0.1:9/v1}\n"));
  const JobSpec other = load(with_input("request: {extra: {alpha: {b: 3, y: 2}, zeta: 1}}\nbackend: {base_url: http://127.0.0.1:9/v1}\n"));
  EXPECT_NE(one.request.extra.dump(), other.request.extra.dump());
  EXPECT_EQ(result_settings(one)["request"]["extra"].dump(), R"({"alpha":{"b":3,"y":2},"zeta":1})");
  EXPECT_EQ(settings_hash(result_settings(one)), settings_hash(result_settings(other)));
}

// A local model reached through a symbolic link keeps the link's name in its records, and its
// settings also name the file the link leads to: a link pointed at another model since is
// another model. Without a link the settings are as they always were.
TEST_F(JobFile, ALocalModelThroughALinkIsAlsoNamedByItsFile) {
  write("a.Q4_1.gguf", "GGUF");
  write("b.Q8_0.gguf", "GGUF");
  fs::create_symlink("a.Q4_1.gguf", dir_ / "current.gguf");
  JobSpec local;
  local.backend.type = "local";
  local.backend.model = (dir_ / "current.gguf").string();
  EXPECT_EQ(model_label(local, ""), "current.gguf");
  const nlohmann::json through_link = result_settings(local);
  EXPECT_EQ(through_link["model"], "current.gguf");
  EXPECT_EQ(through_link["model_file"], "a.Q4_1.gguf");
  fs::remove(dir_ / "current.gguf");
  fs::create_symlink("b.Q8_0.gguf", dir_ / "current.gguf");
  EXPECT_EQ(model_label(local, ""), "current.gguf");
  EXPECT_EQ(result_settings(local)["model_file"], "b.Q8_0.gguf");
  EXPECT_NE(settings_hash(result_settings(local)), settings_hash(through_link));
  local.backend.model = (dir_ / "a.Q4_1.gguf").string();
  EXPECT_FALSE(result_settings(local).contains("model_file"));
  // A target whose name is not UTF-8 is named with its bytes escaped (the settings are JSON).
  write("mod\xe8le.gguf", "GGUF");
  fs::remove(dir_ / "current.gguf");
  fs::create_symlink("mod\xe8le.gguf", dir_ / "current.gguf");
  local.backend.model = (dir_ / "current.gguf").string();
  EXPECT_EQ(result_settings(local)["model_file"], "mod\\xe8le.gguf");
  EXPECT_NO_THROW(settings_hash(result_settings(local)));
}

}  // namespace
}  // namespace batchlm::runner
