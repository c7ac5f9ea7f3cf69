// batchlm: large batches of LLM calls — evals and data synthesis — against OpenAI-compatible
// APIs or the embedded engine.

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <boost/asio/io_context.hpp>

#include "batchlm/client/openai.hpp"
#include "batchlm/core/engine_fields.hpp"
#include "batchlm/local_engine/batch_engine.hpp"
#include "batchlm/local_engine/engine.hpp"
#include "batchlm/local_engine/gguf.hpp"
#include "batchlm/local_engine/local_backend.hpp"
#include "batchlm/runner/dispatcher.hpp"
#include "batchlm/runner/job.hpp"
#include "batchlm/runner/source.hpp"
#include "batchlm/runner/writer.hpp"
#include "cli_checks.hpp"
#include "engine_commands.hpp"

namespace {

using namespace batchlm;
using namespace batchlm::runner;

constexpr const char* kExamples = R"(Examples:
  batchlm run jobs/gsm8k.yaml                       # scored eval with a progress bar
  batchlm run jobs/gsm8k.yaml --limit 50 --concurrency 8
  batchlm run jobs/gsm8k.yaml --dry-run             # validate and show the first requests
  batchlm run jobs/gsm8k.yaml --set request.temperature=0.7 --set retry.max_attempts=3
  batchlm run jobs/gsm8k.yaml --base-url http://127.0.0.1:8000/v1 --model my-model
  batchlm synth --concurrency 20 --count 1000 --output stories.jsonl
  batchlm generate -p "Once upon a time" --max-tokens 64
  batchlm generate --chat -p "What is 17 * 3?" --temperature 0
  batchlm inspect models/SmolLM2-135M-Instruct.Q4_1.gguf
  batchlm serve --port 8000                         # the engine behind an OpenAI-style API

Without a backend section or --base-url, jobs run on the embedded engine with the default
model (scripts/fetch-model.sh downloads it; $BATCHLM_MODEL or --model picks another GGUF).

Rerunning the same command resumes: finished items are skipped, failed ones retried.

Exit codes:
  0    every item succeeded
  1    some items failed, or the run stopped sending (the API refuses the client, the output
       cannot be written): rerun to retry them
  2    bad configuration or usage: nothing was sent
  130  interrupted (Ctrl-C, SIGTERM, SIGHUP, Ctrl-\): finished items are saved; rerun to resume

Ctrl-C, SIGTERM or SIGHUP: no new items, those in flight get grace_period to finish, then the
summary. A second Ctrl-C or SIGTERM, or Ctrl-\, exits at once, keeping every finished item.
)";

// Options shared by `run` and `synth`; each set one is an override of the job file.
struct JobOptions {
  std::string job_file;
  std::optional<int> concurrency;
  std::optional<long long> limit;
  std::optional<long long> count;
  std::optional<std::string> output, backend, model, base_url;
  std::vector<std::string> sets;
  bool fresh = false;
  bool dry_run = false;
};

void add_job_options(CLI::App& cmd, JobOptions& o, bool with_count) {
  cmd.add_option("--concurrency,-c", o.concurrency, "Requests in flight at once")
      ->check(app::at_least(1, true, std::numeric_limits<int>::max()));
  cmd.add_option("--limit,-n", o.limit, "Only the first N items")->check(app::at_least(0));
  if (with_count) cmd.add_option("--count", o.count, "Number of items to synthesize")->check(app::at_least(1));
  cmd.add_option("--output,-o", o.output, "Output JSONL path (the summary goes next to it)");
  cmd.add_flag("--fresh", o.fresh, "Ignore and replace earlier results in the output");
  cmd.add_flag("--dry-run", o.dry_run,
               "Validate, print the first requests and a token estimate; send nothing");
  cmd.add_option("--set", o.sets, "Override a job field: --set key.path=value (repeatable)");
  cmd.add_option("--backend", o.backend, "Backend type: local (the embedded engine) or openai");
  cmd.add_option("--model,-m", o.model, "Local: the GGUF file; openai: the model name sent");
  cmd.add_option("--base-url", o.base_url, "API base URL, e.g. http://127.0.0.1:8000/v1");
}

