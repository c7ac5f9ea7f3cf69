#pragma once
// A job file, validated. Loading either returns a complete JobSpec or throws ConfigError
// naming the file, line and field; nothing is sent before the whole job validates.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "batchlm/client/http.hpp"
#include "batchlm/core/types.hpp"

namespace batchlm::runner {

using std::chrono::milliseconds;

// A mistake in a job file or an override. what() is the whole message, e.g.
//   jobs/gsm8k.yaml:14:3: retry.max_attemps: unknown key (did you mean 'max_attempts'?)
class ConfigError : public std::runtime_error {
 public:
  ConfigError(std::string file, int line, int column, std::string field, std::string message);
  const std::string& file() const { return file_; }
  int line() const { return line_; }      // 1-based; 0 when not tied to a line
  int column() const { return column_; }  // 1-based; 0 when unknown
  const std::string& field() const { return field_; }  // dotted path: "rate_limit.tokens_per_minute"
  const std::string& message() const { return message_; }

 private:
  std::string file_, field_, message_;
  int line_, column_;
};

enum class JobKind { Eval, Synth };
enum class InputFormat { Auto, Jsonl, Batch };  // Batch: OpenAI Batch-API lines {custom_id, body}
enum class ScoringKind { None, Gsm8k, ExactMatch, Regex };

struct InputSpec {
  std::string path;  // empty for a synth job that generates its items
  InputFormat format = InputFormat::Auto;  // Auto: Batch when the first line has custom_id and body
};

// kind: synth without an input: `count` items whose variables are drawn, seeded, from lists.
struct SynthSpec {
  std::int64_t count = 0;
  std::uint64_t seed = 0;
  std::map<std::string, std::vector<std::string>> variables;  // name -> choices
};

// The request of every item; message contents and string fields may use {{field}}.
struct RequestTemplate {
  std::vector<ChatMessage> messages;
  std::string model;  // empty: the backend's model
  std::optional<int> max_tokens;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::vector<std::string> stop;
  std::optional<std::int64_t> seed;
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // further body fields, passed through, in order
};

// Few-shot examples drawn from a file and placed, as user/assistant turns, before the last
// message of the template.
struct FewShotSpec {
  std::string path;      // empty: no few-shot examples
  int count = 0;
  std::uint64_t seed = 0;
  std::string user = "{{question}}";     // rendered with each example's fields
  std::string assistant = "{{answer}}";
};

// The GGUF the local backend loads when neither the job nor $BATCHLM_MODEL names one
// (scripts/fetch-model.sh puts it there).
inline constexpr std::string_view kDefaultLocalModel = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

struct BackendSpec {
  // "openai" or "local". Resolved: the job's value; else "openai" when base_url is given, else
  // "local" (the embedded engine).
  std::string type;
  std::string base_url;         // openai: job value, else $OPENAI_BASE_URL, else api.openai.com
  // openai: the model name for requests that name none. local: the GGUF path (job value, else
  // $BATCHLM_MODEL, else kDefaultLocalModel), relative to the working directory.
  std::string model;
  std::string api_key_env = "OPENAI_API_KEY";  // the variable the key is read from
  client::Headers headers;                     // extra headers
  client::HttpTimeouts timeouts;
  bool stream = true;
  int threads = 0;              // local: compute threads, 0 = one per hardware thread
  std::string device = "auto";  // local: auto (CUDA when a GPU is present), cuda or cpu
  std::int64_t context = 0;     // local: tokens per sequence, 0 = min(model's, 4096)
  // local, continuous batching: sequences decoded together, tokens per batched forward pass
  // (0: the engine's maximum), tokens per KV block, and the KV pool in tokens or bytes (0: a
  // default from free memory).
  int max_sequences = 32;
  std::int64_t token_budget = 0;
  int block_size = 16;
  std::int64_t kv_tokens = 0;
  std::int64_t kv_bytes = 0;
  // local: reuse the KV blocks of finished items before taking pool memory never used (the
  // items of a job share a prompt prefix at most, and that stays cached).
  bool kv_recycle = true;
  // local: a file that gets one JSON line per engine step (empty: none).
  std::string step_log;
  // local: "separate" gives a chat answer's opening <think> block as the record's `reasoning`,
  // apart from its `output`; "inline" keeps it at the head of the output.
  std::string reasoning = "separate";
  // local, speculative decoding (backend.speculative): method none|draft|self|ngram, the draft
  // model (draft), the target's layers that draft (self; 0: a quarter), the bounds of each
  // sequence's draft length, and the n-gram lengths looked up (ngram).
  struct Speculative {
    std::string method = "none";
    std::string model;
    int layers = 0;
    int k_max = 4;
    int k_min = 0;
    int ngram_max = 4;
    int ngram_min = 1;
  } speculative;
};

struct RateLimitSpec {
  double requests_per_minute = 0;  // 0: unlimited
  double tokens_per_minute = 0;    // 0: unlimited
};

struct RetrySpec {
  int max_attempts = 6;               // attempts in all, the first included
  milliseconds base{500};
  milliseconds cap{30'000};
  milliseconds max_retry_after{120'000};  // server hints honoured up to this
  // After a success, a server that can no longer be connected to (restarting, its host
  // rebooting) is waited for this long without spending the items' attempts; 0: not waited for.
  milliseconds reconnect_for{300'000};
  double budget_ratio = 0.2;          // retries in a 10 s window: this fraction of first attempts...
  double budget_min_per_second = 10;  // ...plus this many per second; beyond it retries wait
};

struct OutputSpec {
  std::string path;                   // the JSONL output
  int flush_every = 64;               // records
  milliseconds flush_interval{1000};
  std::vector<std::string> input_fields;  // input fields copied to each record; empty: all
};

struct ScoringSpec {
  ScoringKind kind = ScoringKind::None;
  std::string reference_field = "answer";  // input field holding the expected answer
  std::string pattern;                     // Regex: the pattern the output must match
  // Compares the output with each item's reference (regex scoring reads the output alone).
  bool reads_references() const { return kind == ScoringKind::Gsm8k || kind == ScoringKind::ExactMatch; }
};

// Why an empty stop string is refused wherever one is written (a job, a Batch-API body, --stop).
inline constexpr const char* kEmptyStopString = "an empty string stops nothing: leave it out";

// Where a value was written: file (or the flag that set it), line and column (0: unknown).
struct SourceMark {
  std::string file;
  int line = 0;
  int column = 0;
};

struct JobSpec {
  std::string file;  // where it was loaded from ("<builtin:stories>" for built-ins)
  std::string name;
  JobKind kind = JobKind::Eval;
  InputSpec input;
  SynthSpec synth;
  RequestTemplate request;
  FewShotSpec few_shot;
  BackendSpec backend;
  int concurrency = 32;
  RateLimitSpec rate_limit;
  RetrySpec retry;
  OutputSpec output;
  ScoringSpec scoring;
  std::optional<std::int64_t> limit;  // first N items only
  milliseconds grace_period{30'000};  // on SIGINT: how long in-flight items may finish
  // Where the fields that are checked after loading (templates against the items) were written.
  std::map<std::string, SourceMark> marks;
  // Settings that were accepted but have no effect (printed before the run).
  std::vector<std::string> warnings;
};

// Environment lookup (tests pass a map; the program passes getenv).
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
EnvLookup process_env();

// `--set key.path=value` overrides, applied to the YAML tree before validation; the value is
// parsed as YAML (so `concurrency=8` is a number and `request.stop=[a, b]` a list). A literal
// override (the command's own flags: -o, -m, --backend, --base-url) is the string as given.
struct Override {
  std::string path;
  std::string value;
  bool literal = false;
  std::string flag;  // the command-line flag it came from, for errors; empty: --set
};
Override parse_override(std::string_view text);
// "1073741824", "512MiB", "2GiB", "1.5GB", "64k": bytes (binary suffixes K/M/G/T, KiB..., and
// decimal KB/MB/GB/TB; case-insensitive; a trailing "B" optional). nullopt when malformed.
std::optional<std::int64_t> parse_byte_size(std::string_view text);  // throws ConfigError (file "--set")

// Loads, expands ${VAR} / ${VAR:-default} in every string scalar, applies overrides,
// validates. Relative paths in the job (input, few_shot.path, output.path) are taken as given,
// relative to the working directory, like a shell would.
JobSpec load_job_file(const std::string& path, const std::vector<Override>& overrides,
                      const EnvLookup& env);
JobSpec load_job_text(std::string_view yaml, const std::string& file_label,
                      const std::vector<Override>& overrides, const EnvLookup& env);

// The flag of the last override that set `field` or a field containing it ("--set", "-o", ...),
// if any: errors found in a value name where it was given.
std::optional<std::string> overriding_flag(const std::vector<Override>& overrides, const std::string& field);

// What decides an item's result besides its input: the kind of backend and its model (a local
// model by file name, and where that is a symbolic link also by the name of the file it leads
// to), the request template, the few-shot examples (their file by name) and the scoring. Not the
// API's address, the engine's tuning or the retry policy. Records carry settings_hash() of it,
// so that a resume under other settings is refused rather than mixing two runs' results in one
// file.
nlohmann::json result_settings(const JobSpec& job);
// 16 hex digits (FNV-1a, 64 bits, of the settings' compact JSON): the same on every machine.
std::string settings_hash(const nlohmann::json& settings);
// The model a record names: a local model's file name, as given; for an API the request's own
// (a template or a Batch line may set it), else the backend's.
std::string model_label(const JobSpec& job, const std::string& request_model);

// Why a request's "n" must be 1 (job files and Batch-API lines).
extern const char* const kOneAnswerPerItem;

// Whether `value` is a request's output limit (max_tokens, max_completion_tokens): an integer
// from 1 to 2147483647, checked as unsigned first so a value past INT64_MAX does not wrap to a
// small one (job files and Batch-API lines).
bool is_token_limit(const nlohmann::ordered_json& value);

// The built-in short-story recipe (`batchlm synth` with no job file; same as jobs/stories.yaml).
std::string_view builtin_stories_yaml();

// ${VAR} and ${VAR:-default} expansion; "$$" is a literal "$". An unset ${VAR} without a
// default throws ConfigError at (file, line, field).
std::string expand_env(std::string_view text, const EnvLookup& env, const std::string& file,
                       int line, const std::string& field);

// The valid key nearest to `key` (edit distance), or empty when none is close.
std::string nearest_key(std::string_view key, const std::vector<std::string>& valid);

}  // namespace batchlm::runner
