#pragma once
// The one path every item takes: Source -> Dispatcher -> Backend -> Scorer -> Writer, with
// Progress and the Summary watching. One coroutine per in-flight item on one Asio thread.

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/io_context.hpp>

#include "batchlm/core/backend.hpp"
#include "batchlm/runner/job.hpp"
#include "batchlm/runner/source.hpp"

namespace batchlm::runner {

// Documented exit codes of `batchlm run` / `batchlm synth`.
enum ExitCode : int {
  kExitOk = 0,           // every item succeeded
  kExitSomeFailed = 1,   // the run finished, some items failed (they are retried on rerun)
  kExitUsage = 2,        // bad configuration or usage: nothing was sent
  kExitInterrupted = 130,
};

// From now on SIGINT, SIGTERM and SIGHUP (those not ignored from the start) end the process at
// once with kExitInterrupted, after writing `line` (a string literal) to stderr: for the
// stretches where no run takes them (reading the job, its input and the model; after the run).
void exit_on_stop_signals(const char* line);

struct RunOptions {
  bool fresh = false;                   // ignore and replace earlier results
  std::FILE* progress_out = stderr;     // bar, plain lines and the summary
  std::optional<bool> tty;              // a bar redrawn in place; default: can_redraw(progress_out)
  // SIGINT, SIGTERM, SIGHUP: graceful stop; a second SIGINT or SIGTERM, or SIGQUIT: exit now
  // (whole records flushed); SIGPIPE ignored while the run lasts.
  bool install_signal_handlers = true;
};

struct RunResult {
  int exit_code = kExitOk;
  std::int64_t total = 0, succeeded = 0, failed = 0, resumed = 0, unfinished = 0;
  bool interrupted = false;
  std::string summary_path;  // empty when the summary could not be written
};

// Runs the job to the end (or to an interruption) on `io`, which must not be running already;
// it is run on the calling thread. Throws OutputLockedError / std::runtime_error for a
// failure to open the output.
RunResult run_job(const JobSpec& job, Source& source, Backend& backend, boost::asio::io_context& io,
                  const RunOptions& options);

// `--dry-run`: validates (already done by the caller), prints the first `show` requests that
// would be sent as their JSON bodies, and an estimate of the tokens of the whole job. Sends
// nothing. Items the output already holds finished are left out, as the run's resume skips them,
// and results in it made with other settings than the job's are refused as it refuses them
// (ConfigError saying what changed); neither with `fresh`. With `count_prompt_tokens` (the local
// model's tokenizer) prompts are counted exactly rather than estimated from their length, and
// with `context` those longer than it are counted: the run would fail them.
using PromptTokenCounter = std::function<std::int64_t(const Request&)>;
struct DryRunOptions {
  int show = 3;
  PromptTokenCounter count_prompt_tokens;
  std::int64_t context = 0;  // tokens (the embedded engine's, at most); 0: unknown
  bool fresh = false;
};
void dry_run(const JobSpec& job, Source& source, std::FILE* out, const DryRunOptions& options = {});

}  // namespace batchlm::runner