std::vector<Override> collect_overrides(const JobOptions& o) {
  std::vector<Override> out;
  // Explicit flags are overrides like any other, validated the same way; --set comes last
  // so it wins.
  if (o.concurrency) out.push_back({"concurrency", std::to_string(*o.concurrency), false, "--concurrency"});
  if (o.limit) out.push_back({"limit", std::to_string(*o.limit), false, "--limit"});
  if (o.count) out.push_back({"synth.count", std::to_string(*o.count), false, "--count"});
  // Paths, names and URLs are taken as typed (not as YAML: `-o 2024` is a file name).
  if (o.output) out.push_back({"output.path", *o.output, true, "--output"});
  if (o.backend) out.push_back({"backend.type", *o.backend, true, "--backend"});
  if (o.model) out.push_back({"backend.model", *o.model, true, "--model"});
  if (o.base_url) {
    // Naming an API on the command line selects the API client, whatever the file's type says
    // (--backend, given too, decides).
    if (!o.backend) out.push_back({"backend.type", "openai", true, "--base-url"});
    out.push_back({"backend.base_url", *o.base_url, true, "--base-url"});
  }
  for (const auto& s : o.sets) out.push_back(parse_override(s));
  return out;
}

bool is_openai_host(const std::string& url) {
  return url.find("://api.openai.com") != std::string::npos;
}

// An error found after loading (the engine's own checks), blamed where the field's value was
// given: the flag of the last override that covers it (--set, -m, ...), else its line in the
// job file, else the job file.
ConfigError field_error(const JobSpec& job, const std::vector<Override>& overrides, const std::string& field,
                        const std::string& message) {
  if (std::optional<std::string> flag = overriding_flag(overrides, field)) return ConfigError(*flag, 0, 0, field, message);
  if (const auto at = job.marks.find(field); at != job.marks.end())
    return ConfigError(at->second.file, at->second.line, at->second.column, field, message);
  return ConfigError(job.file, 0, 0, field, message);
}

// The engine names its options as it knows them ("kv_bytes 1024 ...", "speculative.layers must
// be ..."); the job's field is named instead, and blamed where it was set.
ConfigError engine_option_error(const JobSpec& job, const std::vector<Override>& overrides, std::string message) {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"kv_bytes", "kv_memory"}, {"kv_tokens", "kv_tokens"}, {"speculative.", "speculative."},
      {"context", "context"},    {"max_sequences", "max_sequences"}, {"token_budget", "token_budget"},
      {"block_size", "block_size"}};
  std::string field = "backend";
  for (const auto& [engine_name, job_name] : names) {
    if (!message.starts_with(engine_name)) continue;
    if (engine_name.ends_with('.')) {
      field = "backend." + message.substr(0, message.find_first_of(" :"));
    } else {
      field = "backend." + job_name;
      message = job_name + message.substr(engine_name.size());
    }
    break;
  }
  return field_error(job, overrides, field, message);
}

void require_model_file(const JobSpec& job, const std::vector<Override>& overrides) {
  if (const std::string problem = app::model_file_problem(job.backend.model, "set backend.model, $BATCHLM_MODEL or --model");
      !problem.empty())
    throw field_error(job, overrides, "backend.model", problem);
}

// The job's own biases are checked against the model's vocabulary once, not refused item by item.
void refuse_biases_outside(const JobSpec& job, const std::vector<Override>& overrides, std::int64_t n_vocab,
                           const std::string& model_name) {
  for (const auto& [token, bias] : requested_logit_bias(job.request.extra)) {
    if (token >= n_vocab)
      throw field_error(job, overrides, "request.extra.logit_bias",
                        "token " + std::to_string(token) + " is outside the vocabulary of " + std::to_string(n_vocab) +
                            " (" + model_name + ")");
  }
}

