// `batchlm serve`: the embedded engine behind an OpenAI-compatible HTTP API.

#include <signal.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>

#include "batchlm/kernels/ops.hpp"
#include "batchlm/local_engine/local_backend.hpp"
#include "batchlm/runner/ignored_signal.hpp"
#include "batchlm/runner/job.hpp"
#include "batchlm/server/server.hpp"
#include "cli_checks.hpp"
#include "engine_commands.hpp"

namespace batchlm::app {

namespace {

namespace asio = boost::asio;

struct ServeOptions {
  std::string model;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string served_name;
  std::string api_key;
  std::string allowed_origins = "*";
  int threads = 0;
  std::string device = "auto";
  long long context = 0;
  int max_sequences = 32;
  long long token_budget = 0;
  int block_size = 16;
  long long kv_tokens = 0;
  bool kv_recycle = false;
  bool kv_commit = true;
  std::string kv_memory;
  std::string body_memory;
  std::string step_log;
  std::string reasoning = "separate";
  int max_queue = 256;
  double shutdown_grace = 30;
  double write_timeout = 30;
  double request_timeout = 60;
  runner::BackendSpec::Speculative spec;
};

ServeOptions s;
CLI::App* serve_cmd = nullptr;

// --allowed-origins: "none" is none, else each origin of the comma-separated list ("*": any).
// Throws naming an entry a browser could never send as its Origin.
std::vector<std::string> parse_allowed_origins(const std::string& list) {
  if (list == "none") return {};
  std::vector<std::string> origins;
  std::size_t at = 0;
  for (;;) {
    const std::size_t comma = list.find(',', at);
    std::string origin = list.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    origin.erase(0, origin.find_first_not_of(' '));
    origin.erase(origin.find_last_not_of(' ') + 1);
    const std::size_t scheme_end = origin.find("://");
    if (origin != "*" && (scheme_end == std::string::npos || scheme_end == 0 ||
                          origin.size() == scheme_end + 3 || origin.find('/', scheme_end + 3) != std::string::npos))
      throw std::runtime_error("--allowed-origins: '" + origin +
                               "' is not an origin: expected scheme://host[:port] as browsers send it (no path, "
                               "no trailing '/'), * for any, or none");
    origins.push_back(std::move(origin));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return origins;
}


constexpr const char* kServeExamples = R"(Examples:
  batchlm serve                                   # the default model on 127.0.0.1:8000
  batchlm serve --model M.gguf --port 8080 --max-sequences 64
  batchlm serve --speculative ngram               # draft from the prompt: faster copying
  batchlm serve --api-key secret                  # clients send "Authorization: Bearer secret"
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
  batchlm run jobs/gsm8k.yaml --base-url http://127.0.0.1:8000/v1 --model NAME

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming with "stream": true),
GET /v1/models, GET /health, GET /metrics (Prometheus). SIGINT/SIGTERM/SIGHUP: stop accepting, finish requests in flight
(up to --shutdown-grace seconds), exit 0; a second SIGINT or SIGTERM cancels what is left. A signal ignored when
the server started stays ignored, as nohup wants (a script's `batchlm serve &` starts with SIGINT ignored: stop it
with SIGTERM).
)";

}  // namespace