// An API's key, from backend.api_key_env; an empty one when the variable is unset and the API is
// not OpenAI's (a local server needs none). Checked by the dry run too.
std::string api_key(const JobSpec& job, const EnvLookup& env) {
  if (auto key = env(job.backend.api_key_env); key && !key->empty()) {
    // It goes out in a header, which a line break would end (a key copied from a Windows .env
    // file keeps its carriage return): every request would fail, so nothing is sent.
    const auto control = std::find_if(key->begin(), key->end(), [](char c) {
      return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
    });
    if (control != key->end())
      throw ConfigError(job.file, 0, 0, "backend.api_key_env",
                        "$" + job.backend.api_key_env + " holds " +
                            (*control == '\r' ? "a carriage return" : *control == '\n' ? "a line break" : "a control character") +
                            " at character " + std::to_string(control - key->begin() + 1) + " of " +
                            std::to_string(key->size()) + "; an API key is one line of printable characters");
    // Spaces around it or quotes kept from a .env file go out as part of the key: a 401 for a
    // key that is right.
    if (key->front() == ' ' || key->back() == ' ' || key->front() == '"' || key->front() == '\'')
      throw ConfigError(job.file, 0, 0, "backend.api_key_env",
                        "$" + job.backend.api_key_env + " " +
                            (key->front() == ' ' || key->back() == ' ' ? "has spaces around the key"
                                                                         : "holds the key in quotes") +
                            ", which would be sent as part of it; export the key alone");
    return *key;
  }
  if (is_openai_host(job.backend.base_url))
    throw ConfigError(job.file, 0, 0, "backend.api_key_env",
                      "$" + job.backend.api_key_env + " is not set; export your API key, or point "
                      "backend.base_url (or $OPENAI_BASE_URL, or --base-url) at another server");
  // A variable the job names is one it means to send: unset, every request would go without a
  // key (a local server needs none, and takes the default's absence quietly).
  if (job.backend.api_key_env != BackendSpec().api_key_env) {
    const auto at = job.marks.find("backend.api_key_env");
    throw ConfigError(at != job.marks.end() ? at->second.file : job.file, at != job.marks.end() ? at->second.line : 0,
                      at != job.marks.end() ? at->second.column : 0, "backend.api_key_env",
                      "$" + job.backend.api_key_env + " is " + (env(job.backend.api_key_env) ? "empty" : "not set") +
                          "; export the API key in it, or leave backend.api_key_env out for a server that needs no key");
  }
  return {};
}

// The context the engine would give the job's sequences, at most: the job's or 4096, within the
// model's trained length (the engine may hold less, where it cannot run the model's long-context
// rotary factors). 0 where the file does not say.
std::int64_t dry_run_context(const JobSpec& job, const local_engine::gguf::File& file) {
  try {
    const std::optional<std::string> arch = file.find_string("general.architecture");
    if (!arch || file.find(*arch + ".context_length") == nullptr) return 0;
    const auto trained = static_cast<std::int64_t>(file.get_u64(*arch + ".context_length"));
    return std::min<std::int64_t>(job.backend.context > 0 ? job.backend.context : 4096, trained);
  } catch (const std::exception&) {
    return 0;
  }
}

// The output as the writer will take it (a file that can be one, a directory that takes it),
// before a model is loaded or anything sent, and blamed on where the path was given. The dry run
// also reads an existing output through, as the run's resume does itself.
void check_output_path(const JobSpec& job, const std::vector<Override>& overrides, bool read_records, bool fresh) {
  try {
    check_output(job.output.path, read_records, fresh);
  } catch (const std::exception& e) {
    throw field_error(job, overrides, "output.path", e.what());
  }
}

// Tools, and a conversation's calls and results, need a chat template that shows them to the
// model: `problem` says why this model's does not (nullopt: it does).
void refuse_tools_without_template(const JobSpec& job, const std::vector<Override>& overrides,
                                   const std::optional<std::string>& problem) {
  if (!problem) return;
  if (requested_tools(job.request.extra)) throw field_error(job, overrides, "request.extra.tools", *problem);
  for (std::size_t i = 0; i < job.request.messages.size(); ++i) {
    const ChatMessage& m = job.request.messages[i];
    if (m.calls_tools() || m.role == "tool")
      throw field_error(job, overrides,
                        "request.messages[" + std::to_string(i) + "]" + (m.calls_tools() ? ".tool_calls" : ".role"),
                        *problem);
  }
}

// An engine that samples on a GPU refuses what only its CPU sampler applies: a job asking for
// it in request.extra would fail every item, so it is refused before anything is sent.
void refuse_cpu_sampling_on_gpu(const JobSpec& job, const std::vector<Override>& overrides) {
  if (const auto field = cpu_sampling_field(job.request.extra))
    throw field_error(job, overrides, "request.extra." + field->first,
                      field->second + " on the CPU only, and the engine samples on the GPU here; set "
                                      "backend.device: cpu to run it");
}

// The embedded engine's options from the job's backend settings.
local_engine::LocalBackendOptions local_options(const JobSpec& job, const std::vector<Override>& overrides) {
  local_engine::LocalBackendOptions options;
  options.model = job.backend.model;
  options.threads = app::usable_threads(job.backend.threads);
  options.device = local_engine::parse_device(job.backend.device).value_or(local_engine::Device::kAuto);
  options.context = job.backend.context;
  options.max_sequences = job.backend.max_sequences;
  options.token_budget = job.backend.token_budget;
  options.block_size = job.backend.block_size;
  options.kv_tokens = job.backend.kv_tokens;
  options.kv_bytes = job.backend.kv_bytes;
  options.kv_recycle = job.backend.kv_recycle;
  options.step_log = job.backend.step_log;
  options.split_reasoning = job.backend.reasoning == "separate";
  try {
    options.speculative = app::speculative_options(job.backend.speculative);
  } catch (const std::runtime_error& e) {
    throw field_error(job, overrides, "backend.speculative.model", e.what());
  }
  return options;
}

// Runs `make` (the engine made, or its options checked), blaming what it refuses on the job
// field that set it: the run and its dry run say the same.
void engine_errors(const JobSpec& job, const std::vector<Override>& overrides, const std::function<void()>& make) {
  try {
    make();
  } catch (const local_engine::DeviceUnavailable& e) {
    throw field_error(job, overrides, "backend.device", e.what());
  } catch (const local_engine::StepLogUnwritable& e) {
    throw field_error(job, overrides, "backend.step_log", e.detail);
  } catch (const local_engine::DraftModelUnusable& e) {
    throw field_error(job, overrides, "backend.speculative.model", e.what());
  } catch (const local_engine::gguf::Error& e) {
    throw field_error(job, overrides, "backend.model", e.what());
  } catch (const std::invalid_argument& e) {
    throw engine_option_error(job, overrides, e.what());
  } catch (const std::bad_alloc&) {
    // The weights and the KV pool are taken whole at start: a pool set larger than the memory
    // fails here, before any item.
    const std::string field = job.backend.kv_bytes > 0    ? "backend.kv_memory"
                              : job.backend.kv_tokens > 0 ? "backend.kv_tokens"
                                                          : "backend.model";
    throw field_error(job, overrides, field,
                      field == "backend.model"
                          ? "not enough memory for the model and its KV pool (give a smaller backend.kv_memory, or "
                            "backend.context)"
                          : "not enough memory for a KV pool this large (with the model's weights); give a smaller one");
  }
}