void add_serve_command(CLI::App& app) {
  serve_cmd = app.add_subcommand("serve", "Serve a GGUF model over an OpenAI-compatible HTTP API");
  serve_cmd->add_option("--model,-m", s.model, "GGUF file (default: $BATCHLM_MODEL or the default model)");
  serve_cmd->add_option("--host", s.host, "Address to listen on")->capture_default_str();
  serve_cmd->add_option("--port,-p", s.port, "Port (0: any free port)")->check(app::between(0, 65535))->capture_default_str();
  serve_cmd->add_option("--served-model-name", s.served_name,
                        "Model id in /v1/models and responses (default: the model's name)");
  serve_cmd->add_option("--api-key", s.api_key,
                        "Require 'Authorization: Bearer KEY' on /v1/* (default: $BATCHLM_API_KEY, else none)");
  serve_cmd->add_option("--allowed-origins", s.allowed_origins,
                        "Origins whose web pages may call the API from a browser (CORS), comma-separated "
                        "(http://localhost:3000,https://app.example.com); * for any, none for no CORS headers")
      ->capture_default_str();
  serve_cmd->add_option("--threads,-t", s.threads, "Compute threads (0: one per hardware thread)")
      ->check(app::between(0, 1024));
  serve_cmd->add_option("--device", s.device,
                        "Where the model runs: auto (CUDA when a GPU can run the model), cuda or cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}))->capture_default_str();
  serve_cmd->add_option("--context", s.context, "Tokens per sequence (0: min(model's, 4096))")
      ->check(app::at_least(0));
  serve_cmd->add_option("--max-sequences", s.max_sequences, "Sequences decoded together")
      ->check(app::between(1, 512))->capture_default_str();
  serve_cmd->add_option("--token-budget", s.token_budget,
                        "Tokens per batched forward pass (0: 512); at least --max-sequences")
      ->check(app::between(0, 512));
  serve_cmd->add_option("--block-size", s.block_size, "Tokens per KV block")
      ->check(app::between(1, 256))->capture_default_str();
  serve_cmd->add_option("--kv-tokens", s.kv_tokens, "KV pool size in tokens (default: from free memory)")
      ->check(app::at_least(0));
  serve_cmd->add_option("--kv-memory", s.kv_memory, "KV pool size in bytes, e.g. 2GiB (default: from free memory)");
  serve_cmd->add_option("--max-body-memory", s.body_memory,
                        "Request bodies held at once over all clients, e.g. 256MiB (the default); a request whose body "
                        "would go past it gets 503 with Retry-After. One body is at most 8 MiB");
  serve_cmd->add_flag("--kv-recycle", s.kv_recycle,
                      "Reuse the KV blocks of finished requests that nothing shared before taking pool memory "
                      "never used (the prefix cache then forgets unshared prompts sooner)");
  serve_cmd->add_flag_callback("--no-kv-commit", [] { s.kv_commit = false; },
                      "Leave the KV pool's pages to be mapped as the cache first grows into them; by default "
                      "the whole pool is written once at start-up, so requests never wait for the system to "
                      "map fresh memory");
  serve_cmd->add_option("--step-log", s.step_log,
                        "Append one JSON line per engine step to this file: time, sequences, decode and prompt "
                        "tokens, forward and step milliseconds");
  serve_cmd->add_option("--reasoning", s.reasoning,
                        "separate: a chat answer's opening <think> block goes out as the message's "
                        "reasoning_content, apart from its content; inline: it stays at the head of the content")
      ->check(CLI::IsMember({"separate", "inline"}))->capture_default_str();
  serve_cmd->add_option("--max-queue", s.max_queue,
                        "Choices waiting beyond --max-sequences before new requests get 429 (a request with n choices counts n)")
      ->check(app::between(0, 1 << 20))->capture_default_str();
  serve_cmd->add_option("--shutdown-grace", s.shutdown_grace,
                        "Seconds requests in flight get to finish after SIGINT, SIGTERM or SIGHUP")
      ->check(app::between(0, 86400, false))->capture_default_str();
  serve_cmd->add_option("--write-timeout", s.write_timeout,
                        "Seconds a write to a client may make no progress (a client that stopped reading) "
                        "before its connection is closed and its request cancelled")
      ->check(app::between(0.001, 86400, false))->capture_default_str();
  serve_cmd->add_option("--request-timeout", s.request_timeout,
                        "Seconds a client has to send a whole request from its first byte (a client trickling "
                        "it byte by byte is answered 408 then, and the connection closed)")
      ->check(app::between(0.001, 86400, false))->capture_default_str();
  serve_cmd->add_option("--speculative", s.spec.method,
                        "Speculative decoding: none, ngram (look up the prompt and output), self "
                        "(the model's first layers draft) or draft (--draft-model drafts)")
      ->check(CLI::IsMember({"none", "ngram", "self", "draft"}))->capture_default_str();
  serve_cmd->add_option("--draft-model", s.spec.model, "GGUF with the model's vocabulary (--speculative draft)");
  serve_cmd->add_option("--spec-layers", s.spec.layers, "Layers that draft with --speculative self (0: a quarter)")
      ->check(app::between(0, 1024));
  serve_cmd->add_option("--spec-k-max", s.spec.k_max, "Most tokens drafted per sequence and step")
      ->check(app::between(1, 16))->capture_default_str();
  serve_cmd->add_option("--spec-k-min", s.spec.k_min, "Fewest while a sequence drafts (0 lets it stop)")
      ->check(app::between(0, 16))->capture_default_str();
  serve_cmd->add_option("--ngram-max", s.spec.ngram_max, "Longest n-gram looked up (--speculative ngram)")
      ->check(app::between(1, 64))->capture_default_str();
  serve_cmd->add_option("--ngram-min", s.spec.ngram_min, "Shortest n-gram looked up (--speculative ngram)")
      ->check(app::between(1, 64))->capture_default_str();
  serve_cmd->footer(kServeExamples);
}

int run_serve_command() {
  if (serve_cmd == nullptr || !*serve_cmd) return -1;
  // An option given empty is a slip, not a choice: `--api-key "$KEY"` with KEY unset would
  // serve without authentication, `--model "$M"` would serve the default model.
  for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--model", &s.model},
                                    {"--api-key", &s.api_key},
                                    {"--served-model-name", &s.served_name},
                                    {"--host", &s.host},
                                    {"--draft-model", &s.spec.model},
                                    {"--step-log", &s.step_log},
                                    {"--kv-memory", &s.kv_memory},
                                    {"--max-body-memory", &s.body_memory}}) {
    if (serve_cmd->count(flag) > 0 && value->empty())
      throw std::runtime_error(std::string(flag) + ": empty; give a value, or leave the option out for its default");
  }
  if (s.model.empty()) s.model = default_model();
  if (const std::string problem = model_file_problem(s.model, "pass --model"); !problem.empty())
    throw std::runtime_error(problem);
  if (s.api_key.empty()) {
    if (const char* env = std::getenv("BATCHLM_API_KEY"); env != nullptr) s.api_key = env;  // empty: none
  }
  const std::vector<std::string> allowed_origins = parse_allowed_origins(s.allowed_origins);
  local_engine::LocalBackendOptions engine;
  engine.model = s.model;
  engine.threads = app::usable_threads(s.threads);
  engine.device = local_engine::parse_device(s.device).value_or(local_engine::Device::kAuto);
  engine.context = s.context;
  engine.max_sequences = s.max_sequences;
  engine.token_budget = s.token_budget;
  engine.block_size = s.block_size;
  engine.kv_tokens = s.kv_tokens;
  engine.kv_recycle = s.kv_recycle;
  engine.kv_commit = s.kv_commit;
  engine.step_log = s.step_log;
  engine.split_reasoning = s.reasoning == "separate";
  if (!s.kv_memory.empty()) {
    const auto bytes = runner::parse_byte_size(s.kv_memory);
    if (!bytes) throw std::runtime_error("--kv-memory: expected a size such as 2GiB or 512MiB, got '" + s.kv_memory + "'");
    engine.kv_bytes = *bytes;
  }
  std::optional<std::size_t> body_memory;
  if (!s.body_memory.empty()) {
    body_memory = runner::parse_byte_size(s.body_memory);
    if (!body_memory)
      throw std::runtime_error("--max-body-memory: expected a size such as 256MiB or 1GiB, got '" + s.body_memory + "'");
    // Below one body's limit, the largest requests would be refused however long they waited.
    if (*body_memory < server::ServerOptions{}.max_body_bytes)
      throw std::runtime_error("--max-body-memory: " + s.body_memory + " is less than one request body may be (8MiB)");
  }
  try {
    engine.speculative = speculative_options(s.spec);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("--draft-model: ") + e.what());
  }

  asio::io_context io(1);
  std::unique_ptr<local_engine::LocalBackend> backend;
  try {
    backend = std::make_unique<local_engine::LocalBackend>(io.get_executor(), engine);
  } catch (const local_engine::StepLogUnwritable& e) {
    throw std::runtime_error("--step-log: " + e.detail);
  } catch (const local_engine::DraftModelUnusable& e) {
    throw std::runtime_error(std::string("--draft-model: ") + e.what());
  } catch (const std::invalid_argument& e) {
    std::string what = e.what();
    // The engine names its own fields; the flags that set them read better.
    for (const auto& [field, flag] : {std::pair<std::string, std::string>{"kv_bytes ", "--kv-memory "},
                                      {"kv_tokens ", "--kv-tokens "}})
      if (what.starts_with(field)) what = flag + what.substr(field.size());
    throw std::runtime_error(std::string("serve: ") + what);
  }
  server::ServerOptions options;
  options.host = s.host;
  options.port = static_cast<unsigned short>(s.port);
  options.model_name = s.served_name.empty() ? backend->model_name() : s.served_name;
  options.context = backend->context();
  options.prompt_bytes_limit = backend->prompt_bytes_limit();
  options.api_key = s.api_key;
  options.allowed_origins = allowed_origins;
  options.max_in_flight = s.max_sequences + s.max_queue;
  options.shutdown_grace = std::chrono::milliseconds(static_cast<long long>(s.shutdown_grace * 1000));
  options.write_timeout = std::chrono::milliseconds(static_cast<long long>(s.write_timeout * 1000));
  options.request_timeout = std::chrono::milliseconds(static_cast<long long>(s.request_timeout * 1000));
  if (body_memory) options.max_held_body_bytes = *body_memory;
  server::Server http(io, *backend, options);
  http.start();

  // SIGHUP (the terminal closed) shuts down like SIGTERM, unless it was ignored from the start
  // (`nohup`); so are the others. A closing terminal may send SIGHUP more than once, so only a
  // second SIGINT or SIGTERM cancels what is left.
  asio::signal_set signals(io);
  for (int signo : {SIGINT, SIGTERM, SIGHUP})
    if (!runner::ignored_at_start(signo)) signals.add(signo);
  // A closed stdout or stderr pipe costs the lines written to it, not the requests in flight.
  std::signal(SIGPIPE, SIG_IGN);
  bool stopping = false;
  std::function<void(const boost::system::error_code&, int)> on_signal =
      [&](const boost::system::error_code& ec, int signal) {
        if (ec) return;
        signals.async_wait(on_signal);  // before shutdown(), whose `done` may cancel it at once
        if (!stopping) {
          stopping = true;
          const auto in_flight = static_cast<long long>(http.in_flight());
          std::fprintf(stderr, "batchlm serve: %s: finishing %lld choice%s in flight, then exiting\n",
                       signal == SIGINT ? "SIGINT" : signal == SIGTERM ? "SIGTERM" : "SIGHUP", in_flight,
                       in_flight == 1 ? "" : "s");
          http.shutdown([&] { signals.cancel(); });
        } else if (signal != SIGHUP) {
          std::fprintf(stderr, "batchlm serve: second signal: cancelling what is left\n");
          http.shutdown();
        }
      };
  signals.async_wait(on_signal);

  const std::string host = s.host.find(':') != std::string::npos ? "[" + s.host + "]" : s.host;
  // Whether clients need a key is said at start: a key meant but not set shows here.
  std::printf("batchlm serve: listening on http://%s:%u/v1 (model %s, %s; %s)\n", host.c_str(),
              static_cast<unsigned>(http.port()), options.model_name.c_str(), backend->describe().c_str(),
              options.api_key.empty() ? "no API key" : "API key required");
  std::fflush(stdout);
  io.run();
  if (const std::int64_t cancelled = http.aborted(); cancelled > 0)
    std::fprintf(stderr, "batchlm serve: %lld requests still running were cancelled (answered 503 / an error event)\n",
                 static_cast<long long>(cancelled));
  std::fprintf(stderr, "batchlm serve: stopped\n");
  return 0;
}

}  // namespace batchlm::app