std::unique_ptr<Backend> make_backend(const JobSpec& job, const std::vector<Override>& overrides,
                                      boost::asio::io_context& io, const EnvLookup& env) {
  if (job.backend.type == "local") {
    require_model_file(job, overrides);
    const local_engine::LocalBackendOptions options = local_options(job, overrides);
    std::unique_ptr<local_engine::LocalBackend> backend;
    engine_errors(job, overrides, [&] { backend = std::make_unique<local_engine::LocalBackend>(io.get_executor(), options); });
    if (job.backend.context > backend->context())
      std::fprintf(stderr, "batchlm: note: backend.context %lld is beyond the longest context this model runs at; using %lld\n",
                   static_cast<long long>(job.backend.context), static_cast<long long>(backend->context()));
    refuse_biases_outside(job, overrides, backend->vocab_size(), backend->model_name());
    refuse_tools_without_template(job, overrides, backend->tools_problem());
    if (backend->samples_on_device()) refuse_cpu_sampling_on_gpu(job, overrides);
    // A pool set larger than the memory: the system may end the run when the pool fills.
    if (const std::int64_t available = backend->pool_past_memory(); available > 0) {
      const std::string field = job.backend.kv_tokens > 0 ? "backend.kv_tokens" : "backend.kv_memory";  // tokens win
      std::fprintf(stderr,
                   "batchlm: warning: %s: the KV pool (%s) is more than the memory available now (%s); the system "
                   "may end the run when the pool fills: a smaller pool avoids it\n",
                   field.c_str(), local_engine::gguf::human_bytes(static_cast<double>(backend->pool_bytes())).c_str(),
                   local_engine::gguf::human_bytes(static_cast<double>(available)).c_str());
    }
    // Once at start: the model, its KV pool, and where it runs (or why not on a GPU).
    std::fprintf(stderr, "batchlm: %s\n", backend->describe().c_str());
    return backend;
  }
  client::OpenAIOptions options;
  options.base_url = job.backend.base_url;
  options.extra_headers = job.backend.headers;
  options.timeouts = job.backend.timeouts;
  options.api_key = api_key(job, env);
  return std::make_unique<client::OpenAIBackend>(io.get_executor(), std::move(options));
}

// The soft limit on open files is raised to the hard one: on many systems the soft limit is
// 1024 while the hard one is hundreds of thousands, and a run of thousands of streams needs a
// socket for each, serve a descriptor per client.
void raise_open_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  // An unlimited hard limit is not a number the kernel takes for the soft one: fs.nr_open caps it.
  rlim_t wanted = limit.rlim_max;
  if (wanted == RLIM_INFINITY) {
    wanted = rlim_t{1} << 20;  // the kernel's default nr_open
    std::ifstream nr_open("/proc/sys/fs/nr_open");
    if (unsigned long long n = 0; nr_open >> n && n > 0) wanted = static_cast<rlim_t>(n);
  }
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < wanted) {
    const rlimit raised{wanted, limit.rlim_max};
    (void)::setrlimit(RLIMIT_NOFILE, &raised);
  }
}

// The files this process may have open now (the soft limit).
long long open_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  return limit.rlim_cur == RLIM_INFINITY ? std::numeric_limits<long long>::max()
                                         : static_cast<long long>(limit.rlim_cur);
}

// Streams to an API hold a socket each (HTTP/1.1; HTTP/2 shares them). Past what the open-file
// limit allows, connections fail with "too many open files" and are retried until they fail
// for good, and the summary itself cannot be written; so the concurrency is lowered to fit,
// leaving room for the output, its lock, the summary, the step log and the resolver.
void fit_concurrency_to_open_files(JobSpec& job) {
  constexpr long long kFilesKeptBack = 64;
  if (job.backend.type == "local") return;
  const long long files = open_file_limit();
  const long long room = std::max<long long>(1, files - kFilesKeptBack);
  if (job.concurrency <= room) return;
  std::fprintf(stderr,
               "batchlm: note: concurrency %d needs a socket per request, but this process may have only %lld "
               "files open (its hard limit, ulimit -Hn); running %lld at once\n",
               job.concurrency, files, room);
  job.concurrency = static_cast<int>(room);
}

int run_command(const JobOptions& o, bool synth) {
  // Until the run takes stop signals itself (once its output is open and its items are about
  // to go), Ctrl-C, SIGTERM or SIGHUP while the job, its input or the model is read ends the
  // process at once, as a run stopped before it sent anything: exit 130 with a line saying so,
  // rather than the signal's own death (143 for SIGTERM) and nothing.
  exit_on_stop_signals("\nbatchlm: interrupted before the run began: nothing was sent\n");
  const EnvLookup env = process_env();
  const std::vector<Override> overrides = collect_overrides(o);
  JobSpec job = o.job_file.empty()
                    ? load_job_text(builtin_stories_yaml(), "<builtin:stories>", overrides, env)
                    : load_job_file(o.job_file, overrides, env);
  for (const std::string& warning : job.warnings) std::fprintf(stderr, "batchlm: warning: %s\n", warning.c_str());
  if (synth && job.kind != JobKind::Synth && !o.job_file.empty()) {
    std::fprintf(stderr, "batchlm: note: %s is an eval job; running it as given\n", o.job_file.c_str());
  }
  std::unique_ptr<Source> source = open_source(job);  // validates the whole input
  for (const std::string& warning : source->warnings()) std::fprintf(stderr, "batchlm: warning: %s\n", warning.c_str());
  // What the run would refuse, the dry run refuses too: the output, and an API's missing key.
  check_output_path(job, overrides, /*read_records=*/o.dry_run, o.fresh);
  if (o.dry_run) {
    if (job.backend.type != "local") (void)api_key(job, env);
    // The model too: its header and tensor table (the weights are not read), and its
    // vocabulary, which counts the prompts' tokens.
    PromptTokenCounter count_prompt_tokens;
    std::int64_t context = 0;
    if (job.backend.type == "local") {
      require_model_file(job, overrides);
      // The model's whole tensor table and metadata, checked as the run loads them (the weights
      // are not read), and every engine setting the run would refuse for it.
      std::shared_ptr<const local_engine::Model> model;
      local_engine::Device device = local_engine::Device::kCpu;
      engine_errors(job, overrides, [&] {
        const local_engine::LocalBackendOptions options = local_options(job, overrides);
        model = local_engine::Model::load(job.backend.model, /*check_only=*/true, options.context);
        device = local_engine::BatchEngine::check(model, options);
      });
      context = dry_run_context(job, model->file());
      // In the run's order: biases outside the vocabulary, tools the template cannot show, then
      // what the GPU's sampler cannot apply.
      refuse_biases_outside(job, overrides, static_cast<std::int64_t>(model->tokenizer().size()),
                            std::filesystem::path(job.backend.model).stem().string());
      try {
        const local_engine::ChatTemplate* chat = &model->chat_template();  // the model's, kept alive below
        count_prompt_tokens = [model, chat](const Request& request) {
          return static_cast<std::int64_t>(local_engine::request_prompt_tokens(model->tokenizer(), *chat, request).size());
        };
        refuse_tools_without_template(job, overrides, local_engine::tools_problem(*chat));
      } catch (const ConfigError&) {
        throw;
      } catch (const std::exception&) {
        // No chat template this build supports: the run would say so; the dry run estimates.
      }
      if (device == local_engine::Device::kCuda) refuse_cpu_sampling_on_gpu(job, overrides);
    }
    DryRunOptions dry{.show = 3, .count_prompt_tokens = count_prompt_tokens, .context = context, .fresh = o.fresh};
    dry_run(job, *source, stdout, dry);
    return kExitOk;
  }
  fit_concurrency_to_open_files(job);
  boost::asio::io_context io(1);
  std::unique_ptr<Backend> backend = make_backend(job, overrides, io, env);
  RunOptions options;
  options.fresh = o.fresh;
  RunResult result = run_job(job, *source, *backend, io, options);
  return result.exit_code;
}

// A program started with a standard stream closed (`2>&-`, a daemon's closed descriptors) would
// hand that number to the next file it opens, and its messages would go into it: the step log,
// the output's lock, the output itself. /dev/null holds the place instead.
void hold_standard_descriptors() {
  // In order, so that the lowest free number open() takes is `fd` itself.
  for (int fd = STDIN_FILENO; fd <= STDERR_FILENO; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1 && errno == EBADF)
      (void)::open("/dev/null", fd == STDIN_FILENO ? O_RDONLY : O_WRONLY);
  }
}

// For each --option on the command line that the command does not have, the nearest one it
// has ("--concurency": did you mean --concurrency?), or the command that has it. `only_elsewhere`:
// every one was another command's (what the parser then says of the rest is only its echo:
// "arguments were not expected: 5 --count", or a value taken for the job file).
std::string option_hint(CLI::App& app, int argc, char** argv, bool& only_elsewhere) {
  only_elsewhere = false;
  if (argc < 2) return {};
  CLI::App* command = nullptr;
  for (CLI::App* sub : app.get_subcommands({}))
    if (sub->get_name() == argv[1]) command = sub;
  if (command == nullptr) return {};
  const auto long_names = [](const CLI::App& a) {
    std::vector<std::string> names;
    for (const CLI::Option* o : a.get_options())
      for (const std::string& n : o->get_lnames()) names.push_back("--" + n);
    return names;
  };
  const std::vector<std::string> known = long_names(*command);
  std::string hint;
  bool other_causes = false;  // a typo, or an option no command has
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") break;
    if (!arg.starts_with("--")) continue;
    arg = arg.substr(0, arg.find('='));
    if (std::find(known.begin(), known.end(), arg) != known.end()) continue;
    std::string line;
    if (const std::string near = nearest_key(arg, known); !near.empty()) {
      line = arg + ": did you mean " + near + "?";
      other_causes = true;
    } else {
      for (CLI::App* other : app.get_subcommands({})) {
        const std::vector<std::string> theirs = long_names(*other);
        if (other != command && std::find(theirs.begin(), theirs.end(), arg) != theirs.end()) {
          line = arg + " is an option of 'batchlm " + other->get_name() + "', not of '" + command->get_name() + "'";
          break;
        }
      }
    }
    if (line.empty()) other_causes = true;
    if (!line.empty()) hint += (hint.empty() ? "" : "\n") + line;
  }
  only_elsewhere = !hint.empty() && !other_causes;
  return hint;
}

}  // namespace

int main(int argc, char** argv) {
  hold_standard_descriptors();
  raise_open_file_limit();
  CLI::App app{"batchlm — run large batches of LLM calls: evals and data synthesis,\n"
               "against OpenAI-compatible APIs or the embedded engine."};
  app.name("batchlm");  // the usage line names the program even before argv is parsed
  app.footer(kExamples);
  app.set_version_flag("--version,-V", std::string("batchlm ") + BATCHLM_VERSION);
  app.require_subcommand(1);

  JobOptions run_opts;
  CLI::App* run = app.add_subcommand("run", "Run a job file (eval or synthesis)");
  run->add_option("job", run_opts.job_file, "Job file (YAML)")->required()->check(CLI::ExistingFile);
  add_job_options(*run, run_opts, false);
  run->footer(kExamples);

  JobOptions synth_opts;
  CLI::App* synth = app.add_subcommand(
      "synth", "Synthesize a dataset; with no job file, the built-in short-story recipe");
  synth->add_option("job", synth_opts.job_file, "Job file (YAML); default: built-in stories")
      ->check(CLI::ExistingFile);
  add_job_options(*synth, synth_opts, true);
  synth->footer(kExamples);
  app::add_engine_commands(app);
  app::add_serve_command(app);
  app::refuse_options_as_values(app);

  // No command at all: the usage, rather than an error about a missing subcommand.
  if (argc <= 1) {
    std::fputs(app.help().c_str(), stderr);
    return kExitUsage;
  }
  // `batchlm help` and `batchlm help COMMAND`, as other tools take them: read as --help.
  std::vector<char*> help_args;
  char help_flag[] = "--help";
  if (std::string_view(argv[1]) == "help" && argc <= 3) {
    help_args = {argv[0]};
    if (argc == 3) {
      const auto subs = app.get_subcommands({});
      if (std::none_of(subs.begin(), subs.end(), [&](const CLI::App* sub) { return sub->get_name() == argv[2]; })) {
        std::string commands;
        for (const CLI::App* sub : subs) commands += (commands.empty() ? "" : ", ") + sub->get_name();
        std::fprintf(stderr, "batchlm: error: unknown command '%s' (commands: %s)\n", argv[2], commands.c_str());
        return kExitUsage;
      }
      help_args.push_back(argv[2]);
    }
    help_args.push_back(help_flag);
    argc = static_cast<int>(help_args.size());
    argv = help_args.data();
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::string message = e.what();
    // A first word that is no command reads better named than as "a subcommand is required".
    if (argc > 1 && argv[1][0] != '-' && app.get_subcommands().empty()) {
      std::string commands;
      for (const CLI::App* sub : app.get_subcommands({})) commands += (commands.empty() ? "" : ", ") + sub->get_name();
      message = "unknown command '" + std::string(argv[1]) + "' (commands: " + commands + ")";
    }
    // An option given twice: said plainly, not as "At Most 1 required but received 2".
    if (const std::size_t at = message.find(": At Most 1 required but received "); at != std::string::npos)
      message = message.substr(0, at) + ": given " +
                message.substr(at + std::string_view(": At Most 1 required but received ").size()) +
                " times; give it once";
    // A mistyped option is the cause; what the parser made of the rest follows. Another command's
    // option is said alone: the parser's words about it would only mislead.
    bool only_elsewhere = false;
    if (const std::string hint = option_hint(app, argc, argv, only_elsewhere); !hint.empty())
      message = only_elsewhere ? hint : hint + "\n" + message;
    std::fprintf(stderr, "batchlm: error: %s\nRun with --help for more information.\n", message.c_str());
    return kExitUsage;
  }

  try {
    if (*run) return run_command(run_opts, false);
    if (*synth) return run_command(synth_opts, true);
    if (const int code = app::run_engine_command(); code >= 0) return code;
    if (const int code = app::run_serve_command(); code >= 0) return code;
  } catch (const OutputWriteError& e) {
    // Resuming could not rewrite the output (a full disk, the file size limit): nothing was
    // sent and the output is as it was; the same command resumes once there is room.
    std::fprintf(stderr,
                 "batchlm: error: %s; nothing was sent. Make room or fix the output, then run the same command "
                 "again\n",
                 e.what());
    return kExitSomeFailed;
  } catch (const std::bad_alloc&) {
    // Where the engine is made, its memory is what runs out: the weights, or the KV memory at
    // the context asked for (run and synth say which setting themselves).
    const bool serve = app.got_subcommand("serve"), generate = app.got_subcommand("generate");
    std::fprintf(stderr, "batchlm: error: out of memory%s%s\n", serve || generate ? " for the model and its KV cache" : "",
                 serve      ? "; a shorter --context or a smaller --kv-memory or --max-sequences needs less"
                 : generate ? "; a shorter --context needs less"
                            : "");
    return kExitUsage;
  } catch (const std::exception& e) {
    // ConfigError (file:line:field), OutputLockedError (the holder's pid), I/O errors naming
    // the path: the message says it all.
    std::fprintf(stderr, "batchlm: error: %s\n", e.what());
    return kExitUsage;
  }
  return kExitUsage;
}
